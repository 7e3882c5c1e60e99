"""Collectives as data: what each does to a layout and the bytes it moves (``lowering.collectives`` runs them).

A resharding between a producer's layout and a consumer's is a sequence of
``Collective`` steps. Each step acts on one mesh level:

==================  ==================================================  ==========================
kind                effect on the layout                                bytes one device sends
==================  ==================================================  ==========================
``all_reduce``      drops ``level`` from the partial levels             2 (N-1)/N x local bytes
``reduce_scatter``  drops it from the partial levels (on a tensor not   (N-1)/N x local bytes
                    partial over it: sums the N copies), splits ``dim``
``all_gather``      ``level`` stops splitting ``dim`` (its minor split) (N-1) x local bytes
``all_to_all``      ``level`` moves from ``dim`` (minor) to ``to_dim``  (N-1)/N x local bytes
``slice``           ``level`` starts splitting ``dim``: a rank keeps    0
                    its own chunk
``scale``           multiplies by N, the level's size (local)           0
==================  ==================================================  ==========================

N is the level's size, "local bytes" the block a device holds before the
step; the figures are the ring algorithms' volumes (Chimera, Table 1).
Partial values travel in float32, as jaxmercury keeps reduction states.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from jaxmercury.analysis.layouts import Layout

ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER, ALL_TO_ALL, SLICE, SCALE = (
    "all_reduce", "reduce_scatter", "all_gather", "all_to_all", "slice", "scale")
COMMUNICATING = (ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER, ALL_TO_ALL)
PARTIAL_ITEMSIZE = 4  # partial sums are float32 reduction states


class CollectiveError(ValueError):
  """A collective does not apply to the layout it is given."""


@dataclasses.dataclass(frozen=True)
class Collective:
  """One step of a resharding, on one mesh level.

  Attributes:
    kind: one of ``all_reduce``, ``reduce_scatter``, ``all_gather``,
      ``all_to_all``, ``slice``, ``scale``.
    level: the mesh level.
    dim: the dimension gathered (``all_gather``, ``all_to_all``), scattered
      (``reduce_scatter``) or sliced (``slice``); None otherwise.
    to_dim: ``all_to_all`` only: the dimension the level splits afterwards.
  """

  kind: str
  level: str
  dim: int | None = None
  to_dim: int | None = None

  def describe(self, axes: Sequence[str] | None = None) -> str:
    """``all_gather(x along j)``: the step with its dimensions named by ``axes`` (a tensor's axis names)."""
    name = (lambda d: axes[d]) if axes is not None else (lambda d: f"dim {d}")
    if self.kind == ALL_TO_ALL:
      return f"all_to_all({self.level}: {name(self.dim)} -> {name(self.to_dim)})"
    if self.dim is None:
      return f"{self.kind}({self.level})"
    return f"{self.kind}({self.level} along {name(self.dim)})"

  def touches(self) -> frozenset[int]:
    """The dimensions whose split levels this step changes."""
    return frozenset(d for d in (self.dim, self.to_dim) if d is not None)

  def __str__(self) -> str:
    if self.kind == ALL_TO_ALL:
      return f"all_to_all({self.level}: dim {self.dim} -> {self.to_dim})"
    if self.dim is None:
      return f"{self.kind}({self.level})"
    return f"{self.kind}({self.level}, dim {self.dim})"


def apply(layout: Layout, c: Collective) -> Layout:
  """The layout after ``c``; raises ``CollectiveError`` when ``c`` does not apply."""
  dims = [list(e) for e in layout.dims]
  partial = list(layout.partial)
  if c.kind in (ALL_REDUCE, REDUCE_SCATTER, SCALE):
    if c.kind != SCALE and c.level in partial:
      partial.remove(c.level)
    elif c.kind == ALL_REDUCE:
      raise CollectiveError(f"{c}: the tensor is not partial over {c.level!r} ({layout})")
    if c.kind == REDUCE_SCATTER:
      if c.level in layout.levels:
        raise CollectiveError(f"{c}: level {c.level!r} already splits {layout}")
      dims[c.dim].append(c.level)
  elif c.kind in (ALL_GATHER, ALL_TO_ALL):
    if not dims[c.dim] or dims[c.dim][-1] != c.level:
      raise CollectiveError(f"{c}: level {c.level!r} is not the minor split of dim {c.dim} in {layout}")
    dims[c.dim].pop()
    if c.kind == ALL_TO_ALL:
      dims[c.to_dim].append(c.level)
  elif c.kind == SLICE:
    if c.level in layout.levels or c.level in layout.partial:
      raise CollectiveError(f"{c}: level {c.level!r} is already used by {layout}")
    dims[c.dim].append(c.level)
  else:
    raise CollectiveError(f"unknown collective kind {c.kind!r}")
  return Layout(tuple(tuple(e) for e in dims), tuple(partial))


def trajectory(layout: Layout, seq: Sequence[Collective]) -> list[Layout]:
  """The layouts before each step and after the last (``len(seq) + 1`` of them)."""
  out = [layout]
  for c in seq:
    out.append(apply(out[-1], c))
  return out


def bytes_moved(c: Collective, before: Layout, shape: Sequence[int], itemsize: int,
                sizes: Mapping[str, int]) -> float:
  """Bytes one device sends for ``c`` applied to a tensor of global ``shape`` in layout ``before``."""
  n = sizes[c.level]
  item = PARTIAL_ITEMSIZE if before.partial else itemsize
  local = math.prod(before.local_shape(shape, sizes)) * item
  if c.kind == ALL_REDUCE:
    return 2 * (n - 1) / n * local
  if c.kind in (REDUCE_SCATTER, ALL_TO_ALL):
    return (n - 1) / n * local
  if c.kind == ALL_GATHER:
    return (n - 1) * local
  return 0.0


def sequence_bytes(layout: Layout, seq: Sequence[Collective], shape, itemsize, sizes) -> float:
  """Total bytes one device sends for the whole sequence."""
  lays = trajectory(layout, seq)
  return sum(bytes_moved(c, lay, shape, itemsize, sizes) for c, lay in zip(seq, lays))


def sequence_seconds(layout: Layout, seq: Sequence[Collective], shape, itemsize, machine, sizes) -> float:
  """Time of the sequence on ``machine`` (a ``jaxmercury.tuner.cost.Machine``).

  Each communicating step costs its bytes over the level's link bandwidth,
  times the machine's ``gather_factor``, plus one latency.
  """
  total = 0.0
  for c, lay in zip(seq, trajectory(layout, seq)):
    if c.kind in COMMUNICATING:
      nbytes = bytes_moved(c, lay, shape, itemsize, sizes)
      total += machine.gather_factor * nbytes / machine.bandwidth(c.level) + machine.latency_s
  return total


def naive(src: Layout, dst: Layout) -> list[Collective]:
  """Synchronize the producer's output in full, then take what the consumer needs.

  All-reduce every partial level, all-gather every split (minor first), then
  slice into ``dst`` (major first): the redundant sequence that fusion
  (``jaxmercury.analysis.fusion``) starts from.
  """
  if dst.partial:
    raise CollectiveError(f"a consumer cannot read partial sums ({dst})")
  seq = [Collective(ALL_REDUCE, lv) for lv in src.partial]
  for d, levels in enumerate(src.dims):
    seq += [Collective(ALL_GATHER, lv, d) for lv in reversed(levels)]
  for d, levels in enumerate(dst.dims):
    seq += [Collective(SLICE, lv, d) for lv in levels]
  return seq


def steps(src: Layout, dst: Layout) -> list[Collective]:
  """The all-to-alls, all-gathers and slices that move a tensor from ``src`` to ``dst`` (neither partial).

  Per mesh level: a level that leaves one dimension and joins another becomes
  an ``all_to_all``; one that only leaves becomes an ``all_gather``; one that
  only joins becomes a ``slice`` at the rank's offset. Levels leave minor
  first and join major first, so each step acts on a dimension's minor split.
  """
  cur = [list(e) for e in src]
  dst = [tuple(e) for e in dst]
  keep = [_common_prefix(c, d) for c, d in zip(cur, dst)]
  removals = [(dim, lv) for dim in range(len(cur)) for lv in reversed(cur[dim][keep[dim]:])]
  out = []
  for dim, lv in removals:
    target = _next_addition(cur, dst, lv)
    if target is not None and target != dim:
      out.append(Collective(ALL_TO_ALL, lv, dim, target))
      cur[target].append(lv)
    else:
      out.append(Collective(ALL_GATHER, lv, dim))
    cur[dim].pop()
  for dim, entry in enumerate(dst):
    for lv in entry[len(cur[dim]):]:
      out.append(Collective(SLICE, lv, dim))
      cur[dim].append(lv)
  assert [tuple(c) for c in cur] == list(dst), (cur, dst)
  return out


def reductions(partial: Layout, result: Layout) -> list[Collective]:
  """The all-reduces and reduce-scatters that take ``partial`` (partial over some levels) to ``result``: a level
  that splits a dimension in ``result`` and not in ``partial`` is reduce-scattered along it, the others
  all-reduced; in ``partial``'s order of levels."""
  out = []
  for lv in partial.partial:
    dim = next((d for d, (a, b) in enumerate(zip(partial, result)) if lv in b and lv not in a), None)
    out.append(Collective(ALL_REDUCE, lv) if dim is None else Collective(REDUCE_SCATTER, lv, dim))
  return out


def _common_prefix(a, b):
  n = 0
  while n < min(len(a), len(b)) and a[n] == b[n]:
    n += 1
  return n


def _next_addition(cur, dst, level):
  """The dimension ``level`` should join next, if it can join one now."""
  for dim, entry in enumerate(dst):
    have = cur[dim]
    if len(have) < len(entry) and tuple(have) == entry[:len(have)] and entry[len(have)] == level:
      return dim
  return None
