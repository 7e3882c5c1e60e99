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


def _to_storage_order(x, axes, zigzags):
  for dim, a in enumerate(axes):
    if a in zigzags:
      x = jnp.take(x, orders.permutation(x.shape[dim], zigzags[a]), axis=dim)
  return x


def _to_true_order(y, axes, zigzags):
  for dim, a in enumerate(axes):
    if a in zigzags:
      y = jnp.take(y, np.argsort(orders.permutation(y.shape[dim], zigzags[a])), axis=dim)
  return y


def lower(schedule, *, jit: bool = True):
  """Builds ``f(*inputs) -> output`` for a schedule.

  Inputs and the output are global arrays with the program's own shapes. The
  function pads and reshapes them to canonical layout (one dimension per
  axis), puts zigzag axes in storage order, runs the per-device nest under
  ``shard_map``, and restores the order and crops the result.

  Args:
    schedule: the ``Schedule`` to lower.
    jit: wrap the result in ``jax.jit``.
  """
  prog, mesh = schedule.program, schedule.mesh
  plan = make_plan(schedule)
  kernel = registry.lookup(schedule.kernel or "xla", prog, mesh)
  nest = Nest(schedule, plan, kernel)
  out = prog.writes
  reads = prog.reads

  def per_device(*local):
    arrays = {b.name: reshard(x, plan.storage[b.name], plan.resident[b.name])
              for b, x in zip(reads, local)}
    state = nest.run(arrays)
    for red in plan.reductions:
      if red.scatter_axis is None:
        state = prog.reduction.all_reduce(state, red.level)
      else:
        dims = [axes.index(red.scatter_axis) for axes in prog.state_axes()]
        state = prog.reduction.reduce_scatter(state, red.level, dims)
    y = prog.finalize(state)
    return reshard(y, plan.result, plan.storage[out.name])

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

  def run(*inputs):
    prog.check_inputs(inputs)
    canon = []
    for b, x in zip(reads, inputs):
      x = jnp.reshape(x, b.canonical_shape)
      pads = [(0, schedule.padded.get(a, e) - e) for a, e in zip(b.axes, b.canonical_shape)]
      if any(p for _, p in pads):
        x = jnp.pad(x, pads)
      if schedule.zigzags.keys() & set(b.axes):
        x = _to_storage_order(whole(x), b.axes, schedule.zigzags)
      canon.append(constrain(x, plan.spec(b.name)))
    y = mapped(*canon)
    if schedule.zigzags.keys() & set(out.axes):
      y = _to_true_order(whole(y), out.axes, schedule.zigzags)
    crop = tuple(slice(0, e) for e in out.canonical_shape)
    y = jnp.reshape(y[crop], out.shape)
    return y

  run.__name__ = f"{prog.name.replace(' ', '_')}_schedule"
  return jax.jit(run) if jit else run
