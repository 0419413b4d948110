"""Quantization for the FP8 layers: activations on the fly, weights once.

Activations go through :func:`quantize_activation`, which quantizes without the quantizers'
Inf/NaN read-back (``check_finite=False``), so a forward pass never syncs the host;
:func:`rms_norm_quantize_activation` is the same for an RMSNorm's output, computed with the norm
in one kernel (:mod:`tmagemm.nn.norm`). Both are also opaque custom ops with fake
implementations (``torch.ops.tmagemm_nn.*``), which the layers call while torch.compile traces
them (fullgraph=True), and plain calls in eager mode (:func:`activation_ops`): a custom op's
dispatch costs more host time than the quantizer's own cached launch.

Recipes (the ``recipe`` of :class:`~tmagemm.nn.FP8Linear`):

=========  ======================================  ==================================
recipe     activation x (M, K)                     weight w (N, K) (``weight_scale_inv``)
=========  ======================================  ==================================
"block"    1x128 groups: scale (M, ceil(K/128)) +   128x128 blocks: (ceil(N/128), ceil(K/128))
"row"      one scale per token: (M, 1)              one per output channel: (N, 1)
"tensor"   one scale for the whole x: (1, 1)        one scale: (1,)
=========  ======================================  ==================================

+ row-major up to 128 tokens, contiguous along M above (``plan.activation_scales_m_major``).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from .. import envs
from ..cuda import decode
from ..plan import GemmArgs, Scaling, activation_scales_m_major, call_for, tensor_key
from ..quant import quantize_fp8
from ..tma import aligned_empty
from ..triton.norm_quantize import rms_norm_quantize
from ..triton.quantize import SCALE_BLOCK, quantize_1x128, quantize_128x128, quantize_rows

RECIPES = ("block", "row", "tensor")
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)
# scale_mm's recipe keywords per layer recipe: (activation, weight). Always passed explicitly,
# since some shapes fit two recipes (a (M, 1) scale is row-wise and 1x128 when K <= 128).
SCALED_MM_RECIPES = {"block": ("1x128", "128x128"), "row": ("row", "row"), "tensor": ("tensor", "tensor")}


def check_recipe(recipe) -> str:
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {', '.join(repr(r) for r in RECIPES)}, got {recipe!r}")
    return recipe


def weight_scale_shape(recipe: str, out_features: int, in_features: int) -> tuple[int, ...]:
    """The shape of ``weight_scale_inv`` for a (out_features, in_features) weight."""
    if recipe == "block":
        return (-(-out_features // SCALE_BLOCK), -(-in_features // SCALE_BLOCK))
    return (out_features, 1) if recipe == "row" else (1,)


def activation_scale_shape(recipe: str, m: int, k: int) -> tuple[int, int]:
    if recipe == "block":
        return (m, -(-k // SCALE_BLOCK))
    return (m, 1) if recipe == "row" else (1, 1)


def _m_major(recipe: str, m: int) -> bool:
    """Whether the activation's scales are laid out contiguous along M (the block recipe past
    decode sizes: what the native kernel loads by TMA, ``plan.activation_scales_m_major``)."""
    return recipe == "block" and activation_scales_m_major(m)


def _empty_scale(x: torch.Tensor, recipe: str, m: int, k: int) -> torch.Tensor:
    """The fake implementations' scale: the shape and layout the quantizers give."""
    shape = activation_scale_shape(recipe, m, k)
    if _m_major(recipe, m):
        return aligned_empty(shape, 0, torch.float32, x.device)
    return x.new_empty(shape, dtype=torch.float32)


# ------------------------------------------------------------------------------- activations


def check_device(x: torch.Tensor, what: str) -> None:
    if x.device.type != "cuda" and not envs.interpret():
        # The Triton kernels would fail with a launcher error; say what is wrong instead.
        raise ValueError(f"{what} input is on {x.device}; tmagemm's FP8 layers need CUDA tensors on a Hopper "
                         "GPU (CPU tensors run only under the Triton interpreter, TRITON_INTERPRET=1, for testing)")


