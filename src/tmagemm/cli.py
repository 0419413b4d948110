"""``tmagemm``: benchmark, report, inspect and environment commands.

    tmagemm bench [--preset sweep|llm|square|tma] [--m ..] [--n ..] [--k ..] [--dtype fp8|bf16|fp16]
    tmagemm report results/<run>/results.json
    tmagemm inspect triton.tma --dtype fp8 [--config block_m=128,block_n=256] | --cu FILE.cu [-D N=V]
    tmagemm env

Without a GPU, ``bench`` runs the Triton kernels under the Triton interpreter on small shapes
and checks them against float64; the interpreter has to be chosen before any kernel module is
imported, so the command re-executes itself when that is too late.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
from pathlib import Path

_KERNEL_MODULE_PREFIXES = ("tmagemm.triton.", "tmagemm.cuda.")


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got {text!r}")
    return values


def _key_values(text: str) -> dict[str, int | str]:
    out: dict[str, int | str] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"expected key=value pairs separated by commas, got {item!r}")
        out[key.strip()] = int(value) if value.strip().lstrip("-").isdigit() else value.strip()
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tmagemm", description="TMA GEMM kernels for Hopper: benchmark and inspect.")
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="benchmark every tmagemm kernel against cuBLAS")
    bench.add_argument("--preset", choices=("sweep", "llm", "square", "tma"), default=None,
                       help="sweep: M=1..8192 at N=K=4096 (default); llm: model projections; square: 1024..16384; "
                            "tma: TMA copy throughput and NVRTC compile times")  # fmt: skip
    bench.add_argument("--m", type=_int_list, help="M values (with --n/--k: custom shapes; alone: overrides the preset's M)")
    bench.add_argument("--n", type=_int_list, help="N values (custom shapes)")
    bench.add_argument("--k", type=_int_list, help="K values (custom shapes)")
    bench.add_argument("--dtype", choices=("fp8", "bf16", "fp16"), default=None, help="input dtype (default fp8)")
    bench.add_argument("--providers", type=lambda s: [p for p in s.split(",") if p],
                       help="comma-separated provider names or globs, e.g. 'triton.*,cublas*'")  # fmt: skip
    bench.add_argument("--rowwise", action="store_true", help="fp8: row-wise scales instead of tensor-wise")
    bench.add_argument("--exact-accum", action="store_true", help="fp8: tmagemm kernels accumulate in fp32 every K tile")
    bench.add_argument("--graph", action="store_true", help="also time CUDA-graph replay")
    bench.add_argument("--no-host-loop", action="store_true", help="skip the per-call Python loop timing")
    bench.add_argument("--budget-ms", type=float, default=200.0, help="GPU time of timed runs per (shape, provider)")
    bench.add_argument("--out", type=Path, help="output directory (default results/<date>-<preset>-<dtype>)")
    bench.add_argument("--no-plots", action="store_true", help="skip the PNG figures")
    bench.add_argument("--check", action="store_true",
                       help="accuracy check only under the Triton interpreter (the default without a GPU)")  # fmt: skip

    report = sub.add_parser("report", help="re-render tables and plots of a saved result")
    report.add_argument("path", type=Path, help="results.json or the directory holding it")
    report.add_argument("--out", type=Path, help="where to write the plots (default: beside the result)")
    report.add_argument("--no-plots", action="store_true")

    insp = sub.add_parser("inspect", help="compile a kernel for sm_90a and summarize its PTX/SASS")
    insp.add_argument("kernel", nargs="?", help="a registered variant, e.g. triton.tma (see --list)")
    insp.add_argument("--list", action="store_true", help="list the variants that can be inspected")
    insp.add_argument("--dtype", choices=("fp8", "bf16", "fp16"), default="fp8")
    insp.add_argument("--config", type=_key_values, help="Triton config overrides, e.g. block_m=128,num_stages=4")
    insp.add_argument("--cu", help="a native source under tmagemm/cuda to compile instead of a variant")
    insp.add_argument("-D", dest="defines", action="append", default=[], type=_key_values,
                      help="a define for --cu, NAME=VALUE (repeatable)")  # fmt: skip
    insp.add_argument("--out", type=Path, default=Path("inspect"), help="directory for the .ptx/.cubin/.sass dumps")
    insp.add_argument("--json", action="store_true", help="print the summary as JSON")

    sub.add_parser("env", help="device, driver, library versions and which kernel paths are available")
    return parser


# --------------------------------------------------------------------------------------------
# bench / report
# --------------------------------------------------------------------------------------------


def _needs_interpreter(args: argparse.Namespace) -> bool:
    import torch

    return args.command == "bench" and (args.check or not torch.cuda.is_available())


def _ensure_interpreter(argv: list[str]) -> None:
    """Switch Triton to its interpreter, re-executing when kernel modules are already imported."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return
    os.environ["TRITON_INTERPRET"] = "1"
    if any(name.startswith(_KERNEL_MODULE_PREFIXES) for name in sys.modules):
        os.execv(sys.executable, [sys.executable, "-m", "tmagemm.cli", *argv])


