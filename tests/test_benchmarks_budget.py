"""``--time_budget`` in the benchmark suite: what the budget leaves out is no failure, and ``--resume`` runs it.

On 4 H200s a case whose contestants were all skipped because the budget ran
out was recorded as failed ("every contestant failed at size 32K"), stopped
its sweep and was kept, not re-run, by ``--resume``. Here the runner's loop
runs in this process with ``run_case`` replaced by records as
``cases._finish`` builds them, so nothing is compiled.
"""

import dataclasses
import json
import types

import pytest

from benchmarks import cases, report, run, suites

LATE = {"skipped": "time budget spent", "out_of_time": True}


def _contestants(kind: str, flag: bool = True) -> list[dict]:
  """``late``: every contestant skipped for time; ``partial``: ring skipped for time; ``ok``: all timed."""
  late = LATE if flag else {"skipped": "time budget spent"}
  timed = {"median_ms": 1.0, "min_ms": 1.0, "numerics_ok": True, "rel_err": 0.0}
  out = [{"name": "jaxmercury", "role": "jaxmercury", **(late if kind == "late" else timed)},
         {"name": "ring", "role": "baseline", **(timed if kind == "ok" else late)},
         {"name": "usp", "role": "baseline", "skipped": "USP needs a two-level mesh (run with --mesh AxB)"}]
  return out


def _record(case, kind: str, flag: bool = True) -> dict:
  rec = {"name": case.name, "suite": case.suite, "family": case.family, "size": case.size,
         "config": {"seq": case.seq}}
  if not flag:  # as the GPU run of 2026-11-22 wrote it: no flag, and the case "failed"
    contestants = _contestants(kind, flag=False)
    timed = any("median_ms" in c for c in contestants)
    return {**rec, "status": "ok" if timed else "failed", "contestants": contestants, "tuner": {}, "floor": {}}
  records = {c["name"]: c for c in _contestants(kind)}
  return {**rec, "tuner": {}, **cases._finish({"floor": {}}, records, "ring")}


def test_finish_calls_a_case_left_out_for_time_skipped_not_failed():
  case = suites.AttentionCase(1, 32, 32, 128, 32768, True, "4")
  late = _record(case, "late")
  assert late["status"] == "skipped" and late["skipped"].startswith("time budget spent")
  assert late["out_of_time"] == ["jaxmercury", "ring"]
  partial = _record(case, "partial")
  assert partial["status"] == "ok" and partial["out_of_time"] == ["ring"]
  assert not report.finished(late) and not report.finished(partial) and report.finished(_record(case, "ok"))
  failed = cases._finish({}, {"ring": {"name": "ring", "role": "baseline", "error": "out of memory: x"}}, None)
  assert failed["status"] == "failed" and "out_of_time" not in failed
  # results files written before the flag existed are read by the reason
  assert not report.finished(_record(case, "late", flag=False))
  assert not report.finished(_record(case, "partial", flag=False))


def test_time_skips_neither_fail_contestants_nor_stop_the_sweep():
  case = suites.AttentionCase(1, 32, 32, 128, 32768, True, "4")
  for rec in (_record(case, "late"), _record(case, "late", flag=False), _record(case, "partial", flag=False)):
    sweep = run.Sweep()
    sweep.update(case, rec)
    assert sweep.stopped is None and sweep.failed == {}, rec
  sweep = run.Sweep()
  sweep.update(case, {"status": "failed", "contestants": [
      {"name": "ring", "error": "out of memory: ..."}, {"name": "jaxmercury", **LATE}]})
  assert sweep.stopped is None and set(sweep.failed) == {"ring"}  # a real failure still counts


def test_a_tuner_that_timed_out_at_the_budgets_limit_is_left_out_for_time():
  def result(*reasons):
    cands = [types.SimpleNamespace(status="failed", result=types.SimpleNamespace(reason=r)) for r in reasons]
    return types.SimpleNamespace(candidates=cands, best=None)

  env = types.SimpleNamespace(args=types.SimpleNamespace(candidate_time_limit=180.0))
  assert cases._timed_out_by_budget(env, result("time-out: compile and first run took over 10 s"), 10.0)
  assert not cases._timed_out_by_budget(env, result("time-out: compile and first run took over 180 s"), 180.0)
  assert not cases._timed_out_by_budget(env, result("time-out: ...", "wrong result: ..."), 10.0)
  contestant = cases.jaxmercury_contestant(None, {"skipped": "time budget spent: every tuner candidate timed out",
                                                  "out_of_time": True})
  assert contestant.skip.startswith("time budget spent") and contestant.record["out_of_time"] is True


