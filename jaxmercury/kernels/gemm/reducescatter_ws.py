"""GEMM + reduce-scatter in one warp-specialized Mosaic GPU kernel: two consumer warpgroups per CTA.

The same ring as ``fused_matmul_reducescatter`` (read its loop nest there):
at step ``s`` device ``r`` multiplies row block ``b = (r + s + 1) % n`` of
its K shard, adds device ``r + 1``'s partial sum of that block, and stores
the running sum into device ``r - 1``'s ``received[s]``; the own block comes
last and is written to ``out``. Here each step's GEMM is JAX's
warp-specialized Hopper GEMM body (``hopper_matmul_mgpu.kernel``, called as a
dependency): per CTA one producer warpgroup streams A and B tiles by TMA and
two consumer warpgroups run wgmma on two halves of a ``tile_m x 2 tile_n``
(or ``2 tile_m x tile_n``) output tile, so loads, tensor cores and the
epilogue overlap. Its ``c`` operand (``out = c + a @ b``, read tile by tile
in the epilogue) is the received partial sum and its output is the peer's
buffer (``plgpu.remote_ref``): the reduction and the transfer are the GEMM's
own epilogue, with no pass of their own.

Signalling: after a step, each consumer warpgroup of each CTA waits for its
stores to land and signals step ``s``'s semaphore on device ``r - 1``
(``step_semaphores``: one per step); before step ``s`` every warpgroup waits
until the right neighbour's ``2 x grid`` signals of step ``s - 1`` arrived.
The grid is persistent (one CTA per SM), so every CTA waited on is resident.

Partial sums and the result are float32 in the kernel (the GEMM body adds
``c`` in its output dtype); the result is cast to ``out_dtype`` after it.
Shapes need not be multiples of the tiles (row blocks, ``k`` and ``N`` are
padded with zeros); ``M`` must divide by ``n``. Hopper only; one process for
all local GPUs. No interpret mode: JAX's interpreter does not run the
warp-specialized pipeline.
"""

from __future__ import annotations

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

from jaxmercury.errors import PreconditionError
from jaxmercury.kernels.fused_common import gemm_memory, gemm_seconds, hopper_devices
from jaxmercury.kernels.gemm.peer import check_operands, pad_to, round_up, warp_specialized_kernel
from jaxmercury.kernels.gemm.tiles import WsConfig, WsTiles, ws_problem, ws_tile
from jaxmercury.kernels.mosaic_gpu import left_peer, step_semaphores
from jaxmercury.kernels.placements import REDUCESCATTER
from jaxmercury.kernels.registry import DualGemm, FusedKernel

KERNEL = "fused_matmul_reducescatter_ws"


def fused_matmul_reducescatter_ws(x, w, axis_name: str, *, tiles: WsTiles = WsTiles(), out_dtype=None):
  """``psum_scatter(x @ w, axis_name, rows)`` fused into a warp-specialized GEMM; call inside ``shard_map``.

  Args:
    x: this device's K shard of the activations ``[M, k]``, bf16 or fp16;
      ``M`` must divide by the axis size.
    w: this device's rows of the weight ``[k, N]``, same dtype.
    axis_name: the ``shard_map`` axis the partial products are summed over;
      it must span every device of the process.
    tiles: the consumer warpgroups' tiles and the pipeline depth (``WsTiles``).
    out_dtype: the result's dtype (default ``x``'s).

  Returns:
    ``[M / n, N]``: row block ``r`` (this device's index) of ``sum_j x_j @ w_j``.
  """
  if reason := tiles.problem():
    raise PreconditionError(f"{KERNEL}: {reason}")
  n_dev = lax.axis_size(axis_name)
  if x.ndim == 2 and x.shape[0] % n_dev:
    raise PreconditionError(f"{KERNEL}: x has {x.shape[0]} rows, which axis {axis_name!r} "
                            f"({n_dev} devices) cannot scatter evenly")
  check_operands(KERNEL, x, w, axis_name, None, False, names=("x", "w"))
  out_dtype = jnp.dtype(out_dtype or x.dtype)
  (m, k), n = x.shape, w.shape[1]
  mb = m // n_dev
  cm, cn = tiles.cta
  mbp, kp, np_ = round_up(mb, cm), round_up(k, tiles.tile_k), round_up(n, cn)
  if (mbp, kp) != (mb, k):  # pad every row block, so that block b starts at row b * mbp
    x = jnp.pad(x.reshape(n_dev, mb, k), ((0, 0), (0, mbp - mb), (0, kp - k))).reshape(n_dev * mbp, kp)
  out = _kernel(x, pad_to(w, kp, np_), axis_name, n_dev, tiles)
  return out[:mb, :n].astype(out_dtype)


def _kernel(x, w, axis_name, n_dev: int, tiles: WsTiles):
  mb, n = x.shape[0] // n_dev, w.shape[1]
  config = tiles.config()
  grid = hm.get_num_sms()  # one CTA per SM, as the GEMM body's persistent loop expects

  def body(x_ref, w_ref, out_ref, *received):
    if n_dev == 1:
      hm.kernel(x_ref, w_ref, None, out_ref, config)
      return
    (received_ref,) = received
    dev = lax.axis_index(axis_name)
    consumer = lax.axis_index("wg") < 2
    arrived = step_semaphores(n_dev)
    left, to_left = left_peer(dev, n_dev, received_ref)
    for s in range(n_dev):  # n_dev is small and static: each step is its own code
      block = x_ref.at[pl.ds(lax.rem(dev + s + 1, n_dev) * mb, mb)]
      if s > 0:  # every consumer warpgroup of the right peer finished step s - 1
        pl.semaphore_wait(arrived.at[s - 1], value=2 * grid, decrement=False)
      last = s == n_dev - 1
      hm.kernel(block, w_ref, None if s == 0 else received_ref.at[s - 1],
                out_ref if last else to_left.at[s], config)
      if not last:
        @pl.when(consumer)
        def _signal():
          plgpu.wait_smem_to_gmem(0, wait_read_only=False)  # this warpgroup's sums have landed in the peer
          pl.semaphore_signal(arrived.at[s], device_id=left)

  out_type = [jax.ShapeDtypeStruct((mb, n), jnp.float32)]
  if n_dev > 1:  # filled by the right neighbour, one slot per ring step
    out_type.append(jax.ShapeDtypeStruct((n_dev - 1, mb, n), jnp.float32))
  return warp_specialized_kernel(body, out_type, grid, x, w)[0]


def _make(p, config: WsConfig, interpret: bool):
  del interpret  # never: JAX's interpreter does not run its pipeline
  tiles, out_dtype = config.tiles(), p.c.dtype

  def per_device(a, b):
    return fused_matmul_reducescatter_ws(a, b, p.level, tiles=tiles, out_dtype=out_dtype)
  return per_device


FUSED_MATMUL_REDUCESCATTER_WS = FusedKernel(
    name="fused_matmul_reducescatter_ws",
    description="our warp-specialized Mosaic GPU kernel (kernels.gemm.reducescatter_ws): JAX's Hopper GEMM "
                "body (two consumer warpgroups) per ring step, its epilogue adding the received sum and storing "
                "into the left neighbour; shapes padded to its CTA tiles",
    placement=REDUCESCATTER, config=WsConfig, devices=hopper_devices(False),
    problem=lambda p, config: ws_problem(config, 4), tile=ws_tile, make=_make,
    backward=DualGemm(dual="fused_allgather_matmul_ws"), rate_kernel="jax_mosaic_matmul", seconds=gemm_seconds,
    memory=gemm_memory)
