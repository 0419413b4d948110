"""The token permutation around a Mixture-of-Experts layer's grouped GEMMs, each way in one kernel.

An MoE layer sends token t to ``top_k`` experts: pair p = t * top_k + j. The grouped GEMMs take
the pairs sorted by expert (``order``: row r of the sorted operand is pair ``order[r]``).

* :func:`route_pairs`: ``order`` and the experts' cumulative ends from the router's ids, at
  decode sizes (up to ``ROUTE_MAX_PAIRS`` pairs), where ``torch.sort`` and ``searchsorted``
  take a dozen microseconds over six launches.

* :func:`quantize_pairs`: the fp8 rows of the sorted operand, quantized straight from the tokens
  (row r reads token ``order[r] // top_k``), by the quantizers' own steps (1x128 groups, or one
  scale per row), and ``pos`` (pair -> row), the inverse of ``order``. One launch where a
  quantizer, two gathers and an inverse would take four.
* :func:`combine_pairs`: each token's output, the fp32 sum of its pairs' rows of the down
  projection (in pair order: deterministic), skipping pairs whose row lies past the last group
  (``valid_rows``: ids of no local expert), cast once. One launch where a zero fill of those
  rows, an un-permute, a sum and a cast would take four.

Each keeps one plan per call signature in the plan layer's cache, launched directly (no Triton
launcher on the hot path: a decode step runs them once per MoE layer).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..device import on_device
from ..plan import call_for, tensor_key
from .common import let_next_kernel_launch, wait_for_previous_kernel
from .launch import A, B, OUT, SCALE_A, SCALE_B, KernelCall, pdl, pointer_plan
from .quantize import (SCALE_BLOCK, check_input, fp8_grid, fp8_rows, quantize_row_groups, quantize_whole_rows,
                       rows_per_program)

RECIPES = ("1x128", "row")
ROUTE_NAME, QUANTIZE_NAME, COMBINE_NAME = "triton.moe_route", "triton.moe_quantize_pairs", "triton.moe_combine"
# Pairs up to which route_pairs ranks every pair against every other (O(S^2) comparisons over
# S / 64 programs); larger batches sort (torch.sort), which costs a dozen microseconds and a
# handful of launches at decode sizes.
ROUTE_MAX_PAIRS = 1024
_ROUTE_BLOCK = 64


@triton.jit
def _local_ids(ids_ptr, idx, ok, E):
    """Expert ids at ``idx``, ids outside 0..E-1 (sentinels) as E, lanes past the end as E + 1."""
    ids = tl.load(ids_ptr + idx, mask=ok, other=0).to(tl.int64)
    ids = tl.where((ids >= 0) & (ids < E), ids, E)
    return tl.where(ok, ids, E + 1)


@triton.jit
def _route_pairs_kernel(ids_ptr, order_ptr, offs_ptr, S, E, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program i: the sorted position of pairs i*BLOCK.. (the pairs before them in (expert, pair)
    order, counted over all S) and the cumulative ends of experts i*BLOCK.. (the pairs of an
    expert id at most theirs)."""
    wait_for_previous_kernel(PDL)  # the ids come from the router before
    block = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    p_ok = block < S
    idp = _local_ids(ids_ptr, block, p_ok, E)
    rank = tl.zeros([BLOCK], dtype=tl.int32)
    count = tl.zeros([BLOCK], dtype=tl.int32)
    for q0 in range(0, S, BLOCK):
        q = q0 + tl.arange(0, BLOCK)
        idq = _local_ids(ids_ptr, q, q < S, E)
        before = (idq[None, :] < idp[:, None]) | ((idq[None, :] == idp[:, None]) & (q[None, :] < block[:, None]))
        rank += tl.sum(before.to(tl.int32), axis=1)
        count += tl.sum((idq[None, :] <= block[:, None]).to(tl.int32), axis=1)  # block as expert ids
    let_next_kernel_launch(PDL)
    tl.store(order_ptr + rank, block.to(tl.int64), mask=p_ok)
    tl.store(offs_ptr + block, count, mask=block < E)


