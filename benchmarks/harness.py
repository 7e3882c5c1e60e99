"""Timing, numerical agreement and the physical floor, shared by the benchmark suites.

Every contestant of a case is a jitted function of the same global inputs,
placed once in the callers' layout. ``prepare`` compiles each one, runs it
once, compares that output with the reference contestant's (the first to
run), and warms it up; ``time_interleaved`` then times them in rounds, one
call of each per round in a rotating order, so that drift of the machine
(clocks, temperature) spreads over all of them. A contestant that fails
(compile error, out of memory, a run error) is recorded with its error and
the case goes on.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import time
import traceback
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmercury.tuner import measure

from benchmarks.report import OUT_OF_TIME, out_of_time  # noqa: F401  (re-exported for the runners)

BF16_TOLERANCE = 2e-2  # relative Frobenius error allowed between bf16 outputs


def log(text: str):
  print(text, flush=True)


def run_header(module: str, argv) -> dict:
  """A results file's first fields: the device, how many, jax's version, the date (UTC) and the command that
  ran ``benchmarks.<module>`` (``argv``: its arguments, None for the process's own)."""
  import datetime
  import sys
  args = sys.argv[1:] if argv is None else argv
  return {"device": jax.devices()[0].device_kind, "n_devices": len(jax.devices()), "jax_version": jax.__version__,
          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "command": f"python -m benchmarks.{module} " + " ".join(args)}


def failed_contestants(cases) -> list[str]:
  """Names of the records of ``cases`` that failed or disagree (a ``previous`` contestant's are not counted)."""
  return [r["name"] for c in cases for r in c["records"]
          if r["role"] != "previous" and ("error" in r or r.get("numerics_ok") is False)]


def error_text(exc: BaseException) -> str:
  """The exception's type and most telling line; an out-of-memory is named as such."""
  lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
  oom = next((ln for ln in lines if "RESOURCE_EXHAUSTED" in ln or "Out of memory" in ln
              or "out of memory" in ln), None)
  if oom is not None:
    return f"out of memory: {type(exc).__name__}: {oom[:300]}"
  return f"{type(exc).__name__}: {(lines[0] if lines else '')[:300]}"


def is_oom(text: str | None) -> bool:
  return bool(text) and text.startswith("out of memory")


@dataclasses.dataclass
class Contestant:
  """One implementation timed in a case.

  Attributes:
    name: its key in the results (``"jaxmercury"``, ``"ring"``, ...).
    role: ``"jaxmercury"`` or ``"baseline"``.
    build: returns the jitted function of the case's inputs (called once).
    label: what it is, in words.
    skip: a reason not to run it (recorded instead of a time).
    record: extra fields for its result record.
  """

  name: str
  role: str
  build: Callable[[], Callable] | None
  label: str = ""
  skip: str | None = None
  record: dict = dataclasses.field(default_factory=dict)


def compiled_bytes(compiled) -> int | None:
  """Peak bytes per device XLA reports for a compiled function (the tuner's measure)."""
  return measure.compiled_memory(compiled)


@dataclasses.dataclass
class Ready:
  fn: Callable
  iters: int


@dataclasses.dataclass
class Prepared:
  """What ``prepare`` leaves: the runnable contestants, every record, and the reference output."""

  ready: dict  # name -> Ready, in run order
  records: dict  # name -> result record, in the contestants' order
  reference: str | None = None  # the contestant every other output is compared with
  reference_output: object = None


def prepare(contestants, inputs, *, warmup: int, iters: int, max_timing_s: float, order=(),
            deadline: float | None = None, tolerance: float = BF16_TOLERANCE) -> Prepared:
  """Compiles, runs and warms up every contestant, checking each first output against the reference.

  Contestants run in ``order`` (names first to last, the rest after); the
  first that runs becomes the reference, and every later output is compared
  with it as soon as it exists (``check`` below), so agreement costs no extra
  runs and only the reference's output is held. Failures and skips become
  records. A contestant whose first run takes long gets fewer timed runs:
  as many as fit ``max_timing_s``, at least 3 (and one warm-up run).
  """
  records = {c.name: {"name": c.name, "role": c.role, "label": c.label, **c.record} for c in contestants}
  rank = {name: i for i, name in enumerate(order)}
  out = Prepared({}, records)
  for c in sorted(contestants, key=lambda c: rank.get(c.name, len(rank))):
    rec = records[c.name]
    if c.skip:
      rec["skipped"] = c.skip
      log(f"  skip  {c.name}: {c.skip}")
      continue
    if deadline is not None and time.time() > deadline:
      rec["skipped"], rec["out_of_time"] = OUT_OF_TIME, True
      log(f"  skip  {c.name}: {OUT_OF_TIME}")
      continue
    try:
      t0 = time.perf_counter()
      fn = c.build()
      compiled = fn.lower(*inputs).compile() if hasattr(fn, "lower") else fn
      rec["compile_s"] = round(time.perf_counter() - t0, 3)
      rec["memory_bytes"] = compiled_bytes(compiled)
      t1 = time.perf_counter()
      y = jax.block_until_ready(compiled(*inputs))
      first = time.perf_counter() - t1
      check(out, c.name, y, tolerance)
      del y
      for _ in range((warmup if first < 1.0 else 1) - 1):
        jax.block_until_ready(compiled(*inputs))
      n = max(3, min(iters, int(max_timing_s / max(first, 1e-6))))
      out.ready[c.name] = Ready(compiled, n)
      log(f"  ready {c.name} (compile {rec['compile_s']:.2f} s, first run {first * 1e3:.2f} ms, "
          f"{n} timed runs{_agreement(rec)})")
    except Exception as exc:  # noqa: BLE001 - a contestant's failure is data
      rec["error"] = error_text(exc)
      log(f"  ERROR {c.name}: {rec['error']}")
      if not is_oom(rec["error"]):
        traceback.print_exc(limit=4)
  return out


def _agreement(rec) -> str:
  if "rel_err" not in rec:
    return ""
  return f", rel err {rec['rel_err']:.1e}" + ("" if rec["numerics_ok"] else " DISAGREES")


def check(prepared: Prepared, name: str, y, tolerance: float = BF16_TOLERANCE):
  """Compares ``y`` (``name``'s output, an array or a tuple of them) with the reference's; the first output
  checked becomes it.

  The record gets ``rel_err`` (relative Frobenius error, float32; of a tuple,
  the largest of its arrays') and ``numerics_ok``: false when it is not
  finite or not below ``tolerance`` (the contestant keeps its time, flagged).
  """
  rec = prepared.records[name]
  if prepared.reference is None:
    prepared.reference, prepared.reference_output = name, y
    rec["rel_err"] = 0.0
    rec["numerics_ok"] = all(bool(jnp.all(jnp.isfinite(x.astype(jnp.float32)))) for x in jax.tree.leaves(y))
    return
  ref = prepared.reference_output
  shapes = lambda tree: jax.tree.map(lambda x: x.shape, tree)  # noqa: E731
  if shapes(y) != shapes(ref):
    raise ValueError(f"output shape {shapes(y)} differs from the reference's {shapes(ref)}")
  ys, refs = jax.tree.leaves(y), jax.tree.leaves(ref)
  err = max(float(rel_err(a, b)) for a, b in zip(ys, refs))
  rec["rel_err"] = err
  rec["numerics_ok"] = bool(math.isfinite(err) and err < tolerance)
  if not rec["numerics_ok"]:
    log(f"  !!! {name} disagrees with {prepared.reference}: relative error {err:.3e} (tolerance {tolerance})")


def time_interleaved(ready: dict, records: dict, inputs) -> dict[str, list[float]]:
  """Times the ready contestants in rounds (rotating order); name -> per-call ms.

  A contestant stops when it has its own count of runs; one that fails is
  dropped with its error recorded.
  """
  def dropped(name, exc):
    records[name]["error"] = error_text(exc)
    log(f"  ERROR while timing {name}: {records[name]['error']}")
    del ready[name]

  return measure.rounds({name: functools.partial(r.fn, *inputs) for name, r in ready.items()},
                        {name: r.iters for name, r in ready.items()}, on_error=dropped)


@jax.jit
def rel_err(a, b):
  """``||a - b|| / ||b||`` (Frobenius), in float32, on the devices."""
  a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  return jnp.linalg.norm(a - b) / jnp.linalg.norm(b)


# ------------------------------------------------------------ across processes

SKETCH_RANK = 16
SKETCH_TOLERANCE = 1e-4  # relative difference between sketches of the same array (summation order)


@jax.jit
def _sketch_block(a, y, b):
  hi = jax.lax.Precision.HIGHEST
  return jnp.dot(jnp.dot(a, y.astype(jnp.float32), precision=hi), b, precision=hi)


def sketch(y, rank: int = SKETCH_RANK) -> list[list[float]]:
  """A fingerprint of a 2-D global array that another process can compare: ``A @ y @ B``.

  ``A`` (``rank x M``) and ``B`` (``N x rank``) are fixed Gaussian matrices
  (the same in every process). Each distinct shard is sketched on its own
  device with its slices of ``A`` and ``B`` and the parts are summed on the
  host: no collective and no partitioned dot, so XLA flags that change how
  sharded dots compile (the windowed-einsum ones) do not touch it. For
  Gaussian ``A`` and ``B``, ``sketch_rel_err`` of two arrays' sketches
  estimates the relative Frobenius error between the arrays.

  Returns:
    The ``rank x rank`` sketch as nested lists (float64 values, JSON-ready).
  """
  m, n = y.shape
  rng = np.random.default_rng(20261122)
  a = rng.standard_normal((rank, m)).astype(np.float32)
  b = rng.standard_normal((n, rank)).astype(np.float32)
  total = np.zeros((rank, rank))
  seen = set()
  for shard in y.addressable_shards:
    rows, cols = (range(*s.indices(size)) for s, size in zip(shard.index, (m, n)))
    where = (rows.start, rows.stop, cols.start, cols.stop)
    if where in seen:  # a replica of a block already counted
      continue
    seen.add(where)
    dev = shard.device
    part = _sketch_block(jax.device_put(a[:, rows.start:rows.stop], dev), shard.data,
                         jax.device_put(b[cols.start:cols.stop], dev))
    total += np.asarray(part, np.float64)
  return total.tolist()


def sketch_rel_err(got, reference) -> float:
  """``||got - reference|| / ||reference||`` of two sketches (``sketch``)."""
  got, reference = np.asarray(got, np.float64), np.asarray(reference, np.float64)
  return float(np.linalg.norm(got - reference) / np.linalg.norm(reference))


@functools.partial(jax.jit, static_argnums=2)
def _block_sums(y, ref, blocks):
  m, n = ref.shape
  y = y.astype(jnp.float32).reshape(blocks, m // blocks, blocks, n // blocks)
  ref = ref.astype(jnp.float32).reshape(blocks, m // blocks, blocks, n // blocks)
  return ((y - ref) ** 2).sum((1, 3)), (y ** 2).sum((1, 3)), (ref ** 2).sum((1, 3))


def block_errors(y, ref, blocks: int) -> dict | None:
  """Where two 2-D outputs differ: per block of a ``blocks x blocks`` grid, rel err and norm ratio.

  A norm ratio of 0 is a block left empty (zeros), 1 with a large error a
  block holding other values. None when the shape does not split evenly.
  """
  m, n = ref.shape
  if blocks < 1 or m % blocks or n % blocks:
    return None
  err, norm_y, norm_ref = (np.asarray(x, np.float64) for x in _block_sums(y, ref, blocks))

  def relative(sq):
    return np.round(np.sqrt(sq / np.maximum(norm_ref, 1e-30)), 3).tolist()

  return {"grid": f"{blocks} x {blocks} blocks of [{m // blocks}, {n // blocks}] (rows x columns)",
          "rel_err": relative(err), "norm_ratio": relative(norm_y)}


def summarize(records: dict, times: dict):
  """Median, min and the per-call times into each record."""
  for name, t in times.items():
    if t:
      rec = records[name]
      rec["median_ms"] = statistics.median(t)
      rec["min_ms"] = min(t)
      rec["times_ms"] = [round(x, 4) for x in t]


def rank(records: list[dict], floor_ms: float | None, flops_per_device: float | None):
  """Adds each record's ratio to the best baseline, fraction of the floor and TFLOP/s.

  ``ratio_to_best_baseline`` is the best baseline's median over this
  record's (above 1: faster than every baseline). Only timed records whose
  numbers agree (or were not checked) count as the best baseline.

  Returns:
    The best baseline's record, or None.
  """
  timed = [r for r in records if "median_ms" in r and r.get("numerics_ok", True)
           and "error" not in r]
  base = [r for r in timed if r["role"] == "baseline"]
  best = min(base, key=lambda r: r["median_ms"], default=None)
  for r in records:
    if "median_ms" not in r:
      continue
    if best is not None:
      r["ratio_to_best_baseline"] = best["median_ms"] / r["median_ms"]
    if floor_ms:
      r["floor_fraction"] = floor_ms / r["median_ms"]
    if flops_per_device:
      r["tflops_per_device"] = flops_per_device / (r["median_ms"] * 1e-3) / 1e12
  return best


# ------------------------------------------------------------------ floor


def time_call(fn, args, *, iters: int = 5, max_s: float = 10.0, stat=statistics.median) -> float:
  """``stat`` (default the median) of the ms of ``fn(*args)`` after one warm-up run (fewer runs for slow calls)."""
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  first = time.perf_counter() - t0
  times = []
  for _ in range(max(2, min(iters, int(max_s / max(first, 1e-6))))):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append((time.perf_counter() - t0) * 1e3)
  return stat(times)


def random_array(key, shape, dtype, sharding):
  """Fresh normal values of ``shape`` generated in place with ``sharding`` (no host copy)."""
  make = jax.jit(lambda k: jax.random.normal(k, shape, jnp.float32).astype(dtype), out_shardings=sharding)
  return make(key)


def link_bandwidth(mesh, nbytes: int, iters: int = 10) -> dict:
  """One ``ppermute`` of ``nbytes`` per device around a ring over every device of ``mesh``.

  Returns:
    ``{"bytes_per_device", "ms", "bytes_per_s"}`` (bytes each device sends per second).
  """
  levels = tuple(mesh.axis_names)
  axis = levels[0] if len(levels) == 1 else levels
  n = mesh.devices.size
  spec = P(axis)
  perm = [(i, (i + 1) % n) for i in range(n)]
  fn = jax.jit(jax.shard_map(lambda x: jax.lax.ppermute(x, axis, perm), mesh=mesh, in_specs=spec,
                             out_specs=spec, check_vma=False))
  per = max(nbytes // 4, 1)
  x = jax.block_until_ready(jax.device_put(jnp.ones((n * per,), jnp.float32), NamedSharding(mesh, spec)))
  ms = time_call(fn, (x,), iters=iters)
  del x
  return {"bytes_per_device": per * 4, "ms": ms, "bytes_per_s": per * 4 / (ms * 1e-3)}


def compute_floor(fn, shapes, dtype, device, key) -> float:
  """The fastest of 20 runs of ``fn`` on one device (ms), with fresh normal inputs of ``shapes``.

  The fastest, not the median: a floor must not be raised by a slow outlier
  (a median of a few runs once doubled a 0.5 ms GEMM's floor).
  """
  sharding = jax.sharding.SingleDeviceSharding(device)
  keys = jax.random.split(key, len(shapes))
  args = [random_array(k, s, dtype, sharding) for k, s in zip(keys, shapes)]
  try:
    return time_call(jax.jit(fn), args, iters=20, stat=min)
  finally:
    del args


def floor_record(*, compute_ms: float | None, compute_how: str, comm_bytes: float, link: dict | None,
                 comm_how: str) -> dict:
  """The physical floor: the larger of compute and communication time."""
  comm_ms = comm_bytes / link["bytes_per_s"] * 1e3 if link else None
  parts = [x for x in (compute_ms, comm_ms) if x is not None]
  out = {"compute_ms": compute_ms, "compute_how": compute_how, "comm_bytes_per_device": comm_bytes,
         "comm_ms": comm_ms, "comm_how": comm_how}
  if len(parts) == 2:
    out["floor_ms"] = max(parts)
    out["bound"] = "compute" if compute_ms >= comm_ms else "communication"
  return out


def make_mesh(spec: str):
  """``""``: one level ``"gpu"`` over every device; ``"8"``: one level of 8; ``"2x4"``: levels ``("node", "gpu")``."""
  from jax.sharding import AxisType
  shape = (len(jax.devices()),) if not spec else tuple(int(p) for p in spec.lower().split("x"))
  if len(shape) not in (1, 2) or min(shape) < 1:
    raise ValueError(f"mesh {spec!r}: expected N or AxB")
  names = ("gpu",) if len(shape) == 1 else ("node", "gpu")
  count = math.prod(shape)
  if count > len(jax.devices()):
    raise ValueError(f"mesh {spec!r} needs {count} devices; there are {len(jax.devices())}")
  return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape), devices=jax.devices()[:count])
