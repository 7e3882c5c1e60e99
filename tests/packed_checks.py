"""Segment ids, masks and a float32 reference shared by the CPU and GPU tests of the warp-specialized kernels'
masked path (packed sequences, sliding windows)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
from conftest import fresh_key, rel_err

from jaxmercury.programs.packing import random_packing

GRAD_TOL = 2e-2  # bf16 inputs: relative norm error of outputs and gradients


def segment_ids(kind: str, b: int, s: int):
  """int32 ``(q_ids, kv_ids)`` ``[b, s]``, fresh each call, of a kind:

  * ``"packed"``: documents of random lengths (``packing.random_packing``);
  * ``"short"``: documents of 1 to 40 positions, shorter than a tile;
  * ``"long"``: a document of more than half the row, then short ones;
  * ``"orphans"``: packed, but one document's keys carry another id: its queries keep no key;
  * ``"reused"``: ids 0 to 2 at random: no id's positions consecutive (nothing kept whole by ranges);
  * ``"one"``: one document (every id 0).
  """
  rng = np.random.default_rng(int(jax.random.randint(fresh_key(), (), 0, 2 ** 31 - 1)))
  if kind == "packed":
    q = np.asarray(random_packing(fresh_key(), b, s))
  elif kind == "short":
    q = np.stack([np.repeat(np.arange(s), rng.integers(1, 41, s))[:s] for _ in range(b)])
  elif kind == "long":
    first = s // 2 + int(rng.integers(1, s // 4))
    q = np.stack([np.concatenate([np.zeros(first, int), 1 + np.repeat(np.arange(s), rng.integers(1, 60, s))])[:s]
                  for _ in range(b)])
  elif kind == "orphans":
    q = np.asarray(random_packing(fresh_key(), b, s))
    kv = np.where(q == q[:, s // 2:s // 2 + 1], 10 ** 6, q)  # the document at the middle of each row
    return jnp.asarray(q, jnp.int32), jnp.asarray(kv, jnp.int32)
  elif kind == "reused":
    q = rng.integers(0, 3, (b, s))
  elif kind == "one":
    q = np.zeros((b, s), int)
  else:
    raise ValueError(kind)
  q = jnp.asarray(q, jnp.int32)
  return q, q


def mask_array(mb: int, mh: int, s_q: int, s_kv: int, block: int = 64):
  """A fresh boolean mask array ``[mb, mh, s_q, s_kv]`` whose ``block`` x ``block`` blocks are, at random, all
  hidden, all kept or mixed (random pairs, a few rows keeping nothing): tiles of every kind for the kernels'
  summaries at any tile size that ``block`` divides, and some rows of no key."""
  rng = np.random.default_rng(int(jax.random.randint(fresh_key(), (), 0, 2 ** 31 - 1)))
  kinds = rng.integers(0, 3, (mb, mh, s_q // block, s_kv // block))
  mixed = rng.random((mb, mh, s_q, s_kv)) < 0.5
  mixed[..., rng.integers(0, s_q, 3), :] = False
  up = lambda x: np.repeat(np.repeat(x, block, axis=2), block, axis=3)
  return np.where(up(kinds) == 0, False, np.where(up(kinds) == 1, True, mixed))


def keep_mask(q_ids, kv_ids, *, causal=False, window=None, offset=0, s_q=None, s_kv=None):
  """bool ``[b or 1, s_q, s_kv]``: the pairs kept (equal ids where given; ``causal`` and ``window (left, right)``
  on positions, query ``p`` at ``p + offset`` in the keys' frame)."""
  s_q = s_q if q_ids is None else q_ids.shape[1]
  s_kv = s_kv if kv_ids is None else kv_ids.shape[1]
  d = (np.arange(s_q)[:, None] + offset) - np.arange(s_kv)[None, :]
  keep = np.ones((1, s_q, s_kv), bool)
  if q_ids is not None:
    keep = np.asarray(q_ids)[:, :, None] == np.asarray(kv_ids)[:, None, :]
  if causal:
    keep = keep & (d >= 0)
  if window is not None:
    keep = keep & (d <= window[0]) & (d >= -window[1])
  return keep


def by_head(keep):
  """A kept-pairs mask ``[b or 1, s, t]`` (every head's) or ``[b or 1, h or 1, s, t]`` as the latter, NumPy."""
  keep = np.asarray(keep)
  return keep[:, None] if keep.ndim == 3 else keep


def attention(q, k, v, keep):
  """``(out [b, s, h, d], lse [b, h, s])`` float32 of ``q [b, s, h, d]`` over ``k, v [b, t, kv, d]`` keeping the
  pairs ``keep [b or 1, s, t]`` or ``[b or 1, h or 1, s, t]``; a row that keeps no key: ``out = 0``,
  ``lse = -inf``."""
  q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
  g = q.shape[2] // k.shape[2]
  k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
  scores = jnp.einsum("bshd,bthd->bhst", q, k) / math.sqrt(q.shape[-1])
  scores = jnp.where(jnp.asarray(by_head(keep)), scores, -jnp.inf)
  top = jnp.max(scores, axis=-1, keepdims=True)
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  p = jnp.exp(scores - top)
  total = jnp.sum(p, axis=-1)
  out = jnp.einsum("bhst,bthd->bshd", p / jnp.where(total == 0, 1.0, total)[..., None], v)
  return out, jnp.log(total) + top[..., 0]


def inputs(b, s, h, kv, d, s_kv=None, dtype=jnp.bfloat16):
  """Fresh ``q [b, s, h, d]``, ``k, v [b, s_kv, kv, d]`` and a cotangent ``do`` like ``q``."""
  t = s_kv or s
  shapes = [(b, s, h, d), (b, t, kv, d), (b, t, kv, d), (b, s, h, d)]
  return [jax.random.normal(fresh_key(), shape, jnp.float32).astype(dtype) for shape in shapes]


def assert_forward(out, lse, q, k, v, keep, tol=GRAD_TOL):
  """The kernel's ``out`` (``q``'s dtype) and ``lse`` (float32, ``[b, h, s]``) against ``attention``: close where
  a row keeps a key, ``out = 0`` and ``lse = -inf`` where it keeps none, no NaN."""
  want_out, want_lse = attention(q, k, v, keep)
  out, lse = np.asarray(out, np.float32), np.asarray(lse)
  assert out.shape == q.shape and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
  assert not np.isnan(out).any() and not np.isnan(lse).any()
  empty = np.broadcast_to(~by_head(keep).any(axis=-1), lse.shape)  # [b, h, s]
  np.testing.assert_array_equal(np.isneginf(lse), empty)
  assert not np.any(out[np.transpose(empty, (0, 2, 1))])
  assert rel_err(out, want_out) < tol
  finite = np.isfinite(np.asarray(want_lse))
  assert rel_err(lse[finite], np.asarray(want_lse)[finite]) < 1e-3


def reference_grads(q, k, v, do, keep):
  """``(dq, dk, dv)`` float32 of ``attention``'s output, and its ``(out, lse)``."""
  f = lambda q, k, v: attention(q, k, v, keep)
  (out, lse), vjp = jax.vjp(f, *(x.astype(jnp.float32) for x in (q, k, v)))
  return vjp((do.astype(jnp.float32), jnp.zeros_like(lse))), (out, lse)


def assert_grads(got, want, tol=GRAD_TOL):
  """``(dq, dk, dv)`` against ``reference_grads``' (relative norm error under ``tol``), no NaN."""
  for name, g, w in zip(("dq", "dk", "dv"), got, want):
    assert g.shape == w.shape, name
    g = np.asarray(g, np.float32)
    assert not np.isnan(g).any(), name
    err = rel_err(g, w)
    assert err < tol, f"{name}: rel err {err:.3e}"
