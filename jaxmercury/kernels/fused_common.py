"""What the fused kernels share: device checks, and cost and memory hooks per placement kind.

A ``FusedKernel`` names these functions in its declaration: ``devices`` for
the mesh, ``seconds`` and ``memory`` for the tuner's cost model and memory
estimate. They read a placement (``kernels.placements``) and the kernel's
configuration; ``machine`` is the cost model's machine figures
(``tuner.cost.Machine``: ``rate``, ``bandwidth``, ``latency_s``,
``fused_flops_per_s``).
"""

from __future__ import annotations

import math

import jax

from jaxmercury.kernels.mosaic_gpu import hopper_only
from jaxmercury.kernels.placements import ALLGATHER

INTERPRET_CTAS = 2  # persistent CTAs of a kernel in interpret mode (a CPU device reports no SM count)


# ------------------------------------------------------------------ devices


def mesh_problem(p, mesh, *, every_process_device: bool) -> str | None:
  """Level L must hold every device of the mesh; a ring over several devices, every device of the process."""
  levels = dict(mesh.shape)
  total = math.prod(levels.values())
  if total != p.size:
    return (f"mesh level {p.level!r} holds {p.size} of the mesh's {total} devices; the fused kernels run over "
            "one level holding every device")
  if p.size > 1 and len(levels) > 1:
    return (f"the mesh has levels {list(levels)}; the fused kernels address peers by their index "
            f"along one level, so the mesh must have level {p.level!r} only")
  if not isinstance(mesh, jax.sharding.Mesh):
    return None  # an AbstractMesh plans: no devices to check
  if (p.size > 1 or every_process_device) and p.size != jax.device_count():
    return (f"mesh level {p.level!r} has {p.size} device{'s' if p.size > 1 else ''}, but the process has "
            f"{jax.device_count()}; Mosaic GPU addresses peers by their index among all of them, so the level "
            "must span every device")
  if p.size > 1 and jax.process_count() > 1:
    return f"the fused kernels run in one process holding every device; there are {jax.process_count()} processes"
  return None


def interprets_on(p, mesh) -> bool:
  """Whether a kernel with interpret mode runs in it here (a one-device CPU mesh)."""
  return isinstance(mesh, jax.sharding.Mesh) and mesh.devices.flat[0].platform == "cpu" and p.size == 1


def hopper_devices(every_process_device: bool):
  """``devices`` of a kernel without interpret mode: the mesh (``mesh_problem``), then Hopper GPUs."""
  def problem(p, mesh) -> str | None:
    reason = mesh_problem(p, mesh, every_process_device=every_process_device)
    if reason or not isinstance(mesh, jax.sharding.Mesh):
      return reason
    return hopper_only(mesh.devices.flat[0])
  return problem


def interpretable_devices(p, mesh) -> str | None:
  """``devices`` of a kernel with interpret mode: Hopper GPUs, or one CPU device (interpret mode)."""
  reason = mesh_problem(p, mesh, every_process_device=False)
  if reason or not isinstance(mesh, jax.sharding.Mesh) or interprets_on(p, mesh):
    return reason
  device = mesh.devices.flat[0]
  reason = hopper_only(device)
  if reason and device.platform == "cpu":
    reason += (f"; its Mosaic GPU interpret mode runs on CPU only where level {p.level!r} has one device "
               f"(it has {p.size})")
  return reason


