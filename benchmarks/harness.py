"""What every suite shares: contestants checked and timed side by side, the physical floor, the results file.

A case's contestants are jitted functions of the same inputs. ``run_contestants`` compiles each, runs it once,
compares that output with the reference's (the first contestant that runs; a ``"reference"`` contestant, such as
the program's own single-device reference, is checked and never timed), warms it up, and then times them all in
interleaved rounds (``jaxmercury.tuner.measure.rounds``: one call of each per round, the order rotating) so that
drift of the machine spreads over all of them. A contestant that fails (compile error, out of memory, a wrong
output) is recorded with its reason and the case goes on. ``finish`` ranks them: each record's ratio to the best
baseline (above 1: faster), its fraction of the physical floor and its TFLOP/s per device.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import math
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import jaxlib
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxmercury
from benchmarks import clocks, kernel_trace
from jaxmercury.tuner import measure

SCHEMA = "jaxmercury-benchmarks/2"
BF16_TOLERANCE = 2e-2  # relative Frobenius error allowed between bf16 outputs
OUT_OF_TIME = "time budget spent"  # the skip reason of whatever --time_budget left out (--resume runs it)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def log(text: str):
  print(text, flush=True)


def error_text(exc: BaseException) -> str:
  """The exception's type and most telling line; an out-of-memory is named as such."""
  lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
  oom = next((ln for ln in lines if "RESOURCE_EXHAUSTED" in ln or "ut of memory" in ln), None)
  if oom is not None:
    return f"out of memory: {type(exc).__name__}: {oom[:300]}"
  return f"{type(exc).__name__}: {(lines[0] if lines else '')[:300]}"


@dataclasses.dataclass
class Contestant:
  """One implementation in a case.

  Attributes:
    name: its key in the results (for display; the structured fields are in ``record``).
    role: ``"jaxmercury"``, ``"baseline"`` or ``"reference"`` (checked against, not timed).
    build: returns the function of the case's inputs, or ``(function, its own placed arguments)``.
    label: what it is, in words.
    skip: a reason not to run it (recorded instead of a time).
    record: extra fields of its result record (strategy, kernel, configurations, ...).
  """

  name: str
  role: str
  build: Callable | None
  label: str = ""
  skip: str | None = None
  record: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Settings:
  """How contestants are timed: ``iters`` timed runs (fewer for slow ones, as many as fit ``max_timing_s``, at
  least 3; more for fast ones, as many as fill ``min_timing_s``, so that a millisecond case's median is not one
  of a few noisy runs) after ``warmup`` runs; nothing starts after ``deadline`` (``time.time()``); outputs must
  agree within ``tolerance``."""

  iters: int = 20
  warmup: int = 3
  max_timing_s: float = 10.0
  deadline: float | None = None
  tolerance: float = BF16_TOLERANCE
  min_timing_s: float = 0.0  # benchmarks.run: 0.5 s on GPUs
  sustain_s: float = 0.0  # each timed run a block of back-to-back runs this long (measure.sustained): iters blocks
  trace_rounds: int = 0  # after the timing, this many rounds under the profiler: each one's kernels (kernel_trace)

  @classmethod
  def from_args(cls, args, deadline: float | None, tolerance: float = BF16_TOLERANCE) -> "Settings":
    """``benchmarks.run``'s timing flags (``--iters``, ``--warmup``, ``--max_timing_s``, ``--min_timing_s``,
    ``--sustain_s``, ``--trace_rounds``)."""
    return cls(args.iters, args.warmup, args.max_timing_s, deadline, tolerance, args.min_timing_s,
               args.sustain_s, getattr(args, "trace_rounds", 0))

  def runs(self, first_s: float) -> int:
    """Timed runs of a contestant whose first run took ``first_s`` (``sustain_s``: ``iters`` blocks)."""
    if self.sustain_s:
      return self.iters
    first_s = max(first_s, 1e-6)
    return max(3, min(max(self.iters, int(self.min_timing_s / first_s)), int(self.max_timing_s / first_s)))


