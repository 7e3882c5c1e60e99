"""The backward of a fused GEMM: the other placement's fused kernel, fed by the forward's own residuals.

The two fused GEMM placements over a mesh level L are each other's
transposes. For an all-gather GEMM ``C[m, n@L] = A[m@L, k] B[k, n@L]``:

  dA[m@L, k] = dC[m, n@L] B^T[n@L, k]    a GEMM + reduce-scatter over L
  dB[k, n@L] = A^T[k, m] dC[m, n@L]       local, on the gathered A

and for a GEMM + reduce-scatter ``C[m@L, n] = A[m, k@L] B[k@L, n]``:

  dA[m, k@L] = dC[m@L, n] B^T[n, k@L]     an all-gather GEMM over L
  dB[k@L, n] = A^T[k@L, m] dC[m, n]       local, on the gathered dC

So each backward is one fused kernel of the other kind (the forward kernel's ``DualGemm.dual``) and one
local GEMM on the operand that kernel's ring gathered: an all-gather kernel
returns the rows its ring brought (``gathered=True``), so the forward's A and
the backward's dC are never sent again. Before, a fused GEMM was
differentiated through its ordinary ``shard_map`` lowering, which ran that
lowering's collectives again, exposed, before their transposes.
Where the dual kernel cannot run on the mesh's devices, XLA's collectives
stand in (``psum_scatter``, ``all_gather``); a kernel that keeps no gathered
rows (``DualGemm.keeps_rows`` False: JAX's) has its backward gather A.

The rule is a ``jax.custom_vjp`` on the per-device function, inside the
plan's ``shard_map``: JAX differentiates the padding and layouts around it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxmercury.analysis import placements
from jaxmercury.kernels.placements import ALLGATHER
from jaxmercury.lowering.lower import lower


def _dual_block(schedule):
  """The dual kernel's per-device function at its default configuration, or None (``placements.dual_kernel``)."""
  dual = placements.dual_kernel(schedule)
  if dual is None:
    return None
  p = placements.of(schedule)
  return dual.make(p, dual.configure(), dual.interpret and placements.interprets(dual, schedule))


def _dot(x, y, dtype):
  return jnp.dot(x, y, preferred_element_type=jnp.float32).astype(dtype)


def differentiable_block(schedule, per_device):
  """``per_device`` (the fused kernel on one device's blocks ``(a, b) -> c``) with the dual backward.

  Args:
    schedule: the fused GEMM schedule (``placement`` of kind all-gather or reduce-scatter).
    per_device: its lowering's per-device function.
  """
  p = placements.of(schedule)
  level, dual = p.level, _dual_block(schedule)

  @jax.custom_vjp
  def block(a, b):
    return per_device(a, b)

  if p.kind == ALLGATHER:
    def fwd(a, b):
      c, a_full = per_device(a, b, gathered=True)
      return c, (a if a_full is None else a_full, b)

    def bwd(residuals, dc):
      a_kept, b = residuals
      dc = dc.astype(p.c.dtype)
      regather = a_kept.shape[0] != dc.shape[0]  # the kernel kept only this device's rows (keeps_rows False)
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
  return jax.jit(lower(schedule, jit=False, per_device=differentiable_block(schedule, per_device)))
