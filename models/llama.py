"""A Llama-3-style decoder in Flax NNX: RMSNorm, GQA attention with rotary embeddings, SwiGLU MLP.

The math lives in plain functions (``rms_norm``, ``rotary``, ``swiglu``,
``attend``) that the modules and the graph-level plan (``models.block_graph``)
share. ``Attention`` follows ``nnx.MultiHeadAttention``'s convention of an
``attention_fn`` attribute, so ``jaxmercury.distribute`` routes it.
``LlamaConfig.sharding`` (a ``Sharding``) shards the model as a user does on
JAX's default mesh (Explicit axes): FSDP weights and sequence-split
activations.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn.linear import default_embed_init
from jax.sharding import PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class Sharding:
  """How a user shards the model on a mesh of Explicit axes (``jax.make_mesh``'s default, under ``jax.set_mesh``).

  FSDP: every weight matrix is stored split along its first dimension over
  ``axes`` and gathered (``jax.sharding.reshard`` to unsplit) right before it
  is used, so that its gradient is reduce-scattered back to the split; the
  norms' scales stay whole. Sequence parallelism: the tokens are split along
  the sequence over ``axes`` before the embedding lookup, and every
  activation after it stays so split. Attention is written out (scores,
  causal mask, softmax, values), each product given the ``out_sharding`` that
  keeps the queries' split: on Explicit axes JAX refuses
  ``jax.nn.dot_product_attention`` of sequence-split keys (both products'
  results would be split twice over one axis). Build the model under
  ``jax.set_mesh``: the weights are placed as they are created.

  Attributes:
    axes: the mesh axis name, or names (major first), that split the weights and the sequence.
  """

  axes: str | tuple[str, ...]

  @property
  def names(self) -> tuple[str, ...]:
    """The mesh axes' names, major first."""
    return (self.axes,) if isinstance(self.axes, str) else tuple(self.axes)

  @property
  def entry(self):
    """``axes`` as one ``PartitionSpec`` entry."""
    return self.names[0] if len(self.names) == 1 else self.names

  def place(self, weight):
    """``weight`` split along its first dimension (FSDP's storage).

    Raises:
      ValueError: no mesh is set (``jax.set_mesh``), or the mesh's ``axes`` do not divide that dimension.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
      raise ValueError("models.llama.Sharding: build the model under jax.set_mesh(mesh); its weights are placed "
                       "split over the mesh as they are created")
    devices = math.prod(mesh.shape[name] for name in self.names)
    if weight.shape[0] % devices:
      raise ValueError(f"models.llama.Sharding: a weight of shape {weight.shape} does not split over mesh axes "
                       f"{self.names} ({devices} devices): its first dimension must be a multiple of {devices}")
    return jax.sharding.reshard(weight, P(self.entry))

  def initializer(self, init):
    """``init`` whose result is placed split (``place``)."""
    return lambda key, shape, dtype: self.place(init(key, shape, dtype))

  def dot_general(self, lhs, rhs, dimension_numbers, **kwargs):
    """``jax.lax.dot_general`` with the weight ``rhs`` gathered first (``nnx.Linear``'s ``dot_general``)."""
    return jax.lax.dot_general(lhs, jax.sharding.reshard(rhs, P()), dimension_numbers, **kwargs)

  def embed(self, table, tokens):
    """The rows of the gathered ``table [vocab, dim]`` at ``tokens [batch, seq]``, split along the sequence."""
    tokens = jax.sharding.reshard(tokens, P(None, self.entry))
    return jax.sharding.reshard(table, P()).at[tokens].get(out_sharding=P(None, self.entry, None))

  def attend(self, query, key, value, *, is_causal: bool = False):
    """Grouped-query attention of sequence-split ``[batch, seq, heads, head_dim]`` arrays, its result so split.

    The keys' split is left to XLA (each product's ``out_sharding`` keeps only the queries'); a causal mask is
    top-left aligned on the global sequence.
    """
    b, t, h, d = query.shape
    s, kv = key.shape[1], key.shape[2]
    grouped = query.reshape(b, t, kv, h // kv, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", grouped, key, preferred_element_type=jnp.float32,
                        out_sharding=P(None, None, None, self.entry, None)) * d ** -0.5
    if is_causal:
      scores = jnp.where(jnp.arange(t)[:, None] >= jnp.arange(s)[None, :], scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(value.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", weights, value, out_sharding=P(None, self.entry))
    return out.reshape(b, t, h, d)


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
    sharding: how the model is sharded on a mesh of Explicit axes (``Sharding``); None: as the arrays come.
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
  sharding: Sharding | None = None

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
  init, sharding = nnx.initializers.normal(n_in ** -0.5), config.sharding
  if sharding is None:
    return nnx.Linear(n_in, n_out, use_bias=False, dtype=config.dtype, param_dtype=config.param_dtype, rngs=rngs,
                      kernel_init=init)
  return nnx.Linear(n_in, n_out, use_bias=False, dtype=config.dtype, param_dtype=config.param_dtype, rngs=rngs,
                    kernel_init=sharding.initializer(init), dot_general=sharding.dot_general)


class Attention(nnx.Module):
  """GQA self-attention with rotary embeddings; ``attention_fn`` computes the attention itself."""

  def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
    self.config = config
    c = config
    self.wq = _linear(c, rngs, c.dim, c.heads * c.head_dim)
    self.wk = _linear(c, rngs, c.dim, c.kv_heads * c.head_dim)
    self.wv = _linear(c, rngs, c.dim, c.kv_heads * c.head_dim)
    self.wo = _linear(c, rngs, c.heads * c.head_dim, c.dim)
    self.attention_fn = attend if c.sharding is None else c.sharding.attend

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
    placed = {} if c.sharding is None else {"embedding_init": c.sharding.initializer(default_embed_init)}
    self.embed = nnx.Embed(c.vocab, c.dim, dtype=c.dtype, param_dtype=c.param_dtype, rngs=rngs, **placed)
    self.blocks = nnx.List([DecoderBlock(c, rngs=rngs) for _ in range(c.layers)])
    self.norm = RMSNorm(c.dim, eps=c.norm_eps, param_dtype=c.param_dtype, rngs=rngs)
    self.lm_head = _linear(c, rngs, c.dim, c.vocab)

  def __call__(self, tokens):
    c = self.config
    x = self.embed(tokens) if c.sharding is None else c.sharding.embed(self.embed.embedding[...], tokens)
    positions = jnp.arange(tokens.shape[1])
    for block in self.blocks:
      x = block(x, positions)
    return self.lm_head(self.norm(x))
