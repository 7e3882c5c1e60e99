"""The tuning database: winning schedule traces in SQLite, keyed by everything they depend on.

A record's key holds the program's structural hash and parameters, the mesh
shape and level names, the device kind, and the jax and jaxmercury versions:
a record from another version is not used. A record stores the winner's trace
(data), its time and memory, and every candidate's outcome. Reading a record
replays traces through the public primitives (``Schedule.from_json``);
nothing stored is executed.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import sqlite3

import jax

from jaxmercury.errors import ScheduleError

SCHEMA = (
    """CREATE TABLE IF NOT EXISTS winners (
         key TEXT PRIMARY KEY, program TEXT NOT NULL, trace TEXT NOT NULL, name TEXT NOT NULL,
         time_ms REAL NOT NULL, memory_bytes INTEGER NOT NULL, candidates TEXT NOT NULL,
         created TEXT NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS machines (key TEXT PRIMARY KEY, figures TEXT NOT NULL, created TEXT NOT NULL)""",
)


def default_path() -> str:
  """``$XDG_CACHE_HOME/jaxmercury/tuning.db`` (``~/.cache`` when unset)."""
  root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(root, "jaxmercury", "tuning.db")


def _versions() -> dict:
  from jaxmercury import __version__
  return {"jax": jax.__version__, "jaxmercury": __version__}


def _device_kind(mesh) -> str:
  return mesh.devices.flat[0].device_kind if isinstance(mesh, jax.sharding.Mesh) else "abstract"


def record_key(program, mesh, layouts=None) -> str:
  """The key of a record: everything a tuned schedule depends on.

  ``layouts`` are the caller's fixed (in_shardings, out_sharding), if any.
  """
  return json.dumps({
      "program": program.fingerprint(), "params": {k: str(v) for k, v in program.params.items()},
      "mesh": [[n, s] for n, s in mesh.shape.items()], "device": _device_kind(mesh),
      "layouts": None if layouts is None else str(layouts), **_versions()}, sort_keys=True)


@dataclasses.dataclass
class Record:
  winner: object  # tune.Candidate
  candidates: list


def _now() -> str:
  return datetime.datetime.now(datetime.timezone.utc).isoformat()


class Database:
  """A SQLite file of tuned schedules (WAL mode, one transaction per record).

  Args:
    path: the file; default ``default_path()``. Its folder is created.
  """

  def __init__(self, path: str | None = None):
    self.path = path or default_path()
    os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
    try:
      self._conn = sqlite3.connect(self.path, timeout=60)
      self._conn.execute("PRAGMA journal_mode=WAL")
      for statement in SCHEMA:
        self._conn.execute(statement)
      self._conn.commit()
    except sqlite3.DatabaseError as e:
      raise ScheduleError(f"tuning database {self.path!r} is unreadable: {e}") from None

  def store(self, program, mesh, winner, candidates, layouts=None):
    rows = json.dumps([c.to_dict() for c in candidates])
    with self._conn:
      self._conn.execute(
          "INSERT OR REPLACE INTO winners VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
          (record_key(program, mesh, layouts), program.name, winner.schedule.to_json(), winner.name,
           winner.time_ms, winner.memory_bytes, rows, _now()))

  def lookup(self, program, mesh, layouts=None):
    """The stored winner for ``program`` on ``mesh`` as a fresh Schedule, or None."""
    record = self.lookup_record(program, mesh, layouts)
    return None if record is None else record.winner.schedule

  def lookup_record(self, program, mesh, layouts=None) -> Record | None:
    from jaxmercury.schedules.schedule import Schedule
    from jaxmercury.tuner import measure
    from jaxmercury.tuner.tune import Candidate
    row = self._conn.execute(
        "SELECT trace, name, time_ms, memory_bytes, candidates FROM winners WHERE key = ?",
        (record_key(program, mesh, layouts),)).fetchone()
    if row is None:
      return None
    trace, name, time_ms, memory, rows = row
    winner = Candidate(name, Schedule.from_json(program, mesh, trace), float("nan"), memory,
                       measure.Measurement(measure.OK, time_ms))
    cands = []
    for r in json.loads(rows):
      if r["schedule"] == trace and r["name"] == name:
        winner.predicted_ms, winner.result.rel_err, winner.result.compiled_bytes = r["predicted_ms"], r["rel_err"], r.get("compiled_bytes")
        cands.append(winner)
        continue
      result = measure.Measurement(r["status"], r["time_ms"], rel_err=r["rel_err"], reason=r["reason"],
                                   compiled_bytes=r.get("compiled_bytes"))
      cands.append(Candidate(r["name"], Schedule.from_json(program, mesh, r["schedule"]),
                             r["predicted_ms"], r["memory_bytes"], result))
    return Record(winner, cands)

  def machine(self, program, mesh):
    """Stored cost-model figures for this machine and program, or None."""
    from jaxmercury.tuner.cost import Machine
    row = self._conn.execute("SELECT figures FROM machines WHERE key = ?", (record_key(program, mesh),)).fetchone()
    return None if row is None else Machine.from_dict(json.loads(row[0]))

  def store_machine(self, program, mesh, machine):
    with self._conn:
      self._conn.execute("INSERT OR REPLACE INTO machines VALUES (?, ?, ?)",
                         (record_key(program, mesh), json.dumps(machine.to_dict()), _now()))

  def __len__(self):
    return self._conn.execute("SELECT COUNT(*) FROM winners").fetchone()[0]

  def close(self):
    self._conn.close()
