"""The benchmark suite (``benchmarks.run``): smoke runs on the simulated CPU mesh, the results, the report.

The smoke run is one test (pytest-xdist would otherwise run a shared fixture
once per worker): it runs every suite in a subprocess, as a user would, and
checks the JSON, the agreement of every contestant, the tables and the plots.
"""

import dataclasses
import json
import os
import subprocess
import sys
import time

import pytest

from benchmarks import report, run, suites

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOLERANCE = 2e-2

CASE_KEYS = {"name", "suite", "family", "size", "config", "status", "mesh", "flops_per_device", "tuner",
             "floor", "reference", "best_baseline", "best_baseline_ms", "contestants", "agree", "wall_s"}
TOP_KEYS = {"schema", "date", "device", "platform", "n_devices", "jax_version", "jaxlib_version",
            "jaxmercury_version", "python", "command", "smoke", "seed", "settings", "links", "machines",
            "windowed_subprocess", "cases", "sweep_stops", "wall_s", "floor_definition"}


def _run(args, timeout=600):
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
  t0 = time.perf_counter()
  proc = subprocess.run([sys.executable, "-m", "benchmarks.run", *args], capture_output=True, text=True,
                        env=env, cwd=ROOT, timeout=timeout)
  return proc, time.perf_counter() - t0


def _by_name(case):
  return {c["name"]: c for c in case["contestants"]}


def _check_case(case, timed, skipped):
  assert set(case) >= CASE_KEYS, sorted(CASE_KEYS - set(case))
  assert case["status"] == "ok" and case["agree"] is True
  recs = _by_name(case)
  assert set(recs) == set(timed) | set(skipped)
  for name in timed:
    rec = recs[name]
    assert "error" not in rec and "skipped" not in rec, rec
    assert rec["median_ms"] > 0 and rec["min_ms"] <= rec["median_ms"]
    assert len(rec["times_ms"]) >= 3
    assert rec["numerics_ok"] is True and 0 <= rec["rel_err"] < TOLERANCE, rec
    assert rec["ratio_to_best_baseline"] > 0 and rec["floor_fraction"] > 0
  for name, words in skipped.items():
    assert words in recs[name]["skipped"], recs[name]
  best = recs[case["best_baseline"]]
  assert best["role"] == "baseline" and best["ratio_to_best_baseline"] == pytest.approx(1.0)
  assert case["best_baseline_ms"] == min(recs[n]["median_ms"] for n in timed if recs[n]["role"] == "baseline")
  jm = recs["jaxmercury"]
  assert jm["ratio_to_best_baseline"] == pytest.approx(case["best_baseline_ms"] / jm["median_ms"])
  assert jm["schedule"] == case["tuner"]["winner"]
  assert case["reference_vs_program"] < TOLERANCE  # the reference agrees with the program's own
  floor = case["floor"]
  assert floor["compute_ms"] > 0 and floor["comm_ms"] > 0 and floor["comm_bytes_per_device"] > 0
  assert floor["floor_ms"] == max(floor["compute_ms"], floor["comm_ms"])
  assert jm["floor_fraction"] == pytest.approx(floor["floor_ms"] / jm["median_ms"])
  tuner = case["tuner"]
  if "replayed" in tuner:
    assert "not_tuned" in tuner and "candidates" not in tuner
  else:
    assert tuner["candidates"] and tuner["wall_s"] > 0
    assert {c["status"] for c in tuner["candidates"]} <= {"ok", "pruned", "failed"}


