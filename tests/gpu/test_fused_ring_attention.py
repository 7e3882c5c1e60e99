"""The fused ring-attention kernel on real GPUs: every block configuration against the unfused program
and against all_gather + ``jax.nn.dot_product_attention``, non-causal and causal in natural and zigzag order,
and its forwarding path as a loopback ring on one GPU (skipped on CPU).

Run: ``JAX_PLATFORMS=cuda timeout 540 python3 -m pytest tests/gpu/test_fused_ring_attention.py -x -q``
(the timeout: a ring that deadlocks hangs rather than fails).
"""

import functools

import jax
import jax.numpy as jnp
import pytest
from conftest import fresh_key, rel_err
from ring_attention_checks import HEADS, MASKS, SPECS, check, check_loopback, check_matches_cudnn, first_devices, inputs

from gpu.checks import gpu_mesh
from jaxmercury.kernels.attention.ring import (
  CONFIGS,
  Blocks,
  _kernel,
  fused_ring_attention,
  reference,
  ring_attention,
)

pytestmark = pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs GPUs")

_check = functools.partial(check, fused_ring_attention)


@pytest.mark.parametrize("mask", MASKS, ids=["causal", "causal-zigzag"])
@pytest.mark.parametrize("blocks", CONFIGS, ids=str)
@pytest.mark.parametrize("h,kv", HEADS, ids=["mha", "gqa"])
@pytest.mark.parametrize("s_local", [1024, 4096])
def test_every_gpu_causal(s_local, h, kv, blocks, mask):
  """Hidden tiles skipped, partial ones masked, and a forwarder still passes every tile on: no stall, no NaN."""
  _check(gpu_mesh(), s_local, h, kv, blocks, **mask)


@pytest.mark.parametrize("mask", MASKS, ids=["causal", "causal-zigzag"])
@pytest.mark.parametrize("h,kv", HEADS, ids=["mha", "gqa"])
def test_one_gpu_causal(h, kv, mask):
  _check(first_devices(), 1024, h, kv, CONFIGS[0], **mask)


@pytest.mark.parametrize("blocks", CONFIGS, ids=str)
@pytest.mark.parametrize("h,kv", HEADS, ids=["mha", "gqa"])
@pytest.mark.parametrize("s_local", [1024, 4096])
def test_every_gpu(s_local, h, kv, blocks):
  _check(gpu_mesh(), s_local, h, kv, blocks)


@pytest.mark.parametrize("blocks", CONFIGS, ids=str)
@pytest.mark.parametrize("h,kv", HEADS, ids=["mha", "gqa"])
@pytest.mark.parametrize("s_local", [1024, 4096])
def test_one_gpu(s_local, h, kv, blocks):
  _check(first_devices(), s_local, h, kv, blocks)


def test_every_gpu_with_the_benchmarks_heads():
  """32 query heads over 8 key/value heads, d = 128, as in the fused suite of python -m benchmarks.run (one config)."""
  _check(gpu_mesh(), 1024, 32, 8, CONFIGS[0])


def test_every_gpu_matches_cudnn():
  check_matches_cudnn(fused_ring_attention, gpu_mesh())


@pytest.mark.parametrize("mask", [{}] + MASKS, ids=["non-causal", "causal", "causal-zigzag"])
def test_the_gradient_on_every_gpu(mask):
  mesh = gpu_mesh()
  q, k, v = inputs(mesh, 1024, 8, 2)
  cot = jax.random.normal(fresh_key(), q.shape, jnp.float32)

  def grads(attention):
    def loss(q, k, v):
      out, lse = jax.shard_map(attention, mesh=mesh, **SPECS)(q, k, v)
      return jnp.sum(out.astype(jnp.float32) * cot) + jnp.sum(lse)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

  got = grads(lambda q, k, v: ring_attention(q, k, v, "x", **mask))
  want = grads(lambda q, k, v: reference(q, k, v, "x", **mask))
  for g, w in zip(got, want):
    assert rel_err(g.astype(jnp.float32), w.astype(jnp.float32)) < 3e-2


@pytest.mark.parametrize("n,causal,order,chunks", [(3, False, "natural", None), (3, True, "natural", None),
                                                   (2, True, "zigzag", 8)], ids=["3", "causal-3", "zigzag8-2"])
def test_the_forwarding_path_in_a_loopback_ring(n, causal, order, chunks):
  """One GPU, one CTA, ``n`` ring steps: the forwarders' TMA stores into the device's own ``received`` and every
  later step read back from there, on the hardware (``_kernel(..., loopback=True)``)."""
  check_loopback(_kernel, Blocks(64, 128, 2), n, 1, 1024, 4, 2, 128, causal, order, chunks)
