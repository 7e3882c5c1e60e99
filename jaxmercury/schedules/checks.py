"""The checks a schedule's parts must pass, before anything is traced: program, mesh, layouts, a schedule against
its mesh, inputs.

The DSL and the primitives check as they build; these are the checks that
need several parts at once. ``jaxmercury.validate`` (``schedules.validate``)
calls them all for users; ``Schedule`` calls them as it is built and compiled.
Every failure is a ``ScheduleError`` subclass whose message names the axis,
buffer, primitive or mesh level and says what would be valid.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
from jax.sharding import PartitionSpec

from jaxmercury.analysis import placements
from jaxmercury.errors import InputError, LayoutError, MeshError, ProgramError, ScheduleError, UnknownLevelError
from jaxmercury.ir.loops import PARALLEL, VECTOR, spec_levels
from jaxmercury.ir.program import Program
from jaxmercury.kernels import registry


# ------------------------------------------------------------------ program
def check_program(program) -> Program:
  """A ``Program`` whose buffers have dtypes JAX computes in as declared.

  The structure (axes, kinds, buffers, reduction) is checked when the
  program is built (``grid`` and ``Program``); dtypes are checked here
  because ``jax_enable_x64`` may change after a program is declared.
  """
  if not isinstance(program, Program):
    raise ProgramError(f"expected a jaxmercury Program (built with jaxmercury.grid), got {type(program).__name__}")
  for buf in program.reads + (program.writes,):
    canonical = jax.dtypes.canonicalize_dtype(buf.dtype)
    if canonical != buf.dtype:
      raise ProgramError(
          f"buffer {buf.name!r} has dtype {buf.dtype}, which JAX computes as {canonical} while "
          f"jax_enable_x64 is off; declare {canonical} or enable x64 (jax.config.update('jax_enable_x64', True))")
  return program


# ------------------------------------------------------------------ mesh
def check_mesh(mesh, *, devices: bool = False, who: str = "Schedule"):
  """A ``Mesh`` (or, unless ``devices``, an ``AbstractMesh``) with named levels on one platform."""
  if not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
    raise MeshError(f"{who} needs a jax.sharding.Mesh (or an AbstractMesh to plan with), "
                    f"got {type(mesh).__name__}")
  for name, size in mesh.shape.items():
    if not isinstance(name, str) or not name:
      raise MeshError(f"mesh level names must be non-empty strings, got {name!r}; "
                      "name levels e.g. jax.make_mesh((2, 4), ('node', 'gpu'))")
    if size < 1:
      raise MeshError(f"mesh level {name!r} has size {size}; sizes must be positive")
  if devices:
    if not isinstance(mesh, jax.sharding.Mesh):
      raise MeshError(f"cannot compile on {mesh}: an AbstractMesh has no devices; "
                      "use it for plans and cost predictions")
    platforms = sorted({d.platform for d in mesh.devices.flat})
    if len(platforms) > 1:
      raise MeshError(f"mesh mixes device platforms {platforms}; a mesh must hold devices of one platform")
  return mesh


def check_level(levels: Mapping[str, int], level, what: str) -> int:
  """The size of mesh level ``level``; ``UnknownLevelError`` naming the levels if it does not exist."""
  if level not in levels:
    raise UnknownLevelError(f"{what}: mesh has no level {level!r}; levels: {list(levels)}")
  return levels[level]


# ------------------------------------------------------------------ layouts
def check_sharding(buf, levels: Mapping[str, int], spec, what: str):
  """Checks a ``PartitionSpec`` over ``buf``'s own dimensions against the mesh levels.

  Returns:
    ``spec`` (None stays None).
  """
  if spec is None:
    return None
  if not isinstance(spec, PartitionSpec):
    raise LayoutError(f"{what} for {buf.name} must be a PartitionSpec (or None), got {type(spec).__name__}")
  if len(spec) > len(buf.dims):
    raise LayoutError(f"{what}: {spec} has more entries than {buf} has dimensions ({len(buf.dims)})")
  seen = set()
  for dim, entry in enumerate(spec):
    names = spec_levels(entry)
    size = 1
    for n in names:
      check_level(levels, n, f"{what} for {buf.name}")
      if n in seen:
        raise LayoutError(f"{what} for {buf.name}: mesh level {n!r} is used twice in {spec}; "
                          "a level can split one dimension")
      seen.add(n)
      size *= levels[n]
    lead = buf.dims[dim][0].extent
    if lead % size:
      raise LayoutError(
          f"{what} for {buf.name}: dimension {dim} ({buf.dims[dim][0].name}, extent {lead}) does not "
          f"divide evenly over {names} ({size} devices)")
  return spec


def check_in_shardings(program, levels: Mapping[str, int], specs: Sequence | None):
  """One ``PartitionSpec`` (or None) per input of ``program``; returns them as a tuple."""
  if specs is None:
    return None
  if isinstance(specs, PartitionSpec) or not isinstance(specs, (list, tuple)):
    raise LayoutError(f"in_shardings needs a list with one PartitionSpec (or None) per input of {program.name} "
                      f"({', '.join(b.name for b in program.reads)}), got {type(specs).__name__}")
  specs = tuple(specs)
  if len(specs) != len(program.reads):
    raise LayoutError(f"in_shardings needs one entry per input of {program.name} "
                      f"({len(program.reads)}: {', '.join(b.name for b in program.reads)}), got {len(specs)}")
  return tuple(check_sharding(b, levels, s, "in_shardings") for b, s in zip(program.reads, specs))


def check_layouts(program, levels: Mapping[str, int], in_shardings, out_sharding):
  """The caller's input and output layouts, checked; returns them normalized."""
  return (check_in_shardings(program, levels, in_shardings),
          check_sharding(program.writes, levels, out_sharding, "out_sharding"))


