"""One command for every benchmark suite, and for README.md's results table.

  python -m benchmarks.run --suite attention|gemm|fused|training|llama|kernels|tuner|model|moe [--smoke] [--out F] ...
  python -m benchmarks.run readme [--check]      # README.md's results table, from the results files
  python -m benchmarks.run report FILE           # the tables of one results file

Suites (``--help`` lists every flag; each suite's module says what it times):

* ``attention``, ``gemm``: jaxmercury's operator, tuned for the callers' layouts, against every plain-JAX baseline,
  with the physical floor (``benchmarks.operators``); ``training``: the same for training steps; ``fused``: the
  fused kernels against the unfused programs they lower.
* ``llama``: one Llama-3 decoder block planned by the graph search against XLA's shardings (``benchmarks.llama``).
* ``kernels``: local attention kernels on one GPU against cuDNN (``benchmarks.kernels``).
* ``tuner``: the tuner's winner against every library strategy, and its cost model's ranking
  (``benchmarks.tuner``).
* ``model``: the ``models/`` Llama decorated by ``jm.distribute`` against the same model undecorated, one training
  step; ``--fsdp``: FSDP weights and sequence-split activations on an Explicit mesh, against the plain-JAX model
  (Ulysses, all-gathered K/V) and the graph search's block plan (``benchmarks.model``).
* ``moe``: the mixture-of-experts layer at Mixtral-8x7B sizes on one GPU against a plain-JAX einsum-dispatch MoE,
  and ``ragged_dot`` against the Pallas Mosaic GPU grouped GEMM (and a padded einsum), forward and forward +
  backward (``benchmarks.moe``).

Every suite times GPUs; ``--smoke`` runs it at tiny shapes on a simulated 8-device CPU mesh instead, checking every
contestant numerically (its times mean nothing). The results file is rewritten after every case; a case is not
started when the last one suggests it would not finish inside ``--time_budget``, and ``--resume`` runs what the
budget left out.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import traceback

from benchmarks import cases, readme
from benchmarks.baselines import WINDOWED_EINSUM_FLAGS
from jaxmercury._cpu_flags import DEVICE_COUNT, cpu_flags

SUITES = ("attention", "gemm", "fused", "training", "llama", "kernels", "tuner", "model", "moe")


def fused_params(text: str) -> dict:
  """A ``--fused_params`` set: a JSON object of configuration fields."""
  try:
    value = json.loads(text)
  except json.JSONDecodeError as e:
    raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from None
  if not isinstance(value, dict) or not value:
    raise argparse.ArgumentTypeError(f"a JSON object of configuration fields expected, e.g. '{{\"block_kv\": 64}}'"
                                     f", got {text!r}")
  return value


def parse_args(argv: list[str]) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--suite", choices=SUITES, required=True)
  p.add_argument("--smoke", action="store_true", help="tiny shapes on a simulated 8-device CPU mesh")
  p.add_argument("--out", help="results JSON (default benchmarks/results/<date>-<suite>.json; with --smoke, in the "
                 "temporary folder)")
  p.add_argument("--time_budget", type=float, default=540.0, help="seconds; what does not fit is left for --resume")
  p.add_argument("--resume", action="store_true", help="keep the finished cases of --out and run the rest")
  p.add_argument("--seed", type=int, help="the inputs' seed (default: fresh; kept on --resume)")
  p.add_argument("--iters", type=int, help="timed runs per contestant (default 20; smoke 3)")
  p.add_argument("--warmup", type=int, help="warm-up runs (default 3; smoke 1)")
  p.add_argument("--max_timing_s", type=float, help="timed seconds per contestant, at least 3 runs (default 10)")
  p.add_argument("--min_timing_s", type=float,
                 help="timed seconds per contestant at least: a fast one runs more than --iters times (default 0.5; "
                      "smoke 0)")
  p.add_argument("--sustain_s", type=float, default=0.0,
                 help="each timed run a block of back-to-back runs this long, --iters blocks per contestant "
                      "(measure.sustained: power-capped GPUs clock each contestant as it runs alone; default 0: "
                      "single runs in rotating rounds)")
  p.add_argument("--trace_rounds", type=cases.count, default=0,
                 help="after the timing, run each timed contestant this many rounds more under the profiler and "
                      "record its kernels' times on the first GPU (benchmarks.kernel_trace; default 0: no trace)")
  p.add_argument("--mesh", help="N (one level) or AxB (levels node x gpu); default one level over every device")
  size = cases.parse_size
  g = p.add_argument_group("cases (defaults: the suite's, benchmarks.cases.SUITE_DEFAULTS)")
  g.add_argument("--ops", nargs="+", choices=("attention", "gemm"), help="operators (fused, training, tuner)")
  g.add_argument("--seqs", nargs="+", type=size, help="attention sequence lengths (llama: tokens), e.g. 4K 32K 1M")
  g.add_argument("--batches", nargs="+", type=int)
  g.add_argument("--variants", nargs="+", choices=tuple(cases.ATTENTION_HEADS), help="attention heads: MHA, GQA")
  g.add_argument("--causal", choices=("both", "yes", "no"))
  g.add_argument("--gemm_m", nargs="+", type=size, help="GEMM global M (tokens)")
  g.add_argument("--models", nargs="+", choices=tuple(cases.LLAMA3))
  g.add_argument("--layers", nargs="+", choices=cases.LAYERS)
  g = p.add_argument_group("tuning (attention, gemm, training, tuner)")
  g.add_argument("--top_k", type=int, help="autotune top_k (default 4; smoke 0)")
  g.add_argument("--space", type=int, help="autotune design-space sample (default 8; smoke 0)")
  g.add_argument("--tune_iters", type=int, help="autotune timed runs (default 5; smoke 2)")
  g.add_argument("--tune_max_tflop", type=float, default=200.0, help="cases above this many TFLOP per device "
                 "replay the sweep's last winner instead of tuning")
  g.add_argument("--candidate_time_limit", type=float, default=180.0, help="seconds per tuner candidate")
  g.add_argument("--db", help="tuning database (default next to --out)")
  g.add_argument("--plots", help="folder for the tuner's latency-memory plot of every tuned case")
  g.add_argument("--no_windowed", action="store_true", help="gemm: no XLA windowed-einsum child process")
  g.add_argument("--windowed_child", action="store_true", help=argparse.SUPPRESS)
  g = p.add_argument_group("suite options")
  g.add_argument("--training", action="store_true", help="fused, kernels, moe: time training steps")
  g.add_argument("--fused_kernels", nargs="+", metavar="NAME", help="fused: only these fused kernels")
  g.add_argument("--fused_params", nargs="+", type=fused_params, metavar="JSON",
                 help='fused: also time each fused kernel whose configuration has these fields at them, e.g. '
                      '\'{"block_kv": 64}\' (a JSON object per set)')
  g.add_argument("--configs", action="store_true", help="kernels: every configuration of every kernel")
  g.add_argument("--moe_kinds", nargs="+", choices=("grouped_gemm", "layer"), help="moe: which cases (default both): "
                 "the grouped GEMMs side by side, the MoE layer")
  g.add_argument("--config", default="llama3_8b", help="llama, model: the sizes (models.CONFIGS)")
  g.add_argument("--model_layers", type=int, help="model: decoder blocks (default 2)")
  g.add_argument("--fsdp", action="store_true", help="model: weights split over the mesh (FSDP) and activations "
                 "along the sequence, on Explicit axes; against the plain-JAX model and the graph search's plan")
  g.add_argument("--machines", choices=("calibrated", "reference"), help="llama: cost-model figures measured on "
                 "the mesh, or the reference H200 ones (default: calibrated on GPUs)")
  g.add_argument("--measure_iters", type=int, default=0, help="llama: time every operator candidate first")
  g.add_argument("--split", action="store_true", help="llama: also time each operator of the plan alone")
  g.add_argument("--reprice", nargs="+", metavar="RESULTS", help="llama: price the plans these results files "
                 "timed with the current cost model (CPU; nothing runs)")
  args = p.parse_args(argv)
  fast = args.smoke or args.windowed_child
  for key, gpu, smoke in (("iters", 20, 3), ("warmup", 3, 1), ("max_timing_s", 10.0, 2.0), ("min_timing_s", 0.5, 0.0),
                          ("top_k", 4, 0), ("space", 8, 0), ("tune_iters", 5, 2)):
    if getattr(args, key) is None:
      setattr(args, key, smoke if fast else gpu)
  if args.out is None:
    args.out = os.path.join(tempfile.gettempdir(), f"jaxmercury-smoke-{args.suite}.json") if args.smoke else \
        os.path.join("benchmarks", "results", f"{time.strftime('%Y-%m-%d')}-{args.suite}.json")
  args.db = args.db or os.path.splitext(args.out)[0] + ".tuning.db"
  return args


def _previous(path: str) -> dict:
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (OSError, ValueError):
    return {}


def windowed_child(args, argv: list[str], deadline: float) -> dict:
  """Runs the gemm suite's ``xla_auto_windowed`` in a child process with the windowed-einsum flags (XLA reads them
  once, when JAX starts, and they would change every other contestant); before this process starts JAX.

  Returns:
    ``{"status", "code" (its exit status), "results" (its results file), "cases": {case name: its record}}``.
  """
  out = f"{os.path.splitext(args.out)[0]}.windowed.json"
  skip = {"--out", "--resume", "--time_budget", "--seed"}
  keep = [a for i, a in enumerate(argv) if a not in skip and (i == 0 or argv[i - 1] not in skip)]
  budget = max(30.0, 0.3 * (deadline - time.time()))
  env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {WINDOWED_EINSUM_FLAGS}".strip(),
         "PYTHONPATH": os.pathsep.join(p for p in (os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                   os.environ.get("PYTHONPATH")) if p)}
  cmd = [sys.executable, "-m", "benchmarks.run", *keep, "--windowed_child", "--out", out, "--time_budget",
         f"{budget:.0f}", "--seed", str(args.seed)] + (["--resume"] if args.resume else [])
  try:
    code = subprocess.run(cmd, env=env, timeout=budget + 120, check=False).returncode
    status = f"exit {code}"
  except subprocess.TimeoutExpired:
    code, status = None, "killed after its time budget"
  if code != 2:  # 2: it found no GPU and said so
    print(f"== XLA windowed einsum in a child process (XLA_FLAGS += {WINDOWED_EINSUM_FLAGS}): {status}", flush=True)
  found = {c["name"]: c for c in _previous(out).get("cases", [])}
  records = {name: {**r, "xla_flags": WINDOWED_EINSUM_FLAGS} for name, c in found.items()
             for r in c.get("contestants", []) if r["name"] == "xla_auto_windowed"}
  return {"status": status, "code": code, "results": out, "cases": records}


def _suite(name: str):
  """The suite's module (imported here: each starts JAX)."""
  if name in ("attention", "gemm", "fused", "training"):
    from benchmarks import operators  # JAX starts here, after the windowed-einsum child
    return operators
  if name == "llama":
    from benchmarks import llama  # JAX starts here
    return llama
  if name == "kernels":
    from benchmarks import kernels  # JAX starts here
    return kernels
  if name == "model":
    from benchmarks import model  # JAX starts here
    return model
  if name == "moe":
    from benchmarks import moe  # JAX starts here
    return moe
  from benchmarks import tuner  # JAX starts here
  return tuner


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  if argv[:1] in (["readme"], ["report"]):
    return readme.main(argv)
  args = parse_args(argv)
  args.argv = argv
  if args.smoke:  # 8 simulated CPU devices; read when JAX starts (the tests' JAX has started already)
    os.environ["JAX_PLATFORMS"] = "cpu"
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = cpu_flags(flags, None if DEVICE_COUNT in flags else 8)
  start = time.time()
  deadline = start + args.time_budget
  previous = _previous(args.out) if args.resume else {}
  args.seed = args.seed if args.seed is not None else previous.get("seed", random.SystemRandom().randrange(1 << 30))
  windowed = {}
  if args.suite == "gemm" and not (args.windowed_child or args.no_windowed or args.reprice):
    windowed = windowed_child(args, argv, deadline)
    if windowed["code"] == 2:  # it found no GPU and said so
      return 2
  suite = _suite(args.suite)
  if args.fused_kernels:
    from jaxmercury.kernels import registry  # after the suite's module, which starts JAX with the flags above
    names = [k.name for k in registry.fused_kernels()]
    if unknown := sorted(set(args.fused_kernels) - set(names)):
      print(f"benchmarks.run: --fused_kernels names no fused kernel {unknown}; fused kernels: {names}",
            file=sys.stderr)
      return 2
  if args.reprice:
    return suite.reprice(args)
  import jax  # started by the suite's module already, after the windowed-einsum child
  if jax.devices()[0].platform == "cpu" and not args.smoke:
    print(f"benchmarks.run --suite {args.suite} times GPUs; this machine has only CPU devices: run it with --smoke "
          "for a check on a simulated CPU mesh", file=sys.stderr)
    return 2
  if args.smoke:  # threefry compiles slowly per shape on the CPU backend
    jax.config.update("jax_default_prng_impl", "rbg")
  return run(suite, args, argv, previous, start, windowed)


