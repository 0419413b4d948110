"""``FP8Experts``: a Mixture-of-Experts layer's experts in FP8 on tmagemm's grouped GEMMs.

It replaces transformers' experts modules (``Qwen3MoeExperts``, ``MixtralExperts``,
``DeepseekV3Experts`` and the others built with ``use_experts_implementation``: a gate/up
weight (E, 2I, H) and a down weight (E, H, I) as 3-D tensors, ``forward(hidden_states,
top_k_index, top_k_weights)``) and computes what their ``grouped_mm`` implementation computes,
with e4m3 weights and activations quantized on the fly:

1. the (token, expert) pairs are sorted by expert on the device, stably, with each expert's
   cumulative end (one kernel up to ``ROUTE_MAX_PAIRS`` pairs, :mod:`tmagemm.triton.moe_permute`;
   ``torch.sort`` and ``torch.searchsorted`` beyond): no host sync, so the layer captures into
   CUDA graphs with routing that changes between replays;
2. the tokens are quantized straight into that order, one fp8 row per pair
   (:mod:`tmagemm.triton.moe_permute`);
3. gate/up: one grouped block- or row-scaled GEMM (``tmagemm.grouped_scaled_mm``, contiguous
   layout) over every expert;
4. SiLU-and-multiply and the down projection's input quantization in one kernel
   (:mod:`tmagemm.triton.silu_mul_quantize`), which multiplies each row's scales by its pair's
   routing weight, so the down projection's output comes out weighted;
5. down: the second grouped GEMM; then one kernel sums each token's pairs in fp32, in pair order
   (deterministic), leaving out the pairs routed to no local expert (ids outside 0..E-1,
   transformers' expert-parallel sentinels), which no group computed.

Checkpoint layout: the state dict holds each expert's projections under the names FP8
checkpoints on the Hugging Face hub use (``{e}.gate_proj.weight``, ``{e}.gate_proj.weight_scale_inv``,
``{e}.up_proj.*``, ``{e}.down_proj.*``: DeepSeek-V3, Qwen3-MoE-FP8), as views of the stacked
buffers the kernels read, so saving writes them and loading writes through them.
"""

from __future__ import annotations

import re
import torch
from torch import nn

from ..grouped import grouped_scaled_mm
from ..triton import moe_permute
from ..triton.moe_permute import ROUTE_MAX_PAIRS
from ..triton.silu_mul_quantize import silu_mul_quantize
from .linear import ACTIVATION_DTYPES, ALIGN, as_rows, keep_dtypes
from .mlp import is_silu
from .quantize import (
    FP8,
    SCALE_BLOCK,
    SCALED_MM_RECIPES,
    activation_scale_shape,
    check_device,
    check_recipe,
    custom_ops,
    dequantize_weight,
    quantize_weight,
    weight_scale_shape,
)

# The recipes the experts take: "tensor" would scale a whole batch's tokens, across experts, by
# one activation scale; convert keeps experts in high precision under it.
RECIPES = ("block", "row")
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_EXPERT_LAYER = r"(\d+)\.(gate_proj|up_proj|down_proj)"  # <e>.<projection>, the hub's per-expert names
_EXPERT_KEY = re.compile(_EXPERT_LAYER + r"\.(weight|weight_scale_inv)")


# ---------------------------------------------------------------------------- the steps
# Each step of the forward is a torch op under torch.compile (opaque, with a fake: the graph
# holds it whole) and a plain call in eager mode, where a custom op's dispatch alone costs about
# 9 us of host time (the steps' kernels launch directly, triton/moe_permute.py).


