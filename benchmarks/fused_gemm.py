"""Fused all-gather GEMM and GEMM + reduce-scatter (issue 5) against the unfused programs, in one process.

  python -m benchmarks.fused_gemm --out results.json [--iters 20] [--kind allgather|reducescatter|both]
  python -m benchmarks.fused_gemm --smoke --out /tmp/fused.json   # tiny, 8 simulated CPU devices

Contestants per shape, all on the same inputs (x row-sharded, w
column-sharded, output column-sharded), each output checked against the
first: ``xla_allgather_dot`` (all_gather + dot in shard_map), ``jm_async_tp``
(jaxmercury's ``async_tp`` schedule: the shard_map ``ppermute`` ring),
``pallas_mgpu`` (``collective_matmul_mgpu.all_gather_lhs_matmul``, fastest
of its configurations), ``fused[<tiles>]`` (``fused_allgather_matmul``,
one record per tile variant) and ``fused_ws[<tiles>/...]``
(``fused_allgather_matmul_ws``: JAX's warp-specialized GEMM body with two
consumer warpgroups, at JAX's kernel's configurations) and
``fused_comm[<tiles>/<comm CTAs>]`` (``fused_allgather_matmul_comm``: 2, 4
or 8 CTAs only move A around the ring). The floor is one device's local GEMM of the
gathered rows (``[M, K] @ [K, N / devices]``), timed alone. Shapes: per-shard
M 1024 with K = N = 4096 (N per device), and the Llama-3 gate projections at
global M 8192 (K, N) = (4096, 14336) and (8192, 28672). These are
``cases`` in the results.

The reduce-scatter table (``reducescatter_cases``; x column-sharded, so each
device holds a K shard, w row-sharded, output row-sharded): the baseline
``xla_dot_psum_scatter`` (dot then float32 ``psum_scatter`` in shard_map),
``jm_async_tp_rs`` (jaxmercury's ``async_tp_reducescatter`` schedule) and
``fused_rs[<tiles>]`` (``fused_matmul_reducescatter``, one record per tile
variant) and ``fused_rs_ws[<tiles>/<split>]`` (``fused_matmul_reducescatter_ws``:
two consumer warpgroups per CTA). The floor is one device's local GEMM ``[M, K / devices] @
[K / devices, N]``, timed alone. Shapes: global M 4096 with K = N = 4096, and
the Llama-3 down projections at global M 8192 (N, K) = (4096, 14336) and
(8192, 28672), K split over the devices.

The Pallas kernels need Hopper GPUs; ``--smoke`` runs the rest at a tiny
shape on the CPU so the harness cannot rot.
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402

from benchmarks import harness  # noqa: E402
from benchmarks.baselines import gemm as base  # noqa: E402

TILES = ((128, 128, 64, 4), (128, 128, 64, 5), (64, 256, 64, 4), (128, 128, 128, 2))
WS_TILES = ((128, 128, 64, 3, "n"), (128, 64, 64, 4, "n"), (64, 128, 64, 4, "m"))  # the warp-specialized RS kernel
# The warp-specialized all-gather kernel, at JAX's kernel's configurations (base.PALLAS_CONFIGS): tile_m, tile_n,
# tile_k, pipeline depth, the warpgroups' split, the grid's minor dimension and band width.
WS_AG_TILES = ((128, 128, 64, 4, "n", "n", 8), (128, 128, 64, 4, "m", "m", 8), (256, 64, 64, 4, "n", "n", 8),
               (128, 128, 64, 4, "m", "n", 16))
COMM_TILES = ((128, 128, 64, 4, 2), (128, 128, 64, 4, 4), (128, 128, 64, 4, 8))  # + communication CTAs


def shapes(devices: int, smoke: bool = False) -> list[tuple[str, int, int, int]]:
  """``(label, global M, K, global N)``."""
  if smoke:
    return [("smoke M64 K128 N128 per shard", 64 * devices, 128, 128 * devices)]
  return [("per-shard M1024 K4096 N4096", 1024 * devices, 4096, 4096 * devices),
          ("Llama-3 8B gate M8192 K4096 N14336", 8192, 4096, 14336),
          ("Llama-3 70B gate M8192 K8192 N28672", 8192, 8192, 28672)]


def rs_shapes(devices: int, smoke: bool = False) -> list[tuple[str, int, int, int]]:
  """``(label, global M, global K, N)`` of the reduce-scatter table (K is split over the devices)."""
  if smoke:
    return [("smoke M64 per device K128 per shard N128", 64 * devices, 128 * devices, 128)]
  return [("M4096 K4096 N4096", 4096, 4096, 4096),
          ("Llama-3 8B down M8192 K14336 N4096", 8192, 14336, 4096),
          ("Llama-3 70B down M8192 K28672 N8192", 8192, 28672, 8192)]


def _fused_variants(mesh, specs, kernel, options, variants, prefix: str, how: str):
  """One contestant per variant ``t`` of the fused ``kernel`` (called with ``options(*t)`` as keywords):
  ``<prefix>[<m>x<n>x<k>/<rest>]``."""
  skip = base.pallas_unavailable(mesh, jnp.bfloat16)
  out = []
  for t in variants:
    body = lambda a, b, kw=options(*t): kernel(a, b, "x", **kw)
    fn = lambda body=body: jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs[:2], out_specs=specs[2],
                                                 check_vma=False))
    name = f"{prefix}[{t[0]}x{t[1]}x{t[2]}/{'/'.join(map(str, t[3:]))}]"
    out.append(harness.Contestant(name, "jaxmercury", fn, how, skip=skip))
  return out


def _tiles(tiles_type):
  return lambda *t: {"tiles": tiles_type(*t)}


def _ring_and_fused(mesh, m: int, k: int, n: int, specs, strategy: str, ring_name: str, ring_how: str, kernel,
                    prefix: str):
  """jaxmercury's shard_map ring ``strategy`` (a baseline here) and the fused ``kernel`` at every tile variant."""
  import jaxmercury as jm
  from jaxmercury.kernels.mosaic_matmul import Tiles
  from jaxmercury.tuner.autotuner import with_layouts
  x_spec, w_spec, out_spec = specs
  lib = jm.library(jm.programs.matmul(m, n, k, dtype=jnp.bfloat16), mesh)
  ring = with_layouts(lib[strategy], [x_spec, w_spec], out_spec) if strategy in lib else None
  out = [harness.Contestant(ring_name, "baseline", lambda: jax.jit(ring.compile()),
                            f"jaxmercury {strategy}: {ring_how}", skip=None if ring else f"{strategy} does not apply")]
  return out + _fused_variants(mesh, specs, kernel, _tiles(Tiles), TILES, prefix, kernel.__name__)


