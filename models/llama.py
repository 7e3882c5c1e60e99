"""A Llama-3-style decoder in Flax NNX: RMSNorm, GQA attention with rotary embeddings, SwiGLU MLP.

The math lives in plain functions (``rms_norm``, ``rotary``, ``swiglu``,
``attend``) that the modules and the graph-level plan (``models.block_graph``)
share. ``Attention`` follows ``nnx.MultiHeadAttention``'s convention of an
``attention_fn`` attribute, so ``jaxmercury.distribute`` routes it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Sizes of a Llama-3-style decoder.

  Attributes:
    dim: model (residual) width.
    heads: query heads.
    kv_heads: key/value heads (grouped-query attention).
    head_dim: width of one head.
    hidden: MLP hidden width.
    layers: decoder blocks.
    vocab: vocabulary size.
    rope_theta: rotary embedding base.
    norm_eps: RMSNorm epsilon.
    dtype: activation dtype.
    param_dtype: parameter dtype.
  """

  dim: int
  heads: int
  kv_heads: int
  head_dim: int
  hidden: int
  layers: int
  vocab: int
  rope_theta: float = 500000.0
  norm_eps: float = 1e-5
  dtype: object = jnp.float32
  param_dtype: object = jnp.float32

  def with_dtype(self, dtype) -> "LlamaConfig":
    """The same sizes with activations and parameters in ``dtype``."""
    return dataclasses.replace(self, dtype=dtype, param_dtype=dtype)


CONFIGS = {
    "tiny": LlamaConfig(dim=64, heads=4, kv_heads=2, head_dim=16, hidden=128, layers=2, vocab=256, rope_theta=10000.0),
    "small": LlamaConfig(dim=512, heads=8, kv_heads=4, head_dim=64, hidden=1536, layers=4, vocab=4096),
    "llama3_8b": LlamaConfig(dim=4096, heads=32, kv_heads=8, head_dim=128, hidden=14336, layers=32, vocab=128256),
    "llama3_70b": LlamaConfig(dim=8192, heads=64, kv_heads=8, head_dim=128, hidden=28672, layers=80, vocab=128256),
}


def rms_norm(x, weight, eps: float):
  """``x / rms(x) * weight`` over the last dimension, computed in float32."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (y * weight.astype(jnp.float32)).astype(x.dtype)


def rotary(x, positions, theta: float):
  """Rotary embedding of ``x [batch, seq, heads, head_dim]`` at ``positions [seq]`` (rotate-half pairing)."""
  d = x.shape[-1]
  freqs = theta ** (-jnp.arange(0, d, 2, dtype=jnp.float32) / d)
  angles = positions.astype(jnp.float32)[:, None] * freqs[None, :]
  cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[None, :, None, :]
  sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[None, :, None, :]
  x32 = x.astype(jnp.float32)
  rotated = jnp.concatenate([-x32[..., d // 2:], x32[..., :d // 2]], axis=-1)
  return (x32 * cos + rotated * sin).astype(x.dtype)


def swiglu(gate, up):
  """The SwiGLU activation ``silu(gate) * up``."""
  return jax.nn.silu(gate) * up


def attend(query, key, value, **kwargs):
  """Causal grouped-query attention with the ``attention_fn`` signature (``nnx.dot_product_attention``)."""
  return nnx.dot_product_attention(query, key, value, **kwargs)


class RMSNorm(nnx.Module):
  """Root-mean-square normalization with a learned scale."""

  def __init__(self, dim: int, *, eps: float, param_dtype, rngs: nnx.Rngs):
    del rngs
    self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
    self.eps = eps

  def __call__(self, x):
    return rms_norm(x, self.weight[...], self.eps)


def _linear(config: LlamaConfig, rngs: nnx.Rngs, n_in: int, n_out: int) -> nnx.Linear:
  return nnx.Linear(n_in, n_out, use_bias=False, dtype=config.dtype, param_dtype=config.param_dtype, rngs=rngs,
                    kernel_init=nnx.initializers.normal(n_in ** -0.5))


class Attention(nnx.Module):
  """GQA self-attention with rotary embeddings; ``attention_fn`` computes the attention itself."""

  def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
    self.config = config
    c = config
    self.wq = _linear(c, rngs, c.dim, c.heads * c.head_dim)
    self.wk = _linear(c, rngs, c.dim, c.kv_heads * c.head_dim)
    self.wv = _linear(c, rngs, c.dim, c.kv_heads * c.head_dim)
    self.wo = _linear(c, rngs, c.heads * c.head_dim, c.dim)
    self.attention_fn = attend

  def __call__(self, x, positions):
    c = self.config
    b, s, _ = x.shape
    q = rotary(self.wq(x).reshape(b, s, c.heads, c.head_dim), positions, c.rope_theta)
    k = rotary(self.wk(x).reshape(b, s, c.kv_heads, c.head_dim), positions, c.rope_theta)
    v = self.wv(x).reshape(b, s, c.kv_heads, c.head_dim)
    o = self.attention_fn(q, k, v, is_causal=True)
    return self.wo(o.reshape(b, s, c.heads * c.head_dim))


class MLP(nnx.Module):
  """SwiGLU feed-forward: ``w_down(silu(w_gate x) * w_up x)``."""

  def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
    c = config
    self.w_gate = _linear(c, rngs, c.dim, c.hidden)
    self.w_up = _linear(c, rngs, c.dim, c.hidden)
    self.w_down = _linear(c, rngs, c.hidden, c.dim)

  def __call__(self, x):
    return self.w_down(swiglu(self.w_gate(x), self.w_up(x)))


class DecoderBlock(nnx.Module):
  """``x + attention(norm(x))``, then ``+ mlp(norm(.))``."""

  def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
    c = config
    norm = functools.partial(RMSNorm, c.dim, eps=c.norm_eps, param_dtype=c.param_dtype, rngs=rngs)
    self.attention_norm = norm()
    self.attention = Attention(c, rngs=rngs)
    self.mlp_norm = norm()
    self.mlp = MLP(c, rngs=rngs)

  def __call__(self, x, positions=None):
    positions = jnp.arange(x.shape[1]) if positions is None else positions
    x = x + self.attention(self.attention_norm(x), positions)
    return x + self.mlp(self.mlp_norm(x))


class Llama(nnx.Module):
  """Token embedding, ``config.layers`` decoder blocks, final norm and the output projection."""

  def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
    c = config
    self.config = c
    self.embed = nnx.Embed(c.vocab, c.dim, dtype=c.dtype, param_dtype=c.param_dtype, rngs=rngs)
    self.blocks = nnx.List([DecoderBlock(c, rngs=rngs) for _ in range(c.layers)])
    self.norm = RMSNorm(c.dim, eps=c.norm_eps, param_dtype=c.param_dtype, rngs=rngs)
    self.lm_head = _linear(c, rngs, c.dim, c.vocab)

  def __call__(self, tokens):
    x = self.embed(tokens)
    positions = jnp.arange(tokens.shape[1])
    for block in self.blocks:
      x = block(x, positions)
    return self.lm_head(self.norm(x))
