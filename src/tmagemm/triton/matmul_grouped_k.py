"""Grouped GEMM over the reduction dimension: the weight gradient of a Mixture-of-Experts layer.

    out[g] = a[:, K_g] @ b[K_g, :]        a (M, K_total), b (K_total, N), out (E, M, N)

``torch._grouped_mm``'s 2-D x 2-D form: the groups split the shared dimension, so each expert's
(M, N) block sums over its own rows of K_total only. In a backward pass a is ``x.t()`` (the
layer input, tokens sorted by expert) and b the output gradient: out[g] is expert g's weight
gradient ``x[rows_g]^T @ dy[rows_g]``.

Groups (``tmagemm.grouped.GroupLayout``): CONTIGUOUS, ``offs`` (E,) the cumulative group ends on
K_total, clamped by the same rule as the row groups of the other grouped GEMMs (a running
maximum in [0, K_total]: ``matmul_grouped.group_rows``); MASKED, K_total = E x ``rows`` with
group g the first clamp(counts[g], 0, rows) of its ``rows`` (the masked layout's (E, max_m, .)
operands seen as 2-D); BATCHED, every one of each group's ``rows``. An empty group's block is
zeros (nothing to sum), as the gradient of an expert that received no token.

One persistent program per SM walks the work items, (group, output tile) pairs with the groups
of most rows first: every program sorts the counts itself (the grid is sized from shapes alone),
so the longest groups' tiles start in the first rounds and a Zipf-routed expert holding most of
the tokens does not run alone at the end. A tile's store is asynchronous (TMA): it drains while
the program's next tile loads, which matters where groups are short and a 128 x 256 store
weighs as much as the tile's K loop.

Group edges (no value of another group may reach a result, not even an Inf or NaN through a
zero of the other operand):
- The usual weight-gradient layout (a = ``x.t()``, contiguous along M; b contiguous along N): a
  group of at least BLOCK_K rows runs whole steps from its first row, and the rows left over
  run as one more step on the box that ends at its last row. That box lies inside the group, so
  it only needs a's rows the steps before counted zeroed (in registers), and b's box goes to the
  tensor cores as TMA loaded it (a step masking both operands in registers ran the Zipf-routed
  weight gradients 0-8% slower; H200, BENCHMARKS.md). Only a group's own Inf in b can then meet
  a zero of a there: that output column is NaN where float64 has an Inf.
- A group of fewer rows than a step, or an operand contiguous along K_total: every step starts
  inside or on the aligned row at or below the group (a box must start on 16 bytes along a
  contiguous dimension), and a step that reaches past either edge zeroes the other groups'
  rows in both operands, in registers.

a may be contiguous along K_total (a row-major (M, K_total) matrix) or along M (``x.t()``), b
along N or along K_total: the tiles of an operand stored the other way round are read as boxes
of its transpose and transposed in shared memory, as wgmma reads them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .. import device, tma
from ..configs import TritonGemmConfig
from ..grouped import GroupLayout, ReduceArgs
from ..plan import Plan
from .common import grouped_tile, let_next_kernel_launch, wait_for_previous_kernel
from .launch import A, B, OUT, PARTIALS, KernelCall, aot_spec as _aot_spec, direct_launch, pdl
from .matmul_grouped import group_rows

NAME = "triton.grouped_k"
# The launch takes the grouped plans' seven operands (a, b, out, scale_a, scale_b, bias, counts);
# the counts ride in the slot split-K uses for its partials, as in matmul_grouped.
COUNTS = PARTIALS
_OPERANDS = {"a_desc": A, "b_desc": B, "out_desc": OUT, "out_ptr": OUT, "counts_ptr": COUNTS}


@triton.jit
def _load_a(a_desc, off_m, k, A_K_MAJOR: tl.constexpr):
    """[BM, BK] tile of a at (off_m, k)."""
    if A_K_MAJOR:
        tile = a_desc.load([off_m, k])
    else:  # a contiguous along M (x.t()): a box of the (K_total, M) matrix, transposed
        tile = a_desc.load([k, off_m]).T
    return tile


@triton.jit
def _load_b(b_desc, k, off_n, B_N_MAJOR: tl.constexpr):
    """[BK, BN] tile of b at (k, off_n)."""
    if B_N_MAJOR:
        tile = b_desc.load([k, off_n])
    else:  # b contiguous along K_total: a box of the (N, K_total) matrix, transposed
        tile = b_desc.load([off_n, k]).T
    return tile


@triton.jit
def _masked_step(acc, a_desc, b_desc, off_m, off_n, k, lo, hi, BLOCK_K: tl.constexpr, A_K_MAJOR: tl.constexpr,
                 B_N_MAJOR: tl.constexpr):
    """acc += the step at k with rows of K_total outside [lo, hi) zeroed in both operands (another
    group's values must not leak, not even an Inf or NaN through a zero of the other operand)."""
    offs_k = k + tl.arange(0, BLOCK_K)
    keep = (offs_k >= lo) & (offs_k < hi)
    a = _load_a(a_desc, off_m, k, A_K_MAJOR)
    b = _load_b(b_desc, k, off_n, B_N_MAJOR)
    a = tl.where(keep[None, :], a, tl.zeros_like(a))
    b = tl.where(keep[:, None], b, tl.zeros_like(b))
    return tl.dot(a, b, acc)


@triton.jit
def _store(acc, out_desc, out_ptr, g, off_m, off_n, M, N, stride_oe, stride_om, stride_on,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA_STORE: tl.constexpr):
    """out[g, off_m:, off_n:] = acc, clipped at M and N: by TMA (a 3-D map over (E, M, N), so a
    tile never spills into the next group's block; the store is asynchronous and drains while
    the program's next tile loads) or by masked pointer stores."""
    if TMA_STORE:
        out_desc.store([g, off_m, off_n], tl.reshape(acc.to(out_desc.dtype), (1, BLOCK_M, BLOCK_N)))
    else:
        offs_m = off_m + tl.arange(0, BLOCK_M)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        ptrs = (out_ptr + g.to(tl.int64) * stride_oe + offs_m[:, None].to(tl.int64) * stride_om
                + offs_n[None, :].to(tl.int64) * stride_on)
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


# K_total changes with every batch: one binary per config.
@triton.jit(do_not_specialize=["K", "ROWS"])
def grouped_k_kernel(
    a_desc, b_desc, out_desc, out_ptr, counts_ptr,
    E, M, N, K, ROWS,
    stride_oe, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    E_BLOCK: tl.constexpr, NUM_PROGRAMS: tl.constexpr, LAYOUT: tl.constexpr, A_K_MAJOR: tl.constexpr,
    B_N_MAJOR: tl.constexpr, ALIGN_K: tl.constexpr, TMA_STORE: tl.constexpr, PDL: tl.constexpr,
):
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = tiles_m * tiles_n
    total = E * per_group
    # Work item i is tile i % per_group of the group ranked i // per_group (longest first). Round r
    # takes items [r * NUM_PROGRAMS, (r + 1) * NUM_PROGRAMS), program p item p of even rounds and
    # item NUM_PROGRAMS - 1 - p of odd ones: the items of a round shrink along it, so the snake
    # evens out each program's sum of K loops where a plain stride would hand program 0 the
    # longest item of every round.
    pid = tl.program_id(0)
    full_rounds = total // NUM_PROGRAMS
    last_slot = tl.where(full_rounds % 2 == 0, pid, NUM_PROGRAMS - 1 - pid)
    my_rounds = full_rounds + (last_slot < total % NUM_PROGRAMS).to(tl.int32)

    # PDL: the counts and both operands typically come from the kernels before.
    wait_for_previous_kernel(PDL)
    idx = tl.arange(0, E_BLOCK)
    if LAYOUT == 0:
        _, starts, ends = group_rows(counts_ptr, E, K, E_BLOCK, 0)
    elif LAYOUT == 1:
        starts = idx * ROWS
        ends = starts + tl.minimum(tl.maximum(tl.load(counts_ptr + idx, mask=idx < E, other=0), 0), ROWS)
    else:
        starts = idx * ROWS
        ends = starts + ROWS
    # Longest group first, sorted once per program (the counts are on the device): the groups with
    # the most rows start in the first rounds and short ones fill the last. Ties keep the group
    # order; lanes past E sort last.
    order = tl.where(idx < E, (ends - starts).to(tl.int64) * E_BLOCK + (E_BLOCK - 1 - idx), -1)
    order = tl.sort(order, descending=True)

    for r in range(my_rounds):
        item = r * NUM_PROGRAMS + tl.where(r % 2 == 0, pid, NUM_PROGRAMS - 1 - pid)
        rank = item // per_group
        pid_m, pid_n = grouped_tile(item % per_group, tiles_m, tiles_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        g = (E_BLOCK - 1 - (tl.sum(tl.where(idx == rank, order, 0), 0) % E_BLOCK)).to(tl.int32)
        start = tl.sum(tl.where(idx == g, starts, 0), 0)
        end = tl.sum(tl.where(idx == g, ends, 0), 0)

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k = start
        if ALIGN_K > 1:
            # An operand contiguous along K_total: a box must start on 16 bytes there, so the first
            # step starts at the aligned row below the group and masks the previous group's rows.
            head = start - start % ALIGN_K
            if head < start:
                acc = _masked_step(acc, a_desc, b_desc, off_m, off_n, head, start, end, BLOCK_K, A_K_MAJOR,
                                   B_N_MAJOR)
                k = tl.minimum(head + BLOCK_K, end)
        full_steps = (end - k) // BLOCK_K
        for i in range(full_steps):
            kk = k + i * BLOCK_K
            acc = tl.dot(_load_a(a_desc, off_m, kk, A_K_MAJOR), _load_b(b_desc, kk, off_n, B_N_MAJOR), acc)
        done = k + full_steps * BLOCK_K
        if done < end:
            if ALIGN_K == 1 and end - start >= BLOCK_K:
                # The leftover rows on the box that ends at the group's last row: it lies inside
                # the group, so only a's rows the steps before counted are zeroed (in registers;
                # b's box goes to the tensor cores as TMA loaded it).
                kk = end - BLOCK_K
                a = _load_a(a_desc, off_m, kk, A_K_MAJOR)
                a = tl.where((kk + tl.arange(0, BLOCK_K))[None, :] >= done, a, tl.zeros_like(a))
                acc = tl.dot(a, _load_b(b_desc, kk, off_n, B_N_MAJOR), acc)
            else:  # a box from `done` reaches past the group's end: both operands masked
                acc = _masked_step(acc, a_desc, b_desc, off_m, off_n, done, done, end, BLOCK_K, A_K_MAJOR,
                                   B_N_MAJOR)
        if r == my_rounds - 1:  # what is left is this program's last store
            let_next_kernel_launch(PDL)
        _store(acc, out_desc, out_ptr, g, off_m, off_n, M, N, stride_oe, stride_om, stride_on, BLOCK_M, BLOCK_N,
               TMA_STORE)


# ------------------------------------------------------------------------------------- configs


def tma_store(args: ReduceArgs) -> bool:
    """Whether the output is written by TMA: a 16-bit (E, M, N) block contiguous along N that a
    tensor map describes (the weight gradients the library allocates are). fp32 or other strides:
    masked pointer stores."""
    return args.out.element_size() == 2 and tma.map_reason(args.out, "out", (0, 1, 2)) is None


def is_valid(config: TritonGemmConfig, args: ReduceArgs) -> bool:
    """Powers of two, boxes within TMA's 256 per dimension, the stages and the store's staging
    tile within shared memory; the tile is stored whole (no epilogue subtiling), one program per SM
    and no swapped tiles (the forward grouped kernel's, :meth:`TritonGemmConfig.grouped_only`)."""
    dims = (config.block_m, config.block_n, config.block_k)
    pow2 = all(d >= 16 and d & (d - 1) == 0 and d <= 256 for d in dims)
    stage = (config.block_m + config.block_n) * config.block_k * args.a.element_size()
    staging = config.block_m * config.block_n * args.out.element_size() if tma_store(args) else 0
    return (pow2 and config.num_stages >= 1 and not config.epilogue_subtile and not config.grouped_only()
            and stage * config.num_stages + staging <= 224 * 1024)


# One persistent program per SM, 128 x 256 output tiles, 64-deep 16-bit steps, 3 stages, two
# warpgroups, the whole tile stored by one asynchronous TMA store. The weight gradients of
# DeepSeek-V3, Qwen3-235B and Mixtral experts (8-32 experts, 512-2048 tokens each, balanced and
# Zipf-routed; graph-timed, BENCHMARKS.md): on an H200 0.99x torch._grouped_mm in geomean where one
# program per tile ran at 0.91x, 4 stages with the store in column halves 0.98x; as one program
# per tile (H100) 128 x 128 x 64 tiles ran at 0.73x, 128 x 128 x 128 at 0.70x.
DEFAULT = TritonGemmConfig(block_m=128, block_n=256, block_k=64, group_m=8, num_stages=3, num_warps=8)


def heuristic(args: ReduceArgs) -> TritonGemmConfig:
    return DEFAULT


def descriptors(args: ReduceArgs, config: TritonGemmConfig):
    """Host tensor maps over a and b, each over the matrix whose rows are contiguous (the grouped
    check refused what TMA cannot read), and over out where it is stored by TMA (else None)."""
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    dims_a, box_a = ((0, 1), [bm, bk]) if args.a_k_major else ((1, 0), [bk, bm])
    dims_b, box_b = ((0, 1), [bk, bn]) if args.b_n_major else ((1, 0), [bn, bk])
    out_desc = None
    if tma_store(args):
        out_desc = TensorDescriptor(args.out, *tma.map_layout(args.out, (0, 1, 2)), [1, bm, bn])
    return (TensorDescriptor(args.a, *tma.map_layout(args.a, dims_a), box_a),
            TensorDescriptor(args.b, *tma.map_layout(args.b, dims_b), box_b), out_desc)


def kernel_call(args: ReduceArgs, config: TritonGemmConfig, num_sms: int | None = None) -> KernelCall:
    """One launch: min(SMs, work items) persistent programs (``num_sms`` overrides the device's
    SMs; under the interpreter 4, so each program walks several items)."""
    a_desc, b_desc, out_desc = descriptors(args, config)
    tiles = triton.cdiv(args.m, config.block_m) * triton.cdiv(args.n, config.block_n)
    programs = min(num_sms or device.sms_of(args.out.device, cpu=4), args.e * tiles)
    stride_oe, stride_om, stride_on = args.out.stride()
    values = dict(
        a_desc=a_desc, b_desc=b_desc, out_desc=out_desc, out_ptr=args.out, counts_ptr=args.counts,
        E=args.e, M=args.m, N=args.n, K=args.k, ROWS=args.rows,
        stride_oe=stride_oe, stride_om=stride_om, stride_on=stride_on,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        E_BLOCK=triton.next_power_of_2(max(args.e, 1)), NUM_PROGRAMS=programs, LAYOUT=int(args.layout),
        A_K_MAJOR=args.a_k_major, B_N_MAJOR=args.b_n_major,
        ALIGN_K=16 // args.a.element_size() if args.a_k_major or not args.b_n_major else 1,
        TMA_STORE=out_desc is not None, PDL=pdl(args.out),
    )
    return KernelCall(grouped_k_kernel, (programs,), values,
                      dict(num_warps=config.num_warps, num_stages=config.num_stages), _OPERANDS)


def build(args: ReduceArgs, config: TritonGemmConfig | None = None) -> Plan:
    """A plan for every problem with ``args``' signature (shapes, strides, dtypes, alignment,
    layout). Its launch takes the grouped plans' seven operands: ``launch(a, b, out, None, None,
    None, counts)``. ``config`` overrides the heuristic (tests, benchmarks)."""
    if config is None:
        config = heuristic(args)
    if not is_valid(config, args):
        raise ValueError(f"{NAME}: {config} is not valid (powers of two in 16..256, stages within shared memory, "
                         "no epilogue subtiling)")
    fast = direct_launch(NAME, kernel_call(args, config))
    if fast is not None:
        return Plan(NAME, config, fast, fast.device_index, direct=True)

    def launch(a, b, out, scale_a, scale_b, bias, counts) -> None:
        kernel_call(args._replace(a=a, b=b, out=out, counts=counts), config).launch()

    return Plan(NAME, config, launch, args.out.get_device())


def aot_spec(config: TritonGemmConfig | None = None, a_dtype=None, out_dtype=None):
    """A compilable instance for ``tmagemm inspect``: the weight gradient of 8 experts of
    DeepSeek-V3's down projection (a = x.t() of (8 x 512, 2048) inputs, b the (8 x 512, 7168)
    output gradient; bf16 by default)."""
    from ..grouped import reduce_args

    dtype = a_dtype if a_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    e, rows = 8, 512
    x = torch.empty(e * rows, 2048, dtype=dtype)
    dy = torch.empty(e * rows, 7168, dtype=dtype)
    offs = torch.arange(1, e + 1, dtype=torch.int32) * rows
    args = reduce_args(x.t(), dy, offs, out_dtype or dtype)
    return _aot_spec(kernel_call(args, config or heuristic(args), num_sms=132), NAME)
