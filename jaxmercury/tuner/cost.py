"""An analytic cost model: a schedule's time from machine figures.

Per device: compute time is the work its blocks do over the local kernel's
rate (measured by ``calibrate``, in flops the kernel executes per second).
The kernel says, per block, which share of the block's dense work runs on its
own path and which share falls back to the program's XLA body (``Kernel.work``:
causal blocks it cannot take, padded keys, blocks spanning zigzag chunks);
the fallback runs at the ``xla`` rate. Causal blocks that are wholly masked
are skipped, so devices may do unequal work; the busiest one sets the time
(a contiguous ring gives the device with the last queries the most, a zigzag
order or a split of heads none). Segment ids skip what they hide when
running; the model counts what runs for the program's own sample of them
(``analysis.packed.sample_run``: blocks that keep no pair, ring steps past
the last that does).
Each collective moves bytes over the link bandwidth of its mesh level plus a
fixed latency; ring transfers overlap the compute of the step they precede,
so a ring costs the larger of the two plus the part of the smaller that the
machine does not hide (``overlap``). Gathers, all-to-alls and reductions
before and after the nest do not overlap, nor does putting zigzag-ordered
buffers in and out of their order (chunks sent straight to their devices).
A schedule lowered with a fused kernel (``Schedule.lower_with``) costs the
larger of its local GEMM and its ring transfers, which the kernel overlaps
fully, plus one latency (``fused_seconds``); where calibration ran the fused
GEMM on the mesh (``calibrate.fused_gemm_rates``), its measured rate, ring
included, prices it instead. A schedule's backward pass
(``backward_seconds``) is its transposed collectives and the block products
of the gradients, for training objectives. A dispatched schedule (a mixture of
experts' routed exchange) costs its all-to-alls, its grouped GEMM and its
router (``routed_seconds``).
The computation is static: no tracing.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from jaxmercury.analysis import collectives as cl
from jaxmercury.analysis import dispatch as dispatches
from jaxmercury.analysis import packed, placements
from jaxmercury.analysis.memory import block_sizes, local_elements
from jaxmercury.analysis.plan import body_calls
from jaxmercury.ir.loops import SERIAL
from jaxmercury.kernels import config as configs
from jaxmercury.kernels import fused_common, registry
from jaxmercury.kernels.placements import ALLGATHER
from jaxmercury.kernels.registry import DualGemm
from jaxmercury.kernels.work import Block
from jaxmercury.lowering import storage_order
from jaxmercury.programs.masks import mask_of
from jaxmercury.schedules.dual import backward_schedule, fused_loop_nest


@dataclasses.dataclass(frozen=True)
class Machine:
  """Measured or assumed figures of one machine.

  Attributes:
    name: a label.
    flops_per_s: one device's default compute rate.
    link_bytes_per_s: per mesh level, bytes one device sends per second;
      ``"*"`` is the default for levels not named.
    latency_s: fixed cost of one collective or ring step.
    kernel_flops_per_s: per local kernel name, its measured rate on the
      program's blocks in flops it executes per second (overrides
      ``flops_per_s``); ``"xla"``'s also prices work that a kernel leaves to
      the program's body.
    gather_factor: time of an all-gather or all-to-all relative to moving
      the same bytes point to point.
    call_overhead_s: fixed cost of one body call (one block of a serial loop).
    overlap: the share of a ring transfer that hides under the compute
      beside it (1: all of it).
    memory_bytes_per_s: device memory bandwidth, for combining partial
      results between blocks.
    fused_flops_per_s: per fused lowering measured on its own, in flops
      per second per device: the ring attentions' kernel on one device
      (``calibrate.fused_rates``), the fused GEMMs on the whole mesh, ring
      included (``calibrate.fused_gemm_rates``); a fused lowering not here
      takes its ``rate_kernel``'s rate.
    backward_flops_per_s: per local attention kernel, the rate of its
      backward block (``calibrate.backward_rates``: the joint dq and dk-dv
      block, in ``BACKWARD_WORK`` times the forward's flops per second); a
      kernel not here runs its backward at its forward rate.
  """

  name: str
  flops_per_s: float
  link_bytes_per_s: dict
  latency_s: float = 20e-6
  kernel_flops_per_s: dict = dataclasses.field(default_factory=dict)
  gather_factor: float = 1.0
  call_overhead_s: float = 10e-6
  overlap: float = 1.0
  memory_bytes_per_s: float = 2e12
  fused_flops_per_s: dict = dataclasses.field(default_factory=dict)
  backward_flops_per_s: dict = dataclasses.field(default_factory=dict)

  def bandwidth(self, level: str) -> float:
    return self.link_bytes_per_s.get(level, self.link_bytes_per_s["*"])

  def rate(self, kernel: str, config=None) -> float:
    """A kernel's measured rate: of its configuration (keyed by ``configs.label``) where measured, else of its
    defaults, else ``flops_per_s``."""
    base = self.kernel_flops_per_s.get(kernel, self.flops_per_s)
    return self.kernel_flops_per_s.get(configs.label(kernel, config), base) if config is not None else base

  def backward(self) -> "Machine":
    """The machine as a backward pass sees it: each kernel at its backward block's rate where measured."""
    if not self.backward_flops_per_s:
      return self
    return dataclasses.replace(self, kernel_flops_per_s={**self.kernel_flops_per_s, **self.backward_flops_per_s})

  def with_links(self, **levels: float) -> "Machine":
    """The same machine with other per-level bandwidths (to plan larger meshes)."""
    return dataclasses.replace(self, link_bytes_per_s={**self.link_bytes_per_s, **levels})

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, data: dict) -> "Machine":
    return cls(**data)

  def parts(self) -> tuple[dict, dict]:
    """``(mesh figures, kernel figures)``: the fields of ``MESH_FIELDS``, measured once per machine whatever the
    operator, and the others but the name, measured per operator pattern and dtypes."""
    data = self.to_dict()
    return ({k: data[k] for k in MESH_FIELDS},
            {k: v for k, v in data.items() if k not in MESH_FIELDS and k != "name"})

  @classmethod
  def from_parts(cls, name: str, mesh_part: dict, kernel_part: dict) -> "Machine":
    """The machine of a mesh's figures and an operator's kernel figures (``parts``)."""
    return cls(name=name, **mesh_part, **kernel_part)


