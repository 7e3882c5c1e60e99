"""Ring attention in one warp-specialized Mosaic GPU kernel: two consumer warpgroups and a memory warpgroup per CTA.

The contract is ``fused_ring_attention``'s (``ring``; read its docstring: shapes, GQA,
``causal``, ``order`` and ``positions``, the unfused ``reference``): inside
``shard_map`` over ``n`` devices device ``r`` computes softmax attention of
its queries over the keys of every device and returns ``(out, lse)``. That
kernel runs one warpgroup per CTA, which issues the loads' consumers, both
wgmmas and the softmax in turn. Here each CTA runs three warpgroups, as
JAX's FlashAttention-3 kernel (``attention_mgpu._attention_forward``) does:
two consumer warpgroups, each with its own ``block_q``-row Q tile, take
turns on the tensor cores (a schedule barrier: one runs its softmax while
the other's wgmma runs), and one memory warpgroup issues every K/V load
into ``max_concurrent_steps`` SMEM slots and, in a forwarder item, stores
each tile on to the left neighbour.

Loop nest before (``fused_ring_attention``, one warpgroup)::

  for item (bi, hi, qi) of this CTA:                # block_q query rows
    for s in 0 .. n-1:                              # ring step: keys of device (r + s) % n
      if s > 0: wait until device r + 1 filled received[s - 1]
      for kv tile j (emit_pipeline):
        if forwarder and s < n - 1: store the K and V tiles into received[s] of device r - 1
        acc, m, l = online_softmax(acc, m, l, q_tile @ k_tile.T, v_tile)
      if forwarder and s < n - 1: signal step s to device r - 1
    out, lse = acc / l, m + log(l)

After (this kernel; per CTA, the three warpgroups run concurrently)::

  memory warpgroup (40 registers):                  # g: K/V tiles this CTA loaded so far
    for item (bi, hi, pair) of this CTA:            # persistent; forwarder items first
      for s in 0 .. n-1:
        tiles = every tile of the step if forwarding (forwarder and s < n - 1), else the needed ones
        if s > 0 and tiles: wait until device r + 1 filled received[s - 1]   # semaphore s - 1
        for run of the step's source:               # causal: one per chunk of contiguous positions
          for tile j of the run's tiles, loads pipelined max_concurrent_steps deep:
            slot = g % max_concurrent_steps; g += 1
            wait until both consumers released slot (k/v "consumed") and this slot's stores have read it
            TMA k, v tile j -> slot (k/v "loaded" barriers)
            once tile j (lagging max_concurrent_steps - 1 behind) has landed:
              if forwarding: TMA store k, v tile from the slot into received[s] of device r - 1
        if forwarding: wait until the stores landed; signal semaphore s of device r - 1
    wait for the consumers to release the last slots

  consumer warpgroup w in {0, 1} (232 registers):
    for item (bi, hi, pair) of this CTA:
      q_tile = q_r[bi, (2 pair + w) block_q rows, hi]; acc, m, l = 0, -inf, 0
      for every tile the memory warpgroup loads for this item, in the same order:
        wait "k loaded"; S = q_tile @ k.T (wgmma); schedule barrier; release k
        class(q_tile, k_tile) by global positions (causal; else visible); along a run the classes come in the
        order visible, partial, hidden, so a run is three loops (their lengths from the run's offset):
          visible: online softmax of S; partial: the same, scores masked with MASKED; hidden: nothing
        optimization barrier (the softmax is not sunk below the next line)
        schedule barrier; wait "v loaded"; acc += P @ v (wgmma, P from registers); release v
      out[bi, rows, hi], lse[bi, hi, rows] = acc / l, m + log(l)

  consumer warpgroup w, pipelined (one device without a mask; FlashAttention-3's intra-warpgroup pipelining):
    for item (bi, hi, pair) of this CTA:            # tiles t = 0 .. T-1: every tile of every ring step
      take the turn; S = q_tile @ k_0.T; give the turn; release k 0; m, l, P = online softmax of S
      for t in 1 .. T-1:
        wait "k loaded" t, "v loaded" t - 1
        take the turn; issue S = q_tile @ k_t.T, then acc += P @ v_{t-1}; give the turn to the other consumer
        wait for S's wgmma only; release k t; m, l, alpha, P = online softmax of S   # P V still runs
        acc = alpha * acc (waits for P V); release v t - 1
      take the turn; acc += P @ v_{T-1}; give the turn; release v T - 1; out, lse as above

  The turn is a token: consumer w waits on barrier turn[w] and arrives on turn[1 - w], so the two issue
  their wgmmas alternately and each one's softmax runs while the other's wgmmas do.

  With two slots this cannot deadlock although a consumer holds a V slot one
  tile longer: the memory warpgroup loads tile t + 1's K (waiting only for
  tile t - 1's K release, given before either consumer's next meeting)
  before it waits for tile t - 1's V release, and a consumer needs tile
  t + 1's V only at tile t + 2.

A work item is (batch, query head, pair of query tiles): ``2 block_q``
query rows, so ``s`` must be a multiple of ``2 block_q``. The consumers run
one online softmax over all tiles of all ring steps, so there is no
per-step log-sum-exp merge. They know nothing of the ring: a "loaded"
barrier completes only after the memory warpgroup waited for the step's
semaphore, and they need not wait for it themselves.

Ring and forwarding: as in ``fused_ring_attention``, ``received_k`` and
``received_v`` (``[n - 1, b, s, kv, d]``) are extra outputs that the right
neighbour fills; for each ``(b, kv head)`` exactly one item forwards (a
query block of the group's first query head: pair 0 in round-robin order,
items ``0 .. F - 1``, ``ring.round_robin_item``; the heaviest block in the
balanced order, its ranks ``0 .. F - 1``, ``ws_order.forwarders_first``;
``F = b * kv``). Its memory
warpgroup, once a tile's load completed, stores the K and V tile from SMEM
into the left neighbour's ``received[s]`` (``plgpu.remote_ref``) and does
not refill that slot before the stores have read it
(``wait_smem_to_gmem(..., wait_read_only=True)``); at the end of step
``s < n - 1`` it waits until its stores have landed and increments semaphore
``s`` of the left device (``mosaic_gpu.step_semaphores``: one per step, so that a
forwarder running ahead cannot let a waiter for an earlier step through).
Before loading step ``s``'s tiles every item waits until its device's
semaphore ``s - 1`` reaches ``F``.

Barrier protocol. Mosaic GPU tracks each barrier's phase per thread, so
every warpgroup that waits on a barrier waits on every one of its phases,
in order: the consumers wait on every "loaded" phase (a hidden tile too:
the math is skipped, the waits and arrivals are not), the memory warpgroup
waits on every "loaded" phase (lagging ``max_concurrent_steps - 1`` tiles
behind its loads, and draining at the end of each run) and on every
"consumed" phase (before it refills a slot, and for the last slots at the
end of the kernel). Both consumers take the same tiles in the same order
and meet the schedule barrier twice per tile; consumer 1 meets it once
more at the start of the kernel and consumer 0 once more at the end, which
makes them alternate. Tile counts are computed identically in all three
warpgroups (``needed_tiles``).

Causal masking: the tiles of a run whose first key follows the item's last
query are not loaded (except by a forwarder, which passes every tile on);
each consumer classifies each loaded (query tile, key tile) pair by global
positions: hidden (every key follows every query: no wgmma, no softmax),
visible (no mask) or partial (scores where key > query set to ``MASKED``, a
large finite negative: with ``-inf`` a row whose first tile is all masked
would compute ``exp(-inf - -inf)``, NaN; every row sees its own key, so its
first visible key rescales such garbage by ``exp2(MASKED - m) = 0``).

Deadlock freedom: the grid is persistent with at most one CTA per SM (the
three warpgroups' 232 + 232 + 40 registers per thread fill an SM's register
file) and, for ``n > 1``, at most the SM count of CTAs where the device
reports it, so every CTA is resident from the start. The ``F`` forwarder
items come first in either order (items or ranks ``0 .. F - 1``) and the
grid has at least ``F`` CTAs, so each forwarder is the first item of one of
CTAs ``0 .. F - 1``. Inside a CTA the memory warpgroup waits only for the
consumers (slots) and, at step ``s > 0``, for semaphore ``s - 1``; the
consumers wait only for the memory warpgroup's loads and for each other (the
schedule barrier, which both meet equally often). A forwarder at step ``s``
waits only for the forwarders of the right device at step ``s - 1``; step 0
waits for no peer, so by induction over ``s`` every forwarder signals every
step; every other item waits only for forwarders, so every item finishes.

Preconditions (``PreconditionError`` otherwise): those of
``fused_ring_attention`` (dtypes, shapes, ``d`` a multiple of 64 at most
256, blocks, ``order``, an axis spanning every device of the process, no
interpret mode with several devices) and: ``s`` a multiple of
``2 block_q``; causal zigzag chunks a multiple of ``2 block_q``; for
``n > 1`` at least ``b * kv`` CTAs and at most the SM count. Hopper only.

Interpret mode (CPU, one device): the same three warpgroups, barriers and
loop nest (JAX's interpreter runs each warpgroup as a thread and checks
that every waiter observed every barrier phase), except ``P V``: the
interpreter's wgmma reads its left operand from SMEM only, so there ``P V``
is a plain dot added to the accumulator, and the pipelined consumers keep
their accumulator in SMEM (the interpreter cannot store into a wgmma
accumulator).

Scheduling: causal tiles come in class order along a run (visible, then
partial, then hidden: ``visible_tiles``), so each consumer runs three loops,
the first without a branch or a mask; the CTAs take their items in the order
``ws_order.ItemOrder`` chooses (causal items heaviest first in snake order,
on one device in folded rounds where the blocks fold; one device without a
mask, heads in turn and the last round's key tiles shared out over every
CTA); each consumer loads its next item's Q tile into a second buffer while
it computes this one (not for causal items of more than
``PREFETCH_MAX_CAUSAL_TILES`` key tiles); on one device without a mask the
consumers are pipelined, and a CTA reads the key tiles of its odd items last
to first, so that a round starts on the tiles the round before it ended on
(still in L2).

Stages: ``_body`` sets up one CTA; the memory warpgroup is ``_Producer``
(per item, ring step and run of keys: the loads, and the forwarders' stores
and signals), the consumer warpgroups ``_Consumer`` (per tile: the scores,
the tile's class and mask, the online softmax, ``P V``; per item the
epilogue, ``_Consumer.store``); ``_merge_parts`` merges a split tail's parts
after the kernel. Which key tiles an item loads is ``needed_tiles``; which of
them it masks or skips, ``visible_tiles`` and ``softmax_step``'s mask.

Backward: ``DualPrograms``, on one device one cuDNN flash backward call from
this kernel's output and log-sum-exp; configured ``backward="ws_attention"``,
our one-pass kernel (``kernels.attention.ws_backward``) instead, one call per
device or per ring block pair. Not done yet: the pipelined consumers for
causal attention; a causal forwarder loads every K and V tile, hidden ones
too, to pass them on; in a ring, natural-order causal work is unbalanced
(zigzag balances it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxmercury.errors import PreconditionError
from jaxmercury.kernels import fused_common
from jaxmercury.kernels.attention import ring, ws_mask
from jaxmercury.kernels.attention.ring import (
  LN2,
  LOG2E,
  SequenceOrder,
  finish,
  initial_state,
  reference,
  round_robin_item,
  softmax_step,
)
from jaxmercury.kernels.attention.ws_backward import BackwardBlocks
from jaxmercury.kernels.attention.ws_order import CtaItems, ItemOrder, SplitTail
from jaxmercury.kernels.config import param
from jaxmercury.kernels.fused_common import (
  interpretable_devices,
  positive_ints,
  ring_attention_memory,
  ring_attention_seconds,
)
from jaxmercury.kernels.mosaic_gpu import SMEM_BYTES, left_peer, sm_count, step_semaphores, swizzled
from jaxmercury.kernels.placements import RING_ATTENTION
from jaxmercury.kernels.registry import DualPrograms, FusedKernel

__all__ = ["CONFIGS", "WsBlocks", "fused_ring_attention_ws", "reference"]

NAME = "fused_ring_attention_ws"
CONSUMERS = 2  # consumer warpgroups per CTA; warpgroup CONSUMERS issues the loads
CONSUMER_REGISTERS = 232
MEMORY_REGISTERS = 40
# Registers per thread each warpgroup starts with: an SM's 65536 over 384 threads, rounded down to 8. setmaxnreg's
# "increase" waits until the registers it asks for are free, so the warpgroups may ask for at most what they hold
# together.
LAUNCH_REGISTERS = 168
INTERPRET_CTAS = ring.INTERPRET_CTAS
# Shared memory beyond the buffers (barriers, alignment): an upper bound of what Mosaic GPU adds to the buffers'
# bytes in the configurations lowered for an H100, so smem_bytes bounds its count.
SMEM_OVERHEAD = 3 * 1024
# Causal items of more key tiles than this (over every ring step) load their Q tiles one at a time: the next
# item's prefetched tile did not pay there.
PREFETCH_MAX_CAUSAL_TILES = 256


@dataclasses.dataclass(frozen=True)
class WsBlocks(ring.Blocks):
  """Tile sizes and pipeline depth: ``block_q`` rows per consumer warpgroup (``2 block_q`` per work item).

  The same limits as ``ring.Blocks`` (its ``problem``), on this kernel's shared memory.
  """

  def smem_bytes(self, d: int, itemsize: int, q_buffers: int = 1, mask: bool = False) -> int:
    """``q_buffers`` Q tiles per consumer (reused for the outputs), K and V slots, two log-sum-exp rows, barriers
    and alignment; with ``mask``, each K slot's mask tile (a byte a pair of both consumers' rows)."""
    bq, bkv, slots = self.block_q, self.block_kv, self.max_concurrent_steps
    mask_bytes = slots * CONSUMERS * bq * bkv if mask else 0
    return ((q_buffers * CONSUMERS * bq + 2 * slots * bkv) * d * itemsize + CONSUMERS * 4 * bq + mask_bytes
            + SMEM_OVERHEAD)

  def mask_problem(self, d: int, itemsize: int = 2) -> str | None:
    """Why these tiles cannot take a mask array at head dimension ``d`` (its tiles' bytes beside K), or None."""
    if (need := self.smem_bytes(d, itemsize, mask=True)) > SMEM_BYTES:
      return f"with a mask array's tiles it needs {need} bytes of shared memory, more than {SMEM_BYTES}"
    return None


# The block configurations the GPU test tries (d = 128: 3 slots of 128 keys do not fit in shared memory).
CONFIGS = (WsBlocks(64, 128, 2), WsBlocks(64, 64, 3), WsBlocks(64, 64, 4))


@contextlib.contextmanager
def _named():
  """Re-raises ``fused_ring_attention``'s precondition errors under this kernel's name."""
  try:
    yield
  except PreconditionError as e:
    message = str(e)
    if message.startswith(f"{ring.NAME}:"):
      message = NAME + message[len(ring.NAME):]
    raise PreconditionError(message) from None


def fused_ring_attention_ws(q, k, v, axis_name: str | None, *, causal: bool = False, order: str = "natural",
                            chunks: int | None = None, block_q: int = 64, block_kv: int = 128,
                            max_concurrent_steps: int = 2, num_ctas: int | None = None, interpret: bool = False,
                            window: tuple[int, int] | None = None, q_segment_ids=None, kv_segment_ids=None,
                            offset=0, mask=None):
  """Attention over the keys of every device of ``axis_name``, warp-specialized; call inside ``shard_map``.

  Args:
    q: this device's queries ``[b, s, h, d]``, bf16 or fp16.
    k: this device's keys ``[b, s, kv, d]``, ``q``'s dtype; ``kv`` divides ``h``.
    v: this device's values, like ``k``.
    axis_name: the ``shard_map`` axis the sequence is sharded over; it must
      span every device of the process when it has more than one. None: no
      ring, this device's own keys (local attention, ``kernels.attention.ws``).
    causal: each query attends only to keys at global positions up to its
      own (``ring.positions``).
    order: ``"natural"`` or ``"zigzag"``, as for ``fused_ring_attention``.
    chunks: zigzag chunks of the whole sequence (default ``2 n``).
    block_q: query rows per consumer warpgroup (multiple of 64); a work
      item is ``2 block_q`` rows.
    block_kv: key rows per K/V tile (multiple of 64, at most 256).
    max_concurrent_steps: K/V SMEM slots (at least 2).
    num_ctas: CTAs of the persistent grid (default: the device's SM count, or
      ``INTERPRET_CTAS`` on a device without one); for several devices at
      least ``b * kv`` and at most the SM count.
    interpret: run in Mosaic GPU interpret mode (CPU); one device only.
    window: ``(left, right)``: query ``x`` keeps keys ``x - left .. x + right``
      (with ``causal``, ``.. x``); one device only (``axis_name`` None).
    q_segment_ids, kv_segment_ids: ``[b, s]`` int32 (both or neither): a query
      keeps the keys of its own id (packed sequences); one device only.
    offset: with a window, segment ids or a mask array, the position of the
      first query minus that of the first key (a block of a ring schedule;
      int or traced int32 scalar).
    mask: a boolean mask array ``[b or 1, h or 1, s, s]`` (a query keeps the
      keys it marks; batch and heads broadcast where of size 1, not copied);
      one device only.

  With a window, segment ids or a mask array the kernel takes its masked path
  (``ws_mask``): key tiles whose keys no query of an item keeps are not loaded,
  tiles no query of a consumer's tile keeps not computed, tiles every query
  keeps whole not compared; a row that keeps no key gets ``out = 0``,
  ``lse = -inf``. A mask array's partial tiles come as bytes beside K (TMA,
  the K barrier) and are compared in the scores' registers.

  Returns:
    ``(out [b, s, h, d]`` in ``q``'s dtype, ``lse [b, h, s]`` float32, natural log``)``.

  Raises:
    PreconditionError: the inputs, blocks, order or mesh do not fit (module docstring).
  """
  blocks = WsBlocks(block_q, block_kv, max_concurrent_steps)
  with _named():
    n_dev = ring.check_inputs(q, k, v, axis_name, blocks, interpret)
    seq_order = SequenceOrder.make(order, chunks, n_dev, q.shape[1], blocks)
  masking = ws_mask.Masking.make(causal, window, q_segment_ids is not None or kv_segment_ids is not None,
                                 mask is not None)
  if masking:
    _check_masked(q, axis_name, q_segment_ids, kv_segment_ids, mask)
    if masking.array and (reason := blocks.mask_problem(q.shape[3], q.dtype.itemsize)):
      raise PreconditionError(f"{NAME}: {reason}")
  s = q.shape[1]
  if s % (CONSUMERS * block_q):
    raise PreconditionError(f"{NAME}: the local sequence length {s} is not a multiple of 2 * block_q = "
                            f"{CONSUMERS * block_q}: a work item is two query tiles")
  if causal and seq_order.segment % (CONSUMERS * block_q):
    raise PreconditionError(f"{NAME}: zigzag chunks of {seq_order.segment} positions are not a multiple of "
                            f"2 * block_q = {CONSUMERS * block_q}: a work item's two query tiles must lie in one chunk")
  sms = sm_count()
  num_ctas = num_ctas or sms or INTERPRET_CTAS
  if not isinstance(num_ctas, int) or num_ctas < 1:
    raise PreconditionError(f"{NAME}: num_ctas={num_ctas!r} must be a positive int")
  ring.check_forwarders_resident(NAME, n_dev, num_ctas, k)
  if n_dev > 1 and sms and num_ctas > sms:
    raise PreconditionError(
        f"{NAME}: num_ctas={num_ctas} exceeds the {sms} SMs; one CTA (three warpgroups, 232 + 232 + 40 "
        "registers per thread) fills an SM, and the ring needs every CTA resident")
  if masking:
    return _masked(q, k, v, blocks, num_ctas, interpret, seq_order, masking, q_segment_ids, kv_segment_ids, offset,
                   mask)
  return _kernel(q, k, v, axis_name, n_dev, blocks, num_ctas, interpret, causal, seq_order)


def _check_masked(q, axis_name, q_segment_ids, kv_segment_ids, mask):
  """A window, segment ids or a mask array: one device, ids of the rows' shape, a mask of the scores'."""
  if axis_name is not None:
    raise PreconditionError(f"{NAME}: a window, segment ids or a mask array are taken on one device only "
                            f"(axis_name=None), not in a ring over {axis_name!r}; ring schedules run its blocks "
                            "(ws_attention)")
  b, s = q.shape[:2]
  if mask is not None:
    ws_mask.check_array(NAME, mask, b, q.shape[2], s, s)
  if q_segment_ids is None and kv_segment_ids is None:
    return
  for name, ids in (("q_segment_ids", q_segment_ids), ("kv_segment_ids", kv_segment_ids)):
    if ids is None or ids.shape != (b, s) or not jnp.issubdtype(ids.dtype, jnp.integer):
      raise PreconditionError(f"{NAME}: {name} must be integer ids [b, s] = [{b}, {s}] (both ids or neither); got "
                              f"{None if ids is None else (ids.shape, str(ids.dtype))}")


def _masked(q, k, v, blocks: WsBlocks, num_ctas: int, interpret: bool, order: SequenceOrder,
            masking: ws_mask.Masking, q_ids, kv_ids, offset, mask=None):
  """The masked path: the items' table and the query tiles' summaries (``ws_mask``), then the kernel; with a mask
  array, the tiles' kinds, each item's list of key tiles and the mask's bytes too."""
  b, s, h = q.shape[:3]
  bq, bkv = blocks.block_q, blocks.block_kv
  ids = (q_ids.astype(jnp.int32), kv_ids.astype(jnp.int32)) if masking.ids else (None, None)
  offset = jnp.asarray(offset, jnp.int32)
  summary = ws_mask.summaries(masking, *ids, offset, True, (b, s, s), bq)
  if masking.array:  # items by their lists of key tiles (ws_mask.tile_lists), per head where the mask has heads
    kinds = ws_mask.mask_kinds(summary if masking.ids else summary[:1], mask, bq, bkv)
    tiles, count = ws_mask.tile_lists(kinds, CONSUMERS)  # [kb, mh, pairs, key tiles]
    table = ws_mask.list_table(jnp.zeros_like(count), count, b, h)  # each item's whole list
    arrays = (kinds, tiles, ws_mask.mask_bytes(mask))
  else:
    first, count = ws_mask.spans(summary, CONSUMERS, bkv)
    table, arrays = ws_mask.item_table(first, count, h), ()
  extras = (table, summary, offset.reshape(1)) + (ids if masking.ids else ()) + arrays
  return _kernel(q, k, v, None, 1, blocks, num_ctas, interpret, False, order, masking=masking, extras=extras)


def needed_tiles(order: SequenceOrder, run: int, bkv: int, source, start: int, q_last, forwarding, causal: bool):
  """The K/V tiles of the run at local position ``start`` of ``source``'s keys that an item loads.

  All of them when not causal or when forwarding; else those whose first key
  is at most ``q_last``, the item's last query position (keys in a run are
  contiguous in global positions). The memory and the consumer warpgroups
  call this with the same arguments, so they agree on every tile count.
  """
  tiles = run // bkv
  if not causal:
    return tiles
  first = order.first(source, start)
  needed = jnp.clip((q_last + 1 - first + bkv - 1) // bkv, 0, tiles)
  return jnp.where(forwarding, tiles, needed).astype(jnp.int32)


def visible_tiles(offset, count, bq: int, bkv: int):
  """``(n_visible, n_shown)`` of a causal run's ``count`` loaded tiles: tiles ``0 .. n_visible - 1`` are visible
  (every key precedes every query of the consumer's tile: no mask), ``n_visible .. n_shown - 1`` partial (a mask),
  the rest hidden (every key follows every query: no math). ``offset``: the tile's first query position minus the
  run's first key position; tile ``j``'s, ``offset - j bkv``, falls with ``j``, so the classes come in that
  order."""
  n_visible = jnp.clip(jnp.maximum(offset + 1, 0) // bkv, 0, count)  # offset - j bkv >= bkv - 1
  n_shown = jnp.clip((jnp.maximum(offset + bq, 0) + bkv - 1) // bkv, n_visible, count)  # > -bq
  return n_visible, n_shown


@dataclasses.dataclass(frozen=True)
class _Plan(ws_mask.MaskedPlan):
  """What one call runs: the shapes, tiles, ring and item order every stage reads (static)."""

  b: int
  s_loc: int  # this device's positions
  h: int
  kv: int
  d: int
  g: int  # query heads per K/V head
  bq: int
  bkv: int
  slots: int  # K/V SMEM slots
  rows: int  # query rows per work item
  grid: int
  n_dev: int  # ring steps
  ring: bool
  peers: bool  # the ring crosses devices: remote stores and semaphores (not a loopback ring)
  causal: bool
  order: SequenceOrder
  run: int  # keys per run of contiguous global positions
  lag: int  # the memory warpgroup waits for tile j's load after issuing tile j + lag's
  items: ItemOrder
  q_buffers: int  # Q tiles per consumer: the next item's loads into the second while this one computes
  pipelined: bool  # FlashAttention-3's intra-warpgroup pipelining (one device without a mask)
  alternate: bool  # odd items read their key tiles last to first (one device without a mask)
  scale_log2: float
  dtype: np.dtype
  interpret: bool
  masking: ws_mask.Masking | None = None  # the masked path (window, segment ids): items and key tiles by a table

  @property
  def starts(self) -> range:
    """The local positions where the runs of a ring step's keys start."""
    return range(0, self.s_loc, self.run)

  @property
  def split(self) -> SplitTail | None:
    return self.items.split

  @staticmethod
  def make(q, k, n_dev: int, blocks: WsBlocks, num_ctas: int, interpret: bool, causal: bool, order: SequenceOrder,
           loopback: bool, masking: ws_mask.Masking | None = None) -> _Plan:
    b, s_loc, h, d = q.shape
    kv = k.shape[2]
    bq, bkv, slots = blocks.block_q, blocks.block_kv, blocks.max_concurrent_steps
    rows = CONSUMERS * bq
    pairs = s_loc // rows
    grid = min(b * h * pairs, num_ctas)
    ring_ = n_dev > 1
    lone = not (ring_ or causal or masking)  # one device without a mask: no forwarding, every item as long
    items = ItemOrder.make(b, h, kv, pairs, rows, grid, order, causal=causal, ring=ring_, key_tiles=s_loc // bkv,
                           table=masking is not None)
    prefetch = not ((causal or masking) and n_dev * s_loc // bkv > PREFETCH_MAX_CAUSAL_TILES)
    mask = masking is not None and masking.array
    q_buffers = 2 if prefetch and blocks.smem_bytes(d, q.dtype.itemsize, 2, mask) <= SMEM_BYTES else 1
    return _Plan(b=b, s_loc=s_loc, h=h, kv=kv, d=d, g=h // kv, bq=bq, bkv=bkv, slots=slots, rows=rows, grid=grid,
                 n_dev=n_dev, ring=ring_, peers=ring_ and not loopback, causal=causal, order=order,
                 run=order.segment if causal else s_loc, lag=slots - 1, items=items, q_buffers=q_buffers,
                 pipelined=lone, alternate=lone, scale_log2=LOG2E / math.sqrt(d), dtype=q.dtype,
                 interpret=interpret, masking=masking)


def _kernel(q, k, v, axis_name, n_dev: int, blocks: WsBlocks, num_ctas: int, interpret: bool, causal: bool,
            order: SequenceOrder, loopback: bool = False, masking: ws_mask.Masking | None = None, extras=()):
  """The kernel for ``n_dev`` ring steps; ``loopback`` (tests, one device, one CTA): a ring of ``n_dev`` copies;
  ``masking`` (one device): the masked path, ``extras`` its inputs (``_masked``).

  With ``loopback`` the forwarders store into this device's own ``received``
  (no ``remote_ref``, no semaphores: with one CTA the forwarder items run
  first and each waits until its stores landed), so step ``s`` brings this
  device's keys again at the global positions of device ``s``: the
  forwarding path runs in interpret mode.
  """
  assert not loopback or num_ctas == 1, "loopback needs one CTA: the forwarders must run first"
  assert CONSUMERS * CONSUMER_REGISTERS + MEMORY_REGISTERS <= (CONSUMERS + 1) * LAUNCH_REGISTERS, "would hang"
  p = _Plan.make(q, k, n_dev, blocks, num_ctas, interpret, causal, order, loopback, masking)
  dtype = p.dtype
  out_types = [jax.ShapeDtypeStruct(q.shape, dtype), jax.ShapeDtypeStruct((p.b, p.h, p.s_loc), jnp.float32)]
  if p.ring:  # received K and V, one slot per ring step after the first: filled by the right neighbour
    out_types += [jax.ShapeDtypeStruct((n_dev - 1, *k.shape), dtype)] * 2
  if p.split:  # each CTA's (at most two) parts of the last round's items: outputs and log-sum-exps
    out_types += [jax.ShapeDtypeStruct((p.grid, 2, p.rows, p.d), dtype),
                  jax.ShapeDtypeStruct((p.grid, 2, p.rows), jnp.float32)]
  kv_transforms = swizzled(p.d, dtype)
  with_ids = 2 if p.ids else 1  # arrivals on the Q and K barriers: the tiles' segment ids come with them
  with_mask = with_ids + CONSUMERS * p.array  # and on the K barrier the slot's mask tiles
  scratch = [plgpu.SMEM((CONSUMERS, p.q_buffers, p.bq, p.d), dtype, transforms=kv_transforms),
             plgpu.SMEM((p.slots, p.bkv, p.d), dtype, transforms=kv_transforms),
             plgpu.SMEM((p.slots, p.bkv, p.d), dtype, transforms=kv_transforms),
             plgpu.SMEM((CONSUMERS, p.bq), jnp.float32),
             plgpu.Barrier(num_arrivals=with_ids, num_barriers=CONSUMERS * p.q_buffers),  # Q tile loaded
             plgpu.Barrier(num_arrivals=with_mask, num_barriers=p.slots),  # K tile loaded
             plgpu.Barrier(num_barriers=p.slots),  # V tile loaded
             plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=p.slots),  # K slot released by both consumers
             plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=p.slots),  # V slot released
             plgpu.Barrier(num_arrivals=CONSUMERS),  # the consumers' schedule barrier
             plgpu.Barrier(num_barriers=CONSUMERS)]  # pipelined: consumer w's turn on the tensor cores
  if p.pipelined and interpret:
    scratch.append(plgpu.SMEM((CONSUMERS, p.bq, p.d), jnp.float32))  # the accumulators (on GPUs: registers)
  if p.ids:  # each consumer's Q tile's segment ids (per buffer), each K slot's
    scratch += [plgpu.SMEM((CONSUMERS, p.q_buffers, p.bq), jnp.int32), plgpu.SMEM((p.slots, p.bkv), jnp.int32)]
  if p.array:  # each K slot's mask tiles, one per consumer's rows (swizzled: the loads' rows hit every bank)
    scratch.append(plgpu.SMEM((p.slots, CONSUMERS, p.bq, p.bkv), jnp.uint8, transforms=swizzled(p.bkv, jnp.uint8)))
  results = plgpu.kernel(
      functools.partial(_body, p, axis_name), out_type=out_types, scratch_types=scratch, grid=(p.grid,),
      grid_names=("cta",), kernel_name=NAME, num_threads=CONSUMERS + 1, thread_name="wg",
      compiler_params=None if interpret else plgpu.CompilerParams(approx_math=True),
      interpret=plgpu.InterpretGPUParams() if interpret else None)(q, k, v, *extras)
  if p.split:
    return _merge_parts(p.split, *results, **p.items.round_robin())
  return results[0], results[1]


@dataclasses.dataclass(frozen=True)
class _Refs:
  """The kernel's operands, outputs and scratch (``_kernel``'s order)."""

  q: object
  k: object
  v: object
  out: object
  lse: object
  recv_k: object  # ring: the keys and values the right neighbour stored, one slot per later step
  recv_v: object
  part_o: object  # split tail: each CTA's parts of the last round's items
  part_lse: object
  qo_smem: object  # [consumer, buffer]: Q tiles, reused for the outputs
  k_smem: object  # [slot]
  v_smem: object
  lse_smem: object  # [consumer]
  q_loaded: object  # barriers: [consumer * q_buffers + buffer]
  k_loaded: object  # [slot]
  v_loaded: object
  k_consumed: object  # [slot], both consumers arrive
  v_consumed: object
  schedule: object  # the consumers' meetings
  turn: object  # pipelined: [consumer]
  acc_smem: object  # interpret mode, pipelined: the accumulators
  items: object = None  # the masked path (ws_mask): the items' table, the query tiles' summaries, the offset
  q_summary: object = None
  offset: object = None
  q_ids: object = None  # with segment ids: [b, s] each
  k_ids: object = None
  qid_smem: object = None  # [consumer, buffer]: the Q tile's ids
  kid_smem: object = None  # [slot]: the K tile's ids
  kinds: object = None  # with a mask array: [kb, mh, query tiles, key tiles] (ws_mask.mask_kinds)
  tiles: object = None  # [kb, mh, pairs, key tiles]: each item's key tiles (ws_mask.tile_lists)
  mask: object = None  # [mb * mh, s, s] bytes (ws_mask.mask_bytes)
  mask_smem: object = None  # [slot, consumer]: the K tile's mask tile

  @staticmethod
  def unpack(p: _Plan, q, k, v, *rest) -> _Refs:
    rest = list(rest)
    masked = [rest.pop(0) for _ in range(3)] if p.masking else [None] * 3
    ids = [rest.pop(0) for _ in range(2)] if p.ids else [None] * 2
    arrays = [rest.pop(0) for _ in range(3)] if p.array else [None] * 3
    out, lse = rest.pop(0), rest.pop(0)
    recv = (rest.pop(0), rest.pop(0)) if p.ring else (None, None)
    part = (rest.pop(0), rest.pop(0)) if p.split else (None, None)
    mask_smem = rest.pop() if p.array else None
    id_smem = [rest.pop(-2), rest.pop()] if p.ids else [None, None]
    acc_smem = rest.pop() if len(rest) > 11 else None
    return _Refs(q, k, v, out, lse, *recv, *part, *rest, acc_smem, *masked, *ids, *id_smem, *arrays, mask_smem)


class _Ring:
  """This device's ring (traced): the source of each step's keys, where forwarders store them, the semaphores."""

  def __init__(self, p: _Plan, refs: _Refs, dev):
    self.p, self.refs, self.dev = p, refs, dev
    if p.peers:
      self.arrived = step_semaphores(p.n_dev)
      self.left, *self.to_left = left_peer(dev, p.n_dev, refs.recv_k, refs.recv_v)
    elif p.ring:
      self.to_left = refs.recv_k, refs.recv_v

  def forwarding(self, forwards, s):
    """Whether an item (``forwards``: a forwarder item) passes step ``s``'s tiles on."""
    return forwards & (s < self.p.n_dev - 1) if self.p.ring else False

  def sources(self, s):
    """(keys, values, source device) of ring step ``s`` (a Python 0, or traced)."""
    if isinstance(s, int) and s == 0:
      return self.refs.k, self.refs.v, self.dev
    return self.refs.recv_k.at[s - 1], self.refs.recv_v.at[s - 1], lax.rem(self.dev + s, self.p.n_dev)

  def over_steps(self, step, carry):
    """``step(s, carry)`` for ring steps 0 .. n - 1 (0 with the local keys, the rest from ``received``)."""
    carry = step(0, carry)
    return lax.fori_loop(1, self.p.n_dev, step, carry) if self.p.ring else carry


@dataclasses.dataclass(frozen=True)
class _Cta:
  """One CTA's traced state: the plan, the refs, its index, its warpgroup's, its ring and its items."""

  p: _Plan
  refs: _Refs
  cta: object
  wg: object
  ring: _Ring
  items: CtaItems

  def item(self, i):
    """This CTA's item ``i``: ``(batch, query head, query block, forwards, the block's last query position)``."""
    bi, hi, pair, forwards = self.items.item(i)
    p = self.p
    q_last = p.order.first(self.ring.dev, pair * p.rows) + p.rows - 1 if p.causal else None
    return bi, hi, pair, forwards, q_last

  def key_tile(self, bi, hi, pair, entry):
    """The masked path: the key tile of an item's ``entry`` (its span's first tile + j; with a mask array, entry
    ``first + j`` of its list, ``ws_mask.tile_lists``)."""
    if not self.p.array:
      return entry
    kb, mh = self.refs.tiles.shape[:2]
    return self.refs.tiles[bi if kb > 1 else 0, hi if mh > 1 else 0, pair, entry]

  def mask_tiles(self, bi, hi, pair, tile):
    """The mask array's bytes of an item's query tiles (one per consumer) by key tile ``tile``: ``[block_q,
    block_kv]`` each."""
    p, mask = self.p, self.refs.mask
    index = ws_mask.array_index(self.refs.kinds, mask.shape[0], bi, hi)
    return [mask.at[index, pl.ds(pair * p.rows + w * p.bq, p.bq), pl.ds(tile * p.bkv, p.bkv)]
            for w in range(CONSUMERS)]


def _body(p: _Plan, axis_name, *refs):
  """One CTA: its memory warpgroup (``_Producer``) and its two consumer warpgroups (``_Consumer``)."""
  refs = _Refs.unpack(p, *refs)
  cta = lax.axis_index("cta")
  wg = lax.axis_index("wg")
  dev = lax.axis_index(axis_name) if p.peers else 0
  items = CtaItems(p.items, cta, refs.items)
  c = _Cta(p, refs, cta, wg, _Ring(p, refs, dev), items)
  pl.when(wg == CONSUMERS)(lambda: _Producer(c).run())
  pl.when(wg < CONSUMERS)(lambda: _Consumer(c).run())


class _Producer:
  """The memory warpgroup: every K/V tile of every item into the SMEM slots, in the order the consumers take them,
  ``lag`` loads in flight; a forwarder stores each tile from its slot into the left neighbour's ``received`` and
  signals each step."""

  def __init__(self, c: _Cta):
    self.c, self.p, self.refs = c, c.p, c.refs

  def run(self):
    plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")
    p, refs = self.p, self.refs
    loaded = lax.fori_loop(0, self.c.items.count, self.item, jnp.int32(0))

    @pl.loop(jnp.maximum(loaded - p.slots, 0), loaded)
    def _drain(tile):  # observe the consumers' last releases (every waiter sees every phase)
      slot = lax.rem(tile, p.slots)
      plgpu.barrier_wait(refs.k_consumed.at[slot])
      plgpu.barrier_wait(refs.v_consumed.at[slot])

  def item(self, i, loaded):
    """Item ``i``'s tiles after the ``loaded`` this CTA loaded before; returns the new count."""
    p, refs = self.p, self.refs
    bi, hi, pair, forwards, q_last = self.c.item(i)
    kvh = hi // p.g
    backward = lax.rem(i, 2) == 1 if p.alternate else False
    if p.split:
      first, count = self.c.items.span(i)
      return self.stream(refs.k.at[bi, :, kvh], refs.v.at[bi, :, kvh], count, loaded, False, None, first, backward)
    if p.masking:  # the item's span (or list) of key tiles, from its table row; a mask array's tiles beside K
      first, count = self.c.items.keys(i)
      ids = refs.k_ids.at[bi] if p.ids else None
      tile_of = lambda j: self.c.key_tile(bi, hi, pair, first + j)
      mask = functools.partial(self.c.mask_tiles, bi, hi, pair) if p.array else None
      return self.stream(refs.k.at[bi, :, kvh], refs.v.at[bi, :, kvh], count, loaded, False, None, first, ids=ids,
                         tile_of=tile_of, mask=mask)
    step = functools.partial(self.step, bi, kvh, forwards, q_last, backward)
    return self.c.ring.over_steps(step, loaded)

  def step(self, bi, kvh, forwards, q_last, backward, s, loaded):
    """Ring step ``s`` of an item: the needed tiles of each run (a forwarder's: every tile, stored on)."""
    p, ring_ = self.p, self.c.ring
    keys, values, source = ring_.sources(s)
    forwarding = ring_.forwarding(forwards, s)
    counts = [needed_tiles(p.order, p.run, p.bkv, source, start, q_last, forwarding, p.causal) for start in p.starts]
    if p.peers and not (isinstance(s, int) and s == 0):
      def wait():  # every forwarder of device r + 1 has filled received[s - 1]
        pl.semaphore_wait(ring_.arrived.at[s - 1], value=p.items.forwarders, decrement=False)
      if p.causal:  # only where this item reads received[s - 1]
        pl.when(functools.reduce(jnp.add, counts) > 0)(wait)
      else:
        wait()
    for start, count in zip(p.starts, counts):
      keys_run = pl.ds(start, p.run)
      dest = (ring_.to_left[0].at[s, bi, keys_run, kvh], ring_.to_left[1].at[s, bi, keys_run, kvh]) if p.ring else None
      loaded = self.stream(keys.at[bi, keys_run, kvh], values.at[bi, keys_run, kvh], count, loaded, forwarding,
                           dest, backward=backward)
    if p.ring:
      @pl.when(forwarding)
      def _signal():
        plgpu.wait_smem_to_gmem(0, wait_read_only=False)  # this step's stores have landed in the peer
        if p.peers:
          pl.semaphore_signal(ring_.arrived.at[s], device_id=ring_.left)
    return loaded

  def stream(self, keys, values, count, loaded, forwarding, dest, first=0, backward=False, ids=None, tile_of=None,
             mask=None):
    """Loads ``count`` tiles of ``keys, values [r, d]`` (and their segment ``ids [r]``), from tile ``first``
    (``backward``: from the last, down to ``first``; ``tile_of(j)``: the ``j``-th tile's index), into the slots
    after tile ``loaded``; ``mask(tile)``: the mask array's tiles to load beside K; forwards them."""

    @pl.loop(0, count + self.p.lag)
    def _tile(j):
      pl.when(j < count)(lambda: self.issue(keys, values, count, loaded, first, backward, j, ids, tile_of, mask))
      pl.when(j >= self.p.lag)(lambda: self.landed(loaded, forwarding, dest, j))

    return loaded + count

  def issue(self, keys, values, count, loaded, first, backward, j, ids=None, tile_of=None, mask=None):
    """The loads of tile ``j`` of a run into its slot, once both consumers (and a forwarder's stores) freed it;
    its ids and its mask tile with its keys."""
    p, refs = self.p, self.refs
    tile = loaded + j
    slot = lax.rem(tile, p.slots)
    if tile_of is not None:
      index = tile_of(j)
    else:
      index = jnp.where(backward, first + count - 1 - j, first + j) if p.alternate else first + j
    src = pl.ds(index * p.bkv, p.bkv)
    for smem, ref, consumed, barrier, pending in ((refs.k_smem, keys, refs.k_consumed, refs.k_loaded, 1),
                                                  (refs.v_smem, values, refs.v_consumed, refs.v_loaded, 0)):
      @pl.when(tile >= p.slots)
      def _():
        plgpu.barrier_wait(consumed.at[slot])  # both consumers are done with the slot's previous tile
      if p.ring:  # that tile's stores (all but the newest `pending`) have read the slot
        plgpu.wait_smem_to_gmem(pending, wait_read_only=True)
      plgpu.copy_gmem_to_smem(ref.at[src], smem.at[slot], barrier.at[slot])
    if ids is not None:  # the slot's K is free, so are its ids and its mask tile
      plgpu.copy_gmem_to_smem(ids.at[src], refs.kid_smem.at[slot], refs.k_loaded.at[slot])
    if mask is not None:  # a copy per consumer's rows: 2D tiles (a TMA copy strides at most 5 dimensions)
      for w, rows in enumerate(mask(index)):
        plgpu.copy_gmem_to_smem(rows, refs.mask_smem.at[slot, w], refs.k_loaded.at[slot])

  def landed(self, loaded, forwarding, dest, j):
    """Tile ``j - lag`` of a run has landed: a forwarder stores it on from its slot."""
    p, refs = self.p, self.refs
    i = j - p.lag
    slot = lax.rem(loaded + i, p.slots)
    dst = pl.ds(i * p.bkv, p.bkv)
    for smem, barrier, to in ((refs.k_smem, refs.k_loaded, 0), (refs.v_smem, refs.v_loaded, 1)):
      plgpu.barrier_wait(barrier.at[slot])
      if p.ring:
        @pl.when(forwarding)
        def _():
          plgpu.copy_smem_to_gmem(smem.at[slot], dest[to].at[dst])


class _Consumer:
  """A consumer warpgroup (``wg`` 0 or 1): its Q tile of each item against every tile the memory warpgroup loads
  for it, in turn with the other consumer on the tensor cores (module docstring), then the item's output."""

  def __init__(self, c: _Cta):
    self.c, self.p, self.refs, self.wg = c, c.p, c.refs, c.wg

  def run(self):
    plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
    self.lse_row = self.refs.lse_smem.at[self.wg]
    p, items = self.p, self.c.items
    if p.q_buffers > 1:
      pl.when(items.count > 0)(lambda: self.issue_q(0))
    # Consumer 1 starts one meeting ahead (pipelined: gives consumer 0 the first turn), so the two alternate;
    # consumer 0 meets once more (takes the last turn given) at the end, so every phase is waited for.
    meet = self.meet  # one function for both: one branch traced
    pl.when(self.wg == 1)(self.give_turn if p.pipelined else meet)
    lax.fori_loop(0, items.count, self.pipelined_item if p.pipelined else self.item, jnp.int32(0))
    pl.when(self.wg == 0)(self.take_turn if p.pipelined else meet)
    plgpu.wait_smem_to_gmem(0, wait_read_only=False)

  # ---------------------------------------------------------------- the two consumers' meetings and turns
  def meet(self):
    plgpu.barrier_arrive(self.refs.schedule)
    plgpu.barrier_wait(self.refs.schedule)

  def take_turn(self):  # the tensor cores are this consumer's until it gives the turn to the other
    plgpu.barrier_wait(self.refs.turn.at[self.wg])

  def give_turn(self):
    plgpu.barrier_arrive(self.refs.turn.at[1 - self.wg])

  # ---------------------------------------------------------------- Q tiles
  def q_buffer(self, i):  # traced even for one buffer: run_state cannot lower a constant index into the SMEM ref
    return lax.rem(i, self.p.q_buffers)

  def issue_q(self, i):
    """Starts loading item ``i``'s Q tile into this consumer's buffer ``i % q_buffers``."""
    p, refs, wg = self.p, self.refs, self.wg
    bi, hi, pair, _, _ = self.c.item(i)
    buf = self.q_buffer(i)
    plgpu.copy_gmem_to_smem(refs.q.at[bi, pl.ds(pair * p.rows + wg * p.bq, p.bq), hi], refs.qo_smem.at[wg, buf],
                            refs.q_loaded.at[wg * p.q_buffers + buf])
    if p.ids:
      plgpu.copy_gmem_to_smem(refs.q_ids.at[bi, pl.ds(pair * p.rows + wg * p.bq, p.bq)], refs.qid_smem.at[wg, buf],
                              refs.q_loaded.at[wg * p.q_buffers + buf])

  def load_q(self, i):
    """Item ``i``'s Q tile in this consumer's SMEM (the next item's started, with two buffers): the item's
    coordinates, its query rows and the tile. The next item's buffer held the previous item's output, whose
    store ``finish`` saw read."""
    p, refs, wg = self.p, self.refs, self.wg
    bi, hi, pair, forwards, q_last = self.c.item(i)
    buf = self.q_buffer(i)
    if p.q_buffers == 1:
      self.issue_q(i)
    plgpu.barrier_wait(refs.q_loaded.at[wg * p.q_buffers + buf])
    if p.q_buffers > 1:
      pl.when(i + 1 < self.c.items.count)(lambda: self.issue_q(i + 1))
    return bi, hi, pair, forwards, q_last, pl.ds(pair * p.rows + wg * p.bq, p.bq), refs.qo_smem.at[wg, buf]

  # ---------------------------------------------------------------- one tile
  def online_softmax(self, qk, m, l, mask_from=None):
    """``softmax_step`` of the raw scores, ``P`` in the inputs' dtype."""
    m_new, l, alpha, p = softmax_step(qk, m, l, self.p.scale_log2, mask_from)
    return m_new, l, alpha, p.astype(self.p.dtype)

  def arrived(self, loaded, j):
    """The slot of the item's tile ``j`` (after ``loaded``), once its K tile has landed."""
    slot = lax.rem(loaded + j, self.p.slots)
    plgpu.barrier_wait(self.refs.k_loaded.at[slot])
    return slot

  def update(self, carry, slot, q_smem, mask_from=None, masked=None):
    """One visible (``mask_from`` None) or partial tile: the scores, the online softmax, ``acc += P V``;
    ``masked(qk, slot)``: the masked path's scores of a partial tile (it reads the slot's ids)."""
    p, refs = self.p, self.refs
    acc, m, l = carry

    def scores(acc_ref):
      plgpu.wgmma(acc_ref, q_smem, refs.k_smem.at[slot].transpose((1, 0)))
      self.meet()  # the other consumer's softmax runs while this wgmma does
      plgpu.wgmma_wait(0)
      return acc_ref[...]

    qk = pl.run_scoped(scores, plgpu.ACC((p.bq, p.bkv), jnp.float32))
    if masked is not None:
      qk = masked(qk, slot)
    plgpu.barrier_arrive(refs.k_consumed.at[slot])
    if masked is not None:
      m_new, l, alpha, p16 = guarded_softmax_step(qk, m, l, p.scale_log2)
      p16 = p16.astype(p.dtype)
    else:
      m_new, l, alpha, p16 = self.online_softmax(qk, m, l, mask_from)
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    # The softmax is done before this consumer announces it, not sunk behind the barriers
    acc, m_new, l, p16 = lax.optimization_barrier((acc, m_new, l, p16))
    plgpu.barrier_arrive(refs.schedule)  # softmax done
    plgpu.barrier_wait(refs.v_loaded.at[slot])
    plgpu.barrier_wait(refs.schedule)  # the tensor cores are ours

    if p.interpret:  # the interpreter's wgmma takes A from SMEM only: P V as a plain dot
      acc = acc + jnp.dot(p16, refs.v_smem.at[slot][...], preferred_element_type=jnp.float32)
    else:
      def weighted(acc_ref):
        plgpu.wgmma(acc_ref, p16, refs.v_smem.at[slot])
        plgpu.wgmma_wait(0)
      acc = pl.run_state(weighted)(plgpu.ACC.init(acc))
    plgpu.barrier_arrive(refs.v_consumed.at[slot])
    return acc, m_new, l

  def hidden(self, carry, slot):
    """A hidden tile: no math, the same meetings, waits and releases as ``update``'s."""
    refs = self.refs
    self.meet()
    plgpu.barrier_arrive(refs.k_consumed.at[slot])
    plgpu.barrier_arrive(refs.schedule)
    plgpu.barrier_wait(refs.v_loaded.at[slot])
    plgpu.barrier_wait(refs.schedule)
    plgpu.barrier_arrive(refs.v_consumed.at[slot])
    return carry

  # ---------------------------------------------------------------- one item
  def item(self, i, loaded):
    """Item ``i`` (its tiles after the ``loaded`` this CTA took before): every ring step's runs, then the
    epilogue; returns the new count."""
    p = self.p
    if p.masking:
      return self.masked_item(i, loaded)
    bi, hi, pair, forwards, q_last, q_rows, q_smem = self.load_q(i)
    q_first = p.order.first(self.c.ring.dev, pair * p.rows + self.wg * p.bq) if p.causal else None
    step = functools.partial(self.step, i, forwards, q_last, q_first, q_smem)
    loaded, carry = self.c.ring.over_steps(step, (loaded, initial_state(p.bq, p.d)))
    self.store(carry, i, bi, hi, q_rows, q_smem)
    return loaded

  def step(self, i, forwards, q_last, q_first, q_smem, s, state):
    """Ring step ``s`` of item ``i``: each run's tiles, as many as the memory warpgroup loads
    (``needed_tiles``), by class (``visible_tiles``)."""
    p, ring_ = self.p, self.c.ring
    loaded, carry = state
    _, _, source = ring_.sources(s)
    forwarding = ring_.forwarding(forwards, s)
    for start in p.starts:
      count = (self.c.items.span(i)[1] if p.split
               else needed_tiles(p.order, p.run, p.bkv, source, start, q_last, forwarding, p.causal))
      offset = q_first - p.order.first(source, start) if p.causal else None
      arrived = functools.partial(self.arrived, loaded)
      visible = lambda j, carry: self.update(carry, arrived(j), q_smem)
      partial = lambda j, carry, offset=offset: self.update(carry, arrived(j), q_smem, mask_from=j * p.bkv - offset)
      hide = lambda j, carry: self.hidden(carry, arrived(j))
      if not p.causal:
        carry = lax.fori_loop(0, count, visible, carry)
      else:
        n_visible, n_shown = visible_tiles(offset, count, p.bq, p.bkv)
        carry = lax.fori_loop(0, n_visible, visible, carry)
        carry = lax.fori_loop(n_visible, n_shown, partial, carry)
        carry = lax.fori_loop(n_shown, count, hide, carry)
      loaded = loaded + count
    return loaded, carry

  # ---------------------------------------------------------------- the masked path (window, segment ids)
  def masked_item(self, i, loaded):
    """Item ``i`` on the masked path: the key tiles of its span or list (its table row), each by its kind for this
    consumer's query tile (``kind``: hidden, full, partial), then the epilogue (rows that kept no key: zeros);
    returns the new count."""
    p, refs, wg = self.p, self.refs, self.wg
    bi, hi, pair, _, _, q_rows, q_smem = self.load_q(i)
    first, count = self.c.items.keys(i)
    tile = pair * CONSUMERS + wg  # this consumer's query tile
    summary = None if p.array else [refs.q_summary[bi, tile, column] for column in range(ws_mask.SUMMARY)]
    q_ids = refs.qid_smem.at[wg, self.q_buffer(i)] if p.ids else None
    base = tile * p.bq + refs.offset[0]  # the tile's first query position in the keys' frame
    arrived = functools.partial(self.arrived, loaded)

    def one(j, carry):
      slot, key_tile = arrived(j), self.c.key_tile(bi, hi, pair, first + j)
      masked = functools.partial(self.mask, q_ids, base - key_tile * p.bkv)
      branches = [lambda carry: self.hidden(carry, slot), lambda carry: self.update(carry, slot, q_smem),
                  lambda carry: self.update(carry, slot, q_smem, masked=masked)]
      return lax.switch(self.kind(summary, bi, hi, tile, key_tile), branches, carry)

    carry = lax.fori_loop(0, count, one, initial_state(p.bq, p.d))
    self.store(carry, i, bi, hi, q_rows, q_smem)
    return loaded + count

  def kind(self, summary, bi, hi, tile, key_tile):
    """``ws_mask``'s kind (int32) of this consumer's query tile ``tile`` by key tile ``key_tile``: from the query
    tile's summary (``ws_mask.tile_kind``), or with a mask array from its combined kinds (``ws_mask.mask_kinds``)."""
    p = self.p
    if p.array:
      kb, mh = self.refs.kinds.shape[:2]
      return self.refs.kinds[bi if kb > 1 else 0, hi if mh > 1 else 0, tile, key_tile]
    k0 = key_tile * p.bkv
    return ws_mask.tile_kind(summary.__getitem__, k0, k0 + p.bkv - 1)

  def mask(self, q_ids, base, qk, slot):
    """A partial tile's scores, those of pairs not kept ``-inf`` (``guarded_softmax_step``): equal ids (the Q
    tile's and the slot's), the band (``base`` the tile's first query position minus its first key's) and the mask
    array's bytes (the slot's tile, this consumer's rows, in the scores' layout)."""
    p = self.p
    iota = lambda dim: plgpu.broadcasted_iota(jnp.int32, qk.shape, dim, layout=plgpu.Layout.WGMMA)
    equal = None
    if p.ids:
      row_ids = plgpu.load(q_ids, layout=plgpu.Layout.WGMMA.reduce(1))
      col_ids = plgpu.load(self.refs.kid_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
      equal = lax.broadcast_in_dim(row_ids, qk.shape, [0]) == lax.broadcast_in_dim(col_ids, qk.shape, [1])
    keep = p.masking.keep(equal, lambda: iota(0) - iota(1), base)
    if p.array:
      marked = plgpu.load(self.refs.mask_smem.at[slot, self.wg], layout=plgpu.Layout.WGMMA) != 0
      keep = marked if keep is None else keep & marked
    return jnp.where(keep, qk, -jnp.inf)

  def store(self, carry, i, bi, hi, q_rows, q_smem):
    """The epilogue: item ``i``'s output rows and log-sum-exps; with a split tail, a last-round part into its
    slot."""
    refs = self.refs
    if self.p.masking:  # rows may keep no key
      return finish_kept(carry, q_smem, self.lse_row, refs.out.at[bi, q_rows, hi], refs.lse.at[bi, hi, q_rows])
    write = functools.partial(finish, carry, q_smem, self.lse_row)
    if not self.p.split:
      return write(refs.out.at[bi, q_rows, hi], refs.lse.at[bi, hi, q_rows])
    whole, part, own = i < self.p.split.full, i - self.p.split.full, pl.ds(self.wg * self.p.bq, self.p.bq)
    pl.when(whole)(lambda: write(refs.out.at[bi, q_rows, hi], refs.lse.at[bi, hi, q_rows]))
    pl.when(~whole)(lambda: write(refs.part_o.at[self.c.cta, part, own], refs.part_lse.at[self.c.cta, part, own]))

  # ---------------------------------------------------------------- pipelined (one device without a mask)
  def weigh(self, acc_ref, p16, slot):
    """``acc += P V``, issued (the interpreter's: a plain dot on SMEM)."""
    if self.p.interpret:
      acc_ref[...] = acc_ref[...] + jnp.dot(p16, self.refs.v_smem.at[slot][...], preferred_element_type=jnp.float32)
    else:
      plgpu.wgmma(acc_ref, p16, self.refs.v_smem.at[slot])

  def scores_then(self, q_smem, slot, behind=None):
    """``Q K^T`` of the slot's tile, then ``behind()``'s wgmma; returns the scores once theirs retired."""
    refs = self.refs

    def issue(s_ref):
      self.take_turn()
      plgpu.wgmma(s_ref, q_smem, refs.k_smem.at[slot].transpose((1, 0)))
      if behind is not None:
        behind()
      self.give_turn()  # the other consumer's wgmmas queue behind these, its softmax ran meanwhile
      return plgpu.wgmma_accumulator_load(s_ref, wait_n=0 if behind is None else 1)
    qk = pl.run_scoped(issue, plgpu.ACC((self.p.bq, self.p.bkv), jnp.float32))
    plgpu.barrier_arrive(refs.k_consumed.at[slot])
    return qk

  def pipelined_item(self, i, loaded):
    """``item`` with tile ``t``'s softmax overlapping tile ``t - 1``'s ``P V`` (non-causal: every tile of every
    step, ``tiles`` in all, or a split tail's part); the consumers take turns issuing their wgmmas."""
    p, refs = self.p, self.refs
    bi, hi, _, _, _, q_rows, q_smem = self.load_q(i)
    tiles = self.c.items.span(i)[1] if p.split else p.n_dev * (p.s_loc // p.bkv)
    slot_of = lambda t: lax.rem(loaded + t, p.slots)

    def attend(acc_ref):
      _, m, l = initial_state(p.bq, p.d)
      plgpu.barrier_wait(refs.k_loaded.at[slot_of(0)])
      m, l, _, p16 = self.online_softmax(self.scores_then(q_smem, slot_of(0)), m, l)

      def tile(t, carry):
        m, l, p16 = carry
        plgpu.barrier_wait(refs.k_loaded.at[slot_of(t)])
        plgpu.barrier_wait(refs.v_loaded.at[slot_of(t - 1)])
        qk = self.scores_then(q_smem, slot_of(t), behind=lambda: self.weigh(acc_ref, p16, slot_of(t - 1)))
        m, l, alpha, p16 = self.online_softmax(qk, m, l)
        acc_ref[...] = acc_ref[...] * lax.broadcast_in_dim(alpha, (p.bq, p.d), [0])  # reading waits for P V
        plgpu.barrier_arrive(refs.v_consumed.at[slot_of(t - 1)])
        return m, l, p16

      m, l, p16 = lax.fori_loop(1, tiles, tile, (m, l, p16))
      plgpu.barrier_wait(refs.v_loaded.at[slot_of(tiles - 1)])
      self.take_turn()
      self.weigh(acc_ref, p16, slot_of(tiles - 1))
      self.give_turn()
      acc = acc_ref[...]
      plgpu.barrier_arrive(refs.v_consumed.at[slot_of(tiles - 1)])
      self.store((acc, m, l), i, bi, hi, q_rows, q_smem)

    zeros = initial_state(p.bq, p.d)[0]
    if p.interpret:  # the interpreter has no stores into wgmma accumulators: the accumulator lives in SMEM
      refs.acc_smem.at[self.wg][...] = zeros
      attend(refs.acc_smem.at[self.wg])
    else:
      pl.run_state(attend)(plgpu.ACC.init(zeros))
    return loaded + tiles


def guarded_softmax_step(qk, m, l, scale: float):
  """``ring.softmax_step`` of scores whose masked pairs are ``-inf``, for rows that may have kept nothing so far
  (``m = -inf``, ``l = 0``): their exponents are taken from 0, not from ``-inf``, so no ``exp2(-inf - -inf)``.

  (``MASKED``, finite, does not do here: ``qk * scale - m_new`` is one FMA, whose unrounded product leaves a
  fully masked row an error of about ``1e22`` in the exponent; the causal path never shows a row such a tile
  first, the masked path does.)"""
  m_new = jnp.maximum(m, qk.max(axis=1) * scale)
  base = jnp.where(m_new == -jnp.inf, 0.0, m_new)
  alpha = jnp.exp2(m - base)
  p = jnp.exp2(qk * scale - lax.broadcast_in_dim(base, qk.shape, [0]))
  return m_new, l * alpha + p.sum(axis=1), alpha, p


def finish_kept(carry, qo_smem, lse_smem, out_tile, lse_row):
  """``ring.finish`` where rows may have kept no key (``l = 0``, ``acc = 0``): ``out = 0``, ``lse = -inf``."""
  acc, m, l = carry
  kept = l > 0
  inverse = jnp.where(kept, 1.0 / l, 0.0)
  qo_smem[...] = (acc * lax.broadcast_in_dim(inverse, acc.shape, [0])).astype(qo_smem.dtype)
  lse_smem[...] = jnp.where(kept, m * LN2 + jnp.log(l), -jnp.inf)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(qo_smem, out_tile)
  plgpu.copy_smem_to_gmem(lse_smem, lse_row)
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _merge_parts(split: SplitTail, out, lse, part_o, part_lse, **items):
  """``out [b, s, h, d]`` and ``lse [b, h, s]`` with the last round's items merged from their parts."""
  parts = split.parts()
  width = max(map(len, parts.values()))
  ids = sorted(parts)
  cta = np.array([[c for c, _ in parts[t]] + [0] * (width - len(parts[t])) for t in ids], np.int32)
  slot = np.array([[k for _, k in parts[t]] + [0] * (width - len(parts[t])) for t in ids], np.int32)
  real = np.array([[True] * len(parts[t]) + [False] * (width - len(parts[t])) for t in ids])
  with jax.ensure_compile_time_eval():  # the items' coordinates are constants
    coords = round_robin_item(np.array(ids) + split.full * split.grid, **items)
  bi, hi, pair = (np.asarray(x) for x in coords[:3])
  rows = part_o.shape[2]
  part_lses = jnp.where(real[..., None], part_lse[cta, slot], -jnp.inf)  # [items, width, rows]
  merged = jax.nn.logsumexp(part_lses, axis=1)
  o = jnp.einsum("tpr,tprd->trd", jnp.exp(part_lses - merged[:, None]), part_o[cta, slot].astype(jnp.float32))
  at = pair[:, None] * rows + np.arange(rows)[None]  # [items, rows] positions
  return (out.at[bi[:, None], at, hi[:, None]].set(o.astype(out.dtype)),
          lse.at[bi[:, None], hi[:, None], at].set(merged))


# ------------------------------------------------------------------ as a fused kernel of ring schedules


# The local kernels whose backward blocks a fused ring attention's dual programs may run (``WsRingConfig.backward``).
BACKWARDS = (None, "ws_attention")


@dataclasses.dataclass(frozen=True, kw_only=True)
class WsRingConfig:
  """``block_q`` rows per consumer warpgroup (a work item is two), ``block_kv`` keys per tile, K/V slots; and
  ``backward``, the local kernel whose backward blocks run the dual programs (None: cuDNN's where the devices have
  it, ``schedules.dual.backward_schedule``; ``"ws_attention"``: ours, ``kernels.attention.ws_backward``, dq, dk
  and dv in one pass: the training step on one kernel family)."""

  OPEN = True
  block_q: int = param(64)
  block_kv: int = param(128)
  max_concurrent_steps: int = param(2)
  backward: str | None = param(None, "ws_attention")


def _problem(p, config: WsRingConfig) -> str | None:
  """The blocks at the program's head dimension; a work item's two query tiles and the key tiles in each device's
  positions (each zigzag chunk's); the backward kernel's blocks."""
  if reason := positive_ints(config, "block_q", "block_kv", "max_concurrent_steps"):
    return reason
  blocks = WsBlocks(config.block_q, config.block_kv, config.max_concurrent_steps)
  if reason := blocks.problem(p.local_shape()[4], p.itemsize):
    return reason
  if config.backward not in BACKWARDS:
    return f"backward={config.backward!r} is not one of {list(BACKWARDS)}"
  if config.backward is not None:
    backward = BackwardBlocks()
    reason = backward.problem(p.local_shape()[4], p.itemsize) or ring.rows_problem(
        p, {"the backward's query tile": backward.block_q, "the backward's key pair": 2 * backward.block_kv})
    if reason:
      return f"backward={config.backward!r}: {reason}"
  return ring.rows_problem(p, {"2 x block_q": 2 * config.block_q, "block_kv": config.block_kv})


def _make(p, config: WsRingConfig, interpret: bool):
  blocks = {k: v for k, v in dataclasses.asdict(config).items() if k != "backward"}
  return ring.per_device(fused_ring_attention_ws, p, lambda: fused_common.INTERPRET_CTAS if interpret else None,
                         interpret=interpret, **blocks)


FUSED_RING_ATTENTION_WS = FusedKernel(
    name=NAME,
    description="our warp-specialized Mosaic GPU kernel (kernels.attention.ws_forward): two consumer warpgroups "
                "take turns on the tensor cores while a memory warpgroup loads K and V tiles and forwards them to "
                "the left neighbour; one CTA per SM",
    placement=RING_ATTENTION, config=WsRingConfig, devices=interpretable_devices, problem=_problem,
    tile=lambda config: (2 * config.block_q, config.block_kv, 64), make=_make, interpret=True,
    backward=DualPrograms(), rate_kernel=NAME, seconds=ring_attention_seconds, memory=ring_attention_memory)
