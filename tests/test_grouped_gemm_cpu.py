"""The Mosaic GPU grouped GEMM (``kernels.moe.grouped_gemm``), as far as a CPU can check it.

- JAX's ragged-dot kernels take no interpret flag; ``interpreted`` binds Mosaic
  GPU interpret mode into them, and the wrapper (forward, ``dx``, ``dw``)
  runs against a plain per-group reference on one device.
- The forward and the backward lower to Mosaic GPU for an abstract H100 (the
  lowering allocates shared memory and checks wgmma shapes).
- A dispatched MoE schedule with ``gemm="mosaic_grouped_gemm"`` runs on the
  8-device CPU mesh with the kernels stood in by ``jax.lax.ragged_dot``
  (their conventions kept: results in the input dtype, rows past the groups
  unwritten), forward and gradients against the dense reference.
- The kernel is refused on CPU meshes naming the device and not offered
  there; shapes and dtypes it does not compute fall back to ``ragged_dot``,
  saying why.
"""

import functools
import types

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import fresh_key, h100_mesh, lower_for_gpus, make_mesh, mosaic_kernels, rel_err
from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu
from jax.sharding import AxisType
from test_moe import dense_moe, inputs

import jaxmercury as jm
from jaxmercury.analysis import dispatch as dispatches
from jaxmercury.errors import PreconditionError
from jaxmercury.kernels import registry
from jaxmercury.kernels.moe import grouped_gemm as mgg
from jaxmercury.lowering import routed

NAME = "mosaic_grouped_gemm"
SMALL = mgg.GroupedGemmConfig(block_m=64, block_n=64, max_concurrent_steps=2)


def _normal(shape, dtype):
  return jax.random.normal(fresh_key(), shape, jnp.float32).astype(dtype)


def per_group(x, w, sizes):
  """Plain reference: each group's rows times its weights in float32, rows past the groups zero."""
  ends = np.cumsum(np.asarray(sizes))
  starts = ends - np.asarray(sizes)
  out = np.zeros((x.shape[0], w.shape[2]), np.float32)
  xf, wf = np.asarray(x, np.float32), np.asarray(w, np.float32)
  for g, (s, e) in enumerate(zip(starts, ends)):
    out[s:e] = xf[s:e] @ wf[g]
  return out


class _Gpu:
  """What the transposed kernel reads of ``jax.devices()[0]`` (its SM count)."""

  core_count = 132


class _JaxWithGpu:
  """``jax`` as ``transposed_ragged_dot_mgpu`` sees it: ``devices()`` gives an H100's SM count."""

  def __getattr__(self, name):
    return (lambda *a, **k: [_Gpu()]) if name == "devices" else getattr(jax, name)


def _bind_interpret(module, monkeypatch):
  ns = types.SimpleNamespace(**{k: getattr(plgpu, k) for k in dir(plgpu) if not k.startswith("__")})
  ns.kernel = functools.partial(plgpu.kernel, interpret=plgpu.InterpretGPUParams())
  monkeypatch.setattr(module, "plgpu", ns)


@pytest.fixture
def interpreted(monkeypatch):
  """JAX's ragged-dot kernels in Mosaic GPU interpret mode (they take no interpret flag)."""
  _bind_interpret(ragged_dot_mgpu, monkeypatch)
  _bind_interpret(transposed_ragged_dot_mgpu, monkeypatch)
  monkeypatch.setattr(transposed_ragged_dot_mgpu, "jax", _JaxWithGpu())


@pytest.fixture
def sm_count(monkeypatch):
  """The transposed kernel sizes its grid by ``jax.devices()[0].core_count``, which CPUs lack."""
  monkeypatch.setattr(transposed_ragged_dot_mgpu, "jax", _JaxWithGpu())


# ------------------------------------------------------------------ the kernel in interpret mode