def route_pairs(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order, offs)`` of an MoE layer's routing, in one launch: the pairs (p = t * top_k + j of
    ``top_k_index`` (T, top_k)) sorted by expert, stably (``order`` (S,) int64: row r of the
    grouped operand is pair order[r]), and each expert's cumulative end (``offs`` (E,) int32, the
    grouped GEMMs' contiguous layout). Ids outside 0..E-1 (expert-parallel sentinels) sort last
    and fall in no group. What ``torch.sort`` and ``torch.searchsorted`` give, for up to
    ``ROUTE_MAX_PAIRS`` pairs (ValueError beyond)."""
    call = call_for(lambda: (ROUTE_NAME, tensor_key(top_k_index), num_experts),
                    lambda: _RouteCall(top_k_index, num_experts))
    return call(top_k_index)


class _RouteCall:
    """One checked signature of :func:`route_pairs`; its plan takes (ids, offs, order)."""

    def __init__(self, top_k_index: torch.Tensor, num_experts: int):
        fn = "route_pairs"
        if not isinstance(top_k_index, torch.Tensor) or top_k_index.dtype not in (torch.int32, torch.int64) \
                or top_k_index.dim() != 2:
            raise TypeError(f"{fn}: top_k_index must be a 2-D int32/int64 tensor")
        if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts < 1:
            raise ValueError(f"{fn}: num_experts must be a positive int, got {num_experts!r}")
        pairs = top_k_index.numel()
        if pairs > ROUTE_MAX_PAIRS:
            raise ValueError(f"{fn}: {pairs} pairs; it ranks at most {ROUTE_MAX_PAIRS} (sort larger batches)")
        self.pairs, self.experts, self.device = pairs, num_experts, top_k_index.device
        order, offs = self.outputs()
        values = dict(ids_ptr=top_k_index.reshape(-1), order_ptr=order, offs_ptr=offs, S=pairs, E=num_experts,
                      BLOCK=_ROUTE_BLOCK, PDL=pdl(offs))
        call = KernelCall(_route_pairs_kernel, (triton.cdiv(max(pairs, num_experts), _ROUTE_BLOCK),), values,
                          dict(num_warps=4), {"ids_ptr": A, "offs_ptr": B, "order_ptr": OUT})
        with on_device(self.device):
            self.plan = pointer_plan(ROUTE_NAME, call)

    def outputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.empty(self.pairs, dtype=torch.int64, device=self.device),
                torch.empty(self.experts, dtype=torch.int32, device=self.device))

    def __call__(self, top_k_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        order, offs = self.outputs()
        self.plan.run(top_k_index.reshape(-1), offs, order, None, None, None)
        return order, offs


@triton.jit
def _quantize_pairs_kernel(
    x_ptr, order_ptr, q_ptr, s_ptr, pos_ptr,
    S, K, TOP_K, stride_x, stride_q, stride_s, stride_sk,
    FP8_MAX: tl.constexpr, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr, F32_TINY: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PER_GROUP: tl.constexpr, PDL: tl.constexpr,
):
    """PER_GROUP: one program per BLOCK_R sorted rows x one 128-column group; otherwise BLOCK_R
    whole rows, an amax pass and a quantizing pass (from L2). The programs of the first column
    group write ``pos``."""
    wait_for_previous_kernel(PDL)  # x and order come from the kernels before
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < S
    pair = tl.load(order_ptr + rows, mask=row_ok, other=0)
    x_rows = x_ptr + (pair // TOP_K)[:, None].to(tl.int64) * stride_x
    q_rows = q_ptr + rows[:, None].to(tl.int64) * stride_q
    if tl.program_id(1) == 0:
        tl.store(pos_ptr + pair, rows, mask=row_ok)
    if PER_GROUP:
        cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = row_ok[:, None] & (cols[None, :] < K)
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        let_next_kernel_launch(PDL)  # what is left is arithmetic and stores
        q, scale = quantize_row_groups(x, FP8_MAX, MANT_BITS, MIN_EXP, F32_TINY, False)
        tl.store(q_rows + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + rows * stride_s + tl.program_id(1) * stride_sk, scale, mask=row_ok)
    else:
        scale = quantize_whole_rows(x_rows, q_rows, row_ok, K, FP8_MAX, MANT_BITS, MIN_EXP, F32_TINY, BLOCK_R,
                                    BLOCK_K, PDL)
        tl.store(s_ptr + rows * stride_s, scale, mask=row_ok)


def quantize_pairs(x: torch.Tensor, order: torch.Tensor, top_k: int, recipe: str = "1x128",
                   dtype: torch.dtype = torch.float8_e4m3fn):
    """``(q, scale, pos)``: row r of q (S, K) is token ``order[r] // top_k`` of x (T, K)
    quantized as ``quantize_fp8(x, recipe)`` quantizes it ("1x128": scale (S, ceil(K/128)); "row":
    (S, 1), row-major), and ``pos`` (S,) int32 with ``pos[order[r]] = r``.

    x: float16/bfloat16/float32, 2-D, contiguous last dimension. order: (S,) integer, on x's
    device, a permutation of 0..S-1 with S = T * top_k (not checked: a device read). No Inf/NaN
    check (a host sync): a group holding one gets an infinite scale.
    """
    call = call_for(lambda: (QUANTIZE_NAME, tensor_key(x), tensor_key(order), top_k, recipe, dtype),
                    lambda: _QuantizeCall(x, order, top_k, recipe, dtype))
    return call(x, order)


class _QuantizeCall:
    """One checked signature of :func:`quantize_pairs`; its plan takes (x, order, q, scale, pos)."""

    def __init__(self, x, order, top_k, recipe, dtype):
        fn = "quantize_pairs"
        check_input(x, dtype, "x", fn)
        if not isinstance(order, torch.Tensor) or order.dtype not in (torch.int32, torch.int64) or order.dim() != 1:
            raise TypeError(f"{fn}: order must be a 1-D int32/int64 tensor")
        if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
            raise ValueError(f"{fn}: top_k must be a positive int, got {top_k!r}")
        if order.numel() != x.shape[0] * top_k:
            raise ValueError(f"{fn}: order has {order.numel()} pairs; x's {x.shape[0]} tokens x top_k {top_k} make "
                             f"{x.shape[0] * top_k}")
        if order.device != x.device:
            raise ValueError(f"{fn}: order is on {order.device}, x on {x.device}")
        if recipe not in RECIPES:
            raise ValueError(f"{fn}: recipe must be one of {', '.join(repr(r) for r in RECIPES)}, got {recipe!r}")
        pairs, k = order.numel(), x.shape[1]
        per_group = recipe == "1x128"
        self.pairs, self.k, self.dtype, self.device = pairs, k, dtype, x.device
        self.groups = triton.cdiv(k, SCALE_BLOCK) if per_group else 1
        self.plan = None
        if pairs == 0 or k == 0:
            return
        q, scale, pos = self.outputs()
        block_r = rows_per_program(per_group, x.is_cuda)
        values = dict(x_ptr=x, order_ptr=order, q_ptr=q, s_ptr=scale, pos_ptr=pos, S=pairs, K=k, TOP_K=top_k,
                      stride_x=x.stride(0), stride_q=q.stride(0), stride_s=scale.stride(0), stride_sk=scale.stride(1),
                      **fp8_grid(dtype), BLOCK_R=block_r, BLOCK_K=SCALE_BLOCK if per_group else 1024,
                      PER_GROUP=per_group, PDL=pdl(q))
        call = KernelCall(_quantize_pairs_kernel, (triton.cdiv(pairs, block_r), self.groups), values,
                          dict(num_warps=4),
                          {"x_ptr": A, "order_ptr": B, "q_ptr": OUT, "s_ptr": SCALE_A, "pos_ptr": SCALE_B})
        with on_device(self.device):
            self.plan = pointer_plan(QUANTIZE_NAME, call)

    def outputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (fp8_rows(self.pairs, self.k, self.dtype, self.device),
                torch.empty(self.pairs, self.groups, dtype=torch.float32, device=self.device),
                torch.empty(self.pairs, dtype=torch.int32, device=self.device))

    def __call__(self, x, order) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, scale, pos = self.outputs()
        if self.plan is not None:
            self.plan.run(x, order, q, scale, pos, None)
        return q, scale, pos


@triton.jit
def _combine_pairs_kernel(
    y_ptr, pos_ptr, valid_ptr, out_ptr,
    N, stride_y, stride_out,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):
    """One program: token ``program_id(0)``, BLOCK_N columns; its pairs summed in order in fp32."""
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    wait_for_previous_kernel(PDL)  # y comes from the GEMM before
    valid = tl.load(valid_ptr)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        row = tl.load(pos_ptr + token * TOP_K + j)
        # A pair past the last group (no local expert) was never computed: it adds nothing.
        width = tl.where(row < valid, N, 0)
        acc += tl.load(y_ptr + row.to(tl.int64) * stride_y + cols, mask=cols < width, other=0.0).to(tl.float32)
    let_next_kernel_launch(PDL)
    tl.store(out_ptr + token.to(tl.int64) * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < N)


def combine_pairs(y: torch.Tensor, pos: torch.Tensor, valid_rows: torch.Tensor, top_k: int,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``out`` (T, N): ``out[t] = sum_j y[pos[t * top_k + j]]`` in fp32, in j order, over the pairs
    whose row is below ``valid_rows`` (a one-element int32 device tensor: the last group's end),
    cast to ``out_dtype`` (default y's).

    y: (S, N) float16/bfloat16/float32, contiguous last dimension; pos: (S,) int32 on y's device,
    S = T * top_k (its values are not checked: a device read).
    """
    call = call_for(lambda: (COMBINE_NAME, tensor_key(y), tensor_key(pos), tensor_key(valid_rows), top_k, out_dtype),
                    lambda: _CombineCall(y, pos, valid_rows, top_k, out_dtype))
    return call(y, pos, valid_rows)


