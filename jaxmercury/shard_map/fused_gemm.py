"""Fused lowerings of GEMM schedules: all-gather GEMM and GEMM + reduce-scatter over one mesh level.

A schedule's ``Placement`` (read from the plan's layouts) is one of:

- all-gather GEMM (``allgather_matmul``, ``async_tp``): A's rows, B's and C's
  columns split over L; a device computes ``all_gather(A over L) @ B_local``;
- GEMM + reduce-scatter (``matmul_reducescatter``, ``async_tp_reducescatter``):
  A's columns and B's rows split over L, C's rows too; a device computes its
  row block of ``sum over L of A_local @ B_local``.

Registered lowerings: ``fused_allgather_matmul``, ``fused_allgather_matmul_comm``,
``fused_allgather_matmul_ws`` and ``jax_allgather_lhs_matmul`` (all-gather),
``fused_matmul_reducescatter`` and ``fused_matmul_reducescatter_ws`` (reduce-scatter).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Callable

import numpy as np

from jaxmercury.errors import PreconditionError
from jaxmercury.shard_map.fused import (HALF, INTERPRET_CTAS, KIND_NAMES, PLACEMENTS, FusedLowering, hopper_devices,
                                        interpretable_devices, layout_text, lowering, register, split_problem,
                                        splitting_level, stored, whole_nest_problem)

ALLGATHER, REDUCESCATTER = "allgather", "reducescatter"
# Per kind, the axis (by role) of A, B and C that level L splits.
SPLIT_ROLES = {ALLGATHER: ("m", "n", "n"), REDUCESCATTER: ("k", "k", "m")}
KIND_NAMES.update({ALLGATHER: "an all-gather GEMM", REDUCESCATTER: "a GEMM + reduce-scatter"})


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where a schedule puts the GEMM's buffers, in the matmul pattern's roles.

  Attributes:
    kind: ``"allgather"`` (A's rows, B's and C's columns split over L) or
      ``"reducescatter"`` (A's columns, B's rows and C's rows split over L).
    level: the mesh level L.
    size: L's size.
    a, b, c: the program's buffers playing A [m, k], B [k, n] and C [m, n].
    m, n, k: the program's axes playing those roles.
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

  def local_shape(self, schedule) -> tuple[int, int, int]:
    """``(rows, depth, cols)`` of one ring step's GEMM on one device (padded extents).

    All-gather: one A shard ``[m / L, k]`` times the device's B ``[k, n / L]``;
    reduce-scatter: one row block of its A ``[m / L, k / L]`` times its B
    ``[k / L, n]``. Either way the device runs ``L`` such GEMMs.
    """
    ext = lambda ax: schedule.padded.get(ax, schedule.program.axes[ax].extent)
    if self.kind == ALLGATHER:
      return ext(self.m) // self.size, ext(self.k), ext(self.n) // self.size
    return ext(self.m) // self.size, ext(self.k) // self.size, ext(self.n)

  def dtype_problem(self) -> str | None:
    """Why the buffers' dtypes do not fit the fused GEMM kernels, or None."""
    da, db, dc = (np.dtype(x.dtype) for x in (self.a, self.b, self.c))
    if da not in HALF or db != da or dc != da:
      return (f"buffers {self.a.name}, {self.b.name}, {self.c.name} are {da}, {db}, {dc}: the fused kernels take "
              "bf16 or fp16 operands of one dtype and write the result in it")
    return None

  def describe(self, schedule) -> str:
    """The three buffers as the schedule stores them: ``A[m@x, k], B[k, n@x], C[m, n@x]``."""
    return ", ".join(layout_text(buf, stored(schedule, buf)) for buf in (self.a, self.b, self.c))

  def memory_bytes(self, schedule) -> int:
    """Per device: the stored A, B and C blocks, the ring's receive buffers, and padded copies.

    All-gather: the A shards received from the ring, in A's dtype;
    reduce-scatter: the float32 partial sums received and a float32 result.
    """
    size, mp, kp, np_ = gemm_shape(schedule)
    m, k, n = self.local_shape(schedule)
    item = np.dtype(self.a.dtype).itemsize
    padded = (mp, kp, np_) != (m, k, n)  # the kernel works on copies padded to its tiles
    if self.kind == ALLGATHER:
      total = (m * k + k * n + size * m * n + (size - 1) * mp * kp) * item
      return total + ((mp * kp + kp * np_ + size * mp * np_) * item if padded else 0)
    total = (size * m * k + k * n + m * n) * item + size * mp * np_ * 4
    return total + ((size * mp * kp + kp * np_) * item if padded else 0)


