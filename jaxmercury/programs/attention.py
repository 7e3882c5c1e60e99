"""Multi-head attention (MHA, GQA, MQA) with the log-sum-exp merge over keys."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxmercury.errors import ProgramError
from jaxmercury.ir.dsl import Axis, grid, match_buffer
from jaxmercury.ir.reductions import LogSumExp
from jaxmercury.programs import packing
from jaxmercury.programs.masks import KV_SEGMENTS, MASK, Q_SEGMENTS, AttentionMask
from jaxmercury.programs.operator import DTYPE, Operator, Param


def attention_block(ctx, q, k, v, *extras, causal: bool = False, mask: AttentionMask | None = None):
  """One block of attention in canonical layout.

  Args:
    ctx: the block's ``BlockContext``; gives query/key positions for masks.
    q: [b, i, hk, g, d] queries.
    k: [b, j, hk, d] keys.
    v: [b, j, hk, d] values.
    *extras: the blocks of the mask's buffers (``AttentionMask.buffers``).
    causal: mask keys after the query (top-left aligned, as
      ``jax.nn.dot_product_attention``); the mask when ``mask`` is None.
    mask: the program's ``AttentionMask``.

  Returns:
    ``(out [b, i, hk, g, d], lse [b, i, hk, g])`` in float32; rows that see no
    key get ``out = 0`` and ``lse = -inf``. A block the mask hides wholly is
    skipped, not computed: by its positions, or, for segment ids and mask
    arrays, by its data.
  """
  mask = mask if mask is not None else AttentionMask(causal=causal)
  if mask.data:
    keep = mask.keep(ctx, extras)
    return jax.lax.cond(~jnp.any(keep), lambda q, k, v, keep: empty_state(q, k, v),
                        lambda q, k, v, keep: _attend(q, k, v, keep), q, k, v, keep)
  attend = lambda ctx, q, k, v: _attend(q, k, v, mask.keep(ctx, ()))
  if mask.positional:
    return skip_if_hidden(ctx, attend, empty_state, q, k, v, mask=mask)
  return attend(ctx, q, k, v)


def hidden(ctx, mask: AttentionMask | None = None):
  """Whether the mask's positions hide every pair of the block (default causal: every key after every query)."""
  return (mask if mask is not None else AttentionMask(causal=True)).position_hidden(ctx)


def skip_if_hidden(ctx, compute, empty, *blocks, mask: AttentionMask | None = None):
  """``compute(ctx, *blocks)``, or ``empty(*blocks)`` without computing when the block is ``hidden``."""
  return jax.lax.cond(hidden(ctx, mask), lambda *x: empty(*x), lambda *x: compute(ctx, *x), *blocks)


def empty_state(q, k, v, *extras):
  """The forward state of a hidden block: a zero output and a log-sum-exp of ``-inf``, laid out as ``q`` (with
  Explicit axes, ``cond``'s branches must agree on it)."""
  out = jnp.zeros_like(q, dtype=jnp.float32)
  return out, jnp.full_like(out[..., 0], -jnp.inf)


