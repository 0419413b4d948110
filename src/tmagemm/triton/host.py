"""Host-side pieces shared by the Triton GEMM launchers: operand layouts and TMA descriptors.

A 2-D operand is "row-major" when its columns are contiguous (stride(1) == 1) and "col-major"
when its rows are (stride(0) == 1). TMA describes either one as long as the base address and the
leading stride are 16-byte aligned; anything else goes to the pointer kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from ..dispatch import GemmArgs
from .common import scale_mode

_TMA_ALIGN = 16  # bytes: base address and every non-innermost stride
_TMA_MAX_STRIDE = 1 << 40  # bytes


def is_row_major(t: torch.Tensor) -> bool:
    """Columns contiguous. A single column counts as both layouts."""
    return t.stride(1) == 1 or t.shape[1] == 1


def is_col_major(t: torch.Tensor) -> bool:
    return t.stride(0) == 1 or t.shape[0] == 1


def leading_stride(t: torch.Tensor, row_major: bool) -> int:
    """Element stride between rows (row-major) or columns (col-major).

    With a single row (column) the stride is never used to address memory and torch may report any
    value, so use the smallest aligned one instead.
    """
    rows, cols = t.shape
    if row_major:
        if rows > 1:
            return t.stride(0)
        per_16b = _TMA_ALIGN // t.element_size()
        return -(-cols // per_16b) * per_16b
    if cols > 1:
        return t.stride(1)
    per_16b = _TMA_ALIGN // t.element_size()
    return -(-rows // per_16b) * per_16b


def tma_layout_reason(t: torch.Tensor, name: str, row_major: bool) -> str | None:
    """None if TMA can describe ``t`` in the given layout, else why not (names the stride)."""
    if t.data_ptr() % _TMA_ALIGN:
        return f"{name}.data_ptr() is not {_TMA_ALIGN}-byte aligned"
    if row_major and not is_row_major(t):
        return f"{name} is not row-major (stride {tuple(t.stride())})"
    if not row_major and not is_col_major(t):
        return f"{name} is not column-major (stride {tuple(t.stride())})"
    lead_bytes = leading_stride(t, row_major) * t.element_size()
    if lead_bytes % _TMA_ALIGN:
        return f"{name} leading stride of {lead_bytes} bytes is not a multiple of {_TMA_ALIGN}"
    if lead_bytes >= _TMA_MAX_STRIDE:
        return f"{name} leading stride of {lead_bytes} bytes is >= 2^40"
    return None


def descriptor(t: torch.Tensor, row_major: bool, block_rows: int, block_cols: int) -> TensorDescriptor:
    """A host TensorDescriptor over ``t`` as stored in memory (passed to the kernel by value).

    Col-major operands are described through their transpose, so the descriptor's block is
    (block_cols, block_rows) and the kernel transposes the loaded tile.
    """
    rows, cols = t.shape
    lead = leading_stride(t, row_major)
    if row_major:
        return TensorDescriptor(t, [rows, cols], [lead, 1], [block_rows, block_cols])
    return TensorDescriptor(t, [cols, rows], [lead, 1], [block_cols, block_rows])


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Global scratch for device-built tensor maps, from torch's caching allocator (cheap, and
    CUDA-graph safe: inside a capture it comes from the graph's pool)."""
    return torch.empty(size, dtype=torch.int8, device="cuda" if torch.cuda.is_available() else "cpu")


def install_allocator() -> None:
    """Give Triton the scratch allocator that ``tl.make_tensor_descriptor`` needs.

    Triton keeps the allocator per thread/context (autograd runs the backward on its own
    thread), so this is called before every launch that needs it; setting it costs well under
    a microsecond.
    """
    triton.set_allocator(_scratch)


@dataclass(frozen=True)
class Layout:
    """Constexpr layout flags of one problem, shared by all TMA kernels."""

    a_row_major: bool  # A K-major (the usual activation layout)
    b_row_major: bool  # B N-major: a (K, N) row-major weight; False means B = w.t() (K-major)
    tma_store: bool  # out can be written by TMA (row-major, aligned); otherwise masked stores
    scale_a: int
    scale_b: int
    has_bias: bool


