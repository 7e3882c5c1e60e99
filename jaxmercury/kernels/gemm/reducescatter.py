"""GEMM + reduce-scatter in one Mosaic GPU kernel: partial sums travel the ring inside the kernel.

Inside ``shard_map`` over a mesh axis of ``n`` devices, device ``r`` holds
``x_r [M, k]`` (its K shard of the activations, every row) and ``w_r [k, N]``
and gets row block ``r`` of ``sum_j x_j @ w_j`` (``[M / n, N]``, the
``psum_scatter(x_r @ w_r, rows)`` of a row-parallel layer). The loop nest::

  for s in 0 .. n-1:                      # ring step: block (r + s + 1) % n, the own block r last
    b = (r + s + 1) % n
    if s > 0: wait until device r + 1 has filled received[s - 1]
    for tile (mi, ni) of row block b:     # persistent CTAs
      acc = x_r[b][mi] @ w_r[:, ni]       # k streamed through SMEM by TMA, wgmma, float32
      if s > 0: acc += received[s - 1][mi, ni]     # device r + 1's partial sum of block b
      if s < n - 1: store acc into received[s] of device r - 1 (float32)
      else:         out[mi, ni] = acc     # the whole sum of block r
    if s < n - 1: signal device r - 1

Device ``r + 1`` at step ``s - 1`` works on block ``(r + 1 + s - 1 + 1) % n``,
the same block as device ``r`` at step ``s``, so each partial sum gains one
device's term per step and reaches its owner after ``n - 1`` hops.

No collective runs outside the kernel: the epilogue of each tile stores the
running sum by TMA straight into the left neighbour's ``received`` buffer
(``plgpu.remote_ref``), and one global semaphore per ring step counts the
neighbour's CTAs that finished that step (``pl.semaphore_signal(...,
device_id=...)``). Partial sums
stay float32 between devices, so an ``n``-way sum rounds once, at the final
store. The grid is persistent (at most one CTA per SM), so every CTA that
another waits on is resident and the ring cannot deadlock.

Shapes need not be multiples of the tiles: each row block, ``k`` and ``N``
are padded with zeros to the tiles and the result sliced back; ``M`` must
divide by ``n``. Hopper only; one process for all local GPUs (the mesh axis
must cover every device).
"""

from __future__ import annotations

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from jaxmercury.errors import PreconditionError
from jaxmercury.kernels.fused_common import (
  INTERPRET_CTAS,
  gemm_memory,
  gemm_seconds,
  interpretable_devices,
  tile_of,
  tile_problem,
)
from jaxmercury.kernels.gemm.peer import check_operands, pad_to, round_up
from jaxmercury.kernels.gemm.tiles import TileConfig, Tiles, accumulate, store_tile
from jaxmercury.kernels.mosaic_gpu import left_peer, sm_count, step_semaphores, swizzled
from jaxmercury.kernels.placements import REDUCESCATTER
from jaxmercury.kernels.registry import DualGemm, FusedKernel


def fused_matmul_reducescatter(x, w, axis_name: str, *, tiles: Tiles = Tiles(), out_dtype=None,
                               num_ctas: int | None = None, interpret: bool = False):
  """``psum_scatter(x @ w, axis_name, rows)`` with the reduce-scatter fused into the GEMM; call inside ``shard_map``.

  Args:
    x: this device's K shard of the activations ``[M, k]``, bf16 or fp16;
      ``M`` must divide by the axis size.
    w: this device's rows of the weight ``[k, N]``, same dtype.
    axis_name: the ``shard_map`` axis the partial products are summed over;
      it must span every device of the process (Mosaic GPU addresses peers by
      mesh index).
    tiles: tile sizes and pipeline depth (``Tiles``).
    out_dtype: the result's dtype (default ``x``'s); partial sums travel in
      float32 whatever it is.
    num_ctas: CTAs of the persistent grid (default: the device's SM count).
    interpret: run in Mosaic GPU interpret mode (CPU); one device only, since
      the interpreter has no peer memory or remote semaphores.

  Returns:
    ``[M / n, N]``: row block ``r`` (this device's index) of ``sum_j x_j @ w_j``.
  """
  n_dev = lax.axis_size(axis_name)
  if x.ndim == 2 and x.shape[0] % n_dev:
    raise PreconditionError(f"fused_matmul_reducescatter: x has {x.shape[0]} rows, which axis {axis_name!r} "
                            f"({n_dev} devices) cannot scatter evenly")
  check_operands("fused_matmul_reducescatter", x, w, axis_name, tiles, interpret, names=("x", "w"))
  out_dtype = jnp.dtype(out_dtype or x.dtype)
  (m, k), n = x.shape, w.shape[1]
  mb = m // n_dev
  mbp, kp, np_ = round_up(mb, tiles.tile_m), round_up(k, tiles.tile_k), round_up(n, tiles.tile_n)
  if (mbp, kp) != (mb, k):  # pad every row block, so that block b starts at row b * mbp
    x = jnp.pad(x.reshape(n_dev, mb, k), ((0, 0), (0, mbp - mb), (0, kp - k))).reshape(n_dev * mbp, kp)
  out = _kernel(x, pad_to(w, kp, np_), axis_name, n_dev, tiles, out_dtype,
                num_ctas or sm_count(), interpret)
  return out if (mbp, np_) == (mb, n) else out[:mb, :n]


