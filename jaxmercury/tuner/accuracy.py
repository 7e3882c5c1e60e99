"""How well the cost model ranks: its rank agreement with the measured times, and corrections learned from them.

The cost model predicts each candidate's time from the calibrated figures;
its errors differ by kernel (a kernel whose blocks run slower inside a nest
than in the calibration's probe, a fused kernel's ring that overlaps less than
modelled). Every tune stores each timed candidate's prediction and measured
time (its winner's record, ``Database.observations``); the correction of a
kernel on a machine is the median ratio of measured to predicted over those,
so that candidates of different kernels are ranked on comparable times. A
kernel seen fewer than ``MIN_SEEN`` times takes the median over every kernel
(or none: 1). Corrections rank and prune (``Corrections.ms``); the candidates
keep the model's own prediction (``Candidate.predicted_ms``), which is what
later tunes learn from.

``spearman`` is the rank agreement a tune reports (``TuneResult.spearman``).
"""

from __future__ import annotations

import dataclasses
import math
import statistics

import numpy as np

MIN_SEEN = 3  # observations of a kernel before its own correction counts
RECENT = 64  # the latest observations per kernel that count


@dataclasses.dataclass(frozen=True)
class Corrections:
  """Per kernel (a fused kernel's name where a candidate has one, else its local kernel's), the factor its
  predictions are multiplied by; ``default`` for kernels not seen ``MIN_SEEN`` times."""

  factors: dict = dataclasses.field(default_factory=dict)
  default: float = 1.0
  seen: int = 0  # observations learned from

  @classmethod
  def learned(cls, observations) -> "Corrections":
    """From ``(kernel, predicted ms, measured ms)`` observations, oldest first (``Database.observations``)."""
    logs = {}
    for kernel, predicted, measured in observations:
      if predicted > 0 and measured > 0:
        logs.setdefault(kernel, []).append(math.log(measured / predicted))
    logs = {k: v[-RECENT:] for k, v in logs.items()}
    every = [x for v in logs.values() for x in v]
    default = math.exp(statistics.median(every)) if len(every) >= MIN_SEEN else 1.0
    factors = {k: math.exp(statistics.median(v)) for k, v in logs.items() if len(v) >= MIN_SEEN}
    return cls(factors, default, len(every))

  def factor(self, candidate) -> float:
    return self.factors.get(kernel_of(candidate), self.default)

  def ms(self, candidate) -> float:
    """The candidate's prediction, corrected (NaN for a plain program, which has none)."""
    return candidate.predicted_ms * self.factor(candidate)

  def __str__(self) -> str:
    if not self.seen:
      return "none learned yet"
    own = ", ".join(f"{k} x{f:.2f}" for k, f in sorted(self.factors.items()))
    return f"{own or 'no kernel seen enough'}; others x{self.default:.2f} (from {self.seen} measurements)"


def kernel_of(candidate) -> str:
  """What a candidate's correction is kept under: its fused kernel, else its local kernel (``"xla"``: none)."""
  return candidate.lowering or candidate.kernel or "xla"


def _ranks(x) -> np.ndarray:
  """Ranks from 0, ties sharing their mean rank."""
  x = np.asarray(x, float)
  out = np.empty(len(x))
  out[np.argsort(x, kind="stable")] = np.arange(len(x))
  for value in np.unique(x):
    out[x == value] = out[x == value].mean()
  return out


def spearman(a, b) -> float | None:
  """Spearman's rank correlation of two sequences (1: the same order); None for fewer than 3 points or where one
  sequence is constant."""
  if len(a) < 3:
    return None
  ra, rb = _ranks(a), _ranks(b)
  if np.ptp(ra) == 0 or np.ptp(rb) == 0:
    return None
  return float(np.corrcoef(ra, rb)[0, 1])
