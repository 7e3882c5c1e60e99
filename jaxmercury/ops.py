"""Distributed operators that use the tuned schedule for their shapes and mesh.

``attention``, ``matmul`` and ``moe`` build the program for their inputs, take the
winner stored in the tuning database, tune on a miss when ``tune=True``, and
otherwise take the winner tuned for the nearest other sizes of the same
operator on the same mesh (``Database.nearest``: each size within a factor
of 4, replayed on these sizes), else a sensible library strategy with the
preferred local kernel that applies (``registry.default_kernel``: cuDNN or
Mosaic GPU flash attention on GPUs). A stored winner may be a plain program
(``tuner.plain.PlainProgram``: where no schedule beat what a user would run
anyway); it compiles and runs like a schedule.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxmercury import programs
from jaxmercury.kernels import registry
from jaxmercury.lowering import types
from jaxmercury.schedules.library import library
from jaxmercury.schedules.schedule import Schedule
from jaxmercury.tuner.autotuner import autotune
from jaxmercury.tuner.database import FORWARD, TRAINING, Database
from jaxmercury.tuner.plain import PlainProgram, is_plain, runnable_from_json

DEFAULTS = {"attention": ("ring", "context_parallel", "tree"), "matmul": ("allgather_matmul", "matmul_reducescatter"),
            "moe": ("expert_parallel",)}


@dataclasses.dataclass(frozen=True)
class Choice:
  """The schedule an operator uses, and where it came from.

  Attributes:
    schedule: the schedule.
    name: a short name for display (the strategy, its kernel, the sizes it was tuned at).
    origin: ``"database"`` (the winner stored for these sizes), ``"tuned"`` (tuned now), ``"nearest"`` (the
      winner tuned for the nearest other sizes) or ``"default"`` (a library strategy).
  """

  schedule: Schedule | PlainProgram
  name: str
  origin: str

  @property
  def reason(self) -> str:
    """The origin in words."""
    return {"database": "database hit", "tuned": "tuned", "nearest": "nearest sizes' winner",
            "default": "default (nothing tuned near these sizes)"}[self.origin]


def choose(program, mesh, *, database=None, tune: bool = False, **tune_options) -> Choice:
  """The schedule an operator uses and its origin: stored winner, else tuned (if asked), else the nearest sizes'
  winner, else a default. With ``training=True`` among ``tune_options``, the winners are those tuned for a
  training step (``autotune(training=True)``). A winner may be a plain program (``PlainProgram``), which compiles
  as a schedule does."""
  db = database if database is not None else Database()
  objective = TRAINING if tune_options.get("training") else FORWARD
  found = db.lookup_record(program, mesh, objective=objective)
  if found is not None:
    return Choice(found.winner.schedule, found.winner.name, "database")
  if tune:
    result = _outside_traces(lambda: autotune(program, mesh, database=db, **tune_options))
    if result.best is not None:
      return Choice(result.best.schedule, result.best.name, "tuned")
  near = db.nearest(program, mesh, objective=objective)
  if near is not None:
    tuned_at = ", ".join(f"{k}={v}" for k, v in near.params.items() if v != program.params.get(k))
    return Choice(near.schedule, f"{near.name} (tuned at {tuned_at})", "nearest")
  lib = library(program, mesh)
  name = next((n for n in DEFAULTS.get(program.pattern, ()) if n in lib), None)
  schedule = lib[name] if name is not None else Schedule(program, mesh)
  kernel = registry.default_kernel(program, mesh)
  label = (name or "local") + (f" [{kernel}]" if kernel not in (None, "xla") else "")
  return Choice(schedule.patch(kernel) if kernel else schedule, label, "default")


def schedule_for(program, mesh, *, database=None, tune: bool = False, **tune_options) -> Schedule | PlainProgram:
  """The schedule an operator uses (``choose``, without its origin)."""
  return choose(program, mesh, database=database, tune=tune, **tune_options).schedule


def _outside_traces(fn):
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


def prepare(program, mesh, *, schedule=None, database=None, tune: bool = False, **tune_options) -> Prepared:
  """``program`` compiled by ``schedule`` (None: the one ``schedule_for`` picks), with the layouts at its edges:
  what a caller continuing from it under Auto mesh axes needs to know, since arrays' types do not say."""
  if schedule is None:
    schedule = schedule_for(program, mesh, database=database, tune=tune, **tune_options)
  return _prepared(schedule.to_json(), program, mesh)


