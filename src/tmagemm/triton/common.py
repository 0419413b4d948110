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
def prefetch_rows_l2(base, row0, rows, stride, col0, cols, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Ask L2 for a ROWS x COLS box of a row-major matrix (rows x cols, row ``stride`` in
    elements), clipped to the matrix: one bulk prefetch per row, no registers, no shared memory.
    The box's rows must start 16-byte aligned (TMA operands do); a row's byte count is rounded
    down to 16, so the hint never reaches past the row."""
    r = tl.minimum(row0 + tl.arange(0, ROWS), rows - 1)
    nbytes = (tl.minimum(cols - col0, COLS) * (base.dtype.element_ty.primitive_bitwidth // 8)) // 16 * 16
    if nbytes > 0:
        ptrs = base + r.to(tl.int64) * stride + col0
        tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; // $0", "=r,l,r",
                                  [ptrs, tl.full([ROWS], nbytes, tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    """Programmatic dependent launch (the kernel was launched with PDL): block until the kernel
    before this one in the stream has finished and its writes are visible, then let the next
    kernel launch (it waits the same way before reading anything this one writes). Every program
    calls this before its first read of an input and its first write of anything, and before it
    can return, so a kernel never finishes ahead of the one it follows."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def prefetch_weight_then_wait(b_ptr, off_n, k0, N, K, lead_b, B_ROW_MAJOR: tl.constexpr, BLOCK_N: tl.constexpr,
                              PREFETCH_K: tl.constexpr, PDL: tl.constexpr):
    """With PDL: start this program's first PREFETCH_K x BLOCK_N box of the weight B (K, N) on its
    way into L2 while the previous kernel still runs, then :func:`wait_for_previous_kernel`.
    Only a hint is issued before the wait: L2 is the GPU's point of coherence, so even a B that
    the previous kernel writes is read correctly (the TMA loads come after the wait).
    B_ROW_MAJOR: B's rows are K (lead_b between them); else B is the K-major w.t() of an (N, K)
    weight, rows of w N. PREFETCH_K = 0: no prefetch (rows not 16-byte aligned)."""
    if PDL and PREFETCH_K > 0:
        if B_ROW_MAJOR:
            prefetch_rows_l2(b_ptr, k0, K, lead_b, off_n, N, PREFETCH_K, BLOCK_N)
        else:
            prefetch_rows_l2(b_ptr, off_n, N, lead_b, k0, K, BLOCK_N, PREFETCH_K)
    wait_for_previous_kernel(PDL)


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
def scale_bias_epilogue(
    acc,
    offs_m,
    offs_n,
    M,
    N,
    scale_a_ptr,
    scale_b_ptr,
    bias_ptr,
    SCALE_A: tl.constexpr,
    SCALE_B: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """acc (fp32, [BM, BN]) -> scale_a * scale_b * acc + bias, still fp32.

    Row-wise scales are masked by M/N so ragged edge tiles never read past the scale vectors.
    """
    if SCALE_A == 1:
        acc = acc * tl.load(scale_a_ptr)
    elif SCALE_A == 2:
        sa = tl.load(scale_a_ptr + offs_m, mask=offs_m < M, other=0.0)
        acc = acc * sa[:, None]
    if SCALE_B == 1:
        acc = acc * tl.load(scale_b_ptr)
    elif SCALE_B == 2:
        sb = tl.load(scale_b_ptr + offs_n, mask=offs_n < N, other=0.0)
        acc = acc * sb[None, :]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
        acc = acc + bias.to(tl.float32)[None, :]
    return acc


@triton.jit
def mma(a, b, acc, FAST_ACCUM: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc += a @ b. Without fast accumulation, fp8 partial sums are promoted to the fp32
    accumulator once per K tile instead of staying in wgmma's reduced-precision adder."""
    if FAST_ACCUM:
        acc = tl.dot(a, b, acc)
    else:
        acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
    return acc


@triton.jit
def block_scaled_add(acc, partial, sa_ptrs, sb_ptrs, stride_sak, stride_sbk, kb, row_ok, col_ok,
                     B_PER_CHANNEL: tl.constexpr, BLOCK_N: tl.constexpr, SWAPPED: tl.constexpr):
    """acc += partial * scale_a[rows, kb] * scale_b[kb]: one 128-deep k-block's fresh product
    promoted into the fp32 sum with its block scales. sa_ptrs / sb_ptrs point at k-block 0 of the
    tile's rows / weight block (per column when B_PER_CHANNEL or the tile spans several 128-column
    blocks). SWAPPED: acc and partial are the [BLOCK_N, rows] tile of out^T (swap-AB kernels).
    Masked lanes read 1.0, so rows and columns past the edge cannot turn into NaN."""
    sa = tl.load(sa_ptrs + kb * stride_sak, mask=row_ok, other=1.0)
    if B_PER_CHANNEL or BLOCK_N > 128:
        sb = tl.load(sb_ptrs + kb * stride_sbk, mask=col_ok, other=1.0)
        if SWAPPED:
            acc += partial * sb[:, None] * sa[None, :]
        else:
            acc += partial * sa[:, None] * sb[None, :]
    else:
        sb = tl.load(sb_ptrs + kb * stride_sbk)  # the tile's one weight block
        if SWAPPED:
            acc += partial * (sa * sb)[None, :]
        else:
            acc += partial * (sa * sb)[:, None]
    return acc
