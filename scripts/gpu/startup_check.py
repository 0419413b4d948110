"""First-call latency at new batch sizes, the measure of "no call-time stalls".

Run it twice in fresh processes: the first run fills the on-disk caches (Triton's, NVRTC cubins),
the second shows what a restarted server sees. Each run times `tmagemm.warmup` for the weight
shapes, then the first call at 16 M values warm-up never planned, then (with --cold) the first
calls of the same M values in a process state without warm-up for comparison of the worst case.

    python scripts/gpu/startup_check.py [--shapes 4096x4096,7168x2048] [--no-warmup]
"""

from __future__ import annotations

import argparse
import time

import torch

import tmagemm

NEW_M = (3, 7, 13, 24, 37, 50, 77, 100, 150, 200, 300, 333, 500, 777, 1500, 2000)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="4096x4096,7168x2048")
    parser.add_argument("--no-warmup", action="store_true", help="time first calls without a warm-up")
    opts = parser.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in opts.shapes.split(",")]
    t0 = time.perf_counter()
    if not opts.no_warmup:
        summary = tmagemm.warmup(shapes, dtypes=["fp8", "bf16"], max_m=2048, progress=False)
        print(f"startup warmup: {summary.line()} (wall {time.perf_counter() - t0:.1f} s)")
    worst = []
    for n, k in shapes:
        w8 = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
        w16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()  # nn.Linear weight.t()
        sb = torch.rand(1, n, device="cuda") + 0.5
        for m in NEW_M:
            x8 = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
            x16 = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            sa = torch.rand(m, 1, device="cuda") + 0.5
            for name, call in (("fp8", lambda: tmagemm.scaled_mm(x8, w8.t(), sa, sb)),
                               ("bf16", lambda: tmagemm.matmul(x16, w16))):
                torch.cuda.synchronize()
                start = time.perf_counter()
                call()
                torch.cuda.synchronize()
                worst.append(((time.perf_counter() - start) * 1e3, f"{name} N={n} K={k} M={m}"))
    worst.sort(reverse=True)
    times = sorted(ms for ms, _ in worst)
    print(f"startup first calls ({'no warmup' if opts.no_warmup else 'after warmup'}): {len(worst)} calls, "
          f"median {times[len(times) // 2]:.2f} ms, max {worst[0][0]:.2f} ms ({worst[0][1]}), "
          f"next {worst[1][0]:.2f} ms ({worst[1][1]})")


if __name__ == "__main__":
    main()
