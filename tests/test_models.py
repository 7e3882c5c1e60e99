"""Flax's own example models routed by ``jm.distribute``: Gemma 3 (grouped heads, a sliding-window layer then a
global one, right-padded rows), the ViT and MiniGPT tutorials, and a ``jax.nn.dot_product_attention`` decoder with
``nnx.Einsum`` projections, on Auto and Explicit axes inside ``jax.set_mesh``, and the ``models/`` Llama sharded as a
user does on Explicit axes (FSDP weights, sequence-split activations): every attention routed, and each trains
three Adam steps as the undecorated model does (``model_checks.train_alike``)."""

import contextlib
import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
import pytest
import routing_models as rm
import upstream_models as um
from conftest import fresh_key, make_mesh, routable
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from model_checks import spec, store_winners, train_alike

import jaxmercury as jm
from models import CONFIGS, Llama
from models.llama import Sharding

AXES = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}


def _lm_loss(model, tokens, targets):
  """The loss of Gemma's train.py: cross entropy on the tokens that are not padding."""
  logits = model(tokens)
  weights = tokens > um.PAD
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  return (ce * weights).sum() / weights.sum(), logits


def _loss(model, x, labels):
  logits = model(x)
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels).mean(), logits


def _tokens(batch, length, vocab, lengths=None):
  t = um.padded_tokens(fresh_key(), batch, length + 1, vocab, lengths or [length + 1] * batch)
  return t[:, :-1], t[:, 1:]


@dataclasses.dataclass(frozen=True)
class Model:
  build: Callable  # axis type -> module
  batch: Callable  # mesh -> the step's arguments
  loss: Callable
  attention: list  # (module path, mask) of each attention call


def _split(mesh, *xs):
  """``xs`` split over the batch (as the tutorials place their data)."""
  return tuple(jax.device_put(x, NamedSharding(mesh, P("x"))) for x in xs)


def _llama(kind):
  """A one-layer tiny Llama, FSDP and sequence-split (``models.llama.Sharding``: Explicit axes only)."""
  return Llama(dataclasses.replace(CONFIGS["tiny"], layers=1, sharding=Sharding("x")), rngs=nnx.Rngs(0))


def _vit(kind):
  sharding = um.ViTSharding.fsdp_sharding("x") if kind == AxisType.Explicit else um.ViTSharding()
  return um.VisionTransformer(um.ViTConfig(sharding=sharding), rngs=nnx.Rngs(0))


MODELS = {
    "gemma": Model(lambda kind: um.GemmaLM(um.GemmaConfig(), rngs=nnx.Rngs(0)),
                   lambda mesh: _tokens(8, 16, 64, [17, 13, 17, 9, 17, 17, 5, 17]), _lm_loss,
                   [("transformer.layers.0.attn", "sliding_window+padding"),
                    ("transformer.layers.1.attn", "causal+padding")]),
    "vit": Model(_vit, lambda mesh: _split(mesh, jax.random.normal(fresh_key(), (8, 8, 8, 3)),
                                           jax.random.randint(fresh_key(), (8,), 0, 16)), _loss,
                 [("encoder.layers.0.mha", "none")]),
    "minigpt": Model(lambda kind: um.MiniGPT(16, 64, 32, 4, 64, 1, rngs=nnx.Rngs(0)),
                     lambda mesh: _split(mesh, *_tokens(8, 16, 64)), _loss,
                     [("transformer_blocks.layers.0.mha", "causal")]),
    "decoder": Model(lambda kind: rm.Decoder(1, nnx.Rngs(0)), lambda mesh: _tokens(8, 16, rm.VOCAB), _loss,
                     [("blocks.0", "causal")]),
    "llama_fsdp": Model(_llama, lambda mesh: _tokens(1, 64, CONFIGS["tiny"].vocab), _loss,
                        [("blocks.0.attention", "causal")]),
}
EXPLICIT_ONLY = {"llama_fsdp"}  # its reshards and out_shardings are Explicit axes' types


@pytest.mark.parametrize("name,kind", [(name, kind) for name in sorted(MODELS) for kind in sorted(AXES)
                                       if kind == "explicit" or name not in EXPLICIT_ONLY])
