"""``tmagemm``: benchmark, report, inspect, environment, warm-up and tuning commands.

    tmagemm bench [--preset sweep|llm|square|tma] [--m ..] [--n ..] [--k ..] [--dtype fp8|bf16|fp16]
    tmagemm bench --preset decode [--models llama3-8b,..] [--layers 8] [--m 1,16] [--dtype fp8|bf16]
    tmagemm bench --preset moe [--models deepseek-v3,..] [--m 1,64,256] [--dtype fp8|bf16] [--routing balanced,zipf]
    tmagemm bench --preset moe-train [--models mixtral-8x7b,..] [--m 256,1024] [--routing balanced,zipf]
    tmagemm bench --preset moe-layer [--models qwen3-235b-a22b,..] [--m 1,16,4096] [--routing balanced,zipf]
    tmagemm bench --preset model [--models llama3-8b,qwen3-8b] [--m 1,2,4,8,16] [--variants ..] [--compile-check]
    tmagemm report results/<run>/results.json
    tmagemm inspect triton.tma --dtype fp8 [--config block_m=128,block_n=256] | --cu FILE.cu [-D N=V]
    tmagemm env
    tmagemm warmup --shapes 4096x4096,2048x7168 | --preset llm  [--dtype fp8] [--max-m 8192]
    tmagemm tune   --shapes 4096x4096 | --preset llm  [--dtype fp8] [--max-m 8192] [--retune]

Without a GPU (or with ``--check``), ``bench`` runs the Triton kernels under the Triton
interpreter on small shapes, fp16 and fp8 unless ``--dtype`` names one, and checks them against
float64; options that only a GPU can honour (presets, ``--graph``, ``--budget-ms``) are refused
by name. The interpreter has to be chosen before any kernel module is imported, so the command
re-executes itself when that is too late.
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

    bench = sub.add_parser("bench", help="benchmark every tmagemm kernel against cuBLAS "
                           "(without a GPU: check the Triton kernels under the interpreter)",
                           description="Time every tmagemm kernel and the cuBLAS peers on a GPU. Without a GPU "
                           "(or with --check) run the Triton kernels under the Triton interpreter on small "
                           "shapes (fp16 and fp8 unless --dtype names one) and check them against float64; "
                           "no timing, so --preset, --graph and --budget-ms are refused there.")  # fmt: skip
    bench.add_argument("--preset", choices=("sweep", "llm", "square", "block", "tma", "decode", "moe", "moe-train",
                                                 "moe-layer", "model"),
                       default=None,
                       help="GPU only. sweep: M=1..8192 at N=K=4096 (default); llm: model projections; "
                            "square: 1024..16384; block: block-scaled FP8 checkpoint shapes (DeepSeek-V3, Qwen3; "
                            "use with --dtype fp8-block); tma: TMA copy throughput and NVRTC compile times; "
                            "decode: each model's layer stack (qkv, o, gate_up, down) in one CUDA graph, "
                            "per-layer time vs cuBLAS, fp8 tensor/row/block and bf16, M=1..128; "
                            "moe: grouped expert GEMMs (DeepSeek-V3, Qwen3-MoE, Mixtral) vs torch's grouped ops "
                            "and a per-expert loop, contiguous and masked, one call per CUDA graph; "
                            "moe-train: the same experts in training (bf16 forward, input and weight gradients, "
                            "and a step through autograd) vs torch._grouped_mm, one step per CUDA graph; "
                            "moe-layer: a whole MoE layer's experts (routing to the per-token sum), tmagemm.nn."
                            "FP8Experts (block and row) vs the same steps on torch._grouped_mm (bf16) and "
                            "torch._scaled_grouped_mm (fp8 row), --m tokens, one forward per CUDA graph; "
                            "model: decode tokens/s of a whole random 8B-shaped model (transformers Llama-3-8B "
                            "shape) in a CUDA graph, bf16 vs tmagemm.nn FP8 vs the same FP8 weights on torch's "
                            "fp8 GEMMs, batch 1-16, with logits and greedy-token checks")  # fmt: skip
    bench.add_argument("--m", type=_int_list, help="M values (with --n/--k: custom shapes; alone: overrides the preset's M)")
    bench.add_argument("--n", type=_int_list, help="N values (custom shapes)")
    bench.add_argument("--k", type=_int_list, help="K values (custom shapes)")
    bench.add_argument("--dtype", choices=("fp8", "fp8-block", "bf16", "fp16"), default=None,
                       help="input dtype (default fp8; without a GPU: fp16 and fp8); fp8-block: fp8 with 1x128 "
                            "activation and 128x128 weight scales")  # fmt: skip
    bench.add_argument("--providers", type=lambda s: [p for p in s.split(",") if p],
                       help="comma-separated provider names or globs, e.g. 'triton.*,cublas*'")  # fmt: skip
    bench.add_argument("--rowwise", action="store_true", help="fp8: row-wise scales instead of tensor-wise")
    bench.add_argument("--exact-accum", action="store_true", help="fp8: tmagemm kernels accumulate in fp32 every K tile")
    bench.add_argument("--graph", action="store_true", help="also time CUDA-graph replay (GPU only)")
    bench.add_argument("--no-host-loop", action="store_true", help="skip the per-call Python loop timing")
    bench.add_argument("--budget-ms", type=float, default=None,
                       help="GPU time of timed runs per (shape, provider), default 200 (GPU only)")  # fmt: skip
    bench.add_argument("--out", type=Path, help="output directory (default results/<date>-<preset>-<dtype>; "
                       "without a GPU results/<date>-check-<shapes>-<dtypes>)")  # fmt: skip
    bench.add_argument("--no-plots", action="store_true", help="skip the PNG figures")
    bench.add_argument("--configs", action="store_true",
                       help="also run every candidate config of the variants that have them (Triton tiles, the "
                            "native promoting tiles), one provider each (named variant@config, e.g. "
                            "'triton.tma@64x128x128s4w4', 'cuda.blockscaled@coop128x256s4c2pb'; select with "
                            "--providers)")
    bench.add_argument("--models", type=lambda s: [p for p in s.split(",") if p],
                       help="--preset decode: comma-separated models (default all: llama3-8b, llama3-70b-tp4, "
                            "qwen2.5-7b, deepseek-v3); --preset moe: deepseek-v3, deepseek-v3-ep4, qwen3-235b-a22b, "
                            "mixtral-8x7b (default all); --preset moe-train and moe-layer: the same (default all but "
                            "deepseek-v3, whose 256 experts need about 60 GB); --preset model: llama3-8b (default), qwen3-8b, "
                            "tiny")  # fmt: skip
    bench.add_argument("--routing", type=lambda s: [p for p in s.split(",") if p],
                       help="--preset moe, moe-train and moe-layer: comma-separated routings, balanced and/or zipf "
                            "(default both)")
    bench.add_argument("--layers", type=int, default=None,
                       help="--preset decode: layers per captured stack, each with its own weights (default 8); "
                            "--preset model: the model's depth (default its own, 32 for llama3-8b)")
    bench.add_argument("--variants", type=lambda s: [p for p in s.split(",") if p],
                       help="--preset model: comma-separated variants (default all: bf16, fp8-tmagemm, "
                            "fp8-tmagemm-fused and fp8-tmagemm-fused-norms where tmagemm.nn.convert has their "
                            "flags, fp8-torch-block, fp8-tmagemm-row, fp8-torch-row, no-proj)")  # fmt: skip
    bench.add_argument("--context", type=int, default=None,
                       help="--preset model: tokens in the KV cache when the timed step runs (default 512)")
    bench.add_argument("--new-tokens", type=int, default=None,
                       help="--preset model: greedy tokens compared between eager steps and graph replays (default 16)")
    bench.add_argument("--compile-check", action="store_true",
                       help="--preset model: also compare greedy tokens of torch.compile(mode='reduce-overhead') "
                            "with eager, and time the compiled steps, for bf16 and the fp8-tmagemm variants at "
                            "every batch of --m (each compile of a 32-layer model takes 40-55 s on an H100; the "
                            "time is reported)")  # fmt: skip
    bench.add_argument("--init-std", type=float, default=None,
                       help="--preset model: std of the random weights (default transformers' initializer_range, 0.02)")
    bench.add_argument("--check", action="store_true",
                       help="accuracy check only, under the Triton interpreter on small shapes unless --m/--n/--k give "
                            "others (the default without a GPU)")  # fmt: skip

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

    for name, text in (("warmup", "compile and load every kernel the given weight shapes can pick, for every M "
                                  "(run once at server start; artefacts persist on disk for later processes)"),
                       ("tune", "tune the Triton kernels' configs per M bucket offline and store them on disk, "
                                "where every later process reads them; reports the gain over the heuristic")):
        cmd = sub.add_parser(name, help=text)
        what = cmd.add_mutually_exclusive_group(required=True)
        what.add_argument("--shapes", type=_weight_shapes,
                          help="weight shapes NxK (nn.Linear(K, N)), comma-separated, e.g. 4096x4096,28672x4096")
        what.add_argument("--preset", choices=("sweep", "llm", "square"),
                          help="the weight shapes of a bench preset (llm: Llama-3, Qwen2.5, DeepSeek-V3 projections)")
        cmd.add_argument("--dtype", action="append", choices=("fp8", "bf16", "fp16"),
                         help="input dtype (repeatable; default fp8)")
        cmd.add_argument("--scales", action="append", choices=("tensor", "row", "block"),
                         help="fp8 scaling the model uses (repeatable; default row; block: 1x128 activations x "
                              "128x128 weight blocks)")
        cmd.add_argument("--out-dtype", choices=("bf16", "fp16", "fp32"), default="bf16", help="output dtype")
        cmd.add_argument("--max-m", type=int, default=8192, help="largest M (batch tokens) to prepare for")
        cmd.add_argument("--exact-accum", action="store_true", help="fp8 with use_fast_accum=False")
        if name == "warmup":
            cmd.add_argument("--bias", action="store_true", help="the model's linears have a bias")
        else:
            cmd.add_argument("--retune", action="store_true", help="tune buckets that already have a stored config")
        cmd.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def _weight_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        n, sep, k = item.lower().partition("x")
        if not sep or not n.isdigit() or not k.isdigit() or int(n) < 1 or int(k) < 1:
            raise argparse.ArgumentTypeError(f"expected NxK weight shapes such as 4096x4096, got {item!r}")
        shapes.append((int(n), int(k)))
    if not shapes:
        raise argparse.ArgumentTypeError("expected at least one NxK weight shape")
    return shapes


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


def _shape_set(args: argparse.Namespace) -> str:
    """What the shapes of a run are called in its folder name."""
    return args.preset or ("custom" if args.n or args.k else "sweep")


def _default_out(what: str) -> Path:
    """results/<date>-<what>, ``what`` naming the shapes and dtypes the run actually covers."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("results") / f"{stamp}-{what}"


