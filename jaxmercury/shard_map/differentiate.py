"""Training: a ``jax.custom_vjp`` whose backward is the schedule's dual.

For attention the forward keeps only ``o`` and the log-sum-exp; the backward
is one fused kernel call per device where the schedule keeps each device's
attention whole (``local_backward``), and the dual schedules
(``schedules.dual``) otherwise, whose programs recompute probabilities block
by block. Programs without backward programs
are differentiated through their lowered ``shard_map`` program, whose
collectives JAX transposes into their duals (all-gather and reduce-scatter,
a ring and the reverse ring, all-to-all and all-to-all).
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import AxisType

from jaxmercury.schedules.dual import attention_duals
from jaxmercury.shard_map.local_backward import local_backward


def differentiable(schedule, forward):
  """``forward`` (the compiled schedule) with the dual backward attached where one exists."""
  prog = schedule.program
  if prog.pattern != "attention" or prog.params.get("emit_lse"):
    return forward
  d = prog.params["head_dim"]

  @functools.cache
  def duals():  # built on the first differentiation, not for forward-only use
    with_lse, dq_s, dkv_s = attention_duals(schedule)
    fused = local_backward(schedule)
    backward = (fused,) if fused is not None else (dq_s.compile(), dkv_s.compile())
    return (with_lse.compile(differentiable=False), *backward)

  @jax.custom_vjp
  def attention(q, k, v):
    return forward(q, k, v)

  def fwd(q, k, v):
    y = duals()[0](q, k, v)
    o = y[..., :d].astype(q.dtype)
    return o, (q, k, v, o, y[..., d])

  def bwd(residuals, do):
    q, k, v, o, lse = residuals
    do = do.astype(q.dtype)
    _, *backward = duals()
    if len(backward) == 1:
      dq, dk, dv = backward[0](q, k, v, o, do, lse)
      return like(dq, q), like(dk, k), like(dv, v)
    f_dq, f_dkv = backward
    dq = f_dq(q, k, v, o, do, lse)
    dkv = f_dkv(q, k, v, o, do, lse)
    return like(dq, q), like(dkv[..., 0, :], k), like(dkv[..., 1, :], v)

  explicit = any(t == AxisType.Explicit for t in getattr(schedule.mesh, "axis_types", ()))

  def like(grad, primal):  # a cotangent has its primal's dtype and, with explicit axes, its sharding
    grad = grad.astype(primal.dtype)
    return jax.sharding.reshard(grad, jax.typeof(primal).sharding) if explicit else grad

  attention.defvjp(fwd, bwd)
  return jax.jit(attention)
