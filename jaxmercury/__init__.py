"""jaxmercury: distributed tensor operators from CommIR schedules, in JAX."""

from jaxmercury.dsl import Axis, Buffer, grid, match_buffer
from jaxmercury.errors import PreconditionError, ScheduleError, TraceError, UnknownNameError
from jaxmercury.program import BlockContext, Program
from jaxmercury.reductions import LogSumExp, Reduction, Sum
from jaxmercury import programs, schedules
from jaxmercury.schedules import Schedule, library

__all__ = [
    "Axis", "Buffer", "BlockContext", "LogSumExp", "PreconditionError", "Program",
    "Reduction", "Schedule", "ScheduleError", "Sum", "TraceError", "UnknownNameError", "grid",
    "library", "match_buffer", "programs", "schedules",
]
