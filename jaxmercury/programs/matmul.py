"""GEMM: C[m, n] += A[m, k] * B[k, n]."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxmercury.ir.dsl import Axis, grid, match_buffer
from jaxmercury.ir.reductions import Sum
from jaxmercury.programs.operator import DTYPE, Operator, Param


@jax.custom_vjp
def _dot_f32(a, b):
  """``a @ b`` accumulated in float32, whose gradients are GEMMs in the inputs' own dtype.

  JAX's own transpose of ``dot(preferred_element_type=float32)`` multiplies
  the float32 cotangent by the bf16 operand upcast to float32: a float32
  (TF32 on Hopper) GEMM at half the bf16 rate, plus the upcasts. Here the
  cotangent is rounded to the inputs' dtype first, as in ordinary
  mixed-precision training, and both gradient GEMMs accumulate in float32.
  """
  return jnp.dot(a, b, preferred_element_type=jnp.float32)


def _dot_f32_fwd(a, b):
  return _dot_f32(a, b), (a, b)


def _dot_f32_bwd(residuals, g):
  a, b = residuals
  da = jnp.dot(g.astype(b.dtype), b.T, preferred_element_type=jnp.float32).astype(a.dtype)
  db = jnp.dot(a.T, g.astype(a.dtype), preferred_element_type=jnp.float32).astype(b.dtype)
  return da, db


_dot_f32.defvjp(_dot_f32_fwd, _dot_f32_bwd)


def _matmul_body(ctx, a, b):
  del ctx  # zero padding of k contributes nothing to the sum
  return _dot_f32(a, b)


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


OPERATOR = Operator(name="matmul", summary="a GEMM, C = A @ B", build=matmul, params=(
    Param(name="m", default=512, minimum=1, help="rows of A and C"),
    Param(name="n", default=256, minimum=1, help="columns of B and C"),
    Param(name="k", default=512, minimum=1, help="the reduction length"),
    DTYPE))
