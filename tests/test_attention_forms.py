"""The forms of attention code the matcher reads (``jaxmercury.flax.patterns``' declared cases), each built from
the model code that writes it: routed where an operator computes it, equal to the traced program, and otherwise
listed with the one reason that stopped it."""

import functools

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import upstream_models as um
from conftest import fresh_key, make_mesh, rel_err, routable
from flax import nnx

import jaxmercury as jm
from jaxmercury.flax import patterns

MESH = make_mesh("8")


def _q_kv(heads=8, kv_heads=2, seq=16, d=8):
  q = jax.random.normal(fresh_key(), (2, seq, heads, d))
  k, v = (jax.random.normal(fresh_key(), (2, seq, kv_heads, d)) for _ in range(2))
  return q, k, v


def _attention_entries(fn, *args, **kwargs):
  return jm.explain(fn, *args, mesh=MESH, **kwargs).of_kind("attention")


def _routes_alike(fn, *args, tol=1e-5):
  """``fn`` routed: one attention, routed, computing what ``fn`` computes."""
  [e] = _attention_entries(fn, *args)
  assert routable(e), e
  assert rel_err(jax.jit(jm.distribute(fn, mesh=MESH))(*args), jax.jit(fn)(*args)) < tol
  return e


def _gemma_attention(config):
  """Gemma's attention module called as its block calls it, on a padded row's mask (``make_causal_attn_mask``)."""
  layer = um.GemmaAttention(config, um.AttentionType.LOCAL_SLIDING, rngs=nnx.Rngs(0))
  x = jax.random.normal(fresh_key(), (2, 16, config.embed_dim))
  mask = um.make_causal_attn_mask(jnp.arange(16)[None] < jnp.array([[16], [6]]))
  return layer, (x, jnp.broadcast_to(jnp.arange(16), (2, 16)), mask)


def test_grouped_heads():
  """Gemma 3 reshapes its logits [B, T, K, G, S] to [B, T, N, S] before the softmax and back after it
  (examples/gemma/modules.py); nnx.dot_product_attention's weights path does the same over [.., H, T, S]."""
  layer, args = _gemma_attention(um.GemmaConfig())  # its results and training: test_models
  [e] = jm.explain(jm.distribute(layer, mesh=MESH), *args).of_kind("attention")
  assert (routable(e), e.mask, e.shapes) == (True, "band+array", ((2, 16, 8, 8), (2, 16, 2, 8), (2, 16, 2, 8)))
  weights_path = functools.partial(nnx.dot_product_attention, dropout_rate=0.1, deterministic=True, is_causal=True)
  e = _routes_alike(weights_path, *_q_kv())
  assert e.mask == "causal"


def test_soft_cap():
  """Gemma 2 caps its logits, ``jnp.tanh(logits / cap) * cap``: no operator computes it, and explain says so."""
  layer, args = _gemma_attention(um.GemmaConfig(attn_logits_soft_cap=50.0))
  [e] = jm.explain(jm.distribute(layer, mesh=MESH), *args).of_kind("attention")
  assert not e.routed and e.reason == "a soft cap (tanh) on the logits: no operator computes it"
  assert e.module == "" and "GemmaAttention.__call__" in e.where


def test_masks_multiplied():
  """Masks joined by ``*``: Gemma's ``sliding_mask * attn_mask`` of booleans (an ``and``; test_grouped_heads),
  and masks of numbers, ``jnp.where(pad * causal, ...)`` (a test ``!= 0`` of their product), as Flax's float masks
  are combined."""
  def float_masks(q, k, v, lengths):
    pad = (jnp.arange(16)[None] < lengths[:, None]).astype(jnp.float32)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, jnp.repeat(k, 4, axis=2)) / np.sqrt(q.shape[-1])
    s = jnp.where(pad[:, None, None, :] * jnp.tril(jnp.ones((16, 16)))[None, None], s, -1e9)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), jnp.repeat(v, 4, axis=2))

  e = _routes_alike(float_masks, *_q_kv(), jnp.array([16, 11]))
  assert e.mask == "causal+padding"


def _dropout(rate):
  """A hand-written dropout on the attention weights, as ``nnx.Dropout`` writes it."""
  def attend(q, k, v, key):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, jnp.repeat(k, 4, axis=2)) / np.sqrt(q.shape[-1])
    p = jax.nn.softmax(s, -1)
    keep = jax.random.bernoulli(key, 1.0 - rate, p.shape)
    p = jax.lax.select(keep, p / (1.0 - rate), jnp.zeros_like(p))
    return jnp.einsum("bhqk,bkhd->bqhd", p, jnp.repeat(v, 4, axis=2))
  return attend


