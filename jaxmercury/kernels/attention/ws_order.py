"""The order in which the warp-specialized forward's CTAs take their work items (``ws_forward``).

A work item is (batch, query head, query block of ``2 block_q`` rows); the
grid is persistent, so each CTA runs several items in turn. ``ItemOrder``
chooses one of four orders for a call, and ``CtaItems`` gives a CTA's items
in it, traced:

- round-robin (``ring.round_robin_item``): CTA ``c`` runs items
  ``c, c + grid, ...``; in a ring the forwarders (one per batch and K/V head)
  are items ``0 .. F - 1``; on one device without a mask the items go head
  after head from the first;
- split tail (one device without a mask, ``SplitTail``): round-robin for the
  whole rounds, then the last round's key tiles shared out over every CTA,
  each item's parts merged after the kernel by their log-sum-exps;
- balanced (causal): items heaviest first in snake order (CTA ``c`` takes rank
  ``i grid + c`` in its even rounds, ``i grid + grid - 1 - c`` in its odd
  ones), ranks by decreasing causal work in bands of query blocks head after
  head (``band``), a ring's forwarders first (``forwarders_first``);
- folded (causal, one device, where a folding exists: ``Folded``): pairs of
  rounds in which every CTA does the same work, reading one or two heads;
- a table (the masked path, ``ws_mask``: segment ids, windows): the items and
  their key tiles listed heaviest first by the data (``ws_mask.item_table``),
  an input of the kernel, taken in snake order.

Zigzag chunks that a device does not hold in (early, late) pairs keep the
round-robin order (``weights`` is None there).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxmercury.kernels.attention import ws_mask
from jaxmercury.kernels.attention.ring import SequenceOrder, round_robin_item
from jaxmercury.kernels.mosaic_gpu import snake_order

# The K/V heads a round of CTAs may read together (the balanced order's bands keep to it where they can): fewer
# heads read at once keep their keys in L2.
KV_HEADS_AT_ONCE = 8


def imbalance(work: np.ndarray, heads: int, grid: int, band: int) -> float:
  """The busiest CTA's causal work over the mean: ``work[w]`` the work of the query blocks of weight rank ``w``
  (heaviest first), items in snake order by bands of ``band`` blocks."""
  rank = np.arange(len(work) * heads)
  rounds, c = np.divmod(rank, grid)
  cta = np.where(rounds % 2 == 0, c, grid - 1 - c)
  weight_rank = rank // (band * heads) * band + rank % band
  loads = np.bincount(cta, weights=work[weight_rank], minlength=grid)
  return float(loads.max() / loads.mean())


def kv_heads_at_once(pairs: int, heads: int, g: int, grid: int, band: int) -> float:
  """The K/V heads (of every batch) that a round's ``grid`` CTAs read together, on average over the rounds of the
  balanced order by bands of ``band`` blocks (``g`` query heads per K/V head)."""
  rank = np.arange(pairs * heads)
  kv_head = rank % (band * heads) // band // g
  rounds = [kv_head[r:r + grid] for r in range(0, len(rank) - grid + 1, grid)] or [kv_head]
  return float(np.mean([len(np.unique(r)) for r in rounds]))


def band(work: np.ndarray, heads: int, grid: int, g: int = 1) -> int:
  """Query blocks per band of the balanced order (``work [devices, pairs]``: each device's blocks' work, heaviest
  first; ``g`` query heads per K/V head): ranks go by decreasing work in bands of this many blocks, each band head
  after head, so CTAs running together read the keys of fewer heads (with one block per band they read every
  head's). Of the bands (32, 16, 8, 1) that divide the blocks and whose rounds read at most ``KV_HEADS_AT_ONCE``
  K/V heads together (none: the widest), the widest that keeps every device's busiest CTA within 0.2% of the mean
  above the best balance among them."""
  bands = [b for b in (32, 16, 8, 1) if work.shape[1] % b == 0]
  local = [b for b in bands if kv_heads_at_once(work.shape[1], heads, g, grid, b) <= KV_HEADS_AT_ONCE]
  local = local or bands[:1]
  worst = {b: max(imbalance(w, heads, grid, b) for w in work) for b in local}
  best = max(min(worst.values()), 1.0)
  return next(b for b in local if worst[b] <= best + 0.002)


def chunk_by_weight(rank, local_chunks: int):
  """The local chunk (of ``local_chunks``, an int or traced) holding the positions of weight rank ``rank``
  (latest first): a device's stored zigzag chunks pair up as (early, late) in true order, so the late ones
  (odd) come first, earliest late chunk first, then the early ones (even), latest first."""
  if local_chunks == 1:
    return 0 * rank
  late = 2 * rank + 1
  early = 2 * (local_chunks - 1 - rank)
  return jnp.where(rank < local_chunks // 2, late, early) if not isinstance(rank, int) else (
      late if rank < local_chunks // 2 else early)


def pair_by_weight(rank, per_chunk: int, local_chunks: int):
  """The local query block (work item pair) of weight rank ``rank``: blocks by decreasing global position."""
  within = rank % per_chunk if isinstance(rank, int) else lax.rem(rank, per_chunk)
  return chunk_by_weight(rank // per_chunk, local_chunks) * per_chunk + per_chunk - 1 - within


def weights(order: SequenceOrder, pairs: int, rows: int, devices: int) -> np.ndarray | None:
  """``[devices, pairs]``: each device's causal work per block (its last query's global position + 1) by weight
  rank (``pair_by_weight``); None where that rank order is not heaviest first on every device (zigzag chunks
  that a device does not hold in (early, late) pairs)."""
  per_chunk = order.segment // rows
  local_chunks = pairs // per_chunk
  pair = [pair_by_weight(w, per_chunk, local_chunks) for w in range(pairs)]
  work = np.array([[order.first(dev, p * rows) + rows for p in pair] for dev in range(devices)])
  return work if np.all(np.diff(work, axis=1) <= 0) else None


def balanced_item(rank, batch_heads: int, h: int, g: int, band: int, per_chunk: int, local_chunks: int,
                  forwarders: int = 0):
  """Rank ``rank`` of the balanced order -> ``(batch, query head, pair, forwards)``: ranks by decreasing weight
  rank in bands of ``band`` blocks, each band over the ``batch_heads`` (batch, query head) pairs in turn; with
  ``forwarders`` (a ring), those first (``forwarders_first``)."""
  forwards = False
  if forwarders:
    rank, forwards = forwarders_first(rank, forwarders, g * band)
  band_index, within = rank // (band * batch_heads), lax.rem(rank, band * batch_heads)
  bh = within // band
  pair = pair_by_weight(band_index * band + lax.rem(within, band), per_chunk, local_chunks)
  return bh // h, lax.rem(bh, h), pair, forwards


def forwarders_first(rank, forwarders: int, stride: int):
  """A ring's balanced rank -> (the rank in the balanced order, forwards): ranks ``0 .. F - 1`` are the ``F``
  forwarders, each the heaviest block of its group's first head (rank ``f stride`` in the balanced order,
  ``stride`` = heads per group x blocks per band); the rest of the first band follows in its order, and every
  later rank keeps its place. So a forwarder is the first item of CTA ``f`` (the kernel's deadlock freedom)."""
  others = max(stride - 1, 1)
  m = rank - forwarders
  rest = m // others * stride + lax.rem(m, others) + 1
  moved = jnp.where(rank < forwarders, rank * stride, jnp.where(rank < forwarders * stride, rest, rank))
  return moved, rank < forwarders


@dataclasses.dataclass(frozen=True)
class SplitTail:
  """``work`` items of ``tiles`` key tiles over ``grid`` CTAs: the ``full`` whole rounds as usual (CTA ``c`` takes
  items ``c, c + grid, ...``), then the last round's ``work % grid`` items, ``tail`` (item, key tile) units in
  item-major order, shared out evenly: CTA ``c`` takes units ``start(c) .. start(c + 1) - 1`` of them, fewer
  than an item's, so at most two parts (part slots 0 and 1), merged after the kernel by their log-sum-exps.
  CTAs running together still read the keys of neighbouring items (L2)."""

  work: int
  tiles: int
  grid: int

  @staticmethod
  def make(work: int, tiles: int, grid: int) -> SplitTail | None:
    """The split, where the last round is part empty and every CTA gets a unit of it."""
    return SplitTail(work, tiles, grid) if work % grid and (work % grid) * tiles >= grid else None

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
class Folded:
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
  def make(work: np.ndarray, heads: int, grid: int) -> Folded | None:
    """The folding of blocks of ``work [pairs]`` (by weight rank) over ``heads`` heads and ``grid`` CTAs; None where
    no tail shorter than half the blocks leaves whole pairs of rounds, or the couples' work differs (work not
    linear in the rank)."""
    pairs = len(work)
    for tail in range(pairs // 2):
      folded = work[:pairs - tail]
      if len(folded) % 2 == 0 and heads * len(folded) // 2 % grid == 0:
        return Folded(heads, pairs, grid, tail) if np.all(folded + folded[::-1] == folded[0] + folded[-1]) else None
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


@dataclasses.dataclass(frozen=True)
class ItemOrder:
  """The order of a call's ``work`` items over ``grid`` CTAs (module docstring): a ``table`` (the masked path),
  ``split`` or ``folded`` where they apply, else ``balanced`` (``band`` blocks a band) where ``causal_work`` was
  given, else round-robin (``leaders`` items first, one per K/V head; 0: heads in turn)."""

  work: int
  grid: int
  batch_heads: int  # (batch, query head) pairs
  h: int  # query heads
  g: int  # query heads per K/V head
  kv: int  # K/V heads
  pairs: int  # query blocks per head
  per_chunk: int  # query blocks per run of contiguous positions
  forwarders: int  # a ring's forwarder items (0: one device)
  leaders: int  # round-robin items first, one per K/V head (0: heads in turn)
  split: SplitTail | None
  folded: Folded | None
  balanced: bool
  band: int
  table: bool = False  # the items in the order of an input table (ws_mask.item_table)

  @staticmethod
  def make(b: int, h: int, kv: int, pairs: int, rows: int, grid: int, order: SequenceOrder, *, causal: bool,
           ring: bool, key_tiles: int, table: bool = False) -> ItemOrder:
    """The order of ``b h pairs`` items of ``rows`` query rows (``key_tiles`` K/V tiles each on one device);
    ``table``: as an input table lists them (one device)."""
    g, work = h // kv, b * h * pairs
    if table:
      return ItemOrder(work=work, grid=grid, batch_heads=b * h, h=h, g=g, kv=kv, pairs=pairs,
                       per_chunk=order.segment // rows, forwarders=0, leaders=0, split=None, folded=None,
                       balanced=False, band=1, table=True)
    work_per_block = weights(order, pairs, rows, order.n) if causal else None
    balanced = work_per_block is not None  # without a mask every item is as long
    folded = Folded.make(work_per_block[0], b * h, grid) if balanced and not ring else None
    lone = not (ring or causal)  # one device without a mask: no forwarding, every item as long
    return ItemOrder(
        work=work, grid=grid, batch_heads=b * h, h=h, g=g, kv=kv, pairs=pairs, per_chunk=order.segment // rows,
        forwarders=b * kv if ring else 0, leaders=0 if lone else b * kv,
        split=SplitTail.make(work, key_tiles, grid) if lone else None, folded=folded, balanced=balanced,
        band=band(work_per_block, b * h, grid, g) if balanced and not folded else 1)

  def round_robin(self) -> dict:
    """``ring.round_robin_item``'s arguments (the kernel's, and the split tail's merge)."""
    return dict(forwarders=self.leaders, per_group=self.g * self.pairs, nq=self.pairs, g=self.g, kv=self.kv)


class CtaItems:
  """The items of CTA ``cta`` (traced) in ``order``: ``count`` of them, ``item(i)`` the ``i``-th, and with a split
  tail ``span(i)``, with a ``table`` (``ws_mask.item_table``, in global memory) ``keys(i)``, the key tiles it
  runs."""

  def __init__(self, order: ItemOrder, cta, table=None):
    self.order, self.cta, self.table = order, cta, table
    split, grid = order.split, order.grid
    if order.table:  # ranks in snake order, heaviest first
      self.count, self.snake_rank = snake_order(order.work, grid, cta)
    elif split:  # the whole rounds, then the last round's items this CTA's units touch
      self.first_unit, self.end_unit = split.start(cta), split.start(cta + 1)
      self.first_part = self.first_unit // split.tiles
      self.count = split.full + jnp.where(self.end_unit > self.first_unit,
                                          (self.end_unit - 1) // split.tiles - self.first_part + 1, 0)
    elif order.folded:
      self.count, self.tail_rank = order.folded.count(cta)
    elif order.balanced:  # rounds 0 .. full - 1, and round `full` (snake order: its first CTAs if even, last if odd)
      self.count, self.snake_rank = snake_order(order.work, grid, cta)
    else:
      self.count = (order.work - cta + grid - 1) // grid  # this CTA's items: cta, cta + grid, ...

  def item(self, i):
    """Item ``i`` -> ``(batch, query head, query block, forwards)``."""
    o, cta = self.order, self.cta
    local_chunks = o.pairs // o.per_chunk
    if o.table:
      row = self.snake_rank(i)
      bh = self.table[row, ws_mask.ROW]
      return bh // o.h, lax.rem(bh, o.h), self.table[row, ws_mask.GROUP], False
    if o.folded:
      bh, weight_rank = o.folded.item(i, cta, self.tail_rank)
      pair = pair_by_weight(weight_rank, o.per_chunk, local_chunks)
      return bh // o.h, lax.rem(bh, o.h), pair, False
    if o.balanced:  # rank i * grid + (cta, or grid - 1 - cta in odd rounds); ranks by decreasing work
      return balanced_item(self.snake_rank(i), o.batch_heads, o.h, o.g, o.band, o.per_chunk, local_chunks,
                           o.forwarders)
    index = cta + i * o.grid
    if o.split:  # a part of the last round's item first_part + (i - full)
      index = jnp.where(i < o.split.full, index, o.split.full * o.grid + self.first_part + i - o.split.full)
    return round_robin_item(index, **o.round_robin())

  def keys(self, i):
    """Item ``i``'s key tiles ``first .. first + count - 1`` (a table)."""
    row = self.snake_rank(i)
    return self.table[row, ws_mask.FIRST], self.table[row, ws_mask.COUNT]

  def span(self, i):
    """Item ``i``'s key tiles ``first .. first + count - 1`` (split tails only): all of them in the whole rounds,
    this CTA's units in the last."""
    split = self.order.split
    base = (self.first_part + i - split.full) * split.tiles
    first = jnp.where(i < split.full, 0, jnp.maximum(self.first_unit - base, 0))
    end = jnp.where(i < split.full, split.tiles, jnp.minimum(self.end_unit - base, split.tiles))
    return first, end - first
