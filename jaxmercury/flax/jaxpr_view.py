"""A flat view of a traced program: its equations across the call boundaries that only group them.

``jax.make_jaxpr`` nests parts of a program in call equations (``jit`` of
``jnp.einsum``, ``jnp.where``, ``jnp.tril``; ``custom_jvp_call`` of a
softmax; ``checkpoint``). Patterns such as attention span those boundaries.
``View`` numbers every equation by its *path* (the indices of the call
equations around it, then its own) and gives each value one canonical
reference, whatever call it crosses, so that a pattern can follow values
from producer to consumer through calls. Loops (``scan``, ``while``,
``cond``) and ``shard_map`` stay single, opaque equations here (the
rewriter views a loop's bodies as programs of their own).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.extend import core as jcore
from jax.extend import source_info_util

# Call equations whose body runs once, on the call's operands, and returns the call's results.
CALLS = frozenset({"jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
                   "custom_vjp_call_jaxpr", "checkpoint", "remat", "remat2"})
REMAT = frozenset({"checkpoint", "remat", "remat2"})


class Lit(NamedTuple):
  """A literal operand: its value and abstract value."""

  value: Any
  aval: Any


Ref = Any  # a value: (scope, Var) for a variable, Lit for a literal


@dataclasses.dataclass(frozen=True, eq=False)
class Site:
  """One equation of the program.

  Attributes:
    path: the indices of the call equations around it, then its own index.
    eqn: the equation.
    ins: its operands' canonical references.
    outs: its results' canonical references (None for dropped results).
  """

  path: tuple[int, ...]
  eqn: Any
  ins: tuple
  outs: tuple

  @property
  def primitive(self) -> str:
    return self.eqn.primitive.name

  @property
  def params(self) -> dict:
    return self.eqn.params


def inner(eqn):
  """``(jaxpr, consts)`` of a call equation the view looks through; None for any other equation."""
  if eqn.primitive.name not in CALLS:
    return None
  body = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
  if body is None:
    return None
  jaxpr, consts = (body.jaxpr, tuple(body.consts)) if hasattr(body, "consts") else (body, ())
  if len(jaxpr.invars) != len(eqn.invars) or len(jaxpr.outvars) != len(eqn.outvars) \
      or len(jaxpr.constvars) != len(consts):
    return None
  return jaxpr, consts


class View:
  """Every equation of a closed jaxpr, calls looked through, with producers and consumers of each value.

  Attributes:
    closed: the closed jaxpr.
    sites: the equations that are not looked through, in program order.
    calls: the call equations looked through, by path.
    inputs: the canonical references of the program's inputs.
    outputs: the canonical references of its results.
    consts: the values of the constants (closed-over arrays), by reference.
  """

  def __init__(self, closed, known: dict | None = None):
    """``known``: values of some inputs (by index) known before running, which ``evaluate`` may use (a loop
    body's constants computed outside it)."""
    self.closed = closed
    self.sites: list[Site] = []
    self.calls: dict[tuple, Site] = {}
    self.by_path: dict[tuple, Site] = {}
    self.consts: dict = {}
    self._producer: dict = {}
    self._consumers: dict = {}
    jaxpr = closed.jaxpr
    self.inputs = [((), v) for v in jaxpr.invars]
    for i, value in (known or {}).items():
      self.consts[self.inputs[i]] = value
    self.outputs = self._visit(jaxpr, (), self.inputs, tuple(closed.consts))
    self._output_set = {r for r in self.outputs if not isinstance(r, Lit)}

  def _visit(self, jaxpr, scope: tuple, in_refs: Sequence, consts: Sequence) -> list:
    alias = dict(zip(jaxpr.invars, in_refs))
    for v, c in zip(jaxpr.constvars, consts):
      alias[v] = (scope, v)
      self.consts[(scope, v)] = c

    def ref(atom):
      return Lit(atom.val, atom.aval) if isinstance(atom, jcore.Literal) else alias[atom]

    for i, eqn in enumerate(jaxpr.eqns):
      path = scope + (i,)
      ins = tuple(ref(a) for a in eqn.invars)
      body = inner(eqn)
      if body is not None:
        outs = tuple(self._visit(body[0], path, ins, body[1]))
        for v, r in zip(eqn.outvars, outs):
          if not isinstance(v, jcore.DropVar):
            alias[v] = r
        site = Site(path, eqn, ins, outs)
        self.calls[path] = site
      else:
        outs = tuple(None if isinstance(v, jcore.DropVar) else (scope, v) for v in eqn.outvars)
        for v in eqn.outvars:
          if not isinstance(v, jcore.DropVar):
            alias[v] = (scope, v)
        site = Site(path, eqn, ins, outs)
        self.sites.append(site)
        for r in outs:
          if r is not None:
            self._producer[r] = site
        for r in ins:
          if not isinstance(r, Lit):
            self._consumers.setdefault(r, []).append(site)
      self.by_path[path] = site
    return [ref(v) for v in jaxpr.outvars]

  def producer(self, ref: Ref) -> Site | None:
    """The equation that computes ``ref``; None for inputs, constants and literals."""
    return None if isinstance(ref, Lit) else self._producer.get(ref)

  def consumers(self, ref: Ref) -> list[Site]:
    return [] if isinstance(ref, Lit) else self._consumers.get(ref, [])

  def is_output(self, ref: Ref) -> bool:
    return ref in self._output_set

  @staticmethod
  def aval(ref: Ref):
    return ref.aval if isinstance(ref, Lit) else ref[1].aval

  def scalar(self, ref: Ref):
    """``ref``'s value when it is one number known before running (computed from scalar literals and
    constants alone, perhaps broadcast); else None."""
    try:
      value = self.evaluate(ref, limit=1)
    except DependsOnInputs:
      return None
    value = np.asarray(value)
    if value.size != 1 and (not value.size or any(value.strides)):
      return None
    return _number(value.reshape(-1)[:1])

  def evaluate(self, ref: Ref, *, limit: int | None = None, cache: dict | None = None):
    """``ref``'s concrete value, computed from its producers at trace time.

    Raises:
      DependsOnInputs: it depends on an input of the program (or on a value computed outside it), or, with
        ``limit``, on an intermediate of more than ``limit`` elements other than a broadcast.
    """
    cache = {} if cache is None else cache
    if isinstance(ref, Lit):
      return ref.value
    if ref in cache:
      return cache[ref]
    if ref in self.consts:
      value = self.consts[ref]
      if isinstance(value, jax.core.Tracer):
        raise DependsOnInputs
      cache[ref] = value
      return value
    site = self.producer(ref)
    if site is None:
      raise DependsOnInputs
    if site.primitive == "broadcast_in_dim" and limit is not None:
      value = np.asarray(self.evaluate(site.ins[0], limit=limit, cache=cache))
      if value.size == 1 or not any(value.strides):  # one number, broadcast: a view, not a copy
        cache[ref] = np.broadcast_to(value.reshape(-1)[:1].reshape(()), site.params["shape"])
        return cache[ref]
    if limit is not None and int(np.prod(self.aval(ref).shape)) > limit:
      raise DependsOnInputs
    vals = [self.evaluate(r, limit=limit, cache=cache) for r in site.ins]
    with jax.ensure_compile_time_eval():
      outs = bind(site.eqn, vals)
    for r, v in zip(site.outs, outs):
      if r is not None:
        cache[r] = np.asarray(v)
    return cache[ref]


class DependsOnInputs(Exception):
  """A value depends on the program's inputs: it is not known at trace time."""


def _number(value):
  try:
    return np.asarray(value).reshape(()).item()
  except (TypeError, ValueError):
    return None


def bind(eqn, vals) -> list:
  """``eqn``'s primitive applied to ``vals``, with the equation's parameters, context and source info: its
  results as a list."""
  params = eqn.primitive.get_bind_params(eqn.params)
  if isinstance(params, tuple):  # older JAX: (subfuns, params)
    subfuns, params = params
    vals = (*subfuns, *vals)
  ctx = getattr(getattr(eqn, "ctx", None), "manager", None)
  with source_info_util.user_context(eqn.source_info.traceback), (ctx if ctx is not None else _nothing()):
    outs = eqn.primitive.bind(*vals, **params)
  return list(outs) if eqn.primitive.multiple_results else [outs]


class _nothing:
  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return False


# ------------------------------------------------------------------ where an equation comes from
MODULE_SCOPE = "jaxmercury.module:"  # the prefix of the named scopes naming a module's path (``distribute``'s)


def module_path(view: View, site: Site) -> str:
  """The path of the innermost module whose call made ``site`` (``layers.0.attn``), read from the named scopes
  ``distribute`` traces a module's calls in; empty where none (a function, the root module)."""
  eqns = [site.eqn] + [view.calls[site.path[:n]].eqn for n in range(len(site.path) - 1, 0, -1)]
  for eqn in eqns:
    info = getattr(eqn, "source_info", None)
    stack = getattr(getattr(info, "name_stack", None), "stack", ())
    names = [s.name for s in stack if isinstance(getattr(s, "name", None), str) and s.name.startswith(MODULE_SCOPE)]
    if names:
      return names[-1][len(MODULE_SCOPE):]
  return ""


_LIBRARIES = tuple(os.path.dirname(m.__file__) + os.sep for m in (jax, np)) + (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,)


def _library_dirs() -> tuple[str, ...]:
  dirs = list(_LIBRARIES)
  for name in ("flax", "optax", "jaxlib"):
    module = sys.modules.get(name)
    if module is not None and getattr(module, "__file__", None):
      dirs.append(os.path.dirname(module.__file__) + os.sep)
  return tuple(dirs) + (os.path.dirname(os.__file__) + os.sep,)


def source_line(eqn) -> str:
  """``file:line (function)`` of the innermost frame of the user's code that made ``eqn`` (not jax's, flax's,
  optax's, jaxmercury's or the standard library's); empty when unknown."""
  info = getattr(eqn, "source_info", None)
  if info is None:
    return ""
  frames = getattr(getattr(info, "traceback", None), "frames", None)
  if frames is None:
    return source_info_util.summarize(info)
  skip = _library_dirs()
  for frame in frames:
    name = os.path.abspath(frame.file_name)
    if name.startswith(skip) or frame.file_name.startswith("<frozen"):
      continue
    shown = os.path.relpath(name) if name.startswith(os.getcwd() + os.sep) else name
    return f"{shown}:{frame.line_num} ({frame.function_name})"
  return source_info_util.summarize(info)


def raised_at(error: BaseException) -> str:
  """``file:line (function)`` of the innermost frame of the user's code in ``error``'s traceback; empty when
  none."""
  import traceback  # only for the rare error a trace raises

  skip = _library_dirs()
  for frame in reversed(traceback.extract_tb(error.__traceback__)):
    name = os.path.abspath(frame.filename)
    if name.startswith(skip) or frame.filename.startswith("<frozen"):
      continue
    shown = os.path.relpath(name) if name.startswith(os.getcwd() + os.sep) else name
    return f"{shown}:{frame.lineno} ({frame.name})"
  return ""
