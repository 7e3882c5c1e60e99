"""Small models written the way published model code is, for the routing tests.

``Gemma``: the structure of Flax's Gemma example (``nnx.Einsum`` projections
of stacked heads, grouped key-value heads, the query scaled before an
einsum -> mask -> softmax (float32) -> einsum attention, alternating global
(causal) and local (sliding-window) layers, a gated MLP of ``nnx.Einsum``s,
logits from the embedding table); with ``attn_mask`` [batch, q, kv] (causal and
padding, computed by the caller) it masks by that array, its local layers cut to
a two-sided window. ``Decoder``: MaxText's structure (``nnx.Einsum``
projections, ``jax.nn.dot_product_attention(..., is_causal=True)`` with
grouped heads, an ``nnx.Linear`` MLP); with ``segment_ids`` it attends
within the packed sequences (a mask computed from them). ``ScannedDecoder``:
the same layers stacked and applied by ``nnx.scan``. ``plain_attention``:
a function of a parameter dict, no Flax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

DIM, HEADS, KV_HEADS, HEAD_DIM, HIDDEN, VOCAB, WINDOW = 32, 4, 2, 8, 64, 64, 4


def rms_norm(x, scale):
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6) * (1 + scale)).astype(x.dtype)


class GemmaAttention(nnx.Module):
  def __init__(self, local: bool, rngs):
    self.local = local
    self.q_einsum = nnx.Einsum("BTD,DNH->BTNH", (DIM, HEADS, HEAD_DIM), rngs=rngs)
    self.k_einsum = nnx.Einsum("BSD,DKH->BSKH", (DIM, KV_HEADS, HEAD_DIM), rngs=rngs)
    self.v_einsum = nnx.Einsum("BSD,DKH->BSKH", (DIM, KV_HEADS, HEAD_DIM), rngs=rngs)
    self.attn_vec_einsum = nnx.Einsum("BTNH,NHD->BTD", (HEADS, HEAD_DIM, DIM), rngs=rngs)

  def __call__(self, x, attn_mask=None):
    b, t, _ = x.shape
    query = self.q_einsum(x) * HEAD_DIM ** -0.5  # query_pre_attn_scalar
    key, value = self.k_einsum(x), self.v_einsum(x)
    query = query.reshape(b, t, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)
    logits = jnp.einsum("BTKGH,BSKH->BTKGS", query, key).astype(jnp.float32)
    i, j = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
    if attn_mask is None:
      mask = j <= i
      if self.local:
        mask = mask & (i - j < WINDOW)
      mask = mask[None]
    else:  # the caller's [batch, q, kv] mask; a local layer cuts it to a two-sided window, as Gemma does
      mask = attn_mask & ((i - j < WINDOW) & (j - i < WINDOW))[None] if self.local else attn_mask
    logits = jnp.where(mask[:, :, None, None, :], logits, -2.3819763e38)
    probs = jax.nn.softmax(logits, axis=-1).astype(key.dtype)
    encoded = jnp.einsum("BTKGS,BSKH->BTKGH", probs, value).reshape(b, t, HEADS, HEAD_DIM)
    return self.attn_vec_einsum(encoded)


class GemmaBlock(nnx.Module):
  def __init__(self, local: bool, rngs):
    self.pre_attention_norm = nnx.Param(jnp.zeros((DIM,)))
    self.attn = GemmaAttention(local, rngs)
    self.pre_ffw_norm = nnx.Param(jnp.zeros((DIM,)))
    self.gating_einsum = nnx.Einsum("BTD,GDF->GBTF", (2, DIM, HIDDEN), rngs=rngs)
    self.linear = nnx.Einsum("BTF,FD->BTD", (HIDDEN, DIM), rngs=rngs)

  def __call__(self, x, attn_mask=None):
    x = x + self.attn(rms_norm(x, self.pre_attention_norm[...]), attn_mask)
    gate, up = self.gating_einsum(rms_norm(x, self.pre_ffw_norm[...]))
    return x + self.linear(jax.nn.gelu(gate) * up)


class Gemma(nnx.Module):
  def __init__(self, layers: int, rngs):
    self.embedder = nnx.Param(jax.random.normal(rngs.params(), (VOCAB, DIM)) * DIM ** -0.5)
    self.layers = nnx.List([GemmaBlock(local=i % 2 == 0, rngs=rngs) for i in range(layers)])
    self.final_norm = nnx.Param(jnp.zeros((DIM,)))

  def __call__(self, tokens, attn_mask=None):
    x = self.embedder[...][tokens] * DIM ** 0.5
    for layer in self.layers:
      x = layer(x, attn_mask)
    return rms_norm(x, self.final_norm[...]) @ self.embedder[...].T


class DecoderAttention(nnx.Module):
  def __init__(self, rngs):
    self.query = nnx.Einsum("BTD,DNH->BTNH", (DIM, HEADS, HEAD_DIM), rngs=rngs)
    self.key = nnx.Einsum("BSD,DKH->BSKH", (DIM, KV_HEADS, HEAD_DIM), rngs=rngs)
    self.value = nnx.Einsum("BSD,DKH->BSKH", (DIM, KV_HEADS, HEAD_DIM), rngs=rngs)
    self.out = nnx.Einsum("BTNH,NHD->BTD", (HEADS, HEAD_DIM, DIM), rngs=rngs)

  def __call__(self, x, segment_ids=None):
    q, k, v = self.query(x), self.key(x), self.value(x)
    if segment_ids is None:
      o = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    else:
      same = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
      o = jax.nn.dot_product_attention(q, k, v, mask=same, is_causal=True)
    return self.out(o)


class Decoder(nnx.Module):
  def __init__(self, layers: int, rngs):
    self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)
    self.blocks = nnx.List([DecoderAttention(rngs) for _ in range(layers)])
    self.mlp_in = nnx.List([nnx.Linear(DIM, HIDDEN, rngs=rngs) for _ in range(layers)])
    self.mlp_out = nnx.List([nnx.Linear(HIDDEN, DIM, rngs=rngs) for _ in range(layers)])
    self.norm = nnx.RMSNorm(DIM, rngs=rngs)
    self.head = nnx.Linear(DIM, VOCAB, use_bias=False, rngs=rngs)

  def __call__(self, tokens, segment_ids=None):
    x = self.embed(tokens)
    for attn, up, down in zip(self.blocks, self.mlp_in, self.mlp_out):
      x = x + attn(x, segment_ids)
      x = x + down(jax.nn.silu(up(x)))
    return self.head(self.norm(x))


class DecoderLayer(nnx.Module):
  def __init__(self, rngs):
    self.attn = DecoderAttention(rngs)
    self.up = nnx.Linear(DIM, HIDDEN, rngs=rngs)
    self.down = nnx.Linear(HIDDEN, DIM, rngs=rngs)

  def __call__(self, x, segment_ids=None):
    x = x + self.attn(x, segment_ids)
    return x + self.down(jax.nn.silu(self.up(x)))


class ScannedDecoder(nnx.Module):
  """MaxText's scanned layers: the layers' parameters stacked (``nnx.vmap``), applied by ``nnx.scan``."""

  def __init__(self, layers: int, rngs):
    self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)

    @nnx.split_rngs(splits=layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def stack(rngs):
      return DecoderLayer(rngs)

    self.layers = stack(rngs)
    self.norm = nnx.RMSNorm(DIM, rngs=rngs)
    self.head = nnx.Linear(DIM, VOCAB, use_bias=False, rngs=rngs)

  def __call__(self, tokens, segment_ids=None):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def layers(x, layer):
      return layer(x, segment_ids)

    return self.head(self.norm(layers(self.embed(tokens), self.layers)))


def causal_padding_mask(lengths, t):
  """Gemma's attention mask [batch, t, t]: causal, and no key past each row's length (right padding)."""
  i, j = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
  return (j <= i)[None] & (j[None] < jnp.asarray(lengths)[:, None, None])


def plain_params(key):
  ks = jax.random.split(key, 4)
  return {"wq": jax.random.normal(ks[0], (DIM, HEADS * HEAD_DIM)) * DIM ** -0.5,
          "wk": jax.random.normal(ks[1], (DIM, HEADS * HEAD_DIM)) * DIM ** -0.5,
          "wv": jax.random.normal(ks[2], (DIM, HEADS * HEAD_DIM)) * DIM ** -0.5,
          "wo": jax.random.normal(ks[3], (HEADS, HEAD_DIM, DIM)) * DIM ** -0.5}


def plain_attention(params, x):
  """Causal multi-head self-attention of ``x [batch, seq, DIM]``, written with jnp only."""
  b, t, _ = x.shape
  q, k, v = ((x @ params[w]).reshape(b, t, HEADS, HEAD_DIM) for w in ("wq", "wk", "wv"))
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(HEAD_DIM).astype(x.dtype)
  s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
  o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)
  return jnp.einsum("bqhd,hde->bqe", o, params["wo"])


def loss(model, tokens, *extra):
  logits = model(tokens[:, :-1], *extra)
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
