"""The warp-specialized fused ring-attention kernel without a GPU: Mosaic GPU interpret mode on one device
(non-causal and causal, and the forwarding path in a one-device loopback ring), its order of work items, its input
checks, and the 1- and 8-device lowering to Mosaic GPU for abstract H100s.

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

Each interpret-mode case runs a whole kernel in the interpreter, so the cases are chosen pairwise: each variant
the kernel takes (one device without a mask: pipelined consumers, split tails, keys read backward; causal: the
balanced, banded and folded orders, one or two Q buffers; a ring's forwarders) at least once, on the smallest
shapes that still run several items per CTA and several tiles per item.
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
from jaxmercury.kernels.attention import ws_order
from jaxmercury.kernels.attention.ring import SequenceOrder, reference, round_robin_item
from jaxmercury.kernels.attention.ws_forward import (
  CONFIGS,
  INTERPRET_CTAS,
  WsBlocks,
  _kernel,
  _Plan,
  fused_ring_attention_ws,
)


def _check_one_device(b, s, h, kv, d, mask, **params):
  """The kernel in interpret mode on one device against the unfused reference."""
  q, k, v = local_inputs(b, s, h, kv, d)
  out, lse = run(first_devices(), lambda q, k, v: fused_ring_attention_ws(q, k, v, "x", interpret=True, **mask,
                                                                          **params), q, k, v)
  assert_close(out, lse, *run(first_devices(), lambda q, k, v: reference(q, k, v, "x", **mask), q, k, v), q)
  return q, k, v, out


def _plan(b, s, h, kv, d, num_ctas, causal, order="natural", chunks=None, blocks=WsBlocks(64, 64, 2)):
  """The kernel's static plan of a one-device call (which variant runs)."""
  spec = lambda heads: jax.ShapeDtypeStruct((b, s, heads, d), jnp.bfloat16)
  seq_order = SequenceOrder.make(order, chunks, 1, s, blocks)
  return _Plan.make(spec(h), spec(kv), 1, blocks, num_ctas, True, causal, seq_order, False)


# One device without a mask: pipelined consumers, heads in turn, odd items' keys read last to first, and a split
# tail where the last round is part empty. (b, s, h, kv, d, blocks, CTAs): B1 H4 KV2 S256, 8 items of 4 key tiles
# over 3 CTAs: 2 whole rounds, then items 6 and 7 (7 odd: read backward) in 8 units, 3, 3, 2, CTA 1's parts of both;
# MHA over 5 CTAs, the last round's 3 items split across two heads; d 128 in tiles of 128 keys over the default grid
# of a device without an SM count, every round whole.
NON_CAUSAL = [(1, 256, 4, 2, 64, dict(block_kv=64), 3), (1, 256, 4, 4, 64, dict(block_kv=64), 5),
              (2, 256, 4, 2, 128, dict(block_kv=128, max_concurrent_steps=2), None)]


@pytest.mark.parametrize("b,s,h,kv,d,blocks,num_ctas", NON_CAUSAL, ids=["split", "split-mha", "whole-d128"])
def test_one_device_without_a_mask_matches_the_reference(b, s, h, kv, d, blocks, num_ctas):
  p = _plan(b, s, h, kv, d, num_ctas or INTERPRET_CTAS, False, blocks=WsBlocks(64, blocks["block_kv"], 2))
  assert p.pipelined and p.alternate and p.q_buffers == 2
  assert (p.split is None) == (num_ctas is None)
  _check_one_device(b, s, h, kv, d, {}, num_ctas=num_ctas, **blocks)


