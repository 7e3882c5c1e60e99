"""Checks the cost model's ranking against the tuner candidates measured on GPUs.

The attention suites of 2026-11-22 (``benchmarks.run`` on 2, 4 and 2x2 H200s)
timed every candidate the tuner picked; their tuning databases hold each
candidate's schedule trace and measurement. This script rebuilds every
measured candidate from its trace, predicts it again with the current cost
model (``jaxmercury.tuner.cost.predict``) and the machine figures calibrated in
that run, and reports per case the Spearman rank correlation of predicted and
measured times, and the median absolute log error, for the model that ran then
(its predictions as stored) and for the current one. Nothing runs on a GPU:
the times are the runs' measurements, the predictions are computed here.

  python -m benchmarks.model_check [--out benchmarks/results/2026-11-22-model_check.json]

Machine figures. The 2- and 4-GPU runs stored theirs in the results JSON.
Since then a kernel's rate counts the flops it executes, not the program's
flops of the block (which count half of a causal block): ``executed_basis``
converts the stored figures at the block the calibration measured, and a
causal program's XLA rate is the non-causal calibration's (``run_machines``
says why). The 2x2 run was stopped before writing its JSON (its log and
database remain): it takes the causal figures of the 4-GPU run on the same
host, minutes earlier, with every level's link at that run's ring bandwidth.
With them the previous model gives 0.81-1.04 times the predictions the 2x2
log holds (median 0.98).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import re
import sqlite3
import statistics
import sys

import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, AxisType

import jaxmercury as jm
from jaxmercury.kernels import registry
from jaxmercury.tuner import calibrate, cost

RESULTS = os.path.join(os.path.dirname(__file__), "results")
GPU_BUDGET = 8 << 30  # the block budget ``calibrate`` uses on GPUs


@dataclasses.dataclass(frozen=True)
class Run:
  """One GPU run: its results JSON (None if it was not written), log and tuning database."""

  name: str
  results: str | None
  log: str
  database: str


RUNS = (
    Run("2xH200", "2026-11-22-suite-attention-2xH200.json", "2026-11-22-suite-attention-2xH200.log",
        "2026-11-22-suite-attention-2xH200.tuning.db"),
    Run("4xH200", "2026-11-22-suite-attention-4xH200.json", "2026-11-22-suite-attention-4xH200.log",
        "2026-11-22-suite-attention-4xH200.tuning.db"),
    Run("2x2xH200", None, "2026-11-22-suite-attention-2x2xH200.log", "2026-11-22-suite-attention-2x2xH200.tuning.db"),
)
FIGURES_OF = {"2x2xH200": ("4xH200", "attention causal mesh {'gpu': 4}")}  # run without a JSON -> whose figures


# ------------------------------------------------------------------ statistics


def ranks(x) -> np.ndarray:
  """Ranks from 0, ties sharing their mean rank."""
  x = np.asarray(x, float)
  order = np.argsort(x, kind="stable")
  out = np.empty(len(x))
  out[order] = np.arange(len(x))
  for value in np.unique(x):
    tied = x == value
    out[tied] = out[tied].mean()
  return out


def spearman(a, b) -> float:
  if len(a) < 3:
    return math.nan
  return float(np.corrcoef(ranks(a), ranks(b))[0, 1])


def median_abs_log_error(predicted, measured) -> float:
  return float(np.median(np.abs(np.log(np.asarray(predicted) / np.asarray(measured)))))


# ------------------------------------------------------------------ inputs


def read_measurements(path: str) -> dict[str, list[dict]]:
  """Per record key, the ok measurements: name, trace, time_ms. Read-only; sqlite reads a WAL beside it."""
  if not os.path.exists(path):
    raise SystemExit(f"no tuning database at {path} (give its path with --db)")
  conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
  try:
    rows = conn.execute("SELECT key, name, trace, result FROM measurements WHERE result IS NOT NULL").fetchall()
  finally:
    conn.close()
  out = {}
  for key, name, trace, result in rows:
    result = json.loads(result)
    if result["status"] == "ok":
      out.setdefault(key, []).append({"name": name, "trace": trace, "time_ms": result["median_ms"]})
  return out


def log_predictions(path: str) -> dict[str, dict[str, float]]:
  """Per case heading of a suite log, each timed candidate's predicted ms."""
  out, case = {}, None
  line_re = re.compile(r"^\s+\[\d+/\d+\] (.+?)\s+predicted\s+([\d.]+) ms")
  with open(path) as f:
    for line in f:
      if line.startswith("== "):
        case = line[3:].split("  (")[0].strip()
        out[case] = {}
      elif case and (m := line_re.match(line)):
        out[case][m.group(1)] = float(m.group(2))
  return out


def program_of(params: dict):
  return jm.programs.attention(int(params["batch"]), int(params["heads"]), int(params["kv_heads"]),
                               int(params["q_len"]), int(params["kv_len"]), int(params["head_dim"]),
                               causal=params["causal"] in (True, "True"), dtype=jnp.dtype(params["dtype"]))


