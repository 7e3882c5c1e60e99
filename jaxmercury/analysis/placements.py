"""A schedule's placement for the fused kernels, read from its plan, and whether a fused kernel applies.

The ordinary lowering runs a schedule's loop nest under ``jax.shard_map``. A
fused kernel (``kernels.registry.FusedKernel``) runs the whole nest as one
kernel per device instead, the ring inside it; it computes one placement
kind (``kernels.placements``). ``placement(schedule, kind)`` reads the plan's
layouts (not the strategy's name) and returns the schedule's placement of
that kind, or a sentence saying why it has none; ``why_not(kernel,
schedule)`` adds the kernel's own checks (dtypes, devices, parameters).
"""

from __future__ import annotations

from jaxmercury.analysis.layouts import Layout
from jaxmercury.errors import PreconditionError
from jaxmercury.kernels import fused_common, patterns, registry
from jaxmercury.kernels.placements import (
  ALLGATHER,
  KIND_NAMES,
  REDUCESCATTER,
  RING_ATTENTION,
  AttentionPlacement,
  GemmPlacement,
)
from jaxmercury.programs.masks import mask_of

# Per GEMM kind, the axis (by role) of A, B and C that level L splits.
SPLIT_ROLES = {ALLGATHER: ("m", "n", "n"), REDUCESCATTER: ("k", "k", "m")}


def layout_text(buf, layout) -> str:
  """``buf`` with each axis annotated by the mesh levels splitting it: ``A[m@x, k]``."""
  return buf.name + "[" + ", ".join(f"{a}@{'*'.join(lv)}" if lv else a for a, lv in zip(buf.axes, layout)) + "]"