def calibrated_name(mesh) -> str:
  """A calibrated machine's name: its device kind and count."""
  kind = mesh.devices.flat[0].device_kind if isinstance(mesh, jax.sharding.Mesh) else "abstract"
  return f"{kind} x{math.prod(mesh.shape.values())} (calibrated)"


# The figures of the mesh and its devices, whatever runs on them (``Machine.parts``).
MESH_FIELDS = ("link_bytes_per_s", "latency_s", "gather_factor", "overlap", "memory_bytes_per_s")


# A block's backward work over its forward's: a GEMM's two products of its size; an attention recomputes its
# scores and forms dV, dP, dQ and dK, five products against the forward's two.
BACKWARD_WORK = {"matmul": 2.0, "attention": 2.5}


def predict(schedule, machine: Machine) -> float:
  """Predicted seconds for one call of the schedule on ``machine``."""
  if schedule.lowering is not None:
    return fused_seconds(schedule, machine)
  if schedule.dispatched is not None:
    return routed_seconds(schedule, machine)
  return _nest_seconds(schedule, machine)


def routed_seconds(schedule, machine: Machine, *, work: float = 1.0) -> float:
  """A dispatched schedule (``Schedule.dispatch``): routing, the exchange both ways and the grouped GEMM.

  Per chunk: two all-to-alls of the slot buffers over the experts' level (each sends
  ``(size - 1) * slots * d`` elements; a ragged exchange only the kept rows, plus the all-gather of the
  counts), and the expert FFN (``6 d f`` flops per row) on the rows a balanced
  router sends each device (``ragged_dot``, at the ``xla`` rate; a grouped GEMM kernel on the rows its tiles
  compute, at its rate: ``_grouped_gemm_seconds``), or on every slot for every local expert (``dense``).
  Chunks pipeline: one chunk's exchange hides under another's GEMMs up to ``overlap``. Before and
  after: the router's GEMM, the all-gather of the tokens and the reduce-scatter (or all-reduce) of the float32
  partial outputs over the hidden-width levels. ``work`` scales the compute (a backward: 2, its exchanges the
  same all-to-alls reversed).
  """
  d = dispatches.of(schedule)
  w = dispatches.work(schedule, d)
  routing = schedule.program.routing
  rate = machine.rate("xla")
  if d.gemm == "dense":
    gemm = work * 6.0 * w["rows"] * d.local_experts * w["model"] * w["width"] / rate
  else:
    gemm = work * _grouped_gemm_seconds(schedule, d, w, machine)
  sent = w["exchanged"]
  if d.exchange == "ragged":  # only the kept rows, a balanced router's share for the other devices
    sent = w["routed"] * (d.size - 1) / d.size * w["model"] * schedule.program.writes.dtype.itemsize
  exchange = 2 * (machine.gather_factor * sent / machine.bandwidth(d.level) + 2 * machine.latency_s)
  pipelined = max(gemm, exchange) + (1.0 - machine.overlap) * min(gemm, exchange)
  per_chunk = gemm + exchange if d.chunks == 1 else pipelined
  tokens = w["tokens"] * d.chunks
  experts = schedule.program.axes[routing.experts].extent
  total = d.chunks * per_chunk + (d.chunks - 1) * machine.call_overhead_s
  total += work * 2.0 * tokens * w["model"] * experts / rate
  if routing.capacity is not None:
    total += machine.latency_s  # the per-expert counts, all-gathered
  itemsize = schedule.program.writes.dtype.itemsize
  for lv in d.hidden_levels:
    n = schedule.levels[lv]
    if lv in d.gathered:
      total += machine.gather_factor * tokens * w["model"] * (itemsize + 4) * (n - 1) / n / machine.bandwidth(lv)
    else:
      total += machine.gather_factor * 2 * tokens * w["model"] * 4 * (n - 1) / n / machine.bandwidth(lv)
    total += machine.latency_s
  return total