def _check_mode_plan(args: argparse.Namespace):
    """Dtypes, shapes and folder name of the interpreter check; refuses options it cannot honour."""
    from .bench import runner, shapes

    if args.dtype == "bf16":
        raise ValueError("--dtype bf16 needs a GPU: the Triton interpreter's bf16 dot is wrong")
    if args.preset and not (args.n or args.k):  # with --n/--k, _shapes names the conflict instead
        if args.preset == "tma":
            raise ValueError("--preset tma needs a GPU: it times TMA copies and NVRTC compiles")
        if args.preset == "moe-train":
            raise ValueError("--preset moe-train needs a GPU: it times CUDA-graph replay of the expert GEMMs of "
                             "a training step (GBs of bf16 weights and gradients) against torch._grouped_mm")
        if args.preset == "moe-layer":
            raise ValueError("--preset moe-layer needs a GPU: it times CUDA-graph replay of MoE layers' experts "
                             "(GBs of expert weights) against torch's grouped ops")
        if args.preset == "moe":
            raise ValueError("--preset moe needs a GPU: it times CUDA-graph replay of grouped expert GEMMs "
                             "(up to 15 GB of expert weights per call) against torch's grouped ops")  # fmt: skip
        if args.preset == "decode":
            raise ValueError("--preset decode needs a GPU: it times CUDA-graph replay of model layer stacks "
                             "(hundreds of MB of weights per layer) against cuBLAS")  # fmt: skip
        if args.preset == "model":
            raise ValueError("--preset model needs a GPU: it times CUDA-graph replay of a whole model's decode step "
                             "(an 8B model: 16 GB of bf16 weights) against its FP8 conversions")  # fmt: skip
        largest = max(max(s.m, s.n, s.k) for s in shapes.preset_shapes(args.preset))
        raise ValueError(f"--preset {args.preset} needs a GPU: its shapes (sizes up to {largest}) are far too large "
                         "for the Triton interpreter. Without a GPU (or with --check) bench checks small shapes; "
                         "give others with --m/--n/--k")  # fmt: skip
    no_timing = "without a GPU (or with --check) bench only checks accuracy under the Triton interpreter"
    if args.graph:
        raise ValueError(f"--graph needs a GPU: it times CUDA-graph replay, and {no_timing}")
    if args.budget_ms is not None:
        raise ValueError(f"--budget-ms needs a GPU: it sets the time of timed runs, and {no_timing}")
    dtypes = (args.dtype,) if args.dtype else ("fp16", "fp8")
    if args.m or args.n or args.k:
        checked, what = tuple(_shapes(args)), _shape_set(args)
    else:
        checked, what = runner.CHECK_SHAPES, "small"
    return dtypes, checked, f"check-{what}-{'+'.join(dtypes)}"


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
    source = "gemm_sm90_one_warpgroup.cu"
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


