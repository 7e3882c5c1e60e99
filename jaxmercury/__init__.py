"""jaxmercury: distributed tensor operators from CommIR schedules, in JAX."""

__version__ = "0.1.0"

from jaxmercury.dsl import Axis, Buffer, grid, match_buffer
from jaxmercury.errors import PreconditionError, ScheduleError, TraceError, UnknownNameError
from jaxmercury.program import BlockContext, Program
from jaxmercury.reductions import LogSumExp, Reduction, Sum
from jaxmercury import ops, programs, schedules, tuner
from jaxmercury.schedules import Schedule, library
from jaxmercury.tuner import Database, autotune

__all__ = [
    "Axis", "Buffer", "BlockContext", "Database", "autotune", "LogSumExp", "PreconditionError", "Program",
    "Reduction", "Schedule", "ScheduleError", "Sum", "TraceError", "UnknownNameError", "grid",
    "library", "match_buffer", "ops", "programs", "schedules", "tuner",
]