@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_interpret_forward_and_gradients(interpreted, out_dtype):
  """Groups of size 0 (first, middle, last), a group straddling row tiles, rows past the groups; forward, dx, dw,
  and no gradient for the group sizes."""
  m, k, n = 200, 128, 128  # m: not a multiple of the row tile (padded inside)
  sizes = jnp.array([0, 70, 0, 1, 100, 0], jnp.int32)  # 171 rows in groups, 29 past them
  x, w = _normal((m, k), jnp.bfloat16), _normal((6, k, n), jnp.bfloat16)
  dy = _normal((m, n), out_dtype)
  fn = jax.jit(lambda x, w, s: mgg.grouped_gemm(x, w, s, config=SMALL, out_dtype=out_dtype))
  out, vjp = jax.vjp(fn, x, w, sizes)
  assert out.dtype == out_dtype and out.shape == (m, n)
  tol = 1e-2 if out_dtype == jnp.bfloat16 else 5e-3  # the kernel rounds to bf16 before widening
  assert rel_err(out, per_group(x, w, sizes)) < tol
  assert not np.any(np.asarray(out[171:]))
  dx, dw, dsizes = vjp(dy)
  dyf = jnp.asarray(dy, jnp.float32).astype(jnp.bfloat16)
  want_dx = per_group(dyf, jnp.swapaxes(w, 1, 2), sizes)
  assert dx.dtype == jnp.bfloat16 and rel_err(dx, want_dx) < 1e-2
  assert not np.any(np.asarray(dx[171:]))
  ends = np.cumsum(np.asarray(sizes))
  want_dw = np.stack([np.asarray(x[e - s:e], np.float32).T @ np.asarray(dyf[e - s:e], np.float32)
                      for s, e in zip(np.asarray(sizes), ends)])
  assert dw.dtype == jnp.bfloat16 and rel_err(dw, want_dw) < 1e-2
  assert not np.any(np.asarray(dw)[[0, 2, 5]])  # empty groups: zero weight gradients
  assert dsizes.dtype == jax.dtypes.float0


def test_interpret_against_ragged_dot(interpreted):
  """Default tiles, float16, random group sizes summing to every row: equals ``jax.lax.ragged_dot``."""
  m, k, n = 384, 128, 256
  cuts = np.sort(np.random.default_rng(int(jax.random.randint(fresh_key(), (), 0, 2**30))).integers(0, m, 3))
  sizes = jnp.asarray(np.diff(np.concatenate([[0], cuts, [m]])), jnp.int32)
  x, w = _normal((m, k), jnp.float16), _normal((4, k, n), jnp.float16)
  got = jax.jit(lambda x, w, s: mgg.grouped_gemm(x, w, s))(x, w, sizes)
  want = jax.lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32)
  assert rel_err(got, want) < 2e-3


# ------------------------------------------------------------------ lowering for an abstract H100


def test_forward_and_backward_lower(sm_count):
  s = jax.ShapeDtypeStruct
  x, w, sizes, dy = s((512, 256), jnp.bfloat16), s((4, 256, 384), jnp.bfloat16), s((4,), jnp.int32), s((512, 384),
                                                                                                        jnp.float32)
  for choice in (registry.grouped(NAME).configure(), SMALL):
    fn = functools.partial(mgg.grouped_gemm, config=choice)
    assert mosaic_kernels(lower_for_gpus(fn, x, w, sizes, mesh=h100_mesh(1))) == 1

    def both(x, w, sizes, dy, fn=fn):
      out, vjp = jax.vjp(lambda x, w: fn(x, w, sizes), x, w)
      return out, vjp(dy)

    assert mosaic_kernels(lower_for_gpus(both, x, w, sizes, dy, mesh=h100_mesh(1))) == 3  # forward, dx, dw


def test_every_admitted_variant_lowers(sm_count):
  """Every admitted variant's tiles, at the deepest pipeline (the most shared memory) and the widest L2 walk."""
  s = jax.ShapeDtypeStruct
  x, w, sizes = s((256, 512), jnp.bfloat16), s((2, 512, 512), jnp.bfloat16), s((2,), jnp.int32)
  variants = [c for c in jm.kernels.config.variants(mgg.GroupedGemmConfig) if c.tile_problem() is None]
  assert len(variants) == 16
  for c in variants:
    assert mgg.problem(512, 512, jnp.bfloat16, c) is None
    if c.max_concurrent_steps != 4 or c.grid_block_n != 4:
      continue
    fn = lambda x, w, g, c=c: jax.value_and_grad(lambda x, w: mgg.grouped_gemm(x, w, g, config=c).sum(), (0, 1))(x, w)
    assert mosaic_kernels(lower_for_gpus(fn, x, w, sizes, mesh=h100_mesh(1))) == 3, c


# ------------------------------------------------------------------ applicability


