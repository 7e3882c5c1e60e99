"""Lowering a schedule to a jitted ``jax.shard_map`` program."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jaxmercury.ir import orders
from jaxmercury.kernels import registry
from jaxmercury.lowering import types
from jaxmercury.lowering.collectives import reshard
from jaxmercury.lowering.nest import Nest
from jaxmercury.lowering.storage_order import reorder
from jaxmercury.programs import packing
from jaxmercury.programs.masks import KV_SEGMENTS, Q_SEGMENTS


def lower(schedule, *, jit: bool = True, per_device=None, widths: tuple[int, ...] | None = None):
  """Builds ``f(*inputs) -> output`` for a schedule.

  Inputs and the output are global arrays with the program's own shapes. The
  function pads and reshapes them to canonical layout (one dimension per
  axis), puts zigzag axes in storage order, runs the per-device nest under
  ``shard_map``, and restores the order and crops the result.

  Args:
    schedule: the ``Schedule`` to lower.
    jit: wrap the result in ``jax.jit``.
    per_device: a function of the inputs' stored blocks returning the
      output's stored block, run in place of the loop nest (a fused
      lowering); default the nest, with its collectives and reductions.
    widths: ``per_device`` returns the output's block in parts cut along its
      last axis, these wide (an attention kernel's output and log-sum-exp,
      which the ``attention_with_lse`` program stores as one float32
      array): ``f`` returns the parts, each as the output would leave, so
      that they are never packed. The last axis must be its dimension's
      only one, unsplit, unpadded and in natural order.
  """
  prog, mesh = schedule.program, schedule.mesh
  plan = schedule.plan()
  if per_device is None:
    per_device = _nest_per_device(schedule, plan)
  out_spec = plan.spec(prog.writes.name)
  if widths is not None:
    _check_parts(schedule, out_spec, widths)
  mapped = jax.shard_map(
      per_device, mesh=mesh,
      in_specs=tuple(plan.spec(b.name) for b in prog.reads),
      out_specs=out_spec if widths is None else (out_spec,) * len(widths), check_vma=False)
  edges = _Edges(schedule, plan)

  def run(*inputs):
    order = edges.order(inputs)
    y = mapped(*edges.inputs(inputs, order))
    if widths is None:
      return edges.output(y, order=order)
    return tuple(edges.output(part, w, order=order) for part, w in zip(y, widths))

  run.__name__ = f"{prog.name.replace(' ', '_')}_schedule"
  return jax.jit(run) if jit else run


def _check_parts(schedule, out_spec, widths) -> None:
  """``lower``'s ``widths`` apply: they sum to the output's last axis, which nothing splits, pads or reorders."""
  out = schedule.program.writes
  last = out.axes[-1]
  whole = len(out.dims[-1]) == 1 and not types.entries(out_spec, len(out.axes))[-1]
  if (sum(widths) != out.canonical_shape[-1] or not whole or last in schedule.zigzags
      or schedule.padded.get(last, out.canonical_shape[-1]) != out.canonical_shape[-1]):
    raise ValueError(f"{schedule.program.name}: output {out.name!r} cannot leave in parts {widths} along axis "
                     f"{last!r} (extent {out.canonical_shape[-1]}): the widths must sum to it, and the axis must be "
                     "its dimension's only one, unsplit, unpadded and in natural order")


def lower_joint(schedules, kernel, *, jit: bool = True):
  """Builds ``f(*inputs) -> (output, ...)``: schedules of programs that read the same inputs, run in one nest.

  ``nest.joint_problem`` must hold for them (the same loops and read
  layouts); ``kernel(ctx, *read_blocks)`` returns one block of each
  program's output, so each block of inputs is visited once for all of them.
  Each output then takes its own cross-device reductions and layout.

  Args:
    schedules: the schedules; the first's loops are walked.
    kernel: the joint block function.
    jit: wrap the result in ``jax.jit``.
  """
  first = schedules[0]
  plans = [s.plan() for s in schedules]
  nest = Nest(first, plans[0], kernel, joint=list(zip(schedules[1:], plans[1:])))

  def per_device(*local):
    states = nest.run(_resident(first, plans[0], local))
    return tuple(_finish(s, p, state) for s, p, state in zip(schedules, plans, states))

  mapped = jax.shard_map(
      per_device, mesh=first.mesh, in_specs=tuple(plans[0].spec(b.name) for b in first.program.reads),
      out_specs=tuple(p.spec(s.program.writes.name) for s, p in zip(schedules, plans)), check_vma=False)
  edges = [_Edges(s, p) for s, p in zip(schedules, plans)]

  def run(*inputs):
    order = edges[0].order(inputs)  # the programs read the same inputs: one order
    outs = mapped(*edges[0].inputs(inputs, order))
    return tuple(e.output(y, order=order) for e, y in zip(edges, outs))

  run.__name__ = "_and_".join(s.program.name.replace(" ", "_") for s in schedules) + "_joint_schedule"
  return jax.jit(run) if jit else run


class _Edges:
  """A schedule's ``shard_map`` boundary on global arrays: inputs padded, reshaped to canonical layout and put in
  storage order; the output put back in order, cropped and reshaped.

  With Explicit mesh axes every step keeps a sharding type the type system accepts (``types``): a dimension is
  made whole before it is padded, cropped, or reshaped other than on its major axis; the output leaves with the
  schedule's stored layout over its own dimensions, with a dimension its levels no longer divide (a cropped
  one) whole.
  """

  def __init__(self, schedule, plan):
    self.s, self.plan = schedule, plan
    self.mesh = schedule.mesh
    self.explicit = types.explicit(schedule.mesh)

  def _constrain(self, x, spec):
    return types.constrain(x, self.mesh, spec)

  def _whole(self, x):  # explicit sharding types cannot gather along a split dimension
    return self._constrain(x, PartitionSpec()) if self.explicit else x

  def _reordered(self, x, axes, spec, to_storage: bool):
    """Zigzag axes moved to storage order (or back): chunk by chunk between devices where they are split."""
    zigzags = self.s.zigzags
    for dim, a in enumerate(axes):
      if a in zigzags:
        moved = reorder(self._constrain(x, spec), self.s.mesh, spec, dim, zigzags[a], to_storage)
        if moved is None:  # not split in whole chunks: permute the whole array
          perm = orders.permutation(x.shape[dim], zigzags[a])
          moved = jnp.take(self._whole(x), perm if to_storage else np.argsort(perm), axis=dim)
        x = moved
    return x

  def _changed(self, buf) -> set[str]:
    """Axes of ``buf`` the boundary pads, crops or reorders."""
    prog = self.s.program
    return {a for a in buf.axes if self.s.padded.get(a, prog.axes[a].extent) != prog.axes[a].extent
            or a in self.s.zigzags}

  def _entry_spec(self, buf) -> PartitionSpec:
    """The layout ``buf`` enters in over its own dims: its stored layout where a dimension is one axis the
    boundary leaves alone, whole elsewhere (so that reshaping and padding it move no data between devices)."""
    stored, changed = types.entries(self.plan.spec(buf.name), len(buf.axes)), self._changed(buf)
    out, k = [], 0
    for group in buf.dims:
      names = [a.name for a in group]
      keep = len(group) == 1 and names[0] not in changed
      out.append(stored[k] if keep else None)
      k += len(group)
    return PartitionSpec(*out)

  def order(self, inputs):
    """A balanced schedule's order of each row (``Schedule.balance``: ``programs.packing.balanced_order`` of the
    segment ids among ``inputs``), or None."""
    if not self.s.balanced:
      return None
    ids = {b.name: x for b, x in zip(self.s.program.reads, inputs)}
    q, k = (self._whole(jnp.asarray(ids[n])) for n in (Q_SEGMENTS, KV_SEGMENTS))
    return packing.balanced_order(q, k, self.s.zigzags["i"])

  def _ordered(self, x, buf, perm):
    """``x`` (``buf``'s array, the program's own shape) with its sequence dimension taken in ``perm``'s order, in
    its own layout (the rows are permuted whole)."""
    dim = next(n for n, group in enumerate(buf.dims) if {a.name for a in group} & {"i", "j"})
    spec = types.spec_of(x, self.mesh) if self.explicit else None
    index = jnp.reshape(perm, perm.shape + (1,) * (x.ndim - 2))
    y = jnp.take_along_axis(self._whole(x), index, axis=dim)
    return y if spec is None else self._constrain(y, spec)

  def inputs(self, inputs, order=None) -> list:
    """The stored blocks' global arrays of ``inputs``; ``order``: a balanced schedule's (``order``)."""
    prog = self.s.program
    prog.check_inputs(inputs)
    canon = []
    for b, x in zip(prog.reads, inputs):
      if order is not None and {"i", "j"} & set(b.axes):
        x = self._ordered(x, b, order)
      groups = [len(d) for d in b.dims]
      entry = self._entry_spec(b)
      x = self._constrain(x, entry)  # Auto axes too: XLA then never regroups a split across the reshape
      x = types.reshape(x, self.mesh, b.canonical_shape, types.groups_to_axes(entry, groups))
      if not self.explicit:
        x = self._constrain(x, types.groups_to_axes(entry, groups))
      pads = [(0, self.s.padded.get(a, e) - e) for a, e in zip(b.axes, b.canonical_shape)]
      if any(p for _, p in pads):
        x = jnp.pad(x, pads)
      x = self._reordered(x, b.axes, self.plan.spec(b.name), to_storage=True)
      canon.append(self._constrain(x, self.plan.spec(b.name)))
    return canon

  def output(self, y, width: int | None = None, *, order=None):
    """The output's stored block(s) as the program's output; ``width``: a part of it, that wide along its last
    axis (``lower``'s ``widths``); ``order``: a balanced schedule's, undone."""
    out = self.s.program.writes
    shape = out.canonical_shape if width is None else (*out.canonical_shape[:-1], width)
    if not self.explicit:  # XLA's propagation then starts from the layout the nest left
      y = self._constrain(y, self.plan.spec(out.name))
    y = self._reordered(y, out.axes, self.plan.spec(out.name), to_storage=False)
    crop = tuple(slice(0, e) for e in shape)
    cropped = [d for d, e in enumerate(shape) if y.shape[d] != e]
    if cropped:
      spec = self.plan.spec(out.name) if not self.explicit else types.spec_of(y, self.mesh)
      y = self._constrain(y, types.whole(spec, y.ndim, cropped))
    y = types.flatten(y[crop], self.mesh, [len(d) for d in out.dims])
    if order is not None:
      y = self._ordered(y, out, jnp.argsort(order, axis=-1))
    return y if self.explicit else self._constrain(y, types.output_spec(self.s))


def _resident(schedule, plan, local) -> dict:
  """The read buffers' stored blocks moved to the layouts the nest works on."""
  return {b.name: reshard(x, plan.storage[b.name], plan.resident[b.name], schedule.levels)
          for b, x in zip(schedule.program.reads, local)}


def _finish(schedule, plan, state):
  """A nest's output state combined across devices, finalized and moved to the output's stored layout."""
  prog = schedule.program
  for red in plan.reductions:
    if red.scatter_axis is None:
      state = prog.reduction.all_reduce(state, red.level)
    else:
      dims = [axes.index(red.scatter_axis) for axes in prog.state_axes()]
      state = prog.reduction.reduce_scatter(state, red.level, dims)
  y = prog.finalize(state)
  return reshard(y, plan.result, plan.storage[prog.writes.name], schedule.levels)


def _nest_per_device(schedule, plan):
  """The loop nest on one device: stored input blocks -> the output's stored block."""
  kernel = registry.lookup(schedule.kernel or "xla", schedule.program, schedule.mesh, schedule.kernel_config)
  nest = Nest(schedule, plan, kernel)

  def per_device(*local):
    return _finish(schedule, plan, nest.run(_resident(schedule, plan, local)))

  return per_device
