"""Cost-model predictions for meshes larger than the machine (issue 10's plan).

Reads the machine figures calibrated on the GPUs (a ``tune_check`` result) and
predicts every candidate of the benchmark operators on two-level meshes whose
outer level stands in for nodes joined by 100 Gb/s links, with the callers'
layouts fixed (attention sequence-sharded over all levels, GEMM x row-sharded
with w and the output column-sharded); nothing is compiled. ``--fused_rates``
(a ``benchmarks.fused_rates`` result) adds the fused ring attentions' measured
rates to each attention operator's figures; without it they take the fastest
local kernel's, which overrates them.

  python -m benchmarks.predict_meshes --machine benchmarks/results/2026-11-22-tune_check-2xH200.json \\
      [--fused_rates RATES.json] --out benchmarks/results/2026-11-23-predictions-4-2x2-8-2x4-4x2-4x4.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys

import jax.numpy as jnp
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P

import jaxmercury as jm
from jaxmercury.tuner.cost import Machine

MESHES = {"4": (4,), "2x2": (2, 2), "8": (8,), "2x4": (2, 4), "4x2": (4, 2), "4x4": (4, 4)}
NODE_LINK = 100e9 / 8  # 100 Gb/s between nodes, bytes/s


def programs():
  bf16 = jnp.bfloat16
  return {
      "attention B1 S32K H32 KV8 D128": jm.programs.attention(1, 32, 8, 32768, 32768, 128, dtype=bf16),
      "attention B1 S128K H32 KV8 D128 causal": jm.programs.attention(1, 32, 8, 131072, 131072, 128,
                                                                       causal=True, dtype=bf16),
      "matmul 16384 x 8192 x 8192": jm.programs.matmul(16384, 8192, 8192, dtype=bf16),
  }


def layouts(prog, names):
  """The callers' layouts: attention sequence-sharded, GEMM x row-sharded (w, output column-sharded)."""
  entry = names[0] if len(names) == 1 else tuple(names)
  if prog.pattern == "attention":
    return {"in_shardings": (P(None, entry),) * 3, "out_sharding": P(None, entry)}
  return {"in_shardings": (P(entry, None), P(None, entry)), "out_sharding": P(None, entry)}


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--machine", required=True, help="a tune_check result JSON with calibrated figures")
  p.add_argument("--fused_rates", help="a benchmarks.fused_rates result: the fused kernels' measured rates")
  p.add_argument("--out", required=True)
  args = p.parse_args()
  source = json.load(open(args.machine))
  fused = json.load(open(args.fused_rates))["rates"] if args.fused_rates else {}
  figures = {c["case"].split()[0]: Machine.from_dict(c["machine"]) for c in source["cases"]}
  rows = []
  for label, prog in programs().items():
    base = figures[prog.pattern]
    base = dataclasses.replace(base, fused_flops_per_s=fused.get(label, {}).get("fused", {}))
    gpu_link = base.link_bytes_per_s["*"]
    for mesh_name, shape in MESHES.items():
      names = ("gpu",) if len(shape) == 1 else ("node", "gpu")
      mesh = AbstractMesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))
      machine = base.with_links(gpu=gpu_link, **({"node": NODE_LINK} if len(shape) == 2 else {}))
      cands = jm.tuner.predict_candidates(prog, mesh, machine, space=32, **layouts(prog, names))
      best = cands[0]
      library = {c.name: c.predicted_ms for c in cands if c.name.split(" [")[0] in jm.library(prog, mesh)}
      rows.append({"operator": label, "layouts": str(layouts(prog, names)), "mesh": dict(mesh.shape), "predicted_best": best.name,
                   "predicted_best_ms": best.predicted_ms, "library_predicted_ms": library,
                   "candidates": len(cands)})
      print(f"{label:<42} {mesh_name:>4}  best {best.predicted_ms:9.3f} ms  {best.name}")
  out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
         "machine_from": args.machine, "fused_rates_from": args.fused_rates, "node_link_bytes_per_s": NODE_LINK,
         "note": "predictions only: no 4- or 8-GPU machine was available to measure them",
         "command": "python -m benchmarks.predict_meshes " + " ".join(sys.argv[1:]),
         "rows": rows}
  with open(args.out, "w") as f:
    json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()
