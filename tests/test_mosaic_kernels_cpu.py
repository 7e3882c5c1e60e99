"""The Mosaic GPU kernels, as far as a CPU can check them.

- ``mosaic_matmul`` runs in Mosaic GPU interpret mode: directly, in every
  variant, and patched into schedules on a one-device mesh (JAX's GPU
  interpreter races when several simulated devices run kernels at once).
- Every kernel lowers to Mosaic GPU for an abstract H100 (no GPU needed): the
  lowering allocates shared memory and checks wgmma shapes, so the shared
  memory estimates that decide between kernel and fallback are checked
  against it. attention_mgpu checks the CUDA runtime version while tracing,
  which a CPU jaxlib does not have: the tests give it one.
- The attention kernels' dispatch (visible, hidden, diagonal, fallback) and
  their conversions (scaled queries, base-2 lse, layouts, float16) run with
  the kernels stood in by XLA models of their conventions: JAX's own
  ``attention_mgpu.attention_reference`` forward and a model of its backward.
- The kernels are refused on CPU meshes, naming the device, and are not
  offered there.
"""

import contextlib
import dataclasses
import functools
import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import fresh_key, h100_mesh, lower_for_gpus, make_mesh, mosaic_kernels, pairwise, rel_err

import jaxmercury as jm
from jaxmercury.errors import PreconditionError
from jaxmercury.kernels import mosaic_gpu, registry
from jaxmercury.kernels.attention import causal_blocks
from jaxmercury.kernels.attention import mosaic as ma
from jaxmercury.kernels.gemm import mosaic as mm
from jaxmercury.kernels.gemm.tiles import Tiles
from jaxmercury.programs import attention_backward as ab

MOSAIC = ("mosaic_attention", "mosaic_attention_dq", "mosaic_attention_dkv", "mosaic_matmul", "jax_mosaic_matmul")
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}


def _normal(shape, dtype):
  return jax.random.normal(fresh_key(), shape, jnp.float32).astype(dtype)


class _FakeDevice:
  """What ``hopper_only`` reads of a device."""

  def __init__(self, capability, kind="NVIDIA GPU", platform="gpu"):
    self.platform, self.compute_capability, self.device_kind = platform, capability, kind

  def __str__(self):
    return self.device_kind


# ------------------------------------------------------------------ devices


def test_hopper_only():
  cpu = jax.devices("cpu")[0]
  assert str(cpu) in mosaic_gpu.hopper_only(cpu) and "cpu" in mosaic_gpu.hopper_only(cpu)
  reason = mosaic_gpu.hopper_only(_FakeDevice("8.0", "NVIDIA A100-SXM4-80GB"))
  assert "9.0" in reason and "8.0" in reason and "A100" in reason
  assert mosaic_gpu.hopper_only(_FakeDevice("9.0")) is None
  assert "wgmma" in mosaic_gpu.hopper_only(_FakeDevice("10.0"))


@pytest.mark.parametrize("name", MOSAIC)
def test_refused_on_cpu_and_not_offered(name):
  attn = jm.programs.attention(1, 4, 2, 256, 256, 64, causal=True, dtype=jnp.bfloat16)
  programs = {"mosaic_attention": attn, "mosaic_attention_dq": ab.attention_dq(attn),
              "mosaic_attention_dkv": ab.attention_dkv(attn)}
  prog = programs.get(name, jm.programs.matmul(256, 256, 256, jnp.bfloat16))
  mesh = make_mesh("8")
  for mode in (contextlib.nullcontext(), registry.interpret_mode()):
    with mode:
      with pytest.raises(PreconditionError, match=rf"{name}.*gpu.*'cpu'"):
        jm.Schedule(prog, mesh).patch(name)
      assert name not in {v.name for v in registry.variants(prog, mesh)}


# ------------------------------------------------------------------ mosaic_matmul in interpret mode


