"""Attention with segment ids through cuDNN's packed layout: each document a segment, no pair outside one computed.

A packed row's documents are runs of equal segment ids. Per block, in the
graph and with static shapes, the queries' ids and the keys' ids are cut into
runs; a query run and the key run of the same id are one cuDNN segment
(``packed_segments``: its queries' and its keys' start and length), and cuDNN's packed
flash attention (``q_offsets``/``kv_offsets`` with ``PADDING`` or
``PADDING_CAUSAL``) computes only the pairs within segments. cuDNN's causal
mask is top-left within a segment, so a block takes:

* without a causal mask: every block, ``PADDING``;
* causal, keys all before the queries (a ring's earlier block): ``PADDING``,
  whatever its segments' offsets;
* causal, the diagonal (queries and keys at the same positions): each
  segment's queries and keys start together, ``PADDING_CAUSAL`` (with a
  window ``(left, 0)``: cuDNN's ``sliding_window_length = left + 1``);
* hidden by position: skipped (``out = 0``, ``lse = -inf``);
* anything else (a window that cuts a block off the diagonal, query and key
  blocks of different sizes overlapping partly, padded keys, blocks spanning
  zigzag chunks): the program's own body (its cost hook says so).

Rows in no segment (padding, or a document with no keys in the block) get
``out = 0``, ``lse = -inf``, zero gradients; cuDNN leaves them unwritten.

**The cap M** (``PackedConfig.max_documents``). cuDNN takes segments as a
``[rows, M]`` table whose size is static; its softmax statistics are
``[rows * M, heads, block length]`` float32 (one block-long slot per segment,
``4 M`` bytes per query and head) and its grid covers ``rows * M`` segments
of the whole block's length, most of them empty. M is therefore small (32 by
default, the tuner also tries 8 and 128); a row with more documents is
computed in further calls of M documents each (a ``while_loop`` over
"waves", whose rows are disjoint), never refused. M is at least 2: JAX
takes ``M == 1`` for its unpacked path, which ignores the offsets.

**Ids must be runs**: a document's positions consecutive in the block (as
packing gives them), and on the diagonal its queries and keys starting
together. An id whose queries or keys form several runs (ids reused for
different documents, a document cut by another) is refused when running
with an ``InputError`` naming it (cuDNN would keep each run to itself);
padding ids (positions no key matches) may repeat.

cuDNN's packed layout needs a Hopper (compute capability 9.0) or newer GPU,
bf16 or fp16, head dimension at most 256 and a multiple of 8
(JAX's private cuDNN module, reached through ``_compat``, checks them).
The cuDNN calls are module functions (``_packed``, ``_packed_backward``, in
JAX's packed layout) so that tests on CPU can stand them in with XLA.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxmercury._compat import cudnn_packed_attention, cudnn_packed_attention_backward
from jaxmercury.errors import InputError
from jaxmercury.kernels.attention import causal_blocks
from jaxmercury.kernels.attention import packed_segments as ps
from jaxmercury.kernels.config import param
from jaxmercury.kernels.registry import AttentionBackward, Kernel
from jaxmercury.kernels.work import Block, Work, band_work
from jaxmercury.programs.attention_backward import dq_dkv_block
from jaxmercury.programs.masks import PAD_QUERY_SEGMENT, mask_of

NAME = "cudnn_packed"
HALF = frozenset({np.dtype(jnp.bfloat16), np.dtype(jnp.float16)})


@dataclasses.dataclass(frozen=True, kw_only=True)
class PackedConfig:
  """``max_documents``: M, the documents per row of one cuDNN call (module docstring); any int of at least 2 (the
  tuner tries the choices)."""

  OPEN = True
  max_documents: int = param(32, 8, 128)

  def __post_init__(self):
    if not isinstance(self.max_documents, int) or self.max_documents < 2:
      raise ValueError(f"{NAME}: max_documents must be an int of at least 2, got {self.max_documents!r}")


def _refuse_conflicts(segs: ps.Segments):
  """An ``InputError`` when running, where an id forms several runs (``Segments.conflict``)."""
  def fail(rows):
    raise InputError(
        f"{NAME}: segment ids of batch rows {np.flatnonzero(rows).tolist()} are not runs: an id's positions (queries "
        "or keys) are not consecutive, or a document's queries and keys start apart on the diagonal. cuDNN's packed "
        "layout takes each document as one run; give every document its own id, or use kernel 'cudnn_attention' "
        "(a dense mask)")
  jax.lax.cond(jnp.any(segs.conflict), lambda c: jax.debug.callback(fail, c), lambda c: None, segs.conflict)


# ------------------------------------------------------------------ the cuDNN calls (stood in on CPU by tests)
def _packed(q, k, v, q_seqlen, kv_seqlen, q_offsets, kv_offsets, causal: bool, window):
  """cuDNN's packed attention: q [b, i, heads, d], k, v [b, j, kv heads, d] -> (o as q, stats [b * m, heads, i]
  float32); rows outside the segments unwritten."""
  return cudnn_packed_attention(q, k, v, q_seqlen, kv_seqlen, q_offsets, kv_offsets, scale=1 / math.sqrt(q.shape[-1]),
                                causal=causal, sliding_window_length=window)


def _packed_backward(q, k, v, o, do, stats, q_seqlen, kv_seqlen, q_offsets, kv_offsets, causal: bool, window):
  """cuDNN's packed backward: (dq, dk, dv) in the inputs' layouts and dtype; rows outside the segments unwritten."""
  return cudnn_packed_attention_backward(q, k, v, o, do, stats, q_seqlen, kv_seqlen, q_offsets, kv_offsets,
                                         scale=1 / math.sqrt(q.shape[-1]), causal=causal,
                                         sliding_window_length=window)


# ------------------------------------------------------------------ a block, forward and backward
def packed_forward(q, k, v, q_ids, kv_ids, *, causal: bool, window, m: int, check: bool = True):
  """One block through cuDNN's packed attention: ``(out [b, i, hk, g, d], lse [b, i, hk, g])`` float32.

  Args:
    q: [b, i, hk, g, d]; k, v: [b, j, hk, d]; q_ids, kv_ids: int32 [b, i], [b, j].
    causal: cuDNN's causal mask within each segment (the diagonal: queries and keys at the same positions).
    window: cuDNN's ``sliding_window_length`` (with ``causal``), or None.
    m: documents per row per call.
    check: refuse ids that are not runs (``InputError`` when running).
  """
  segs = ps.segments(q_ids, kv_ids, aligned=causal)
  if check:
    _refuse_conflicts(segs)
  b, i, hk, g, d = q.shape
  flat = q.reshape(b, i, hk * g, d)

  def wave(carry):
    w, out, lse = carry
    o, stats = _packed(flat, k, v, *ps.table(segs, w, m), causal, window)
    rows = ps.in_wave(segs.q_seg, w, m)
    out = jnp.where(rows[..., None, None], o.astype(jnp.float32), out)
    return w + 1, out, jnp.where(rows[..., None], ps.rows_of(stats, segs, w, m), lse)

  start = (jnp.int32(0), jnp.zeros(flat.shape, jnp.float32), jnp.full((b, i, hk * g), -jnp.inf, jnp.float32))
  _, out, lse = jax.lax.while_loop(lambda c: c[0] < ps.waves(segs, m), wave, start)
  return out.reshape(q.shape), lse.reshape(b, i, hk, g)


def packed_backward(q, k, v, o, do, lse, q_ids, kv_ids, *, causal: bool, window, m: int):
  """(dq [b, i, hk, g, d], dk, dv [b, j, hk, d]) float32 of one block through cuDNN's packed backward, from the
  (merged) output and log-sum-exp; arguments as ``packed_forward``'s."""
  segs = ps.segments(q_ids, kv_ids, aligned=causal)
  b, i, hk, g, d = q.shape
  flat = lambda x: x.reshape(b, i, hk * g, d).astype(q.dtype)
  lse = jnp.where(jnp.isfinite(lse), lse, 0.0).reshape(b, i, hk * g)

  def wave(carry):
    w, dq, dk, dv = carry
    grads = _packed_backward(flat(q), k, v, flat(o), flat(do), ps.stats_of(lse, segs, w, m), *ps.table(segs, w, m),
                             causal, window)
    rows, keys = ps.in_wave(segs.q_seg, w, m)[..., None, None], ps.in_wave(segs.kv_seg, w, m)[..., None, None]
    dq_w, dk_w, dv_w = (x.astype(jnp.float32) for x in grads)
    return w + 1, jnp.where(rows, dq_w, dq), jnp.where(keys, dk_w, dk), jnp.where(keys, dv_w, dv)

  zeros = lambda x: jnp.zeros(x.shape, jnp.float32)
  start = (jnp.int32(0), zeros(flat(q)), zeros(k), zeros(v))
  _, dq, dk, dv = jax.lax.while_loop(lambda c: c[0] < ps.waves(segs, m), wave, start)
  return dq.reshape(q.shape), dk, dv


