"""Kernel ``cudnn_packed`` on CPU: segment ids as cuDNN's packed layout, its refusals, and its blocks with cuDNN
stood in (``cudnn_packed_standin``: XLA code of JAX's documented packed layout) against the reference.

cuDNN's packed layout itself runs only on Hopper GPUs (``tests/gpu/test_cudnn_packed.py``)."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import fresh_key, make_mesh, rel_err
from cudnn_packed_standin import cpu_packed  # noqa: F401  (a fixture)
from jax.sharding import AxisType

import jaxmercury as jm
from jaxmercury.errors import PreconditionError
from jaxmercury.kernels.attention import cudnn_packed as cp
from jaxmercury.kernels.attention import packed_segments as ps


# ------------------------------------------------------------------ segment ids -> segments (offsets, lengths)
def _runs(row):
  """[(id, start, length)] of a row's runs of equal ids (NumPy)."""
  cuts = [0] + [p for p in range(1, len(row)) if row[p] != row[p - 1]] + [len(row)]
  return [(int(row[a]), a, b - a) for a, b in zip(cuts[:-1], cuts[1:])]


def _expected(q_row, kv_row):
  """Segments of one row (NumPy): per query run whose id has a key run, (q start, q len, kv start, kv len), in
  query order."""
  keys = {i: (s, n) for i, s, n in _runs(kv_row)}
  return [(s, n, *keys[i]) for i, s, n in _runs(q_row) if i in keys]