def quantize_activation(x: torch.Tensor, recipe: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_fp8, scale)`` of a 2-D activation with a contiguous last dimension and K % 16 == 0
    (so x_fp8 is contiguous, as the fake implementation says). Block scales are contiguous along
    M past decode sizes (``plan.activation_scales_m_major``), row-major otherwise."""
    check_device(x, "FP8Linear")
    # No Inf/NaN read-back per forward pass (a host sync on every layer): a non-finite activation
    # shows as an Inf scale in its group and propagates to the output, as in other engines. The
    # kernel recipes call their quantizer directly (quantize_fp8's argument checks once per call
    # would be host time on every layer; the quantizer checks each input signature once).
    if recipe == "block":
        return quantize_1x128(x, check_finite=False, m_major=_m_major(recipe, x.shape[0]))
    if recipe == "row":
        return quantize_rows(x)
    return quantize_fp8(x, recipe, check_finite=False)


def _fake_quantize(x, recipe):
    m, k = x.shape
    return x.new_empty((m, k), dtype=FP8), _empty_scale(x, recipe, m, k)


def rms_norm_quantize_activation(x: torch.Tensor, weight: torch.Tensor, eps: float,
                                 recipe: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, y_fp8, scale)``: transformers' RMSNorm of a 2-D activation (contiguous last dimension,
    K % 16 == 0) and y quantized per ``recipe`` ("block" or "row") exactly as
    :func:`quantize_activation` would quantize it, in one kernel
    (:func:`tmagemm.triton.norm_quantize.rms_norm_quantize`)."""
    check_device(x, "FP8RMSNorm")
    return rms_norm_quantize(x, weight, eps, "1x128" if recipe == "block" else recipe,
                             m_major=_m_major(recipe, x.shape[0]))


def _fake_norm_quantize(x, weight, eps, recipe):
    m, k = x.shape
    return (x.new_empty((m, k), dtype=torch.promote_types(weight.dtype, x.dtype)), x.new_empty((m, k), dtype=FP8),
            _empty_scale(x, recipe, m, k))


def custom_ops(*steps):
    """Register each ``(function, fake)`` of ``steps`` as ``torch.ops.tmagemm_nn.<its name>`` (an
    opaque custom op with that fake implementation) and return what the layers call on every
    forward to reach them: ``torch.ops.tmagemm_nn`` while torch.compile traces, the plain
    functions otherwise (the same kernels without a custom op's dispatch, which costs more host
    time than their cached launches)."""
    for fn, fake in steps:
        torch.library.custom_op(f"tmagemm_nn::{fn.__name__}", fn, mutates_args=()).register_fake(fake)
    eager = SimpleNamespace(**{fn.__name__: fn for fn, _ in steps})

    def ops():
        return torch.ops.tmagemm_nn if torch.compiler.is_compiling() else eager

    return ops


# The activation quantizers as the layers call them.
activation_ops = custom_ops((quantize_activation, _fake_quantize), (rms_norm_quantize_activation, _fake_norm_quantize))


def block_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, bias: torch.Tensor | None,
                 out_dtype: torch.dtype) -> torch.Tensor:
    """The "block" recipe's product of a 2-D activation (contiguous last dimension, K % 16 == 0)
    with an (N, K) e4m3 weight and its 128x128 scales, plus ``bias``: (M, N) of out_dtype.
    :func:`quantize_activation` then ``tmagemm.scaled_mm``; or, at up to 8 tokens (H100; 2 on an
    H200) where the dispatcher would run that fp8 GEMM on the native decode kernel
    (``cuda.decode.takes_quantizing``), that kernel quantizing x itself
    (``cuda.decode.build_quantizing``): one launch instead of two, the same fp8 values, scales,
    sums and output bit for bit."""
    if x.shape[0] > decode.QUANTIZE_MAX_M:  # no signature to look up: the two launches
        return _quantize_then_multiply(x, weight, weight_scale_inv, bias, out_dtype)
    call = call_for(lambda: ("nn.block_linear", tensor_key(x), tensor_key(weight), tensor_key(weight_scale_inv),
                             tensor_key(bias), out_dtype),
                    lambda: _BlockLinear(x, weight, weight_scale_inv, bias, out_dtype))
    return call(x, weight, weight_scale_inv, bias)


def _quantize_then_multiply(x, weight, weight_scale_inv, bias, out_dtype) -> torch.Tensor:
    from ..api import scaled_mm

    xq, xs = quantize_activation(x, "block")
    return scaled_mm(xq, weight.t(), xs, weight_scale_inv, bias=bias, out_dtype=out_dtype, scale_recipe_a="1x128",
                     scale_recipe_b="128x128")


