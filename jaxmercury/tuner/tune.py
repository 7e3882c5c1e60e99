"""``autotune``: pick the fastest correct schedule of a program on a mesh.

Candidates are the library's strategies plus a sample of the design space,
each with every local kernel that applies. The cost model (calibrated once per
machine and program, then read from the database) ranks them; candidates over
the memory budget (default on GPUs: 90% of device memory) are pruned before
compiling; the library strategies and the best ``top_k`` others are compiled,
checked against the reference and timed. The winner and every
candidate's outcome go to the tuning database.
"""

from __future__ import annotations

import dataclasses
import random

import jax

from jaxmercury.pallas_kernels import registry
from jaxmercury.schedules.library import library
from jaxmercury.schedules.schedule import Schedule
from jaxmercury.tuner import cost, measure
from jaxmercury.tuner.calibrate import calibrate
from jaxmercury.tuner.memory import memory_per_device
from jaxmercury.tuner.reference import reference_output
from jaxmercury.tuner.space import enumerate_schedules


@dataclasses.dataclass
class Candidate:
  """One schedule considered by the tuner and what became of it."""

  name: str
  schedule: object
  predicted_ms: float
  memory_bytes: int
  result: measure.Measurement | None = None

  @property
  def status(self) -> str:
    return self.result.status if self.result else measure.PRUNED

  @property
  def time_ms(self) -> float | None:
    return self.result.median_ms if self.result else None

  def to_dict(self) -> dict:
    r = self.result
    return {"name": self.name, "schedule": self.schedule.to_json(), "predicted_ms": self.predicted_ms,
            "time_ms": self.time_ms, "memory_bytes": self.memory_bytes, "status": self.status,
            "reason": r.reason if r else "", "rel_err": r.rel_err if r else None,
            "compiled_bytes": r.compiled_bytes if r else None}


@dataclasses.dataclass
class TuneResult:
  """The winner and every candidate considered, with why each lost or failed."""

  best: Candidate | None
  candidates: list
  from_database: bool = False
  machine: cost.Machine | None = None

  def table(self) -> str:
    rows = ["| candidate | predicted ms | measured ms | memory MiB | status | note |",
            "|---|---|---|---|---|---|"]
    for c in sorted(self.candidates, key=_rank):
      t = "" if c.time_ms is None else f"{c.time_ms:.3f}"
      note = c.result.reason if c.result else ""
      rows.append(f"| {c.name} | {c.predicted_ms:.3f} | {t} | {c.memory_bytes / 2**20:.2f} | {c.status} | {note} |")
    return "\n".join(rows)


def _rank(c):
  order = {measure.OK: 0, measure.FAILED: 1, measure.PRUNED: 2}
  return order[c.status], c.time_ms if c.time_ms is not None else c.predicted_ms


def describe(schedule) -> str:
  """A short name for a schedule: its distributing primitives and serial tiles."""
  short = {"parallelize": "par", "shift": "shift", "shard": "shard", "replicate": "repl", "pad": "pad",
           "patch": "patch"}
  parts = []
  for step in schedule.trace:
    name, args = step["primitive"], step["args"]
    if name == "tile":
      outer = schedule.loop_or_none(step["kwargs"].get("names", [args[0] + "0"])[0])
      if outer is not None and outer.role == "serial" and not outer.shifted_by:
        parts.append(f"tile({args[0]},{args[1]})")
    elif name in short:
      parts.append(f"{short[name]}({','.join(map(str, args))})")
  return " ".join(parts) or "local"


def default_candidates(program, mesh, *, space: int = 24, seed: int = 0,
                       kernels=None) -> list[tuple[str, object]]:
  """The library strategies, then a sample of the design space, each with every applicable kernel."""
  base = list(library(program, mesh).items())
  seen = {s.to_json() for _, s in base}
  rest = [s for s in enumerate_schedules(program, mesh, tile_factors=(2, 4)) if s.to_json() not in seen]
  base += [(describe(s), s) for s in random.Random(seed).sample(rest, min(space, len(rest)))]
  kernels = kernels if kernels is not None else registry.candidates(program, mesh)
  out = []
  for name, s in base:
    for k in kernels:
      patched = s.copy() if k == "xla" else s.copy().patch(k)
      out.append((name if k == "xla" else f"{name} [{k}]", patched))
  return out


