"""``python -m jaxmercury.tune``: tune an operator on this machine's mesh.

Without GPUs the mesh is simulated on the CPU (8 devices by default)::

  python -m jaxmercury.tune attention --seq 256 --heads 8 --kv-heads 2
  python -m jaxmercury.tune matmul --m 512 --n 512 --k 1024 --mesh 2x4
"""

from __future__ import annotations

import argparse
import os
import sys


def _parse(argv):
  p = argparse.ArgumentParser(prog="python -m jaxmercury.tune", description=__doc__.splitlines()[0])
  p.add_argument("program", choices=["attention", "matmul", "weighted_sum"])
  p.add_argument("--mesh", default=None, help="mesh shape, e.g. 8 or 2x4 (default: all devices, one level)")
  p.add_argument("--levels", default=None, help="comma-separated level names (default x, or node,gpu)")
  p.add_argument("--cpu-devices", type=int, default=8, help="simulated CPU devices when no GPU is present")
  p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--kv-heads", type=int, default=8)
  p.add_argument("--seq", type=int, default=256, help="query and key length")
  p.add_argument("--head-dim", type=int, default=32)
  p.add_argument("--causal", action="store_true")
  p.add_argument("--m", type=int, default=512)
  p.add_argument("--n", type=int, default=256)
  p.add_argument("--k", type=int, default=512)
  p.add_argument("--space", type=int, default=24, help="design-space schedules added to the library's")
  p.add_argument("--top-k", type=int, default=8, help="candidates compiled and timed, best predicted first")
  p.add_argument("--iters", type=int, default=10)
  p.add_argument("--memory-budget-mib", type=float, default=None)
  p.add_argument("--db", default="jaxmercury_tuning.db", help="SQLite tuning database")
  return p.parse_args(argv)


def _program(args, jm):
  if args.program == "attention":
    return jm.programs.attention(args.batch, args.heads, args.kv_heads, args.seq, args.seq,
                                 args.head_dim, causal=args.causal, dtype=args.dtype)
  if args.program == "matmul":
    return jm.programs.matmul(args.m, args.n, args.k, dtype=args.dtype)
  return jm.programs.weighted_sum(args.m, args.k, dtype=args.dtype)


def _mesh(args, jax):
  from jax.sharding import AxisType
  from jaxmercury.errors import ScheduleError
  shape = (tuple(int(x) for x in args.mesh.split("x")) if args.mesh else (len(jax.devices()),))
  names = tuple(args.levels.split(",")) if args.levels else (("x",) if len(shape) == 1 else ("node", "gpu"))
  if len(names) != len(shape):
    raise ScheduleError(f"--levels names {len(names)} levels for a mesh of {len(shape)}")
  import math
  if math.prod(shape) > len(jax.devices()):
    raise ScheduleError(f"mesh {shape} needs {math.prod(shape)} devices, this machine has {len(jax.devices())}")
  return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))


def main(argv=None):
  args = _parse(sys.argv[1:] if argv is None else argv)
  flag = f"--xla_force_host_platform_device_count={args.cpu_devices}"
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
  import jax
  import jaxmercury as jm
  mesh = _mesh(args, jax)
  prog = _program(args, jm)
  print(f"tuning {prog}\non {len(mesh.devices.flat)} {mesh.devices.flat[0].device_kind} devices, "
        f"mesh {dict(zip(mesh.axis_names, mesh.devices.shape))}", flush=True)
  db = jm.Database(args.db)
  budget = None if args.memory_budget_mib is None else int(args.memory_budget_mib * 2**20)
  result = jm.autotune(prog, mesh, space=args.space, top_k=args.top_k, memory_budget=budget,
                       iters=args.iters, database=db, log=lambda s: print(s, flush=True))
  print("\n" + result.table())
  if result.best is None:
    print("\nno candidate passed its numerical check")
    return 1
  print(f"\nwinner: {result.best.name} ({result.best.result.median_ms:.3f} ms), stored in {args.db}\n")
  print(result.best.schedule)
  return 0


if __name__ == "__main__":
  sys.exit(main())
