"""Attention kernels, one module each (registry names in brackets):

- ``cudnn``: cuDNN's flash attention on blocks, every mask of ``programs.masks`` (``cudnn_attention``);
- ``cudnn_packed``: cuDNN's packed layout, segment ids as segments, only their pairs computed (``cudnn_packed``);
- ``pallas``: flash attention written in portable Pallas, Triton backend or interpret mode (``pallas_attention``);
- ``triton``: the same forward written in Triton, through jax-triton (``triton_attention``);
- ``mosaic``: JAX's Mosaic GPU FlashAttention-3 kernels, ``attention_mgpu`` (``mosaic_attention``);
- ``ws``: our warp-specialized kernels as a local kernel, forward and backward (``ws_attention``);
- ``ring``: ring attention in one Mosaic GPU kernel, one warpgroup per CTA (``fused_ring_attention``);
- ``ws_forward``: the warp-specialized forward, on one device or as a ring (``fused_ring_attention_ws``);
- ``ws_backward``: the warp-specialized backward, dq, dk and dv in one pass; ``ws_order``: the forward's order of
  work items;
- ``causal_blocks``: how a local kernel takes a causal block at traced offsets.
"""

from jaxmercury.kernels.attention import cudnn, cudnn_packed, mosaic, pallas, ring, triton, ws, ws_forward  # noqa: F401  (registered)
