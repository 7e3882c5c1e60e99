"""Compiling, checking and timing one candidate schedule.

``measure`` runs in two phases, each under a hard time limit when one is
given (``watchdog.run_limited``): compile + first run + check against the
reference, then the timed runs. Between and after the phases the processes of
a multi-process run combine what they saw (``gather``): a candidate fails if
it fails on any process, its error is the error of the whole output, and each
timed run counts as long as the slowest process took.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxmercury.ir.loops import spec_levels
from jaxmercury.tuner.plain import is_plain, platform_of
from jaxmercury.tuner.timeout import run_limited

OK, PRUNED, FAILED = "ok", "pruned", "failed"
# Why a candidate was not timed or failed (``Measurement.cause``), for a summary that tells them apart.
OVER_BUDGET, INVALID, WRONG = "over the memory budget", "invalid for the mesh", "failed its numerical check"

# Local outcome codes of the first phase, combined across processes.
_PASSED, _ERROR, _TIMEOUT = 0, 1, 2
_CODE_TEXT = {_ERROR: "compile or run error", _TIMEOUT: "time-out"}


@dataclasses.dataclass
class Measurement:
  """The outcome of one candidate: its time, or why it was not timed.

  ``status`` is ``ok`` (checked and timed), ``pruned`` (not compiled: over
  the memory budget, or ranked below the timed few by the cost model) or
  ``failed`` (compile or run error, time-out, NaN, or a result that differs
  from the reference); ``reason`` says which, ``cause`` in one word where the summary tells it apart
  (``OVER_BUDGET``, ``INVALID``, ``WRONG``; empty otherwise).
  """

  status: str
  median_ms: float | None = None
  times_ms: list[float] = dataclasses.field(default_factory=list)
  rel_err: float | None = None
  reason: str = ""
  compiled_bytes: int | None = None  # from compiled.memory_analysis(), where available
  cause: str = ""
  compile_s: float | None = None  # seconds of the compile, first run and check

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, data: dict) -> "Measurement":
    """Rebuilds a measurement from ``to_dict`` output (data from a database or another process)."""
    if not isinstance(data, dict) or data.get("status") not in (OK, PRUNED, FAILED):
      raise ValueError(f"not a measurement: {data!r}")
    fields = {f.name for f in dataclasses.fields(cls)}
    m = cls(**{k: v for k, v in data.items() if k in fields})
    if not isinstance(m.times_ms, list) or not all(isinstance(t, (int, float)) for t in m.times_ms):
      raise ValueError(f"measurement times must be a list of numbers, got {m.times_ms!r}")
    if m.status == OK and not isinstance(m.median_ms, (int, float)):
      raise ValueError(f"an ok measurement needs a time, got {m.median_ms!r}")
    return m


# float32 on GPUs: XLA's default float32 dot there rounds its operands to TensorFloat-32 (10 mantissa bits, unit
# roundoff 2^-11 = 4.9e-4), so a user's plain float32 program differs from a full-precision reference by about that.
TF32_TOLERANCE = 2e-3


def tolerance(dtype, platform: str = "cpu") -> float:
  """Relative Frobenius error allowed for outputs of this dtype on devices of ``platform``."""
  if np.dtype(dtype).itemsize <= 2:
    return 2e-2
  return TF32_TOLERANCE if platform == "gpu" else 1e-4


def gradient_tolerance(dtype, platform: str = "cpu") -> float:
  """Relative Frobenius error allowed for gradients of this dtype (a backward rounds once more than its forward)."""
  if np.dtype(dtype).itemsize <= 2:
    return 3e-2
  return 2 * TF32_TOLERANCE if platform == "gpu" else 1e-4


def training_step(fn):
  """``step(*inputs, cotangent) -> (output, *gradients)``: ``fn``'s forward and its pullback in one jitted call."""
  def step(*args):
    out, pullback = jax.vjp(fn, *args[:-1])
    return (out, *pullback(args[-1]))
  return jax.jit(step)


def rel_err(y, ref) -> float:
  y = np.asarray(jax.device_get(y), np.float64)
  ref = np.asarray(jax.device_get(ref), np.float64)
  denom = np.linalg.norm(ref)
  return float(np.linalg.norm(y - ref) / (denom if denom else 1.0))


