"""The fused ring-attention kernel on one device in Mosaic GPU interpret mode, causal or not, its input
checks, its gradient, its global positions, and the 8-device ring's lowering to Mosaic GPU (no GPU needed).

Peer stores and remote semaphores have no interpreter; the ring runs in
tests/gpu/test_fused_ring_attention.py. The loopback ring here
(``_kernel(..., loopback=True)``, one CTA) stores every forwarded tile into
the device's own ``received`` and reads it back at the next step, which
covers the forwarders' stores and every ring step's positions and tile
counts. In interpret mode the P V product is a
plain dot (the interpreter's wgmma reads its left operand from SMEM only);
the lowering test covers the register-operand wgmma the GPU runs.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import fresh_key, h100_mesh, lower_for_gpus, mosaic_kernels, rel_err
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from ring_attention_checks import SEQ, SPECS, check_loopback, first_devices, local_inputs, run

from jaxmercury.errors import PreconditionError
from jaxmercury.ir import orders
from jaxmercury.kernels.attention.ring import (
  CONFIGS,
  Blocks,
  _kernel,
  fused_ring_attention,
  positions,
  reference,
  ring_attention,
  round_robin_item,
)

BLOCKS = [dict(block_q=64, block_kv=64, max_concurrent_steps=2), dict(block_q=64, block_kv=128, max_concurrent_steps=3)]


# Each block configuration once, each shape once: MHA on the default grid of a device without an SM count (4 CTAs),
# GQA d 128 over 3 CTAs.
@pytest.mark.parametrize("b,s,h,kv,d,blocks,num_ctas", [(1, 128, 2, 2, 64, BLOCKS[0], None),
                                                        (2, 128, 4, 2, 128, BLOCKS[1], 3)], ids=["mha", "gqa"])
def test_one_device_matches_the_reference(b, s, h, kv, d, blocks, num_ctas):
  q, k, v = local_inputs(b, s, h, kv, d)
  out, lse = run(first_devices(), lambda q, k, v: fused_ring_attention(q, k, v, "x", num_ctas=num_ctas,
                                                                       interpret=True, **blocks), q, k, v)
  want_out, want_lse = run(first_devices(), lambda q, k, v: reference(q, k, v, "x"), q, k, v)
  assert out.shape == q.shape and out.dtype == jnp.bfloat16
  assert lse.shape == (b, h, s) and lse.dtype == jnp.float32
  assert rel_err(out.astype(jnp.float32), want_out.astype(jnp.float32)) < 2e-2
  assert rel_err(lse, want_lse) < 1e-3


def test_the_reference_is_dot_product_attention():
  q, k, v = local_inputs(1, 64, 4, 2, 64, jnp.float32)
  out, lse = run(first_devices(), lambda q, k, v: reference(q, k, v, "x"), q, k, v)
  assert rel_err(out, jax.nn.dot_product_attention(q, k, v)) < 1e-5
  scores = jnp.einsum("bshd,bthd->bhst", q, jnp.repeat(k, 2, axis=2)) / np.sqrt(64)
  assert rel_err(lse, jax.nn.logsumexp(scores, axis=-1)) < 1e-5


# ------------------------------------------------------------------ causal
# (order, zigzag chunks, local sequence length): with one device, the default zigzag (2 chunks) is the natural
# order, 4 chunks store true chunks 0, 3, 1, 2: hidden, visible and partial tiles in every ring-step run.
ORDERS = [("natural", None, 256), ("zigzag", None, 256), ("zigzag", 4, 512)]


def _true_order(x, chunks):
  """``x [b, s, ...]`` stored in zigzag order (``chunks`` chunks) -> true sequence order."""
  return x if chunks is None else x[:, np.argsort(orders.permutation(x.shape[1], chunks))]


# Each order once, each head layout and block configuration (zigzag4's runs: several tiles of 64 keys).
@pytest.mark.parametrize("order,chunks,s,b,h,kv,blocks", [(*ORDERS[0], 1, 2, 2, BLOCKS[0]), (*ORDERS[1], 2, 4, 2, BLOCKS[1]),
                                                          (*ORDERS[2], 1, 2, 2, BLOCKS[0])],
                         ids=["natural-mha", "zigzag-gqa", "zigzag4-mha"])
def test_causal_one_device_matches_the_reference(order, chunks, s, b, h, kv, blocks):
  q, k, v = local_inputs(b, s, h, kv, 64)
  mask = dict(causal=True, order=order, chunks=chunks)
  out, lse = run(first_devices(), lambda q, k, v: fused_ring_attention(q, k, v, "x", num_ctas=3, interpret=True,
                                                                       **mask, **blocks),
                  q, k, v)
  want_out, want_lse = run(first_devices(), lambda q, k, v: reference(q, k, v, "x", **mask), q, k, v)
  assert out.shape == q.shape and out.dtype == jnp.bfloat16 and lse.shape == (b, h, s)
  assert np.all(np.isfinite(np.asarray(out, np.float32))) and np.all(np.isfinite(np.asarray(lse)))
  assert rel_err(out.astype(jnp.float32), want_out.astype(jnp.float32)) < 2e-2
  assert rel_err(lse, want_lse) < 1e-3
  # the same as causal attention of the sequence in true order
  dpa = jax.nn.dot_product_attention(*(_true_order(x, chunks).astype(jnp.float32) for x in (q, k, v)), is_causal=True)
  assert rel_err(_true_order(out, chunks).astype(jnp.float32), dpa) < 2e-2


def test_the_causal_reference_is_dot_product_attention():
  q, k, v = local_inputs(1, 128, 4, 2, 64, jnp.float32)
  out, lse = run(first_devices(), lambda q, k, v: reference(q, k, v, "x", causal=True), q, k, v)
  assert rel_err(out, jax.nn.dot_product_attention(q, k, v, is_causal=True)) < 1e-5
  scores = jnp.einsum("bshd,bthd->bhst", q, jnp.repeat(k, 2, axis=2)) / np.sqrt(64)
  scores = jnp.where(jnp.tril(jnp.ones((128, 128), bool)), scores, -jnp.inf)
  assert rel_err(lse, jax.nn.logsumexp(scores, axis=-1)) < 1e-5


@pytest.mark.parametrize("causal,order,chunks", [(False, "natural", None), (True, "zigzag", 4)],
                         ids=["non-causal", "causal-zigzag4"])
def test_the_gradient_is_the_references(causal, order, chunks):
  """``ring_attention``'s gradient (the unfused reference's backward from the kernel's forward)."""
  q, k, v = local_inputs(1, 256, 4, 2, 64)
  cot = jax.random.normal(fresh_key(), q.shape, jnp.float32)
  mask = dict(causal=causal, order=order, chunks=chunks)

  def loss(attention):
    def f(q, k, v):
      out, lse = jax.shard_map(attention, mesh=first_devices(), **SPECS)(q, k, v)
      return jnp.sum(out.astype(jnp.float32) * cot) + jnp.sum(jnp.sin(lse))
    return jax.jit(jax.grad(f, argnums=(0, 1, 2)))

  got = loss(lambda q, k, v: ring_attention(q, k, v, "x", block_kv=64, num_ctas=4, interpret=True, **mask))(q, k, v)
  want = loss(lambda q, k, v: reference(q, k, v, "x", **mask))(q, k, v)
  for g, w in zip(got, want):
    assert g.shape == w.shape and g.dtype == w.dtype
    assert np.all(np.isfinite(np.asarray(g, np.float32)))
    assert rel_err(g.astype(jnp.float32), w.astype(jnp.float32)) < 2e-2


