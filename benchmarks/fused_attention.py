"""Fused ring attention (one Mosaic GPU kernel) against the unfused programs, in one process.

  python -m benchmarks.fused_attention --out results.json [--seq 16384 32768 65536 131072] [--kv_heads 32 8]
      [--causal]
  python -m benchmarks.fused_attention --smoke --out /tmp/fused_attention.json   # tiny, 8 simulated CPU devices

One mesh level ``"x"`` over every device; the sequence is sharded over it
(``P(None, "x")``), B1 H32 D128 bf16, non-causal (``--causal``: causal);
``--seq`` are global sequence lengths. Contestants per case, all on the same
inputs, each output checked against the first's:

- ``cp_allgather_cudnn`` (baseline): all-gathered K/V + cuDNN flash attention
  in ``shard_map`` (``benchmarks.baselines.attention.context_parallel``);
- ``ring_cudnn`` (baseline): the RingAttention baseline of the same module
  (``ppermute`` ring + cuDNN blocks, merged by log-sum-exp);
- ``jm_ring`` (baseline): jaxmercury's ``ring`` schedule for the attention
  program, as the library lowers it (``shard_map`` + ``ppermute``);
- ``fused[<block_q>x<block_kv>/<steps>]`` (jaxmercury):
  ``fused_ring_attention``, one record per block configuration
  (``CONFIGS``, one CTA per SM; ``TWO_PER_SM``, ``,2/SM``: twice as many
  CTAs); the case's summary names the fastest;
- ``fused_ws[<block_q>x<block_kv>/<steps>]`` (jaxmercury):
  ``fused_ring_attention_ws``, two consumer warpgroups and a memory
  warpgroup per CTA (FlashAttention-3's structure), one per ``CONFIGS``;
  ``fused_ws_pipe[...]`` (non-causal): the same with ``pipelined=True``,
  each consumer's softmax running behind its previous tile's ``P V``.

Causal cases add ``ulysses_cudnn`` (baseline: all-to-all to heads, cuDNN's
causal mask), ``fused_zigzag[...]`` and ``fused_ws_zigzag[...]``
(jaxmercury: the ``ring_zigzag`` schedule lowered with either fused kernel,
which balances the causal work; it takes natural-order arrays and pays
putting them in zigzag order and back, which a model keeping its sequence in
zigzag order would not); ``fused[...]`` and ``fused_ws[...]`` then run the
natural order, where the last device does the most work.

``--training`` times a training step instead: each contestant's forward
and backward (``jax.vjp`` and its pullback on a fresh random cotangent, one
jitted call returning o, dq, dk, dv, each checked against the first
contestant's). The kernels alone have no backward, so the fused contestants
are the schedules' lowerings (``Schedule.compile()``: the kernel keeps its
output and log-sum-exp for the dual programs, cuDNN blocks);
``jm_ring_zigzag`` (baseline, causal) is the zigzag ring on cuDNN both ways.
``--previous_backward`` adds ``*_previous_backward`` (role ``previous``, not
a baseline): the warp-specialized lowering differentiated as it was before
2026-11-24, through the ordinary schedule on XLA's attention body, forward
run again. TFLOP/s then count the backward as 2.5 forwards.

Each record has the median ms, its ratio to the best baseline (above 1:
faster) and TFLOP/s per device. The JSON file is rewritten after every case,
so a run cut short keeps what it measured. ``--smoke`` runs a tiny case on 8
simulated CPU devices with the XLA attention instead of cuDNN (the fused
kernel needs Hopper GPUs and is skipped there), so the harness cannot rot.
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402

from benchmarks import harness  # noqa: E402
from benchmarks.baselines import attention as attn  # noqa: E402
from benchmarks.baselines.gemm import pallas_unavailable  # noqa: E402

HEADS, HEAD_DIM, BATCH = 32, 128, 1
GRAD_TOLERANCE = 3e-2  # relative error of bf16 gradients against the first contestant's
# Blocks whose shared memory (< half an SM's) lets two CTAs share an SM, so that one CTA's softmax overlaps the
# other's wgmma: run with a grid of twice the SM count.
TWO_PER_SM = ((64, 64, 2),)  # (block_q, block_kv, max_concurrent_steps)
LEVELS = ("x",)


def _jm_ring(mesh, prog, spec, impl: str, strategy: str = "ring"):
  """jaxmercury's ``strategy`` schedule of ``prog`` for sequence-sharded callers (blocks on cuDNN where ``impl``
  is ``"cudnn"``), or the reason it does not apply."""
  import jaxmercury as jm
  from jaxmercury.tuner.autotuner import with_layouts
  lib = jm.library(prog, mesh)
  if strategy not in lib:
    return None, f"jaxmercury's library has no {strategy} schedule here ({sorted(lib)})"
  ring = lib[strategy].patch("cudnn_attention") if impl == "cudnn" else lib[strategy]
  return with_layouts(ring, [spec] * 3, spec), None


def _jm_zigzag_fused(mesh, prog, spec, lowering: str, **params):
  """jaxmercury's ``ring_zigzag`` schedule lowered with the fused kernel ``lowering`` at ``params``, for
  natural-order callers (it puts the sequence into zigzag order and back), or the reason it does not apply."""
  import jaxmercury as jm
  from jaxmercury.lowering import fused
  from jaxmercury.tuner.autotuner import with_layouts
  lib = jm.library(prog, mesh)
  if "ring_zigzag" not in lib:
    return None, f"jaxmercury's library has no ring_zigzag schedule here ({sorted(lib)})"
  zigzag = with_layouts(lib["ring_zigzag"], [spec] * 3, spec)
  if why := fused.why_not(lowering, zigzag):
    return None, why
  return zigzag.lower_with(lowering, **params), None


def _lowered(mesh, prog, spec, strategy: str, lowering: str, **params):
  """jaxmercury's ``strategy`` schedule for sequence-sharded callers lowered with the fused kernel ``lowering`` at
  ``params``, or the reason it does not apply."""
  import jaxmercury as jm
  from jaxmercury.lowering import fused
  from jaxmercury.tuner.autotuner import with_layouts
  lib = jm.library(prog, mesh)
  if strategy not in lib:
    return None, f"jaxmercury's library has no {strategy} schedule here ({sorted(lib)})"
  s = with_layouts(lib[strategy], [spec] * 3, spec)
  if why := fused.why_not(lowering, s):
    return None, why
  return s.lower_with(lowering, **params), None


def _previous_backward(schedule):
  """``schedule`` (fused) compiled with the backward fused lowerings had before 2026-11-24: the vjp of the
  ordinary lowering on XLA's attention body, which runs that forward again and keeps its scores."""
  from jaxmercury.lowering import fused
  from jaxmercury.lowering.lower import lower
  forward = lower(schedule, jit=False, per_device=fused.lowering(schedule.lowering).build(
      schedule, **schedule.lowering_params))
  ordinary = lower(fused.ordinary_schedule(schedule), jit=False)

  @jax.custom_vjp
  def f(q, k, v):
    return forward(q, k, v)

  f.defvjp(lambda *xs: (forward(*xs), xs), lambda xs, g: jax.vjp(ordinary, *xs)[1](g))
  return jax.jit(f)


