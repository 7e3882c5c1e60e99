"""Routing by rewriting the traced program: models written as MaxText writes them, a plain JAX function, and
what ``jm.explain`` reports."""

import contextlib
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import routing_models as rm
from conftest import (
  adam_losses,
  assert_grads_match,
  assert_trains_alike,
  fresh_key,
  make_mesh,
  rel_err,
  routable,
  store_library_winners,
)
from flax import nnx
from jax.sharding import AxisType
from model_checks import store_winners, train_alike

import jaxmercury as jm
from jaxmercury.flax import masks

# (axis type, inside jax.set_mesh)
PLACES = {"auto": (AxisType.Auto, False), "explicit-set_mesh": (AxisType.Explicit, True),
          "explicit": (AxisType.Explicit, False)}


def _place(name):
  axis_type, inside = PLACES[name]
  mesh = make_mesh("8", axis_type)
  return mesh, (jax.set_mesh(mesh) if inside else contextlib.nullcontext())


def _packed(batch, seq):
  """Segment ids of packed rows: the first row holds two sequences, the others one."""
  ids = np.zeros((batch, seq), np.int32)
  ids[0, seq // 2:] = 1
  return jnp.asarray(ids)


MODELS = {
    # name: (build, extra call arguments, attention (routed, mask) per layer, matmuls)
    "packed": (lambda: rm.Decoder(1, nnx.Rngs(0)), lambda t: (_packed(t.shape[0], t.shape[1] - 1),),
               [(True, "causal+segment_ids")], 7),
    "scanned": (lambda: rm.ScannedDecoder(2, nnx.Rngs(0)), lambda t: (_packed(t.shape[0], t.shape[1] - 1),),
                [(True, "causal+segment_ids")], 7),
}


def _loss(model, tokens, *extra):
  logits = model(tokens[:, :-1], *extra)
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean(), logits


@pytest.mark.parametrize("model,place", [("packed", "explicit"), ("scanned", "auto"), ("scanned", "explicit-set_mesh")])
def test_models_route_as_undecorated(model, place, tmp_path):
  """MaxText's structure with packed rows (segment ids), its layers scanned or not; Flax's own examples are in
  test_models."""
  build, extra_of, attention, matmuls = MODELS[model]
  mesh, where = _place(place)
  db = jm.Database(str(tmp_path / "routing.db"))
  tokens = jax.random.randint(fresh_key(), (2, 17), 0, rm.VOCAB)
  extra = extra_of(tokens)
  with where:
    plain = build()
    report = jm.explain(jm.distribute(plain, mesh=mesh, database=db), tokens[:, :-1], *extra)
    assert [(routable(e), e.mask) for e in report.of_kind("attention")] == attention  # untuned: plain
    assert len(report.of_kind("matmul")) == matmuls and all(routable(e) for e in report.of_kind("matmul"))
    for e in report:
      assert e.where.startswith("tests/routing_models.py:") and e.reason
      assert (e.schedule is not None) == e.routed
    assert str(report).splitlines()[-1].startswith(f"{len(report.routed)} of {len(report)} routed")
    store_winners(db, mesh, report)
    routed = jm.distribute(nnx.clone(plain), mesh=mesh, database=db)
    trained = train_alike(plain, routed, _loss, (tokens, *extra), mesh=mesh, lower=True)
  assert "collective_permute" in trained.text  # the stored ring's


@pytest.mark.parametrize("place", ["explicit-set_mesh"])
def test_plain_function(place, tmp_path):
  mesh, where = _place(place)
  db = jm.Database(str(tmp_path / "routing.db"))
  params = rm.plain_params(fresh_key())
  x = jax.random.normal(fresh_key(), (2, 16, rm.DIM))
  target = jax.random.normal(fresh_key(), (2, 16, rm.DIM))
  with where:
    routed = jm.distribute(rm.plain_attention, mesh=mesh, database=db)
    assert jm.distribute(mesh=mesh, database=db)(rm.plain_attention).__name__ == "plain_attention"
    store_library_winners(db, lambda: jm.explain(routed, params, x))
    report = jm.explain(routed, params, x)
    assert [(e.kind, e.routed) for e in report] == [("matmul", True)] * 3 + [("attention", True), ("matmul", True)]
    assert report.of_kind("attention")[0].mask == "causal"
    assert rel_err(jax.jit(routed)(params, x), jax.jit(rm.plain_attention)(params, x)) < 1e-5
    text = jax.jit(routed).lower(params, x).as_text()
    assert "collective_permute" in text and "all_gather" in text

    def loss(fn, p):
      return jnp.mean((fn(p, x) - target) ** 2)

    def train(fn):
      return adam_losses(lambda q: loss(fn, q), params)

    def grads(fn):
      return jax.jit(jax.grad(lambda p: loss(fn, p)))(params)

    assert_grads_match(grads(routed), grads(rm.plain_attention))
    assert_trains_alike(train(routed), train(rm.plain_attention))


# ------------------------------------------------------------------ what the matcher finds, and why not
def _explain(fn, *shapes, mesh=None):
  args = [jax.ShapeDtypeStruct(s, jnp.float32) if isinstance(s, tuple) else s for s in shapes]
  return jm.explain(fn, *args, mesh=mesh or make_mesh("8"))


def test_attention_forms_are_found():
  q, kv, one = (2, 16, 4, 8), (2, 16, 4, 8), (2, 16, 1, 8)
  report = _explain(lambda q, k, v: jax.nn.dot_product_attention(q, k, v), q, kv, kv)
  assert [(e.kind, routable(e), e.mask) for e in report] == [("attention", True, "none")]
  report = _explain(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True), q, one, one)  # MQA
  assert [(routable(e), e.mask, e.shapes) for e in report] == [(True, "causal", (q, one, one))]
  report = _explain(lambda q, k, v: nnx.dot_product_attention(q, k, v), q, kv, kv)
  assert [(e.kind, routable(e)) for e in report] == [("attention", True)]
  report = _explain(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=(3, 0)),
                    q, kv, kv)
  assert [(routable(e), e.mask) for e in report] == [(True, "sliding_window")]
  bias = (1, 4, 16, 16)
  report = _explain(lambda q, k, v, b: jax.nn.dot_product_attention(q, k, v, bias=b), q, kv, kv, bias)
  assert [(e.routed, e.reason) for e in report] == [(False, "adds a bias to the logits")]


