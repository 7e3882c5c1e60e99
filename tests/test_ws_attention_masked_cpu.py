"""The warp-specialized attention kernels' masked path (segment ids, sliding windows) without a GPU.

The forward (``ws_forward``) and the one-pass backward (``ws_backward``) run in Mosaic GPU interpret mode on one
device against a float32 reference (``packed_checks.attention``; in schedules, the program's own reference):
random packings, documents shorter than a tile and longer than an item's rows, rows that keep no key (``out = 0``,
``lse = -inf``, no gradient), ids reused at random places (no id's positions consecutive: only the in-tile compare
is exact), causal and windows with and without ids, at a block's offset (a ring step's block), MHA and GQA. The
cases are pairwise over those choices, on the smallest shapes that run several items per CTA and several tiles per
item. The ``ws_mask`` summaries are checked against brute force on the host; the kernels lower for an abstract
H100 at the real sizes (S32K, D128, default tiles): Mosaic GPU's own layout and shared-memory passes.
"""

import contextlib
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
  reference_grads,
  segment_ids,
)

import jaxmercury as jm
from jaxmercury.errors import PreconditionError
from jaxmercury.kernels import registry
from jaxmercury.kernels.attention import ws, ws_mask
from jaxmercury.kernels.attention.ws_backward import attention_backward_ws
from jaxmercury.kernels.attention.ws_forward import fused_ring_attention_ws

# ------------------------------------------------------------------ the summaries, on the host


@pytest.mark.parametrize("kind,causal,window,offset", [("packed", True, None, 0), ("reused", False, (40, 20), 64),
                                                       ("short", True, (90, 0), -128), ("one", False, None, 0)])
