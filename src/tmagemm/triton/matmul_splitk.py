"""Small-M (decode) GEMM: TMA weight streaming, optional swap-AB, split-K with an in-kernel reduction.

For M <= 128 and N, K in the thousands the GEMM reads the weight once and is bound by HBM
bandwidth. One row of 128x128 output tiles gives N/128 CTAs (32 at N=4096) for 132 SMs, so most of
the machine idles. This kernel family fixes that with two tools:

* **split-K**: each output tile's K range is cut into ``split_k`` slices, one CTA per slice, so
  ``tiles * split_k`` CTAs stream the weight in parallel. Slices write fp32 partials to a cached
  workspace; the CTA that arrives last at a per-tile counter sums all slices *in slice order*
  and runs the scale/bias/cast epilogue. One launch, no zeroing of ``out``, and the result is
  bitwise reproducible (the sum order never depends on which CTA finished first).
* **swap-AB**: compute ``out^T = b^T a^T`` so the weight fills the 64/128-row WGMMA M dimension
  and the few tokens land in the N dimension (16..128), instead of padding M up to 64.

Block-scaled fp8 (1x128 activations x 128x128 or per-channel weight scales) runs here too at
decode-sized M: BLOCK_K is then the 128-deep scale block, each step's product is promoted into
the fp32 sum with its scales, and the slices' partial sums are already dequantised.

The configuration comes from :func:`choose_config` (or :func:`choose_block_config`), a pure
function of (M, N, K, dtype, SMs); nothing is tuned at call time. Partial sums and counters come
from ``tmagemm.workspace``, which makes the launch safe in eager mode and under any CUDA-graph
capture.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import triton
import triton.language as tl

from .. import device, tma, workspace
from ..plan import GemmArgs, Plan, Scaling, Variant, block_tiling
from . import matmul_blockscaled as blockscaled
from .common import (SCALES_AHEAD_MIN_ROWS, block_scaled_add, chunk_step, epilogue_operands, first_row_scale_chunks,
                     let_next_kernel_launch, load_block_scales, load_weight_scales, mma, next_row_scale_chunks,
                     row_scales_in, scale_bias, wait_for_previous_kernel)
from .host import descriptor
from .launch import A, B, BIAS, COUNTERS, OUT, PARTIALS, SCALE_A, SCALE_B, KernelCall, direct_launch, pdl

MAX_M = 128
# Largest N: one arrival counter per 64-column output tile must fit a workspace counter chunk.
MAX_N = 64 * workspace.COUNTERS

# Shared memory one CTA may plan for its pipeline (H100/H200 allow 227 KiB per block); the rest
# is left for the layout conversions of the epilogue.
_SMEM_BUDGET = 200 * 1024


@dataclass(frozen=True)
class SplitKConfig:
    """Tiles and split of one small-M launch.

    block_m tiles the tokens (M), block_n the weight rows (N), block_k the reduction. With
    ``swap_ab`` the kernel computes ``[block_n, block_m]`` tiles of out^T. ``a_tma`` loads the
    activation through a TMA descriptor too (otherwise pointer loads, any strides).
    The accumulation mode is not part of the config: it follows the call (``GemmArgs.fast_accum``,
    the public ``use_fast_accum``). Without fast accumulation an fp8 tile promotes WGMMA's
    reduced-precision accumulator into fp32 once per block_k (like DeepGEMM).
    """

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    swap_ab: bool
    a_tma: bool
    num_stages: int
    num_warps: int = 4

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value > 256 or value & (value - 1):
                raise ValueError(f"SplitKConfig.{name}={value}: must be a power of two in [16, 256]")
        if self.split_k < 1:
            raise ValueError(f"SplitKConfig.split_k={self.split_k}: must be >= 1")
        if self.num_stages < 1:
            raise ValueError(f"SplitKConfig.num_stages={self.num_stages}: must be >= 1")
        if self.num_warps not in (4, 8):
            raise ValueError(f"SplitKConfig.num_warps={self.num_warps}: must be 4 or 8")

    def smem_bytes(self, itemsize: int) -> int:
        """Pipeline buffers: one weight tile and one activation tile per stage."""
        return self.num_stages * (self.block_n + self.block_m) * self.block_k * itemsize

    def gpu_reason(self, itemsize: int) -> str | None:
        """None when this config may launch on a GPU. Only the tile family the heuristic uses and
        the GPU tests cover may: smaller tiles (block_n < 64, block_k rows under 128 B) run under
        the interpreter only (a GPU job of ours stalled on them once; the cause is not pinned
        down)."""
        if self.block_n < 64 or self.block_k * itemsize != 128:
            return (f"SplitKConfig block_n={self.block_n}, block_k={self.block_k}: on a GPU this kernel takes "
                    f"block_n >= 64 and block_k spanning 128 B ({128 // itemsize} elements)")
        return None


# ----------------------------------------------------------------------------------------------
# Heuristic
# ----------------------------------------------------------------------------------------------


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def warps_for(block_m: int, block_n: int) -> int:
    """One warpgroup per tile up to 128 x 64 accumulators, two above."""
    return 8 if block_m * block_n > 128 * 64 else 4


def stages_for(block_m: int, block_n: int, block_k: int, itemsize: int, ctas_per_sm: int = 2) -> int:
    """Deepest pipeline that lets ``ctas_per_sm`` CTAs share one SM's shared memory."""
    stage = (block_m + block_n) * block_k * itemsize
    return max(2, min(8, _SMEM_BUDGET // ctas_per_sm // stage))


# fp8 at up to 16 tokens on weights of more 64-row tiles than two per SM (the widest gate/up
# projections, one K slice): WIDE_FP8_STAGES stages, three CTAs per SM instead of two, where the
# last of those waves still holds CTAs for at least half the SMs. Per GEMM (H100, 8 chained
# copies with their own weights in one CUDA graph, M = 1, 8, 16, two rounds): 37888 x 3584 48.6
# against 49.9 us at one token (cuBLAS 49.8), 36864 x 7168 91.9 against 92.4; 28672 x 4096,
# whose last wave would hold 52 CTAs, 44.5 against 42.7, so it keeps 8 stages. In the decode
# stacks (fp8 tensor- and row-wise, 1-16 tokens) Qwen2.5-7B's layers ran 0.9-2.6% faster and
# DeepSeek-V3's 0.2-0.7% (BENCHMARKS.md).
# Weights of up to two tiles per SM (all resident at 8 stages) keep them: on Llama-3-70B TP 4's
# 14336 x 8192 128-row tiles (one per SM) were 2% faster per GEMM but level in its stack at 1
# and 8 tokens and 0.8% slower at 16.
WIDE_FP8_STAGES = 6


def _wide_fp8_stages(tiles: int, sm_count: int) -> int | None:
    """:func:`choose_config`'s ring depth for fp8 at <= 16 tokens on a weight of ``tiles`` 64-row
    tiles, or None for the general rule."""
    last_wave = tiles % (3 * sm_count)
    if tiles > 2 * sm_count and (last_wave == 0 or 2 * last_wave >= sm_count):
        return WIDE_FP8_STAGES
    return None


@functools.lru_cache(maxsize=4096)
def choose_config(m: int, n: int, k: int, itemsize: int, sm_count: int) -> SplitKConfig:
    """Tiles and split factor for an (m, n, k) problem; pure, so tests can tabulate it.

    Fitted to a sweep on an H100 (docs/small-m.md): swap-AB with the tokens rounded up to a
    power of two >= 16 in the WGMMA N slot, 64 weight rows per tile (twice the CTAs of 128-row
    tiles, and the deepest pipeline: 8 stages at M <= 16; fp8 on the widest weights:
    :func:`_wide_fp8_stages`), block_k spanning 128 bytes (one 128B
    swizzle row), and a K split only while the tiles alone leave SMs idle (split up to
    sm_count // tiles, keeping >= 4 K-blocks per slice). Splitting further to fill two waves lost
    in the sweep: the partial sums cost more than the extra parallelism returned. ``itemsize``:
    1 for fp8 operands, 2 for bf16/fp16.
    """
    block_k = 128 // itemsize
    block_m = min(MAX_M, max(16, _next_pow2(m)))
    block_n = 64
    tiles = _cdiv(max(m, 1), block_m) * _cdiv(max(n, 1), block_n)
    num_stages = stages_for(block_m, block_n, block_k, itemsize)
    if itemsize == 1 and block_m == 16:  # one row of tiles: ``tiles`` counts the weight's
        num_stages = _wide_fp8_stages(tiles, sm_count) or num_stages
    k_iters = max(1, _cdiv(k, block_k))
    split = max(1, min(sm_count // tiles, k_iters // 4))
    if itemsize == 1 and split == 2 and k_iters < 128:
        # fp8 tiles already on half the SMs: two slices pay for their partial sums only over a
        # long K (H100, graph-timed with PDL: N = K = 4096 and 3584 6-10% faster unsplit at
        # M <= 16, K = 14336 level to 3% faster, K = 18944 (148 steps) 7% slower unsplit).
        split = 1
    # Re-derive the split from the slice length so no slice is empty.
    split = _cdiv(k_iters, _cdiv(k_iters, split))
    return SplitKConfig(
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        split_k=split,
        swap_ab=True,
        # 16-bit activations of 33-64 tokens (64-token tiles) through TMA, pipelined with the
        # weight: 1-3% faster than pointer loads at M = 64 on an H100 (N = K = 4096, 3584, and
        # 4096 x 14336). build() falls back to pointer loads where TMA cannot describe A.
        a_tma=itemsize == 2 and m > 32,
        num_stages=num_stages,
        num_warps=warps_for(block_m, block_n),
    )


def choose_block_config(m: int, n: int, k: int, sm_count: int) -> SplitKConfig:
    """The block-scaled launch: 64-row weight tiles, 128-deep k-steps (the scale block), the
    token tiling and slices of :func:`tmagemm.plan.block_tiling`, the activation through TMA too
    (pipelined with the weight: 2-15% faster than pointer loads across the checkpoint shapes on
    an H100), :func:`choose_config`'s pipeline depth and warps for those tiles."""
    rows, swap, split = block_tiling(m, n, k, sm_count)
    return SplitKConfig(block_m=rows, block_n=64, block_k=128, split_k=split, swap_ab=swap, a_tma=True,
                        num_stages=stages_for(rows, 64, 128, 1), num_warps=warps_for(rows, 64))


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------


# M changes every decode step and the split is picked per shape: not specialising on them keeps
# one binary per config (the reduction branch is a uniform scalar test). The k-stride of an
# outer-dim-major 1x128 scale_a equals M: not specialised either.
@triton.jit(do_not_specialize=["M", "split_k", "iters_per_split", "stride_sak"])
def _splitk_kernel(
    a_ptr,
    a_desc,
    w_desc,
    out_ptr,
    scale_a_ptr,
    scale_b_ptr,
    bias_ptr,
    ws_ptr,
    lock_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_om,
    stride_on,
    stride_sam,
    stride_sak,
    stride_sbn,
    stride_sbk,
    split_k,
    iters_per_split,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SWAP_AB: tl.constexpr,
    A_TMA: tl.constexpr,
    W_KMAJOR: tl.constexpr,
    SCALE_A: tl.constexpr,
    SCALE_B: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    FAST_ACCUM: tl.constexpr,
    BLOCK_SCALED: tl.constexpr,
    SCALE_A_CHUNKS: tl.constexpr,
    PDL: tl.constexpr,
):
    # -- scheduler: axis 0 is the K slice, so the slices of one tile are launched side by side
    # and the last one does not wait long for the others; consecutive tiles walk N, so CTAs in
    # flight share the activation row panel in L2.
    split_id = tl.program_id(0)
    tile_id = tl.program_id(1)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m = tile_id // num_pid_n
    pid_n = tile_id % num_pid_n
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)

    k_lo = split_id * iters_per_split
    k_hi = tl.minimum(k_lo + iters_per_split, tl.cdiv(K, BLOCK_K))
    # PDL: the activation (and everything else) is read after the previous kernel has finished.
    wait_for_previous_kernel(PDL)
    # Every slice reads them, though only the last to arrive applies them: read after the
    # reduction they would add a memory round trip to the kernel's tail.
    out_sa, out_sb, out_bias = epilogue_operands(offs_m, offs_n, M, N, scale_a_ptr, scale_b_ptr, bias_ptr,
                                                 SCALE_A, SCALE_B, HAS_BIAS)

    # -- mainloop: the weight streams through TMA (zero-filled past N and K, so ragged edges need
    # no masks); Triton pipelines the loads num_stages deep behind mbarriers.
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # Block-scaled fp8 (BLOCK_SCALED 1: 128x128 weight blocks, 2: one weight scale per channel):
    # BLOCK_K is the 128-deep scale block, so each step's product is promoted with its scales and
    # the slices' partial sums are already dequantised (the epilogue adds only the bias).
    if BLOCK_SCALED:
        sa_ptrs = scale_a_ptr + offs_m * stride_sam
        if BLOCK_SCALED == 2:
            sb_ptrs = scale_b_ptr + offs_n * stride_sbn
        else:
            sb_ptrs = scale_b_ptr + (off_n // 128) * stride_sbn  # BLOCK_N divides the 128-row block
    # common.SCALES_AHEAD_MIN_ROWS says why. SCALE_A_CHUNKS (scale_a contiguous along M): the row
    # scales come in chunks of SCALE_CHUNK k-blocks, loaded a chunk ahead (common.load_row_scale_chunk),
    # and the weight scale a step ahead.
    SCALES_AHEAD: tl.constexpr = BLOCK_M >= SCALES_AHEAD_MIN_ROWS
    if BLOCK_SCALED:
        if SCALE_A_CHUNKS:
            sa_chunk, sa_next = first_row_scale_chunks(sa_ptrs, stride_sak, k_lo, k_hi, offs_m < M)
            sb = load_weight_scales(sb_ptrs, stride_sbk, k_lo, offs_n < N, BLOCK_SCALED == 2, BLOCK_N)
        elif SCALES_AHEAD:
            sa, sb = load_block_scales(sa_ptrs, sb_ptrs, stride_sak, stride_sbk, k_lo, offs_m < M, offs_n < N,
                                       BLOCK_SCALED == 2, BLOCK_N)
    for ki in range(k_lo, k_hi):
        k0 = ki * BLOCK_K
        if A_TMA:
            a = a_desc.load([off_m, k0])
        else:
            # The activation is tiny next to the weight; pointer loads accept any strides and
            # skip a tensor-map encode per call on the host.
            ks = k0 + offs_k
            a = tl.load(
                a_ptr + offs_m[:, None] * stride_am + ks[None, :] * stride_ak,
                mask=(offs_m[:, None] < M) & (ks[None, :] < K),
                other=0.0,
            )
        if W_KMAJOR:
            w = w_desc.load([off_n, k0])  # [BLOCK_N, BLOCK_K], K contiguous (fp8 needs this)
        else:
            w = w_desc.load([k0, off_n]).T  # [BLOCK_K, BLOCK_N], N contiguous (16-bit only)
        if BLOCK_SCALED:
            if SWAP_AB:  # a fresh product: no accumulator in
                partial = tl.dot(w, a.T)
            else:
                partial = tl.dot(a, w.T)
            if SCALE_A_CHUNKS:
                step = chunk_step(ki, k_lo)
                sa = row_scales_in(sa_chunk, step)
            elif not SCALES_AHEAD:
                sa, sb = load_block_scales(sa_ptrs, sb_ptrs, stride_sak, stride_sbk, ki, offs_m < M, offs_n < N,
                                           BLOCK_SCALED == 2, BLOCK_N)
            acc = block_scaled_add(acc, partial, sa, sb, BLOCK_SCALED == 2, BLOCK_N, SWAP_AB)
            if SCALE_A_CHUNKS:
                sb = load_weight_scales(sb_ptrs, stride_sbk, tl.minimum(ki + 1, k_hi - 1), offs_n < N,
                                        BLOCK_SCALED == 2, BLOCK_N)
                sa_chunk, sa_next = next_row_scale_chunks(sa_chunk, sa_next, step, sa_ptrs, stride_sak, ki, k_hi,
                                                          offs_m < M)
            elif SCALES_AHEAD:  # the next k-block's (this one's again after the last)
                sa, sb = load_block_scales(sa_ptrs, sb_ptrs, stride_sak, stride_sbk, tl.minimum(ki + 1, k_hi - 1),
                                           offs_m < M, offs_n < N, BLOCK_SCALED == 2, BLOCK_N)
        elif SWAP_AB:
            acc = mma(w, a.T, acc, FAST_ACCUM, BLOCK_K)
        else:
            acc = mma(a, w.T, acc, FAST_ACCUM, BLOCK_K)

    let_next_kernel_launch(PDL)

    # -- split-K reduction, deterministic: every slice parks its partial in the workspace, then
    # bumps the tile's arrival counter; the last to arrive sums the slices in slice order.
    if split_k > 1:
        tile_elems: tl.constexpr = BLOCK_M * BLOCK_N
        ws_tile = ws_ptr + tile_id.to(tl.int64) * split_k * tile_elems
        if SWAP_AB:
            offs_acc = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        else:
            offs_acc = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        # .cg keeps partials in L2 (the coherence point across SMs), never in a stale L1 line.
        tl.store(ws_tile + split_id * tile_elems + offs_acc, acc, cache_modifier=".cg")
        # All threads' stores must be issued before the release below publishes them: the
        # scalar atomic runs on one thread, and its gpu-scope release is cumulative over what
        # the CTA barrier ordered before it.
        tl.debug_barrier()
        arrived = tl.atomic_add(lock_ptr + tile_id, 1, sem="acq_rel", scope="gpu")
        if arrived != split_k - 1:
            return
        acc = tl.zeros_like(acc)
        for s in range(0, split_k):
            acc += tl.load(ws_tile + s * tile_elems + offs_acc, cache_modifier=".cg")
        # Re-arm the counter for the next launch that uses it: the counters never need a memset,
        # which keeps the call a single kernel (tmagemm/workspace.py).
        tl.atomic_xchg(lock_ptr + tile_id, 0, sem="relaxed", scope="gpu")

    # -- epilogue: back to (tokens, N) orientation, dequantise, bias, cast, masked store.
    if SWAP_AB:
        acc = acc.T
    acc = scale_bias(acc, out_sa, out_sb, out_bias, SCALE_A, SCALE_B, HAS_BIAS)
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


# ----------------------------------------------------------------------------------------------
# Host side: checks, launch, plan
# ----------------------------------------------------------------------------------------------


def supports(args: GemmArgs) -> str | None:
    if args.block_scaling is not None:
        layout = blockscaled.layout_of(args)  # the block recipe's operand and scale rules
        if isinstance(layout, str):
            return layout
        if not layout.operand_tma:
            return "block-scaled operands TMA cannot describe run on triton.blockscaled's pointer loads"
    if args.m > MAX_M:
        return f"M={args.m} > {MAX_M}: the split-K kernels are for small M (decode)"
    if args.n > MAX_N:
        return f"N={args.n} > {MAX_N}: more output tiles than one workspace counter chunk holds"
    if args.m == 0 or args.n == 0 or args.k == 0:
        return "a zero-size dimension (the plan layer returns those without a kernel)"
    kmajor = tma.b_is_k_major(args.b)
    if args.is_fp8 and not kmajor:
        return "fp8 b must be column-major (b = w.t() of a row-major (N, K) weight): WGMMA reads fp8 K-major"
    return tma.operand_reason(args.b, "b", not kmajor)


# The per-call operands of _splitk_kernel, by parameter: A reaches the kernel as a pointer (and as
# a descriptor with a_tma), the weight through its descriptor, then the workspace.
_OPERANDS = {"a_ptr": A, "a_desc": A, "w_desc": B, "out_ptr": OUT, "scale_a_ptr": SCALE_A, "scale_b_ptr": SCALE_B,
             "bias_ptr": BIAS, "ws_ptr": PARTIALS, "lock_ptr": COUNTERS}


def _split(args: GemmArgs, config: SplitKConfig) -> tuple[int, int, int]:
    """(output tiles, K slices, K-blocks per slice); no slice is empty."""
    tiles = _cdiv(args.m, config.block_m) * _cdiv(args.n, config.block_n)
    k_iters = _cdiv(args.k, config.block_k)
    per_split = _cdiv(k_iters, config.split_k)
    return tiles, _cdiv(k_iters, per_split), per_split


def partials_needed(args: GemmArgs, config: SplitKConfig) -> int:
    """fp32 partial sums one launch needs (none without a K split)."""
    tiles, split, _ = _split(args, config)
    return tiles * split * config.block_m * config.block_n if split > 1 else 0


def kernel_call(args: GemmArgs, config: SplitKConfig, ws: workspace.Workspace) -> KernelCall:
    a, b, out = args.a, args.b, args.out
    m, n, k = args.m, args.n, args.k
    kmajor = tma.b_is_k_major(b)
    w_desc = descriptor(b, not kmajor, config.block_k, config.block_n)
    a_desc = descriptor(a, True, config.block_m, config.block_k) if config.a_tma else None
    tiles, split, per_split = _split(args, config)
    if args.block_scaling is not None:
        sa, sb = args.scale_a, args.scale_b
        scale_strides = dict(stride_sam=sa.stride(0), stride_sak=sa.stride(1), stride_sbn=sb.stride(0),
                             stride_sbk=sb.stride(1))
        scaling = dict(SCALE_A=int(Scaling.NONE), SCALE_B=int(Scaling.NONE),
                       BLOCK_SCALED=2 if args.block_scaling[1] == Scaling.BLOCK_1X128 else 1,
                       SCALE_A_CHUNKS=blockscaled.scale_a_in_chunks(sa))
    else:
        scale_strides = dict(stride_sam=0, stride_sak=0, stride_sbn=0, stride_sbk=0)
        scaling = dict(SCALE_A=int(Scaling.of(args.scale_a)), SCALE_B=int(Scaling.of(args.scale_b)), BLOCK_SCALED=0,
                       SCALE_A_CHUNKS=False)
    values = dict(
        a_ptr=a, a_desc=a_desc, w_desc=w_desc, out_ptr=out, scale_a_ptr=args.scale_a, scale_b_ptr=args.scale_b,
        bias_ptr=args.bias, ws_ptr=ws.partials, lock_ptr=ws.counters,
        M=m, N=n, K=k, stride_am=a.stride(0), stride_ak=a.stride(1), stride_om=out.stride(0), stride_on=out.stride(1),
        **scale_strides, split_k=split, iters_per_split=per_split,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, SWAP_AB=config.swap_ab,
        A_TMA=config.a_tma, W_KMAJOR=kmajor, **scaling, HAS_BIAS=args.bias is not None,
        FAST_ACCUM=args.fast_accum, PDL=pdl(out),
    )
    return KernelCall(_splitk_kernel, (split, tiles), values,
                      dict(num_stages=config.num_stages, num_warps=config.num_warps), _OPERANDS)


def build(args: GemmArgs, config: SplitKConfig | None = None) -> Plan:
    """The plan of one problem signature: heuristic config, the kernel launched directly
    (``triton/launch.py``) with the workspace of the calling stream (or capture) per call."""
    itemsize = args.a.element_size()
    if config is not None and args.block_scaling is not None and (config.block_k != 128 or config.block_n > 128):
        raise ValueError(f"triton.splitk: block-scaled problems need block_k = 128 (one scale block per K step) "
                         f"and block_n <= 128 (a tile inside one 128-row weight block), got {config}")
    forced = config is not None
    if config is None:
        sms = device.sms_of(args.out.device)
        if args.block_scaling is not None:
            config = choose_block_config(args.m, args.n, args.k, sms)
        else:
            config = choose_config(args.m, args.n, args.k, itemsize, sms)
    reason = tma.operand_reason(args.a, "a", True) if config.a_tma else None
    if reason is not None:
        # The heuristic falls back to pointer loads; a forced config is refused.
        if forced:
            raise ValueError(f"triton.splitk: config {config} loads a through TMA, but {reason}")
        config = dataclasses.replace(config, a_tma=False)
    on_gpu = args.out.is_cuda
    if on_gpu:
        reason = config.gpu_reason(itemsize)
        if reason:
            raise ValueError(reason)
        workspace.top_up(args.out.get_device())
    need = partials_needed(args, config)
    fast = direct_launch("triton.splitk", kernel_call(args, config, workspace.for_launch(args.out, need))) if on_gpu else None
    if fast is not None:
        index = fast.device_index
        scratch = workspace.getter(index, need)

        def launch(a, b, out, scale_a, scale_b, bias) -> None:
            ws = scratch()
            fast(a, b, out, scale_a, scale_b, bias, ws.partials, ws.counters)

        return Plan("triton.splitk", config, launch, index, direct=True)

    def launch(a, b, out, scale_a, scale_b, bias) -> None:
        problem = GemmArgs(a, b, out, scale_a, scale_b, bias, args.fast_accum, args.block_scaling)
        kernel_call(problem, config, workspace.for_launch(out, need)).launch()

    return Plan("triton.splitk", config, launch, args.out.get_device())


VARIANTS = [
    Variant(
        name="triton.splitk",
        backend="triton",
        description="small-M (<=128) decode GEMM: TMA weight stream, swap-AB, deterministic split-K; "
                    "tensor/row-wise scales or block-scaled fp8 (1x128 x 128x128 / per-channel)",
        supports=supports,
        build=build,
    )
]
