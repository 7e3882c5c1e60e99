"""cuDNN's packed attention stood in by XLA on CPU, as JAX documents its packed layout and as XLA lays out its
statistics: rows outside every segment are NaN (cuDNN leaves them unwritten), the statistics [b * m, heads, t] are
numbered by segment across the rows (-1 entries skipped) and NaN past each segment's length.

``cpu_packed`` (a fixture where imported) offers the kernel on CPU devices, any dtype, its cuDNN calls stood in, and
returns the list of calls that ran (``"forward"``, ``"backward"`` each with its mask: ``causal``, ``window``,
``padding``)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmercury.kernels import registry
from jaxmercury.kernels.attention import cudnn_packed


def _segment_of(offsets, lengths, n):
  """Each position's segment [b, n] (-1: none) and its position in it, from JAX's packed layout."""
  m = lengths.shape[1]
  starts, pos = offsets[:, :m, None], jnp.arange(n)
  inside = (starts >= 0) & (lengths[:, :, None] >= 0) & (starts <= pos) & (pos < starts + lengths[:, :, None])
  seg = jnp.where(inside.any(1), jnp.argmax(inside, axis=1), -1)
  return seg, pos - jnp.take_along_axis(offsets[:, :m], jnp.maximum(seg, 0), axis=1)


def _scores(q, k, q_seqlen, kv_seqlen, q_offsets, kv_offsets, causal, window):
  """Scaled scores [b, hk, g, t, s] float32, -inf outside segments and cuDNN's masks; the segment maps."""
  b, t, n, d = q.shape
  s, hk = k.shape[1], k.shape[2]
  qseg, qpos = _segment_of(q_offsets, q_seqlen, t)
  kseg, kpos = _segment_of(kv_offsets, kv_seqlen, s)
  keep = (qseg[:, :, None] == kseg[:, None, :]) & (qseg[:, :, None] >= 0)
  if causal:
    keep = keep & (qpos[:, :, None] >= kpos[:, None, :])
  if window is not None:
    assert causal
    keep = keep & (qpos[:, :, None] - kpos[:, None, :] < window)
  qf = q.astype(jnp.float32).reshape(b, t, hk, n // hk, d)
  sc = jnp.einsum("bthgd,bshd->bhgts", qf, k.astype(jnp.float32)) / np.sqrt(d)
  return jnp.where(keep[:, None, None], sc, -jnp.inf), qseg, qpos, kseg


def _slots(q_seqlen, qseg):
  """Each query's statistics row: its segment numbered across the rows (skipping -1 entries)."""
  real = q_seqlen >= 0
  number = (jnp.cumsum(real.reshape(-1)) - 1).reshape(real.shape)
  return jnp.where(qseg >= 0, jnp.take_along_axis(number, jnp.maximum(qseg, 0), axis=1), real.size)


def packed(q, k, v, q_seqlen, kv_seqlen, q_offsets, kv_offsets, causal, window):
  b, t, n, d = q.shape
  sc, qseg, qpos, _ = _scores(q, k, q_seqlen, kv_seqlen, q_offsets, kv_offsets, causal, window)
  lse = jax.nn.logsumexp(sc, axis=-1)  # [b, hk, g, t]
  o = jnp.einsum("bhgts,bshd->bthgd", jnp.exp(sc - lse[..., None]), v.astype(jnp.float32)).reshape(b, t, n, d)
  o = jnp.where((qseg >= 0)[..., None, None], o, jnp.nan).astype(q.dtype)
  rows = jnp.transpose(lse.reshape(b, n, t), (0, 2, 1))  # [b, t, n]
  stats = jnp.full((q_seqlen.size, n, t), jnp.nan, jnp.float32)
  stats = stats.at[_slots(q_seqlen, qseg)[..., None], jnp.arange(n), qpos[..., None]].set(rows, mode="drop")
  return o, stats


def packed_backward(q, k, v, o, do, stats, q_seqlen, kv_seqlen, q_offsets, kv_offsets, causal, window):
  b, t, n, d = q.shape
  hk = k.shape[2]
  f32 = lambda x: x.astype(jnp.float32)
  sc, qseg, qpos, kseg = _scores(q, k, q_seqlen, kv_seqlen, q_offsets, kv_offsets, causal, window)
  slot = jnp.clip(_slots(q_seqlen, qseg), 0, stats.shape[0] - 1)
  lse = stats[slot[..., None], jnp.arange(n), jnp.clip(qpos, 0, t - 1)[..., None]]  # [b, t, n]
  lse = jnp.transpose(lse, (0, 2, 1)).reshape(b, hk, n // hk, t)
  p = jnp.where(jnp.isfinite(sc), jnp.exp(sc - lse[..., None]), 0.0)
  grouped = lambda x: f32(x).reshape(b, t, hk, n // hk, d)
  delta = jnp.einsum("bthgd,bthgd->bhgt", grouped(do), grouped(o))
  ds = p * (jnp.einsum("bthgd,bshd->bhgts", grouped(do), f32(v)) - delta[..., None])
  scale = 1 / np.sqrt(d)
  dq = jnp.einsum("bhgts,bshd->bthgd", ds, f32(k)).reshape(b, t, n, d) * scale
  dk = jnp.einsum("bhgts,bthgd->bshd", ds, grouped(q)) * scale
  dv = jnp.einsum("bhgts,bthgd->bshd", p, grouped(do))
  rows, keys = (qseg >= 0)[..., None, None], (kseg >= 0)[..., None, None]
  unwritten = lambda keep, x, like: jnp.where(keep, x, jnp.nan).astype(like.dtype)
  return unwritten(rows, dq, q), unwritten(keys, dk, k), unwritten(keys, dv, v)


def _kind(causal, window) -> str:
  return "window" if window is not None else "causal" if causal else "padding"


@pytest.fixture
def cpu_packed(monkeypatch):
  ran = []

  def forward(*args):
    kind = _kind(*args[-2:])
    jax.debug.callback(lambda: ran.append(f"forward {kind}"))
    return packed(*args)

  def backward(*args):
    kind = _kind(*args[-2:])
    jax.debug.callback(lambda: ran.append(f"backward {kind}"))
    return packed_backward(*args)
  monkeypatch.setattr(cudnn_packed, "_packed", forward)
  monkeypatch.setattr(cudnn_packed, "_packed_backward", backward)
  for name in (cudnn_packed.NAME, f"{cudnn_packed.NAME}_dq", f"{cudnn_packed.NAME}_dkv"):
    kernel = registry._KERNELS[name]
    monkeypatch.setitem(registry._KERNELS, name, dataclasses.replace(kernel, platforms=frozenset({"cpu"}),
                                                                     dtypes=None, supports=None))
  return ran