def whole_nest_problem(schedule, *, zigzag: bool = False) -> str | None:
  """Why no fused kernel can replace ``schedule``'s nest (a patched block, a zigzag axis), or None.

  Args:
    schedule: the schedule.
    zigzag: whether the caller's placement takes axes stored in zigzag order (and checks them itself).
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
      return (f"buffer {buf.name} is stored {layout_text(buf, storage[buf.name])}, not "
              f"{layout_text(buf, Layout(want))}; {need}")
  return None


def _extent(schedule, axis: str) -> int:
  return schedule.padded.get(axis, schedule.program.axes[axis].extent)


# ------------------------------------------------------------------ GEMMs


def _need(kind: str, a, b, c, m, n, k, lv="L") -> str:
  if kind == ALLGATHER:
    shapes = f"{a.name}[{m}@{lv}, {k}], {b.name}[{k}, {n}@{lv}], {c.name}[{m}, {n}@{lv}]"
    what = f"{a.name}'s rows and {b.name}'s and {c.name}'s columns"
  else:
    shapes = f"{a.name}[{m}, {k}@{lv}], {b.name}[{k}@{lv}, {n}], {c.name}[{m}@{lv}, {n}]"
    what = f"{a.name}'s columns, {b.name}'s rows and {c.name}'s rows"
  return f"{KIND_NAMES[kind]} needs {what} split over one mesh level and nothing else split: {shapes}"


def gemm_placement(schedule) -> GemmPlacement | str:
  """The schedule's GEMM placement, or why it is neither fused GEMM placement.

  Reads the plan's storage layouts (the caller's ``in_shardings`` / ``out_sharding`` included): A split along
  its rows over one mesh level L is an all-gather GEMM (A ``[m@L, k]``, B ``[k, n@L]``, C ``[m, n@L]``), A split
  along its columns a GEMM + reduce-scatter (A ``[m, k@L]``, B ``[k@L, n]``, C ``[m@L, n]``); levels of size 1
  elsewhere are ignored (they split nothing).
  """
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
  return GemmPlacement(kind, level, schedule.levels[level], a, b, c, m, n, k,
                       (_extent(schedule, m), _extent(schedule, k), _extent(schedule, n)))


# ------------------------------------------------------------------ ring attention


def attention_placement(schedule) -> AttentionPlacement | str:
  """The schedule's ring-attention placement, or why the fused ring-attention kernels do not apply.

  The sequence of q, k, v and o split over one mesh level L holding every device, nothing else split (the
  ``ring`` and ``ring_zigzag`` strategies), queries and keys of one length, no padding; causal programs in
  natural order or with both sequence axes in the same zigzag order, in whole chunks per device. The kernels
  mask causally or not at all: a program with a window, segment ids or a mask array has no placement.
  """
  prog = schedule.program
  try:
    match = patterns.match("attention", prog)
  except PreconditionError as e:
    return f"the fused ring-attention kernels compute attention (loop-nest pattern 'attention'): {e}"
  if match.params.get("emit_lse"):
    return "the fused ring-attention lowering writes the output only; this program also writes the log-sum-exp"
  mask = mask_of(match.params)
  if extra := mask.kinds - {"causal"}:
    return (f"the fused ring-attention kernels mask causally or not at all, not by the program's {sorted(extra)} "
            f"({mask.describe()})")
  if reason := whole_nest_problem(schedule, zigzag=True):  # zigzag sequence axes: checked below
    return reason
  axes = {role: ax for ax, role in match.to_pattern.items()}
  q, k, v = (b for b in prog.reads if b.name not in mask.buffers)
  o = prog.writes
  extent = lambda role: prog.axes[axes[role]].extent
  padded = [ax for ax in (axes["i"], axes["j"], axes["d"]) if _extent(schedule, ax) != prog.axes[ax].extent]
  if padded:
    return f"axis {padded[0]!r} is padded; the fused kernel takes no padding (padded keys would be attended)"
  if extent("i") != extent("j"):
    return f"queries ({extent('i')}) and keys ({extent('j')}) differ in length; the fused kernel takes self-attention"
  if extent("d") % 64 or extent("d") > 192:  # 64 query rows x (64 keys + d) float32 values in one warpgroup
    return f"head dimension {axes['d']!r} = {extent('d')} must be a multiple of 64 and at most 192"
  q_layout = schedule.plan().storage[q.name]
  need = (f"the fused ring attention needs {q.name}[{axes['i']}@L], {k.name}[{axes['j']}@L], {v.name}[{axes['j']}@L], "
          f"{o.name}[{axes['i']}@L], nothing else split")
  level, n_split = splitting_level(schedule, q_layout[q.axes.index(axes["i"])])
  if level is None:
    return f"buffer {q.name} is stored {layout_text(q, q_layout)}: its sequence is split over {n_split} levels; {need}"
  split_axes = [(q, axes["i"]), (k, axes["j"]), (v, axes["j"]), (o, axes["i"])]
  if reason := split_problem(schedule, level, split_axes, need):
    return reason
  size = schedule.levels[level]
  chunks = _zigzag_chunks(schedule, axes, level, size)
  if isinstance(chunks, str):
    return chunks
  return AttentionPlacement(level, size, q, k, v, o, axes, {role: extent(role) for role in axes},
                            causal=bool(match.params.get("causal")),
                            order="natural" if chunks is None else "zigzag", chunks=chunks)


def _zigzag_chunks(schedule, axes, level: str, size: int) -> int | None | str:
  """The zigzag chunks of the sequence axes (None: natural order), or why the kernels cannot take their order."""
  zigzags, i, j = schedule.zigzags, axes["i"], axes["j"]
  if not zigzags:
    return None
  kernel = "the fused ring-attention kernel"
  other = [a for a in zigzags if a not in (i, j)]
  if other:
    return (f"axis {other[0]!r} is stored in zigzag order; {kernel} takes zigzag order on the sequence axes "
            f"{i!r} and {j!r} only")
  if zigzags.get(i) != zigzags.get(j):
    said = lambda a: f"in zigzag order in {zigzags[a]} chunks" if a in zigzags else "in natural order"
    return f"axis {i!r} is stored {said(i)} but axis {j!r} {said(j)}; {kernel} takes queries and keys in one order"
  chunks = zigzags[i]
  if chunks % size:
    return (f"axis {i!r} is stored in zigzag order in {chunks} chunks, not a multiple of the {size} devices of "
            f"level {level!r}; {kernel} takes whole chunks per device")
  return chunks


# ------------------------------------------------------------------ kernels on schedules

PLACEMENTS = {ALLGATHER: gemm_placement, REDUCESCATTER: gemm_placement, RING_ATTENTION: attention_placement}


def placement(schedule, kind: str):
  """The schedule's placement for a kernel of ``kind``, or why it has none (a sentence)."""
  return PLACEMENTS[kind](schedule)