def _refuse_fp8_options_without_fp8(args: argparse.Namespace) -> None:
    if args.dtype in ("bf16", "fp16"):
        for flag, given in (("--rowwise", args.rowwise), ("--exact-accum", args.exact_accum)):
            if given:
                raise ValueError(f"{flag} applies to fp8 runs only, and --dtype {args.dtype} has no fp8 scales")


def _given(args: argparse.Namespace, *flags: str) -> list[str]:
    """The options among ``flags`` set on the command line: any value but the parser's None /
    False (an empty list counts as unset, 0 as set)."""
    values = {flag: getattr(args, flag.lstrip("-").replace("-", "_")) for flag in flags}
    return [flag for flag, value in values.items() if value is not None and value is not False and value != []]


def cmd_bench(args: argparse.Namespace, command: str) -> int:
    import torch

    from .bench import runner
    from .bench.results import BenchResult
    from .bench import envinfo

    _refuse_fp8_options_without_fp8(args)
    if args.preset not in ("decode", "moe", "moe-train", "moe-layer", "model") and (args.models or
                                                                                 args.layers is not None):
        raise ValueError("--models and --layers apply to --preset decode only, and to --preset model (--models also to "
                         "--preset moe, moe-train and moe-layer)")
    model_only = _given(args, "--variants", "--context", "--new-tokens", "--compile-check", "--init-std")
    if args.preset != "model" and model_only:
        raise ValueError(f"{', '.join(model_only)} apply to --preset model only")
    if args.preset not in ("moe", "moe-train", "moe-layer") and args.routing:
        raise ValueError("--routing applies to --preset moe, moe-train and moe-layer only")
    if args.check or not torch.cuda.is_available():
        dtypes, checked, what = _check_mode_plan(args)
        out_dir = args.out or _default_out(what)
        print(f"No GPU (or --check): checking the Triton kernels under the interpreter, {' and '.join(dtypes)} on "
              f"{len(checked)} shape(s); timings need a GPU.", file=sys.stderr)  # fmt: skip
        result = runner.check(dtypes, checked, tuple(args.providers) if args.providers else None, command,
                              rowwise=args.rowwise, fast_accum=not args.exact_accum, configs=args.configs)  # fmt: skip
        _emit(result, out_dir, plots=False)
        return 0 if all(r["status"] in ("checked", "unsupported", "absent") for r in result.records) else 1
    if args.preset == "decode":
        return _bench_decode(args, command)
    if args.preset == "moe":
        return _bench_moe(args, command)
    if args.preset == "moe-train":
        return _bench_moe_train(args, command)
    if args.preset == "moe-layer":
        return _bench_moe_layer(args, command)
    if args.preset == "model":
        return _bench_model(args, command)
    if args.preset == "tma":
        given = _given(args, "--m", "--n", "--k", "--dtype", "--providers", "--rowwise", "--exact-accum", "--graph",
                       "--budget-ms", "--configs")
        if given:
            raise ValueError(f"--preset tma measures TMA copies and NVRTC compiles; {', '.join(given)} do not apply")
        result = BenchResult(envinfo.metadata(command), extras=_tma_extras())
        _emit(result, args.out or _default_out("tma"), plots=False)
        return 0
    config = runner.BenchConfig(
        shapes=tuple(_shapes(args)),
        dtype=args.dtype or "fp8",
        providers=tuple(args.providers) if args.providers else None,
        rowwise=args.rowwise,
        fast_accum=not args.exact_accum,
        graph=args.graph,
        host_loop=not args.no_host_loop,
        configs=args.configs,
        command=command,
        **({} if args.budget_ms is None else {"budget_ms": args.budget_ms}),
    )
    out_dir = args.out or _default_out(f"{_shape_set(args)}-{config.dtype}")
    result = runner.run(config)
    _emit(result, out_dir, plots=not args.no_plots)
    return 0 if not any(r["status"] == "wrong" for r in result.records) else 1