@jax.jit
def _rel(a, b):
  a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  return jnp.linalg.norm(a - b) / jnp.linalg.norm(b)


def rel_err(y, ref) -> float:
  """``||y - ref|| / ||ref||`` (Frobenius, float32) of two pytrees of arrays, the largest over their leaves; ``ref``
  is moved to each leaf's sharding first (it may live on one device)."""
  ys, refs = jax.tree.leaves(y), jax.tree.leaves(ref)
  if [a.shape for a in ys] != [b.shape for b in refs]:
    raise ValueError(f"output shapes {[a.shape for a in ys]} differ from the reference's {[b.shape for b in refs]}")
  return max(float(_rel(a, jax.device_put(b, a.sharding))) for a, b in zip(ys, refs))


def run_contestants(contestants: list[Contestant], inputs, settings: Settings) -> tuple[list[dict], str | None]:
  """Compiles, checks, warms up and then times the contestants in interleaved rounds, in list order.

  Returns:
    ``(records in list order, the reference's name or None)``.
  """
  records = {c.name: {"name": c.name, "role": c.role, "label": c.label, **c.record} for c in contestants}
  ready, ref, ref_name = {}, None, None  # name -> (call, runs); the reference's output and name
  for c in contestants:
    rec = records[c.name]
    if c.skip:
      rec["skipped"] = c.skip
      log(f"  skip  {c.name}: {c.skip}")
      continue
    if settings.deadline is not None and time.time() > settings.deadline:
      rec.update(skipped=OUT_OF_TIME, out_of_time=True)
      continue
    try:
      t0 = time.perf_counter()
      built = c.build()
      fn, args = built if isinstance(built, tuple) else (built, inputs)
      compiled = fn.lower(*args).compile() if hasattr(fn, "lower") else fn
      rec["compile_s"] = round(time.perf_counter() - t0, 3)
      rec["memory_bytes"] = measure.compiled_memory(compiled)
      t1 = time.perf_counter()
      y = jax.block_until_ready(compiled(*args))
      first = time.perf_counter() - t1
      if ref_name is None:
        ref, ref_name = y, c.name
        rec["rel_err"] = 0.0
        rec["numerics_ok"] = all(bool(jnp.all(jnp.isfinite(x.astype(jnp.float32)))) for x in jax.tree.leaves(y))
      else:
        rec["rel_err"] = rel_err(y, ref)
        rec["numerics_ok"] = bool(math.isfinite(rec["rel_err"]) and rec["rel_err"] < settings.tolerance)
      del y
      if c.role == "reference":
        continue
      for _ in range((settings.warmup if first < 1.0 else 1) - 1):
        jax.block_until_ready(compiled(*args))
      ready[c.name] = (functools.partial(compiled, *args), settings.runs(first))
      log(f"  ready {c.name} (compile {rec['compile_s']:.2f} s, first run {first * 1e3:.2f} ms, rel err "
          f"{rec['rel_err']:.1e}{'' if rec['numerics_ok'] else ' DISAGREES'})")
    except Exception as exc:  # a contestant's failure is data
      rec["error"] = error_text(exc)
      log(f"  ERROR {c.name}: {rec['error']}")
  del ref  # the reference output is not held while timing

  def dropped(name, exc):
    records[name]["error"] = error_text(exc)
    log(f"  ERROR while timing {name}: {records[name]['error']}")

  calls, sampler = clocks.Calls(), clocks.Sampler() if settings.sustain_s and ready else None
  try:
    times = measure.rounds({n: calls.wrap(n, call) if sampler else call for n, (call, _) in ready.items()},
                           {n: k for n, (_, k) in ready.items()}, on_error=dropped, block_s=settings.sustain_s)
  finally:  # nvidia-smi ends with the timing, also on Ctrl-C
    samples = sampler.stop() if sampler else []
  for name, t in times.items():
    records[name].update(median_ms=statistics.median(t), min_ms=min(t), times_ms=[round(x, 4) for x in t])
  for name, seen in clocks.by_contestant(calls.blocks(), samples).items():  # the clock each block ran at
    if name in times:
      records[name]["clocks"] = seen
  if settings.trace_rounds and times:
    _trace(records, {name: ready[name][0] for name in times}, settings.trace_rounds)
  return list(records.values()), ref_name


