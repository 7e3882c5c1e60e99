"""GEMM kernels, one module each (registry names in brackets):

- ``mosaic``: local GEMM blocks, ours (``mosaic_matmul``) and JAX's warp-specialized Hopper GEMM
  (``jax_mosaic_matmul``);
- ``allgather``: all-gather GEMM in one kernel, A's tiles forwarded as the GEMM reads them
  (``fused_allgather_matmul``); ``allgather_comm``: the same with dedicated communication CTAs
  (``fused_allgather_matmul_comm``); ``allgather_ws``: on JAX's warp-specialized GEMM body
  (``fused_allgather_matmul_ws``); ``allgather_jax``: JAX's own collective GEMM (``jax_allgather_lhs_matmul``);
- ``reducescatter``: GEMM + reduce-scatter in one kernel, partial sums stored into the peer
  (``fused_matmul_reducescatter``); ``reducescatter_ws``: on JAX's warp-specialized GEMM body
  (``fused_matmul_reducescatter_ws``);
- ``tiles``: the tiles, the pipeline and the epilogue they share; ``peer``: the ring GEMMs' checks and padding.
"""

from jaxmercury.kernels.gemm import (  # noqa: F401  (registered)
  allgather,
  allgather_comm,
  allgather_jax,
  allgather_ws,
  mosaic,
  reducescatter,
  reducescatter_ws,
)
