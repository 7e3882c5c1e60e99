"""The warp-specialized fused all-gather GEMM: its input checks, and its ring's lowering to Mosaic GPU for 1 and
8 devices (no GPU needed). It runs in tests/gpu/test_fused_allgather_matmul.py."""

import jax
import jax.numpy as jnp
import pytest
from conftest import h100_mesh, lower_for_gpus, mosaic_kernels
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmercury.errors import PreconditionError
from jaxmercury.kernels.gemm.allgather_ws import fused_allgather_matmul_ws
from jaxmercury.kernels.gemm.tiles import WsTiles

SPECS = dict(in_specs=(P("x", None), P(None, "x")), out_specs=P(None, "x"), check_vma=False)
WS_TILES = [WsTiles(128, 128, 64, 4), WsTiles(128, 64, 64, 4), WsTiles(64, 128, 64, 4, "m")]


def _run(a, b, devices=1, **kwargs):
  mesh = jax.make_mesh((devices,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:devices])
  fn = jax.shard_map(lambda a, b: fused_allgather_matmul_ws(a, b, "x", **kwargs), mesh=mesh, **SPECS)
  return jax.jit(fn)(a, b)


def test_inputs_and_tiles_are_checked_before_anything_runs():
  a = jnp.ones((256, 128), jnp.bfloat16)
  with pytest.raises(PreconditionError, match="bf16 or fp16"):
    _run(a, jnp.ones((128, 128), jnp.float32))
  with pytest.raises(PreconditionError, match=r"a \[m, k\] and b \[k, n\]"):
    _run(a, jnp.ones((64, 128), jnp.bfloat16))
  with pytest.raises(PreconditionError, match="shared memory"):
    _run(a, jnp.ones((128, 128), jnp.bfloat16), tiles=WsTiles(128, 128, 64, 5))
  with pytest.raises(PreconditionError, match="split='k'"):
    _run(a, jnp.ones((128, 128), jnp.bfloat16), tiles=WsTiles(split="k"))
  with pytest.raises(PreconditionError, match="every device of the process|Mosaic GPU addresses peers"):
    _run(jnp.ones((512, 128), jnp.bfloat16), jnp.ones((128, 256), jnp.bfloat16), devices=2)


SHAPES = {"tiled": (8 * 256, 512, 8 * 256), "ragged": (8 * 200, 1000, 8 * 75)}


# Pairwise over the devices, the tiles and the shape (each pair once, not their product).
PAIRS = ((1, 0, "tiled"), (8, 0, "ragged"), (1, 1, "ragged"), (8, 1, "tiled"), (8, 2, "tiled"), (1, 2, "ragged"))


@pytest.mark.parametrize("devices,tiles,shape", [(d, WS_TILES[t], SHAPES[s]) for d, t, s in PAIRS],
                         ids=[f"{d}-{WS_TILES[t]}-{s}" for d, t, s in PAIRS])
def test_the_ring_lowers_for_h100s(shape, tiles, devices):
  """The ring (A tiles stored from the pipeline's SMEM into the peer, per-step semaphores, two consumer
  warpgroups) lowers to Mosaic GPU.

  Lowering for an abstract H100 checks layouts and shared memory; it is no
  CUDA compile and no run.
  """
  m, k, n = shape
  mesh = h100_mesh(devices)
  spec = lambda shape, p: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, p))
  f = jax.shard_map(lambda a, b: fused_allgather_matmul_ws(a, b, "x", tiles=tiles), mesh=mesh, **SPECS)
  text = lower_for_gpus(f, spec((m, k), P("x", None)), spec((k, n), P(None, "x")), mesh=mesh)
  assert mosaic_kernels(text) == 1