def test_cudnn_attention_is_reported():
  """On a machine without cuDNN, JAX's cuDNN attention does not trace: explain says so, at the call's line."""
  f = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
  shape = jax.ShapeDtypeStruct((2, 16, 4, 8), jnp.bfloat16)
  try:
    jax.make_jaxpr(f)(shape, shape, shape)
  except RuntimeError:
    [e] = jm.explain(f, shape, shape, shape, mesh=make_mesh("8"))
    assert (e.kind, e.routed) == ("attention", False) and "implementation='cudnn'" in e.reason
    assert e.where.startswith("tests/test_routing.py:")
  else:
    pytest.skip("cuDNN present: the call traces")


@pytest.fixture
def cudnn_traces(monkeypatch):
  """JAX's cuDNN attention traceable without cuDNN: its version check answered. Its primitive cannot run here,
  but a routed call replaces it (on a GPU the same jaxpr comes without this: tests/gpu)."""
  import sys

  from jaxmercury import _compat
  monkeypatch.setattr(sys.modules[_compat.cudnn_attention.__module__], "check_cudnn_version", lambda: 90800)


@pytest.mark.parametrize("place", ["auto", "explicit-set_mesh"])
def test_cudnn_attention_calls_are_routed(cudnn_traces, place, tmp_path):
  """``implementation="cudnn"`` calls (grouped heads; causal, a sliding window, a boolean mask with the causal
  one) are routed as the XLA ones are, forward and gradients equal to JAX's XLA attention; a bias and sequence
  lengths are reported with their reasons. The mask array on both axis types, the positional masks on one each."""
  mesh, where = _place(place)
  keys = iter(jax.random.split(fresh_key(), 5))
  q = jax.random.normal(next(keys), (2, 32, 4, 8), jnp.bfloat16)
  k, v = (jax.random.normal(next(keys), (2, 32, 2, 8), jnp.bfloat16) for _ in range(2))
  m = jax.random.bernoulli(next(keys), 0.7, (2, 1, 32, 32)) | jnp.eye(32, dtype=bool)  # every row keeps a key
  positional = {"auto": ("causal", dict(is_causal=True)),
                "explicit-set_mesh": ("sliding_window", dict(is_causal=True, local_window_size=(5, 0)))}[place]
  calls = dict([positional, ("causal+array", dict(is_causal=True, mask=m))])
  cot = jax.random.normal(next(keys), q.shape, jnp.float32)
  db = jm.Database(str(tmp_path / "routing.db"))
  with where:
    for mask, kwargs in calls.items():
      f = functools.partial(jax.nn.dot_product_attention, implementation="cudnn", **kwargs)
      store_library_winners(db, lambda f=f: jm.explain(f, q, k, v, mesh=mesh, database=db))  # the primitive: no CPU
      [e] = jm.explain(f, q, k, v, mesh=mesh, database=db)
      assert (e.kind, e.routed, e.mask, e.shapes) == ("attention", True, mask, (q.shape, k.shape, v.shape)), e
      routed = jax.jit(jm.distribute(f, mesh=mesh, database=db))
      xla = functools.partial(jax.nn.dot_product_attention, implementation="xla", **kwargs)
      assert rel_err(routed(q, k, v).astype(jnp.float32), xla(q, k, v).astype(jnp.float32)) < 2e-2, mask
      loss = lambda fn: (lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * cot))
      got = jax.grad(loss(routed), argnums=(0, 1, 2))(q, k, v)
      want = jax.grad(loss(xla), argnums=(0, 1, 2))(q, k, v)
      for name, g, w in zip("qkv", got, want):
        assert rel_err(g.astype(jnp.float32), w.astype(jnp.float32)) < 3e-2, (mask, name)
    bias = functools.partial(jax.nn.dot_product_attention, implementation="cudnn", bias=m.astype(jnp.bfloat16))
    lengths = functools.partial(jax.nn.dot_product_attention, implementation="cudnn",
                                query_seq_lengths=jnp.array([20, 32], jnp.int32))
    for f, reason in ((bias, "adds a bias to the logits"), (lengths, "sequence lengths")):
      [e] = jm.explain(f, q, k, v, mesh=mesh)
      assert not e.routed and e.reason.startswith(reason), e


