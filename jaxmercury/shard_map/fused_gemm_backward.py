"""The backward of a fused GEMM: the other placement's fused kernel, fed by the forward's own residuals.

The two fused GEMM placements over a mesh level L are each other's
transposes. For an all-gather GEMM ``C[m, n@L] = A[m@L, k] B[k, n@L]``:

  dA[m@L, k] = dC[m, n@L] B^T[n@L, k]    a GEMM + reduce-scatter over L
  dB[k, n@L] = A^T[k, m] dC[m, n@L]       local, on the gathered A

and for a GEMM + reduce-scatter ``C[m@L, n] = A[m, k@L] B[k@L, n]``:

  dA[m, k@L] = dC[m@L, n] B^T[n, k@L]     an all-gather GEMM over L
  dB[k@L, n] = A^T[k@L, m] dC[m, n]       local, on the gathered dC

So each backward is one fused kernel of the other kind (``DUALS``) and one
local GEMM on the operand that kernel's ring gathered: an all-gather kernel
returns the rows its ring brought (``gathered=True``), so the forward's A and
the backward's dC are never sent again. Before, a fused GEMM was
differentiated through its ordinary ``shard_map`` lowering, which ran that
lowering's collectives again, exposed, before their transposes.
Where the dual kernel cannot run on the mesh's devices, XLA's collectives
stand in (``psum_scatter``, ``all_gather``); JAX's all-gather kernel keeps no
gathered rows, so its backward gathers A.

The rule is a ``jax.custom_vjp`` on the per-device function, inside the
plan's ``shard_map``: JAX differentiates the padding and layouts around it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxmercury.shard_map import fused, fused_gemm

# Per fused GEMM lowering, the lowering of the other kind that runs its backward's collective GEMM.
DUALS = {"fused_allgather_matmul": "fused_matmul_reducescatter",
         "fused_allgather_matmul_comm": "fused_matmul_reducescatter",
         "fused_allgather_matmul_ws": "fused_matmul_reducescatter_ws",
         "jax_allgather_lhs_matmul": "fused_matmul_reducescatter_ws",
         "fused_matmul_reducescatter": "fused_allgather_matmul",
         "fused_matmul_reducescatter_ws": "fused_allgather_matmul_ws"}
REGATHERS = {"jax_allgather_lhs_matmul"}  # all-gather kernels that keep no gathered rows: the backward gathers A


def dual_lowering(schedule) -> fused.FusedLowering | None:
  """The fused lowering that runs the backward's collective GEMM of ``schedule`` (a fused GEMM), or None where
  its kernel cannot run on the mesh's devices (XLA's collectives then)."""
  low = fused.lowering(schedule.lowering)
  dual = fused.lowering(DUALS[low.name])
  return dual if dual.device_problem(schedule, low.place(schedule)) is None else None


def _dual_block(schedule):
  """The dual lowering's per-device function at its default parameters, or None (``dual_lowering``)."""
  dual = dual_lowering(schedule)
  if dual is None:
    return None
  p = fused.lowering(schedule.lowering).place(schedule)
  return dual.make(p, dual.params(), dual.interpret and fused.interprets_on(schedule, p))


def _dot(x, y, dtype):
  return jnp.dot(x, y, preferred_element_type=jnp.float32).astype(dtype)


def differentiable_block(schedule, per_device):
  """``per_device`` (the fused kernel on one device's blocks ``(a, b) -> c``) with the dual backward.

  Args:
    schedule: the fused GEMM schedule (``placement`` of kind all-gather or reduce-scatter).
    per_device: its lowering's per-device function.
  """
  p = fused.lowering(schedule.lowering).place(schedule)
  level, dual = p.level, _dual_block(schedule)

  @jax.custom_vjp
  def block(a, b):
    return per_device(a, b)

  if p.kind == fused_gemm.ALLGATHER:
    def fwd(a, b):
      c, a_full = per_device(a, b, gathered=True)
      return c, (a if a_full is None else a_full, b)

    def bwd(residuals, dc):
      a_kept, b = residuals
      dc = dc.astype(p.c.dtype)
      regather = a_kept.shape[0] != dc.shape[0]  # the kernel kept only this device's rows (REGATHERS)
      a_full = lax.all_gather(a_kept, level, axis=0, tiled=True) if regather else a_kept
      if dual is not None:
        da = dual(dc, b.T)
      else:
        da = lax.psum_scatter(_dot(dc, b.T, jnp.float32), level, scatter_dimension=0, tiled=True)
      return da.astype(a_full.dtype), _dot(a_full.T, dc, b.dtype)
  else:
    def fwd(a, b):
      return per_device(a, b), (a, b)

    def bwd(residuals, dc):
      a, b = residuals
      dc = dc.astype(p.c.dtype)
      if dual is not None:
        da, dc_full = dual(dc, b.T, gathered=True)
        if dc_full is None:
          dc_full = lax.all_gather(dc, level, axis=0, tiled=True)
      else:
        dc_full = lax.all_gather(dc, level, axis=0, tiled=True)
        da = _dot(dc_full, b.T, a.dtype)
      return da.astype(a.dtype), _dot(a.T, dc_full, b.dtype)

  block.defvjp(fwd, bwd)
  return block


def attach(schedule, per_device):
  """``f(*inputs)``, jitted: the fused GEMM under the plan's ``shard_map`` with the dual backward."""
  from jaxmercury.shard_map.lower import lower
  return jax.jit(lower(schedule, jit=False, per_device=differentiable_block(schedule, per_device)))


BACKWARD = fused.OwnBackward(None, attach, "the dual fused GEMM, fed by the forward's gathered rows")
fused.BACKWARDS.update({fused_gemm.ALLGATHER: BACKWARD, fused_gemm.REDUCESCATTER: BACKWARD})
