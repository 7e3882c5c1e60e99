"""The backward of a fused ring attention: the dual programs of its loop-nest schedule, fed by the kernel.

A ring attention kernel (``kernels.attention.ring``, ``.ws_forward``) computes
device ``r``'s output block over every device's keys in one launch, K and V
travelling the ring inside it. It declares ``DualPrograms`` as its backward:
the dq and dk-dv programs of ``backward_schedule`` (the same layouts and
ring as a loop nest, cuDNN blocks on GPUs), fed by the kernel's own output
and log-sum-exp.
"""

from __future__ import annotations

import functools

import jax

from jaxmercury.lowering.differentiate import differentiable
from jaxmercury.lowering.lower import lower
from jaxmercury.schedules import dual


def backward_schedule(schedule):
  """The loop-nest schedule whose dual programs differentiate a fused ring attention.

  That is the schedule without its lowering (the same layouts and ring) with
  its blocks on cuDNN where the mesh's devices run it
  (``schedules.dual.backward_schedule``): the dq and dk-dv programs run cuDNN's
  flash backward blocks; elsewhere (CPU, interpret mode) XLA's body. A kernel
  configured with ``backward="ws_attention"`` runs ours instead
  (``schedules.dual.fused_loop_nest``).
  """
  return dual.backward_schedule(dual.fused_loop_nest(schedule))


def attach(schedule, per_device):
  """The fused forward with the dual backward of ``backward_schedule``, fed by the kernel's own residuals.

  The forward under differentiation runs the kernel once, keeping its output
  and log-sum-exp (``per_device(..., with_lse=True)`` lowered on the dual's
  ``attention_with_lse`` schedule, whose output ``olse`` holds both: they
  leave apart, as its parts, so the output stays in its dtype and is never
  packed into float32); the backward recomputes probabilities block by block
  from them. Nothing runs twice and no score matrix is kept.
  """
  forward = lower(schedule, jit=False, per_device=per_device)

  def keeping_residuals(with_lse):
    d = with_lse.program.params["head_dim"]
    parts = lower(with_lse, jit=False, per_device=functools.partial(per_device, with_lse=True), widths=(d, 1))

    def run(*inputs):
      o, lse = parts(*inputs)
      return o, lse[..., 0]
    return jax.jit(run)

  return differentiable(dual.fused_loop_nest(schedule), forward, forward_with_lse=keeping_residuals)
