"""jaxmercury.distribute on Flax NNX modules: same parameters, same results, same training losses."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import (
  fresh_key,
  make_mesh,
  rel_err,
  store_library_winners,
  store_winner,
)
from flax import nnx
from model_checks import store_winners, train_alike

import jaxmercury as jm
import models
from jaxmercury import ops
from jaxmercury.flax import AttentionFn, DotGeneral, Routing


def _variable(x):
  return isinstance(x, nnx.Variable)


def _state_leaves(module):
  return jax.tree.leaves(nnx.state(module))


def test_distribute_keeps_parameters_for_instances_and_classes(tmp_path):
  mesh = make_mesh("8")
  db = jm.Database(str(tmp_path / "flax.db"))
  config = models.CONFIGS["tiny"]
  plain = models.Llama(config, rngs=nnx.Rngs(3))
  routed = jm.distribute(models.Llama(config, rngs=nnx.Rngs(3)), mesh=mesh, database=db)
  Routed = jm.distribute(mesh=mesh, database=db)(models.Llama)
  built = Routed(config, rngs=nnx.Rngs(3))
  assert Routed.__name__ == "Llama" and issubclass(Routed, models.Llama)
  for other in (routed, built):
    assert jax.tree.structure(nnx.state(other)) == jax.tree.structure(nnx.state(plain))
    for a, b in zip(_state_leaves(other), _state_leaves(plain)):
      np.testing.assert_array_equal(a, b)
  assert isinstance(routed, models.Llama) and type(routed).jaxmercury_base is models.Llama
  # the instance distributed is left as written: a new module routes, sharing its variables
  instance = models.Llama(config, rngs=nnx.Rngs(3))
  shared = jm.distribute(instance, mesh=mesh, database=db)
  assert type(instance) is models.Llama and type(shared) is not models.Llama
  assert all(a is b for a, b in zip(jax.tree.leaves(nnx.state(shared), is_leaf=_variable),
                                    jax.tree.leaves(nnx.state(instance), is_leaf=_variable)))
  # distributing twice routes once, from the original class
  again = jm.distribute(routed, mesh=mesh)
  assert type(again).jaxmercury_base is models.Llama and type(again).__mro__[1] is models.Llama
  report = jm.explain(routed, models.random_tokens(fresh_key(), 2, 16, config.vocab)[:, :-1])
  assert len(report.of_kind("attention")) == config.layers and report.plain == list(report)  # nothing tuned
  with pytest.raises(TypeError, match="nnx.Module"):
    jm.distribute(object(), mesh=mesh)


def _llama_loss(model, tokens):
  logits = model(tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), tokens[:, 1:]).mean(), logits


def test_decorated_tiny_model_matches_forward_and_training(tmp_path):
  """The repository's Llama on 8 simulated devices against the undecorated model: outputs, gradients and three
  Adam steps (``model_checks.train_alike``), its attention on the ring."""
  mesh = make_mesh("8")
  db = jm.Database(str(tmp_path / "flax.db"))
  config = models.CONFIGS["tiny"]
  plain = models.Llama(config, rngs=nnx.Rngs(0))
  tokens = models.random_tokens(fresh_key(), 2, 32, config.vocab)
  store_winners(db, mesh, jm.explain(plain, tokens[:, :-1], mesh=mesh, database=db))
  routed = jm.distribute(nnx.clone(plain), mesh=mesh, database=db)
  trained = train_alike(plain, routed, _llama_loss, (tokens,), mesh=mesh, lower=True)
  assert "collective_permute" in trained.text  # ring attention


def test_multihead_attention_and_linear_general_are_routed(tmp_path):
  mesh = make_mesh("2x4")
  db = jm.Database(str(tmp_path / "flax.db"))

  def build():
    return nnx.MultiHeadAttention(num_heads=8, in_features=32, qkv_features=64, num_kv_heads=4, decode=False,
                                  rngs=nnx.Rngs(1))

  plain, routed = build(), jm.distribute(build(), mesh=mesh, database=db)
  x = jax.random.normal(fresh_key(), (2, 16, 32))
  store_library_winners(db, lambda: jm.explain(routed, x, is_causal=True))
  report = jm.explain(routed, x, is_causal=True)
  assert [(e.kind, e.routed, e.mask) for e in report] == [("matmul", True, "")] * 3 + [
      ("attention", True, "causal"), ("matmul", True, "")]
  want = plain(x, is_causal=True)
  got = jax.jit(lambda s, x: nnx.merge(nnx.graphdef(routed), s)(x, is_causal=True))(nnx.state(routed), x)
  assert rel_err(got, want) < 1e-5


def test_routes_fall_back_where_they_do_not_apply(monkeypatch):
  mesh = make_mesh("8")

  def refuse(*args, **kwargs):
    raise AssertionError("jaxmercury should not run this call")

  monkeypatch.setattr(ops, "matmul", refuse)
  monkeypatch.setattr(ops, "attention", refuse)
  route = Routing(mesh)
  dot = DotGeneral(route)
  a, b = jax.random.normal(fresh_key(), (12, 16)), jax.random.normal(fresh_key(), (16, 8))
  np.testing.assert_allclose(dot(a, b, (((1,), (0,)), ((), ()))), a @ b, rtol=1e-6)  # 12 rows do not divide by 8
  batched = jax.random.normal(fresh_key(), (2, 8, 16))
  assert dot.gemm_shape(batched, batched, (((2,), (2,)), ((0,), (0,)))) is None  # batch dims
  attn = AttentionFn(route, nnx.dot_product_attention)
  q = jax.random.normal(fresh_key(), (1, 16, 4, 8))
  mask = jnp.tril(jnp.ones((16, 16), bool))[None, None]
  np.testing.assert_allclose(attn(q, q, q, mask=mask), nnx.dot_product_attention(q, q, q, mask=mask), rtol=1e-6)
  # what the operators do not compute: a wider result than the inputs, a precision above the default
  a16, b16 = a[:8].astype(jnp.bfloat16), b.astype(jnp.bfloat16)
  wide = dot(a16, b16, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
  assert wide.dtype == jnp.float32
  np.testing.assert_array_equal(wide, jax.lax.dot_general(a16, b16, (((1,), (0,)), ((), ())),
                                                          preferred_element_type=jnp.float32))
  for precision in ("highest", jax.lax.Precision.HIGH, ("default", "highest")):
    np.testing.assert_array_equal(dot(a[:8], b, (((1,), (0,)), ((), ())), precision=precision),
                                  jax.lax.dot_general(a[:8], b, (((1,), (0,)), ((), ())), precision=precision))
    np.testing.assert_allclose(attn(q, q, q, precision=precision), nnx.dot_product_attention(q, q, q), rtol=1e-5)


def test_routes_take_the_default_precision_and_result_type(monkeypatch, tmp_path):
  mesh = make_mesh("8")
  db = jm.Database(str(tmp_path / "flax.db"))
  store_winner(db, ops.matmul_program((8, 16), (16, 8), "bfloat16"), mesh)
  calls = []
  prepare = ops.prepare
  monkeypatch.setattr(ops, "prepare", lambda prog, *a, **kw: calls.append(prog.name) or prepare(prog, *a, **kw))
  dot = DotGeneral(Routing(mesh, db))
  a, b = jax.random.normal(fresh_key(), (8, 16), jnp.bfloat16), jax.random.normal(fresh_key(), (16, 8), jnp.bfloat16)
  want = (a.astype(jnp.float32) @ b.astype(jnp.float32))
  for kwargs in ({}, {"precision": "default"}, {"precision": ("fastest", "default")},
                 {"preferred_element_type": jnp.bfloat16}):
    got = dot(a, b, (((1,), (0,)), ((), ())), **kwargs)
    assert got.dtype == jnp.bfloat16 and rel_err(got.astype(jnp.float32), want) < 1e-2
  assert len(calls) == 4
  dot(a, b, (((1,), (0,)), ((), ())), precision="highest")  # asks for more than the routed GEMM computes at
  assert len(calls) == 4


def test_routes_pass_database_and_tuning_options(monkeypatch, tmp_path):
  mesh = make_mesh("8")
  db = jm.Database(str(tmp_path / "flax.db"))
  seen = {}

  def spy(q, k, v, **kwargs):
    seen.update(kwargs)
    return nnx.dot_product_attention(q, k, v, is_causal=kwargs["causal"])

  monkeypatch.setattr(ops, "attention", spy)
  chosen = []

  def choose(prog, mesh, **kw):  # untuned: plain; asked to tune: the ring, as if it had won
    chosen.append(kw)
    return ops.Choice(ring, "ring", "tuned") if kw.get("tune") else ops.Choice(ring, "plain", "plain")

  prog = ops.attention_program((1, 16, 8, 4), (1, 16, 8, 4), "float32", True)
  ring = jm.library(prog, mesh)["ring"]
  monkeypatch.setattr(ops, "choose", choose)
  layer = jm.distribute(nnx.MultiHeadAttention(num_heads=8, in_features=32, decode=False, rngs=nnx.Rngs(0)),
                        mesh=mesh, database=db, tune=True, top_k=2, iters=3, linear=False)
  layer(jnp.ones((1, 16, 32)), is_causal=True)
  untuned = {"layouts": None, "database": db, "top_k": 2, "iters": 3}
  assert chosen == [untuned, dict(untuned, tune=True)]  # planned, then tuned (then planned with its winner)
  assert seen == {"mesh": mesh, "causal": True, "schedule": ring}
  report = jm.explain(layer, jnp.ones((1, 16, 32)), is_causal=True)
  assert [e.routed for e in report.of_kind("matmul")] == [False] * 4
  assert report.of_kind("matmul")[0].reason == "matmuls not routed (asked)"


def test_linen_layers_take_the_routes(tmp_path):
  """Linen: the routes passed as the layers' hooks run the GEMMs and the attention on the mesh; a mask reaches the
  attention route (Linen passes what the hook's signature names), which falls back to the plain attention."""
  from flax import linen as nn
  mesh = make_mesh("8")
  routing = Routing(mesh, jm.Database(str(tmp_path / "linen.db")))

  class Block(nn.Module):
    routed: bool

    @nn.compact
    def __call__(self, x, mask=None):
      dot = DotGeneral(routing) if self.routed else None
      hooks = dict(attention_fn=AttentionFn(routing, nn.dot_product_attention), qkv_dot_general=dot,
                   out_dot_general=dot) if self.routed else {}
      h = nn.MultiHeadDotProductAttention(num_heads=8, qkv_features=64, **hooks)(x, mask=mask)
      return nn.Dense(32, dot_general=dot)(h)

  x = jax.random.normal(fresh_key(), (2, 64, 32), jnp.float32)
  params = Block(routed=False).init(fresh_key(), x)
  store_library_winners(routing.database, lambda: jax.eval_shape(lambda: Block(routed=True).apply(params, x)))
  mask = nn.make_causal_mask(jnp.ones((2, 64)))
  for m in (None, mask):
    want = Block(routed=False).apply(params, x, m)
    got = jax.jit(lambda p, x, m=m: Block(routed=True).apply(p, x, m))(params, x)
    assert rel_err(got, want) < 1e-5
  text = jax.jit(lambda p, x: Block(routed=True).apply(p, x)).lower(params, x).as_text()
  assert "all_gather" in text or "collective_permute" in text or "all_to_all" in text
  plain = jax.jit(lambda p, x: Block(routed=False).apply(p, x)).lower(params, x).as_text()
  assert "all_gather" not in plain and "collective_permute" not in plain
  loss = lambda routed: jax.grad(lambda p: jnp.sum(Block(routed=routed).apply(p, x) ** 2))(params)
  got, want = jax.tree.leaves(jax.jit(lambda: loss(True))()), jax.tree.leaves(loss(False))
  scale = max(float(jnp.abs(w).max()) for w in want)  # the key bias's gradient is zero: rounding noise alone
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * scale)
