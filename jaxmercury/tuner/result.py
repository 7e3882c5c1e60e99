"""``TuneResult``: what a tune found, and why each candidate won, lost or failed."""

from __future__ import annotations

import dataclasses
import math

from jaxmercury.tuner import measure
from jaxmercury.tuner.candidates import Candidate
from jaxmercury.tuner.cost import Machine
from jaxmercury.tuner.database import FORWARD

# A tune's stages, as ``TuneResult.phases`` names them: the cost model's figures, then the candidates proposed,
# scored and pruned, the trusted reference, the compiles (each round of them), the checks and timed runs, the
# final round and the stored records.
STAGES = ("calibration", "propose", "score", "prune", "reference", "compile", "check", "time", "final round",
          "store")


@dataclasses.dataclass
class TuneResult:
  """The winner and every candidate considered, with why each lost or failed.

  Attributes:
    best: the winner (a plain program when no schedule beats it beyond the noise: ``best.plain``), or None
      when no candidate passed.
    candidates: every candidate, plain ones included.
    from_database: read from the tuning database, not tuned.
    machine: the cost model's figures.
    resumed: measurements read back from the database instead of taken.
    objective: what the times are of: the forward, or a training step (``database.TRAINING``).
    decision: how the winner was chosen (the final round's verdict, ties within noise named).
    tied: the candidates tied with the winner within the final round's noise.
    phases: seconds per stage of the tune, in the order they began (``STAGES``); empty for a winner read from
      the database.
    spearman: the cost model's rank agreement with the measured times (Spearman's correlation of the
      predictions, corrected as they were ranked, and the medians of the timed candidates, plain programs left
      out; 1: the same order); None for fewer than three.
    corrections: the per-kernel corrections of the cost model the candidates were ranked with
      (``accuracy.Corrections``).
    not_offered: per fused kernel that computes this operator but cannot run here, why not.
    compiled: how many programs the tune compiled to measure (forwards and training steps).
    references: how many times the tune computed the trusted reference (``reference.trial``): one at most.
  """

  best: Candidate | None
  candidates: list
  from_database: bool = False
  machine: Machine | None = None
  resumed: int = 0
  objective: str = FORWARD
  decision: str = ""
  tied: list = dataclasses.field(default_factory=list)
  phases: dict = dataclasses.field(default_factory=dict)
  spearman: float | None = None
  corrections: object = None
  not_offered: dict = dataclasses.field(default_factory=dict)
  compiled: int = 0
  references: int = 0

  def counts(self) -> str:
    """What the tune computed, for its log line: the programs compiled and the references."""
    return f"{self.compiled} programs compiled, {self.references} reference{'s' if self.references != 1 else ''}"

  @property
  def baseline(self) -> Candidate | None:
    """The best plain candidate that passed (on its final-round time where it had one), or None."""
    plain = [c for c in self.candidates if c.plain and c.status == measure.OK]
    final = [c for c in plain if c.final_ms is not None]
    if final:
      return min(final, key=lambda c: c.final_ms)
    return min(plain, key=lambda c: c.time_ms, default=None)

  @property
  def speedup_vs_baseline(self) -> float | None:
    """The baseline's time over the winner's, on the times of one round (the final round's where both ran in it,
    else their own); None without a winner or a baseline."""
    best, base = self.best, self.baseline
    if best is None or base is None:
      return None
    if best.final_ms is not None and base.final_ms is not None:
      return base.final_ms / best.final_ms
    return base.time_ms / best.time_ms if best.time_ms else None

  def summary(self) -> str:
    """One line: the winner, its time and speedup over the plain program; or, when nothing passed, how many
    candidates were over the memory budget, invalid for the mesh, failed their numerical check or failed
    otherwise (a compile or run error, a time-out)."""
    if self.best is not None:
      best, speedup, base = self.best, self.speedup_vs_baseline, self.baseline
      versus = "" if speedup is None or base is None or base is best else f", {speedup:.2f}x {base.name}"
      what = " (the plain program)" if best.plain else ""
      timed = sum(1 for c in self.candidates if c.status == measure.OK)
      found = "from the database" if self.from_database else f"{timed} of {len(self.candidates)} candidates timed"
      return f"winner {best.name}{what}: {best.time_ms:.3f} ms{versus} ({found})"
    counts = {}
    for c in self.candidates:
      if c.result is not None and c.status != measure.OK:
        cause = c.result.cause or ("failed to compile or run" if c.status == measure.FAILED else "pruned")
        counts[cause] = counts.get(cause, 0) + 1
    parts = ", ".join(f"{n} {cause}" for cause, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    return f"nothing passed of {len(self.candidates)} candidates: {parts or 'none was offered'}"

  def table(self) -> str:
    """Every candidate, best first: ``plain`` in the origin column marks the programs a user would otherwise run;
    ``final ms`` is the side-by-side time of the final round's finalists, which decided the winner."""
    rows = ["| candidate | origin | predicted ms | measured ms | final ms | memory MiB | status | note |",
            "|---|---|---|---|---|---|---|---|"]
    for c in sorted(self.candidates, key=_rank):
      t = "" if c.time_ms is None else f"{c.time_ms:.3f}"
      final = "" if c.final_ms is None else f"{c.final_ms:.3f}"
      predicted = "" if math.isnan(c.predicted_ms) else f"{c.predicted_ms:.3f}"
      note = c.final.note if c.final else c.result.reason if c.result else ""
      if c is self.best:
        note = f"winner: {note}" if note else "winner"
      rows.append(f"| {c.name} | {c.origin} | {predicted} | {t} | {final} | {c.memory_bytes / 2**20:.2f} | "
                  f"{c.status} | {note} |")
    if self.not_offered:
      rows.append("\nnot offered: " + "; ".join(f"{name} ({why})" for name, why in sorted(self.not_offered.items())))
    return "\n".join(rows)


def _rank(c):
  order = {measure.OK: 0, measure.FAILED: 1, measure.PRUNED: 2}
  time = c.time_ms if c.time_ms is not None else c.predicted_ms
  return order[c.status], c.final_ms is None, c.final_ms or 0.0, math.inf if math.isnan(time) else time
