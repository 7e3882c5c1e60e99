"""The GEMM kernels' tiles, and the Mosaic GPU pipeline and epilogue that the kernels written here share.

- ``Tiles`` (one warpgroup per CTA: ``mosaic_matmul`` and the fused ring GEMMs) and ``TileConfig``, a fused
  GEMM kernel's configuration of them;
- ``accumulate``: ``acc += a_rows @ b_cols``, k tiles streamed through SMEM by TMA into wgmma, with a hook
  after each step (a fused kernel forwards the A tile from there);
- ``store_tile``: the epilogue, registers to SMEM to GMEM by TMA (the output may be a peer's);
- ``WsTiles`` and ``WsConfig``: the tiles of JAX's warp-specialized Hopper GEMM body
  (``hopper_matmul_mgpu.kernel``: two consumer warpgroups), which the ``_ws`` ring GEMMs run.
"""

from __future__ import annotations

import dataclasses

import jax.experimental.pallas.mosaic_gpu as plgpu
from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

from jaxmercury.kernels.config import param
from jaxmercury.kernels.mosaic_gpu import ACC_VALUES, SMEM_BYTES, swizzled


@dataclasses.dataclass(frozen=True)
class Tiles:
  """Tile sizes and pipeline depth of a GEMM kernel with one warpgroup per CTA (``mosaic_matmul``, the fused
  ring GEMMs)."""

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


def accumulate(acc_ref, a_rows, b_cols, tiles: Tiles, on_step=None):
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
      plgpu.BlockSpec((tm, tk), lambda kk: (0, kk), transforms=swizzled(tk, a_rows.dtype), delay_release=1),
      plgpu.BlockSpec((tk, tn), lambda kk: (kk, 0), transforms=swizzled(tn, b_cols.dtype), delay_release=1),
  ]
  k_steps = a_rows.shape[1] // tk
  pipeline = plgpu.emit_pipeline(step, grid=(k_steps,), in_specs=in_specs,
                                 max_concurrent_steps=tiles.max_concurrent_steps)
  pipeline(a_rows, b_cols)
  plgpu.wgmma_wait(0)
  return acc_ref[...]


def store_tile(acc, out_smem, out_tile):
  """Epilogue: registers -> SMEM -> GMEM (TMA), in ``out_smem``'s dtype; ``out_tile`` may be a peer's."""
  out_smem[...] = acc.astype(out_smem.dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(out_smem, out_tile)
  plgpu.wait_smem_to_gmem(0)


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


@dataclasses.dataclass(frozen=True)
class WsTiles:
  """One consumer warpgroup's ``tile_m x tile_n``; the CTA's tile is twice that along ``split``."""

  tile_m: int = 128
  tile_n: int = 128
  tile_k: int = 64
  max_concurrent_steps: int = 3
  split: str = "n"  # the dimension the two consumer warpgroups split: "n" or "m"
  grid_minor: str = "n"  # the persistent loop's output-tile order: the fastest-moving dimension, "n" or "m"
  grid_width: int = 1  # ... in bands this many tiles wide (L2 reuse)

  @property
  def cta(self) -> tuple[int, int]:
    return (2 * self.tile_m, self.tile_n) if self.split == "m" else (self.tile_m, 2 * self.tile_n)

  def smem_bytes(self, itemsize: int = 2, out_itemsize: int = 4) -> int:
    """Pipeline buffers plus the epilogue (two warpgroups x two 64 x 64 slots of the output's dtype)."""
    cm, cn = self.cta
    return self.max_concurrent_steps * (cm + cn) * self.tile_k * itemsize + 2 * 2 * 64 * 64 * out_itemsize

  def problem(self, out_itemsize: int = 4) -> str | None:
    """Why these tiles cannot compile (with an output of ``out_itemsize`` bytes; float32 here), or None."""
    for name in ("split", "grid_minor"):
      if getattr(self, name) not in ("m", "n"):
        return f"{name}={getattr(self, name)!r} must be 'm' or 'n'"
    if self.grid_width < 1:
      return f"grid_width={self.grid_width} must be at least 1"
    if self.tile_m % 64 or self.tile_n % 64 or self.tile_k % 64:
      return f"tile_m={self.tile_m}, tile_n={self.tile_n}, tile_k={self.tile_k} must be multiples of 64"
    if self.tile_m * self.tile_n > 128 * 128:
      return f"tile_m x tile_n = {self.tile_m * self.tile_n} float32 accumulators exceed one warpgroup's registers"
    if self.max_concurrent_steps < 2:
      return f"max_concurrent_steps={self.max_concurrent_steps} must be at least 2"
    if self.smem_bytes(out_itemsize=out_itemsize) > SMEM_BYTES:
      return f"needs {self.smem_bytes(out_itemsize=out_itemsize)} bytes of shared memory, more than {SMEM_BYTES}"
    return None

  def config(self):
    return hm.TuningConfig(tile_m=self.tile_m, tile_n=self.tile_n, tile_k=self.tile_k,
                           max_concurrent_steps=self.max_concurrent_steps, epi_tile_m=64, epi_tile_n=64,
                           wg_dimension=_dimension(self.split), grid_minor_dim=_dimension(self.grid_minor),
                           grid_tile_width=self.grid_width)


def _dimension(name: str):
  return hm.MatmulDimension.M if name == "m" else hm.MatmulDimension.N


@dataclasses.dataclass(frozen=True, kw_only=True)
class WsConfig:
  """One consumer warpgroup's tiles, the pipeline depth and the dimension the two consumers split (``WsTiles``)."""

  OPEN = True
  tile_m: int = param(128)
  tile_n: int = param(128)
  tile_k: int = param(64)
  max_concurrent_steps: int = param(3)
  split: str = param("n")

  def tiles(self) -> WsTiles:
    return WsTiles(**dataclasses.asdict(self))


def ws_problem(config, out_itemsize: int) -> str | None:
  """Whether a warp-specialized kernel's configuration compiles with an output of ``out_itemsize`` bytes."""
  for key, v in dataclasses.asdict(config).items():
    if key not in ("split", "grid_minor") and (not isinstance(v, int) or isinstance(v, bool)):
      return f"{key}={v!r} must be an int"
  return config.tiles().problem(out_itemsize)


def ws_tile(config) -> tuple[int, int, int]:
  """The CTA tile (twice a warpgroup's along ``split``) and ``tile_k``."""
  return (*config.tiles().cta, config.tile_k)
