"""The Pallas flash attention kernels in interpret mode on CPU, against the programs' own bodies.

Blocks are checked at traced offsets (as in a ring step) where the key block is
visible, on the diagonal or hidden, in zigzag order, with padding keys (and
padding queries in the backward), and at lengths that are not multiples of the
tile. The GPU lowering (Pallas -> Triton IR) is checked too, for an abstract
A100 and H100, without compiling.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_matches, fresh_key, make_mesh, rel_err

import jaxmercury as jm
from jaxmercury.errors import PreconditionError
from jaxmercury.kernels import registry
from jaxmercury.kernels.attention import pallas as fa
from jaxmercury.kernels.attention import triton as triton_attention
from jaxmercury.programs import attention_backward as ab

HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}
TILES = dict(block_q=32, block_kv=16)  # several tiles per block, so tiles are skipped and masked


def _blocks(heads, kv_heads, n_q, n_kv, d, dtype=jnp.float32):
  """Fresh random q [1, i, hk, g, d], k and v [1, j, hk, d], o and do [1, i, hk, g, d]."""
  g = heads // kv_heads
  keys = jax.random.split(fresh_key(), 5)
  q = jax.random.normal(keys[0], (1, n_q, kv_heads, g, d)).astype(dtype)
  k, v = (jax.random.normal(x, (1, n_kv, kv_heads, d)).astype(dtype) for x in keys[1:3])
  o = jax.random.normal(keys[3], q.shape).astype(dtype)
  do = jax.random.normal(keys[4], q.shape).astype(dtype)
  return q, k, v, o, do


def _context(starts, sizes, extents, zigzag=None):
  return jm.BlockContext(starts=starts, sizes=sizes, extents=extents, zigzag=zigzag or {})


def _forward_pair(causal, make_ctx, tiles):
  """Jitted (kernel, body) forward on a context built from traced starts."""
  prog_body = jm.programs.attention(1, 1, 1, 4, 4, 4, causal=causal).body

  @jax.jit
  def both(starts, q, k, v):
    ctx = make_ctx(starts)
    return fa.pallas_attention_block(ctx, q, k, v, causal=causal, interpret=True, **tiles), prog_body(ctx, q, k, v)
  return both


def _assert_forward(got, want, tol=2e-5):
  (out, lse), (ref_out, ref_lse) = got, want
  assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
  assert out.dtype == lse.dtype == jnp.float32
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
  if np.any(ref_out != 0):
    assert rel_err(out, ref_out) < tol
  else:
    assert not np.any(out)
  finite = np.isfinite(ref_lse)
  np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(ref_lse)[finite], rtol=tol, atol=tol)


# (heads, causal): MHA, GQA and MQA, causal and not, without compiling all six
COMBOS = [("mha", False), ("gqa", True), ("gqa", False), ("mqa", True)]


@pytest.mark.parametrize("heads,causal", COMBOS)
def test_forward_whole(heads, causal):
  """One block over the whole sequence; lengths that are not multiples of the tile."""
  h, hk = HEADS[heads]
  q, k, v, _, _ = _blocks(h, hk, 100, 70, 32)
  sizes = {"i": 100, "j": 70}
  both = _forward_pair(causal, lambda s: _context({}, sizes, sizes), TILES)
  _assert_forward(*both(jnp.zeros(2, jnp.int32), q, k, v))


def _poison(x):
  """``x`` with NaN keys from row 32 on: at key start 192 of a 216-long axis, two whole tiles of padding."""
  return x.at[:, 32:].set(jnp.nan)


def _zero(x):
  return x.at[:, 32:].set(0)


def _context_maker(sizes, extents, zigzag):
  return lambda s: _context({"i": s[0], "j": s[1]}, sizes, extents, zigzag)


SIZES = {"i": 64, "j": 64}
RING = _context_maker(SIZES, {"i": 256, "j": 256}, {})
ZIGZAG = _context_maker(SIZES, {"i": 256, "j": 256}, {"i": 8, "j": 8})  # a block spans two chunks
PADDED = _context_maker(SIZES, {"i": 232, "j": 216}, {})  # padding past the true extents
# Traced (query start, key start): keys before the queries (visible), on the diagonal, after (hidden),
# straddling; zigzag blocks at both ends; padded blocks.
STARTS = {"ring": (RING, [(128, 0), (128, 128), (64, 192), (128, 96)]),
          "zigzag": (ZIGZAG, [(0, 64), (192, 128)]),
          "padded": (PADDED, [(192, 192), (192, 128), (64, 192)])}
BLOCK_CASES = [("ring", True), ("zigzag", True), ("zigzag", False), ("padded", True), ("padded", False)]


@pytest.mark.parametrize("layout,causal", BLOCK_CASES)
def test_forward_blocks(layout, causal):
  """Blocks at traced offsets, in zigzag order and with padding keys; one compilation each."""
  q, k, v, _, _ = _blocks(4, 2, 64, 64, 32)
  make, starts = STARTS[layout]
  both = _forward_pair(causal, make, TILES)
  for s in starts:
    _assert_forward(*both(jnp.array(s, jnp.int32), q, k, v))
  if layout == "padded":  # tiles of padding keys are skipped: NaNs there never reach the output
    got, _ = both(jnp.array([192, 192], jnp.int32), q, _poison(k), _poison(v))
    _assert_forward(got, both(jnp.array([192, 192], jnp.int32), q, _zero(k), _zero(v))[1])


def test_forward_bf16_default_tiles():
  q, k, v, _, _ = _blocks(4, 1, 128, 128, 64, jnp.bfloat16)
  sizes = {"i": 128, "j": 128}
  both = _forward_pair(True, lambda s: _context({}, sizes, sizes), {})
  _assert_forward(*both(jnp.zeros(2, jnp.int32), q, k, v), tol=1e-2)


def _backward_pair(causal, make_ctx, tiles):
  """Jitted (kernel, reference) dq and dkv on a context built from traced starts."""
  @jax.jit
  def both(starts, *xs):
    ctx = make_ctx(starts)
    run = lambda part: fa.pallas_backward_block(ctx, *xs, causal=causal, part=part, interpret=True, **tiles)
    return (run("dq"), run("dkv")), (ab.dq_block(ctx, *xs, causal=causal), ab.dkv_block(ctx, *xs, causal=causal))
  return both


def _lse(q, k, sizes):
  """A consistent lse: the block's own (non-causal) forward log-sum-exp."""
  ctx = _context({}, sizes, sizes)
  return jm.programs.attention(1, 1, 1, 4, 4, 4).body(ctx, q, k, k)[1]


