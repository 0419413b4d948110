"""Non-persistent Triton GEMM whose loads and stores go through TMA.

One program per output tile, in grouped (L2-friendly) order. A and B tiles arrive through host
``TensorDescriptor``s passed by value (no per-call host-to-device descriptor copy, the cost the
seed write-ups measured); Triton software-pipelines the K loop over ``num_stages`` TMA buffers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import device, tma
from ..configs import TritonGemmConfig
from ..plan import GemmArgs, Variant
from .common import (epilogue_operands, first_row_in_bounds, grouped_tile, let_next_kernel_launch, mma, scale_bias,
                     wait_for_previous_kernel)
from .host import GEMM_OPERANDS, Layout, example_args, install_allocator, operand_descriptors, tma_builder, tma_layout, tma_supports
from .launch import KernelCall, aot_spec as _aot_spec, pdl


@triton.jit
def load_a_tile(a_desc, off_m, off_k, A_ROW_MAJOR: tl.constexpr):
    """[BM, BK] tile of A; a column-major A is described transposed and flipped back here."""
    if A_ROW_MAJOR:
        tile = a_desc.load([off_m, off_k])
    else:
        tile = a_desc.load([off_k, off_m]).T
    return tile


@triton.jit
def load_a_rows(a_ptr, off_m, off_k, M, K, lead_a, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BM, BK] tile of a row-major A through masked pointer loads (rows past M and columns past
    K read 0), pipelined by Triton like the TMA loads."""
    rows = off_m + tl.arange(0, BLOCK_M)
    cols = off_k + tl.arange(0, BLOCK_K)
    return tl.load(a_ptr + rows[:, None] * lead_a + cols[None, :], mask=(rows[:, None] < M) & (cols[None, :] < K),
                   other=0.0)


@triton.jit
def load_b_tile(b_desc, off_k, off_n, B_ROW_MAJOR: tl.constexpr):
    """[BK, BN] tile of B; a K-major B (w.t() of an (N, K) weight) is loaded as [BN, BK] and
    transposed, which wgmma reads directly from shared memory (required for fp8)."""
    if B_ROW_MAJOR:
        tile = b_desc.load([off_k, off_n])
    else:
        tile = b_desc.load([off_n, off_k]).T
    return tile