def contestants(mesh, m: int, k: int, n: int):
  from jaxmercury.kernels.fused_allgather_matmul import fused_allgather_matmul
  from jaxmercury.kernels.fused_allgather_matmul_comm import fused_allgather_matmul_comm
  from jaxmercury.kernels.fused_allgather_matmul_ws import fused_allgather_matmul_ws
  from jaxmercury.kernels.fused_matmul_reducescatter_ws import WsTiles
  from jaxmercury.kernels.mosaic_matmul import Tiles
  specs = base.layouts("allgather", "x")
  out = [harness.Contestant("xla_allgather_dot", "baseline", lambda: base.allgather_dot(mesh, "x"),
                            "all_gather + dot in shard_map")]
  skip = base.pallas_unavailable(mesh, jnp.bfloat16)
  for i, config in enumerate(base.PALLAS_CONFIGS):
    out.append(harness.Contestant(f"pallas_mgpu[{i}]", "baseline",
                                  lambda c=config: base.pallas_allgather_matmul(mesh, "x", c),
                                  f"JAX all_gather_lhs_matmul {config}", skip=skip))
  out += _ring_and_fused(mesh, m, k, n, specs, "async_tp", "jm_async_tp", "shard_map ppermute ring",
                         fused_allgather_matmul, "fused")
  out += _fused_variants(mesh, specs, fused_allgather_matmul_ws, _tiles(WsTiles), WS_AG_TILES, "fused_ws",
                         "fused_allgather_matmul_ws (two consumer warpgroups)")
  comm = lambda *t: {"tiles": Tiles(*t[:4]), "comm_ctas": t[4]}  # noqa: E731
  return out + _fused_variants(mesh, specs, fused_allgather_matmul_comm, comm, COMM_TILES, "fused_comm",
                               "fused_allgather_matmul_comm (dedicated communication CTAs)")


def _measure(mesh, kind: str, m: int, k: int, n: int, iters: int, contestants_of, local_shapes):
  """Inputs in ``kind``'s layouts, the local GEMM floor, then every contestant checked and timed side by side.

  Returns ``(records by name, this floor in ms, our fastest record or None)``.
  """
  devices = mesh.devices.size
  x_spec, w_spec, _ = base.layouts(kind, "x")
  keys = jax.random.split(jax.random.key(random.SystemRandom().randrange(1 << 31)), 2)
  x = harness.random_array(keys[0], (m, k), jnp.bfloat16, NamedSharding(mesh, x_spec))
  w = harness.random_array(keys[1], (k, n), jnp.bfloat16, NamedSharding(mesh, w_spec))
  floor_ms = harness.compute_floor(base.local_share(kind), local_shapes, jnp.bfloat16, mesh.devices.flat[0], keys[1])
  prepared = harness.prepare(contestants_of(mesh, m, k, n), (x, w), warmup=3, iters=iters, max_timing_s=10.0)
  harness.summarize(prepared.records, harness.time_interleaved(prepared.ready, prepared.records, (x, w)))
  harness.rank(list(prepared.records.values()), floor_ms, 2 * m * k * n / devices)
  mine = [r for r in prepared.records.values() if r["role"] == "jaxmercury" and "median_ms" in r]
  return prepared.records, floor_ms, min(mine, key=lambda r: r["median_ms"], default=None)


