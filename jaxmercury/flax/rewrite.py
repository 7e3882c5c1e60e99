"""Routing by rewriting the traced program.

``route(fn, routing)`` is ``fn`` with each attention and GEMM of its traced
program (``patterns.find``) computed by a jaxmercury operator: the wrapper
traces ``fn`` to a jaxpr (``jax.make_jaxpr``) at its arguments' shapes and
evaluates that jaxpr equation by equation, binding each equation's primitive
as it was, except the equations a match replaces: its anchor runs the
operator on the match's operands, its other equations are skipped. Calls
(``jit``) that hold a replaced equation are evaluated inline, a
``checkpoint`` as a checkpoint of its rewritten body; every other call is
bound whole. A loop or branch (``scan``, ``while``, ``cond``) whose bodies
hold a routed call is rebuilt around its rewritten bodies
(``jaxmercury.flax.loops``), each body planned as a program of its own. A
mask's data parts (segment ids, mask arrays) are read from the program's
values and passed to the operator. The operators are differentiable, so
gradients flow through the rewritten program as through the original.

``plan(view, routing)`` decides for each match, in the program and in its
loops' bodies: routed with the schedule ``ops.choose`` picks for the
caller's layouts, or not, with the reason. A match nothing was measured for
(no stored winner for its sizes, none for the nearest sizes in its layouts)
is not routed: its equations run as traced, the call the user wrote,
reported "plain (not tuned)". With ``routing.tune``, ``tuned_plan`` first
tunes each distinct operator of the program once (same program, sizes and
layouts), in program order, within ``routing.time_budget_s``; one the
budget leaves out runs plain, and says so. ``explain`` reports it.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from jaxmercury import ops
from jaxmercury.analysis import packed
from jaxmercury.errors import ScheduleError
from jaxmercury.flax import loops, masks, patterns
from jaxmercury.flax.jaxpr_view import REMAT, DependsOnInputs, Lit, View, bind, inner, module_path, raised_at
from jaxmercury.flax.report import Entry, Report
from jaxmercury.flax.routes import DotGeneral, Routing
from jaxmercury.lowering import types
from jaxmercury.tuner import agree

_ROUTING = contextvars.ContextVar("jaxmercury_routing", default=False)
_CUSTOM = frozenset({"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"})


@dataclasses.dataclass(eq=False)
class Decision:
  """A match and what routing does with it."""

  match: patterns.Match
  entry: Entry
  operator: dict  # routed: the operator's keyword arguments (attention: the mask's)
  choice: ops.Choice | None = None  # what ops.choose picked (None: the match is not routable)
  program: object = None  # the operator's program
  layouts: tuple | None = None  # the caller's layouts of it (ops.caller_layouts)

  @property
  def key(self) -> tuple:
    """The operator it runs: one tune serves every match of the same key."""
    return self.program, str(self.layouts)


def _std_shape(shape, order, groups):
  """The shape of an operand moved to ``order`` and flattened by ``groups`` (an empty group: size 1)."""
  dims, out, k = [shape[d] for d in order], [], 0
  for n in groups:
    out.append(math.prod(dims[k:k + n]))
    k += n
  return tuple(out)


def _region(routing: Routing, operands) -> tuple[Routing, contextlib.AbstractContextManager]:
  """``(routing, context)`` for a match: where its operands' mesh has other axis types than ``routing.mesh`` (a
  call inside ``jax.sharding.auto_axes`` or ``explicit_axes``), the same devices with the region's types and that
  mesh as the context's; else ``routing`` as it is and no context."""
  for ref in operands:
    mesh = None if isinstance(ref, Lit) else getattr(getattr(View.aval(ref), "sharding", None), "mesh", None)
    if mesh is not None and not mesh.empty and tuple(mesh.axis_types) != tuple(routing.mesh.axis_types):
      retyped = jax.sharding.Mesh(routing.mesh.devices, routing.mesh.axis_names, axis_types=mesh.axis_types)
      return dataclasses.replace(routing, mesh=retyped), jax.sharding.use_abstract_mesh(retyped.abstract_mesh)
  return routing, contextlib.nullcontext()


def _decide(view, match, routing, scope: str = "", tuning=None) -> Decision:
  region, context = _region(routing, match.operands)
  with context:
    return _decide_in(view, match, region, scope, tuning)


