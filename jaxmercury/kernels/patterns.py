"""Loop-nest patterns that kernels implement, and matching a program against them.

A pattern is a family of template programs (``attention``, causal or not,
with or without the log-sum-exp output; ``matmul``; the attention backward
pair). A program matches a pattern when, up to a renaming of its axes:

* its read and write buffers bind the same axes in the same dimensions;
* its loops have the same kinds (spatial or reduction), and its block axes
  are the template's block axes;
* its reduction is the same merge over the same value axes;
* its body computes what the template's body computes: checked on small
  random blocks, unless the program declares the pattern itself (the shipped
  programs), whose bodies are the templates' own.

A kernel may also name a pattern that has no template here (a user's own
operator): then only programs that declare that pattern match.

The match gives the renaming (program axis -> pattern axis) and the
template's parameters (``causal``, an attention program's mask: its
``window``, ``segment_ids`` and ``mask_axes``, ...), so a kernel written for the pattern's
axis names serves a user's program that names its axes differently.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxmercury.errors import PreconditionError
from jaxmercury.ir.program import BlockContext
from jaxmercury.programs import attention_backward as backward
from jaxmercury.programs.attention import attention as attention_program
from jaxmercury.programs.matmul import matmul as matmul_program

_PROBE_EXTENT = 8  # loop axes are probed on blocks of at most this size


@dataclasses.dataclass(frozen=True)
class Pattern:
  """A family of template programs.

  Attributes:
    name: what kernels name in ``Kernel.patterns``.
    template: ``template(**choice)`` builds a small program of the pattern.
    choices: each template parameter's possible values.
    declared: template parameters with too many values to try (an attention mask's window, its buffers): a
      program that declares the pattern gives them from its own parameters (where it has them); programs
      matched by their bodies take the template's defaults.
  """

  name: str
  template: Callable
  choices: Mapping[str, tuple] = dataclasses.field(default_factory=dict)
  declared: tuple[str, ...] = ()

  def instances(self, fixed: Mapping[str, Any] | None = None):
    """Each choice of the parameters and its template, with the ``fixed`` ones (a declaring program's) set."""
    keys = list(self.choices)
    for values in itertools.product(*(self.choices[k] for k in keys)):
      choice = {**dict(zip(keys, values)), **(fixed or {})}
      yield choice, self.template(**choice)


@dataclasses.dataclass(frozen=True)
class Match:
  """How a program matches a pattern.

  Attributes:
    to_pattern: program axis name -> the pattern's axis name.
    params: the template parameters the program's body agrees with.
  """

  to_pattern: Mapping[str, str]
  params: Mapping[str, Any]

  @property
  def renames(self) -> bool:
    return any(k != v for k, v in self.to_pattern.items())


_PATTERNS: dict[str, Pattern] = {}


def register_pattern(pattern: Pattern) -> Pattern:
  _PATTERNS[pattern.name] = pattern
  return pattern


def _bind(template, program) -> dict[str, str]:
  """The axis renaming program -> template that makes their buffers agree; raises if none."""
  if len(template.reads) != len(program.reads):
    raise PreconditionError(f"reads {len(program.reads)} buffers, the pattern reads {len(template.reads)}")
  rename: dict[str, str] = {}
  for t, p in zip(template.reads + (template.writes,), program.reads + (program.writes,)):
    t_groups, p_groups = [tuple(a.name for a in d) for d in t.dims], [tuple(a.name for a in d) for d in p.dims]
    if [len(g) for g in t_groups] != [len(g) for g in p_groups]:
      raise PreconditionError(f"buffer {p} has dimensions {p_groups}, the pattern's {t} has {t_groups}")
    for pa, ta in zip(sum(p_groups, ()), sum(t_groups, ())):
      if rename.setdefault(pa, ta) != ta:
        raise PreconditionError(f"axis {pa!r} of buffer {p.name!r} plays two roles of the pattern "
                                f"({rename[pa]!r} and {ta!r})")
  if len(set(rename.values())) != len(rename):
    raise PreconditionError("two axes of the program play one role of the pattern")
  p_kinds = {rename[a.name]: program.kinds[a.name] for a in program.loops}
  t_kinds = {a.name: template.kinds[a.name] for a in template.loops}
  if p_kinds != t_kinds:
    raise PreconditionError(f"loops (pattern names) {p_kinds} differ from the pattern's {t_kinds}")
  return rename


def _same_reduction(template, program, rename) -> bool:
  t, p = template.reduction, program.reduction
  if (t is None) != (p is None):
    return False
  if t is None:
    return True
  if type(t) is not type(p):
    return False
  mine = {k: tuple(rename.get(a, a) for a in v) if k == "value_axes" else v for k, v in vars(p).items()}
  return mine == vars(t)


def _probe_blocks(program, key):
  sizes = {n: (min(a.extent, _PROBE_EXTENT) if n in program.kinds else a.extent)
           for n, a in program.axes.items()}
  keys = jax.random.split(key, len(program.reads))
  blocks = [jax.random.normal(k, tuple(sizes[a] for a in b.axes), jnp.float32).astype(b.dtype)
            for k, b in zip(keys, program.reads)]
  return sizes, blocks


def _same_body(template, program, rename) -> bool:
  """Whether both bodies give the same state on small random blocks."""
  cpu = jax.devices("cpu")[0]
  with jax.default_device(cpu):
    sizes, blocks = _probe_blocks(program, jax.random.key(np.random.randint(1 << 30)))
    extents = {n: a.extent for n, a in program.axes.items()}
    ctx = BlockContext(starts={}, sizes=sizes, extents=extents)
    mine = program.run_body(ctx, blocks)
    theirs = template.run_body(ctx.renamed(rename), blocks)
  if len(mine) != len(theirs):
    return False
  tol = 1e-4 if all(np.dtype(b.dtype) == np.float32 for b in program.reads) else 3e-2
  return all(x.shape == y.shape and bool(jnp.allclose(x, y, rtol=tol, atol=tol, equal_nan=True))
             for x, y in zip(mine, theirs))


@functools.lru_cache(maxsize=256)
def _match(name: str, program) -> Match:
  declared = program.pattern == name
  if name not in _PATTERNS:  # a user's kernel for a pattern known only by its name
    if declared:
      return Match({a: a for a in program.axes}, {})
    raise PreconditionError(f"{program.name} declares pattern {program.pattern!r}, not {name!r} (register a "
                            f"patterns.Pattern with a template program to match by structure)")
  pat = _PATTERNS[name]
  reasons = []
  fixed = {k: program.params[k] for k in pat.declared if declared and k in program.params}
  for choice, template in pat.instances(fixed):
    if declared and any(program.params.get(k, v) != v for k, v in choice.items()):
      continue
    try:
      rename = _bind(template, program)
    except PreconditionError as e:
      reasons.append(str(e))
      continue
    if not _same_reduction(template, program, rename):
      reasons.append(f"its reduction {program.reduction.name if program.reduction else None!r} differs "
                     f"from the pattern's {template.reduction.name if template.reduction else None!r}")
      continue
    if declared or _same_body(template, program, rename):
      return Match(rename, choice)
    reasons.append(f"its body computes something else than the pattern's with {choice}")
  why = "; ".join(dict.fromkeys(reasons)) or "no template fits its parameters"
  raise PreconditionError(f"{program.name} does not match loop-nest pattern {name!r}: {why}")


def match(name: str, program) -> Match:
  """How ``program`` matches pattern ``name``.

  Raises:
    PreconditionError: saying which buffer, axis, loop, reduction or body
      differs from the pattern.
  """
  return _match(name, program)


MASK_PARAMS = ("window", "segment_ids", "mask_axes")  # an attention program's mask beyond causal (programs.masks)


def _attention(causal=False, emit_lse=False, window=None, segment_ids=False, mask_axes=None):
  prog = attention_program(1, 2, 1, 4, 4, 2, causal=causal, window=window, segment_ids=segment_ids,
                           mask_axes=mask_axes)
  return backward.attention_with_lse(prog) if emit_lse else prog


def _attention_grad(part):
  def build(causal=False, window=None, segment_ids=False, mask_axes=None):
    prog = attention_program(1, 2, 1, 4, 4, 2, causal=causal, window=window, segment_ids=segment_ids,
                             mask_axes=mask_axes)
    return (backward.attention_dq if part == "dq" else backward.attention_dkv)(prog)
  return build


def _matmul():
  return matmul_program(4, 4, 4)


register_pattern(Pattern("attention", _attention, {"causal": (False, True), "emit_lse": (False, True)},
                         declared=MASK_PARAMS))
register_pattern(Pattern("attention_dq", _attention_grad("dq"), {"causal": (False, True)}, declared=MASK_PARAMS))
register_pattern(Pattern("attention_dkv", _attention_grad("dkv"), {"causal": (False, True)}, declared=MASK_PARAMS))
register_pattern(Pattern("matmul", _matmul))
