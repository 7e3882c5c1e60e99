"""The fused all-gather GEMM kernel on one device in Mosaic GPU interpret mode, and its input checks.

Peer stores and remote semaphores have no interpreter; the ring runs in
tests/gpu/test_fused_allgather_matmul.py.
"""

import jax
import jax.numpy as jnp
import pytest
from conftest import fresh_key, rel_err
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxmercury.errors import PreconditionError
from jaxmercury.kernels.gemm.allgather import fused_allgather_matmul, reference
from jaxmercury.kernels.gemm.tiles import Tiles


def _one_device_mesh():
  return jax.make_mesh((1,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])


def _run(fn, a, b):
  f = jax.shard_map(fn, mesh=_one_device_mesh(), in_specs=(P("x"), P()), out_specs=P(), check_vma=False)
  return jax.jit(f)(a, b)


@pytest.mark.parametrize("m,k,n", [(128, 128, 256), (200, 96, 130)])  # multiples of the tiles, and not
def test_one_device_matches_gather_then_dot(m, k, n):
  a = jax.random.normal(fresh_key(), (m, k), jnp.float32).astype(jnp.bfloat16)
  b = jax.random.normal(fresh_key(), (k, n), jnp.float32).astype(jnp.bfloat16)
  tiles = Tiles(tile_m=64, tile_n=128, tile_k=64, max_concurrent_steps=2)
  got = _run(lambda a, b: fused_allgather_matmul(a, b, "x", tiles=tiles, num_ctas=3, interpret=True), a, b)
  want = _run(lambda a, b: reference(a, b, "x"), a, b)
  assert got.shape == (m, n) and got.dtype == jnp.bfloat16
  assert rel_err(got.astype(jnp.float32), want.astype(jnp.float32)) < 1e-2


def test_inputs_are_checked_before_anything_runs():
  a = jnp.ones((128, 64), jnp.bfloat16)
  with pytest.raises(PreconditionError, match="bf16 or fp16"):
    _run(lambda a, b: fused_allgather_matmul(a, b, "x"), a, jnp.ones((64, 128), jnp.float32))
  with pytest.raises(PreconditionError, match=r"a \[m, k\] and b \[k, n\]"):
    _run(lambda a, b: fused_allgather_matmul(a, b, "x"), a, jnp.ones((32, 128), jnp.bfloat16))
  with pytest.raises(PreconditionError, match="tile_m=96"):
    _run(lambda a, b: fused_allgather_matmul(a, b, "x", tiles=Tiles(tile_m=96)), a, jnp.ones((64, 128), jnp.bfloat16))


@pytest.mark.parametrize("interpret,message", [(True, "no peer memory"), (False, "the process has 8")])
def test_a_ring_needs_a_gpu_mesh_over_every_device(interpret, message):
  mesh = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:2])
  f = jax.shard_map(lambda a, b: fused_allgather_matmul(a, b, "x", interpret=interpret), mesh=mesh,
                    in_specs=(P("x"), P()), out_specs=P(), check_vma=False)
  with pytest.raises(PreconditionError, match=message):
    jax.jit(f)(jnp.ones((256, 64), jnp.bfloat16), jnp.ones((64, 128), jnp.bfloat16))
