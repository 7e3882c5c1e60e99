"""Where the training steps' time goes while they run back to back: each kernel's time inside the timed loop.

    python3 -m benchmarks.ws_trace --seq 32K --kv 8 --causal [--rounds 12] [--steps cudnn ws cudnn_blocks]
    python3 -m benchmarks.ws_trace --backward --seq 32K --kv 8 --causal [--variants ws_default] [--query_chunks 4]

Nsight Compute times kernels one at a time on an idle GPU (``benchmarks.ncu_kernels``); the benchmarks time
steps back to back, where clocks, power and the gaps between launches count too. This runs
``ws_local --training``'s steps (``ws_local.training_step``) in rotating rounds under the profiler
(``kernel_trace.traced``): per step, the median wall time of a call, its kernels' span on the GPU, the GPU's busy
time in that span, and each kernel's median time.
Inputs are made on the host; the steps are ``ws_local --training``'s, checked there. ``--backward`` times the
backward alone instead: cuDNN's (``cudnn``) and ours at ``--variants`` (``ws_local.BACKWARD_STEPS``) and at
``--query_chunks`` (``q{n}``), on ``ws_profile.backward_case``'s inputs, gradients checked against cuDNN's first.
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax

from benchmarks import harness, kernel_trace, ws_local, ws_profile


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
  lines = []
  result = kernel_trace.traced({name: functools.partial(step, *inputs) for name, step in steps.items()},
                               args.rounds, lines=lines)
  print("GPU lines in the trace:", "; ".join(lines) or "none")
  mode = "backward" if args.backward else "training"
  print(f"B1 S{s} H{h} KV{args.kv} D{d}{' causal' if args.causal else ''} {mode}, {args.rounds} rounds")
  print(kernel_trace.table(result))
  if args.out:
    out = harness.header("ws_trace", [], seq=s, kv=args.kv, causal=args.causal, mode=mode, rounds=args.rounds,
                         steps=result)
    out["command"] = "python -m benchmarks.ws_trace " + " ".join(sys.argv[1:] if argv is None else argv)
    harness.write_json(args.out, out)


if __name__ == "__main__":
  main()
