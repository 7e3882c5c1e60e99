"""Attention masks beyond causal: sliding windows, segment ids (packed sequences) and mask arrays.

Every library schedule against a dense reference written here (not the
program's own body), forward and backward; windows smaller than, equal to and
larger than a device's block; the ring's skipped steps in the printout, the
lowered program and the cost model; ``attention_mask``'s classification of
``jax.nn.dot_product_attention`` arguments and its reasons.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import fresh_key, make_mesh, rel_err
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxmercury as jm
from jaxmercury.programs import masks
from jaxmercury.tuner import cost

B, H, HK, T, D = 1, 8, 8, 32, 4  # MHA so every strategy (ulysses too) applies; 4 queries a device on 8 devices


def dense(q, k, v, keep):
  """Attention with ``keep`` [b or 1, h or 1, t, s]; rows that keep nothing give zeros."""
  h, hk = q.shape[2], k.shape[2]
  k, v = jnp.repeat(k, h // hk, axis=2), jnp.repeat(v, h // hk, axis=2)
  s = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1])
  s = jnp.where(keep, s, -jnp.inf)
  top = jnp.max(s, -1, keepdims=True)
  p = jnp.exp(s - jnp.where(jnp.isfinite(top), top, 0.0))
  p = p / jnp.maximum(jnp.sum(p, -1, keepdims=True), 1e-30)
  return jnp.einsum("bhts,bshd->bthd", p, v)


def band_keep(t, s, causal, window):
  d = np.arange(t)[:, None] - np.arange(s)[None, :]
  keep = np.ones((t, s), bool)
  if causal:
    keep &= d >= 0
  if window is not None:
    keep &= (d <= window[0]) & (d >= -window[1])
  return jnp.asarray(keep)[None, None]


def packed_segments(key, b, t, pieces=3):
  """Packed-sequence segment ids [b, t]: ``pieces`` consecutive runs of random lengths per row."""
  cuts = jnp.sort(jax.random.randint(key, (b, pieces - 1), 1, t), axis=1)
  return jnp.sum(jnp.arange(t)[None, :, None] >= cuts[:, None, :], axis=-1).astype(jnp.int32)


def check(schedules, xs, keep, *, grads=("ring",), tol=2e-5):
  """Each schedule's forward, and the gradients of a weighted sum for those named in ``grads`` (all: None),
  against ``dense`` with ``keep`` (computed on the host: the inputs may be sharded on Explicit axes)."""
  host = [jax.device_get(x) for x in xs]
  q, k, v = host[:3]
  want = dense(q, k, v, keep)
  w = jax.random.normal(fresh_key(), want.shape)
  loss = lambda f: (lambda q, k, v: jnp.sum(w * f(q, k, v)))
  want_g = jax.grad(loss(lambda *a: dense(*a, keep)), argnums=(0, 1, 2))(q, k, v)
  for name, s in schedules.items():
    f = s.compile()
    assert rel_err(f(*xs), want) < tol, f"{name}\n{s}"
    if grads is None or name in grads:
      g = jax.jit(jax.grad(loss(lambda q, k, v: f(q, k, v, *xs[3:])), argnums=(0, 1, 2)))(*xs[:3])
      for part, a, b in zip("qkv", g, want_g):
        assert rel_err(a, b) < 10 * tol, f"d{part} {name}\n{s}"


# ------------------------------------------------------------------ sliding windows
@pytest.mark.parametrize(("mesh_name", "causal", "window"), [
    ("8", True, (2, 0)),  # smaller than a device's 4 queries
    ("8", False, (4, 4)),  # equal to it, both sides
    ("8", True, (11, 0)),  # larger
    ("2x4", True, (3, 1)),
    ("4x2", False, (40, 2)),  # wider than the sequence on one side
], ids=["smaller", "equal", "larger", "2x4", "wide"])
def test_window_library_forward_and_backward(mesh_name, causal, window):
  """Every strategy forward and backward on the 8-device ring; the two-level meshes differentiate the ring."""
  mesh = make_mesh(mesh_name)
  prog = jm.programs.attention(B, H, HK, T, T, D, causal=causal, window=window)
  lib = jm.library(prog, mesh)
  assert {"ring", "context_parallel", "tree", "ulysses"} <= set(lib)
  check(lib, prog.random_inputs(fresh_key()), band_keep(T, T, causal, window),
        grads=None if mesh_name == "8" else ("ring",))


def test_window_gqa_cross_lengths_and_bf16():
  """Grouped heads, queries and keys of different lengths the mesh does not divide, bf16."""
  mesh = make_mesh("8")
  prog = jm.programs.attention(1, 4, 2, 20, 28, 8, causal=True, window=(5, 0), dtype=jnp.bfloat16)
  lib = jm.library(prog, mesh)
  xs = prog.random_inputs(fresh_key())
  check({n: lib[n] for n in ("ring", "context_parallel")}, xs, band_keep(20, 28, True, (5, 0)), tol=2e-2)


def test_ring_skips_steps_outside_the_window():
  mesh = make_mesh("8")
  narrow = jm.programs.attention(B, H, HK, T, T, D, causal=True, window=(3, 0))
  ring = jm.library(narrow, mesh)["ring"]
  (r,) = ring.plan().rings.values()
  # 4 queries a device: a window of 3 reaches back into the previous device's keys only (rank r visits block
  # (t + r) % 8 at step t: its own at 0, the previous one at 7).
  assert r.steps() == [0, 7] and r.skipped == 6 and r.transfers == 1
  text = str(ring)
  assert "skips 6 of 8 steps outside the window (runs 0, 7)" in text
  assert "2 of 8 steps" in text
  xs = narrow.random_inputs(fresh_key())
  lowered = jax.jit(ring.compile()).lower(*xs).as_text()
  assert lowered.count("collective_permute") == 2  # k and v, each moved once: from step 0 straight to step 7
  causal = jm.library(jm.programs.attention(B, H, HK, T, T, D, causal=True), mesh)["ring"]
  assert "skips" not in str(causal)
  assert jax.jit(causal.compile()).lower(*xs).as_text().count("collective_permute") == 2 * 7


def test_cost_model_prices_only_the_window():
  mesh = AbstractMesh((8,), ("x",), axis_types=(AxisType.Auto,))
  t = 8192
  machine = cost.Machine("test", 100e12, {"*": 100e9}, 10e-6, call_overhead_s=0.0, memory_bytes_per_s=1e30)
  full = jm.library(jm.programs.attention(1, 8, 8, t, t, 64, causal=True), mesh)["ring"]
  narrow = jm.library(jm.programs.attention(1, 8, 8, t, t, 64, causal=True, window=(256, 0)), mesh)["ring"]
  # The window keeps 256 keys a query: every rank computes its own block and its neighbour's (XLA's body computes a
  # block it does not skip densely), where the causal ring's last rank computes all 8.
  assert cost.compute_seconds(narrow, machine) == pytest.approx(cost.compute_seconds(full, machine) * 2 / 8)
  assert narrow.plan().rings["j0"].transfers == 1 and full.plan().rings["j0"].transfers == 7
  assert cost.predict(narrow, machine) < cost.predict(full, machine) / 3
  flops = narrow.program.flops / full.program.flops
  assert flops == pytest.approx(masks.band_pairs((0, t), (0, t), (0, 256)) / (t * (t + 1) / 2), rel=1e-3)


def test_zigzag_only_where_it_pays():
  mesh = make_mesh("4x2")
  assert "ring_zigzag" not in jm.library(jm.programs.attention(B, H, HK, T, T, D, causal=True, window=(8, 0)), mesh)
  wide = jm.programs.attention(B, H, HK, T, T, D, causal=True, window=(20, 0))
  lib = jm.library(wide, mesh)
  assert "ring_zigzag" in lib
  check({"ring_zigzag": lib["ring_zigzag"]}, wide.random_inputs(fresh_key()), band_keep(T, T, True, (20, 0)),
        grads=None)


# ------------------------------------------------------------------ segment ids and mask arrays
def test_segment_ids_library():
  mesh = make_mesh("2x4")
  prog = jm.programs.attention(2, H, HK, T, T, D, causal=True, segment_ids=True)
  assert [b.name for b in prog.reads] == ["q", "k", "v", "q_segment_ids", "kv_segment_ids"]
  q, k, v = prog.random_inputs(fresh_key())[:3]
  seg = packed_segments(fresh_key(), 2, T)
  keep = (seg[:, None, :, None] == seg[:, None, None, :]) & band_keep(T, T, True, None)
  lib = jm.library(prog, mesh)
  assert {"ring", "context_parallel", "tree", "ulysses", "usp"} <= set(lib)
  assert all("kv_segment_ids" in r.buffers for r in lib["ring"].plan().rings.values())
  # the rings' gradients with segment ids, and ring_balanced: test_packed
  check({n: s for n, s in lib.items() if n != "ring_balanced"}, (q, k, v, seg, seg), keep, grads=())


def test_mask_arrays_stay_with_their_queries_or_travel_with_their_keys():
  """A mask with a query axis is stored with the queries it masks (each device holds its rows, every key: nothing
  moves); a key-only mask (padding) travels around the ring with the keys."""
  mesh = make_mesh("2x4")
  prog = jm.programs.attention(2, H, HK, T, 24, D, mask=True)
  assert prog.buffer("mask").shape == (2, T, 24)
  lib = jm.library(prog, mesh)
  plan = lib["ring"].plan()
  assert plan.storage["mask"].dims == ((), ("node", "gpu"), ())
  assert all(r.buffers == ("k", "v") for r in plan.rings.values())
  xs = prog.random_inputs(fresh_key())
  check(lib, xs, xs[3][:, None])
  padding = jm.programs.attention(2, H, HK, T, 24, D, mask_axes=("b", "j"))
  ring = jm.library(padding, mesh)["ring"]
  assert all(r.buffers == ("k", "v", "mask") for r in ring.plan().rings.values())
  xs = padding.random_inputs(fresh_key())
  check({"ring": ring}, xs, xs[3][:, None, None, :])


def test_mask_array_over_heads_and_window_together():
  """A [b, h, i, j] mask on grouped heads, with a window and segment ids: every part must keep a pair."""
  mesh = make_mesh("8")
  prog = jm.programs.attention(1, 4, 2, T, T, D, window=(6, 6), segment_ids=True, mask_axes=("b", "h", "i", "j"))
  q, k, v, _, _, m = prog.random_inputs(fresh_key())
  qs, ks = packed_segments(fresh_key(), 1, T), packed_segments(fresh_key(), 1, T, 2)
  keep = band_keep(T, T, False, (6, 6)) & (qs[:, None, :, None] == ks[:, None, None, :]) & m
  lib = jm.library(prog, mesh)
  check({n: lib[n] for n in ("ring", "context_parallel")}, (q, k, v, qs, ks, m), keep)


@pytest.mark.parametrize("inside", [False, True], ids=["outside", "set_mesh"])
def test_masks_on_explicit_axes(inside):
  mesh = make_mesh("2x4", AxisType.Explicit)
  prog = jm.programs.attention(2, H, HK, T, T, D, causal=True, window=(5, 0), segment_ids=True)
  q, k, v = prog.random_inputs(fresh_key())[:3]
  seg = packed_segments(fresh_key(), 2, T)
  keep = (seg[:, None, :, None] == seg[:, None, None, :]) & band_keep(T, T, True, (5, 0))
  put = lambda x: jax.device_put(x, NamedSharding(mesh, P(None, "gpu")))
  xs = tuple(map(put, (q, k, v, seg, seg)))
  lib = jm.library(prog, mesh)
  if inside:
    with jax.set_mesh(mesh):
      check({"ring": lib["ring"]}, xs, keep)
  else:
    check({"ring": lib["ring"], "ulysses": lib["ulysses"]}, xs, keep, grads=())


# ------------------------------------------------------------------ the operator and its arguments
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_ops_attention_with_masks(axis_type):
  mesh = make_mesh("8", axis_type)
  key = iter(jax.random.split(fresh_key(), 4))
  q = jax.random.normal(next(key), (2, T, 4, D))
  k, v = (jax.random.normal(next(key), (2, T, 2, D)) for _ in range(2))
  seg = packed_segments(next(key), 2, T)
  mask = jax.random.bernoulli(fresh_key(), 0.8, (2, T, T))
  with jax.set_mesh(mesh):
    y = jm.ops.attention(q, k, v, mesh=mesh, causal=True, window=3, q_segment_ids=seg, kv_segment_ids=seg,
                         mask=mask[:, None])
  keep = band_keep(T, T, True, (3, 3)) & (seg[:, None, :, None] == seg[:, None, None, :]) & mask[:, None]
  assert rel_err(y, dense(q, k, v, keep)) < 2e-5
  # Where every row keeps a key, JAX's own attention agrees.
  want = jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=(3, 3))
  with jax.set_mesh(mesh):
    assert rel_err(jm.ops.attention(q, k, v, mesh=mesh, causal=True, window=(3, 3)), want) < 2e-5


def test_attention_mask_classifies_jax_arguments():
  q = jax.ShapeDtypeStruct((2, 16, 4, 8), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((2, 12, 2, 8), jnp.bfloat16)
  m = masks.attention_mask(q, k, is_causal=True, local_window_size=4)
  assert (m.causal, m.window, m.kinds) == (True, (4, 4), {"causal", "window"})
  assert m.band == (0, 4)
  m = masks.attention_mask(q, k, mask=jax.ShapeDtypeStruct((2, 1, 16, 12), jnp.bool_))
  assert m.mask_axes == ("b", "i", "j")
  m = masks.attention_mask(q, k, mask=jax.ShapeDtypeStruct((2, 16, 12), jnp.bool_), mask_axes=("b", "i", "j"))
  assert m.mask_axes == ("b", "i", "j")
  m = masks.attention_mask(q, k, query_seq_lengths=jax.ShapeDtypeStruct((2,), jnp.int32))
  assert m.segment_ids and m.buffers == ("q_segment_ids", "kv_segment_ids")
  assert jm.programs.mask_reason(q, k, is_causal=True) is None
  reasons = {
      "bias": dict(bias=jax.ShapeDtypeStruct((2, 4, 16, 12), jnp.float32)),
      "boolean": dict(mask=jax.ShapeDtypeStruct((2, 1, 16, 12), jnp.float32)),
      "broadcasts": dict(mask=jax.ShapeDtypeStruct((2, 3, 16, 12), jnp.bool_)),
      "together": dict(q_segment_ids=jax.ShapeDtypeStruct((2, 16), jnp.int32)),
      "scale": dict(scale=0.5),
      "non-negative": dict(local_window_size=(-1, 2)),
  }
  for word, kwargs in reasons.items():
    reason = jm.programs.mask_reason(q, k, **kwargs)
    assert reason is not None and word in reason, (word, reason)
  with pytest.raises(jm.MaskError, match="bias"):
    jm.ops.attention(jnp.zeros((2, 16, 4, 8)), jnp.zeros((2, 12, 2, 8)), jnp.zeros((2, 12, 2, 8)),
                     mesh=make_mesh("8"), mask=jnp.zeros((2, 4, 16, 12)))
  assert issubclass(jm.MaskError, jm.ScheduleError)


def test_kernels_say_which_masks_they_compute():
  from jaxmercury.kernels import registry
  prog = jm.programs.attention(1, 8, 8, 64, 64, 32, causal=True, window=(8, 0), dtype=jnp.bfloat16)
  mesh = AbstractMesh((8,), ("x",), axis_types=(AxisType.Auto,))
  assert registry.local("xla").why_not(prog, mesh) is None
  for name in ("pallas_attention", "mosaic_attention"):
    reason = registry.local(name).why_not(prog, mesh)
    assert reason is not None and "window" in reason, (name, reason)


def test_plain_attention_takes_the_mask():
  """The tuner's plain programs (what a user would run in JAX) compute the masked program, not a causal one."""
  from jaxmercury.programs import plain
  for kwargs in (dict(causal=True, window=(3, 0)), dict(window=(2, 5)), dict(causal=True, segment_ids=True),
                 dict(mask_axes=("b", "h", "i", "j"), segment_ids=True)):
    prog = jm.programs.attention(2, 4, 2, 16, 16, 8, **kwargs)
    xs = prog.random_inputs(fresh_key())
    (xla,) = plain.applicable(prog, "cpu")
    assert rel_err(xla.make(prog)(*xs), prog.reference(*xs)) < 2e-5, kwargs
  bf16 = jm.programs.attention(1, 4, 2, 16, 16, 8, causal=True, segment_ids=True, dtype=jnp.bfloat16)
  cudnn = plain.known(bf16)[0]  # on GPUs: cuDNN with the dense mask, as a user passes it
  assert cudnn.implementation == "cudnn" and cudnn.why_not(bf16, "gpu") is None and cudnn.why_not(bf16, "cpu")