def _attend(q, k, v, keep):
  """Attention of a block whose kept pairs are ``keep`` (bool, broadcastable to [b, hk, g, i, j])."""
  scale = 1.0 / math.sqrt(q.shape[-1])
  s = jnp.einsum("bihgd,bjhd->bhgij", q, k, preferred_element_type=jnp.float32) * scale
  s = jnp.where(keep, s, -jnp.inf)
  top = jnp.max(s, axis=-1, keepdims=True)
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  p = jnp.exp(s - top)
  total = jnp.sum(p, axis=-1)
  o = jnp.einsum("bhgij,bjhd->bihgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
  denom = jnp.transpose(jnp.where(total == 0, 1.0, total), (0, 3, 1, 2))
  lse = jnp.transpose(top[..., 0] + jnp.log(total), (0, 3, 1, 2))
  return o / denom[..., None], lse


def _workspace(mask: AttentionMask):
  def workspace(sizes):
    """Scores and probabilities of one block in float32, and its kept pairs (a byte each) under a data mask."""
    pairs = sizes["b"] * sizes["hk"] * sizes["g"] * sizes["i"] * sizes["j"]
    return 2 * 4 * pairs + (pairs if mask.data else 0)
  return workspace


def mask_buffers(mask: AttentionMask, axes: dict) -> tuple:
  """The read buffers of ``mask`` (``AttentionMask.buffers``) over the program's ``axes``."""
  out = []
  if mask.segment_ids:
    out += [match_buffer(Q_SEGMENTS, (axes["b"], axes["i"]), jnp.int32),
            match_buffer(KV_SEGMENTS, (axes["b"], axes["j"]), jnp.int32)]
  if mask.mask_axes is not None:
    dims = [(axes["hk"], axes["g"]) if a == "h" else axes[a] for a in mask.mask_axes]
    out.append(match_buffer(MASK, dims, jnp.bool_))
  return tuple(out)


def attention(batch: int, heads: int, kv_heads: int, q_len: int, kv_len: int, head_dim: int,
              causal: bool = False, dtype=jnp.float32, *, window=None, segment_ids: bool = False,
              mask=None, mask_axes=None):
  """The attention program.

  Inputs q [batch, q_len, heads, head_dim], k and v [batch, kv_len, kv_heads,
  head_dim]; output [batch, q_len, heads, head_dim]. ``heads`` must be a
  multiple of ``kv_heads``: query head ``h`` reads kv head ``h // (heads //
  kv_heads)``, so ``kv_heads == heads`` is MHA, fewer is GQA, one is MQA.

  Loops: b, hk (kv head), g (query head within its group), i (query), all
  spatial, and j (key), a reduction merged by log-sum-exp. The head
  dimension d is a block axis.

  Masks (``programs.masks``; they combine, as in ``jax.nn.dot_product_attention``):

  Args:
    causal: keys at or before their query (top-left aligned).
    window: ``local_window_size``: ``(left, right)``, or one int for both; query ``q`` keeps keys ``q - left`` to
      ``q + right``.
    segment_ids: the program also reads ``q_segment_ids [batch, q_len]`` and ``kv_segment_ids [batch, kv_len]``
      (int32); a query keeps the keys of its own segment (packed sequences).
    mask_axes: the program also reads a boolean ``mask`` over these of ``("b", "h", "i", "j")`` (batch, query
      heads, queries, keys; in that order; the others broadcast): ``("b", "i", "j")`` is a [batch, q_len, kv_len]
      mask.
    mask: shorthand for ``mask_axes``: True for a [batch, q_len, kv_len] mask (``("b", "i", "j")``, as Gemma's
      attention passes it), or the axes.

  Extra inputs follow q, k, v in that order.
  """
  if not isinstance(kv_heads, int) or kv_heads < 1:
    raise ProgramError(f"attention: kv_heads must be a positive int, got {kv_heads!r}")
  if not isinstance(heads, int) or heads < 1 or heads % kv_heads:
    raise ProgramError(f"attention: heads ({heads!r}) must be a positive multiple of kv_heads ({kv_heads})")
  if isinstance(window, (int, np.integer)) and not isinstance(window, bool):
    window = (int(window), int(window))
  if mask is not None and mask is not False:
    if mask_axes is not None:
      raise ProgramError("attention: give mask or mask_axes, not both")
    mask_axes = ("b", "i", "j") if mask is True else mask
  mask = AttentionMask(causal=bool(causal), window=window, segment_ids=bool(segment_ids), mask_axes=mask_axes)
  b, hk, g = Axis("b", batch), Axis("hk", kv_heads), Axis("g", heads // kv_heads)
  i, j, d = Axis("i", q_len), Axis("j", kv_len), Axis("d", head_dim)
  q = match_buffer("q", (b, i, (hk, g), d), dtype)
  k = match_buffer("k", (b, j, hk, d), dtype)
  v = match_buffer("v", (b, j, hk, d), dtype)
  o = match_buffer("o", (b, i, (hk, g), d), dtype)
  extras = mask_buffers(mask, dict(b=b, hk=hk, g=g, i=i, j=j))
  if mask.kinds <= {"causal"}:
    statement = (f"o[b, i, hk*g] <- softmax{'_causal' if causal else ''}(q[b, i, hk*g] . k[b, j, hk]) "
                 "v[b, j, hk]")
  else:
    statement = f"o[b, i, hk*g] <- softmax(q[b, i, hk*g] . k[b, j, hk] | {mask.describe()}) v[b, j, hk]"
  reads = (q, k, v) + extras
  sample = functools.partial(packing.packed_inputs, tuple(r.name for r in reads)) if mask.segment_ids else None
  return grid((b, hk, g, i, j), "ssssr", reads=reads, writes=o,
              body=functools.partial(attention_block, mask=mask),
              reduction=LogSumExp(value_axes=("d",)), name=mask.name(), pattern="attention",
              params=dict(batch=batch, heads=heads, kv_heads=kv_heads, q_len=q_len, kv_len=kv_len,
                          head_dim=head_dim, causal=bool(causal), dtype=str(np.dtype(dtype)), **mask.params()),
              flops=4.0 * batch * heads * q_len * kv_len * head_dim * mask.kept_share(q_len, kv_len),
              workspace=_workspace(mask), statement=statement,
              sample=sample)


def _self_attention(*, batch, heads, kv_heads, seq_len, head_dim, causal, dtype):
  return attention(batch, heads, kv_heads, seq_len, seq_len, head_dim, causal=causal, dtype=dtype)


OPERATOR = Operator(
    name="attention", summary="self-attention: MHA, GQA (fewer key/value heads) or MQA (one)",
    build=_self_attention, params=(
        Param(name="batch", default=1, minimum=1, help="batch"),
        Param(name="heads", default=8, minimum=1, help="query heads"),
        Param(name="kv_heads", default=8, minimum=1, help="key/value heads (GQA when fewer, MQA at 1)"),
        Param(name="seq_len", default=256, minimum=1, help="query and key length"),
        Param(name="head_dim", default=32, minimum=1, help="head dimension"),
        Param(name="causal", default=False, help="causal mask"),
        dataclasses.replace(DTYPE, help="element type (cuDNN attention needs a 16-bit type)")))