def test_smoke_suite(tmp_path):
  """Every suite on the simulated mesh: all contestants run, agree, and land in the JSON, tables and plots.

  ``--tune_max_tflop`` is set so that the second size of the first sweep replays the first size's winner.
  """
  out = tmp_path / "smoke.json"
  proc, wall = _run(["--smoke", "--suite", "all", "--out", str(out), "--tune_max_tflop", "1e-6"])
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
  results = json.loads(out.read_text())
  assert set(results) >= TOP_KEYS, sorted(TOP_KEYS - set(results))
  assert results["schema"] == run.SCHEMA and results["smoke"] is True
  assert results["platform"] == "cpu" and results["n_devices"] == 8
  assert set(results["links"]) == {"8", "2x4"} and all(v["bytes_per_s"] > 0 for v in results["links"].values())
  assert not results["sweep_stops"] and "unfinished" not in results

  cases = {c["name"]: c for c in results["cases"]}
  mha = ["attention MHA B1 S64 H8 KV8 D16 mesh 8", "attention MHA B1 S128 H8 KV8 D16 mesh 8"]
  gqa = "attention GQA B2 S128 H8 KV2 D16 causal mesh 2x4"
  ag, rs = "gemm AG tiny.up M256 K256 N512 mesh 8", "gemm RS tiny.down M256 K512 N256 mesh 8"
  assert list(cases) == mha + [gqa, ag, rs]  # the first sweep grew from 64 to 128
  for name in mha:
    _check_case(cases[name], ["jaxmercury", "cp_allgather", "ring", "ulysses"], {"usp": "two-level"})
    assert cases[name]["mesh"] == {"gpu": 8}
  first_winner = cases[mha[0]]["tuner"]["winner"]
  assert cases[mha[1]]["tuner"]["replayed"] == f"{first_winner}, the winner at size 64"
  assert "above --tune_max_tflop" in cases[mha[1]]["tuner"]["not_tuned"]
  _check_case(cases[gqa], ["jaxmercury", "cp_allgather", "ring", "ulysses", "usp"], {})
  assert cases[gqa]["mesh"] == {"node": 2, "gpu": 4} and cases[gqa]["fig13"] is True
  _check_case(cases[ag], ["jaxmercury", "allgather_dot", "xla_auto", "xla_auto_windowed"],
              {"pallas_mgpu": "Hopper"})
  _check_case(cases[rs], ["jaxmercury", "dot_psum_scatter", "xla_auto", "xla_auto_windowed"], {})
  for name in (ag, rs):  # the subprocess had this process's inputs and agrees with this process's reference
    windowed = _by_name(cases[name])["xla_auto_windowed"]
    assert windowed["process"] == "separate" and "main process" in windowed["agreement_checked_against"]
    assert windowed["inputs_match"] is True and windowed["rel_err_vs_main"] < TOLERANCE, windowed
    assert "output_sketch" in results["windowed_subprocess"]["cases"][name]
  assert results["windowed_subprocess"]["status"] == "exit 0"
  assert "--xla_gpu_threshold_for_windowed_einsum_mib=0" in results["windowed_subprocess"]["flags"]

  # the tables: one summary row per case, one detail row per contestant, nothing flagged
  text = report.markdown(results)
  assert results["device"] in text and results["jax_version"] in text and "simulated CPU" in text
  for name in cases:
    assert f"| {name} |" in text
  detail = [ln for ln in report.detail_table(results).splitlines()[2:]]
  assert len(detail) == sum(len(c["contestants"]) for c in results["cases"])
  assert report.problems(results, strict=True) == []
  assert "| usp |" in text and "skipped: USP needs a two-level mesh" in text
  assert report.markdown(results) in proc.stdout  # the run printed the same tables

  # the plots: speedups, the Fig. 13 overlay, and the tuner's own scatter
  names = {os.path.basename(p) for p in results["plots"]}
  assert {"speedup-attention.png", "speedup-gemm.png",
          "fig13-attention-gqa-b2-s128-h8-kv2-d16-causal-mesh-2x4.png"} <= names
  assert all(os.path.getsize(p) > 10_000 for p in results["plots"])
  assert os.path.getsize(cases[gqa]["fig13_plot"]) > 10_000
  print(f"smoke suite: {wall:.1f} s")


def _fake_case(case, contestants, status="ok"):
  return {"name": case.name, "suite": case.suite, "family": case.family, "size": case.size,
          "config": dataclasses.asdict(case), "status": status, "contestants": contestants, "floor": {},
          "tuner": {}}


