"""Block-scaled FP8 GEMM: DeepSeek-V3 / Qwen3-FP8 checkpoints ("1x128 activations x 128x128 weights").

    out[m, n] = sum_kb scale_a[m, kb] * scale_b[n // 128 (or n), kb] * (sum_{k in kb} a[m, k] * b[k, n]) + bias[n]

a (M, K) fp8 e4m3 row-major; b (K, N) = w.t() of a row-major (N, K) fp8 weight (K-major);
scale_a (M, ceil(K/128)) fp32; scale_b (ceil(N/128), ceil(K/128)) fp32 for 128x128 weight blocks
(Scaling.BLOCK_128X128) or (N, ceil(K/128)) for one scale per output channel per k-block
(Scaling.BLOCK_1X128). Scales may have any strides (row-major, or PyTorch's outer-dim-major
(1, M) layout): the kernel takes both strides and nothing is copied.

One program per output tile in grouped order; A and B tiles through host TensorDescriptors passed
by value; the K step is one 128-deep scale block, whose product goes into a fresh fp32
accumulator and is then scaled and added to the running fp32 sum: the per-block fp32 promotion
the recipe needs (wgmma's fp8 adder keeps ~14 mantissa bits, enough for 128 terms, not for K).
A ragged last k-block is zero-filled by TMA, so zeros meet its scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import device, tma, tuning
from ..configs import TritonGemmConfig
from ..plan import GemmArgs, Plan, Scaling, Variant
from .common import (SCALES_AHEAD_MIN_ROWS, block_scaled_add, chunk_step, first_row_in_bounds, first_row_scale_chunks,
                     grouped_tile, let_next_kernel_launch, load_block_scales, load_weight_scales, next_row_scale_chunks,
                     row_scales_in, wait_for_previous_kernel)
from .host import GEMM_OPERANDS, descriptor
from .launch import KernelCall, aot_spec as _aot_spec, direct_launch, pdl
from .matmul_tma import store_tile

NAME = "triton.blockscaled"
SCALE_BLOCK = 128  # the recipe's k-block (and weight block height)
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_FP8 = torch.float8_e4m3fn


# M changes every step of a server: do not specialize on it (one binary per config), nor on the
# k-stride of an outer-dim-major scale_a, which equals M.
@triton.jit(do_not_specialize=["M", "stride_sak"])
def blockscaled_gemm_kernel(
    a_desc, b_desc, c_desc, c_ptr, scale_a_ptr, scale_b_ptr, bias_ptr,
    M, N, K, stride_cm, stride_cn, stride_sam, stride_sak, stride_sbn, stride_sbk, stride_am, stride_bn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    B_PER_CHANNEL: tl.constexpr, TMA_STORE: tl.constexpr, HAS_BIAS: tl.constexpr, OPERAND_TMA: tl.constexpr,
    SCALE_A_CHUNKS: tl.constexpr, PDL: tl.constexpr,
):
    # ---- static checks: one k-step is exactly one scale block
    tl.static_assert(BLOCK_K == 128, "block-scaled GEMM: BLOCK_K must be the 128-deep scale block")
    tl.static_assert(B_PER_CHANNEL or (128 % BLOCK_N == 0) or (BLOCK_N % 128 == 0),
                     "128x128 weight scales: tiles must not straddle a 128-column block")

    # ---- scheduler: grouped tile order (A row panels and B column panels reused from L2)
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    off_m = first_row_in_bounds(pid_m, BLOCK_M, M, True)
    off_n = pid_n * BLOCK_N
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    wait_for_previous_kernel(PDL)  # PDL: all reads and writes come after the previous kernel

    # ---- scale pointers. Rows past M / columns past N read 1.0, not 0: their products are zero
    # (TMA zero-fill) and never stored, but 0 * (an inf from garbage) would be NaN in registers.
    sa_ptrs = scale_a_ptr + offs_m * stride_sam
    sa_mask = offs_m < M
    sb_mask = offs_n < N
    if B_PER_CHANNEL:
        sb_ptrs = scale_b_ptr + offs_n * stride_sbn  # one scale per output channel
    elif BLOCK_N <= 128:
        sb_ptrs = scale_b_ptr + (off_n // 128) * stride_sbn  # the tile's single weight block row
    else:
        sb_ptrs = scale_b_ptr + (offs_n // 128) * stride_sbn  # wide tiles span several block rows

    # ---- main loop: per k-block a fresh fp32 product, scaled into the running sum. TMA zero-fills
    # the ragged last k-block and the M / N edges, so the loads need no masks. Operands TMA cannot
    # describe (a row stride not a multiple of 16 bytes, e.g. K = 7000) are read with masked
    # pointer loads instead: a_desc / b_desc are then the tensors' base pointers.
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_blocks = tl.cdiv(K, BLOCK_K)
    # common.SCALES_AHEAD_MIN_ROWS says why. SCALE_A_CHUNKS (scale_a contiguous along M): the row
    # scales come in chunks of SCALE_CHUNK k-blocks, loaded a chunk ahead (common.load_row_scale_chunk),
    # and the weight scales a step ahead.
    SCALES_AHEAD: tl.constexpr = BLOCK_M >= SCALES_AHEAD_MIN_ROWS
    if SCALE_A_CHUNKS:
        sa_chunk, sa_next = first_row_scale_chunks(sa_ptrs, stride_sak, 0, k_blocks, sa_mask)
        sb = load_weight_scales(sb_ptrs, stride_sbk, 0, sb_mask, B_PER_CHANNEL, BLOCK_N)
    elif SCALES_AHEAD:
        sa, sb = load_block_scales(sa_ptrs, sb_ptrs, stride_sak, stride_sbk, 0, sa_mask, sb_mask, B_PER_CHANNEL,
                                   BLOCK_N)
    for kb in range(k_blocks):
        if OPERAND_TMA:
            a = a_desc.load([off_m, kb * BLOCK_K])
            b = b_desc.load([off_n, kb * BLOCK_K]).T  # K-major B: wgmma reads the transposed view
        else:
            ks = kb * BLOCK_K + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            a = tl.load(a_desc + offs_m[:, None].to(tl.int64) * stride_am + ks[None, :],
                        mask=(offs_m[:, None] < M) & k_ok[None, :], other=0.0)
            b = tl.load(b_desc + offs_n[None, :].to(tl.int64) * stride_bn + ks[:, None],
                        mask=k_ok[:, None] & (offs_n[None, :] < N), other=0.0)
        partial = tl.dot(a, b)  # no accumulator in: the block's sum starts from zero
        if SCALE_A_CHUNKS:
            step = chunk_step(kb, 0)
            sa = row_scales_in(sa_chunk, step)
        elif not SCALES_AHEAD:
            sa, sb = load_block_scales(sa_ptrs, sb_ptrs, stride_sak, stride_sbk, kb, sa_mask, sb_mask, B_PER_CHANNEL,
                                       BLOCK_N)
        acc = block_scaled_add(acc, partial, sa, sb, B_PER_CHANNEL, BLOCK_N, False)
        if SCALE_A_CHUNKS:
            sb = load_weight_scales(sb_ptrs, stride_sbk, tl.minimum(kb + 1, k_blocks - 1), sb_mask, B_PER_CHANNEL,
                                    BLOCK_N)
            sa_chunk, sa_next = next_row_scale_chunks(sa_chunk, sa_next, step, sa_ptrs, stride_sak, kb, k_blocks,
                                                      sa_mask)
        elif SCALES_AHEAD:  # the next k-block's (this one's again after the last)
            sa, sb = load_block_scales(sa_ptrs, sb_ptrs, stride_sak, stride_sbk, tl.minimum(kb + 1, k_blocks - 1),
                                       sa_mask, sb_mask, B_PER_CHANNEL, BLOCK_N)
    let_next_kernel_launch(PDL)

    # ---- epilogue: bias in fp32, then one rounding to the output dtype
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
        acc = acc + bias.to(tl.float32)[None, :]
    store_tile(c_desc, c_ptr, acc, offs_m, offs_n, off_m, off_n, M, N, stride_cm, stride_cn, TMA_STORE)


# ------------------------------------------------------------------------------------- configs


def is_valid(config: TritonGemmConfig, out_itemsize: int) -> bool:
    """The family's config rule: the TMA GEMM rule (powers of two, shared memory) with the K step
    fixed to the 128-deep scale block. Any power-of-two block_n works for both weight recipes
    (<= 128 divides the weight block; wider tiles gather one scale per column). Nothing only the
    grouped kernel runs (:meth:`TritonGemmConfig.grouped_only`: swapped tiles, several programs
    per SM)."""
    return config.block_k == SCALE_BLOCK and not config.grouped_only() and config.is_valid(1, 1, out_itemsize)


def _config(bm, bn, stages, warps, group_m=8) -> TritonGemmConfig:
    return TritonGemmConfig(block_m=bm, block_n=bn, block_k=SCALE_BLOCK, group_m=group_m, num_stages=stages,
                            num_warps=warps)


# Tuning candidates. No 128x256 tile: the fresh per-block product doubles the accumulator
# registers (two 128x256 fp32 tiles would spill with 8 warps).
CONFIGS = (
    _config(64, 64, 6, 4),
    _config(64, 128, 6, 4),
    _config(128, 64, 5, 4),
    _config(128, 128, 4, 8),
    _config(128, 128, 5, 8),
)

# The heuristic's tiles with their steady-state rate on an H100 (TFLOP/s at M = N = 4096, K =
# 7168, bf16 out, graph-timed): what one SM-slot-wave of each tile is worth.
_TILE_RATES = (
    (_config(128, 128, 4, 8), 830.0),
    (_config(64, 128, 6, 4), 726.0),
    (_config(128, 64, 5, 4), 590.0),
    (_config(64, 64, 6, 4), 512.0),
)
_SMALL_M_TILE = _config(64, 64, 6, 4)


def heuristic_for(m: int, n: int, k: int, sms: int) -> TritonGemmConfig:
    """A config from the problem size and SM count alone (pure; CUDA-graph capture, tuning off).

    Fitted to a sweep of every candidate on an H100 (132 SMs; DeepSeek-V3 shapes N x K = 2112 x
    7168, 4096 x 7168, 7168 x 2048, 24576 x 1536; M = 128 .. 4096, bf16 out, graph-timed):
    - M <= 128: 64x64 tiles. The GEMM streams the weight; the most CTAs pulling it wins (at M =
      128, N = 4096: 439 TFLOP/s against 350 for 64x128 and 228 for 128x128).
    - larger M: the tile with the least estimated time, waves x tile area / the tile's rate (one
      CTA per SM: every tile uses most of shared memory). This charges a nearly empty last
      wave: at M = 1024, N = 2112, 136 tiles of 128x128 take two waves on 132 SMs (469 TFLOP/s)
      where 264 tiles of 128x64 fill two (595). At every point of the sweep it picked the
      fastest tile shape (its stage count within 4% of the best).
    (k is part of the signature for rules to come, e.g. split-K for tiny M at long K.)
    """
    if m <= 128:
        return _SMALL_M_TILE
    best, best_time = None, float("inf")
    for config, rate in _TILE_RATES:
        waves = triton.cdiv(triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n), sms)
        time = waves * config.block_m * config.block_n / rate
        if time < best_time:
            best, best_time = config, time
    return best


def heuristic(args: GemmArgs) -> TritonGemmConfig:
    return heuristic_for(args.m, args.n, args.k, device.sms_of(args.out.device))


# --------------------------------------------------------------------------------- host side


@dataclass(frozen=True)
class Layout:
    """Constexpr layout flags of one block-scaled problem."""

    b_per_channel: bool  # scale_b (N, KB): one scale per output channel (Scaling.BLOCK_1X128)
    tma_store: bool  # out row-major, aligned: TMA store; otherwise masked pointer stores
    has_bias: bool
    operand_tma: bool = True  # a and b through tensor maps; otherwise masked pointer loads
    scale_a_chunks: bool = False  # scale_a contiguous along M: loaded in chunks (scale_a_in_chunks)


def _scale_reason(scale, name: str, shape: tuple, recipe: str, dev) -> str | None:
    if scale is None:
        return f"{name} is missing ({recipe} needs an fp32 {shape} tensor)"
    if scale.dtype != torch.float32:
        return f"{name} must be float32, got {scale.dtype}"
    if tuple(scale.shape) != shape:
        return f"{name} has shape {tuple(scale.shape)}; {recipe} needs {shape}"
    if scale.device != dev:
        return f"{name} is on {scale.device}, the operands on {dev}"
    return None


def layout_of(args: GemmArgs) -> Layout | str:
    """Layout flags for ``args``, or the reason this family cannot run it."""
    if args.block_scaling is None:
        return "no block scaling (GemmArgs.block_scaling is None): tensor/row-wise scales run on the TMA kernels"
    sa_kind, sb_kind = args.block_scaling
    if sa_kind != Scaling.BLOCK_1X128 or sb_kind not in (Scaling.BLOCK_128X128, Scaling.BLOCK_1X128):
        return (f"block scaling ({Scaling(sa_kind).name}, {Scaling(sb_kind).name}) is not (BLOCK_1X128, "
                "BLOCK_128X128 or BLOCK_1X128)")
    m, n, k = args.m, args.n, args.k
    if m == 0 or n == 0 or k == 0:
        return "a zero-size dimension (the plan layer returns those without a kernel)"
    if args.a.dtype != _FP8 or args.b.dtype != _FP8:
        return f"a and b must be float8_e4m3fn, got {args.a.dtype} and {args.b.dtype}"
    if args.out.dtype not in _OUT_DTYPES:
        return f"out must be bfloat16, float16 or float32, got {args.out.dtype}"
    dev = args.out.device
    if args.a.device != dev or args.b.device != dev:
        return f"a ({args.a.device}), b ({args.b.device}) and out ({dev}) must share a device"
    # fp8 wgmma reads both operands K-major: A row-major, B = w.t() (column-major). Through tensor
    # maps when TMA can describe both, else with pointer loads (any leading stride).
    if tma.contiguous_dim(args.a) != 1:
        return f"a {tuple(args.a.shape)} must be row-major (stride {tuple(args.a.stride())})"
    if tma.contiguous_dim(args.b) != 0:
        return (f"b {tuple(args.b.shape)} must be column-major, the .t() of a row-major (N, K) weight "
                f"(stride {tuple(args.b.stride())})")
    operand_tma = all(tma.operand_reason(t, name, row_major) is None
                      for t, name, row_major in ((args.a, "a", True), (args.b, "b", False)))
    if tma.contiguous_dim(args.out) != 1:
        return f"out {tuple(args.out.shape)} must be row-major (stride {tuple(args.out.stride())})"
    kb = triton.cdiv(k, SCALE_BLOCK)
    per_channel = sb_kind == Scaling.BLOCK_1X128
    b_shape = (n, kb) if per_channel else (triton.cdiv(n, SCALE_BLOCK), kb)
    for reason in (_scale_reason(args.scale_a, "scale_a", (m, kb), "1x128 activation scaling", dev),
                   _scale_reason(args.scale_b, "scale_b", b_shape,
                                 "per-channel 1x128" if per_channel else "128x128 weight scaling", dev)):
        if reason:
            return reason
    bias = args.bias
    if bias is not None:
        if tuple(bias.shape) != (n,) or not bias.is_floating_point() or (n > 1 and bias.stride(0) != 1):
            return f"bias must be a contiguous float ({n},) vector, got {bias.dtype} {tuple(bias.shape)}"
        if bias.device != dev:
            return f"bias is on {bias.device}, the operands on {dev}"
    return Layout(b_per_channel=per_channel, tma_store=tma.store_reason(args.out) is None, has_bias=bias is not None,
                  operand_tma=operand_tma, scale_a_chunks=scale_a_in_chunks(args.scale_a))


def scale_a_in_chunks(scale_a: torch.Tensor) -> bool:
    """Whether the block kernels load a's 1x128 scales in chunks of k-blocks
    (``common.load_row_scale_chunk``): scales contiguous along M (PyTorch's outer-dim-major and
    DeepGEMM's layout) with more than one row and k-block. Row-major ones keep per-step loads.
    Any k-stride: even at M = 16 (k-blocks 16 floats apart) chunks ran 0.94x of row-major speed
    against 0.88x per step (H200, BENCHMARKS.md); the grouped kernel, whose masked groups measured
    otherwise, has its own bound (``matmul_grouped.CHUNK_MIN_K_STRIDE``)."""
    return min(scale_a.shape) > 1 and tma.contiguous_dim(scale_a) == 0


def supports(args: GemmArgs) -> str | None:
    """``Variant.supports``: None, or why ``args`` is not a block-scaled problem this kernel runs."""
    layout = layout_of(args)
    return layout if isinstance(layout, str) else None


def kernel_call(args: GemmArgs, config: TritonGemmConfig, layout: Layout) -> KernelCall:
    """One launch, every kernel argument named once (direct launch, Triton's launcher, AOT)."""
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    if layout.operand_tma:
        a_desc = descriptor(args.a, True, bm, bk)
        b_desc = descriptor(args.b, False, bk, bn)  # described as the (N, K) weight, box [bn, bk]
    else:
        a_desc, b_desc = args.a, args.b
    c_desc = descriptor(args.out, True, bm, bn) if layout.tma_store else None
    sa, sb = args.scale_a, args.scale_b
    grid = (triton.cdiv(args.m, bm) * triton.cdiv(args.n, bn),)
    values = dict(
        a_desc=a_desc, b_desc=b_desc, c_desc=c_desc, c_ptr=args.out, scale_a_ptr=sa, scale_b_ptr=sb,
        bias_ptr=args.bias, M=args.m, N=args.n, K=args.k, stride_cm=args.out.stride(0),
        stride_cn=args.out.stride(1), stride_sam=sa.stride(0), stride_sak=sa.stride(1),
        stride_sbn=sb.stride(0), stride_sbk=sb.stride(1),
        stride_am=tma.leading_stride(args.a, True), stride_bn=tma.leading_stride(args.b, False),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=config.group_m,
        B_PER_CHANNEL=layout.b_per_channel, TMA_STORE=layout.tma_store, HAS_BIAS=layout.has_bias,
        OPERAND_TMA=layout.operand_tma, SCALE_A_CHUNKS=layout.scale_a_chunks, PDL=pdl(args.out),
    )
    return KernelCall(blockscaled_gemm_kernel, grid, values,
                      dict(num_warps=config.num_warps, num_stages=config.num_stages), GEMM_OPERANDS)


def build(args: GemmArgs, config: TritonGemmConfig | None = None) -> Plan:
    """``Variant.build``: a plan for every problem with ``args``' signature (shapes, strides of
    every operand and scale, dtypes, alignment, recipe). ``config`` overrides tuning/heuristic."""
    layout = layout_of(args)
    if isinstance(layout, str):
        raise ValueError(f"{NAME} cannot run this problem: {layout}")
    out_size = args.out.element_size()
    if config is None:
        config = tuning.select(NAME, args, CONFIGS, heuristic, lambda c: kernel_call(args, c, layout).launch())
    elif config.block_k != SCALE_BLOCK:
        raise ValueError(f"{NAME}: config.block_k must be {SCALE_BLOCK} (one scale block per K step), got {config}")
    if not is_valid(config, out_size):
        raise ValueError(f"{NAME}: {config} does not fit (powers of two, shared memory, nothing only triton.grouped runs) for {args.out.dtype} output")
    fast = direct_launch(NAME, kernel_call(args, config, layout))
    if fast is not None:
        return Plan(NAME, config, fast, fast.device_index, direct=True)
    block_scaling = args.block_scaling

    def launch(a, b, out, scale_a, scale_b, bias) -> None:
        operands = GemmArgs(a, b, out, scale_a, scale_b, bias, False, block_scaling)
        kernel_call(operands, config, layout).launch()

    return Plan(NAME, config, launch, args.out.get_device())


VARIANTS = [
    Variant(
        name=NAME,
        backend="triton",
        description="Triton, block-scaled fp8 (1x128 activations x 128x128 or per-channel weights), "
                    "TMA loads, fp32 promotion per 128-deep k-block",
        supports=supports,
        build=build,
        configs=CONFIGS,
    ),
]


def example_args(out_dtype=torch.bfloat16, m: int = 4096, n: int = 4096, k: int = 4096,
                 recipe: Scaling = Scaling.BLOCK_128X128) -> GemmArgs:
    """CPU operands as a DeepSeek-V3 linear layer passes them (scales row-major)."""
    kb = triton.cdiv(k, SCALE_BLOCK)
    rows_b = n if recipe == Scaling.BLOCK_1X128 else triton.cdiv(n, SCALE_BLOCK)
    return GemmArgs(torch.empty(m, k, dtype=_FP8), torch.empty(n, k, dtype=_FP8).t(),
                    torch.empty(m, n, dtype=out_dtype), torch.ones(m, kb), torch.ones(rows_b, kb), None, False,
                    (Scaling.BLOCK_1X128, recipe))


def aot_spec(config: TritonGemmConfig | None = None, a_dtype=None, out_dtype=None):
    """A compilable instance for ``tmagemm inspect`` (fp8 e4m3, 128x128 weight blocks, bf16 out)."""
    if a_dtype not in (None, _FP8):
        raise ValueError(f"{NAME} takes float8_e4m3fn operands only, not {a_dtype}")
    args = example_args(out_dtype or torch.bfloat16)
    config = config or _config(128, 128, 4, 8)
    return _aot_spec(kernel_call(args, config, layout_of(args)), NAME)
