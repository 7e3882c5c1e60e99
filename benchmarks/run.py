"""The benchmark suite: jaxmercury against every baseline, side by side, on the same devices.

  python -m benchmarks.run --suite attention|gemm|all --out benchmarks/results/<date>-<device>.json
  python -m benchmarks.run --smoke --suite all --out /tmp/smoke.json     # simulated 8-device CPU mesh

In one process on one mesh per case, for every configuration of the suite
(``benchmarks.suites``): jaxmercury's operator, tuned by ``jm.autotune`` for
the callers' layouts, and each plain-JAX baseline (``benchmarks.baselines``)
are compiled, timed in interleaved rounds on the same inputs and checked
against one another. Each result records the median, the ratio to the best
baseline and the fraction of the physical floor (the larger of the compute
time of one device's share at the measured single-GPU rate and the time of
the fewest bytes a device must receive at the measured link bandwidth).

XLA's automatic collective matmul needs XLA flags that must be set before
JAX starts and would change every other contestant too, so it runs first, in
a subprocess (``benchmarks.xla_windowed``), and its results are merged in.

Sweeps grow the sequence length (attention) or M (GEMM); a contestant that
fails (out of memory, ...) is skipped at the larger sizes, and a sweep stops
when every contestant failed. ``--time_budget`` bounds the run: the results
file is rewritten after every case, a case is not started when the last one
suggests it would not finish in the time left (``expected_seconds``), and
``--resume`` continues a run from it.
Whatever the budget left out (a case not started, or contestants of a case
skipped because time ran out) is no failure: it stops no sweep and marks no
contestant failed, and ``--resume`` runs such cases again.
"""

from __future__ import annotations

import os
import sys

SCHEMA = "jaxmercury-benchmarks/1"


def _preconfigure(argv):
  """``--smoke``: 8 simulated CPU devices. Must run before JAX starts."""
  if "--smoke" in argv:
    os.environ["JAX_PLATFORMS"] = "cpu"
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
      os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()


if __name__ == "__main__":
  _preconfigure(sys.argv)

# pylint: disable=wrong-import-position
import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

from benchmarks import report, suites  # noqa: E402  (no JAX: planning happens before JAX starts)


# ------------------------------------------------------------------ flags


def parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--suite", choices=("attention", "gemm", "all"), default="all")
  p.add_argument("--out", required=True, help="results JSON (rewritten after every case)")
  p.add_argument("--smoke", action="store_true", help="tiny configurations on a simulated 8-device CPU mesh")
  p.add_argument("--mesh", default="", help="mesh: N (one level) or AxB (levels node x gpu, for USP); "
                 "default one level over every device")
  p.add_argument("--seqs", nargs="*", type=suites.parse_size, default=None,
                 help="attention sequence lengths (e.g. 4K 32K 1M); default the doubling sweep")
  p.add_argument("--seq_max", default="1M", help="end of the doubling sweep, or 'none': until every "
                 "contestant fails")
  p.add_argument("--batches", nargs="*", type=int, default=[1, 16])
  p.add_argument("--variants", nargs="*", choices=("MHA", "GQA"), default=["MHA", "GQA"])
  p.add_argument("--causal", choices=("both", "yes", "no"), default="both")
  p.add_argument("--gemm_m", nargs="*", type=suites.parse_size, default=list(suites.GEMM_M))
  p.add_argument("--models", nargs="*", choices=sorted(suites.LLAMA3), default=["8B", "70B"])
  p.add_argument("--layers", nargs="*", choices=("qkv", "gate_up", "o", "down"),
                 default=["qkv", "gate_up", "o", "down"])
  p.add_argument("--time_budget", type=float, default=540.0,
                 help="seconds for the whole run; cases not expected to finish in time are left for --resume")
  p.add_argument("--resume", action="store_true", help="keep the finished cases of --out and run the rest")
  p.add_argument("--iters", type=int, default=None, help="timed runs per contestant (default 20; smoke 3)")
  p.add_argument("--warmup", type=int, default=None, help="warm-up runs (default 3; smoke 1)")
  p.add_argument("--max_timing_s", type=float, default=None,
                 help="timed seconds per contestant; slow ones get fewer runs, at least 3 (default 10; smoke 2)")
  p.add_argument("--top_k", type=int, default=None, help="autotune top_k (default 4; smoke 0)")
  p.add_argument("--space", type=int, default=None, help="autotune design-space sample (default 8; smoke 0)")
  p.add_argument("--tune_iters", type=int, default=None, help="autotune timed runs (default 5; smoke 2)")
  p.add_argument("--tune_max_tflop", type=float, default=200.0,
                 help="tune only calls of at most this many TFLOP per device; larger ones replay the "
                 "sweep's last winner (the tuner's single-device reference and timing would take too long)")
  p.add_argument("--candidate_time_limit", type=float, default=180.0,
                 help="seconds a tuner candidate may take to compile and run once")
  p.add_argument("--db", default=None, help="tuning database (default: next to --out)")
  p.add_argument("--no_windowed", action="store_true", help="skip XLA's windowed-einsum subprocess")
  p.add_argument("--fig13", default=None, help="the case whose tuner result is drawn as Mercury's Fig. 13 "
                 "(default: attention MHA B1 S32K, or the USP case with --smoke)")
  p.add_argument("--plots", default=None, help="folder for the plots (default: <out>-plots)")
  p.add_argument("--no_plots", action="store_true")
  p.add_argument("--seed", type=int, default=None, help="inputs' seed (default: fresh; kept on --resume)")
  p.add_argument("--link_mib", type=int, default=None, help="ppermute size for the link bandwidth "
                 "(default 1024; smoke 4)")
  args = p.parse_args(argv)
  gpu_defaults = dict(iters=20, warmup=3, max_timing_s=10.0, top_k=4, space=8, tune_iters=5, link_mib=1024)
  smoke_defaults = dict(iters=3, warmup=1, max_timing_s=2.0, top_k=0, space=0, tune_iters=2, link_mib=4)
  for k, v in (smoke_defaults if args.smoke else gpu_defaults).items():
    if getattr(args, k) is None:
      setattr(args, k, v)
  args.seq_max = None if args.seq_max.lower() == "none" else suites.parse_size(args.seq_max)
  args.causal = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
  stem = os.path.splitext(args.out)[0]
  args.db = args.db or f"{stem}.tuning.db"
  args.plots = args.plots or f"{stem}-plots"
  if args.fig13 is None:
    args.fig13 = ("attention GQA B2 S128 H8 KV2 D16 causal mesh 2x4" if args.smoke
                  else "attention MHA B1 S32K H32 KV32 D128" + (f" mesh {args.mesh}" if args.mesh else ""))
  return args


def plan(args) -> list:
  """``[(families, sizes)]`` in run order; ``sizes`` None: doubling until every contestant fails."""
  if args.smoke:
    return suites.smoke_sweeps(args.suite)
  sel = suites.Selection(seqs=args.seqs, seq_max=args.seq_max, batches=tuple(args.batches),
                         variants=tuple(args.variants), causal=args.causal, gemm_m=tuple(args.gemm_m),
                         models=tuple(args.models), layers=tuple(args.layers), mesh=args.mesh)
  out = []
  if args.suite in ("attention", "all"):
    out.append(suites.attention_sweeps(sel, args.mesh))
  if args.suite in ("gemm", "all"):
    out.append(suites.gemm_sweeps(sel, args.mesh))
  return out


def sizes_of(sizes, start: int):
  """The sweep's sizes: the list, or doubling from ``start`` (capped at 2**28)."""
  if sizes is not None:
    yield from sizes
    return
  s = start
  while s <= 1 << 28:
    yield s
    s *= 2


# ---------------------------------------------------------- results file


