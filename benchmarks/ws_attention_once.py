"""One call of the warp-specialized fused attention on one GPU, for profilers and compiler reports.

  MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=/tmp/d python3 -m benchmarks.ws_attention_once [--pipelined]
  ncu --clock-control none --kernel-name regex:body --launch-count 1 --section SpeedOfLight \
      --section WarpStateStats python3 -m benchmarks.ws_attention_once [--pipelined]

B1 S4096 H32 KV8 D128 bf16, random inputs, default blocks; prints the output's sum so that the call runs.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxmercury.kernels.fused_ring_attention_ws import fused_ring_attention_ws


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--pipelined", action="store_true", help="the consumers' softmax behind the previous P V")
  args = p.parse_args(argv)
  mesh = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])
  keys = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(key, (1, 4096, heads, 128), jnp.bfloat16) for key, heads in zip(keys, (32, 8, 8)))
  body = lambda q, k, v: fused_ring_attention_ws(q, k, v, "x", pipelined=args.pipelined)[0]
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, "x"),) * 3, out_specs=P(None, "x"), check_vma=False))
  print("pipelined" if args.pipelined else "default", float(f(q, k, v).astype(jnp.float32).sum()))


if __name__ == "__main__":
  main()
