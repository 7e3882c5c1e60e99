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

After (this kernel; per CTA, three warpgroups run concurrently)::

  memory warpgroup (24 registers; 40 with ``registers=232``):
    for item (bi, kv head kh, heads H, query chunk c, key pair u) of this CTA:  # one; persistent: several
      wait until the consumers stored the last item's dk, dv (K/V SMEM free)
      TMA k, v rows [2 u block_kv, +2 block_kv) -> SMEM   # consumer w's tile: rows w block_kv ..
      for query head hq in H, for query tile t of chunk c that sees the keys:
        slot = tiles loaded so far % max_concurrent_steps; wait until both consumers released it
        TMA q, lse (base 2), do, delta of (hq, t) -> slot

  consumer warpgroup w in {0, 1} (``registers``: 240, or 232, per thread):
    for item (bi, kh, H, c, u) of this CTA:
      dk, dv = 0 (registers, [block_kv, d] float32)
      for (hq, t) as the memory warpgroup loads them:
        s^T = k_w q^T; p^T = exp2(s^T scale - lse)          (masked on the diagonal: causal)
        dv += p^T do; dp^T = v_w do^T; ds^T = p^T (dp^T - delta); dk += ds^T q
        release the slot; ds^T -> SMEM rows w of ds[t % 2]
        meet the other consumer (both halves of ds^T in SMEM)
        dq[t, columns c_w] = scale * ds[t % 2]^T k[:, c_w]  # [block_q, d/2]: each consumer half the columns
        TMA reduce-add dq -> dq_acc[bi, t rows, hq, c_w]     # float32, global memory
      meet; dk scale, dv -> K/V SMEM rows w -> TMA store dk, dv [bi, rows, kh]; release K/V SMEM
                                                            # summed: reduce-add into float32 sums

How a consumer's step waits on its wgmmas (``BackwardBlocks.waits``; the
loop nest above is ``serial``, four waits per tile: s^T; dv with dp^T; dk;
dq):

  paired       s^T and dp^T issued together (neither needs the other), then
               dv and dk together, then dq: three waits per tile
  overlapped   (the default) as paired, but dk, dv and dq in one wait: the
               ds^T store and the meeting run while the tensor cores compute
               dk and dv

With ``early_loads`` (paired and overlapped waits), a step reads its lse and
delta from SMEM between issuing s^T, dp^T and waiting on them, so that the
shared-memory latency hides under the tensor cores; without, after the wait
(an H100 profile at S16K showed the first uses of those rows stalled there).
It took 8-49% longer (H200): the rows, held across the wait, made ptxas spill
more (docs/benchmarks.md).
With ``specialized``, the kernel holds the consumers' loop nest twice, once
per warpgroup, so that the offsets of its key rows, dq columns and staging
buffer are constants (the same profile showed the consumers reloading
spilled SMEM addresses before their wgmmas; ptxas spills none then). The
default (``None``) specializes without a mask, not under a causal one: on an
H100 it was 1-7% faster on every non-causal case and 2-27% slower on four of
five causal ones (whose items run a masked and an unmasked copy of the step
already; the instruction cache is the suspect, not measured).
With ``one_step``, an item's tiles run one copy of the step: under a causal
mask every tile is masked (a visible tile's mask keeps every pair, at a
compare and a select per element), without one the masked loop, which runs
no tile, is not emitted; so a consumer's hot code is one step, not two. On
an H100, with specialized consumers under a causal mask on the persistent
grid, it was 2-7% faster than two shared copies at S 8K-16K and 6-15%
slower at S32K (two runs); with a CTA per item, 3-11% slower than two
copies of the step at S 4K-32K (not the default).

With ``deferred_dq``, a step's dq waits in the staging buffer until the next
step has written its ds^T: one fence (``commit_smem``) then covers both, and
the dq store is sent between it and the meeting; the item's last dq goes
with its dk and dv. One fence per step rather than two (the H100 profile had
4.4% of the stall samples at them). On an H100 it was 1-9% faster without a
mask at S 4K-32K and -3% to +5% under a causal one; the default (``None``)
defers without a mask.

Head dimension 64 (half the columns would be 32, under a swizzled tile):
each consumer computes all of dq's columns from its own key tile, and both
add them.

Barrier protocol, as ``fused_ring_attention_ws``'s: every warpgroup that
waits on a barrier waits on every phase of it. Both consumers wait on every
"loaded" phase and meet equally often (once per tile, once per item); the memory
warpgroup waits on every "consumed" phase (before refilling a slot, the last
ones at the end) and every "K/V free" phase (before the next item's K/V, the
last at the end). The two ``ds`` buffers alternate by tile: a consumer
writes ``ds[t % 2]`` only after the meeting of tile ``t - 1``, which the
other consumer reaches after its dq of tile ``t - 2`` (which read that
buffer) retired.

Causal: queries and keys share positions (``s_q == s_kv``, top-left
aligned); an item's query tiles start at the first that sees its keys, and
each consumer masks (``p = 0`` where key > query) the tiles that are not
wholly visible to its key tile.

Items: ranked by ``order`` over lanes (batch, kv head, the part of its
query heads an item runs: ``b h`` lanes of one query head by default) and
key pairs:

  pairs   rank ``r`` is key pair ``r // lanes`` of lane ``r % lanes``:
          every head runs at once, the key pairs that see the most causal
          queries first
  heads   key pair ``r % pairs`` of lane ``r // pairs``: the
          CTAs running side by side share a head (its queries and dq rows
          in L2); causal, the longest pairs of each head first
  auto    (the default) heads without a mask, with the queries in chunks
          (in chunks, pairs ran 0.65-0.70x at S32K causal) or with items
          of one query head (the default: side by side down the diagonal,
          their rows shared in L2); for items of whole groups, heads where
          each lane has at least twice as many key pairs as the device has
          SMs and pairs would run fewer than 8 CTAs a lane side by side,
          else pairs (``auto_order``)