# (order, zigzag chunks, local sequence length): with one device the default zigzag (2 chunks) is the natural
# order; 4 chunks of 128 store true chunks 0, 3, 1, 2: hidden, visible and partial tiles in one ring step.
# (b, h, kv, d, blocks, CTAs): items heaviest first in snake order over 3 CTAs, the last round part-filled; MHA;
# head dimension 192 in three slots, where two Q buffers do not fit (one a consumer, loaded item by item).
CAUSAL = [("natural", None, 256, 1, 2, 2, 64, dict(block_kv=64), 3),
          ("zigzag", None, 256, 1, 4, 2, 64, dict(block_kv=64), 3),
          ("zigzag", 4, 512, 1, 4, 2, 64, dict(block_kv=64), 3),
          ("natural", None, 256, 1, 2, 1, 192, dict(block_kv=64, max_concurrent_steps=3), 3)]


@pytest.mark.parametrize("order,chunks,s,b,h,kv,d,blocks,num_ctas", CAUSAL,
                         ids=["natural-mha", "zigzag-gqa", "zigzag4", "one-q-buffer"])
def test_causal_one_device_matches_the_reference(order, chunks, s, b, h, kv, d, blocks, num_ctas):
  p = _plan(b, s, h, kv, d, num_ctas, True, order, chunks, WsBlocks(64, 64, blocks.get("max_concurrent_steps", 2)))
  assert p.items.balanced and p.items.folded is None and not p.pipelined and p.q_buffers == (1 if d == 192 else 2)
  mask = dict(causal=True, order=order, chunks=chunks)
  q, k, v, out = _check_one_device(b, s, h, kv, d, mask, num_ctas=num_ctas, **blocks)
  # the same as causal attention of the sequence in true order
  true = lambda x: x if chunks is None else x[:, np.argsort(orders.permutation(x.shape[1], chunks))]
  dpa = jax.nn.dot_product_attention(*(true(x).astype(jnp.float32) for x in (q, k, v)), is_causal=True)
  assert rel_err(true(out).astype(jnp.float32), dpa) < 2e-2