def local_error(y, ref) -> tuple[bool, float, float]:
  """(all finite, sum of squared differences, sum of squared reference) over this process's shards.

  Each element counts once (replica 0 of every shard), so the sums of all
  processes give the error of the whole output; one process needs only the
  shards it can address. ``ref`` is best a host (numpy) array: each shard's
  part of it is then a host slice, where slicing a device array would compile
  a program per shard; a device array (``reference.trial(on_device=True)``)
  serves a shard that is the whole output without a slice. On CPU devices
  the sums are taken on the host; on others on each shard's device, in
  float32 (copying a large output to the host and summing it there took
  seconds per candidate).
  """
  host = [ref] if isinstance(ref, np.ndarray) else []  # the host copy of ``ref``, made when a shard needs it

  def part_of(index):
    if not host:
      host.append(np.asarray(jax.device_get(ref)))
    return host[0][index]

  finite, diff, norm = True, 0.0, 0.0
  for shard in y.addressable_shards:
    if shard.replica_id != 0:
      continue
    if shard.device.platform == "cpu":
      part, want = np.asarray(shard.data, np.float64), np.asarray(part_of(shard.index), np.float64)
      ok, d, n = bool(np.all(np.isfinite(part))), float(np.sum((part - want) ** 2)), float(np.sum(want ** 2))
    else:
      want = ref if not host and shard.data.shape == ref.shape else part_of(shard.index)
      sums = _error_sums(shard.data, jax.device_put(want, shard.device))
      ok, d, n = (float(v) for v in jax.device_get(sums))
    finite = finite and bool(ok)
    diff += d if finite else 0.0
    norm += n
  return finite, diff, norm


@jax.jit
def _error_sums(part, ref):
  part, ref = part.astype(jnp.float32), ref.astype(jnp.float32)
  return jnp.all(jnp.isfinite(part)).astype(jnp.float32), jnp.sum((part - ref) ** 2), jnp.sum(ref ** 2)


_SOURCE_LINE = re.compile(r'^(File ".*", line \d+|\S+\.py:\d+)')


def clip(text: str, limit: int = 300) -> str:
  """``text`` cut to ``limit`` characters at a word boundary, marked by an ellipsis where it was cut."""
  if len(text) <= limit:
    return text
  cut = text[:limit - 1]
  space = cut.rfind(" ")
  return (cut[:space] if space > limit // 2 else cut).rstrip(" ,;:") + "…"


def _first_line(e: BaseException) -> str:
  """The exception's type and its most telling line (an out-of-memory is named as such; source locations that
  JAX prefixes some messages with are skipped)."""
  lines = [line.strip() for line in str(e).splitlines() if line.strip() and not _SOURCE_LINE.match(line.strip())]
  line = lines[0] if lines else ""
  oom = next((x for x in lines if "RESOURCE_EXHAUSTED" in x or "Out of memory" in x), None)
  if oom is not None:
    return f"out of memory: {type(e).__name__}: {clip(oom)}"
  if line.startswith("Traceback") or line.endswith("Traceback (most recent call last):"):
    line = f"{line} ... {lines[-1]}"  # a host callback's error: its last line says what failed
  return f"{type(e).__name__}: {clip(line)}"


def compiled_memory(compiled) -> int | None:
  """Peak bytes per device XLA reports for a compiled program, if it reports any."""
  try:
    m = compiled.memory_analysis()
  except Exception:
    return None
  if m is None:
    return None
  return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
             - m.alias_size_in_bytes)


def stored_spec(runnable, buffer: str) -> PartitionSpec | None:
  """The layout a schedule stores ``buffer`` in (its plan's), or a plain program's layout of it."""
  if is_plain(runnable):
    return runnable.user_spec(buffer)
  return runnable.plan().user_spec(buffer)


def _divisible(spec: PartitionSpec, shape, mesh) -> PartitionSpec:
  """``spec`` with each dimension the mesh does not divide whole: a padded axis is stored whole and padded inside
  the program, so that is where the caller's array starts."""
  entries = []
  for size, entry in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
    entries.append(entry if size % math.prod(mesh.shape[n] for n in spec_levels(entry)) == 0 else None)
  return PartitionSpec(*entries)


def _sharding(runnable, buffer: str, shape) -> NamedSharding:
  """Where ``runnable`` stores ``buffer`` (of ``shape``): its layout, the dimensions the mesh does not divide whole."""
  return NamedSharding(runnable.mesh, _divisible(stored_spec(runnable, buffer) or PartitionSpec(), shape,
                                                 runnable.mesh))


def _placed(runnable, buffer: str, x):
  """``x`` laid out as ``runnable`` stores ``buffer``; under several processes each keeps its devices' shards."""
  sharding = _sharding(runnable, buffer, x.shape)
  if not sharding.is_fully_addressable and not isinstance(x, np.ndarray):
    x = np.asarray(jax.device_get(x))
  return jax.device_put(x, sharding)


