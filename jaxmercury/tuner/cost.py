"""An analytic cost model: a schedule's time from machine figures.

Per device: compute time is the flops its blocks do over the rate of the
local kernel (measured by ``calibrate``);
each collective moves bytes over the link bandwidth of its mesh level plus a
fixed latency; ring transfers overlap the compute of the step they precede,
so a ring costs the larger of the two plus the part of the smaller that the
machine does not hide (``overlap``). Gathers, all-to-alls and reductions
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
    flops_per_s: one device's default compute rate.
    link_bytes_per_s: per mesh level, bytes one device sends per second;
      ``"*"`` is the default for levels not named.
    latency_s: fixed cost of one collective or ring step.
    kernel_flops_per_s: per local kernel name, its measured rate on the
      program's blocks (overrides ``flops_per_s``).
    gather_factor: time of an all-gather or all-to-all relative to moving
      the same bytes point to point.
    call_overhead_s: fixed cost of one body call (one block of a serial loop).
    overlap: the share of a ring transfer that hides under the compute
      beside it (1: all of it).
    memory_bytes_per_s: device memory bandwidth, for combining partial
      results between blocks.
  """

  name: str
  flops_per_s: float
  link_bytes_per_s: dict
  latency_s: float = 20e-6
  kernel_flops_per_s: dict = dataclasses.field(default_factory=dict)
  gather_factor: float = 1.0
  call_overhead_s: float = 10e-6
  overlap: float = 1.0
  memory_bytes_per_s: float = 2e12

  def bandwidth(self, level: str) -> float:
    return self.link_bytes_per_s.get(level, self.link_bytes_per_s["*"])

  def rate(self, kernel: str) -> float:
    """A kernel's measured rate; a variant (``name[p=v]``) not measured takes its kernel's."""
    base = self.kernel_flops_per_s.get(kernel.partition("[")[0], self.flops_per_s)
    return self.kernel_flops_per_s.get(kernel, base)

  def with_links(self, **levels: float) -> "Machine":
    """The same machine with other per-level bandwidths (to plan larger meshes)."""
    return dataclasses.replace(self, link_bytes_per_s={**self.link_bytes_per_s, **levels})

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, data: dict) -> "Machine":
    return cls(**data)


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
  calls = math.prod(lp.extent for lp in schedule.loops if lp.role == "serial")
  compute = prog.flops / parallel / machine.rate(schedule.kernel or "xla") + calls * machine.call_overhead_s
  if calls > 1:  # each block's partial state is combined with, or placed into, the accumulated one
    compute += calls * 3 * _state_block_bytes(schedule) / machine.memory_bytes_per_s
  exposed = 0.0
  for b in prog.reads:
    layout = [list(e) for e in plan.storage[b.name]]
    for st in reshard.steps(plan.storage[b.name], plan.resident[b.name]):
      nbytes = local_elements(schedule, b, layout) * b.dtype.itemsize
      exposed += machine.gather_factor * _collective_bytes(st.op, nbytes, levels[st.level]) / machine.bandwidth(st.level)
      exposed += machine.latency_s if st.op != reshard.SLICE else 0.0
      _apply(layout, st)
  out = prog.writes
  state_bytes = 4 * local_elements(schedule, out, plan.resident[out.name]) * len(prog.state_axes())
  for red in plan.reductions:
    n = levels[red.level]
    exposed += machine.gather_factor * 2 * state_bytes * (n - 1) / n / machine.bandwidth(red.level)
    exposed += machine.latency_s
  layout = [list(e) for e in plan.result]
  for st in reshard.steps(plan.result, plan.storage[out.name]):
    nbytes = local_elements(schedule, out, layout) * out.dtype.itemsize
    exposed += machine.gather_factor * _collective_bytes(st.op, nbytes, levels[st.level]) / machine.bandwidth(st.level)
    _apply(layout, st)
  ring = 0.0
  for r in plan.rings.values():
    nbytes = sum(local_elements(schedule, prog.buffer(b), plan.resident[b]) * prog.buffer(b).dtype.itemsize
                 for b in r.buffers)
    if r.travel:
      nbytes += state_bytes
    ring += (r.size - 1) * (nbytes / machine.bandwidth(r.level) + machine.latency_s)
  return exposed + max(compute, ring) + (1.0 - machine.overlap) * min(compute, ring)


def _state_block_bytes(schedule) -> int:
  from jaxmercury.tuner.memory import block_sizes
  prog, sizes = schedule.program, block_sizes(schedule)
  return sum(4 * math.prod(sizes[a] for a in leaf) for leaf in prog.state_axes())


def _apply(layout, st):
  if st.op == reshard.ALL_GATHER:
    layout[st.dim].pop()
  elif st.op == reshard.ALL_TO_ALL:
    layout[st.dim].pop()
    layout[st.to_dim].append(st.level)
  else:
    layout[st.dim].append(st.level)
