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
  (``plgpu.remote_ref``) changes only ``_store_tile``. It also runs on CPU in
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
from jaxmercury.kernels.registry import Kernel

# Shared memory one CTA may allocate on H100/H200 (227 KiB), less 1 KiB for barriers.
SMEM_BYTES = 227 * 1024 - 1024
# One warpgroup holds at most this many float32 accumulator values in registers (128 per thread).
ACC_VALUES = 128 * 128
HALF_DTYPES = frozenset({np.dtype(jnp.bfloat16), np.dtype(jnp.float16)})


def hopper_only(device) -> str | None:
  """Why ``device`` cannot run a Hopper Mosaic GPU (wgmma) kernel, or None if it can.

  Args:
    device: a ``jax.Device``.

  Returns:
    A sentence naming the device and what it lacks, or ``None``.
  """
  if device.platform != "gpu":
    return f"Mosaic GPU kernels need an NVIDIA Hopper GPU; {device} is a {device.platform} device"
  capability = str(getattr(device, "compute_capability", ""))
  try:
    major, minor = (int(x) for x in capability.split(".")[:2])
  except ValueError:
    return f"Mosaic GPU kernels need an NVIDIA GPU with compute capability 9.x; {device} reports {capability!r}"
  if major < 9:
    return (f"Mosaic GPU needs compute capability 9.0 (Hopper) or newer, "
            f"device {device} ({device.device_kind}) has {major}.{minor}")
  if major > 9:
    return (f"this kernel uses Hopper's wgmma, which compute capability {major}.{minor} "
            f"({device.device_kind}) does not have; it needs 9.x")
  return None


# ------------------------------------------------------------------ mosaic_matmul


@dataclasses.dataclass(frozen=True)
class Tiles:
  """Tile sizes and pipeline depth of ``mosaic_matmul``."""

  tile_m: int = 128
  tile_n: int = 128
  tile_k: int = 64
  max_concurrent_steps: int = 4

  def smem_bytes(self, itemsize: int) -> int:
    """Pipeline buffers (A and B tiles per step) plus the float32 epilogue tile."""
    tm, tn, tk = self.tile_m, self.tile_n, self.tile_k
    return self.max_concurrent_steps * (tm * tk + tk * tn) * itemsize + 4 * tm * tn

  def problem(self, itemsize: int = 2) -> str | None:
    """Why these tiles cannot compile (for 2-byte inputs), or None."""
    tm, tn, tk = self.tile_m, self.tile_n, self.tile_k
    if tm % 64:
      return f"tile_m={tm} must be a multiple of 64 (wgmma's M)"
    if tn % 64 or tn > 256:
      return f"tile_n={tn} must be a multiple of 64 and at most 256 (wgmma's N, 128-byte swizzle)"
    if tk % 64:
      return f"tile_k={tk} must be a multiple of 64 (128-byte swizzle of 2-byte inputs)"
    if self.max_concurrent_steps < 2:
      return f"max_concurrent_steps={self.max_concurrent_steps} must be at least 2"
    if tm * tn > ACC_VALUES:
      return f"tile_m x tile_n = {tm * tn} float32 accumulators exceed one warpgroup's registers ({ACC_VALUES})"
    if self.smem_bytes(itemsize) > SMEM_BYTES:
      return f"needs {self.smem_bytes(itemsize)} bytes of shared memory, more than {SMEM_BYTES}"
    return None

  def divides(self, m: int, n: int, k: int) -> bool:
    return m % self.tile_m == 0 and n % self.tile_n == 0 and k % self.tile_k == 0


def _swizzled(minor: int, dtype):
  """SMEM transforms for a tile whose minor dimension has ``minor`` elements: (8, s) tiles, swizzled."""
  itemsize = jnp.dtype(dtype).itemsize
  swizzle = plgpu.find_swizzle(minor * itemsize * 8)
  return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def _accumulate(acc_ref, a_rows, b_cols, tiles: Tiles, on_step=None):
  """acc += a_rows @ b_cols, streaming k tiles through SMEM; returns the accumulator value.

  ``delay_release=1`` lets one wgmma stay in flight: the pipeline refills a
  step's buffers only after the following step, when ``wgmma_wait(1)`` has
  retired the wgmma that read them. ``on_step(k_index, a_smem)``, if given,
  runs after each step's wgmma is issued (a fused kernel forwards the A tile
  from there); work it starts on ``a_smem`` must finish within one step.
  """
  tm, tn, tk = tiles.tile_m, tiles.tile_n, tiles.tile_k

  def step(indices, a_smem, b_smem):
    plgpu.wgmma(acc_ref, a_smem, b_smem)
    plgpu.wgmma_wait(1)
    if on_step is not None:
      on_step(indices[0], a_smem)

  in_specs = [
      plgpu.BlockSpec((tm, tk), lambda kk: (0, kk), transforms=_swizzled(tk, a_rows.dtype), delay_release=1),
      plgpu.BlockSpec((tk, tn), lambda kk: (kk, 0), transforms=_swizzled(tn, b_cols.dtype), delay_release=1),
  ]
  k_steps = a_rows.shape[1] // tk
  pipeline = plgpu.emit_pipeline(step, grid=(k_steps,), in_specs=in_specs,
                                 max_concurrent_steps=tiles.max_concurrent_steps)
  pipeline(a_rows, b_cols)
  plgpu.wgmma_wait(0)
  return acc_ref[...]


