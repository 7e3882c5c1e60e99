"""The all-gather GEMM with dedicated communication CTAs: one device in Mosaic GPU interpret mode, its input
checks, and its ring's lowering to Mosaic GPU for 8 abstract H100s (no GPU needed).

Peer stores and remote semaphores have no interpreter; the ring runs in
tests/gpu/test_fused_allgather_matmul_comm.py. The loopback ring here
(``_kernel(..., loopback=True)``) sends every chunk into the device's own
``received`` and computes the later steps from there.
"""

import jax
import jax.numpy as jnp
import pytest
from conftest import fresh_key, h100_mesh, lower_for_gpus, mosaic_kernels, rel_err
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmercury.errors import PreconditionError
from jaxmercury.kernels.gemm.allgather import reference
from jaxmercury.kernels.gemm.allgather_comm import _kernel, fused_allgather_matmul_comm
from jaxmercury.kernels.gemm.peer import round_up
from jaxmercury.kernels.gemm.tiles import Tiles

SMALL = Tiles(tile_m=64, tile_n=128, tile_k=64, max_concurrent_steps=2)  # fewer interpreted steps
SPECS = dict(in_specs=(P("x", None), P(None, "x")), out_specs=P(None, "x"), check_vma=False)


def _run(fn, a, b, devices=1):
  mesh = jax.make_mesh((devices,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:devices])
  return jax.jit(jax.shard_map(fn, mesh=mesh, **SPECS))(a, b)


@pytest.mark.parametrize("m,k,n", [(128, 128, 256), (200, 96, 130)])  # multiples of the tiles, and not
def test_one_device_matches_gather_then_dot(m, k, n):
  a = jax.random.normal(fresh_key(), (m, k), jnp.float32).astype(jnp.bfloat16)
  b = jax.random.normal(fresh_key(), (k, n), jnp.float32).astype(jnp.bfloat16)
  got = _run(lambda a, b: fused_allgather_matmul_comm(a, b, "x", tiles=SMALL, num_ctas=3, interpret=True), a, b)
  want = _run(lambda a, b: reference(a, b, "x"), a, b)
  assert got.shape == (m, n) and got.dtype == jnp.bfloat16
  assert rel_err(got.astype(jnp.float32), want.astype(jnp.float32)) < 1e-2


@pytest.mark.parametrize("comm_ctas,chunk_rows", [(2, 128), (1, 64)], ids=["2-comm-ctas", "1-comm-cta"])
def test_the_forwarding_path_in_a_loopback_ring(comm_ctas, chunk_rows):
  """Three ring steps on one device: the communication CTAs store every chunk into this device's own
  ``received`` and the compute CTAs read steps 1 and 2 from there (unwritten rows would be NaN, the
  interpreter's uninitialised memory), so every row block of the result is ``a @ b``."""
  n, (m, k, cols) = 3, (256, 128, 256)
  a = jax.random.normal(fresh_key(), (m, k), jnp.float32).astype(jnp.bfloat16)
  b = jax.random.normal(fresh_key(), (k, cols), jnp.float32).astype(jnp.bfloat16)
  got = _run(lambda a, b: _kernel(a, b, "x", n, SMALL, jnp.dtype(jnp.bfloat16), comm_ctas + 3, comm_ctas,
                                  chunk_rows, True, loopback=True)[0], a, b)
  want = jnp.tile(jnp.dot(a, b, preferred_element_type=jnp.float32), (n, 1))
  assert got.shape == (n * m, cols)
  assert jnp.all(jnp.isfinite(got.astype(jnp.float32)))
  assert rel_err(got.astype(jnp.float32), want) < 1e-2


def test_inputs_and_counts_are_checked_before_anything_runs():
  a, b = jnp.ones((128, 64), jnp.bfloat16), jnp.ones((64, 128), jnp.bfloat16)
  with pytest.raises(PreconditionError, match="bf16 or fp16"):
    _run(lambda a, b: fused_allgather_matmul_comm(a, b, "x"), a, jnp.ones((64, 128), jnp.float32))
  with pytest.raises(PreconditionError, match=r"a \[m, k\] and b \[k, n\]"):
    _run(lambda a, b: fused_allgather_matmul_comm(a, b, "x"), a, jnp.ones((32, 128), jnp.bfloat16))
  with pytest.raises(PreconditionError, match="tile_m=96"):
    _run(lambda a, b: fused_allgather_matmul_comm(a, b, "x", tiles=Tiles(tile_m=96)), a, b)
  with pytest.raises(PreconditionError, match="comm_ctas=0 must be a positive int"):
    _run(lambda a, b: fused_allgather_matmul_comm(a, b, "x", comm_ctas=0, interpret=True), a, b)
  with pytest.raises(PreconditionError, match="chunk_rows=96 must be a multiple of tile_m=64"):
    _run(lambda a, b: fused_allgather_matmul_comm(a, b, "x", tiles=SMALL, chunk_rows=96, interpret=True), a, b)
  with pytest.raises(PreconditionError, match=r"chunk_rows=256 .* dividing the rows padded to the tiles \(128\)"):
    _run(lambda a, b: fused_allgather_matmul_comm(a, b, "x", tiles=SMALL, chunk_rows=256, interpret=True), a, b)


