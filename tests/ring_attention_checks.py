"""Inputs, runner and check shared by the CPU and GPU tests of the fused ring-attention kernels (one warpgroup,
warp-specialized), and the backward problems of the one-pass backward kernel's."""

import math

import jax
import jax.numpy as jnp
import numpy as np
from conftest import fresh_key, rel_err
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmercury.ir import orders
from jaxmercury.kernels.attention.ring import SequenceOrder, positions, reference

SEQ = P(None, "x")
SPECS = dict(in_specs=(SEQ,) * 3, out_specs=(SEQ, P(None, None, "x")), check_vma=False)
HEADS = [(8, 8), (8, 2)]  # (query heads, key/value heads): MHA and GQA
MASKS = [dict(causal=True), dict(causal=True, order="zigzag")]  # zigzag: 2 n chunks, as ring_zigzag stores them


def first_devices(n: int = 1):
  """A one-level mesh ``"x"`` over the first ``n`` devices."""
  return jax.make_mesh((n,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:n])


def inputs(mesh, s_local, h, kv, d=128, b=1):
  """Fresh sequence-sharded ``q, k, v`` (bf16), ``s_local`` positions per device."""
  n = mesh.devices.size
  sharding = NamedSharding(mesh, SEQ)
  return [jax.device_put(jax.random.normal(fresh_key(), (b, n * s_local, heads, d), jnp.float32).astype(jnp.bfloat16),
                         sharding) for heads in (h, kv, kv)]


def local_inputs(b, s, h, kv, d, dtype=jnp.bfloat16):
  """Fresh ``q [b, s, h, d]``, ``k, v [b, s, kv, d]`` on one device."""
  shapes = [(b, s, h, d), (b, s, kv, d), (b, s, kv, d)]
  return [jax.random.normal(fresh_key(), shape, jnp.float32).astype(dtype) for shape in shapes]


def assert_close(out, lse, want_out, want_lse, q):
  """``out [b, s, h, d]`` in ``q``'s dtype and ``lse [b, h, s]`` float32, finite, close to the wanted ones."""
  b, s, h, _ = q.shape
  assert out.shape == q.shape and out.dtype == q.dtype
  assert lse.shape == (b, h, s) and lse.dtype == jnp.float32
  assert np.all(np.isfinite(np.asarray(out, np.float32))) and np.all(np.isfinite(np.asarray(lse)))
  assert rel_err(out.astype(jnp.float32), np.asarray(want_out, np.float32)) < 2e-2
  assert rel_err(lse, want_lse) < 1e-3


def loopback_reference(q, k, v, n, causal, order, chunks):
  """Device 0 of a ring of ``n`` devices that all hold ``k, v``: keys at every device's global positions."""
  b, s, h, d = q.shape
  g = h // k.shape[2]
  key_pos = np.concatenate([np.asarray(positions(order, j, n, s, np.arange(s), chunks)) for j in range(n)])
  query_pos = key_pos[:s]
  keys, values = (np.repeat(np.tile(np.asarray(x, np.float32), (1, n, 1, 1)), g, axis=2) for x in (k, v))
  scores = np.einsum("bshd,bthd->bhst", np.asarray(q, np.float32), keys) / math.sqrt(d)
  if causal:
    scores = np.where(query_pos[:, None] >= key_pos[None, :], scores, -np.inf)
  lse = np.asarray(jax.nn.logsumexp(scores, axis=-1))
  out = np.einsum("bhst,bthd->bshd", np.exp(scores - lse[..., None]), values)
  return out, lse


def check_loopback(kernel, blocks, n, b, s, h, kv, d, causal=False, order="natural", chunks=None, **params):
  """``kernel`` (a fused ring attention's ``_kernel``) as a loopback ring of ``n`` steps on one device and one
  CTA (interpret mode on CPU) against ``loopback_reference``: the forwarders store each tile into the device's own
  ``received`` and every item reads the later steps from there (unwritten rows would be NaN on CPU)."""
  q, k, v = local_inputs(b, s, h, kv, d)
  seq_order = SequenceOrder.make(order, chunks, n, s, blocks)
  interpret = jax.devices()[0].platform == "cpu"
  out, lse = run(first_devices(), lambda q, k, v: kernel(q, k, v, "x", n, blocks, 1, interpret, causal, seq_order,
                                                         loopback=True, **params), q, k, v)
  assert_close(out, lse, *loopback_reference(q, k, v, n, causal, order, chunks), q)


def run(mesh, fn, *xs):
  return jax.jit(jax.shard_map(fn, mesh=mesh, **SPECS))(*xs)


