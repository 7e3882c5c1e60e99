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
kernel maps to its backward kernels (``BACKWARD_KERNELS``); on devices with
cuDNN the backward's blocks run cuDNN's whatever the forward's kernel
(``backward_schedule``).
"""

from __future__ import annotations

import math

from jax.sharding import PartitionSpec

from jaxmercury.errors import PreconditionError, ScheduleError
from jaxmercury.programs import attention_backward as ab
from jaxmercury.schedules.loops import SERIAL
from jaxmercury.schedules.schedule import Schedule
from jaxmercury.schedules.trace import replay

BUFFER_STEPS = ("shard", "replicate")
# Forward kernels and the kernels of their backward programs.
BACKWARD_KERNELS = {"dq": {"cudnn_attention": "cudnn_attention_dq", "mosaic_attention": "mosaic_attention_dq",
                           "pallas_attention": "pallas_attention_dq", "triton_attention": "pallas_attention_dq"},
                    "dkv": {"cudnn_attention": "cudnn_attention_dkv", "mosaic_attention": "mosaic_attention_dkv",
                            "pallas_attention": "pallas_attention_dkv", "triton_attention": "pallas_attention_dkv"}}
BACKWARD_BLOCKS = "cudnn_attention"  # the forward kernel whose backward kernels run every backward where they can


def backward_schedule(schedule: Schedule) -> Schedule:
  """The schedule whose dual programs run an attention schedule's backward: its blocks on cuDNN where they can be.

  The backward needs only the output and log-sum-exp the forward saved, not
  the kernel that computed them, so its blocks may run another kernel's
  backward. cuDNN's flash backward (``BACKWARD_BLOCKS``, one call returning
  dq, dk and dv) is the fastest we have: JAX's Mosaic dq and dk-dv kernels
  recompute the probabilities twice and have no causal mask. The result is
  ``schedule`` with its ``patch`` steps replaced by ``patch(BACKWARD_BLOCKS)``;
  where the mesh's devices, the dtype or the shapes rule cuDNN out (CPU,
  float32), ``schedule`` itself (its kernel's ``BACKWARD_KERNELS``, or XLA's
  body). Programs without backward programs (other patterns, attention
  emitting its log-sum-exp): ``schedule``.

  Preconditions: no fused lowering (``shard_map.fused.ordinary_schedule`` removes it).

  Before / after (a ``ring`` patched with ``mosaic_attention``, on GPUs)::

    parallel i0 in 8 @ x:                         parallel i0 in 8 @ x:
      for j0 in 8 (shift i0 @ x):                   for j0 in 8 (shift i0 @ x):
        mosaic_attention(o[i0], q[i0], k[j0], ..)     cudnn_attention(o[i0], q[i0], k[j0], ..)
  """
  prog = schedule.program
  if prog.pattern != "attention" or prog.params.get("emit_lse") or schedule.kernel == BACKWARD_BLOCKS:
    return schedule
  if schedule.lowering is not None:
    raise ScheduleError(f"{schedule.program.name}: lowered with {schedule.lowering!r}; take its ordinary schedule "
                        "(shard_map.fused.ordinary_schedule) first")
  unpatched = schedule.copy()
  unpatched.kernel = None
  unpatched.trace = [step for step in unpatched.trace if step["primitive"] != "patch"]
  try:
    return unpatched.patch(BACKWARD_BLOCKS)
  except PreconditionError:
    return schedule


def _full(spec, rank):
  entries = list(spec or PartitionSpec()) + [None] * rank
  return entries[:rank]


def _renamed(steps, names: dict, kernel: dict) -> list[dict]:
  """Steps with buffers renamed and kernels mapped (a kernel with no backward is dropped)."""
  out = []
  for step in steps:
    if step["primitive"] == "patch":
      name = step["args"][0].partition("[")[0]  # a tuned forward variant maps to the default backward
      if not kernel:
        out.append(step)
      elif name in kernel:
        out.append({**step, "args": [kernel[name]]})
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
      names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
      if size % math.prod(schedule.levels[n] for n in names):
        entries[dim] = None
    specs[b.name] = entries
  return specs


def fit_blocks(schedule: Schedule, budget_bytes: int) -> Schedule:
  """Tiles a schedule's innermost blocks into serial blocks until one body call's workspace fits."""
  from jaxmercury.pallas_kernels import registry
  from jaxmercury.tuner.memory import block_sizes
  prog = schedule.program
  kernel = registry.kernel(schedule.kernel or "xla")
  reductions = [a.name for a in prog.loops if prog.kinds[a.name] == "r"]
  spatial = [a.name for a in prog.loops if prog.kinds[a.name] == "s"]
  for axis in reductions + spatial:
    need = -(-kernel.workspace_bytes(prog, block_sizes(schedule)) // budget_bytes)
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
  q, k, v, o = (specs[n] for n in ("q", "k", "v", "o"))
  return replay(Schedule(ab.attention_with_lse(prog), schedule.mesh,
                         in_shardings=[PartitionSpec(*x) for x in (q, k, v)], out_sharding=PartitionSpec(*o)),
                _renamed(schedule.trace, {"q": ["q"], "k": ["k"], "v": ["v"], "o": ["olse"]}, kernel={}))


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
      two in one nest (``shard_map.joint_backward``): the extra tiles are
      the dq schedule's, replayed on the dk-dv one, and its serial loops
      are reordered to the dq schedule's order.
  """
  forward = with_lse_schedule(schedule)
  prog = schedule.program
  specs = _storage_specs(schedule)
  q, k, v, o = (specs[n] for n in ("q", "k", "v", "o"))
  rows = PartitionSpec(*o[:3])
  backward_ins = [PartitionSpec(*x) for x in (q, k, v, o, o)] + [rows]
  mesh, steps = schedule.mesh, schedule.trace
  companions = ["o", "do", "lse"]
  dq = replay(Schedule(ab.attention_dq(prog), mesh, in_shardings=backward_ins, out_sharding=PartitionSpec(*q)),
              _renamed(steps, {"q": ["q"], "k": ["k"], "v": ["v"], "o": companions + ["dq"]},
                       kernel=BACKWARD_KERNELS["dq"]))
  unfitted = len(dq.trace)
  dq = fit_blocks(dq, workspace_bytes)
  dkv = replay(Schedule(ab.attention_dkv(prog), mesh, in_shardings=backward_ins,
                        out_sharding=PartitionSpec(k[0], k[1], k[2], None, k[3])),
               _renamed(steps, {"q": ["q"], "k": ["k", "dkv"], "v": ["v", "dkv"], "o": companions},
                        kernel=BACKWARD_KERNELS["dkv"]))
  if not joint:
    return forward, dq, fit_blocks(dkv, workspace_bytes)
  replay(dkv, dq.trace[unfitted:])
  serial = [lp.name for lp in dq.loops if lp.role == SERIAL]
  if len(serial) > 1:
    dkv.reorder(*serial)
  return forward, dq, dkv