def _shapes(args: argparse.Namespace):
    from .bench import shapes

    if args.n or args.k:
        if args.preset:
            raise ValueError("--n/--k give custom shapes; drop --preset or drop --n/--k")
        return shapes.custom_shapes(args.m or [], args.n or [], args.k or [])
    return shapes.preset_shapes(args.preset or "sweep", args.m)


def _default_out(args: argparse.Namespace) -> Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    name = args.preset or ("custom" if args.n or args.k else "sweep")
    return Path("results") / f"{stamp}-{name}-{args.dtype or 'fp8'}"


def _tma_extras() -> dict:
    """The TMA toolkit's numbers: copy throughput and NVRTC compile / cache-hit times."""
    import dataclasses
    import tempfile
    import time

    extras: dict = {}
    try:
        from .bench import tma_copy
    except ImportError as exc:
        extras["tma_copy"] = f"absent: tmagemm.bench.tma_copy not importable ({exc})"
    else:
        try:
            value = tma_copy.run_tma_copy_bench()
            if isinstance(value, list):
                value = [dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for v in value]
            elif dataclasses.is_dataclass(value):
                value = dataclasses.asdict(value)
            extras["tma_copy"] = value
        except Exception as exc:
            extras["tma_copy"] = f"failed: {type(exc).__name__}: {exc}"
    try:
        from . import jit
    except ImportError as exc:
        extras["nvrtc"] = f"absent: tmagemm.jit not importable ({exc})"
        return extras
    source = "gemm_sm90_seed.cu"
    previous = os.environ.get("TMAGEMM_CACHE_DIR")
    try:
        with tempfile.TemporaryDirectory(prefix="tmagemm-nvrtc-") as cache:
            os.environ["TMAGEMM_CACHE_DIR"] = cache  # an empty cache: the first compile is a real miss
            jit.clear_memory_cache()
            cold = jit.compile(source)
            jit.clear_memory_cache()
            disk = jit.compile(source)
            t0 = time.perf_counter()
            jit.compile(source)
            memory_s = time.perf_counter() - t0
        extras["nvrtc"] = {"source": source, "first_compile_s": cold.compile_seconds, "disk_cache_hit_s": disk.compile_seconds,
                           "memory_cache_hit_s": memory_s, "disk_hit": disk.cache_hit}  # fmt: skip
    except Exception as exc:
        extras["nvrtc"] = f"failed: {type(exc).__name__}: {exc}"
    finally:
        if previous is None:
            os.environ.pop("TMAGEMM_CACHE_DIR", None)
        else:
            os.environ["TMAGEMM_CACHE_DIR"] = previous
    return extras


def _emit(result, out_dir: Path | None, plots: bool) -> None:
    from .bench import plots as plotting, report, results

    print(report.render(result))
    if out_dir is None:
        return
    paths = list(results.save(result, out_dir).values())
    if plots:
        paths += plotting.plot_all(result, out_dir)
    (out_dir / "table.txt").write_text(report.render(result) + "\n")
    print("\nwrote " + ", ".join(str(p) for p in paths))


