"""Lowering a schedule to a jitted ``jax.shard_map`` program."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from jaxmercury.pallas_kernels import registry
from jaxmercury.schedules import orders
from jaxmercury.shard_map.nest import Nest
from jaxmercury.shard_map.plan import make_plan
from jaxmercury.shard_map.reshard import reshard
from jaxmercury.shard_map.storage_order import reorder


def lower(schedule, *, jit: bool = True, per_device=None):
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
  """
  prog, mesh = schedule.program, schedule.mesh
  plan = make_plan(schedule)
  out = prog.writes
  reads = prog.reads
  if per_device is None:
    per_device = _nest_per_device(schedule, plan)
  mapped = jax.shard_map(
      per_device, mesh=mesh,
      in_specs=tuple(plan.spec(b.name) for b in reads),
      out_specs=plan.spec(out.name), check_vma=False)
  explicit = any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ()))

  def constrain(x, spec):
    sharding = NamedSharding(mesh, spec)
    return jax.sharding.reshard(x, sharding) if explicit else jax.lax.with_sharding_constraint(x, sharding)

  def whole(x):  # explicit sharding types cannot gather along a split dimension
    return constrain(x, PartitionSpec()) if explicit else x

  def reordered(x, axes, spec, to_storage: bool):
    """Zigzag axes moved to storage order (or back): chunk by chunk between devices where they are split."""
    for dim, a in enumerate(axes):
      if a in schedule.zigzags:
        moved = reorder(constrain(x, spec), mesh, spec, dim, schedule.zigzags[a], to_storage)
        if moved is None:  # not split in whole chunks: permute the whole array
          perm = orders.permutation(x.shape[dim], schedule.zigzags[a])
          moved = jnp.take(whole(x), perm if to_storage else np.argsort(perm), axis=dim)
        x = moved
    return x

  def run(*inputs):
    prog.check_inputs(inputs)
    canon = []
    for b, x in zip(reads, inputs):
      x = jnp.reshape(x, b.canonical_shape)
      pads = [(0, schedule.padded.get(a, e) - e) for a, e in zip(b.axes, b.canonical_shape)]
      if any(p for _, p in pads):
        x = jnp.pad(x, pads)
      x = reordered(x, b.axes, plan.spec(b.name), to_storage=True)
      canon.append(constrain(x, plan.spec(b.name)))
    y = reordered(mapped(*canon), out.axes, plan.spec(out.name), to_storage=False)
    crop = tuple(slice(0, e) for e in out.canonical_shape)
    y = jnp.reshape(y[crop], out.shape)
    return y

  run.__name__ = f"{prog.name.replace(' ', '_')}_schedule"
  return jax.jit(run) if jit else run


def _nest_per_device(schedule, plan):
  """The loop nest on one device: stored input blocks -> the output's stored block."""
  prog = schedule.program
  kernel = registry.lookup(schedule.kernel or "xla", prog, schedule.mesh)
  nest = Nest(schedule, plan, kernel)

  def per_device(*local):
    arrays = {b.name: reshard(x, plan.storage[b.name], plan.resident[b.name])
              for b, x in zip(prog.reads, local)}
    state = nest.run(arrays)
    for red in plan.reductions:
      if red.scatter_axis is None:
        state = prog.reduction.all_reduce(state, red.level)
      else:
        dims = [axes.index(red.scatter_axis) for axes in prog.state_axes()]
        state = prog.reduction.reduce_scatter(state, red.level, dims)
    y = prog.finalize(state)
    return reshard(y, plan.result, plan.storage[prog.writes.name])

  return per_device
