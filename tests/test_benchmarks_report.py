"""The benchmarks' parts that need no suite run: the harness, the runner's budget and resume, the plans, README's
generated results table and the results files it and the docs cite, and the baselines' GPU paths (lowered for CUDA
without a GPU)."""

import dataclasses
import json
import os
import pathlib
import time
import types

import jax
import jax.numpy as jnp
import pytest
from test_code_rules import _function_imports

from benchmarks import cases, harness, readme, run

ROOT = pathlib.Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------ the harness


def test_harness_runs_fill_the_minimum_and_stop_at_the_maximum():
  """``iters`` runs; more for a fast contestant, as many as fill ``min_timing_s``; fewer for a slow one, as many as
  fit ``max_timing_s``; never under 3."""
  s = harness.Settings(iters=20, max_timing_s=10.0, min_timing_s=0.5)
  assert s.runs(0.1) == 20  # 2 s: iters
  assert s.runs(0.004) == 125  # 20 runs would be 80 ms: 0.5 s of runs
  assert s.runs(2.0) == 5 and s.runs(20.0) == 3
  assert harness.Settings(iters=20, min_timing_s=0.0).runs(1e-4) == 20


def test_harness_checks_times_and_ranks():
  """The reference is checked against and not timed; a wrong output is flagged and keeps its time; an error and a
  skip are recorded; past the deadline nothing starts; ranks follow the medians."""
  x = jax.random.normal(jax.random.key(int(time.time_ns() % 2**31)), (64, 64), jnp.float32)
  square = lambda: jax.jit(lambda a: a @ a)
  C = harness.Contestant
  contestants = [C("ref", "reference", square), C("base", "baseline", square),
                 C("mine", "jaxmercury", lambda: jax.jit(lambda a: 1.1 * (a @ a))),
                 C("boom", "baseline", lambda: jax.jit(lambda a: a[:3] @ a)), C("off", "baseline", square, skip="no")]
  records, ref = harness.run_contestants(contestants, [x], harness.Settings(iters=3, warmup=1, max_timing_s=1.0))
  recs = {r["name"]: r for r in records}
  assert ref == "ref" and list(recs) == ["ref", "base", "mine", "boom", "off"]
  assert "median_ms" not in recs["ref"] and recs["ref"]["rel_err"] == 0.0
  assert recs["base"]["numerics_ok"] and recs["base"]["rel_err"] < 1e-6 and len(recs["base"]["times_ms"]) == 3
  assert recs["mine"]["numerics_ok"] is False and recs["mine"]["rel_err"] == pytest.approx(0.1, rel=1e-3)
  assert "median_ms" in recs["mine"] and "differ from the reference" in recs["boom"]["error"]
  assert recs["off"]["skipped"] == "no"
  case = harness.finish({"name": "c"}, records, ref, floor_ms=0.5 * recs["base"]["median_ms"], flops_per_device=1e6)
  assert case["status"] == "ok" and case["agree"] is False and case["best_baseline"] == "base"
  assert recs["base"]["ratio_to_best_baseline"] == 1.0 and recs["base"]["floor_fraction"] == 0.5
  assert recs["mine"]["tflops_per_device"] == pytest.approx(1e6 / recs["mine"]["median_ms"] / 1e9)
  assert readme.problems({"cases": [case]}) == ["c: mine DISAGREES (rel err 1.00e-01)"]
  late, ref = harness.run_contestants(contestants[:2], [x], harness.Settings(deadline=0.0))
  assert ref is None and all(r["skipped"] == harness.OUT_OF_TIME and r["out_of_time"] for r in late)
  case = harness.finish({"name": "late"}, late, ref)
  assert case["status"] == "skipped" and not harness.finished(case)


# ------------------------------------------------------------------ the runner: budget and resume


@dataclasses.dataclass(frozen=True)
class _Case:
  name: str
  flops: float
  op: str = "attention"


def _suite(calls: list, behaviour: dict):
  """A suite whose cases answer from ``behaviour`` (name -> "ok", "slow", "boom" or "two records")."""
  def run_case(env, case):
    calls.append(case.name)
    kind = behaviour.get(case.name, "ok")
    if kind == "boom":
      raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 9 GiB")
    if kind == "slow":
      time.sleep(0.3)
    rec = lambda name: harness.finish({"name": name}, [{"name": "b", "role": "baseline", "median_ms": 1.0}], "b")
    return [rec(case.name + " forward"), rec(case.name + " training")] if kind == "two records" else rec(case.name)

  plan = [_Case("small", 1.0), _Case("large", 1e4), _Case("pair", 1.0, op="llama")]
  return types.SimpleNamespace(Env=lambda args, results, deadline: types.SimpleNamespace(), plan=lambda args: plan,
                               run_case=run_case)


def _runs(out, budget, calls, behaviour, *extra):
  argv = ["--suite", "attention", "--out", str(out), "--time_budget", str(budget), "--seed", "3", *extra]
  args = run.parse_args(argv)
  previous = json.loads(out.read_text()) if "--resume" in extra else {}
  code = run.run(_suite(calls, behaviour), args, argv, previous, time.time(), {})
  return code, json.loads(out.read_text())


