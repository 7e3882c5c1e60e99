"""Compiling, checking and timing one candidate schedule."""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import numpy as np

OK, PRUNED, FAILED = "ok", "pruned", "failed"


@dataclasses.dataclass
class Measurement:
  """The outcome of one candidate: its time, or why it was not timed.

  ``status`` is ``ok`` (checked and timed), ``pruned`` (not compiled: over
  the memory budget, or ranked below the timed few by the cost model) or
  ``failed`` (compile or run error, time-out, NaN, or a result that differs
  from the reference); ``reason`` says which.
  """

  status: str
  median_ms: float | None = None
  times_ms: list[float] = dataclasses.field(default_factory=list)
  rel_err: float | None = None
  reason: str = ""
  compiled_bytes: int | None = None  # from compiled.memory_analysis(), where available


def tolerance(dtype) -> float:
  """Relative Frobenius error allowed for outputs of this dtype."""
  return 2e-2 if np.dtype(dtype).itemsize <= 2 else 1e-4


def rel_err(y, ref) -> float:
  y = np.asarray(jax.device_get(y), np.float64)
  ref = np.asarray(jax.device_get(ref), np.float64)
  denom = np.linalg.norm(ref)
  return float(np.linalg.norm(y - ref) / (denom if denom else 1.0))


def _first_line(e: BaseException) -> str:
  text = str(e).strip().splitlines()
  return f"{type(e).__name__}: {text[0][:300] if text else ''}"


def compiled_memory(compiled) -> int | None:
  """Peak bytes per device XLA reports for a compiled program, if it reports any."""
  try:
    m = compiled.memory_analysis()
  except Exception:  # noqa: BLE001 - not every backend reports memory
    return None
  if m is None:
    return None
  return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
             - m.alias_size_in_bytes)


def place_inputs(schedule, inputs):
  """Inputs laid out as the schedule stores them, so that timing excludes the move."""
  if not isinstance(schedule.mesh, jax.sharding.Mesh):
    return inputs
  from jax.sharding import NamedSharding, PartitionSpec
  plan = schedule.plan()
  out = []
  for b, x in zip(schedule.program.reads, inputs):
    spec = plan.user_spec(b.name)
    out.append(jax.device_put(x, NamedSharding(schedule.mesh, spec if spec is not None else PartitionSpec())))
  return jax.block_until_ready(out)


def measure(schedule, inputs, reference, *, warmup: int = 2, iters: int = 10,
            time_limit_s: float | None = None) -> Measurement:
  """Compiles ``schedule``, checks it against ``reference``, then times it.

  A candidate that fails to compile or run, or whose compile and first run
  exceed ``time_limit_s``, is ``failed``; inputs are first placed in the
  layout the schedule stores them in (``place_inputs``); so is one whose output is not finite
  or differs from the reference beyond the dtype's tolerance, and it is never
  timed. Times are wall clock around ``block_until_ready`` (device-side
  completion), after ``warmup`` runs; the median of ``iters`` counts.
  """
  start = time.perf_counter()
  try:
    inputs = place_inputs(schedule, inputs)
    compiled = schedule.compile().lower(*inputs).compile()
    y = jax.block_until_ready(compiled(*inputs))
  except Exception as e:  # noqa: BLE001 - a candidate's failure is data, not a crash
    return Measurement(FAILED, reason=_first_line(e))
  nbytes = compiled_memory(compiled)
  if time_limit_s is not None and time.perf_counter() - start > time_limit_s:
    return Measurement(FAILED, reason=f"time-out: compile and first run took over {time_limit_s:g} s",
                       compiled_bytes=nbytes)
  if not np.all(np.isfinite(np.asarray(jax.device_get(y), np.float32))):
    return Measurement(FAILED, reason="output has NaN or Inf", compiled_bytes=nbytes)
  err = rel_err(y, reference)
  tol = tolerance(schedule.program.writes.dtype)
  if err > tol:
    return Measurement(FAILED, rel_err=err, reason=f"wrong result: relative error {err:.2e} above {tol:.0e}",
                       compiled_bytes=nbytes)
  for _ in range(warmup):
    jax.block_until_ready(compiled(*inputs))
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*inputs))
    times.append((time.perf_counter() - t0) * 1e3)
  return Measurement(OK, statistics.median(times), times, err, compiled_bytes=nbytes)
