"""The all-gather GEMM with dedicated communication CTAs on real GPUs: tile variants, communication CTA counts and
chunk sizes against all_gather + dot (skipped on CPU)."""

import jax
import jax.numpy as jnp
import pytest
from conftest import fresh_key, rel_err
from gpu.checks import gpu_mesh
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmercury.pallas_kernels.fused_allgather_matmul_comm import fused_allgather_matmul_comm, reference
from jaxmercury.pallas_kernels.mosaic_matmul import Tiles

pytestmark = pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs GPUs")

TILES = [Tiles(128, 128, 64, 4), Tiles(64, 256, 64, 4), Tiles(64, 128, 64, 4)]
# (comm_ctas, chunk_rows): one CTA sending everything, the default, many CTAs with two-tile chunks.
COMM = [(1, None), (4, None), (16, 256)]


def _check(mesh, m_shard, k, n, tiles, comm_ctas=4, chunk_rows=None):
  devices = mesh.devices.size
  a = jax.device_put(jax.random.normal(fresh_key(), (devices * m_shard, k), jnp.float32).astype(jnp.bfloat16),
                     NamedSharding(mesh, P("x", None)))
  b = jax.device_put(jax.random.normal(fresh_key(), (k, devices * n), jnp.float32).astype(jnp.bfloat16),
                     NamedSharding(mesh, P(None, "x")))

  def run(fn):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P("x", None), P(None, "x")), out_specs=P(None, "x"),
                                 check_vma=False))(a, b)

  got = run(lambda a, b: fused_allgather_matmul_comm(a, b, "x", tiles=tiles, comm_ctas=comm_ctas,
                                                     chunk_rows=chunk_rows))
  want = jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32))
  assert got.shape == want.shape
  assert rel_err(got.astype(jnp.float32), want) < 2e-2, (tiles, comm_ctas, chunk_rows)
  unfused = run(lambda a, b: reference(a, b, "x"))
  assert rel_err(got.astype(jnp.float32), unfused.astype(jnp.float32)) < 2e-2
  # Run again: the semaphores and receive buffers of one call must not leak into the next.
  again = run(lambda a, b: fused_allgather_matmul_comm(a, b, "x", tiles=tiles, comm_ctas=comm_ctas,
                                                       chunk_rows=chunk_rows))
  assert rel_err(again.astype(jnp.float32), want) < 2e-2


@pytest.mark.parametrize("comm", COMM, ids=str)
@pytest.mark.parametrize("tiles", TILES, ids=str)
@pytest.mark.parametrize("shape", [(1024, 4096, 1024), (1000, 1000, 600)], ids=["tiled", "ragged"])
def test_every_gpu(shape, tiles, comm):
  _check(gpu_mesh(), *shape, tiles, *comm)


@pytest.mark.parametrize("shape", [(1024, 4096, 1024), (1000, 1000, 600)], ids=["tiled", "ragged"])
def test_one_gpu(shape):
  mesh = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])
  _check(mesh, *shape, TILES[0])