def _grouped_gemm_seconds(schedule, d, w, machine: Machine) -> float:
  """The expert FFN's three grouped GEMMs (``2 d f`` flops per row each) on the rows a balanced router sends:
  through ``ragged_dot`` at the ``xla`` rate, or through a grouped GEMM kernel on the rows its tiles compute
  (``GroupedKernel.rows``) at its measured rate (the ``xla`` rate where not measured); a projection the
  kernel cannot compute runs ``ragged_dot`` (``analysis.dispatch.gemm_fallback``)."""
  xla = machine.rate("xla")
  per_projection = 2.0 * w["model"] * w["width"]
  if d.gemm == "ragged_dot":
    return 3 * per_projection * w["routed"] / xla
  kernel = registry.grouped(d.gemm)
  config = kernel.configure()
  rate = machine.kernel_flops_per_s.get(d.gemm, xla)
  fallback = dispatches.gemm_fallback(schedule, d)
  total = 0.0
  for name in dispatches.projections(schedule, d):
    if name in fallback:
      total += per_projection * w["routed"] / xla
    else:
      total += per_projection * kernel.rows(w["routed"], d.local_experts, config) / rate
  return total


def backward_seconds(schedule, machine: Machine) -> float:
  """Predicted seconds of the schedule's backward pass (the vjp JAX derives), beyond its forward.

  A loop nest's backward is priced as its forward with every block's work
  ``BACKWARD_WORK`` times the forward's (a GEMM: two GEMMs of its size; an
  attention: five block products against two, at the backward block's
  measured rate where calibration measured it; an attention's blocks on
  cuDNN where its ``backward_schedule`` puts them) and every collective
  transposed, moving the same bytes (gathers become reduce-scatters, ring
  shifts run the other way carrying cotangents). A cross-level reduction
  transposes to an all-gather of the output's stored block where the output
  is split over that level (a reduce-scatter), to nothing where it is whole
  there (an all-reduce: every device already holds the whole cotangent). A
  fused ring attention's backward is that of its loop nest (``DualPrograms``: the kernel keeps its residuals;
  ``schedules.dual.fused_loop_nest``: on the kernel its configuration's ``backward`` names); a fused GEMM's is
  its dual fused GEMM and one local GEMM (``fused_gemm_backward_seconds``).
  """
  if schedule.dispatched is not None:
    return routed_seconds(schedule, machine.backward(), work=2.0)
  if schedule.lowering is None:
    work = BACKWARD_WORK.get(schedule.program.pattern, 2.0)
    return _nest_seconds(backward_schedule(schedule), machine.backward(), work=work, reductions=TRANSPOSED)
  if isinstance(registry.fused(schedule.lowering).backward, DualGemm):
    return fused_gemm_backward_seconds(schedule, machine)
  return backward_seconds(fused_loop_nest(schedule), machine)


