"""The masked path of the warp-specialized attention kernels: which tiles they load, skip and mask, from the data.

A mask here is a band of positions (causal, a sliding window: a query keeps
the keys with ``lo <= query - key <= hi``), with segment ids equal ids
(``q_segment_ids[query] == kv_segment_ids[key]``: packed sequences), and with
a mask array its elements (``mask[batch, head, query, key]``, batch and head
of size 1 where it broadcasts). The kernels (``ws_forward``, ``ws_backward``)
take it as ``Masking`` and a traced ``offset``, the position of the first
query minus that of the first key (a block at ring offsets).

Per call, before the kernel (XLA on ``[b, s]`` int32 ids), for every row of
one side (queries in the forward, keys in the backward) ``row_ranges`` gives
the range ``[lo, hi]`` of the other side's positions that the row may keep:
the first and last position holding the row's id, cut to the band. For a
packed row (each id's positions consecutive) the range is exactly the kept
set (``exact``); otherwise it holds it. Then per tile of rows
(``tile_summaries``, the ``SUMMARY`` columns):

* ``LO``, ``HI``: the smallest ``lo`` and the largest ``hi`` of its rows that
  keep anything: a tile of the other side outside ``[LO, HI]`` is hidden
  (``tile_kind``: no math), and the span of tiles an item loads is that of its
  tiles' ranges (``spans``);
* ``FULL_LO``, ``FULL_HI``: the largest ``lo`` and smallest ``hi`` where every
  row's range is exact and not empty (else an empty range): a tile inside
  ``[FULL_LO, FULL_HI]`` is kept whole (``FULL``: no compare). The others are
  ``PARTIAL``: the kernels compare ids and positions in registers.

So every skip is safe for any ids (a tile is hidden only when no row's range
meets it, full only when every row keeps all of it), and exact for packed
rows. The items' work then depends on the data: ``item_table`` lists them
heaviest first (most tiles), each with its span, and the kernels' CTAs take
them in snake order (``mosaic_gpu.snake_order``): a data-dependent order
passed as an input, on a static grid.

A mask array keeps no ranges: its kinds are per pair of tiles
(``array_kinds``: any and all of each block, reduced once per call, at the
mask's own batch and head sizes, never broadcast), combined with the band's
and the ids' (``pair_kinds``, ``combine``). An item then lists the tiles it
loads (``tile_lists``: those some row tile of the item does not hide, in
order), and its table row holds its range in that list; the kernels read a
tile's kind from the combined kinds, and a partial tile's elements (bytes,
loaded beside K or Q, ``mask_bytes``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxmercury.errors import PreconditionError

BIG = 1 << 30  # beyond every position: an unbounded band, an empty range's ends
HIDDEN, FULL, PARTIAL = 0, 1, 2  # tile kinds (the branches of the kernels' lax.switch)
LO, HI, FULL_LO, FULL_HI = range(4)  # the columns of a tile summary
SUMMARY = 4
ROW, GROUP, FIRST, COUNT = range(4)  # the columns of an item table: (batch, head) row, group, span
TABLE = 4


@dataclasses.dataclass(frozen=True)
class Masking:
  """What the masked path computes: the band ``lo <= query - key <= hi`` (None: unbounded), with ``ids`` equal
  segment ids, with ``array`` a mask array's elements."""

  lo: int | None
  hi: int | None
  ids: bool
  array: bool = False

  @staticmethod
  def make(causal: bool, window, segment_ids: bool, array: bool = False) -> Masking | None:
    """The masking of ``causal``, a window ``(left, right)`` (None: none), segment ids and a mask array; None where
    there is no window, no ids and no array (the kernels' own causal and unmasked paths)."""
    if window is None and not segment_ids and not array:
      return None
    lo, hi = (0 if causal else None), None
    if window is not None:
      left, right = window
      lo = -right if lo is None else max(lo, -right)
      hi = left
    return Masking(lo, hi, bool(segment_ids), bool(array))

  def keep(self, ids_equal, difference, base):
    """Which pairs of a tile are kept: ``ids_equal`` (None without ids) and the band on positions, where
    ``difference() + base`` is each pair's query position minus its key position (``difference()`` an int32
    tile, asked for only with a band; ``base`` a traced scalar); None where neither masks."""
    keep = ids_equal
    if self.lo is not None or self.hi is not None:
      d = difference()
      for bound, kept in ((self.lo, lambda b: d >= b), (self.hi, lambda b: d <= b)):
        if bound is not None:
          keep = kept(bound - base) if keep is None else keep & kept(bound - base)
    return keep


