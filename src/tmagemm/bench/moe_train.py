"""``tmagemm bench --preset moe-train``: an MoE layer's expert GEMMs in training (bf16), each step
one call per CUDA graph, against ``torch._grouped_mm``.

A *case* is one expert projection (gate_up or down) of one model of ``--preset moe`` at ``m``
tokens per expert and one routing (the same models, counts and Zipf law), in the contiguous
layout: x (rows, K) sorted by expert, ``offs`` the cumulative int32 group ends on the device, w
(E, N, K) the experts' weights, dy (rows, N) the output gradient. Every case runs four steps:

* ``forward``: ``y = grouped_mm(x, w.transpose(1, 2), offs=offs)``;
* ``input_grad``: ``dx = grouped_mm(dy, w, offs=offs)``;
* ``weight_grad``: ``dw = grouped_mm(x.t(), dy, offs=offs)``, (E, K, N): torch's 2-D x 2-D form;
* ``step``: forward and backward through autograd, ``grouped_mm(x, w.transpose(1, 2),
  offs=offs).backward(dy)`` with x and w leaves whose ``.grad`` accumulates (each provider's own
  backward: tmagemm's writes d w in w's (E, N, K) layout).

Providers: ``tmagemm`` (``tmagemm.grouped_mm``) and ``torch`` (``torch._grouped_mm``), each step
captured as ONE call per ``torch.cuda.CUDAGraph`` and timed as replays in alternating rounds.
Every step's result (the step's x.grad and w.grad after one replay from zeros) is checked against
float64 on up to ``moe.CHECK_EXPERTS`` experts (busiest, lightest, seeded others): max|out -
ref| / max|ref| <= ``TOLERANCE``; d x and y on the first ``moe.CHECK_ROWS`` rows of each.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, TextIO

from . import graphed, moe
from .graphed import fmt, table
from .results import FAILED, OK, UNSUPPORTED, WRONG, BenchResult, error_text, geomean

NAME = "moe-train"  # the preset, and the key of its records in results.json
PROVIDERS = ("tmagemm", "torch")
STEPS = ("forward", "input_grad", "weight_grad", "step")
# Tokens per expert; a model runs those with E x m <= moe.MAX_ROWS (DeepSeek-V3's 256 experts: 256,
# its EP 4 share and Qwen3-235B: up to 1024 / 512, Mixtral: all).
DEFAULT_M = (256, 1024, 4096)
# DeepSeek-V3's whole layer (256 experts) holds 15 GB of bf16 gate_up weights, as much again in
# w.grad and in each provider's weight gradient: opt in with --models.
DEFAULT_MODELS = ("deepseek-v3-ep4", "qwen3-235b-a22b", "mixtral-8x7b")
DEFAULT_BUDGET_MS = 20.0
TOLERANCE = 1e-2  # bf16 outputs and gradients, fp32 accumulation

FIELDS = (
    "model", "projection", "e", "n", "k", "routing", "m", "rows", "experts_touched", "max_count", "step",
    "provider", "status", "reason", "us", "p20_us", "p80_us", "replays", "l2_flushed", "flops", "tflops",
    "speedup_vs_torch", "max_rel_err", "tolerance", "checked",
)  # fmt: skip


def parse_models(names: list[str] | None) -> tuple[str, ...]:
    return DEFAULT_MODELS if not names else moe.parse_models(names)


def grid(models: tuple[str, ...], m_values: tuple[int, ...], routings: tuple[str, ...]) -> list[moe.Case]:
    """Every case of a run (``moe.Case``, bf16, contiguous), in run order (model, projection: one
    weight set at a time)."""
    cases = []
    for name in models:
        model = moe.MODELS[name]
        for p in model.projections():
            for m in m_values:
                if model.experts * m > moe.MAX_ROWS:
                    continue
                for r in routings:
                    counts = tuple(moe.counts_for(model, m, r))
                    cases.append(moe.Case(name, p.name, p.n, p.k, model.experts, "bf16", "contiguous", r, m, counts))
    return cases


@dataclass(frozen=True)
class MoETrainConfig:
    """One ``--preset moe-train`` run. budget_ms: GPU time of timed replays per (case, step,
    provider)."""

    models: tuple[str, ...] = DEFAULT_MODELS
    m_values: tuple[int, ...] = DEFAULT_M
    routings: tuple[str, ...] = moe.ROUTINGS
    budget_ms: float = DEFAULT_BUDGET_MS
    command: str = ""

    def __post_init__(self):
        if not self.m_values or any(m < 1 or m > 8192 for m in self.m_values):
            raise ValueError(f"--preset moe-train needs tokens per expert (--m) in 1..8192, got {list(self.m_values)}")
        if self.budget_ms <= 0:
            raise ValueError(f"--budget-ms must be > 0, got {self.budget_ms}")
        moe.parse_models(list(self.models))
        moe.parse_routings(list(self.routings))
        if not self.cases():
            raise ValueError(f"--m {','.join(map(str, self.m_values))} gives no case: E x m must be <= "
                             f"{moe.MAX_ROWS} ({', '.join(f'{n}: E = {moe.MODELS[n].experts}' for n in self.models)})")

    def cases(self) -> list[moe.Case]:
        return grid(self.models, self.m_values, self.routings)


def new_record(case: moe.Case, step: str, provider: str) -> dict[str, Any]:
    rec: dict[str, Any] = {f: None for f in FIELDS}
    flops = 2 * case.rows * case.n * case.k * (3 if step == "step" else 1)
    rec.update(model=case.model, projection=case.projection, e=case.e, n=case.n, k=case.k, routing=case.routing,
               m=case.m, rows=case.rows, experts_touched=sum(1 for c in case.counts if c > 0),
               max_count=max(case.counts), step=step, provider=provider, flops=flops, tolerance=TOLERANCE)
    return rec


def _key(r: dict[str, Any]) -> tuple:
    return r["model"], r["projection"], r["routing"], r["m"], r["step"]


def derive(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """TFLOP/s of every timed record; on tmagemm's, ``speedup_vs_torch`` (torch's time / ours)
    where both ran correctly."""
    by_key: dict[tuple, dict[str, dict]] = {}
    for r in records:
        r["tflops"] = r["speedup_vs_torch"] = None
        if r["status"] == OK and r.get("us"):
            r["tflops"] = r["flops"] / (r["us"] * 1e-6) / 1e12
        by_key.setdefault(_key(r), {})[r["provider"]] = r
    timed = lambda r: r is not None and r["status"] == OK and r.get("us")  # noqa: E731
    for group in by_key.values():
        ours, torch_ = group.get("tmagemm"), group.get("torch")
        if timed(ours) and timed(torch_):
            ours["speedup_vs_torch"] = torch_["us"] / ours["us"]
    return records


def geomeans(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per step and per routing (and "all"): geomean, minimum and maximum of tmagemm's speedup."""
    rows = []
    routings = list(dict.fromkeys(r["routing"] for r in records))
    for step in STEPS:
        for routing in routings + (["all"] if len(routings) > 1 else []):
            values = [r["speedup_vs_torch"] for r in records if r["provider"] == "tmagemm" and r["step"] == step
                      and routing in ("all", r["routing"]) and r["speedup_vs_torch"] is not None]
            if values:
                rows.append({"step": step, "routing": routing, "n": len(values), "speedup_vs_torch": geomean(values),
                             "min": min(values), "max": max(values)})
    return rows


