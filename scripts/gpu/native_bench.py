"""Benchmark the native GEMM ladder against cuBLAS, side by side in one process.

    python scripts/gpu/native_bench.py OUT_DIR [--rungs cuda.seed,cuda.ws,...] [--budget-s 200]
    python scripts/gpu/native_bench.py --precompile   # build every variant the job uses (CPU only)
    python scripts/gpu/native_bench.py --smoke RUNG   # one small run (the job's hang guard)

Peers: torch.matmul (bf16/fp16) and torch._scaled_mm(use_fast_accum=True) (fp8, tensor-wise
scales, bf16 out). Time: median of CUDA events around each call with a 256 MB buffer zeroed
before it (tmagemm.bench.timing.Timer). Each rung's output is compared with the peer's in the
same run. Writes OUT_DIR/native_bench.json and prints a compact table last.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from dataclasses import replace

import torch

from tmagemm.cuda import gemm as native
from tmagemm.dispatch import GemmArgs

F8, BF16, F16 = torch.float8_e4m3fn, torch.bfloat16, torch.float16
CUBES = [2048, 4096, 6144, 8192]
FP8_M = [1024, 2048, 4096, 8192]

# Config variants measured next to the default rungs (name -> config), to pick defaults from data.
EXTRA = {
    "coop.s3": replace(native.RUNGS["cuda.persistent_coop"], stages=3, epi_passes=1, epi_buffers=1),
    "coop.g16": replace(native.RUNGS["cuda.persistent_coop"], group_m=16),
    "mc.s3": replace(native.RUNGS["cuda.persistent_coop_mc"], stages=3, epi_passes=1, epi_buffers=1),
    "ws.g16": replace(native.RUNGS["cuda.ws"], group_m=16),
}


def config_of(name: str):
    return native.RUNGS[name] if name in native.RUNGS else EXTRA[name]


# (label, a/b dtype, out dtype, B K-major)
FAMILIES = [
    ("bf16", BF16, BF16, False),
    ("fp16", F16, F16, False),
    ("bf16-wT", BF16, BF16, True),
    ("fp8", F8, BF16, True),
]


def cells():
    for label, ab, out, k_major in FAMILIES:
        shapes = [(s, s, s) for s in CUBES]
        if ab == F8:
            shapes = [(m, 4096, 4096) for m in FP8_M] + [(s, s, s) for s in CUBES if s != 4096]
        if label == "bf16-wT":
            shapes = [(4096, 4096, 4096), (8192, 8192, 8192)]
        for shape in shapes:
            yield label, ab, out, k_major, shape


def _build(task):
    name, ab, out, k_major = task
    start = time.time()
    native.compile_module(config_of(name), ab, out, k_major)
    return f"{name} {ab} {out} kmajor={k_major}: {time.time() - start:.1f}s"


def precompile() -> None:
    tasks = {(name, ab, out, k) for _, ab, out, k in FAMILIES for name in list(native.RUNGS) + list(EXTRA)}
    # the test families too (tests/test_native_gemm.py)
    tasks |= {(name, ab, out, k) for name in native.RUNGS for ab, out, k in [
        (BF16, BF16, True), (F16, F16, False), (BF16, torch.float32, False), (F8, BF16, True),
        (BF16, BF16, False), (F8, torch.float32, True)]}
    with mp.get_context("spawn").Pool(min(16, len(tasks))) as pool:
        for line in pool.imap_unordered(_build, sorted(tasks, key=str)):
            print(line, flush=True)


def make(shape, ab, out_dtype, k_major):
    m, n, k = shape
    a = torch.randn(m, k, device="cuda").to(ab)
    w = torch.randn(n, k, device="cuda").to(ab)
    b = w.t() if k_major else w.t().contiguous()
    out = torch.empty(m, n, device="cuda", dtype=out_dtype)
    if ab == F8:
        sa, sb = torch.tensor([0.5], device="cuda"), torch.tensor([2.0], device="cuda")
        return GemmArgs(a, b, out, sa, sb)
    return GemmArgs(a, b, out)


def peer(args: GemmArgs):
    if args.is_fp8:
        return lambda: torch._scaled_mm(args.a, args.b, args.scale_a, args.scale_b, out_dtype=args.out.dtype,
                                        use_fast_accum=True)
    return lambda: torch.matmul(args.a, args.b)


def smoke(name: str) -> None:
    args = make((300, 520, 208), BF16, BF16, False)
    native.run(args, native.RUNGS[name])
    torch.cuda.synchronize()
    ref = args.a.float() @ args.b.float()
    err = ((args.out.float() - ref).abs().max() / ref.abs().max()).item()
    print(f"smoke {name}: rel err {err:.2e}", flush=True)
    sys.exit(0 if err < 1e-2 else 1)


def bench(out_dir: str, rungs: list[str], budget_s: float) -> None:
    from tmagemm.bench.timing import Timer

    timer = Timer(torch.device("cuda"), budget_ms=120.0, min_reps=10, max_reps=100)
    start = time.time()
    rows = []
    for label, ab, out_dtype, k_major, shape in cells():
        if time.time() - start > budget_s:
            print(f"budget reached, skipping {label} {shape}", flush=True)
            continue
        m, n, k = shape
        args = make(shape, ab, out_dtype, k_major)
        fn = peer(args)
        ref = fn().float()
        flops = 2.0 * m * n * k
        t_peer = timer.eager(fn).median_us
        row = {"family": label, "m": m, "n": n, "k": k, "peer_us": t_peer, "peer_tflops": flops / t_peer / 1e6}
        for name in rungs:
            config = config_of(name)
            try:
                call = lambda: native.run(args, config)  # noqa: E731
                args.out.fill_(float("nan"))
                call()
                torch.cuda.synchronize()
                err = ((args.out.float() - ref).abs().max() / ref.abs().max()).item()
                t = timer.eager(call).median_us
                row[name] = {"us": t, "tflops": flops / t / 1e6, "vs_peer": t_peer / t, "rel_err": err}
            except Exception as exc:  # record and go on: one broken rung must not hide the others
                row[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        rows.append(row)
        print(json.dumps(row), flush=True)

    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": time.strftime("%Y-%m-%d"),
        "timing": "median of CUDA events per call, 256 MB buffer zeroed before each call",
        "peers": "torch.matmul (bf16/fp16), torch._scaled_mm(use_fast_accum=True, tensor-wise, bf16 out) (fp8)",
    }
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    with open(f"{out_dir}/native_bench.json", "w") as handle:
        json.dump({"meta": meta, "rows": rows}, handle, indent=1)

    short = {"cuda.seed": "seed", "cuda.ws": "ws", "cuda.persistent_coop": "coop", "cuda.persistent_coop_mc": "coop_mc",
             "cuda.persistent_pingpong": "pingpong"}
    print("\n" + json.dumps(meta))
    print(f"{'family':7} {'M':>5} {'N':>5} {'K':>5} {'peerTF':>6} " + " ".join(f"{short.get(r, r):>12}" for r in rungs))
    for row in rows:
        cols = []
        for name in rungs:
            cell = row.get(name, {})
            if "error" in cell:
                cols.append(f"{'ERR':>12}")
            else:
                flag = " " if cell["rel_err"] <= 2e-2 else "!"  # NaN (unwritten output) flags too
                cols.append(f"{cell['tflops']:5.0f} {cell['vs_peer']:4.2f}x{flag}")
        print(f"{row['family']:7} {row['m']:5} {row['n']:5} {row['k']:5} {row['peer_tflops']:6.0f} " + " ".join(cols))
    print("(cells: TFLOP/s and speed vs peer; ! = max rel err vs peer > 2e-2)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir", nargs="?", default=".")
    parser.add_argument("--rungs", default=",".join(native.RUNGS))
    parser.add_argument("--extra", default=",".join(EXTRA), help="config variants from EXTRA to add")
    parser.add_argument("--budget-s", type=float, default=200.0)
    parser.add_argument("--precompile", action="store_true")
    parser.add_argument("--smoke")
    opts = parser.parse_args()
    if opts.precompile:
        precompile()
    elif opts.smoke:
        smoke(opts.smoke)
    else:
        names = [r for r in opts.rungs.split(",") + opts.extra.split(",") if r]
        bench(opts.out_dir, names, opts.budget_s)


if __name__ == "__main__":
    main()