@pytest.mark.parametrize("interpret,message", [(True, "no peer memory"), (False, "the process has 8")])
def test_a_ring_needs_a_gpu_mesh_over_every_device(interpret, message):
  fn = lambda a, b: fused_allgather_matmul_comm(a, b, "x", interpret=interpret)
  with pytest.raises(PreconditionError, match=message):
    _run(fn, jnp.ones((256, 64), jnp.bfloat16), jnp.ones((64, 256), jnp.bfloat16), devices=2)


def _lower(m, k, n, devices=8, **kwargs):
  mesh = h100_mesh(devices)
  spec = lambda shape, p: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, p))
  f = jax.shard_map(lambda a, b: fused_allgather_matmul_comm(a, b, "x", **kwargs), mesh=mesh, **SPECS)
  return lower_for_gpus(f, spec((m, k), P("x", None)), spec((k, n), P(None, "x")), mesh=mesh)


# Each tile variant once, each shape at least once.
@pytest.mark.parametrize("shape,tiles,chunk_rows", [((8 * 512, 1024, 8 * 256), Tiles(), None),
                                                    ((8 * 200, 1000, 8 * 75), Tiles(64, 256, 64, 4), 128),
                                                    ((8 * 512, 1024, 8 * 256), Tiles(256, 64, 64, 2), None)],
                         ids=["tiled-128x128", "ragged-64x256", "tiled-256x64"])
def test_the_ring_lowers_for_eight_h100s(shape, tiles, chunk_rows):
  """Communication CTAs (TMA through SMEM into the peer, per-chunk semaphores) and compute CTAs lower to one
  Mosaic GPU kernel; lowering for an abstract H100 checks layouts and shared memory, it is no CUDA compile."""
  assert chunk_rows is None or round_up(shape[0] // 8, tiles.tile_m) % chunk_rows == 0
  assert mosaic_kernels(_lower(*shape, tiles=tiles, chunk_rows=chunk_rows)) == 1


def test_the_grid_must_leave_compute_ctas():
  with pytest.raises(PreconditionError, match="comm_ctas=132 must be less than the grid's 132 CTAs"):
    _lower(8 * 256, 256, 8 * 128, comm_ctas=132)
  with pytest.raises(PreconditionError, match="num_ctas=200 exceeds the device's 132 SMs"):
    _lower(8 * 256, 256, 8 * 128, num_ctas=200)
  assert mosaic_kernels(_lower(8 * 256, 256, 8 * 128, comm_ctas=1, num_ctas=2)) == 1


def test_the_fused_lowering_runs_interpreted_on_one_device_and_checks_comm_ctas():
  import numpy as np

  import jaxmercury as jm
  mesh = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])
  prog = jm.programs.matmul(72, 136, 40, dtype=jnp.bfloat16)  # ragged: padded to the tiles
  s = jm.library(prog, mesh)["async_tp"].lower_with("fused_allgather_matmul_comm", tile_m=64,
                                                    max_concurrent_steps=2, comm_ctas=2)
  assert "lowered with fused_allgather_matmul_comm(tile_m=64, max_concurrent_steps=2, comm_ctas=2) " \
         "(Mosaic GPU interpret mode)" in str(s)
  a, b = prog.random_inputs(fresh_key())
  f = s.compile()
  y = f(a, b)
  assert y.shape == prog.writes.shape and y.dtype == jnp.bfloat16
  assert rel_err(y.astype(jnp.float32), jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32))) < 2e-2
  assert "wgmma" in str(jax.make_jaxpr(f)(a, b))  # the Mosaic GPU kernel ran, not the nest
  cot = jax.random.normal(fresh_key(), prog.writes.shape, jnp.float32).astype(jnp.bfloat16)
  _, vjp = jax.vjp(f, a, b)
  _, vjp_plain = jax.vjp(jm.library(prog, mesh)["async_tp"].compile(), a, b)
  for got, want in zip(vjp(cot), vjp_plain(cot)):  # the same products, summed in another order: within 1 bf16 ulp
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2**-7, atol=1e-3)
  with pytest.raises(PreconditionError, match="comm_ctas=0 must be a positive int"):
    jm.library(prog, mesh)["async_tp"].lower_with("fused_allgather_matmul_comm", comm_ctas=0)
  with pytest.raises(PreconditionError, match="chunk_tiles=0 must be a positive int"):
    jm.library(prog, mesh)["async_tp"].lower_with("fused_allgather_matmul_comm", chunk_tiles=0)


def test_the_fused_lowering_pads_rows_to_whole_chunks():
  """chunk_tiles: chunks of several tiles of rows; the schedule pads each device's rows to whole chunks."""
  import jaxmercury as jm
  mesh = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])
  prog = jm.programs.matmul(72, 136, 40, dtype=jnp.bfloat16)  # 72 rows: two chunks of 2 x 64 rows would not fit
  s = jm.library(prog, mesh)["async_tp"].lower_with("fused_allgather_matmul_comm", tile_m=64, chunk_tiles=2,
                                                    max_concurrent_steps=2, comm_ctas=1)
  a, b = prog.random_inputs(fresh_key())
  y = s.compile()(a, b)
  assert rel_err(y.astype(jnp.float32), jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32))) < 2e-2
