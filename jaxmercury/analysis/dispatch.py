"""A dispatched schedule's routed exchange, read from its plan (static facts, no tracing).

``Schedule.dispatch(loop)`` on a routed program (``ir.routing.Routing``, a
mixture of experts) stores the routed inputs and the output split along the
tokens over the experts loop's level ``L``. The dense plan would then
all-gather the tokens over ``L`` and reduce-scatter the output over ``L``:
every device computes every token against its experts, masked. A dispatch
replaces that pair by a data-dependent exchange: each token row goes only to
the devices that hold one of its experts (an all-to-all over ``L`` whose
counts the router decides), those devices compute only the routed rows,
grouped by expert, and a second all-to-all returns the rows to their tokens.
``Dispatch`` records where the exchange runs and what else the layouts imply:

* levels splitting the experts' hidden width ``f`` (expert tensor
  parallelism): the tokens are all-gathered over them before the exchange
  and the partial outputs reduce-scattered (or all-reduced) after it;
* levels splitting only the tokens (data parallelism): nothing moves;
* serial loops over the tokens (``tile``): the exchange runs chunk by chunk,
  so one chunk's all-to-all can overlap the previous chunk's expert GEMMs.
"""

from __future__ import annotations

import dataclasses
import math

from jaxmercury.errors import PreconditionError
from jaxmercury.ir.loops import PARALLEL, SERIAL
from jaxmercury.kernels import registry


@dataclasses.dataclass(frozen=True)
class Dispatch:
  """Where a dispatched schedule's routed exchange runs.

  Attributes:
    loop: the dispatched parallel loop (over the experts).
    level: its mesh level: the all-to-all's.
    size: the level's size (devices the experts are spread over).
    local_experts: experts per device.
    token_levels: the levels splitting the routed inputs' and the output's token dimension, major first.
    hidden_levels: the levels splitting each expert's hidden width (expert tensor parallelism).
    gathered: the hidden levels the tokens are split over too: all-gathered before the exchange and
      reduce-scattered after it (the others all-reduce the partial outputs).
    chunks: the serial token chunks each device dispatches one after the other (1: all at once).
    exchange: ``"padded"``: ``all_to_all`` of fixed-size slot buffers (``slots``); ``"ragged"``:
      ``ragged_all_to_all`` of the kept rows only (XLA:CPU does not run it).
    gemm: the grouped expert GEMM: ``"ragged_dot"``, ``"dense"`` (each local expert on every received slot,
      masked) or a registered grouped GEMM kernel (``kernels.registry.GroupedKernel``: ``"mosaic_grouped_gemm"``).
  """

  loop: str
  level: str
  size: int
  local_experts: int
  token_levels: tuple[str, ...]
  hidden_levels: tuple[str, ...]
  gathered: tuple[str, ...]
  chunks: int
  exchange: str = "padded"
  gemm: str = "ragged_dot"

  def local_tokens(self, tokens: int, levels: dict) -> int:
    """Tokens one device routes: its stored share, gathered over the ``gathered`` levels, per chunk."""
    split = math.prod(levels[lv] for lv in self.token_levels if lv not in self.gathered)
    return tokens // split // self.chunks

  def slots(self, tokens: int, levels: dict, top_k: int, capacity: int | None) -> int:
    """Rows one device sends to one peer per chunk (padded exchange): at most every local token once per
    local expert it picks, and at most ``capacity`` per expert."""
    n = self.local_tokens(tokens, levels)
    bound = n * min(top_k, self.local_experts)
    if capacity is not None:
      bound = min(bound, self.local_experts * min(capacity, n))
    return max(1, bound)


EXCHANGES = ("padded", "ragged")
BUILTIN_GEMMS = ("ragged_dot", "dense")


def gemms() -> tuple[str, ...]:
  """The grouped GEMMs ``dispatch(gemm=...)`` takes: the built-in ones, then the registered grouped GEMM kernels."""
  return BUILTIN_GEMMS + tuple(registry.grouped_names())


def gemm_problem(gemm: str, mesh) -> str | None:
  """Why ``mesh``'s devices cannot run grouped GEMM ``gemm`` (a built-in one: None)."""
  return None if gemm in BUILTIN_GEMMS else registry.grouped(gemm).devices(mesh)


