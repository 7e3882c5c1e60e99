"""GEMM blocks through Pallas Mosaic GPU kernels (Hopper, bf16/fp16).

Two kernels for the ``"matmul"`` pattern (blocks ``a [m, k]``, ``b [k, n]``,
result ``float32 [m, n]``):

- ``mosaic_matmul``: written here. One CTA per output tile, one warpgroup per
  CTA. Per tile, ``plgpu.emit_pipeline`` streams ``A[tile_m, tile_k]`` and
  ``B[tile_k, tile_n]`` tiles from GMEM to SMEM by TMA, up to
  ``max_concurrent_steps`` steps ahead of the tensor cores; ``wgmma``
  accumulates into a float32 register accumulator; the epilogue stores it
  through SMEM to GMEM by TMA. The epilogue is the hook for fused
  communication: a kernel that stores its tile to a peer's memory
  (``plgpu.remote_ref``) changes only ``tiles.store_tile``. It also runs on CPU in
  Mosaic GPU interpret mode (``make(program, interpret=True)``), on one
  device at a time: JAX 0.11.2's interpreter races when several simulated
  devices run kernels at once (each kernel's end checks that no device still
  holds a barrier), so the registry does not offer it on CPU meshes.
- ``jax_mosaic_matmul``: JAX's own warp-specialized, persistent Hopper GEMM
  (``jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu``), as a dependency.
  It writes its result in the input dtype, widened here to float32.

Blocks whose shape is not a multiple of the tiles use the program's XLA body.
Both use Hopper's ``wgmma``: compute capability 9.x only (Blackwell has
``tcgen05`` instead).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

from jaxmercury.errors import PreconditionError
from jaxmercury.kernels.config import param
from jaxmercury.kernels.gemm.tiles import Tiles, accumulate, store_tile
from jaxmercury.kernels.mosaic_gpu import HALF_DTYPES, SMEM_BYTES, hopper_only, swizzled
from jaxmercury.kernels.registry import Kernel

# ------------------------------------------------------------------ mosaic_matmul


def _tile_kernel(a_gmem, b_gmem, out_gmem, out_smem, *, tiles: Tiles):
  """One CTA: the output tile at grid position (m, n)."""
  rows = pl.ds(lax.axis_index("m") * tiles.tile_m, tiles.tile_m)
  cols = pl.ds(lax.axis_index("n") * tiles.tile_n, tiles.tile_n)
  # Register (ACC) and SMEM scratch are scoped separately (interpret mode cannot mix them).
  acc = pl.run_scoped(lambda acc_ref: accumulate(acc_ref, a_gmem.at[rows, :], b_gmem.at[:, cols], tiles),
                      plgpu.ACC((tiles.tile_m, tiles.tile_n), jnp.float32))
  store_tile(acc, out_smem, out_gmem.at[rows, cols])


def mosaic_gemm(a, b, tiles: Tiles = Tiles(), *, interpret: bool = False):
  """``a @ b`` in float32 through the Mosaic GPU kernel, differentiable: its backward's two GEMMs
  (``dC b^T`` and ``a^T dC``) run through the kernel too where the tiles divide them, through XLA otherwise.

  Args:
    a: [m, k] bf16 or fp16.
    b: [k, n], same dtype.
    tiles: tile sizes; ``m``, ``n``, ``k`` must be multiples of them.
    interpret: run in Mosaic GPU interpret mode (CPU).

  Returns:
    [m, n] float32.
  """
  (m, k), n = a.shape, b.shape[1]
  if not tiles.divides(m, n, k):
    raise ValueError(f"mosaic_gemm: shape m={m} n={n} k={k} is not a multiple of {tiles}")
  kernel = functools.partial(_kernel_gemm, tiles=tiles, interpret=interpret)
  return differentiable(kernel, tiles.divides)(a, b)


def _kernel_gemm(a, b, *, tiles: Tiles, interpret: bool):
  (m, _), n = a.shape, b.shape[1]
  out_smem = plgpu.SMEM((tiles.tile_m, tiles.tile_n), jnp.float32, transforms=swizzled(tiles.tile_n, jnp.float32))
  kernel = plgpu.kernel(
      functools.partial(_tile_kernel, tiles=tiles),
      out_type=jax.ShapeDtypeStruct((m, n), jnp.float32),
      scratch_types=[out_smem],
      grid=(m // tiles.tile_m, n // tiles.tile_n), grid_names=("m", "n"),
      interpret=plgpu.InterpretGPUParams() if interpret else None)
  return kernel(a, b)


def differentiable(kernel, divides):
  """``kernel`` (``kernel(a, b) -> [m, n] float32``) with a custom VJP whose two GEMMs, ``dC b^T`` and ``a^T dC``,
  run through ``kernel`` where ``divides(m, n, k)`` holds for them and through XLA otherwise (Mosaic GPU kernels
  have no differentiation rule of their own)."""

  def through(a, b):
    (m, k), n = a.shape, b.shape[1]
    return gemm(a, b) if divides(m, n, k) else jnp.dot(a, b, preferred_element_type=jnp.float32)

  @jax.custom_vjp
  def gemm(a, b):
    return kernel(a, b)

  def backward(saved, d_out):
    a, b = saved
    d_out = d_out.astype(a.dtype)
    return through(d_out, b.T).astype(a.dtype), through(a.T, d_out).astype(b.dtype)

  gemm.defvjp(lambda a, b: (kernel(a, b), (a, b)), backward)
  return gemm


def mosaic_matmul_block(ctx, a, b, *, tiles: Tiles, interpret: bool, fallback):
  """One matmul block (the program body's contract) through ``mosaic_gemm``, else ``fallback``."""
  (m, k), n = a.shape, b.shape[1]
  if not tiles.divides(m, n, k):
    return fallback(ctx, a, b)
  return mosaic_gemm(a, b, tiles, interpret=interpret)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicMatmulConfig:
  """``mosaic_matmul``'s tiles and pipeline depth (``Tiles``), with the tuner's choices."""

  tile_m: int = param(128, 64)
  tile_n: int = param(128, 256)
  tile_k: int = param(64, 128)
  max_concurrent_steps: int = param(4, 2)

  def tiles(self) -> Tiles:
    return Tiles(self.tile_m, self.tile_n, self.tile_k, self.max_concurrent_steps)


def _make(program, config: MosaicMatmulConfig, interpret: bool):
  tiles = config.tiles()
  itemsize = np.dtype(program.reads[0].dtype).itemsize
  if reason := tiles.problem(itemsize):
    raise PreconditionError(f"mosaic_matmul with {config}: {reason}")
  return functools.partial(mosaic_matmul_block, tiles=tiles, interpret=interpret, fallback=program.body)


# interpret=False: interpret mode is right on one device, but fails at random on the
# several-device CPU meshes that the registry's interpret mode serves (see the module docstring).
MOSAIC_MATMUL = Kernel(
    name="mosaic_matmul", patterns=frozenset({"matmul"}), make=_make, config=MosaicMatmulConfig,
    dtypes=HALF_DTYPES, platforms=frozenset({"gpu"}), supports=hopper_only, interpret=False,
    workspace=lambda program, sizes, config: 0,
    description="one warpgroup per output tile, TMA pipeline into wgmma (written here)")


# ------------------------------------------------------------------ jax_mosaic_matmul


def jax_gemm(a, b, *, tile_m: int, tile_n: int, tile_k: int, max_concurrent_steps: int):
  """``a @ b`` through ``hopper_matmul_mgpu.matmul``, widened to float32, differentiable (``differentiable``).

  Its CTA tile is ``tile_m x 2 tile_n`` (two compute warpgroups side by side
  along n); its result is in the input dtype.
  """
  params = dict(tile_m=tile_m, tile_n=tile_n, tile_k=tile_k, max_concurrent_steps=max_concurrent_steps)
  config = hm.TuningConfig(**params)
  kernel = lambda a, b: hm.matmul(a, b, None, config).astype(jnp.float32)
  return differentiable(kernel, lambda m, n, k: _jax_divides(m, n, k, params))(a, b)


def _jax_divides(m, n, k, params) -> bool:
  return m % params["tile_m"] == 0 and n % (2 * params["tile_n"]) == 0 and k % params["tile_k"] == 0


def jax_matmul_block(ctx, a, b, *, params: dict, fallback):
  """One matmul block through JAX's Hopper GEMM, else ``fallback``."""
  (m, k), n = a.shape, b.shape[1]
  if not _jax_divides(m, n, k, params):
    return fallback(ctx, a, b)
  return jax_gemm(a, b, **params)


@dataclasses.dataclass(frozen=True, kw_only=True)
class JaxMatmulConfig:
  """``hopper_matmul_mgpu``'s tiles and pipeline depth, with the tuner's choices."""

  tile_m: int = param(128, 64)
  tile_n: int = param(128, 64)
  tile_k: int = param(64)
  max_concurrent_steps: int = param(4, 2)

  def smem_bytes(self, itemsize: int = 2) -> int:
    """Pipeline buffers (A tile, two B tiles per step) plus two warpgroups' double-buffered 64x64 epilogue."""
    return (self.max_concurrent_steps * (self.tile_m * self.tile_k + 2 * self.tile_k * self.tile_n) * itemsize
            + 2 * 2 * 64 * 64 * itemsize)


def _make_jax(program, config: JaxMatmulConfig, interpret: bool):
  del interpret  # never (interpret=False): hopper_matmul_mgpu sizes its grid by the device's core_count
  if config.smem_bytes() > SMEM_BYTES:
    raise PreconditionError(f"jax_mosaic_matmul with {config}: needs {config.smem_bytes()} bytes of shared memory, "
                            f"more than {SMEM_BYTES}")
  return functools.partial(jax_matmul_block, params=dataclasses.asdict(config), fallback=program.body)


JAX_MOSAIC_MATMUL = Kernel(
    name="jax_mosaic_matmul", patterns=frozenset({"matmul"}), make=_make_jax, config=JaxMatmulConfig,
    dtypes=HALF_DTYPES, platforms=frozenset({"gpu"}), supports=hopper_only, interpret=False,
    workspace=lambda program, sizes, config: 2 * sizes["m"] * sizes["n"],
    description="JAX's warp-specialized persistent Hopper GEMM (hopper_matmul_mgpu)")
