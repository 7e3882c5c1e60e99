"""Routed reductions: a reduction loop whose iterations each spatial point visits only a few of, chosen by data.

A mixture-of-experts layer sums over experts ``e`` for every token ``t``, but
only the ``top_k`` experts a router picks for ``t`` contribute; the others add
zero. As a loop nest it is an ordinary sum over ``e`` (the dense form: every
expert on every token, masked), which is what ``Program.reference`` computes
and what every schedule's result must equal. ``Routing`` records the sparsity
so that schedules can exploit it: ``Schedule.dispatch`` turns the all-gather of
the token-indexed inputs and the reduce-scatter of the output over the expert
loop's mesh level into a data-dependent exchange that moves only the routed
rows (an all-to-all whose counts the router decides), and the lowering
computes only the routed (token, expert) pairs, grouped by expert.
"""

from __future__ import annotations

import dataclasses

from jaxmercury.errors import ProgramError


@dataclasses.dataclass(frozen=True, kw_only=True)
class Routing:
  """Which loop is routed, by which buffer, and how many of its iterations a point keeps.

  Attributes:
    tokens: the spatial axis whose points are routed (a token).
    experts: the reduction axis a router picks from (an expert).
    router: the read buffer whose product with a token's row scores the experts; its expert
      dimension is a block axis (every token is scored against every expert).
    routed: the read buffers indexed by ``tokens`` that move with a token when it is dispatched.
    top_k: how many experts each token keeps.
    capacity: the most (token, expert) assignments one expert keeps, in token order; None: all
      (dropless).
  """

  tokens: str
  experts: str
  router: str
  routed: tuple[str, ...]
  top_k: int
  capacity: int | None = None

  def check(self, program):
    """Raises ``ProgramError`` unless the named axes and buffers play their roles in ``program``."""
    where = f"{program.name}: routing"
    kinds = program.kinds
    if kinds.get(self.tokens) != "s":
      raise ProgramError(f"{where}: tokens axis {self.tokens!r} must be a spatial loop of the program")
    if kinds.get(self.experts) != "r":
      raise ProgramError(f"{where}: experts axis {self.experts!r} must be a reduction loop of the program")
    names = {b.name: b for b in program.reads}
    if self.router not in names:
      raise ProgramError(f"{where}: router {self.router!r} is not a read buffer; reads: {sorted(names)}")
    looped = sorted(set(names[self.router].axes) & set(kinds))
    if looped:
      raise ProgramError(f"{where}: router {self.router!r} must be indexed by block axes only (every token is "
                         f"scored against every expert), it has loop axes {looped}")
    for name in self.routed:
      if name not in names or self.tokens not in names[name].axes:
        raise ProgramError(f"{where}: routed buffer {name!r} must be a read buffer indexed by {self.tokens!r}")
    if self.tokens not in program.writes.axes:
      raise ProgramError(f"{where}: the output must be indexed by the tokens axis {self.tokens!r}")
    experts = program.axes[self.experts].extent
    if not isinstance(self.top_k, int) or not 1 <= self.top_k <= experts:
      raise ProgramError(f"{where}: top_k={self.top_k!r} must be between 1 and the {experts} experts")
    if self.capacity is not None and (not isinstance(self.capacity, int) or self.capacity < 1):
      raise ProgramError(f"{where}: capacity={self.capacity!r} must be a positive int or None (dropless)")