def _decide_in(view, match, routing, scope: str, tuning) -> Decision:
  m = match
  common = dict(kind=m.kind, where=m.where, shapes=m.shapes, module=module_path(view, m.anchor) or scope)
  if m.kind == "attention":
    mask = m.mask.name if m.mask is not None else ""
    if m.layout:
      nb1, ng, nd = m.layout["groups"]
      q_shape, k_shape, v_shape = m.shapes
      q_std = _std_shape(q_shape, m.layout["q"], (1, 1, nb1 + ng, nd))
      k_std = _std_shape(k_shape, m.layout["k"], (1, 1, nb1, nd))
      common["shapes"] = (q_std, k_std, _std_shape(v_shape, m.layout["v"], (1, 1, nb1, 1)))
    reason = m.reason or _inside_custom(view, m) or _mask_scope(view, m) or (
        "" if routing.attention else "attention not routed (asked)")
    if reason:
      return Decision(m, Entry(**common, routed=False, schedule=None, reason=reason, mask=mask), {})
    operator = masks.route(m.mask)
  else:
    reason = m.reason or _inside_custom(view, m) or ("" if routing.matmul else "matmuls not routed (asked)")
    if not reason:
      mm, kk, nn = patterns.gemm_sizes(m)
      d = routing.devices
      if min(mm, kk, nn) == 0 or mm % d or kk % d or nn % d:
        reason = f"sizes m={mm} k={kk} n={nn} that the mesh's {d} devices do not divide"
    if reason:
      return Decision(m, Entry(**common, routed=False, schedule=None, reason=reason), {})
    operator = {}
    mask = ""
  program, layouts = _operator(view, m, operator, routing)
  decision = Decision(m, None, operator, program=program, layouts=layouts)
  tuning = tuning or Tuning()
  try:
    choice = tuning.choices.get(decision.key) or ops.choose(program, routing.mesh, layouts=layouts,
                                                            database=routing.database, **routing.options())
  except ScheduleError as e:
    decision.entry = Entry(**common, routed=False, schedule=None, reason=f"no schedule: {e}", mask=mask)
    return decision
  decision.choice = choice
  reason = tuning.reason(decision.key, choice)
  if choice.as_written:  # nothing measured, or nothing beat the call as written: its equations run as traced
    decision.entry = Entry(**common, routed=False, schedule=None, reason=reason, mask=mask, program=program)
  else:
    path = packed.data_path(choice.schedule)
    decision.entry = Entry(**common, routed=True, schedule=choice.name + (f" ({path})" if path else ""),
                           reason=reason, mask=mask, program=program)
  return decision


def _operator(view, m, operator, routing) -> tuple:
  """``(program, layouts)``: the operator a routable match runs and the caller's layouts of it
  (``ops.caller_layouts``; None on Auto mesh axes), found by tracing the rewrite's own steps (``_attention_args``,
  ``_gemm_args``) on the operands' types."""
  mesh = routing.mesh
  explicit = types.explicit(mesh)

  def abstract(ref):
    if isinstance(ref, Lit):
      return ref.value
    aval = View.aval(ref)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=getattr(aval, "sharding", None) if explicit else None)

  if m.kind == "matmul":
    mm, kk, nn = patterns.gemm_sizes(m)
    program = ops.matmul_program((mm, kk), (kk, nn), str(np.dtype(m.dtype)))
    if not explicit:
      return program, None
    params = m.anchor.eqn.params
    lhs, rhs = _abstract_eval(lambda a, b: _gemm_args(m, params, a, b)[:2], [abstract(r) for r in m.operands])
    dn, kwargs = _gemm_dims(m, params)
    return program, DotGeneral(routing).layouts(lhs, rhs, dn, **kwargs)
  found = {}

  def inputs(q, k, v, extras):
    args, kwargs = _attention_args(m, operator, mesh, q, k, v, extras)
    op = ops.attention_operands(*args, **kwargs)
    found["program"], found["expected"] = op.program, op.expected
    return op.inputs

  extras = [[abstract(r) for r in t.refs] for t in (m.mask.terms if m.mask else ())]
  traced = _abstract_eval(inputs, [*(abstract(r) for r in m.operands), extras])
  return found["program"], ops.caller_layouts(mesh, traced, found["expected"])