def _need(kind: str, a, b, c, m, n, k, lv="L") -> str:
  if kind == ALLGATHER:
    shapes = f"{a.name}[{m}@{lv}, {k}], {b.name}[{k}, {n}@{lv}], {c.name}[{m}, {n}@{lv}]"
    what = f"{a.name}'s rows and {b.name}'s and {c.name}'s columns"
  else:
    shapes = f"{a.name}[{m}, {k}@{lv}], {b.name}[{k}@{lv}, {n}], {c.name}[{m}@{lv}, {n}]"
    what = f"{a.name}'s columns, {b.name}'s rows and {c.name}'s rows"
  return f"{KIND_NAMES[kind]} needs {what} split over one mesh level and nothing else split: {shapes}"


def placement(schedule) -> Placement | str:
  """The schedule's ``Placement``, or why it is neither fused GEMM placement.

  Reads the plan's storage layouts (the caller's ``in_shardings`` /
  ``out_sharding`` included): A split along its rows over one mesh level L is
  an all-gather GEMM (A ``[m@L, k]``, B ``[k, n@L]``, C ``[m, n@L]``), A split
  along its columns a GEMM + reduce-scatter (A ``[m, k@L]``, B ``[k@L, n]``,
  C ``[m@L, n]``); levels of size 1 elsewhere are ignored (they split nothing).
  """
  from jaxmercury.pallas_kernels import patterns
  prog = schedule.program
  try:
    roles = {role: ax for ax, role in patterns.match("matmul", prog).to_pattern.items()}
  except PreconditionError as e:
    return f"the fused kernels compute GEMMs (loop-nest pattern 'matmul'): {e}"
  if reason := whole_nest_problem(schedule):
    return reason
  plan = schedule.plan()
  a, b = prog.reads
  c = prog.writes
  m, n, k = roles["m"], roles["n"], roles["k"]
  a_layout = plan.storage[a.name]
  by_kind = {kind: a_layout[a.axes.index(roles[SPLIT_ROLES[kind][0]])] for kind in (ALLGATHER, REDUCESCATTER)}
  if by_kind[ALLGATHER] and by_kind[REDUCESCATTER]:
    return (f"buffer {a.name} is stored {layout_text(a, a_layout)}: both its rows and its columns are split; "
            f"{_need(ALLGATHER, a, b, c, m, n, k)}; or {_need(REDUCESCATTER, a, b, c, m, n, k)}")
  if not by_kind[ALLGATHER] and not by_kind[REDUCESCATTER]:
    return (f"buffer {a.name} is stored {layout_text(a, a_layout)}: neither its rows ({m}) nor its columns ({k}) are "
            f"split over a mesh level; {_need(ALLGATHER, a, b, c, m, n, k)}; "
            f"or {_need(REDUCESCATTER, a, b, c, m, n, k)}")
  kind = ALLGATHER if by_kind[ALLGATHER] else REDUCESCATTER
  level, n_split = splitting_level(schedule, by_kind[kind])
  if level is None:
    return (f"buffer {a.name} is stored {layout_text(a, a_layout)}: its {'rows' if kind == ALLGATHER else 'columns'} "
            f"are split over {n_split} levels; {_need(kind, a, b, c, m, n, k)}")
  split_axes = [(buf, roles[role]) for buf, role in zip((a, b, c), SPLIT_ROLES[kind])]
  if reason := split_problem(schedule, level, split_axes, _need(kind, a, b, c, m, n, k, level)):
    return reason
  return Placement(kind, level, schedule.levels[level], a, b, c, m, n, k)


PLACEMENTS.update({ALLGATHER: placement, REDUCESCATTER: placement})


# ------------------------------------------------------------------ ours: pallas_kernels.fused_allgather_matmul


def _tiles(params):
  from jaxmercury.pallas_kernels.mosaic_matmul import Tiles
  return Tiles(**params)


def _ours_params(params, itemsize) -> str | None:
  for key, v in params.items():
    if not isinstance(v, int) or isinstance(v, bool):
      return f"{key}={v!r} must be an int"
  return _tiles(params).problem(itemsize)


