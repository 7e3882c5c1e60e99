"""Sharding types at a schedule's edges, on meshes of Explicit and Auto axes alike.

With ``AxisType.Explicit`` axes (what ``jax.make_mesh`` gives), a sharding is
part of an array's type: a reshape of a split dimension needs the result's
sharding, slicing a split dimension to a size its levels do not divide is
refused, and an array made outside ``jax.set_mesh`` has a type of no mesh.
These helpers move arrays between the layouts a schedule's boundary needs so
that every step is one the type system accepts; with ``Auto`` axes they are
sharding constraints, as before.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from jaxmercury.ir.loops import spec_levels


def explicit(mesh) -> bool:
  """Whether any axis of ``mesh`` is Explicit (shardings are then types)."""
  return any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ()))


def entries(spec: PartitionSpec | None, rank: int) -> list:
  """``spec``'s entries padded with None to ``rank``."""
  out = list(spec or PartitionSpec())
  return (out + [None] * rank)[:rank]


def spec_of(x, mesh) -> PartitionSpec:
  """The spec ``x``'s type (an array's, or a ``ShapeDtypeStruct``'s sharding) carries on ``mesh`` (all None where
  its type has no mesh; empty with Auto axes; over the Explicit axes alone on a mesh mixing both)."""
  if not explicit(mesh):
    return PartitionSpec()
  sharding = x.sharding if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x).sharding
  if getattr(sharding, "mesh", None) is None or sharding.mesh.empty:
    return PartitionSpec(*([None] * x.ndim))
  return PartitionSpec(*entries(sharding.spec, x.ndim))


def _only(spec: PartitionSpec, rank: int, names: set) -> PartitionSpec:
  """``spec`` with the mesh axes not in ``names`` left out."""
  out = []
  for entry in entries(spec, rank):
    kept = tuple(lv for lv in spec_levels(entry) if lv in names)
    out.append(None if not kept else kept[0] if len(kept) == 1 else kept)
  return PartitionSpec(*out)


def typed_part(spec: PartitionSpec, rank: int, mesh) -> PartitionSpec:
  """``spec`` over ``mesh``'s Explicit axes alone (what an array's type can say on a mesh mixing both)."""
  return _only(spec, rank, {n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Explicit})


def constrain(x, mesh, spec: PartitionSpec):
  """``x`` laid out as ``spec``: a reshard over Explicit axes (skipped where its type already says so), a
  sharding constraint over Auto ones; a mesh mixing both gets each part by its own means."""
  if not explicit(mesh):
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
  kinds = dict(zip(mesh.axis_names, mesh.axis_types))
  manual = {n for n, t in kinds.items() if t == AxisType.Explicit}
  typed = _only(spec, x.ndim, manual)
  if entries(spec_of(x, mesh), x.ndim) != entries(typed, x.ndim) or jax.typeof(x).sharding.mesh.empty:
    x = jax.sharding.reshard(x, NamedSharding(mesh, typed))
  auto = set(kinds) - manual
  if auto:
    x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, _only(spec, x.ndim, auto)))
  return x


def whole(spec: PartitionSpec, rank: int, dims: Sequence[int]) -> PartitionSpec:
  """``spec`` with ``dims`` split by nothing."""
  out = entries(spec, rank)
  for d in dims:
    out[d] = None
  return PartitionSpec(*out)


def groups_to_axes(spec: PartitionSpec, groups: Sequence[int]) -> PartitionSpec:
  """A spec over dims that flatten ``groups[d]`` axes each, as a spec over those axes: a dimension's levels go
  to its major axis (the caller has made sure that is where they belong)."""
  out = []
  for entry, n in zip(entries(spec, len(groups)), groups):
    out += [entry] + [None] * (n - 1)
  return PartitionSpec(*out)


def axes_to_groups(spec: PartitionSpec, groups: Sequence[int], shape: Sequence[int], sizes) -> PartitionSpec | None:
  """A spec over axes as a spec over the dims that flatten ``groups[d]`` of them each; None where a group is
  split other than on its major axis alone (its data is then not in contiguous chunks of the flattened dim)."""
  flat, out, k = entries(spec, sum(groups)), [], 0
  for n in groups:
    part = flat[k:k + n]
    if any(part[1:]):
      return None
    if part[0] is not None and shape[k] % math.prod(sizes[lv] for lv in spec_levels(part[0])):
      return None
    out.append(part[0])
    k += n
  return PartitionSpec(*out)


