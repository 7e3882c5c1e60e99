"""Packed sequences: rows of documents told apart by segment ids, and what schedules need to know of them.

A packed row holds several documents; a query keeps only the keys of its
own document (``q_segment_ids == kv_segment_ids``). Three things follow
from the ids alone, before any attention is computed:

* ``keeps``: whether a block of queries and a block of keys keep any pair,
  from each id's range of query positions in the block (sorted once per
  block): exact where every document's queries are consecutive positions
  of the block (packing), a superset otherwise. Rings decide from it which
  steps run (``lowering.nest``); it is written once for NumPy and JAX.
* ``balanced_order``: a storage order of a row that gives every rank of a
  zigzag split the same kept pairs: each document's positions spread evenly
  over the chunks, in their order (``Schedule.balance``).
* ``kept_pairs``: how many pairs queries keep (the printout's and the cost
  model's count of the work that runs).

``random_packing`` draws the rows a tune times packed attention on.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxmercury.programs.masks import KV_SEGMENTS, PAD_QUERY_SEGMENT, Q_SEGMENTS

SHORTEST, LONGEST = 64, 4  # random_packing's document lengths: row length / 64 to row length / 4


def document_lengths(length: int) -> tuple[int, int]:
  """The shortest and longest document ``random_packing`` puts in a row of ``length``."""
  shortest = max(1, length // SHORTEST)
  return shortest, max(shortest, length // LONGEST)


@functools.partial(jax.jit, static_argnums=(1, 2))
def random_packing(key, batch: int, length: int):
  """Segment ids int32 [batch, length] of rows packed with documents of lengths drawn uniformly from
  ``document_lengths(length)`` (ids 0, 1, ... in order; the last document cut at the row's end)."""
  shortest, longest = document_lengths(length)
  docs = length // shortest + 1
  ends = jnp.cumsum(jax.random.randint(key, (batch, docs), shortest, longest + 1), axis=1)
  return jax.vmap(lambda e: jnp.searchsorted(e, jnp.arange(length), side="right"))(ends).astype(jnp.int32)


def packed_inputs(names: tuple[str, ...], key, inputs: tuple) -> tuple:
  """``inputs`` (of the read buffers ``names``) with the segment ids random packings (an attention program's
  ``Program.sample``): one packing for queries and keys of one length, one each otherwise."""
  out = dict(zip(names, inputs))
  (b, t), s = out[Q_SEGMENTS].shape, out[KV_SEGMENTS].shape[1]
  keys = jax.random.split(jax.random.fold_in(key, 0x5E6), 2)
  out[Q_SEGMENTS] = random_packing(keys[0], b, t)
  out[KV_SEGMENTS] = out[Q_SEGMENTS] if s == t else random_packing(keys[1], b, s)
  return tuple(out[n] for n in names)


# ------------------------------------------------------------------ which blocks keep a pair
def keeps(xp, q_ids, q_pos, q_real, k_ids, k_pos, k_real, band):
  """Whether one row's block of queries and block of keys keep a pair (1-D arrays; ``xp``: ``numpy`` or
  ``jax.numpy``).

  A key keeps a pair when queries of its id lie in the band around it, judged by the smallest and largest
  position of those queries in the block (the queries of one id sorted once): exact where each id's queries
  are consecutive positions, as a packed row's documents are.

  Args:
    q_ids, q_pos, q_real: the queries' segment ids, true positions and which are real (not padding).
    k_ids, k_pos, k_real: the keys'.
    band: ``(lo, hi)``: pairs ``lo <= query - key <= hi`` are kept (None: unbounded).
  """
  q_ids = xp.where(q_real, q_ids, PAD_QUERY_SEGMENT)  # an id no key has
  order = xp.lexsort((q_pos, q_ids))
  ids, pos = q_ids[order], q_pos[order]
  search = np.searchsorted if xp is np else functools.partial(jnp.searchsorted, method="scan_unrolled")  # no loop
  first = search(ids, k_ids, side="left")
  last = search(ids, k_ids, side="right") - 1
  n = ids.shape[0]
  kept = k_real & (last >= first)
  lo, hi = band
  if lo is not None:
    kept = kept & (pos[xp.clip(last, 0, n - 1)] - k_pos >= lo)
  if hi is not None:
    kept = kept & (pos[xp.clip(first, 0, n - 1)] - k_pos <= hi)
  return xp.any(kept)


# ------------------------------------------------------------------ the balanced order
def balanced_order(q_ids, kv_ids, chunks: int):
  """``perm`` int32 [batch, length]: the position of the row that each stored position holds, before a zigzag
  split into ``chunks`` chunks (``Schedule.balance``).

  Each segment's positions are ranked by the middle of their share of the segment (``(2 offset + 1) / (2
  length)``), cut into ``chunks`` equal chunks in that rank, and each chunk keeps the row's order: every chunk
  holds about ``1 / chunks`` of every segment, in the segment's order, so a zigzag split gives each rank the
  same kept pairs of a causal mask (and of none), and a segment's positions keep their order (a causal mask
  compares stored positions as it would true ones). A row whose keys have an id that its queries have only at
  other positions keeps its order (identity): the order would not keep those pairs' order.

  Args:
    q_ids, kv_ids: int [batch, length] segment ids (one length: self-attention).
    chunks: the zigzag chunks; must divide ``length``.
  """
  return jax.vmap(lambda q, k: _balanced_row(q, k, chunks))(jnp.asarray(q_ids), jnp.asarray(kv_ids))


def _balanced_row(q, k, chunks: int):
  n = q.shape[0]
  at = jnp.arange(n, dtype=jnp.int32)
  order = jnp.lexsort((at, q))
  ids = q[order]
  start = jnp.searchsorted(ids, ids, side="left")
  size = jnp.searchsorted(ids, ids, side="right") - start
  share = jnp.zeros(n, jnp.float32).at[order].set(((2 * (at - start) + 1) / (2 * size)).astype(jnp.float32))
  chunk = jnp.zeros(n, jnp.int32).at[jnp.lexsort((at, share))].set(at * chunks // n)
  perm = jnp.lexsort((at, chunk)).astype(jnp.int32)
  found = jnp.searchsorted(ids, k)
  foreign = (k != q) & (ids[jnp.clip(found, 0, n - 1)] == k)  # a key id the queries hold at other positions
  return jnp.where(jnp.any(foreign), at, perm)


# ------------------------------------------------------------------ counting kept pairs (NumPy)
def kept_pairs(q_ids, q_pos, kv_ids, kv_pos, band) -> np.ndarray:
  """For each query of one row, how many keys it keeps: keys of its segment id within ``band`` of it.

  Args:
    q_ids, q_pos: the queries' ids and true positions (1-D).
    kv_ids, kv_pos: the keys'.
    band: ``(lo, hi)`` as ``keeps``.
  """
  q_ids, kv_ids = np.asarray(q_ids, np.int64), np.asarray(kv_ids, np.int64)
  q_pos, kv_pos = np.asarray(q_pos, np.int64), np.asarray(kv_pos, np.int64)
  stride = int(max(q_pos.max(initial=0), kv_pos.max(initial=0))) + 1
  lo, hi = band
  lo = -stride if lo is None else max(lo, -stride)
  hi = stride if hi is None else min(hi, stride)
  ids, rank = np.unique(np.concatenate([q_ids, kv_ids]), return_inverse=True)
  q_rank, k_rank = rank[:len(q_ids)], rank[len(q_ids):]
  span = 3 * stride + 1  # id-major keys: positions of one id never reach the next id's
  keys = np.sort(k_rank * span + kv_pos + stride)
  top = np.searchsorted(keys, q_rank * span + q_pos - lo + stride, side="right")
  bottom = np.searchsorted(keys, q_rank * span + q_pos - hi + stride, side="left")
  return top - bottom