def _trace(records: dict, calls: dict, rounds: int):
  """Each timed contestant's kernels (``kernel_trace.traced`` on the first GPU) in ``records[name]["trace"]``; a
  trace that fails is recorded, not raised (the times stand)."""
  try:
    traced = kernel_trace.traced(calls, rounds, device=0, top=kernel_trace.TOP)
  except Exception as exc:  # the profiler's failure is data, as a contestant's is
    log(f"  ERROR while tracing: {error_text(exc)}")
    for name in calls:
      records[name]["trace"] = {"error": error_text(exc)}
    return
  for name, summary in traced.items():
    records[name]["trace"] = summary
  log(kernel_trace.table(traced))


def finish(case: dict, records: list[dict], reference: str | None, *, floor_ms: float | None = None,
           flops_per_device: float | None = None) -> dict:
  """Ranks the records into ``case``: each one's ratio to the best baseline, fraction of the floor, TFLOP/s.

  The best baseline is the fastest timed baseline whose output agrees. The case's ``status`` is ``"ok"`` when
  anything was timed, ``"skipped"`` when the time budget left everything out (``--resume`` runs it), else
  ``"failed"``; ``agree`` whether every timed contestant agreed.
  """
  timed = [r for r in records if "median_ms" in r]
  base = [r for r in timed if r["role"] == "baseline" and r.get("numerics_ok", True)]
  best = min(base, key=lambda r: r["median_ms"], default=None)
  for r in timed:
    if best is not None:
      r["ratio_to_best_baseline"] = best["median_ms"] / r["median_ms"]
    if floor_ms:
      r["floor_fraction"] = floor_ms / r["median_ms"]
    if flops_per_device:
      r["tflops_per_device"] = flops_per_device / (r["median_ms"] * 1e-3) / 1e12
  late = [r["name"] for r in records if r.get("out_of_time")]
  case.update(contestants=records, reference=reference, best_baseline=best and best["name"],
              best_baseline_ms=best and best["median_ms"], agree=all(r.get("numerics_ok", True) for r in records))
  if late:
    case["out_of_time"] = late
  case["status"] = "ok" if timed else ("skipped" if late else "failed")
  if case["status"] == "skipped":
    case["skipped"] = OUT_OF_TIME
  return case


def mark(what: str, value: float, *, at_most: float | None = None, at_least: float | None = None) -> dict:
  """A case's mark: ``what`` measured ``value``, its bound, and whether it was met."""
  met = (at_most is None or value <= at_most) and (at_least is None or value >= at_least)
  bound = {"at_most": at_most} if at_most is not None else {"at_least": at_least}
  return {"what": what, "value": round(value, 3), **bound, "met": met}


def finished(case: dict) -> bool:
  """Whether ``--resume`` keeps a case: it ran, and nothing of it was left out for time."""
  return case.get("status") in ("ok", "failed") and not case.get("out_of_time")


# ------------------------------------------------------------------ inputs, meshes, floors


def make_mesh(spec: str, axis_type: AxisType = AxisType.Auto):
  """``""``: one level ``"gpu"`` over every device; ``"8"``: one level of 8; ``"2x4"``: levels ``node`` x ``gpu``;
  every level of ``axis_type``."""
  shape = (len(jax.devices()),) if not spec else tuple(int(p) for p in spec.lower().split("x"))
  if len(shape) not in (1, 2) or min(shape) < 1 or math.prod(shape) > len(jax.devices()):
    raise ValueError(f"mesh {spec!r}: expected N or AxB of at most {len(jax.devices())} devices")
  names = ("gpu",) if len(shape) == 1 else ("node", "gpu")
  return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape),
                       devices=jax.devices()[:math.prod(shape)])