def cmd_bench(args: argparse.Namespace, command: str) -> int:
    import torch

    from .bench import runner
    from .bench.results import BenchResult
    from .bench import envinfo

    out_dir = args.out or _default_out(args)
    if args.check or not torch.cuda.is_available():
        dtype = args.dtype
        if dtype == "bf16":
            raise ValueError("--dtype bf16 needs a GPU: the Triton interpreter's bf16 dot is wrong")
        if args.preset == "tma":
            raise ValueError("--preset tma needs a GPU")
        shapes = tuple(_shapes(args)) if (args.m or args.n or args.k) else runner.CHECK_SHAPES
        print("No GPU (or --check): running the Triton kernels under the interpreter on small shapes; "
              "timings need a GPU.", file=sys.stderr)  # fmt: skip
        result = runner.check((dtype,) if dtype else ("fp16", "fp8"), shapes,
                              tuple(args.providers) if args.providers else None, command)  # fmt: skip
        _emit(result, out_dir, plots=False)
        return 0 if all(r["status"] in ("checked", "unsupported", "absent") for r in result.records) else 1
    if args.preset == "tma":
        result = BenchResult(envinfo.metadata(command), extras=_tma_extras())
        _emit(result, out_dir, plots=False)
        return 0
    config = runner.BenchConfig(
        shapes=tuple(_shapes(args)),
        dtype=args.dtype or "fp8",
        providers=tuple(args.providers) if args.providers else None,
        rowwise=args.rowwise,
        fast_accum=not args.exact_accum,
        graph=args.graph,
        host_loop=not args.no_host_loop,
        budget_ms=args.budget_ms,
        command=command,
    )
    result = runner.run(config)
    _emit(result, out_dir, plots=not args.no_plots)
    return 0 if not any(r["status"] == "wrong" for r in result.records) else 1


def cmd_report(args: argparse.Namespace) -> int:
    from .bench import results

    result = results.load(args.path)
    base = args.path if args.path.is_dir() else args.path.parent
    out = args.out or base
    from .bench import plots as plotting, report

    print(report.render(result))
    if not args.no_plots:
        made = plotting.plot_all(result, out)
        if made:
            print("\nwrote " + ", ".join(str(p) for p in made))
    return 0


# --------------------------------------------------------------------------------------------
# inspect / env
# --------------------------------------------------------------------------------------------


def cmd_inspect(args: argparse.Namespace) -> int:
    import json

    from . import inspection

    if args.list:
        from . import dispatch

        for v in dispatch.variants():
            print(f"{v.name:22s} [{v.backend}] {v.description}")
        for module, reason in dispatch.unavailable().items():
            print(f"{module:22s} not importable: {reason}")
        return 0
    if bool(args.kernel) == bool(args.cu):
        raise ValueError("name exactly one of: a variant (e.g. triton.tma) or --cu FILE.cu")
    defines = {k: v for d in args.defines for k, v in d.items()}
    if args.cu:
        art = inspection.compile_native(args.cu, defines)
    else:
        if defines:
            raise ValueError("-D applies to --cu sources only")
        art = inspection.inspect_variant(args.kernel, args.dtype, args.config)
    paths = inspection.write_dumps(art, args.out)
    summary = inspection.summarize(art)
    if args.json:
        print(json.dumps({**summary, "files": {k: str(v) for k, v in paths.items()}}, indent=1))
        return 0
    width = max(len(k) for k in summary)
    for key, value in summary.items():
        if value not in (0, None) or not key.startswith(("ptx ", "sass ")):
            print(f"{key:<{width}}  {'-' if value is None else value}")
    zero = [k for k, v in summary.items() if v == 0 and k.startswith(("ptx ", "sass "))]
    if zero:
        print(f"{'absent (0)':<{width}}  " + ", ".join(zero))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def cmd_env(args: argparse.Namespace) -> int:
    from .bench import envinfo

    meta = envinfo.metadata(" ".join(sys.argv))
    keys = ("gpu", "capability", "sm_count", "memory_gib", "l2_mib", "driver", "clocks", "torch", "torch_cuda",
            "triton", "tmagemm", "cuda_bindings", "nvrtc", "python", "git_sha")  # fmt: skip
    width = 22
    for key in keys:
        if key in meta:
            print(f"{key:<{width}}  {meta[key] if meta[key] is not None else '-'}")
    print()
    for what, state in envinfo.capabilities():
        print(f"{what:<{width + 8}}  {state}")
    print()
    try:
        rows = envinfo.registry()
    except Exception as exc:
        rows = [("registry", f"failed: {type(exc).__name__}: {exc}")]
    for name, text in rows:
        print(f"{name:<{width + 8}}  {text}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if _needs_interpreter(args):
        _ensure_interpreter(argv)
    command = "tmagemm " + shlex.join(argv)
    try:
        if args.command == "bench":
            return cmd_bench(args, command)
        if args.command == "report":
            return cmd_report(args)
        if args.command == "inspect":
            return cmd_inspect(args)
        return cmd_env(args)
    except (ValueError, TypeError, RuntimeError) as exc:
        print(f"tmagemm {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
