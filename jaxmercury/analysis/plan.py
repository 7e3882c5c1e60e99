"""From a schedule's annotations to a communication plan.

Nothing here is written per strategy: each buffer's layouts follow from which
loops are parallel or shifted and which buffers were ``shard``-ed or
``replicate``-d, and the collectives follow from the differences between
layouts (see ``reshard``).

Layouts are ``analysis.layouts.Layout``s over each buffer's canonical
dimensions (one per axis): per dimension the mesh levels splitting it, major
first; the output's resident layout is partial over the levels its
cross-level reductions combine. The collectives between layouts are
``analysis.collectives`` steps (``Plan.collectives``).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from jax.sharding import PartitionSpec

from jaxmercury.analysis import collectives as cl
from jaxmercury.analysis.layouts import Layout
from jaxmercury.errors import PreconditionError, ScheduleError
from jaxmercury.ir.loops import PARALLEL, SERIAL, VECTOR, spec_levels
from jaxmercury.kernels.work import Block
from jaxmercury.programs.masks import KV_SEGMENTS, Q_SEGMENTS, mask_of


@dataclasses.dataclass(frozen=True)
class Ring:
  """A shifted loop: what travels around the ring of its parallel loop's level.

  ``distances``: where an attention program's positional mask (causal, a
  sliding window) hides every block of some steps from every rank, the
  distances ``(visited block - rank) % size`` some rank computes; the other
  steps are skipped, their compute and their transfers (None: every step runs).

  ``chain``: where segment ids (packed sequences) travel with the ring, the
  distances of the steps the positional mask keeps, nearest first (by the
  smallest query-key distance some rank's blocks have there): when running,
  the ring runs the shortest prefix of it that holds every step at which
  some device's blocks keep a pair (``programs.packing.keeps``), the
  transfers going straight from one step run to the next (None: the steps
  are fixed).
  """

  loop: str
  axis: str
  level: str
  size: int
  buffers: tuple[str, ...]  # read buffers passed around the ring
  travel: bool  # partial outputs travel (pipelined reduce-scatter)
  distances: frozenset | None = None
  chain: tuple[int, ...] | None = None

  @property
  def offset(self) -> int:
    """Rank r visits (t + r + offset) % size; 1 lets the last visit be the owner's."""
    return 1 if self.travel else 0

  def steps(self, offset: int | None = None) -> list[int]:
    """The steps that run when rank r visits ``(t + r + offset) % size`` (default this ring's offset): all but
    those no rank computes a block at (at least one: a ring with nothing to compute runs its first step)."""
    offset = self.offset if offset is None else offset
    if self.distances is None:
      return list(range(self.size))
    return [t for t in range(self.size) if (t + offset) % self.size in self.distances] or [0]

  def chain_steps(self, offset: int | None = None) -> list[int]:
    """The ``chain``'s steps in its order when rank r visits ``(t + r + offset) % size`` (default this ring's
    offset)."""
    offset = self.offset if offset is None else offset
    return [(d - offset) % self.size for d in self.chain]

  @property
  def skipped(self) -> int:
    """How many of its steps the ring skips."""
    return self.size - len(self.steps())

  @property
  def transfers(self) -> int:
    """How many times the ring's blocks move (``moves`` of the steps it runs)."""
    return self.moves(self.steps())

  def moves(self, steps) -> int:
    """How many times the ring's blocks move (``ppermute`` rounds, of one or several hops) when it runs ``steps``
    in that order: before each step but the first, before the first unless it is step 0, and, for travelling
    partial outputs, once more after the last step unless it is the last step."""
    return len(steps) - 1 + (steps[0] > 0) + (self.travel and steps[-1] != self.size - 1)


@dataclasses.dataclass(frozen=True)
class CrossReduction:
  """Partial outputs of a parallel reduction loop, combined over its level."""

  loop: str
  level: str
  scatter_axis: str | None  # None: all-reduce


@dataclasses.dataclass(frozen=True)
class Plan:
  """What the lowering does, derived from the schedule (immutable: one derivation serves compile and gradients).

  Attributes:
    storage: buffer -> ``Layout`` at the ``shard_map`` boundary.
    resident: buffer -> ``Layout`` the loop nest works on (the output's: after the nest, partial over the
      levels its cross-level reductions combine).
    result: the output's layout after the cross-level reductions.
    rings: shifted loop name -> ``Ring``.
    reductions: ``CrossReduction`` per parallel reduction loop, outermost first.
    local_factors: buffer -> {axis: the loop names not distributed in its resident layout}.
    buffers: name -> ``Buffer``.
  """

  storage: dict
  resident: dict
  result: Layout
  rings: dict
  reductions: tuple
  local_factors: dict
  buffers: dict = dataclasses.field(default_factory=dict)

  def spec(self, buffer: str) -> PartitionSpec:
    """The storage layout over the buffer's canonical dims (one per axis)."""
    return to_spec(self.storage[buffer])

  def user_spec(self, buffer: str) -> PartitionSpec | None:
    """The storage layout over the buffer's own dims, or None if it has none.

    A dimension that flattens several axes is split only when its minor axes
    are not: then the major axis's levels split the whole dimension.
    """
    return user_spec(self.buffers[buffer], self.storage[buffer])

  def collectives(self) -> list[tuple[str, cl.Collective]]:
    """``(buffer, collective)`` for every collective outside the rings, in program order: each input moved from
    its storage to its resident layout, the output's cross-level reductions, the output moved to its storage."""
    out = []
    for name in self.buffers:
      if name != self.output:
        out += [(name, c) for c in cl.steps(self.storage[name], self.resident[name])]
    out += [(self.output, c) for c in cl.reductions(self.resident[self.output], self.result)]
    out += [(self.output, c) for c in cl.steps(self.result, self.storage[self.output])]
    return out

  @property
  def output(self) -> str:
    return list(self.buffers)[-1]


def user_spec(buf, layout: Layout) -> PartitionSpec | None:
  """``layout`` (over ``buf``'s canonical dims) as a spec over its own dims, or None if it has none."""
  layout = iter(layout)
  entries = []
  for group in buf.dims:
    parts = [next(layout) for _ in group]
    if any(parts[1:]):
      return None
    entries.append(parts[0])
  return to_spec(Layout(tuple(entries)))


def to_spec(layout: Layout) -> PartitionSpec:
  return PartitionSpec(*[None if not e else e[0] if len(e) == 1 else e for e in layout])


def from_spec(spec: PartitionSpec, buf) -> Layout:
  """A PartitionSpec over a buffer's own dims as a layout over its canonical dims."""
  out = []
  for dim, group in enumerate(buf.dims):
    entry = spec[dim] if dim < len(spec) else None
    names = spec_levels(entry)
    out.extend([names] + [()] * (len(group) - 1))
  return Layout(tuple(out))


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
  for name, d in _band_distances(schedule, loops, rings).items():
    rings[name] = dataclasses.replace(rings[name], distances=d)
  for name, chain in _data_chains(schedule, loops, rings).items():
    rings[name] = dataclasses.replace(rings[name], chain=chain)

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
    resident[b.name] = Layout(tuple(res))
    storage[b.name] = Layout(tuple(sto))

  res = nest_layout(out, lambda name: rings[name].travel)
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
  resident[out.name] = Layout(tuple(res), tuple(r.level for r in reductions))
  result = Layout(tuple(result))
  sto = [list(e) for e in result]
  for (name, level), place in placements.items():
    if name == out.name and place[0] == "replicate":
      for e in sto:
        if level in e:
          e.remove(level)
  storage[out.name] = Layout(tuple(sto))

  if schedule.in_shardings is not None:
    for b, spec in zip(prog.reads, schedule.in_shardings):
      if spec is not None:
        storage[b.name] = from_spec(spec, b)
  if schedule.out_sharding is not None:
    storage[out.name] = from_spec(schedule.out_sharding, out)

  for b in prog.reads + (out,):
    local_factors[b.name] = {}  # a buffer of block axes only (a router) has none
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


ATTENTION_PATTERNS = ("attention", "attention_dq", "attention_dkv")


def body_calls(schedule, rings, axes) -> tuple:
  """Every body call of the nest on every device, enumerated over the mesh levels and the serial loops on ``axes``
  (device-major: the calls of one device are consecutive).

  Returns:
    ``(index, rank, starts)``: ``index(loop)``, the block each call visits on ``loop`` (a ring's rank ``r``
    visits ``(t + r + offset) % size`` at step ``t``); ``rank``, each call's coordinate per mesh level; ``starts``,
    per axis of ``axes``, each call's first stored position on it, as the nest computes it.
  """
  level_names = list(schedule.levels)
  loops = {lp.name: lp for lp in schedule.loops}
  serial = [lp for lp in schedule.loops if lp.role == SERIAL and lp.axis in axes]
  shape = [schedule.levels[lv] for lv in level_names] + [lp.extent for lp in serial]
  grid = np.indices(shape).reshape(len(shape), -1)
  rank = dict(zip(level_names, grid))
  step = {lp.name: grid[len(level_names) + n] for n, lp in enumerate(serial)}

  def index(lp):
    if lp.role == PARALLEL:
      return rank[lp.level]
    if lp.shifted_by:
      ring = rings[lp.name]
      return (step[lp.name] + rank[ring.level] + ring.offset) % lp.extent
    return step[lp.name]

  starts = []
  for a in axes:
    start, stride = np.zeros(grid.shape[1], np.int64), 1
    for f in reversed(schedule.factors[a]):
      lp = loops[f]
      if lp.role != VECTOR:
        start = start + index(lp) * stride
      stride *= lp.extent
    starts.append(start)
  return index, rank, starts


SEQUENCE = ("i", "j")  # the query and key axes: what positional masks compare


def _call_blocks(schedule, loops, rings):
  """Every body call of the nest on every device (``body_calls``) as a ``kernels.work.Block`` over the query and
  key axes: ``(index, rank, blocks, inverse)``, the distinct blocks and each call's one (``blocks[inverse]``)."""
  index, rank, starts = body_calls(schedule, rings, SEQUENCE)
  sizes = {a: math.prod(loops[f].extent for f in schedule.factors[a] if loops[f].role == VECTOR) for a in SEQUENCE}
  extents = {a: schedule.program.axes[a].extent for a in SEQUENCE}
  cols, inverse = np.unique(np.stack(starts), axis=1, return_inverse=True)
  blocks = [Block(sizes, extents, dict(zip(SEQUENCE, map(int, col))), schedule.zigzags) for col in cols.T]
  return index, rank, blocks, np.reshape(inverse, -1)


def _band_distances(schedule, loops, rings) -> dict[str, frozenset]:
  """For each ring whose steps an attention program's positional mask hides from every rank, the distances
  ``(visited block - rank) % size`` that some rank computes (``Ring.distances``).

  Every body call on every device is enumerated over the loops that move the query and key positions (the
  mesh levels, the serial loops on ``i`` and ``j``), as the nest computes them; a call is hidden when the band
  keeps none of its pairs (``kernels.work.Block.band_case``).
  """
  prog = schedule.program
  mask = mask_of(prog.params)
  if not rings or prog.pattern not in ATTENTION_PATTERNS or not mask.positional or not {"i", "j"} <= set(prog.kinds):
    return {}
  index, rank, blocks, inverse = _call_blocks(schedule, loops, rings)
  shown = np.array([b.band_case(band=mask.band) != "hidden" for b in blocks])[inverse]
  out = {}
  for name, ring in rings.items():
    lp = loops[name]
    if lp.axis not in SEQUENCE:  # a ring over heads (or batch): every step holds the same positions
      continue
    distance = (index(lp) - rank[ring.level]) % ring.size
    needed = frozenset(int(d) for d in np.unique(distance[shown]))
    if len(needed) < ring.size:
      out[name] = needed
  return out


SEGMENT_IDS = {"i": Q_SEGMENTS, "j": KV_SEGMENTS}  # the segment ids along each sequence axis


def _data_chains(schedule, loops, rings) -> dict[str, tuple[int, ...]]:
  """For each ring around which an attention program's segment ids travel, its ``Ring.chain``: the distances of
  the steps its positional mask keeps (``Ring.distances``), ordered by the smallest ``|query - key|`` among the
  pairs the band keeps in any body call at that distance (ties: nearest distance first). Of rings nested on one
  axis (a ring over each mesh level) the innermost only: an outer ring's block is split over the inner ring's
  devices."""
  prog = schedule.program
  mask = mask_of(prog.params)
  if not rings or prog.pattern not in ATTENTION_PATTERNS or not mask.segment_ids or not {"i", "j"} <= set(prog.kinds):
    return {}
  index, rank, blocks, inverse = _call_blocks(schedule, loops, rings)
  gaps = np.array([_band_gap(b, mask.band) for b in blocks])[inverse]
  out = {}
  for name, ring in rings.items():
    lp = loops[name]
    inner = schedule.loops[schedule.loops.index(lp) + 1:]
    if lp.axis not in SEQUENCE or SEGMENT_IDS[lp.axis] not in ring.buffers or any(
        other.shifted_by and other.axis == lp.axis for other in inner):
      continue
    distance = (index(lp) - rank[ring.level]) % ring.size
    nearest = {d: float(gaps[distance == d].min()) for d in range(ring.size) if np.any(distance == d)}
    kept = [d for d, gap in nearest.items() if np.isfinite(gap) and (ring.distances is None or d in ring.distances)]
    out[name] = tuple(sorted(kept, key=lambda d: (nearest[d], min(d, ring.size - d), d))) or (0,)
  return out


def _band_gap(block: Block, band) -> float:
  """The smallest ``|query - key|`` of the block's pairs that ``band`` keeps (real keys only; inf: none)."""
  lo, hi = band
  best = np.inf
  for qa, qb in block.ranges("i"):
    for ka, kb in block.ranges("j"):
      kb = min(kb, block.extents["j"])
      if qb <= qa or kb <= ka:
        continue
      low, high = qa - (kb - 1), (qb - 1) - ka  # the block's query - key differences
      low, high = max(low, lo) if lo is not None else low, min(high, hi) if hi is not None else high
      if low <= high:
        best = min(best, 0 if low <= 0 <= high else min(abs(low), abs(high)))
  return best


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
