"""Running a scheduled loop nest on one device's blocks, inside shard_map.

Serial loops slice the buffers they index; shifted loops rotate ring buffers
with ``ppermute`` (the next block's transfer is issued before the current
block's compute) or pass partial outputs along; spatial loops assemble the
output, reduction loops combine partial states.

A joint nest runs several programs' schedules in the same loops (attention's
dq and dk-dv programs): one kernel call per block returns a block of each,
and each program combines its own partial results by its own loop kinds.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxmercury.analysis.plan import SEGMENT_IDS
from jaxmercury.ir.loops import PARALLEL, SERIAL
from jaxmercury.ir.orders import true_positions
from jaxmercury.ir.program import BlockContext
from jaxmercury.lowering import blocks
from jaxmercury.programs import packing
from jaxmercury.programs.masks import mask_of

UNROLL_LIMIT = 8  # serial loops longer than this run as lax.fori_loop


class _Part:
  """One program's side of a nest: how its partial results combine into its output."""

  def __init__(self, schedule, plan):
    self.s = schedule
    self.plan = plan
    self.prog = schedule.program
    self.loops = {lp.name: lp for lp in schedule.loops}
    self.state_axes = self.prog.state_axes()
    self.out_local = plan.local_factors[self.prog.writes.name]

  def _extents(self, names):
    return [self.loops[n].extent for n in names]

  def _assemble(self, full, part, lp, fixed, idx):
    names = [n for n in self.out_local.get(lp.axis, []) if n not in fixed]
    pos = names.index(lp.name)
    ext = self._extents(names)
    out = []
    full = (None,) * len(part) if full is None else full
    for leaf_axes, f, p in zip(self.state_axes, full, part):
      dim = leaf_axes.index(lp.axis)
      f = blocks.expand(p, dim, ext, pos) if f is None else f
      out.append(blocks.place(f, p, dim, ext, pos, idx))
    return tuple(out)

  def accumulate(self, acc, sub, loop: str, fixed, idx, shift=None):
    """``acc`` with the partial result ``sub`` of iteration ``idx`` of ``loop`` taken in: combined (a
    reduction loop; ``shift``: after passing ``acc`` along the ring, its partial outputs travel), or placed
    (a spatial loop)."""
    lp = self.loops[loop]
    if shift is not None:
      return sub if acc is None else self.prog.reduction.combine(shift(acc), sub)
    if lp.kind == "r":
      return sub if acc is None else self.prog.reduction.combine(acc, sub)
    return self._assemble(acc, sub, lp, fixed, idx)


