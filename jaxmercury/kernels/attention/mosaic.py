"""Attention blocks through JAX's Mosaic GPU flash attention (Hopper, bf16/fp16).

The kernels are ``jax.experimental.pallas.ops.gpu.attention_mgpu``'s
(FlashAttention-3 style: TMA loads by a memory warpgroup, two compute
warpgroups on wgmma). Their conventions differ from ours and are converted
here:

- layout: queries ``[b, i, h, d]`` with query head ``h = hk * g + g_index``
  reading kv head ``h // g`` (so ours ``[b, i, hk, g, d]`` reshapes freely);
  log-sum-exp ``[b, h, i]``;
- scores are not scaled: queries are multiplied by ``1 / sqrt(d)`` first;
- the log-sum-exp is in base 2: ours is ``ln 2`` times it;
- shared-memory buffers are float16 (jax 0.11.2 refuses bf16 inputs), so
  bf16 blocks go through float16; values beyond +-65504 would overflow, and
  the incoming gradient ``do`` is rescaled by a power of two into float16's
  range (tiny gradients would otherwise underflow), the results scaled back.

Forward (``mosaic_attention``): causal blocks at traced offsets (ring steps)
take one of three paths at run time: fully visible (the non-causal kernel),
fully masked (skipped: ``out = 0``, ``lse = -inf``) or on the diagonal (the
causal kernel, when query and key blocks have one size, so that a partial
overlap starts on the diagonal). Backward (``mosaic_attention_dq``,
``mosaic_attention_dkv``): the kernels of ``attention_mgpu``'s backward from
the merged output and log-sum-exp; visible pairs only (it has no causal
mask), hidden pairs give zeros, diagonal pairs use the program's XLA body.

Blocks the kernels cannot take use the program's own body: keys that may hold
padding, blocks spanning zigzag chunks, a head dimension that is not a
multiple of 64, block lengths that are not multiples of the kernel's blocks,
or kernel blocks that do not fit in shared memory.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import attention_mgpu

from jaxmercury._compat import mgpu_attention_backward
from jaxmercury.kernels.attention import causal_blocks
from jaxmercury.kernels.config import param
from jaxmercury.kernels.mosaic_gpu import HALF_DTYPES, SMEM_BYTES, hopper_only
from jaxmercury.kernels.registry import AttentionBackward, Kernel
from jaxmercury.kernels.work import Block, Work

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
F16, F32 = jnp.float16, jnp.float32



@dataclasses.dataclass(frozen=True, kw_only=True)
class ForwardConfig:
  """The forward kernel's blocks and pipeline depth, with the tuner's choices."""

  block_q: int = param(64, 128)
  block_kv: int = param(128, 64)
  max_concurrent_steps: int = param(2, 4)


# Each backward kernel's own blocks: the rows it keeps (q for dq, kv for dkv) and those it streams.
@dataclasses.dataclass(frozen=True, kw_only=True)
class DqConfig:
  block_q: int = param(64, 128)
  block_kv: int = param(128, 64)
  compute_wgs: int = param(2, 1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DkvConfig:
  block_q: int = param(128, 64)
  block_kv: int = param(64, 128)
  compute_wgs: int = param(2, 1)


BACKWARD_STEPS = 2  # pipeline depth of the backward kernels (as in JAX's tests)


# ------------------------------------------------------------------ configurations


def _forward_fits(tq: int, tk: int, d: int, params: dict) -> bool:
  """Whether the forward kernel takes a [tq] x [tk] block pair of head dim ``d``."""
  bq, bkv, steps = params["block_q"], params["block_kv"], params["max_concurrent_steps"]
  if d % 64 or tq % (2 * bq) or tk % bkv:  # two compute warpgroups of block_q rows each
    return False
  steps = min(steps, tk // bkv)
  smem = 2 * bq * d * 2 + 2 * steps * bkv * d * 2 + 2 * bq * 4  # q/o, k and v buffers, lse
  return smem <= SMEM_BYTES


def _forward_config(tq: int, tk: int, d: int, params: dict):
  """attention_mgpu's TuningConfig for a [tq] x [tk] block pair of head dim ``d``, or None if it cannot run."""
  if not _forward_fits(tq, tk, d, params):
    return None
  return attention_mgpu.TuningConfig(block_q=params["block_q"], block_kv=params["block_kv"],
                              max_concurrent_steps=params["max_concurrent_steps"])


