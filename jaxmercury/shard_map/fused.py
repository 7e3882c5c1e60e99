"""Fused lowerings: a whole GEMM schedule run as one fused collective GEMM kernel per device.

The ordinary lowering (``lower``) runs a schedule's loop nest under
``jax.shard_map``: XLA collectives or ``ppermute`` rings between local GEMM
blocks. Two placements over one mesh level L let a fused kernel compute each
device's share in one launch, with the ring inside the kernel (the check
reads the plan's layouts, not the strategy's name):

- all-gather GEMM (``allgather_matmul``, ``async_tp``): A's rows, B's and C's
  columns split over L; a device computes ``all_gather(A over L) @ B_local``;
- GEMM + reduce-scatter (``matmul_reducescatter``, ``async_tp_reducescatter``):
  A's columns and B's rows (the contraction) split over L, C's rows too; a
  device computes its row block of ``sum over L of A_local @ B_local``.

A third kind, non-causal ring attention (``ring``: the sequence of q, k, v
and o split over L), lives in ``jaxmercury.shard_map.fused_attention``.
``Schedule.lower_with(name)`` picks one of the lowerings registered here;
``Schedule.compile()`` then runs it under the same ``shard_map`` (the plan's
layouts, padding and global signature) and differentiates through the
ordinary lowering's backward, since Pallas kernels have no autodiff. The tuner
offers every lowering whose ``why_not`` is None as one more candidate.

Each ``FusedLowering`` has a name, a one-line description, the placement kind
it computes, ``why_not(schedule)`` (None when it applies, else a sentence
naming the buffer, mesh level, device, dtype or parameter that prevents it)
and ``build(schedule, **params)``, the per-device function
``(a_local, b_local) -> c_local``.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxmercury.errors import PreconditionError, UnknownNameError

HALF = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
INTERPRET_CTAS = 2  # persistent CTAs of our kernel in interpret mode (a CPU device reports no SM count)


ALLGATHER, REDUCESCATTER = "allgather", "reducescatter"
# Per kind, the axis (by role) of A, B and C that level L splits.
SPLIT_ROLES = {ALLGATHER: ("m", "n", "n"), REDUCESCATTER: ("k", "k", "m")}
KIND_NAMES = {ALLGATHER: "an all-gather GEMM", REDUCESCATTER: "a GEMM + reduce-scatter"}


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
    return _dtype_problem(self)


def _fmt(buf, layout) -> str:
  return buf.name + "[" + ", ".join(f"{a}@{'*'.join(lv)}" if lv else a for a, lv in zip(buf.axes, layout)) + "]"


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
  if schedule.kernel not in (None, "xla"):
    return (f"the block is patched with kernel {schedule.kernel!r}; a fused lowering replaces the whole nest, "
            "so it takes an unpatched schedule")
  if schedule.zigzags:
    ax = next(iter(schedule.zigzags))
    return f"axis {ax!r} is stored in zigzag order; the fused kernels take the natural order"
  plan = schedule.plan()
  a, b = prog.reads
  c = prog.writes
  m, n, k = roles["m"], roles["n"], roles["k"]
  sizes = schedule.levels
  a_layout = plan.storage[a.name]
  by_kind = {kind: a_layout[a.axes.index(roles[SPLIT_ROLES[kind][0]])] for kind in (ALLGATHER, REDUCESCATTER)}
  if by_kind[ALLGATHER] and by_kind[REDUCESCATTER]:
    return (f"buffer {a.name} is stored {_fmt(a, a_layout)}: both its rows and its columns are split; "
            f"{_need(ALLGATHER, a, b, c, m, n, k)}; or {_need(REDUCESCATTER, a, b, c, m, n, k)}")
  if not by_kind[ALLGATHER] and not by_kind[REDUCESCATTER]:
    return (f"buffer {a.name} is stored {_fmt(a, a_layout)}: neither its rows ({m}) nor its columns ({k}) are "
            f"split over a mesh level; {_need(ALLGATHER, a, b, c, m, n, k)}; or {_need(REDUCESCATTER, a, b, c, m, n, k)}")
  kind = ALLGATHER if by_kind[ALLGATHER] else REDUCESCATTER
  levels = by_kind[kind]
  split = [lv for lv in levels if sizes[lv] > 1]
  if len(split) > 1:
    return (f"buffer {a.name} is stored {_fmt(a, a_layout)}: its {'rows' if kind == ALLGATHER else 'columns'} "
            f"are split over {len(split)} levels; {_need(kind, a, b, c, m, n, k)}")
  level = split[0] if split else levels[-1]

  def kept(layout):
    return tuple(tuple(lv for lv in e if lv == level or sizes[lv] > 1) for e in layout)

  for buf, role in zip((a, b, c), SPLIT_ROLES[kind]):
    want = tuple((level,) if ax == roles[role] else () for ax in buf.axes)
    if kept(plan.storage[buf.name]) != want:
      return (f"buffer {buf.name} is stored {_fmt(buf, plan.storage[buf.name])}, not {_fmt(buf, want)}; "
              f"{_need(kind, a, b, c, m, n, k, level)}")
  return Placement(kind, level, sizes[level], a, b, c, m, n, k)


# Placement finders by lowering kind; jaxmercury.shard_map.fused_attention adds the ring-attention kind.
PLACEMENTS: dict[str, Callable] = {ALLGATHER: placement, REDUCESCATTER: placement}


def _dtype_problem(p: Placement) -> str | None:
  """Why the GEMM's buffers' dtypes do not fit the fused GEMM kernels, or None."""
  da, db, dc = (np.dtype(x.dtype) for x in (p.a, p.b, p.c))
  if da not in HALF or db != da or dc != da:
    return (f"buffers {p.a.name}, {p.b.name}, {p.c.name} are {da}, {db}, {dc}: the fused kernels take "
            "bf16 or fp16 operands of one dtype and write the result in it")
  return None


def _mesh_problem(schedule, p: Placement, *, every_process_device: bool) -> str | None:
  """Level L must hold every device of the mesh; a ring over several devices, every device of the process."""
  mesh = schedule.mesh
  total = math.prod(schedule.levels.values())
  if total != p.size:
    return (f"mesh level {p.level!r} holds {p.size} of the mesh's {total} devices; the fused kernels run over "
            "one level holding every device")
  if p.size > 1 and len(schedule.levels) > 1:
    return (f"the mesh has levels {list(schedule.levels)}; the fused kernels address peers by their index "
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


def _interprets(schedule, p: Placement) -> bool:
  mesh = schedule.mesh
  return isinstance(mesh, jax.sharding.Mesh) and mesh.devices.flat[0].platform == "cpu" and p.size == 1


def _stored(schedule, buf):
  return schedule.plan().storage[buf.name]


@dataclasses.dataclass(frozen=True)
class FusedLowering:
  """One fused lowering of the all-gather GEMM or GEMM + reduce-scatter schedules.

  Attributes:
    name: what ``Schedule.lower_with`` names.
    description: one line for ``str(schedule)`` and the docs.
    defaults: its parameters and their default values.
    rate_kernel: the local kernel whose measured rate prices its GEMM in the cost model.
    device_problem: ``(schedule, placement) -> reason | None`` for the mesh's devices.
    param_problem: ``(params, itemsize) -> reason | None``.
    tile: ``params -> (rows, cols, k)``: the multiples it pads one device's GEMM to.
    make: ``(placement, params, interpret) -> per-device function``.
    interpret: it runs on a one-device CPU mesh in Mosaic GPU interpret mode.
    kind: the placement it computes, ``"allgather"`` or ``"reducescatter"``.
  """

  name: str
  description: str
  defaults: Mapping[str, object]
  rate_kernel: str
  device_problem: Callable
  param_problem: Callable
  tile: Callable
  make: Callable
  interpret: bool = False
  kind: str = ALLGATHER

  def params(self, **given) -> dict:
    return {**self.defaults, **given}

  def place(self, schedule):
    """The schedule's placement for this lowering's kind (``PLACEMENTS``), or why it has none."""
    return PLACEMENTS[self.kind](schedule)

  def why_not(self, schedule) -> str | None:
    """None when this lowering applies to ``schedule``, else a sentence saying what prevents it."""
    p = self.place(schedule)
    if isinstance(p, str):
      return p
    if p.kind != self.kind:
      return (f"{self.name} computes {KIND_NAMES[self.kind]}; this schedule stores {_fmt(p.a, _stored(schedule, p.a))}, "
              f"{_fmt(p.b, _stored(schedule, p.b))}, {_fmt(p.c, _stored(schedule, p.c))}: {KIND_NAMES[p.kind]}")
    return p.dtype_problem() or self.device_problem(schedule, p)

  def check(self, schedule, params: Mapping | None = None):
    """Raises ``PreconditionError`` with ``why_not``'s reason, or a parameter's problem."""
    reason = self.why_not(schedule)
    if reason is None:
      unknown = sorted(set(params or {}) - set(self.defaults))
      if unknown:
        raise UnknownNameError(f"lower_with({self.name!r}): no parameter {unknown[0]!r}; parameters: "
                               f"{sorted(self.defaults)}")
      reason = self.param_problem(self.params(**(params or {})), np.dtype(schedule.program.reads[0].dtype).itemsize)
    if reason is not None:
      raise PreconditionError(f"lower_with({self.name!r}): {reason}")

  def interprets(self, schedule) -> bool:
    """Whether it would run in Mosaic GPU interpret mode (a CPU mesh of one device)."""
    p = self.place(schedule)
    return self.interpret and not isinstance(p, str) and _interprets(schedule, p)

  def build(self, schedule, **params) -> Callable:
    """The per-device function ``(a_local, b_local) -> c_local`` to run under ``jax.shard_map``."""
    self.check(schedule, params)
    p = self.place(schedule)
    return self.make(p, self.params(**params), self.interpret and _interprets(schedule, p))

  def label(self, params: Mapping) -> str:
    """``name(p=v, ...)`` with the parameters that differ from the defaults, in declared order."""
    shown = [f"{k}={params[k]}" for k in self.defaults if k in params and params[k] != self.defaults[k]]
    return f"{self.name}({', '.join(shown)})" if shown else self.name


# ------------------------------------------------------------------ ours: pallas_kernels.fused_allgather_matmul


def _tiles(params):
  from jaxmercury.pallas_kernels.mosaic_matmul import Tiles
  return Tiles(**params)


def _ours_params(params, itemsize) -> str | None:
  for key, v in params.items():
    if not isinstance(v, int) or isinstance(v, bool):
      return f"{key}={v!r} must be an int"
  return _tiles(params).problem(itemsize)


def _ours_devices(schedule, p: Placement) -> str | None:
  from jaxmercury.pallas_kernels.mosaic_matmul import hopper_only
  reason = _mesh_problem(schedule, p, every_process_device=False)
  if reason or not isinstance(schedule.mesh, jax.sharding.Mesh) or _interprets(schedule, p):
    return reason
  device = schedule.mesh.devices.flat[0]
  reason = hopper_only(device)
  if reason and device.platform == "cpu":
    reason += (f"; its Mosaic GPU interpret mode runs on CPU only where level {p.level!r} has one device "
               f"(it has {p.size})")
  return reason


def _ours_tile(params):
  t = _tiles(params)
  return t.tile_m, t.tile_n, t.tile_k


def _ours_make(kernel: str) -> Callable:
  """``make`` of our one-warpgroup kernel ``jaxmercury.pallas_kernels.<kernel>.<kernel>``."""
  def make(p: Placement, params, interpret: bool):
    fn = getattr(importlib.import_module(f"jaxmercury.pallas_kernels.{kernel}"), kernel)
    tiles, out_dtype = _tiles(params), p.c.dtype

    def per_device(a, b):
      return fn(a, b, p.level, tiles=tiles, out_dtype=out_dtype, num_ctas=INTERPRET_CTAS if interpret else None,
                interpret=interpret)
    return per_device
  return make


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


def _hopper_devices(every_process_device: bool) -> Callable:
  """``device_problem`` of a kernel without interpret mode: the mesh (``_mesh_problem``), then Hopper GPUs."""
  def problem(schedule, p) -> str | None:
    from jaxmercury.pallas_kernels.mosaic_matmul import hopper_only
    reason = _mesh_problem(schedule, p, every_process_device=every_process_device)
    if reason or not isinstance(schedule.mesh, jax.sharding.Mesh):
      return reason
    return hopper_only(schedule.mesh.devices.flat[0])
  return problem


def _jax_tile(params):
  cta_m, cta_n = _jax_cta(params)
  return cta_m, cta_n, params["tile_k"]


def _jax_make(p: Placement, params, interpret: bool):
  del interpret  # never: the kernel sizes its grid by the device's SM count
  from jax.experimental.pallas.ops.gpu import collective_matmul_mgpu as cm  # Hopper only: lazy

  from jaxmercury.pallas_kernels.peer_gemm import pad_to, round_up
  dim = cm.MatmulDimension
  config = cm.TuningConfig(tile_m=params["tile_m"], tile_n=params["tile_n"], tile_k=params["tile_k"],
                           max_concurrent_steps=params["max_concurrent_steps"],
                           grid_minor_dim=getattr(dim, params["grid_minor_dim"]),
                           grid_tile_width=params["grid_tile_width"],
                           wg_dimension=getattr(dim, params["wg_dimension"]))
  rows, cols, depth = _jax_tile(params)
  out_dtype = p.c.dtype

  def per_device(a, b):
    (m, k), n = a.shape, b.shape[1]
    mp, kp, np_ = round_up(m, rows), round_up(k, depth), round_up(n, cols)
    out = cm.all_gather_lhs_matmul(pad_to(a, mp, kp), pad_to(b, kp, np_), p.level, config=config, dtype=out_dtype)
    if (mp, np_) == (m, n):
      return out
    return out.reshape(p.size, mp, np_)[:, :m, :n].reshape(p.size * m, n)
  return per_device


# ------------------------------------------------------------------ ours: GEMM + reduce-scatter with two consumers


def _ws_tiles(params):
  from jaxmercury.pallas_kernels.fused_matmul_reducescatter_ws import WsTiles
  return WsTiles(**params)


def _ws_params(params, itemsize) -> str | None:
  del itemsize  # the kernel checks its operands' dtype
  for key, v in params.items():
    if key != "split" and (not isinstance(v, int) or isinstance(v, bool)):
      return f"{key}={v!r} must be an int"
  return _ws_tiles(params).problem()


def _ws_tile(params):
  t = _ws_tiles(params)
  return (*t.cta, t.tile_k)


def _ws_make(p: Placement, params, interpret: bool):
  del interpret  # never: JAX's interpreter does not run the warp-specialized pipeline
  from jaxmercury.pallas_kernels.fused_matmul_reducescatter_ws import fused_matmul_reducescatter_ws
  tiles, out_dtype = _ws_tiles(params), p.c.dtype

  def per_device(a, b):
    return fused_matmul_reducescatter_ws(a, b, p.level, tiles=tiles, out_dtype=out_dtype)
  return per_device


LOWERINGS: dict[str, FusedLowering] = {}


def register(lowering: FusedLowering) -> FusedLowering:
  if lowering.name in LOWERINGS:
    raise ValueError(f"fused lowering {lowering.name!r} is already registered")
  LOWERINGS[lowering.name] = lowering
  return lowering


register(FusedLowering(
    "fused_allgather_matmul",
    "our Mosaic GPU kernel (pallas_kernels.fused_allgather_matmul): A's row shards travel the ring by TMA "
    "stores into the left neighbour, overlapped with wgmma; shapes padded to its tiles",
    {"tile_m": 128, "tile_n": 128, "tile_k": 64, "max_concurrent_steps": 4}, "mosaic_matmul",
    _ours_devices, _ours_params, _ours_tile, _ours_make("fused_allgather_matmul"), interpret=True))

register(FusedLowering(
    "jax_allgather_lhs_matmul",
    "JAX's Mosaic GPU kernel (collective_matmul_mgpu.all_gather_lhs_matmul): warp-specialized persistent GEMM "
    "that forwards A's tiles to the left neighbour; shapes padded to its CTA tiles",
    JAX_DEFAULTS, "jax_mosaic_matmul", _hopper_devices(True), _jax_params, _jax_tile, _jax_make))

register(FusedLowering(
    "fused_matmul_reducescatter",
    "our Mosaic GPU kernel (pallas_kernels.fused_matmul_reducescatter): each tile's float32 running sum is "
    "stored by TMA into the left neighbour as the GEMM finishes it; shapes padded to its tiles",
    {"tile_m": 128, "tile_n": 128, "tile_k": 64, "max_concurrent_steps": 4}, "mosaic_matmul",
    _ours_devices, _ours_params, _ours_tile, _ours_make("fused_matmul_reducescatter"), interpret=True,
    kind=REDUCESCATTER))

register(FusedLowering(
    "fused_matmul_reducescatter_ws",
    "our warp-specialized Mosaic GPU kernel (pallas_kernels.fused_matmul_reducescatter_ws): JAX's Hopper GEMM "
    "body (two consumer warpgroups) per ring step, its epilogue adding the received sum and storing into the "
    "left neighbour; shapes padded to its CTA tiles",
    {"tile_m": 128, "tile_n": 128, "tile_k": 64, "max_concurrent_steps": 3, "split": "n"}, "jax_mosaic_matmul",
    _hopper_devices(False), _ws_params, _ws_tile, _ws_make, kind=REDUCESCATTER))


# ------------------------------------------------------------------ lookups used by the schedule, tuner, printer


def lowering(name: str) -> FusedLowering:
  """The registered lowering ``name``; ``UnknownNameError`` listing the known ones."""
  if name not in LOWERINGS:
    raise UnknownNameError(f"lower_with: no fused lowering {name!r}; known: {sorted(LOWERINGS)}")
  return LOWERINGS[name]


def why_not(name: str, schedule) -> str | None:
  """Why lowering ``name`` does not apply to ``schedule``, or None."""
  return lowering(name).why_not(schedule)


def applicable(schedule) -> list[str]:
  """Names of the lowerings that apply to ``schedule`` (``why_not`` is None), in registration order."""
  return [name for name, low in LOWERINGS.items() if low.why_not(schedule) is None]


def check(schedule):
  """Raises ``PreconditionError`` if the schedule's chosen lowering no longer applies (primitives after it)."""
  if schedule.lowering is not None:
    lowering(schedule.lowering).check(schedule, schedule.lowering_params)


