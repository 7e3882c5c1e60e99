"""The operators users tune by name (``python -m jaxmercury.tune NAME``): the shipped ones and any registered.

One line adds an operator: ``register_operator(Operator(...))`` (``programs.operator``), after which the
command line offers it with a flag per parameter, its help and its checks.
"""

from __future__ import annotations

from jaxmercury.errors import ProgramError, UnknownNameError
from jaxmercury.programs.attention import OPERATOR as ATTENTION
from jaxmercury.programs.matmul import OPERATOR as MATMUL
from jaxmercury.programs.moe import OPERATOR as MOE
from jaxmercury.programs.operator import Operator
from jaxmercury.programs.weighted_sum import OPERATOR as WEIGHTED_SUM

_OPERATORS: dict[str, Operator] = {op.name: op for op in (ATTENTION, MATMUL, MOE, WEIGHTED_SUM)}


def register_operator(operator: Operator) -> Operator:
  """Adds ``operator`` under its name; returns it.

  Raises:
    ProgramError: another operator has that name.
  """
  if not isinstance(operator, Operator):
    raise ProgramError(f"register_operator takes a programs.Operator, got {type(operator).__name__}")
  if _OPERATORS.get(operator.name, operator) != operator:
    raise ProgramError(f"an operator named {operator.name!r} is registered already")
  _OPERATORS[operator.name] = operator
  return operator


def operators() -> tuple[Operator, ...]:
  """Every registered operator, the shipped ones first."""
  return tuple(_OPERATORS.values())


def find_operator(name: str) -> Operator:
  """The operator named ``name``.

  Raises:
    UnknownNameError: no operator has that name (the message lists those that exist).
  """
  if name not in _OPERATORS:
    raise UnknownNameError(f"unknown operator {name!r}; the operators are {', '.join(_OPERATORS)}")
  return _OPERATORS[name]
