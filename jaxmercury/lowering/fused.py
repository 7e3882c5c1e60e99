"""Compiling a schedule lowered with a fused kernel: the kernel under the plan's ``shard_map``, with its backward.

The forward is the fused kernel's per-device function (``FusedKernel.make``
on the schedule's placement, ``analysis.placements``) in place of the loop
nest, inside the same wrapper as ``lower`` (padding, layouts, cropping).
Pallas kernels have no autodiff, so the kernel declares how its backward
runs, fed by the kernel's own residuals: ``DualGemm``, the dual fused GEMM
from the rows its ring gathered (``fused_gemm_backward``); ``DualPrograms``,
a ring attention's dual programs from its output and log-sum-exp
(``fused_attention``).
"""

from __future__ import annotations

from jaxmercury.analysis import placements
from jaxmercury.kernels import registry
from jaxmercury.kernels.registry import DualGemm, DualPrograms
from jaxmercury.lowering import fused_attention, fused_gemm_backward


def per_device(schedule, config=None):
  """The schedule's fused kernel on one device's blocks (``FusedKernel.make``), at ``config`` (default the
  schedule's)."""
  k = registry.fused(schedule.lowering)
  p = placements.of(schedule)
  config = schedule.lowering_config if config is None else config
  return k.make(p, config, placements.interprets(k, schedule))


def compile_fused(schedule):
  """``f(*inputs) -> output`` on global arrays: the fused kernel under the plan's ``shard_map``, with a backward."""
  placements.check(schedule)
  k = registry.fused(schedule.lowering)
  if isinstance(k.backward, DualGemm):
    return fused_gemm_backward.attach(schedule, per_device(schedule))
  if isinstance(k.backward, DualPrograms):
    return fused_attention.attach(schedule, per_device(schedule))
  raise TypeError(f"fused kernel {k.name!r}: unknown backward {k.backward!r}")
