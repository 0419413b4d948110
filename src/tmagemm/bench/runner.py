"""The benchmark loop: every (shape, provider) is checked against float64, then timed.

Nothing a provider does can end the run: absent, unsupported, failed and wrong results are
recorded with their reason. Without a GPU, :func:`check` runs the Triton kernels under the
interpreter on small shapes and verifies them; timing needs a GPU.
"""

from __future__ import annotations

import fnmatch
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, TextIO

import torch

from . import envinfo, providers as prov
from .results import ABSENT, CHECKED, FAILED, OK, UNSUPPORTED, WRONG, BenchResult, derive, error_text
from .shapes import CHECK_SHAPES, Shape
from .timing import Timer, copy_bandwidth_gbs, host_loop_us, matmul_peak_tflops

# The seed write-ups' end-to-end number: a decode-sized GEMM where host overhead dominates.
HOST_LOOP_SHAPE = Shape(16, 4096, 4096)


@dataclass(frozen=True)
class BenchConfig:
    """What one ``tmagemm bench`` run measures.

    providers: glob patterns of provider names (None: all). rowwise: row-wise fp8 scales
    instead of tensor-wise. fast_accum: fp8 accumulation mode of the tmagemm providers.
    graph: also time CUDA-graph replay. host_loop: also time a Python loop of calls at
    :data:`HOST_LOOP_SHAPE`. budget_ms: GPU time spent on timed runs per (shape, provider).
    configs: also time every candidate config of the variants that have them, one provider each.
    """

    shapes: tuple[Shape, ...]
    dtype: str = "fp8"
    providers: tuple[str, ...] | None = None
    rowwise: bool = False
    fast_accum: bool = True
    graph: bool = False
    host_loop: bool = True
    budget_ms: float = 200.0
    configs: bool = False
    command: str = ""


