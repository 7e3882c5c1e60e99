"""The Pallas flash attention kernels compiled for the GPU (Triton lowering), and the
jax-triton kernel when importable; skipped without a GPU.

Each kernel is compared in bf16 against the float32 XLA reference at S=1024..4096,
d=128; ``-s`` prints rough timings (never asserted).
"""

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import fresh_key, rel_err

import jaxmercury as jm
from gpu.checks import check_gradients, check_schedule, gpu_mesh, library_with
from jaxmercury.kernels.attention import pallas as fa
from jaxmercury.kernels.attention import triton as ta
from jaxmercury.programs import attention_backward as ab

pytestmark = pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs GPUs")


def _inputs(heads, kv_heads, s, d=128, dtype=jnp.bfloat16, b=1):
  keys = jax.random.split(fresh_key(), 4)
  q = jax.random.normal(keys[0], (b, s, kv_heads, heads // kv_heads, d)).astype(dtype)
  k, v = (jax.random.normal(x, (b, s, kv_heads, d)).astype(dtype) for x in keys[1:3])
  do = jax.random.normal(keys[3], q.shape).astype(dtype)
  return q, k, v, do


def _ctx(s):
  return jm.BlockContext(starts={}, sizes={"i": s, "j": s}, extents={"i": s, "j": s})


def _reference(q, k, v, causal):
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  body = jm.programs.attention(1, 1, 1, 4, 4, 4, causal=causal).body
  return jax.jit(lambda *x: body(_ctx(q.shape[1]), *x))(*f32)


def _time(f, *args, reps=10):
  jax.block_until_ready(f(*args))
  start = time.perf_counter()
  for _ in range(reps):
    out = f(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - start) / reps


def _check_forward(fn, q, k, v, causal, label):
  s = q.shape[1]
  pos = jnp.arange(s, dtype=jnp.int32)
  f = jax.jit(lambda q, k, v: fn(q, k, v, pos, pos, causal=causal))
  out, lse = f(q, k, v)
  ref_out, ref_lse = _reference(q, k, v, causal)
  assert rel_err(out, ref_out) < 2e-2, label
  assert float(jnp.max(jnp.abs(lse - ref_lse))) < 5e-2, label
  ms = _time(f, q, k, v) * 1e3
  flops = 4 * q.shape[0] * q.shape[2] * q.shape[3] * s * s * q.shape[4] * (0.5 if causal else 1.0)
  print(f"{label}: {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("s", [1024, 4096])
def test_pallas_forward(s, causal):
  q, k, v, _ = _inputs(8, 2, s)
  _check_forward(fa.flash_forward, q, k, v, causal, f"pallas fwd S={s} causal={causal}")


@pytest.mark.parametrize("block_q,block_kv", [(64, 128), (128, 64), (128, 128)])
def test_pallas_forward_variants(block_q, block_kv):
  q, k, v, _ = _inputs(8, 8, 2048)
  fn = functools.partial(fa.flash_forward, block_q=block_q, block_kv=block_kv)
  _check_forward(fn, q, k, v, True, f"pallas fwd block_q={block_q} block_kv={block_kv}")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("s", [1024, 2048])
def test_pallas_backward(s, causal):
  q, k, v, do = _inputs(8, 2, s)
  o, lse = _reference(q, k, v, causal)
  o = o.astype(q.dtype)
  pos = jnp.arange(s, dtype=jnp.int32)
  args = (q, k, v, o, do, lse)
  dq = jax.jit(lambda *x: fa.flash_dq(*x, pos, pos, causal=causal))(*args)
  dkv = jax.jit(lambda *x: fa.flash_dkv(*x, pos, pos, causal=causal))(*args)
  f32 = [x.astype(jnp.float32) if x.dtype != jnp.float32 else x for x in args]
  ref_dq = jax.jit(lambda *x: ab.dq_block(_ctx(s), *x, causal=causal))(*f32)
  ref_dkv = jax.jit(lambda *x: ab.dkv_block(_ctx(s), *x, causal=causal))(*f32)
  assert rel_err(dq, ref_dq) < 3e-2
  assert rel_err(dkv[..., 0, :], ref_dkv[..., 0, :]) < 3e-2
  assert rel_err(dkv[..., 1, :], ref_dkv[..., 1, :]) < 3e-2


@pytest.mark.parametrize("strategy", ["ring", "ring_zigzag", "context_parallel"])
def test_schedule_with_pallas_kernels(strategy):
  """The patched forward and its dual backward (Pallas dq/dkv) on all GPUs, values and gradients."""
  prog = jm.programs.attention(1, 8, 2, 2048, 2048, 128, causal=True, dtype=jnp.bfloat16)
  check_gradients(library_with(prog, strategy, "pallas_attention"))


def _triton_or_skip():
  reason = ta._supports(jax.devices()[0])
  if reason:
    pytest.skip(reason)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("s", [1024, 4096])
def test_triton_forward(s, causal):
  _triton_or_skip()
  q, k, v, _ = _inputs(8, 2, s)
  _check_forward(ta.triton_forward, q, k, v, causal, f"triton fwd S={s} causal={causal}")


def test_triton_ring_offsets_and_padding():
  """The Triton kernel on ring-like blocks: traced starts, padding keys, a length not a tile multiple."""
  _triton_or_skip()
  q, k, v, _ = _inputs(8, 2, 1000)
  body = jm.programs.attention(1, 1, 1, 4, 4, 4, causal=True).body
  sizes, extents = {"i": 1000, "j": 1000}, {"i": 4000, "j": 3900}

  @jax.jit
  def both(starts, q, k, v):
    ctx = jm.BlockContext(starts={"i": starts[0], "j": starts[1]}, sizes=sizes, extents=extents)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    return ta.triton_attention_block(ctx, q, k, v, causal=True), body(ctx, *f32)

  for starts in [(2000, 0), (2000, 2000), (1000, 3000), (3000, 2500)]:
    (out, lse), (ref_out, ref_lse) = both(jnp.array(starts, jnp.int32), q, k, v)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    if np.any(ref_out):
      assert rel_err(out, ref_out) < 2e-2, starts


def test_triton_schedule():
  _triton_or_skip()
  prog = jm.programs.attention(1, 8, 2, 2048, 2048, 128, causal=True, dtype=jnp.bfloat16)
  check_schedule(jm.library(prog, gpu_mesh())["ring"].patch("triton_attention"))