def reshape(x, mesh, shape: Sequence[int], out_spec: PartitionSpec):
  """``jnp.reshape(x, shape)`` whose result has ``out_spec`` (Explicit axes need it said; Auto ones do not)."""
  if not explicit(mesh):
    return jax.numpy.reshape(x, shape)
  if jax.typeof(x).sharding.mesh.empty:
    return jax.numpy.reshape(x, shape)
  kinds = dict(zip(mesh.axis_names, mesh.axis_types))
  typed = {n for n, t in kinds.items() if t == AxisType.Explicit}
  y = jax.lax.reshape(x, tuple(shape), out_sharding=NamedSharding(mesh, _only(out_spec, len(shape), typed)))
  if len(typed) < len(kinds):  # a mesh mixing both: its Auto axes by a constraint
    y = jax.lax.with_sharding_constraint(y, NamedSharding(mesh, _only(out_spec, len(shape), set(kinds) - typed)))
  return y


def minor_dims(groups: Sequence[int]) -> list[int]:
  """The dims (over the axes) that are not the major axis of their group."""
  out, k = [], 0
  for n in groups:
    out += list(range(k + 1, k + n))
    k += n
  return out


def _free(rank: int, whole_dims: Sequence[int]) -> PartitionSpec:
  """Auto axes: a spec leaving each dim to XLA (``UNCONSTRAINED``) but ``whole_dims``, split by nothing."""
  return PartitionSpec(*[None if d in whole_dims else PartitionSpec.UNCONSTRAINED for d in range(rank)])


def flatten(x, mesh, groups: Sequence[int], target: PartitionSpec | None = None):
  """``x`` with each run of ``groups[d]`` consecutive dims flattened into one, its layout carried along: a run
  split on its major dim alone keeps that split; a run split on a minor dim is made whole first.

  With Auto axes the types say nothing, so ``target`` (the layout the flattened array is wanted in, where the
  caller knows it) is constrained on the result where its split can lie on a run's major dim, and the run is
  kept whole where it cannot: XLA then never spreads a split over two dims across the reshape (an
  "involuntary full rematerialization"); it moves the flattened array instead.
  """
  shape, out_shape, k = x.shape, [], 0
  for n in groups:
    out_shape.append(math.prod(shape[k:k + n]))
    k += n
  minors = minor_dims(groups)
  if not explicit(mesh):
    y = jax.numpy.reshape(x, out_shape)
    if target is None:
      return y
    sizes, wanted, out, k = dict(mesh.shape), entries(target, len(groups)), [], 0
    for d, n in enumerate(groups):
      split = math.prod(sizes[lv] for lv in spec_levels(wanted[d]))
      out.append(wanted[d] if n == 1 or shape[k] % split == 0 else None)
      k += n
    return jax.lax.with_sharding_constraint(y, NamedSharding(mesh, PartitionSpec(*out)))
  if jax.typeof(x).sharding.mesh.empty:
    return jax.numpy.reshape(x, out_shape)
  sizes = dict(mesh.shape)
  spec = axes_to_groups(spec_of(x, mesh), groups, shape, sizes)
  if spec is None:
    x = constrain(x, mesh, whole(spec_of(x, mesh), x.ndim, minors))
    spec = axes_to_groups(spec_of(x, mesh), groups, shape, sizes)
  return reshape(x, mesh, out_shape, spec)


def unflatten(y, mesh, shape: Sequence[int], groups: Sequence[int], known: PartitionSpec | None = None):
  """``y``'s dims each split into ``groups[d]`` dims of ``shape``; a dim's split goes to its major part where its
  levels divide it, else the dim is made whole first. With Auto axes ``known`` is the layout ``y`` is in (its
  type does not say), constrained at every step; unknown, the new minor dims are kept whole."""
  auto = not explicit(mesh)
  if auto and known is None:
    out = jax.numpy.reshape(y, shape)
    minors = minor_dims(groups)
    return jax.lax.with_sharding_constraint(out, NamedSharding(mesh, _free(out.ndim, minors))) if minors else out
  if not auto and jax.typeof(y).sharding.mesh.empty:
    return jax.numpy.reshape(y, shape)
  current = known if auto else spec_of(y, mesh)
  sizes, spec, out, k = dict(mesh.shape), entries(current, y.ndim), [], 0
  undivided = []
  for d, n in enumerate(groups):
    split = math.prod(sizes[lv] for lv in spec_levels(spec[d]))
    if spec[d] is not None and shape[k] % split:
      undivided.append(d)
    out += [spec[d]] + [None] * (n - 1)
    k += n
  if undivided:
    spec = whole(current, y.ndim, undivided)
    return unflatten(constrain(y, mesh, spec), mesh, shape, groups, spec if auto else None)
  if auto:
    return constrain(jax.numpy.reshape(y, shape), mesh, PartitionSpec(*out))
  return reshape(y, mesh, shape, PartitionSpec(*out))


