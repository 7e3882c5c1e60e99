"""Known distributed strategies, each built only from schedule primitives.

``library(program, mesh)`` returns the strategies that apply to a program on
a mesh, by name. On a mesh of several levels, a strategy that spreads one
loop spreads it over every level (one factor per level, outermost level
first); ``usp`` mixes levels.
"""

from __future__ import annotations

import math

import jax
from jax.sharding import PartitionSpec

from jaxmercury.errors import ScheduleError
from jaxmercury.programs.masks import KV_SEGMENTS, band_pairs, mask_of
from jaxmercury.schedules.schedule import Schedule


def split(s: Schedule, loop: str, levels, *, parallel: bool = True) -> list[str]:
  """Tiles ``loop`` into one factor per mesh level (plus the rest) and spreads them.

  Pads the loop's axis first when the mesh does not divide it. With
  ``parallel=False`` the factors are tiled but left serial (for ``shift``).

  Returns:
    The factor loops' names, one per level.
  """
  sizes = [s.levels[lv] for lv in levels]
  total = math.prod(sizes)
  if s.loop(loop).extent % total:
    s.pad(s.loop(loop).axis, total)
  names, rest = [], loop
  for k, (lv, size) in enumerate(zip(levels, sizes)):
    name = f"{loop}{k}"
    s.tile(rest, size, names=(name, f"{loop}_in"))
    rest = f"{loop}_in"
    names.append(name)
    if parallel:
      s.parallelize(name, lv)
  return names


def _seq_spec(levels, dim):
  entry = levels[0] if len(levels) == 1 else tuple(levels)
  return PartitionSpec(*([None] * dim + [entry]))


def _sequence_specs(program, levels) -> tuple:
  """Each input stored split along its sequence axis (queries, else keys) over ``levels``: the caller layouts of
  ``ulysses`` and ``usp``. A mask array with a query axis is split along it, with only a key axis along that."""
  out = []
  for b in program.reads:
    axis = "i" if "i" in b.axes else "j" if "j" in b.axes else None
    dim = next((n for n, d in enumerate(b.dims) if axis in [a.name for a in d]), None)
    out.append(_seq_spec(levels, dim) if dim is not None else None)
  return tuple(out)


def attention_library(program, mesh) -> dict[str, Schedule]:
  levels = list(mesh.axis_names)
  s_levels = dict(mesh.shape)
  out = {}
  mask = mask_of(program.params)

  def ctx_parallel():
    s = Schedule(program, mesh)
    _pad_to_mesh(s, "j")
    par = split(s, "i", levels)
    for buf in ("k", "v", KV_SEGMENTS):
      if buf in program.buffers:
        for p in par:
          s.shard(buf, p, axis="j")
    return s

  def ring():
    s = Schedule(program, mesh)
    par = split(s, "i", levels)
    for p, j in zip(par, split(s, "j", levels, parallel=False)):
      s.shift(j, p)
    return s

  def ring_zigzag(balanced: bool = False):
    if balanced:
      s = Schedule(program, mesh)
      s.balance(2 * math.prod(s.levels.values()))  # raises where the program has no segment ids to spread
      return _zigzag_ring(s)
    if not mask.causal or program.axes["i"].extent != program.axes["j"].extent:
      raise ScheduleError("ring_zigzag balances causal self-attention")
    if mask.window is not None and not _zigzag_pays(mask, program.axes["i"].extent, math.prod(s_levels.values())):
      raise ScheduleError("ring_zigzag: with this window the busiest rank does no less work in zigzag order than "
                          "in natural order; zigzag would only add ring steps")
    s = Schedule(program, mesh)
    chunks = 2 * math.prod(s.levels.values())
    s.zigzag("i", chunks).zigzag("j", chunks)
    return _zigzag_ring(s)

  def _zigzag_ring(s):
    par = split(s, "i", levels)
    rings = split(s, "j", levels, parallel=False)
    for p, j in zip(par, rings):
      s.shift(j, p)
    s.tile("i_in", 2, names=("i_half", "i_chunk")).tile("j_in", 2, names=("j_half", "j_chunk"))
    # each block is one chunk (contiguous, so whole-block kernels apply); both query halves
    # meet each travelling key block, so K/V go around the ring once
    return s.reorder(*rings, "i_half")

  def tree():
    s = Schedule(program, mesh)
    split(s, "j", levels)
    return s

  def ulysses():
    seq = _seq_spec(levels, 1)
    s = Schedule(program, mesh, in_shardings=_sequence_specs(program, levels), out_sharding=seq)
    total = math.prod(s.levels.values())
    head = "hk" if program.axes["hk"].extent % total == 0 else "g"
    if program.axes[head].extent % total:
      raise ScheduleError(f"ulysses: neither kv heads nor query groups divide over {total} devices")
    split(s, head, levels[::-1])  # innermost level first: each level is one all-to-all
    return s

  def head_parallel():
    s = Schedule(program, mesh)
    total = math.prod(s.levels.values())
    if program.axes["hk"].extent % total:
      raise ScheduleError(f"head_parallel: {program.axes['hk'].extent} kv heads do not divide over {total} devices")
    split(s, "hk", levels)
    return s

  def usp():
    if len(levels) < 2:
      raise ScheduleError("usp needs a mesh of two levels")
    outer, inner = levels[0], levels[-1]
    seq = _seq_spec([outer, inner], 1)
    s = Schedule(program, mesh, in_shardings=_sequence_specs(program, [outer, inner]), out_sharding=seq)
    head = "hk" if program.axes["hk"].extent % s.levels[inner] == 0 else "g"
    split(s, head, [inner])
    (p,) = split(s, "i", [outer])
    (j,) = split(s, "j", [outer], parallel=False)
    s.shift(j, p)
    return s

  for name, build in (("context_parallel", ctx_parallel), ("ring", ring), ("ring_zigzag", ring_zigzag),
                      ("ring_balanced", lambda: ring_zigzag(balanced=True)),
                      ("ulysses", ulysses), ("head_parallel", head_parallel), ("usp", usp), ("tree", tree)):
    _try(out, name, build)
  return out


