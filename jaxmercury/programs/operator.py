"""An operator's declared parameters: what it is built from, their defaults, meanings and valid values, as data.

A program function (``attention``, ``matmul``, ...) takes sizes and
switches; its ``Operator`` declares the ones a user picks when tuning it,
so that a front end (``python -m jaxmercury.tune``) gives each a flag, help
and checks without knowing the operator::

  Operator(name="matmul", summary="C = A @ B", build=matmul, params=(
      Param(name="m", default=512, minimum=1, help="rows of A and C"), ..., DTYPE))

``build`` receives every parameter by name. A value outside its declared
range is refused by ``Param.problem``; rules between parameters (query heads
a multiple of key/value heads) stay in the program function, which raises
``ProgramError`` naming them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from jaxmercury.errors import ProgramError

KINDS = (int, float, bool, str)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Param:
  """One parameter of an operator.

  Attributes:
    name: the program function's keyword (an identifier; the flag ``--name``).
    default: its value when not given; None for an optional one (``kind`` then says its type).
    help: what it means, in a few words.
    kind: ``int``, ``float``, ``bool`` or ``str``; by default the default's type.
    minimum: the least valid value of a number.
    choices: the valid values of a string.
  """

  name: str
  default: Any
  help: str
  kind: type | None = None
  minimum: int | float | None = None
  choices: tuple[str, ...] = ()

  def __post_init__(self):
    if self.kind is None:
      if self.default is None:
        raise ProgramError(f"parameter {self.name!r}: an optional parameter (default None) needs its kind")
      object.__setattr__(self, "kind", type(self.default))
    if self.kind not in KINDS:
      raise ProgramError(f"parameter {self.name!r}: kind {self.kind!r} is not one of int, float, bool, str")
    if not self.name.isidentifier():
      raise ProgramError(f"parameter name {self.name!r} must be an identifier")
    if self.choices and self.kind is not str:
      raise ProgramError(f"parameter {self.name!r}: choices are for str parameters")
    if self.default is not None and self.problem(self.default):
      raise ProgramError(f"parameter {self.name!r}: default {self.default!r} {self.problem(self.default)}")

  def problem(self, value) -> str | None:
    """Why ``value`` is not valid for this parameter, saying what would be; None when it is."""
    if value is None:
      return None
    if self.kind is float and isinstance(value, int) and not isinstance(value, bool):
      value = float(value)
    if not isinstance(value, self.kind) or (self.kind is int and isinstance(value, bool)):
      return f"must be {_KIND_WORDS[self.kind]}"
    if self.minimum is not None and value < self.minimum:
      return f"must be at least {self.minimum}"
    if self.choices and value not in self.choices:
      return f"must be one of {', '.join(self.choices)}"
    return None


_KIND_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Operator:
  """An operator users tune by name: its program function and the parameters it is built from.

  Attributes:
    name: the operator's name (``python -m jaxmercury.tune NAME``).
    summary: one line saying what it computes.
    params: its parameters, in the order a reader meets them.
    build: the program function, called with every parameter by keyword.
  """

  name: str
  summary: str
  params: tuple[Param, ...]
  build: Callable[..., Any]

  def __post_init__(self):
    if not self.name.isidentifier():
      raise ProgramError(f"operator name {self.name!r} must be an identifier")
    names = [p.name for p in self.params]
    if twice := sorted({n for n in names if names.count(n) > 1}):
      raise ProgramError(f"operator {self.name!r} declares parameters {twice} twice")

  def defaults(self) -> dict[str, Any]:
    return {p.name: p.default for p in self.params}

  def program(self, **values):
    """The program at ``values`` (the defaults where not given).

    Raises:
      ProgramError: a name that is no parameter, or a value the parameter or the program function refuses.
    """
    if unknown := sorted(set(values) - {p.name for p in self.params}):
      raise ProgramError(f"{self.name}: no parameter {unknown}; its parameters are "
                         f"{', '.join(p.name for p in self.params)}")
    for p in self.params:
      if p.name in values and (why := p.problem(values[p.name])):
        raise ProgramError(f"{self.name}: {p.name}={values[p.name]!r} {why} ({p.help})")
    return self.build(**{**self.defaults(), **values})


DTYPE = Param(name="dtype", default="float32", choices=("float32", "bfloat16", "float16"), help="element type")
