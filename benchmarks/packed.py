"""Packed rows on every GPU: the sequence-split schedules that skip and balance by segment ids against what a JAX
user runs.

    python -m benchmarks.packed --out packed.json [--seqs 32K 128K] [--mixes uniform long_tailed one] [--training]
    python -m benchmarks.packed --out packed-1gpu.json --mesh 1 --kernels ws_attention cudnn_packed  # one GPU
    python -m benchmarks.packed --out packed-mask.json --mesh 1 --mask_kernels ws_attention  # a mask array

Each case is one batch of rows (B1 H32 KV8 D128 bf16 by default) packed with documents, causal within them, split
along the sequence over every GPU (the callers' layout, ``P(None, "gpu")``): ``uniform`` rows of documents of
512-8K tokens, ``long_tailed`` rows with one document of half the row among them, ``one`` a row that is one
document (causal over the whole row: what the segment ids cost where they skip nothing). Contestants, in one process on
the same inputs, timed in interleaved rounds (``benchmarks.harness``):

* ``ulysses_dense`` (baseline): what a JAX user writes today: Ulysses (all-to-all to heads) and
  ``jax.nn.dot_product_attention`` with the packed mask as a dense boolean ``[B, 1, S, S]`` (cuDNN takes it as a
  bias over every tile); left out where the mask would not fit (``--dense_limit``).
* ``ring``, ``ring_zigzag``, ``ring_balanced``: jaxmercury's library strategies (``Schedule.balance``), their blocks
  on the preferred local kernel (``registry.default_kernel``: cuDNN on GPUs); the ring runs the steps the segment
  ids need.
* ``tuned`` (with ``--tune``): ``jm.autotune``'s winner, tuned on random packings.
* ``local_<kernel>`` (with ``--kernels``, one device: ``--mesh 1``): the whole row on one local kernel
  (``ws_attention``: our warp-specialized kernels reading the segment ids, skipping the tiles no document spans;
  ``cudnn_attention``: cuDNN with the packed mask as a bias; ``cudnn_packed``: cuDNN's packed layout, documents as
  offsets and lengths). On one device the library's rings do not apply, ``ulysses_dense`` is
  ``jax.nn.dot_product_attention`` with the dense mask on the whole row, and ``jaxmercury_untuned`` is
  ``jm.ops.attention`` with the segment ids on a fresh database.
* ``local_<kernel>_mask_array`` (with ``--mask_kernels``, one device): the whole row on one local kernel of a
  program that reads the packed mask as a mask array (``mask=True``, ``[B, S, S]``, built in the call from the
  segment ids as the dense baseline builds its own): what the kernel skips by a mask array's tiles alone
  (``ws_attention``: hidden tiles not loaded, full ones not compared).

Each contestant's record carries its speed-up over ``ulysses_dense`` and, on the forward, its rate on the kept pairs
as a share of cuDNN's causal rate over the whole row (``with_ratios``).

Each case also records the time of the same rows' attention without documents (Ulysses and cuDNN causal over
the whole row, on one device cuDNN causal alone: the work packing saves), the kept pairs as a share of the causal
square, and per schedule the busiest device's kept pairs over the mean and the ring steps run
(``Schedule.data_run``). ``--training`` times forward and backward. ``--smoke`` runs small cases on the simulated
8-device CPU mesh (XLA kernels; the ``--kernels`` in Mosaic GPU interpret mode, bf16, head dimension 64).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxmercury as jm
from benchmarks import harness
from benchmarks.baselines import attention as baselines
from benchmarks.ws_local import seq_length
from jaxmercury._cpu_flags import DEVICE_COUNT, cpu_flags
from jaxmercury.kernels import registry
from jaxmercury.tuner import measure

SCHEDULES = ("ring", "ring_zigzag", "ring_balanced")


def packing(rng, length: int, mix: str, shortest: int, longest: int) -> np.ndarray:
  """One row's segment ids [1, length]: documents of lengths uniform in ``[shortest, longest]``; ``long_tailed``:
  one of them half the row, at a random place; ``one``: one document."""
  ids, at = np.zeros(length, np.int32), 0
  if mix == "one":
    return ids[None]
  while at < length:
    n = int(rng.integers(shortest, longest + 1))
    ids[at:at + n] = ids[at - 1] + 1 if at else 0
    at += n
  if mix == "long_tailed":
    start = int(rng.integers(0, length // 2))
    ids[start:start + length // 2] = ids.max() + 1
  return ids[None]


def dense_mask(seg):
  """The packed causal mask as ``jax.nn.dot_product_attention`` takes it: bool ``[B, 1, S, S]``."""
  s = seg.shape[1]
  causal = jnp.arange(s)[:, None] >= jnp.arange(s)[None, :]
  return ((seg[:, :, None] == seg[:, None, :]) & causal)[:, None]


def ulysses_dense(mesh, heads: int, kv_heads: int, impl: str):
  """Ulysses with the dense packed mask: ``f(q, k, v, seg) -> o``, all split along the sequence."""
  axis, n = "gpu", mesh.shape["gpu"]

  def body(q, k, v, seg):
    k, v = baselines._repeat_kv(k, v, n)
    q, k, v = (baselines._seq_to_heads(x, axis) for x in (q, k, v))
    mask = dense_mask(jax.lax.all_gather(seg, axis, axis=1, tiled=True))
    o = jax.nn.dot_product_attention(q, k, v, mask=mask, implementation=impl)
    return baselines._heads_to_seq(o, axis)

  spec = P(None, axis)
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 4, out_specs=spec, check_vma=False))


def dense_call(mesh, heads: int, kv_heads: int, impl: str):
  """``f(q, k, v, seg, _) -> o`` with the dense packed mask: Ulysses over the mesh, or on one device the call
  itself (what a user writes there)."""
  if mesh.size == 1:
    call = jax.jit(lambda q, k, v, seg: jax.nn.dot_product_attention(q, k, v, mask=dense_mask(seg),
                                                                     implementation=impl))
  else:
    call = ulysses_dense(mesh, heads, kv_heads, impl)
  return lambda q, k, v, a, _: call(q, k, v, a)


def schedule_of(prog, mesh, name: str, tune: bool):
  """A library strategy of ``prog`` on the preferred local kernel, or (``"tuned"``) the tuner's winner.

  Raises:
    jm.ScheduleError: the strategy does not apply on ``mesh`` (a ring on one device).
  """
  if name == "tuned":
    return jm.autotune(prog, mesh, space=8, top_k=4, log=harness.log).best.schedule
  library = jm.library(prog, mesh)
  if name not in library:
    raise jm.ScheduleError(f"{name} is not in the library on a mesh of {mesh.size} devices")
  s = library[name]
  kernel = registry.default_kernel(prog, mesh)
  return s.patch(kernel) if kernel else s


def local_contestant(prog, mesh, kernel: str, *, mask_array: bool = False, skip: str | None = None
                     ) -> harness.Contestant:
  """The whole row on one local ``kernel`` (``Schedule.patch``), one device only; ``mask_array``: ``prog`` is a
  ``mask=True`` program, given the packed mask as its mask array (built in the call from the segment ids);
  ``skip``: a reason to leave it out."""
  name, label = f"local_{kernel}", f"jaxmercury, the whole row on {kernel}"
  if mask_array:
    name, label = f"{name}_mask_array", f"{label}, the packed mask as an array"
  if mesh.size != 1:
    return harness.Contestant(name, "jaxmercury", None, label, skip="local kernels are timed on one device (--mesh 1)")
  try:
    schedule = jm.Schedule(prog, mesh).patch(kernel)
  except jm.ScheduleError as e:
    return harness.Contestant(name, "jaxmercury", None, label, skip=str(e))

  def build():
    run = schedule.compile()
    return jax.jit(lambda q, k, v, seg, _: run(q, k, v, dense_mask(seg)[:, 0])) if mask_array else run
  record = {"kernel": kernel, **({"mask": "array"} if mask_array else {})}
  return harness.Contestant(name, "jaxmercury", build, label, record=record, skip=skip)


def untuned_contestant(mesh) -> harness.Contestant:
  """``jm.ops.attention`` with the segment ids on a fresh database: what a user's untuned call runs."""
  database = jm.Database(os.path.join(tempfile.mkdtemp(), "untuned.db"))
  call = jax.jit(lambda q, k, v, a, c: jm.ops.attention(q, k, v, mesh=mesh, causal=True, q_segment_ids=a,
                                                         kv_segment_ids=c, database=database))
  return harness.Contestant("jaxmercury_untuned", "jaxmercury", lambda: call,
                            "jm.ops.attention with segment ids, untuned (a fresh database)")