# ------------------------------------------------------------------ which path a block takes, by its positions
VISIBLE, HIDDEN, DIAGONAL, OTHER = range(4)


def _case(ctx, band):
  """The block's path (``VISIBLE``: the band keeps all its pairs, ``HIDDEN``, ``DIAGONAL`` or ``OTHER``): a Python
  int where its positions are static, else traced."""
  tq, tk = ctx.sizes["i"], ctx.sizes["j"]
  qs, ks = ctx.start("i"), ctx.start("j")
  static = isinstance(qs, int) and isinstance(ks, int)
  xp = np if static else jnp
  hidden, visible = causal_blocks.band_cover(ctx, band)
  # blocks of one size start at multiples of it: one partly kept by a causal band alone is the diagonal
  diagonal = (qs == ks) if band[1] is not None else True
  case = xp.where(hidden, HIDDEN, xp.where(visible, VISIBLE, xp.where(tq == tk and diagonal, DIAGONAL, OTHER)))
  return int(case) if static else case


def dispatch(ctx, mask, operands, *, run, empty, fallback):
  """``run(causal, window)(*operands)`` on the block's path (module docstring), ``empty(*operands)`` where its
  positions hide it, ``fallback(*operands)`` (the program's body) where cuDNN cannot take it."""
  if not mask.causal:
    return run(False, None)(*operands)
  band = mask.band
  branches = [run(False, None), empty, run(True, causal_blocks.causal_window(band, ctx.sizes["i"])), fallback]
  case = _case(ctx, band)
  if isinstance(case, int):
    return branches[case](*operands)
  if band[1] is None and ctx.sizes["i"] == ctx.sizes["j"]:
    branches = branches[:3]  # OTHER cannot happen: no body (and its scores' memory) in the switch
  return jax.lax.switch(case, branches, *operands)


