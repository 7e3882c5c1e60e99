"""Tuning database durability: corruption, other versions, malformed records, the nearest other sizes, concurrent
writers."""

import json
import os
import sqlite3
import subprocess
import sys
import textwrap
import warnings

import jax.numpy as jnp
import pytest
from conftest import fresh_key, make_mesh
from jax.sharding import AbstractMesh, AxisType

import jaxmercury as jm
from jaxmercury.tuner import cost, database, measure
from jaxmercury.tuner.autotuner import Candidate

CPU = cost.Machine("test CPU", flops_per_s=10e9, link_bytes_per_s={"*": 1e9}, latency_s=50e-6)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
       "JAX_PLATFORMS": "cpu"}  # the tests' XLA flags: 8 devices


def _quiet(_):
  pass


def _winner(prog, mesh, name="allgather_matmul", time_ms=1.0):
  s = jm.library(prog, mesh)[name]
  return Candidate(name, s, 0.5, 1024, measure.Measurement(measure.OK, time_ms, [time_ms], 1e-7))


def _store_winner(db, prog, mesh, name="allgather_matmul"):
  w = _winner(prog, mesh, name)
  db.store(prog, mesh, w, [w])
  return w


def _aside_files(tmp_path):
  return sorted(p.name for p in tmp_path.iterdir() if ".corrupt-" in p.name)


# ------------------------------------------------------------------ corruption
def test_garbage_file_is_set_aside_and_a_fresh_database_started(tmp_path):
  path = tmp_path / "t.db"
  path.write_bytes(b"this is not a database, just bytes" * 100)
  with pytest.warns(RuntimeWarning, match=r"tuning database .*t\.db is corrupted .*moved it to .*\.corrupt-"):
    db = jm.Database(path)
  (aside,) = _aside_files(tmp_path)
  assert db.set_aside.endswith(aside) and (tmp_path / aside).read_bytes().startswith(b"this is not a database")
  prog, mesh = jm.programs.matmul(64, 32, 48), make_mesh("8")
  w = _store_winner(db, prog, mesh)
  assert jm.Database(path).lookup(prog, mesh).to_json() == w.schedule.to_json()


def test_damaged_pages_are_detected(tmp_path):
  path = tmp_path / "t.db"
  prog, mesh = jm.programs.matmul(64, 32, 48), make_mesh("8")
  db = jm.Database(path)
  for n in range(300):  # enough rows to fill several pages (figures are stored once per pattern: keys of our own)
    db._write("INSERT INTO machines VALUES (?, ?, ?)", (f"filler {n}", json.dumps(CPU.to_dict()), "now"))
  _store_winner(db, prog, mesh)
  db._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
  db.close()
  with open(path, "r+b") as f:
    f.seek(4096 * 3)
    f.write(os.urandom(4096 * 4))
  with pytest.warns(RuntimeWarning, match="is corrupted"):
    fresh = jm.Database(path)
  assert len(fresh) == 0 and len(_aside_files(tmp_path)) >= 1
  assert fresh.lookup(prog, mesh) is None


def test_foreign_sqlite_file_is_set_aside(tmp_path):
  path = tmp_path / "t.db"
  with sqlite3.connect(path) as conn:
    conn.execute("CREATE TABLE winners (player TEXT, score INTEGER)")
  with pytest.warns(RuntimeWarning, match="lacks columns .*not a jaxmercury tuning database"):
    db = jm.Database(path)
  assert len(db) == 0 and len(_aside_files(tmp_path)) == 1


def test_unopenable_path_is_reported_and_left_alone(tmp_path):
  folder = tmp_path / "a_folder.db"
  folder.mkdir()
  (folder / "keep").write_text("mine")
  with pytest.raises(jm.ScheduleError, match=r"tuning database .*a_folder\.db' cannot be opened: unable to open"):
    jm.Database(folder)
  assert (folder / "keep").read_text() == "mine" and not _aside_files(tmp_path)


# ------------------------------------------------------------------ versions and malformed records
def test_record_from_another_version_is_detected_and_not_used(tmp_path, monkeypatch):
  prog, mesh = jm.programs.matmul(64, 128, 256), make_mesh("8")
  db = jm.Database(tmp_path / "t.db")
  with monkeypatch.context() as m:
    m.setattr(database, "_versions", lambda: {"jax": "0.4.30", "jaxmercury": "0.0.9"})
    _store_winner(db, prog, mesh, "async_tp")
    assert db.lookup(prog, mesh).to_json() == jm.library(prog, mesh)["async_tp"].to_json()
  assert len(db) == 1 and db.lookup_record(prog, mesh) is None
  assert db.stale_records(prog, mesh) == [{"jax": "0.4.30", "jaxmercury": "0.0.9"}]
  assert db.stale_records(prog, make_mesh("2x4")) == []
  lines = []
  result = jm.autotune(prog, mesh, candidates=list(jm.library(prog, mesh).items()), iters=1, machine=CPU,
                       database=db, log=lines.append)
  assert not result.from_database and result.best is not None
  assert any("jax 0.4.30 / jaxmercury 0.0.9" in line and "not used" in line for line in lines), lines
  assert len(db) == 2 and db.lookup_record(prog, mesh).winner.name == result.best.name