class Nest:
  """The per-device executor of one schedule, or of several in the same loops (``joint``).

  Args:
    schedule, plan: the schedule and its plan.
    kernel: ``kernel(ctx, *read_blocks)``: the block's output; with ``joint``,
      a tuple of one output block per part (``schedule`` first).
    joint: further ``(schedule, plan)`` pairs run in the same loops
      (``joint_problem`` says whether they can be).
  """

  def __init__(self, schedule, plan, kernel, *, joint=()):
    self.s = schedule
    self.plan = plan
    self.kernel = kernel
    self.prog = schedule.program
    self.loops = {lp.name: lp for lp in schedule.loops}
    self.serial = [lp for lp in schedule.loops if lp.role == SERIAL]
    self.parts = [_Part(schedule, plan)] + [_Part(s, p) for s, p in joint]

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
        x = blocks.take(x, dim, [self.loops[n].extent for n in names], names.index(lp.name), idx)
        factors = {**factors, lp.axis: [n for n in names if n != lp.name]}
      new[name] = (x, factors)
    return new

  # --------------------------------------------------------------------- run
  def run(self, arrays):
    """The output state of the nest's program (a tuple of one state per part, joint) from the read blocks."""
    env = {b.name: (arrays[b.name], dict(self.plan.local_factors[b.name])) for b in self.prog.reads}
    states = self._run(0, env, {})
    return states if len(self.parts) > 1 else states[0]

  def _run(self, k, env, fixed):
    if k == len(self.serial):
      return self._leaf(env, fixed)
    lp = self.serial[k]
    if lp.shifted_by:
      return self._ring(k, env, fixed, lp)
    step = lambda t, acc: self._step(k, env, fixed, lp, t, acc)
    if lp.extent <= UNROLL_LIMIT:
      acc = (None,) * len(self.parts)
      for t in range(lp.extent):
        acc = step(t, acc)
      return acc
    first = step(0, (None,) * len(self.parts))
    return jax.lax.fori_loop(1, lp.extent, step, first)

  def _step(self, k, env, fixed, lp, t, acc):
    sub = self._run(k + 1, self._slice_env(env, lp, t), {**fixed, lp.name: t})
    return tuple(part.accumulate(a, s, lp.name, fixed, t) for part, a, s in zip(self.parts, acc, sub))

  def _ring(self, k, env, fixed, lp):
    rings = [part.plan.rings[lp.name] for part in self.parts]
    ring = rings[0]
    n = ring.size
    rank = jax.lax.axis_index(ring.level)

    def shift(tree, hops=1):  # rank j - hops receives rank j's block
      if hops % n == 0:
        return tree
      perm = [(j, (j - hops) % n) for j in range(n)]
      return jax.tree.map(lambda x: jax.lax.ppermute(x, ring.level, perm), tree)

    offset = max(r.offset for r in rings)  # a part whose outputs travel starts one block on

    def step(n_step, steps, current, acc, ahead: bool):
      """Step ``steps[n_step]``: the next step's blocks sent on (``ahead``) before this one's compute."""
      t = steps[n_step]
      nxt = shift(current, steps[n_step + 1] - t) if ahead else current
      idx = (t + rank + offset) % n
      step_env = {**env, **{b: (current[b], env[b][1]) for b in ring.buffers}}
      sub = self._run(k + 1, self._slice_env(step_env, lp, idx), {**fixed, lp.name: idx})
      hops = t - steps[n_step - 1] if n_step else 1
      acc = tuple(part.accumulate(a, s, lp.name, fixed, idx,
                                  shift=(lambda tree, h=hops: shift(tree, h)) if r.travel else None)
                  for part, r, a, s in zip(self.parts, rings, acc, sub))
      return nxt, acc

    if ring.chain is not None:
      return self._data_ring(env, fixed, lp, rings, shift, step, offset)
    # the steps some part computes a block at (a positional mask may hide the others from every rank)
    steps = sorted(set().union(*(r.steps(offset) for r in rings)))
    current = shift({b: env[b][0] for b in ring.buffers}, offset + steps[0])
    acc = (None,) * len(self.parts)
    for n_step in range(len(steps)):
      current, acc = step(n_step, steps, current, acc, n_step + 1 < len(steps))
    if steps[-1] < n - 1:  # travelling partial outputs go on to their owners
      acc = tuple(shift(a, n - 1 - steps[-1]) if r.travel else a for r, a in zip(rings, acc))
    return acc

  def _data_ring(self, env, fixed, lp, rings, shift, step, offset):
    """A ring whose steps the segment ids decide (``Ring.chain``): its chain's steps in order, up to the last at
    which some device's blocks keep a pair (``_data_prefix``, the same on every device); a step past it neither
    computes nor moves blocks, a step before it sends the blocks straight to the next step (``lax.switch``
    over: idle, the last step, a step and its transfer)."""
    ring = rings[0]
    steps = ring.chain_steps(offset)
    runs = self._data_prefix(env, fixed, lp, ring, steps, offset)
    current = shift({b: env[b][0] for b in ring.buffers}, offset + steps[0])
    acc = (None,) * len(self.parts)
    for n_step in range(len(steps)):
      ahead = (False, True) if n_step + 1 < len(steps) else (False,)
      kinds = [lambda c, a: (c, a)] + [lambda c, a, s=n_step, on=on: step(s, steps, c, a, on) for on in ahead]
      first = int(n_step == 0)  # the first step always runs (and sets the accumulators' structure)
      kinds = kinds[first:]
      choice = jnp.clip(runs - n_step - first, 0, len(kinds) - 1)
      current, acc = kinds[0](current, acc) if len(kinds) == 1 else jax.lax.switch(choice, kinds, current, acc)
    if any(r.travel for r in rings):  # travelling partial outputs go on to their owners
      home = [lambda a, t=t: shift(a, ring.size - 1 - t) for t in steps]
      acc = tuple(jax.lax.switch(runs - 1, home, a) if r.travel else a for r, a in zip(rings, acc))
    return acc

  def _data_prefix(self, env, fixed, lp, ring, steps, offset):
    """How many of the chain's ``steps`` run: up to the last at which some device's queries and visiting keys keep
    a pair (``programs.packing.keeps`` on the segment ids: the travelling ids of every rank gathered once),
    combined over the whole mesh; at least one."""
    side = lp.axis
    other = "i" if side == "j" else "j"
    band = mask_of(self.prog.params).band
    blocks = jax.lax.all_gather(env[SEGMENT_IDS[side]][0], ring.level)  # rank r holds block r before the ring
    rank = jax.lax.axis_index(ring.level)
    visited = jnp.array([(t + rank + offset) % ring.size for t in steps])
    mine = (env[SEGMENT_IDS[other]][0],) + self._region(other, fixed)  # ids [b, n], positions [n], real [n]
    theirs = (jnp.take(blocks, visited, axis=0),) + tuple(  # ids [steps, b, n], positions and real [steps, n]
        jnp.stack(x) for x in zip(*(self._region(side, {**fixed, lp.name: idx}) for idx in visited)))
    (q_ids, q_pos, q_real), (k_ids, k_pos, k_real) = (mine, theirs) if side == "j" else (theirs, mine)
    row = lambda qi, qp, qr, ki, kp, kr: packing.keeps(jnp, qi, qp, qr, ki, kp, kr, band)
    per_row = jax.vmap(row, in_axes=(0, None, None, 0, None, None))
    stepped = (None,) * 3 + (0,) * 3 if side == "j" else (0,) * 3 + (None,) * 3  # the visiting side's arrays
    visits = jnp.any(jax.vmap(per_row, in_axes=stepped)(q_ids, q_pos, q_real, k_ids, k_pos, k_real), axis=1)
    needed = jax.lax.pmax(visits.astype(jnp.int32), tuple(self.s.levels))
    return jnp.maximum(jnp.max(needed * jnp.arange(1, len(steps) + 1)), 1)

  def _region(self, axis, fixed):
    """The true positions (and which are real, not padding) along ``axis`` of the blocks the sub-nest under
    ``fixed`` reads, in their layout: its unfixed serial and vector factors, major first."""
    stored, stride = jnp.zeros((), jnp.int32), 1
    for f in reversed(self.s.factors[axis]):
      lp = self.loops[f]
      if lp.role == PARALLEL:
        stored = stored + jax.lax.axis_index(lp.level) * stride
      elif f in fixed:
        stored = stored + fixed[f] * stride
      else:
        stored = stored[None] + (jnp.arange(lp.extent) * stride).reshape((lp.extent,) + (1,) * stored.ndim)
      stride *= lp.extent
    stored = jnp.reshape(stored, -1)
    extent = self.prog.axes[axis].extent
    chunks = self.s.zigzags.get(axis)
    true = stored if chunks is None else true_positions(stored, extent, chunks)
    return true, true < extent

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
    out = self.kernel(ctx, *[env[b.name][0] for b in self.prog.reads])
    outs = out if len(self.parts) > 1 else (out,)
    return tuple(part.prog.state_of(o) for part, o in zip(self.parts, outs))


