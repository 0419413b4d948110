"""First-call latency at new batch sizes, the measure of "no call-time stalls".

Run it twice in fresh processes: the first run fills the on-disk caches (Triton's, NVRTC cubins),
the second shows what a restarted server sees. Each run times `tmagemm.warmup` for the weight
shapes, then the first call at 16 M values warm-up never planned (with --no-warmup: the same
first calls without a warm-up, the worst case). Each call's time and the garbage collection
inside it are printed for the slowest four.

    python scripts/gpu/startup_check.py [--shapes 4096x4096,7168x2048] [--no-warmup] [--block]
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

import tmagemm

NEW_M = (3, 7, 13, 24, 37, 50, 77, 100, 150, 200, 300, 333, 500, 777, 1500, 2000)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="4096x4096,7168x2048")
    parser.add_argument("--no-warmup", action="store_true", help="time first calls without a warm-up")
    parser.add_argument("--block", action="store_true",
                        help="also fp8 with 1x128 x 128x128 block scales (warm-up scales row and block)")
    opts = parser.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in opts.shapes.split(",")]
    t0 = time.perf_counter()
    if not opts.no_warmup:
        scales = ["row", "block"] if opts.block else ["row"]
        summary = tmagemm.warmup(shapes, dtypes=["fp8", "bf16"], scales=scales, max_m=2048, progress=False)
        print(f"startup warmup: {summary.line()} (wall {time.perf_counter() - t0:.1f} s)")
    gc_ms, gc_start = [0.0], [0.0]

    def time_collections(phase: str, _info: dict) -> None:  # garbage collection inside a timed call
        if phase == "start":
            gc_start[0] = time.perf_counter()
        else:
            gc_ms[0] += (time.perf_counter() - gc_start[0]) * 1e3

    gc.callbacks.append(time_collections)
    worst = []
    for n, k in shapes:
        w8 = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
        w16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()  # nn.Linear weight.t()
        sb = torch.rand(1, n, device="cuda") + 0.5
        sb_block = torch.rand(-(-n // 128), -(-k // 128), device="cuda") + 0.5
        for m in NEW_M:
            x8 = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
            x16 = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            sa = torch.rand(m, 1, device="cuda") + 0.5
            sa_block = torch.rand(m, -(-k // 128), device="cuda") + 0.5
            calls = [("fp8", lambda: tmagemm.scaled_mm(x8, w8.t(), sa, sb)),
                     ("bf16", lambda: tmagemm.matmul(x16, w16))]
            if opts.block:
                calls.append(("fp8-block", lambda: tmagemm.scaled_mm(x8, w8.t(), sa_block, sb_block)))
            for name, call in calls:
                torch.cuda.synchronize()
                gc_ms[0], start = 0.0, time.perf_counter()
                call()
                torch.cuda.synchronize()
                worst.append(((time.perf_counter() - start) * 1e3, f"{name} N={n} K={k} M={m}, gc {gc_ms[0]:.1f} ms"))
    worst.sort(reverse=True)
    times = sorted(ms for ms, _ in worst)
    slowest = ", ".join(f"{ms:.2f} ms ({what})" for ms, what in worst[:4])
    print(f"startup first calls ({'no warmup' if opts.no_warmup else 'after warmup'}): {len(worst)} calls, "
          f"median {times[len(times) // 2]:.2f} ms; slowest: {slowest}")


if __name__ == "__main__":
    main()
