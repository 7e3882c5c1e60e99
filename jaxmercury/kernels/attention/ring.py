"""Ring attention in one Mosaic GPU kernel: K and V travel the ring inside the kernel.

Inside ``shard_map`` over a mesh axis of ``n`` devices, with the sequence
sharded over that axis, device ``r`` holds ``q_r [b, s, h, d]`` and
``k_r, v_r [b, s, kv, d]`` (GQA: query head ``h`` reads key/value head
``h // (h / kv)``) and computes softmax attention of its queries over the
keys of every device, with scores scaled by ``1 / sqrt(d)``; causal or not.

Causal means: a query attends to the keys at global sequence positions up
to its own. Which global positions a device holds is the ``order``
(``positions``): ``"natural"``, device ``r`` holds ``[r s, (r + 1) s)``;
``"zigzag"``, the sequence is cut into ``c`` chunks (default ``c = 2 n``)
stored in the order ``Schedule.zigzag`` gives them (``schedules.orders``:
true chunks ``0, c-1, 1, c-2, ...``), so with ``c = 2 n`` device ``r`` holds
chunks ``r`` and ``2 n - 1 - r`` and every device has the same causal work.

The unfused program (``reference``)::

  k_all, v_all = all_gather(k), all_gather(v)     # one collective, n * s keys
  out, lse = attention(q_r, k_all, v_all)

The ring schedule it replaces moves ``k, v`` with ``ppermute`` between
attention blocks and merges the blocks' partial results by log-sum-exp. Here
the loop nest is one kernel::

  for item (bi, hi, qi) of this CTA:              # persistent CTAs; forwarder items first
    q_tile = q_r[bi, qi, hi]                      # TMA to SMEM, once per item
    acc, m, l = 0, -inf, 0                        # online softmax state, in registers
    for s in 0 .. n-1:                            # ring step: keys of device (r + s) % n
      source = k_r, v_r if s == 0 else received_k[s - 1], received_v[s - 1]
      needed(run) = forwarder and s < n - 1, or not causal, or run's first key <= q_tile's last query
      if s > 0 and any run is needed: wait until device r + 1 has filled received[s - 1]
      for run of source:                          # causal: one per chunk of contiguous positions; else one
        if not needed(run): skip it (no loads)
        for kv tile j of run[bi, :, hi // g]:     # TMA to SMEM, pipelined
          if forwarder and s < n - 1: store the K and V tiles into received[s] of device r - 1
          match class(q_tile, k_tile) by global positions (causal; else visible):
            hidden:  nothing                      # every key follows every query
            visible: acc, m, l = online_softmax(acc, m, l, q_tile @ k_tile.T, v_tile)   # wgmma, wgmma
            partial: the same with scores where key > query set to MASKED
      if forwarder and s < n - 1: signal step s to device r - 1
    out[bi, qi, hi], lse[bi, hi, qi] = acc / l, m + log(l)

Design:

- No collective runs outside the kernel. ``received_k`` and ``received_v``
  (``[n - 1, b, s, kv, d]``) are extra outputs of the kernel that the right
  neighbour fills: every K and V tile a forwarder reads from SMEM for its own
  wgmma is also stored, by TMA, into the left neighbour's buffer
  (``plgpu.remote_ref``).
- For each ``(b, kv head)`` exactly one work item forwards: query block 0 of
  query head ``kv_head * g``. There are ``F = b * kv`` forwarders. At the end
  of ring step ``s`` a forwarder waits until its stores have landed and
  increments global semaphore ``s`` of the left device; before reading
  ``received[s - 1]`` every item waits until that device's semaphore
  ``s - 1`` reaches ``F``. One semaphore per step, not one counter: a fast
  forwarder's signal for step ``s + 1`` must not let a waiter for step ``s``
  through.
- The merge across ring steps is the online softmax itself: ``m`` and ``l``
  run across all tiles of all steps, so no per-step log-sum-exp merge exists.
- Causal masking classifies each (query tile, key tile) pair by global
  positions (tiles never straddle a chunk, so each is a contiguous range):
  hidden pairs skip both wgmmas, visible ones run unmasked, partial ones
  mask elementwise with ``MASKED``, a large finite negative score (with
  ``-inf`` a row whose first tile is all masked would compute
  ``exp(-inf - -inf)``, NaN). Its first visible key rescales such a row's
  state by ``exp2(MASKED - m) = 0``; every row sees its own key, so ``l > 0``
  at the end. A run of keys wholly after the tile is not even loaded, except
  by a forwarder: it still stores every K and V tile into the left
  neighbour and signals every step, so the ring never stalls on the mask.
- One warpgroup per CTA computes ``S = Q K^T`` and ``P V`` with wgmma (``P``
  from registers); ``plgpu.emit_pipeline`` streams K and V tiles
  ``max_concurrent_steps - 1`` ahead of the tile in use. A forwarder issues
  its stores of a tile before that tile's wgmmas and waits at the end of the
  step until they have read the slot, which the pipeline then refills.

Deadlock freedom: the grid is persistent, the ``F`` forwarder items are
work items ``0 .. F - 1`` and the grid must have at least ``F`` CTAs, so
every forwarder is the first item of CTA ``0 .. F - 1``, resident from the
start (by default one CTA per SM, all resident at once; with ``num_ctas`` up
to twice the SM count, two share an SM where their registers and shared
memory fit; if they do not, CTAs beyond the resident ones start as earlier
ones end, and the forwarders rely on being among the first CTAs to start,
which CUDA does in practice but does not promise). A forwarder at step ``s`` waits only for the
forwarders of the right device at step ``s - 1``; by induction over ``s``
every forwarder finishes, and every other item waits only for forwarders.

Preconditions (``PreconditionError`` otherwise): q, k, v bf16 or fp16 of one
dtype, ``q [b, s, h, d]`` and ``k, v [b, s, kv, d]`` with ``kv`` dividing
``h``; ``s`` a multiple of ``block_q`` and ``block_kv``; ``d`` a multiple of
64 and at most 256; ``order`` natural or zigzag; for zigzag, ``c`` even and
a multiple of ``n``, and the chunks (``s / 2`` positions with ``c = 2 n``,
so ``s`` even) multiples of ``block_q`` and ``block_kv``; for ``n > 1``: the
axis spans every device of the process (Mosaic GPU addresses peers by their
index in the whole mesh), at least ``b * kv`` CTAs, and no interpret mode
(the interpreter has no peer memory). Hopper only.

Interpret mode (CPU, one device) runs the same loop nest except ``P V``: the
interpreter's wgmma reads its left operand from SMEM only, so there ``P V``
is a plain dot added to the accumulator.

Not done yet: one warpgroup per CTA issues the loads' consumers, both
wgmmas and the softmax in turn (no warp specialization, no second
warpgroup to overlap softmax with the tensor cores), so the local attention
is slower than FlashAttention-3; the backward pass of ``ring_attention``
is the unfused reference's; a causal forwarder loads every K and V tile,
hidden ones too, to pass them on; and in natural order causal work is
unbalanced (device ``n - 1`` computes ``2 n - 1`` times device 0's share):
zigzag balances it.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from jaxmercury.errors import PreconditionError
from jaxmercury.ir import orders
from jaxmercury.kernels import fused_common
from jaxmercury.kernels.config import param
from jaxmercury.kernels.fused_common import (
  interpretable_devices,
  positive_ints,
  ring_attention_memory,
  ring_attention_seconds,
)
from jaxmercury.kernels.mosaic_gpu import (
  ACC_VALUES,
  HALF_DTYPES,
  SMEM_BYTES,
  left_peer,
  ring_size,
  sm_count,
  step_semaphores,
  swizzled,
)
from jaxmercury.kernels.placements import RING_ATTENTION
from jaxmercury.kernels.registry import DualPrograms, FusedKernel

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
NAME = "fused_ring_attention"
INTERPRET_CTAS = 4  # the default grid where the device reports no SM count (CPU, interpret mode)


@dataclasses.dataclass(frozen=True)
class Blocks:
  """Tile sizes and pipeline depth of the kernel."""

  block_q: int = 64
  block_kv: int = 128
  max_concurrent_steps: int = 2

  def smem_bytes(self, d: int, itemsize: int) -> int:
    """The Q tile (reused for the output), K and V pipeline slots, the log-sum-exp row."""
    return (self.block_q + 2 * self.max_concurrent_steps * self.block_kv) * d * itemsize + 4 * self.block_q

  def problem(self, d: int, itemsize: int = 2) -> str | None:
    """Why these blocks cannot compile for head dimension ``d``, or None."""
    bq, bkv = self.block_q, self.block_kv
    if bq % 64:
      return f"block_q={bq} must be a multiple of 64 (wgmma's M)"
    if bkv % 64 or bkv > 256:
      return f"block_kv={bkv} must be a multiple of 64 and at most 256 (wgmma's N)"
    if self.max_concurrent_steps < 2:
      return f"max_concurrent_steps={self.max_concurrent_steps} must be at least 2 (loads ahead of the wgmmas)"
    if bq * (bkv + d) > ACC_VALUES:
      return (f"block_q x (block_kv + d) = {bq * (bkv + d)} float32 scores and accumulators exceed "
              f"one warpgroup's registers ({ACC_VALUES})")
    if self.smem_bytes(d, itemsize) > SMEM_BYTES:
      return f"needs {self.smem_bytes(d, itemsize)} bytes of shared memory, more than {SMEM_BYTES}"
    return None


# The block configurations the GPU test and the benchmark try.
CONFIGS = (Blocks(64, 128, 2), Blocks(64, 128, 3), Blocks(64, 64, 4))


def fused_ring_attention(q, k, v, axis_name: str, *, causal: bool = False, order: str = "natural",
                         chunks: int | None = None, block_q: int = 64, block_kv: int = 128,
                         max_concurrent_steps: int = 2, num_ctas: int | None = None, interpret: bool = False):
  """Attention over the keys of every device of ``axis_name``, causal or not; call inside ``shard_map``.

  Args:
    q: this device's queries ``[b, s, h, d]``, bf16 or fp16.
    k: this device's keys ``[b, s, kv, d]``, ``q``'s dtype; ``kv`` divides ``h``.
    v: this device's values, like ``k``.
    axis_name: the ``shard_map`` axis the sequence is sharded over; it must
      span every device of the process when it has more than one.
    causal: each query attends only to keys at global positions up to its
      own (``positions`` says which global positions a device holds).
    order: how the sequence is laid out over the devices: ``"natural"``
      (device ``r`` holds ``[r s, (r + 1) s)``) or ``"zigzag"`` (cut into
      ``chunks`` chunks stored in the order ``Schedule.zigzag`` gives them).
    chunks: zigzag chunks of the whole sequence (even, a multiple of the
      device count); default ``2 n``, the ``ring_zigzag`` strategy's.
    block_q: query rows per work item (multiple of 64).
    block_kv: key rows per pipelined K/V tile (multiple of 64, at most 256).
    max_concurrent_steps: K/V tiles in flight (at least 2).
    num_ctas: CTAs of the persistent grid (default: the device's SM count, or
      ``INTERPRET_CTAS`` on a device without one); at least ``b * kv`` when
      the axis has several devices.
    interpret: run in Mosaic GPU interpret mode (CPU); one device only.

  Returns:
    ``(out [b, s, h, d]`` in ``q``'s dtype, ``lse [b, h, s]`` float32, natural log``)``.

  Raises:
    PreconditionError: the inputs, blocks, order or mesh do not fit (module docstring).
  """
  blocks = Blocks(block_q, block_kv, max_concurrent_steps)
  n_dev = check_inputs(q, k, v, axis_name, blocks, interpret)
  seq_order = SequenceOrder.make(order, chunks, n_dev, q.shape[1], blocks)
  num_ctas = num_ctas or sm_count() or INTERPRET_CTAS
  check_forwarders_resident(NAME, n_dev, num_ctas, k)
  return _kernel(q, k, v, axis_name, n_dev, blocks, num_ctas, interpret, causal, seq_order)


def check_forwarders_resident(name: str, n_dev: int, num_ctas: int, k):
  """A ring of several devices needs one resident CTA per forwarder item, ``b * kv`` of them (keys ``k``)."""
  b, kv = k.shape[0], k.shape[2]
  if n_dev > 1 and num_ctas < b * kv:
    raise PreconditionError(
        f"{name}: the ring needs one resident CTA per forwarder, b * kv = {b} * {kv} = {b * kv}, "
        f"but the grid has {num_ctas} CTAs")


ORDERS = ("natural", "zigzag")


def positions(order: str, device, n: int, s: int, local, chunks: int | None = None):
  """Global sequence positions of local positions ``local`` of ``device`` (of ``n``, ``s`` positions each).

  ``"natural"``: ``device * s + local``. ``"zigzag"``: the sequence is cut
  into ``chunks`` chunks (default ``2 n``) stored in zigzag order, as
  ``Schedule.zigzag`` stores an axis (``schedules.orders``): stored position
  ``device * s + local`` holds the true position this returns. ``device``
  and ``local`` may be ints, arrays or traced scalars.
  """
  stored = device * s + local
  if order == "natural":
    return stored
  if order != "zigzag":
    raise PreconditionError(f"{NAME}: order={order!r} must be one of {ORDERS}")
  return orders.true_positions(stored, n * s, chunks or 2 * n)


@dataclasses.dataclass(frozen=True)
class SequenceOrder:
  """How a device's ``s`` positions map to global ones: contiguous runs (``segment`` long) of ``order``."""

  order: str
  chunks: int | None
  n: int
  s: int
  segment: int

  @staticmethod
  def make(order: str, chunks: int | None, n: int, s: int, blocks: Blocks) -> "SequenceOrder":
    """Checks the order's preconditions; ``PreconditionError`` naming the problem."""
    if order not in ORDERS:
      raise PreconditionError(f"{NAME}: order={order!r} must be one of {ORDERS}")
    if order == "natural":
      if chunks is not None:
        raise PreconditionError(f"{NAME}: chunks={chunks} applies to order='zigzag' only")
      return SequenceOrder(order, None, n, s, s)
    chunks = 2 * n if chunks is None else chunks
    if not isinstance(chunks, int) or chunks < 2 or chunks % 2 or chunks % n:
      raise PreconditionError(f"{NAME}: zigzag chunks={chunks!r} must be even and a multiple of the {n} devices")
    per_device = chunks // n
    if s % per_device:
      raise PreconditionError(f"{NAME}: the local sequence length {s} does not split into {per_device} zigzag chunks")
    segment = s // per_device
    for name, block in (("block_q", blocks.block_q), ("block_kv", blocks.block_kv)):
      if segment % block:
        raise PreconditionError(f"{NAME}: zigzag chunks of {segment} positions are not a multiple of "
                                f"{name}={block}: a tile must lie in one chunk")
    return SequenceOrder(order, chunks, n, s, segment)

  def first(self, device, local):
    """Global position of local position ``local`` of ``device`` (the start of a run when tiles align)."""
    return positions(self.order, device, self.n, self.s, local, self.chunks)


def check_inputs(q, k, v, axis_name: str, blocks: Blocks, interpret: bool) -> int:
  """Raises ``PreconditionError`` naming what the kernel cannot take; returns the axis's device count."""
  if not (q.dtype == k.dtype == v.dtype) or q.dtype not in HALF_DTYPES:
    raise PreconditionError(f"{NAME}: q, k and v must all be bf16 or fp16, got {q.dtype}, {k.dtype}, {v.dtype}")
  if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
    raise PreconditionError(f"{NAME}: q [b, s, h, d] and k, v [b, s, kv, d] expected, "
                            f"got {q.shape}, {k.shape}, {v.shape}")
  (b, s, h, d), (bk, sk, kv, dk) = q.shape, k.shape
  if (b, s, d) != (bk, sk, dk):
    raise PreconditionError(f"{NAME}: q [b, s, h, d] and k, v [b, s, kv, d] must agree on b, s and d, "
                            f"got {q.shape}, {k.shape}")
  if h % kv:
    raise PreconditionError(f"{NAME}: {h} query heads are not a multiple of {kv} key/value heads (GQA)")
  if d % 64 or d > 256:
    raise PreconditionError(f"{NAME}: head dimension d={d} must be a multiple of 64 and at most 256")
  if reason := blocks.problem(d, q.dtype.itemsize):
    raise PreconditionError(f"{NAME}: {reason}")
  for name, block in (("block_q", blocks.block_q), ("block_kv", blocks.block_kv)):
    if s % block:
      raise PreconditionError(f"{NAME}: the local sequence length {s} is not a multiple of {name}={block}")
  return 1 if axis_name is None else ring_size(NAME, axis_name, interpret)


def round_robin_item(t, forwarders: int, per_group: int, nq: int, g: int, kv: int):
  """Work item ``t`` -> (batch, query head, query block, forwards?).

  Items ``0 .. forwarders - 1`` are the forwarders, one per (batch, kv head)
  group: query block 0 of the group's first query head. The rest enumerate
  each group's other ``per_group - 1`` (query head, query block) pairs. With
  no forwarders (0: one device), each group's pairs in turn.
  """
  if not forwarders:
    group, j = t // per_group, lax.rem(t, per_group)
    return group // kv, lax.rem(group, kv) * g + j // nq, lax.rem(j, nq), False
  forwards = t < forwarders
  rest = jnp.maximum(t - forwarders, 0)
  others = max(per_group - 1, 1)
  group = jnp.where(forwards, t, rest // others)
  j = jnp.where(forwards, 0, lax.rem(rest, others) + 1)  # index within the group: head-in-group * nq + block
  return group // kv, lax.rem(group, kv) * g + j // nq, lax.rem(j, nq), forwards


def _kernel(q, k, v, axis_name, n_dev: int, blocks: Blocks, num_ctas: int, interpret: bool, causal: bool,
            order: SequenceOrder, loopback: bool = False):
  """The kernel for ``n_dev`` ring steps; ``loopback`` (tests, one device, one CTA): a ring of ``n_dev`` copies.

  With ``loopback`` the forwarders store into this device's own
  ``received`` (no ``remote_ref``, no semaphores: with one CTA the forwarder
  items run first and each waits until its stores landed), so step ``s``
  brings this device's keys again at the global positions of device ``s``:
  the forwarding path runs in interpret mode.
  """
  assert not loopback or num_ctas == 1, "loopback needs one CTA: the forwarders must run first"
  b, s_loc, h, d = q.shape
  kv = k.shape[2]
  g = h // kv
  bq, bkv = blocks.block_q, blocks.block_kv
  nq = s_loc // bq
  forwarders, per_group = b * kv, g * nq
  work = b * h * nq
  grid = min(work, num_ctas)
  ring = n_dev > 1
  peers = ring and not loopback  # the ring crosses devices: remote stores and semaphores
  scale_log2 = LOG2E / math.sqrt(d)  # scores in base-2 units: exp2(qk * scale_log2) = exp(qk / sqrt(d))
  dtype = q.dtype
  # Causal: the keys a ring step brings are visited as runs of contiguous global positions (one per zigzag
  # chunk), each streamed by its own pipeline; non-causal: one run, the whole block.
  run = order.segment if causal else s_loc

  def body(q_ref, k_ref, v_ref, out_ref, lse_ref, *rest):
    recv_k, recv_v, qo_smem, lse_smem, q_barrier = rest if ring else (None, None, *rest)
    cta = lax.axis_index("cta")
    dev = lax.axis_index(axis_name) if peers else 0
    if peers:
      arrived = step_semaphores(n_dev)
      left, *to_left = left_peer(dev, n_dev, recv_k, recv_v)
    elif ring:
      to_left = recv_k, recv_v

    @pl.loop(cta, work, step=grid)
    def _work_item(t):
      bi, hi, qi, forwards = round_robin_item(t, forwarders, per_group, nq, g, kv)
      kvh = hi // g
      q_rows = pl.ds(qi * bq, bq)
      q_first = order.first(dev, qi * bq) if causal else None  # global position of the tile's first query
      plgpu.copy_gmem_to_smem(q_ref.at[bi, q_rows, hi], qo_smem, q_barrier.at[0])
      plgpu.barrier_wait(q_barrier.at[0])

      def ring_step(keys, values, s, carry, *, received: bool):
        forwarding = forwards & (s < n_dev - 1) if ring else False
        source = lax.rem(dev + s, n_dev) if ring else 0  # the device whose keys this step brings
        starts = range(0, s_loc, run)
        # Causal: a run whose first key follows the tile's last query is all masked: no loads unless forwarded.
        needed = [(order.first(source, start) <= q_first + bq - 1) | forwarding if causal else True
                  for start in starts]
        if received and peers:  # every forwarder of r + 1 has filled received[s - 1]; waited for where it is read
          @pl.when(functools.reduce(jnp.logical_or, needed) if causal else True)
          def _wait():
            pl.semaphore_wait(arrived.at[s - 1], value=forwarders, decrement=False)

        for start, run_needed in zip(starts, needed):
          def forward(j, k_smem, v_smem, start=start):
            @pl.when(forwarding)
            def _():
              rows = pl.ds(start + j * bkv, bkv)
              plgpu.copy_smem_to_gmem(k_smem, to_left[0].at[s, bi, rows, kvh])
              plgpu.copy_smem_to_gmem(v_smem, to_left[1].at[s, bi, rows, kvh])

          def release(_):
            @pl.when(forwarding)
            def _():
              plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the stores have read the slot the pipeline refills

          def attend(carry, start=start, forward=forward, release=release):
            keys_run = pl.ds(start, run)
            offset = q_first - order.first(source, start) if causal else None
            return _attend(qo_smem, keys.at[bi, keys_run, kvh], values.at[bi, keys_run, kvh], carry, blocks,
                           scale_log2, dtype, interpret, forward if ring else None, release if ring else None,
                           offset)

          carry = lax.cond(run_needed, attend, lambda carry: carry, carry) if causal else attend(carry)
        if ring:
          @pl.when(forwarding)
          def _signal():
            plgpu.wait_smem_to_gmem(0, wait_read_only=False)  # this step's stores have landed in the peer
            if peers:
              pl.semaphore_signal(arrived.at[s], device_id=left)
        return carry

      carry = ring_step(k_ref, v_ref, 0, initial_state(bq, d), received=False)
      if ring:
        def later_step(s, carry):
          return ring_step(recv_k.at[s - 1], recv_v.at[s - 1], s, carry, received=True)
        carry = lax.fori_loop(1, n_dev, later_step, carry)
      finish(carry, qo_smem, lse_smem, out_ref.at[bi, q_rows, hi], lse_ref.at[bi, hi, q_rows])

    plgpu.wait_smem_to_gmem(0, wait_read_only=False)

  out_types = [jax.ShapeDtypeStruct(q.shape, dtype), jax.ShapeDtypeStruct((b, h, s_loc), jnp.float32)]
  if ring:  # received K and V, one slot per ring step after the first: filled by the right neighbour
    out_types += [jax.ShapeDtypeStruct((n_dev - 1, *k.shape), dtype)] * 2
  scratch = [plgpu.SMEM((bq, d), dtype, transforms=swizzled(d, dtype)),
             plgpu.SMEM((bq,), jnp.float32),
             plgpu.Barrier(num_barriers=1)]
  results = plgpu.kernel(
      body, out_type=out_types, scratch_types=scratch, grid=(grid,), grid_names=("cta",), kernel_name=NAME,
      compiler_params=None if interpret else plgpu.CompilerParams(approx_math=True),
      interpret=plgpu.InterpretGPUParams() if interpret else None)(q, k, v)
  return results[0], results[1]


def initial_state(bq: int, d: int):
  """Online softmax state (acc, running max in base-2 units, running sum) in wgmma layouts."""
  row = plgpu.Layout.WGMMA.reduce(1)
  return (plgpu.layout_cast(jnp.zeros((bq, d), jnp.float32), plgpu.Layout.WGMMA),
          plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32), row),
          plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), row))