def projections(schedule, d: "Dispatch") -> dict[str, tuple[int, int]]:
  """The expert FFN's three grouped GEMMs on one device, ``name -> (k, n)`` of ``rows [m, k] @ w[e] [k, n]``."""
  w = work(schedule, d)
  return {"gate": (w["model"], w["width"]), "up": (w["model"], w["width"]), "down": (w["width"], w["model"])}


def gemm_fallback(schedule, d: "Dispatch") -> dict[str, str]:
  """Per projection whose shapes or dtype a grouped GEMM kernel cannot compute, why: those run
  ``jax.lax.ragged_dot`` instead (empty for the built-in GEMMs and where the kernel computes all three)."""
  if d.gemm in BUILTIN_GEMMS:
    return {}
  k = registry.grouped(d.gemm)
  dtype = schedule.program.buffer(schedule.program.routing.routed[0]).dtype
  out = {}
  for name, (kk, nn) in projections(schedule, d).items():
    if reason := k.problem(kk, nn, dtype, k.configure()):
      out[name] = reason
  return out


def of(schedule, plan=None, *, complete: bool = True) -> Dispatch | None:
  """The schedule's ``Dispatch`` (None where it has none); ``PreconditionError`` where its layouts do not fit.

  ``complete=False`` (a primitive's validation) lets the routed inputs' tokens be split over other levels than
  the output's, or in another order, as between two ``shard`` calls; the lowering needs them equal.
  """
  opts = schedule.dispatched
  if opts is None:
    return None
  plan = plan if plan is not None else schedule.plan()
  prog, routing = schedule.program, schedule.program.routing
  where = f"dispatch({opts['loop']!r})"
  if schedule.lowering is not None:
    raise PreconditionError(f"{where}: the schedule is lowered with {schedule.lowering!r}; the routed exchange "
                            f"is its own lowering")
  if schedule.kernel not in (None, "xla"):
    raise PreconditionError(f"{where}: the block is patched with {schedule.kernel!r}; a dispatched schedule "
                            f"computes its rows with its grouped GEMM (dispatch(gemm=...))")
  lp = schedule.loop(opts["loop"])
  storage = plan.storage

  def split_only(name, allowed: dict):
    for a, levels in zip(prog.buffer(name).axes, storage[name]):
      if levels and not (a in allowed and set(levels) <= set(allowed[a])):
        raise PreconditionError(f"{where}: {name} is stored split along {a!r} over {'*'.join(levels)}; a "
                                f"dispatched schedule splits {name} only along {sorted(allowed) or 'nothing'}")

  def token_dim(name):
    return prog.buffer(name).axes.index(routing.tokens)

  out = prog.writes.name
  token_levels = tuple(storage[out][token_dim(out)])
  for name in routing.routed:
    if complete and tuple(storage[name][token_dim(name)]) != token_levels:
      raise PreconditionError(f"{where}: {name}'s tokens are split over {storage[name][token_dim(name)]}, the "
                              f"output's over {token_levels}: a dispatch returns each row to where its token is")
  if lp.level not in token_levels:
    raise PreconditionError(f"{where}: the tokens must be split over the experts' level {lp.level!r}")
  experts = [x for x in schedule.loops if x.axis == routing.experts and x.role == PARALLEL]
  if len(experts) != 1:
    raise PreconditionError(f"{where}: the experts must be spread over exactly one mesh level, not "
                            f"{[x.level for x in experts]}")
  hidden = [x for x in schedule.loops if x.role == PARALLEL and x.axis not in (routing.tokens, routing.experts)]
  hidden_levels = tuple(x.level for x in hidden)
  for x in schedule.loops:
    if x.shifted_by:
      raise PreconditionError(f"{where}: loop {x.name!r} is shifted; a dispatched schedule has no rings")
  if schedule.zigzags:
    raise PreconditionError(f"{where}: a dispatched schedule keeps the tokens in their order (no zigzag)")
  for name in routing.routed + (out,):
    split_only(name, {routing.tokens: tuple(storage[name][token_dim(name)])})
  split_only(routing.router, {})
  for b in prog.reads:
    if b.name not in routing.routed and b.name != routing.router:
      allowed = {routing.experts: (lp.level,)}
      allowed.update({x.axis: (x.level,) for x in hidden if x.axis in b.axes})
      split_only(b.name, allowed)
  chunks = math.prod(x.extent for x in schedule.loops if x.axis == routing.tokens and x.role == SERIAL)
  experts_total = schedule.padded[routing.experts]
  return Dispatch(loop=lp.name, level=lp.level, size=schedule.levels[lp.level],
                  local_experts=experts_total // schedule.levels[lp.level], token_levels=token_levels,
                  hidden_levels=hidden_levels, gathered=tuple(lv for lv in hidden_levels if lv in token_levels),
                  chunks=chunks, exchange=opts["exchange"], gemm=opts["gemm"])