def _fused(k) -> registry.FusedKernel:
  return registry.fused(k) if isinstance(k, str) else k


def place(k, schedule):
  """The schedule's placement for fused kernel ``k`` (a ``FusedKernel`` or its name), or why it has none."""
  return placement(schedule, _fused(k).placement)


def why_not(k, schedule, config=None) -> str | None:
  """None when fused kernel ``k`` (a ``FusedKernel`` or its name; at ``config``, default its defaults) runs
  ``schedule``, else why not."""
  k = _fused(k)
  p = placement(schedule, k.placement)
  if isinstance(p, str):
    return p
  if p.kind != k.placement:
    return (f"{k.name} computes {KIND_NAMES[k.placement]}; this schedule stores "
            f"{', '.join(layout_text(b, schedule.plan().storage[b.name]) for b in (p.a, p.b, p.c))}: "
            f"{KIND_NAMES[p.kind]}")
  reason = p.dtype_problem()
  if reason is None and k.problem is not None:
    reason = k.problem(p, config if config is not None else k.configure())
  return reason or k.devices(p, schedule.mesh)


def check(schedule):
  """Raises ``PreconditionError`` if the schedule's fused kernel does not (or no longer) apply."""
  if schedule.lowering is None:
    return
  k = registry.fused(schedule.lowering)
  reason = why_not(k, schedule, schedule.lowering_config)
  if reason is not None:
    raise PreconditionError(f"lower_with({k.name!r}): {reason}")


def of(schedule):
  """The placement of a schedule lowered with a fused kernel (``check`` first)."""
  return placement(schedule, registry.fused(schedule.lowering).placement)


def interprets(k, schedule) -> bool:
  """Whether fused kernel ``k`` (or its name) would run on ``schedule`` in Mosaic GPU interpret mode (a one-device
  CPU mesh)."""
  k = _fused(k)
  p = placement(schedule, k.placement)
  return k.interpret and not isinstance(p, str) and fused_common.interprets_on(p, schedule.mesh)


def applicable(schedule) -> list[str]:
  """Names of the fused kernels that run ``schedule`` at their defaults, in registration order."""
  return [k.name for k in registry.fused_kernels() if why_not(k, schedule) is None]


def offered(schedule) -> list[str]:
  """The applicable fused kernels the tuner and the graph search offer: those verified on GPUs for this placement,
  and in Mosaic GPU interpret mode (a one-device CPU mesh, where the tuner checks them) every one."""
  def trusted(k):
    return (k.unverified is None or interprets(k, schedule)
            or k.unverified(placement(schedule, k.placement)) is None)
  return [name for name in applicable(schedule) if trusted(registry.fused(name))]


def signature(schedule) -> tuple:
  """What a fused schedule computes: equal for two schedules that run the same kernel on the same blocks."""
  p = of(schedule)
  plan = schedule.plan()
  return (schedule.lowering, schedule.lowering_config, tuple(sorted(plan.storage.items())),
          tuple(sorted(schedule.zigzags.items())), p if isinstance(p, str) else (p.kind, p.level, p.local_shape()))


def runs_as(schedule) -> tuple[str, object]:
  """``(fused kernel name, configuration)`` whose program a fused schedule runs: on a mesh level of one device the
  kernel its own equals there (``FusedKernel.one_device``: its ring empty), else its own."""
  name, config = schedule.lowering, schedule.lowering_config
  same = registry.fused(name).one_device
  if same is not None:
    p = of(schedule)
    if not isinstance(p, str) and p.size == 1:
      return same(config) or (name, config)
  return name, config


def memory_bytes(schedule) -> int:
  """Per device: what a fused schedule's kernel holds (its ``memory`` hook)."""
  k = registry.fused(schedule.lowering)
  return k.memory(k, of(schedule), schedule.lowering_config)


def dual_kernel(schedule) -> registry.FusedKernel | None:
  """The fused kernel that runs the backward's collective GEMM of a fused GEMM schedule (``DualGemm``), or None
  where it cannot run on the mesh's devices (XLA's collectives then)."""
  k = registry.fused(schedule.lowering)
  dual = registry.fused(k.backward.dual)
  return dual if dual.devices(of(schedule), schedule.mesh) is None else None
