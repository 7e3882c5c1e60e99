"""``python -m jaxmercury.tuner.worker``: measure one candidate in a process of its own.

Reads one JSON request on stdin (see ``watchdog.worker_request``): the
program's shipped factory and parameters, the mesh shape, the schedule's
trace (or a plain program's description, ``tuner.plain``), a seed, timing
counts, whether to time a training step, and modules to import (ones that
register the candidate's kernel). The trace is replayed through the public primitives;
nothing in the request is executed. Progress goes to stdout as lines
``jaxmercury-worker: ready``, ``... checked <first run seconds>`` and
``... result <measurement JSON>``; the parent kills the process at its limit.
"""

from __future__ import annotations

import importlib
import json
import sys

import jax
from jax.sharding import AxisType

from jaxmercury import programs
from jaxmercury.tuner import measure
from jaxmercury.tuner.plain import runnable_from_json
from jaxmercury.tuner.reference import trial

PREFIX = "jaxmercury-worker:"


def _say(event: str, data: str = ""):
  print(f"{PREFIX} {event} {data}".rstrip(), flush=True)


def _failure(reason: str) -> str:
  return json.dumps({"status": "failed", "reason": reason})


def run(request: dict) -> str:
  """Measures the requested candidate; returns the measurement as JSON."""
  for module in request.get("imports", []):
    importlib.import_module(module)
  spec = request["program"]
  if spec["factory"] not in programs.__all__:
    return _failure(f"worker: {spec['factory']!r} is not a shipped program factory")
  program = getattr(programs, spec["factory"])(**spec["params"])
  if program.fingerprint() != request["fingerprint"]:
    return _failure("worker: the rebuilt program differs from the tuner's")
  names, sizes = tuple(request["mesh"]["names"]), tuple(request["mesh"]["sizes"])
  n = 1
  for s in sizes:
    n *= s
  mesh = jax.make_mesh(sizes, names, axis_types=(AxisType.Auto,) * len(sizes), devices=jax.devices()[:n])
  schedule = runnable_from_json(program, mesh, request["trace"])
  inputs, cotangent, reference = trial(program, request["seed"], mesh.devices.flat[0],
                                      training=bool(request.get("training")))
  jax.block_until_ready(reference)
  _say("ready")
  result = measure.measure(schedule, inputs, reference, warmup=request["warmup"], iters=request["iters"],
                           on_checked=lambda run_s: _say("checked", f"{run_s:.6f}"), cotangent=cotangent)
  return json.dumps(result.to_dict())


def main() -> int:
  try:
    request = json.loads(sys.stdin.read())
    text = run(request)
  except Exception as e:
    first = (str(e).strip().splitlines() or [""])[0][:300]
    text = _failure(f"{type(e).__name__}: {first}")
  _say("result", text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
