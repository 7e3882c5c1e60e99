"""Attention blocks through cuDNN flash attention (GPU, bf16/fp16).

Causal blocks at traced offsets (ring steps) take one of three paths chosen
at run time: fully visible (no mask), on the diagonal (cuDNN's causal mask),
or fully masked (skipped: ``out = 0``, ``lse = -inf``). Query and key blocks
of one size start at multiples of it, so a partial overlap is the diagonal;
blocks of different sizes that overlap partially, key blocks that may hold
padding, and blocks spanning zigzag chunks use the program's own XLA body.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxmercury import _compat
from jaxmercury.kernels import causal_dispatch
from jaxmercury.kernels.registry import AttentionBackward, Kernel
from jaxmercury.kernels.work import Block, Work
from jaxmercury.programs.attention_backward import dq_dkv_block


def _cudnn(q, k, v, causal):
  b, i, hk, g, d = q.shape
  mask = _compat.MaskType.CAUSAL if causal else _compat.MaskType.NO_MASK
  out, lse = _compat.cudnn_attention(
      q.reshape(b, i, hk * g, d), k, v, scale=1.0 / math.sqrt(d), mask_type=mask,
      qkv_layout="BTNH", return_residual=True)
  lse = jnp.transpose(lse.astype(jnp.float32), (0, 2, 1)).reshape(b, i, hk, g)
  return out.reshape(b, i, hk, g, d).astype(jnp.float32), lse


def cudnn_attention_block(ctx, q, k, v, *, causal: bool, fallback):
  """One attention block (same contract as ``attention_block``) through cuDNN."""
  tq, tk = ctx.sizes["i"], ctx.sizes["j"]
  if ctx.extents["j"] % tk or not (ctx.contiguous("i") and ctx.contiguous("j")):
    return fallback(ctx, q, k, v)  # padded keys, or a block spanning zigzag chunks
  if not causal:
    return _cudnn(q, k, v, False)
  if tq == tk:  # blocks start at multiples of their size: a partial overlap is the diagonal
    partial = lambda q, k, v: _cudnn(q, k, v, True)
  else:
    partial = functools.partial(fallback, ctx)
  return causal_dispatch.dispatch(ctx, (q, k, v), visible=lambda q, k, v: _cudnn(q, k, v, False),
                                  hidden=causal_dispatch.empty_state, partial=partial)


def _make(program, config, interpret):
  del config, interpret
  causal = program.params["causal"]
  return functools.partial(cudnn_attention_block, causal=causal, fallback=program.body)


def cudnn_work(block: Block, *, causal: bool, config=None) -> Work:
  """``cudnn_attention_block``'s work: what runs on cuDNN and what on the XLA body."""
  whole = not block.padded("j") and block.contiguous("i") and block.contiguous("j")
  return causal_dispatch.dispatch_work(block, causal, whole)


def _cudnn_backward(q, k, v, o, do, lse):
  return _cudnn_backward_masked(q, k, v, o, do, lse, False)


def cudnn_backward(q, k, v, o, do, lse, causal: bool):
  """(dq, dk, dv) through cuDNN's flash backward from a given output and log-sum-exp.

  Layouts: q, o, do [b, i, heads, d]; k, v [b, j, kv heads, d]; lse [b, i,
  heads] (natural log, as ``_cudnn`` returns it). Gradients in the inputs' dtype.
  """
  stats = jnp.transpose(lse, (0, 2, 1)).astype(jnp.float32)
  return _compat.cudnn_attention_backward(q, k, v, o, do, stats, scale=1.0 / math.sqrt(q.shape[-1]), causal=causal)


def _cudnn_backward_masked(q, k, v, o, do, lse, causal):
  """(dq, dk, dv) of one block pair ([b, i, hk, g, d] queries) from the merged output and lse, float32."""
  b, i, hk, g, d = q.shape
  flat = lambda x: x.reshape(b, i, hk * g, d)
  dq, dk, dv = cudnn_backward(flat(q), k, v, flat(o), flat(do), lse.reshape(b, i, hk * g), causal)
  return dq.reshape(q.shape).astype(jnp.float32), dk.astype(jnp.float32), dv.astype(jnp.float32)


