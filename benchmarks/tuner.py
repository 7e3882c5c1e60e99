"""The tuner against the library: ``jm.autotune``'s winner and every library strategy timed side by side.

For each case (attention and GEMM in the callers' layouts, as the operator suites take them): ``jm.autotune``
with a fresh database (``--space``, ``--top_k``, ``--tune_iters``), then the winner (``jaxmercury``) and every
library candidate (``tuner.autotuner.default_candidates`` without a design-space sample: each strategy with each
local and fused kernel that applies, the baselines here) in interleaved rounds on the same inputs. The case
records the tuner's wall time and candidates, and the Spearman rank correlation between the cost model's
predicted times and the measured medians of every contestant timed (1: the model orders them as measured).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time

import jax
from jax.sharding import NamedSharding

import jaxmercury as jm
from benchmarks import harness, operators
from jaxmercury.errors import ScheduleError
from jaxmercury.tuner import cost
from jaxmercury.tuner.accuracy import spearman
from jaxmercury.tuner.autotuner import default_candidates


def plan(args) -> list:
  return operators.plan(args)  # attention and GEMM cases, as the operator suites take them


class Env:
  def __init__(self, args, results: dict, deadline: float):
    self.args, self.results, self.deadline = args, results, deadline
    self.meshes = {}

  def mesh(self, spec: str):
    return self.meshes.setdefault(spec, harness.make_mesh(spec))


def run_case(env, case) -> dict:
  args, mesh, prog = env.args, env.mesh(case.mesh), operators.program(case)
  ins, out = operators.layouts(case, mesh)
  t0 = time.perf_counter()
  result = jm.autotune(prog, mesh, in_shardings=ins, out_sharding=out, top_k=args.top_k, space=args.space,
                       iters=args.tune_iters, database=jm.Database(os.path.join(tempfile.mkdtemp(), "tune.db")),
                       machine=operators.SMOKE_MACHINE if args.smoke else None, key=jax.random.key(args.seed),
                       log=lambda s: harness.log("    " + s))
  rec = {"name": case.name, "op": case.op, "config": dataclasses.asdict(case), "mesh": dict(mesh.shape), "tuner": {
      "wall_s": round(time.perf_counter() - t0, 2), "winner": result.best and result.best.name,
      "candidates": [{k: v for k, v in c.to_dict().items() if k != "schedule"} for c in result.candidates]}}
  contestants = []
  if result.best is not None:
    best = result.best
    contestants.append(harness.Contestant("jaxmercury", "jaxmercury", lambda: best.schedule.compile(),
                                          f"autotune winner: {best.name}",
                                          record={"strategy": best.strategy, "predicted_ms": best.predicted_ms,
                                                  **operators.fields(best.schedule)}))
  for c in default_candidates(prog, mesh, space=0, in_shardings=ins, out_sharding=out):
    try:
      s, why = c.schedule.with_layouts(ins, out), None
      predicted = cost.predict(s, result.machine) * 1e3
    except ScheduleError as exc:
      s, why, predicted = None, str(exc), None
    contestants.append(harness.Contestant(c.name, "baseline", lambda s=s: s.compile(), "library strategy", skip=why,
                                          record={"strategy": c.strategy, "predicted_ms": predicted,
                                                  **operators.fields(c.schedule)}))
  keys = jax.random.split(operators.case_key(args.seed, case.name), len(prog.reads))
  inputs = [harness.random_array(k, b.shape, b.dtype, NamedSharding(mesh, spec))
            for k, b, spec in zip(keys, prog.reads, ins)]
  if args.smoke:
    contestants.insert(0, operators.reference(prog, inputs, False))
  records, ref = harness.run_contestants(contestants, inputs, harness.Settings.from_args(args, env.deadline))
  timed = [r for r in records if "median_ms" in r and r.get("numerics_ok") and r.get("predicted_ms")]
  rec["spearman_predicted_vs_measured"] = spearman([r["predicted_ms"] for r in timed], [r["median_ms"] for r in timed])
  rec["ranked"] = len(timed)
  return harness.finish(rec, records, ref, flops_per_device=prog.flops / mesh.devices.size)
