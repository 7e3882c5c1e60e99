"""The Mosaic GPU kernels on a Hopper GPU (skipped elsewhere).

Each kernel on fresh random blocks against the float32 reference (the
program's body in float32), bf16 and fp16, MHA / GQA / MQA, causal and not,
at ring offsets (visible, diagonal, hidden), every tunable variant, shapes on
and off the kernels' tiles; then patched into library schedules on all local
GPUs, values and gradients.

Run: ``JAX_PLATFORMS=cuda python3 -m pytest tests/gpu/test_mosaic_kernels.py -x -q``
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import fresh_key
from conftest import rel_err as _rel

import jaxmercury as jm
from gpu.checks import TOL, check_gradients, check_schedule, library_with
from gpu.checks import gpu_mesh as _mesh
from jaxmercury.kernels import mosaic_gpu, registry
from jaxmercury.kernels.attention import mosaic as ma
from jaxmercury.kernels.gemm import mosaic as mm
from jaxmercury.programs import attention_backward as ab


def _hopper() -> bool:
  device = jax.devices()[0]
  return device.platform == "gpu" and mosaic_gpu.hopper_only(device) is None


pytestmark = pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU (compute capability 9.x)")

HEADS = {"mha": (8, 8), "gqa": (8, 2), "mqa": (8, 1)}


def _normal(shape, dtype=jnp.float32, scale=1.0):
  return (scale * jax.random.normal(fresh_key(), shape, jnp.float32)).astype(dtype)


def _f32(*xs):
  return [x.astype(jnp.float32) for x in xs]


def _count_kernels(fn, *args):
  """Mosaic GPU kernel calls in the lowered program (branches not taken included)."""
  return jax.jit(fn).lower(*args).as_text().count("custom_call @mosaic_gpu")


# ------------------------------------------------------------------ attention blocks


def _attention(heads, n, d, causal, dtype=jnp.bfloat16):
  h, hk = HEADS[heads]
  return jm.programs.attention(1, h, hk, n, n, d, causal=causal, dtype=dtype)


def _qkv(prog, tq, tk):
  p = prog.params
  hk, g, d, dtype = p["kv_heads"], p["heads"] // p["kv_heads"], p["head_dim"], prog.reads[0].dtype
  q = _normal((2, tq, hk, g, d), dtype)
  k, v = _normal((2, tk, hk, d), dtype), _normal((2, tk, hk, d), dtype)
  return q, k, v


def _ctx(starts, sizes, extents):
  return jm.BlockContext(starts=starts, sizes=sizes, extents=extents)


def _backward_block(part: str, program):
  """The ``part`` (``dq`` or ``dkv``) backward kernel's block for ``program``, default configuration."""
  config = {"dq": ma.DqConfig, "dkv": ma.DkvConfig}[part]()
  return ma._make_backward(part)(program, config, False)


def _assert_state(got, want):
  (out, lse), (ref_out, ref_lse) = got, want
  assert out.dtype == lse.dtype == jnp.float32 and out.shape == ref_out.shape and lse.shape == ref_lse.shape
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
  if np.any(ref_out):
    assert _rel(out, ref_out) < TOL
  else:
    assert not np.any(out)
  finite = np.isfinite(ref_lse)
  np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(ref_lse)[finite], atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", sorted(HEADS))
def test_forward_whole_block(heads, causal, d, dtype):
  prog = _attention(heads, 512, d, causal, dtype)
  q, k, v = _qkv(prog, 512, 512)
  sizes = {"i": 512, "j": 512}
  ctx = _ctx({}, sizes, sizes)
  block = ma._make(prog, ma.ForwardConfig(), False)
  assert _count_kernels(lambda *x: block(ctx, *x), q, k, v) >= 1
  _assert_state(jax.jit(lambda *x: block(ctx, *x))(q, k, v), prog.body(ctx, *_f32(q, k, v)))