and run by a grid of (``persistent``):

  one CTA per item (the default): CTA ``c`` runs rank ``c``, and the
          hardware starts the next CTA on an SM as one ends there, so the
          items balance as they end (longest first, under a causal mask);
          each item pays a CTA's start (barriers, register split, the first
          loads). On an H100 it was 0.98-1.15x of cuDNN's at S 4K-32K where
          the persistent grid was 0.82-1.04x, in one process
          (docs/benchmarks.md).
  one CTA per SM (``persistent=True``): CTA ``c`` takes ranks ``i grid + c``
          in its even rounds and ``i grid + grid - 1 - c`` in its odd ones
          (snake order, which evens out causal work), so a part-filled last
          round goes to the first CTAs if it is even and to the last ones if
          it is odd. Its rounds of a causal ``heads`` order hold the longest
          pairs of one head beside the shortest of the last.

Query chunks (``query_chunks``): an item can run its key pair over one part of the query range, so that
an item is (batch, kv head, heads H, chunk, key pair); the memory warpgroup loads, and the consumers run,
that chunk's query tiles only, and each item adds its float32 dk and dv into sums in global memory (TMA
reduce-add stores through the dq staging, ``dq_cols`` columns at a time), cast after the kernel. The
same sums take a K/V head's query heads over several items (``heads_per_item``, H; by default one query
head per item, as without grouped K/V, so grouped K/V is always summed; ``None``: the whole group, K/V
loaded once for its heads). Items go chunk by chunk, key pairs innermost (causal: the last chunks,
which see the most key pairs, first), heads in turn unless ``order`` says pairs. The CTAs side by side
then stream one chunk's queries: an H100 profile of the whole range of items of whole groups at S64K
(Nsight Compute) read 250-310 GB from DRAM against cuDNN's 12, its L2 hit rate 72-76% against 97-99%.
``auto_chunks`` picks the count from measured runs.

Interpret mode (CPU): the same warpgroups, barriers and loop nest; the
interpreter's wgmma takes its left operand from SMEM only, so the products
with ``p^T`` and ``ds^T`` in registers are plain dots there, and it has no
reduce-add stores, so each CTA adds its dq by loads and stores into a buffer
of its own (the two consumers' columns apart, or one after the other),
summed after the kernel.

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
from jaxmercury.kernels.config import param
from jaxmercury.kernels.fused_common import positive_ints
from jaxmercury.kernels.mosaic_gpu import SMEM_BYTES, sm_count, snake_order, swizzled

NAME = "attention_backward_ws"
LOG2E = math.log2(math.e)
CONSUMERS = 2
REGISTER_SPLITS = {240: 24, 232: 40}  # a consumer warpgroup's registers per thread: the memory warpgroup's
INTERPRET_CTAS = 3  # the default grid in interpret mode: rounds of items whose last is part empty, odd or even
SMEM_OVERHEAD = 3 * 1024  # barriers and alignment (as fused_ring_attention_ws measured)
CHUNK_ROWS = 32768  # auto_chunks without a mask: query rows per chunk at most
CAUSAL_CHUNKS = 8  # auto_chunks under a causal mask for items of several query heads: chunks
GROUPED_CAUSAL_CHUNKED_FROM = 65536  # from this many queries on
HALF = frozenset({jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)})
SERIAL, PAIRED, OVERLAPPED = WAITS = ("serial", "paired", "overlapped")
AUTO, PAIRS, HEADS = ORDERS = ("auto", "pairs", "heads")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BackwardBlocks:
  """Tiles of the backward kernel: ``block_q`` query rows streamed per step, ``block_kv`` key rows per consumer
  warpgroup (a work item is ``2 block_kv`` keys), ``max_concurrent_steps`` query-side SMEM slots; ``waits``, how a
  consumer's step waits on its tensor-core products (``OVERLAPPED``, ``PAIRED`` or ``SERIAL``), ``order``, which
  items run side by side (``PAIRS``, ``HEADS``, or ``AUTO``: ``auto_order``, by the mask and the key pairs);
  ``registers``, per-thread registers of a consumer warpgroup (a key of ``REGISTER_SPLITS``: the memory
  warpgroup gets the rest); ``early_loads``, the step's lse and delta read from SMEM while its s^T and dp^T are on
  the tensor cores rather than after (``paired`` and ``overlapped`` waits); ``specialized``, each consumer
  warpgroup its own copy of the code, its SMEM offsets constants rather than registers (``None``: without a mask,
  not under a causal one); ``one_step``, one copy of the step for masked and visible tiles; ``persistent``, one CTA
  per SM running items in turn, or (``False``, the default) one CTA per item, in rank order; ``deferred_dq``, a
  step's dq staged and sent after the next step's ds^T fence, one fence per step rather than two (``None``: without
  a mask, not under a causal one); ``query_chunks``, how many parts of the query range an item's key pair runs
  over (``None``: ``auto_chunks``, by the length, the mask and the heads an item holds), dk and dv added up across
  them (module docstring); ``heads_per_item``, how many of a K/V head's query heads an item runs (1, the default:
  one, as without grouped K/V; ``None``: all of them; fewer than all: the K/V head's dk and dv added up across
  its items, as across chunks)."""

  block_q: int = param(64)
  block_kv: int = param(64)
  max_concurrent_steps: int = param(2)
  waits: str = param("overlapped", "paired", "serial")
  order: str = param("auto", "pairs", "heads")
  registers: int = param(240, 232)
  early_loads: bool = param(False, True)
  specialized: bool | None = param(None, True, False)
  one_step: bool = param(False, True)
  persistent: bool = param(False, True)
  deferred_dq: bool | None = param(None, True, False)
  query_chunks: int | None = param(None, 1, 2, 4, 8)
  heads_per_item: int | None = param(1, None, 2, 4)

  def smem_bytes(self, d: int, itemsize: int) -> int:
    """K and V of both consumers, the Q/dO slots with their lse and delta rows, two ds buffers, the dq staging."""
    bq, bkv, slots = self.block_q, self.block_kv, self.max_concurrent_steps
    kv = 2 * CONSUMERS * bkv * d * itemsize
    streamed = slots * (2 * bq * d * itemsize + 2 * 4 * bq)
    ds = 2 * CONSUMERS * bkv * bq * itemsize
    dq = CONSUMERS * bq * _dq_columns(d) * 4
    return kv + streamed + ds + dq + SMEM_OVERHEAD

  def heads(self, group: int) -> int:
    """The query heads an item runs, ``group`` query heads per K/V head."""
    return self.heads_per_item or group

  def chunks(self, s_q: int, causal: bool, group: int = 1) -> int:
    """The query chunks of ``s_q`` queries, ``group`` query heads per K/V head: ``query_chunks``, else
    ``auto_chunks``' for the heads an item runs."""
    return self.query_chunks or auto_chunks(s_q, causal, self.heads(group))

  def summed(self, s_q: int, causal: bool, group: int = 1) -> bool:
    """Whether several items add into each K/V head's dk and dv (float32 sums in global memory): the queries in
    chunks, or a K/V head's query heads over several items."""
    return self.chunks(s_q, causal, group) > 1 or self.heads(group) < group

  def problem(self, d: int, itemsize: int = 2) -> str | None:
    """Why these tiles cannot compile for head dimension ``d``, or None."""
    if self.block_q != 64 or self.block_kv != 64:
      return (f"block_q={self.block_q} and block_kv={self.block_kv} must be 64 (the registers hold dk and dv of "
              "64 keys and 64-query score tiles)")
    if d not in (64, 128):
      return f"head dimension {d} must be 64 or 128 (dk and dv of 64 keys in registers)"
    if self.waits not in WAITS:
      return f"waits={self.waits!r} must be one of {list(WAITS)}"
    if self.order not in ORDERS:
      return f"order={self.order!r} must be one of {list(ORDERS)}"
    if self.specialized not in (None, True, False):
      return f"specialized={self.specialized!r} must be None (by the mask), True or False"
    if self.deferred_dq not in (None, True, False):
      return f"deferred_dq={self.deferred_dq!r} must be None (by the mask), True or False"
    for name, none in (("query_chunks", "auto_chunks"), ("heads_per_item", "the whole group")):
      if getattr(self, name) is not None and positive_ints(self, name):
        return f"{name}={getattr(self, name)!r} must be None ({none}) or a positive int"
    if self.persistent not in (True, False):
      return f"persistent={self.persistent!r} must be True (one CTA per SM) or False (one CTA per item)"
    if self.registers not in REGISTER_SPLITS:
      return f"registers={self.registers} must be one of {list(REGISTER_SPLITS)} (consumer warpgroups' per thread)"
    if self.max_concurrent_steps < 2:
      return f"max_concurrent_steps={self.max_concurrent_steps} must be at least 2"
    if (need := self.smem_bytes(d, itemsize)) > SMEM_BYTES:
      return f"needs {need} bytes of shared memory, over the {SMEM_BYTES} a CTA has"
    return None


