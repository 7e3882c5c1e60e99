"""Mixture of experts: a SwiGLU expert FFN per expert, each token summed over the top-k experts its router picks.

For token ``t`` the router scores every expert, ``logits = x[t] @ router``
(float32); the ``top_k`` best experts are kept (ties to the lower expert
index, as ``jax.lax.top_k``) and weighted by the softmax of their logits:

  y[t] = sum over the kept e of g[t, e] * (silu(x[t] @ w_gate[e]) * (x[t] @ w_up[e])) @ w_down[e]

With a capacity, each expert keeps at most ``capacity`` assignments, taken in
token order (a lower token first; a token picks each expert at most once), and
a dropped assignment contributes zero (the other gates are not renormalized).

As a loop nest: ``t`` spatial, ``e`` (experts) and ``f`` (the FFN's hidden
width, through which the activation acts elementwise) sums; ``d`` (the model
width) and ``r`` (the router's expert column, every token scored against
every expert) are block axes. The body computes the dense form, every expert
of its block on every token of its block, masked by the routing; the
program's ``routing`` (``ir.routing.Routing``) lets a schedule compute only
the routed pairs and move only the routed rows (``Schedule.dispatch``).

The routing helpers here (``route``, ``kept``) are the one definition of the
routing that the body and the routed lowering (``lowering.routed``) share, so
both pick the same experts.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxmercury.errors import ProgramError
from jaxmercury.ir.dsl import Axis, grid, match_buffer
from jaxmercury.ir.reductions import Sum
from jaxmercury.ir.routing import Routing
from jaxmercury.programs.operator import DTYPE, Operator, Param


def expert_capacity(tokens: int, experts: int, top_k: int, capacity_factor: float | None) -> int | None:
  """``ceil(capacity_factor * tokens * top_k / experts)``: the assignments one expert keeps (None: dropless)."""
  if capacity_factor is None:
    return None
  return max(1, math.ceil(capacity_factor * tokens * top_k / experts))


def router_logits(x, router):
  """``x @ router`` in float32: every token's score for every expert."""
  return jnp.dot(x.astype(jnp.float32), router.astype(jnp.float32), preferred_element_type=jnp.float32)


def route(x, router, top_k: int):
  """``(experts [t, top_k] int32, gates [t, top_k] float32)``: each token's best experts, best first (ties to the
  lower index), and the softmax of their logits."""
  values, experts = jax.lax.top_k(router_logits(x, router), top_k)
  return experts.astype(jnp.int32), jax.nn.softmax(values, axis=-1)


def chosen(experts, valid, num_experts: int):
  """``[t, num_experts]`` int32: 1 where a valid token picked the expert."""
  hits = experts[:, :, None] == jnp.arange(num_experts, dtype=experts.dtype)
  return (jnp.any(hits, axis=1) & valid[:, None]).astype(jnp.int32)


def kept(experts, valid, capacity: int | None, num_experts: int, before=None):
  """``[t, top_k]`` bool: the assignments that survive the capacity (and belong to valid tokens).

  An assignment of token ``t`` to expert ``e`` is kept when fewer than
  ``capacity`` earlier tokens picked ``e``: the tokens before this block's
  first (``before [num_experts]``, default none) and the block's own.
  """
  keep = jnp.broadcast_to(valid[:, None], experts.shape)
  if capacity is None:
    return keep
  picks = chosen(experts, valid, num_experts)
  ahead = jnp.cumsum(picks, axis=0) - picks
  if before is not None:
    ahead = ahead + before[None, :]
  position = jnp.take_along_axis(ahead, experts, axis=1)
  return keep & (position < capacity)


def swiglu(a, b, dtype):
  """``silu(a) * b`` of float32 pre-activations, rounded to ``dtype`` for the down projection."""
  return (jax.nn.silu(a) * b).astype(dtype)


