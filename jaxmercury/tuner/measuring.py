"""The compile, check and time stages of a tune.

``measure_stage`` takes candidates in order: those the database already
holds a measurement of are resumed; the rest are compiled all at once on
threads (``ahead.compile_all``: XLA compiles outside Python's lock) while the
reference is computed, then each is checked against the reference and timed
(``measure.measure``), and its measurement stored as soon as it is taken.
Under several processes every process compiles its own programs at once as
well, and the checks and timed runs go in lockstep, each combined across the
processes (the slowest counts).

A forward tune measures its candidates once; a training tune measures their
forwards first and the training steps of its finalists only
(``training_finalists``). ``Kept`` holds what was compiled, so that the final
round compiles nothing again.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import math
import random
import threading
import time

import jax

from jaxmercury.tuner import agree, ahead, cost, decide, measure, watchdog
from jaxmercury.tuner.reference import trial

MAX_ATTEMPTS = 2  # a candidate the tuner died in this often is failed, not retried


class Phases:
  """Seconds spent per stage of a tune (``TuneResult.phases``), in the order the stages began."""

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


class Trial:
  """The inputs, cotangent and reference every candidate is checked and timed on (``reference.trial``; kept on
  ``device`` where ``on_device``: a mesh of one device), computed once, in a thread of its own when ``start``ed
  (beside the compiles), else when first asked for. ``computed`` counts the computations (one per tune)."""

  def __init__(self, program, seed: int, device, training: bool, on_device: bool = False):
    self.program, self.seed, self.device, self.training = program, seed, device, training
    self.on_device = on_device
    self.computed = 0
    self._future = None
    self._lock = threading.Lock()

  def start(self):
    with self._lock:
      if self._future is None:
        self._future = concurrent.futures.Future()
        threading.Thread(target=self._compute, name="jaxmercury-reference", daemon=True).start()

  def _compute(self):
    try:
      self.computed += 1
      self._future.set_result(trial(self.program, self.seed, self.device, training=self.training,
                                    on_device=self.on_device))
    except BaseException as e:
      self._future.set_exception(e)

  def get(self) -> tuple:
    """``(inputs, cotangent, reference)``."""
    self.start()
    return self._future.result()

  def inputs(self):
    """The inputs alone."""
    return self.get()[0]

  def finish(self):
    """Waits for a computation started and not yet asked for (none may run on once the tune returns)."""
    if self._future is not None:
      concurrent.futures.wait([self._future])


class Kept:
  """Compiled calls (``measure.measure(keep=...)``) of the timed candidates: the final round compiles none of them
  again. Only those that are finalists so far keep their placed inputs (``trim``), so that the devices hold the
  inputs of a few candidates at most; the others keep their compiled program, and the final round places their
  inputs again."""

  def __init__(self):
    self.calls = {}

  def keeper(self, c):
    return lambda call: self.calls.__setitem__(id(c), call)

  def ready(self, c, inputs, cotangent_key=None):
    """A call of no arguments running ``c`` on ``inputs`` (``measure.ready_call``), from what was kept."""
    call = self.calls.get(id(c))
    if isinstance(call, functools.partial):
      return call
    return measure.ready_call(c.schedule, inputs, cotangent_key=cotangent_key, compiled=call)

  def trim(self, ok):
    wanted = {id(c) for c in decide.finalists(ok)}
    self.calls = {k: v if k in wanted or not isinstance(v, functools.partial) else v.func
                  for k, v in self.calls.items()}


def resumed(config, store, cands) -> list:
  """Per candidate, the measurement ``store`` holds of it (a candidate the tuner died measuring
  ``MAX_ATTEMPTS`` times is failed), or None. Process 0 reads them and broadcasts them with its plan: the
  processes' databases may differ."""
  stored = store.measurements() if config.resume and not config.retune else {}
  out = []
  for c in cands:
    row = stored.get(c.schedule.to_json())
    if row is not None and row.result is None and row.attempts >= MAX_ATTEMPTS:
      out.append(measure.Measurement(measure.FAILED, reason=f"the tuner died {row.attempts} times while "
                                                            "measuring it (crash, kill or out of memory)"))
    else:
      out.append(None if row is None else row.result)
  return out