def random_array(key, shape, dtype, sharding):
  """Fresh normal values of ``shape`` generated in place with ``sharding`` (no host copy)."""
  return jax.jit(lambda k: jax.random.normal(k, shape, jnp.float32).astype(dtype), out_shardings=sharding)(key)


def time_call(fn, args, *, iters: int = 5, stat=statistics.median) -> float:
  """``stat`` of the ms of ``fn(*args)`` over ``iters`` runs after one warm-up run."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append((time.perf_counter() - t0) * 1e3)
  return stat(times)


def link_bandwidth(mesh, nbytes: int) -> dict:
  """One ``ppermute`` of ``nbytes`` per device around a ring over every device of ``mesh``: bytes sent per second."""
  axis = mesh.axis_names[0] if len(mesh.axis_names) == 1 else tuple(mesh.axis_names)
  n = mesh.devices.size
  fn = jax.jit(jax.shard_map(lambda x: jax.lax.ppermute(x, axis, [(i, (i + 1) % n) for i in range(n)]), mesh=mesh,
                             in_specs=P(axis), out_specs=P(axis), check_vma=False))
  per = max(nbytes // 4, 1)
  ms = time_call(fn, (jax.device_put(jnp.ones((n * per,), jnp.float32), NamedSharding(mesh, P(axis))),), iters=10)
  return {"bytes_per_device": per * 4, "ms": ms, "bytes_per_s": per * 4 / (ms * 1e-3)}


def floor_record(*, compute_ms: float | None, compute_how: str, comm_bytes: float, link: dict | None,
                 comm_how: str) -> dict:
  """The physical floor: the larger of this device's compute time and the time of the fewest bytes it receives."""
  comm_ms = comm_bytes / link["bytes_per_s"] * 1e3 if link else None
  out = {"compute_ms": compute_ms, "compute_how": compute_how, "comm_bytes_per_device": comm_bytes,
         "comm_ms": comm_ms, "comm_how": comm_how}
  if compute_ms is not None and comm_ms is not None:
    out["floor_ms"] = max(compute_ms, comm_ms)
    out["bound"] = "compute" if compute_ms >= comm_ms else "communication"
  return out


# ------------------------------------------------------------------ the results file


def commit() -> str | None:
  """``$JAXMERCURY_COMMIT`` where set (a copy of the working tree on a GPU machine, whose git metadata, if any, may
  be stale), else the git commit the code was run at (``-dirty`` with uncommitted changes); None when neither
  says."""
  if os.environ.get("JAXMERCURY_COMMIT"):
    return os.environ["JAXMERCURY_COMMIT"]
  try:
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True, timeout=10)
    if head.returncode == 0:
      return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
  except (OSError, subprocess.SubprocessError):
    pass
  return None


def header(suite: str, argv: list[str], **fields) -> dict:
  """A results file's first fields: what ran where, when, at which commit, by which command."""
  dev = jax.devices()[0]
  return {"schema": SCHEMA, "suite": suite,
          "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
          "device": dev.device_kind, "platform": dev.platform, "n_devices": len(jax.devices()),
          "jax_version": jax.__version__, "jaxlib_version": jaxlib.__version__,
          "jaxmercury_version": jaxmercury.__version__, "python": platform.python_version(), "commit": commit(),
          "command": "python -m benchmarks.run " + " ".join(argv), **fields}


def write_json(path: str, data: dict):
  """Writes ``data`` atomically (a run cut short leaves a readable file)."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(f"{path}.tmp", "w", encoding="utf-8") as f:
    json.dump(data, f, indent=1)
  os.replace(f"{path}.tmp", path)