def run(suite, args, argv, previous: dict, start: float, windowed: dict) -> int:
  """The suite's cases in order, each checked and timed; the results file rewritten after each."""
  from benchmarks import harness  # after the windowed-einsum child: harness starts JAX
  deadline = start + args.time_budget
  settings = {k: getattr(args, k) for k in ("iters", "warmup", "max_timing_s", "min_timing_s", "sustain_s",
                                            "trace_rounds", "time_budget", "mesh", "top_k", "space", "tune_iters",
                                            "tune_max_tflop", "training", "configs")}
  results = harness.header(args.suite, argv, smoke=args.smoke, seed=args.seed, settings=settings)
  results.update(links=previous.get("links", {}), machines=previous.get("machines", {}))
  if windowed:
    results["windowed"] = {k: v for k, v in windowed.items() if k not in ("cases", "code")}
  env = suite.Env(args, results, deadline)
  env.windowed = windowed.get("cases", {})
  todo = suite.plan(args)
  names = {c.name for c in todo}
  kept = {}  # a case's records from --out, kept when every one of them finished
  for rec in previous.get("cases", []):
    kept.setdefault(rec.get("spec", rec["name"]), []).append(rec)
  foreign = [r for spec, recs in kept.items() if spec not in names for r in recs]
  ran, last = [], {}  # the records of this run; per operator, (flops, seconds) of its last case run
  for case in todo:
    op = getattr(case, "op", "")
    expected = last[op][1] * max(1.0, case.flops / last[op][0]) ** 0.5 if op in last else 0.0
    if case.name in kept and all(harness.finished(r) for r in kept[case.name]):
      recs = kept[case.name]
    elif time.time() + expected > deadline:
      recs = [{"name": case.name, "status": "skipped", "skipped": harness.OUT_OF_TIME, "out_of_time": True}]
    else:
      harness.log(f"\n== {case.name}  ({deadline - time.time():.0f} s of the budget left)")
      t0 = time.perf_counter()
      try:
        recs = suite.run_case(env, case)
      except Exception as exc:  # the case fails, the run goes on
        traceback.print_exc(limit=6)
        recs = {"name": case.name, "status": "error", "error": harness.error_text(exc)}
      recs = recs if isinstance(recs, list) else [recs]
      wall = round(time.perf_counter() - t0, 1)
      for r in recs:
        r.update(spec=case.name, wall_s=wall)
      if not any(r.get("out_of_time") for r in recs):
        last[op] = (max(case.flops, 1.0), wall)
    ran += recs
    results["cases"] = foreign + ran
    harness.write_json(args.out, results)
  left = [r["name"] for r in ran if not harness.finished(r)]
  if left:
    results["unfinished"] = f"{len(left)} cases left out for time or failed to run, from {left[0]}: --resume runs them"
  results["wall_s"] = round(time.time() - start, 1)
  harness.write_json(args.out, results)
  print("\n" + readme.report(results), flush=True)
  bad = readme.problems(results, strict=args.smoke)
  if bad:
    print("\n!!! PROBLEMS:\n  " + "\n  ".join(bad), flush=True)
  print(f"\nwrote {args.out}", flush=True)
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
