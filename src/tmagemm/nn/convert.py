"""``convert``: swap a model's nn.Linear layers for FP8Linear in place, quantizing their weights, and
its Mixture-of-Experts experts modules for FP8Experts (and,
with ``fuse_gate_up``, its gated SiLU MLPs for FP8GatedMLP; with ``fuse_qkv``, its attention
projections for one stacked GEMM; with ``fuse_norms``, the RMSNorms feeding them for FP8RMSNorm,
which quantizes their input)."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable

from torch import nn

from .linear import ALIGN, FP8Linear
from .quantize import check_recipe

DEFAULT_SKIP = ("lm_head",)


def matches(name: str, patterns: Iterable[str]) -> bool:
    """Whether a dotted module name matches one of ``patterns``: a pattern (fnmatch syntax)
    matches the whole name or any dotted suffix of it, so "lm_head" matches "lm_head" and
    "model.lm_head", "mlp.down_proj" matches "model.layers.3.mlp.down_proj", and
    "model.layers.0.*" matches everything in layer 0."""
    parts = name.split(".")
    suffixes = [".".join(parts[i:]) for i in range(len(parts))]
    return any(fnmatch.fnmatchcase(s, p) for p in patterns for s in suffixes)


def aligned(linear: nn.Linear) -> bool:
    """Whether the fp8 kernels can take this layer: in_features and out_features multiples of 16
    (16-byte fp8 weight rows; 16-byte-aligned output rows)."""
    return linear.in_features % ALIGN == 0 and linear.out_features % ALIGN == 0


def convert(model: nn.Module, recipe: str = "block", skip: Iterable[str] = DEFAULT_SKIP,
            fuse_gate_up: bool = False, fuse_qkv: bool = False, fuse_norms: bool = False) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` (recursively, in place) with an
    :class:`FP8Linear` holding its quantized weight, and return the model.

    recipe: "block" (default), "row" or "tensor" (see FP8Linear). skip: module names or
    fnmatch patterns to keep in high precision (matched against the full dotted name and its
    dotted suffixes; default ("lm_head",): the logits are the most sensitive GEMM and the
    vocabulary is often not a multiple of 16). Layers whose in_features or out_features is not a
    multiple of 16 stay in high precision too (the fp8 kernels need 16-byte aligned rows).
    A model that is itself an nn.Linear is returned converted (it cannot be replaced in place).
    Mixture-of-Experts layers' experts modules (transformers' 3-D gate/up and down weights,
    ``Qwen3MoeExperts``, ``MixtralExperts``, ``DeepseekV3Experts``, ...: see
    :func:`tmagemm.nn.experts.experts_reason`) become :class:`~tmagemm.nn.FP8Experts` under the
    "block" and "row" recipes (grouped GEMMs over every expert; ``skip`` may name them too); the
    "tensor" recipe keeps them in high precision (one activation scale would span every
    expert's tokens).
    Subclasses of nn.Linear (LoRA wrappers, other quantized layers) are left alone; layers
    already FP8Linear are kept. The names of the converted layers are
    ``[n for n, m in model.named_modules() if isinstance(m, FP8Linear)]``.

    fuse_gate_up: first replace every gated SiLU MLP (transformers' LlamaMLP, Qwen2MLP, Qwen3MLP,
    MistralMLP, ...: ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``, see
    :func:`tmagemm.nn.mlp.gated_mlp_reason`) with an :class:`FP8GatedMLP`, whose gate/up
    projection, SiLU-and-multiply and down-projection input quantization run as one kernel;
    an MLP is fused only when none of its three projections is skipped (it is converted layer by
    layer otherwise). "block" recipe only (ValueError otherwise). The state dict keeps the
    unfused names (``mlp.gate_proj.weight``, ...), so checkpoints are the same either way.

    fuse_qkv: replace the q_proj, k_proj and v_proj of every module whose forward calls them in
    order on one input (transformers' attention modules) with stacked layers
    (:mod:`tmagemm.nn.stacked`): one quantization and one GEMM for the three, each projection
    keeping its own state-dict names. "block" and "row" recipes; projections with mixed biases,
    or (block) out_features not multiples of 128, are converted one by one.

    fuse_norms: last, replace every RMSNorm whose output a module's forward passes straight to
    converted layers (transformers' decoder layers: ``input_layernorm`` -> q/k/v,
    ``post_attention_layernorm`` -> the MLP) with an :class:`FP8RMSNorm`, which quantizes its
    output for them in the same kernel (:mod:`tmagemm.nn.norm`; "block" and "row" recipes; norms
    matching ``skip`` are kept). The state dict is unchanged.
    """
    check_recipe(recipe)
    if isinstance(skip, str):
        skip = (skip,)
    skip = tuple(skip)
    for flag, value in (("fuse_gate_up", fuse_gate_up), ("fuse_qkv", fuse_qkv), ("fuse_norms", fuse_norms)):
        if not isinstance(value, bool):
            raise TypeError(f"{flag} must be a bool, got {type(value).__name__}")
    if fuse_qkv and recipe == "tensor":
        raise ValueError("fuse_qkv=True needs recipe='block' or 'row' (tensor-wise layers have one scale each)")
    if fuse_norms and recipe == "tensor":
        raise ValueError("fuse_norms=True needs recipe='block' or 'row' (a tensor-wise scale needs every row's amax)")
    if fuse_gate_up:
        if recipe != "block":
            raise ValueError(f"fuse_gate_up=True needs recipe='block' (the fused kernel is block-scaled), got {recipe!r}")
        from .mlp import fuse_gated_mlps

        model = fuse_gated_mlps(model, skip)
    if fuse_qkv:
        from .stacked import fuse_stacked_projections

        model = fuse_stacked_projections(model, skip, recipe=recipe)
    from .experts import RECIPES as EXPERT_RECIPES, convert_experts

    if recipe in EXPERT_RECIPES:  # "tensor" keeps the experts in high precision
        model = convert_experts(model, recipe, skip)
    if type(model) is nn.Linear:
        return FP8Linear.from_linear(model, recipe) if aligned(model) else model
    # remove_duplicate=False: a layer reachable under two names is replaced under both (by one
    # FP8Linear), and skipped if either name is to be skipped.
    named = [(name, module) for name, module in model.named_modules(remove_duplicate=False)
             if type(module) is nn.Linear]
    kept = {id(module) for name, module in named if matches(name, skip) or not aligned(module)}
    converted: dict[int, FP8Linear] = {}
    for name, linear in named:
        if id(linear) in kept:
            continue
        if id(linear) not in converted:
            converted[id(linear)] = FP8Linear.from_linear(linear, recipe)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, converted[id(linear)])
    if fuse_norms:
        from .norm import fuse_norms as fuse

        model = fuse(model, skip)
    return model


def high_precision_linears(model: nn.Module) -> list[str]:
    """Names of the nn.Linear layers left in high precision (an HF checkpoint's
    ``modules_to_not_convert``)."""
    return [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
