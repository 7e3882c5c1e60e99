"""Fused lowerings: a whole schedule run as one fused collective kernel per device.

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

Those two live in ``jaxmercury.shard_map.fused_gemm``; a third kind,
ring attention, causal or not (``ring``, ``ring_zigzag``: the sequence of
q, k, v and o split over L, in natural or zigzag order), in
``jaxmercury.shard_map.fused_attention``. This module holds what
they share: ``FusedLowering``, the registry and the lookups the schedule,
tuner and printer use, and ``compile_fused``.
``Schedule.lower_with(name)`` picks one of the lowerings registered here;
``Schedule.compile()`` then runs it under the same ``shard_map`` (the plan's
layouts, padding and global signature) with a backward, since Pallas kernels
have no autodiff: a ring attention's dual programs fed by the kernel's output
and log-sum-exp, a GEMM's dual fused GEMM fed by the rows its ring gathered
(``BACKWARDS``). The tuner
offers every lowering whose ``why_not`` is None as one more candidate.

Each ``FusedLowering`` has a name, a one-line description, the placement kind
it computes, ``why_not(schedule)`` (None when it applies, else a sentence
naming the buffer, mesh level, device, dtype or parameter that prevents it)
and ``build(schedule, **params)``, the per-device function
``(*input_blocks) -> output_block``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxmercury.errors import PreconditionError, UnknownNameError

HALF = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
INTERPRET_CTAS = 2  # persistent CTAs of our kernel in interpret mode (a CPU device reports no SM count)


# Per lowering kind: what it computes, in words, and how a schedule's placement of that kind is found
# (``schedule -> placement | reason``); each kind's module fills them in.
KIND_NAMES: dict[str, str] = {}
PLACEMENTS: dict[str, Callable] = {}


@dataclasses.dataclass(frozen=True)
class OwnBackward:
  """A placement kind's backward, fed by the fused kernel's own residuals (Pallas kernels have no autodiff).

  Attributes:
    schedule: ``fused schedule -> loop-nest schedule`` whose backward runs; the
      cost model prices that schedule's backward, with no forward run again;
      None where the cost model prices the kind's backward itself (GEMMs).
    attach: ``(fused schedule, per-device function) -> jitted f(*inputs)``:
      the fused forward with that backward.
    description: what computes the gradients, for the printer.
  """

  schedule: Callable | None
  attach: Callable
  description: str


# Per placement kind, its backward (each kind's module registers it).
BACKWARDS: dict[str, OwnBackward] = {}


def layout_text(buf, layout) -> str:
  """``buf`` with each axis annotated by the mesh levels splitting it: ``A[m@x, k]``."""
  return buf.name + "[" + ", ".join(f"{a}@{'*'.join(lv)}" if lv else a for a, lv in zip(buf.axes, layout)) + "]"


def mesh_problem(schedule, p, *, every_process_device: bool) -> str | None:
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


def interprets_on(schedule, p) -> bool:
  """Whether ``schedule`` runs a kernel on a one-device CPU mesh (Mosaic GPU interpret mode)."""
  mesh = schedule.mesh
  return isinstance(mesh, jax.sharding.Mesh) and mesh.devices.flat[0].platform == "cpu" and p.size == 1


def whole_nest_problem(schedule, *, zigzag: bool = False) -> str | None:
  """Why no fused lowering can replace ``schedule``'s nest (a patched block, a zigzag axis), or None.

  Args:
    schedule: the schedule.
    zigzag: whether the caller's placement takes axes stored in zigzag order
      (and checks them itself); the GEMM placements do not.
  """
  if schedule.kernel not in (None, "xla"):
    return (f"the block is patched with kernel {schedule.kernel!r}; a fused lowering replaces the whole nest, "
            "so it takes an unpatched schedule")
  if schedule.zigzags and not zigzag:
    return f"axis {next(iter(schedule.zigzags))!r} is stored in zigzag order; a fused lowering takes the natural order"
  return None


def splitting_level(schedule, levels) -> tuple[str | None, int]:
  """``(L, n)``: of the mesh ``levels`` splitting one axis, the one of size above 1 (or, where none is, the last,
  which splits nothing), and ``n``, how many of size above 1 there are; ``L`` is None unless ``n <= 1`` and
  ``levels`` is not empty."""
  split = [lv for lv in levels if schedule.levels[lv] > 1]
  if len(split) > 1 or not levels:
    return None, len(split)
  return (split[0] if split else levels[-1]), len(split)


def split_problem(schedule, level: str, split_axes, need: str) -> str | None:
  """The first of ``split_axes`` (``(buffer, axis)`` pairs) whose buffer is not stored with that axis alone split
  over ``level`` (levels of size 1 elsewhere split nothing), as a sentence ending in ``need``; None if all are."""
  storage, sizes = schedule.plan().storage, schedule.levels
  for buf, axis in split_axes:
    kept = tuple(tuple(lv for lv in e if lv == level or sizes[lv] > 1) for e in storage[buf.name])
    want = tuple((level,) if ax == axis else () for ax in buf.axes)
    if kept != want:
      return (f"buffer {buf.name} is stored {layout_text(buf, storage[buf.name])}, not {layout_text(buf, want)}; "
              f"{need}")
  return None


def stored(schedule, buf):
  """How ``schedule`` stores ``buf``: per axis, the mesh levels splitting it."""
  return schedule.plan().storage[buf.name]


@dataclasses.dataclass(frozen=True)
class FusedLowering:
  """One fused lowering: a kernel that runs a whole schedule of one placement kind per device.

  Attributes:
    name: what ``Schedule.lower_with`` names.
    description: one line for ``str(schedule)`` and the docs.
    defaults: its parameters and their default values.
    rate_kernel: the local kernel whose measured rate prices its compute in
      the cost model; or its own name: ``calibrate.fused_rates`` measures the
      kernel itself (on one device), into ``Machine.fused_flops_per_s``.
    device_problem: ``(schedule, placement) -> reason | None`` for the mesh's devices.
    param_problem: ``(params, itemsize) -> reason | None``.
    tile: ``params -> (rows, cols, depth)``: the multiples it pads one device's blocks to.
    make: ``(placement, params, interpret) -> per-device function``; an
      all-gather GEMM's also takes ``gathered=True``, returning ``(C block,
      all_gather(A) or None)`` for its backward (``fused_gemm_backward``).
    interpret: it runs on a one-device CPU mesh in Mosaic GPU interpret mode.
    kind: the placement kind it computes (``KIND_NAMES``).
    fit_problem: ``(placement, params, schedule) -> reason | None``: whether
      the parameters fit this schedule's blocks (a kernel that does not pad
      them); None: any that pass ``param_problem`` do.
    unverified: ``placement -> reason | None``: why the kernel is not yet
      trusted on GPUs for this placement (it has not run there); the tuner and
      the graph search then leave it out (``offered``), ``lower_with`` still
      takes it. None: verified.
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
  kind: str = "allgather"
  fit_problem: Callable | None = None
  unverified: Callable | None = None

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
      return (f"{self.name} computes {KIND_NAMES[self.kind]}; this schedule stores {p.describe(schedule)}: "
              f"{KIND_NAMES[p.kind]}")
    reason = p.dtype_problem() or self.device_problem(schedule, p)
    if reason is None and self.fit_problem is not None:  # its default parameters must fit
      reason = self.fit_problem(p, self.params(), schedule)
    return reason

  def check(self, schedule, params: Mapping | None = None):
    """Raises ``PreconditionError`` with ``why_not``'s reason, or a parameter's problem."""
    reason = self.why_not(schedule)
    if reason is None:
      unknown = sorted(set(params or {}) - set(self.defaults))
      if unknown:
        raise UnknownNameError(f"lower_with({self.name!r}): no parameter {unknown[0]!r}; parameters: "
                               f"{sorted(self.defaults)}")
      chosen = self.params(**(params or {}))
      reason = self.param_problem(chosen, np.dtype(schedule.program.reads[0].dtype).itemsize)
      if reason is None and self.fit_problem is not None:
        reason = self.fit_problem(self.place(schedule), chosen, schedule)
    if reason is not None:
      raise PreconditionError(f"lower_with({self.name!r}): {reason}")

  def interprets(self, schedule) -> bool:
    """Whether it would run in Mosaic GPU interpret mode (a CPU mesh of one device)."""
    p = self.place(schedule)
    return self.interpret and not isinstance(p, str) and interprets_on(schedule, p)

  def build(self, schedule, **params) -> Callable:
    """The per-device function ``(*input_blocks) -> output_block`` to run under ``jax.shard_map``."""
    self.check(schedule, params)
    p = self.place(schedule)
    return self.make(p, self.params(**params), self.interpret and interprets_on(schedule, p))

  def label(self, params: Mapping) -> str:
    """``name(p=v, ...)`` with the parameters that differ from the defaults, in declared order."""
    shown = [f"{k}={params[k]}" for k in self.defaults if k in params and params[k] != self.defaults[k]]
    return f"{self.name}({', '.join(shown)})" if shown else self.name