def _argv(out):
  return ["--suite", "attention", "--out", str(out), "--seqs", "4K", "8K", "--batches", "1", "--variants", "MHA",
          "--causal", "yes", "--mesh", "4", "--no_plots", "--time_budget", "600", "--seed", "5"]


@pytest.fixture
def fake_cases(monkeypatch):
  """``run.run_case`` answering from a table ``{size: kind}``; the sizes it ran are in ``calls``."""
  state = types.SimpleNamespace(kinds={}, calls=[])

  def run_case(env, case, sweep):
    del env, sweep
    state.calls.append(case.size)
    return _record(case, state.kinds.get(case.size, "ok"))

  monkeypatch.setattr(run, "run_case", run_case)
  return state


def _statuses(out):
  results = json.loads(out.read_text())
  return results, [(suites.seq_label(c["size"]), c["status"]) for c in results["cases"]]


def test_the_sweep_goes_on_and_resume_runs_the_case_again(tmp_path, fake_cases):
  out = tmp_path / "attention.json"
  fake_cases.kinds = {4096: "late"}  # the budget ran out inside the first case
  assert run.main(_argv(out)) == 0
  results, statuses = _statuses(out)
  assert fake_cases.calls == [4096, 8192]  # the sweep was not stopped
  assert statuses == [("4K", "skipped"), ("8K", "ok")] and results["sweep_stops"] == []
  assert "S4K" in results["unfinished"] and "--resume" in results["unfinished"]
  assert "not run (time budget): 1 cases" in report.markdown(results)
  assert report.problems(results) == []

  fake_cases.calls, fake_cases.kinds = [], {}
  assert run.main(_argv(out) + ["--resume"]) == 0
  results, statuses = _statuses(out)
  assert fake_cases.calls == [4096]  # only the case left out for time; the finished one is kept
  assert statuses == [("4K", "ok"), ("8K", "ok")] and "unfinished" not in results


def test_resume_runs_cases_of_an_older_file_whose_contestants_were_skipped_for_time(tmp_path, fake_cases):
  """The 4 x H200 results file: a "failed" case whose contestants were only skipped for time, and the like."""
  fam = suites.AttentionCase(1, 32, 32, 128, 0, True, "4")
  other = suites.AttentionCase(1, 32, 8, 128, 4096, True, "4")  # another sweep: stays as it is
  out = tmp_path / "attention.json"
  kept = _record(other, "ok")
  out.write_text(json.dumps({"schema": run.SCHEMA, "seed": 5, "cases": [
      kept, _record(suites.with_size(fam, 4096), "late", flag=False),
      _record(suites.with_size(fam, 8192), "partial", flag=False)],
      "sweep_stops": [{"family": fam.family, "reason": "every contestant failed at size 4K"}]}))
  assert run.main(_argv(out) + ["--resume"]) == 0
  results, statuses = _statuses(out)
  assert fake_cases.calls == [4096, 8192]
  assert results["cases"][0] == kept and statuses[1:] == [("4K", "ok"), ("8K", "ok")]
  assert results["sweep_stops"] == [] and "unfinished" not in results
  md = report.markdown(results)
  assert "stopped" not in md and "incomplete" not in md


def test_report_names_cases_that_ran_with_contestants_skipped_for_time():
  case = suites.AttentionCase(1, 32, 32, 128, 32768, True, "4")
  results = {"cases": [_record(case, "partial")]}
  notes = "\n".join(report.notes(results))
  assert "incomplete (time budget): 1 cases" in notes and case.name in notes and "--resume" in notes


def test_a_case_expected_to_outlast_the_budget_is_left_for_resume():
  """On 2 x H200 a 128K case started with 64 s left ran past the command's limit; now it is not started."""
  s32k = suites.AttentionCase(1, 32, 8, 128, 32768, False, "")
  s128k = dataclasses.replace(s32k, seq=131072)
  ran = {"suite": "attention", "wall_s": 30.0, "config": dataclasses.asdict(s32k)}
  assert run.expected_seconds(s128k, []) == 0.0  # nothing ran yet: no guess
  assert run.expected_seconds(s128k, [ran]) == pytest.approx(30.0 * 4)  # 16x the flops: 4x the seconds
  assert run.expected_seconds(s32k, [{**ran, "config": dataclasses.asdict(s128k)}]) == 30.0  # never less
  late = {**ran, "wall_s": 500.0, "out_of_time": True}
  assert run.expected_seconds(s128k, [ran, late]) == pytest.approx(120.0)  # cut-off cases tell nothing
  gemm = suites.GemmCase("allgather", 8192, 4096, 6144, "")
  assert run.expected_seconds(gemm, [ran]) == 0.0  # another suite's cases tell nothing either