def _feasible_variants():
  k = registry.kernel("mosaic_matmul")
  out = []
  for choice in k.variants():
    tiles = choice.config.tiles()
    if tiles.problem() is None:
      out.append(tiles)
  return out


def test_infeasible_matmul_variants_are_refused(interpreted_gemm):
  prog = jm.programs.matmul(256, 256, 256, jnp.bfloat16)
  with pytest.raises(PreconditionError, match="registers"):
    jm.Schedule(prog, _one_device()).patch("mosaic_matmul", tile_n=256)
  with pytest.raises(PreconditionError, match="shared memory"):
    jm.Schedule(prog, _one_device()).patch("mosaic_matmul", tile_k=128)
  assert len(_feasible_variants()) >= 6


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_matmul_interpret_pairwise_variants(dtype):
  """Feasible variants covering every pair of tile choices (bf16; the default in fp16) on a shape with several
  tiles along each axis."""
  a, b = _normal((256, 256), dtype), _normal((256, 512), dtype)
  want = jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32))
  for tiles in pairwise(_feasible_variants()) if dtype == jnp.bfloat16 else [Tiles()]:
    got = jax.jit(functools.partial(mm.mosaic_gemm, tiles=tiles, interpret=True))(a, b)
    assert got.dtype == jnp.float32 and got.shape == want.shape
    assert rel_err(got, want) < 1e-5, tiles


@pytest.mark.parametrize("k", [256, 192])
def test_matmul_gradients_interpret(k):
  """The kernel's backward, dA = dC B^T and dB = A^T dC, against XLA's on the same inputs: through the kernel
  (k=256), through XLA where k is no multiple of the 128-wide output tiles of those two GEMMs (k=192)."""
  a, b = _normal((256, k), jnp.bfloat16), _normal((k, 256), jnp.bfloat16)
  d_out = _normal((256, 256), jnp.float32)
  tiles = Tiles(128, 128, 64, 2)
  loss = lambda f: lambda a, b: jnp.vdot(f(a, b), d_out)
  want = jax.grad(loss(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32)), (0, 1))(a, b)
  got = jax.jit(jax.grad(loss(functools.partial(mm.mosaic_gemm, tiles=tiles, interpret=True)), (0, 1)))(a, b)
  for g, w in zip(got, want):
    assert g.dtype == jnp.bfloat16 and rel_err(g, w) < 2e-2


def test_matmul_block_falls_back_off_the_tiles():
  prog = jm.programs.matmul(200, 128, 128, jnp.bfloat16)
  block = mm._make(prog, mm.MosaicMatmulConfig(), True)
  a, b = _normal((200, 128), jnp.bfloat16), _normal((128, 128), jnp.bfloat16)
  ctx = jm.BlockContext(starts={}, sizes={"m": 200, "n": 128, "k": 128}, extents={"m": 200, "n": 128, "k": 128})
  np.testing.assert_array_equal(block(ctx, a, b), prog.body(ctx, a, b))


def _one_device():
  """Mosaic GPU interpret mode runs one simulated device at a time (see ``mosaic_matmul``)."""
  return jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])


@pytest.fixture
def interpreted_gemm(monkeypatch):
  """``mosaic_matmul`` offered on CPU in interpret mode; counts the calls that reach the kernel."""
  calls = []
  original = mm.mosaic_gemm

  def counted(a, b, tiles, **kw):
    calls.append((a.shape, b.shape))
    return original(a, b, tiles, **kw)
  monkeypatch.setattr(mm, "mosaic_gemm", counted)
  kernel = registry._KERNELS["mosaic_matmul"]
  monkeypatch.setitem(registry._KERNELS, "mosaic_matmul", dataclasses.replace(
      kernel, platforms=frozenset({"cpu"}), supports=None,
      make=lambda program, config, interpret: mm._make(program, config, True)))
  return calls