def joint_problem(first, others) -> str | None:
  """Why schedules ``others`` cannot run in the loops of schedule ``first`` (a joint ``Nest``), or None.

  They must read the same buffers laid out alike, have the same serial loops
  (names, extents, shifts) in the same order, rings on the same loops moving
  the same buffers, and tile, pad and put in zigzag order the same axes alike.
  """
  def serial(s):
    return [(lp.name, lp.extent, lp.shifted_by, lp.level) for lp in s.loops if lp.role == SERIAL]

  p0 = first.plan()
  reads = [b.name for b in first.program.reads]
  for s in others:
    p = s.plan()
    if [b.name for b in s.program.reads] != reads:
      return f"{s.program.name} reads {[b.name for b in s.program.reads]}, {first.program.name} reads {reads}"
    for b in reads:
      if (p.storage[b], p.resident[b], p.local_factors[b]) != (p0.storage[b], p0.resident[b], p0.local_factors[b]):
        return f"buffer {b} is laid out differently in {s.program.name}"
    if serial(s) != serial(first):
      return f"serial loops {serial(s)} of {s.program.name} differ from {serial(first)}"
    if {k: (r.buffers, r.level, r.size, r.distances, r.chain) for k, r in p.rings.items()} != {
        k: (r.buffers, r.level, r.size, r.distances, r.chain) for k, r in p0.rings.items()}:
      return f"the rings of {s.program.name} move other buffers"
    if (s.zigzags, s.factors, s.padded) != (first.zigzags, first.factors, first.padded):
      return f"{s.program.name} tiles, pads or orders its axes differently"
  return None