def _backward_blocks(part: str, params: dict) -> dict:
  """The four block sizes attention_mgpu's backward takes (it builds both kernels).

  The kernel of ``part`` gets ``params``' blocks; the other one (unused, and
  removed as dead code) the mirrored pairing JAX tests: its kept rows are
  ``part``'s streamed ones and the reverse.
  """
  bq, bkv = params["block_q"], params["block_kv"]
  if part == "dq":
    return dict(block_q_dq=bq, block_kv_dq=bkv, block_q_dkv=bkv, block_kv_dkv=bq)
  return dict(block_q_dkv=bq, block_kv_dkv=bkv, block_q_dq=bkv, block_kv_dq=bq)


def _backward_smem(d: int, wgs: int, steps: int, b: dict) -> int:
  """Shared memory of the larger of attention_mgpu's dq and dkv kernels, for blocks ``b``."""
  dq = 2 * wgs * b["block_q_dq"] * d * 2 + 2 * wgs * b["block_q_dq"] * 4 + 2 * steps * b["block_kv_dq"] * d * 2
  dkv = 2 * wgs * b["block_kv_dkv"] * d * 2 + steps * b["block_q_dkv"] * (2 * d * 2 + 2 * 4)
  return max(dq, dkv)


def _backward_warpgroups(tq: int, tk: int, d: int, part: str, params: dict) -> int | None:
  """The compute warpgroups the backward of a block pair runs with, or None if it cannot run.

  ``params["compute_wgs"]``, or one where that many do not divide the block
  or fit in shared memory.
  """
  b, steps = _backward_blocks(part, params), BACKWARD_STEPS
  if d % 64 or tq % b["block_q_dkv"] or tk % b["block_kv_dq"]:
    return None
  for wgs in dict.fromkeys((params["compute_wgs"], 1)):
    if tq % (b["block_q_dq"] * wgs) or tk % (b["block_kv_dkv"] * wgs) or _backward_smem(d, wgs, steps, b) > SMEM_BYTES:
      continue
    return wgs
  return None


def _backward_config(tq: int, tk: int, d: int, part: str, params: dict):
  """attention_mgpu's TuningConfig for the backward of a block pair, or None if it cannot run."""
  wgs = _backward_warpgroups(tq, tk, d, part, params)
  if wgs is None:
    return None
  b = _backward_blocks(part, params)
  return attention_mgpu.TuningConfig(block_q=b["block_q_dq"], block_kv=b["block_kv_dq"],
                                     max_concurrent_steps=BACKWARD_STEPS, compute_wgs_bwd=wgs, **b)


# ------------------------------------------------------------------ the kernels, in their conventions


def _kernel_forward(q, k, v, config):
  """attention_mgpu forward: (out [b, i, h, d] in q's dtype, lse [b, h, i] float32 base 2); unscaled scores."""
  out, (lse,) = attention_mgpu.attention(q, k, v, config, save_residuals=True)
  return out, lse


def _kernel_backward(q, k, v, o, do, lse, config):
  """attention_mgpu backward from a given output and base-2 lse: (dq [b, i, h, d], dk, dv [b, j, hk, d])."""
  return mgpu_attention_backward(q, k, v, o, do, lse, config)


# ------------------------------------------------------------------ conversions to our conventions


def _heads(x):
  """[b, i, hk, g, d] -> [b, i, hk * g, d]."""
  b, i, hk, g, d = x.shape
  return x.reshape(b, i, hk * g, d)


def _scaled_queries(q):
  return (q.astype(F32) * (1.0 / math.sqrt(q.shape[-1]))).astype(F16)


