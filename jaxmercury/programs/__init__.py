"""Operators shipped with jaxmercury, declared with the DSL."""

from jaxmercury.programs.attention import attention
from jaxmercury.programs.matmul import matmul
from jaxmercury.programs.moe import moe
from jaxmercury.programs.weighted_sum import weighted_sum

__all__ = ["attention", "matmul", "moe", "weighted_sum"]
