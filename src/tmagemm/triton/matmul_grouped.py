"""Grouped GEMM for Mixture-of-Experts: one persistent launch over every expert's tiles.

    out[rows of group g] = (a[rows of g] @ b[g]) * scales + bias[g]

Layouts (``tmagemm.grouped.GroupLayout``): CONTIGUOUS a (M_total, K) with rows sorted by expert
and ``offs`` (E,) the cumulative group ends; MASKED a (E, max_m, K) with ``masked_m`` (E,) valid
rows per expert; BATCHED a (E, M, K), every row valid. b is (E, K, N), K-major (``w.transpose(1,
2)`` of (E, N, K) weights) or N-major (16-bit only).

Scheduler. The counts never leave the device (no host sync, so the launch captures into a CUDA
graph and replays with new counts). Every program loads the whole count vector once (E_BLOCK
lanes), turns it into clamped row ranges [start_g, end_g) and the inclusive prefix sum of the
tiles per group (ceil(rows_g / BLOCK_M) * tiles_n), then walks the global tile ids p, p +
NUM_PROGRAMS, ... up to that sum. A tile id maps to its group by counting the prefix sums <= id
(one vector reduction), and within the group to (m, n) tiles in grouped (L2-friendly) order. The
grid is min(SMs x ``TritonGemmConfig.programs_per_sm``, an upper bound of the tile count known
from shapes alone), so programs past the real count simply find no tile.

Swapped decode tiles (``TritonGemmConfig.swap_ab``, groups known to hold a few rows: see
:func:`heuristic_for`): block_n rows of expert g's weight fill wgmma's M and block_m (16) rows of A
its N slot, so a group of one row wastes 15 rows of a 16-row tile rather than 63 of a 64-row
one, and the small stages let more programs stream weights at once. The tile is computed as
out^T and transposed in registers before the epilogue. The grid is then the tile bound itself,
one tile per program, walked from the last id down (the programs past the real count start
among the first and leave at once).

Group-boundary rule (CONTIGUOUS): end_g = min(max(offs[0..g], 0), M_total) (a running maximum,
clamped), start_g = end_{g-1} (0 for g = 0). Decreasing offsets give empty groups, offsets past
M_total stop at M_total, rows past the last end are never written. MASKED: rows [0,
clamp(masked_m[g], 0, max_m)) of expert g.

Loads. A and b tiles come through host TensorDescriptors: b through a 3-D map over (E, N, K)
(or (E, K, N)) with box [1, BN, BK], so a K tile past K is zero-filled and never reads the next
expert; A through a 2-D map (CONTIGUOUS) or a 3-D map (MASKED / BATCHED). An A tile that starts
inside group g may cover rows of the next group (CONTIGUOUS) or padding rows (MASKED): those
rows only feed output rows of the same tile that are never stored (each output row depends on
its own A row alone), so they cost bandwidth, never correctness. Stores are masked pointer
stores bounded by [start_g, end_g): a TMA store cannot be clipped at a group boundary.

Block-scaled fp8 (1x128 activations x 128x128 weights) steps K by one 128-deep scale block: a
fresh fp32 product per block, scaled and added to the running sum (the fp32 promotion the
recipe needs). Tensor-/row-wise scales multiply the finished accumulator in the epilogue.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .. import device, tma
from ..configs import TritonGemmConfig
from ..grouped import GroupedArgs, GroupLayout, GroupScaling
from ..plan import Plan
from .common import (SCALES_AHEAD_MIN_ROWS, block_scaled_add, chunk_step, first_row_scale_chunks, grouped_tile,
                     let_next_kernel_launch, load_block_scales, load_weight_scales, mma, next_row_scale_chunks,
                     row_scales_in, wait_for_previous_kernel)
from .launch import A, B, BIAS, OUT, PARTIALS, SCALE_A, SCALE_B, KernelCall, aot_spec as _aot_spec, direct_launch, pdl

NAME = "triton.grouped"
SCALE_BLOCK = 128  # the block-scaled recipe's k-block and weight-block edge
# The group counts travel as the seventh per-call operand (the slot split-K uses for its
# partials; a grouped launch has no workspace): launch(a, b, out, scale_a, scale_b, bias, counts).
COUNTS = PARTIALS
_OPERANDS = {"a_desc": A, "b_desc": B, "out_ptr": OUT, "counts_ptr": COUNTS, "scale_a_ptr": SCALE_A,
             "scale_b_ptr": SCALE_B, "bias_ptr": BIAS}


@triton.jit
def _running_max(x, y):
    return tl.maximum(x, y)


@triton.jit
def group_rows(counts_ptr, E, M, E_BLOCK: tl.constexpr, LAYOUT: tl.constexpr):
    """(LAYOUT: GroupLayout, 0 CONTIGUOUS, 1 MASKED, 2 BATCHED.) Row range [starts, ends) of every group as E_BLOCK-lane vectors (lanes past E empty).

    CONTIGUOUS: ends are the running maximum of offs clamped to [0, M] and starts the previous
    end, so groups never overlap, never run backwards and never pass M, whatever offs holds.
    MASKED: rows [0, clamp(masked_m[g], 0, M)) of expert g. BATCHED: all M rows.
    """
    idx = tl.arange(0, E_BLOCK)
    live = idx < E
    if LAYOUT == 0:
        ends = tl.load(counts_ptr + idx, mask=live, other=0)
        ends = tl.associative_scan(tl.minimum(tl.maximum(ends, 0), M), 0, _running_max)
        # The previous group's end: the same running maximum over offs shifted by one.
        starts = tl.load(counts_ptr + idx - 1, mask=live & (idx > 0), other=0)
        starts = tl.associative_scan(tl.minimum(tl.maximum(starts, 0), M), 0, _running_max)
    elif LAYOUT == 1:
        ends = tl.load(counts_ptr + idx, mask=live, other=0)
        ends = tl.minimum(tl.maximum(ends, 0), M)
        starts = tl.zeros_like(ends)
    else:
        ends = tl.where(live, M, 0)
        starts = tl.zeros_like(ends)
    # Padding lanes hold no rows (their scanned starts/ends are not a group's).
    ends = tl.where(live, ends, starts)
    return idx, starts, ends


@triton.jit
def load_a(a_desc, g, off_m, off_k, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, LAYOUT: tl.constexpr):
    """[BM, BK] tile of A: rows of the 2-D (M_total, K) map, or of expert g's (max_m, K) slice."""
    if LAYOUT == 0:
        tile = a_desc.load([off_m, off_k])
    else:
        tile = a_desc.load([g, off_m, off_k]).reshape(BLOCK_M, BLOCK_K)
    return tile


