"""Tensor-parallel GEMM baselines in plain JAX, for any mesh level name.

All-gather GEMM (a column-parallel linear layer): ``x [M, K]`` row-sharded,
``w [K, N]`` column-sharded, ``out [M, N]`` column-sharded. Reduce-scatter
GEMM (a row-parallel layer): ``x`` column-sharded (``K`` split), ``w``
row-sharded, ``out`` row-sharded.

* ``allgather_dot`` / ``dot_psum_scatter``: the collective then the product
  (or the product then the collective) inside ``jax.shard_map``, cuBLAS on GPU.
* ``xla_auto``: ``jax.jit`` of a plain ``jnp.dot`` with the operands' and
  the output's shardings given, so XLA's SPMD partitioner chooses the
  collectives. Run with the windowed-einsum flags
  (``benchmarks.baselines.WINDOWED_EINSUM_FLAGS``, set before JAX starts) this
  is XLA's automatic collective matmul.
* ``pallas_allgather_matmul``: JAX's Mosaic GPU kernel
  ``jax.experimental.pallas.ops.gpu.collective_matmul_mgpu.all_gather_lhs_matmul``
  (Hopper GPUs, one level over every device), imported only when built.

Nothing here comes from jaxmercury.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def layouts(kind: str, level: str):
  """``(x spec, w spec, out spec)`` of an ``"allgather"`` or ``"reducescatter"`` GEMM."""
  if kind == "allgather":
    return P(level, None), P(None, level), P(None, level)
  if kind == "reducescatter":
    return P(None, level), P(level, None), P(level, None)
  raise ValueError(f"GEMM kind must be 'allgather' or 'reducescatter', got {kind!r}")


def _dot(a, b):
  """bf16 in, float32 accumulation, input dtype out."""
  return jnp.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype)


def _mapped(mesh, body, kind, level):
  x, w, out = layouts(kind, level)
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(x, w), out_specs=out, check_vma=False))


def allgather_dot(mesh, level: str):
  """``all_gather(x)`` then ``x @ w_local`` in ``shard_map``: ``f(x, w) -> out``."""
  return _mapped(mesh, lambda x, w: _dot(jax.lax.all_gather(x, level, axis=0, tiled=True), w),
                 "allgather", level)


def dot_psum_scatter(mesh, level: str):
  """``x_local @ w_local`` (float32) then ``psum_scatter`` over rows: ``f(x, w) -> out``."""
  def body(x, w):
    partial = jnp.dot(x, w, preferred_element_type=jnp.float32)
    return jax.lax.psum_scatter(partial, level, scatter_dimension=0, tiled=True).astype(x.dtype)

  return _mapped(mesh, body, "reducescatter", level)


def xla_auto(mesh, level: str, kind: str):
  """``jnp.dot`` jitted with sharded operands and output: XLA partitions it."""
  x, w, out = (NamedSharding(mesh, s) for s in layouts(kind, level))
  return jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype),
                 in_shardings=(x, w), out_shardings=out)


local_share = jax.jit(_dot)  # one rank's GEMM on one device, no communication: the compute floor


def hopper(device) -> bool:
  """Whether ``device`` is an sm90 (Hopper) GPU, the only target of the Mosaic GPU kernel."""
  cc = getattr(device, "compute_capability", None)
  return device.platform == "gpu" and isinstance(cc, str) and cc.split(".")[0] == "9"


def pallas_unavailable(mesh, dtype) -> str | None:
  """Why ``pallas_allgather_matmul`` cannot run here, or None when it can."""
  dev = mesh.devices.flat[0]
  if dev.platform != "gpu":
    return f"needs a Hopper GPU (sm90); the devices are {dev.platform}"
  if not hopper(dev):
    return f"needs a Hopper GPU (sm90); {dev.device_kind} is sm{getattr(dev, 'compute_capability', '?')}"
  if len(mesh.axis_names) != 1:
    return "the kernel runs over one mesh level holding every device"
  if mesh.devices.size != jax.device_count() or jax.device_count() != jax.local_device_count():
    return "the kernel needs one process holding every device of the mesh"
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"the kernel takes bf16/f16, not {jnp.dtype(dtype)}"
  return None


# Tile configurations tried (the fastest one counts): points of the space the kernel's own example
# sweeps (tile_k 64, 4 pipeline steps), each within Hopper's 227 KiB of shared memory (checked by
# lowering for CUDA; tile_m 256 with tile_n 128, or with wg_dimension M, does not fit).
# (tile_m, tile_n, grid_minor_dim, grid_tile_width, wg_dimension)
PALLAS_CONFIGS = (
    (128, 128, "N", 8, "N"),
    (128, 128, "M", 8, "M"),
    (256, 64, "N", 8, "N"),
    (128, 128, "N", 16, "M"),
)


def pallas_allgather_matmul(mesh, level: str, config: tuple, dtype=jnp.bfloat16):
  """JAX's Mosaic GPU all-gather matmul over ``level``: ``f(x, w) -> out`` (all-gather layouts).

  Args:
    config: one of ``PALLAS_CONFIGS``.

  Raises:
    ImportError / ValueError: the kernel or the configuration does not fit.
  """
  from jax.experimental.pallas.ops.gpu import collective_matmul_mgpu as cm  # Hopper only: lazy
  tile_m, tile_n, minor, width, wg = config
  dim = cm.MatmulDimension
  tuning = cm.TuningConfig(tile_m=tile_m, tile_n=tile_n, tile_k=64, max_concurrent_steps=4,
                           grid_minor_dim=getattr(dim, minor), grid_tile_width=width,
                           wg_dimension=getattr(dim, wg))

  def body(x, w):
    return cm.all_gather_lhs_matmul(x, w, level, config=tuning, dtype=dtype)

  return _mapped(mesh, body, "allgather", level)
