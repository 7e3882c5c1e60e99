"""jaxmercury: distributed tensor operators from CommIR schedules, in JAX."""

from jaxmercury import graph, kernels, lowering, ops, programs, schedules, tuner  # noqa: F401  (lowering: Schedule.compile's)
from jaxmercury._version import __version__
from jaxmercury.errors import (
                               InputError,
                               LayoutError,
                               MaskError,
                               MeshError,
                               PreconditionError,
                               ProgramError,
                               ScheduleError,
                               TraceError,
                               UnknownLevelError,
                               UnknownNameError,
)
from jaxmercury.flax import distribute, explain
from jaxmercury.ir import Axis, BlockContext, Buffer, LogSumExp, Program, Reduction, Sum, grid, match_buffer
from jaxmercury.schedules import Schedule, library, validate
from jaxmercury.tuner import Database, TuneConfig, TuneInterrupted, autotune

__all__ = [
    "Axis", "Buffer", "BlockContext", "Database", "TuneConfig", "TuneInterrupted", "autotune", "InputError",
    "LayoutError", "LogSumExp", "MeshError",
    "PreconditionError", "Program", "ProgramError", "Reduction", "Schedule", "ScheduleError", "Sum", "TraceError",
    "UnknownLevelError", "UnknownNameError", "grid", "library", "match_buffer", "ops", "programs", "schedules",
    "tuner", "validate", "distribute", "explain", "graph", "kernels", "__version__", "MaskError",
]
