"""A tuning candidate as data: its strategy, kernel and configuration, fused kernel and configuration, trace.

The kernel, lowering and their configurations are the schedule's own
(``Schedule.kernel``, ``kernel_config``, ``lowering``, ``lowering_config``);
the trace is the schedule's. ``name`` renders them for display, as
``"ring [mosaic_attention(block_q=128)]"`` or ``"async_tp {fused_allgather_matmul}"``;
nothing reads a candidate back from its name. ``to_dict`` / ``from_dict``
give the structured form the tuning database stores. A plain candidate
(origin ``"plain"``) holds a ``tuner.plain.PlainProgram`` where the others
hold a schedule: the program a user would otherwise run, named as
``"plain jnp.dot (XLA)"``, stored as its description.

``program_key`` says which candidates lower to the same program (the tuner
times one of them).
"""

from __future__ import annotations

import dataclasses
import json
import math

from jaxmercury.analysis import placements
from jaxmercury.analysis.memory import block_sizes
from jaxmercury.ir.loops import VECTOR
from jaxmercury.kernels import config as configs
from jaxmercury.kernels import registry
from jaxmercury.schedules.schedule import Schedule
from jaxmercury.tuner import measure
from jaxmercury.tuner.plain import PlainProgram, runnable_from_json

LIBRARY, SPACE, NEAREST, GIVEN, PLAIN = "library", "space", "nearest", "given", "plain"
ORIGINS = (LIBRARY, SPACE, NEAREST, GIVEN, PLAIN)


@dataclasses.dataclass(frozen=True)
class Final:
  """A finalist's side-by-side times in a tune's final round (``tuner.decide``), kept apart from its own
  measurement: a winner is chosen on the times of one round.

  Attributes:
    median_ms: the median of its runs in the round; None for a winner decided without a final round (its own
      times alone: no other came close), which keeps the verdict in ``note``.
    times_ms: its runs, one per round it ran in.
    note: what the round found about it (its time against the leader's, tied, the winner's verdict).
  """

  median_ms: float | None
  times_ms: tuple = ()
  note: str = ""

  def to_dict(self) -> dict:
    return {"median_ms": self.median_ms, "times_ms": list(self.times_ms), "note": self.note}

  @classmethod
  def from_dict(cls, data) -> "Final | None":
    if data is None:
      return None
    if not isinstance(data, dict) or not isinstance(data.get("note", ""), str) or not all(
        isinstance(t, (int, float)) for t in data.get("times_ms", [])) or not isinstance(
            data.get("median_ms"), (int, float, type(None))):
      raise ValueError(f"not a final-round record: {data!r}")
    return cls(data.get("median_ms"), tuple(data.get("times_ms", [])), data.get("note", ""))


