"""``FP8Linear``: an inference linear layer with an e4m3 weight, quantizing its input on the fly.

The layer keeps the Hugging Face FP8 checkpoint layout: an e4m3 ``weight`` (N, K) and an fp32
``weight_scale_inv`` (the dequantization scale: ``w ~= weight * weight_scale_inv`` per recipe,
see :mod:`tmagemm.nn.quantize`), both buffers, plus an optional ``bias`` parameter. Forward is
quantize(x) -> ``tmagemm.scaled_mm``, two launches with no host synchronization and no branch
on data, so it runs under ``torch.compile(fullgraph=True)`` and inside CUDA graphs; the "block"
recipe at decode token counts is one launch, the decode GEMM quantizing x itself
(:func:`tmagemm.nn.quantize.block_linear`, the same output bit for bit).
"""

from __future__ import annotations

import torch
from torch import nn

from ..api import scaled_mm
from .quantize import (
    FP8,
    SCALED_MM_RECIPES,
    activation_ops,
    check_recipe,
    dequantize_weight,
    linear_ops,
    quantize_weight,
    weight_scale_shape,
)

# Inputs the layer takes; the output has the input's dtype. float32 is quantized directly from
# float32 (the quantizers read it) and gives a float32 output: nothing is cast behind the caller.
ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# The fp8 kernels read weight rows and write output rows through TMA: 16-byte aligned rows, so
# K (fp8, 1 byte) and N (the output) must be multiples of 16.
ALIGN = 16


def check_input(x, in_features: int, what: str) -> None:
    """The input checks of the FP8 layers' forward (shapes and dtypes only: static under
    torch.compile): TypeError for a non-tensor or another dtype, ValueError for the last dimension."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} expects a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in ACTIVATION_DTYPES:
        raise TypeError(f"{what} takes bfloat16, float16 or float32 input, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] != in_features:
        raise ValueError(f"{what}: input has shape {tuple(x.shape)}; its last dimension must be "
                         f"in_features = {in_features}")


def as_rows(x: torch.Tensor, width: int) -> torch.Tensor:
    """x (..., width) as (tokens, width) with a contiguous last dimension (what the kernels take)."""
    x2 = x.reshape(-1, width)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def quantize_input(x: torch.Tensor, width: int, recipe: str, norm=None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., width) as a 2-D fp8 activation and its scales per ``recipe``: what ``norm`` (the
    :class:`~tmagemm.nn.FP8RMSNorm` feeding the layer, or None) computed for this very x, else
    ``quantize_activation`` of it (bit for bit the same values either way)."""
    handed = None if norm is None else norm.handoff.take(x)
    if handed is not None:
        return handed
    return activation_ops().quantize_activation(as_rows(x, width), recipe)


def keep_dtypes(fn, tensors):
    """``fn`` of ``Module._apply`` that casts every floating tensor (``.half()``, ``.to(dtype)``)
    except ``tensors`` (fp8 weights, fp32 scales), which only follow device moves."""
    kept = {id(t) for t in tensors}

    def apply(t):
        moved = fn(t)
        if id(t) in kept and moved.dtype != t.dtype:
            moved = torch.empty_like(t, device=moved.device) if t.is_meta else t.to(moved.device)
        return moved

    return apply


