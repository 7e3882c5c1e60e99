"""A CommIR program: the loop nest of one operator, before any schedule."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxmercury.errors import InputError, ProgramError, UnknownNameError
from jaxmercury.ir.orders import true_positions
from jaxmercury.ir.reductions import Reduction
from jaxmercury.ir.routing import Routing


@dataclasses.dataclass(frozen=True)
class BlockContext:
  """What a body knows about the block it computes.

  Attributes:
    starts: global offset of the block along each loop axis in storage order
      (traced ints).
    sizes: the block's static extent along each axis.
    extents: each axis's true global extent (before any padding).
    zigzag: for axes stored in zigzag order, their number of chunks.
  """

  starts: Mapping[str, Any]
  sizes: Mapping[str, int]
  extents: Mapping[str, int]
  zigzag: Mapping[str, int] = dataclasses.field(default_factory=dict)

  def renamed(self, names: Mapping[str, str]) -> "BlockContext":
    """The same block with its axes renamed (``names``: old -> new; others kept)."""
    r = lambda m: {names.get(k, k): v for k, v in m.items()}
    return BlockContext(r(self.starts), r(self.sizes), r(self.extents), r(self.zigzag))

  def start(self, axis: str):
    """The true global position of the block's first element along ``axis``."""
    return self.positions(axis)[0] if axis in self.zigzag else self.starts.get(axis, 0)

  def contiguous(self, axis: str) -> bool:
    """Whether the block's true positions along ``axis`` are consecutive."""
    chunks = self.zigzag.get(axis)
    return chunks is None or (self.extents[axis] // chunks) % self.sizes[axis] == 0

  def positions(self, axis: str):
    """True global positions of the block's elements along ``axis``."""
    stored = self.starts.get(axis, 0) + jnp.arange(self.sizes[axis])
    if axis in self.zigzag:
      return true_positions(stored, self.extents[axis], self.zigzag[axis])
    return stored

  def valid(self, axis: str):
    """Which of the block's positions along ``axis`` lie inside the true extent."""
    return self.positions(axis) < self.extents[axis]


@dataclasses.dataclass(frozen=True, eq=False)
class Program:
  """An operator as a loop nest over named axes (see ``jaxmercury.grid``)."""

  name: str
  loops: tuple
  kinds: Mapping[str, str]
  reads: tuple
  writes: Any
  body: Callable
  reduction: Reduction | None
  pattern: str | None = None
  statement: str | None = None
  params: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  flops: float = 0.0
  workspace: Callable | None = None
  routing: Routing | None = None  # a routed reduction (mixture of experts): ``ir.routing``
  sample: Callable | None = None  # ``sample(key, inputs) -> inputs``: random inputs given their form (packed ids)

  def fingerprint(self) -> str:
    """A structural hash: loops, kinds, buffers, dtypes, reduction, body and parameters."""
    body = getattr(self.body, "func", self.body)
    data = {
        "name": self.name, "pattern": self.pattern, "params": {k: str(v) for k, v in self.params.items()},
        "loops": [(a.name, a.extent, self.kinds[a.name]) for a in self.loops],
        "buffers": [(b.name, [[(a.name, a.extent) for a in d] for d in b.dims], str(b.dtype))
                    for b in self.reads + (self.writes,)],
        "reduction": self.reduction.name if self.reduction else None,
        "body": f"{getattr(body, '__module__', '')}.{getattr(body, '__qualname__', repr(body))}",
    }
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]

  def __post_init__(self):
    axes = {}
    for buf in self.reads + (self.writes,):
      for d in buf.dims:
        for a in d:
          if axes.setdefault(a.name, a) != a:
            raise ProgramError(
                f"axis {a.name!r} has extents {axes[a.name].extent} and {a.extent} in {self.name}")
    names = [b.name for b in self.reads + (self.writes,)]
    if len(set(names)) != len(names):
      raise ProgramError(f"{self.name}: buffer names must be unique, got {names}")
    loop_names = [a.name for a in self.loops]
    if len(set(loop_names)) != len(loop_names):
      raise ProgramError(f"{self.name}: loop axes must be unique, got {loop_names}")
    for a in self.loops:
      if a.name not in axes:
        raise ProgramError(f"{self.name}: loop {a.name!r} indexes no buffer; bind it to a buffer dimension "
                           "with match_buffer")
      if axes[a.name] != a:
        raise ProgramError(f"{self.name}: loop {a.name!r} extent differs from its buffers'")
    out = set(self.writes.axes)
    for a in self.loops:
      kind = self.kinds[a.name]
      if kind == "s" and a.name not in out:
        raise ProgramError(f"{self.name}: spatial loop {a.name!r} must index output {self.writes.name!r}")
      if kind == "r" and a.name in out:
        raise ProgramError(f"{self.name}: reduction loop {a.name!r} must not index output {self.writes.name!r}")
    if "r" in self.kinds.values() and self.reduction is None:
      raise ProgramError(f"{self.name}: reduction loops need a reduction (e.g. jaxmercury.Sum())")
    object.__setattr__(self, "axes", axes)
    if self.routing is not None:
      self.routing.check(self)

  @property
  def buffers(self):
    return {b.name: b for b in self.reads + (self.writes,)}

  @property
  def loop_names(self) -> tuple[str, ...]:
    return tuple(a.name for a in self.loops)

  def buffer(self, name: str):
    if name not in self.buffers:
      raise UnknownNameError(f"{self.name} has no buffer {name!r}; buffers: {sorted(self.buffers)}")
    return self.buffers[name]

  def check_inputs(self, inputs):
    """Checks the number, shapes and dtypes of inputs against the read buffers.

    Raises:
      InputError: naming the buffer, what it expects and what it got.
    """
    if len(inputs) != len(self.reads):
      raise InputError(f"{self.name} takes {len(self.reads)} inputs "
                       f"({', '.join(b.name for b in self.reads)}), got {len(inputs)}")
    for buf, x in zip(self.reads, inputs):
      if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise InputError(f"input {buf.name}: expected an array of shape {buf.shape} and dtype {buf.dtype}, "
                         f"got {type(x).__name__}")
      if tuple(x.shape) != buf.shape:
        raise InputError(f"input {buf.name}: expected shape {buf.shape} for {buf}, got {tuple(x.shape)}")
      if np.dtype(x.dtype) != buf.dtype:
        raise InputError(f"input {buf.name}: expected dtype {buf.dtype}, got {x.dtype}")

  def state_axes(self) -> tuple[tuple[str, ...], ...]:
    """The axes of each leaf of a partial result (the reduction's state)."""
    if self.reduction is None:
      return (self.writes.axes,)
    return self.reduction.state_axes(self.writes.axes)

  def state_of(self, result):
    """A body's (or kernel's) return value as a partial state: a tuple of float32 leaves."""
    if self.reduction is None:
      return (jnp.asarray(result, jnp.float32),)
    return self.reduction.from_body(result)

  def run_body(self, ctx, blocks):
    """Runs the body on canonical blocks and returns its state."""
    return self.state_of(self.body(ctx, *blocks))

  def finalize(self, state):
    if self.reduction is None:
      return state[0].astype(self.writes.dtype)
    return self.reduction.finalize(state, self.writes.dtype)

  def reference(self, *inputs):
    """Runs the plain, undistributed loop nest on whole arrays."""
    self.check_inputs(inputs)
    blocks = [jnp.reshape(x, b.canonical_shape) for b, x in zip(self.reads, inputs)]
    extents = {n: a.extent for n, a in self.axes.items()}
    ctx = BlockContext(starts={}, sizes=extents, extents=extents)
    out = self.finalize(self.run_body(ctx, blocks))
    return jnp.reshape(out, self.writes.shape)

  def random_inputs(self, key: jax.Array, scale: float = 1.0):
    """Fresh normal random inputs with the read buffers' shapes and dtypes (boolean buffers: True with
    probability 3/4), given their form by ``sample`` where the program has one (an attention's segment ids: packed
    rows)."""
    buffers = tuple((tuple(b.shape), jnp.dtype(b.dtype).name) for b in self.reads)
    inputs = _random_inputs(key, jnp.float32(scale), buffers=buffers)
    return self.sample(key, inputs) if self.sample else inputs

  def __str__(self):
    loops = " ".join(f"{a.name}:{a.extent}{self.kinds[a.name]}" for a in self.loops)
    reads = ", ".join(str(b) for b in self.reads)
    return f"{self.name}({reads}) -> {self.writes} over [{loops}]"


@functools.partial(jax.jit, static_argnames="buffers")
def _random_inputs(key, scale, *, buffers):
  """``Program.random_inputs`` as one compiled program (drawn op by op, each draw would compile on its own)."""
  keys = jax.random.split(key, len(buffers))
  return tuple(jax.random.bernoulli(k, 0.75, shape) if dtype == "bool" else
               (scale * jax.random.normal(k, shape, jnp.float32)).astype(dtype)
               for k, (shape, dtype) in zip(keys, buffers))