def test_resume_keeps_finished_cases_and_the_budget_skips_the_rest(tmp_path):
  """--resume keeps what a results file holds; a spent --time_budget skips (and names) the rest."""
  first = suites.with_size(suites.smoke_sweeps("attention")[0][0][0], 64)
  kept = _fake_case(first, [{"name": "jaxmercury", "role": "jaxmercury", "median_ms": 1.0},
                            {"name": "ring", "role": "baseline", "median_ms": 2.0}])
  gemm = suites.smoke_sweeps("gemm")[0][0][0]
  other = _fake_case(suites.with_size(gemm, 256), [{"name": "xla_auto", "role": "baseline", "median_ms": 1.0}])
  out = tmp_path / "partial.json"
  out.write_text(json.dumps({"schema": run.SCHEMA, "seed": 1234, "cases": [other, kept]}))
  proc, _ = _run(["--smoke", "--suite", "attention", "--resume", "--time_budget", "0", "--no_plots",
                  "--out", str(out)], timeout=300)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  results = json.loads(out.read_text())
  assert results["seed"] == 1234  # inputs as in the run being resumed
  statuses = [(c["name"], c["status"]) for c in results["cases"]]
  assert statuses == [(other["name"], "ok"), (first.name, "ok"), ("attention MHA B1 S128 H8 KV8 D16 mesh 8", "skipped"),
                      ("attention GQA B2 S128 H8 KV2 D16 causal mesh 2x4", "skipped")]
  assert results["cases"][:2] == [other, kept]  # another suite's case stays; this suite's is kept
  assert all(c["skipped"] == "time budget spent" for c in results["cases"][2:])
  assert "--resume" in results["unfinished"]
  assert "kept from" in proc.stdout


# ------------------------------------------------------ no JAX below here


def test_sweep_skips_failed_contestants_and_stops_when_all_fail():
  case = suites.AttentionCase(1, 32, 8, 128, 4096, False, "")
  sweep = run.Sweep()
  sweep.update(case, {"status": "ok", "contestants": [
      {"name": "ring", "median_ms": 3.0}, {"name": "ulysses", "error": "out of memory: XlaRuntimeError: ..."}]})
  assert set(sweep.failed) == {"ulysses"} and "size 4K" in sweep.failed["ulysses"] and sweep.stopped is None
  sweep.update(suites.with_size(case, 8192), {"status": "failed", "contestants": [
      {"name": "ring", "error": "out of memory: ..."}, {"name": "ulysses", "skipped": sweep.failed["ulysses"]}]})
  assert set(sweep.failed) == {"ulysses", "ring"} and "size 4K" in sweep.failed["ulysses"]
  assert sweep.stopped == "every contestant failed at size 8K"


def test_gpu_plan_follows_the_mercury_evaluation():
  args = run.parse_args(["--out", "/tmp/x.json"])
  (families, seqs), (gemms, ms) = run.plan(args)
  assert seqs == [4096 << i for i in range(9)] and seqs[-1] == 1 << 20
  assert len(families) == 8  # MHA/GQA x batch 1/16 x causal or not
  assert {(f.heads, f.kv_heads, f.head_dim) for f in families} == {(32, 32, 128), (32, 8, 128)}
  assert {f.batch for f in families} == {1, 16} and {f.causal for f in families} == {False, True}
  assert ms == [4096, 8192, 16384, 32768]
  shapes = {(g.layer, g.kind, g.k, g.n) for g in gemms}
  assert ("8B.qkv", "allgather", 4096, 6144) in shapes and ("70B.down", "reducescatter", 28672, 8192) in shapes
  assert len(gemms) == 8
  names = [suites.with_size(f, s).name for f in families for s in seqs] + \
          [suites.with_size(g, m).name for g in gemms for m in ms]
  assert len(names) == len(set(names))
  assert args.fig13 in names
  assert args.iters == 20 and args.time_budget == 540 and args.db.endswith(".tuning.db")
  unbounded = run.parse_args(["--out", "x.json", "--seq_max", "none", "--suite", "attention"])
  assert run.plan(unbounded)[0][1] is None
  assert list(run.sizes_of(None, 4096))[:3] == [4096, 8192, 16384]
  picked = run.parse_args(["--out", "x.json", "--seqs", "8K", "1M", "--causal", "no", "--variants", "GQA",
                           "--batches", "1", "--suite", "attention", "--mesh", "1x2"])
  ((fam,), seqs), = run.plan(picked)
  assert seqs == [8192, 1 << 20] and fam.variant == "GQA" and not fam.causal and fam.mesh == "1x2"
  assert suites.with_size(fam, 8192).name == "attention GQA B1 S8K H32 KV8 D128 mesh 1x2"


