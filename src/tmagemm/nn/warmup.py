"""``tmagemm.nn.warmup``: compile and plan, at start-up, every kernel a converted model's FP8 layers
can run, so no request stalls on a compile (docs/nn.md, "Warm-up").

``tmagemm.warmup`` does this for bare GEMM shapes; a model's layers also run their activation
quantizers (whose Triton launch specializes on the token count: one, a multiple of 16, other)
and, with fused MLPs, ``gate_up_silu_quant``; fused norms their norm-and-quantize kernel. Here each
distinct layer (FP8Linear, FP8GatedMLP, a stack, FP8Experts, FP8RMSNorm) runs its own computation once per
token-count bucket (``tmagemm.startup.m_buckets``), so exactly the kernels, configs and plans of
the model's calls are built.
"""

from __future__ import annotations

import gc
import sys
import time

import torch
from torch import nn

from ..startup import Summary, m_buckets
from .experts import FP8Experts
from .linear import FP8Linear
from .mlp import FP8GatedMLP
from .norm import FP8RMSNorm
from .quantize import rms_norm_quantize_activation
from .stacked import FP8StackedLinear, FP8StackMember


def _layers(model: nn.Module) -> dict[tuple, nn.Module]:
    """One module per distinct call signature: FP8GatedMLPs, stacked projections, FP8Linears
    outside them (a fused MLP's gate/up children and a stack's members are not called on their
    own), FP8Experts and FP8RMSNorms."""
    fused = [m for m in model.modules() if isinstance(m, FP8GatedMLP)]
    inside = {id(child) for m in fused for child in (m.gate_proj, m.up_proj, m.down_proj)}
    layers: dict[tuple, nn.Module] = {}
    for m in fused:
        bias = m.down_proj.bias
        key = ("mlp", m.hidden_size, m.intermediate_size, None if bias is None else bias.dtype, m.down_proj.weight.device)
        layers.setdefault(key, m)
    for m in model.modules():
        if isinstance(m, FP8StackedLinear):  # its members are served by its stacked GEMM
            bias = None if m.stacked_bias is None else m.stacked_bias.dtype
            layers.setdefault(("stack", m.in_features, m.out_sizes, m.recipe, bias, m.weight.device), m)
        elif isinstance(m, FP8Linear) and not isinstance(m, FP8StackMember) and id(m) not in inside:
            bias = None if m.bias is None else m.bias.dtype
            layers.setdefault(("linear", m.in_features, m.out_features, m.recipe, bias, m.weight.device), m)
    for m in model.modules():
        if isinstance(m, FP8Experts):
            layers.setdefault(("experts", m.hidden_size, m.intermediate_size, m.num_experts, m.recipe,
                               m.gate_up_proj.device), m)
    for m in model.modules():
        if isinstance(m, FP8RMSNorm):
            layers.setdefault(("norm", m.hidden_size, m.recipe, m.weight.dtype, m.weight.device), m)
    return layers


def _run(layer: nn.Module, x: torch.Tensor, top_k: int) -> None:
    if isinstance(layer, FP8Experts):
        # Each token to top_k distinct experts, spread evenly, as a router's choice may be.
        k = min(top_k, layer.num_experts)
        ids = torch.rand(x.shape[0], layer.num_experts, device=x.device).argsort(dim=1)[:, :k]
        layer(x, ids, torch.full(ids.shape, 1.0 / k, device=x.device, dtype=x.dtype))
    elif isinstance(layer, FP8RMSNorm):
        # The norm's kernel without its forward, which would keep a hand-off for its layers.
        rms_norm_quantize_activation(x, layer.weight, layer.variance_epsilon, layer.recipe)
    else:
        layer(x)


def warmup(model: nn.Module, *, dtype: torch.dtype = torch.bfloat16, max_tokens: int = 8192,
           m_values=None, progress: bool = True) -> Summary:
    """Run every distinct FP8 layer of ``model`` once per token count a forward pass may bring.

    dtype: the activations' dtype (bfloat16, float16 or float32, as the model runs). max_tokens:
    the largest number of tokens (batch x sequence) one call will see; m_values: the token counts
    to run instead of :func:`tmagemm.startup.m_buckets` of ``max_tokens``. Inputs are random, the
    outputs discarded; weights are not touched. Prints progress to stderr unless ``progress`` is
    False and returns a :class:`tmagemm.startup.Summary` (calls, seconds, the slowest). Raises
    ValueError when the model has no FP8 layer or the token counts are not positive.
    """
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"tmagemm.nn.warmup: dtype must be bfloat16, float16 or float32, got {dtype}")
    layers = _layers(model)
    if not layers:
        raise ValueError("tmagemm.nn.warmup: the model has no FP8 layer (convert it first)")
    values = sorted({int(m) for m in (m_values if m_values is not None else m_buckets(max_tokens))})
    if not values or values[0] < 1:
        raise ValueError(f"tmagemm.nn.warmup: token counts must be positive, got {values}")
    # Experts layers run with the model's experts per token (its config's num_experts_per_tok).
    top_k = int(getattr(getattr(model, "config", None), "num_experts_per_tok", None) or 2)
    summary, started, total = Summary(), time.perf_counter(), len(layers) * len(values)
    with torch.no_grad():
        for key, layer in layers.items():
            width, device = key[1], key[-1]
            inputs = torch.randn(values[-1], width, device=device).to(dtype)
            for m in values:
                t0 = time.perf_counter()
                _run(layer, inputs[:m], top_k)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                spent = time.perf_counter() - t0
                summary.calls += 1
                label = f"{type(layer).__name__} {key[1]}x{key[2]} M={m}"
                summary.slowest = sorted(summary.slowest + [(spent, label)], reverse=True)[:5]
                if progress:
                    print(f"\rtmagemm.nn.warmup [{summary.calls}/{total}] {label:<44} "
                          f"{time.perf_counter() - started:6.1f} s", end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    gc.collect()  # compiling leaves reference cycles: collect them now, not during a first request
    summary.seconds = time.perf_counter() - started
    return summary
