"""cuDNN attention patched into distributed schedules, on real GPUs (skipped on CPU)."""

import jax
import jax.numpy as jnp
import pytest

import jaxmercury as jm
from gpu.checks import check_gradients, check_schedule, gpu_mesh, library_with

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

  from jaxmercury.lowering.local_backward import local_reason
  from jaxmercury.tuner.autotuner import with_layouts
  n = len(jax.devices())
  prog = jm.programs.attention(1, 8 * n, 2 * n, 2048, 2048, 128, causal=causal, dtype=jnp.bfloat16)
  heads = P(None, None, "x", None)
  schedule = with_layouts(jm.library(prog, gpu_mesh())["ulysses"], [heads] * 3, heads).patch("cudnn_attention")
  assert local_reason(schedule) is None
  check_gradients(schedule)


@pytest.mark.parametrize("causal", [False, True])
def test_joint_backward_runs_one_cudnn_call_per_block_pair(causal):
  """dq and dk-dv in one nest on cuDNN blocks (each device's queries and keys tiled in two, serial), against the
  float32 reference: one cuDNN backward call per block pair returns both programs' blocks."""
  from conftest import fresh_key, rel_err

  from jaxmercury.lowering.joint_backward import joint_backward, joint_reason
  from jaxmercury.schedules.dual import attention_duals
  prog = jm.programs.attention(1, 8, 2, 2048, 2048, 128, causal=causal, dtype=jnp.bfloat16)
  ring = jm.library(prog, gpu_mesh())["ring"]
  ring.tile("i_in", 2).tile("j_in", 2).patch("cudnn_attention")  # 4 block pairs of one size per ring step
  with_lse, dq_s, dkv_s = attention_duals(ring, joint=True)
  assert dq_s.kernel == "cudnn_attention_dq" and joint_reason(dq_s, dkv_s) is None
  q, k, v = prog.random_inputs(fresh_key())
  do = jax.random.normal(fresh_key(), prog.writes.shape, jnp.float32)
  olse = with_lse.compile(differentiable=False)(q, k, v)
  o, lse = olse[..., :-1].astype(jnp.bfloat16), olse[..., -1]
  dq, dkv = joint_backward(dq_s, dkv_s)(q, k, v, o, do.astype(jnp.bfloat16), lse)
  f32 = jm.programs.attention(**{**prog.params, "dtype": jnp.float32})
  _, vjp = jax.vjp(f32.reference, *(x.astype(jnp.float32) for x in (q, k, v)))
  for name, got, want in zip("qkv", (dq, dkv[..., 0, :], dkv[..., 1, :]), vjp(do)):
    assert rel_err(got.astype(jnp.float32), want) < 3e-2, f"d{name}"
