"""Multi-head attention (MHA, GQA, MQA) with the log-sum-exp merge over keys."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxmercury.errors import ProgramError
from jaxmercury.ir.dsl import Axis, grid, match_buffer
from jaxmercury.ir.reductions import LogSumExp


def attention_block(ctx, q, k, v, *, causal: bool):
  """One block of attention in canonical layout.

  Args:
    ctx: the block's ``BlockContext``; gives query/key positions for masks.
    q: [b, i, hk, g, d] queries.
    k: [b, j, hk, d] keys.
    v: [b, j, hk, d] values.
    causal: mask keys after the query (top-left aligned, as
      ``jax.nn.dot_product_attention``).

  Returns:
    ``(out [b, i, hk, g, d], lse [b, i, hk, g])`` in float32; rows that see no
    key get ``out = 0`` and ``lse = -inf``. A causal block whose keys all
    follow its queries is skipped, not computed.
  """
  if causal:
    return skip_if_hidden(ctx, functools.partial(_attend, causal=True), _empty_state, q, k, v)
  return _attend(ctx, q, k, v, causal=False)


def hidden(ctx):
  """Whether every key of the block comes after every query (all masked when causal)."""
  return jnp.max(ctx.positions("i")) < jnp.min(ctx.positions("j"))


def skip_if_hidden(ctx, compute, empty, *blocks):
  """``compute(ctx, *blocks)``, or ``empty(*blocks)`` without computing when the block is hidden."""
  return jax.lax.cond(hidden(ctx), lambda *x: empty(*x), lambda *x: compute(ctx, *x), *blocks)


def _empty_state(q, k, v):
  b, i, hk, g, d = q.shape
  return jnp.zeros((b, i, hk, g, d), jnp.float32), jnp.full((b, i, hk, g), -jnp.inf, jnp.float32)


def _attend(ctx, q, k, v, *, causal):
  scale = 1.0 / math.sqrt(q.shape[-1])
  s = jnp.einsum("bihgd,bjhd->bhgij", q, k, preferred_element_type=jnp.float32) * scale
  mask = ctx.valid("j")[None, :]
  if causal:
    mask = mask & (ctx.positions("i")[:, None] >= ctx.positions("j")[None, :])
  s = jnp.where(mask, s, -jnp.inf)
  top = jnp.max(s, axis=-1, keepdims=True)
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  p = jnp.exp(s - top)
  total = jnp.sum(p, axis=-1)
  o = jnp.einsum("bhgij,bjhd->bihgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
  denom = jnp.transpose(jnp.where(total == 0, 1.0, total), (0, 3, 1, 2))
  lse = jnp.transpose(top[..., 0] + jnp.log(total), (0, 3, 1, 2))
  return o / denom[..., None], lse


def _scores_bytes(sizes):
  """Scores and probabilities of one block, in float32."""
  return 2 * 4 * sizes["b"] * sizes["hk"] * sizes["g"] * sizes["i"] * sizes["j"]


def attention(batch: int, heads: int, kv_heads: int, q_len: int, kv_len: int, head_dim: int,
              causal: bool = False, dtype=jnp.float32):
  """The attention program.

  Inputs q [batch, q_len, heads, head_dim], k and v [batch, kv_len, kv_heads,
  head_dim]; output [batch, q_len, heads, head_dim]. ``heads`` must be a
  multiple of ``kv_heads``: query head ``h`` reads kv head ``h // (heads //
  kv_heads)``, so ``kv_heads == heads`` is MHA, fewer is GQA, one is MQA.

  Loops: b, hk (kv head), g (query head within its group), i (query), all
  spatial, and j (key), a reduction merged by log-sum-exp. The head
  dimension d is a block axis.
  """
  if not isinstance(kv_heads, int) or kv_heads < 1:
    raise ProgramError(f"attention: kv_heads must be a positive int, got {kv_heads!r}")
  if not isinstance(heads, int) or heads < 1 or heads % kv_heads:
    raise ProgramError(f"attention: heads ({heads!r}) must be a positive multiple of kv_heads ({kv_heads})")
  b, hk, g = Axis("b", batch), Axis("hk", kv_heads), Axis("g", heads // kv_heads)
  i, j, d = Axis("i", q_len), Axis("j", kv_len), Axis("d", head_dim)
  q = match_buffer("q", (b, i, (hk, g), d), dtype)
  k = match_buffer("k", (b, j, hk, d), dtype)
  v = match_buffer("v", (b, j, hk, d), dtype)
  o = match_buffer("o", (b, i, (hk, g), d), dtype)
  kind = "causal attention" if causal else "attention"
  return grid((b, hk, g, i, j), "ssssr", reads=(q, k, v), writes=o,
              body=functools.partial(attention_block, causal=causal),
              reduction=LogSumExp(value_axes=("d",)), name=kind, pattern="attention",
              params=dict(batch=batch, heads=heads, kv_heads=kv_heads, q_len=q_len, kv_len=kv_len,
                          head_dim=head_dim, causal=causal, dtype=str(np.dtype(dtype))),
              flops=4.0 * batch * heads * q_len * kv_len * head_dim * (0.5 if causal else 1.0),
              workspace=_scores_bytes,
              statement=(f"o[b, i, hk*g] <- softmax{'_causal' if causal else ''}(q[b, i, hk*g] . k[b, j, hk]) "
                         "v[b, j, hk]"))
