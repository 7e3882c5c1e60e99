"""``distribute``: route a Flax NNX module's attention and linear layers through jaxmercury.

Applied to a module instance it rewires the instance (and every submodule)
in place; applied to a module class it returns a subclass whose instances are
rewired as they are built. Only static attributes change (``attention_fn``,
``dot_general``): the parameters, their values and the state pytree stay
what they were, and so do the results, up to floating-point rounding.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxmercury.flax.routes import AttentionFn, DotGeneral, MoeFn, Routing

LINEAR_TYPES = (nnx.Linear, nnx.LinearGeneral)


def distribute(target: Any = None, /, *, mesh, database=None, tune: bool = False, attention: bool = True,
               linear: bool = True, moe: bool = True, **tune_options):
  """Runs a Flax NNX module's attention and linear layers as jaxmercury operators on ``mesh``.

  Every submodule with an ``attention_fn`` attribute (``nnx.MultiHeadAttention``
  and modules that follow its convention, such as ``models.llama.Attention``)
  gets a ``jaxmercury.flax.AttentionFn``; every ``nnx.Linear`` and
  ``nnx.LinearGeneral`` without a ``dot_general_cls`` gets a
  ``jaxmercury.flax.DotGeneral``. Each operator uses the schedule stored in the
  tuning database for its shapes and mesh; on a miss it is tuned when
  ``tune`` is set (and the winner stored), else the winner tuned for the
  nearest other sizes runs (``Database.nearest``), else a library default. Calls
  an operator does not cover (masks, dropout, shapes the mesh does not
  divide) run the original function. Every submodule with a ``moe_fn``
  attribute (a mixture-of-experts layer such as ``models.mixtral.MoE``) gets
  a ``jaxmercury.flax.MoeFn``: its experts run as ``jaxmercury.ops.moe``
  (expert parallel, tokens exchanged by a routed all-to-all).

  Usage::

    model = jaxmercury.distribute(Llama(config, rngs=rngs), mesh=mesh)

    @jaxmercury.distribute(mesh=mesh, tune=True, training=True)
    class Model(nnx.Module): ...

  Args:
    target: a module instance or class; omitted, a decorator is returned.
    mesh: the device mesh (build it with ``axis_types``).
    database: a ``jaxmercury.Database``; None for the default file.
    tune: tune operators missing from the database.
    attention: route attention.
    linear: route linear layers.
    moe: route mixture-of-experts layers (``moe_fn``).
    **tune_options: passed to ``jaxmercury.autotune`` when tuning;
      ``training=True`` (for a model being trained) uses, and tunes, the
      schedules of the fastest training step rather than of the forward.

  Returns:
    The rewired instance, the rewiring subclass, or a decorator.
  """
  routing = Routing(mesh, database, tune, tuple(sorted(tune_options.items())))

  def apply(obj):
    if isinstance(obj, type):
      if not issubclass(obj, nnx.Module):
        raise TypeError(f"distribute: {obj.__name__} is not a flax.nnx.Module subclass")
      return _subclass(obj, routing, attention, linear, moe)
    if not isinstance(obj, nnx.Module):
      raise TypeError(f"distribute: expected a flax.nnx.Module or Module class, got {type(obj).__name__} "
                      "(for Linen, pass jaxmercury.flax.DotGeneral and AttentionFn as the layers' dot_general and "
                      "attention_fn)")
    rewire(obj, routing, attention=attention, linear=linear, moe=moe)
    return obj

  return apply if target is None else apply(target)


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


def _subclass(cls, routing, attention, linear, moe=True):
  original_init = cls.__init__

  @functools.wraps(original_init)
  def __init__(self, *args, **kwargs):
    original_init(self, *args, **kwargs)
    rewire(self, routing, attention=attention, linear=linear, moe=moe)

  distributed = type(cls.__name__, (cls,), {
      "__init__": __init__, "__module__": cls.__module__, "__qualname__": cls.__qualname__,
      "__doc__": cls.__doc__, "jaxmercury_routing": routing})
  return distributed


def replicate_state(module, mesh):
  """Places every array of ``module``'s state replicated on ``mesh``, in place; returns the module.

  Arrays created on one device are otherwise moved on the first jitted
  call, and the call after it sees new input shardings and compiles again.
  """
  state = nnx.state(module)
  nnx.update(module, jax.device_put(state, NamedSharding(mesh, PartitionSpec())))
  return module
