"""Our warp-specialized attention kernels with mask arrays on one GPU (skipped on CPU): the forward and the one-pass
backward reading a boolean ``mask`` (per-call tile kinds, each item's list of key tiles, partial tiles' bytes loaded
beside K or Q and compared in registers), B1 H32 KV8 D128 bf16, forward and gradients against the float32
reference; and ``ws_attention`` in a one-GPU schedule of a ``mask=True`` program.

The masks are drawn on the device: blocks of 128 x 128 all hidden, all kept or mixed at random (tiles of every kind
for both kernels' tiles), a few rows keeping nothing; over every head or broadcast over the heads (one
``[1, 1, S, S]`` array, not copied per head).

Run: ``JAX_PLATFORMS=cuda timeout 540 python3 -m pytest tests/gpu/test_ws_mask_array_gpu.py -x -q`` (the timeout: a
barrier protocol that deadlocks hangs rather than fails).
"""

import jax
import jax.numpy as jnp
import pytest
from conftest import fresh_key
from jax.sharding import AxisType
from packed_checks import assert_forward, assert_grads, inputs, keep_mask, reference_grads

import jaxmercury as jm
from gpu.checks import GRAD_TOL, TOL, check_gradients, check_schedule
from jaxmercury.kernels.attention.ws_backward import attention_backward_ws
from jaxmercury.kernels.attention.ws_forward import fused_ring_attention_ws

pytestmark = pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs GPUs")

BLOCK = 128  # the mask's blocks of one kind: a multiple of every kernel tile


def device_mask(heads: int, s: int):
  """A fresh bool mask ``[1, heads, s, s]`` on the device: each ``BLOCK`` x ``BLOCK`` block hidden, kept whole or
  mixed (pairs kept at random), and 4 random rows that keep nothing."""
  kinds = jax.random.randint(fresh_key(), (1, heads, s // BLOCK, s // BLOCK), 0, 3)
  kinds = jnp.repeat(jnp.repeat(kinds, BLOCK, axis=2), BLOCK, axis=3)
  mixed = jax.random.bernoulli(fresh_key(), 0.5, (1, heads, s, s))
  mask = jnp.where(kinds == 0, False, jnp.where(kinds == 1, True, mixed))
  empty = jax.random.randint(fresh_key(), (4,), 0, s)
  return mask.at[:, :, empty, :].set(False)


@pytest.mark.parametrize("heads,s,causal,window", [(1, 8192, True, None), (32, 4096, True, None),
                                                   (32, 4096, False, None), (1, 8192, True, (2048, 0))],
                         ids=["broadcast-heads-8K-causal", "per-head-4K-causal", "per-head-4K", "window-8K"])
def test_ws_kernels_read_mask_arrays(heads, s, causal, window):
  """Forward and one-pass backward with a mask array (and causal, a sliding window), B1 H32 KV8 D128 bf16: rows
  that keep no key give ``out = 0``, ``lse = -inf`` and no gradient. The backward takes the forward's own output and
  log-sum-exp, as a training step does."""
  q, k, v, do = inputs(1, s, 32, 8, 128)
  mask = device_mask(heads, s)
  keep = mask & jnp.asarray(keep_mask(None, None, causal=causal, window=window, s_q=s, s_kv=s))[:, None]
  masked = dict(causal=causal, window=window)
  out, lse = jax.jit(lambda q, k, v, m: fused_ring_attention_ws(q, k, v, None, mask=m, **masked))(q, k, v, mask)
  assert_forward(out, lse, q, k, v, keep, tol=TOL)
  want, _ = reference_grads(q, k, v, do, keep)
  got = jax.jit(lambda *x: attention_backward_ws(*x[:6], mask=x[6], **masked))(q, k, v, out, do, lse, mask)
  assert_grads(got, want, tol=GRAD_TOL)


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_ws_attention_trains_with_a_mask_array(axis_type):
  """A one-GPU schedule of causal attention with a ``[B, S, S]`` mask array patched with ws_attention (the tuner
  offers it for mask arrays once these tests pass: ``unverified_masks``): our kernels forward and backward against the float32 reference."""
  mesh = jax.make_mesh((1,), ("x",), axis_types=(axis_type,), devices=jax.devices()[:1])
  prog = jm.programs.attention(1, 32, 8, 8192, 8192, 128, causal=True, mask=True, dtype=jnp.bfloat16)
  schedule = jm.Schedule(prog, mesh).patch("ws_attention")
  check_schedule(schedule)
  check_gradients(schedule)
