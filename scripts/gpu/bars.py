"""The issues' speed bars, measured the way they are stated: the public API against cuBLAS, side by
side, in alternating rounds.

    PYTHONPATH=src python scripts/gpu/bars.py [OUT_DIR] [--rounds 7]

Shapes: fp8 N = K = 4096 at M = 16..8192 and 8192^3 (``tmagemm.scaled_mm`` vs
``torch._scaled_mm(use_fast_accum=True)``, tensor-wise scales, bf16 out, B = w.t()); bf16 and
fp16 M = N = K in {2048, 4096, 6144, 8192} (``tmagemm.matmul`` vs ``torch.matmul``, row-major
B). Each round times cuBLAS and then tmagemm (CUDA-graph replay of one call, 256 MB zeroed
before each replay, median of the replays), so every ratio pairs two measurements taken at the
same clocks; the table gives the median ratio over the rounds and its range. Outputs are
compared with cuBLAS's before timing. Writes OUT_DIR/bars.json; prints the table last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

import tmagemm
from tmagemm.bench.timing import Timer

FP8 = torch.float8_e4m3fn


def fp8_case(m: int, n: int, k: int):
    a = torch.randn(m, k, device="cuda").to(FP8)
    w = torch.randn(n, k, device="cuda").to(FP8)
    sa, sb = torch.tensor(0.5, device="cuda"), torch.tensor(2.0, device="cuda")
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    peer = lambda: torch._scaled_mm(a, w.t(), sa, sb, out_dtype=torch.bfloat16, use_fast_accum=True)  # noqa: E731
    ours = lambda: tmagemm.scaled_mm(a, w.t(), sa, sb, out=out)  # noqa: E731
    return peer, ours, out


def half_case(dtype: torch.dtype, s: int):
    a = torch.randn(s, s, device="cuda", dtype=dtype)
    b = torch.randn(s, s, device="cuda", dtype=dtype)
    out = torch.empty(s, s, device="cuda", dtype=dtype)
    return (lambda: torch.matmul(a, b)), (lambda: tmagemm.matmul(a, b, out=out)), out


def cases():
    for m in (16, 64, 128, 256, 512, 1024, 2048, 4096, 8192):
        yield "fp8", (m, 4096, 4096), lambda m=m: fp8_case(m, 4096, 4096)
    yield "fp8", (8192, 8192, 8192), lambda: fp8_case(8192, 8192, 8192)
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
        for s in (2048, 4096, 6144, 8192):
            yield name, (s, s, s), lambda dtype=dtype, s=s: half_case(dtype, s)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir", nargs="?", default=os.environ.get("OUT"))
    parser.add_argument("--rounds", type=int, default=7)
    opts = parser.parse_args()
    timer = Timer(torch.device("cuda"), budget_ms=60.0, min_reps=10, max_reps=80)
    rows = []
    for family, shape, make in cases():
        peer, ours, out = make()
        ref = peer().double()
        out.fill_(float("nan"))
        ours()
        err = float((out.double() - ref).abs().max() / ref.abs().max())
        ratios, peer_us, ours_us = [], [], []
        for _ in range(opts.rounds):
            p, o = timer.graph(peer).median_us, timer.graph(ours).median_us
            peer_us.append(p)
            ours_us.append(o)
            ratios.append(p / o)
        row = dict(family=family, shape=shape, err_vs_cublas=err, peer_us=peer_us, ours_us=ours_us, ratios=ratios,
                   median_ratio=statistics.median(ratios))
        rows.append(row)
        print(f"{family} {shape}: cuBLAS {statistics.median(peer_us):.1f} us, ratio {row['median_ratio']:.3f} "
              f"({min(ratios):.3f}-{max(ratios):.3f}), err {err:.1e}", flush=True)
        if opts.out_dir:
            with open(os.path.join(opts.out_dir, "bars.json"), "w") as f:
                json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)
    print("\n| family | M, N, K | cuBLAS us | tmagemm / cuBLAS speed, median (range) | max err vs cuBLAS |")
    print("|---|---|---:|---|---:|")
    for r in rows:
        print(f"| {r['family']} | {', '.join(map(str, r['shape']))} | {statistics.median(r['peer_us']):.1f} | "
              f"{r['median_ratio']:.3f} ({min(r['ratios']):.3f}-{max(r['ratios']):.3f}) | {r['err_vs_cublas']:.1e} |")


if __name__ == "__main__":
    main()
