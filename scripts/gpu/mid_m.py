"""FP8 GEMM at small and medium M (16..512, N=K=4096): config sweep against cuBLAS.

Run on an H100/H200 from the repo root::

    PYTHONPATH=src python scripts/gpu/mid_m.py

Sweeps explicit configs of ``triton.tma`` (``matmul_tma.kernel_call``), of the
split-K/swap-AB kernel (``matmul_splitk.run(args, config)``) and of ``triton.persistent``;
e4m3 inputs, tensor-wise scales, bf16 output, fast accumulation (the peer is
``torch._scaled_mm(use_fast_accum=True)``). Every cell is checked against cuBLAS's output.

Timing excludes host overhead: one call (after an eager warm-up on the capture stream) is
captured in a CUDA graph and ``graph.replay`` is timed with ``tmagemm.bench.timing.Timer.graph``
(median; a 256 MB buffer is zeroed before every replay, so L2 is cold). cuBLAS is timed the
same way before and after each M's candidates. (The results in docs/small-m.md were taken when
this script timed replays with ``triton.testing.do_bench``, which flushes the same way.)

Kernels are compiled first in worker processes (the Triton disk cache is shared), so the timed
part only loads binaries. Writes every row to $OUT/mid_m.jsonl as it goes and the metadata to
$OUT/mid_m_meta.json; prints the best config per M and family last.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from dataclasses import asdict

import torch
import triton

from tmagemm.bench.timing import Timer
from tmagemm.configs import TritonGemmConfig
from tmagemm.dispatch import GemmArgs
from tmagemm.triton import matmul_persistent, matmul_splitk, matmul_tma
from tmagemm.triton.host import tma_layout, triton_launch

FP8 = torch.float8_e4m3fn
N = K = 4096
MS = (16, 32, 64, 128, 256, 512)
T0 = time.time()
BUDGET_S = float(os.environ.get("MID_M_BUDGET_S", "300"))  # stop timing new cells past this
COMPILE_S = 150.0  # precompile phase gives up on configs still compiling (or hung) past this
MAX_REL_ERR = 2e-2  # Frobenius error vs cuBLAS; bf16 output alone gives ~3e-3


# ---------------------------------------------------------------------------------- candidates


def _tc(bm, bn, bk, s, w, subtile=False) -> TritonGemmConfig:
    return TritonGemmConfig(bm, bn, bk, 8, s, w, subtile)


def tma_candidates() -> list[TritonGemmConfig]:
    """The current CONFIGS and heuristic picks, then small-tile and mid-M families."""
    shapes = [(64, bn, bk, s, 4) for bn in (32, 64) for bk in (128, 256) for s in (4, 6, 8)]
    shapes += [(64, 128, 128, 4, 4), (64, 128, 128, 6, 4), (64, 128, 256, 3, 4), (64, 128, 256, 4, 4)]
    shapes += [(32, 32, 256, 6, 4), (32, 64, 256, 6, 4), (16, 64, 256, 6, 4)]
    shapes += [(128, 32, 128, 6, 4), (128, 32, 256, 4, 4), (128, 64, 128, 6, 4), (128, 64, 256, 4, 4),
               (128, 64, 128, 6, 8), (128, 64, 256, 4, 8)]
    shapes += [(128, 128, 128, 4, 8), (128, 128, 128, 5, 8), (128, 128, 256, 3, 8), (128, 128, 128, 4, 4),
               (128, 256, 64, 4, 8), (256, 32, 128, 4, 8), (256, 64, 128, 3, 8), (256, 64, 128, 4, 8),
               (256, 128, 128, 3, 8), (256, 128, 64, 4, 8), (64, 256, 128, 4, 4), (64, 256, 128, 4, 8)]
    configs = list(matmul_tma.CONFIGS) + [_tc(*s) for s in shapes]
    configs += [_tc(64, 64, 128, 5, 4), _tc(64, 128, 128, 4, 4), _tc(128, 256, 128, 3, 8)]  # old heuristic
    return [c for c in dict.fromkeys(configs) if c.is_valid(1, 1, 2)]


def persistent_candidates() -> list[TritonGemmConfig]:
    return [_tc(128, 256, 128, 3, 8, True), _tc(128, 128, 128, 4, 8), _tc(128, 128, 128, 4, 8, True),
            _tc(128, 64, 128, 5, 4), _tc(64, 128, 128, 5, 4), _tc(128, 128, 256, 3, 8), _tc(256, 64, 128, 3, 8)]


def splitk_candidates(m: int) -> list[matmul_splitk.SplitKConfig]:
    """Around choose_config: weight rows per tile, pipeline depth, split, fp8 promotion, A via TMA."""
    sk = matmul_splitk
    base = sk.choose_config(min(m, sk.MAX_M), N, K, FP8, 132)
    bm = base.block_m
    out = [base, sk.SplitKConfig(**{**asdict(base), "fast_accum": True}),
           sk.SplitKConfig(**{**asdict(base), "a_tma": True})]
    for bn in (64, 128):
        warps = 8 if bm * bn > 128 * 64 else 4
        for stages in dict.fromkeys((4, sk.stages_for(bm, bn, 128, 1), sk.stages_for(bm, bn, 128, 1, 1))):
            for split in (1, 2, 3, 4):
                out.append(sk.SplitKConfig(bm, bn, 128, split, True, False, stages, warps, True))
    return list(dict.fromkeys(out))


def candidates(m: int) -> list[tuple[str, object]]:
    cells = [("tma", c) for c in tma_candidates()]
    if m <= 2 * matmul_splitk.MAX_M:  # M=256 runs the splitk kernel as two 128-token tiles (exploratory)
        cells += [("splitk", c) for c in splitk_candidates(m)]
    if m >= 128:
        cells += [("persistent", c) for c in persistent_candidates()]
    return cells


# ------------------------------------------------------------------------------------ problems


def problem(m: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed + m)
    a = torch.randn(m, K, device="cuda", generator=g).to(FP8)
    w = torch.randn(N, K, device="cuda", generator=g).to(FP8)  # nn.Linear weight; b = w.t() is K-major
    sa = torch.tensor([0.7], device="cuda")
    sb = torch.tensor([1.3], device="cuda")
    return a, w.t(), sa, sb


def launcher(family: str, config, args: GemmArgs, device_desc: bool = False):
    if family == "tma":
        layout = tma_layout(args)
        return lambda: triton_launch(matmul_tma.kernel_call(args, config, layout, device_desc))
    if family == "persistent":
        layout = tma_layout(args)
        return lambda: triton_launch(matmul_persistent.kernel_call(args, config, layout))
    return lambda: matmul_splitk.run(args, config)


def label(family: str, config) -> str:
    if family == "splitk":
        c = config
        return (f"splitk bm{c.block_m} bn{c.block_n} s{c.split_k} st{c.num_stages} w{c.num_warps}"
                f"{' fast' if c.fast_accum else ''}{' atma' if c.a_tma else ''}")
    c = config
    return f"{family} {c.block_m}x{c.block_n}x{c.block_k} st{c.num_stages} w{c.num_warps}{' sub' if c.epilogue_subtile else ''}"


# ----------------------------------------------------------------------------------- compiling


def _compile_one(task):
    """Worker: run one candidate once so its binary lands in the Triton disk cache."""
    family, config, m = task
    try:
        a, b, sa, sb = problem(m)
        out = torch.empty(m, N, device="cuda", dtype=torch.bfloat16)
        launcher(family, config, GemmArgs(a, b, out, sa, sb))()
        torch.cuda.synchronize()
        return None
    except Exception as e:  # reported and the candidate dropped, the sweep goes on
        return f"{type(e).__name__}: {str(e)[:300]}"


def precompile(tasks) -> dict:
    """{task index: error or None}; tasks missing from the dict did not finish in time."""
    ctx = mp.get_context("spawn")
    done = {}
    with ctx.Pool(min(14, max(1, (os.cpu_count() or 2) - 2))) as pool:
        pending = {i: pool.apply_async(_compile_one, (t,)) for i, t in enumerate(tasks)}
        deadline = time.time() + COMPILE_S
        for i, res in pending.items():
            try:
                done[i] = res.get(timeout=max(0.1, deadline - time.time()))
            except mp.TimeoutError:
                continue
        pool.terminate()
    return done


def compile_key(family: str, config, m: int) -> tuple:
    """Candidates that share a binary: tma/persistent binaries do not depend on M (all M here are
    multiples of 16); splitk's block_m follows M."""
    return (family, config) if family != "splitk" else (family, config, config.block_m)


