"""The fused all-gather GEMMs on real GPUs (ours and our warp-specialized one): every tile variant against
all_gather + dot (skipped on CPU)."""

import jax
import pytest
from jax.sharding import AxisType

from gpu.checks import check_allgather_matmul, gpu_mesh
from jaxmercury.kernels.gemm.allgather import fused_allgather_matmul
from jaxmercury.kernels.gemm.allgather_ws import fused_allgather_matmul_ws
from jaxmercury.kernels.gemm.tiles import Tiles, WsTiles

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


@pytest.mark.parametrize("kernel", ["ours", "comm", "ws"])
@pytest.mark.parametrize("shape", [(1024, 4096, 1024), (1000, 1000, 600)], ids=["tiled", "ragged"])
def test_the_gathered_rows_are_all_gather(shape, kernel):
  """``gathered=True``: the rows the ring brought, in every device's order, are exactly ``all_gather(a)``; the
  product is unchanged (the backward's residual, ``lowering.fused_gemm_backward``)."""
  import jax.numpy as jnp
  from conftest import fresh_key, rel_err
  from jax import lax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from jaxmercury.kernels.gemm.allgather_comm import fused_allgather_matmul_comm
  mesh, (m_shard, k, n) = gpu_mesh(), shape
  fn = {"ours": fused_allgather_matmul, "comm": fused_allgather_matmul_comm, "ws": fused_allgather_matmul_ws}[kernel]
  devices = mesh.devices.size
  a = jax.device_put(jax.random.normal(fresh_key(), (devices * m_shard, k), jnp.float32).astype(jnp.bfloat16),
                     NamedSharding(mesh, P("x", None)))
  b = jax.device_put(jax.random.normal(fresh_key(), (k, devices * n), jnp.float32).astype(jnp.bfloat16),
                     NamedSharding(mesh, P(None, "x")))

  def per_device(a, b):
    out, full = fn(a, b, "x", gathered=True)
    return out, full[None], lax.all_gather(a, "x", axis=0, tiled=True)[None]

  out, full, want = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P("x", None), P(None, "x")),
                                          out_specs=(P(None, "x"), P("x"), P("x")), check_vma=False))(a, b)
  assert (full == want).all()
  assert rel_err(out.astype(jnp.float32), jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32))) < 2e-2