def _tamper(path, column, value):
  with sqlite3.connect(path) as conn:
    conn.execute(f"UPDATE winners SET {column} = ?", (value,))


def _steps(edit):
  def tamper(trace):
    data = json.loads(trace)
    edit(data["steps"])
    return json.dumps(data)
  return tamper


@pytest.mark.parametrize("column,value,message", [
    ("trace", _steps(lambda steps: steps[-1].update(primitive="exec")), "unknown primitive 'exec'"),
    ("trace", _steps(lambda steps: steps.insert(0, {"primitive": "tile", "args": [["__import__", "os"], 2]})),
     r"no loop \['__import__', 'os'\]"),
    ("trace", _steps(lambda steps: steps.append({"primitive": "tile", "args": ["m"], "code": "print(1)"})), "malformed"),
    ("trace", lambda trace: "{not json", "not valid JSON"),
    ("candidates", lambda trace: '[{"name": 1}]', "stored record is malformed"),
    ("candidates", lambda trace: "}}", "malformed candidates"),
    ("candidates", lambda trace: json.dumps([{"name": "x", "schedule": trace, "status": "rm -rf", "time_ms": 1.0,
                                              "rel_err": 0.0, "reason": "", "predicted_ms": 1.0, "memory_bytes": 1}]),
     "not a measurement"),
], ids=["unknown-primitive", "bad-argument", "extra-field", "not-json", "candidate-fields", "candidates-not-json",
        "unknown-status"])
def test_malformed_record_is_rejected_not_executed(tmp_path, column, value, message):
  prog, mesh = jm.programs.matmul(64, 128, 256), make_mesh("8")
  path = tmp_path / "t.db"
  db = jm.Database(path)
  w = _store_winner(db, prog, mesh)
  _tamper(path, column, value(w.schedule.to_json()))
  with pytest.warns(RuntimeWarning, match=message):
    assert db.lookup_record(prog, mesh) is None
  lines = []
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", RuntimeWarning)
    result = jm.autotune(prog, mesh, candidates=[("allgather_matmul", w.schedule)], iters=1, machine=CPU,
                         database=db, log=lines.append)
  assert not result.from_database and result.best is not None  # tuned afresh, and the record replaced
  assert result.best.schedule.to_json() in (w.schedule.to_json(), result.baseline.schedule.to_json())
  assert db.lookup(prog, mesh).to_json() == result.best.schedule.to_json()


def test_malformed_measurement_rows_are_skipped(tmp_path):
  prog, mesh = jm.programs.matmul(64, 128, 256), make_mesh("8")
  path = tmp_path / "t.db"
  db = jm.Database(path)
  good = _winner(prog, mesh)
  db.store_measurement(prog, mesh, good)
  key = database.record_key(prog, mesh)
  with sqlite3.connect(path) as conn:
    conn.execute("INSERT INTO measurements VALUES (?, ?, ?, ?, 0, 'now')", (key, "t1", "bad json", "{oops"))
    conn.execute("INSERT INTO measurements VALUES (?, ?, ?, ?, 0, 'now')",
                 (key, "t2", "bad status", json.dumps({"status": "rm -rf", "median_ms": 1.0})))
  with pytest.warns(RuntimeWarning, match="skipping a malformed measurement"):
    rows = db.measurements(prog, mesh)
  assert list(rows) == [good.schedule.to_json()] and rows[good.schedule.to_json()].result == good.result


# ------------------------------------------------------------------ the nearest other sizes
def _attention(seq, causal=True):
  return jm.programs.attention(1, 4, 2, seq, seq, 16, causal=causal)


def _store(db, schedule, name):
  w = Candidate(name, schedule, 0.5, 1024, measure.Measurement(measure.OK, 1.0, [1.0], 1e-7))
  db.store(schedule.program, schedule.mesh, w, [w])


def test_nearest_takes_the_closest_sizes_whose_winner_replays(tmp_path):
  """Only sizes may differ, each within the factor; the closest record whose trace replays on the new sizes wins."""
  mesh = make_mesh("8")
  db = jm.Database(str(tmp_path / "near.db"))
  _store(db, jm.Schedule(_attention(96), mesh).tile("i", 3), "tiled")  # closest, but 3 does not divide 128
  _store(db, jm.library(_attention(256), mesh)["ring"], "ring")
  _store(db, jm.library(_attention(128, causal=False), mesh)["tree"], "tree")  # another flag
  _store(db, jm.library(_attention(1024), mesh)["context_parallel"], "context_parallel")  # 8x away
  target = _attention(128)
  assert db.lookup(target, mesh) is None
  schedule, tuned, name, strategy = db.nearest(target, mesh)
  assert tuned["q_len"] == 256 and name == strategy == "ring" and schedule.program is target
  assert schedule.trace == jm.library(_attention(256), mesh)["ring"].trace
  xs = target.random_inputs(fresh_key())
  assert float(jnp.max(jnp.abs(schedule.compile()(*xs) - target.reference(*xs)))) < 1e-5
  assert db.nearest(target, mesh, within=1.5) is None  # ring's 2x is too far, the tiled trace does not replay
  assert db.nearest(target, make_mesh("2x4")) is None  # another mesh
  assert db.nearest(_attention(256), mesh).params["q_len"] == 1024  # never its own record (that is lookup's)
  odd = _attention(1000)  # the 1024 winner replays on a length that is not a multiple of the devices
  schedule, tuned, _, _ = db.nearest(odd, mesh)
  assert tuned["q_len"] == 1024
  xs = odd.random_inputs(fresh_key())
  assert float(jnp.max(jnp.abs(schedule.compile()(*xs) - odd.reference(*xs)))) < 1e-5