def _abstract_eval(fn, args):
  """``jax.eval_shape`` of ``fn(*args)``, ``args`` nesting ``ShapeDtypeStruct``s and constants (a mask's
  literal parts)."""
  leaves, tree = jax.tree.flatten(args)
  dynamic = [isinstance(x, jax.ShapeDtypeStruct) for x in leaves]

  def run(*xs):
    it = iter(xs)
    return fn(*jax.tree.unflatten(tree, [next(it) if d else x for x, d in zip(leaves, dynamic)]))

  return jax.eval_shape(run, *[x for x, d in zip(leaves, dynamic) if d])


def _inside_custom(view, m) -> str:
  """Why a match inside a custom-derivative function is left alone (its rule would no longer apply). JAX's cuDNN
  attention is itself the custom derivative around its primitive: the operator replaces both."""
  own = m.anchor.path[:-1] if m.anchor.primitive == patterns.CUDNN_ATTENTION else None
  for site in (m.anchor, *m.inner):
    for n in range(1, len(site.path)):
      if site.path[:n] == own:
        continue
      call = view.calls.get(site.path[:n])
      if call is not None and call.primitive in _CUSTOM:
        return f"inside a {call.primitive} (a custom derivative)"
  return ""


def _mask_scope(view, m) -> str:
  """Why a mask's arrays cannot be read where the operator runs: computed inside a checkpoint the attention is
  not inside (its values exist only in the checkpoint's own trace)."""
  for term in m.mask.terms if m.mask is not None else ():
    for ref in term.refs:
      scope = () if isinstance(ref, Lit) else ref[0]
      for n in range(1, len(scope) + 1):
        call = view.calls.get(scope[:n])
        if call is not None and call.primitive in REMAT and m.anchor.path[:n] != scope[:n]:
          return f"its {term.kind} mask is computed inside a checkpoint the attention is not in"
  return ""


@dataclasses.dataclass(eq=False)
class Plan:
  """What routing does with one program: its matches' decisions, and the plans of its loops' bodies.

  Attributes:
    view: the program.
    decisions: one per attention and contraction of the program itself.
    bodies: for each loop or branch equation (``scan``, ``while``, ``cond``) by ``id`` of its site, the
      ``(view, plan)`` of each of its bodies (``loops.bodies`` order).
  """

  view: View
  decisions: list
  bodies: dict

  @property
  def rewrites(self) -> bool:
    """Whether anything in the program or its bodies is routed."""
    return any(d.entry.routed for d in self.decisions) or any(
        p.rewrites for subs in self.bodies.values() for _, p in subs)

  def decisions_everywhere(self):
    """Its decisions and its loops' bodies', in program order."""
    for site in self.view.sites:
      yield from (d for d in self.decisions if d.match.anchor is site)
      for _, sub in self.bodies.get(id(site), ()):
        yield from sub.decisions_everywhere()

  def entries(self) -> list[Entry]:
    """The report's entries in program order, a loop's bodies' where the loop is."""
    at = {}
    for d in self.decisions:
      at.setdefault(id(d.match.anchor), []).append(d.entry)
    out = []
    for site in self.view.sites:
      out += at.get(id(site), [])
      for _, sub in self.bodies.get(id(site), ()):
        out += sub.entries()
    return out


def _known(view: View, site, invariant: dict) -> dict:
  """The values of a loop body's inputs known at trace time: its loop-invariant boolean and integer operands
  computed from no input of the program (a causal mask built outside a scan of layers)."""
  out = {}
  for i, j in invariant.items():
    ref = site.ins[j]
    aval = View.aval(ref)
    if aval.dtype != np.bool_ and not np.issubdtype(aval.dtype, np.integer):
      continue
    if math.prod(aval.shape) > masks.LARGEST_EVALUATED:
      continue
    try:
      out[i] = view.evaluate(ref, limit=masks.LARGEST_EVALUATED)
    except DependsOnInputs:
      pass
  return out


def plan(view: View, routing: Routing, depth: int = 0, tuning: Tuning | None = None, scope: str = "") -> Plan:
  """Each attention and contraction of ``view``'s program and of its loops' bodies, with what routing does
  with it (nothing is tuned here: ``tuning`` holds what ``tuned_plan`` tuned); ``scope``: the module path of the
  loop whose body ``view`` is."""
  bodies = {}
  if depth < 8:
    for site in view.sites:
      subs = loops.bodies(site.eqn)
      if subs:
        views = [View(b, _known(view, site, inv)) for b, inv in zip(subs, loops.invariants(site.eqn))]
        inner_scope = module_path(view, site) or scope
        bodies[id(site)] = [(v, plan(v, routing, depth + 1, tuning, inner_scope)) for v in views]
  return Plan(view, [_decide(view, m, routing, scope, tuning) for m in patterns.find(view)], bodies)


