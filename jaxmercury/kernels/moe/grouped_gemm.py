"""The grouped expert GEMM through Pallas Mosaic GPU kernels (Hopper, bf16/fp16): ``mosaic_grouped_gemm``.

A dispatched mixture-of-experts schedule (``Schedule.dispatch(gemm=...)``)
computes the rows it received grouped by local expert: rows sorted by group,
``group_sizes [e]`` int32, ``out[rows of group g] = x[rows of g] @ w[g]``
(``x [m, k]``, ``w [e, k, n]``, rows past ``sum(group_sizes)`` give 0), as
``jax.lax.ragged_dot`` does. This kernel is a thin wrapper of JAX's own
Hopper kernels, used as dependencies:

- forward ``x @ w[g]``: ``ragged_dot_mgpu.ragged_dot``, a persistent kernel
  (one CTA per SM) walking the (row tile, column tile) pairs of every group;
  a row tile that straddles two groups is computed once per group and each
  stores only its own rows;
- ``dx = dy @ w[g]^T``: the same kernel with ``transpose_rhs=True`` (w is
  read transposed in shared memory, never transposed in HBM);
- ``dw[g] = x_g^T @ dy_g``: ``transposed_ragged_dot_mgpu``, which contracts
  over each group's rows (masking the rows of the neighbouring groups in the
  tiles at its ends); an empty group's ``dw`` is 0.

Why theirs and not a kernel of ours: they already handle the ragged tile
boundaries and the persistent schedule; what they lack is what the wrapper
adds (a ``custom_vjp`` pairing the three, the rows past the groups zeroed,
rows padded to the tiles, our configuration, applicability, cost and memory).
Their results are in the input dtype (the float32 accumulator is rounded to
bf16 before it is widened to the caller's ``out_dtype``), unlike
``ragged_dot(preferred_element_type=float32)``.

Applicability: Hopper GPUs (``hopper_only``), bf16 or fp16 inputs of one dtype,
``k`` and ``n`` multiples of the tiles (``problem``); elsewhere a dispatched
schedule computes that GEMM with ``jax.lax.ragged_dot`` and says why
(``analysis.dispatch.gemm_fallback``). JAX's kernels take no interpret flag:
the CPU tests run them in Mosaic GPU interpret mode by binding one, lower them
for an abstract H100, and stand them in by ``jax.lax.ragged_dot``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu

from jaxmercury.kernels.config import param
from jaxmercury.kernels.mosaic_gpu import ACC_VALUES, HALF_DTYPES, SMEM_BYTES, hopper_only
from jaxmercury.kernels.registry import GroupedKernel


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupedGemmConfig:
  """Tiles of JAX's ragged-dot kernels, with the tuner's choices.

  Attributes:
    block_m: rows per tile (wgmma's M: a multiple of 64).
    block_n: output columns per tile (at most 128 with ``block_m`` 128: one warpgroup's accumulator).
    block_k: contraction depth per pipeline step.
    max_concurrent_steps: pipeline depth (TMA loads in flight).
    grid_block_n: column tiles a CTA walks before the next row tile (L2 reuse of the rows).
  """

  block_m: int = param(128, 64)
  block_n: int = param(128, 64)
  block_k: int = param(64)
  max_concurrent_steps: int = param(4, 2)
  grid_block_n: int = param(1, 4)

  def smem_bytes(self, itemsize: int = 2) -> int:
    """Pipeline buffers (a row tile and a weight tile per step) plus the epilogue tile."""
    bm, bn, bk = self.block_m, self.block_n, self.block_k
    return self.max_concurrent_steps * (bm * bk + bk * bn) * itemsize + bm * bn * itemsize

  def tile_problem(self) -> str | None:
    """Why these tiles cannot compile, or None."""
    if self.block_m % 64 or self.block_n % 64 or self.block_k % 64:
      return f"block_m={self.block_m}, block_n={self.block_n}, block_k={self.block_k} must be multiples of 64"
    if self.block_m * self.block_n > ACC_VALUES:
      return f"block_m x block_n = {self.block_m * self.block_n} float32 accumulators exceed {ACC_VALUES}"
    if self.smem_bytes() > SMEM_BYTES:
      return f"needs {self.smem_bytes()} bytes of shared memory, more than {SMEM_BYTES}"
    return None


def problem(k: int, n: int, dtype, config: GroupedGemmConfig) -> str | None:
  """Why the kernel cannot compute ``x [m, k] @ w[g] [k, n]`` and its gradients in ``dtype``, or None.

  The forward tiles ``k`` by ``block_k`` and ``n`` by ``block_n``; ``dx`` the other way round; ``dw`` tiles
  ``k`` by ``block_m`` and ``n`` by ``block_n``. The rows ``m`` are padded to the tiles here.
  """
  if np.dtype(dtype) not in HALF_DTYPES:
    return f"the kernel takes {sorted(map(str, HALF_DTYPES))}, the rows are {np.dtype(dtype)}"
  if reason := config.tile_problem():
    return reason
  c = config
  for what, size, tile in (("k", k, c.block_k), ("k", k, c.block_n), ("k", k, c.block_m),
                           ("n", n, c.block_n), ("n", n, c.block_k)):
    if size % tile:
      return f"{what}={size} is not a multiple of {tile} (tiles {c})"
  for what, size in (("n", n), ("k", k)):
    if (size // c.block_n) % c.grid_block_n:
      return f"{what}={size} is not a multiple of grid_block_n x block_n = {c.grid_block_n * c.block_n}"
  return None


def devices_problem(mesh) -> str | None:
  """Why ``mesh``'s devices cannot run the kernel (a sentence naming the device), or None (an abstract mesh)."""
  if not isinstance(mesh, jax.sharding.Mesh):
    return None
  return hopper_only(mesh.devices.flat[0])


# The kernels, called through these two names (tests stand them in): results in the inputs' dtype.
def _ragged(x, w, sizes, config: GroupedGemmConfig, transpose_rhs: bool):
  """``x [m, k] @ w[g]`` per group (``transpose_rhs``: ``w [e, n, k]`` read as its transpose)."""
  return ragged_dot_mgpu.ragged_dot(x, w, group_sizes=sizes, transpose_rhs=transpose_rhs, block_m=config.block_m,
                                    block_n=config.block_n, block_k=config.block_k,
                                    max_concurrent_steps=config.max_concurrent_steps,
                                    grid_block_n=config.grid_block_n)


def _transposed(x, dy, sizes, config: GroupedGemmConfig):
  """``[e, k, n]``: per group ``x_g^T @ dy_g`` over the group's rows."""
  return transposed_ragged_dot_mgpu.transposed_ragged_dot(
      x, dy, group_sizes=sizes, block_m=config.block_m, block_n=config.block_n, block_k=config.block_k,
      max_concurrent_steps=config.max_concurrent_steps, grid_block_n=config.grid_block_n)


def _padded_rows(a, config: GroupedGemmConfig):
  """``a`` with zero rows appended up to a multiple of the row tiles (the kernels' TMA boxes)."""
  tile = math.lcm(config.block_m, config.block_k)
  extra = -a.shape[0] % tile
  return jnp.pad(a, ((0, extra), (0, 0))) if extra else a


def _grouped_rows(out, sizes, m: int):
  """The first ``m`` rows of a kernel's output, those past the groups zeroed (the kernel leaves them unwritten)."""
  out = out[:m]
  return jnp.where((jnp.arange(m) < jnp.sum(sizes))[:, None], out, jnp.zeros((), out.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _grouped(x, w, sizes, config, out_dtype):
  out = _ragged(_padded_rows(x, config), w, sizes, config, False)
  return _grouped_rows(out, sizes, x.shape[0]).astype(out_dtype)


def _grouped_fwd(x, w, sizes, config, out_dtype):
  return _grouped(x, w, sizes, config, out_dtype), (x, w, sizes)


def _grouped_bwd(config, out_dtype, residuals, dy):
  del out_dtype
  x, w, sizes = residuals
  dy = _padded_rows(dy.astype(x.dtype), config)
  dx = _grouped_rows(_ragged(dy, w, sizes, config, True), sizes, x.shape[0])
  dw = _transposed(_padded_rows(x, config), dy, sizes, config)
  return dx.astype(x.dtype), dw.astype(w.dtype), None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def grouped_gemm(x, w, group_sizes, *, config: GroupedGemmConfig = GroupedGemmConfig(), out_dtype=jnp.float32):
  """``jax.lax.ragged_dot(x, w, group_sizes)`` through JAX's Hopper kernels, differentiable in ``x`` and ``w``.

  Args:
    x: [m, k] rows sorted by group, bf16 or fp16.
    w: [e, k, n], x's dtype.
    group_sizes: [e] int32 rows per group (sum at most ``m``; the rows past it give 0).
    config: the kernels' tiles; ``problem(k, n, dtype, config)`` must be None.
    out_dtype: the result's dtype (the kernel rounds to x's dtype first).

  Returns:
    [m, n] in ``out_dtype``.
  """
  if reason := problem(x.shape[1], w.shape[2], x.dtype, config):
    raise ValueError(f"mosaic_grouped_gemm: {reason}")
  if w.dtype != x.dtype or w.shape[1] != x.shape[1] or group_sizes.shape != (w.shape[0],):
    raise ValueError(f"mosaic_grouped_gemm: x {x.shape} {x.dtype}, w {w.shape} {w.dtype} and group_sizes "
                     f"{group_sizes.shape} do not fit x [m, k], w [e, k, n], group_sizes [e] of one dtype")
  return _grouped(x, w, group_sizes.astype(jnp.int32), config, np.dtype(out_dtype))


def rows(routed: int, groups: int, config: GroupedGemmConfig) -> float:
  """Rows the kernel computes for ``routed`` rows in ``groups`` groups: each group's last row tile is half
  empty on average, and a tile straddling two groups is computed for both (cost model)."""
  return routed + groups * config.block_m / 2


def memory(m: int, k: int, n: int, groups: int, itemsize: int, config: GroupedGemmConfig) -> int:
  """Temporary bytes of one forward and backward beyond ``ragged_dot``'s: the rows padded to the tiles, the
  kernel's result in the input dtype before it is widened, and ``dw`` in the input dtype."""
  tile = math.lcm(config.block_m, config.block_k)
  padded = -(-m // tile) * tile
  return itemsize * (padded * (k + n) + m * n + groups * k * n)


MOSAIC_GROUPED_GEMM = GroupedKernel(
    name="mosaic_grouped_gemm", config=GroupedGemmConfig, dtypes=HALF_DTYPES,
    devices=lambda mesh: devices_problem(mesh),  # through the module's name: tests stand the devices in
    problem=problem, gemm=grouped_gemm, rows=rows, memory=memory,
    description="JAX's Hopper ragged-dot kernels (ragged_dot_mgpu forward and dx, transposed_ragged_dot_mgpu dw)")