def test_sizes_and_labels():
  assert suites.parse_size("4K") == 4096 and suites.parse_size("1m") == 1 << 20 and suites.parse_size("300") == 300
  with pytest.raises(ValueError):
    suites.parse_size("4 GB")
  assert [suites.seq_label(s) for s in (200, 4096, 1 << 20, 3 << 20)] == ["200", "4K", "1M", "3M"]


def _synthetic():
  def rec(name, role, ms, **kw):
    return {"name": name, "role": role, "median_ms": ms, "min_ms": ms, "numerics_ok": True, "rel_err": 1e-3, **kw}
  ok_case = {"name": "attention MHA B1 S4K H32 KV32 D128", "suite": "attention", "family": "f", "size": 4096,
             "status": "ok", "agree": True, "best_baseline": "ring", "best_baseline_ms": 2.0,
             "floor": {"compute_ms": 1.0, "comm_ms": 0.5, "floor_ms": 1.0, "bound": "compute",
                       "comm_bytes_per_device": 1e6, "compute_how": "x", "comm_how": "y"},
             "contestants": [rec("jaxmercury", "jaxmercury", 1.6, schedule="ring [cudnn_attention]",
                                 ratio_to_best_baseline=1.25, floor_fraction=0.625),
                             rec("ring", "baseline", 2.0, ratio_to_best_baseline=1.0),
                             {"name": "ulysses", "role": "baseline", "error": "out of memory: boom\nmore"},
                             {"name": "usp", "role": "baseline", "skipped": "USP needs a two-level mesh"},
                             rec("cp_allgather", "baseline", 9.0, numerics_ok=False, rel_err=0.3)]}
  bad_case = {"name": "gemm AG 8B.qkv M4096 K4096 N6144", "suite": "gemm", "status": "error",
              "error": "ValueError: x", "contestants": []}
  skipped = {"name": "gemm AG 8B.qkv M8192 K4096 N6144", "suite": "gemm", "status": "skipped",
             "skipped": "time budget spent", "contestants": []}
  return {"date": "2026-01-01T00:00:00+00:00", "device": "NVIDIA H200", "platform": "gpu", "n_devices": 2,
          "jax_version": "0.11.2", "jaxlib_version": "0.11.2", "jaxmercury_version": "0.1.0", "python": "3.12.1",
          "command": "python -m benchmarks.run", "seed": 7, "smoke": False,
          "links": {"2": {"bytes_per_s": 3e11, "bytes_per_device": 1 << 30, "ms": 3.5}},
          "cases": [ok_case, bad_case, skipped],
          "sweep_stops": [{"family": "f", "reason": "every contestant failed at size 1M"}],
          "unfinished": "time budget spent before gemm AG 8B.qkv M8192 K4096 N6144; run again with --resume"}


def test_markdown_tables_and_problems():
  results = _synthetic()
  text = report.markdown(results)
  assert "2 x NVIDIA H200 (gpu), jax 0.11.2" in text and "simulated" not in text
  row = next(ln for ln in text.splitlines() if ln.startswith("| attention MHA B1 S4K H32 KV32 D128 | ring |"))
  assert "| ring [cudnn_attention] | 1.600 | 1.25x | 1.000 (compute) | 62% | yes |" in row
  assert "| gemm AG 8B.qkv M4096 K4096 N6144 |" in text and "ERROR: ValueError: x" in text
  assert "M8192" not in report.summary_table(results)  # skipped cases are listed in the notes only
  assert "ERROR: out of memory: boom |" in text  # the first line of the error
  assert "skipped: USP needs a two-level mesh" in text and "DISAGREES (rel err 3.00e-01)" in text
  assert "link over mesh 2: 300.0 GB/s" in text and "every contestant failed at size 1M" in text
  assert "not run (time budget): 1 cases" in text and "--resume" in text
  assert report.problems(results) == ["attention MHA B1 S4K H32 KV32 D128: cp_allgather disagrees "
                                      "(DISAGREES (rel err 3.00e-01))"]
  strict = report.problems(results, strict=True)
  assert any("ulysses" in p for p in strict) and any("case error" in p for p in strict)


