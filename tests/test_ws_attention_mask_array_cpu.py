"""The warp-specialized attention kernels with mask arrays (``mask=``) without a GPU.

The per-call tile kinds and key tile lists (``ws_mask``) against brute force on the host; the forward
(``ws_forward``) and the one-pass backward (``ws_backward``) in Mosaic GPU interpret mode on one device against a
float32 reference (``packed_checks``), for random masks whose 64 x 64 blocks are hidden, kept whole or mixed (some
rows keeping no key), broadcast over batch, heads, both or neither, with causal, a window and segment ids; the
cases pairwise over those choices on the smallest shapes that run several items per CTA. Then ``ws_attention`` in a
schedule of a ``mask=`` program (forward and gradients), the tuner's offer, and lowering for an abstract H100 at
real sizes (Mosaic GPU's own passes: the mask bytes' TMA copies and their WGMMA-layout loads).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import fresh_key, h100_mesh, lower_for_gpus, mosaic_kernels, rel_err
from jax.sharding import AxisType
from packed_checks import (
  GRAD_TOL,
  assert_forward,
  assert_grads,
  inputs,
  keep_mask,
  mask_array,
  reference_grads,
  segment_ids,
)

import jaxmercury as jm
from jaxmercury.kernels import registry
from jaxmercury.kernels.attention import ws, ws_backward, ws_mask
from jaxmercury.kernels.attention.ws_backward import attention_backward_ws
from jaxmercury.kernels.attention.ws_forward import fused_ring_attention_ws

# ------------------------------------------------------------------ the kinds and lists, on the host


@pytest.mark.parametrize("causal,window,offset", [(True, None, 0), (False, (100, 20), -64)])
def test_kinds_and_lists_hold_every_kept_pair(causal, window, offset):
  """A tile the kinds call hidden keeps no pair, one they call full keeps all; every tile with a kept pair is in
  its row group's list, the lists ascending; ``list_ranges`` cuts them to a range of tiles."""
  s, rows, cols = 512, 64, 128
  mask = mask_array(2, 1, s, s)
  keep = mask & keep_mask(None, None, causal=causal, window=window, offset=offset, s_q=s, s_kv=s)[:, None]
  masking = ws_mask.Masking.make(causal, window, False, True)
  summary = ws_mask.summaries(masking, None, None, offset, True, (2, s, s), rows)[:1]
  kinds = np.asarray(ws_mask.mask_kinds(summary, jnp.asarray(mask), rows, cols))
  tiles, count = (np.asarray(x) for x in ws_mask.tile_lists(jnp.asarray(kinds), 2))
  assert kinds.shape == (2, 1, s // rows, s // cols)
  for b in range(2):
    for t in range(s // rows):
      listed = tiles[b, 0, t // 2, :count[b, 0, t // 2]]
      assert np.all(np.diff(listed) > 0)
      for u in range(s // cols):
        pairs = keep[b, 0, t * rows:(t + 1) * rows, u * cols:(u + 1) * cols]
        assert kinds[b, 0, t, u] != ws_mask.HIDDEN or not pairs.any()
        assert kinds[b, 0, t, u] != ws_mask.FULL or pairs.all()
        assert not pairs.any() or u in listed
  first, n = (np.asarray(x) for x in ws_mask.list_ranges(jnp.asarray(tiles), jnp.asarray(count), 1, 3))
  for b, pair in np.ndindex(2, s // rows // 2):
    listed = tiles[b, 0, pair, :count[b, 0, pair]]
    assert list(listed[first[b, 0, pair]:first[b, 0, pair] + n[b, 0, pair]]) == [u for u in listed if 1 <= u < 3]


# ------------------------------------------------------------------ the kernels in interpret mode


@dataclasses.dataclass(frozen=True)
class Case:
  """One kernel run: the mask's batch and head sizes (1: broadcast), the other masks, the shapes and tiles."""

  broadcast: str  # "none", "batch", "heads", "both": the axes the mask array broadcasts over
  causal: bool
  window: tuple | None
  ids: str | None  # segment_ids' kind (packed_checks.segment_ids), or None
  gqa: bool
  d: int


# Every broadcast (the mask's own batch and heads, one of them, neither) with causal, a causal window and segment
# ids (with and without a band), GQA and MHA, head dimensions 64 (keys in tiles of 128) and 128 (three slots of
# 64): the fewest runs that meet each choice once and the kernels' two mask-tile shapes.
FORWARD = [Case("none", True, None, None, True, 64), Case("batch", False, None, "packed", False, 128),
           Case("both", True, (96, 0), None, True, 64)]
BACKWARD = [Case("heads", True, None, None, True, 64), Case("batch", False, None, "packed", False, 128)]


def _case_inputs(case: Case, b: int = 2, s: int = 256):
  """``(q, k, v, do, mask, q_ids, kv_ids, keep)`` of a case: fresh inputs, its mask array, the pairs kept."""
  h, kv = (4, 2) if case.gqa else (2, 2)
  q, k, v, do = inputs(b, s, h, kv, case.d)
  mb = 1 if case.broadcast in ("batch", "both") else b
  mh = 1 if case.broadcast in ("heads", "both") else h
  mask = mask_array(mb, mh, s, s)
  q_ids, kv_ids = segment_ids(case.ids, b, s) if case.ids else (None, None)
  positions = keep_mask(q_ids, kv_ids, causal=case.causal, window=case.window, s_q=s, s_kv=s)
  return q, k, v, do, jnp.asarray(mask), q_ids, kv_ids, mask & positions[:, None]


@pytest.mark.parametrize("case", FORWARD, ids=str)
def test_forward_matches_the_reference(case):
  q, k, v, _, mask, q_ids, kv_ids, keep = _case_inputs(case)
  block_kv = 64 if case.d == 128 else 128
  run = functools.partial(fused_ring_attention_ws, causal=case.causal, window=case.window, block_kv=block_kv,
                          max_concurrent_steps=3 if block_kv == 64 else 2, num_ctas=3, interpret=True)
  out, lse = jax.jit(lambda q, k, v, m, a, c: run(q, k, v, None, mask=m, q_segment_ids=a, kv_segment_ids=c))(
      q, k, v, mask, q_ids, kv_ids)
  assert_forward(out, lse, q, k, v, keep)


@pytest.mark.parametrize("case", BACKWARD, ids=str)
def test_backward_matches_the_reference(case):
  q, k, v, do, mask, q_ids, kv_ids, keep = _case_inputs(case)
  want, (out, lse) = reference_grads(q, k, v, do, keep)
  run = functools.partial(attention_backward_ws, causal=case.causal, window=case.window, interpret=True)
  got = jax.jit(lambda q, k, v, o, do, lse, m, a, c: run(q, k, v, o, do, lse, mask=m, q_segment_ids=a,
                                                         kv_segment_ids=c))(
      q, k, v, out.astype(q.dtype), do, lse, mask, q_ids, kv_ids)
  assert_grads(got, want)
  unkept = ~np.asarray(keep).any(axis=(0, 1, 2))  # keys no query of any head keeps get no gradient
  assert not np.any(np.asarray(got[1], np.float32)[:, unkept]) and not np.any(np.asarray(got[2], np.float32)[:, unkept])


def test_bad_masks_are_named():
  q = jax.ShapeDtypeStruct((2, 256, 2, 64), jnp.bfloat16)
  with pytest.raises(jm.errors.PreconditionError, match=r"mask must be a boolean array \[b or 1, h or 1, s_q, s_kv\]"):
    jax.eval_shape(lambda q, m: fused_ring_attention_ws(q, q, q, None, mask=m, interpret=True), q,
                   jax.ShapeDtypeStruct((3, 1, 256, 256), jnp.bool_))
  with pytest.raises(jm.errors.PreconditionError, match=r"mask must be a boolean array .* got \(1, 256, 256\)"):
    jax.eval_shape(lambda q, m: attention_backward_ws(q, q, q, q, q, jnp.zeros((2, 2, 256)), mask=m, interpret=True),
                   q, jax.ShapeDtypeStruct((1, 256, 256), jnp.bool_))


# ------------------------------------------------------------------ ws_attention in schedules


def test_schedules_run_masks_on_the_kernels(monkeypatch):
  """One device, Explicit axes inside ``jax.set_mesh``: a causal program with a mask over heads and positions
  (``mask_axes=("h", "i", "j")``: broadcast over the batch) through ``ws_attention``: the kernels' masked path
  (not the program's body) forward and backward, against the float32 reference."""
  mesh = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:1])
  prog, f32 = (jm.programs.attention(2, 2, 1, 128, 128, 64, dtype=dtype, causal=True, mask_axes=("h", "i", "j"))
               for dtype in (jnp.bfloat16, jnp.float32))
  calls = []
  for name in ("masked_forward", "masked_backward"):
    real = getattr(ws, name)
    monkeypatch.setattr(ws, name, lambda *a, name=name, real=real, **k: calls.append(name) or real(*a, **k))
  q, k, v = (jax.random.normal(fresh_key(), r.shape, jnp.float32).astype(r.dtype) for r in prog.reads[:3])
  xs = (q, k, v, jnp.asarray(mask_array(1, 2, 128, 128)[0]))
  cot = jax.random.normal(fresh_key(), prog.writes.shape)
  f32_inputs = lambda xs: [x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x for x in xs]
  with registry.interpret_mode(), jax.set_mesh(mesh):
    s = jm.Schedule(prog, mesh).patch("ws_attention")
    run = s.compile()
    assert rel_err(run(*xs).astype(jnp.float32), f32.reference(*f32_inputs(xs))) < GRAD_TOL
    loss = lambda f, cast: lambda q, k, v: jnp.sum(f(*cast((q, k, v)), xs[3]).astype(jnp.float32) * cot)
    got = jax.jit(jax.grad(loss(run, list), argnums=(0, 1, 2)))(*xs[:3])
    want = jax.grad(loss(f32.reference, f32_inputs), argnums=(0, 1, 2))(*xs[:3])
  assert_grads(got, want)
  assert set(calls) == {"masked_forward", "masked_backward"}


@pytest.mark.parametrize("array", [False, True], ids=["segment_ids", "mask_array"])
def test_backward_table_has_the_grid_items_past_a_chunk(array):
  """Past ``CHUNK_ROWS`` queries the masked path's table of items (``_masked_inputs``) holds exactly the kernel's
  grid of items (``_Plan``): both chunk the queries alike (the table once chunked them as an unmasked call)."""
  b, s, h, kv, d = 1, 2 * ws_backward.CHUNK_ROWS, 2, 1, 64
  sds = jax.ShapeDtypeStruct
  q, k = sds((b, s, h, d), jnp.bfloat16), sds((b, s, kv, d), jnp.bfloat16)
  ids, mask = sds((b, s), jnp.int32), sds((1, 1, s, s), jnp.bool_) if array else None
  masking, blocks = ws_mask.Masking.make(True, None, True, array), ws_backward.BackwardBlocks()
  extras = jax.eval_shape(lambda q, k, ids, m: ws_backward._masked_inputs(q, k, blocks, masking, ids, ids, 0, m),
                          q, k, ids, mask)
  assert extras[0].shape[0] == ws_backward._Plan.make(q, k, False, blocks, True, masking).grid


def test_offered_for_mask_arrays_once_trusted():
  """``ws_attention`` applies to mask arrays (with causal, a window, segment ids) on GPUs beside cuDNN with a bias
  and XLA; the tuner offers it there once its mask arrays have run on a GPU (``unverified_masks``), and for
  segment ids now."""
  ws = registry.local("ws_attention")
  for mask in (dict(mask=True), dict(mask_axes=("h", "i", "j"), causal=True),
               dict(mask=True, segment_ids=True, window=(64, 0), causal=True)):
    prog = jm.programs.attention(1, 8, 2, 4096, 4096, 128, dtype=jnp.bfloat16, **mask)
    assert ws.why_not(prog, h100_mesh(1)) is None and "not yet run on a GPU" in ws.untrusted(prog), mask
    assert {"xla", "cudnn_attention"} <= set(registry.candidates(prog, h100_mesh(1))), mask
    trusted = dataclasses.replace(ws, unverified_masks=frozenset())
    assert trusted.untrusted(prog) is None
  ids = jm.programs.attention(1, 8, 2, 4096, 4096, 128, dtype=jnp.bfloat16, segment_ids=True, causal=True)
  assert "ws_attention" in registry.candidates(ids, h100_mesh(1))


# ------------------------------------------------------------------ lowering for an abstract H100 (no GPU)


@pytest.mark.parametrize("kernel", ["forward", "backward"])
def test_lowers_for_an_h100_at_real_sizes(kernel):
  """B1 H32 KV8 D128 S4K, a causal mask over heads at the default tiles: Mosaic GPU's own passes accept each
  kernel (the mask bytes' TMA copies beside K or Q, their loads in the scores' layout, the shared memory)."""
  sds = jax.ShapeDtypeStruct
  q, k = sds((1, 4096, 32, 128), jnp.bfloat16), sds((1, 4096, 8, 128), jnp.bfloat16)
  mask = sds((1, 32, 4096, 4096), jnp.bool_)
  if kernel == "forward":
    run = lambda q, k, v, m: fused_ring_attention_ws(q, k, v, None, causal=True, mask=m)
    args = (q, k, k, mask)
  else:
    run = lambda q, k, v, o, do, lse, m: attention_backward_ws(q, k, v, o, do, lse, causal=True, mask=m)
    args = (q, k, k, q, q, sds((1, 32, 4096), jnp.float32), mask)
  assert mosaic_kernels(lower_for_gpus(run, *args, mesh=h100_mesh(1))) == 1
