"""The plain programs of a tune, laid out on its mesh: what a user would run instead of a schedule.

A ``PlainProgram`` is one of ``jaxmercury.programs.plain``'s definitions
(``jnp.dot``, ``jax.nn.dot_product_attention`` with cuDNN or XLA, a
program's ``reference``) jitted with its inputs and output constrained to
layouts on the mesh, for XLA to partition the rest. It is data, like a
schedule: ``to_json`` names the definition and the layouts, and
``from_json`` (or ``runnable_from_json``, which reads schedules too) rebuilds
it, so that a tuning database can store a plain winner and ``jaxmercury.ops``
can run it. It answers what the tuner, the measurement and the operators ask
of a schedule: ``program``, ``mesh``, ``compile()``, ``to_json()``, the
layouts of its buffers (``user_spec``), and no kernel or fused lowering.

Layouts are the caller's (``in_shardings``, ``out_sharding``) where given,
else the default layout (``default_specs``): the output's first spatial axis
that the mesh's device count divides is split over every mesh level, in the
output and in every input indexed by it; everything else is whole. (A GEMM's
rows: ``A`` and ``C`` split by rows, ``B`` whole; attention's queries.) A
definition that JAX partitions only in some layouts (``Plain.layout``:
cuDNN's attention splits batch and heads, nothing else) is called in those:
inputs in other layouts are moved to them first (XLA's all-to-all), as a
user would have to; where the caller gives none, they are its layouts.
On Explicit mesh axes each is called as a user must call it there
(``PlainProgram.compile``): ``jnp.dot`` with ``out_sharding``, the others with
the axes made Auto for XLA to partition them, so that every layout JAX
accepts for the arrays runs.

``as_written`` is the plain program a caller's call stands for, in the
layouts the caller's arrays are in (unknown ones left unconstrained): what
``jaxmercury.ops`` runs for an operator no tune has measured.
"""

from __future__ import annotations

import dataclasses
import json
import math

import jax
from jax.sharding import NamedSharding, PartitionSpec

from jaxmercury.errors import TraceError
from jaxmercury.ir.loops import spec_levels
from jaxmercury.ir.program import Program
from jaxmercury.lowering import types
from jaxmercury.programs import plain as definitions
from jaxmercury.schedules import trace as trace_format
from jaxmercury.schedules.schedule import Schedule


def _spec_data(spec: PartitionSpec | None):
  return None if spec is None else [e if e is None or isinstance(e, str) else list(e) for e in spec]


def _spec_from(data) -> PartitionSpec | None:
  if data is None:
    return None
  if not isinstance(data, list) or not all(e is None or isinstance(e, (str, list)) for e in data):
    raise TraceError(f"a plain program's layout must be a list of level names, got {data!r}")
  return PartitionSpec(*[e if e is None or isinstance(e, str) else tuple(e) for e in data])


def platform_of(mesh) -> str:
  """The platform of the mesh's devices (``"cpu"``, ``"gpu"``, ...)."""
  if isinstance(mesh, jax.sharding.Mesh):
    return mesh.devices.flat[0].platform
  device = getattr(mesh, "abstract_device", None)
  return getattr(device, "platform", None) or "cpu"