def _half_range(x):
  """(x * 2^e as float16, 2^e) with the largest magnitude of ``x`` brought into [1, 2) (2^e = 1 for zeros)."""
  top = jnp.max(jnp.abs(x.astype(F32)))
  exponent = jnp.where(top > 0, -jnp.floor(jnp.log2(jnp.where(top > 0, top, 1.0))), 0.0)
  factor = jnp.exp2(jnp.clip(exponent, -120.0, 120.0))  # a power of two: exact, undone exactly
  return (x.astype(F32) * factor).astype(F16), factor


def forward(q, k, v, config):
  """One block pair through the forward kernel, in our conventions.

  Args:
    q: [b, i, hk, g, d] bf16 or fp16.
    k, v: [b, j, hk, d].
    config: attention_mgpu's TuningConfig (its ``causal`` masks top-left aligned).

  Returns:
    ``(out [b, i, hk, g, d], lse [b, i, hk, g])`` in float32, lse in natural log.
  """
  b, i, hk, g, d = q.shape
  out, lse2 = _kernel_forward(_heads(_scaled_queries(q)), k.astype(F16), v.astype(F16), config)
  lse = jnp.transpose(lse2.astype(F32), (0, 2, 1)).reshape(b, i, hk, g) * LN2
  return out.reshape(q.shape).astype(F32), lse


def backward(q, k, v, o, do, lse, config):
  """(dq, dk, dv) of one block pair in float32 from the merged ``o`` and natural-log ``lse`` [b, i, hk, g]."""
  b, i, hk, g, d = q.shape
  scale = 1.0 / math.sqrt(d)
  do16, factor = _half_range(do)
  lse2 = jnp.transpose(lse.reshape(b, i, hk * g).astype(F32), (0, 2, 1)) * LOG2E
  dq, dk, dv = _kernel_backward(_heads(_scaled_queries(q)), k.astype(F16), v.astype(F16),
                                _heads(o.astype(F16)), _heads(do16), lse2, config)
  # The kernel differentiates with respect to the scaled queries: dq carries the scale once more.
  dq = dq.reshape(q.shape).astype(F32) * (scale / factor)
  return dq, dk.astype(F32) / factor, dv.astype(F32) / factor


# ------------------------------------------------------------------ block dispatch


def mosaic_attention_block(ctx, q, k, v, *, causal: bool, params: dict, fallback):
  """One attention block (``attention_block``'s contract) through attention_mgpu, else ``fallback``."""
  tq, tk = ctx.sizes["i"], ctx.sizes["j"]
  config = _forward_config(tq, tk, q.shape[-1], params)
  if config is None or not causal_blocks.takes_whole(ctx, backward=False):
    return fallback(ctx, q, k, v)
  if not causal:
    return forward(q, k, v, config)
  if tq == tk:  # blocks start at multiples of their size: a partial overlap is the diagonal
    partial = functools.partial(forward, config=dataclasses.replace(config, causal=True))
  else:
    partial = functools.partial(fallback, ctx)
  return causal_blocks.dispatch(ctx, (q, k, v), visible=functools.partial(forward, config=config),
                                  hidden=causal_blocks.empty_state, partial=partial)


def mosaic_backward_block(ctx, q, k, v, o, do, lse, *, causal: bool, part: str, params: dict, fallback):
  """One block pair's dq (``part="dq"``) or stacked [dk, dv] (``"dkv"``) through attention_mgpu's backward.

  Causal pairs: visible ones through the kernel, hidden ones zeros, the
  others (on the diagonal) through ``fallback``.
  """
  tq, tk = ctx.sizes["i"], ctx.sizes["j"]
  config = _backward_config(tq, tk, q.shape[-1], part, params)
  if config is None or not causal_blocks.takes_whole(ctx, backward=True):
    return fallback(ctx, q, k, v, o, do, lse)
  pick = causal_blocks.pick(part)
  run = lambda *x: pick(*backward(*x, config))
  if not causal:
    return run(q, k, v, o, do, lse)
  shape = jax.eval_shape(run, q, k, v, o, do, lse)
  return causal_blocks.dispatch(ctx, (q, k, v, o, do, lse), visible=run,
                                  hidden=lambda *x: jnp.zeros(shape.shape, shape.dtype),
                                  partial=functools.partial(fallback, ctx))


