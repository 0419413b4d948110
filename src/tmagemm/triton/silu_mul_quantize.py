"""SiLU-and-multiply of a gated MLP's gate/up output and FP8 quantization in one kernel: what a
Mixture-of-Experts layer runs between its grouped gate/up and down projections
(:class:`tmagemm.nn.FP8Experts`), where the gate/up GEMM is a grouped one with no fused epilogue.

The activation is transformers' (``_default_apply_gate``: ``gate, up = h.chunk(2, -1)``,
``act_fn(gate) * up``), rounded where torch rounds it: SiLU in fp32 to h's dtype, the product in
fp32 to h's dtype. Then the FP8 layers' own quantization of that value
(:func:`tmagemm.triton.quantize.quantize_row_groups`: 1x128 groups, or one scale per row). An
optional per-row multiplier (an MoE's routing weight) multiplies each row's dequantization
scales, never the fp8 values: the down projection's output then comes out weighted, at no cost,
and the values keep their precision.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..device import on_device
from ..plan import call_for, tensor_key
from .common import let_next_kernel_launch, wait_for_previous_kernel
from .launch import A, B, OUT, SCALE_A, SCALE_B, KernelCall, pdl, pointer_plan
from .quantize import (
    SCALE_BLOCK,
    check_input,
    fp8_grid,
    fp8_rows,
    fp8_values,
    magnitude,
    quantize_row_groups,
    rows_per_program,
    scale_of,
)

RECIPES = ("1x128", "row")


@triton.jit
def _silu_mul(h_rows, cols, mask, I):
    """transformers' ``act_fn(gate) * up`` of the columns ``cols`` of rows ``h_rows`` (gate at
    column c, up at I + c), in fp32, rounded to h's dtype where torch rounds."""
    g = tl.load(h_rows + cols[None, :], mask=mask, other=0.0)
    u = tl.load(h_rows + I + cols[None, :], mask=mask, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
    return (act * u.to(tl.float32)).to(g.dtype).to(tl.float32)


@triton.jit
def _silu_mul_quantize_kernel(
    h_ptr, q_ptr, s_ptr, w_ptr, w_index_ptr,
    R, I, stride_h, stride_q, stride_s, stride_sk,
    FP8_MAX: tl.constexpr, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr, F32_TINY: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PER_GROUP: tl.constexpr, ROW_SCALE: tl.constexpr,
    GATHER: tl.constexpr, PDL: tl.constexpr,
):
    """PER_GROUP: one program per BLOCK_R rows x one 128-column group (BLOCK_K = 128), its scales
    at s[r, kb]. Otherwise one program per BLOCK_R whole rows: a pass for the rows' amax, a second
    (reading h again, from L2) that quantizes, one scale per row. ROW_SCALE: w[r] (GATHER:
    w[w_index[r]]) multiplies row r's scales."""
    wait_for_previous_kernel(PDL)  # h comes from the GEMM before
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    h_rows = h_ptr + rows[:, None].to(tl.int64) * stride_h
    q_rows = q_ptr + rows[:, None].to(tl.int64) * stride_q
    if ROW_SCALE:
        w_rows = rows
        if GATHER:
            w_rows = tl.load(w_index_ptr + rows, mask=row_ok, other=0)
        mult = tl.load(w_ptr + w_rows, mask=row_ok, other=0.0).to(tl.float32)
    if PER_GROUP:
        cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = row_ok[:, None] & (cols[None, :] < I)
        v = _silu_mul(h_rows, cols, mask, I)
        let_next_kernel_launch(PDL)  # what is left is arithmetic and two stores
        q, scale = quantize_row_groups(v, FP8_MAX, MANT_BITS, MIN_EXP, F32_TINY, False)
        tl.store(q_rows + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
        if ROW_SCALE:
            scale = scale * mult
        tl.store(s_ptr + rows * stride_s + tl.program_id(1) * stride_sk, scale, mask=row_ok)
    else:
        amax = tl.zeros([BLOCK_R], dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            v = _silu_mul(h_rows, cols, row_ok[:, None] & (cols[None, :] < I), I)
            amax = tl.maximum(amax, tl.max(magnitude(v), axis=1))
        let_next_kernel_launch(PDL)
        scale = scale_of(amax, FP8_MAX, F32_TINY, False)
        for k0 in range(0, I, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            mask = row_ok[:, None] & (cols[None, :] < I)
            q = fp8_values(_silu_mul(h_rows, cols, mask, I), scale[:, None], FP8_MAX, MANT_BITS, MIN_EXP)
            tl.store(q_rows + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
        if ROW_SCALE:
            scale = scale * mult
        tl.store(s_ptr + rows * stride_s, scale, mask=row_ok)


NAME = "triton.silu_mul_quantize"


def silu_mul_quantize(h: torch.Tensor, recipe: str = "1x128", row_scale: torch.Tensor | None = None,
                      row_scale_index: torch.Tensor | None = None, dtype: torch.dtype = torch.float8_e4m3fn):
    """``(q, scale)``: ``silu(gate) * up`` of a gated MLP's gate/up output ``h`` (S, 2I) (gate
    the first I columns, up the last I), quantized per ``recipe`` as ``quantize_fp8(act,
    recipe)`` would quantize it ("1x128": scale (S, ceil(I/128)); "row": (S, 1)), with each row's
    scales multiplied by ``row_scale[r]`` if given (``row_scale[row_scale_index[r]]`` with an
    index: an MoE pair's routing weight, read in expert order). q (S, I) has its row stride
    rounded up to 16 (as the quantizers'); the scales are row-major (the grouped GEMMs read them
    per row).

    h: float16/bfloat16/float32, 2-D with an even number of columns, contiguous last dimension.
    row_scale: a float tensor on h's device, (S,) or, with row_scale_index ((S,) int32/int64, its
    values not checked: a device read), any length; or None. No Inf/NaN check (a host sync): a group
    holding one gets an infinite scale. TypeError / ValueError name the offending argument. One
    plan per signature in the plan layer's cache (a direct launch): a call after the first checks
    and plans nothing.
    """
    call = call_for(lambda: (NAME, tensor_key(h), recipe, tensor_key(row_scale), tensor_key(row_scale_index), dtype),
                    lambda: _Call(h, recipe, row_scale, row_scale_index, dtype))
    return call(h, row_scale, row_scale_index)


def _check(h, recipe, row_scale, row_scale_index, dtype) -> None:
    fn = "silu_mul_quantize"
    check_input(h, dtype, "h", fn)
    rows, width = h.shape
    if width % 2:
        raise ValueError(f"{fn}: h {tuple(h.shape)} must have an even number of columns (gate, then up)")
    if recipe not in RECIPES:
        raise ValueError(f"{fn}: recipe must be one of {', '.join(repr(r) for r in RECIPES)}, got {recipe!r}")
    if row_scale is not None:
        if not isinstance(row_scale, torch.Tensor) or not row_scale.is_floating_point():
            raise TypeError(f"{fn}: row_scale must be a floating-point torch.Tensor or None")
        if row_scale.dim() != 1 or (row_scale_index is None and row_scale.shape[0] != rows):
            raise ValueError(f"{fn}: row_scale has shape {tuple(row_scale.shape)}; h {tuple(h.shape)} needs ({rows},)")
        if row_scale.device != h.device:
            raise ValueError(f"{fn}: row_scale is on {row_scale.device}, h on {h.device}")
    if row_scale_index is not None:
        if row_scale is None:
            raise ValueError(f"{fn}: row_scale_index needs a row_scale")
        if not isinstance(row_scale_index, torch.Tensor) or row_scale_index.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{fn}: row_scale_index must be an int32/int64 torch.Tensor or None")
        if tuple(row_scale_index.shape) != (rows,) or row_scale_index.device != h.device:
            raise ValueError(f"{fn}: row_scale_index {tuple(row_scale_index.shape)} on {row_scale_index.device} must "
                             f"be ({rows},) on {h.device}")


class _Call:
    """One checked signature: the outputs' shapes and the plan (none when there is nothing to
    compute). Its launch takes (h, row_scale_index, q, scale, row_scale), unused ones standing in
    as ``scale``."""

    def __init__(self, h, recipe, row_scale, row_scale_index, dtype):
        _check(h, recipe, row_scale, row_scale_index, dtype)
        rows, inner = h.shape[0], h.shape[1] // 2
        per_group = recipe == "1x128"
        self.rows, self.inner, self.dtype, self.device = rows, inner, dtype, h.device
        self.groups = triton.cdiv(inner, SCALE_BLOCK) if per_group else 1
        self.plan = None
        if rows == 0 or inner == 0:
            return
        q, scale = self.outputs()
        block_r = rows_per_program(per_group, h.is_cuda)
        values = dict(h_ptr=h, q_ptr=q, s_ptr=scale, w_ptr=scale if row_scale is None else row_scale,
                      w_index_ptr=scale if row_scale_index is None else row_scale_index, R=rows, I=inner,
                      stride_h=h.stride(0), stride_q=q.stride(0), stride_s=scale.stride(0), stride_sk=scale.stride(1),
                      **fp8_grid(dtype), BLOCK_R=block_r, BLOCK_K=SCALE_BLOCK if per_group else 1024,
                      PER_GROUP=per_group, ROW_SCALE=row_scale is not None, GATHER=row_scale_index is not None,
                      PDL=pdl(q))
        call = KernelCall(_silu_mul_quantize_kernel, (triton.cdiv(rows, block_r), self.groups), values,
                          dict(num_warps=4),
                          {"h_ptr": A, "w_index_ptr": B, "q_ptr": OUT, "s_ptr": SCALE_A, "w_ptr": SCALE_B})
        with on_device(h.device):
            self.plan = pointer_plan(NAME, call)

    def outputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        return (fp8_rows(self.rows, self.inner, self.dtype, self.device),
                torch.empty(self.rows, self.groups, dtype=torch.float32, device=self.device))

    def __call__(self, h, row_scale, row_scale_index) -> tuple[torch.Tensor, torch.Tensor]:
        q, scale = self.outputs()
        if self.plan is not None:
            self.plan.run(h, scale if row_scale_index is None else row_scale_index, q, scale,
                          scale if row_scale is None else row_scale, None)
        return q, scale