def _training_step(build):
  """``build`` (a forward's builder) turned into the builder of a jitted training step
  ``(q, k, v, cot) -> (o, dq, dk, dv)``: the forward and its pullback in one call (``measure.training_step``)."""
  from jaxmercury.tuner.measure import training_step
  return lambda: training_step(build())


def training_contestants(mesh, prog, spec, impl: str, previous: bool = False):
  """Forward+backward contestants (``--training``): the differentiable baselines and fused lowerings."""
  from jaxmercury.kernels.fused_ring_attention import Blocks
  causal = bool(prog.params.get("causal"))
  out = [c for c in contestants(mesh, prog, spec, impl, kernels=False)]
  if causal:
    zigzag, why = _jm_ring(mesh, prog, spec, impl, "ring_zigzag")
    out.append(harness.Contestant("jm_ring_zigzag", "baseline", lambda: jax.jit(zigzag.compile()),
                                  f"jaxmercury ring_zigzag schedule, {impl} blocks both ways", skip=why))
  skip = pallas_unavailable(mesh, jnp.bfloat16)
  sw = Blocks(*TWO_PER_SM[0])
  sw_blocks = f"[{sw.block_q}x{sw.block_kv}/{sw.max_concurrent_steps},2/SM]"
  lowerings = [("ring", "fused_ws", "fused_ring_attention_ws", {}),
               ("ring", f"fused{sw_blocks}", "fused_ring_attention", {"ctas_per_sm": 2})]
  if causal:
    lowerings += [("ring_zigzag", "fused_ws_zigzag", "fused_ring_attention_ws", {}),
                  ("ring_zigzag", f"fused_zigzag{sw_blocks}", "fused_ring_attention", {"ctas_per_sm": 2})]
  for strategy, name, lowering, params in lowerings:
    s, why = (None, skip) if skip else _lowered(mesh, prog, spec, strategy, lowering, **params)
    label = f"{strategy} lowered with {lowering}; backward: dual programs on cuDNN from its output and lse"
    out.append(harness.Contestant(name, "jaxmercury", lambda s=s: jax.jit(s.compile()), label, skip=why))
  if previous:
    s, why = (None, skip) if skip else _lowered(mesh, prog, spec, "ring", "fused_ring_attention_ws")
    out.append(harness.Contestant("fused_ws_previous_backward", "previous", lambda s=s: _previous_backward(s),
                                  "ring lowered with fused_ring_attention_ws, differentiated through the ordinary "
                                  "lowering on XLA's body (before 2026-11-24)", skip=why))
  return [dataclasses.replace(c, build=_training_step(c.build)) if c.build else c for c in out]


