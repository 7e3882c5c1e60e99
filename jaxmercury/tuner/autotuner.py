"""``autotune``: pick the fastest correct schedule of a program on a mesh.

A tune is a pipeline of stages, each a function of the frozen ``TuneConfig``,
the ``Task`` (program, mesh, the caller's layouts) and the candidates, which
are data (``tuner.candidates``):

1. calibration (``stored.machine``): the cost model's figures, from the
   database, or measured once per machine (the mesh's links) and once per
   operator and dtype (its kernels), and stored;
2. propose (``tuner.propose``): the library's strategies and a sample of the
   design space, each with every kernel and fused lowering that applies, and
   the plain programs (what the user would otherwise run, XLA partitioning
   the operator written in JAX, in the caller's layouts);
3. score (``tuner.prune.score``): each laid out for the caller's layouts,
   validated, its time and memory predicted;
4. prune (``tuner.prune.prune``): what is worth compiling: the plain
   programs, the winner tuned for the nearest other sizes, and the
   candidates predicted within ``margin`` of the best prediction (corrected
   per kernel by what the database has measured, ``tuner.accuracy``), the
   ``top_k`` best at most; every other candidate carries the reason;
5. compile, check, time (``tuner.measuring``): all compiled at once on
   threads, each checked against the reference and timed, each measurement
   stored as soon as it is taken (an interrupted tune resumes from them). A
   training tune measures the forwards first and compiles the training steps
   of its finalists only;
6. decide (``tuner.decide``): the best plain program and the candidates
   closest to the best time run side by side in interleaved rounds; the plain
   program wins unless a schedule beats it beyond the noise;
7. store: the winner and every candidate's outcome go to the tuning database.

While it runs, JAX's persistent compilation cache is on for what the tune
compiles (``tuner.compile_cache``): a second tune, another process or the
next run reads its executables instead of compiling them.

Reliability: the program, mesh, layouts and every candidate are validated
before anything is traced (an invalid candidate fails with the reason);
each candidate runs under a hard time limit (``watchdog``) and any failure
(compile error, out of memory, time-out, NaN, wrong values) fails only that
candidate. Under ``jax.distributed`` (one process per GPU) the tune makes the
decisions of one process: process 0 plans and broadcasts (``agree``), every
process compiles its programs at once, the checks, timed runs and final
round go in lockstep, and times are combined so that the slowest process
counts.
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax

from jaxmercury.analysis.memory import memory_per_device
from jaxmercury.errors import ScheduleError
from jaxmercury.schedules.schedule import Schedule
from jaxmercury.schedules.validate import validate
from jaxmercury.tuner import agree, compile_cache, cost, decide, measure, prune, stored
from jaxmercury.tuner.accuracy import Corrections, spearman
from jaxmercury.tuner.candidates import Candidate, Final
from jaxmercury.tuner.config import Task, TuneConfig
from jaxmercury.tuner.database import FORWARD
from jaxmercury.tuner.measuring import Kept, Phases, Trial, fresh_seed, measure_stage, resumed, training_finalists
from jaxmercury.tuner.propose import (  # noqa: F401  (re-exported: the candidates' builders)
  default_candidates,
  describe,
  grouped_gemm_variants,
  lowering_variants,
  not_offered,
  propose,
)
from jaxmercury.tuner.result import TuneResult

_DEFAULTS = TuneConfig()


def autotune(program, mesh, *, candidates=None, config: TuneConfig | None = None, in_shardings=None,
             out_sharding=None, machine: cost.Machine | None = None, key=None, database=None, log=print,
             space: int = _DEFAULTS.space, top_k: int = _DEFAULTS.top_k, margin: float = _DEFAULTS.margin,
             memory_budget: int | None = None, iters: int = _DEFAULTS.iters, time_limit_s: float | None = None,
             retune: bool = False, isolation: str = _DEFAULTS.isolation, resume: bool = True,
             training: bool = False, training_finalists: int = _DEFAULTS.training_finalists,
             final_budget_s: float = _DEFAULTS.final_budget_s, compile_threads: int | None = None,
             compile_cache: bool | str = True) -> TuneResult:
  """Finds the fastest correct schedule of ``program`` on ``mesh``.

  The program, mesh and layouts are validated first (``jaxmercury.schedules.validate``); a candidate that does
  not validate is failed with the reason. How the search goes is a ``TuneConfig``: pass one as ``config``, or
  its fields as keyword arguments (``space`` to ``compile_cache``, documented there), not both. Under several
  processes (``jax.distributed``) process 0 makes every decision (the stored winner, the candidates, the inputs'
  seed) and broadcasts it, the others follow (a process whose database disagrees is overruled), and the processes
  measure in lockstep, the slowest counting.

  Args:
    program: the program to tune.
    mesh: the device mesh.
    candidates: (name, Schedule) pairs (or ``Candidate``s) to choose among; default the library plus
      ``space`` design-space schedules, with every applicable kernel. The plain programs
      (``tuner.plain.plain_programs``, for the caller's layouts) are added either way.
    config: how to search (``TuneConfig``); default built from the keyword arguments below.
    in_shardings: the layouts (``PartitionSpec`` per input) the caller's arrays have; every candidate is lowered
      for them, so that moving the inputs into its own layout counts in its time.
    out_sharding: the layout the caller needs the output in.
    machine: cost-model figures; default read from ``database`` or measured by ``calibrate`` (and stored).
    key: PRNG key for the random inputs; fresh inputs by default (``TuneConfig.seed`` wins where set).
    database: a ``Database``: a stored winner is returned without tuning (unless ``retune``), measurements are
      stored as they are taken, and a new winner is stored.
    log: progress printer.
    space, top_k, margin, memory_budget, iters, time_limit_s, retune, isolation, resume, training,
      training_finalists, final_budget_s, compile_threads, compile_cache: ``TuneConfig``'s fields.

  Returns:
    A ``TuneResult``; ``best`` is None when no candidate passed, a plain program (``best.plain``) when no
    schedule beats it beyond the noise; ``baseline`` is the best plain program, ``decision`` says how the winner
    was chosen, ``phases`` where the time went.

  Raises:
    ScheduleError: the program, mesh or layouts are invalid.
    ValueError: an option is out of range, or both ``config`` and options were given.
  """
  options = {"space": space, "top_k": top_k, "margin": margin, "memory_budget": memory_budget, "iters": iters,
             "time_limit_s": time_limit_s, "retune": retune, "isolation": isolation, "resume": resume,
             "training": training, "training_finalists": training_finalists, "final_budget_s": final_budget_s,
             "compile_threads": compile_threads, "compile_cache": compile_cache}
  if config is None:
    config = TuneConfig(**options)
  else:
    changed = sorted(k for k, v in options.items() if v != getattr(_DEFAULTS, k))
    if changed:
      raise ValueError(f"autotune: pass either config= or the options {changed}, not both")
  validate(program, mesh, in_shardings=in_shardings, out_sharding=out_sharding, compiling=True)
  task = Task(program, mesh, in_shardings, out_sharding)
  if config.isolation == "process" and agree.process_count() > 1:
    log("isolation='process' measures on one process only; measuring in-process under jax.distributed")
    config = dataclasses.replace(config, isolation="thread")
  if config.seed is None:
    seed = fresh_seed(key)
    if agree.process_count() > 1:  # the same inputs on every process
      seed = agree.broadcast_json(seed if agree.is_leader() else None)
    config = dataclasses.replace(config, seed=seed)
  started = time.perf_counter()
  log(f"== {program}{' (training step)' if config.training else ''} on mesh {dict(mesh.shape)}")
  try:
    with jax.set_mesh(None):  # a caller's mesh (jax.set_mesh) would refuse the tuner's calls on single devices
      result = tune(task, config, candidates, machine=machine, database=database, log=log)
  except KeyboardInterrupt:
    kept = 0 if database is None else len([m for m in database.measurements(
        program, mesh, task.layouts, objective=config.objective).values() if m.result is not None])
    raise TuneInterrupted(kept) from None
  spent = ", ".join(f"{phase} {s:.1f}" for phase, s in result.phases.items() if s >= 0.05)
  spent = f" ({spent}; {result.counts()})" if not result.from_database else ""
  log(f"== done in {time.perf_counter() - started:.1f} s{spent}: {result.summary()}")
  return result


class TuneInterrupted(KeyboardInterrupt):
  """Ctrl-C during a tune. Every measurement taken so far is stored (``kept`` of this operator's), so that
  tuning again resumes from them."""

  def __init__(self, kept: int):
    super().__init__(f"interrupted; {kept} measurements kept, rerun to resume")
    self.kept = kept


def tune(task: Task, config: TuneConfig, given=None, *, machine=None, database=None, log=print) -> TuneResult:
  """The tune's stages (module docstring), once its arguments are checked (``autotune``): ``given`` are the
  caller's candidates or None; ``config.seed`` is set."""
  found = stored.from_database(task, config.objective, database, config.retune, log)
  if found is not None:
    return found
  clock = Phases()
  cache = compile_cache.folder(config.compile_cache, getattr(database, "path", None))
  with compile_cache.for_tune(cache):
    with clock("calibration"):
      machine = stored.machine(task, machine, database, log, training=config.training)
    store = stored.Store(database, task, log, config.objective)
    plan = _plan(task, config, given, machine, store, clock, log) if agree.is_leader() else None
    if agree.process_count() > 1:
      plan = _Plan.from_data(task, agree.broadcast_json(plan.to_data() if agree.is_leader() else None))
    if plan.resumed:
      log(f"resuming: {plan.resumed} of {len(plan.chosen)} measurements read from {store.path}")
    kept, compiled = Kept(), 0
    trial_data = Trial(task.program, config.seed, agree.local_device(task.mesh), config.training,
                       on_device=task.mesh.devices.size == 1)
    chosen = plan.chosen
    if config.training and sum(not c.plain for c in chosen if c.result is None) > config.training_finalists:
      chosen, compiled = _forwards_first(task, config, machine, plan, trial_data, store, clock, log)
    try:
      compiled += measure_stage(config, chosen, training=config.training, trial_data=trial_data, store=store,
                                clock=clock, kept=kept, log=log)
      best, decision, tied = _decide(task, config, plan.candidates, kept, trial_data, clock, log)
    except KeyboardInterrupt:
      raise  # Ctrl-C ends at once; the reference's thread, if still running, is a daemon's
    except BaseException:
      trial_data.finish()  # no computation of the tune's runs on once it returns
      raise
    trial_data.finish()
    with clock("store"):
      if best is not None:
        store.winner(best, plan.candidates)
  ok = [c for c in plan.candidates if c.status == measure.OK and not c.plain]
  agreement = spearman([plan.corrections.ms(c) for c in ok], [c.time_ms for c in ok])
  if agreement is not None:
    log(f"cost model: rank agreement with the measured times (Spearman) {agreement:.2f} over {len(ok)} candidates")
  return TuneResult(best, plan.candidates, machine=machine, resumed=plan.resumed, objective=config.objective,
                    decision=decision, tied=tied, phases=clock.seconds(), spearman=agreement,
                    corrections=plan.corrections, not_offered=plan.not_offered, compiled=compiled,
                    references=trial_data.computed)


@dataclasses.dataclass
class _Plan:
  """Process 0's plan, broadcast to the others: every candidate (with the results decided so far), those chosen
  to measure in order, and what was learned on the way."""

  candidates: list
  chosen: list
  resumed: int = 0
  corrections: Corrections = dataclasses.field(default_factory=Corrections)
  not_offered: dict = dataclasses.field(default_factory=dict)
  forwards: dict = dataclasses.field(default_factory=dict)  # index in chosen -> resumed forward measurement

  def to_data(self) -> dict:
    index = {id(c): k for k, c in enumerate(self.candidates)}
    return {"candidates": [{**c.to_dict(), "result": None if c.result is None else c.result.to_dict()}
                           for c in self.candidates],
            "chosen": [index[id(c)] for c in self.chosen], "resumed": self.resumed,
            "corrections": dataclasses.asdict(self.corrections), "not_offered": self.not_offered,
            "forwards": {str(k): m.to_dict() for k, m in self.forwards.items()}}

  @classmethod
  def from_data(cls, task, data: dict) -> "_Plan":
    """The plan on another process: candidates rebuilt from their structured records."""
    cands = []
    for d in data["candidates"]:
      try:
        c = Candidate.from_dict(task.program, task.mesh, d)
      except (ScheduleError, ValueError):  # a candidate process 0 found invalid: never measured, kept for the record
        predicted = math.nan if d["predicted_ms"] is None else d["predicted_ms"]
        c = Candidate(d["strategy"], Schedule(task.program, task.mesh), predicted, d["memory_bytes"],
                      origin=d["origin"], recorded_trace=d["schedule"])
      c.result = None if d["result"] is None else measure.Measurement.from_dict(d["result"])
      c.final = None
      cands.append(c)
    return cls(cands, [cands[k] for k in data["chosen"]], int(data["resumed"]),
               Corrections(**data["corrections"]), dict(data["not_offered"]),
               {int(k): measure.Measurement.from_dict(m) for k, m in data["forwards"].items()})


def _plan(task, config, given, machine, store, clock, log) -> _Plan:
  """The propose, score and prune stages, and what the database already measured (process 0)."""
  if config.memory_budget is None:
    config = dataclasses.replace(config, memory_budget=prune.device_budget(task.mesh))
  with clock("propose"):
    cands = propose(task, config, given)
    missing = not_offered(task.program, task.mesh) if agree.process_count() > 1 else {}
  with clock("score"):
    cands = prune.score(task, config, machine, cands)
    near = prune.nearest(task, config, machine, store.nearest() if given is None else None, cands)
  with clock("prune"):
    corrections = Corrections.learned(store.observations())
    if corrections.factors:
      log(f"cost model corrections: {corrections}")
    chosen = prune.prune(config, cands, corrections, near=near, given=given is not None, log=log)
    if config.retune:
      store.clear()
    count = 0
    for c, m in zip(chosen, resumed(config, store, chosen)):
      if m is not None:
        c.result, count = m, count + 1
    forwards = {}
    if config.training:
      forward_store = stored.Store(store.db, task, log, FORWARD)
      forwards = {k: m for k, m in enumerate(resumed(config, forward_store, chosen)) if m is not None}
  return _Plan(cands, chosen, count, corrections, missing, forwards)


def _forwards_first(task, config, machine, plan: _Plan, trial_data, store, clock, log) -> tuple[list, int]:
  """A training tune's forward pass: the chosen candidates' forwards measured (copies of them, stored under the
  forward objective), then the candidates whose training steps are measured (``training_finalists``); the others
  are pruned, or failed where their forward failed, with the reason. Returns ``(finalists, programs compiled)``."""
  todo = [c for c in plan.chosen if c.result is None and not c.plain]  # a plain program's step is always measured
  copies = [dataclasses.replace(c, result=plan.forwards.get(k)) for k, c in enumerate(plan.chosen)
            if c.result is None and not c.plain]
  log(f"  ranking {len(copies)} candidates on their forwards first")
  compiled = measure_stage(config, copies, training=False, trial_data=trial_data,
                           store=stored.Store(store.db, task, log, FORWARD), clock=clock, kept=None, log=log,
                           label="forward ")
  _, why = training_finalists(config, machine, copies)
  for k, reason in why.items():
    if isinstance(reason, measure.Measurement):  # its forward failed: so does its step
      todo[k].result = dataclasses.replace(reason, reason=f"forward: {reason.reason}")
    else:
      todo[k].result = measure.Measurement(measure.PRUNED, reason=reason)
  return [c for c in plan.chosen if c.result is None or c.status == measure.OK], compiled


def _decide(task, config, cands, kept: Kept, trial_data: Trial, clock, log) -> tuple:
  """The decide stage: the final round among the timed candidates (every process in lockstep)."""
  many = agree.process_count() > 1
  ok = [c for c in cands if c.status == measure.OK]
  if not ok:
    return None, "", []
  step_key = jax.random.fold_in(jax.random.key(config.seed), 1) if config.training else None
  with clock("final round"):
    best, decision, tied = decide.decide_stage(
        ok, lambda c: kept.ready(c, trial_data.inputs(), step_key), iters=config.iters,
        budget_s=config.final_budget_s, log=log, gather=agree.gather if many else None)
  if many:  # the same times everywhere give the same decision; process 0's is the record
    index = next(k for k, c in enumerate(cands) if c is best)
    final = agree.broadcast_json({"best": index, "decision": decision} if agree.is_leader() else None)
    best, decision = cands[final["best"]], final["decision"]
  log(f"decision: {decision}")
  if best.final is None:  # decided without a final round: the verdict alone, for the record
    best.final = Final(None, (), decision)
  return best, decision, tied


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