# ------------------------------------------------------------------ schedule
def check_on_mesh(schedule, mesh=None):
  """A schedule against the mesh it runs on (default its own), its kernel, layouts and plan; returns the plan.

  The schedule's own consistency comes from its primitives; this checks what
  depends on the mesh and devices at hand.
  """
  mesh = schedule.mesh if mesh is None else mesh
  built_for, here = dict(schedule.mesh.shape), dict(mesh.shape)
  if built_for != here or schedule.levels != built_for:
    raise MeshError(f"schedule was built for mesh levels {schedule.levels}, not {here}: "
                    f"{_level_difference(schedule.levels, here)}; build the schedule on this mesh")
  used = {}
  for lp in schedule.loops:
    if lp.role != PARALLEL:
      continue
    size = check_level(here, lp.level, f"parallel loop {lp.name!r}")
    if lp.extent != size:
      raise MeshError(f"parallel loop {lp.name!r} has extent {lp.extent} but mesh level {lp.level!r} has size "
                      f"{size}; a parallel loop's extent must equal its level's size")
    if lp.level in used:
      raise MeshError(f"mesh level {lp.level!r} carries both {used[lp.level]!r} and {lp.name!r}; "
                      "a level can carry one parallel loop")
    used[lp.level] = lp.name
  registry.lookup(schedule.kernel or "xla", schedule.program, mesh, schedule.kernel_config)
  check_layouts(schedule.program, here, schedule.in_shardings, schedule.out_sharding)
  check_routed_capacity(schedule)
  plan = schedule.plan()
  placements.check(schedule)  # a fused lowering, checked again after later primitives
  return plan


def check_routed_capacity(schedule):
  """A routed program with a capacity, not dispatched: its dense body counts the capacity from the first token
  of its block, so the tokens must not be split into blocks."""
  routing = schedule.program.routing
  if routing is None or routing.capacity is None or schedule.dispatched is not None:
    return
  split = [lp.name for lp in schedule.loops if lp.axis == routing.tokens and lp.role != VECTOR]
  if split:
    raise ScheduleError(f"{schedule.program.name}: loops {split} split the tokens {routing.tokens!r} into blocks, "
                        f"but the dense body counts the expert capacity ({routing.capacity}) within one block; "
                        f"dispatch the experts loop (Schedule.dispatch), which counts it across blocks and devices, "
                        f"or leave the tokens whole")


# ------------------------------------------------------------------ inputs
def check_inputs(program, inputs, mesh=None):
  """Number, shapes and dtypes of ``inputs`` (``Program.check_inputs``), and their devices.

  A committed array (one placed with ``jax.device_put``) must live on the
  mesh's devices; uncommitted arrays are moved by ``jit``.
  """
  if not isinstance(inputs, (list, tuple)):
    raise InputError(f"inputs must be a list or tuple of arrays ({', '.join(b.name for b in program.reads)}), "
                     f"got {type(inputs).__name__}")
  program.check_inputs(tuple(inputs))
  if not isinstance(mesh, jax.sharding.Mesh):
    return
  on_mesh = set(mesh.devices.flat)
  for buf, x in zip(program.reads, inputs):
    if isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array) or not x.committed:
      continue
    outside = sorted(d.id for d in x.sharding.device_set - on_mesh)
    if outside:
      raise InputError(f"input {buf.name} is committed to devices {outside} outside the mesh "
                       f"(devices {sorted(d.id for d in on_mesh)}); jax.device_put it onto the mesh's devices")


def _level_difference(a: Mapping[str, int], b: Mapping[str, int]) -> str:
  for name in list(a) + [n for n in b if n not in a]:
    if name not in b:
      return f"level {name!r} is missing"
    if name not in a:
      return f"level {name!r} is new"
    if a[name] != b[name]:
      return f"level {name!r} has size {a[name]} there and {b[name]} here"
  return "the levels are in another order"


def _short(value) -> str:
  text = repr(value)
  return text if len(text) <= 200 else text[:200] + "..."