def _ours_tile(params):
  t = _tiles(params)
  return t.tile_m, t.tile_n, t.tile_k


def _ours_make(kernel: str) -> Callable:
  """``make`` of our one-warpgroup kernel ``jaxmercury.pallas_kernels.<kernel>.<kernel>``."""
  def make(p: Placement, params, interpret: bool):
    fn = getattr(importlib.import_module(f"jaxmercury.pallas_kernels.{kernel}"), kernel)
    tiles, out_dtype = _tiles(params), p.c.dtype

    def per_device(a, b, **gathered):
      return fn(a, b, p.level, tiles=tiles, out_dtype=out_dtype, num_ctas=INTERPRET_CTAS if interpret else None,
                interpret=interpret, **gathered)
    return per_device
  return make


# ------------------------------------------------------------------ ours: fused_allgather_matmul_comm


# chunk_tiles: rows of A per chunk (the unit of transfer and of readiness), in tiles of tile_m rows
COMM_DEFAULTS = {"tile_m": 128, "tile_n": 128, "tile_k": 64, "max_concurrent_steps": 4, "comm_ctas": 4,
                 "chunk_tiles": 1}
COMM_COUNTS = ("comm_ctas", "chunk_tiles")


def _comm_split(params) -> tuple[dict, int, int]:
  """``(tile params, comm_ctas, chunk_tiles)``."""
  tile_params = {key: v for key, v in params.items() if key not in COMM_COUNTS}
  return tile_params, params["comm_ctas"], params["chunk_tiles"]


def _comm_params(params, itemsize) -> str | None:
  for key in COMM_COUNTS:
    if not isinstance(params[key], int) or isinstance(params[key], bool) or params[key] < 1:
      return f"{key}={params[key]!r} must be a positive int"
  return _ours_params(_comm_split(params)[0], itemsize)


def _comm_tile(params):
  """Rows padded to whole chunks, so that the chunks divide each device's rows."""
  tile_params, _, chunk_tiles = _comm_split(params)
  rows, cols, depth = _ours_tile(tile_params)
  return rows * chunk_tiles, cols, depth


def _comm_make(p: Placement, params, interpret: bool):
  """``make`` of ``pallas_kernels.fused_allgather_matmul_comm`` (chunks of ``chunk_tiles * tile_m`` rows)."""
  from jaxmercury.pallas_kernels.fused_allgather_matmul_comm import fused_allgather_matmul_comm
  tile_params, comm_ctas, chunk_tiles = _comm_split(params)
  tiles, out_dtype = _tiles(tile_params), p.c.dtype

  def per_device(a, b, gathered: bool = False):
    return fused_allgather_matmul_comm(a, b, p.level, tiles=tiles, comm_ctas=comm_ctas,
                                       chunk_rows=chunk_tiles * tiles.tile_m, out_dtype=out_dtype,
                                       num_ctas=INTERPRET_CTAS if interpret else None, interpret=interpret,
                                       gathered=gathered)
  return per_device


# ------------------------------------------------------------------ JAX's: collective_matmul_mgpu


# Its first configuration in benchmarks/baselines/gemm.py PALLAS_CONFIGS (the kernel's own example's space).
JAX_DEFAULTS = {"tile_m": 128, "tile_n": 128, "tile_k": 64, "max_concurrent_steps": 4,
                "grid_minor_dim": "N", "grid_tile_width": 8, "wg_dimension": "N"}


def _jax_cta(params) -> tuple[int, int]:
  """The CTA tile: two compute warpgroups side by side along ``wg_dimension``."""
  m_wg = params["wg_dimension"] == "M"
  return params["tile_m"] * (2 if m_wg else 1), params["tile_n"] * (1 if m_wg else 2)


