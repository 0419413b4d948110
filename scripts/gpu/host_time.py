"""Host time per call of the public API next to PyTorch's own ops (the issue's host-time figure).

The GPU is kept busy by a long queue of large matmuls issued first, so the timed calls never wait
for it: what is timed is Python, argument checks, planning lookups and the launch itself. Run it
once per library version to compare (e.g. PYTHONPATH=src vs a checkout of an older commit); it
prints one line per case: median and range over rounds, in microseconds per call.

    python scripts/gpu/host_time.py [--m 1,16,256] [--n 4096] [--k 4096] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import tmagemm


def per_call_us(fn, calls: int, busy: torch.Tensor) -> float:
    for _ in range(20):  # planned, compiled, tensor maps encoded
        fn()
    torch.cuda.synchronize()
    for _ in range(calls // 10 + 8):  # ~ms of queued GPU work: the calls below never wait
        busy @ busy
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    spent = time.perf_counter() - t0
    torch.cuda.synchronize()
    return spent / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", default="1,16,256")
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=400)
    opts = parser.parse_args()
    n, k = opts.n, opts.k
    busy = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    w8 = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
    w16 = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    sb = torch.rand(1, n, device="cuda") + 0.5
    for m in (int(v) for v in opts.m.split(",")):
        x8 = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
        x16 = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        sa = torch.rand(m, 1, device="cuda") + 0.5
        cases = {
            "tmagemm.scaled_mm": lambda: tmagemm.scaled_mm(x8, w8.t(), sa, sb),
            "torch._scaled_mm": lambda: torch._scaled_mm(x8, w8.t(), sa, sb, out_dtype=torch.bfloat16),
            "tmagemm.matmul": lambda: tmagemm.matmul(x16, w16),
            "torch.mm": lambda: torch.mm(x16, w16),
        }
        rounds = {name: [] for name in cases}
        for _ in range(opts.rounds):  # alternate, so drift hits every case alike
            for name, fn in cases.items():
                rounds[name].append(per_call_us(fn, opts.calls, busy))
        for name, values in rounds.items():
            print(f"host_time M={m:<5} {name:<18} {statistics.median(values):6.2f} us/call "
                  f"(range {min(values):.2f}-{max(values):.2f}, {opts.rounds} rounds)")


if __name__ == "__main__":
    main()