def _bench_decode(args: argparse.Namespace, command: str) -> int:
    """``--preset decode`` (bench/decode.py): its own tables and records; ``tmagemm report`` prints them."""
    from .bench import decode

    given = _given(args, "--n", "--k", "--providers", "--rowwise", "--graph", "--no-host-loop", "--configs")
    if given:
        raise ValueError(f"--preset decode times tmagemm vs cuBLAS on fp8 tensor/row/block and bf16 stacks, always "
                         f"as CUDA-graph replay; {', '.join(given)} do not apply (--dtype picks the recipes, "
                         "--models the models, --m the M values)")  # fmt: skip
    config = decode.DecodeConfig(
        models=decode.parse_models(args.models),
        recipes=decode.recipes_for(args.dtype),
        m_values=tuple(args.m or decode.DECODE_M),
        layers=decode.DEFAULT_LAYERS if args.layers is None else args.layers,
        fast_accum=not args.exact_accum,
        command=command,
        **({} if args.budget_ms is None else {"budget_ms": args.budget_ms}),
    )
    out_dir = args.out or _default_out(f"decode-{args.dtype or 'fp8+bf16'}")
    return _run_graphed(decode, config, out_dir)


def _run_graphed(preset, config, out_dir) -> int:
    """Run a graph-timed preset module (decode, moe, model), print and save its tables; 1 if a row was wrong."""
    from .bench import graphed
    from .bench.results import WRONG

    result, records = preset.run(config)
    print(graphed.render(result))
    paths = graphed.save(result, records, preset.FIELDS, preset.NAME, out_dir)
    print("\nwrote " + ", ".join(str(p) for p in paths.values()))
    return 0 if not any(r["status"] == WRONG for r in records) else 1