def test_attention_weights_used_elsewhere_fall_back():
  def weights_too(q, k, v):
    p = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v), p

  report = _explain(weights_too, (2, 16, 4, 8), (2, 16, 4, 8), (2, 16, 4, 8))
  assert [(e.kind, e.routed, e.reason) for e in report] == [
      ("attention", False, "its attention weights are a result of the program (returned, or stored by a sow): no "
                           "operator gives them")]


def test_matmul_reasons(tmp_path):
  a, w = (12, 16), (16, 8)
  report = _explain(lambda a, w: a @ w, a, w)
  assert report[0].reason == "sizes m=12 k=16 n=8 that the mesh's 8 devices do not divide"
  report = _explain(lambda a, w: jnp.dot(a, w, precision="highest"), (8, 16), w)
  assert report[0].reason.startswith("precision")
  report = _explain(lambda a, b: jnp.einsum("bij,bjk->bik", a, b), (2, 8, 16), (2, 16, 8))
  assert report[0].reason == "batch dimensions (not one GEMM)"
  ints = jax.ShapeDtypeStruct((8, 16), jnp.int32), jax.ShapeDtypeStruct((16, 8), jnp.int32)
  assert _explain(lambda a, b: a @ b, *ints)[0].reason.startswith("dtypes int32")
  # contracted dims anywhere: the operands are moved to one GEMM
  report = _explain(lambda a, b: jnp.einsum("kbm,nk->bmn", a, b), (16, 2, 8), (8, 16))
  assert report[0].reason == "plain (not tuned)" and report[0].schedule is None and routable(report[0])
  a, b = jax.random.normal(fresh_key(), (16, 2, 8)), jax.random.normal(fresh_key(), (8, 16))
  fn = lambda a, b: jnp.einsum("kbm,nk->bmn", a, b)
  db = jm.Database(str(tmp_path / "routing.db"))
  routed = jm.distribute(fn, mesh=make_mesh("8"), database=db)
  store_library_winners(db, lambda: jm.explain(routed, a, b))
  assert jm.explain(routed, a, b)[0].schedule == "allgather_matmul"
  assert rel_err(jax.jit(routed)(a, b), fn(a, b)) < 1e-5


def test_masks_classified_and_hooked():
  i, j = np.arange(8)[:, None], np.arange(8)[None, :]
  assert masks.classify_matrix(np.ones((8, 8), bool)).kind == "none"
  assert masks.classify_matrix(j <= i).kind == "causal"
  assert masks.classify_matrix((j <= i) & (i - j < 3)) == masks.MaskInfo("sliding_window", (("window", 3),))
  assert masks.classify_matrix((i + j) % 2 == 0).kind == "array"
  assert masks.route(masks.MaskInfo("causal")) == {"causal": True}
  assert masks.route(masks.MaskInfo("sliding_window", (("window", 3),))) == {"causal": True, "window": (2, 0)}
  assert masks.classify_matrix(np.abs(i - j) < 3) == masks.MaskInfo("band", (("left", 2), ("right", 2)))
  assert masks.route(masks.MaskInfo("band", (("left", 2), ("right", 1)))) == {"causal": False, "window": (2, 1)}
  assert masks.route(masks.MaskInfo("unknown")) is None


