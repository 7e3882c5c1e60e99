"""The fused all-gather GEMMs on real GPUs (ours and our warp-specialized one): every tile variant against
all_gather + dot (skipped on CPU)."""

import jax
import pytest
from gpu.checks import check_allgather_matmul, gpu_mesh
from jax.sharding import AxisType

from jaxmercury.pallas_kernels.fused_allgather_matmul import fused_allgather_matmul
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
  check_allgather_matmul(mesh, m_shard, k, n, _kernel(tiles), tiles)


@pytest.mark.parametrize("tiles", TILES + WS_TILES, ids=str)
@pytest.mark.parametrize("shape", [(1024, 4096, 1024), (1000, 1000, 600)], ids=["tiled", "ragged"])
def test_every_gpu(shape, tiles):
  _check(gpu_mesh(), *shape, tiles)


@pytest.mark.parametrize("tiles", [TILES[0], WS_TILES[0]], ids=str)
@pytest.mark.parametrize("shape", [(1024, 4096, 1024), (1000, 1000, 600)], ids=["tiled", "ragged"])
def test_one_gpu(shape, tiles):
  mesh = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])
  _check(mesh, *shape, tiles)