@pytest.mark.parametrize("heads", ["gqa", "mqa"])
def test_forward_ring_offsets(heads):
  """Traced starts: keys before (visible), at (diagonal) and after (hidden) the queries; uneven blocks."""
  prog = _attention(heads, 1024, 128, True)
  block = ma._make(prog, ma.ForwardConfig(), False)
  for tq, tk, cases in [(256, 256, [(512, 0), (512, 512), (256, 768)]),
                        (256, 128, [(512, 128), (512, 512), (256, 896), (512, 640)])]:
    q, k, v = _qkv(prog, tq, tk)
    sizes, whole = {"i": tq, "j": tk}, {"i": 1024, "j": 1024}
    run = jax.jit(lambda s, *x: block(_ctx({"i": s[0], "j": s[1]}, sizes, whole), *x))
    for qs, ks in cases:
      starts = jnp.array([qs, ks], jnp.int32)
      want = prog.body(_ctx({"i": starts[0], "j": starts[1]}, sizes, whole), *_f32(q, k, v))
      _assert_state(run(starts, q, k, v), want)


def test_forward_every_variant():
  prog = _attention("gqa", 512, 128, True)
  q, k, v = _qkv(prog, 512, 512)
  sizes = {"i": 512, "j": 512}
  ctx = _ctx({}, sizes, sizes)
  want = prog.body(ctx, *_f32(q, k, v))
  for choice in registry.kernel("mosaic_attention").variants():
    if ma._forward_config(512, 512, 128, dataclasses.asdict(choice.config)) is None:
      continue
    block = ma._make(prog, choice.config, False)
    _assert_state(jax.jit(lambda *x: block(ctx, *x))(q, k, v), want)


@pytest.mark.parametrize("shape", [(200, 200, 128), (512, 512, 80), (192, 256, 64)])
def test_forward_off_the_tiles_falls_back(shape):
  """Lengths not multiples of 2 * block_q or block_kv, a head dim not a multiple of 64: the XLA body."""
  tq, tk, d = shape
  prog = jm.programs.attention(1, 8, 2, tq, tk, d, causal=False, dtype=jnp.bfloat16)
  q, k, v = _qkv(prog, tq, tk)
  sizes = {"i": tq, "j": tk}
  ctx = _ctx({}, sizes, sizes)
  block = ma._make(prog, ma.ForwardConfig(), False)
  assert _count_kernels(lambda *x: block(ctx, *x), q, k, v) == 0
  _assert_state(jax.jit(lambda *x: block(ctx, *x))(q, k, v), prog.body(ctx, *_f32(q, k, v)))


def _backward_inputs(prog, tq, tk):
  """q, k, v, an incoming gradient, and the consistent float32 output and lse of a whole-sequence forward."""
  q, k, v = _qkv(prog, tq, tk)
  dtype = q.dtype
  sizes = {"i": tq, "j": tk}
  out, lse = prog.body(_ctx({}, sizes, sizes), *_f32(q, k, v))
  do = _normal(q.shape, dtype)
  return q, k, v, out.astype(dtype), do, lse


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("heads", sorted(HEADS))
@pytest.mark.parametrize("part", ["dq", "dkv"])
def test_backward_whole_block(part, heads, dtype):
  prog = _attention(heads, 512, 128, False, dtype)
  program = getattr(ab, f"attention_{part}")(prog)
  xs = _backward_inputs(prog, 512, 512)
  sizes = {"i": 512, "j": 512}
  ctx = _ctx({}, sizes, sizes)
  block = _backward_block(part, program)
  assert _count_kernels(lambda *x: block(ctx, *x), *xs) == 1
  got = jax.jit(lambda *x: block(ctx, *x))(*xs)
  want = program.body(ctx, *_f32(*xs))
  assert got.dtype == jnp.float32 and _rel(got, want) < TOL


def test_backward_tiny_incoming_gradient():
  """A gradient far below float16's range (rescaled around the kernel) still comes out right."""
  prog = _attention("gqa", 512, 128, False)
  q, k, v, o, do, lse = _backward_inputs(prog, 512, 512)
  do = (do.astype(jnp.float32) * 1e-9).astype(do.dtype)
  sizes = {"i": 512, "j": 512}
  ctx = _ctx({}, sizes, sizes)
  for part in ("dq", "dkv"):
    program = getattr(ab, f"attention_{part}")(prog)
    got = jax.jit(lambda *x: _backward_block(part, program)(ctx, *x))(q, k, v, o, do, lse)
    assert _rel(got, program.body(ctx, *_f32(q, k, v, o, do, lse))) < TOL