def case_table(records: list[dict[str, Any]]) -> str:
    """One row per (case, step): each provider's us, tmagemm's TFLOP/s, speedup, error."""
    groups: dict[tuple, dict[str, dict]] = {}
    for r in records:
        groups.setdefault(_key(r), {})[r["provider"]] = r
    rows = []
    for group in groups.values():
        any_ = next(iter(group.values()))
        ours = group.get("tmagemm") or {}

        def us(p: str) -> str:
            r = group.get(p) or {}
            return fmt(r.get("us"), ".1f") if r.get("status") == OK else "-"

        speedup = ours.get("speedup_vs_torch")
        note = ", ".join(f"{p} {r['status']}" for p, r in group.items() if r["status"] != OK)
        rows.append([any_["model"], any_["projection"], str(any_["e"]), any_["routing"], str(any_["m"]),
                     str(any_["rows"]), str(any_["max_count"]), any_["step"], us("tmagemm"), us("torch"),
                     fmt(ours.get("tflops"), ".0f"), "-" if speedup is None else f"{speedup:.3f}x",
                     fmt(ours.get("max_rel_err"), ".1e"), note])  # fmt: skip
    headers = ["model", "proj", "E", "routing", "m", "rows", "max count", "step", "tmagemm us", "torch us",
               "TFLOP/s", "vs torch", "err", "note"]  # fmt: skip
    return table(headers, rows)