def true_order(x, mesh, mask):
  """A global ``[b, S, ...]`` array stored in ``mask``'s order -> true sequence order."""
  if mask.get("order") != "zigzag":
    return x
  return x[:, np.argsort(orders.permutation(x.shape[1], 2 * mesh.devices.size))]


def check(kernel, mesh, s_local, h, kv, blocks, d=128, b=1, num_ctas=None, **mask):
  """``kernel`` (a fused ring attention) against the unfused reference and, up to 16K positions, against
  ``jax.nn.dot_product_attention`` of the true-order arrays; then once more (state fresh each launch)."""
  q, k, v = inputs(mesh, s_local, h, kv, d, b)
  params = dict(block_q=blocks.block_q, block_kv=blocks.block_kv, max_concurrent_steps=blocks.max_concurrent_steps,
                num_ctas=num_ctas, **mask)
  out, lse = run(mesh, lambda q, k, v: kernel(q, k, v, "x", **params), q, k, v)
  want_out, want_lse = run(mesh, lambda q, k, v: reference(q, k, v, "x", **mask), q, k, v)
  assert out.shape == q.shape and lse.shape == (q.shape[0], h, q.shape[1])
  assert np.all(np.isfinite(np.asarray(out, np.float32))) and np.all(np.isfinite(np.asarray(lse)))
  assert rel_err(out.astype(jnp.float32), want_out.astype(jnp.float32)) < 2e-2, blocks
  assert rel_err(lse, want_lse) < 1e-3, blocks
  if q.shape[1] <= 16384:  # the same numbers as jax.nn.dot_product_attention (XLA) of the global arrays
    true = lambda x: true_order(x, mesh, mask)
    dpa = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=mask.get("causal", False)))
    want = dpa(true(q), true(k), true(v))
    assert rel_err(true(out).astype(jnp.float32), want.astype(jnp.float32)) < 2e-2, blocks
  # A second call: the per-step semaphores start from zero each launch, the received buffers are fresh.
  again, _ = run(mesh, lambda q, k, v: kernel(q, k, v, "x", **params), q, k, v)
  assert rel_err(again.astype(jnp.float32), want_out.astype(jnp.float32)) < 2e-2, blocks


def check_matches_cudnn(kernel, mesh):
  """``kernel``'s output against all-gathered K/V + cuDNN attention (``jax.nn.dot_product_attention``)."""
  q, k, v = inputs(mesh, 1024, 8, 2)
  out, _ = run(mesh, lambda q, k, v: kernel(q, k, v, "x"), q, k, v)

  def cudnn(q, k, v):
    k, v = (jax.lax.all_gather(x, "x", axis=1, tiled=True) for x in (k, v))
    return jax.nn.dot_product_attention(q, k, v, implementation="cudnn")

  want = jax.jit(jax.shard_map(cudnn, mesh=mesh, in_specs=(SEQ,) * 3, out_specs=SEQ, check_vma=False))(q, k, v)
  assert rel_err(out.astype(jnp.float32), want.astype(jnp.float32)) < 2e-2


def grouped_reference(q, k, v, causal):
  """Float32 attention ``(o [b, s, h, d], lse [b, h, s])`` of ``q [b, s, h, d]`` over grouped kv heads ``k, v
  [b, s_kv, kv, d]`` (query head ``hq`` reads kv head ``hq // (h / kv)``), causal top-left aligned."""
  b, s, h, d = q.shape
  g = h // k.shape[2]
  kk, vv = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, kk) / np.sqrt(d)
  if causal:
    scores = jnp.where(jnp.arange(s)[:, None] >= jnp.arange(k.shape[1])[None], scores, -jnp.inf)
  lse = jax.nn.logsumexp(scores, axis=-1)
  return jnp.einsum("bhqk,bkhd->bqhd", jnp.exp(scores - lse[..., None]), vv), lse


def backward_problem(b, s, skv, h, kv, d, causal, dtype=jnp.bfloat16):
  """Fresh ``(q, k, v, o, do, lse)`` in ``dtype`` (lse float32; their float32 values exact: o from the float32
  forward, rounded) and the float32 gradients ``(dq, dk, dv)`` of the same values."""
  keys = jax.random.split(fresh_key(), 4)
  q = jax.random.normal(keys[0], (b, s, h, d)).astype(dtype)
  k, v = (jax.random.normal(key, (b, skv, kv, d)).astype(dtype) for key in keys[1:3])
  do = jax.random.normal(keys[3], (b, s, h, d)).astype(dtype)
  f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
  (o, lse), vjp = jax.vjp(lambda q, k, v: grouped_reference(q, k, v, causal), *f32[:3])
  return (q, k, v, o.astype(dtype), do, lse), vjp((f32[3], jnp.zeros_like(lse)))
