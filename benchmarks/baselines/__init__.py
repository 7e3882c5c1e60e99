"""Plain-JAX baselines that jaxmercury is measured against (nothing in them comes from jaxmercury)."""

# XLA's automatic collective matmul: ``gemm.xla_auto`` under these flags, which XLA reads once, when JAX starts
# (``benchmarks.run`` runs it in a child process). No JAX here: the runner reads this before JAX starts.
WINDOWED_EINSUM_FLAGS = ("--xla_gpu_threshold_for_windowed_einsum_mib=0 --xla_gpu_multi_streamed_windowed_einsum=true "
                         "--xla_gpu_enable_latency_hiding_scheduler=true")
