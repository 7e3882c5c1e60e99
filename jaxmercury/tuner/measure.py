"""Compiling, checking and timing one candidate schedule."""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import numpy as np

OK, FAILED, WRONG = "ok", "failed", "wrong"


@dataclasses.dataclass
class Measurement:
  """The outcome of one candidate: its time, or why it was rejected."""

  status: str
  median_ms: float | None = None
  times_ms: list[float] = dataclasses.field(default_factory=list)
  rel_err: float | None = None
  reason: str = ""


def tolerance(dtype) -> float:
  """Relative Frobenius error allowed for outputs of this dtype."""
  return 2e-2 if np.dtype(dtype).itemsize <= 2 else 1e-4


def rel_err(y, ref) -> float:
  y = np.asarray(jax.device_get(y), np.float64)
  ref = np.asarray(jax.device_get(ref), np.float64)
  denom = np.linalg.norm(ref)
  return float(np.linalg.norm(y - ref) / (denom if denom else 1.0))


def measure(schedule, inputs, reference, *, warmup: int = 2, iters: int = 10) -> Measurement:
  """Compiles ``schedule``, checks it against ``reference``, then times it.

  A candidate that fails to compile or run is ``failed``; one whose output
  is not finite or differs from the reference beyond the dtype's tolerance is
  ``wrong`` and never timed. Times are wall clock around
  ``block_until_ready``, after ``warmup`` runs; the median of ``iters`` counts.
  """
  try:
    fn = schedule.compile()
    y = jax.block_until_ready(fn(*inputs))
  except Exception as e:  # noqa: BLE001 - a candidate's failure is data, not a crash
    return Measurement(FAILED, reason=f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
  if not np.all(np.isfinite(np.asarray(jax.device_get(y), np.float32))):
    return Measurement(WRONG, reason="output has NaN or Inf")
  err = rel_err(y, reference)
  tol = tolerance(schedule.program.writes.dtype)
  if err > tol:
    return Measurement(WRONG, rel_err=err, reason=f"relative error {err:.2e} above {tol:.0e}")
  for _ in range(warmup):
    jax.block_until_ready(fn(*inputs))
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*inputs))
    times.append((time.perf_counter() - t0) * 1e3)
  return Measurement(OK, statistics.median(times), times, err)
