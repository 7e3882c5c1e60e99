"""A tuning candidate as data: its strategy, kernel and configuration, fused kernel and configuration, trace.

The kernel, lowering and their configurations are the schedule's own
(``Schedule.kernel``, ``kernel_config``, ``lowering``, ``lowering_config``);
the trace is the schedule's. ``name`` renders them for display, as
``"ring [mosaic_attention(block_q=128)]"`` or ``"async_tp {fused_allgather_matmul}"``;
nothing reads a candidate back from its name. ``to_dict`` / ``from_dict``
give the structured form the tuning database stores.
"""

from __future__ import annotations

import dataclasses
import json

from jaxmercury.kernels import config as configs
from jaxmercury.kernels import registry
from jaxmercury.schedules.schedule import Schedule
from jaxmercury.tuner import measure

LIBRARY, SPACE, NEAREST, GIVEN = "library", "space", "nearest", "given"
ORIGINS = (LIBRARY, SPACE, NEAREST, GIVEN)


@dataclasses.dataclass
class Candidate:
  """One schedule the tuner considered, and what became of it.

  Attributes:
    strategy: the library strategy's name, a design-space schedule's description (``describe``), or a
      caller's name for a schedule it gave.
    schedule: the schedule (its kernel, fused kernel, their configurations and its trace).
    predicted_ms: the cost model's time (training: forward and backward).
    memory_bytes: the static per-device memory estimate.
    result: the measurement, or None while it is not measured.
    origin: ``"library"``, ``"space"`` (the design space), ``"nearest"`` (the winner tuned for the nearest other
      sizes) or ``"given"`` (the caller's).
    tuned_at: for ``"nearest"``: the sizes it was tuned at.
    recorded_trace: the trace another process recorded for a candidate this process cannot rebuild (it
      failed to validate there); None: the schedule's.
  """

  strategy: str
  schedule: Schedule
  predicted_ms: float
  memory_bytes: int
  result: measure.Measurement | None = None
  origin: str = LIBRARY
  tuned_at: dict | None = None
  recorded_trace: str | None = None

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
    candidate (``"given"``) is shown by the caller's name."""
    if self.origin == GIVEN:
      return self.strategy
    out = self.strategy
    if self.kernel not in (None, "xla"):
      out += f" [{configs.label(self.kernel, self.kernel_config)}]"
    if self.lowering is not None:
      out += f" {{{configs.label(self.lowering, self.lowering_config)}}}"
    if self.schedule.dispatched is not None and self.schedule.dispatched["gemm"] != "ragged_dot":
      out += f" [grouped GEMM {self.schedule.dispatched['gemm']}]"
    if self.tuned_at:
      out += " (tuned at " + ", ".join(f"{k}={v}" for k, v in self.tuned_at.items()) + ")"
    return out

  @property
  def status(self) -> str:
    return self.result.status if self.result else measure.PRUNED

  @property
  def time_ms(self) -> float | None:
    return self.result.median_ms if self.result else None

  def to_dict(self) -> dict:
    """The structured form: what it is (strategy, kernel, lowering, configurations, trace) and its outcome."""
    r = self.result
    return {"name": self.name, "strategy": self.strategy, "origin": self.origin, "tuned_at": self.tuned_at,
            "kernel": self.kernel, "kernel_config": configs.changed(self.kernel_config),
            "lowering": self.lowering, "lowering_config": configs.changed(self.lowering_config),
            "schedule": self.recorded_trace or self.schedule.to_json(), "predicted_ms": self.predicted_ms,
            "time_ms": self.time_ms,
            "memory_bytes": self.memory_bytes, "status": self.status, "reason": r.reason if r else "",
            "rel_err": r.rel_err if r else None, "compiled_bytes": r.compiled_bytes if r else None}

  @classmethod
  def from_dict(cls, program, mesh, data: dict) -> "Candidate":
    """A candidate from ``to_dict`` output: its trace replayed through the primitives, checked against the
    recorded kernel and lowering (a disagreement raises ``ValueError``)."""
    schedule = Schedule.from_json(program, mesh, data["schedule"])
    for field in ("kernel", "lowering"):
      if getattr(schedule, field) != data.get(field):
        raise ValueError(f"candidate {data.get('strategy')!r}: its trace gives {field} {getattr(schedule, field)!r}, "
                         f"the record says {data.get(field)!r}")
    result = measure.Measurement.from_dict({"status": data["status"], "median_ms": data["time_ms"],
                                            "rel_err": data.get("rel_err"), "reason": data.get("reason", ""),
                                            "compiled_bytes": data.get("compiled_bytes")})
    if not isinstance(data["strategy"], str) or data.get("origin", LIBRARY) not in ORIGINS:
      raise ValueError(f"candidate fields of the wrong type: {json.dumps(data)[:200]}")
    return cls(data["strategy"], schedule, float(data["predicted_ms"]), int(data["memory_bytes"]), result,
               data.get("origin", LIBRARY), data.get("tuned_at"))


def kernel_choices(program, mesh, *, variants: bool = False) -> list[registry.KernelChoice]:
  """The local kernels a tune tries on ``mesh``: each that applies at its defaults, or (``variants``) every
  configuration of each."""
  if variants:
    return registry.variants(program, mesh)
  return [registry.KernelChoice(name) for name in registry.candidates(program, mesh)]
