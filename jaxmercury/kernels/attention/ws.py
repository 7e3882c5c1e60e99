"""Attention blocks through our warp-specialized Mosaic GPU kernels, forward and backward (Hopper, bf16/fp16).

Forward (``ws_attention``): ``fused_ring_attention_ws`` without a ring, on
the block's own keys (two consumer warpgroups taking turns on the tensor
cores, a memory warpgroup loading K and V; non-causal blocks on its
pipelined consumers). Backward (``ws_attention_dq``, ``ws_attention_dkv``,
their joint block and the per-device whole): ``attention_backward_ws``, dq,
dk and dv in one pass over the block pair. So a schedule patched with it
trains on one kernel family end to end; its ``AttentionBackward`` is its own
(``own``): its backward blocks run where its forward ran, not cuDNN's.

Causal blocks at traced offsets (ring steps) go by their position
(``causal_dispatch``): visible ones unmasked, hidden ones skipped, a partly
masked one of equal query and key blocks (the diagonal) on the kernels'
causal paths. Blocks the kernels cannot take run the program's own body:
query and key blocks of different lengths (forward), lengths that are not
multiples of the tiles, keys that may hold padding, blocks spanning zigzag
chunks, a head dimension the backward does not take (64 and 128 only).

Segment ids, mask arrays and sliding windows (with or without causal) take
the kernels' masked path (``ws_mask``) at any offset: a block its positions
hide is skipped; any other runs with the block's offset (its first query's
position minus its first key's), and the kernels skip the tiles that keep no
pair, compare only those kept in part, and give rows that keep no key
``out = 0``, ``lse = -inf``. A mask array's block goes to the kernels as
``[batch or 1, heads or 1, queries, keys]``: broadcast over batch and heads
where the program's mask does not have them (not copied), along queries or
keys where it lacks those.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxmercury.kernels.attention import causal_blocks, ws_mask
from jaxmercury.kernels.attention.ws_backward import BackwardBlocks, attention_backward_ws
from jaxmercury.kernels.attention.ws_forward import WsBlocks, fused_ring_attention_ws
from jaxmercury.kernels.config import param
from jaxmercury.kernels.mosaic_gpu import HALF_DTYPES, hopper_only
from jaxmercury.kernels.registry import AttentionBackward, Kernel
from jaxmercury.kernels.work import CAUSAL, Block, Work, body_share
from jaxmercury.programs.attention_backward import dq_dkv_block
from jaxmercury.programs.masks import AttentionMask, expand_mask, mask_of

NAME = "ws_attention"
F32 = jnp.float32
BACKWARD = BackwardBlocks()


@dataclasses.dataclass(frozen=True, kw_only=True)
class WsConfig:
  """The forward kernel's tiles (``fused_ring_attention_ws``): ``block_q`` query rows per consumer warpgroup,
  ``block_kv`` keys per K/V tile, ``max_concurrent_steps`` K/V slots. The backward's are ``BackwardBlocks``'."""

  block_q: int = param(64)
  block_kv: int = param(128)
  max_concurrent_steps: int = param(2)


# ------------------------------------------------------------------ where the kernels take a block


def forward_problem(tq: int, tk: int, d: int, config: WsConfig, itemsize: int = 2, mask: bool = False) -> str | None:
  """Why the forward kernel cannot take a [tq] x [tk] block pair of head dimension ``d`` (``mask``: with a mask
  array's tiles; None: it can)."""
  if tq != tk:
    return f"query and key blocks of different lengths ({tq} and {tk})"
  if d % 64 or d > 256:
    return f"head dimension {d} is not a multiple of 64 up to 256"
  blocks = WsBlocks(config.block_q, config.block_kv, config.max_concurrent_steps)
  if reason := blocks.problem(d, itemsize) or (blocks.mask_problem(d, itemsize) if mask else None):
    return reason
  if tq % (2 * config.block_q) or tk % config.block_kv:
    return f"blocks of {tq} positions are not a multiple of 2 * block_q = {2 * config.block_q} and block_kv"
  return None


def backward_problem(tq: int, tk: int, d: int, causal: bool, itemsize: int = 2, mask: bool = False) -> str | None:
  """Why the backward kernel cannot take a [tq] x [tk] block pair (``mask``: with a mask array's tiles; None: it
  can)."""
  if reason := BACKWARD.problem(d, itemsize, mask):
    return reason
  keys = 2 * BACKWARD.block_kv
  if tq % BACKWARD.block_q or tk % keys:
    return f"{tq} queries and {tk} keys are not multiples of {BACKWARD.block_q} and {keys}"
  if causal and tq != tk:
    return f"causal query and key blocks of different lengths ({tq} and {tk})"
  return None


# ------------------------------------------------------------------ the kernels on one block pair


def forward(q, k, v, *, causal: bool, config: WsConfig, interpret: bool):
  """``(out [b, i, hk, g, d], lse [b, i, hk, g])`` float32 (natural log) of ``q [b, i, hk, g, d]`` over
  ``k, v [b, j, hk, d]``."""
  b, i, hk, g, d = q.shape
  out, lse = fused_ring_attention_ws(q.reshape(b, i, hk * g, d), k, v, None, causal=causal, block_q=config.block_q,
                                     block_kv=config.block_kv, max_concurrent_steps=config.max_concurrent_steps,
                                     interpret=interpret)
  return out.reshape(q.shape).astype(F32), jnp.transpose(lse, (0, 2, 1)).reshape(b, i, hk, g)


def backward(q, k, v, o, do, lse, *, causal: bool, interpret: bool):
  """``(dq, dk, dv)`` float32 of one block pair from the merged output ``o`` and natural-log ``lse [b, i, hk, g]``."""
  b, i, hk, g, d = q.shape
  heads = lambda x: x.reshape(b, i, hk * g, d)
  rows = jnp.transpose(lse.reshape(b, i, hk * g), (0, 2, 1))
  dq, dk, dv = attention_backward_ws(heads(q), k, v, heads(o), heads(do).astype(q.dtype), rows, causal=causal,
                                     interpret=interpret)
  return dq.reshape(q.shape), dk.astype(F32), dv.astype(F32)


def masked(mask: AttentionMask) -> bool:
  """Whether the kernels take ``mask`` on their masked path (segment ids, a mask array, a window), not the causal
  one."""
  return ws_mask.Masking.make(mask.causal, mask.window, mask.segment_ids, mask.mask_axes is not None) is not None


def data_inputs(mask: AttentionMask, extras, tq: int, tk: int) -> dict:
  """The kernels' keyword arguments for a block's data masks: ``extras`` its segment ids (``[b, i]``, ``[b, j]``)
  and its mask array's block (the program's ``mask`` buffer's axes) as ``mask [b or 1, heads or 1, tq, tk]``."""
  extras = list(extras)
  out = dict(zip(("q_segment_ids", "kv_segment_ids"), extras[:2])) if mask.segment_ids else {}
  if mask.mask_axes is not None:
    block = expand_mask(extras[-1], mask.mask_axes)  # [b, hk, g, i, j], size 1 where it has no such axis
    nb, nhk, ng = block.shape[:3]
    block = block.reshape(nb, nhk * ng, *block.shape[3:])
    out["mask"] = jnp.broadcast_to(block, (nb, nhk * ng, tq, tk))
  return out


def masked_forward(q, k, v, *extras, mask: AttentionMask, offset, config: WsConfig, interpret: bool):
  """``forward`` on the masked path: ``extras`` the blocks' data masks where ``mask`` has them (``data_inputs``),
  ``offset`` the first query's position minus the first key's."""
  b, i, hk, g, d = q.shape
  data = data_inputs(mask, extras, i, k.shape[1])
  out, lse = fused_ring_attention_ws(q.reshape(b, i, hk * g, d), k, v, None, causal=mask.causal, window=mask.window,
                                     offset=offset, block_q=config.block_q, block_kv=config.block_kv,
                                     max_concurrent_steps=config.max_concurrent_steps, interpret=interpret, **data)
  return out.reshape(q.shape).astype(F32), jnp.transpose(lse, (0, 2, 1)).reshape(b, i, hk, g)


def masked_backward(q, k, v, o, do, lse, *extras, mask: AttentionMask, offset, interpret: bool):
  """``backward`` on the masked path (``masked_forward``'s arguments)."""
  b, i, hk, g, d = q.shape
  heads = lambda x: x.reshape(b, i, hk * g, d)
  rows = jnp.transpose(lse.reshape(b, i, hk * g), (0, 2, 1))
  data = data_inputs(mask, extras, i, k.shape[1])
  dq, dk, dv = attention_backward_ws(heads(q), k, v, heads(o), heads(do).astype(q.dtype), rows, causal=mask.causal,
                                     window=mask.window, offset=offset, interpret=interpret, **data)
  return dq.reshape(q.shape), dk.astype(F32), dv.astype(F32)


def _offset(ctx):
  """The block's first query position minus its first key's."""
  return jnp.asarray(ctx.start("i") - ctx.start("j"), jnp.int32)


def _unless_hidden(ctx, mask: AttentionMask, run, hidden, operands):
  """``run(*operands)``, or ``hidden(*operands)`` where the mask's positions hide the whole block."""
  if not mask.positional:
    return run(*operands)
  return jax.lax.cond(mask.position_hidden(ctx), hidden, run, *operands)


def ws_attention_block(ctx, q, k, v, *extras, causal: bool, config: WsConfig, interpret: bool, fallback,
                       mask: AttentionMask | None = None):
  """One attention block (``attention_block``'s contract) through the forward kernel, else ``fallback``."""
  tq, tk = ctx.sizes["i"], ctx.sizes["j"]
  takes = causal_blocks.takes_whole(ctx, backward=False)
  array = mask is not None and mask.mask_axes is not None
  if forward_problem(tq, tk, q.shape[-1], config, q.dtype.itemsize, array) or not takes:
    return fallback(ctx, q, k, v, *extras)
  if mask is not None and masked(mask):
    run = functools.partial(masked_forward, mask=mask, offset=_offset(ctx), config=config, interpret=interpret)
    return _unless_hidden(ctx, mask, run, causal_blocks.empty_state, (q, k, v, *extras))
  run = functools.partial(forward, config=config, interpret=interpret)
  if not causal:
    return run(q, k, v, causal=False)
  return causal_blocks.dispatch(ctx, (q, k, v), visible=functools.partial(run, causal=False),
                                  hidden=causal_blocks.empty_state, partial=functools.partial(run, causal=True))


def ws_backward_block(ctx, q, k, v, o, do, lse, *extras, causal: bool, part: str, interpret: bool, fallback,
                      mask: AttentionMask | None = None):
  """One block pair's dq (``part="dq"``), stacked [dk, dv] (``"dkv"``) or both (``"dq_dkv"``) through the backward
  kernel; hidden causal pairs give zeros, blocks it cannot take ``fallback``."""
  blocks = (q, k, v, o, do, lse)
  tq, tk = ctx.sizes["i"], ctx.sizes["j"]
  takes = causal_blocks.takes_whole(ctx, backward=True)
  array = mask is not None and mask.mask_axes is not None
  if backward_problem(tq, tk, q.shape[-1], False, q.dtype.itemsize, array) or not takes:
    return fallback(ctx, *blocks, *extras)
  pick = causal_blocks.pick(part)
  if mask is not None and masked(mask):
    run = lambda *x: pick(*masked_backward(*x, mask=mask, offset=_offset(ctx), interpret=interpret))
    shapes = jax.eval_shape(run, *blocks, *extras)
    zeros = lambda *x: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    return _unless_hidden(ctx, mask, run, zeros, (*blocks, *extras))
  run = lambda *x, causal=False: pick(*backward(*x, causal=causal, interpret=interpret))
  if not causal:
    return run(*blocks)
  shapes = jax.eval_shape(run, *blocks)
  partial = (lambda *x: run(*x, causal=True)) if tq == tk else functools.partial(fallback, ctx)
  return causal_blocks.dispatch(ctx, blocks, visible=run, partial=partial,
                                  hidden=lambda *x: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes))


