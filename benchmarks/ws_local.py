"""The warp-specialized attention kernels on one GPU against cuDNN's: forward, backward and the training step.

    python -m benchmarks.ws_local --out ws_local.json [--seqs 4K 16K] [--kv 32 8] [--causal both] [--training]

For each case (B1 H32 D128 bf16 by default), in one process on the same inputs, interleaved rounds
(``tuner.measure.rounds``): ``jax.nn.dot_product_attention(implementation="cudnn")`` and the fused ring attention
kernel (``kernels.attention.ws_forward``, a one-device ring) at its defaults, outputs checked against cuDNN's.
``--training`` times forward and backward instead: ``jax.vjp`` of cuDNN's attention against the ring schedule
lowered with the kernel (``lower_with("fused_ring_attention_ws")``), whose backward is the one jaxmercury runs for
it (cuDNN's flash backward), and with ``backward="ws_attention"``, our one-pass backward kernel
(``kernels.attention.ws_backward``). ``--backward`` times the backward alone, both from the same output and
log-sum-exp (the kernel's forward's): cuDNN's flash backward against ours, gradients checked against cuDNN's.
TFLOP/s count a causal mask's visible half; the backward counts as 2.5 forwards.
``--smoke`` runs a small case on the CPU: XLA's attention for cuDNN, the kernels in Mosaic GPU interpret mode.
``--sustain_s`` times each contestant in blocks of back-to-back runs instead of single runs: a GPU at its power
cap clocks by the power drawn, so single runs in rotation share one clock and hide what a contestant's own draw
does to it; a block runs at the clock the contestant allows alone, as a training loop of it does (each records
that clock and power, ``benchmarks.clocks``). ``--training_steps`` keeps some of the training contestants;
``--trace_rounds`` traces each contestant's kernels after its timing (``benchmarks.kernel_trace``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jaxmercury as jm
from benchmarks import cases, harness
from jaxmercury._cpu_flags import cpu_flags
from jaxmercury.kernels import registry
from jaxmercury.kernels.attention import ws as ws_attention
from jaxmercury.kernels.attention.cudnn import cudnn_backward
from jaxmercury.kernels.attention.ws_forward import fused_ring_attention_ws
from jaxmercury.tuner import measure


def smoke_flags():
  """The CPU flags of a ``--smoke`` run (``_cpu_flags``: interpreted kernels one at a time, so that two kernels'
  host callbacks cannot hold both of a small machine's XLA threads), set before JAX makes its client."""
  os.environ["XLA_FLAGS"] = cpu_flags(os.environ.get("XLA_FLAGS", ""))


def seq_length(text: str) -> int:
  """A sequence length from ``"16K"`` (times 1024) or ``"500"``."""
  return int(text[:-1]) * 1024 if text.upper().endswith("K") else int(text)


def kernel_forward(mesh, causal: bool, smoke: bool):
  """The kernel's forward at its defaults on a one-device ``mesh``, jitted: ``(q, k, v) -> out``."""
  kernel = lambda q, k, v: fused_ring_attention_ws(q, k, v, "x", causal=causal, interpret=smoke)
  return jax.jit(jax.shard_map(lambda q, k, v: kernel(q, k, v)[0], mesh=mesh, in_specs=(P(),) * 3, out_specs=P(),
                               check_vma=False))


def _schedule_step(mesh, b, s, h, kv, d, causal, smoke: bool, kernel: str = "fused_ring_attention_ws", **params):
  """The training step of the ring schedule lowered with the fused kernel at ``params`` (or patched with a local
  ``kernel``), on ``[b, s, h, d]`` inputs."""
  prog = jm.programs.attention(b, h, kv, s, s, d, causal=causal, dtype=jnp.bfloat16)
  mode = registry.interpret_mode if smoke else contextlib.nullcontext
  with mode():  # the kernels are chosen when built and made when traced: in interpret mode for --smoke
    ring = jm.library(prog, mesh)["ring"]
    schedule = ring.lower_with(kernel, **params) if kernel.startswith("fused") else ring.patch(kernel)
    fn = schedule.compile(differentiable=True)

  def traced(q, k, v):
    with mode():
      return fn(q, k, v)
  return measure.training_step(traced)


def cudnn_forward(causal: bool, smoke: bool):
  """``(q, k, v) -> out``: ``jax.nn.dot_product_attention(implementation="cudnn")`` (``smoke``: XLA's)."""
  impl = "xla" if smoke else "cudnn"
  return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=impl)


