"""The warp-specialized fused ring attention on one GPU against cuDNN, each change to its pipeline beside the last.

    python -m benchmarks.ws_local --out ws_local.json [--seqs 4K 16K] [--kv 32 8] [--causal both] [--training]

For each case (B1 H32 D128 bf16 by default), in one process on the same inputs, interleaved rounds
(``tuner.measure.rounds``): ``jax.nn.dot_product_attention(implementation="cudnn")`` and the kernel
(``kernels.attention.ws_forward``, a one-device ring) under each ``Pipeline`` from the kernel as first written
(``BEFORE``) to the default, one change at a time (non-causal cases: the changes that apply to them). Outputs are
checked against cuDNN's. ``--training`` times forward and backward instead: ``jax.vjp`` of cuDNN's attention
against the ring schedule lowered with the kernel (``lower_with("fused_ring_attention_ws")``), whose backward is
the one jaxmercury runs for it (cuDNN's flash backward), and with ``backward="ws_attention"``, our one-pass
backward kernel (``kernels.attention.ws_backward``). ``--backward`` times the backward alone, both from the same
output and log-sum-exp (the kernel's forward's): cuDNN's flash backward against ours in each of
``BACKWARD_STEPS`` (its configurations, ``BackwardBlocks``) and at the ``--query_chunks`` counts, gradients checked
against cuDNN's. TFLOP/s count a causal mask's visible half; the backward counts as 2.5 forwards.
``--smoke`` runs a small case on the CPU: XLA's attention for cuDNN, the kernel in Mosaic GPU interpret mode.
``--sustain_s`` times each contestant in blocks of back-to-back runs instead of single runs: a GPU at its power
cap clocks by the power drawn, so single runs in rotation share one clock and hide what a contestant's own draw
does to it; a block runs at the clock the contestant allows alone, as a training loop of it does (each records
that clock and power, ``benchmarks.clocks``). ``--training_steps`` keeps some of the training contestants;
``--trace_rounds`` traces each contestant's kernels after its timing (``benchmarks.kernel_trace``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jaxmercury as jm
from benchmarks import cases, harness
from jaxmercury._cpu_flags import cpu_flags
from jaxmercury.kernels import config, registry
from jaxmercury.kernels.attention import ws as ws_attention
from jaxmercury.kernels.attention.cudnn import cudnn_backward
from jaxmercury.kernels.attention.ws_backward import BackwardBlocks
from jaxmercury.kernels.attention.ws_forward import BEFORE, Pipeline, fused_ring_attention_ws
from jaxmercury.tuner import measure

ROUND_ROBIN = dict(heads_in_turn=False, alternate_keys=False)  # one device without a mask: the order before 2026-11-28
# One change at a time, in the order they were made; each name is the kernel's arguments up to and including its
# change (``pipelined``: the consumers' intra-warpgroup pipelining, taking turns; non-causal only).
STEPS = {"before": dict(pipeline=BEFORE),
         "causal_loops": dict(pipeline=Pipeline(causal_loops=True, balanced=False, prefetch_q=False, **ROUND_ROBIN)),
         "balanced": dict(pipeline=Pipeline(causal_loops=True, balanced=True, prefetch_q=False, folded=False,
                                            **ROUND_ROBIN)),
         "prefetch_q": dict(pipeline=Pipeline(split_tail=False, folded=False, **ROUND_ROBIN)),
         "split_tail": dict(pipeline=Pipeline(**ROUND_ROBIN), pipelined=False),
         "pipelined": dict(pipeline=Pipeline(**ROUND_ROBIN), pipelined=True),
         "default": dict(),  # the kernel's defaults: split tail and pipelined consumers where they measured faster
         # Other blocks at the default pipeline (the GPU tests' CONFIGS), asked for by name (--steps)
         "kv64x3": dict(block_kv=64, max_concurrent_steps=3),
         "kv64x4": dict(block_kv=64, max_concurrent_steps=4),
         # The balanced order in other bands (``Pipeline.band``; by default ``_band``'s choice), by name only
         "band1": dict(pipeline=Pipeline(band=1)),
         "band8": dict(pipeline=Pipeline(band=8)),
         "band16": dict(pipeline=Pipeline(band=16)),
         "band32": dict(pipeline=Pipeline(band=32)),
         "band64": dict(pipeline=Pipeline(band=64)),
         "band128": dict(pipeline=Pipeline(band=128)),
         # The balanced order in bands where it folds (``Pipeline.folded=False``: the default before 2026-11-28),
         # and in folded rounds (the default since), by name only
         "unfolded": dict(pipeline=Pipeline(folded=False)),
         "folded": dict(pipeline=Pipeline(folded=True)),
         # One device without a mask: the round-robin order (one item per K/V head first; the default until
         # 2026-11-28), items head after head from the first, then also odd items' keys read last to first (the
         # default since), by name only
         "round_robin": dict(pipeline=Pipeline(**ROUND_ROBIN)),
         "heads_in_turn": dict(pipeline=Pipeline(heads_in_turn=True, alternate_keys=False)),
         "alternate_keys": dict(pipeline=Pipeline(heads_in_turn=True, alternate_keys=True))}
BLOCK_STEPS = ("kv64x3", "kv64x4")
ORDER_STEPS = ("round_robin", "heads_in_turn", "alternate_keys")  # non-causal only
BAND_STEPS = ("band1", "band8", "band16", "band32", "band64", "band128", "unfolded", "folded")  # causal only
GROUPED = {"heads_per_item": None}  # items of a K/V head's whole group: the default before one query head per item


# The backward kernel's variants (``--backward``): as first written, then each change (``BackwardBlocks``). Each
# name keeps the defaults of its day (``_as_of``: a persistent grid, dq sent in its own step, items of whole
# groups), so that it still means the kernel measured under it. Those with the auto order ran at S <= 32K, where its
# causal pairs stand.
def _as_of(**changes) -> BackwardBlocks:
  return BackwardBlocks(**{"persistent": True, "deferred_dq": False, **GROUPED} | changes)


BACKWARD_STEPS = {"ws_serial": _as_of(waits="serial", order="pairs", registers=232),
                  "ws_paired": _as_of(waits="paired", order="pairs", registers=232),
                  "ws_overlapped": _as_of(waits="overlapped", order="pairs", registers=232),
                  "ws_heads": _as_of(waits="overlapped", order="heads", registers=232),
                  "ws_serial_heads": _as_of(waits="serial", order="heads", registers=232),
                  "ws_regs232": _as_of(registers=232),  # the default before the wider register split
                  "ws_early": _as_of(early_loads=True, registers=232),
                  "ws_early_regs240": _as_of(early_loads=True),
                  "ws_paired_regs240": _as_of(waits="paired"),
                  "ws_specialized": _as_of(specialized=True),
                  "ws_shared": _as_of(specialized=False),  # the default before specialized consumers
                  "ws_one_step": _as_of(one_step=True),
                  "ws_one_step_specialized": _as_of(one_step=True, specialized=True),
                  "ws_persistent": _as_of(),  # the default before a CTA per item
                  "ws_items": _as_of(persistent=False, order="heads"),  # a CTA per item, heads in turn
                  "ws_items_pairs": _as_of(persistent=False, order="pairs"),
                  "ws_items_one_step": _as_of(persistent=False, order="heads", one_step=True, specialized=True),
                  "ws_items_specialized": _as_of(persistent=False, specialized=True),
                  "ws_immediate_dq": _as_of(persistent=False),  # the default before deferred dq
                  "ws_deferred_dq": BackwardBlocks(deferred_dq=True, **GROUPED),
                  "ws_whole": BackwardBlocks(query_chunks=1, **GROUPED),  # the default before query chunks
                  "ws_grouped": BackwardBlocks(**GROUPED),  # the default before one query head per item (KV < H)
                  # one query head per item (under a causal mask its runs of 6635e48-079c333 had 8 query chunks)
                  "ws_split_heads": BackwardBlocks(heads_per_item=1, order="heads"),
                  "ws_split_heads_whole": BackwardBlocks(heads_per_item=1, query_chunks=1, order="pairs"),
                  "ws_split_whole_heads": BackwardBlocks(heads_per_item=1, query_chunks=1, order="heads"),
                  "ws_whole_heads": BackwardBlocks(query_chunks=1, order="heads", **GROUPED),
                  "ws_pairs": BackwardBlocks(order="pairs"),  # one query head per item, pairs of every head
                  "ws_default": BackwardBlocks()}  # overlapped, 240 registers, a CTA per item, one query head per
                                                   # item, heads in turn; without a mask specialized, dq deferred,
                                                   # query chunks from S64K; under a causal mask the whole queries
CAUSAL_STEPS = ("before", "causal_loops", "balanced", "prefetch_q", "default", *BLOCK_STEPS, *BAND_STEPS)
NON_CAUSAL_STEPS = ("before", "prefetch_q", "split_tail", "pipelined", "default", *BLOCK_STEPS,
                    *ORDER_STEPS)  # loops, snake: causal


def chunk_steps(counts) -> dict:
  """``--query_chunks``' contestants: ``{"q{n}": BackwardBlocks(query_chunks=n)}`` per count ``n``."""
  return {f"q{n}": BackwardBlocks(query_chunks=n) for n in counts}


