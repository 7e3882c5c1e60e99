"""The tuning database: winning schedule traces in SQLite, keyed by everything they depend on.

A record's key holds the program and its parameters, the mesh, the device
kind and the jax and jaxmercury versions: a record from another version is
not used. Records store the trace as data; reading one replays it through the
public primitives (``Schedule.from_json``), never executes anything stored.
"""

from __future__ import annotations

import datetime
import json
import sqlite3

import jax

from jaxmercury.errors import ScheduleError

SCHEMA = """
CREATE TABLE IF NOT EXISTS winners (
  key TEXT PRIMARY KEY,
  program TEXT NOT NULL,
  trace TEXT NOT NULL,
  median_ms REAL NOT NULL,
  candidates INTEGER NOT NULL,
  created TEXT NOT NULL
)"""


def _version() -> str:
  from jaxmercury import __version__
  return __version__


def record_key(program, mesh) -> str:
  levels = dict(zip(mesh.axis_names, mesh.devices.shape))
  return json.dumps({
      "program": program.name, "params": dict(program.params), "mesh": levels,
      "device": mesh.devices.flat[0].device_kind, "jax": jax.__version__,
      "jaxmercury": _version()}, sort_keys=True)


class Database:
  """A SQLite file of tuned schedules (WAL mode, one transaction per record)."""

  def __init__(self, path: str):
    self.path = path
    try:
      self._conn = sqlite3.connect(path, timeout=30)
      self._conn.execute("PRAGMA journal_mode=WAL")
      self._conn.execute(SCHEMA)
      self._conn.commit()
    except sqlite3.DatabaseError as e:
      raise ScheduleError(f"tuning database {path!r} is unreadable: {e}") from None

  def store(self, program, mesh, schedule, median_ms: float, candidates: int):
    with self._conn:
      self._conn.execute(
          "INSERT OR REPLACE INTO winners VALUES (?, ?, ?, ?, ?, ?)",
          (record_key(program, mesh), program.name, schedule.to_json(), median_ms, candidates,
           datetime.datetime.now(datetime.timezone.utc).isoformat()))

  def lookup(self, program, mesh):
    """The stored winner for ``program`` on ``mesh`` as a fresh Schedule, or None."""
    from jaxmercury.schedules.schedule import Schedule
    row = self._conn.execute("SELECT trace FROM winners WHERE key = ?",
                             (record_key(program, mesh),)).fetchone()
    return None if row is None else Schedule.from_json(program, mesh, row[0])

  def __len__(self):
    return self._conn.execute("SELECT COUNT(*) FROM winners").fetchone()[0]

  def close(self):
    self._conn.close()
