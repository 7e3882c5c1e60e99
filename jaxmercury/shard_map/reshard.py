"""Moving a local block between two layouts with collectives, inside shard_map.

Per mesh level: a level that leaves one dimension and joins another becomes an
``all_to_all``; one that only leaves becomes an ``all_gather``; one that only
joins becomes a local slice at the rank's offset.
"""

from __future__ import annotations

import dataclasses

import jax

ALL_TO_ALL, ALL_GATHER, SLICE = "all_to_all", "all_gather", "slice"


@dataclasses.dataclass(frozen=True)
class Step:
  """One collective (or local slice) of a layout change."""

  op: str
  level: str
  dim: int  # the dimension gathered (all_gather, all_to_all) or sliced
  to_dim: int | None = None  # all_to_all: the dimension split


def steps(src, dst) -> list[Step]:
  """The steps that turn layout ``src`` into layout ``dst``.

  Layouts give, per dimension, the mesh levels splitting it (major first).
  """
  cur = [list(e) for e in src]
  dst = [tuple(e) for e in dst]
  keep = [_common_prefix(c, d) for c, d in zip(cur, dst)]
  removals = [(dim, lv) for dim in range(len(cur)) for lv in reversed(cur[dim][keep[dim]:])]
  out = []
  for dim, lv in removals:
    target = _next_addition(cur, dst, lv)
    if target is not None and target != dim:
      out.append(Step(ALL_TO_ALL, lv, dim, target))
      cur[target].append(lv)
    else:
      out.append(Step(ALL_GATHER, lv, dim))
    cur[dim].pop()
  for dim, entry in enumerate(dst):
    for lv in entry[len(cur[dim]):]:
      out.append(Step(SLICE, lv, dim))
      cur[dim].append(lv)
  assert [tuple(c) for c in cur] == list(dst), (cur, dst)
  return out


def reshard(x, src, dst):
  """Converts local block ``x`` (inside ``shard_map``) from layout ``src`` to ``dst``."""
  for st in steps(src, dst):
    if st.op == ALL_TO_ALL:
      x = jax.lax.all_to_all(x, st.level, split_axis=st.to_dim, concat_axis=st.dim, tiled=True)
    elif st.op == ALL_GATHER:
      x = jax.lax.all_gather(x, st.level, axis=st.dim, tiled=True)
    else:
      size = x.shape[st.dim] // jax.lax.psum(1, st.level)
      x = jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(st.level) * size, size, st.dim)
  return x


def _common_prefix(a, b):
  n = 0
  while n < min(len(a), len(b)) and a[n] == b[n]:
    n += 1
  return n


def _next_addition(cur, dst, level):
  """The dimension ``level`` should join next, if it can join one now."""
  for dim, entry in enumerate(dst):
    have = cur[dim]
    if len(have) < len(entry) and tuple(have) == entry[:len(have)] and entry[len(have)] == level:
      return dim
  return None