@dataclasses.dataclass
class Tuning:
  """What ``tuned_plan`` tuned: the choice per operator (``Decision.key``), and why the others were not tuned."""

  choices: dict = dataclasses.field(default_factory=dict)
  skipped: dict = dataclasses.field(default_factory=dict)

  def reason(self, key, choice: ops.Choice) -> str:
    """The report's reason for an operator's choice (``ops.Choice.reason``), with why it was not tuned."""
    why = self.skipped.get(key)
    if why is None:
      return choice.reason
    if choice.plain:
      return f"plain (not tuned: {why})"
    if choice.reason.endswith(")"):  # a plain winner's: "plain (...)"
      return f"{choice.reason[:-1]}; not tuned: {why})"
    return f"{choice.reason} (not tuned: {why})"


def _spent(started: float, budget: float) -> bool:
  """Whether ``budget`` seconds have passed since ``started``: process 0's answer under several processes, which
  tune in lockstep (one starting a tune the others skip would wait for them forever)."""
  return ops.outside_traces(lambda: agree.broadcast_json(time.perf_counter() - started >= budget))


def tuned_plan(view: View, routing: Routing) -> Plan:
  """``plan``, each distinct operator tuned first where ``routing.tune`` asks (``tune_operators``)."""
  first = plan(view, routing)
  if not routing.tune:
    return first
  return plan(view, routing, tuning=tune_operators(first, routing))


def tune_operators(program: Plan, routing: Routing) -> Tuning:
  """Tunes each distinct operator of ``program`` (same program, sizes and layouts: ``Decision.key``) that has no
  stored winner, once, in program order, logging ``operator i of n`` and its time; once
  ``routing.time_budget_s`` is spent no further tune starts (a tune under way finishes), and the operators left
  keep what ``ops.choose`` gives untuned (the plain program, or the nearest sizes' winner). Under several
  processes process 0's clock decides (``_spent``)."""
  options = routing.options()
  log = options.get("log", print)
  todo = {}
  for d in program.decisions_everywhere():
    if d.choice is not None and d.choice.origin in (ops.NEAREST, ops.PLAIN):
      todo.setdefault(d.key, d)
  out, budget, started = Tuning(), routing.time_budget_s, time.perf_counter()
  for i, (key, d) in enumerate(todo.items(), 1):
    shapes = " ".join("x".join(map(str, shape)) for shape in d.entry.shapes)
    what = f"operator {i} of {len(todo)}: {d.entry.kind} {shapes} at {d.entry.where}"
    if budget is not None and _spent(started, budget):
      out.skipped[key] = f"the time budget of {budget:g} s was spent"
      log(f"== {what}: not tuned, the time budget of {budget:g} s was spent; runs {d.choice.name}")
      continue
    log(f"== {what}")
    t0 = time.perf_counter()
    try:
      choice = ops.choose(d.program, routing.mesh, layouts=d.layouts, database=routing.database, tune=True,
                          **options)
    except ScheduleError as e:
      out.skipped[key] = f"its tune failed: {e}"
      log(f"== {what}: its tune failed ({e}); runs {d.choice.name}")
      continue
    out.choices[key] = choice
    log(f"== {what}: {choice.name}, {choice.reason}, in {time.perf_counter() - t0:.1f} s")
  if todo:
    log(f"== {len(out.choices)} of {len(todo)} operators tuned in {time.perf_counter() - started:.1f} s"
        + (f"; {len(out.skipped)} not tuned" if out.skipped else ""))
  return out


# ------------------------------------------------------------------ the operators on matched operands
def _to_std(x, order, groups, mesh):
  if tuple(order) != tuple(range(x.ndim)):
    x = jnp.transpose(x, order)
  groups, pos = list(groups), 0
  for i, n in enumerate(groups):
    if n == 0:
      x = jnp.expand_dims(x, pos)
      groups[i] = 1
    pos += groups[i]
  return types.flatten(x, mesh, groups)


