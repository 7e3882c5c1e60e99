"""Forward+backward of causal attention: jaxmercury's rings against all-gathered K/V + cuDNN.

Also reports each rank's share of the causal work (unmasked query-key pairs)
for the contiguous ring and the zigzag ring.

  python -m benchmarks.training_check --out results.json [--smoke]
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxmercury as jm  # noqa: E402
from benchmarks import harness  # noqa: E402
from jaxmercury.kernels import registry  # noqa: E402
from jaxmercury.ir import orders  # noqa: E402
from benchmarks.baselines import xla as base  # noqa: E402


def rank_work(seq: int, ranks: int, zigzag: bool) -> list[int]:
  """Unmasked (query, key) pairs each rank computes under a causal mask."""
  true = orders.permutation(seq, 2 * ranks) if zigzag else np.arange(seq)
  per = seq // ranks
  return [int(np.sum(true[r * per:(r + 1) * per] + 1)) for r in range(ranks)]


def rel(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def run_case(mesh, seq, heads, kv_heads, dim, iters, kernel):
  prog = jm.programs.attention(1, heads, kv_heads, seq, seq, dim, causal=True, dtype=jnp.bfloat16)
  xs = prog.random_inputs(jax.random.key(0))
  cot = jax.random.normal(jax.random.key(1), prog.writes.shape, jnp.bfloat16)
  seq_spec = NamedSharding(mesh, P(None, "x"))
  xs = [jax.device_put(x, seq_spec) for x in xs]
  cot = jax.device_put(cot, seq_spec)
  lib = jm.library(prog, mesh)
  contestants = {"base:cp_allgather[cudnn, explicit mask]": base.context_parallel_attention(
      mesh, causal=True, implementation="cudnn" if kernel == "cudnn_attention" else "xla")}
  for name in ("ring", "ring_zigzag"):
    s = lib[name]
    if kernel != "xla":
      s.patch(kernel)
    contestants[f"jm:{name}[{kernel}]"] = s.compile()
  rows, want = [], None
  for name, f in contestants.items():
    loss = lambda q, k, v, f=f: jnp.sum(f(q, k, v).astype(jnp.float32) * cot.astype(jnp.float32))
    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    try:
      value, grads = grad(*xs)
      if want is None:
        want = grads
      err = max(rel(g, w) for g, w in zip(grads, want))
      fwd_ms = harness.time_call(jax.jit(f), xs, iters=iters, max_s=120.0)
      both_ms = harness.time_call(grad, xs, iters=iters, max_s=120.0)
      rows.append({"name": name, "forward_ms": fwd_ms, "forward_backward_ms": both_ms, "grad_rel_err": err})
    except Exception as e:  # noqa: BLE001 - record and go on
      rows.append({"name": name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
    print(json.dumps(rows[-1]), flush=True)
  ranks = mesh.devices.size
  work = {"ring": rank_work(seq, ranks, False), "ring_zigzag": rank_work(seq, ranks, True)}
  imbalance = {k: max(v) / statistics.mean(v) for k, v in work.items()}
  return {"config": f"B1 S{seq} H{heads} KV{kv_heads} D{dim} causal bf16", "contestants": rows,
          "rank_work_pairs": work, "max_over_mean_work": imbalance}


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--out", required=True)
  p.add_argument("--smoke", action="store_true")
  p.add_argument("--iters", type=int, default=5)
  p.add_argument("--seq", type=int, nargs="*", default=[32768, 65536])
  args = p.parse_args()
  n = len(jax.devices())
  mesh = jax.make_mesh((n,), ("x",), axis_types=(AxisType.Auto,))
  probe = jm.programs.attention(1, 8, 8, 64, 64, 64, causal=True, dtype=jnp.bfloat16)
  kernel = "cudnn_attention" if "cudnn_attention" in registry.candidates(probe, mesh) else "xla"
  if args.smoke:
    cases = [run_case(mesh, 256, 4, 2, 32, 2, kernel)]
  else:
    cases = [run_case(mesh, s, 32, 8, 128, args.iters, kernel) for s in args.seq]
  out = {"device": jax.devices()[0].device_kind, "n_devices": n, "jax_version": jax.__version__,
         "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
         "command": "python -m benchmarks.training_check " + " ".join(sys.argv[1:]), "cases": cases}
  with open(args.out, "w") as f:
    json.dump(out, f, indent=1)
  print(json.dumps([{k: c[k] for k in ("config", "max_over_mean_work")} for c in cases], indent=1))


if __name__ == "__main__":
  main()