def hopper_devices(every_process_device: bool) -> Callable:
  """``device_problem`` of a kernel without interpret mode: the mesh (``mesh_problem``), then Hopper GPUs."""
  def problem(schedule, p) -> str | None:
    from jaxmercury.pallas_kernels.mosaic_matmul import hopper_only
    reason = mesh_problem(schedule, p, every_process_device=every_process_device)
    if reason or not isinstance(schedule.mesh, jax.sharding.Mesh):
      return reason
    return hopper_only(schedule.mesh.devices.flat[0])
  return problem


def interpretable_devices(schedule, p) -> str | None:
  """``device_problem`` of a kernel with interpret mode: Hopper GPUs, or one CPU device (interpret mode)."""
  from jaxmercury.pallas_kernels.mosaic_matmul import hopper_only
  reason = mesh_problem(schedule, p, every_process_device=False)
  if reason or not isinstance(schedule.mesh, jax.sharding.Mesh) or interprets_on(schedule, p):
    return reason
  device = schedule.mesh.devices.flat[0]
  reason = hopper_only(device)
  if reason and device.platform == "cpu":
    reason += (f"; its Mosaic GPU interpret mode runs on CPU only where level {p.level!r} has one device "
               f"(it has {p.size})")
  return reason


LOWERINGS: dict[str, FusedLowering] = {}