def mesh_of(shape) -> AbstractMesh:
  names, sizes = zip(*shape)
  return AbstractMesh(tuple(sizes), tuple(names), axis_types=(AxisType.Auto,) * len(names))


# ------------------------------------------------------------------ machine figures


def executed_basis(figures: dict, program) -> cost.Machine:
  """Stored figures with each kernel's rate in the flops it executes.

  The calibration that produced them timed blocks at the origin and counted
  the program's flops of the block: for a causal program half the block's,
  whatever the kernel computed. Each rate is scaled by executed over counted
  flops at the larger block it timed (the one the rate rests on), on the
  program it was calibrated with.
  """
  machine = cost.Machine.from_dict(figures)
  rates = {}
  for name, rate in machine.kernel_flops_per_s.items():
    kernel = registry.kernel(name)
    sizes = calibrate._block_sizes(program, kernel, GPU_BUDGET, square=False)
    counted = program.flops * math.prod(sizes[a.name] / a.extent for a in program.loops)
    rates[name] = rate * calibrate.executed_flops(program, name, sizes) / counted
  return dataclasses.replace(machine, kernel_flops_per_s=rates, flops_per_s=max(rates.values()))


def _machine_key(program, mesh) -> str:
  return f"attention{' causal' if program.params['causal'] else ''} mesh {dict(mesh.shape)}"


def tuned_cases(results: dict) -> list[dict]:
  """The cases of a results JSON that the tuner ran (not skipped)."""
  return [c for c in results["cases"] if "tuner" in c]


def run_machines(results: dict) -> dict[str, cost.Machine]:
  """Per machine key of a results JSON, its figures on the executed basis (calibrated on its first case).

  A causal key takes the XLA body's rate of the non-causal key on the same
  mesh, where there is one: the body computes a block that is not wholly
  masked densely either way, and the runs' XLA schedules doing the same
  dense work per device took as long causal as not (``xla_evidence``), while
  the causal calibration, on blocks at constant offsets, gives a dense rate
  30% higher.
  """
  out = {}
  for key, held in results["machines"].items():
    for case in tuned_cases(results):
      c = case["config"]
      prog = jm.programs.attention(c["batch"], c["heads"], c["kv_heads"], c["seq"], c["seq"], c["head_dim"],
                                   causal=c["causal"], dtype=jnp.dtype(c["dtype"]))
      if _machine_key(prog, mesh_of(case["mesh"].items())) == key and c["seq"] == held["size"]:
        out[key] = executed_basis(held["figures"], prog)
        break
  for key, machine in out.items():
    plain = out.get(key.replace("attention causal mesh", "attention mesh"))
    if key.startswith("attention causal") and plain is not None:
      out[key] = dataclasses.replace(machine, kernel_flops_per_s={**machine.kernel_flops_per_s,
                                                                  "xla": plain.rate("xla")})
  return out


def xla_evidence(results: dict) -> list[dict]:
  """XLA-body strategies whose devices do the same dense work causal or not: their measured ms side by side.

  A contiguous causal ring's last device and a causal context-parallel
  split (every block partly visible) compute every block densely.
  """
  rows = []
  by_name = {c["name"]: c for c in tuned_cases(results)}
  for name, case in by_name.items():
    plain = by_name.get(name.replace(" causal", "")) if " causal" in name else None
    if plain is None:
      continue
    times = {c["name"]: c["time_ms"] for c in case["tuner"]["candidates"]}
    plain_times = {c["name"]: c["time_ms"] for c in plain["tuner"]["candidates"]}
    for strategy in ("ring", "context_parallel"):
      if times.get(strategy) and plain_times.get(strategy):
        rows.append({"case": name, "strategy": strategy, "causal_ms": times[strategy],
                     "non_causal_ms": plain_times[strategy]})
  return rows


# ------------------------------------------------------------------ the check