def test_model_routes_and_trains_as_undecorated(name, kind, tmp_path):
  model = MODELS[name]
  mesh = make_mesh("8", AXES[kind])
  db = jm.Database(str(tmp_path / "models.db"))
  with jax.set_mesh(mesh):
    batch = model.batch(mesh)
    plain = model.build(AXES[kind])
    routed = jm.distribute(plain, mesh=mesh, database=db)
    assert type(plain) is not type(routed) and isinstance(routed, type(plain))
    report = jm.explain(routed, *batch[:1])
    assert [(e.module, e.mask) for e in report.of_kind("attention")] == model.attention
    assert all(routable(e) for e in report.of_kind("attention")), report
    store_winners(db, mesh, report)
    routed = jm.distribute(nnx.clone(plain), mesh=mesh, database=db)  # its own parameters, to train apart
    trained = train_alike(plain, routed, model.loss, batch, mesh=mesh, lower=True)
  assert "collective_permute" in trained.text  # the rings of the stored schedule: really distributed


def test_llama_sharding_refuses_what_it_cannot_place():
  """The FSDP Llama built outside ``jax.set_mesh``, or with a weight the mesh does not divide: a clear error."""
  config = dataclasses.replace(CONFIGS["tiny"], layers=1, sharding=Sharding("x"))
  with pytest.raises(ValueError, match=r"build the model under jax.set_mesh\(mesh\)"):
    Llama(config, rngs=nnx.Rngs(0))
  with jax.set_mesh(make_mesh("8", AxisType.Explicit)), pytest.raises(
      ValueError, match=r"shape \(250, 64\) does not split over mesh axes \('x',\) \(8 devices\)"):
    Llama(dataclasses.replace(config, vocab=250), rngs=nnx.Rngs(0))


def test_gemma_explain_and_the_undecorated_instance(tmp_path):
  """``jm.explain`` of Gemma: its two attention calls per forward with their module paths, source lines and
  masks (a sliding window with the padding mask of ``make_causal_attn_mask``, then the causal mask with it), every
  matmul's module; ``jm.distribute(instance)`` leaves the instance undecorated, sharing its variables."""
  mesh = make_mesh("8", AxisType.Explicit)
  with jax.set_mesh(mesh):
    tokens, _ = _tokens(8, 16, 64, [17, 13, 17, 9, 17, 17, 5, 17])
    model = um.GemmaLM(um.GemmaConfig(), rngs=nnx.Rngs(0))
    routed = jm.distribute(model, mesh=mesh, database=jm.Database(str(tmp_path / "models.db")))
    report = jm.explain(routed, tokens)
  assert type(model) is um.GemmaLM and not hasattr(type(model), "jaxmercury_routing")
  assert routed.transformer.embedder.embedding is model.transformer.embedder.embedding  # one set of variables
  attention = report.of_kind("attention")
  assert [(e.module, e.mask, routable(e)) for e in attention] == [
      ("transformer.layers.0.attn", "sliding_window+padding", True),
      ("transformer.layers.1.attn", "causal+padding", True)]
  assert all(e.where.startswith("tests/upstream_models.py:") and "GemmaAttention.__call__" in e.where
             for e in attention)
  assert [e.shapes for e in attention] == [((8, 16, 8, 8), (8, 16, 2, 8), (8, 16, 2, 8))] * 2
  modules = [e.module for e in report.of_kind("matmul")]
  assert modules[:3] == ["transformer.layers.0.attn.q_einsum", "transformer.layers.0.attn.kv_einsum",
                         "transformer.layers.0.attn.attn_vec_einsum"] and modules[-1] == "transformer"
  text = str(report)
  assert "transformer.layers.1.attn" in text and "attention (causal+padding)" in text
  # the mask made outside the model (as train.py passes it) is an array the rewrite passes on
  positions = jnp.zeros((8, 16), jnp.int32)
  with jax.set_mesh(mesh):
    mask = um.make_causal_attn_mask(tokens > um.PAD)
    inner = jm.explain(model.transformer, tokens, positions, mask, mesh=mesh)
  assert [(e.mask, routable(e)) for e in inner.of_kind("attention")] == [("band+array", True), ("array", True)]


@pytest.mark.parametrize("where", ["outside", "inside"])
def test_types_survive_optimizer_steps_outside_set_mesh(where, tmp_path):
  """On Explicit axes with the mesh only passed to ``distribute`` (arrays of no mesh), or set: after Adam steps
  the parameters keep the undecorated model's types. A gradient the schedules left split made the embedding table
  split over the vocabulary, and the next step's lookup failed."""
  mesh = make_mesh("8", AxisType.Explicit)
  with jax.set_mesh(mesh) if where == "inside" else contextlib.nullcontext():
    batch = _tokens(8, 16, rm.VOCAB)
    plain = rm.Decoder(1, nnx.Rngs(0))
    routed = jm.distribute(nnx.clone(plain), mesh=mesh, database=jm.Database(str(tmp_path / "models.db")))
    trained = train_alike(plain, routed, _loss, batch, mesh=mesh)
  assert trained.traces <= 2
  assert spec(trained.params["embed"]["embedding"][...]) == ()
