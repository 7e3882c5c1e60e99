"""The fused GEMM + reduce-scatter kernel on one device in Mosaic GPU interpret mode, its input checks,
and the ring's lowering to Mosaic GPU for 8 devices (no GPU needed).

Peer stores and remote semaphores have no interpreter; the ring runs in
tests/gpu/test_fused_matmul_reducescatter.py.
"""

import jax
import jax.numpy as jnp
import pytest
from conftest import fresh_key, h100_mesh, lower_for_gpus, mosaic_kernels, rel_err
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmercury.errors import PreconditionError
from jaxmercury.kernels.gemm.reducescatter import fused_matmul_reducescatter, reference
from jaxmercury.kernels.gemm.tiles import Tiles

SPECS = dict(in_specs=(P(None, "x"), P("x", None)), out_specs=P("x", None), check_vma=False)


def _mesh(devices):
  return jax.make_mesh((devices,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:devices])


def _run(fn, x, w, devices=1):
  return jax.jit(jax.shard_map(fn, mesh=_mesh(devices), **SPECS))(x, w)


# Multiples of the tiles, and not; each output dtype once.
@pytest.mark.parametrize("m,k,n,out_dtype", [(128, 128, 256, None), (200, 96, 130, jnp.float32)])
def test_one_device_matches_dot(m, k, n, out_dtype):
  x = jax.random.normal(fresh_key(), (m, k), jnp.float32).astype(jnp.bfloat16)
  w = jax.random.normal(fresh_key(), (k, n), jnp.float32).astype(jnp.bfloat16)
  tiles = Tiles(tile_m=64, tile_n=128, tile_k=64, max_concurrent_steps=2)
  got = _run(lambda x, w: fused_matmul_reducescatter(x, w, "x", tiles=tiles, out_dtype=out_dtype, num_ctas=3,
                                                     interpret=True), x, w)
  want = _run(lambda x, w: reference(x, w, "x", out_dtype=jnp.float32), x, w)
  assert got.shape == (m, n) and got.dtype == (out_dtype or jnp.bfloat16)
  assert rel_err(got.astype(jnp.float32), want) < (1e-5 if out_dtype else 1e-2)


def test_inputs_are_checked_before_anything_runs():
  x = jnp.ones((128, 64), jnp.bfloat16)
  with pytest.raises(PreconditionError, match="bf16 or fp16"):
    _run(lambda x, w: fused_matmul_reducescatter(x, w, "x"), x, jnp.ones((64, 128), jnp.float32))
  with pytest.raises(PreconditionError, match=r"x \[m, k\] and w \[k, n\]"):
    _run(lambda x, w: fused_matmul_reducescatter(x, w, "x"), x, jnp.ones((32, 128), jnp.bfloat16))
  with pytest.raises(PreconditionError, match="tile_m=96"):
    _run(lambda x, w: fused_matmul_reducescatter(x, w, "x", tiles=Tiles(tile_m=96)), x,
         jnp.ones((64, 128), jnp.bfloat16))


def test_rows_must_divide_by_the_axis():
  with pytest.raises(PreconditionError, match=r"129 rows, which axis 'x' \(2 devices\)"):
    _run(lambda x, w: fused_matmul_reducescatter(x, w, "x"), jnp.ones((129, 128), jnp.bfloat16),
         jnp.ones((128, 128), jnp.bfloat16), devices=2)


@pytest.mark.parametrize("interpret,message", [(True, "no peer memory"), (False, "the process has 8")])
def test_a_ring_needs_a_gpu_mesh_over_every_device(interpret, message):
  with pytest.raises(PreconditionError, match=message):
    _run(lambda x, w: fused_matmul_reducescatter(x, w, "x", interpret=interpret), jnp.ones((256, 128), jnp.bfloat16),
         jnp.ones((128, 128), jnp.bfloat16), devices=2)


# The GPU test's and the benchmark's tile variants.
RING_TILES = [Tiles(128, 128, 64, 4), Tiles(128, 128, 64, 5), Tiles(64, 256, 64, 4), Tiles(64, 128, 64, 4),
              Tiles(128, 128, 128, 2)]


# Every tile variant once, each shape with several of them.
@pytest.mark.parametrize("tiles,shape", [(tiles, (1024, 512, 512) if i % 2 == 0 else (8 * 200, 1000, 600))
                                         for i, tiles in enumerate(RING_TILES)], ids=str)
def test_the_ring_lowers_for_eight_h100s(shape, tiles):
  """The 8-device ring (remote stores, semaphores, the float32 partial-sum add) lowers to Mosaic GPU.

  Lowering for an abstract H100 checks layouts and shared memory (the
  epilogue's buffers reuse the pipeline's); it is no CUDA compile and no run.
  """
  m, k, n = shape
  mesh = h100_mesh(8)
  spec = lambda shape, p: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, p))
  f = jax.shard_map(lambda x, w: fused_matmul_reducescatter(x, w, "x", tiles=tiles, num_ctas=132), mesh=mesh,
                    **SPECS)
  text = lower_for_gpus(f, spec((m, 8 * k), P(None, "x")), spec((8 * k, n), P("x", None)), mesh=mesh)
  assert mosaic_kernels(text) == 1
