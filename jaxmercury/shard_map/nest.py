"""Running a scheduled loop nest on one device's blocks, inside shard_map.

Serial loops slice the buffers they index; shifted loops rotate ring buffers
with ``ppermute`` (the next block's transfer is issued before the current
block's compute) or pass partial outputs along; spatial loops assemble the
output, reduction loops combine partial states.
"""

from __future__ import annotations

import math

import jax

from jaxmercury.program import BlockContext
from jaxmercury.schedules.loops import PARALLEL, SERIAL
from jaxmercury.shard_map import blocks

UNROLL_LIMIT = 8  # serial loops longer than this run as lax.fori_loop


class Nest:
  """The per-device executor of one schedule."""

  def __init__(self, schedule, plan, kernel):
    self.s = schedule
    self.plan = plan
    self.kernel = kernel
    self.prog = schedule.program
    self.loops = {lp.name: lp for lp in schedule.loops}
    self.serial = [lp for lp in schedule.loops if lp.role == SERIAL]
    self.state_axes = self.prog.state_axes()
    self.out_local = plan.local_factors[self.prog.writes.name]

  # ------------------------------------------------------------------ helpers
  def _extents(self, names):
    return [self.loops[n].extent for n in names]

  def _offset(self, axis, fixed):
    """Global start of the current block along a loop axis."""
    start, stride = 0, 1
    for f in reversed(self.s.factors[axis]):
      lp = self.loops[f]
      idx = jax.lax.axis_index(lp.level) if lp.role == PARALLEL else fixed.get(f)
      if idx is not None:
        start = start + idx * stride
      stride *= lp.extent
    return start

  def _slice_env(self, env, lp, idx):
    new = {}
    for name, (x, factors) in env.items():
      names = factors.get(lp.axis)
      if names and lp.name in names:
        dim = self.prog.buffers[name].axes.index(lp.axis)
        x = blocks.take(x, dim, self._extents(names), names.index(lp.name), idx)
        factors = {**factors, lp.axis: [n for n in names if n != lp.name]}
      new[name] = (x, factors)
    return new

  def _out_factors(self, axis, fixed):
    return [n for n in self.out_local.get(axis, []) if n not in fixed]

  def _assemble(self, full, part, lp, fixed, idx):
    names = self._out_factors(lp.axis, fixed)
    pos = names.index(lp.name)
    ext = self._extents(names)
    out = []
    full = (None,) * len(part) if full is None else full
    for leaf_axes, f, p in zip(self.state_axes, full, part):
      dim = leaf_axes.index(lp.axis)
      f = blocks.expand(p, dim, ext, pos) if f is None else f
      out.append(blocks.place(f, p, dim, ext, pos, idx))
    return tuple(out)

  def _combine(self, a, b):
    return self.prog.reduction.combine(a, b)

  # --------------------------------------------------------------------- run
  def run(self, arrays):
    env = {b.name: (arrays[b.name], dict(self.plan.local_factors[b.name])) for b in self.prog.reads}
    return self._run(0, env, {})

  def _run(self, k, env, fixed):
    if k == len(self.serial):
      return self._leaf(env, fixed)
    lp = self.serial[k]
    if lp.shifted_by:
      return self._ring(k, env, fixed, lp)
    step = lambda t, acc: self._step(k, env, fixed, lp, t, acc)
    if lp.extent <= UNROLL_LIMIT:
      acc = None
      for t in range(lp.extent):
        acc = step(t, acc)
      return acc
    first = step(0, None)
    return jax.lax.fori_loop(1, lp.extent, step, first)

  def _step(self, k, env, fixed, lp, t, acc):
    sub = self._run(k + 1, self._slice_env(env, lp, t), {**fixed, lp.name: t})
    if lp.kind == "r":
      return sub if acc is None else self._combine(acc, sub)
    return self._assemble(acc, sub, lp, fixed, t)

  def _ring(self, k, env, fixed, lp):
    ring = self.plan.rings[lp.name]
    n = ring.size
    rank = jax.lax.axis_index(ring.level)
    perm = [(j, (j - 1) % n) for j in range(n)]  # rank j-1 receives rank j's block
    shift = lambda tree: jax.tree.map(lambda x: jax.lax.ppermute(x, ring.level, perm), tree)
    current = {b: env[b][0] for b in ring.buffers}
    if ring.offset:
      current = shift(current)
    acc = None
    for t in range(n):
      nxt = shift(current) if t < n - 1 else None  # issued before this step's compute
      idx = (t + rank + ring.offset) % n
      step_env = {**env, **{b: (current[b], env[b][1]) for b in ring.buffers}}
      sub = self._run(k + 1, self._slice_env(step_env, lp, idx), {**fixed, lp.name: idx})
      if ring.travel:
        acc = sub if acc is None else self._combine(shift(acc), sub)
      elif lp.kind == "r":
        acc = sub if acc is None else self._combine(acc, sub)
      else:
        acc = self._assemble(acc, sub, lp, fixed, idx)
      current = nxt
    return acc

  def _leaf(self, env, fixed):
    starts, sizes = {}, {}
    for a in self.prog.axes:
      if a in self.s.factors:
        starts[a] = self._offset(a, fixed)
        sizes[a] = math.prod(self.loops[f].extent for f in self.s.factors[a]
                             if self.loops[f].role not in (PARALLEL, SERIAL))
      else:
        sizes[a] = self.prog.axes[a].extent
    ctx = BlockContext(starts=starts, sizes=sizes,
                       extents={a: ax.extent for a, ax in self.prog.axes.items()}, zigzag=self.s.zigzags)
    return self.prog.state_of(self.kernel(ctx, *[env[b.name][0] for b in self.prog.reads]))
