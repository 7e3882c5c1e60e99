"""Attention's backward in one warp-specialized Mosaic GPU kernel: dq, dk and dv in one pass (Hopper).

From the forward's output ``o`` and log-sum-exp, the backward of softmax
attention needs, per (query, key) pair, the probability ``p`` again and
``ds = p (dp - delta)`` with ``dp = do . v`` and ``delta = rowsum(o * do)``;
then ``dq = ds k``, ``dk = ds^T q``, ``dv = p^T do`` (scaled by
``1 / sqrt(d)`` where the scores were). The dual programs
(``programs.attention_backward``) run dq and dk-dv apart, so each block pair
recomputes ``p`` twice; cuDNN's flash backward and this kernel compute all
three from one pass over the pairs, as FlashAttention-2 and -3 do: dk and dv
stay in registers while the queries stream by, and dq is added into a float32
buffer in global memory (TMA reduce-add stores).

Loop nest before (the dual programs, per device)::

  for query tile t:                    # dq program
    for key tile u: recompute p, ds; dq[t] += ds k[u]
  for key tile u:                      # dk-dv program
    for query tile t: recompute p, ds; dk[u] += ds^T q[t]; dv[u] += p^T do[t]

After (this kernel; one CTA per work item, three warpgroups run concurrently)::

  memory warpgroup (24 registers):
    for item (bi, query head hq, query chunk c, key pair u) of this CTA:
      wait until the consumers stored the last item's dk, dv (K/V SMEM free)
      TMA k, v rows [2 u block_kv, +2 block_kv) of kv head hq // g -> SMEM   # consumer w's tile: rows w block_kv ..
      for query tile t of chunk c that sees the keys:
        slot = tiles loaded so far % max_concurrent_steps; wait until both consumers released it
        TMA q, lse (base 2), do, delta of (hq, t) -> slot

  consumer warpgroup w in {0, 1} (240 registers per thread):
    for item (bi, hq, c, u) of this CTA:
      dk, dv = 0 (registers, [block_kv, d] float32)
      for t as the memory warpgroup loads them:
        s^T = k_w q^T; dp^T = v_w do^T                      (issued together, one wait)
        p^T = exp2(s^T scale - lse)                         (masked on the diagonal: causal)
        ds^T = p^T (dp^T - delta)
        dv += p^T do; dk += ds^T q                          (issued together)
        ds^T -> SMEM rows w of ds[t % 2]; meet the other consumer (both halves of ds^T in SMEM)
        dq[t, columns c_w] = scale * ds[t % 2]^T k[:, c_w]  # [block_q, d/2]: each consumer half the columns
        wait for dk, dv and dq; release the slot
        TMA reduce-add dq -> dq_acc[bi, t rows, hq, c_w]     # float32, global memory
      meet; dk scale, dv -> K/V SMEM rows w -> TMA store dk, dv [bi, rows, kh]; release K/V SMEM
                                                            # summed: reduce-add into float32 sums

The ds^T store and the meeting run while the tensor cores compute dk and dv
(one wait for the three products of a step). Without a mask a step's dq waits
in the staging buffer until the next step has written its ds^T: one fence
(``commit_smem``) then covers both, and the dq store is sent between it and
the meeting; the item's last dq goes with its dk and dv. Without a mask the
kernel holds the consumers' loop nest twice, once per warpgroup, so that the
offsets of its key rows, dq columns and staging buffer are constants; under a
causal mask one copy serves both warpgroups (its items run a masked and an
unmasked copy of the step already).

Head dimension 64 (half the columns would be 32, under a swizzled tile):
each consumer computes all of dq's columns from its own key tile, and both
add them.

Barrier protocol, as ``ws_forward``'s: every warpgroup that waits on a
barrier waits on every phase of it. Both consumers wait on every "loaded"
phase and meet equally often (once per tile, once per item); the memory
warpgroup waits on every "consumed" phase (before refilling a slot, the last
ones at the end) and every "K/V free" phase (before the next item's K/V, the
last at the end). The two ``ds`` buffers alternate by tile: a consumer
writes ``ds[t % 2]`` only after the meeting of tile ``t - 1``, which the
other consumer reaches after its dq of tile ``t - 2`` (which read that
buffer) retired.

Causal: queries and keys share positions (``s_q == s_kv``, top-left
aligned); an item's query tiles start at the first that sees its keys
(``first_tile``), and each consumer masks (``p = 0`` where key > query) the
tiles that are not wholly visible to its key tile (``probabilities``).

Items: (batch, query head: a lane; query chunk; key pair), one CTA each, in
rank order: the hardware starts the next CTA on an SM as one ends there, so
the items balance as they end (under a causal mask the longest first). Ranks
go lane by lane (the CTAs side by side share a head: its queries and dq rows
in L2), each lane's items chunk by chunk (causal: the last chunks, which see
the most key pairs, first), key pairs innermost.

Query chunks (``BackwardBlocks.query_chunks``; by default ``auto_chunks``:
without a mask chunks of at most ``CHUNK_ROWS`` queries, none under a causal
mask): an item runs its key pair over one part of the query range; the
memory warpgroup loads, and the consumers run, that chunk's query tiles only.
Where several items add into one K/V head's dk and dv (the queries in chunks,
or grouped K/V: each of a K/V head's query heads is an item of its own), the
items add their float32 parts into sums in global memory (TMA reduce-add
stores through the dq staging, ``dq_cols`` columns at a time), cast after
the kernel.

Interpret mode (CPU): the same warpgroups, barriers and loop nest; the
interpreter's wgmma takes its left operand from SMEM only, so the products
with ``p^T`` and ``ds^T`` in registers are plain dots there (so dv and dk
wait before the ds^T store and the meeting, dq after them), and it has no
reduce-add stores, so each CTA adds its dq by loads and stores into a buffer
of its own (the two consumers' columns apart, or one after the other),
summed after the kernel.

Stages: ``_Producer`` (the memory warpgroup: per item its K/V, per query
tile the streamed rows), ``_Consumer`` (per tile ``step``: the scores,
``probabilities`` with the causal mask, the gradients' products; per item
``item`` and its epilogue, dk and dv stored or added into the sums), and
``_Items`` (which item a CTA runs, and its query tiles: which tiles are
masked, ``first_tile`` and ``_Consumer.item``'s ``t_vis``).

Preconditions (``PreconditionError`` otherwise): bf16 or fp16 ``q, k, v,
do`` of one dtype; ``d`` 64 or 128; ``block_q`` and ``block_kv`` 64;
``s_q`` a multiple of ``block_q``; ``s_kv`` a multiple of ``2 block_kv``;
causal only with ``s_q == s_kv``; ``kv`` divides ``h``.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from jaxmercury.errors import PreconditionError
from jaxmercury.kernels.attention import ws_mask
from jaxmercury.kernels.config import param
from jaxmercury.kernels.fused_common import positive_ints
from jaxmercury.kernels.mosaic_gpu import SMEM_BYTES, snake_order, swizzled

NAME = "attention_backward_ws"
LOG2E = math.log2(math.e)
CONSUMERS = 2
CONSUMER_REGISTERS, MEMORY_REGISTERS = 240, 24  # per thread
SMEM_OVERHEAD = 3 * 1024  # barriers and alignment (as ws_forward's)
CHUNK_ROWS = 32768  # auto_chunks without a mask: query rows per chunk at most
HALF = frozenset({jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)})
ITEM_HEADS = 1  # query heads per item: grouped K/V adds its heads' dk and dv across items


@dataclasses.dataclass(frozen=True, kw_only=True)
class BackwardBlocks:
  """Tiles of the backward kernel: ``block_q`` query rows streamed per step, ``block_kv`` key rows per consumer
  warpgroup (a work item is ``2 block_kv`` keys), ``max_concurrent_steps`` query-side SMEM slots; and
  ``query_chunks``, how many parts of the query range an item's key pair runs over (``None``: ``auto_chunks``, by
  the length and the mask), dk and dv added up across them (module docstring)."""

  block_q: int = param(64)
  block_kv: int = param(64)
  max_concurrent_steps: int = param(2)
  query_chunks: int | None = param(None)

  def smem_bytes(self, d: int, itemsize: int, mask: bool = False) -> int:
    """K and V of both consumers, the Q/dO slots with their lse and delta rows (with ``mask``, the mask array's
    bytes of both consumers' keys), two ds buffers, the dq staging."""
    bq, bkv, slots = self.block_q, self.block_kv, self.max_concurrent_steps
    kv = 2 * CONSUMERS * bkv * d * itemsize
    streamed = slots * (2 * bq * d * itemsize + 2 * 4 * bq + (CONSUMERS * bkv * bq if mask else 0))
    ds = 2 * CONSUMERS * bkv * bq * itemsize
    dq = CONSUMERS * bq * _dq_columns(d) * 4
    return kv + streamed + ds + dq + SMEM_OVERHEAD

  def chunks(self, s_q: int, causal: bool) -> int:
    """The query chunks of ``s_q`` queries: ``query_chunks``, else ``auto_chunks``'."""
    return self.query_chunks or auto_chunks(s_q, causal)

  def summed(self, s_q: int, causal: bool, group: int = 1) -> bool:
    """Whether several items add into each K/V head's dk and dv (float32 sums in global memory): the queries in
    chunks, or a K/V head's ``group`` query heads over several items."""
    return self.chunks(s_q, causal) > 1 or group > ITEM_HEADS

  def problem(self, d: int, itemsize: int = 2, mask: bool = False) -> str | None:
    """Why these tiles cannot compile for head dimension ``d`` (``mask``: with a mask array's tiles), or None."""
    if self.block_q != 64 or self.block_kv != 64:
      return (f"block_q={self.block_q} and block_kv={self.block_kv} must be 64 (the registers hold dk and dv of "
              "64 keys and 64-query score tiles)")
    if d not in (64, 128):
      return f"head dimension {d} must be 64 or 128 (dk and dv of 64 keys in registers)"
    if self.query_chunks is not None and positive_ints(self, "query_chunks"):
      return f"query_chunks={self.query_chunks!r} must be None (auto_chunks) or a positive int"
    if self.max_concurrent_steps < 2:
      return f"max_concurrent_steps={self.max_concurrent_steps} must be at least 2"
    if (need := self.smem_bytes(d, itemsize, mask)) > SMEM_BYTES:
      return f"needs {need} bytes of shared memory, over the {SMEM_BYTES} a CTA has"
    return None


def _dq_columns(d: int) -> int:
  """dq columns each consumer computes: half of them where a half is whole swizzled tiles (64 columns)."""
  return d // 2 if (d // 2) % 64 == 0 else d


def auto_chunks(s_q: int, causal: bool) -> int:
  """``BackwardBlocks.query_chunks=None``'s chunks of ``s_q`` queries: without a mask the fewest of at most
  ``CHUNK_ROWS`` rows; under a causal mask none (the items, one query head each, run the diagonal in turn by
  head)."""
  if causal:
    return 1
  return max(1, -(-s_q // CHUNK_ROWS))


def attention_backward_ws(q, k, v, o, do, lse, *, causal: bool = False, blocks: BackwardBlocks = BackwardBlocks(),
                          interpret: bool = False, window: tuple[int, int] | None = None, q_segment_ids=None,
                          kv_segment_ids=None, offset=0, mask=None):
  """``(dq, dk, dv)`` of softmax attention from its output and log-sum-exp, in one kernel.

  Args:
    q, do: ``[b, s_q, h, d]``, bf16 or fp16 (one dtype, ``k``'s and ``v``'s too).
    o: the forward's output, ``[b, s_q, h, d]``, any float dtype (it gives ``delta = rowsum(o * do)``).
    k, v: ``[b, s_kv, kv, d]``; ``kv`` divides ``h`` (query head ``hq`` reads kv head ``hq // (h / kv)``).
    lse: ``[b, h, s_q]`` float32, natural log: the forward's log-sum-exp of the scaled scores (``-inf`` for a
      row that kept no key: its gradients are zero).
    causal: query ``i`` sees keys ``j <= i`` (``s_q == s_kv``).
    blocks: the tiles (``BackwardBlocks``).
    interpret: Mosaic GPU interpret mode (CPU).
    window: ``(left, right)``: query ``x`` keeps keys ``x - left .. x + right``.
    q_segment_ids, kv_segment_ids: ``[b, s_q]`` and ``[b, s_kv]`` int32 (both or
      neither): a query keeps the keys of its own id (packed sequences).
    offset: with a window, segment ids or a mask array, the position of the
      first query minus that of the first key (int or traced int32 scalar).
    mask: a boolean mask array ``[b or 1, h or 1, s_q, s_kv]`` (a query keeps
      the keys it marks; batch and heads broadcast where of size 1).

  With a window, segment ids or a mask array the kernel takes its masked path
  (``ws_mask``): an item's query tiles are those that keep any of its keys,
  tiles every query keeps whole are not compared. A mask array is read
  transposed (keys by queries, once per call, as the consumers' ``p^T``
  tiles): its partial tiles come as bytes beside Q (TMA, the Q barrier).

  Returns:
    ``dq [b, s_q, h, d]`` float32, ``dk, dv [b, s_kv, kv, d]`` in the inputs' dtype.

  Raises:
    PreconditionError: shapes, dtypes or tiles the kernel does not take (module docstring).
  """
  masking = ws_mask.Masking.make(causal, window, q_segment_ids is not None or kv_segment_ids is not None,
                                 mask is not None)
  _check(q, k, v, o, do, lse, causal and masking is None, blocks, mask)
  delta = jnp.einsum("bshd,bshd->bhs", o.astype(jnp.float32), do.astype(jnp.float32))
  lse2 = jnp.where(jnp.isfinite(lse), lse * LOG2E, jnp.inf)  # a row without keys: p = exp2(-inf) = 0
  if masking is not None:
    extras = _masked_inputs(q, k, blocks, masking, q_segment_ids, kv_segment_ids, offset, mask)
    return _kernel(q, k, v, do, lse2.astype(jnp.float32), delta, False, blocks, interpret, masking, extras)
  return _kernel(q, k, v, do, lse2.astype(jnp.float32), delta, causal, blocks, interpret)


def _masked_inputs(q, k, blocks: BackwardBlocks, masking: ws_mask.Masking, q_ids, kv_ids, offset,
                   mask=None) -> tuple:
  """The masked path's inputs: the items' table (``ws_mask.item_table``: lanes, each item's query tiles: those of
  its chunk that keep any of its keys), the key tiles' summaries, the offset; with ids, the query ids and the key
  ids by key tile; with a mask array, ``_array_inputs``' (the table from them)."""
  b, s, h, _ = q.shape
  skv, kv = k.shape[1], k.shape[2]
  if masking.ids:
    for name, ids, n in (("q_segment_ids", q_ids, s), ("kv_segment_ids", kv_ids, skv)):
      if ids is None or ids.shape != (b, n) or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise PreconditionError(f"{NAME}: {name} must be integer ids [b, {n}] (both ids or neither); got "
                                f"{None if ids is None else (ids.shape, str(ids.dtype))}")
    q_ids, kv_ids = q_ids.astype(jnp.int32), kv_ids.astype(jnp.int32)
  else:
    q_ids = kv_ids = None
  offset = jnp.asarray(offset, jnp.int32)
  bq, bkv, keys = blocks.block_q, blocks.block_kv, CONSUMERS * blocks.block_kv
  summary = ws_mask.summaries(masking, kv_ids, q_ids, offset, False, (b, skv, s), bkv)
  plan = chunk_plan(s // bq, item_chunks(blocks, s, False, masking), bq, keys, skv // keys, False)
  ids = (q_ids, kv_ids.reshape(b, skv // bkv, bkv)) if masking.ids else ()
  if masking.array:
    table, arrays = _array_inputs(summary if masking.ids else summary[:1], mask, plan, (b, h), (bq, bkv))
    return (table, summary, offset.reshape(1)) + ids + arrays
  first, count = ws_mask.spans(summary, CONSUMERS, bq)  # [b, key pairs] query tiles
  lo = jnp.array([c_lo for c_lo, _, _ in plan for _ in range(skv // keys)], jnp.int32)
  hi = jnp.array([c_hi for _, c_hi, _ in plan for _ in range(skv // keys)], jnp.int32)
  first, end = jnp.tile(first, (1, len(plan))), jnp.tile(first + count, (1, len(plan)))
  t0, t_end = jnp.maximum(first, lo), jnp.minimum(end, hi)
  table = ws_mask.item_table(t0, jnp.maximum(t_end - t0, 0), kv * (h // kv // ITEM_HEADS))
  return (table, summary, offset.reshape(1)) + ids


def _array_inputs(summary, mask, plan, batch_heads: tuple[int, int], tiles: tuple[int, int]):
  """With a mask array: the items' table (each item's range of its key pair's list of query tiles, cut to its
  chunk; ``batch_heads``: ``(b, h)``), and the kernel's ``(kinds [kb, mh, key tiles, query tiles], lists
  [kb, mh, key pairs, query tiles], bytes [mb * mh, s_kv, s_q])`` of the transposed mask (``ws_mask``)."""
  assert ITEM_HEADS == 1, "an item's query head indexes the mask's heads"
  (b, h), (bq, bkv) = batch_heads, tiles
  keys_first = jnp.swapaxes(mask, 2, 3)  # [mb, mh, s_kv, s_q]: the consumers' p^T tiles
  kinds = ws_mask.mask_kinds(summary, keys_first, bkv, bq)
  lists, count = ws_mask.tile_lists(kinds, CONSUMERS)
  ranges = [ws_mask.list_ranges(lists, count, lo, hi) for lo, hi, _ in plan]  # groups chunk-major
  first, count = (jnp.concatenate(r, axis=-1) for r in zip(*ranges))  # [kb, mh, groups]
  return ws_mask.list_table(first, count, b, h), (kinds, lists, ws_mask.mask_bytes(keys_first))


def _check(q, k, v, o, do, lse, causal: bool, blocks: BackwardBlocks, mask=None) -> None:
  if q.ndim != 4 or k.ndim != 4 or q.shape != o.shape or q.shape != do.shape or k.shape != v.shape:
    raise PreconditionError(f"{NAME}: q, o, do must be [b, s_q, h, d] and k, v [b, s_kv, kv, d] of one shape "
                            f"each; got q {q.shape}, k {k.shape}, v {v.shape}, o {o.shape}, do {do.shape}")
  b, s, h, d = q.shape
  kb, skv, kv, kd = k.shape
  if (kb, kd) != (b, d) or h % kv:
    raise PreconditionError(f"{NAME}: k {k.shape} must share q's batch {b} and head dimension {d}, and its "
                            f"{kv} heads divide q's {h}")
  dtypes = {jnp.dtype(x.dtype) for x in (q, k, v, do)}
  if len(dtypes) != 1 or not dtypes <= HALF:
    raise PreconditionError(f"{NAME}: q, k, v, do must all be bfloat16 or all float16, got "
                            f"{sorted(map(str, dtypes))}")
  if lse.shape != (b, h, s):
    raise PreconditionError(f"{NAME}: lse must be [b, h, s_q] = {(b, h, s)}, got {lse.shape}")
  if reason := blocks.problem(d, q.dtype.itemsize, mask is not None):
    raise PreconditionError(f"{NAME}: {reason}")
  if mask is not None:
    ws_mask.check_array(NAME, mask, b, h, s, skv)
  if s % blocks.block_q or skv % (CONSUMERS * blocks.block_kv):
    raise PreconditionError(f"{NAME}: s_q={s} must be a multiple of block_q={blocks.block_q} and s_kv={skv} of "
                            f"2 * block_kv = {CONSUMERS * blocks.block_kv} (a work item's two key tiles)")
  if causal and s != skv:
    raise PreconditionError(f"{NAME}: causal takes queries and keys at the same positions; s_q={s} != s_kv={skv}")
  if (blocks.query_chunks or 1) > s // blocks.block_q:
    raise PreconditionError(f"{NAME}: query_chunks={blocks.query_chunks} is more than the {s // blocks.block_q} "
                            f"query tiles of {blocks.block_q} rows; pass at most that many, or None")


def _add(target, staged):
  """``target += staged`` by a load and a store: interpret mode's reduce-add store (into its CTA's own buffer)."""
  target[...] = target[...] + staged[...]


def item_chunks(blocks: BackwardBlocks, s_q: int, causal: bool, masking: ws_mask.Masking | None) -> int:
  """The chunks of ``s_q`` queries the items run in (``BackwardBlocks.chunks``): the masked path's items are short,
  chunked as causal ones. The items' table and the kernel's grid both take it."""
  return blocks.chunks(s_q, causal or masking is not None)


def chunk_plan(nq: int, chunks: int, bq: int, keys: int, pairs: int, causal: bool) -> list[tuple[int, int, int]]:
  """``(first query tile, end tile, key pairs)`` of each of ``chunks`` parts of ``nq`` query tiles, in the order
  their items run: under a causal mask the pairs each chunk's queries see, the last chunks (most pairs) first."""
  bounds = [c * nq // chunks for c in range(chunks + 1)]
  plan = [(lo, hi, min(pairs, -(-hi * bq // keys)) if causal else pairs) for lo, hi in zip(bounds, bounds[1:])]
  return plan[::-1] if causal else plan


def first_tile(kv0, bq: int, causal: bool):
  """The first query tile that sees key row ``kv0`` (causal; else 0)."""
  return kv0 // bq if causal else 0


@dataclasses.dataclass(frozen=True)
class _Plan(ws_mask.MaskedPlan):
  """What one call runs: shapes, tiles, items and the consumers' variant (static)."""

  b: int
  s: int  # queries
  h: int
  d: int
  kv: int
  g: int  # query heads per K/V head
  dtype: jnp.dtype
  bq: int
  bkv: int
  slots: int
  keys: int  # key rows per item
  parts: int  # items per (batch, kv head, chunk, key pair): one per query head
  summed: bool  # several items add into each K/V head's dk and dv (float32 sums)
  lanes: int  # (batch, kv head, query head of its group)
  plan: tuple  # chunk_plan's
  starts: tuple  # each chunk's first item of a lane
  per_head: int  # items per lane
  work: int
  grid: int  # one CTA per item
  dq_cols: int
  split: bool  # each consumer half of dq's columns, from both key tiles
  scale: float
  scale_log2: float
  overlapped: bool  # dk, dv and dq in one wait (GPUs); interpret mode: two (its products are dots)
  specialized: bool  # a copy of the consumers' code per warpgroup, its SMEM offsets constants (no mask)
  deferred: bool  # a step's dq sent after the next step's ds^T fence (no mask)
  causal: bool
  interpret: bool
  masking: ws_mask.Masking | None = None  # the masked path (window, segment ids): items and query tiles by a table

  @property
  def keys_pairs(self) -> int:
    """Key pairs (items of a lane and chunk): the masked path's groups are chunk-major."""
    return self.plan[0][2]

  @staticmethod
  def make(q, k, causal: bool, blocks: BackwardBlocks, interpret: bool,
           masking: ws_mask.Masking | None = None) -> _Plan:
    b, s, h, d = q.shape
    kv = k.shape[2]
    g = h // kv
    bq, bkv = blocks.block_q, blocks.block_kv
    keys = CONSUMERS * bkv  # key rows per item
    nq, pairs = s // bq, k.shape[1] // keys
    banded = causal or masking is not None
    chunks = item_chunks(blocks, s, causal, masking)
    parts = g // ITEM_HEADS
    lanes = b * kv * parts
    plan = chunk_plan(nq, chunks, bq, keys, pairs, causal)
    starts = [0, *itertools.accumulate(n for _, _, n in plan)]  # each chunk's first item of a lane
    per_head = starts.pop()
    dq_cols = _dq_columns(d)
    scale = 1.0 / math.sqrt(d)
    return _Plan(b=b, s=s, h=h, d=d, kv=kv, g=g, dtype=q.dtype, bq=bq, bkv=bkv, slots=blocks.max_concurrent_steps,
                 keys=keys, parts=parts, summed=blocks.summed(s, banded, g), lanes=lanes, plan=tuple(plan),
                 starts=tuple(starts), per_head=per_head, work=lanes * per_head, grid=lanes * per_head,
                 dq_cols=dq_cols, split=dq_cols < d, scale=scale, scale_log2=LOG2E * scale,
                 overlapped=not interpret, specialized=not banded, deferred=not banded, causal=causal,
                 interpret=interpret, masking=masking)


def _kernel(q, k, v, do, lse2, delta, causal: bool, blocks: BackwardBlocks, interpret: bool,
            masking: ws_mask.Masking | None = None, extras: tuple = ()):
  p = _Plan.make(q, k, causal, blocks, interpret, masking)
  bq, d, dtype, slots, keys = p.bq, p.d, p.dtype, p.slots, p.keys
  tiles = swizzled(d, dtype)
  ds_tiles = swizzled(bq, dtype)
  dq_tiles = swizzled(p.dq_cols, jnp.float32)
  scratch = [plgpu.SMEM((slots, bq, d), dtype, transforms=tiles),  # q
             plgpu.SMEM((slots, bq, d), dtype, transforms=tiles),  # do
             plgpu.SMEM((slots, bq), jnp.float32),  # lse (base 2)
             plgpu.SMEM((slots, bq), jnp.float32),  # delta
             plgpu.SMEM((keys, d), dtype, transforms=tiles),  # k of both consumers; dk on the way out
             plgpu.SMEM((keys, d), dtype, transforms=tiles),  # v; dv on the way out
             plgpu.SMEM((2, keys, bq), dtype, transforms=ds_tiles),  # ds^T, two buffers
             plgpu.SMEM((CONSUMERS, bq, p.dq_cols), jnp.float32, transforms=dq_tiles),  # dq staging
             plgpu.Barrier(num_arrivals=2 if p.ids else 1),  # K loaded (and its ids)
             plgpu.Barrier(),  # V loaded
             # Q and lse loaded (and Q's ids, the slot's mask tiles)
             plgpu.Barrier(num_arrivals=2 + p.ids + CONSUMERS * p.array, num_barriers=slots),
             plgpu.Barrier(num_arrivals=2, num_barriers=slots),  # dO and delta loaded
             plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=slots),  # slot released by both consumers
             plgpu.Barrier(num_arrivals=CONSUMERS),  # K/V SMEM free (dk, dv stored)
             plgpu.Barrier(num_arrivals=CONSUMERS)]  # the consumers' meetings
  if p.ids:  # each slot's query ids, both consumers' key ids
    scratch += [plgpu.SMEM((slots, bq), jnp.int32), plgpu.SMEM((CONSUMERS, p.bkv), jnp.int32)]
  if p.array:  # each slot's mask tiles, one per consumer's keys (swizzled: the loads' rows hit every bank)
    scratch.append(plgpu.SMEM((slots, CONSUMERS, p.bkv, bq), jnp.uint8, transforms=swizzled(bq, jnp.uint8)))
  # dq is added into a float32 buffer; in interpret mode one per CTA (no reduce-add stores there), summed after
  per_cta = (p.grid,) if interpret else ()
  dq_acc = jax.new_ref(jnp.zeros(per_cta + q.shape, jnp.float32))
  sums = [jax.new_ref(jnp.zeros(per_cta + k.shape, jnp.float32)) for _ in "kv"] if p.summed else []
  kv_type = jax.ShapeDtypeStruct(k.shape, dtype)
  outs = plgpu.kernel(
      functools.partial(_body, p), out_type=[] if sums else [kv_type, kv_type], scratch_types=scratch,
      grid=(p.grid,), grid_names=("cta",), kernel_name=NAME, num_threads=CONSUMERS + 1, thread_name="wg",
      compiler_params=None if interpret else plgpu.CompilerParams(approx_math=True),
      interpret=plgpu.InterpretGPUParams() if interpret else None)(q, k, v, do, lse2, delta, *extras, dq_acc, *sums)
  total = lambda ref: ref[...].sum(axis=0) if interpret else ref[...]
  dk, dv = [total(ref).astype(dtype) for ref in sums] if sums else outs
  return total(dq_acc), dk, dv


@dataclasses.dataclass(frozen=True)
class _Refs:
  """The kernel's operands (dk and dv: float32 sums where summed, else its outputs) and scratch."""

  q: object
  k: object
  v: object
  do: object
  lse: object  # base 2
  delta: object
  dq: object  # float32, [CTA] + in interpret mode
  dk: object
  dv: object
  q_smem: object  # [slot]
  do_smem: object
  lse_smem: object
  delta_smem: object
  k_smem: object  # both consumers' key rows; dk on the way out
  v_smem: object
  ds_smem: object  # [t % 2]: ds^T
  dq_smem: object  # [consumer]: the dq staging
  k_loaded: object
  v_loaded: object
  q_loaded: object  # [slot]
  do_loaded: object
  consumed: object  # [slot], both consumers arrive
  kv_free: object
  meeting: object
  items: object = None  # the masked path (ws_mask): the items' table, the key tiles' summaries, the offset
  k_summary: object = None
  offset: object = None
  q_ids: object = None  # with segment ids: [b, s_q], and [b, s_kv / block_kv, block_kv]
  k_ids: object = None
  qid_smem: object = None  # [slot]
  kid_smem: object = None  # [consumer]
  kinds: object = None  # with a mask array: [kb, mh, key tiles, query tiles] (ws_mask.mask_kinds)
  tiles: object = None  # [kb, mh, key pairs, query tiles]: each key pair's query tiles (ws_mask.tile_lists)
  mask: object = None  # [mb * mh, s_kv, s_q] bytes, keys first (ws_mask.mask_bytes)
  mask_smem: object = None  # [slot, consumer]: the slot's mask tiles

  @staticmethod
  def unpack(p: _Plan, *refs) -> _Refs:
    refs = list(refs)
    inputs, refs = refs[:6], refs[6:]
    masked = [refs.pop(0) for _ in range(3)] if p.masking else [None] * 3
    ids = [refs.pop(0) for _ in range(2)] if p.ids else [None] * 2
    arrays = [refs.pop(0) for _ in range(3)] if p.array else [None] * 3
    mask_smem = refs.pop() if p.array else None
    id_smem = [refs.pop(-2), refs.pop()] if p.ids else [None] * 2
    # refs: dq, dk, dv (sums or outputs), the scratch
    return _Refs(*inputs, *refs, *masked, *ids, *id_smem, *arrays, mask_smem)


class _Items:
  """The items of CTA ``cta`` (traced): ``count`` of them in snake order, ``item(i)`` the ``i``-th, ``steps``
  over its query tiles."""

  def __init__(self, p: _Plan, cta, refs: _Refs):
    self.p, self.refs, self.table = p, refs, refs.items
    self.count, self.rank_of = snake_order(p.work, p.grid, cta)

  def item(self, i):
    """Item ``i`` of this CTA, ``(batch, kv head, first query head, first key row, first query tile, end tile)``:
    lanes (batch, kv head, query head of its group) in turn, each lane's items chunk by chunk, key pairs
    innermost; causal: in each chunk the first pairs see the most queries."""
    p = self.p
    rank = self.rank_of(i)
    if p.masking:  # the table's row: its lane, group (chunk and key pair) and query tiles
      lane, j, first, count = (self.table[rank, column] for column in range(ws_mask.TABLE))
      kh = lax.rem(lane // p.parts, p.kv)
      first_head = kh * p.g + lax.rem(lane, p.parts) * ITEM_HEADS
      return lane // (p.kv * p.parts), kh, first_head, lax.rem(j, p.keys_pairs) * p.keys, first, first + count
    lane, j = rank // p.per_head, lax.rem(rank, p.per_head)
    (lo, hi, _), pair = p.plan[0], j
    for (first, end, _), start in zip(p.plan[1:], p.starts[1:]):  # the chunk holding j
      later = j >= start
      lo, hi, pair = jnp.where(later, first, lo), jnp.where(later, end, hi), jnp.where(later, j - start, pair)
    kv0, kh = pair * p.keys, lax.rem(lane // p.parts, p.kv)
    first_head = kh * p.g + lax.rem(lane, p.parts) * ITEM_HEADS
    return lane // (p.kv * p.parts), kh, first_head, kv0, jnp.maximum(lo, first_tile(kv0, p.bq, p.causal)), hi

  def query_tile(self, bi, hq, kv0, entry):
    """The query tile of an item's ``entry`` (the masked path: itself; with a mask array, entry ``entry`` of its
    key pair's list, ``ws_mask.tile_lists``)."""
    p, refs = self.p, self.refs
    if not p.array:
      return entry
    kb, mh = refs.tiles.shape[:2]
    return refs.tiles[bi if kb > 1 else 0, hq if mh > 1 else 0, kv0 // p.keys, entry]

  def kind(self, summary, bi, hq, key_tile, t):
    """``ws_mask``'s kind (int32) of query tile ``t`` by key tile ``key_tile``: from the key tile's summary
    (``ws_mask.tile_kind``), or with a mask array from its combined kinds (``ws_mask.mask_kinds``)."""
    p, refs = self.p, self.refs
    if p.array:
      kb, mh = refs.kinds.shape[:2]
      return refs.kinds[bi if kb > 1 else 0, hq if mh > 1 else 0, key_tile, t]
    return ws_mask.tile_kind(summary.__getitem__, t * p.bq, t * p.bq + p.bq - 1)

  def steps(self, runs, step, state):
    """``step(j, t, tag, state)`` over an item's query heads (``j``: from its first) and, for each, the query
    tiles ``t`` of its ``runs``, ``(first tile, end tile, tag)``, in order."""
    def head(j, state):
      for lo, hi, tag in runs:
        state = lax.fori_loop(lo, hi, lambda t, state, tag=tag: step(j, t, tag, state), state)
      return state
    return lax.fori_loop(0, ITEM_HEADS, head, state)


def _body(p: _Plan, *refs):
  """One CTA: its memory warpgroup (``_Producer``) and its two consumers (``_Consumer``)."""
  refs = _Refs.unpack(p, *refs)
  cta = lax.axis_index("cta")
  wg = lax.axis_index("wg")
  items = _Items(p, cta, refs)
  pl.when(wg == CONSUMERS)(lambda: _Producer(p, refs, items).run())
  pl.when(wg < CONSUMERS)(lambda: _consumers(p, refs, items, cta, wg))


class _Producer:
  """The memory warpgroup: per item its K and V rows, then per query tile the streamed Q, dO, lse and delta rows
  into the slots the consumers released."""

  def __init__(self, p: _Plan, refs: _Refs, items: _Items):
    self.p, self.refs, self.items = p, refs, items

  def run(self):
    p, refs = self.p, self.refs
    plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")
    loaded = lax.fori_loop(0, self.items.count, self.item, jnp.int32(0))

    @pl.loop(jnp.maximum(loaded - p.slots, 0), loaded)
    def _drain(n):  # observe the consumers' last releases (every waiter sees every phase)
      plgpu.barrier_wait(refs.consumed.at[lax.rem(n, p.slots)])

    pl.when(self.items.count > 0)(lambda: plgpu.barrier_wait(refs.kv_free))

  def item(self, i, loaded):
    p, refs = self.p, self.refs
    bi, kh, h0, kv0, t0, t_end = self.items.item(i)
    pl.when(i > 0)(lambda: plgpu.barrier_wait(refs.kv_free))  # the last item's dk, dv left K/V SMEM
    rows = pl.ds(kv0, p.keys)
    plgpu.copy_gmem_to_smem(refs.k.at[bi, rows, kh], refs.k_smem, refs.k_loaded)
    plgpu.copy_gmem_to_smem(refs.v.at[bi, rows, kh], refs.v_smem, refs.v_loaded)
    if p.ids:  # both consumers' key ids, by key tile
      plgpu.copy_gmem_to_smem(refs.k_ids.at[bi, pl.ds(kv0 // p.bkv, CONSUMERS)], refs.kid_smem, refs.k_loaded)
    return self.items.steps([(t0, t_end, None)], functools.partial(self.tile, bi, h0, kv0), loaded)

  def tile(self, bi, h0, kv0, j, entry, _, loaded):
    """The query tile of entry ``entry`` (``_Items.query_tile``) of head ``h0 + j`` into the next slot; with a mask
    array, its bytes by both consumers' keys."""
    p, refs = self.p, self.refs
    hq, slot = h0 + j, lax.rem(loaded, p.slots)
    t = self.items.query_tile(bi, hq, kv0, entry)
    pl.when(loaded >= p.slots)(lambda: plgpu.barrier_wait(refs.consumed.at[slot]))
    qrows = pl.ds(t * p.bq, p.bq)
    plgpu.copy_gmem_to_smem(refs.q.at[bi, qrows, hq], refs.q_smem.at[slot], refs.q_loaded.at[slot])
    plgpu.copy_gmem_to_smem(refs.lse.at[bi, hq, qrows], refs.lse_smem.at[slot], refs.q_loaded.at[slot])
    plgpu.copy_gmem_to_smem(refs.do.at[bi, qrows, hq], refs.do_smem.at[slot], refs.do_loaded.at[slot])
    plgpu.copy_gmem_to_smem(refs.delta.at[bi, hq, qrows], refs.delta_smem.at[slot], refs.do_loaded.at[slot])
    if p.ids:
      plgpu.copy_gmem_to_smem(refs.q_ids.at[bi, qrows], refs.qid_smem.at[slot], refs.q_loaded.at[slot])
    if p.array:  # a copy per consumer's keys: 2D tiles (a TMA copy strides at most 5 dimensions)
      index = ws_mask.array_index(refs.kinds, refs.mask.shape[0], bi, hq)
      for w in range(CONSUMERS):
        plgpu.copy_gmem_to_smem(refs.mask.at[index, pl.ds(kv0 + w * p.bkv, p.bkv), qrows],
                                refs.mask_smem.at[slot, w], refs.q_loaded.at[slot])
    return loaded + 1


def _consumers(p: _Plan, refs: _Refs, items: _Items, cta, wg):
  """Both consumer warpgroups: without a mask a copy of the code per warpgroup (its SMEM offsets constants)."""
  plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
  if p.specialized:
    for w in range(CONSUMERS):
      pl.when(wg == w)(lambda w=w: _Consumer(p, refs, items, cta, w).run())
  else:
    _Consumer(p, refs, items, cta, wg).run()


class _Consumer:
  """Consumer warpgroup ``wg`` (an int: specialized; else the traced warpgroup index): its key tile of each item
  against the item's query tiles, dk and dv in registers, dq added into the float32 buffer."""

  def __init__(self, p: _Plan, refs: _Refs, items: _Items, cta, wg):
    self.p, self.refs, self.items, self.cta, self.wg = p, refs, items, cta, wg
    self.own = own = pl.ds(wg * p.bkv, p.bkv)  # this consumer's key rows in K/V SMEM
    self.k_own, self.v_own = refs.k_smem.at[own], refs.v_smem.at[own]
    if p.split:
      self.dq_a, self.dq_b, self.dq_at = (lambda buf: refs.ds_smem.at[buf],
                                          refs.k_smem.at[:, pl.ds(wg * p.dq_cols, p.dq_cols)], wg * p.dq_cols)
    else:
      self.dq_a, self.dq_b, self.dq_at = lambda buf: refs.ds_smem.at[buf, own], self.k_own, 0
    self.col = plgpu.Layout.WGMMA.reduce(0)  # a vector along the columns (queries) of a [keys, queries] tile

  def run(self):
    lax.fori_loop(0, self.items.count, self.item, jnp.int32(0))
    plgpu.wait_smem_to_gmem(0, wait_read_only=False)

  def meet(self):
    plgpu.barrier_arrive(self.refs.meeting)
    plgpu.barrier_wait(self.refs.meeting)

  # ---------------------------------------------------------------- products
  def product(self, acc, a, b_smem):
    """``acc + a @ b_smem`` for ``a`` in registers (the interpreter's wgmma takes SMEM only: a plain dot)."""
    if self.p.interpret:
      return acc + jnp.dot(a, b_smem[...], preferred_element_type=jnp.float32)

    def issue(acc_ref):
      plgpu.wgmma(acc_ref, a, b_smem)
      plgpu.wgmma_wait(0)
    return pl.run_state(issue)(plgpu.ACC.init(acc))

  def scores(self, a_smem, b_smem, shape):
    """``a_smem @ b_smem`` from SMEM, float32."""
    def issue(acc_ref):
      plgpu.wgmma(acc_ref, a_smem, b_smem)
      plgpu.wgmma_wait(0)
      return acc_ref[...]
    return pl.run_scoped(issue, plgpu.ACC(shape, jnp.float32))

  def rows(self, slot):
    """The step's lse (base 2) and delta, one per query column of this thread's tile elements."""
    refs = self.refs
    return plgpu.load(refs.lse_smem.at[slot], layout=self.col), plgpu.load(refs.delta_smem.at[slot], layout=self.col)

  def two_scores(self, slot):
    """``(k_w q^T, v_w do^T, lse, delta)``, the products float32: both wgmmas issued together, one wait; the rows
    read from SMEM after it."""
    p, refs = self.p, self.refs

    def issue(st_ref, dpt_ref):
      plgpu.wgmma(st_ref, self.k_own, refs.q_smem.at[slot].transpose((1, 0)))
      plgpu.wgmma(dpt_ref, self.v_own, refs.do_smem.at[slot].transpose((1, 0)))
      plgpu.wgmma_wait(0)
      return st_ref[...], dpt_ref[...], *self.rows(slot)
    return pl.run_scoped(issue, plgpu.ACC((p.bkv, p.bq), jnp.float32), plgpu.ACC((p.bkv, p.bq), jnp.float32))

  def keys_and_values(self, dk, dv, dst, pt, slot):
    """``(dk + ds^T q, dv + p^T do)``: both wgmmas issued together, one wait."""
    q_tile, do_tile = self.refs.q_smem.at[slot], self.refs.do_smem.at[slot]
    if self.p.interpret:
      return self.product(dk, dst, q_tile), self.product(dv, pt, do_tile)

    def issue(refs):
      dk_ref, dv_ref = refs
      plgpu.wgmma(dv_ref, pt, do_tile)
      plgpu.wgmma(dk_ref, dst, q_tile)
      plgpu.wgmma_wait(0)
    return pl.run_state(issue)((plgpu.ACC.init(dk), plgpu.ACC.init(dv)))

  def query_grads(self, buf):
    """This consumer's columns of ``ds k`` over both key tiles (its own key tile's: ``d`` 64), float32."""
    return self.scores(self.dq_a(buf).transpose((1, 0)), self.dq_b, (self.p.bq, self.p.dq_cols))

  def overlapped(self, dk, dv, dst, pt, slot, buf, flush):
    """``keys_and_values`` and ``query_grads`` with one wait: the ds^T store and the meeting happen while the
    tensor cores run dk and dv."""
    p, refs = self.p, self.refs
    zeros = plgpu.layout_cast(jnp.zeros((p.bq, p.dq_cols), jnp.float32), plgpu.Layout.WGMMA)

    def issue(acc_refs):
      dk_ref, dv_ref, dq_ref = acc_refs
      plgpu.wgmma(dv_ref, pt, refs.do_smem.at[slot])
      plgpu.wgmma(dk_ref, dst, refs.q_smem.at[slot])
      self.share(dst, buf, flush)
      plgpu.wgmma(dq_ref, self.dq_a(buf).transpose((1, 0)), self.dq_b)
      plgpu.wgmma_wait(0)
    return pl.run_state(issue)((plgpu.ACC.init(dk), plgpu.ACC.init(dv), plgpu.ACC.init(zeros)))

  def probabilities(self, st, lse, mask_from):
    """``p^T = exp2(s^T scale - lse)``, zero where a key is after its query (``mask_from``: causal tiles; on the
    masked path a function of ``p^T``: ``masked``)."""
    p = self.p
    pt = jnp.exp2(st * p.scale_log2 - lax.broadcast_in_dim(lse, (p.bkv, p.bq), [1]))
    if callable(mask_from):
      return mask_from(pt)
    if mask_from is None:
      return pt
    key = plgpu.broadcasted_iota(jnp.int32, (p.bkv, p.bq), 0, layout=plgpu.Layout.WGMMA)  # keep where
    query = plgpu.broadcasted_iota(jnp.int32, (p.bkv, p.bq), 1, layout=plgpu.Layout.WGMMA)  # query - key >= 0
    return jnp.where(query - key >= mask_from, pt, 0.0)

  def masked(self, kind, slot, base, pt):
    """The masked path's ``p^T`` of a tile of ``kind`` (``_Items.kind``): zero where the pair is not kept (equal
    ids of the slot's queries and this consumer's keys, the band (``base``: the tile's first query position minus
    its first key's), the mask array's bytes), unless the tile is kept whole (no compare)."""
    p = self.p

    def compare(pt):
      iota = lambda dim: plgpu.broadcasted_iota(jnp.int32, pt.shape, dim, layout=plgpu.Layout.WGMMA)
      equal = None
      if p.ids:
        key_ids = plgpu.load(self.refs.kid_smem.at[self.wg], layout=plgpu.Layout.WGMMA.reduce(1))
        query_ids = plgpu.load(self.refs.qid_smem.at[slot], layout=self.col)
        equal = (lax.broadcast_in_dim(key_ids, pt.shape, [0]) == lax.broadcast_in_dim(query_ids, pt.shape, [1]))
      keep = p.masking.keep(equal, lambda: iota(1) - iota(0), base)
      if p.array:  # the slot's mask bytes by this consumer's keys, in p^T's layout
        marked = plgpu.load(self.refs.mask_smem.at[slot, self.wg], layout=plgpu.Layout.WGMMA) != 0
        keep = marked if keep is None else keep & marked
      return jnp.where(keep, pt, 0.0)
    return lax.cond(kind == ws_mask.FULL, lambda pt: pt, compare, pt)

  # ---------------------------------------------------------------- ds^T and dq through shared and global memory
  def share(self, dst, buf, flush):
    """This consumer's ``ds^T`` into SMEM, then meet the other's (both halves there); ``flush()`` (deferred dq:
    the last step's staged dq sent) between the fence and the meeting."""
    self.refs.ds_smem.at[buf, self.own][...] = dst
    plgpu.commit_smem()
    flush()
    self.meet()

  def window(self, total, *index):
    """``total[index]``, a float32 sum in global memory (interpret mode: its CTA's own)."""
    return total.at[(self.cta, *index) if self.p.interpret else index]

  def dq_window(self, bi, hq, t):
    """This consumer's columns of dq rows ``t`` of head ``hq`` in ``dq_acc``."""
    p = self.p
    return self.window(self.refs.dq, bi, pl.ds(t * p.bq, p.bq), hq, pl.ds(self.dq_at, p.dq_cols))

  def add_staged(self, target):
    """This consumer's staging added into ``target``: a TMA reduce-add store (interpret mode: loads and stores)."""
    if self.p.interpret:
      _add(target, self.refs.dq_smem.at[self.wg])
    else:
      plgpu.copy_smem_to_gmem(self.refs.dq_smem.at[self.wg], target, reduction_op="add")

  def send_dq(self, target):
    """The staged dq added into ``target``."""
    if self.p.interpret and not self.p.split:  # both add to one window: one after the other (interpreter threads)
      pl.when(self.wg == 0)(lambda: self.add_staged(target))
      self.meet()
      pl.when(self.wg == 1)(lambda: self.add_staged(target))
    else:
      self.add_staged(target)

  def send_pending(self, bi, pending):
    """The dq staged by the last step, if one is (``pending``: its head and tile, tile -1 where none)."""
    hq, t = pending
    pl.when(t >= 0)(lambda: self.send_dq(self.dq_window(bi, hq, t)))

  # ---------------------------------------------------------------- one query tile, one item
  def step(self, carry, n, bi, hq, t, mask_from):
    """Query tile ``t`` of head ``hq`` (the item's ``n``-th tile loaded): dk, dv updated, dq added (deferred:
    staged, and sent by the next step's fence; ``pending``, the staged tile's head and tile; None without)."""
    p, refs = self.p, self.refs
    dk, dv, pending = carry
    flush = functools.partial(self.send_pending, bi, pending) if p.deferred else lambda: None
    slot, buf = lax.rem(n, p.slots), lax.rem(n, 2)
    plgpu.barrier_wait(refs.q_loaded.at[slot])
    plgpu.barrier_wait(refs.do_loaded.at[slot])  # s^T and dp^T together
    st, dpt, lse, delta = self.two_scores(slot)
    pt = self.probabilities(st, lse, mask_from)
    dst = (pt * (dpt - lax.broadcast_in_dim(delta, (p.bkv, p.bq), [1]))).astype(p.dtype)
    if p.overlapped:
      dk, dv, dq = self.overlapped(dk, dv, dst, pt.astype(p.dtype), slot, buf, flush)
      plgpu.barrier_arrive(refs.consumed.at[slot])  # the wgmmas that read Q and dO retired
    else:
      dk, dv = self.keys_and_values(dk, dv, dst, pt.astype(p.dtype), slot)
      plgpu.barrier_arrive(refs.consumed.at[slot])
      self.share(dst, buf, flush)
      dq = self.query_grads(buf)
    dq = dq * p.scale
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's dq store read the staging buffer
    refs.dq_smem.at[self.wg][...] = dq
    if p.deferred:  # the next step's fence (or the item's end) sends it
      return dk, dv, (hq, t)
    plgpu.commit_smem()
    self.send_dq(self.dq_window(bi, hq, t))
    return dk, dv, pending

  def item(self, i, n):
    """Item ``i`` (after the ``n`` tiles this CTA took before): its query tiles, masked (causal) up to ``t_vis``,
    then the epilogue; returns the new count."""
    p, refs = self.p, self.refs
    bi, kh, h0, kv0, t0, t_end = self.items.item(i)
    first_key = kv0 + self.wg * p.bkv
    # Tiles from t_vis on see every key of this consumer's tile: query t bq >= the tile's last key.
    t_vis = jnp.clip((first_key + p.bkv - 1 + p.bq - 1) // p.bq, t0, t_end) if p.causal else t0
    plgpu.barrier_wait(refs.k_loaded)
    plgpu.barrier_wait(refs.v_loaded)
    zeros = plgpu.layout_cast(jnp.zeros((p.bkv, p.d), jnp.float32), plgpu.Layout.WGMMA)

    if p.masking:  # each query tile by its kind for this consumer's key tile
      summary = None if p.array else [refs.k_summary[bi, first_key // p.bkv, column]
                                      for column in range(ws_mask.SUMMARY)]
      offset = refs.offset[0]

      def one(j, entry, masked, state):
        n, carry = state
        t = self.items.query_tile(bi, h0 + j, kv0, entry)
        kind = self.items.kind(summary, bi, h0 + j, first_key // p.bkv, t)
        mask = functools.partial(self.masked, kind, lax.rem(n, p.slots), t * p.bq + offset - first_key)
        return n + 1, self.step(carry, n, bi, h0 + j, t, mask)
    else:
      def one(j, t, masked, state):
        n, carry = state
        return n + 1, self.step(carry, n, bi, h0 + j, t, first_key - t * p.bq if masked else None)

    runs = [(t0, t_vis, True), (t_vis, t_end, False)]
    none = (jnp.int32(0), jnp.int32(-1)) if p.deferred else None  # no dq staged
    n, (dk, dv, pending) = self.items.steps(runs, one, (n, (zeros, zeros, none)))
    self.meet()  # the other consumer's last dq read this consumer's K rows
    self.epilogue(bi, kh, first_key, pending, dk, dv)
    return n

  def epilogue(self, bi, kh, first_key, pending, dk, dv):
    """The item's dk and dv: stored (through K/V SMEM), or added into the float32 sums; K/V SMEM released."""
    p, refs = self.p, self.refs
    out_rows = pl.ds(first_key, p.bkv)
    if p.summed:  # float32 parts: through the dq staging, added
      self.add_parts(bi, kh, out_rows, pending, dk * p.scale, dv)
    else:
      self.k_own[...] = (dk * p.scale).astype(p.dtype)
      self.v_own[...] = dv.astype(p.dtype)
      plgpu.commit_smem()  # (deferred: the item's last dq too)
      plgpu.copy_smem_to_gmem(self.k_own, refs.dk.at[bi, out_rows, kh])
      plgpu.copy_smem_to_gmem(self.v_own, refs.dv.at[bi, out_rows, kh])
      if p.deferred:
        self.send_pending(bi, pending)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    plgpu.barrier_arrive(refs.kv_free)

  def add_parts(self, bi, kh, out_rows, pending, dk, dv):
    """This item's float32 ``dk``, ``dv`` of this consumer's keys added into the sums, ``dq_cols`` columns at a
    time through the dq staging (after the staged dq, deferred)."""
    p, refs = self.p, self.refs
    if p.deferred:
      plgpu.commit_smem()
      self.send_pending(bi, pending)
    for total, part in ((refs.dk, dk), (refs.dv, dv)):
      for c0 in range(0, p.d, p.dq_cols):
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the staging's last store read it
        refs.dq_smem.at[self.wg][...] = part[:, c0:c0 + p.dq_cols]
        plgpu.commit_smem()
        self.add_staged(self.window(total, bi, out_rows, kh, pl.ds(c0, p.dq_cols)))
