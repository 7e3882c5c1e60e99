"""Typed kernel configurations: frozen keyword-only dataclasses whose fields declare the tuner's choices.

A kernel's tunable parameters are one dataclass::

  @dataclasses.dataclass(frozen=True, kw_only=True)
  class Blocks:
    block_q: int = param(64, 128)      # the default first, then the other choices
    block_kv: int = param(128, 64)

``variants(Blocks)`` lists every combination of the choices (the default
first); ``make(Blocks, {"block_q": 128})`` builds a checked instance;
``changed(config)`` gives the fields that differ from the defaults, which is
what a trace records and what a name shows. Configurations are data: hashable,
compared by value, stored as plain dicts, never parsed from names.

A configuration class whose ``OPEN`` is True (fused kernels' tiles) accepts
values beyond the listed choices; the kernel's own ``problem`` check then
says whether they fit.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping
from typing import Any

from jaxmercury.errors import PreconditionError, UnknownNameError


def param(default, *others, doc: str = ""):
  """A configuration field: its default, then the other values the tuner tries."""
  return dataclasses.field(default=default, metadata={"choices": (default, *others), "doc": doc})


def choices(cls) -> dict[str, tuple]:
  """Per field of configuration class ``cls``, its choices (the default first)."""
  return {f.name: tuple(f.metadata.get("choices", (f.default,))) for f in dataclasses.fields(cls)}


def variants(cls) -> list:
  """Every combination of ``cls``'s choices, as instances, the default first."""
  table = choices(cls)
  keys = list(table)
  return [cls(**dict(zip(keys, values))) for values in itertools.product(*(table[k] for k in keys))]


def defaults(cls) -> dict[str, Any]:
  return {f.name: f.default for f in dataclasses.fields(cls)}


def make(cls, params: Mapping[str, Any] | None, *, where: str):
  """An instance of ``cls`` with ``params`` set, checked against its fields and (unless ``cls.OPEN``) choices.

  Raises:
    UnknownNameError: a parameter that is not a field (the message lists them).
    PreconditionError: a value that is not one of the field's choices.
  """
  params = dict(params or {})
  if cls is None:
    if params:
      raise UnknownNameError(f"{where}: takes no parameters, got {sorted(params)}")
    return None
  table = choices(cls)
  for key, value in params.items():
    if key not in table:
      raise UnknownNameError(f"{where}: no parameter {key!r}; parameters: {sorted(table)}")
    if not getattr(cls, "OPEN", False) and value not in table[key]:
      raise PreconditionError(f"{where}: {key}={value!r} is not one of the choices {list(table[key])}")
  return cls(**params)


def changed(config) -> dict[str, Any]:
  """The fields of ``config`` that differ from their defaults, in declared order (None: no config)."""
  if config is None:
    return {}
  return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
          if getattr(config, f.name) != f.default}


def label(name: str, config) -> str:
  """``name(p=v, ...)`` with the parameters that differ from the defaults; ``name`` when none do."""
  shown = ", ".join(f"{k}={v}" for k, v in changed(config).items())
  return f"{name}({shown})" if shown else name


def as_dict(config) -> dict[str, Any]:
  """Every field of ``config`` (an empty dict for no config)."""
  return {} if config is None else dataclasses.asdict(config)
