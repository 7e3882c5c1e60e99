"""What routing did to a program: one entry per attention and contraction, and the table of them."""

from __future__ import annotations

import dataclasses

PLAIN = "plain (not tuned"  # how a reason starts for a call that runs as written until tuned


@dataclasses.dataclass(frozen=True)
class Entry:
  """One attention or contraction of a traced program.

  Attributes:
    kind: ``"attention"`` or ``"matmul"``.
    where: the source line of the model's code that made it (``file:line (function)``).
    shapes: its operands' shapes (attention: queries, keys, values; matmul: the two operands).
    routed: whether a jaxmercury operator computes it.
    schedule: the schedule's name (strategy and kernel, and the sizes it was tuned at for a nearest-sizes
      winner); None where not routed.
    reason: where the schedule comes from (``database hit``, ``tuned``, ``nearest sizes' winner``), ``plain (not
      tuned)`` for a call nothing was measured for (it runs as written; ``plain (not tuned: ...)`` says why a tune
      asked for did not run), or why the call is not routed (its mask, a bias, sizes the mesh does not divide,
      dtypes, ...).
    mask: the attention's mask kind (``none``, ``causal``, ``sliding_window``, ...); empty for a matmul.
    module: the path of the module whose call made it (``layers.0.attn``, for a module ``distribute`` routes);
      empty where it is the root module's own code or a function's.
    program: the operator's program the call runs once routed (``jaxmercury.programs``: tune it with
      ``jaxmercury.autotune(entry.program, mesh)``, or store a winner for it); also for a call that runs plain
      until tuned; None where the call cannot be routed.
  """

  kind: str
  where: str
  shapes: tuple
  routed: bool
  schedule: str | None
  reason: str
  mask: str = ""
  module: str = ""
  program: object = dataclasses.field(default=None, compare=False, repr=False)


class Report(tuple):
  """The entries of a program, in program order; ``str()`` is a table."""

  @property
  def routed(self) -> list[Entry]:
    return [e for e in self if e.routed]

  @property
  def fallen_back(self) -> list[Entry]:
    return [e for e in self if not e.routed]

  @property
  def plain(self) -> list[Entry]:
    """The calls that run as written because nothing was measured for them (routed once tuned)."""
    return [e for e in self if not e.routed and e.reason.startswith(PLAIN)]

  def of_kind(self, kind: str) -> list[Entry]:
    return [e for e in self if e.kind == kind]

  def __str__(self) -> str:
    head = ("#", "kind", "module", "where", "shapes", "routed", "schedule", "reason")
    rows = [head] + [(str(i), e.kind + (f" ({e.mask})" if e.mask and e.mask != "none" else ""), e.module or "-",
                      e.where, " ".join("x".join(map(str, s)) for s in e.shapes), "yes" if e.routed else "no",
                      e.schedule or "-", e.reason) for i, e in enumerate(self)]
    widths = [max(len(r[c]) for r in rows) for c in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    summary = (f"{len(self.routed)} of {len(self)} routed "
               f"({len([e for e in self.routed if e.kind == 'attention'])} attention, "
               f"{len([e for e in self.routed if e.kind == 'matmul'])} matmul)"
               + (f", {len(self.plain)} plain until tuned" if self.plain else ""))
    return "\n".join(lines + [summary])

  def __repr__(self) -> str:
    return f"Report({list(self)!r})"
