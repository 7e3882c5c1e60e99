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
  """

  sizes: Mapping[str, int]
  extents: Mapping[str, int]
  starts: Mapping[str, int] = dataclasses.field(default_factory=dict)
  zigzag: Mapping[str, int] = dataclasses.field(default_factory=dict)

  def renamed(self, names: Mapping[str, str]) -> "Block":
    """The same block with its axes renamed (``names``: old -> new; others kept)."""
    r = lambda m: {names.get(k, k): v for k, v in m.items()}
    return Block(r(self.sizes), r(self.extents), r(self.starts), r(self.zigzag))

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
    (q_lo, q_hi), (k_lo, k_hi) = self.span(query), self.span(key)
    if k_hi <= q_lo:
      return "visible"
    return "hidden" if k_lo > q_hi else "partial"

  def causal_share(self, query: str = "i", key: str = "j") -> float:
    """The share of the block's (query, key) pairs a causal mask keeps (real keys at or before the query)."""
    kept = 0
    for q in self.ranges(query):
      for lo, hi in self.ranges(key):
        kept += _pairs_at_or_below(q, (lo, min(hi, self.extents[key])))
    return kept / (self.sizes[query] * self.sizes[key])


def _pairs_at_or_below(queries: tuple[int, int], keys: tuple[int, int]) -> int:
  """How many (x, y) with x in ``queries``, y in ``keys`` (``[start, stop)`` ranges) have y <= x."""
  c, d = keys
  if d <= c:
    return 0

  def below(n):  # sum over x < n of the keys at or before x
    m = max(min(n, d) - c, 0)
    return m * (m + 1) // 2 + max(n - d, 0) * (d - c)

  return below(queries[1]) - below(queries[0])


def body_share(block: Block, causal: bool) -> float:
  """The dense share an attention program's own body computes: all of it unless causal masking hides it all."""
  return 0.0 if causal and block.causal_case() == "hidden" else 1.0