def _assert_backward(got, want, tol=2e-5):
  for x, ref in zip(got, want):
    assert x.shape == ref.shape and x.dtype == jnp.float32
    assert rel_err(x, ref) < tol if np.any(ref) else not np.any(x)


@pytest.mark.parametrize("heads,causal", [c for c in COMBOS if c != ("gqa", False)])
def test_backward_whole(heads, causal):
  h, hk = HEADS[heads]
  q, k, v, o, do = _blocks(h, hk, 90, 72, 32)
  sizes = {"i": 90, "j": 72}
  both = _backward_pair(causal, lambda s: _context({}, sizes, sizes), TILES)
  _assert_backward(*both(jnp.zeros(2, jnp.int32), q, k, v, o, do, _lse(q, k, sizes)))


@pytest.mark.parametrize("layout,causal", BLOCK_CASES[:2] + BLOCK_CASES[3:])
def test_backward_blocks(layout, causal):
  """Ring offsets, zigzag chunks, padding queries and keys."""
  q, k, v, o, do = _blocks(4, 2, 64, 64, 32)
  make, starts = STARTS[layout]
  both = _backward_pair(causal, make, TILES)
  lse = _lse(q, k, SIZES)
  for s in starts:
    _assert_backward(*both(jnp.array(s, jnp.int32), q, k, v, o, do, lse))
  if layout == "padded":  # tiles of padding keys are skipped: NaNs there never reach the gradients
    at = jnp.array([192, 192], jnp.int32)
    got, _ = both(at, q, _poison(k), _poison(v), o, do, lse)
    _assert_backward(got, both(at, q, _zero(k), _zero(v), o, do, lse)[1])