def test_report_cli_and_plots(tmp_path):
  path = tmp_path / "r.json"
  results = _synthetic()
  results["cases"][0]["fig13"] = True
  results["cases"][0]["tuner"] = {"candidates": [
      {"name": "ring", "status": "ok", "time_ms": 1.6, "predicted_ms": 1.5, "memory_bytes": 3 << 20,
       "compiled_bytes": 4 << 20},
      {"name": "par(i0,gpu) tile(j,2)", "status": "pruned", "time_ms": None, "predicted_ms": 2.5,
       "memory_bytes": 2 << 20, "compiled_bytes": None}]}
  for c in results["cases"][0]["contestants"]:
    c["memory_bytes"] = 5 << 20
  path.write_text(json.dumps(results))
  md = tmp_path / "r.md"
  assert report.main([str(path), "--md", str(md), "--plots", str(tmp_path / "plots")]) == 0
  assert md.read_text().strip() == report.markdown(results)
  files = sorted(os.listdir(tmp_path / "plots"))
  assert files == ["fig13-attention-mha-b1-s4k-h32-kv32-d128.png", "speedup-attention.png"]


def test_a_failed_tuner_replays_the_sweeps_last_winner():
  """The tuner failing (here: out of memory before it starts) falls back to the winner at a smaller size."""
  import types

  import jax
  import jax.numpy as jnp
  import numpy as np
  from conftest import make_mesh
  from jax.sharding import PartitionSpec as P

  import jaxmercury as jm
  from benchmarks import cases
  from jaxmercury.tuner.autotuner import with_layouts

  mesh = make_mesh("8")
  seq = P(None, "x")
  small = jm.programs.attention(1, 8, 8, 64, 64, 16)
  trace = with_layouts(jm.library(small, mesh)["ring"], (seq,) * 3, seq).to_json()

  def oom(*args):
    raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 512.00GiB")

  args = types.SimpleNamespace(tune_max_tflop=200.0)
  env = types.SimpleNamespace(winners={"fam": (64, "ring", trace)}, machine=oom, args=args)
  prog = jm.programs.attention(1, 8, 8, 128, 128, 16)
  result, rec = cases.tune(env, prog, mesh, "fam", 128, (seq,) * 3, seq)
  assert rec["error"].startswith("out of memory") and rec["replayed"] == "ring, the winner at size 64"
  contestant = cases.jaxmercury_contestant(result, rec)
  assert contestant.record["schedule"] == rec["winner"] == "ring (winner at size 64, replayed)"
  q, k, v = prog.random_inputs(jax.random.key(3))
  out = contestant.build()(q, k, v)
  ref = prog.reference(q, k, v)
  assert float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref)) < 1e-4
  assert np.asarray(out).shape == (1, 128, 8, 16)
  assert cases.tune(types.SimpleNamespace(winners={}, machine=oom, args=args), prog, mesh, "other", 128,
                    (seq,) * 3, seq)[0] is None


