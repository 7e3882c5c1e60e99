"""Mosaic GPU building blocks shared by the kernels of every operator (Hopper).

- the machine: ``SMEM_BYTES`` a CTA may allocate, ``ACC_VALUES`` a
  warpgroup's float32 accumulator holds, ``HALF_DTYPES`` wgmma takes,
  ``hopper_only`` (why a device cannot run a wgmma kernel), ``sm_count``;
- shared memory: ``swizzled``, the tiling and swizzle transforms of a TMA
  tile;
- rings over peer GPUs: ``ring_size`` (the devices of a ring and why a
  kernel cannot run it), ``step_semaphores`` (one per ring step),
  ``left_peer`` (where a ring stores);
- persistent grids: ``snake_order`` (which items a CTA runs).
"""

from __future__ import annotations

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxmercury.errors import PreconditionError

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


def sm_count() -> int | None:
  """The SM count of the GPUs a kernel is traced for: the abstract mesh's device (lowering without GPUs), else
  the first device's; None where neither says (a CPU device)."""
  abstract = jax.sharding.get_abstract_mesh().abstract_device
  if abstract is not None and abstract.num_cores:
    return abstract.num_cores
  return getattr(jax.devices()[0], "core_count", None)


def swizzled(minor: int, dtype):
  """SMEM transforms for a tile whose minor dimension has ``minor`` elements: (8, s) tiles, swizzled."""
  itemsize = jnp.dtype(dtype).itemsize
  swizzle = plgpu.find_swizzle(minor * itemsize * 8)
  return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def ring_size(kernel: str, axis_name: str, interpret: bool) -> int:
  """The device count of the ring over ``axis_name``; ``PreconditionError`` where ``kernel`` cannot run it.

  Interpret mode runs one device only (no peer memory), and a ring of several
  devices must span every device of the process (Mosaic GPU addresses peers
  by their index in the whole mesh). Call inside ``shard_map``.
  """
  n_dev = lax.axis_size(axis_name)
  if interpret and n_dev > 1:
    raise PreconditionError(f"{kernel}: interpret mode runs one device, axis {axis_name!r} has {n_dev}: "
                            "Mosaic GPU's interpreter has no peer memory or remote semaphores")
  if n_dev > 1 and n_dev != jax.device_count():
    raise PreconditionError(f"{kernel}: axis {axis_name!r} has {n_dev} devices, but the process has "
                            f"{jax.device_count()}; Mosaic GPU addresses peers by their index in the whole mesh")
  return n_dev


def step_semaphores(n_dev: int):
  """One global semaphore per ring step (``n_dev - 1`` of them); call inside the kernel body.

  Step ``s``'s stores into the left peer are announced on semaphore ``s`` only.
  One counting semaphore for all steps is not enough: a CTA that runs ahead
  could signal step ``s + 1`` before a slow CTA signals step ``s``, and the
  count a waiter for step ``s`` expects would be reached early.
  """
  return pl.get_global(plgpu.SemaphoreType.REGULAR((max(n_dev - 1, 1),)))


def left_peer(dev, n_dev: int, *refs):
  """``(left, *refs_there)``: the ring's left neighbour of device ``dev`` (``dev - 1`` mod ``n_dev``) and each of
  ``refs`` as that device holds it (``plgpu.remote_ref``), where the ring stores; call inside the kernel body."""
  left = lax.rem(dev + n_dev - 1, n_dev)
  return (left, *(plgpu.remote_ref(ref, left) for ref in refs))


def snake_order(work: int, grid: int, cta):
  """``work`` items over a persistent grid of ``grid`` CTAs in snake order: CTA ``cta`` takes rank ``i grid + cta``
  in its even rounds ``i`` and ``i grid + grid - 1 - cta`` in its odd ones, so a part-filled last round goes to
  the first CTAs if it is even and to the last ones if it is odd.

  Returns:
    ``(items, rank)``: how many items ``cta`` runs (traced), and ``rank(i)``, the rank of its ``i``-th.
  """
  full, last = divmod(work, grid)
  in_last = (cta < last) if full % 2 == 0 else (cta >= grid - last)
  return full + in_last.astype(jnp.int32), lambda i: i * grid + jnp.where(lax.rem(i, 2) == 0, cta, grid - 1 - cta)
