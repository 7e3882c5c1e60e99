"""Flax's own example models, as their upstream code writes them, for the routing tests.

The attention computations are reproduced line for line from google/flax at
commit 18f8f311c275d57f46d95e41b15aa97b454754c0 (Apache License 2.0), since
they are what ``jaxmercury.distribute``'s matcher must read; the rest keeps
upstream's structure, smaller:

- ``Gemma`` (``examples/gemma/modules.py``: ``Attention``, ``FeedForward``,
  ``Block``; ``examples/gemma/transformer.py``: ``Transformer``,
  ``make_causal_attn_mask``, ``build_positions_from_mask``;
  ``examples/gemma/layers.py``: ``RMSNorm``;
  ``examples/gemma/positional_embeddings.py``: ``apply_rope``), configured as
  ``TransformerConfig.gemma3_1b`` (qk norm, post norms, a sliding-window
  layer then a global one) with grouped heads (8 query heads, 2 kv heads) at
  tiny widths. ``GemmaLM`` is the model as ``examples/gemma/train.py`` calls
  it: the padding mask from the tokens, the positions and the causal mask
  built from it, the logits returned.
- ``VisionTransformer`` (``docs_nnx/examples/vit_training.md``: ``nnx.Conv``
  patches, ``nnx.MultiHeadAttention`` encoders, a class token, a classifier).
- ``MiniGPT`` (``docs_nnx/examples/minigpt.md``: causal
  ``nnx.MultiHeadAttention`` blocks, token and position embeddings, the
  output layer's result resharded like the tokens).
"""

from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

# ------------------------------------------------------------------ Gemma (examples/gemma)
K_MASK = -2.3819763e38  # modules.py
PAD = 0


class AttentionType(enum.Enum):
  GLOBAL = 1
  LOCAL_SLIDING = 2


@dataclasses.dataclass(frozen=True)
class GemmaConfig:
  """The fields of ``transformer_cfg.TransformerConfig`` the modules read, at ``gemma3_1b``'s settings and tiny
  widths; ``num_heads``/``num_kv_heads`` grouped, as the issue's model."""

  num_layers: int = 2
  num_embed: int = 64
  embed_dim: int = 32
  hidden_dim: int = 64
  num_heads: int = 8
  head_dim: int = 8
  num_kv_heads: int = 2
  attention_types: tuple = (AttentionType.LOCAL_SLIDING, AttentionType.GLOBAL)
  sliding_window_size: int = 4
  attn_logits_soft_cap: float | None = None
  final_logit_softcap: float | None = None
  use_post_attn_norm: bool = True
  use_post_ffw_norm: bool = True
  use_qk_norm: bool = True
  local_base_frequency: int = 10_000
  global_base_frequency: int = 1_000_000
  dropout_rate: float = 0.0

  def query_pre_attn_scalar(self) -> float:
    return self.head_dim**-0.5  # BY_ONE_OVER_SQRT_HEAD_DIM


class RMSNorm(nnx.Module):  # layers.py
  def __init__(self, dim: int, *, rngs: nnx.Rngs):
    self.scale = nnx.Param(nnx.initializers.zeros_init()(rngs.params(), dim, jnp.float32))

  def __call__(self, x):
    x = jnp.asarray(x, jnp.float32)
    mean2 = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    normed_inputs = jnp.asarray(x * jax.lax.rsqrt(mean2 + 1e-06), dtype=jnp.float32)
    return normed_inputs * (1.0 + jnp.asarray(self.scale, jnp.float32))