def packed_attention_block(ctx, q, k, v, q_ids, kv_ids, *, mask, config: PackedConfig, fallback):
  """One attention block (``attention_block``'s contract) through cuDNN's packed layout."""
  if not causal_blocks.takes_whole(ctx, backward=False):
    return fallback(ctx, q, k, v, q_ids, kv_ids)  # padded keys, or a block spanning zigzag chunks
  q_ids = jnp.where(ctx.valid("i")[None, :], q_ids, PAD_QUERY_SEGMENT)  # padded queries keep nothing
  run = lambda causal, window: lambda *x: packed_forward(*x, q_ids, kv_ids, causal=causal, window=window,
                                                         m=config.max_documents)
  return dispatch(ctx, mask, (q, k, v), run=run, empty=causal_blocks.empty_state,
                  fallback=lambda *x: fallback(ctx, *x, q_ids, kv_ids))


def packed_backward_block(ctx, q, k, v, o, do, lse, q_ids, kv_ids, *, mask, part: str, config: PackedConfig,
                          fallback):
  """One block pair's dq (``part="dq"``), stacked [dk, dv] (``"dkv"``) or both (``"dq_dkv"``) through cuDNN's packed
  backward; dispatched as the forward."""
  blocks = (q, k, v, o, do, lse)
  if not causal_blocks.takes_whole(ctx, backward=True):
    return fallback(ctx, *blocks, q_ids, kv_ids)
  pick = causal_blocks.pick(part)
  run = lambda causal, window: lambda *x: pick(*packed_backward(*x, q_ids, kv_ids, causal=causal, window=window,
                                                                m=config.max_documents))
  shapes = jax.eval_shape(run(False, None), *blocks)
  return dispatch(ctx, mask, blocks, run=run,
                  empty=lambda *x: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes),
                  fallback=lambda *x: fallback(ctx, *x, q_ids, kv_ids))