def whole(q, k, v, o, do, lse, causal: bool, *, interpret: bool = False, blocks: BackwardBlocks = BACKWARD):
  """``(dq, dk, dv)`` of a device's whole attention in one kernel call, in the inputs' dtypes: ``q, o, do
  [b, i, heads, d]``, ``k, v [b, j, kv heads, d]``, ``lse [b, i, heads]`` (natural log); ``blocks`` the backward
  kernel's configuration (``BackwardBlocks``)."""
  dq, dk, dv = attention_backward_ws(q, k, v, o, do.astype(q.dtype), jnp.transpose(lse, (0, 2, 1)).astype(F32),
                                     causal=causal, blocks=blocks, interpret=interpret)
  return dq.astype(q.dtype), dk, dv


def whole_limit(program, extents) -> str | None:
  """Where one device's whole attention does not fit the backward kernel."""
  reason = backward_problem(extents["i"], extents["j"], extents["d"], program.params["causal"])
  return f"{NAME}'s backward: {reason}" if reason else None


# ------------------------------------------------------------------ work, for the cost model


def _masked_work(block: Block, whole: bool) -> Work:
  """The masked path's work: the pairs its positions keep (data masks counted as keeping all of them: an upper
  bound; the kernels skip what the data hides), the body's where the kernels cannot take the block."""
  if not whole:
    return Work(fast=0.0, fallback=body_share(block))
  return Work(fast=block.band_share() if block.band else 1.0)


