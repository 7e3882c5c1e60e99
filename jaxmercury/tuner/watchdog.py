"""Hard time limits for candidates: a watchdog thread, or a worker process that is killed.

``timeout.run_limited`` runs a function in a daemon thread and stops waiting for it at
the limit. Python cannot interrupt XLA, so an abandoned candidate keeps its
thread, and if it hangs on the devices it holds their queues: later
candidates wait behind it (on CPU as on GPU) and time out in turn, and the
process may not exit cleanly. The search goes on and reports it, but only a
worker process can be stopped for good.

``measure_in_worker`` runs a candidate in a child process
(``python -m jaxmercury.tuner.worker``) that is killed at the limit: a hang
cannot outlive it. The child receives data only: the program's factory name
and parameters, the mesh shape, the schedule's trace (JSON), a seed, and the
names of modules that register the candidate's kernel.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import jax

from jaxmercury import programs
from jaxmercury._cpu_flags import cpu_flags
from jaxmercury.kernels import registry
from jaxmercury.tuner import measure as measure_module

PREFIX = "jaxmercury-worker:"


# ------------------------------------------------------------------ worker processes
def program_factory(program) -> dict | None:
  """``{"factory": name, "params": ...}`` if a shipped factory rebuilds ``program`` exactly, else None."""
  name = program.pattern
  factory = getattr(programs, name, None) if name in getattr(programs, "__all__", ()) else None
  if factory is None:
    return None
  try:
    rebuilt = factory(**program.params)
  except Exception:
    return None
  if rebuilt.fingerprint() != program.fingerprint():
    return None
  return {"factory": name, "params": dict(program.params)}


def kernel_modules(schedule) -> list[str]:
  """Modules a worker imports so that the schedule's kernel is registered there too."""
  if not schedule.kernel:
    return []
  make = registry.kernel(schedule.kernel).make
  module = getattr(make, "__module__", None) or ""
  return [] if not module or module.startswith("jaxmercury") or module == "__main__" else [module]


def worker_request(schedule, seed: int, *, iters: int, warmup: int, training: bool = False) -> dict | None:
  """What a worker needs to rebuild and measure ``schedule`` (``training``: its training step), as data; None if
  it cannot."""
  spec = program_factory(schedule.program)
  if spec is None or not isinstance(schedule.mesh, jax.sharding.Mesh):
    return None
  mesh = schedule.mesh
  return {"program": spec, "fingerprint": schedule.program.fingerprint(),
          "mesh": {"names": list(mesh.shape), "sizes": list(mesh.shape.values())},
          "platform": mesh.devices.flat[0].platform, "trace": schedule.to_json(), "seed": int(seed),
          "iters": int(iters), "warmup": int(warmup), "imports": kernel_modules(schedule),
          "training": bool(training)}


def _environment(request) -> dict:
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
  env["JAX_PLATFORMS"] = request["platform"]
  if request["platform"] == "cpu":
    n = 1
    for s in request["mesh"]["sizes"]:
      n *= s
    env["XLA_FLAGS"] = cpu_flags(env.get("XLA_FLAGS", ""), n)
  else:
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  return env


def measure_in_worker(schedule, seed: int, *, iters: int = 10, warmup: int = 2,
                      time_limit_s: float | None = None, start_limit_s: float = 300.0, training: bool = False):
  """Measures ``schedule`` (``training``: its training step) in a child process that is killed at the time limit.

  The child builds the inputs (and cotangent) from ``seed`` and its own reference (``reference.trial``). Its
  compile and first run get ``time_limit_s`` (from the moment it is ready);
  the timed runs get as long again plus ten times their expected length.

  Returns:
    The ``Measurement``, or None when the schedule cannot be rebuilt in a
    worker (a program no shipped factory makes, or an abstract mesh).
  """
  request = worker_request(schedule, seed, iters=iters, warmup=warmup, training=training)
  if request is None:
    return None
  proc = subprocess.Popen([sys.executable, "-m", "jaxmercury.tuner.worker"], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=_environment(request), start_new_session=True)
  lines: queue.Queue = queue.Queue()
  errors: list[str] = []
  threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True).start()
  stderr = threading.Thread(target=_keep_tail, args=(proc.stderr, errors), daemon=True)
  stderr.start()
  try:
    proc.stdin.write(json.dumps(request))
    proc.stdin.close()
    started = time.monotonic()
    event, data = _next_event(lines, start_limit_s)
    if event is None:
      return _failed(f"worker did not start within {start_limit_s:g} s", proc, stderr, errors)
    limit = time_limit_s
    while event != "result":
      if event == "eof":
        return _failed(f"worker died (exit status {proc.wait()})", proc, stderr, errors)
      if event == "checked":
        run_s = float(data)
        limit = None if time_limit_s is None else time_limit_s + 10 * (warmup + iters) * run_s
      event, data = _next_event(lines, limit)
      if event is None:
        phase = "timed runs" if limit != time_limit_s else "compile and first run"
        return measure_module.Measurement(
            measure_module.FAILED, reason=f"time-out: {phase} took over {limit:.3g} s (worker killed after "
                                          f"{time.monotonic() - started:.1f} s)")
    return measure_module.Measurement.from_dict(json.loads(data))
  finally:
    _kill(proc)


def _pump(stream, lines: queue.Queue):
  for line in stream:
    if line.startswith(PREFIX):
      event, _, data = line[len(PREFIX):].strip().partition(" ")
      lines.put((event, data))
  lines.put(("eof", ""))


def _keep_tail(stream, tail: list):
  for line in stream:
    tail.append(line.rstrip())
    del tail[:-20]


def _next_event(lines: queue.Queue, limit_s: float | None):
  try:
    return lines.get(timeout=limit_s)
  except queue.Empty:
    return None, None


def _failed(what: str, proc, stderr: threading.Thread, errors: list):
  _kill(proc)
  stderr.join(2.0)
  last = next((e for e in reversed(errors) if e.strip()), "")
  return measure_module.Measurement(measure_module.FAILED, reason=f"{what}{': ' + last[:300] if last else ''}")


def _kill(proc):
  if proc.poll() is None:
    try:
      os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
      proc.kill()
  proc.wait()
