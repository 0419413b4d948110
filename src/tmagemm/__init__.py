"""tmagemm: TMA-based GEMM kernels for NVIDIA Hopper GPUs, callable from PyTorch.

Public API: ``matmul`` (bf16/fp16), ``scaled_mm`` (fp8, the ``torch._scaled_mm`` contract),
``grouped_mm`` / ``grouped_scaled_mm`` (Mixture-of-Experts, the ``torch._grouped_mm`` contracts),
``quantize_fp8``, ``gate_up_silu_quant`` (a gated MLP's gate/up projection, SiLU-and-multiply and
1x128 quantization in one kernel, block-scaled fp8), and ``warmup`` / ``tune`` (compile and tune
ahead of time, at server start).
The torch ops live under ``torch.ops.tmagemm`` once ``tmagemm.ops`` is imported (which
importing tmagemm does).
"""

from . import nn, ops  # noqa: F401  (ops registers torch.ops.tmagemm.*)
from .api import matmul, scaled_mm
from .gate_up import gate_up_silu_quant
from .grouped import grouped_mm, grouped_scaled_mm
from .quant import quantize_fp8
from .startup import tune, warmup

__version__ = "0.1.0"
__all__ = ["matmul", "scaled_mm", "grouped_mm", "grouped_scaled_mm", "quantize_fp8", "gate_up_silu_quant", "warmup",
           "tune", "nn", "__version__"]