def _on_masked_path(block: Block) -> bool:
  """Whether the block's mask takes the kernels' masked path (segment ids or a mask array, a window)."""
  return block.data or block.band not in (None, CAUSAL)


def _work(block: Block, *, causal: bool, config: WsConfig) -> Work:
  """``ws_attention_block``'s work: the kernel's blocks, and the XLA body's where it cannot take them."""
  fits = forward_problem(block.sizes["i"], block.sizes["j"], block.sizes["d"], config) is None
  whole = fits and causal_blocks.takes_whole(block, backward=False)
  if _on_masked_path(block):
    return _masked_work(block, whole)
  return causal_blocks.dispatch_work(block, causal, whole)


def _backward_work(block: Block, *, causal: bool, config=None) -> Work:
  """``ws_backward_block``'s work."""
  del config
  fits = backward_problem(block.sizes["i"], block.sizes["j"], block.sizes["d"], False) is None
  whole = fits and causal_blocks.takes_whole(block, backward=True)
  if _on_masked_path(block):
    return _masked_work(block, whole)
  return causal_blocks.dispatch_work(block, causal, whole)


def _forward_workspace(program, sizes, config) -> int:
  """The float32 output state the block returns (the kernel's own output is the inputs' dtype)."""
  del program, config
  return 4 * sizes["b"] * sizes["i"] * sizes["hk"] * sizes["g"] * (sizes["d"] + 1)