def _bench_moe(args: argparse.Namespace, command: str) -> int:
    """``--preset moe`` (bench/moe.py): its own tables and records; ``tmagemm report`` prints them."""
    from .bench import moe

    given = _given(args, "--n", "--k", "--providers", "--rowwise", "--graph", "--no-host-loop", "--layers",
                   "--configs")
    if given:
        raise ValueError(f"--preset moe times tmagemm vs torch's grouped ops and a per-expert loop on fp8 (row-wise) "
                         f"and bf16 expert GEMMs, always as CUDA-graph replay; {', '.join(given)} do not apply "
                         "(--models picks the models, --m the tokens per expert, --dtype fp8|bf16, --routing "
                         "balanced,zipf)")  # fmt: skip
    config = moe.MoEConfig(
        models=moe.parse_models(args.models),
        dtypes=moe.dtypes_for(args.dtype),
        m_values=tuple(args.m or moe.DEFAULT_M),
        routings=moe.parse_routings(args.routing),
        fast_accum=not args.exact_accum,
        command=command,
        **({} if args.budget_ms is None else {"budget_ms": args.budget_ms}),
    )
    out_dir = args.out or _default_out(f"moe-{args.dtype or 'fp8+bf16'}")
    return _run_graphed(moe, config, out_dir)


