"""Packed rows on real GPUs (skipped on CPU): the rings that skip steps by segment ids and the balanced split, on
cuDNN blocks, forward and gradients against the float32 reference, on random packings (``Program.random_inputs``
draws segment ids as rows of documents)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import fresh_key, rel_err
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxmercury as jm
from gpu.checks import check_gradients, gpu_mesh, library_with

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