def contestants(mesh, prog, spec, impl: str, kernels: bool = True):
  """The forward contestants; ``kernels=False``: only the baselines and jaxmercury's unfused ring."""
  from jaxmercury.kernels.fused_ring_attention import CONFIGS, Blocks, fused_ring_attention
  from jaxmercury.kernels.fused_ring_attention_ws import CONFIGS as WS_CONFIGS
  from jaxmercury.kernels.fused_ring_attention_ws import fused_ring_attention_ws
  causal = bool(prog.params.get("causal"))
  out = [harness.Contestant("cp_allgather_" + impl, "baseline",
                            lambda: attn.context_parallel(mesh, LEVELS, causal=causal, impl=impl),
                            f"all-gathered K/V + {impl} in shard_map"),
         harness.Contestant("ring_" + impl, "baseline", lambda: attn.ring(mesh, LEVELS, causal=causal, impl=impl),
                            f"RingAttention baseline: ppermute ring + {impl} blocks")]
  if causal:  # the fastest causal baseline measured (shared/REFERENCE.md): all-to-all to heads, cuDNN's causal mask
    heads, kv = prog.axes["hk"].extent * prog.axes["g"].extent, prog.axes["hk"].extent
    out.append(harness.Contestant("ulysses_" + impl, "baseline",
                                  lambda: attn.ulysses(mesh, LEVELS, causal=True, impl=impl, heads=heads, kv_heads=kv),
                                  f"Ulysses: all-to-all to heads + {impl}"))
  ring, why = _jm_ring(mesh, prog, spec, impl)
  out.append(harness.Contestant("jm_ring", "baseline", lambda: jax.jit(ring.compile()),
                                f"jaxmercury ring schedule: shard_map ppermute ring, {impl} blocks", skip=why))
  if not kernels:
    return out
  skip = pallas_unavailable(mesh, jnp.bfloat16)
  sms = getattr(jax.devices()[0], "core_count", None) or 1
  variants = [(c, 1) for c in CONFIGS] + [(Blocks(*c), 2) for c in TWO_PER_SM]
  if causal:  # the balanced order: the schedule's lowering, reordering the sequence in and out
    zigzags = [(f"fused_zigzag[{c.block_q}x{c.block_kv}/{c.max_concurrent_steps}"
                f"{'' if per_sm == 1 else f',{per_sm}/SM'}]", "fused_ring_attention", c, {"ctas_per_sm": per_sm})
               for c, per_sm in variants]
    zigzags += [(f"fused_ws_zigzag[{c.block_q}x{c.block_kv}/{c.max_concurrent_steps}]", "fused_ring_attention_ws",
                 c, {}) for c in WS_CONFIGS]
    for name, lowering, c, extra in zigzags:
      zigzag, why = (None, skip) if skip else _jm_zigzag_fused(
          mesh, prog, spec, lowering, block_q=c.block_q, block_kv=c.block_kv,
          max_concurrent_steps=c.max_concurrent_steps, **extra)
      out.append(harness.Contestant(name, "jaxmercury", lambda z=zigzag: jax.jit(z.compile()),
                                    f"ring_zigzag lowered with {lowering} (sequence put in zigzag order and back)",
                                    skip=why))
  # two consumer warpgroups and a memory warpgroup per CTA, one CTA per SM; pipelined: each consumer's softmax
  # overlaps its previous tile's P V (non-causal only)
  for c, pipelined in [(c, False) for c in WS_CONFIGS] + ([] if causal else [(c, True) for c in WS_CONFIGS]):
    body = lambda q, k, v, c=c, pipelined=pipelined: fused_ring_attention_ws(
        q, k, v, "x", causal=causal, block_q=c.block_q, block_kv=c.block_kv,
        max_concurrent_steps=c.max_concurrent_steps, pipelined=pipelined)[0]
    fn = lambda body=body: jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec,
                                                 check_vma=False))
    name = f"fused_ws{'_pipe' if pipelined else ''}[{c.block_q}x{c.block_kv}/{c.max_concurrent_steps}]"
    out.append(harness.Contestant(name, "jaxmercury", fn,
                                  "fused_ring_attention_ws: warp-specialized (FA3-style), K/V forwarded by the "
                                  "memory warpgroup" + (", softmax behind the previous P V" if pipelined else ""),
                                  skip=skip))
  for c, per_sm in variants:
    body = lambda q, k, v, c=c, per_sm=per_sm: fused_ring_attention(
        q, k, v, "x", causal=causal, block_q=c.block_q, block_kv=c.block_kv,
        max_concurrent_steps=c.max_concurrent_steps, num_ctas=per_sm * sms)[0]
    fn = lambda body=body: jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec,
                                                 check_vma=False))
    name = f"fused[{c.block_q}x{c.block_kv}/{c.max_concurrent_steps}{'' if per_sm == 1 else f',{per_sm}/SM'}]"
    out.append(harness.Contestant(name, "jaxmercury", fn,
                                  f"fused_ring_attention: one Mosaic GPU kernel, K/V forwarded by TMA, "
                                  f"{per_sm} CTA(s) per SM", skip=skip))
  return out


