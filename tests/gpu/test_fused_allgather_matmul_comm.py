"""The all-gather GEMM with dedicated communication CTAs on real GPUs: tile variants, communication CTA counts and
chunk sizes against all_gather + dot (skipped on CPU)."""

import jax
import pytest
from jax.sharding import AxisType

from gpu.checks import check_allgather_matmul, gpu_mesh
from jaxmercury.kernels.gemm.allgather_comm import fused_allgather_matmul_comm
from jaxmercury.kernels.gemm.tiles import Tiles

pytestmark = pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs GPUs")

TILES = [Tiles(128, 128, 64, 4), Tiles(64, 256, 64, 4), Tiles(64, 128, 64, 4)]
# (comm_ctas, chunk_rows): one CTA sending everything, the default, many CTAs with two-tile chunks.
COMM = [(1, None), (4, None), (16, 256)]


def _check(mesh, m_shard, k, n, tiles, comm_ctas=4, chunk_rows=None):
  kernel = lambda a, b: fused_allgather_matmul_comm(a, b, "x", tiles=tiles, comm_ctas=comm_ctas,
                                                    chunk_rows=chunk_rows)
  check_allgather_matmul(mesh, m_shard, k, n, kernel, (tiles, comm_ctas, chunk_rows))


@pytest.mark.parametrize("comm", COMM, ids=str)
@pytest.mark.parametrize("tiles", TILES, ids=str)
@pytest.mark.parametrize("shape", [(1024, 4096, 1024), (1000, 1000, 600)], ids=["tiled", "ragged"])
def test_every_gpu(shape, tiles, comm):
  _check(gpu_mesh(), *shape, tiles, *comm)


@pytest.mark.parametrize("shape", [(1024, 4096, 1024), (1000, 1000, 600)], ids=["tiled", "ragged"])
def test_one_gpu(shape):
  mesh = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])
  _check(mesh, *shape, TILES[0])
