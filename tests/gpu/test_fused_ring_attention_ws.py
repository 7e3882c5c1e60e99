"""The warp-specialized fused ring-attention kernel on real GPUs: every block configuration against the unfused
program and against all_gather + ``jax.nn.dot_product_attention``, non-causal and causal in natural and zigzag
order, the smallest legal grid, and against the one-warpgroup kernel (skipped on CPU).

Run: ``JAX_PLATFORMS=cuda timeout 540 python3 -m pytest tests/gpu/test_fused_ring_attention_ws.py -x -q``
(the timeout: a ring or a barrier protocol that deadlocks hangs rather than fails).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import fresh_key, rel_err
from gpu.checks import gpu_mesh
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmercury.pallas_kernels.fused_ring_attention import fused_ring_attention, reference
from jaxmercury.pallas_kernels.fused_ring_attention_ws import CONFIGS, fused_ring_attention_ws
from jaxmercury.schedules import orders

pytestmark = pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs GPUs")

SEQ = P(None, "x")
SPECS = dict(in_specs=(SEQ,) * 3, out_specs=(SEQ, P(None, None, "x")), check_vma=False)
HEADS = [(8, 8), (8, 2)]  # (query heads, key/value heads): MHA and GQA
MASKS = [dict(causal=True), dict(causal=True, order="zigzag")]  # zigzag: 2 n chunks, as ring_zigzag stores them


def _one_gpu():
  return jax.make_mesh((1,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])


def _inputs(mesh, s_local, h, kv, d=128, b=1):
  n = mesh.devices.size
  sharding = NamedSharding(mesh, SEQ)
  return [jax.device_put(jax.random.normal(fresh_key(), (b, n * s_local, heads, d), jnp.float32).astype(jnp.bfloat16),
                         sharding) for heads in (h, kv, kv)]


def _run(mesh, fn, *xs):
  return jax.jit(jax.shard_map(fn, mesh=mesh, **SPECS))(*xs)


def _true_order(x, mesh, mask):
  """A global ``[b, S, ...]`` array stored in ``mask``'s order -> true sequence order."""
  if mask.get("order") != "zigzag":
    return x
  return x[:, np.argsort(orders.permutation(x.shape[1], 2 * mesh.devices.size))]


def _params(blocks, **extra):
  return dict(block_q=blocks.block_q, block_kv=blocks.block_kv, max_concurrent_steps=blocks.max_concurrent_steps,
              **extra)


def _check(mesh, s_local, h, kv, blocks, d=128, b=1, num_ctas=None, **mask):
  q, k, v = _inputs(mesh, s_local, h, kv, d, b)
  params = _params(blocks, num_ctas=num_ctas, **mask)
  out, lse = _run(mesh, lambda q, k, v: fused_ring_attention_ws(q, k, v, "x", **params), q, k, v)
  want_out, want_lse = _run(mesh, lambda q, k, v: reference(q, k, v, "x", **mask), q, k, v)
  assert out.shape == q.shape and lse.shape == (q.shape[0], h, q.shape[1])
  assert np.all(np.isfinite(np.asarray(out, np.float32))) and np.all(np.isfinite(np.asarray(lse)))
  assert rel_err(out.astype(jnp.float32), want_out.astype(jnp.float32)) < 2e-2, blocks
  assert rel_err(lse, want_lse) < 1e-3, blocks
  if q.shape[1] <= 16384:  # the same numbers as jax.nn.dot_product_attention (XLA) of the global arrays
    true = lambda x: _true_order(x, mesh, mask)
    dpa = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=mask.get("causal", False)))
    want = dpa(true(q), true(k), true(v))
    assert rel_err(true(out).astype(jnp.float32), want.astype(jnp.float32)) < 2e-2, blocks
  # A second call: the per-step semaphores start from zero each launch, the received buffers are fresh.
  again, _ = _run(mesh, lambda q, k, v: fused_ring_attention_ws(q, k, v, "x", **params), q, k, v)
  assert rel_err(again.astype(jnp.float32), want_out.astype(jnp.float32)) < 2e-2, blocks


