"""Attention's backward as jaxmercury runs it, side by side on the same residuals, in one process.

  python -m benchmarks.attention_backward --out results.json [--seq 16384 32768] [--kv_heads 8] [--causal]
      [--tiles 2]
  python -m benchmarks.attention_backward --smoke --out /tmp/attention_backward.json   # 2 simulated CPU devices

The schedule is the library's ``ring`` over every device (one level ``"x"``),
its queries and keys on each device tiled ``--tiles`` times more (serial
block pairs), patched with cuDNN (``"xla"`` in ``--smoke``); B1 H32 D128
bf16. Every contestant maps the same ``(q, k, v, o, do, lse)`` (the
schedule's forward residuals, a fresh random cotangent) to ``(dq, dk, dv)``,
checked against the first contestant's:

- ``joint``: the dual programs in one nest (``lowering.joint_backward``):
  one backward block call per block pair;
- ``apart``: the same dual schedules one after the other, as before
  2026-11-24: each runs a backward block call per block pair (cuDNN's
  computes dq, dk and dv and each program keeps its part), and each its own
  ring of keys and values;
- ``local`` (one device only): one cuDNN backward call over each device's
  whole attention (``local_backward``), what ``jax.nn.dot_product_attention``'s
  gradient runs.

Records: median ms and TFLOP/s per device (the backward's work counted as
2.5 forwards: recomputed scores, dV, dP, dQ, dK).
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

import jaxmercury as jm  # noqa: E402
from benchmarks import harness  # noqa: E402

HEADS, HEAD_DIM, BATCH = 32, 128, 1
GRAD_TOLERANCE = 3e-2  # relative error of bf16 gradients against the first contestant's


def schedule_for(mesh, prog, tiles: int, kernel: str):
  """The library's ring over ``mesh``, each device's queries and keys tiled ``tiles`` times, patched."""
  ring = jm.library(prog, mesh)["ring"]
  if tiles > 1:
    ring.tile("i_in", tiles).tile("j_in", tiles)
  return ring.patch(kernel) if kernel != "xla" else ring


def contestants(schedule):
  """(name, label, builder) of each way to run ``schedule``'s backward, and the residuals' forward."""
  from jaxmercury.schedules.dual import attention_duals
  from jaxmercury.lowering.joint_backward import joint_backward
  from jaxmercury.lowering.local_backward import local_backward
  with_lse, dq_s, dkv_s = attention_duals(schedule, joint=True)

  def split(f):
    def run(*residuals):
      dq, dkv = f(*residuals)
      return dq, dkv[..., 0, :], dkv[..., 1, :]
    return jax.jit(run)

  def apart():
    _, dq_a, dkv_a = attention_duals(schedule)
    f_dq, f_dkv = dq_a.compile(), dkv_a.compile()
    return split(lambda *r: (f_dq(*r), f_dkv(*r)))

  out = [harness.Contestant("joint", "jaxmercury", lambda: split(joint_backward(dq_s, dkv_s)),
                            "dq and dk-dv programs in one nest: one backward block call per block pair"),
         harness.Contestant("apart", "previous", apart,
                            "dq and dk-dv programs one after the other (before 2026-11-24)")]
  local = local_backward(schedule) if schedule.mesh.devices.size == 1 else None
  out.append(harness.Contestant("local", "baseline", lambda: jax.jit(local),
                                "one cuDNN backward call over the device's attention (jax.nn's gradient)",
                                skip=None if local is not None else "several devices: the attention is split"))
  return with_lse.compile(differentiable=False), out


def run_case(mesh, seq: int, kv_heads: int, causal: bool, tiles: int, kernel: str, iters: int) -> dict:
  n = mesh.devices.size
  label = f"B{BATCH} S{seq} H{HEADS} KV{kv_heads} D{HEAD_DIM} bf16 {'causal' if causal else 'non-causal'} backward"
  harness.log(f"case {label} on {n} devices, tiles {tiles}")
  prog = jm.programs.attention(BATCH, HEADS, kv_heads, seq, seq, HEAD_DIM, causal=causal, dtype=jnp.bfloat16)
  schedule = schedule_for(mesh, prog, tiles, kernel)
  forward, entrants = contestants(schedule)
  key = jax.random.key(random.SystemRandom().randrange(1 << 31))
  q, k, v = prog.random_inputs(key)
  olse = forward(q, k, v)
  do = jax.random.normal(jax.random.fold_in(key, 1), prog.writes.shape, jnp.float32).astype(jnp.bfloat16)
  residuals = (q, k, v, olse[..., :-1].astype(jnp.bfloat16), do, olse[..., -1])
  del olse
  prepared = harness.prepare(entrants, residuals, warmup=2, iters=iters, max_timing_s=10.0, tolerance=GRAD_TOLERANCE)
  harness.summarize(prepared.records, harness.time_interleaved(prepared.ready, prepared.records, residuals))
  flops = 2.5 * 4 * BATCH * HEADS * seq * (seq // n) * HEAD_DIM * (0.5 if causal else 1)
  records = list(prepared.records.values())
  harness.rank(records, None, flops)
  times = {r["name"]: r.get("median_ms") for r in records}
  summary = {"apart_over_joint": times["apart"] / times["joint"] if times["apart"] and times["joint"] else None,
             "joint_over_local": times["joint"] / times["local"] if times["local"] and times["joint"] else None}
  harness.log(json.dumps({"case": label, **summary}))
  return {"case": label, "seq": seq, "kv_heads": kv_heads, "causal": causal, "tiles": tiles, "schedule": str(schedule),
          "flops_per_device": flops, "reference": prepared.reference, "records": records, "summary": summary}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", required=True)
  p.add_argument("--seq", type=int, nargs="+", default=[16384, 32768])
  p.add_argument("--kv_heads", type=int, nargs="+", default=[8])
  p.add_argument("--causal", action="store_true")
  p.add_argument("--tiles", type=int, default=2, help="serial tiles of each device's queries and of its keys")
  p.add_argument("--iters", type=int, default=10)
  p.add_argument("--smoke", action="store_true", help="a tiny case on 2 simulated CPU devices, XLA blocks")
  args = p.parse_args(argv)
  n = len(jax.devices())
  mesh = jax.make_mesh((n,), ("x",), axis_types=(AxisType.Auto,))
  seqs, kv_heads = ([256 * n], [8]) if args.smoke else (args.seq, args.kv_heads)
  out = {**harness.run_header("attention_backward", argv), "cases": []}
  for kv in kv_heads:
    for seq in seqs:
      out["cases"].append(run_case(mesh, seq, kv, args.causal, args.tiles, "xla" if args.smoke else "cudnn_attention",
                                   2 if args.smoke else args.iters))
      with open(args.out, "w", encoding="utf-8") as f:  # after every case: a run cut short keeps its data
        json.dump(out, f, indent=1)
  bad = harness.failed_contestants(out["cases"])
  if bad:
    raise SystemExit(f"contestants failed or disagree: {bad}")


if __name__ == "__main__":
  main()
