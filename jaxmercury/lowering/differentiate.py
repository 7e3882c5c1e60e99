"""Training: a ``jax.custom_vjp`` whose backward is the schedule's dual.

For attention the forward keeps only ``o`` and the log-sum-exp, and the
backward runs on ``schedules.dual.backward_schedule`` (the same nest, its
blocks on cuDNN where the devices have it, whatever kernel ran the forward):
one fused kernel call per device where the schedule keeps each device's
attention whole (``local_backward``), and the dual schedules
(``schedules.dual``) otherwise, whose programs recompute probabilities block
by block: both in one nest, one backward block call per block pair
(``joint_backward``), where their kernels have a joint block. Programs without backward programs
are differentiated through their lowered ``shard_map`` program, whose
collectives JAX transposes into their duals (all-gather and reduce-scatter,
a ring and the reverse ring, all-to-all and all-to-all).
"""

from __future__ import annotations

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from jaxmercury.lowering.joint_backward import joint_backward
from jaxmercury.lowering.local_backward import local_backward
from jaxmercury.schedules.dual import attention_duals, backward_schedule, with_lse_schedule


def differentiable(schedule, forward, *, forward_with_lse=None):
  """``forward`` (the compiled schedule) with the dual backward attached where one exists.

  Args:
    schedule: the loop-nest schedule: its ``attention_with_lse`` dual keeps the
      forward's residuals, its ``backward_schedule``'s dual programs run the backward.
    forward: ``f(q, k, v, *extras) -> o`` (extras: a masked program's segment ids or mask array), run where
      nothing is differentiated.
    forward_with_lse: ``with_lse_schedule -> g(q, k, v, *extras) -> (o, lse)``: the
      forward that keeps the backward's residuals, built from the dual's
      ``attention_with_lse`` schedule (a fused kernel's, which returns the two
      apart); default that schedule compiled, its ``olse`` cut in two.
  """
  prog = schedule.program
  if prog.pattern != "attention" or prog.params.get("emit_lse"):
    return forward
  d = prog.params["head_dim"]
  # The dual schedules are built now, with the forward: differentiating builds nothing (their plans included).
  with_lse = with_lse_schedule(schedule)
  keep = forward_with_lse(with_lse) if forward_with_lse else _apart(with_lse.compile(differentiable=False), d)
  backward = backward_schedule(schedule)
  _, dq_s, dkv_s = attention_duals(backward, joint=True)
  pullback = _backward(backward, dq_s, dkv_s)

  @jax.custom_vjp
  def attention(q, k, v, *extras):  # extras: the mask's buffers (segment ids, a mask array): no gradients
    return forward(q, k, v, *extras)

  def fwd(q, k, v, *extras):
    o, lse = keep(q, k, v, *extras)
    o = o.astype(q.dtype)
    return o, (q, k, v, o, lse, extras)

  def bwd(residuals, do):
    q, k, v, o, lse, extras = residuals
    dq, dk, dv = pullback(q, k, v, o, do.astype(q.dtype), lse, *extras)
    return (like(dq, q), like(dk, k), like(dv, v)) + (None,) * len(extras)

  explicit = any(t == AxisType.Explicit for t in getattr(schedule.mesh, "axis_types", ()))

  def like(grad, primal):  # a cotangent has its primal's dtype and, with explicit axes, its sharding
    grad = grad.astype(primal.dtype)
    if not explicit:
      return grad
    sharding = jax.typeof(primal).sharding
    if sharding.mesh.empty:  # a primal of no mesh (made outside jax.set_mesh): its cotangent replicated on ours
      sharding = NamedSharding(schedule.mesh, PartitionSpec())
    return jax.sharding.reshard(grad, sharding)

  attention.defvjp(fwd, bwd)
  return jax.jit(attention)


def _apart(olse_of, d: int):
  """``olse_of``'s output ``[..., d + 1]`` (``attention_with_lse``'s) as ``(o [..., d], lse [...])``."""
  def run(*args):
    y = olse_of(*args)
    return y[..., :d], y[..., d]
  return run


def _backward(schedule, dq_s, dkv_s):
  """``(q, k, v, o, do, lse, *extras) -> (dq, dk, dv)``: one fused call per device (``local_backward``), else the dual
  programs in one nest (``joint_backward``), else the two dual programs one after the other."""
  fused = local_backward(schedule)
  if fused is not None:
    return fused
  joint = joint_backward(dq_s, dkv_s)
  if joint is not None:
    def both(*args):
      dq, dkv = joint(*args)
      return dq, dkv[..., 0, :], dkv[..., 1, :]
    return both
  _, dq_s, dkv_s = attention_duals(schedule)  # each tiled to its own workspace
  f_dq, f_dkv = dq_s.compile(), dkv_s.compile()

  def apart(*args):
    dkv = f_dkv(*args)
    return f_dq(*args), dkv[..., 0, :], dkv[..., 1, :]
  return apart
