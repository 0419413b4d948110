"""Measurement-only peer: DeepGEMM's block-scaled FP8 GEMM against tmagemm and cuBLAS, one process.

    bash scripts/peers/deepgemm/build.sh /path/to/DeepGEMM              # once, on the GPU machine
    PYTHONPATH=src:/path/to/DeepGEMM python scripts/peers/deepgemm/deepgemm_peer.py OUT_DIR \
        [--m 64,128,4096] [--grouped] [--budget-ms 25]

Problems: the block preset's DeepSeek-V3 shapes (tmagemm.bench.shapes.BLOCK_LAYERS, DeepGEMM's
own six) at each M. Operands: a (M, K) e4m3, w (N, K) e4m3, 1x128 scales of a (M, K/128) and
128x128 scales of w (N/128, K/128), fp32, random in [0.5, 1.5); bf16 output. Providers:

* ``tmagemm``: ``tmagemm.scaled_mm(a, w.t(), sa, sw)`` (the public API, its own dispatch), sa
  row-major (what tmagemm.quantize_fp8 gives);
* ``tmagemm.mn``: the same call with sa in DeepGEMM's layout (contiguous along M, the column
  stride M rounded up to 4), the very input DeepGEMM's kernel reads (dense problems);
* ``deepgemm``: ``deep_gemm.fp8_gemm_nt((a, sa'), (w, sw), out)`` (DeepGEMM 2.x; 1.x names it
  ``gemm_fp8_fp8_bf16_nt``), with sa' = sa in the MN-major, TMA-aligned layout DeepGEMM's SM90
  kernel reads (converted once, outside timing: a caller would quantize straight into it), fp32
  scales (no UE8M0 rounding);
* ``cublas``: ``torch.nn.functional.scaled_mm`` with BlockWise1x128 / BlockWise128x128.

With ``--grouped``, DeepGEMM's grouped problems instead (the shapes of its published tables):
contiguous, E groups of m rows ((E * m, K) activations, (E, N, K) weights; DeepGEMM's
``m_grouped_gemm_fp8_fp8_bf16_nt_contiguous`` with per-row group indices, tmagemm's
``grouped_scaled_mm(..., offs=...)``) and masked (E, max_m, K) with every row valid (DeepGEMM's
``..._masked`` with expected_m = max_m, tmagemm's ``masked_m=``); both block-scaled, tmagemm
timed with row-major activation scales and (``tmagemm.mn``) with DeepGEMM's own scale tensor.
cuBLAS has no block-scaled grouped GEMM. Grouped outputs are checked on each group's first 128 rows.

Every output is checked against the float64 block dequantization (max |error| / max |ref| <=
1e-2) in the same run. Times: tmagemm.bench.timing.Timer.graph (CUDA-graph replay, L2 flushed,
median), in two alternating rounds. Writes OUT_DIR/deepgemm_peer.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

import tmagemm
from tmagemm import tma
from tmagemm.bench import envinfo, providers
from tmagemm.bench.shapes import BLOCK_LAYERS, Shape
from tmagemm.bench.timing import Timer

TOL = providers.TOLERANCE["fp8-block"]
FP8 = torch.float8_e4m3fn
DEEPSEEK = [layer for layer in BLOCK_LAYERS if layer[0].startswith("deepseek-v3")]


def log(*args) -> None:
    print(*args, flush=True)


def dense_calls(case: providers.Case, deep_gemm) -> dict:
    """name -> zero-argument call returning its output, for one dense case."""
    found = {}
    out = case.empty_out()
    found["tmagemm"] = lambda: tmagemm.scaled_mm(case.a, case.b, case.scale_a, case.scale_b,
                                                 out_dtype=torch.bfloat16, out=out)
    sa_mn = tma.aligned_copy(case.scale_a, 0)  # DeepGEMM's layout: contiguous along M
    out_mn = case.empty_out()
    found["tmagemm.mn"] = lambda: tmagemm.scaled_mm(case.a, case.b, sa_mn, case.scale_b, out_dtype=torch.bfloat16,
                                                    out=out_mn)
    if deep_gemm is not None:
        w = case.b.t()  # (N, K) row-major
        d = case.empty_out()
        if hasattr(deep_gemm, "fp8_gemm_nt"):  # DeepGEMM 2.x (C++ extension)
            sa = deep_gemm.get_mn_major_tma_aligned_tensor(case.scale_a)
            found["deepgemm"] = lambda: (deep_gemm.fp8_gemm_nt((case.a, sa), (w, case.scale_b), d, recipe=(1, 128, 128),
                                                               disable_ue8m0_cast=True), d)[1]
        else:  # DeepGEMM 1.x (Python JIT): the same kernel family under its first name
            sa = deep_gemm.get_col_major_tma_aligned_tensor(case.scale_a)
            found["deepgemm"] = lambda: (deep_gemm.gemm_fp8_fp8_bf16_nt((case.a, sa), (w, case.scale_b), d), d)[1]
    try:
        found["cublas"] = providers._cublas_fp8_block(case).call
    except providers.Unsupported:
        pass
    return found


# DeepGEMM's grouped tables: (E, rows per group, N, K).
GROUPED_CONTIGUOUS = [(4, 8192, 4096, 7168), (4, 8192, 7168, 2048), (8, 4096, 4096, 7168), (8, 4096, 7168, 2048)]
GROUPED_MASKED = [(1, 1024, 4096, 7168), (1, 1024, 7168, 2048), (2, 512, 4096, 7168), (2, 512, 7168, 2048),
                  (4, 256, 4096, 7168), (4, 256, 7168, 2048)]
CHECKED_ROWS = 128


def grouped_problem(layout: str, e: int, rows: int, n: int, k: int, deep_gemm, device) -> dict:
    """Operands, calls and a check for one grouped problem (block-scaled, bf16 out)."""
    kb, nb = -(-k // 128), -(-n // 128)
    w = torch.randn(e, n, k, device=device).to(FP8)
    sb = torch.rand(e, nb, kb, device=device) + 0.5
    if layout == "contiguous":
        a = torch.randn(e * rows, k, device=device).to(FP8)
        sa = torch.rand(e * rows, kb, device=device) + 0.5
        offs = torch.arange(1, e + 1, device=device, dtype=torch.int32) * rows
        out_shape = (e * rows, n)
    else:
        a = torch.randn(e, rows, k, device=device).to(FP8)
        sa = torch.rand(e, rows, kb, device=device) + 0.5
        masked_m = torch.full((e,), rows, device=device, dtype=torch.int32)
        out_shape = (e, rows, n)
    ours = torch.empty(out_shape, device=device, dtype=torch.bfloat16)
    calls = {}
    if layout == "contiguous":
        calls["tmagemm"] = lambda: tmagemm.grouped_scaled_mm(a, w.transpose(1, 2), sa, sb, offs=offs, out=ours)
    else:
        calls["tmagemm"] = lambda: tmagemm.grouped_scaled_mm(a, w.transpose(1, 2), sa, sb, masked_m=masked_m,
                                                             out=ours)
    if deep_gemm is not None:
        theirs = torch.empty(out_shape, device=device, dtype=torch.bfloat16)
        sa_dg = deep_gemm.get_col_major_tma_aligned_tensor(sa)
        # tmagemm given DeepGEMM's own activation-scale tensor (contiguous along the rows).
        counts = {"offs": offs} if layout == "contiguous" else {"masked_m": masked_m}
        calls["tmagemm.mn"] = lambda: tmagemm.grouped_scaled_mm(a, w.transpose(1, 2), sa_dg, sb, out=ours, **counts)
        if layout == "contiguous":
            m_indices = torch.arange(e, device=device, dtype=torch.int32).repeat_interleave(rows)
            calls["deepgemm"] = lambda: (deep_gemm.m_grouped_gemm_fp8_fp8_bf16_nt_contiguous(
                (a, sa_dg), (w, sb), theirs, m_indices), theirs)[1]
        else:
            calls["deepgemm"] = lambda: (deep_gemm.m_grouped_gemm_fp8_fp8_bf16_nt_masked(
                (a, sa_dg), (w, sb), theirs, masked_m, rows), theirs)[1]

    def check(out: torch.Tensor) -> float:
        worst = 0.0
        for g in range(e):
            rows_g = slice(g * rows, g * rows + CHECKED_ROWS) if layout == "contiguous" else (g, slice(0, CHECKED_ROWS))
            per_k = torch.arange(k, device=device) // 128
            ref = (a[rows_g].double() * sa[rows_g].double()[:, per_k]) @ (
                w[g].double() * sb[g].double()[torch.arange(n, device=device) // 128][:, per_k]).t()
            got = out[rows_g].double()
            if not torch.isfinite(got).all():
                return float("inf")
            worst = max(worst, ((got - ref).abs().max() / ref.abs().max()).item())
        return worst

    label = f"{layout} {e}x{rows}"
    return {"label": label, "m": e * rows, "n": n, "k": k, "calls": calls, "check": check}


def dense_problem(m: int, label: str, n: int, k: int, deep_gemm, device) -> dict:
    case = providers.make_case(Shape(m, n, k, label), "fp8-block", device)
    return {"label": label, "m": m, "n": n, "k": k, "calls": dense_calls(case, deep_gemm),
            "check": lambda out: providers.relative_error(out, case)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--m", default="64,128,4096", help="comma-separated M values")
    parser.add_argument("--grouped", action="store_true", help="DeepGEMM's grouped problems instead of dense ones")
    parser.add_argument("--budget-ms", type=float, default=25.0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    # DeepGEMM's JIT reads $HOME for its default cache even when DG_JIT_CACHE_DIR is set, and
    # crashes without it (as on machines that run jobs with an empty environment).
    os.environ.setdefault("DG_JIT_CACHE_DIR", str(Path(tempfile.gettempdir()) / "deep_gemm_cache"))
    os.environ.setdefault("HOME", os.environ["DG_JIT_CACHE_DIR"])
    try:
        import deep_gemm
    except ImportError as exc:  # say so and still time the others
        log(f"deep_gemm not importable ({exc}); run build.sh and put the checkout on PYTHONPATH")
        deep_gemm = None
    timer = Timer(device, budget_ms=args.budget_ms)
    records = []
    if args.grouped:
        problems = ((grouped_problem, ("contiguous", *shape)) for shape in GROUPED_CONTIGUOUS)
        problems = [*problems, *((grouped_problem, ("masked", *shape)) for shape in GROUPED_MASKED)]
    else:
        problems = [(dense_problem, (m, *layer)) for m in (int(v) for v in args.m.split(",")) for layer in DEEPSEEK]
    for build, spec in problems:
        problem = build(*spec, deep_gemm, device)
        row = {key: problem[key] for key in ("label", "m", "n", "k")}
        row.update(us={}, error={}, status={})
        runs = problem["calls"]
        for name, fn in runs.items():
            try:
                err = problem["check"](fn())
                torch.cuda.synchronize()
                row["error"][name] = err
                row["status"][name] = "ok" if err <= TOL else "wrong"
            except Exception as exc:  # a refusal (cuBLAS at M = 1) or a failed JIT build
                row["status"][name] = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
        timed = {name: [] for name in runs if row["status"][name] == "ok"}
        for _ in range(2):
            for name in timed:
                timed[name].append(timer.graph(runs[name]).median_us)
        row["us"] = {name: statistics.median(v) for name, v in timed.items()}
        records.append(row)
        cells = " ".join(f"{name}={row['us'].get(name, float('nan')):.1f}" for name in runs)
        log(f"{row['label']} {row['m']}x{row['n']}x{row['k']} {cells} {row['status']}")
        del problem, runs
    meta = envinfo.metadata(" ".join(sys.argv))
    if deep_gemm is not None:
        commit = Path(deep_gemm.__file__).resolve().parents[1] / "deep_gemm_commit.txt"
        meta["deep_gemm"] = commit.read_text().strip() if commit.exists() else getattr(deep_gemm, "__version__", "?")
    (args.out / "deepgemm_peer.json").write_text(json.dumps({"metadata": meta, "records": records}, indent=1))

    log("\nproblem | M x N x K | tmagemm us | DeepGEMM us | cuBLAS us | TFLOP/s tmagemm / DeepGEMM | tmagemm vs DeepGEMM | vs cuBLAS")
    ratios: dict[str, list[float]] = {"deepgemm": [], "cublas": [], "deepgemm (same scale layout)": []}
    for r in records:
        us = r["us"]
        ours = us.get("tmagemm")
        flops = 2 * r["m"] * r["n"] * r["k"]
        cells = []
        for peer in ("deepgemm", "cublas"):
            if ours and us.get(peer):
                ratios[peer].append(us[peer] / ours)
                cells.append(f"{us[peer] / ours:.2f}x")
            else:
                cells.append(r["status"].get(peer, "-")[:30])
        if us.get("tmagemm.mn") and us.get("deepgemm"):
            ratios["deepgemm (same scale layout)"].append(us["deepgemm"] / us["tmagemm.mn"])
        tf = " / ".join(f"{flops / us[p] / 1e6:.0f}" if us.get(p) else "-" for p in ("tmagemm", "deepgemm"))
        log(f"{r['label']} | {r['m']}x{r['n']}x{r['k']} | {ours or float('nan'):.1f} | {us.get('deepgemm', float('nan')):.1f} | "
            f"{us.get('cublas', float('nan')):.1f} | {tf} | {cells[0]} | {cells[1]}")
    for peer, values in ratios.items():
        if values:
            log(f"geomean tmagemm speed vs {peer}: {math.exp(sum(map(math.log, values)) / len(values)):.3f} "
                f"({len(values)} cells)")
    for layout in ("contiguous", "masked") if args.grouped else ():
        for ours_name in ("tmagemm", "tmagemm.mn"):
            values = [r["us"]["deepgemm"] / r["us"][ours_name] for r in records
                      if r["label"].startswith(layout) and r["us"].get("deepgemm") and r["us"].get(ours_name)]
            if values:
                log(f"geomean {ours_name} speed vs deepgemm, {layout}: "
                    f"{math.exp(sum(map(math.log, values)) / len(values)):.3f} ({len(values)} cells, "
                    f"{min(values):.3f}-{max(values):.3f})")
    if ratios["deepgemm (same scale layout)"]:
        log("(same scale layout: tmagemm.mn, whose activation scales are DeepGEMM's own input)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
