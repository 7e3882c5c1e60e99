"""``autotune``: pick the fastest correct schedule of a program on a mesh.

Candidates are the library's strategies plus a sample of the design space,
each with every local kernel that applies, and each with every fused lowering
that applies (``Schedule.lower_with``: the whole nest as one fused kernel, on
Hopper GPUs for the all-gather GEMMs); on a mesh of one device, where every
communication schedule is the local loop nest, the local nest (``"local"``)
with each kernel and fused lowering. Beside them stand the plain programs
(``tuner.plain``): what the user would otherwise run, XLA partitioning the
operator written in JAX (``jnp.dot``, ``jax.nn.dot_product_attention`` with
cuDNN where it runs), in the caller's layouts.

Candidates that lower to the same program (``candidates.program_key``) are
merged first: one is kept, the others are pruned ("same program as ...").
The cost model (calibrated once per machine, pattern and dtype, then read from the
database) ranks them; candidates over the memory budget (default on GPUs:
90% of device memory) are pruned before compiling. Each library strategy is
timed once, with the kernel the cost model predicts fastest for it (its
anchor); every other candidate, the strategies' other kernels included,
competes for the ``top_k`` best predicted places, and the rest are pruned
("cost model ranks it below the top k"). The plain programs are always timed.
The timed ones are compiled, checked against the reference and timed (a
fused lowering of a library strategy is timed once too, so it meets the
``shard_map`` lowering of the same schedule). The winner is decided in a
final round (``tuner.decide``, on one process): the best plain program and
the candidates closest to the best time run side by side in interleaved
rounds until their differences are resolved or a time budget is spent; the
winner comes from those times alone, the plain program wins unless a schedule
beats it beyond the noise, and ties within the noise are reported. The winner
and every candidate's outcome go to the tuning database.

Reliability: the program, mesh, layouts and every candidate are validated
before anything is traced (an invalid candidate fails with the reason); each
candidate runs under a hard time limit (``watchdog``) and any failure (compile
error, out of memory, time-out, NaN, wrong values) fails only that candidate;
each measurement is stored as soon as it is taken, so an interrupted tune
resumes; under ``jax.distributed`` process 0 decides and broadcasts
(``agree``), and times are combined so that the slowest process counts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import random
import sqlite3
import time

import jax

from jaxmercury.analysis import dispatch as dispatches
from jaxmercury.analysis import placements
from jaxmercury.analysis.memory import memory_per_device
from jaxmercury.errors import PreconditionError, ScheduleError
from jaxmercury.kernels import config as configs
from jaxmercury.kernels import registry
from jaxmercury.schedules.library import library
from jaxmercury.schedules.schedule import Schedule
from jaxmercury.schedules.trace import is_size
from jaxmercury.schedules.validate import validate
from jaxmercury.tuner import agree, ahead, cost, decide, measure, watchdog
from jaxmercury.tuner.calibrate import calibrate
from jaxmercury.tuner.candidates import (
  GIVEN,
  LIBRARY,
  NEAREST,
  PLAIN,
  SPACE,
  Candidate,
  Final,
  kernel_choices,
  program_key,
)
from jaxmercury.tuner.database import FORWARD, RECORD_FORMAT, TRAINING, record_from_data
from jaxmercury.tuner.plain import PlainProgram, plain_programs
from jaxmercury.tuner.progress import calibration_progress
from jaxmercury.tuner.reference import trial
from jaxmercury.tuner.space import enumerate_schedules


@dataclasses.dataclass
class TuneResult:
  """The winner and every candidate considered, with why each lost or failed.

  Attributes:
    best: the winner (a plain program when no schedule beats it beyond the noise: ``best.plain``), or None
      when no candidate passed.
    candidates: every candidate, plain ones included.
    from_database: read from the tuning database, not tuned.
    machine: the cost model's figures.
    resumed: measurements read back from the database instead of taken.
    objective: what the times are of: the forward, or a training step (``database.TRAINING``).
    decision: how the winner was chosen (the final round's verdict, ties within noise named).
    tied: the candidates tied with the winner within the final round's noise.
    phases: seconds per phase of the tune (``calibration``, ``plan``, ``compile ahead``, ``reference``,
      ``compile and check``, ``timing``, ``final round``); empty for a winner read from the database.
  """

  best: Candidate | None
  candidates: list
  from_database: bool = False
  machine: cost.Machine | None = None
  resumed: int = 0
  objective: str = FORWARD
  decision: str = ""
  tied: list = dataclasses.field(default_factory=list)
  phases: dict = dataclasses.field(default_factory=dict)

  @property
  def baseline(self) -> Candidate | None:
    """The best plain candidate that passed (on its final-round time where it had one), or None."""
    plain = [c for c in self.candidates if c.plain and c.status == measure.OK]
    final = [c for c in plain if c.final_ms is not None]
    if final:
      return min(final, key=lambda c: c.final_ms)
    return min(plain, key=lambda c: c.time_ms, default=None)

  @property
  def speedup_vs_baseline(self) -> float | None:
    """The baseline's time over the winner's, on the times of one round (the final round's where both ran in it,
    else their own); None without a winner or a baseline."""
    best, base = self.best, self.baseline
    if best is None or base is None:
      return None
    if best.final_ms is not None and base.final_ms is not None:
      return base.final_ms / best.final_ms
    return base.time_ms / best.time_ms if best.time_ms else None

  def summary(self) -> str:
    """One line: the winner, its time and speedup over the plain program; or, when nothing passed, how many
    candidates were over the memory budget, invalid for the mesh, failed their numerical check or failed
    otherwise (a compile or run error, a time-out)."""
    if self.best is not None:
      best, speedup, base = self.best, self.speedup_vs_baseline, self.baseline
      versus = "" if speedup is None or base is None or base is best else f", {speedup:.2f}x {base.name}"
      what = " (the plain program)" if best.plain else ""
      timed = sum(1 for c in self.candidates if c.status == measure.OK)
      found = "from the database" if self.from_database else f"{timed} of {len(self.candidates)} candidates timed"
      return f"winner {best.name}{what}: {best.time_ms:.3f} ms{versus} ({found})"
    counts = {}
    for c in self.candidates:
      if c.result is not None and c.status != measure.OK:
        cause = c.result.cause or ("failed to compile or run" if c.status == measure.FAILED else "pruned")
        counts[cause] = counts.get(cause, 0) + 1
    parts = ", ".join(f"{n} {cause}" for cause, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    return f"nothing passed of {len(self.candidates)} candidates: {parts or 'none was offered'}"

  def table(self) -> str:
    """Every candidate, best first: ``plain`` in the origin column marks the programs a user would otherwise run;
    ``final ms`` is the side-by-side time of the final round's finalists, which decided the winner."""
    rows = ["| candidate | origin | predicted ms | measured ms | final ms | memory MiB | status | note |",
            "|---|---|---|---|---|---|---|---|"]
    for c in sorted(self.candidates, key=_rank):
      t = "" if c.time_ms is None else f"{c.time_ms:.3f}"
      final = "" if c.final_ms is None else f"{c.final_ms:.3f}"
      predicted = "" if math.isnan(c.predicted_ms) else f"{c.predicted_ms:.3f}"
      note = c.final.note if c.final else c.result.reason if c.result else ""
      if c is self.best:
        note = f"winner: {note}" if note else "winner"
      rows.append(f"| {c.name} | {c.origin} | {predicted} | {t} | {final} | {c.memory_bytes / 2**20:.2f} | "
                  f"{c.status} | {note} |")
    return "\n".join(rows)


def _rank(c):
  order = {measure.OK: 0, measure.FAILED: 1, measure.PRUNED: 2}
  time = c.time_ms if c.time_ms is not None else c.predicted_ms
  return order[c.status], c.final_ms is None, c.final_ms or 0.0, math.inf if math.isnan(time) else time


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


def default_candidates(program, mesh, *, space: int = 24, seed: int = 0, kernels=None,
                       in_shardings=None, out_sharding=None, training: bool = False) -> list[Candidate]:
  """The library strategies, then a sample of the design space, each with every applicable kernel.

  Each schedule is also offered with every fused kernel that applies to it
  (``analysis.placements.offered``) for the caller's layouts (``in_shardings``,
  ``out_sharding``), unless it would run in interpret mode (outside
  ``registry.interpret_mode()``). A design-space schedule's fused kernel that runs the same kernel on the
  same blocks as an earlier candidate's is left out (the library's strategies keep theirs: their backward
  passes differ). The design space is sampled among schedules that lower to programs no library strategy
  lowers to (``program_key``). On a mesh of one device the local loop nest comes first, as the strategy
  ``"local"``; the library's strategies follow (the tuner merges them into it: each is the local nest
  there), those that tile the nest into serial blocks pruned, and no design space is sampled: a tune times
  one candidate per kernel. Candidates are returned unscored (``predicted_ms`` NaN).

  Args:
    kernels: the local kernels to try (``KernelChoice``s or names); default each that applies, at its
      defaults (``candidates.kernel_choices``).
    training: also offer each fused kernel with every other backward its configuration names
      (``lowering_variants``: a fused ring attention's backward on our kernel as well as on cuDNN's).
  """
  base = [(name, LIBRARY, s, None) for name, s in library(program, mesh).items()]
  if math.prod(mesh.shape.values()) == 1:
    local = Schedule(program, mesh)
    key = program_key(local)
    tiled = measure.Measurement(measure.PRUNED, reason="one device: it tiles the local loop nest into serial "
                                                       "blocks, which a one-device tune does not try")
    base = [("local", LIBRARY, local, None)] + [(n, o, s, None if program_key(s) == key else tiled)
                                                for n, o, s, _ in base]
  else:
    seen = {program_key(s) for _, _, s, _ in base}
    rest = []
    for s in enumerate_schedules(program, mesh, tile_factors=(2, 4)):
      key = program_key(s)
      if key not in seen:
        seen.add(key)
        rest.append(s)
    base += [(describe(s), SPACE, s, None) for s in random.Random(seed).sample(rest, min(space, len(rest)))]
  strategies = sum(1 for _, origin, _, _ in base if origin == LIBRARY)
  kernels = kernel_choices(program, mesh) if kernels is None else [
      k if isinstance(k, registry.KernelChoice) else registry.KernelChoice(k) for k in kernels]
  out, kernels_seen = [], set()
  for n, (name, origin, s, pruned) in enumerate(base):
    if s.dispatched is not None:  # its local kernel is its grouped GEMM, a parameter of the dispatch
      out += [Candidate(name, v, math.nan, 0, result=pruned, origin=origin) for v in grouped_gemm_variants(s)]
      continue
    for k in kernels:
      patched = s.copy() if k.name == "xla" else s.copy().patch(k)
      out.append(Candidate(name, patched, math.nan, 0, result=pruned, origin=origin))
    for lowering in _fused_lowerings(s, in_shardings, out_sharding):
      for params in lowering_variants(lowering, mesh, training):
        try:
          lowered = s.copy().lower_with(lowering, **params)
        except PreconditionError:  # a backward whose blocks do not fit this schedule's
          continue
        key = (placements.signature(lowered), tuple(params.items()))
        if n < strategies or key not in kernels_seen:
          kernels_seen.add(key)
          out.append(Candidate(name, lowered, math.nan, 0, result=pruned, origin=origin))
  return out


def lowering_variants(lowering: str, mesh, training: bool) -> list[dict]:
  """The configurations a fused kernel is offered with: its defaults, and in training each other choice of its
  configuration's ``backward`` field (the forward is the same kernel; only the backward differs) whose kernel is
  trusted on ``mesh``'s devices (``Kernel.unverified``; interpret mode tries it)."""
  if not training:
    return [{}]
  choices = configs.choices(registry.fused(lowering).config).get("backward", ())
  trusted = lambda k: registry.local(k).unverified is None or registry.local(k).interprets(mesh)
  return [{}] + [{"backward": b} for b in choices[1:] if trusted(b)]


def grouped_gemm_variants(schedule) -> list:
  """A dispatched schedule with each grouped GEMM (``analysis.dispatch.gemms()``), its own first, rebuilt through
  the primitives from its trace. A grouped GEMM kernel is offered where the mesh's devices run it and it computes
  at least one of the expert FFN's projections (elsewhere it would be ``ragged_dot`` again)."""
  data = json.loads(schedule.to_json())
  step = next(st for st in data["steps"] if st["primitive"] == "dispatch")
  own = step["kwargs"].get("gemm", "ragged_dot")
  out = [schedule.copy()]
  for gemm in dispatches.gemms():
    if gemm == own or dispatches.gemm_problem(gemm, schedule.mesh) is not None:
      continue
    step["kwargs"]["gemm"] = gemm
    variant = Schedule.from_json(schedule.program, schedule.mesh, json.dumps(data))
    d = dispatches.of(variant)
    if gemm in dispatches.BUILTIN_GEMMS or len(dispatches.gemm_fallback(variant, d)) < len(
        dispatches.projections(variant, d)):
      out.append(variant)
  return out


def _fused_lowerings(schedule, in_shardings, out_sharding) -> list[str]:
  """The fused kernels the tuner offers for ``schedule`` (compiled for the caller's layouts)."""
  names = [n for n in placements.offered(schedule)
           if registry.interpreting() or not placements.interprets(registry.fused(n), schedule)]
  if names and (in_shardings is not None or out_sharding is not None):
    try:
      laid = schedule.with_layouts(in_shardings, out_sharding)
    except ScheduleError:
      return []
    names = [n for n in names if placements.why_not(registry.fused(n), laid) is None]
  return names


def _device_budget(mesh) -> int | None:
  device = agree.local_device(mesh)
  stats = device.memory_stats() if device.platform != "cpu" else None
  return int(0.9 * stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


MAX_ATTEMPTS = 2  # a candidate the tuner died in this often is failed, not retried
PREDICTED_SLOWER = 2.0  # a default candidate predicted this many times the best prediction is not timed


def autotune(program, mesh, *, candidates=None, space: int = 24, top_k: int = 8,
             in_shardings=None, out_sharding=None,
             memory_budget: int | None = None, machine: cost.Machine | None = None, iters: int = 10,
             time_limit_s: float | None = None, key=None, database=None, retune: bool = False,
             isolation: str = "thread", resume: bool = True, training: bool = False, final_budget_s: float = 3.0,
             compile_threads: int | None = None, log=print) -> TuneResult:
  """Finds the fastest correct schedule of ``program`` on ``mesh``.

  The program, mesh and layouts are validated first (``jaxmercury.schedules.validate``);
  a candidate that does not validate is failed with the reason. Each
  candidate's measurement goes to ``database`` as soon as it is taken, so an
  interrupted tune (Ctrl-C, kill) resumes from them: a later call with the
  same key re-times only what is missing. Under several processes
  (``jax.distributed``) process 0 makes every decision (the stored winner,
  the candidates, the inputs' seed, the winner) and broadcasts it; the others
  follow, and a process whose database disagrees is overruled. Timings are
  combined so that the slowest process counts.

  Args:
    program: the program to tune.
    mesh: the device mesh.
    candidates: (name, Schedule) pairs to choose among; default the library
      plus ``space`` design-space schedules, with every applicable kernel.
      The plain programs (``tuner.plain.plain_programs``, for the caller's
      layouts) are added either way.
    space: how many design-space schedules to add to the library's.
    top_k: how many candidates besides the anchors, best predicted first, to
      compile and time. Anchors, always timed when they fit the memory
      budget: each library strategy with its best-predicted kernel (one per
      strategy), each fused lowering of a library strategy, and (default
      candidates) the winner ``database`` holds for the nearest other sizes
      (``Database.nearest``). A strategy's other kernels compete with the design-space
      schedules for these ``top_k`` places; the rest are pruned with the
      reason.
    in_shardings: the layouts (``PartitionSpec`` per input) the caller's
      arrays have; every candidate is lowered for them, so that moving the
      inputs into its own layout counts in its time.
    out_sharding: the layout the caller needs the output in.
    memory_budget: bytes per device; candidates estimated above it are pruned.
      Default: 90% of a GPU's memory, no limit on CPU.
    machine: cost-model figures; default read from ``database`` or measured by
      ``calibrate`` (and stored).
    iters: timed runs per candidate (the median counts), and interleaved
      rounds between two comparisons in the final round (``tuner.decide``).
    time_limit_s: seconds a candidate's compile and first run may take; past
      it the candidate is failed ("time-out") and the search goes on.
    key: PRNG key for the random inputs; fresh inputs by default.
    database: a ``Database``: a stored winner is returned without tuning
      (unless ``retune``), measurements are stored as they are taken, and a
      new winner is stored.
    retune: tune even when the database holds a winner, and re-time every
      candidate (stored measurements of this key are discarded).
    isolation: ``"thread"`` measures in this process, abandoning a candidate
      at the time limit; ``"process"`` measures each candidate in a worker
      process that is killed at the limit (a hang cannot outlive it; programs
      from ``jaxmercury.programs`` on one process only, others fall back to
      ``"thread"``).
    resume: reuse this key's stored measurements instead of re-timing them.
    training: find the fastest training step instead: candidates are ranked
      by their predicted forward and backward (``cost.backward_seconds``),
      checked on their output and every input's gradient for a random
      output cotangent, and timed as one forward-and-backward call
      (``measure.training_step``); the database keeps these records apart
      from the forward's (``database.TRAINING``).
    final_budget_s: seconds after which the final round starts no new
      rounds; its finalists not resolved by then are reported tied.
    compile_threads: candidates compiled at once, all before the first is
      run (``tuner.ahead``); default one per CPU core, 8 at most; 1 compiles
      each just before it is checked. One at a time in any case under
      several processes, with ``isolation='process'``, and after the tuner
      died while measuring (so that a rerun finds the candidate to blame).
    log: progress printer.

  Returns:
    A ``TuneResult``; ``best`` is None when no candidate passed, a plain
    program (``best.plain``) when no schedule beats it beyond the noise;
    ``baseline`` is the best plain program, ``decision`` says how the winner
    was chosen.

  Raises:
    ScheduleError: the program, mesh or layouts are invalid.
  """
  validate(program, mesh, in_shardings=in_shardings, out_sharding=out_sharding, compiling=True)
  if isolation not in ("thread", "process"):
    raise ValueError(f"isolation must be 'thread' or 'process', got {isolation!r}")
  layouts = None if in_shardings is None and out_sharding is None else (in_shardings, out_sharding)
  many = agree.process_count() > 1
  if isolation == "process" and many:
    log("isolation='process' measures on one process only; measuring in-process under jax.distributed")
    isolation = "thread"

  objective = TRAINING if training else FORWARD
  started = time.perf_counter()
  log(f"== {program}{' (training step)' if training else ''} on mesh {dict(mesh.shape)}")
  try:
    threads = ahead.default_threads() if compile_threads is None else compile_threads
    with jax.set_mesh(None):  # a caller's mesh (jax.set_mesh) would refuse the tuner's calls on single devices
      result = _search(program, mesh, candidates, space, top_k, in_shardings, out_sharding, memory_budget, machine,
                       iters, time_limit_s, key, database, retune, isolation, resume, training, final_budget_s,
                       log, layouts, many, objective, threads)
  except KeyboardInterrupt:
    kept = 0 if database is None else len([m for m in database.measurements(program, mesh, layouts,
                                                                            objective=objective).values()
                                           if m.result is not None])
    raise TuneInterrupted(kept) from None
  spent = ", ".join(f"{phase} {s:.1f}" for phase, s in result.phases.items() if s >= 0.05)
  log(f"== done in {time.perf_counter() - started:.1f} s{f' ({spent})' if spent else ''}: {result.summary()}")
  return result


class TuneInterrupted(KeyboardInterrupt):
  """Ctrl-C during a tune. Every measurement taken so far is stored (``kept`` of this operator's), so that
  tuning again resumes from them."""

  def __init__(self, kept: int):
    super().__init__(f"interrupted; {kept} measurements kept, rerun to resume")
    self.kept = kept


def _search(program, mesh, candidates, space, top_k, in_shardings, out_sharding, memory_budget, machine, iters,
            time_limit_s, key, database, retune, isolation, resume, training, final_budget_s, log, layouts, many,
            objective, threads) -> TuneResult:
  """``autotune``'s search, once its arguments are checked (see there)."""
  found = _from_database(program, mesh, layouts, objective, database, retune, log)
  if found is not None:
    return found
  clock = _Phases()
  with clock("calibration"):
    machine = _machine(program, mesh, machine, database, log)
  store = _Store(database, program, mesh, layouts, log, objective)
  if agree.is_leader():
    with clock("plan"):
      cands, timed, resumed = _plan(program, mesh, candidates, space, top_k, in_shardings, out_sharding,
                                    memory_budget, machine, store, retune, resume, training, log)
    seed = _seed(key)
  if many:
    plan = agree.broadcast_json(_plan_data(cands, timed, seed) if agree.is_leader() else None)
    if not agree.is_leader():
      cands, timed, seed = _plan_from_data(program, mesh, plan)
      resumed = sum(1 for n in timed if cands[n].result is not None)

  inputs = None
  kept = _Kept()  # the compiled programs of the candidates that may reach the final round
  todo = [cands[i] for i in timed if cands[i].result is None]
  compiled = {}
  if threads > 1 and len(todo) > 1 and not many and isolation == "thread" and not store.died_measuring():
    for c in todo:
      store.started(c)
    log(f"  compiling {len(todo)} candidates, {min(threads, len(todo))} at a time ...")
    with clock("compile ahead"):
      futures = ahead.compile_all([c.schedule for c in todo], training=training, threads=threads,
                                  time_limit_s=time_limit_s)
    compiled = {id(c): f for c, f in zip(todo, futures)}
  for n, index in enumerate(timed):
    c = cands[index]
    if c.result is None:
      if id(c) not in compiled:
        store.started(c)
      if isolation == "process":
        c.result = watchdog.measure_in_worker(c.schedule, seed, iters=iters, time_limit_s=time_limit_s,
                                              training=training)
        if c.result is None:
          log(f"  {c.name}: no worker can rebuild {program.name}; measuring in-process")
      if c.result is None:
        if inputs is None:
          with clock("reference"):
            inputs, cotangent, reference = trial(program, seed, agree.local_device(mesh), training=training)
        t0 = time.perf_counter()
        c.result = measure.measure(c.schedule, inputs, reference, iters=iters, time_limit_s=time_limit_s,
                                   gather=agree.gather if many else None, cotangent=cotangent,
                                   keep=None if many else kept.keeper(c), compiled=compiled.pop(id(c), None))
        compiling = c.result.compile_s or 0.0
        clock.add("compile and check", compiling)
        clock.add("timing", time.perf_counter() - t0 - compiling)
      store.measured(c)
      note = "" if c.result.compile_s is None else f"  (compile and check {c.result.compile_s:.1f} s)"
    else:
      note = "  (resumed)"
    shown = f"{c.time_ms:9.3f} ms" if c.time_ms is not None else c.result.reason
    predicted = "        -" if math.isnan(c.predicted_ms) else f"{c.predicted_ms:9.3f}"
    log(f"  [{n + 1}/{len(timed)}] {c.name:<40} predicted {predicted} ms  {c.status:<6} {shown}{note}")
    if "resumed" not in note and isolation == "thread" and c.result.reason.startswith("time-out"):
      log("  warning: an abandoned candidate may still occupy the devices and delay the next ones; "
          "isolation='process' kills it instead")
    kept.trim([c for c in cands if c.status == measure.OK])

  ok = [c for c in cands if c.status == measure.OK]
  best, decision, tied = None, "", []
  if ok and not many:
    if inputs is None:
      inputs = program.random_inputs(jax.random.key(seed))
    step_key = jax.random.fold_in(jax.random.key(seed), 1) if training else None
    with clock("final round"):
      best, decision, tied = _final_round(ok, kept, inputs, iters, final_budget_s, log, step_key)
  elif ok:
    best, decision = _own_times_winner(ok)
  if many:
    final = agree.broadcast_json(
        {"results": [None if c.result is None else c.result.to_dict() for c in cands], "decision": decision,
         "best": None if best is None else cands.index(best)} if agree.is_leader() else None)
    for c, r in zip(cands, final["results"]):
      c.result = None if r is None else measure.Measurement.from_dict(r)
    best, decision = None if final["best"] is None else cands[final["best"]], final["decision"]
  if decision:
    log(f"decision: {decision}")
  if best is not None and best.final is None:  # decided without a final round: the verdict alone, for the record
    best.final = Final(None, (), decision)
  if best is not None:
    store.winner(best, cands)
  return TuneResult(best, cands, machine=machine, resumed=resumed, objective=objective, decision=decision,
                    tied=tied, phases=clock.seconds())


class _Phases:
  """Seconds spent per phase of a tune (``TuneResult.phases``), in the order the phases began."""

  def __init__(self):
    self._seconds = {}

  def add(self, phase: str, seconds: float):
    self._seconds[phase] = self._seconds.get(phase, 0.0) + seconds

  @contextlib.contextmanager
  def __call__(self, phase: str):
    t0 = time.perf_counter()
    try:
      yield
    finally:
      self.add(phase, time.perf_counter() - t0)

  def seconds(self) -> dict[str, float]:
    return dict(self._seconds)


class _Kept:
  """Compiled calls (``measure.measure(keep=...)``) of the candidates that may reach the final round: the final
  round then compiles none of them again. Only those that are finalists so far are kept (``trim``), so that the
  devices hold the inputs of a few candidates at most."""

  def __init__(self):
    self.calls = {}

  def keeper(self, c):
    return lambda call: self.calls.__setitem__(id(c), call)

  def get(self, c):
    return self.calls.get(id(c))

  def trim(self, ok):
    wanted = {id(c) for c in decide.finalists(ok)}
    self.calls = {k: v for k, v in self.calls.items() if k in wanted}


def _final_round(ok, kept: _Kept, inputs, iters: int, budget_s: float, log, cotangent_key=None):
  """The winner of the final round among ``decide.finalists(ok)`` (``cotangent_key``: their training steps).

  Each finalist's round goes to its ``final`` (its own measurement, as stored, is left as it was).

  Returns:
    ``(winner, decision text, candidates tied with it)``. With one finalist, or when no finalist runs in the
    round, the winner is chosen on the candidates' own times (``_own_times_winner``).
  """
  finalists = decide.finalists(ok)
  if len(finalists) < 2:
    return (*_own_times_winner(ok), [])
  names = _distinct_names(finalists)
  calls = {}
  for name, c in zip(names, finalists):
    call = kept.get(c)
    if call is None:
      try:
        call = measure.ready_call(c.schedule, inputs, cotangent_key=cotangent_key)
      except Exception as e:
        log(f"  final round: {c.name} does not run again ({type(e).__name__}: {str(e)[:200]}); left out")
        continue
    calls[name] = call
  by_name = dict(zip(names, finalists))
  order = sorted(calls, key=lambda n: (by_name[n].predicted_ms if not math.isnan(by_name[n].predicted_ms)
                                       else math.inf, n))
  # rounds per batch: ``iters``, fewer (4 at least) where two batches of the finalists' own times exceed the budget
  round_s = sum(by_name[n].time_ms for n in calls) * 1e-3
  batch = max(4, min(iters, int(budget_s / (decide.FIRST_LOOK * round_s)) if round_s > 0 else iters))
  verdict = decide.final_round(calls, plain=[n for n in calls if by_name[n].plain], order=order, batch=batch,
                               max_rounds=3 * batch, budget_s=budget_s) if len(calls) > 1 else None
  if verdict is None:
    return (*_own_times_winner(ok), [])
  for name in calls:
    c = by_name[name]
    if name in verdict.failed:
      note = f"failed in the final round ({verdict.failed[name]})"
    elif name == verdict.winner:
      note = verdict.summary()
    else:
      note = f"{verdict.versus_leader[name]} the leader's time in the final round"
      note += "; tied within noise with the winner" if name in verdict.tied else ""
    c.final = Final(verdict.median_ms(name), tuple(verdict.times_ms.get(name, [])), note)
  log("  final round (interleaved): " + ", ".join(
      f"{n} {verdict.median_ms(n):.3f} ms" for n in calls if n not in verdict.failed))
  return by_name[verdict.winner], verdict.summary(), [by_name[n] for n in verdict.tied]


def _own_times_winner(ok) -> tuple:
  """``(winner, decision text)`` on the candidates' own times, where no final round ran (one finalist, or several
  processes): the fastest, unless it is a schedule less than ``decide.PLAIN_MARGIN`` faster than the best plain
  program, which then wins."""
  best = min(ok, key=lambda c: c.time_ms)
  plain = min((c for c in ok if c.plain), key=lambda c: c.time_ms, default=None)
  if plain is not None and best is not plain and best.time_ms * (1 + decide.PLAIN_MARGIN) > plain.time_ms:
    return plain, (f"{plain.name} wins on the candidates' own times: {best.name} is not "
                   f"{decide.PLAIN_MARGIN:.0%} faster")
  alone = len(decide.finalists(ok)) < 2
  why = "no other came close enough for a final round" if alone else "no final round under several processes"
  if best.plain and alone:
    why = "no schedule came close enough to it for a final round"
  return best, f"{best.name} wins on the candidates' own times: {why}"


def _distinct_names(cands) -> list[str]:
  """The candidates' names, a number added where two share one."""
  out, seen = [], {}
  for c in cands:
    seen[c.name] = seen.get(c.name, 0) + 1
    out.append(c.name if seen[c.name] == 1 else f"{c.name} #{seen[c.name]}")
  return out


def _from_database(program, mesh, layouts, objective, database, retune: bool, log) -> TuneResult | None:
  """Process 0's stored winner (broadcast to every process), or None to tune."""
  many = agree.process_count() > 1
  if not many and (database is None or retune):
    return None
  mine = (database.record_data(program, mesh, layouts, objective=objective)
          if database is not None and not retune else None)
  record = None
  if agree.is_leader() and mine is not None:
    try:
      record = record_from_data(program, mesh, mine)
    except ScheduleError as e:
      log(f"{database.path}: the stored record is not trusted ({e}); tuning afresh")
      mine = None
  if agree.is_leader() and mine is None and database is not None and not retune:
    for old in database.stale_records(program, mesh, layouts, objective=objective):
      fmt = "" if old.get("format") == RECORD_FORMAT else f" (record format {old.get('format', 1)})"
      log(f"{database.path} holds a record from jax {old['jax']} / jaxmercury {old['jaxmercury']}{fmt}; "
          "not used by this version")
  agreed = agree.broadcast_json(mine if agree.is_leader() else None) if many else mine
  if agreed is None:
    if mine is not None:
      log(f"process {jax.process_index()}: {database.path} holds {mine['name']!r}, but process 0 "
          "decides and has none: tuning")
    return None
  if not agree.is_leader():
    if mine is None or mine["trace"] != agreed["trace"]:
      held = "no winner" if mine is None else repr(mine["name"])
      log(f"process {jax.process_index()}: database {getattr(database, 'path', None)} holds {held}; "
          f"overruled by process 0's {agreed['name']!r}")
  if record is None:  # another process: process 0's record, replayed here
    record = record_from_data(program, mesh, agreed)
  if not agree.is_leader() and database is not None and (mine is None or mine["trace"] != agreed["trace"]):
    _Store(database, program, mesh, layouts, log, objective).winner(record.winner, record.candidates)
  where = f"in {database.path}" if agree.is_leader() else f"by process {jax.process_index()} from process 0"
  log(f"found {where}: {record.winner.name} ({record.winner.time_ms:.3f} ms)")
  return TuneResult(record.winner, record.candidates, from_database=True, objective=objective,
                    decision=record.winner.final.note if record.winner.final else "")


def _machine(program, mesh, machine, database, log) -> cost.Machine:
  """Cost-model figures: given, stored, or calibrated; process 0's under several processes."""
  if machine is None and database is not None:
    machine = database.machine(program, mesh)
  if agree.process_count() > 1:
    figures = agree.broadcast_json(machine.to_dict() if agree.is_leader() and machine else None)
    machine = None if figures is None else cost.Machine.from_dict(figures)
  if machine is None:
    log("calibrating the cost model on this machine (once per machine, operator and dtype) ...")
    machine = calibrate(program, mesh, progress=calibration_progress(log))
    if agree.process_count() > 1:
      machine = cost.Machine.from_dict(agree.broadcast_json(machine.to_dict() if agree.is_leader() else None))
    if database is not None:
      _Store(database, program, mesh, None, log, FORWARD).machine(machine)
  return machine


def _scored(c: Candidate, program, mesh, machine, in_shardings, out_sharding, training=False) -> Candidate:
  """``c`` for the caller's layouts, scored (``training``: its forward and backward predicted), or failed with the
  reason it does not validate."""
  schedule = c.schedule
  try:
    if in_shardings is not None or out_sharding is not None:
      schedule = schedule.with_layouts(in_shardings, out_sharding)
    # a caller's schedule is checked against its trace too; the tuner's own are built by primitives alone
    validate(program, mesh, schedule=schedule, compiling=True, trace=c.origin == GIVEN)
    seconds = cost.predict(schedule, machine) + (cost.backward_seconds(schedule, machine) if training else 0.0)
    return dataclasses.replace(c, schedule=schedule, predicted_ms=seconds * 1e3,
                               memory_bytes=memory_per_device(schedule))
  except ScheduleError as e:
    return dataclasses.replace(c, schedule=schedule, predicted_ms=math.inf, memory_bytes=0,
                               result=measure.Measurement(measure.FAILED, reason=f"invalid: {e}",
                                                          cause=measure.INVALID))


def _anchors(fits, library_names) -> dict:
  """(strategy, fused kernel) -> the best-predicted candidate, for each library strategy among ``fits``.

  A fused kernel of a library strategy is an anchor of its own, so it is timed beside the strategy's
  ``shard_map`` lowering. A caller's candidate named as a library strategy counts as that strategy.

  Args:
    fits: candidates within the memory budget, best predicted first.
    library_names: the library's strategy names for the program and mesh.
  """
  out = {}
  for c in fits:
    key = (c.strategy, c.lowering)
    if (c.origin == LIBRARY or (c.origin == GIVEN and c.strategy in library_names)) and key not in out:
      out[key] = c
  return out


def _given(candidates) -> list[Candidate]:
  """A caller's candidates: ``Candidate``s, or ``(name, Schedule)`` pairs."""
  return [c if isinstance(c, Candidate) else Candidate(c[0], c[1], math.nan, 0, origin=GIVEN) for c in candidates]


def _plan(program, mesh, candidates, space, top_k, in_shardings, out_sharding, memory_budget, machine, store,
          retune, resume, training, log):
  """(candidates, indices to time: the plain programs, then the rest best predicted first, how many of those are
  resumed); process 0 only."""
  memory_budget = memory_budget if memory_budget is not None else _device_budget(mesh)
  proposed = _given(candidates) if candidates is not None else default_candidates(
      program, mesh, space=space, in_shardings=in_shardings, out_sharding=out_sharding, training=training)
  score = lambda c: _scored(c, program, mesh, machine, in_shardings, out_sharding, training)
  plain = [Candidate(p.name, p, math.nan, p.memory_bytes(), origin=PLAIN)
           for p in plain_programs(program, mesh, in_shardings, out_sharding)]
  for c in plain:
    if memory_budget is not None and c.memory_bytes > memory_budget:
      c.result = measure.Measurement(measure.PRUNED, reason=f"its inputs and output alone take {c.memory_bytes} B, "
                                                            "over the budget", cause=measure.OVER_BUDGET)
  cands = plain + [score(c) for c in proposed]
  plain = [c for c in plain if c.result is None]
  fits, programs = [], {}  # programs: program_key -> the candidate timed for it
  for c in cands[len(plain):]:
    if c.result is not None:
      continue
    if memory_budget is not None and c.memory_bytes > memory_budget:
      c.result = measure.Measurement(measure.PRUNED, reason=f"estimated {c.memory_bytes} B over the budget",
                                     cause=measure.OVER_BUDGET)
      continue
    key = program_key(c.schedule)
    if key in programs:
      c.result = measure.Measurement(measure.PRUNED, reason=f"same program as {programs[key].name}")
      continue
    programs[key] = c
    fits.append(c)
  fits.sort(key=lambda c: c.predicted_ms)
  anchors = _anchors(fits, set(library(program, mesh)))
  if candidates is None:  # anchors too on one device, where every candidate is local compute the model knows
    fits = _prune_predicted_slow(fits, keep=() if mesh.size == 1 else anchors.values())
    anchors = {k: c for k, c in anchors.items() if c.result is None}
  anchor_ids = {id(c) for c in anchors.values()}
  ranked = [c for c in fits if id(c) not in anchor_ids]
  for c in ranked[top_k:]:
    anchor = anchors.get((c.strategy, c.lowering))
    also = f"; {c.strategy} is timed as {anchor.name}" if anchor is not None else ""
    c.result = measure.Measurement(measure.PRUNED, reason=f"cost model ranks it below the top {top_k}{also}")
  fits = sorted([*anchors.values(), *ranked[:top_k]], key=lambda c: c.predicted_ms)
  near = store.nearest() if candidates is None else None
  if near is not None:
    _time_nearest(near, cands, fits, ranked[top_k:], memory_budget, score, programs, log)
  fits = plain + fits
  if retune:
    store.clear()
  stored = store.measurements() if resume and not retune else {}
  resumed = 0
  for c in fits:
    row = stored.get(c.schedule.to_json())
    if row is None:
      continue
    if row.result is not None:
      c.result, resumed = row.result, resumed + 1
    elif row.attempts >= MAX_ATTEMPTS:
      c.result = measure.Measurement(measure.FAILED, reason=f"the tuner died {row.attempts} times while "
                                                            "measuring it (crash, kill or out of memory)")
      resumed += 1
  if resumed:
    log(f"resuming: {resumed} of {len(fits)} measurements read from {store.path}")
  return cands, [cands.index(c) for c in fits], resumed


def _prune_predicted_slow(fits: list, keep=()) -> list:
  """``fits`` (best predicted first) less the candidates predicted over ``PREDICTED_SLOWER`` times the best
  prediction, pruned with the reason: the cost model's errors, once calibrated, are well under that factor, and
  compiling them is most of a tune's time. Those in ``keep`` stay."""
  if not fits or not fits[0].predicted_ms > 0:
    return fits
  best, kept = fits[0], {id(c) for c in keep}
  for c in fits[1:]:
    ratio = c.predicted_ms / best.predicted_ms
    if ratio > PREDICTED_SLOWER and id(c) not in kept:
      c.result = measure.Measurement(measure.PRUNED, reason=f"predicted {c.predicted_ms:.3g} ms, {ratio:.1f}x the "
                                                            f"best prediction ({best.name})")
  return [c for c in fits if c.result is None]


def _time_nearest(near, cands, fits: list, ranked_out, memory_budget, score, programs, log):
  """Adds to ``fits`` (the candidates to time) the winner tuned for the nearest other sizes (``near``, a
  ``Database.nearest``), so that a tune never does worse than the schedule a miss would have run; a new
  candidate when no candidate has its trace. Of the candidates already pruned, only those the cost model
  ranked out (``ranked_out``) are taken back; those over ``memory_budget`` stay pruned, and one that lowers to
  the program of a candidate already timed (``programs``) is pruned as such. A plain winner is the plain
  program a tune always times."""
  if isinstance(near.schedule, PlainProgram):
    return
  trace = near.schedule.to_json()
  c = next((c for c in cands if c.schedule.to_json() == trace), None)
  if c is None:
    mine = near.schedule.program.params
    sizes = {k: v for k, v in near.params.items() if is_size(v) and v != mine.get(k)}
    c = score(Candidate(near.strategy, near.schedule, math.nan, 0, origin=NEAREST, tuned_at=sizes))
    cands.append(c)
  if any(f is c for f in fits) or (c.result is not None and not any(r is c for r in ranked_out)):
    return
  if memory_budget is not None and c.memory_bytes > memory_budget:
    return
  same = programs.get(program_key(c.schedule))
  if same is not None and same is not c:
    c.result = measure.Measurement(measure.PRUNED, reason=f"same program as {same.name}")
    return
  c.result = None
  fits.append(c)
  fits.sort(key=lambda c: c.predicted_ms)
  log(f"also timing {c.name}: the winner tuned for the nearest other sizes ({near.name})")


def _seed(key) -> int:
  if key is None:
    return random.SystemRandom().randrange(1 << 31)
  return int(jax.random.randint(key, (), 0, (1 << 31) - 1))


def _plan_data(cands, timed, seed) -> dict:
  return {"seed": seed, "timed": timed, "candidates": [
      {**c.to_dict(), "result": None if c.result is None else c.result.to_dict()} for c in cands]}


def _plan_from_data(program, mesh, data):
  """Process 0's plan on another process: candidates rebuilt from their structured records."""
  cands = []
  for d in data["candidates"]:
    result = None if d["result"] is None else measure.Measurement.from_dict(d["result"])
    try:
      c = Candidate.from_dict(program, mesh, d)
    except (ScheduleError, ValueError):  # a candidate process 0 found invalid: never timed, kept for the record
      c = Candidate(d["strategy"], Schedule(program, mesh), d["predicted_ms"], d["memory_bytes"],
                    origin=d["origin"], recorded_trace=d["schedule"])
    c.result = result
    cands.append(c)
  return cands, list(data["timed"]), int(data["seed"])


class _Store:
  """Database writes that never stop a tune: a failed write is logged and the search goes on. Records and
  measurements go under the tune's layouts and objective."""

  def __init__(self, database, program, mesh, layouts, log, objective):
    self.db, self.program, self.mesh, self.layouts, self.log = database, program, mesh, layouts, log
    self.objective = objective
    self.path = getattr(database, "path", None)

  def _do(self, what, method: str, *args, keyed: bool = True):
    if self.db is None:
      return None
    try:
      extra = {"objective": self.objective} if keyed else {}
      return getattr(self.db, method)(self.program, self.mesh, *args, **extra)
    except sqlite3.Error as e:
      self.log(f"warning: could not {what} in {self.path}: {e}")
      return None

  def started(self, c):
    self._do("mark a measurement started", "start_measurement", c, self.layouts)

  def measured(self, c):
    self._do("store a measurement", "store_measurement", c, self.layouts)

  def winner(self, best, cands):
    self._do("store the winner", "store", best, cands, self.layouts)

  def machine(self, machine):
    self._do("store machine figures", "store_machine", machine, keyed=False)

  def clear(self):
    self._do("clear measurements", "clear_measurements", self.layouts)

  def died_measuring(self) -> bool:
    """Whether a stored candidate of this key was started and never measured (the tuner died measuring it)."""
    return any(row.result is None and row.attempts for row in self.measurements().values())

  def measurements(self) -> dict:
    return self._do("read measurements", "measurements", self.layouts) or {}

  def nearest(self):
    return self._do("read the nearest sizes' winner", "nearest", self.layouts)


def predict_candidates(program, mesh, machine: cost.Machine, *, space: int = 24, in_shardings=None,
                       out_sharding=None) -> list[Candidate]:
  """Predicted time and memory of each candidate on ``mesh``, which may be an AbstractMesh.

  Nothing is compiled: this plans for meshes larger than the machine, with
  ``machine`` giving (for example, through ``Machine.with_links``) the links
  those meshes would have. Kernels are those ``machine`` has rates for; the
  caller's layouts, when given, are fixed as in ``autotune``.
  """
  kernels = sorted(machine.kernel_flops_per_s) or ["xla"]
  cands = default_candidates(program, mesh, space=space, kernels=kernels, in_shardings=in_shardings,
                             out_sharding=out_sharding)
  out = []
  for c in cands:
    s = c.schedule
    if in_shardings is not None or out_sharding is not None:
      s = s.with_layouts(in_shardings, out_sharding)
    out.append(dataclasses.replace(c, schedule=s, predicted_ms=cost.predict(s, machine) * 1e3,
                                   memory_bytes=memory_per_device(s)))
  return sorted(out, key=lambda c: c.predicted_ms)