def test_cudnn_baselines_lower_for_gpus(monkeypatch):
  """The cuDNN paths of the attention baselines trace and lower for CUDA (no GPU needed).

  JAX refuses cuDNN attention without a GPU before tracing, so its version and
  compute-capability checks are stubbed for this test only.
  """
  import jax
  import jax.numpy as jnp
  from conftest import make_mesh
  from jax._src.cudnn import fused_attention_stablehlo as cudnn
  from jax.sharding import NamedSharding

  from benchmarks.baselines import attention as attn

  monkeypatch.setattr(cudnn, "check_cudnn_version", lambda: 91000)
  monkeypatch.setattr(cudnn, "check_compute_capability", lambda capability: True)
  mesh = make_mesh("2x4")
  levels = tuple(mesh.axis_names)
  sharding = NamedSharding(mesh, attn.seq_spec(levels))
  q = jax.ShapeDtypeStruct((1, 1024, 8, 64), jnp.bfloat16, sharding=sharding)
  kv = jax.ShapeDtypeStruct((1, 1024, 2, 64), jnp.bfloat16, sharding=sharding)
  for causal in (False, True):
    for build in (attn.context_parallel, attn.ring):
      text = build(mesh, levels, causal=causal, impl="cudnn").trace(q, kv, kv).lower(
          lowering_platforms=("cuda",)).as_text()
      assert "__cudnn$fmha" in text
    for build in (attn.ulysses, attn.usp):
      text = build(mesh, levels, causal=causal, impl="cudnn", heads=8, kv_heads=2).trace(q, kv, kv).lower(
          lowering_platforms=("cuda",)).as_text()
      assert "__cudnn$fmha" in text and "all_to_all" in text


def test_harness_flags_disagreement_failures_and_the_deadline():
  """A wrong output is flagged (and keeps its time), an error is recorded, past the deadline nothing runs."""
  import jax
  import jax.numpy as jnp

  from benchmarks import harness

  x = jax.random.normal(jax.random.key(0), (64, 64), jnp.float32)
  good = lambda: jax.jit(lambda a: a @ a)
  contestants = [harness.Contestant("mine", "jaxmercury", lambda: jax.jit(lambda a: 1.1 * (a @ a))),
                 harness.Contestant("base", "baseline", good),
                 harness.Contestant("boom", "baseline", lambda: jax.jit(lambda a: a[:3] @ a)),
                 harness.Contestant("off", "baseline", good, skip="not here")]
  prep = harness.prepare(contestants, (x,), warmup=1, iters=3, max_timing_s=1.0, order=("base", "mine"))
  assert list(prep.records) == ["mine", "base", "boom", "off"] and prep.reference == "base"
  assert prep.records["mine"]["numerics_ok"] is False and prep.records["mine"]["rel_err"] == pytest.approx(0.1)
  assert "differs from the reference" in prep.records["boom"]["error"]
  assert prep.records["off"]["skipped"] == "not here"
  times = harness.time_interleaved(prep.ready, prep.records, (x,))
  harness.summarize(prep.records, times)
  records = list(prep.records.values())
  best = harness.rank(records, floor_ms=None, flops_per_device=2 * 64 ** 3)
  assert best["name"] == "base" and "median_ms" in prep.records["mine"]  # flagged, still timed
  late = harness.prepare(contestants[:2], (x,), warmup=1, iters=3, max_timing_s=1.0, deadline=0.0)
  assert all(r["skipped"] == "time budget spent" and r["out_of_time"] for r in late.records.values())
  assert not late.ready


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_local_kernels_smoke(tmp_path, direction):
  """Every attention kernel that runs on the CPU (interpret mode), and its backward, agrees with the reference."""
  extra = ["--backward"] if direction == "backward" else []
  cases = _smoke("local_kernels", tmp_path, "--causal", "yes", "--iters", "2", "--warmup", "1", *extra)
  assert [c["config"] for c in cases] == ["B1 S128 H4 KV4 D32 causal", "B1 S128 H4 KV2 D32 causal"]
  assert {c["pass"] for c in cases} == {"forward+backward" if extra else "forward"}
  for case in cases:
    kernels = {r["name"]: r for r in case["records"] if r["role"] == "jaxmercury"}
    assert {"xla", "pallas_attention"} <= set(kernels)
    for r in kernels.values():
      assert r["numerics_ok"] and r["rel_err"] < 2e-2 and r["median_ms"] > 0, r
    assert case["default"] in kernels