# ------------------------------------------------------------------ work, for the cost model


def mosaic_work(block: Block, *, causal: bool, config: ForwardConfig) -> Work:
  """``mosaic_attention_block``'s work: what runs on attention_mgpu and what on the XLA body."""
  params = dataclasses.asdict(config)
  fits = _forward_fits(block.sizes["i"], block.sizes["j"], block.sizes["d"], params)
  whole = fits and causal_blocks.takes_whole(block, backward=False)
  return causal_blocks.dispatch_work(block, causal, whole)


def _backward_work(part: str):
  def work(block: Block, *, causal: bool, config) -> Work:
    """``mosaic_backward_block``'s work: visible pairs on the kernel, diagonal ones on the XLA body."""
    params = dataclasses.asdict(config)
    fits = _backward_warpgroups(block.sizes["i"], block.sizes["j"], block.sizes["d"], part, params) is not None
    whole = fits and causal_blocks.takes_whole(block, backward=True)
    return causal_blocks.dispatch_work(block, causal, whole, diagonal=False)
  return work


# ------------------------------------------------------------------ the kernel


def _make(program, config: ForwardConfig, interpret: bool):
  del interpret
  return functools.partial(mosaic_attention_block, causal=program.params["causal"],
                           params=dataclasses.asdict(config), fallback=program.body)


def _make_backward(part: str):
  def make(program, config, interpret: bool):
    del interpret
    return functools.partial(mosaic_backward_block, causal=program.params["causal"], part=part,
                             params=dataclasses.asdict(config), fallback=program.body)
  return make


def _forward_workspace(program, sizes, config) -> int:
  """float16 copies of q, k, v and the output, and the float32 lse."""
  s = sizes
  q = s["b"] * s["i"] * s["hk"] * s["g"] * s["d"]
  kv = s["b"] * s["j"] * s["hk"] * s["d"]
  return 2 * (2 * q + 2 * kv) + 4 * s["b"] * s["hk"] * s["g"] * s["i"]


def _backward_workspace(program, sizes, config) -> int:
  """float16 copies of q, k, v, o, do and dq; per-query-head float16 dk and dv; float32 lse and delta."""
  s = sizes
  q = s["b"] * s["i"] * s["hk"] * s["g"] * s["d"]
  kv = s["b"] * s["j"] * s["hk"] * s["d"]
  per_head_kv = kv * s["g"]
  return 2 * (4 * q + 2 * kv + 2 * per_head_kv) + 2 * 4 * s["b"] * s["hk"] * s["g"] * s["i"]


def _backward_kernel(part: str, config: type) -> Kernel:
  return Kernel(name=f"mosaic_attention_{part}", patterns=frozenset({f"attention_{part}"}),
                make=_make_backward(part), config=config, dtypes=HALF_DTYPES, platforms=frozenset({"gpu"}),
                dtype_of="q", supports=hopper_only, workspace=_backward_workspace, work=_backward_work(part),
                description=f"attention_mgpu's {part} backward kernel, from the merged output and log-sum-exp")


MOSAIC_ATTENTION = Kernel(
    name="mosaic_attention", patterns=frozenset({"attention"}), make=_make, config=ForwardConfig,
    dtypes=HALF_DTYPES, platforms=frozenset({"gpu"}), supports=hopper_only, workspace=_forward_workspace,
    work=mosaic_work, preference=1,
    backward=AttentionBackward(dq=_backward_kernel("dq", DqConfig), dkv=_backward_kernel("dkv", DkvConfig)),
    description="JAX's Mosaic GPU flash attention (attention_mgpu: TMA loads, two compute warpgroups)")