def _canonical(x, dims, canon):
  """``x`` (its dims on the logits dims ``dims``) on the logits dims ``canon``, in that order, size 1 where it
  does not vary."""
  kept = [(p, d) for p, d in enumerate(dims) if x.shape[p] != 1]
  x = jnp.reshape(x, [x.shape[p] for p, _ in kept])
  order = sorted(range(len(kept)), key=lambda i: canon.index(kept[i][1]))
  if order != list(range(len(kept))):
    x = jnp.transpose(x, order)
  present = {d for _, d in kept}
  sizes = {d: x.shape[i] for i, d in enumerate(sorted(present, key=canon.index))}
  return jnp.reshape(x, [sizes.get(d, 1) for d in canon])


def _mask_arguments(m, vals) -> dict:
  """``ops.attention``'s segment-id and mask-array arguments from the values of the mask's terms."""
  lay, out, arrays = m.layout, {}, []
  shape, heads, roles = lay["logits"], lay["heads"], lay["roles"]
  b, i, j = (next(d for d, r in roles.items() if r == a) for a in ("b", "i", "j"))
  for term, xs in zip(m.mask.terms, vals):
    if term.kind == "segment_ids":
      for name, x, dims, seq in (("q", xs[0], term.dims[0], i), ("kv", xs[1], term.dims[1], j)):
        ids = _canonical(x, dims, [b, seq])
        out[f"{name}_segment_ids"] = jnp.broadcast_to(ids, (shape[b], shape[seq]))
    else:
      arrays.append(_canonical(xs[0] != 0 if term.nonzero else xs[0], term.dims[0], [b, *heads, i, j]))
  if arrays:
    axes = masks.mask_axes(m.mask, roles)
    full = functools.reduce(jnp.logical_and, arrays)
    if "h" in axes:
      full = jnp.broadcast_to(full, [full.shape[0], *(shape[h] for h in heads), *full.shape[-2:]])
    sizes = {"b": full.shape[0], "h": math.prod(full.shape[1:-2]), "i": full.shape[-2], "j": full.shape[-1]}
    out["mask"] = jnp.reshape(full, [sizes[a] for a in axes])
    out["mask_axes"] = axes
  return out


