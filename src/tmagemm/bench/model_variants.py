"""The variants of ``tmagemm bench --preset model``: how each one's linear layers are made from
the bf16 model (converted, swapped for PyTorch's fp8 GEMMs, or zeroed), PyTorch's block-scale
layouts, and the check of a decoder layer's linears against float64.

Every variant is a copy of the bf16 model's module tree sharing its tensors
(``static_decode.shared_copy``); the torch peers share the fp8 weights of their tmagemm twin and
quantize activations with the same tmagemm quantizer, so only the GEMM differs.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn

from .. import nn as tnn
from ..nn import FP8Experts, FP8GatedMLP, FP8Linear
from ..nn.convert import DEFAULT_SKIP, matches
from ..nn.experts import experts_reason
from ..nn.quantize import SCALE_BLOCK
from ..quant import quantize_fp8
from . import mlp_fusion
from .decode import tolerance
from .moe_layer import torch_experts_forward
from .static_decode import shared_copy, swap_modules

VARIANTS = {
    "bf16": "the model as built: nn.Linear (cuBLAS)",
    "fp8-tmagemm": "tmagemm.nn.convert(recipe='block'): 1x128 activation x 128x128 weight scales, tmagemm.scaled_mm",
    "fp8-tmagemm-fused": "tmagemm.nn.convert(recipe='block', fuse_gate_up=True, fuse_qkv=True) of fp8-tmagemm's "
                         "layers: FP8GatedMLP (quantize, fused gate/up + SiLU*mul + quantize, down) and q/k/v "
                         "as one stacked GEMM",
    "fp8-tmagemm-fused-norms": "fp8-tmagemm-fused plus fuse_norms=True: each decoder layer's two RMSNorms as "
                               "FP8RMSNorm, quantizing their output for q/k/v and the MLP in the norm's kernel",
    "fp8-torch-block": "fp8-tmagemm's weights and activation quantizer; GEMM on torch.nn.functional.scaled_mm "
                       "(BlockWise1x128 x BlockWise128x128, cuBLAS)",
    "fp8-tmagemm-row": "tmagemm.nn.convert(recipe='row'): per-token x per-channel scales, tmagemm.scaled_mm",
    "fp8-torch-row": "fp8-tmagemm-row's weights and quantizer; GEMM on torch._scaled_mm row-wise (cuBLAS); an "
                     "MoE's experts on torch._scaled_grouped_mm",
    "no-proj": "reference: every converted projection (and an MoE's experts) returns zeros (the rest of the step: "
               "attention, norms, rotary, router, lm_head, launches)",
}  # fmt: skip


# The convert flags each fused variant sets (a before/after run may import an older tmagemm).
FUSED_FLAGS = {"fp8-tmagemm-fused": ("fuse_gate_up", "fuse_qkv"),
               "fp8-tmagemm-fused-norms": ("fuse_gate_up", "fuse_qkv", "fuse_norms")}


def fused_available(variant: str) -> bool:
    """Whether this tmagemm's ``tmagemm.nn.convert`` takes every flag of fused ``variant``."""
    parameters = inspect.signature(tnn.convert).parameters
    return all(flag in parameters for flag in FUSED_FLAGS[variant])


# ------------------------------------------------------------------------ torch fp8 layers