def moe_block(ctx, x, router, w_gate, w_up, w_down, *, top_k: int, capacity: int | None):
  """One block: the block's experts on the block's tokens, dense, masked by the routing (float32 ``[t, d]``).

  Args:
    ctx: the block's ``BlockContext`` (its expert offset, its valid tokens).
    x: [t, d] tokens.
    router: [d, r] the whole router (every expert's column).
    w_gate, w_up: [e, d, f] the block's experts.
    w_down: [e, f, d].
    top_k: experts per token.
    capacity: assignments per expert (None: dropless), counted from the block's first token: exact when the
      block holds every token, as in the reference; the routed lowering counts across blocks and devices.
  """
  experts, gates = route(x, router, top_k)
  keep = kept(experts, ctx.valid("t"), capacity, router.shape[1])
  weights = jnp.zeros((x.shape[0], router.shape[1]), jnp.float32)
  weights = weights.at[jnp.arange(x.shape[0])[:, None], experts].add(jnp.where(keep, gates, 0.0))
  block = w_gate.shape[0]
  weights = jax.lax.dynamic_slice_in_dim(jnp.pad(weights, ((0, 0), (0, block))), ctx.start("e"), block, axis=1)
  a = jnp.einsum("td,edf->etf", x, w_gate, preferred_element_type=jnp.float32)
  b = jnp.einsum("td,edf->etf", x, w_up, preferred_element_type=jnp.float32)
  out = jnp.einsum("etf,efd->etd", swiglu(a, b, x.dtype), w_down, preferred_element_type=jnp.float32)
  return jnp.einsum("te,etd->td", weights, out)


def einsum_dispatch(x, router, w_gate, w_up, w_down, *, top_k: int, capacity_factor: float | None = None):
  """A capacity-based einsum-dispatch MoE of ``x [..., d]`` (``programs.moe``'s semantics).

  Each (token, choice) assignment takes the next free slot of its expert in token order; the dispatch tensor
  ``[t, e, c]`` is one where a token sits in slot ``c`` of expert ``e``, and an assignment past the capacity
  gets no slot. Dropless (``capacity_factor`` None) gives every expert ``tokens`` slots.
  """
  shape = x.shape
  x = x.reshape(-1, shape[-1])
  tokens, experts = x.shape[0], router.shape[1]
  capacity = tokens if capacity_factor is None else min(tokens, math.ceil(capacity_factor * tokens * top_k / experts))
  logits = jnp.dot(x.astype(jnp.float32), router.astype(jnp.float32), preferred_element_type=jnp.float32)
  values, picked = jax.lax.top_k(logits, top_k)
  gates = jax.nn.softmax(values, axis=-1)
  choice = jax.nn.one_hot(picked, experts, dtype=jnp.int32)  # [t, k, e]
  per_token = jnp.sum(choice, axis=1)
  slot = jnp.cumsum(per_token, axis=0) - per_token  # [t, e]: earlier tokens that picked e
  position = jax.nn.one_hot(jnp.where(per_token > 0, slot, capacity), capacity, dtype=x.dtype)  # [t, e, c]
  dispatch = position * per_token[..., None].astype(x.dtype)
  weights = jnp.einsum("tk,tke->te", gates, choice.astype(jnp.float32))
  combine = weights[..., None] * dispatch.astype(jnp.float32)
  xe = jnp.einsum("tec,td->ecd", dispatch, x)
  a = jnp.einsum("ecd,edf->ecf", xe, w_gate, preferred_element_type=jnp.float32)
  b = jnp.einsum("ecd,edf->ecf", xe, w_up, preferred_element_type=jnp.float32)
  h = (jax.nn.silu(a) * b).astype(x.dtype)
  out = jnp.einsum("ecf,efd->ecd", h, w_down, preferred_element_type=jnp.float32)
  y = jnp.einsum("tec,ecd->td", combine, out)
  return y.astype(x.dtype).reshape(shape)


def _workspace(itemsize: int):
  def workspace(sizes):
    e, t, f, d = sizes["e"], sizes["t"], sizes["f"], sizes["d"]
    return e * t * (2 * 4 * f + itemsize * f + 4 * d)  # pre-activations, activation, expert outputs
  return workspace


