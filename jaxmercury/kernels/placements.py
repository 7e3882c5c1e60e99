"""Placements: where a schedule puts a whole operator's buffers, as the fused kernels see it (data only).

A fused kernel runs a whole schedule of one placement kind per device.
``jaxmercury.analysis.placements`` reads a schedule's plan and returns its
placement (or why it has none); the kernels' hooks (``make``, ``devices``,
``problem``, ``seconds``, ``memory``) read only these records.

Kinds:

- ``ALLGATHER``: an all-gather GEMM ``C[m, n@L] = A[m@L, k] B[k, n@L]``;
- ``REDUCESCATTER``: a GEMM + reduce-scatter ``C[m@L, n] = A[m, k@L] B[k@L, n]``;
- ``RING_ATTENTION``: attention with the sequence of q, k, v and o split over L, in natural or zigzag order.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

ALLGATHER, REDUCESCATTER, RING_ATTENTION = "allgather", "reducescatter", "ring_attention"
KIND_NAMES = {ALLGATHER: "an all-gather GEMM", REDUCESCATTER: "a GEMM + reduce-scatter",
              RING_ATTENTION: "ring attention"}
HALF = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


def round_up(x: int, multiple: int) -> int:
  return -(-x // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class GemmPlacement:
  """Where a schedule puts a GEMM's buffers, in the matmul pattern's roles.

  Attributes:
    kind: ``ALLGATHER`` or ``REDUCESCATTER``.
    level: the mesh level L.
    size: L's size.
    a, b, c: the program's buffers playing A [m, k], B [k, n] and C [m, n].
    m, n, k: the program's axes playing those roles.
    extents: the padded global extents of m, k and n.
  """

  kind: str
  level: str
  size: int
  a: object
  b: object
  c: object
  m: str
  n: str
  k: str
  extents: tuple[int, int, int]

  @property
  def itemsize(self) -> int:
    return np.dtype(self.a.dtype).itemsize

  def local_shape(self) -> tuple[int, int, int]:
    """``(rows, depth, cols)`` of one ring step's GEMM on one device (padded extents).

    All-gather: one A shard ``[m / L, k]`` times the device's B ``[k, n / L]``;
    reduce-scatter: one row block of its A ``[m / L, k / L]`` times its B
    ``[k / L, n]``. Either way the device runs ``L`` such GEMMs.
    """
    m, k, n = self.extents
    if self.kind == ALLGATHER:
      return m // self.size, k, n // self.size
    return m // self.size, k // self.size, n

  def padded_shape(self, tile) -> tuple[int, int, int, int]:
    """``(L, rows, depth, cols)``: one device runs ``L`` GEMMs of this shape, padded to ``tile`` (rows, cols,
    depth multiples)."""
    m, k, n = self.local_shape()
    rows, cols, depth = tile
    return self.size, round_up(m, rows), round_up(k, depth), round_up(n, cols)

  def dtype_problem(self) -> str | None:
    """Why the buffers' dtypes do not fit the fused GEMM kernels, or None."""
    da, db, dc = (np.dtype(x.dtype) for x in (self.a, self.b, self.c))
    if da not in HALF or db != da or dc != da:
      return (f"buffers {self.a.name}, {self.b.name}, {self.c.name} are {da}, {db}, {dc}: the fused kernels take "
              "bf16 or fp16 operands of one dtype and write the result in it")
    return None


@dataclasses.dataclass(frozen=True)
class AttentionPlacement:
  """Where a schedule puts attention's buffers: the sequence split over mesh level ``level``.

  Attributes:
    level, size: the mesh level L and its size.
    q, k, v, o: the program's buffers in the attention pattern's roles.
    axes: program axis of each pattern role (``b``, ``i``, ``j``, ``hk``, ``g``, ``d``).
    extents: global extent of each pattern role.
    causal: whether the program masks keys after the query.
    order, chunks: how the sequence is stored, the kernel's ``order``
      (``"natural"`` or ``"zigzag"``) and zigzag chunks (None for natural).
  """

  level: str
  size: int
  q: object
  k: object
  v: object
  o: object
  axes: dict
  extents: dict
  causal: bool = False
  order: str = "natural"
  chunks: int | None = None
  kind: str = RING_ATTENTION

  @property
  def itemsize(self) -> int:
    return np.dtype(self.q.dtype).itemsize

  def local_shape(self) -> tuple[int, ...]:
    """``(b, s_local, kv heads, group, d)`` of one device's blocks."""
    e = self.extents
    return e["b"], e["i"] // self.size, e["hk"], e["g"], e["d"]

  def run(self) -> int:
    """The positions of one contiguous run a tile must lie in: a device's (natural order) or a zigzag chunk's."""
    return self.local_shape()[1] if self.chunks is None else self.extents["i"] // self.chunks

  def dtype_problem(self) -> str | None:
    dtypes = [np.dtype(x.dtype) for x in (self.q, self.k, self.v, self.o)]
    if dtypes[0] not in HALF or any(d != dtypes[0] for d in dtypes):
      return (f"buffers q, k, v, o are {', '.join(map(str, dtypes))}: the fused ring-attention kernels take "
              "bf16 or fp16, one dtype")
    return None

