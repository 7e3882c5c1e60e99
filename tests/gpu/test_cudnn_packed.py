"""Kernel ``cudnn_packed`` on a Hopper GPU (skipped elsewhere): cuDNN's packed layout against the float32 reference,
B1 H8 KV2 D128 S 8K bf16 rows packed with documents of random lengths, causal within them.

The block's output and log-sum-exp (which the kernel reads out of cuDNN's per-segment statistics), in one call and
in waves of fewer documents; the schedules' outputs and gradients (cuDNN's packed backward from the statistics the
kernel writes back), whole rows on one GPU and the ring on every GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import fresh_key, rel_err
from jax.sharding import AxisType

import jaxmercury as jm
from benchmarks.packed import packing
from gpu.checks import TOL, check_gradients, library_with
from jaxmercury.kernels.attention import cudnn_packed as cp

pytestmark = pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs GPUs")
B, H, KV, S, D = 1, 8, 2, 8192, 128


def _ids(shortest=512, longest=2048):
  seed = int(jax.random.randint(fresh_key(), (), 0, 2**30))
  return jnp.asarray(packing(np.random.default_rng(seed), S, "uniform", shortest, longest))


def _reference(q, k, v, ids, window):
  """Float32 (out [b, s, hk, g, d], lse [b, s, hk, g]) with the documents' causal mask (and window)."""
  f32 = lambda x: x.astype(jnp.float32)
  pos = jnp.arange(S)
  keep = (ids[:, :, None] == ids[:, None, :]) & (pos[:, None] >= pos[None, :])
  if window is not None:
    keep = keep & (pos[:, None] - pos[None, :] < window)
  scores = jnp.einsum("bihgd,bjhd->bhgij", f32(q), f32(k)) / np.sqrt(D)
  scores = jnp.where(keep[:, None, None], scores, -jnp.inf)
  lse = jax.nn.logsumexp(scores, axis=-1)
  out = jnp.einsum("bhgij,bjhd->bihgd", jnp.exp(scores - lse[..., None]), f32(v))
  return out, jnp.transpose(lse, (0, 3, 1, 2))


@pytest.mark.parametrize(("m", "window"), [(32, None), (4, None), (32, 1000)], ids=["one-call", "waves", "window"])
def test_block_output_and_lse(m, window):
  keys = jax.random.split(fresh_key(), 3)
  q = jax.random.normal(keys[0], (B, S, KV, H // KV, D), jnp.bfloat16)
  k, v = (jax.random.normal(key, (B, S, KV, D), jnp.bfloat16) for key in keys[1:])
  ids = _ids()
  run = jax.jit(lambda *a: cp.packed_forward(*a, causal=True, window=window, m=m))
  out, lse = run(q, k, v, ids, ids)
  want_out, want_lse = _reference(q, k, v, ids, window)
  assert rel_err(out, want_out) < TOL
  np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), atol=2e-2, rtol=2e-3)


def test_whole_rows_on_one_gpu_forward_and_gradients():
  prog = jm.programs.attention(B, H, KV, S, S, D, causal=True, segment_ids=True, dtype=jnp.bfloat16)
  mesh = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])
  check_gradients(library_with(prog, "ulysses", "cudnn_packed", mesh))


def test_ring_on_every_gpu_forward_and_gradients():
  prog = jm.programs.attention(B, H, KV, S, S, D, causal=True, segment_ids=True, dtype=jnp.bfloat16)
  check_gradients(library_with(prog, "ring", "cudnn_packed"))
