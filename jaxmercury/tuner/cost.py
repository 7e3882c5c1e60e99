"""An analytic cost model: a schedule's time from machine figures.

Per device: compute time is the flops its blocks do over the matrix rate;
each collective moves bytes over the link bandwidth of its mesh level plus a
fixed latency; ring transfers overlap the compute of the step they precede,
so a ring costs the larger of the two. Gathers, all-to-alls and reductions
before and after the nest do not overlap.
"""

from __future__ import annotations

import dataclasses
import math

from jaxmercury.shard_map import reshard
from jaxmercury.shard_map.plan import make_plan
from jaxmercury.tuner.memory import local_elements


@dataclasses.dataclass(frozen=True)
class Machine:
  """Measured or assumed figures of one machine.

  Attributes:
    name: a label.
    flops_per_s: one device's matrix rate.
    link_bytes_per_s: per mesh level, bytes one device sends per second;
      ``"*"`` is the default for levels not named.
    latency_s: fixed cost of one collective or ring step.
  """

  name: str
  flops_per_s: float
  link_bytes_per_s: dict
  latency_s: float = 20e-6

  def bandwidth(self, level: str) -> float:
    return self.link_bytes_per_s.get(level, self.link_bytes_per_s["*"])


# Figures from ../shared/REFERENCE.md (2 x H200, NVLink, jax 0.11.2) and a rough CPU.
H200_NVLINK = Machine("2xH200 NVLink", 600e12, {"*": 150e9}, 20e-6)
CPU_SIMULATED = Machine("simulated CPU mesh", 20e9, {"*": 5e9}, 50e-6)


def _collective_bytes(op: str, local_bytes: int, n: int) -> float:
  if op == reshard.ALL_GATHER:
    return local_bytes * (n - 1)
  if op == reshard.ALL_TO_ALL:
    return local_bytes * (n - 1) / n
  return 0.0  # a local slice


def predict(schedule, machine: Machine) -> float:
  """Predicted seconds for one call of the schedule on ``machine``."""
  prog, plan = schedule.program, make_plan(schedule)
  levels = schedule.levels
  parallel = math.prod(levels[lp.level] for lp in schedule.loops if lp.role == "parallel")
  compute = prog.flops / parallel / machine.flops_per_s
  exposed = 0.0
  for b in prog.reads:
    layout = [list(e) for e in plan.storage[b.name]]
    for st in reshard.steps(plan.storage[b.name], plan.resident[b.name]):
      nbytes = local_elements(schedule, b, layout) * b.dtype.itemsize
      exposed += _collective_bytes(st.op, nbytes, levels[st.level]) / machine.bandwidth(st.level)
      exposed += machine.latency_s if st.op != reshard.SLICE else 0.0
      _apply(layout, st)
  out = prog.writes
  state_bytes = 4 * local_elements(schedule, out, plan.resident[out.name]) * (
      1 if prog.reduction is None else len(prog.reduction.state_axes(out.axes)))
  for red in plan.reductions:
    n = levels[red.level]
    exposed += 2 * state_bytes * (n - 1) / n / machine.bandwidth(red.level) + machine.latency_s
  layout = [list(e) for e in plan.result]
  for st in reshard.steps(plan.result, plan.storage[out.name]):
    nbytes = local_elements(schedule, out, layout) * out.dtype.itemsize
    exposed += _collective_bytes(st.op, nbytes, levels[st.level]) / machine.bandwidth(st.level)
    _apply(layout, st)
  ring = 0.0
  for r in plan.rings.values():
    nbytes = sum(local_elements(schedule, prog.buffer(b), plan.resident[b]) * prog.buffer(b).dtype.itemsize
                 for b in r.buffers)
    if r.travel:
      nbytes += state_bytes
    ring += (r.size - 1) * (nbytes / machine.bandwidth(r.level) + machine.latency_s)
  return exposed + max(compute, ring)


def _apply(layout, st):
  if st.op == reshard.ALL_GATHER:
    layout[st.dim].pop()
  elif st.op == reshard.ALL_TO_ALL:
    layout[st.dim].pop()
    layout[st.to_dim].append(st.level)
  else:
    layout[st.dim].append(st.level)