@dataclasses.dataclass(frozen=True, eq=False)
class PlainProgram:
  """A plain program (``jaxmercury.programs.plain.Plain``) of ``program`` on ``mesh``, in fixed layouts.

  Attributes:
    program: the program it computes.
    mesh: the device mesh.
    plain: the definition.
    in_shardings: a ``PartitionSpec`` per input, over the input's own dims; None: the caller's array's layout,
      whatever it is (nothing is constrained: ``as_written``).
    out_sharding: the output's ``PartitionSpec``; None: what XLA (on Explicit axes, JAX's typing) gives.
  """

  program: Program
  mesh: object
  plain: definitions.Plain
  in_shardings: tuple
  out_sharding: PartitionSpec

  # What a schedule has and a plain program has not: no kernel, fused kernel or primitives.
  kernel = kernel_config = lowering = lowering_config = None
  trace = ()

  @property
  def name(self) -> str:
    """For display: ``"plain jnp.dot (XLA)"``."""
    return self.plain.label

  @property
  def levels(self) -> dict:
    return dict(self.mesh.shape)

  def user_spec(self, buffer: str) -> PartitionSpec:
    """The layout of ``buffer`` (a read or the output) over its own dims."""
    if buffer == self.program.writes.name:
      return self.out_sharding
    names = [b.name for b in self.program.reads]
    return self.in_shardings[names.index(buffer)]

  def compile(self, *, differentiable: bool = True):
    """``f(*inputs) -> output``, jitted: the inputs constrained to their layouts, the plain computation, the output
    constrained to its layout (arrays in other layouts are moved by XLA, as for a schedule; a None layout is left
    as the caller's array has it).

    On Explicit mesh axes the computation is called as a user must call it there: with the output's
    ``out_sharding`` (``jnp.dot``); in its own layouts (``Plain.layout``: cuDNN's attention), which JAX's types
    take; else with the axes made Auto (``jax.sharding.auto_axes``) for XLA to partition it (JAX's attention,
    whose einsums JAX's types refuse for some layouts: sequence-split queries and keys).

    Args:
      differentiable: accepted for a schedule's signature; a plain program is always differentiable (JAX's own
        derivative).
    """
    del differentiable
    fn = self.plain.make(self.program)
    mesh, prog = self.mesh, self.program
    inner = self.inner_shardings()

    def run(*inputs):
      prog.check_inputs(inputs)
      xs = [_constrain(x, mesh, s) for x, s in zip(inputs, self.in_shardings)]
      if inner != self.in_shardings:  # moved to layouts the call's partitioner takes (an all-to-all)
        xs = [_constrain(x, mesh, s) for x, s in zip(xs, inner)]
      return _constrain(self._call(fn, xs), mesh, self.out_sharding)

    run.__name__ = f"{prog.name.replace(' ', '_')}_plain"
    return jax.jit(run)

  def _call(self, fn, xs):
    """``fn(*xs)``, on Explicit axes with the output's sharding said (``compile``)."""
    if not types.explicit(self.mesh) or self.out_sharding is None or self.plain.layout is not None:
      return fn(*xs)
    rank = len(self.program.writes.shape)
    out = NamedSharding(self.mesh, types.typed_part(self.out_sharding, rank, self.mesh))
    if self.plain.out_sharding:
      return fn(*xs, out_sharding=out)
    return jax.sharding.auto_axes(fn, out_sharding=out)(*xs)

  def in_layouts(self, in_shardings=None, out_sharding=None) -> "PlainProgram":
    """The same definition in other layouts (a None entry, or none given: the caller's array's, unconstrained)."""
    given = tuple(in_shardings) if in_shardings is not None else (None,) * len(self.program.reads)
    return dataclasses.replace(self, in_shardings=given, out_sharding=out_sharding)

  def inner_shardings(self) -> tuple:
    """The input layouts the definition is called in: its own (``Plain.layout``: cuDNN's attention splits batch
    and heads only) where it has one, else the inputs'."""
    if self.plain.layout is None:
      return self.in_shardings
    return tuple(self.plain.layout(self.program, self.in_shardings, self.levels))

  def memory_bytes(self) -> int:
    """Per device: its inputs and output in their layouts (XLA's temporaries are not estimated)."""
    sizes = self.levels
    total = 0
    for buf, spec in [*zip(self.program.reads, self.in_shardings), (self.program.writes, self.out_sharding)]:
      split = math.prod(sizes[level] for entry in spec or () for level in spec_levels(entry))
      total += math.prod(buf.shape) * buf.dtype.itemsize // split
    return int(total)

  def to_data(self) -> dict:
    return {"format": trace_format.FORMAT, "program": self.program.name, "params": dict(self.program.params),
            "mesh": self.levels, "plain": self.plain.name, "implementation": self.plain.implementation,
            "in_shardings": [_spec_data(s) for s in self.in_shardings], "out_sharding": _spec_data(self.out_sharding)}

  def to_json(self) -> str:
    """Its description as data (the definition's name and implementation, the program, mesh and layouts)."""
    return json.dumps(self.to_data(), sort_keys=True)

  @classmethod
  def from_json(cls, program: Program, mesh, text: str, *, other_sizes: bool = False) -> "PlainProgram":
    """The plain program ``to_json`` describes, on ``program`` and ``mesh`` (``other_sizes``: described for other
    sizes of the same program, as ``Schedule.from_json``).

    Raises:
      TraceError: the text is malformed, for another program or mesh, or names no plain program of ``program``.
    """
    data = _data(text)
    params, want = data.get("params", {}), dict(program.params)
    fits = trace_format.same_but_sizes(params, want) if other_sizes and isinstance(params, dict) else params == want
    if not fits or data.get("program") != program.name:
      raise TraceError(f"plain program is for {data.get('program')!r} {params}, not {program.name!r} {want}")
    if data.get("mesh") != dict(mesh.shape):
      raise TraceError(f"plain program is for mesh {data.get('mesh')}, not {dict(mesh.shape)}")
    plain = definitions.find(program, data.get("plain"), data.get("implementation"))
    if plain is None:
      raise TraceError(f"{program.name} has no plain program {data.get('plain')!r} ({data.get('implementation')!r})")
    ins = data.get("in_shardings")
    if not isinstance(ins, list) or len(ins) != len(program.reads):
      raise TraceError(f"a plain program of {program.name} needs {len(program.reads)} input layouts, got {ins!r}")
    return cls(program, mesh, plain, tuple(_spec_from(s) for s in ins), _spec_from(data.get("out_sharding")))

  def __str__(self) -> str:
    lines = [f"{self.name}: {self.program.name} as written in JAX, partitioned by XLA on mesh {self.levels}",
             "buffers:"]
    for b, spec in zip(self.program.reads, self.in_shardings):
      lines.append(f"  in  {b.name}{list(b.shape)} {b.dtype} {_shown(spec)}")
    out = self.program.writes
    lines.append(f"  out {out.name}{list(out.shape)} {out.dtype} {_shown(self.out_sharding)}")
    return "\n".join(lines)

  __repr__ = __str__


