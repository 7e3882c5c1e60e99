"""Sequence-parallel attention baselines in plain JAX, written from their papers.

Every builder takes a mesh and the names of the mesh levels it spreads the
sequence over, and returns a jitted function of global arrays

    f(q [B, S, H, D], k [B, S, KV, D], v [B, S, KV, D]) -> o [B, S, H, D]

whose inputs and output are all sequence-sharded over those levels, major
level first (``P(None, levels)``): the layout the benchmark's callers hold.
``H`` must be a multiple of ``KV`` (MHA when equal, GQA when fewer): query
head ``h`` reads key/value head ``h // (H // KV)``, as in
``jax.nn.dot_product_attention``. A causal mask is top-left aligned on the
global sequence.

* ``context_parallel``: all-gather K and V, attend the local queries to all
  keys (one cuDNN call; causal: one call per key chunk, chunks after the
  rank's queries skipped, the rest merged by their log-sum-exp).
* ``ring``: RingAttention (Liu et al., 2023): keys and values travel around a
  ``ppermute`` ring, each step's transfer issued before the step's blockwise
  attention so the two can overlap; partial results merge by log-sum-exp
  (online softmax). Causal: blocks after the rank's queries are skipped.
* ``ulysses``: DeepSpeed-Ulysses (Jacobs et al., 2023): an all-to-all turns
  sequence-sharded q, k, v into head-sharded full sequences, local attention,
  and an all-to-all back. Key/value heads are repeated when there are fewer
  of them than devices.
* ``usp``: Unified Sequence Parallelism (Fang and Zhao, 2024) on a two-level
  mesh: Ulysses over the inner level, a ring over the outer level.

The local kernel is ``"cudnn"`` (GPU, through JAX's cuDNN flash attention) or
``"xla"`` (any platform, plain ``jax.numpy``). Nothing here comes from
jaxmercury.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


def seq_spec(levels: Sequence[str]) -> P:
  """``P(None, levels)``: dimension 1 (the sequence) split over ``levels``, major first."""
  levels = tuple(levels)
  return P(None, levels[0] if len(levels) == 1 else levels)


def _axis(levels):
  levels = tuple(levels)
  return levels[0] if len(levels) == 1 else levels


def _size(mesh, levels) -> int:
  return math.prod(mesh.shape[lv] for lv in levels)


def _mapped(mesh, levels, body):
  spec = seq_spec(levels)
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec,
                               check_vma=False))


# ------------------------------------------------------------ local kernels


def full_attention(q, k, v, *, causal: bool, impl: str):
  """Attention of whole (aligned) sequences through ``jax.nn.dot_product_attention``."""
  return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=impl)


def _xla_block(q, k, v, causal):
  """(o float32 [B, T, H, D], lse float32 [B, T, H]) of one block, in plain jax.numpy."""
  b, t, h, d = q.shape
  kv = k.shape[2]
  g = h // kv
  qg = q.reshape(b, t, kv, g, d)
  s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) / math.sqrt(d)
  if causal:
    mask = jnp.arange(t)[:, None] >= jnp.arange(k.shape[1])[None, :]
    s = jnp.where(mask, s, -jnp.inf)
  top = jnp.max(s, axis=-1, keepdims=True)
  p = jnp.exp(s - top)
  total = jnp.sum(p, axis=-1, keepdims=True)
  o = jnp.einsum("bkgts,bskd->btkgd", (p / total).astype(v.dtype), v,
                 preferred_element_type=jnp.float32)
  lse = (top + jnp.log(total))[..., 0]  # [b, kv, g, t]
  return o.reshape(b, t, h, d), jnp.transpose(lse, (0, 3, 1, 2)).reshape(b, t, h)


def _cudnn_block(q, k, v, causal):
  """(o, lse float32 [B, T, H]) of one block through cuDNN's flash attention.

  ``jax.nn.dot_product_attention(return_residual=True)`` rounds the
  log-sum-exp to the inputs' dtype, too coarse for merging; JAX's own cuDNN
  wrapper keeps it in float32.
  """
  from jax._src.cudnn import fused_attention_stablehlo as cudnn  # GPU only: lazy (JAX internals, see above)
  mask = cudnn.MaskType.CAUSAL if causal else cudnn.MaskType.NO_MASK
  o, lse = cudnn.dot_product_attention(q, k, v, scale=1.0 / math.sqrt(q.shape[-1]),
                                       mask_type=mask, qkv_layout="BTNH", return_residual=True)
  return o.astype(jnp.float32), jnp.transpose(lse.astype(jnp.float32), (0, 2, 1))


def block_attention(q, k, v, *, causal: bool, impl: str):
  """One block's (o float32 [B, T, H, D], lse float32 [B, T, H]); causal is top-left aligned."""
  return (_cudnn_block if impl == "cudnn" else _xla_block)(q, k, v, causal)