@pytest.mark.parametrize("strategy", ["allgather_matmul", "matmul_reducescatter", "async_tp", "tiled"])
def test_matmul_schedules_interpret(interpreted_gemm, strategy):
  """Library schedules (on one device) and a reduction tiled into serial blocks, through the kernel."""
  prog = jm.programs.matmul(256, 512, 512, jnp.bfloat16)
  if strategy == "tiled":
    s = jm.Schedule(prog, _one_device()).tile("k", 4)
  else:
    s = jm.library(prog, _one_device())[strategy]
  s = s.patch("mosaic_matmul", tile_m=64)
  xs = [_normal(b.shape, b.dtype) for b in prog.reads]
  want = jnp.dot(xs[0].astype(jnp.float32), xs[1].astype(jnp.float32))
  got = s.compile()(*xs)
  assert interpreted_gemm, f"no block reached the kernel\n{s}"
  assert got.dtype == jnp.bfloat16 and rel_err(got.astype(jnp.float32), want) < 1e-2


# ------------------------------------------------------------------ lowering for an abstract H100


def _lower(fn, *args):
  return lower_for_gpus(fn, *args, mesh=h100_mesh(1))


@pytest.fixture
def cuda_runtime(monkeypatch):
  """attention_mgpu asserts a CUDA runtime version while tracing; give it one (CUDA 13)."""
  from jax.experimental.pallas.ops.gpu import attention_mgpu
  monkeypatch.setattr(attention_mgpu, "cuda_versions",
                      types.SimpleNamespace(cuda_runtime_get_version=lambda: 13000))


def test_matmul_variants_lower():
  """Both GEMM kernels' variants, every pair of tile choices (feasible ones), lower for an H100."""
  s = jax.ShapeDtypeStruct
  a, b = s((512, 1024), jnp.bfloat16), s((1024, 512), jnp.bfloat16)
  for tiles in pairwise(_feasible_variants()):
    assert mosaic_kernels(_lower(functools.partial(mm.mosaic_gemm, tiles=tiles), a, b)) == 1, tiles
  for config in pairwise([choice.config for choice in registry.kernel("jax_mosaic_matmul").variants()]):
    params = dataclasses.asdict(config)
    assert mosaic_kernels(_lower(functools.partial(mm.jax_gemm, **params), a, b)) == 1, config


def test_matmul_gradients_lower_to_three_kernels():
  """Both GEMM kernels differentiate, the backward's two GEMMs through the kernel (lowered for an H100)."""
  s = jax.ShapeDtypeStruct
  a, b, d = s((512, 1024), jnp.bfloat16), s((1024, 512), jnp.bfloat16), s((512, 512), jnp.float32)
  (choice, *_) = registry.kernel("jax_mosaic_matmul").variants()
  gemms = [functools.partial(mm.mosaic_gemm, tiles=Tiles()),
           functools.partial(mm.jax_gemm, **dataclasses.asdict(choice.config))]
  for gemm in gemms:
    step = jax.value_and_grad(lambda a, b, d: jnp.vdot(gemm(a, b), d), (0, 1))
    assert mosaic_kernels(_lower(step, a, b, d)) == 3


def _spec(*shape, dtype=jnp.bfloat16):
  return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("d", [128, 256])
