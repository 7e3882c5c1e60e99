"""A block's segment ids as cuDNN's packed layout: documents as (offset, length) segments, in the graph, static shapes.

Per batch row, the queries' ids and the keys' ids are cut into runs of equal
ids; a query run and the key run of the same id are one segment. ``segments``
gives each row's segments (query start and length, key start and length),
each position's segment, and whether an id forms several runs (a conflict: the
layout takes a document as one run). cuDNN takes at most M segments per row
in one call (``[rows, M]`` tables): a row's segments are taken M at a time in
"waves" (``waves``, ``table``); ``rows_of`` and ``stats_of`` convert between
cuDNN's softmax statistics of a wave (``[rows * M, heads, length]``, one slot
per segment, numbered across the rows, by position within the segment) and
each query's log-sum-exp.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp


# ------------------------------------------------------------------ segments from the ids (graph side)
class Segments(NamedTuple):
  """A block's segments: per row, segment ``c`` is query run ``[q_start, q_start + q_len)`` with key run
  ``[kv_start, kv_start + kv_len)`` (arrays [b, i], zero past ``count``); ``q_seg`` [b, i] and ``kv_seg`` [b, j]
  give each position's segment (-1: none); ``conflict`` [b]: an id with several runs on a side that has it on the
  other (or, ``aligned``, a segment whose queries and keys start apart)."""

  q_start: jax.Array
  q_len: jax.Array
  kv_start: jax.Array
  kv_len: jax.Array
  count: jax.Array
  q_seg: jax.Array
  kv_seg: jax.Array
  conflict: jax.Array


def _runs(ids):
  """One row's runs of equal ids: ``(starts, lengths, ids, run of each position, valid)``, each run array of the
  row's length (valid: the first ``count`` runs)."""
  n = ids.shape[0]
  first = jnp.concatenate([jnp.ones((1,), bool), ids[1:] != ids[:-1]])
  run_of = jnp.cumsum(first, dtype=jnp.int32) - 1
  starts = jnp.nonzero(first, size=n, fill_value=n)[0].astype(jnp.int32)
  valid = jnp.arange(n) <= run_of[-1]
  ends = jnp.concatenate([starts[1:], jnp.full((1,), n, jnp.int32)])
  lengths = jnp.where(valid, ends - starts, 0)
  return starts, lengths, ids[jnp.minimum(starts, n - 1)], run_of, valid


def _lookup(run_ids, valid):
  """``find(x) -> (run, found, again)``: the first valid run of id ``x``, whether there is one, whether there is a
  second."""
  n = run_ids.shape[0]
  order = jnp.lexsort((jnp.arange(n), ~valid, run_ids))  # by id, valid runs first
  ids, ok = run_ids[order], valid[order]

  def find(x):
    at = jnp.clip(jnp.searchsorted(ids, x, side="left", method="scan_unrolled"), 0, n - 1)
    nxt = jnp.minimum(at + 1, n - 1)
    found = (ids[at] == x) & ok[at]
    return order[at], found, found & (at + 1 < n) & (ids[nxt] == x) & ok[nxt]
  return find


def _row_segments(q_ids, kv_ids, aligned: bool):
  qs, ql, qid, q_run_of, q_valid = _runs(q_ids)
  ks, kl, kid, k_run_of, k_valid = _runs(kv_ids)
  kr, found, k_again = _lookup(kid, k_valid)(qid)
  found = found & q_valid
  _, _, q_again = _lookup(qid, q_valid)(qid)
  conflict = found & (k_again | q_again)
  if aligned:
    conflict = conflict | (found & (ks[kr] != qs))
  seg_of_run = jnp.where(found, jnp.cumsum(found, dtype=jnp.int32) - 1, -1)
  count = jnp.sum(found, dtype=jnp.int32)
  n = q_ids.shape[0]
  runs = jnp.nonzero(found, size=n, fill_value=0)[0]  # the query run of each segment
  real = jnp.arange(n) < count
  keep = lambda x: jnp.where(real, x, 0)
  seg_of_krun = jnp.full(kv_ids.shape[0], -1, jnp.int32).at[jnp.where(found, kr, kv_ids.shape[0])].set(
      seg_of_run, mode="drop")
  return Segments(keep(qs[runs]), keep(ql[runs]), keep(ks[kr[runs]]), keep(kl[kr[runs]]), count,
                  seg_of_run[q_run_of], seg_of_krun[k_run_of], jnp.any(conflict))


def segments(q_ids, kv_ids, *, aligned: bool) -> Segments:
  """The ``Segments`` of a block's ids (int32 [b, i] and [b, j]); ``aligned``: its segments must start together
  (the causal diagonal)."""
  return jax.vmap(functools.partial(_row_segments, aligned=aligned))(q_ids, kv_ids)

# ------------------------------------------------------------------ one call's M documents per row ("waves")
def waves(segs: Segments, m: int):
  return (jnp.max(segs.count) + m - 1) // m


def table(segs: Segments, w, m: int):
  """Wave ``w``'s segments in JAX's packed layout: ``(q_seqlen, kv_seqlen, q_offsets, kv_offsets)``, int32
  [b, m] and [b, m + 1], -1 past each row's last."""
  n = segs.q_start.shape[1]
  c = w * m + jnp.arange(m)
  real = c[None, :] < segs.count[:, None]
  take = lambda x: jnp.where(real, x[:, jnp.minimum(c, n - 1)], -1).astype(jnp.int32)
  end = lambda x: jnp.concatenate([x, jnp.full((x.shape[0], 1), -1, jnp.int32)], axis=1)
  return take(segs.q_len), take(segs.kv_len), end(take(segs.q_start)), end(take(segs.kv_start))


def in_wave(seg, w, m: int):
  return (seg >= 0) & (seg // m == w)


def _slots(segs: Segments, w, m: int):
  """Each query's slot in wave ``w``'s statistics: ``(segment numbered across the rows, position in it)``, [b, i]
  each (garbage where the query is not in the wave)."""
  here = jnp.clip(segs.count - w * m, 0, m)
  first = jnp.cumsum(here) - here  # the wave's segments of the rows before
  c = jnp.maximum(segs.q_seg, 0)
  start = jnp.take_along_axis(segs.q_start, c, axis=1)
  return first[:, None] + c % m, jnp.arange(c.shape[1])[None, :] - start


def rows_of(stats, segs: Segments, w, m: int):
  """cuDNN's statistics [b * m, heads, i] of wave ``w`` as each query's log-sum-exp [b, i, heads]."""
  g, t = _slots(segs, w, m)
  heads = jnp.arange(stats.shape[1])
  return stats[jnp.clip(g, 0, stats.shape[0] - 1)[..., None], heads, jnp.clip(t, 0, stats.shape[2] - 1)[..., None]]


def stats_of(lse, segs: Segments, w, m: int):
  """Queries' log-sum-exp [b, i, heads] (finite) as wave ``w``'s statistics [b * m, heads, i] (zeros elsewhere)."""
  b, i, heads = lse.shape
  g, t = _slots(segs, w, m)
  g = jnp.where(in_wave(segs.q_seg, w, m), g, b * m)  # out of bounds: dropped
  return jnp.zeros((b * m, heads, i), jnp.float32).at[g[..., None], jnp.arange(heads), t[..., None]].set(
      lse, mode="drop")