def smoke_flags():
  """The CPU flags of a ``--smoke`` run (``_cpu_flags``: interpreted kernels one at a time, so that two kernels'
  host callbacks cannot hold both of a small machine's XLA threads), set before JAX makes its client."""
  os.environ["XLA_FLAGS"] = cpu_flags(os.environ.get("XLA_FLAGS", ""))


def seq_length(text: str) -> int:
  """A sequence length from ``"16K"`` (times 1024) or ``"500"``."""
  return int(text[:-1]) * 1024 if text.upper().endswith("K") else int(text)


def kernel_forward(mesh, causal: bool, smoke: bool, **params):
  """The kernel's forward at ``params`` on a one-device ``mesh``, jitted: ``(q, k, v) -> out``."""
  kernel = lambda q, k, v: fused_ring_attention_ws(q, k, v, "x", causal=causal, interpret=smoke, **params)
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


def ws_backward_of(causal: bool, smoke: bool, blocks: BackwardBlocks):
  """The same signature, jitted: our one-pass backward with ``blocks`` (``smoke``: in interpret mode)."""
  return jax.jit(lambda *a: ws_attention.whole(*a, causal, interpret=smoke, blocks=blocks))


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
                                      "cuDNN's flash backward (the one jax.nn.dot_product_attention's vjp runs)")]
    named = {n: BACKWARD_STEPS[n] for n in args.backward_steps}
    for name, blocks in (named | chunk_steps(args.query_chunks)).items():
      default = " (the default)" if blocks == ws_attention.BACKWARD else ""
      contestants.append(harness.Contestant(
          name, "jaxmercury", lambda x=blocks: ws_backward_of(causal, args.smoke, x),
          f"kernels.attention.ws_backward, {config.changed(blocks) or 'its defaults'}{default}: dq, dk, dv in one "
          "pass (ws_attention.whole)", record={"blocks": dataclasses.asdict(blocks)}))
    tolerance = measure.gradient_tolerance(jnp.bfloat16)
  else:
    steps = CAUSAL_STEPS if causal else NON_CAUSAL_STEPS
    contestants = [harness.Contestant("cudnn", "baseline", lambda: jax.jit(cudnn), label)]
    for name in (n for n in steps if n in args.steps):
      params = STEPS[name]
      contestants.append(harness.Contestant(
          name, "jaxmercury", lambda p=params: kernel_forward(mesh, causal, args.smoke, **p),
          f"fused_ring_attention_ws, {params}",
          record={"pipeline": dataclasses.asdict(params.get("pipeline", Pipeline())),
                  "pipelined": params.get("pipelined"),
                  "blocks": {k: params[k] for k in ("block_kv", "max_concurrent_steps") if k in params}}))
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
  by_name_only = BLOCK_STEPS + BAND_STEPS + ORDER_STEPS
  parser.add_argument("--steps", nargs="+", default=[n for n in STEPS if n not in by_name_only], choices=list(STEPS))
  parser.add_argument("--training", action="store_true")
  parser.add_argument("--training_steps", nargs="+", default=list(TRAINING_STEPS[1:]), choices=TRAINING_STEPS[1:],
                      help="with --training, these contestants beside cuDNN's (default: all)")
  parser.add_argument("--backward", action="store_true", help="the backward alone: cuDNN's against our kernel")
  parser.add_argument("--backward_steps", nargs="+", default=list(BACKWARD_STEPS), choices=list(BACKWARD_STEPS))
  parser.add_argument("--query_chunks", nargs="+", type=int, default=[],
                      help="with --backward, also our backward at these query chunk counts (contestants q{n})")
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