# ------------------------------------------------------------------ applicability, work, memory
def _mask_problem(mask) -> str | None:
  if not mask.segment_ids:
    return "it computes attention with segment ids (cuDNN's packed layout); without them 'cudnn_attention' applies"
  if mask.window is not None and not (mask.causal and mask.window[1] == 0):
    return f"cuDNN's packed layout takes a sliding window (left, 0) with the causal mask only, not {mask.describe()}"
  return None


def _device_problem(device) -> str | None:
  capability = str(getattr(device, "compute_capability", ""))
  try:
    major = int(capability.split(".")[0])
  except ValueError:
    return f"cuDNN's packed layout needs an NVIDIA GPU; {device} reports compute capability {capability!r}"
  if major < 9:
    return (f"cuDNN's packed layout needs compute capability 9.0 (Hopper) or newer; {device} ({device.device_kind}) "
            f"has {capability}")
  return None


def _work(block: Block, whole: bool) -> Work:
  """What ``dispatch`` runs for ``block`` (``band_work``): where the band cuts it, cuDNN's share on the diagonal
  (the band's pairs; a data mask's are known only when running, counted as the band's, an upper bound), else the
  body's."""
  def cut(block):
    tq, tk = block.sizes["i"], block.sizes["j"]
    diagonal = block.band[1] is None or block.span("i")[0] == block.span("j")[0]
    return Work(fast=block.band_share()) if tq == tk and diagonal else Work(fast=0.0, fallback=1.0)
  return band_work(block, whole, cut)


def packed_work(block: Block, *, causal: bool, config=None) -> Work:
  del causal, config  # the block's band says it
  return _work(block, causal_blocks.takes_whole(block, backward=False))


def packed_backward_work(block: Block, *, causal: bool, config=None) -> Work:
  del causal, config
  return _work(block, causal_blocks.takes_whole(block, backward=True))


def _workspace(program, sizes, config: PackedConfig) -> int:
  """cuDNN's statistics (one block-long float32 slot per segment and head) twice (the backward's input), the
  float32 output and log-sum-exp rows, the segment tables and position maps (int32)."""
  rows = sizes["b"] * sizes["hk"] * sizes["g"] * sizes["i"]
  positions = sizes["b"] * (sizes["i"] + sizes["j"])
  return 4 * (2 * config.max_documents * rows + rows * (sizes["d"] + 1) + 12 * positions)


# ------------------------------------------------------------------ the kernel
def _make(program, config: PackedConfig, interpret):
  del interpret
  return functools.partial(packed_attention_block, mask=mask_of(program.params), config=config, fallback=program.body)


def _make_backward(part: str):
  def make(program, config, interpret):
    del interpret
    return functools.partial(packed_backward_block, mask=mask_of(program.params), part=part, config=config,
                             fallback=program.body)
  return make


def _joint(dq_program):
  """One packed backward per block pair for the dq and dk-dv programs run in one nest."""
  mask = mask_of(dq_program.params)
  return functools.partial(packed_backward_block, mask=mask, part="dq_dkv", config=PackedConfig(),
                           fallback=functools.partial(dq_dkv_block, mask=mask))


def _backward_kernel(part: str) -> Kernel:
  return Kernel(name=f"{NAME}_{part}", patterns=frozenset({f"attention_{part}"}), make=_make_backward(part),
                config=PackedConfig, dtypes=HALF, dtype_of="q", platforms=frozenset({"gpu"}), supports=_device_problem,
                work=packed_backward_work, workspace=_workspace, masks=frozenset({"causal", "window", "segment_ids"}),
                mask_problem=_mask_problem, description=f"cuDNN's packed flash backward, {part} of a block pair")


CUDNN_PACKED = Kernel(
    name=NAME, patterns=frozenset({"attention"}), make=_make, config=PackedConfig, dtypes=HALF, dtype_of="q",
    platforms=frozenset({"gpu"}), supports=_device_problem, work=packed_work, workspace=_workspace,
    masks=frozenset({"causal", "window", "segment_ids"}), mask_problem=_mask_problem,
    backward=AttentionBackward(dq=_backward_kernel("dq"), dkv=_backward_kernel("dkv"), joint=_joint, own=True),
    description="cuDNN's packed flash attention (JAX's private cuDNN module): segment ids as segments, only their "
                "pairs computed; causal within documents, a causal window (left, 0) on the diagonal")