def _device_budget(mesh) -> int | None:
  stats = mesh.devices.flat[0].memory_stats() if mesh.devices.flat[0].platform != "cpu" else None
  return int(0.9 * stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def with_layouts(schedule, in_shardings, out_sharding):
  """The same schedule for callers whose arrays have the given layouts."""
  from jaxmercury.schedules.trace import replay
  fresh = Schedule(schedule.program, schedule.mesh, in_shardings=in_shardings, out_sharding=out_sharding)
  return replay(fresh, [dict(step) for step in schedule.trace])


def autotune(program, mesh, *, candidates=None, space: int = 24, top_k: int = 8,
             in_shardings=None, out_sharding=None,
             memory_budget: int | None = None, machine: cost.Machine | None = None, iters: int = 10,
             time_limit_s: float | None = None, key=None, database=None, retune: bool = False,
             log=print) -> TuneResult:
  """Finds the fastest correct schedule of ``program`` on ``mesh``.

  Args:
    program: the program to tune.
    mesh: the device mesh.
    candidates: (name, Schedule) pairs to choose among; default the library
      plus ``space`` design-space schedules, with every applicable kernel.
    space: how many design-space schedules to add to the library's.
    in_shardings: the layouts (``PartitionSpec`` per input) the caller's
      arrays have; every candidate is lowered for them, so that moving the
      inputs into its own layout counts in its time.
    out_sharding: the layout the caller needs the output in.
    top_k: how many candidates besides the library's, best predicted first,
      to compile and time (library strategies that fit are always timed).
    memory_budget: bytes per device; candidates estimated above it are pruned.
      Default: 90% of a GPU's memory, no limit on CPU.
    machine: cost-model figures; default read from ``database`` or measured by
      ``calibrate`` (and stored).
    iters: timed runs per candidate (the median counts).
    time_limit_s: a candidate whose compile and first run take longer fails.
    key: PRNG key for the random inputs; fresh inputs by default.
    database: a ``Database``: a stored winner is returned without tuning
      (unless ``retune``), and a new winner is stored.
    retune: tune even when the database holds a winner.
    log: progress printer.

  Returns:
    A ``TuneResult``; ``best`` is None when no candidate passed.
  """
  layouts = None if in_shardings is None and out_sharding is None else (in_shardings, out_sharding)
  if database is not None and not retune:
    record = database.lookup_record(program, mesh, layouts)
    if record is not None:
      log(f"found in {database.path}: {record.winner.name} ({record.winner.time_ms:.3f} ms)")
      return TuneResult(record.winner, record.candidates, from_database=True)
  if machine is None and database is not None:
    machine = database.machine(program, mesh)
  if machine is None:
    log("calibrating the cost model on this machine ...")
    machine = calibrate(program, mesh)
    if database is not None:
      database.store_machine(program, mesh, machine)
  memory_budget = memory_budget if memory_budget is not None else _device_budget(mesh)
  pairs = candidates if candidates is not None else default_candidates(program, mesh, space=space)
  if in_shardings is not None or out_sharding is not None:
    pairs = [(n, with_layouts(s, in_shardings, out_sharding)) for n, s in pairs]
  cands = [Candidate(name, s, cost.predict(s, machine) * 1e3, memory_per_device(s)) for name, s in pairs]
  fits = []
  for c in cands:
    if memory_budget is not None and c.memory_bytes > memory_budget:
      c.result = measure.Measurement(measure.PRUNED, reason=f"estimated {c.memory_bytes} B over the budget")
    else:
      fits.append(c)
  fits.sort(key=lambda c: c.predicted_ms)
  library_names = set(library(program, mesh))
  anchors = [c for c in fits if c.name.split(" [")[0] in library_names]
  ranked = [c for c in fits if c not in anchors]
  for c in ranked[top_k:]:
    c.result = measure.Measurement(measure.PRUNED, reason=f"cost model ranks it below the top {top_k}")
  fits = sorted(anchors + ranked[:top_k], key=lambda c: c.predicted_ms)
  key = key if key is not None else jax.random.key(random.SystemRandom().randrange(1 << 31))
  inputs = program.random_inputs(key)
  reference = reference_output(program, inputs, mesh.devices.flat[0])
  for n, c in enumerate(fits):
    c.result = measure.measure(c.schedule, inputs, reference, iters=iters, time_limit_s=time_limit_s)
    shown = f"{c.time_ms:9.3f} ms" if c.time_ms is not None else c.result.reason
    log(f"  [{n + 1}/{len(fits)}] {c.name:<40} predicted {c.predicted_ms:9.3f} ms  {c.status:<6} {shown}")
  ok = [c for c in cands if c.status == measure.OK]
  best = min(ok, key=lambda c: c.time_ms) if ok else None
  if best is not None and database is not None:
    database.store(program, mesh, best, cands, layouts)
  return TuneResult(best, cands, machine=machine)


def predict_candidates(program, mesh, machine: cost.Machine, *, space: int = 24, in_shardings=None,
                       out_sharding=None) -> list[Candidate]:
  """Predicted time and memory of each candidate on ``mesh``, which may be an AbstractMesh.

  Nothing is compiled: this plans for meshes larger than the machine, with
  ``machine`` giving (for example, through ``Machine.with_links``) the links
  those meshes would have. Kernels are those ``machine`` has rates for; the
  caller's layouts, when given, are fixed as in ``autotune``.
  """
  kernels = sorted(machine.kernel_flops_per_s) or ["xla"]
  pairs = default_candidates(program, mesh, space=space, kernels=kernels)
  if in_shardings is not None or out_sharding is not None:
    pairs = [(n, with_layouts(s, in_shardings, out_sharding)) for n, s in pairs]
  cands = [Candidate(name, s, cost.predict(s, machine) * 1e3, memory_per_device(s)) for name, s in pairs]
  return sorted(cands, key=lambda c: c.predicted_ms)
