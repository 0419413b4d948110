"""FP8 linear layers for real models: ``FP8Linear`` (quantized weight, activations quantized on
the fly, ``tmagemm.scaled_mm``), ``FP8GatedMLP`` (a gated SiLU MLP with its gate/up projection,
SiLU-and-multiply and quantization fused), ``FP8Experts`` (a Mixture-of-Experts layer's experts
on grouped GEMMs), ``FP8StackedLinear`` (an attention's q/k/v
projections as one GEMM), ``FP8RMSNorm`` (an RMSNorm that quantizes its output for the FP8 layers
it feeds), ``convert`` (swap a model's nn.Linear layers and, optionally, fuse its MLPs, attention
projections and norms), FP8 checkpoints in the Hugging Face layout, tensor-parallel shards, and
``warmup`` (compile and plan a converted model's kernels at start-up). docs/nn.md walks through
them."""

from .checkpoint import (
    from_pretrained_fp8,
    load_fp8_checkpoint,
    quantization_config,
    save_fp8_checkpoint,
)
from .convert import convert
from .experts import FP8Experts
from .linear import FP8Linear
from .mlp import FP8GatedMLP
from .norm import FP8RMSNorm
from .parallel import ColumnParallelFP8Linear, RowParallelFP8Linear, parallelize_linear
from .stacked import FP8StackedLinear, FP8StackMember
from .warmup import warmup

__all__ = [
    "ColumnParallelFP8Linear",
    "FP8Experts",
    "FP8GatedMLP",
    "FP8Linear",
    "FP8RMSNorm",
    "FP8StackMember",
    "FP8StackedLinear",
    "RowParallelFP8Linear",
    "convert",
    "from_pretrained_fp8",
    "load_fp8_checkpoint",
    "parallelize_linear",
    "quantization_config",
    "save_fp8_checkpoint",
    "warmup",
]