def _smoke(module, tmp_path, *extra):
  out = tmp_path / f"{module}.json"
  proc = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", "--smoke", "--out", str(out), *extra],
                        capture_output=True, text=True, timeout=900, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(out.read_text())["cases"]


def test_fused_gemm_smoke(tmp_path):
  """The unfused contestants run and agree on the CPU; the Hopper kernels are skipped with a reason."""
  (case,) = _smoke("fused_gemm", tmp_path)
  records = {r["name"]: r for r in case["records"]}
  assert records["xla_allgather_dot"]["median_ms"] > 0 and records["jm_async_tp"]["median_ms"] > 0
  assert records["jm_async_tp"]["numerics_ok"]
  fused = [r for name, r in records.items() if name.startswith(("fused[", "fused_ws[", "fused_comm["))]
  assert len(fused) == 11 and all("Hopper" in r["skipped"] for r in fused)
  (rs_case,) = json.loads((tmp_path / "fused_gemm.json").read_text())["reducescatter_cases"]
  records = {r["name"]: r for r in rs_case["records"]}
  assert records["xla_dot_psum_scatter"]["median_ms"] > 0 and records["jm_async_tp_rs"]["numerics_ok"]
  fused = [r for name, r in records.items() if name.startswith(("fused_rs[", "fused_rs_ws["))]
  assert len(fused) == 7 and all("Hopper" in r["skipped"] for r in fused)


@pytest.mark.parametrize("causal", [False, True], ids=["non-causal", "causal"])
def test_fused_attention_smoke(tmp_path, causal):
  """The unfused ring and all-gather contestants (and Ulysses, causal) run and agree on the CPU; the fused kernel
  is skipped."""
  (case,) = _smoke("fused_attention", tmp_path, *(["--causal"] if causal else []))
  assert case["causal"] == causal
  records = {r["name"]: r for r in case["records"]}
  for name in ("cp_allgather_xla", "ring_xla", "jm_ring") + (("ulysses_xla",) if causal else ()):
    assert records[name]["median_ms"] > 0 and records[name]["numerics_ok"], records[name]
  kernels = ("fused[", "fused_zigzag[", "fused_ws[", "fused_ws_zigzag[")
  fused = [r for name, r in records.items() if name.startswith(kernels)]
  assert len(fused) == (14 if causal else 7) and all("Hopper" in r["skipped"] for r in fused)


def test_fused_attention_training_smoke(tmp_path):
  """``--training``: the differentiable baselines' gradients agree on the CPU; the fused lowerings (and the
  previous backward, which is no baseline) are skipped."""
  (case,) = _smoke("fused_attention", tmp_path, "--causal", "--training", "--previous_backward")
  assert case["training"] and case["causal"]
  records = {r["name"]: r for r in case["records"]}
  for name in ("cp_allgather_xla", "ring_xla", "ulysses_xla", "jm_ring", "jm_ring_zigzag"):
    assert records[name]["median_ms"] > 0 and records[name]["numerics_ok"], records[name]
    assert records[name]["rel_err"] < 3e-2
  fused = ["fused_ws", "fused[64x64/2,2/SM]", "fused_ws_zigzag", "fused_zigzag[64x64/2,2/SM]",
           "fused_ws_previous_backward"]
  assert all("Hopper" in records[name]["skipped"] for name in fused)
  assert records["fused_ws_previous_backward"]["role"] == "previous"
  assert case["summary"]["best_baseline"] in ("cp_allgather_xla", "ring_xla", "ulysses_xla", "jm_ring",
                                              "jm_ring_zigzag")


def test_attention_backward_smoke(tmp_path):
  """The joint and apart backwards of one ring agree on 2 simulated CPU devices; the one-device fused call is
  skipped with its reason."""
  (case,) = _smoke("attention_backward", tmp_path, "--causal")
  records = {r["name"]: r for r in case["records"]}
  assert records["joint"]["median_ms"] > 0 and records["apart"]["numerics_ok"] and records["apart"]["rel_err"] < 1e-3
  assert "several devices" in records["local"]["skipped"]
  assert case["summary"]["apart_over_joint"] == records["apart"]["median_ms"] / records["joint"]["median_ms"]


