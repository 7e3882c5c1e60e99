"""Drop-in replacements for Flax's attention function and ``dot_general`` that run jaxmercury operators.

``AttentionFn`` has the signature of ``flax.nnx.dot_product_attention`` (what
``nnx.MultiHeadAttention(attention_fn=...)`` calls) and ``DotGeneral`` that of
``jax.lax.dot_general`` (what ``nnx.Linear(dot_general=...)`` calls). Each
runs ``jaxmercury.ops`` on its mesh when the call is one it covers and a
schedule was measured faster for it (``ops.choose``), and the function it
replaced otherwise, so results never change, only where and how they are
computed. Both are hashable values: Flax keeps them as static
attributes of the module.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxmercury import ops
from jaxmercury.lowering import types


@dataclasses.dataclass(frozen=True)
class Routing:
  """Where and how routed operators run.

  Attributes:
    mesh: the device mesh the operators are spread over.
    database: a ``jaxmercury.Database`` with tuned schedules; None for the
      default file (``jaxmercury.tuner.database.default_path()``).
    tune: on a database miss, tune the operator (and store the winner);
      otherwise use the nearest sizes' winner, else the call as written
      (``ops.choose``).
    tune_options: keyword arguments for ``jaxmercury.autotune``, as sorted
      (name, value) pairs.
    attention: route attention (``jaxmercury.distribute``'s rewriting).
    matmul: route GEMMs (``jaxmercury.distribute``'s rewriting).
    time_budget_s: with ``tune``, the seconds a traced program's tunes may
      take together (``jaxmercury.distribute``'s rewriting): no operator's
      tune starts once they are spent; None: no limit.
  """

  mesh: Any
  database: Any = None
  tune: bool = False
  tune_options: tuple = ()
  attention: bool = True
  matmul: bool = True
  time_budget_s: float | None = None

  @property
  def devices(self) -> int:
    return math.prod(self.mesh.shape.values())

  def options(self) -> dict:
    return dict(self.tune_options)


_FLAX_ATTENTION_ARGS = {"bias", "mask", "broadcast_dropout", "dropout_rng", "dropout_rate", "deterministic",
                        "dtype", "precision", "module", "is_causal", "promote_dtype"}
# Arguments Linen's attention passes too; covered only at these values (the plain softmax attention).
_DEFAULT_ONLY_ARGS = {"force_fp32_for_softmax": False, "einsum_dot_general": None, "qk_attn_weights_einsum": None,
                      "attn_weights_value_einsum": None}


@dataclasses.dataclass(frozen=True)
class AttentionFn:
  """``attention_fn(query, key, value, ...)`` through ``jaxmercury.ops.attention``.

  Covered: 4-D ``query [batch, q_len, heads, head_dim]`` and ``key``/``value``
  ``[batch, kv_len, kv_heads, head_dim]`` (``heads`` a multiple of
  ``kv_heads``), no ``bias`` or ``mask``, no dropout, no weights sown
  (``module`` None), the default ``precision``, floating dtypes;
  ``is_causal`` selects causal attention. Anything else goes to
  ``fallback``.

  Its signature is the fallback's: Linen's ``MultiHeadDotProductAttention``
  passes only the arguments its ``attention_fn``'s signature names, so the
  mask and dropout arguments reach this route (which then falls back)
  rather than being dropped. In Linen, pass it as the layer's
  ``attention_fn`` (``AttentionFn(Routing(mesh), nn.dot_product_attention)``).

  Attributes:
    routing: where the operator runs.
    fallback: the attention function replaced.
  """

  routing: Routing
  fallback: Callable

  @property
  def __signature__(self) -> inspect.Signature:
    return inspect.signature(self.fallback)

  def covers(self, query, key, value, kwargs) -> bool:
    if set(kwargs) - _FLAX_ATTENTION_ARGS - set(_DEFAULT_ONLY_ARGS):
      return False
    if any(kwargs.get(name, default) != default for name, default in _DEFAULT_ONLY_ARGS.items()):
      return False
    if kwargs.get("bias") is not None or kwargs.get("mask") is not None or kwargs.get("module") is not None:
      return False
    if not _default_precision(kwargs.get("precision")):
      return False
    rate = kwargs.get("dropout_rate", 0.0)
    if rate and not kwargs.get("deterministic", False):
      return False
    if query.ndim != 4 or key.ndim != 4 or value.shape != key.shape:
      return False
    b, _, h, d = query.shape
    return (key.shape[0] == b and key.shape[3] == d and key.shape[2] >= 1 and h % key.shape[2] == 0
            and all(jnp.issubdtype(x.dtype, jnp.floating) for x in (query, key, value)))

  def __call__(self, query, key, value, *args, **kwargs):
    if args or not self.covers(query, key, value, kwargs):
      return self.fallback(query, key, value, *args, **kwargs)
    expected = jax.eval_shape(functools.partial(self.fallback, query, key, value, **kwargs))
    q, k, v = _promote((query, key, value), kwargs.get("dtype"))
    r, causal = self.routing, bool(kwargs.get("is_causal", False))
    choice = ops.choose_for(ops.attention_operands(q, k, v, causal=causal), r.mesh, database=r.database,
                            tune=r.tune, **r.options())
    if choice.as_written:  # nothing measured, or nothing beat it: the call as written
      return self.fallback(query, key, value, **kwargs)
    out = ops.attention(q, k, v, mesh=r.mesh, causal=causal, schedule=choice.schedule)
    return types.like(out, r.mesh, expected, free_dims=(0, 1))  # batch and sequence follow the inputs


def _default_precision(precision) -> bool:
  """Whether ``precision`` (None, a name, a ``lax.Precision`` or a pair) asks for nothing beyond the default,
  which is what the routed operators compute at."""
  pair = precision if isinstance(precision, (tuple, list)) else (precision,)
  return all(p is None or jax.lax.Precision(p) == jax.lax.Precision.DEFAULT for p in pair)


def _promote(arrays, dtype):
  dtype = dtype if dtype is not None else jnp.result_type(*arrays)
  return tuple(jnp.asarray(x, dtype) for x in arrays)


@dataclasses.dataclass(frozen=True)
class DotGeneral:
  """``dot_general(lhs, rhs, dimension_numbers, ...)`` through ``jaxmercury.ops.matmul``.

  Covered: no batch dimensions; ``lhs`` contracts its trailing dimensions and
  ``rhs`` its leading ones, in the same order (what ``nnx.Linear`` and
  ``nnx.LinearGeneral`` do), so that the call is one GEMM ``[m, k] @ [k, n]``;
  equal floating dtypes; ``m``, ``k`` and ``n`` divide by the number of
  devices; the default ``precision``; no ``preferred_element_type`` other
  than the inputs' dtype (the operator's result has the inputs' dtype: a
  wider one would only be a rounded copy). Anything else goes to
  ``fallback``. The result has the sharding type the replaced call would
  give (on meshes of Explicit axes), a caller's ``out_sharding`` included. In
  Linen, pass it as ``nn.Dense(dot_general=DotGeneral(Routing(mesh)))``.

  Attributes:
    routing: where the operator runs.
    fallback: the dot_general replaced.
  """

  routing: Routing
  fallback: Callable = jax.lax.dot_general

  def gemm_shape(self, lhs, rhs, dimension_numbers) -> tuple[int, int, int] | None:
    """``(m, k, n)`` when the call is one GEMM this route covers, else None."""
    (lc, rc), (lb, rb) = dimension_numbers
    lc, rc = tuple(lc), tuple(rc)
    if lb or rb or not lc or len(lc) != len(rc):
      return None
    if lc != tuple(range(lhs.ndim - len(lc), lhs.ndim)) or rc != tuple(range(len(rc))):
      return None
    if [lhs.shape[d] for d in lc] != [rhs.shape[d] for d in rc]:
      return None
    k = math.prod(rhs.shape[:len(rc)])
    m = math.prod(lhs.shape[:lhs.ndim - len(lc)])
    n = math.prod(rhs.shape[len(rc):])
    if lhs.dtype != rhs.dtype or not jnp.issubdtype(lhs.dtype, jnp.floating):
      return None
    devices = self.routing.devices
    if min(m, n, k) == 0 or m % devices or n % devices or k % devices:
      return None
    return m, k, n

  def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
    return self.route(lhs, rhs, dimension_numbers, precision, preferred_element_type, **kwargs)

  def route(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, *, schedule=None,
            **kwargs):
    """The call, through ``ops`` where covered: by ``schedule`` (None: the one ``ops.choose`` picks for the
    caller's layouts, ``layouts``; the call itself where nothing measured beat it)."""
    plain = (not set(kwargs) - {"out_sharding"} and _default_precision(precision)
             and (preferred_element_type is None or np.dtype(preferred_element_type) == lhs.dtype))
    shape = self.gemm_shape(lhs, rhs, dimension_numbers) if plain else None
    options = dict(precision=precision, preferred_element_type=preferred_element_type, **kwargs)
    original = functools.partial(self.fallback, lhs, rhs, dimension_numbers, **options)
    if shape is None:
      return original()
    r = self.routing
    m, k, n = shape
    prog = ops.matmul_program((m, k), (k, n), str(lhs.dtype))
    if schedule is None:
      choice = ops.choose(prog, r.mesh, layouts=self.layouts(lhs, rhs, dimension_numbers, **options),
                          database=r.database, tune=r.tune, **r.options())
      if choice.as_written:  # nothing measured, or nothing beat it: the call as written
        return original()
      schedule = choice.schedule
    (lc, rc), _ = dimension_numbers
    batch, contracted = lhs.ndim - len(lc), len(rc)
    out_shape = lhs.shape[:batch] + rhs.shape[contracted:]
    lhs, rhs = types.cotangent_like(lhs, r.mesh), types.cotangent_like(rhs, r.mesh)  # gradients of the caller's types
    op = ops.prepare(prog, r.mesh, schedule=schedule)
    a = types.flatten(lhs, r.mesh, [batch, len(lc)], op.input_specs[0])
    b = types.flatten(rhs, r.mesh, [contracted, rhs.ndim - contracted], op.input_specs[1])
    y = types.unflatten(op.fn(a, b), r.mesh, out_shape, [batch, rhs.ndim - contracted], op.output_spec)
    return types.like(y, r.mesh, jax.eval_shape(original), free_dims=range(batch))

  def layouts(self, lhs, rhs, dimension_numbers, **kwargs) -> tuple | None:
    """The caller's layouts of the GEMM a covered call is (``ops.caller_layouts``: the operands and the result
    flattened to ``[m, k] . [k, n] -> [m, n]``, as ``route`` flattens them), from arrays or
    ``ShapeDtypeStruct``s; ``kwargs`` are the call's other arguments. None on Auto mesh axes."""
    mesh = self.routing.mesh
    if not types.explicit(mesh):
      return None
    (lc, rc), _ = dimension_numbers
    batch, contracted = lhs.ndim - len(lc), len(rc)

    def flat(lhs, rhs):
      a = types.flatten(lhs, mesh, [batch, len(lc)])
      b = types.flatten(rhs, mesh, [contracted, rhs.ndim - contracted])
      y = self.fallback(lhs, rhs, dimension_numbers, **kwargs)
      return a, b, types.flatten(y, mesh, [batch, rhs.ndim - contracted])

    a, b, y = jax.eval_shape(flat, lhs, rhs)
    return ops.caller_layouts(mesh, (a, b), y)


@dataclasses.dataclass(frozen=True)
class MoeFn:
  """``moe_fn(x, router, w_gate, w_up, w_down, *, top_k, capacity_factor=None)`` through ``jaxmercury.ops.moe``.

  The convention of a mixture-of-experts layer that keeps its expert computation in a ``moe_fn`` attribute
  (``models.mixtral.MoE``): ``x [..., d]`` (leading dimensions are tokens), ``router [d, experts]``,
  ``w_gate``/``w_up [experts, d, f]``, ``w_down [experts, f, d]``; the semantics of ``programs.moe``. Covered:
  one floating dtype for all five; anything else goes to ``fallback``.

  Attributes:
    routing: where the operator runs.
    fallback: the function replaced.
  """

  routing: Routing
  fallback: Callable

  def covers(self, x, router, w_gate, w_up, w_down) -> bool:
    arrays = (x, router, w_gate, w_up, w_down)
    if x.ndim < 2 or len({a.dtype for a in arrays}) != 1 or not jnp.issubdtype(x.dtype, jnp.floating):
      return False
    d, (experts, f) = x.shape[-1], (router.shape[-1], w_gate.shape[-1])
    return (router.shape == (d, experts) and w_gate.shape == (experts, d, f) and w_up.shape == w_gate.shape
            and w_down.shape == (experts, f, d) and math.prod(x.shape[:-1]) > 0)

  def __call__(self, x, router, w_gate, w_up, w_down, *, top_k, capacity_factor=None, **kwargs):
    if kwargs or not self.covers(x, router, w_gate, w_up, w_down):
      return self.fallback(x, router, w_gate, w_up, w_down, top_k=top_k, capacity_factor=capacity_factor, **kwargs)
    r = self.routing
    expected = jax.eval_shape(lambda a: a, x)
    x, router, w_gate, w_up, w_down = (types.cotangent_like(a, r.mesh) for a in (x, router, w_gate, w_up, w_down))
    flat = types.flatten(x, r.mesh, [x.ndim - 1, 1]) if x.ndim > 2 else x
    choice = ops.choose_for(ops.moe_operands(flat, router, w_gate, w_up, w_down, top_k=top_k,
                                             capacity_factor=capacity_factor),
                            r.mesh, database=r.database, tune=r.tune, **r.options())
    if choice.as_written:  # nothing measured, or nothing beat it: the call as written
      return self.fallback(x, router, w_gate, w_up, w_down, top_k=top_k, capacity_factor=capacity_factor)
    y = ops.moe(flat, router, w_gate, w_up, w_down, mesh=r.mesh, top_k=top_k, capacity_factor=capacity_factor,
                schedule=choice.schedule)
    y = types.unflatten(y, r.mesh, x.shape, [x.ndim - 1, 1]) if x.ndim > 2 else y
    return types.like(y, r.mesh, expected, free_dims=range(x.ndim - 1))
