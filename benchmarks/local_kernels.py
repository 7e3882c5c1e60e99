"""Local attention kernels on one GPU against cuDNN's ``jax.nn.dot_product_attention``.

Every registered kernel that implements the attention pattern and runs on the
device (and, with ``--variants``, each of its tunable block sizes) computes
one whole block (B, S, H, KV, D; causal or not) in one process, side by side
with ``jax.nn.dot_product_attention(implementation="cudnn")``. Outputs are
checked against cuDNN's; times are medians of interleaved runs; rates are in
TFLOP/s (causal counts the visible half). The chosen default per shape is
the fastest kernel that agrees, and it must reach 90% of cuDNN's rate.
``--backward`` times forward+backward instead: each kernel followed by the
backward kernels the dual schedules patch in (dq, then dk/dv, from the saved
log-sum-exp), against ``jax.vjp`` of cuDNN's attention; flops count the
backward as 2.5 forwards.

  python -m benchmarks.local_kernels --out benchmarks/results/<date>-local_kernels-<device>.json
  python -m benchmarks.local_kernels --backward --out <...>.json    # forward+backward
  python -m benchmarks.local_kernels --smoke --out /tmp/k.json      # CPU, interpret mode, toy sizes
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import time

if "--smoke" in sys.argv:
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

import jaxmercury as jm  # noqa: E402
from benchmarks import harness  # noqa: E402
from jaxmercury.kernels import registry  # noqa: E402
from jaxmercury.ir.program import BlockContext  # noqa: E402

DEFAULT_RATIO = 0.9  # the chosen default's rate over cuDNN's, at least
XLA_MAX_SEQ = 8192  # XLA's attention holds the S x S scores: skipped above this


def _whole_block(prog):
  """The context of one block covering every axis, and the queries' canonical shape [b, s, hk, g, d]."""
  extents = {n: a.extent for n, a in prog.axes.items()}
  return BlockContext(starts={}, sizes=extents, extents=extents), prog.buffer("q").canonical_shape


def kernel_fn(name, prog, mesh):
  """``(q [b,s,h,d], k, v) -> out [b,s,h,d]`` through kernel ``name`` on one whole block."""
  block = registry.lookup(name, prog, mesh)
  ctx, q_shape = _whole_block(prog)

  def run(q, k, v):
    out, _ = block(ctx, q.reshape(q_shape), k, v)
    return out.astype(q.dtype).reshape(q.shape)
  return jax.jit(run)


def backward_fn(name, prog, mesh):
  """``(q, k, v, do) -> [dq, dk, dv]`` flattened: kernel ``name``'s forward, then its backward kernels.

  The backward kernels are the ones the dual schedules patch in
  (``dual.BACKWARD_KERNELS``; the programs' XLA bodies for ``xla``): dq and
  dk/dv are two calls, each recomputing the probabilities from the lse.
  """
  from jaxmercury.programs import attention_backward as ab
  from jaxmercury.schedules.dual import BACKWARD_KERNELS
  base = name.partition("[")[0]
  forward = registry.lookup(name, prog, mesh)
  dq_block = registry.lookup(BACKWARD_KERNELS["dq"].get(base, "xla"), ab.attention_dq(prog), mesh)
  dkv_block = registry.lookup(BACKWARD_KERNELS["dkv"].get(base, "xla"), ab.attention_dkv(prog), mesh)
  ctx, q_shape = _whole_block(prog)

  def run(q, k, v, do):
    q5, do5 = q.reshape(q_shape), do.reshape(q_shape)
    out, lse = forward(ctx, q5, k, v)
    o5 = out.astype(q.dtype)
    dq = dq_block(ctx, q5, k, v, o5, do5, lse)
    dkv = dkv_block(ctx, q5, k, v, o5, do5, lse)
    return jnp.concatenate([dq.ravel(), dkv[..., 0, :].ravel(), dkv[..., 1, :].ravel()])
  return jax.jit(run)


def grad_of(attend):
  """``(q, k, v, do) -> [dq, dk, dv]`` flattened, by ``jax.vjp`` of ``attend(q, k, v)``."""
  def run(q, k, v, do):
    _, vjp = jax.vjp(attend, q, k, v)
    return jnp.concatenate([g.astype(jnp.float32).ravel() for g in vjp(do)])
  return jax.jit(run)


