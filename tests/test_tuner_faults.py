"""Tuner fault tolerance: faulty candidates are reported and never win; interrupted tunes resume.

Fault injection uses the kernels of ``fault_kernels`` (raise, NaN, wrong
values, hang) patched into library schedules; hangs are stopped by the
watchdog in-process or by killing the worker process.
"""

import importlib
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from conftest import assert_matches, fresh_key, make_mesh

import jaxmercury as jm
from jaxmercury._cpu_flags import cpu_flags
from jaxmercury.kernels import registry
from jaxmercury.tuner import cost, measure
from jaxmercury.tuner.autotuner import Candidate

CPU = cost.Machine("test CPU", flops_per_s=10e9, link_bytes_per_s={"*": 1e9}, latency_s=50e-6)
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _prog():
  return jm.programs.matmul(64, 128, 256)


@pytest.fixture
def faults(monkeypatch):
  """The fault kernels, registered for this test only; the hang is released when the test ends."""
  monkeypatch.setattr(registry, "_KERNELS", dict(registry._KERNELS))
  module = importlib.import_module("fault_kernels")
  module.install()
  module.RELEASE.clear()
  yield module
  module.RELEASE.set()


def _faulty_pairs(prog, mesh, kernels):
  lib = jm.library(prog, mesh)
  pairs = list(lib.items())
  pairs += [(f"allgather_matmul [{k}]", lib["allgather_matmul"].copy().patch(k)) for k in kernels]
  return lib, pairs


def _check_faults_reported(result, lib, reasons):
  by_name = {c.name: c for c in result.candidates}
  for kernel, reason in reasons.items():
    c = by_name[f"allgather_matmul [{kernel}]"]
    assert c.status == measure.FAILED and reason in c.result.reason, (kernel, c.result.reason)
    assert c.time_ms is None and not c.result.times_ms
  for name in lib:
    assert by_name[name].status == measure.OK, by_name[name].result.reason
  assert result.best is not None and (result.best.plain or (
      result.best.name in lib and result.best.schedule.kernel is None))
  return by_name


def test_faulty_candidates_in_process_fail_with_reasons_and_are_recorded(faults, tmp_path):
  prog, mesh = _prog(), make_mesh("8")
  kernels = ["test_raises", "test_nan", "test_wrong", "test_oom", "test_hangs"]
  lib, pairs = _faulty_pairs(prog, mesh, kernels)
  lines = []

  def log(line):  # the hang ends once the watchdog has given up on it, so that later candidates get the devices
    lines.append(line)
    if "time-out" in line:
      faults.RELEASE.set()

  db = jm.Database(tmp_path / "t.db")
  start = time.monotonic()
  result = jm.autotune(prog, mesh, candidates=pairs, top_k=len(pairs), iters=2, machine=CPU, key=fresh_key(),
                       time_limit_s=3.0, database=db, log=log)
  assert time.monotonic() - start < 120
  reasons = {"test_raises": "injected kernel fault", "test_nan": "NaN", "test_wrong": "wrong result",
             "test_oom": "out of memory: JaxRuntimeError: ",
             "test_hangs": "time-out: compile and first run took over 3 s"}
  by_name = _check_faults_reported(result, lib, reasons)
  assert by_name["allgather_matmul [test_wrong]"].result.rel_err == pytest.approx(0.01, rel=0.05)
  # Every measurement, failed ones with their reasons, is in the database; so is the winner.
  stored = db.measurements(prog, mesh)
  assert len(stored) == len(pairs) + 1  # and the plain program's
  for c in result.candidates:
    row = stored[c.schedule.to_json()]
    assert row.result == c.result, c.name
  assert db.lookup(prog, mesh).to_json() == result.best.schedule.to_json()
  assert_matches(result.best.schedule)


