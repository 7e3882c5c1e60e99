"""cuDNN attention patched into distributed schedules, on real GPUs (skipped on CPU)."""

import jax
import jax.numpy as jnp
import pytest
from conftest import fresh_key, rel_err

import jaxmercury as jm
from gpu.checks import GRAD_TOL, TOL, check_gradients, check_schedule, gpu_mesh, library_with
from jaxmercury.programs.masks import mask_of

pytestmark = pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs GPUs")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("strategy", ["ring", "context_parallel", "tree", "ulysses"])
def test_library_with_cudnn(strategy, causal):
  prog = jm.programs.attention(2, 8, 2, 1024, 1024, 128, causal=causal, dtype=jnp.bfloat16)
  check_schedule(library_with(prog, strategy, "cudnn_attention"))


@pytest.mark.parametrize("causal", [False, True])
def test_ring_with_uneven_blocks_uses_all_paths(causal):
  """Tiling keys finer than queries exercises the visible, hidden and bias branches."""
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
  n = len(jax.devices())
  prog = jm.programs.attention(1, 8 * n, 2 * n, 2048, 2048, 128, causal=causal, dtype=jnp.bfloat16)
  heads = P(None, None, "x", None)
  schedule = jm.library(prog, gpu_mesh())["ulysses"].with_layouts([heads] * 3, heads).patch("cudnn_attention")
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


# ------------------------------------------------------------------ masks on cuDNN (windows, segment ids, arrays)
def _dense_check(schedule, xs, tol=TOL, grad_tol=GRAD_TOL):
  """``schedule`` on ``xs`` (q, k, v and the mask's inputs), output and dq, dk, dv, against float32 attention
  with the program's kept pairs (``test_masks.dense``: rows keeping no key give zeros)."""
  from test_masks import dense
  prog = schedule.program
  q, k, v, *extras = xs
  keep = mask_of(prog.params).dense_keep(q.shape[1], k.shape[1], extras)
  f32 = lambda x: x.astype(jnp.float32)
  cot = jax.random.normal(fresh_key(), q.shape, jnp.float32)
  ref_out, ref_vjp = jax.vjp(lambda q, k, v: dense(q, k, v, keep), f32(q), f32(k), f32(v))
  f = schedule.compile()
  out, vjp = jax.vjp(lambda q, k, v: f32(f(q, k, v, *extras)), q, k, v)
  assert rel_err(out, ref_out) < tol, f"output\n{schedule}"
  for name, g, w in zip("qkv", vjp(cot), ref_vjp(cot)):
    err = rel_err(f32(g), w)
    assert err < grad_tol, f"d{name}: rel err {err}\n{schedule}"


def _emulated_ring(prog, blocks=4):
  """The library's ring on every GPU, each device's queries and keys tiled in ``blocks``: block pairs at every
  offset (hidden, visible, diagonal, the band's edge) on one GPU too; patched with cuDNN."""
  ring = jm.library(prog, gpu_mesh())["ring"]
  return ring.tile("i_in", blocks).tile("j_in", blocks).patch("cudnn_attention")


@pytest.mark.parametrize(("causal", "window"), [
    (True, (40, 0)),  # narrower than a block: cuDNN's sliding window on the diagonal, a bias at its edge
    (True, (700, 0)),  # wider than a block: cuDNN's causal mask on the diagonal, visible blocks unmasked
    (False, (100, 60)),  # two-sided: biases
], ids=["narrow", "wide", "two-sided"])
def test_windows_on_cudnn(causal, window):
  n = len(jax.devices())
  prog = jm.programs.attention(2, 8, 2, 1024 * n, 1024 * n, 64, causal=causal, window=window, dtype=jnp.bfloat16)
  s = _emulated_ring(prog)
  assert s.kernel == "cudnn_attention"
  _dense_check(s, prog.random_inputs(fresh_key()))


def test_segment_ids_on_cudnn():
  """Packed sequences (boundaries inside blocks, blocks sharing no segment skipped) with the causal mask."""
  from test_masks import packed_segments
  n = len(jax.devices())
  t = 1024 * n
  prog = jm.programs.attention(2, 8, 2, t, t, 64, causal=True, segment_ids=True, dtype=jnp.bfloat16)
  q, k, v = prog.random_inputs(fresh_key())[:3]
  seg = packed_segments(fresh_key(), 2, t, pieces=5)
  _dense_check(_emulated_ring(prog), (q, k, v, seg, seg))


@pytest.mark.parametrize("axes", [("b", "i", "j"), ("b", "h", "i", "j"), ("b", "j")],
                         ids=["batch-queries-keys", "per-head", "keys"])