# ------------------------------------------------------------------ concurrent writers
WRITER = textwrap.dedent("""
    import os, sys, time
    from jax.sharding import AbstractMesh, AxisType
    import jaxmercury as jm
    from jaxmercury.tuner.measure import Measurement
    from jaxmercury.tuner.candidates import Candidate

    path, who, n, go = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    mesh = AbstractMesh((8,), ("x",), axis_types=(AxisType.Auto,))
    shared = jm.programs.matmul(64, 32, 48)
    own = jm.programs.matmul(64, 32, 48 if who == "a" else 96)
    db = jm.Database(path)

    class Trace:  # a schedule's stand-in: its trace and no kernel
      kernel = kernel_config = lowering = lowering_config = None

      def __init__(self, text):
        self.text = text
      def to_json(self):
        return self.text

    while not os.path.exists(go):
      time.sleep(0.005)
    for i in range(n):
      c = Candidate(f"{who}-{i}", Trace(f"trace-{who}-{i}"), 1.0, 1, Measurement("ok", float(i), [float(i)], 0.0))
      db.start_measurement(shared, mesh, c)
      db.store_measurement(shared, mesh, c)
    w = Candidate(who, jm.library(own, mesh)["allgather_matmul"], 1.0, 1, Measurement("ok", 1.0, [1.0], 0.0))
    db.store(own, mesh, w, [w])
    print("done", flush=True)
""")


def test_concurrent_writers_lose_nothing(tmp_path):
  path, go, n = str(tmp_path / "t.db"), str(tmp_path / "go"), 150
  jm.Database(path).close()
  procs = [subprocess.Popen([sys.executable, "-c", WRITER, path, who, str(n), go], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for who in "ab"]
  try:
    open(go, "w").close()
    outs = [p.communicate(timeout=240)[0] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  assert all(p.returncode == 0 for p in procs), outs
  mesh = AbstractMesh((8,), ("x",), axis_types=(AxisType.Auto,))
  db = jm.Database(path)
  rows = db.measurements(jm.programs.matmul(64, 32, 48), mesh)
  assert len(rows) == 2 * n
  for who in "ab":
    for i in range(n):
      row = rows[f"trace-{who}-{i}"]
      assert row.name == f"{who}-{i}" and row.result.median_ms == i and row.attempts == 1
  assert len(db) == 2
  assert db.lookup_record(jm.programs.matmul(64, 32, 48), mesh).winner.name == "a"
  assert db.lookup_record(jm.programs.matmul(64, 32, 96), mesh).winner.name == "b"


TUNER = textwrap.dedent("""
    import json, os, sys
    import jax
    from jax.sharding import AxisType
    import jaxmercury as jm
    from jaxmercury.tuner import cost
    machine = cost.Machine("test CPU", flops_per_s=10e9, link_bytes_per_s={"*": 1e9}, latency_s=50e-6)
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
    prog = jm.programs.matmul(64, 128, 256) if sys.argv[2] == "matmul" else jm.programs.weighted_sum(64, 256)
    result = jm.autotune(prog, mesh, space=4, top_k=2, iters=2, machine=machine, database=jm.Database(sys.argv[1]),
                         log=lambda s: None)
    timed = [c.schedule.to_json() for c in result.candidates if c.status != "pruned"]
    print(json.dumps({"winner": result.best.schedule.to_json(), "timed": timed}))
""")


def test_two_tuners_writing_one_database_lose_nothing(tmp_path):
  path = str(tmp_path / "t.db")
  procs = {name: subprocess.Popen([sys.executable, "-c", TUNER, path, name], env=ENV, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for name in ("matmul", "weighted_sum")}
  try:
    outs = {name: p.communicate(timeout=300) for name, p in procs.items()}
  finally:
    for p in procs.values():
      if p.poll() is None:
        p.kill()
  for name, p in procs.items():
    assert p.returncode == 0, outs[name][1][-3000:]
  mesh = make_mesh("8")
  db = jm.Database(path)
  assert len(db) == 2
  for name, prog in (("matmul", jm.programs.matmul(64, 128, 256)), ("weighted_sum", jm.programs.weighted_sum(64, 256))):
    report = json.loads(outs[name][0].strip().splitlines()[-1])
    assert db.lookup(prog, mesh).to_json() == report["winner"]
    rows = db.measurements(prog, mesh)
    assert set(rows) == set(report["timed"]) and all(r.result is not None for r in rows.values())