def torch_block_weight_scale(scale: torch.Tensor) -> torch.Tensor:
    """PyTorch's layout of 128x128 weight scales for ``F.scaled_mm``'s BlockWise128x128 operand
    ``b = w.t()``: (KB rounded up to 4, NB) with stride (1, KB4), i.e. the transpose of a
    row-major (NB, KB4) copy of tmagemm's (NB, KB) ``weight_scale_inv`` (padding scales 1: they
    cover no column of K). Made once per layer."""
    nb, kb = scale.shape
    padded = torch.ones(nb, -(-kb // 4) * 4, dtype=torch.float32, device=scale.device)
    padded[:, :kb] = scale
    return padded.t()


def torch_block_activation_scale(scale: torch.Tensor) -> torch.Tensor:
    """PyTorch's layout of 1x128 activation scales: the same (M, KB) values outer-dim-major,
    stride (1, M) (one small copy per call: tmagemm's quantizer writes them row-major)."""
    out = scale.new_empty(scale.shape[1], scale.shape[0]).t()
    return out.copy_(scale)


def torch_block_api():
    """(torch.nn.functional.scaled_mm, ScalingType), or RuntimeError saying this torch lacks them."""
    if not hasattr(F, "scaled_mm") or not hasattr(F, "ScalingType"):
        raise RuntimeError(f"torch {torch.__version__} has no torch.nn.functional.scaled_mm / ScalingType "
                           "(cuBLAS block-scaled fp8, torch 2.10 or later)")  # fmt: skip
    return F.scaled_mm, F.ScalingType


class TorchBlockFP8Linear(nn.Module):
    """A block-recipe FP8Linear's weight (shared, not copied) with the GEMM on
    ``torch.nn.functional.scaled_mm`` (cuBLAS, BlockWise1x128 x BlockWise128x128); the
    activation is quantized by the layer's own quantizer, so the fp8 operands are the same."""

    def __init__(self, layer: FP8Linear):
        super().__init__()
        if type(layer) is not FP8Linear or layer.recipe != "block":
            raise TypeError(f"expected a block-recipe FP8Linear, got {layer!r}")
        self.scaled_mm, self.scaling = torch_block_api()
        self.inner, self.in_features, self.out_features = layer, layer.in_features, layer.out_features
        self.register_buffer("weight_scale_torch", torch_block_weight_scale(layer.weight_scale_inv), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        xq, xs = torch.ops.tmagemm_nn.quantize_activation(x.reshape(-1, self.in_features).contiguous(), "block")
        y = self.scaled_mm(xq, self.inner.weight.t(), torch_block_activation_scale(xs), self.scaling.BlockWise1x128,
                           self.weight_scale_torch, self.scaling.BlockWise128x128, output_dtype=x.dtype)  # fmt: skip
        if self.inner.bias is not None:
            y = y + self.inner.bias
        return y.reshape(*lead, self.out_features)


class TorchRowFP8Linear(nn.Module):
    """A row-recipe FP8Linear's weight (shared) with the GEMM on ``torch._scaled_mm`` (row-wise,
    fast accumulation, like the layer's own tmagemm call); the same activation quantizer."""

    def __init__(self, layer: FP8Linear):
        super().__init__()
        if type(layer) is not FP8Linear or layer.recipe != "row":
            raise TypeError(f"expected a row-recipe FP8Linear, got {layer!r}")
        self.inner, self.in_features, self.out_features = layer, layer.in_features, layer.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        xq, xs = torch.ops.tmagemm_nn.quantize_activation(x.reshape(-1, self.in_features).contiguous(), "row")
        y = torch._scaled_mm(xq, self.inner.weight.t(), xs, self.inner.weight_scale_inv.t(), bias=self.inner.bias,
                             out_dtype=x.dtype, use_fast_accum=True)  # fmt: skip
        return y.reshape(*lead, self.out_features)


class TorchRowFP8Experts(nn.Module):
    """A row-recipe FP8Experts' weights (shared) with its two grouped GEMMs on
    ``torch._scaled_grouped_mm`` (row-wise, PyTorch's only fp8 grouped GEMM) in transformers'
    grouped_mm steps (``moe_layer.torch_experts_forward``: activations quantized per row by
    torch ops)."""

    def __init__(self, layer: FP8Experts):
        super().__init__()
        if type(layer) is not FP8Experts or layer.recipe != "row":
            raise TypeError(f"expected a row-recipe FP8Experts, got {layer!r}")
        self.inner, self.num_experts = layer, layer.num_experts
        self.gate_up_proj = layer.gate_up_proj  # step_weight_bytes counts the experts by this

    def forward(self, hidden_states, top_k_index, top_k_weights):
        m = self.inner
        return torch_experts_forward(hidden_states, top_k_index, top_k_weights, m.num_experts, m.gate_up_proj,
                                     m.down_proj, m.gate_up_proj_scale_inv.squeeze(-1), m.down_proj_scale_inv.squeeze(-1))


class ZeroExperts(nn.Module):
    """Stands in for an MoE layer's experts: zeros of the tokens' shape, no weight read."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.num_experts = layer.num_experts

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return torch.zeros_like(hidden_states)


class ZeroProjection(nn.Module):
    """Stands in for a projection: zeros of its output shape, no weight read."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.out_features = layer.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros(*x.shape[:-1], self.out_features)


def build_variant(name: str, model: nn.Module, built: dict[str, nn.Module]) -> nn.Module:
    """The causal LM that variant ``name`` decodes with: ``model`` itself (bf16) or a copy sharing
    its tensors with converted or swapped linears (lm_head stays as it is: convert's default
    skip). ``built`` holds the variants built so far (the torch peers reuse the fp8 weights of
    fp8-tmagemm / fp8-tmagemm-row)."""

    def quantized(recipe: str) -> nn.Module:
        twin = {"block": "fp8-tmagemm", "row": "fp8-tmagemm-row"}[recipe]
        return built[twin] if twin in built else tnn.convert(shared_copy(model), recipe=recipe)

    def swapped(base: nn.Module, kind: type, make) -> nn.Module:
        copy = shared_copy(base)
        if not swap_modules(copy, lambda n, m: type(m) is kind and not matches(n, DEFAULT_SKIP), make):
            raise ValueError(f"{name}: the model has no {kind.__name__} layer to swap")
        return copy

    if name == "bf16":
        return model
    if name == "fp8-tmagemm":
        return quantized("block")
    if name == "fp8-tmagemm-row":
        return quantized("row")
    if name in FUSED_FLAGS:
        # From fp8-tmagemm's layers: the same fp8 bits, o_proj and down_proj shared, gate/up and
        # q/k/v copied once into the stacked buffers (fused norms: their weights copied).
        flags = dict.fromkeys(FUSED_FLAGS[name], True)
        return tnn.convert(shared_copy(quantized("block")), recipe="block", **flags)
    has_experts = any(experts_reason(m) is None for m in model.modules())
    if name == "fp8-torch-block":
        if has_experts:
            raise ValueError("torch has no block-scaled grouped GEMM for the model's experts")
        return swapped(quantized("block"), FP8Linear, TorchBlockFP8Linear)
    if name == "fp8-torch-row":
        copy = swapped(quantized("row"), FP8Linear, TorchRowFP8Linear)
        swap_modules(copy, lambda n, m: type(m) is FP8Experts, TorchRowFP8Experts)
        return copy
    if name == "no-proj":
        copy = swapped(model, nn.Linear, ZeroProjection)
        swap_modules(copy, lambda n, m: experts_reason(m) is None, ZeroExperts)
        return copy
    raise ValueError(f"unknown variant {name!r}")


# ------------------------------------------------------------------------------- checks


CHECKED = (nn.Linear, FP8Linear, TorchBlockFP8Linear, TorchRowFP8Linear, FP8GatedMLP)


def check_linears(layer: nn.Module, batch: int, seed: int = 0) -> tuple[float, float, str]:
    """Every linear of one decoder layer (nn.Linear, FP8Linear, the torch fp8 layers) and every
    fused gated MLP (FP8GatedMLP) on a random (batch, K) input against float64 of the operands
    it multiplies (fp8: the quantized activation and weights, dequantized; a fused MLP's h =
    silu(g) * u unquantized, as the decode preset's mlp fusion check). Other module types are
    left to the logits check. Returns (error, tolerance, where) of the module whose error is the
    largest fraction of its tolerance; error = max|out - ref| / max|ref|; tolerances as the
    decode preset's."""
    gen = torch.Generator().manual_seed(seed + batch)
    like = activation_like(layer)
    worst = (0.0, 1.0, "", -1.0)
    for name, m in layer.named_modules():
        if type(m) not in CHECKED:
            continue
        k = m.hidden_size if type(m) is FP8GatedMLP else m.in_features
        x = torch.randn(batch, k, generator=gen).to(device=like.device, dtype=like.dtype)
        out = m(x).double()
        ref, tol, where = _reference(name, m, x)
        finite = bool(torch.isfinite(out).all())
        err = ((out - ref).abs().max() / ref.abs().max().clamp(min=1e-300)).item() if finite else float("inf")
        if err / tol > worst[3]:
            worst = (err, tol, where, err / tol)
    return worst[0], worst[1], worst[2]


def _reference(name: str, m: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, float, str]:
    """float64 output of a checked module on x, its tolerance, and how to name it."""
    if type(m) is FP8GatedMLP:
        down = m.down_proj
        ref = mlp_fusion.reference(x, m.gate_up_weight, down.weight, m.gate_up_weight_scale_inv, down.weight_scale_inv)
        ref = ref if down.bias is None else ref + down.bias.double()
        return ref, mlp_fusion.TOLERANCE, f"{name} (fused gate/up) {m.intermediate_size}x{m.hidden_size}"
    inner = getattr(m, "inner", m)  # the torch fp8 layers wrap the FP8Linear whose tensors they use
    k = inner.in_features
    if type(inner) is nn.Linear:
        ref, tol = x.double() @ inner.weight.double().t(), tolerance("bf16", k)
    else:
        block = inner.recipe == "block"
        xq, xs = quantize_fp8(x, "1x128" if block else inner.recipe, check_finite=False)
        xs = xs.double().repeat_interleave(SCALE_BLOCK, 1)[:, :k] if block else xs.double()
        ref = (xq.double() * xs) @ inner.dequantized_weight(torch.float64).t()
        tol = tolerance("fp8-block" if block else f"fp8-{inner.recipe}", k, fast_accum=True)
    ref = ref if inner.bias is None else ref + inner.bias.double()
    return ref, tol, f"{name} {inner.out_features}x{k}"


def activation_like(layer: nn.Module) -> torch.Tensor:
    """A tensor with the dtype and device of a decoder layer's activations: its first 16/32-bit
    floating parameter (a norm's weight; fp8 weights are buffers)."""
    return next(p for p in layer.parameters() if p.is_floating_point() and p.element_size() > 1)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """|got - want| / |want| in the Frobenius norm."""
    return ((got - want).norm() / want.norm().clamp(min=1e-30)).item()
