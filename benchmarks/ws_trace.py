"""Where the training steps' time goes while they run back to back: each kernel's time inside the timed loop.

    python3 -m benchmarks.ws_trace --seq 32K --kv 8 --causal [--rounds 12] [--steps cudnn ws cudnn_blocks]
    python3 -m benchmarks.ws_trace --backward --seq 32K --kv 8 --causal [--variants ws_default] [--query_chunks 4]

Nsight Compute times kernels one at a time on an idle GPU (``benchmarks.ncu_kernels``); the benchmarks time
steps back to back, where clocks, power and the gaps between launches count too. This runs
``ws_local --training``'s steps (``ws_local.training_step``) in rotating rounds (``measure.rounds``), under
``jax.profiler.trace``, and reads the trace's Perfetto JSON: per step, the median wall time of a call (its host
annotation), its kernels' span on the GPU, the GPU's busy time in that span, and each kernel's median time.
Inputs are made on the host; the steps are ``ws_local --training``'s, checked there. ``--backward`` times the
backward alone instead: cuDNN's (``cudnn``) and ours at ``--variants`` (``ws_local.BACKWARD_STEPS``) and at
``--query_chunks`` (``q{n}``), on ``ws_profile.backward_case``'s inputs, gradients checked against cuDNN's first.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import statistics
import sys
import tempfile
import time

import jax

from benchmarks import harness, ws_local, ws_profile
from jaxmercury.tuner import measure

CALL = "ws_trace:"  # the host annotation of one call: "ws_trace:<step>:<round>"


def _gpu_processes(trace: dict) -> tuple[list, dict]:
  """The trace's events and ``{pid: name}`` of its GPU processes."""
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
  return events, {pid: name for pid, name in names.items() if "GPU" in name or "gpu" in name}


def _gpu_threads(events, gpu: dict) -> dict:
  """``{(pid, tid): name}`` of the GPU processes' lines."""
  return {(e["pid"], e["tid"]): e["args"]["name"] for e in events
          if e.get("ph") == "M" and e.get("name") == "thread_name" and e["pid"] in gpu}


def gpu_lines(trace: dict) -> list[str]:
  """The names of the trace's GPU processes and their lines (threads): what ``kernels_by_call`` reads."""
  events, gpu = _gpu_processes(trace)
  return sorted(f"{gpu[pid]}: {name}" for (pid, _), name in _gpu_threads(events, gpu).items())


def kernels_by_call(trace: dict) -> dict[tuple[str, int], dict]:
  """``(step, round) -> {"wall": us, "kernels": [(name, start us, duration us)]}`` from a Perfetto JSON trace:
  each call's host annotation, and the GPU kernels that started inside it."""
  events, gpu = _gpu_processes(trace)
  streams = {key for key, name in _gpu_threads(events, gpu).items() if "Stream" in name}  # not XLA Ops lines
  calls = {}
  for e in events:
    if e.get("ph") == "X" and e.get("name", "").startswith(CALL) and e["pid"] not in gpu:
      _, step, r = e["name"].split(":")
      calls[(step, int(r))] = {"start": e["ts"], "wall": e["dur"], "kernels": []}
  windows = sorted((c["start"], c["start"] + c["wall"], key) for key, c in calls.items())
  for e in events:
    if e.get("ph") != "X" or e["pid"] not in gpu or (streams and (e["pid"], e.get("tid")) not in streams):
      continue
    for start, end, key in windows:
      if start <= e["ts"] < end:
        calls[key]["kernels"].append((e["name"], e["ts"], e["dur"]))
        break
  return calls


def summary(calls: dict[tuple[str, int], dict]) -> dict[str, dict]:
  """Per step, medians over its calls: wall, the kernels' span, busy time (their union), per kernel name."""
  out = {}
  for step in sorted({s for s, _ in calls}):
    mine = [c for (s, _), c in calls.items() if s == step]
    if not all(c["kernels"] for c in mine):  # no GPU in the trace (the CPU smoke run): wall times only
      out[step] = {"calls": len(mine), "wall_ms": statistics.median(c["wall"] for c in mine) / 1e3}
      continue
    spans, busy, per_name = [], [], collections.defaultdict(list)
    for c in mine:
      ks = sorted(c["kernels"], key=lambda k: k[1])
      spans.append(max(t + d for _, t, d in ks) - ks[0][1])
      total, reach = 0.0, float("-inf")
      for _, t, d in ks:  # the union of the kernels' intervals
        total += max(0.0, t + d - max(t, reach))
        reach = max(reach, t + d)
      busy.append(total)
      by_name = collections.Counter()
      for name, _, d in ks:
        by_name[name] += d
      for name, d in by_name.items():
        per_name[name].append(d)
    out[step] = {"calls": len(mine), "wall_ms": statistics.median(c["wall"] for c in mine) / 1e3,
                 "span_ms": statistics.median(spans) / 1e3, "busy_ms": statistics.median(busy) / 1e3,
                 "kernels_ms": {n: statistics.median(v) / 1e3 for n, v in sorted(per_name.items(),
                                                                                key=lambda kv: -sum(kv[1]))}}
  return out


