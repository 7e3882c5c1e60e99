"""GPU kernel time of the Llama block's graph plan against XLA's Megatron shardings, kernel by kernel.

  python -m benchmarks.llama_profile --seq 4096 --out_dir DIR

For the searched plans (one per residual layout, ``llama_block.PLANS``) and the ``xla_megatron_tp`` and
``xla_megatron_tp_sp`` baselines of ``benchmarks.llama_block``: the count of
each collective in the compiled HLO, then ``--iters`` forward calls under
``jax.profiler.trace``, whose device-0 kernels are summed by name
(milliseconds per call, the 40 largest). ``DIR/profile-<seq>.json`` holds the
table, ``DIR/hlo-<name>-<seq>.txt`` the compiled HLO. A gap between the
kernel sum and the wall time of ``llama_block`` is time the GPU idles
(launches, waits for peers).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import tempfile

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AxisType

from benchmarks import llama_block as lb
from models import CONFIGS, DecoderBlock
from models import block_graph as bg

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute", "custom-call")


def kernel_times(fn, args, iters: int) -> dict[str, float]:
  """Milliseconds per call of each kernel on the first GPU, by kernel name."""
  for _ in range(3):
    jax.block_until_ready(fn(*args))
  folder = tempfile.mkdtemp()
  with jax.profiler.trace(folder):
    for _ in range(iters):
      jax.block_until_ready(fn(*args))
  (path,) = glob.glob(f"{folder}/**/*.xplane.pb", recursive=True)
  per = collections.Counter()
  for plane in jax.profiler.ProfileData.from_file(path).planes:
    if plane.name.startswith("/device:GPU:0"):
      for line in plane.lines:
        if "Stream" in line.name:  # kernels; the op and module lines summarize them
          for ev in line.events:
            per[ev.name[:90]] += ev.duration_ns / 1e6 / iters
  return dict(per)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--seq", type=int, default=4096)
  p.add_argument("--iters", type=int, default=10)
  p.add_argument("--out_dir", required=True)
  args = p.parse_args(argv)
  os.makedirs(args.out_dir, exist_ok=True)
  mesh = jax.make_mesh((len(jax.devices()),), ("x",), axis_types=(AxisType.Auto,))
  config = CONFIGS["llama3_8b"].with_dtype(jnp.bfloat16)
  params = bg.block_params(DecoderBlock(config, rngs=nnx.Rngs(1)))
  x = jax.random.normal(jax.random.key(2), (1, args.seq, config.dim), config.dtype)
  plans = {name: lb.plan_block(config, args.seq, mesh, lb.H200_MACHINES, lb.GPU_STRATEGIES, kind,
                               training=training)[0]
           for name, (kind, training) in lb.PLANS.items()}
  contestants = lb.block_contestants(plans, config, mesh, ("xla_megatron_tp", "xla_megatron_tp_sp"), "cudnn")
  report = {}
  for name, (f, specs, x_spec) in contestants.items():
    fwd, _, (p_, xs) = lb.placed_forward(f, specs, x_spec, params, x, mesh)
    hlo = fwd.lower(p_, xs).compile().as_text()
    with open(f"{args.out_dir}/hlo-{name}-{args.seq}.txt", "w") as fh:
      fh.write(hlo)
    per = kernel_times(fwd, (p_, xs), args.iters)
    top = sorted(per.items(), key=lambda kv: -kv[1])[:40]
    report[name] = {"hlo_counts": {op: hlo.count(f" {op}(") + hlo.count(f" {op}-start(") for op in COLLECTIVES},
                    "total_kernel_ms_per_iter": sum(per.values()), "top": [[k, round(ms, 4)] for k, ms in top]}
    print(name, json.dumps(report[name]), flush=True)
  with open(f"{args.out_dir}/profile-{args.seq}.json", "w") as fh:
    json.dump(report, fh, indent=1)


if __name__ == "__main__":
  main()
