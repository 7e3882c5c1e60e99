"""The database side of a tune: its stored winner, its cost-model figures and its records.

``from_database`` answers a tune from a stored winner (process 0's, broadcast
to every process); ``machine`` reads the cost model's figures or calibrates
the parts the database lacks (process 0 measures and broadcasts; the others
join the measurements that run over the mesh); ``Store`` writes measurements
as they are taken and the winner's record, and never stops a tune on a failed
write.
"""

from __future__ import annotations

import sqlite3
import time

import jax

from jaxmercury.errors import ScheduleError
from jaxmercury.tuner import agree
from jaxmercury.tuner.calibrate import BACKWARD, KERNELS, MESH, measure_parts, with_backward
from jaxmercury.tuner.cost import Machine, calibrated_name
from jaxmercury.tuner.database import FORWARD, RECORD_FORMAT, record_from_data
from jaxmercury.tuner.progress import calibration_progress
from jaxmercury.tuner.result import TuneResult


def from_database(task, objective: str, database, retune: bool, log) -> TuneResult | None:
  """Process 0's stored winner (broadcast to every process), or None to tune."""
  program, mesh, layouts = task.program, task.mesh, task.layouts
  many = agree.process_count() > 1
  if not many and (database is None or retune):
    return None
  mine = (database.record_data(program, mesh, layouts, objective=objective)
          if database is not None and not retune else None)
  record = None
  if agree.is_leader() and mine is not None:
    try:
      record = record_from_data(program, mesh, mine)
    except ScheduleError as e:
      log(f"{database.path}: the stored record is not trusted ({e}); tuning afresh")
      mine = None
  if agree.is_leader() and mine is None and database is not None and not retune:
    for old in database.stale_records(program, mesh, layouts, objective=objective):
      fmt = "" if old.get("format") == RECORD_FORMAT else f" (record format {old.get('format', 1)})"
      log(f"{database.path} holds a record from jax {old['jax']} / jaxmercury {old['jaxmercury']}{fmt}; "
          "not used by this version")
  agreed = agree.broadcast_json(mine if agree.is_leader() else None) if many else mine
  if agreed is None:
    if mine is not None:
      log(f"process {jax.process_index()}: {database.path} holds {mine['name']!r}, but process 0 "
          "decides and has none: tuning")
    return None
  if not agree.is_leader():
    if mine is None or mine["trace"] != agreed["trace"]:
      held = "no winner" if mine is None else repr(mine["name"])
      log(f"process {jax.process_index()}: database {getattr(database, 'path', None)} holds {held}; "
          f"overruled by process 0's {agreed['name']!r}")
  if record is None:  # another process: process 0's record, replayed here
    record = record_from_data(program, mesh, agreed)
  if not agree.is_leader() and database is not None and (mine is None or mine["trace"] != agreed["trace"]):
    Store(database, task, log, objective).winner(record.winner, record.candidates)
  where = f"in {database.path}" if agree.is_leader() else f"by process {jax.process_index()} from process 0"
  log(f"found {where}: {record.winner.name} ({record.winner.time_ms:.3f} ms)")
  return TuneResult(record.winner, record.candidates, from_database=True, objective=objective,
                    decision=record.winner.final.note if record.winner.final else "")


def machine(task, given: Machine | None, database, log, training: bool = False) -> Machine:
  """The cost model's figures: ``given``, else the database's, calibrating (and storing) the parts it lacks
  (``calibrate.measure_parts``: the mesh's once per machine, the kernels' once per operator pattern and dtypes);
  process 0's under several processes. The kernels' backward blocks are measured for a ``training`` tune only:
  a forward tune stores the kernels' part without them, and the first training tune adds them
  (``calibrate.with_backward``)."""
  program, mesh = task.program, task.mesh
  many = agree.process_count() > 1
  if given is not None:
    return Machine.from_dict(agree.broadcast_json(given.to_dict() if agree.is_leader() else None)) if many \
        else given
  parts = database.machine_parts(program, mesh) if database is not None else {}
  if many:
    parts = agree.broadcast_json(parts if agree.is_leader() else None)
  need = tuple(part for part in (MESH, KERNELS) if part not in parts)
  if need:
    what = {MESH: "the mesh (once per machine)", KERNELS: "the kernels (once per operator and dtype)"}
    log(f"calibrating the cost model on this machine: {' and '.join(what[p] for p in need)} ...")
    measured = measure_parts(program, mesh, parts=need, progress=calibration_progress(log), local=agree.is_leader(),
                             backward=training)
    if many:
      measured = agree.broadcast_json(measured if agree.is_leader() else None)
    store = Store(database, task, log)
    for part, figures in measured.items():
      store.machine_part(part, figures)
    parts = {**parts, **measured}
  if training and BACKWARD not in parts[KERNELS]:
    log("calibrating the cost model's backward blocks on this machine (once per operator and dtype) ...")
    started = time.perf_counter()
    figures = with_backward(program, mesh, parts[KERNELS], local=agree.is_leader())
    if many:
      figures = agree.broadcast_json(figures if agree.is_leader() else None)
    Store(database, task, log).machine_part(KERNELS, figures)
    parts = {**parts, KERNELS: figures}
    log(f"  calibrated: backward blocks in {time.perf_counter() - started:.1f} s")
  return Machine.from_parts(calibrated_name(mesh), parts[MESH], parts[KERNELS])


class Store:
  """Database writes that never stop a tune: a failed write is logged and the search goes on. Records and
  measurements go under the tune's layouts and ``objective``."""

  def __init__(self, database, task, log, objective: str = FORWARD):
    self.db, self.program, self.mesh, self.layouts, self.log = database, task.program, task.mesh, task.layouts, log
    self.objective = objective
    self.path = getattr(database, "path", None)

  def _do(self, what: str, call):
    if self.db is None:
      return None
    try:
      return call(self.db)
    except sqlite3.Error as e:
      self.log(f"warning: could not {what} in {self.path}: {e}")
      return None

  def _keyed(self, what: str, method: str, *args):
    return self._do(what, lambda db: getattr(db, method)(self.program, self.mesh, *args, self.layouts,
                                                         objective=self.objective))

  def started(self, c):
    self._keyed("mark a measurement started", "start_measurement", c)

  def measured(self, c):
    self._keyed("store a measurement", "store_measurement", c)

  def winner(self, best, cands):
    self._keyed("store the winner", "store", best, cands)

  def clear(self):
    self._keyed("clear measurements", "clear_measurements")

  def measurements(self) -> dict:
    return self._keyed("read measurements", "measurements") or {}

  def nearest(self):
    return self._keyed("read the nearest sizes' winner", "nearest")

  def died_measuring(self) -> bool:
    """Whether a stored candidate of this key was started and never measured (the tuner died measuring it)."""
    return any(row.result is None and row.attempts for row in self.measurements().values())

  def machine_part(self, part: str, figures: dict):
    self._do("store machine figures", lambda db: db.store_machine_part(part, self.program, self.mesh, figures))

  def observations(self) -> list:
    return self._do("read the cost model's past predictions", lambda db: db.observations(self.mesh, self.objective)) \
        or []
