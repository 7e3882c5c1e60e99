"""jaxmercury: distributed tensor operators from CommIR schedules, in JAX."""

__version__ = "0.1.0"

from jaxmercury.dsl import Axis, Buffer, grid, match_buffer
from jaxmercury.errors import (InputError, LayoutError, MeshError, PreconditionError, ProgramError, ScheduleError,
                               TraceError, UnknownLevelError, UnknownNameError)
from jaxmercury.program import BlockContext, Program
from jaxmercury.reductions import LogSumExp, Reduction, Sum
from jaxmercury import ops, programs, schedules, tuner, validate
from jaxmercury.schedules import Schedule, library
from jaxmercury.tuner import Database, autotune
from jaxmercury.flax import distribute
from jaxmercury import graph

__all__ = [
    "Axis", "Buffer", "BlockContext", "Database", "autotune", "InputError", "LayoutError", "LogSumExp", "MeshError",
    "PreconditionError", "Program", "ProgramError", "Reduction", "Schedule", "ScheduleError", "Sum", "TraceError",
    "UnknownLevelError", "UnknownNameError", "grid", "library", "match_buffer", "ops", "programs", "schedules",
    "tuner", "validate", "distribute", "graph",
]
