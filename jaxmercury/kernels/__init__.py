"""Kernels: local block kernels that ``Schedule.patch`` puts in place of a program's body, fused kernels that
``Schedule.lower_with`` runs a whole schedule as, and grouped GEMM kernels that ``Schedule.dispatch(gemm=...)``
computes a mixture of experts' expert GEMMs with. Each is one object in one module; one line here registers it.

A kernel of your own is registered the same way, from any module (``docs/kernels.md``)::

  from jaxmercury import kernels
  kernels.register(MY_KERNEL)
"""

from jaxmercury.kernels import (
                                cudnn_attention,
                                flash_attention,
                                fused_allgather_matmul,
                                fused_allgather_matmul_comm,
                                fused_allgather_matmul_ws,
                                fused_matmul_reducescatter,
                                fused_matmul_reducescatter_ws,
                                fused_ring_attention,
                                fused_ring_attention_ws,
                                jax_allgather_matmul,
                                mosaic_attention,
                                mosaic_grouped_gemm,
                                mosaic_matmul,
                                triton_attention,
                                ws_attention,
                                xla,
)
from jaxmercury.kernels.config import param
from jaxmercury.kernels.registry import (
                                AttentionBackward,
                                DualGemm,
                                DualPrograms,
                                FusedKernel,
                                GroupedKernel,
                                Kernel,
                                KernelChoice,
                                interpret_mode,
                                register,
)
from jaxmercury.kernels.work import Block, Work

# Local kernels, in the order the tuner tries them.
register(xla.XLA)
register(cudnn_attention.CUDNN_ATTENTION)
register(flash_attention.PALLAS_ATTENTION)
register(triton_attention.TRITON_ATTENTION)
register(mosaic_attention.MOSAIC_ATTENTION)
register(ws_attention.WS_ATTENTION)
register(mosaic_matmul.MOSAIC_MATMUL)
register(mosaic_matmul.JAX_MOSAIC_MATMUL)
# Fused kernels.
register(fused_allgather_matmul.FUSED_ALLGATHER_MATMUL)
register(fused_allgather_matmul_comm.FUSED_ALLGATHER_MATMUL_COMM)
register(jax_allgather_matmul.JAX_ALLGATHER_LHS_MATMUL)
register(fused_matmul_reducescatter.FUSED_MATMUL_REDUCESCATTER)
register(fused_matmul_reducescatter_ws.FUSED_MATMUL_REDUCESCATTER_WS)
register(fused_allgather_matmul_ws.FUSED_ALLGATHER_MATMUL_WS)
register(fused_ring_attention.FUSED_RING_ATTENTION)
register(fused_ring_attention_ws.FUSED_RING_ATTENTION_WS)
# Grouped GEMM kernels (a dispatched mixture of experts' expert GEMMs).
register(mosaic_grouped_gemm.MOSAIC_GROUPED_GEMM)

__all__ = ["AttentionBackward", "Block", "DualGemm", "DualPrograms", "FusedKernel", "GroupedKernel", "Kernel",
           "KernelChoice", "Work", "interpret_mode", "param", "register"]