# Causal classes of a (query tile, key tile) pair, the branches of _attend's switch.
HIDDEN, VISIBLE, PARTIAL = 0, 1, 2
# A masked raw score: finite (also in base-2 units, scaled by log2(e) / sqrt(d)), so that a row whose first tile
# is all masked gets m = MASKED * scale and exp2(0) = 1 rather than exp2(-inf - -inf) = NaN; its first visible
# key then rescales that row's sum and accumulator by exp2(MASKED * scale - m) = 0. Every row sees its own key,
# so one comes.
MASKED = -1e30


def softmax_step(qk, m, l, scale: float, mask_from=None):
  """One tile of the online softmax on raw scores ``qk [bq, bkv]`` (wgmma layout), ``scale`` converting them to
  base 2 (``log2(e) / sqrt(d)``), and the running max ``m`` (base 2) and sum ``l``: ``(m_new, l_new, alpha, p)``,
  ``alpha`` rescaling the old accumulator; ``mask_from``: scores are kept where query row - key row >= it, the
  rest masked (``MASKED``). The scale is applied to the row max and inside the exponent, where
  ``qk * scale - m_new`` is one FMA per score, not to the scores first."""
  if mask_from is not None:
    rows = plgpu.broadcasted_iota(jnp.int32, qk.shape, 0, layout=plgpu.Layout.WGMMA)
    cols = plgpu.broadcasted_iota(jnp.int32, qk.shape, 1, layout=plgpu.Layout.WGMMA)
    qk = jnp.where(rows - cols >= mask_from, qk, MASKED)
  m_new = jnp.maximum(m, qk.max(axis=1) * scale)
  alpha = jnp.exp2(m - m_new)
  p = jnp.exp2(qk * scale - lax.broadcast_in_dim(m_new, qk.shape, [0]))
  return m_new, l * alpha + p.sum(axis=1), alpha, p


