"""The one registry of kernels: local block kernels (``patch``) and fused whole-nest kernels (``lower_with``).

A kernel is one object declared in one module, registered by one line in
``jaxmercury/kernels/__init__.py`` (or by a user's ``register(...)`` call):

* ``Kernel``: computes one block exactly as a program's body would. It
  declares the loop-nest patterns it implements (``patterns``), when it
  applies (``dtypes``, ``platforms``, ``supports``), its tunable parameters
  (``config``, a frozen keyword-only dataclass, see ``kernels.config``), how
  to build it (``make``), its cost and memory hooks (``work``,
  ``workspace``) and, for attention, its backward (``AttentionBackward``:
  block kernels of the dq and dk-dv programs, a joint block, a per-device
  fused backward).
* ``FusedKernel``: runs a whole schedule of one placement kind (an all-gather
  GEMM, a GEMM + reduce-scatter, a ring attention) as one kernel per device,
  the ring inside it. It declares the same things for its placement
  (``kernels.placements``) plus how its backward runs (``DualGemm`` or
  ``DualPrograms``).
* ``GroupedKernel``: a mixture-of-experts schedule's grouped expert GEMM
  (``Schedule.dispatch(gemm=...)``), with the devices, shapes and dtypes it
  computes, its configuration, cost and memory hooks; its backward is its own
  (a ``custom_vjp``).

The rest of the library asks the registry; nothing else names a kernel.
Kernels that run in Pallas interpret mode are offered on CPU devices inside
``interpret_mode()`` (tests).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from jaxmercury.errors import PreconditionError, UnknownNameError
from jaxmercury.kernels import config as configs
from jaxmercury.kernels import patterns
from jaxmercury.kernels.work import Block, Work, body_share
from jaxmercury.programs.masks import mask_of

ALL_PLATFORMS = frozenset({"cpu", "gpu", "tpu"})


@dataclasses.dataclass(frozen=True)
class KernelChoice:
  """A local kernel and its configuration (None: the kernel's defaults, or a kernel without parameters)."""

  name: str
  config: Any = None

  def __str__(self) -> str:
    return configs.label(self.name, self.config)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionBackward:
  """How a forward attention kernel's backward runs, from the output and log-sum-exp its forward kept.

  Attributes:
    dq: the block kernel of the ``attention_dq`` program (None: the program's own XLA body).
    dkv: the block kernel of the ``attention_dkv`` program (None: its XLA body).
    joint: ``joint(dq_program) -> block(ctx, q, k, v, o, do, lse) -> (dq, dkv)``: both programs' blocks in
      one call per block pair (the dual programs run in one nest); None: none.
    whole: ``whole(q, k, v, o, do, lse, causal) -> (dq, dk, dv)``: the backward of a device's whole attention
      in one call, for schedules that keep each device's attention local; None: none.
    whole_limit: ``(program, per-device extents) -> reason | None``: where ``whole`` does not fit.
    everywhere: its blocks run every attention's backward where they apply, whatever kernel ran the forward
      (cuDNN's: the fastest backward we have), unless that kernel's backward is ``own``.
    own: its blocks run the backward of its own forward even where another kernel's are ``everywhere``.

  A kernel declared ``interpret=True`` that runs in interpret mode gets ``interpret=True`` as a keyword of
  ``joint`` and ``whole``; the others are called as above.
  """

  dq: "Kernel | None" = None
  dkv: "Kernel | None" = None
  joint: Callable | None = None
  whole: Callable | None = None
  whole_limit: Callable | None = None
  everywhere: bool = False
  own: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class Kernel:
  """A local kernel: one block of a program's loop nest.

  Attributes:
    name: the registered name.
    patterns: loop-nest patterns it implements (``kernels.patterns``); ``"*"`` for any program.
    make: ``make(program, config, interpret) -> block(ctx, *blocks)``; None: the program's own body.
    config: its tunable parameters, a frozen keyword-only dataclass (``kernels.config``); None: none.
    dtypes: accepted dtypes of the read buffers (None: any).
    dtype_of: the read buffer whose dtype must be accepted (None: every read).
    platforms: device platforms it runs on.
    supports: ``supports(device) -> reason | None`` for finer device requirements (Hopper).
    interpret: it runs on CPUs in Pallas interpret mode (``interpret_mode()``).
    interpret_devices: in interpret mode, the most devices a mesh may have (Mosaic GPU's interpreter keeps one
      state for every device and runs one device's kernels at a time); None: any.
    work: ``work(block, *, causal, config) -> Work`` of one call, on the pattern's axis names (cost model);
      ``block.band`` is the program's positional mask (causal, sliding window), ``block.data`` whether it masks
      by data too (segment ids, a mask array). None: the program's body
      computes every block densely unless the positional mask hides all of it; another kernel is taken to
      compute only the pairs the mask keeps.
    workspace: ``workspace(program, sizes, config) -> bytes`` of one call (None: the program's own estimate).
    backward: attention kernels: how the backward runs (``AttentionBackward``).
    preference: the default kernel of a pattern is the applicable one of the highest preference (None: never).
    description: one line for the docs and printouts.
    masks: attention kernels: the mask kinds it computes (``programs.masks.KINDS``: ``causal``, ``window``,
      ``segment_ids``, ``mask``); it does not apply to a program with another.
    mask_problem: ``mask_problem(mask) -> reason | None`` for finer requirements of a mask (a window only with
      the causal mask, ...).
    unverified: why it is not yet trusted on GPUs (None: it is): ``candidates`` (what the tuner tries) leaves it
      out there, ``patch`` still takes it.
    unverified_masks: the mask kinds (of ``masks``) it computes but has not yet computed on a GPU: likewise left
      out there for a program with one of them.
  """

  name: str
  patterns: frozenset
  make: Callable | None = None
  config: type | None = None
  dtypes: frozenset | None = None
  dtype_of: str | None = None
  platforms: frozenset = ALL_PLATFORMS
  supports: Callable | None = None
  interpret: bool = False
  interpret_devices: int | None = None
  work: Callable | None = None
  workspace: Callable | None = None
  backward: AttentionBackward | None = None
  preference: int | None = None
  description: str = ""
  masks: frozenset = frozenset({"causal"})
  mask_problem: Callable | None = None
  unverified: str | None = None
  unverified_masks: frozenset = frozenset()

  def configure(self, params: Mapping[str, Any] | None = None):
    """The kernel's configuration with ``params`` set (its defaults for none; None for a kernel without one)."""
    if self.config is None:
      return configs.make(None, params, where=f"patch({self.name!r})")
    return configs.make(self.config, params, where=f"patch({self.name!r})")

  def variants(self) -> list[KernelChoice]:
    """Every configuration the tuner may try, the default first."""
    if self.config is None:
      return [KernelChoice(self.name)]
    return [KernelChoice(self.name, c) for c in configs.variants(self.config)]

  def why_not(self, program, mesh) -> str | None:
    """Why this kernel cannot run ``program``'s blocks on ``mesh``'s devices, or None.

    On an ``AbstractMesh`` (planning only) the devices are not checked.
    """
    try:
      m = _pattern_match(self, program)
    except PreconditionError as e:
      return f"kernel implements {sorted(self.patterns)}: {e}"
    if m is not None and (reason := self._mask_reason(mask_of(m.params))):
      return reason
    dtypes = {np.dtype(b.dtype) for b in program.reads if self.dtype_of in (None, b.name)}
    if self.dtypes is not None and not dtypes <= self.dtypes:
      return f"kernel accepts {sorted(map(str, self.dtypes))}, program has {sorted(map(str, dtypes))}"
    return _device_problem(self, mesh)[0]

  def _mask_reason(self, mask) -> str | None:
    """Why the kernel cannot compute an attention program's ``mask`` (None: it can)."""
    if missing := mask.kinds - self.masks:
      return (f"kernel computes masks {sorted(self.masks) or 'none'}, not the program's {sorted(missing)} "
              f"({mask.describe()})")
    return self.mask_problem(mask) if self.mask_problem else None

  def untrusted(self, program) -> str | None:
    """Why the kernel is not yet trusted on GPUs for ``program`` (``unverified``, ``unverified_masks``), or None."""
    if self.unverified is not None:
      return self.unverified
    m = _pattern_match(self, program) if self.unverified_masks else None
    kinds = mask_of(m.params).kinds & self.unverified_masks if m is not None else ()
    return f"its {sorted(kinds)} masks have not yet run on a GPU" if kinds else None

  def interprets(self, mesh) -> dict:
    """``{"interpret": True}`` where this kernel runs in interpret mode on ``mesh``'s devices, else ``{}``: the
    keywords its backward's ``joint`` and ``whole`` take."""
    return {"interpret": True} if _device_problem(self, mesh)[1] else {}

  def block(self, program, mesh, config=None) -> Callable:
    """The block function for ``program`` on ``mesh``; ``PreconditionError`` where it does not apply."""
    reason = self.why_not(program, mesh)
    if reason:
      raise PreconditionError(f"patch({self.name!r}): {reason}")
    if self.make is None:
      return program.body
    config = config if config is not None else self.configure()
    interpret = _device_problem(self, mesh)[1]
    m = _pattern_match(self, program)
    if m is None or (not m.renames and all(program.params.get(p) == v for p, v in m.params.items())):
      return self.make(program, config, interpret)
    return _renamed(self, program, m, config, interpret)

  def block_work(self, program, block: Block, config=None) -> Work:
    """Where one body call of ``program`` runs (``Work``), from the block alone (no tracing)."""
    m = _pattern_match(self, program)
    mask = mask_of({**program.params, **(m.params if m else {})})
    if m is not None and m.renames:
      block = block.renamed(m.to_pattern)
    if (mask.positional or mask.data) and {"i", "j"} <= set(block.sizes):  # a query and a key axis to mask
      block = dataclasses.replace(block, band=mask.band if mask.positional else None, data=mask.data)
    if self.work is not None:
      return self.work(block, causal=mask.causal, config=config if config is not None else self.configure())
    if self.make is None:
      return Work(fast=body_share(block))
    return Work(fast=block.band_share() if block.band else 1.0)

  def workspace_bytes(self, program, sizes, config=None) -> int:
    """Temporary bytes of one call on blocks of ``sizes`` (program axis names)."""
    if self.workspace is not None:
      m = _pattern_match(self, program)
      if m is not None and m.renames:
        sizes = {m.to_pattern.get(k, k): v for k, v in sizes.items()}
      return int(self.workspace(program, sizes, config if config is not None else self.configure()))
    return int(program.workspace(sizes)) if program.workspace else 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class DualGemm:
  """A fused GEMM's backward: the fused kernel of the other placement (``dual``) and one local GEMM.

  Attributes:
    dual: the fused kernel that computes the collective GEMM of the backward.
    keeps_rows: the forward kernel returns the rows its ring gathered (``gathered=True``), so the backward's
      local GEMM needs no gather; False: the backward all-gathers A again.
  """

  dual: str
  keeps_rows: bool = True
  description: str = "the dual fused GEMM, fed by the forward's gathered rows"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DualPrograms:
  """A fused attention's backward: the dual dq and dk-dv programs of its ordinary schedule (cuDNN blocks where
  the devices have them, or the local kernel its configuration's ``backward`` field names), fed by the kernel's
  own output and log-sum-exp."""

  description: str = "the dual programs, from the kernel's output and log-sum-exp"


@dataclasses.dataclass(frozen=True, kw_only=True)
class FusedKernel:
  """A fused kernel: a whole schedule of one placement kind run as one kernel per device, its ring inside.

  Attributes:
    name: what ``Schedule.lower_with`` names.
    description: one line for ``str(schedule)`` and the docs.
    placement: the placement kind it computes (``kernels.placements``: ``ALLGATHER``, ``REDUCESCATTER``,
      ``RING_ATTENTION``).
    config: its parameters, a frozen keyword-only dataclass whose defaults are the kernel's.
    devices: ``devices(placement, mesh) -> reason | None``: the mesh's devices and levels.
    problem: ``problem(placement, config) -> reason | None``: whether the parameters fit the placement's
      blocks and dtypes (None: any).
    tile: ``tile(config) -> (rows, cols, depth)``: the multiples it pads one device's blocks to.
    make: ``make(placement, config, interpret) -> per_device(*blocks)``; an all-gather GEMM's also takes
      ``gathered=True``, returning ``(C block, the rows its ring gathered or None)`` for its backward.
    backward: ``DualGemm`` or ``DualPrograms``.
    rate_kernel: the local kernel whose measured rate prices its compute; its own name: calibration
      measures the kernel itself.
    seconds: the cost hook, ``seconds(placement, config, machine, *, measured_rate, sms) -> seconds`` of one
      call (``kernels.fused_costs``).
    memory: the memory hook, ``memory(placement, config) -> bytes`` one device holds.
    interpret: it runs on a one-device CPU mesh in Mosaic GPU interpret mode.
    unverified: ``unverified(placement) -> reason | None``: why it is not yet trusted on GPUs for this
      placement; the tuner and graph search then leave it out, ``lower_with`` still takes it.
    one_device: ``one_device(config) -> (name, config) | None``: the fused kernel and configuration whose program
      this one's is where its mesh level has one device (the ring empty: the same tiles over the same GEMM, and
      the same backward), which the tuner compiles in its stead (``tuner.candidates.program_key``); None: none.
  """

  name: str
  description: str
  placement: str
  config: type
  devices: Callable
  tile: Callable
  make: Callable
  backward: DualGemm | DualPrograms
  rate_kernel: str
  seconds: Callable
  memory: Callable
  problem: Callable | None = None
  interpret: bool = False
  unverified: Callable | None = None
  one_device: Callable | None = None

  def configure(self, params: Mapping[str, Any] | None = None):
    return configs.make(self.config, params, where=f"lower_with({self.name!r})")

  def label(self, config) -> str:
    """``name(p=v, ...)`` with the parameters that differ from the defaults."""
    return configs.label(self.name, config)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupedKernel:
  """A grouped GEMM kernel: a dispatched mixture-of-experts schedule's expert GEMMs (``Schedule.dispatch(gemm=
  name)``), for every group (expert) ``x[rows of g] [m_g, k] @ w[g] [k, n]`` over rows sorted by group.

  Its pattern is that contract (``jax.lax.ragged_dot``'s); ``jax.lax.ragged_dot`` itself and the dense masked
  form are the built-in choices, not registered kernels.

  Attributes:
    name: what ``dispatch(gemm=...)`` names.
    config: its parameters, a frozen keyword-only dataclass (``kernels.config``).
    dtypes: accepted dtypes of the rows and weights.
    devices: ``devices(mesh) -> reason | None``: the mesh's devices (a sentence naming the device); an
      ``AbstractMesh``: None.
    problem: ``problem(k, n, dtype, config) -> reason | None``: the GEMM shapes and dtypes it computes, forward
      and backward; elsewhere the schedule uses ``jax.lax.ragged_dot`` for that GEMM.
    gemm: ``gemm(x, w, group_sizes, *, config, out_dtype) -> [m, n]``, differentiable in ``x`` and ``w`` (its
      backward: the grouped GEMM of ``dy`` with ``w`` transposed, and the transposed grouped GEMM for ``dw``).
    rows: cost hook, ``rows(routed, groups, config) -> rows`` it computes for ``routed`` rows in ``groups`` groups.
    memory: memory hook, ``memory(m, k, n, groups, itemsize, config) -> bytes`` of temporaries of one forward
      and backward beyond ``ragged_dot``'s.
    description: one line for the docs and printouts.
  """

  name: str
  config: type
  dtypes: frozenset
  devices: Callable
  problem: Callable
  gemm: Callable
  rows: Callable
  memory: Callable
  description: str = ""

  def configure(self, params: Mapping[str, Any] | None = None):
    return configs.make(self.config, params, where=f"dispatch(gemm={self.name!r})")


_KERNELS: dict[str, Kernel | FusedKernel | GroupedKernel] = {}
_BACKWARD_OF: dict[str, AttentionBackward] = {}  # a backward block kernel's name -> the backward it belongs to
_MODE = threading.local()


def register(k: Kernel | FusedKernel | GroupedKernel) -> Kernel | FusedKernel | GroupedKernel:
  """Adds a kernel (and an attention kernel's backward block kernels) to the registry; returns it.

  Registering the same object twice is a no-op; another kernel of a registered name is an error.
  """
  if not isinstance(k, (Kernel, FusedKernel, GroupedKernel)):
    raise TypeError(f"register takes a Kernel, FusedKernel or GroupedKernel, got {type(k).__name__}")
  if k.name in _KERNELS and _KERNELS[k.name] is not k:
    raise ValueError(f"kernel {k.name!r} is already registered")
  config = k.config
  if config is not None and not (dataclasses.is_dataclass(config) and config.__dataclass_params__.frozen):
    raise TypeError(f"kernel {k.name!r}: config must be a frozen dataclass, got {config!r}")
  _KERNELS[k.name] = k
  if isinstance(k, Kernel) and k.backward is not None:
    for part in (k.backward.dq, k.backward.dkv):
      if part is not None:
        register(part)
        _BACKWARD_OF[part.name] = k.backward
    if k.name == "xla":
      _BACKWARD_OF["xla"] = k.backward
  return k


def kernel(name: str) -> Kernel | FusedKernel:
  """The registered kernel ``name``; ``UnknownNameError`` listing the registered ones."""
  if not isinstance(name, str) or name not in _KERNELS:
    raise UnknownNameError(f"no kernel {name!r}; registered: {sorted(_KERNELS)}")
  return _KERNELS[name]


def local(name: str) -> Kernel:
  """The local kernel ``name`` (what ``patch`` takes)."""
  k = _KERNELS.get(name)
  if not isinstance(k, Kernel):
    raise UnknownNameError(f"patch: no local kernel {name!r}; local kernels: {local_names()}"
                           + (f" ({name!r} is a fused kernel: Schedule.lower_with takes it)" if k else ""))
  return k


def fused(name: str) -> FusedKernel:
  """The fused kernel ``name`` (what ``lower_with`` takes)."""
  k = _KERNELS.get(name)
  if not isinstance(k, FusedKernel):
    raise UnknownNameError(f"lower_with: no fused kernel {name!r}; known: {fused_names()}"
                           + (f" ({name!r} is a local kernel: Schedule.patch takes it)" if k else ""))
  return k


def local_names() -> list[str]:
  return sorted(n for n, k in _KERNELS.items() if isinstance(k, Kernel))


def fused_names() -> list[str]:
  return sorted(n for n, k in _KERNELS.items() if isinstance(k, FusedKernel))


def grouped(name: str) -> GroupedKernel:
  """The grouped GEMM kernel ``name`` (what ``dispatch(gemm=...)`` takes besides ``ragged_dot`` and ``dense``)."""
  k = _KERNELS.get(name)
  if not isinstance(k, GroupedKernel):
    raise UnknownNameError(f"dispatch: no grouped GEMM kernel {name!r}; known: {grouped_names()}")
  return k


def grouped_names() -> list[str]:
  """The grouped GEMM kernels' names, in registration order."""
  return [n for n, k in _KERNELS.items() if isinstance(k, GroupedKernel)]


def fused_kernels() -> list[FusedKernel]:
  """The fused kernels, in registration order."""
  return [k for k in _KERNELS.values() if isinstance(k, FusedKernel)]


@contextlib.contextmanager
def interpret_mode():
  """Offers kernels that run in Pallas interpret mode on CPU devices, and makes them so."""
  saved = getattr(_MODE, "interpret", False)
  _MODE.interpret = True
  try:
    yield
  finally:
    _MODE.interpret = saved


def interpreting() -> bool:
  return getattr(_MODE, "interpret", False)


def candidates(program, mesh) -> list[str]:
  """Names of the local kernels that can replace ``program``'s body on ``mesh``, in registration order; kernels
  not yet trusted on GPUs (``Kernel.untrusted``) only where they run in interpret mode."""
  return [name for name, k in _KERNELS.items() if isinstance(k, Kernel) and k.why_not(program, mesh) is None
          and (k.untrusted(program) is None or k.interprets(mesh))]


def variants(program, mesh) -> list[KernelChoice]:
  """Every configuration of every local kernel that applies (``candidates``), each kernel's default first."""
  return [choice for name in candidates(program, mesh) for choice in local(name).variants()]


def lookup(name: str, program, mesh, config=None) -> Callable:
  """The block function of local kernel ``name`` for ``program`` on ``mesh``.

  Raises:
    UnknownNameError: no such kernel.
    PreconditionError: the program does not match the kernel's pattern, its dtypes are not accepted, or the
      devices cannot run it; the message says which.
  """
  return local(name).block(program, mesh, config)


def default_kernel(program, mesh) -> str | None:
  """The applicable local kernel of the highest ``preference`` (None: the program's body is the default)."""
  ranked = [(k.preference, name) for name, k in _KERNELS.items()
            if isinstance(k, Kernel) and k.preference is not None and k.why_not(program, mesh) is None]
  return max(ranked)[1] if ranked else None


def backward_of(block_kernel: str) -> AttentionBackward | None:
  """The ``AttentionBackward`` a dq or dk-dv block kernel (or ``"xla"``) belongs to."""
  return _BACKWARD_OF.get(block_kernel)


def everywhere_backward() -> str | None:
  """The forward kernel whose backward blocks run every attention backward where they apply, if one is registered."""
  return next((name for name, k in _KERNELS.items()
               if isinstance(k, Kernel) and k.backward is not None and k.backward.everywhere), None)


def _pattern_match(k: Kernel, program) -> patterns.Match | None:
  """None for kernels that take any program; raises if ``program`` matches none of ``k``'s patterns."""
  if "*" in k.patterns:
    return None
  reasons = []
  for name in sorted(k.patterns):
    try:
      return patterns.match(name, program)
    except PreconditionError as e:
      reasons.append(str(e))
  raise PreconditionError("; ".join(reasons))


def _device_problem(k: Kernel, mesh) -> tuple[str | None, bool]:
  """(why the mesh's devices cannot run ``k`` or None, whether to interpret)."""
  if not isinstance(mesh, jax.sharding.Mesh):
    return None, False  # an AbstractMesh plans; no devices to check
  device = mesh.devices.flat[0]
  if device.platform == "cpu" and k.interpret and interpreting():
    if k.interpret_devices is not None and mesh.devices.size > k.interpret_devices:
      return (f"its interpret mode runs on at most {k.interpret_devices} device(s) (Mosaic GPU's interpreter), the "
              f"mesh has {mesh.devices.size}"), False
    return None, True
  if device.platform not in k.platforms:
    hint = "; it runs there in interpret mode (registry.interpret_mode())" if k.interpret else ""
    return f"runs on {sorted(k.platforms)}, mesh devices are {device.platform!r} ({device.device_kind}){hint}", False
  return (k.supports(device) if k.supports else None), False


def _renamed(k: Kernel, program, m: patterns.Match, config, interpret: bool) -> Callable:
  """``k`` on a program that names its axes its own way: the kernel sees the pattern's names."""
  back = {v: n for n, v in m.to_pattern.items()}
  body = lambda ctx, *blocks: program.body(ctx.renamed(back), *blocks)
  view = dataclasses.replace(program, body=body, params={**program.params, **m.params})
  fn = k.make(view, config, interpret)
  return lambda ctx, *blocks: fn(ctx.renamed(m.to_pattern), *blocks)
