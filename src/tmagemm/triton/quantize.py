"""Fused block quantizers for the block-scaled FP8 GEMM (DeepSeek-V3 / Qwen3-FP8 recipe).

``quantize_1x128``: activations, one fp32 scale per row per 128-column group (scale_a of
``triton.blockscaled``). ``quantize_128x128``: weights, one scale per 128 x 128 block (its
scale_b). Both read the input once: a program loads its tile into registers, takes the amax of
each group, and writes the fp8 values and the scales from the same registers.

Scales are dequantization scales (x ~= q * scale), ``amax / fp8_max`` clamped below by the
smallest normal fp32 so an all-zero group quantizes to zeros. ``pow2_scale=True`` rounds each
scale up to a power of two (UE8M0, as DeepGEMM offers): dequantization then only shifts
exponents, and since the scale only grows no value overflows fp8.

Inf/NaN input raises ValueError: the kernel turns a group holding one into an infinite scale
(NaN is mapped to +Inf before the max, since a hardware max drops NaN), and the host checks the
small scale tensor, not the input, once after the launch (skipped during CUDA-graph capture,
where reading a flag back would break the capture).

Each input signature (shape, strides, dtype, device, options) is checked and planned once, in the
plan layer's cache: later calls allocate the outputs and launch directly (``launch.pointer_plan``),
which keeps an FP8 layer's eager forward from paying Triton's launcher on every activation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..device import on_device
from ..plan import call_for, tensor_key
from ..tma import aligned_empty
from .common import let_next_kernel_launch, wait_for_previous_kernel
from .launch import A, OUT, SCALE_A, KernelCall, pdl, pointer_plan

SCALE_BLOCK = 128  # the recipe's group width along K (and height along N for weights)
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
IN_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_F32_TINY = torch.finfo(torch.float32).tiny
# (mantissa bits, smallest normal exponent) of each fp8 format
_FP8_GRID = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}


@triton.jit
def _round_to_fp8_grid(q, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr):
    """fp32 ``q`` (finite, within the fp8 range) rounded to nearest-even on the grid of an fp8
    format with MANT_BITS mantissa bits and smallest normal exponent MIN_EXP, so the cast that
    follows is exact. The hardware cast (cvt.rn.satfinite) rounds the same way; doing it here
    makes every backend agree bit for bit with torch, the interpreter included (its own cast
    loses the carry when rounding up to the next power of two, e.g. 124.3 -> 64).
    Costs a few integer ops per element in a memory-bound kernel."""
    mag = tl.abs(q)
    # Normal range: round the fp32 mantissa to MANT_BITS bits, ties to even, in integer bits (a
    # carry out of the mantissa correctly bumps the exponent).
    DROP: tl.constexpr = 23 - MANT_BITS
    bits = mag.to(tl.int32, bitcast=True)
    bits = (bits + ((1 << (DROP - 1)) - 1) + ((bits >> DROP) & 1)) & ~((1 << DROP) - 1)
    normal = bits.to(tl.float32, bitcast=True)
    # Subnormal range: a fixed step of 2^(MIN_EXP - MANT_BITS). Scale to units of that step
    # (exact: a power of two), round to an integer with the 2^23 trick (one IEEE rounding, ties
    # to even), scale back.
    UP: tl.constexpr = 2.0 ** (MANT_BITS - MIN_EXP)
    DOWN: tl.constexpr = 2.0 ** (MIN_EXP - MANT_BITS)
    sub = ((mag * UP + 8388608.0) - 8388608.0) * DOWN
    rounded = tl.where(mag < 2.0**MIN_EXP, sub, normal)
    return tl.where(q < 0, -rounded, rounded)


@triton.jit
def magnitude(x):
    """|x| with NaN counted as +Inf: max.f32 (on the GPU and in the interpreter) returns the
    non-NaN operand, which would hide a NaN; an infinite amax makes an infinite scale, which the
    host reports."""
    return tl.where(x == x, tl.abs(x), float("inf"))


@triton.jit
def scale_of(amax, FP8_MAX: tl.constexpr, F32_TINY: tl.constexpr, POW2: tl.constexpr):
    """amax / fp8_max correctly rounded (div_rn: Triton's "/" is approximate on the GPU), so it
    matches torch bit for bit; never below the smallest normal (a zero group quantizes to zeros).
    POW2: rounded up to a power of two exactly (any mantissa bit carries into the exponent, the
    mantissa is cleared; +Inf stays +Inf)."""
    scale = tl.maximum(tl.math.div_rn(amax, FP8_MAX), F32_TINY)
    if POW2:
        bits = scale.to(tl.int32, bitcast=True)
        bits = tl.where(bits < 0x7F800000, (bits + 0x7FFFFF) & 0x7F800000, bits)
        scale = bits.to(tl.float32, bitcast=True)
    return scale


@triton.jit
def fp8_values(x, scale, FP8_MAX: tl.constexpr, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr):
    """x / scale (``scale`` broadcast by the caller), clamped to +-FP8_MAX (guarding the rounding
    at amax) and rounded to nearest even on the fp8 grid: the cast that follows is exact."""
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX), FP8_MAX)
    return _round_to_fp8_grid(q, MANT_BITS, MIN_EXP)


@triton.jit
def quantize_row_groups(x, FP8_MAX: tl.constexpr, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr,
                        F32_TINY: tl.constexpr, POW2: tl.constexpr):
    """Quantize an fp32 tile whose rows are each one whole 1x128 group: returns ``(q, scale)``, q
    fp32 on the fp8 grid (the cast to fp8 that follows is exact) and one dequantization scale
    per row, by the quantizers' own steps (:func:`magnitude`, :func:`scale_of`,
    :func:`fp8_values`). For kernels that produce an activation and quantize it in their
    epilogue (``triton/gate_up.py``); a row of zeros (padding past M, say) gets zeros and the
    smallest normal scale."""
    scale = scale_of(tl.max(magnitude(x), axis=1), FP8_MAX, F32_TINY, POW2)
    return fp8_values(x, scale[:, None], FP8_MAX, MANT_BITS, MIN_EXP), scale


def fp8_grid(dtype: torch.dtype = torch.float8_e4m3fn) -> dict:
    """The constexprs :func:`quantize_row_groups` (and the quantizer kernel) take for ``dtype``."""
    return dict(FP8_MAX=float(torch.finfo(dtype).max), MANT_BITS=_FP8_GRID[dtype][0], MIN_EXP=_FP8_GRID[dtype][1],
                F32_TINY=_F32_TINY)


@triton.jit
def _block_quantize_kernel(
    x_ptr, q_ptr, s_ptr,
    R, K, stride_x, stride_q, stride_s, stride_sk,
    FP8_MAX: tl.constexpr, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr, F32_TINY: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PER_ROW: tl.constexpr, POW2: tl.constexpr, PDL: tl.constexpr,
):
    """One program: BLOCK_R rows x one BLOCK_K-wide column group of x.

    PER_ROW: one scale per row of the tile (1x128 groups, s[r, kb] at r * stride_s + kb *
    stride_sk); otherwise one scale for the whole tile (BLOCK_R = 128: a 128x128 block, s[rb, kb]).
    """
    # PDL: x typically comes from the kernel before.
    wait_for_previous_kernel(PDL)

    # ---- load the tile once (ragged rows / columns masked to 0, which never raises an amax)
    pid_r = tl.program_id(0)
    kb = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < R) & (cols[None, :] < K)
    # int64 row offsets: a large weight (N * stride) can pass 2^31 elements.
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    let_next_kernel_launch(PDL)  # what is left is arithmetic and two stores

    # ---- amax, scale and fp8 values of each group, from the registers already holding x
    if PER_ROW:
        q, scale = quantize_row_groups(x, FP8_MAX, MANT_BITS, MIN_EXP, F32_TINY, POW2)
    else:
        scale = scale_of(tl.max(tl.max(magnitude(x), axis=1), axis=0), FP8_MAX, F32_TINY, POW2)
        q = fp8_values(x, scale, FP8_MAX, MANT_BITS, MIN_EXP)
    tl.store(q_ptr + rows[:, None].to(tl.int64) * stride_q + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
    if PER_ROW:
        tl.store(s_ptr + rows * stride_s + kb * stride_sk, scale, mask=rows < R)
    else:
        tl.store(s_ptr + pid_r * stride_s + kb * stride_sk, scale)


@triton.jit
def quantize_whole_rows(x_rows, q_rows, row_ok, K, FP8_MAX: tl.constexpr, MANT_BITS: tl.constexpr,
                        MIN_EXP: tl.constexpr, F32_TINY: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """BLOCK_R whole rows (``x_rows`` / ``q_rows``: [BLOCK_R, 1] pointers to each row's first
    element; rows where ``row_ok`` is False are skipped) quantized with one scale each: a row is
    longer than a tile, so one pass finds the rows' amax and a second one (reading x again, from
    L2) quantizes; the arithmetic is _block_quantize_kernel's, bit for bit. Lets the next kernel
    launch between the passes (PDL) and returns the scales."""
    amax = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + cols[None, :], mask=row_ok[:, None] & (cols[None, :] < K), other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(magnitude(x), axis=1))
    let_next_kernel_launch(PDL)  # what is left reads x from L2 and writes q
    scale = scale_of(amax, FP8_MAX, F32_TINY, False)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        mask = row_ok[:, None] & (cols[None, :] < K)
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        q = fp8_values(x, scale[:, None], FP8_MAX, MANT_BITS, MIN_EXP)
        tl.store(q_rows + cols[None, :], q.to(q_rows.dtype.element_ty), mask=mask)
    return scale


@triton.jit
def _row_quantize_kernel(
    x_ptr, q_ptr, s_ptr,
    R, K, stride_x, stride_q,
    FP8_MAX: tl.constexpr, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr, F32_TINY: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    """One program: BLOCK_R whole rows of x, one scale each (the row-wise recipe's activations)."""
    # PDL: x typically comes from the kernel before.
    wait_for_previous_kernel(PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    scale = quantize_whole_rows(x_ptr + rows[:, None].to(tl.int64) * stride_x,
                                q_ptr + rows[:, None].to(tl.int64) * stride_q, row_ok, K, FP8_MAX, MANT_BITS,
                                MIN_EXP, F32_TINY, BLOCK_R, BLOCK_K, PDL)
    tl.store(s_ptr + rows, scale, mask=row_ok)


ROWS_NAME = "triton.quantize_rows"
BLOCKS_NAME = "triton.quantize_blocks"


def quantize_rows(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn):
    """Quantize ``x`` (M, K) with one scale per row, in one kernel (``quantize_fp8(x, "row")``
    on the GPU and under the interpreter). Returns ``(x_fp8, scale)``: x_fp8 (M, K) with its row
    stride rounded up to 16 bytes (as :func:`quantize_1x128`'s), scale (M, 1) fp32 = max(amax /
    fp8_max, smallest normal). A row holding Inf or NaN gets an infinite scale (the caller checks)."""
    call = call_for(lambda: (ROWS_NAME, tensor_key(x), dtype), lambda: _QuantizeCall(x, dtype, "row", False, False))
    return call(x)


class _QuantizeCall:
    """One checked signature of a quantizer: ``kind`` "row" (:func:`quantize_rows`), "1x128" or
    "128x128" (:func:`_quantize`) of x's shape, strides, dtype and device. Its plan takes
    (x, q, scale) in the A, OUT and SCALE_A slots."""

    def __init__(self, x, dtype, kind: str, pow2_scale: bool, m_major: bool, fn: str = "quantize_fp8",
                 name: str = "x"):
        check_input(x, dtype, name, fn)
        rows, k = x.shape
        self.rows, self.k, self.dtype, self.device, self.kind, self.m_major = rows, k, dtype, x.device, kind, m_major
        self.kb = triton.cdiv(k, SCALE_BLOCK)
        self.plan = None
        if rows == 0 or k == 0:
            return
        q, scale = self.outputs()
        common = dict(x_ptr=x, q_ptr=q, s_ptr=scale, R=rows, K=k, stride_x=x.stride(0), stride_q=q.stride(0),
                      **fp8_grid(dtype), PDL=pdl(q))
        if kind == "row":
            block_r = rows_per_program(False, x.is_cuda)
            call = KernelCall(_row_quantize_kernel, (triton.cdiv(rows, block_r),),
                              dict(common, BLOCK_R=block_r, BLOCK_K=1024), dict(num_warps=4), _OPERANDS)
        else:
            per_row = kind == "1x128"
            # 1x128: 16 rows per program (4-8 KB read; many small programs keep the most bytes in
            # flight: 2.2-2.3 TB/s on an H100 for 4096-16384 x 7168 bf16, against 1.8-2.0 with 32
            # rows and 1.5-1.7 with 64); 128x128: one whole block per program (its amax needs all
            # of it). The interpreter (CPU tensors) runs each program as numpy calls: fewer, larger.
            block_r = 16 if per_row and x.is_cuda else SCALE_BLOCK
            values = dict(common, stride_s=scale.stride(0), stride_sk=scale.stride(1), BLOCK_R=block_r,
                          BLOCK_K=SCALE_BLOCK, PER_ROW=per_row, POW2=bool(pow2_scale))
            # 4 warps hold a 16x128 tile in 16 fp32 registers per thread; the 128x128 weight tile
            # is spread over 16 warps (32 per thread: 1.35-1.47 TB/s against 1.1-1.2 with 8).
            call = KernelCall(_block_quantize_kernel, (triton.cdiv(rows, block_r), self.kb), values,
                              dict(num_warps=4 if per_row else 16), _OPERANDS)
        with on_device(self.device):  # Triton loads kernels on the current GPU: make it x's
            self.plan = pointer_plan(ROWS_NAME if kind == "row" else BLOCKS_NAME, call)

    def outputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        q = fp8_rows(self.rows, self.k, self.dtype, self.device)
        if self.kind == "row":
            scale = torch.empty(self.rows, 1, dtype=torch.float32, device=self.device)
        elif self.m_major:
            scale = aligned_empty((self.rows, self.kb), 0, torch.float32, self.device)
        else:
            groups = self.rows if self.kind == "1x128" else triton.cdiv(self.rows, SCALE_BLOCK)
            scale = torch.empty(groups, self.kb, dtype=torch.float32, device=self.device)
        return q, scale

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, scale = self.outputs()
        if self.plan is not None:
            self.plan.run(x, None, q, scale, None, None)
        return q, scale


_OPERANDS = {"x_ptr": A, "q_ptr": OUT, "s_ptr": SCALE_A}


def rows_per_program(per_group: bool, on_gpu: bool) -> int:
    """Rows one program of a row-by-row quantizing kernel takes (this module's row quantizer, the
    MoE pairs quantizer, the SiLU quantizer): 16 rows x one 128-column group (many small programs
    keep the most bytes in flight, as the 1x128 quantizer measured), or one whole row in
    1024-wide steps per program (one scale per row; decode has a few rows). The interpreter runs
    each program as numpy calls: 16 rows, fewer and larger ones."""
    return 1 if on_gpu and not per_group else 16


def fp8_rows(rows: int, k: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty (rows, k) fp8 output whose row stride is k rounded up to 16 elements: the GEMM
    reads it through TMA, which needs 16-byte row strides (a no-op for every real checkpoint's
    K, all multiples of 16)."""
    padded = -(-k // 16) * 16
    q = torch.empty(rows, padded, dtype=dtype, device=device)
    return q if padded == k else q[:, :k]


def check_input(x: torch.Tensor, dtype: torch.dtype, name: str, fn: str) -> None:
    """TypeError / ValueError naming ``name`` of ``fn`` unless x is a 2-D float16/bfloat16/float32
    tensor with a contiguous last dimension and dtype an fp8 type."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn} expects a torch.Tensor {name}, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{fn}: {name} must be 2-D, got shape {tuple(x.shape)}")
    if x.dtype not in IN_DTYPES:
        raise TypeError(f"{fn}: {name} must be float16/bfloat16/float32, got {x.dtype}")
    if dtype not in _FP8_DTYPES:
        raise TypeError(f"{fn}: dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError(f"{fn}: {name} {tuple(x.shape)} needs a contiguous last dimension "
                         f"(stride {tuple(x.stride())}); pass {name}.contiguous()")


def _quantize(x, dtype, pow2_scale, per_row: bool, fn: str, name: str, check_finite: bool = True,
              m_major: bool = False):
    kind = "1x128" if per_row else "128x128"
    call = call_for(lambda: (BLOCKS_NAME, tensor_key(x), dtype, kind, bool(pow2_scale), m_major),
                    lambda: _QuantizeCall(x, dtype, kind, pow2_scale, m_major, fn, name))
    q, scale = call(x)
    if check_finite and not (x.is_cuda and torch.cuda.is_current_stream_capturing()) \
            and not bool(torch.isfinite(scale).all()):
        raise ValueError(_non_finite_message(x, scale, per_row, fn, name))
    return q, scale


def _non_finite_message(x, scale, per_row: bool, fn: str, name: str) -> str:
    """Where the Inf/NaN values are (computed only once the cheap check failed)."""
    xf = x.float()
    kinds = " and ".join(k for k, present in (("Inf", bool(xf.isinf().any())), ("NaN", bool(xf.isnan().any())))
                         if present)
    groups = (~torch.isfinite(scale)).nonzero()
    r, kb = groups[0].tolist()
    where = f"row {r}" if per_row else f"rows {r * SCALE_BLOCK}..{min((r + 1) * SCALE_BLOCK, x.shape[0]) - 1}"
    cols = f"columns {kb * SCALE_BLOCK}..{min((kb + 1) * SCALE_BLOCK, x.shape[1]) - 1}"
    return (f"{fn}: {name} {tuple(x.shape)} holds {kinds} ({len(groups)} of {scale.numel()} scale groups; the "
            f"first at {where}, {cols}); no finite scale represents it")


def quantize_1x128(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, pow2_scale: bool = False,
                   check_finite: bool = True, m_major: bool = False):
    """Quantize activations ``x`` (M, K) per row per 128 columns.

    Returns ``(x_fp8, scale)``: x_fp8 (M, K) row-major in ``dtype`` (contiguous when K is a
    multiple of 16; otherwise its row stride is K rounded up to 16, as TMA needs); scale
    (M, ceil(K/128)) fp32 with ``x[m, k] ~= x_fp8[m, k] * scale[m, k // 128]`` (the scale_a of a
    block-scaled GEMM), row-major, or with ``m_major`` contiguous along M with its column stride M
    rounded up to 4 (:func:`tmagemm.tma.aligned_empty`). A ragged last group's amax covers only
    its valid columns.

    x: float16/bfloat16/float32, any row stride, contiguous last dimension (ValueError
    otherwise). pow2_scale: round scales up to powers of two. Raises ValueError when x holds Inf
    or NaN, unless ``check_finite`` is False: the check reads the scales back (a host sync), which
    a model's forward pass should not pay on every call (then a non-finite group gives an Inf
    scale). Never checked during CUDA-graph capture.
    """
    return _quantize(x, dtype, pow2_scale, True, "quantize_1x128", "x", check_finite, m_major)


def quantize_128x128(w: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, pow2_scale: bool = False,
                     check_finite: bool = True):
    """Quantize a weight ``w`` (N, K) per 128 x 128 block.

    Returns ``(w_fp8, scale)``: w_fp8 (N, K) row-major in ``dtype`` (row stride K rounded up
    to 16, as for :func:`quantize_1x128`); scale (ceil(N/128), ceil(K/128)) fp32 row-major with ``w[n, k] ~= w_fp8[n, k] * scale[n // 128, k // 128]``.
    Pass ``w_fp8.t()`` as the GEMM's b and ``scale`` as its scale_b (Scaling.BLOCK_128X128).
    Ragged edge blocks take the amax of their valid elements. Same input rules and errors as
    :func:`quantize_1x128`.
    """
    return _quantize(w, dtype, pow2_scale, False, "quantize_128x128", "w", check_finite)
