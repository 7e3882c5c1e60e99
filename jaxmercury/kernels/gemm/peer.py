"""What the fused GEMM kernels that store into peer GPUs share: argument checks and padding to tiles."""

from __future__ import annotations

import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from jaxmercury.errors import PreconditionError
from jaxmercury.kernels.gemm.tiles import Tiles
from jaxmercury.kernels.mosaic_gpu import ring_size


def round_up(x: int, multiple: int) -> int:
  return -(-x // multiple) * multiple


def pad_to(x, rows: int, cols: int):
  """``x`` padded with zeros at the end to ``[rows, cols]``."""
  return x if x.shape == (rows, cols) else jnp.pad(x, ((0, rows - x.shape[0]), (0, cols - x.shape[1])))


def check_operands(kernel: str, a, b, axis_name: str, tiles: Tiles | None, interpret: bool,
                   names: tuple[str, str] = ("a", "b")) -> int:
  """Raises ``PreconditionError`` naming what ``kernel`` cannot take; returns the axis's device count.

  ``a [m, k]`` and ``b [k, n]`` must both be bf16 or fp16, the tiles must
  compile (``None``: the caller checks its own), interpret mode runs one device only, and the axis must span the
  process's devices (Mosaic GPU addresses peers by their index in the whole
  mesh). ``names`` are the operands' names in the messages. Call inside ``shard_map``.
  """
  if a.dtype != b.dtype or a.dtype not in (jnp.bfloat16, jnp.float16):
    raise PreconditionError(f"{kernel}: {names[0]} and {names[1]} must both be bf16 or fp16, got {a.dtype}, {b.dtype}")
  if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
    raise PreconditionError(f"{kernel}: {names[0]} [m, k] and {names[1]} [k, n] expected, got {a.shape}, {b.shape}")
  if tiles is not None and (reason := tiles.problem(a.dtype.itemsize)):
    raise PreconditionError(f"{kernel}: {reason}")
  return ring_size(kernel, axis_name, interpret)


def warp_specialized_kernel(body, out_type, grid: int, *operands):
  """``body`` run on the grid JAX's warp-specialized Hopper GEMM body (``hopper_matmul_mgpu.kernel``) expects:
  ``grid`` persistent CTAs (one per SM) along ``"cluster_grid"``, clusters of one, three warpgroups along
  ``"wg"`` (two consumers, one producer) and warpgroup lowering; returns the kernel's outputs (a list)."""
  return plgpu.kernel(
      body, out_type=out_type, grid=(grid,), grid_names=("cluster_grid",), cluster=(1,),
      cluster_names=("cluster",), num_threads=3, thread_name="wg",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))(*operands)


def unpad_row_blocks(out, n_dev: int, m: int, n: int):
  """An all-gather GEMM's ``[n_dev * mp, np]`` result, each device's row block padded to the tiles, cropped to
  ``[n_dev * m, n]``."""
  mp, np_ = out.shape[0] // n_dev, out.shape[1]
  if (mp, np_) == (m, n):
    return out
  return out.reshape(n_dev, mp, np_)[:, :m, :n].reshape(n_dev * m, n)


def gathered_rows(a, received, axis_name: str):
  """``all_gather(a, axis_name, rows)``, read from an all-gather kernel's ring slots: nothing moves again.

  Args:
    a: this device's row shard ``[m, k]``.
    received: the kernel's receive buffer ``[n - 1, mp, kp]`` (padded): on
      device ``r``, slot ``s`` holds the rows of device ``(r + s + 1) % n``,
      which the ring brought for step ``s + 1``; None on one device.
    axis_name: the ring's ``shard_map`` axis.
  """
  if received is None:
    return a
  m, k = a.shape
  slots = jnp.concatenate([a[None], received[:, :m, :k]])  # slot s: the rows of device (r + s) % n
  return jnp.roll(slots, lax.axis_index(axis_name), axis=0).reshape(-1, k)
