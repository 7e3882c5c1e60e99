"""Small models written the way published model code is, for the routing tests (Flax's own examples, Gemma
among them, are in ``upstream_models``).

``Decoder``: MaxText's structure (``nnx.Einsum`` projections,
``jax.nn.dot_product_attention(..., is_causal=True)`` with grouped heads, an
``nnx.Linear`` MLP); with ``segment_ids`` it attends within the packed
sequences (a mask computed from them). ``ScannedDecoder``: the same layers
stacked and applied by ``nnx.scan``. ``plain_attention``: a function of a
parameter dict, no Flax.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

DIM, HEADS, KV_HEADS, HEAD_DIM, HIDDEN, VOCAB = 32, 4, 2, 8, 64, 64


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
