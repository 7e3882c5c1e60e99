"""The fused all-gather GEMMs on real GPUs (ours and our warp-specialized one): every tile variant against
all_gather + dot (skipped on CPU)."""

import jax
import jax.numpy as jnp
import pytest
from conftest import fresh_key, rel_err
from gpu.checks import gpu_mesh
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmercury.pallas_kernels.fused_allgather_matmul import fused_allgather_matmul, reference
from jaxmercury.pallas_kernels.fused_allgather_matmul_ws import fused_allgather_matmul_ws
from jaxmercury.pallas_kernels.fused_matmul_reducescatter_ws import WsTiles
from jaxmercury.pallas_kernels.mosaic_matmul import Tiles

pytestmark = pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs GPUs")

TILES = [Tiles(128, 128, 64, 4), Tiles(64, 256, 64, 4), Tiles(64, 128, 64, 4)]
WS_TILES = [WsTiles(128, 128, 64, 4), WsTiles(128, 64, 64, 4), WsTiles(64, 128, 64, 4, "m")]


def _kernel(tiles):
  if isinstance(tiles, WsTiles):
    return lambda a, b: fused_allgather_matmul_ws(a, b, "x", tiles=tiles)
  return lambda a, b: fused_allgather_matmul(a, b, "x", tiles=tiles)


def _check(mesh, m_shard, k, n, tiles):
  devices = mesh.devices.size
  a = jax.device_put(jax.random.normal(fresh_key(), (devices * m_shard, k), jnp.float32).astype(jnp.bfloat16),
                     NamedSharding(mesh, P("x", None)))
  b = jax.device_put(jax.random.normal(fresh_key(), (k, devices * n), jnp.float32).astype(jnp.bfloat16),
                     NamedSharding(mesh, P(None, "x")))

  def run(fn):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P("x", None), P(None, "x")), out_specs=P(None, "x"),
                                 check_vma=False))(a, b)

  got = run(_kernel(tiles))
  want = jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32))
  assert got.shape == want.shape
  assert rel_err(got.astype(jnp.float32), want) < 2e-2, tiles
  unfused = run(lambda a, b: reference(a, b, "x"))
  assert rel_err(got.astype(jnp.float32), unfused.astype(jnp.float32)) < 2e-2


@pytest.mark.parametrize("tiles", TILES + WS_TILES, ids=str)
@pytest.mark.parametrize("shape", [(1024, 4096, 1024), (1000, 1000, 600)], ids=["tiled", "ragged"])
def test_every_gpu(shape, tiles):
  _check(gpu_mesh(), *shape, tiles)


@pytest.mark.parametrize("tiles", [TILES[0], WS_TILES[0]], ids=str)
@pytest.mark.parametrize("shape", [(1024, 4096, 1024), (1000, 1000, 600)], ids=["tiled", "ragged"])
def test_one_gpu(shape, tiles):
  mesh = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])
  _check(mesh, *shape, tiles)
