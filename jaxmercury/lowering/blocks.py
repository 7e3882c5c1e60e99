"""Indexing one loop factor of a dimension that several loop factors tile.

A dimension of extent E1*E2*...*En (factors major first) is viewed as
[E1, ..., En]; taking or placing factor k at an index reshapes, indexes and
flattens back. The outermost factor is a plain slice.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def take(x, dim: int, extents: list[int], pos: int, idx):
  """Slice ``x`` along ``dim`` at index ``idx`` of factor ``pos``."""
  inner = math.prod(extents[pos + 1:])
  if pos == 0:
    return jax.lax.dynamic_slice_in_dim(x, idx * inner, inner, dim)
  shape = x.shape[:dim] + tuple(extents) + x.shape[dim + 1:]
  y = jax.lax.dynamic_index_in_dim(x.reshape(shape), idx, dim + pos, keepdims=False)
  return y.reshape(x.shape[:dim] + (x.shape[dim] // extents[pos],) + x.shape[dim + 1:])


def place(full, part, dim: int, extents: list[int], pos: int, idx):
  """Writes ``part`` into ``full`` along ``dim`` at index ``idx`` of factor ``pos``."""
  inner = math.prod(extents[pos + 1:])
  if pos == 0:
    return jax.lax.dynamic_update_slice_in_dim(full, part.astype(full.dtype), idx * inner, dim)
  shape = full.shape[:dim] + tuple(extents) + full.shape[dim + 1:]
  part_shape = full.shape[:dim] + tuple(1 if k == pos else e for k, e in enumerate(extents)) + full.shape[dim + 1:]
  y = jax.lax.dynamic_update_index_in_dim(
      full.reshape(shape), part.reshape(part_shape).astype(full.dtype), idx, dim + pos)
  return y.reshape(full.shape)


def expand(part, dim: int, extents: list[int], pos: int):
  """A zero array shaped like ``part`` with factor ``pos`` of ``dim`` restored."""
  shape = list(part.shape)
  shape[dim] *= extents[pos]
  return jnp.zeros(shape, part.dtype)
