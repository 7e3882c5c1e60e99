"""GEMM: C[m, n] += A[m, k] * B[k, n]."""

import jax.numpy as jnp
import numpy as np

from jaxmercury.dsl import Axis, grid, match_buffer
from jaxmercury.reductions import Sum


def _matmul_body(ctx, a, b):
  del ctx  # zero padding of k contributes nothing to the sum
  return jnp.dot(a, b, preferred_element_type=jnp.float32)


def matmul(m: int, n: int, k: int, dtype=jnp.float32):
  """The GEMM program: inputs A[m, k], B[k, n]; output C[m, n].

  Loop nest: ``for m, n (spatial), k (reduction): C[m, n] += A[m, k] * B[k, n]``.
  """
  am, an, ak = Axis("m", m), Axis("n", n), Axis("k", k)
  a = match_buffer("A", (am, ak), dtype)
  b = match_buffer("B", (ak, an), dtype)
  c = match_buffer("C", (am, an), dtype)
  return grid((am, an, ak), "ssr", reads=(a, b), writes=c, body=_matmul_body,
              reduction=Sum(), name="matmul", pattern="matmul",
              statement="C[m, n] += A[m, k] * B[k, n]",
              params=dict(m=m, n=n, k=k, dtype=str(np.dtype(dtype))))
