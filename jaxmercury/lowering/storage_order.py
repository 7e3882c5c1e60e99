"""Moving a sharded zigzag axis between true and storage order, chunk by chunk between devices.

An axis split over ``n`` devices in ``c`` chunks (``k = c / n`` per device)
is reordered by sending each local chunk straight to the device and slot
its new position names, in ``k`` rounds of one ``ppermute`` each (every
device sends one chunk and receives one per round). The whole array is
never gathered: each chunk travels at most once, and chunks that stay on
their device do not travel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from jaxmercury.ir import orders
from jaxmercury.ir.loops import spec_levels


def zigzag_moves(chunks: int, to_storage: bool) -> np.ndarray:
  """``dest[i]``: the chunk position that the chunk at position ``i`` moves to."""
  true_of_stored = np.array([orders.zigzag_chunk(s, chunks) for s in range(chunks)])
  return np.argsort(true_of_stored) if to_storage else true_of_stored


def _matching(edges: list[list[int]], devices: int) -> list[int]:
  """A perfect matching sender -> one of its remaining edges' indices (Kuhn's augmenting paths)."""
  owner = [-1] * devices  # receiver -> sender
  pick = [-1] * devices  # sender -> edge index

  def augment(e, seen):
    for i, (r, _) in enumerate(edges[e]):
      if r not in seen:
        seen.add(r)
        if owner[r] < 0 or augment(owner[r], seen):
          owner[r], pick[e] = e, i
          return True
    return False

  for e in range(devices):
    augment(e, set())
  return pick


def routes(dest: np.ndarray, devices: int):
  """Rounds of one ``ppermute`` each that move every chunk to ``dest``.

  Every device sends ``k = len(dest) / devices`` chunks and receives ``k``:
  a regular bipartite multigraph, which splits into ``k`` perfect matchings
  (König), one ``ppermute`` per matching.

  Args:
    dest: a permutation of chunk positions (``zigzag_moves``).
    devices: how many devices hold contiguous blocks of ``len(dest) / devices`` chunks.

  Returns:
    ``(pairs, send, order)``: ``pairs[i]`` the ``(source, destination)``
    devices of round ``i``; ``send[i, e]`` the local slot device ``e`` sends
    in round ``i``; ``order[r, s]`` the round whose arrival fills slot ``s``
    of device ``r``. None where the chunks do not divide evenly.
  """
  chunks = len(dest)
  if chunks % devices:
    return None
  k = chunks // devices
  edges = [[(int(dest[e * k + j]) // k, j) for j in range(k)] for e in range(devices)]
  pairs, send, order = [], np.zeros((k, devices), np.int32), np.zeros((devices, k), np.int32)
  for i in range(k):
    pick = _matching(edges, devices)
    round_pairs = []
    for e in range(devices):
      r, j = edges[e].pop(pick[e])
      round_pairs.append((e, r))
      send[i, e] = j
      order[r, int(dest[e * k + j]) % k] = i
    pairs.append(round_pairs)
  return pairs, send, order


def sharded_levels(spec: PartitionSpec, dim: int) -> tuple[str, ...]:
  """The mesh levels that split dimension ``dim`` under ``spec`` (major first)."""
  return spec_levels(spec[dim] if dim < len(spec) else None)


def exchange(x, dim: int, levels: tuple[str, ...], plan):
  """Per device (inside ``shard_map``): this device's block of ``x`` in the new order along ``dim``."""
  pairs, send, order = plan
  k = order.shape[1]
  me = lax.axis_index(levels)
  local = jnp.stack(jnp.split(x, k, axis=dim))
  arrived = []
  for i, round_pairs in enumerate(pairs):
    chunk = jnp.take(local, jnp.asarray(send[i])[me], axis=0)
    moves = any(src != dst for src, dst in round_pairs)
    arrived.append(lax.ppermute(chunk, levels, round_pairs) if moves else chunk)
  placed = jnp.take(jnp.stack(arrived), jnp.asarray(order)[me], axis=0)
  return jnp.concatenate([placed[s] for s in range(k)], axis=dim)


def reorder(x, mesh, spec: PartitionSpec, dim: int, chunks: int, to_storage: bool):
  """``x`` (global, laid out as ``spec``) with axis ``dim`` moved to zigzag storage order or back.

  Returns None where the axis is not split over devices in whole chunks
  (the caller then permutes the whole array).
  """
  levels = sharded_levels(spec, dim)
  if not levels:
    return None
  devices = int(np.prod([mesh.shape[a] for a in levels]))
  plan = routes(zigzag_moves(chunks, to_storage), devices)
  if plan is None:
    return None
  return jax.shard_map(lambda b: exchange(b, dim, levels, plan), mesh=mesh, in_specs=(spec,), out_specs=spec,
                       check_vma=False)(x)