def _zigzag_pays(mask, length: int, devices: int) -> bool:
  """Whether zigzag order gives the busiest of ``devices`` ranks less masked self-attention work than natural
  order (a causal mask does; a window much shorter than the sequence does not: every rank's queries see a
  window's worth of keys in either order)."""
  if length % (2 * devices):
    return False
  chunk = length // (2 * devices)
  work = lambda lo, hi: band_pairs((lo, hi), (0, length), mask.band)
  natural = max(work(2 * r * chunk, 2 * (r + 1) * chunk) for r in range(devices))
  zigzag = max(work(r * chunk, (r + 1) * chunk) + work((2 * devices - 1 - r) * chunk, (2 * devices - r) * chunk)
               for r in range(devices))
  return zigzag < natural


def matmul_library(program, mesh) -> dict[str, Schedule]:
  levels = list(mesh.axis_names)
  out = {}

  def allgather():
    s = Schedule(program, mesh)
    _pad_to_mesh(s, "m")
    for p in split(s, "n", levels):
      s.shard("A", p, axis="m")
    return s

  def reducescatter():
    s = Schedule(program, mesh)
    _pad_to_mesh(s, "m")
    for p in split(s, "k", levels):
      s.shard("C", p, axis="m")
    return s

  def async_tp():
    s = Schedule(program, mesh)
    par = split(s, "n", levels)
    for p, m in zip(par, split(s, "m", levels, parallel=False)):
      s.shift(m, p)
    return s

  def async_tp_reducescatter():
    s = Schedule(program, mesh)
    par = split(s, "k", levels)
    for p, m in zip(par, split(s, "m", levels, parallel=False)):
      s.shift(m, p)
    return s

  def data_parallel():
    s = Schedule(program, mesh)
    split(s, "m", levels)
    return s

  for name, build in (("allgather_matmul", allgather), ("matmul_reducescatter", reducescatter),
                      ("async_tp", async_tp), ("async_tp_reducescatter", async_tp_reducescatter),
                      ("data_parallel", data_parallel)):
    _try(out, name, build)
  return out


def moe_library(program, mesh) -> dict[str, Schedule]:
  """Mixture of experts (a routed program): the experts spread, tokens exchanged by a routed all-to-all."""
  levels = list(mesh.axis_names)
  routing = program.routing
  out = {}

  def expert_level(level):
    size, experts = mesh.shape[level], program.axes[routing.experts].extent
    if experts % size:
      raise ScheduleError(f"expert_parallel: the {experts} experts do not divide over mesh level {level!r} of "
                          f"size {size}")

  def expert_parallel(chunks: int = 1, exchange: str = "padded"):
    ep = levels[-1]  # the innermost level: the all-to-all is the heaviest exchange
    expert_level(ep)
    s = Schedule(program, mesh)
    _pad_to_mesh(s, routing.tokens)
    data = split(s, routing.tokens, levels[:-1])  # the other levels: data parallel
    (e,) = split(s, routing.experts, [ep])
    s.dispatch(e, exchange=exchange)
    if chunks > 1:
      local = f"{routing.tokens}_in" if data else routing.tokens
      per_device = s.padded[routing.tokens] // math.prod(s.levels.values())
      if per_device % chunks:
        raise ScheduleError(f"expert_parallel_pipelined: {per_device} tokens per device do not split into "
                            f"{chunks} chunks")
      s.tile(local, chunks, names=(f"{routing.tokens}_chunk", f"{routing.tokens}_row"))
    return s

  def expert_tensor_parallel():
    if len(levels) != 2:
      raise ScheduleError("expert_tensor_parallel needs a mesh of two levels")
    ep, tp = levels
    expert_level(ep)
    s = Schedule(program, mesh)
    _pad_to_mesh(s, routing.tokens)
    (e,) = split(s, routing.experts, [ep])
    hidden = next(a.name for a in program.loops if a.name not in (routing.tokens, routing.experts))
    (f,) = split(s, hidden, [tp])  # each expert's hidden width
    s.dispatch(e)
    for name in (program.writes.name,) + routing.routed:  # tokens split over both levels, the experts' major
      s.shard(name, f, axis=routing.tokens)
    return s

  def ragged():
    if _platform(mesh) != "gpu":
      raise ScheduleError("expert_parallel_ragged: ragged_all_to_all runs on GPUs (XLA:CPU does not run it)")
    return expert_parallel(exchange="ragged")

  for name, build in (("expert_parallel", expert_parallel),
                      ("expert_parallel_pipelined", lambda: expert_parallel(2)),
                      ("expert_parallel_ragged", ragged),
                      ("expert_tensor_parallel", expert_tensor_parallel)):
    _try(out, name, build)
  return out