def _fill_empty_rows(out, mask: masks.MaskInfo, vs, arguments):
  """``out [b, s, h, dv]`` with each query that its mask array leaves no key given the mean of the values, as
  the traced program gives it: its softmax over a row of logits all set to the one fill weighs every key alike
  (a padded row past a sliding window's reach, say). The operators give such a row zeros."""
  array = arguments.get("mask")
  if array is None:
    return out
  axes = arguments["mask_axes"]
  s, t = out.shape[1], vs.shape[1]
  keep = jax.lax.expand_dims(array, [d for d, a in enumerate("bhij") if a not in axes])
  keep = keep & masks.kept_pairs(mask, s, t, xp=jnp)
  empty = jnp.moveaxis(~jnp.any(keep, axis=-1), 2, 1)[..., None]  # [b or 1, s, h or 1, 1]
  mean = jnp.mean(vs.astype(jnp.float32), axis=1, keepdims=True)  # [b, 1, kv heads, dv]
  mean = jnp.repeat(mean, out.shape[2] // vs.shape[2], axis=2).astype(out.dtype)
  return jnp.where(empty, mean, out)


def _attention_args(m, operator, mesh, q, k, v, extras) -> tuple:
  """``(args, kwargs)`` of ``ops.attention`` for a match's operands: q, k and v in the operator's layout (q scaled
  to the operator's scale), and the mask's keywords."""
  lay = m.layout
  nb1, ng, nd = lay["groups"]
  qs = _to_std(q, lay["q"], (1, 1, nb1 + ng, nd), mesh)
  ks = _to_std(k, lay["k"], (1, 1, nb1, nd), mesh)
  vs = _to_std(v, lay["v"], (1, 1, nb1, 1), mesh)
  factor = m.scale * math.sqrt(qs.shape[-1])
  if abs(factor - 1.0) > 1e-9:
    qs = (qs * jnp.asarray(factor, jnp.float32)).astype(qs.dtype)
  return (qs, ks, vs), {**operator, **_mask_arguments(m, extras)}


def _attention(d: Decision, routing: Routing, q, k, v, anchor_aval, extras=()):
  m, lay, mesh = d.match, d.match.layout, routing.mesh
  args, kwargs = _attention_args(m, d.operator, mesh, q, k, v, extras)
  out = ops.attention(*args, mesh=mesh, schedule=d.choice.schedule, **kwargs)
  out = _fill_empty_rows(out, m.mask, args[2], kwargs)
  heads = sum(lay["groups"][:2])
  q_order = lay["q"]
  head_sizes = [q.shape[a] for a in q_order[2:2 + heads]] or [1]
  shape = [q.shape[q_order[0]], q.shape[q_order[1]], *head_sizes, v.shape[lay["v"][-1]]]
  y = types.unflatten(out, mesh, shape, [1, 1, len(head_sizes), 1])
  if not heads:
    y = jnp.squeeze(y, 2)
  if tuple(lay["out"]) != tuple(range(y.ndim)):
    y = jnp.transpose(y, lay["out"])
  y = y.astype(anchor_aval.dtype)
  free = tuple(i for i, p in enumerate(lay["out"]) if p in (0, 1))
  return types.like(y, mesh, anchor_aval, free_dims=free)


def _gemm_args(m, params, lhs, rhs) -> tuple:
  """``(lhs, rhs, dimension_numbers, kwargs)``: a matched contraction as one ``[free, k] . [k, free]``
  ``dot_general`` (the operands transposed) and its keywords."""
  lay = m.layout
  if tuple(lay["lhs"]) != tuple(range(lhs.ndim)):
    lhs = jnp.transpose(lhs, lay["lhs"])
  if tuple(lay["rhs"]) != tuple(range(rhs.ndim)):
    rhs = jnp.transpose(rhs, lay["rhs"])
  return lhs, rhs, *_gemm_dims(m, params)


def _gemm_dims(m, params) -> tuple:
  """``(dimension_numbers, kwargs)`` of ``_gemm_args``'s ``dot_general``."""
  nl, k = m.layout["free"][0], m.layout["k"]
  dn = ((tuple(range(nl, nl + k)), tuple(range(k))), ((), ()))
  kwargs = dict(precision=params.get("precision"), preferred_element_type=params.get("preferred_element_type"))
  if params.get("out_sharding") is not None:
    kwargs["out_sharding"] = params["out_sharding"]
  return dn, kwargs


def _matmul(d: Decision, routing: Routing, lhs, rhs, params, anchor_aval):
  lhs, rhs, dn, kwargs = _gemm_args(d.match, params, lhs, rhs)
  y = DotGeneral(routing).route(lhs, rhs, dn, schedule=d.choice.schedule, **kwargs)
  # the traced result's sharding type (what the original equation gave; a traced call's shape may lack it)
  return types.like(y, routing.mesh, anchor_aval, free_dims=range(d.match.layout["free"][0]))


# ------------------------------------------------------------------ the interpreter
def evaluate(program: Plan, routing: Routing, args):
  """The planned program on ``args`` with the routed decisions' operators in place of their equations (and
  its loops rebuilt around their rewritten bodies)."""
  view = program.view
  routed = [d for d in program.decisions if d.entry.routed]
  anchors = {id(d.match.anchor): d for d in routed}
  skipped = {id(s) for d in routed for s in d.match.inner}
  opened = {s.path[:n] for d in routed for s in (d.match.anchor, *d.match.inner) for n in range(1, len(s.path))}
  opened |= {r[0][:n] for d in routed for r in _term_refs(d.match) for n in range(1, len(r[0]) + 1)}
  env = {}

  def read(ref):
    return ref.value if isinstance(ref, Lit) else env[ref]

  def write(refs, vals):
    for r, v in zip(refs, vals):
      if r is not None and not isinstance(r, Lit):
        env[r] = v

  def run(jaxpr, scope, consts):
    for v, c in zip(jaxpr.constvars, consts):
      env[(scope, v)] = c
    for i, eqn in enumerate(jaxpr.eqns):
      path = scope + (i,)
      site = view.by_path[path]
      if path in view.calls:
        if path in opened:
          body, body_consts = inner(eqn)
          if eqn.primitive.name in REMAT:
            write(site.outs, _remat(eqn, site, body, body_consts, path))
          else:
            run(body, path, body_consts)
          continue
        write(site.outs, bind(eqn, [read(r) for r in site.ins]))
      elif id(site) in skipped:
        continue
      elif id(site) in program.bodies and any(p.rewrites for _, p in program.bodies[id(site)]):
        run_body = [functools.partial(evaluate, p, routing) for _, p in program.bodies[id(site)]]
        write(site.outs, loops.rebuild(eqn, [read(r) for r in site.ins], run_body))
      elif id(site) in anchors:
        write(site.outs, [_routed(anchors[id(site)], site)])
      else:
        write(site.outs, bind(eqn, [read(r) for r in site.ins]))

  def _routed(d, site):
    region, context = _region(routing, d.match.operands)
    with context:
      vals = [types.cotangent_like(read(r), region.mesh) for r in d.match.operands]
      aval = View.aval(site.outs[0])
      if d.match.kind == "attention":
        extras = [[read(r) for r in t.refs] for t in (d.match.mask.terms if d.match.mask else ())]
        return _attention(d, region, *vals, aval, extras)
      return _matmul(d, region, *vals, site.params, aval)

  def _remat(eqn, site, body, body_consts, path):
    def rewritten(*vals):
      write(site.ins, vals)
      run(body, path, body_consts)
      return [read(r) for r in site.outs]
    return jax.checkpoint(rewritten, prevent_cse=eqn.params.get("prevent_cse", True),
                          policy=eqn.params.get("policy"))(*[read(r) for r in site.ins])

  write(view.inputs, args)
  run(view.closed.jaxpr, (), view.closed.consts)
  return [read(r) for r in view.outputs]


def _term_refs(m) -> list:
  """The program values a match's mask terms read (not literals)."""
  terms = m.mask.terms if m.kind == "attention" and m.mask is not None else ()
  return [r for t in terms for r in t.refs if not isinstance(r, Lit)]


# ------------------------------------------------------------------ tracing a function
def _split(args, kwargs):
  leaves, tree = jax.tree.flatten((args, kwargs))
  dynamic = [isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)) for x in leaves]
  return leaves, tree, dynamic