def test_summaries_skip_only_hidden_tiles_and_keep_only_whole_ones(kind, causal, window, offset):
  """Every tile ``tile_kind`` calls hidden keeps no pair, every one it calls full keeps all, every kept pair lies in
  its item's span; forward (rows: queries) and backward (rows: keys). Packed rows: every tile that keeps all its
  pairs is full (the ranges are exact)."""
  s, bq, bkv = 512, 64, 128
  q_ids, kv_ids = segment_ids(kind, 1, s)
  masking = ws_mask.Masking.make(causal, window, True)
  keep = keep_mask(q_ids, kv_ids, causal=causal, window=window, offset=offset)[0]
  summary = np.asarray(ws_mask.summaries(masking, q_ids, kv_ids, offset, True, (1, s, s), bq))[0]
  first, count = (np.asarray(x)[0] for x in ws_mask.spans(jnp.asarray(summary)[None], 2, bkv))
  for t in range(s // bq):
    for u in range(s // bkv):
      pairs = keep[t * bq:(t + 1) * bq, u * bkv:(u + 1) * bkv]
      kind_ = int(ws_mask.tile_kind(summary[t].__getitem__, u * bkv, (u + 1) * bkv - 1))
      assert kind_ != ws_mask.HIDDEN or not pairs.any()
      assert kind_ != ws_mask.FULL or pairs.all()
      if kind in ("packed", "one") and pairs.all():
        assert kind_ == ws_mask.FULL
      if pairs.any():
        assert first[t // 2] <= u < first[t // 2] + count[t // 2]
  keys = np.asarray(ws_mask.summaries(masking, kv_ids, q_ids, offset, False, (1, s, s), 64))[0]
  for u in range(s // 64):
    for t in range(s // 64):
      pairs = keep[t * 64:(t + 1) * 64, u * 64:(u + 1) * 64]
      kind_ = int(ws_mask.tile_kind(keys[u].__getitem__, t * 64, t * 64 + 63))
      assert (kind_ != ws_mask.HIDDEN or not pairs.any()) and (kind_ != ws_mask.FULL or pairs.all())


def test_the_item_table_lists_the_heaviest_first():
  """Every (batch, group, head) item once, the most tiles first; the heads of one group side by side."""
  first = jnp.array([[0, 3, 1], [2, 0, 0]], jnp.int32)
  count = jnp.array([[1, 4, 2], [4, 0, 3]], jnp.int32)
  table = np.asarray(ws_mask.item_table(first, count, 2))
  assert table[:, ws_mask.COUNT].tolist() == [4, 4, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0]
  assert table[:4, ws_mask.ROW].tolist() == [0, 1, 2, 3] and table[:4, ws_mask.GROUP].tolist() == [1, 1, 0, 0]
  assert sorted(map(tuple, table[:, :2].tolist())) == [(r, g) for r in range(4) for g in range(3)]
  assert table[4].tolist() == [2, 2, 0, 3]


# ------------------------------------------------------------------ the kernels in interpret mode

# (ids, causal, window, offset, b, s, h, kv, d, block_kv, num_ctas): documents shorter than a tile, GQA, several
# items per CTA; rows that keep no key (a document's keys carry another id), MHA, two rows; ids at random places
# with a causal window at a ring block's offset, head dimension 128 in three slots of 64 keys; one document longer
# than half the row under a two-sided window at a negative offset, 4 query heads a K/V head; a window without ids.
FORWARD = [("short", True, None, 0, 1, 256, 4, 2, 64, 64, 3),
           ("orphans", False, None, 0, 2, 256, 2, 2, 64, 128, None),
           ("reused", True, (48, 0), 64, 1, 256, 2, 1, 128, 64, 2),
           ("long", False, (100, 30), -64, 1, 512, 4, 1, 64, 128, 3),
           (None, True, (70, 0), 0, 1, 256, 2, 2, 128, 128, None)]


@pytest.mark.parametrize("ids,causal,window,offset,b,s,h,kv,d,block_kv,num_ctas", FORWARD,
                         ids=["short-causal-gqa", "orphans-mha", "reused-window-offset", "long-window", "window"])
def test_forward_matches_the_reference(ids, causal, window, offset, b, s, h, kv, d, block_kv, num_ctas):
  q, k, v, _ = inputs(b, s, h, kv, d)
  q_ids, kv_ids = segment_ids(ids, b, s) if ids else (None, None)
  slots = 3 if d == 128 and block_kv == 64 else 2
  run = functools.partial(fused_ring_attention_ws, causal=causal, window=window, offset=offset, block_kv=block_kv,
                          max_concurrent_steps=slots, num_ctas=num_ctas, interpret=True)
  out, lse = jax.jit(lambda q, k, v, a, c: run(q, k, v, None, q_segment_ids=a, kv_segment_ids=c))(
      q, k, v, q_ids, kv_ids)
  assert_forward(out, lse, q, k, v, keep_mask(q_ids, kv_ids, causal=causal, window=window, offset=offset, s_q=s,
                                              s_kv=s))


# (ids, causal, window, offset, b, s, h, kv, d): packed, GQA (dk, dv summed over its query heads), d 128; rows
# that keep no key and keys no query keeps, MHA, two rows; ids at random places, a causal window, a ring block's
# offset; a window without ids.
BACKWARD = [("packed", True, None, 0, 1, 256, 2, 1, 128),
            ("orphans", False, None, 0, 2, 256, 2, 2, 64),
            ("reused", True, (48, 0), 64, 1, 256, 2, 1, 64),
            (None, False, (40, 40), -64, 1, 256, 2, 2, 128)]


@pytest.mark.parametrize("ids,causal,window,offset,b,s,h,kv,d", BACKWARD,
                         ids=["packed-gqa", "orphans-mha", "reused-window-offset", "window"])
def test_backward_matches_the_reference(ids, causal, window, offset, b, s, h, kv, d):
  q, k, v, do = inputs(b, s, h, kv, d)
  q_ids, kv_ids = segment_ids(ids, b, s) if ids else (None, None)
  keep = keep_mask(q_ids, kv_ids, causal=causal, window=window, offset=offset, s_q=s, s_kv=s)
  want, (out, lse) = reference_grads(q, k, v, do, keep)
  run = functools.partial(attention_backward_ws, causal=causal, window=window, offset=offset, interpret=True)
  got = jax.jit(lambda q, k, v, o, do, lse, a, c: run(q, k, v, o, do, lse, q_segment_ids=a, kv_segment_ids=c))(
      q, k, v, out.astype(q.dtype), do, lse, q_ids, kv_ids)
  assert_grads(got, want)
  if ids == "orphans":  # keys no query keeps get no gradient
    unkept = ~np.asarray(keep).any(axis=1)
    assert not np.any(np.asarray(got[1], np.float32)[unkept]) and not np.any(np.asarray(got[2], np.float32)[unkept])


def test_bad_inputs_are_named():
  q = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
  ids = jax.ShapeDtypeStruct((1, 256), jnp.int32)
  with pytest.raises(PreconditionError, match="kv_segment_ids must be integer ids \\[b, s\\] = \\[1, 256\\]"):
    jax.eval_shape(lambda q, a: fused_ring_attention_ws(q, q, q, None, q_segment_ids=a, interpret=True), q, ids)
  with pytest.raises(PreconditionError, match="q_segment_ids must be integer ids \\[b, 256\\]"):
    jax.eval_shape(lambda q, a: attention_backward_ws(q, q, q, q, q, jnp.zeros((1, 2, 256)), q_segment_ids=a[:, :8],
                                                      kv_segment_ids=a, interpret=True), q, ids)
  mesh = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])
  ring = jax.shard_map(lambda q, a: fused_ring_attention_ws(q, q, q, "x", q_segment_ids=a, kv_segment_ids=a,
                                                            interpret=True)[0], mesh=mesh,
                       in_specs=(jax.P(None, "x"),) * 2, out_specs=jax.P(None, "x"), check_vma=False)
  with pytest.raises(PreconditionError, match="segment ids or a mask array are taken on one device only"):
    jax.eval_shape(ring, q, ids)


# ------------------------------------------------------------------ ws_attention in schedules


def _grads(schedule, reference, xs, cot):
  """Gradients of q, k and v (the ids are integers) through ``schedule`` and ``reference`` (float32)."""
  loss = lambda f, cast: lambda q, k, v: jnp.sum(f(*cast((q, k, v)), *xs[3:]).astype(jnp.float32) * cot)
  f32 = lambda xs: [x.astype(jnp.float32) for x in xs]
  got = jax.jit(jax.grad(loss(schedule.compile(), list), argnums=(0, 1, 2)))(*xs[:3])
  want = jax.grad(loss(reference, f32), argnums=(0, 1, 2))(*xs[:3])
  return got, want


def _spy(monkeypatch, *names):
  """The names of the calls of ``ws.<name>`` (the kernels' masked path, not the program's body), as they come."""
  calls = []
  for name in names:
    real = getattr(ws, name)
    monkeypatch.setattr(ws, name, lambda *a, name=name, real=real, **k: calls.append(name) or real(*a, **k))
  return calls


@pytest.mark.parametrize("axis_type,inside,tiles,mask,train", [
    (AxisType.Explicit, True, 2, dict(causal=True), True),  # blocks at offsets: one hidden, one all before
    (AxisType.Auto, False, 1, dict(window=(40, 8)), False)])
def test_schedules_run_on_the_masked_path(axis_type, inside, tiles, mask, train, monkeypatch):
  """One device: ``ws_attention`` with segment ids (the program's random packing), on Explicit axes inside
  ``jax.set_mesh`` over 2 x 2 blocks at offsets (the positions hide one, the kernels run the others at their
  offsets) forward and backward, on Auto axes outside it on the whole attention under a two-sided window."""
  mesh = jax.make_mesh((1,), ("x",), axis_types=(axis_type,), devices=jax.devices()[:1])
  prog, f32 = (jm.programs.attention(1, 2, 1, 256, 256, 64, dtype=dtype, segment_ids=True, **mask)
               for dtype in (jnp.bfloat16, jnp.float32))
  calls = _spy(monkeypatch, "masked_forward", "masked_backward")
  with registry.interpret_mode(), (jax.set_mesh(mesh) if inside else contextlib.nullcontext()):
    s = jm.Schedule(prog, mesh)
    if tiles > 1:
      s = s.tile("i", tiles).tile("j", tiles)
    s = s.patch("ws_attention")
    xs = prog.random_inputs(fresh_key())
    got = s.compile()(*xs)
    want = f32.reference(*(x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x for x in xs))
    assert rel_err(got.astype(jnp.float32), want) < GRAD_TOL
    if train:
      cot = jax.random.normal(fresh_key(), prog.writes.shape)
      assert_grads(*_grads(s, f32.reference, xs, cot))
  assert set(calls) == ({"masked_forward", "masked_backward"} if train else {"masked_forward"})


def test_offered_for_segment_ids_and_windows():
  """The tuner and the default choice may take ``ws_attention`` for segment ids and windows (``masks``), on
  GPUs, beside cuDNN with a bias and XLA (mask arrays: ``test_ws_attention_mask_array_cpu``)."""
  gpus = h100_mesh(1)
  for mask in (dict(causal=True, segment_ids=True), dict(window=(64, 0), causal=True),
               dict(segment_ids=True, window=(32, 32))):
    prog = jm.programs.attention(1, 8, 2, 4096, 4096, 128, dtype=jnp.bfloat16, **mask)
    assert {"xla", "cudnn_attention", "ws_attention"} <= set(registry.candidates(prog, gpus)), mask


# ------------------------------------------------------------------ lowering for an abstract H100 (no GPU)


@pytest.mark.parametrize("kernel,mask", [("forward", dict(causal=True)), ("backward", dict(causal=True)),
                                         ("forward", dict(window=(1024, 1024))),
                                         ("backward", dict(causal=True, window=(4096, 0)))])
def test_lowers_for_an_h100_at_the_real_sizes(kernel, mask):
  """B1 H32 KV8 D128 S32K with segment ids at the default tiles: Mosaic GPU's own passes accept each kernel
  (layouts of the ids' compare, shared memory with the ids' slots, the tables read as scalars)."""
  sds = jax.ShapeDtypeStruct
  q, k = sds((1, 32768, 32, 128), jnp.bfloat16), sds((1, 32768, 8, 128), jnp.bfloat16)
  ids = sds((1, 32768), jnp.int32)
  if kernel == "forward":
    run = lambda q, k, v, a: fused_ring_attention_ws(q, k, v, None, q_segment_ids=a, kv_segment_ids=a, **mask)
    args = (q, k, k, ids)
  else:
    run = lambda q, k, v, o, do, lse, a: attention_backward_ws(q, k, v, o, do, lse, q_segment_ids=a,
                                                               kv_segment_ids=a, **mask)
    args = (q, k, k, q, q, sds((1, 32, 32768), jnp.float32), ids)
  assert mosaic_kernels(lower_for_gpus(run, *args, mesh=h100_mesh(1))) == 1
