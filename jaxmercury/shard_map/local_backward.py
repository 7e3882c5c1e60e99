"""One fused backward kernel call per device, for attention that never leaves the device.

When a schedule splits attention over batch and heads only (no ring, no
cross-device reduction, no resharding of ``q``, ``k``, ``v`` or ``o``, and
every split axis splits all four alike), each device's slice is a whole
attention problem of its own. Its backward is then one kernel call that
returns dq, dk and dv together, where the dual schedules (``schedules.dual``)
run a dq pass and a dk-dv pass that each recompute the probabilities.

Fused backward kernels, by the forward's kernel: ``cudnn_attention`` (cuDNN's
flash backward from the saved output and log-sum-exp) and ``xla`` (JAX's
derivative of the plain attention). Other kernels keep the dual schedules.
"""

from __future__ import annotations

from typing import Callable

import jax
from jax.sharding import PartitionSpec

from jaxmercury.pallas_kernels.cudnn_attention import cudnn_backward

BUFFERS = ("q", "k", "v", "o")


def _xla(q, k, v, o, do, lse, causal):
  del o, lse  # recomputed
  f = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")
  _, vjp = jax.vjp(f, q, k, v)
  return vjp(do.astype(q.dtype))


FUSED_BACKWARD = {"cudnn_attention": cudnn_backward, "xla": _xla}


def _split_axes(plan, prog) -> dict | None:
  """``{axis: levels}`` of the axes the four buffers' layouts split, or None if they split them differently."""
  split = {}
  for name in BUFFERS:
    for axis, levels in zip(prog.buffer(name).axes, plan.storage[name]):
      if levels:
        if split.setdefault(axis, levels) != levels:
          return None
  return split


def local_reason(schedule) -> str | None:
  """Why the schedule's attention backward cannot run as one fused call per device (None: it can)."""
  prog = schedule.program
  kernel = (schedule.kernel or "xla").partition("[")[0]
  if kernel not in FUSED_BACKWARD:
    return f"kernel {kernel!r} has no fused backward"
  if prog.params["causal"] and prog.buffer("q").shape[1] != prog.buffer("k").shape[1]:
    return "causal attention with queries and keys of different lengths"
  plan = schedule.plan()
  if plan.rings or plan.reductions:
    return "blocks travel or reduce across devices"
  if any(plan.storage[b] != plan.resident[b] for b in BUFFERS) or plan.result != plan.storage["o"]:
    return "buffers are resharded around the loop nest"
  split = _split_axes(plan, prog)
  if split is None:
    return "buffers are split differently"
  common = set.intersection(*(set(prog.buffer(b).axes) for b in BUFFERS))
  if not set(split) <= common:
    return f"axes {sorted(set(split) - common)} split some buffers but not all"
  if any(plan.user_spec(b) is None for b in BUFFERS):
    return "a flattened dimension is split on its minor axis"
  return None


def local_backward(schedule) -> Callable | None:
  """``(q, k, v, o, do, lse) -> (dq, dk, dv)`` as one fused kernel call per device, or None.

  Arrays are in the caller's layouts: ``q``, ``o``, ``do`` [b, i, heads, d],
  ``k``, ``v`` [b, j, kv heads, d], ``lse`` [b, i, heads] (natural log).
  """
  if local_reason(schedule) is not None:
    return None
  plan, prog = schedule.plan(), schedule.program
  fused = FUSED_BACKWARD[(schedule.kernel or "xla").partition("[")[0]]
  causal = prog.params["causal"]
  specs = {b: plan.user_spec(b) for b in BUFFERS}
  rows = PartitionSpec(*(list(specs["o"]) + [None] * 3)[:3])

  def per_device(q, k, v, o, do, lse):
    dq, dk, dv = fused(q, k, v, o, do, lse, causal)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)

  return jax.shard_map(per_device, mesh=schedule.mesh,
                       in_specs=(specs["q"], specs["k"], specs["v"], specs["o"], specs["o"], rows),
                       out_specs=(specs["q"], specs["k"], specs["v"]), check_vma=False)
