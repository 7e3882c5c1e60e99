"""From a schedule's annotations to a communication plan.

Nothing here is written per strategy: each buffer's layouts follow from which
loops are parallel or shifted and which buffers were ``shard``-ed or
``replicate``-d, and the collectives follow from the differences between
layouts (see ``reshard``).

Layouts are tuples with one entry per canonical dimension (one per axis);
each entry is the tuple of mesh levels splitting that dimension, major first.
"""

from __future__ import annotations

import dataclasses
import math

from jax.sharding import PartitionSpec

from jaxmercury.errors import PreconditionError, ScheduleError
from jaxmercury.schedules.loops import PARALLEL

Layout = tuple  # tuple[tuple[str, ...], ...]


@dataclasses.dataclass(frozen=True)
class Ring:
  """A shifted loop: what travels around the ring of its parallel loop's level."""

  loop: str
  axis: str
  level: str
  size: int
  buffers: tuple[str, ...]  # read buffers passed around the ring
  travel: bool  # partial outputs travel (pipelined reduce-scatter)

  @property
  def offset(self) -> int:
    """Rank r visits (t + r + offset) % size; 1 lets the last visit be the owner's."""
    return 1 if self.travel else 0


@dataclasses.dataclass(frozen=True)
class CrossReduction:
  """Partial outputs of a parallel reduction loop, combined over its level."""

  loop: str
  level: str
  scatter_axis: str | None  # None: all-reduce


@dataclasses.dataclass(frozen=True)
class Plan:
  """What the lowering does, derived from the schedule."""

  storage: dict  # buffer -> Layout at the shard_map boundary
  resident: dict  # buffer -> Layout the loop nest works on (for the output: after the nest)
  result: Layout  # the output's layout after cross-level reductions
  rings: dict  # loop name -> Ring
  reductions: tuple  # CrossReduction, outermost first
  local_factors: dict  # buffer -> {axis: [loop names not distributed in its resident layout]}

  buffers: dict = dataclasses.field(default_factory=dict)  # name -> Buffer

  def spec(self, buffer: str) -> PartitionSpec:
    """The storage layout over the buffer's canonical dims (one per axis)."""
    return to_spec(self.storage[buffer])

  def user_spec(self, buffer: str) -> PartitionSpec | None:
    """The storage layout over the buffer's own dims, or None if it has none.

    A dimension that flattens several axes is split only when its minor axes
    are not: then the major axis's levels split the whole dimension.
    """
    buf, layout = self.buffers[buffer], iter(self.storage[buffer])
    entries = []
    for group in buf.dims:
      parts = [next(layout) for _ in group]
      if any(parts[1:]):
        return None
      entries.append(parts[0])
    return to_spec(tuple(entries))


def to_spec(layout: Layout) -> PartitionSpec:
  return PartitionSpec(*[None if not e else e[0] if len(e) == 1 else e for e in layout])


def from_spec(spec: PartitionSpec, buf) -> Layout:
  """A PartitionSpec over a buffer's own dims as a layout over its canonical dims."""
  out = []
  for dim, group in enumerate(buf.dims):
    entry = spec[dim] if dim < len(spec) else None
    names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    out.extend([names] + [()] * (len(group) - 1))
  return tuple(out)


