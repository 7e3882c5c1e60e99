"""The registry of local kernels and the patterns they implement.

A kernel computes one block exactly as a program's body would: ``make(program)``
returns a function of the body's ``(ctx, *blocks)`` that returns what the body
returns. It is
registered for a pattern (``"attention"``, ``"matmul"``, ...), the dtypes it
accepts and the device platforms it runs on. ``Schedule.patch`` checks all
three before accepting it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import numpy as np

from jaxmercury.errors import PreconditionError, UnknownNameError


@dataclasses.dataclass(frozen=True)
class Kernel:
  name: str
  patterns: frozenset  # program patterns it implements; "*" for any
  make: Callable | None  # make(program) -> block function; None: the program's own body
  dtypes: frozenset | None = None  # None: any
  platforms: frozenset = frozenset({"cpu", "gpu", "tpu"})
  workspace: Callable | None = None  # workspace(program, sizes) -> bytes; None: the program's
  dtype_of: str | None = None  # the read buffer whose dtype must be accepted; None: every read

  def workspace_bytes(self, program, sizes) -> int:
    if self.workspace is not None:
      return int(self.workspace(program, sizes))
    return int(program.workspace(sizes)) if program.workspace else 0

  def matches(self, program) -> bool:
    return "*" in self.patterns or program.pattern in self.patterns


_KERNELS: dict[str, Kernel] = {}


def register(kernel: Kernel):
  if kernel.name in _KERNELS:
    raise ValueError(f"kernel {kernel.name!r} is already registered")
  _KERNELS[kernel.name] = kernel
  return kernel


def candidates(program, mesh) -> list[str]:
  """Names of the kernels that can replace ``program``'s body on ``mesh``."""
  out = []
  for name in _KERNELS:
    try:
      lookup(name, program, mesh)
    except PreconditionError:
      continue
    out.append(name)
  return out


def kernel(name: str) -> Kernel:
  if name not in _KERNELS:
    raise UnknownNameError(f"no kernel {name!r}; registered: {sorted(_KERNELS)}")
  return _KERNELS[name]


def lookup(name: str, program, mesh) -> Callable:
  """The kernel function for ``program`` on ``mesh``; raises if it does not apply.

  On an ``AbstractMesh`` (planning only) the device platform is not checked.
  """
  k = kernel(name)
  if not k.matches(program):
    raise PreconditionError(
        f"patch({name!r}): kernel implements {sorted(k.patterns)}, not {program.name} (pattern {program.pattern!r})")
  dtypes = {np.dtype(b.dtype) for b in program.reads if k.dtype_of in (None, b.name)}
  if k.dtypes is not None and not dtypes <= k.dtypes:
    raise PreconditionError(f"patch({name!r}): kernel accepts {sorted(map(str, k.dtypes))}, "
                            f"program has {sorted(map(str, dtypes))}")
  platform = mesh.devices.flat[0].platform if isinstance(mesh, jax.sharding.Mesh) else None
  if platform is not None and platform not in k.platforms:
    raise PreconditionError(f"patch({name!r}): kernel runs on {sorted(k.platforms)}, mesh devices are {platform!r}")
  return k.make(program) if k.make else program.body


register(Kernel("xla", frozenset({"*"}), None))