@triton.jit
def store_tile(c_desc, c_ptr, acc, offs_m, offs_n, off_m, off_n, M, N, stride_cm, stride_cn, TMA_STORE: tl.constexpr):
    """Write one fp32 tile to the output dtype: TMA store when out is aligned and row-major,
    masked pointer stores otherwise (TMA clips the ragged edges by itself)."""
    if TMA_STORE:
        c_desc.store([off_m, off_n], acc.to(c_desc.dtype))
    else:
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
        tl.store(ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def device_descriptor(base, rows, cols, lead, ROW_MAJOR: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                      BLOCK_COLS: tl.constexpr):
    """A tensor map built on the device (same layout rules as host.descriptor)."""
    if ROW_MAJOR:
        desc = tl.make_tensor_descriptor(base, shape=[rows, cols], strides=[lead, 1],
                                         block_shape=[BLOCK_ROWS, BLOCK_COLS])
    else:
        desc = tl.make_tensor_descriptor(base, shape=[cols, rows], strides=[lead, 1],
                                         block_shape=[BLOCK_COLS, BLOCK_ROWS])
    return desc


# M changes with every batch: not specialising on it keeps one binary per config, so a new M
# never compiles (the masks and TMA bounds take M at run time).
@triton.jit(do_not_specialize=["M"])
def tma_gemm_kernel(
    a_desc, b_desc, c_desc, c_ptr, scale_a_ptr, scale_b_ptr, bias_ptr,
    M, N, K, stride_cm, stride_cn, lead_a, lead_b,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    A_ROW_MAJOR: tl.constexpr, B_ROW_MAJOR: tl.constexpr, TMA_STORE: tl.constexpr,
    SCALE_A: tl.constexpr, SCALE_B: tl.constexpr, HAS_BIAS: tl.constexpr, FAST_ACCUM: tl.constexpr,
    DEVICE_DESC: tl.constexpr, A_POINTERS: tl.constexpr, PDL: tl.constexpr,
):
    # PDL: every read and write below comes after the previous kernel has finished (device-built
    # maps too: their scratch may be memory that kernel was still using).
    wait_for_previous_kernel(PDL)
    if DEVICE_DESC:
        # a_desc / b_desc are base pointers: each program encodes its own tensor maps in a
        # global scratch slot, so the host launches with plain pointers and encodes nothing
        # (host-side encoding per call is what made the seed write-ups' end-to-end latency explode).
        if not A_POINTERS:
            a_desc = device_descriptor(a_desc, M, K, lead_a, A_ROW_MAJOR, BLOCK_M, BLOCK_K)
        b_desc = device_descriptor(b_desc, K, N, lead_b, B_ROW_MAJOR, BLOCK_K, BLOCK_N)
        if TMA_STORE:
            c_desc = device_descriptor(c_ptr, M, N, stride_cm, True, BLOCK_M, BLOCK_N)
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    off_m = first_row_in_bounds(pid_m, BLOCK_M, M, A_ROW_MAJOR)
    off_n = pid_n * BLOCK_N
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    out_sa, out_sb, out_bias = epilogue_operands(offs_m, offs_n, M, N, scale_a_ptr, scale_b_ptr, bias_ptr,
                                                 SCALE_A, SCALE_B, HAS_BIAS)

    # K loop: TMA zero-fills the ragged last K tile, so no masks are needed here.
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if A_POINTERS:  # a_desc is A's base pointer (see a_pointer_loads)
            a = load_a_rows(a_desc, off_m, k * BLOCK_K, M, K, lead_a, BLOCK_M, BLOCK_K)
        else:
            a = load_a_tile(a_desc, off_m, k * BLOCK_K, A_ROW_MAJOR)
        b = load_b_tile(b_desc, k * BLOCK_K, off_n, B_ROW_MAJOR)
        acc = mma(a, b, acc, FAST_ACCUM, BLOCK_K)
    let_next_kernel_launch(PDL)

    acc = scale_bias(acc, out_sa, out_sb, out_bias, SCALE_A, SCALE_B, HAS_BIAS)
    store_tile(c_desc, c_ptr, acc, offs_m, offs_n, off_m, off_n, M, N, stride_cm, stride_cn, TMA_STORE)


# Candidates for tuning (tuning.select times each valid one once per problem bucket). The
# 64-row / 256-deep fp8 tiles are the winners of a graph-timed config sweep at M=16..512 on an H100
# (docs/small-m.md, "Small and medium M with `triton.tma`"); the 128x256 / 128x128 tiles serve
# large M and 16-bit inputs.
CONFIGS = tuple(
    TritonGemmConfig(block_m=bm, block_n=bn, block_k=bk, group_m=8, num_stages=s, num_warps=w)
    for bm, bn, bk, s, w in (
        (128, 256, 64, 3, 8),
        (128, 128, 64, 4, 8),
        (128, 128, 128, 3, 8),
        (128, 256, 128, 3, 8),
        (64, 128, 128, 4, 4),
        (128, 64, 128, 4, 4),
        (64, 32, 256, 6, 4),
        (64, 64, 256, 6, 4),
        (64, 128, 256, 4, 4),
        (64, 64, 128, 4, 4),
        (64, 64, 128, 6, 4),
        (64, 64, 128, 10, 4),
        (64, 128, 64, 4, 4),
    )
)

# fp8 tiles for M <= 256, in order of preference: (block_n, num_stages). Every stage holds a
# 64x256 A box and a block_n x 256 B box; the depth is the most that fits one CTA per SM.
_FP8_SMALL_M_TILES = ((64, 6), (128, 4))
_SMALL_M_BLOCK = 64  # one wgmma M=64 warpgroup tile: rows past M are TMA zero-fill, never read from HBM
# 64 x 32 fp8 tiles (twice the CTAs of 64 x 64) where the 64 x 64 tiles fill at most half the
# SMs: at 33-64 tokens with fast accumulation, and at any M <= 256 without it.
_FP8_NARROW = TritonGemmConfig(_SMALL_M_BLOCK, 32, 256, 8, 6, 4)


def _fp8_small_m(args: GemmArgs, sms: int) -> TritonGemmConfig:
    """Small and medium M are bound by streaming the weight: what counts is how many CTAs pull
    B at once and how many bytes each keeps in flight. So: 64-row tiles, 256-deep K steps
    (half the loop trips and twice the TMA box of 128), 6 stages, block_n=64 unless its tiles
    overflow one wave on the SMs, then 128 (a second wave on a few SMs costs more than the
    extra parallelism gives). Measured on an H100 at N=K=4096: 0.95-1.00x of cuBLAS at M=16-256.
    Where even 128-wide tiles overflow a wave (M = 192-256 at N = 7168, M >= 96 at N = 14336),
    128-deep steps let two CTAs share an SM: 5-12% faster there (H100, BENCHMARKS.md). Not at
    33-64 tokens (one row of tiles) with K >= 3072, where the 256-deep steps stay ahead over
    several waves: 36864 x 7168 115.8 -> 108.6 us, 37888 x 3584 66.9 -> 63.6, 28672 x 4096
    56.5 -> 56.1 at M = 64 (at K = 1536 they were 4% behind; H100, 2026-11-25). On GPUs with
    slow memory (an H100) at 1-32 tokens too: 8 chained copies with their own weights in one
    CUDA graph, 28672 x 4096 2.7-4.1% faster (44.9 -> 43.7 us at 32 tokens), 36864 x 7168 9-12%
    and 37888 x 3584 6-9% faster than with 128-deep steps (H100, 2026-11-28; the plan runs these
    two on split-K up to 16 tokens).
    At 33-64 tokens, where the 64 x 64 tiles fill at most half the SMs, 64 x 32 tiles (twice the
    CTAs): on the decode stacks' 2112-4096-row weights 0.4-2.8% faster per GEMM (0.948-1.015x
    cuBLAS) and 0.4-1.1 us faster per layer at M = 64; at M = 32 the layers were 0.4-3 us
    slower with them (H100, 2026-11-25, BENCHMARKS.md). Without fast accumulation:
    :func:`_fp8_exact_small_m`.
    """
    tiles_m = triton.cdiv(args.m, _SMALL_M_BLOCK)
    tiles_64 = tiles_m * triton.cdiv(args.n, 64)
    if not args.fast_accum:
        exact = _fp8_exact_small_m(tiles_64, sms)
        if exact is not None:
            return exact
    elif args.m > 32 and tiles_m == 1 and 2 * tiles_64 <= sms:
        return _FP8_NARROW
    for block_n, stages in _FP8_SMALL_M_TILES:
        if tiles_m * triton.cdiv(args.n, block_n) <= sms:
            return TritonGemmConfig(_SMALL_M_BLOCK, block_n, 256, 8, stages, 4)
    if tiles_m == 1 and args.k >= 3072 and (args.m > 32 or device.slow_memory(args.out.device)):
        return TritonGemmConfig(_SMALL_M_BLOCK, 128, 256, 8, 4, 4)
    return TritonGemmConfig(_SMALL_M_BLOCK, 128, 128, 8, 4, 4)


def _fp8_exact_small_m(tiles_64: int, sms: int) -> TritonGemmConfig | None:
    """fp8 with use_fast_accum=False at M <= 256 (``tiles_64``: the problem's 64 x 64 tiles). Each
    128-deep product is promoted into fp32 as soon as its wgmma retires, so a CTA waits on every
    k-step: more CTAs, or more stages, hide that wait. Up to half a wave of 64 x 64 tiles, 64 x 32
    tiles (twice the CTAs); up to a wave, 64 x 64 tiles 10 stages deep; up to two waves, 64 x 64
    tiles 6 stages deep, two CTAs per SM. H100, graph-timed, L2 flushed, against
    ``torch._scaled_mm(use_fast_accum=False)`` at M = 64 / 128 / 256, N and K in {4096, 8192}
    (BENCHMARKS.md): 0.93-0.99x where the fast-accumulation tiles ran 0.88-0.98x. None past two
    waves (not measured): the fast-accumulation tiles, promoting every 128 deep."""
    if 2 * tiles_64 <= sms:
        return _FP8_NARROW
    if tiles_64 <= sms:
        return TritonGemmConfig(_SMALL_M_BLOCK, 64, 128, 8, 10, 4)
    if tiles_64 <= 2 * sms:
        return TritonGemmConfig(_SMALL_M_BLOCK, 64, 128, 8, 6, 4)
    return None


def _16bit_small_m(args: GemmArgs, sms: int) -> TritonGemmConfig:
    """bf16/fp16 at M <= 256 (split-K takes M <= 16 and long K on narrow weights up to 64 tokens,
    :func:`tmagemm.plan.preference`): 64-row tiles.
    While the 64 x 64 tiles fit one wave on the SMs, 64 x 64 x 128 six stages deep (192 KB in
    flight per SM, one CTA each); past a wave, 64 x 128 tiles: 128-deep with 4 stages while they
    fit a wave, 64-deep with 4 stages (two CTAs per SM) where two rows of them fit twice the SMs.
    H100, graph-timed, L2 flushed, against torch.matmul (BENCHMARKS.md): at M = 32-128 on N = K =
    4096 0.94-1.03x where the 4-stage 64 x 64 tiles and split-K ran 0.84-0.97x; 14336 x 4096 at
    M = 80-128 0.97-1.03x where the 128-deep 64 x 128 tiles ran 0.83-0.97x. Past that (M > 128
    on wide weights) the 128-deep 64 x 128 tiles of the 2026-11-23 sweep stay."""
    tiles_m = triton.cdiv(args.m, _SMALL_M_BLOCK)
    if tiles_m * triton.cdiv(args.n, 64) <= sms:
        return TritonGemmConfig(_SMALL_M_BLOCK, 64, 128, 8, 6, 4)
    wide = tiles_m * triton.cdiv(args.n, 128)
    if wide > sms and tiles_m <= 2 and wide <= 2 * sms:
        return TritonGemmConfig(_SMALL_M_BLOCK, 128, 64, 8, 4, 4)
    return TritonGemmConfig(_SMALL_M_BLOCK, 128, 128, 8, 4, 4)


def heuristic(args: GemmArgs) -> TritonGemmConfig:
    """A config that is good on H100/H200 without timing anything (CUDA-graph capture, tuning
    off, the default), fitted to graph-replay timings (docs/small-m.md, BENCHMARKS.md)."""
    sms = device.sms_of(args.out.device)
    if args.is_fp8:
        if args.m <= 256:
            return _fp8_small_m(args, sms)
        if args.m <= 512:
            # Two 112 KB CTAs per SM: 256 tiles of 128x64 all resident at once.
            return TritonGemmConfig(128, 64, 128, 8, 4, 4)
        return TritonGemmConfig(128, 256, 128, 8, 3, 8)
    if args.m <= 256:
        return _16bit_small_m(args, sms)
    return TritonGemmConfig(128, 256, 64, 8, 3, 8)


def a_pointer_loads(args: GemmArgs, config: TritonGemmConfig, layout: Layout) -> bool:
    """Whether A comes through masked pointer loads instead of TMA: a row-major A of at most half
    a row tile (M <= block_m / 2), whose TMA box would hang half or more past row M. Such a box
    loads far slower than one inside (docs/small-m.md, "Rows past M"); H200 decode stacks at
    M = 17-32 ran 0.974 -> 1.005x cuBLAS (fp8 tensor-wise), 0.990 -> 1.021x (bf16) with pointer
    loads, no layer slower. A box with fewer rows past M (M = 48 of 64) stayed ahead of them."""
    return layout.a_row_major and args.a.stride(1) == 1 and args.m <= config.block_m // 2


def kernel_call(args: GemmArgs, config: TritonGemmConfig, layout: Layout, device_desc: bool = False) -> KernelCall:
    """One launch (see host.tma_builder)."""
    a_pointers = a_pointer_loads(args, config, layout)
    if device_desc:
        install_allocator()
        a_desc, b_desc, c_desc = args.a, args.b, None
        lead_a, lead_b = tma.leading_stride(args.a, layout.a_row_major), tma.leading_stride(args.b, layout.b_row_major)
    else:
        lead_a = lead_b = 0  # unused: the host descriptors carry the strides
        a_desc, b_desc, c_desc = operand_descriptors(
            args, layout, config.block_m, config.block_n, config.block_k, config.block_n, a_tma=not a_pointers
        )
    if a_pointers:  # the kernel reads A from its base pointer with its row stride
        a_desc, lead_a = args.a, args.a.stride(0)
    grid = (triton.cdiv(args.m, config.block_m) * triton.cdiv(args.n, config.block_n),)
    values = dict(
        a_desc=a_desc, b_desc=b_desc, c_desc=c_desc, c_ptr=args.out, scale_a_ptr=args.scale_a,
        scale_b_ptr=args.scale_b, bias_ptr=args.bias, M=args.m, N=args.n, K=args.k,
        stride_cm=args.out.stride(0), stride_cn=args.out.stride(1), lead_a=lead_a, lead_b=lead_b,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        **layout.constexprs(args.fast_accum), DEVICE_DESC=device_desc, A_POINTERS=a_pointers, PDL=pdl(args.out),
    )
    return KernelCall(tma_gemm_kernel, grid, values, dict(num_warps=config.num_warps, num_stages=config.num_stages),
                      GEMM_OPERANDS)


build = tma_builder("triton.tma", CONFIGS, heuristic, kernel_call)
# Device-built maps need Triton's per-launch scratch allocation: always Triton's launcher.
build_device = tma_builder("triton.tma_device", CONFIGS, heuristic, kernel_call, direct=False, device_desc=True)


VARIANTS = [
    Variant(
        name="triton.tma",
        backend="triton",
        description="Triton, non-persistent, TMA loads/stores via host TensorDescriptor passed by value",
        supports=tma_supports,
        build=build,
        configs=CONFIGS,
    ),
    Variant(
        name="triton.tma_device",
        backend="triton",
        description="triton.tma with tensor maps built on the device (tl.make_tensor_descriptor): no host encode per call",
        supports=tma_supports,
        build=build_device,
        configs=CONFIGS,
    ),
]


def aot_spec(config: TritonGemmConfig | None = None, a_dtype=None, out_dtype=None, variant: str = "triton.tma"):
    """A compilable instance for ``tmagemm inspect`` (fp8 by default: A row-major, B K-major);
    ``variant="triton.tma_device"`` gives the kernel that builds its tensor maps on the device."""
    args = example_args(a_dtype or torch.float8_e4m3fn, out_dtype or torch.bfloat16)
    config = config or TritonGemmConfig(128, 256, 128 if args.is_fp8 else 64, 8, 3, 8)
    return _aot_spec(kernel_call(args, config, tma_layout(args), device_desc=variant == "triton.tma_device"), variant)
