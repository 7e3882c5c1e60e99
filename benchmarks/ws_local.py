"""The warp-specialized fused ring attention on one GPU against cuDNN, each change to its pipeline beside the last.

    python -m benchmarks.ws_local --out ws_local.json [--seqs 4K 16K] [--kv 32 8] [--causal both] [--training]

For each case (B1 H32 D128 bf16 by default), in one process on the same inputs, interleaved rounds
(``tuner.measure.rounds``): ``jax.nn.dot_product_attention(implementation="cudnn")`` and the kernel
(``kernels.fused_ring_attention_ws``, a one-device ring) under each ``Pipeline`` from the kernel as first written
(``BEFORE``) to the default, one change at a time (non-causal cases: the changes that apply to them). Outputs are
checked against cuDNN's. ``--training`` times forward and backward instead: ``jax.vjp`` of cuDNN's attention
against the ring schedule lowered with the kernel (``lower_with("fused_ring_attention_ws")``), whose backward is
the one jaxmercury runs for it. TFLOP/s count a causal mask's visible half; the backward counts as 2.5 forwards.
``--smoke`` runs a small case on the CPU: XLA's attention for cuDNN, the kernel in Mosaic GPU interpret mode.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import time

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jaxmercury as jm
from benchmarks import harness
from jaxmercury.kernels import registry
from jaxmercury.kernels.fused_ring_attention_ws import BEFORE, Pipeline, fused_ring_attention_ws
from jaxmercury.tuner import measure

# One change at a time, in the order they were made; each name is the pipeline up to and including its change.
STEPS = {"before": BEFORE,
         "causal_loops": Pipeline(causal_loops=True, balanced=False, prefetch_q=False),
         "balanced": Pipeline(causal_loops=True, balanced=True, prefetch_q=False),
         "prefetch_q": Pipeline(split_tail=False),
         "split_tail": Pipeline()}
NON_CAUSAL_STEPS = ("before", "prefetch_q", "split_tail")  # the loops and the balanced order: causal work only


def _seq(text: str) -> int:
  return int(text[:-1]) * 1024 if text.upper().endswith("K") else int(text)


def _kernel_forward(mesh, causal: bool, pipeline: Pipeline, smoke: bool):
  kernel = lambda q, k, v: fused_ring_attention_ws(q, k, v, "x", causal=causal, pipeline=pipeline, interpret=smoke)
  return jax.jit(jax.shard_map(lambda q, k, v: kernel(q, k, v)[0], mesh=mesh, in_specs=(P(),) * 3, out_specs=P(),
                               check_vma=False))


def _schedule_step(mesh, b, s, h, kv, d, causal, smoke: bool):
  """The training step of the ring schedule lowered with the kernel, on ``[b, s, h, d]`` inputs."""
  prog = jm.programs.attention(b, h, kv, s, s, d, causal=causal, dtype=jnp.bfloat16)
  fn = jm.library(prog, mesh)["ring"].lower_with("fused_ring_attention_ws").compile(differentiable=True)

  def traced(q, k, v):  # the kernel is made when traced: in interpret mode for --smoke
    with registry.interpret_mode() if smoke else contextlib.nullcontext():
      return fn(q, k, v)
  return measure.training_step(traced)


def run_case(args, mesh, s: int, kv: int, causal: bool, deadline: float) -> dict:
  b, h, d = args.batch, args.heads, args.head_dim
  keys = jax.random.split(jax.random.key(args.seed + s + 7 * kv + causal), 4)
  inputs = [jax.random.normal(keys[0], (b, s, h, d), jnp.bfloat16)]
  inputs += [jax.random.normal(key, (b, s, kv, d), jnp.bfloat16) for key in keys[1:3]]
  impl = "xla" if args.smoke else "cudnn"
  cudnn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=impl)
  label = f'jax.nn.dot_product_attention(implementation="{impl}")'
  if args.training:
    inputs.append(jax.random.normal(keys[3], (b, s, h, d), jnp.bfloat16))
    step = lambda: _schedule_step(mesh, b, s, h, kv, d, causal, args.smoke)
    contestants = [harness.Contestant("cudnn", "baseline", lambda: measure.training_step(cudnn), f"jax.vjp of {label}"),
                   harness.Contestant("ws", "jaxmercury", step,
                                      "ring schedule lowered with fused_ring_attention_ws, its own backward")]
    tolerance = measure.gradient_tolerance(jnp.bfloat16)
  else:
    steps = STEPS if causal else {n: STEPS[n] for n in NON_CAUSAL_STEPS}
    contestants = [harness.Contestant("cudnn", "baseline", lambda: jax.jit(cudnn), label)]
    contestants += [harness.Contestant(name, "jaxmercury", lambda p=p: _kernel_forward(mesh, causal, p, args.smoke),
                                       f"fused_ring_attention_ws, {p}", record={"pipeline": dataclasses.asdict(p)})
                    for name, p in steps.items() if name in args.steps]
    tolerance = harness.BF16_TOLERANCE
  seq = f"{s // 1024}K" if s >= 1024 else str(s)
  name = f"B{b} S{seq} H{h} KV{kv} D{d}{' causal' if causal else ''}{' training' if args.training else ''}"
  harness.log(f"case {name}")
  settings = harness.Settings(iters=args.iters, warmup=3, max_timing_s=args.max_timing_s, deadline=deadline,
                              tolerance=tolerance, min_timing_s=args.min_timing_s)
  records, ref = harness.run_contestants(contestants, inputs, settings)
  flops = 4 * b * h * s * s * d / (2 if causal else 1) * (3.5 if args.training else 1.0)
  case = {"name": name, "batch": b, "seq": s, "heads": h, "kv_heads": kv, "head_dim": d, "causal": causal,
          "training": args.training}
  return harness.finish(case, records, ref, flops_per_device=flops)


def table(cases: list[dict]) -> str:
  names = []
  for c in cases:
    names += [r["name"] for r in c["contestants"] if r["name"] not in names]
  lines = ["| case | " + " | ".join(f"{n} ms (x cuDNN)" for n in names) + " |", "|---" * (len(names) + 1) + "|"]
  for c in cases:
    recs = {r["name"]: r for r in c["contestants"]}
    cells = []
    for n in names:
      r = recs.get(n, {})
      ok = "" if r.get("numerics_ok", True) else " DISAGREES"
      cells.append(f"{r['median_ms']:.3f} ({r['ratio_to_best_baseline']:.3f}){ok}" if "median_ms" in r
                   else r.get("error", r.get("skipped", ""))[:40])
    lines.append(f"| {c['name']} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True)
  parser.add_argument("--seqs", nargs="+", default=["4K", "8K", "16K", "32K", "64K"])
  parser.add_argument("--kv", nargs="+", type=int, default=[32, 8])
  parser.add_argument("--causal", choices=["both", "yes", "no"], default="both")
  parser.add_argument("--steps", nargs="+", default=list(STEPS), choices=list(STEPS))
  parser.add_argument("--training", action="store_true")
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--heads", type=int, default=32)
  parser.add_argument("--head_dim", type=int, default=128)
  parser.add_argument("--iters", type=int, default=20)
  parser.add_argument("--min_timing_s", type=float, default=0.5)
  parser.add_argument("--max_timing_s", type=float, default=3.0)
  parser.add_argument("--time_budget", type=float, default=480.0)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--smoke", action="store_true", help="a small case on the CPU (XLA, interpret mode)")
  args = parser.parse_args(argv)
  if args.smoke:
    args.seqs, args.kv, args.heads, args.head_dim, args.iters, args.min_timing_s = ["256"], [2], 4, 64, 3, 0.0
  start = time.time()
  deadline = start + args.time_budget
  mesh = jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
  out = harness.header("ws_local", [])
  out["command"] = "python -m benchmarks.ws_local " + " ".join(sys.argv[1:] if argv is None else argv)
  out["cases"] = []
  for s in map(_seq, args.seqs):
    for kv in args.kv:
      for causal in {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]:
        if time.time() > deadline:
          harness.log(f"out of time: S{s} KV{kv} causal={causal} left out")
          continue
        out["cases"].append(run_case(args, mesh, s, kv, causal, deadline))
        out["wall_s"] = round(time.time() - start, 1)
        harness.write_json(args.out, out)
  print(table(out["cases"]))


if __name__ == "__main__":
  main()
