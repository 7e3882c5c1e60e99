"""The fused GEMM + reduce-scatter kernels on real GPUs (one consumer warpgroup, and the warp-specialized one
with two): every tile variant against dot + psum_scatter (skipped on CPU)."""

import jax
import jax.numpy as jnp
import pytest
from conftest import fresh_key, rel_err
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from test_fused_matmul_reducescatter_ws_cpu import WS_TILES

from gpu.checks import gpu_mesh
from jaxmercury.kernels.gemm.reducescatter import fused_matmul_reducescatter, reference
from jaxmercury.kernels.gemm.reducescatter_ws import fused_matmul_reducescatter_ws
from jaxmercury.kernels.gemm.tiles import Tiles

pytestmark = pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs GPUs")

TILES = [Tiles(128, 128, 64, 4), Tiles(64, 256, 64, 4), Tiles(64, 128, 64, 4)]
SHAPES = [(1024, 4096, 1024), (1000, 1000, 600)]  # (rows per device, k per device, n)


def _check(mesh, m_block, k, n, tiles, kernel=fused_matmul_reducescatter):
  devices = mesh.devices.size
  x = jax.device_put(jax.random.normal(fresh_key(), (devices * m_block, devices * k), jnp.float32).astype(jnp.bfloat16),
                     NamedSharding(mesh, P(None, "x")))
  w = jax.device_put(jax.random.normal(fresh_key(), (devices * k, n), jnp.float32).astype(jnp.bfloat16),
                     NamedSharding(mesh, P("x", None)))

  def run(fn):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(None, "x"), P("x", None)), out_specs=P("x", None),
                                 check_vma=False))(x, w)

  got = run(lambda x, w: kernel(x, w, "x", tiles=tiles))
  want = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32))
  assert got.shape == want.shape and got.dtype == jnp.bfloat16
  assert rel_err(got.astype(jnp.float32), want) < 2e-2, tiles
  unfused = run(lambda x, w: reference(x, w, "x"))
  assert rel_err(got.astype(jnp.float32), unfused.astype(jnp.float32)) < 2e-2
  # Partial sums travel in float32: with a float32 result the fused kernel is as exact as the reference.
  exact = run(lambda x, w: kernel(x, w, "x", tiles=tiles, out_dtype=jnp.float32))
  assert rel_err(exact, want) < 1e-4, tiles


@pytest.mark.parametrize("tiles", TILES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=["tiled", "ragged"])
def test_every_gpu(shape, tiles):
  _check(gpu_mesh(), *shape, tiles)


@pytest.mark.parametrize("shape", SHAPES, ids=["tiled", "ragged"])
def test_one_gpu(shape):
  mesh = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])
  _check(mesh, *shape, TILES[0])


@pytest.mark.parametrize("tiles", WS_TILES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=["tiled", "ragged"])
def test_warp_specialized_every_gpu(shape, tiles):
  _check(gpu_mesh(), *shape, tiles, fused_matmul_reducescatter_ws)


@pytest.mark.parametrize("shape", SHAPES, ids=["tiled", "ragged"])
def test_warp_specialized_one_gpu(shape):
  mesh = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])
  _check(mesh, *shape, WS_TILES[0], fused_matmul_reducescatter_ws)