def write_json(path: str, data: dict):
  """Writes ``data`` atomically (a partial run leaves a readable file)."""
  folder = os.path.dirname(os.path.abspath(path))
  os.makedirs(folder, exist_ok=True)
  tmp = f"{path}.tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(data, f, indent=1)
  os.replace(tmp, path)


def load_previous(path: str) -> dict | None:
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
  except (OSError, ValueError):
    return None
  return data if data.get("schema") == SCHEMA else None


# ------------------------------------------------- windowed-einsum subprocess


def windowed_subprocess(args, gemm_cases, seed, deadline, previous) -> dict:
  """Runs ``benchmarks.xla_windowed`` for the GEMM cases (before this process starts JAX).

  Returns:
    ``{"flags", "status", "cases": {case name: record}}``; cases already
    measured in ``previous`` are kept, not re-run.
  """
  from benchmarks.baselines.gemm import WINDOWED_EINSUM_FLAGS
  kept = dict((previous or {}).get("windowed_subprocess", {}).get("cases", {}))
  kept = {k: v for k, v in kept.items() if "median_ms" in v or "error" in v}
  out = {"flags": WINDOWED_EINSUM_FLAGS, "cases": kept}
  todo = [c for c in gemm_cases if c.name not in kept]
  if args.no_windowed:
    out["status"] = "not run (--no_windowed)"
    return out
  if not todo:
    out["status"] = "nothing to run"
    return out
  remaining = deadline - time.time()
  child_deadline = time.time() + max(30.0, 0.3 * remaining)
  folder = tempfile.mkdtemp(prefix="jm-windowed-")
  spec_path, out_path = os.path.join(folder, "spec.json"), os.path.join(folder, "out.json")
  spec = {"cases": [dataclasses.asdict(c) for c in todo], "seed": seed, "iters": args.iters,
          "warmup": args.warmup, "max_timing_s": args.max_timing_s, "deadline": child_deadline,
          "prng_impl": "rbg" if args.smoke else None}
  with open(spec_path, "w", encoding="utf-8") as f:
    json.dump(spec, f)
  env = dict(os.environ)
  env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {WINDOWED_EINSUM_FLAGS}".strip()
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
  print(f"\n== XLA windowed einsum: {len(todo)} GEMM cases in a subprocess "
        f"(XLA_FLAGS += {WINDOWED_EINSUM_FLAGS})", flush=True)
  t0 = time.time()
  try:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.xla_windowed", "--spec", spec_path,
                           "--out", out_path], env=env, cwd=root, timeout=child_deadline - t0 + 120,
                          check=False)
    out["status"] = f"exit {proc.returncode}"
  except subprocess.TimeoutExpired:
    out["status"] = "killed after its time budget"
  out["wall_s"] = round(time.time() - t0, 1)
  try:
    with open(out_path, encoding="utf-8") as f:
      child = json.load(f)
    out["cases"].update(child.get("cases", {}))
    out["device"] = child.get("device")
  except (OSError, ValueError) as exc:
    out["status"] += f"; no results ({exc})"
  print(f"   windowed einsum subprocess: {out['status']} in {out['wall_s']} s", flush=True)
  return out


# ---------------------------------------------------------------- the run