@pytest.mark.parametrize("part", ["dq", "dkv"])
def test_backward_ring_offsets_and_variants(part):
  """Causal pairs at traced starts (visible: kernel, diagonal: body, hidden: zeros), every variant."""
  prog = _attention("gqa", 1024, 128, True)
  program = getattr(ab, f"attention_{part}")(prog)
  q, k, v, o, do, _ = _backward_inputs(prog, 256, 256)
  lse = _normal((2, 256, 2, 4), jnp.float32) + 6.0  # a plausible merged lse for these rows
  sizes, whole = {"i": 256, "j": 256}, {"i": 1024, "j": 1024}
  for choice in registry.kernel(f"mosaic_attention_{part}").variants():
    block = ma._make_backward(part)(program, choice.config, False)
    run = jax.jit(lambda s, *x: block(_ctx({"i": s[0], "j": s[1]}, sizes, whole), *x))
    for qs, ks in [(512, 0), (512, 512), (256, 768)]:
      starts = jnp.array([qs, ks], jnp.int32)
      want = program.body(_ctx({"i": starts[0], "j": starts[1]}, sizes, whole), *_f32(q, k, v, o, do, lse))
      got = run(starts, q, k, v, o, do, lse)
      assert (_rel(got, want) < TOL) if np.any(want) else not np.any(got), (choice, qs, ks)


# ------------------------------------------------------------------ attention schedules


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("strategy", ["ring", "context_parallel", "tree", "ulysses"])
def test_library_with_mosaic(strategy, causal):
  prog = jm.programs.attention(2, 8, 2, 2048, 2048, 128, causal=causal, dtype=jnp.bfloat16)
  check_schedule(library_with(prog, strategy, "mosaic_attention"))


@pytest.mark.parametrize("heads", sorted(HEADS))
def test_ring_heads_and_variant(heads):
  prog = _attention(heads, 2048, 64, True)
  check_schedule(jm.library(prog, _mesh())["ring"].patch("mosaic_attention", block_kv=64))


@pytest.mark.parametrize("causal", [False, True])
def test_ring_with_uneven_blocks_uses_all_paths(causal):
  """Keys tiled finer than queries: visible, hidden and fallback branches."""
  prog = jm.programs.attention(1, 8, 8, 2048, 2048, 64, causal=causal, dtype=jnp.bfloat16)
  n = len(jax.devices())
  s = jm.Schedule(prog, _mesh()).tile("i", n).parallelize("i0", "x").tile("j", n).shift("j0", "i0")
  s.tile("j1", 2).patch("mosaic_attention", block_kv=64)
  check_schedule(s)


@pytest.mark.parametrize("strategy", ["ring", "ring_zigzag", "context_parallel"])
@pytest.mark.parametrize("causal", [False, True])
def test_gradients_of_mosaic_schedules_run_cudnns_backward(strategy, causal):
  """The Mosaic forward's output and log-sum-exp feed cuDNN's backward blocks (``dual.backward_schedule``):
  gradients match the float32 reference, and the gradient program launches no Mosaic kernel beyond the
  forward's (JAX's Mosaic dq and dk-dv kernels do not run)."""
  prog = jm.programs.attention(1, 8, 2, 4096, 4096, 128, causal=causal, dtype=jnp.bfloat16)
  s = library_with(prog, strategy, "mosaic_attention")
  check_gradients(s)
  f = s.compile()
  xs = prog.random_inputs(fresh_key())
  grad = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=(0, 1, 2))).lower(*xs).as_text()
  assert "__cudnn$fmha" in grad and "Backward" in grad
  assert 0 < grad.count("custom_call @mosaic_gpu") <= _count_kernels(f, *xs)


# ------------------------------------------------------------------ matmul


def _block(kernel: str, prog):
  """``kernel``'s block function for ``prog`` in its default configuration."""
  k = registry.kernel(kernel)
  return k.make(prog, k.variants()[0].config, False)