def like(y, mesh, target, free_dims: Sequence[int] = ()):
  """``y`` laid out as the undecorated operation's result would be.

  With Explicit axes: the sharding type of ``target`` (a ``ShapeDtypeStruct`` or array: what the undecorated
  operation gives), where that type names a mesh. With Auto axes, where types say nothing: ``free_dims`` (the
  dims that follow the inputs' rows: batch, sequence) left to XLA and the others whole, as an undecorated
  operation on replicated weights leaves its features; XLA then continues from a layout it can reach without
  regrouping a split across the caller's reshapes.
  """
  if not explicit(mesh):
    spec = PartitionSpec(*[PartitionSpec.UNCONSTRAINED if d in free_dims else None for d in range(y.ndim)])
    return jax.lax.with_sharding_constraint(y, NamedSharding(mesh, spec))
  sharding = getattr(target, "sharding", None)
  if sharding is None or getattr(sharding, "mesh", None) is None:
    return y
  if sharding.mesh.empty:  # the undecorated result is on no mesh (its inputs were not): whole, as it is
    return jax.sharding.reshard(y, NamedSharding(mesh, PartitionSpec())) if _split(y) else y
  return jax.sharding.reshard(y, sharding)


def cotangent_like(x, mesh):
  """``x``, its cotangent given ``x``'s sharding type (on meshes of Explicit axes; Auto axes: ``x`` as it is).

  A schedule's backward leaves each gradient in the layout its dual program stores it in; the derivative of the
  undecorated operation gives it its primal's type, and so must a route: a cotangent of another type changes the
  type of what the caller's code adds it to (an optimizer's update of a parameter, then that parameter in the
  next step). A primal of no mesh (made outside ``jax.set_mesh``) gets its cotangent whole on ``mesh``: a type of
  no mesh would leave the layout to XLA, which keeps the backward's split.
  """
  if not explicit(mesh) or not jax.numpy.issubdtype(x.dtype, jax.numpy.inexact):
    return x
  sharding = jax.typeof(x).sharding
  if getattr(sharding, "mesh", None) is None or sharding.mesh.empty:
    sharding = NamedSharding(mesh, PartitionSpec())
  return _typed_cotangent(x, sharding)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _typed_cotangent(x, sharding):
  return x


def _typed_cotangent_fwd(x, sharding):
  return x, None


def _typed_cotangent_bwd(sharding, _, ct):
  return (jax.sharding.reshard(ct, sharding),)


_typed_cotangent.defvjp(_typed_cotangent_fwd, _typed_cotangent_bwd)


def _split(y) -> bool:
  """Whether ``y``'s sharding type splits a dimension."""
  spec = getattr(getattr(jax.typeof(y), "sharding", None), "spec", None)
  return spec is not None and any(p is not None for p in spec)


def output_spec(schedule) -> PartitionSpec:
  """The layout a compiled schedule's output leaves in, over the output's own dims: its stored layout, a cropped
  (padded) dimension whole, a flattened dimension split on a minor axis whole (what ``lower`` gives it)."""
  out, plan = schedule.program.writes, schedule.plan()
  spec = plan.spec(out.name)
  cropped = [d for d, (a, e) in enumerate(zip(out.axes, out.canonical_shape)) if schedule.padded.get(a, e) != e]
  spec = whole(spec, len(out.axes), cropped)
  groups = [len(d) for d in out.dims]
  merged = axes_to_groups(spec, groups, out.canonical_shape, schedule.levels)
  if merged is None:
    merged = axes_to_groups(whole(spec, len(out.axes), minor_dims(groups)), groups, out.canonical_shape,
                            schedule.levels)
  return merged