def test_the_budget_leaves_cases_for_resume_which_keeps_the_finished(tmp_path):
  """A case expected to outlast the budget (the last case of its operator, scaled by the work) is not started;
  --resume keeps what finished (and a case of another plan) and runs the rest; an error is rerun too."""
  out, calls = tmp_path / "r.json", []
  code, results = _runs(out, 5, calls, {"small": "slow", "pair": "two records"})
  assert code == 0 and calls == ["small", "pair"]  # large: 0.3 s x sqrt(1e4) = 30 s > 5 s
  assert [(c["name"], c["status"]) for c in results["cases"]] == [
      ("small", "ok"), ("large", "skipped"), ("pair forward", "ok"), ("pair training", "ok")]
  assert results["cases"][1]["out_of_time"] and "--resume" in results["unfinished"]
  assert {c["spec"] for c in results["cases"][2:]} == {"pair"} and results["cases"][0]["wall_s"] >= 0.3
  results["cases"].append({"name": "foreign", "status": "ok", "contestants": []})
  out.write_text(json.dumps(results))
  calls.clear()
  code, again = _runs(out, 600, calls, {"large": "boom"}, "--resume")
  assert calls == ["large"] and code == 0  # only what the budget left out
  assert [c["name"] for c in again["cases"]] == ["foreign", "small", "large", "pair forward", "pair training"]
  assert again["cases"][2]["status"] == "error" and again["cases"][2]["error"].startswith("out of memory")
  assert again["seed"] == 3 and "large" in again["unfinished"]
  calls.clear()
  code, third = _runs(out, 600, calls, {}, "--resume")
  assert calls == ["large"] and "unfinished" not in third and third["cases"][0]["name"] == "foreign"


def test_plans_follow_the_flags_and_the_mercury_evaluation():
  args = run.parse_args(["--suite", "attention", "--out", "x.json"])
  plan = cases.plan(cases.options(args))
  assert len(plan) == 9 * 8 and plan[0].seq == 4096 and plan[-1].seq == 1 << 20  # MHA/GQA x B1/B16 x causal
  assert {(c.heads, c.kv_heads, c.head_dim) for c in plan} == {(32, 32, 128), (32, 8, 128)}
  assert len({c.name for c in plan}) == len(plan) and args.iters == 20 and args.db == "x.tuning.db"
  gemm = cases.plan(cases.options(run.parse_args(["--suite", "gemm", "--gemm_m", "8K", "--models", "70B"])))
  assert [(c.layer, c.kind, c.k, c.n) for c in gemm] == [
      ("70B.qkv", "allgather", 8192, 10240), ("70B.gate_up", "allgather", 8192, 57344),
      ("70B.o", "reducescatter", 8192, 8192), ("70B.down", "reducescatter", 28672, 8192)]
  picked = run.parse_args(["--suite", "training", "--ops", "attention", "--seqs", "8K", "--mesh", "1x2",
                           "--causal", "no"])
  (case,) = cases.plan(cases.options(picked))
  assert case.name == "attention GQA B1 S8K H32 KV8 D128 mesh 1x2" and case.family == \
      "attention GQA B1 H32 KV8 D128 mesh 1x2"
  assert cases.case_from_dict(dataclasses.asdict(case)) == case
  assert [cases.parse_size(s) for s in ("4K", "1m", "300")] == [4096, 1 << 20, 300]
  assert [cases.size_label(s) for s in (200, 4096, 1 << 20)] == ["200", "4K", "1M"]
  smoke = run.parse_args(["--suite", "kernels", "--smoke"])
  assert smoke.iters == 3 and smoke.out.endswith("jaxmercury-smoke-kernels.json")


# ------------------------------------------------------------------ the results files and README's table


def test_the_readme_table_is_what_the_files_give_and_shows_no_stale_file():
  """Regenerate with ``python -m benchmarks.run readme`` after adding or changing a results file; a stale file's
  row goes (with its file) or names a newer file of its kind."""
  text = (ROOT / "README.md").read_text()
  assert readme.BEGIN in text and readme.END in text, "README.md lost the results table's markers"
  assert text.split(readme.BEGIN)[1].split(readme.END)[0].strip() == readme.readme_table()
  assert readme.main(["readme", "--check"]) == 0
  rows = [readme.summarize(str(ROOT / "benchmarks" / "results" / name)) for _, name in readme.HEADLINES]
  assert all(r.headline for r in rows)
  assert not [r.file for r in rows if r.stale], "stale rows in README.md's results table"


def test_every_results_file_is_cited_by_the_readme_or_the_docs():
  """``benchmarks/results/`` keeps the files README.md or a page of ``docs/`` cites, and nothing else (git keeps
  the superseded ones)."""
  texts = [(ROOT / "README.md").read_text()] + [p.read_text() for p in (ROOT / "docs").glob("*.md")]
  uncited = [p.name for p in sorted((ROOT / "benchmarks" / "results").iterdir())
             if not any(p.name in text for text in texts)]
  assert not uncited, f"results files no page cites (delete them, or cite them): {uncited}"


