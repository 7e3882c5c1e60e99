"""How fast the tuner decides, and that what it decides is never slower than the plain program (issue 52's marks).

  python -m benchmarks.tune_speed --out F.json [--cases ...] [--smoke]
  python -m benchmarks.tune_speed --out F.json --processes 4 --process_id I --coordinator 127.0.0.1:PORT   # each GPU

Cases, in order (``--cases``), on every device of the machine (one level), the callers' layouts as the operator
suites take them (attention sequence-split; an all-gather GEMM ``x[M@, K] . w[K, N@]``, a reduce-scatter GEMM
``x[M, K@] . w[K@, N] -> [M@, N]``):

* ``calibration``: a fresh database's calibration for the attention program (the mesh's figures, the
  attention kernels' and their backward blocks', which the first training tune measures) and then for the GEMM's
  kernels, each part timed (mark: the first tune's part, the mesh's and the attention kernels',
  ``CALIBRATION_S``; the backward blocks' is recorded beside it);
* ``attention``, ``attention-training``: B1 H32 KV8 D128 causal bf16 at ``--seq`` (32K), its forward and its
  training step; ``gemm-ag``, ``gemm-rs``: ``--gemm`` (8192^3) bf16. Each ``jm.autotune`` at its defaults on the
  calibrated database, its compilation cache cold (the marks ``TUNE_S``: its wall time; ``--gemm_rs``: the
  reduce-scatter GEMM's shape where it differs); then the winner and the
  plain program it was measured against, each compiled again, side by side in interleaved rounds on inputs in the
  callers' layouts (mark: the winner at least ``RATIO`` of the plain program's speed);
* ``model``: the ``models/`` Llama (``--model_layers`` 2 layers, ``--model_config`` 8B widths, ``--model_tokens``
  4K tokens) decorated by ``jm.distribute(tune=True, training=True)`` on a fresh database: from the decoration to
  the compiled training step, calibration included (mark ``TUNE_S["model"]``), then its step beside the
  undecorated model's (mark ``RATIO``). One process only.

Under ``--processes N`` (one process per GPU, ``jax.distributed``) every process runs the same cases and
process 0 writes the results. ``--smoke`` runs small shapes on the simulated 8-device CPU mesh (the marks mean
nothing there). Each case records its marks (``marks``: what, value, bound, met).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
import traceback

import jax
from jax.sharding import NamedSharding

import jaxmercury as jm
from benchmarks import harness, model, operators
from benchmarks.cases import AttentionCase, GemmCase, parse_size
from jaxmercury._cpu_flags import cpu_flags
from jaxmercury.tuner import agree, calibrate, measure
from models import CONFIGS
from models.train import random_tokens

TUNE_S = {"attention": 10.0, "attention-training": 20.0, "gemm-ag": 5.0, "gemm-rs": 5.0, "model": 60.0}
CALIBRATION_S = 40.0
RATIO = 0.98  # the tuned program's speed over the plain program's, at least
CASES = ("calibration", "attention", "attention-training", "gemm-ag", "gemm-rs", "model")
DEFAULT_CASES = ("calibration", "attention", "attention-training", "gemm-ag", "model")


def parse_args(argv):
  p = argparse.ArgumentParser(prog="python -m benchmarks.tune_speed", description=__doc__.splitlines()[0])
  p.add_argument("--out", required=True, help="results JSON")
  p.add_argument("--cases", nargs="+", choices=CASES, default=list(DEFAULT_CASES))
  p.add_argument("--seq", type=parse_size, default=parse_size("32K"), help="attention sequence length")
  p.add_argument("--gemm", default="8192,8192,8192", help="the all-gather GEMM's M,K,N")
  p.add_argument("--gemm_rs", help="the reduce-scatter GEMM's M,K,N (default --gemm's)")
  p.add_argument("--model_config", default="llama3_8b", help="models.CONFIGS entry whose widths the model takes")
  p.add_argument("--model_layers", type=int, default=2)
  p.add_argument("--model_tokens", type=parse_size, default=parse_size("4K"))
  p.add_argument("--iters", type=int, default=20, help="interleaved rounds of the side-by-side timing")
  p.add_argument("--time_budget", type=float, default=540.0, help="seconds; no case starts after it")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--processes", type=int, default=1, help="one process per GPU: how many (jax.distributed)")
  p.add_argument("--process_id", type=int, default=0)
  p.add_argument("--coordinator", default="127.0.0.1:8476", help="jax.distributed's coordinator address")
  p.add_argument("--smoke", action="store_true", help="small shapes on a simulated 8-device CPU mesh")
  args = p.parse_args(argv)
  args.gemm = _shape(p, "--gemm", args.gemm)
  args.gemm_rs = _shape(p, "--gemm_rs", args.gemm_rs) if args.gemm_rs else args.gemm
  if args.smoke:
    args.seq, args.gemm, args.gemm_rs = 256, (256, 128, 256), (256, 128, 256)
    args.model_config, args.model_tokens, args.iters = "tiny", 64, 4
  return args


def _shape(parser, flag: str, text: str) -> tuple:
  try:
    shape = tuple(parse_size(x) for x in text.split(","))
  except ValueError:
    shape = ()
  if len(shape) != 3:
    parser.error(f"{flag} {text!r}: expected M,K,N such as 8192,8192,8192")
  return shape


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parse_args(argv)
  if args.smoke:  # before JAX makes its client (at the first device asked for): 8 devices in all
    jax.config.update("jax_platforms", "cpu")
    os.environ["XLA_FLAGS"] = cpu_flags(os.environ.get("XLA_FLAGS", ""), max(1, 8 // args.processes))
  if args.processes > 1:  # before any device is asked for, too
    if args.smoke:
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.processes,
                               process_id=args.process_id)
  if jax.devices()[0].platform == "cpu" and not args.smoke:
    print("benchmarks.tune_speed times GPUs; this machine has only CPU devices: run it with --smoke for a check on a "
          "simulated CPU mesh", file=sys.stderr)
    return 2
  start = time.time()
  results = harness.header("tune_speed", argv, smoke=args.smoke, processes=args.processes)
  results["command"] = "python -m benchmarks.tune_speed " + " ".join(argv)
  results["marks"] = {"tune_s": TUNE_S, "calibration_s": CALIBRATION_S, "ratio_to_plain": RATIO}
  results["cases"] = []
  env = Env(args, start + args.time_budget)
  for name in args.cases:
    if time.time() > env.deadline:
      rec = {"name": name, "status": "skipped", "skipped": harness.OUT_OF_TIME, "out_of_time": True}
    else:
      harness.log(f"\n== {name}")
      t0 = time.perf_counter()
      try:
        rec = RUNNERS[name](env, name)
      except Exception as exc:  # the case fails, the run goes on
        traceback.print_exc(limit=6)
        rec = {"name": name, "status": "error", "error": harness.error_text(exc)}
      rec["wall_s"] = round(time.perf_counter() - t0, 1)
    results["cases"].append(rec)
    results["wall_s"] = round(time.time() - start, 1)
    if jax.process_index() == 0:
      harness.write_json(args.out, results)
  harness.log("\n" + table(results))
  return 0


class Env:
  """What the cases share: the arguments, the mesh, the calibrated database (``calibration`` makes it)."""

  def __init__(self, args, deadline: float):
    self.args, self.deadline = args, deadline
    self.mesh = harness.make_mesh("")
    self.folder = tempfile.mkdtemp(prefix="tune_speed-")
    self._database = None

  def database(self):
    """The calibrated database the operator cases tune on: the ``calibration`` case's, else one calibrated on
    first use."""
    if self._database is None:
      self._database = self.fresh_database("tuning")
      calibrate_parts(self, self._database)
    return self._database

  def fresh_database(self, name: str):
    return jm.Database(os.path.join(self.folder, name, "tuning.db"))


def attention_case(args) -> AttentionCase:
  if args.smoke:
    return AttentionCase(1, 4, 2, 16, args.seq, True, dtype="float32")
  return AttentionCase(1, 32, 8, 128, args.seq, True)


def gemm_case(args, kind: str) -> GemmCase:
  m, k, n = args.gemm if kind == "allgather" else args.gemm_rs
  return GemmCase(kind, m, k, n, dtype="float32" if args.smoke else "bfloat16")


def calibrate_parts(env, database) -> dict:
  """Calibrates ``database`` as a first attention tune (forward), the first attention training tune (the backward
  blocks) and then a first GEMM tune would: seconds per part."""
  seconds = {}
  progs = {"attention": operators.program(attention_case(env.args)),
           "gemm": operators.program(gemm_case(env.args, "allgather"))}
  local = jax.process_index() == 0

  def measured(figures):
    return agree.broadcast_json(figures if agree.is_leader() else None) if jax.process_count() > 1 else figures

  for op, prog in progs.items():
    parts = (calibrate.MESH, calibrate.KERNELS) if op == "attention" else (calibrate.KERNELS,)
    for part in parts:
      t0 = time.perf_counter()
      figures = measured(calibrate.measure_parts(prog, env.mesh, parts=(part,), local=local, backward=False)[part])
      database.store_machine_part(part, prog, env.mesh, figures)
      seconds[f"{op} {part}"] = round(time.perf_counter() - t0, 2)
    t0 = time.perf_counter()
    if calibrate.BACKWARD not in figures:  # as the first training tune would (CPUs measure none)
      figures = measured(calibrate.with_backward(prog, env.mesh, figures, local=local))
      database.store_machine_part(calibrate.KERNELS, prog, env.mesh, figures)
    seconds[f"{op} backward"] = round(time.perf_counter() - t0, 2)
  return seconds


def run_calibration(env, name: str) -> dict:
  database = env.fresh_database("tuning")
  seconds = calibrate_parts(env, database)
  env._database = database  # the operator cases tune on it
  first = seconds["attention mesh"] + seconds["attention kernels"]
  return {"name": name, "status": "ok", "op": "calibration", "calibration_s": seconds,
          "first_training_tune_s": round(first + seconds["attention backward"], 2),
          "marks": [harness.mark("calibration_s (mesh and attention kernels: a first tune's)", first,
                          at_most=CALIBRATION_S)], "contestants": []}


def run_operator(env, name: str) -> dict:
  """A tune on the calibrated database, then its winner against the plain program, side by side."""
  args = env.args
  kinds = {"gemm-ag": "allgather", "gemm-rs": "reducescatter"}
  case = attention_case(args) if name.startswith("attention") else gemm_case(args, kinds[name])
  training = name.endswith("training")
  prog, mesh = operators.program(case), env.mesh
  ins, out = operators.layouts(case, mesh)
  database = env.database()
  lines = []
  t0 = time.perf_counter()
  result = jm.autotune(prog, mesh, in_shardings=ins, out_sharding=out, training=training, database=database,
                       key=jax.random.key(args.seed), log=lambda s: (lines.append(s), harness.log("    " + s)))
  tune_s = time.perf_counter() - t0
  rec = {"name": f"{case.name}{' training step' if training else ''}", "op": name, "config": dataclasses.asdict(case),
         "mesh": dict(mesh.shape), "training": training,
         "tuner": {"wall_s": round(tune_s, 2), "phases": {k: round(v, 3) for k, v in result.phases.items()},
                   "compiled": result.compiled, "references": result.references, "spearman": result.spearman,
                   "decision": result.decision,
                   "winner": result.best and result.best.name,
                   "timed": sum(1 for c in result.candidates if c.status == measure.OK),
                   "candidates": len(result.candidates), "from_database": result.from_database}}
  marks = [harness.mark("tune_s", tune_s, at_most=TUNE_S[name])]
  if result.best is None or result.baseline is None:
    rec.update(status="failed", error=result.summary(), marks=marks)
    return rec
  keys = jax.random.split(jax.random.key(args.seed + 1), len(prog.reads) + 1)
  inputs = [harness.random_array(k, b.shape, b.dtype, NamedSharding(mesh, spec))
            for k, b, spec in zip(keys, prog.reads, ins)]
  if training:
    inputs.append(harness.random_array(keys[-1], prog.writes.shape, prog.writes.dtype, NamedSharding(mesh, out)))
  build = (lambda s: lambda: measure.training_step(s.compile())) if training else (lambda s: s.compile)
  contestants = [harness.Contestant("plain", "baseline", build(result.baseline.schedule), result.baseline.name),
                 harness.Contestant("jaxmercury", "jaxmercury", build(result.best.schedule),
                                    f"autotune winner: {result.best.name}")]
  settings = harness.Settings(iters=args.iters, warmup=2, max_timing_s=5.0, deadline=env.deadline,
                              tolerance=measure.gradient_tolerance(prog.writes.dtype) if training
                              else measure.tolerance(prog.writes.dtype, mesh.devices.flat[0].platform))
  records, ref = harness.run_contestants(contestants, inputs, settings)
  harness.finish(rec, records, ref, flops_per_device=prog.flops * (3 if training else 1) / mesh.devices.size)
  mine = next(r for r in records if r["name"] == "jaxmercury")
  if "ratio_to_best_baseline" in mine:
    marks.append(harness.mark("ratio_to_plain", mine["ratio_to_best_baseline"], at_least=RATIO))
  rec["marks"] = marks
  return rec


def run_model(env, name: str) -> dict:
  """The decorated Llama tuned for training on a fresh database (calibration included), against the model as
  written."""
  args = env.args
  if jax.process_count() > 1:
    return {"name": name, "status": "skipped", "skipped": "one process only (the model's inputs are one process's)",
            "contestants": []}
  case = model.ModelCase(args.model_config, args.model_layers, args.model_tokens)
  implementation = "xla" if args.smoke else "cudnn"
  tokens = random_tokens(jax.random.key(args.seed), 1, case.tokens, CONFIGS[case.config].vocab)
  database = env.fresh_database("model")
  tuning = {}

  def decorated():
    lines = []
    t0 = time.perf_counter()
    routed = jm.distribute(model.build(case, "xla"), mesh=env.mesh, database=database, tune=True, training=True,
                           log=lambda s: (lines.append(s), harness.log("    " + s)))
    step, step_args = model.step_of(routed, tokens)
    compiled = step.lower(*step_args).compile()  # tunes every operator while tracing
    tuning.update(wall_s=round(time.perf_counter() - t0, 2),
                  operators=[line for line in lines if line.startswith("== ")])
    return compiled, step_args

  contestants = [harness.Contestant("plain", "baseline", lambda: model.step_of(model.build(case, implementation),
                                                                                tokens),
                                    f"the model as written, attention {implementation}"),
                 harness.Contestant("jaxmercury", "jaxmercury", decorated, "jm.distribute(tune=True, training=True)")]
  settings = harness.Settings(iters=args.iters, warmup=2, max_timing_s=5.0, deadline=env.deadline,
                              tolerance=measure.gradient_tolerance("bfloat16"))
  records, ref = harness.run_contestants(contestants, [tokens], settings)
  rec = {"name": case.name, "op": name, "config": dataclasses.asdict(case), "mesh": dict(env.mesh.shape),
         "training": True, "tuning": tuning}
  harness.finish(rec, records, ref, flops_per_device=case.flops / env.mesh.devices.size)
  marks = [harness.mark("tune_s (decorated model to its compiled training step, calibration included)",
                 tuning.get("wall_s", float("inf")), at_most=TUNE_S[name])]
  mine = next(r for r in records if r["name"] == "jaxmercury")
  if "ratio_to_best_baseline" in mine:
    marks.append(harness.mark("ratio_to_plain", mine["ratio_to_best_baseline"], at_least=RATIO))
  rec["marks"] = marks
  return rec


RUNNERS = {"calibration": run_calibration, "attention": run_operator, "attention-training": run_operator,
           "gemm-ag": run_operator, "gemm-rs": run_operator, "model": run_model}


def table(results: dict) -> str:
  """One row per case: its marks."""
  rows = ["| case | mark | value | bound | met |", "|---|---|---|---|---|"]
  for case in results["cases"]:
    for m in case.get("marks", []):
      bound = f"<= {m['at_most']}" if "at_most" in m else f">= {m['at_least']}"
      rows.append(f"| {case['name']} | {m['what']} | {m['value']} | {bound} | {'yes' if m['met'] else 'NO'} |")
    if not case.get("marks"):
      rows.append(f"| {case['name']} | | | | {case.get('status')}: {case.get('error') or case.get('skipped', '')} |")
  return "\n".join(rows)


if __name__ == "__main__":
  sys.exit(main())