def test_cpu_needs_interpret_mode():
  prog = jm.programs.attention(1, 4, 2, 64, 64, 8, causal=True)
  mesh = make_mesh("8")
  with pytest.raises(PreconditionError, match="interpret"):
    jm.Schedule(prog, mesh).patch("pallas_attention")
  assert "triton_attention" not in registry.candidates(prog, mesh)
  assert isinstance(triton_attention._supports(jax.devices("cpu")[0]), str)
  with registry.interpret_mode():
    assert {"pallas_attention", "pallas_attention_dq", "pallas_attention_dkv"} <= {
        *registry.candidates(prog, mesh),
        *registry.candidates(ab.attention_dq(prog), mesh),
        *registry.candidates(ab.attention_dkv(prog), mesh)}


@pytest.mark.parametrize("strategy", ["ring"])
def test_ring_schedule_and_gradient(strategy):
  """A ring on the 8-device mesh with the Pallas kernels: values and gradients equal the reference's."""
  from test_training import _check_grads

  from jaxmercury.schedules.dual import attention_duals
  prog = jm.programs.attention(1, 4, 2, 128, 128, 16, causal=True)
  with registry.interpret_mode():
    s = jm.library(prog, make_mesh("8"))[strategy].patch("pallas_attention")
    assert_matches(s)
    _, dq, dkv = attention_duals(s)
    assert (dq.kernel, dkv.kernel) == ("pallas_attention_dq", "pallas_attention_dkv")
    _check_grads(s)


def test_padded_ring_with_a_variant():
  """Lengths the mesh does not divide (padded queries and keys) and a non-default tile variant."""
  from jaxmercury.schedules.dual import attention_duals
  prog = jm.programs.attention(1, 4, 1, 60, 60, 16, causal=True)
  with registry.interpret_mode():
    s = jm.library(prog, make_mesh("8"))["ring"].patch("pallas_attention", block_q=128)
    assert (s.kernel, s.kernel_config.block_q) == ("pallas_attention", 128)
    assert_matches(s)
    _, dq, dkv = attention_duals(s)  # a tuned variant keeps the Pallas backward kernels
    assert (dq.kernel, dkv.kernel) == ("pallas_attention_dq", "pallas_attention_dkv")


def _lower_for(device_kind, fn, *args):
  mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=jax.sharding.AbstractDevice(device_kind, None, "gpu"))
  with jax.sharding.use_abstract_mesh(mesh):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("device_kind", ["NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3"])
def test_lowers_to_triton(device_kind):
  """Pallas -> Triton IR for a pre-Hopper and a Hopper GPU, bf16, d=128, no GPU needed."""
  s = jax.ShapeDtypeStruct
  q, k = s((1, 256, 2, 2, 128), jnp.bfloat16), s((1, 192, 2, 128), jnp.bfloat16)
  qpos, kpos, lse = s((256,), jnp.int32), s((192,), jnp.int32), s((1, 256, 2, 2), jnp.float32)
  for causal in (False, True):
    text = _lower_for(device_kind, functools.partial(fa.flash_forward, causal=causal), q, k, k, qpos, kpos)
    assert "__gpu$xla.gpu.triton" in text
    for grad in (fa.flash_dq, fa.flash_dkv):
      text = _lower_for(device_kind, functools.partial(grad, causal=causal), q, k, k, q, q, lse, qpos, kpos)
      assert "__gpu$xla.gpu.triton" in text