def geomean_table(records: list[dict[str, Any]]) -> str:
    rows = [[g["step"], g["routing"], str(g["n"]), f"{g['speedup_vs_torch']:.3f}", f"{g['min']:.3f}", f"{g['max']:.3f}"]
            for g in geomeans(records)]
    return table(["step", "routing", "n", "vs torch (geomean)", "min", "max"], rows)


NOTES = (
    "us = median CUDA-graph replay time of ONE call (forward, input_grad, weight_grad) or of one "
    "forward + backward through autograd (step), providers in alternating rounds; L2 flushed (256 MB "
    "zeroed) before each replay where the experts' weights are < 256 MB. torch = torch._grouped_mm "
    "(the same calls; step: its autograd). vs torch = torch's time / tmagemm's. TFLOP/s from 2 x rows "
    "x N x K per GEMM (step: three). err = max|out - ref| / max|ref| vs float64 on up to "
    f"{moe.CHECK_EXPERTS} experts (busiest, lightest, seeded others): y and d x on their first "
    f"{moe.CHECK_ROWS} rows, d w whole; step: x.grad and w.grad after one replay from zeros."
)


def tables(records: list[dict[str, Any]]) -> dict[str, str]:
    """The printed report as named text blocks (also in results.json's extras: ``tmagemm report``)."""
    out = {"moe-train cases": case_table(records), "moe-train geomeans (tmagemm vs torch)": geomean_table(records)}
    return graphed.finish_tables(
        "moe-train", out, records, lambda r: f"{r['model']} {r['projection']} {r['routing']} m={r['m']} {r['step']}",
        NOTES, 2)


# ------------------------------------------------------------------------------- GPU: steps


@dataclass
class _Operands:
    x: Any  # (rows, K)
    w: Any  # (E, N, K)
    dy: Any  # (rows, N)
    offs: Any  # (E,) int32 cumulative ends
    starts: list[int]


def _operands(case: moe.Case, device) -> _Operands:
    import torch

    gen = torch.Generator(device=device).manual_seed(moe.SEED + case.m * 7 + case.n + case.k)
    bf16 = torch.bfloat16
    x = moe.randn((case.rows, case.k), bf16, device, gen)
    w = moe.randn((case.e, case.n, case.k), bf16, device, gen, 1 / math.sqrt(case.k))
    dy = moe.randn((case.rows, case.n), bf16, device, gen)
    starts = moe.group_starts(case.counts)
    offs = torch.tensor([s + c for s, c in zip(starts, case.counts)], dtype=torch.int32, device=device)
    return _Operands(x, w, dy, offs, starts)


def _build(provider: str, step: str, ops: _Operands) -> tuple[Callable[[], None], Callable[[], Any]]:
    """(call, result): one call of the step, and what the last call (or replay) produced: an
    output tensor, or the step's (x.grad, w.grad)."""
    import torch

    fn = torch._grouped_mm
    if provider == "tmagemm":
        from .. import grouped

        fn = grouped.grouped_mm
    if step == "step":
        x = ops.x.detach().requires_grad_()
        w = ops.w.detach().requires_grad_()
        x.grad, w.grad = torch.zeros_like(x), torch.zeros_like(w)  # the graph accumulates into these

        def call() -> None:
            fn(x, w.transpose(1, 2), offs=ops.offs).backward(ops.dy)

        def result():
            return x.grad, w.grad

        return call, result
    operands = {"forward": (ops.x, ops.w.transpose(1, 2)), "input_grad": (ops.dy, ops.w),
                "weight_grad": (ops.x.t(), ops.dy)}[step]  # fmt: skip
    held: dict[str, Any] = {}

    def call() -> None:
        held["out"] = fn(*operands, offs=ops.offs)

    return call, lambda: held["out"]


