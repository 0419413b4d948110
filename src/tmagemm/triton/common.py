"""Device helpers shared by the Triton GEMM kernels: programmatic dependent launch, tile order,
the mma step and the scale/bias epilogue (SCALE_A / SCALE_B are ``tmagemm.plan.Scaling`` values)."""

from __future__ import annotations

import triton
import triton.language as tl

try:  # grid dependency control (griddepcontrol.*), in triton.language.extra.cuda since Triton 3.5
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAS_GDC = True
except ImportError:  # older Triton: kernels are launched without PDL (launch.pdl says so)
    HAS_GDC = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    """Programmatic dependent launch (the kernel was launched with PDL, so it may start while
    the kernel before it in the stream still runs): block until that kernel has finished and its
    writes are visible. Every program calls this after its setup and before its first read of an
    input or write of anything, and before it can return, so a kernel never finishes ahead of
    the one it follows."""
    if PDL:
        gdc_wait()


@triton.jit
def let_next_kernel_launch(PDL: tl.constexpr):
    """Let the next kernel in the stream launch (it does its setup, then waits for this one as
    above). Called once a program's main loop is done: dependents launched any earlier sit on
    SM resources while this kernel still streams its operands, which measured slower on an H100
    (decode layer stacks: -1.5% fp8, -4% bf16; at the end of the main loop: +2.7% / +1%)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def grouped_tile(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Map a linear tile id to (pid_m, pid_n) in groups of GROUP_M rows of tiles.

    Consecutive programs then share B column panels and A row panels while those are still in L2,
    instead of sweeping a whole row of output tiles and evicting A before it is reused.
    """
    tiles_per_group = GROUP_M * num_pid_n
    group = tile_id // tiles_per_group
    first_m = group * GROUP_M
    group_rows = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile_id % tiles_per_group) % group_rows
    pid_n = (tile_id % tiles_per_group) // group_rows
    return pid_m, pid_n


