#!/usr/bin/env bash
# Small-M (decode) GEMM job for the device machine: GPU tests, then a benchmark.
#
#   scripts/gpu/smallm.sh sweep    # tests + candidate configs at N=K=4096 (and a few llm shapes)
#   scripts/gpu/smallm.sh confirm  # tests + heuristic configs on N=K=4096 and the llm preset,
#                                  # vs torch._scaled_mm / torch.matmul, + per-call host time
#
# Timings: median of CUDA events around each call, a 256 MiB buffer zeroed before each call
# (L2 flushed, and the GPU stays busy long enough that host launch time is not in the number).
# Writes details under $OUT (CSV, JSON metadata, pytest log) and prints a short table last.
set -euo pipefail
MODE=${1:-confirm}
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/smallm_out}
mkdir -p "$OUT"

# GPU tests in the background while the benchmark's kernels compile in worker processes; the
# timed part starts only after the tests finished, so nothing else runs on the GPU then.
rm -f /tmp/smallm_tests_done
(timeout 170 python -m pytest -q -p no:cacheprovider tests/test_splitk.py >"$OUT/pytest.log" 2>&1
 touch /tmp/smallm_tests_done) &
TESTS=$!

cat >/tmp/smallm_bench.py <<'EOF'
import json, math, os, statistics, sys, time, datetime, subprocess
import multiprocessing as mp
import torch, triton
from tmagemm.dispatch import GemmArgs
from tmagemm.triton import matmul_splitk as sk

MODE, OUT, TESTS_DONE = sys.argv[1], sys.argv[2], sys.argv[3]
T0 = time.time()
BUDGET_S = 290  # stop timing new cells past this, so the table always prints
F8, BF16, F16 = torch.float8_e4m3fn, torch.bfloat16, torch.float16
MS = [1, 2, 4, 8, 16, 32, 64, 128]


def make(m, n, k, dtype):
    a = torch.randn(m, k, device="cuda").to(dtype)
    w = torch.randn(n, k, device="cuda").to(dtype)
    if dtype == F8:
        sa = torch.tensor([0.7], device="cuda"); sb = torch.tensor([1.3], device="cuda")
    else:
        sa = sb = None
    out = torch.empty(m, n, device="cuda", dtype=BF16)
    return GemmArgs(a, w.t(), out, sa, sb, None)


def candidates(m, n, k, dtype, full):
    """Split-free configs (split_k is a runtime argument: one binary for all splits).

    The base grid (every shape): swap-AB with block_m = pow2(M) >= 16, block_n 64/128/256, and
    for M >= 64 the unswapped 64/128-row tile. ``full`` adds the activation-through-TMA, pipeline
    depth, fp8 fast-accumulation and unswapped-16-row variants (N=K=4096 only).
    """
    isz = 1 if dtype == F8 else 2
    bk = 128 // isz
    bm = min(128, max(16, 1 << (m - 1).bit_length()))
    warps = lambda bm_, bn_: 8 if bm_ * bn_ > 128 * 64 else 4
    out = [sk.SplitKConfig(bm, bn, bk, 1, True, False, sk.stages_for(bm, bn, bk, isz), warps(bm, bn)) for bn in (64, 128, 256)]
    if m >= 64:
        bmn = 64 if m <= 64 else 128
        out.append(sk.SplitKConfig(bmn, 128, bk, 1, False, False, sk.stages_for(bmn, 128, bk, isz), warps(bmn, 128)))
    if full:
        out += [sk.SplitKConfig(bm, bn, bk, 1, True, True, sk.stages_for(bm, bn, bk, isz), warps(bm, bn)) for bn in (64, 128, 256)]
        out += [sk.SplitKConfig(bm, 128, bk, 1, True, False, sk.stages_for(bm, 128, bk, isz, per), warps(bm, 128)) for per in (1, 3)]
        if dtype == F8:
            out.append(sk.SplitKConfig(bm, 128, bk, 1, True, False, sk.stages_for(bm, 128, bk, isz), warps(bm, 128), fast_accum=True))
        if m <= 16:
            out.append(sk.SplitKConfig(16, 128, bk, 1, False, False, sk.stages_for(16, 128, bk, isz), 4))
    return out