def _kernel(x, w, axis_name, n_dev: int, tiles: Tiles, out_dtype, num_ctas: int, interpret: bool):
  mb, n = x.shape[0] // n_dev, w.shape[1]
  tm, tn = tiles.tile_m, tiles.tile_n
  tiles_n = n // tn
  num_tiles = (mb // tm) * tiles_n
  grid = min(num_tiles, num_ctas)

  def body(x_ref, w_ref, out_ref, *received):
    cta = lax.axis_index("cta")
    if n_dev > 1:
      (received_ref,) = received
      dev = lax.axis_index(axis_name)
      arrived = step_semaphores(n_dev)
      left, to_left = left_peer(dev, n_dev, received_ref)
    else:
      dev = 0

    def ring_step(s, first: bool, last: bool):
      """Step ``s`` (static flags: ``first`` has no partial to add, ``last`` stores the own block)."""
      block_rows = lax.rem(dev + s + 1, n_dev) * mb
      if not first:
        pl.semaphore_wait(arrived.at[s - 1], value=grid, decrement=False)  # every CTA of the right peer, step s - 1

      @pl.loop(cta, num_tiles, step=grid)
      def _tile(t):
        mi, ni = t // tiles_n, lax.rem(t, tiles_n)
        rows, cols = pl.ds(mi * tm, tm), pl.ds(ni * tn, tn)
        # Register (ACC) and SMEM scratch are scoped separately (interpret mode cannot mix them);
        # the epilogue's SMEM reuses the pipeline's once the GEMM is done.
        acc = pl.run_scoped(
            lambda acc_ref: accumulate(acc_ref, x_ref.at[pl.ds(block_rows + mi * tm, tm), :],
                                        w_ref.at[:, cols], tiles),
            plgpu.ACC((tm, tn), jnp.float32))
        if first and last:  # one device: a plain GEMM
          pl.run_scoped(lambda out_smem: store_tile(acc, out_smem, out_ref.at[rows, cols]),
                        plgpu.SMEM((tm, tn), out_dtype, transforms=swizzled(tn, out_dtype)))
          return

        def epilogue(sum_smem, out_smem, landed):
          if first:
            total = acc
          else:  # the right peer's partial sum of this tile, through SMEM into registers (WGMMA layout)
            plgpu.copy_gmem_to_smem(received_ref.at[s - 1, rows, cols], sum_smem, landed)
            plgpu.barrier_wait(landed)
            total = acc + sum_smem[...]
          if last:
            store_tile(total, out_smem, out_ref.at[rows, cols])
          else:  # float32 into the left peer; its write is awaited once per step, before the signal
            sum_smem[...] = total
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(sum_smem, to_left.at[s, rows, cols])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # sum_smem may be reused

        pl.run_scoped(epilogue,
                      plgpu.SMEM((tm, tn), jnp.float32, transforms=swizzled(tn, jnp.float32)),
                      plgpu.SMEM((tm, tn), out_dtype, transforms=swizzled(tn, out_dtype)),
                      plgpu.Barrier(num_barriers=1))

      if not last:
        plgpu.wait_smem_to_gmem(0, wait_read_only=False)  # this CTA's partial sums have landed in the peer
        pl.semaphore_signal(arrived.at[s], device_id=left)

    if n_dev == 1:
      ring_step(0, first=True, last=True)
      return
    ring_step(0, first=True, last=False)
    if n_dev > 2:
      @pl.loop(1, n_dev - 1)
      def _ring(s):
        ring_step(s, first=False, last=False)
    ring_step(n_dev - 1, first=False, last=True)
    plgpu.wait_smem_to_gmem(0, wait_read_only=False)

  out_type = [jax.ShapeDtypeStruct((mb, n), out_dtype)]
  if n_dev > 1:  # filled by the right neighbour, one slot per ring step
    out_type.append(jax.ShapeDtypeStruct((n_dev - 1, mb, n), jnp.float32))
  results = plgpu.kernel(
      body, out_type=out_type, grid=(grid,), grid_names=("cta",),
      interpret=plgpu.InterpretGPUParams() if interpret else None)(x, w)
  return results[0]


def reference(x, w, axis_name: str, out_dtype=None):
  """The unfused program: one GEMM (float32 accumulation) then ``psum_scatter`` over rows."""
  partial = jnp.dot(x, w, preferred_element_type=jnp.float32)
  return lax.psum_scatter(partial, axis_name, scatter_dimension=0, tiled=True).astype(out_dtype or x.dtype)


def _make(p, config: TileConfig, interpret: bool):
  tiles, out_dtype = config.tiles(), p.c.dtype

  def per_device(a, b):
    return fused_matmul_reducescatter(a, b, p.level, tiles=tiles, out_dtype=out_dtype,
                                      num_ctas=INTERPRET_CTAS if interpret else None, interpret=interpret)
  return per_device


def _one_device(config: TileConfig) -> tuple[str, TileConfig]:
  """On one device the ring is empty: one GEMM step, its tiles stored as they are done (``first and last``),
  which is ``fused_allgather_matmul``'s one step at the same tiles; each backward runs the other kernel, which
  is again the same GEMM there."""
  return "fused_allgather_matmul", config


FUSED_MATMUL_REDUCESCATTER = FusedKernel(
    name="fused_matmul_reducescatter",
    description="our Mosaic GPU kernel (kernels.gemm.reducescatter): each tile's float32 running sum is "
                "stored by TMA into the left neighbour as the GEMM finishes it; shapes padded to its tiles",
    placement=REDUCESCATTER, config=TileConfig, devices=interpretable_devices, problem=tile_problem, tile=tile_of,
    make=_make, interpret=True, backward=DualGemm(dual="fused_allgather_matmul"), rate_kernel="mosaic_matmul",
    seconds=gemm_seconds, memory=gemm_memory, one_device=_one_device)
