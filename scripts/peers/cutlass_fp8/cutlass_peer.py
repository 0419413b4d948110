"""Measurement-only peer: CUTLASS 3.x FP8 GEMM configs vs torch._scaled_mm (cuBLAS) vs tmagemm.

    CUTLASS_DIR=/path/to/cutlass bash scripts/peers/cutlass_fp8/build.sh     # nvcc, no GPU needed
    PYTHONPATH=src python scripts/peers/cutlass_fp8/cutlass_peer.py OUT_DIR [--budget-s 300]

A (M,K) e4m3 row-major, w (N,K) e4m3 row-major (b = w.t()), bf16 out, tensor-wise scales
sa=0.5, sb=2.0 for torch / tmagemm and alpha=1.0 for CUTLASS (same product). Every CUTLASS
output is checked against the torch peer's (max |diff| / max |peer|, flagged above 1e-2).
Times: tmagemm.bench.timing.Timer.graph (CUDA-graph replay, L2 flushed), median us.
Phase 1 times every config at (swizzle 1, raster 0) and (8, 0); phase 2 sweeps the other
(swizzle, raster) pairs for the best two configs of the shape. cuBLAS is timed before, between
and after the groups; its median is the reference. Writes OUT_DIR/cutlass_peer.json.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

BUILD = Path(__file__).resolve().parents[3] / "build" / "cutlass_fp8"  # where build.sh puts the library
CONFIGS = ["pp_64x128_c1", "pp_64x128_c2", "pp_128x128_c2", "pp_64x256_c2",
           "co_128x256_c2", "co_256x128_c2", "co_128x128_c2"]
SHAPES = [(512, 4096, 4096), (1024, 4096, 4096), (2048, 4096, 4096), (4096, 4096, 4096),
          (8192, 4096, 4096), (8192, 8192, 8192)]
SWIZZLES = (1, 2, 4, 8)
RASTERS = (0, 1, 2)  # Heuristic, AlongM, AlongN
PHASE1 = [(1, 0), (8, 0)]
TOL = 1e-2
F8, BF16 = torch.float8_e4m3fn, torch.bfloat16
RC_NAMES = {1: "bad args", 2: "can_implement failed", 3: "workspace", 4: "initialize failed", 5: "launch failed",
            6: "device query failed"}


def log(*args):
    print(*args, flush=True)


class Cutlass:
    def __init__(self, path: Path):
        self.lib = ctypes.CDLL(str(path))
        self.fns, self.ws_fns = {}, {}
        for name in CONFIGS:
            fn = getattr(self.lib, f"cutlass_fp8_{name}", None)
            ws = getattr(self.lib, f"cutlass_fp8_{name}_workspace", None)
            if fn is None or ws is None:
                continue
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                           ctypes.c_int, ctypes.c_float, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                           ctypes.c_size_t, ctypes.c_void_p]
            ws.restype = ctypes.c_size_t
            ws.argtypes = [ctypes.c_int] * 5
            self.fns[name], self.ws_fns[name] = fn, ws

    def workspace_bytes(self, name, m, n, k) -> int:
        return max(int(self.ws_fns[name](m, n, k, s, r)) for s in SWIZZLES for r in RASTERS)

    def call(self, name, a, w, d, alpha, swizzle, raster, ws, ws_bytes) -> int:
        m, k = a.shape
        n = w.shape[0]
        stream = torch.cuda.current_stream().cuda_stream
        return self.fns[name](a.data_ptr(), w.data_ptr(), d.data_ptr(), m, n, k, alpha, swizzle, raster,
                              ws.data_ptr(), ws_bytes, stream)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    if torch.isnan(x).any():
        return math.inf
    denom = ref.float().abs().max().item()
    return (x.float() - ref.float()).abs().max().item() / max(denom, 1e-30)


def time_fn(timer, fn):
    """(median us, mode, host_bound); graph replay, eager as a fallback if capture fails."""
    try:
        t = timer.graph(fn)
        return t.median_us, "graph", t.host_bound
    except RuntimeError as exc:
        log(f"    graph capture failed ({exc}); timing eagerly")
        t = timer.eager(fn)
        return t.median_us, "eager", t.host_bound


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir")
    ap.add_argument("--lib", default=str(BUILD / "libcutlass_fp8.so"))
    ap.add_argument("--budget-s", type=float, default=300.0, help="skip phase 2 once this much time has passed")
    ap.add_argument("--shapes", default=None, help="e.g. 4096x4096x4096,8192x8192x8192")
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # CPU mock tests only
    opts = ap.parse_args()
    out_dir = Path(opts.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.time()

    import tmagemm
    from tmagemm.bench.timing import Timer

    shapes = SHAPES if not opts.shapes else [tuple(int(v) for v in s.split("x")) for s in opts.shapes.split(",")]
    cl = Cutlass(Path(opts.lib))
    missing = [c for c in CONFIGS if c not in cl.fns]
    dev = torch.device(opts.device)
    commit_file = BUILD / "cutlass_commit.txt"
    meta = {
        "device": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cutlass_commit": commit_file.read_text().strip() if commit_file.exists() else None,
        "lib": opts.lib,
        "configs": list(cl.fns),
        "configs_missing_from_lib": missing,
        "timer": {"method": "Timer.graph", "budget_ms": 60.0, "min_reps": 15, "max_reps": 80},
        "tolerance": TOL,
    }
    log(f"device {meta['device']}, torch {meta['torch']}, configs {list(cl.fns)}, missing {missing}")
    timer = Timer(dev, budget_ms=60.0, min_reps=15, max_reps=80)
    results = {"meta": meta, "shapes": []}
    json_path = out_dir / "cutlass_peer.json"

    def save():
        json_path.write_text(json.dumps(results, indent=1))

    torch.manual_seed(0)
    for (m, n, k) in shapes:
        log(f"=== M={m} N={n} K={k} ({time.time() - t_start:.0f}s)")
        a = torch.randn(m, k, device=dev).to(F8)
        w = torch.randn(n, k, device=dev).to(F8)
        sa = torch.tensor([0.5], device=dev)
        sb = torch.tensor([2.0], device=dev)
        b = w.t()

        def cublas():
            return torch._scaled_mm(a, b, sa, sb, out_dtype=BF16, use_fast_accum=True)

        ref = cublas()
        torch.cuda.synchronize()
        flops = 2.0 * m * n * k
        entry = {"m": m, "n": n, "k": k, "cublas_us": [], "ours": None, "cutlass": {}}
        results["shapes"].append(entry)

        us, mode, hb = time_fn(timer, cublas)
        entry["cublas_us"].append(us)
        log(f"  cublas {us:8.1f} us ({flops / us / 1e6:.0f} TFLOP/s) {mode}{' HOST-BOUND' if hb else ''}")

        # ours
        try:
            def ours():
                return tmagemm.scaled_mm(a, b, sa, sb, out_dtype=BF16)

            t0 = time.time()
            o = ours()  # warm-up (plans / JIT / tuning outside timing)
            torch.cuda.synchronize()
            err = rel_err(o, ref)
            us, mode, hb = time_fn(timer, ours)
            entry["ours"] = {"us": us, "err": err, "mode": mode, "host_bound": hb, "warmup_s": time.time() - t0}
            log(f"  ours   {us:8.1f} us err {err:.2e}{' FLAG' if err > TOL else ''} {mode}"
                f"{' HOST-BOUND' if hb else ''} (first call + timing {time.time() - t0:.1f}s)")
        except Exception as exc:  # noqa: BLE001  (record and go on)
            entry["ours"] = {"error": f"{type(exc).__name__}: {exc}"}
            log(f"  ours   FAILED: {type(exc).__name__}: {exc}")

        bufs = {}

        def run_cell(name, sw, ra):
            cfg = entry["cutlass"].setdefault(name, {"cells": {}})
            if "error" in cfg:
                return
            if name not in bufs:
                ws_bytes = cl.workspace_bytes(name, m, n, k)
                bufs[name] = (torch.empty(max(ws_bytes, 16), dtype=torch.uint8, device=dev), ws_bytes)
                cfg["workspace_bytes"] = ws_bytes
            ws, ws_bytes = bufs[name]
            key = f"{sw},{ra}"
            d = torch.full((m, n), float("nan"), dtype=BF16, device=dev)
            rc = cl.call(name, a, w, d, 1.0, sw, ra, ws, ws_bytes)
            if rc != 0:
                cfg["cells"][key] = {"rc": rc, "error": RC_NAMES.get(rc, "?")}
                log(f"  {name:14s} sw={sw} r={ra}: FAILED rc={rc} ({RC_NAMES.get(rc, '?')})")
                return
            torch.cuda.synchronize()
            err = rel_err(d, ref)

            def fn():
                rc2 = cl.call(name, a, w, d, 1.0, sw, ra, ws, ws_bytes)
                if rc2 != 0:
                    raise RuntimeError(f"{name} returned {rc2}")

            us, mode, hb = time_fn(timer, fn)
            err2 = rel_err(d, ref)  # output after the timed replays too
            cfg["cells"][key] = {"us": us, "err": err, "err_after_timing": err2, "mode": mode, "host_bound": hb}
            flag = " FLAG" if max(err, err2) > TOL else ""
            log(f"  {name:14s} sw={sw} r={ra}: {us:8.1f} us err {err:.2e}{flag} {mode}{' HOST-BOUND' if hb else ''}")

        def best(name):
            cells = entry["cutlass"].get(name, {}).get("cells", {})
            ok = [(c["us"], key) for key, c in cells.items() if "us" in c and max(c["err"], c["err_after_timing"]) <= TOL]
            return min(ok) if ok else None

        for name in cl.fns:
            for sw, ra in PHASE1:
                try:
                    run_cell(name, sw, ra)
                except Exception as exc:  # noqa: BLE001
                    entry["cutlass"].setdefault(name, {"cells": {}})["error"] = f"{type(exc).__name__}: {exc}"
                    log(f"  {name}: FAILED {type(exc).__name__}: {exc}")
                    torch.cuda.synchronize()  # a sticky CUDA error raises here and ends the run
        save()

        us, mode, hb = time_fn(timer, cublas)
        entry["cublas_us"].append(us)
        log(f"  cublas {us:8.1f} us (mid)")

        ranked = sorted((b_[0], name) for name in cl.fns if (b_ := best(name)) is not None)
        top = [name for _, name in ranked[:2]]
        if time.time() - t_start > opts.budget_s:
            log(f"  budget of {opts.budget_s:.0f}s spent: skipping the swizzle/raster sweep")
            top = []
        entry["swept"] = top
        for name in top:
            for sw in SWIZZLES:
                for ra in RASTERS:
                    if (sw, ra) in PHASE1:
                        continue
                    try:
                        run_cell(name, sw, ra)
                    except Exception as exc:  # noqa: BLE001
                        entry["cutlass"][name]["cells"][f"{sw},{ra}"] = {"error": f"{type(exc).__name__}: {exc}"}
                        log(f"  {name} sw={sw} r={ra}: FAILED {type(exc).__name__}: {exc}")
                        torch.cuda.synchronize()

        us, mode, hb = time_fn(timer, cublas)
        entry["cublas_us"].append(us)
        cub = statistics.median(entry["cublas_us"])
        entry["cublas_median_us"] = cub
        log(f"  cublas {us:8.1f} us (after); median {cub:.1f} us")
        if entry["ours"] and "us" in entry["ours"]:
            entry["ours"]["ratio"] = cub / entry["ours"]["us"]
        for name in cl.fns:
            cfg = entry["cutlass"].get(name, {})
            for c in cfg.get("cells", {}).values():
                if "us" in c:
                    c["ratio"] = cub / c["us"]
            bb = best(name)
            if bb is not None:
                cfg["best"] = {"us": bb[0], "ratio": cub / bb[0], "swizzle_raster": bb[1]}
        save()
        del a, w, b, ref, bufs
        torch.cuda.empty_cache()

    results["meta"]["total_s"] = time.time() - t_start
    save()

    # compact table: ratio = cuBLAS time / x time (>1 = faster than cuBLAS)
    short = {name: name.replace("_c", "c") for name in cl.fns}
    head = f"{'shape':>16s} {'cuBLAS us':>9s} {'ours':>6s} " + " ".join(f"{short[nm]:>15s}" for nm in cl.fns)
    log("")
    log("ratio = cuBLAS us / x us; CUTLASS: best ratio (swizzle,raster); * = swept; x = failed / out of tolerance")
    log(head)
    for e in results["shapes"]:
        o = e["ours"] or {}
        ours = f"{o['ratio']:.3f}" if "ratio" in o else "fail"
        cols = []
        for nm in cl.fns:
            cfg = e["cutlass"].get(nm, {})
            if "best" in cfg:
                bst = cfg["best"]
                star = "*" if nm in e.get("swept", []) else " "
                cols.append(f"{bst['ratio']:.3f}({bst['swizzle_raster']}){star}")
            else:
                cols.append("x")
        log(f"{e['m']:>5d}x{e['n']}x{e['k']:<5d} {e['cublas_median_us']:9.1f} {ours:>6s} "
            + " ".join(f"{c:>15s}" for c in cols))
    log(f"total {time.time() - t_start:.0f}s; wrote {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
