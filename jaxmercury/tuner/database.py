"""The tuning database: winning schedule traces and every measurement, in SQLite.

A record's key holds the program's structural hash and parameters, the mesh
shape and level names, the device kind, the caller's layouts, the objective
(a training step's records apart from the forward's), the record format, and
the jax and jaxmercury versions: a record from another version or format is
not used (and ``stale_records`` says it is there). Candidates are stored in
their structured form (``tuner.candidates.Candidate.to_dict``: strategy,
kernel and configuration, fused kernel and configuration, trace, outcome);
format 1 records, whose kernels were written into names, are stale. A plain
winner (the program a user would otherwise run, ``tuner.plain``) is stored as
its description (``PlainProgram.to_json``) where a schedule's trace would be,
and read back as a ``PlainProgram``. Three tables:

- ``winners``: per key, the winner's trace, time and memory, and every
  candidate's outcome;
- ``measurements``: per key and candidate trace, its measurement, written as
  soon as it is taken (an interrupted tune resumes from them), or a marker
  that it is being measured (a tune that dies in it counts an attempt);
- ``machines``: calibrated cost-model figures, in two parts (``calibrate.MESH`` and ``calibrate.KERNELS``): a
  mesh's figures once per device kind and mesh, whatever the operator and dtype; the kernels' per operator
  pattern and dtypes (``machine_part_key``). Rows of older versions (one row per operator) are not read.

The cost model's accuracy is learned from the winners' records themselves: every timed candidate's prediction
and measured time, per kernel on each machine (``observations``, read by ``tuner.accuracy``).

Durability: WAL journal, one ``BEGIN IMMEDIATE`` transaction per record, a
60 s busy timeout, so concurrent tuners on one machine wait for each other
instead of failing or overwriting. A file that is not a readable database is
moved aside (``<path>.corrupt-<time>``) with a warning and a fresh one
started. The database holds data only: traces are replayed through the public
primitives (``Schedule.from_json``), which reject unknown primitives and
malformed steps; a malformed record is reported and ignored, never executed.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import sqlite3
import threading
import time
import warnings
from typing import NamedTuple

import jax
from jax.sharding import PartitionSpec

from jaxmercury._version import __version__
from jaxmercury.errors import ScheduleError, TraceError
from jaxmercury.schedules.trace import is_size, same_but_sizes
from jaxmercury.tuner import measure
from jaxmercury.tuner.candidates import Candidate
from jaxmercury.tuner.cost import Machine, calibrated_name
from jaxmercury.tuner.plain import runnable_from_json

SCHEMA = (
    """CREATE TABLE IF NOT EXISTS winners (
         key TEXT PRIMARY KEY, program TEXT NOT NULL, trace TEXT NOT NULL, name TEXT NOT NULL,
         time_ms REAL NOT NULL, memory_bytes INTEGER NOT NULL, candidates TEXT NOT NULL,
         created TEXT NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS machines (key TEXT PRIMARY KEY, figures TEXT NOT NULL, created TEXT NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS measurements (
         key TEXT NOT NULL, trace TEXT NOT NULL, name TEXT NOT NULL, result TEXT,
         attempts INTEGER NOT NULL DEFAULT 0, created TEXT NOT NULL, PRIMARY KEY (key, trace))""",
)
COLUMNS = {"winners": {"key", "program", "trace", "name", "time_ms", "memory_bytes", "candidates", "created"},
           "machines": {"key", "figures", "created"},
           "measurements": {"key", "trace", "name", "result", "attempts", "created"}}
RECORD_FORMAT = 2  # 2: structured candidates and format-2 traces
VERSION_FIELDS = ("jax", "jaxmercury", "format")
NEAR_FACTOR = 4.0  # Database.nearest: how far apart sizes may be


def default_path() -> str:
  """``$XDG_CACHE_HOME/jaxmercury/tuning.db`` (``~/.cache`` when unset)."""
  root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(root, "jaxmercury", "tuning.db")


def _versions() -> dict:
  return {"jax": jax.__version__, "jaxmercury": __version__, "format": RECORD_FORMAT}


def _device_kind(mesh) -> str:
  return mesh.devices.flat[0].device_kind if isinstance(mesh, jax.sharding.Mesh) else "abstract"


FORWARD, TRAINING = "forward", "training"  # what a tune minimizes: the forward, or a forward and backward step


def record_key(program, mesh, layouts=None, objective: str = FORWARD) -> str:
  """The key of a record: everything a tuned schedule depends on.

  ``layouts`` are the caller's fixed (in_shardings, out_sharding), if any;
  ``objective`` what the tune minimized (``FORWARD``, whose keys name no
  objective, or ``TRAINING``).
  """
  if objective not in (FORWARD, TRAINING):
    raise ValueError(f"objective must be {FORWARD!r} or {TRAINING!r}, got {objective!r}")
  extra = {} if objective == FORWARD else {"objective": objective}
  return json.dumps({
      "program": program.fingerprint(), "params": {k: str(v) for k, v in program.params.items()},
      "mesh": [[n, s] for n, s in mesh.shape.items()], "device": _device_kind(mesh),
      "layouts": _layouts_text(program, layouts), **extra, **_versions()}, sort_keys=True)


def _layouts_text(program, layouts) -> str | None:
  """The caller's layouts as text, each spec over all of its buffer's dims (``P("x")`` of a matrix is
  ``P("x", None)``), so that a layout written short or long is one key."""
  if layouts is None:
    return None
  ins, out = layouts

  def full(spec, buf):
    if spec is None:
      return None
    rank = len(buf.shape)
    entries = (list(spec) + [None] * rank)[:rank]
    return PartitionSpec(*[e[0] if isinstance(e, tuple) and len(e) == 1 else e for e in entries])

  ins = None if ins is None else tuple(full(s, b) for s, b in zip(ins, program.reads))
  return str((ins, full(out, program.writes)))


MESH_PART, KERNELS_PART = "mesh", "kernels"  # calibrate.MESH and calibrate.KERNELS


def _machine_fields(mesh) -> dict:
  """What identifies a machine: its device kind and mesh, and the versions that measured it."""
  return {"mesh": [[n, s] for n, s in mesh.shape.items()], "device": _device_kind(mesh), **_versions()}


def machine_part_key(part: str, program, mesh) -> str:
  """The key of one part of the cost-model figures: the mesh's (``MESH_PART``) once per machine (device kind and
  mesh); the kernels' (``KERNELS_PART``) once per machine, operator pattern and element types, whatever the sizes:
  figures measured at one size rank the candidates of the others."""
  if part == MESH_PART:
    return json.dumps({"part": part, **_machine_fields(mesh)}, sort_keys=True)
  if part != KERNELS_PART:
    raise ValueError(f"part must be {MESH_PART!r} or {KERNELS_PART!r}, got {part!r}")
  return json.dumps({
      "part": part, "pattern": program.pattern or program.fingerprint(),
      "dtypes": [str(b.dtype) for b in (*program.reads, program.writes)],
      "causal": str(program.params.get("causal")), **_machine_fields(mesh)}, sort_keys=True)


class Near(NamedTuple):
  """``Database.nearest``'s answer: the winner tuned for other sizes, replayed on the program asked about (a
  ``Schedule``, or a ``PlainProgram``)."""

  schedule: object
  params: dict  # the parameters it was tuned for
  name: str  # its candidate name there (for display)
  strategy: str  # its strategy


@dataclasses.dataclass
class Record:
  winner: Candidate
  candidates: list


@dataclasses.dataclass
class Stored:
  """A candidate's row in ``measurements``: its measurement (None while unfinished) and start count."""

  name: str
  result: object  # measure.Measurement | None
  attempts: int