class _CombineCall:
    """One checked signature of :func:`combine_pairs`; its plan takes (y, pos, out, valid_rows)."""

    def __init__(self, y, pos, valid_rows, top_k, out_dtype):
        fn = "combine_pairs"
        if not isinstance(y, torch.Tensor) or y.dim() != 2 or y.dtype not in (torch.float16, torch.bfloat16,
                                                                              torch.float32):
            raise TypeError(f"{fn}: y must be a 2-D float16/bfloat16/float32 tensor")
        if y.shape[1] > 1 and y.stride(1) != 1:
            raise ValueError(f"{fn}: y needs a contiguous last dimension (stride {tuple(y.stride())})")
        if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
            raise ValueError(f"{fn}: top_k must be a positive int, got {top_k!r}")
        for name, t in (("pos", pos), ("valid_rows", valid_rows)):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.int32:
                raise TypeError(f"{fn}: {name} must be an int32 tensor")
            if t.device != y.device:
                raise ValueError(f"{fn}: {name} is on {t.device}, y on {y.device}")
        if pos.shape != (y.shape[0],) or y.shape[0] % top_k or valid_rows.numel() != 1:
            raise ValueError(f"{fn}: pos {tuple(pos.shape)} and valid_rows {tuple(valid_rows.shape)} must be "
                             f"({y.shape[0]},) and one element, y's rows {y.shape[0]} a multiple of top_k {top_k}")
        self.tokens, self.n = y.shape[0] // top_k, y.shape[1]
        self.dtype, self.device = out_dtype or y.dtype, y.device
        self.plan = None
        if self.tokens == 0 or self.n == 0:
            return
        out = self.output()
        block_n = min(1024, triton.next_power_of_2(self.n))
        values = dict(y_ptr=y, pos_ptr=pos, valid_ptr=valid_rows, out_ptr=out, N=self.n, stride_y=y.stride(0),
                      stride_out=out.stride(0), TOP_K=top_k, BLOCK_N=block_n, PDL=pdl(out))
        call = KernelCall(_combine_pairs_kernel, (self.tokens, triton.cdiv(self.n, block_n)), values,
                          dict(num_warps=4), {"y_ptr": A, "pos_ptr": B, "out_ptr": OUT, "valid_ptr": SCALE_A})
        with on_device(self.device):
            self.plan = pointer_plan(COMBINE_NAME, call)

    def output(self) -> torch.Tensor:
        return torch.empty(self.tokens, self.n, dtype=self.dtype, device=self.device)

    def __call__(self, y, pos, valid_rows) -> torch.Tensor:
        out = self.output()
        if self.plan is not None:
            self.plan.run(y, pos, out, valid_rows, None, None)
        return out
