"""RMSNorm and FP8 quantization in one kernel: the norm before a model's FP8 layers writes its
output and that output's fp8 values and scales, so the layers need no quantizer of their own.

The norm is transformers' (``LlamaRMSNorm``, Qwen2/3, Mistral, ...)::

    normed = (x.float() * rsqrt(mean(x.float() ** 2) + eps)).to(x.dtype)
    y = weight * normed                      # dtype: torch.promote_types(weight, x)

and the quantization is the FP8 layers' own, of y as stored (``quantize_fp8(y, "1x128")`` or
``"row"``): the same steps (:func:`tmagemm.triton.quantize.quantize_row_groups`) on the same
values, so the fp8 output is bit for bit what the layers would have computed from y. One program
normalizes one row: it holds the whole row in registers, so x is read once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..device import on_device
from ..plan import call_for, tensor_key
from ..tma import aligned_empty
from .common import let_next_kernel_launch, wait_for_previous_kernel
from .launch import A, B, OUT, SCALE_A, SCALE_B, KernelCall, pdl, pointer_plan
from .quantize import IN_DTYPES, SCALE_BLOCK, check_input, fp8_grid, fp8_rows, quantize_row_groups

RECIPES = ("1x128", "row")
# A program holds one row in registers: 32768 fp32 values are 64 per thread with 16 warps.
MAX_HIDDEN = 32768


def valid_eps(eps) -> bool:
    """Whether ``eps`` is a non-negative int or float (not a bool)."""
    return not isinstance(eps, bool) and isinstance(eps, (int, float)) and eps >= 0


@triton.jit
def _rms_norm_quantize_kernel(
    x_ptr, w_ptr, y_ptr, q_ptr, s_ptr,
    H, stride_x, stride_y, stride_q, stride_s, stride_sk,
    EPS: tl.constexpr, FP8_MAX: tl.constexpr, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr, F32_TINY: tl.constexpr,
    BLOCK_H: tl.constexpr, PER_GROUP: tl.constexpr, PDL: tl.constexpr,
):
    """One program: row ``program_id(0)`` of x, BLOCK_H (a power of two, >= 128) columns wide."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    valid = cols < H
    # The weight never comes from the kernel before: load it before waiting on that kernel.
    w = tl.load(w_ptr + cols, mask=valid, other=0.0).to(tl.float32)
    wait_for_previous_kernel(PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=valid, other=0.0)
    let_next_kernel_launch(PDL)  # what is left is arithmetic and three small stores

    # ---- the norm, rounded where transformers rounds: to x's dtype, then the product to y's
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / H + EPS)
    normed = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    y = (w * normed).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * stride_y + cols, y, mask=valid)

    # ---- fp8 values and scales of y as stored: rows of GROUP columns, one scale each (padding
    # columns are 0: they never raise an amax)
    GROUP: tl.constexpr = 128 if PER_GROUP else BLOCK_H
    q, scale = quantize_row_groups(tl.reshape(y.to(tl.float32), (BLOCK_H // GROUP, GROUP)),
                                   FP8_MAX, MANT_BITS, MIN_EXP, F32_TINY, False)
    group = tl.arange(0, BLOCK_H // GROUP)
    tl.store(s_ptr + row * stride_s + group * stride_sk, scale, mask=group * GROUP < H)
    tl.store(q_ptr + row * stride_q + cols, tl.reshape(q, (BLOCK_H,)).to(q_ptr.dtype.element_ty), mask=valid)


def rms_norm_quantize(x: torch.Tensor, weight: torch.Tensor, eps: float, recipe: str = "1x128",
                      dtype: torch.dtype = torch.float8_e4m3fn, m_major: bool = False):
    """``(y, y_fp8, scale)``: transformers' RMSNorm of ``x`` (M, H) with ``weight`` (H,) and
    ``eps``, and y quantized per ``recipe`` ("1x128": scale (M, ceil(H/128)); "row": (M, 1)), as
    ``quantize_fp8(y, recipe)`` would, in one kernel. ``m_major`` ("1x128" only): the scales
    contiguous along M, as ``quantize_fp8(y, "1x128", scale_layout="m-major")`` lays them out.

    x: float16/bfloat16/float32, 2-D, contiguous last dimension; weight: one of those dtypes,
    on x's device; y has dtype ``torch.promote_types(weight.dtype, x.dtype)``. y_fp8's row stride
    is H rounded up to 16 (as the quantizers'). No Inf/NaN check (a host sync): a row or group
    holding one gets an infinite scale. TypeError / ValueError name the offending argument.
    """
    call = call_for(lambda: (NAME, tensor_key(x), tensor_key(weight), type(eps), eps, recipe, dtype, m_major),
                    lambda: _NormQuantizeCall(x, weight, eps, recipe, dtype, m_major))
    return call(x, weight)


NAME = "triton.rms_norm_quantize"
_OPERANDS = {"x_ptr": A, "w_ptr": B, "y_ptr": OUT, "q_ptr": SCALE_A, "s_ptr": SCALE_B}


class _NormQuantizeCall:
    """One checked signature of :func:`rms_norm_quantize`; its plan takes (x, weight, y, q, scale)."""

    def __init__(self, x, weight, eps, recipe, dtype, m_major):
        _check(x, weight, eps, recipe, dtype)
        if m_major and recipe != "1x128":
            raise ValueError(f"rms_norm_quantize: m_major applies to the '1x128' recipe, got recipe {recipe!r}")
        self.rows, self.h = x.shape
        self.y_dtype, self.dtype, self.device = torch.promote_types(weight.dtype, x.dtype), dtype, x.device
        self.groups = -(-self.h // SCALE_BLOCK) if recipe == "1x128" else 1
        self.m_major = m_major
        self.plan = None
        if self.rows == 0:
            return
        y, q, scale = self.outputs()
        block_h = max(SCALE_BLOCK, triton.next_power_of_2(self.h))
        values = dict(x_ptr=x, w_ptr=weight, y_ptr=y, q_ptr=q, s_ptr=scale, H=self.h, stride_x=x.stride(0),
                      stride_y=y.stride(0), stride_q=q.stride(0), stride_s=scale.stride(0), stride_sk=scale.stride(1),
                      EPS=float(eps), **fp8_grid(dtype), BLOCK_H=block_h, PER_GROUP=recipe == "1x128", PDL=pdl(q))
        # 8-32 fp32 values per thread for the rows of today's models (H = 2048-8192).
        call = KernelCall(_rms_norm_quantize_kernel, (self.rows,), values,
                          dict(num_warps=min(16, max(4, block_h // 512))), _OPERANDS)
        with on_device(self.device):  # Triton loads kernels on the current GPU: make it x's
            self.plan = pointer_plan(NAME, call)

    def outputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        y = torch.empty(self.rows, self.h, dtype=self.y_dtype, device=self.device)
        q = fp8_rows(self.rows, self.h, self.dtype, self.device)
        if self.m_major:
            scale = aligned_empty((self.rows, self.groups), 0, torch.float32, self.device)
        else:
            scale = torch.empty(self.rows, self.groups, dtype=torch.float32, device=self.device)
        return y, q, scale

    def __call__(self, x, weight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        y, q, scale = self.outputs()
        if self.plan is not None:
            self.plan.run(x, weight, y, q, scale, None)
        return y, q, scale


def _check(x, weight, eps, recipe, dtype) -> None:
    fn = "rms_norm_quantize"
    check_input(x, dtype, "x", fn)
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{fn}: weight must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dtype not in IN_DTYPES:
        raise TypeError(f"{fn}: weight must be float16/bfloat16/float32, got {weight.dtype}")
    h = x.shape[1]
    if weight.shape != (h,):
        raise ValueError(f"{fn}: weight has shape {tuple(weight.shape)}; x {tuple(x.shape)} needs ({h},)")
    if not 0 < h <= MAX_HIDDEN:
        raise ValueError(f"{fn}: x's hidden size {h} must be in 1..{MAX_HIDDEN} (one row per program)")
    if weight.device != x.device:
        raise ValueError(f"{fn}: weight is on {weight.device}, x on {x.device}")
    if not valid_eps(eps):
        raise ValueError(f"{fn}: eps must be a non-negative float, got {eps!r}")
    if recipe not in RECIPES:
        raise ValueError(f"{fn}: recipe must be one of {', '.join(repr(r) for r in RECIPES)}, got {recipe!r}")