def _check(case: moe.Case, step: str, result, ops: _Operands) -> tuple[float, str]:
    """Max relative error of ``result`` against float64 on the checked experts, and where."""
    import torch

    worst, where = 0.0, ""
    for g in moe.check_experts(case.counts):
        s, c = ops.starts[g], case.counts[g]
        head = slice(s, s + min(c, moe.CHECK_ROWS))
        x, dy, w = ops.x[s : s + c].double(), ops.dy[s : s + c].double(), ops.w[g].double()
        if step == "forward":
            pairs = [("y", result[head], ops.x[head].double() @ w.t())]
        elif step == "input_grad":
            pairs = [("d x", result[head], ops.dy[head].double() @ w)]
        elif step == "weight_grad":
            pairs = [("d w", result[g], x.t() @ dy)]
        else:
            grad_x, grad_w = result
            pairs = [("x.grad", grad_x[head], ops.dy[head].double() @ w), ("w.grad", grad_w[g], dy.t() @ x)]
        for what, got, ref in pairs:
            got = got.double()
            if not torch.isfinite(got).all():
                return float("inf"), f"expert {g} {what} (non-finite)"
            err = ((got - ref).abs().max() / ref.abs().max().clamp(min=1e-300)).item()
            if err >= worst:
                worst, where = err, f"expert {g} ({c} rows) {what}"
    return worst, where


def _zero_grads(result) -> None:
    for t in result():
        t.zero_()


def _run_step(case: moe.Case, step: str, ops: _Operands, config: MoETrainConfig, flush) -> list[dict[str, Any]]:
    """Both providers at one step of one case: build, first call, capture, time, check."""
    import torch

    records = {p: new_record(case, step, p) for p in PROVIDERS}
    graphs, results = {}, {}
    for provider in PROVIDERS:
        rec = records[provider]
        try:
            call, result = _build(provider, step, ops)
            call()  # first call: plans (tmagemm), picks the kernel (torch)
            torch.cuda.synchronize()
            graphs[provider] = graphed.capture(call)
            results[provider] = result
        except Exception as exc:
            status = FAILED if provider == "tmagemm" else UNSUPPORTED
            rec.update(status=status, reason=error_text(exc))
            torch.cuda.synchronize()
    flushed = case.e * case.n * case.k * 2 < moe.FLUSH_BELOW_BYTES
    if graphs:
        times = graphed.time_graphs(graphs, config.budget_ms, flush if flushed else None)
        for provider, ms in times.items():
            median, p20, p80 = graphed.replay_quantiles(ms)
            records[provider].update(us=median, p20_us=p20, p80_us=p80, replays=len(ms), l2_flushed=flushed)
    checked = f"{len(moe.check_experts(case.counts))} of {sum(1 for c in case.counts if c)} experts"
    for provider, graph in graphs.items():
        if step == "step":
            _zero_grads(results[provider])
        graph.replay()  # the check reads what one replay of this provider's own graph wrote
        torch.cuda.synchronize()
        rec = records[provider]
        err, where = _check(case, step, results[provider](), ops)
        rec.update(max_rel_err=err, checked=checked, status=OK if err <= TOLERANCE else WRONG)
        if rec["status"] == WRONG:
            rec["reason"] = f"max rel err {err:.3g} > {TOLERANCE:.3g} (vs float64; worst: {where})"
    del graphs, results
    return list(records.values())


def run(config: MoETrainConfig, stream: TextIO | None = None) -> tuple[BenchResult, list[dict[str, Any]]]:
    """Time every case and step of ``config`` for both providers on the current GPU."""
    import torch

    from .runner import Progress
    from .timing import FLUSH_BYTES

    device, meta = graphed.start_run(NAME, config, "it times CUDA-graph replay of grouped expert GEMMs")
    meta["models"] = moe.models_metadata(config.models)
    meta["routing"] = {"zipf_s": moe.ZIPF_S, "seed": moe.SEED, "max_rows": moe.MAX_ROWS}
    flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device=device)
    cases = config.cases()
    records: list[dict[str, Any]] = []
    progress = Progress(len(cases), stream or sys.stderr)
    t0 = time.perf_counter()
    for case in cases:
        ops = None
        try:
            torch.cuda.empty_cache()
            ops = _operands(case, device)
            for step in STEPS:
                records += _run_step(case, step, ops, config, flush)
        except Exception as exc:  # e.g. out of memory
            done = {(r["step"], r["provider"]) for r in records if r["model"] == case.model
                    and r["projection"] == case.projection and r["routing"] == case.routing and r["m"] == case.m}
            records += [{**new_record(case, s, p), "status": FAILED, "reason": error_text(exc)}
                        for s in STEPS for p in PROVIDERS if (s, p) not in done]  # fmt: skip
            torch.cuda.synchronize()
        del ops
        progress.step(f"{case.model} {case.projection} {case.routing} m={case.m}")
    meta["wall_s"] = round(time.perf_counter() - t0, 1)
    derive(records)
    return graphed.make_result(meta, tables(records)), records
