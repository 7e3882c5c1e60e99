"""NodeOption placements of graph nodes: library schedules for operators, layouts for glue.

An operator's candidate is a library strategy with its inputs fixed to the
layouts its loop nest works on (so that moving data into them is the edge's
job, where it can be fused with the producer's), and its output left as the
nest produces it: a GEMM whose reduction axis is spread over the mesh leaves
partial sums, reduced on the edge by an all-reduce, or a reduce-scatter when
the consumer wants only its part. Its time is the cost model's prediction
(``jaxmercury.tuner.cost.predict``) without that reduction, or a measured
time from the tuning database scaled the same way.

Where a fused lowering (``jaxmercury.lowering.fused``) runs a strategy's
whole nest as one kernel per device on this mesh, the strategy also comes
as a fused candidate, ``"strategy <lowering>"``: the same layouts, its
output placed as the strategy places it (a fused reduce-scatter leaves no
partial sums), priced by ``cost.fused_seconds``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np
from jax.sharding import PartitionSpec

from jaxmercury.analysis import placements
from jaxmercury.analysis.layouts import Layout, enumerate_layouts
from jaxmercury.analysis.memory import local_elements
from jaxmercury.analysis.plan import user_spec
from jaxmercury.errors import ScheduleError
from jaxmercury.ir.loops import PARALLEL
from jaxmercury.ir.reductions import Sum
from jaxmercury.kernels import registry
from jaxmercury.schedules.library import library
from jaxmercury.schedules.schedule import Schedule
from jaxmercury.tuner import cost


@dataclasses.dataclass(frozen=True)
class NodeOption:
  """One way to run a node.

  Attributes:
    name: e.g. the library strategy's name, or the layout for glue.
    inputs: the layout of each input, over the shape the node reads it in.
    output: the layout of the output (may be partial over mesh levels).
    seconds: predicted (or measured) time of the node itself.
    schedule: ``op`` nodes: the jaxmercury ``Schedule`` that runs it, its
      inputs fixed to ``inputs``; partial outputs are all-reduced by it
      unless the plan turns the reduction into a reduce-scatter.
    params: ``op`` nodes: ``PartitionSpec`` per parameter buffer (weights).
    source: where ``seconds`` comes from: ``"predicted"``, ``"database"`` or
      ``"measured"`` (``measure_candidates``).
    grad_sync_seconds: ``op`` nodes, in training: the all-reduce of the
      gradients of parameters the schedule keeps whole on a mesh level that
      splits the computation along another axis (each device holds a partial
      gradient), predicted, less the part that hides under the node's own
      backward (``candidates.grad_sync_seconds``).
    backward_seconds: ``op`` nodes: the predicted time of the schedule's
      backward pass beyond its forward (``cost.backward_seconds``), without
      the gradient all-reduce; None (glue): ``BACKWARD_FACTOR`` prices it.
    train_seconds: ``op`` nodes: the measured time of the node's forward and
      backward (``measure_candidates(..., training=True)``: its ``vjp``, the
      gradient all-reduce included); None: not measured, and training prices
      the node from ``seconds``, ``backward_seconds`` and
      ``grad_sync_seconds``.
  """

  name: str
  inputs: tuple[Layout, ...]
  output: Layout | None
  seconds: float = 0.0
  schedule: object = None
  params: tuple = ()
  source: str = "predicted"
  grad_sync_seconds: float = 0.0
  train_seconds: float | None = None
  backward_seconds: float | None = None


SKIPPED_STRATEGIES = ("ring_zigzag",)  # stores sequences permuted: a whole-array reorder on every edge


def machine_for(machines, pattern: str) -> cost.Machine:
  """The machine figures for a program pattern: ``machines`` is a Machine or a mapping by pattern ("*": default)."""
  if isinstance(machines, cost.Machine):
    return machines
  return machines.get(pattern) or machines["*"]


def user_layout(plan, buffer: str, layout) -> PartitionSpec | None:
  """A canonical layout of ``buffer`` as a spec over the buffer's own dims, or None if it has none."""
  return user_spec(plan.buffers[buffer], layout)


