"""The graph cost model's predictions for the Llama block plans a GPU run timed, against their times.

``benchmarks.llama_block`` records, per sequence length, the machine figures
it calibrated, each plan's choice of candidate per node and each plan's
measured forward and forward+backward. This script rebuilds the block's graph
on an abstract mesh of the run's size with those figures, fixes each plan's
recorded choices (``jaxmercury.graph.fixed``) and prices them with the
current cost model, for the forward and for a training step. Nothing runs on
a GPU: the times are the run's, the predictions are computed here, so a
change to the cost model can be checked against runs already made.

  python -m benchmarks.llama_predictions RESULTS.json... [--out predictions.json]

Printed per plan: predicted and measured milliseconds and their ratio, and per
sequence length whether the plan the training objective ranks first is the
fastest measured one.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax.numpy as jnp
from jax.sharding import AbstractMesh, AxisType

from benchmarks import llama_block as lb
from benchmarks.llama_profile import machines_from
from jaxmercury import graph as jg
from models import CONFIGS
from models import block_graph as bg


def case_predictions(path: str, case: dict, n_devices: int) -> list[dict]:
  """One row per timed plan of ``case``: its recorded choices priced now, beside its measured times."""
  seq = case["seq"]
  machines = machines_from(path, seq)
  mesh = AbstractMesh((n_devices,), ("x",), axis_types=(AxisType.Auto,))
  config = CONFIGS["llama3_8b"].with_dtype(jnp.bfloat16)
  measured = {r["name"]: r for r in case["contestants"] if "error" not in r}
  rows = []
  for name, recorded in case["plans"].items():
    timed = measured.get(name) or measured.get(recorded["same_as"] or "")
    if timed is None:
      continue
    graph = bg.block_graph(config, batch=1, seq=seq, mesh=mesh, machines=machines, strategies=lb.GPU_STRATEGIES,
                           residual=lb.residual_layout(recorded["residual"], mesh))
    options = {node.name: {c.name: c for c in node.candidates} for node in graph.nodes}
    missing = sorted(n for n, c in recorded["choice"].items() if c not in options.get(n, {}))
    if missing:
      raise SystemExit(f"{path}, seq {seq}, {name}: the graph no longer offers the recorded candidates of {missing}")
    choice = {n: options[n][c] for n, c in recorded["choice"].items()}
    forward = jg.fixed(graph, machines, choice).seconds * 1e3
    training = jg.fixed(graph, machines, choice, training=True).seconds * 1e3
    rows.append({"results": path, "seq": seq, "plan": name, "searched_for": "training" if recorded["training"] else "forward",
                 "forward_predicted_ms": forward, "forward_measured_ms": timed["forward_ms"],
                 "training_predicted_ms": training, "training_measured_ms": timed["forward_backward_ms"],
                 "recorded_training_predicted_ms": recorded["predicted_ms"] if recorded["training"] else None})
  return rows


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("results", nargs="+", help="benchmarks.llama_block results files")
  p.add_argument("--out", default=None)
  args = p.parse_args(argv)
  rows = []
  for path in args.results:
    with open(path) as fh:
      data = json.load(fh)
    for case in data["cases"]:
      if "machines" not in case:
        raise SystemExit(f"{path}, seq {case['seq']}: no calibrated machines recorded")
      rows += case_predictions(path, case, data["n_devices"])
  print(f"{'seq':>6} {'plan':<36} {'fwd pred':>9} {'meas':>8} {'ratio':>6}  {'train pred':>10} {'meas':>8} {'ratio':>6}")
  for r in rows:
    print(f"{r['seq']:>6} {r['plan']:<36} {r['forward_predicted_ms']:9.3f} {r['forward_measured_ms']:8.3f} "
          f"{r['forward_predicted_ms'] / r['forward_measured_ms']:6.2f}  {r['training_predicted_ms']:10.3f} "
          f"{r['training_measured_ms']:8.3f} {r['training_predicted_ms'] / r['training_measured_ms']:6.2f}")
  for path, seq in dict.fromkeys((r["results"], r["seq"]) for r in rows):
    mine = [r for r in rows if (r["results"], r["seq"]) == (path, seq)]
    ranked = min(mine, key=lambda r: r["training_predicted_ms"])["plan"]
    fastest = min(mine, key=lambda r: r["training_measured_ms"])["plan"]
    print(f"{path}, seq {seq}: the training objective ranks {ranked} first; fastest measured: {fastest}")
  if args.out:
    with open(args.out, "w") as fh:
      json.dump({"command": "python -m benchmarks.llama_predictions " + " ".join(sys.argv[1:] if argv is None
                                                                                else argv), "rows": rows}, fh,
                indent=1)


if __name__ == "__main__":
  main()
