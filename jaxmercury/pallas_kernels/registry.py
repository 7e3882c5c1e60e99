"""The registry of local kernels and the loop-nest patterns they implement.

A kernel computes one block exactly as a program's body would: ``make(program,
**params)`` returns a function of the body's ``(ctx, *blocks)`` that returns
what the body returns. It is registered for loop-nest patterns
(``"attention"``, ``"matmul"``, ... see ``patterns``), the dtypes it accepts,
the device platforms it runs on (and ``supports``, for finer device
requirements such as Hopper), and tunable parameters with their choices.

A kernel variant is named ``name[param=value,...]`` (parameters left at their
defaults are not written); ``lookup`` and ``Schedule.patch`` take such names.
Kernels that can run in Pallas interpret mode are offered on CPU devices
inside ``interpret_mode()`` (tests).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
from typing import Any, Callable, Mapping

import jax
import numpy as np

from jaxmercury.errors import PreconditionError, UnknownNameError
from jaxmercury.pallas_kernels import patterns
from jaxmercury.pallas_kernels.work import Block, Work, body_share


@dataclasses.dataclass(frozen=True)
class Kernel:
  """A local kernel.

  Attributes:
    name: the registered name.
    patterns: loop-nest patterns it implements; ``"*"`` for any program.
    make: ``make(program, **params)`` -> block function; None: the program's
      own body.
    dtypes: accepted dtypes of the read buffers (None: any).
    platforms: device platforms it runs on.
    workspace: ``workspace(program, sizes) -> bytes`` of one call (None: the
      program's own estimate).
    dtype_of: the read buffer whose dtype must be accepted (None: every read).
    supports: ``supports(device)`` -> why the device cannot run it, or None.
    params: tunable parameters and their choices, the default first.
    interpret: ``make(..., interpret=True)`` runs on CPUs in Pallas interpret
      mode.
    work: ``work(block, causal=..., **params) -> Work`` of one body call, on
      the pattern's axis names (for the cost model; no tracing). None: the
      program's own body (``make`` None) computes every block densely unless
      causal masking hides all of it; another kernel is taken to compute only
      the pairs the mask keeps.
  """

  name: str
  patterns: frozenset
  make: Callable | None
  dtypes: frozenset | None = None
  platforms: frozenset = frozenset({"cpu", "gpu", "tpu"})
  workspace: Callable | None = None
  dtype_of: str | None = None
  supports: Callable | None = None
  params: Mapping[str, tuple] = dataclasses.field(default_factory=dict)
  interpret: bool = False
  work: Callable | None = None

  def block_work(self, program, block: Block, **params) -> Work:
    """Where one body call of ``program`` runs (``Work``), from the block alone.

    Args:
      program: the program the kernel replaces the body of.
      block: the call's block, on the program's axis names.
      params: the variant's parameters (``parse``); defaults where left out.
    """
    m = _pattern_match(self, program)
    causal = bool({**program.params, **(m.params if m else {})}.get("causal", False))
    if m is not None and m.renames:
      block = block.renamed(m.to_pattern)
    if self.work is not None:
      return self.work(block, causal=causal, **{**{p: c[0] for p, c in self.params.items()}, **params})
    causal = causal and {"i", "j"} <= set(block.sizes)  # a query and a key axis to mask
    if self.make is None:
      return Work(fast=body_share(block, causal))
    return Work(fast=block.causal_share() if causal else 1.0)

  def workspace_bytes(self, program, sizes) -> int:
    if self.workspace is not None:
      m = _pattern_match(self, program)
      if m is not None and m.renames:
        sizes = {m.to_pattern.get(k, k): v for k, v in sizes.items()}
      return int(self.workspace(program, sizes))
    return int(program.workspace(sizes)) if program.workspace else 0

  def variants(self) -> list[str]:
    """Every variant's name, the default (``name``) first."""
    keys = list(self.params)
    return [variant_name(self.name, dict(zip(keys, vals)), self)
            for vals in itertools.product(*(self.params[k] for k in keys))] or [self.name]


_KERNELS: dict[str, Kernel] = {}
_MODE = threading.local()


def register(kernel: Kernel):
  if kernel.name in _KERNELS:
    raise ValueError(f"kernel {kernel.name!r} is already registered")
  for key, choices in kernel.params.items():
    if not choices:
      raise ValueError(f"kernel {kernel.name!r}: parameter {key!r} has no choices")
  _KERNELS[kernel.name] = kernel
  return kernel


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


def variant_name(base: str, params: Mapping[str, Any], k: Kernel | None = None) -> str:
  """``base[p=v,...]`` with the parameters that differ from the defaults, in declared order."""
  k = k or kernel(base)
  shown = [f"{p}={params[p]}" for p in k.params if p in params and params[p] != k.params[p][0]]
  return f"{base}[{','.join(shown)}]" if shown else base


def parse(name: str) -> tuple[Kernel, dict]:
  """The kernel and the full parameters of a variant name such as ``pallas_attention[block_q=64]``."""
  base, _, rest = name.partition("[")
  k = kernel(base)
  params = {p: c[0] for p, c in k.params.items()}
  if rest:
    if not rest.endswith("]"):
      raise UnknownNameError(f"kernel variant {name!r}: expected name[param=value,...]")
    for item in filter(None, rest[:-1].split(",")):
      key, _, text = item.partition("=")
      params[key.strip()] = _value(k, key.strip(), text.strip())
  return k, params


def _value(k: Kernel, key: str, text: str):
  if key not in k.params:
    raise UnknownNameError(f"kernel {k.name!r} has no parameter {key!r}; parameters: {sorted(k.params)}")
  for choice in k.params[key]:
    if str(choice) == text:
      return choice
  raise PreconditionError(f"kernel {k.name!r}: {key}={text} is not one of the choices {list(k.params[key])}")


def full_params(name: str, **params) -> dict:
  """Every parameter of kernel (variant) ``name`` with ``params`` set, checked against the choices."""
  k, full = parse(name)
  for key, value in params.items():
    full[key] = _value(k, key, str(value))
  return full


def resolve(name: str, **params) -> str:
  """The variant name of kernel ``name`` with ``params`` set (checked against the choices)."""
  return variant_name(kernel(name).name, full_params(name, **params))


def candidates(program, mesh, variants: bool = False) -> list[str]:
  """Names of the kernels that can replace ``program``'s body on ``mesh``.

  Args:
    variants: list every tunable variant, not only each kernel's default.
  """
  out = []
  for name, k in _KERNELS.items():
    try:
      lookup(name, program, mesh)
    except PreconditionError:
      continue
    out.extend(k.variants() if variants else [name])
  return out


def kernel(name: str) -> Kernel:
  base = name.partition("[")[0]
  if base not in _KERNELS:
    raise UnknownNameError(f"no kernel {base!r}; registered: {sorted(_KERNELS)}")
  return _KERNELS[base]


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
    return None, True
  if device.platform not in k.platforms:
    hint = "; it runs there in interpret mode (registry.interpret_mode())" if k.interpret else ""
    return f"runs on {sorted(k.platforms)}, mesh devices are {device.platform!r} ({device.device_kind}){hint}", False
  reason = k.supports(device) if k.supports else None
  return reason, False


def lookup(name: str, program, mesh) -> Callable:
  """The kernel function for ``program`` on ``mesh``; raises if it does not apply.

  ``name`` may be a variant (``pallas_attention[block_q=64]``). On an
  ``AbstractMesh`` (planning only) the devices are not checked.

  Raises:
    UnknownNameError: no such kernel or parameter.
    PreconditionError: the program does not match the kernel's pattern, its
      dtypes are not accepted, or the devices cannot run it; the message says
      which.
  """
  k, params = parse(name)
  try:
    m = _pattern_match(k, program)
  except PreconditionError as e:
    raise PreconditionError(f"patch({name!r}): kernel implements {sorted(k.patterns)}: {e}") from None
  dtypes = {np.dtype(b.dtype) for b in program.reads if k.dtype_of in (None, b.name)}
  if k.dtypes is not None and not dtypes <= k.dtypes:
    raise PreconditionError(f"patch({name!r}): kernel accepts {sorted(map(str, k.dtypes))}, "
                            f"program has {sorted(map(str, dtypes))}")
  problem, interpret = _device_problem(k, mesh)
  if problem:
    raise PreconditionError(f"patch({name!r}): kernel {problem}")
  if k.make is None:
    return program.body
  if interpret:
    params = {**params, "interpret": True}
  if m is None or (not m.renames and all(program.params.get(p) == v for p, v in m.params.items())):
    return k.make(program, **params)
  return _renamed(k, program, m, params)


def _renamed(k: Kernel, program, m: patterns.Match, params) -> Callable:
  """``k`` on a program that names its axes its own way: the kernel sees the pattern's names."""
  back = {v: n for n, v in m.to_pattern.items()}
  body = lambda ctx, *blocks: program.body(ctx.renamed(back), *blocks)
  view = dataclasses.replace(program, body=body, params={**program.params, **m.params})
  fn = k.make(view, **params)
  return lambda ctx, *blocks: fn(ctx.renamed(m.to_pattern), *blocks)


register(Kernel("xla", frozenset({"*"}), None))