def test_attention_shared_memory_estimates(cuda_runtime, d):
  """Where the estimate admits a configuration it lowers; where it refuses, lowering runs out of SMEM (every pair
  of each kernel's choices)."""
  am = ma.attention_mgpu
  q, k, lse = _spec(1, 512, 2, 2, d), _spec(1, 512, 2, d), _spec(1, 512, 2, 2, dtype=jnp.float32)
  for config in pairwise([choice.config for choice in registry.kernel("mosaic_attention").variants()]):
    p = dataclasses.asdict(config)
    config = ma._forward_config(512, 512, d, p)
    raw = am.TuningConfig(block_q=p["block_q"], block_kv=p["block_kv"], max_concurrent_steps=p["max_concurrent_steps"])
    _assert_lowers_iff(config is not None, lambda *x: ma.forward(*x, raw), q, k, k)
  for part in ("dq", "dkv"):
    for kernel_config in pairwise([choice.config for choice in registry.kernel(f"mosaic_attention_{part}").variants()]):
      p = dataclasses.asdict(kernel_config)
      config = ma._backward_config(512, 512, d, part, p)
      if config is None:  # every warpgroup count was refused: check the last one tried (one)
        blocks = ma._backward_blocks(part, p)
        config = am.TuningConfig(block_q=64, block_kv=64, max_concurrent_steps=ma.BACKWARD_STEPS,
                                 compute_wgs_bwd=1, **blocks)
        admitted = False
      else:
        admitted = True
      run = lambda *x, config=config, part=part: causal_blocks.pick(part)(*ma.backward(*x, config))
      _assert_lowers_iff(admitted, run, q, k, k, q, q, lse)


def _assert_lowers_iff(admitted, fn, *args):
  try:
    text = _lower(fn, *args)
  except ValueError as e:
    assert "shared memory" in str(e) and not admitted, str(e)
    return
  assert admitted, "the estimate refused a configuration that fits"
  assert mosaic_kernels(text) == 1  # the backward's other kernel is dead code, removed


def test_attention_blocks_lower(cuda_runtime):
  """The patched blocks at traced offsets: causal forward holds both kernels; fallbacks hold none."""
  prog = jm.programs.attention(1, 4, 2, 1024, 1024, 128, causal=True, dtype=jnp.bfloat16)
  q, k, lse = _spec(1, 256, 2, 2, 128), _spec(1, 256, 2, 128), _spec(1, 256, 2, 2, dtype=jnp.float32)
  starts = _spec(2, dtype=jnp.int32)

  def block(fn, sizes, extents):
    return lambda s, *x: fn(jm.BlockContext({"i": s[0], "j": s[1]}, sizes, extents), *x)

  even, whole = {"i": 256, "j": 256}, {"i": 1024, "j": 1024}
  forward = ma._make(prog, ma.ForwardConfig(), False)
  assert mosaic_kernels(_lower(block(forward, even, whole), starts, q, k, k)) == 2
  padded = {"i": 1000, "j": 1000}
  assert mosaic_kernels(_lower(block(forward, even, padded), starts, q, k, k)) == 0
  for part, config in (("dq", ma.DqConfig()), ("dkv", ma.DkvConfig())):
    make = ma._make_backward(part)
    program = getattr(ab, f"attention_{part}")(prog)
    assert mosaic_kernels(_lower(block(make(program, config, False), even, whole), starts, q, k, k, q, q, lse)) == 1


# ------------------------------------------------------------------ attention dispatch with stand-ins


def _forward_standin(q, k, v, config):
  """attention_mgpu's forward conventions, by JAX's own reference of it (unscaled scores, base-2 lse [b, h, i])."""
  out, (lse,) = ma.attention_mgpu.attention_reference(q, k, v, causal=config.causal, save_residuals=True)
  return out.astype(q.dtype), lse