def moe(tokens: int, d_model: int, d_ff: int, experts: int, top_k: int, *, capacity_factor: float | None = None,
        dtype=jnp.float32):
  """The mixture-of-experts program.

  Inputs, in order: ``x [tokens, d_model]``, ``router [d_model, experts]``,
  ``w_gate [experts, d_model, d_ff]``, ``w_up [experts, d_model, d_ff]``,
  ``w_down [experts, d_ff, d_model]``; output ``y [tokens, d_model]``.

  Args:
    tokens, d_model, d_ff, experts: sizes.
    top_k: experts each token keeps (1 <= top_k <= experts).
    capacity_factor: None for dropless; otherwise each expert keeps at most
      ``ceil(capacity_factor * tokens * top_k / experts)`` assignments in
      token order, and a dropped one contributes zero.
    dtype: the buffers' dtype.

  Raises:
    ProgramError: ``top_k`` outside ``[1, experts]``, or a non-positive capacity factor.
  """
  for name, value in (("tokens", tokens), ("d_model", d_model), ("d_ff", d_ff), ("experts", experts)):
    if not isinstance(value, (int, np.integer)) or value < 1:
      raise ProgramError(f"moe: {name} must be a positive int, got {value!r}")
  if not isinstance(top_k, (int, np.integer)) or not 1 <= top_k <= experts:
    raise ProgramError(f"moe: top_k={top_k!r} must be between 1 and experts={experts}: a token picks "
                       f"top_k distinct experts")
  if capacity_factor is not None and not (isinstance(capacity_factor, (int, float)) and capacity_factor > 0):
    raise ProgramError(f"moe: capacity_factor={capacity_factor!r} must be a positive number, or None (dropless)")
  capacity = expert_capacity(tokens, experts, top_k, capacity_factor)
  t, e, f = Axis("t", tokens), Axis("e", experts), Axis("f", d_ff)
  d, r = Axis("d", d_model), Axis("r", experts)
  x = match_buffer("x", (t, d), dtype)
  router = match_buffer("router", (d, r), dtype)
  w_gate = match_buffer("w_gate", (e, d, f), dtype)
  w_up = match_buffer("w_up", (e, d, f), dtype)
  w_down = match_buffer("w_down", (e, f, d), dtype)
  y = match_buffer("y", (t, d), dtype)
  routing = Routing(tokens="t", experts="e", router="router", routed=("x",), top_k=int(top_k), capacity=capacity)
  return grid((t, e, f), "srr", reads=(x, router, w_gate, w_up, w_down), writes=y,
              body=functools.partial(moe_block, top_k=int(top_k), capacity=capacity), reduction=Sum(),
              name="moe", pattern="moe", routing=routing,
              params=dict(tokens=tokens, d_model=d_model, d_ff=d_ff, experts=experts, top_k=int(top_k),
                          capacity_factor=capacity_factor, dtype=str(np.dtype(dtype))),
              flops=2.0 * tokens * d_model * experts + 6.0 * tokens * top_k * d_model * d_ff,
              workspace=_workspace(np.dtype(dtype).itemsize),
              statement=f"y[t] += g[t, e] * ffn_e(x[t]), e in top-{top_k}(x[t] . router)")


OPERATOR = Operator(
    name="moe", summary="a mixture-of-experts layer: SwiGLU experts, each token summed over its router's top-k",
    build=moe, params=(
        Param(name="tokens", default=512, minimum=1, help="tokens (batch times sequence)"),
        Param(name="d_model", default=64, minimum=1, help="model width"),
        Param(name="d_ff", default=128, minimum=1, help="each expert's hidden width"),
        Param(name="experts", default=8, minimum=1, help="experts"),
        Param(name="top_k", default=2, minimum=1, help="experts each token is routed to (1 to experts)"),
        Param(name="capacity_factor", default=None, kind=float,
              help="each expert keeps at most capacity_factor * tokens * top_k / experts assignments (default: "
                   "dropless)"),
        DTYPE))
