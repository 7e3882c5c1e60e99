"""Local kernels that ``Schedule.patch`` can put in place of a program's body."""

from jaxmercury.pallas_kernels import cudnn_attention, registry  # noqa: F401  (registers kernels)