def check_features(in_features, out_features, what: str = "FP8Linear") -> None:
    for name, value in (("in_features", in_features), ("out_features", out_features)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{what}: {name} must be a positive int, got {value!r}")
        if value % ALIGN:
            raise ValueError(f"{what}: {name} = {value} is not a multiple of {ALIGN}; the fp8 kernels need 16-byte "
                             "aligned rows (tmagemm.nn.convert keeps such layers in high precision)")


class FP8Linear(nn.Module):
    """``y = x @ W.T + bias`` with W stored in float8_e4m3fn and x quantized per call (inference only).

    in_features, out_features: multiples of 16 (ValueError otherwise). bias: whether the layer
    has a bias, a parameter of ``dtype``. recipe: "block" (x in 1x128 groups, W in 128x128
    blocks: the DeepSeek-V3 / Qwen3-FP8 recipe, what HF FP8 checkpoints hold), "row" (x per
    token, W per output channel) or "tensor" (one dynamic scale for x, one for W).
    dtype: the bias dtype (bfloat16, float16 or float32). device: where the tensors live.

    forward(x): x (..., in_features) bfloat16, float16 or float32 -> (..., out_features) of
    x's dtype. TypeError for other dtypes, ValueError when the last dimension is not
    in_features or the device cannot run the kernels (a CUDA Hopper GPU; the CPU only under
    TRITON_INTERPRET=1, where all three input dtypes work: the dot's operands are fp8). Gradients do not flow through the layer.

    Buffers ``weight`` (N, K) e4m3 and ``weight_scale_inv`` (fp32: (ceil(N/128), ceil(K/128))
    block, (N, 1) row, (1,) tensor) keep their dtypes through ``module.to(dtype)`` / ``.half()``;
    loading a state dict checks their dtypes instead of casting a high-precision weight.

    ``input_norm``: the :class:`~tmagemm.nn.FP8RMSNorm` whose output this layer takes, if
    ``tmagemm.nn.convert(..., fuse_norms=True)`` linked one (it then hands over that output's
    quantization); None otherwise.
    """

    input_norm = None  # set with object.__setattr__: a reference, not a child module

    def __init__(self, in_features: int, out_features: int, bias: bool = True, recipe: str = "block",
                 dtype: torch.dtype = torch.bfloat16, device=None):
        super().__init__()
        check_features(in_features, out_features, type(self).__name__)
        check_recipe(recipe)
        if dtype not in ACTIVATION_DTYPES:
            raise TypeError(f"{type(self).__name__}: dtype (of the bias) must be torch.bfloat16, torch.float16 or "
                            f"torch.float32, got {dtype}")
        self.in_features, self.out_features, self.recipe = in_features, out_features, recipe
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=FP8, device=device))
        self.register_buffer("weight_scale_inv", torch.ones(weight_scale_shape(recipe, out_features, in_features),
                                                            dtype=torch.float32, device=device))
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    # ---------------------------------------------------------------------------- building

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: str = "block", dtype: torch.dtype | None = None) -> FP8Linear:
        """An FP8Linear holding ``linear``'s weight quantized per ``recipe`` (block: the fused
        128x128 quantizer on CUDA, the same arithmetic in torch elsewhere) and its bias, on the
        weight's device. dtype: the bias dtype; defaults to the weight's (bfloat16 if that is
        not bfloat16/float16/float32)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear expects a torch.nn.Linear, got {type(linear).__name__}")
        weight = linear.weight
        if dtype is None:
            dtype = weight.dtype if weight.dtype in ACTIVATION_DTYPES else torch.bfloat16
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, recipe, dtype, weight.device)
        layer.load_quantized(*quantize_weight(weight, recipe), linear.bias)
        return layer

    @torch.no_grad()
    def load_quantized(self, weight: torch.Tensor, weight_scale_inv: torch.Tensor, bias: torch.Tensor | None = None):
        """Copy an already quantized weight (e4m3, (N, K)), its scale (this recipe's shape) and
        the bias into the layer, checking shapes and dtypes."""
        _expect(weight, self.weight, "weight", exact_dtype=True)
        _expect(weight_scale_inv, self.weight_scale_inv, "weight_scale_inv", exact_dtype=False)
        self.weight.copy_(weight)
        self.weight_scale_inv.copy_(weight_scale_inv)
        if (bias is None) != (self.bias is None):
            raise ValueError(f"bias {'given' if bias is not None else 'missing'} but the layer was built "
                             f"with bias={self.bias is not None}")
        if bias is not None:
            _expect(bias, self.bias, "bias", exact_dtype=False)
            self.bias.copy_(bias)
        return self

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``weight * weight_scale_inv`` expanded to (N, K) in ``dtype`` (for debugging and
        comparisons; the forward never builds it)."""
        return dequantize_weight(self.weight, self.weight_scale_inv, self.recipe, dtype)

    # ----------------------------------------------------------------------------- forward

    def check_input(self, x) -> None:
        """The checks of forward (shapes and dtypes only: static under torch.compile)."""
        check_input(x, self.in_features, type(self).__name__)

    def quantized_mm(self, x: torch.Tensor, bias: torch.Tensor | None, weight: torch.Tensor | None = None,
                     weight_scale_inv: torch.Tensor | None = None) -> torch.Tensor:
        """x (..., K) quantized per the recipe, times the fp8 weight, plus ``bias``: (..., N).
        weight / weight_scale_inv: another (N, K) weight of this recipe and its scales (a stack
        of layers sharing this input, :mod:`tmagemm.nn.stacked`) instead of the layer's own."""
        handed = None if self.input_norm is None else self.input_norm.handoff.take(x)
        if handed is None and self.recipe == "block":
            # Quantized inside the GEMM where the decode kernel runs it (nn.quantize.block_linear).
            if weight is None:
                weight, weight_scale_inv = self.weight, self.weight_scale_inv
            y = linear_ops().block_linear(as_rows(x, self.in_features), weight, weight_scale_inv, bias, x.dtype)
        else:
            xq, xs = handed if handed is not None else quantize_input(x, self.in_features, self.recipe)
            y = self.quantized_input_mm(xq, xs, bias, x.dtype, weight, weight_scale_inv)
        return y.reshape(*x.shape[:-1], y.shape[1])

    def quantized_input_mm(self, xq: torch.Tensor, xs: torch.Tensor, bias: torch.Tensor | None,
                           out_dtype: torch.dtype, weight: torch.Tensor | None = None,
                           weight_scale_inv: torch.Tensor | None = None) -> torch.Tensor:
        """An input already quantized per the recipe (xq (M, K) e4m3 and its scale, e.g. the
        fused gate/up kernel's output) times the fp8 weight (the layer's, or ``weight`` with its
        ``weight_scale_inv``), plus ``bias``: (M, N) of out_dtype."""
        if weight is None:
            weight, weight_scale_inv = self.weight, self.weight_scale_inv
        recipe_a, recipe_b = SCALED_MM_RECIPES[self.recipe]
        ws = weight_scale_inv.reshape(-1) if self.recipe == "row" else weight_scale_inv
        return scaled_mm(xq, weight.t(), xs, ws, bias=bias, out_dtype=out_dtype,
                         scale_recipe_a=recipe_a, scale_recipe_b=recipe_b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.check_input(x)
        return self.quantized_mm(x, self.bias)

    # ---------------------------------------------------------------------- module plumbing

    def _apply(self, fn, recurse=True):
        """Module.to(dtype), .half(), .bfloat16() cast every floating tensor, fp8 included: the
        fp8 weight and the fp32 scales keep their dtypes (device moves still apply)."""
        return super()._apply(keep_dtypes(fn, (self._buffers["weight"], self._buffers["weight_scale_inv"])), recurse)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # load_state_dict would copy_ a bf16 weight into the fp8 buffer, silently quantizing it
        # without a scale: refuse anything but e4m3 there.
        weight = state_dict.get(prefix + "weight")
        if isinstance(weight, torch.Tensor) and weight.dtype != FP8:
            error_msgs.append(f"{prefix}weight has dtype {weight.dtype}; an FP8Linear loads float8_e4m3fn weights "
                              "(quantize a high-precision layer with FP8Linear.from_linear or tmagemm.nn.convert)")
            return
        scale = state_dict.get(prefix + "weight_scale_inv")
        if isinstance(scale, torch.Tensor) and not scale.is_floating_point():
            error_msgs.append(f"{prefix}weight_scale_inv has dtype {scale.dtype}; expected float32")
            return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"recipe={self.recipe!r}")


def _expect(value, target: torch.Tensor, name: str, exact_dtype: bool) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if tuple(value.shape) != tuple(target.shape):
        raise ValueError(f"{name} has shape {tuple(value.shape)}; this layer expects {tuple(target.shape)}")
    if exact_dtype and value.dtype != target.dtype:
        raise TypeError(f"{name} has dtype {value.dtype}; expected {target.dtype}")
    if not exact_dtype and not value.is_floating_point():
        raise TypeError(f"{name} has dtype {value.dtype}; expected a floating-point tensor ({target.dtype})")
