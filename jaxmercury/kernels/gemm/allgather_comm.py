"""All-gather GEMM in one Mosaic GPU kernel, the ring driven by dedicated communication CTAs (inter-SM overlap).

Inside ``shard_map`` over a mesh axis of ``n`` devices, device ``r`` holds
``a_r [m, k]`` and ``b [k, n_cols]`` and computes ``concat(a_0 .. a_{n-1}) @ b``,
like ``fused_allgather_matmul``. There the compute CTAs forward the A tiles
they read (intra-SM overlap) and every CTA meets a whole-step barrier. Here
the persistent grid is split in two (inter-SM overlap, ParallelKittens §3;
Iris §4 "workgroup specialization"): ``comm_ctas`` CTAs only move A around
the ring, the others only compute, and readiness is tracked per chunk of
``chunk_rows`` rows. The loop nest, before (the schedule)::

  for s in 0 .. n-1:                      # ring step (shift: visits shard (r + s) % n)
    out[(r + s) % n] = (a_r if s == 0 else received[s - 1]) @ b
    if s < n - 1: received[s] of device r - 1 = (a_r if s == 0 else received[s - 1])

and after (this kernel)::

  communication CTA j (of comm_ctas):
    for s in 0 .. n-2:
      for chunk c = j, j + comm_ctas, ... of the chunks of rows:
        if s > 0: wait semaphore[s - 1, c] (device r + 1 filled received[s - 1] rows c)
        source = a_r if s == 0 else received[s - 1]
        for piece (tile_m rows, <= 256 cols) of chunk c:   # two SMEM slots: load i + 1 while storing i
          TMA source[piece] -> SMEM (barrier); TMA SMEM -> received[s][piece] of device r - 1
        wait until the stores have landed; signal semaphore[s, c] of device r - 1
  compute CTA w (of the rest):
    for tile t = w, w + workers, ... of the n * tiles_per_step tiles, in (s, mi, ni) order:
      if s > 0: wait semaphore[s - 1, chunk of row tile mi]
      out[(r + s) % n][mi, ni] = source_s[mi] @ b[:, ni]   # k streamed through SMEM by TMA, wgmma

Design: the semaphores count per (step, chunk), so a compute CTA waits for
exactly the rows its tile reads, not for a whole step; the tile order
(step, then row tile, then column tile) consumes chunks in the order the
communication CTAs send them (ascending chunk index per step), and the flat
tile counter balances tiles over compute CTAs across steps (no step barrier).
Semaphores are only signalled once each; waiters use ``decrement=False``, so
the communication CTA and every compute CTA that read chunk ``c`` of step
``s`` all see the same signal.

Deadlock freedom: the grid is persistent (at most one CTA per SM, so every
CTA is resident and runs to its waits). Communication CTA ``j`` of device
``r`` waits only for semaphores that CTA ``j`` of device ``r + 1`` signals,
and its items ``(s, c)`` wait only for items of step ``s - 1``; step 0 waits
for nothing, so by induction on ``s`` every communication item finishes.
Compute CTAs wait only for communication CTAs and signal nothing, so no
cycle can form, and no CTA waits on a compute CTA.

Preconditions: bf16 or fp16 operands (``peer_gemm.check_operands``); one
process holding every device of the axis (Mosaic GPU addresses peers by
mesh index); ``1 <= comm_ctas < num_ctas <= SM count`` (at most one
communication CTA per chunk is used); ``chunk_rows`` a multiple of ``tile_m`` dividing the
padded ``m``. Shapes need not be multiples of the tiles: ``m``, ``k`` and
``n_cols`` are padded with zeros and the result sliced back. On one device
there is nothing to send: the kernel is a persistent GEMM, and it also runs
in Mosaic GPU interpret mode (which has no remote refs or semaphores).
Hopper only.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from jaxmercury.errors import PreconditionError
from jaxmercury.kernels.config import param
from jaxmercury.kernels.fused_common import (
  INTERPRET_CTAS,
  gemm_memory,
  gemm_seconds,
  interpretable_devices,
  positive_ints,
  tile_of,
  tile_problem,
)
from jaxmercury.kernels.gemm.peer import check_operands, gathered_rows, pad_to, round_up, unpad_row_blocks
from jaxmercury.kernels.gemm.tiles import TileConfig, Tiles, accumulate, store_tile
from jaxmercury.kernels.mosaic_gpu import left_peer, sm_count, swizzled
from jaxmercury.kernels.placements import ALLGATHER
from jaxmercury.kernels.registry import DualGemm, FusedKernel

KERNEL = "fused_allgather_matmul_comm"
# Bytes of the communication CTAs' two SMEM slots at most (they reuse the compute pipeline's SMEM scope).
COMM_SMEM_BYTES = 128 * 1024


def fused_allgather_matmul_comm(a, b, axis_name: str, *, tiles: Tiles = Tiles(), comm_ctas: int = 4,
                                chunk_rows: int | None = None, out_dtype=None, num_ctas: int | None = None,
                                interpret: bool = False, gathered: bool = False):
  """``all_gather(a, axis_name, rows) @ b`` with the ring run by dedicated CTAs; call inside ``shard_map``.

  Args:
    a: this device's row shard ``[m, k]``, bf16 or fp16.
    b: ``[k, n_cols]``, same dtype (this device's columns).
    axis_name: the ``shard_map`` axis the rows are gathered over; it must span
      every device of the process (Mosaic GPU addresses peers by mesh index).
    tiles: tile sizes and pipeline depth of the compute CTAs (``Tiles``).
    comm_ctas: CTAs of the grid that only move A around the ring (at most one
      per chunk is used); unused on one device.
    chunk_rows: rows per chunk, the unit of transfer and of readiness
      (default ``tiles.tile_m``); a multiple of ``tile_m`` dividing the padded ``m``.
    out_dtype: the result's dtype (default ``a``'s).
    num_ctas: CTAs of the persistent grid, both kinds (default: the device's SM count).
    interpret: run in Mosaic GPU interpret mode (CPU); one device only.
    gathered: also return ``all_gather(a)`` (``[n * m, k]``), read from the
      ring's receive buffers (``peer_gemm.gathered_rows``): the backward's
      residual, with nothing sent again.

  Returns:
    ``[n * m, n_cols]``: row block ``j`` is ``a_j @ b``; with ``gathered``,
    ``(that, all_gather(a))``.

  Raises:
    PreconditionError: naming the operand, tile or count that the kernel cannot take.
  """
  n_dev = check_operands(KERNEL, a, b, axis_name, tiles, interpret)
  out_dtype = jnp.dtype(out_dtype or a.dtype)
  (m, k), n = a.shape, b.shape[1]
  mp, kp, np_ = round_up(m, tiles.tile_m), round_up(k, tiles.tile_k), round_up(n, tiles.tile_n)
  chunk_rows = tiles.tile_m if chunk_rows is None else chunk_rows
  num_ctas = num_ctas or sm_count()
  _check_counts(n_dev, comm_ctas, chunk_rows, num_ctas, tiles.tile_m, mp)
  if num_ctas is None:  # one device without an SM count (interpret mode on CPU): one CTA per tile
    num_ctas = (mp // tiles.tile_m) * (np_ // tiles.tile_n)
  out, received = _kernel(pad_to(a, mp, kp), pad_to(b, kp, np_), axis_name, n_dev, tiles, out_dtype, num_ctas,
                          comm_ctas, chunk_rows, interpret)
  out = unpad_row_blocks(out, n_dev, m, n)
  return (out, gathered_rows(a, received, axis_name)) if gathered else out


def _check_counts(n_dev: int, comm_ctas, chunk_rows, num_ctas, tile_m: int, padded_m: int):
  """``PreconditionError`` for a communication CTA count or chunk size the kernel cannot take."""
  for name, v in (("comm_ctas", comm_ctas), ("chunk_rows", chunk_rows)):
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
      raise PreconditionError(f"{KERNEL}: {name}={v!r} must be a positive int")
  if chunk_rows % tile_m or padded_m % chunk_rows:
    raise PreconditionError(f"{KERNEL}: chunk_rows={chunk_rows} must be a multiple of tile_m={tile_m} dividing "
                            f"the rows padded to the tiles ({padded_m})")
  if n_dev > 1 and num_ctas is None:
    raise PreconditionError(f"{KERNEL}: the device reports no SM count; pass num_ctas")
  if n_dev > 1 and comm_ctas >= num_ctas:
    raise PreconditionError(f"{KERNEL}: comm_ctas={comm_ctas} must be less than the grid's {num_ctas} CTAs "
                            "(the rest compute)")
  if n_dev > 1 and (sms := sm_count()) is not None and num_ctas > sms:
    raise PreconditionError(f"{KERNEL}: num_ctas={num_ctas} exceeds the device's {sms} SMs; the ring waits across "
                            "CTAs, so every CTA must be resident")


def _piece_cols(tiles: Tiles, k: int, itemsize: int) -> int:
  """Columns of one communication piece (``tile_m`` rows): at most 256 (a TMA box), dividing ``k``, and two
  slots no larger than the compute pipeline's buffers (the two kinds of CTA share one SMEM scope)."""
  tm, tn, tk = tiles.tile_m, tiles.tile_n, tiles.tile_k
  budget = min(COMM_SMEM_BYTES, tiles.max_concurrent_steps * (tm * tk + tk * tn) * itemsize)
  for cols in (256, 128):
    if k % cols == 0 and 2 * tm * cols * itemsize <= budget:
      return cols
  return 64


def _kernel(a, b, axis_name, n_dev: int, tiles: Tiles, out_dtype, num_ctas: int, comm_ctas: int,
            chunk_rows: int, interpret: bool, loopback: bool = False):
  """The kernel for ``n_dev`` ring steps; ``loopback`` (tests, one device): a ring of ``n_dev`` copies of ``a``.

  With ``loopback`` the communication CTAs store into this device's own
  ``received`` (no ``remote_ref``, no semaphores), so step ``s`` brings ``a``
  again and row block ``s`` of the result is ``a @ b``. It relies on the
  CTAs running one after another in index order, as in interpret mode:
  the communication CTAs (the first) then send every chunk of every step
  before any compute CTA reads one.
  """
  (m, k), n = a.shape, b.shape[1]
  tm, tn = tiles.tile_m, tiles.tile_n
  tiles_n = n // tn
  step_tiles = (m // tm) * tiles_n
  total_tiles = n_dev * step_tiles
  chunks = m // chunk_rows
  comm = min(comm_ctas, chunks) if n_dev > 1 else 0
  workers = min(num_ctas - comm, total_tiles)
  piece_cols = _piece_cols(tiles, k, a.dtype.itemsize)
  row_pieces, col_pieces = chunk_rows // tm, k // piece_cols
  peers = n_dev > 1 and not loopback  # the ring crosses devices: remote stores and semaphores

  def body(a_ref, b_ref, out_ref, *rest):
    received_ref, out_smem = rest if n_dev > 1 else (None, *rest)
    cta = lax.axis_index("cta")
    dev = lax.axis_index(axis_name) if peers else 0
    if peers:
      arrived = pl.get_global(plgpu.SemaphoreType.REGULAR((n_dev - 1, chunks)))  # [step, chunk], set once
      left, to_left = left_peer(dev, n_dev, received_ref)
    else:
      to_left = received_ref

    def compute_tile(source, t, s):
      """Output tile ``t`` (flat over steps) of step ``s`` from ``source``, A's shard (r + s) % n."""
      local = t - s * step_tiles
      mi, ni = local // tiles_n, lax.rem(local, tiles_n)
      rows, cols = pl.ds(mi * tm, tm), pl.ds(ni * tn, tn)
      acc = pl.run_scoped(lambda acc_ref: accumulate(acc_ref, source.at[rows, :], b_ref.at[:, cols], tiles),
                          plgpu.ACC((tm, tn), jnp.float32))
      out_rows = lax.rem(dev + s, n_dev) * m
      store_tile(acc, out_smem, out_ref.at[pl.ds(out_rows + mi * tm, tm), cols])

    def compute(worker):
      @pl.loop(worker, step_tiles, step=workers)
      def _own(t):  # step 0: this device's shard, nothing to wait for
        compute_tile(a_ref, t, 0)

      if n_dev > 1:
        # The same progression t = worker (mod workers), continued into steps 1 .. n-1.
        start = worker + (step_tiles - worker + workers - 1) // workers * workers

        @pl.loop(start, total_tiles, step=workers)
        def _received(t):
          s = t // step_tiles
          mi = (t - s * step_tiles) // tiles_n
          if peers:
            pl.semaphore_wait(arrived.at[s - 1, mi * tm // chunk_rows], value=1, decrement=False)
          compute_tile(received_ref.at[s - 1], t, s)

    def communicate(j, slots, loaded):
      def piece(c, i):
        return (pl.ds(c * chunk_rows + i // col_pieces * tm, tm),
                pl.ds(lax.rem(i, col_pieces) * piece_cols, piece_cols))

      def send(source, s, c):
        """Chunk ``c`` of ``source`` into ``received[s]`` of the left device, then signal ``[s, c]`` there."""
        plgpu.copy_gmem_to_smem(source.at[piece(c, 0)], slots.at[0], loaded.at[0])

        @pl.loop(0, row_pieces * col_pieces)
        def _piece(i):
          slot = lax.rem(i, 2)
          plgpu.barrier_wait(loaded.at[slot])
          plgpu.copy_smem_to_gmem(slots.at[slot], to_left.at[s].at[piece(c, i)])

          @pl.when(i + 1 < row_pieces * col_pieces)
          def _prefetch():
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # piece i - 1's store has read the other slot
            plgpu.copy_gmem_to_smem(source.at[piece(c, i + 1)], slots.at[1 - slot], loaded.at[1 - slot])

        plgpu.wait_smem_to_gmem(0, wait_read_only=False)  # the chunk has landed in the peer
        if peers:
          pl.semaphore_signal(arrived.at[s, c], device_id=left)

      @pl.loop(j, chunks, step=comm)
      def _own(c):
        send(a_ref, 0, c)

      @pl.loop(1, n_dev - 1)
      def _forward(s):
        @pl.loop(j, chunks, step=comm)
        def _chunk(c):
          if peers:  # the right device filled these rows
            pl.semaphore_wait(arrived.at[s - 1, c], value=1, decrement=False)
          send(received_ref.at[s - 1], s, c)

    if n_dev > 1:
      @pl.when(cta < comm)
      def _comm():
        pl.run_scoped(lambda slots, loaded: communicate(cta, slots, loaded),
                      plgpu.SMEM((2, tm, piece_cols), a.dtype), plgpu.Barrier(num_barriers=2))

      @pl.when(cta >= comm)
      def _compute():
        compute(cta - comm)
    else:
      compute(cta)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  out_type = [jax.ShapeDtypeStruct((n_dev * m, n), out_dtype)]
  if n_dev > 1:
    out_type.append(jax.ShapeDtypeStruct((n_dev - 1, m, k), a.dtype))  # filled by the right neighbour
  out_smem = plgpu.SMEM((tm, tn), out_dtype, transforms=swizzled(tn, out_dtype))
  result = plgpu.kernel(
      body, out_type=out_type, scratch_types=[out_smem], grid=(comm + workers,), grid_names=("cta",),
      interpret=plgpu.InterpretGPUParams() if interpret else None)(a, b)
  return result[0], (result[1] if n_dev > 1 else None)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CommConfig(TileConfig):
  """The compute CTAs' tiles, the CTAs that only move A, and rows per chunk in tiles of ``tile_m`` rows."""

  comm_ctas: int = param(4)
  chunk_tiles: int = param(1)


def _problem(p, config: CommConfig) -> str | None:
  return positive_ints(config, "comm_ctas", "chunk_tiles") or tile_problem(p, config)


def _tile(config: CommConfig) -> tuple[int, int, int]:
  """Rows padded to whole chunks, so that the chunks divide each device's rows."""
  rows, cols, depth = tile_of(config)
  return rows * config.chunk_tiles, cols, depth


def _make(p, config: CommConfig, interpret: bool):
  tiles, out_dtype = config.tiles(), p.c.dtype

  def per_device(a, b, gathered: bool = False):
    return fused_allgather_matmul_comm(a, b, p.level, tiles=tiles, comm_ctas=config.comm_ctas,
                                       chunk_rows=config.chunk_tiles * tiles.tile_m, out_dtype=out_dtype,
                                       num_ctas=INTERPRET_CTAS if interpret else None, interpret=interpret,
                                       gathered=gathered)
  return per_device


def _one_device(config: CommConfig) -> tuple[str, TileConfig] | None:
  """On one device no CTA communicates (``comm`` is 0): every CTA computes, as ``fused_allgather_matmul``'s do, on
  the same tiles and the same padding where a chunk is one tile of rows; the backward is the same dual kernel."""
  if config.chunk_tiles != 1:  # rows padded to whole chunks: another program
    return None
  return "fused_allgather_matmul", TileConfig(tile_m=config.tile_m, tile_n=config.tile_n, tile_k=config.tile_k,
                                              max_concurrent_steps=config.max_concurrent_steps)


FUSED_ALLGATHER_MATMUL_COMM = FusedKernel(
    name="fused_allgather_matmul_comm",
    description="our Mosaic GPU kernel (kernels.gemm.allgather_comm): comm_ctas CTAs of the persistent "
                "grid pass A's row shards round the ring by TMA through SMEM, one semaphore per chunk of "
                "chunk_tiles * tile_m rows; the other CTAs run the GEMM, waiting per tile for its rows; shapes "
                "padded to its tiles and chunks",
    placement=ALLGATHER, config=CommConfig, devices=interpretable_devices, problem=_problem, tile=_tile,
    make=_make, interpret=True, backward=DualGemm(dual="fused_matmul_reducescatter"), rate_kernel="mosaic_matmul",
    seconds=gemm_seconds, memory=gemm_memory, one_device=_one_device)
