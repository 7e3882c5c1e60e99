"""The Mercury paper's running example: C[i] += A[i, j] * B[j]."""

import jax.numpy as jnp
import numpy as np

from jaxmercury.ir.dsl import Axis, grid, match_buffer
from jaxmercury.ir.reductions import Sum
from jaxmercury.programs.operator import DTYPE, Operator, Param


def _weighted_sum_body(ctx, a, b):
  del ctx
  return jnp.einsum("ij,j->i", a, b, preferred_element_type=jnp.float32)


def weighted_sum(i: int, j: int, dtype=jnp.float32):
  """Inputs A[i, j], B[j]; output C[i] = sum_j A[i, j] * B[j]."""
  ai, aj = Axis("i", i), Axis("j", j)
  a = match_buffer("A", (ai, aj), dtype)
  b = match_buffer("B", (aj,), dtype)
  c = match_buffer("C", (ai,), dtype)
  return grid((ai, aj), "sr", reads=(a, b), writes=c, body=_weighted_sum_body,
              reduction=Sum(), name="weighted_sum", pattern="weighted_sum",
              statement="C[i] += A[i, j] * B[j]", params=dict(i=i, j=j, dtype=str(np.dtype(dtype))))


OPERATOR = Operator(name="weighted_sum", summary="the Mercury paper's running example, C[i] = A[i, :] . B",
                    build=weighted_sum, params=(
                        Param(name="i", default=512, minimum=1, help="rows of A, length of C"),
                        Param(name="j", default=512, minimum=1, help="the reduction length"),
                        DTYPE))