def test_problem_names_shapes_and_dtypes():
  c = mgg.GroupedGemmConfig()
  assert mgg.problem(4096, 14336, jnp.bfloat16, c) is None  # Mixtral-8x7B
  assert mgg.problem(14336, 4096, jnp.bfloat16, c) is None
  assert "float32" in mgg.problem(128, 128, jnp.float32, c)
  assert "k=96" in mgg.problem(96, 128, jnp.bfloat16, c)
  assert "n=200" in mgg.problem(128, 200, jnp.bfloat16, c)
  assert "grid_block_n" in mgg.problem(128, 384, jnp.bfloat16, mgg.GroupedGemmConfig(grid_block_n=4))
  assert "accumulators" in mgg.GroupedGemmConfig(block_m=256, block_n=128).tile_problem()
  with pytest.raises(ValueError, match="float32"):
    mgg.grouped_gemm(jnp.ones((64, 128)), jnp.ones((2, 128, 128)), jnp.array([10, 20], jnp.int32))


def _moe(dtype=jnp.bfloat16, d=128, f=256):
  return jm.programs.moe(64, d, f, 8, 2, dtype=dtype)


@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto])
def test_refused_on_cpu_and_not_offered(kind):
  mesh = make_mesh("8", kind)
  prog = _moe()
  s = jm.Schedule(prog, mesh).tile("e", 8).parallelize("e0", "x")
  with pytest.raises(PreconditionError, match=r"mosaic_grouped_gemm.*(TFRT_CPU_0|cpu).*cpu device"):
    s.dispatch("e0", gemm=NAME)
  assert dispatches.gemm_problem(NAME, mesh) is not None
  variants = jm.tuner.autotuner.grouped_gemm_variants(jm.library(prog, mesh)["expert_parallel"])
  assert {v.dispatched["gemm"] for v in variants} == {"ragged_dot", "dense"}
  with pytest.raises(PreconditionError, match="choose one of.*mosaic_grouped_gemm"):
    s.dispatch("e0", gemm="mosaic")


# ------------------------------------------------------------------ dispatch with the kernels stood in


@pytest.fixture
def standins(monkeypatch):
  """The kernels stood in by ``ragged_dot`` with their conventions (input dtype, rows past the groups NaN: the
  kernel leaves them unwritten), the devices taken for Hopper GPUs; records the calls."""
  calls = []

  def ragged(x, w, sizes, config, transpose_rhs):
    calls.append(("dx" if transpose_rhs else "forward", x.shape, w.shape))
    w = jnp.swapaxes(w, 1, 2) if transpose_rhs else w
    out = jax.lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32).astype(x.dtype)
    return jnp.where((jnp.arange(x.shape[0]) < jnp.sum(sizes))[:, None], out, jnp.nan)

  def transposed(x, dy, sizes, config):
    calls.append(("dw", x.shape, dy.shape))
    dims = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((0,), (0,)), ((), ())),
                                             lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
    return jax.lax.ragged_dot_general(x, dy, sizes, dims, preferred_element_type=jnp.float32).astype(x.dtype)

  monkeypatch.setattr(mgg, "_ragged", ragged)
  monkeypatch.setattr(mgg, "_transposed", transposed)
  monkeypatch.setattr(mgg, "devices_problem", lambda mesh: None)
  return calls


def test_standins_match_the_reference(standins):
  """The stand-ins keep the kernels' contract: the wrapper through them equals the per-group reference."""
  sizes = jnp.array([3, 0, 50, 20], jnp.int32)
  x, w = _normal((96, 128), jnp.bfloat16), _normal((4, 128, 128), jnp.bfloat16)
  assert rel_err(mgg.grouped_gemm(x, w, sizes, config=SMALL), per_group(x, w, sizes)) < 5e-3


@pytest.mark.parametrize("mesh_shape,level,kind", [("8", "x", AxisType.Explicit), ("2x4", "gpu", AxisType.Auto)])
def test_dispatch_forward_and_gradients(standins, mesh_shape, level, kind):
  """expert_parallel with the kernel: forward and the gradients of all five inputs equal the dense reference."""
  mesh = make_mesh(mesh_shape, kind)
  prog = _moe()
  xs = inputs(prog, biased=False)
  s = jm.Schedule(prog, mesh).tile("e", mesh.shape[level]).parallelize("e0", level).dispatch("e0", gemm=NAME)
  assert "grouped by expert: mosaic_grouped_gemm" in str(s) and "ragged_dot:" not in str(s)
  fn = s.compile()
  ref = lambda *a: dense_moe(*a, top_k=2)
  assert rel_err(fn(*xs), ref(*xs)) < 2e-2
  assert {c[0] for c in standins} == {"forward"}
  dy = _normal((64, 128), jnp.bfloat16)
  got = jax.vjp(fn, *xs)[1](dy)
  want = jax.vjp(ref, *xs)[1](dy)
  for name, g, r in zip(("x", "router", "w_gate", "w_up", "w_down"), got, want):
    assert rel_err(g, r) < 5e-2, name
  assert {c[0] for c in standins} == {"forward", "dx", "dw"}


