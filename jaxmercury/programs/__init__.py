"""Operators shipped with jaxmercury, declared with the DSL."""

from jaxmercury.programs.attention import attention
from jaxmercury.programs.masks import AttentionMask, attention_mask, mask_reason
from jaxmercury.programs.matmul import matmul
from jaxmercury.programs.moe import moe
from jaxmercury.programs.weighted_sum import weighted_sum

__all__ = ["AttentionMask", "attention", "attention_mask", "mask_reason", "matmul", "moe", "weighted_sum"]