def _dq_columns(d: int) -> int:
  """dq columns each consumer computes: half of them where a half is whole swizzled tiles (64 columns)."""
  return d // 2 if (d // 2) % 64 == 0 else d


def attention_backward_ws(q, k, v, o, do, lse, *, causal: bool = False, blocks: BackwardBlocks = BackwardBlocks(),
                          num_ctas: int | None = None, interpret: bool = False):
  """``(dq, dk, dv)`` of softmax attention from its output and log-sum-exp, in one kernel.

  Args:
    q, do: ``[b, s_q, h, d]``, bf16 or fp16 (one dtype, ``k``'s and ``v``'s too).
    o: the forward's output, ``[b, s_q, h, d]``, any float dtype (it gives ``delta = rowsum(o * do)``).
    k, v: ``[b, s_kv, kv, d]``; ``kv`` divides ``h`` (query head ``hq`` reads kv head ``hq // (h / kv)``).
    lse: ``[b, h, s_q]`` float32, natural log: the forward's log-sum-exp of the scaled scores (``-inf`` for a
      row that kept no key: its gradients are zero).
    causal: query ``i`` sees keys ``j <= i`` (``s_q == s_kv``).
    blocks: the tiles (``BackwardBlocks``).
    num_ctas: CTAs of a persistent grid (``blocks.persistent``; default the device's SM count, ``INTERPRET_CTAS``
      in interpret mode).
    interpret: Mosaic GPU interpret mode (CPU).

  Returns:
    ``dq [b, s_q, h, d]`` float32, ``dk, dv [b, s_kv, kv, d]`` in the inputs' dtype.

  Raises:
    PreconditionError: shapes, dtypes or tiles the kernel does not take (module docstring).
  """
  _check(q, k, v, o, do, lse, causal, blocks)
  if num_ctas is not None and not blocks.persistent:
    raise PreconditionError(f"{NAME}: num_ctas={num_ctas!r} sizes a persistent grid, but blocks.persistent is False "
                            "(one CTA per item); pass BackwardBlocks(persistent=True) with it, or no num_ctas")
  delta = jnp.einsum("bshd,bshd->bhs", o.astype(jnp.float32), do.astype(jnp.float32))
  lse2 = jnp.where(jnp.isfinite(lse), lse * LOG2E, jnp.inf)  # a row without keys: p = exp2(-inf) = 0
  grid = num_ctas if num_ctas is not None else (None if interpret else sm_count()) or INTERPRET_CTAS
  if not isinstance(grid, int) or grid < 1:
    raise PreconditionError(f"{NAME}: num_ctas={num_ctas!r} must be a positive int")
  return _kernel(q, k, v, do, lse2.astype(jnp.float32), delta, causal, blocks, grid, interpret)


