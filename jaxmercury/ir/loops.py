"""Loops of a scheduled nest and their roles."""

from __future__ import annotations

import dataclasses

VECTOR = "vector"  # computed whole inside one body call
SERIAL = "serial"  # a temporal loop: one body call per iteration
PARALLEL = "parallel"  # spread over one mesh level


def spec_levels(entry) -> tuple[str, ...]:
  """The mesh levels one ``PartitionSpec`` entry names (None: none; a level's name; a tuple of them), major
  first."""
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


@dataclasses.dataclass
class Loop:
  """One loop of the nest.

  Attributes:
    name: the loop's name (the axis name until ``tile`` renames it).
    axis: the program axis this loop iterates a factor of.
    extent: number of iterations.
    kind: ``s`` (spatial) or ``r`` (reduction), inherited from the axis.
    role: vector, serial or parallel.
    level: the mesh level of a parallel loop.
    shifted_by: for a shifted serial loop, the parallel loop it follows.
  """

  name: str
  axis: str
  extent: int
  kind: str
  role: str = VECTOR
  level: str | None = None
  shifted_by: str | None = None

  @property
  def distributed(self) -> bool:
    """Parallel or shifted: its factor of the axis is spread over a mesh level."""
    return self.role == PARALLEL or self.shifted_by is not None