def _bench_moe_train(args: argparse.Namespace, command: str) -> int:
    """``--preset moe-train`` (bench/moe_train.py): its own tables and records."""
    from .bench import moe, moe_train

    given = _given(args, "--n", "--k", "--providers", "--rowwise", "--exact-accum", "--graph", "--no-host-loop",
                   "--layers", "--configs")
    if args.dtype not in (None, "bf16"):
        given.append(f"--dtype {args.dtype}")
    if given:
        raise ValueError(f"--preset moe-train times tmagemm vs torch._grouped_mm on bf16 expert GEMMs of a training "
                         f"step, always as CUDA-graph replay; {', '.join(given)} do not apply (--models picks the "
                         "models, --m the tokens per expert, --routing balanced,zipf)")  # fmt: skip
    config = moe_train.MoETrainConfig(
        models=moe_train.parse_models(args.models),
        m_values=tuple(args.m or moe_train.DEFAULT_M),
        routings=moe.parse_routings(args.routing),
        command=command,
        **({} if args.budget_ms is None else {"budget_ms": args.budget_ms}),
    )
    return _run_graphed(moe_train, config, args.out or _default_out("moe-train-bf16"))


def _bench_moe_layer(args: argparse.Namespace, command: str) -> int:
    """``--preset moe-layer`` (bench/moe_layer.py): its own tables and records."""
    from .bench import moe, moe_layer

    given = _given(args, "--n", "--k", "--providers", "--dtype", "--rowwise", "--exact-accum", "--graph",
                   "--no-host-loop", "--layers", "--configs")
    if given:
        raise ValueError(f"--preset moe-layer times tmagemm.nn.FP8Experts vs torch's grouped ops on whole MoE "
                         f"layers' experts, always as CUDA-graph replay; {', '.join(given)} do not apply (--models "
                         "picks the models, --m the tokens, --routing balanced,zipf)")  # fmt: skip
    config = moe_layer.MoELayerConfig(
        models=moe_layer.DEFAULT_MODELS if not args.models else moe.parse_models(args.models),
        tokens=tuple(args.m or moe_layer.DEFAULT_TOKENS),
        routings=moe.parse_routings(args.routing),
        command=command,
        **({} if args.budget_ms is None else {"budget_ms": args.budget_ms}),
    )
    return _run_graphed(moe_layer, config, args.out or _default_out("moe-layer"))