def _segment_mask(q, k, v, seg):
  return jax.nn.dot_product_attention(q, k, v, mask=seg[:, None, :, None] == seg[:, None, None, :], is_causal=True)


def _per_head_mask(q, k, v, m):
  return jax.nn.dot_product_attention(q, k, v, mask=m)


def _negated_mask(q, k, v, m):  # masked where the caller's array is False, written as where(~m, fill, logits)
  s = jnp.einsum("bqhd,bkhd->bhqk", q, jnp.repeat(k, 2, axis=2)) / np.sqrt(q.shape[-1])
  s = jnp.where(~m[:, None], -1e30, s)
  return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), jnp.repeat(v, 2, axis=2))


def _top_k(q, k, v, m):  # each query keeps its 4 largest scores: a mask computed from the scores themselves
  s = jnp.einsum("bqhd,bkhd->bhqk", q, jnp.repeat(k, 2, axis=2))
  s = jnp.where(s >= jnp.sort(s, axis=-1)[..., -4:-3], s, -1e30)
  return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), jnp.repeat(v, 2, axis=2))


@pytest.mark.parametrize("place", ["explicit-set_mesh"])
def test_data_masks_are_routed(place, tmp_path):
  """Segment ids and mask arrays computed from the inputs reach the operator as its arrays; a mask computed
  from the scores falls back, saying so."""
  mesh, where = _place(place)
  q = jax.random.normal(fresh_key(), (2, 16, 4, 8))
  k, v = (jax.random.normal(fresh_key(), (2, 16, 2, 8)) for _ in range(2))
  per_head = jax.random.bernoulli(fresh_key(), 0.6, (2, 4, 16, 16)) | jnp.eye(16, dtype=bool)
  pad = rm.causal_padding_mask((16, 12), 16)
  [e] = jm.explain(_segment_mask, q, k, v, _packed(2, 16), mesh=mesh)  # run by the packed models' tests
  assert (routable(e), e.mask) == (True, "causal+segment_ids")
  db = jm.Database(str(tmp_path / "routing.db"))
  with where:
    for fn, extra, kind in [(_per_head_mask, per_head, "array"), (_negated_mask, pad, "array")]:
      routed = jm.distribute(fn, mesh=mesh, database=db)
      store_library_winners(db, lambda: jm.explain(routed, q, k, v, extra))
      [e] = jm.explain(routed, q, k, v, extra)
      assert (e.routed, e.mask) == (True, kind) and e.schedule
      assert rel_err(jax.jit(routed)(q, k, v, extra), fn(q, k, v, extra)) < 1e-5
    grad = lambda f: jax.grad(lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v, per_head))), argnums=(0, 1, 2))
    routed = jm.distribute(_per_head_mask, mesh=mesh, database=db)
    for got, want in zip(jax.jit(grad(routed))(q, k, v), grad(_per_head_mask)(q, k, v)):
      assert rel_err(got, want) < 1e-4
    [e] = jm.explain(_top_k, q, k, v, pad, mesh=mesh)
  assert (e.routed, e.mask, e.reason) == (False, "unknown", "mask: computed from the attention's own scores")


def test_distribute_logs_its_report(caplog, tmp_path):
  fn = jm.distribute(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True), mesh=make_mesh("8"),
                     database=jm.Database(str(tmp_path / "routing.db")))
  q = jax.random.normal(fresh_key(), (2, 16, 4, 8))
  with caplog.at_level(logging.INFO):
    jax.jit(fn).lower(q, q, q)
  assert "attention (causal)" in caplog.text and "plain (not tuned)" in caplog.text
  assert "0 of 1 routed (0 attention, 0 matmul), 1 plain until tuned" in caplog.text


def test_explain_needs_a_mesh_or_a_routed_target():
  with pytest.raises(TypeError, match="mesh"):
    jm.explain(lambda x: x @ x, jnp.ones((8, 8)))
  with pytest.raises(TypeError, match="instance"):
    jm.explain(rm.Decoder, jnp.ones((2, 8), jnp.int32), mesh=make_mesh("8"))


