"""The design-space scatter of a tuning run: latency against memory (Mercury, Fig. 13).

Each candidate of a ``TuneResult`` is one point: x is its estimated memory per
device, y its measured latency (candidates checked and timed) or, in a lighter
marker, the cost model's prediction (candidates pruned before compiling, and
failed ones). The Pareto front of the timed candidates (the lowest latency for
at most that much memory) is drawn as a step line; the winner is highlighted
and the library's strategies are labeled by name. The plain programs (what a
user would run without jaxmercury, ``tuner.plain``) are diamonds, labeled by
name.

matplotlib is an optional dependency: only ``latency_memory_plot`` needs it,
and it draws with the non-interactive Agg backend without touching pyplot's
global state.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence

from jaxmercury.tuner import measure
from jaxmercury.tuner.candidates import LIBRARY, PLAIN

MIB = 2**20


def pareto_front(points: Sequence[Sequence[float]]) -> list:
  """The points no other point beats on both coordinates, lower being better.

  A point ``(x, y, ...)`` is on the front when every other point with
  ``x' <= x`` has ``y' > y``: it has the lowest y for at most its x. Of equal
  points only the first is kept. Items after the first two (labels, objects)
  are carried along. Points with a non-finite or missing coordinate are
  ignored.

  Args:
    points: a sequence of ``(x, y, ...)`` tuples.

  Returns:
    The front's points, by increasing x (and so decreasing y).
  """
  finite = [p for p in points if _finite(p[0]) and _finite(p[1])]
  front, best_y = [], math.inf
  for p in sorted(finite, key=lambda p: (p[0], p[1])):
    if p[1] < best_y:
      front.append(p)
      best_y = p[1]
  return front


def _finite(v) -> bool:
  return v is not None and math.isfinite(v)


def _points(candidates, status: str, timed: bool) -> list[tuple[float, float, object]]:
  """(MiB, ms, candidate) for the candidates of one status, at measured or predicted ms."""
  out = []
  for c in candidates:
    if c.status != status:
      continue
    y = c.time_ms if timed else c.predicted_ms
    if _finite(y):
      out.append((c.memory_bytes / MIB, y, c))
  return out


def _default_title(result) -> str:
  s = result.candidates[0].schedule
  shape = "x".join(str(n) for n in s.levels.values())
  origin = " (from the database)" if result.from_database else ""
  return f"{s.program.name}: {len(result.candidates)} candidates on mesh {shape}{origin}"


def _scatter(ax, result):
  """The candidates as points: timed ones solid, pruned and failed ones lighter."""
  ok = _points(result.candidates, measure.OK, timed=True)
  pruned = _points(result.candidates, measure.PRUNED, timed=False)
  failed = _points(result.candidates, measure.FAILED, timed=False)
  if pruned:
    ax.scatter([p[0] for p in pruned], [p[1] for p in pruned], s=22, facecolors="none",
               edgecolors="tab:blue", alpha=0.4, label="pruned (predicted ms)")
  if failed:
    ax.scatter([p[0] for p in failed], [p[1] for p in failed], s=22, marker="x", color="tab:red",
               alpha=0.5, label="failed (predicted ms)")
  schedules = [p for p in ok if not p[2].plain]
  plain = [p for p in ok if p[2].plain]
  if schedules:
    ax.scatter([p[0] for p in schedules], [p[1] for p in schedules], s=30, color="tab:blue", label="measured")
  if plain:
    ax.scatter([p[0] for p in plain], [p[1] for p in plain], s=60, marker="D", color="tab:purple", zorder=4,
               label="plain program (measured)")
  return ok, pruned + failed


def _front_line(ax, ok, right_edge: float):
  """The Pareto front of the timed points as a step line out to ``right_edge``."""
  front = pareto_front(ok)
  if not front:
    return
  xs = [p[0] for p in front] + [max(right_edge, front[-1][0])]
  ys = [p[1] for p in front] + [front[-1][1]]
  ax.step(xs, ys, where="post", color="tab:green", linewidth=1.5, label="Pareto front")


def _labels(ax, points):
  """Names next to the library strategies' and the plain programs' points."""
  for x, y, c in points:
    if c.origin in (LIBRARY, PLAIN):
      ax.annotate(c.name, (x, y), xytext=(4, 4), textcoords="offset points", fontsize=7)


def _winner(ax, best):
  """The winner as a large star marked "winner" (its full name goes in the title)."""
  if best is None or not _finite(best.time_ms):
    return
  x = best.memory_bytes / MIB
  ax.scatter([x], [best.time_ms], s=180, marker="*", color="tab:orange", edgecolors="black",
             zorder=5, label="winner")
  ax.annotate("winner", (x, best.time_ms), xytext=(6, -14), textcoords="offset points", fontsize=8,
              fontweight="bold")


def _winner_line(best) -> str:
  """The title's second line: the winner's name and time, shortened to fit."""
  if best is None or not _finite(best.time_ms):
    return "no candidate passed"
  return textwrap.shorten(f"winner: {best.name} ({best.time_ms:.3f} ms)", width=110, placeholder=" ...")


def _log_scale_if_wide(ax, ys):
  """A logarithmic latency axis, with plain 1-2-5 tick labels, when latencies span over 20x."""
  from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # optional: only for plots
  ys = [y for y in ys if y > 0]
  if ys and max(ys) / min(ys) > 20:
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def latency_memory_plot(result, path, title: str | None = None):
  """Draws a tuning run's latency-memory scatter and writes it to ``path``.

  Args:
    result: a ``TuneResult`` (from ``autotune``, or read from the database).
    path: the image file to write; its suffix picks the format (``.png``,
      ``.svg``, ``.pdf``).
    title: the plot's title; default the program, candidate count and mesh.

  Returns:
    ``path``.

  Raises:
    RuntimeError: matplotlib is not installed.
    ValueError: the result has no candidates.
  """
  try:
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # optional: only for plots
    from matplotlib.figure import Figure  # optional: only for plots
  except ImportError:
    raise RuntimeError("latency_memory_plot needs matplotlib: pip install matplotlib") from None
  if not result.candidates:
    raise ValueError("latency_memory_plot: the tuning result has no candidates")
  fig = Figure(figsize=(7.5, 5.0))
  FigureCanvasAgg(fig)
  ax = fig.add_subplot()
  ok, others = _scatter(ax, result)
  everything = ok + others
  xs = [p[0] for p in everything] or [0.0]
  _front_line(ax, ok, right_edge=max(xs))
  _labels(ax, everything)
  _winner(ax, result.best)
  _log_scale_if_wide(ax, [p[1] for p in everything])
  ax.margins(0.06, 0.12)  # room for the labels at the edges
  ax.set_xlabel("memory per device (MiB, estimated)")
  ax.set_ylabel("latency (ms)")
  heading = title if title is not None else _default_title(result)
  ax.set_title(f"{heading}\n{_winner_line(result.best)}", fontsize=9)
  ax.grid(True, alpha=0.3)
  ax.legend(fontsize=8, loc="best")
  fig.tight_layout()
  fig.savefig(path, dpi=150)
  return path
