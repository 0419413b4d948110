"""tmagemm: TMA-based GEMM kernels for NVIDIA Hopper GPUs, callable from PyTorch."""

__version__ = "0.1.0"