def register(lowering: FusedLowering) -> FusedLowering:
  if lowering.name in LOWERINGS:
    raise ValueError(f"fused lowering {lowering.name!r} is already registered")
  LOWERINGS[lowering.name] = lowering
  return lowering


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


def offered(schedule) -> list[str]:
  """The applicable lowerings the tuner and the graph search offer: those verified on GPUs for this placement,
  and in Mosaic GPU interpret mode (a one-device CPU mesh, where the tuner checks them) every one."""
  def trusted(low):
    return low.unverified is None or low.interprets(schedule) or low.unverified(low.place(schedule)) is None
  return [name for name in applicable(schedule) if trusted(LOWERINGS[name])]


def check(schedule):
  """Raises ``PreconditionError`` if the schedule's chosen lowering no longer applies (primitives after it)."""
  if schedule.lowering is not None:
    lowering(schedule.lowering).check(schedule, schedule.lowering_params)


def signature(schedule) -> tuple:
  """What a fused schedule computes: equal for two schedules that run the same kernel on the same blocks."""
  p = lowering(schedule.lowering).place(schedule)
  plan = schedule.plan()
  return (schedule.lowering, tuple(sorted(schedule.lowering_params.items())),
          tuple(sorted(plan.storage.items())), tuple(sorted(schedule.zigzags.items())),
          p.local_shape(schedule) if not isinstance(p, str) else p)


def summary(schedule) -> str:
  """The printer's line for a fused schedule."""
  low = lowering(schedule.lowering)
  p = low.place(schedule)
  level = p.level if not isinstance(p, str) else "?"
  mode = " (Mosaic GPU interpret mode)" if low.interprets(schedule) else ""
  grads = BACKWARDS[low.kind].description
  return (f"lowered with {low.label(schedule.lowering_params)}{mode}: the whole nest runs as one fused kernel per "
          f"device, the ring over {level} inside it; gradients: {grads}\n  {low.description}")


def memory_bytes(schedule) -> int:
  """Per device: the stored blocks, the ring's receive buffers and padded copies (the placement's count)."""
  return lowering(schedule.lowering).place(schedule).memory_bytes(schedule)


# ------------------------------------------------------------------ compiling


def ordinary_schedule(schedule):
  """``schedule`` without its lowering: the same layouts and rings as a loop nest, its block on XLA's body (what
  the fused kernel computes, and what a ring attention's backward is built from)."""
  plain = schedule.copy()
  plain.lowering, plain.lowering_params = None, {}
  plain.trace = [step for step in plain.trace if step["primitive"] != "lower_with"]
  return plain


def compile_fused(schedule):
  """``f(*inputs) -> output`` on global arrays: the fused kernel under the plan's ``shard_map``, with a backward.

  The forward is the lowering's per-device function in place of the loop
  nest, inside the same wrapper as ``lower`` (padding, layouts, cropping).
  Pallas kernels have no autodiff, so each kind attaches its own backward
  (``BACKWARDS``), fed by the kernel's own residuals: a ring attention's dual
  programs from its output and log-sum-exp, a GEMM's dual fused GEMM from
  the rows its ring gathered (``fused_gemm_backward``).
  """
  check(schedule)
  low = lowering(schedule.lowering)
  return BACKWARDS[low.kind].attach(schedule, low.build(schedule, **schedule.lowering_params))


from jaxmercury.shard_map import fused_attention, fused_gemm, fused_gemm_backward  # noqa: E402,F401  register
