"""Attention blocks through cuDNN flash attention (GPU, bf16/fp16), with the masks of ``programs.masks``.

Each block at traced offsets (ring steps) takes one of these paths, chosen at
run time (``lax.switch``), forward and backward alike:

* hidden: the mask keeps none of its pairs; skipped (``out = 0``, ``lse =
  -inf``; zero gradients);
* visible: the mask keeps all of them; cuDNN unmasked;
* band: a positional mask (causal, a sliding window ``(left, 0)``) on the
  diagonal of query and key blocks of one size: cuDNN's own causal mask,
  with ``sliding_window_length = left + 1`` where the window is narrower than
  the block (cuDNN skips the tiles the band hides);
* bias: any other partly kept block (the band's edge off the diagonal, a
  two-sided window, segment ids, a mask array): cuDNN with the block's kept
  pairs as a bias (0 kept, a large negative number elsewhere, as JAX passes
  a boolean mask), over ``[batch or 1, heads or 1, queries, keys]``; rows that
  keep no key are then set to ``out = 0``, ``lse = -inf``. cuDNN takes a bias
  in training only for even lengths: blocks of an odd size take the
  program's XLA body instead.

Positional masks choose by the block's start positions (cheap); data masks
(segment ids, mask arrays) by the block's kept pairs themselves, computed once
(``any``: not hidden, ``all``: visible). Key blocks that may hold padding and
blocks spanning zigzag chunks use the program's own XLA body whole.

The cuDNN calls are module functions (``_cudnn``, ``_cudnn_backward_masked``)
so that tests on CPU can stand them in with XLA.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxmercury._compat import MaskType, cudnn_attention, cudnn_attention_backward
from jaxmercury.kernels.attention import causal_blocks
from jaxmercury.kernels.registry import AttentionBackward, Kernel
from jaxmercury.kernels.work import Block, Work, band_work
from jaxmercury.programs.attention_backward import dq_dkv_block
from jaxmercury.programs.masks import KINDS, AttentionMask, mask_of


# ------------------------------------------------------------------ the cuDNN calls
def _cudnn(q, k, v, causal=False, window=None, keep=None):
  """cuDNN's flash attention of one block pair, as cuDNN computes it.

  Args:
    q: [b, i, hk, g, d] queries; k, v: [b, j, hk, d].
    causal: cuDNN's causal mask (top-left aligned).
    window: cuDNN's ``sliding_window_length`` (with ``causal``): query ``x`` keeps keys ``x - window < y <= x``.
    keep: bool [b or 1, hk * g or 1, i, j]: pairs not kept get a large negative bias (a row that keeps none
      gets cuDNN's softmax over its biased scores, not zeros: the caller fixes it).

  Returns:
    ``(out [b, i, hk, g, d], lse [b, i, hk, g])`` in float32, lse in natural log.
  """
  b, i, hk, g, d = q.shape
  mask = MaskType.CAUSAL if causal else MaskType.NO_MASK
  out, lse = cudnn_attention(
      q.reshape(b, i, hk * g, d), k, v, mask=keep, scale=1.0 / math.sqrt(d), mask_type=mask,
      sliding_window_length=window, qkv_layout="BTNH", return_residual=True)
  lse = jnp.transpose(lse.astype(jnp.float32), (0, 2, 1)).reshape(b, i, hk, g)
  return out.reshape(b, i, hk, g, d).astype(jnp.float32), lse


def cudnn_backward(q, k, v, o, do, lse, causal: bool, window=None, keep=None):
  """(dq, dk, dv) through cuDNN's flash backward from a given output and log-sum-exp.

  Layouts: q, o, do [b, i, heads, d]; k, v [b, j, kv heads, d]; lse [b, i,
  heads] (natural log, as ``_cudnn`` returns it); ``window`` and ``keep``
  ([b or 1, heads or 1, i, j]) as ``_cudnn``'s. Gradients in the inputs' dtype.
  """
  stats = jnp.transpose(lse, (0, 2, 1)).astype(jnp.float32)
  return cudnn_attention_backward(q, k, v, o, do, stats, scale=1.0 / math.sqrt(q.shape[-1]), causal=causal,
                                          sliding_window_length=window, mask=keep)


def _cudnn_backward_masked(q, k, v, o, do, lse, causal=False, window=None, keep=None):
  """(dq, dk, dv) of one block pair ([b, i, hk, g, d] queries) from the merged output and lse, float32; masks as
  ``_cudnn``'s (a row whose lse is -inf must not reach it)."""
  b, i, hk, g, d = q.shape
  flat = lambda x: x.reshape(b, i, hk * g, d)
  dq, dk, dv = cudnn_backward(flat(q), k, v, flat(o), flat(do), lse.reshape(b, i, hk * g), causal, window, keep)
  return dq.reshape(q.shape).astype(jnp.float32), dk.astype(jnp.float32), dv.astype(jnp.float32)


# ------------------------------------------------------------------ masks as cuDNN takes them
def _heads_keep(keep, q):
  """A block's kept pairs (``AttentionMask.keep``: [b, hk, g, i, j], size 1 where unmasked) as cuDNN's
  [b or 1, hk * g or 1, i, j]."""
  _, tq, hk, g, _ = q.shape
  nb, nhk, ng, ni, nj = keep.shape
  if nhk * ng > 1:
    keep = jnp.broadcast_to(keep, (nb, hk, g, ni, nj)).reshape(nb, hk * g, ni, nj)
  else:
    keep = keep.reshape(nb, 1, ni, nj)
  return jnp.broadcast_to(keep, (nb, keep.shape[1], tq, nj))


def _forward(q, k, v, causal=False, window=None, keep=None):
  """``_cudnn``, with ``keep`` as ``AttentionMask.keep`` gives it; rows that keep no key: ``out = 0``,
  ``lse = -inf`` (``attention_block``'s contract)."""
  if keep is None:
    return _cudnn(q, k, v, causal, window)
  b, i, hk, g, d = q.shape
  keep = _heads_keep(keep, q)
  out, lse = _cudnn(q, k, v, causal, window, keep)
  rows = jnp.transpose(jnp.any(keep, axis=-1), (0, 2, 1))  # [b or 1, i, heads or 1]
  rows = jnp.broadcast_to(rows, (b, i, hk * g)).reshape(b, i, hk, g)
  return jnp.where(rows[..., None], out, 0.0), jnp.where(rows, lse, -jnp.inf)


def _backward(q, k, v, o, do, lse, causal=False, window=None, keep=None):
  """``_cudnn_backward_masked`` with ``keep`` as ``AttentionMask.keep`` gives it. A row that keeps no key at all
  has lse -inf: any finite value does there (the bias zeroes its probabilities, its output is zero)."""
  if keep is None:
    return _cudnn_backward_masked(q, k, v, o, do, lse, causal, window)
  lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
  return _cudnn_backward_masked(q, k, v, o, do, lse, causal, window, _heads_keep(keep, q))


# ------------------------------------------------------------------ the dispatch, shared by forward and backward
def _band_window(band, data: bool, tq: int, tk: int):
  """``(takes, window)``: whether cuDNN's causal mask (with ``sliding_window_length = window``, None: none) is the
  mask of the diagonal block of ``tq`` queries and ``tk`` keys, for a positional mask ``band`` (``lo <= query -
  key <= hi``) and no data mask."""
  lo, hi = band
  if data or tq != tk or lo != 0:
    return False, None
  return True, causal_blocks.causal_window(band, tq)


def _dispatch(ctx, mask: AttentionMask, extras, operands, *, run, empty, fallback):
  """``run(*operands, causal=, window=, keep=)`` on the block's path (module docstring), ``empty(*operands)``
  where the mask hides it, ``fallback(*operands)`` (the program's body) where cuDNN cannot take it."""
  if not (mask.positional or mask.data):
    return run(*operands)
  unmasked = lambda *x: run(*x)  # a new function each call: lax.switch caches its branches' traces by function
  tq, tk = ctx.sizes["i"], ctx.sizes["j"]
  biased = tq % 2 == 0 and tk % 2 == 0  # cuDNN's bias in training: even lengths only
  if mask.data:
    keep = mask.keep(ctx, extras)
    partly = (lambda *x: run(*x, keep=keep)) if biased else fallback
    case = jnp.where(~jnp.any(keep), 1, jnp.where(jnp.all(keep), 0, 2))
    return jax.lax.switch(case, [unmasked, empty, partly], *operands)
  hidden, visible = causal_blocks.band_cover(ctx, mask.band)
  partly = (lambda *x: run(*x, keep=mask.keep(ctx, ()))) if biased else fallback
  branches = [unmasked, empty, partly]
  case = jnp.where(hidden, 1, jnp.where(visible, 0, 2))
  takes, window = _band_window(mask.band, False, tq, tk)
  if takes:
    branches.append(lambda *x: run(*x, causal=True, window=window))
    case = jnp.where((case == 2) & (ctx.start("i") == ctx.start("j")), 3, case)
  return jax.lax.switch(case, branches, *operands)


def cudnn_attention_block(ctx, q, k, v, *extras, mask: AttentionMask, fallback):
  """One attention block (same contract as ``attention_block``) through cuDNN."""
  if not causal_blocks.takes_whole(ctx, backward=False):
    return fallback(ctx, q, k, v, *extras)  # padded keys, or a block spanning zigzag chunks
  return _dispatch(ctx, mask, extras, (q, k, v), run=_forward, empty=causal_blocks.empty_state,
                   fallback=lambda *x: fallback(ctx, *x, *extras))


def cudnn_backward_block(ctx, q, k, v, o, do, lse, *extras, mask: AttentionMask, part: str, fallback):
  """One block pair's dq (``part="dq"``), stacked [dk, dv] (``"dkv"``) or both (``"dq_dkv"``, a joint nest's
  block: one cuDNN call for the two programs) through cuDNN.

  Dispatches as ``cudnn_attention_block`` does; hidden pairs give zeros.
  """
  blocks = (q, k, v, o, do, lse)
  if not causal_blocks.takes_whole(ctx, backward=True):
    return fallback(ctx, *blocks, *extras)
  pick = causal_blocks.pick(part)
  run = lambda *x, **masks: pick(*_backward(*x, **masks))
  shapes = jax.eval_shape(run, *blocks)
  return _dispatch(ctx, mask, extras, blocks, run=run,
                   empty=lambda *x: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes),
                   fallback=lambda *x: fallback(ctx, *x, *extras))


