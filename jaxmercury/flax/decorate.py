"""``distribute`` and ``explain``: route a Flax NNX module's or a JAX function's attention and GEMMs through
jaxmercury operators, and report what was routed.

Applied to a function, ``distribute`` returns it routed (``rewrite.route``);
applied to a module class, a subclass whose ``__call__`` runs the class's own
``__call__`` as a function of the module's state (``nnx.split``/``merge``),
routed, and writes the state back; applied to an instance, a new instance of
that subclass holding the same variables (``nnx.merge`` of the instance's
``nnx.split``): training either trains both, and the instance given keeps
running as written. The parameters, their values and the state pytree stay
what they were, and so do the results, up to floating-point rounding.
``rewire`` installs the older hooks (``AttentionFn``, ``DotGeneral``) on a
module's attributes instead.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxmercury.flax import rewrite
from jaxmercury.flax.jaxpr_view import MODULE_SCOPE
from jaxmercury.flax.report import Report
from jaxmercury.flax.routes import AttentionFn, DotGeneral, MoeFn, Routing

LINEAR_TYPES = (nnx.Linear, nnx.LinearGeneral)


def distribute(target: Any = None, /, *, mesh, database=None, tune: bool = False, attention: bool = True,
               linear: bool = True, moe: bool = True, time_budget_s: float | None = None, **tune_options):
  """Runs the attention and GEMMs of a Flax NNX module or a JAX function as jaxmercury operators on ``mesh``.

  The target's program is traced (``jax.make_jaxpr``) at each call's shapes;
  in it, attention (``jax.nn.dot_product_attention``'s XLA computation,
  ``flax.nnx.dot_product_attention``, an einsum -> mask -> softmax -> einsum
  written out, with grouped key-value heads or not) and contractions shaped
  as one GEMM (``nnx.Linear``, ``nnx.LinearGeneral``, ``nnx.Einsum``,
  ``jnp.einsum``, ``@``, ``lax.dot_general`` without batch dims) are
  replaced by ``jaxmercury.ops`` operators, and the rest of the program runs
  as traced (``jaxmercury.flax.rewrite``). Each operator uses the schedule
  stored in the tuning database for its shapes, mesh and the caller's
  layouts; on a miss it is tuned when ``tune`` is set (and the winner
  stored: each distinct operator once, ``operator i of n`` logged with its
  time, all of them within ``time_budget_s``), else the winner tuned for the
  nearest other sizes in the same layouts runs (``Database.nearest``), else
  the call runs as written ("plain (not tuned)": the user's own program,
  partitioned by XLA). Masks reach the operator as its arguments: causal, sliding
  windows and bands; segment ids (an ``eq`` of integer arrays) as
  ``q_segment_ids``/``kv_segment_ids``; any other boolean computed from the
  inputs as ``mask`` (that array itself). Attention and GEMMs in the bodies
  of ``lax.scan`` (``nnx.scan``-ned layers), ``while_loop`` and ``cond`` are
  routed too, the loop rebuilt around its rewritten body. Calls an operator
  does not compute (a mask computed from the scores, a bias, dtypes, sizes
  the mesh does not divide) run as traced; which calls
  were routed, with which schedule, and why the others were not, is logged
  (absl, INFO) and returned by ``jaxmercury.explain``. Gradients flow
  through the operators' own backward. A module's submodules with a
  ``moe_fn`` attribute (a mixture-of-experts layer such as
  ``models.mixtral.MoE``) get a ``jaxmercury.flax.MoeFn``: their experts run
  as ``jaxmercury.ops.moe`` (expert parallel, tokens exchanged by a routed
  all-to-all).

  Usage::

    model = jaxmercury.distribute(Llama(config, rngs=rngs), mesh=mesh)  # a new module, the same variables

    @jaxmercury.distribute(mesh=mesh, tune=True, training=True)
    class Model(nnx.Module): ...

    @jaxmercury.distribute(mesh=mesh)
    def forward(params, tokens): ...

  Args:
    target: a module instance or class, or a function; omitted, a decorator is returned.
    mesh: the device mesh.
    database: a ``jaxmercury.Database``; None for the default file.
    tune: tune operators missing from the database.
    time_budget_s: with ``tune``, seconds for all of a traced program's tunes: no operator's tune starts once
      they are spent (one under way finishes); the operators left run plain (or the nearest sizes' winner), and
      the log and ``jaxmercury.explain`` say so. None: no limit.
    attention: route attention.
    linear: route GEMMs (linear layers, einsum projections).
    moe: route mixture-of-experts layers (``moe_fn``).
    **tune_options: passed to ``jaxmercury.autotune`` when tuning;
      ``training=True`` (for a model being trained) uses, and tunes, the
      schedules of the fastest training step rather than of the forward.

  Returns:
    For an instance, a new module routing its calls that shares the
    instance's variables (the instance itself is left as it was); for a
    class, a subclass whose instances route their calls; the routed
    function; or a decorator.
  """
  routing = Routing(mesh, database, tune, tuple(sorted(tune_options.items())), attention, linear, time_budget_s)

  def apply(obj):
    if isinstance(obj, type):
      if not issubclass(obj, nnx.Module):
        raise TypeError(f"distribute: {obj.__name__} is not a flax.nnx.Module subclass")
      return _subclass(obj, routing, moe)
    if isinstance(obj, nnx.Module):
      routed = nnx.merge(*nnx.split(obj))  # new modules, the same variables
      routed.__class__ = _subclass(getattr(type(obj), "jaxmercury_base", type(obj)), routing, moe)
      if moe:
        rewire(routed, routing, attention=False, linear=False, moe=True)
      return routed
    if callable(obj):
      return rewrite.route(getattr(obj, "jaxmercury_original", obj), routing)
    raise TypeError(f"distribute: expected a flax.nnx.Module, a Module class or a function, got "
                    f"{type(obj).__name__} (for Linen, pass jaxmercury.flax.DotGeneral and AttentionFn as the "
                    "layers' dot_general and attention_fn)")

  return apply if target is None else apply(target)


def _subclass(cls, routing: Routing, moe: bool = True):
  key = (cls, routing, moe)
  if key in _SUBCLASSES:
    return _SUBCLASSES[key]
  original_call, original_init = cls.__call__, cls.__init__

  @functools.wraps(original_init)
  def __init__(self, *args, **kwargs):
    original_init(self, *args, **kwargs)
    if moe:  # its MoE layers' hooks: the rewrite finds no MoE pattern in a traced program
      rewire(self, routing, attention=False, linear=False, moe=True)

  @functools.wraps(original_call)
  def __call__(self, *args, **kwargs):
    pure, state = _pure(self, cls)
    out, new_state = rewrite.route(pure, routing)(state, *args, **kwargs)
    nnx.update(self, new_state)
    return out

  distributed = type(cls.__name__, (cls,), {
      "__init__": __init__, "__call__": __call__, "__module__": cls.__module__, "__qualname__": cls.__qualname__,
      "__doc__": cls.__doc__, "jaxmercury_routing": routing, "jaxmercury_base": cls})
  _SUBCLASSES[key] = distributed
  return distributed


_SUBCLASSES: dict = {}


def _pure(module, cls):
  """``(pure, state)``: ``cls.__call__`` on ``module`` as a function of its state, and that state."""
  graphdef, state = nnx.split(module)

  def pure(state, *args, **kwargs):
    m = nnx.merge(graphdef, state)
    with _module_scopes(m):
      out = cls.__call__(m, *args, **kwargs)
    return out, nnx.state(m)

  pure.__qualname__ = f"{cls.__qualname__}.__call__"
  return pure, state


@contextlib.contextmanager
def _module_scopes(module):
  """While tracing ``module``: each submodule's ``__call__`` in a ``jax.named_scope`` naming its path in the module
  (``jaxpr_view.MODULE_SCOPE`` + ``layers.0.attn``), which the traced equations keep and ``explain`` reports.
  The classes' ``__call__`` are wrapped for that time only, and restored after."""
  paths = {id(m): ".".join(map(str, path)) for path, m in nnx.iter_modules(module) if path}
  classes = list(dict.fromkeys(type(m) for _, m in nnx.iter_modules(module)))
  own = {cls: cls.__dict__.get("__call__") for cls in classes}
  originals = {cls: next((c.__dict__["__call__"] for c in cls.__mro__ if "__call__" in c.__dict__), None)
               for cls in classes}

  def scoped(call):
    @functools.wraps(call)
    def wrapper(self, *args, **kwargs):
      path = paths.get(id(self))
      if path is None:
        return call(self, *args, **kwargs)
      with jax.named_scope(MODULE_SCOPE + path):
        return call(self, *args, **kwargs)
    return wrapper

  try:
    for cls, call in originals.items():
      if call is not None:
        cls.__call__ = scoped(call)
    yield
  finally:
    for cls, call in own.items():
      if call is None:
        if "__call__" in cls.__dict__:
          delattr(cls, "__call__")
      else:
        cls.__call__ = call


def explain(target, *args, mesh=None, database=None, tune: bool = False, **kwargs) -> Report:
  """What ``jaxmercury.distribute`` does with ``target`` called on ``args`` (and ``kwargs``).

  Args:
    target: a module instance or function, routed by ``distribute`` or not (then ``mesh`` is required).
    *args: example arguments (arrays or ``jax.ShapeDtypeStruct``s: nothing is computed).
    mesh, database, tune: the routing, for a target not routed by ``distribute`` (a routed one's is used).
    **kwargs: keyword arguments of the call.

  Returns:
    A ``Report``: one ``Entry`` per attention and contraction (kind, where, shapes, routed, schedule,
    reason); ``str()`` of it is a table.
  """
  routing = getattr(target, "jaxmercury_routing", None)
  if routing is None:
    if mesh is None:
      raise TypeError("explain: pass mesh= for a target that jaxmercury.distribute has not routed")
    routing = Routing(mesh, database, tune)
  if isinstance(target, type):
    raise TypeError(f"explain: pass an instance of {target.__name__}, not the class")
  if isinstance(target, nnx.Module):
    pure, state = _pure(target, getattr(type(target), "jaxmercury_base", type(target)))
    return rewrite.explain_function(pure, routing, (state, *args), kwargs)
  fn = getattr(target, "jaxmercury_original", target)
  return rewrite.explain_function(fn, routing, args, kwargs)


def rewire(module, routing: Routing, *, attention: bool = True, linear: bool = True, moe: bool = True) -> int:
  """Installs jaxmercury routes on ``module`` and its submodules, in place.

  A route already installed is replaced (its original is kept as fallback).

  Returns:
    The number of attributes replaced.
  """
  count = 0
  for _, sub in nnx.iter_modules(module):
    if attention and callable(getattr(sub, "attention_fn", None)):
      sub.attention_fn = AttentionFn(routing, _original(sub.attention_fn))
      count += 1
    if moe and callable(getattr(sub, "moe_fn", None)):
      sub.moe_fn = MoeFn(routing, _original(sub.moe_fn))
      count += 1
    if linear and isinstance(sub, LINEAR_TYPES) and getattr(sub, "dot_general_cls", None) is None:
      fallback = _original(sub.dot_general) if sub.dot_general is not None else None
      sub.dot_general = DotGeneral(routing, fallback) if fallback is not None else DotGeneral(routing)
      count += 1
  return count


def _original(fn):
  return fn.fallback if isinstance(fn, (AttentionFn, DotGeneral, MoeFn)) else fn


def replicate_state(module, mesh):
  """Places every array of ``module``'s state replicated on ``mesh``, in place; returns the module.

  Arrays created on one device are otherwise moved on the first jitted
  call, and the call after it sees new input shardings and compiles again.
  """
  state = nnx.state(module)
  nnx.update(module, jax.device_put(state, NamedSharding(mesh, PartitionSpec())))
  return module