def _without_output_placement(schedule: Schedule) -> Schedule:
  """The schedule with ``shard``/``replicate`` of its output removed: reductions all-reduce."""
  return schedule.without("shard", "replicate", buffer=schedule.program.writes.name)


def reduction_seconds(schedule: Schedule, machine: cost.Machine) -> float:
  """The part of ``cost.predict`` spent in the cross-level reductions of the output.

  Mirrors the reduction term of ``jaxmercury.tuner.cost.predict`` (which has
  no breakdown): keep the two in step.
  """
  plan = schedule.plan()
  state = cost.partial_state_bytes(schedule, plan)
  total = 0.0
  for red in plan.reductions:
    n = schedule.levels[red.level]
    total += machine.gather_factor * 2 * state * (n - 1) / n / machine.bandwidth(red.level) + machine.latency_s
  return total


def _database_seconds(record, native: Schedule, machine, core: float) -> float | None:
  """The measured time of ``native`` (as tuned), scaled by the model's core/native ratio; None if unmeasured."""
  if record is None:
    return None
  want = native.to_json()
  for c in record.candidates:
    if c.schedule.to_json() == want and c.time_ms is not None:
      predicted = cost.predict(native, machine)
      return c.time_ms * 1e-3 * (core / predicted if predicted > 0 else 1.0)
  return None


def op_candidates(program, mesh, machines, *, activations: Sequence[str], strategies: Sequence[str] | None = None,
                  kernels: Sequence[str] | None = None, partial_outputs: bool = True,
                  database=None, fused_lowerings: bool | None = None) -> list[NodeOption]:
  """One candidate per library strategy (and local kernel) of ``program`` on ``mesh``.

  Args:
    program: a jaxmercury program.
    mesh: the device mesh.
    machines: a ``Machine`` or a mapping by program pattern (see ``machine_for``).
    activations: names of the program's read buffers fed by graph edges, in
      the node's input order; the other reads are parameters, stored in the
      layout the strategy wants.
    strategies: library names to consider; default all but ``ring_zigzag``.
    kernels: local kernels; default those the machine has a rate for that
      apply here (``"xla"`` when it has none).
    partial_outputs: leave a sum-reduced output partial (reduced on the edge).
    database: a ``Database``; a measured time of the strategy replaces the prediction.
    fused_lowerings: add the fused candidates (see the module docstring);
      default: where they run natively (Hopper GPUs), not in interpret mode.
  """
  machine = machine_for(machines, program.pattern)
  available = registry.candidates(program, mesh)
  kernels = list(kernels) if kernels is not None else (
      [k for k in sorted(machine.kernel_flops_per_s) if k in available] or ["xla"])
  params = [b.name for b in program.reads if b.name not in activations]
  record = database.lookup_record(program, mesh) if database is not None else None
  found = []
  for name, native in library(program, mesh).items():
    if (strategies is not None and name not in strategies) or (strategies is None and name in SKIPPED_STRATEGIES):
      continue
    for kernel in kernels:
      try:
        found.append(_candidate(name, native, kernel, program, machine, activations, params,
                                partial_outputs and isinstance(program.reduction, Sum), record))
      except ScheduleError:
        continue  # the strategy does not take these layouts
    found.extend(_fused_candidates(name, native, program, machine, activations, params, record, fused_lowerings))
  return _distinct_fused(found)


def _distinct_fused(found: list[NodeOption]) -> list[NodeOption]:
  """Drops a fused candidate equal to an earlier one (two strategies the same kernel runs alike)."""
  seen, kept = set(), []
  for c in found:
    key = (c.schedule.lowering, c.inputs, c.output, c.params) if c.schedule.lowering else None
    if key is None or key not in seen:
      kept.append(c)
      seen.add(key)
  return kept


def _fused_candidates(name, native, program, machine, activations, params, record, wanted) -> list[NodeOption]:
  """The strategy run by each fused lowering that applies to it (``wanted``: see ``op_candidates``)."""
  if wanted is False:
    return []
  found = []
  for lowering in placements.offered(native):
    if wanted is None and placements.interprets(registry.fused(lowering), native):
      continue
    try:
      found.append(_candidate(f"{name} <{lowering}>", native.copy().lower_with(lowering), "xla", program, machine,
                              activations, params, False, record))
    except ScheduleError:
      continue  # the kernel does not take these layouts
  return found