def make_plan(schedule) -> Plan:
  """Derives layouts, rings and reductions; raises ScheduleError if inconsistent."""
  prog, levels = schedule.program, schedule.levels
  loops = {lp.name: lp for lp in schedule.loops}
  placements = schedule.placements
  out = prog.writes

  rings = {}
  for lp in schedule.loops:
    if not lp.shifted_by:
      continue
    par = loops[lp.shifted_by]
    ring_bufs = tuple(
        b.name for b in prog.reads
        if lp.axis in b.axes and par.axis not in b.axes
        and placements.get((b.name, par.level), ("shard",))[0] != "replicate")
    travel = lp.axis in out.axes and par.axis not in out.axes
    rings[lp.name] = Ring(lp.name, lp.axis, par.level, levels[par.level], ring_bufs, travel)

  def nest_layout(buf, ring_member):
    entries = []
    for a in buf.axes:
      lv = []
      for f in schedule.factors.get(a, []):
        floop = loops[f]
        if floop.role == PARALLEL or (floop.shifted_by and ring_member(floop.name)):
          lv.append(_level_of(floop, loops))
      entries.append(tuple(lv))
    return entries

  storage, resident, local_factors = {}, {}, {}
  for b in prog.reads:
    res = nest_layout(b, lambda name, b=b: b.name in rings[name].buffers)
    sto = [list(e) for e in res]
    for (name, level), place in placements.items():
      if name != b.name or (place[0] == "shard" and level in sto[b.axes.index(place[1])]):
        continue
      for e in sto:
        if level in e:
          e.remove(level)
      if place[0] == "shard":
        sto[b.axes.index(place[1])].append(level)
    resident[b.name] = tuple(res)
    storage[b.name] = tuple(tuple(e) for e in sto)

  res = nest_layout(out, lambda name: rings[name].travel)
  resident[out.name] = tuple(res)
  consumed = {r.level for r in rings.values() if r.travel}
  reductions, result = [], [list(e) for e in res]
  for lp in schedule.loops:
    if lp.role != PARALLEL or lp.kind != "r" or lp.level in consumed:
      continue
    place = placements.get((out.name, lp.level))
    axis = place[1] if place and place[0] == "shard" else None
    if axis is not None:
      for leaf_axes in prog.state_axes():
        if axis not in leaf_axes:
          raise PreconditionError(
              f"shard({out.name!r}, {lp.name!r}, axis={axis!r}): the {prog.reduction.name} reduction's "
              f"state has no axis {axis!r} to reduce-scatter along")
      result[out.axes.index(axis)].append(lp.level)
    reductions.append(CrossReduction(lp.name, lp.level, axis))
  result = tuple(tuple(e) for e in result)
  sto = [list(e) for e in result]
  for (name, level), place in placements.items():
    if name == out.name and place[0] == "replicate":
      for e in sto:
        if level in e:
          e.remove(level)
  storage[out.name] = tuple(tuple(e) for e in sto)

  if schedule.in_shardings is not None:
    for b, spec in zip(prog.reads, schedule.in_shardings):
      if spec is not None:
        storage[b.name] = from_spec(spec, b)
  if schedule.out_sharding is not None:
    storage[out.name] = from_spec(schedule.out_sharding, out)

  for b in prog.reads + (out,):
    for a, n in local_factor_names(schedule, b, resident[b.name], loops).items():
      local_factors.setdefault(b.name, {})[a] = n
      split = [f for f in schedule.factors[a] if f not in n]
      if schedule.factors[a][:len(split)] != split:
        raise ScheduleError(
            f"buffer {b.name!r}: along axis {a!r}, loop {split[-1]!r} splits it over the mesh while the "
            f"outer loop {schedule.factors[a][len(split) - 1]!r} does not; a buffer can only be split "
            f"over the outermost loops of an axis")
    for what, layout in (("storage", storage[b.name]), ("resident", resident[b.name])):
      _check_layout(schedule, b, layout, what)
  _check_layout(schedule, out, result, "result")
  return Plan(storage, resident, result, rings, tuple(reductions), local_factors, prog.buffers)


def _level_of(lp, loops):
  return lp.level if lp.role == PARALLEL else loops[lp.shifted_by].level


def local_factor_names(schedule, buf, layout, loops):
  """For each loop axis of ``buf``: its factors not distributed in ``layout``."""
  out = {}
  for a, levels in zip(buf.axes, layout):
    if a not in schedule.factors:
      continue
    out[a] = [f for f in schedule.factors[a] if not (loops[f].distributed and _level_of(loops[f], loops) in levels)]
  return out


def _check_layout(schedule, buf, layout, what):
  seen = {}
  for a, levels in zip(buf.axes, layout):
    for lv in levels:
      if lv in seen:
        raise ScheduleError(
            f"buffer {buf.name!r} would be split over mesh level {lv!r} along both {seen[lv]!r} and {a!r} "
            f"({what} layout); a level can split a buffer along one axis")
      seen[lv] = a
    extent = schedule.padded.get(a, schedule.program.axes[a].extent)
    size = math.prod(schedule.levels[lv] for lv in levels)
    if extent % size:
      raise ScheduleError(
          f"buffer {buf.name!r}: axis {a!r} (extent {extent}) does not split evenly over mesh levels "
          f"{levels} ({size} devices) in its {what} layout")
