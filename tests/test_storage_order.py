"""Zigzag storage order between devices: chunk exchanges, never a whole-array gather or all-reduce."""

import re

import pytest
from conftest import fresh_key, make_mesh, rel_err, tolerance

import jaxmercury as jm
from jaxmercury.lowering import storage_order


def _apply(dest, plan, devices):
  """Moves chunk ids as ``exchange`` would, round by round; returns the chunk ids per position."""
  pairs, send, order = plan
  k = len(dest) // devices
  held = [[e * k + j for j in range(k)] for e in range(devices)]
  placed = [[None] * k for _ in range(devices)]
  for i, round_pairs in enumerate(pairs):
    assert sorted(dst for _, dst in round_pairs) == list(range(devices))  # one ppermute: a permutation
    arrivals = {dst: held[src][send[i, src]] for src, dst in round_pairs}
    for r in range(devices):
      placed[r][list(order[r]).index(i)] = arrivals[r]
  return [c for block in placed for c in block]


@pytest.mark.parametrize("devices", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("to_storage", [True, False], ids=["to_storage", "to_true"])
def test_routes_put_every_chunk_where_the_zigzag_order_says(devices, to_storage):
  for chunks in (2 * devices, 4 * devices):
    dest = storage_order.zigzag_moves(chunks, to_storage)
    at = _apply(dest, storage_order.routes(dest, devices), devices)
    assert all(at[dest[p]] == p for p in range(chunks)), (chunks, at)


def test_routes_refuse_chunks_that_do_not_divide():
  assert storage_order.routes(storage_order.zigzag_moves(6, True), 4) is None


@pytest.mark.parametrize("mesh_name", ["8", "2x4"])
def test_zigzag_schedule_moves_chunks_by_ppermute_only(mesh_name):
  """Before, XLA lowered the whole-array permutation to an all-reduce (Auto axes) or an all-gather (Explicit)."""
  prog = jm.programs.attention(1, 4, 2, 64, 64, 8, causal=True)
  f = jm.library(prog, make_mesh(mesh_name))["ring_zigzag"].compile(differentiable=False)
  xs = prog.random_inputs(fresh_key())
  assert rel_err(f(*xs), prog.reference(*xs)) < tolerance(prog.writes.dtype)
  hlo = f.lower(*xs).compile().as_text()
  assert not re.findall(r" (all-gather|all-reduce|all-to-all)(-start)?\(", hlo)
  # the ring's 7 steps for K and V, and two rounds each for q, k, v and the output
  assert len(re.findall(r" collective-permute(-start)?\(", hlo)) == 2 * 7 + 4 * 2