def splits_for(cfg, m, n, k, sms):
    k_iters = -(-k // cfg.block_k)
    tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
    return [s for s in (1, 2, 3, 4, 6, 8, 12, 16) if s == 1 or (-(-k_iters // s) >= 2 and tiles * s <= 8 * sms)]


def with_split(cfg, s):
    return sk.SplitKConfig(cfg.block_m, cfg.block_n, cfg.block_k, s, cfg.swap_ab, cfg.a_tma, cfg.num_stages, cfg.num_warps, cfg.fast_accum)


def _compile_worker(tasks):
    errors = []
    for dtype_name, m, cfg in tasks:
        try:
            args = make(m, 4096, 4096, getattr(torch, dtype_name))
            sk.run(args, cfg)
            torch.cuda.synchronize()
        except Exception as exc:  # reported, and the cell is skipped later
            errors.append((dtype_name, m, repr(cfg), f"{type(exc).__name__}: {str(exc)[:300]}"))
    return errors


FLUSH = None


def bench(fn, reps=20):
    global FLUSH
    if FLUSH is None:
        FLUSH = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        FLUSH.zero_()
        starts[i].record(); fn(); ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3  # us


def copy_bw():
    res = {}
    for mib in (1024, 16, 32):
        src = torch.empty(mib << 20, dtype=torch.uint8, device="cuda"); dst = torch.empty_like(src)
        us = bench(lambda: dst.copy_(src), reps=10 if mib == 1024 else 25)
        res[mib] = 2 * (mib << 20) / us / 1e3  # GB/s
        del src, dst
    return res


def ref_of(args):
    r = args.a.float() @ args.b.float()
    if args.scale_a is not None:
        r = r * args.scale_a * args.scale_b
    return r


def rel_err(out, ref):
    return float((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6))


def peers(args, dtype):
    a, b = args.a, args.b
    res = {}
    if dtype == F8:
        res["scaled_mm"] = lambda: torch._scaled_mm(a, b, scale_a=args.scale_a, scale_b=args.scale_b, out_dtype=BF16, use_fast_accum=True)
        a16, b16 = a.to(F16), b.to(F16)  # b16 keeps the column-major (nn.Linear) layout
        res["cublas_fp16"] = lambda: torch.matmul(a16, b16)
    else:
        res["matmul_bf16"] = lambda: torch.matmul(a, b)
    return res


def bytes_of(m, n, k, dtype):
    isz = 1 if dtype == F8 else 2
    return n * k * isz + m * k * isz + m * n * 2


def host_time(fn, calls=400):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t) / calls * 1e6
    torch.cuda.synchronize()
    return host


def main():
    rows, errors = [], []
    meta = {
        "date": datetime.date.today().isoformat(), "mode": MODE,
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "driver": subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True).stdout.strip(),
        "sm_count": torch.cuda.get_device_properties(0).multi_processor_count,
    }
    sms = meta["sm_count"]
    # ---- compile everything in parallel processes (Triton's disk cache is shared)
    tasks = []
    seen = set()
    if MODE == "sweep":
        for dtype_name in ("float8_e4m3fn", "bfloat16"):
            for m in MS:
                for cfg in candidates(m, 4096, 4096, getattr(torch, dtype_name), True):
                    key = (dtype_name, with_split(cfg, 2))
                    if key not in seen:
                        seen.add(key); tasks.append((dtype_name, m, with_split(cfg, 2)))
    else:
        shapes = [(4096, 4096)] + list(sk.LLM_PROJECTIONS.values())
        for dtype_name in ("float8_e4m3fn", "bfloat16"):
            for m in MS:
                for k, n in shapes:
                    cfg = sk.choose_config(m, n, k, getattr(torch, dtype_name), sms)
                    key = (dtype_name, with_split(cfg, 2))
                    if key not in seen:
                        seen.add(key); tasks.append((dtype_name, m, with_split(cfg, 2)))
    nproc = 12
    chunks = [tasks[i::nproc] for i in range(nproc)]
    with mp.get_context("spawn").Pool(nproc) as pool:
        for errs in pool.map(_compile_worker, chunks):
            errors.extend(errs)
    print(f"compiled {len(tasks)} kernels in {time.time() - T0:.0f}s; {len(errors)} failed", flush=True)
    for e in errors:
        print("COMPILE-FAIL", e, flush=True)
    bad = {(e[0], e[2]) for e in errors}
    while not os.path.exists(TESTS_DONE):  # the background GPU tests must finish before timing
        time.sleep(1)
    print(f"tests done at {time.time() - T0:.0f}s", flush=True)

    meta["copy_gbps"] = copy_bw()
    copy = meta["copy_gbps"][1024]
    print(f"D2D copy GB/s: {meta['copy_gbps']}", flush=True)

    def cell(shape_name, m, n, k, dtype, configs):
        args = make(m, n, k, dtype)
        ref = ref_of(args)
        nbytes = bytes_of(m, n, k, dtype)
        for name, fn in peers(args, dtype).items():
            try:
                us = bench(fn)
            except Exception as exc:
                us = float("nan"); print("PEER-FAIL", name, m, n, k, repr(exc)[:200])
            rows.append(dict(shape=shape_name, dtype=str(dtype)[6:], m=m, n=n, k=k, impl=name, cfg="", split=0, us=us, gbps=nbytes / us / 1e3, err=0.0))
        for cfg in configs:
            if (str(dtype)[6:], repr(with_split(cfg, 2))) in bad:
                continue
            try:
                args.out.fill_(float("nan"))
                sk.run(args, cfg)
                err = rel_err(args.out, ref)
                us = bench(lambda: sk.run(args, cfg))
            except Exception as exc:
                print("RUN-FAIL", m, n, k, cfg, repr(exc)[:200]); continue
            rows.append(dict(shape=shape_name, dtype=str(dtype)[6:], m=m, n=n, k=k, impl="tmagemm", cfg=repr(cfg), split=cfg.split_k, us=us, gbps=nbytes / us / 1e3, err=err))

    if MODE == "sweep":
        shapes = [("4096x4096", 4096, 4096)] + [(nm, kn[0], kn[1]) for nm, kn in sk.LLM_PROJECTIONS.items()]
        for name, k, n in shapes:
            for dtype in (F8, BF16):
                for m in MS:
                    if time.time() - T0 > BUDGET_S:
                        break
                    cfgs = [with_split(c, s) for c in candidates(m, n, k, dtype, name == "4096x4096")
                            for s in splits_for(c, m, n, k, sms)]
                    cell(name, m, n, k, dtype, cfgs)
            torch.cuda.empty_cache()
    else:
        shapes = [("4096x4096", 4096, 4096)] + [(nm, kn[0], kn[1]) for nm, kn in sk.LLM_PROJECTIONS.items()]
        for dtype in (F8, BF16):
            for name, k, n in shapes:
                for m in MS:
                    if time.time() - T0 > BUDGET_S:
                        break
                    cell(name, m, n, k, dtype, [sk.choose_config(m, n, k, dtype, sms)])
                    torch.cuda.empty_cache()

    # ---- per-call host time at M=16, N=K=4096 (variant entry point, heuristic config)
    host = {}
    variant = sk.VARIANTS[0]
    for dtype in (F8, BF16):
        args = make(16, 4096, 4096, dtype)
        cfg = sk.choose_config(16, 4096, 4096, dtype, sms)
        host[f"{str(dtype)[6:]}.variant_run"] = host_time(lambda: variant.run(args))
        tma_cfg = sk.SplitKConfig(cfg.block_m, cfg.block_n, cfg.block_k, cfg.split_k, cfg.swap_ab, True, cfg.num_stages, cfg.num_warps)
        host[f"{str(dtype)[6:]}.a_tma_run"] = host_time(lambda: sk.run(args, tma_cfg))
        host[f"{str(dtype)[6:]}.kernel_us"] = bench(lambda: variant.run(args))
        for name, fn in peers(args, dtype).items():
            host[f"{str(dtype)[6:]}.{name}"] = host_time(fn)
    meta["host_us"] = host

    # ---- outputs
    import csv
    with open(os.path.join(OUT, f"{MODE}.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].keys())); w.writeheader(); w.writerows(rows)
    meta["compile_errors"] = errors
    with open(os.path.join(OUT, f"{MODE}_meta.json"), "w") as f:
        json.dump(meta, f, indent=1, default=str)

    lines = [f"# {meta['device']} driver {meta['driver']} torch {meta['torch']} triton {meta['triton']} "
             f"copy {copy:.0f} GB/s (16MiB: {meta['copy_gbps'][16]:.0f}) mode={MODE}"]
    lines.append(f"{'shape':20s} {'dt':6s} {'M':>4s} {'ours_us':>8s} {'GB/s':>6s} {'%copy':>6s} {'peer_us':>8s} {'x_peer':>6s} {'x_fp16':>6s} err   best cfg")
    by = {}
    for r in rows:
        by.setdefault((r["shape"], r["dtype"], r["m"]), []).append(r)
    ratios = {}
    for (shape, dt, m), rs in by.items():
        ours = [r for r in rs if r["impl"] == "tmagemm" and r["err"] < 2e-2]
        if not ours:
            continue
        best = min(ours, key=lambda r: r["us"])
        peer = next((r for r in rs if r["impl"] in ("scaled_mm", "matmul_bf16")), None)
        f16 = next((r for r in rs if r["impl"] == "cublas_fp16"), None)
        xp = peer["us"] / best["us"] if peer else float("nan")
        xf = f16["us"] / best["us"] if f16 else float("nan")
        ratios.setdefault((shape, dt), []).append((xp, xf))
        short = best["cfg"].replace("SplitKConfig(", "").replace(")", "").replace("block_", "").replace("num_", "")
        lines.append(f"{shape:20s} {dt:6s} {m:4d} {best['us']:8.2f} {best['gbps']:6.0f} {100 * best['gbps'] / copy:5.0f}% {peer['us'] if peer else float('nan'):8.2f} {xp:6.2f} {xf:6.2f} {best['err']:.0e} {short}")
    lines.append("geomean over M (x_peer, x_fp16), min x_peer:")
    for (shape, dt), rs in ratios.items():
        gp = math.exp(sum(math.log(x[0]) for x in rs) / len(rs))
        gf = [x[1] for x in rs if not math.isnan(x[1])]
        gf = math.exp(sum(math.log(x) for x in gf) / len(gf)) if gf else float("nan")
        lines.append(f"  {shape:20s} {dt:6s} {gp:5.2f} {gf:5.2f} min {min(x[0] for x in rs):5.2f}")
    lines.append("host us per call: " + ", ".join(f"{k}={v:.1f}" for k, v in host.items()))
    text = "\n".join(lines)
    with open(os.path.join(OUT, f"{MODE}_summary.txt"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
EOF

python /tmp/smallm_bench.py "$MODE" "$OUT" /tmp/smallm_tests_done 2>&1 | tee "$OUT/bench.log" | grep -v "^COMPILE-FAIL" | tail -n 150 || true
wait $TESTS || true
echo "== GPU tests:"; tail -n 15 "$OUT/pytest.log"