def _hidden(q, k, v):
  b, t, h, d = q.shape
  return jnp.zeros((b, t, h, d), jnp.float32), jnp.full((b, t, h), -jnp.inf, jnp.float32)


def merge(a, b):
  """Online-softmax merge of two partial results ``(o, lse)`` over disjoint keys.

  ``a`` must have a finite log-sum-exp; ``b``'s may be ``-inf`` (no keys).
  """
  (o1, l1), (o2, l2) = a, b
  top = jnp.maximum(l1, l2)  # finite, as l1 is
  w1, w2 = jnp.exp(l1 - top), jnp.exp(l2 - top)
  total = w1 + w2
  o = (o1 * (w1 / total)[..., None] + o2 * (w2 / total)[..., None])
  return o, top + jnp.log(total)


def _visible_or_hidden(visible, q, k, v, impl):
  """The block's unmasked attention when ``visible`` (traced), else nothing (skipped)."""
  return jax.lax.cond(visible, lambda *x: block_attention(*x, causal=False, impl=impl),
                      _hidden, q, k, v)


def _ring(q, k, v, axis, n, causal, impl):
  """RingAttention over one (possibly flattened) mesh axis of ``n`` ranks; float32 (o, lse).

  Rank ``r`` holds query block ``r``; at step ``t`` it holds key block
  ``(r - t) % n``. The transfer for step ``t + 1`` is issued before step
  ``t``'s compute, which does not depend on it.
  """
  r = jax.lax.axis_index(axis)
  perm = [(i, (i + 1) % n) for i in range(n)]
  state = block_attention(q, k, v, causal=causal, impl=impl)  # step 0: the diagonal block
  for t in range(1, n):
    k, v = jax.lax.ppermute((k, v), axis, perm)
    if causal:  # key block (r - t) % n precedes query block r exactly when t <= r
      part = _visible_or_hidden(t <= r, q, k, v, impl)
    else:
      part = block_attention(q, k, v, causal=False, impl=impl)
    state = merge(state, part)
  return state


