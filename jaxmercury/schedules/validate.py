"""``jaxmercury.validate``: one call that checks a program, mesh, schedule, layouts and inputs before anything is
traced.

``validate`` may be called by users; ``autotune`` calls it for the program,
the mesh, the caller's layouts and each candidate, and ``Schedule.compile``
runs the same checks (``schedules.checks``). Beyond those, ``validate(...,
schedule=s)`` checks the schedule against its own trace: a schedule changed
other than through its primitives (or a trace edited by hand) would serialize
to something that is not the schedule that runs. Every failure is a
``ScheduleError`` subclass whose message names the axis, buffer, primitive or
mesh level and says what would be valid.
"""

from __future__ import annotations

import copy

from jaxmercury.errors import ScheduleError, TraceError
from jaxmercury.schedules import checks
from jaxmercury.schedules.checks import (
  check_in_shardings,
  check_inputs,
  check_layouts,
  check_level,
  check_mesh,
  check_program,
  check_sharding,
)
from jaxmercury.schedules.schedule import Schedule
from jaxmercury.schedules.trace import replay

__all__ = ["check_in_shardings", "check_inputs", "check_layouts", "check_level", "check_mesh", "check_program",
           "check_schedule", "check_sharding", "check_trace", "validate"]


def validate(program, mesh=None, *, schedule=None, inputs=None, in_shardings=None, out_sharding=None,
             compiling: bool = False, trace: bool = True):
  """Checks everything given, before anything is traced.

  Args:
    program: the ``Program``.
    mesh: the mesh it runs on; default the schedule's.
    schedule: a ``Schedule`` of ``program``: checked against ``mesh``, its
      kernel, its communication plan and (``trace``) its own trace.
    inputs: arrays to check against the read buffers (number, shape, dtype)
      and, for committed arrays, against the mesh's devices.
    in_shardings: the caller's ``PartitionSpec`` per input, checked against
      the mesh levels and the buffers' dimensions.
    out_sharding: the caller's ``PartitionSpec`` for the output.
    compiling: the mesh must have devices (not an ``AbstractMesh``).
    trace: replay the schedule's trace and compare (schedules built only
      through primitives, as the tuner's, need not).

  Returns:
    The schedule's communication ``Plan`` when a schedule is given, else None.

  Raises:
    ScheduleError: one of its subclasses (``ProgramError``, ``MeshError``,
      ``LayoutError``, ``InputError``, ``PreconditionError``, ``TraceError``,
      ``UnknownNameError``) naming the problem.
  """
  check_program(program)
  if mesh is None and schedule is not None:
    mesh = getattr(schedule, "mesh", None)
  if mesh is not None:
    check_mesh(mesh, devices=compiling)
    check_layouts(program, dict(mesh.shape), in_shardings, out_sharding)
  plan = check_schedule(schedule, program, mesh, trace=trace) if schedule is not None else None
  if inputs is not None:
    check_inputs(program, inputs, mesh)
  return plan


def check_schedule(schedule, program=None, mesh=None, *, trace: bool = True):
  """A schedule of ``program`` on ``mesh`` (``trace``: consistent with its trace); returns its plan."""
  if not isinstance(schedule, Schedule):
    raise ScheduleError(f"expected a jaxmercury Schedule, got {type(schedule).__name__}")
  if program is not None and schedule.program is not program and \
      schedule.program.fingerprint() != program.fingerprint():
    raise ScheduleError(f"schedule is for {schedule.program}, not {program}; build it with Schedule(program, mesh)")
  if trace:
    check_trace(schedule)
  return checks.check_on_mesh(schedule, mesh)


def check_trace(schedule):
  """Replays the schedule's trace on a fresh schedule; it must rebuild the same nest."""
  fresh = Schedule(schedule.program, schedule.mesh, in_shardings=schedule.in_shardings,
                   out_sharding=schedule.out_sharding)
  try:
    replay(fresh, copy.deepcopy(schedule.trace))
  except TraceError:
    raise
  except ScheduleError as e:
    raise TraceError(f"the schedule's trace does not replay: {e}") from None
  for attr in ("loops", "factors", "padded", "zigzags", "balanced", "placements", "kernel", "kernel_config", "lowering",
               "lowering_config"):
    if getattr(fresh, attr) != getattr(schedule, attr):
      raise TraceError(
          f"schedule and its trace disagree on {attr}: replaying the trace gives {_short(getattr(fresh, attr))}, "
          f"the schedule has {_short(getattr(schedule, attr))}; change schedules only through their primitives")


def _short(value) -> str:
  text = repr(value)
  return text if len(text) <= 200 else text[:200] + "..."
