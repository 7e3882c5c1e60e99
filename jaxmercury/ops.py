"""Distributed operators that run the plain program until a schedule is measured faster.

``attention``, ``matmul`` and ``moe`` build the program for their inputs and
run, in this order: the winner stored in the tuning database for these sizes
(and the caller's layouts, or tuned for no particular layouts), tuned now on
a miss when ``tune=True``, the winner tuned for the nearest other sizes of the
same operator in the same caller layouts (``Database.nearest``: each size
within a factor of 4, replayed on these sizes); else the plain program as
written (``tuner.plain.as_written``: ``jnp.dot``, JAX's attention, the MoE
einsum dispatch, in the layouts the caller's arrays are in, partitioned by
XLA), never a schedule nothing measured. The caller's layouts are what the
arrays' sharding types say (Explicit mesh axes); on Auto axes types say
nothing and the records tuned for no particular layouts are the ones read. A
stored winner may be a plain program (``tuner.plain.PlainProgram``: where no
schedule beat what a user would run anyway); it compiles and runs like a
schedule.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxmercury import programs
from jaxmercury._compat import ShardingTypeError
from jaxmercury.lowering import types
from jaxmercury.schedules.schedule import Schedule
from jaxmercury.tuner.autotuner import autotune
from jaxmercury.tuner.database import FORWARD, TRAINING, Database
from jaxmercury.tuner.plain import PlainProgram, as_written, is_plain, runnable_from_json

DATABASE, TUNED, NEAREST, PLAIN = "database", "tuned", "nearest", "plain"


@dataclasses.dataclass(frozen=True)
class Choice:
  """The schedule an operator uses, and where it came from.

  Attributes:
    schedule: the schedule, or a plain program.
    name: a short name for display (the strategy, its kernel, the sizes it was tuned at).
    origin: ``"database"`` (the winner stored for these sizes), ``"tuned"`` (tuned now), ``"nearest"`` (the
      winner tuned for the nearest other sizes) or ``"plain"`` (nothing measured: the plain program as written).
  """

  schedule: Schedule | PlainProgram
  name: str
  origin: str

  @property
  def plain(self) -> bool:
    """Whether nothing was measured for it (``origin == "plain"``): the plain program as written."""
    return self.origin == PLAIN

  @property
  def as_written(self) -> bool:
    """Whether it is the caller's own call, partitioned by XLA: nothing measured, or a plain winner XLA
    partitions as it is written (not one called in layouts of its own, as cuDNN's attention is)."""
    return self.plain or (is_plain(self.schedule) and self.schedule.plain.layout is None)

  @property
  def reason(self) -> str:
    """The origin in words; a plain winner's says no schedule beat it."""
    said = {DATABASE: "database hit", TUNED: "tuned", NEAREST: "nearest sizes' winner", PLAIN: "not tuned"}
    if self.plain or is_plain(self.schedule):
      return f"plain ({said[self.origin]}{'' if self.plain else ': no schedule beat it'})"
    return said[self.origin]


def choose(program, mesh, *, layouts=None, database=None, tune: bool = False, **tune_options) -> Choice:
  """The schedule an operator uses and its origin: the stored winner (for ``layouts``, else for no particular
  layouts), else tuned (if asked, in ``layouts``), else the nearest sizes' winner for ``layouts``, else the plain
  program as written (``tuner.plain.as_written``) in ``layouts``. With ``training=True`` among ``tune_options``,
  the winners are those tuned for a training step (``autotune(training=True)``). A winner may be a plain program
  (``PlainProgram``), which compiles as a schedule does.

  Args:
    layouts: the caller's ``(in_shardings, out_sharding)`` (``caller_layouts``), or None where unknown.
  """
  db = database if database is not None else Database()
  objective = TRAINING if tune_options.get("training") else FORWARD
  ins, out = layouts if layouts is not None else (None, None)
  found = db.lookup_record(program, mesh, layouts, objective=objective)
  if found is None and layouts is not None:
    found = db.lookup_record(program, mesh, objective=objective)
  if found is not None:
    return Choice(found.winner.schedule, found.winner.name, DATABASE)
  if tune:
    result = outside_traces(lambda: autotune(program, mesh, database=db, in_shardings=ins, out_sharding=out,
                                              **tune_options))
    if result.best is not None:
      return Choice(result.best.schedule, result.best.name, TUNED)
  near = db.nearest(program, mesh, layouts, objective=objective)
  if near is not None:
    tuned_at = ", ".join(f"{k}={v}" for k, v in near.params.items() if v != program.params.get(k))
    return Choice(near.schedule, f"{near.name} (tuned at {tuned_at})", NEAREST)
  plain = as_written(program, mesh, ins, out)
  return Choice(plain, plain.name, PLAIN)


def caller_layouts(mesh, inputs, output) -> tuple | None:
  """The caller's layouts of an operator: ``(in_shardings, out_sharding)``, a ``PartitionSpec`` over each input's
  and the output's own dims, as their sharding types say on meshes of Explicit axes (arrays or
  ``ShapeDtypeStruct``s; ``output`` is what the undecorated call gives); None on Auto axes, where types say
  nothing."""
  if not types.explicit(mesh):
    return None
  return tuple(types.spec_of(x, mesh) for x in inputs), types.spec_of(output, mesh)


def schedule_for(program, mesh, *, layouts=None, database=None, tune: bool = False,
                 **tune_options) -> Schedule | PlainProgram:
  """The schedule an operator uses (``choose``, without its origin)."""
  return choose(program, mesh, layouts=layouts, database=database, tune=tune, **tune_options).schedule


def outside_traces(fn):
  """``fn()``; while a model is being traced (under ``jax.jit``), in a thread of its own: JAX's trace state is per
  thread, so that the tuner's arrays are real arrays there, not the trace's."""
  if not isinstance(jnp.zeros(()), jax.core.Tracer):
    return fn()
  outcome = {}

  def run():
    try:
      outcome["value"] = fn()
    except BaseException as e:  # re-raised in the caller's thread
      outcome["error"] = e

  thread = threading.Thread(target=run, name="jaxmercury-tune", daemon=True)
  thread.start()
  thread.join()
  if "error" in outcome:
    raise outcome["error"]
  return outcome["value"]


@dataclasses.dataclass(frozen=True)
class Prepared:
  """An operator ready to run, and the layouts at its edges (over the buffers' own dims).

  Attributes:
    fn: ``fn(*inputs) -> output``, the compiled schedule.
    input_specs: the layout the schedule stores each input in (None: not expressible over its own dims).
    output_spec: the layout its output leaves in (``lowering.types.output_spec``).
  """

  fn: Callable
  input_specs: tuple
  output_spec: PartitionSpec


@functools.lru_cache(maxsize=64)
def _prepared(trace: str, program, mesh) -> Prepared:
  runnable = runnable_from_json(program, mesh, trace)
  if is_plain(runnable):
    return Prepared(runnable.compile(), tuple(runnable.in_shardings), runnable.out_sharding)
  plan = runnable.plan()
  return Prepared(runnable.compile(), tuple(plan.user_spec(b.name) for b in program.reads),
                  types.output_spec(runnable))


def prepare(program, mesh, *, schedule=None, layouts=None, database=None, tune: bool = False,
            **tune_options) -> Prepared:
  """``program`` compiled by ``schedule`` (None: the one ``schedule_for`` picks for ``layouts``), with the layouts
  at its edges: what a caller continuing from it under Auto mesh axes needs to know, since arrays' types do not
  say."""
  if schedule is None:
    schedule = schedule_for(program, mesh, layouts=layouts, database=database, tune=tune, **tune_options)
  return _prepared(schedule.to_json(), program, mesh)


class Operands(NamedTuple):
  """An operator's call as its program takes it.

  Attributes:
    program: the program.
    inputs: its inputs, in the order of its reads.
    expected: the undecorated call's result as a ``ShapeDtypeStruct`` (on Explicit mesh axes, its sharding type).
  """

  program: object
  inputs: tuple
  expected: object


def choose_for(operands: Operands, mesh, *, database=None, tune: bool = False, **tune_options) -> Choice:
  """``choose`` for a call, in the caller's layouts (``caller_layouts``)."""
  layouts = caller_layouts(mesh, operands.inputs, operands.expected)
  return choose(operands.program, mesh, layouts=layouts, database=database, tune=tune, **tune_options)


def _run(operands: Operands, mesh, free_dims, schedule, database, tune, tune_options):
  """The operator on its inputs: ``schedule`` (None: ``choose_for``'s; a plain one as written in the caller's
  layouts, as the caller's own call runs, not in those it was tuned in), its result laid out as the undecorated
  call's (``types.like``); the plain program as written leaves it where XLA puts it, as the caller's call would."""
  operands = operands._replace(inputs=tuple(types.cotangent_like(x, mesh) for x in operands.inputs))  # gradients
  # of the caller's types
  if schedule is None:
    choice = choose_for(operands, mesh, database=database, tune=tune, **tune_options)
    schedule = choice.schedule
    if choice.as_written and not choice.plain:
      schedule = schedule.in_layouts(*(caller_layouts(mesh, operands.inputs, operands.expected) or (None, None)))
  out = _prepared(schedule.to_json(), operands.program, mesh).fn(*operands.inputs)
  if is_plain(schedule) and schedule.out_sharding is None:
    return out
  return types.like(out, mesh, operands.expected, free_dims=free_dims)


@functools.lru_cache(maxsize=256)
def attention_program(shape_q, shape_k, dtype, causal, window=None, segment_ids=False, mask_axes=None):
  b, s, h, d = shape_q
  return programs.attention(b, h, shape_k[2], s, shape_k[1], d, causal=causal, dtype=dtype, window=window,
                            segment_ids=segment_ids, mask_axes=mask_axes)


@functools.lru_cache(maxsize=256)
def matmul_program(shape_a, shape_b, dtype):
  return programs.matmul(shape_a[0], shape_b[1], shape_a[1], dtype=dtype)


@functools.lru_cache(maxsize=256)
def moe_program(tokens, d_model, d_ff, experts, top_k, capacity_factor, dtype):
  return programs.moe(tokens, d_model, d_ff, experts, top_k, capacity_factor=capacity_factor, dtype=dtype)


def moe_operands(x, router, w_gate, w_up, w_down, *, top_k: int, capacity_factor: float | None = None) -> Operands:
  """``moe``'s call as its program takes it."""
  prog = moe_program(x.shape[0], x.shape[1], w_gate.shape[2], router.shape[1], int(top_k), capacity_factor,
                     str(x.dtype))
  return Operands(prog, (x, router, w_gate, w_up, w_down), jax.eval_shape(lambda a: a, x))


def moe(x, router, w_gate, w_up, w_down, *, mesh, top_k: int, capacity_factor: float | None = None,
        schedule=None, database=None, tune: bool = False, **tune_options):
  """A mixture-of-experts layer (``programs.moe``) of x [tokens, d] on ``mesh``: ``schedule`` where given, else
  the one ``choose`` picks (untuned: the einsum dispatch as written, ``tuner.plain.as_written``)."""
  operands = moe_operands(x, router, w_gate, w_up, w_down, top_k=top_k, capacity_factor=capacity_factor)
  return _run(operands, mesh, (0,), schedule, database, tune, tune_options)


def attention_operands(q, k, v, *, causal: bool = False, window=None, q_segment_ids=None, kv_segment_ids=None,
                       mask=None, mask_axes=None) -> Operands:
  """``attention``'s call as its program takes it: q, k, v and the mask's arrays."""
  m = programs.attention_mask(q, k, mask=mask, is_causal=causal, local_window_size=window,
                              q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, mask_axes=mask_axes)
  prog = attention_program(tuple(q.shape), tuple(k.shape), str(q.dtype), m.causal, m.window, m.segment_ids,
                           m.mask_axes)
  extras = m.inputs(q, k, mask=mask, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                    mask_axes=mask_axes)
  return Operands(prog, (q, k, v, *extras), _attention_type(q, k, v, causal))


def _attention_type(q, k, v, causal: bool):
  """The result type of ``jax.nn.dot_product_attention(q, k, v)``; where JAX's sharding types refuse that call
  (queries and keys split over one axis on Explicit axes), q's, which is what it gives where it takes one."""
  try:
    return jax.eval_shape(lambda *x: jax.nn.dot_product_attention(*x, is_causal=causal), q, k, v)
  except ShardingTypeError:
    return jax.eval_shape(lambda x: x, q)


def attention(q, k, v, *, mesh, causal: bool = False, window=None, q_segment_ids=None, kv_segment_ids=None,
              mask=None, mask_axes=None, schedule=None, database=None, tune: bool = False, **tune_options):
  """Attention of q [b, s, h, d] with k, v [b, t, kv_heads, d] on ``mesh``; on meshes of Explicit axes its result
  has the sharding type ``jax.nn.dot_product_attention`` would give (q's where JAX's types refuse that call).

  Runs ``schedule`` where given, else the one ``choose`` picks for the caller's layouts (untuned: JAX's attention
  as written, ``tuner.plain.as_written``).

  Masks (``jaxmercury.programs.masks``; they combine): ``causal``; ``window`` (``(left, right)`` or one int,
  ``jax.nn.dot_product_attention``'s ``local_window_size``); ``q_segment_ids`` [b, s] and ``kv_segment_ids``
  [b, t] (packed sequences: a query keeps the keys of its own segment); ``mask``, a boolean array broadcastable to
  [b, h, s, t] (or over the dimensions ``mask_axes`` names, e.g. ``("b", "i", "j")`` for [b, s, t]). A mask
  jaxmercury cannot express raises ``MaskError`` with the reason (``programs.mask_reason`` says so without
  raising).
  """
  operands = attention_operands(q, k, v, causal=causal, window=window, q_segment_ids=q_segment_ids,
                                kv_segment_ids=kv_segment_ids, mask=mask, mask_axes=mask_axes)
  return _run(operands, mesh, (0, 1), schedule, database, tune, tune_options)


def matmul_operands(a, b, *, mesh=None, out_sharding=None) -> Operands:
  """``matmul``'s call as its program takes it; ``out_sharding`` (a ``NamedSharding``, or a ``PartitionSpec`` on
  ``mesh``) the result's, as ``jnp.dot`` takes it (on Explicit axes)."""
  prog = matmul_program(tuple(a.shape), tuple(b.shape), str(a.dtype))
  if isinstance(out_sharding, PartitionSpec):
    out_sharding = NamedSharding(mesh, out_sharding)
  if out_sharding is None or not types.explicit(out_sharding.mesh):
    return Operands(prog, (a, b), jax.eval_shape(jnp.matmul, a, b))
  return Operands(prog, (a, b), jax.eval_shape(lambda x, y: jnp.matmul(x, y, out_sharding=out_sharding), a, b))


def matmul(a, b, *, mesh, out_sharding=None, schedule=None, database=None, tune: bool = False, **tune_options):
  """``a @ b`` for a [m, k], b [k, n] on ``mesh``; on meshes of Explicit axes its result has the sharding type
  ``jnp.matmul(a, b, out_sharding=out_sharding)`` gives (where JAX's types cannot say it, ``x[M@x, K] .
  w[K, N@x]``, a user must pass ``out_sharding`` there as here). Runs ``schedule`` where given, else the one
  ``choose`` picks for the caller's layouts (untuned: ``jnp.dot`` as written, ``tuner.plain.as_written``).

  Args:
    out_sharding: the result's layout (a ``NamedSharding``, or a ``PartitionSpec`` on ``mesh``); None: what
      ``a @ b`` gives.
  """
  operands = matmul_operands(a, b, mesh=mesh, out_sharding=out_sharding)
  out = _run(operands, mesh, (0,), schedule, database, tune, tune_options)
  if out_sharding is not None and not types.explicit(mesh):
    spec = out_sharding.spec if isinstance(out_sharding, NamedSharding) else out_sharding
    out = types.constrain(out, mesh, spec)
  return out