def _platform(mesh) -> str:
  """The platform of the mesh's devices (an abstract mesh's abstract device's)."""
  if isinstance(mesh, jax.sharding.AbstractMesh):
    return getattr(getattr(mesh, "abstract_device", None), "platform", None) or "unknown"
  return mesh.devices.flat[0].platform


def _pad_to_mesh(s: Schedule, axis: str):
  total = math.prod(s.levels.values())
  if s.padded[axis] % total:
    s.pad(axis, total)


def generic_library(program, mesh) -> dict[str, Schedule]:
  """For any program: each loop spread over the whole mesh, and rings."""
  levels = list(mesh.axis_names)
  out = {}
  for lp in program.loops:
    _try(out, f"parallel_{lp.name}", lambda lp=lp: _parallel(program, mesh, lp.name, levels))
  for sp in program.loops:
    for other in program.loops:
      if other is not sp:
        _try(out, f"ring_{other.name}_over_{sp.name}",
             lambda sp=sp, other=other: _ring(program, mesh, sp.name, other.name, levels))
  return out


def _parallel(program, mesh, loop, levels):
  s = Schedule(program, mesh)
  split(s, loop, levels)
  return s


def _ring(program, mesh, parallel_loop, shifted_loop, levels):
  s = Schedule(program, mesh)
  par = split(s, parallel_loop, levels)
  for p, j in zip(par, split(s, shifted_loop, levels, parallel=False)):
    s.shift(j, p)
  return s


def _try(out, name, build):
  try:
    out[name] = build()
  except ScheduleError:
    pass  # the strategy does not apply to this program or mesh


_BY_PATTERN = {"attention": attention_library, "matmul": matmul_library, "moe": moe_library}


def library(program, mesh) -> dict[str, Schedule]:
  """The known strategies that apply to ``program`` on ``mesh``, by name.

  attention: ``context_parallel`` (all-gathered K/V), ``ring``
  (RingAttention), ``ring_zigzag`` (the ring with queries and keys in zigzag
  order, so causal work is balanced), ``ring_balanced`` (packed rows: the
  ring in zigzag order after each row's documents are spread evenly over
  the chunks, ``Schedule.balance``), ``ulysses`` (heads spread, all-to-all from sequence-sharded
  inputs), ``head_parallel`` (kv heads spread over every level, where they divide: no communication for
  callers whose heads are split, as in a tensor-parallel attention block; each device's attention is whole, so
  its backward is one fused call, ``lowering.local_backward``), ``usp`` (heads on the inner level, ring on the
  outer; two-level meshes), ``tree`` (keys spread, log-sum-exp merge). matmul:
  ``allgather_matmul``, ``matmul_reducescatter``, ``async_tp`` (all-gather
  ring overlapped with the GEMM), ``async_tp_reducescatter`` (partial outputs
  passed around the ring), ``data_parallel`` (rows spread, B replicated: no
  communication for callers whose rows are split, as in a sequence-parallel
  block with replicated weights). moe: ``expert_parallel`` (experts over the
  innermost level, tokens over every level, a routed all-to-all over the
  experts' level: ``Schedule.dispatch``), ``expert_parallel_pipelined`` (the
  same, each device's tokens dispatched in two chunks), ``expert_parallel_ragged``
  (GPU meshes: ``ragged_all_to_all`` of the kept rows only), and on two-level
  meshes ``expert_tensor_parallel`` (experts over the outer level, each
  expert's hidden width over the inner one); each is left out where the
  experts do not divide over its level. Other programs get ``parallel_<loop>`` and
  ``ring_<loop>_over_<loop>`` strategies.
  """
  build = _BY_PATTERN.get(program.pattern, generic_library)
  return build(program, mesh)
