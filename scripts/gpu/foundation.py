"""Device check for the Triton GEMMs: correctness of every variant, speed vs cuBLAS, host overhead.

Run on an H100/H200: ``PYTHONPATH=src python scripts/gpu/foundation.py [--quick]``. Prints a short
table last; writes the full rows to $OUT/foundation.json when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import triton

import tmagemm
from tmagemm import dispatch, tuning
from tmagemm.bench.timing import Timer, host_loop_us
from tmagemm.dispatch import GemmArgs

FP8 = torch.float8_e4m3fn


_timer: Timer | None = None  # one flush buffer for the whole run, made in main()


def bench(fn) -> float:
    """Median ms of eager calls, L2 flushed before each (tmagemm.bench.timing)."""
    return _timer.eager(fn).median_us / 1e3


def graph_ms(fn) -> float:
    """Kernel time without host overhead: one call captured in a CUDA graph, replays timed with
    the L2 flushed between them (fn must have run once already, so nothing tunes in capture)."""
    return _timer.graph(fn).median_us / 1e3


def host_us(fn) -> float:
    """Per-call host time of a Python loop that synchronises once at the end."""
    return host_loop_us(fn, calls=400)


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


SPEED_VARIANTS = ["triton.tma", "triton.tma_device", "triton.persistent", "cuda.persistent_coop",
                  "cuda.persistent_pingpong", "tmagemm.auto"]


def _provider(name, args):
    if name == "tmagemm.auto":
        if args.is_fp8:
            return lambda: tmagemm.scaled_mm(args.a, args.b, args.scale_a, args.scale_b, out=args.out)
        return lambda: tmagemm.matmul(args.a, args.b, out=args.out)
    v = dispatch.get(name)
    reason = v.supports(args)
    if reason:
        raise ValueError(reason)
    return lambda: v.run(args)


def _speed_rows(rows, dtype, shape, args, ref_fn):
    """One row per variant; cuBLAS is re-timed right before each variant, so every ratio pairs two
    measurements taken at the same clocks (on large shapes the GPU heats up during a group, and a
    single cuBLAS time taken first made the variants timed last read 3-10% low)."""
    m, n, k = shape
    ref = ref_fn()
    names = [nm for nm in SPEED_VARIANTS if nm == "tmagemm.auto" or nm in {v.name for v in dispatch.variants()}]
    for name in names:
        try:
            fn = _provider(name, args)
            fn()  # compiles and tunes outside the timed region
            ref_ms = graph_ms(ref_fn)
            ms = graph_ms(fn)
            eager = bench(fn)
            err = rel_err(args.out, ref.double())
        except Exception as e:
            rows.append(dict(kind="speed", variant=name, dtype=dtype, shape=shape, error=str(e)[:300]))
            continue
        rows.append(dict(kind="speed", variant=name, dtype=dtype, shape=shape, ms=ms, eager_ms=eager, ref_ms=ref_ms,
                         ratio=ref_ms / ms, tflops=2 * m * n * k / ms / 1e9, err_vs_cublas=err))


def speed(rows, quick, fp8_ms=None, bf16=True):
    fp8_ms = fp8_ms or ((16, 64, 128, 256, 384, 512, 1024, 2048, 4096, 8192) if not quick else (128, 1024, 4096))
    for m in fp8_ms:
        n = k = 4096
        a, b, sa, sb = fp8_problem(m, n, k)
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        args = GemmArgs(a, b, out, sa.reshape(1), sb.reshape(1))
        _speed_rows(rows, "fp8", (m, n, k), args,
                    lambda: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=True))
        print(f"fp8 M={m} done", flush=True)
    # (512, 4096, 4096): the last M the dispatcher gives to Triton for 16-bit types.
    for m, n, k in ([(4096,) * 3] if quick else [(512, 4096, 4096), (4096,) * 3, (8192,) * 3]) if bf16 else ():
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        _speed_rows(rows, "bf16", (m, n, k), GemmArgs(a, b, out), lambda a=a, b=b: torch.matmul(a, b))


def host_times(rows):
    """Host time per call (M=16, N=K=4096 fp8; the issue's measurement) for the public API and
    torch._scaled_mm, then the parts of ours, each measured on its own. ``issue`` is the loop's
    own time with the GPU kept busy (pure host cost); ``loop`` waits for the GPU at the end (the
    seed's end-to-end number, which converges to the kernel time when that is longer)."""
    from tmagemm import api
    from tmagemm.triton import matmul_tma
    from tmagemm.triton.host import tma_layout, triton_launch

    m, n, k = 16, 4096, 4096
    a, b, sa, sb = fp8_problem(m, n, k)
    sa1, sb1 = sa.reshape(1), sb.reshape(1)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    args = GemmArgs(a, b, out, sa1, sb1)
    layout = tma_layout(args)
    config = matmul_tma.heuristic(args)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    big = fp8_problem(1024, n, k)
    big_args = GemmArgs(big[0], big[1], torch.empty(1024, n, device="cuda", dtype=torch.bfloat16), big[2].reshape(1),
                        big[3].reshape(1))
    parts = {
        "torch._scaled_mm": lambda: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=True),
        "tmagemm.scaled_mm": lambda: tmagemm.scaled_mm(a, b, sa1, sb1),
        "torch.matmul bf16": lambda: torch.matmul(x, w),
        "tmagemm.matmul bf16": lambda: tmagemm.matmul(x, w),
        "torch._scaled_mm M=1024": lambda: torch._scaled_mm(big[0], big[1], big[2], big[3], out_dtype=torch.bfloat16,
                                                           use_fast_accum=True),
        "tmagemm.scaled_mm M=1024": lambda: tmagemm.scaled_mm(big[0], big[1], big[2].reshape(1), big[3].reshape(1)),
        "part: argument checks": lambda: api.check_scaled_mm(a, b, sa1, sb1, None, torch.bfloat16, None, "auto"),
        "part: call key": lambda: ("scaled_mm", api._key(a), api._key(b), api._key(sa1), api._key(sb1), api._key(None),
                                   api._key(None), torch.bfloat16, True, "auto"),
        "part: torch.empty out": lambda: torch.empty(m, n, device="cuda", dtype=torch.bfloat16),
        "part: plan lookup": lambda: dispatch.plan(args),
        "part: direct launch (triton.tma)": dispatch.get("triton.tma").prepare(args),
        "part: Triton launch, host descriptors": lambda: triton_launch(matmul_tma.kernel_call(args, config, layout)),
        "part: Triton launch, device-built maps": lambda: triton_launch(
            matmul_tma.kernel_call(args, config, layout, True)),
    }
    if "cuda.persistent_coop" in {v.name for v in dispatch.variants()}:
        parts["part: native persistent_coop launch (M=1024)"] = dispatch.get("cuda.persistent_coop").prepare(big_args)
    result = {}
    for name, fn in parts.items():
        call = (lambda f=fn: f(args)) if name.startswith("part: direct") else (
            (lambda f=fn: f(big_args)) if name.startswith("part: native") else fn)
        try:
            result[name] = dict(issue=round(_timer.host_us(call), 2), loop=round(host_us(call), 2))
        except Exception as e:
            result[name] = dict(error=f"{type(e).__name__}: {str(e)[:160]}")
    os.environ["TMAGEMM_DIRECT_LAUNCH"] = "0"
    dispatch.clear_plans()
    try:
        tmagemm.scaled_mm(a, b, sa1, sb1)
        result["tmagemm.scaled_mm, TMAGEMM_DIRECT_LAUNCH=0"] = dict(
            issue=round(_timer.host_us(lambda: tmagemm.scaled_mm(a, b, sa1, sb1)), 2))
    finally:
        os.environ.pop("TMAGEMM_DIRECT_LAUNCH")
        dispatch.clear_plans()
    kernel = _timer.eager(lambda: tmagemm.scaled_mm(a, b, sa1, sb1)).median_us
    result["kernel time of tmagemm.scaled_mm (L2 flushed)"] = dict(issue=round(kernel, 2))
    chosen = dispatch.choose(args).name
    rows.append(dict(kind="host", shape=(m, n, k), variant=chosen, **{k_: v for k_, v in result.items()}))
    print(f"host time per call, M=16 N=K=4096 (auto runs {chosen}); us: issue (GPU kept busy) / loop (sync at end)")
    for name, r in result.items():
        print(f"  {name:50s} {r}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--skip-correctness", action="store_true", help="the pytest GPU suite covers it")
    parser.add_argument("--fp8-m", default="", help="comma-separated M values of the fp8 speed rows (bf16 rows skipped)")
    parser.add_argument("--host-only", action="store_true", help="host time per call only, no speed table")
    opts = parser.parse_args()
    global _timer
    _timer = Timer(torch.device("cuda"))
    props = torch.cuda.get_device_properties(0)
    print(f"device {props.name} SMs {props.multi_processor_count} torch {torch.__version__} triton {triton.__version__}")
    rows = []
    t = time.time()
    if not opts.skip_correctness:
        os.environ["TMAGEMM_AUTOTUNE"] = "0"  # heuristic configs: correctness should not wait on tuning
        correctness(rows)
        os.environ["TMAGEMM_AUTOTUNE"] = "1"
        print(f"correctness done {time.time() - t:.0f}s", flush=True)
    try:
        host_times(rows)
    except Exception as e:  # keep the speed table even if a measurement path breaks
        print("host times failed:", type(e).__name__, str(e)[:300], flush=True)
    if not opts.host_only:
        fp8_ms = tuple(int(x) for x in opts.fp8_m.split(",") if x)
        speed(rows, opts.quick, fp8_ms, bf16=not fp8_ms)
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
                      f"{r['ratio']:6.3f} {r['tflops']:8.1f} eager {r['eager_ms']:.4f} err {r['err_vs_cublas']:.1e}")
    ok = sum(1 for r in rows if r["kind"] == "correct" and isinstance(r["err"], float) and r["err"] < 2e-2)
    print(f"correctness: {ok}/{sum(1 for r in rows if r['kind'] == 'correct')} within 2e-2")


if __name__ == "__main__":
    main()
