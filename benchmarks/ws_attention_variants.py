"""The warp-specialized attention's consumer variants side by side with cuDNN, on one GPU, in one process.

  python -m benchmarks.ws_attention_variants --out results.json [--seq 16384 32768] [--kv_heads 32 8] [--causal]

B1 H32 D128 bf16, one device (no ring: the local attention). Contestants,
all on the same inputs, each output checked against the first's:

- ``cudnn`` (baseline): ``jax.nn.dot_product_attention(implementation="cudnn")``;
- ``ws[<tweaks>]`` (jaxmercury): ``fused_ring_attention_ws``'s kernel at its
  default blocks with each combination of the consumer tweaks on or off
  (``_kernel``'s keywords): ``fold`` (the ``1/sqrt(d)`` scale inside the
  exponent, one FMA per score), ``early`` (the next K tile waited for while
  ``P V`` runs), ``pin`` (the softmax pinned before the schedule barrier by
  ``optimization_barrier``); ``ws[-]`` has none.

Each record has the median ms, its ratio to cuDNN (above 1: faster) and TFLOP/s.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import random
import sys

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks import harness

HEADS, HEAD_DIM, BATCH = 32, 128, 1
TWEAKS = ("fold", "early", "pin")


def _ws(mesh, causal: bool, on: tuple[str, ...]):
  from jaxmercury.pallas_kernels import fused_ring_attention_ws as ws
  from jaxmercury.pallas_kernels.fused_ring_attention import SequenceOrder

  def body(q, k, v):
    blocks = ws.WsBlocks()
    order = SequenceOrder.make("natural", None, 1, q.shape[1], blocks)
    sms = jax.devices()[0].core_count
    return ws._kernel(q, k, v, "x", 1, blocks, sms, False, causal, order, fold_scale="fold" in on,
                      early_k_wait="early" in on, pin_softmax="pin" in on)[0]
  spec = P(None, "x")
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False))


def run_case(mesh, seq: int, kv_heads: int, iters: int, causal: bool) -> dict:
  label = f"B{BATCH} S{seq} H{HEADS} KV{kv_heads} D{HEAD_DIM} bf16 {'causal' if causal else 'non-causal'}"
  harness.log(f"case {label}")
  keys = jax.random.split(jax.random.key(random.SystemRandom().randrange(1 << 31)), 3)
  sharding = NamedSharding(mesh, P())
  inputs = tuple(harness.random_array(k, shape, jnp.bfloat16, sharding)
                 for k, shape in zip(keys, [(BATCH, seq, HEADS, HEAD_DIM)] + [(BATCH, seq, kv_heads, HEAD_DIM)] * 2))
  cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn"))
  contestants = [harness.Contestant("cudnn", "baseline", lambda: cudnn, "cuDNN flash attention")]
  for n in range(len(TWEAKS) + 1):
    for on in itertools.combinations(TWEAKS, n):
      contestants.append(harness.Contestant(f"ws[{','.join(on) or '-'}]", "jaxmercury",
                                            lambda on=on: _ws(mesh, causal, on), "fused_ring_attention_ws kernel"))
  prepared = harness.prepare(contestants, inputs, warmup=3, iters=iters, max_timing_s=10.0)
  harness.summarize(prepared.records, harness.time_interleaved(prepared.ready, prepared.records, inputs))
  flops = 4 * BATCH * HEADS * seq * seq * HEAD_DIM * (0.5 if causal else 1)
  records = list(prepared.records.values())
  harness.rank(records, None, flops)
  for r in records:
    harness.log(f"  {r['name']:22s} {r.get('median_ms', float('nan')):8.3f} ms  x{r.get('ratio_to_best_baseline')}"
                f"  {r.get('tflops_per_device')} TFLOP/s  {r.get('error', '')[:200]}")
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
         "command": "python -m benchmarks.ws_attention_variants " + " ".join(sys.argv[1:] if argv is None else argv),
         "cases": []}
  for kv in args.kv_heads:
    for seq in args.seq:
      out["cases"].append(run_case(mesh, seq, kv, args.iters, args.causal))
      with open(args.out, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()
