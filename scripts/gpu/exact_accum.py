"""fp8 with fp32-promoted accumulation: ``tmagemm.scaled_mm(use_fast_accum=False)`` against
``torch._scaled_mm(use_fast_accum=False)``, and how far each accumulation mode is from float64.

    PYTHONPATH=src python scripts/gpu/exact_accum.py

Speed: N = K = 4096, tensor-wise scales, bf16 out; CUDA-graph replay, L2 flushed, median.
Accuracy: fp32 out, the worst |error| / (|A| @ |B|) and the relative Frobenius error against a
float64 product of the same fp8 inputs, for both libraries in both modes, at K = 4096 and 16384.
"""

from __future__ import annotations

import torch

import tmagemm
from tmagemm.bench.timing import Timer

FP8 = torch.float8_e4m3fn


def operands(m: int, n: int, k: int):
    a = (torch.randn(m, k, device="cuda") * 2).to(FP8)
    w = (torch.randn(n, k, device="cuda") * 2).to(FP8)
    one = torch.tensor(1.0, device="cuda")
    return a, w, one


def accuracy() -> None:
    print("accuracy, fp32 out: path | K | max err / (|A|@|B|) | rel Frobenius err")
    for k in (4096, 16384):
        a, w, one = operands(1024, 1024, k)
        ref = a.double() @ w.double().t()
        scale = a.double().abs() @ w.double().abs().t()
        for fast in (True, False):
            paths = {
                "cuBLAS": lambda: torch._scaled_mm(a, w.t(), one, one, out_dtype=torch.float32, use_fast_accum=fast),
                "tmagemm": lambda: tmagemm.scaled_mm(a, w.t(), one, one, out_dtype=torch.float32, use_fast_accum=fast),
            }
            for name, fn in paths.items():
                err = fn().double() - ref
                print(f"{name} {'fast' if fast else 'exact'} | {k} | {float((err.abs() / scale).max()):.2e} | "
                      f"{float(err.norm() / ref.norm()):.2e}", flush=True)


def speed() -> None:
    timer = Timer(torch.device("cuda"), budget_ms=60.0, min_reps=15, max_reps=80)
    print("M | cuBLAS fast us | cuBLAS exact us | ours exact us | exact ratio | err cuBLAS exact | err ours exact")
    for m in (16, 512, 1024, 2048, 4096, 8192):
        a, w, _ = operands(m, 4096, 4096)
        sa, sb = torch.tensor(0.5, device="cuda"), torch.tensor(2.0, device="cuda")
        ref = a.double() @ w.double().t()

        def peer(fast):
            return lambda: torch._scaled_mm(a, w.t(), sa, sb, out_dtype=torch.bfloat16, use_fast_accum=fast)

        def ours():
            return tmagemm.scaled_mm(a, w.t(), sa, sb, out_dtype=torch.bfloat16, use_fast_accum=False)

        errs = [((f().double() - ref).norm() / ref.norm()).item() for f in (peer(False), ours)]
        fast_us, exact_us, ours_us = (timer.graph(f).median_us for f in (peer(True), peer(False), ours))
        print(f"{m} | {fast_us:.1f} | {exact_us:.1f} | {ours_us:.1f} | {exact_us / ours_us:.3f} | "
              f"{errs[0]:.2e} | {errs[1]:.2e}", flush=True)


if __name__ == "__main__":
    accuracy()
    speed()