def _jax_params(params, itemsize) -> str | None:
  from jaxmercury.pallas_kernels.mosaic_matmul import ACC_VALUES, SMEM_BYTES
  for key in ("grid_minor_dim", "wg_dimension"):
    if params[key] not in ("M", "N"):
      return f"{key}={params[key]!r} must be 'M' or 'N'"
  for key in ("tile_m", "tile_n", "tile_k", "max_concurrent_steps", "grid_tile_width"):
    v = params[key]
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
      return f"{key}={v!r} must be a positive int"
  tm, tn, tk, steps = params["tile_m"], params["tile_n"], params["tile_k"], params["max_concurrent_steps"]
  if tm % 64 or tn % 64 or tk % 64:
    return f"tile_m={tm}, tile_n={tn} and tile_k={tk} must be multiples of 64 (its 64x64 epilogue, 128-byte swizzle)"
  if steps < 2:
    return f"max_concurrent_steps={steps} must be at least 2"
  if tm * tn > ACC_VALUES:
    return f"tile_m x tile_n = {tm * tn} float32 accumulators exceed one warpgroup's registers ({ACC_VALUES})"
  cta_m, cta_n = _jax_cta(params)
  smem = steps * (cta_m * tk + tk * cta_n) * itemsize + 2 * 2 * 64 * 64 * itemsize
  if smem > SMEM_BYTES:
    return f"needs {smem} bytes of shared memory, more than {SMEM_BYTES}"
  return None


def _jax_tile(params):
  cta_m, cta_n = _jax_cta(params)
  return cta_m, cta_n, params["tile_k"]


def _jax_make(p: Placement, params, interpret: bool):
  del interpret  # never: the kernel sizes its grid by the device's SM count
  from jax.experimental.pallas.ops.gpu import collective_matmul_mgpu as cm  # Hopper only: lazy

  from jaxmercury.pallas_kernels.peer_gemm import pad_to, round_up, unpad_row_blocks
  dim = cm.MatmulDimension
  config = cm.TuningConfig(tile_m=params["tile_m"], tile_n=params["tile_n"], tile_k=params["tile_k"],
                           max_concurrent_steps=params["max_concurrent_steps"],
                           grid_minor_dim=getattr(dim, params["grid_minor_dim"]),
                           grid_tile_width=params["grid_tile_width"],
                           wg_dimension=getattr(dim, params["wg_dimension"]))
  rows, cols, depth = _jax_tile(params)
  out_dtype = p.c.dtype

  def per_device(a, b, gathered: bool = False):
    (m, k), n = a.shape, b.shape[1]
    mp, kp, np_ = round_up(m, rows), round_up(k, depth), round_up(n, cols)
    out = cm.all_gather_lhs_matmul(pad_to(a, mp, kp), pad_to(b, kp, np_), p.level, config=config, dtype=out_dtype)
    out = unpad_row_blocks(out, p.size, m, n)
    return (out, None) if gathered else out  # it keeps no gathered A: the backward gathers it
  return per_device


# ------------------------------------------------------------------ ours: GEMM + reduce-scatter with two consumers


def _ws_tiles(params):
  from jaxmercury.pallas_kernels.fused_matmul_reducescatter_ws import WsTiles
  return WsTiles(**params)


def _ws_params(params, itemsize, out_itemsize: int = 4) -> str | None:
  del itemsize  # the kernel checks its operands' dtype
  for key, v in params.items():
    if key not in ("split", "grid_minor") and (not isinstance(v, int) or isinstance(v, bool)):
      return f"{key}={v!r} must be an int"
  return _ws_tiles(params).problem(out_itemsize)


def _ws_ag_params(params, itemsize) -> str | None:
  return _ws_params(params, itemsize, out_itemsize=itemsize)  # the epilogue stores the output's dtype


def _ws_tile(params):
  t = _ws_tiles(params)
  return (*t.cta, t.tile_k)


def _ws_make(kernel: str) -> Callable:
  """``make`` of a warp-specialized kernel (never interpreted: JAX's interpreter does not run its pipeline)."""
  def make(p: Placement, params, interpret: bool):
    del interpret
    module = importlib.import_module(f"jaxmercury.pallas_kernels.{kernel}")
    fn, tiles, out_dtype = getattr(module, kernel), _ws_tiles(params), p.c.dtype

    def per_device(a, b, **gathered):
      return fn(a, b, p.level, tiles=tiles, out_dtype=out_dtype, **gathered)
    return per_device
  return make


register(FusedLowering(
    "fused_allgather_matmul",
    "our Mosaic GPU kernel (pallas_kernels.fused_allgather_matmul): A's row shards travel the ring by TMA "
    "stores into the left neighbour, overlapped with wgmma; shapes padded to its tiles",
    {"tile_m": 128, "tile_n": 128, "tile_k": 64, "max_concurrent_steps": 4}, "mosaic_matmul",
    interpretable_devices, _ours_params, _ours_tile, _ours_make("fused_allgather_matmul"), interpret=True))