def with_ratios(case: dict) -> dict:
  """Per timed contestant: its speed-up over the dense-mask call (``ulysses_dense``) and, where the unpacked causal
  time was measured, its rate on the kept pairs as a share of cuDNN's causal rate over the whole row (the causal
  time times the kept fraction, over its time)."""
  times = {r["name"]: r["median_ms"] for r in case["contestants"] if "median_ms" in r}
  for r in case["contestants"]:
    if "median_ms" not in r:
      continue
    if "ulysses_dense" in times:
      r["ratio_to_dense_mask"] = round(times["ulysses_dense"] / r["median_ms"], 3)
    if "unpacked_causal_ms" in case:
      r["kept_rate_of_causal_rate"] = round(case["unpacked_causal_ms"] * case["kept_fraction_of_causal"]
                                            / r["median_ms"], 3)
  return case


def trained(fn):
  """``step(q, k, v, seg, cotangent) -> (o, dq, dk, dv)``: ``fn``'s forward and pullback, jitted."""
  def step(q, k, v, seg, cotangent):
    o, pullback = jax.vjp(lambda q, k, v: fn(q, k, v, seg, seg), q, k, v)
    return (o, *pullback(cotangent))
  return jax.jit(step)


def run_case(args, mesh, s: int, mix: str, deadline: float) -> dict:
  b, h, kv, d = args.batch, args.heads, args.kv, args.head_dim
  impl = "xla" if args.smoke else "cudnn"
  dtype = jnp.float32 if args.smoke and not (args.kernels or args.mask_kernels) else jnp.bfloat16
  shortest, longest = (s // 64, s // 4) if args.smoke else (512, 8192)
  seg = np.concatenate([packing(np.random.default_rng(args.seed + r), s, mix, shortest, longest) for r in range(b)])
  kept = float(np.mean([(np.square(np.bincount(row)).sum() + s) / 2 for row in seg]))  # documents are runs
  spec = NamedSharding(mesh, P(None, "gpu"))
  keys = jax.random.split(jax.random.key(args.seed), 4)
  q = harness.random_array(keys[0], (b, s, h, d), dtype, spec)
  k, v = (harness.random_array(key, (b, s, kv, d), dtype, spec) for key in keys[1:3])
  ids = jax.device_put(jnp.asarray(seg), spec)
  prog = jm.programs.attention(b, h, kv, s, s, d, causal=True, segment_ids=True, dtype=dtype)
  runs, contestants = {}, []
  dense_bytes = b * s * s
  too_dense = None if dense_bytes <= args.dense_limit else (f"the dense mask ({dense_bytes / 2**30:.0f} GiB) is "
                                                             "over --dense_limit")
  contestants.append(harness.Contestant(
      "ulysses_dense", "baseline", lambda: dense_call(mesh, h, kv, impl),
      "Ulysses, jax.nn.dot_product_attention with the dense packed mask" if mesh.size > 1 else
      "jax.nn.dot_product_attention with the dense packed mask", skip=too_dense))
  schedules = SCHEDULES if mesh.size > 1 else ()  # one device: the whole row, no ring
  for name in schedules + (("tuned",) if args.tune else ()):
    try:
      schedule = schedule_of(prog, mesh, name, args.tune)
    except jm.ScheduleError as e:
      contestants.append(harness.Contestant(name, "jaxmercury", None, skip=str(e)))
      continue
    if name in SCHEDULES:
      run = schedule.data_run(seg, seg)
      runs[name] = {"balance": round(run.balance(), 3), "ring_steps": {k: list(v) for k, v in run.steps.items()}}
    contestants.append(harness.Contestant(name, "jaxmercury", lambda s=schedule: s.compile(),
                                          f"jaxmercury {name}", record={"strategy": name, **runs.get(name, {})}))
  contestants += [local_contestant(prog, mesh, kernel) for kernel in args.kernels]
  masked = jm.programs.attention(b, h, kv, s, s, d, causal=True, mask=True, dtype=dtype)
  contestants += [local_contestant(masked, mesh, kernel, mask_array=True, skip=too_dense)
                  for kernel in args.mask_kernels]
  if mesh.size == 1:
    contestants.append(untuned_contestant(mesh))
  inputs = (q, k, v, ids, ids)
  if args.training:
    cot = harness.random_array(keys[3], (b, s, h, d), dtype, spec)
    for c in contestants:
      if c.build is not None:
        c.build = lambda build=c.build: trained(build())
    inputs = (q, k, v, ids, cot)
  label = f"B{b} S{s // 1024 if s >= 1024 else s}{'K' if s >= 1024 else ''} H{h} KV{kv} D{d} {mix}"
  harness.log(f"case {label}{' training' if args.training else ''}")
  tolerance = measure.gradient_tolerance(dtype) if args.training else harness.BF16_TOLERANCE
  settings = harness.Settings(iters=args.iters, warmup=2, max_timing_s=args.max_timing_s, deadline=deadline,
                              tolerance=tolerance, min_timing_s=args.min_timing_s)
  records, ref = harness.run_contestants(contestants, inputs, settings)
  case = {"name": label, "batch": b, "seq": s, "heads": h, "kv_heads": kv, "head_dim": d, "mix": mix,
          "training": args.training, "kept_fraction_of_causal": kept / (s * (s + 1) / 2),
          "documents": int(seg.max()) + 1}
  if not args.training and time.time() < deadline:  # the same rows without documents: the work packing saves
    whole = baselines.ulysses(mesh, ("gpu",), causal=True, impl=impl, heads=h, kv_heads=kv)
    case["unpacked_causal_ms"] = harness.time_call(whole, (q, k, v), iters=args.iters)
  return with_ratios(harness.finish(case, records, ref))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True)
  parser.add_argument("--seqs", nargs="+", default=["32K", "128K"])
  parser.add_argument("--mixes", nargs="+", default=["uniform", "long_tailed"],
                      choices=["uniform", "long_tailed", "one"])
  parser.add_argument("--training", action="store_true")
  parser.add_argument("--tune", action="store_true", help="also the tuner's winner (tuned on random packings)")
  parser.add_argument("--mesh", default="", help="devices: '' every one (default), '1' one GPU")
  parser.add_argument("--kernels", nargs="*", default=[], help="local kernels timed on the whole row (one device)")
  parser.add_argument("--mask_kernels", nargs="*", default=[],
                      help="local kernels timed on the whole row with the packed mask as a mask array (one device)")
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--heads", type=int, default=32)
  parser.add_argument("--kv", type=int, default=8)
  parser.add_argument("--head_dim", type=int, default=128)
  parser.add_argument("--iters", type=int, default=10)
  parser.add_argument("--min_timing_s", type=float, default=0.5)
  parser.add_argument("--max_timing_s", type=float, default=3.0)
  parser.add_argument("--dense_limit", type=float, default=2**32, help="bytes of the dense mask at most")
  parser.add_argument("--time_budget", type=float, default=500.0)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--smoke", action="store_true", help="small cases on the simulated 8-device CPU mesh")
  args = parser.parse_args(argv)
  if args.smoke:
    args.seqs, args.heads, args.kv, args.head_dim, args.iters, args.min_timing_s = ["256"], 8, 8, 16, 3, 0.0
    if args.kernels or args.mask_kernels:  # what the kernels take, in interpret mode
      args.heads, args.kv, args.head_dim, args.iters = 2, 1, 64, 1
    flags = os.environ.get("XLA_FLAGS", "")  # before JAX makes its CPU client: 8 simulated devices
    os.environ["XLA_FLAGS"] = cpu_flags(flags, None if DEVICE_COUNT in flags else 8)
  start = time.time()
  mesh = harness.make_mesh(args.mesh)
  out = harness.header("packed", [])
  out["command"] = "python -m benchmarks.packed " + " ".join(sys.argv[1:] if argv is None else argv)
  out["cases"] = []
  with registry.interpret_mode() if args.smoke else contextlib.nullcontext():
    for s in map(seq_length, args.seqs):
      for mix in args.mixes:
        if time.time() > start + args.time_budget:
          harness.log(f"out of time: S{s} {mix} left out")
          continue
        out["cases"].append(run_case(args, mesh, s, mix, start + args.time_budget))
        out["wall_s"] = round(time.time() - start, 1)
        harness.write_json(args.out, out)


if __name__ == "__main__":
  main()
