"""Where a tensor lives on the mesh: ``Layout``, the one model of placements.

A layout gives, per dimension of a tensor, the mesh levels that split it
(major first), and the levels over which the values are still partial sums
waiting for a reduction (the output of a GEMM whose reduction axis is spread
over the mesh, before its all-reduce or reduce-scatter). A schedule's plan
gives each buffer's layouts over its canonical dimensions (one per axis,
``analysis.plan``); the graph search gives each tensor's over its own
dimensions. Both move between layouts by ``analysis.collectives``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Mapping, Sequence

from jax.sharding import PartitionSpec

from jaxmercury.ir.loops import spec_levels


@dataclasses.dataclass(frozen=True)
class Layout:
  """A tensor's placement.

  Attributes:
    dims: per dimension, the mesh levels splitting it, major first.
    partial: mesh levels over which each rank holds a partial sum; the true
      value is the sum over the ranks of those levels.
  """

  dims: tuple[tuple[str, ...], ...]
  partial: tuple[str, ...] = ()

  def __post_init__(self):
    object.__setattr__(self, "dims", tuple(tuple(e) for e in self.dims))
    object.__setattr__(self, "partial", tuple(self.partial))

  def __iter__(self):
    return iter(self.dims)

  def __len__(self) -> int:
    return len(self.dims)

  def __getitem__(self, dim: int) -> tuple[str, ...]:
    return self.dims[dim]

  def without(self, levels) -> "Layout":
    """The layout with ``levels`` splitting nothing (levels of size 1, or levels a consumer reads whole)."""
    drop = set(levels)
    return Layout(tuple(tuple(lv for lv in e if lv not in drop) for e in self.dims),
                  tuple(lv for lv in self.partial if lv not in drop))

  def devices(self, dim: int, sizes: Mapping[str, int]) -> int:
    """How many devices split dimension ``dim``."""
    return math.prod(sizes[lv] for lv in self.dims[dim])

  @classmethod
  def replicated(cls, rank: int) -> "Layout":
    return cls(((),) * rank)

  @classmethod
  def from_spec(cls, spec: PartitionSpec | None, rank: int, partial: Sequence[str] = ()) -> "Layout":
    """The layout a ``PartitionSpec`` over the tensor's dims describes."""
    spec = spec if spec is not None else PartitionSpec()
    dims = []
    for d in range(rank):
      entry = spec[d] if d < len(spec) else None
      dims.append(spec_levels(entry))
    return cls(tuple(dims), tuple(partial))

  @property
  def spec(self) -> PartitionSpec:
    """The ``PartitionSpec`` of the split dims (partial levels are not expressible in one)."""
    return PartitionSpec(*[None if not e else e[0] if len(e) == 1 else e for e in self.dims])

  @property
  def levels(self) -> set[str]:
    """Levels that split a dimension."""
    return {lv for e in self.dims for lv in e}

  def local_shape(self, shape: Sequence[int], sizes: Mapping[str, int]) -> tuple[int, ...]:
    """One device's block shape of a tensor of global ``shape``."""
    return tuple(n // math.prod(sizes[lv] for lv in e) for n, e in zip(shape, self.dims))

  def fits(self, shape: Sequence[int], sizes: Mapping[str, int]) -> bool:
    """Whether every split dimension divides evenly and no level is used twice."""
    used = [lv for e in self.dims for lv in e] + list(self.partial)
    if len(used) != len(set(used)) or len(shape) != len(self.dims):
      return False
    return all(n % math.prod(sizes[lv] for lv in e) == 0 for n, e in zip(shape, self.dims))

  def __str__(self) -> str:
    body = ", ".join("@".join(e) if e else "-" for e in self.dims)
    return f"[{body}]" + (f" partial({','.join(self.partial)})" if self.partial else "")


def enumerate_layouts(shape: Sequence[int], sizes: Mapping[str, int], *,
                      allowed: Callable[[Layout], bool] | None = None) -> list[Layout]:
  """Every layout of ``shape`` with each mesh level on at most one dimension.

  Levels sharing a dimension split it in mesh order (outer level major).

  Args:
    shape: the tensor's global shape.
    sizes: mesh level sizes, outermost first.
    allowed: optional filter (for example "the feature dimension stays whole").
  """
  levels = list(sizes)
  out = []
  for choice in itertools.product(range(len(shape) + 1), repeat=len(levels)):
    dims = [[] for _ in shape]
    for lv, d in zip(levels, choice):
      if d < len(shape):
        dims[d].append(lv)
    lay = Layout(tuple(tuple(e) for e in dims))
    if lay.fits(shape, sizes) and (allowed is None or allowed(lay)):
      out.append(lay)
  return out


def _groups(src: Sequence[int], dst: Sequence[int]) -> list[tuple[list[int], list[int]]] | None:
  """Pairs of groups of non-unit dimensions, of equal element counts, that a reshape maps onto each other."""
  a = [d for d, n in enumerate(src) if n != 1]
  b = [d for d, n in enumerate(dst) if n != 1]
  groups, i, j = [], 0, 0
  while i < len(a) and j < len(b):
    gi, gj = [a[i]], [b[j]]
    pi, pj = src[a[i]], dst[b[j]]
    i, j = i + 1, j + 1
    while pi != pj:
      if pi < pj and i < len(a):
        gi.append(a[i])
        pi, i = pi * src[a[i]], i + 1
      elif pj < pi and j < len(b):
        gj.append(b[j])
        pj, j = pj * dst[b[j]], j + 1
      else:
        return None
    groups.append((gi, gj))
  return groups if i == len(a) and j == len(b) else None


def view(layout: Layout, src: Sequence[int], dst: Sequence[int], sizes: Mapping[str, int]) -> Layout | None:
  """The layout of the same data reshaped from ``src`` to ``dst``, or None if a reshape must move data.

  Within each group of dimensions that the reshape merges or splits, the
  split levels must sit on the group's major non-unit dimension; they then
  split the major non-unit dimension of the other side, which must divide.
  """
  if tuple(src) == tuple(dst):
    return layout
  groups = _groups(src, dst)
  if groups is None:
    return None
  if any(layout.dims[d] for d, n in enumerate(src) if n == 1):
    return None
  dims: list[tuple[str, ...]] = [() for _ in dst]
  for gi, gj in groups:
    split = [d for d in gi if layout.dims[d]]
    if not split:
      continue
    if split != [gi[0]]:
      return None
    levels = layout.dims[gi[0]]
    if dst[gj[0]] % math.prod(sizes[lv] for lv in levels):
      return None
    dims[gj[0]] = levels
  return Layout(tuple(dims), layout.partial)