def one_device_mesh():
  """The one-device mesh every case runs on (axis ``x``)."""
  return jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))


TRAINING_STEPS = ("cudnn", "ws", "ws_own", "cudnn_blocks")  # --training's contestants (cudnn_blocks: GPUs only)


def training_step(name: str, mesh, b: int, s: int, h: int, kv: int, d: int, causal: bool, smoke: bool):
  """``--training``'s contestant ``name``, jitted: ``cudnn`` the vjp of cuDNN's attention (``smoke``: XLA's);
  ``ws``, ``ws_own`` the ring schedule lowered with the fused kernel, with cuDNN's backward or ours;
  ``cudnn_blocks`` the schedule on cuDNN blocks."""
  if name == "cudnn":
    return measure.training_step(cudnn_forward(causal, smoke))
  if name == "cudnn_blocks":
    return _schedule_step(mesh, b, s, h, kv, d, causal, smoke, "cudnn_attention")
  params = {"backward": "ws_attention"} if name == "ws_own" else {}
  return _schedule_step(mesh, b, s, h, kv, d, causal, smoke, **params)


def random_qkv(keys, b: int, s: int, h: int, kv: int, d: int) -> list:
  """Fresh bf16 ``q [b, s, h, d]``, ``k, v [b, s, kv, d]`` from the first three of ``keys``."""
  q = jax.random.normal(keys[0], (b, s, h, d), jnp.bfloat16)
  return [q] + [jax.random.normal(key, (b, s, kv, d), jnp.bfloat16) for key in keys[1:3]]


def backward_inputs(inputs, key, causal: bool, smoke: bool):
  """``(q, k, v, o, do, lse [b, s, h])``: the forward's output and log-sum-exp from the kernel (one device)."""
  q, k, v = inputs
  out, lse = jax.jit(lambda q, k, v: fused_ring_attention_ws(q, k, v, None, causal=causal, interpret=smoke))(q, k, v)
  do = jax.random.normal(key, q.shape, q.dtype)
  return [q, k, v, out, do, jnp.transpose(lse, (0, 2, 1))]


def cudnn_backward_of(causal: bool, smoke: bool):
  """``(q, k, v, o, do, lse [b, s, h]) -> (dq, dk, dv)``, jitted: cuDNN's flash backward (``smoke``: XLA's)."""
  if smoke:  # no cuDNN on the CPU: XLA's derivative of the plain attention
    return jax.jit(lambda *a: registry.local("xla").backward.whole(*a, causal))
  return jax.jit(lambda *a: cudnn_backward(*a, causal))


def ws_backward_of(causal: bool, smoke: bool):
  """The same signature, jitted: our one-pass backward (``smoke``: in interpret mode)."""
  return jax.jit(lambda *a: ws_attention.whole(*a, causal, interpret=smoke))