@dataclasses.dataclass
class Candidate:
  """One schedule the tuner considered, and what became of it.

  Attributes:
    strategy: the library strategy's name, a design-space schedule's description (``describe``), or a
      caller's name for a schedule it gave.
    schedule: the schedule (its kernel, fused kernel, their configurations and its trace); for a plain
      candidate, its ``PlainProgram``.
    predicted_ms: the cost model's time (training: forward and backward); NaN for a plain program (``to_dict``:
      None).
    memory_bytes: the static per-device memory estimate.
    result: the measurement, or None while it is not measured.
    origin: ``"library"``, ``"space"`` (the design space), ``"nearest"`` (the winner tuned for the nearest other
      sizes), ``"given"`` (the caller's) or ``"plain"`` (the program a user would otherwise run).
    tuned_at: for ``"nearest"``: the sizes it was tuned at.
    recorded_trace: the trace another process recorded for a candidate this process cannot rebuild (it
      failed to validate there); None: the schedule's.
    final: its side-by-side times in the final round (``Final``); None: it was not a finalist (a winner decided
      on the candidates' own times carries the verdict alone).
  """

  strategy: str
  schedule: Schedule | PlainProgram
  predicted_ms: float
  memory_bytes: int
  result: measure.Measurement | None = None
  origin: str = LIBRARY
  tuned_at: dict | None = None
  recorded_trace: str | None = None
  final: Final | None = None

  @property
  def kernel(self) -> str | None:
    return self.schedule.kernel

  @property
  def kernel_config(self):
    return self.schedule.kernel_config

  @property
  def lowering(self) -> str | None:
    return self.schedule.lowering

  @property
  def lowering_config(self):
    return self.schedule.lowering_config

  @property
  def name(self) -> str:
    """For display: the strategy, ``[kernel(config)]``, ``{fused kernel(config)}``, ``(tuned at ...)``; a caller's
    candidate (``"given"``) is shown by the caller's name, a plain one by its program (``"plain jnp.dot (XLA)"``)."""
    if self.origin in (GIVEN, PLAIN):
      return self.strategy
    out = self.strategy
    if self.kernel not in (None, "xla"):
      out += f" [{configs.label(self.kernel, self.kernel_config)}]"
    if self.lowering is not None:
      out += f" {{{configs.label(self.lowering, self.lowering_config)}}}"
    dispatched = getattr(self.schedule, "dispatched", None)  # a plain program has none
    if dispatched is not None and dispatched["gemm"] != "ragged_dot":
      out += f" [grouped GEMM {dispatched['gemm']}]"
    if self.tuned_at:
      out += " (tuned at " + ", ".join(f"{k}={v}" for k, v in self.tuned_at.items()) + ")"
    return out

  @property
  def status(self) -> str:
    return self.result.status if self.result else measure.PRUNED

  @property
  def plain(self) -> bool:
    """Whether it is a plain program (what a user would run without jaxmercury)."""
    return self.origin == PLAIN

  @property
  def time_ms(self) -> float | None:
    """The median of its own timed runs."""
    return self.result.median_ms if self.result else None

  @property
  def final_ms(self) -> float | None:
    """The median of its side-by-side runs in the tune's final round; None: it was not a finalist."""
    return self.final.median_ms if self.final else None

  def to_dict(self) -> dict:
    """The structured form: what it is (strategy, kernel, lowering, configurations, trace) and its outcome."""
    r = self.result
    return {"name": self.name, "strategy": self.strategy, "origin": self.origin, "plain": self.plain,
            "tuned_at": self.tuned_at,
            "kernel": self.kernel, "kernel_config": configs.changed(self.kernel_config),
            "lowering": self.lowering, "lowering_config": configs.changed(self.lowering_config),
            "schedule": self.recorded_trace or self.schedule.to_json(),
            "predicted_ms": None if math.isnan(self.predicted_ms) else self.predicted_ms,
            "time_ms": self.time_ms, "final_ms": self.final_ms,
            "final": None if self.final is None else self.final.to_dict(),
            "memory_bytes": self.memory_bytes, "status": self.status, "reason": r.reason if r else "",
            "rel_err": r.rel_err if r else None, "compiled_bytes": r.compiled_bytes if r else None}

  @classmethod
  def from_dict(cls, program, mesh, data: dict) -> "Candidate":
    """A candidate from ``to_dict`` output: its trace replayed through the primitives (a plain candidate: its
    description read back), checked against the recorded kernel and lowering (a disagreement raises
    ``ValueError``)."""
    schedule = runnable_from_json(program, mesh, data["schedule"])
    if isinstance(schedule, PlainProgram) != (data.get("origin") == PLAIN):
      raise ValueError(f"candidate {data.get('strategy')!r}: its origin {data.get('origin')!r} does not fit "
                       f"its {'plain program' if isinstance(schedule, PlainProgram) else 'schedule'}")
    for field in ("kernel", "lowering"):
      if getattr(schedule, field) != data.get(field):
        raise ValueError(f"candidate {data.get('strategy')!r}: its trace gives {field} {getattr(schedule, field)!r}, "
                         f"the record says {data.get(field)!r}")
    result = measure.Measurement.from_dict({"status": data["status"], "median_ms": data["time_ms"],
                                            "rel_err": data.get("rel_err"), "reason": data.get("reason", ""),
                                            "compiled_bytes": data.get("compiled_bytes")})
    if not isinstance(data["strategy"], str) or data.get("origin", LIBRARY) not in ORIGINS:
      raise ValueError(f"candidate fields of the wrong type: {json.dumps(data)[:200]}")
    predicted = math.nan if data["predicted_ms"] is None else float(data["predicted_ms"])
    return cls(data["strategy"], schedule, predicted, int(data["memory_bytes"]), result,
               data.get("origin", LIBRARY), data.get("tuned_at"), final=Final.from_dict(data.get("final")))


def kernel_choices(program, mesh, *, variants: bool = False) -> list[registry.KernelChoice]:
  """The local kernels a tune tries on ``mesh``: each that applies at its defaults, or (``variants``) every
  configuration of each."""
  if variants:
    return registry.variants(program, mesh)
  return [registry.KernelChoice(name) for name in registry.candidates(program, mesh)]


def _level_of(schedule, name):
  lp = schedule.loop_or_none(name) if name else None
  return None if lp is None else (lp.axis, lp.level)


def program_key(schedule) -> tuple:
  """What the lowered program of a schedule depends on: equal keys lower to the same program.

  The key holds the kernel and fused kernel with their configurations, the
  storage order (zigzag) and padding, the serial and parallel loops in
  order by axis, extent, mesh level and the loop each follows around a
  ring, the block each body call sees, and the plan's layouts, rings and
  cross-level reductions; never a loop's name. Mesh levels of size 1 and
  loops of extent 1 do nothing and are left out: on a mesh of one device
  every communication schedule is the local loop nest, and a fused kernel
  whose ring is empty is the kernel whose program it equals there
  (``FusedKernel.one_device``). A plain program's key is its description.
  """
  if isinstance(schedule, PlainProgram):
    return ("plain", schedule.to_json())
  sizes = schedule.levels
  idle = [lv for lv, n in sizes.items() if n == 1]
  plan = schedule.plan()
  layouts = lambda table: tuple(sorted((b, lay.without(idle)) for b, lay in table.items()))
  loops = tuple((lp.axis, lp.extent, lp.role, lp.level if lp.level not in idle else None,
                 _level_of(schedule, lp.shifted_by) if lp.shifted_by and sizes.get(
                     schedule.loop(lp.shifted_by).level, 1) > 1 else None)
                for lp in schedule.loops if lp.role != VECTOR and lp.extent > 1)
  blocks = tuple(sorted(block_sizes(schedule).items()))
  rings = tuple(sorted((r.axis, r.level, r.size, r.buffers, r.travel) for r in plan.rings.values() if r.size > 1))
  reductions = tuple((r.level, r.scatter_axis) for r in plan.reductions if sizes.get(r.level, 1) > 1)
  padded = tuple(sorted((a, n) for a, n in schedule.padded.items() if n != schedule.program.axes[a].extent))
  lowering = None if schedule.lowering is None else configs.label(*placements.runs_as(schedule))
  return (configs.label(schedule.kernel or "xla", schedule.kernel_config), lowering,
          tuple(sorted(schedule.zigzags.items())), padded, loops, blocks, layouts(plan.storage),
          layouts(plan.resident), plan.result.without(idle), rings, reductions)
