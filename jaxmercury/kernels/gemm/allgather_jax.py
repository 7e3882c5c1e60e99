"""``jax_allgather_lhs_matmul``: JAX's own all-gather GEMM (``collective_matmul_mgpu``) as a fused kernel.

A dependency, not our code: a warp-specialized persistent Hopper GEMM that
forwards A's tiles to the left neighbour through NVSHMEM. Shapes are padded
to its CTA tiles (two compute warpgroups side by side along
``wg_dimension``). It keeps no gathered rows, so its backward gathers A again.
"""

from __future__ import annotations

import dataclasses

from jax.experimental.pallas.ops.gpu import collective_matmul_mgpu as cm

from jaxmercury.kernels.config import param
from jaxmercury.kernels.fused_common import gemm_memory, gemm_seconds, hopper_devices
from jaxmercury.kernels.gemm.peer import pad_to, round_up, unpad_row_blocks
from jaxmercury.kernels.mosaic_gpu import ACC_VALUES, SMEM_BYTES
from jaxmercury.kernels.placements import ALLGATHER
from jaxmercury.kernels.registry import DualGemm, FusedKernel


@dataclasses.dataclass(frozen=True, kw_only=True)
class JaxCollectiveConfig:
  """``collective_matmul_mgpu.TuningConfig``'s fields, the enums as ``"M"`` / ``"N"``; its first configuration
  in ``benchmarks/baselines/gemm.py`` (the kernel's own example's space) by default."""

  OPEN = True
  tile_m: int = param(128)
  tile_n: int = param(128)
  tile_k: int = param(64)
  max_concurrent_steps: int = param(4)
  grid_minor_dim: str = param("N")
  grid_tile_width: int = param(8)
  wg_dimension: str = param("N")

  def cta(self) -> tuple[int, int]:
    """The CTA tile: two compute warpgroups side by side along ``wg_dimension``."""
    m_wg = self.wg_dimension == "M"
    return self.tile_m * (2 if m_wg else 1), self.tile_n * (1 if m_wg else 2)


def _problem(p, config: JaxCollectiveConfig) -> str | None:
  for key in ("grid_minor_dim", "wg_dimension"):
    if getattr(config, key) not in ("M", "N"):
      return f"{key}={getattr(config, key)!r} must be 'M' or 'N'"
  for key in ("tile_m", "tile_n", "tile_k", "max_concurrent_steps", "grid_tile_width"):
    v = getattr(config, key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
      return f"{key}={v!r} must be a positive int"
  tm, tn, tk, steps = config.tile_m, config.tile_n, config.tile_k, config.max_concurrent_steps
  if tm % 64 or tn % 64 or tk % 64:
    return f"tile_m={tm}, tile_n={tn} and tile_k={tk} must be multiples of 64 (its 64x64 epilogue, 128-byte swizzle)"
  if steps < 2:
    return f"max_concurrent_steps={steps} must be at least 2"
  if tm * tn > ACC_VALUES:
    return f"tile_m x tile_n = {tm * tn} float32 accumulators exceed one warpgroup's registers ({ACC_VALUES})"
  cta_m, cta_n = config.cta()
  smem = steps * (cta_m * tk + tk * cta_n) * p.itemsize + 2 * 2 * 64 * 64 * p.itemsize
  if smem > SMEM_BYTES:
    return f"needs {smem} bytes of shared memory, more than {SMEM_BYTES}"
  return None


def _tile(config: JaxCollectiveConfig) -> tuple[int, int, int]:
  return (*config.cta(), config.tile_k)


def _devices(p, mesh) -> str | None:
  """JAX's kernel reaches its peer through NVSHMEM, which XLA does not set up for a one-device ring."""
  reason = hopper_devices(True)(p, mesh)
  if reason is None and p.size == 1:
    return (f"jax_allgather_lhs_matmul needs several GPUs on mesh level {p.level!r} (it has 1): XLA sets up the "
            "NVSHMEM it uses only across GPUs (on one GPU: 'UNIMPLEMENTED: NVSHMEM is not supported in XLA')")
  return reason


def _make(p, config: JaxCollectiveConfig, interpret: bool):
  del interpret  # never: the kernel sizes its grid by the device's SM count
  dim = cm.MatmulDimension
  tuning = cm.TuningConfig(tile_m=config.tile_m, tile_n=config.tile_n, tile_k=config.tile_k,
                           max_concurrent_steps=config.max_concurrent_steps,
                           grid_minor_dim=getattr(dim, config.grid_minor_dim),
                           grid_tile_width=config.grid_tile_width, wg_dimension=getattr(dim, config.wg_dimension))
  rows, cols, depth = _tile(config)
  out_dtype = p.c.dtype

  def per_device(a, b, gathered: bool = False):
    (m, k), n = a.shape, b.shape[1]
    mp, kp, np_ = round_up(m, rows), round_up(k, depth), round_up(n, cols)
    out = cm.all_gather_lhs_matmul(pad_to(a, mp, kp), pad_to(b, kp, np_), p.level, config=tuning, dtype=out_dtype)
    out = unpad_row_blocks(out, p.size, m, n)
    return (out, None) if gathered else out  # it keeps no gathered A: the backward gathers it
  return per_device


JAX_ALLGATHER_LHS_MATMUL = FusedKernel(
    name="jax_allgather_lhs_matmul",
    description="JAX's Mosaic GPU kernel (collective_matmul_mgpu.all_gather_lhs_matmul): warp-specialized "
                "persistent GEMM that forwards A's tiles to the left neighbour; shapes padded to its CTA tiles",
    placement=ALLGATHER, config=JaxCollectiveConfig, devices=_devices, problem=_problem, tile=_tile, make=_make,
    backward=DualGemm(dual="fused_matmul_reducescatter_ws", keeps_rows=False), rate_kernel="jax_mosaic_matmul",
    seconds=gemm_seconds, memory=gemm_memory)