@pytest.mark.parametrize("blocks", CONFIGS, ids=str)
@pytest.mark.parametrize("h,kv", HEADS, ids=["mha", "gqa"])
@pytest.mark.parametrize("s_local", [1024, 4096])
def test_every_gpu(s_local, h, kv, blocks):
  _check(gpu_mesh(), s_local, h, kv, blocks)


@pytest.mark.parametrize("blocks", CONFIGS, ids=str)
@pytest.mark.parametrize("h,kv", HEADS, ids=["mha", "gqa"])
@pytest.mark.parametrize("s_local", [1024, 4096])
def test_one_gpu(s_local, h, kv, blocks):
  _check(_one_gpu(), s_local, h, kv, blocks)


@pytest.mark.parametrize("mask", MASKS, ids=["causal", "causal-zigzag"])
@pytest.mark.parametrize("blocks", CONFIGS, ids=str)
@pytest.mark.parametrize("h,kv", HEADS, ids=["mha", "gqa"])
@pytest.mark.parametrize("s_local", [1024, 4096])
def test_every_gpu_causal(s_local, h, kv, blocks, mask):
  """Tiles after the item not loaded, hidden tiles kept in the barrier protocol, forwarders pass every tile on."""
  _check(gpu_mesh(), s_local, h, kv, blocks, **mask)


@pytest.mark.parametrize("mask", MASKS, ids=["causal", "causal-zigzag"])
@pytest.mark.parametrize("h,kv", HEADS, ids=["mha", "gqa"])
def test_one_gpu_causal(h, kv, mask):
  _check(_one_gpu(), 1024, h, kv, CONFIGS[0], **mask)


@pytest.mark.parametrize("mask", [{}] + MASKS, ids=["non-causal", "causal", "causal-zigzag"])
def test_every_gpu_with_the_smallest_grid(mask):
  """``num_ctas = b * kv``: every CTA's first item forwards, then it runs many more items through the same slots."""
  _check(gpu_mesh(), 1024, 8, 2, CONFIGS[0], b=2, num_ctas=4, **mask)


@pytest.mark.parametrize("mask", [{}] + MASKS, ids=["non-causal", "causal", "causal-zigzag"])
def test_every_gpu_with_head_dimension_64(mask):
  _check(gpu_mesh(), 1024, 8, 2, CONFIGS[2], d=64, **mask)


def test_every_gpu_with_the_benchmarks_heads():
  """32 query heads over 8 key/value heads, d = 128, as in benchmarks/fused_attention.py (one config)."""
  _check(gpu_mesh(), 1024, 32, 8, CONFIGS[0])


def test_every_gpu_matches_cudnn():
  mesh = gpu_mesh()
  q, k, v = _inputs(mesh, 1024, 8, 2)
  out, _ = _run(mesh, lambda q, k, v: fused_ring_attention_ws(q, k, v, "x"), q, k, v)

  def cudnn(q, k, v):
    k, v = (jax.lax.all_gather(x, "x", axis=1, tiled=True) for x in (k, v))
    return jax.nn.dot_product_attention(q, k, v, implementation="cudnn")

  want = jax.jit(jax.shard_map(cudnn, mesh=mesh, in_specs=(SEQ,) * 3, out_specs=SEQ, check_vma=False))(q, k, v)
  assert rel_err(out.astype(jnp.float32), want.astype(jnp.float32)) < 2e-2


@pytest.mark.parametrize("mask", [{}] + MASKS, ids=["non-causal", "causal", "causal-zigzag"])
def test_every_gpu_matches_the_one_warpgroup_kernel(mask):
  mesh = gpu_mesh()
  q, k, v = _inputs(mesh, 2048, 8, 2)
  out, lse = _run(mesh, lambda q, k, v: fused_ring_attention_ws(q, k, v, "x", **mask), q, k, v)
  want_out, want_lse = _run(mesh, lambda q, k, v: fused_ring_attention(q, k, v, "x", **mask), q, k, v)
  assert rel_err(out.astype(jnp.float32), want_out.astype(jnp.float32)) < 1e-2
  assert rel_err(lse, want_lse) < 1e-4