def _repeat_kv(k, v, ranks):
  """Key/value heads repeated so that ``ranks`` divides them (GQA with few kv heads)."""
  kv = k.shape[2]
  if kv % ranks == 0:
    return k, v
  return jnp.repeat(k, ranks // kv, axis=2), jnp.repeat(v, ranks // kv, axis=2)


def heads_problem(heads: int, kv_heads: int, ranks: int) -> str | None:
  """Why ``heads`` query and ``kv_heads`` key/value heads do not split over ``ranks`` (Ulysses), or None."""
  if heads % ranks:
    return f"{heads} query heads do not split over {ranks} ranks"
  if kv_heads % ranks and ranks % kv_heads:
    return f"{kv_heads} key/value heads neither divide nor are divided by {ranks} ranks"
  return None


def _heads_check(name, heads, kv_heads, ranks):
  if why := heads_problem(heads, kv_heads, ranks):
    raise ValueError(f"{name}: {why}")


def _seq_to_heads(x, axis):
  return jax.lax.all_to_all(x, axis, split_axis=2, concat_axis=1, tiled=True)


def _heads_to_seq(x, axis):
  return jax.lax.all_to_all(x, axis, split_axis=1, concat_axis=2, tiled=True)


# --------------------------------------------------------------- baselines


def context_parallel(mesh, levels, *, causal: bool, impl: str):
  """All-gathered K/V: each rank attends its queries to the whole key sequence.

  Args:
    mesh: the device mesh.
    levels: the mesh levels the sequence is split over, major first.
    causal: top-left-aligned causal mask on the global sequence.
    impl: ``"cudnn"`` or ``"xla"``.

  Returns:
    ``f(q, k, v) -> o``, all ``seq_spec(levels)``.
  """
  axis, n = _axis(levels), _size(mesh, levels)

  def body(q, k, v):
    k = jax.lax.all_gather(k, axis, axis=1, tiled=True)
    v = jax.lax.all_gather(v, axis, axis=1, tiled=True)
    if not causal:
      return full_attention(q, k, v, causal=False, impl=impl)
    r, t = jax.lax.axis_index(axis), q.shape[1]
    chunk = lambda x, c: jax.lax.slice_in_dim(x, c * t, (c + 1) * t, axis=1)
    state = block_attention(q, jax.lax.dynamic_slice_in_dim(k, r * t, t, 1),
                            jax.lax.dynamic_slice_in_dim(v, r * t, t, 1), causal=True, impl=impl)
    for c in range(n - 1):  # chunks before the diagonal one; the rest are hidden
      state = merge(state, _visible_or_hidden(c < r, q, chunk(k, c), chunk(v, c), impl))
    return state[0].astype(q.dtype)

  return _mapped(mesh, levels, body)


def ring(mesh, levels, *, causal: bool, impl: str):
  """RingAttention: K/V blocks passed around a ``ppermute`` ring over ``levels`` (flattened).

  Args and returns as ``context_parallel``.
  """
  axis, n = _axis(levels), _size(mesh, levels)

  def body(q, k, v):
    return _ring(q, k, v, axis, n, causal, impl)[0].astype(q.dtype)

  return _mapped(mesh, levels, body)


def ulysses(mesh, levels, *, causal: bool, impl: str, heads: int, kv_heads: int):
  """DeepSpeed-Ulysses: all-to-all to head-sharded full sequences and back.

  Args:
    heads, kv_heads: the attention's query and key/value heads (checked:
      the query heads must split over the ranks, and the kv heads must divide
      or be divided by their count).
    Others as ``context_parallel``.

  Raises:
    ValueError: the heads do not split over the ranks.
  """
  axis, n = _axis(levels), _size(mesh, levels)
  _heads_check("ulysses", heads, kv_heads, n)

  def body(q, k, v):
    k, v = _repeat_kv(k, v, n)
    q, k, v = (_seq_to_heads(x, axis) for x in (q, k, v))
    return _heads_to_seq(full_attention(q, k, v, causal=causal, impl=impl), axis)

  return _mapped(mesh, levels, body)


def usp(mesh, levels, *, causal: bool, impl: str, heads: int, kv_heads: int):
  """USP on two levels ``(outer, inner)``: Ulysses over ``inner``, RingAttention over ``outer``.

  The sequence is split over both levels, outer major, so the all-to-all over
  the inner level leaves each rank the contiguous sequence block of its outer
  index (for a subset of heads), and the ring over the outer level sees
  blocks in sequence order (the causal skip stays valid).

  Raises:
    ValueError: not two levels, or the heads do not split over the inner level.
  """
  if len(levels) != 2:
    raise ValueError(f"usp needs two mesh levels, got {tuple(levels)}")
  outer, inner = levels
  n_out, n_in = mesh.shape[outer], mesh.shape[inner]
  _heads_check("usp", heads, kv_heads, n_in)

  def body(q, k, v):
    k, v = _repeat_kv(k, v, n_in)
    q, k, v = (_seq_to_heads(x, inner) for x in (q, k, v))
    o = _ring(q, k, v, outer, n_out, causal, impl)[0].astype(q.dtype)
    return _heads_to_seq(o, inner)

  return _mapped(mesh, levels, body)


def local_share(impl: str):
  """One rank's share on one device, no communication: ``f(q, k, v) -> o`` (the compute floor), non-causal."""
  return jax.jit(lambda q, k, v: full_attention(q, k, v, causal=False, impl=impl))