def _attend(q_smem, keys, values, carry, blocks: Blocks, scale_log2: float, dtype, interpret: bool,
            on_tile=None, after_tile=None, offset=None):
  """Online softmax of the Q tile over ``keys, values [r, d]``, streamed through SMEM; returns the new state.

  ``on_tile(j, k_smem, v_smem)`` runs when tile ``j`` has arrived, before its
  wgmmas (a forwarder stores the tiles from there); ``after_tile(j)`` runs at
  the end of the step, after the wgmmas have retired: the pipeline refills
  the slot right after it, so stores started by ``on_tile`` must have read
  the slot by then.

  ``offset``: None (non-causal), else the global position of the Q tile's
  first row minus that of ``keys``' first row (``keys`` are contiguous in
  global positions). Tile ``j`` is then hidden (every key follows every
  query: no compute), visible (no key follows any query: no mask) or
  partial (an elementwise mask).
  """
  bq, bkv = blocks.block_q, blocks.block_kv
  d = keys.shape[-1]

  def update(carry, k_smem, v_smem, mask_from=None):
    """One tile's online softmax step; ``mask_from``: keep scores where query row - key row >= it."""
    acc, m, l = carry

    def scores(acc_ref):
      plgpu.wgmma(acc_ref, q_smem, k_smem.transpose((1, 0)))
      plgpu.wgmma_wait(0)
      return acc_ref[...]

    qk = pl.run_scoped(scores, plgpu.ACC((bq, bkv), jnp.float32))
    m_new, l, alpha, p = softmax_step(qk, m, l, scale_log2, mask_from)
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

    def weighted(acc_ref):
      plgpu.wgmma(acc_ref, p.astype(dtype), v_smem)
      plgpu.wgmma_wait(0)

    if interpret:  # the interpreter's wgmma takes A from SMEM only: P V as a plain dot
      acc = acc + jnp.dot(p.astype(dtype), v_smem[...], preferred_element_type=jnp.float32)
    else:  # P from registers, accumulated into acc's registers
      acc = pl.run_state(weighted)(plgpu.ACC.init(acc))
    return acc, m_new, l

  def step(indices, k_smem, v_smem, carry):
    j = indices[0]
    if on_tile is not None:
      on_tile(j, k_smem, v_smem)
    if offset is None:
      carry = update(carry, k_smem, v_smem)
    else:
      gap = offset - j * bkv  # first query's position minus the tile's first key's
      kind = jnp.where(gap >= bkv - 1, VISIBLE, jnp.where(gap <= -bq, HIDDEN, PARTIAL)).astype(jnp.int32)
      carry = lax.switch(kind, [lambda c, k_, v_: c,
                                lambda c, k_, v_: update(c, k_, v_),
                                lambda c, k_, v_: update(c, k_, v_, mask_from=-gap)], carry, k_smem, v_smem)
    if after_tile is not None:
      after_tile(j)
    return carry

  specs = [plgpu.BlockSpec((bkv, d), lambda j: (j, 0), transforms=swizzled(d, dtype))] * 2
  pipeline = plgpu.emit_pipeline(step, grid=(keys.shape[0] // bkv,), in_specs=specs,
                                 max_concurrent_steps=blocks.max_concurrent_steps, init_carry=carry)
  return pipeline(keys, values)


def finish(carry, qo_smem, lse_smem, out_tile, lse_row):
  """Normalises the accumulator and stores it and the natural-log log-sum-exp through SMEM (TMA)."""
  acc, m, l = carry
  qo_smem[...] = (acc / lax.broadcast_in_dim(l, acc.shape, [0])).astype(qo_smem.dtype)
  lse_smem[...] = m * LN2 + jnp.log(l)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(qo_smem, out_tile)
  plgpu.copy_smem_to_gmem(lse_smem, lse_row)
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the SMEM tiles may be reused by the next item


def reference(q, k, v, axis_name: str, *, causal: bool = False, order: str = "natural", chunks: int | None = None):
  """The unfused program: ``all_gather`` K and V over ``axis_name``, float32 softmax attention.

  ``causal``, ``order`` and ``chunks`` as for ``fused_ring_attention``: the
  mask compares the global positions ``positions`` gives.

  Returns:
    ``(out [b, s, h, d]`` in ``q``'s dtype, ``lse [b, h, s]`` float32``)``.
  """
  b, s, h, d = q.shape
  kv = k.shape[2]
  k_all = lax.all_gather(k, axis_name, axis=1, tiled=True)
  v_all = lax.all_gather(v, axis_name, axis=1, tiled=True)
  qg = q.reshape(b, s, kv, h // kv, d)
  scores = jnp.einsum("bskgd,btkd->bkgst", qg, k_all, preferred_element_type=jnp.float32) / math.sqrt(d)
  if causal:
    n = lax.axis_size(axis_name)
    mine = positions(order, lax.axis_index(axis_name), n, s, jnp.arange(s), chunks)
    every = positions(order, 0, n, s, jnp.arange(n * s), chunks)  # gathered keys: device-major storage order
    scores = jnp.where(mine[:, None] >= every[None, :], scores, MASKED)  # finite: no NaN in the gradient
  lse = jax.nn.logsumexp(scores, axis=-1)
  p = jnp.exp(scores - lse[..., None])
  out = jnp.einsum("bkgst,btkd->bskgd", p, v_all.astype(jnp.float32))
  return out.reshape(b, s, h, d).astype(q.dtype), lse.reshape(b, h, s)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _ring_attention(q, k, v, axis_name, kernel_params):
  return fused_ring_attention(q, k, v, axis_name, **dict(kernel_params))


def _forward(q, k, v, axis_name, kernel_params):
  return _ring_attention(q, k, v, axis_name, kernel_params), (q, k, v)


def _backward(axis_name, kernel_params, residuals, cotangents):
  mask = {key: value for key, value in kernel_params if key in ("causal", "order", "chunks")}
  _, pullback = jax.vjp(lambda q, k, v: reference(q, k, v, axis_name, **mask), *residuals)
  return pullback(cotangents)


_ring_attention.defvjp(_forward, _backward)


def ring_attention(q, k, v, axis_name: str, **kernel_params):
  """``fused_ring_attention`` with a gradient; call inside ``shard_map``.

  The backward pass recomputes the unfused ``reference`` (with the same
  ``causal``, ``order`` and ``chunks``) and differentiates it (its
  ``all_gather`` transposes to a reduce-scatter of the K and V gradients),
  so training works; only the forward pass is fused.

  Args:
    q, k, v, axis_name: as for ``fused_ring_attention``.
    **kernel_params: ``fused_ring_attention``'s keyword arguments.

  Returns:
    ``(out, lse)`` as ``fused_ring_attention``; both carry gradients.
  """
  return _ring_attention(q, k, v, axis_name, tuple(sorted(kernel_params.items())))


# ------------------------------------------------------------------ as a fused kernel of ring schedules


@dataclasses.dataclass(frozen=True, kw_only=True)
class RingConfig:
  """Blocks, pipeline depth and CTAs per SM. The default: blocks small enough for two CTAs per SM, so that one
  CTA's softmax overlaps the other's wgmma."""

  OPEN = True
  block_q: int = param(64)
  block_kv: int = param(64)
  max_concurrent_steps: int = param(2)
  ctas_per_sm: int = param(2)


def rows_problem(p, rows: dict) -> str | None:
  """The first of ``rows`` (name -> rows of a tile) that does not divide each device's positions (each zigzag
  chunk's, in zigzag order): a tile lies in one contiguous run of positions."""
  run = p.run()
  where = "each device's positions" if p.chunks is None else "each zigzag chunk's positions"
  for name, n in rows.items():
    if run % n:
      return f"{name}={n} does not divide {where} of {p.axes['i']!r} ({run})"
  return None


def _problem(p, config: RingConfig) -> str | None:
  """The blocks at the program's head dimension, every CTA resident, tiles in each device's positions."""
  if reason := positive_ints(config):
    return reason
  d = p.local_shape()[4]
  blocks = Blocks(config.block_q, config.block_kv, config.max_concurrent_steps)
  if reason := blocks.problem(d, p.itemsize):
    return reason
  smem = blocks.smem_bytes(d, p.itemsize)
  if config.ctas_per_sm * smem > SMEM_BYTES:  # every CTA must be resident: the ring waits on them
    return (f"ctas_per_sm={config.ctas_per_sm}: {config.ctas_per_sm} CTAs of {smem} bytes of shared memory "
            f"(head dim {d}) exceed one SM's {SMEM_BYTES}")
  return rows_problem(p, {"block_q": config.block_q, "block_kv": config.block_kv})


def per_device(kernel, p, num_ctas, **blocks):
  """``kernel`` (a fused ring attention) on the stored blocks, ``q [b, s, hk, g, d]`` and ``k, v [b, s, hk, d]``,
  in the placement's mask and order; ``num_ctas()`` is asked when traced.

  ``run(q, k, v)`` returns the output block; ``run(q, k, v, with_lse=True)`` the blocks of the backward's
  residuals, the parts of the ``attention_with_lse`` program's ``olse`` (``lower``'s ``widths``): the output
  ``[b, s, hk, g, d]`` in its dtype and the log-sum-exp ``[b, s, hk, g, 1]`` float32.
  """
  def run(q, k, v, *, with_lse: bool = False):
    b, s, hk, g, d = q.shape
    out, lse = kernel(q.reshape(b, s, hk * g, d), k, v, p.level, causal=p.causal, order=p.order,
                      chunks=p.chunks, num_ctas=num_ctas(), **blocks)
    out = out.reshape(b, s, hk, g, d)
    if not with_lse:
      return out
    lse = jnp.transpose(lse, (0, 2, 1)).reshape(b, s, hk, g, 1)  # [b, h, s] -> [b, s, hk, g, 1]
    return out, lse.astype(jnp.float32)
  return run


def _make(p, config: RingConfig, interpret: bool):
  return per_device(fused_ring_attention, p,
                    lambda: fused_common.INTERPRET_CTAS if interpret else config.ctas_per_sm * sm_count(),
                    block_q=config.block_q, block_kv=config.block_kv,
                    max_concurrent_steps=config.max_concurrent_steps, interpret=interpret)


FUSED_RING_ATTENTION = FusedKernel(
    name=NAME,
    description="our Mosaic GPU kernel (kernels.attention.ring): K and V tiles forwarded by TMA into the left "
                "neighbour as they are consumed, online softmax across the ring steps, causal tiles masked or "
                "skipped by global position; ctas_per_sm CTAs share each SM",
    placement=RING_ATTENTION, config=RingConfig, devices=interpretable_devices, problem=_problem,
    tile=lambda config: (config.block_q, config.block_kv, 64), make=_make, interpret=True,
    backward=DualPrograms(), rate_kernel=NAME, seconds=ring_attention_seconds, memory=ring_attention_memory)