def route_pairs(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order, offs)``: the pairs sorted by expert and each expert's cumulative end
    (:func:`tmagemm.triton.moe_permute.route_pairs`)."""
    check_device(top_k_index, "FP8Experts")
    return moe_permute.route_pairs(top_k_index, num_experts)


def quantize_pairs(x: torch.Tensor, order: torch.Tensor, top_k: int,
                   recipe: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, scale, pos)``: the tokens x (T, K) quantized per ``recipe`` ("block" or "row")
    straight into the expert order ``order`` of their T * top_k pairs, and each pair's row
    (:func:`tmagemm.triton.moe_permute.quantize_pairs`)."""
    check_device(x, "FP8Experts")
    return moe_permute.quantize_pairs(x, order, top_k, "1x128" if recipe == "block" else recipe)


def silu_mul_quantize_activation(h: torch.Tensor, recipe: str, row_scale: torch.Tensor | None = None,
                                 row_scale_index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(act_fp8, scale)``: transformers' ``silu(gate) * up`` of a gate/up output h (S, 2I)
    quantized per ``recipe`` ("block" or "row"), each row's scales times
    ``row_scale[row_scale_index[r]]`` (or ``row_scale[r]``) if given
    (:func:`tmagemm.triton.silu_mul_quantize.silu_mul_quantize`)."""
    check_device(h, "FP8Experts")
    return silu_mul_quantize(h, "1x128" if recipe == "block" else recipe, row_scale, row_scale_index)


def combine_pairs(y: torch.Tensor, pos: torch.Tensor, valid_rows: torch.Tensor, top_k: int) -> torch.Tensor:
    """Each token's sum of its pairs' rows of y (S, N), pairs at rows >= valid_rows left out
    (:func:`tmagemm.triton.moe_permute.combine_pairs`)."""
    check_device(y, "FP8Experts")
    return moe_permute.combine_pairs(y, pos, valid_rows, top_k)


def _fake_route(top_k_index, num_experts):
    return (top_k_index.new_empty((top_k_index.numel(),), dtype=torch.int64),
            top_k_index.new_empty((num_experts,), dtype=torch.int32))


def _fake_quantize(x, order, top_k, recipe):
    s, k = order.shape[0], x.shape[1]
    return (x.new_empty((s, k), dtype=FP8), x.new_empty(activation_scale_shape(recipe, s, k), dtype=torch.float32),
            x.new_empty((s,), dtype=torch.int32))


def _fake_silu(h, recipe, row_scale=None, row_scale_index=None):
    m, k = h.shape[0], h.shape[1] // 2
    return h.new_empty((m, k), dtype=FP8), h.new_empty(activation_scale_shape(recipe, m, k), dtype=torch.float32)


def _fake_combine(y, pos, valid_rows, top_k):
    return y.new_empty((y.shape[0] // top_k, y.shape[1]))


_steps = custom_ops((route_pairs, _fake_route), (quantize_pairs, _fake_quantize),
                    (silu_mul_quantize_activation, _fake_silu), (combine_pairs, _fake_combine))


# ------------------------------------------------------------------------------ the layer


def experts_reason(module: nn.Module) -> str | None:
    """None when :class:`FP8Experts` can replace ``module``, else why not: a transformers experts
    module (``use_experts_implementation``) with gate/up weights concatenated [gate; up] (E, 2I,
    H), a down weight (E, H, I), no bias, no post-expert norm, transformers' default gate and a
    SiLU ``act_fn``; H and I multiples of 16 (block recipe: I of 128, so a scale block never
    spans gate and up)."""
    if isinstance(module, FP8Experts):
        return "already an FP8Experts"
    flags = ("has_gate", "has_bias", "is_transposed", "is_concatenated")
    if not all(hasattr(module, f) for f in flags):
        return f"{type(module).__name__} is not a transformers experts module (use_experts_implementation)"
    if not module.has_gate or module.has_bias or module.is_transposed or not module.is_concatenated \
            or getattr(module, "has_post_expert_norm", False):
        return (f"{type(module).__name__}: has_gate={module.has_gate}, has_bias={module.has_bias}, is_transposed="
                f"{module.is_transposed}, is_concatenated={module.is_concatenated}: only gated, concatenated, "
                "untransposed experts without bias or post-expert norm")
    apply_gate = getattr(type(module), "_apply_gate", None)
    if apply_gate is not None and getattr(apply_gate, "__name__", "") != "_default_apply_gate":
        return f"{type(module).__name__} has its own _apply_gate, not act_fn(gate) * up"
    if not is_silu(getattr(module, "act_fn", None)):
        return f"act_fn is {type(getattr(module, 'act_fn', None)).__name__}, not SiLU"
    return _weights_reason(getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None))


def _weights_reason(gate_up, down) -> str | None:
    """None for experts' weights FP8Experts takes (gate/up (E, 2I, H), down (E, H, I), H and I
    multiples of 16, one device), else why not."""
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor) \
            or gate_up.dim() != 3 or down.dim() != 3:
        return "gate_up_proj and down_proj must be 3-D tensors"
    e, two_i, h = gate_up.shape
    if two_i % 2 or tuple(down.shape) != (e, h, two_i // 2):
        return f"shapes: gate_up_proj {tuple(gate_up.shape)}, down_proj {tuple(down.shape)}"
    if h % ALIGN or (two_i // 2) % ALIGN:
        return f"hidden size {h} and intermediate size {two_i // 2} must be multiples of {ALIGN}"
    if gate_up.device != down.device:
        return f"gate_up_proj is on {gate_up.device}, down_proj on {down.device}"
    return None


class FP8Experts(nn.Module):
    """An MoE layer's experts with e4m3 weights: ``forward(hidden_states, top_k_index,
    top_k_weights)`` as transformers' experts modules (inference only).

    num_experts (E), hidden_size (H), intermediate_size (I): H and I multiples of 16, I of 128
    for the "block" recipe. recipe: "block" (1x128 activations x 128x128 weight blocks) or
    "row" (per token x per output channel). device: where the buffers live.

    Buffers: ``gate_up_proj`` (E, 2I, H) and ``down_proj`` (E, H, I) e4m3 (gate rows first, as
    transformers stacks them), ``gate_up_proj_scale_inv`` / ``down_proj_scale_inv`` their fp32
    dequantization scales per expert ((E, 2I/128, H/128) and (E, H/128, I/128) block; (E, 2I, 1)
    and (E, H, 1) row). They keep their dtypes through ``module.to(dtype)``.

    forward: hidden_states (T, H) bfloat16, float16 or float32; top_k_index (T, k) int32 or int64
    expert ids (torch.topk's); top_k_weights (T, k) floating routing weights. Returns (T, H) of hidden_states' dtype:
    ``sum_j w[t, j] * expert_{id[t, j]}(x[t])``, where an id outside 0..E-1 (an expert-parallel
    sentinel) contributes nothing. TypeError / ValueError for other dtypes, shapes or devices.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, recipe: str = "block",
                 device=None):
        super().__init__()
        for name, value in (("num_experts", num_experts), ("hidden_size", hidden_size),
                            ("intermediate_size", intermediate_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"FP8Experts: {name} must be a positive int, got {value!r}")
        if check_recipe(recipe) not in RECIPES:
            raise ValueError(f"FP8Experts: recipe must be 'block' or 'row', got {recipe!r} (one tensor-wise activation "
                             "scale would span every expert's tokens)")
        for name, value in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
            if value % ALIGN:
                raise ValueError(f"FP8Experts: {name} = {value} is not a multiple of {ALIGN} (16-byte fp8 rows)")
        if recipe == "block" and intermediate_size % SCALE_BLOCK:
            raise ValueError(f"FP8Experts: intermediate_size = {intermediate_size} is not a multiple of {SCALE_BLOCK}: "
                             "a 128-row scale block would span the gate and up projections")
        e, h, i = num_experts, hidden_size, intermediate_size
        self.num_experts, self.hidden_size, self.intermediate_size, self.recipe = e, h, i, recipe
        for name, (n, k) in (("gate_up_proj", (2 * i, h)), ("down_proj", (h, i))):
            self.register_buffer(name, torch.zeros(e, n, k, dtype=FP8, device=device))
            self.register_buffer(name + "_scale_inv", torch.ones(e, *weight_scale_shape(recipe, n, k),
                                                                 dtype=torch.float32, device=device))
        # The experts' ids, which searchsorted finds each group's end with (not state).
        self.register_buffer("expert_ids", torch.arange(e, device=device), persistent=False)

    # ---------------------------------------------------------------------------- building

    @classmethod
    @torch.no_grad()
    def from_experts(cls, experts: nn.Module, recipe: str = "block") -> FP8Experts:
        """An FP8Experts holding ``experts``' weights (a transformers experts module, see
        :func:`experts_reason`) quantized per ``recipe``, expert by expert, on their device."""
        reason = experts_reason(experts)
        if reason:
            raise TypeError(f"FP8Experts.from_experts: {reason}")
        return cls.from_weights(experts.gate_up_proj, experts.down_proj, recipe)

    @classmethod
    @torch.no_grad()
    def from_weights(cls, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, recipe: str = "block") -> FP8Experts:
        """An FP8Experts of high-precision experts' weights as transformers holds them: gate/up
        (E, 2I, H), gate rows first, and down (E, H, I), quantized per ``recipe``, expert by
        expert, on their device. TypeError for non-tensors, ValueError for shapes."""
        if not isinstance(gate_up_proj, torch.Tensor) or not isinstance(down_proj, torch.Tensor):
            raise TypeError("FP8Experts.from_weights: gate_up_proj and down_proj must be torch.Tensors")
        reason = _weights_reason(gate_up_proj, down_proj)
        if reason:
            raise ValueError(f"FP8Experts.from_weights: {reason}")
        e, two_i, h = gate_up_proj.shape
        layer = cls(e, h, two_i // 2, recipe, device=gate_up_proj.device)
        for g in range(e):
            for name, weight in (("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
                q, scale = quantize_weight(weight[g], recipe)
                getattr(layer, name)[g].copy_(q)
                getattr(layer, name + "_scale_inv")[g].copy_(scale)
        return layer

    def projection(self, expert: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weight, weight_scale_inv)`` of one expert's ``gate_proj``, ``up_proj`` or
        ``down_proj``: views of the stacked buffers (an FP8Linear's layout for that projection)."""
        i = self.intermediate_size
        if name == "down_proj":
            return self.down_proj[expert], self.down_proj_scale_inv[expert]
        rows = slice(0, i) if name == "gate_proj" else slice(i, 2 * i)
        scale_rows = slice(rows.start // SCALE_BLOCK, rows.stop // SCALE_BLOCK) if self.recipe == "block" else rows
        return self.gate_up_proj[expert, rows], self.gate_up_proj_scale_inv[expert, scale_rows]

    def dequantized(self, expert: int, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """One expert's projection weight (``gate_up_proj`` (2I, H) or ``down_proj`` (H, I))
        dequantized in ``dtype`` (for comparisons; the forward never builds it)."""
        return dequantize_weight(getattr(self, name)[expert], getattr(self, name + "_scale_inv")[expert], self.recipe,
                                 dtype)

    # ----------------------------------------------------------------------------- forward

    def check_input(self, hidden_states, top_k_index, top_k_weights) -> None:
        """The checks of forward (shapes, dtypes, devices: static under torch.compile)."""
        what = type(self).__name__
        for name, value in (("hidden_states", hidden_states), ("top_k_index", top_k_index),
                            ("top_k_weights", top_k_weights)):
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"{what}: {name} must be a torch.Tensor, got {type(value).__name__}")
        if hidden_states.dtype not in ACTIVATION_DTYPES:
            raise TypeError(f"{what}: hidden_states must be bfloat16, float16 or float32, got {hidden_states.dtype}")
        if hidden_states.dim() != 2 or hidden_states.shape[1] != self.hidden_size:
            raise ValueError(f"{what}: hidden_states has shape {tuple(hidden_states.shape)}; expected (tokens, "
                             f"{self.hidden_size})")
        if top_k_index.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{what}: top_k_index must hold int32 or int64 expert ids, got {top_k_index.dtype}")
        if not top_k_weights.is_floating_point():
            raise TypeError(f"{what}: top_k_weights must be floating point, got {top_k_weights.dtype}")
        tokens = hidden_states.shape[0]
        if top_k_index.dim() != 2 or top_k_index.shape[0] != tokens:
            raise ValueError(f"{what}: top_k_index has shape {tuple(top_k_index.shape)}; expected ({tokens}, top_k)")
        if tuple(top_k_weights.shape) != tuple(top_k_index.shape):
            raise ValueError(f"{what}: top_k_weights has shape {tuple(top_k_weights.shape)}, top_k_index "
                             f"{tuple(top_k_index.shape)}; they must match")
        for name, value in (("top_k_index", top_k_index), ("top_k_weights", top_k_weights)):
            if value.device != hidden_states.device:
                raise ValueError(f"{what}: {name} is on {value.device}, hidden_states on {hidden_states.device}")
        if self.gate_up_proj.device != hidden_states.device:
            raise ValueError(f"{what}: hidden_states is on {hidden_states.device}, the weights on "
                             f"{self.gate_up_proj.device}")

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        self.check_input(hidden_states, top_k_index, top_k_weights)
        tokens, top_k = top_k_index.shape
        h, e = self.hidden_size, self.num_experts
        if tokens == 0 or top_k == 0:
            return hidden_states.new_zeros(tokens, h)
        steps = _steps()
        # ---- routing, on the device: pairs sorted by expert (stably), ids outside 0..E-1 last
        if tokens * top_k <= ROUTE_MAX_PAIRS:  # decode sizes: one launch
            order, offs = steps.route_pairs(top_k_index, e)
        else:  # negative ids too sort last as unsigned 32-bit values
            sorted_ids, order = torch.sort(top_k_index.reshape(-1).long() & 0xFFFFFFFF, stable=True)
            offs = torch.searchsorted(sorted_ids, self.expert_ids, right=True, out_int32=True)

        # ---- the tokens quantized into expert order; gate/up of every pair, grouped by expert
        recipe_a, recipe_b = SCALED_MM_RECIPES[self.recipe]
        xq, xs, pos = steps.quantize_pairs(as_rows(hidden_states, h), order, top_k, self.recipe)
        gate_up = grouped_scaled_mm(xq, self.gate_up_proj.transpose(1, 2), xs, self._weight_scale("gate_up_proj"),
                                    offs=offs, out_dtype=hidden_states.dtype, scale_recipe_a=recipe_a,
                                    scale_recipe_b=recipe_b)

        # ---- SiLU * up, quantized, each row's scales times its pair's routing weight; then down
        hq, hs = steps.silu_mul_quantize_activation(gate_up, self.recipe, top_k_weights.reshape(-1), order)
        out = grouped_scaled_mm(hq, self.down_proj.transpose(1, 2), hs, self._weight_scale("down_proj"), offs=offs,
                                out_dtype=hidden_states.dtype, scale_recipe_a=recipe_a, scale_recipe_b=recipe_b)

        # ---- each token's pairs summed in fp32, in pair order; pairs of no local expert left out
        return steps.combine_pairs(out, pos, offs[-1:], top_k)

    def _weight_scale(self, name: str) -> torch.Tensor:
        """A projection's scales as the grouped GEMM takes them: (E, N/128, K/128) blocks, or
        (E, N) per channel."""
        scale = getattr(self, name + "_scale_inv")
        return scale.squeeze(-1) if self.recipe == "row" else scale

    # ---------------------------------------------------------------------- module plumbing

    def _apply(self, fn, recurse=True):
        """Module.to(dtype) and friends leave the fp8 weights and fp32 scales (and the expert
        ids) in their dtypes; device moves apply."""
        kept = [self._buffers[n] for n in ("gate_up_proj", "gate_up_proj_scale_inv", "down_proj",
                                           "down_proj_scale_inv", "expert_ids")]
        return super()._apply(keep_dtypes(fn, kept), recurse)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # Each expert's projections under the checkpoint names, as views of the stacked buffers.
        for g in range(self.num_experts):
            for name in PROJECTIONS:
                weight, scale = self.projection(g, name)
                for suffix, tensor in (("weight", weight), ("weight_scale_inv", scale)):
                    destination[f"{prefix}{g}.{name}.{suffix}"] = tensor if keep_vars else tensor.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        found = set()
        for key in [k for k in state_dict if k.startswith(prefix)]:
            match = _EXPERT_KEY.fullmatch(key[len(prefix):])
            if match is None or int(match.group(1)) >= self.num_experts:
                unexpected_keys.append(key)
                continue
            g, name, suffix = int(match.group(1)), match.group(2), match.group(3)
            weight, scale = self.projection(g, name)
            target, value = (weight if suffix == "weight" else scale), state_dict[key]
            if not isinstance(value, torch.Tensor):
                error_msgs.append(f"{key} is a {type(value).__name__}, not a tensor")
            elif suffix == "weight" and value.dtype != FP8:
                error_msgs.append(f"{key} has dtype {value.dtype}; FP8Experts loads float8_e4m3fn weights "
                                  "(quantize high-precision experts with FP8Experts.from_experts or "
                                  "tmagemm.nn.convert)")
            elif suffix == "weight_scale_inv" and not value.is_floating_point():
                error_msgs.append(f"{key} has dtype {value.dtype}; expected float32")
            elif value.numel() != target.numel() or (suffix == "weight" and tuple(value.shape) != tuple(target.shape)):
                error_msgs.append(f"{key}: checkpoint {tuple(value.shape)}, model {tuple(target.shape)}")
            else:
                with torch.no_grad():
                    target.copy_(value.reshape(target.shape))
                found.add(key)
        missing_keys.extend(f"{prefix}{g}.{name}.{suffix}" for g in range(self.num_experts) for name in PROJECTIONS
                            for suffix in ("weight", "weight_scale_inv")
                            if f"{prefix}{g}.{name}.{suffix}" not in found)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, recipe={self.recipe!r}")


def convert_experts(model: nn.Module, recipe: str = "block", skip=()) -> nn.Module:
    """Replace every module of ``model`` that :class:`FP8Experts` can take (:func:`experts_reason`)
    and whose name matches no pattern of ``skip`` with an FP8Experts of ``recipe`` holding its
    quantized weights, in place; return the model (a model that is itself such a module is
    returned converted)."""
    from .convert import matches

    if experts_reason(model) is None:
        return FP8Experts.from_experts(model, recipe)
    for name, module in list(model.named_modules()):
        if name and experts_reason(module) is None and not matches(name, skip):
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child,
                    FP8Experts.from_experts(module, recipe))
    return model


def expert_checkpoint_names(names) -> dict[str, set[int]]:
    """Of checkpoint layer names (``x.weight_scale_inv`` without the suffix), the experts
    modules they belong to: ``{"model.layers.0.mlp.experts": {0, 1, ...}}`` for names
    ``<module>.<e>.gate_proj`` / ``up_proj`` / ``down_proj``."""
    found: dict[str, set[int]] = {}
    for name in names:
        match = re.fullmatch(r"(.+)\." + _EXPERT_LAYER, name)
        if match:
            found.setdefault(match.group(1), set()).add(int(match.group(2)))
    return found
