"""Mixture-of-experts kernels: ``grouped_gemm``, the experts' grouped GEMM through JAX's Hopper ragged-dot kernels
(``mosaic_grouped_gemm``)."""

from jaxmercury.kernels.moe import grouped_gemm  # noqa: F401  (registered)
