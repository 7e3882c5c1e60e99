"""The cuDNN attention kernel's masks (sliding windows, segment ids, mask arrays), on CPU with cuDNN stood in.

``conftest.cpu_cudnn`` replaces the two cuDNN calls by XLA code of their
contract (cuDNN's causal mask, sliding window, and a boolean mask turned
into a large negative bias, whose fully masked rows cuDNN leaves as a softmax
over the bias) and records which ran. Single blocks at chosen offsets take
each path of the dispatch (skipped, unmasked, cuDNN's band, bias, the XLA
body) and match the program's own body, forward and backward; ring schedules
on the 8-device mesh match a dense reference, forward and gradients, with
windows smaller than, equal to and larger than a device's block.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import fresh_key, make_mesh
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from test_masks import band_keep, check, packed_segments

import jaxmercury as jm
from jaxmercury.kernels.attention import cudnn as ca
from jaxmercury.kernels.work import Block, Work
from jaxmercury.programs import attention_backward as ab
from jaxmercury.programs.attention import attention_block
from jaxmercury.programs.masks import AttentionMask

T = 64  # 8 queries a device on 8 devices


# ------------------------------------------------------------------ one block, each path
def _block_inputs(b, tq, tk, hk, g, d, extras_fn):
  keys = iter(jax.random.split(fresh_key(), 8))
  q = jax.random.normal(next(keys), (b, tq, hk, g, d))
  k, v = (jax.random.normal(next(keys), (b, tk, hk, d)) for _ in range(2))
  return q, k, v, extras_fn(next(keys))


def _run_block(cpu_cudnn, mask, ctx, q, k, v, extras):
  """The kernel's forward and joint backward of one block against the program's body; the cuDNN kinds that ran
  and whether the body did."""
  ran, body_ran = cpu_cudnn, []
  fallback = lambda *a: (jax.debug.callback(lambda: body_ran.append(1)), ab.dq_dkv_block(*a, mask=mask))[1]
  forward_body = functools.partial(attention_block, mask=mask)
  forward_fallback = lambda *a: (jax.debug.callback(lambda: body_ran.append(1)), forward_body(*a))[1]
  out, lse = ca.cudnn_attention_block(ctx, q, k, v, *extras, mask=mask, fallback=forward_fallback)
  want_out, want_lse = forward_body(ctx, q, k, v, *extras)
  np.testing.assert_allclose(out, want_out, rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(lse, want_lse, rtol=2e-5, atol=2e-5)  # -inf where a row keeps no key
  # The backward with the merged lse of this block alone (a row keeping nothing: -inf) and its output.
  do = jax.random.normal(fresh_key(), q.shape)
  got = ca.cudnn_backward_block(ctx, q, k, v, want_out, do, want_lse, *extras, mask=mask, part="dq_dkv",
                                fallback=fallback)
  want = ab.dq_dkv_block(ctx, q, k, v, want_out, do, want_lse, *extras, mask=mask)
  for g, w in zip(got, want):
    assert np.all(np.isfinite(g))
    np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)
  jax.effects_barrier()
  kinds = {r for r in ran if r != "backward"}
  return kinds, bool(body_ran)


def _ctx(qs, ks, tq, tk):
  extent = 8 * max(tq, tk)
  return jm.BlockContext(starts={"i": qs, "j": ks}, sizes={"i": tq, "j": tk}, extents={"i": extent, "j": extent})


NO_EXTRAS = lambda key: ()
CASES = {  # name: (mask, (qs, ks, tq, tk), extras, the cuDNN kinds that run, whether the XLA body runs)
    "causal visible": (AttentionMask(causal=True), (16, 0, 8, 8), NO_EXTRAS, {"unmasked"}, False),
    "causal diagonal": (AttentionMask(causal=True), (8, 8, 8, 8), NO_EXTRAS, {"causal"}, False),
    "causal hidden": (AttentionMask(causal=True), (0, 8, 8, 8), NO_EXTRAS, set(), False),
    "causal two sizes": (AttentionMask(causal=True), (8, 12, 8, 4), NO_EXTRAS, {"bias"}, False),
    "window diagonal": (AttentionMask(causal=True, window=(3, 0)), (8, 8, 8, 8), NO_EXTRAS, {"window"}, False),
    "window below": (AttentionMask(causal=True, window=(3, 0)), (8, 0, 8, 8), NO_EXTRAS, {"bias"}, False),
    "window outside": (AttentionMask(causal=True, window=(3, 0)), (24, 0, 8, 8), NO_EXTRAS, set(), False),
    "window of a block": (AttentionMask(window=(7, 0)), (8, 8, 8, 8), NO_EXTRAS, {"causal"}, False),
    "wide window inside": (AttentionMask(causal=True, window=(20, 0)), (16, 8, 8, 8), NO_EXTRAS, {"unmasked"}, False),
    "two-sided diagonal": (AttentionMask(window=(4, 4)), (8, 8, 8, 8), NO_EXTRAS, {"bias"}, False),
    "two-sided above": (AttentionMask(window=(4, 4)), (0, 8, 8, 8), NO_EXTRAS, {"bias"}, False),
    "odd sizes edge": (AttentionMask(causal=True, window=(3, 0)), (5, 0, 5, 5), NO_EXTRAS, set(), True),
    "odd sizes diagonal": (AttentionMask(causal=True, window=(3, 0)), (5, 5, 5, 5), NO_EXTRAS, {"window"}, False),
    "segments mixed": (AttentionMask(causal=True, segment_ids=True), (8, 8, 8, 8),
                       lambda key: (jnp.array([[0] * 3 + [1] * 5]), jnp.array([[0] * 5 + [1] * 3])), {"bias"}, False),
    "segments disjoint": (AttentionMask(segment_ids=True), (0, 8, 8, 8),
                          lambda key: (jnp.zeros((1, 8), jnp.int32), jnp.ones((1, 8), jnp.int32)), set(), False),
    "segments one": (AttentionMask(segment_ids=True), (0, 8, 8, 8),
                     lambda key: (jnp.full((1, 8), 2), jnp.full((1, 8), 2)), {"unmasked"}, False),
    "mask random": (AttentionMask(mask_axes=("b", "i", "j")), (0, 8, 8, 8),
                    lambda key: (jax.random.bernoulli(key, 0.6, (1, 8, 8)),), {"bias"}, False),
    "mask empty rows": (AttentionMask(mask_axes=("b", "i", "j")), (0, 8, 8, 8),
                        lambda key: (jax.random.bernoulli(key, 0.6, (1, 8, 8)).at[:, 2:5].set(False),), {"bias"},
                        False),
    "mask all false": (AttentionMask(mask_axes=("b", "i", "j")), (0, 8, 8, 8),
                       lambda key: (jnp.zeros((1, 8, 8), bool),), set(), False),
    "mask all true": (AttentionMask(mask_axes=("b", "i", "j")), (0, 8, 8, 8),
                      lambda key: (jnp.ones((1, 8, 8), bool),), {"unmasked"}, False),
    "mask over heads": (AttentionMask(causal=True, mask_axes=("b", "h", "i", "j")), (8, 0, 8, 8),
                        lambda key: (jax.random.bernoulli(key, 0.6, (1, 2, 2, 8, 8)),), {"bias"}, False),
    "mask over keys": (AttentionMask(mask_axes=("b", "j")), (0, 8, 8, 8),
                       lambda key: (jax.random.bernoulli(key, 0.6, (1, 8)).at[:, 3].set(False),), {"bias"},
                       False),  # a key hidden: a draw that keeps all 8 (1.7%) would run unmasked
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_block_path_matches_the_body(cpu_cudnn, case):
  mask, (qs, ks, tq, tk), extras_fn, kinds, body = CASES[case]
  q, k, v, extras = _block_inputs(1, tq, tk, 2, 2, 8, extras_fn)
  ran, body_ran = _run_block(cpu_cudnn, mask, _ctx(qs, ks, tq, tk), q, k, v, extras)
  assert ran == {f"{part} {kind}" for part in ("forward", "backward") for kind in kinds}, ran
  assert body_ran == body


# ------------------------------------------------------------------ ring schedules against the dense reference
def _ring(prog, split=1):
  s = jm.library(prog, make_mesh("8"))["ring"]
  if split > 1:
    s.tile("j_in", split)
  return s.patch("cudnn_attention")


@pytest.mark.parametrize(("causal", "window", "split", "kinds"), [
    (True, (3, 0), 1, {"window", "bias"}),  # smaller than a device's block of 8
    (True, (8, 0), 1, {"causal", "bias"}),  # equal to it
    (True, (20, 0), 1, {"causal", "unmasked", "bias"}),  # larger
    (False, (4, 4), 1, {"bias"}),  # two-sided
    (True, (5, 0), 2, {"bias"}),  # key blocks of 4
], ids=["smaller", "equal", "larger", "two-sided", "uneven-blocks"])
def test_window_ring_forward_and_gradients(cpu_cudnn, causal, window, split, kinds):
  prog = jm.programs.attention(1, 4, 2, T, T, 8, causal=causal, window=window)
  s = _ring(prog, split)
  check({"ring": s}, prog.random_inputs(fresh_key()), band_keep(T, T, causal, window))
  assert {r.split(" ", 1)[1] for r in cpu_cudnn if r != "backward"} == kinds
  assert {r.split(" ", 1)[0] for r in cpu_cudnn} == {"forward", "backward"}


def test_odd_blocks_take_the_body_where_a_bias_would_be_needed(cpu_cudnn):
  """5 queries a device: cuDNN's band on the diagonal, the XLA body at the window's edge."""
  prog = jm.programs.attention(1, 4, 2, 40, 40, 8, causal=True, window=(3, 0))
  check({"ring": _ring(prog)}, prog.random_inputs(fresh_key()), band_keep(40, 40, True, (3, 0)))
  assert {r for r in cpu_cudnn if r != "backward"} == {"forward window", "backward window"}


def test_zigzag_ring_with_a_window(cpu_cudnn):
  """Blocks of zigzag chunks at their true positions: whole chunks through the dispatch."""
  prog = jm.programs.attention(1, 4, 2, T, T, 8, causal=True, window=(40, 0))
  s = jm.library(prog, make_mesh("4x2"))["ring_zigzag"].patch("cudnn_attention")
  check({"ring_zigzag": s}, prog.random_inputs(fresh_key()), band_keep(T, T, True, (40, 0)),
        grads=("ring_zigzag",))
  assert {"forward unmasked", "forward causal", "forward bias", "backward bias"} <= set(cpu_cudnn)


def test_lengths_the_mesh_does_not_divide(cpu_cudnn):
  """60 queries and keys on 8 devices: padded key blocks on the XLA body, the rest (query padding) on cuDNN."""
  prog = jm.programs.attention(1, 4, 2, 60, 60, 8, causal=True, window=(9, 0), segment_ids=True)
  q, k, v = prog.random_inputs(fresh_key())[:3]
  seg = packed_segments(fresh_key(), 1, 60)
  keep = (seg[:, None, :, None] == seg[:, None, None, :]) & band_keep(60, 60, True, (9, 0))
  check({"ring": _ring(prog)}, (q, k, v, seg, seg), keep)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_segment_ids_ring(cpu_cudnn, axis_type):
  """Packed sequences with a causal mask; on Explicit axes, inputs placed and under ``jax.set_mesh``."""
  mesh = make_mesh("8", axis_type)
  prog = jm.programs.attention(2, 4, 2, T, T, 8, causal=True, segment_ids=True)
  q, k, v = prog.random_inputs(fresh_key())[:3]
  seg = packed_segments(fresh_key(), 2, T)
  keep = (seg[:, None, :, None] == seg[:, None, None, :]) & band_keep(T, T, True, None)
  ring = jm.library(prog, mesh)["ring"].patch("cudnn_attention")
  if axis_type == AxisType.Explicit:
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P(None, "x")))
    with jax.set_mesh(mesh):
      check({"ring": ring}, tuple(map(put, (q, k, v, seg, seg))), keep)
  else:
    check({"ring": ring}, (q, k, v, seg, seg), keep)
  assert {"forward bias", "backward bias"} <= set(cpu_cudnn)


def test_mask_arrays_ring(cpu_cudnn):
  """A [b, i, j] mask with rows that keep no key and blocks it hides wholly, and a per-head mask with a window."""
  prog = jm.programs.attention(2, 4, 2, T, T, 8, mask=True)
  q, k, v, m = prog.random_inputs(fresh_key())
  m = m.at[:, 10:14].set(False).at[:, 32:40, 40:56].set(False)  # empty rows; a block of device 4 hidden
  check({"ring": _ring(prog)}, (q, k, v, m), m[:, None])
  assert {"forward bias", "backward bias"} <= set(cpu_cudnn)
  heads = jm.programs.attention(1, 4, 2, T, T, 8, causal=True, window=(9, 0), mask_axes=("b", "h", "i", "j"))
  q, k, v, m = heads.random_inputs(fresh_key())
  check({"ring": _ring(heads)}, (q, k, v, m), band_keep(T, T, True, (9, 0)) & m)


def test_rows_keeping_no_key_give_zeros_and_zero_gradients(cpu_cudnn):
  prog = jm.programs.attention(1, 4, 2, T, T, 8, mask_axes=("b", "i", "j"))
  q, k, v, m = prog.random_inputs(fresh_key())
  m = m.at[:, 20:30].set(False)
  f = _ring(prog).compile()
  out = f(q, k, v, m)
  assert bool(jnp.all(out[:, 20:30] == 0)) and bool(jnp.all(jnp.isfinite(out)))
  dq = jax.grad(lambda q: jnp.sum(f(q, k, v, m) ** 2))(q)
  assert bool(jnp.all(dq[:, 20:30] == 0)) and bool(jnp.all(jnp.isfinite(dq)))


# ------------------------------------------------------------------ what the kernel declares
def test_kernel_declares_every_mask_and_prices_skipped_blocks_as_nothing():
  from jax.sharding import AbstractMesh

  from jaxmercury.kernels import registry
  from jaxmercury.tuner import cost
  mesh = AbstractMesh((8,), ("x",), axis_types=(AxisType.Auto,))
  kernel = registry.local("cudnn_attention")
  for kw in (dict(window=(8, 0)), dict(segment_ids=True), dict(mask=True), dict(mask_axes=("b", "h", "i", "j"))):
    prog = jm.programs.attention(1, 8, 2, 1024, 1024, 64, causal=True, dtype=jnp.bfloat16, **kw)
    assert kernel.why_not(prog, mesh) is None
    assert registry.local("cudnn_attention_dq").why_not(ab.attention_dq(prog), mesh) is None
  machine = cost.Machine("test", 100e12, {"*": 100e9}, 10e-6, call_overhead_s=0.0, memory_bytes_per_s=1e30,
                         kernel_flops_per_s={"xla": 10e12, "cudnn_attention": 100e12})
  t = 8192
  full, narrow = (jm.library(jm.programs.attention(1, 8, 8, t, t, 64, causal=True, dtype=jnp.bfloat16, window=w),
                             mesh)["ring"].patch("cudnn_attention") for w in (None, (256, 0)))
  # The narrow window: each rank's diagonal block by cuDNN's band (the pairs it keeps), its neighbour's densely by a
  # bias, the 6 others skipped; the causal ring's last rank computes 7 blocks and its diagonal's half.
  per_block = 4 * 8 * (t // 8) ** 2 * 64 / 100e12
  diag = Block({"i": t // 8, "j": t // 8}, {"i": t, "j": t}, {"i": 0, "j": 0}, band=(0, 256)).band_share()
  assert cost.compute_seconds(narrow, machine) == pytest.approx(per_block * (1 + diag), rel=1e-3)
  assert cost.compute_seconds(full, machine) == pytest.approx(per_block * 7.5, rel=1e-3)
  odd = Block({"i": 5, "j": 5}, {"i": 40, "j": 40}, {"i": 5, "j": 0}, band=(0, 3))
  assert ca.cudnn_work(odd, causal=True) == Work(fast=0.0, fallback=1.0)
  data = Block({"i": 8, "j": 8}, {"i": 64, "j": 64}, {"i": 8, "j": 8}, band=(0, None), data=True)
  assert ca.cudnn_work(data, causal=True) == Work()  # the diagonal by a bias, densely
