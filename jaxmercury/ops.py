"""Distributed operators that use the tuned schedule for their shapes and mesh.

``attention`` and ``matmul`` build the program for their inputs, take the
winner stored in the tuning database, tune on a miss when ``tune=True``, and
otherwise fall back to a sensible library strategy.
"""

from __future__ import annotations

import functools

from jaxmercury import programs
from jaxmercury.schedules.library import library
from jaxmercury.schedules.schedule import Schedule

DEFAULTS = {"attention": ("ring", "context_parallel", "tree"), "matmul": ("allgather_matmul", "matmul_reducescatter")}


def schedule_for(program, mesh, *, database=None, tune: bool = False, **tune_options) -> Schedule:
  """The schedule an operator uses: stored winner, else tuned (if asked), else a default."""
  from jaxmercury.tuner.database import Database
  from jaxmercury.tuner.tune import autotune
  db = database if database is not None else Database()
  found = db.lookup(program, mesh)
  if found is not None:
    return found
  if tune:
    result = autotune(program, mesh, database=db, **tune_options)
    if result.best is not None:
      return result.best.schedule
  lib = library(program, mesh)
  for name in DEFAULTS.get(program.pattern, ()):
    if name in lib:
      return lib[name]
  return Schedule(program, mesh)


@functools.lru_cache(maxsize=64)
def _compiled(trace: str, program, mesh):
  return Schedule.from_json(program, mesh, trace).compile()


def _run(program, mesh, inputs, database, tune, tune_options):
  schedule = schedule_for(program, mesh, database=database, tune=tune, **tune_options)
  return _compiled(schedule.to_json(), program, mesh)(*inputs)


@functools.lru_cache(maxsize=256)
def _attention_program(shape_q, shape_k, dtype, causal):
  b, s, h, d = shape_q
  return programs.attention(b, h, shape_k[2], s, shape_k[1], d, causal=causal, dtype=dtype)


@functools.lru_cache(maxsize=256)
def _matmul_program(shape_a, shape_b, dtype):
  return programs.matmul(shape_a[0], shape_b[1], shape_a[1], dtype=dtype)


def attention(q, k, v, *, mesh, causal: bool = False, database=None, tune: bool = False, **tune_options):
  """Attention of q [b, s, h, d] with k, v [b, t, kv_heads, d] on ``mesh``."""
  prog = _attention_program(tuple(q.shape), tuple(k.shape), str(q.dtype), causal)
  return _run(prog, mesh, (q, k, v), database, tune, tune_options)


def matmul(a, b, *, mesh, database=None, tune: bool = False, **tune_options):
  """``a @ b`` for a [m, k], b [k, n] on ``mesh``."""
  prog = _matmul_program(tuple(a.shape), tuple(b.shape), str(a.dtype))
  return _run(prog, mesh, (a, b), database, tune, tune_options)
