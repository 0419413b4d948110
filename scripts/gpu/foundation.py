"""Device check for the Triton GEMMs: correctness of every variant, speed vs cuBLAS, host overhead.

Run on an H100/H200: ``PYTHONPATH=src python scripts/gpu/foundation.py [--quick]``. Prints a short
table last; writes the full rows to $OUT/foundation.json when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import triton
import triton.testing

import tmagemm
from tmagemm import dispatch, tuning
from tmagemm.dispatch import GemmArgs

FP8 = torch.float8_e4m3fn


def bench(fn) -> float:
    """Median ms with L2 flushed between runs (do_bench zeroes a 256 MB buffer each rep)."""
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def host_us(fn, n=400) -> float:
    """Per-call host time of a Python loop that never synchronises."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def fp8_problem(m, n, k, rowwise=False):
    a = torch.randn(m, k, device="cuda").to(FP8)
    w = torch.randn(n, k, device="cuda").to(FP8)
    sa = (torch.rand(m, 1, device="cuda") + 0.5) if rowwise else torch.tensor(0.7, device="cuda")
    sb = (torch.rand(1, n, device="cuda") + 0.5) if rowwise else torch.tensor(1.3, device="cuda")
    return a, w.t(), sa, sb


def rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def correctness(rows):
    for name in ("triton.tma", "triton.persistent", "triton.ptr"):
        v = dispatch.get(name)
        for m, n, k in ((1, 256, 512), (727, 577, 864), (1024, 1024, 1024)):
            for dt in (torch.bfloat16, torch.float16):
                a = torch.randn(m, k, device="cuda", dtype=dt)
                b = torch.randn(k, n, device="cuda", dtype=dt)
                out = torch.full((m, n), float("nan"), device="cuda", dtype=dt)
                args = GemmArgs(a, b, out)
                if v.supports(args):
                    continue
                try:
                    v.run(args)
                    err = rel_err(out, a.double() @ b.double())
                except Exception as e:  # report, keep going
                    err = f"{type(e).__name__}: {str(e)[:200]}"
                rows.append(dict(kind="correct", variant=name, dtype=str(dt), shape=(m, n, k), err=err))
            a, b, sa, sb = fp8_problem(m, n, k, rowwise=True)
            out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
            args = GemmArgs(a, b, out, sa.reshape(-1), sb.reshape(-1), bias)
            if v.supports(args):
                continue
            try:
                v.run(args)
                ref = (a.double() @ b.double()) * sa.double() * sb.double() + bias.double()
                err = rel_err(out, ref)
            except Exception as e:
                err = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(dict(kind="correct", variant=name, dtype="fp8", shape=(m, n, k), err=err))


def speed(rows, quick):
    variants = ["triton.tma", "triton.persistent"]
    fp8_ms = (16, 64, 128, 256, 512, 1024, 2048, 4096, 8192) if not quick else (128, 1024, 4096)
    for m in fp8_ms:
        n = k = 4096
        a, b, sa, sb = fp8_problem(m, n, k)
        ref_ms = bench(lambda: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=True))
        ref = torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=True)
        for name in variants:
            v = dispatch.get(name)
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            args = GemmArgs(a, b, out, sa.reshape(1), sb.reshape(1))
            try:
                v.run(args)  # tunes on first call
                ms = bench(lambda: v.run(args))
                err = rel_err(out, ref.double())
            except Exception as e:
                rows.append(dict(kind="speed", variant=name, dtype="fp8", shape=(m, n, k), error=str(e)[:300]))
                continue
            rows.append(dict(kind="speed", variant=name, dtype="fp8", shape=(m, n, k), ms=ms, ref_ms=ref_ms,
                             ratio=ref_ms / ms, tflops=2 * m * n * k / ms / 1e9, err_vs_cublas=err))
    for s in ((4096,) if quick else (4096, 8192)):
        a = torch.randn(s, s, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(s, s, device="cuda", dtype=torch.bfloat16)
        ref_ms = bench(lambda: torch.matmul(a, b))
        ref = torch.matmul(a, b)
        for name in variants:
            v = dispatch.get(name)
            out = torch.empty(s, s, device="cuda", dtype=torch.bfloat16)
            args = GemmArgs(a, b, out)
            try:
                v.run(args)
                ms = bench(lambda: v.run(args))
                err = rel_err(out, ref.double())
            except Exception as e:
                rows.append(dict(kind="speed", variant=name, dtype="bf16", shape=(s, s, s), error=str(e)[:300]))
                continue
            rows.append(dict(kind="speed", variant=name, dtype="bf16", shape=(s, s, s), ms=ms, ref_ms=ref_ms,
                             ratio=ref_ms / ms, tflops=2 * s**3 / ms / 1e9, err_vs_cublas=err))


def overhead(rows):
    m, n, k = 16, 4096, 4096
    a, b, sa, sb = fp8_problem(m, n, k)
    sa1, sb1 = sa.reshape(1), sb.reshape(1)
    tmagemm.scaled_mm(a, b, sa1, sb1)
    ours = host_us(lambda: tmagemm.scaled_mm(a, b, sa1, sb1))
    theirs = host_us(lambda: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=True))
    kernel = bench(lambda: tmagemm.scaled_mm(a, b, sa1, sb1)) * 1e3
    rows.append(dict(kind="host", shape=(m, n, k), ours_us=ours, torch_scaled_mm_us=theirs, ours_kernel_us=kernel,
                     variant=dispatch.choose(GemmArgs(a, b, torch.empty(m, n, device="cuda", dtype=torch.bfloat16),
                                                      sa1, sb1)).name))