def hidden_width(schedule, d: Dispatch) -> int:
  """One device's share of each expert's hidden width (the loop axes other than the tokens and the experts)."""
  routing = schedule.program.routing
  width = math.prod(schedule.padded[a] for a in schedule.program.kinds if a not in (routing.tokens, routing.experts))
  return width // math.prod(schedule.levels[lv] for lv in d.hidden_levels)


def work(schedule, d: Dispatch) -> dict:
  """What one device does per chunk, for the cost model and the memory estimate (no tracing).

  Returns:
    ``tokens`` routed per chunk, ``rows`` the grouped GEMM computes (the slot buffers' rows; the rows a
    balanced router fills: ``routed``), ``width`` and ``model`` (hidden and model widths), ``exchanged``: bytes
    one all-to-all sends to the other devices.
  """
  prog, routing = schedule.program, schedule.program.routing
  tokens = d.local_tokens(schedule.padded[routing.tokens], schedule.levels)
  slots = d.slots(schedule.padded[routing.tokens], schedule.levels, routing.top_k, routing.capacity)
  model = math.prod(prog.buffer(routing.routed[0]).canonical_shape) // prog.axes[routing.tokens].extent
  routed = tokens * routing.top_k
  if routing.capacity is not None:
    routed = min(routed, d.local_experts * routing.capacity * d.size // (d.chunks * _token_devices(schedule, d)))
  itemsize = prog.buffer(routing.routed[0]).dtype.itemsize
  return dict(tokens=tokens, rows=d.size * slots, routed=routed, width=hidden_width(schedule, d), model=model,
              exchanged=(d.size - 1) * slots * model * itemsize)


def _token_devices(schedule, d: Dispatch) -> int:
  return math.prod(schedule.levels[lv] for lv in d.token_levels if lv not in d.gathered)


def memory_bytes(schedule, d: Dispatch) -> int:
  """Peak bytes one device holds: its stored blocks, the tokens gathered over the hidden-width levels, and per
  chunk the slot buffers both ways and the grouped GEMM's float32 pre-activations and outputs."""
  plan = schedule.plan()
  prog = schedule.program
  total = 0
  for b in prog.reads + (prog.writes,):
    total += b.dtype.itemsize * math.prod(
        schedule.padded.get(a, e) // math.prod(schedule.levels[lv] for lv in levels)
        for a, e, levels in zip(b.axes, b.canonical_shape, plan.storage[b.name]))
  w = work(schedule, d)
  itemsize = prog.writes.dtype.itemsize
  gathered = w["tokens"] * d.chunks * w["model"] * itemsize if d.gathered else 0
  experts = d.local_experts if d.gemm == "dense" else 1
  chunk = w["rows"] * (2 * w["model"] * itemsize + 4 * w["model"] * 2 + experts * 3 * 4 * w["width"])
  if d.gemm not in BUILTIN_GEMMS:  # the kernel's own temporaries, for the projections it computes
    k = registry.grouped(d.gemm)
    chunk += sum(k.memory(w["rows"], kk, nn, d.local_experts, itemsize, k.configure())
                 for name, (kk, nn) in projections(schedule, d).items() if name not in gemm_fallback(schedule, d))
  return total + gathered + chunk + 4 * w["tokens"] * d.chunks * w["model"]