def run_case(args, mesh, s: int, kv: int, causal: bool, deadline: float) -> dict:
  b, h, d = args.batch, args.heads, args.head_dim
  keys = jax.random.split(jax.random.key(args.seed + s + 7 * kv + causal), 4)
  inputs = random_qkv(keys, b, s, h, kv, d)
  cudnn = cudnn_forward(causal, args.smoke)
  label = f'jax.nn.dot_product_attention(implementation="{"xla" if args.smoke else "cudnn"}")'
  if args.training:
    inputs.append(jax.random.normal(keys[3], (b, s, h, d), jnp.bfloat16))
    step = lambda name: lambda: training_step(name, mesh, b, s, h, kv, d, causal, args.smoke)
    contestants = [harness.Contestant("cudnn", "baseline", step("cudnn"), f"jax.vjp of {label}"),
                   harness.Contestant("ws", "jaxmercury", step("ws"),
                                      "ring schedule lowered with fused_ring_attention_ws, its own backward"),
                   harness.Contestant("ws_own", "jaxmercury", step("ws_own"),
                                      "the same, configured with backward='ws_attention': our one-pass backward "
                                      "kernel", record={"backward": "ws_attention"})]
    if not args.smoke:  # the same backward after cuDNN's forward: which half a gap is in
      contestants.append(harness.Contestant(
          "cudnn_blocks", "jaxmercury", step("cudnn_blocks"),
          "the ring schedule patched with cuDNN blocks: cuDNN's forward, the same backward"))
    contestants = [c for c in contestants if c.name == "cudnn" or c.name in args.training_steps]
    tolerance = measure.gradient_tolerance(jnp.bfloat16)
  elif args.backward:
    inputs = backward_inputs(inputs, keys[3], causal, args.smoke)
    contestants = [harness.Contestant("cudnn", "baseline", lambda: cudnn_backward_of(causal, args.smoke),
                                      "cuDNN's flash backward (the one jax.nn.dot_product_attention's vjp runs)"),
                   harness.Contestant("ws", "jaxmercury", lambda: ws_backward_of(causal, args.smoke),
                                      "kernels.attention.ws_backward at its defaults: dq, dk, dv in one pass "
                                      "(ws_attention.whole)")]
    tolerance = measure.gradient_tolerance(jnp.bfloat16)
  else:
    contestants = [harness.Contestant("cudnn", "baseline", lambda: jax.jit(cudnn), label),
                   harness.Contestant("ws", "jaxmercury", lambda: kernel_forward(mesh, causal, args.smoke),
                                      "fused_ring_attention_ws at its defaults, a one-device ring")]
    tolerance = harness.BF16_TOLERANCE
  seq = f"{s // 1024}K" if s >= 1024 else str(s)
  mode = " training" if args.training else " backward" if args.backward else ""
  name = f"B{b} S{seq} H{h} KV{kv} D{d}{' causal' if causal else ''}{mode}"
  harness.log(f"case {name}")
  settings = harness.Settings(iters=args.iters, warmup=3, max_timing_s=args.max_timing_s, deadline=deadline,
                              tolerance=tolerance, min_timing_s=args.min_timing_s, sustain_s=args.sustain_s,
                              trace_rounds=args.trace_rounds)
  records, ref = harness.run_contestants(contestants, inputs, settings)
  flops = 4 * b * h * s * s * d / (2 if causal else 1) * (3.5 if args.training else 2.5 if args.backward else 1.0)
  case = {"name": name, "batch": b, "seq": s, "heads": h, "kv_heads": kv, "head_dim": d, "causal": causal,
          "training": args.training, "backward": args.backward}
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
      clock = f" {r['clocks']['sm_mhz']} MHz" if "clocks" in r else ""
      cells.append(f"{r['median_ms']:.3f} ({r['ratio_to_best_baseline']:.3f}){clock}{ok}" if "median_ms" in r
                   else r.get("error", r.get("skipped", ""))[:40])
    lines.append(f"| {c['name']} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True)
  parser.add_argument("--seqs", nargs="+", default=["4K", "8K", "16K", "32K", "64K"])
  parser.add_argument("--kv", nargs="+", type=int, default=[32, 8])
  parser.add_argument("--causal", choices=["both", "yes", "no"], default="both")
  parser.add_argument("--training", action="store_true")
  parser.add_argument("--training_steps", nargs="+", default=list(TRAINING_STEPS[1:]), choices=TRAINING_STEPS[1:],
                      help="with --training, these contestants beside cuDNN's (default: all)")
  parser.add_argument("--backward", action="store_true", help="the backward alone: cuDNN's against our kernel")
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--heads", type=int, default=32)
  parser.add_argument("--head_dim", type=int, default=128)
  parser.add_argument("--iters", type=int, default=20)
  parser.add_argument("--min_timing_s", type=float, default=0.5)
  parser.add_argument("--max_timing_s", type=float, default=3.0)
  parser.add_argument("--sustain_s", type=float, default=0.0,
                      help="time --iters blocks of back-to-back runs this long each (a GPU at its power cap then "
                           "clocks as under that contestant alone; measure.sustained); 0: single runs")
  parser.add_argument("--trace_rounds", type=cases.count, default=0,
                      help="after the timing, this many rounds more under the profiler: each contestant's kernels "
                           "(benchmarks.kernel_trace)")
  parser.add_argument("--time_budget", type=float, default=480.0)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--smoke", action="store_true", help="a small case on the CPU (XLA, interpret mode)")
  args = parser.parse_args(argv)
  if args.smoke:
    args.seqs, args.kv, args.heads, args.head_dim, args.iters, args.min_timing_s = ["256"], [2], 4, 64, 3, 0.0
    smoke_flags()
  start = time.time()
  deadline = start + args.time_budget
  mesh = one_device_mesh()
  out = harness.header("ws_local", [])
  out["command"] = "python -m benchmarks.ws_local " + " ".join(sys.argv[1:] if argv is None else argv)
  out["sustain_s"] = args.sustain_s  # 0: rotating single runs; else blocks of back-to-back runs this long
  out["cases"] = []
  for s in map(seq_length, args.seqs):
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