def cudnn_backward_block(ctx, q, k, v, o, do, lse, *, causal: bool, part: str, fallback):
  """One block pair's dq (``part="dq"``), stacked [dk, dv] (``"dkv"``) or both (``"dq_dkv"``, a joint nest's
  block: one cuDNN call for the two programs) through cuDNN.

  Dispatches as ``cudnn_attention_block`` does; hidden causal pairs give zeros.
  """
  pick = {"dq": lambda dq, dk, dv: dq, "dkv": lambda dq, dk, dv: jnp.stack([dk, dv], axis=3),
          "dq_dkv": lambda dq, dk, dv: (dq, jnp.stack([dk, dv], axis=3))}[part]
  tq, tk = ctx.sizes["i"], ctx.sizes["j"]
  padded = ctx.extents["j"] % tk or ctx.extents["i"] % tq
  if padded or not (ctx.contiguous("i") and ctx.contiguous("j")) or (causal and tq != tk):
    return fallback(ctx, q, k, v, o, do, lse)
  if not causal:
    return pick(*_cudnn_backward_masked(q, k, v, o, do, lse, False))
  shapes = jax.eval_shape(lambda *x: pick(*_cudnn_backward_masked(*x, False)), q, k, v, o, do, lse)
  return causal_dispatch.dispatch(ctx, (q, k, v, o, do, lse),
                                  visible=lambda *x: pick(*_cudnn_backward_masked(*x, False)),
                                  hidden=lambda *x: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes),
                                  partial=lambda *x: pick(*_cudnn_backward_masked(*x, True)))


def cudnn_backward_work(block: Block, *, causal: bool, config=None) -> Work:
  """``cudnn_backward_block``'s work (block pairs of two sizes fall back whole when causal)."""
  whole = (not block.padded("j") and not block.padded("i") and block.contiguous("i") and block.contiguous("j")
           and not (causal and block.sizes["i"] != block.sizes["j"]))
  return causal_dispatch.dispatch_work(block, causal, whole)


def _make_backward(part):
  def make(program, config, interpret):
    del config, interpret
    return functools.partial(cudnn_backward_block, causal=program.params["causal"], part=part,
                             fallback=program.body)
  return make


def _joint(dq_program):
  """One cuDNN backward call per block pair for the dq and dk-dv programs run in one nest."""
  causal = dq_program.params["causal"]
  return functools.partial(cudnn_backward_block, causal=causal, part="dq_dkv",
                           fallback=functools.partial(dq_dkv_block, causal=causal))


def _lse_rows(program, sizes, config):
  return 4 * sizes["b"] * sizes["hk"] * sizes["g"] * sizes["i"]


HALF = frozenset({np.dtype(jnp.bfloat16), np.dtype(jnp.float16)})


def _backward_kernel(part: str) -> Kernel:
  return Kernel(name=f"cudnn_attention_{part}", patterns=frozenset({f"attention_{part}"}), make=_make_backward(part),
                dtypes=HALF, platforms=frozenset({"gpu"}), dtype_of="q", work=cudnn_backward_work,
                workspace=_lse_rows, description=f"cuDNN's flash backward, {part} of a block pair")


CUDNN_ATTENTION = Kernel(
    name="cudnn_attention", patterns=frozenset({"attention"}), make=_make, dtypes=HALF,
    platforms=frozenset({"gpu"}), work=cudnn_work, workspace=_lse_rows, preference=2,
    backward=AttentionBackward(dq=_backward_kernel("dq"), dkv=_backward_kernel("dkv"), joint=_joint,
                               whole=cudnn_backward, everywhere=True),
    description="cuDNN flash attention (through jax's cuDNN custom call), log-sum-exp kept in float32")