def tma_layout(args: GemmArgs) -> Layout | str:
    """Layout flags for the TMA kernels, or the reason TMA cannot describe the operands."""
    if args.m == 0 or args.n == 0 or args.k == 0:
        return "a zero-size dimension (tmagemm.matmul / scaled_mm return those without a kernel)"
    a_row = is_row_major(args.a)
    b_row = is_row_major(args.b) and not (args.is_fp8 and is_col_major(args.b))
    if args.is_fp8 and not (a_row and not b_row):
        # fp8 wgmma reads both operands K-major from shared memory: A row-major, B column-major.
        return "fp8 TMA kernels need A row-major and B column-major (the torch._scaled_mm layout)"
    for t, name, row in ((args.a, "a", a_row), (args.b, "b", b_row)):
        reason = tma_layout_reason(t, name, row)
        if reason:
            return reason
    # A ragged row end (N*itemsize not a multiple of 16 bytes) is stored with masked pointer
    # stores: a TMA store may write the whole last 16-byte chunk of a row (seen with the native
    # kernels), which for a sliced output view would touch the neighbouring columns.
    tma_store = tma_layout_reason(args.out, "out", True) is None and (args.n * args.out.element_size()) % _TMA_ALIGN == 0
    return Layout(
        a_row_major=a_row,
        b_row_major=b_row,
        tma_store=tma_store,
        scale_a=scale_mode(args.scale_a),
        scale_b=scale_mode(args.scale_b),
        has_bias=args.bias is not None,
    )


def operand_descriptors(args: GemmArgs, layout: Layout, block_m: int, block_n: int, block_k: int, out_block_n: int):
    """Descriptors for A, B and (when TMA stores) the output tile."""
    a_desc = descriptor(args.a, layout.a_row_major, block_m, block_k)
    b_desc = descriptor(args.b, layout.b_row_major, block_k, block_n)
    c_desc = descriptor(args.out, True, block_m, out_block_n) if layout.tma_store else None
    return a_desc, b_desc, c_desc


# ------------------------------------------------------------------ AOT specs (tmagemm inspect)

_TL_NAMES = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.float8_e4m3fn: "fp8e4nv",
    torch.float8_e5m2: "fp8e5",
}
_ALIGNED = [["tt.divisibility", 16]]


def aot_gemm_signature(
    a_dtype: torch.dtype,
    b_dtype: torch.dtype,
    out_dtype: torch.dtype,
    block_m: int,
    block_n: int,
    block_k: int,
    out_block_n: int,
    *,
    b_row_major: bool,
    scaled: bool,
    tma: bool = True,
) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) of the operand/epilogue parameters every GEMM kernel shares.

    Describes the common case: row-major A, aligned row-major output stored through TMA,
    tensor-wise scales when ``scaled`` and no bias.
    """
    a, b, c = _TL_NAMES[a_dtype], _TL_NAMES[b_dtype], _TL_NAMES[out_dtype]
    b_block = [block_k, block_n] if b_row_major else [block_n, block_k]
    sig = {
        "a_desc": f"tensordesc<{a}[{block_m}, {block_k}]>" if tma else f"*{a}",
        "b_desc": f"tensordesc<{b}[{b_block[0]}, {b_block[1]}]>" if tma else f"*{b}",
        "c_desc": f"tensordesc<{c}[{block_m}, {out_block_n}]>" if tma else "constexpr",
        "c_ptr": f"*{c}",
        "scale_a_ptr": "*fp32" if scaled else "constexpr",
        "scale_b_ptr": "*fp32" if scaled else "constexpr",
        "bias_ptr": "constexpr",
        "M": "i32",
        "N": "i32",
        "K": "i32",
        "stride_cm": "i32",
        "stride_cn": "i32",
    }
    constexprs = {"bias_ptr": None}
    if not tma:
        constexprs["c_desc"] = None
    if not scaled:
        constexprs.update(scale_a_ptr=None, scale_b_ptr=None)
    attrs = {name: _ALIGNED for name in ("c_ptr", "K", "stride_cm") if name in sig}
    return sig, constexprs, attrs


def aot_layout_constexprs(b_row_major: bool, scaled: bool) -> dict:
    return {
        "A_ROW_MAJOR": True,
        "B_ROW_MAJOR": b_row_major,
        "TMA_STORE": True,
        "SCALE_A": 1 if scaled else 0,
        "SCALE_B": 1 if scaled else 0,
        "HAS_BIAS": False,
        "FAST_ACCUM": True,
    }