def _suite_file(path, **extra):
  def contestants(ratio, floor):
    return [{"name": "b", "role": "baseline", "median_ms": 2.0, "ratio_to_best_baseline": 1.0},
            {"name": "j1", "role": "jaxmercury", "ratio_to_best_baseline": ratio, "floor_fraction": floor},
            {"name": "j2", "role": "jaxmercury", "ratio_to_best_baseline": ratio / 2, "floor_fraction": 0.01},
            {"name": "bad", "role": "jaxmercury", "ratio_to_best_baseline": 9.0, "numerics_ok": False}]
  data = {"schema": harness.SCHEMA, "suite": "gemm", "date": "2031-01-02T03:04:05+00:00", "device": "TPU v9",
          "n_devices": 4, "commit": "abc123", "command": "python -m benchmarks.run --suite gemm | x",
          "cases": [{"name": "a", "config": {"kind": "allgather"}, "contestants": contestants(1.25, 0.5)},
                    {"name": "b", "config": {"kind": "allgather"}, "contestants": contestants(0.8, 0.25)},
                    {"name": "c", "config": {"kind": "reducescatter"}, "contestants": contestants(1.0, None)},
                    {"name": "d", "group": "training", "contestants": [{"name": "x", "role": "baseline"}]}], **extra}
  path.write_text(json.dumps(data))
  return str(path)


def test_headlines_come_from_the_records_and_stale_files_say_so(tmp_path):
  row = readme.summarize(_suite_file(tmp_path / "s.json"))
  assert (row.date, row.suite, row.device, row.commit) == ("2031-01-02", "gemm", "4 x TPU v9", "abc123")
  assert row.headline == ("AG: 0.80-1.25x of the best baseline (2 cases), 25-50% of the floor; "
                          "RS: 1.00x of the best baseline (1 case)")  # the best agreeing contestant per case
  assert readme.summarize(_suite_file(tmp_path / "s.json"), versus="").headline == (
      "AG: 0.80-1.25x (2 cases), 25-50% of the floor; RS: 1.00x (1 case)")
  assert row.stale is None
  stale = readme.summarize(_suite_file(tmp_path / "t.json", predates={"commit": "def456", "change": "a new ring"}))
  assert stale.stale == "measured before def456: a new ring"
  one = _suite_file(tmp_path / "one.json", cases=[{"name": "a", "op": "attention", "contestants": [
      {"name": "j", "role": "jaxmercury", "ratio_to_best_baseline": 1.5}]}])
  assert readme.summarize(one).headline == "1.50x of the best baseline (1 case)"  # one group: unnamed
  (tmp_path / "2031-01-01-u.json").write_text(json.dumps({"rates": {"k": 1.0}}))
  bare = readme.summarize(str(tmp_path / "2031-01-01-u.json"))
  assert bare.headline is None and bare.suite == "" and bare.commit is None  # listed without a headline
  assert bare.date == "2031-01-01"  # the file's name gives the date its JSON lacks
  cli = {"device_kind": "NVIDIA H100 80GB HBM3", "mesh": {"node": 2, "gpu": 4}, "objective": "training",
         "winner": {"name": "ring", "time_ms": 1.23456}}
  (tmp_path / "c.json").write_text(json.dumps(cli))
  tuned = readme.summarize(str(tmp_path / "c.json"))
  assert (tuned.suite, tuned.device, tuned.headline) == ("jaxmercury.tune", "8 x H100",
                                                         "winner ring: 1.235 ms (training)")


def test_report_tables_name_every_case_and_contestant():
  with open(ROOT / "benchmarks" / "results" / "2026-11-28-fused_attention_noncausal-05912d4-2xH200.json") as f:
    results = json.load(f)
  text = readme.report(results)
  for case in results["cases"]:
    assert f"| {case['name']} |" in text
    for r in case["contestants"]:
      assert f"| {case['name']} | {r['name']} |" in text
  assert "commit 05912d4" in text and readme.problems(results) == []


# ------------------------------------------------------------------ code


def test_benchmark_imports_inside_functions_say_why():
  silent = [f"{path.relative_to(ROOT)}:{n}: {text}" for path in sorted((ROOT / "benchmarks").rglob("*.py"))
            for n, text, said in _function_imports(path) if not said]
  assert not silent, "imports inside functions without a comment saying why:\n" + "\n".join(silent)


def test_cudnn_baselines_lower_for_gpus(monkeypatch):
  """The cuDNN paths of the attention baselines trace and lower for CUDA (no GPU needed): JAX refuses cuDNN
  attention without a GPU before tracing, so its version and compute-capability checks are stubbed here."""
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
      lowered = build(mesh, levels, causal=causal, impl="cudnn").trace(q, kv, kv).lower(lowering_platforms=("cuda",))
      assert "__cudnn$fmha" in lowered.as_text()
    for build in (attn.ulysses, attn.usp):
      text = build(mesh, levels, causal=causal, impl="cudnn", heads=8, kv_heads=2).trace(q, kv, kv).lower(
          lowering_platforms=("cuda",)).as_text()
      assert "__cudnn$fmha" in text and "all_to_all" in text
  assert os.environ["JAX_PLATFORMS"] == "cpu"