class Env:
  """What the cases share: flags, meshes, measured links, cost-model figures, deadline."""

  def __init__(self, args, results, deadline, windowed):
    import jax
    import jaxmercury as jm
    self.args = args
    self.results = results
    self.deadline = deadline
    self.windowed = windowed
    self.warmup = args.warmup
    self.impl = "cudnn" if jax.devices()[0].platform == "gpu" and not args.smoke else "xla"
    self.database = jm.Database(args.db)
    self._meshes = {}
    self.winners = {}  # family -> (size, name, trace) of the sweep's last tuned winner
    self.current_inputs = None
    self.program_reference = None

  def mesh(self, spec: str):
    from benchmarks import harness
    if spec not in self._meshes:
      self._meshes[spec] = harness.make_mesh(spec)
    return self._meshes[spec]

  def link(self, mesh) -> dict | None:
    """The ppermute ring bandwidth over the whole mesh, measured once per mesh."""
    from benchmarks import harness
    key = "x".join(str(s) for s in mesh.devices.shape)
    links = self.results.setdefault("links", {})
    if key not in links:
      try:
        links[key] = harness.link_bandwidth(mesh, self.args.link_mib << 20)
        print(f"  link over mesh {key}: {links[key]['bytes_per_s'] / 1e9:.1f} GB/s per device "
              f"({links[key]['bytes_per_device'] >> 20} MiB ppermute in {links[key]['ms']:.3f} ms)", flush=True)
      except Exception as exc:  # noqa: BLE001
        links[key] = {"error": harness.error_text(exc)}
    return links[key] if "bytes_per_s" in links[key] else None

  def machine(self, family: str, size: int, prog, mesh):
    """Cost-model figures: fixed on the smoke mesh; else calibrated (``jaxmercury.tuner.calibrate``).

    One calibration serves every sweep of a pattern (attention causal or not,
    GEMM) on a mesh, and is taken again when the size grew 8x since; the
    figures are kept in the results file, so a resumed run reuses them.
    """
    from benchmarks.cases import SMOKE_MACHINE
    from jaxmercury.tuner.calibrate import calibrate
    from jaxmercury.tuner.cost import Machine
    del family  # the pattern decides, not the shape
    if self.args.smoke:
      return SMOKE_MACHINE
    key = f"{prog.pattern}{' causal' if prog.params.get('causal') else ''} mesh {dict(mesh.shape)}"
    stored = self.results.setdefault("machines", {})
    held = stored.get(key)
    if held is None or size >= 8 * held["size"]:
      t0 = time.perf_counter()
      machine = calibrate(prog, mesh)
      held = stored[key] = {"size": size, "figures": machine.to_dict(),
                            "calibrate_s": round(time.perf_counter() - t0, 1)}
      print(f"  calibrated the cost model ({key}) in {held['calibrate_s']} s", flush=True)
    return Machine.from_dict(held["figures"])

  def candidate_limit(self) -> float:
    return max(10.0, min(self.args.candidate_time_limit, self.deadline - time.time()))

  def is_fig13(self, case) -> bool:
    return case.name == self.args.fig13

  def tuner_plot(self, result, case) -> str | None:
    """The tuner's own latency-memory scatter (``jaxmercury.tuner.plot``) of this case."""
    if self.args.no_plots:
      return None
    try:
      from jaxmercury.tuner.plot import latency_memory_plot
      os.makedirs(self.args.plots, exist_ok=True)
      path = os.path.join(self.args.plots, "fig13-tuner.png")
      return latency_memory_plot(result, path, title=f"jaxmercury autotune: {case.name}")
    except Exception as exc:  # noqa: BLE001 - a plot never stops the run
      print(f"  (tuner plot failed: {exc})", flush=True)
      return None

  def windowed_result(self, case) -> dict | None:
    if case.suite != "gemm":
      return None
    rec = self.windowed.get("cases", {}).get(case.name)
    if rec is None:
      why = self.windowed.get("status", "not run")
      out = {"name": "xla_auto_windowed", "role": "baseline", "skipped": f"windowed-einsum subprocess: {why}"}
      if "time budget" in why:  # killed at its budget before this case: --resume runs it
        out["out_of_time"] = True
      return out
    return dict(rec)


@dataclasses.dataclass
class Sweep:
  """A sweep's memory: contestants that failed at a smaller size, and why it stopped.

  Only errors count as failures; a contestant or case skipped because the
  time budget ran out (``report.out_of_time``) is neither failed nor a reason
  to stop.
  """

  failed: dict = dataclasses.field(default_factory=dict)
  stopped: str | None = None

  def update(self, case, rec: dict):
    label = suites.seq_label(case.size)
    for c in rec.get("contestants", []):
      if "error" in c and not report.out_of_time(c):
        self.failed.setdefault(c["name"], f"failed at size {label}: {c['error'][:200]}")
    late = report.out_of_time(rec) or report.late_contestants(rec)
    if rec.get("status") in ("failed", "error") and not late:
      self.stopped = f"every contestant failed at size {label}"


