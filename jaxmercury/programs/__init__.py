"""Operators shipped with jaxmercury, declared with the DSL."""

from jaxmercury.programs.attention import attention
from jaxmercury.programs.masks import AttentionMask, attention_mask, mask_reason
from jaxmercury.programs.matmul import matmul
from jaxmercury.programs.moe import moe
from jaxmercury.programs.operator import DTYPE, Operator, Param
from jaxmercury.programs.registry import find_operator, operators, register_operator
from jaxmercury.programs.weighted_sum import weighted_sum

__all__ = ["DTYPE", "AttentionMask", "Operator", "Param", "attention", "attention_mask", "find_operator", "mask_reason",
           "matmul", "moe", "operators", "register_operator", "weighted_sum"]