class _BlockLinear:
    """:func:`block_linear` for one signature of at most QUANTIZE_MAX_M tokens: the quantizing
    decode plan, or None (the two launches)."""

    def __init__(self, x, weight, weight_scale_inv, bias, out_dtype):
        self.shape, self.out_dtype, self.plan = (x.shape[0], weight.shape[0]), out_dtype, None
        m, k = x.shape
        if (x.is_cuda and x.dtype in decode.QUANTIZE_TYPES and envs.forced_backend() in (None, "auto", "cuda")
                and m > 0 and decode.takes_quantizing(m, weight.shape[0], k, x.device)):
            args = GemmArgs(x, weight.t(), x.new_empty(self.shape, dtype=out_dtype), None, weight_scale_inv, bias,
                            True, (Scaling.BLOCK_1X128, Scaling.BLOCK_128X128))
            if decode.quantizing_reason(args) is None:
                self.plan = decode.build_quantizing(args)

    def __call__(self, x, weight, weight_scale_inv, bias):
        if self.plan is None:
            return _quantize_then_multiply(x, weight, weight_scale_inv, bias, self.out_dtype)
        out = x.new_empty(self.shape, dtype=self.out_dtype)
        self.plan.run(x, weight.t(), out, None, weight_scale_inv, bias)
        return out


def _fake_block_linear(x, weight, weight_scale_inv, bias, out_dtype):
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=out_dtype)


# The block recipe's quantize-and-multiply as the layers call it.
linear_ops = custom_ops((block_linear, _fake_block_linear))


# ----------------------------------------------------------------------------------- weights


def quantize_weight(w: torch.Tensor, recipe: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w_fp8, weight_scale_inv)`` of an (N, K) float weight, ``w ~= w_fp8 * scale`` per recipe.

    "block" runs the fused 128x128 quantizer on CUDA tensors and the same arithmetic in torch
    elsewhere (bit for bit the same result, so a model can be converted in CPU memory and moved
    to the GPU afterwards); "row" and "tensor" use :func:`tmagemm.quantize_fp8`.
    Raises ValueError for Inf/NaN weights.
    """
    check_recipe(recipe)
    w = w.detach()
    if recipe == "block":
        if w.is_cuda:
            q, scale = quantize_128x128(w.contiguous())
            return q.contiguous(), scale
        return _quantize_128x128_torch(w)
    q, scale = quantize_fp8(w, recipe)
    return q, (scale if recipe == "row" else scale.reshape(1))


def _quantize_128x128_torch(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused quantizer's arithmetic in torch: scale = amax / 448 (fp32, at least the smallest
    normal), q = round-to-nearest-even(clamp(w / scale)), ragged edge blocks padded with zeros."""
    n, k = w.shape
    nb, kb = -(-n // SCALE_BLOCK), -(-k // SCALE_BLOCK)
    padded = w.new_zeros((nb * SCALE_BLOCK, kb * SCALE_BLOCK), dtype=torch.float32)
    padded[:n, :k] = w
    blocks = padded.view(nb, SCALE_BLOCK, kb, SCALE_BLOCK)
    amax = blocks.abs().amax(dim=(1, 3))
    if not bool(torch.isfinite(amax).all()):
        nb_bad, kb_bad = (~torch.isfinite(amax)).nonzero()[0].tolist()
        raise ValueError(f"the weight {tuple(w.shape)} holds Inf or NaN (first in the 128x128 block at rows "
                         f"{nb_bad * SCALE_BLOCK}.., columns {kb_bad * SCALE_BLOCK}..); no finite scale represents it")
    scale = (amax / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(nb * SCALE_BLOCK, kb * SCALE_BLOCK)[:n, :k].contiguous(), scale


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, recipe: str, dtype=torch.float32) -> torch.Tensor:
    """``q * scale`` expanded per recipe, in ``dtype`` (computed in float32 or float64)."""
    n, k = q.shape
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    s = scale.to(compute)
    if recipe == "block":
        s = s.repeat_interleave(SCALE_BLOCK, 0)[:n].repeat_interleave(SCALE_BLOCK, 1)[:, :k]
    elif recipe == "row":
        s = s.reshape(n, 1)
    else:
        s = s.reshape(1, 1)
    return (q.to(compute) * s).to(dtype)
