"""Local kernels that ``Schedule.patch`` can put in place of a program's body."""

from jaxmercury.pallas_kernels import cudnn_attention, registry  # noqa: F401  (registers kernels)
from jaxmercury.pallas_kernels import flash_attention, triton_attention  # noqa: F401  (registers kernels)
from jaxmercury.pallas_kernels import mosaic_attention, mosaic_matmul  # noqa: F401  (registers kernels)