def fused_gemm_backward_seconds(schedule, machine: Machine) -> float:
  """A fused GEMM's backward (``lowering.fused_gemm_backward``): the dual fused GEMM, then the local GEMM.

  The dual kernel does the forward's flops and passes ``L - 1`` blocks: an
  all-gather GEMM's dual reduce-scatters float32 partials of dA's row block
  ``[m, k]``, a reduce-scatter GEMM's dual gathers dC's row blocks
  ``[m, n]``; both overlapped with its GEMMs, at its measured rate on the mesh
  (``fused_flops_per_s``), else its local kernel's. Where the dual kernel
  cannot run, XLA's GEMM and then its collective. The other gradient is one
  local GEMM of the forward's flops on the gathered operand; a kernel that
  keeps no gathered rows (``DualGemm.keeps_rows`` False) gathers A first.
  """
  k = registry.fused(schedule.lowering)
  p = placements.of(schedule)
  size, m, depth, n = p.padded_shape(k.tile(schedule.lowering_config))
  local = compute_seconds(schedule.without("lower_with"), machine)
  link = machine.bandwidth(p.level)
  sent = (size - 1) * (m * depth * 4 if p.kind == ALLGATHER else m * n * p.itemsize)
  dual = placements.dual_kernel(schedule)
  if dual is None:
    collective = local + machine.gather_factor * sent / link + machine.latency_s
  else:
    collective = fused_common.overlapped_gemm_seconds(dual, dual.configure(), 2 * size * m * depth * n, sent,
                                                      p.level, machine, _sm_count(schedule.mesh))
  regather = 0.0
  if not k.backward.keeps_rows:
    regather = machine.gather_factor * (size - 1) * m * depth * p.itemsize / link + machine.latency_s
  return collective + regather + local


TRANSPOSED = "transposed"  # ``_nest_seconds``: price each cross-level reduction's transpose


def _nest_seconds(schedule, machine: Machine, *, work: float = 1.0, reductions: str | None = "forward") -> float:
  """The loop nest's seconds with each block's compute ``work`` times the forward's (0: none, no call costs);
  ``reductions``: its cross-level reductions as all-reduces (``"forward"``), their transposes
  (``TRANSPOSED``) or left out (None)."""
  prog, plan = schedule.program, schedule.plan()
  levels = schedule.levels
  run = packed.sample_run(schedule)  # the steps segment ids leave, on the program's sample
  ring_steps = {name: run.steps[name] if run and name in run.steps else r.steps() for name, r in plan.rings.items()}
  calls = math.prod(len(ring_steps[lp.name]) if lp.shifted_by else lp.extent  # steps a mask hides: none
                    for lp in schedule.loops if lp.role == SERIAL)
  compute = 0.0
  if work:
    compute = work * compute_seconds(schedule, machine, plan) + calls * machine.call_overhead_s
    if calls > 1:  # each block's partial state is combined with, or placed into, the accumulated one
      compute += calls * 3 * _state_block_bytes(schedule) / machine.memory_bytes_per_s
  exposed = 0.0
  for b in prog.reads:
    exposed += _moves_seconds(schedule, b, plan.storage[b.name], plan.resident[b.name], machine, latency=True)
  out = prog.writes
  state_bytes = partial_state_bytes(schedule, plan)
  for red in plan.reductions if reductions else ():
    n = levels[red.level]
    if reductions == TRANSPOSED:
      if any(red.level in lv for lv in plan.storage[out.name]):
        nbytes = local_elements(schedule, out, plan.storage[out.name]) * out.dtype.itemsize
        exposed += machine.gather_factor * nbytes * (n - 1) / machine.bandwidth(red.level) + machine.latency_s
      continue
    exposed += machine.gather_factor * 2 * state_bytes * (n - 1) / n / machine.bandwidth(red.level)
    exposed += machine.latency_s
  exposed += _moves_seconds(schedule, out, plan.result, plan.storage[out.name], machine, latency=False)
  exposed += _zigzag_seconds(schedule, machine, plan)
  ring = 0.0
  for r in plan.rings.values():
    nbytes = sum(local_elements(schedule, prog.buffer(b), plan.resident[b]) * prog.buffer(b).dtype.itemsize
                 for b in r.buffers)
    if r.travel:
      nbytes += state_bytes
    ring += r.moves(ring_steps[r.loop]) * (nbytes / machine.bandwidth(r.level) + machine.latency_s)
  return exposed + max(compute, ring) + (1.0 - machine.overlap) * min(compute, ring)