def run_case(mesh, seq: int, kv_heads: int, iters: int, impl: str, causal: bool = False, training: bool = False,
             previous: bool = False) -> dict:
  """One case: global sequence ``seq``, ``kv_heads`` key/value heads; every contestant checked and timed
  (``training``: forward+backward steps)."""
  import jaxmercury as jm
  n = mesh.devices.size
  label = (f"B{BATCH} S{seq} H{HEADS} KV{kv_heads} D{HEAD_DIM} bf16 {'causal' if causal else 'non-causal'}"
           f"{' forward+backward' if training else ''}")
  harness.log(f"case {label} on {n} devices")
  prog = jm.programs.attention(BATCH, HEADS, kv_heads, seq, seq, HEAD_DIM, causal=causal, dtype=jnp.bfloat16)
  spec = attn.seq_spec(LEVELS)
  keys = jax.random.split(jax.random.key(random.SystemRandom().randrange(1 << 31)), 4)
  sharding = NamedSharding(mesh, spec)
  shapes = [(BATCH, seq, HEADS, HEAD_DIM)] + [(BATCH, seq, kv_heads, HEAD_DIM)] * 2
  if training:  # the output's cotangent
    shapes.append((BATCH, seq, HEADS, HEAD_DIM))
  inputs = tuple(harness.random_array(k, shape, jnp.bfloat16, sharding) for k, shape in zip(keys, shapes))
  entrants = (training_contestants(mesh, prog, spec, impl, previous) if training
              else contestants(mesh, prog, spec, impl))
  prepared = harness.prepare(entrants, inputs, warmup=3, iters=iters, max_timing_s=10.0,
                             tolerance=GRAD_TOLERANCE if training else harness.BF16_TOLERANCE)
  harness.summarize(prepared.records, harness.time_interleaved(prepared.ready, prepared.records, inputs))
  del inputs
  flops = 4 * BATCH * HEADS * seq * (seq // n) * HEAD_DIM * (0.5 if causal else 1)  # QK^T and PV, per device
  flops *= 3.5 if training else 1  # the backward: 2.5 forwards (recomputed scores, dV, dP, dQ, dK)
  records = list(prepared.records.values())
  best_base = harness.rank(records, None, flops)
  mine = [r for r in records if r["role"] == "jaxmercury" and "median_ms" in r and r.get("numerics_ok", True)]
  best = min(mine, key=lambda r: r["median_ms"], default=None)
  summary = {"fused_best": best and best["name"], "fused_best_ms": best and best["median_ms"],
             "best_baseline": best_base and best_base["name"], "best_baseline_ms": best_base and best_base["median_ms"],
             "fused_over_best_baseline": best and best.get("ratio_to_best_baseline")}
  harness.log(json.dumps({"case": label, **summary}))
  return {"case": label, "seq": seq, "causal": causal, "training": training, "seq_per_device": seq // n, "batch": BATCH, "heads": HEADS,
          "kv_heads": kv_heads, "head_dim": HEAD_DIM, "flops_per_device": flops, "reference": prepared.reference,
          "records": records, "summary": summary}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", required=True)
  p.add_argument("--seq", type=int, nargs="+", default=[16384, 32768, 65536, 131072],
                 help="global sequence lengths")
  p.add_argument("--kv_heads", type=int, nargs="+", default=[32, 8])
  p.add_argument("--iters", type=int, default=20)
  p.add_argument("--causal", action="store_true", help="causal attention (unmasked work counted in TFLOP/s)")
  p.add_argument("--training", action="store_true", help="time forward+backward steps (differentiable contestants)")
  p.add_argument("--previous_backward", action="store_true",
                 help="with --training: add the fused lowering's backward before 2026-11-24")
  p.add_argument("--smoke", action="store_true", help="a tiny case on 8 simulated CPU devices, XLA attention")
  args = p.parse_args(argv)
  n = len(jax.devices())
  mesh = jax.make_mesh((n,), LEVELS, axis_types=(AxisType.Auto,))
  seqs, kv_heads = ([128 * n], [8]) if args.smoke else (args.seq, args.kv_heads)
  out = {**harness.run_header("fused_attention", argv), "cases": []}
  for kv in kv_heads:
    for seq in seqs:
      out["cases"].append(run_case(mesh, seq, kv, 2 if args.smoke else args.iters, "xla" if args.smoke else "cudnn",
                                   causal=args.causal, training=args.training, previous=args.previous_backward))
      with open(args.out, "w", encoding="utf-8") as f:  # after every case: a run cut short keeps its data
        json.dump(out, f, indent=1)
  bad = harness.failed_contestants(out["cases"])
  if bad:
    raise SystemExit(f"contestants failed or disagree: {bad}")


if __name__ == "__main__":
  main()
