"""The DSL: named axes, buffers bound to axes, and compute grids.

An operator is declared once as a loop nest::

  m, n, k = Axis("m", 512), Axis("n", 256), Axis("k", 1024)
  a = match_buffer("A", (m, k), jnp.float32)
  b = match_buffer("B", (k, n), jnp.float32)
  c = match_buffer("C", (m, n), jnp.float32)
  program = grid((m, n, k), "ssr", reads=(a, b), writes=c,
                 body=lambda ctx, a, b: a @ b, reduction=Sum())

A buffer dimension may bind several axes, major first (``(hk, g)`` for the
query heads of grouped-query attention). Axes a buffer names but the grid does
not loop over are block axes: the body always sees them whole.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax.numpy as jnp
import numpy as np

from jaxmercury.errors import ProgramError
from jaxmercury.ir.program import Program
from jaxmercury.ir.reductions import Reduction
from jaxmercury.ir.routing import Routing

_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")


def check_name(name: str, what: str, error: type = ProgramError) -> str:
  """Returns ``name`` if it is a non-empty identifier; raises ``error`` otherwise."""
  if not isinstance(name, str) or not name or not set(name) <= _NAME_CHARS:
    raise error(f"{what} name {name!r} must be a non-empty identifier (letters, digits and _)")
  return name


def check_dtype(dtype, where: str) -> np.dtype:
  """``dtype`` as a numpy dtype if it is a numeric (or bool) type JAX computes with; raises ``ProgramError``."""
  try:
    dt = np.dtype(dtype)
  except TypeError:
    raise ProgramError(f"{where}: {dtype!r} is not a dtype; use a numeric type such as "
                       "jnp.float32, jnp.bfloat16 or jnp.float16") from None
  if not (jnp.issubdtype(dt, jnp.number) or dt == np.bool_):
    raise ProgramError(f"{where}: dtype {dt} is neither numeric nor bool; use a numeric type such as "
                       "jnp.float32, jnp.bfloat16 or jnp.float16")
  return dt


@dataclasses.dataclass(frozen=True)
class Axis:
  """A named loop variable with a static extent."""

  name: str
  extent: int

  def __post_init__(self):
    check_name(self.name, "axis")
    if not isinstance(self.extent, (int, np.integer)) or self.extent < 1:
      raise ProgramError(
          f"axis {self.name!r} needs a positive integer extent, got {self.extent!r}")


@dataclasses.dataclass(frozen=True)
class Buffer:
  """A tensor whose dimensions are bound to axes.

  Attributes:
    name: the buffer's name, used by schedule primitives.
    dims: one tuple of axes per dimension, major axis first.
    dtype: element type.
  """

  name: str
  dims: tuple[tuple[Axis, ...], ...]
  dtype: np.dtype

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(int(np.prod([a.extent for a in d])) for d in self.dims)

  @property
  def axes(self) -> tuple[str, ...]:
    """Axis names in canonical order: one per axis, composite dims split."""
    return tuple(a.name for d in self.dims for a in d)

  @property
  def canonical_shape(self) -> tuple[int, ...]:
    return tuple(a.extent for d in self.dims for a in d)

  def __str__(self):
    dims = ", ".join("*".join(a.name for a in d) for d in self.dims)
    return f"{self.name}[{dims}]"


def match_buffer(name: str, dims: Sequence[Axis | Sequence[Axis]], dtype) -> Buffer:
  """Binds a named buffer to axes.

  Args:
    name: the buffer name.
    dims: for each dimension an ``Axis``, or a tuple of axes (major first)
      that the dimension flattens.
    dtype: element type.

  Returns:
    The ``Buffer``.
  """
  check_name(name, "buffer")
  bound = []
  for d in dims:
    group = (d,) if isinstance(d, Axis) else tuple(d)
    if not group or not all(isinstance(a, Axis) for a in group):
      raise ProgramError(f"buffer {name!r}: each dimension must be an Axis or a tuple of Axes, got {d!r}")
    bound.append(group)
  names = [a.name for g in bound for a in g]
  if len(set(names)) != len(names):
    raise ProgramError(f"buffer {name!r} binds an axis twice: {names}; each axis may index a buffer once")
  return Buffer(name, tuple(bound), check_dtype(dtype, f"buffer {name!r}"))


def grid(loops: Sequence[Axis], kinds: str, *, reads: Sequence[Buffer], writes: Buffer,
         body: Callable, reduction: Reduction | None = None, name: str = "program",
         pattern: str | None = None, statement: str | None = None,
         params: dict | None = None, flops: float | None = None,
         workspace: Callable | None = None, routing: Routing | None = None,
         sample: Callable | None = None) -> Program:
  """Declares a compute grid: the loop nest of an operator.

  Args:
    loops: the loop axes, outermost first.
    kinds: one letter per loop, ``s`` (spatial) or ``r`` (reduction).
    reads: input buffers, in the order the program takes them.
    writes: the output buffer. It must be indexed by every spatial loop and
      by no reduction loop.
    body: ``body(ctx, *blocks)`` computes one block. ``blocks`` are the read
      buffers' blocks in canonical layout (one dimension per axis);
      ``ctx.start(axis)`` is the block's global offset along an axis. It
      returns what ``reduction.from_body`` accepts (the output block for a
      sum).
    reduction: the associative combine of the reduction loops; required when
      any loop is a reduction.
    name: a name shown in printouts.
    pattern: the kernel pattern this nest implements (for ``patch``).
    statement: a one-line description of the body for printouts.
    params: static parameters that identify the program (shapes, flags).
    flops: floating-point operations of the whole program, for the cost
      model; default two per point of the loop nest.
    workspace: ``workspace(sizes) -> bytes``, the temporary memory one body
      call needs for blocks of the given per-axis sizes (memory estimate).
    routing: for a routed reduction (a mixture of experts), which loop a
      router picks from and how (``ir.routing.Routing``); None: dense.
    sample: ``sample(key, inputs) -> inputs``: ``Program.random_inputs`` gives its normal draws this form (an
      attention's segment ids: rows of packed documents).

  Returns:
    The ``Program``.
  """
  loops = tuple(loops)
  if not all(isinstance(a, Axis) for a in loops):
    raise ProgramError(f"grid: loops must be Axis objects, got {[type(a).__name__ for a in loops]}")
  if not isinstance(kinds, str) or len(kinds) != len(loops) or set(kinds) - {"s", "r"}:
    raise ProgramError(f"kinds {kinds!r} must give one of 's'/'r' for each of {len(loops)} loops "
                       f"{[a.name for a in loops]}")
  reads = tuple(reads) if isinstance(reads, (list, tuple)) else (reads,)
  for role, buf in [("reads", b) for b in reads] + [("writes", writes)]:
    if not isinstance(buf, Buffer):
      raise ProgramError(f"grid: {role} must hold Buffers made by match_buffer, got {type(buf).__name__}")
  if not reads:
    raise ProgramError("grid: a program needs at least one read buffer")
  if reduction is not None and not isinstance(reduction, Reduction):
    raise ProgramError(f"grid: reduction must be a jaxmercury Reduction such as Sum() or LogSumExp(), "
                       f"got {reduction!r}")
  if routing is not None and not isinstance(routing, Routing):
    raise ProgramError(f"grid: routing must be a jaxmercury.ir.Routing, got {type(routing).__name__}")
  program = Program(name=name, loops=loops, kinds=dict(zip([a.name for a in loops], kinds)),
                    reads=reads, writes=writes, body=body, reduction=reduction,
                    pattern=pattern, statement=statement, params=dict(params or {}),
                    flops=float(flops if flops is not None else 2 * np.prod([a.extent for a in loops], dtype=float)),
                    workspace=workspace, routing=routing, sample=sample)
  if not callable(body):  # after the structure, whose errors say more
    raise ProgramError(f"{name}: body must be callable as body(ctx, *blocks), got {type(body).__name__}")
  return program
