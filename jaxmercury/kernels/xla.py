"""``xla``: the program's own body, compiled by XLA; for attention, its backward too.

Every program runs on it. For attention its backward runs the dual programs'
own bodies, both in one call per block pair (``dq_dkv_block``), or, where a
schedule keeps each device's attention whole and its scores fit
``SCORES_BYTES``, JAX's derivative of the whole attention.
"""

from __future__ import annotations

import functools
import math

import jax

from jaxmercury.kernels.registry import AttentionBackward, Kernel
from jaxmercury.programs.attention_backward import dq_dkv_block
from jaxmercury.programs.masks import KINDS, mask_of

SCORES_BYTES = 4 << 30  # the float32 scores the whole-attention backward may hold per device


def _joint(dq_program):
  return functools.partial(dq_dkv_block, mask=mask_of(dq_program.params))


def _whole(q, k, v, o, do, lse, causal):
  del o, lse  # recomputed
  f = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")
  _, vjp = jax.vjp(f, q, k, v)
  return vjp(do.astype(q.dtype))


def _whole_limit(program, extents) -> str | None:
  """Where JAX's derivative would hold more float32 scores per device than ``SCORES_BYTES``."""
  scores = 4 * math.prod(extents[a] for a in ("b", "hk", "g", "i", "j"))
  if scores > SCORES_BYTES:
    return (f"XLA's derivative would hold {scores} bytes of scores per device (over {SCORES_BYTES}); the dual "
            "programs recompute them block by block")
  return None


XLA = Kernel(name="xla", patterns=frozenset({"*"}), make=None, masks=frozenset(KINDS),
             backward=AttentionBackward(joint=_joint, whole=_whole, whole_limit=_whole_limit),
             description="the program's own body, compiled by XLA")