def place_inputs(schedule, inputs):
  """Inputs laid out as the schedule (or plain program) stores them, so that timing excludes the move.

  Under several processes each process passes the same (host-local) values
  and keeps the shards its devices hold.
  """
  if not isinstance(schedule.mesh, jax.sharding.Mesh):
    return inputs
  return jax.block_until_ready([_placed(schedule, b.name, x) for b, x in zip(schedule.program.reads, inputs)])


def place_output(schedule, x):
  """``x`` (shaped like the output: its cotangent) laid out as the schedule stores its output."""
  if not isinstance(schedule.mesh, jax.sharding.Mesh):
    return x
  return jax.block_until_ready(_placed(schedule, schedule.program.writes.name, x))


def _this_process(values: np.ndarray) -> np.ndarray:
  return np.asarray(values)[None]


@dataclasses.dataclass
class _Checked:
  """What one process saw of the compile, the first run and the check (per output: the output, then, for a
  training step, each input's gradient)."""

  code: int = _PASSED
  reason: str = ""
  compiled: object = None
  inputs: tuple = ()
  compiled_bytes: int | None = None
  run_s: float = 0.0
  finite: bool = True
  diffs: tuple = ()
  norms: tuple = ()

  def row(self, outputs: int) -> np.ndarray:
    """What the processes combine: code, all finite, then each output's squared difference and norm."""
    diffs, norms = self.diffs or (0.0,) * outputs, self.norms or (0.0,) * outputs
    return np.array([self.code, float(self.finite), *diffs, *norms], np.float64)


def _runnable(schedule, training: bool):
  """The schedule's (or plain program's) jitted call, or its training step (``training_step``)."""
  fn = schedule.compile()
  return training_step(fn) if training else fn


def compile_ahead(schedule, *, training: bool = False):
  """The compiled program ``measure`` would compile for ``schedule`` (``training``: its training step), from the
  buffers' shapes alone, so that several candidates can compile at once before any is run (``measure``'s
  ``compiled``). Under several processes each compiles its own (a compile runs no collective)."""
  prog = schedule.program
  buffers = prog.reads + ((prog.writes,) if training else ())  # a training step takes the output's cotangent
  args = [jax.ShapeDtypeStruct(b.shape, b.dtype, sharding=_sharding(schedule, b.name, b.shape)) for b in buffers]
  return _runnable(schedule, training).lower(*args).compile()


def _compile_and_check(schedule, inputs, reference, cotangent=None, compiled=None) -> _Checked:
  try:
    inputs = place_inputs(schedule, inputs)
    if cotangent is not None:
      inputs = [*inputs, place_output(schedule, cotangent)]
    if compiled is not None:
      compiled = compiled.result()
    else:
      compiled = _runnable(schedule, cotangent is not None).lower(*inputs).compile()
    t0 = time.perf_counter()
    y = jax.block_until_ready(compiled(*inputs))
    run_s = time.perf_counter() - t0
  except Exception as e:
    return _Checked(_ERROR, _first_line(e))
  errors = [local_error(a, r) for a, r in zip(jax.tree.leaves(y), jax.tree.leaves(reference))
            if np.dtype(r.dtype) != jax.dtypes.float0]  # an integer input's gradient (segment ids) has no values
  return _Checked(compiled=compiled, inputs=tuple(inputs), compiled_bytes=compiled_memory(compiled),
                  run_s=run_s, finite=all(e[0] for e in errors), diffs=tuple(e[1] for e in errors),
                  norms=tuple(e[2] for e in errors))


def _timed_runs(compiled, inputs, warmup: int, iters: int) -> list[float]:
  for _ in range(warmup):
    jax.block_until_ready(compiled(*inputs))
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*inputs))
    times.append((time.perf_counter() - t0) * 1e3)
  return times


def sustained(call: Callable, seconds: float) -> float:
  """Milliseconds per run of ``call`` run back to back, one run queued behind the one running: for half of
  ``seconds`` untimed (the clock settles to the power this call draws), then timed for at least ``seconds``."""
  def back_to_back(until: float) -> int:
    runs, queued = 0, None
    while not runs or time.perf_counter() < until:
      out = call()
      if queued is not None:
        jax.block_until_ready(queued)
      queued, runs = out, runs + 1
    jax.block_until_ready(queued)
    return runs

  back_to_back(time.perf_counter() + seconds / 2)
  t0 = time.perf_counter()
  runs = back_to_back(t0 + seconds)
  return (time.perf_counter() - t0) * 1e3 / runs