def _packing(rng, n, *, shuffled, padded):
  """A row of documents of random lengths (1 to n / 3), ids shuffled or in order, the tail padding (-1) or not."""
  ids, at, doc = np.zeros(n, np.int32), 0, 0
  while at < n:
    length = int(rng.integers(1, n // 3 + 1))
    ids[at:at + length] = doc
    at, doc = at + length, doc + 1
  if shuffled:
    ids = rng.permutation(doc + 5)[ids].astype(np.int32)
  if padded:
    ids[n - int(rng.integers(1, n // 4)):] = -1
  return ids


@pytest.mark.parametrize("aligned", [True, False], ids=["diagonal", "apart"])
def test_segments_of_random_packings(aligned):
  """Random rows (ids in and out of order, padded tails); on the diagonal the keys' ids are the queries', else a
  key block of other positions sharing some documents (an earlier block of the same row)."""
  rng = np.random.default_rng(int(jax.random.randint(fresh_key(), (), 0, 2**30)))
  n, rows = 48, 12
  q = np.stack([_packing(rng, n, shuffled=r % 2 == 1, padded=r % 3 == 0) for r in range(rows)])
  if aligned:
    kv = q.copy()
  else:  # the row's 48 positions before: its first query document continues from them
    kv = np.stack([np.concatenate([_packing(rng, n // 2, shuffled=True, padded=False) + 100, np.full(n // 2, r[0])])
                   for r in q])
  segs = jax.jit(ps.segments, static_argnames="aligned")(jnp.asarray(q), jnp.asarray(kv), aligned=aligned)
  assert not np.any(segs.conflict)
  for r in range(rows):
    want = _expected(q[r], kv[r])
    count = int(segs.count[r])
    got = list(zip(*(np.asarray(x[r, :count]).tolist() for x in (segs.q_start, segs.q_len, segs.kv_start,
                                                                   segs.kv_len))))
    assert got == want, (q[r], kv[r])
    for c, (qs, ql, ks, kl) in enumerate(want):  # each position's segment, -1 outside every one
      assert np.all(np.asarray(segs.q_seg[r, qs:qs + ql]) == c) and np.all(np.asarray(segs.kv_seg[r, ks:ks + kl]) == c)
    assert np.sum(np.asarray(segs.q_seg[r]) >= 0) == sum(s[1] for s in want)
    assert np.sum(np.asarray(segs.kv_seg[r]) >= 0) == sum(s[3] for s in want)


def test_waves_take_every_segment_once_in_the_packed_layout():
  """With M = 3, rows of 8, 2 and 0 segments: 3 waves, each row's tables JAX's layout (-1 past its last)."""
  q = jnp.asarray(np.stack([np.repeat(np.arange(8), 3), np.repeat([5, 9], 12), np.full(24, 7)]))
  kv = jnp.asarray(np.stack([np.repeat(np.arange(8), 3), np.repeat([5, 9], 12), np.full(24, 8)]))
  segs = ps.segments(q, kv, aligned=True)
  assert int(ps.waves(segs, 3)) == 3
  seen = []
  for w in range(3):
    q_len, kv_len, q_off, kv_off = (np.asarray(x) for x in ps.table(segs, w, 3))
    assert q_len.shape == (3, 3) and q_off.shape == (3, 4) and np.all(q_off[:, -1] == -1)
    assert np.array_equal(q_len < 0, q_off[:, :3] < 0) and np.array_equal(q_len, kv_len)
    seen += [(r, int(o)) for r in range(3) for o in q_off[r, :3] if o >= 0]
  assert sorted(seen) == [(0, 3 * c) for c in range(8)] + [(1, 0), (1, 12)]


@pytest.mark.parametrize(("q_row", "aligned"), [
    ([0, 0, 1, 1, 0, 0, 2, 2], False),  # id 0 in two runs
    ([0, 0, 1, 1, 1, 2, 2, 2], True),  # on the diagonal, the keys below: id 1 starts apart
], ids=["reused-id", "diagonal-apart"])
def test_ids_that_are_not_runs_are_conflicts(q_row, aligned):
  kv_row = [0, 0, 1, 1, 1, 1, 2, 2] if aligned else q_row
  segs = ps.segments(jnp.asarray([q_row, [3] * 8]), jnp.asarray([kv_row, [3] * 8]), aligned=aligned)
  assert np.asarray(segs.conflict).tolist() == [True, False]


# ------------------------------------------------------------------ applicability
def _prog(**kw):
  return jm.programs.attention(1, 4, 2, 64, 64, 16, **{"causal": True, "segment_ids": True, "dtype": jnp.bfloat16,
                                                        **kw})


@pytest.mark.parametrize(("kw", "words"), [
    ({"segment_ids": False}, "without them 'cudnn_attention' applies"),
    ({"window": (4, 4), "causal": False}, "sliding window (left, 0) with the causal mask only"),
    ({"dtype": jnp.float32}, "kernel accepts ['bfloat16', 'float16']"),
    ({}, "gpu"),  # the right program on the CPU mesh: the platform
])
def test_refusals_name_the_problem(kw, words):
  s = jm.library(_prog(**kw), make_mesh("8"))["ring"]
  with pytest.raises(PreconditionError, match=r"patch\('cudnn_packed'\)") as e:
    s.patch("cudnn_packed")
  assert words in str(e.value)


def test_refuses_gpus_before_hopper_and_configs_below_two_documents():
  ampere = types.SimpleNamespace(compute_capability="8.0", device_kind="NVIDIA A100")
  assert "9.0 (Hopper) or newer" in cp._device_problem(ampere) and "8.0" in cp._device_problem(ampere)
  assert cp._device_problem(types.SimpleNamespace(compute_capability="9.0", device_kind="NVIDIA H200")) is None
  assert "NVIDIA GPU" in cp._device_problem(jax.devices()[0])
  with pytest.raises(ValueError, match="max_documents must be an int of at least 2"):
    cp.PackedConfig(max_documents=1)


# ------------------------------------------------------------------ its blocks, cuDNN stood in
def _check(schedule, xs, tol=1e-4):
  """Forward and gradients of a weighted sum against the program's reference."""
  prog = schedule.program
  f = schedule.compile()
  w = jax.random.normal(fresh_key(), prog.writes.shape)
  loss = lambda fn: (lambda q, k, v: jnp.sum(w * fn(q, k, v, *xs[3:])))
  assert rel_err(f(*xs), prog.reference(*xs)) < tol
  got = jax.grad(loss(f), argnums=(0, 1, 2))(*xs[:3])
  want = jax.grad(loss(prog.reference), argnums=(0, 1, 2))(*xs[:3])
  for g, r in zip(got, want):
    assert rel_err(g, r) < tol


def test_ring_blocks_in_waves(cpu_packed):  # noqa: F811
  """The causal ring on 2 devices, M = 2: the earlier block unmasked (padding mask only), diagonal blocks causal,
  the second device's in two waves (three documents: ids out of order, the last a padding id); a document across
  the devices' boundary, so that the ring runs its second step."""
  prog = jm.programs.attention(1, 2, 1, 32, 32, 8, causal=True, segment_ids=True)
  mesh = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Auto,))
  s = jm.library(prog, mesh)["ring"].patch("cudnn_packed", max_documents=2)
  cut = int(jax.random.randint(fresh_key(), (), 2, 14))
  ids = jnp.asarray([[7] * cut + [3] * (24 - cut) + [5] * 4 + [-1] * 4])
  _check(s, (*prog.random_inputs(fresh_key())[:3], ids, ids))
  assert set(cpu_packed) == {f"{p} {k}" for p in ("forward", "backward") for k in ("causal", "padding")}


def test_ids_that_are_not_runs_are_refused_when_running(cpu_packed):  # noqa: F811
  prog = jm.programs.attention(1, 4, 2, 16, 16, 16, causal=True, segment_ids=True)
  ids = jnp.asarray([[0] * 4 + [1] * 4 + [0] * 4 + [2] * 4])
  f = jm.library(prog, jax.make_mesh((1,), ("x",)))["ulysses"].patch("cudnn_packed").compile()
  with pytest.raises(Exception, match="segment ids of batch rows \\[0\\] are not runs"):
    jax.block_until_ready(f(*prog.random_inputs(fresh_key())[:3], ids, ids))
