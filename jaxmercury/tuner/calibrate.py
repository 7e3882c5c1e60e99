"""A short microbenchmark that measures the cost model's figures on this machine.

Each applicable local kernel runs on one device on blocks of the program's
own shape at two sizes, repeated inside one jitted loop so that dispatch does
not count: the two times give its rate (in the flops it executes: the
kernel's ``Work`` says how much of a block that is) and its fixed cost per
call; a backward block runs at the larger size alone (its rate is all the
cost model keeps of it). Each size compiles once: on CPUs the repeats are
the loop's argument, on GPUs the loop's calls are dispatched back to back.
Block offsets are traced, as in the nest (a constant causal mask would let
XLA compile another body); a causal program's blocks are diagonal, query and
key blocks of one size, which the kernels take on their own path. A ring
``ppermute`` over each mesh level at two sizes gives the level's bandwidth
and latency, an all-gather against the same ring the collectives' factor, and
a ring beside independent matrix products how much of a transfer hides; an
elementwise pass gives the memory bandwidth.

The figures come in two parts, stored apart (``tuner.database``): the mesh's
(``MESH_FIELDS``: links, latency, collectives, overlap, memory bandwidth),
measured once per machine (device kind and mesh) whatever the operator and
dtype, and the kernels' (the rest), once per operator pattern and dtypes.
A tune measures only the part the database lacks (``measure_parts(parts=...)``);
the kernels' backward blocks (``BACKWARD``), only a training tune's, wait for
the first training tune (``with_backward``).
Each step compiles its probe programs at once on threads (``_warm``: the
kernels' step every kernel's; the timed calls then find them compiled), and
its blocks are drawn on the host, so that no random draw compiles a program
of its own.
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
import statistics
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxmercury.analysis import placements
from jaxmercury.errors import PreconditionError
from jaxmercury.ir.program import BlockContext
from jaxmercury.kernels import registry
from jaxmercury.kernels.work import Block
from jaxmercury.programs import attention
from jaxmercury.programs.attention_backward import attention_dq
from jaxmercury.schedules.library import library
from jaxmercury.tuner.ahead import default_threads
from jaxmercury.tuner.cost import BACKWARD_WORK, Machine, calibrated_name, dense_flops, masked_axes
from jaxmercury.tuner.measure import place_inputs

REPEATS = 8
PIPELINED_CALLS = 4  # calls of a loop of REPEATS timed back to back (``_per_repeat``)
GPU_BLOCK_FLOPS = 1e13  # work per timed block: enough for a kernel's rate to have levelled off
FUSED_PROBE_FLOPS = 2e12  # a fused attention's probe: a few milliseconds on a GPU


def _time(fn, *args, iters: int = 3) -> float:
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def _warm(probes):
  """Compiles each ``(jitted function, args)`` of ``probes`` on threads, all at once: the calls that time them then
  find them compiled (JAX keeps what ``lower(...).compile()`` compiled for the function's own calls). A compile
  that fails is left for its call to raise."""
  def compile_one(probe):
    fn, args = probe
    try:
      fn.lower(*args).compile()
    except Exception:
      pass
  probes = list({id(fn): (fn, args) for fn, args in probes}.values())  # a function of its repeats: once
  if len(probes) < 2:
    return
  with concurrent.futures.ThreadPoolExecutor(min(len(probes), default_threads())) as pool:
    list(pool.map(compile_one, probes))


def _repeats(make, *args) -> list:
  """The two probes of ``_per_repeat``: ``make(REPEATS)`` and ``make(1)`` on ``args``."""
  return [(make(REPEATS), args), (make(1), args)]


def _per_repeat(probes) -> float:
  """Seconds of one repeat of a loop body, without dispatch, from its ``_repeats`` probes; or from one probe, a loop
  of ``REPEATS`` (``_kernel_probes`` on GPUs): its calls dispatched back to back (``_pipelined``), dispatch hidden
  under the device's work and a call's own fixed cost spread over its repeats."""
  if len(probes) == 1:
    (many, args), = probes
    return max(_pipelined(many, *args, calls=PIPELINED_CALLS) / REPEATS, 1e-9)
  (many, many_args), (one, one_args) = probes
  return max((_time(many, *many_args) - _time(one, *one_args)) / (REPEATS - 1), 1e-9)


def _normal(seed: int, shape, dtype) -> np.ndarray:
  """Normal values drawn on the host (a ``jax.random`` draw compiles a program per shape), at most a million of
  them repeated over a larger block: a timing needs values, not independent ones."""
  size = math.prod(shape)
  drawn = np.random.default_rng(seed).standard_normal(min(size, 1 << 20), dtype=np.float32).astype(dtype)
  return np.resize(drawn, shape)


def _block_sizes(program, kernel, budget_bytes: int, shrink: int = 1, square: bool = True,
                 max_flops: float | None = None) -> dict[str, int]:
  """Per-axis block sizes that fit the budget and ``max_flops``, then ``shrink`` times fewer loop points.

  ``square``: a causal program's query and key blocks take the smaller of their sizes.
  """
  sizes = {a: ax.extent for a, ax in program.axes.items()}
  loops = [a.name for a in program.loops]

  def nbytes():
    data = sum(math.prod(sizes[a] for a in b.axes) * b.dtype.itemsize for b in program.reads + (program.writes,))
    return kernel.workspace_bytes(program, sizes) + data

  def halve():
    axis = max(loops, key=lambda a: sizes[a])
    if sizes[axis] == 1:
      return False
    sizes[axis] = max(1, sizes[axis] // 2)
    return True

  def flops():
    return dense_flops(program) * math.prod(sizes[a] / ax.extent for a, ax in program.axes.items())

  while (nbytes() > budget_bytes or (max_flops is not None and flops() > max_flops)) and halve():
    pass
  while shrink > 1 and halve():
    shrink //= 2
  masked = masked_axes(program)
  if square and len(masked) == 2:  # diagonal blocks of one size: the kernels' own causal path
    for a in masked:
      sizes[a] = min(sizes[b] for b in masked)
  return sizes


def executed_flops(program, kernel_name: str, sizes) -> float:
  """Flops ``kernel_name`` executes on one block of ``sizes`` at the origin (masked work it skips not counted)."""
  kernel = registry.local(kernel_name)
  extents = {a: ax.extent for a, ax in program.axes.items()}
  work = kernel.block_work(program, Block(sizes, extents))
  return dense_flops(program) * math.prod(sizes[a] / extents[a] for a in program.kinds) * (work.fast + work.fallback)


def _kernel_probes(program, fn, sizes, device, *, pipelined: bool | None = None) -> list:
  """The ``_per_repeat`` probes of one call on blocks at the origin, given as traced offsets (as the nest gives
  them): on CPUs the two of ``_repeats`` as one program, the repeats its argument; on GPUs (``pipelined``, default
  on devices other than CPUs) one loop of ``REPEATS``, timed pipelined: one compile per block size, where two
  would compile each kernel twice (a Mosaic kernel's lowering takes seconds)."""
  extents = {a: ax.extent for a, ax in program.axes.items()}
  blocks = tuple(jax.device_put(_normal(k, [sizes[a] for a in b.axes], b.dtype), device)
                 for k, b in enumerate(program.reads))

  def loop(repeats, origin, *xs):
    ctx = BlockContext(starts={a: origin for a in program.kinds}, sizes=sizes, extents=extents)

    def step(_, xs):
      outs = jax.tree.leaves(fn(ctx, *xs))  # every output feeds the next repeat: none is dead code
      nudge = (sum(out.reshape(-1)[0] for out in outs) * 0).astype(xs[0].dtype)
      return (xs[0] + nudge,) + xs[1:]
    return jax.lax.fori_loop(0, repeats, step, xs)

  origin = jax.device_put(np.int32(0), device)
  if device.platform != "cpu" if pipelined is None else pipelined:
    return [(jax.jit(functools.partial(loop, REPEATS)), (origin, *blocks))]
  run = jax.jit(loop)  # one program, the repeats its argument (a loop on a CPU costs nothing)
  return [(run, (jax.device_put(np.int32(n), device), origin, *blocks)) for n in (REPEATS, 1)]


def kernel_figures(program, kernel_name: str, mesh, budget_bytes: int,
                   max_flops: float | None = None, *, backward=None) -> tuple[float, float]:
  """(flops per second, fixed seconds per call) of a kernel on one device, on blocks of at most ``max_flops``.

  ``backward``: ``(program, block function)`` run instead on the same block
  sizes, its work ``BACKWARD_WORK`` times the kernel's (``backward_rates``).
  """
  probes = _figure_probes(program, kernel_name, mesh, budget_bytes, max_flops, backward)
  _warm(_flat(probes))
  return _fit(probes)


def _figure_probes(program, kernel_name: str, mesh, budget_bytes: int, max_flops, backward=None,
                   shrinks=(1, 8)) -> dict:
  """``kernel_figures``' probes, not yet compiled: ``{flops executed per repeat: _per_repeat probes}``, a block per
  factor of ``shrinks`` (default a larger and a smaller one; the larger alone gives a rate without a fixed cost)."""
  kernel = registry.local(kernel_name)
  run_program, fn = backward or (program, registry.lookup(kernel_name, program, mesh))
  scale = BACKWARD_WORK[program.pattern] if backward else 1.0
  device = mesh.devices.flat[0]
  probes = {}
  for shrink in shrinks:
    sizes = _block_sizes(program, kernel, budget_bytes, shrink, max_flops=max_flops)
    probes[scale * executed_flops(program, kernel_name, sizes)] = _kernel_probes(run_program, fn, sizes, device)
  return probes


def _flat(*figure_probes) -> list:
  return [p for probes in figure_probes for pair in probes.values() for p in pair]


def _fit(probes) -> tuple[float, float]:
  """(flops per second, fixed seconds per call) from ``_figure_probes``' probes, timed."""
  points = {flops: _per_repeat(pair) for flops, pair in probes.items()}
  ordered = sorted(points.items())  # one point when both sizes do the same work
  (f_small, t_small), (f_big, t_big) = ordered[0], ordered[-1]
  if f_big <= f_small or t_big <= t_small:
    return f_big / t_big, 0.0
  rate = (f_big - f_small) / (t_big - t_small)
  return rate, max(t_small - f_small / rate, 0.0)


def link_figures(mesh, level: str, nbytes: int) -> tuple[float, float, float]:
  """(ring bandwidth bytes/s, latency s, all-gather factor) over one mesh level."""
  n = mesh.shape[level]
  perm = [(j, (j - 1) % n) for j in range(n)]
  spec = PartitionSpec(level)

  def ring(x):
    return jax.lax.ppermute(x, level, perm)

  def gather(x):
    full = jax.lax.all_gather(x, level, axis=0, tiled=True)
    return jax.lax.dynamic_slice_in_dim(full, jax.lax.axis_index(level) * x.shape[0], x.shape[0], 0) + 1

  def probes(op, per_device):
    def make(repeats):
      body = lambda x: jax.lax.fori_loop(0, repeats, lambda _, y: op(y), x)
      return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
    x = jax.device_put(np.ones((n * max(per_device // 4, 1),), np.float32), NamedSharding(mesh, spec))
    return _repeats(make, x)

  steps = {"big": probes(ring, nbytes), "small": probes(ring, 4096), "gather": probes(gather, nbytes)}
  _warm([p for pair in steps.values() for p in pair])
  big, small, gathered = (_per_repeat(pair) for pair in steps.values())
  bandwidth = nbytes / max(big - small, 1e-12)
  factor = (gathered - small) / max((n - 1) * (big - small), 1e-12)
  return bandwidth, small, float(np.clip(factor, 0.25, 4.0))


def overlap_figure(mesh, level: str, nbytes: int, gpu: bool) -> float:
  """How much of a ring transfer hides under independent compute: 1 all, 0 none."""
  n = mesh.shape[level]
  perm = [(j, (j - 1) % n) for j in range(n)]
  spec = PartitionSpec(level)
  size = 4096 if gpu else 256
  dtype = jnp.bfloat16 if gpu else jnp.float32

  def make(compute, transfer):
    def step(_, carry):
      a, x = carry
      if compute:
        a = jnp.dot(a, a, preferred_element_type=jnp.float32).astype(a.dtype) * 0.5
      if transfer:
        x = jax.lax.ppermute(x, level, perm)
      return a, x
    def body(a, x):
      return jax.lax.fori_loop(0, REPEATS, step, (a, x))
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec), check_vma=False))

  a = jax.device_put((_normal(1, (n * size, size), np.float32) / 64).astype(dtype), NamedSharding(mesh, spec))
  x = jax.device_put(np.ones((n * max(nbytes // 4, 1),), np.float32), NamedSharding(mesh, spec))
  probes = [(make(c, t), (a, x)) for c, t in ((True, False), (False, True), (True, True))]
  _warm(probes)
  t_c, t_t, t_both = (_time(fn, *args) for fn, args in probes)
  return float(np.clip((t_c + t_t - t_both) / max(min(t_c, t_t), 1e-12), 0.0, 1.0))


def memory_figure(device, nbytes: int) -> float:
  """Device memory bandwidth in bytes/s (one read and one write per element)."""
  x = jax.device_put(np.ones((max(nbytes // 4, 1),), np.float32), device)

  def make(repeats):
    return jax.jit(lambda y: jax.lax.fori_loop(0, repeats, lambda _, z: z * 1.0001 + 1.0, y))

  probes = _repeats(make, x)
  _warm(probes)
  return 2 * x.size * 4 / _per_repeat(probes)


def kernel_rates(program, mesh, kernels=None, progress=None) -> tuple[dict, float]:
  """Per local kernel (default: those that apply), its rate on ``program``'s blocks; and the median fixed cost
  of one call. ``progress(what)`` is called before each kernel's measurement. Every kernel's probes compile at
  once on threads (``_warm``), before the first is timed: one kernel's lowering overlaps another's compile."""
  gpu = mesh.devices.flat[0].platform != "cpu"
  budget = (8 << 30) if gpu else (64 << 20)
  names = list(kernels or registry.candidates(program, mesh))
  if progress is not None and names:
    progress(f"kernel {names[0]}")
  probes = {name: _figure_probes(program, name, mesh, budget, GPU_BLOCK_FLOPS if gpu else None) for name in names}
  _warm(_flat(*probes.values()))
  rates, overheads = {}, []
  for k, name in enumerate(names):
    if progress is not None and k:
      progress(f"kernel {name}")
    rates[name], overhead = _fit(probes[name])
    overheads.append(overhead)
  return rates, statistics.median(overheads) if overheads else 0.0


def backward_rates(program, mesh, kernels) -> dict[str, float]:
  """Per local kernel of ``kernels`` (an attention program's) whose backward runs as a joint block
  (``AttentionBackward.joint``: dq and dk-dv of a block pair in one call), that block's rate on one device,
  in ``BACKWARD_WORK`` times the forward's flops per second; other programs have none. One block size, the
  forward's larger: only the rate is kept (the fixed cost of a call is the forward's figure), and each size of a
  Mosaic GPU block compiles for seconds."""
  if program.pattern != "attention" or program.params.get("emit_lse"):
    return {}
  gpu = mesh.devices.flat[0].platform != "cpu"
  dq_program = attention_dq(program)
  probes = {}
  for name in kernels:
    backward = registry.local(name).backward
    if backward is None or backward.joint is None:
      continue
    dq_kernel = backward.dq.name if backward.dq is not None else "xla"
    try:
      registry.lookup(dq_kernel, dq_program, mesh)
    except PreconditionError:
      continue
    block = backward.joint(dq_program, **registry.local(name).interprets(mesh))
    # a quarter of the forward's budget: the backward keeps the scores' probabilities and their gradients
    probes[name] = _figure_probes(program, name, mesh, (2 << 30) if gpu else (16 << 20),
                                  GPU_BLOCK_FLOPS if gpu else None, backward=(dq_program, block), shrinks=(1,))
  _warm(_flat(*probes.values()))  # every block compiles at once, as in ``kernel_rates``
  return {name: _fit(pairs)[0] for name, pairs in probes.items()}


def fused_rates(program, mesh, *, seq: int | None = None) -> dict[str, float]:
  """Per fused lowering priced at its own kernel's rate (``rate_kernel`` is its name: the ring attentions), the
  rate that kernel reaches on one device of ``mesh``: a ring of one device, so the local attention alone.

  The program is an attention program (``pattern == "attention"``; other programs have none), rebuilt at
  sequence ``seq`` (default: the longest multiple of 256 up to the program's keys whose work is at most
  ``FUSED_PROBE_FLOPS``); the rate is its executed flops (a causal program computes half its scores) over
  the time of one call, a few milliseconds, so a launch's fixed cost hardly counts. One length, not two:
  a persistent kernel's last wave of work items is partly idle, differently at each length, which a
  difference of two times would amplify (into a rate above the kernel's own). Lowerings
  that do not apply there (another device kind, blocks that do not fit), or fail to run (with a warning), are
  left out.
  """
  own = [k for k in registry.fused_kernels() if k.rate_kernel == k.name]
  if program.pattern != "attention" or not own:
    return {}
  params = program.params
  if seq is None:
    per_key = 4 * params["batch"] * params["heads"] * params["head_dim"]
    seq = max(256, min(params["kv_len"], int(math.sqrt(FUSED_PROBE_FLOPS / per_key))) // 256 * 256)
  one = jax.sharding.Mesh(np.array(mesh.devices.flat[:1]), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
  probe = attention(params["batch"], params["heads"], params["kv_heads"], seq, seq, params["head_dim"],
                    causal=params["causal"], dtype=program.reads[0].dtype)
  schedules = list(library(probe, one).values())
  inputs = jax.device_put(probe.random_inputs(jax.random.key(seq)), one.devices.flat[0])
  rates = {}
  for low in own:
    schedule = next((s for s in schedules if placements.why_not(low, s) is None), None)
    if schedule is None:
      continue
    try:
      fn = jax.jit(schedule.copy().lower_with(low.name).compile(differentiable=False))
      rates[low.name] = probe.flops / _time(fn, *inputs)
    except Exception as e:
      warnings.warn(f"calibrate: {low.name} did not run on one device ({type(e).__name__}: {str(e)[:200]}); "
                    "its rate is not measured", RuntimeWarning, stacklevel=2)
  return rates


GEMM_STRATEGIES = ("async_tp", "allgather_matmul", "matmul_reducescatter")  # the schedules fused GEMMs lower


def _pipelined(fn, *args, calls: int = 4 * REPEATS) -> float:
  """Seconds per call of ``fn(*args)`` dispatched ``calls`` times back to back, waiting once at the end: the
  host dispatches while the devices run, so dispatch does not count where a call outlasts it. (A jitted loop
  does not serve a call whose inputs stay the same: XLA hoists it out of the loop.)"""
  jax.block_until_ready(fn(*args))
  t0 = time.perf_counter()
  for _ in range(calls):
    out = fn(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - t0) / calls


def fused_gemm_rates(program, mesh) -> dict[str, float]:
  """Per fused GEMM lowering offered for ``program`` on ``mesh``, its rate on the whole mesh, in flops per
  second per device: the program's flops over the devices, over the time of one call of the first library
  schedule it lowers (``GEMM_STRATEGIES``), on random inputs in that schedule's layouts; calls are dispatched
  back to back (``_pipelined``), so that dispatch does not count (timed one by one, a call's dispatch can
  outlast its kernel). The ring, its handshakes, padding and launch skew all count, which a kernel's rate on
  one device leaves out. A schedule's lowerings compile at once on threads (``_warm``) before the first is timed;
  one that runs another's program there (``placements.runs_as``: on a mesh level of one device) takes that one's
  rate, timed once. ``program`` must be a GEMM (others have none); lowerings that fail to run are left out, with a
  warning.
  """
  if program.pattern != "matmul":
    return {}
  lib = library(program, mesh)
  rates, twins = {}, {}
  for strategy in GEMM_STRATEGIES:
    if strategy not in lib:
      continue
    schedule = lib[strategy]
    todo = [name for name in placements.offered(schedule) if name not in rates and name not in twins]
    if not todo:
      continue
    inputs = place_inputs(schedule, program.random_inputs(jax.random.key(len(rates))))
    fns = {}
    for name in todo:
      try:
        lowered = schedule.copy().lower_with(name)
        same, config = placements.runs_as(lowered)
        if same != name and config == registry.fused(same).configure():
          twins[name] = same
          continue
        fns[name] = lowered.compile(differentiable=False)
      except Exception as e:
        _not_measured(name, e)
    _warm([(fn, inputs) for fn in fns.values()])
    for name, fn in fns.items():
      try:
        rates[name] = program.flops / mesh.devices.size / _pipelined(fn, *inputs)
      except Exception as e:
        _not_measured(name, e)
  return rates | {name: rates[same] for name, same in twins.items() if same in rates}


def _not_measured(name: str, e: Exception):
  warnings.warn(f"calibrate: {name} did not run on the mesh ({type(e).__name__}: {str(e)[:200]}); its rate "
                "is not measured", RuntimeWarning, stacklevel=3)


MESH, KERNELS = "mesh", "kernels"  # the parts of a machine's figures (``Machine.parts``), measured apart
BACKWARD = "backward_flops_per_s"  # the kernels' part's field that only a training tune needs (``with_backward``)


def calibrate(program, mesh, *, kernels=None, progress=None) -> Machine:
  """Measures this machine's figures for ``program`` on ``mesh``: both parts of ``measure_parts``."""
  parts = measure_parts(program, mesh, kernels=kernels, progress=progress)
  return Machine.from_parts(calibrated_name(mesh), parts[MESH], parts[KERNELS])


def measure_parts(program, mesh, *, parts=(MESH, KERNELS), kernels=None, progress=None, local: bool = True,
                  backward: bool = True) -> dict:
  """Measures the parts of this machine's figures named in ``parts``.

  ``MESH``: per mesh level of more than one device its ring bandwidth and latency, the collectives' factor and
  how much of a transfer hides under compute; one device's memory bandwidth. ``KERNELS``: the local kernels'
  rates on ``program``'s blocks (all that apply, or ``kernels``) and their fixed cost per call, on GPUs their
  backward blocks' (``backward_rates``) and, where ``kernels`` is not given, the fused ring attentions'
  (``fused_rates``; on a mesh of several devices, the only one where they are offered) and fused GEMMs'
  (``fused_gemm_rates``).

  Args:
    program: the program whose kernels are measured.
    mesh: the device mesh whose links are measured.
    parts: which parts to measure.
    kernels: the local kernels to measure; default those that apply.
    progress: ``progress(step, done, total)``, called before each measurement (``step`` names it).
    local: measure what runs on one device (kernels, memory). Under ``jax.distributed`` the processes other than
      process 0, which measures and broadcasts, pass False: they join only what runs over the mesh (links,
      overlap, fused GEMMs), whose collectives need every process; their local figures are placeholders.
    backward: measure the backward blocks too. False (a forward tune's): on GPUs the kernels' part is returned
      without its ``BACKWARD`` field, which a training tune measures when it first needs it (``with_backward``).

  Returns:
    ``{part: {Machine field: value}}`` for each part measured.
  """
  gpu = mesh.devices.flat[0].platform != "cpu"
  link_bytes = (64 << 20) if gpu else (1 << 20)  # CPU devices share the host's memory: a ring there is a copy
  names = list(kernels or registry.candidates(program, mesh)) if KERNELS in parts and local else []
  levels = [level for level in mesh.axis_names if mesh.shape[level] > 1] if MESH in parts else []
  fused = gpu and kernels is None and KERNELS in parts
  total = len(names) + 2 * len(levels) + (MESH in parts) + (2 if fused else 0) + (gpu and backward and KERNELS in parts)
  done = [0]

  def step(what):
    if progress is not None:
      progress(what, done[0], total)
    done[0] += 1

  out = {}
  if MESH in parts:
    links, latencies, factors, overlaps = {}, [], [], []
    for level in levels:
      step(f"link {level}")
      bw, lat, factor = link_figures(mesh, level, link_bytes)
      links[level] = bw
      latencies.append(lat)
      factors.append(factor)
      step(f"overlap {level}")
      overlaps.append(overlap_figure(mesh, level, link_bytes, gpu))
    links["*"] = min(links.values()) if links else 1e12
    step("memory bandwidth")
    memory = memory_figure(mesh.devices.flat[0], (512 << 20) if gpu else (32 << 20)) if local else 0.0
    out[MESH] = {"link_bytes_per_s": links, "latency_s": statistics.median(latencies) if latencies else 0.0,
                 "gather_factor": statistics.median(factors) if factors else 1.0,
                 "overlap": statistics.median(overlaps) if overlaps else 1.0, "memory_bytes_per_s": memory}
  if KERNELS in parts:
    rates, overhead = kernel_rates(program, mesh, names, progress=step) if local else ({}, 0.0)
    fused_figures, backward_figures = {}, {}
    if fused:
      step("fused ring attentions")
      # on one device the tuner offers no ring attention (``propose.ONE_DEVICE_RING``): no rate of theirs to measure
      fused_figures = fused_rates(program, mesh) if local and mesh.devices.size > 1 else {}
      step("fused GEMMs")
      fused_figures |= fused_gemm_rates(program, mesh)
    if gpu and backward:
      step("backward blocks")
      backward_figures = backward_rates(program, mesh, rates) if local else {}
    out[KERNELS] = {"flops_per_s": max(rates.values()) if rates else 1e12, "kernel_flops_per_s": rates,
                    "call_overhead_s": overhead, "fused_flops_per_s": fused_figures}
    if backward or not gpu:  # a CPU's has none to measure
      out[KERNELS][BACKWARD] = backward_figures
  if progress is not None:
    progress("done", total, total)
  return out


def with_backward(program, mesh, kernel_part: dict, *, local: bool = True) -> dict:
  """``kernel_part`` (a ``KERNELS`` part measured without its backward blocks, ``measure_parts(backward=False)``)
  with its ``BACKWARD`` field measured (``backward_rates`` of the kernels it has rates for; on a process other
  than process 0, ``local`` False, a placeholder)."""
  rates = kernel_part.get("kernel_flops_per_s", {})
  return {**kernel_part, BACKWARD: backward_rates(program, mesh, rates) if local else {}}
