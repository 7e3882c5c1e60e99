"""Packed rows on real GPUs (skipped on CPU): the rings that skip steps by segment ids and the balanced split, on
cuDNN blocks, and our warp-specialized kernels' masked path (segment ids read in the kernels) on one GPU, forward
and gradients against the float32 reference, on random packings (``Program.random_inputs`` draws segment ids as
rows of documents; ``packed_checks.segment_ids`` other layouts).

Run: ``JAX_PLATFORMS=cuda timeout 540 python3 -m pytest tests/gpu/test_packed_gpu.py -x -q`` (the timeout: a
barrier protocol that deadlocks hangs rather than fails).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import fresh_key, rel_err
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from packed_checks import assert_forward, assert_grads, inputs, keep_mask, reference_grads, segment_ids

import jaxmercury as jm
from gpu.checks import GRAD_TOL, TOL, check_gradients, check_schedule, gpu_mesh, library_with
from jaxmercury.kernels.attention.ws_backward import attention_backward_ws
from jaxmercury.kernels.attention.ws_forward import fused_ring_attention_ws

pytestmark = pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs GPUs")


@pytest.mark.parametrize("strategy", ["ring", "ring_zigzag", "ring_balanced"])
def test_packed_rings_on_cudnn(strategy):
  prog = jm.programs.attention(2, 8, 2, 4096, 4096, 128, causal=True, segment_ids=True, dtype=jnp.bfloat16)
  check_gradients(library_with(prog, strategy, "cudnn_attention"))


def test_packed_ring_with_one_long_document():
  """One document of half the row among short ones, split along the sequence as callers hold it: the ring runs
  the steps that document needs, and the balanced ring agrees with it."""
  n = len(jax.devices())
  t = 1024 * n
  prog = jm.programs.attention(1, 8, 2, t, t, 128, causal=True, segment_ids=True, dtype=jnp.bfloat16)
  seg = np.repeat(np.arange(t // 128), 128)[None].astype(np.int32)
  seg[0, t // 4:3 * t // 4] = t
  q, k, v = prog.random_inputs(fresh_key())[:3]
  put = lambda x: jax.device_put(x, NamedSharding(gpu_mesh(), P(None, "x")))
  xs = tuple(map(put, (q, k, v, jnp.asarray(seg), jnp.asarray(seg))))
  f32 = jm.programs.attention(1, 8, 2, t, t, 128, causal=True, segment_ids=True)
  ref = f32.reference(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), seg, seg)
  ring = library_with(prog, "ring", "cudnn_attention")
  assert len(ring.data_run(seg, seg).steps["j0"]) <= max(2, n // 2)  # the document spans half the devices
  for strategy in ("ring", "ring_balanced"):
    y = library_with(prog, strategy, "cudnn_attention").compile()(*xs)
    assert rel_err(y.astype(jnp.float32), ref) < 2e-2, strategy


@pytest.mark.parametrize("kind,s,window", [("packed", 4096, None), ("long", 8192, None), ("orphans", 4096, None),
                                           ("packed", 8192, (2048, 0))])
def test_ws_kernels_read_segment_ids(kind, s, window):
  """Our forward and one-pass backward kernels with segment ids, causal within documents, B1 H8 KV2 D128 bf16 on
  one GPU: documents of random lengths, one of more than half the row, a document whose queries keep no key
  (``out = 0``, ``lse = -inf``, no gradient), a sliding window over the documents. The backward takes the
  forward's own output and log-sum-exp, as a training step does."""
  q, k, v, do = inputs(1, s, 8, 2, 128)
  q_ids, kv_ids = segment_ids(kind, 1, s)
  keep = keep_mask(q_ids, kv_ids, causal=True, window=window)
  masked = dict(causal=True, window=window)
  out, lse = jax.jit(lambda q, k, v, a, c: fused_ring_attention_ws(q, k, v, None, q_segment_ids=a, kv_segment_ids=c,
                                                                   **masked))(q, k, v, q_ids, kv_ids)
  assert_forward(out, lse, q, k, v, keep, tol=TOL)
  want, _ = reference_grads(q, k, v, do, keep)
  got = jax.jit(lambda *x: attention_backward_ws(*x[:6], q_segment_ids=x[6], kv_segment_ids=x[7], **masked))(
      q, k, v, out, do, lse, q_ids, kv_ids)
  assert_grads(got, want, tol=GRAD_TOL)


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_ws_attention_trains_on_packed_rows(axis_type):
  """A one-GPU schedule of packed attention patched with ws_attention (the registry offers it for segment ids):
  our kernels forward and backward against the float32 reference."""
  mesh = jax.make_mesh((1,), ("x",), axis_types=(axis_type,), devices=jax.devices()[:1])
  prog = jm.programs.attention(1, 8, 2, 8192, 8192, 128, causal=True, segment_ids=True, dtype=jnp.bfloat16)
  schedule = jm.Schedule(prog, mesh).patch("ws_attention")
  check_schedule(schedule)
  check_gradients(schedule)
