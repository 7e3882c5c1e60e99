"""The score and prune stages: what the cost model predicts, and what is worth compiling.

``score`` lays each proposed candidate out for the caller's layouts,
validates it and predicts its time (a training tune: its forward and
backward) and memory. ``prune`` then chooses what a tune compiles, because
compiling is most of a tune's time: the plain programs always (unless over
the memory budget), and of the others, in order, those that

1. validated (an invalid one is failed with the reason),
2. fit the memory budget,
3. lower to a program no earlier candidate lowers to (``program_key``),
4. are predicted within ``TuneConfig.margin`` of the best prediction, after
   the per-kernel corrections learned from the database
   (``accuracy.Corrections``; a caller's own candidates skip this rule),
5. and rank among the ``top_k`` best predicted.

The winner tuned for the nearest other sizes (``Database.nearest``) is
compiled too, whatever its prediction, so that a tune never does worse than
the schedule a miss would have run. Every candidate left out carries the
reason.
"""

from __future__ import annotations

import dataclasses
import math

from jaxmercury.analysis.memory import memory_per_device
from jaxmercury.errors import ScheduleError
from jaxmercury.schedules.trace import is_size
from jaxmercury.schedules.validate import validate
from jaxmercury.tuner import agree, cost, measure
from jaxmercury.tuner.candidates import GIVEN, NEAREST, Candidate, program_key
from jaxmercury.tuner.plain import PlainProgram


def score(task, config, machine: cost.Machine, candidates: list[Candidate]) -> list[Candidate]:
  """Each candidate for the caller's layouts, scored (``predicted_ms``, ``memory_bytes``); one that does not
  validate is failed with the reason. Plain programs and candidates already decided pass unchanged."""
  return [c if c.plain or c.result is not None else _scored(task, config, machine, c) for c in candidates]


def _scored(task, config, machine, c: Candidate) -> Candidate:
  schedule = c.schedule
  try:
    if task.layouts is not None:
      schedule = schedule.with_layouts(task.in_shardings, task.out_sharding)
    # a caller's schedule is checked against its trace too; the tuner's own are built by primitives alone
    validate(task.program, task.mesh, schedule=schedule, compiling=True, trace=c.origin == GIVEN)
    seconds = cost.predict(schedule, machine)
    if config.training:
      seconds += cost.backward_seconds(schedule, machine)
    return dataclasses.replace(c, schedule=schedule, predicted_ms=seconds * 1e3,
                               memory_bytes=memory_per_device(schedule))
  except ScheduleError as e:
    return dataclasses.replace(c, schedule=schedule, predicted_ms=math.inf, memory_bytes=0,
                               result=measure.Measurement(measure.FAILED, reason=f"invalid: {e}",
                                                          cause=measure.INVALID))


def device_budget(mesh) -> int | None:
  """90% of a GPU's memory (per device), None on CPUs."""
  device = agree.local_device(mesh)
  stats = device.memory_stats() if device.platform != "cpu" else None
  return int(0.9 * stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def prune(config, candidates: list[Candidate], corrections, *, near: Candidate | None = None, given: bool = False,
          log=print) -> list[Candidate]:
  """The candidates to compile, the plain programs first, the rest best predicted first; every other candidate
  gets a ``PRUNED`` result with the reason (see the module docstring).

  Args:
    config: the ``TuneConfig`` (``memory_budget``, resolved; ``margin``; ``top_k``).
    candidates: scored candidates (``score``).
    corrections: the ``accuracy.Corrections`` the predictions are ranked by.
    near: the candidate of the winner tuned for the nearest other sizes (``nearest``), or None.
    given: the candidates are the caller's: the margin rule does not apply.
    log: progress printer.
  """
  budget = config.memory_budget
  over = lambda c: budget is not None and c.memory_bytes > budget
  plain, fits, programs = [], [], {}  # programs: program_key -> the candidate compiled for it
  for c in candidates:
    if c.result is not None:
      continue
    if c.plain:
      if over(c):
        c.result = _pruned(f"its inputs and output alone take {c.memory_bytes} B, over the budget",
                           measure.OVER_BUDGET)
      else:
        plain.append(c)
      continue
    if over(c):
      c.result = _pruned(f"estimated {c.memory_bytes} B over the budget", measure.OVER_BUDGET)
      continue
    key = program_key(c.schedule)
    if key in programs:
      c.result = _pruned(f"same program as {programs[key].name}")
      continue
    programs[key] = c
    fits.append(c)
  fits.sort(key=corrections.ms)
  if not given:
    fits = _within_margin(fits, corrections, config.margin)
  for c in fits[config.top_k:]:
    c.result = _pruned(f"cost model ranks it below the top {config.top_k}")
  chosen = fits[:config.top_k]
  if near is not None and not given and _take_nearest(near, chosen, programs, over):
    chosen.append(near)
    log(f"also timing {near.name}: the winner tuned for the nearest other sizes")
  return plain + sorted(chosen, key=corrections.ms)


def _pruned(reason: str, cause: str = "") -> measure.Measurement:
  return measure.Measurement(measure.PRUNED, reason=reason, cause=cause)


def _within_margin(fits: list, corrections, margin: float) -> list:
  """``fits`` (best predicted first) less those predicted over ``margin`` times the best prediction, pruned with
  the ratio."""
  if not fits or not corrections.ms(fits[0]) > 0:
    return fits
  best = fits[0]
  for c in fits[1:]:
    ratio = corrections.ms(c) / corrections.ms(best)
    if ratio > margin:
      c.result = _pruned(f"predicted {corrections.ms(c):.3g} ms, {ratio:.1f}x the best prediction ({best.name})")
  return [c for c in fits if c.result is None]


def nearest(task, config, machine, near, candidates: list[Candidate]) -> Candidate | None:
  """The candidate of the winner tuned for the nearest other sizes (``near``, a ``Database.nearest`` answer):
  the scored candidate that has its trace, else a new one (origin ``"nearest"``, scored, appended to
  ``candidates``); None for no answer or a plain winner (the plain programs are always compiled)."""
  if near is None or isinstance(near.schedule, PlainProgram):
    return None
  trace = near.schedule.to_json()
  c = next((c for c in candidates if not c.plain and c.schedule.to_json() == trace), None)
  if c is None:
    mine = near.schedule.program.params
    sizes = {k: v for k, v in near.params.items() if is_size(v) and v != mine.get(k)}
    c = _scored(task, config, machine, Candidate(near.strategy, near.schedule, math.nan, 0, origin=NEAREST,
                                                 tuned_at=sizes))
    candidates.append(c)
  return c


def _take_nearest(c: Candidate, chosen: list, programs: dict, over) -> bool:
  """Whether the nearest sizes' candidate ``c`` is compiled besides ``chosen``: not when failed, over the memory
  budget, already chosen, or lowering to the program of another candidate (pruned so); one the cost model ranked
  out is taken back."""
  if any(x is c for x in chosen) or over(c):
    return False
  if c.result is not None and not (c.result.status == measure.PRUNED and (
      "top" in c.result.reason or "best prediction" in c.result.reason)):
    return False
  same = programs.get(program_key(c.schedule))
  if same is not None and same is not c:
    c.result = _pruned(f"same program as {same.name}")
    return False
  c.result = None
  return True