def apply_rope(inputs, positions, head_dim: int, max_wavelength: int = 10_000, scale_factor: float = 1.0):
  """positional_embeddings.py's RoPE."""
  fraction = 2 * jnp.arange(0, head_dim // 2) / head_dim
  timescale = max_wavelength**fraction
  sinusoid_inp = positions[..., jnp.newaxis] / timescale[jnp.newaxis, jnp.newaxis, :]
  sinusoid_inp = sinusoid_inp[..., jnp.newaxis, :]
  sinusoid_inp /= scale_factor
  sin, cos = jnp.sin(sinusoid_inp), jnp.cos(sinusoid_inp)
  first_half, second_half = jnp.split(inputs, 2, axis=-1)
  first_part = first_half * cos - second_half * sin
  second_part = second_half * cos + first_half * sin
  return jnp.concatenate([first_part, second_part], axis=-1).astype(inputs.dtype)


class GemmaAttention(nnx.Module):
  """modules.py's ``Attention`` (no kv cache, no sharding annotations: ``ShardingConfig.no_sharding()``)."""

  def __init__(self, config: GemmaConfig, attn_type: AttentionType, *, rngs: nnx.Rngs):
    features, head_dim = config.embed_dim, config.head_dim
    num_heads, num_kv_heads = config.num_heads, config.num_kv_heads
    self.query_pre_attn_scalar = config.query_pre_attn_scalar()
    self.attn_type = attn_type
    self.sliding_window_size = config.sliding_window_size
    self.attn_logits_soft_cap = config.attn_logits_soft_cap
    self.rope_base_frequency = (config.local_base_frequency if attn_type == AttentionType.LOCAL_SLIDING
                                else config.global_base_frequency)
    self.attn_vec_einsum = nnx.Einsum("BTNH,NHD->BTD", (num_heads, head_dim, features), rngs=rngs)
    self.q_einsum = nnx.Einsum("BTD,NDH->BTNH", (num_heads, features, head_dim), rngs=rngs)
    self.kv_einsum = nnx.Einsum("BTD,CKDH->CBTKH", (2, num_kv_heads, features, head_dim), rngs=rngs)
    self.use_qk_norm = config.use_qk_norm
    if self.use_qk_norm:
      self._query_norm = RMSNorm(head_dim, rngs=rngs)
      self._key_norm = RMSNorm(head_dim, rngs=rngs)
    self.dropout = nnx.Dropout(config.dropout_rate)

  @property
  def head_dim(self):
    return self.attn_vec_einsum.kernel.shape[1]

  @property
  def num_heads(self):
    return self.q_einsum.kernel.shape[0]

  @property
  def num_kv_heads(self):
    return self.kv_einsum.kernel.shape[1]

  def __call__(self, x, segment_pos, attn_mask, rngs=None):
    query_proj = self.q_einsum(x)
    key_proj, value_proj = self.kv_einsum(x)
    if self.use_qk_norm:
      query_proj = self._query_norm(query_proj)
      key_proj = self._key_norm(key_proj)
    query_proj = apply_rope(query_proj, segment_pos, head_dim=self.head_dim, max_wavelength=self.rope_base_frequency)
    query_scaled = query_proj * self.query_pre_attn_scalar
    key_proj = apply_rope(key_proj, segment_pos, head_dim=self.head_dim, max_wavelength=self.rope_base_frequency)

    # From here to the output projection: modules.py's Attention.__call__ as written upstream.
    use_gqa = self.num_heads > self.num_kv_heads and self.num_kv_heads > 1
    if use_gqa:
      # Reshape matrices to enable einsums over groups.
      num_groups = self.num_heads // self.num_kv_heads
      batch_size, seq_size, _, head_dim = query_scaled.shape
      query_scaled = query_scaled.reshape(
        (batch_size, seq_size, self.num_kv_heads, num_groups, head_dim)
      )
      logits = jnp.einsum('BTKGH,BSKH->BTKGS', query_scaled, key_proj)
      logits = logits.reshape(
        (batch_size, seq_size, self.num_heads, -1)
      )
    else:
      logits = jnp.einsum('BTNH,BSNH->BTNS', query_scaled, key_proj)

    if self.attn_logits_soft_cap is not None:
      logits = jnp.tanh(logits / self.attn_logits_soft_cap)
      logits = logits * self.attn_logits_soft_cap
    if self.attn_type == AttentionType.LOCAL_SLIDING:
      if self.sliding_window_size is None:
        raise ValueError(
            'sliding_window_size must be set if attn_type is Local Sliding.'
        )

      # workaround for a bug with triu/tril if all_ones is explicitly sharded
      # all_ones = jnp.ones_like(attn_mask)
      all_ones = jnp.ones(attn_mask.shape, dtype=attn_mask.dtype)
      sliding_mask = jnp.triu(
          all_ones, -1 * self.sliding_window_size + 1
      ) * jnp.tril(all_ones, self.sliding_window_size - 1)
      attn_mask = sliding_mask * attn_mask

    padded_logits = jnp.where((jnp.expand_dims(attn_mask, -2)), logits, K_MASK)
    probs = jax.nn.softmax(padded_logits, axis=-1).astype(key_proj.dtype)

    probs = self.dropout(probs, rngs=rngs)

    if use_gqa:
      # Reshape matrices to enable einsums over groups.
      num_groups = self.num_heads // self.num_kv_heads
      batch_size, seq_size1, _, _ = probs.shape
      probs = probs.reshape(
        (batch_size, seq_size1, self.num_kv_heads, num_groups, -1)
      )
      encoded = jnp.einsum('BTKGS,BSKH->BTKGH', probs, value_proj)
      encoded = encoded.reshape(
        (batch_size, seq_size, self.num_heads, head_dim)
      )
    else:
      encoded = jnp.einsum('BTNS,BSNH->BTNH', probs, value_proj)
    return self.attn_vec_einsum(encoded)


class GemmaFeedForward(nnx.Module):  # modules.py's FeedForward
  def __init__(self, features: int, hidden_dim: int, *, rngs: nnx.Rngs, dropout_rate: float = 0.0):
    init = nnx.initializers.normal()
    self.gate_proj = nnx.Linear(features, hidden_dim, use_bias=False, kernel_init=init, rngs=rngs)
    self.up_proj = nnx.Linear(features, hidden_dim, use_bias=False, kernel_init=init, rngs=rngs)
    self.down_proj = nnx.Linear(hidden_dim, features, use_bias=False, kernel_init=init, rngs=rngs)
    self.dropout = nnx.Dropout(dropout_rate)

  def __call__(self, x, rngs=None):
    activations = nnx.gelu(self.gate_proj(x)) * self.up_proj(x)
    return self.down_proj(self.dropout(activations, rngs=rngs))


class GemmaBlock(nnx.Module):  # modules.py's Block
  def __init__(self, config: GemmaConfig, attn_type: AttentionType, *, rngs: nnx.Rngs):
    d = config.embed_dim
    self.pre_attention_norm = RMSNorm(d, rngs=rngs)
    self.attn = GemmaAttention(config, attn_type, rngs=rngs)
    self.post_attention_norm = RMSNorm(d, rngs=rngs) if config.use_post_attn_norm else None
    self.pre_ffw_norm = RMSNorm(d, rngs=rngs)
    self.mlp = GemmaFeedForward(d, config.hidden_dim, rngs=rngs, dropout_rate=config.dropout_rate)
    self.post_ffw_norm = RMSNorm(d, rngs=rngs) if config.use_post_ffw_norm else None
    self.dropout = nnx.Dropout(config.dropout_rate)

  def __call__(self, x, segment_pos, attn_mask, rngs=None):
    attn_output = self.attn(self.pre_attention_norm(x), segment_pos, attn_mask, rngs=rngs)
    if self.post_attention_norm is not None:
      attn_output = self.post_attention_norm(attn_output)
    x += attn_output
    ffw_outputs = self.mlp(self.pre_ffw_norm(x), rngs=rngs)
    if self.post_ffw_norm is not None:
      ffw_outputs = self.post_ffw_norm(ffw_outputs)
    x += ffw_outputs
    return self.dropout(x, rngs=rngs)


class ScaledEmbed(nnx.Embed):  # modules.py
  def __call__(self, x, out_sharding=None):
    x = super().__call__(x, out_sharding)
    x *= jnp.sqrt(x.shape[-1])
    return x


class Gemma(nnx.Module):
  """transformer.py's ``Transformer`` (no kv cache): ``(last_tokens, positions, attention_mask) -> logits``."""

  def __init__(self, config: GemmaConfig, *, rngs: nnx.Rngs):
    self.embedder = ScaledEmbed(config.num_embed, config.embed_dim, rngs=rngs)
    self.layers = nnx.List([GemmaBlock(config, attn_type, rngs=rngs)
                            for _, attn_type in zip(range(config.num_layers), config.attention_types)])
    self.final_norm = RMSNorm(config.embed_dim, rngs=rngs)
    self.final_logits_softcap = config.final_logit_softcap

  def __call__(self, last_tokens, positions, attention_mask, rngs=None):
    x = self.embedder(last_tokens)
    for layer in self.layers:
      x = layer(x, positions, attention_mask, rngs=rngs)
    logits = self.embedder.attend(self.final_norm(x))
    if self.final_logits_softcap is not None:
      logits /= self.final_logits_softcap
      logits = jnp.tanh(logits) * self.final_logits_softcap
    return logits


def make_causal_attn_mask(input_mask):
  """transformer.py: [B, L, L], causal, no key that is padding."""
  seq_len = input_mask.shape[-1]
  attn_mask = input_mask[..., None, :]
  causal_mask = jnp.tril(jnp.ones((seq_len, seq_len), dtype=jnp.bool_))
  # Prefixes can be attended by all tokens
  attn_mask *= causal_mask[None, ...]
  return attn_mask


def build_positions_from_mask(input_mask):
  """transformer.py: the RoPE positions of the tokens that are not padding."""
  positions = jnp.cumsum(input_mask, axis=-1)
  return positions - (positions >= 1)


class GemmaLM(nnx.Module):
  """``Gemma`` called as ``examples/gemma/train.py`` calls it: masks and positions from the tokens (padding is
  ``PAD``)."""

  def __init__(self, config: GemmaConfig, *, rngs: nnx.Rngs):
    self.transformer = Gemma(config, rngs=rngs)

  def __call__(self, tokens):
    input_mask = tokens > PAD
    positions = build_positions_from_mask(input_mask)
    return self.transformer(tokens, positions, make_causal_attn_mask(input_mask))


def padded_tokens(key, batch: int, length: int, vocab: int, lengths):
  """Tokens ``[batch, length]`` right-padded with ``PAD`` after each row's length."""
  tokens = jax.random.randint(key, (batch, length), 1, vocab)
  return jnp.where(jnp.arange(length)[None] < jnp.asarray(lengths)[:, None], tokens, PAD)


# ------------------------------------------------------------------ ViT (docs_nnx/examples/vit_training.md)
@dataclasses.dataclass(frozen=True)
class ViTSharding:
  """The tutorial's ``ShardingConfig``: none, or FSDP (weights split over ``fsdp``, activations batch-split)."""

  attn_qkvo_weight_ndh: P | None = None
  mlp_weight_df: P | None = None
  mlp_weight_fd: P | None = None
  act_btd: P | None = None
  act_btf: P | None = None
  act_btnh: P | None = None
  act_bc: P | None = None

  @staticmethod
  def fsdp_sharding(fsdp: str = "fsdp"):
    return ViTSharding(attn_qkvo_weight_ndh=P(None, fsdp, None), mlp_weight_df=P(fsdp, None),
                       mlp_weight_fd=P(None, fsdp), act_btd=P(fsdp, None, None), act_btf=P(fsdp, None, None),
                       act_btnh=P(fsdp, None, None, None), act_bc=P(fsdp, None))


@dataclasses.dataclass(frozen=True)
class ViTConfig:
  num_classes: int = 16
  in_channels: int = 3
  img_size: int = 8
  patch_size: int = 4
  num_layers: int = 1
  num_heads: int = 8
  mlp_dim: int = 64
  hidden_size: int = 64
  dropout_rate: float = 0.0
  sharding: ViTSharding = ViTSharding()


class VisionTransformer(nnx.Module):
  def __init__(self, config: ViTConfig, *, rngs: nnx.Rngs):
    n_patches = (config.img_size // config.patch_size) ** 2
    self.patch_embeddings = nnx.Conv(config.in_channels, config.hidden_size,
                                     kernel_size=(config.patch_size, config.patch_size),
                                     strides=(config.patch_size, config.patch_size), padding="VALID", rngs=rngs)
    initializer = jax.nn.initializers.truncated_normal(stddev=0.02)
    self.position_embeddings = nnx.Param(initializer(rngs.params(), (1, n_patches + 1, config.hidden_size)))
    self.dropout = nnx.Dropout(config.dropout_rate)
    self.cls_token = nnx.Param(jnp.zeros((1, 1, config.hidden_size)))
    self.encoder = nnx.Sequential(*[TransformerEncoder(config, rngs=rngs) for _ in range(config.num_layers)])
    self.final_norm = nnx.LayerNorm(config.hidden_size, rngs=rngs)
    self.classifier = nnx.Linear(config.hidden_size, config.num_classes, rngs=rngs)
    self.config = config

  def embed(self, x):
    patches = self.patch_embeddings(x, out_sharding=self.config.sharding.act_btd)
    batch_size = patches.shape[0]
    patches = patches.reshape(batch_size, -1, patches.shape[-1])
    cls_token = jnp.tile(self.cls_token.astype(x.dtype), (batch_size, 1, 1))
    if self.config.sharding.act_btd is not None:
      cls_token = jax.device_put(cls_token, device=self.config.sharding.act_btd)
    x = jnp.concat([cls_token, patches], axis=1)
    return x + self.position_embeddings.astype(x.dtype)

  def __call__(self, x, rngs=None):
    x = self.dropout(self.embed(x), rngs=rngs)
    x = self.final_norm(self.encoder(x, rngs=rngs))
    return self.classifier(x[:, 0], out_sharding=self.config.sharding.act_bc)


class TransformerEncoder(nnx.Module):
  def __init__(self, config: ViTConfig, *, rngs: nnx.Rngs):
    shd = config.sharding
    self.norm1 = nnx.LayerNorm(config.hidden_size, rngs=rngs)
    self.mha = nnx.MultiHeadAttention(num_heads=config.num_heads, in_features=config.hidden_size,
                                      dropout_rate=config.dropout_rate, broadcast_dropout=False, decode=False,
                                      deterministic=False, kernel_metadata={"out_sharding": shd.attn_qkvo_weight_ndh},
                                      out_kernel_metadata={"out_sharding": shd.attn_qkvo_weight_ndh},
                                      keep_rngs=False, rngs=rngs)
    self.norm2 = nnx.LayerNorm(config.hidden_size, rngs=rngs)
    self.mlp_up_proj = nnx.Linear(config.hidden_size, config.mlp_dim,
                                  kernel_metadata={"out_sharding": shd.mlp_weight_df}, rngs=rngs)
    self.mlp_down_proj = nnx.Linear(config.mlp_dim, config.hidden_size,
                                    kernel_metadata={"out_sharding": shd.mlp_weight_fd}, rngs=rngs)
    self.mlp_drop = nnx.Dropout(config.dropout_rate, rngs=rngs)
    self.config = config

  def attn(self, x, rngs=None):
    shd = self.config.sharding
    return self.mha(x, rngs=rngs, out_sharding=shd.act_btd, qkv_sharding=shd.act_btnh)

  def mlp(self, x, rngs=None):
    shd = self.config.sharding
    x = nnx.gelu(self.mlp_up_proj(x, out_sharding=shd.act_btf))
    x = self.mlp_drop(x, rngs=rngs)
    x = self.mlp_down_proj(x, out_sharding=shd.act_btd)
    return self.mlp_drop(x, rngs=rngs)

  def __call__(self, x, rngs=None):
    x = x + self.attn(self.norm1(x), rngs=rngs)
    return x + self.mlp(self.norm2(x), rngs=rngs)


# ------------------------------------------------------------------ MiniGPT (docs_nnx/examples/minigpt.md)
class TransformerBlock(nnx.Module):
  def __init__(self, embed_dim: int, num_heads: int, ff_dim: int, *, rngs: nnx.Rngs, rate: float = 0.1):
    self.mha = nnx.MultiHeadAttention(num_heads=num_heads, in_features=embed_dim, rngs=rngs)
    self.dropout1 = nnx.Dropout(rate=rate, rngs=rngs)
    self.layer_norm1 = nnx.LayerNorm(epsilon=1e-6, num_features=embed_dim, rngs=rngs)
    self.mlp = nnx.Sequential(nnx.Linear(embed_dim, ff_dim, rngs=rngs), nnx.relu,
                              nnx.Linear(ff_dim, embed_dim, rngs=rngs), nnx.Dropout(rate=rate, rngs=rngs))
    self.layer_norm2 = nnx.LayerNorm(epsilon=1e-6, num_features=embed_dim, rngs=rngs)

  def __call__(self, inputs):
    attention_output = self.mha(inputs_q=inputs, is_causal=True, decode=False)
    attention_output = self.dropout1(attention_output)
    out1 = self.layer_norm1(inputs + attention_output)
    return self.layer_norm2(out1 + self.mlp(out1))


class TokenAndPositionEmbedding(nnx.Module):
  def __init__(self, maxlen: int, vocab_size: int, embed_dim: int, *, rngs: nnx.Rngs):
    self.token_emb = nnx.Embed(num_embeddings=vocab_size, features=embed_dim, rngs=rngs)
    self.pos_emb = nnx.Embed(num_embeddings=maxlen, features=embed_dim, rngs=rngs)

  def __call__(self, x):
    positions = jnp.arange(0, x.shape[1])[None, :]
    return self.token_emb(x, out_sharding=jax.typeof(x).sharding) + self.pos_emb(positions)


class MiniGPT(nnx.Module):
  def __init__(self, maxlen: int, vocab_size: int, embed_dim: int, num_heads: int, feed_forward_dim: int,
               num_transformer_blocks: int, rngs: nnx.Rngs):
    self.embedding_layer = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim, rngs=rngs)
    self.transformer_blocks = nnx.Sequential(*[TransformerBlock(embed_dim, num_heads, feed_forward_dim, rngs=rngs)
                                               for _ in range(num_transformer_blocks)])
    self.output_layer = nnx.Linear(in_features=embed_dim, out_features=vocab_size, rngs=rngs)

  def __call__(self, inputs):
    x = self.transformer_blocks(self.embedding_layer(inputs))
    return jax.sharding.reshard(self.output_layer(x), jax.typeof(inputs).sharding)
