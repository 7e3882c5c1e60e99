"""Schedule traces as JSON: data only, replayed through the public primitives.

Format 2 records a patched kernel or fused lowering as its name and, as keyword arguments, the fields of its
configuration that differ from the defaults (format 1 wrote them into the name, ``"kernel[param=value]"``);
a trace of another format is refused with ``TraceError``.
"""

from __future__ import annotations

import json

from jax.sharding import PartitionSpec

from jaxmercury.errors import TraceError

FORMAT = 2
PRIMITIVES = ("pad", "zigzag", "balance", "tile", "join", "reorder", "patch", "parallelize", "shift", "shard",
              "replicate", "lower_with", "dispatch")


def _spec_to_data(spec):
  if spec is None:
    return None
  return [e if e is None or isinstance(e, str) else list(e) for e in spec]


def _spec_from_data(data):
  if data is None:
    return None
  if not isinstance(data, list):
    raise TraceError(f"a sharding in a trace must be a list, got {data!r}")
  return PartitionSpec(*[e if e is None or isinstance(e, str) else tuple(e) for e in data])


def to_data(schedule) -> dict:
  return {
      "format": FORMAT,
      "program": schedule.program.name,
      "params": dict(schedule.program.params),
      "mesh": dict(schedule.levels),
      "in_shardings": None if schedule.in_shardings is None else [_spec_to_data(s) for s in schedule.in_shardings],
      "out_sharding": _spec_to_data(schedule.out_sharding),
      "steps": [dict(step) for step in schedule.trace],
  }


def to_json(schedule) -> str:
  return json.dumps(to_data(schedule), sort_keys=True)


def replay(schedule, steps):
  """Applies recorded steps to ``schedule`` through its public primitives."""
  if not isinstance(steps, list):
    raise TraceError("trace steps must be a list")
  for k, step in enumerate(steps):
    if not isinstance(step, dict) or set(step) - {"primitive", "args", "kwargs"}:
      raise TraceError(f"trace step {k} is malformed: {step!r}")
    name = step.get("primitive")
    if name not in PRIMITIVES:
      raise TraceError(f"trace step {k}: unknown primitive {name!r}; known: {PRIMITIVES}")
    args, kwargs = step.get("args", []), step.get("kwargs", {})
    if not isinstance(args, list) or not isinstance(kwargs, dict):
      raise TraceError(f"trace step {k}: args must be a list and kwargs a dict")
    for v in list(args) + list(kwargs.values()):
      if not isinstance(v, (str, int, float, bool, list)):
        raise TraceError(f"trace step {k}: argument {v!r} is not a name, number, flag or list of names")
    try:
      getattr(schedule, name)(*args, **kwargs)
    except TypeError as e:
      raise TraceError(f"trace step {k} ({name}): {e}") from None
  return schedule


def is_size(value) -> bool:
  """Whether a program parameter is a size (an int, not a flag), which ``from_json(other_sizes=True)`` lets
  differ."""
  return isinstance(value, int) and not isinstance(value, bool)


def same_but_sizes(params: dict, other: dict) -> bool:
  """Whether two programs' parameters have the same names and differ in sizes only (``is_size``)."""
  return params.keys() == other.keys() and all(
      params[k] == other[k] or (is_size(params[k]) and is_size(other[k])) for k in params)


def from_json(schedule_class, program, mesh, text: str, *, other_sizes: bool = False):
  """Rebuilds a schedule of ``program`` on ``mesh`` from ``to_json`` output.

  Args:
    schedule_class: ``Schedule`` (``Schedule.from_json`` passes it).
    program: the program; the trace must be for it (its name and parameters).
    mesh: the mesh; the trace must be for its level names and sizes.
    text: the trace.
    other_sizes: accept a trace of the same program at other sizes (int
      parameters: lengths, batch, heads), replayed on this one; a step
      whose preconditions this shape breaks raises.
  """
  try:
    data = json.loads(text)
  except json.JSONDecodeError as e:
    raise TraceError(f"schedule trace is not valid JSON: {e}") from None
  if not isinstance(data, dict) or data.get("format") != FORMAT:
    raise TraceError(f"schedule trace has format {data.get('format') if isinstance(data, dict) else None!r}; "
                     f"this jaxmercury reads format {FORMAT}")
  params, want = data.get("params", {}), dict(program.params)
  fits = same_but_sizes(params, want) if other_sizes and isinstance(params, dict) else params == want
  if not fits or data.get("program") != program.name:
    raise TraceError(f"trace is for {data.get('program')!r} {data.get('params')}, "
                     f"not {program.name!r} {dict(program.params)}")
  levels = dict(mesh.shape)
  if data.get("mesh") != levels:
    raise TraceError(f"trace is for mesh {data.get('mesh')}, not {levels}")
  ins = data.get("in_shardings")
  schedule = schedule_class(program, mesh,
                      in_shardings=None if ins is None else [_spec_from_data(s) for s in ins],
                      out_sharding=_spec_from_data(data.get("out_sharding")))
  return replay(schedule, data.get("steps"))
