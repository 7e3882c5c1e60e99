"""Running collectives (``analysis.collectives``) on local blocks inside ``jax.shard_map``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import numpy as np

from jaxmercury.analysis import collectives as cl
from jaxmercury.analysis.collectives import Collective, CollectiveError
from jaxmercury.analysis.layouts import Layout
from jaxmercury.lowering import types


def run(x, seq: Sequence[Collective], sizes: Mapping[str, int]):
  """Applies ``seq`` to the local block ``x``; call inside ``jax.shard_map``."""
  for c in seq:
    if c.kind == cl.ALL_REDUCE:
      x = jax.lax.psum(x, c.level)
    elif c.kind == cl.REDUCE_SCATTER:
      x = jax.lax.psum_scatter(x, c.level, scatter_dimension=c.dim, tiled=True)
    elif c.kind == cl.ALL_GATHER:
      x = jax.lax.all_gather(x, c.level, axis=c.dim, tiled=True)
    elif c.kind == cl.ALL_TO_ALL:
      x = jax.lax.all_to_all(x, c.level, split_axis=c.to_dim, concat_axis=c.dim, tiled=True)
    elif c.kind == cl.SLICE:
      size = x.shape[c.dim] // sizes[c.level]
      x = jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(c.level) * size, size, c.dim)
    elif c.kind == cl.SCALE:
      x = x * np.asarray(sizes[c.level], x.dtype)
    else:
      raise CollectiveError(f"unknown collective kind {c.kind!r}")
  return x


def reshard(x, src: Layout, dst: Layout, sizes: Mapping[str, int]):
  """Converts local block ``x`` (inside ``shard_map``) from layout ``src`` to ``dst`` (``collectives.steps``)."""
  return run(x, cl.steps(src, dst), sizes)


def reshard_program(mesh, src: Layout, seq: Sequence[Collective]):
  """``f(x)`` on global arrays: moves ``x`` from ``src`` through ``seq`` (``src`` must not be partial).

  Returns:
    The function and the layout it leaves ``x`` in.
  """
  if src.partial:
    raise CollectiveError("a global array cannot hold partial sums; reduce inside the producer")
  dst = cl.trajectory(src, seq)[-1]
  if not seq:
    return (lambda x: x), dst
  sizes = dict(mesh.shape)

  def f(x):
    x = types.constrain(x, mesh, src.spec)
    return jax.shard_map(lambda b: run(b, seq, sizes), mesh=mesh, in_specs=src.spec, out_specs=dst.spec,
                         check_vma=False)(x)

  return f, dst