@triton.jit
def load_b(b_desc, g, off_k, off_n, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, B_K_MAJOR: tl.constexpr):
    """[BK, BN] tile of b[g]. The 3-D map's expert dimension keeps the box inside expert g: a K
    tile past K is zero-filled instead of reading the next expert's weight."""
    if B_K_MAJOR:
        # (E, N, K) weight read K-major and transposed in shared memory (what fp8 wgmma needs).
        tile = b_desc.load([g, off_n, off_k]).reshape(BLOCK_N, BLOCK_K).T
    else:
        tile = b_desc.load([g, off_k, off_n]).reshape(BLOCK_K, BLOCK_N)
    return tile


@triton.jit
def product_operands(a, b, SWAP_AB: tl.constexpr):
    """The two operands of the tile's product: a [BM, BK] @ b [BK, BN], or for the swapped decode
    tiles b^T [BN, BK] @ a^T [BK, BM], the tile of out^T with the weight rows in wgmma's M."""
    if SWAP_AB:
        first, second = b.T, a.T
    else:
        first, second = a, b
    return first, second


# M (M_total, or max_m) changes with every batch: one binary per config. stride_sak equals M
# for an outer-dim-major scale_a.
@triton.jit(do_not_specialize=["M", "stride_sak"])
def grouped_gemm_kernel(
    a_desc, b_desc, out_ptr, counts_ptr, scale_a_ptr, scale_b_ptr, bias_ptr,
    E, M, N, K,
    stride_oe, stride_om, stride_on,
    stride_sae, stride_sam, stride_sak, stride_sbe, stride_sbn, stride_sbk, stride_biase, stride_biasn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr, E_BLOCK: tl.constexpr, LAYOUT: tl.constexpr, B_K_MAJOR: tl.constexpr,
    SCALING: tl.constexpr, B_PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr, FAST_ACCUM: tl.constexpr,
    HAS_K: tl.constexpr, SCALE_A_CHUNKS: tl.constexpr, SWAP_AB: tl.constexpr, PDL: tl.constexpr,
):
    # ---- static checks
    tl.static_assert(SCALING != 2 or BLOCK_K == 128, "block-scaled: BLOCK_K must be the 128-deep scale block")
    tl.static_assert(SCALING != 2 or B_PER_CHANNEL or (128 % BLOCK_N == 0) or (BLOCK_N % 128 == 0),
                     "128x128 weight scales: tiles must not straddle a 128-column block")

    # PDL: the counts (and the activation) typically come from the kernel before: wait for it.
    wait_for_previous_kernel(PDL)

    # ---- scheduler: the group table, once per program (one vector load of the counts)
    idx, starts, ends = group_rows(counts_ptr, E, M, E_BLOCK, LAYOUT)
    tiles_n = tl.cdiv(N, BLOCK_N)
    group_tiles = tl.cdiv(ends - starts, BLOCK_M) * tiles_n
    tiles_end = tl.cumsum(group_tiles, 0)  # one past each group's last tile id
    total = tl.sum(group_tiles, 0)

    # Swapped decode tiles: one tile per program (the grid is a bound of the tiles from shapes
    # alone, a run-time value so that no batch size compiles a binary of its own), the last ids
    # first: the programs past the real tile count are then scheduled among the first and leave
    # at once, not after every real tile.
    if SWAP_AB:
        programs = tl.num_programs(0)
        first_id = programs - 1 - tl.program_id(0)
    else:
        programs = NUM_PROGRAMS
        first_id = tl.program_id(0)
    for tile_id in tl.range(first_id, total, programs):
        # Group of this tile: the groups whose tiles all come before it (empty groups included).
        before = tiles_end <= tile_id
        g = tl.sum(before.to(tl.int32), 0)
        first_tile = tl.max(tl.where(before, tiles_end, 0), 0)
        this = idx == g
        row_start = tl.sum(tl.where(this, starts, 0), 0)
        row_end = tl.sum(tl.where(this, ends, 0), 0)
        pid_m, pid_n = grouped_tile(tile_id - first_tile, tl.cdiv(row_end - row_start, BLOCK_M), tiles_n, GROUP_M)
        off_m = row_start + pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        offs_m = off_m + tl.arange(0, BLOCK_M)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        row_ok = offs_m < row_end  # rows of this group only (>= row_start by construction)
        col_ok = offs_n < N
        g64 = g.to(tl.int64)

        # ---- main loop (SWAP_AB: the [BLOCK_N, BLOCK_M] tile of out^T, weight rows in wgmma's M)
        if SWAP_AB:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if HAS_K:
            if SCALING == 2:
                # Block-scaled: a fresh fp32 product per 128-deep k-block, scaled into the sum.
                # Rows outside the group / columns past N read scale 1.0: their products are
                # never stored, and 0 * (inf from garbage) would only make NaN in registers.
                sa_ptrs = scale_a_ptr + g64 * stride_sae + offs_m * stride_sam
                if B_PER_CHANNEL:
                    sb_ptrs = scale_b_ptr + g64 * stride_sbe + offs_n * stride_sbn
                elif BLOCK_N <= 128:
                    sb_ptrs = scale_b_ptr + g64 * stride_sbe + (off_n // 128) * stride_sbn
                else:
                    sb_ptrs = scale_b_ptr + g64 * stride_sbe + (offs_n // 128) * stride_sbn
                k_blocks = tl.cdiv(K, BLOCK_K)
                # common.py says why. SCALE_A_CHUNKS (scale_a contiguous along M): the row scales
                # in chunks of SCALE_CHUNK k-blocks a chunk ahead (common.load_row_scale_chunk),
                # the weight scales a step ahead.
                SCALES_AHEAD: tl.constexpr = BLOCK_M >= SCALES_AHEAD_MIN_ROWS
                if SCALE_A_CHUNKS:
                    sa_chunk, sa_next = first_row_scale_chunks(sa_ptrs, stride_sak, 0, k_blocks, row_ok)
                    sb = load_weight_scales(sb_ptrs, stride_sbk, 0, col_ok, B_PER_CHANNEL, BLOCK_N)
                elif SCALES_AHEAD:
                    sa, sb = load_block_scales(sa_ptrs, sb_ptrs, stride_sak, stride_sbk, 0, row_ok, col_ok,
                                               B_PER_CHANNEL, BLOCK_N)
                for kb in range(k_blocks):
                    a = load_a(a_desc, g, off_m, kb * BLOCK_K, BLOCK_M, BLOCK_K, LAYOUT)
                    b = load_b(b_desc, g, kb * BLOCK_K, off_n, BLOCK_N, BLOCK_K, B_K_MAJOR)
                    x, y = product_operands(a, b, SWAP_AB)
                    partial = tl.dot(x, y)
                    if SCALE_A_CHUNKS:
                        step = chunk_step(kb, 0)
                        sa = row_scales_in(sa_chunk, step)
                    elif not SCALES_AHEAD:
                        sa, sb = load_block_scales(sa_ptrs, sb_ptrs, stride_sak, stride_sbk, kb, row_ok, col_ok,
                                                   B_PER_CHANNEL, BLOCK_N)
                    acc = block_scaled_add(acc, partial, sa, sb, B_PER_CHANNEL, BLOCK_N, SWAP_AB)
                    if SCALE_A_CHUNKS:
                        sb = load_weight_scales(sb_ptrs, stride_sbk, tl.minimum(kb + 1, k_blocks - 1), col_ok,
                                                B_PER_CHANNEL, BLOCK_N)
                        sa_chunk, sa_next = next_row_scale_chunks(sa_chunk, sa_next, step, sa_ptrs, stride_sak, kb,
                                                                  k_blocks, row_ok)
                    elif SCALES_AHEAD:  # the next k-block's (this one's again after the last)
                        sa, sb = load_block_scales(sa_ptrs, sb_ptrs, stride_sak, stride_sbk,
                                                   tl.minimum(kb + 1, k_blocks - 1), row_ok, col_ok, B_PER_CHANNEL,
                                                   BLOCK_N)
            else:
                for k in range(tl.cdiv(K, BLOCK_K)):
                    a = load_a(a_desc, g, off_m, k * BLOCK_K, BLOCK_M, BLOCK_K, LAYOUT)
                    b = load_b(b_desc, g, k * BLOCK_K, off_n, BLOCK_N, BLOCK_K, B_K_MAJOR)
                    x, y = product_operands(a, b, SWAP_AB)
                    acc = mma(x, y, acc, FAST_ACCUM, BLOCK_K)

        if SWAP_AB:
            acc = acc.T  # the [BM, BN] tile from here on
        if SCALING == 1:
            # Tensor- and row-wise scales through strides (0 along a broadcast axis; SCALING is
            # NONE without K).
            sa = tl.load(scale_a_ptr + g64 * stride_sae + offs_m * stride_sam, mask=row_ok, other=0.0)
            sb = tl.load(scale_b_ptr + g64 * stride_sbe + offs_n * stride_sbn, mask=col_ok, other=0.0)
            acc = acc * sa[:, None] * sb[None, :]

        if tile_id + programs >= total:  # PDL: this program's last main loop is done
            let_next_kernel_launch(PDL)

        # ---- epilogue: bias in fp32, one rounding, stores clipped to this group's rows
        if HAS_BIAS:
            bias = tl.load(bias_ptr + g64 * stride_biase + offs_n * stride_biasn, mask=col_ok, other=0.0)
            acc = acc + bias.to(tl.float32)[None, :]
        ptrs = (out_ptr + g64 * stride_oe + offs_m[:, None].to(tl.int64) * stride_om
                + offs_n[None, :].to(tl.int64) * stride_on)
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def zero_uncovered_rows_kernel(out_ptr, counts_ptr, E, M, N, stride_oe, stride_om, stride_on,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, E_BLOCK: tl.constexpr,
                               LAYOUT: tl.constexpr, PDL: tl.constexpr):
    """Zeros in the rows of ``out`` that no group covers (by :func:`group_rows`' rule): past the
    last group's end (CONTIGUOUS, one program per BLOCK_M rows), past expert program_id(1)'s count
    (MASKED). A program whose rows are all covered stores nothing."""
    wait_for_previous_kernel(PDL)  # the counts, and the rows the GEMM before wrote
    e = tl.program_id(1)
    if LAYOUT == 0:
        _, _, ends = group_rows(counts_ptr, E, M, E_BLOCK, 0)
        first_free = tl.max(ends, 0)
    else:
        first_free = tl.minimum(tl.maximum(tl.load(counts_ptr + e), 0), M)
    let_next_kernel_launch(PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    if tl.program_id(0) * BLOCK_M + BLOCK_M > first_free:
        free = (rows >= first_free) & (rows < M)
        base = out_ptr + e.to(tl.int64) * stride_oe + rows[:, None].to(tl.int64) * stride_om
        for n0 in range(0, N, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            tl.store(base + cols[None, :].to(tl.int64) * stride_on,
                     tl.zeros((BLOCK_M, BLOCK_N), dtype=out_ptr.dtype.element_ty),
                     mask=free[:, None] & (cols[None, :] < N))


ZERO_ROWS_NAME = "triton.grouped_zero_rows"


def zero_rows_plan(out: torch.Tensor, counts: torch.Tensor, layout: GroupLayout) -> Plan:
    """A plan writing zeros into the rows of a grouped GEMM's ``out`` ((M_total, N) CONTIGUOUS
    or (E, max_m, N) MASKED, not empty) that no group covers, reading the counts on the device
    (no host sync): what a gradient needs there, at the cost of those rows alone rather than of
    zero-filling ``out``. Its launch takes the grouped plans' seven operands: ``launch(None,
    None, out, None, None, None, counts)``."""
    e = counts.shape[0]
    m, n = out.shape[-2], out.shape[-1]
    stride_oe, (stride_om, stride_on) = (0 if out.dim() == 2 else out.stride(0)), out.stride()[-2:]
    block_m = 16
    values = dict(out_ptr=out, counts_ptr=counts, E=e, M=m, N=n, stride_oe=stride_oe, stride_om=stride_om,
                  stride_on=stride_on, BLOCK_M=block_m, BLOCK_N=128, E_BLOCK=triton.next_power_of_2(max(e, 1)),
                  LAYOUT=int(layout), PDL=pdl(out))
    grid = (triton.cdiv(m, block_m), e if layout == GroupLayout.MASKED else 1)
    call = KernelCall(zero_uncovered_rows_kernel, grid, values, dict(num_warps=4),
                      {"out_ptr": OUT, "counts_ptr": COUNTS})
    fast = direct_launch(ZERO_ROWS_NAME, call)
    if fast is not None:
        return Plan(ZERO_ROWS_NAME, None, fast, fast.device_index, direct=True)

    def launch(a, b, out_, scale_a, scale_b, bias, counts_) -> None:
        replace(call, args={**call.args, "out_ptr": out_, "counts_ptr": counts_}).launch()

    return Plan(ZERO_ROWS_NAME, None, launch, out.get_device())


# ------------------------------------------------------------------------------------- configs


def is_valid(config: TritonGemmConfig, args: GroupedArgs) -> bool:
    """The family's config rule: the TMA GEMM rule (powers of two, TMA box, shared memory), boxes
    of at most 256 per dimension, and for block scales a K step of one 128-deep block with tiles
    that do not straddle a 128-column weight block. Swapped decode tiles (``swap_ab``): at least
    64 weight rows (wgmma's M) and at most 64 rows of A (its N slot), one tile per program (so no
    ``programs_per_sm``)."""
    item = args.a.element_size()
    if max(config.block_m, config.block_n, config.block_k) > 256:
        return False
    if config.swap_ab and not (config.block_n >= 64 and config.block_m <= 64 and config.programs_per_sm == 1):
        return False
    if not config.is_valid(item, item, args.out.element_size()):
        return False
    if args.scaling == GroupScaling.BLOCK:
        if config.block_k != SCALE_BLOCK:
            return False
        bn = config.block_n
        return args.b_per_channel or 128 % bn == 0 or bn % 128 == 0
    return True


def _config(bm, bn, bk, stages, warps) -> TritonGemmConfig:
    return TritonGemmConfig(block_m=bm, block_n=bn, block_k=bk, group_m=8, num_stages=stages, num_warps=warps)


# 128 x 256 tiles only where the experts' columns give every SM at least this many of them at one
# row of tiles per group; below that (few experts, narrow outputs: Mixtral's down projection,
# 8 x 16 wide tiles for 132 SMs) 64 x 128 tiles keep the SMs busy. H100, moe preset cases with
# Zipf routing (BENCHMARKS.md): Mixtral down, masked, max_m 189: 64 x 128 187 us (fp8) / 379 us
# (bf16) where 128 x 256 took 240 / 458.
WIDE_MIN_TILES_PER_SM = 2
# Decode-sized groups read their weights through 64 x 256 tiles: half the tiles of 64 x 128 ones,
# each streaming twice the columns (moe preset, H100, two rounds: bf16 1.012x geomean over the 64
# rows at 1 and 16 tokens per expert, none below 0.99x).
DECODE_ROWS = 16
# Their ring: 4 stages (160 KB), on GPUs with slow memory (an H100) SLOW_MEMORY_WIDE_STAGES. Every
# 64 x 256 case of the moe preset's models at 8 and 16 rows per expert (one call per graph, L2
# flushed, 4 rounds; BENCHMARKS.md): on an H100 3 stages ran bf16 1.016-1.044x per projection
# (every one of the 36 cases faster), fp8 (Mixtral down) 1.011x; three programs of 4 stages per SM
# 1.000-1.010x, so fewer bytes in flight per SM, not more programs, is what gains (as for the
# decode kernel's rules on slow memory, cuda/decode.py). On an H200 3 stages ran 0.991x.
SLOW_MEMORY_WIDE_STAGES = 3
# Groups known to be small take swapped tiles: DECODE_WEIGHT_ROWS rows of the expert's weight fill
# wgmma's M and DECODE_TOKENS rows of A its N slot, one tile per program. Known small: masked or
# batched groups of at most DECODE_ROWS rows (max_m bounds every group), contiguous ones of at
# most DECODE_MEAN_ROWS rows on average (top-k routed decode: a few rows per expert). A contiguous
# mean of 16 says nothing of the largest group, whose weight a 16-row tile of A reads once per 16
# rows: Zipf-routed groups of 16 rows on average (up to 512) ran 5-10% slower swapped.
# Against the tiles they replace, H100 (BENCHMARKS.md, "Grouped decode tiles with the operands
# swapped"): 8 chained copies with their own weights in one CUDA graph of the expert projections
# of DeepSeek-V3 EP 4, Qwen3-30B-A3B, Qwen3-235B-A22B and Mixtral with 1, 4 and 16 top-k routed
# tokens (fp8 block- and row-scaled) 1.057x in geomean (0.978-1.248x; Qwen3-30B-A3B's down
# projection at 4-16 tokens 1.14-1.17x); the moe preset (one call, L2 flushed) at 1 and 16 tokens
# per expert: bf16 1.02-1.04x per class, fp8 1.00-1.01x.
DECODE_MEAN_ROWS = 4
DECODE_TOKENS = 16  # wgmma's N: the fewest rows a tl.dot takes
DECODE_WEIGHT_ROWS = 128
DECODE_STAGES = 6
# Except long weight streams in fp8 without block scales on GPUs with slow memory
# (``device.slow_memory``: an H100, not an H200): K of at least LONG_STREAM_K and more than
# LONG_STREAM_TILES_PER_SM swapped tiles per SM (their bound from shapes; eight per program at two
# programs per SM). There an H100 streams the weights faster through the persistent 64-row tiles
# (one call per graph, L2 flushed, fp8 row-wise, swapped against 64 x 128 tiles; BENCHMARKS.md,
# "Swapped tiles on long weight streams"): DeepSeek-V3 gate_up (256 experts, K = 7168, 62 tiles
# per SM) 0.974-0.982x, Qwen3-235B-A22B gate_up (K = 4096, 23 per SM) 0.965-0.992x, DeepSeek-V3
# EP 4 gate_up at 16-32 routed tokens (16.5-18.4 per SM) 0.984-0.994x. At fewer tiles per SM the
# swapped tiles led or tied: Mixtral gate_up (K = 4096, 13.6 per SM) at one token per expert
# 1.008-1.029x (0.987-0.994x at 2-16), the same weights at up to 8 per SM 1.016-1.061x; the down
# projections (K <= 2048) 1.004-1.21x at any count. Block-scaled groups keep the swapped tiles (the
# 64-row ones promote per block and lost there), as do 16-bit ones (1.0-1.03x). An H200 ran every
# one of those cases faster swapped (1.02-1.38x, the long fp8 streams 1.02-1.12x) than on the
# 64-row tiles of one program per SM it then had.
LONG_STREAM_K = 4096
LONG_STREAM_TILES_PER_SM = 16
# The 64 x 128 tiles of groups of up to 64 rows (not block-scaled) run STREAM_PROGRAMS_PER_SM
# persistent programs of STREAM_STAGES stages per SM, instead of one program of 5 (fp8) or 4
# (16-bit) stages, for 16-bit operands and, on GPUs without slow memory (an H200), for fp8: a
# 5-stage fp8 program keeps 80 KB of weight in flight, too few bytes for an H200's bandwidth.
# Every 64 x 128 case of the moe preset's models at 8-64 rows per expert (contiguous and masked,
# balanced and Zipf; one call per graph, L2 flushed; BENCHMARKS.md, "Grouped 64-row tiles on an
# H200"): H200 fp8 row-wise 1.076x in geomean (0.983-1.246x; Qwen3-235B-A22B down 1.16-1.25x),
# bf16 1.079x (1.015-1.293x); H100 bf16 1.024x (1.004-1.053x per projection), fp8 0.999x (its
# gate_up projections 0.977-0.998x: one program kept). 2 programs of 4 stages: H200 1.064x /
# 1.070x, H100 0.976x / 1.000x. The 64 x 256 tiles (16-bit groups of up to 16 rows) stay: 0.991x
# on the H200.
# fp8 on slow memory takes them too where a tile's K loop is short, K <= SHORT_K (12 k-blocks of
# 128): there one program fills and drains its pipeline every few k-blocks, and the others stream
# meanwhile. H100, the same cases: Qwen3-235B-A22B down (K = 1536) 1.045-1.050x
# (1.023-1.089x) in two sweeps at 8-64 rows per expert; DeepSeek-V3 down (K = 2048) 0.988-0.996x
# and the gate_up projections (K >= 4096) 0.982-0.997x, which keep one program.
STREAM_STAGES = 3
STREAM_PROGRAMS_PER_SM = 3
SHORT_K = 1536


def long_weight_stream(fp8: bool, block_scaled: bool, k: int, decode_tiles_per_sm: float, slow_memory: bool) -> bool:
    """Whether decode-sized groups stream their weights through the persistent 64-row tiles rather
    than the swapped ones (LONG_STREAM_K says why): fp8 without block scales, K >= LONG_STREAM_K,
    more than LONG_STREAM_TILES_PER_SM swapped tiles per SM (``decode_tiles_per_sm``: their
    :func:`tile_bound` per SM), on a GPU with slow memory."""
    return (slow_memory and fp8 and not block_scaled and k >= LONG_STREAM_K
            and decode_tiles_per_sm > LONG_STREAM_TILES_PER_SM)


def heuristic_for(rows_per_group: int, fp8: bool, block_scaled: bool, contiguous: bool = False,
                  wide_tiles_per_sm: float = float("inf"), long_stream: bool = False,
                  slow_memory: bool = True, short_k: bool = False) -> TritonGemmConfig:
    """A config from shapes alone (pure; nothing timed, nothing synced).

    rows_per_group: CONTIGUOUS M_total / E (the mean), MASKED / BATCHED max_m (the most);
    contiguous: the layout is CONTIGUOUS;
    wide_tiles_per_sm: E * ceil(N / 256) / SMs, the 128 x 256 tiles per SM at one row of tiles
    per group;
    long_stream: :func:`long_weight_stream` of the problem; slow_memory: ``device.slow_memory`` of
    the GPU (an H100; not an H200); short_k: K <= SHORT_K.
    - masked / batched groups of <= DECODE_ROWS rows, contiguous ones of <= DECODE_MEAN_ROWS on
      average: swapped decode tiles (``swap_ab``; DECODE_WEIGHT_ROWS weight rows x DECODE_TOKENS
      rows of A, one tile per program): a 16-row tile of A wastes least on groups of a few rows,
      and its small stages let more programs stream weights at once. Not for long weight streams
      (``long_stream``): those take the rules below.
    - other groups of <= DECODE_ROWS rows, not block-scaled: 64 x 256 tiles for 16-bit operands;
      for fp8 only where those tiles fit in one wave (wide_tiles_per_sm <= 1); with slow memory
      SLOW_MEMORY_WIDE_STAGES stages. There 64 x 128 tiles fill at most two waves, and with
      skewed routing a short second one: Mixtral down (8 experts x 4096 columns) at 1 token per
      expert under Zipf routing, 5 experts with rows, 160 tiles for 132 SMs, ran 1.17x faster on
      the wide tiles (0.89x -> 1.05x torch's grouped op); elsewhere fp8 lost 2-5% on them (H100,
      BENCHMARKS.md).
    - <= 64 rows: 64-row tiles, one warpgroup (wgmma's M is 64, so a 64-row tile wastes least on
      a short group) and 128 columns, deep pipelines: the GEMM streams the weights, and every
      expert's weight is read by its one row of tiles; 16-bit, and fp8 without slow memory or
      with a short K (not block-scaled), in STREAM_PROGRAMS_PER_SM programs of STREAM_STAGES
      stages per SM. Except contiguous 16-bit groups of 33-64 rows on average where 128 x 256
      tiles fill the SMs (WIDE_MIN_TILES_PER_SM): the mean says nothing of the largest group, and
      under skewed routing most rows sit in groups whose weight a 64-row tile reads several times
      (H100, moe preset, 64 rows per expert on average: Zipf-routed DeepSeek-V3, Qwen3-MoE and
      Mixtral gate_up 9-11% faster, balanced groups within 2%; at 1 and 16 rows on average the
      wide tiles were up to 5% slower). With slow memory those groups take 64 x 256 tiles of
      SLOW_MEMORY_WIDE_STAGES stages instead: on an H100 balanced groups of 64 ran 4.6-7.6%
      faster than on 128 x 256 tiles (against torch's grouped op 0.99-1.02x -> 1.04-1.07x),
      Zipf-routed ones 0.7-4.1% slower (still 1.06-1.13x torch); with 4 stages balanced groups
      gained nothing (BENCHMARKS.md, 2026-11-28).
    - <= 128 rows: 128x128 tiles, two warpgroups.
    - more: 128x256 (16-bit, and fp8 with tensor/row scales) where they fill the SMs, else 64 x 128;
      block-scaled stays at 128x128 (its fresh per-block product doubles the accumulator
      registers, as in triton.blockscaled). At 256 rows per group 128x256 was ahead of 128x128
      in 10 of 12 contiguous cases (DeepSeek-V3, Qwen3-MoE, Mixtral projections; all six bf16
      ones, by 4-11%; H100, graph-timed, BENCHMARKS.md).
    """
    bk = SCALE_BLOCK if (fp8 or block_scaled) else 64
    wide_fills = wide_tiles_per_sm >= WIDE_MIN_TILES_PER_SM
    narrow = _config(64, 128, bk, 5 if fp8 else 4, 4)
    wide = _config(128, 256, bk, 3, 8)
    half_wide = _config(64, 256, bk, SLOW_MEMORY_WIDE_STAGES if slow_memory else 4, 4)  # one warpgroup
    if rows_per_group <= (DECODE_MEAN_ROWS if contiguous else DECODE_ROWS) and not long_stream:
        return replace(_config(DECODE_TOKENS, DECODE_WEIGHT_ROWS, bk, DECODE_STAGES, 4), swap_ab=True)
    if rows_per_group <= DECODE_ROWS and not block_scaled and (not fp8 or wide_tiles_per_sm <= 1):
        return half_wide
    if rows_per_group <= 64:
        skewable = contiguous and rows_per_group > 32 and not fp8 and not block_scaled
        if skewable and wide_fills:
            return half_wide if slow_memory else wide
        if block_scaled or (fp8 and slow_memory and not short_k):
            return narrow
        return replace(narrow, num_stages=STREAM_STAGES, programs_per_sm=STREAM_PROGRAMS_PER_SM)
    if rows_per_group <= 128 or block_scaled:
        return _config(128, 128, bk, 4, 8)
    return wide if wide_fills else narrow


def heuristic(args: GroupedArgs) -> TritonGemmConfig:
    contiguous = args.layout == GroupLayout.CONTIGUOUS
    rows = triton.cdiv(args.m, max(args.e, 1)) if contiguous else args.m
    block = args.scaling == GroupScaling.BLOCK
    sms = device.sms_of(args.out.device)
    wide_per_sm = args.e * triton.cdiv(args.n, 256) / sms
    decode_per_sm = tile_bound(args, DECODE_TOKENS, DECODE_WEIGHT_ROWS) / sms
    slow = device.slow_memory(args.out.device)
    long_stream = long_weight_stream(args.is_fp8, block, args.k, decode_per_sm, slow)
    config = heuristic_for(rows, args.is_fp8, block, contiguous, wide_per_sm, long_stream=long_stream,
                           slow_memory=slow, short_k=args.k <= SHORT_K)
    return config.fitted(args.a.element_size(), args.a.element_size(), args.out.element_size())


def tile_bound(args: GroupedArgs, block_m: int, block_n: int) -> int:
    """An upper bound of the tiles any counts can give, from shapes alone (the grid's size)."""
    tiles_n = triton.cdiv(args.n, block_n)
    if args.layout == GroupLayout.CONTIGUOUS:
        # Group g's rows r_g take ceil(r_g / BM) <= (r_g + BM - 1) / BM rows of tiles; summed over
        # at most min(E, M_total) non-empty groups: (M_total + (BM - 1) * min(E, M_total)) / BM.
        return (args.m + (block_m - 1) * min(args.e, args.m)) // block_m * tiles_n
    return args.e * triton.cdiv(args.m, block_m) * tiles_n


# --------------------------------------------------------------------------------- host side


def descriptors(args: GroupedArgs, config: TritonGemmConfig) -> tuple[TensorDescriptor, TensorDescriptor]:
    """Host tensor maps over A and b (the grouped check already refused what TMA cannot read)."""
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    if args.layout == GroupLayout.CONTIGUOUS:
        shape, strides = tma.map_layout(args.a, (0, 1))
        a_desc = TensorDescriptor(args.a, shape, strides, [bm, bk])
    else:
        shape, strides = tma.map_layout(args.a, (0, 1, 2))
        a_desc = TensorDescriptor(args.a, shape, strides, [1, bm, bk])
    if args.b_k_major:
        shape, strides = tma.map_layout(args.b, (0, 2, 1))  # the (E, N, K) weight
        b_desc = TensorDescriptor(args.b, shape, strides, [1, bn, bk])
    else:
        shape, strides = tma.map_layout(args.b, (0, 1, 2))
        b_desc = TensorDescriptor(args.b, shape, strides, [1, bk, bn])
    return a_desc, b_desc


# 1x128 activation scales contiguous along the rows with consecutive k-blocks at least this many
# elements apart load in chunks (scale_a_in_chunks). Measured on an H200 (BENCHMARKS.md), 32
# experts of DeepSeek-V3 / Qwen3-MoE, 4-64 rows each, against row-major scales: contiguous groups
# (k-blocks M_total >= 128 apart) 0.78-0.94x with per-step loads, 0.91-0.95x in chunks; masked
# groups with max_m <= 64 0.91-1.00x per step, 0.93-0.95x in chunks (their few rows of k-blocks
# share cache lines, and a chunk costs each step a select across the chunk's lanes).
CHUNK_MIN_K_STRIDE = 128


def scale_a_in_chunks(args: GroupedArgs) -> bool:
    """Whether the kernel loads 1x128 activation scales in chunks of k-blocks
    (``common.load_row_scale_chunk``): scales contiguous along the rows (PyTorch's outer-dim-major
    and DeepGEMM's layout) over more than one k-block, consecutive k-blocks CHUNK_MIN_K_STRIDE or
    more apart; other layouts keep per-step loads."""
    _, sa_m, sa_k = args.scale_a_strides
    return sa_m == 1 and sa_k >= CHUNK_MIN_K_STRIDE and args.k > SCALE_BLOCK


def kernel_call(args: GroupedArgs, config: TritonGemmConfig, num_sms: int | None = None) -> KernelCall:
    """One launch, every kernel argument named once (direct launch, Triton's launcher, AOT).
    ``num_sms``: the SMs the persistent grid spreads over (default the device's; 4 under the
    interpreter, so the persistent loop runs more than once per program), ``config.programs_per_sm``
    programs each; swapped tiles ignore it (one tile per program)."""
    has_k = args.k > 0
    a_desc, b_desc = descriptors(args, config) if has_k else (None, None)
    scaling = args.scaling if has_k else GroupScaling.NONE  # an empty sum: zeros (+ bias)
    sa_e, sa_m, sa_k = args.scale_a_strides
    sb_e, sb_n, sb_k = args.scale_b_strides
    out = args.out
    if args.layout == GroupLayout.CONTIGUOUS:
        stride_oe, (stride_om, stride_on) = 0, out.stride()
    else:
        stride_oe, stride_om, stride_on = out.stride()
    bias = args.bias
    bias_e, bias_n = bias.stride() if bias is not None else (0, 0)
    bound = tile_bound(args, config.block_m, config.block_n)
    if config.swap_ab:  # one tile per program, the stride read at run time (the kernel says why)
        programs, grid = 1, (max(1, bound),)
    else:
        programs = (num_sms or device.sms_of(out.device, cpu=4)) * config.programs_per_sm
        grid = (max(1, min(programs, bound)),)
    values = dict(
        a_desc=a_desc, b_desc=b_desc, out_ptr=out, counts_ptr=args.counts,
        scale_a_ptr=args.scale_a if scaling else None, scale_b_ptr=args.scale_b if scaling else None,
        bias_ptr=bias, E=args.e, M=args.m, N=args.n, K=args.k,
        stride_oe=stride_oe, stride_om=stride_om, stride_on=stride_on,
        stride_sae=sa_e, stride_sam=sa_m, stride_sak=sa_k, stride_sbe=sb_e, stride_sbn=sb_n, stride_sbk=sb_k,
        stride_biase=bias_e, stride_biasn=bias_n,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        NUM_PROGRAMS=programs, E_BLOCK=triton.next_power_of_2(max(args.e, 1)), LAYOUT=int(args.layout),
        B_K_MAJOR=args.b_k_major, SCALING=int(scaling), B_PER_CHANNEL=args.b_per_channel,
        HAS_BIAS=bias is not None, FAST_ACCUM=args.fast_accum, HAS_K=has_k,
        SCALE_A_CHUNKS=scaling == GroupScaling.BLOCK and scale_a_in_chunks(args), SWAP_AB=config.swap_ab,
        PDL=pdl(out),
    )
    return KernelCall(grouped_gemm_kernel, grid, values,
                      dict(num_warps=config.num_warps, num_stages=config.num_stages), _OPERANDS)


def build(args: GroupedArgs, config: TritonGemmConfig | None = None, num_sms: int | None = None) -> Plan:
    """A plan for every grouped problem with ``args``' signature (shapes, strides, dtypes,
    alignment, layout, scaling). Its launch takes seven operands: ``launch(a, b, out, scale_a,
    scale_b, bias, counts)``. ``config`` overrides the heuristic (tests, benchmarks)."""
    if config is None:
        config = heuristic(args)
    if not is_valid(config, args):
        raise ValueError(f"{NAME}: {config} is not valid for this problem (powers of two, boxes <= 256, "
                         "shared memory; block scales need block_k == 128 and 128-aligned block_n)")
    fast = direct_launch(NAME, kernel_call(args, config, num_sms))
    if fast is not None:
        return Plan(NAME, config, fast, fast.device_index, direct=True)

    def launch(a, b, out, scale_a, scale_b, bias, counts) -> None:
        operands = args._replace(a=a, b=b, out=out, scale_a=scale_a, scale_b=scale_b, bias=bias, counts=counts)
        kernel_call(operands, config, num_sms).launch()

    return Plan(NAME, config, launch, args.out.get_device())


def aot_spec(config: TritonGemmConfig | None = None, a_dtype=None, out_dtype=None):
    """A compilable instance for ``tmagemm inspect``: contiguous layout, fp8 e4m3 with row-wise
    scales (bf16 out) by default, 8 experts of 512 rows, N = 4096, K = 7168 (b K-major)."""
    from ..grouped import example_args
    from . import launch

    if torch.int32 not in launch._TL_NAMES:  # the counts pointer: launch.py must name "*i32"
        raise NotImplementedError(f"{NAME}: tmagemm.triton.launch._TL_NAMES has no entry for int32 pointers")
    args = example_args(a_dtype or torch.float8_e4m3fn, out_dtype or torch.bfloat16)
    return _aot_spec(kernel_call(args, config or heuristic(args), num_sms=132), NAME)
