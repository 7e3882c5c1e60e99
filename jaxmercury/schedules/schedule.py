"""``Schedule``: the CommIR loop nest of a program on a mesh, and its primitives."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import jax
from jax.sharding import PartitionSpec

from jaxmercury.analysis import dispatch as dispatches
from jaxmercury.analysis import packed, placements
from jaxmercury.analysis import plan as plans
from jaxmercury.errors import PreconditionError, ProgramError, ScheduleError, UnknownNameError
from jaxmercury.ir.dsl import check_name
from jaxmercury.ir.loops import PARALLEL, SERIAL, VECTOR, Loop
from jaxmercury.ir.program import Program
from jaxmercury.kernels import config as configs
from jaxmercury.kernels import registry
from jaxmercury.kernels.registry import KernelChoice
from jaxmercury.programs import masks
from jaxmercury.schedules import checks, printer
from jaxmercury.schedules import trace as trace_format
from jaxmercury.schedules.trace import replay

SHARD, REPLICATE = "shard", "replicate"

# ``Schedule.compile``'s one route to the lowering layer (above this one): ``jaxmercury.lowering`` registers
# ``compile_schedule(schedule, *, differentiable)`` here when it is imported, which ``import jaxmercury`` does.
_COMPILER: list[Callable] = []


def register_compiler(compile_schedule: Callable):
  """Sets the function ``Schedule.compile`` lowers with (``jaxmercury.lowering.compile_schedule``)."""
  _COMPILER[:] = [compile_schedule]


class Schedule:
  """A program's loop nest on a device mesh, rewritten by schedule primitives.

  Computation primitives (``tile``, ``join``, ``reorder``, ``patch``, and
  ``pad`` and ``zigzag``) rewrite the nest; communication primitives (``parallelize``,
  ``shift``, ``shard``, ``replicate``) annotate it; ``lower_with`` picks a
  fused kernel to run the whole nest. Every call checks its
  preconditions, raises ``ScheduleError`` naming the problem, and is recorded
  in ``trace`` (see ``to_json`` / ``from_json``). A schedule changes only
  through its primitives: its kernel, lowering and trace are read-only, and
  its communication plan is derived once per change (``plan()``).
  ``compile()`` lowers the schedule to a ``jax.shard_map`` program.

  Args:
    program: the ``Program`` to schedule.
    mesh: a ``jax.sharding.Mesh``; its axis names are the mesh levels. An
      ``AbstractMesh`` (no devices) serves planning and cost prediction on
      meshes this machine does not have; it cannot be compiled.
    in_shardings: optional ``PartitionSpec`` per input, over the inputs'
      own dimensions: the layouts the caller's arrays have. Where they differ
      from the schedule's layouts the lowering inserts all-to-all, all-gather
      or slicing.
    out_sharding: optional ``PartitionSpec`` the output must have.
  """

  def __init__(self, program: Program, mesh: jax.sharding.Mesh, *,
               in_shardings: Sequence[PartitionSpec | None] | None = None,
               out_sharding: PartitionSpec | None = None):
    if not isinstance(program, Program):
      raise ProgramError(f"Schedule needs a jaxmercury Program, got {type(program).__name__}")
    checks.check_program(program)
    checks.check_mesh(mesh)
    self.program = program
    self.mesh = mesh
    self.levels: dict[str, int] = dict(mesh.shape)
    self.loops: list[Loop] = [
        Loop(a.name, a.name, a.extent, program.kinds[a.name]) for a in program.loops]
    self.factors: dict[str, list[str]] = {a.name: [a.name] for a in program.loops}
    self.padded: dict[str, int] = {a.name: a.extent for a in program.loops}
    self.zigzags: dict[str, int] = {}
    self.balanced = False  # ``balance``: the zigzag axes hold the segments' positions spread evenly first
    self.placements: dict[tuple[str, str], tuple] = {}
    self._kernel: KernelChoice | None = None
    self._lowering: KernelChoice | None = None  # a fused kernel (``lower_with``); None: the loop nest
    self._dispatched: dict | None = None  # a routed exchange (``dispatch``): its loop and options
    self.in_shardings, self.out_sharding = checks.check_layouts(program, self.levels, in_shardings, out_sharding)
    self._trace: list[dict] = []
    self._plan = None  # derived once per change (``plan``)

  # ------------------------------------------------------------ read-only state
  @property
  def trace(self) -> list[dict]:
    """The primitives applied, in order, as data (a copy: a schedule changes only through its primitives)."""
    return copy.deepcopy(self._trace)

  @property
  def kernel(self) -> str | None:
    """The local kernel ``patch`` put in place of the block (None: the program's own body)."""
    return self._kernel.name if self._kernel else None

  @property
  def kernel_config(self):
    """The patched kernel's configuration (None: no kernel, or one without parameters)."""
    return self._kernel.config if self._kernel else None

  @property
  def lowering(self) -> str | None:
    """The fused kernel ``lower_with`` runs the whole nest as (None: the loop nest)."""
    return self._lowering.name if self._lowering else None

  @property
  def dispatched(self) -> dict | None:
    """``dispatch``'s loop and options (``{"loop", "exchange", "gemm"}``), or None: no routed exchange."""
    return dict(self._dispatched) if self._dispatched else None

  @property
  def lowering_config(self):
    return self._lowering.config if self._lowering else None

  # ----------------------------------------------------------------- lookup
  def loop(self, name: str) -> Loop:
    for lp in self.loops:
      if lp.name == name:
        return lp
    raise UnknownNameError(
        f"no loop {name!r} in the {self.program.name} nest; loops: {[lp.name for lp in self.loops]}")

  def loop_or_none(self, name) -> Loop | None:
    return next((lp for lp in self.loops if lp.name == name), None)

  def _level(self, level: str, primitive: str) -> int:
    return checks.check_level(self.levels, level, primitive)

  def _parallel(self, name: str, primitive: str) -> Loop:
    lp = self.loop(name)
    if lp.role != PARALLEL:
      raise PreconditionError(
          f"{primitive}: loop {name!r} is not parallel ({lp.role}); parallelize it onto a mesh level first")
    return lp

  def _record(self, primitive: str, *args, **kwargs):
    self._trace.append({"primitive": primitive, "args": list(args),
                        "kwargs": {k: v for k, v in kwargs.items() if v is not None}})
    self._plan = None

  def _check_outer_distributed(self, lp: Loop, primitive: str):
    for name in self.factors[lp.axis]:
      if name == lp.name:
        return
      if not self.loop(name).distributed:
        raise PreconditionError(
            f"{primitive}({lp.name!r}): loop {name!r} tiles axis {lp.axis!r} outside {lp.name!r} and is "
            f"{self.loop(name).role}; only the outermost factors of an axis can be spread over the mesh")

  def _commit(self, saved: "Schedule", primitive: str, *args, **kwargs):
    """Records a communication primitive once the whole schedule still validates.

    On failure the schedule is restored: a rejected call changes nothing.
    """
    self._plan = None
    try:
      plan = self.validate()
    except ScheduleError:
      self.__dict__.update(saved.__dict__)
      raise
    self._record(primitive, *args, **kwargs)
    self._plan = plan

  def copy(self) -> "Schedule":
    """An independent copy, sharing the program and mesh."""
    new = copy.copy(self)
    new.loops = [copy.copy(lp) for lp in self.loops]
    new.factors = {k: list(v) for k, v in self.factors.items()}
    new.padded = dict(self.padded)
    new.zigzags = dict(self.zigzags)
    new.placements = dict(self.placements)
    new._trace = copy.deepcopy(self._trace)
    return new

  def _rebuilt(self, steps, *, in_shardings=None, out_sharding=None) -> "Schedule":
    """A fresh schedule of the same program and mesh with ``steps`` applied through the primitives."""
    fresh = Schedule(self.program, self.mesh, in_shardings=in_shardings, out_sharding=out_sharding)
    return replay(fresh, steps)

  def without(self, *primitives: str, buffer: str | None = None) -> "Schedule":
    """The same schedule without its steps of the named primitives (``"patch"``: the block back on the program's
    body; ``"lower_with"``: the loop nest instead of a fused kernel; ``"shard", "replicate"`` with ``buffer``:
    that buffer's placements), rebuilt through the primitives."""
    def dropped(step):
      return step["primitive"] in primitives and (buffer is None or step["args"][:1] == [buffer])
    steps = [step for step in self._trace if not dropped(step)]
    return self._rebuilt(copy.deepcopy(steps), in_shardings=self.in_shardings, out_sharding=self.out_sharding)

  def with_layouts(self, in_shardings=None, out_sharding=None) -> "Schedule":
    """The same schedule for callers whose arrays have the given layouts (``PartitionSpec`` per input, and the
    output's), rebuilt through the primitives."""
    return self._rebuilt(copy.deepcopy(self._trace), in_shardings=in_shardings, out_sharding=out_sharding)

  # ---------------------------------------------------- computation primitives
  def pad(self, axis: str, multiple: int) -> "Schedule":
    """Pads a loop axis up to a multiple, so that it can be tiled evenly.

    Inputs are zero-padded along the axis and the output is cropped. Padded
    positions of a reduction axis read zeros: bodies whose zeros are not the
    reduction's identity mask them with ``ctx.valid(axis)`` (attention does).

    Preconditions: ``axis`` is a loop axis not yet tiled or distributed.

    Before / after (``pad("i", 8)`` with I = 6)::

      for i in 6: C[i] += ...        for i in 8: C[i] += ...   # i >= 6 cropped
    """
    if axis not in self.factors:
      raise UnknownNameError(f"pad: {axis!r} is not a loop axis; loop axes: {list(self.factors)}")
    if not isinstance(multiple, int) or multiple < 1:
      raise PreconditionError(f"pad({axis!r}): multiple must be a positive int, got {multiple!r}")
    if len(self.factors[axis]) != 1 or self.loop(self.factors[axis][0]).role != VECTOR:
      raise PreconditionError(f"pad({axis!r}): pad an axis before tiling or distributing it")
    lp = self.loop(self.factors[axis][0])
    lp.extent = self.padded[axis] = -(-self.padded[axis] // multiple) * multiple
    self._record("pad", axis, multiple)
    return self

  def zigzag(self, axis: str, chunks: int) -> "Schedule":
    """Stores a loop axis in zigzag order: true chunks 0, c-1, 1, c-2, ...

    Spread over ``chunks / 2`` ranks, rank ``r`` then holds chunks ``r`` and
    ``c-1-r``: every rank gets the same share of a causal mask's work. The
    lowering puts inputs in storage order and the output back in true order;
    bodies see true positions through ``ctx.positions``.

    Preconditions: ``axis`` is a loop axis not yet tiled, padded or
    zigzagged; ``chunks`` is even and divides its extent.

    Before / after (``zigzag("i", 4)`` with I = 8, then tile and parallelize)::

      parallel i0 in 2 @ x:            parallel i0 in 2 @ x:
        i = 4*i0 + i1                    rank 0: i in {0,1, 6,7}; rank 1: {2,3, 4,5}
    """
    if axis not in self.factors:
      raise UnknownNameError(f"zigzag: {axis!r} is not a loop axis; loop axes: {list(self.factors)}")
    lp = self.loop(self.factors[axis][0])
    if len(self.factors[axis]) != 1 or lp.role != VECTOR or axis in self.zigzags or \
        self.padded[axis] != self.program.axes[axis].extent:
      raise PreconditionError(f"zigzag({axis!r}): zigzag an axis before tiling, padding or distributing it")
    if not isinstance(chunks, int) or chunks < 2 or chunks % 2 or lp.extent % chunks:
      raise PreconditionError(
          f"zigzag({axis!r}, {chunks!r}): chunks must be even and divide the axis extent {lp.extent}")
    self.zigzags[axis] = chunks
    self._record("zigzag", axis, chunks)
    return self

  def balance(self, chunks: int) -> "Schedule":
    """Stores the queries and keys of packed rows so that every rank of a zigzag split keeps as many pairs.

    A packed row's long documents give the ranks of a sequence split very
    unequal work (a causal mask's pairs grow with the square of a
    document's length). Before the schedule runs, each row is permuted by
    ``programs.packing.balanced_order`` of its segment ids: every segment's
    positions spread evenly over ``chunks`` chunks, in their order; the
    chunks are then stored in zigzag order (as ``zigzag("i", chunks)`` and
    ``zigzag("j", chunks)``), so that a rank holding chunks ``r`` and
    ``chunks - 1 - r`` keeps about ``1 / ranks`` of every document's pairs.
    The output (and every gradient) is permuted back. The permutation is
    computed from the segment ids inside the compiled program (static
    shapes); since it keeps each segment's positions in their order, a
    causal mask compares the stored positions as it would the true ones, and
    every kernel that takes a zigzag order takes it. A row whose key ids
    the queries hold at other positions keeps its order.

    Preconditions: attention with segment ids (``q_segment_ids``,
    ``kv_segment_ids``), queries and keys of one length, no window (it
    measures distances the order does not keep) and no mask array; the
    sequence axes are not yet tiled, padded or zigzagged; ``chunks`` is even
    and divides their extent.

    Before / after (``balance(4)`` on a row of documents A (6 positions) and
    B (2), split over 2 ranks; kept causal pairs 10 and 14, then 11 and 13)::

      rank 0: A0 A1 A2 A3          rank 0: A0 A1 | A5 B1  (chunks 0 and 3)
      rank 1: A4 A5 B0 B1          rank 1: A2 B0 | A3 A4  (chunks 1 and 2)
    """
    prog = self.program
    mask = masks.mask_of(prog.params)
    names = {b.name for b in prog.reads}
    where = f"balance({chunks!r})"
    if not {masks.Q_SEGMENTS, masks.KV_SEGMENTS} <= names or not {"i", "j"} <= set(self.factors):
      raise PreconditionError(f"{where}: {prog.name} reads no segment ids over sequence axes 'i' and 'j'; balance "
                              "spreads the documents of packed rows (attention with segment_ids=True)")
    if prog.axes["i"].extent != prog.axes["j"].extent:
      raise PreconditionError(f"{where}: queries ({prog.axes['i'].extent}) and keys ({prog.axes['j'].extent}) "
                              "differ in length; balance permutes both sequences alike (self-attention)")
    if mask.window is not None or mask.mask_axes is not None:
      raise PreconditionError(f"{where}: the program masks by {mask.describe()}; balance keeps each segment's "
                              "order, not its distances (a window) nor a mask array's pairs: causal masks or none")
    try:
      self.copy().zigzag("i", chunks).zigzag("j", chunks)
    except PreconditionError as e:
      raise PreconditionError(f"{where}: {e}") from None
    self.zigzag("i", chunks).zigzag("j", chunks)
    del self._trace[-2:]  # recorded as one step, balance
    self.balanced = True
    self._record("balance", chunks)
    return self

  def tile(self, loop: str, factor: int, names: Sequence[str] | None = None) -> "Schedule":
    """Splits a loop into ``factor`` tiles: an outer serial loop and an inner loop.

    Preconditions: ``loop`` exists and is not distributed; ``factor`` divides
    its extent; the new names are unused.

    Before / after (``tile("j", 4)`` with J = 16)::

      for j in 16:                 for j0 in 4:           # serial
        C[i] += A[i,j] * B[j]        for j1 in 4:
                                       C[i] += A[i, 4*j0+j1] * B[4*j0+j1]

    Args:
      loop: the loop to split.
      factor: the outer loop's extent (the number of tiles).
      names: the (outer, inner) names; default ``loop + "0"``, ``loop + "1"``.
    """
    lp = self.loop(loop)
    if lp.distributed:
      raise PreconditionError(f"tile({loop!r}): loop is distributed; tile before parallelize/shift")
    if not isinstance(factor, int) or factor < 1 or lp.extent % factor:
      raise PreconditionError(
          f"tile({loop!r}, {factor!r}): factor must divide the loop's extent {lp.extent}"
          + ("" if self.padded[lp.axis] != lp.extent else
             f"; pad({lp.axis!r}, {factor}) first to tile unevenly"))
    outer, inner = names or (loop + "0", loop + "1")
    taken = {x.name for x in self.loops} - {loop}
    for n in (outer, inner):
      check_name(n, "loop", PreconditionError)
      if n in taken or outer == inner:
        raise PreconditionError(f"tile({loop!r}): loop name {n!r} is already used; pass names=")
    at = self.loops.index(lp)
    o = Loop(outer, lp.axis, factor, lp.kind, role=SERIAL)
    i = Loop(inner, lp.axis, lp.extent // factor, lp.kind, role=lp.role)
    self.loops[at:at + 1] = [o, i]
    fs = self.factors[lp.axis]
    k = fs.index(loop)
    fs[k:k + 1] = [outer, inner]
    self._record("tile", loop, factor, names=list(names) if names else None)
    return self

  def join(self, outer: str, inner: str, name: str | None = None) -> "Schedule":
    """Merges two adjacent loops over consecutive factors of one axis.

    Preconditions: ``outer`` directly encloses ``inner`` in the nest and is
    the next-major factor of the same axis; neither is distributed. The
    merged loop runs as ``inner`` did, so ``join`` undoes ``tile``.

    Before / after (``join("j0", "j1")``)::

      for j0 in 4:                 for j in 16:
        for j1 in 4: ...             ...

    Args:
      outer: the enclosing loop.
      inner: the enclosed loop.
      name: the merged loop's name; default ``outer``.
    """
    o, i = self.loop(outer), self.loop(inner)
    if o.axis != i.axis:
      raise PreconditionError(
          f"join({outer!r}, {inner!r}): loops iterate different axes ({o.axis!r}, {i.axis!r}); "
          "only factors of one axis can be joined")
    fs = self.factors[o.axis]
    if fs.index(inner) != fs.index(outer) + 1 or self.loops.index(i) != self.loops.index(o) + 1:
      raise PreconditionError(
          f"join({outer!r}, {inner!r}): {outer!r} must directly enclose {inner!r} and be its next-major factor")
    if o.distributed or i.distributed:
      raise PreconditionError(f"join({outer!r}, {inner!r}): distributed loops cannot be joined")
    merged = name or outer
    check_name(merged, "loop", PreconditionError)
    if merged in {x.name for x in self.loops} - {outer, inner}:
      raise PreconditionError(f"join: loop name {merged!r} is already used")
    role = i.role  # the merged loop runs as the inner one did: join undoes tile
    at = self.loops.index(o)
    self.loops[at:at + 2] = [Loop(merged, o.axis, o.extent * i.extent, o.kind, role=role)]
    k = fs.index(outer)
    fs[k:k + 2] = [merged]
    self._record("join", outer, inner, name=name)
    return self

  def reorder(self, *loops: str) -> "Schedule":
    """Permutes the named loops into the given order, in the slots they occupy.

    Preconditions: the loops exist and are distinct; parallel loops stay
    outside the others.

    Before / after (``reorder("j", "i")``)::

      for i in I:                  for j in J:
        for j in J: ...              for i in I: ...
    """
    if len(set(loops)) != len(loops):
      raise PreconditionError(f"reorder{loops}: a loop is named twice")
    picked = [self.loop(n) for n in loops]
    slots = sorted(self.loops.index(lp) for lp in picked)
    new = list(self.loops)
    for slot, lp in zip(slots, picked):
      new[slot] = lp
    _check_parallel_outermost(new)
    self.loops = new
    self._record("reorder", *loops)
    return self

  def patch(self, kernel: str | KernelChoice, **params) -> "Schedule":
    """Replaces the innermost block computation by a registered local kernel.

    The block is the sub-nest left inside every tiled, parallel and shifted
    loop; the kernel must implement its loop-nest pattern exactly (see
    ``jaxmercury.kernels.patterns``: same buffers and loops up to axis
    names, same reduction, same body).

    Preconditions: a local kernel named ``kernel`` is registered; the program
    matches one of its patterns; it accepts the program's dtypes; it runs on
    the mesh's devices; ``params`` are fields of its configuration and among
    their choices (``kernel`` may also be a ``KernelChoice``, a kernel and its
    configuration).

    Before / after (``patch("cudnn_attention")``)::

      parallel i0 in 8 @ x:                     parallel i0 in 8 @ x:
        for j0 in 8 (shift i0 @ x):               for j0 in 8 (shift i0 @ x):
          for b, hk, g, i1, j1:                     cudnn_attention(o[i0], q[i0], k[j0], v[j0])
            o[..] <- merge(q . k, v)
    """
    if isinstance(kernel, KernelChoice):
      params = {**configs.changed(kernel.config), **params}
      kernel = kernel.name
    k = registry.local(kernel)
    config = k.configure(params)
    k.block(self.program, self.mesh, config)  # raises where it does not apply or the configuration does not build
    self._kernel = KernelChoice(k.name, config)
    self._record("patch", k.name, **configs.changed(config))
    return self

  def lower_with(self, lowering: str, **params) -> "Schedule":
    """Runs the whole nest as one fused kernel per device instead of the ``shard_map`` loop nest.

    The fused kernels (``kernels.registry.FusedKernel``; ``registry.fused_names()``) each compute one placement
    kind (``kernels.placements``): all-gather GEMMs (``fused_allgather_matmul`` and its ``_comm`` and ``_ws``
    variants, JAX's ``jax_allgather_lhs_matmul``), GEMM + reduce-scatter (``fused_matmul_reducescatter`` and
    ``_ws``) and ring attention (``fused_ring_attention`` and ``_ws``); ``params`` are fields of the kernel's
    configuration dataclass. ``compile()`` runs the kernel under the same ``shard_map`` layouts, padding and
    global signature; gradients come from the kernel's declared backward: the dual fused GEMM fed by the rows
    the forward's ring gathered (a GEMM's), or the dual programs fed by the kernel's output and log-sum-exp (a
    ring attention's).

    Preconditions (the error gives ``analysis.placements.why_not``): the block is not patched; the plan stores
    the buffers as the kernel's placement kind needs, split over one mesh level L and nothing else split (as
    ``allgather_matmul`` / ``async_tp``, ``matmul_reducescatter`` or ``ring`` / ``ring_zigzag`` do); L holds
    every device of the mesh and, over several devices, is the mesh's only level and spans every device of the
    process; the buffers are all bf16 or all fp16; the devices are Hopper GPUs (kernels with interpret mode also
    run on a CPU mesh of one device); ``params`` are the kernel's and fit. Primitives applied later are checked
    again when compiling.

    Before / after (``lower_with("fused_allgather_matmul")`` on ``async_tp``)::

      parallel n0 in 8 @ x:                     parallel n0 in 8 @ x:  # one kernel per device
        for m0 in 8 shift(n0):  # ring of A       fused_allgather_matmul(A[m@x], B[k, n@x]):
          block: C[m, n] += A[m, k] * B[k, n]       for s in 8: rows (rank + s) % 8 of C = A_s @ B
                                                      # A_s stored into rank - 1 by the kernel

    Args:
      lowering: a registered fused kernel's name.
      **params: fields of its configuration (default: its defaults).

    Raises:
      UnknownNameError: no such fused kernel or parameter (the message lists the known ones).
      PreconditionError: the kernel does not apply; the message says why.
    """
    k = registry.fused(lowering)
    config = k.configure({key: v for key, v in params.items() if v is not None})
    reason = placements.why_not(k, self, config)
    if reason is not None:
      raise PreconditionError(f"lower_with({k.name!r}): {reason}")
    self._lowering = KernelChoice(k.name, config)
    self._record("lower_with", k.name, **configs.changed(config))
    return self

  def kernel_candidates(self) -> list[str]:
    """The local kernels ``patch`` accepts for this schedule's block on its mesh (the tuner's choices)."""
    return registry.candidates(self.program, self.mesh)

  def kernel_variants(self) -> list[KernelChoice]:
    """Every configuration of every local kernel ``patch`` accepts here, each kernel's default first."""
    return registry.variants(self.program, self.mesh)

  # -------------------------------------------------- communication primitives
  def parallelize(self, loop: str, mesh_level: str) -> "Schedule":
    """Spreads a loop's iterations over one mesh level.

    Buffers indexed by the loop's axis become sharded over the level, the
    others replicated. A reduction loop's partial results are combined across
    the level (all-reduce, or reduce-scatter when the output is ``shard``-ed).

    The loop moves outside every non-parallel loop: each rank runs the rest
    of the nest.

    Preconditions: the loop's extent equals the level's size; the level is
    not used by another loop; every loop outside it on the same axis is
    distributed.

    Before / after (``parallelize("i", "x")`` with I = |x|)::

      for j in J:                  parallel i in I @ x:
        for i in I: ...              for j in J: ...
    """
    lp = self.loop(loop)
    size = self._level(mesh_level, f"parallelize({loop!r}, {mesh_level!r})")
    if lp.role == PARALLEL:
      raise PreconditionError(f"parallelize({loop!r}): loop is already parallel over {lp.level!r}")
    if lp.shifted_by:
      raise PreconditionError(f"parallelize({loop!r}): loop is shifted by {lp.shifted_by!r}")
    for other in self.loops:
      if other.role == PARALLEL and other.level == mesh_level:
        raise PreconditionError(
            f"parallelize({loop!r}, {mesh_level!r}): mesh level {mesh_level!r} is already used by "
            f"loop {other.name!r}; a level can carry one parallel loop")
    if lp.extent != size:
      hint = f"; tile({loop!r}, {size}) first" if lp.extent % size == 0 else ""
      raise PreconditionError(
          f"parallelize({loop!r}, {mesh_level!r}): loop extent {lp.extent} must equal the size "
          f"{size} of mesh level {mesh_level!r}{hint}")
    self._check_outer_distributed(lp, "parallelize")
    saved = self.copy()
    lp.role, lp.level = PARALLEL, mesh_level
    self.loops.remove(lp)
    n_parallel = sum(1 for x in self.loops if x.role == PARALLEL)
    self.loops.insert(n_parallel, lp)
    self._commit(saved, "parallelize", loop, mesh_level)
    return self

  def shift(self, local_loop: str, parallel_loop: str) -> "Schedule":
    """Staggers a local loop by a parallel loop's rank: rank r visits (t + r) % T.

    Read buffers indexed by the shifted loop's axis (and not already split by
    the parallel loop's axis) become sharded and travel around a ring
    (``ppermute``) whose next transfer overlaps the current block's compute.
    When the output is indexed by the shifted axis but not by the parallel
    loop (a parallel reduction), partial outputs travel the ring instead and
    end at their owners (a pipelined reduce-scatter).

    Preconditions: ``parallel_loop`` is parallel; ``local_loop`` is not distributed, its extent equals the
    parallel level's
    size, and every loop outside it on its axis is distributed.

    Before / after (``shift("j", "i")``)::

      parallel i in I @ x:         parallel i in I @ x:
        for j in J:                  for j in J:   # shift(i), ring of B over x
          C[i] += A[i,j] * B[j]        C[i] += A[i,(j+i)%J] * B[(j+i)%J]
    """
    lp = self.loop(local_loop)
    par = self.loop(parallel_loop)
    if par.role != PARALLEL:
      raise PreconditionError(
          f"shift({local_loop!r}, {parallel_loop!r}): {parallel_loop!r} is not a parallel loop "
          f"({par.role}); a loop can only be shifted along a parallelized loop")
    if lp.role == PARALLEL or lp.shifted_by:
      raise PreconditionError(f"shift({local_loop!r}, ...): loop is already distributed")
    if lp.axis == par.axis:
      raise PreconditionError(f"shift({local_loop!r}, {parallel_loop!r}): both loops iterate axis {lp.axis!r}")
    size = self.levels[par.level]
    if lp.extent != size:
      raise PreconditionError(
          f"shift({local_loop!r}, {parallel_loop!r}): loop extent {lp.extent} must equal the size {size} "
          f"of mesh level {par.level!r}" + (f"; tile({local_loop!r}, {size}) first" if lp.extent % size == 0 else ""))
    self._check_outer_distributed(lp, "shift")
    saved = self.copy()
    lp.role, lp.shifted_by = SERIAL, parallel_loop
    self._commit(saved, "shift", local_loop, parallel_loop)
    return self

  def shard(self, buffer: str, parallel_loop: str, axis: str | None = None) -> "Schedule":
    """Stores a buffer split over a parallel loop's mesh level.

    A read buffer not indexed by the loop's axis is then stored split along
    ``axis`` and all-gathered before use; the output of a parallel reduction
    is reduce-scattered along ``axis`` instead of all-reduced.

    Preconditions: ``parallel_loop`` is parallel; ``axis`` (default: the
    buffer's first axis that divides evenly) indexes the buffer.

    Before / after (``shard("B", "i")``)::

      parallel i in I @ x:         parallel i in I @ x:
        for j in J:                  AllGather(B over x)
          C[i] += A[i,j] * B[j]      for j in J: C[i] += A[i,j] * B[j]
    """
    buf = self.program.buffer(buffer)
    par = self._parallel(parallel_loop, "shard")
    if axis is not None and axis not in buf.axes:
      raise UnknownNameError(f"shard({buffer!r}, {parallel_loop!r}): {buffer} has no axis {axis!r}; axes: {buf.axes}")
    if par.axis in buf.axes:
      if axis not in (None, par.axis):
        raise PreconditionError(
            f"shard({buffer!r}, {parallel_loop!r}, axis={axis!r}): {buffer} is indexed by the loop's "
            f"axis {par.axis!r} and is split along it")
      chosen = par.axis
    else:
      chosen = axis or self._default_shard_axis(buf, par)
    saved = self.copy()
    self.placements[(buffer, par.level)] = (SHARD, chosen)
    self._commit(saved, "shard", buffer, parallel_loop, axis=axis)
    return self

  def replicate(self, buffer: str, parallel_loop: str) -> "Schedule":
    """Stores a full copy of a buffer on every rank of a parallel loop's level.

    A replicated read buffer is sliced locally instead of communicated; a
    replicated output is all-gathered (spatial loop) or all-reduced
    (reduction loop) over the level.

    Preconditions: ``parallel_loop`` is parallel.

    Before / after (``replicate("B", "i")`` after a shift of j)::

      parallel i @ x:              parallel i @ x:
        for j: # ring of B           for j: # B local, read at (j+i)%J
    """
    self.program.buffer(buffer)
    par = self._parallel(parallel_loop, "replicate")
    saved = self.copy()
    self.placements[(buffer, par.level)] = (REPLICATE,)
    self._commit(saved, "replicate", buffer, parallel_loop)
    return self

  def dispatch(self, parallel_loop: str, *, exchange: str = "padded", gemm: str = "ragged_dot") -> "Schedule":
    """Exchanges only the routed rows over a parallel experts loop's level: a data-dependent all-to-all.

    For a routed program (``ir.routing.Routing``: a mixture of experts). The
    routed inputs (the tokens) and the output are stored split along the
    tokens over the loop's level ``L``, as ``shard(x, loop, axis=tokens)`` and
    ``shard(y, loop)`` would store them; instead of the all-gather of the
    tokens and the reduce-scatter of the output that the dense nest would
    then run over ``L``, each device sends each of its token rows only to the
    devices holding an expert the router picked for it (an all-to-all whose
    counts the router decides), computes only the rows it received, grouped
    by expert (``gemm``), and a second all-to-all brings the results back to
    their tokens, where they are summed with the gate weights. Capacity
    (``Routing.capacity``) is counted in global token order across devices.
    Other levels keep their meaning: one that splits the experts' hidden
    width all-gathers the tokens before the exchange and reduce-scatters the
    partial outputs after it (expert tensor parallelism); one that splits
    only the tokens is data parallel; serial loops over the tokens make the
    exchange run chunk by chunk (pipelined). ``analysis.dispatch`` derives
    all of it from the plan.

    Preconditions: the program is routed; ``parallel_loop`` is parallel and iterates its experts axis, unpadded
    (the level divides the experts); no loop is shifted and no axis zigzagged; the buffers are split only as
    above.

    Before / after (``dispatch("e0")`` after ``tile("e", 8).parallelize("e0", "x")``)::

      parallel e0 in 8 @ x:                  parallel e0 in 8 @ x:
        AllGather(x over x along t)            AllToAll(x's routed rows over x, counts from the router)
        block: y[t] += g[t,e] ffn_e(x[t])      grouped GEMM of the received rows by local expert
        ReduceScatter(y over x along t)        AllToAll(expert outputs back over x), y[t] = sum g * out

    Args:
      parallel_loop: the parallel loop over the experts.
      exchange: ``"padded"``: ``all_to_all`` of fixed-size slot buffers, every device sending each peer as many
        rows as could ever go there (``analysis.dispatch.Dispatch.slots``; with a capacity, at most the
        capacity per expert); ``"ragged"``: ``ragged_all_to_all`` of the kept rows only, packed into a receive
        buffer of the same bound (XLA:CPU does not run it).
      gemm: the grouped expert GEMM: ``"ragged_dot"`` (``jax.lax.ragged_dot`` over the rows sorted by
        expert), ``"dense"`` (every local expert on every received row, masked: for tiny expert counts) or a
        registered grouped GEMM kernel (``"mosaic_grouped_gemm"``: Pallas Mosaic GPU, Hopper; refused on other
        devices; a projection whose shapes or dtype it cannot compute runs ``ragged_dot``, and the printed
        schedule says why: ``analysis.dispatch.gemm_fallback``).
    """
    routing = self.program.routing
    where = f"dispatch({parallel_loop!r})"
    if routing is None:
      raise PreconditionError(f"{where}: {self.program.name} is not a routed program (no ir.Routing): there is "
                              f"nothing data-dependent to exchange")
    par = self._parallel(parallel_loop, "dispatch")
    if par.axis != routing.experts:
      raise PreconditionError(f"{where}: the loop iterates {par.axis!r}, not the experts axis {routing.experts!r}")
    experts, size = self.program.axes[routing.experts].extent, self.levels[par.level]
    if self.padded[routing.experts] != experts:
      raise PreconditionError(f"{where}: the {experts} experts do not divide over mesh level {par.level!r} of size "
                              f"{size}; spread them over a level whose size divides {experts}")
    if exchange not in dispatches.EXCHANGES:
      raise PreconditionError(f"{where}: exchange={exchange!r}; choose one of {dispatches.EXCHANGES}")
    if gemm not in dispatches.gemms():
      raise PreconditionError(f"{where}: gemm={gemm!r}; choose one of {dispatches.gemms()}")
    if reason := dispatches.gemm_problem(gemm, self.mesh):
      raise PreconditionError(f"{where}: gemm={gemm!r} cannot run here: {reason}; use gemm='ragged_dot'")
    if self._dispatched is not None:
      raise PreconditionError(f"{where}: the schedule already dispatches over loop {self._dispatched['loop']!r}")
    saved = self.copy()
    for name in routing.routed + (self.program.writes.name,):
      self.placements[(name, par.level)] = (SHARD, routing.tokens)
    self._dispatched = {"loop": parallel_loop, "exchange": exchange, "gemm": gemm}
    self._commit(saved, "dispatch", parallel_loop, exchange=None if exchange == "padded" else exchange,
                 gemm=None if gemm == "ragged_dot" else gemm)
    return self

  def _default_shard_axis(self, buf, par) -> str:
    size = self.levels[par.level]
    for a in buf.axes:
      if self.padded.get(a, self.program.axes[a].extent) % size == 0:
        return a
    raise PreconditionError(
        f"shard({buf.name!r}, {par.name!r}): no axis of {buf} divides evenly by the size {size} of "
        f"mesh level {par.level!r}; pass axis= or pad")

  # ------------------------------------------------------------ inspection
  def validate(self):
    """Checks the whole schedule; raises ``ScheduleError`` naming the problem; returns its plan."""
    plan = self.plan()
    dispatches.of(self, plan, complete=False)
    return plan

  def plan(self) -> plans.Plan:
    """The communication plan the lowering follows, derived once per change of the schedule."""
    if self._plan is None:
      self._plan = plans.make_plan(self)
    return self._plan

  def data_run(self, q_segment_ids, kv_segment_ids) -> packed.DataRun:
    """What the schedule runs for these segment ids (int [batch, q_len], [batch, kv_len]): per ring whose steps
    the ids decide, the steps with kept pairs and the steps that run; per device, the blocks computed and the
    pairs kept (``analysis.packed.data_run``)."""
    return packed.data_run(self, q_segment_ids, kv_segment_ids)

  def describe(self, q_segment_ids=None, kv_segment_ids=None) -> str:
    """``str(schedule)``, with the counts of ``data_run`` for segment ids where given."""
    run = None if q_segment_ids is None else self.data_run(q_segment_ids, kv_segment_ids)
    return printer.render(self, run)

  def compile(self, *, differentiable: bool = True):
    """Lowers the schedule to a jitted callable on global arrays.

    Args:
      differentiable: attach the backward pass generated from this schedule
        (``jax.grad`` works either way; this makes the gradient a scheduled
        program of its own where the program has backward programs). Its
        schedules are built here, so that differentiating builds nothing.

    The program, the mesh, the layouts and the kernel are checked first
    (``jaxmercury.validate``); ``validate(program, mesh, inputs=...)`` also
    checks arrays and the devices they are committed to.

    A schedule given ``lower_with`` runs its fused kernel under the same
    ``shard_map`` layouts; its backward is always attached, since the kernel
    has no autodiff.

    Returns:
      ``f(*inputs) -> output``, a ``jax.jit`` of a ``jax.shard_map`` program
      (``jaxmercury.lowering.compile_schedule``).
    """
    checks.check_program(self.program)
    checks.check_mesh(self.mesh, devices=True)
    checks.check_on_mesh(self)
    if not _COMPILER:
      raise ScheduleError("no lowering is registered: import jaxmercury (which imports jaxmercury.lowering)")
    return _COMPILER[0](self, differentiable=differentiable)

  def to_json(self) -> str:
    return trace_format.to_json(self)

  @classmethod
  def from_json(cls, program: Program, mesh, text: str, *, other_sizes: bool = False) -> "Schedule":
    """The schedule a ``to_json`` trace records, rebuilt on ``program`` and ``mesh`` through the primitives;
    ``other_sizes``: the trace may be of the same program at other sizes (``trace.from_json``)."""
    return trace_format.from_json(cls, program, mesh, text, other_sizes=other_sizes)

  def __str__(self):
    return printer.render(self)

  __repr__ = __str__


def _check_parallel_outermost(loops: list[Loop]):
  seen_local = None
  for lp in loops:
    if lp.role != PARALLEL:
      seen_local = seen_local or lp.name
    elif seen_local:
      raise PreconditionError(
          f"reorder: parallel loop {lp.name!r} would sit inside loop {seen_local!r}; "
          "parallel loops stay outside the others")