def signature(schedule) -> tuple:
  """What a fused schedule computes: equal for two schedules that run the same kernel on the same blocks."""
  p = lowering(schedule.lowering).place(schedule)
  plan = schedule.plan()
  return (schedule.lowering, tuple(sorted(schedule.lowering_params.items())),
          tuple(sorted(plan.storage.items())), p.local_shape(schedule) if not isinstance(p, str) else p)


def summary(schedule) -> str:
  """The printer's line for a fused schedule."""
  low = lowering(schedule.lowering)
  p = low.place(schedule)
  level = p.level if not isinstance(p, str) else "?"
  mode = " (Mosaic GPU interpret mode)" if low.interprets(schedule) else ""
  return (f"lowered with {low.label(schedule.lowering_params)}{mode}: the whole nest runs as one fused kernel per "
          f"device, the ring over {level} inside it; gradients: the shard_map lowering's\n  {low.description}")


def gemm_shape(schedule) -> tuple[int, int, int, int]:
  """``(L, rows, depth, cols)``: one device runs ``L`` GEMMs of this shape (``Placement.local_shape``), padded."""
  from jaxmercury.pallas_kernels.peer_gemm import round_up
  low = lowering(schedule.lowering)
  p = placement(schedule)
  m, k, n = p.local_shape(schedule)
  rows, cols, depth = low.tile(low.params(**schedule.lowering_params))
  return p.size, round_up(m, rows), round_up(k, depth), round_up(n, cols)


