"""The warp-specialized fused ring-attention kernel without a GPU: Mosaic GPU interpret mode on one device
(non-causal and causal, and the forwarding path in a one-device loopback ring), its input checks, and the 1- and
8-device lowering to Mosaic GPU for abstract H100s.

JAX's Mosaic GPU interpreter runs the kernel's three warpgroups as threads,
with ``plgpu.Barrier`` arrive and wait between them (and it checks at the end
that every waiter observed every barrier phase, so a protocol slip fails
here), ``set_max_registers`` (a no-op there), wgmma with an SMEM left
operand, and TMA copies. It has no peer memory and no semaphores, so the
ring itself runs only in tests/gpu/test_fused_ring_attention_ws.py; the
loopback ring here (``_kernel(..., loopback=True)``, one CTA) stores every
forwarded tile into the device's own ``received`` and reads it back at the
next step, which covers the forwarders' lagged stores, the slot reuse and
the tile counts of every ring step. In interpret mode ``P V`` is a plain dot
(the interpreter's wgmma reads its left operand from SMEM only); the
lowering tests cover the register-operand wgmma the GPU runs. Its race
detector (``detect_races=True``) is not used: it reports every
read / release / refill of an SMEM slot as a race, even in a four-line
producer-consumer kernel.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import h100_mesh, lower_for_gpus, mosaic_kernels, rel_err
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from ring_attention_checks import SEQ, SPECS, assert_close, check_loopback, first_devices, local_inputs, run

from jaxmercury.errors import PreconditionError
from jaxmercury.ir import orders
from jaxmercury.kernels.attention.ring import SequenceOrder, reference, round_robin_item
from jaxmercury.kernels.attention.ws_forward import (
  BEFORE,
  CONFIGS,
  INTERPRET_CTAS,
  Pipeline,
  WsBlocks,
  _balanced_item,
  _band,
  _Folded,
  _imbalance,
  _kernel,
  _kv_heads_at_once,
  _SplitTail,
  _weights,
  fused_ring_attention_ws,
)

BLOCKS = [dict(block_q=64, block_kv=64, max_concurrent_steps=3), dict(block_q=64, block_kv=128, max_concurrent_steps=2)]


@pytest.mark.parametrize("pipelined", [False, True], ids=["", "pipelined"])
@pytest.mark.parametrize("blocks", BLOCKS, ids=str)
@pytest.mark.parametrize("b,s,h,kv,d", [(1, 256, 2, 2, 64), (2, 256, 4, 2, 128)], ids=["mha", "gqa"])
def test_one_device_matches_the_reference(b, s, h, kv, d, blocks, pipelined):
  """Three CTAs over b * h * s / 128 items: every CTA runs several items through the same slots and barriers."""
  q, k, v = local_inputs(b, s, h, kv, d)
  out, lse = run(first_devices(), lambda q, k, v: fused_ring_attention_ws(q, k, v, "x", num_ctas=3, interpret=True,
                                                                          pipelined=pipelined, **blocks), q, k, v)
  assert_close(out, lse, *run(first_devices(), lambda q, k, v: reference(q, k, v, "x"), q, k, v), q)


# (order, zigzag chunks, local sequence length): with one device the default zigzag (2 chunks) is the natural
# order; 4 chunks of 128 store true chunks 0, 3, 1, 2: hidden, visible and partial tiles in one ring step.
ORDERS = [("natural", None, 256), ("zigzag", None, 256), ("zigzag", 4, 512)]


def _true_order(x, chunks):
  """``x [b, s, ...]`` stored in zigzag order (``chunks`` chunks) -> true sequence order."""
  return x if chunks is None else x[:, np.argsort(orders.permutation(x.shape[1], chunks))]


@pytest.mark.parametrize("b,h,kv", [(1, 2, 2), (2, 4, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("order,chunks,s", ORDERS, ids=["natural", "zigzag", "zigzag4"])
def test_causal_one_device_matches_the_reference(order, chunks, s, b, h, kv):
  q, k, v = local_inputs(b, s, h, kv, 64)
  mask = dict(causal=True, order=order, chunks=chunks)
  out, lse = run(first_devices(), lambda q, k, v: fused_ring_attention_ws(q, k, v, "x", num_ctas=3, interpret=True,
                                                                          block_kv=64, **mask), q, k, v)
  assert_close(out, lse, *run(first_devices(), lambda q, k, v: reference(q, k, v, "x", **mask), q, k, v), q)
  # the same as causal attention of the sequence in true order
  dpa = jax.nn.dot_product_attention(*(_true_order(x, chunks).astype(jnp.float32) for x in (q, k, v)), is_causal=True)
  assert rel_err(_true_order(out, chunks).astype(jnp.float32), dpa) < 2e-2


# Each change of the pipeline alone (the default has all): the causal loops, the balanced order, the Q prefetch.
PIPELINES = [BEFORE, Pipeline(balanced=False, prefetch_q=False), Pipeline(causal_loops=False, prefetch_q=False),
             Pipeline(causal_loops=False, balanced=False)]


@pytest.mark.parametrize("pipeline", PIPELINES, ids=["before", "loops", "balanced", "prefetch"])
@pytest.mark.parametrize("num_ctas", [3, 4])
def test_every_pipeline_matches_the_reference(pipeline, num_ctas):
  """16 items over 3 CTAs (5 full rounds: the last round's item goes to the last CTA in snake order) or 4 (4
  rounds, none partial); 4 zigzag chunks of 128: hidden, partial and visible tiles in each item."""
  q, k, v = local_inputs(1, 512, 4, 2, 64)
  mask = dict(causal=True, order="zigzag", chunks=4)
  params = dict(num_ctas=num_ctas, interpret=True, block_kv=64, pipeline=pipeline, **mask)
  out, lse = run(first_devices(), lambda q, k, v: fused_ring_attention_ws(q, k, v, "x", **params), q, k, v)
  assert_close(out, lse, *run(first_devices(), lambda q, k, v: reference(q, k, v, "x", **mask), q, k, v), q)


@pytest.mark.parametrize("num_ctas", [3, 4, 6])
@pytest.mark.parametrize("prefetch_q,pipelined", [(False, False), (True, False), (True, True)],
                         ids=["", "prefetch", "prefetch-pipelined"])
def test_split_tails_match_the_reference(num_ctas, prefetch_q, pipelined):
  """16 items of 8 key tiles: over 3 or 6 CTAs the last round's items (1 or 4) are shared out over every CTA and
  merged after the kernel; over 4 CTAs every round is full (no split)."""
  q, k, v = local_inputs(1, 512, 4, 2, 64)
  params = dict(num_ctas=num_ctas, interpret=True, block_kv=64, pipeline=Pipeline(prefetch_q=prefetch_q),
                pipelined=pipelined)
  out, lse = run(first_devices(), lambda q, k, v: fused_ring_attention_ws(q, k, v, "x", **params), q, k, v)
  assert_close(out, lse, *run(first_devices(), lambda q, k, v: reference(q, k, v, "x"), q, k, v), q)


@pytest.mark.parametrize("b,h,kv,num_ctas,pipelined,pipeline", [
    (2, 4, 2, 3, False, Pipeline()), (2, 4, 2, 3, True, Pipeline()), (2, 4, 2, 4, False, Pipeline()),
    (1, 4, 4, 9, False, Pipeline()), (1, 4, 4, 9, False, Pipeline(heads_in_turn=False, alternate_keys=False))],
    ids=["split", "split-pipelined", "whole", "split-mha", "split-mha-round-robin"])
def test_one_device_orders_without_a_mask_match_the_reference(b, h, kv, num_ctas, pipelined, pipeline):
  """Heads in turn and odd items' keys read last to first (``Pipeline.heads_in_turn``, ``alternate_keys``, the
  defaults), S512 in 8 key tiles an item. B2 H4 KV2, 32 items: over 3 CTAs 10 whole rounds and a split tail, whose
  parts on odd items are read backward too; over 4 CTAs 8 whole rounds. B1 H4 KV4, 16 items over 9 CTAs: the split
  tail spans two heads, so its parts are merged back only at the rows of the items the kernel ran, heads in turn
  or (round-robin) one item per K/V head first."""
  q, k, v = local_inputs(b, 512, h, kv, 64)
  params = dict(num_ctas=num_ctas, interpret=True, block_kv=64, pipelined=pipelined, pipeline=pipeline)
  out, lse = run(first_devices(), lambda q, k, v: fused_ring_attention_ws(q, k, v, "x", **params), q, k, v)
  assert_close(out, lse, *run(first_devices(), lambda q, k, v: reference(q, k, v, "x"), q, k, v), q)


def test_heads_in_turn_take_every_item_once_in_order():
  """No forwarder items (one device): item ``t`` is the ``t``-th (batch, query head, query block), blocks fastest;
  with forwarders, one per (batch, K/V head) first, then every other item once."""
  b, h, kv, pairs = 2, 4, 2, 3
  g = h // kv
  every = [(bi, hi, p) for bi in range(b) for hi in range(h) for p in range(pairs)]
  items = [tuple(int(x) for x in round_robin_item(jnp.int32(t), 0, g * pairs, pairs, g, kv)[:3]) for t in range(len(every))]
  assert items == every
  ringed = [round_robin_item(jnp.int32(t), b * kv, g * pairs, pairs, g, kv) for t in range(len(every))]
  assert [bool(f) for *_, f in ringed] == [True] * (b * kv) + [False] * (len(every) - b * kv)
  assert sorted(tuple(int(x) for x in i[:3]) for i in ringed) == every


def test_split_tail_units():
  split = _SplitTail.make(16, 8, 3)  # 5 whole rounds, then item 15's 8 units: 3, 3, 2
  assert split.full == 5 and [split.start(c) for c in range(4)] == [0, 3, 6, 8]
  assert split.parts() == {0: [(0, 0), (1, 0), (2, 0)]}
  split = _SplitTail.make(16, 8, 6)  # 2 whole rounds, then items 12 .. 15: 32 units, 6, 6, 5, 5, 5, 5
  assert split.parts() == {0: [(0, 0), (1, 0)], 1: [(1, 1), (2, 0)], 2: [(2, 1), (3, 0), (4, 0)], 3: [(4, 1), (5, 0)]}
  assert _SplitTail.make(16, 8, 4) is None and _SplitTail.make(1, 2, 3) is None  # a full last round; too little


@pytest.mark.parametrize("n,b,h,kv,causal,order,chunks,s,slots,pipelined", [
    (3, 2, 4, 2, False, "natural", None, 128, 2, False),  # b * kv = 4 forwarders, 4 non-forwarders, 3 ring steps
    (3, 2, 4, 2, False, "natural", None, 128, 2, True),  # the same, one softmax behind each P V across the steps
    (3, 1, 2, 1, True, "natural", None, 256, 3, False),  # steps 1, 2 hidden: only the forwarder loads (passes) them
    (2, 1, 2, 1, True, "zigzag", 8, 512, 2, False),  # 4 chunks a device: hidden, partial and visible runs each step
    (4, 2, 2, 2, True, "zigzag", None, 256, 2, False),  # ring_zigzag's layout, every item a forwarder
], ids=["mha-3", "mha-3-pipelined", "causal-3", "zigzag8-2", "zigzag-4"])
def test_the_forwarding_path_in_a_loopback_ring(n, b, h, kv, causal, order, chunks, s, slots, pipelined):
  """Forwarders store each tile from SMEM into ``received[s]`` and every item reads step ``s + 1`` from there.

  One device, one CTA, ``n`` ring steps: the forwarders (the CTA's first
  items) store into this device's own ``received``; unwritten ``received``
  rows would be NaN (the interpreter's uninitialised memory).
  """
  check_loopback(_kernel, WsBlocks(64, 64, slots), n, b, s, h, kv, 64, causal, order, chunks, pipelined=pipelined)


@pytest.mark.parametrize("n,b,h,kv,order,chunks,s,pipeline", [
    (3, 1, 2, 1, "natural", None, 256, BEFORE),  # round-robin: the forwarders are items 0 .. F - 1
    (2, 1, 4, 2, "zigzag", None, 256, Pipeline()),  # balanced: 2 forwarders first, then 14 items by their work
    (2, 1, 2, 1, "zigzag", 6, 384, Pipeline()),  # 3 chunks a device: not (early, late) pairs, round-robin
], ids=["round-robin", "balanced-gqa", "zigzag6"])
def test_both_item_orders_in_a_loopback_ring(n, b, h, kv, order, chunks, s, pipeline):
  check_loopback(_kernel, WsBlocks(64, 64, 2), n, b, s, h, kv, 64, True, order, chunks, pipeline=pipeline)


def _ring_loads(seq: int, n: int, h: int, kv: int, grid: int, balanced: bool) -> list[np.ndarray]:
  """Each device's causal work per CTA (its items' last query positions summed) in a zigzag ring of ``n``, B1,
  items of 128 query rows in the kernel's order; checks that every item runs once and each forwarder first."""
  s, g, rows = seq // n, h // kv, 128
  pairs = s // rows
  order = SequenceOrder.make("zigzag", None, n, s, WsBlocks(64, 128, 2))
  weights = _weights(order, pairs, rows, n)
  ranks = np.arange(h * pairs)
  if balanced:  # snake order (fused_common.snake_order): CTA c takes rank i grid + c, odd rounds reversed
    rounds, c = np.divmod(ranks, grid)
    cta = np.where(rounds % 2 == 0, c, grid - 1 - c)
    bi, hi, pair, forwards = (np.asarray(x) for x in _balanced_item(
        jnp.asarray(ranks), h, h, g, _band(weights, h, grid, g), order.segment // rows, pairs // (order.segment // rows),
        forwarders=kv))
  else:
    cta = ranks % grid
    bi, hi, pair, forwards = (np.asarray(x) for x in round_robin_item(jnp.asarray(ranks), kv, g * pairs, pairs, g, kv))
  assert len(set(zip(bi.tolist(), hi.tolist(), pair.tolist()))) == h * pairs  # every item once
  first = ranks < grid
  assert sorted(cta[forwards & first].tolist()) == list(range(kv)) and forwards.sum() == kv  # CTA f's first item
  assert sorted(hi[forwards].tolist()) == list(range(0, h, g))  # each group's first head
  return [np.bincount(cta, weights=[order.first(dev, p * rows) + rows for p in pair], minlength=grid)
          for dev in range(n)]