def run_shape(mesh, label, m, k, n, iters):
  """One row of the all-gather table: global ``x [m, k]`` (row-sharded) times ``w [k, n]`` (column-sharded)."""
  records, floor_ms, best = _measure(mesh, "allgather", m, k, n, iters, contestants,
                                     [(m, k), (k, n // mesh.devices.size)])
  jax_best = min((r for r in records.values() if r["name"].startswith("pallas_mgpu") and "median_ms" in r),
                 key=lambda r: r["median_ms"], default=None)
  summary = {"floor_ms": floor_ms, "fused_best": best and best["name"],
             "fused_over_jax_kernel": best and jax_best and jax_best["median_ms"] / best["median_ms"],
             "fused_floor_fraction": best and floor_ms / best["median_ms"]}
  harness.log(json.dumps({"shape": label, **summary}))
  return {"shape": label, "m": m, "k": k, "n": n, "records": list(records.values()), "summary": summary}


def rs_contestants(mesh, m: int, k: int, n: int):
  from jaxmercury.kernels.fused_matmul_reducescatter import fused_matmul_reducescatter
  specs = base.layouts("reducescatter", "x")
  out = [harness.Contestant("xla_dot_psum_scatter", "baseline", lambda: base.dot_psum_scatter(mesh, "x"),
                            "dot (float32) + psum_scatter in shard_map")]
  from jaxmercury.kernels.fused_matmul_reducescatter_ws import WsTiles, fused_matmul_reducescatter_ws
  out += _ring_and_fused(mesh, m, k, n, specs, "async_tp_reducescatter", "jm_async_tp_rs",
                         "shard_map ppermute ring of partial sums", fused_matmul_reducescatter, "fused_rs")
  return out + _fused_variants(mesh, specs, fused_matmul_reducescatter_ws, _tiles(WsTiles), WS_TILES,
                               "fused_rs_ws", "fused_matmul_reducescatter_ws (two consumer warpgroups)")


def run_rs_shape(mesh, label, m, k, n, iters):
  """One row of the reduce-scatter table: global ``x [m, k]`` (K-sharded) times ``w [k, n]`` (row-sharded)."""
  devices = mesh.devices.size
  records, floor_ms, best = _measure(mesh, "reducescatter", m, k, n, iters, rs_contestants,
                                     [(m, k // devices), (k // devices, n)])
  unfused = records["xla_dot_psum_scatter"]
  summary = {"floor_ms": floor_ms, "fused_best": best and best["name"],
             "fused_over_dot_psum_scatter": (unfused["median_ms"] / best["median_ms"]
                                             if best and "median_ms" in unfused else None),
             "fused_floor_fraction": best and floor_ms / best["median_ms"]}
  harness.log(json.dumps({"shape": label, **summary}))
  return {"shape": label, "m": m, "k": k, "k_per_device": k // devices, "n": n, "records": list(records.values()),
          "summary": summary}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", required=True)
  p.add_argument("--iters", type=int, default=20)
  p.add_argument("--smoke", action="store_true")
  p.add_argument("--kind", choices=("both", "allgather", "reducescatter"), default="both",
                 help="which table(s) to run")
  args = p.parse_args(argv)
  n = len(jax.devices())
  mesh = jax.make_mesh((n,), ("x",), axis_types=(AxisType.Auto,))
  iters = 2 if args.smoke else args.iters
  cases = ([run_shape(mesh, *s, iters) for s in shapes(n, args.smoke)]
           if args.kind in ("both", "allgather") else [])
  rs_cases = ([run_rs_shape(mesh, *s, iters) for s in rs_shapes(n, args.smoke)]
              if args.kind in ("both", "reducescatter") else [])
  out = {**harness.run_header("fused_gemm", argv), "cases": cases, "reducescatter_cases": rs_cases}
  with open(args.out, "w", encoding="utf-8") as f:
    json.dump(out, f, indent=1)
  bad = harness.failed_contestants(cases + rs_cases)
  if bad:
    raise SystemExit(f"contestants failed or disagree: {bad}")


if __name__ == "__main__":
  main()
