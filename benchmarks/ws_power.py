"""Each backward's sustained time, SM clock and power: contestants run back to back while nvidia-smi samples.

    python3 -m benchmarks.ws_power --seq 32K --kv 8 --causal --variants ws_default ws_grouped --out power.json

An H100 or H200 running attention's backward sits at its power cap (700 W): its clock follows the power drawn.
Timed in rotating single runs (``tuner.measure.rounds``), all contestants share one clock, set by their mix; here
each runs alone for ``--seconds`` (``--cycles`` times, in turn), so that its time is the one a loop of it gets,
and nvidia-smi's samples (``clocks.Sampler``) after its first second give the clock, power, temperature and
throttle reasons it ran at. Inputs and contestants are ``ws_profile.backward_case``'s (cuDNN's flash backward and
ours at ``--variants``, gradients checked against cuDNN's first). ``--smoke``: the CPU case, without samples.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax

from benchmarks import clocks, harness, ws_local, ws_profile

SETTLE_S = 1.0  # samples this long after a contestant starts are left out (the clock settling)


def _summary(name: str, cycle: int, start: float, end: float, runs: int, samples: list[tuple]) -> dict:
  inside = [x for x in samples if start + SETTLE_S <= x[0] <= end]  # clocks.parse's rows
  mean = lambda k: round(sum(x[k] for x in inside) / len(inside), 1) if inside else None
  return {"name": name, "cycle": cycle, "ms_per_call": round((end - start) * 1e3 / runs, 4), "calls": runs,
          "samples": len(inside), "sm_mhz": mean(2), "power_w": mean(3), "temp_c": mean(4),
          "throttle": sorted({x[5] for x in inside})}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True)
  ws_profile.case_arguments(parser, "32K", 8)
  parser.add_argument("--seconds", type=float, default=4.0)
  parser.add_argument("--cycles", type=int, default=2)
  parser.add_argument("--smoke", action="store_true", help="a small case on the CPU (XLA, interpret mode)")
  args = parser.parse_args(argv)
  s, h, kv, d = ws_local.seq_length(args.seq), 32, args.kv, 128
  if args.smoke:
    s, h, kv, d = 256, 4, 2, 64
    ws_local.smoke_flags()
  variants = {name: ws_local.BACKWARD_STEPS[name] for name in args.variants}
  inputs, contestants = ws_profile.backward_case(s, h, kv, d, args.causal, args.smoke, variants)
  sampler = clocks.Sampler() if not args.smoke else None
  windows = []
  try:
    for cycle in range(args.cycles):
      for name, fn in contestants.items():
        start, runs = time.time(), 0
        while not runs or time.time() - start < args.seconds:
          out = [fn(*inputs) for _ in range(5)]
          jax.block_until_ready(out)
          runs += 5
        windows.append((name, cycle, start, time.time(), runs))
  finally:  # nvidia-smi ends with the runs, also on Ctrl-C
    samples = sampler.stop() if sampler else []
  out = harness.header("ws_power", [])
  out["command"] = "python -m benchmarks.ws_power " + " ".join(sys.argv[1:] if argv is None else argv)
  out |= {"seq": s, "kv": kv, "causal": args.causal, "seconds": args.seconds,
          "rows": [_summary(*w, samples) for w in windows]}
  for row in out["rows"]:
    harness.log(f"{row['name']:24s} cycle {row['cycle']}: {row['ms_per_call']:.3f} ms, {row['sm_mhz']} MHz, "
                f"{row['power_w']} W, throttle {row['throttle']}")
  harness.write_json(args.out, out)


if __name__ == "__main__":
  main()