def row_ranges(a_ids, b_ids, d_lo, d_hi, a_len: int, b_len: int):
  """For each of one row's ``a_len`` positions ``p`` of side ``a``, the positions of side ``b`` it may keep:
  ``(lo, hi, exact, kept)``, ``[lo, hi]`` the first and last ``b`` position of ``p``'s id cut to ``[p + d_lo,
  p + d_hi]``, ``exact`` where the id's ``b`` positions are consecutive (the range is then the kept set),
  ``kept`` where the range is not empty. ``a_ids [a_len]``, ``b_ids [b_len]``: int ids, or None (all equal)."""
  p = jnp.arange(a_len, dtype=jnp.int32)
  if a_ids is None:
    first, last, count = jnp.zeros_like(p), jnp.full_like(p, b_len - 1), jnp.full_like(p, b_len)
  else:
    order = jnp.argsort(b_ids, stable=True)  # ids ascending, positions ascending within one id
    ids = b_ids[order]
    search = functools.partial(jnp.searchsorted, method="scan_unrolled")  # no loop
    left, right = search(ids, a_ids, side="left"), search(ids, a_ids, side="right")
    count = (right - left).astype(jnp.int32)
    first = order[jnp.clip(left, 0, b_len - 1)].astype(jnp.int32)
    last = order[jnp.clip(right - 1, 0, b_len - 1)].astype(jnp.int32)
  lo, hi = jnp.maximum(first, p + d_lo), jnp.minimum(last, p + d_hi)
  return lo, hi, count == last - first + 1, (count > 0) & (lo <= hi)


