"""cuDNN attention patched into distributed schedules, on real GPUs (skipped on CPU)."""

import jax
import jax.numpy as jnp
import pytest
from gpu.checks import check_gradients, check_schedule, gpu_mesh, library_with

import jaxmercury as jm

pytestmark = pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs GPUs")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("strategy", ["ring", "context_parallel", "tree", "ulysses"])
def test_library_with_cudnn(strategy, causal):
  prog = jm.programs.attention(2, 8, 2, 1024, 1024, 128, causal=causal, dtype=jnp.bfloat16)
  check_schedule(library_with(prog, strategy, "cudnn_attention"))


@pytest.mark.parametrize("causal", [False, True])
def test_ring_with_uneven_blocks_uses_all_paths(causal):
  """Tiling keys finer than queries exercises the visible, hidden and fallback branches."""
  prog = jm.programs.attention(1, 4, 4, 512, 512, 64, causal=causal, dtype=jnp.bfloat16)
  n = len(jax.devices())
  s = jm.Schedule(prog, gpu_mesh()).tile("i", n).parallelize("i0", "x").tile("j", n).shift("j0", "i0")
  s.tile("j1", 2).patch("cudnn_attention")
  check_schedule(s)


@pytest.mark.parametrize("strategy", ["ring", "ring_zigzag", "context_parallel"])
def test_gradients_with_cudnn_backward(strategy):
  prog = jm.programs.attention(1, 8, 2, 2048, 2048, 128, causal=True, dtype=jnp.bfloat16)
  check_gradients(jm.library(prog, gpu_mesh())[strategy].patch("cudnn_attention"))


@pytest.mark.parametrize("causal", [False, True])
def test_head_parallel_gradients_with_one_fused_cudnn_backward(causal):
  """Heads split over the devices: the backward is one cuDNN call per device (``local_backward``)."""
  from jax.sharding import PartitionSpec as P

  from jaxmercury.shard_map.local_backward import local_reason
  from jaxmercury.tuner.tune import with_layouts
  n = len(jax.devices())
  prog = jm.programs.attention(1, 8 * n, 2 * n, 2048, 2048, 128, causal=causal, dtype=jnp.bfloat16)
  heads = P(None, None, "x", None)
  schedule = with_layouts(jm.library(prog, gpu_mesh())["ulysses"], [heads] * 3, heads).patch("cudnn_attention")
  assert local_reason(schedule) is None
  check_gradients(schedule)