def _candidate(name, native, kernel, program, machine, activations, params, partial_ok, record):
  if kernel != "xla":
    native = native.copy().patch(kernel)
    name = f"{name} [{kernel}]"
  base = _without_output_placement(native) if partial_ok else native
  plan = base.plan()
  specs = {}
  for b in program.reads:
    specs[b.name] = user_layout(plan, b.name, plan.resident[b.name]) or plan.user_spec(b.name)
  out = program.writes
  partial = tuple(red.level for red in plan.reductions) if partial_ok else ()
  out_spec = user_layout(plan, out.name, plan.result) or plan.user_spec(out.name)
  if out_spec is None or any(s is None for s in specs.values()):
    raise ScheduleError(f"{name}: a layout is not expressible over the buffers' own dims")
  realized = base.with_layouts([specs[b.name] for b in program.reads], out_spec)
  seconds = cost.predict(realized, machine)
  if partial:
    seconds -= reduction_seconds(realized, machine)
  source = "predicted"
  measured = _database_seconds(record, native, machine, seconds)
  if measured is not None:
    seconds, source = measured, "database"
  inputs = tuple(Layout.from_spec(specs[a], len(program.buffer(a).shape)) for a in activations)
  output = Layout.from_spec(out_spec, len(out.shape), partial)
  backward = cost.backward_seconds(realized, machine)
  sync = grad_sync_seconds(realized, params, machine)
  return NodeOption(name, inputs, output, seconds, realized, tuple((p, specs[p]) for p in params), source,
                   sync - machine.overlap * min(sync, backward), backward_seconds=backward)


def grad_sync_seconds(schedule: Schedule, params: Sequence[str], machine: cost.Machine) -> float:
  """In training: the all-reduce of each parameter's gradient over every mesh level that parallelizes a loop
  over an axis the parameter lacks while leaving the parameter whole (``data_parallel``'s replicated weights:
  each device's rows give a partial gradient). Predicted seconds, all of it; a candidate counts the part its
  own backward does not hide (XLA runs the all-reduce beside the rest of the backward; the machine's
  ``overlap`` share of the shorter of the two hides)."""
  plan = schedule.plan()
  prog = schedule.program
  total = 0.0
  for name in params:
    buf = prog.buffer(name)
    stored = {lv for levels in plan.storage[name] for lv in levels}
    levels = {lp.level for lp in schedule.loops if lp.role == PARALLEL and lp.axis not in buf.axes} - stored
    nbytes = local_elements(schedule, buf, plan.storage[name]) * buf.dtype.itemsize
    for lv in levels:
      n = schedule.levels[lv]
      if n > 1:
        total += machine.gather_factor * 2 * nbytes * (n - 1) / n / machine.bandwidth(lv) + machine.latency_s
  return total


def glue_candidates(shape: Sequence[int], dtype, n_inputs: int, mesh, machines, *,
                    allowed: Callable[[Layout], bool] | None = None, touches: float = 1.0) -> list[NodeOption]:
  """One candidate per layout of a local (elementwise or per-row) function.

  Every input is read in the output's shape and layout. Time: reading the
  inputs and writing the output of one device's block at the machine's
  memory bandwidth, ``touches`` times.
  """
  machine = machine_for(machines, "*")
  sizes = dict(mesh.shape)
  out = []
  for lay in enumerate_layouts(shape, sizes, allowed=allowed):
    local = math.prod(lay.local_shape(shape, sizes)) * np.dtype(dtype).itemsize
    seconds = touches * (n_inputs + 1) * local / machine.memory_bytes_per_s
    out.append(NodeOption(str(lay), (lay,) * n_inputs, lay, seconds))
  return out


def unsplit(*dims: int) -> Callable[[Layout], bool]:
  """A layout filter: the given dimensions stay whole (for example the features a norm reduces over)."""
  return lambda lay: all(not lay.dims[d] for d in dims)
