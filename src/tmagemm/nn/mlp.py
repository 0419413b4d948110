"""``FP8GatedMLP``: a transformers gated SiLU MLP (``down_proj(act_fn(gate_proj(x)) * up_proj(x))``)
whose gate/up projection, SiLU-and-multiply and the down projection's input quantization run as
one kernel (``tmagemm.gate_up_silu_quant``), block-scaled fp8 recipe.

Forward: quantize x per 1x128 group -> fused gate/up (fp8 h and its 1x128 scales) -> the down
projection's block-scaled ``scaled_mm``: three launches where a chain of FP8Linear layers takes
eight (each projection quantizes its input and multiplies; SiLU and the product are two more)
and h never exists in 16 bits. Above FUSED_MAX_TOKENS tokens (larger decode batches, prefill)
the stacked gate/up weight runs as one block-scaled GEMM, then SiLU-and-multiply and a quantizer:
measured faster there.

Checkpoint layout: the module keeps the Hugging Face names. ``gate_proj`` and ``up_proj`` stay
``FP8Linear`` children whose ``weight`` / ``weight_scale_inv`` buffers are views of the two
halves of the stacked ``gate_up_weight`` (2I, H) / ``gate_up_weight_scale_inv`` (2I/128, H/128)
buffers the kernel reads (not saved: ``persistent=False``), so the state dict holds exactly
``gate_proj.weight``, ``gate_proj.weight_scale_inv``, ``up_proj.*`` and ``down_proj.*``, each
weight is stored once, and loading writes through the views into the stacked buffers.
"""

from __future__ import annotations

import ast
import functools

import torch
from torch import nn

from ..api import scaled_mm
from ..gate_up import GROUP, gate_up_silu_quant
from .linear import FP8Linear, check_features, check_input, keep_dtypes, quantize_input
from .quantize import FP8, activation_ops, quantize_weight
from .source import forward_def, statements

# The forward this module replaces, as transformers writes it (LlamaMLP, MistralMLP, Qwen2MLP,
# Qwen3MLP and many more): ``return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))``,
# or the same expression assigned to a name that is then returned.
# Tokens up to which forward runs the fused kernel. H100, decode preset "mlp fusion" (fused vs
# quantize -> gate/up GEMM -> SiLU * up -> quantize, per layer in a CUDA graph) on Llama-3-8B,
# Llama-3-70B TP 4, Qwen2.5-7B and DeepSeek-V3 MLPs: 1.00-1.23x at M = 1-16, at 24-32 0.97-0.98x
# on Llama-3-70B TP 4 and 1.01-1.12x on the others. Since the block-scaled gate/up GEMM takes the
# Triton 64 x 64 tiles at 33-64 tokens (plan.BLOCK_ONE_ROW_M), the chain is ahead there: fused
# 0.92-0.95x at 48 on three of the four (1.05x Llama-3-8B), 0.93-1.10x at 64; 0.91-0.99x at 96,
# 0.95-1.05x at 128, 0.80-0.87x at 256 (BENCHMARKS.md).
FUSED_MAX_TOKENS = 32

_GATED = ast.dump(ast.parse("self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))", mode="eval").body)


@functools.lru_cache(maxsize=None)
def has_gated_forward(cls: type) -> bool:
    """Whether ``cls.forward(self, x)`` computes exactly ``down_proj(act_fn(gate_proj(x)) *
    up_proj(x))`` and returns it (read from its source: nothing else may happen in it)."""
    fn = forward_def(cls)
    if fn is None or [a.arg for a in fn.args.args] != ["self", "x"] or fn.args.vararg or fn.args.kwarg:
        return False
    body = statements(fn)
    if len(body) == 1 and isinstance(body[0], ast.Return) and body[0].value is not None:
        return ast.dump(body[0].value) == _GATED
    if len(body) == 2 and isinstance(body[0], ast.Assign) and isinstance(body[1], ast.Return):
        (target,), ret = body[0].targets, body[1].value
        return (isinstance(target, ast.Name) and isinstance(ret, ast.Name) and ret.id == target.id
                and ast.dump(body[0].value) == _GATED)
    return False