def _store_tile(acc, out_smem, out_tile):
  """Epilogue: registers -> SMEM -> GMEM (TMA), in ``out_smem``'s dtype; ``out_tile`` may be a peer's."""
  out_smem[...] = acc.astype(out_smem.dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(out_smem, out_tile)
  plgpu.wait_smem_to_gmem(0)


def _tile_kernel(a_gmem, b_gmem, out_gmem, out_smem, *, tiles: Tiles):
  """One CTA: the output tile at grid position (m, n)."""
  rows = pl.ds(lax.axis_index("m") * tiles.tile_m, tiles.tile_m)
  cols = pl.ds(lax.axis_index("n") * tiles.tile_n, tiles.tile_n)
  # Register (ACC) and SMEM scratch are scoped separately (interpret mode cannot mix them).
  acc = pl.run_scoped(lambda acc_ref: _accumulate(acc_ref, a_gmem.at[rows, :], b_gmem.at[:, cols], tiles),
                      plgpu.ACC((tiles.tile_m, tiles.tile_n), jnp.float32))
  _store_tile(acc, out_smem, out_gmem.at[rows, cols])


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
  return _gemm(a, b, tiles, interpret)


def _kernel_gemm(a, b, tiles: Tiles, interpret: bool):
  (m, _), n = a.shape, b.shape[1]
  out_smem = plgpu.SMEM((tiles.tile_m, tiles.tile_n), jnp.float32, transforms=_swizzled(tiles.tile_n, jnp.float32))
  kernel = plgpu.kernel(
      functools.partial(_tile_kernel, tiles=tiles),
      out_type=jax.ShapeDtypeStruct((m, n), jnp.float32),
      scratch_types=[out_smem],
      grid=(m // tiles.tile_m, n // tiles.tile_n), grid_names=("m", "n"),
      interpret=plgpu.InterpretGPUParams() if interpret else None)
  return kernel(a, b)


def _gemm_or_dot(a, b, tiles: Tiles, interpret: bool):
  (m, k), n = a.shape, b.shape[1]
  if tiles.divides(m, n, k):
    return _gemm(a, b, tiles, interpret)
  return jnp.dot(a, b, preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _gemm(a, b, tiles: Tiles, interpret: bool):
  return _kernel_gemm(a, b, tiles, interpret)


def _gemm_forward(a, b, tiles, interpret):
  return _kernel_gemm(a, b, tiles, interpret), (a, b)


def _gemm_backward(tiles, interpret, saved, d_out):
  a, b = saved
  d_out = d_out.astype(a.dtype)
  da = _gemm_or_dot(d_out, b.T, tiles, interpret)
  db = _gemm_or_dot(a.T, d_out, tiles, interpret)
  return da.astype(a.dtype), db.astype(b.dtype)


_gemm.defvjp(_gemm_forward, _gemm_backward)


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
  """``a @ b`` through ``hopper_matmul_mgpu.matmul``, widened to float32.

  Its CTA tile is ``tile_m x 2 tile_n`` (two compute warpgroups side by side
  along n); its result is in the input dtype.
  """
  config = hm.TuningConfig(tile_m=tile_m, tile_n=tile_n, tile_k=tile_k, max_concurrent_steps=max_concurrent_steps)
  return hm.matmul(a, b, None, config).astype(jnp.float32)


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class TileConfig:
  """A fused GEMM kernel's tiles and pipeline depth (``Tiles``); any values its ``problem`` accepts."""

  OPEN = True
  tile_m: int = param(128)
  tile_n: int = param(128)
  tile_k: int = param(64)
  max_concurrent_steps: int = param(4)

  def tiles(self) -> Tiles:
    return Tiles(self.tile_m, self.tile_n, self.tile_k, self.max_concurrent_steps)
