"""Lowering: schedules to ``jax.shard_map`` programs, fused kernels under the same wrapper, and their backward
passes.

``compile_schedule`` is the one entry point: ``Schedule.compile`` reaches it
through ``schedules.schedule.register_compiler``, called here, since this
layer sits above the schedules.
"""

from jaxmercury.lowering.differentiate import differentiable as with_backward
from jaxmercury.lowering.fused import compile_fused
from jaxmercury.lowering.lower import lower
from jaxmercury.lowering.routed import routed_per_device
from jaxmercury.schedules.schedule import register_compiler


def compile_schedule(schedule, *, differentiable: bool = True):
  """``f(*inputs) -> output``: the schedule's ``shard_map`` program (its fused kernel's, if lowered with one) and,
  where the program has backward programs and ``differentiable``, its dual backward (always for a fused kernel,
  which has no autodiff); a dispatched schedule's routed exchange (``lowering.routed``), differentiated by JAX."""
  if schedule.lowering is not None:
    return compile_fused(schedule)
  if schedule.dispatched is not None:  # the routed exchange; gradients: JAX's through it
    return lower(schedule, per_device=routed_per_device(schedule, schedule.plan()))
  forward = lower(schedule)
  return with_backward(schedule, forward) if differentiable else forward


register_compiler(compile_schedule)

__all__ = ["compile_schedule"]