def expected_seconds(case, history: list[dict]) -> float:
  """A guess at ``case``'s wall time from the last case of its suite that ran (0 when none did).

  The last case's seconds, scaled by the square root of the flops ratio when
  ``case`` does more work (compiles and fixed costs do not grow with it): a
  case that would not finish inside the budget is left for ``--resume``
  rather than started and cut off by an outer time limit.
  """
  ran = [r for r in history if r.get("suite") == case.suite and r.get("wall_s") and not r.get("out_of_time")]
  if not ran:
    return 0.0
  last = ran[-1]
  ratio = case.flops / max(suites.case_from_dict(last["config"]).flops, 1.0)
  return last["wall_s"] * max(1.0, ratio) ** 0.5


def run_case(env, case, sweep: Sweep) -> dict:
  from benchmarks import cases
  import jax
  t0 = time.perf_counter()
  left = env.deadline - time.time()
  print(f"\n== {case.name}  ({left:.0f} s of the budget left)", flush=True)
  rec = {"name": case.name, "suite": case.suite, "family": case.family, "size": case.size,
         "config": dataclasses.asdict(case)}
  try:
    body = cases.run_attention if case.suite == "attention" else cases.run_gemm
    rec.update(body(env, case, dict(sweep.failed)))
  except Exception as exc:  # noqa: BLE001 - the case fails, the run goes on
    from benchmarks import harness
    rec["status"] = "error"
    rec["error"] = harness.error_text(exc)
    print(f"  CASE ERROR: {rec['error']}", flush=True)
    traceback.print_exc(limit=6)
  if env.is_fig13(case):
    rec["fig13"] = True
  rec["wall_s"] = round(time.perf_counter() - t0, 1)
  gc.collect()
  jax.clear_caches()
  return rec