def check_case(name, program, mesh, rows, old: dict[str, float], machine: cost.Machine) -> dict:
  candidates = []
  for row in rows:
    schedule = jm.Schedule.from_json(program, mesh, row["trace"])
    candidates.append({"name": row["name"], "time_ms": row["time_ms"], "old_predicted_ms": old.get(row["name"]),
                       "new_predicted_ms": cost.predict(schedule, machine) * 1e3})
  candidates.sort(key=lambda c: c["time_ms"])
  both = [c for c in candidates if c["old_predicted_ms"] is not None]
  t_old = [c["time_ms"] for c in both]
  t_new = [c["time_ms"] for c in candidates]
  p_old = [c["old_predicted_ms"] for c in both]
  p_new = [c["new_predicted_ms"] for c in candidates]
  return {
      "case": name, "mesh": dict(mesh.shape), "machine": machine.name, "measured": len(candidates),
      "spearman_old": spearman(p_old, t_old), "spearman_new": spearman(p_new, t_new),
      "median_abs_log_error_old": median_abs_log_error(p_old, t_old),
      "median_abs_log_error_new": median_abs_log_error(p_new, t_new),
      "best_measured": candidates[0]["name"],
      "best_predicted_old": min(both, key=lambda c: c["old_predicted_ms"])["name"] if both else None,
      "best_predicted_new": min(candidates, key=lambda c: c["new_predicted_ms"])["name"],
      "candidates": candidates}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", default=os.path.join(RESULTS, "2026-11-22-model_check.json"))
  p.add_argument("--db", nargs=3, metavar=("DB_2", "DB_4", "DB_2x2"),
                 help="the tuning databases of the 2-, 4- and 2x2-GPU runs (default: the copies in benchmarks/results)")
  args = p.parse_args(argv)
  runs = [dataclasses.replace(r, database=db) for r, db in zip(RUNS, args.db)] if args.db else list(RUNS)

  machines, cases, evidence = {}, [], []
  for run in runs:
    results = None
    if run.results:
      with open(os.path.join(RESULTS, run.results)) as f:
        results = json.load(f)
      machines[run.name] = run_machines(results)
      evidence += xla_evidence(results)
    logged = log_predictions(os.path.join(RESULTS, run.log))
    stored = {c["name"]: c for c in tuned_cases(results)} if results else {}
    for key, rows in read_measurements(os.path.join(RESULTS, run.database)).items():
      params = json.loads(key)
      program, mesh = program_of(params["params"]), mesh_of(params["mesh"])
      name = _case_name(program, mesh, logged, stored)
      if name in stored:
        old = {c["name"]: c["predicted_ms"] for c in stored[name]["tuner"]["candidates"]}
      else:  # a case the run was stopped in: its log has the predictions
        old = logged.get(name, {})
      if _machine_key(program, mesh) in machines.get(run.name, {}):
        machine = machines[run.name][_machine_key(program, mesh)]
      else:
        source_run, source_key = FIGURES_OF[run.name]
        base = machines[source_run][source_key]
        machine = dataclasses.replace(base, name=f"{base.name}, links per level at its ring's",
                                      link_bytes_per_s={**{lv: base.bandwidth("*") for lv in mesh.axis_names},
                                                        "*": base.bandwidth("*")})
      cases.append({"run": run.name, **check_case(name, program, mesh, rows, old, machine)})

  summary = {k: statistics.median(c[k] for c in cases) for k in
             ("spearman_old", "spearman_new", "median_abs_log_error_old", "median_abs_log_error_new")}
  out = {
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
      "command": "python -m benchmarks.model_check " + " ".join(argv if argv is not None else sys.argv[1:]),
      "note": ("time_ms are the GPU measurements of the 2026-11-22 attention suite runs on H200s (their tuning "
               "databases); old_predicted_ms are the predictions those runs stored; new_predicted_ms are "
               "recomputed on CPU from each candidate's stored trace with the current cost model and the "
               "machine figures calibrated in that run (kernel rates put on the executed-flops basis; causal "
               "figures take the XLA body's rate of the non-causal calibration on the same mesh, see "
               "xla_causal_vs_non_causal; the 2x2 run, which wrote no JSON, takes the 4-GPU run's causal "
               "figures, links at its ring's bandwidth)."),
      "summary_median_over_cases": summary,
      "machines": {run: {k: m.to_dict() for k, m in ms.items()} for run, ms in machines.items()},
      "xla_causal_vs_non_causal": evidence,
      "cases": cases}
  with open(args.out, "w") as f:
    json.dump(out, f, indent=1)
  print(f"{'run':9} {'case':52} {'n':>3} {'spearman old':>12} {'new':>6} {'|log err| old':>14} {'new':>6}")
  for c in cases:
    print(f"{c['run']:9} {c['case']:52} {c['measured']:3d} {c['spearman_old']:12.3f} {c['spearman_new']:6.3f} "
          f"{c['median_abs_log_error_old']:14.3f} {c['median_abs_log_error_new']:6.3f}")
  print("median over cases:", json.dumps({k: round(v, 3) for k, v in summary.items()}))
  print(f"wrote {args.out}")


def _case_name(program, mesh, logged, stored) -> str:
  """The suite's name of the case that tuned ``program`` on ``mesh``."""
  p = program.params
  kind = "MHA" if p["kv_heads"] == p["heads"] else ("MQA" if p["kv_heads"] == 1 else "GQA")
  seq = f"S{p['q_len'] // 1024}K" if p["q_len"] % 1024 == 0 else f"S{p['q_len']}"
  base = f"attention {kind} B{p['batch']} {seq} H{p['heads']} KV{p['kv_heads']} D{p['head_dim']}"
  base += " causal" if p["causal"] else ""
  for name in list(stored) + list(logged):
    if name == base or name.startswith(base + " mesh"):
      return name
  return base


if __name__ == "__main__":
  main()
