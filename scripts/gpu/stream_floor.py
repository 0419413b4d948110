"""How fast can a small-M GEMM be? The weight has to be read once, so the floor is the time the
device takes to stream that many bytes. This measures, side by side in one process (graph replays,
L2 flushed between them, median): a plain read of the weight's bytes (torch sum), a device copy of
the same bytes, cuBLAS fp8 / bf16 and tmagemm at small M, and the large-copy bandwidth the issue's
"% of copy bandwidth" refers to.

``PYTHONPATH=src python scripts/gpu/stream_floor.py``; writes $OUT/stream_floor.json when OUT is set.
"""

from __future__ import annotations

import json
import os

import torch

import tmagemm
from tmagemm.bench.shapes import LLM_LAYERS
from tmagemm.bench.timing import Timer, copy_bandwidth_gbs

FP8 = torch.float8_e4m3fn
SHAPES = {"4096x4096": (4096, 4096), **{label: (n, k) for label, n, k in LLM_LAYERS}}


def main():
    timer = Timer(torch.device("cuda"))
    dev = torch.device("cuda")
    copy_gbs = copy_bandwidth_gbs(dev)
    rows = []
    print(f"large copy bandwidth (read + write): {copy_gbs:.0f} GB/s")
    # What any graph-timed launch costs here (launch, events, flush aftermath): an empty kernel.
    empty_us = timer.graph(lambda: torch.cuda._sleep(1)).median_us
    print(f"empty kernel: {empty_us:.1f} us")
    for label, (n, k) in SHAPES.items():
        weight = torch.randn(n, k, device="cuda").to(FP8)
        as_int = weight.view(torch.int32)
        sink = torch.empty_like(weight)
        read_us = timer.graph(lambda: as_int.sum(dtype=torch.int64)).median_us
        copy_us = timer.graph(lambda: sink.copy_(weight)).median_us
        write_us = timer.graph(lambda: sink.zero_()).median_us
        floor_us = min(read_us, copy_us / 2)
        print(f"{label}: weight {weight.numel() / 1e6:.1f} MB fp8; read {read_us:.1f} us, copy {copy_us:.1f} us, "
              f"write {write_us:.1f} us")
        for m in (1, 16, 64, 128):
            a = torch.randn(m, k, device="cuda").to(FP8)
            sa = torch.tensor([0.5], device="cuda")
            sb = torch.tensor([0.25], device="cuda")
            cublas = timer.graph(lambda: torch._scaled_mm(a, weight.t(), sa, sb, out_dtype=torch.bfloat16,
                                                          use_fast_accum=True)).median_us
            tmagemm.scaled_mm(a, weight.t(), sa, sb)
            ours = timer.graph(lambda: tmagemm.scaled_mm(a, weight.t(), sa, sb)).median_us
            traffic = weight.numel() + a.numel() + 2 * m * n
            row = dict(shape=label, m=m, read_us=read_us, copy_us=copy_us, write_us=write_us, empty_us=empty_us,
                       cublas_us=cublas, ours_us=ours,
                       cublas_pct_copy=100 * traffic / cublas / 1e3 / copy_gbs,
                       ours_pct_copy=100 * traffic / ours / 1e3 / copy_gbs,
                       best_possible_vs_cublas=cublas / floor_us)
            rows.append(row)
            print(f"  M={m:4d} cuBLAS {cublas:7.1f} us ({row['cublas_pct_copy']:4.0f}% of copy BW)  tmagemm "
                  f"{ours:7.1f} us ({row['ours_pct_copy']:4.0f}%)  floor {floor_us:6.1f} us -> at most "
                  f"{row['best_possible_vs_cublas']:.2f}x cuBLAS")
        del weight, sink
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "stream_floor.json"), "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), copy_gbs=copy_gbs, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