def rounds(calls: dict, counts, on_error=None, block_s: float = 0.0) -> dict[str, list[float]]:
  """Times calls side by side: per round one run of each, in an order that rotates every round.

  Machine drift (clocks, temperature, other load) then spreads over all of
  them alike, which separates calls closer than the spread of one-at-a-time
  timings. A GPU at its power cap sets its clock by the power drawn, so in
  single runs each call's clock is set by the mix; with ``block_s`` each run
  is a block of back-to-back runs (``sustained``), at the clock the call
  itself allows, as in a loop of it alone.

  Args:
    calls: name -> a callable of no arguments (its result is waited for).
    counts: runs (blocks) per name (an int: the same for every name); a name
      stops once it has its count.
    on_error: ``on_error(name, exception)`` for a run that raises; that name
      is then dropped. None: the exception propagates.
    block_s: seconds per timed block (``sustained``); 0: single runs.

  Returns:
    name -> per-run milliseconds (per block: its mean), for the names not
    dropped.
  """
  counts = counts if isinstance(counts, dict) else dict.fromkeys(calls, counts)
  names, live = list(calls), dict(calls)
  times = {name: [] for name in calls}
  for r in range(max(counts.values(), default=0)):
    k = r % len(names)
    for name in names[k:] + names[:k]:
      if name not in live or len(times[name]) >= counts[name]:
        continue
      try:
        if block_s:
          times[name].append(sustained(live[name], block_s))
        else:
          t0 = time.perf_counter()
          jax.block_until_ready(live[name]())
          times[name].append((time.perf_counter() - t0) * 1e3)
      except Exception as exc:
        if on_error is None:
          raise
        on_error(name, exc)
        del live[name]
  return {name: t for name, t in times.items() if name in live}


def ready_call(schedule, inputs, *, cotangent_key=None, compiled=None) -> Callable:
  """A call of no arguments running the compiled ``schedule`` (or plain program) on ``inputs`` in its layouts,
  after one untimed run.

  Args:
    schedule: a checked schedule or plain program.
    inputs: the program's inputs.
    cotangent_key: call a training step instead: the forward and backward (``training_step``) on a random output
      cotangent drawn from this key, laid out as the output.
    compiled: its compiled program (or training step), kept from its measurement; None: compiled here.
  """
  xs = place_inputs(schedule, inputs)
  if cotangent_key is not None:
    out = schedule.program.writes
    cot = jax.random.normal(cotangent_key, out.shape, jnp.float32).astype(out.dtype)
    xs = [*xs, place_output(schedule, cot)]
  if compiled is None:
    compiled = _runnable(schedule, cotangent_key is not None).lower(*xs).compile()
  jax.block_until_ready(compiled(*xs))
  return functools.partial(compiled, *xs)


def interleaved(schedules: dict, inputs, *, iters: int = 10, cotangent_key=None) -> dict[str, list[float]]:
  """Times already-checked schedules side by side (``rounds``).

  Args:
    schedules: name -> Schedule (or plain program); each compiles and runs (one untimed run each, ``ready_call``).
    inputs: the program's inputs; each schedule gets them in its own layout.
    iters: rounds.
    cotangent_key: time a training step instead: each schedule's forward and
      backward (``jax.vjp`` and its pullback in one jitted call) on a random
      output cotangent drawn from this key, laid out as the output.

  Returns:
    name -> per-run milliseconds.
  """
  ready = {name: ready_call(s, inputs, cotangent_key=cotangent_key) for name, s in schedules.items()}
  return rounds(ready, iters)