def _constrain(x, mesh, spec: PartitionSpec | None):
  return x if spec is None else types.constrain(x, mesh, spec)


def _shown(spec: PartitionSpec | None) -> str:
  return "as the caller's" if spec is None else str(spec)


def _data(text: str) -> dict:
  try:
    data = json.loads(text)
  except (TypeError, json.JSONDecodeError) as e:
    raise TraceError(f"plain program is not valid JSON: {e}") from None
  if not isinstance(data, dict) or data.get("format") != trace_format.FORMAT:
    raise TraceError(f"plain program has format {data.get('format') if isinstance(data, dict) else None!r}; "
                     f"this jaxmercury reads format {trace_format.FORMAT}")
  return data


def is_plain_json(text: str) -> bool:
  """Whether a stored description is a plain program's (else a schedule's trace)."""
  try:
    data = json.loads(text)
  except (TypeError, json.JSONDecodeError):
    return False
  return isinstance(data, dict) and "plain" in data


def runnable_from_json(program: Program, mesh, text: str, *, other_sizes: bool = False):
  """A stored description replayed: a ``PlainProgram`` where it describes one, else a ``Schedule``."""
  if is_plain_json(text):
    return PlainProgram.from_json(program, mesh, text, other_sizes=other_sizes)
  return Schedule.from_json(program, mesh, text, other_sizes=other_sizes)


def default_specs(program: Program, mesh) -> tuple[tuple, PartitionSpec]:
  """The default layout (module docstring): ``(input specs, output spec)``."""
  levels = tuple(mesh.shape)
  devices = math.prod(mesh.shape.values())
  entry = levels[0] if len(levels) == 1 else levels
  out = program.writes
  split = None
  if devices > 1:
    split = next((d[0].name for d in out.dims
                  if len(d) == 1 and program.kinds.get(d[0].name) == "s" and d[0].extent % devices == 0), None)

  def spec(buf) -> PartitionSpec:
    return PartitionSpec(*[entry if split is not None and len(d) == 1 and d[0].name == split else None
                           for d in buf.dims])

  return tuple(spec(b) for b in program.reads), spec(out)


def plain_programs(program: Program, mesh, in_shardings=None, out_sharding=None) -> list[PlainProgram]:
  """The plain programs that apply on ``mesh``'s devices, in the caller's layouts (a None entry, or none given: the
  default layout; for a definition with its own layouts, ``Plain.layout``, those: no data moved before the call,
  and the output stays in the first input's layout)."""
  defaults, default_out = default_specs(program, mesh)
  given = in_shardings if in_shardings is not None else (None,) * len(defaults)
  callers = tuple(d if s is None else s for s, d in zip(given, defaults))
  out = []
  for plain in definitions.applicable(program, platform_of(mesh)):
    ins, result = callers, default_out if out_sharding is None else out_sharding
    if plain.layout is not None:
      own = plain.layout(program, ins, dict(mesh.shape))
      ins = tuple(o if s is None else s for s, o in zip(given, own))
      if out_sharding is None and given[0] is None and _same_dims(program.reads[0], program.writes):
        result = ins[0]
    out.append(PlainProgram(program, mesh, plain, ins, result))
  return out


def as_written(program: Program, mesh, in_shardings=None, out_sharding=None) -> PlainProgram:
  """The plain program a caller's call of ``program`` stands for: its first plain program that applies (``jnp.dot``;
  cuDNN's attention on GPUs where it applies, else XLA's; the MoE einsum dispatch) in the caller's layouts, a
  None entry (or none given) left as the caller's array has it: nothing is constrained, XLA partitions the call
  from the layouts the caller's arrays are in. A definition with its own layouts (``Plain.layout``: cuDNN's
  attention) is called in those (``plain_programs``)."""
  first = plain_programs(program, mesh, in_shardings, out_sharding)[0]
  return first if first.plain.layout is not None else first.in_layouts(in_shardings, out_sharding)


def _same_dims(a, b) -> bool:
  """Whether buffers ``a`` and ``b`` have the same dims (attention's ``q`` and ``o``)."""
  return [[x.name for x in d] for d in a.dims] == [[x.name for x in d] for d in b.dims]


def is_plain(runnable) -> bool:
  return isinstance(runnable, PlainProgram)


__all__ = ["PlainProgram", "as_written", "default_specs", "is_plain", "is_plain_json", "plain_programs", "platform_of",
           "runnable_from_json"]