def is_silu(act) -> bool:
    # torch's nn.SiLU, or transformers' SiLUActivation (ACT2FN["silu"]), which calls F.silu.
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


def _projection_reason(layer, name: str) -> str | None:
    if type(layer) is nn.Linear:
        return None
    if type(layer) is FP8Linear:  # exact type: tensor-parallel shards are not fused
        return None if layer.recipe == "block" else f"{name} is an FP8Linear with recipe {layer.recipe!r}, not 'block'"
    return f"{name} is a {type(layer).__name__}, not an nn.Linear or FP8Linear"


def gated_mlp_reason(mlp: nn.Module) -> str | None:
    """None when :class:`FP8GatedMLP` can replace ``mlp``, else why not: a module whose forward is
    ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` (:func:`has_gated_forward`) with a SiLU
    ``act_fn``; gate_proj and up_proj (H -> I, no bias) and down_proj (I -> H) each an nn.Linear or
    a "block" FP8Linear on one device; I a multiple of 128, H of 16."""
    if isinstance(mlp, FP8GatedMLP):
        return "already an FP8GatedMLP"
    layers = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if any(not isinstance(layer, nn.Module) for layer in layers) or not hasattr(mlp, "act_fn"):
        return f"{type(mlp).__name__} lacks gate_proj, up_proj, down_proj or act_fn"
    if not is_silu(mlp.act_fn):
        return f"act_fn is {type(mlp.act_fn).__name__}, not SiLU"
    if not has_gated_forward(type(mlp)):
        return f"{type(mlp).__name__}.forward is not down_proj(act_fn(gate_proj(x)) * up_proj(x))"
    gate, up, down = layers
    for layer, name in ((gate, "gate_proj"), (up, "up_proj"), (down, "down_proj")):
        reason = _projection_reason(layer, name)
        if reason:
            return reason
    h, i = gate.in_features, gate.out_features
    if (up.in_features, up.out_features, down.in_features, down.out_features) != (h, i, i, h):
        return (f"shapes: gate_proj {h} -> {i}, up_proj {up.in_features} -> {up.out_features}, down_proj "
                f"{down.in_features} -> {down.out_features}")
    if gate.bias is not None or up.bias is not None:
        return "gate_proj or up_proj has a bias (the fused kernel adds none)"
    if i % GROUP or h % 16:
        return f"intermediate size {i} is not a multiple of {GROUP} or hidden size {h} not of 16"
    devices = {layer.weight.device for layer in layers}
    if len(devices) > 1:
        return f"the projections are on several devices ({sorted(map(str, devices))})"
    return None