def test_hanging_candidate_in_a_worker_process_is_killed(faults):
  prog, mesh = _prog(), make_mesh("8")
  lib = jm.library(prog, mesh)
  pairs = [("allgather_matmul", lib["allgather_matmul"])]
  pairs += [(f"allgather_matmul [{k}]", lib["allgather_matmul"].copy().patch(k)) for k in ("test_hangs", "test_wrong")]
  start = time.monotonic()
  result = jm.autotune(prog, mesh, candidates=pairs, top_k=len(pairs), iters=2, machine=CPU, key=fresh_key(),
                       time_limit_s=3.0, isolation="process", log=lambda s: None)
  assert time.monotonic() - start < 120
  by_name = {c.name: c for c in result.candidates}
  hung = by_name["allgather_matmul [test_hangs]"]
  assert hung.status == measure.FAILED and hung.result.reason.startswith("time-out"), hung.result.reason
  assert "worker killed" in hung.result.reason
  assert by_name["allgather_matmul [test_wrong]"].result.reason.startswith("wrong result")
  assert result.best in (by_name["allgather_matmul"], result.baseline) and result.best.status == measure.OK
  assert result.best.result.rel_err < measure.tolerance(prog.writes.dtype)


def test_interrupted_tune_keeps_measurements_and_resumes(tmp_path, monkeypatch):
  prog, mesh = _prog(), make_mesh("8")
  pairs = list(jm.library(prog, mesh).items())
  db = jm.Database(tmp_path / "t.db")
  timed = []

  def interrupt_after_two(line):
    if "ok" in line or "failed" in line:
      timed.append(line)
      if len(timed) == 2:
        raise KeyboardInterrupt  # Ctrl-C while the tune is under way

  with pytest.raises(KeyboardInterrupt):
    jm.autotune(prog, mesh, candidates=pairs, iters=2, machine=CPU, database=db, log=interrupt_after_two)
  assert len(db) == 0 and db.count_measurements() == 2

  calls = []
  real = measure.measure
  monkeypatch.setattr(measure, "measure", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
  result = jm.autotune(prog, mesh, candidates=pairs, iters=2, machine=CPU, database=db, log=lambda s: None)
  timed = len(pairs) + 1  # and the plain program
  assert result.resumed == 2 and len(calls) == timed - 2
  assert result.best is not None and len(db) == 1 and db.count_measurements() == timed


# Each candidate timed over 400 runs: the tune still has seconds of work left when the test sees two rows.
KILLED_TUNE = textwrap.dedent("""
    import os, sys
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    from jax.sharding import AxisType
    import jaxmercury as jm
    from jaxmercury.tuner import cost
    machine = cost.Machine("test CPU", flops_per_s=10e9, link_bytes_per_s={"*": 1e9}, latency_s=50e-6)
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
    prog = jm.programs.matmul(64, 128, 256)
    jm.autotune(prog, mesh, space=6, top_k=6, iters=400, machine=machine, database=jm.Database(sys.argv[1]),
                log=lambda s: print(s, flush=True))
""")


def _finished_rows(path) -> int:
  try:
    with sqlite3.connect(path, timeout=10) as conn:
      return conn.execute("SELECT COUNT(*) FROM measurements WHERE result IS NOT NULL").fetchone()[0]
  except sqlite3.OperationalError:  # not created yet
    return 0


def test_tune_killed_halfway_resumes_with_records_intact(tmp_path, monkeypatch):
  path = str(tmp_path / "t.db")
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
         "XLA_FLAGS": cpu_flags("", 8)}
  proc = subprocess.Popen([sys.executable, "-c", KILLED_TUNE, path], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  try:
    deadline = time.monotonic() + 240
    while _finished_rows(path) < 2 and proc.poll() is None and time.monotonic() < deadline:
      time.sleep(0.05)
    assert proc.poll() is None, "the tune ended before it could be killed:\n" + proc.stdout.read()[-3000:]
    proc.send_signal(signal.SIGKILL)
  finally:
    if proc.poll() is None:
      proc.kill()
    proc.wait()
  assert proc.returncode == -signal.SIGKILL

  prog, mesh = _prog(), make_mesh("8")
  db = jm.Database(path)  # opens cleanly: every committed record survived the kill
  before = {t: r for t, r in db.measurements(prog, mesh).items() if r.result is not None}
  assert len(before) >= 2 and len(db) == 0
  assert all(r.result.status == measure.OK and r.result.median_ms > 0 for r in before.values())

  calls = []
  real = measure.measure
  monkeypatch.setattr(measure, "measure", lambda *a, **k: calls.append(a[0].to_json()) or real(*a, **k))
  result = jm.autotune(prog, mesh, space=6, top_k=6, iters=2, machine=CPU, database=db, log=lambda s: None)
  timed = [c for c in result.candidates if c.status != measure.PRUNED]
  assert result.resumed == len(before) and not set(calls) & set(before)
  assert len(calls) == len(timed) - len(before)
  for c in timed:  # measurements taken before the kill are used as they were
    if c.schedule.to_json() in before:
      assert c.result == before[c.schedule.to_json()].result
  assert result.best is not None and db.lookup(prog, mesh).to_json() == result.best.schedule.to_json()
  after = db.measurements(prog, mesh)
  assert all(after[t].result == r.result for t, r in before.items())
  assert all(r.result is not None for r in after.values())


def test_candidate_the_tuner_died_in_twice_is_failed_not_retried(tmp_path, monkeypatch):
  prog, mesh = _prog(), make_mesh("8")
  pairs = list(jm.library(prog, mesh).items())
  db = jm.Database(tmp_path / "t.db")
  doomed = Candidate(pairs[0][0], pairs[0][1], 0.0, 0)
  for _ in range(2):  # two tunes were killed while measuring it
    db.start_measurement(prog, mesh, doomed)
  result = jm.autotune(prog, mesh, candidates=pairs, iters=2, machine=CPU, database=db, log=lambda s: None)
  c = next(c for c in result.candidates if c.name == pairs[0][0])
  assert c.status == measure.FAILED and "died 2 times while measuring it" in c.result.reason
  assert result.best is not None and result.best.name != pairs[0][0]


def test_candidates_compile_on_threads_before_any_runs(monkeypatch):
  """Every candidate compiles (on the compile threads) before the first check; a compile error is that
  candidate's failure, with its reason, the others are timed as one at a time would."""
  prog, mesh = _prog(), make_mesh("8")
  pairs = list(jm.library(prog, mesh).items())
  events = []
  original_compile, original_check = measure.compile_ahead, measure._compile_and_check

  def compile_ahead(schedule, **kw):
    events.append(("compile", threading.current_thread().name))
    if schedule.to_json() == pairs[0][1].to_json():
      raise RuntimeError("a compile that fails")
    return original_compile(schedule, **kw)

  def check(*args, **kw):
    events.append(("check", threading.current_thread().name))
    return original_check(*args, **kw)

  monkeypatch.setattr(measure, "compile_ahead", compile_ahead)
  monkeypatch.setattr(measure, "_compile_and_check", check)
  result = jm.autotune(prog, mesh, candidates=pairs, iters=2, machine=CPU, compile_threads=3, log=lambda s: None)
  compiles = [e for e in events if e[0] == "compile"]
  assert len(compiles) == len(pairs) + 1  # and the plain program
  assert all(name.startswith("jaxmercury-compile-") for _, name in compiles)
  assert events.index(compiles[-1]) < events.index(next(e for e in events if e[0] == "check"))
  failed = next(c for c in result.candidates if c.name == pairs[0][0])
  assert failed.status == measure.FAILED and "a compile that fails" in failed.result.reason
  assert all(c.status == measure.OK for c in result.candidates if c is not failed)
  assert result.phases["compile"] > 0


def test_after_the_tuner_died_candidates_compile_one_at_a_time(tmp_path, monkeypatch):
  """A candidate started and never measured (the tuner died) makes the next tune compile each candidate just
  before it runs, so that a second death is blamed on the right one."""
  prog, mesh = _prog(), make_mesh("8")
  pairs = list(jm.library(prog, mesh).items())
  db = jm.Database(tmp_path / "t.db")
  db.start_measurement(prog, mesh, Candidate(pairs[0][0], pairs[0][1], 0.0, 0))
  ahead = []
  monkeypatch.setattr(measure, "compile_ahead", lambda *a, **kw: ahead.append(a))
  result = jm.autotune(prog, mesh, candidates=pairs, iters=2, machine=CPU, database=db, compile_threads=3,
                       log=lambda s: None)
  assert not ahead and "compile" not in result.phases
  assert all(c.status == measure.OK for c in result.candidates)