class Progress:
    """A one-line progress bar on a terminal; one line per step otherwise (logs, CI)."""

    def __init__(self, total: int, stream: TextIO | None = None, width: int = 28):
        self.total, self.done, self.width = total, 0, width
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty()
        self.t0 = time.perf_counter()

    def step(self, label: str) -> None:
        self.done += 1
        filled = self.width * self.done // max(self.total, 1)
        elapsed = time.perf_counter() - self.t0
        line = f"[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} {elapsed:5.0f}s {label}"
        if self.tty:
            self.stream.write("\r" + line[:120].ljust(120))
            if self.done == self.total:
                self.stream.write("\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def _record(shape: Shape, dtype: str, provider: prov.Provider, bytes_: int) -> dict[str, Any]:
    return {
        "m": shape.m, "n": shape.n, "k": shape.k, "label": shape.label, "dtype": dtype,
        "provider": provider.name, "family": provider.family, "status": None, "reason": None,
        "median_us": None, "p20_us": None, "p80_us": None, "reps": None,
        "graph_median_us": None, "graph_p20_us": None, "graph_p80_us": None,
        "max_rel_err": None, "tolerance": prov.TOLERANCE[dtype], "flops": shape.flops, "bytes": bytes_,
    }  # fmt: skip


def _run_one(provider: prov.Provider, case: prov.Case, timer: Timer | None, graph: bool) -> dict[str, Any]:
    rec = _record(case.shape, case.dtype, provider, case.compulsory_bytes)
    if provider.absent:
        rec.update(status=ABSENT, reason=provider.absent)
        return rec
    try:
        prepared = provider.prepare(case)
    except prov.Unsupported as exc:
        rec.update(status=UNSUPPORTED, reason=str(exc))
        return rec
    except Exception as exc:
        rec.update(status=FAILED, reason=f"prepare: {error_text(exc)}")
        return rec
    try:
        # The first call compiles (and tunes, with TMAGEMM_AUTOTUNE=1); it is also the one checked
        # for accuracy.
        out = prepared.call()
        err = prov.relative_error(out, case, prepared.out_scale, prepared.reference)
    except Exception as exc:
        rec.update(status=FAILED, reason=error_text(exc))
        return rec
    rec["max_rel_err"] = err
    good = err <= rec["tolerance"]
    if timer is None:
        rec.update(status=CHECKED if good else WRONG)
    else:
        rec["status"] = OK if good else WRONG
    if not good:
        rec["reason"] = f"max rel err {err:.3g} > {rec['tolerance']:g}"
    if timer is None:
        return rec
    try:
        t = timer.eager(prepared.call)
        rec.update(median_us=t.median_us, p20_us=t.p20_us, p80_us=t.p80_us, reps=t.reps)
        if t.host_bound:
            rec["reason"] = "; ".join(filter(None, [rec["reason"], "timing: host fell behind the GPU; times may include launch work"]))
    except Exception as exc:
        rec.update(status=FAILED, reason=f"timing: {error_text(exc)}")
        return rec
    if graph:
        try:
            t = timer.graph(prepared.call)
            rec.update(graph_median_us=t.median_us, graph_p20_us=t.p20_us, graph_p80_us=t.p80_us)
        except Exception as exc:
            rec["reason"] = "; ".join(filter(None, [rec["reason"], f"graph: {error_text(exc)}"]))
    return rec


def _ceilings(dtype: str, device: torch.device) -> dict[str, Any]:
    ceilings: dict[str, Any] = {"copy_gbs": None, "peak_tflops": {}, "errors": []}
    try:
        ceilings["copy_gbs"] = copy_bandwidth_gbs(device)
    except Exception as exc:
        ceilings["errors"].append(f"copy bandwidth: {error_text(exc)}")
    try:
        ceilings["peak_tflops"][dtype] = matmul_peak_tflops(dtype, device)
    except Exception as exc:
        ceilings["errors"].append(f"{dtype} matmul peak: {error_text(exc)}")
    return ceilings


def _host_loop(chosen: list[prov.Provider], config: BenchConfig, device: torch.device) -> list[dict[str, Any]]:
    """Per-call time of an unsynchronised Python loop for each tmagemm provider and the main peer."""
    rows = []
    case = prov.make_case(HOST_LOOP_SHAPE, config.dtype, device, config.rowwise)
    peer = prov.main_peer(config.dtype)
    for p in chosen:
        if p.absent or not (p.family == "tmagemm" or p.name == peer):
            continue
        row = {"provider": p.name, "m": case.shape.m, "n": case.shape.n, "k": case.shape.k, "us_per_call": None, "reason": None}
        try:
            row["us_per_call"] = host_loop_us(p.prepare(case).call)
        except prov.Unsupported as exc:
            row["reason"] = f"unsupported: {exc}"
        except Exception as exc:
            row["reason"] = error_text(exc)
        rows.append(row)
    return rows


def _providers(config: BenchConfig) -> list[prov.Provider]:
    everything = prov.tmagemm_providers(config.fast_accum, config.configs) + prov.peer_providers()
    return prov.select(everything, config.dtype, list(config.providers) if config.providers else None)


def run(config: BenchConfig, stream: TextIO | None = None) -> BenchResult:
    """Benchmark ``config`` on the current CUDA device."""
    if not torch.cuda.is_available():
        raise RuntimeError("tmagemm bench needs a CUDA GPU for timing; without one use check()")
    device = torch.device("cuda", torch.cuda.current_device())
    chosen = _providers(config)
    meta = envinfo.metadata(config.command)
    meta["config"] = {**asdict(config), "shapes": [str(s) for s in config.shapes]}
    meta["providers"] = {p.name: p.description for p in chosen}
    meta["ceilings"] = _ceilings(config.dtype, device)
    result = BenchResult(meta)
    timer = Timer(device, config.budget_ms)
    progress = Progress(len(config.shapes) * len(chosen), stream)
    for shape in config.shapes:
        try:
            case = prov.make_case(shape, config.dtype, device, config.rowwise)
        except Exception as exc:  # e.g. out of memory for the operands or the reference
            for p in chosen:
                rec = _record(shape, config.dtype, p, 0)
                rec.update(status=FAILED, reason=f"operands: {error_text(exc)}")
                result.records.append(rec)
                progress.step(f"{shape} {p.name}")
            continue
        for p in chosen:
            result.records.append(_run_one(p, case, timer, config.graph))
            progress.step(f"{shape} {p.name}")
        del case
    del timer
    torch.cuda.empty_cache()
    if config.host_loop:
        result.host_loop = _host_loop(chosen, config, device)
    return derive(result)


# Backends whose providers run under the Triton interpreter (the others need a GPU).
INTERPRETER_BACKENDS = ("triton", "api")


def _check_providers(dtypes: tuple[str, ...], patterns: tuple[str, ...] | None, fast_accum: bool,
                     configs: bool = False) -> dict[str, list]:
    """The interpreter-capable providers per dtype. A pattern that matches none of them is an
    error naming the dtypes checked and the GPU-only providers it would have matched."""
    everything = prov.tmagemm_providers(fast_accum, configs) + prov.peer_providers()
    runnable = [p for p in everything if p.backend in INTERPRETER_BACKENDS]
    for pattern in patterns or ():
        def matches(p: prov.Provider) -> bool:
            return any(d in p.dtypes for d in dtypes) and fnmatch.fnmatchcase(p.name, pattern)

        if not any(matches(p) for p in runnable):
            names = ", ".join(p.name for p in runnable if any(d in p.dtypes for d in dtypes))
            gpu_only = [p.name for p in everything if p not in runnable and matches(p)]
            why = f"; {', '.join(gpu_only)} need a GPU" if gpu_only else ""
            raise ValueError(f"--providers {pattern!r} matches none of the providers the interpreter check runs for "
                             f"{' and '.join(dtypes)} (Triton kernels and tmagemm.auto): {names}{why}")  # fmt: skip
    return {dtype: prov.select(runnable, dtype, list(patterns) if patterns else None) for dtype in dtypes}


def check(dtypes: tuple[str, ...] = ("fp16", "fp8"), shapes: tuple[Shape, ...] = CHECK_SHAPES,
          patterns: tuple[str, ...] | None = None, command: str = "", stream: TextIO | None = None,
          rowwise: bool = False, fast_accum: bool = True, configs: bool = False) -> BenchResult:  # fmt: skip
    """CPU mode: run the Triton providers under the interpreter on small shapes, no timing.

    rowwise, fast_accum and configs mean what they do in :class:`BenchConfig` (the first two for
    fp8 cases only).
    """
    if "bf16" in dtypes:
        raise ValueError("the Triton interpreter computes bf16 dots wrongly; check fp16 and fp8 on the CPU")
    meta = envinfo.metadata(command)
    meta["mode"] = "interpreter check (no GPU): accuracy only, timings need a GPU"
    meta["config"] = {"dtypes": list(dtypes), "shapes": [str(s) for s in shapes], "rowwise": rowwise,
                      "fast_accum": fast_accum, "configs": configs,
                      "providers": list(patterns) if patterns else None}  # fmt: skip
    result = BenchResult(meta)
    per_dtype = _check_providers(tuple(dtypes), patterns, fast_accum, configs)
    progress = Progress(sum(len(v) for v in per_dtype.values()) * len(shapes), stream)
    for dtype, chosen in per_dtype.items():
        for shape in shapes:
            case = prov.make_case(shape, dtype, "cpu", rowwise)
            for p in chosen:
                result.records.append(_run_one(p, case, None, False))
                progress.step(f"{dtype} {shape} {p.name}")
    return derive(result)
