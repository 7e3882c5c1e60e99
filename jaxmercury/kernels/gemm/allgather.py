"""All-gather GEMM in one Mosaic GPU kernel: A's row shards travel the ring inside the kernel.

Inside ``shard_map`` over a mesh axis of ``n`` devices, device ``r`` holds
``a_r [m, k]`` and ``b [k, n_cols]`` and computes ``concat(a_0 .. a_{n-1}) @ b``
(the ``allgather_matmul`` / ``async_tp`` schedules). The loop nest::

  for s in 0 .. n-1:                      # ring step (shift: visits shard (r + s) % n)
    source = a_r if s == 0 else received[s - 1]
    for tile (mi, ni) of the output rows of shard (r + s) % n:   # persistent CTAs
      acc = source[mi] @ b[:, ni]         # k streamed through SMEM by TMA, wgmma
      if ni == 0 and s < n - 1: store each A tile of source[mi] into received[s] of device r - 1
      out[(r + s) % n][mi, ni] = acc
    signal device r - 1; wait until device r + 1 has filled received[s]

No collective runs outside the kernel: each A tile that the tensor cores
read from SMEM is also stored, by TMA, straight into the left neighbour's
``received`` buffer (``plgpu.remote_ref``), and one global semaphore per ring
step counts the neighbour's CTAs that finished that step (``pl.semaphore_signal(..., device_id=...)``). The
grid is persistent (at most one CTA per SM), so every CTA that another waits
on is resident and the ring cannot deadlock.

Shapes need not be multiples of the tiles: ``m``, ``k`` and ``n_cols`` are
padded with zeros to the tiles and the result sliced back. Hopper only; one
process for all local GPUs (the mesh axis must cover every device).
"""

from __future__ import annotations

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from jaxmercury.kernels.fused_common import (
  INTERPRET_CTAS,
  gemm_memory,
  gemm_seconds,
  interpretable_devices,
  tile_of,
  tile_problem,
)
from jaxmercury.kernels.gemm.peer import check_operands, gathered_rows, pad_to, round_up, unpad_row_blocks
from jaxmercury.kernels.gemm.tiles import TileConfig, Tiles, accumulate, store_tile
from jaxmercury.kernels.mosaic_gpu import left_peer, sm_count, step_semaphores, swizzled
from jaxmercury.kernels.placements import ALLGATHER
from jaxmercury.kernels.registry import DualGemm, FusedKernel


def fused_allgather_matmul(a, b, axis_name: str, *, tiles: Tiles = Tiles(), out_dtype=None,
                           num_ctas: int | None = None, interpret: bool = False, gathered: bool = False):
  """``all_gather(a, axis_name, rows) @ b`` with the gather fused into the GEMM; call inside ``shard_map``.

  Args:
    a: this device's row shard ``[m, k]``, bf16 or fp16.
    b: ``[k, n_cols]``, same dtype (this device's columns).
    axis_name: the ``shard_map`` axis the rows are gathered over; it must span
      every device of the process (Mosaic GPU addresses peers by mesh index).
    tiles: tile sizes and pipeline depth (``Tiles``).
    out_dtype: the result's dtype (default ``a``'s).
    num_ctas: CTAs of the persistent grid (default: the device's SM count).
    interpret: run in Mosaic GPU interpret mode (CPU); one device only, since
      the interpreter has no peer memory or remote semaphores.
    gathered: also return ``all_gather(a)`` (``[n * m, k]``), read from the
      ring's receive buffers (``peer_gemm.gathered_rows``): the backward's
      residual, with nothing sent again.

  Returns:
    ``[n * m, n_cols]``: row block ``j`` is ``a_j @ b``; with ``gathered``,
    ``(that, all_gather(a))``.
  """
  n_dev = check_operands("fused_allgather_matmul", a, b, axis_name, tiles, interpret)
  out_dtype = jnp.dtype(out_dtype or a.dtype)
  (m, k), n = a.shape, b.shape[1]
  mp, kp, np_ = round_up(m, tiles.tile_m), round_up(k, tiles.tile_k), round_up(n, tiles.tile_n)
  out, received = _kernel(pad_to(a, mp, kp), pad_to(b, kp, np_), axis_name, n_dev, tiles, out_dtype,
                          num_ctas or sm_count(), interpret)
  out = unpad_row_blocks(out, n_dev, m, n)
  return (out, gathered_rows(a, received, axis_name)) if gathered else out