def test_loop_and_branch_bodies_are_rewritten(tmp_path):
  """GEMMs in the bodies of a scan, a while loop and a cond are routed: the loop is rebuilt around its rewritten
  body (gradients through the scan and the cond)."""
  def scanned(x, ws):
    return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]

  def looped(x, ws):
    return jax.lax.while_loop(lambda c: c[1] < 2, lambda c: (jnp.tanh(c[0] @ ws[c[1]]), c[1] + 1), (x, 0))[0]

  def branched(x, ws):
    return jax.lax.cond(jnp.sum(x) > 0, lambda: x @ ws[0], lambda: jnp.tanh(x @ ws[1]))

  mesh = make_mesh("8")
  db = jm.Database(str(tmp_path / "routing.db"))
  x, ws = jax.random.normal(fresh_key(), (16, 16)), jax.random.normal(fresh_key(), (3, 16, 16)) * 0.3
  for fn, count in ((scanned, 1), (looped, 1), (branched, 2)):
    routed = jm.distribute(fn, mesh=mesh, database=db)
    store_library_winners(db, lambda: jm.explain(routed, x, ws))
    report = jm.explain(routed, x, ws)
    assert [(e.kind, e.routed, e.shapes) for e in report] == [("matmul", True, ((16, 16), (16, 16)))] * count
    assert "all_gather" in jax.jit(routed).lower(x, ws).as_text()
    assert rel_err(jax.jit(routed)(x, ws), fn(x, ws)) < 1e-5
    if fn is not looped:
      grad = lambda f: jax.grad(lambda x, ws: jnp.sum(jnp.sin(f(x, ws))), argnums=(0, 1))
      for got, want in zip(jax.jit(grad(routed))(x, ws), grad(fn)(x, ws)):
        assert rel_err(got, want) < 1e-4


def test_checkpointed_scan_layers_with_a_mask_built_outside(tmp_path):
  """Layers under jax.checkpoint and lax.scan (MaxText's remat-ed scanned layers) whose causal mask is built
  outside the scan and their segment ids closed over: the mask still reads as causal plus segment ids; inputs
  on no mesh under an Explicit jax.set_mesh keep their types."""
  mesh, where = _place("explicit-set_mesh")
  x = jax.random.normal(fresh_key(), (2, 16, 32))
  ws = jax.random.normal(fresh_key(), (2, 32, 32)) * 0.2
  seg = _packed(2, 16)

  def layers(x, ws, seg):
    causal = jnp.tril(jnp.ones((16, 16), bool))

    @jax.checkpoint
    def layer(h, w):
      q = (h @ w).reshape(2, 16, 4, 8)
      keep = (seg[:, None, :, None] == seg[:, None, None, :]) & causal
      return h + jax.nn.dot_product_attention(q, q, q, mask=keep).reshape(2, 16, 32), None

    return jax.lax.scan(layer, x, ws)[0]

  with where:
    db = jm.Database(str(tmp_path / "routing.db"))
    routed = jm.distribute(layers, mesh=mesh, database=db)
    store_library_winners(db, lambda: jm.explain(routed, x, ws, seg))
    report = jm.explain(routed, x, ws, seg)
    assert [(e.kind, e.routed, e.mask) for e in report] == [("matmul", True, ""),
                                                            ("attention", True, "causal+segment_ids")]
    assert rel_err(jax.jit(routed)(x, ws, seg), layers(x, ws, seg)) < 1e-5
    grad = lambda f: jax.grad(lambda x, ws: jnp.sum(jnp.sin(f(x, ws, seg))), argnums=(0, 1))
    for got, want in zip(jax.jit(grad(routed))(x, ws), grad(layers)(x, ws)):
      assert rel_err(got, want) < 1e-4


def test_bfloat16_attention_is_routed(tmp_path):
  f = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)  # logits cast to float32 inside
  q = jax.random.normal(fresh_key(), (2, 16, 4, 8), jnp.bfloat16)
  k, v = (jax.random.normal(fresh_key(), (2, 16, 2, 8), jnp.bfloat16) for _ in range(2))
  db = jm.Database(str(tmp_path / "routing.db"))
  routed = jm.distribute(f, mesh=make_mesh("8"), database=db)
  store_library_winners(db, lambda: jm.explain(routed, q, k, v))
  assert [(e.kind, e.routed) for e in jm.explain(routed, q, k, v)] == [("attention", True)]
  got = jax.jit(routed)(q, k, v)
  assert got.dtype == jnp.bfloat16 and rel_err(got, f(q, k, v)) < 2e-2
