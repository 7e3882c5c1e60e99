"""Kernels: local block kernels that ``Schedule.patch`` puts in place of a program's body, fused kernels that
``Schedule.lower_with`` runs a whole schedule as, and grouped GEMM kernels that ``Schedule.dispatch(gemm=...)``
computes a mixture of experts' expert GEMMs with. Each is one object in one module; one line here registers it.

A kernel of your own is registered the same way, from any module (``docs/kernels.md``)::

  from jaxmercury import kernels
  kernels.register(MY_KERNEL)
"""

from jaxmercury.kernels import attention, gemm, moe, xla
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
register(attention.cudnn.CUDNN_ATTENTION)
register(attention.cudnn_packed.CUDNN_PACKED)
register(attention.pallas.PALLAS_ATTENTION)
register(attention.triton.TRITON_ATTENTION)
register(attention.mosaic.MOSAIC_ATTENTION)
register(attention.ws.WS_ATTENTION)
register(gemm.mosaic.MOSAIC_MATMUL)
register(gemm.mosaic.JAX_MOSAIC_MATMUL)
# Fused kernels.
register(gemm.allgather.FUSED_ALLGATHER_MATMUL)
register(gemm.allgather_comm.FUSED_ALLGATHER_MATMUL_COMM)
register(gemm.allgather_jax.JAX_ALLGATHER_LHS_MATMUL)
register(gemm.reducescatter.FUSED_MATMUL_REDUCESCATTER)
register(gemm.reducescatter_ws.FUSED_MATMUL_REDUCESCATTER_WS)
register(gemm.allgather_ws.FUSED_ALLGATHER_MATMUL_WS)
register(attention.ring.FUSED_RING_ATTENTION)
register(attention.ws_forward.FUSED_RING_ATTENTION_WS)
# Grouped GEMM kernels (a dispatched mixture of experts' expert GEMMs).
register(moe.grouped_gemm.MOSAIC_GROUPED_GEMM)

__all__ = ["AttentionBackward", "Block", "DualGemm", "DualPrograms", "FusedKernel", "GroupedKernel", "Kernel",
           "KernelChoice", "Work", "interpret_mode", "param", "register"]
