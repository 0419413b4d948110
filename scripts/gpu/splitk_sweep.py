"""Which ``triton.splitk`` launch is fastest at M <= 64 with a 4096 x 4096 fp8 weight?

    PYTHONPATH=src python scripts/gpu/splitk_sweep.py [OUT_DIR]

Phase 1 times every candidate (block_n 64/128, split 1/2/4, 4/6/8 stages, fp8 accumulation
promoted per k-block or left to wgmma) once per M; phase 2 re-times the three fastest, the
heuristic's config and the ``triton.tma`` heuristic in five rounds alternating with cuBLAS
(``torch._scaled_mm(use_fast_accum=True)``, tensor-wise scales, bf16 out). Time: CUDA-graph
replay of one call, a 256 MB buffer zeroed before each replay (L2 flushed), median. Every
output is compared with cuBLAS's. Writes OUT_DIR/splitk_sweep.json and prints a table last.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import statistics
import sys

import torch

from tmagemm import device
from tmagemm.bench.timing import Timer
from tmagemm.dispatch import GemmArgs
from tmagemm.triton import matmul_splitk, matmul_tma
from tmagemm.triton.host import tma_layout, triton_launch

FP8 = torch.float8_e4m3fn
N = K = 4096
MS = (1, 16, 32, 64)


def candidates(m: int, sms: int) -> dict[str, matmul_splitk.SplitKConfig]:
    base = matmul_splitk.choose_config(m, N, K, FP8, sms)
    out = {"heuristic": base}
    for block_n, split, stages, fast in itertools.product((64, 128), (1, 2, 4), (4, 6, 8), (False, True)):
        config = dataclasses.replace(base, block_n=block_n, split_k=split, num_stages=stages, fast_accum=fast)
        if config.smem_bytes(1) > 200 * 1024:
            continue
        out[f"n{block_n}.x{split}.s{stages}{'.fast' if fast else ''}"] = config
    return out


def main(out_dir: str | None) -> None:
    timer = Timer(torch.device("cuda"), budget_ms=60.0, min_reps=15, max_reps=80)
    sms = device.sms_of(torch.device("cuda"))
    w = torch.randn(N, K, device="cuda").to(FP8)
    sa, sb = torch.tensor([0.5], device="cuda"), torch.tensor([0.25], device="cuda")
    rows = []
    for m in MS:
        a = torch.randn(m, K, device="cuda").to(FP8)

        def cublas():
            return torch._scaled_mm(a, w.t(), sa, sb, out_dtype=torch.bfloat16, use_fast_accum=True)

        ref = cublas().double()
        out = torch.empty(m, N, device="cuda", dtype=torch.bfloat16)
        args = GemmArgs(a, w.t(), out, sa, sb)
        calls = {name: (lambda c=c: matmul_splitk.run(args, c)) for name, c in candidates(m, sms).items()}
        tma = matmul_tma.heuristic(args)
        layout = tma_layout(args)
        calls["tma heuristic"] = lambda: triton_launch(matmul_tma.kernel_call(args, tma, layout))
        errors, phase1 = {}, {}
        for name, fn in calls.items():
            out.fill_(float("nan"))
            fn()
            errors[name] = ((out.double() - ref).norm() / ref.norm()).item()
            phase1[name] = timer.graph(fn).median_us
        base = timer.graph(cublas).median_us
        ranked = sorted((n for n in phase1 if n not in ("heuristic", "tma heuristic")), key=phase1.get)
        finalists = list(dict.fromkeys(ranked[:3] + ["heuristic", "tma heuristic"]))
        rounds = {name: [] for name in finalists + ["cuBLAS"]}
        for _ in range(5):
            for name in finalists:
                rounds["cuBLAS"].append(timer.graph(cublas).median_us)
                rounds[name].append(timer.graph(calls[name]).median_us)
        med = {name: statistics.median(v) for name, v in rounds.items()}
        row = dict(m=m, n=N, k=K, cublas_phase1_us=base, phase1_us=phase1, errors=errors, phase2_us=med,
                   configs={n: str(c) for n, c in candidates(m, sms).items()})
        rows.append(row)
        bad = [n for n, e in errors.items() if not e < 2e-2]
        print(f"M={m}: cuBLAS {med['cuBLAS']:.1f} us | " + " | ".join(
            f"{n} {med['cuBLAS'] / med[n]:.3f}" for n in finalists) + (f" | ERR {bad}" if bad else ""), flush=True)
        if out_dir:
            with open(os.path.join(out_dir, "splitk_sweep.json"), "w") as f:
                json.dump(dict(device=torch.cuda.get_device_name(), sms=sms, rows=rows), f, indent=1)
    print("\nM | cuBLAS us | heuristic | tma heuristic | fastest (ratio)")
    for row in rows:
        med = row["phase2_us"]
        best = min((n for n in med if n != "cuBLAS"), key=med.get)
        print(f"{row['m']} | {med['cuBLAS']:.1f} | {med['cuBLAS'] / med['heuristic']:.3f} | "
              f"{med['cuBLAS'] / med['tma heuristic']:.3f} | {best} ({med['cuBLAS'] / med[best]:.3f})")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT"))
