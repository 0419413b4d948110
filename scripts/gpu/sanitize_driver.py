"""Small ragged GEMMs through the public API, one launch each, for compute-sanitizer.

    compute-sanitizer --tool racecheck python scripts/gpu/sanitize_driver.py [substring of case names]

Run by scripts/gpu/check.sh (memcheck, racecheck, synccheck) with TMAGEMM_AUTOTUNE=0, so each
case launches only the kernel its heuristic picks. The cases reach every kernel family the
dispatcher picks at small shapes: the native cooperative kernel (``backend="cuda"``, with the
promoting fp8 mainloop of ``use_fast_accum=False``), the native decode kernel (M <= 16 on
weights of 2048 x 2048 or more, its K shared by clusters of 2 and 4 CTAs), and with ``backend="triton"`` split-K
(M = 1, long K), the tile kernel (M = 17) and the persistent kernel (M = 300); 16-bit inputs with
both B layouts; the fused gate/up projection (split and unsplit) feeding a block GEMM. Every
kernel is launched with programmatic dependent launch (the default). Shapes are off the tile sizes; the larger ones have more tiles than SMs, so
persistent CTAs walk several tiles. (The ping-pong schedule needs fp8 M >= 4096 with N, K >= 8192,
too large for the sanitizer; the grouped kernel's ping-pong tiles run here.) Grouped GEMMs run
both grouped kernels, the native one on each of its schedules, with counts that need clamping,
and the native weight gradient (groups along K) over short groups, leftover rows and bad offsets.
Each output is checked against float64; exits 1 if any case fails or is off.
"""

from __future__ import annotations

import sys

import torch

import tmagemm
from tmagemm import tma

FP8 = torch.float8_e4m3fn

# (backend, M, N, K, use_fast_accum, row-wise scales + bias)
FP8_CASES = [
    ("cuda", 200, 264, 208, True, False),
    ("cuda", 1100, 4112, 208, True, False),  # 9 x 17 tiles of 128x256 > 132 SMs
    ("cuda", 300, 520, 272, False, True),  # promoting mainloop (128x128, two scratch), row-wise scales, bias
    ("cuda", 1100, 2112, 272, False, True),  # promoting 128x256 tiles on clusters, N ends mid-tile
    ("cuda", 1, 3620, 3600, True, False),  # the decode kernel (n8 tiles, clusters of 2), N and K off its tiles
    ("cuda", 13, 3620, 3600, True, True),  # the decode kernel's n16 tiles, row-wise scales, bias
    ("cuda", 3, 2100, 4208, True, False),  # the decode kernel on 33 tiles: clusters of 4 share K
    ("triton", 1, 264, 4096, True, False),  # small M: split-K
    ("triton", 17, 520, 208, True, True),
    ("triton", 300, 264, 208, False, False),
]
# (backend, dtype, M, N, K, B K-major)
HALF_CASES = [
    ("cuda", torch.bfloat16, 300, 520, 208, False),
    ("cuda", torch.bfloat16, 1100, 4112, 208, True),
    ("cuda", torch.float16, 17, 264, 136, False),
    ("cuda", torch.bfloat16, 9, 3620, 3592, True),  # the decode kernel
    ("triton", torch.bfloat16, 17, 264, 136, True),
    ("triton", torch.float16, 300, 520, 208, False),
]
# Block-scaled fp8 (1x128 x 128x128): (backend, M, N, K); K = 700 has no tensor map (pointer loads).
BLOCK_CASES = [
    ("cuda", 300, 520, 576),  # 128x128 tiles with two scratch fragments
    ("cuda", 1100, 2112, 576),  # 128x256 tiles on clusters; the last tile's second half is past N
    # the same tiles loading the scales by TMA: a's along M and the weight's along K with padded
    # strides, in buffers ending at their last elements (boxes past them are zero-filled)
    ("cuda-maps", 1101, 2112, 576),
    ("triton", 17, 264, 576),
    ("triton", 5, 264, 700),
    ("triton", 3, 200, 4096),  # small M: split-K, 8 K slices
    ("cuda", 7, 2100, 8208),  # the decode kernel: clusters of 4, each CTA's scales in two chunks, K off the blocks
]
# Grouped GEMMs through the public API: (scaling, layout, E, rows of A (M_total or max_m), N, K,
# counts). The counts include decreasing offsets, offsets past M_total, counts past max_m and
# negative ones (clamped by the kernels, never read or written out of bounds).
GROUPED_CASES = [
    ("bf16", "contiguous", 3, 700, 264, 208, [300, 100, 900]),  # native kernel (234 rows per group)
    ("row_fast", "contiguous", 3, 700, 264, 208, [300, 100, 900]),  # native, ping-pong tiles (fast accumulation)
    ("block", "contiguous", 3, 800, 520, 576, [0, 350, 640]),  # native, 2x1 clusters, a pair past a group's end
    ("block", "masked", 4, 200, 264, 576, [200, 0, 500, -3]),  # native, masked
    ("block_mn", "masked", 4, 200, 264, 576, [200, 0, 500, -3]),  # native, DeepGEMM's expert-strided scales
    ("row", "contiguous", 4, 64, 264, 208, [10, 20, 20, 64]),  # Triton kernel, 64 x 256 tiles (16 rows per group)
    ("bf16", "contiguous", 6, 20, 264, 208, [5, 3, 12, 30, 20, 19]),  # swapped decode tiles, offsets decreasing and past M_total
    ("block", "masked", 4, 16, 264, 576, [16, -2, 3, 40]),  # swapped tiles, counts past max_m and negative
    ("row", "masked", 4, 32, 264, 208, [32, 1, 0, 40]),  # Triton, 64-row tiles
]
# Weight gradients (grouped GEMMs over K_total, the native kernel): (layout, E, rows (K_total or
# max_m), M, N, counts): short groups (one box past their end), leftover rows (the box ending at
# a group's last row), empty, decreasing and past-the-end offsets, counts past max_m.
WEIGHT_GRAD_CASES = [
    ("contiguous", 5, 1000, 136, 264, [40, 300, 250, 900, 1200]),
    ("masked", 3, 200, 72, 264, [130, 0, 500]),
]
# The fused gate/up projection (gate_up_silu_quant): (M, H, I); M = 3 splits K, M = 70 does not.
GATE_UP_CASES = [(3, 1000, 256), (70, 576, 384)]
TOL = 1e-2  # max|out - ref| / max|ref|; bf16 output rounding alone is ~4e-3
GATE_UP_TOL = 8e-2  # h is e4m3 (3 mantissa bits): up to 2^-4 relative per element


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).abs().max() / ref.abs().max())


