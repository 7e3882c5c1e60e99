"""The warp-specialized fused GEMM + reduce-scatter: its input checks, and its ring's lowering to Mosaic GPU
for 1 and 8 devices (no GPU needed). It runs in tests/gpu/test_fused_matmul_reducescatter.py."""

import jax
import jax.numpy as jnp
import pytest
from conftest import h100_mesh, lower_for_gpus, mosaic_kernels
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmercury.errors import PreconditionError
from jaxmercury.kernels.gemm.reducescatter_ws import fused_matmul_reducescatter_ws
from jaxmercury.kernels.gemm.tiles import WsTiles

SPECS = dict(in_specs=(P(None, "x"), P("x", None)), out_specs=P("x", None), check_vma=False)
# The GPU test's and the benchmark's variants.
WS_TILES = [WsTiles(128, 128, 64, 3), WsTiles(128, 64, 64, 4), WsTiles(64, 128, 64, 4, "m")]


def _run(fn, x, w, devices=1):
  mesh = jax.make_mesh((devices,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:devices])
  return jax.jit(jax.shard_map(fn, mesh=mesh, **SPECS))(x, w)


def test_inputs_and_tiles_are_checked_before_anything_runs():
  x = jnp.ones((256, 128), jnp.bfloat16)
  with pytest.raises(PreconditionError, match="bf16 or fp16"):
    _run(lambda x, w: fused_matmul_reducescatter_ws(x, w, "x"), x, jnp.ones((128, 128), jnp.float32))
  with pytest.raises(PreconditionError, match=r"x \[m, k\] and w \[k, n\]"):
    _run(lambda x, w: fused_matmul_reducescatter_ws(x, w, "x"), x, jnp.ones((64, 128), jnp.bfloat16))
  with pytest.raises(PreconditionError, match="shared memory"):
    _run(lambda x, w: fused_matmul_reducescatter_ws(x, w, "x", tiles=WsTiles(128, 128, 64, 4)), x,
         jnp.ones((128, 128), jnp.bfloat16))
  with pytest.raises(PreconditionError, match="split='k'"):
    _run(lambda x, w: fused_matmul_reducescatter_ws(x, w, "x", tiles=WsTiles(split="k")), x,
         jnp.ones((128, 128), jnp.bfloat16))
  with pytest.raises(PreconditionError, match=r"129 rows, which axis 'x' \(2 devices\)"):
    _run(lambda x, w: fused_matmul_reducescatter_ws(x, w, "x"), jnp.ones((129, 128), jnp.bfloat16),
         jnp.ones((128, 128), jnp.bfloat16), devices=2)


SHAPES = {"tiled": (2048, 512, 512), "ragged": (8 * 200, 1000, 600)}


# Pairwise over the devices, the tiles and the shape (each pair once, not their product).
PAIRS = ((1, 0, "tiled"), (8, 0, "ragged"), (1, 1, "ragged"), (8, 1, "tiled"), (8, 2, "tiled"), (1, 2, "ragged"))


@pytest.mark.parametrize("devices,tiles,shape", [(d, WS_TILES[t], SHAPES[s]) for d, t, s in PAIRS],
                         ids=[f"{d}-{WS_TILES[t]}-{s}" for d, t, s in PAIRS])
def test_the_ring_lowers_for_h100s(shape, tiles, devices):
  """The ring (remote epilogue stores, per-step semaphores, two consumer warpgroups) lowers to Mosaic GPU.

  Lowering for an abstract H100 checks layouts and shared memory; it is no
  CUDA compile and no run.
  """
  m, k, n = shape
  mesh = h100_mesh(devices)
  spec = lambda shape, p: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, p))
  f = jax.shard_map(lambda x, w: fused_matmul_reducescatter_ws(x, w, "x", tiles=tiles), mesh=mesh, **SPECS)
  text = lower_for_gpus(f, spec((m, devices * k), P(None, "x")), spec((devices * k, n), P("x", None)), mesh=mesh)
  assert mosaic_kernels(text) == 1