def overhead_breakdown(rows):
    """Where the per-call host time goes (M=16, N=K=4096 fp8 through triton.tma)."""
    from tmagemm import api
    from tmagemm.triton import matmul_tma
    from tmagemm.triton.host import operand_descriptors, tma_layout

    m, n, k = 16, 4096, 4096
    a, b, sa, sb = fp8_problem(m, n, k)
    sa1, sb1 = sa.reshape(1), sb.reshape(1)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    args = GemmArgs(a, b, out, sa1, sb1)
    layout = tma_layout(args)
    config = matmul_tma.heuristic(args)
    descs = operand_descriptors(args, layout, config.block_m, config.block_n, config.block_k, config.block_n)
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n),)
    consts = dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
                  A_ROW_MAJOR=True, B_ROW_MAJOR=False, TMA_STORE=True, SCALE_A=1, SCALE_B=1, HAS_BIAS=False,
                  FAST_ACCUM=True)

    def jit_launch():
        matmul_tma.tma_gemm_kernel[grid](*descs, out, sa1, sb1, None, m, n, k, out.stride(0), out.stride(1),
                                         **consts, num_warps=config.num_warps, num_stages=config.num_stages)

    compiled = matmul_tma.tma_gemm_kernel.warmup(*descs, out, sa1, sb1, None, m, n, k, out.stride(0),
                                                 out.stride(1), **consts, num_warps=config.num_warps,
                                                 num_stages=config.num_stages, grid=grid)
    positional = [*descs, out, sa1, sb1, None, m, n, k, out.stride(0), out.stride(1), *consts.values()]
    runner = compiled[grid]
    parts = dict(
        check=host_us(lambda: api.check_scaled_mm(a, b, sa1, sb1, None, torch.bfloat16, None, "auto"), 2000),
        plan=host_us(lambda: dispatch.plan(args), 2000),
        descriptors=host_us(lambda: operand_descriptors(args, layout, config.block_m, config.block_n,
                                                        config.block_k, config.block_n), 2000),
        empty=host_us(lambda: torch.empty(m, n, device="cuda", dtype=torch.bfloat16), 2000),
        jit_launch=host_us(jit_launch),
        compiled_launch=host_us(lambda: runner(*positional)),
        full_api=host_us(lambda: tmagemm.scaled_mm(a, b, sa1, sb1)),
        torch_scaled_mm=host_us(lambda: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=True)),
    )
    rows.append(dict(kind="host_breakdown", **parts))
    print("host breakdown (us/call):", {k: round(v, 1) for k, v in parts.items()}, flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--skip-correctness", action="store_true", help="the pytest GPU suite covers it")
    opts = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    print(f"device {props.name} SMs {props.multi_processor_count} torch {torch.__version__} triton {triton.__version__}")
    rows = []
    t = time.time()
    if not opts.skip_correctness:
        os.environ["TMAGEMM_AUTOTUNE"] = "0"  # heuristic configs: correctness should not wait on tuning
        correctness(rows)
        os.environ["TMAGEMM_AUTOTUNE"] = "1"
        print(f"correctness done {time.time() - t:.0f}s", flush=True)
    overhead(rows)
    try:
        overhead_breakdown(rows)
    except Exception as e:  # keep the speed table even if a measurement path breaks
        print("host breakdown failed:", type(e).__name__, str(e)[:300], flush=True)
    speed(rows, opts.quick)
    print(f"speed done {time.time() - t:.0f}s", flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "foundation.json"), "w") as f:
            json.dump(dict(device=props.name, torch=torch.__version__, triton=triton.__version__,
                           rows=rows, tuned={k: v.to_dict() for k, v in tuning._memory.items()}), f, indent=1,
                      default=str)
    for r in rows:
        if r["kind"] == "correct" and (not isinstance(r["err"], float) or r["err"] > 2e-2):
            print("BAD", r)
    print(f"{'variant':20s} {'dtype':5s} {'shape':20s} {'ms':>8s} {'cublas':>8s} {'ratio':>6s} {'TFLOP/s':>8s}")
    for r in rows:
        if r["kind"] == "speed":
            if "error" in r:
                print(f"{r['variant']:20s} {r['dtype']:5s} {str(r['shape']):20s} ERROR {r['error'][:150]}")
            else:
                print(f"{r['variant']:20s} {r['dtype']:5s} {str(r['shape']):20s} {r['ms']:8.4f} {r['ref_ms']:8.4f} "
                      f"{r['ratio']:6.3f} {r['tflops']:8.1f}")
        elif r["kind"] == "host":
            print("host overhead", r)
    ok = sum(1 for r in rows if r["kind"] == "correct" and isinstance(r["err"], float) and r["err"] < 2e-2)
    print(f"correctness: {ok}/{sum(1 for r in rows if r['kind'] == 'correct')} within 2e-2")


if __name__ == "__main__":
    main()