def record_from_data(program, mesh, data: dict) -> Record:
  """A ``Record`` from stored (or broadcast) data; every trace replays through the primitives.

  Raises:
    TraceError: the data is malformed or a trace does not replay.
  """
  try:
    trace, name = data["trace"], data["name"]
    runnable_from_json(program, mesh, trace)  # the winner's own trace replays, whatever the candidates hold
    cands = [Candidate.from_dict(program, mesh, r) for r in data["candidates"]]
    winner = next((c for c in cands if c.schedule.to_json() == trace and c.name == name), None)
    if winner is None:
      raise ValueError(f"the winner {name!r} is not among its candidates")
    winner.result = dataclasses.replace(winner.result, status=measure.OK, median_ms=float(data["time_ms"]))
  except TraceError:
    raise
  except (ScheduleError, KeyError, TypeError, ValueError, AttributeError) as e:
    raise TraceError(f"stored record is malformed: {type(e).__name__}: {e}") from None
  return Record(winner, cands)


def _now() -> str:
  return datetime.datetime.now(datetime.UTC).isoformat()


class Database:
  """A SQLite file of tuned schedules and measurements (WAL, one transaction per record).

  Args:
    path: the file; default ``default_path()``. Its folder is created. A
      file that is not a readable jaxmercury database is moved aside to
      ``<path>.corrupt-<time>`` with a ``RuntimeWarning`` and a fresh one is
      started.
  """

  def __init__(self, path: str | os.PathLike | None = None):
    self.path = path or default_path()
    os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
    self.set_aside: str | None = None  # where a corrupted file was moved, if one was
    self._lock = threading.RLock()
    try:
      self._conn = self._connect()
    except sqlite3.DatabaseError as e:
      if not _is_corruption(e):  # locked, unreadable, a directory: report, never move it
        raise ScheduleError(f"tuning database {os.fspath(self.path)!r} cannot be opened: {e}") from None
      self.set_aside = self._move_aside(str(e))
      try:
        self._conn = self._connect()
      except sqlite3.DatabaseError as again:
        raise ScheduleError(f"tuning database {os.fspath(self.path)!r} is unusable: {again}") from None

  # ------------------------------------------------------------ the file
  def _connect(self) -> sqlite3.Connection:
    path = os.fspath(self.path)
    self._inode = _inode(path)
    # one connection for every thread (a tune started while a model is traced runs in a thread of its own),
    # each statement under the lock
    conn = sqlite3.connect(path, timeout=60, isolation_level=None, check_same_thread=False)
    try:
      conn.execute("PRAGMA journal_mode=WAL")
      check = conn.execute("PRAGMA quick_check").fetchone()
      if check is None or check[0] != "ok":
        raise _Corrupt(f"integrity check failed: {check[0] if check else 'no answer'}")
      for statement in SCHEMA:
        conn.execute(statement)
      for table, columns in COLUMNS.items():
        have = {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
        if not columns <= have:
          raise _Corrupt(f"table {table} lacks columns {sorted(columns - have)}: not a jaxmercury tuning database")
    except BaseException:
      conn.close()
      raise
    return conn

  def _move_aside(self, reason: str) -> str | None:
    """Renames the corrupted file (and its WAL files) aside; returns the new name."""
    path = os.fspath(self.path)
    if _inode(path) != self._inode:  # another process already replaced it
      return None
    aside = f"{path}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    for suffix in ("", "-wal", "-shm"):
      try:
        os.replace(path + suffix, aside + suffix)
      except FileNotFoundError:
        pass
    warnings.warn(f"tuning database {path} is corrupted ({reason}); moved it to {aside} and started a "
                  "fresh one", RuntimeWarning, stacklevel=3)
    return aside

  def _write(self, sql: str, params: tuple):
    """One statement in one ``BEGIN IMMEDIATE`` transaction (waits for other writers)."""
    with self._lock:
      self._conn.execute("BEGIN IMMEDIATE")
      try:
        self._conn.execute(sql, params)
      except BaseException:
        self._conn.execute("ROLLBACK")
        raise
      self._conn.execute("COMMIT")

  def _read(self, sql: str, params: tuple) -> list:
    try:
      with self._lock:
        return self._conn.execute(sql, params).fetchall()
    except sqlite3.DatabaseError as e:
      warnings.warn(f"tuning database {os.fspath(self.path)} could not be read ({e}); treating it as empty",
                    RuntimeWarning, stacklevel=3)
      return []

  # ------------------------------------------------------------ winners
  def store(self, program, mesh, winner, candidates, layouts=None, *, objective: str = FORWARD):
    """Stores (or replaces) the winner of ``program`` on ``mesh`` and every candidate's outcome."""
    rows = json.dumps([c.to_dict() for c in candidates])
    self._write("INSERT OR REPLACE INTO winners VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (record_key(program, mesh, layouts, objective), program.name, winner.schedule.to_json(),
                 winner.name, winner.time_ms, winner.memory_bytes, rows, _now()))

  def record_data(self, program, mesh, layouts=None, *, objective: str = FORWARD) -> dict | None:
    """The stored record as plain data (what ``record_from_data`` reads), or None."""
    rows = self._read("SELECT trace, name, time_ms, memory_bytes, candidates FROM winners WHERE key = ?",
                      (record_key(program, mesh, layouts, objective),))
    if not rows:
      return None
    trace, name, time_ms, memory, cands = rows[0]
    try:
      cands = json.loads(cands)
    except (TypeError, ValueError) as e:
      warnings.warn(f"tuning database {os.fspath(self.path)}: the record for {program.name} has malformed "
                    f"candidates ({e}); ignored", RuntimeWarning, stacklevel=2)
      return None
    return {"trace": trace, "name": name, "time_ms": time_ms, "memory_bytes": memory, "candidates": cands}

  def lookup(self, program, mesh, layouts=None, *, objective: str = FORWARD):
    """The stored winner for ``program`` on ``mesh``, or None: a fresh ``Schedule``, or the
    ``tuner.plain.PlainProgram`` where the plain program won (both compile the same way)."""
    record = self.lookup_record(program, mesh, layouts, objective=objective)
    return None if record is None else record.winner.schedule

  def lookup_record(self, program, mesh, layouts=None, *, objective: str = FORWARD) -> Record | None:
    """The stored record, its traces replayed; None if there is none or it is malformed (with a warning)."""
    data = self.record_data(program, mesh, layouts, objective=objective)
    if data is None:
      return None
    try:
      return record_from_data(program, mesh, data)
    except TraceError as e:
      warnings.warn(f"tuning database {os.fspath(self.path)}: the record for {program.name} is not "
                    f"trusted ({e}); ignored", RuntimeWarning, stacklevel=2)
      return None

  def nearest(self, program, mesh, layouts=None, *, objective: str = FORWARD, within: float = NEAR_FACTOR):
    """The winner tuned for the nearest other sizes of ``program``, replayed on ``program``; or None.

    A record qualifies when only sizes differ (int parameters: lengths,
    batch, heads; not dtypes or flags), each within a factor ``within``, and
    the mesh, device, layouts and versions are the same. The nearest (the
    smallest sum of ``|log(size ratio)|``) whose winner replays on this
    shape is taken: a trace whose steps this shape breaks (a tile that does
    not divide) is passed over.

    Returns:
      A ``Near`` (the replayed winner, the parameters and name it was tuned
      with), or None.
    """
    want = json.loads(record_key(program, mesh, layouts, objective))
    fixed = {k: v for k, v in want.items() if k not in ("program", "params")}
    params = dict(program.params)
    near = []
    rows = self._read("SELECT key, trace, name, candidates FROM winners WHERE program = ?", (program.name,))
    for key, trace, name, cands in rows:
      try:
        have, tuned = json.loads(key), json.loads(trace)["params"]
        strategy = next(c["strategy"] for c in json.loads(cands) if c["schedule"] == trace and c["name"] == name)
      except (ValueError, TypeError, KeyError, StopIteration):
        continue
      if not isinstance(have, dict) or {k: v for k, v in have.items() if k not in ("program", "params")} != fixed \
          or not isinstance(tuned, dict) or not same_but_sizes(tuned, params) or tuned == params:
        continue
      ratios = [max(tuned[k], params[k]) / max(min(tuned[k], params[k]), 1) for k in params if is_size(params[k])]
      if all(r <= within for r in ratios):
        near.append((sum(math.log(r) for r in ratios), trace, tuned, name, strategy))
    for _, trace, tuned, name, strategy in sorted(near, key=lambda n: n[0]):
      try:
        return Near(runnable_from_json(program, mesh, trace, other_sizes=True), tuned, str(name), str(strategy))
      except ScheduleError:
        continue
    return None

  def stale_records(self, program, mesh, layouts=None, *, objective: str = FORWARD) -> list[dict]:
    """Versions of records for this key made by another jax or jaxmercury (not used)."""
    want = json.loads(record_key(program, mesh, layouts, objective))
    base = {k: v for k, v in want.items() if k not in VERSION_FIELDS}
    out = []
    for (key,) in self._read("SELECT key FROM winners WHERE program = ?", (program.name,)):
      try:
        have = json.loads(key)
      except ValueError:
        continue
      if isinstance(have, dict) and {k: v for k, v in have.items() if k not in VERSION_FIELDS} == base \
          and any(have.get(f) != want[f] for f in VERSION_FIELDS):
        out.append({f: have[f] for f in VERSION_FIELDS if f in have})
    return out

  # ------------------------------------------------------------ measurements
  def start_measurement(self, program, mesh, candidate, layouts=None, *, objective: str = FORWARD):
    """Marks a candidate as being measured (one more attempt), before it runs."""
    self._write(
        "INSERT INTO measurements (key, trace, name, result, attempts, created) VALUES (?, ?, ?, NULL, 1, ?) "
        "ON CONFLICT (key, trace) DO UPDATE SET attempts = attempts + 1, result = NULL, created = excluded.created",
        (record_key(program, mesh, layouts, objective), candidate.schedule.to_json(), candidate.name, _now()))

  def store_measurement(self, program, mesh, candidate, layouts=None, *, objective: str = FORWARD):
    """Stores a candidate's measurement as soon as it is taken."""
    self._write(
        "INSERT INTO measurements (key, trace, name, result, attempts, created) VALUES (?, ?, ?, ?, 0, ?) "
        "ON CONFLICT (key, trace) DO UPDATE SET result = excluded.result, name = excluded.name, "
        "created = excluded.created",
        (record_key(program, mesh, layouts, objective), candidate.schedule.to_json(), candidate.name,
         json.dumps(candidate.result.to_dict()), _now()))

  def measurements(self, program, mesh, layouts=None, *, objective: str = FORWARD) -> dict[str, Stored]:
    """Stored measurements of this key by candidate trace; malformed rows are skipped with a warning."""
    out = {}
    rows = self._read("SELECT trace, name, result, attempts FROM measurements WHERE key = ?",
                      (record_key(program, mesh, layouts, objective),))
    for trace, name, result, attempts in rows:
      try:
        out[trace] = Stored(name, None if result is None else measure.Measurement.from_dict(json.loads(result)),
                            int(attempts))
      except (TypeError, ValueError) as e:
        warnings.warn(f"tuning database {os.fspath(self.path)}: skipping a malformed measurement of "
                      f"{name!r} ({e})", RuntimeWarning, stacklevel=2)
    return out

  def clear_measurements(self, program, mesh, layouts=None, *, objective: str = FORWARD):
    """Forgets this key's measurements (``autotune(retune=True)`` starts afresh)."""
    self._write("DELETE FROM measurements WHERE key = ?", (record_key(program, mesh, layouts, objective),))

  def count_measurements(self) -> int:
    rows = self._read("SELECT COUNT(*) FROM measurements WHERE result IS NOT NULL", ())
    return rows[0][0] if rows else 0

  # ------------------------------------------------------------ machines
  def machine(self, program, mesh):
    """Stored cost-model figures for this machine and program's pattern and types, both parts, or None."""
    parts = self.machine_parts(program, mesh)
    if len(parts) < 2:
      return None
    return Machine.from_parts(calibrated_name(mesh), parts[MESH_PART], parts[KERNELS_PART])

  def machine_parts(self, program, mesh) -> dict:
    """The stored parts of this machine's figures (``{MESH_PART: fields, KERNELS_PART: fields}``, those stored); a
    malformed part is left out with a warning."""
    out = {}
    fields = {f.name for f in dataclasses.fields(Machine)} - {"name"}
    for part in (MESH_PART, KERNELS_PART):
      rows = self._read("SELECT figures FROM machines WHERE key = ?", (machine_part_key(part, program, mesh),))
      if not rows:
        continue
      try:
        figures = json.loads(rows[0][0])
        if not isinstance(figures, dict) or not set(figures) <= fields:
          raise ValueError(f"unknown fields {sorted(set(figures) - fields) if isinstance(figures, dict) else figures}")
        out[part] = figures
      except (TypeError, ValueError) as e:
        warnings.warn(f"tuning database {os.fspath(self.path)}: malformed machine figures ({e}); ignored",
                      RuntimeWarning, stacklevel=2)
    return out

  def store_machine_part(self, part: str, program, mesh, figures: dict):
    """Stores one part of the figures (``machine_parts``)."""
    self._write("INSERT OR REPLACE INTO machines VALUES (?, ?, ?)",
                (machine_part_key(part, program, mesh), json.dumps(figures), _now()))

  def store_machine(self, program, mesh, machine):
    """Stores a machine's figures, both parts."""
    mesh_part, kernel_part = machine.parts()
    self.store_machine_part(MESH_PART, program, mesh, mesh_part)
    self.store_machine_part(KERNELS_PART, program, mesh, kernel_part)

  def observations(self, mesh, objective: str = FORWARD) -> list[tuple[str, float, float]]:
    """``(kernel, predicted ms, measured ms)`` of every timed candidate of the winners' records of this machine
    (device kind, mesh, versions) and objective, plain programs left out. ``kernel`` is the fused kernel where
    the candidate has one, else its local kernel (``"xla"`` for none)."""
    want = {**_machine_fields(mesh), "objective": objective}
    out = []
    for key, cands in self._read("SELECT key, candidates FROM winners ORDER BY created", ()):
      try:
        have = json.loads(key)
        if {k: have.get(k, FORWARD if k == "objective" else None) for k in want} != want:
          continue
        for c in json.loads(cands):
          if c.get("plain") or c.get("status") != measure.OK or not c.get("predicted_ms") or not c.get("time_ms"):
            continue
          out.append((str(c.get("lowering") or c.get("kernel") or "xla"), float(c["predicted_ms"]),
                      float(c["time_ms"])))
      except (TypeError, ValueError, AttributeError):
        continue
    return out

  def __len__(self):
    rows = self._read("SELECT COUNT(*) FROM winners", ())
    return rows[0][0] if rows else 0

  def close(self):
    self._conn.close()


class _Corrupt(sqlite3.DatabaseError):
  """A file SQLite reads but that fails the integrity check or lacks jaxmercury's tables."""


def _is_corruption(e: sqlite3.DatabaseError) -> bool:
  name = getattr(e, "sqlite_errorname", "") or ""
  return isinstance(e, _Corrupt) or name.startswith(("SQLITE_CORRUPT", "SQLITE_NOTADB"))


def _inode(path: str):
  try:
    st = os.stat(path)
  except FileNotFoundError:
    return None
  return (st.st_dev, st.st_ino)