def test_dropout():
  """A dropout of rate 0 keeps every weight: routed. At a rate above 0 (a hand-written one, the ViT tutorial's
  ``nnx.MultiHeadAttention(dropout_rate=0.1, deterministic=False)``) no operator computes it."""
  e = _routes_alike(_dropout(0.0), *_q_kv(), jax.random.key(0))
  assert e.mask == "none"
  [e] = _attention_entries(_dropout(0.25), *_q_kv(), jax.random.key(0))
  assert not e.routed and e.reason == "dropout on the attention weights (rate 0.25): no operator computes it"
  vit = um.VisionTransformer(um.ViTConfig(dropout_rate=0.1), rngs=nnx.Rngs(0))
  images = jnp.ones((8, 8, 8, 3))
  [e] = jm.explain(jm.distribute(vit, mesh=MESH), images, rngs=nnx.Rngs(1)).of_kind("attention")
  assert not e.routed and e.reason.startswith("dropout on the attention weights (rate 0.1")
  assert e.module == "encoder.layers.0.mha"
  [e] = jm.explain(jm.distribute(um.VisionTransformer(um.ViTConfig(), rngs=nnx.Rngs(0)), mesh=MESH),
                   images).of_kind("attention")
  assert routable(e)  # rate 0: nothing traced


@pytest.fixture
def sow_stores_nothing():
  flax.config.update("nnx_sow_capture_noop", True)
  yield
  flax.config.update("nnx_sow_capture_noop", False)


@pytest.mark.parametrize("kv_heads", [8, 4])
def test_sow_that_stores_nothing(kv_heads, sow_stores_nothing):
  """``MultiHeadAttention(..., sow_weights=True)`` traces the weights path; where the sow stores nothing (outside
  ``nnx.capture`` with ``nnx_sow_capture_noop``) the attention is routed, grouped heads or not."""
  layer = nnx.MultiHeadAttention(num_heads=8, in_features=32, qkv_features=64, num_kv_heads=kv_heads, decode=False,
                                 rngs=nnx.Rngs(0))
  x = jax.random.normal(fresh_key(), (2, 16, 32))
  routed = jm.distribute(layer, mesh=MESH)
  [e] = jm.explain(routed, x, is_causal=True, sow_weights=True).of_kind("attention")
  assert (routable(e), e.mask, e.module) == (True, "causal", "")
  call = nnx.jit(lambda m, x: m(x, is_causal=True, sow_weights=True))
  assert rel_err(call(routed, x), call(layer, x)) < 1e-5


def test_sow_that_stores_the_weights():
  layer = nnx.MultiHeadAttention(num_heads=8, in_features=32, qkv_features=64, num_kv_heads=4, decode=False,
                                 rngs=nnx.Rngs(0))
  [e] = jm.explain(jm.distribute(layer, mesh=MESH), jnp.ones((2, 16, 32)), sow_weights=True).of_kind("attention")
  assert not e.routed and e.reason.startswith("its attention weights are a result of the program")


def test_code_no_case_reads_is_named():
  """A softmax between the scores and values products with code no case reads: listed as attention, its reason
  the first equation that stopped the matcher."""
  def cumulative(q, k, v):
    s = jnp.cumsum(jnp.einsum("bqhd,bkhd->bhqk", q, k), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)

  [e] = _attention_entries(cumulative, *_q_kv(kv_heads=8))
  assert not e.routed and e.reason.startswith("cumsum between the scores and the softmax (tests/test_attention_forms")
  assert e.reason.endswith("no case reads it")


# each declared case: the test built from the code that writes it (test_routing covers the plain forms)
COVERED = {"cast": "test_routing.test_bfloat16_attention_is_routed", "scale": "test_routing.test_attention_forms_"
           "are_found", "transpose": "test_routing.test_attention_forms_are_found", "grouped heads": "test_grouped_heads",
           "mask": "test_masks_multiplied", "soft cap": "test_soft_cap", "bias": "test_routing.test_attention_forms_"
           "are_found", "dropout": "test_dropout"}


def test_every_case_has_its_test():
  cases = {c.name for c in (*patterns.LOGITS_CASES, *patterns.WEIGHTS_CASES)}
  assert cases == set(COVERED)
  for test in COVERED.values():
    module, _, name = test.rpartition(".")
    assert name in (vars(__import__(module)) if module else globals()), test
