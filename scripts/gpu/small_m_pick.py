"""Which kernel should "auto" run at M <= 32? Times, side by side (graph replays, L2 flushed,
median), the small-tile ``triton.tma`` heuristic, the same with 32-wide tiles (twice the CTAs),
and ``triton.splitk`` at its heuristic split and at twice that, against cuBLAS fp8, on N = K = 4096
and the weight shapes of the ``llm`` preset whose tiles leave SMs idle. Every output is compared
with cuBLAS's in the same run.

``PYTHONPATH=src python scripts/gpu/small_m_pick.py``; writes $OUT/small_m_pick.json when OUT is set.
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch

from tmagemm import device
from tmagemm.bench.timing import Timer
from tmagemm.configs import TritonGemmConfig
from tmagemm.dispatch import GemmArgs
from tmagemm.triton import matmul_splitk, matmul_tma
from tmagemm.triton.host import tma_layout, triton_launch

FP8 = torch.float8_e4m3fn
SHAPES = {  # (N, K)
    "4096x4096": (4096, 4096),
    "llama3-8b.down": (4096, 14336),
    "qwen2.5-7b.down": (3584, 18944),
    "llama3-70b.qkv": (10240, 8192),
    "deepseek-v3.q_a+kv_a": (2112, 7168),
    "llama3-70b.o": (8192, 8192),
}


def candidates(args: GemmArgs, sms: int):
    base = matmul_tma.heuristic(args)
    layout = tma_layout(args)
    yield "tma heuristic", base, lambda: triton_launch(matmul_tma.kernel_call(args, base, layout))
    for stages in (6, 8):
        narrow = TritonGemmConfig(64, 32, 256, 8, stages, 4)
        yield f"tma 64x32x256 s{stages}", narrow, lambda c=narrow: triton_launch(matmul_tma.kernel_call(args, c, layout))
    split = matmul_splitk.choose_config(args.m, args.n, args.k, args.a.dtype, sms)
    yield f"splitk x{split.split_k}", split, lambda: matmul_splitk.run(args, split)
    double = dataclasses.replace(split, split_k=split.split_k * 2)
    k_iters = -(-args.k // double.block_k)
    if double.split_k * 2 <= k_iters:
        yield f"splitk x{double.split_k}", double, lambda: matmul_splitk.run(args, double)


def main():
    timer = Timer(torch.device("cuda"))
    sms = device.sms_of(torch.device("cuda"))
    rows = []
    for label, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda").to(FP8)
        for m in (1, 16, 32):
            a = torch.randn(m, k, device="cuda").to(FP8)
            sa, sb = torch.tensor([0.5], device="cuda"), torch.tensor([0.25], device="cuda")
            ref = torch._scaled_mm(a, w.t(), sa, sb, out_dtype=torch.bfloat16, use_fast_accum=True)
            cublas = timer.graph(lambda: torch._scaled_mm(a, w.t(), sa, sb, out_dtype=torch.bfloat16,
                                                          use_fast_accum=True)).median_us
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            args = GemmArgs(a, w.t(), out, sa, sb)
            cells = {}
            for name, config, fn in candidates(args, sms):
                out.fill_(float("nan"))
                fn()
                err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
                us = timer.graph(fn).median_us
                cells[name] = dict(us=us, ratio=cublas / us, err=err, config=str(config))
            rows.append(dict(shape=label, m=m, n=n, k=k, cublas_us=cublas, cells=cells))
            best = max(cells, key=lambda c: cells[c]["ratio"])
            print(f"{label:22s} M={m:3d} cuBLAS {cublas:6.1f} us | " + " | ".join(
                f"{c} {v['ratio']:.2f}{'!' if v['err'] > 2e-2 else ''}" for c, v in cells.items()) + f" | best {best}",
                flush=True)
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "small_m_pick.json"), "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), sms=sms, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
