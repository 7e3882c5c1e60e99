"""The Mosaic GPU grouped GEMM (``kernels.moe.grouped_gemm``) on a Hopper GPU (skipped elsewhere).

The kernel against ``jax.lax.ragged_dot`` (float32 accumulation) forward and
backward (dx, dw) at a few shapes, groups of size 0 and rows past the groups
included, every admitted configuration at one shape; then an expert-parallel
MoE schedule with ``dispatch(gemm="mosaic_grouped_gemm")`` on a one-device GPU
mesh against the dense reference, values and gradients of all five inputs.

Run: ``JAX_PLATFORMS=cuda python3 -m pytest tests/gpu/test_grouped_gemm.py -x -q``
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import fresh_key, rel_err
from jax.sharding import AxisType
from test_moe import dense_moe, inputs

import jaxmercury as jm
from jaxmercury.kernels import config as configs
from jaxmercury.kernels import mosaic_gpu
from jaxmercury.kernels.moe import grouped_gemm as mgg

NAME = "mosaic_grouped_gemm"


def _hopper() -> bool:
  device = jax.devices()[0]
  return device.platform == "gpu" and mosaic_gpu.hopper_only(device) is None


pytestmark = pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU (compute capability 9.x)")


def _normal(shape, dtype):
  return jax.random.normal(fresh_key(), shape, jnp.float32).astype(dtype)


def _sizes(m: int, groups: int, *, empty: int, spare: int) -> jnp.ndarray:
  """Random group sizes summing to ``m - spare``, ``empty`` of them zero."""
  rng = np.random.default_rng(int(jax.random.randint(fresh_key(), (), 0, 2**30)))
  cuts = np.sort(rng.integers(0, m - spare, groups - empty - 1))
  sizes = np.diff(np.concatenate([[0], cuts, [m - spare]]))
  sizes = np.insert(sizes, rng.choice(groups - empty + 1, empty), 0)
  return jnp.asarray(sizes, jnp.int32)


def _ragged(x, w, sizes):
  return jax.lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32)


SHAPES = [  # m, k, n, groups, empty groups, rows past the groups
    (1024, 512, 768, 8, 2, 0),
    (1000, 1024, 256, 4, 1, 37),  # m off the row tiles
    (4096, 4096, 1024, 8, 0, 0),  # Mixtral's d_model, a slice of its d_ff
]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_and_backward_against_ragged_dot(shape, dtype):
  m, k, n, groups, empty, spare = shape
  sizes = _sizes(m, groups, empty=empty, spare=spare)
  x, w = _normal((m, k), dtype), _normal((groups, k, n), dtype)
  dy = _normal((m, n), jnp.float32)
  fn = jax.jit(lambda x, w: mgg.grouped_gemm(x, w, sizes))
  got, vjp = jax.vjp(fn, x, w)
  want, want_vjp = jax.vjp(jax.jit(lambda x, w: _ragged(x, w, sizes)), x, w)
  assert got.dtype == jnp.float32 and rel_err(got, want) < 1e-2
  assert not np.any(np.asarray(got[m - spare:]))
  dx, dw = vjp(dy)
  want_dx, want_dw = want_vjp(dy.astype(dtype).astype(jnp.float32))
  assert dx.dtype == dtype and rel_err(dx, want_dx) < 2e-2
  assert dw.dtype == dtype and rel_err(dw, want_dw) < 2e-2
  for g in np.flatnonzero(np.asarray(sizes) == 0):
    assert not np.any(np.asarray(dw[g])), g


def test_bf16_output():
  sizes = _sizes(512, 4, empty=1, spare=0)
  x, w = _normal((512, 256), jnp.bfloat16), _normal((4, 256, 256), jnp.bfloat16)
  got = mgg.grouped_gemm(x, w, sizes, out_dtype=jnp.bfloat16)
  assert got.dtype == jnp.bfloat16 and rel_err(got, _ragged(x, w, sizes)) < 1e-2


def test_every_admitted_configuration():
  m, k, n = 1024, 512, 512
  sizes = _sizes(m, 8, empty=1, spare=16)
  x, w, dy = _normal((m, k), jnp.bfloat16), _normal((8, k, n), jnp.bfloat16), _normal((m, n), jnp.bfloat16)
  want, want_vjp = jax.vjp(lambda x, w: _ragged(x, w, sizes), x, w)
  want_dx, want_dw = want_vjp(dy.astype(jnp.float32))
  for config in configs.variants(mgg.GroupedGemmConfig):
    if mgg.problem(k, n, jnp.bfloat16, config) is not None:
      continue
    got, vjp = jax.vjp(jax.jit(lambda x, w, c=config: mgg.grouped_gemm(x, w, sizes, config=c)), x, w)
    dx, dw = vjp(dy.astype(jnp.float32))
    assert rel_err(got, want) < 1e-2, config
    assert rel_err(dx, want_dx) < 2e-2 and rel_err(dw, want_dw) < 2e-2, config


def _one_gpu():
  return jax.make_mesh((1,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])


def test_expert_parallel_with_the_kernel_on_one_gpu():
  mesh = _one_gpu()
  prog = jm.programs.moe(1024, 512, 1024, 8, 2, dtype=jnp.bfloat16)
  xs = inputs(prog, biased=False)
  s = jm.Schedule(prog, mesh).tile("e", 1).parallelize("e0", "x").dispatch("e0", gemm=NAME)
  assert "grouped by expert: mosaic_grouped_gemm" in str(s) and "ragged_dot:" not in str(s)
  text = jax.jit(s.compile()).lower(*xs).as_text()
  assert text.count("custom_call @mosaic_gpu") == 3  # gate, up, down
  ref = jax.jit(lambda *a: dense_moe(*a, top_k=2))
  fn = jax.jit(s.compile())
  assert rel_err(fn(*xs), ref(*xs)) < 2e-2
  dy = _normal((1024, 512), jnp.bfloat16)
  got, want = jax.vjp(fn, *xs)[1](dy), jax.vjp(ref, *xs)[1](dy)
  for name, g, r in zip(("x", "router", "w_gate", "w_up", "w_down"), got, want):
    assert rel_err(g, r) < 5e-2, name
  plain = jm.Schedule(prog, mesh).tile("e", 1).parallelize("e0", "x").dispatch("e0")
  assert NAME in {v.dispatched["gemm"] for v in jm.tuner.autotuner.grouped_gemm_variants(plain)}  # offered here