def _backward_standin(q, k, v, o, do, lse2, config):
  """attention_mgpu's backward math and conventions in XLA: float16 in and out, unscaled, base-2 lse [b, h, i]."""
  f32 = lambda x: x.astype(jnp.float32)
  b, i, h, d = q.shape
  j, hk = k.shape[1], k.shape[2]
  kk, vv = (jnp.repeat(f32(x), h // hk, axis=2) for x in (k, v))  # query head h reads kv head h // g
  p = jnp.exp2(jnp.einsum("bihd,bjhd->bhij", f32(q), kk) * ma.LOG2E - lse2[..., None])
  delta = jnp.einsum("bihd,bihd->bhi", f32(o), f32(do))
  ds = p * (jnp.einsum("bihd,bjhd->bhij", f32(do), vv) - delta[..., None])
  dq = jnp.einsum("bhij,bjhd->bihd", ds, kk)
  per_group = lambda x: x.reshape(b, j, hk, h // hk, d).sum(3)
  dk = per_group(jnp.einsum("bhij,bihd->bjhd", ds, f32(q)))
  dv = per_group(jnp.einsum("bhij,bihd->bjhd", p, f32(do)))
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@pytest.fixture
def standins(monkeypatch):
  """The attention kernels with attention_mgpu stood in by XLA, offered on CPU.

  Returns the list of configurations of the kernel calls that ran (recorded
  while running, so branches traced but not taken do not count).
  """
  ran = []

  def record(fn):
    def run(*args):
      config = args[-1]
      jax.debug.callback(lambda: ran.append(config))
      return fn(*args)
    return run
  monkeypatch.setattr(ma, "_kernel_forward", record(_forward_standin))
  monkeypatch.setattr(ma, "_kernel_backward", record(_backward_standin))
  for name in MOSAIC[:3]:
    kernel = registry._KERNELS[name]
    monkeypatch.setitem(registry._KERNELS, name, dataclasses.replace(kernel, platforms=frozenset({"cpu"}),
                                                                      supports=None))
  return ran


def _attention(heads="gqa", n=1024, d=64, causal=True):
  h, hk = HEADS[heads]
  return jm.programs.attention(1, h, hk, n, n, d, causal=causal, dtype=jnp.bfloat16)


def _inputs(prog):
  return prog.random_inputs(fresh_key())


def _reference(prog, xs):
  ref = jm.programs.attention(**{**prog.params, "dtype": jnp.float32})
  return ref.reference(*[x.astype(jnp.float32) for x in xs])


def _assert_forward(schedule, tol=2e-2):
  prog = schedule.program
  xs = _inputs(prog)
  got = schedule.compile()(*xs).astype(jnp.float32)
  assert rel_err(got, _reference(prog, xs)) < tol, str(schedule)


def _assert_gradients(schedule, tol=3e-2):
  prog = schedule.program
  xs = _inputs(prog)
  cot = _normal(prog.writes.shape, jnp.float32)
  ref = jm.programs.attention(**{**prog.params, "dtype": jnp.float32})
  want = jax.grad(lambda *a: jnp.sum(ref.reference(*a) * cot), argnums=(0, 1, 2))(*[x.astype(jnp.float32) for x in xs])
  f = schedule.compile()
  got = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32) * cot), argnums=(0, 1, 2)))(*xs)
  for name, g, w in zip("qkv", got, want):
    assert rel_err(g.astype(jnp.float32), w) < tol, f"d{name}\n{schedule}"


def _library(prog, strategy):
  """A library schedule over 4 devices (zigzag: 8 chunks, of two of the kernel's query blocks at 1024 positions);
  ``context_parallel_tiled``: context parallel, keys in serial blocks of the queries' size."""
  mesh = jax.make_mesh((4,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:4])
  lib = jm.library(prog, mesh)
  if strategy == "context_parallel_tiled":
    return lib["context_parallel"].tile("j", 4)
  return lib[strategy]


# Each head layout with and without a mask on the ring (pairwise), both context parallels (causal context parallel
# runs only the body), zigzag order (for causal attention).
DISPATCH_CASES = [("ring", False, "mha"), ("ring", True, "gqa"), ("ring", False, "mqa"), ("ring", True, "mqa"),
                  ("context_parallel", True, "gqa"), ("context_parallel_tiled", False, "gqa"),
                  ("context_parallel_tiled", True, "gqa"), ("ring_zigzag", True, "gqa")]


