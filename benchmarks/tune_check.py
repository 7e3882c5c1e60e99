"""Tunes attention and GEMM on this machine and checks the tuner against the library.

For each case: ``autotune`` (timing the cost model's best ``--top``), then every
library strategy not timed by the tuner is timed in the same process with
each applicable kernel; the report gives the tuner's wall time, the winner
against the fastest library strategy, and the Spearman correlation between
predicted and measured times over all timed candidates.

  python -m benchmarks.tune_check --out results.json [--smoke]
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

import jaxmercury as jm  # noqa: E402
from jaxmercury.tuner import cost, measure  # noqa: E402
from jaxmercury.tuner.autotuner import Candidate, default_candidates, with_layouts  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402


def spearman(a, b) -> float:
  ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
  return float(np.corrcoef(ra, rb)[0, 1])


def run_case(label, prog, mesh, layouts, top, iters):
  db = jm.Database(os.path.join(tempfile.mkdtemp(), "tune.db"))
  t0 = time.perf_counter()
  result = jm.autotune(prog, mesh, top_k=top, iters=iters, database=db, space=16,
                       in_shardings=layouts[0], out_sharding=layouts[1], log=lambda s: print(s, flush=True))
  tune_s = time.perf_counter() - t0
  timed = {c.schedule.to_json(): c for c in result.candidates if c.result and c.status != "pruned"}
  key = jax.random.key(1)
  inputs = prog.random_inputs(key)
  reference = None
  library_rows = []
  lib_names = set(jm.library(prog, mesh))
  for name, s in default_candidates(prog, mesh, space=0):
    s = with_layouts(s, *layouts)
    base = name.split(" [")[0]
    if base not in lib_names:
      continue
    c = timed.get(s.to_json())
    if c is None:
      if reference is None:
        reference = timed_reference(prog, result, inputs)
      c = Candidate(name, s, cost.predict(s, result.machine) * 1e3, jm.tuner.memory_per_device(s))
      c.result = measure.measure(s, inputs, reference, iters=iters)
      print(f"  library {name:<40} {c.status} {c.time_ms}", flush=True)
    library_rows.append(c)
  extra = [c for c in library_rows if c.schedule.to_json() not in timed]
  measured = [c for c in result.candidates + extra if c.status == "ok"]
  rho = spearman([c.predicted_ms for c in measured], [c.time_ms for c in measured]) if len(measured) > 2 else None
  best_lib = min((c for c in library_rows if c.status == "ok"), key=lambda c: c.time_ms, default=None)
  row = {
      "case": label, "tune_seconds": tune_s, "winner": result.best.name, "winner_ms": result.best.time_ms,
      "best_library": best_lib.name if best_lib else None, "best_library_ms": best_lib.time_ms if best_lib else None,
      "winner_vs_best_library": (best_lib.time_ms / result.best.time_ms) if best_lib else None,
      "spearman_predicted_vs_measured": rho, "timed": len(measured),
      "machine": result.machine.to_dict(),
      "layouts": [None if layouts[0] is None else [str(x) for x in layouts[0]], str(layouts[1])],
      "candidates": [c.to_dict() for c in result.candidates + extra],
  }
  print(json.dumps({k: v for k, v in row.items() if k not in ("candidates", "machine")}, indent=1), flush=True)
  return row


def timed_reference(prog, result, inputs):
  """The reference output: the tuner's winner, which passed the check against the plain program."""
  return result.best.schedule.compile()(*inputs)


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--out", required=True)
  p.add_argument("--smoke", action="store_true")
  p.add_argument("--top", type=int, default=10)
  p.add_argument("--iters", type=int, default=10)
  args = p.parse_args()
  n = len(jax.devices())
  mesh = jax.make_mesh((n,), ("gpu",), axis_types=(AxisType.Auto,))
  seq = ((P(None, "gpu"),) * 3, P(None, "gpu"))  # sequence-sharded q, k, v and output
  ag = ((P("gpu", None), P(None, "gpu")), P(None, "gpu"))  # x row-sharded, w and output column-sharded
  if args.smoke:
    cases = [("attention B1 S256 H8 KV2 D32 causal", jm.programs.attention(1, 8, 2, 256, 256, 32, causal=True), seq),
             ("matmul 512^3", jm.programs.matmul(512, 512, 512), ag)]
  else:
    bf16 = jnp.bfloat16
    cases = [("attention B1 S32768 H32 KV8 D128, sequence-sharded",
              jm.programs.attention(1, 32, 8, 32768, 32768, 128, dtype=bf16), seq),
             ("matmul 8192^3, x row-sharded", jm.programs.matmul(8192, 8192, 8192, dtype=bf16), ag)]
  rows = [run_case(label, prog, mesh, layouts, args.top, args.iters) for label, prog, layouts in cases]
  out = {"device": jax.devices()[0].device_kind, "n_devices": n, "jax_version": jax.__version__,
         "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
         "command": "python -m benchmarks.tune_check " + " ".join(sys.argv[1:]), "cases": rows}
  with open(args.out, "w") as f:
    json.dump(out, f, indent=1)
  print("wrote", args.out)


if __name__ == "__main__":
  main()
