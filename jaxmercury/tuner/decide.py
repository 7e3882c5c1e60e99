"""The final round: finalists timed side by side until their differences are resolved, and the winner.

A tune first times each candidate alone (``measure.measure``). Timings taken
one at a time drift with the machine (clocks, temperature, other load), so
the winner is chosen in a final round among the finalists: the best plain
program (what the user would run without jaxmercury) and the candidates whose
own times come within ``FINAL_MARGIN`` (or their own spread) of the best,
``FINAL_SIZE`` at most. They run in interleaved rounds (``measure.rounds``: one
run of each per round, the order rotating), ``batch`` rounds at a time. After
each batch every finalist is compared with the leader (the lowest median of
this round) on the rounds both ran: the median of the per-round ratios of
their times, and its noise, the half-width of that median's 99% interval from
the ratios' spread (``compare``; 99% because the comparison is repeated after
every batch). From the second batch on, a finalist slower beyond the noise
(and beyond ``NOISE_FLOOR``) is resolved and stops running; the rest go on
until one is left, ``budget_s`` is spent (after the second batch) or
``max_rounds`` are run.

The winner comes from these times alone, never from a candidate's earlier
timing:

- the plain program wins unless a schedule is faster than it beyond the
  noise and by more than ``PLAIN_MARGIN``;
- otherwise the finalists the leader did not resolve are tied with it
  (within the noise); of those that beat the plain program, the first in the
  caller's ``order`` (a fixed preference, so that two tunes of one operator
  pick the same of two tied programs) wins, and ``Decision.tied`` names the
  others.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np

from jaxmercury.tuner import measure
from jaxmercury.tuner.candidates import Final

FINAL_MARGIN = 0.05  # candidates this close to the best time of their own are finalists
FINAL_SIZE = 4  # at most this many, the best plain program besides
NOISE_FLOOR = 0.01  # differences below 1% are never resolved
PLAIN_MARGIN = 0.02  # a schedule replaces the plain program only when more than 2% faster
# A median's 99% half-width: WIDTH * IQR / sqrt(n) (its standard error is 0.93 IQR / sqrt(n) for normal noise).
WIDTH = 2.4
FIRST_LOOK = 2  # batches before any finalist is resolved


@dataclasses.dataclass(frozen=True)
class Comparison:
  """One finalist against another on the rounds both ran.

  Attributes:
    ratio: the median over those rounds of (its time / the other's time).
    noise: the half-width of that median's 99% interval, as a ratio (0.03: 3%).
    rounds: the rounds compared.
  """

  ratio: float
  noise: float
  rounds: int

  def slower(self, floor: float = NOISE_FLOOR) -> bool:
    """Whether it is slower beyond the noise and by more than ``floor``."""
    return math.log(self.ratio) > max(math.log1p(self.noise), math.log1p(floor))

  def __str__(self) -> str:
    return f"{self.ratio:.3f}x (noise {self.noise:.1%}, {self.rounds} rounds)"


def compare(times_ms: Sequence[float], other_ms: Sequence[float]) -> Comparison:
  """``times_ms`` against ``other_ms``, paired by round (the first rounds of the longer list count)."""
  n = min(len(times_ms), len(other_ms))
  logs = sorted(math.log(a / b) for a, b in zip(times_ms[:n], other_ms[:n]))
  if n == 0:
    return Comparison(1.0, math.inf, 0)
  if n < 4:
    return Comparison(math.exp(statistics.median(logs)), math.inf, n)
  q1, _, q3 = statistics.quantiles(logs, n=4)
  return Comparison(math.exp(statistics.median(logs)), math.expm1(WIDTH * (q3 - q1) / math.sqrt(n)), n)


@dataclasses.dataclass(frozen=True)
class Decision:
  """What the final round found.

  Attributes:
    winner: the finalist chosen.
    leader: the finalist of the lowest median in the round.
    times_ms: per finalist, its side-by-side times (a finalist that failed in the round has none).
    versus_leader: per finalist, its ``Comparison`` with the leader.
    tied: the finalists within the noise of the winner's round (not resolved slower than the leader), the winner
      excepted.
    baseline: the best plain finalist, or None.
    versus_baseline: the winner against ``baseline`` (None: no plain finalist, or the winner is it).
    rounds: the rounds run.
    seconds: how long they took.
    resolved: whether every other finalist was resolved (no ties, no budget cut).
    failed: per finalist that raised in the round, the error.
  """

  winner: str
  leader: str
  times_ms: dict
  versus_leader: dict
  tied: tuple
  baseline: str | None
  versus_baseline: Comparison | None
  rounds: int
  seconds: float
  resolved: bool
  failed: dict

  def median_ms(self, name: str) -> float | None:
    times = self.times_ms.get(name)
    return statistics.median(times) if times else None

  def summary(self) -> str:
    """One line: who won and why."""
    line = f"{self.winner} wins the final round ({self.rounds} interleaved rounds, {self.seconds:.1f} s)"
    if self.baseline is not None and self.winner == self.baseline:
      beaten = [n for n in self.times_ms if n != self.winner and n not in self.failed]
      line += "; no schedule faster than it beyond the noise" if beaten else ""
    elif self.versus_baseline is not None:
      line += f"; {self.baseline} is {self.versus_baseline} its time"
    if self.tied:
      line += "; tied within noise with " + ", ".join(self.tied)
    return line


def final_round(calls: dict[str, Callable], *, plain: Sequence[str] = (), order: Sequence[str] = (),
                batch: int = 10, max_rounds: int = 50, budget_s: float = 3.0,
                clock: Callable[[], float] = time.perf_counter, gather: Callable | None = None) -> Decision | None:
  """Times ``calls`` side by side until the winner is resolved (module docstring).

  Under several processes (``gather``) the processes run the rounds in lockstep, each the same calls in the same
  order; after each batch every run's time is combined (the slowest process's counts, a run that failed on any
  process fails the finalist) and so is the elapsed time, so that every process takes the same decisions from the
  same times.

  Args:
    calls: finalist name -> a call of no arguments (compiled, inputs placed, run once).
    plain: the names of plain programs among them.
    order: the preference among tied finalists, most preferred first; names not in it come after, by name.
    batch: rounds between comparisons (at least 4).
    max_rounds: rounds at most.
    budget_s: seconds after which no new batch starts (the first ``FIRST_LOOK`` batches run whatever it is).
    clock: the clock the budget is read from.
    gather: ``agree.gather`` under several processes (stacks each process's array); None: this process alone.

  Returns:
    The ``Decision``, or None when every finalist failed.
  """
  batch = max(batch, 4)
  start = clock()
  times = {name: [] for name in calls}
  failed = {}
  live = dict(calls)
  rounds = 0
  resolved = set()

  def on_error(name, exc):
    failed[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"

  while True:
    got = measure.rounds(live, batch, on_error=on_error)
    elapsed = clock() - start
    if gather is not None:
      got, elapsed = _slowest(got, list(live), batch, elapsed, gather, failed)
    for name in list(live):
      if name in got:
        times[name].extend(got[name])
      else:
        del live[name]
    rounds += batch
    if not live:
      return None
    leader = _leader(live, times)
    for name in list(live) if rounds >= FIRST_LOOK * batch else ():
      floor = PLAIN_MARGIN if name in plain and leader not in plain else NOISE_FLOOR
      if name != leader and compare(times[name], times[leader]).slower(floor):
        resolved.add(name)
        del live[name]
    looked = rounds >= FIRST_LOOK * batch
    if len(live) == 1 or rounds >= max_rounds or (looked and elapsed >= budget_s):
      break
  ran = {n: t for n, t in times.items() if n not in failed}
  leader = _leader(ran, times)
  versus = {n: compare(t, times[leader]) for n, t in ran.items()}
  within = [n for n in ran if n not in resolved]
  baseline = min((n for n in ran if n in plain), key=lambda n: statistics.median(times[n]), default=None)
  if baseline is not None and baseline in within:
    winner = baseline
  else:
    beats = [n for n in within if baseline is None or compare(times[baseline], times[n]).slower(PLAIN_MARGIN)]
    rank = {n: k for k, n in enumerate(order)}
    winner = min(beats or [leader], key=lambda n: (rank.get(n, len(rank)), n))
  return Decision(winner, leader, ran, versus, tuple(n for n in within if n != winner), baseline,
                  None if baseline in (None, winner) else compare(times[baseline], times[winner]), rounds,
                  elapsed, len(within) == 1, failed)


def _slowest(got: dict, names: list, batch: int, elapsed: float, gather: Callable, failed: dict):
  """``(times, elapsed)`` of one batch combined across processes: per name its runs, each as long as its slowest
  process took (a name that failed on any process is left out, and named in ``failed``), and the longest
  elapsed time."""
  rows = np.full((len(names) + 1, batch), np.nan)
  for k, name in enumerate(names):
    if name in got:
      rows[k, :len(got[name])] = got[name]
  rows[-1, 0] = elapsed
  every = gather(rows)
  out = {}
  for k, name in enumerate(names):
    runs = every[:, k, :]
    if np.isnan(runs).any():
      failed.setdefault(name, f"failed on process {int(np.isnan(runs).any(axis=1).argmax())}")
    else:
      out[name] = [float(t) for t in runs.max(axis=0)]
  return out, float(np.max(every[:, -1, 0]))


def _leader(names, times) -> str:
  return min(names, key=lambda n: (statistics.median(times[n]), n))


def finalists(candidates: Sequence, *, margin: float | None = None, size: int | None = None) -> list:
  """The candidates of a tune's final round, from their own timings: the best plain one, and those whose median
  is within ``margin`` of the best median, or within the spread of their own runs (the interval of their
  medians, ``WIDTH`` wide, overlaps the best's), ``size`` at most, best first.

  Args:
    candidates: timed candidates (``time_ms``, ``result.times_ms``, ``plain``).
    margin: default ``FINAL_MARGIN``.
    size: default ``FINAL_SIZE``.
  """
  margin = FINAL_MARGIN if margin is None else margin
  size = FINAL_SIZE if size is None else size
  ok = sorted(candidates, key=lambda c: c.time_ms)
  if not ok:
    return []
  low = ok[0].time_ms * (1 + max(margin, _spread(ok[0])))
  close = [c for c in ok if not c.plain and c.time_ms * (1 - _spread(c)) <= low][:size]
  plain = next((c for c in ok if c.plain), None)
  return sorted(close + ([plain] if plain is not None else []), key=lambda c: c.time_ms)


def _spread(candidate) -> float:
  """The half-width of the candidate's median's 95% interval, relative to its median (from its own runs)."""
  times = candidate.result.times_ms if candidate.result else []
  if len(times) < 4 or not candidate.time_ms:
    return 0.0
  q1, _, q3 = statistics.quantiles(times, n=4)
  return WIDTH * (q3 - q1) / math.sqrt(len(times)) / candidate.time_ms


def decide_stage(ok: list, ready, *, iters: int, budget_s: float, log, gather=None):
  """The winner among the timed candidates ``ok``: the final round of ``finalists(ok)``.

  Each finalist's round goes to its ``final`` (its own measurement, as stored, is left as it was). Under several
  processes (``gather``) every process runs the round in lockstep and reaches the same decision
  (``final_round``).

  Args:
    ok: the candidates that passed and were timed (their ``result`` the same on every process).
    ready: ``ready(candidate) -> call`` of no arguments running it (compiled, inputs placed); raises where it
      does not run again.
    iters: rounds per batch at most.
    budget_s: the round's time budget.
    log: progress printer.
    gather: ``agree.gather`` under several processes.

  Returns:
    ``(winner, decision text, candidates tied with it)``. With one finalist, or when no finalist runs in the
    round, the winner is chosen on the candidates' own times (``own_times_winner``).
  """
  chosen = finalists(ok)
  if len(chosen) < 2:
    return (*own_times_winner(ok), [])
  names = _distinct_names(chosen)
  calls = {}
  for name, c in zip(names, chosen):
    try:
      calls[name] = ready(c)
    except Exception as e:
      log(f"  final round: {c.name} does not run again ({type(e).__name__}: {str(e)[:200]}); left out")
  by_name = dict(zip(names, chosen))
  order = sorted(calls, key=lambda n: (by_name[n].predicted_ms if not math.isnan(by_name[n].predicted_ms)
                                       else math.inf, n))
  # rounds per batch: ``iters``, fewer (4 at least) where two batches of the finalists' own times exceed the budget
  round_s = sum(by_name[n].time_ms for n in calls) * 1e-3
  batch = max(4, min(iters, int(budget_s / (FIRST_LOOK * round_s)) if round_s > 0 else iters))
  verdict = final_round(calls, plain=[n for n in calls if by_name[n].plain], order=order, batch=batch,
                        max_rounds=3 * batch, budget_s=budget_s, gather=gather) if len(calls) > 1 else None
  if verdict is None:
    return (*own_times_winner(ok), [])
  for name in calls:
    c = by_name[name]
    if name in verdict.failed:
      note = f"failed in the final round ({verdict.failed[name]})"
    elif name == verdict.winner:
      note = verdict.summary()
    else:
      note = f"{verdict.versus_leader[name]} the leader's time in the final round"
      note += "; tied within noise with the winner" if name in verdict.tied else ""
    c.final = Final(verdict.median_ms(name), tuple(verdict.times_ms.get(name, [])), note)
  log("  final round (interleaved): " + ", ".join(
      f"{n} {verdict.median_ms(n):.3f} ms" for n in calls if n not in verdict.failed))
  return by_name[verdict.winner], verdict.summary(), [by_name[n] for n in verdict.tied]


def own_times_winner(ok) -> tuple:
  """``(winner, decision text)`` on the candidates' own times, where no final round ran (one finalist, or none
  ran again): the fastest, unless it is a schedule less than ``PLAIN_MARGIN`` faster than the best plain
  program, which then wins."""
  best = min(ok, key=lambda c: c.time_ms)
  plain = min((c for c in ok if c.plain), key=lambda c: c.time_ms, default=None)
  if plain is not None and best is not plain and best.time_ms * (1 + PLAIN_MARGIN) > plain.time_ms:
    return plain, (f"{plain.name} wins on the candidates' own times: {best.name} is not "
                   f"{PLAIN_MARGIN:.0%} faster")
  alone = len(finalists(ok)) < 2
  why = "no other came close enough for a final round" if alone else "no finalist ran again in the final round"
  if best.plain and alone:
    why = "no schedule came close enough to it for a final round"
  return best, f"{best.name} wins on the candidates' own times: {why}"


def _distinct_names(cands) -> list[str]:
  """The candidates' names, a number added where two share one."""
  out, seen = [], {}
  for c in cands:
    seen[c.name] = seen.get(c.name, 0) + 1
    out.append(c.name if seen[c.name] == 1 else f"{c.name} #{seen[c.name]}")
  return out