def _bench_model(args: argparse.Namespace, command: str) -> int:
    """``--preset model`` (bench/model.py): its own tables and records; ``tmagemm report`` prints them."""
    from .bench import model

    given = _given(args, "--n", "--k", "--providers", "--dtype", "--rowwise", "--exact-accum", "--graph",
                   "--no-host-loop", "--configs")
    if given:
        raise ValueError(f"--preset model times whole decode steps of fixed variants (bf16, tmagemm.nn FP8, torch "
                         f"fp8), always as CUDA-graph replay; {', '.join(given)} do not apply (--variants picks the "
                         "variants, --models the models, --m the batch sizes)")  # fmt: skip
    config = model.ModelBenchConfig(
        models=model.parse_models(args.models),
        variants=model.parse_variants(args.variants),
        batches=tuple(args.m or model.DEFAULT_BATCHES),
        layers=args.layers,
        context=model.DEFAULT_CONTEXT if args.context is None else args.context,
        new_tokens=model.DEFAULT_NEW_TOKENS if args.new_tokens is None else args.new_tokens,
        compile_check=args.compile_check,
        init_std=args.init_std,
        command=command,
        **({} if args.budget_ms is None else {"budget_ms": args.budget_ms}),
    )
    out_dir = args.out or _default_out("model")
    return _run_graphed(model, config, out_dir)


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
        from . import plan

        rows = [(v.name, f"[{v.backend}]", v.description) for v in plan.variants()]
        rows += [(module, "", f"not importable: {reason}") for module, reason in plan.unavailable().items()]
        widths = [max((len(row[i]) for row in rows), default=0) for i in (0, 1)]
        for name, backend, text in rows:
            print(f"{name:<{widths[0]}}  {backend:<{widths[1]}}  {text}".rstrip())
        return 0
    if bool(args.kernel) == bool(args.cu):
        raise ValueError("name exactly one of: a variant (e.g. triton.tma) or --cu FILE.cu")
    defines = {k: v for d in args.defines for k, v in d.items()}
    if not args.cu and defines:
        raise ValueError("-D applies to --cu sources only")
    with inspection.quiet_fp_fusion_notice():
        if args.cu:
            art = inspection.compile_native(args.cu, defines)
        else:
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


def cmd_startup(args: argparse.Namespace) -> int:
    """``tmagemm warmup`` / ``tmagemm tune``."""
    import torch

    from . import startup

    if not torch.cuda.is_available():
        raise RuntimeError(f"{args.command} needs a CUDA GPU (it compiles and times kernels on it)")
    if args.max_m < 1:
        raise ValueError(f"--max-m must be >= 1, got {args.max_m}")
    if args.shapes:
        shapes = args.shapes
    else:
        from .bench import shapes as presets

        shapes = list(dict.fromkeys((s.n, s.k) for s in presets.preset_shapes(args.preset)))
    out_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.out_dtype]
    common = dict(dtypes=args.dtype or ["fp8"], max_m=args.max_m, scales=args.scales or ["row"],
                  out_dtype=out_dtype, use_fast_accum=not args.exact_accum, progress=not args.quiet)
    if args.command == "warmup":
        summary = startup.warmup(shapes, bias=args.bias, **common)
        print(f"warmup: {len(shapes)} weight shapes, {summary.line()}")
        return 0
    summary = startup.tune(shapes, retune=args.retune, **common)
    print(f"tune: {len(shapes)} weight shapes, {summary.line()}")
    if not summary.outcomes:
        print("nothing tuned: every bucket already had a stored config (--retune tunes again) or runs a kernel "
              "with a fixed heuristic (split-K, native)")
    for outcome in summary.outcomes:
        if outcome.heuristic_ms and outcome.chosen_ms:
            gain = f"{outcome.heuristic_ms / outcome.chosen_ms:.3f}x"
            times = f"{outcome.heuristic_ms * 1e3:8.1f} us -> {outcome.chosen_ms * 1e3:8.1f} us"
        else:
            gain, times = "-", "(heuristic could not be timed)"
        kept = "heuristic kept" if outcome.chosen == outcome.heuristic else "tuned config stored"
        print(f"  {outcome.key:<64} {times}  {gain:>7}  {kept}")
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
        if args.command in ("warmup", "tune"):
            return cmd_startup(args)
        return cmd_env(args)
    except (ValueError, TypeError, RuntimeError) as exc:
        print(f"tmagemm {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
