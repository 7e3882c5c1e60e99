"""What a schedule of packed attention runs for given segment ids: the printout's and the cost model's counts.

Which blocks keep a pair is data: the lowering decides it when running
(``lowering.nest``: a ring runs the shortest prefix of its ``Ring.chain``
that holds every step at which some device's blocks keep a pair; a body
call whose block keeps none computes nothing). ``data_run`` counts the same
from example segment ids on the host: per ring, the steps with kept pairs
and the steps that run; per device, the body calls that compute and the
(query, key) pairs they keep. The cost model prices a schedule on the
program's own sample (``sample_run``: the random packing a tune times it
on).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import numpy as np

from jaxmercury.analysis.plan import body_calls
from jaxmercury.errors import InputError
from jaxmercury.ir.loops import VECTOR
from jaxmercury.kernels.work import Block
from jaxmercury.programs import packing
from jaxmercury.programs.masks import mask_of

AXES = ("b", "i", "j")  # the loop axes whose block starts decide what a body call keeps


@dataclasses.dataclass(frozen=True)
class DataRun:
  """What a schedule runs for some segment ids.

  Attributes:
    kept_steps: per ring whose steps the data decides (``Ring.chain``), the steps at which some device's blocks
      keep a pair, in the chain's order.
    steps: per such ring, the steps that run: the chain's shortest prefix holding ``kept_steps``.
    calls: per device, the body calls whose blocks keep a pair (the others compute nothing).
    pairs: per device, the (query, key) pairs kept, times the query heads: its work.
    computed: per body call (``analysis.plan.body_calls`` over ``AXES``, device-major), whether it keeps a pair.
  """

  kept_steps: dict
  steps: dict
  calls: tuple
  pairs: tuple
  computed: np.ndarray = dataclasses.field(repr=False, compare=False)

  def balance(self) -> float:
    """The busiest device's pairs over the mean (1: even)."""
    return max(self.pairs) / (sum(self.pairs) / len(self.pairs)) if sum(self.pairs) else 1.0


def data_run(schedule, q_segment_ids, kv_segment_ids) -> DataRun:
  """What ``schedule`` (attention with segment ids) runs for these ids (int [batch, q_len], [batch, kv_len])."""
  prog = schedule.program
  mask = mask_of(prog.params)
  if not mask.segment_ids:
    raise InputError(f"{prog.name}: data_run counts the work of segment ids; the program has none")
  qs, ks = np.asarray(q_segment_ids), np.asarray(kv_segment_ids)
  for name, ids, axis in (("q_segment_ids", qs, "i"), ("kv_segment_ids", ks, "j")):
    want = (prog.axes["b"].extent, prog.axes[axis].extent)
    if ids.shape != want:
      raise InputError(f"data_run: {name} has shape {ids.shape}, the program's is {want}")
  if schedule.balanced:  # the ids as the nest sees them: in the balanced order (before its zigzag)
    perm = np.asarray(packing.balanced_order(qs, ks, schedule.zigzags["i"]))
    qs, ks = np.take_along_axis(qs, perm, axis=1), np.take_along_axis(ks, perm, axis=1)
  plan = schedule.plan()
  loops = {lp.name: lp for lp in schedule.loops}
  index, rank, starts = body_calls(schedule, plan.rings, AXES)
  sizes = {a: math.prod(loops[f].extent for f in schedule.factors[a] if loops[f].role == VECTOR)
           for a in prog.axes if a in schedule.factors}
  extents = {a: ax.extent for a, ax in prog.axes.items()}
  cols, inverse = np.unique(np.stack(starts), axis=1, return_inverse=True)
  kept = np.array([_block_pairs(qs, ks, Block(sizes, extents, dict(zip(AXES, map(int, col))), schedule.zigzags),
                                mask.band) for col in cols.T], np.int64)[np.reshape(inverse, -1)]
  per_device = kept.reshape(math.prod(schedule.levels.values()), -1)
  kept_steps, steps = {}, {}
  for name, ring in plan.rings.items():
    if ring.chain is None:
      continue
    step = (index(loops[name]) - rank[ring.level] - ring.offset) % ring.size
    chain = ring.chain_steps()
    held = {int(t) for t in np.unique(step[kept > 0])}
    kept_steps[name] = tuple(t for t in chain if t in held)
    steps[name] = tuple(chain[:max((chain.index(t) + 1 for t in held if t in chain), default=1)])
  heads = sizes["hk"] * sizes["g"]
  return DataRun(kept_steps, steps, tuple(int(c) for c in (per_device > 0).sum(axis=1)),
                 tuple(int(p) * heads for p in per_device.sum(axis=1)), kept > 0)


def _block_pairs(qs, ks, block: Block, band) -> int:
  """The (query, key) pairs one body call's block keeps (every row of its batch block, one head)."""
  rows = range(block.starts["b"], min(block.starts["b"] + block.sizes["b"], qs.shape[0]))
  q = np.concatenate([np.arange(lo, min(hi, block.extents["i"])) for lo, hi in block.ranges("i")])
  k = np.concatenate([np.arange(lo, min(hi, block.extents["j"])) for lo, hi in block.ranges("j")])
  if not len(q) or not len(k):
    return 0
  return int(sum(packing.kept_pairs(qs[r, q], q, ks[r, k], k, band).sum() for r in rows))


def sample_run(schedule) -> DataRun | None:
  """``data_run`` on the program's own sample of segment ids (the random packing ``Program.random_inputs``
  draws: what a tune times), or None for a program without segment ids."""
  prog = schedule.program
  if not mask_of(prog.params).segment_ids:
    return None
  qs, ks = _sample(prog.axes["b"].extent, prog.axes["i"].extent, prog.axes["j"].extent)
  return data_run(schedule, qs, ks)


@functools.lru_cache(maxsize=32)
def _sample(batch: int, q_len: int, kv_len: int):
  """A fixed random packing (``packing.random_packing``) of each length, as the programs' ``sample`` draws it."""
  key = jax.random.key(0)
  qs = np.asarray(packing.random_packing(key, batch, q_len))
  return qs, qs if kv_len == q_len else np.asarray(packing.random_packing(jax.random.fold_in(key, 1), batch, kv_len))


def data_path(schedule) -> str:
  """What a schedule does with an attention's segment ids besides masking, in words for ``jm.explain`` (``""``:
  nothing, or not a schedule)."""
  if not hasattr(schedule, "plan") or not mask_of(schedule.program.params).segment_ids:
    return ""
  rings = any(r.chain is not None for r in schedule.plan().rings.values())
  skips = f"skips {'ring steps and ' if rings else ''}blocks by segment ids"
  return f"balanced rows; {skips}" if schedule.balanced else skips