def _check(q, k, v, o, do, lse, causal: bool, blocks: BackwardBlocks) -> None:
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
  if reason := blocks.problem(d, q.dtype.itemsize):
    raise PreconditionError(f"{NAME}: {reason}")
  if s % blocks.block_q or skv % (CONSUMERS * blocks.block_kv):
    raise PreconditionError(f"{NAME}: s_q={s} must be a multiple of block_q={blocks.block_q} and s_kv={skv} of "
                            f"2 * block_kv = {CONSUMERS * blocks.block_kv} (a work item's two key tiles)")
  if causal and s != skv:
    raise PreconditionError(f"{NAME}: causal takes queries and keys at the same positions; s_q={s} != s_kv={skv}")
  if h // kv % blocks.heads(h // kv):
    raise PreconditionError(f"{NAME}: heads_per_item={blocks.heads_per_item} must divide the {h // kv} query heads "
                            f"per K/V head (h={h}, kv={kv}); pass a divisor of {h // kv}, or None (all of them)")
  if (blocks.query_chunks or 1) > s // blocks.block_q:
    raise PreconditionError(f"{NAME}: query_chunks={blocks.query_chunks} is more than the {s // blocks.block_q} "
                            f"query tiles of {blocks.block_q} rows; pass at most that many, or None")


def _add(target, staged):
  """``target += staged`` by a load and a store: interpret mode's reduce-add store (into its CTA's own buffer)."""
  target[...] = target[...] + staged[...]


def auto_order(causal: bool, pairs: int, lanes: int, sms: int, chunks: int = 1, item_heads: int = 1) -> str:
  """``BackwardBlocks.order="auto"``'s order: ``HEADS`` without a mask, with the queries in ``chunks`` (in chunks
  pairs ran 0.65-0.70x at S32K causal) or where an item runs one query head (``item_heads``); for items of several
  query heads under a causal mask on the whole queries, ``HEADS`` where each of the ``lanes`` has at least
  ``2 sms`` key pairs and ``PAIRS`` would share a lane among fewer than 8 CTAs (``sms < 8 lanes``), else ``PAIRS``.

  Items of one query head, in turn by head, keep the CTAs side by side on one head's query rows, in step down the
  diagonal: an H100 profile at S32K KV 8 causal read 108 GB/s from DRAM (L2 hit rate 98%) against 1.26 TB/s (74%)
  in pairs, and in sustained runs, where the GPU runs at its 700 W cap and the clock follows the power, heads ran
  1.01-1.04x of cuDNN's at S 8K-64K where items of whole groups (the earlier default) ran 0.97-1.02x
  (docs/benchmarks.md).

  Heads in turn is longest first per head only: the last head's longest item starts when that head's work, about
  ``pairs / 2`` of its longest items' worth, is left for the ``sms`` SMs, which outlasts it from ``pairs >= 2 sms``
  on (S 64K and longer on an H100); below it pairs, longest first over every head, kept the tail short (S8K KV8:
  1.038x of cuDNN's against 0.939x). At S64K on an H100 (three processes): KV 32, where pairs runs 4 CTAs a head
  side by side, heads in turn ran 1.003-1.017x against pairs' 0.954-0.962x (0.54-0.59x in a fourth, both grids);
  KV 8, 16 CTAs a head, pairs ran 0.980-0.982x against 0.960-0.966x in two (a tie in the third). Measured at
  those two head counts only (docs/benchmarks.md).
  """
  return HEADS if not causal or chunks > 1 or item_heads == 1 or (pairs >= 2 * sms and sms < 8 * lanes) else PAIRS