def table(result: dict[str, dict], width: int = 70) -> str:
  lines = []
  for step, r in result.items():
    gpu = f", GPU span {r['span_ms']:.3f} ms, busy {r['busy_ms']:.3f} ms" if "span_ms" in r else ", no GPU kernels"
    lines.append(f"{step}: {r['calls']} calls, wall {r['wall_ms']:.3f} ms{gpu}")
    lines += [f"  {name[:width]:{width}s} {ms:9.3f} ms" for name, ms in r.get("kernels_ms", {}).items()]
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq", default="32K")
  parser.add_argument("--kv", type=int, default=8)
  parser.add_argument("--causal", action="store_true")
  parser.add_argument("--steps", nargs="+", default=["cudnn", "ws", "cudnn_blocks"],
                      choices=ws_local.TRAINING_STEPS)
  parser.add_argument("--rounds", type=int, default=12)
  parser.add_argument("--heads", type=int, default=32)
  parser.add_argument("--head_dim", type=int, default=128)
  parser.add_argument("--out", help="write the summary here as JSON")
  parser.add_argument("--backward", action="store_true", help="the backward alone: cuDNN's and ours at --variants")
  parser.add_argument("--variants", nargs="+", default=["ws_default"], choices=list(ws_local.BACKWARD_STEPS))
  parser.add_argument("--query_chunks", nargs="+", type=int, default=[],
                      help="with --backward, also ours at these query chunk counts (steps q{n})")
  parser.add_argument("--smoke", action="store_true", help="a small case on the CPU (XLA, interpret mode)")
  args = parser.parse_args(argv)
  s, h, d = ws_local.seq_length(args.seq), args.heads, args.head_dim
  if args.smoke:
    s, args.kv, h, d = 256, 2, 4, 64
    ws_local.smoke_flags()
  if args.backward:
    variants = {n: ws_local.BACKWARD_STEPS[n] for n in args.variants} | ws_local.chunk_steps(args.query_chunks)
    inputs, steps = ws_profile.backward_case(s, h, args.kv, d, args.causal, args.smoke, variants)
  else:
    inputs = ws_profile.host_inputs(s, h, args.kv, d, s + 7 * args.kv + args.causal)
    steps = {n: ws_profile.training_step(n, s, h, args.kv, d, args.causal, args.smoke) for n in args.steps}
  for step in steps.values():  # compiled and warm before the trace
    jax.block_until_ready(step(*inputs))
    jax.block_until_ready(step(*inputs))
  made = collections.Counter()  # calls made per step: one per round

  def annotated(name):
    def call():
      with jax.profiler.TraceAnnotation(f"{CALL}{name}:{made[name]}"):
        jax.block_until_ready(steps[name](*inputs))
      made[name] += 1
    return call

  with tempfile.TemporaryDirectory() as logdir:
    with jax.profiler.trace(logdir, create_perfetto_trace=True):
      measure.rounds({name: annotated(name) for name in steps}, args.rounds)  # rotating, as ws_local times them
      time.sleep(0.1)
    path = glob.glob(os.path.join(logdir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not path:
      raise SystemExit(f"no perfetto_trace.json.gz under the profiler's {logdir}")
    with gzip.open(path[0]) as f:
      trace = json.load(f)
  print("GPU lines in the trace:", "; ".join(gpu_lines(trace)) or "none")
  result = summary(kernels_by_call(trace))
  mode = "backward" if args.backward else "training"
  print(f"B1 S{s} H{h} KV{args.kv} D{d}{' causal' if args.causal else ''} {mode}, {args.rounds} rounds")
  print(table(result))
  if args.out:
    out = harness.header("ws_trace", [], seq=s, kv=args.kv, causal=args.causal, mode=mode, rounds=args.rounds,
                         steps=result)
    out["command"] = "python -m benchmarks.ws_trace " + " ".join(sys.argv[1:] if argv is None else argv)
    harness.write_json(args.out, out)


if __name__ == "__main__":
  main()
