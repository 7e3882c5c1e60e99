"""Static per-device memory estimate of a schedule, from its plan.

Counts what each device holds at once: every input's stored block and, when
the nest needs another layout, its gathered copy; a second block per ring
buffer (the one in flight); the output's float32 partial state; and the
output's stored block.
"""

from __future__ import annotations

import math

from jaxmercury.shard_map.plan import make_plan


def local_elements(schedule, buf, layout) -> int:
  n = 1
  for a, extent, levels in zip(buf.axes, buf.canonical_shape, layout):
    extent = schedule.padded.get(a, extent)
    n *= extent // math.prod(schedule.levels[lv] for lv in levels)
  return n


def memory_per_device(schedule) -> int:
  """Estimated peak bytes one device holds for the schedule's buffers."""
  plan = make_plan(schedule)
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
  return total