@pytest.mark.parametrize("strategy, causal, heads", DISPATCH_CASES)
def test_library_dispatch(standins, strategy, causal, heads):
  """Values, and which blocks reach the kernel (the causal kernel only for equal, aligned blocks)."""
  prog = _attention(heads, causal=causal)
  _assert_forward(_library(prog, strategy).patch("mosaic_attention"))
  # Causal context parallel: a query block against all keys is never wholly visible: all of it is the body's.
  assert bool(standins) != (causal and strategy == "context_parallel")
  assert any(c.causal for c in standins) == (causal and strategy != "context_parallel")


@pytest.mark.parametrize("causal", [False, True])
def test_uneven_blocks_use_every_path(standins, causal):
  """Keys tiled finer than queries: visible blocks through the kernel, diagonal ones through the body."""
  prog = _attention(causal=causal)
  s = jm.Schedule(prog, make_mesh("8")).tile("i", 8).parallelize("i0", "x").tile("j", 8).shift("j0", "i0")
  s.tile("j1", 2).patch("mosaic_attention", block_kv=64)
  _assert_forward(s)
  assert standins and not any(c.causal for c in standins)


def test_blocks_off_the_kernel_fall_back(standins):
  """Padded keys, and blocks shorter than two query blocks of the kernel, use the program's body."""
  _assert_forward(_library(_attention(n=1000), "ring").patch("mosaic_attention"))
  _assert_forward(_library(_attention(n=512), "ring").patch("mosaic_attention", block_q=128))
  assert not standins


def test_head_dim_off_the_kernel_falls_back(standins):
  _assert_forward(_library(_attention(d=80), "ring").patch("mosaic_attention"))
  assert not standins


@pytest.mark.parametrize("strategy, causal", [("ring", False), ("ring_zigzag", True), ("context_parallel_tiled", True)])
def test_gradients_through_the_backward_kernels(standins, strategy, causal):
  from jaxmercury.schedules.dual import attention_duals
  prog = _attention(causal=causal)
  s = _library(prog, strategy).patch("mosaic_attention")
  _, dq, dkv = attention_duals(s)
  assert (dq.kernel, dkv.kernel) == ("mosaic_attention_dq", "mosaic_attention_dkv")
  _assert_gradients(s)
  assert any(c.has_backward_blocks for c in standins)


@pytest.mark.parametrize("strategy, causal", [("ring_zigzag", True), ("context_parallel", False)])
def test_gradients_run_cudnns_backward_where_the_devices_have_it(standins, cpu_cudnn, strategy, causal):
  """With cuDNN offered, a Mosaic-patched schedule's backward runs cuDNN's backward blocks on the same nest
  (``dual.backward_schedule``), fed by the Mosaic forward's output and log-sum-exp; JAX's Mosaic dq and dk-dv
  kernels do not run."""
  from jaxmercury.schedules.dual import attention_duals, backward_schedule
  prog = _attention(causal=causal)
  params = {} if strategy == "ring_zigzag" else {"block_q": 128}  # a block holds two of the kernel's query blocks
  s = _library(prog, strategy).patch("mosaic_attention", **params)
  b = backward_schedule(s)
  assert b.kernel == "cudnn_attention" and s.kernel == "mosaic_attention"
  assert [t["args"] for t in b.trace if t["primitive"] == "patch"] == [["cudnn_attention"]]
  kernel_label = str(s).split("[kernel ")[1].split("]")[0]
  assert b.plan().storage == s.plan().storage and str(b) == str(s).replace(kernel_label, "cudnn_attention")
  assert attention_duals(s)[0].kernel == s.kernel  # the forward keeping its residuals stays Mosaic
  _assert_gradients(s)
  assert "backward" in cpu_cudnn
  assert not any(c.has_backward_blocks for c in standins) and standins  # the Mosaic forward ran, its backward not


def test_without_cudnn_the_backward_keeps_the_kernels_own(standins):
  """On devices without cuDNN (here: CPU, cuDNN not stood in) the backward stays on the forward kernel's own."""
  from jaxmercury.schedules.dual import backward_schedule
  s = _library(_attention(), "ring").patch("mosaic_attention")
  assert backward_schedule(s) is s