def header(args, seed) -> dict:
  import jax
  import jaxlib
  import jaxmercury
  dev = jax.devices()[0]
  return {
      "schema": SCHEMA,
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "device": dev.device_kind, "platform": dev.platform, "n_devices": len(jax.devices()),
      "jax_version": jax.__version__, "jaxlib_version": jaxlib.__version__,
      "jaxmercury_version": jaxmercury.__version__, "python": platform.python_version(),
      "command": "python -m benchmarks.run " + " ".join(sys.argv[1:]) if sys.argv else "",
      "smoke": args.smoke, "suite": args.suite, "seed": seed,
      "settings": {k: getattr(args, k) for k in ("iters", "warmup", "max_timing_s", "top_k", "space",
                                                  "tune_iters", "tune_max_tflop", "time_budget", "link_mib",
                                                  "mesh")},
      "floor_definition": "max(compute, communication): compute = this device's share of the flops at the "
                          "rate one device reaches on one rank's share (timed alone); communication = the "
                          "fewest bytes a device receives under the baselines' strategies at the ppermute "
                          "ring bandwidth measured once per mesh",
  }


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  _preconfigure(argv)
  args = parse_args(argv)
  start = time.time()
  deadline = start + args.time_budget
  previous = load_previous(args.out) if args.resume else None
  seed = args.seed if args.seed is not None else (previous or {}).get("seed")
  seed = seed if seed is not None else random.SystemRandom().randrange(1 << 30)
  args.seed = seed
  sweeps = plan(args)

  gemm_cases = [suites.with_size(f, m) for fams, sizes in sweeps for m in (sizes or []) for f in fams
                if f.suite == "gemm"]
  # Kept: cases that ran with nothing left out for time; the rest (not started, or contestants skipped
  # because the budget ran out) run again.
  done = {c["name"]: c for c in (previous or {}).get("cases", []) if report.finished(c)}
  windowed = (windowed_subprocess(args, [c for c in gemm_cases if c.name not in done], seed, deadline, previous)
              if gemm_cases else {"status": "no GEMM cases", "cases": {}})

  import jax  # noqa: E402 - only now: the subprocess above had the devices to itself
  if args.smoke:  # threefry takes ~2.5 s to compile per shape on the CPU backend; rbg ~0.6 s
    jax.config.update("jax_default_prng_impl", "rbg")
  results = header(args, seed)
  results["links"] = dict((previous or {}).get("links", {}))
  results["machines"] = dict((previous or {}).get("machines", {}))
  results["windowed_subprocess"] = windowed
  results["sweep_stops"] = []
  # Cases of the resumed file that this command's plan does not cover (another --suite, other sizes)
  # stay in the file, ahead of this command's cases.
  planned = {(f.family, None if sizes is None else tuple(sizes)) for fams, sizes in sweeps for f in fams}
  plan_sizes = dict(planned)
  foreign = [c for c in (previous or {}).get("cases", []) if c.get("family") not in plan_sizes
             or (plan_sizes[c["family"]] is not None and c.get("size") not in plan_sizes[c["family"]])]
  visited = []
  results["cases"] = foreign
  print(f"devices: {results['n_devices']} x {results['device']} ({results['platform']}), jax "
        f"{results['jax_version']}, seed {seed}, budget {args.time_budget:.0f} s", flush=True)
  env = Env(args, results, deadline, windowed)

  out_of_time = None
  for families, sizes in sweeps:
    state = {f.family: Sweep() for f in families}
    start_size = 4096 if families and families[0].suite == "attention" else 256
    for size in sizes_of(sizes, start_size):
      active = [f for f in families if state[f.family].stopped is None]
      if not active:
        break
      for fam in active:
        case, sweep = suites.with_size(fam, size), state[fam.family]
        if case.name in done:
          rec = done[case.name]
          print(f"\n== {case.name}: kept from {args.out}", flush=True)
          if rec.get("tuner", {}).get("winner_trace") and not rec["tuner"].get("replayed"):
            env.winners[case.family] = (case.size, rec["tuner"]["winner"], rec["tuner"]["winner_trace"])
        elif (expected := expected_seconds(case, visited)) > deadline - time.time():
          out_of_time = out_of_time or case.name
          print(f"\n== {case.name}: not started, expected to take {expected:.0f} s with "
                f"{max(deadline - time.time(), 0):.0f} s of the budget left (--resume runs it)", flush=True)
          rec = {"name": case.name, "suite": case.suite, "family": case.family, "size": case.size,
                 "config": dataclasses.asdict(case), "status": "skipped", "skipped": report.OUT_OF_TIME,
                 "out_of_time": True}
        else:
          rec = run_case(env, case, sweep)
          if not report.finished(rec):  # the budget ran out inside it
            out_of_time = out_of_time or case.name
        visited.append(rec)
        results["cases"] = foreign + visited
        sweep.update(case, rec)
        if sweep.stopped:
          results["sweep_stops"].append({"family": fam.family, "reason": sweep.stopped})
          print(f"  sweep {fam.family} stops: {sweep.stopped}", flush=True)
        write_json(args.out, results)
      if out_of_time and sizes is None:
        break
  if out_of_time:
    results["unfinished"] = f"time budget spent before {out_of_time} finished; run again with --resume"
  results["wall_s"] = round(time.time() - start, 1)
  if not args.no_plots:
    results["plots"] = report.plots(results, args.plots)
  write_json(args.out, results)
  print("\n" + report.markdown(results), flush=True)
  bad = report.problems(results, strict=args.smoke)
  if bad:
    print("\n!!! PROBLEMS:\n  " + "\n  ".join(bad), flush=True)
  print(f"\nwrote {args.out} ({results['wall_s']} s)", flush=True)
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