# ------------------------------------------------------------------ work, for the cost model
def _work(block: Block, whole: bool) -> Work:
  """What ``_dispatch`` runs for ``block`` (``band_work``): where the band cuts it, cuDNN's share of a band on the
  diagonal (the pairs it keeps), else the whole block as a bias. Data masks count as keeping every pair their band
  keeps (an upper bound: which blocks they hide is data)."""
  def cut(block):
    tq, tk = block.sizes["i"], block.sizes["j"]
    if _band_window(block.band, block.data, tq, tk)[0] and block.span("i")[0] == block.span("j")[0]:
      return Work(fast=block.band_share())
    return Work() if tq % 2 == 0 and tk % 2 == 0 else Work(fast=0.0, fallback=1.0)
  return band_work(block, whole, cut)


def cudnn_work(block: Block, *, causal: bool, config=None) -> Work:
  """``cudnn_attention_block``'s work: what runs on cuDNN and what on the XLA body."""
  del causal, config  # the block's band and data say it
  return _work(block, causal_blocks.takes_whole(block, backward=False))


def cudnn_backward_work(block: Block, *, causal: bool, config=None) -> Work:
  """``cudnn_backward_block``'s work."""
  del causal, config
  return _work(block, causal_blocks.takes_whole(block, backward=True))


