"""Static per-device memory estimate of a schedule, from its plan.

Counts what each device holds at once: every input's stored block and, when
the nest needs another layout, its gathered copy; a second block per ring
buffer (the one in flight); the output's float32 partial state and its stored
block; whole arrays put in or out of zigzag order; and the workspace of one
body call (the patched kernel's, else the program's). A fused lowering holds
its stored blocks, the A shards it receives and copies padded to its tiles. A dispatched schedule
(``Schedule.dispatch``) holds its stored blocks, its slot buffers and its grouped GEMM's activations
(``analysis.dispatch.memory_bytes``).
"""

from __future__ import annotations

import math

from jaxmercury.analysis import dispatch as dispatches
from jaxmercury.analysis import placements
from jaxmercury.ir.loops import VECTOR
from jaxmercury.kernels import registry


def local_elements(schedule, buf, layout) -> int:
  """Elements of one device's block of ``buf`` in ``layout``."""
  n = 1
  for a, extent, levels in zip(buf.axes, buf.canonical_shape, layout):
    extent = schedule.padded.get(a, extent)
    n *= extent // math.prod(schedule.levels[lv] for lv in levels)
  return n


def block_sizes(schedule) -> dict[str, int]:
  """Per axis, the extent one body call sees."""
  prog = schedule.program
  sizes = {a: ax.extent for a, ax in prog.axes.items()}
  for a, names in schedule.factors.items():
    sizes[a] = math.prod(schedule.loop(n).extent for n in names if schedule.loop(n).role == VECTOR)
  return sizes


def memory_per_device(schedule) -> int:
  """Estimated peak bytes one device holds while running the schedule."""
  if schedule.lowering is not None:
    return placements.memory_bytes(schedule)
  routed = dispatches.of(schedule)
  if routed is not None:
    return dispatches.memory_bytes(schedule, routed)
  plan = schedule.plan()
  prog = schedule.program
  ring_buffers = {b for r in plan.rings.values() for b in r.buffers}
  total = 0
  for b in prog.reads:
    stored = local_elements(schedule, b, plan.storage[b.name])
    resident = local_elements(schedule, b, plan.resident[b.name])
    total += stored * b.dtype.itemsize
    if plan.storage[b.name] != plan.resident[b.name]:
      total += resident * b.dtype.itemsize
    if b.name in ring_buffers:
      total += resident * b.dtype.itemsize
  out = prog.writes
  total += 4 * local_elements(schedule, out, plan.resident[out.name])
  total += local_elements(schedule, out, plan.storage[out.name]) * out.dtype.itemsize
  for b in prog.reads + (out,):  # reordering a zigzag axis happens on whole arrays
    if schedule.zigzags.keys() & set(b.axes):
      total += math.prod(b.canonical_shape) * b.dtype.itemsize
  kernel = registry.local(schedule.kernel or "xla")
  return total + kernel.workspace_bytes(prog, block_sizes(schedule), schedule.kernel_config)
