"""Storage orders of an axis: which true position each stored position holds.

``zigzag`` with ``c`` chunks (``c`` even) stores true chunks in the order
0, c-1, 1, c-2, ...: split over ``c / 2`` ranks, rank ``r`` holds chunks ``r``
and ``c-1-r``, so causal attention gives every rank the same work.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def zigzag_chunk(stored_chunk, chunks: int):
  """The true chunk held at a stored chunk index (works on ints and arrays)."""
  pair, second = stored_chunk // 2, stored_chunk % 2
  return jnp.where(second == 0, pair, chunks - 1 - pair) if not isinstance(stored_chunk, int) else (
      pair if second == 0 else chunks - 1 - pair)


def true_positions(stored, extent: int, chunks: int):
  """True positions of stored positions ``stored`` of an axis of ``extent``."""
  size = extent // chunks
  return zigzag_chunk(stored // size, chunks) * size + stored % size


def permutation(extent: int, chunks: int) -> np.ndarray:
  """``perm[s]``: the true position stored at ``s`` (a static numpy array)."""
  stored = np.arange(extent)
  size = extent // chunks
  pair, second = (stored // size) // 2, (stored // size) % 2
  return np.where(second == 0, pair, chunks - 1 - pair) * size + stored % size