def test_backward_is_priced_on_cudnn_for_gpus():
  """The cost model prices a Mosaic schedule's backward as the cuDNN schedule's on H100s."""
  from jaxmercury.schedules.dual import backward_schedule
  from jaxmercury.tuner import cost
  prog = jm.programs.attention(1, 32, 8, 32768, 32768, 128, causal=True, dtype=jnp.bfloat16)
  machine = cost.Machine("h100-ish", 700e12, {"*": 150e9}, 20e-6,
                         kernel_flops_per_s={"mosaic_attention": 500e12, "cudnn_attention": 600e12},
                         backward_flops_per_s={"mosaic_attention": 100e12, "cudnn_attention": 500e12})
  ring = jm.library(prog, h100_mesh(8))["ring"]
  mosaic, cudnn = ring.copy().patch("mosaic_attention"), ring.copy().patch("cudnn_attention")
  assert backward_schedule(mosaic).kernel == "cudnn_attention"
  assert cost.backward_seconds(mosaic, machine) == pytest.approx(cost.backward_seconds(cudnn, machine))
  assert cost.predict(mosaic, machine) > cost.predict(cudnn, machine)
  f32 = jm.library(jm.programs.attention(**{**prog.params, "dtype": jnp.float32}), h100_mesh(8))["ring"]
  assert backward_schedule(f32) is f32  # cuDNN takes half precision only
  with pytest.raises(jm.ScheduleError, match="fused_ring_attention.*without\\('lower_with'\\)"):
    backward_schedule(ring.copy().lower_with("fused_ring_attention"))


def test_tiny_gradients_survive_float16(standins):
  """An incoming gradient far below float16's range still gives accurate gradients (it is rescaled)."""
  prog = _attention("mha", n=256, d=64, causal=False)
  b, i, hk, g, d = 1, 256, 4, 1, 64
  q, o, do = (_normal((b, i, hk, g, d), jnp.bfloat16) for _ in range(3))
  k, v = (_normal((b, i, hk, d), jnp.bfloat16) for _ in range(2))
  sizes = {"i": i, "j": i}
  ctx = jm.BlockContext(starts={}, sizes=sizes, extents=sizes)
  lse = prog.body(ctx, q, k, v)[1]
  tiny = (do.astype(jnp.float32) * 1e-9).astype(jnp.bfloat16)
  for part in ("dq", "dkv"):
    program = getattr(ab, f"attention_{part}")(prog)
    config = ma.DqConfig() if part == "dq" else ma.DkvConfig()
    got = ma._make_backward(part)(program, config, False)(ctx, q, k, v, o, tiny, lse)
    want = program.body(ctx, q, k, v, o, tiny, lse)
    assert float(jnp.max(jnp.abs(want))) < 1e-6
    assert rel_err(got, want) < 2e-2, part


def test_forward_conversions(standins):
  """One whole block: natural-log lse, scaled scores, float32 results, for MHA, GQA and MQA."""
  for heads in HEADS:
    prog = _attention(heads, n=256, causal=True)
    h, hk = HEADS[heads]
    q = _normal((1, 256, hk, h // hk, 64), jnp.bfloat16)
    k, v = (_normal((1, 256, hk, 64), jnp.bfloat16) for _ in range(2))
    sizes = {"i": 256, "j": 256}
    ctx = jm.BlockContext(starts={}, sizes=sizes, extents=sizes)
    out, lse = ma._make(prog, ma.ForwardConfig(), False)(ctx, q, k, v)
    ref_out, ref_lse = prog.body(ctx, q, k, v)
    assert out.dtype == lse.dtype == jnp.float32
    assert rel_err(out, ref_out) < 1e-2 and float(jnp.max(jnp.abs(lse - ref_lse))) < 2e-2 * math.log(256)
