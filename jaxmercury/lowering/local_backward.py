"""One fused backward kernel call per device, for attention that never leaves the device.

When a schedule splits attention over batch and heads only (no ring, no
cross-device reduction, no resharding of ``q``, ``k``, ``v`` or ``o``, and
every split axis splits all four alike; mesh levels of size 1 split
nothing, so any schedule on one device qualifies), each device's slice is a whole
attention problem of its own. Its backward is then one kernel call that
returns dq, dk and dv together, where the dual schedules (``schedules.dual``)
run a dq pass and a dk-dv pass that each recompute the probabilities.

The fused backward is the one the forward's kernel declares
(``AttentionBackward.whole``: cuDNN's flash backward from the saved output and
log-sum-exp; XLA's derivative of the plain attention, where its scores fit);
other kernels keep the dual schedules.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
from jax.sharding import PartitionSpec

from jaxmercury.kernels import registry
from jaxmercury.lowering import types
from jaxmercury.programs.masks import mask_of

BUFFERS = ("q", "k", "v", "o")


def _whole(schedule):
  """The per-device fused backward the schedule's kernel declares, and its limit (None where none)."""
  backward = registry.local(schedule.kernel or "xla").backward
  return (backward.whole, backward.whole_limit) if backward is not None and backward.whole else (None, None)


def _kept(layout, sizes) -> tuple:
  """``layout`` without its mesh levels of size 1, which split nothing."""
  return tuple(tuple(lv for lv in entry if sizes[lv] > 1) for entry in layout)


def _split_axes(plan, prog, sizes) -> dict | None:
  """``{axis: levels}`` of the axes the four buffers' layouts split, or None if they split them differently."""
  split = {}
  for name in BUFFERS:
    for axis, levels in zip(prog.buffer(name).axes, _kept(plan.storage[name], sizes)):
      if levels:
        if split.setdefault(axis, levels) != levels:
          return None
  return split


def local_reason(schedule) -> str | None:
  """Why the schedule's attention backward cannot run as one fused call per device (None: it can).

  Rings, reductions and layouts over mesh levels of size 1 move nothing: a
  ring on a one-device mesh is local attention.
  """
  prog = schedule.program
  whole, limit = _whole(schedule)
  if whole is None:
    return f"kernel {schedule.kernel or 'xla'!r} has no fused backward"
  if prog.params["causal"] and prog.buffer("q").shape[1] != prog.buffer("k").shape[1]:
    return "causal attention with queries and keys of different lengths"
  if (mask := mask_of(prog.params)).kinds - {"causal"}:
    return f"the fused backwards take a causal mask or none, not {mask.describe()}"
  plan, sizes = schedule.plan(), schedule.levels
  if any(r.size > 1 for r in plan.rings.values()) or any(sizes[r.level] > 1 for r in plan.reductions):
    return "blocks travel or reduce across devices"
  kept = lambda layout: _kept(layout, sizes)
  if (any(kept(plan.storage[b]) != kept(plan.resident[b]) for b in BUFFERS)
      or kept(plan.result) != kept(plan.storage["o"])):
    return "buffers are resharded around the loop nest"
  split = _split_axes(plan, prog, sizes)
  if split is None:
    return "buffers are split differently"
  common = set.intersection(*(set(prog.buffer(b).axes) for b in BUFFERS))
  if not set(split) <= common:
    return f"axes {sorted(set(split) - common)} split some buffers but not all"
  if any(plan.user_spec(b) is None for b in BUFFERS):
    return "a flattened dimension is split on its minor axis"
  if limit is not None:
    extents = {a: prog.axes[a].extent // math.prod(sizes[lv] for lv in split.get(a, ())) for a in prog.axes}
    return limit(prog, extents)
  return None


def local_backward(schedule) -> Callable | None:
  """``(q, k, v, o, do, lse) -> (dq, dk, dv)`` as one fused kernel call per device, or None.

  Arrays are in the caller's layouts: ``q``, ``o``, ``do`` [b, i, heads, d],
  ``k``, ``v`` [b, j, kv heads, d], ``lse`` [b, i, heads] (natural log).
  """
  if local_reason(schedule) is not None:
    return None
  plan, prog = schedule.plan(), schedule.program
  fused, _ = _whole(schedule)
  mode = registry.local(schedule.kernel or "xla").interprets(schedule.mesh)
  causal = prog.params["causal"]
  specs = {b: plan.user_spec(b) for b in BUFFERS}
  rows = PartitionSpec(*(list(specs["o"]) + [None] * 3)[:3])

  def per_device(q, k, v, o, do, lse):
    dq, dk, dv = fused(q, k, v, o, do, lse, causal, **mode)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)

  in_specs = (specs["q"], specs["k"], specs["v"], specs["o"], specs["o"], rows)
  mapped = jax.shard_map(per_device, mesh=schedule.mesh, in_specs=in_specs,
                         out_specs=(specs["q"], specs["k"], specs["v"]), check_vma=False)

  def run(*arrays):  # Explicit axes: each array's type must say its layout (a residual may be unsplit)
    return mapped(*(types.constrain(x, schedule.mesh, spec) for x, spec in zip(arrays, in_specs)))
  return run