def run(program, mesh, inputs, *, database=None, tune: bool = False, **tune_options):
  """``(output, layout)``: ``program`` on ``inputs`` (``prepare``) and the layout its output leaves in."""
  prepared = prepare(program, mesh, database=database, tune=tune, **tune_options)
  return prepared.fn(*inputs), prepared.output_spec


def _run(program, mesh, inputs, database, tune, tune_options):
  inputs = [types.cotangent_like(x, mesh) for x in inputs]  # gradients of the caller's types
  return run(program, mesh, inputs, database=database, tune=tune, **tune_options)[0]


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


def moe(x, router, w_gate, w_up, w_down, *, mesh, top_k: int, capacity_factor: float | None = None,
        database=None, tune: bool = False, **tune_options):
  """A mixture-of-experts layer (``programs.moe``) of x [tokens, d] on ``mesh``: the tuned schedule, else
  ``expert_parallel`` where the mesh's innermost level divides the experts, else the whole layer on every
  device."""
  prog = moe_program(x.shape[0], x.shape[1], w_gate.shape[2], router.shape[1], int(top_k), capacity_factor,
                     str(x.dtype))
  out = _run(prog, mesh, (x, router, w_gate, w_up, w_down), database, tune, tune_options)
  return types.like(out, mesh, jax.eval_shape(lambda a: a, x), free_dims=(0,))


def attention(q, k, v, *, mesh, causal: bool = False, window=None, q_segment_ids=None, kv_segment_ids=None,
              mask=None, mask_axes=None, database=None, tune: bool = False, **tune_options):
  """Attention of q [b, s, h, d] with k, v [b, t, kv_heads, d] on ``mesh``; on meshes of Explicit axes its result
  has the sharding type ``jax.nn.dot_product_attention`` would give.

  Masks (``jaxmercury.programs.masks``; they combine): ``causal``; ``window`` (``(left, right)`` or one int,
  ``jax.nn.dot_product_attention``'s ``local_window_size``); ``q_segment_ids`` [b, s] and ``kv_segment_ids``
  [b, t] (packed sequences: a query keeps the keys of its own segment); ``mask``, a boolean array broadcastable to
  [b, h, s, t] (or over the dimensions ``mask_axes`` names, e.g. ``("b", "i", "j")`` for [b, s, t]). A mask
  jaxmercury cannot express raises ``MaskError`` with the reason (``programs.mask_reason`` says so without
  raising).
  """
  m = programs.attention_mask(q, k, mask=mask, is_causal=causal, local_window_size=window,
                              q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, mask_axes=mask_axes)
  prog = attention_program(tuple(q.shape), tuple(k.shape), str(q.dtype), m.causal, m.window, m.segment_ids,
                           m.mask_axes)
  extras = m.inputs(q, k, mask=mask, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                    mask_axes=mask_axes)
  out = _run(prog, mesh, (q, k, v, *extras), database, tune, tune_options)
  return types.like(out, mesh, jax.eval_shape(lambda *x: jax.nn.dot_product_attention(*x, is_causal=causal), q, k, v),
                    free_dims=(0, 1))


def matmul(a, b, *, mesh, database=None, tune: bool = False, **tune_options):
  """``a @ b`` for a [m, k], b [k, n] on ``mesh``; on meshes of Explicit axes its result has the sharding type
  ``a @ b`` would give."""
  prog = matmul_program(tuple(a.shape), tuple(b.shape), str(a.dtype))
  out = _run(prog, mesh, (a, b), database, tune, tune_options)
  return types.like(out, mesh, jax.eval_shape(jnp.matmul, a, b), free_dims=(0,))
