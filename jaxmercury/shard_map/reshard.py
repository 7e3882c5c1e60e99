"""Moving a local block between two layouts with collectives, inside shard_map.

Per mesh level: a level that leaves one dimension and joins another becomes an
``all_to_all``; one that only leaves becomes an ``all_gather``; one that only
joins becomes a local slice at the rank's offset.
"""

from __future__ import annotations

import jax


def reshard(x, src, dst):
  """Converts local block ``x`` from layout ``src`` to layout ``dst``.

  Args:
    x: the local block (inside ``shard_map``).
    src: the layout ``x`` has: per dimension, the mesh levels splitting it.
    dst: the layout wanted.

  Returns:
    The local block in layout ``dst``.
  """
  cur = [list(e) for e in src]
  dst = [tuple(e) for e in dst]
  keep = [_common_prefix(c, d) for c, d in zip(cur, dst)]
  removals = [(dim, lv) for dim in range(len(cur)) for lv in reversed(cur[dim][keep[dim]:])]
  for dim, lv in removals:
    target = _next_addition(cur, dst, lv)
    if target is not None and target != dim:
      x = jax.lax.all_to_all(x, lv, split_axis=target, concat_axis=dim, tiled=True)
      cur[target].append(lv)
    else:
      x = jax.lax.all_gather(x, lv, axis=dim, tiled=True)
    cur[dim].pop()
  for dim, entry in enumerate(dst):
    for lv in entry[len(cur[dim]):]:
      n = jax.lax.psum(1, lv)
      size = x.shape[dim] // n
      x = jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(lv) * size, size, dim)
      cur[dim].append(lv)
  assert [tuple(c) for c in cur] == dst, (cur, dst)
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
