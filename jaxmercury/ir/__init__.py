"""The IR: named axes, buffers, programs (CommIR loop nests), reductions, loops and storage orders."""

from jaxmercury.ir.dsl import Axis, Buffer, grid, match_buffer
from jaxmercury.ir.program import BlockContext, Program
from jaxmercury.ir.reductions import LogSumExp, Reduction, Sum
from jaxmercury.ir.routing import Routing

__all__ = ["Axis", "BlockContext", "Buffer", "LogSumExp", "Program", "Reduction", "Routing", "Sum", "grid",
           "match_buffer"]
