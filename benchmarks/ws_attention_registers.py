"""The warp-specialized attention's register split side by side with cuDNN, on one GPU, in one process.

  python -m benchmarks.ws_attention_registers --out results.json [--seq 16384 32768] [--kv_heads 32 8] [--causal]

B1 H32 D128 bf16, one device (no ring: the local attention). Contestants,
all on the same inputs, each output checked against the first's: ``cudnn``
(baseline, ``jax.nn.dot_product_attention(implementation="cudnn")``) and
``ws[<consumer>/<memory>]`` (jaxmercury): ``fused_ring_attention_ws`` at its
default blocks traced with ``CONSUMER_REGISTERS`` and ``MEMORY_REGISTERS``
set to each split in ``SPLITS`` (the three warpgroups start with
``LAUNCH_REGISTERS`` = 168 each, and a split asking for more than 3 x 168 in
all hangs: 240/32 did). Each record has the median ms, its ratio to cuDNN
(above 1: faster) and TFLOP/s.
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import sys

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks import harness
from jaxmercury.kernels import fused_ring_attention_ws as ws

HEADS, HEAD_DIM, BATCH = 32, 128, 1
SPLITS = ((232, 40), (240, 24))


def _compiled_ws(mesh, causal: bool, split: tuple[int, int], inputs):
  """The kernel compiled with the register split (the constants are read while it is traced)."""
  body = lambda q, k, v: ws.fused_ring_attention_ws(q, k, v, "x", causal=causal)[0]
  spec = P(None, "x")
  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False))
  kept = ws.CONSUMER_REGISTERS, ws.MEMORY_REGISTERS
  ws.CONSUMER_REGISTERS, ws.MEMORY_REGISTERS = split
  try:
    return fn.lower(*inputs).compile()
  finally:
    ws.CONSUMER_REGISTERS, ws.MEMORY_REGISTERS = kept


def run_case(mesh, seq: int, kv_heads: int, iters: int, causal: bool) -> dict:
  label = f"B{BATCH} S{seq} H{HEADS} KV{kv_heads} D{HEAD_DIM} bf16 {'causal' if causal else 'non-causal'}"
  harness.log(f"case {label}")
  keys = jax.random.split(jax.random.key(random.SystemRandom().randrange(1 << 31)), 3)
  sharding = NamedSharding(mesh, P())
  inputs = tuple(harness.random_array(k, shape, jnp.bfloat16, sharding)
                 for k, shape in zip(keys, [(BATCH, seq, HEADS, HEAD_DIM)] + [(BATCH, seq, kv_heads, HEAD_DIM)] * 2))
  cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn"))
  contestants = [harness.Contestant("cudnn", "baseline", lambda: cudnn, "cuDNN flash attention")]
  for split in SPLITS:
    contestants.append(harness.Contestant(f"ws[{split[0]}/{split[1]}]", "jaxmercury",
                                          lambda split=split: _compiled_ws(mesh, causal, split, inputs),
                                          "fused_ring_attention_ws, consumer/memory registers"))
  prepared = harness.prepare(contestants, inputs, warmup=3, iters=iters, max_timing_s=10.0)
  harness.summarize(prepared.records, harness.time_interleaved(prepared.ready, prepared.records, inputs))
  flops = 4 * BATCH * HEADS * seq * seq * HEAD_DIM * (0.5 if causal else 1)
  records = list(prepared.records.values())
  harness.rank(records, None, flops)
  for r in records:
    harness.log(f"  {r['name']:14s} {r.get('median_ms', float('nan')):8.3f} ms  x{r.get('ratio_to_best_baseline')}  "
                f"{r.get('tflops_per_device')} TFLOP/s  {r.get('error', '')[:300]}")
  return {"case": label, "seq": seq, "kv_heads": kv_heads, "causal": causal, "flops": flops,
          "reference": prepared.reference, "records": records}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", required=True)
  p.add_argument("--seq", type=int, nargs="+", default=[16384, 32768])
  p.add_argument("--kv_heads", type=int, nargs="+", default=[32, 8])
  p.add_argument("--causal", action="store_true")
  p.add_argument("--iters", type=int, default=10)
  args = p.parse_args(argv)
  mesh = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])
  out = {"device": jax.devices()[0].device_kind, "jax_version": jax.__version__,
         "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
         "command": "python -m benchmarks.ws_attention_registers " + " ".join(sys.argv[1:] if argv is None else argv),
         "cases": []}
  for kv in args.kv_heads:
    for seq in args.seq:
      out["cases"].append(run_case(mesh, seq, kv, args.iters, args.causal))
      with open(args.out, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()