def auto_chunks(s_q: int, causal: bool, group: int = 1) -> int:
  """``BackwardBlocks.query_chunks=None``'s chunks of ``s_q`` queries for items of ``group`` query heads: without a
  mask the fewest of at most ``CHUNK_ROWS`` rows (S64K: 2); under a causal one none for items of one query head
  (in turn by head, ``auto_order``), ``CAUSAL_CHUNKS`` from ``GROUPED_CAUSAL_CHUNKED_FROM`` queries on for items of
  several.

  Sustained runs on an H100 (docs/benchmarks.md): causal, items of one query head in turn by head, the whole
  queries 1.03x of cuDNN's at S32K KV 32 where 8 chunks ran 1.00x, 1.008x at S64K KV 8 against 1.005x. Earlier
  (rotating rounds, items of whole groups):

  Measured on an H100 (B1 H32 D128, x cuDNN's backward, two processes; module docstring): without a mask S64K
  KV 8 ran 1.01x in 2 chunks against 0.95x whole, KV 32 1.01x against 0.98-0.99x, S32K KV 8 whole 1.01x against
  0.99x in 2; causal KV 32 in 8 chunks 1.00x against 0.96-0.97x at S32K and 1.04x against 1.01x at S64K, KV 8 at
  most 1% apart; at S16K whole ran 2-15% ahead of 2 to 8 chunks in three cases of four, and within 0.5% of 2
  chunks in the fourth (KV 8 causal). A call's median GPU span in traced rounds (``ws_trace --backward``: the
  kernel, zeroing the float32 sums, casting them): causal S32K KV 8 on an H100, whole queries took 1.0-2.1% less
  than 8 chunks (four runs; the kernel alone 0.5-1.6%), on an H200 0.8% more (one); KV 32 8 chunks 1.7-3.6% less
  than whole (H100, two); S64K KV 8, 8 chunks 2.5% less than whole (H100, one)."""
  if causal:
    return CAUSAL_CHUNKS if group > 1 and s_q >= GROUPED_CAUSAL_CHUNKED_FROM else 1
  return max(1, -(-s_q // CHUNK_ROWS))


def _chunk_plan(nq: int, chunks: int, bq: int, keys: int, pairs: int, causal: bool) -> list[tuple[int, int, int]]:
  """``(first query tile, end tile, key pairs)`` of each of ``chunks`` parts of ``nq`` query tiles, in the order
  their items run: under a causal mask the pairs each chunk's queries see, the last chunks (most pairs) first."""
  bounds = [c * nq // chunks for c in range(chunks + 1)]
  plan = [(lo, hi, min(pairs, -(-hi * bq // keys)) if causal else pairs) for lo, hi in zip(bounds, bounds[1:])]
  return plan[::-1] if causal else plan


def _first_tile(kv0, bq: int, causal: bool):
  """The first query tile that sees key row ``kv0`` (causal; else 0)."""
  return kv0 // bq if causal else 0


def _kernel(q, k, v, do, lse2, delta, causal: bool, blocks: BackwardBlocks, num_ctas: int, interpret: bool):
  b, s, h, d = q.shape
  skv, kv = k.shape[1], k.shape[2]
  g = h // kv
  dtype = q.dtype
  bq, bkv, slots = blocks.block_q, blocks.block_kv, blocks.max_concurrent_steps
  keys = CONSUMERS * bkv  # key rows per item
  nq, pairs = s // bq, skv // keys
  chunks = blocks.chunks(s, causal, g)
  heads = blocks.heads(g)  # query heads per item
  parts = g // heads  # items per (batch, kv head, chunk, key pair)
  summed = blocks.summed(s, causal, g)
  lanes = b * kv * parts  # (batch, kv head, part of its group)
  plan = _chunk_plan(nq, chunks, bq, keys, pairs, causal)
  starts = [0, *itertools.accumulate(n for _, _, n in plan)]  # each chunk's first item of a lane
  per_head = starts.pop()
  work = lanes * per_head
  grid = min(work, num_ctas) if blocks.persistent else work
  dq_cols = _dq_columns(d)
  split = dq_cols < d  # each consumer half of dq's columns, from both key tiles
  scale = 1.0 / math.sqrt(d)
  scale_log2 = LOG2E * scale
  waits = PAIRED if interpret and blocks.waits == OVERLAPPED else blocks.waits  # interpret: its products are dots
  order = auto_order(causal, pairs, lanes, num_ctas, chunks, heads) if blocks.order == AUTO else blocks.order
  specialized = not causal if blocks.specialized is None else blocks.specialized
  deferred = not causal if blocks.deferred_dq is None else blocks.deferred_dq
  col = plgpu.Layout.WGMMA.reduce(0)  # a vector along the columns (queries) of a [keys, queries] tile

  def body(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *refs):
    # dk and dv: float32 sums of the chunks' parts (several chunks), else the kernel's outputs in the inputs' dtype
    (dk_ref, dv_ref, q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, ds_smem, dq_smem, k_loaded, v_loaded,
     q_loaded, do_loaded, consumed, kv_free, meeting) = refs
    cta = lax.axis_index("cta")
    wg = lax.axis_index("wg")
    items, rank_of = snake_order(work, grid, cta)

    def item_of(i):
      """Item ``i`` of this CTA, ``(batch, kv head, first query head, first key row, first query tile, end tile)``:
      ranks in snake order (``cta`` in even rounds, ``grid - 1 - cta`` in odd ones) over (chunk, key pair), then
      lanes (batch, kv head, part of its query heads) (``PAIRS``), or the other way round (``HEADS``); causal: in
      each chunk the first pairs see the most queries."""
      rank = rank_of(i)
      if order == PAIRS:
        j, lane = rank // lanes, lax.rem(rank, lanes)
      else:
        lane, j = rank // per_head, lax.rem(rank, per_head)
      (lo, hi, _), pair = plan[0], j
      for (first, end, _), start in zip(plan[1:], starts[1:]):  # the chunk holding j
        later = j >= start
        lo, hi, pair = jnp.where(later, first, lo), jnp.where(later, end, hi), jnp.where(later, j - start, pair)
      kv0, kh = pair * keys, lax.rem(lane // parts, kv)
      first_head = kh * g + lax.rem(lane, parts) * heads
      return lane // (kv * parts), kh, first_head, kv0, jnp.maximum(lo, _first_tile(kv0, bq, causal)), hi

    def item_steps(runs, step, state):
      """``step(j, t, tag, state)`` over an item's query heads (``j``: from its first) and, for each, the query
      tiles ``t`` of its ``runs``, ``(first tile, end tile, tag)``, in order."""
      def head(j, state):
        for lo, hi, tag in runs:
          state = lax.fori_loop(lo, hi, lambda t, state, tag=tag: step(j, t, tag, state), state)
        return state
      return lax.fori_loop(0, heads, head, state)

    # ------------------------------------------------------------------ memory warpgroup
    @pl.when(wg == CONSUMERS)
    def _memory():
      plgpu.set_max_registers(REGISTER_SPLITS[blocks.registers], action="decrease")

      def item(i, loaded):
        bi, kh, h0, kv0, t0, t_end = item_of(i)
        pl.when(i > 0)(lambda: plgpu.barrier_wait(kv_free))  # the last item's dk, dv left K/V SMEM
        rows = pl.ds(kv0, keys)
        plgpu.copy_gmem_to_smem(k_ref.at[bi, rows, kh], k_smem, k_loaded)
        plgpu.copy_gmem_to_smem(v_ref.at[bi, rows, kh], v_smem, v_loaded)

        def tile(j, t, _, loaded):
          hq, slot = h0 + j, lax.rem(loaded, slots)
          pl.when(loaded >= slots)(lambda: plgpu.barrier_wait(consumed.at[slot]))
          qrows = pl.ds(t * bq, bq)
          plgpu.copy_gmem_to_smem(q_ref.at[bi, qrows, hq], q_smem.at[slot], q_loaded.at[slot])
          plgpu.copy_gmem_to_smem(lse_ref.at[bi, hq, qrows], lse_smem.at[slot], q_loaded.at[slot])
          plgpu.copy_gmem_to_smem(do_ref.at[bi, qrows, hq], do_smem.at[slot], do_loaded.at[slot])
          plgpu.copy_gmem_to_smem(delta_ref.at[bi, hq, qrows], delta_smem.at[slot], do_loaded.at[slot])
          return loaded + 1

        return item_steps([(t0, t_end, None)], tile, loaded)

      loaded = lax.fori_loop(0, items, item, jnp.int32(0))

      @pl.loop(jnp.maximum(loaded - slots, 0), loaded)
      def _drain(n):  # observe the consumers' last releases (every waiter sees every phase)
        plgpu.barrier_wait(consumed.at[lax.rem(n, slots)])

      pl.when(items > 0)(lambda: plgpu.barrier_wait(kv_free))

    # ------------------------------------------------------------------ consumer warpgroups
    def consumer(wg):
      """Consumer warpgroup ``wg`` (an int: ``specialized``; else the traced warpgroup index)."""
      own = pl.ds(wg * bkv, bkv)  # this consumer's key rows in K/V SMEM
      k_own, v_own = k_smem.at[own], v_smem.at[own]
      if split:
        dq_a, dq_b, dq_at = lambda buf: ds_smem.at[buf], k_smem.at[:, pl.ds(wg * dq_cols, dq_cols)], wg * dq_cols
      else:
        dq_a, dq_b, dq_at = lambda buf: ds_smem.at[buf, own], k_own, 0

      def meet():
        plgpu.barrier_arrive(meeting)
        plgpu.barrier_wait(meeting)

      def product(acc, a, b_smem):
        """``acc + a @ b_smem`` for ``a`` in registers (the interpreter's wgmma takes SMEM only: a plain dot)."""
        if interpret:
          return acc + jnp.dot(a, b_smem[...], preferred_element_type=jnp.float32)

        def issue(acc_ref):
          plgpu.wgmma(acc_ref, a, b_smem)
          plgpu.wgmma_wait(0)
        return pl.run_state(issue)(plgpu.ACC.init(acc))

      def scores(a_smem, b_smem, shape):
        """``a_smem @ b_smem`` from SMEM, float32."""
        def issue(acc_ref):
          plgpu.wgmma(acc_ref, a_smem, b_smem)
          plgpu.wgmma_wait(0)
          return acc_ref[...]
        return pl.run_scoped(issue, plgpu.ACC(shape, jnp.float32))

      def values_and_scores(dv, pt, slot):
        """``(dv + p^T do, v_w do^T)``: both wgmmas issued together, one wait."""
        do_tile, do_t = do_smem.at[slot], do_smem.at[slot].transpose((1, 0))
        if interpret:
          return product(dv, pt, do_tile), scores(v_own, do_t, (bkv, bq))

        def issue(refs):
          dv_ref, dpt_ref = refs
          plgpu.wgmma(dv_ref, pt, do_tile)
          plgpu.wgmma(dpt_ref, v_own, do_t)
          plgpu.wgmma_wait(0)
        zeros = plgpu.layout_cast(jnp.zeros((bkv, bq), jnp.float32), plgpu.Layout.WGMMA)
        return pl.run_state(issue)((plgpu.ACC.init(dv), plgpu.ACC.init(zeros)))

      def rows(slot):
        """The step's lse (base 2) and delta, one per query column of this thread's tile elements."""
        return plgpu.load(lse_smem.at[slot], layout=col), plgpu.load(delta_smem.at[slot], layout=col)

      def two_scores(slot):
        """``(k_w q^T, v_w do^T, lse, delta)``, the products float32: both wgmmas issued together, one wait; the
        rows read from SMEM while the tensor cores run (``early_loads``) or after."""
        def issue(st_ref, dpt_ref):
          plgpu.wgmma(st_ref, k_own, q_smem.at[slot].transpose((1, 0)))
          plgpu.wgmma(dpt_ref, v_own, do_smem.at[slot].transpose((1, 0)))
          early = rows(slot) if blocks.early_loads else None
          plgpu.wgmma_wait(0)
          return st_ref[...], dpt_ref[...], *(early or rows(slot))
        return pl.run_scoped(issue, plgpu.ACC((bkv, bq), jnp.float32), plgpu.ACC((bkv, bq), jnp.float32))

      def keys_and_values(dk, dv, dst, pt, slot):
        """``(dk + ds^T q, dv + p^T do)``: both wgmmas issued together, one wait."""
        q_tile, do_tile = q_smem.at[slot], do_smem.at[slot]
        if interpret:
          return product(dk, dst, q_tile), product(dv, pt, do_tile)

        def issue(refs):
          dk_ref, dv_ref = refs
          plgpu.wgmma(dv_ref, pt, do_tile)
          plgpu.wgmma(dk_ref, dst, q_tile)
          plgpu.wgmma_wait(0)
        return pl.run_state(issue)((plgpu.ACC.init(dk), plgpu.ACC.init(dv)))

      def share(dst, buf, flush):
        """This consumer's ``ds^T`` into SMEM, then meet the other's (both halves there); ``flush()`` (``deferred_dq``:
        the last step's staged dq sent) between the fence and the meeting."""
        ds_smem.at[buf, own][...] = dst
        plgpu.commit_smem()
        flush()
        meet()

      def window(total, *index):
        """``total[index]``, a float32 sum in global memory (interpret mode: its CTA's own)."""
        return total.at[(cta, *index) if interpret else index]

      def dq_window(bi, hq, t):
        """This consumer's columns of dq rows ``t`` of head ``hq`` in ``dq_acc``."""
        return window(dq_ref, bi, pl.ds(t * bq, bq), hq, pl.ds(dq_at, dq_cols))

      def add_staged(target):
        """This consumer's staging added into ``target``: a TMA reduce-add store (interpret mode: loads and stores)."""
        if interpret:
          _add(target, dq_smem.at[wg])
        else:
          plgpu.copy_smem_to_gmem(dq_smem.at[wg], target, reduction_op="add")

      def send_dq(target):
        """The staged dq added into ``target``."""
        if interpret and not split:  # both add to one window: one after the other (the interpreter's threads)
          pl.when(wg == 0)(lambda: add_staged(target))
          meet()
          pl.when(wg == 1)(lambda: add_staged(target))
        else:
          add_staged(target)

      def send_pending(bi, pending):
        """The dq staged by the last step, if one is (``pending``: its head and tile, tile -1 where none)."""
        hq, t = pending
        pl.when(t >= 0)(lambda: send_dq(dq_window(bi, hq, t)))

      def query_grads(buf):
        """This consumer's columns of ``ds k`` over both key tiles (its own key tile's: ``d`` 64), float32."""
        return scores(dq_a(buf).transpose((1, 0)), dq_b, (bq, dq_cols))

      def overlapped(dk, dv, dst, pt, slot, buf, flush):
        """``keys_and_values`` and ``query_grads`` with one wait: the ds^T store and the meeting happen while the
        tensor cores run dk and dv."""
        zeros = plgpu.layout_cast(jnp.zeros((bq, dq_cols), jnp.float32), plgpu.Layout.WGMMA)

        def issue(refs):
          dk_ref, dv_ref, dq_ref = refs
          plgpu.wgmma(dv_ref, pt, do_smem.at[slot])
          plgpu.wgmma(dk_ref, dst, q_smem.at[slot])
          share(dst, buf, flush)
          plgpu.wgmma(dq_ref, dq_a(buf).transpose((1, 0)), dq_b)
          plgpu.wgmma_wait(0)
        return pl.run_state(issue)((plgpu.ACC.init(dk), plgpu.ACC.init(dv), plgpu.ACC.init(zeros)))

      def probabilities(st, lse, mask_from):
        """``p^T = exp2(s^T scale - lse)``, zero where a key is after its query (``mask_from``: causal tiles)."""
        pt = jnp.exp2(st * scale_log2 - lax.broadcast_in_dim(lse, (bkv, bq), [1]))
        if mask_from is None:
          return pt
        key = plgpu.broadcasted_iota(jnp.int32, (bkv, bq), 0, layout=plgpu.Layout.WGMMA)  # keep where
        query = plgpu.broadcasted_iota(jnp.int32, (bkv, bq), 1, layout=plgpu.Layout.WGMMA)  # query - key >= 0
        return jnp.where(query - key >= mask_from, pt, 0.0)

      def step(carry, n, bi, hq, t, mask_from):
        """Query tile ``t`` of head ``hq`` (the item's ``n``-th tile loaded): dk, dv updated, dq added (``deferred_dq``:
        staged, and sent by the next step's fence; ``pending``, the staged tile's head and tile; None without)."""
        dk, dv, pending = carry
        flush = functools.partial(send_pending, bi, pending) if deferred else lambda: None
        slot, buf = lax.rem(n, slots), lax.rem(n, 2)
        plgpu.barrier_wait(q_loaded.at[slot])
        if waits == SERIAL:  # four waits: s^T; p^T do with v_w do^T; ds^T q; dq
          st = scores(k_own, q_smem.at[slot].transpose((1, 0)), (bkv, bq))
          pt = probabilities(st, plgpu.load(lse_smem.at[slot], layout=col), mask_from)
          plgpu.barrier_wait(do_loaded.at[slot])
          dv, dpt = values_and_scores(dv, pt.astype(dtype), slot)
          delta = plgpu.load(delta_smem.at[slot], layout=col)
        else:  # s^T and dp^T together
          plgpu.barrier_wait(do_loaded.at[slot])
          st, dpt, lse, delta = two_scores(slot)
          pt = probabilities(st, lse, mask_from)
        dst = (pt * (dpt - lax.broadcast_in_dim(delta, (bkv, bq), [1]))).astype(dtype)
        if waits == OVERLAPPED:
          dk, dv, dq = overlapped(dk, dv, dst, pt.astype(dtype), slot, buf, flush)
          plgpu.barrier_arrive(consumed.at[slot])  # the wgmmas that read Q and dO retired
        else:
          if waits == SERIAL:
            dk = product(dk, dst, q_smem.at[slot])
          else:
            dk, dv = keys_and_values(dk, dv, dst, pt.astype(dtype), slot)
          plgpu.barrier_arrive(consumed.at[slot])
          share(dst, buf, flush)
          dq = query_grads(buf)
        dq = dq * scale
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's dq store read the staging buffer
        dq_smem.at[wg][...] = dq
        if deferred:  # the next step's fence (or the item's end) sends it
          return dk, dv, (hq, t)
        plgpu.commit_smem()
        send_dq(dq_window(bi, hq, t))
        return dk, dv, pending

      def item(i, n):
        bi, kh, h0, kv0, t0, t_end = item_of(i)
        first_key = kv0 + wg * bkv
        # Tiles from t_vis on see every key of this consumer's tile: query t bq >= the tile's last key.
        t_vis = jnp.clip((first_key + bkv - 1 + bq - 1) // bq, t0, t_end) if causal else t0
        plgpu.barrier_wait(k_loaded)
        plgpu.barrier_wait(v_loaded)
        zeros = plgpu.layout_cast(jnp.zeros((bkv, d), jnp.float32), plgpu.Layout.WGMMA)

        def one(j, t, masked, state):
          n, carry = state
          return n + 1, step(carry, n, bi, h0 + j, t, first_key - t * bq if masked else None)

        if blocks.one_step:  # the mask keeps every pair of a visible tile
          runs = [(t0, t_end, causal)]
        else:
          runs = [(t0, t_vis, True), (t_vis, t_end, False)]
        none = (jnp.int32(0), jnp.int32(-1)) if deferred else None  # no dq staged
        n, (dk, dv, pending) = item_steps(runs, one, (n, (zeros, zeros, none)))
        meet()  # the other consumer's last dq read this consumer's K rows
        out_rows = pl.ds(first_key, bkv)
        if summed:  # float32 parts: through the dq staging, added
          add_parts(bi, kh, out_rows, pending, dk * scale, dv)
        else:
          k_own[...] = (dk * scale).astype(dtype)
          v_own[...] = dv.astype(dtype)
          plgpu.commit_smem()  # (deferred: the item's last dq too)
          plgpu.copy_smem_to_gmem(k_own, dk_ref.at[bi, out_rows, kh])
          plgpu.copy_smem_to_gmem(v_own, dv_ref.at[bi, out_rows, kh])
          if deferred:
            send_pending(bi, pending)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        plgpu.barrier_arrive(kv_free)
        return n

      def add_parts(bi, kh, out_rows, pending, dk, dv):
        """This chunk's float32 ``dk``, ``dv`` of this consumer's keys added into the sums, ``dq_cols`` columns at a
        time through the dq staging (after the staged dq, ``deferred_dq``)."""
        if deferred:
          plgpu.commit_smem()
          send_pending(bi, pending)
        for total, part in ((dk_ref, dk), (dv_ref, dv)):
          for c0 in range(0, d, dq_cols):
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the staging's last store read it
            dq_smem.at[wg][...] = part[:, c0:c0 + dq_cols]
            plgpu.commit_smem()
            add_staged(window(total, bi, out_rows, kh, pl.ds(c0, dq_cols)))

      lax.fori_loop(0, items, item, jnp.int32(0))
      plgpu.wait_smem_to_gmem(0, wait_read_only=False)

    @pl.when(wg < CONSUMERS)
    def _consumers():
      plgpu.set_max_registers(blocks.registers, action="increase")
      if specialized:  # a copy of the code per consumer, its SMEM offsets constants
        for w in range(CONSUMERS):
          pl.when(wg == w)(functools.partial(consumer, w))
      else:
        consumer(wg)

  tiles = swizzled(d, dtype)
  ds_tiles = swizzled(bq, dtype)
  dq_tiles = swizzled(dq_cols, jnp.float32)
  scratch = [plgpu.SMEM((slots, bq, d), dtype, transforms=tiles),  # q
             plgpu.SMEM((slots, bq, d), dtype, transforms=tiles),  # do
             plgpu.SMEM((slots, bq), jnp.float32),  # lse (base 2)
             plgpu.SMEM((slots, bq), jnp.float32),  # delta
             plgpu.SMEM((keys, d), dtype, transforms=tiles),  # k of both consumers; dk on the way out
             plgpu.SMEM((keys, d), dtype, transforms=tiles),  # v; dv on the way out
             plgpu.SMEM((2, keys, bq), dtype, transforms=ds_tiles),  # ds^T, two buffers
             plgpu.SMEM((CONSUMERS, bq, dq_cols), jnp.float32, transforms=dq_tiles),  # dq staging
             plgpu.Barrier(),  # K loaded
             plgpu.Barrier(),  # V loaded
             plgpu.Barrier(num_arrivals=2, num_barriers=slots),  # Q and lse loaded
             plgpu.Barrier(num_arrivals=2, num_barriers=slots),  # dO and delta loaded
             plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=slots),  # slot released by both consumers
             plgpu.Barrier(num_arrivals=CONSUMERS),  # K/V SMEM free (dk, dv stored)
             plgpu.Barrier(num_arrivals=CONSUMERS)]  # the consumers' meetings
  # dq is added into a float32 buffer; in interpret mode one per CTA (no reduce-add stores there), summed after
  per_cta = (grid,) if interpret else ()
  dq_acc = jax.new_ref(jnp.zeros(per_cta + q.shape, jnp.float32))
  sums = [jax.new_ref(jnp.zeros(per_cta + k.shape, jnp.float32)) for _ in "kv"] if summed else []
  kv_type = jax.ShapeDtypeStruct(k.shape, dtype)
  outs = plgpu.kernel(
      body, out_type=[] if sums else [kv_type, kv_type], scratch_types=scratch, grid=(grid,), grid_names=("cta",),
      kernel_name=NAME, num_threads=CONSUMERS + 1, thread_name="wg",
      compiler_params=None if interpret else plgpu.CompilerParams(approx_math=True),
      interpret=plgpu.InterpretGPUParams() if interpret else None)(q, k, v, do, lse2, delta, dq_acc, *sums)
  total = lambda ref: ref[...].sum(axis=0) if interpret else ref[...]
  dk, dv = [total(ref).astype(dtype) for ref in sums] if sums else outs
  return total(dq_acc), dk, dv
