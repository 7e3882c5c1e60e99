"""The one place that reaches into JAX internals, for what JAX has no public route to.

``jax.nn.dot_product_attention(..., return_residual=True)`` casts cuDNN's
log-sum-exp to the output dtype (bf16), too coarse to merge partial
attention results; the raw cuDNN call keeps it in float32. Its backward can
only reuse its own forward's residuals; ring attention's backward needs it
with the merged output and log-sum-exp. ``ShardingTypeError`` (a call JAX's
sharding types refuse on Explicit mesh axes) is not exported by JAX. cuDNN's packed layout (documents of a
packed row as segments, ``q_offsets``/``kv_offsets``) is reached only through the private cuDNN module, its backward
with given statistics likewise.
"""

import jax
from jax._src.core import ShardingTypeError  # noqa: F401
from jax._src.cudnn.fused_attention_stablehlo import (
  MaskType,
  _dot_product_attention_bwd_p_wrapper,
  _normalize_layout,
  combine_bias_and_mask,
)
from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention as cudnn_attention
from jax.experimental.pallas.ops.gpu import attention_mgpu


def cudnn_attention_backward(q, k, v, o, do, lse, *, scale: float, causal: bool, sliding_window_length=None,
                             mask=None):
  """cuDNN's flash backward with a given output and log-sum-exp (BTNH; lse [B, N, T] float32).

  Passing the final ``o`` and ``lse`` of a merged (ring) attention gives each
  key block's share of the gradients, which the public API cannot: its
  backward only reuses the residuals of its own forward call.
  ``sliding_window_length`` and a boolean ``mask`` ([B or 1, N or 1, T, S])
  as the forward's (``cudnn_attention``): the mask becomes the same additive
  bias, with no bias gradient.
  """
  unused = jax.numpy.zeros(0, dtype=q.dtype)
  bias = unused if mask is None else combine_bias_and_mask(None, mask, q.dtype)
  mask_type = MaskType.CAUSAL if causal else MaskType.NO_MASK
  return _dot_product_attention_bwd_p_wrapper.bind(
      q, k, v, bias, unused, unused, unused, unused, unused, unused, lse, o, do,
      scale=scale, seed=42, dropout_rate=0.0, variadic_args=(mask is not None, False), mask_type=mask_type,
      layout=_normalize_layout("BTNH").value, sliding_window_length=sliding_window_length)


def cudnn_packed_attention(q, k, v, q_seqlen, kv_seqlen, q_offsets, kv_offsets, *, scale: float, causal: bool,
                           sliding_window_length=None):
  """cuDNN's flash attention over packed segments (BTNH), and its raw softmax statistics.

  ``q_offsets``, ``kv_offsets`` int32 [B, M + 1] and ``q_seqlen``,
  ``kv_seqlen`` int32 [B, M]: each row's segments (start, length) on either
  side, -1 past its last (JAX's documented packed layout; M >= 2, as
  ``M == 1`` takes JAX's unpacked path, which ignores the offsets). The
  padding mask keeps a segment's queries to its keys; ``causal`` is top-left
  within each segment. Hopper or newer. Returns ``(o [B, T, N, H], stats
  [B * M, N, T] float32)``: stats per segment, numbered across the batch's
  rows, by position within the segment (natural log); rows outside every
  segment are not written.
  """
  mask_type = MaskType.PADDING_CAUSAL if causal else MaskType.PADDING
  return cudnn_attention(q, k, v, q_seqlen=q_seqlen, kv_seqlen=kv_seqlen, q_offsets=q_offsets, kv_offsets=kv_offsets,
                         scale=scale, mask_type=mask_type, sliding_window_length=sliding_window_length,
                         qkv_layout="BTNH", return_residual=True)


def cudnn_packed_attention_backward(q, k, v, o, do, stats, q_seqlen, kv_seqlen, q_offsets, kv_offsets, *,
                                    scale: float, causal: bool, sliding_window_length=None):
  """cuDNN's packed flash backward from a given output and softmax statistics (``cudnn_packed_attention``'s
  layouts, ``stats`` as it returns them): (dq, dk, dv); rows outside every segment are not written."""
  unused = jax.numpy.zeros(0, dtype=q.dtype)
  mask_type = MaskType.PADDING_CAUSAL if causal else MaskType.PADDING
  return _dot_product_attention_bwd_p_wrapper.bind(
      q, k, v, unused, q_seqlen, kv_seqlen, q_offsets, kv_offsets, unused, unused, stats, o, do,
      scale=scale, seed=42, dropout_rate=0.0, variadic_args=(False, False), mask_type=mask_type,
      layout=_normalize_layout("BTNH").value, sliding_window_length=sliding_window_length)


def mgpu_attention_backward(q, k, v, o, do, lse, config):
  """Mosaic GPU flash attention's backward kernels with a given output and log-sum-exp.

  ``jax.experimental.pallas.ops.gpu.attention_mgpu`` is public, but only its
  forward is: the backward kernels are reached through its ``custom_vjp``
  rule ``_attention_bwd``, a private function, which (like cuDNN's public
  API) would otherwise only see its own forward's residuals. Conventions:
  q, o, do [B, T, H, D] and k, v [B, S, Hkv, D] in float16; lse [B, H, T]
  float32 in base 2; scores unscaled. Returns (dq, dk, dv) in float16.
  """
  return attention_mgpu._attention_bwd(config, False, (q, k, v, o, lse), do)