# ------------------------------------------------------------------ the kernel
def _make(program, config, interpret):
  del config, interpret
  return functools.partial(cudnn_attention_block, mask=mask_of(program.params), fallback=program.body)


def _make_backward(part):
  def make(program, config, interpret):
    del config, interpret
    return functools.partial(cudnn_backward_block, mask=mask_of(program.params), part=part, fallback=program.body)
  return make


def _joint(dq_program):
  """One cuDNN backward call per block pair for the dq and dk-dv programs run in one nest."""
  mask = mask_of(dq_program.params)
  return functools.partial(cudnn_backward_block, mask=mask, part="dq_dkv",
                           fallback=functools.partial(dq_dkv_block, mask=mask))


def _workspace(program, sizes, config):
  """The float32 log-sum-exp rows; with a mask, a block's kept pairs and bias (3 bytes a pair, per head only for
  a mask array over heads)."""
  del config
  lse = 4 * sizes["b"] * sizes["hk"] * sizes["g"] * sizes["i"]
  mask = mask_of(program.params)
  if not (mask.positional or mask.data):
    return lse
  heads = sizes["hk"] * sizes["g"] if "h" in (mask.mask_axes or ()) else 1
  return lse + 3 * sizes["b"] * heads * sizes["i"] * sizes["j"]


HALF = frozenset({np.dtype(jnp.bfloat16), np.dtype(jnp.float16)})


def _backward_kernel(part: str) -> Kernel:
  return Kernel(name=f"cudnn_attention_{part}", patterns=frozenset({f"attention_{part}"}), make=_make_backward(part),
                dtypes=HALF, platforms=frozenset({"gpu"}), dtype_of="q", work=cudnn_backward_work,
                workspace=_workspace, masks=frozenset(KINDS),
                description=f"cuDNN's flash backward, {part} of a block pair")


CUDNN_ATTENTION = Kernel(
    name="cudnn_attention", patterns=frozenset({"attention"}), make=_make, dtypes=HALF,
    platforms=frozenset({"gpu"}), dtype_of="q", work=cudnn_work, workspace=_workspace, preference=2,
    masks=frozenset(KINDS),
    backward=AttentionBackward(dq=_backward_kernel("dq"), dkv=_backward_kernel("dkv"), joint=_joint,
                               whole=cudnn_backward, everywhere=True),
    description="cuDNN flash attention (through jax's cuDNN custom call), log-sum-exp kept in float32; every mask "
                "(causal and windows by cuDNN's own masks or a bias, segment ids and mask arrays by a bias)")