def _feasible_tiles():
  out = []
  for choice in registry.kernel("mosaic_matmul").variants():
    tiles = choice.config.tiles()
    if tiles.problem() is None:
      out.append(tiles)
  return out


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_mosaic_gemm_every_variant(dtype):
  a, b = _normal((1024, 2048), dtype), _normal((2048, 1536), dtype)
  want = jnp.dot(*_f32(a, b), precision="highest")
  for tiles in _feasible_tiles():
    got = jax.jit(functools.partial(mm.mosaic_gemm, tiles=tiles))(a, b)
    assert got.dtype == jnp.float32 and _rel(got, want) < 1e-4, tiles


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_jax_gemm_every_variant(dtype):
  a, b = _normal((1024, 2048), dtype), _normal((2048, 1536), dtype)
  want = jnp.dot(*_f32(a, b), precision="highest")
  for choice in registry.kernel("jax_mosaic_matmul").variants():
    got = jax.jit(functools.partial(mm.jax_gemm, **dataclasses.asdict(choice.config)))(a, b)
    assert got.dtype == jnp.float32 and _rel(got, want) < 1e-2, choice  # rounded to the input dtype


@pytest.mark.parametrize("kernel", ["mosaic_matmul", "jax_mosaic_matmul"])
def test_matmul_kernels_differentiate(kernel):
  """Both GEMM kernels' gradients (their backward GEMMs through the kernel) against XLA's, with the backward's
  GEMMs reaching the kernel."""
  prog = jm.programs.matmul(1024, 1536, 2048, jnp.bfloat16)
  sizes = {"m": 1024, "n": 1536, "k": 2048}
  block = _block(kernel, prog)
  ctx = _ctx({}, sizes, sizes)
  a, b, d = _normal((1024, 2048), jnp.bfloat16), _normal((2048, 1536), jnp.bfloat16), _normal((1024, 1536),
                                                                                                jnp.float32)
  step = lambda f: jax.value_and_grad(lambda a, b: jnp.vdot(f(a, b), d), (0, 1))
  want = step(lambda a, b: jnp.dot(*_f32(a, b), precision="highest"))(a, b)[1]
  assert _count_kernels(step(lambda *x: block(ctx, *x)), a, b) == 3  # the forward and both backward GEMMs
  got = jax.jit(step(lambda *x: block(ctx, *x)))(a, b)[1]
  for g, w in zip(got, want):
    assert g.dtype == jnp.bfloat16 and _rel(g, w) < 2e-2


@pytest.mark.parametrize("kernel", ["mosaic_matmul", "jax_mosaic_matmul"])
@pytest.mark.parametrize("shape", [(1024, 1024, 1024), (1000, 1024, 1024), (1024, 1000, 1024), (1024, 1024, 1000)])
def test_matmul_blocks_on_and_off_the_tiles(kernel, shape):
  m, n, k = shape
  prog = jm.programs.matmul(m, n, k, jnp.bfloat16)
  sizes = {"m": m, "n": n, "k": k}
  ctx = _ctx({}, sizes, sizes)
  block = _block(kernel, prog)
  a, b = _normal((m, k), jnp.bfloat16), _normal((k, n), jnp.bfloat16)
  on_tiles = shape == (1024, 1024, 1024)
  assert (_count_kernels(lambda *x: block(ctx, *x), a, b) > 0) == on_tiles
  got = jax.jit(lambda *x: block(ctx, *x))(a, b)
  assert got.dtype == jnp.float32 and _rel(got, jnp.dot(*_f32(a, b), precision="highest")) < 1e-2


@pytest.mark.parametrize("kernel", ["mosaic_matmul", "jax_mosaic_matmul"])
@pytest.mark.parametrize("strategy", ["allgather_matmul", "matmul_reducescatter", "async_tp", "async_tp_reducescatter"])
def test_matmul_library_with_mosaic(strategy, kernel):
  prog = jm.programs.matmul(4096, 4096, 4096, jnp.bfloat16)
  s = library_with(prog, strategy, kernel)
  xs = prog.random_inputs(fresh_key())
  want = jnp.dot(*_f32(*xs), precision="highest")
  f = s.compile()
  assert _count_kernels(f, *xs) > 0, f"no block reached the kernel\n{s}"
  assert _rel(f(*xs).astype(jnp.float32), want) < TOL