def trace(fn, args, kwargs):
  """``(view, call)``: ``fn``'s traced program at ``args``' shapes, and ``call(flat_args) -> result``'s pieces:
  the dynamic leaves and a function rebuilding the result from the program's outputs."""
  leaves, tree, dynamic = _split(args, kwargs)
  dyn = [x for x, d in zip(leaves, dynamic) if d]

  def flat(*xs):
    it = iter(xs)
    full = [next(it) if d else x for x, d in zip(leaves, dynamic)]
    a, k = jax.tree.unflatten(tree, full)
    return fn(*a, **k)

  token = _ROUTING.set(True)
  try:
    closed, shape = jax.make_jaxpr(flat, return_shape=True)(*dyn)
  finally:
    _ROUTING.reset(token)
  return View(closed), dyn, jax.tree.structure(shape)


def report(program: Plan) -> Report:
  return Report(program.entries())


def route(fn, routing: Routing):
  """``fn`` with its attention and GEMMs computed by jaxmercury operators on ``routing.mesh``."""

  @functools.wraps(fn)
  def routed(*args, **kwargs):
    if _ROUTING.get():  # inside another routed function's trace: that one routes
      return fn(*args, **kwargs)
    view, dyn, out_tree = trace(fn, args, kwargs)
    decisions = tuned_plan(view, routing)
    logging.info("jaxmercury routing of %s:\n%s", getattr(fn, "__qualname__", fn), report(decisions))
    token = _ROUTING.set(True)
    try:
      outs = evaluate(decisions, routing, dyn)
    finally:
      _ROUTING.reset(token)
    return jax.tree.unflatten(out_tree, outs)

  routed.jaxmercury_routing = routing
  routed.jaxmercury_original = fn
  return routed


CUDNN_UNTRACEABLE = (
    "jax.nn.dot_product_attention(implementation='cudnn') does not trace without cuDNN (JAX checks for it while "
    "tracing), so nothing of this program can be inspected here; on a machine with cuDNN the call is routed like "
    "implementation=None's")


def explain_function(fn, routing: Routing, args, kwargs) -> Report:
  try:
    view, _, _ = trace(fn, args, kwargs)
  except RuntimeError as e:
    if "cuDNN" not in str(e):
      raise
    return Report([Entry("attention", raised_at(e), (), False, None, CUDNN_UNTRACEABLE)])
  return report(tuned_plan(view, routing))