def contestants(prog, mesh, *, variants: bool, on_gpu: bool, backward: bool = False):
  causal, seq = prog.params["causal"], prog.params["q_len"]
  out = []
  wrap = grad_of if backward else jax.jit
  if on_gpu:
    attend = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
    out.append(harness.Contestant("cudnn_dpa", "baseline", lambda: wrap(attend),
                                  label='jax.nn.dot_product_attention(implementation="cudnn")'
                                  + (", jax.vjp" if backward else "")))
  else:
    out.append(harness.Contestant("reference", "baseline", lambda: wrap(prog.reference),
                                  label="the program's reference" + (", jax.vjp" if backward else "")))
  make = backward_fn if backward else kernel_fn
  for name in registry.candidates(prog, mesh, variants=variants):
    skip = f"XLA holds the {seq}x{seq} scores" if name == "xla" and seq > XLA_MAX_SEQ else None
    out.append(harness.Contestant(name, "jaxmercury", lambda name=name: make(name, prog, mesh),
                                  label=f"kernel {name}" + (" and its backward kernels" if backward else ""),
                                  skip=skip))
  return out


def run_case(batch, seq, heads, kv_heads, dim, causal, mesh, args, on_gpu):
  prog = jm.programs.attention(batch, heads, kv_heads, seq, seq, dim, causal=causal, dtype=jnp.bfloat16)
  config = f"B{batch} S{seq} H{heads} KV{kv_heads} D{dim}{' causal' if causal else ''}"
  harness.log(config)
  key = jax.random.key(int(time.time_ns() % (1 << 31)))
  inputs = prog.random_inputs(key)
  if args.backward:  # the incoming gradient, like the output
    inputs += (jax.random.normal(jax.random.fold_in(key, 1), prog.writes.shape, jnp.float32).astype(jnp.bfloat16),)
  field = contestants(prog, mesh, variants=args.variants, on_gpu=on_gpu, backward=args.backward)
  prepared = harness.prepare(field, inputs, warmup=args.warmup, iters=args.iters, max_timing_s=args.max_timing_s,
                             order=("cudnn_dpa", "reference"))
  times = harness.time_interleaved(prepared.ready, prepared.records, inputs)
  harness.summarize(prepared.records, times)
  records = list(prepared.records.values())
  flops = prog.flops * (3.5 if args.backward else 1.0)  # forward 2 matmuls, backward 5
  best_base = harness.rank(records, None, flops)
  ours = [r for r in records if r["role"] == "jaxmercury" and "median_ms" in r and r.get("numerics_ok")]
  default = min(ours, key=lambda r: r["median_ms"], default=None)
  case = {"config": config, "batch": batch, "seq": seq, "heads": heads, "kv_heads": kv_heads, "head_dim": dim,
          "causal": causal, "pass": "forward+backward" if args.backward else "forward", "flops": flops,
          "records": records,
          "default": default and default["name"],
          "default_over_cudnn": default and best_base and best_base["median_ms"] / default["median_ms"]}
  if default and best_base:
    case["default_meets_90pct"] = case["default_over_cudnn"] >= DEFAULT_RATIO
  for r in records:
    rate = f"{r['tflops_per_device']:.0f} TFLOP/s" if "tflops_per_device" in r else r.get("error") or r.get("skipped")
    harness.log(f"  {r['name']:<40} {rate}  rel err {r.get('rel_err', float('nan')):.1e}")
  return case


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", required=True)
  p.add_argument("--smoke", action="store_true", help="CPU, kernels in interpret mode, toy sizes")
  p.add_argument("--seqs", type=int, nargs="*", default=[4096, 8192, 16384, 32768])
  p.add_argument("--kv_heads", type=int, nargs="*", default=[32, 8])
  p.add_argument("--causal", choices=("both", "yes", "no"), default="both")
  p.add_argument("--variants", action="store_true", help="every tunable block size of every kernel")
  p.add_argument("--backward", action="store_true",
                 help="time forward+backward: each kernel with its backward kernels against jax.vjp of cuDNN")
  p.add_argument("--iters", type=int, default=20)
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--max_timing_s", type=float, default=3.0)
  p.add_argument("--time_budget", type=float, default=540.0)
  args = p.parse_args(argv)
  on_gpu = jax.devices()[0].platform == "gpu"
  mesh = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:1])
  heads, dim, batch = (32, 128, 1) if not args.smoke else (4, 32, 1)
  seqs = args.seqs if not args.smoke else [128]
  kv_list = args.kv_heads if not args.smoke else [4, 2]
  causal_list = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
  start = time.time()
  out = {"device": jax.devices()[0].device_kind, "jax_version": jax.__version__,
         "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
         "command": "python -m benchmarks.local_kernels " + " ".join(sys.argv[1:] if argv is None else argv),
         "cases": []}
  with registry.interpret_mode() if args.smoke else contextlib.nullcontext():
    for seq in seqs:
      for kv in kv_list:
        for causal in causal_list:
          if time.time() - start > args.time_budget:
            harness.log(f"time budget spent: S{seq} KV{kv} causal={causal} not run")
            continue
          out["cases"].append(run_case(batch, seq, heads, kv, dim, causal, mesh, args, on_gpu))
          with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
  print(json.dumps([{k: c[k] for k in ("config", "default", "default_over_cudnn")} for c in out["cases"]], indent=1))


if __name__ == "__main__":
  main()