def test_mask_arrays_on_cudnn(axes):
  """A boolean mask as cuDNN's bias (broadcast over heads, or per head), rows keeping no key, a block hidden."""
  n = len(jax.devices())
  t = 1024 * n
  prog = jm.programs.attention(2, 8, 2, t, t, 64, mask_axes=axes, dtype=jnp.bfloat16)
  q, k, v, m = prog.random_inputs(fresh_key())
  if "i" in axes:
    m = m.at[:, ..., 100:110, :].set(False).at[:, ..., 512:768, 0:256].set(False)
  _dense_check(_emulated_ring(prog), (q, k, v, m))


def test_odd_blocks_on_cudnn():
  """Blocks of an odd size: the diagonal by cuDNN's sliding window, the window's edge by the XLA body."""
  n = len(jax.devices())
  prog = jm.programs.attention(1, 4, 2, 4 * 127 * n, 4 * 127 * n, 64, causal=True, window=(50, 0),
                               dtype=jnp.bfloat16)
  _dense_check(_emulated_ring(prog), prog.random_inputs(fresh_key()))


@pytest.mark.parametrize("kwargs", [dict(is_causal=True), dict(is_causal=True, local_window_size=(100, 0)),
                                    dict(mask=True)], ids=["causal", "window", "mask"])
def test_jax_cudnn_attention_calls_are_routed(kwargs):
  """``jax.nn.dot_product_attention(implementation="cudnn")`` (grouped heads) is found in the traced program,
  routed, and gives JAX's cuDNN result and gradients."""
  import functools

  from jaxmercury.flax.patterns import CUDNN_ATTENTION
  keys = iter(jax.random.split(fresh_key(), 5))
  q = jax.random.normal(next(keys), (2, 512, 8, 64), jnp.bfloat16)
  k, v = (jax.random.normal(next(keys), (2, 512, 2, 64), jnp.bfloat16) for _ in range(2))
  if kwargs.get("mask"):  # [b, 1, q, k], every row keeping a key
    kwargs = dict(mask=jax.random.bernoulli(next(keys), 0.7, (2, 1, 512, 512)) | jnp.eye(512, dtype=bool))
  f = functools.partial(jax.nn.dot_product_attention, implementation="cudnn", **kwargs)
  assert CUDNN_ATTENTION in str(jax.make_jaxpr(f)(q, k, v))
  mesh = gpu_mesh()
  [entry] = jm.explain(f, q, k, v, mesh=mesh)
  assert entry.kind == "attention" and entry.routed, entry
  routed = jax.jit(jm.distribute(f, mesh=mesh))
  f32 = lambda x: x.astype(jnp.float32)
  assert rel_err(f32(routed(q, k, v)), f32(jax.jit(f)(q, k, v))) < TOL
  cot = jax.random.normal(next(keys), q.shape, jnp.float32)
  loss = lambda fn: (lambda *a: jnp.sum(f32(fn(*a)) * cot))
  got = jax.jit(jax.grad(loss(routed), argnums=(0, 1, 2)))(q, k, v)
  want = jax.jit(jax.grad(loss(f), argnums=(0, 1, 2)))(q, k, v)
  for name, g, w in zip("qkv", got, want):
    assert rel_err(f32(g), f32(w)) < GRAD_TOL, name


@pytest.mark.parametrize("training", [False, True], ids=["forward", "training"])
@pytest.mark.parametrize("axis_type", [jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit])
def test_the_plain_cudnn_program_runs_in_any_caller_layout(axis_type, training):
  """The plain cuDNN attention a tune measures (``tuner.plain``): cuDNN's partitioner takes batch and head splits
  only, so inputs split along the sequence are moved to the heads for the call (on two H200s the sequence split
  did not compile, 2026-11-28); without layouts given it is laid out by heads. Checked and timed as a tune does,
  outputs (and gradients) against the float32 reference."""
  from jax.sharding import PartitionSpec as P

  from jaxmercury.tuner import measure
  from jaxmercury.tuner.plain import plain_programs
  from jaxmercury.tuner.reference import trial
  mesh = jax.make_mesh((len(jax.devices()),), ("x",), axis_types=(axis_type,))
  n = len(jax.devices())
  prog = jm.programs.attention(1, 4 * n, n, 1024 * n, 1024 * n, 128, causal=True, dtype=jnp.bfloat16)
  seq, heads = P(None, "x", None, None), P(None, None, "x", None)
  (free,) = [p for p in plain_programs(prog, mesh) if p.plain.implementation == "cudnn"]
  (given,) = [p for p in plain_programs(prog, mesh, (seq,) * 3, seq) if p.plain.implementation == "cudnn"]
  assert free.in_shardings == ((heads,) * 3 if n > 1 else (P(None, None, None, None),) * 3)  # one GPU: nothing split
  assert given.in_shardings == (seq,) * 3 and given.inner_shardings() == (heads,) * 3
  inputs, cot, reference = trial(prog, int(jax.random.randint(fresh_key(), (), 0, 2 ** 30)), jax.devices()[0],
                                 training=training)
  for plain in (free, given):
    result = measure.measure(plain, inputs, reference, iters=2, cotangent=cot)
    assert result.status == measure.OK, (plain.in_shardings, result.reason)