def test_one_device_mesh(standins):
  """The GPU test's schedule (experts over a one-device level) on one CPU device."""
  mesh = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])
  prog = jm.programs.moe(64, 128, 128, 8, 2, dtype=jnp.bfloat16)
  xs = inputs(prog, biased=False)
  s = jm.Schedule(prog, mesh).tile("e", 1).parallelize("e0", "x").dispatch("e0", gemm=NAME)
  assert rel_err(jax.jit(s.compile())(*xs), dense_moe(*xs, top_k=2)) < 2e-2 and standins


def test_library_schedules_with_the_kernel_inside_set_mesh(standins):
  mesh = make_mesh("8")
  prog = _moe()
  xs = inputs(prog, biased=False)
  want = dense_moe(*xs, top_k=2)
  for name in ("expert_parallel", "expert_parallel_pipelined"):
    variants = jm.tuner.autotuner.grouped_gemm_variants(jm.library(prog, mesh)[name])
    (s,) = [v for v in variants if v.dispatched["gemm"] == NAME]
    with jax.set_mesh(mesh):
      assert rel_err(s.compile()(*xs), want) < 2e-2, name


def test_shapes_off_the_kernel_fall_back_saying_why(standins):
  mesh = make_mesh("8")
  prog = _moe(d=128, f=96)  # d_ff 96: the gate and up GEMMs' n, the down GEMM's k, off the tiles
  s = jm.Schedule(prog, mesh).tile("e", 8).parallelize("e0", "x").dispatch("e0", gemm=NAME)
  d = dispatches.of(s)
  assert set(dispatches.gemm_fallback(s, d)) == {"gate", "up", "down"}
  assert "gate projection on ragged_dot: n=96" in str(s)
  xs = inputs(prog, biased=False)
  assert rel_err(s.compile()(*xs), dense_moe(*xs, top_k=2)) < 2e-2
  assert not standins  # every projection on ragged_dot
  assert {v.dispatched["gemm"] for v in jm.tuner.autotuner.grouped_gemm_variants(s)} == {NAME, "ragged_dot",
                                                                                          "dense"}
  f32 = _moe(dtype=jnp.float32)
  s32 = jm.Schedule(f32, mesh).tile("e", 8).parallelize("e0", "x").dispatch("e0")
  assert {v.dispatched["gemm"] for v in jm.tuner.autotuner.grouped_gemm_variants(s32)} == {"ragged_dot", "dense"}
  dot = routed.grouped_dot(NAME)
  x32, w32 = _normal((16, 128), jnp.float32), _normal((2, 128, 128), jnp.float32)
  sizes = jnp.array([5, 9], jnp.int32)
  assert rel_err(dot(x32, w32, sizes), per_group(x32, w32, sizes)) < 1e-5 and not standins


def test_cost_and_memory_price_the_kernel(standins):
  mesh = jax.sharding.AbstractMesh((8,), ("x",), axis_types=(AxisType.Auto,))
  prog = jm.programs.moe(8192, 4096, 14336, 8, 2, dtype=jnp.bfloat16)
  base = jm.Schedule(prog, mesh).tile("e", 8).parallelize("e0", "x")
  rd = base.copy().dispatch("e0")
  mk = base.copy().dispatch("e0", gemm=NAME)
  machine = jm.tuner.cost.Machine("h", 5e14, {"*": 1e11})
  fast = jm.tuner.cost.Machine("h", 5e14, {"*": 1e11}, kernel_flops_per_s={"xla": 4e14, NAME: 6e14})
  from jaxmercury.analysis.memory import memory_per_device
  assert memory_per_device(mk) > memory_per_device(rd)
  # unmeasured: the kernel's tiles cost rows; measured faster: it wins
  assert jm.tuner.cost.predict(mk, machine) > jm.tuner.cost.predict(rd, machine)
  assert jm.tuner.cost.predict(mk, fast) < jm.tuner.cost.predict(rd, fast)
  assert jm.tuner.cost.backward_seconds(mk, fast) < jm.tuner.cost.backward_seconds(rd, fast)
