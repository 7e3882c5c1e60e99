"""GPU kernel time of the Llama block's graph plan against XLA's Megatron shardings, kernel by kernel.

  python -m benchmarks.llama_profile --seq 4096 --out_dir DIR [--backward] [--machines_from RESULTS.json]
      [--names jaxmercury_plan_training xla_megatron_tp ...]

For the searched plans (``llama_block.PLANS``) and the plain-jit baselines
of ``benchmarks.llama_block`` (``--names`` picks some): the count of each
collective in the compiled HLO, the wall time of a call, then ``--iters``
forward calls under
``jax.profiler.trace``, whose device-0 kernels are summed by name
(milliseconds per call, the 40 largest), and summed by category (collective,
attention, gemm, our Pallas kernels, other); with ``--backward`` the same for
a forward+backward call (every gradient). ``--machines_from`` plans with the
figures a ``llama_block`` results file calibrated for that sequence, so the
plans are the ones it timed. ``DIR/profile-<seq>.json`` holds the tables,
``DIR/hlo-<name>-<kind>-<seq>.txt`` the compiled HLO. Kernels on separate
streams overlap, so the sum can exceed the wall time; a wall time above the
sum is time the GPU idles (launches, waits for peers).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import glob
import json
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AxisType

from benchmarks import harness
from benchmarks import llama_block as lb
from jaxmercury.tuner.cost import Machine
from models import CONFIGS, DecoderBlock
from models import block_graph as bg

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute", "custom-call")


CATEGORIES = (("collective", ("nccl",)), ("attention", ("sdpa", "flash", "fmha", "attention")),
              ("gemm", ("nvjet", "gemm", "cutlass", "xmma", "matmul", "dot")),
              ("pallas", ("mosaic", "pallas", "ring", "fused")))


def category(kernel: str) -> str:
  """The kind of a kernel by its name: collective, attention, gemm, pallas (our fused kernels) or other."""
  low = kernel.lower()
  return next((cat for cat, marks in CATEGORIES if any(m in low for m in marks)), "other")


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


def summarize(fn, args, iters: int, hlo: str) -> dict:
  """The HLO's collective counts, the call's wall time, and its device-0 kernel time by category and by name."""
  per = kernel_times(fn, args, iters)
  by_category = collections.Counter()
  for name, ms in per.items():
    by_category[category(name)] += ms
  top = sorted(per.items(), key=lambda kv: -kv[1])[:40]
  return {"hlo_counts": {op: hlo.count(f" {op}(") + hlo.count(f" {op}-start(") for op in COLLECTIVES},
          "wall_ms": harness.time_call(fn, args, iters=iters),
          "total_kernel_ms_per_iter": sum(per.values()),
          "by_category_ms": {k: round(v, 4) for k, v in sorted(by_category.items())},
          "top": [[k, round(ms, 4)] for k, ms in top]}


def machines_from(path: str, seq: int) -> dict:
  """The calibrated cost-model figures a ``llama_block`` results file recorded for ``seq`` (to rebuild its plans)."""
  with open(path) as fh:
    cases = json.load(fh)["cases"]
  case = next((c for c in cases if c.get("seq") == seq and "machines" in c), None)
  if case is None:
    raise SystemExit(f"{path} holds no calibrated machines for sequence {seq}")
  return {k: Machine.from_dict(m) for k, m in case["machines"].items()}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--seq", type=int, default=4096)
  p.add_argument("--iters", type=int, default=10)
  p.add_argument("--out_dir", required=True)
  p.add_argument("--backward", action="store_true", help="also profile forward + backward (every gradient)")
  p.add_argument("--machines_from", default=None,
                 help="a llama_block results file: plan with the figures it calibrated for --seq")
  p.add_argument("--names", nargs="*", default=None, help="contestants to profile (default: all)")
  p.add_argument("--config", default="llama3_8b", choices=sorted(CONFIGS))
  args = p.parse_args(argv)
  os.makedirs(args.out_dir, exist_ok=True)
  mesh = jax.make_mesh((len(jax.devices()),), ("x",), axis_types=(AxisType.Auto,))
  config = CONFIGS[args.config].with_dtype(jnp.bfloat16)
  gpu = jax.devices()[0].platform == "gpu"
  params = bg.block_params(DecoderBlock(config, rngs=nnx.Rngs(1)))
  x = jax.random.normal(jax.random.key(2), (1, args.seq, config.dim), config.dtype)
  cot = jax.random.normal(jax.random.key(3), x.shape, config.dtype)
  machines = machines_from(args.machines_from, args.seq) if args.machines_from else \
      (lb.H200_MACHINES if gpu else lb.CPU_MACHINES)
  wanted = set(args.names) if args.names is not None else None
  plans = {name: lb.plan_block(config, args.seq, mesh, machines, lb.GPU_STRATEGIES if gpu else None, kind,
                               training=training)[0]
           for name, (kind, training) in lb.PLANS.items() if wanted is None or name in wanted}
  baselines = [b for b in ("xla_megatron_tp", "xla_megatron_tp_sp", "xla_sequence_parallel")
               if wanted is None or b in wanted]
  contestants = lb.block_contestants(plans, config, mesh, baselines, "cudnn" if gpu else None)
  report = {"command": "python -m benchmarks.llama_profile " + " ".join(sys.argv[1:] if argv is None else argv),
            "device": jax.devices()[0].device_kind, "n_devices": len(jax.devices()), "jax_version": jax.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "plans": {name: str(plan) for name, plan in plans.items()}}
  for name, (f, specs, x_spec) in contestants.items():
    fwd, shardings, (p_, xs) = lb.placed_forward(f, specs, x_spec, params, x, mesh)
    calls = {"forward": fwd}
    if args.backward:
      loss = lambda p, x, f=f: jnp.sum(f(p, x).astype(jnp.float32) * cot.astype(jnp.float32))
      calls["forward_backward"] = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), in_shardings=shardings)
    for kind, fn in calls.items():
      hlo = fn.lower(p_, xs).compile().as_text()
      with open(f"{args.out_dir}/hlo-{name}-{kind}-{args.seq}.txt", "w") as fh:
        fh.write(hlo)
      report.setdefault(name, {})[kind] = summarize(fn, (p_, xs), args.iters, hlo)
      print(name, kind, json.dumps({k: v for k, v in report[name][kind].items() if k != "top"}), flush=True)
    with open(f"{args.out_dir}/profile-{args.seq}.json", "w") as fh:
      json.dump(report, fh, indent=1)


if __name__ == "__main__":
  main()