@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("per_device", [2, 4])
def test_positions_are_the_stored_zigzag_order(n, per_device):
  """Device r's positions are the true positions ``Schedule.zigzag`` stores at ``[r s, (r + 1) s)``."""
  s, chunks = 8, per_device * n
  chunk = s // per_device
  local = np.arange(s)
  stored = orders.permutation(n * s, chunks)
  traced = jax.jit(lambda r, j: positions("zigzag", r, n, s, j, chunks))  # device and position traced
  for r in range(n):
    got = np.asarray(positions("zigzag", r, n, s, local, None if per_device == 2 else chunks))
    want = [orders.zigzag_chunk(r * per_device + j // chunk, chunks) * chunk + j % chunk for j in local]
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, stored[r * s:(r + 1) * s])
    np.testing.assert_array_equal(positions("natural", r, n, s, local), r * s + local)
    for j in range(0, s, chunk):  # ints in, ints out: the kernel's tile starts; traced too
      assert positions("zigzag", r, n, s, j, chunks) == got[j]
      assert int(traced(r, j)) == got[j]
  if per_device == 2:  # ring_zigzag's layout: device r holds true chunks r and 2 n - 1 - r
    starts = [[int(positions("zigzag", r, n, s, j)) // chunk for j in (0, chunk)] for r in range(n)]
    assert starts == [[r, 2 * n - 1 - r] for r in range(n)]


@pytest.mark.parametrize("kwargs,message", [
    (dict(order="diagonal"), r"order='diagonal' must be one of \('natural', 'zigzag'\)"),
    (dict(order="zigzag", chunks=3), "zigzag chunks=3 must be even"),
    (dict(order="natural", chunks=2), "chunks=2 applies to order='zigzag' only"),
    (dict(order="zigzag", chunks=4), "zigzag chunks of 32 positions are not a multiple of block_q=64"),
    (dict(order="zigzag", chunks=2, block_kv=128), "zigzag chunks of 64 positions are not a multiple of block_kv=128"),
])
def test_orders_are_checked(kwargs, message):
  q = k = v = jnp.ones((1, 128, 2, 64), jnp.bfloat16)
  with pytest.raises(PreconditionError, match=message):
    run(first_devices(), lambda q, k, v: fused_ring_attention(q, k, v, "x", causal=True, num_ctas=4, interpret=True,
                                              **{"block_kv": 64, **kwargs}), q, k, v)


@pytest.mark.parametrize("change,message", [
    (dict(dtype=jnp.float32), "bf16 or fp16"),
    (dict(k_shape=(1, 128, 2, 64, 1)), r"q \[b, s, h, d\] and k, v \[b, s, kv, d\] expected"),
    (dict(k_shape=(1, 64, 2, 64)), "must agree on b, s and d"),
    (dict(k_shape=(1, 128, 3, 64), v_shape=(1, 128, 3, 64)), "4 query heads are not a multiple of 3"),
    (dict(d=96), "head dimension d=96"),
    (dict(s=96), "sequence length 96 is not a multiple of block_q=64"),
    (dict(blocks=dict(block_q=96)), "block_q=96 must be a multiple of 64"),
    (dict(blocks=dict(max_concurrent_steps=1)), "at least 2"),
    (dict(blocks=dict(block_q=128, block_kv=256)), "exceed one warpgroup's registers"),
])
def test_inputs_are_checked_before_anything_runs(change, message):
  s, d, dtype = change.get("s", 128), change.get("d", 64), change.get("dtype", jnp.bfloat16)
  q = jnp.ones((1, s, 4, d), dtype)
  k = jnp.ones(change.get("k_shape", (1, s, 2, d)), dtype)
  v = jnp.ones(change.get("v_shape", k.shape), dtype)
  fn = lambda q, k, v: fused_ring_attention(q, k, v, "x", num_ctas=4, **change.get("blocks", {}))
  with pytest.raises(PreconditionError, match=message):
    jax.jit(jax.shard_map(fn, mesh=first_devices(), in_specs=(SEQ,) * 3, out_specs=(SEQ, P()),
                          check_vma=False))(q, k, v)


@pytest.mark.parametrize("interpret,devices,message", [(True, 2, "no peer memory"),
                                                       (False, 2, "the process has 8"),
                                                       (False, 8, r"b \* kv = 2 \* 4 = 8, but the grid has 4")])
def test_a_ring_needs_a_gpu_mesh_over_every_device(interpret, devices, message):
  q, k, v = jnp.ones((2, devices * 128, 4, 64), jnp.bfloat16), *[jnp.ones((2, devices * 128, 4, 64), jnp.bfloat16)] * 2
  with pytest.raises(PreconditionError, match=message):
    run(first_devices(devices), lambda q, k, v: fused_ring_attention(q, k, v, "x", num_ctas=4, interpret=interpret),
        q, k, v)




def _lower_ring(b, s, h, kv, d, blocks, **mask):
  mesh = h100_mesh(8)
  spec = lambda heads: jax.ShapeDtypeStruct((b, 8 * s, heads, d), jnp.bfloat16, sharding=NamedSharding(mesh, SEQ))
  kernel = lambda q, k, v: fused_ring_attention(q, k, v, "x", num_ctas=132, block_q=blocks.block_q,
                                                block_kv=blocks.block_kv,
                                                max_concurrent_steps=blocks.max_concurrent_steps, **mask)
  text = lower_for_gpus(jax.shard_map(kernel, mesh=mesh, **SPECS), spec(h), spec(kv), spec(kv), mesh=mesh)
  assert mosaic_kernels(text) == 1
  assert "all-gather" not in text and "all_gather" not in text and "collective_permute" not in text


# Every block configuration once (and the benchmark's two-per-SM blocks), every shape at least once.
@pytest.mark.parametrize("shape,blocks", [((1, 1024, 32, 32, 128), CONFIGS[0]), ((1, 1024, 32, 8, 128), CONFIGS[1]),
                                          ((2, 256, 4, 2, 64), CONFIGS[2]), ((1, 1024, 32, 8, 128), Blocks(64, 64, 2))],
                         ids=["mha", "gqa", "small", "gqa-two-per-sm"])
def test_the_ring_lowers_for_eight_h100s(shape, blocks):
  """The 8-device ring (remote TMA stores, per-step semaphores, wgmma with P from registers) lowers.

  Lowering for an abstract H100 checks layouts and shared memory; it is no
  CUDA compile (register pressure is ptxas's) and no run.
  """
  _lower_ring(*shape, blocks)


# Pairwise over the blocks, the order and the shape.
@pytest.mark.parametrize("shape,order,blocks", [((1, 1024, 32, 8, 128), "natural", CONFIGS[0]),
                                                ((2, 256, 4, 2, 64), "zigzag", CONFIGS[0]),
                                                ((2, 256, 4, 2, 64), "natural", Blocks(64, 64, 2)),
                                                ((1, 1024, 32, 8, 128), "zigzag", Blocks(64, 64, 2))],
                         ids=["gqa", "zigzag-small", "small-two-per-sm", "zigzag-gqa-two-per-sm"])
def test_the_causal_ring_lowers_for_eight_h100s(shape, order, blocks):
  """The causal ring (runs skipped by a cond, tiles classified by a switch, iota masks) lowers too."""
  _lower_ring(*shape, blocks, causal=True, order=order)


def test_one_device_lowers_without_peers():
  mesh = h100_mesh(1)
  spec = lambda heads: jax.ShapeDtypeStruct((1, 512, heads, 128), jnp.float16, sharding=NamedSharding(mesh, SEQ))
  f = jax.shard_map(lambda q, k, v: fused_ring_attention(q, k, v, "x", num_ctas=132), mesh=mesh, **SPECS)
  text = lower_for_gpus(f, spec(8), spec(8), spec(8), mesh=mesh)
  assert mosaic_kernels(text) == 1


@pytest.mark.parametrize("b,h,kv,nq", [(1, 4, 2, 3), (2, 4, 4, 1), (2, 8, 2, 2), (1, 1, 1, 1), (3, 6, 3, 4)])
def test_forwarders_come_first_and_every_item_runs_once(b, h, kv, nq):
  """Items 0 .. b * kv - 1 are the forwarders (query block 0 of each group's first head), one per (b, kv head)."""
  g = h // kv
  forwarders = b * kv
  items = [tuple(int(x) for x in round_robin_item(jnp.int32(t), forwarders, g * nq, nq, g, kv)) for t in range(b * h * nq)]
  assert sorted(i[:3] for i in items) == [(bi, hi, qi) for bi in range(b) for hi in range(h) for qi in range(nq)]
  assert [i[3] for i in items] == [1] * forwarders + [0] * (len(items) - forwarders)
  assert {(bi, hi // g) for bi, hi, qi, _ in items[:forwarders]} == {(bi, k) for bi in range(b) for k in range(kv)}
  assert all(qi == 0 and hi % g == 0 for _, hi, qi, _ in items[:forwarders])


@pytest.mark.parametrize("n,b,h,kv,causal,order,chunks,s", [
    (3, 1, 4, 2, False, "natural", None, 128),  # b * kv = 2 forwarders, 2 non-forwarders, 3 ring steps
    (3, 1, 2, 1, True, "natural", None, 256),  # steps 1, 2 hidden: only the forwarder loads (passes) them
    (2, 1, 2, 1, True, "zigzag", 8, 512),  # 4 chunks a device: hidden, partial and visible runs each step
], ids=["mha-3", "causal-3", "zigzag8-2"])
def test_the_forwarding_path_in_a_loopback_ring(n, b, h, kv, causal, order, chunks, s):
  """Forwarders store each tile from SMEM into ``received[s]`` and every item reads step ``s + 1`` from there.

  One device, one CTA, ``n`` ring steps: the forwarders (the CTA's first
  items) store into this device's own ``received``; unwritten ``received``
  rows would be NaN (the interpreter's uninitialised memory).
  """
  check_loopback(_kernel, Blocks(64, 64, 2), n, b, s, h, kv, 64, causal, order, chunks)