def measure_stage(config, cands: list, *, training: bool, trial_data: Trial, store, clock: Phases,
                  kept: Kept | None, log, label: str = "") -> int:
  """Measures each of ``cands`` without a result yet, in order: compile (all at once, on threads), check, time
  (module docstring); each ``result`` is set and stored as soon as it is taken.

  Args:
    config: the ``TuneConfig``.
    cands: the candidates, in the order they are checked and timed (those resumed hold their result already).
    training: measure training steps (``measure.training_step``) instead of forwards.
    trial_data: the inputs and reference (``Trial``; its cotangent and gradients for training steps).
    store: the ``stored.Store`` measurements go to as they are taken.
    clock: the tune's ``Phases``.
    kept: where the compiled calls go, for the final round (None: nowhere).
    log: progress printer.
    label: what is measured, in the progress lines (``"forward "``).

  Returns:
    How many programs were compiled in this process.
  """
  many = agree.process_count() > 1
  todo = [c for c in cands if c.result is None]
  compiled = {}
  if todo and config.isolation == "thread":
    trial_data.start()
  threads = config.threads()
  if threads > 1 and len(todo) > 1 and config.isolation == "thread" and not store.died_measuring():
    for c in todo:
      store.started(c)
    log(f"  compiling {len(todo)} {label}candidates, {min(threads, len(todo))} at a time ...")
    with clock("compile"):
      futures = ahead.compile_all([c.schedule for c in todo], training=training, threads=threads,
                                  time_limit_s=config.time_limit_s)
    compiled = {id(c): f for c, f in zip(todo, futures)}
  count = 0
  waiting = {id(c) for c in todo}
  for n, c in enumerate(cands):
    if id(c) not in waiting:
      _progress(log, n, len(cands), c, label, config.isolation, resumed=True)
      continue
    if id(c) not in compiled:
      store.started(c)
    if config.isolation == "process":
      c.result = watchdog.measure_in_worker(c.schedule, trial_data.seed, iters=config.iters,
                                           time_limit_s=config.time_limit_s, training=training)
      if c.result is None:
        log(f"  {c.name}: no worker can rebuild {c.schedule.program.name}; measuring in-process")
    if c.result is None:
      with clock("reference"):
        inputs, cotangent, reference = trial_data.get()
      if not training and trial_data.training:  # a training tune's forwards: the reference's output alone
        cotangent, reference = None, reference[0]
      t0 = time.perf_counter()
      c.result = measure.measure(c.schedule, inputs, reference, iters=config.iters, time_limit_s=config.time_limit_s,
                                 gather=agree.gather if many else None, cotangent=cotangent,
                                 keep=None if kept is None else kept.keeper(c), compiled=compiled.pop(id(c), None))
      count += 1
      checking = c.result.compile_s or 0.0
      clock.add("check", checking)
      clock.add("time", time.perf_counter() - t0 - checking)
    store.measured(c)
    _progress(log, n, len(cands), c, label, config.isolation)
    if kept is not None:
      kept.trim([x for x in cands if x.status == measure.OK])
  return count


def _progress(log, n: int, total: int, c, label: str, isolation: str, resumed: bool = False):
  result = c.result
  shown = f"{result.median_ms:9.3f} ms" if result.status == measure.OK else result.reason
  predicted = "        -" if math.isnan(c.predicted_ms) else f"{c.predicted_ms:9.3f}"
  note = "" if result.compile_s is None else f"  (compile and check {result.compile_s:.1f} s)"
  note = "  (resumed)" if resumed else note
  log(f"  [{n + 1}/{total}] {label}{c.name:<40} predicted {predicted} ms  {result.status:<6} {shown}{note}")
  if not resumed and isolation == "thread" and result.reason.startswith("time-out"):
    log("  warning: an abandoned candidate may still occupy the devices and delay the next ones; "
        "isolation='process' kills it instead")


def training_finalists(config, machine, forwards: list) -> tuple[list, dict]:
  """Which candidates of a training tune have their training steps measured, from their measured forwards.

  Each schedule's step is estimated as its measured forward times its predicted step over its predicted forward
  (``cost.predict``); the plain programs always go on, and of the others the ``config.training_finalists`` best
  estimated, within ``config.margin`` of the best estimate.

  Args:
    config: the ``TuneConfig``.
    machine: the cost model's figures.
    forwards: the candidates (copies) whose ``result`` is their forward's measurement.

  Returns:
    ``(indices of the finalists, {index: why not})``: why not is a sentence, or the failed forward's
    ``Measurement``.
  """
  estimates, why = {}, {}
  for k, c in enumerate(forwards):
    if c.status != measure.OK:
      why[k] = c.result
    elif not c.plain:
      forward_ms = cost.predict(c.schedule, machine) * 1e3
      estimates[k] = c.time_ms * (c.predicted_ms / forward_ms if forward_ms > 0 else 1.0)
  ranked = sorted(estimates, key=estimates.get)
  best = estimates[ranked[0]] if ranked else None
  chosen = {k for k in ranked[:config.training_finalists] if estimates[k] <= config.margin * best}
  for k in ranked:
    if k not in chosen:
      why[k] = (f"its forward ({forwards[k].time_ms:.3f} ms, a step of about {estimates[k]:.3f} ms) ranks it "
                f"out of the {config.training_finalists} training finalists")
  return [k for k in range(len(forwards)) if k not in why], why


def fresh_seed(key) -> int:
  """The random inputs' seed: from ``key``, or fresh."""
  if key is None:
    return random.SystemRandom().randrange(1 << 31)
  return int(jax.random.randint(key, (), 0, (1 << 31) - 1))