def _moves_seconds(schedule, buf, src, dst, machine: Machine, *, latency: bool) -> float:
  """Moving ``buf`` from layout ``src`` to ``dst`` by ``collectives.steps``: each step's bytes over its level's
  link (times ``gather_factor``), and one latency per communicating step where ``latency``."""
  shape = [schedule.padded.get(a, e) for a, e in zip(buf.axes, buf.canonical_shape)]
  seq = cl.steps(src, dst)
  total = 0.0
  for c, before in zip(seq, cl.trajectory(src, seq)):
    nbytes = cl.bytes_moved(c, before, shape, buf.dtype.itemsize, schedule.levels)
    total += machine.gather_factor * nbytes / machine.bandwidth(c.level)
    total += machine.latency_s if latency and c.kind in cl.COMMUNICATING else 0.0
  return total


def partial_state_bytes(schedule, plan) -> int:
  """Bytes of one device's partial result: every leaf of the reduction's state (float32) in the output's resident
  layout (attention: the output block, and its running max and sum, which have no head dimension)."""
  out = schedule.program.writes
  layout = dict(zip(out.axes, plan.resident[out.name]))
  extents = {a: ax.extent for a, ax in schedule.program.axes.items()}
  total = 0
  for leaf in schedule.program.state_axes():
    total += 4 * math.prod(schedule.padded.get(a, extents[a])
                           // math.prod(schedule.levels[lv] for lv in layout.get(a, ())) for a in leaf)
  return total


def fused_seconds(schedule, machine: Machine) -> float:
  """A schedule lowered with a fused kernel: the kernel's own cost hook (``FusedKernel.seconds``: a fused GEMM's
  ``max(local GEMMs, ring transfers) + latency``, a ring attention's attention over every key against its ring),
  at the kernel's rate measured on the mesh where calibration measured it."""
  k = registry.fused(schedule.lowering)
  return k.seconds(k, placements.of(schedule), schedule.lowering_config, machine, _sm_count(schedule.mesh))


def _sm_count(mesh, default: int = 132) -> int:
  """The SM count of the mesh's devices (an abstract mesh's device, else the first device's), else an H100's."""
  if isinstance(mesh, jax.sharding.AbstractMesh):
    return getattr(mesh.abstract_device, "num_cores", None) or default
  return getattr(mesh.devices.flat[0], "core_count", None) or default


def dense_flops(program) -> float:
  """The program's flops with every loop point computed (programs count a causal mask's half only, a sliding
  window's pairs; a routed program, its top-k experts per token: its dense body computes every expert)."""
  if program.routing is not None:
    return program.flops * program.axes[program.routing.experts].extent / program.routing.top_k
  p = program.params
  return program.flops / (mask_of(p).kept_share(p["q_len"], p["kv_len"]) if "q_len" in p else 1.0)


def masked_axes(program) -> tuple[str, ...]:
  """The loop axes whose block positions change a block's work: the query and key axes of a program with a
  positional mask (causal, sliding window)."""
  if not mask_of(program.params).positional:
    return ()
  return tuple(a for a in ("i", "j") if a in program.kinds)


def compute_seconds(schedule, machine: Machine, plan=None) -> float:
  """Seconds of local compute on the busiest device, without call overheads.

  Every body call's work is split by the kernel (``Kernel.block_work``)
  into its own share, at its rate, and the share its fallback (the program's
  body) computes, at the ``xla`` rate; wholly masked causal blocks cost
  nothing. A device's time is its calls' sum; the busiest device sets the
  time: a ring lets no device run more than a step ahead of its neighbour,
  and the collectives after the nest wait for all.
  """
  prog = schedule.program
  plan = plan or schedule.plan()
  name, config = schedule.kernel or "xla", schedule.kernel_config
  kernel = registry.local(name)
  sizes = block_sizes(schedule)
  extents = {a: ax.extent for a, ax in prog.axes.items()}
  dense = dense_flops(prog) * math.prod(sizes[a] / extents[a] for a in prog.kinds)
  fast_s, slow_s = dense / machine.rate(name, config), dense / machine.rate("xla")

  def seconds(starts) -> float:
    w = kernel.block_work(prog, Block(sizes, extents, starts, schedule.zigzags), config)
    return w.fast * fast_s + w.fallback * slow_s

  serial = [lp for lp in schedule.loops if lp.role == SERIAL]
  run = packed.sample_run(schedule)  # segment ids: calls whose blocks keep no pair of the sample compute nothing
  masked = packed.AXES if run is not None else masked_axes(prog)
  kept = [lp for lp in serial if lp.axis in masked]
  repeat = math.prod(lp.extent for lp in serial if lp not in kept)  # loops whose blocks all cost the same
  if not masked:
    return seconds({}) * repeat
  _, _, starts = body_calls(schedule, plan.rings, masked)  # each call's first stored position
  pairs, inverse = np.unique(np.stack(starts), axis=1, return_inverse=True)
  cost = np.array([seconds(dict(zip(masked, map(int, col)))) for col in pairs.T])[np.reshape(inverse, -1)]
  if run is not None:
    cost = cost * run.computed
  per_device = cost.reshape(math.prod(schedule.levels.values()), -1).sum(axis=1)
  return repeat * float(per_device.max())


def _zigzag_seconds(schedule, machine: Machine, plan) -> float:
  """Putting zigzag-ordered buffers in and out of their order (and a balanced schedule's rows in theirs).

  Where the axis is split over devices in whole chunks, each device sends
  its chunks straight to their new devices, ``k`` rounds of one
  ``ppermute`` of a ``1/k`` share of its block (``storage_order``);
  otherwise the whole array is permuted: each input all-gathered, the
  output all-reduced (twice an all-gather's bytes).
  """
  prog = schedule.program
  devices = math.prod(schedule.levels.values())
  total = 0.0
  for b in prog.reads + (prog.writes,):
    nbytes = math.prod(b.canonical_shape) * b.dtype.itemsize
    if schedule.balanced and {"i", "j"} & set(b.axes):  # the balanced order: rows permuted whole, gathered first
      total += machine.gather_factor * nbytes * (devices - 1) / devices / machine.bandwidth("*") + machine.latency_s
    for dim, a in enumerate(b.axes):
      if a not in schedule.zigzags:
        continue
      split = storage_order.sharded_levels(plan.spec(b.name), dim)
      parts = math.prod(schedule.levels[lv] for lv in split)
      if split and storage_order.routes(storage_order.zigzag_moves(schedule.zigzags[a], True), parts):
        rounds = schedule.zigzags[a] // parts
        block = nbytes / parts
        total += rounds * machine.latency_s + block / min(machine.bandwidth(lv) for lv in split)
      else:
        moved = (2 if b is prog.writes else 1) * nbytes * (devices - 1) / devices
        total += machine.gather_factor * moved / machine.bandwidth("*") + machine.latency_s
      total += 2 * nbytes / devices / machine.memory_bytes_per_s
  return total


def _state_block_bytes(schedule) -> int:
  prog, sizes = schedule.program, block_sizes(schedule)
  return sum(4 * math.prod(sizes[a] for a in leaf) for leaf in prog.state_axes())