register(FusedLowering(
    "fused_allgather_matmul_comm",
    "our Mosaic GPU kernel (pallas_kernels.fused_allgather_matmul_comm): comm_ctas CTAs of the persistent grid "
    "pass A's row shards round the ring by TMA through SMEM, one semaphore per chunk of chunk_tiles * tile_m "
    "rows; the other CTAs run the GEMM, waiting per tile for its rows; shapes padded to its tiles and chunks",
    COMM_DEFAULTS, "mosaic_matmul", interpretable_devices, _comm_params, _comm_tile, _comm_make, interpret=True))


def _jax_devices(schedule, p) -> str | None:
  """JAX's kernel reaches its peer through NVSHMEM, which XLA does not set up for a one-device ring."""
  reason = hopper_devices(True)(schedule, p)
  if reason is None and p.size == 1:
    return (f"jax_allgather_lhs_matmul needs several GPUs on mesh level {p.level!r} (it has 1): XLA sets up the "
            "NVSHMEM it uses only across GPUs (on one H200: 'UNIMPLEMENTED: NVSHMEM is not supported in XLA')")
  return reason


register(FusedLowering(
    "jax_allgather_lhs_matmul",
    "JAX's Mosaic GPU kernel (collective_matmul_mgpu.all_gather_lhs_matmul): warp-specialized persistent GEMM "
    "that forwards A's tiles to the left neighbour; shapes padded to its CTA tiles",
    JAX_DEFAULTS, "jax_mosaic_matmul", _jax_devices, _jax_params, _jax_tile, _jax_make))

register(FusedLowering(
    "fused_matmul_reducescatter",
    "our Mosaic GPU kernel (pallas_kernels.fused_matmul_reducescatter): each tile's float32 running sum is "
    "stored by TMA into the left neighbour as the GEMM finishes it; shapes padded to its tiles",
    {"tile_m": 128, "tile_n": 128, "tile_k": 64, "max_concurrent_steps": 4}, "mosaic_matmul",
    interpretable_devices, _ours_params, _ours_tile, _ours_make("fused_matmul_reducescatter"), interpret=True,
    kind=REDUCESCATTER))

register(FusedLowering(
    "fused_matmul_reducescatter_ws",
    "our warp-specialized Mosaic GPU kernel (pallas_kernels.fused_matmul_reducescatter_ws): JAX's Hopper GEMM "
    "body (two consumer warpgroups) per ring step, its epilogue adding the received sum and storing into the "
    "left neighbour; shapes padded to its CTA tiles",
    {"tile_m": 128, "tile_n": 128, "tile_k": 64, "max_concurrent_steps": 3, "split": "n"}, "jax_mosaic_matmul",
    hopper_devices(False), _ws_params, _ws_tile, _ws_make("fused_matmul_reducescatter_ws"), kind=REDUCESCATTER))

register(FusedLowering(
    "fused_allgather_matmul_ws",
    "our warp-specialized Mosaic GPU kernel (pallas_kernels.fused_allgather_matmul_ws): JAX's Hopper GEMM body "
    "(two consumer warpgroups) per ring step, storing each A tile it reads into the left neighbour, one semaphore "
    "per step; shapes padded to its CTA tiles",
    {"tile_m": 128, "tile_n": 128, "tile_k": 64, "max_concurrent_steps": 4, "split": "n", "grid_minor": "n",
     "grid_width": 8}, "jax_mosaic_matmul", hopper_devices(False), _ws_ag_params, _ws_tile,
    _ws_make("fused_allgather_matmul_ws")))


def gemm_shape(schedule) -> tuple[int, int, int, int]:
  """``(L, rows, depth, cols)``: one device runs ``L`` GEMMs of this shape (``Placement.local_shape``), padded."""
  from jaxmercury.pallas_kernels.peer_gemm import round_up
  low = lowering(schedule.lowering)
  p = low.place(schedule)
  m, k, n = p.local_shape(schedule)
  rows, cols, depth = low.tile(low.params(**schedule.lowering_params))
  return p.size, round_up(m, rows), round_up(k, depth), round_up(n, cols)