def test_training_check_smoke(tmp_path):
  """Forward+backward contestants agree with the baseline; zigzag balances the causal ring's work."""
  (case,) = _smoke("training_check", tmp_path)
  names = [c["name"] for c in case["contestants"]]
  assert names[0].startswith("base:") and {"jm:ring[xla]", "jm:ring_zigzag[xla]"} <= set(names)
  for c in case["contestants"]:
    assert c["grad_rel_err"] < 2e-2 and c["forward_ms"] > 0 and c["forward_backward_ms"] > 0, c
  assert case["max_over_mean_work"]["ring"] > 1.4 and case["max_over_mean_work"]["ring_zigzag"] == 1.0


def test_llama_block_smoke(tmp_path):
  """The graph plans of a tiny block (both residual layouts) run, print their plans and agree with plain JAX."""
  (case,) = _smoke("llama_block", tmp_path, "--iters", "1", "--machines", "calibrated")
  assert set(case["plans"]) == {"jaxmercury_plan", "jaxmercury_plan_replicated", "jaxmercury_plan_training",
                                "jaxmercury_plan_replicated_training"}
  assert [p["training"] for p in case["plans"].values()] == [False, False, True, True]
  assert "training step" in case["plans"]["jaxmercury_plan_training"]["plan"]
  figures = case["machines"]  # measured on the simulated mesh before planning
  assert figures["matmul"]["kernel_flops_per_s"]["xla"] > 0 and figures["attention"]["kernel_flops_per_s"]["xla"] > 0
  assert 0 <= figures["matmul"]["overlap"] <= 1 and figures["matmul"]["link_bytes_per_s"]["x"] > 0
  for plan in case["plans"].values():
    assert "operators:" in plan["plan"] and "edges" in plan["plan"]
  timed = [c for c in case["contestants"] if "error" not in c]
  plans = [name for name, p in case["plans"].items() if p["same_as"] is None]  # a training plan equal to its
  assert [c["name"] for c in timed[:len(plans)]] == plans and len(timed) >= len(plans) + 1  # forward's: timed once
  for c in timed:
    assert c["out_rel_err"] < 5e-2 and c["grad_rel_err"] < 5e-2, c
  assert case["summary"]["forward_ms"]["jaxmercury"] > 0
  split = {r["operator"]: r for r in case["operator_split"]}
  assert {"wq", "wk", "wv", "attention", "wo", "w_gate", "w_up", "w_down"} <= set(split)
  for r in split.values():
    for side in ("jaxmercury", "xla"):
      assert r[f"{side}_forward_ms"] > 0 and r[f"{side}_forward_backward_ms"] > 0, r


def test_llama_predictions_reprice_the_recorded_gpu_runs(tmp_path):
  """The plans two 2 x H200 runs timed (4K and 32K tokens), rebuilt from their recorded choices and calibrated
  figures and priced by the current cost model: every recorded choice is still offered, and every prediction,
  forward and training step, lies within 15% of the measured time (at 32K the training step is 9-11% under)."""
  results = [f"benchmarks/results/2026-11-24-s11-llama_block-{seq}-2xH200.json" for seq in (4096, 32768)]
  out = tmp_path / "predictions.json"
  subprocess.run([sys.executable, "-m", "benchmarks.llama_predictions", *results, "--out", str(out)], check=True,
                 cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, timeout=600)
  rows = json.loads(out.read_text())["rows"]
  assert {(r["seq"], r["plan"]) for r in rows} == {(seq, plan) for seq in (4096, 32768) for plan in (
      "jaxmercury_plan", "jaxmercury_plan_replicated", "jaxmercury_plan_training",
      "jaxmercury_plan_replicated_training")}
  for r in rows:
    for kind in ("forward", "training"):
      ratio = r[f"{kind}_predicted_ms"] / r[f"{kind}_measured_ms"]
      assert 0.85 < ratio < 1.15, (r["seq"], r["plan"], kind, ratio)