def positive_ints(config, *names) -> str | None:
  """The first of ``names`` (default: every field) whose value in ``config`` is not a positive int."""
  for key in names or vars(config):
    v = getattr(config, key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
      return f"{key}={v!r} must be a positive int"
  return None


# ------------------------------------------------------------------ cost hooks


def overlapped_gemm_seconds(kernel, config, flops: float, sent: float, level: str, machine, sms: int) -> float:
  """A fused GEMM kernel doing ``flops`` while its ring passes ``sent`` bytes over ``level``: the longer of the
  two, plus one latency.

  The GEMM runs at the kernel's own rate on the mesh where calibration measured it (``fused_flops_per_s``: ring,
  handshakes and launch skew included), else at its ``rate_kernel``'s; a kernel that leaves ``comm_ctas`` of a
  device's ``sms`` SMs to communication computes on the others.
  """
  measured = machine.fused_flops_per_s.get(kernel.name)
  gemm = flops / (measured or machine.rate(kernel.rate_kernel))
  comm_ctas = getattr(config, "comm_ctas", 0) if sent else 0
  if comm_ctas and not measured:
    gemm *= sms / max(sms - comm_ctas, 1)
  return max(gemm, sent / machine.bandwidth(level)) + machine.latency_s


def gemm_seconds(kernel, p, config, machine, sms: int) -> float:
  """A fused collective GEMM: ``max(local GEMMs, ring transfers) + latency``.

  One device runs ``L`` GEMMs of one ring step's shape (padded to the
  kernel's tiles) and passes ``L - 1`` blocks to its neighbour over the
  level's link: A shards in A's dtype (all-gather) or float32 partial sums of
  one row block (reduce-scatter). The kernels send each tile as they compute
  it, so the two overlap fully.
  """
  size, m, k, n = p.padded_shape(kernel.tile(config))
  sent = m * k * p.itemsize if p.kind == ALLGATHER else m * n * 4
  return overlapped_gemm_seconds(kernel, config, 2 * size * m * k * n, (size - 1) * sent, p.level, machine, sms)


def ring_attention_seconds(kernel, p, config, machine, sms: int) -> float:
  """Fused ring attention: ``max(attention over every key, passing n - 1 K/V blocks) + latency``.

  The attention runs at the kernel's measured rate (``fused_flops_per_s``; else ``rate_kernel``'s); the
  kernel forwards each K/V tile as it consumes it, so the two overlap. A causal kernel skips the key tiles
  after its query tile: in natural order the busiest device (the last) computes ``n - 1/2`` of its ``n``
  blocks, in zigzag order every device half of them.
  """
  del config, sms
  b, s, hk, g, d = p.local_shape()
  share = 1.0
  if p.causal:
    share = 0.5 if p.order == "zigzag" else 1 - 1 / (2 * p.size)
  rate = machine.fused_flops_per_s.get(kernel.name) or machine.rate(kernel.rate_kernel)
  compute = share * 4 * b * hk * g * s * (s * p.size) * d / rate
  ring = (p.size - 1) * 2 * b * s * hk * d * p.itemsize / machine.bandwidth(p.level)
  return max(compute, ring) + machine.latency_s


# ------------------------------------------------------------------ memory hooks


def gemm_memory(kernel, p, config) -> int:
  """Per device: the stored A, B and C blocks, the ring's receive buffers, and copies padded to the tiles.

  All-gather: the A shards received from the ring, in A's dtype; reduce-scatter: the float32 partial sums
  received and a float32 result.
  """
  size, mp, kp, np_ = p.padded_shape(kernel.tile(config))
  m, k, n = p.local_shape()
  item = p.itemsize
  padded = (mp, kp, np_) != (m, k, n)
  if p.kind == ALLGATHER:
    total = (m * k + k * n + size * m * n + (size - 1) * mp * kp) * item
    return total + ((mp * kp + kp * np_ + size * mp * np_) * item if padded else 0)
  total = (size * m * k + k * n + m * n) * item + size * mp * np_ * 4
  return total + ((size * mp * kp + kp * np_) * item if padded else 0)


def ring_attention_memory(kernel, p, config) -> int:
  """q, k, v and o blocks, the ``n - 1`` received K and V blocks, and the float32 log-sum-exp."""
  del kernel, config
  b, s, hk, g, d = p.local_shape()
  return (2 * b * s * hk * g * d + 2 * p.size * b * s * hk * d) * p.itemsize + 4 * b * hk * g * s


# ------------------------------------------------------------------ configurations


def tile_problem(p, config) -> str | None:
  """``problem`` of a kernel configured by ``mosaic_matmul.TileConfig``: positive ints that compile as tiles."""
  return positive_ints(config) or config.tiles().problem(p.itemsize)


def tile_of(config) -> tuple[int, int, int]:
  """``tile`` of a kernel configured by ``mosaic_matmul.TileConfig``: its (rows, cols, depth) tiles."""
  return config.tile_m, config.tile_n, config.tile_k
