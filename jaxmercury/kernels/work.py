"""Where a local kernel's work runs, known from the schedule alone (for the cost model).

A ``Block`` is one body call as the loop structure fixes it before tracing:
its sizes, the true extents, its start positions and zigzag chunks. A
kernel's ``work`` function maps a block to ``Work``: the share of the
block's dense work it computes on its own path and the share its dispatch
hands to the program's XLA body (padded keys, blocks spanning zigzag chunks,
partly masked causal blocks it cannot take).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from jaxmercury.ir.orders import zigzag_chunk
from jaxmercury.programs import masks


@dataclasses.dataclass(frozen=True)
class Work:
  """Where one body call's work runs, as shares of the block's dense work.

  The dense work is every (query, key) pair of the block computed, masked or
  not. A wholly masked causal block that is skipped has no work.

  Attributes:
    fast: the share the kernel computes on its own path.
    fallback: the share computed by the program's own (XLA) body.
  """

  fast: float = 1.0
  fallback: float = 0.0


@dataclasses.dataclass(frozen=True)
class Block:
  """One body call as known before tracing: what a kernel's ``work`` reads.

  Attributes:
    sizes: the block's extent along each axis.
    extents: each axis's true global extent (positions past it are padding).
    starts: the block's first stored position along each loop axis.
    zigzag: for axes stored in zigzag order, their number of chunks.
    band: an attention program's positional mask, ``(lo, hi)``: it keeps ``lo <= query - key <= hi``
      (``programs.masks.AttentionMask.band``; None: none).
    data: the program also masks by data (segment ids, a mask array), which hide pairs only known when running.
  """

  sizes: Mapping[str, int]
  extents: Mapping[str, int]
  starts: Mapping[str, int] = dataclasses.field(default_factory=dict)
  zigzag: Mapping[str, int] = dataclasses.field(default_factory=dict)
  band: tuple | None = None
  data: bool = False

  def renamed(self, names: Mapping[str, str]) -> "Block":
    """The same block with its axes renamed (``names``: old -> new; others kept)."""
    r = lambda m: {names.get(k, k): v for k, v in m.items()}
    return Block(r(self.sizes), r(self.extents), r(self.starts), r(self.zigzag), self.band, self.data)

  def contiguous(self, axis: str) -> bool:
    """Whether the block's true positions along ``axis`` are consecutive (``BlockContext.contiguous``)."""
    chunks = self.zigzag.get(axis)
    return chunks is None or (self.extents[axis] // chunks) % self.sizes[axis] == 0

  def padded(self, axis: str) -> bool:
    """Whether blocks of this size along ``axis`` may hold padding (the extent is not a multiple)."""
    return self.extents[axis] % self.sizes[axis] != 0

  def ranges(self, axis: str) -> list[tuple[int, int]]:
    """The block's true positions along ``axis`` as ``[start, stop)`` ranges (one unless zigzag splits it)."""
    start, size = self.starts.get(axis, 0), self.sizes[axis]
    chunks = self.zigzag.get(axis)
    if chunks is None:
      return [(start, start + size)]
    chunk = self.extents[axis] // chunks
    out = []
    for stored in range(start // chunk, (start + size - 1) // chunk + 1):
      lo, hi = max(start, stored * chunk), min(start + size, (stored + 1) * chunk)
      true = zigzag_chunk(stored, chunks) * chunk
      out.append((true + lo - stored * chunk, true + hi - stored * chunk))
    return out

  def span(self, axis: str) -> tuple[int, int]:
    """The smallest and largest true position of the block along ``axis``."""
    ranges = self.ranges(axis)
    return min(lo for lo, _ in ranges), max(hi for _, hi in ranges) - 1

  def causal_case(self, query: str = "i", key: str = "j") -> str:
    """``"visible"`` (every key at or before every query), ``"hidden"`` (every key after) or ``"partial"``."""
    return self.band_case(query, key, band=CAUSAL)

  def causal_share(self, query: str = "i", key: str = "j") -> float:
    """The share of the block's (query, key) pairs a causal mask keeps (real keys at or before the query)."""
    return self.band_share(query, key, band=CAUSAL)

  def band_case(self, query: str = "i", key: str = "j", band=None) -> str:
    """``"visible"``, ``"hidden"`` or ``"partial"``: whether ``band`` (default the block's) keeps all, none or
    some of the block's pairs, judged by their positions' extremes."""
    return masks.band_case(self.span(query), self.span(key), band or self.band or (None, None))

  def band_share(self, query: str = "i", key: str = "j", band=None) -> float:
    """The share of the block's (query, key) pairs that ``band`` (default the block's) keeps with a real key."""
    band = band or self.band or (None, None)
    kept = 0
    for q in self.ranges(query):
      for lo, hi in self.ranges(key):
        kept += masks.band_pairs(q, (lo, min(hi, self.extents[key])), band)
    return kept / (self.sizes[query] * self.sizes[key])


CAUSAL = (0, None)  # the band of a causal mask: query - key >= 0


def body_share(block: Block, causal: bool = False) -> float:
  """The dense share an attention program's own body computes: all of it unless its positional mask (the block's
  band, or a causal one) hides it all."""
  band = block.band or (CAUSAL if causal else None)
  return 0.0 if band and block.band_case(band=band) == "hidden" else 1.0


def band_work(block: Block, whole: bool, cut) -> Work:
  """The work of a kernel that takes ``block`` (``whole``) under the block's band: the body's share where it does
  not take it, all of it without a band or where the band keeps every pair, none where the band hides every pair,
  and ``cut(block) -> Work`` (the kernel's own rule) where the band cuts the block."""
  if not whole:
    return Work(fast=0.0, fallback=body_share(block))
  if block.band is None:
    return Work()
  case = block.band_case()
  if case == "visible":
    return Work()
  if case == "hidden":
    return Work(fast=0.0)
  return cut(block)