@pytest.mark.parametrize("s,num_ctas,tail,block_kv", [(512, 4, 0, 128), (768, 4, 2, 64)])
def test_folded_rounds_match_the_reference(s, num_ctas, tail, block_kv):
  """B1 H2 KV1 causal over 4 CTAs: S512, 4 blocks of 128 rows a head, in two pairs of rounds and no tail; S768,
  6 blocks a head, one pair of rounds and then each head's 2 lightest blocks."""
  assert ws_order.Folded.make(np.arange(s // 128, 0, -1), 2, num_ctas).tail == tail
  assert _plan(1, s, 2, 1, 64, num_ctas, True).items.folded.tail == tail
  _check_one_device(1, s, 2, 1, 64, dict(causal=True), num_ctas=num_ctas, block_kv=block_kv)


def test_the_balanced_order_in_bands_matches_the_reference():
  """8 query blocks by 2 heads over 13 CTAs, where no folding exists: one band of 8 blocks, head after head
  (``ws_order.band``)."""
  work = np.arange(8, 0, -1)[None]  # one device: block 7 (8 key tiles) first
  assert ws_order.band(work, 4, 4) == 8 and ws_order.band(work, 4, 3) == 1  # over 3 CTAs bands: one 2% busier
  assert ws_order.imbalance(work[0], 4, 4, 8) == 1.0 and ws_order.imbalance(work[0], 2, 3, 8) > 1.2
  p = _plan(1, 1024, 2, 1, 64, 13, True, blocks=WsBlocks(64, 128, 2))
  assert p.items.folded is None and p.items.band == 8
  _check_one_device(1, 1024, 2, 1, 64, dict(causal=True), num_ctas=13, block_kv=128)


def test_heads_in_turn_take_every_item_once_in_order():
  """No forwarder items (one device): item ``t`` is the ``t``-th (batch, query head, query block), blocks fastest;
  with forwarders, one per (batch, K/V head) first, then every other item once."""
  b, h, kv, pairs = 2, 4, 2, 3
  g = h // kv
  every = [(bi, hi, p) for bi in range(b) for hi in range(h) for p in range(pairs)]
  items = [tuple(int(x) for x in round_robin_item(jnp.int32(t), 0, g * pairs, pairs, g, kv)[:3])
           for t in range(len(every))]
  assert items == every
  ringed = [round_robin_item(jnp.int32(t), b * kv, g * pairs, pairs, g, kv) for t in range(len(every))]
  assert [bool(f) for *_, f in ringed] == [True] * (b * kv) + [False] * (len(every) - b * kv)
  assert sorted(tuple(int(x) for x in i[:3]) for i in ringed) == every


def test_split_tail_units():
  split = ws_order.SplitTail.make(16, 8, 3)  # 5 whole rounds, then item 15's 8 units: 3, 3, 2
  assert split.full == 5 and [split.start(c) for c in range(4)] == [0, 3, 6, 8]
  assert split.parts() == {0: [(0, 0), (1, 0), (2, 0)]}
  split = ws_order.SplitTail.make(16, 8, 6)  # 2 whole rounds, then items 12 .. 15: 32 units, 6, 6, 5, 5, 5, 5
  assert split.parts() == {0: [(0, 0), (1, 0)], 1: [(1, 1), (2, 0)], 2: [(2, 1), (3, 0), (4, 0)], 3: [(4, 1), (5, 0)]}
  assert ws_order.SplitTail.make(16, 8, 4) is None and ws_order.SplitTail.make(1, 2, 3) is None


@pytest.mark.parametrize("n,b,h,kv,causal,order,chunks,s,slots", [
    (3, 1, 4, 2, False, "natural", None, 128, 2),  # b * kv = 2 forwarders, 2 non-forwarders, 3 ring steps
    (3, 1, 2, 1, True, "natural", None, 256, 3),  # steps 1, 2 hidden: only the forwarder loads (passes) them
    (2, 1, 2, 1, True, "zigzag", 8, 512, 2),  # 4 chunks a device: hidden, partial and visible runs each step
    (2, 1, 4, 2, True, "zigzag", None, 256, 2),  # balanced: 2 forwarders first, then 6 items by their work
    (2, 1, 2, 1, True, "zigzag", 6, 384, 2),  # 3 chunks a device: not (early, late) pairs, round-robin
], ids=["mha-3", "causal-3", "zigzag8-2", "balanced-gqa", "zigzag6"])
def test_the_forwarding_path_in_a_loopback_ring(n, b, h, kv, causal, order, chunks, s, slots):
  """Forwarders store each tile from SMEM into ``received[s]`` and every item reads step ``s + 1`` from there.

  One device, one CTA, ``n`` ring steps: the forwarders (the CTA's first
  items) store into this device's own ``received``; unwritten ``received``
  rows would be NaN (the interpreter's uninitialised memory).
  """
  check_loopback(_kernel, WsBlocks(64, 64, slots), n, b, s, h, kv, 64, causal, order, chunks)


def _ring_loads(seq: int, n: int, h: int, kv: int, grid: int, balanced: bool) -> list[np.ndarray]:
  """Each device's causal work per CTA (its items' last query positions summed) in a zigzag ring of ``n``, B1,
  items of 128 query rows in the kernel's order; checks that every item runs once and each forwarder first."""
  s, g, rows = seq // n, h // kv, 128
  pairs = s // rows
  order = SequenceOrder.make("zigzag", None, n, s, WsBlocks(64, 128, 2))
  weights = ws_order.weights(order, pairs, rows, n)
  ranks = np.arange(h * pairs)
  if balanced:  # snake order (mosaic_gpu.snake_order): CTA c takes rank i grid + c, odd rounds reversed
    rounds, c = np.divmod(ranks, grid)
    cta = np.where(rounds % 2 == 0, c, grid - 1 - c)
    bi, hi, pair, forwards = (np.asarray(x) for x in ws_order.balanced_item(
        jnp.asarray(ranks), h, h, g, ws_order.band(weights, h, grid, g), order.segment // rows,
        pairs // (order.segment // rows), forwarders=kv))
  else:
    cta = ranks % grid
    bi, hi, pair, forwards = (np.asarray(x) for x in round_robin_item(jnp.asarray(ranks), kv, g * pairs, pairs, g,
                                                                      kv))
  assert len(set(zip(bi.tolist(), hi.tolist(), pair.tolist()))) == h * pairs  # every item once
  first = ranks < grid
  assert sorted(cta[forwards & first].tolist()) == list(range(kv)) and forwards.sum() == kv  # CTA f's first item
  assert sorted(hi[forwards].tolist()) == list(range(0, h, g))  # each group's first head
  return [np.bincount(cta, weights=np.asarray(order.first(dev, pair * rows)) + rows, minlength=grid)
          for dev in range(n)]


@pytest.mark.parametrize("seq,kv,round_robin,balanced", [(16384, 8, 1.11, 1.02), (32768, 32, 1.10, 1.035),
                                                          (65536, 8, 1.023, 1.02)])
def test_the_balanced_order_evens_out_a_zigzag_ring(seq, kv, round_robin, balanced):
  """Two devices, H32, 132 CTAs: round-robin leaves a device's busiest CTA 2-34% above the mean in these cases, the
  balanced order with its forwarders first within 2% (GQA) or 3.5% (MHA: bands of 32 blocks, few K/V heads read at
  once, ``ws_order.band``)."""
  worst = lambda order: max(load.max() / load.mean() for load in _ring_loads(seq, 2, 32, kv, 132, order))
  assert worst(False) > round_robin and worst(True) < balanced


def test_bands_keep_few_kv_heads_read_at_once():
  """One device, B1 H32, 132 CTAs: GQA (8 K/V heads) keeps bands of 1 block at S 4K-16K, 8 at S32K, 16 at S64K;
  MHA's rounds would read 17-32 K/V heads in narrower bands, so it takes bands of 32 blocks (about 5)."""
  blocks = {seq: np.arange(seq // 128, 0, -1)[None] for seq in (4096, 16384, 32768, 65536)}
  assert [ws_order.band(work, 32, 132, g=4) for work in blocks.values()] == [1, 1, 8, 16]
  assert [ws_order.band(work, 32, 132, g=1) for work in blocks.values()] == [32] * 4
  assert [round(ws_order.kv_heads_at_once(128, 32, 1, 132, band)) for band in (1, 8, 32)] == [32, 17, 5]
  assert ws_order.kv_heads_at_once(128, 32, 4, 132, 1) == 8


def _folded_loads(folded: ws_order.Folded) -> tuple[np.ndarray, list]:
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
  folded = ws_order.Folded.make(np.arange(512, 0, -1), 32, 132)
  assert (folded.tail, folded.round_pairs) == (50, 56)
  loads, heads = _folded_loads(folded)
  assert loads.max() / loads.mean() < 1.0001 and ws_order.imbalance(np.arange(512, 0, -1), 32, 132, 32) > 1.001
  assert max(len(x) for x in heads[:2 * folded.round_pairs]) == 2
  assert [ws_order.Folded.make(np.arange(p, 0, -1), 32, 132).tail for p in (128, 256)] == [62, 58]


def test_folded_rounds_need_work_linear_in_the_rank():
  assert ws_order.Folded.make(np.array([9, 7, 4, 2, 1, 1]), 2, 2) is None  # 9 + 1 != 7 + 2: couples unequal
  assert ws_order.Folded.make(np.array([4, 3, 2, 1]), 2, 3) is None  # no tail under 2 blocks: whole pairs of rounds
  assert ws_order.Folded.make(np.arange(6, 0, -1), 1, 2) == ws_order.Folded(1, 6, 2, 2)  # (6, 3), (5, 4); then 2, 1


def test_item_weights_follow_global_positions():
  blocks = WsBlocks(64, 64, 2)
  zigzag = ws_order.weights(SequenceOrder.make("zigzag", 8, 2, 512, blocks), 4, 128, 2)  # true 0 7 1 6 | 2 5 3 4
  assert zigzag.tolist() == [[1024, 896, 256, 128], [768, 640, 512, 384]]
  assert ws_order.weights(SequenceOrder.make("zigzag", 6, 2, 384, blocks), 3, 128, 2) is None  # 0 5 1 | 4 2 3


# ------------------------------------------------------------------ lowering for abstract H100s (no GPU)
def _lower(devices: int, b: int, s: int, h: int, kv: int, d: int, dtype=jnp.bfloat16, **params):
  mesh = h100_mesh(devices)
  spec = lambda heads: jax.ShapeDtypeStruct((b, devices * s, heads, d), dtype, sharding=NamedSharding(mesh, SEQ))
  f = jax.shard_map(lambda q, k, v: fused_ring_attention_ws(q, k, v, "x", **params), mesh=mesh, **SPECS)
  return lower_for_gpus(f, spec(h), spec(kv), spec(kv), mesh=mesh)


def _blocks(blocks: WsBlocks):
  return dict(block_q=blocks.block_q, block_kv=blocks.block_kv, max_concurrent_steps=blocks.max_concurrent_steps)


# Each block configuration once, each shape once, each order once: non-causal MHA and GQA at d 128, causal natural
# and zigzag, small at d 64 (b 2).
RINGS = [((1, 1024, 32, 32, 128), CONFIGS[0], {}), ((1, 1024, 32, 8, 128), CONFIGS[1], {}),
         ((2, 256, 4, 2, 64), CONFIGS[2], {}), ((1, 1024, 32, 8, 128), CONFIGS[2], dict(causal=True)),
         ((2, 256, 4, 2, 64), CONFIGS[0], dict(causal=True, order="zigzag"))]


@pytest.mark.parametrize("shape,blocks,mask", RINGS, ids=["mha", "gqa", "small", "causal-gqa", "causal-zigzag-small"])
def test_the_ring_lowers_for_eight_h100s(shape, blocks, mask):
  """Three warpgroups, barriers, remote TMA stores, per-step semaphores, wgmma with P from registers, and causal
  tile counts by position, hidden tiles that keep the barrier protocol, iota masks lower.

  Lowering for an abstract H100 runs Mosaic GPU's own passes (layouts,
  shared memory: a kernel over 227 KiB fails here); it is no CUDA compile
  (register pressure is ptxas's) and no run.
  """
  text = _lower(8, *shape, num_ctas=132, **mask, **_blocks(blocks))
  assert mosaic_kernels(text) == 1
  assert "all-gather" not in text and "all_gather" not in text and "collective_permute" not in text


# One device over the abstract H100's 132 SMs: without a mask pipelined consumers, a split tail, keys read
# backward; causal the longest-first snake order in bands (S32K) or folded rounds (MHA S16K); fp16 without an SM
# count given; head dimension 192 where one Q buffer a consumer fits (the pipelined accumulators in registers).
ONE_DEVICE = [((1, 4096, 32, 8, 128), {}, {}), ((1, 32768, 32, 8, 128), dict(causal=True), {}),
              ((1, 16384, 32, 32, 128), dict(causal=True), {}),
              ((1, 512, 8, 8, 128), dict(causal=True), dict(dtype=jnp.float16)),
              ((1, 1024, 4, 2, 192), {}, dict(block_kv=64, max_concurrent_steps=3))]


@pytest.mark.parametrize("shape,mask,params", ONE_DEVICE, ids=["split-tail", "banded", "folded", "fp16", "d192"])
def test_one_device_lowers_for_an_h100(shape, mask, params):
  """One device: no received buffers, no semaphores; the default grid is the abstract device's 132 SMs."""
  text = _lower(1, *shape, **mask, **params)
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
  """The estimate covers Mosaic GPU's count (buffers + about 2.7 KiB); every config fits with d = 128."""
  for blocks in CONFIGS:
    assert blocks.problem(128) is None, blocks
  assert WsBlocks(64, 128, 2).smem_bytes(128, 2) >= 167000  # Mosaic GPU's smem_bytes for it, lowered for an H100
  assert "shared memory" in WsBlocks(64, 128, 3).problem(128)  # 232568 bytes > 227 KiB in Mosaic GPU
