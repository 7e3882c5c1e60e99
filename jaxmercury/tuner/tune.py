"""``autotune``: pick the fastest correct schedule of a program on a mesh."""

from __future__ import annotations

import dataclasses
import random

import jax

from jaxmercury.schedules.library import library
from jaxmercury.tuner import cost, measure
from jaxmercury.tuner.memory import memory_per_device
from jaxmercury.tuner.space import enumerate_schedules


@dataclasses.dataclass
class Candidate:
  name: str
  schedule: object
  predicted_ms: float
  memory_bytes: int
  result: measure.Measurement | None = None

  @property
  def status(self) -> str:
    return self.result.status if self.result else "not timed"


@dataclasses.dataclass
class TuneResult:
  """The winner and every candidate considered, with why each lost or failed."""

  best: Candidate | None
  candidates: list

  def table(self) -> str:
    rows = ["| candidate | predicted ms | memory MiB | status | median ms | rel err | note |",
            "|---|---|---|---|---|---|---|"]
    for c in sorted(self.candidates, key=_rank):
      r = c.result
      rows.append(f"| {c.name} | {c.predicted_ms:.3f} | {c.memory_bytes / 2**20:.2f} | {c.status} | "
                  f"{'' if not r or r.median_ms is None else f'{r.median_ms:.3f}'} | "
                  f"{'' if not r or r.rel_err is None else f'{r.rel_err:.1e}'} | {'' if not r else r.reason} |")
    return "\n".join(rows)


def _rank(c):
  order = {"ok": 0, "wrong": 1, "failed": 2, "not timed": 3, "over memory": 4}
  t = c.result.median_ms if c.result and c.result.median_ms is not None else c.predicted_ms
  return order.get(c.status, 5), t


def default_machine(mesh) -> cost.Machine:
  return cost.CPU_SIMULATED if mesh.devices.flat[0].platform == "cpu" else cost.H200_NVLINK


def candidates(program, mesh, *, space: int = 24, seed: int = 0) -> list[tuple[str, object]]:
  """The library strategies, then a sample of the design space."""
  out = list(library(program, mesh).items())
  seen = {s.to_json() for _, s in out}
  rest = [s for s in enumerate_schedules(program, mesh) if s.to_json() not in seen]
  for s in random.Random(seed).sample(rest, min(space, len(rest))):
    out.append((describe(s), s))
  return out


def describe(schedule) -> str:
  """A short name for a schedule: its communication primitives."""
  short = {"parallelize": "par", "shift": "shift", "shard": "shard", "replicate": "repl", "tile": "tile"}
  parts = []
  for step in schedule.trace:
    name = step["primitive"]
    if name == "tile" and schedule.loop_or_none(step["kwargs"].get("names", [None])[0]) is not None \
        and schedule.loop(step["kwargs"]["names"][0]).role == "serial" \
        and not schedule.loop(step["kwargs"]["names"][0]).shifted_by:
      parts.append(f"tile({step['args'][0]},{step['args'][1]})")
    elif name in short and name != "tile":
      parts.append(f"{short[name]}({','.join(map(str, step['args']))})")
  return " ".join(parts) or "local"


def autotune(program, mesh, *, space: int = 24, top_k: int = 8, memory_budget: int | None = None,
         machine: cost.Machine | None = None, iters: int = 10, key=None, database=None,
         log=print) -> TuneResult:
  """Ranks candidates by the cost model, then checks and times the best ``top_k``.

  Args:
    program: the program to tune.
    mesh: the device mesh.
    space: how many design-space schedules to add to the library's.
    top_k: how many candidates (by predicted time) to compile and time.
    memory_budget: bytes per device; candidates estimated above it are pruned.
    machine: figures for the cost model; default by device platform.
    iters: timed runs per candidate (median reported).
    key: PRNG key for the random inputs; fresh inputs by default.
    database: a ``Database`` to store the winner in.
    log: progress printer.

  Returns:
    A ``TuneResult``; ``best`` is None when no candidate passed.
  """
  machine = machine or default_machine(mesh)
  cands = []
  for name, s in candidates(program, mesh, space=space):
    cands.append(Candidate(name, s, cost.predict(s, machine) * 1e3, memory_per_device(s)))
  fits = [c for c in cands if memory_budget is None or c.memory_bytes <= memory_budget]
  for c in cands:
    if c not in fits:
      c.result = measure.Measurement("over memory", reason=f"estimate above budget {memory_budget} B")
  fits.sort(key=lambda c: c.predicted_ms)
  key = key if key is not None else jax.random.key(random.SystemRandom().randrange(1 << 31))
  inputs = program.random_inputs(key)
  reference = program.reference(*inputs)
  for c in fits[:top_k]:
    c.result = measure.measure(c.schedule, inputs, reference, iters=iters)
    log(f"  {c.name:<28} {c.status:<7} "
        f"{'' if c.result.median_ms is None else f'{c.result.median_ms:9.3f} ms'} {c.result.reason}")
  ok = [c for c in cands if c.status == "ok"]
  best = min(ok, key=lambda c: c.result.median_ms) if ok else None
  if best is not None and database is not None:
    database.store(program, mesh, best.schedule, best.result.median_ms, len(cands))
  return TuneResult(best, cands)