@pytest.mark.parametrize("seq,kv,round_robin,balanced", [(16384, 8, 1.11, 1.02), (32768, 32, 1.10, 1.035),
                                                          (65536, 8, 1.023, 1.02)])
def test_the_balanced_order_evens_out_a_zigzag_ring(seq, kv, round_robin, balanced):
  """Two devices, H32, 132 CTAs: round-robin leaves a device's busiest CTA 2-34% above the mean in these cases, the
  balanced order with its forwarders first within 2% (GQA) or 3.5% (MHA: bands of 32 blocks, few K/V heads read at
  once, ``_band``)."""
  worst = lambda order: max(load.max() / load.mean() for load in _ring_loads(seq, 2, 32, kv, 132, order))
  assert worst(False) > round_robin and worst(True) < balanced


def test_bands_keep_few_kv_heads_read_at_once():
  """One device, B1 H32, 132 CTAs: GQA (8 K/V heads) keeps the bands measured there (1 at S 4K-16K, 8 at S32K, 16
  at S64K); MHA's rounds would read 17-32 K/V heads in narrower bands, so it takes bands of 32 blocks (about 5)."""
  blocks = {seq: np.arange(seq // 128, 0, -1)[None] for seq in (4096, 16384, 32768, 65536)}
  assert [_band(work, 32, 132, g=4) for work in blocks.values()] == [1, 1, 8, 16]
  assert [_band(work, 32, 132, g=1) for work in blocks.values()] == [32] * 4
  assert [round(_kv_heads_at_once(128, 32, 1, 132, band)) for band in (1, 8, 32)] == [32, 17, 5]
  assert _kv_heads_at_once(128, 32, 4, 132, 1) == 8


def _folded_loads(folded: _Folded) -> tuple[np.ndarray, list]:
  """Each CTA's causal work (blocks of linear work, heaviest first) and each round's heads, in the kernel's
  folded order; checks that every item runs once."""
  loads, rounds, items = np.zeros(folded.grid), {}, []
  for c in range(folded.grid):
    count, tail_rank = folded.count(jnp.int32(c))
    i = jnp.arange(int(count))
    bh, w = (np.asarray(x) for x in folded.item(i, jnp.int32(c), tail_rank))
    items += list(zip(bh.tolist(), w.tolist()))
    loads[c] = (folded.pairs - w).sum()
    for r, head in zip(np.asarray(i).tolist(), bh.tolist()):  # a CTA's i-th item runs in round i
      rounds.setdefault(r, set()).add(head)
  assert sorted(items) == [(bh, w) for bh in range(folded.heads) for w in range(folded.pairs)]  # every item once
  return loads, [rounds[r] for r in sorted(rounds)]


def test_folded_rounds_even_out_the_ctas_and_read_few_heads():
  """One device, B1 H32, 132 CTAs: S64K folds all but the 50 lightest blocks of each head into 56 pairs of
  rounds that each read one or two heads; the busiest CTA is within 0.01% of the mean (bands of 32 blocks: 0.2%,
  rounds of about 5 heads)."""
  folded = _Folded.make(np.arange(512, 0, -1), 32, 132)
  assert (folded.tail, folded.round_pairs) == (50, 56)
  loads, heads = _folded_loads(folded)
  assert loads.max() / loads.mean() < 1.0001 and _imbalance(np.arange(512, 0, -1), 32, 132, 32) > 1.001
  assert max(len(x) for x in heads[:2 * folded.round_pairs]) == 2
  assert [_Folded.make(np.arange(p, 0, -1), 32, 132).tail for p in (128, 256)] == [62, 58]


def test_folded_rounds_need_work_linear_in_the_rank():
  assert _Folded.make(np.array([9, 7, 4, 2, 1, 1]), 2, 2) is None  # 9 + 1 != 7 + 2: couples of unequal work
  assert _Folded.make(np.array([4, 3, 2, 1]), 2, 3) is None  # no tail under 2 blocks leaves whole pairs of rounds
  assert _Folded.make(np.arange(6, 0, -1), 1, 2) == _Folded(1, 6, 2, 2)  # couples (6, 3), (5, 4); then 2, 1


@pytest.mark.parametrize("num_ctas,tail,prefetch_q", [(4, 0, True), (6, 2, False)])
def test_folded_rounds_match_the_reference(num_ctas, tail, prefetch_q):
  """B1 H4 KV2 S1024 causal, 8 blocks of 128 rows a head: over 4 CTAs four pairs of rounds and no tail (each
  consumer loading its next item's Q tile ahead), over 6 two pairs of rounds and then each head's 2 lightest
  blocks (Q tiles one at a time)."""
  assert _Folded.make(np.arange(8, 0, -1), 4, num_ctas).tail == tail
  q, k, v = local_inputs(1, 1024, 4, 2, 64)
  params = dict(num_ctas=num_ctas, interpret=True, block_kv=64, causal=True,
                pipeline=Pipeline(folded=True, prefetch_q=prefetch_q))
  out, lse = run(first_devices(), lambda q, k, v: fused_ring_attention_ws(q, k, v, "x", **params), q, k, v)
  assert_close(out, lse, *run(first_devices(), lambda q, k, v: reference(q, k, v, "x", causal=True), q, k, v), q)


def test_item_weights_follow_global_positions():
  blocks = WsBlocks(64, 64, 2)
  zigzag = _weights(SequenceOrder.make("zigzag", 8, 2, 512, blocks), 4, 128, 2)  # true chunks 0 7 1 6 | 2 5 3 4
  assert zigzag.tolist() == [[1024, 896, 256, 128], [768, 640, 512, 384]]
  assert _weights(SequenceOrder.make("zigzag", 6, 2, 384, blocks), 3, 128, 2) is None  # 0 5 1 | 4 2 3


def test_the_default_grid_without_an_sm_count():
  q, k, v = local_inputs(1, 512, 2, 2, 64)
  assert INTERPRET_CTAS < 1 * 2 * 512 // 128  # some CTA runs several items
  out, lse = run(first_devices(), lambda q, k, v: fused_ring_attention_ws(q, k, v, "x", interpret=True), q, k, v)
  assert_close(out, lse, *run(first_devices(), lambda q, k, v: reference(q, k, v, "x"), q, k, v), q)


# ------------------------------------------------------------------ lowering for abstract H100s (no GPU)
def _lower(devices: int, b: int, s: int, h: int, kv: int, d: int, dtype=jnp.bfloat16, **params):
  mesh = h100_mesh(devices)
  spec = lambda heads: jax.ShapeDtypeStruct((b, devices * s, heads, d), dtype, sharding=NamedSharding(mesh, SEQ))
  f = jax.shard_map(lambda q, k, v: fused_ring_attention_ws(q, k, v, "x", **params), mesh=mesh, **SPECS)
  return lower_for_gpus(f, spec(h), spec(kv), spec(kv), mesh=mesh)


def _blocks(blocks: WsBlocks):
  return dict(block_q=blocks.block_q, block_kv=blocks.block_kv, max_concurrent_steps=blocks.max_concurrent_steps)


@pytest.mark.parametrize("blocks", CONFIGS, ids=str)
@pytest.mark.parametrize("b,s,h,kv,d", [(1, 1024, 32, 32, 128), (1, 1024, 32, 8, 128), (2, 256, 4, 2, 64)],
                         ids=["mha", "gqa", "small"])
def test_the_ring_lowers_for_eight_h100s(b, s, h, kv, d, blocks, pipelined=False):
  """Three warpgroups, barriers, remote TMA stores, per-step semaphores, wgmma with P from registers lower.

  Lowering for an abstract H100 runs Mosaic GPU's own passes (layouts,
  shared memory: a kernel over 227 KiB fails here); it is no CUDA compile
  (register pressure is ptxas's) and no run.
  """
  text = _lower(8, b, s, h, kv, d, num_ctas=132, pipelined=pipelined, **_blocks(blocks))
  assert mosaic_kernels(text) == 1
  assert "all-gather" not in text and "all_gather" not in text and "collective_permute" not in text


@pytest.mark.parametrize("blocks", [CONFIGS[0], CONFIGS[1]], ids=str)
def test_the_pipelined_ring_lowers_for_eight_h100s(blocks):
  """Two wgmma accumulators live at once (the scores and the output), the scores read with one wgmma in flight."""
  test_the_ring_lowers_for_eight_h100s(1, 1024, 32, 8, 128, blocks, pipelined=True)


@pytest.mark.parametrize("blocks", [CONFIGS[0], CONFIGS[2]], ids=str)
@pytest.mark.parametrize("order", ["natural", "zigzag"])
@pytest.mark.parametrize("b,s,h,kv,d", [(1, 1024, 32, 8, 128), (2, 256, 4, 2, 64)], ids=["gqa", "small"])
def test_the_causal_ring_lowers_for_eight_h100s(b, s, h, kv, d, order, blocks):
  """Tile counts by position, hidden tiles that keep the barrier protocol, iota masks: they lower too."""
  text = _lower(8, b, s, h, kv, d, causal=True, order=order, num_ctas=132, **_blocks(blocks))
  assert mosaic_kernels(text) == 1
  assert "all-gather" not in text and "all_gather" not in text and "collective_permute" not in text


@pytest.mark.parametrize("causal", [False, True], ids=["non-causal", "causal"])
def test_one_device_lowers_without_peers(causal):
  """One device: no received buffers, no semaphores; the default grid is the abstract device's 132 SMs."""
  text = _lower(1, 1, 512, 8, 8, 128, jnp.float16, causal=causal)
  assert mosaic_kernels(text) == 1


# ------------------------------------------------------------------ preconditions
@pytest.mark.parametrize("change,message", [
    (dict(dtype=jnp.float32), "fused_ring_attention_ws: q, k and v must all be bf16 or fp16"),
    (dict(k_shape=(1, 128, 2, 64, 1)), r"q \[b, s, h, d\] and k, v \[b, s, kv, d\] expected"),
    (dict(k_shape=(1, 64, 2, 64)), "must agree on b, s and d"),
    (dict(k_shape=(1, 128, 3, 64), v_shape=(1, 128, 3, 64)), "4 query heads are not a multiple of 3"),
    (dict(d=96), "head dimension d=96"),
    (dict(s=96), "sequence length 96 is not a multiple of block_q=64"),
    (dict(s=192, blocks=dict(block_kv=64)), r"192 is not a multiple of 2 \* block_q = 128: a work item is two"),
    (dict(blocks=dict(block_q=96)), "block_q=96 must be a multiple of 64"),
    (dict(blocks=dict(block_kv=320)), "block_kv=320 must be a multiple of 64 and at most 256"),
    (dict(blocks=dict(max_concurrent_steps=1)), "at least 2"),
    (dict(blocks=dict(block_q=128, block_kv=256)), "exceed one warpgroup's registers"),
    (dict(d=128, blocks=dict(block_kv=128, max_concurrent_steps=3)), "needs 232960 bytes of shared memory"),
    (dict(blocks=dict(num_ctas=-1)), "num_ctas=-1 must be a positive int"),
    (dict(blocks=dict(pipeline=Pipeline(band=3))), r"band=3\) must be a positive int dividing the 1 query blocks"),
    (dict(s=256, blocks=dict(pipeline=Pipeline(band=0))), r"band=0\) must be a positive int dividing the 2 query"),
    (dict(blocks=dict(pipeline=Pipeline(folded="yes"))), r"Pipeline\(folded='yes'\) must be True or False"),
    (dict(blocks=dict(pipeline=Pipeline(prefetch_q=1))), r"Pipeline\(prefetch_q=1\) must be True or False"),
])
def test_inputs_are_checked_before_anything_runs(change, message):
  s, d, dtype = change.get("s", 128), change.get("d", 64), change.get("dtype", jnp.bfloat16)
  q = jnp.ones((1, s, 4, d), dtype)
  k = jnp.ones(change.get("k_shape", (1, s, 2, d)), dtype)
  v = jnp.ones(change.get("v_shape", k.shape), dtype)
  params = {"num_ctas": 4, **change.get("blocks", {})}
  fn = lambda q, k, v: fused_ring_attention_ws(q, k, v, "x", **params)
  with pytest.raises(PreconditionError, match=message):
    jax.jit(jax.shard_map(fn, mesh=first_devices(), in_specs=(SEQ,) * 3, out_specs=(SEQ, P()),
                          check_vma=False))(q, k, v)


def test_pipelined_consumers_are_not_causal():
  q = k = v = jnp.ones((1, 256, 2, 64), jnp.bfloat16)
  with pytest.raises(PreconditionError, match="pipelined=True runs non-causal attention only"):
    run(first_devices(), lambda q, k, v: fused_ring_attention_ws(q, k, v, "x", causal=True, pipelined=True,
                                                                 interpret=True), q, k, v)


@pytest.mark.parametrize("kwargs,message", [
    (dict(order="diagonal"), r"fused_ring_attention_ws: order='diagonal' must be one of"),
    (dict(order="zigzag", chunks=3), "zigzag chunks=3 must be even"),
    (dict(order="natural", chunks=2), "chunks=2 applies to order='zigzag' only"),
    (dict(order="zigzag", chunks=8), "zigzag chunks of 32 positions are not a multiple of block_q=64"),
    (dict(order="zigzag", chunks=4),  # chunks of 64 positions: one query tile, not a pair
     r"zigzag chunks of 64 positions are not a multiple of 2 \* block_q = 128: a work item's two query tiles"),
])
def test_orders_are_checked(kwargs, message):
  q = k = v = jnp.ones((1, 256, 2, 64), jnp.bfloat16)
  with pytest.raises(PreconditionError, match=message):
    run(first_devices(), lambda q, k, v: fused_ring_attention_ws(q, k, v, "x", causal=True, num_ctas=4, interpret=True,
                                                 block_kv=64, **kwargs), q, k, v)


@pytest.mark.parametrize("interpret,devices,message", [
    (True, 2, "fused_ring_attention_ws: interpret mode runs one device.*no peer memory"),
    (False, 2, "fused_ring_attention_ws: axis 'x' has 2 devices, but the process has 8"),
    (False, 8, r"fused_ring_attention_ws: the ring needs one resident CTA per forwarder, b \* kv = 2 \* 4 = 8, "
               "but the grid has 4 CTAs"),
])
def test_a_ring_needs_a_gpu_mesh_over_every_device(interpret, devices, message):
  q, k, v = [jnp.ones((2, devices * 128, 4, 64), jnp.bfloat16)] * 3
  with pytest.raises(PreconditionError, match=message):
    run(first_devices(devices), lambda q, k, v: fused_ring_attention_ws(q, k, v, "x", num_ctas=4, interpret=interpret),
        q, k, v)


def test_a_ring_grid_must_be_resident():
  """Over 132 CTAs on 132 SMs some would wait for others to finish: the ring could deadlock."""
  with pytest.raises(PreconditionError, match="num_ctas=133 exceeds the 132 SMs"):
    _lower(8, 1, 256, 4, 2, 64, num_ctas=133)
  assert mosaic_kernels(_lower(1, 1, 256, 4, 2, 64, num_ctas=264)) == 1  # one device: no ring


def test_the_blocks_count_their_shared_memory():
  """The estimate covers Mosaic GPU's count (measured: buffers + about 2.7 KiB); every config fits with d = 128."""
  for blocks in CONFIGS:
    assert blocks.problem(128) is None, blocks
  assert WsBlocks(64, 128, 2).smem_bytes(128, 2) >= 167000  # Mosaic GPU's smem_bytes for it, lowered for an H100
  assert "shared memory" in WsBlocks(64, 128, 3).problem(128)  # 232568 bytes > 227 KiB in Mosaic GPU


@pytest.mark.parametrize("causal,s", [(False, 4096), (True, 4096), (True, 32768)],
                         ids=["split-tail", "causal-balanced", "causal-banded"])
def test_one_device_lowers_for_an_h100(causal, s):
  """One device, 1024 items over 132 CTAs: the split tail's parts (non-causal) or the longest-first snake order
  (at S32K in bands of 8 query blocks) and the three causal loops, with two Q buffers per consumer, lower within
  an H100's shared memory."""
  text = _lower(1, 1, s, 32, 8, 128, num_ctas=132, causal=causal)
  assert mosaic_kernels(text) == 1


def test_the_pipelined_consumers_lower_with_one_q_buffer():
  """Pipelined consumers without the Q prefetch (one Q buffer per consumer, as where two do not fit)."""
  text = _lower(1, 1, 4096, 32, 8, 128, num_ctas=132, pipelined=True, pipeline=Pipeline(prefetch_q=False))
  assert mosaic_kernels(text) == 1


@pytest.mark.parametrize("pipelined", [False, True], ids=["", "pipelined"])
def test_the_orders_without_a_mask_lower_for_an_h100(pipelined):
  """Heads in turn and odd items' keys read backward (the defaults; their TMA source tile chosen at run time),
  split tail."""
  text = _lower(1, 1, 4096, 32, 32, 128, num_ctas=132, pipelined=pipelined)
  assert mosaic_kernels(text) == 1


def test_the_balanced_order_in_bands_matches_the_reference():
  """8 query blocks by 4 (batch, head) pairs over 4 CTAs: one band of 8 blocks, head after head (``_band``)."""
  work = np.arange(8, 0, -1)[None]  # one device: block 7 (8 key tiles) first
  assert _band(work, 4, 4) == 8 and _band(work, 4, 3) == 1  # over 3 CTAs bands would leave one 2% busier
  assert _imbalance(work[0], 4, 4, 8) == 1.0 and _imbalance(work[0], 2, 3, 8) > 1.2
  q, k, v = local_inputs(2, 1024, 2, 1, 64)
  params = dict(num_ctas=4, interpret=True, block_kv=128, causal=True)
  out, lse = run(first_devices(), lambda q, k, v: fused_ring_attention_ws(q, k, v, "x", **params), q, k, v)
  assert_close(out, lse, *run(first_devices(), lambda q, k, v: reference(q, k, v, "x", causal=True), q, k, v), q)
