"""Ring attention in one warp-specialized Mosaic GPU kernel: two consumer warpgroups and a memory warpgroup per CTA.

The contract is ``fused_ring_attention``'s (read its docstring: shapes, GQA,
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

  consumer warpgroup w, ``pipelined=True`` (FlashAttention-3's intra-warpgroup pipelining; not causal):
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
items ``0 .. F - 1``, ``round_robin_item``; the heaviest block in the balanced order,
its ranks ``0 .. F - 1``, ``_forwarders_first``; ``F = b * kv``). Its memory
warpgroup, once a tile's load completed, stores the K and V tile from SMEM
into the left neighbour's ``received[s]`` (``plgpu.remote_ref``) and does
not refill that slot before the stores have read it
(``wait_smem_to_gmem(..., wait_read_only=True)``); at the end of step
``s < n - 1`` it waits until its stores have landed and increments semaphore
``s`` of the left device (``peer_gemm.step_semaphores``: one per step, so that a
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
warpgroups (``_run_tiles``).

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

Scheduling (``Pipeline``; each change measured against the last on one
H100 and one H200 by ``benchmarks.ws_local``): causal tiles come in class
order along a run (visible, then partial, then hidden), so each consumer runs
three loops, the first without a branch or a mask; causal items run longest
first in snake order, which balances the CTAs (on one device round-robin left
5-28% more work on the busiest CTA at S 4K-16K; in a zigzag ring of two, 4-34%
at S 16K-32K, 2-4% at S64K); on one device in folded rounds of one or two
heads where the blocks fold into whole pairs of rounds (``_Folded``, S >= 16K
at H32 on 132 SMs), else in bands of query blocks head after head (``_band``)
where that keeps the balance; each consumer loads its next
item's Q tile into a second buffer while it computes this one; and on one
device without a mask, when the items leave the last round part empty, its
items' key tiles are shared out over every CTA and each item's parts merged
after the kernel by their log-sum-exps (``_SplitTail``).

Backward: ``DualPrograms``, on one device one cuDNN flash backward call from
this kernel's output and log-sum-exp; configured ``backward="ws_attention"``,
our one-pass kernel (``kernels.attention.ws_backward``) instead, one call per
device or per ring block pair. Not done yet: the pipelined consumers for
causal attention; a causal
forwarder loads every K and V tile, hidden ones too, to pass them on; in a
ring, natural-order causal work is unbalanced (zigzag balances it).
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
from jaxmercury.kernels.attention import ring as fra
from jaxmercury.kernels.attention.ring import (
  HIDDEN,
  LOG2E,
  PARTIAL,
  VISIBLE,
  SequenceOrder,
  finish,
  initial_state,
  reference,
  round_robin_item,
  softmax_step,
)
from jaxmercury.kernels.attention.ws_backward import BackwardBlocks
from jaxmercury.kernels.config import param
from jaxmercury.kernels.fused_common import INTERPRET_CTAS as INTERPRET_CTAS_FUSED
from jaxmercury.kernels.fused_common import (
  interpretable_devices,
  positive_ints,
  ring_attention_memory,
  ring_attention_seconds,
)
from jaxmercury.kernels.mosaic_gpu import SMEM_BYTES, left_peer, sm_count, snake_order, step_semaphores, swizzled
from jaxmercury.kernels.placements import RING_ATTENTION
from jaxmercury.kernels.registry import DualPrograms, FusedKernel

__all__ = ["BEFORE", "CONFIGS", "Pipeline", "WsBlocks", "fused_ring_attention_ws", "reference"]

NAME = "fused_ring_attention_ws"
CONSUMERS = 2  # consumer warpgroups per CTA; warpgroup CONSUMERS issues the loads
CONSUMER_REGISTERS = 232
MEMORY_REGISTERS = 40
# Registers per thread each warpgroup starts with: an SM's 65536 over 384 threads, rounded down to 8. setmaxnreg's
# "increase" waits until the registers it asks for are free, so the warpgroups may ask for at most what they hold
# together: 232/40 and 240/24 run (as fast, on one H200), 240/32 hangs.
LAUNCH_REGISTERS = 168
INTERPRET_CTAS = fra.INTERPRET_CTAS
# Shared memory beyond the buffers (barriers, alignment): Mosaic GPU's count exceeds the buffers' bytes by 2.6 to
# 2.7 KiB in every configuration lowered for an H100 (measured), so smem_bytes is an upper bound of its count.
SMEM_OVERHEAD = 3 * 1024


@dataclasses.dataclass(frozen=True)
class WsBlocks(fra.Blocks):
  """Tile sizes and pipeline depth: ``block_q`` rows per consumer warpgroup (``2 block_q`` per work item).

  The same limits as ``fused_ring_attention.Blocks`` (its ``problem``), on this kernel's shared memory.
  """

  def smem_bytes(self, d: int, itemsize: int, q_buffers: int = 1) -> int:
    """``q_buffers`` Q tiles per consumer (reused for the outputs), K and V slots, two log-sum-exp rows, barriers
    and alignment."""
    bq, bkv, slots = self.block_q, self.block_kv, self.max_concurrent_steps
    return (q_buffers * CONSUMERS * bq + 2 * slots * bkv) * d * itemsize + CONSUMERS * 4 * bq + SMEM_OVERHEAD


# The block configurations the GPU test tries (d = 128: 3 slots of 128 keys do not fit in shared memory).
CONFIGS = (WsBlocks(64, 128, 2), WsBlocks(64, 64, 3), WsBlocks(64, 64, 4))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Pipeline:
  """How the kernel schedules its work; every field off is the kernel as first written, which
  ``benchmarks.ws_local`` times beside each step (the defaults are all on).

  Attributes:
    causal_loops: causal tiles run in three loops per run (visible, partial, hidden; the classes come in that
      order), not one loop that switches on each tile's class: the visible tiles' loop has no branch.
    balanced: causal items run longest first in snake order: CTA ``c`` takes rank ``i * grid + c`` in its even
      rounds and ``i * grid + grid - 1 - c`` in its odd ones, ranks ordered by decreasing causal work (the query
      block's global position, ``_pair_by_weight``; in bands of blocks head after head, ``_band``), so every CTA
      gets about the same work and the last round holds the shortest items; in a ring the forwarders first
      (``_forwarders_first``). Zigzag chunks that a device does not hold in (early, late) pairs keep the
      round-robin order.
    prefetch_q: each consumer loads the next item's Q tile into its second Q buffer while it computes this one;
      not for causal items of more than ``PREFETCH_MAX_CAUSAL_TILES`` key tiles (measured slower there).
    split_tail: on one device without a mask, when the items do not fill the last round, its items' key tiles
      are shared out evenly over every CTA (``_SplitTail``), each item's parts merged after the kernel by their
      log-sum-exps.
    band: query blocks per band of the balanced order (None: ``_band``'s choice); it must divide the blocks.
    folded: on one device with a causal mask and no ``band`` given, the balanced order in folded rounds
      where a folding exists (``_Folded``; else bands): CTAs running together read the keys of one or two heads,
      and every CTA has the same work after each pair of rounds. On one H200, MHA S64K causal read 2.8-3.0% of
      the DRAM bandwidth instead of 6.9-7.2% (L2 hits 96% instead of 89%), held a higher clock, and ran 1.007x of
      cuDNN where the bands ran 0.997x; 0.7-1.6% faster than the bands at S 16K-64K, KV 32 and 8
      (benchmarks/results/2026-11-28-ws_local_folded-4493e8c-H200.json).
    heads_in_turn: on one device without a mask, the round-robin items go head after head from the first; else
      one item per K/V head first, as a ring's forwarders (on one device they forward nothing, and the first round
      reads every head's keys).
    alternate_keys: on one device without a mask, a CTA reads the key tiles of its odd items last to first, so a
      round starts on the tiles that the round before it ended on, likely still in L2 (a head's keys and values at
      S64K D128, 32 MiB, are two thirds of an H100's or H200's 50 MB L2: a round reading them in the same order
      misses on every tile). With ``heads_in_turn``, on one H200 MHA S64K read 1.6-1.8% of the DRAM bandwidth
      instead of 2.6-3.0% (cuDNN's forward: 1.5-1.6%) and ran 1.012-1.017x of cuDNN where the round-robin order
      ran 0.998-1.006x (two processes); over S 4K-64K, KV 32 and 8, 1.002-1.034x, within 0.6% of the
      round-robin order where slower (benchmarks/results/2026-11-28-ws_local_orders-3dfbedb-H200.json).
  """

  causal_loops: bool = True
  balanced: bool = True
  prefetch_q: bool = True
  split_tail: bool = True
  band: int | None = None
  folded: bool = True
  heads_in_turn: bool = True
  alternate_keys: bool = True


BEFORE = Pipeline(causal_loops=False, balanced=False, prefetch_q=False, split_tail=False, folded=False,
                  heads_in_turn=False, alternate_keys=False)  # as first written
# On one H100 (benchmarks/results/2026-11-25-ws_local-*): the Q prefetch gains 1-17% at S 4K-32K, and at S64K causal
# KV 32 lost 2-6% in three runs (KV 8 and non-causal within 1%, either way): above 256 tiles of 128 keys, causal
# items load their Q tiles one at a time.
PREFETCH_MAX_CAUSAL_TILES = 256


def _imbalance(work: np.ndarray, heads: int, grid: int, band: int) -> float:
  """The busiest CTA's causal work over the mean: ``work[w]`` the work of the query blocks of weight rank ``w``
  (heaviest first), items in snake order by bands of ``band`` blocks."""
  rank = np.arange(len(work) * heads)
  rounds, c = np.divmod(rank, grid)
  cta = np.where(rounds % 2 == 0, c, grid - 1 - c)
  weight_rank = rank // (band * heads) * band + rank % band
  loads = np.bincount(cta, weights=work[weight_rank], minlength=grid)
  return float(loads.max() / loads.mean())


def _kv_heads_at_once(pairs: int, heads: int, g: int, grid: int, band: int) -> float:
  """The K/V heads (of every batch) that a round's ``grid`` CTAs read together, on average over the rounds of the
  balanced order by bands of ``band`` blocks (``g`` query heads per K/V head)."""
  rank = np.arange(pairs * heads)
  kv_head = rank % (band * heads) // band // g
  rounds = [kv_head[r:r + grid] for r in range(0, len(rank) - grid + 1, grid)] or [kv_head]
  return float(np.mean([len(np.unique(r)) for r in rounds]))


# The K/V heads a round may read together: with one block per band, B1 H32 KV8 (8 K/V heads) was the fastest band at
# S 4K-16K on one H100 and KV32 (32) the slowest at every S 4K-64K; bands of 32 blocks (about 5 K/V heads) ran 2.5-4%
# faster at S 4K-16K and 1% at S32K (benchmarks/results/2026-11-28-ws_local_bands-*-H100*.json).
KV_HEADS_AT_ONCE = 8


def _band(work: np.ndarray, heads: int, grid: int, g: int = 1) -> int:
  """Query blocks per band of the balanced order (``work [devices, pairs]``: each device's blocks' work, heaviest
  first; ``g`` query heads per K/V head): ranks go by decreasing work in bands of this many blocks, each band head
  after head, so CTAs running together read the keys of fewer heads (with one block per band they read every
  head's; at S64K, 32 heads of 128 rows, that lost 2-9% to round-robin, whose CTAs share one head, in three of
  four runs on an H100 and an H200). Of the bands (32, 16, 8, 1) that divide the blocks and whose rounds read at
  most ``KV_HEADS_AT_ONCE`` K/V heads together (none: the widest), the widest that keeps every device's busiest
  CTA within 0.2% of the mean above the best balance among them."""
  bands = [band for band in (32, 16, 8, 1) if work.shape[1] % band == 0]
  local = [band for band in bands if _kv_heads_at_once(work.shape[1], heads, g, grid, band) <= KV_HEADS_AT_ONCE]
  local = local or bands[:1]
  worst = {band: max(_imbalance(w, heads, grid, band) for w in work) for band in local}
  best = max(min(worst.values()), 1.0)
  return next(band for band in local if worst[band] <= best + 0.002)


def _chunk_by_weight(rank, local_chunks: int):
  """The local chunk (of ``local_chunks``, an int or traced) holding the positions of weight rank ``rank``
  (latest first): a device's stored zigzag chunks pair up as (early, late) in true order, so the late ones
  (odd) come first, earliest late chunk first, then the early ones (even), latest first."""
  if local_chunks == 1:
    return 0 * rank
  late = 2 * rank + 1
  early = 2 * (local_chunks - 1 - rank)
  return jnp.where(rank < local_chunks // 2, late, early) if not isinstance(rank, int) else (
      late if rank < local_chunks // 2 else early)


def _pair_by_weight(rank, per_chunk: int, local_chunks: int):
  """The local query block (work item pair) of weight rank ``rank``: blocks by decreasing global position."""
  within = rank % per_chunk if isinstance(rank, int) else lax.rem(rank, per_chunk)
  return _chunk_by_weight(rank // per_chunk, local_chunks) * per_chunk + per_chunk - 1 - within


def _weights(order: SequenceOrder, pairs: int, rows: int, devices: int) -> np.ndarray | None:
  """``[devices, pairs]``: each device's causal work per block (its last query's global position + 1) by weight
  rank (``_pair_by_weight``); None where that rank order is not heaviest first on every device (zigzag chunks
  that a device does not hold in (early, late) pairs)."""
  per_chunk = order.segment // rows
  local_chunks = pairs // per_chunk
  pair = [_pair_by_weight(w, per_chunk, local_chunks) for w in range(pairs)]
  work = np.array([[order.first(dev, p * rows) + rows for p in pair] for dev in range(devices)])
  return work if np.all(np.diff(work, axis=1) <= 0) else None


def _balanced_item(rank, batch_heads: int, h: int, g: int, band: int, per_chunk: int, local_chunks: int,
                   forwarders: int = 0):
  """Rank ``rank`` of the balanced order -> ``(batch, query head, pair, forwards)``: ranks by decreasing weight
  rank in bands of ``band`` blocks, each band over the ``batch_heads`` (batch, query head) pairs in turn; with
  ``forwarders`` (a ring), those first (``_forwarders_first``)."""
  forwards = False
  if forwarders:
    rank, forwards = _forwarders_first(rank, forwarders, g * band)
  band_index, within = rank // (band * batch_heads), lax.rem(rank, band * batch_heads)
  bh = within // band
  pair = _pair_by_weight(band_index * band + lax.rem(within, band), per_chunk, local_chunks)
  return bh // h, lax.rem(bh, h), pair, forwards


def _forwarders_first(rank, forwarders: int, stride: int):
  """A ring's balanced rank -> (the rank in the balanced order, forwards): ranks ``0 .. F - 1`` are the ``F``
  forwarders, each the heaviest block of its group's first head (rank ``f stride`` in the balanced order,
  ``stride`` = heads per group x blocks per band); the rest of the first band follows in its order, and every
  later rank keeps its place. So a forwarder is the first item of CTA ``f`` (deadlock freedom, module docstring)."""
  others = max(stride - 1, 1)
  m = rank - forwarders
  rest = m // others * stride + lax.rem(m, others) + 1
  moved = jnp.where(rank < forwarders, rank * stride, jnp.where(rank < forwarders * stride, rest, rank))
  return moved, rank < forwarders


@dataclasses.dataclass(frozen=True)
class _SplitTail:
  """``work`` items of ``tiles`` key tiles over ``grid`` CTAs: the ``full`` whole rounds as usual (CTA ``c`` takes
  items ``c, c + grid, ...``), then the last round's ``work % grid`` items, ``tail`` (item, key tile) units in
  item-major order, shared out evenly: CTA ``c`` takes units ``start(c) .. start(c + 1) - 1`` of them, fewer
  than an item's, so at most two parts (part slots 0 and 1), merged after the kernel by their log-sum-exps.
  CTAs running together still read the keys of neighbouring items (L2)."""

  work: int
  tiles: int
  grid: int

  @staticmethod
  def make(work: int, tiles: int, grid: int) -> "_SplitTail | None":
    """The split, where the last round is part empty and every CTA gets a unit of it."""
    return _SplitTail(work, tiles, grid) if work % grid and (work % grid) * tiles >= grid else None

  @property
  def full(self) -> int:
    return self.work // self.grid

  def start(self, c):
    """CTA ``c``'s first unit of the last round (an int, or traced): runs of ``tail // grid`` units, the first
    ``tail % grid`` one longer."""
    per, extra = divmod((self.work % self.grid) * self.tiles, self.grid)
    return c * per + (min(c, extra) if isinstance(c, int) else jnp.minimum(c, extra))

  def parts(self) -> dict[int, list[tuple[int, int]]]:
    """Each last-round item (by its index among them) -> its parts, ``(CTA, part slot)``."""
    parts = {}
    for c in range(self.grid):
      first, end = self.start(c), self.start(c + 1)
      for slot, item in enumerate(range(first // self.tiles, (end - 1) // self.tiles + 1) if end > first else ()):
        parts.setdefault(item, []).append((c, slot))
    return parts


@dataclasses.dataclass(frozen=True)
class _Folded:
  """The balanced order in folded rounds, for causal blocks whose work falls linearly with their weight rank
  (one device): each (batch, head) pair's heaviest ``pairs - tail`` blocks fold into ``(w, pairs - tail - 1 - w)``
  couples of equal total work, ``grid`` couples per pair of rounds, CTA ``c`` taking couple ``k grid + c``'s
  heavy block in round ``2k`` and its light one in round ``2k + 1``; the couples go head after head, so a round's
  CTAs read the keys of one or two heads, and every CTA has done the same work after each pair of rounds. The
  ``tail`` lightest blocks of every head (``tail``: the fewest that leave whole pairs of rounds) then run
  heaviest first in snake order.

      for k in 0 .. round_pairs - 1:          # every CTA c
        couple = k * grid + c                 # (head, w), head after head
        run block w of head; run block pairs - tail - 1 - w of head
      for rank in snake order over the tail:  # heaviest first, every head at each weight
        run block pairs - tail + rank // heads of head rank % heads
  """

  heads: int  # (batch, query head) pairs
  pairs: int  # query blocks per head
  grid: int
  tail: int

  @staticmethod
  def make(work: np.ndarray, heads: int, grid: int) -> "_Folded | None":
    """The folding of blocks of ``work [pairs]`` (by weight rank) over ``heads`` heads and ``grid`` CTAs; None where
    no tail shorter than half the blocks leaves whole pairs of rounds, or the couples' work differs (work not
    linear in the rank)."""
    pairs = len(work)
    for tail in range(pairs // 2):
      folded = work[:pairs - tail]
      if len(folded) % 2 == 0 and heads * len(folded) // 2 % grid == 0:
        return _Folded(heads, pairs, grid, tail) if np.all(folded + folded[::-1] == folded[0] + folded[-1]) else None
    return None

  @property
  def round_pairs(self) -> int:
    return self.heads * (self.pairs - self.tail) // 2 // self.grid

  def count(self, cta):
    """CTA ``cta``'s items and ``rank(j)``, the rank of its ``j``-th tail item (``snake_order``)."""
    tail_items, tail_rank = snake_order(self.heads * self.tail, self.grid, cta)
    return 2 * self.round_pairs + tail_items, tail_rank

  def item(self, i, cta, tail_rank):
    """CTA ``cta``'s ``i``-th item (traced) -> ``(batch-head, weight rank)``."""
    half = (self.pairs - self.tail) // 2
    couple = i // 2 * self.grid + cta
    w = lax.rem(couple, half)
    t = tail_rank(jnp.maximum(i - 2 * self.round_pairs, 0))
    folded = i < 2 * self.round_pairs
    partner = jnp.where(lax.rem(i, 2) == 0, w, 2 * half - 1 - w)
    return (jnp.where(folded, couple // half, lax.rem(t, self.heads)),
            jnp.where(folded, partner, self.pairs - self.tail + t // self.heads))


@contextlib.contextmanager
def _named():
  """Re-raises ``fused_ring_attention``'s precondition errors under this kernel's name."""
  try:
    yield
  except PreconditionError as e:
    message = str(e)
    if message.startswith(f"{fra.NAME}:"):
      message = NAME + message[len(fra.NAME):]
    raise PreconditionError(message) from None


def fused_ring_attention_ws(q, k, v, axis_name: str | None, *, causal: bool = False, order: str = "natural",
                            chunks: int | None = None, block_q: int = 64, block_kv: int = 128,
                            max_concurrent_steps: int = 2, num_ctas: int | None = None, pipelined: bool | None = None,
                            pipeline: Pipeline = Pipeline(), interpret: bool = False):
  """Attention over the keys of every device of ``axis_name``, warp-specialized; call inside ``shard_map``.

  Args:
    q: this device's queries ``[b, s, h, d]``, bf16 or fp16.
    k: this device's keys ``[b, s, kv, d]``, ``q``'s dtype; ``kv`` divides ``h``.
    v: this device's values, like ``k``.
    axis_name: the ``shard_map`` axis the sequence is sharded over; it must
      span every device of the process when it has more than one. None: no
      ring, this device's own keys (local attention, ``kernels.attention.ws``).
    causal: each query attends only to keys at global positions up to its
      own (``fused_ring_attention.positions``).
    order: ``"natural"`` or ``"zigzag"``, as for ``fused_ring_attention``.
    chunks: zigzag chunks of the whole sequence (default ``2 n``).
    block_q: query rows per consumer warpgroup (multiple of 64); a work
      item is ``2 block_q`` rows.
    block_kv: key rows per K/V tile (multiple of 64, at most 256).
    max_concurrent_steps: K/V SMEM slots (at least 2).
    num_ctas: CTAs of the persistent grid (default: the device's SM count, or
      ``INTERPRET_CTAS`` on a device without one); for several devices at
      least ``b * kv`` and at most the SM count.
    pipelined: each consumer issues tile ``t``'s ``Q K^T`` and tile
      ``t - 1``'s ``P V`` together and runs tile ``t``'s softmax while the
      ``P V`` wgmma runs (FlashAttention-3's intra-warpgroup pipelining;
      module docstring); not causal. None: on one device without a mask
      (measured faster there on an H100: 1-4% at S 4K-32K, within the
      timings' spread at S64K; rings keep the other consumers, the turns
      have not run on two GPUs).
    pipeline: how the work is scheduled (``Pipeline``; the defaults are the fastest measured).
    interpret: run in Mosaic GPU interpret mode (CPU); one device only.

  Returns:
    ``(out [b, s, h, d]`` in ``q``'s dtype, ``lse [b, h, s]`` float32, natural log``)``.

  Raises:
    PreconditionError: the inputs, blocks, order or mesh do not fit (module docstring).
  """
  blocks = WsBlocks(block_q, block_kv, max_concurrent_steps)
  with _named():
    n_dev = fra.check_inputs(q, k, v, axis_name, blocks, interpret)
    seq_order = SequenceOrder.make(order, chunks, n_dev, q.shape[1], blocks)
  s = q.shape[1]
  if s % (CONSUMERS * block_q):
    raise PreconditionError(f"{NAME}: the local sequence length {s} is not a multiple of 2 * block_q = "
                            f"{CONSUMERS * block_q}: a work item is two query tiles")
  if pipelined is None:
    pipelined = not causal and n_dev == 1
  if pipelined and causal:
    raise PreconditionError(f"{NAME}: pipelined=True runs non-causal attention only; pass causal=False or "
                            "pipelined=False")
  switch = next((f.name for f in dataclasses.fields(pipeline)
                 if f.name != "band" and not isinstance(getattr(pipeline, f.name), bool)), None)
  if switch:
    raise PreconditionError(f"{NAME}: Pipeline({switch}={getattr(pipeline, switch)!r}) must be True or False")
  band, pairs = pipeline.band, s // (CONSUMERS * block_q)
  if band is not None and (not isinstance(band, int) or isinstance(band, bool) or band < 1 or pairs % band):
    raise PreconditionError(f"{NAME}: Pipeline(band={band!r}) must be a positive int dividing the {pairs} query "
                            f"blocks of 2 * block_q = {CONSUMERS * block_q} rows")
  if causal and seq_order.segment % (CONSUMERS * block_q):
    raise PreconditionError(f"{NAME}: zigzag chunks of {seq_order.segment} positions are not a multiple of "
                            f"2 * block_q = {CONSUMERS * block_q}: a work item's two query tiles must lie in one chunk")
  sms = sm_count()
  num_ctas = num_ctas or sms or INTERPRET_CTAS
  if not isinstance(num_ctas, int) or num_ctas < 1:
    raise PreconditionError(f"{NAME}: num_ctas={num_ctas!r} must be a positive int")
  fra.check_forwarders_resident(NAME, n_dev, num_ctas, k)
  if n_dev > 1 and sms and num_ctas > sms:
    raise PreconditionError(
        f"{NAME}: num_ctas={num_ctas} exceeds the {sms} SMs; one CTA (three warpgroups, 232 + 232 + 40 "
        "registers per thread) fills an SM, and the ring needs every CTA resident")
  return _kernel(q, k, v, axis_name, n_dev, blocks, num_ctas, interpret, causal, seq_order, pipelined=pipelined,
                 pipeline=pipeline)


def _run_tiles(order: SequenceOrder, run: int, bkv: int, source, start: int, q_last, forwarding, causal: bool):
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


def _kernel(q, k, v, axis_name, n_dev: int, blocks: WsBlocks, num_ctas: int, interpret: bool, causal: bool,
            order: SequenceOrder, loopback: bool = False, pipelined: bool = False, pipeline: Pipeline = Pipeline()):
  """The kernel for ``n_dev`` ring steps; ``loopback`` (tests, one device, one CTA): a ring of ``n_dev`` copies.

  With ``loopback`` the forwarders store into this device's own ``received``
  (no ``remote_ref``, no semaphores: with one CTA the forwarder items run
  first and each waits until its stores landed), so step ``s`` brings this
  device's keys again at the global positions of device ``s``: the
  forwarding path runs in interpret mode.
  """
  assert not loopback or num_ctas == 1, "loopback needs one CTA: the forwarders must run first"
  assert not (pipelined and causal), "the pipelined consumers run non-causal attention only"
  assert CONSUMERS * CONSUMER_REGISTERS + MEMORY_REGISTERS <= (CONSUMERS + 1) * LAUNCH_REGISTERS, "would hang"
  b, s_loc, h, d = q.shape
  kv = k.shape[2]
  g = h // kv
  bq, bkv, slots = blocks.block_q, blocks.block_kv, blocks.max_concurrent_steps
  rows = CONSUMERS * bq  # query rows per work item
  pairs = s_loc // rows
  forwarders, per_group = b * kv, g * pairs
  work = b * h * pairs
  grid = min(work, num_ctas)
  ring = n_dev > 1
  peers = ring and not loopback  # the ring crosses devices: remote stores and semaphores
  scale_log2 = LOG2E / math.sqrt(d)
  dtype = q.dtype
  run = order.segment if causal else s_loc
  starts = range(0, s_loc, run)
  lag = slots - 1  # the memory warpgroup waits for tile j's load after issuing tile j + lag's
  weights = _weights(order, pairs, rows, n_dev) if pipeline.balanced and causal else None
  balanced = weights is not None  # without causal every item is as long
  fold = balanced and pipeline.folded and pipeline.band is None and not ring
  folded = _Folded.make(weights[0], b * h, grid) if fold else None
  lone = not (ring or causal)  # one device without a mask: no forwarding, every item as long
  band_pairs = (pipeline.band or _band(weights, b * h, grid, g)) if balanced and not folded else 1
  per_chunk = order.segment // rows  # query blocks per run of contiguous positions
  split = _SplitTail.make(work, s_loc // bkv, grid) if pipeline.split_tail and lone else None
  prefetch = pipeline.prefetch_q and not (causal and n_dev * s_loc // bkv > PREFETCH_MAX_CAUSAL_TILES)
  q_buffers = 2 if prefetch and blocks.smem_bytes(d, dtype.itemsize, 2) <= SMEM_BYTES else 1
  leaders = 0 if lone and pipeline.heads_in_turn else forwarders  # items first, one per K/V head (0: heads in turn)
  item_args = dict(forwarders=leaders, per_group=per_group, nq=pairs, g=g, kv=kv)  # round_robin_item's
  alternate = lone and pipeline.alternate_keys

  def body(q_ref, k_ref, v_ref, out_ref, lse_ref, *rest):
    if ring:
      recv_k, recv_v, *rest = rest
    if split:
      part_o, part_lse, *rest = rest
    qo_smem, k_smem, v_smem, lse_smem, q_loaded, k_loaded, v_loaded, k_consumed, v_consumed, schedule, turn, *o_smem = (
        rest)
    cta = lax.axis_index("cta")
    wg = lax.axis_index("wg")
    dev = lax.axis_index(axis_name) if peers else 0
    if split:  # the whole rounds, then the last round's items this CTA's units touch
      first_unit, end_unit = split.start(cta), split.start(cta + 1)
      first_part = first_unit // split.tiles
      items = split.full + jnp.where(end_unit > first_unit, (end_unit - 1) // split.tiles - first_part + 1, 0)
    elif folded:
      items, tail_rank = folded.count(cta)
    elif balanced:  # rounds 0 .. full - 1, and round `full` (snake order: its first CTAs if even, last if odd)
      items, snake_rank = snake_order(work, grid, cta)
    else:
      items = (work - cta + grid - 1) // grid  # this CTA's items: cta, cta + grid, ...
    if peers:
      arrived = step_semaphores(n_dev)
      left, *to_left = left_peer(dev, n_dev, recv_k, recv_v)
    elif ring:
      to_left = recv_k, recv_v

    def item_of(i):
      if folded:
        bh, weight_rank = folded.item(i, cta, tail_rank)
        pair = _pair_by_weight(weight_rank, per_chunk, pairs // per_chunk)
        bi, hi, forwards = bh // h, lax.rem(bh, h), False
      elif balanced:  # rank i * grid + (cta, or grid - 1 - cta in odd rounds); ranks by decreasing work
        bi, hi, pair, forwards = _balanced_item(snake_rank(i), b * h, h, g, band_pairs, per_chunk, pairs // per_chunk,
                                                forwarders if ring else 0)
      else:
        index = cta + i * grid
        if split:  # a part of the last round's item first_part + (i - full)
          index = jnp.where(i < split.full, index, split.full * grid + first_part + i - split.full)
        bi, hi, pair, forwards = round_robin_item(index, **item_args)
      q_last = order.first(dev, pair * rows) + rows - 1 if causal else None
      return bi, hi, pair, forwards, q_last

    def span(i):
      """Item ``i``'s key tiles ``first .. first + count - 1`` (split tails only): all of them in the whole
      rounds, this CTA's units in the last."""
      base = (first_part + i - split.full) * split.tiles
      first = jnp.where(i < split.full, 0, jnp.maximum(first_unit - base, 0))
      end = jnp.where(i < split.full, split.tiles, jnp.minimum(end_unit - base, split.tiles))
      return first, end - first

    def forwarding_at(forwards, s):
      return forwards & (s < n_dev - 1) if ring else False

    def step_sources(s):
      """(keys, values, source device) of ring step ``s`` (a Python 0, or traced)."""
      if isinstance(s, int) and s == 0:
        return k_ref, v_ref, dev
      return recv_k.at[s - 1], recv_v.at[s - 1], lax.rem(dev + s, n_dev)

    def over_steps(step, carry):
      """``step(s, carry)`` for ring steps 0 .. n - 1 (0 with the local keys, the rest from ``received``)."""
      carry = step(0, carry)
      return lax.fori_loop(1, n_dev, step, carry) if ring else carry

    # ------------------------------------------------------------------ memory warpgroup
    @pl.when(wg == CONSUMERS)
    def _memory():
      plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")

      def stream(keys, values, count, loaded, forwarding, dest, first=0, backward=False):
        """Loads ``count`` tiles of ``keys, values [r, d]``, from tile ``first`` (``backward``: from the last,
        down to ``first``), into the slots after tile ``loaded``; forwards them."""

        @pl.loop(0, count + lag)
        def _tile(j):
          @pl.when(j < count)
          def _issue():
            tile = loaded + j
            slot = lax.rem(tile, slots)
            index = jnp.where(backward, first + count - 1 - j, first + j) if alternate else first + j
            src = pl.ds(index * bkv, bkv)
            for smem, ref, consumed, barrier, pending in ((k_smem, keys, k_consumed, k_loaded, 1),
                                                          (v_smem, values, v_consumed, v_loaded, 0)):
              @pl.when(tile >= slots)
              def _():
                plgpu.barrier_wait(consumed.at[slot])  # both consumers are done with the slot's previous tile
              if ring:  # that tile's stores (all but the newest `pending`) have read the slot
                plgpu.wait_smem_to_gmem(pending, wait_read_only=True)
              plgpu.copy_gmem_to_smem(ref.at[src], smem.at[slot], barrier.at[slot])

          @pl.when(j >= lag)
          def _landed():
            i = j - lag
            slot = lax.rem(loaded + i, slots)
            dst = pl.ds(i * bkv, bkv)
            for smem, barrier, to in ((k_smem, k_loaded, 0), (v_smem, v_loaded, 1)):
              plgpu.barrier_wait(barrier.at[slot])
              if ring:
                @pl.when(forwarding)
                def _():
                  plgpu.copy_smem_to_gmem(smem.at[slot], dest[to].at[dst])

        return loaded + count

      def item(i, loaded):
        bi, hi, _, forwards, q_last = item_of(i)
        kvh = hi // g
        backward = lax.rem(i, 2) == 1 if alternate else False
        if split:
          first, count = span(i)
          return stream(k_ref.at[bi, :, kvh], v_ref.at[bi, :, kvh], count, loaded, False, None, first, backward)

        def step(s, loaded):
          keys, values, source = step_sources(s)
          forwarding = forwarding_at(forwards, s)
          counts = [_run_tiles(order, run, bkv, source, start, q_last, forwarding, causal) for start in starts]
          if peers and not (isinstance(s, int) and s == 0):
            def wait():  # every forwarder of device r + 1 has filled received[s - 1]
              pl.semaphore_wait(arrived.at[s - 1], value=forwarders, decrement=False)
            if causal:  # only where this item reads received[s - 1]
              pl.when(functools.reduce(jnp.add, counts) > 0)(wait)
            else:
              wait()
          for start, count in zip(starts, counts):
            keys_run = pl.ds(start, run)
            dest = (to_left[0].at[s, bi, keys_run, kvh], to_left[1].at[s, bi, keys_run, kvh]) if ring else None
            loaded = stream(keys.at[bi, keys_run, kvh], values.at[bi, keys_run, kvh], count, loaded, forwarding,
                            dest, backward=backward)
          if ring:
            @pl.when(forwarding)
            def _signal():
              plgpu.wait_smem_to_gmem(0, wait_read_only=False)  # this step's stores have landed in the peer
              if peers:
                pl.semaphore_signal(arrived.at[s], device_id=left)
          return loaded

        return over_steps(step, loaded)

      loaded = lax.fori_loop(0, items, item, jnp.int32(0))

      @pl.loop(jnp.maximum(loaded - slots, 0), loaded)
      def _drain(tile):  # observe the consumers' last releases (every waiter sees every phase)
        slot = lax.rem(tile, slots)
        plgpu.barrier_wait(k_consumed.at[slot])
        plgpu.barrier_wait(v_consumed.at[slot])

    # ------------------------------------------------------------------ consumer warpgroups
    @pl.when(wg < CONSUMERS)
    def _consumers():
      plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
      lse_row = lse_smem.at[wg]

      def meet():
        plgpu.barrier_arrive(schedule)
        plgpu.barrier_wait(schedule)

      def hidden(carry, slot):
        meet()
        plgpu.barrier_arrive(k_consumed.at[slot])
        plgpu.barrier_arrive(schedule)
        plgpu.barrier_wait(v_loaded.at[slot])
        plgpu.barrier_wait(schedule)
        plgpu.barrier_arrive(v_consumed.at[slot])
        return carry

      def online_softmax(qk, m, l, mask_from=None):
        """``softmax_step`` of the raw scores, ``P`` in the inputs' dtype."""
        m_new, l, alpha, p = softmax_step(qk, m, l, scale_log2, mask_from)
        return m_new, l, alpha, p.astype(dtype)

      def update(carry, slot, q_smem, mask_from=None):
        acc, m, l = carry

        def scores(acc_ref):
          plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
          meet()  # the other consumer's softmax runs while this wgmma does
          plgpu.wgmma_wait(0)
          return acc_ref[...]

        qk = pl.run_scoped(scores, plgpu.ACC((bq, bkv), jnp.float32))
        plgpu.barrier_arrive(k_consumed.at[slot])
        m_new, l, alpha, p16 = online_softmax(qk, m, l, mask_from)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        # The softmax is done before this consumer announces it, not sunk behind the barriers (0-2% on an H100)
        acc, m_new, l, p16 = lax.optimization_barrier((acc, m_new, l, p16))
        plgpu.barrier_arrive(schedule)  # softmax done
        plgpu.barrier_wait(v_loaded.at[slot])
        plgpu.barrier_wait(schedule)  # the tensor cores are ours

        if interpret:  # the interpreter's wgmma takes A from SMEM only: P V as a plain dot
          acc = acc + jnp.dot(p16, v_smem.at[slot][...], preferred_element_type=jnp.float32)
        else:
          def weighted(acc_ref):
            plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
            plgpu.wgmma_wait(0)
          acc = pl.run_state(weighted)(plgpu.ACC.init(acc))
        plgpu.barrier_arrive(v_consumed.at[slot])
        return acc, m_new, l

      def q_buffer(i):  # traced even for one buffer: run_state cannot lower a constant index into the SMEM ref
        return lax.rem(i, q_buffers)

      def issue_q(i):
        """Starts loading item ``i``'s Q tile into this consumer's buffer ``i % q_buffers``."""
        bi, hi, pair, _, _ = item_of(i)
        buf = q_buffer(i)
        plgpu.copy_gmem_to_smem(q_ref.at[bi, pl.ds(pair * rows + wg * bq, bq), hi], qo_smem.at[wg, buf],
                                q_loaded.at[wg * q_buffers + buf])

      def load_q(i):
        """Item ``i``'s Q tile in this consumer's SMEM (the next item's started, with two buffers): the item's
        coordinates, its query rows and the tile. The next item's buffer held the previous item's output, whose
        store ``finish`` saw read."""
        bi, hi, pair, forwards, q_last = item_of(i)
        buf = q_buffer(i)
        if q_buffers == 1:
          issue_q(i)
        plgpu.barrier_wait(q_loaded.at[wg * q_buffers + buf])
        if q_buffers > 1:
          pl.when(i + 1 < items)(lambda: issue_q(i + 1))
        return bi, hi, pair, forwards, q_last, pl.ds(pair * rows + wg * bq, bq), qo_smem.at[wg, buf]

      def item(i, loaded):
        bi, hi, pair, forwards, q_last, q_rows, q_smem = load_q(i)
        q_first = order.first(dev, pair * rows + wg * bq) if causal else None

        def step(s, state):
          loaded, carry = state
          _, _, source = step_sources(s)
          forwarding = forwarding_at(forwards, s)
          for start in starts:
            count = span(i)[1] if split else _run_tiles(order, run, bkv, source, start, q_last, forwarding, causal)
            offset = q_first - order.first(source, start) if causal else None

            def arrived(j, loaded=loaded):
              slot = lax.rem(loaded + j, slots)
              plgpu.barrier_wait(k_loaded.at[slot])
              return slot

            visible = lambda j, carry: update(carry, arrived(j), q_smem)
            partial = lambda j, carry, offset=offset: update(carry, arrived(j), q_smem, mask_from=j * bkv - offset)
            hide = lambda j, carry: hidden(carry, arrived(j))
            if not causal:
              carry = lax.fori_loop(0, count, visible, carry)
            elif pipeline.causal_loops:  # tile j's first query minus first key, offset - j bkv, falls with j
              n_visible = jnp.clip(jnp.maximum(offset + 1, 0) // bkv, 0, count)  # offset - j bkv >= bkv - 1
              n_shown = jnp.clip((jnp.maximum(offset + bq, 0) + bkv - 1) // bkv, n_visible, count)  # > -bq
              carry = lax.fori_loop(0, n_visible, visible, carry)
              carry = lax.fori_loop(n_visible, n_shown, partial, carry)
              carry = lax.fori_loop(n_shown, count, hide, carry)
            else:
              def tile(j, carry, offset=offset):
                gap = offset - j * bkv  # the tile's first query's position minus its first key's
                kind = jnp.where(gap >= bkv - 1, VISIBLE, jnp.where(gap <= -bq, HIDDEN, PARTIAL)).astype(jnp.int32)
                branches = [None] * 3
                branches[HIDDEN], branches[VISIBLE], branches[PARTIAL] = hide, visible, partial
                return lax.switch(kind, branches, j, carry)
              carry = lax.fori_loop(0, count, tile, carry)
            loaded = loaded + count
          return loaded, carry

        loaded, carry = over_steps(step, (loaded, initial_state(bq, d)))
        store(carry, i, bi, hi, q_rows, q_smem)
        return loaded

      def store(carry, i, bi, hi, q_rows, q_smem):
        """Item ``i``'s output rows and log-sum-exps; with a split tail, a last-round part into its slot."""
        write = functools.partial(finish, carry, q_smem, lse_row)
        if not split:
          return write(out_ref.at[bi, q_rows, hi], lse_ref.at[bi, hi, q_rows])
        whole, part, own = i < split.full, i - split.full, pl.ds(wg * bq, bq)
        pl.when(whole)(lambda: write(out_ref.at[bi, q_rows, hi], lse_ref.at[bi, hi, q_rows]))
        pl.when(~whole)(lambda: write(part_o.at[cta, part, own], part_lse.at[cta, part, own]))

      def take_turn():  # the tensor cores are this consumer's until it gives the turn to the other
        plgpu.barrier_wait(turn.at[wg])

      def give_turn():
        plgpu.barrier_arrive(turn.at[1 - wg])

      def pipelined_item(i, loaded):
        """``item`` with tile ``t``'s softmax overlapping tile ``t - 1``'s ``P V`` (non-causal: every tile of every
        step, ``tiles`` in all, or a split tail's part); the consumers take turns issuing their wgmmas."""
        bi, hi, _, _, _, q_rows, q_smem = load_q(i)
        tiles = span(i)[1] if split else n_dev * (s_loc // bkv)
        slot_of = lambda t: lax.rem(loaded + t, slots)

        def weigh(acc_ref, p16, slot):  # acc += P V, issued (the interpreter's: a plain dot on SMEM)
          if interpret:
            acc_ref[...] = acc_ref[...] + jnp.dot(p16, v_smem.at[slot][...], preferred_element_type=jnp.float32)
          else:
            plgpu.wgmma(acc_ref, p16, v_smem.at[slot])

        def scores(slot, behind=None):
          """``Q K^T`` of the slot's tile, then ``behind()``'s wgmma; returns the scores once theirs retired."""
          def issue(s_ref):
            take_turn()
            plgpu.wgmma(s_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
            if behind is not None:
              behind()
            give_turn()  # the other consumer's wgmmas queue behind these, its softmax ran meanwhile
            return plgpu.wgmma_accumulator_load(s_ref, wait_n=0 if behind is None else 1)
          qk = pl.run_scoped(issue, plgpu.ACC((bq, bkv), jnp.float32))
          plgpu.barrier_arrive(k_consumed.at[slot])
          return qk

        def attend(acc_ref):
          _, m, l = initial_state(bq, d)
          plgpu.barrier_wait(k_loaded.at[slot_of(0)])
          m, l, _, p16 = online_softmax(scores(slot_of(0)), m, l)

          def tile(t, carry):
            m, l, p16 = carry
            plgpu.barrier_wait(k_loaded.at[slot_of(t)])
            plgpu.barrier_wait(v_loaded.at[slot_of(t - 1)])
            qk = scores(slot_of(t), behind=lambda: weigh(acc_ref, p16, slot_of(t - 1)))
            m, l, alpha, p16 = online_softmax(qk, m, l)
            acc_ref[...] = acc_ref[...] * lax.broadcast_in_dim(alpha, (bq, d), [0])  # reading waits for P V
            plgpu.barrier_arrive(v_consumed.at[slot_of(t - 1)])
            return m, l, p16

          m, l, p16 = lax.fori_loop(1, tiles, tile, (m, l, p16))
          plgpu.barrier_wait(v_loaded.at[slot_of(tiles - 1)])
          take_turn()
          weigh(acc_ref, p16, slot_of(tiles - 1))
          give_turn()
          acc = acc_ref[...]
          plgpu.barrier_arrive(v_consumed.at[slot_of(tiles - 1)])
          store((acc, m, l), i, bi, hi, q_rows, q_smem)

        zeros = initial_state(bq, d)[0]
        if interpret:  # the interpreter has no stores into wgmma accumulators: the accumulator lives in SMEM
          o_smem[0].at[wg][...] = zeros
          attend(o_smem[0].at[wg])
        else:
          pl.run_state(attend)(plgpu.ACC.init(zeros))
        return loaded + tiles

      if q_buffers > 1:
        pl.when(items > 0)(lambda: issue_q(0))
      # Consumer 1 starts one meeting ahead (pipelined: gives consumer 0 the first turn), so the two alternate;
      # consumer 0 meets once more (takes the last turn given) at the end, so every phase is waited for.
      pl.when(wg == 1)(give_turn if pipelined else meet)
      lax.fori_loop(0, items, pipelined_item if pipelined else item, jnp.int32(0))
      pl.when(wg == 0)(take_turn if pipelined else meet)
      plgpu.wait_smem_to_gmem(0, wait_read_only=False)

  out_types = [jax.ShapeDtypeStruct(q.shape, dtype), jax.ShapeDtypeStruct((b, h, s_loc), jnp.float32)]
  if ring:  # received K and V, one slot per ring step after the first: filled by the right neighbour
    out_types += [jax.ShapeDtypeStruct((n_dev - 1, *k.shape), dtype)] * 2
  if split:  # each CTA's (at most two) parts of the last round's items: outputs and log-sum-exps
    out_types += [jax.ShapeDtypeStruct((grid, 2, rows, d), dtype), jax.ShapeDtypeStruct((grid, 2, rows), jnp.float32)]
  kv_transforms = swizzled(d, dtype)
  scratch = [plgpu.SMEM((CONSUMERS, q_buffers, bq, d), dtype, transforms=kv_transforms),
             plgpu.SMEM((slots, bkv, d), dtype, transforms=kv_transforms),
             plgpu.SMEM((slots, bkv, d), dtype, transforms=kv_transforms),
             plgpu.SMEM((CONSUMERS, bq), jnp.float32),
             plgpu.Barrier(num_barriers=CONSUMERS * q_buffers),  # Q tile loaded, per consumer and buffer
             plgpu.Barrier(num_barriers=slots),  # K tile loaded
             plgpu.Barrier(num_barriers=slots),  # V tile loaded
             plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=slots),  # K slot released by both consumers
             plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=slots),  # V slot released
             plgpu.Barrier(num_arrivals=CONSUMERS),  # the consumers' schedule barrier
             plgpu.Barrier(num_barriers=CONSUMERS)]  # pipelined: consumer w's turn on the tensor cores
  if pipelined and interpret:
    scratch.append(plgpu.SMEM((CONSUMERS, bq, d), jnp.float32))  # the accumulators (on GPUs: registers)
  results = plgpu.kernel(
      body, out_type=out_types, scratch_types=scratch, grid=(grid,), grid_names=("cta",), kernel_name=NAME,
      num_threads=CONSUMERS + 1, thread_name="wg",
      compiler_params=None if interpret else plgpu.CompilerParams(approx_math=True),
      interpret=plgpu.InterpretGPUParams() if interpret else None)(q, k, v)
  if split:
    return _merge_cuts(split, *results, **item_args)
  return results[0], results[1]


def _merge_cuts(split: _SplitTail, out, lse, part_o, part_lse, **items):
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
  and dv in one pass: the training step on one kernel family); ``balanced``, causal items heaviest first
  (``Pipeline.balanced``; False: round-robin, the order before 2026-11-28, which benchmarks time beside it)."""

  OPEN = True
  block_q: int = param(64)
  block_kv: int = param(128)
  max_concurrent_steps: int = param(2)
  backward: str | None = param(None, "ws_attention")
  balanced: bool = param(True)


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
  if not isinstance(config.balanced, bool):
    return f"balanced={config.balanced!r} must be True or False"
  if config.backward is not None:
    backward = BackwardBlocks()
    reason = backward.problem(p.local_shape()[4], p.itemsize) or fra.rows_problem(
        p, {"the backward's query tile": backward.block_q, "the backward's key pair": 2 * backward.block_kv})
    if reason:
      return f"backward={config.backward!r}: {reason}"
  return fra.rows_problem(p, {"2 x block_q": 2 * config.block_q, "block_kv": config.block_kv})


def _make(p, config: WsRingConfig, interpret: bool):
  blocks = {k: v for k, v in dataclasses.asdict(config).items() if k not in ("backward", "balanced")}
  return fra.per_device(fused_ring_attention_ws, p, lambda: INTERPRET_CTAS_FUSED if interpret else None,
                        interpret=interpret, pipeline=Pipeline(balanced=config.balanced), **blocks)


FUSED_RING_ATTENTION_WS = FusedKernel(
    name=NAME,
    description="our warp-specialized Mosaic GPU kernel (kernels.attention.ws_forward): two consumer warpgroups "
                "take turns on the tensor cores while a memory warpgroup loads K and V tiles and forwards them to "
                "the left neighbour; one CTA per SM",
    placement=RING_ATTENTION, config=WsRingConfig, devices=interpretable_devices, problem=_problem,
    tile=lambda config: (2 * config.block_q, config.block_kv, 64), make=_make, interpret=True,
    backward=DualPrograms(), rate_kernel=NAME, seconds=ring_attention_seconds, memory=ring_attention_memory)
