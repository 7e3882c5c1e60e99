"""The warp-specialized fused ring-attention kernel on real GPUs: every block configuration against the unfused
program and against all_gather + ``jax.nn.dot_product_attention``, non-causal and causal in natural and zigzag
order, the smallest legal grid, against the one-warpgroup kernel, one GPU's orders (pipelined consumers, split
tails, folded rounds), and its forwarding path as a loopback ring on one GPU (skipped on CPU).

Run: ``JAX_PLATFORMS=cuda timeout 540 python3 -m pytest tests/gpu/test_fused_ring_attention_ws.py -x -q``
(the timeout: a ring or a barrier protocol that deadlocks hangs rather than fails).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_err
from ring_attention_checks import HEADS, MASKS, check, check_loopback, check_matches_cudnn, first_devices, inputs, run

from gpu.checks import gpu_mesh
from jaxmercury.kernels.attention.ring import fused_ring_attention
from jaxmercury.kernels.attention.ws_forward import CONFIGS, WsBlocks, _kernel, fused_ring_attention_ws
from jaxmercury.kernels.attention.ws_order import Folded
from jaxmercury.kernels.mosaic_gpu import sm_count

pytestmark = pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs GPUs")

_check = functools.partial(check, fused_ring_attention_ws)


@pytest.mark.parametrize("blocks", CONFIGS, ids=str)
@pytest.mark.parametrize("h,kv", HEADS, ids=["mha", "gqa"])
@pytest.mark.parametrize("s_local", [1024, 4096])
def test_every_gpu(s_local, h, kv, blocks):
  _check(gpu_mesh(), s_local, h, kv, blocks)


@pytest.mark.parametrize("blocks", CONFIGS, ids=str)
@pytest.mark.parametrize("h,kv", HEADS, ids=["mha", "gqa"])
@pytest.mark.parametrize("s_local", [1024, 4096])
def test_one_gpu(s_local, h, kv, blocks):
  """One GPU without a mask: pipelined consumers (each tile's softmax behind the previous tile's P V wgmma: two
  accumulators live, the scores read early), heads in turn, a split tail where the last round is part empty."""
  _check(first_devices(), s_local, h, kv, blocks)


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
  _check(first_devices(), 1024, h, kv, CONFIGS[0], **mask)


@pytest.mark.parametrize("s,h,kv,num_ctas", [(1024, 4, 2, 6), (4096, 12, 12, None), (4096, 12, 4, None)],
                         ids=["6-ctas", "mha-every-sm", "gqa-every-sm"])
def test_one_gpu_causal_in_folded_rounds(s, h, kv, num_ctas):
  """Causal on one GPU where the blocks fold (``ws_order.Folded``): 8 blocks a head over 6 CTAs (two pairs of
  rounds, then each head's 2 lightest blocks), and H12 S4K over every SM (132: one pair of rounds, then each
  head's 10 lightest of 32 blocks)."""
  grid = num_ctas or sm_count()
  assert Folded.make(np.arange(s // 128, 0, -1), h, grid) is not None, f"no folding of H{h} S{s} over {grid} CTAs"
  _check(first_devices(), s, h, kv, CONFIGS[0], num_ctas=num_ctas, causal=True)


@pytest.mark.parametrize("mask", [{}] + MASKS, ids=["non-causal", "causal", "causal-zigzag"])
def test_every_gpu_with_the_smallest_grid(mask):
  """``num_ctas = b * kv``: every CTA's first item forwards, then it runs many more items through the same slots."""
  _check(gpu_mesh(), 1024, 8, 2, CONFIGS[0], b=2, num_ctas=4, **mask)


@pytest.mark.parametrize("mask", [{}] + MASKS, ids=["non-causal", "causal", "causal-zigzag"])
def test_every_gpu_with_head_dimension_64(mask):
  _check(gpu_mesh(), 1024, 8, 2, CONFIGS[2], d=64, **mask)


def test_every_gpu_with_the_benchmarks_heads():
  """32 query heads over 8 key/value heads, d = 128, as in the fused suite of python -m benchmarks.run (one config)."""
  _check(gpu_mesh(), 1024, 32, 8, CONFIGS[0])


def test_every_gpu_matches_cudnn():
  check_matches_cudnn(fused_ring_attention_ws, gpu_mesh())


@pytest.mark.parametrize("mask", [{}] + MASKS, ids=["non-causal", "causal", "causal-zigzag"])
def test_every_gpu_matches_the_one_warpgroup_kernel(mask):
  mesh = gpu_mesh()
  q, k, v = inputs(mesh, 2048, 8, 2)
  out, lse = run(mesh, lambda q, k, v: fused_ring_attention_ws(q, k, v, "x", **mask), q, k, v)
  want_out, want_lse = run(mesh, lambda q, k, v: fused_ring_attention(q, k, v, "x", **mask), q, k, v)
  assert rel_err(out.astype(jnp.float32), want_out.astype(jnp.float32)) < 1e-2
  assert rel_err(lse, want_lse) < 1e-4


@pytest.mark.parametrize("n,causal,order,chunks", [(3, False, "natural", None), (3, True, "natural", None),
                                                   (2, True, "zigzag", 8)], ids=["3", "causal-3", "zigzag8-2"])
def test_the_forwarding_path_in_a_loopback_ring(n, causal, order, chunks):
  """One GPU, one CTA, ``n`` ring steps: the forwarders' TMA stores into the device's own ``received`` and every
  later step read back from there, on the hardware (``_kernel(..., loopback=True)``)."""
  check_loopback(_kernel, WsBlocks(64, 128, 2), n, 1, 1024, 4, 2, 128, causal, order, chunks)
