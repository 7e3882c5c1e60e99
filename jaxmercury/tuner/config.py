"""What a tune is asked (``Task``: the program, mesh, layouts and objective) and how it searches (``TuneConfig``).

Both are frozen: every stage of a tune (``tuner.autotuner``) is a function of
them and of the candidates, which are data.
"""

from __future__ import annotations

import dataclasses
import os

from jaxmercury.tuner import ahead
from jaxmercury.tuner.database import FORWARD, TRAINING

ISOLATIONS = ("thread", "process")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TuneConfig:
  """How a tune searches. ``autotune``'s keyword arguments build one; every field has a default.

  Attributes:
    space: design-space schedules added to the library's.
    top_k: candidates at most, best predicted first, that are compiled and timed besides the plain programs and
      the winner tuned for the nearest other sizes.
    margin: a candidate is compiled only when predicted within this factor of the best prediction (after the
      per-kernel corrections learned from the database, ``tuner.accuracy``); at least 1.
    memory_budget: bytes per device; candidates estimated above it are pruned. None: 90% of a GPU's memory, no
      limit on CPUs.
    iters: timed runs per candidate (the median counts), and rounds between two comparisons in the final round.
    time_limit_s: seconds a candidate's compile and first run may take; past it the candidate is failed.
    retune: tune even when the database holds a winner, and re-time every candidate.
    resume: reuse stored measurements of this key instead of re-timing them.
    isolation: ``"thread"`` measures in this process; ``"process"`` in a worker process killed at the limit.
    training: find the fastest training step (forward and backward) instead of the fastest forward. Candidates
      are ranked on their forwards first; only the best ``training_finalists`` (and the plain programs) have
      their training steps compiled, checked and timed.
    training_finalists: in a training tune, candidates at most whose training steps are compiled, best first by
      their measured forward scaled by their predicted step over their predicted forward.
    final_budget_s: seconds after which the final round starts no new rounds.
    compile_threads: candidates compiled at once (threads: XLA compiles outside Python's lock); None: one per
      CPU core, ``ahead.MAX_THREADS`` at most.
    compile_cache: JAX's persistent compilation cache while tuning (``tuner.compile_cache``): True in its default
      folder (beside the database, or ``$JAXMERCURY_COMPILE_CACHE``), False off, or a folder.
    seed: the random inputs' seed; None: fresh.
  """

  space: int = 24
  top_k: int = 8
  margin: float = 1.5
  memory_budget: int | None = None
  iters: int = 10
  time_limit_s: float | None = None
  retune: bool = False
  resume: bool = True
  isolation: str = "thread"
  training: bool = False
  training_finalists: int = 3
  final_budget_s: float = 3.0
  compile_threads: int | None = None
  compile_cache: bool | str | os.PathLike = True
  seed: int | None = None

  def __post_init__(self):
    if self.isolation not in ISOLATIONS:
      raise ValueError(f"isolation must be 'thread' or 'process', got {self.isolation!r}")
    for name, least in (("space", 0), ("top_k", 0), ("iters", 1), ("training_finalists", 1)):
      if getattr(self, name) < least:
        raise ValueError(f"{name} must be at least {least}, got {getattr(self, name)}")
    if not self.margin >= 1.0:
      raise ValueError(f"margin must be at least 1 (a factor of the best prediction), got {self.margin}")
    if self.compile_threads is not None and self.compile_threads < 1:
      raise ValueError(f"compile_threads must be at least 1, got {self.compile_threads}")
    if self.time_limit_s is not None and not self.time_limit_s > 0:
      raise ValueError(f"time_limit_s must be a positive number of seconds, got {self.time_limit_s}")

  @property
  def objective(self) -> str:
    """What the times are of: ``database.FORWARD`` or ``database.TRAINING``."""
    return TRAINING if self.training else FORWARD

  def threads(self) -> int:
    """Compile threads: ``compile_threads``, else one per CPU core (``ahead.default_threads``)."""
    return ahead.default_threads() if self.compile_threads is None else self.compile_threads


@dataclasses.dataclass(frozen=True)
class Task:
  """What is tuned: ``program`` on ``mesh`` for the caller's layouts (``in_shardings``: a ``PartitionSpec`` per
  input, ``out_sharding``; None: the tuner's choice)."""

  program: object
  mesh: object
  in_shardings: tuple | None = None
  out_sharding: object = None

  @property
  def layouts(self):
    """The database's layouts key: None, or ``(in_shardings, out_sharding)``."""
    if self.in_shardings is None and self.out_sharding is None:
      return None
    return (self.in_shardings, self.out_sharding)
