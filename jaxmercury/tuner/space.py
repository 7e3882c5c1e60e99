"""The design space: schedules enumerated from primitives, as Mercury §6 does.

Communication schedules first fix, for each mesh level, which loop axis it
spreads (one ``parallelize`` per level, factors tiled in level order), then
which other axis, if any, is shifted along that level's parallel loop, and
whether sharded inputs are gathered (``shard`` on a read buffer) or outputs
reduce-scattered (``shard`` on the output). Computation schedules then tile
one remaining loop into serial blocks. Invalid combinations are dropped by the
primitives' own checks.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from jaxmercury.errors import ScheduleError
from jaxmercury.schedules.schedule import Schedule


def _spread(s: Schedule, axis: str, levels: list[str], parallel: bool) -> list[str]:
  names = []
  for lv in levels:
    rest = s.factors[axis][-1]
    name = f"{axis}_{lv}"
    s.tile(rest, s.levels[lv], names=(name, rest))
    if parallel:
      s.parallelize(name, lv)
    names.append(name)
  return names


def _communication(program, mesh, s_factory) -> Iterator[Schedule]:
  levels = list(mesh.axis_names)
  loops = [a.name for a in program.loops]
  for assign in itertools.product(loops, repeat=len(levels)):
    for shifts in itertools.product([None] + loops, repeat=len(levels)):
      if any(sh is not None and sh == a for sh, a in zip(shifts, assign)):
        continue
      for gather in (False, True):
        try:
          s = s_factory()
          par = {}
          for axis in dict.fromkeys(assign):
            lv = [l for l, a in zip(levels, assign) if a == axis]
            par.update(zip(lv, _spread(s, axis, lv, parallel=True)))
          for axis in dict.fromkeys(x for x in shifts if x):
            lv = [l for l, x in zip(levels, shifts) if x == axis]
            for l, name in zip(lv, _spread(s, axis, lv, parallel=False)):
              s.shift(name, par[l])
          if gather:
            _gather_or_scatter(s, par)
        except ScheduleError:
          continue
        yield s


def _gather_or_scatter(s: Schedule, par: dict):
  """Stores every buffer a parallel loop does not split as split (AllGather / ReduceScatter)."""
  prog = s.program
  changed = False
  for name in par.values():
    lp = s.loop(name)
    shifted = {x.axis for x in s.loops if x.shifted_by == name}
    for b in prog.reads + (prog.writes,):
      if lp.axis in b.axes or shifted & set(b.axes):
        continue
      if b is prog.writes and lp.kind == "s":
        continue
      s.shard(b.name, name)
      changed = True
  if not changed:
    raise ScheduleError("nothing to gather or scatter")


def _computation(s: Schedule, factors=(2,)) -> Iterator[Schedule]:
  yield s
  for lp in list(s.loops):
    if lp.role != "vector" or lp.extent < 2:
      continue
    for f in factors:
      try:
        t = s.copy()
        t.tile(lp.name, f, names=(f"{lp.name}_t", f"{lp.name}_b"))
        t.validate()
      except ScheduleError:
        continue
      yield t


def enumerate_schedules(program, mesh, *, tile_factors=(2,), limit: int | None = None) -> list[Schedule]:
  """All valid schedules of the design space, deduplicated by their traces."""
  seen, out = set(), []
  for comm in _communication(program, mesh, lambda: Schedule(program, mesh)):
    for s in _computation(comm, tile_factors):
      key = s.to_json()
      if key in seen:
        continue
      seen.add(key)
      out.append(s)
      if limit and len(out) >= limit:
        return out
  return out


def space_size(program, mesh) -> int:
  return len(enumerate_schedules(program, mesh))



