"""A forward schedule's backward schedules: the same trace on the backward programs.

Replaying the forward's primitives on the programs of the backward pass gives
each communication its dual without writing it: a key block that travels a
ring forward has its gradient travel the ring back to its owner (a shifted
loop whose output is not indexed by the parallel loop), an all-gathered input
has its gradient reduce-scattered (``shard`` on the gradient of a parallel
reduction), an all-to-all is answered by an all-to-all (the layouts swap
roles). Buffer names map forward to backward: placements of an input apply to
that input and to its gradient; placements of the output apply to the
incoming cotangent and its companions (``o``, ``lse``). A patched forward
kernel maps to the backward block kernels it declares
(``kernels.registry.AttentionBackward``); on devices where a kernel declared
``everywhere`` runs (cuDNN), the backward's blocks run its kernels whatever
the forward's kernel (``backward_schedule``).
"""

from __future__ import annotations

import math

from jax.sharding import PartitionSpec

from jaxmercury.analysis.memory import block_sizes
from jaxmercury.errors import PreconditionError, ScheduleError
from jaxmercury.ir.loops import SERIAL, spec_levels
from jaxmercury.kernels import registry
from jaxmercury.programs import attention_backward as ab
from jaxmercury.schedules.schedule import Schedule
from jaxmercury.schedules.trace import replay

BUFFER_STEPS = ("shard", "replicate")


def backward_kernel(forward_kernel: str | None, part: str) -> str | None:
  """The block kernel of the ``part`` (``"dq"`` or ``"dkv"``) program that ``forward_kernel`` declares for its
  backward; None: the program's own body."""
  if forward_kernel is None:
    return None
  backward = registry.local(forward_kernel).backward
  block = getattr(backward, part) if backward is not None else None
  return block.name if block is not None else None


def backward_schedule(schedule: Schedule) -> Schedule:
  """The schedule whose dual programs run an attention schedule's backward: its blocks on cuDNN where they can be.

  The backward needs only the output and log-sum-exp the forward saved, not
  the kernel that computed them, so its blocks may run another kernel's
  backward. A kernel whose backward is declared ``own`` (ours, ``ws_attention``)
  keeps it: the schedule is returned as it is. Otherwise the kernel whose
  ``AttentionBackward`` is declared ``everywhere``
  (cuDNN's flash backward, one call returning dq, dk and dv) is the fastest we
  have: JAX's Mosaic dq and dk-dv kernels recompute the probabilities twice
  and have no causal mask. The result is ``schedule`` patched with that
  kernel instead of its own; where the mesh's devices, the dtype or the shapes
  rule it out (CPU, float32), ``schedule`` itself (its kernel's declared
  backward kernels, or XLA's body). Programs without backward programs (other
  patterns, attention emitting its log-sum-exp): ``schedule``.

  Preconditions: no fused lowering (``Schedule.without("lower_with")`` removes it).

  Before / after (a ``ring`` patched with ``mosaic_attention``, on GPUs)::

    parallel i0 in 8 @ x:                         parallel i0 in 8 @ x:
      for j0 in 8 (shift i0 @ x):                   for j0 in 8 (shift i0 @ x):
        mosaic_attention(o[i0], q[i0], k[j0], ..)     cudnn_attention(o[i0], q[i0], k[j0], ..)
  """
  prog = schedule.program
  everywhere = registry.everywhere_backward()
  if prog.pattern != "attention" or prog.params.get("emit_lse") or everywhere is None \
      or schedule.kernel == everywhere or _own_backward(schedule.kernel):
    return schedule
  if schedule.lowering is not None:
    raise ScheduleError(f"{schedule.program.name}: lowered with {schedule.lowering!r}; take its loop-nest schedule "
                        "(Schedule.without('lower_with')) first")
  if registry.local(everywhere).why_not(prog, schedule.mesh) is not None:
    return schedule
  try:
    return schedule.without("patch").patch(everywhere)
  except PreconditionError:
    return schedule


def fused_loop_nest(schedule: Schedule) -> Schedule:
  """A fused attention schedule's loop nest, whose dual programs run its backward: the schedule without its
  lowering, patched with the local kernel its configuration's ``backward`` field names (``"ws_attention"``: our
  one-pass backward kernel, an ``own`` backward that ``backward_schedule`` keeps); without one, as it is.

  Before / after (a ``ring`` lowered with ``fused_ring_attention_ws(backward='ws_attention')``)::

    lowered with fused_ring_attention_ws          parallel i0 in 8 @ x:
      (one kernel per device, the ring inside)      for j0 in 8 (shift i0 @ x):
                                                      ws_attention(o[i0], q[i0], k[j0], ..)
  """
  nest = schedule.without("lower_with")
  kernel = getattr(schedule.lowering_config, "backward", None)
  return nest if kernel is None else nest.without("patch").patch(kernel)


def _own_backward(kernel: str | None) -> bool:
  """Whether ``kernel`` declares its backward its own (``AttentionBackward.own``): kept, not cuDNN's."""
  backward = registry.local(kernel).backward if kernel is not None else None
  return backward is not None and backward.own


def _full(spec, rank):
  entries = list(spec or PartitionSpec()) + [None] * rank
  return entries[:rank]


