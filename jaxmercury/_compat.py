"""The one place that reaches into JAX internals, for what JAX has no public route to.

``jax.nn.dot_product_attention(..., return_residual=True)`` casts cuDNN's
log-sum-exp to the output dtype (bf16), too coarse to merge partial
attention results; the raw cuDNN call keeps it in float32. Its backward can
only reuse its own forward's residuals; ring attention's backward needs it
with the merged output and log-sum-exp. ``ShardingTypeError`` (a call JAX's
sharding types refuse on Explicit mesh axes) is not exported by JAX.
"""

import jax
from jax._src.core import ShardingTypeError  # noqa: F401
from jax._src.cudnn.fused_attention_stablehlo import (
  MaskType,
  _dot_product_attention_bwd_p_wrapper,
  _normalize_layout,
  combine_bias_and_mask,
)
from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention as cudnn_attention  # noqa: F401
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