def fp8_case(backend, m, n, k, fast, rowwise):
    a = torch.randn(m, k, device="cuda").to(FP8)
    b = torch.randn(n, k, device="cuda").to(FP8).t()
    if rowwise:
        sa, sb = torch.rand(m, 1, device="cuda") + 0.5, torch.rand(1, n, device="cuda") + 0.5
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    else:
        sa, sb, bias = torch.tensor(0.5, device="cuda"), torch.tensor(2.0, device="cuda"), None
    out = tmagemm.scaled_mm(a, b, sa, sb, bias=bias, use_fast_accum=fast, backend=backend)
    ref = (a.double() @ b.double()) * sa.double() * sb.double()
    return out, ref if bias is None else ref + bias.double()


def block_case(backend, m, n, k):
    kb, nb = -(-k // 128), -(-n // 128)
    a = torch.randn(m, k, device="cuda").to(FP8)
    w = torch.randn(n, k, device="cuda").to(FP8)
    sa, sb = torch.rand(m, kb, device="cuda") + 0.5, torch.rand(nb, kb, device="cuda") + 0.5
    if backend == "cuda-maps":
        backend, sa, sb = "cuda", tma.aligned_copy(sa, 0), tma.aligned_copy(sb, 1)
    out = tmagemm.scaled_mm(a, w.t(), sa, sb, backend=backend)
    per_k = torch.arange(k, device="cuda") // 128
    rows = torch.arange(n, device="cuda") // 128
    return out, (a.double() * sa.double()[:, per_k]) @ (w.double() * sb.double()[rows][:, per_k]).t()


def half_case(backend, dtype, m, n, k, k_major):
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    b = torch.randn(n, k, device="cuda", dtype=dtype).t() if k_major else torch.randn(k, n, device="cuda", dtype=dtype)
    return tmagemm.matmul(a, b, backend=backend), a.double() @ b.double()


def grouped_case(scaling, layout, e, rows, n, k, counts):
    """One grouped call; returns the rows its groups cover (stacked) against float64."""
    contiguous = layout == "contiguous"
    shape_a = (rows, k) if contiguous else (e, rows, k)
    w = torch.randn(e, n, k, device="cuda")
    if scaling == "bf16":
        a = torch.randn(*shape_a, device="cuda", dtype=torch.bfloat16)
        b = w.bfloat16().transpose(1, 2)
        a_deq, b_deq = a.double(), b.double()
    else:
        a, b = torch.randn(*shape_a, device="cuda").to(FP8), w.to(FP8).transpose(1, 2)
        kb, nb = -(-k // 128), -(-n // 128)
        per_k = torch.arange(k, device="cuda") // 128
        if scaling.startswith("block"):
            sa, sb = torch.rand(*shape_a[:-1], kb, device="cuda") + 0.5, torch.rand(e, nb, kb, device="cuda") + 0.5
            if scaling == "block_mn":  # each expert's scales contiguous along its rows, experts 4 rows padded apart
                sa = (torch.rand(e, kb, rows + 4, device="cuda") + 0.5)[:, :, :rows].transpose(1, 2)
            a_deq = a.double() * sa.double()[..., per_k]
            cols = torch.arange(n, device="cuda") // 128
            b_deq = b.double() * sb.double()[:, cols][:, :, per_k].transpose(1, 2)
        else:
            sa, sb = torch.rand(*shape_a[:-1], device="cuda") + 0.5, torch.rand(e, n, device="cuda") + 0.5
            a_deq, b_deq = a.double() * sa.double()[..., None], b.double() * sb.double()[:, None, :]
    kw = {"offs" if contiguous else "masked_m": torch.tensor(counts, dtype=torch.int32, device="cuda")}
    if scaling == "bf16":
        out = tmagemm.grouped_mm(a, b, **kw)
    else:
        out = tmagemm.grouped_scaled_mm(a, b, sa, sb, use_fast_accum=scaling == "row_fast", **kw)
    got, ref, end = [], [], 0
    for g, c in enumerate(counts):  # the documented row rule
        if contiguous:
            start, end = end, max(end, min(max(c, 0), rows))
            got.append(out[start:end])
            ref.append(a_deq[start:end] @ b_deq[g])
        else:
            t = min(max(c, 0), rows)
            got.append(out[g, :t])
            ref.append(a_deq[g, :t] @ b_deq[g])
    return torch.cat(got), torch.cat(ref)


def weight_grad_case(layout, e, rows, m, n, counts):
    """The weight gradient x_g^T @ dy_g of each group (grouped_mm's 2-D x 2-D form, or a masked
    layout's through weight_grad), stacked, against float64."""
    from tmagemm import grouped

    contiguous = layout == "contiguous"
    x = torch.randn(rows if contiguous else e * rows, m, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(x.shape[0], n, device="cuda", dtype=torch.bfloat16)
    counts_t = torch.tensor(counts, dtype=torch.int32, device="cuda")
    if contiguous:
        out = tmagemm.grouped_mm(x.t(), dy, offs=counts_t)
    else:
        out = grouped.weight_grad(x.reshape(e, rows, m), dy.reshape(e, rows, n), masked_m=counts_t)
    ref, end = [], 0
    for g, c in enumerate(counts):  # the documented row rule
        if contiguous:
            start, end = end, max(end, min(max(c, 0), rows))
        else:
            start, end = g * rows, g * rows + min(max(c, 0), rows)
        ref.append(x[start:end].double().t() @ dy[start:end].double())
    return out.reshape(-1, n), torch.cat(ref)


def gate_up_case(m, h, i):
    """Fused gate/up + SiLU*mul + 1x128 quantization, then a chained block GEMM on its output
    (PDL launches back to back); returns the dequantized h against float64."""
    x = torch.randn(m, h, device="cuda")
    xq, sx = tmagemm.quantize_fp8(x, "1x128")
    w = torch.randn(2 * i, h, device="cuda") / h**0.5
    wq, sw = tmagemm.quantize_fp8(w, "128x128")
    hq, hs = tmagemm.gate_up_silu_quant(xq, sx, wq, sw)
    down = torch.randn(64, i, device="cuda").to(FP8)
    tmagemm.scaled_mm(hq, down.t(), hs, torch.ones(1, -(-i // 128), device="cuda"), scale_recipe_a="1x128",
                      scale_recipe_b="128x128")
    per_k, per_i = torch.arange(h, device="cuda") // 128, torch.arange(i, device="cuda") // 128
    rows = torch.arange(2 * i, device="cuda") // 128
    xd = xq.double() * sx.double()[:, per_k]
    wd = wq.double() * sw.double()[rows][:, per_k]
    g, u = (xd @ wd.t()).split(i, dim=1)
    return hq.double() * hs.double()[:, per_i], g * torch.sigmoid(g) * u


def main() -> int:
    torch.manual_seed(0)
    cases = [(f"scaled_mm {c[0]} {c[1]}x{c[2]}x{c[3]} fast={c[4]} rowwise={c[5]}", fp8_case, c) for c in FP8_CASES]
    cases += [(f"matmul {c[0]} {str(c[1])[6:]} {c[2]}x{c[3]}x{c[4]} k_major={c[5]}", half_case, c) for c in HALF_CASES]
    cases += [(f"scaled_mm block {c[0]} {c[1]}x{c[2]}x{c[3]}", block_case, c) for c in BLOCK_CASES]
    cases += [(f"grouped {c[0]} {c[1]} E={c[2]} rows={c[3]} {c[4]}x{c[5]} counts={c[6]}", grouped_case, c)
              for c in GROUPED_CASES]
    cases += [(f"weight_grad {c[0]} E={c[1]} rows={c[2]} {c[3]}x{c[4]} counts={c[5]}", weight_grad_case, c)
              for c in WEIGHT_GRAD_CASES]
    cases += [(f"gate_up_silu_quant {c[0]}x{c[1]} I={c[2]}", gate_up_case, c) for c in GATE_UP_CASES]
    if len(sys.argv) > 1:  # a substring of the case names: only those
        cases = [c for c in cases if sys.argv[1] in c[0]]
    failed = 0
    for name, make, params in cases:
        try:
            out, ref = make(*params)
            torch.cuda.synchronize()
            err = rel_err(out, ref)
            status = "ok" if err <= (GATE_UP_TOL if make is gate_up_case else TOL) else "OFF"
            print(f"{status:4s} {name}: rel err {err:.1e}", flush=True)
        except Exception as exc:  # report and go on: the sanitizer report covers the other cases
            status = "FAIL"
            print(f"FAIL {name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        failed += status != "ok"
    print(f"sanitize_driver: {len(cases) - failed}/{len(cases)} cases ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
