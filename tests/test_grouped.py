"""Grouped GEMMs (tmagemm.grouped): contiguous, masked and batched layouts, fp16 and fp8 (row-,
tensor- and block-wise scales), bias, rows that must stay untouched, bad counts, zero sizes and
argument errors, against a per-expert float64 reference.

CPU tests run the Triton kernel under the interpreter with small explicit tiles (so groups span
several tiles and boundaries fall inside tiles) and a persistent width of 4 programs; tests
marked ``gpu`` take the heuristic's configs on larger shapes, capture CUDA graphs and compare
with torch's grouped GEMMs.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import replace

import pytest
import torch
from test_native_gemm import needs_nvrtc

from tmagemm import grouped, plan
from tmagemm.configs import TritonGemmConfig
from tmagemm.cuda import gemm as native_gemm
from tmagemm.cuda import grouped as native
from tmagemm.grouped import GroupLayout, grouped_mm, grouped_scaled_mm
from tmagemm.triton import matmul_grouped_k

FP8 = torch.float8_e4m3fn
DEV = "cuda" if torch.cuda.is_available() else "cpu"
HALF = torch.bfloat16 if DEV == "cuda" else torch.float16  # the interpreter's bf16 tl.dot is wrong
CFG16 = TritonGemmConfig(16, 16, 16, 8, 2, 4)  # 16-bit: tiny tiles, many per group
CFG8 = TritonGemmConfig(16, 16, 32, 8, 2, 4)  # fp8 tensor/row-wise
CFG_BLOCK = TritonGemmConfig(16, 32, 128, 8, 2, 4)  # fp8 block-scaled: one k-step per scale block
SMS = 4  # persistent programs under the interpreter: each walks several tiles
# Relative errors: the interpreter computes fp8 products exactly in fp32; wgmma's fp8 adder keeps
# ~14 mantissa bits within a K tile. Half-precision outputs round each element (bf16 on a GPU).
REL8 = 1e-5 if DEV == "cpu" else 2e-3
REL_HALF_OUT = 2e-3 if DEV == "cpu" else 8e-3


# ---------------------------------------------------------------------------------- reference


def bounds(counts: list[int], layout: GroupLayout, rows: int) -> list[tuple[int, int]]:
    """The documented row rule: contiguous groups end at the running max of offs clamped to
    [0, M_total] and start where the previous one ended; masked counts clamp to [0, max_m]."""
    if layout == GroupLayout.CONTIGUOUS:
        spans, end = [], 0
        for c in counts:
            start, end = end, max(end, min(max(c, 0), rows))
            spans.append((start, end))
        return spans
    return [(0, min(max(c, 0), rows)) for c in counts]


def reference(a_deq, b_deq, counts, layout, bias=None):
    """float64 result with NaN where no group writes, from dequantized operands (a (M, K) or
    (E, max_m, K), b (E, K, N))."""
    e, _, n = b_deq.shape
    rows = a_deq.shape[-2]
    ref = torch.full((*a_deq.shape[:-1], n), float("nan"), dtype=torch.float64)
    counts = [rows] * e if counts is None else counts
    for g, (s, t) in enumerate(bounds(counts, layout, rows)):
        if t <= s:
            continue
        block = (a_deq[s:t] if layout == GroupLayout.CONTIGUOUS else a_deq[g, s:t]) @ b_deq[g]
        if bias is not None:
            block = block + bias[g].double()
        if layout == GroupLayout.CONTIGUOUS:
            ref[s:t] = block
        else:
            ref[g, s:t] = block
    return ref


def check(out: torch.Tensor, ref: torch.Tensor, rel: float, what: str = "") -> None:
    """Written rows match within ``rel`` (relative Frobenius); unwritten rows still hold the NaN
    poison the output was filled with; a failure names the worst element."""
    got = out.double().cpu()
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    written = ~torch.isnan(ref)
    untouched = torch.isnan(got[~written]).all()
    assert untouched, f"{what}: rows no group covers were written at {torch.nonzero(~torch.isnan(got) & ~written)[:5].tolist()}"
    if not written.any():
        return
    g, r = got[written], ref[written]
    assert torch.isfinite(g).all(), f"{what}: rows of a group left unwritten / non-finite: {torch.nonzero(~torch.isfinite(got) & written)[:5].tolist()}"
    err = (g - r).norm() / r.norm().clamp_min(1e-30)
    if err > rel:
        diff = torch.where(written, (got - ref).abs(), torch.zeros_like(got))
        idx = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
        raise AssertionError(f"{what}: relative error {err:.3e} > {rel:.1e}; worst at {idx}: got {got[idx]:.6g}, "
                             f"want {ref[idx]:.6g}")


def poisoned(shape, dtype=torch.float32):
    return torch.full(shape, float("nan"), dtype=dtype, device=DEV)


def counts_tensor(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEV)


def weights(e, k, n, dtype, k_major=True):
    """b (E, K, N): ``w.transpose(1, 2)`` of (E, N, K) weights (K-major) or row-major (N-major)."""
    if k_major:
        return (torch.randn(e, n, k, device=DEV) / 4).to(dtype).transpose(1, 2)
    return (torch.randn(e, k, n, device=DEV) / 4).to(dtype)


def run16(a, b, counts, layout, out, config=CFG16, out_dtype=torch.float32):
    kw = {"offs": counts} if layout == GroupLayout.CONTIGUOUS else {"masked_m": counts}
    if layout == GroupLayout.BATCHED:
        kw = {}
    return grouped.run(grouped.mm_args(a, b, out_dtype=out_dtype, out=out, **kw), config=config, num_sms=SMS)


# ---------------------------------------------------------------------------------- 16-bit


@pytest.mark.parametrize("k_major", [True, False], ids=["b_k_major", "b_n_major"])
@pytest.mark.parametrize("offs", [
    [5, 5, 37, 40],  # empty expert, boundaries inside tiles, rows past offs[-1] untouched
    [0, 0, 45, 45],  # one expert takes every token
    [45, 45, 45, 45],  # first expert takes every token, the rest empty
    [3, 19, 19, 33],
], ids=["ragged", "one_takes_all", "first_takes_all", "mixed"])
def test_contiguous_fp16(offs, k_major, seeded):
    e, m, k, n = 4, 45, 48, 40
    a = torch.randn(m, k, device=DEV).to(HALF)
    b = weights(e, k, n, HALF, k_major)
    out = run16(a, b, counts_tensor(offs), GroupLayout.CONTIGUOUS, poisoned((m, n)))
    check(out, reference(a.double().cpu(), b.double().cpu(), offs, GroupLayout.CONTIGUOUS), 1e-5, f"offs={offs}")


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the NaN rows, in numpy
@pytest.mark.parametrize("k_major", [True, False], ids=["b_k_major", "b_n_major"])
def test_masked_fp16(k_major, seeded):
    e, max_m, k, n = 3, 37, 32, 24
    counts = [0, 37, 17]
    a = torch.randn(e, max_m, k, device=DEV).to(HALF)
    a[0] = float("nan")  # rows past a count are never read into another group's results
    a[2, 17:] = float("inf")
    b = weights(e, k, n, HALF, k_major)
    out = run16(a, b, counts_tensor(counts), GroupLayout.MASKED, poisoned((e, max_m, n)))
    check(out, reference(a.double().cpu(), b.double().cpu(), counts, GroupLayout.MASKED), 1e-5, "masked")


def test_batched_fp16_and_single_expert(seeded):
    a = torch.randn(2, 19, 32, device=DEV).to(HALF)
    b = weights(2, 32, 20, HALF)
    out = run16(a, b, None, GroupLayout.BATCHED, poisoned((2, 19, 20)))
    check(out, reference(a.double().cpu(), b.double().cpu(), None, GroupLayout.BATCHED), 1e-5, "batched")
    # E = 1, contiguous, fp16 output.
    a1 = torch.randn(21, 16, device=DEV).to(HALF)
    b1 = weights(1, 16, 24, HALF)
    out = run16(a1, b1, counts_tensor([21]), GroupLayout.CONTIGUOUS, poisoned((21, 24), HALF), out_dtype=HALF)
    check(out, reference(a1.double().cpu(), b1.double().cpu(), [21], GroupLayout.CONTIGUOUS), REL_HALF_OUT, "E=1")


@pytest.mark.parametrize("offs", [
    [30, 10, 40, 20],  # decreasing: groups 1 and 3 empty
    [10, 80, 90, 100],  # past M_total: group 1 stops at M_total, the rest empty
    [-5, 12, 12, 7],  # negative start clamps to 0
], ids=["decreasing", "past_end", "negative"])
def test_bad_offsets_are_clamped(offs, seeded):
    e, m, k, n = 4, 45, 32, 24
    a = torch.randn(m, k, device=DEV).to(HALF)
    b = weights(e, k, n, HALF)
    out = run16(a, b, counts_tensor(offs), GroupLayout.CONTIGUOUS, poisoned((m, n)))
    check(out, reference(a.double().cpu(), b.double().cpu(), offs, GroupLayout.CONTIGUOUS), 1e-5, f"offs={offs}")


def test_bad_masked_counts_are_clamped(seeded):
    e, max_m, k, n = 3, 20, 32, 24
    counts = [1000, -3, 7]
    a = torch.randn(e, max_m, k, device=DEV).to(HALF)
    b = weights(e, k, n, HALF)
    out = run16(a, b, counts_tensor(counts), GroupLayout.MASKED, poisoned((e, max_m, n)))
    check(out, reference(a.double().cpu(), b.double().cpu(), counts, GroupLayout.MASKED), 1e-5, "masked clamp")


def test_public_api_caches_and_counts_stay_on_device(seeded):
    """Same signature, new counts: the cached plan serves it (no new plan, right rows)."""
    plan.clear_plans()
    e, m, k, n = 3, 40, 32, 24
    a = torch.randn(m, k, device=DEV).to(HALF)
    b = weights(e, k, n, HALF)
    for offs in ([10, 25, 40], [0, 33, 35]):
        out = grouped_mm(a, b, offs=counts_tensor(offs), out=poisoned((m, n), HALF))
        check(out, reference(a.double().cpu(), b.double().cpu(), offs, GroupLayout.CONTIGUOUS), REL_HALF_OUT, f"offs={offs}")
    assert len(grouped.cached_plans()) == 1
    assert grouped.cached_plans()[0].variant == "triton.grouped"
    # Masked layout through the public API with the heuristic config; out allocated.
    a3 = torch.randn(e, 8, k, device=DEV).to(HALF)
    res = grouped_mm(a3, b, masked_m=counts_tensor([8, 0, 5]), out_dtype=torch.float32)
    assert res.shape == (e, 8, n) and res.dtype == torch.float32
    ref = reference(a3.double().cpu(), b.double().cpu(), [8, 0, 5], GroupLayout.MASKED)
    written = ~torch.isnan(ref)
    assert torch.allclose(res.double().cpu()[written], ref[written], rtol=1e-4, atol=1e-4)


def _traced(fn):
    """fn compiled with fullgraph=True, and the FX graphs Dynamo hands the back end, which runs
    them as they are (no compiler back end runs the interpreter's CPU tensors)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    return torch.compile(fn, fullgraph=True, backend=backend), graphs


def test_compile_fullgraph_traces_the_grouped_ops(seeded):
    """torch.compile(fullgraph=True) traces grouped_mm as torch.ops.tmagemm.grouped_mm (and its
    out= form as grouped_mm_out): no graph break, the results of eager calls, new counts served
    by the same graph."""
    torch._dynamo.reset()
    e, m, k, n = 3, 40, 32, 24
    a = torch.randn(m, k, device=DEV).to(HALF)
    b = weights(e, k, n, HALF)
    a3 = torch.randn(e, 8, k, device=DEV).to(HALF)

    def layer(a, b, offs, a3, masked_m, out):
        grouped_mm(a, b, offs=offs, out=out)
        return out.float() * 2, grouped_mm(a3, b, masked_m=masked_m, out_dtype=torch.float32)

    compiled, graphs = _traced(layer)
    for offs, masked in (([10, 25, 40], [8, 0, 5]), ([0, 33, 35], [1, 8, 0])):
        doubled, res = compiled(a, b, counts_tensor(offs), a3, counts_tensor(masked), poisoned((m, n), HALF))
        ref = reference(a.double().cpu(), b.double().cpu(), offs, GroupLayout.CONTIGUOUS) * 2
        check(doubled, ref, REL_HALF_OUT, f"compiled offs={offs}")
        ref = reference(a3.double().cpu(), b.double().cpu(), masked, GroupLayout.MASKED)
        res = torch.where(torch.isnan(ref), float("nan"), res.double().cpu())  # rows no group covers: uninitialised
        check(res, ref, 1e-5, f"compiled masked {masked}")
    assert len(graphs) == 1, f"{len(graphs)} graphs for two sets of counts"
    code = graphs[0].code
    assert "tmagemm.grouped_mm_out" in code and "tmagemm.grouped_mm(" in code
    torch._dynamo.reset()


def test_compile_fullgraph_traces_the_grouped_scaled_ops(seeded):
    """grouped_scaled_mm traces as torch.ops.tmagemm.grouped_scaled_mm (recipes passed as the
    op's strings, torch's ScalingType names accepted) and grouped_scaled_mm_out, with bias."""
    torch._dynamo.reset()
    e, m, k, n = 2, 24, 208, 32  # K: a partial last 128-deep block
    a, b = fp8_operands((m, k), e, k, n)
    kb = -(-k // 128)
    sa = torch.rand(m, kb, device=DEV) + 0.5  # 1x128
    sb = torch.rand(e, n, kb, device=DEV) + 0.5  # 1x128 per output channel
    bias = torch.randn(e, n, device=DEV)
    offs = counts_tensor([10, 24])

    def layer(a, b, sa, sb, offs, bias, out):
        y = grouped_scaled_mm(a, b, sa, sb, offs=offs, bias=bias, out_dtype=torch.float32,
                              scale_recipe_a="BlockWise1x128", scale_recipe_b="1x128")
        grouped_scaled_mm(a, b, sa, sb, offs=offs, out=out, out_dtype=torch.float32, scale_recipe_a="1x128",
                          scale_recipe_b="1x128")
        return y, out

    compiled, graphs = _traced(layer)
    y, out = compiled(a, b, sa, sb, offs, bias, poisoned((m, n)))
    cols = torch.arange(k) // 128
    a_deq = a.double().cpu() * sa.double().cpu()[:, cols]
    b_deq = b.double().cpu() * sb.double().cpu()[:, :, cols].transpose(1, 2)
    check(y, reference(a_deq, b_deq, [10, 24], GroupLayout.CONTIGUOUS, bias.cpu()), REL8, "compiled, bias")  # every row
    check(out, reference(a_deq, b_deq, [10, 24], GroupLayout.CONTIGUOUS), REL8, "compiled, out=")
    code = graphs[0].code
    assert "tmagemm.grouped_scaled_mm(" in code and "tmagemm.grouped_scaled_mm_out" in code
    torch._dynamo.reset()


def test_compile_fails_with_the_eager_message(seeded):
    """A bad argument fails the compile at trace time with the eager check's message (Dynamo
    wraps the TypeError; the message is ours)."""
    torch._dynamo.reset()
    e, m, k, n = 2, 20, 32, 16
    a, b = torch.randn(m, k, device=DEV).to(HALF), weights(e, k, n, HALF)
    compiled = torch.compile(lambda a, b, offs, out: grouped_mm(a, b, offs=offs, out=out), fullgraph=True,
                             backend="aot_eager")
    with pytest.raises(Exception, match="out has dtype torch.float32 but out_dtype is"):
        compiled(a, b, counts_tensor([7, 20]), poisoned((m, n)))
    torch._dynamo.reset()


def test_grouped_ops_called_directly_check_like_the_functions(seeded):
    """The torch ops take the public functions' defaults and raise their errors."""
    e, m, k, n = 2, 20, 32, 16
    a = torch.randn(m, k, device=DEV).to(HALF)
    b = weights(e, k, n, HALF)
    offs = counts_tensor([7, 20])
    out = torch.ops.tmagemm.grouped_mm(a, b, offs)  # offs covers every row: all written
    check(out, reference(a.double().cpu(), b.double().cpu(), [7, 20], GroupLayout.CONTIGUOUS), REL_HALF_OUT, "op")
    assert out.dtype == HALF
    with pytest.raises(ValueError, match="offs must be 1-D with one entry per expert"):
        torch.ops.tmagemm.grouped_mm(a, b, counts_tensor([7, 10, 20]))
    with pytest.raises(TypeError, match="a must be float8_e4m3fn"):
        torch.ops.tmagemm.grouped_scaled_mm(a, b, torch.ones(m), torch.ones(e, n), offs)


# ---------------------------------------------------------------------------------- fp8


def fp8_operands(shape_a, e, k, n):
    a = (torch.randn(*shape_a, device=DEV) * 2).to(FP8)
    w = (torch.randn(e, n, k, device=DEV) * 2).to(FP8)
    return a, w.transpose(1, 2)


@pytest.mark.parametrize("layout", [GroupLayout.CONTIGUOUS, GroupLayout.MASKED], ids=["contiguous", "masked"])
def test_fp8_rowwise_bias(layout, seeded):
    e, rows, k, n = 3, 37, 64, 40
    counts = [9, 9, 30] if layout == GroupLayout.CONTIGUOUS else [9, 0, 37]
    a, b = fp8_operands((rows, k) if layout == GroupLayout.CONTIGUOUS else (e, rows, k), e, k, n)
    sa = torch.rand(a.shape[:-1], device=DEV) + 0.5  # (M_total,) or (E, max_m)
    sb = torch.rand(e, 1, n, device=DEV) + 0.5  # (E, 1, N), torch's rowwise layout
    bias = torch.randn(e, n, device=DEV)
    kw = {"offs": counts_tensor(counts)} if layout == GroupLayout.CONTIGUOUS else {"masked_m": counts_tensor(counts)}
    args = grouped.scaled_mm_args(a, b, sa, sb, bias=bias, out_dtype=torch.float32,
                                  out=poisoned((*a.shape[:-1], n)), **kw)
    out = grouped.run(args, config=CFG8, num_sms=SMS)
    a_deq = a.double().cpu() * sa.double().cpu()[..., None]
    b_deq = b.double().cpu() * sb.double().cpu()
    check(out, reference(a_deq, b_deq, counts, layout, bias.cpu()), REL8, f"fp8 rowwise {layout.name}")


@pytest.mark.anydevice
@pytest.mark.parametrize("layout", [GroupLayout.CONTIGUOUS, GroupLayout.MASKED], ids=["contiguous", "masked"])
@pytest.mark.parametrize("fp8", [False, True], ids=["half", "fp8_rowwise"])
def test_several_programs_per_sm(fp8, layout, seeded):
    """programs_per_sm: the persistent grid is SMs x programs_per_sm programs (2 x 3 here), each
    walking tiles p, p + 6, ...: 18 tiles of ragged groups (70, 0, 1, 129 rows; N = 300 off the
    tile) all written once, matching float64."""
    from tmagemm.triton import matmul_grouped as mg

    e, k, n = 4, 256, 300
    counts = [70, 70, 71, 200] if layout == GroupLayout.CONTIGUOUS else [70, 0, 1, 129]
    rows = 200 if layout == GroupLayout.CONTIGUOUS else 129
    dtype = FP8 if fp8 else HALF
    config = TritonGemmConfig(64, 128, 128 if fp8 else 64, 8, 3, 4, programs_per_sm=3)
    shape_a = (rows, k) if layout == GroupLayout.CONTIGUOUS else (e, rows, k)
    if fp8:
        a, b = fp8_operands(shape_a, e, k, n)
        sa = torch.rand(a.shape[:-1], device=DEV) + 0.5
        sb = torch.rand(e, n, device=DEV) + 0.5
    else:
        a, b = (torch.randn(*shape_a, device=DEV) / 4).to(dtype), weights(e, k, n, dtype)
    kw = {"offs": counts_tensor(counts)} if layout == GroupLayout.CONTIGUOUS else {"masked_m": counts_tensor(counts)}
    out = poisoned((*a.shape[:-1], n))
    if fp8:
        args = grouped.scaled_mm_args(a, b, sa, sb, out_dtype=torch.float32, out=out, **kw)
        a_deq, b_deq = a.double().cpu() * sa.double().cpu()[..., None], b.double().cpu() * sb.double().cpu()[:, None]
    else:
        args = grouped.mm_args(a, b, out_dtype=torch.float32, out=out, **kw)
        a_deq, b_deq = a.double().cpu(), b.double().cpu()
    call = mg.kernel_call(args, config, num_sms=2)
    assert call.grid == (6,)
    assert mg.tile_bound(args, 64, 128) > 6  # programs walk several tiles
    grouped.run(args, config=config, num_sms=2)
    check(out, reference(a_deq, b_deq, counts, layout), REL8 if fp8 else 1e-3, f"{config.label()} {layout.name}")


@pytest.mark.parametrize("layout", [GroupLayout.CONTIGUOUS, GroupLayout.MASKED], ids=["contiguous", "masked"])
@pytest.mark.parametrize("recipe", ["half", "half_n_major", "fp8_rowwise", "fp8_block", "fp8_block_per_channel"])
def test_decode_tiles_from_the_heuristic(recipe, layout, seeded):
    """The swapped tiles the heuristic gives decode-sized groups (weight rows in wgmma's M, 16
    rows of A in its N slot, one tile per program, the last tile ids first) on a ragged problem:
    N off the 128-row weight tile (a box past N), K off the k-block, one-row groups, an empty one,
    a group of 19 rows (two token tiles), a masked count past max_m, rows past the counts untouched; tensor-, row- and
    block-scaled fp8 with a bias, 16-bit weights K- and N-major."""
    from tmagemm.triton import matmul_grouped as mg

    n = 300 if recipe.startswith("fp8") else 296  # an N-major b's rows are whole 16-byte units
    k = 176 if recipe.startswith("fp8") else 96
    # contiguous (3 rows per expert on average): groups of 1, 0, 19, 2 and no rows, rows 22-23 in
    # none; masked: a count past max_m
    if layout == GroupLayout.CONTIGUOUS:
        e, rows, counts = 8, 24, [1, 1, 20, 22, 22, 22, 22, 22]
    else:
        e, rows, counts = 4, 16, [1, 0, 40, 2]
    shape_a = (rows, k) if layout == GroupLayout.CONTIGUOUS else (e, rows, k)
    kw = {"offs" if layout == GroupLayout.CONTIGUOUS else "masked_m": counts_tensor(counts)}
    out = poisoned((*shape_a[:-1], n))
    bias = torch.randn(e, n, device=DEV)
    if recipe.startswith("fp8"):
        a, b = fp8_operands(shape_a, e, k, n)
        kb = -(-k // 128)
        if recipe == "fp8_rowwise":
            sa, sb = torch.rand(shape_a[:-1], device=DEV) + 0.5, torch.rand(e, n, device=DEV) + 0.5
            a_deq = a.double().cpu() * sa.double().cpu()[..., None]
            b_deq = b.double().cpu() * sb.double().cpu()[:, None, :]
        else:
            per_channel = recipe == "fp8_block_per_channel"
            sa = torch.rand(*shape_a[:-1], kb, device=DEV) + 0.5
            sb = torch.rand(e, n if per_channel else -(-n // 128), kb, device=DEV) + 0.5
            a_deq, b_deq = _block_deq(a, b, sa, sb, per_channel)
        args = grouped.scaled_mm_args(a, b, sa, sb, bias=bias, out_dtype=torch.float32, out=out,
                                      use_fast_accum=True, **kw)
    else:
        a = torch.randn(shape_a, device=DEV).to(HALF)
        b = weights(e, k, n, HALF, k_major=recipe == "half")
        args = grouped.mm_args(a, b, out_dtype=torch.float32, out=out, **kw)
        bias = None
        a_deq, b_deq = a.double().cpu(), b.double().cpu()
    config = mg.heuristic(args)  # fitted to shared memory, as the dispatcher takes it
    assert config.swap_ab and (config.block_m, config.block_n) == (mg.DECODE_TOKENS, mg.DECODE_WEIGHT_ROWS)
    out = grouped.run(args, config=config)
    ref = reference(a_deq, b_deq, counts, layout, None if bias is None else bias.cpu())
    check(out, ref, REL8 if recipe.startswith("fp8") else 1e-5, f"decode tiles {recipe}")


def test_tile_bound_holds_for_any_counts():
    """The grid of swapped tiles (one per program) is a bound of the tiles from shapes alone:
    ceil(r / BM) summed over the groups never passes it, for any counts that sum to at most
    M_total, and it is reached (all groups of one row, or one group of every row)."""
    from tmagemm.triton import matmul_grouped as mg

    gen = torch.Generator().manual_seed(3)
    for e, m_total in ((1, 1), (4, 3), (8, 40), (128, 16), (64, 200), (3, 100)):
        a = torch.zeros(m_total, 32, dtype=torch.float16)
        args = grouped.mm_args(a, torch.zeros(e, 32, 16, dtype=torch.float16),
                               offs=torch.full((e,), m_total, dtype=torch.int32))
        for bm in (16, 64):
            bound = mg.tile_bound(args, bm, 16)
            tiles = []
            for _ in range(200):
                cuts = torch.randint(0, m_total + 1, (e - 1,), generator=gen).sort().values.tolist()
                sizes = [hi - lo for lo, hi in zip([0, *cuts], [*cuts, m_total])]
                tiles.append(sum(-(-r // bm) for r in sizes))
            assert max(tiles) <= bound, (e, m_total, bm, max(tiles), bound)
            assert -(-m_total // bm) <= bound  # one group of every row
            if e >= m_total:
                assert bound == m_total  # every group of one row: the bound is reached


def test_fp8_tensorwise_per_expert_fast_accum(seeded):
    e, m, k, n = 2, 30, 96, 24
    a, b = fp8_operands((m, k), e, k, n)
    sa = torch.tensor(0.5, device=DEV)
    sb = torch.tensor([2.0, 0.25], device=DEV)
    args = grouped.scaled_mm_args(a, b, sa, sb, offs=counts_tensor([13, 30]), out_dtype=torch.float32,
                                  out=poisoned((m, n)), use_fast_accum=True)
    out = grouped.run(args, config=CFG8, num_sms=SMS)
    b_deq = b.double().cpu() * sb.double().cpu()[:, None, None]
    check(out, reference(a.double().cpu() * 0.5, b_deq, [13, 30], GroupLayout.CONTIGUOUS), REL8, "tensorwise")
    # Masked layout with a 0-d scale_a (no row dimension to take an expert stride from).
    a3, _ = fp8_operands((e, 9, k), e, k, n)
    args = grouped.scaled_mm_args(a3, b, sa, sb, masked_m=counts_tensor([9, 4]), out_dtype=torch.float32,
                                  out=poisoned((e, 9, n)), use_fast_accum=True)
    out = grouped.run(args, config=CFG8, num_sms=SMS)
    check(out, reference(a3.double().cpu() * 0.5, b_deq, [9, 4], GroupLayout.MASKED), REL8, "tensorwise masked")


def _block_deq(a, b, sa, sb, per_channel=False):
    """Dequantize with 1x128 activation scales and 128x128 (or per-channel 1x128) weight scales."""
    k = a.shape[-1]
    kidx = torch.arange(k) // 128
    a_deq = a.double().cpu() * sa.double().cpu()[..., kidx]
    n = b.shape[2]
    nidx = torch.arange(n) if per_channel else torch.arange(n) // 128
    sbk = sb.double().cpu()[:, nidx][:, :, kidx]  # (E, N, K)
    return a_deq, b.double().cpu() * sbk.transpose(1, 2)


@pytest.mark.parametrize("layout", [GroupLayout.CONTIGUOUS, GroupLayout.MASKED], ids=["contiguous", "masked"])
def test_fp8_blockwise(layout, seeded):
    """1x128 x 128x128, K not a multiple of 128 (the ragged k-block is zero-filled), N past one
    weight block, scales in transposed (outer-dim-major) layouts: read through strides."""
    e, rows, k, n = 3, 26, 176, 150
    kb, nb = 2, 2
    counts = [0, 11, 26] if layout == GroupLayout.CONTIGUOUS else [26, 3, 0]
    a, b = fp8_operands((rows, k) if layout == GroupLayout.CONTIGUOUS else (e, rows, k), e, k, n)
    if layout == GroupLayout.CONTIGUOUS:
        sa = (torch.rand(kb, rows, device=DEV) + 0.5).t()  # (M_total, KB), outer-dim-major
    else:
        sa = torch.rand(e, rows, kb, device=DEV) + 0.5
    sb = (torch.rand(e, kb, nb, device=DEV) + 0.5).transpose(1, 2)  # (E, NB, KB), strided
    bias = torch.randn(e, n, device=DEV).to(torch.bfloat16)
    kw = {"offs": counts_tensor(counts)} if layout == GroupLayout.CONTIGUOUS else {"masked_m": counts_tensor(counts)}
    args = grouped.scaled_mm_args(a, b, sa, sb, bias=bias, out_dtype=torch.float32,
                                  out=poisoned((*a.shape[:-1], n)), **kw)
    assert args.scaling == grouped.GroupScaling.BLOCK and not args.b_per_channel
    out = grouped.run(args, config=CFG_BLOCK, num_sms=SMS)
    a_deq, b_deq = _block_deq(a, b, sa, sb)
    check(out, reference(a_deq, b_deq, counts, layout, bias.cpu()), REL8, f"fp8 block {layout.name}")


@pytest.mark.anydevice
@pytest.mark.parametrize("layout", [GroupLayout.CONTIGUOUS, GroupLayout.MASKED], ids=["contiguous", "masked"])
def test_fp8_block_scales_contiguous_along_rows(layout, seeded):
    """1x128 activation scales contiguous along the rows (torch's outer-dim-major layout for the
    contiguous groups, DeepGEMM's (E, KB, max_m) transposed for masked ones), k-blocks 130 rows
    apart, over 9 k-blocks: the kernel loads them in chunks of 8 k-blocks, the second one partial.
    Row-major scales, and rows of k-blocks closer than CHUNK_MIN_K_STRIDE, keep per-step loads."""
    from tmagemm.triton import matmul_grouped

    e, rows, k, n = 3, 130, 1104, 150
    kb, nb = -(-k // 128), -(-n // 128)
    counts = [0, 11, 26] if layout == GroupLayout.CONTIGUOUS else [26, 3, 0]
    a, b = fp8_operands((rows, k) if layout == GroupLayout.CONTIGUOUS else (e, rows, k), e, k, n)
    if layout == GroupLayout.CONTIGUOUS:
        sa = (torch.rand(kb, rows, device=DEV) + 0.5).t()
    else:
        sa = (torch.rand(e, kb, rows, device=DEV) + 0.5).transpose(1, 2)
    sb = torch.rand(e, nb, kb, device=DEV) + 0.5
    kw = {"offs": counts_tensor(counts)} if layout == GroupLayout.CONTIGUOUS else {"masked_m": counts_tensor(counts)}
    args = grouped.scaled_mm_args(a, b, sa, sb, out_dtype=torch.float32, out=poisoned((*a.shape[:-1], n)), **kw)
    assert matmul_grouped.scale_a_in_chunks(args)
    assert not matmul_grouped.scale_a_in_chunks(grouped.scaled_mm_args(a, b, sa.contiguous(), sb, **kw))
    if layout == GroupLayout.MASKED:  # max_m = 100: k-blocks 100 rows apart
        close = (torch.rand(e, kb, 100, device=DEV) + 0.5).transpose(1, 2)
        assert not matmul_grouped.scale_a_in_chunks(grouped.scaled_mm_args(a[:, :100].contiguous(), b, close, sb, **kw))
    out = grouped.run(args, config=CFG_BLOCK, num_sms=SMS)
    a_deq, b_deq = _block_deq(a, b, sa, sb)
    check(out, reference(a_deq, b_deq, counts, layout), REL8, f"fp8 block, row-contiguous scales, {layout.name}")


def test_fp8_block_wide_tiles_and_mixed_recipes(seeded):
    """Wide tiles (BLOCK_N 256 spans two weight blocks), per-channel 1x128 weight scales, and
    1x128 activations with row-wise weight scales (promoted per k-block all the same)."""
    e, m, k, n = 2, 20, 256, 260
    a, b = fp8_operands((m, k), e, k, n)
    offs = counts_tensor([7, 20])
    sa = torch.rand(m, 2, device=DEV) + 0.5
    wide = TritonGemmConfig(16, 256, 128, 8, 2, 4)
    sb_blocks = torch.rand(e, 3, 2, device=DEV) + 0.5
    out = grouped.run(grouped.scaled_mm_args(a, b, sa, sb_blocks, offs=offs, out_dtype=torch.float32,
                                             out=poisoned((m, n))), config=wide, num_sms=SMS)
    check(out, reference(*_block_deq(a, b, sa, sb_blocks), [7, 20], GroupLayout.CONTIGUOUS), REL8, "wide")
    sb_chan = torch.rand(e, n, 2, device=DEV) + 0.5
    args = grouped.scaled_mm_args(a, b, sa, sb_chan, offs=offs, out_dtype=torch.float32, out=poisoned((m, n)))
    assert args.b_per_channel
    out = grouped.run(args, config=CFG_BLOCK, num_sms=SMS)
    check(out, reference(*_block_deq(a, b, sa, sb_chan, True), [7, 20], GroupLayout.CONTIGUOUS), REL8, "1x128 b")
    sb_row = torch.rand(e, n, device=DEV) + 0.5
    out = grouped.run(grouped.scaled_mm_args(a, b, sa, sb_row, offs=offs, out_dtype=torch.float32,
                                             out=poisoned((m, n))), config=CFG_BLOCK, num_sms=SMS)
    a_deq = a.double().cpu() * sa.double().cpu()[:, torch.arange(k) // 128]
    check(out, reference(a_deq, b.double().cpu() * sb_row.double().cpu()[:, None, :], [7, 20],
                         GroupLayout.CONTIGUOUS), REL8, "1x128 a x row b")


def test_fp8_public_api_default_config(seeded):
    e, m, k, n = 2, 24, 128, 32
    a, b = fp8_operands((m, k), e, k, n)
    sa, sb = torch.rand(m, 1, device=DEV) + 0.5, torch.rand(e, n, device=DEV) + 0.5
    out = grouped_scaled_mm(a, b, sa, sb, offs=counts_tensor([10, 24]), out_dtype=torch.float32)
    ref = reference(a.double().cpu() * sa.double().cpu(), b.double().cpu() * sb.double().cpu()[:, None, :],
                    [10, 24], GroupLayout.CONTIGUOUS)
    check(out, ref, REL8, "fp8 api")


# ---------------------------------------------------------------------------------- zero sizes


def test_zero_sizes(seeded):
    k, n = 32, 24
    # E = 0: nothing to write, no kernel.
    a = torch.randn(5, k, device=DEV).to(HALF)
    res = grouped_mm(a, torch.empty(0, k, n, device=DEV, dtype=HALF), offs=counts_tensor([]))
    assert res.shape == (5, n)
    # M_total = 0 and N = 0.
    b = weights(2, k, n, HALF)
    assert grouped_mm(a[:0], b, offs=counts_tensor([0, 0])).shape == (0, n)
    assert grouped_mm(a, weights(2, k, 0, HALF), offs=counts_tensor([2, 5])).shape == (5, 0)
    assert grouped_mm(torch.empty(2, 0, k, device=DEV, dtype=HALF), b, masked_m=counts_tensor([0, 0])).shape == (2, 0, n)


def test_k_zero_gives_bias_rows(seeded):
    e, m, n = 3, 10, 24
    a = torch.empty(m, 0, device=DEV, dtype=FP8)
    b = torch.empty(e, n, 0, device=DEV, dtype=FP8).transpose(1, 2)
    bias = torch.randn(e, n, device=DEV)
    offs = [2, 2, 7]
    args = grouped.scaled_mm_args(a, b, torch.ones(m, device=DEV), torch.ones(e, n, device=DEV), offs=counts_tensor(offs),
                                  bias=bias, out_dtype=torch.float32, out=poisoned((m, n)))
    out = grouped.run(args, config=CFG8, num_sms=SMS)
    check(out, reference(torch.zeros(m, 0, dtype=torch.float64), torch.zeros(e, 0, n, dtype=torch.float64), offs,
                         GroupLayout.CONTIGUOUS, bias.cpu()), 1e-6, "K=0")
    out = grouped_mm(torch.empty(e, 4, 0, device=DEV, dtype=HALF), torch.empty(e, 0, n, device=DEV, dtype=HALF),
                     masked_m=counts_tensor([4, 0, 2]), out=poisoned((e, 4, n), HALF))
    assert (out[0] == 0).all() and torch.isnan(out[1]).all() and (out[2, :2] == 0).all() and torch.isnan(out[2, 2:]).all()


# ---------------------------------------------------------------------------------- errors


# ------------------------------------------------------------- groups along K; autograd


CFG_K = TritonGemmConfig(16, 16, 16, 8, 2, 4)  # the reduction form: many steps per group
# ... with a 16-bit output stored by TMA: several tiles per group, so each of the interpreter's 4
# persistent programs walks several rounds.
CFG_K_TMA_STORE = TritonGemmConfig(16, 32, 16, 8, 2, 4)


def reduce_reference(a, b, offs):
    """float64 (E, M, N): a[:, K_g] @ b[K_g] over the documented groups (zeros when empty)."""
    a, b = a.double().cpu(), b.double().cpu()
    spans = bounds(offs, GroupLayout.CONTIGUOUS, a.shape[1])
    out = torch.zeros(len(offs), a.shape[0], b.shape[1], dtype=torch.float64)
    for g, (s_, t) in enumerate(spans):
        out[g] = a[:, s_:t] @ b[s_:t]
    return out


@pytest.mark.anydevice
@pytest.mark.parametrize("a_k_major", [True, False], ids=["a_k_major", "a_m_major"])
@pytest.mark.parametrize("b_n_major", [True, False], ids=["b_n_major", "b_k_major"])
# Five groups: the persistent programs' last round is partial (and odd for CFG_K).
@pytest.mark.parametrize("offs", [[13, 13, 50, 77, 91], [0, 96, 96, 96, 96], [40, 30, 200, 7, 60]],
                         ids=["ragged_and_empty", "one_group_takes_all", "decreasing_and_past_end"])
@pytest.mark.parametrize("config, out_dtype", [(CFG_K, torch.float32), (CFG_K_TMA_STORE, HALF)],
                         ids=["fp32_pointer_stores", "half_tma_store"])
def test_groups_along_k(offs, a_k_major, b_n_major, config, out_dtype, seeded):
    """torch._grouped_mm's 2-D x 2-D form: out[g] = a[:, K_g] @ b[K_g] for every layout of a and
    b, groups starting and ending inside steps (and off 16 bytes), empty groups giving zeros,
    bad offsets clamped by the row rule. The rows no group covers hold Inf and NaN, which must
    not reach any result. Both stores: masked pointer stores (fp32) and TMA's, clipped at each
    group's block."""
    m, k, n = (17 if a_k_major else 24), 96, 40  # x.t() (a along M) needs M * 2 bytes on 16
    a = torch.randn(k, m, device=DEV).to(HALF).t() if not a_k_major else torch.randn(m, k, device=DEV).to(HALF)
    b = torch.randn(n, k, device=DEV).to(HALF).t() if not b_n_major else torch.randn(k, n, device=DEV).to(HALF)
    spans = bounds(offs, GroupLayout.CONTIGUOUS, k)
    uncovered = spans[-1][1]
    if uncovered < k:
        a[:, uncovered:] = float("nan")
        b[uncovered:] = float("inf")
    out = poisoned((len(offs), m, n), out_dtype)
    args = grouped.mm_args(a, b, offs=counts_tensor(offs), out_dtype=out_dtype, out=out)
    assert isinstance(args, grouped.ReduceArgs) and (args.a_k_major, args.b_n_major) == (a_k_major, b_n_major)
    assert matmul_grouped_k.tma_store(args) == (out_dtype == HALF)
    grouped.run(args, config=config)
    want = reduce_reference(torch.nan_to_num(a.float(), 0.0, 0.0, 0.0), torch.nan_to_num(b.float(), 0.0, 0.0, 0.0), offs)
    assert torch.isfinite(out).all()
    for g, (s_, t) in enumerate(spans):
        if t == s_:
            assert not out[g].any(), f"empty group {g} is not zeros"
    check(out, want, 1e-5 if out_dtype == torch.float32 else REL_HALF_OUT, f"offs={offs}")
    # The public function (heuristic config) and a 16-bit output.
    got = grouped_mm(a, b, offs=counts_tensor(offs))
    assert got.dtype == HALF and got.shape == (len(offs), m, n)
    check(got, want, REL_HALF_OUT, "public")


@pytest.mark.anydevice
@pytest.mark.parametrize("config, offs", [(CFG_K, [37, 37, 90, 96]), (None, [100, 170, 300, 300])],
                         ids=["16_row_steps", "default_config"])
def test_groups_along_k_keep_other_groups_values_out(config, offs, seeded):
    """x.t() and dy (the weight gradient's layout): a group's leftover rows run on the box ending
    at its last row, so only its own rows are read there. NaN and Inf in one group's rows of both
    operands reach no other group's result."""
    k = offs[-1]
    a = torch.randn(k, 24, device=DEV).to(HALF).t()
    b = torch.randn(k, 40, device=DEV).to(HALF)
    want = reduce_reference(a, b, offs)
    spans = bounds(offs, GroupLayout.CONTIGUOUS, k)
    poisoned_group = 2 if config is CFG_K else 1
    s_, t = spans[poisoned_group]
    a[:, s_:t:3] = float("nan")
    b[s_ + 1:t:3] = float("inf")
    args = grouped.mm_args(a, b, offs=counts_tensor(offs), out=poisoned((len(offs), 24, 40), HALF))
    grouped.run(args, config=config)
    for g in range(len(offs)):
        if g != poisoned_group:
            check(args.out[g], want[g], REL_HALF_OUT, f"group {g}")
            assert torch.isfinite(args.out[g]).all()


def test_groups_along_k_kernel_refuses_configs_it_does_not_run():
    """The Triton reduction kernel stores whole tiles: a subtiled epilogue, tiles off powers of
    two, and stages past shared memory are refused by name."""
    x, dy = torch.empty(64, 32, dtype=torch.float16), torch.empty(64, 48, dtype=torch.float16)
    args = grouped.reduce_args(x.t(), dy, counts_tensor([20, 64]))
    for config in (TritonGemmConfig(16, 32, 16, 8, 2, 4, epilogue_subtile=True), TritonGemmConfig(16, 48, 16, 8, 2, 4),
                   TritonGemmConfig(128, 256, 128, 8, 4, 8)):
        with pytest.raises(ValueError, match="no epilogue subtiling"):
            matmul_grouped_k.build(args, config)


@pytest.mark.anydevice
def test_groups_along_k_zero_sizes_and_one_row(seeded):
    a, b = torch.randn(8, 32, device=DEV).to(HALF), torch.randn(32, 16, device=DEV).to(HALF)
    offs = counts_tensor([10, 32])
    one = grouped_mm(a[:1], b, offs=offs, out_dtype=torch.float32)  # M = 1
    check(one, reduce_reference(a[:1], b, [10, 32]), 1e-5, "M = 1")
    assert not grouped_mm(a[:, :0], b[:0], offs=offs).any()  # K_total = 0: every group empty
    assert grouped_mm(a, b, offs=offs[:0]).shape == (0, 8, 16)
    assert grouped_mm(a[:0], b, offs=offs).shape == (2, 0, 16)


def _grads(a, b, grad, counts, layout):
    """float64 (d a, d b) of the per-group products; rows no group covers get zero gradient."""
    a, b, grad = a.double().cpu(), b.double().cpu(), grad.double().cpu()
    ga, gb = torch.zeros_like(a), torch.zeros_like(b)
    counts = [a.shape[-2]] * b.shape[0] if counts is None else counts
    for g, (s_, t) in enumerate(bounds(counts, layout, a.shape[-2])):
        ag, dg = (a[s_:t], grad[s_:t]) if layout == GroupLayout.CONTIGUOUS else (a[g, s_:t], grad[g, s_:t])
        if layout == GroupLayout.CONTIGUOUS:
            ga[s_:t] = dg @ b[g].t()
        else:
            ga[g, s_:t] = dg @ b[g].t()
        gb[g] = ag.t() @ dg
    return ga, gb


@pytest.mark.anydevice
@pytest.mark.parametrize("layout", list(GroupLayout), ids=lambda x: x.name.lower())
@pytest.mark.parametrize("k_major", [True, False], ids=["b_k_major", "b_n_major"])
def test_autograd_matches_the_reference(layout, k_major, seeded):
    """grouped_mm is differentiable: d a = grad_g @ b[g]^T on each group's rows (zeros on rows
    no group covers), d b[g] = a_g^T @ grad_g (zeros for an empty group), for every layout."""
    e, k, n = 3, 48, 40
    if layout == GroupLayout.CONTIGUOUS:
        counts = [17, 17, 50]
        a = torch.randn(60, k, device=DEV).to(HALF)
        kw = {"offs": counts_tensor(counts)}
    else:
        counts = [5, 0, 20] if layout == GroupLayout.MASKED else None
        a = torch.randn(e, 20, k, device=DEV).to(HALF)
        kw = {"masked_m": counts_tensor(counts)} if counts else {}
    b = weights(e, k, n, HALF, k_major).detach().requires_grad_()
    a.requires_grad_()
    out = grouped_mm(a, b, **kw)
    grad = torch.randn_like(out)
    spans = bounds(counts or [20] * e, layout, a.shape[-2])
    if layout == GroupLayout.CONTIGUOUS:
        grad[spans[-1][1]:] = float("nan")  # rows no group covers: their gradient must not matter
    elif layout == GroupLayout.MASKED:
        for g, (_, t) in enumerate(spans):
            grad[g, t:] = float("nan")
    out.backward(grad)
    ga, gb = _grads(a.detach(), b.detach(), torch.nan_to_num(grad, 0.0), counts, layout)
    assert a.grad.dtype == a.dtype and b.grad.dtype == b.dtype and b.grad.shape == b.shape
    rel = 2e-3 if DEV == "cpu" else 8e-3
    for got, want, name in ((a.grad, ga, "d a"), (b.grad, gb, "d b")):
        assert torch.isfinite(got).all(), name
        err = (got.double().cpu() - want).norm() / want.norm()
        assert err < rel, (name, err.item())
    if layout == GroupLayout.CONTIGUOUS:
        assert not a.grad[spans[-1][1]:].any()
    if layout == GroupLayout.MASKED:
        assert not b.grad[1].any() and not a.grad[0, 5:].any()


@pytest.mark.anydevice
def test_autograd_with_output_rows_off_16_bytes(seeded):
    """N = 12 (24-byte rows): the forward takes it with a K-major b, and the backward pads the
    output gradient's rows for its TMA reads instead of refusing it."""
    e, k, n = 2, 32, 12
    a = torch.randn(30, k, device=DEV).to(HALF).requires_grad_()
    b = weights(e, k, n, HALF).detach().requires_grad_()
    out = grouped_mm(a, b, offs=counts_tensor([11, 30]))
    grad = torch.randn_like(out)
    out.backward(grad)
    ga, gb = _grads(a.detach(), b.detach(), grad, [11, 30], GroupLayout.CONTIGUOUS)
    for got, want, name in ((a.grad, ga, "d a"), (b.grad, gb, "d b")):
        err = (got.double().cpu() - want).norm() / want.norm()
        assert err < (2e-3 if DEV == "cpu" else 8e-3), (name, err.item())


@pytest.mark.anydevice
@pytest.mark.parametrize("layout", list(GroupLayout), ids=lambda x: x.name.lower())
def test_weight_grad_is_planned_once_per_signature(layout, seeded):
    """grouped.weight_grad (the backward's weight gradient) keeps its plan per call signature: a
    second call with new values takes the cached plan and gives its own reference."""
    e, k, n = 3, 32, 24
    counts = [7, 7, 30] if layout == GroupLayout.CONTIGUOUS else [5, 0, 12] if layout == GroupLayout.MASKED else None
    shape = (30,) if layout == GroupLayout.CONTIGUOUS else (e, 12)
    kw = {} if counts is None else {"offs" if layout == GroupLayout.CONTIGUOUS else "masked_m": counts_tensor(counts)}
    plan.clear_plans()
    for _ in range(2):
        a = torch.randn(*shape, k, device=DEV).to(HALF)
        grad = torch.randn(*shape, n, device=DEV).to(HALF)
        got = grouped.weight_grad(a, grad, out_dtype=torch.float32, **kw)
        _, want = _grads(a, torch.zeros(e, k, n, dtype=HALF), grad, counts, layout)
        check(got, want, 1e-5, layout.name)
    # x.t() and grad contiguous along N: the native kernel on a Hopper GPU, the Triton one on the CPU
    assert [p.variant for p in grouped.cached_plans()] == ["cuda.grouped_k" if DEV == "cuda" else "triton.grouped_k"]


def columns_reference(a, b, offs):
    """float64 (M, N_total): out[:, N_g] = a[g] @ b[:, N_g] over the documented groups; NaN in the
    columns no group covers."""
    a, b = a.double().cpu(), b.double().cpu()
    out = torch.full((a.shape[1], b.shape[1]), float("nan"), dtype=torch.float64)
    for g, (s_, t) in enumerate(bounds(offs, GroupLayout.CONTIGUOUS, b.shape[1])):
        out[:, s_:t] = a[g] @ b[:, s_:t]
    return out


@pytest.mark.anydevice
@pytest.mark.parametrize("b_n_major", [True, False], ids=["b_row_major", "b_column_major"])
@pytest.mark.parametrize("m, offs", [(17, [30, 30, 90]), (1, [0, 64, 64]), (24, [50, 20, 200])],
                         ids=["ragged_and_empty", "m1_one_group", "decreasing_and_past_end"])
def test_groups_along_n(m, offs, b_n_major, seeded):
    """torch._grouped_mm's 3-D x 2-D form: out[:, N_g] = a[g] @ b[:, N_g] with b row- or
    column-major, empty groups, bad offsets clamped by the row rule, into a row-major out= (its
    rows copied in), a column-major one and a new one; the columns no group covers keep out's
    values (NaN poison here), and b is not modified."""
    g, k, n_total = len(offs), 32, 96
    a = torch.randn(g, m, k, device=DEV).to(HALF)
    b = torch.randn(k, n_total, device=DEV).to(HALF) if b_n_major else torch.randn(n_total, k, device=DEV).to(HALF).t()
    b_before = b.clone()
    out = poisoned((m, n_total), torch.float32)
    got = grouped_mm(a, b, offs=counts_tensor(offs), out_dtype=torch.float32, out=out)
    assert got.data_ptr() == out.data_ptr() and got.shape == (m, n_total)
    check(out, columns_reference(a, b, offs), 1e-5, f"offs={offs}")
    assert torch.equal(b, b_before)
    want = columns_reference(a, b, offs)
    covered = ~torch.isnan(want)
    # A new output (a's dtype): column-major, the transpose's rows written in place.
    fresh = grouped_mm(a, b, offs=counts_tensor(offs))
    assert fresh.shape == (m, n_total) and fresh.dtype == HALF and (m == 1 or fresh.stride() == (1, m))
    err = (fresh.double().cpu()[covered] - want[covered]).norm() / want[covered].norm()
    assert err < REL_HALF_OUT, err.item()
    # A column-major out= is written in place as well; the uncovered columns keep its values.
    out_cm = poisoned((n_total, m), torch.float32).t()
    assert grouped_mm(a, b, offs=counts_tensor(offs), out_dtype=torch.float32, out=out_cm).data_ptr() == out_cm.data_ptr()
    check(out_cm, want, 1e-5, f"column-major out, offs={offs}")


@pytest.mark.anydevice
def test_autograd_of_the_n_grouped_form(seeded):
    """The 3-D x 2-D form's gradients: d a[g] = grad[:, N_g] @ b[:, N_g]^T (zeros for an empty
    group), d b[:, N_g] = a[g]^T @ grad[:, N_g], zeros on the columns no group covers; and
    torch.compile (AOTAutograd) traces both directions with the same gradients."""
    g, m, k, n_total = 3, 24, 32, 80
    offs = [30, 30, 70]
    a = torch.randn(g, m, k, device=DEV).to(HALF)
    b = torch.randn(k, n_total, device=DEV).to(HALF)
    grad = torch.randn(m, n_total, device=DEV).to(HALF)
    ga, gb = torch.zeros(g, m, k, dtype=torch.float64), torch.zeros(k, n_total, dtype=torch.float64)
    a64, b64, g64 = a.double().cpu(), b.double().cpu(), grad.double().cpu()
    for i, (s_, t) in enumerate(bounds(offs, GroupLayout.CONTIGUOUS, n_total)):
        ga[i] = g64[:, s_:t] @ b64[:, s_:t].t()
        gb[:, s_:t] = a64[i].t() @ g64[:, s_:t]

    offs_t, grad_f = counts_tensor(offs), grad.float()
    # The op's fake output has the real one's strides (column-major), as torch.compile assumes.
    real = grouped_mm(a, b, offs=offs_t)
    fake = torch.ops.tmagemm.grouped_mm(a.to("meta"), b.to("meta"), offs_t.to("meta"))
    assert fake.shape == real.shape and fake.stride() == real.stride() == (1, m)

    def loss(a_, b_):  # d loss / d out = grad
        return (grouped_mm(a_, b_, offs=offs_t).float() * grad_f).sum()

    torch._dynamo.reset()
    for fn in (loss, torch.compile(loss, fullgraph=True, backend="aot_eager")):
        a_, b_ = a.clone().requires_grad_(), b.clone().requires_grad_()
        fn(a_, b_).backward()
        for got, want, name in ((a_.grad, ga, "d a"), (b_.grad, gb, "d b")):
            err = (got.double().cpu() - want).norm() / want.norm()
            assert err < (2e-3 if DEV == "cpu" else 8e-3), (name, err.item())
        assert not a_.grad[1].any() and not b_.grad[:, 70:].any()
    torch._dynamo.reset()


def test_groups_along_n_errors():
    a, b = torch.randn(2, 8, 32).to(HALF), torch.randn(32, 40).to(HALF)
    offs = counts_tensor([10, 40])
    with pytest.raises(ValueError, match="offs is required for a 3-D a"):
        grouped_mm(a, b)
    with pytest.raises(ValueError, match="masked_m takes a 3-D a and b"):
        grouped_mm(a, b, masked_m=offs)
    with pytest.raises(ValueError, match="offs has 3 groups but a has 2"):
        grouped_mm(a, b, offs=counts_tensor([10, 20, 40]))
    with pytest.raises(ValueError, match=r"a.shape\[2\] \(32\) must equal b.shape\[0\] \(16\)"):
        grouped_mm(a, b[:16], offs=offs)
    with pytest.raises(ValueError, match=r"out has shape \(40, 8\) but the result is \(8, 40\)"):
        grouped_mm(a, b, offs=offs, out=torch.empty(40, 8, dtype=HALF))
    with pytest.raises(TypeError, match="offs must be int32"):
        grouped_mm(a, b, offs=offs.long())


@pytest.mark.anydevice
@pytest.mark.parametrize("a_k_major, b_n_major", [(False, True), (True, False)],
                         ids=["x_t_and_dy", "both_transposed"])
def test_autograd_of_the_k_grouped_form(a_k_major, b_n_major, seeded):
    """The 2-D x 2-D form's gradients: d a[:, K_g] = grad[g] @ b[K_g]^T, d b[K_g] = a[:, K_g]^T @
    grad[g], zeros on the K rows no group covers; with a and b stored either way (the backward
    copies the transposed ones by TMA)."""
    m, k, n = 24, 80, 32
    offs = [30, 30, 70]
    a = (torch.randn(m, k, device=DEV) if a_k_major else torch.randn(k, m, device=DEV).t()).to(HALF)
    b = (torch.randn(k, n, device=DEV) if b_n_major else torch.randn(n, k, device=DEV).t()).to(HALF)
    a, b = a.detach().requires_grad_(), b.detach().requires_grad_()
    out = grouped_mm(a, b, offs=counts_tensor(offs))
    grad = torch.randn_like(out)
    out.backward(grad)
    ga, gb = torch.zeros(m, k, dtype=torch.float64), torch.zeros(k, n, dtype=torch.float64)
    a64, b64, g64 = a.detach().double().cpu(), b.detach().double().cpu(), grad.double().cpu()
    for g, (s_, t) in enumerate(bounds(offs, GroupLayout.CONTIGUOUS, k)):
        ga[:, s_:t] = g64[g] @ b64[s_:t].t()
        gb[s_:t] = a64[:, s_:t].t() @ g64[g]
    for got, want, name in ((a.grad, ga, "d a"), (b.grad, gb, "d b")):
        err = (got.double().cpu() - want).norm() / want.norm()
        assert err < (2e-3 if DEV == "cpu" else 8e-3), (name, err.item())
    assert not a.grad[:, 70:].any() and not b.grad[70:].any()


def test_autograd_refusals_and_weight_grad_errors(seeded):
    a, b, o = _ops16()
    a.requires_grad_()
    with pytest.raises(ValueError, match="out= is not differentiable"):
        grouped_mm(a, b, offs=o, out=torch.empty(8, 16, device=DEV, dtype=HALF))
    out = grouped_mm(a, b, offs=o)  # the op with its autograd formula
    assert out.requires_grad and out.grad_fn is not None
    with pytest.raises(ValueError, match="grouped_scaled_mm .* does not support automatic differentiation"):
        a8 = torch.randn(8, 32, device=DEV).to(FP8)
        grouped_scaled_mm(a8, b.detach().to(FP8).requires_grad_(), torch.ones(8, device=DEV),
                          torch.ones(2, 16, device=DEV), offs=o)
    with pytest.raises(ValueError, match="grad .* must have the rows of a"):
        grouped.weight_grad(a.detach(), torch.randn(7, 16, device=DEV).to(HALF), offs=o)
    with pytest.raises(ValueError, match="masked_m must be 1-D"):
        grouped.weight_grad(torch.randn(2, 4, 32, device=DEV).to(HALF), torch.randn(2, 4, 16, device=DEV).to(HALF),
                            masked_m=o[:1])


@pytest.mark.parametrize("layout, counts", [(GroupLayout.CONTIGUOUS, [5, 5, 30]), (GroupLayout.CONTIGUOUS, [40, 2, 70]),
                                            (GroupLayout.CONTIGUOUS, []), (GroupLayout.MASKED, [3, 0, 40, -2])],
                         ids=["contiguous", "past_the_end", "no_groups", "masked"])
def test_zero_uncovered_rows_writes_those_rows_alone(layout, counts):
    """The zeros the input gradient needs: rows no group covers (by the row rule) become 0.0, the
    covered ones keep what they held (NaN here)."""
    shape = (40, 150) if layout == GroupLayout.CONTIGUOUS else (len(counts), 33, 150)
    kw = {"offs" if layout == GroupLayout.CONTIGUOUS else "masked_m": counts_tensor(counts)}
    covered = ~torch.isnan(reference(torch.ones(*shape[:-1], 1, dtype=torch.float64),
                                     torch.ones(max(len(counts), 1), 1, 1, dtype=torch.float64), counts, layout))
    for _ in range(2):  # planned, then from the plan cache
        out = torch.full(shape, float("nan"), device=DEV, dtype=HALF)
        assert grouped.zero_uncovered_rows(out, **kw) is out
        got = out.cpu()
        assert torch.isnan(got[covered.expand_as(got)]).all() and (got[~covered.expand_as(got)] == 0).all()
    with pytest.raises(ValueError, match="must be 2-D with offs"):
        grouped.zero_uncovered_rows(out[None] if layout == GroupLayout.CONTIGUOUS else out[0], **kw)


def test_compile_traces_the_backward(seeded):
    """torch.compile(fullgraph=True) with AOTAutograd: the forward traces as tmagemm.grouped_mm and
    the backward as grouped_mm_out and grouped_weight_grad, with the eager gradients."""
    torch._dynamo.reset()
    e, k, n = 3, 32, 24
    a = torch.randn(40, k, device=DEV).to(HALF)
    b = weights(e, k, n, HALF).detach()
    offs = counts_tensor([10, 25, 40])

    def loss(a, b, offs):
        return grouped_mm(a, b, offs=offs).float().square().sum()

    grads = []
    for fn in (loss, torch.compile(loss, fullgraph=True, backend="aot_eager")):
        a_, b_ = a.clone().requires_grad_(), b.clone().requires_grad_()
        fn(a_, b_, offs).backward()
        grads.append((a_.grad, b_.grad))
    for (eager, compiled), name in zip(zip(*grads), ("d a", "d b")):
        assert torch.allclose(eager.float(), compiled.float(), rtol=1e-2, atol=1e-2), name
    torch._dynamo.reset()


def _ops16(e=2, m=8, k=32, n=16):
    return torch.randn(m, k, device=DEV).to(HALF), weights(e, k, n, HALF), counts_tensor([3, 8][:e])


@pytest.mark.parametrize("case, exc, match", [
    (lambda a, b, o: grouped_mm(a, b, offs=o.long()), TypeError, "offs must be int32"),
    (lambda a, b, o: grouped_mm(a, b, offs=o[:1]), ValueError, "offs must be 1-D"),
    (lambda a, b, o: grouped_mm(a, b, offs=o.to("meta")), ValueError, "offs is on meta"),
    (lambda a, b, o: grouped_mm(a, b), ValueError, "offs is required"),
    (lambda a, b, o: grouped_mm(a, b, offs=o, masked_m=o), ValueError, "not both"),
    (lambda a, b, o: grouped_mm(a[:, :16], b, offs=o), ValueError, "inner dimensions differ"),
    (lambda a, b, o: grouped_mm(a, b[0, 0], offs=o), ValueError, r"b must be 3-D \(E, K, N\) or 2-D"),
    (lambda a, b, o: grouped_mm(a, b[0], masked_m=o), ValueError, "masked_m takes a 3-D a and b"),
    (lambda a, b, o: grouped_mm(a, b[0]), ValueError, "offs is required for a 2-D b"),
    (lambda a, b, o: grouped_mm(a, b[0, :16], offs=o), ValueError, "must share their grouped dimension K_total"),
    (lambda a, b, o: grouped_mm(a[None], b[0], offs=o), ValueError, "offs has 2 groups but a has 1"),
    (lambda a, b, o: grouped_mm(a[None, None], b[0], offs=o), ValueError, "the 2-D x 2-D form takes a"),
    (lambda a, b, o: grouped_mm(a, b[0], offs=o[None]), ValueError, r"offs must be 1-D \(E,\)"),
    (lambda a, b, o: grouped_mm(a, torch.randn(16, 64, device=DEV).to(HALF)[:, ::2].t(), offs=o), ValueError,
     r"b \(32, 16\) must be contiguous along N or K_total"),
    (lambda a, b, o: grouped_mm(a, b[0], offs=o, out=torch.empty(2, 8, 15, device=DEV, dtype=HALF)), ValueError,
     "out has shape"),
    (lambda a, b, o: grouped_mm(a, b.float(), offs=o), TypeError, "must both be bfloat16 or both float16"),
    (lambda a, b, o: grouped_mm(a.t().contiguous().t(), b, offs=o), ValueError, "a .* must be contiguous"),
    (lambda a, b, o: grouped_mm(a[:, :20].contiguous(), weights(2, 20, 16, HALF), offs=o), ValueError,
     "a stride 20 along dimension 0 is 40 bytes"),
    (lambda a, b, o: grouped_mm(a[:, :16], weights(2, 16, 12, HALF, k_major=False), offs=o), ValueError,
     "b stride 12 along dimension 1 is 24 bytes"),
    (lambda a, b, o: grouped_mm(a, b, offs=o, out=torch.empty(8, 15, device=DEV, dtype=HALF)), ValueError, "out has shape"),
    (lambda a, b, o: grouped_mm(a, b, offs=o, out=torch.empty(8, 16, device=DEV)), TypeError, "out has dtype"),
    (lambda a, b, o: grouped_mm(a, b, offs=o, out_dtype=torch.int8), TypeError, "out_dtype"),
    (lambda a, b, o: grouped_mm(a[None].expand(3, 8, 32), b, masked_m=counts_tensor([1, 1, 1])), ValueError,
     "a has 3 experts"),
    (lambda a, b, o: grouped_mm(a[None].expand(2, 8, 32), b, masked_m=counts_tensor([1, 1, 1])), ValueError,
     "masked_m must be 1-D"),
    (lambda a, b, o: grouped_mm(a, 1.0, offs=o), TypeError, "b must be a torch.Tensor"),
])
def test_errors_name_the_argument(case, exc, match):
    a, b, o = _ops16()
    with pytest.raises(exc, match=match):
        case(a, b, o)


def test_fp8_errors_name_the_argument():
    e, m, k, n = 2, 8, 64, 16
    a, b = fp8_operands((m, k), e, k, n)
    offs = counts_tensor([3, 8])
    sa, sb = torch.ones(m, device=DEV), torch.ones(e, n, device=DEV)
    cases = [
        (lambda: grouped_scaled_mm(a, b.contiguous(), sa, sb, offs=offs), ValueError, "b must be K-major"),
        (lambda: grouped_scaled_mm(a.to(HALF), b, sa, sb, offs=offs), TypeError, "a must be float8_e4m3fn"),
        (lambda: grouped_scaled_mm(a, b, sa.double(), sb, offs=offs), TypeError, "scale_a must be float32"),
        (lambda: grouped_scaled_mm(a, b, torch.ones(m + 1, device=DEV), sb, offs=offs), ValueError, "scale_a has shape"),
        (lambda: grouped_scaled_mm(a, b, sa, torch.ones(e, n + 1, device=DEV), offs=offs), ValueError,
         "scale_b has shape"),
        (lambda: grouped_scaled_mm(a, b, sa, sb, offs=offs, bias=torch.ones(n, device=DEV)), ValueError,
         "bias has shape"),
        (lambda: grouped_scaled_mm(a, b, sa, sb, offs=offs, scale_recipe_b="1x128"), ValueError,
         "the 1x128 recipe expects"),
        (lambda: grouped_scaled_mm(a, b, sa, sb, offs=offs, scale_recipe_a="128x128"), ValueError, "scale_recipe_a"),
        (lambda: grouped_scaled_mm(a, b, sa, sb, offs=offs, use_fast_accum=1), TypeError, "use_fast_accum"),
    ]
    for case, exc, match in cases:
        with pytest.raises(exc, match=match):
            case()


@pytest.mark.skipif(DEV == "cuda", reason="the CPU refusal of bf16 (interpreter bug)")
def test_bf16_refused_on_cpu():
    a = torch.randn(4, 16).bfloat16()
    with pytest.raises(ValueError, match="bfloat16 inputs on the CPU"):
        grouped_mm(a, torch.randn(1, 16, 8).bfloat16(), offs=torch.tensor([4], dtype=torch.int32))


def test_heuristic_is_pure_and_valid():
    from tmagemm.triton import matmul_grouped as mg

    for dtype, block in ((torch.float16, False), (FP8, False), (FP8, True)):
        for rows in (1, 64, 200, 4096):
            config = mg.heuristic_for(rows, dtype == FP8, block)
            assert config == mg.heuristic_for(rows, dtype == FP8, block)
            assert config.block_m == (16 if rows <= mg.DECODE_ROWS else 64 if rows <= 64 else 128)
            assert config.swap_ab == (rows <= mg.DECODE_ROWS)
            if block:
                assert config.block_k == 128 and config.block_n <= 128


@pytest.mark.parametrize(
    "rows, fp8, block, contiguous, wide_per_sm, tile",
    [
        (64, False, False, True, 10.0, (64, 256)),  # contiguous 16-bit: wide tiles (64 x 256 on slow memory, the default)
        (64, False, False, True, 1.0, (64, 128)),  # ... unless they leave SMs idle
        (32, False, False, True, 10.0, (64, 128)),  # decode-sized groups: 64-row tiles
        (4, False, False, True, 10.0, (16, 128)),  # contiguous, <= 4 rows on average: swapped tiles
        (1, False, False, False, 0.5, (16, 128)),  # masked, max_m <= 16: swapped tiles
        (16, True, False, False, 1.5, (16, 128)),
        (1, True, True, False, 0.5, (16, 128)),  # block-scaled too
        (16, False, False, True, 10.0, (64, 256)),  # contiguous, 16 on average, 16-bit: twice the columns
        (16, True, False, True, 8 * 16 / 132, (64, 256)),  # fp8: where those tiles fit in one wave
        (16, True, False, True, 1.5, (64, 128)),  # ... else 64 x 128
        (5, True, True, True, 0.5, (64, 128)),  # block-scaled, contiguous past 4 rows on average
        (17, True, True, False, 0.5, (64, 128)),  # masked past 16 rows
        (64, True, False, True, 10.0, (64, 128)),  # fp8: balanced groups lost 4-7% on wide tiles
        (64, False, False, False, 10.0, (64, 128)),  # masked: max_m <= 64 bounds every group
        (100, False, False, True, 10.0, (128, 128)),
        (189, True, False, False, 3.4, (128, 256)),  # Mixtral gate_up, masked, Zipf
        (189, True, False, False, 8 * 16 / 132, (64, 128)),  # Mixtral down: 128 wide tiles for 132 SMs
        (1024, False, False, False, 0.5, (64, 128)),
        (200, True, True, True, 10.0, (128, 128)),  # block-scaled: 128 x 128 tiles
        (200, True, True, True, 0.5, (128, 128)),
    ],
)
def test_heuristic_tiles(rows, fp8, block, contiguous, wide_per_sm, tile):
    from tmagemm.triton import matmul_grouped as mg

    config = mg.heuristic_for(rows, fp8, block, contiguous, wide_per_sm)
    assert (config.block_m, config.block_n) == tile
    assert config.swap_ab == (rows <= (mg.DECODE_MEAN_ROWS if contiguous else mg.DECODE_ROWS))


@pytest.mark.parametrize(
    "fp8, block, k, decode_per_sm, slow_memory, long_stream",
    [
        (True, False, 4096, 16.1, True, True),  # a long fp8 weight stream on an H100
        (True, False, 7168, 62.1, True, True),
        (True, False, 7168, 62.1, False, False),  # an H200's bandwidth wants the swapped tiles
        (True, False, 4096, 16.0, True, False),  # at most 16 swapped tiles per SM
        (True, False, 4095, 62.1, True, False),  # shorter K
        (True, True, 7168, 62.1, True, False),  # block-scaled groups keep the swapped tiles
        (False, False, 7168, 62.1, True, False),  # and 16-bit ones
    ],
)
def test_long_weight_stream(fp8, block, k, decode_per_sm, slow_memory, long_stream):
    from tmagemm.triton import matmul_grouped as mg

    assert mg.long_weight_stream(fp8, block, k, decode_per_sm, slow_memory) == long_stream


@pytest.mark.parametrize("rows, contiguous", [(1, True), (4, True), (16, False)])
def test_heuristic_long_weight_streams_take_64_row_tiles(rows, contiguous):
    from tmagemm.triton import matmul_grouped as mg

    swapped = mg.heuristic_for(rows, True, False, contiguous, 31.0)
    assert swapped.swap_ab and (swapped.block_m, swapped.block_n) == (16, 128)
    streaming = mg.heuristic_for(rows, True, False, contiguous, 31.0, long_stream=True)
    assert not streaming.swap_ab and (streaming.block_m, streaming.block_n) == (64, 128)


@pytest.mark.parametrize("slow_memory", [True, False])
def test_heuristic_reads_the_swapped_tile_bound(monkeypatch, slow_memory):
    """heuristic(args) on one row per expert: Qwen3-235B-A22B's gate_up (128 experts, 3072 x 4096)
    bounds 3072 swapped tiles (23 per SM of 132): fp8 on a GPU with slow memory takes 64 x 128
    tiles; with faster memory, K = 2048, bf16 operands, or 8 experts (192 tiles) the swapped ones."""
    from tmagemm import device
    from tmagemm.triton import matmul_grouped as mg

    monkeypatch.setattr(device, "slow_memory", lambda dev: slow_memory)

    def config(a_dtype=FP8, e=128, k=4096):
        return mg.heuristic(grouped.example_args(a_dtype, e=e, rows=1, n=3072, k=k))

    assert (config().block_m, config().swap_ab) == ((64, False) if slow_memory else (16, True))
    assert config(k=2048).swap_ab
    assert config(torch.bfloat16).swap_ab
    assert config(e=8).swap_ab


@pytest.mark.parametrize("rows, fp8, block, slow_memory, short_k, expect", [
    (17, True, False, False, False, (64, 128, 3, 3)),  # no slow memory: three programs of three stages
    (64, False, False, False, False, (64, 128, 3, 3)),
    (64, True, False, True, False, (64, 128, 5, 1)),  # fp8 on slow memory (an H100): one program of five
    (64, True, False, True, True, (64, 128, 3, 3)),  # ... but three where K is short
    (64, False, False, True, False, (64, 128, 3, 3)),  # 16-bit: three programs on every GPU
    (64, True, True, False, False, (64, 128, 5, 1)),  # block scales: as before on every GPU
    (64, True, True, True, True, (64, 128, 5, 1)),
    (16, False, False, False, False, (64, 256, 4, 1)),  # 64 x 256 tiles keep one program
    (16, False, False, True, False, (64, 256, 3, 1)),  # ... of three stages on slow memory
    (16, True, False, True, True, (64, 256, 3, 1)),
    (100, True, False, False, False, (128, 128, 4, 1)),
    (100, True, False, True, True, (128, 128, 4, 1)),
])
def test_heuristic_programs_per_sm(rows, fp8, block, slow_memory, short_k, expect):
    from tmagemm.triton import matmul_grouped as mg

    config = mg.heuristic_for(rows, fp8, block, True, 1.0, slow_memory=slow_memory, short_k=short_k)
    assert (config.block_m, config.block_n, config.num_stages, config.programs_per_sm) == expect


@pytest.mark.parametrize("rows, slow_memory, expect", [
    (33, True, (64, 256, 3, 4)),  # slow memory (an H100): 64 x 256 tiles of three stages
    (64, True, (64, 256, 3, 4)),
    (33, False, (128, 256, 3, 8)),  # an H200: 128 x 256 tiles
    (64, False, (128, 256, 3, 8)),
    (32, True, (64, 128, 3, 4)),  # 32 or fewer on average: the streaming 64 x 128 tiles
])
def test_heuristic_contiguous_16bit_groups_where_wide_tiles_fill(rows, slow_memory, expect):
    """Contiguous 16-bit groups of 33-64 rows on average whose experts' columns fill the SMs
    with 128 x 256 tiles (the mean says nothing of the largest group)."""
    from tmagemm.triton import matmul_grouped as mg

    config = mg.heuristic_for(rows, False, False, True, 10.0, slow_memory=slow_memory)
    assert (config.block_m, config.block_n, config.num_stages, config.num_warps) == expect


@pytest.mark.parametrize("k, programs", [(1536, 3), (1537, 1), (7168, 1)])
def test_heuristic_reads_k(monkeypatch, k, programs):
    """heuristic(args) passes K <= SHORT_K as short_k: fp8 groups of 64 rows on slow memory."""
    from tmagemm.triton import matmul_grouped as mg

    monkeypatch.setattr(mg.device, "slow_memory", lambda dev: True)
    args = grouped.example_args(FP8, e=128, rows=64, n=4096, k=k)
    assert mg.heuristic(args).programs_per_sm == programs


@pytest.mark.parametrize("slow_memory, wide", [(False, (128, 256)), (True, (64, 256))])
def test_heuristic_reads_the_experts_columns(monkeypatch, slow_memory, wide):
    """heuristic(args): 8 experts x 4096 columns give 128 wide tiles (under 2 per SM of 132):
    64 x 128; 64 experts give 1024: wide tiles, 128 x 256 or, on slow memory, 64 x 256
    (contiguous bf16, 64 rows per group on average)."""
    from tmagemm.triton import matmul_grouped as mg

    monkeypatch.setattr(mg.device, "slow_memory", lambda dev: slow_memory)
    few = grouped.example_args(torch.bfloat16, e=8, rows=64, n=4096, k=256)
    many = grouped.example_args(torch.bfloat16, e=64, rows=64, n=4096, k=256)
    assert (mg.heuristic(few).block_m, mg.heuristic(few).block_n) == (64, 128)
    assert (mg.heuristic(many).block_m, mg.heuristic(many).block_n) == wide


# ---------------------------------------------------------------------------------- GPU


gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8_rowwise"])
def test_gpu_large_contiguous_matches_torch(fp8, seeded):
    e, k, n = 8, 2048, 1536
    sizes = torch.randint(0, 700, (e,)).tolist()
    sizes[3] = 0
    m = sum(sizes) + 37  # rows past offs[-1]
    offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32).cuda()
    out = poisoned((m, n), torch.bfloat16)
    if fp8:
        a, b = fp8_operands((m, k), e, k, n)
        sa, sb = torch.rand(m, device=DEV) + 0.5, torch.rand(e, n, device=DEV) + 0.5
        got = grouped_scaled_mm(a, b, sa, sb, offs=offs, out=out)
        ref = reference(a.double().cpu() * sa.double().cpu()[:, None], b.double().cpu() * sb.double().cpu()[:, None],
                        offs.tolist(), GroupLayout.CONTIGUOUS)
        fn = getattr(torch, "_scaled_grouped_mm", None)
        peer = (lambda: fn(a, b, sa, sb, offs=offs, out_dtype=torch.bfloat16)) if fn else None
    else:
        a = torch.randn(m, k, device=DEV).bfloat16()
        b = weights(e, k, n, torch.bfloat16)
        got = grouped_mm(a, b, offs=offs, out=out)
        ref = reference(a.double().cpu(), b.double().cpu(), offs.tolist(), GroupLayout.CONTIGUOUS)
        fn = getattr(torch, "_grouped_mm", None)
        peer = (lambda: fn(a, b, offs=offs, out_dtype=torch.bfloat16)) if fn else None
    check(got, ref, 1e-2, "gpu contiguous")
    if peer is not None:
        try:
            theirs = peer()
        except RuntimeError as exc:  # e.g. torch built without the grouped kernels for this arch
            pytest.skip(f"torch peer unavailable: {exc}")
        rows = int(offs[-1])
        assert torch.allclose(got[:rows].float(), theirs[:rows].float(), rtol=2e-2, atol=2e-2 * ref[:rows].abs().max().item())


@pytest.mark.gpu
def test_gpu_training_step_graph_replays_with_new_offsets(seeded):
    """Forward and backward captured in one CUDA graph (nothing syncs with the host), replayed
    after the offsets change in place: both gradients follow the new groups."""
    e, k, n = 4, 512, 384
    a = torch.randn(1000, k, device="cuda", dtype=torch.bfloat16).requires_grad_()
    b = (torch.randn(e, n, k, device="cuda") / 8).to(torch.bfloat16).transpose(1, 2).detach().requires_grad_()
    grad = torch.randn(1000, n, device="cuda", dtype=torch.bfloat16)
    offs = counts_tensor([100, 100, 700, 1000])

    def step():
        grouped_mm(a, b, offs=offs).backward(grad)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            a.grad = b.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    a.grad = b.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for values in ([250, 250, 600, 1000], [0, 999, 999, 999], [100, 100, 700, 1000]):
        offs.copy_(counts_tensor(values))
        graph.replay()
        torch.cuda.synchronize()
        ga, gb = _grads(a.detach(), b.detach(), grad, values, GroupLayout.CONTIGUOUS)
        for got, want, name in ((a.grad, ga, "d a"), (b.grad, gb, "d b")):
            err = ((got.double().cpu() - want).norm() / want.norm()).item()
            assert err < 8e-3, (values, name, err)


@pytest.mark.gpu
@pytest.mark.parametrize("sizes", [[0, 300, 1, 513, 129, 192, 65, 1024], [256] * 8], ids=["ragged", "balanced"])
def test_gpu_autograd_matches_torch_grouped_mm(sizes, seeded):
    """bf16 forward and backward against torch._grouped_mm's (same inputs) and float64: the input
    gradient, the weight gradient (the 2-D x 2-D kernel) and the 2-D x 2-D form's own output."""
    e, k, n = len(sizes), 1536, 1024
    offs = counts_tensor(list(itertools.accumulate(sizes)))
    total = sum(sizes)
    a = torch.randn(total, k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(e, n, k, device="cuda") / 8).to(torch.bfloat16)
    grad = torch.randn(total, n, device="cuda", dtype=torch.bfloat16)
    results = []
    for fn in (grouped_mm, torch._grouped_mm):
        a_, b_ = a.clone().requires_grad_(), w.transpose(1, 2).detach().requires_grad_()
        out = fn(a_, b_, offs=offs)
        out.backward(grad)
        results.append((out.detach(), a_.grad, b_.grad))
    ga, gb = _grads(a, w.transpose(1, 2), grad, list(itertools.accumulate(sizes)), GroupLayout.CONTIGUOUS)
    for (ours, theirs), want, name in zip(zip(*results), (None, ga, gb), ("out", "d a", "d b")):
        if want is None:
            want = reference(a.double().cpu(), w.transpose(1, 2).double().cpu(), list(itertools.accumulate(sizes)),
                             GroupLayout.CONTIGUOUS)
        ref_err = ((theirs.double().cpu() - want).norm() / want.norm()).item()
        err = ((ours.double().cpu() - want).norm() / want.norm()).item()
        assert err < 8e-3 and err <= 1.25 * ref_err + 1e-4, (name, err, ref_err)
    # The weight gradient of the K-major b is the 2-D x 2-D call in the weights' own (E, N, K)
    # layout, bit for bit (the same kernel), and matches the (E, K, N) call within rounding.
    assert torch.equal(grouped_mm(grad.t(), a, offs=offs).transpose(1, 2), results[0][2])
    assert ((grouped_mm(a.t(), grad, offs=offs).double() - results[0][2].double()).norm()
            / results[0][2].double().norm()) < 1e-3


@gpu
def test_gpu_blockwise_masked_large(seeded):
    e, max_m, k, n = 6, 192, 1024, 768
    a, b = fp8_operands((e, max_m, k), e, k, n)
    sa = torch.rand(e, max_m, k // 128, device=DEV) + 0.5
    sb = torch.rand(e, n // 128, k // 128, device=DEV) + 0.5
    counts = [192, 0, 1, 64, 130, 77]
    out = poisoned((e, max_m, n), torch.bfloat16)
    got = grouped_scaled_mm(a, b, sa, sb, masked_m=counts_tensor(counts), out=out)
    check(got, reference(*_block_deq(a, b, sa, sb), counts, GroupLayout.MASKED), 1e-2, "gpu block masked")


@gpu
def test_gpu_cuda_graph_masked_counts_change_between_replays(seeded):
    e, max_m, k, n = 8, 64, 512, 1024
    a = torch.randn(e, max_m, k, device=DEV).bfloat16()
    b = weights(e, k, n, torch.bfloat16)
    masked = counts_tensor([64] * e)
    out = poisoned((e, max_m, n), torch.bfloat16)
    grouped_mm(a, b, masked_m=masked, out=out)  # plan + compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grouped_mm(a, b, masked_m=masked, out=out)
    for counts in ([1, 0, 64, 5, 17, 33, 2, 63], [0] * e, [64, 64, 1, 1, 0, 0, 9, 9]):
        masked.copy_(counts_tensor(counts))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(out, reference(a.double().cpu(), b.double().cpu(), counts, GroupLayout.MASKED), 1e-2, f"replay {counts}")


@gpu
def test_gpu_compile_reduce_overhead_masked_counts_change(seeded):
    """torch.compile(mode="reduce-overhead", fullgraph=True) over a masked fp8 expert layer: the
    grouped op inside cudagraph trees, new counts each step (no recapture, right rows)."""
    torch._dynamo.reset()
    e, max_m, k, n = 8, 32, 512, 768
    a, b = fp8_operands((e, max_m, k), e, k, n)
    sa, sb = torch.rand(e, max_m, device=DEV) + 0.5, torch.rand(e, n, device=DEV) + 0.5
    masked = counts_tensor([max_m] * e)

    def experts(a, b, sa, sb, masked_m):
        return grouped_scaled_mm(a, b, sa, sb, masked_m=masked_m, use_fast_accum=True) * 0.5

    compiled = torch.compile(experts, mode="reduce-overhead", fullgraph=True)
    a_deq = a.double().cpu() * sa.double().cpu()[..., None]
    b_deq = b.double().cpu() * sb.double().cpu()[:, None, :]
    for counts in ([32] * e, [1, 0, 32, 5, 17, 31, 2, 3], [0] * e, [9, 9, 1, 1, 0, 0, 32, 32]):
        masked.copy_(counts_tensor(counts))
        torch.compiler.cudagraph_mark_step_begin()
        got = compiled(a, b, sa, sb, masked).clone()
        torch.cuda.synchronize()
        ref = reference(a_deq, b_deq, counts, GroupLayout.MASKED) * 0.5
        written = ~torch.isnan(ref)
        if written.any():
            err = (got.double().cpu()[written] - ref[written]).norm() / ref[written].norm()
            assert err < 1e-2, f"counts {counts}: relative error {err:.2e}"
    torch._dynamo.reset()


@gpu
def test_gpu_direct_launch_and_decode_config(seeded):
    plan.clear_plans()
    e, max_m, k, n = 16, 8, 1024, 2048
    a, b = fp8_operands((e, max_m, k), e, k, n)
    sa, sb = torch.rand(e, max_m, device=DEV) + 0.5, torch.rand(e, n, device=DEV) + 0.5
    counts = [3, 8, 0, 1] * 4
    got = grouped_scaled_mm(a, b, sa, sb, masked_m=counts_tensor(counts))
    (p,) = grouped.cached_plans()
    assert p.direct and p.config.swap_ab and p.config.num_stages == 6  # swapped decode tiles, not cut
    ref = reference(a.double().cpu() * sa.double().cpu()[..., None], b.double().cpu() * sb.double().cpu()[:, None],
                    counts, GroupLayout.MASKED)
    check(torch.where(torch.isnan(ref).to(DEV), float("nan"), got.float()), ref, 1e-2, "decode")


# ---------------------------------------------------------------------------------- native kernel
# cuda/grouped.py: the persistent kernel built with TMAGEMM_GROUPED. GPU tests run it
# with a few CTAs (each walks many tiles across group boundaries) on groups that end inside
# tiles, empty groups, a one-row group (a 2x1 cluster's second tile lies wholly past it) and rows
# no group covers; CPU tests check its builds and the rules that route problems to it.

_COOP = native_gemm.NATIVE_CONFIGS["cuda.persistent_coop"]
_PROMOTE = native_gemm._PROMOTE_WIDE  # promoting 128 x 256 tiles on 2x1 clusters
_PINGPONG = native_gemm.NATIVE_CONFIGS["cuda.persistent_pingpong"]  # 128 x 128 tiles, alternating consumers


def _native_config(base, e, **changes):
    return replace(base, groups=e, **changes)


# Contiguous group sizes (37 rows after the last group stay untouched) and masked counts of
# max_m = 300. Groups end 1, 44, 64 and 65 rows into a 128-row tile: the tile's second 64 rows
# (the native kernel's second consumer), or a 2x1 cluster tile's second CTA, hold none or one.
SIZES = [0, 300, 1, 513, 129, 192, 65]
MASKED = [300, 0, 129, 1, 255, 64, 65]


def _native_operands(dtype, layout, k, n, k_major=True):
    e = len(SIZES)
    if layout == GroupLayout.CONTIGUOUS:
        counts = torch.tensor(SIZES).cumsum(0).tolist()
        shape_a, kw = (counts[-1] + 37, k), {"offs": counts_tensor(counts)}
    else:
        counts = MASKED
        shape_a, kw = (e, 300, k), {"masked_m": counts_tensor(counts)}
    if dtype == FP8:
        a, b = fp8_operands(shape_a, e, k, n)
    else:
        a, b = torch.randn(*shape_a, device=DEV).to(dtype), weights(e, k, n, dtype, k_major)
    return a, b, counts, kw


@gpu
@pytest.mark.parametrize("layout", [GroupLayout.CONTIGUOUS, GroupLayout.MASKED], ids=["contiguous", "masked"])
@pytest.mark.parametrize("k_major, out_dtype", [(True, torch.bfloat16), (False, torch.float32)],
                         ids=["b_k_major_bf16_out", "b_n_major_fp32_out"])
def test_gpu_native_bf16(layout, k_major, out_dtype, seeded):
    k, n = (200 if k_major else 192), 400  # N off the 256-column tile; K off the k-block (K-major)
    a, b, counts, kw = _native_operands(torch.bfloat16, layout, k, n, k_major)
    args = grouped.mm_args(a, b, out_dtype=out_dtype, out=poisoned((*a.shape[:-1], n), out_dtype), **kw)
    assert native.unsupported_reason(args) is None
    out = grouped.run(args, config=_native_config(_COOP, len(SIZES)), num_sms=6)
    rel = 1e-4 if out_dtype == torch.float32 else 8e-3
    check(out, reference(a.double().cpu(), b.double().cpu(), counts, layout), rel, f"native bf16 {layout.name}")


@gpu
@pytest.mark.parametrize("layout", [GroupLayout.CONTIGUOUS, GroupLayout.MASKED], ids=["contiguous", "masked"])
@pytest.mark.parametrize("recipe", ["row_promote_c2", "row_promote_c1", "tensor_fast", "tensor_fast_pingpong",
                                    "block_c2", "block_c1"])
def test_gpu_native_fp8(layout, recipe, seeded):
    e, k, n = len(SIZES), 400, 400  # K: a partial last k-block and scale block; N: a partial weight block
    a, b, counts, kw = _native_operands(FP8, layout, k, n)
    rows = a.shape[:-1]
    bias = torch.randn(e, n, device=DEV).to(torch.bfloat16)
    fast = recipe.startswith("tensor_fast")
    if recipe.startswith("block"):
        kb, nb = -(-k // 128), -(-n // 128)
        # 1x128 scales outer-dim-major for the contiguous layout (torch's), row-major for masked.
        sa = ((torch.rand(kb, rows[0], device=DEV) + 0.5).t() if layout == GroupLayout.CONTIGUOUS
              else torch.rand(*rows, kb, device=DEV) + 0.5)
        sb = torch.rand(e, nb, kb, device=DEV) + 0.5
        a_deq, b_deq = _block_deq(a, b, sa, sb)
        config = _native_config(_PROMOTE, e, block_scaled=True)
    elif fast:
        sa, sb = torch.tensor(0.75, device=DEV), torch.rand(e, device=DEV) + 0.5  # tensor-wise, per expert
        a_deq, b_deq = a.double().cpu() * 0.75, b.double().cpu() * sb.double().cpu()[:, None, None]
        config = _native_config(_PINGPONG if recipe.endswith("pingpong") else _COOP, e)
    else:
        sa, sb = torch.rand(rows, device=DEV) + 0.5, torch.rand(e, n, device=DEV) + 0.5
        a_deq = a.double().cpu() * sa.double().cpu()[..., None]
        b_deq = b.double().cpu() * sb.double().cpu()[:, None, :]
        config = _native_config(_PROMOTE, e)
    if recipe.endswith("c1"):
        config = replace(config, cluster_m=1)
    args = grouped.scaled_mm_args(a, b, sa, sb, bias=bias, out_dtype=torch.float32, use_fast_accum=fast,
                                  out=poisoned((*rows, n)), **kw)
    assert native.unsupported_reason(args, config) is None
    out = grouped.run(args, config=config, num_sms=6)
    check(out, reference(a_deq, b_deq, counts, layout, bias.cpu()), REL8, f"native fp8 {recipe} {layout.name}")


@gpu
@pytest.mark.parametrize("cluster_m", [1, 2])
def test_gpu_native_masked_block_scales_at_an_expert_stride(cluster_m, seeded):
    """DeepGEMM's masked scale layout, (E, max_m, K/128) with each expert's scales contiguous along
    its rows and the experts a padded row count apart (get_col_major_tma_aligned_tensor): the
    native kernel reads them through its expert offset (the dispatcher takes it too)."""
    e, k, n = len(SIZES), 400, 400
    a, b, counts, kw = _native_operands(FP8, GroupLayout.MASKED, k, n)
    max_m, kb, nb = a.shape[1], -(-k // 128), -(-n // 128)
    padded = max_m + 12
    sa = (torch.rand(e, kb, padded, device=DEV) + 0.5)[:, :, :max_m].transpose(1, 2)
    sb = torch.rand(e, nb, kb, device=DEV) + 0.5
    args = grouped.scaled_mm_args(a, b, sa, sb, out_dtype=torch.float32, out=poisoned((e, max_m, n)), **kw)
    assert args.scale_a_strides == (kb * padded, 1, padded)
    config = replace(_native_config(_PROMOTE, e, block_scaled=True), cluster_m=cluster_m)
    assert native.unsupported_reason(args, config) is None and native.preferred(args)
    ref = reference(*_block_deq(a, b, sa, sb), counts, GroupLayout.MASKED)
    check(grouped.run(args, config=config, num_sms=6), ref, REL8, f"expert-strided block scales, {cluster_m}x1")
    plan.clear_plans()
    got = grouped_scaled_mm(a, b, sa, sb, out_dtype=torch.float32, out=poisoned((e, max_m, n)), **kw)
    assert [p.variant for p in grouped.cached_plans()] == [native.NAME]
    check(got, ref, REL8, "expert-strided block scales, dispatched")


@gpu
@pytest.mark.parametrize("recipe", ["bf16", "block_c2", "row_promote_c1"])
def test_gpu_native_tail_split(recipe, seeded):
    """Groups whose tiles leave a last wave on at most half of the few CTAs, K deep enough for two
    slices: later slices hand their sums to the first. The kernel counts the tiles on the device,
    so graph replays with new offsets change the tail (split, then none, then split again)."""
    e, n = len(SIZES), 400
    k = 2048 if recipe == "bf16" else 4096  # 32 k-blocks: two slices of TAIL_MIN_K_BLOCKS
    a, b, counts, kw = _native_operands(FP8 if recipe != "bf16" else torch.bfloat16, GroupLayout.CONTIGUOUS, k, n)
    if recipe == "bf16":
        args = grouped.mm_args(a, b, out=poisoned((a.shape[0], n), torch.bfloat16), **kw)
        a_deq, b_deq, sms, rel = a.double().cpu(), b.double().cpu(), 12, 8e-3
        config = _native_config(_COOP, e, tail_split=4)  # 28 tiles on 12 CTAs: 4 in 2 slices
    elif recipe == "block_c2":
        kb, nb = k // 128, -(-n // 128)
        sa = (torch.rand(kb, a.shape[0], device=DEV) + 0.5).t()
        sb = torch.rand(e, nb, kb, device=DEV) + 0.5
        args = grouped.scaled_mm_args(a, b, sa, sb, out_dtype=torch.float32, out=poisoned((a.shape[0], n)), **kw)
        a_deq, b_deq = _block_deq(a, b, sa, sb)
        sms, rel = 16, REL8
        config = _native_config(_PROMOTE, e, block_scaled=True, tail_split=4)  # 18 pair tiles on 8 pairs
    else:
        sa, sb = torch.rand(a.shape[0], device=DEV) + 0.5, torch.rand(e, n, device=DEV) + 0.5
        args = grouped.scaled_mm_args(a, b, sa, sb, out_dtype=torch.float32, use_fast_accum=False,
                                      out=poisoned((a.shape[0], n)), **kw)
        a_deq, b_deq = a.double().cpu() * sa.double().cpu()[:, None], b.double().cpu() * sb.double().cpu()[:, None, :]
        sms, rel = 11, REL8
        config = _native_config(native_gemm._PROMOTE_NARROW, e, cluster_m=1, tail_split=4)  # 56 tiles on 11 CTAs
    assert native.unsupported_reason(args, config) is None
    out = grouped.run(args, config=config, num_sms=sms)
    check(out, reference(a_deq, b_deq, counts, GroupLayout.CONTIGUOUS), rel, f"tail split {recipe}")
    plan = native.build(args, config, sms)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.run(*args.operands)
    offs = kw["offs"]
    for sizes in ([0, 0, 0, 1200, 0, 0, 0], [100] * 7, [0, 300, 1, 513, 129, 192, 65]):
        ends = torch.tensor(sizes).cumsum(0).tolist()
        offs.copy_(counts_tensor(ends))
        args.out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(args.out, reference(a_deq, b_deq, ends, GroupLayout.CONTIGUOUS), rel, f"tail split {recipe} replay {sizes}")


@gpu
def test_gpu_native_batched_single_expert_and_bad_offsets(seeded):
    k, n = 256, 256
    a = torch.randn(3, 200, k, device=DEV).bfloat16()
    b = weights(3, k, n, torch.bfloat16)
    out = grouped.run(grouped.mm_args(a, b, out=poisoned((3, 200, n), torch.bfloat16)),
                      config=_native_config(_COOP, 3), num_sms=4)
    check(out, reference(a.double().cpu(), b.double().cpu(), None, GroupLayout.BATCHED), 8e-3, "native batched")
    a1, b1 = a[0], b[:1]
    out = grouped.run(grouped.mm_args(a1, b1, offs=counts_tensor([150]), out=poisoned((200, n), torch.bfloat16)),
                      config=_native_config(_COOP, 1), num_sms=4)
    check(out, reference(a1.double().cpu(), b1.double().cpu(), [150], GroupLayout.CONTIGUOUS), 8e-3, "native E=1")
    m = 400
    a4 = torch.randn(m, k, device=DEV).bfloat16()
    b4 = weights(4, k, n, torch.bfloat16)
    for offs in ([300, 100, 390, 200], [150, 900, 950, 1000], [-5, 129, 129, 7]):
        out = grouped.run(grouped.mm_args(a4, b4, offs=counts_tensor(offs), out=poisoned((m, n), torch.bfloat16)),
                          config=_native_config(_COOP, 4), num_sms=4)
        check(out, reference(a4.double().cpu(), b4.double().cpu(), offs, GroupLayout.CONTIGUOUS), 8e-3,
              f"native offs={offs}")


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8_fast_pingpong"])
def test_gpu_native_graph_replays_with_new_offsets(dtype, seeded):
    """Contiguous groups whose sizes change between replays of one captured grouped call (the
    public API's dispatch picks the native kernel for groups of this size: cooperative tiles for
    bf16, ping-pong ones for fp8 with fast accumulation at this K)."""
    plan.clear_plans()
    e, m, k, n = 4, 1024, 512, 768
    offs = counts_tensor([256, 512, 768, 1024])
    if dtype == FP8:
        a, b = fp8_operands((m, k), e, k, n)
        sa, sb = torch.rand(m, device=DEV) + 0.5, torch.rand(e, n, device=DEV) + 0.5
        a_deq = a.double().cpu() * sa.double().cpu()[:, None]
        b_deq = b.double().cpu() * sb.double().cpu()[:, None, :]
        out, rel = poisoned((m, n)), REL8

        def call():
            grouped_scaled_mm(a, b, sa, sb, offs=offs, out=out, out_dtype=torch.float32, use_fast_accum=True)
    else:
        a, b = torch.randn(m, k, device=DEV).bfloat16(), weights(e, k, n, torch.bfloat16)
        a_deq, b_deq = a.double().cpu(), b.double().cpu()
        out, rel = poisoned((m, n), torch.bfloat16), 8e-3

        def call():
            grouped_mm(a, b, offs=offs, out=out)
    call()
    (p,) = grouped.cached_plans()
    assert p.variant == native.NAME and p.direct and p.config.pingpong == (dtype == FP8)
    heavy = native.HEAVY_GROUP_ROWS_PINGPONG if dtype == FP8 else native.HEAVY_GROUP_ROWS
    assert p.launch.heavy_group_rows == heavy
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for counts in ([1, 1, 1000, 1000], [0, 0, 0, 0], [700, 701, 701, 1024], [1024, 0, 3, 1]):
        offs.copy_(counts_tensor(counts))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(out, reference(a_deq, b_deq, counts, GroupLayout.CONTIGUOUS), rel, f"replay {counts}")


@gpu
def test_gpu_masked_fp8_pingpong_dispatch_replays_with_new_counts(seeded):
    """Masked fp8 with fast accumulation at K <= PINGPONG_MAX_K and a max_m of FAST_MIN_ROWS or
    more: the public API's dispatch takes the native ping-pong tiles; one captured call replayed
    with skewed, empty and full counts writes each expert's valid rows (row-wise scales, bias) and
    nothing past them."""
    plan.clear_plans()
    e, max_m, k, n = 6, 200, 640, 384
    assert k <= native.PINGPONG_MAX_K and max_m >= native.FAST_MIN_ROWS
    a, b = fp8_operands((e, max_m, k), e, k, n)
    sa, sb = torch.rand(e, max_m, device=DEV) + 0.5, torch.rand(e, n, device=DEV) + 0.5
    bias = torch.randn(e, n, device=DEV)
    a_deq = a.double().cpu() * sa.double().cpu()[..., None]
    b_deq = b.double().cpu() * sb.double().cpu()[:, None, :]
    masked = counts_tensor([max_m] * e)
    out = poisoned((e, max_m, n))

    def call():
        grouped_scaled_mm(a, b, sa, sb, masked_m=masked, bias=bias, out=out, out_dtype=torch.float32,
                          use_fast_accum=True)
    call()
    (p,) = grouped.cached_plans()
    assert p.variant == native.NAME and p.config.pingpong
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for counts in ([200, 1, 0, 65, 128, 129], [0] * 6, [7, 200, 3, 0, 1, 199], [max_m] * 6):
        masked.copy_(counts_tensor(counts))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(out, reference(a_deq, b_deq, counts, GroupLayout.MASKED, bias.cpu()), REL8, f"replay {counts}")


@gpu
@pytest.mark.parametrize("pdl", [True, False], ids=["pdl", "no_pdl"])
def test_gpu_native_chain_reads_what_the_kernel_before_wrote(pdl, monkeypatch, seeded):
    """Native grouped GEMMs back to back (programmatic dependent launch on and off), eager and in
    a CUDA graph: each takes the previous one's output as its activation and group ends that a
    copy kernel writes just before it, so a kernel that read either before the wait would see
    the poison or the previous step's boundaries."""
    if pdl:
        monkeypatch.delenv("TMAGEMM_PDL", raising=False)
    else:
        monkeypatch.setenv("TMAGEMM_PDL", "0")
    plan.clear_plans()
    e, m, d = 4, 1200, 1024
    ws = [(torch.randn(e, d, d, device=DEV) / d**0.5).bfloat16().transpose(1, 2) for _ in range(3)]
    ends = [counts_tensor(c) for c in ([300, 650, 1000, 1200], [1, 600, 601, 1200], [1200, 1200, 1200, 1200])]
    offs = counts_tensor([0] * e)
    outs = [poisoned((m, d), torch.bfloat16) for _ in ws]

    def chain(x):
        a = x
        for w, end, out in zip(ws, ends, outs):
            offs.copy_(end)
            a = grouped_mm(a, w, offs=offs, out=out)

    def check_chain(x, what):
        a = x
        for i, (w, end, out) in enumerate(zip(ws, ends, outs)):
            check(out, reference(a.double().cpu(), w.double().cpu(), end.tolist(), GroupLayout.CONTIGUOUS), 8e-3,
                  f"{what}, GEMM {i + 1}")
            a = out

    x = torch.randn(m, d, device=DEV).bfloat16()
    chain(x)
    torch.cuda.synchronize()
    check_chain(x, "eager")
    plans = grouped.cached_plans()
    assert plans and all(p.variant == native.NAME and p.launch.pdl == pdl for p in plans)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain(x)
    for replay in range(2):
        x.copy_(torch.randn(m, d, device=DEV))
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check_chain(x, f"graph replay {replay}")
    plan.clear_plans()


def test_native_config_rule_is_pure():
    e = 8

    def block(rows, masked=False):
        row = grouped.example_args(FP8, e=e, rows=rows, n=512, k=256)
        if masked:
            return grouped.scaled_mm_args(row.a.view(e, rows, 256), row.b, torch.ones(e, rows, 2), torch.ones(e, 4, 2),
                                          masked_m=torch.full((e,), rows, dtype=torch.int32))
        return grouped.scaled_mm_args(row.a, row.b, torch.ones(e * rows, 2), torch.ones(e, 4, 2), offs=row.counts)

    big = block(1024)
    config = native.config_for(big)
    assert config == native.config_for(big) and config.groups == e
    assert config.tail_split == native_gemm.TAIL_SPLIT  # the kernel cuts a short last wave into K slices
    assert config.block_scaled and config.cluster_m == 2 and config.block_n == 256
    assert native.config_for(block(512)).cluster_m == 1  # short groups: single CTAs
    assert native.config_for(block(1024, masked=True)).cluster_m == 1  # max_m bounds the rows, not their count
    row = grouped.example_args(FP8, e=e, rows=1024, n=512, k=256)  # row-wise, promoted
    narrow = native.config_for(row)
    assert narrow.promote and narrow.promote_depth == 2 and narrow.block_n == 128 and narrow.cluster_m == 1
    # Fast accumulation: ping-pong 128 x 128 tiles at short K or one row of tiles, else cooperative
    # 128 x 256 tiles with the tail split.
    fast = native.config_for(row._replace(fast_accum=True))
    assert fast.pingpong and not fast.promote and fast.block_n == 128 and fast.cluster_m == 1 and fast.tail_split == 0
    deep = grouped.example_args(FP8, e=e, rows=256, n=512, k=4096)._replace(fast_accum=True)
    assert not native.config_for(deep).pingpong and native.config_for(deep).block_n == 256
    assert native.config_for(deep).tail_split == native_gemm.TAIL_SPLIT
    one_row = grouped.example_args(FP8, e=e, rows=128, n=512, k=4096)._replace(fast_accum=True)
    assert native.config_for(one_row).pingpong  # one row of tiles per group: ping-pong at any K
    assert not native.config_for(grouped.example_args(FP8, e=e, rows=129, n=512, k=4096)._replace(
        fast_accum=True)).pingpong
    assert not native.config_for(grouped.example_args(torch.bfloat16, e=e, rows=128, n=512, k=256)).pingpong
    half = grouped.example_args(torch.bfloat16, e=e, rows=512, n=512, k=256)
    assert not native.config_for(half).promote and native.config_for(half).groups == e
    for args in (big, row, half, row._replace(fast_accum=True), deep):
        config = native.config_for(args)
        assert config.is_valid(args.out.element_size())
    # The group table takes shared memory: many experts cost the ring a stage.
    many = grouped.example_args(torch.bfloat16, e=2048, rows=1, n=256, k=256)
    assert native.config_for(many).stages < native.config_for(half).stages


def test_native_dispatch_rule(monkeypatch):
    """Which groups the dispatcher gives the native kernel: above one tile per group (block
    scales: above decode size), at any K."""
    monkeypatch.setattr(native._device, "is_hopper", lambda device: True)
    ex = grouped.example_args
    assert native.preferred(ex(torch.bfloat16, e=4, rows=129, n=256, k=256))
    assert not native.preferred(ex(torch.bfloat16, e=4, rows=128, n=256, k=256))
    args = ex(FP8, e=4, rows=512, n=256, k=2048)  # row-wise, promoted, short K
    assert native.preferred(args) and native.preferred(args._replace(fast_accum=True))
    assert not native.preferred(ex(FP8, e=4, rows=128, n=256, k=2048))
    # Fast-accumulating fp8 (ping-pong tiles): from 64 rows per group at K <= 2048, else from 128.
    fast = [ex(FP8, e=4, rows=rows, n=256, k=k)._replace(fast_accum=True) for rows, k in
            ((64, 2048), (63, 2048), (128, 2064), (127, 2064))]
    assert [native.preferred(f) for f in fast] == [True, False, True, False]
    kb = 2048 // 128
    sa, sb = torch.ones(4 * 80, kb), torch.ones(4, 2, kb)
    block = grouped.scaled_mm_args(args.a[:320], args.b, sa, sb, offs=torch.tensor([80, 160, 240, 320],
                                                                                   dtype=torch.int32))
    assert block.scaling == grouped.GroupScaling.BLOCK and native.preferred(block)
    assert not native.preferred(block._replace(a=args.a[:256], out=block.out[:256]))  # 64 rows per group
    # Masked 16-bit groups and fast-accumulating fp8 ones at K > 2048: the Triton kernel at any
    # max_m; fast-accumulating fp8 at K <= 2048 from a max_m of 128 (ping-pong tiles); promoted fp8
    # and block-scaled ones keep the rows-per-group rule; batched groups (every row valid) as
    # contiguous ones.
    a3, out3 = torch.empty(4, 1024, 256, dtype=torch.bfloat16), torch.empty(4, 1024, 256, dtype=torch.bfloat16)
    b16 = torch.empty(4, 256, 256, dtype=torch.bfloat16).transpose(1, 2)
    masked = grouped.mm_args(a3, b16, masked_m=torch.full((4,), 1024, dtype=torch.int32), out=out3)
    assert masked.layout == grouped.GroupLayout.MASKED and not native.preferred(masked)
    assert native.preferred(masked._replace(layout=grouped.GroupLayout.BATCHED))
    a8_full = torch.empty(4, 1024, 2048, dtype=FP8)
    masked_row = grouped.scaled_mm_args(a8_full, args.b, torch.ones(4, 1024), torch.ones(4, 256),
                                        masked_m=torch.full((4,), 1024, dtype=torch.int32))
    assert native.preferred(masked_row)  # promoted fp8 (the default): the rows-per-group rule
    fast_masked = masked_row._replace(fast_accum=True)
    assert native.preferred(fast_masked) and native.config_for(fast_masked).pingpong  # K = 2048
    assert not native.preferred(fast_masked._replace(a=a8_full[:, :127], out=fast_masked.out[:, :127]))
    a8_deep = torch.empty(4, 1024, 2176, dtype=FP8)
    b8_deep = torch.empty(4, 256, 2176, dtype=FP8).transpose(1, 2)
    deep_masked = grouped.scaled_mm_args(a8_deep, b8_deep, torch.ones(4, 1024), torch.ones(4, 256),
                                         masked_m=torch.full((4,), 1024, dtype=torch.int32), use_fast_accum=True)
    assert not native.preferred(deep_masked)  # K > 2048
    a8 = torch.empty(4, 128, 2048, dtype=FP8)
    masked_block = grouped.scaled_mm_args(a8, args.b, torch.ones(4, 128, kb), sb,
                                          masked_m=torch.full((4,), 128, dtype=torch.int32))
    assert masked_block.scaling == grouped.GroupScaling.BLOCK and native.preferred(masked_block)


def test_native_refusals_name_the_reason(monkeypatch):
    e, m, k, n = 2, 256, 256, 256
    a = torch.empty(m, k, dtype=FP8)
    b = torch.empty(e, n, k, dtype=FP8).transpose(1, 2)
    offs = torch.tensor([100, 256], dtype=torch.int32)
    sa, sb = torch.ones(m), torch.ones(e, n)
    args = grouped.scaled_mm_args(a, b, sa, sb, offs=offs)
    assert "Hopper" in native.unsupported_reason(args)
    monkeypatch.setattr(native._device, "is_hopper", lambda device: True)
    assert native.unsupported_reason(args) is None
    # Experts that are not one stride apart (every other expert of a larger tensor).
    b_gaps = torch.empty(2 * e, n, k, dtype=FP8)[::2].transpose(1, 2)
    assert "stacked" in native.unsupported_reason(grouped.scaled_mm_args(a, b_gaps, sa, sb, offs=offs))
    sb_chan = torch.ones(e, n, 2)
    assert "per output channel" in native.unsupported_reason(grouped.scaled_mm_args(a, b, sa, sb_chan, offs=offs))
    h = torch.empty(m, 96, dtype=torch.float16)
    assert "N-major" in native.unsupported_reason(grouped.mm_args(h, torch.empty(e, 96, n, dtype=torch.float16),
                                                                   offs=offs))
    assert "zero-size" in native.unsupported_reason(grouped.scaled_mm_args(a[:, :0], b[:, :0], sa, sb, offs=offs))
    # Masked: row-wise scales are read by stacked row (experts one max_m apart); block scales at
    # any expert stride (DeepGEMM's (E, max_m, K/128), each expert's contiguous along its rows).
    a3 = torch.empty(e, 128, k, dtype=FP8)
    counts = torch.tensor([100, 128], dtype=torch.int32)
    sa_gaps = torch.ones(e, 132)[:, :128]
    assert "stacked" in native.unsupported_reason(grouped.scaled_mm_args(a3, b, sa_gaps, sb, masked_m=counts))
    sa_deepgemm = torch.ones(e, 2, 132)[:, :, :128].transpose(1, 2)
    sb_blocks = torch.ones(e, 2, 2)
    args = grouped.scaled_mm_args(a3, b, sa_deepgemm, sb_blocks, masked_m=counts)
    assert args.scale_a_strides == (264, 1, 132) and native.unsupported_reason(args) is None


@needs_nvrtc
@pytest.mark.parametrize("config, ab, out", [
    (_native_config(_PROMOTE, 256, block_scaled=True), FP8, torch.bfloat16),
    (_native_config(_PROMOTE, 64, block_scaled=True, cluster_m=1), FP8, torch.bfloat16),
    (_native_config(_PROMOTE, 8, cluster_m=1), FP8, torch.float32),
    (_native_config(_COOP, 8), FP8, torch.bfloat16),
    (_native_config(_PINGPONG, 8), FP8, torch.bfloat16),
    (_native_config(_COOP, 8), torch.bfloat16, torch.bfloat16),
], ids=["block_c2", "block_c1", "promote_c1_fp32", "fast_fp8", "fast_fp8_pingpong", "bf16"])
def test_native_builds_for_sm90a(config, ab, out):
    """The grouped kernel keeps the dense mainloop's properties (no spills, wgmmas not
    serialized) and has both stores: TMA for tiles inside a group, 16-byte stores at its end."""
    from tmagemm import jit

    module = native_gemm.compile_module(config, ab, out, True)
    sass = jit.sass(module.cubin)
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", sass)
    mma = [i for i, op in enumerate(ops) if "GMMA" in op]
    spills = [i for i, op in enumerate(ops) if op.startswith(("LDL", "STL"))]
    # No local memory in the mainloop. Outside it NVRTC 13.0 keeps one 4-byte value of the group
    # walk in local memory in the block-scaled single-CTA build (16 bytes of spill stores, read
    # and written with the tile walk, not per wgmma); every other build has none.
    assert not any(mma[0] <= i <= mma[-1] for i in spills), "local memory (spills) in the mainloop"
    spill_stores = max(map(int, re.findall(r"(\d+) bytes spill stores", module.log)), default=0)
    assert spill_stores == (16 if config.block_scaled and config.cluster_m == 1 else 0), module.log
    assert "are serialized" not in module.log
    assert "UTMASTG" in sass and "STG.E.128" in sass
    assert ("QGMMA" if ab == FP8 else "HGMMA") in sass
    # Single CTAs load light groups' weights with an L2 evict-first policy (2x1 clusters do not).
    hinted = "L2::cache_hint" in module.ptx and "L2::evict_first" in module.ptx
    assert hinted == (config.cluster_m == 1)


def test_native_a_comes_in_half_boxes():
    """Grouped builds (TMAGEMM_GROUPED, which gives the kernel kAHalfBoxes) load A as two 64-row
    boxes (the second skipped where the group ends within the tile's first 64 rows); one GEMM
    keeps one 128-row box."""
    for base in (_COOP, _PINGPONG, _PROMOTE):
        config = _native_config(base, 8)
        assert native_gemm.a_box_rows(config) == 64
        assert native_gemm._defines(config, FP8, torch.bfloat16, True)["TMAGEMM_GROUPED"] == 1
        assert native_gemm.a_box_rows(base) == 128
        assert native_gemm._defines(base, FP8, torch.bfloat16, True)["TMAGEMM_GROUPED"] == 0


# ----------------------------------------------------------- the native weight gradient


def _native_k_case(layout, counts, m, n, rows, dtype=torch.bfloat16, poison_group=None):
    """x.t() and dy of the weight gradient, and the float64 reference (E, M, N). ``counts``:
    contiguous offsets or masked counts; rows: K_total (contiguous) or rows per expert. NaN and
    Inf go into the rows no group covers and, with ``poison_group``, into that group's rows."""
    e = len(counts)
    k_total = rows if layout == GroupLayout.CONTIGUOUS else e * rows
    x = torch.randn(k_total, m, device="cuda").to(dtype)
    dy = torch.randn(k_total, n, device="cuda").to(dtype)
    spans = bounds(counts, layout, rows)
    if layout != GroupLayout.CONTIGUOUS:
        spans = [(g * rows + s_, g * rows + t) for g, (s_, t) in enumerate(spans)]
    covered = torch.zeros(k_total, dtype=torch.bool)
    for s_, t in spans:
        covered[s_:t] = True
    want = torch.zeros(e, m, n, dtype=torch.float64)
    for g, (s_, t) in enumerate(spans):
        want[g] = x[s_:t].double().cpu().t() @ dy[s_:t].double().cpu()
    x[~covered.cuda()] = float("nan")
    dy[~covered.cuda()] = float("inf")
    if poison_group is not None:
        s_, t = spans[poison_group]
        x[s_:t:5] = float("nan")
        dy[s_ + 1:t:5] = float("inf")
    return x, dy, want


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16_out", "fp32_out"])
@pytest.mark.parametrize("ctas", [3, 0], ids=["3_ctas", "one_per_sm"])
@pytest.mark.parametrize("layout, counts, m, n, rows", [
    (GroupLayout.CONTIGUOUS, [13, 13, 200, 330, 330, 900], 200, 264, 1000),  # empty, short, leftover rows, past the end
    (GroupLayout.CONTIGUOUS, [0, 640, 640], 128, 256, 640),  # one group takes all, whole k-blocks
    (GroupLayout.CONTIGUOUS, [500, 300, 2000, 1500], 136, 520, 1700),  # decreasing and past-the-end offsets
    (GroupLayout.MASKED, [5, 0, 130, 64, 200], 72, 264, 200),
    (GroupLayout.BATCHED, None, 64, 256, 100),
], ids=["ragged", "one_group", "bad_offsets", "masked", "batched"])
def test_gpu_native_weight_grad_matches_float64(layout, counts, m, n, rows, ctas, out_dtype, seeded):
    """The native weight gradient against float64 in every layout: empty groups give zeros,
    short groups (< 64 rows) and leftover rows take the edge rules, M and N off the tile, NaN and
    Inf in rows no group covers reach nothing; with 3 CTAs every CTA walks many items."""
    from tmagemm.cuda import grouped_k as native_k

    e = 3 if counts is None else len(counts)
    x, dy, want = _native_k_case(layout, counts if counts is not None else [rows] * e, m, n, rows)
    if layout == GroupLayout.CONTIGUOUS:
        args = grouped.reduce_args(x.t(), dy, counts_tensor(counts), out_dtype, out=poisoned((e, m, n), out_dtype))
    else:
        args = grouped.weight_grad_args(x.reshape(e, rows, m), dy.reshape(e, rows, n),
                                        masked_m=None if counts is None else counts_tensor(counts), out_dtype=out_dtype)
        args = args._replace(out=poisoned((e, m, n), out_dtype))
    assert native_k.unsupported_reason(args) is None
    grouped.run(args, config=native_k.GroupedKConfig(ctas=ctas))  # a GroupedKConfig picks the native kernel
    check(args.out, want, 1e-5 if out_dtype == torch.float32 else REL_HALF_OUT, f"{layout.name} ctas={ctas}")


@pytest.mark.gpu
@pytest.mark.parametrize("e, out_dtype", [(165, torch.bfloat16), (1024, torch.float32)], ids=["165_bf16", "1024_fp32"])
def test_gpu_native_weight_grad_with_many_groups(e, out_dtype, seeded):
    """Group tables large enough that the ring gives up a stage (165 groups with bf16 out, 1024
    with fp32 out: 3 stages), groups of 0-40 rows in random order."""
    from tmagemm.cuda import grouped_k as native_k

    counts = torch.randint(0, 41, (e,), generator=torch.Generator().manual_seed(e)).tolist()
    offs = list(itertools.accumulate(counts))
    x, dy, want = _native_k_case(GroupLayout.CONTIGUOUS, offs, 72, 264, offs[-1] + 3)
    config = native_k.DEFAULT.fitted(e, out_dtype.itemsize)
    assert config.stages == 3
    args = grouped.reduce_args(x.t(), dy, counts_tensor(offs), out_dtype, out=poisoned((e, 72, 264), out_dtype))
    assert native_k.preferred(args)  # what the dispatcher runs
    grouped.run(args)
    check(args.out, want, 1e-5 if out_dtype == torch.float32 else REL_HALF_OUT, f"{e} groups")


@pytest.mark.gpu
def test_gpu_native_weight_grad_keeps_other_groups_values_out(seeded):
    """NaN and Inf in one group's rows of x and dy reach no other group's gradient: a short
    group's box past its end and a long group's box ending at its last row."""
    from tmagemm.cuda import grouped_k as native_k

    offs = [40, 300, 330, 700]  # 40 rows (short), 260 (leftover 4), 30 (short), 370 (leftover 50)
    for poisoned_group in range(len(offs)):
        x, dy, want = _native_k_case(GroupLayout.CONTIGUOUS, offs, 128, 256, 700, poison_group=poisoned_group)
        args = grouped.reduce_args(x.t(), dy, counts_tensor(offs), torch.float32, out=poisoned((4, 128, 256)))
        grouped.run(args, config=native_k.GroupedKConfig(ctas=2))
        for g in range(len(offs)):
            if g != poisoned_group:
                check(args.out[g], want[g], 1e-5, f"group {g}, poison in {poisoned_group}")


@pytest.mark.gpu
def test_gpu_weight_grad_dispatch_takes_the_native_kernel(seeded):
    """grouped_mm(x.t(), dy, offs=...) and the autograd weight gradient run natively on Hopper;
    operands contiguous along K_total keep the Triton kernel."""
    x = torch.randn(304, 128, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(304, 256, device="cuda", dtype=torch.bfloat16)
    offs = counts_tensor([100, 304])
    plan.clear_plans()
    grouped_mm(x.t(), dy, offs=offs)
    assert [p.variant for p in grouped.cached_plans()] == ["cuda.grouped_k"]
    plan.clear_plans()
    grouped_mm(x.t().contiguous(), dy, offs=offs)
    assert [p.variant for p in grouped.cached_plans()] == ["triton.grouped_k"]


def test_native_weight_grad_refusals_name_the_reason(monkeypatch):
    from tmagemm.cuda import grouped_k as native_k

    x, dy = torch.empty(304, 128, dtype=torch.bfloat16), torch.empty(304, 256, dtype=torch.bfloat16)
    offs = torch.tensor([100, 304], dtype=torch.int32)
    args = grouped.reduce_args(x.t(), dy, offs)
    assert "Hopper" in native_k.unsupported_reason(args)
    monkeypatch.setattr(native_k._device, "is_hopper", lambda device: True)
    assert native_k.unsupported_reason(args) is None
    assert "contiguous along M" in native_k.unsupported_reason(grouped.reduce_args(x.t().contiguous(), dy, offs))
    many = torch.arange(1, 1026, dtype=torch.int32)
    assert "at most 1024" in native_k.unsupported_reason(grouped.reduce_args(x.t(), dy, many))
    strided = torch.empty(4, 128, 256, dtype=torch.bfloat16)[::2]
    assert "not stacked" in native_k.unsupported_reason(args._replace(out=strided))
    n_major = torch.empty(2, 256, 128, dtype=torch.bfloat16).transpose(1, 2)
    assert "contiguous" in native_k.unsupported_reason(args._replace(out=n_major))
    assert "zero-size" in native_k.unsupported_reason(grouped.reduce_args(x[:0].t(), dy[:0], offs))
    with pytest.raises(ValueError, match="cuda.grouped_k: a must be contiguous along M"):
        native_k.build(grouped.reduce_args(x.t().contiguous(), dy, offs))
    # Shared memory: four stages fit up to ~128 groups with 16-bit output; more groups take fewer.
    assert native_k.DEFAULT.fitted(64, 2).stages == 4 and native_k.DEFAULT.fitted(1024, 4).stages == 3
    assert all(native_k.DEFAULT.fitted(e, size).is_valid(e, size) for e in (1, 170, 256, 1024) for size in (2, 4))
    # Room for the ring's barriers in static shared memory: 170 groups no longer fit four stages.
    assert native_k.DEFAULT.fitted(170, 2).stages == 3


@needs_nvrtc
@pytest.mark.parametrize("ab, out", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)],
                         ids=["bf16", "fp16_fp32_out"])
def test_native_weight_grad_builds_for_sm90a(ab, out):
    """The native weight gradient compiled for sm_90a: wgmma reading both operands transposed
    (MN-major), not serialized, no spills, TMA loads and both stores (TMA inside a group's
    block, 16-byte stores where a fragment reaches the next expert's rows), PDL's wait before the
    first load."""
    from tmagemm import jit
    from tmagemm.cuda import grouped_k as native_k

    module = native_k.compile_module(ab, out, native_k.DEFAULT.fitted(256, out.itemsize))
    sass = jit.sass(module.cubin)
    assert "LDL" not in sass and "STL" not in sass, "local memory (spills) in the kernel"
    assert "are serialized" not in module.log
    assert "HGMMA" in sass and "UTMALDG" in sass and "UTMASTG" in sass and "STG.E.128" in sass
    body = module.ptx[module.ptx.index(".entry"):]
    assert ", p, 1, 1, 1, 1;" in body  # wgmma's imm-trans-a and imm-trans-b
    assert body.index("griddepcontrol.wait") < body.index("cp.async.bulk.tensor")
    assert body.index("cp.async.bulk.tensor") < body.index("griddepcontrol.launch_dependents")


# ------------------------------------------------------------------------ sm_90a, ahead of time


def test_groups_along_k_compile_for_sm90a():
    """The 2-D x 2-D (weight-gradient) kernel as the GPU runs it, compiled for sm_90a: TMA loads
    and stores, bf16 wgmma, no spills, PDL's wait before the first load and its trigger after the main loop,
    and a parameter list the direct launch can fill."""
    from tmagemm import inspection
    from tmagemm.triton import matmul_grouped_k as kernel
    from tmagemm.triton.common import HAS_GDC
    from tmagemm.triton.launch import parameter_plan

    art = inspection.compile_triton(kernel.aot_spec())
    s = inspection.summarize(art)
    assert s["sass UTMALDG"] > 0 and s["sass HGMMA"] > 0 and s["sass UTMASTG"] > 0, s
    assert art.spills == 0
    body = art.ptx[art.ptx.index(".entry"):]
    if HAS_GDC:
        wait = body.index("griddepcontrol.wait")
        assert body.index("cp.async.bulk.tensor") > wait and body.index("griddepcontrol.launch_dependents") > wait
    x, dy = torch.empty(4096, 2048, dtype=torch.bfloat16), torch.empty(4096, 7168, dtype=torch.bfloat16)
    call = kernel.kernel_call(grouped.reduce_args(x.t(), dy, torch.arange(1, 9, dtype=torch.int32) * 512),
                              kernel.DEFAULT)
    laid_out = parameter_plan(art.ptx, art.launch_metadata, call.positional, call.operand_slots, call.unspecialized)
    assert not isinstance(laid_out, str), laid_out


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_swapped_decode_tiles_compile_for_sm90a(dtype):
    """The swapped decode tiles as the GPU runs them, compiled for sm_90a: the weight's 128 rows in
    wgmma's M (two m64 instructions' worth) and 16 rows of A in its N slot (m64n16), TMA loads,
    no spills, and a parameter list the direct launch can fill."""
    from tmagemm import inspection
    from tmagemm.triton import matmul_grouped as kernel
    from tmagemm.triton.launch import parameter_plan

    a_dtype = FP8 if dtype == "fp8" else torch.bfloat16
    config = kernel.heuristic_for(1, dtype == "fp8", False, contiguous=True)
    assert config.swap_ab
    art = inspection.compile_triton(kernel.aot_spec(config, a_dtype))
    s = inspection.summarize(art)
    assert s["sass UTMALDG"] > 0 and s["sass QGMMA" if dtype == "fp8" else "sass HGMMA"] > 0, s
    shape = "m64n16k32" if dtype == "fp8" else "m64n16k16"
    assert f"wgmma.mma_async.sync.aligned.{shape}" in art.ptx, "tokens are not in wgmma's N slot"
    assert art.spills == 0
    args = grouped.example_args(a_dtype, e=8, rows=1)
    call = kernel.kernel_call(args, config)
    laid_out = parameter_plan(art.ptx, art.launch_metadata, call.positional, call.operand_slots, call.unspecialized)
    assert not isinstance(laid_out, str), laid_out
    assert call.grid == (kernel.tile_bound(args, 16, 128),)  # one tile per program