class FP8GatedMLP(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))`` with fp8 weights in 128x128 blocks, the
    gate/up projection, SiLU-and-multiply and h's 1x128 quantization fused (inference only).

    hidden_size: H, a multiple of 16; intermediate_size: I, a multiple of 128. bias: whether
    down_proj has one (a parameter of ``dtype``); gate_proj and up_proj never do.
    Buffers ``gate_up_weight`` (2I, H) e4m3 (rows [0, I) gate, [I, 2I) up) and
    ``gate_up_weight_scale_inv`` (2I/128, ceil(H/128)) fp32 are what the kernel reads; the children
    ``gate_proj`` / ``up_proj`` (FP8Linear) hold views of their halves, ``down_proj`` is an
    FP8Linear. The state dict has the children's keys only (HF's layout).
    Write the children's tensors in place (``copy_``, ``load_state_dict``, ``load_quantized``):
    replacing a child's buffer object detaches it from the stacked buffer (``load_state_dict(...,
    assign=True)`` is handled: the stacked buffers are rebuilt from the loaded children).

    forward(x): x (..., H) bfloat16, float16 or float32 -> (..., H) of x's dtype; the checks and
    errors of FP8Linear. No host synchronisation; traces under torch.compile(fullgraph=True).
    ``input_norm``: as FP8Linear's (the norm feeding the MLP, or None).
    """

    input_norm = None  # set with object.__setattr__: a reference, not a child module

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 dtype: torch.dtype = torch.bfloat16, device=None):
        super().__init__()
        check_features(hidden_size, intermediate_size, type(self).__name__)
        if intermediate_size % GROUP:
            raise ValueError(f"{type(self).__name__}: intermediate_size = {intermediate_size} is not a multiple of "
                             f"{GROUP} (each 1x128 group of h is one program's output)")
        h, i = hidden_size, intermediate_size
        self.hidden_size, self.intermediate_size = h, i
        self.register_buffer("gate_up_weight", torch.zeros(2 * i, h, dtype=FP8, device=device), persistent=False)
        self.register_buffer("gate_up_weight_scale_inv",
                             torch.ones(2 * i // GROUP, -(-h // GROUP), dtype=torch.float32, device=device),
                             persistent=False)
        # Built on the meta device: their buffers are replaced by views at once.
        self.gate_proj = FP8Linear(h, i, False, "block", dtype, device="meta")
        self.up_proj = FP8Linear(h, i, False, "block", dtype, device="meta")
        self.down_proj = FP8Linear(i, h, bias, "block", dtype, device)
        self._tie()
        self.register_load_state_dict_post_hook(_retie_after_load)

    # ---------------------------------------------------------------------------- building

    @classmethod
    def from_mlp(cls, mlp: nn.Module) -> FP8GatedMLP:
        """An FP8GatedMLP computing ``mlp`` (see :func:`gated_mlp_reason`; ValueError otherwise), on
        its device: nn.Linear projections are quantized ("block": 128x128 weights), FP8Linear ones
        are copied bit for bit (a "block" down_proj is reused as it is). down_proj's bias keeps its
        dtype."""
        reason = gated_mlp_reason(mlp)
        if reason:
            raise ValueError(f"FP8GatedMLP.from_mlp: {reason}")
        gate, up, down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        h, i = gate.in_features, gate.out_features
        dtype = down.bias.dtype if down.bias is not None else torch.bfloat16  # only a bias has one
        fused = cls(h, i, down.bias is not None, dtype, device=gate.weight.device)
        with torch.no_grad():
            for layer, rows in ((gate, slice(0, i)), (up, slice(i, 2 * i))):
                if type(layer) is FP8Linear:
                    q, scale = layer.weight, layer.weight_scale_inv
                else:
                    q, scale = quantize_weight(layer.weight, "block")
                fused.gate_up_weight[rows].copy_(q)
                fused.gate_up_weight_scale_inv[rows.start // GROUP: rows.stop // GROUP].copy_(scale)
        fused.down_proj = down if type(down) is FP8Linear else FP8Linear.from_linear(down, "block", dtype)
        return fused

    def _tie(self) -> None:
        """Point gate_proj's and up_proj's weight and scale buffers at the stacked buffers' halves."""
        i, nb = self.intermediate_size, self.intermediate_size // GROUP
        w, s = self.gate_up_weight, self.gate_up_weight_scale_inv
        self.gate_proj._buffers["weight"], self.up_proj._buffers["weight"] = w[:i], w[i:]
        self.gate_proj._buffers["weight_scale_inv"], self.up_proj._buffers["weight_scale_inv"] = s[:nb], s[nb:]

    def _tied(self) -> bool:
        i, nb = self.intermediate_size, self.intermediate_size // GROUP
        pairs = ((self.gate_proj.weight, self.gate_up_weight[:i]), (self.up_proj.weight, self.gate_up_weight[i:]),
                 (self.gate_proj.weight_scale_inv, self.gate_up_weight_scale_inv[:nb]),
                 (self.up_proj.weight_scale_inv, self.gate_up_weight_scale_inv[nb:]))
        return all(t.device == v.device and t.data_ptr() == v.data_ptr() and t.shape == v.shape
                   and t.stride() == v.stride() for t, v in pairs)

    def dequantized_weights(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_gate, W_up), each (I, H), dequantized (for debugging and comparisons)."""
        return self.gate_proj.dequantized_weight(dtype), self.up_proj.dequantized_weight(dtype)

    # ----------------------------------------------------------------------------- forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_input(x, self.hidden_size, type(self).__name__)
        xq, xs = quantize_input(x, self.hidden_size, "block", self.input_norm)
        if xq.shape[0] <= FUSED_MAX_TOKENS:
            hq, hs = gate_up_silu_quant(xq, xs, self.gate_up_weight, self.gate_up_weight_scale_inv)
        else:
            # Past decode sizes the stacked gate/up GEMM, SiLU-and-multiply and a quantizer are
            # faster than the fused kernel (h rounded to x's dtype first, like the unfused chain).
            gu = scaled_mm(xq, self.gate_up_weight.t(), xs, self.gate_up_weight_scale_inv, out_dtype=x.dtype,
                           scale_recipe_a="1x128", scale_recipe_b="128x128")
            g, u = gu.split(self.intermediate_size, dim=1)
            hq, hs = activation_ops().quantize_activation(nn.functional.silu(g) * u, "block")
        y = self.down_proj.quantized_input_mm(hq, hs, self.down_proj.bias, x.dtype)
        return y.reshape(*x.shape[:-1], self.hidden_size)

    # ---------------------------------------------------------------------- module plumbing

    def _apply(self, fn, recurse=True):
        """Device moves and dtype casts: the stacked buffers move once and keep their dtypes (as
        FP8Linear's), the children's views are re-derived from them instead of being copied."""
        for child in (self.gate_proj, self.up_proj):
            child._buffers["weight"] = child._buffers["weight_scale_inv"] = None
        try:
            super()._apply(keep_dtypes(fn, (self.gate_up_weight, self.gate_up_weight_scale_inv)), recurse)
        finally:
            self._tie()
        return self

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, fused gate/up"


def _retie_after_load(module: FP8GatedMLP, incompatible_keys) -> None:
    """After ``load_state_dict``: a load that copied into the children's views changed the stacked
    buffers already; one that replaced the children's tensors (``assign=True``) did not, so the
    stacked buffers are rebuilt from them (this MLP's gate/up held twice only meanwhile)."""
    if module._tied():
        return
    gate, up = module.gate_proj, module.up_proj
    module.gate_up_weight = torch.cat([gate.weight, up.weight])
    module.gate_up_weight_scale_inv = torch.cat([gate.weight_scale_inv, up.weight_scale_inv]).float()
    module._tie()


def fuse_gated_mlps(model: nn.Module, skip=(), quantize: bool = True) -> nn.Module:
    """Replace (in place) every gated SiLU MLP of ``model`` that :func:`gated_mlp_reason` accepts
    and none of whose projections' names match ``skip`` (``convert``'s rules) with an
    :class:`FP8GatedMLP`, and return the model (the model itself may be the MLP: then its
    replacement is returned). quantize: False fuses only MLPs whose three projections are already
    FP8Linear (a loaded FP8 checkpoint: high-precision layers stay as they are). An MLP reachable
    under several names becomes one FP8GatedMLP under all of them."""
    from .convert import matches

    def eligible(name: str, module: nn.Module) -> bool:
        if gated_mlp_reason(module) is not None:
            return False
        projections = ("gate_proj", "up_proj", "down_proj")
        if not quantize and any(type(getattr(module, p)) is not FP8Linear for p in projections):
            return False
        return not any(matches(f"{name}.{p}" if name else p, skip) for p in projections)

    if eligible("", model):
        return FP8GatedMLP.from_mlp(model)
    named = [(n, m) for n, m in model.named_modules(remove_duplicate=False) if n and gated_mlp_reason(m) is None]
    kept = {id(m) for n, m in named if not eligible(n, m)}
    fused: dict[int, FP8GatedMLP] = {}
    for name, mlp in named:
        if id(mlp) in kept:
            continue
        if id(mlp) not in fused:
            fused[id(mlp)] = FP8GatedMLP.from_mlp(mlp)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, fused[id(mlp)])
    return model
