"""All-gather GEMM in one warp-specialized Mosaic GPU kernel: two consumer warpgroups per CTA.

The same ring as ``fused_allgather_matmul`` (read its loop nest there): at
step ``s`` device ``r`` multiplies A's row shard of device ``(r + s) % n``
(its own at ``s = 0``, else the one its right neighbour stored into
``received[s - 1]``) by its columns of B, and forwards that shard to device
``r - 1``'s ``received[s]``. Here each step's GEMM is JAX's warp-specialized
Hopper GEMM body (``hopper_matmul_mgpu.kernel``, called as a dependency):
per CTA one producer warpgroup streams A and B tiles by TMA and two consumer
warpgroups run wgmma on two halves of a ``tile_m x 2 tile_n`` (or
``2 tile_m x tile_n``) output tile. The body's ``pipeline_callback`` runs in
consumer warpgroup 0 after each wgmma: on the first column of output tiles
it stores the A tile it just read from SMEM into the left neighbour's
buffer (``plgpu.remote_ref``), so every A tile crosses the link once, read
from SMEM that the GEMM loaded anyway. ``delay_release=1`` keeps the slot
until the next step, by which time the store has read it.

Signalling: after step ``s`` warpgroup 0 of each CTA waits until its stores
have landed and signals step ``s``'s semaphore on device ``r - 1``
(``step_semaphores``: one per step, so that a CTA running ahead cannot
complete an earlier step's count); before step ``s`` every warpgroup waits
until all ``grid`` CTAs of the right neighbour signalled step ``s - 1``. JAX's
own kernel (``collective_matmul_mgpu.all_gather_lhs_matmul``) counts every
step on one semaphore, which lets a waiter through early from three devices
on. The grid is persistent (one CTA per SM), so every CTA waited on is
resident and the ring cannot deadlock.

Shapes need not be multiples of the tiles (``m``, ``k`` and the columns are
padded with zeros). Hopper only; one process for all local GPUs. No
interpret mode: JAX's interpreter does not run the warp-specialized pipeline.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

from jaxmercury.errors import PreconditionError
from jaxmercury.kernels.config import param
from jaxmercury.kernels.fused_common import gemm_memory, gemm_seconds, hopper_devices
from jaxmercury.kernels.gemm.peer import (
  check_operands,
  gathered_rows,
  pad_to,
  round_up,
  unpad_row_blocks,
  warp_specialized_kernel,
)
from jaxmercury.kernels.gemm.tiles import WsConfig, WsTiles, ws_problem, ws_tile
from jaxmercury.kernels.mosaic_gpu import left_peer, step_semaphores
from jaxmercury.kernels.placements import ALLGATHER
from jaxmercury.kernels.registry import DualGemm, FusedKernel

KERNEL = "fused_allgather_matmul_ws"


def fused_allgather_matmul_ws(a, b, axis_name: str, *, tiles: WsTiles = WsTiles(), out_dtype=None,
                              gathered: bool = False):
  """``all_gather(a, axis_name, rows) @ b`` fused into a warp-specialized GEMM; call inside ``shard_map``.

  Args:
    a: this device's row shard ``[m, k]``, bf16 or fp16.
    b: ``[k, n_cols]``, same dtype (this device's columns).
    axis_name: the ``shard_map`` axis the rows are gathered over; it must
      span every device of the process.
    tiles: the consumer warpgroups' tiles and the pipeline depth (``WsTiles``).
    out_dtype: the result's dtype (default ``a``'s).
    gathered: also return ``all_gather(a)`` (``[n * m, k]``), read from the
      ring's receive buffers (``peer_gemm.gathered_rows``): the backward's
      residual, with nothing sent again.

  Returns:
    ``[n * m, n_cols]``: row block ``j`` is ``a_j @ b``; with ``gathered``,
    ``(that, all_gather(a))``.
  """
  out_dtype = jnp.dtype(out_dtype or a.dtype)
  if reason := tiles.problem(out_itemsize=out_dtype.itemsize):
    raise PreconditionError(f"{KERNEL}: {reason}")
  n_dev = check_operands(KERNEL, a, b, axis_name, None, False)
  (m, k), n = a.shape, b.shape[1]
  cm, cn = tiles.cta
  mp, kp, np_ = round_up(m, cm), round_up(k, tiles.tile_k), round_up(n, cn)
  out, received = _kernel(pad_to(a, mp, kp), pad_to(b, kp, np_), axis_name, n_dev, tiles, out_dtype)
  out = unpad_row_blocks(out, n_dev, m, n)
  return (out, gathered_rows(a, received, axis_name)) if gathered else out


def _kernel(a, b, axis_name, n_dev: int, tiles: WsTiles, out_dtype):
  (m, k), n = a.shape, b.shape[1]
  config = tiles.config()
  cta_m, tile_k = tiles.cta[0], tiles.tile_k
  grid = hm.get_num_sms()  # one CTA per SM, as the GEMM body's persistent loop expects

  def body(a_ref, b_ref, out_ref, *received):
    if n_dev == 1:
      hm.kernel(a_ref, b_ref, None, out_ref, config)
      return
    (received_ref,) = received
    dev = lax.axis_index(axis_name)
    sender = lax.axis_index("wg") == 0
    arrived = step_semaphores(n_dev)
    left, to_left = left_peer(dev, n_dev, received_ref)

    def forward(step_buffer):
      def callback(m_idx, n_idx, k_idx, a_smem, b_smem):
        del b_smem

        @pl.when(sender & (n_idx == 0))  # each A tile once: on the first column of output tiles
        def _():
          plgpu.copy_smem_to_gmem(a_smem, step_buffer.at[pl.ds(m_idx * cta_m, cta_m), pl.ds(k_idx * tile_k, tile_k)])
          plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the previous tile's read is done: its slot may go
      return callback

    for s in range(n_dev):  # n_dev is small and static: each step is its own code
      if s > 0:  # every CTA of the right peer finished storing step s - 1
        pl.semaphore_wait(arrived.at[s - 1], value=grid, decrement=False)
      source = a_ref if s == 0 else received_ref.at[s - 1]
      rows = pl.ds(lax.rem(dev + s, n_dev) * m, m)
      forwarding = s < n_dev - 1
      hm.kernel(source, b_ref, None, out_ref.at[rows], config,
                pipeline_callback=forward(to_left.at[s]) if forwarding else None,
                delay_release=1 if forwarding else 0)
      if forwarding:
        @pl.when(sender)
        def _signal():
          plgpu.wait_smem_to_gmem(0, wait_read_only=False)  # this CTA's A tiles have landed in the peer
          pl.semaphore_signal(arrived.at[s], device_id=left)

  out_type = [jax.ShapeDtypeStruct((n_dev * m, n), out_dtype)]
  if n_dev > 1:  # filled by the right neighbour, one slot per ring step
    out_type.append(jax.ShapeDtypeStruct((n_dev - 1, m, k), a.dtype))
  results = warp_specialized_kernel(body, out_type, grid, a, b)
  return results[0], (results[1] if n_dev > 1 else None)


@dataclasses.dataclass(frozen=True, kw_only=True)
class WsAllGatherConfig(WsConfig):
  """``WsConfig`` with a deeper pipeline and the persistent loop's tile order (``grid_minor``, in bands
  ``grid_width`` tiles wide, for L2 reuse)."""

  max_concurrent_steps: int = param(4)
  grid_minor: str = param("n")
  grid_width: int = param(8)


def _make(p, config: WsAllGatherConfig, interpret: bool):
  del interpret  # never: JAX's interpreter does not run its pipeline
  tiles, out_dtype = config.tiles(), p.c.dtype

  def per_device(a, b, gathered: bool = False):
    return fused_allgather_matmul_ws(a, b, p.level, tiles=tiles, out_dtype=out_dtype, gathered=gathered)
  return per_device


FUSED_ALLGATHER_MATMUL_WS = FusedKernel(
    name="fused_allgather_matmul_ws",
    description="our warp-specialized Mosaic GPU kernel (kernels.gemm.allgather_ws): JAX's Hopper GEMM "
                "body (two consumer warpgroups) per ring step, storing each A tile it reads into the left "
                "neighbour, one semaphore per step; shapes padded to its CTA tiles",
    placement=ALLGATHER, config=WsAllGatherConfig, devices=hopper_devices(False),
    problem=lambda p, config: ws_problem(config, p.itemsize),  # the epilogue stores the output's dtype
    tile=ws_tile, make=_make, backward=DualGemm(dual="fused_matmul_reducescatter_ws"),
    rate_kernel="jax_mosaic_matmul", seconds=gemm_seconds, memory=gemm_memory)