def tile_summaries(lo, hi, exact, kept, rows: int):
  """``[..., n // rows, SUMMARY]`` int32 of ``row_ranges``' results ``[..., n]`` in tiles of ``rows`` (module
  docstring)."""
  tiles = lambda x: x.reshape(*x.shape[:-1], x.shape[-1] // rows, rows)
  lo, hi, exact, kept = map(tiles, (lo, hi, exact, kept))
  whole = jnp.all(exact & kept, axis=-1)
  return jnp.stack([jnp.min(jnp.where(kept, lo, BIG), axis=-1), jnp.max(jnp.where(kept, hi, -BIG), axis=-1),
                    jnp.where(whole, jnp.max(lo, axis=-1), BIG), jnp.where(whole, jnp.min(hi, axis=-1), -BIG)],
                   axis=-1).astype(jnp.int32)


def spans(summary, per: int, tile: int):
  """``(first, count)`` int32 ``[..., groups]``: the other side's tiles of ``tile`` positions that each group of
  ``per`` consecutive summarized tiles may keep (none: ``(0, 0)``)."""
  grouped = summary.reshape(*summary.shape[:-2], summary.shape[-2] // per, per, SUMMARY)
  lo, hi = jnp.min(grouped[..., LO], axis=-1), jnp.max(grouped[..., HI], axis=-1)
  some = lo <= hi
  first = jnp.where(some, lo // tile, 0)
  return first.astype(jnp.int32), jnp.where(some, hi // tile + 1 - first, 0).astype(jnp.int32)


def tile_kind(summary, first, last):
  """``HIDDEN``, ``FULL`` or ``PARTIAL`` (int32, traced) of the other side's positions ``first .. last`` for a
  tile of ``summary`` (a function of the column: its scalars)."""
  hidden = (summary(HI) < first) | (summary(LO) > last)
  full = (summary(FULL_LO) <= first) & (summary(FULL_HI) >= last)
  return jnp.where(hidden, HIDDEN, jnp.where(full, FULL, PARTIAL)).astype(jnp.int32)


def item_table(first, count, heads: int):
  """``[b * groups * heads, TABLE]`` int32: every (batch, group, head) item as ``(batch * heads + head, group,
  first, count)``, the most tiles first (ties: batch, group, head ascending, so the heads of one group run
  side by side and share its keys in L2). ``first``, ``count``: ``[b, groups]`` (``spans``: every head's), or
  ``[b, groups, heads]`` (``list_ranges``)."""
  b, groups = count.shape[:2]
  bi, group, head = jnp.meshgrid(jnp.arange(b), jnp.arange(groups), jnp.arange(heads), indexing="ij")
  by_head = lambda x: jnp.broadcast_to(x if x.ndim == 3 else x[..., None], bi.shape)
  tiles = by_head(count)
  order = jnp.lexsort([x.reshape(-1) for x in (head, group, bi, -tiles)])
  table = jnp.stack([bi * heads + head, group, by_head(first), tiles], axis=-1)
  return table.reshape(-1, TABLE)[order].astype(jnp.int32)


def bounds(masking: Masking, offset, forward: bool):
  """``(d_lo, d_hi)`` of ``row_ranges``: the forward's rows are queries (a query ``p`` keeps keys ``p + offset -
  hi .. p + offset - lo``), the backward's keys (a key ``p`` is kept by queries ``p - offset + lo .. p - offset +
  hi``); traced."""
  lo = -BIG if masking.lo is None else masking.lo
  hi = BIG if masking.hi is None else masking.hi
  if forward:
    return offset - hi, offset - lo
  return lo - offset, hi - offset


def summaries(masking: Masking, a_ids, b_ids, offset, forward: bool, shape: tuple[int, int, int], rows: int):
  """``[b, a_len // rows, SUMMARY]`` tile summaries of side ``a`` (``a_ids [b, a_len]``, ``b_ids [b, b_len]``,
  or None without ids; ``shape`` is ``(b, a_len, b_len)``) in tiles of ``rows``."""
  b, a_len, b_len = shape
  d_lo, d_hi = bounds(masking, offset, forward)
  if a_ids is None:
    summary = tile_summaries(*row_ranges(None, None, d_lo, d_hi, a_len, b_len), rows)
    return jnp.broadcast_to(summary, (b, *summary.shape))
  ranges = jax.vmap(lambda a, k: row_ranges(a, k, d_lo, d_hi, a_len, b_len))(a_ids, b_ids)
  return tile_summaries(*ranges, rows)


class MaskedPlan:
  """What a kernel's plan (a dataclass with a ``masking: Masking | None`` field) reads of its masked path."""

  masking: Masking | None

  @property
  def ids(self) -> bool:
    """The masked path compares segment ids: their tiles travel with Q and K."""
    return self.masking is not None and self.masking.ids

  @property
  def array(self) -> bool:
    """The masked path reads a mask array: its tiles' kinds, the items' tile lists, its bytes beside the
    streamed side's tiles (K in the forward, Q in the backward)."""
    return self.masking is not None and self.masking.array


# ------------------------------------------------------------------ mask arrays: kinds per pair of tiles


def combine(*kinds):
  """The kind of a pair of tiles that several masks all apply to: hidden where one hides it, full where all keep
  it whole, else partial."""
  out = kinds[0]
  for kind in kinds[1:]:
    out = jnp.where((out == HIDDEN) | (kind == HIDDEN), HIDDEN, jnp.maximum(out, kind))
  return out.astype(jnp.int32)


def array_kinds(mask, rows: int, cols: int):
  """``[mb, mh, a_len // rows, b_len // cols]`` int32 kinds of a mask array ``[mb, mh, a_len, b_len]`` (bool or
  bytes, nonzero: kept) in tiles of ``rows`` x ``cols``: hidden where a tile keeps nothing, full where it keeps
  all."""
  mb, mh, a_len, b_len = mask.shape
  tiles = (mask != 0).reshape(mb, mh, a_len // rows, rows, b_len // cols, cols)
  some, every = jnp.any(tiles, axis=(3, 5)), jnp.all(tiles, axis=(3, 5))
  return jnp.where(every, FULL, jnp.where(some, PARTIAL, HIDDEN)).astype(jnp.int32)


def pair_kinds(summary, cols: int, n_cols: int):
  """``[b, a tiles, n_cols]`` int32 kinds (``tile_kind``) of each tile of ``summary [b, a tiles, SUMMARY]`` against
  each of the other side's ``n_cols`` tiles of ``cols`` positions."""
  first = jnp.arange(n_cols, dtype=jnp.int32) * cols
  return tile_kind(lambda column: summary[..., column][..., None], first, first + cols - 1)


def mask_kinds(summary, mask, rows: int, cols: int):
  """``[kb, mh, a tiles, b tiles]`` kinds of a mask array ``mask [mb, mh, a_len, b_len]`` together with the band
  and ids that ``summary [sb, a tiles, SUMMARY]`` summarizes (``summaries``; ``sb`` 1 where it does not depend on
  the batch: a band alone), in tiles of ``rows`` x ``cols``; ``kb`` the larger of ``mb`` and ``sb``."""
  bands = pair_kinds(summary, cols, mask.shape[-1] // cols)  # [sb, a tiles, b tiles]
  return combine(array_kinds(mask, rows, cols), bands[:, None])


def tile_lists(kinds, per: int):
  """``(tiles [kb, mh, groups, b tiles], count [kb, mh, groups])`` int32: for each group of ``per`` consecutive
  row tiles of ``kinds [kb, mh, a tiles, b tiles]``, the other side's tiles some row tile of the group does not
  hide, ascending (``count`` of them; the rest of the row is padding)."""
  kb, mh, na, nb = kinds.shape
  shown = jnp.any(kinds.reshape(kb, mh, na // per, per, nb) != HIDDEN, axis=3)
  tiles = jnp.argsort(~shown, axis=-1, stable=True)  # the shown tiles first, ascending
  return tiles.astype(jnp.int32), jnp.sum(shown, axis=-1, dtype=jnp.int32)


def list_ranges(tiles, count, lo: int, hi: int):
  """``(first, count)`` int32: the entries of ``tile_lists``' rows (``tiles``, ``count``) that lie in ``[lo, hi)``
  (ascending: one run of entries)."""
  listed = jnp.arange(tiles.shape[-1]) < count[..., None]
  before = lambda bound: jnp.sum(listed & (tiles < bound), axis=-1, dtype=jnp.int32)
  return before(lo), before(hi) - before(lo)


def list_table(first, count, b: int, h: int):
  """``item_table`` of items by their tile lists' ranges: ``first``, ``count`` ``[kb, mh, groups]``
  (``list_ranges``; ``kb``, ``mh`` 1 where the mask broadcasts) for each of ``b`` rows and ``h`` heads."""
  by_item = lambda x: jnp.broadcast_to(jnp.swapaxes(x, 1, 2), (b, x.shape[2], h))
  return item_table(by_item(first), by_item(count), h)


def mask_bytes(mask):
  """A mask array ``[mb, mh, a_len, b_len]`` as the kernels load it: bytes (1: kept) ``[mb * mh, a_len, b_len]``
  (``array_index``), a tile a TMA copy of rows of ``b_len`` bytes (a multiple of 16, as TMA needs, where the
  kernels' tiles divide it), one squeezed dimension."""
  mb, mh, a_len, b_len = mask.shape
  return (mask != 0).astype(jnp.uint8).reshape(mb * mh, a_len, b_len)


def array_index(kinds, rows: int, bi, hi):
  """Batch ``bi`` and query head ``hi``'s index in ``mask_bytes``' first dimension (``rows`` of them), the
  mask's head count read off its ``kinds [kb, mh, ...]`` (``mask_kinds``); traced."""
  mh = kinds.shape[1]
  return (bi if rows > mh else 0) * mh + (hi if mh > 1 else 0)


def check_array(name: str, mask, b: int, h: int, s_q: int, s_kv: int) -> None:
  """A mask array's shape and dtype (``[b or 1, h or 1, s_q, s_kv]``, bool or integer), else
  ``PreconditionError`` naming the kernel ``name``."""
  shape, dtype = tuple(mask.shape), jnp.dtype(mask.dtype)
  if (len(shape) != 4 or shape[0] not in (1, b) or shape[1] not in (1, h) or shape[2:] != (s_q, s_kv)
      or not (dtype == jnp.bool_ or jnp.issubdtype(dtype, jnp.integer))):
    raise PreconditionError(f"{name}: mask must be a boolean array [b or 1, h or 1, s_q, s_kv] = [{b} or 1, {h} "
                            f"or 1, {s_q}, {s_kv}]; got {shape} {dtype}")