def measure(schedule, inputs, reference, *, warmup: int = 2, iters: int = 10,
            time_limit_s: float | None = None, gather: Callable | None = None,
            on_checked: Callable | None = None, cotangent=None, keep: Callable | None = None,
            compiled=None) -> Measurement:
  """Compiles ``schedule``, checks it against ``reference``, then times it.

  A candidate that fails to compile or run, or whose compile and first run
  exceed ``time_limit_s``, is ``failed``: the limit is enforced by a
  watchdog that stops waiting for it (``watchdog.run_limited``), so a hung
  candidate is abandoned, not waited for. Inputs are first placed in the
  layout the schedule stores them in (``place_inputs``). A candidate whose
  output is not finite or differs from the reference beyond the dtype's
  tolerance is ``failed`` and never timed. Times are wall clock around
  ``block_until_ready`` (device-side completion), after ``warmup`` runs; the
  median of ``iters`` counts. The timed runs have their own limit:
  ``time_limit_s`` plus ten times their expected length.

  Args:
    schedule: the candidate.
    inputs: the program's inputs (host-local values, the same on every process).
    reference: the trusted output, on this process.
    warmup: untimed runs before timing.
    iters: timed runs.
    time_limit_s: seconds for the compile and first run; None: no limit.
    gather: ``gather(array) -> array`` stacking one array per process (an
      all-gather); default this process only. Every process calls it at the
      same points, so all reach the same verdict and time.
    on_checked: called with the first run's seconds once the candidate passed its check.
    cotangent: time a training step instead (``training_step``: the
      forward and its backward for this output cotangent, in one call);
      ``reference`` is then ``(output, gradients)`` and each gradient is
      checked too (``gradient_tolerance``). ``rel_err`` is the output's.
    keep: called, once the candidate is timed, with a call of no arguments that runs its compiled program on the
      placed inputs again (to time it side by side later without compiling it again).
    compiled: a ``concurrent.futures.Future`` of the compiled program (``compile_ahead``), waited for within the
      time limit, instead of compiling here.

  Returns:
    The ``Measurement``.
  """
  gather = gather or _this_process
  prog = schedule.program
  names = ["output"] + ([f"d{b.name}" for b in prog.reads] if cotangent is not None else [])
  start = time.perf_counter()
  checked, timed_out = run_limited(lambda: _compile_and_check(schedule, inputs, reference, cotangent, compiled),
                                   time_limit_s)
  if timed_out or (time_limit_s is not None and checked.code == _PASSED
                   and time.perf_counter() - start > time_limit_s):
    nbytes = None if checked is None else checked.compiled_bytes
    checked = _Checked(_TIMEOUT, f"time-out: compile and first run took over {time_limit_s:g} s",
                       compiled_bytes=nbytes)
  rows = gather(checked.row(len(names)))
  nbytes = checked.compiled_bytes
  compile_s = time.perf_counter() - start
  failed = [int(c) for c in rows[:, 0]]
  if any(failed):
    if checked.code:
      return Measurement(FAILED, reason=checked.reason, compiled_bytes=nbytes, compile_s=compile_s)
    process, code = next((p, c) for p, c in enumerate(failed) if c)
    return Measurement(FAILED, reason=f"{_CODE_TEXT[code]} on process {process}", compiled_bytes=nbytes,
                       compile_s=compile_s)
  if not np.all(rows[:, 1]):
    what = "output or a gradient" if cotangent is not None else "output"
    return Measurement(FAILED, reason=f"{what} has NaN or Inf", compiled_bytes=nbytes, cause=WRONG,
                       compile_s=compile_s)
  diffs, norms = np.sum(rows[:, 2:2 + len(names)], axis=0), np.sum(rows[:, 2 + len(names):], axis=0)
  errs = [float(np.sqrt(d / (n if n else 1.0))) for d, n in zip(diffs, norms)]
  err, platform = errs[0], platform_of(schedule.mesh)
  for k, (name, e) in enumerate(zip(names, errs)):
    tol = (tolerance if k == 0 else gradient_tolerance)(prog.writes.dtype, platform)
    if e > tol:
      what = "wrong result" if k == 0 else f"wrong gradient {name}"
      return Measurement(FAILED, rel_err=err, reason=f"{what}: relative error {e:.2e} above {tol:.0e}",
                         compiled_bytes=nbytes, cause=WRONG, compile_s=compile_s)
  if on_checked is not None:
    on_checked(checked.run_s)
  limit = None if time_limit_s is None else time_limit_s + 10 * (warmup + iters) * checked.run_s
  try:
    times, timed_out = run_limited(lambda: _timed_runs(checked.compiled, checked.inputs, warmup, iters), limit)
    reason = f"time-out: {warmup + iters} timed runs took over {limit:.3g} s" if timed_out else ""
  except Exception as e:
    times, reason = None, _first_line(e)
  local = np.full(iters, np.nan) if times is None else np.asarray(times, np.float64)
  all_times = gather(local)
  if np.isnan(all_times).any():
    return Measurement(FAILED, rel_err=err, compiled_bytes=nbytes, compile_s=compile_s,
                       reason=reason or f"timed runs failed on process {int(np.isnan(all_times).any(1).argmax())}")
  slowest = [float(t) for t in np.max(all_times, axis=0)]  # each run as long as its slowest process
  if keep is not None:
    keep(functools.partial(checked.compiled, *checked.inputs))
  return Measurement(OK, statistics.median(slowest), slowest, err, compiled_bytes=nbytes, compile_s=compile_s)