def _renamed(steps, names: dict, part: str | None) -> list[dict]:
  """Steps with buffers renamed and patched kernels mapped to their ``part`` backward kernels (a kernel with no
  backward kernel is dropped: the program's own body); ``part`` None keeps them."""
  out = []
  for step in steps:
    if step["primitive"] == "patch":
      if part is None:
        out.append(step)
      elif (mapped := backward_kernel(step["args"][0], part)) is not None:
        out.append({"primitive": "patch", "args": [mapped], "kwargs": {}})  # its default configuration
      continue
    if step["primitive"] not in BUFFER_STEPS:
      out.append(step)
      continue
    for name in names.get(step["args"][0], ()):
      out.append({**step, "args": [name] + list(step["args"][1:])})
  return out


def _storage_specs(schedule):
  """Each buffer's stored layout over its own dims; dims it cannot split evenly (padded) left whole."""
  plan = schedule.plan()
  prog = schedule.program
  specs = {}
  for b in prog.reads + (prog.writes,):
    entries = _full(plan.user_spec(b.name), len(b.dims))
    for dim, (entry, size) in enumerate(zip(entries, b.shape)):
      names = spec_levels(entry)
      if size % math.prod(schedule.levels[n] for n in names):
        entries[dim] = None
    specs[b.name] = entries
  return specs


def fit_blocks(schedule: Schedule, budget_bytes: int) -> Schedule:
  """Tiles a schedule's innermost blocks into serial blocks until one body call's workspace fits."""
  prog = schedule.program
  kernel = registry.local(schedule.kernel or "xla")
  reductions = [a.name for a in prog.loops if prog.kinds[a.name] == "r"]
  spatial = [a.name for a in prog.loops if prog.kinds[a.name] == "s"]
  for axis in reductions + spatial:
    need = -(-kernel.workspace_bytes(prog, block_sizes(schedule), schedule.kernel_config) // budget_bytes)
    if need <= 1:
      break
    inner = schedule.loop(schedule.factors[axis][-1])
    if inner.role != "vector":
      continue
    factor = next((f for f in range(need, inner.extent + 1) if inner.extent % f == 0), inner.extent)
    if factor > 1:
      schedule.tile(inner.name, factor, names=(f"{inner.name}_bwd", f"{inner.name}_bwd_block"))
  return schedule


def with_lse_schedule(schedule) -> Schedule:
  """The forward that keeps the backward's residuals: ``schedule``'s trace replayed on ``attention_with_lse``
  (its output ``olse``, the output and log-sum-exp, stored as ``o``); the first of ``attention_duals``."""
  prog = schedule.program
  if prog.pattern != "attention" or prog.params.get("emit_lse"):
    raise ScheduleError(f"{prog.name}: no backward programs for pattern {prog.pattern!r}")
  specs = _storage_specs(schedule)
  extras = _extras(prog)
  return replay(Schedule(ab.attention_with_lse(prog), schedule.mesh,
                         in_shardings=[PartitionSpec(*specs[n]) for n in ("q", "k", "v", *extras)],
                         out_sharding=PartitionSpec(*specs["o"])),
                _renamed(schedule.trace, {"q": ["q"], "k": ["k"], "v": ["v"], "o": ["olse"],
                                          **{n: [n] for n in extras}}, part=None))


def _extras(prog) -> tuple[str, ...]:
  """The read buffers after q, k and v: the mask's (segment ids, a mask array)."""
  return tuple(b.name for b in prog.reads[3:])


def attention_duals(schedule, workspace_bytes: int = 4 << 30, *, joint: bool = False
                    ) -> tuple[Schedule, Schedule, Schedule]:
  """(forward with lse, dq, dk-dv) schedules of an attention schedule.

  The backward programs keep the forward's distribution and are tiled further
  into serial blocks where one block's recomputed scores would exceed
  ``workspace_bytes``.

  Args:
    schedule: the forward attention schedule.
    workspace_bytes: one block call's workspace budget.
    joint: make the dk-dv schedule walk the dq schedule's loops, to run the
      two in one nest (``lowering.joint_backward``): the extra tiles are
      the dq schedule's, replayed on the dk-dv one, and its serial loops
      are reordered to the dq schedule's order.
  """
  forward = with_lse_schedule(schedule)
  prog = schedule.program
  specs = _storage_specs(schedule)
  q, k, v, o = (specs[n] for n in ("q", "k", "v", "o"))
  extras = _extras(prog)
  rows = PartitionSpec(*o[:3])
  backward_ins = [PartitionSpec(*x) for x in (q, k, v, o, o)] + [rows] + [PartitionSpec(*specs[n]) for n in extras]
  mesh, steps = schedule.mesh, schedule.trace
  companions = ["o", "do", "lse"]
  same = {n: [n] for n in extras}
  dq = replay(Schedule(ab.attention_dq(prog), mesh, in_shardings=backward_ins, out_sharding=PartitionSpec(*q)),
              _renamed(steps, {"q": ["q"], "k": ["k"], "v": ["v"], "o": companions + ["dq"], **same}, part="dq"))
  unfitted = len(dq.trace)
  dq = fit_blocks(dq, workspace_bytes)
  dkv = replay(Schedule(ab.attention_dkv(prog), mesh, in_shardings=backward_ins,
                        out_sharding=PartitionSpec(k[0], k[1], k[2], None, k[3])),
               _renamed(steps, {"q": ["q"], "k": ["k", "dkv"], "v": ["v", "dkv"], "o": companions, **same},
                        part="dkv"))
  if not joint:
    return forward, dq, fit_blocks(dkv, workspace_bytes)
  replay(dkv, dq.trace[unfitted:])
  serial = [lp.name for lp in dq.loops if lp.role == SERIAL]
  if len(serial) > 1:
    dkv.reorder(*serial)
  return forward, dq, dkv