def _kernel(a, b, axis_name, n_dev: int, tiles: Tiles, out_dtype, num_ctas: int, interpret: bool):
  (m, k), n = a.shape, b.shape[1]
  tm, tn, tk = tiles.tile_m, tiles.tile_n, tiles.tile_k
  tiles_n = n // tn
  num_tiles = (m // tm) * tiles_n
  grid = min(num_tiles, num_ctas)

  def body(a_ref, b_ref, out_ref, received_ref, out_smem):
    cta = lax.axis_index("cta")
    dev = lax.axis_index(axis_name) if n_dev > 1 else 0
    if n_dev > 1:
      arrived = step_semaphores(n_dev)
      left, to_left = left_peer(dev, n_dev, received_ref)

    def ring_step(source, s):
      out_rows = lax.rem(dev + s, n_dev) * m
      forwarding = s < n_dev - 1

      @pl.loop(cta, num_tiles, step=grid)
      def _tile(t):
        mi, ni = t // tiles_n, lax.rem(t, tiles_n)
        rows, cols = pl.ds(mi * tm, tm), pl.ds(ni * tn, tn)

        def forward(kk, a_smem):
          @pl.when(forwarding & (ni == 0))
          def _():
            plgpu.copy_smem_to_gmem(a_smem, to_left.at[s, rows, pl.ds(kk * tk, tk)])
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the previous tile's read is done: its SMEM may go

        on_step = forward if n_dev > 1 else None
        acc = pl.run_scoped(
            lambda acc_ref: accumulate(acc_ref, source.at[rows, :], b_ref.at[:, cols], tiles, on_step),
            plgpu.ACC((tm, tn), jnp.float32))
        store_tile(acc, out_smem, out_ref.at[pl.ds(out_rows + mi * tm, tm), cols])

      if n_dev > 1:
        @pl.when(forwarding)
        def _signal():
          plgpu.wait_smem_to_gmem(0, wait_read_only=False)  # this CTA's stores have landed in the peer
          pl.semaphore_signal(arrived.at[s], device_id=left)
          pl.semaphore_wait(arrived.at[s], value=grid, decrement=False)  # every CTA of the right peer, step s

    ring_step(a_ref, 0)
    if n_dev > 1:
      @pl.loop(1, n_dev)
      def _ring(s):
        ring_step(received_ref.at[s - 1], s)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  out_smem = plgpu.SMEM((tm, tn), out_dtype, transforms=swizzled(tn, out_dtype))
  result, received = plgpu.kernel(
      body,
      out_type=[jax.ShapeDtypeStruct((n_dev * m, n), out_dtype),
                jax.ShapeDtypeStruct((max(n_dev - 1, 1), m, k), a.dtype)],  # filled by the right neighbour
      scratch_types=[out_smem], grid=(grid,), grid_names=("cta",),
      interpret=plgpu.InterpretGPUParams() if interpret else None)(a, b)
  return result, (received if n_dev > 1 else None)


def reference(a, b, axis_name: str, out_dtype=None):
  """The unfused program: ``all_gather`` then one GEMM (float32 accumulation)."""
  full = lax.all_gather(a, axis_name, axis=0, tiled=True)
  return jnp.dot(full, b, preferred_element_type=jnp.float32).astype(out_dtype or a.dtype)



def _make(p, config: TileConfig, interpret: bool):
  tiles, out_dtype = config.tiles(), p.c.dtype

  def per_device(a, b, gathered: bool = False):
    return fused_allgather_matmul(a, b, p.level, tiles=tiles, out_dtype=out_dtype,
                                  num_ctas=INTERPRET_CTAS if interpret else None, interpret=interpret,
                                  gathered=gathered)
  return per_device


FUSED_ALLGATHER_MATMUL = FusedKernel(
    name="fused_allgather_matmul",
    description="our Mosaic GPU kernel (kernels.gemm.allgather): A's row shards travel the ring by TMA "
                "stores into the left neighbour, overlapped with wgmma; shapes padded to its tiles",
    placement=ALLGATHER, config=TileConfig, devices=interpretable_devices, problem=tile_problem, tile=tile_of,
    make=_make, interpret=True, backward=DualGemm(dual="fused_matmul_reducescatter"), rate_kernel="mosaic_matmul",
    seconds=gemm_seconds, memory=gemm_memory)