def _backward_workspace(program, sizes, config) -> int:
  """float32 dq (the kernel's accumulator) and its copy, delta and the base-2 lse rows; where the queries go in
  chunks or a K/V head's query heads over several items (``BackwardBlocks.summed``), the float32 dk and dv sums."""
  del config
  q = sizes["b"] * sizes["i"] * sizes["hk"] * sizes["g"]
  summed = BACKWARD.summed(sizes["i"], program.params["causal"], sizes["g"])
  sums = 2 * 4 * sizes["b"] * sizes["j"] * sizes["hk"] * sizes["d"] if summed else 0
  return 2 * 4 * q * sizes["d"] + 2 * 4 * q + sums


# ------------------------------------------------------------------ the kernel


def _mask_keywords(program) -> dict:
  """``mask=`` for the block functions where the program's mask takes the masked path (else none: the causal
  path's calls stay as they were)."""
  mask = mask_of(program.params)
  return dict(mask=mask) if masked(mask) else {}


def _make(program, config: WsConfig, interpret: bool):
  return functools.partial(ws_attention_block, causal=program.params["causal"], config=config, interpret=interpret,
                           fallback=program.body, **_mask_keywords(program))


def _make_backward(part: str):
  def make(program, config, interpret: bool):
    del config
    return functools.partial(ws_backward_block, causal=program.params["causal"], part=part, interpret=interpret,
                             fallback=program.body, **_mask_keywords(program))
  return make


def _joint(dq_program, *, interpret: bool = False):
  """One backward kernel call per block pair for the dq and dk-dv programs run in one nest."""
  return functools.partial(ws_backward_block, causal=dq_program.params["causal"], part="dq_dkv",
                           interpret=interpret, fallback=functools.partial(dq_dkv_block,
                                                                           mask=mask_of(dq_program.params)),
                           **_mask_keywords(dq_program))


MASKS = frozenset({"causal", "window", "segment_ids", "mask"})


def _backward_kernel(part: str) -> Kernel:
  return Kernel(name=f"{NAME}_{part}", patterns=frozenset({f"attention_{part}"}), make=_make_backward(part),
                dtypes=HALF_DTYPES, dtype_of="q", platforms=frozenset({"gpu"}), supports=hopper_only, interpret=True,
                interpret_devices=1, work=_backward_work, workspace=_backward_workspace, masks=MASKS,
                description=f"our Mosaic GPU backward kernel (kernels.attention.ws_backward), its {part} part")


WS_ATTENTION = Kernel(
    name=NAME, patterns=frozenset({"attention"}), make=_make, config=WsConfig, dtypes=HALF_DTYPES, dtype_of="q",
    platforms=frozenset({"gpu"}), supports=hopper_only, interpret=True, interpret_devices=1, work=_work,
    workspace=_forward_workspace, masks=MASKS, unverified_masks=frozenset({"mask"}),
    backward=AttentionBackward(dq=_backward_kernel("dq"), dkv=_backward_kernel("dkv"), joint=_joint, whole=whole,
                               whole_limit=whole_limit, own=True),
    description="our warp-specialized Mosaic GPU kernels (kernels.attention.ws_forward without a ring, "
                "kernels.attention.ws_backward: dq, dk and dv in one pass); causal, sliding windows, segment ids and "
                "mask arrays (tiles the mask hides skipped, tiles it keeps whole not compared)")