@triton.jit
def first_row_in_bounds(pid_m, BLOCK_M: tl.constexpr, M, A_ROW_MAJOR: tl.constexpr):
    """First row of row tile ``pid_m``. Where M is ragged and spans at least one tile, the last
    tile starts at M - BLOCK_M, overlapping its neighbour, instead of reaching past M: a TMA box
    that is partly out of bounds loads far slower than one inside (H200, fp8 64-row tiles at
    M = 96: 17-20% slower per GEMM on 4096- to 18944-deep weights). The shared rows are computed
    twice with the same inputs in the same order, so both stores write the same bits. A
    column-major A has M as its contiguous dimension, where TMA box starts must be 16-byte
    aligned: there the start is rounded up to 16 rows (at most 15 rows past M). Below one tile
    (M < BLOCK_M) the box still reaches past M."""
    ALIGN: tl.constexpr = 1 if A_ROW_MAJOR else 16
    return tl.minimum(pid_m * BLOCK_M, tl.maximum(M - BLOCK_M + ALIGN - 1, 0) // ALIGN * ALIGN)


@triton.jit
def epilogue_operands(offs_m, offs_n, M, N, scale_a_ptr, scale_b_ptr, bias_ptr, SCALE_A: tl.constexpr,
                      SCALE_B: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The scales and bias :func:`scale_bias` applies (placeholders where the kernel has none).

    Kernels with one output tile read them right after the PDL wait, before the main loop, so
    their latency passes under the operand stream instead of adding a round trip to memory to
    the kernel's tail (a decode GEMM's weight stream evicts them from L2); the persistent kernels
    read each tile's with its epilogue. Row-wise scales are masked by M/N so ragged edge tiles
    never read past the scale vectors.
    """
    sa = 1.0
    sb = 1.0
    bias = 0.0
    if SCALE_A == 1:
        sa = tl.load(scale_a_ptr)
    elif SCALE_A == 2:
        sa = tl.load(scale_a_ptr + offs_m, mask=offs_m < M, other=0.0)
    if SCALE_B == 1:
        sb = tl.load(scale_b_ptr)
    elif SCALE_B == 2:
        sb = tl.load(scale_b_ptr + offs_n, mask=offs_n < N, other=0.0)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
    return sa, sb, bias


@triton.jit
def scale_bias(acc, sa, sb, bias, SCALE_A: tl.constexpr, SCALE_B: tl.constexpr, HAS_BIAS: tl.constexpr):
    """acc (fp32, [BM, BN]) -> scale_a * scale_b * acc + bias, still fp32 (:func:`epilogue_operands`)."""
    if SCALE_A == 1:
        acc = acc * sa
    elif SCALE_A == 2:
        acc = acc * sa[:, None]
    if SCALE_B == 1:
        acc = acc * sb
    elif SCALE_B == 2:
        acc = acc * sb[None, :]
    if HAS_BIAS:
        acc = acc + bias[None, :]
    return acc


@triton.jit
def mma(a, b, acc, FAST_ACCUM: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc += a @ b. Without fast accumulation, fp8 partial sums are promoted to the fp32
    accumulator every 128 K elements (once per K tile up to 128 deep) instead of staying in
    wgmma's reduced-precision adder: cuBLAS's promotion interval. Promoting once per 256-deep
    tile measured 1.66x cuBLAS's error (H100, fp32 out, K = 4112-14336)."""
    if FAST_ACCUM:
        acc = tl.dot(a, b, acc)
    elif BLOCK_K > 128:
        acc = tl.dot(a, b, acc, max_num_imprecise_acc=128)
    else:
        acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
    return acc


# Token rows per tile from which the block-scaled kernels load a k-block's scales at the end of
# the step before (the loop carries them) rather than in their own step, where the load puts a
# memory round trip between the TMA wait and the wgmma of every step. Loaded a step ahead, the
# decode preset's block-scaled layer stacks ran 1-3% faster at M = 32, 64 and 128 (H100; one of
# four stacks 0.5% slower at M = 32). On 16-row tiles (M <= 16) the early load measured 1-3%
# slower; there two consecutive k-blocks' scales share a cache line, so the in-step load often
# hits L1 (a likely reason, not pinned down).
SCALES_AHEAD_MIN_ROWS = tl.constexpr(32)


@triton.jit
def load_block_scales(sa_ptrs, sb_ptrs, stride_sak, stride_sbk, kb, row_ok, col_ok, B_PER_CHANNEL: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    """(scale_a[rows, kb], scale_b[kb]): k-block kb's 1x128 activation scales and its weight
    scale, one per column when B_PER_CHANNEL or the tile spans several 128-column blocks, else
    the tile's one weight block. sa_ptrs / sb_ptrs point at k-block 0 of the tile's rows / weight
    block. Masked lanes read 1.0, so rows and columns past the edge cannot turn into NaN."""
    sa = tl.load(sa_ptrs + kb * stride_sak, mask=row_ok, other=1.0)
    return sa, load_weight_scales(sb_ptrs, stride_sbk, kb, col_ok, B_PER_CHANNEL, BLOCK_N)


@triton.jit
def load_weight_scales(sb_ptrs, stride_sbk, kb, col_ok, B_PER_CHANNEL: tl.constexpr, BLOCK_N: tl.constexpr):
    """k-block kb's weight scale(s) of :func:`load_block_scales` alone (for kernels that load the
    activation scales in chunks: :func:`load_row_scale_chunk`)."""
    if B_PER_CHANNEL or BLOCK_N > 128:
        return tl.load(sb_ptrs + kb * stride_sbk, mask=col_ok, other=1.0)
    return tl.load(sb_ptrs + kb * stride_sbk)


# k-blocks per load of 1x128 activation scales contiguous along M (PyTorch's outer-dim-major and
# DeepGEMM's layout), see load_row_scale_chunk.
SCALE_CHUNK = tl.constexpr(8)


@triton.jit
def load_row_scale_chunk(sa_ptrs, stride_sak, kb, k_end, row_ok):
    """a's 1x128 scales of k-blocks [kb, kb + SCALE_CHUNK) (those before ``k_end``) for the
    tile's rows, [rows, SCALE_CHUNK]; masked entries read 1.0 as in :func:`load_block_scales`.

    For scales contiguous along M, where one k-block's scales of the tile's rows are one short
    run and the next k-block's lie M floats further: a per-step load is an L2 round trip in
    every step (0.88-0.91x of row-major scales at M <= 128, where the rows' consecutive
    k-blocks share a sector and 7 of 8 per-step loads hit L1). The kernels load a chunk of
    k-blocks a chunk ahead of its use and pick each step's column (:func:`row_scales_in`)."""
    ks = kb + tl.arange(0, SCALE_CHUNK)
    return tl.load(sa_ptrs[:, None] + ks[None, :] * stride_sak, mask=row_ok[:, None] & (ks[None, :] < k_end),
                   other=1.0)


@triton.jit
def first_row_scale_chunks(sa_ptrs, stride_sak, k_first, k_end, row_ok):
    """The chunks a loop starting at k-block ``k_first`` begins with: its first and the next."""
    return (load_row_scale_chunk(sa_ptrs, stride_sak, k_first, k_end, row_ok),
            load_row_scale_chunk(sa_ptrs, stride_sak, k_first + SCALE_CHUNK, k_end, row_ok))


@triton.jit
def next_row_scale_chunks(chunk, ahead, step, sa_ptrs, stride_sak, kb, k_end, row_ok):
    """The chunks after k-block ``kb`` (column ``step`` of ``chunk``): unchanged within a chunk; past
    its last column the chunk ahead, already loaded, and a load of the one after it."""
    if step == SCALE_CHUNK - 1:
        chunk = ahead
        ahead = load_row_scale_chunk(sa_ptrs, stride_sak, kb + 1 + SCALE_CHUNK, k_end, row_ok)
    return chunk, ahead


@triton.jit
def chunk_step(kb, k_first):
    """k-block kb's column in its chunk, the chunks counted from k-block k_first (>= 0 apart)."""
    j = kb - k_first
    return j - j // SCALE_CHUNK * SCALE_CHUNK  # the interpreter's ints take no % of a constexpr


@triton.jit
def row_scales_in(chunk, j):
    """Column ``j`` of a :func:`load_row_scale_chunk` chunk: one k-block's row scales."""
    return tl.sum(tl.where(tl.arange(0, SCALE_CHUNK)[None, :] == j, chunk, 0.0), axis=1)


@triton.jit
def block_scaled_add(acc, partial, sa, sb, B_PER_CHANNEL: tl.constexpr, BLOCK_N: tl.constexpr,
                     SWAPPED: tl.constexpr):
    """acc += partial * scale_a[rows, kb] * scale_b[kb]: one 128-deep k-block's fresh product
    promoted into the fp32 sum with the scales :func:`load_block_scales` returned for it.
    SWAPPED: acc and partial are the [BLOCK_N, rows] tile of out^T (swap-AB kernels)."""
    if B_PER_CHANNEL or BLOCK_N > 128:
        if SWAPPED:
            acc += partial * sb[:, None] * sa[None, :]
        else:
            acc += partial * sa[:, None] * sb[None, :]
    else:
        if SWAPPED:
            acc += partial * (sa * sb)[None, :]
        else:
            acc += partial * (sa * sb)[:, None]
    return acc