# ------------------------------------------------------------------------------------- timing


_timer: Timer | None = None  # one flush buffer for the run, made in main()


def graph_ms(fn) -> float:
    """Median ms of replaying one captured call, L2 flushed before each replay."""
    return _timer.graph(fn).median_us / 1e3


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm())


def main() -> None:
    global _timer
    out_dir = os.environ.get("OUT", "/tmp/mid_m_out")
    os.makedirs(out_dir, exist_ok=True)
    rows_file = open(os.path.join(out_dir, "mid_m.jsonl"), "w")

    def emit(row):
        rows_file.write(json.dumps(row) + "\n")
        rows_file.flush()

    try:
        from tmagemm.bench.envinfo import metadata
        meta = metadata("PYTHONPATH=src python scripts/gpu/mid_m.py")
    except Exception as e:  # metadata is nice to have; the sweep is the point
        meta = {"error": str(e), "torch": torch.__version__, "triton": triton.__version__}
    meta["device_name"] = torch.cuda.get_device_name()
    with open(os.path.join(out_dir, "mid_m_meta.json"), "w") as f:
        json.dump(meta, f, indent=1, default=str)
    print(f"device {meta['device_name']} torch {torch.__version__} triton {triton.__version__}", flush=True)

    # -- compile every distinct binary in parallel
    tasks, seen = [], set()
    for m in MS:
        for family, config in candidates(m):
            key = compile_key(family, config, m)
            if key not in seen:
                seen.add(key)
                tasks.append((family, config, m))
    results = precompile(tasks)
    bad = {}
    for i, (family, config, m) in enumerate(tasks):
        err = results.get(i, "compile/first launch did not finish in time")
        if err is not None:
            bad[compile_key(family, config, m)] = err
            emit(dict(kind="compile_error", family=family, config=label(family, config), m=m, error=err))
    print(f"compiled {len(tasks) - len(bad)}/{len(tasks)} binaries in {time.time() - T0:.0f} s; "
          f"{len(bad)} failed", flush=True)
    for key, err in list(bad.items())[:12]:
        print(f"  skip {label(key[0], key[1])}: {err[:160]}", flush=True)

    # -- time every cell, M by M
    best = {}  # (m, family) -> (ms, label)
    _timer = Timer(torch.device("cuda"))
    cublas = {}
    for m in MS:
        if time.time() - T0 > BUDGET_S:
            print(f"budget reached before M={m}", flush=True)
            break
        a, b, sa, sb = problem(m)
        ref_fn = lambda: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=True)
        ref = ref_fn().double()
        ref_times = [graph_ms(ref_fn)]
        out = torch.empty(m, N, device="cuda", dtype=torch.bfloat16)
        args = GemmArgs(a, b, out, sa, sb)
        cells = []
        for family, config in candidates(m):
            if compile_key(family, config, m) in bad:
                continue
            if time.time() - T0 > BUDGET_S:
                break
            fn = launcher(family, config, args)
            try:
                out.fill_(float("nan"))
                fn()
                torch.cuda.synchronize()
                err = rel_err(out, ref)
                ms = graph_ms(fn) if err < MAX_REL_ERR else float("nan")
            except Exception as e:
                emit(dict(kind="error", m=m, family=family, config=label(family, config), error=str(e)[:300]))
                continue
            cells.append((family, config, ms, err))
            if len(cells) % 20 == 0:
                ref_times.append(graph_ms(ref_fn))  # cuBLAS again: drift shows up in the spread
        ref_times.append(graph_ms(ref_fn))
        ref_ms = statistics.median(ref_times)
        cublas[m] = (ref_ms, min(ref_times), max(ref_times))
        for family, config, ms, err in cells:
            row = dict(kind="cell", m=m, n=N, k=K, family=family, config=label(family, config),
                       params=asdict(config), ms=ms, us=ms * 1e3, cublas_us=ref_ms * 1e3,
                       ratio=ref_ms / ms if ms == ms else None, rel_err=err)
            emit(row)
            if ms == ms and (ms < best.get((m, family), (float("inf"),))[0]):
                best[(m, family)] = (ms, label(family, config), config)
        ranked = sorted((c for c in cells if c[2] == c[2]), key=lambda c: c[2])
        print(f"M={m}: cuBLAS {ref_ms * 1e3:.1f} us (spread {min(ref_times) * 1e3:.1f}-{max(ref_times) * 1e3:.1f}); "
              f"{len(cells)} cells; top 6:", flush=True)
        for family, config, ms, err in ranked[:6]:
            print(f"   {ms * 1e3:6.1f} us  {ref_ms / ms:5.3f}x  {label(family, config)}  err {err:.1e}", flush=True)
        wrong = [c for c in cells if not c[3] < MAX_REL_ERR]
        for family, config, ms, err in wrong[:5]:
            print(f"   WRONG rel_err {err:.2e}: {label(family, config)}", flush=True)

        # the device-descriptor variant with the best tma config of this M
        if (m, "tma") in best and time.time() - T0 < BUDGET_S:
            config = best[(m, "tma")][2]
            try:
                fn = launcher("tma", config, args, device_desc=True)
                out.fill_(float("nan"))
                fn()
                torch.cuda.synchronize()
                err = rel_err(out, ref)
                ms = graph_ms(fn)
                best[(m, "tma_device")] = (ms, label("tma_device", config), config)
                emit(dict(kind="cell", m=m, n=N, k=K, family="tma_device", config=label("tma", config),
                          params=asdict(config), ms=ms, us=ms * 1e3, cublas_us=ref_ms * 1e3,
                          ratio=ref_ms / ms, rel_err=err))
            except Exception as e:
                emit(dict(kind="error", m=m, family="tma_device", config=label("tma", config), error=str(e)[:300]))
        del a, b, out, ref

    rows_file.close()
    print(f"\nFP8 e4m3 -> bf16, N=K={N}, tensor-wise scales, graph replay median, L2 flushed; "
          f"ratio = cuBLAS time / ours ({time.time() - T0:.0f} s total)")
    print(f"{'M':>4} {'cuBLAS us':>9}  {'family':<10} {'us':>6} {'ratio':>6}  config")
    for m in MS:
        if m not in cublas:
            continue
        ref_ms = cublas[m][0]
        for family in ("tma", "tma_device", "splitk", "persistent"):
            if (m, family) in best:
                ms, name, _ = best[(m, family)]
                print(f"{m:>4} {ref_ms * 1e3:>9.1f}  {family:<10} {ms * 1e3:>6.1f} {ref_ms / ms:>6.3f}  {name}")


if __name__ == "__main__":
    sys.exit(main())
