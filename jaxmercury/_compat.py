"""The one place that reaches into JAX internals, for what JAX has no public route to.

``jax.nn.dot_product_attention(..., return_residual=True)`` casts cuDNN's
log-sum-exp to the output dtype (bf16), too coarse to merge partial
attention results; the raw cuDNN call keeps it in float32.
"""

from jax._src.cudnn.fused_attention_stablehlo import MaskType  # noqa: F401
from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention as cudnn_attention  # noqa: F401