def memory_bytes(schedule) -> int:
  """Per device: the stored blocks, the ring's receive buffers, and padded copies.

  All-gather: the A shards received from the ring, in A's dtype;
  reduce-scatter: the float32 partial sums received and a float32 result.
  """
  p = lowering(schedule.lowering).place(schedule)
  if not isinstance(p, Placement):
    return p.memory_bytes(schedule)
  size, mp, kp, np_ = gemm_shape(schedule)
  m, k, n = p.local_shape(schedule)
  item = np.dtype(p.a.dtype).itemsize
  padded = (mp, kp, np_) != (m, k, n)  # the kernel works on copies padded to its tiles
  if p.kind == ALLGATHER:
    total = (m * k + k * n + size * m * n + (size - 1) * mp * kp) * item
    return total + ((mp * kp + kp * np_ + size * mp * np_) * item if padded else 0)
  total = (size * m * k + k * n + m * n) * item + size * mp * np_ * 4
  return total + ((size * mp * kp + kp * np_) * item if padded else 0)


# ------------------------------------------------------------------ compiling


def compile_fused(schedule):
  """``f(*inputs) -> output`` on global arrays: the fused kernel under the plan's ``shard_map``, with a backward.

  The forward is the lowering's per-device function in place of the loop
  nest, inside the same wrapper as ``lower`` (padding, layouts, cropping);
  the backward is the vjp of the ordinary ``shard_map`` lowering of the same
  schedule (its rings transposed by JAX), recomputing nothing of the fused
  forward: a GEMM's vjp needs only A and B.
  """
  from jax.sharding import AxisType

  from jaxmercury.shard_map.lower import lower
  check(schedule)
  per_device = lowering(schedule.lowering).build(schedule, **schedule.lowering_params)
  forward = lower(schedule, jit=False, per_device=per_device)
  ordinary = lower(schedule, jit=False)
  explicit = any(t == AxisType.Explicit for t in getattr(schedule.mesh, "axis_types", ()))

  def like(grad, primal):  # a cotangent has its primal's dtype and, with explicit axes, its sharding
    grad = grad.astype(primal.dtype)
    return jax.sharding.reshard(grad, jax.typeof(primal).sharding) if explicit else grad

  @jax.custom_vjp
  def fused(*inputs):
    return forward(*inputs)

  def fwd(*inputs):
    return forward(*inputs), inputs

  def bwd(residuals, g):
    _, vjp = jax.vjp(ordinary, *residuals)
    return tuple(like(d, x) for d, x in zip(vjp(g), residuals))

  fused.defvjp(fwd, bwd)
  return jax.jit(fused)


from jaxmercury.shard_map import fused_attention  # noqa: E402,F401  registers the ring-attention lowering
