"""``tmagemm bench --preset moe``: grouped expert GEMMs of MoE layers, one call per CUDA graph.

A *case* is one expert projection (gate_up or down) of one model's MoE layer at one number of
tokens per expert ``m``, one routing and one layout:

* contiguous (prefill): ``E * m`` rows of A sorted by expert, ``offs`` the cumulative int32 group
  ends on the device. Run for every ``m`` with ``E * m <= MAX_ROWS``.
* masked (decode, DeepGEMM's layout): A is (E, max_m, K), ``masked_m`` the int32 rows per expert.
  Run for ``m <= MASKED_MAX_M``; max_m = the largest count (= m when balanced).

Routing: ``balanced`` (every expert m rows) or ``zipf`` (counts drawn with a fixed seed from a
Zipf law over a seeded permutation of the experts, s = ZIPF_S, no expert above the rows a top-k
router can send it: every token picks top_k distinct experts; same total ``E * m`` as balanced).

Providers, all captured as ONE call per ``torch.cuda.CUDAGraph`` and timed as graph replays:

* ``tmagemm``: ``tmagemm.grouped.grouped_mm`` / ``grouped_scaled_mm`` (fp8 row-wise: scale_a one
  per row of A, scale_b (E, N)), with ``out=``.
* ``torch``: ``torch._grouped_mm`` (bf16) / ``torch._scaled_grouped_mm`` (fp8 row-wise), 2-D A
  with ``offs``; masked: 3-D x 3-D (batched over all max_m rows: torch has no masked layout).
* ``loop``: one ``torch.mm`` / ``torch._scaled_mm`` per expert in the same graph: contiguous over
  each expert's exact rows (counts known at capture, experts without rows skipped); masked over
  all max_m rows of every expert (a graph cannot read the counts: what an engine without grouped
  kernels does).

A peer that raises is recorded ``unsupported`` with the error text; a tmagemm error ``failed``.

Counted per case (:func:`case_bytes`): the weights of the experts with > 0 rows, the fp32 row-wise
scales of those rows and experts, the activation rows read and the bf16 output rows written, each
once (padding rows of the masked layout are not counted); FLOPs = 2 x rows x N x K. ``%copy`` =
bytes / time as a percentage of the measured device-to-device copy rate (read + write bytes).
"""

from __future__ import annotations

import itertools
import math
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, TextIO

from . import graphed
from .graphed import fmt, table
from .results import FAILED, OK, UNSUPPORTED, WRONG, BenchResult, error_text, geomean

# ------------------------------------------------------------------------------------ models


@dataclass(frozen=True)
class Expert:
    """One expert projection: ``(rows, K) @ (K, N)`` with an (N, K) weight per expert."""

    name: str
    n: int
    k: int


@dataclass(frozen=True)
class MoEModel:
    """An MoE layer as one GPU holds it: ``experts`` routed experts (``ep``-way expert parallel
    splits the model's ``experts * ep``), each token routed to ``top_k`` of all of them."""

    name: str
    hidden: int
    intermediate: int  # of one expert
    experts: int  # on this GPU
    top_k: int
    ep: int = 1

    def projections(self) -> tuple[Expert, ...]:
        return (Expert("gate_up", 2 * self.intermediate, self.hidden), Expert("down", self.hidden, self.intermediate))

    def max_rows_per_expert(self, total_rows: int) -> int:
        """Rows one expert can get at most: the tokens this GPU sees (each picks top_k distinct
        experts, top_k / ep of them here on average), i.e. ``total_rows * ep / top_k``."""
        return max(1, -(-total_rows * self.ep // self.top_k))


MODELS = {m.name: m for m in (
    MoEModel("deepseek-v3", 7168, 2048, 256, 8),  # 256 routed experts, moe_intermediate 2048
    MoEModel("deepseek-v3-ep4", 7168, 2048, 64, 8, ep=4),  # 64 of the 256 per GPU under EP 4
    MoEModel("qwen3-235b-a22b", 4096, 1536, 128, 8),
    MoEModel("mixtral-8x7b", 4096, 14336, 8, 2),
)}  # fmt: skip

DTYPES = ("fp8", "bf16")
ROUTINGS = ("balanced", "zipf")
LAYOUTS = ("contiguous", "masked")
NAME = "moe"  # the preset, and the key of its records in results.json
PROVIDERS = ("tmagemm", "torch", "loop")
DEFAULT_M = (1, 16, 64, 256, 2048)
MAX_ROWS = 65536  # contiguous cases with E * m above this are skipped (activations + outputs of 1-4 GB)
MASKED_MAX_M = 64  # decode: the masked layout runs for m <= this
ZIPF_S = 1.0
SEED = 20260101
DEFAULT_BUDGET_MS = 20.0
CHECK_EXPERTS = 4  # experts checked against float64 per case (busiest, lightest, two seeded others)
CHECK_ROWS = 1024  # first rows of each checked expert
FLUSH_BELOW_BYTES = 256 << 20  # flush L2 before each replay when the touched weights are below this


def parse_models(names: list[str] | None) -> tuple[str, ...]:
    if not names:
        return tuple(MODELS)
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        raise ValueError(f"unknown model {', '.join(unknown)} for the moe presets; choose from {', '.join(MODELS)}")
    return tuple(dict.fromkeys(names))


def dtypes_for(dtype: str | None) -> tuple[str, ...]:
    if dtype is None:
        return DTYPES
    if dtype not in DTYPES:
        raise ValueError(f"--preset moe runs fp8 (row-wise scales) and bf16; --dtype {dtype} does not apply")
    return (dtype,)


def parse_routings(names: list[str] | None) -> tuple[str, ...]:
    if not names:
        return ROUTINGS
    unknown = [n for n in names if n not in ROUTINGS]
    if unknown:
        raise ValueError(f"unknown routing {', '.join(unknown)}; choose from {', '.join(ROUTINGS)}")
    return tuple(dict.fromkeys(names))


# ---------------------------------------------------------------------------------- routing


def zipf_counts(e: int, m: int, cap: int | None = None, s: float = ZIPF_S, seed: int = SEED) -> list[int]:
    """Rows per expert under skewed routing: ``e * m`` rows drawn multinomially from p_r ~ 1/r^s
    over a seeded permutation of the experts (deterministic in (e, m, s, seed)); an expert over
    ``cap`` is clipped to it and its excess drawn again over the experts below the cap, so the sum
    stays ``e * m``."""
    import numpy as np

    total = e * m
    cap = total if cap is None else cap
    if cap * e < total:
        raise ValueError(f"cap {cap} x {e} experts < {total} rows")
    rng = np.random.default_rng([seed, e, m, int(s * 1000)])
    p = 1.0 / np.arange(1, e + 1, dtype=np.float64) ** s
    counts = np.zeros(e, dtype=np.int64)
    left, open_ = total, np.ones(e, dtype=bool)
    while left > 0:
        q = p * open_
        counts += rng.multinomial(left, q / q.sum())
        over = counts > cap
        left = int((counts[over] - cap).sum())
        counts[over] = cap
        open_ &= counts < cap
    out = [0] * e
    for rank, expert in enumerate(rng.permutation(e)):
        out[int(expert)] = int(counts[rank])
    return out


def counts_for(model: MoEModel, m: int, routing: str) -> list[int]:
    e = model.experts
    if routing == "balanced":
        return [m] * e
    return zipf_counts(e, m, cap=model.max_rows_per_expert(e * m))


@dataclass(frozen=True)
class Case:
    model: str
    projection: str
    n: int
    k: int
    e: int
    dtype: str
    layout: str
    routing: str
    m: int  # nominal rows per expert; the counts sum to e * m
    counts: tuple[int, ...]

    @property
    def rows(self) -> int:
        return sum(self.counts)

    @property
    def max_m(self) -> int | None:
        """Rows per expert of the masked A buffer (the busiest expert's count), None if contiguous."""
        return max(self.counts) if self.layout == "masked" else None


def models_metadata(names: tuple[str, ...]) -> dict[str, dict]:
    """What a run's metadata says of each model: experts on the GPU, top-k, expert parallelism,
    projection shapes."""
    return {name: {"experts": MODELS[name].experts, "top_k": MODELS[name].top_k, "ep": MODELS[name].ep,
                   "projections": [f"{p.name} {p.n}x{p.k}" for p in MODELS[name].projections()]}
            for name in names}


def layouts_for(e: int, m: int) -> tuple[str, ...]:
    return tuple(lay for lay, ok in (("contiguous", e * m <= MAX_ROWS), ("masked", m <= MASKED_MAX_M)) if ok)


def grid(models: tuple[str, ...], dtypes: tuple[str, ...], m_values: tuple[int, ...],
         routings: tuple[str, ...]) -> list[Case]:  # fmt: skip
    """Every case of a run, in run order (model, dtype, projection: one weight set at a time)."""
    cases = []
    for name in models:
        model = MODELS[name]
        counts = {(m, r): tuple(counts_for(model, m, r)) for m in m_values for r in routings}
        for dtype in dtypes:
            for p in model.projections():
                for m in m_values:
                    for layout in layouts_for(model.experts, m):
                        for r in routings:
                            cases.append(Case(name, p.name, p.n, p.k, model.experts, dtype, layout, r, m, counts[m, r]))
    return cases


def group_starts(counts) -> list[int]:
    """First row of each expert's rows in the contiguous layout."""
    return [0, *itertools.accumulate(counts)][: len(counts)]


def check_experts(counts: tuple[int, ...] | list[int], how_many: int = CHECK_EXPERTS, seed: int = SEED) -> list[int]:
    """The experts a case checks: the busiest, the lightest with rows, then seeded others with rows."""
    import random

    busy = [g for g, c in enumerate(counts) if c > 0]
    if not busy:
        return []
    picked = [max(busy, key=lambda g: counts[g]), min(busy, key=lambda g: counts[g])]
    rest = [g for g in busy if g not in picked]
    random.Random(seed + len(counts)).shuffle(rest)
    return list(dict.fromkeys(picked + rest))[:how_many]


# ------------------------------------------------------------------------------ byte counting


def case_bytes(counts: tuple[int, ...] | list[int], n: int, k: int, dtype: str) -> dict[str, int]:
    """Compulsory bytes of one grouped call: weights (N x K) of every expert with rows, row-wise fp32
    scales (one per row of A, N per touched expert), activation rows (K each) read, bf16 output
    rows (N each) written; plus ``bytes`` (their sum) and ``flops`` (2 x rows x N x K)."""
    elt = 1 if dtype == "fp8" else 2
    touched = sum(1 for c in counts if c > 0)
    rows = sum(counts)
    out = {"weight_bytes": touched * n * k * elt, "scale_bytes": 4 * (rows + touched * n) if dtype == "fp8" else 0,
           "activation_bytes": rows * k * elt, "output_bytes": rows * n * 2}  # fmt: skip
    out["bytes"] = sum(out.values())
    out["flops"] = 2 * rows * n * k
    return out


def tolerance(dtype: str, k: int, fast_accum: bool) -> float:
    """decode's rule: 1e-2 bf16, 2e-2 fp8 (x sqrt(K / 4096) past K = 4096 with fast accumulation)."""
    from .decode import tolerance as rule

    return rule("bf16" if dtype == "bf16" else "fp8-row", k, fast_accum)


# ------------------------------------------------------------------------------------ records


FIELDS = (
    "model", "projection", "e", "n", "k", "dtype", "layout", "routing", "m", "rows", "max_m",
    "experts_touched", "max_count", "provider", "status", "reason", "us", "p20_us", "p80_us", "replays",
    "l2_flushed", "weight_bytes", "scale_bytes", "activation_bytes", "output_bytes", "bytes", "flops",
    "tflops", "gbps", "pct_copy", "speedup_vs_torch", "speedup_vs_loop", "skew_ratio",
    "max_rel_err", "tolerance", "checked",
)  # fmt: skip


@dataclass(frozen=True)
class MoEConfig:
    """One ``--preset moe`` run. budget_ms: GPU time of timed replays per (case, provider);
    fast_accum: fp8 accumulation of every provider (torch's grouped op is asked for it too)."""

    models: tuple[str, ...] = tuple(MODELS)
    dtypes: tuple[str, ...] = DTYPES
    m_values: tuple[int, ...] = DEFAULT_M
    routings: tuple[str, ...] = ROUTINGS
    budget_ms: float = DEFAULT_BUDGET_MS
    fast_accum: bool = True
    command: str = ""

    def __post_init__(self):
        if not self.m_values or any(m < 1 or m > 8192 for m in self.m_values):
            raise ValueError(f"--preset moe needs tokens per expert (--m) in 1..8192, got {list(self.m_values)}")
        if self.budget_ms <= 0:
            raise ValueError(f"--budget-ms must be > 0, got {self.budget_ms}")
        parse_models(list(self.models))
        parse_routings(list(self.routings))
        for d in self.dtypes:
            dtypes_for(d)
        if not self.cases():
            raise ValueError(f"--m {','.join(map(str, self.m_values))} gives no case: contiguous needs E x m <= "
                             f"{MAX_ROWS}, masked m <= {MASKED_MAX_M}")  # fmt: skip

    def cases(self) -> list[Case]:
        return grid(self.models, self.dtypes, self.m_values, self.routings)


def new_record(case: Case, provider: str, fast_accum: bool = True) -> dict[str, Any]:
    rec: dict[str, Any] = {f: None for f in FIELDS}
    rec.update(model=case.model, projection=case.projection, e=case.e, n=case.n, k=case.k, dtype=case.dtype,
               layout=case.layout, routing=case.routing, m=case.m, rows=case.rows, max_m=case.max_m,
               experts_touched=sum(1 for c in case.counts if c > 0), max_count=max(case.counts), provider=provider,
               tolerance=tolerance(case.dtype, case.k, fast_accum), **case_bytes(case.counts, case.n, case.k, case.dtype))  # fmt: skip
    return rec


def _key(r: dict[str, Any], routing: bool = True) -> tuple:
    base = (r["model"], r["projection"], r["dtype"], r["layout"], r["m"])
    return (*base, r["routing"]) if routing else base


def derive(records: list[dict[str, Any]], copy_gbs: float | None) -> list[dict[str, Any]]:
    """TFLOP/s, GB/s and %copy of every timed record; on tmagemm records the speedups (torch op
    time / ours, loop time / ours) where both ran correctly; on zipf records of every provider
    ``skew_ratio`` = balanced time / zipf time at the same total rows (1.0: skew costs nothing)."""
    by_case: dict[tuple, dict[str, dict]] = {}
    for r in records:
        r["tflops"] = r["gbps"] = r["pct_copy"] = r["speedup_vs_torch"] = r["speedup_vs_loop"] = r["skew_ratio"] = None
        us = r.get("us")
        if r["status"] == OK and us:
            r["tflops"] = r["flops"] / (us * 1e-6) / 1e12
            r["gbps"] = r["bytes"] / (us * 1e-6) / 1e9
            if copy_gbs:
                r["pct_copy"] = 100 * r["gbps"] / copy_gbs
        by_case.setdefault(_key(r), {})[r["provider"]] = r
    timed = lambda r: r is not None and r["status"] == OK and r.get("us")  # noqa: E731
    for key, group in by_case.items():
        ours = group.get("tmagemm")
        for peer in ("torch", "loop"):
            if timed(ours) and timed(group.get(peer)):
                ours[f"speedup_vs_{peer}"] = group[peer]["us"] / ours["us"]
        if key[-1] == "zipf":
            balanced = by_case.get((*key[:-1], "balanced"), {})
            for provider, r in group.items():
                if timed(r) and timed(balanced.get(provider)):
                    r["skew_ratio"] = balanced[provider]["us"] / r["us"]
    return records


def geomeans(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (dtype, layout), and per dtype over both layouts (layout "all", the issue's "over the
    preset"), over tmagemm's records: geomean and minimum of each speedup, geomean %copy, geomean
    and minimum skew ratio (zipf rows); and the peers' own skew ratios (``torch_skew``,
    ``loop_skew``: what skewed routing costs them on the same cases)."""
    rows = []
    groups = []
    for dtype in dict.fromkeys(r["dtype"] for r in records):
        layouts = list(dict.fromkeys(r["layout"] for r in records if r["dtype"] == dtype))
        groups += [(dtype, layout, (layout,)) for layout in layouts]
        if len(layouts) > 1:
            groups.append((dtype, "all", tuple(layouts)))
    for dtype, layout, members in groups:
        ours = [r for r in records if r["provider"] == "tmagemm" and r["dtype"] == dtype and r["layout"] in members]
        row: dict[str, Any] = {"dtype": dtype, "layout": layout, "rows": len(ours)}
        for what in ("speedup_vs_torch", "speedup_vs_loop", "skew_ratio"):
            values = [r[what] for r in ours if r[what] is not None]
            row[f"{what}_n"], row[what], row[f"{what}_min"] = len(values), geomean(values), min(values, default=None)
        row["pct_copy"] = geomean([r["pct_copy"] for r in ours])
        for peer in ("torch", "loop"):
            values = [r["skew_ratio"] for r in records if r["provider"] == peer and r["dtype"] == dtype
                      and r["layout"] in members and r["skew_ratio"] is not None]
            row[f"{peer}_skew"], row[f"{peer}_skew_min"] = geomean(values), min(values, default=None)
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------------- tables


def case_table(records: list[dict[str, Any]]) -> str:
    """One row per case: us of each provider, tmagemm's TFLOP/s, speedups, %copy (ours and the
    loop's), skew ratio."""
    cases: dict[tuple, dict[str, dict]] = {}
    for r in records:
        cases.setdefault(_key(r), {})[r["provider"]] = r
    rows = []
    for group in cases.values():
        any_ = next(iter(group.values()))
        ours = group.get("tmagemm") or {}

        def us(p: str) -> str:
            r = group.get(p) or {}
            return fmt(r.get("us"), ".1f") if r.get("status") == OK else "-"

        def x(v: Any) -> str:
            return "-" if v is None else f"{v:.2f}x"

        note = ", ".join(f"{p} {r['status']}" for p, r in group.items() if r["status"] != OK)
        loop = group.get("loop") or {}
        rows.append([any_["model"], any_["projection"], any_["dtype"], str(any_["e"]), any_["layout"], any_["routing"],
                     str(any_["m"]), str(any_["rows"]), str(any_["experts_touched"]), fmt(any_["max_m"], "d"),
                     fmt(any_["bytes"] / 1e6, ".1f"), us("tmagemm"), us("torch"), us("loop"),
                     fmt(ours.get("tflops"), ".1f"), x(ours.get("speedup_vs_torch")), x(ours.get("speedup_vs_loop")),
                     fmt(ours.get("pct_copy"), ".0f"), fmt(loop.get("pct_copy"), ".0f"), fmt(ours.get("skew_ratio"), ".2f"),
                     fmt(ours.get("max_rel_err"), ".1e"), note])  # fmt: skip
    headers = ["model", "proj", "dtype", "E", "layout", "routing", "m", "rows", "touched", "max_m", "MB",
               "tmagemm us", "torch us", "loop us", "TFLOP/s", "vs torch", "vs loop", "%copy", "loop %copy", "skew", "err",
               "note"]  # fmt: skip
    return table(headers, rows)


def geomean_table(records: list[dict[str, Any]]) -> str:
    rows = []
    for g in geomeans(records):
        def pair(what: str, spec: str = ".3f") -> list[str]:
            return [f"{g[what + '_n']}/{g['rows']}", fmt(g[what], spec), fmt(g[what + "_min"], spec)]

        rows.append([g["dtype"], g["layout"], *pair("speedup_vs_torch"), *pair("speedup_vs_loop"),
                     fmt(g["pct_copy"], ".0f"), *pair("skew_ratio"),
                     *(fmt(g[f"{peer}_skew{end}"], ".3f") for peer in ("torch", "loop") for end in ("", "_min"))])  # fmt: skip
    headers = ["dtype", "layout", "vs torch n", "vs torch", "min", "vs loop n", "vs loop", "min", "%copy",
               "skew n", "skew", "min", "torch skew", "min", "loop skew", "min"]  # fmt: skip
    return table(headers, rows)


NOTES = (
    "us = median CUDA-graph replay time of ONE grouped call (alternating rounds of the providers); "
    "L2 flushed (256 MB zeroed) before each replay where the touched experts' weights are < 256 MB, "
    "else they stream past L2 anyway. torch = torch._grouped_mm / torch._scaled_grouped_mm (row-wise), "
    "masked: 3-D x 3-D over all max_m rows; loop = one torch.mm / torch._scaled_mm per expert in the "
    "same graph (contiguous: each expert's rows, empty experts skipped; masked: all max_m rows). "
    "vs X = X's time / tmagemm's. MB and %copy count the weights of experts with rows + row-wise "
    "scales + activation rows read + bf16 output rows written, vs the measured copy rate (read + "
    "written); loop %copy: the loop's (100 / loop %copy is about the most any kernel can gain over the "
    "loop on that row). skew = balanced time / zipf time at the same total rows (torch skew, loop skew: the "
    "peers' own on the same cases). TFLOP/s from 2 x rows x N x K. "
    f"err = max|out - ref| / max|ref| vs float64 on up to {CHECK_EXPERTS} experts (busiest, lightest, "
    f"seeded others), first {CHECK_ROWS} rows of each, every provider."
)


def tables(records: list[dict[str, Any]]) -> dict[str, str]:
    """The printed report as named text blocks (also in results.json's extras: ``tmagemm report``)."""
    out = {"moe cases": case_table(records), "moe geomeans (tmagemm)": geomean_table(records)}
    return graphed.finish_tables(
        "moe", out, records,
        lambda r: f"{r['model']} {r['projection']} {r['dtype']} {r['layout']} {r['routing']} m={r['m']}", NOTES, 2)


# ------------------------------------------------------------------------------ GPU: operands


def randn(shape: tuple, dtype, device, gen, scale: float = 1.0):
    """randn in ``dtype``, made in float32 chunks along dim 0 of at most 2^28 elements."""
    import torch

    out = torch.empty(shape, dtype=dtype, device=device)
    inner = math.prod(shape[1:]) or 1
    step = max(1, (1 << 28) // inner)
    for i in range(0, shape[0], step):
        chunk = torch.randn((min(step, shape[0] - i), *shape[1:]), device=device, generator=gen)
        out[i : i + step] = (chunk * scale).to(dtype) if scale != 1.0 else chunk.to(dtype)
    return out


@dataclass
class _Weights:
    """(E, N, K) row-major weights (``b`` = the (E, K, N) K-major view every provider reads) and,
    for fp8, the (E, N) row-wise scales; one set per (model, dtype, projection)."""

    w: Any
    sb: Any = None

    @property
    def b(self):
        return self.w.transpose(1, 2)


def _weights(e: int, n: int, k: int, dtype: str, device) -> _Weights:
    import torch

    gen = torch.Generator(device=device).manual_seed(SEED + n * 31 + k)
    if dtype == "bf16":  # unit-variance outputs
        return _Weights(randn((e, n, k), torch.bfloat16, device, gen, 1 / math.sqrt(k)))
    w = randn((e, n, k), torch.float8_e4m3fn, device, gen)
    return _Weights(w, (torch.rand(e, n, device=device, generator=gen) + 0.5) / math.sqrt(k))


@dataclass
class _Inputs:
    a: Any  # (rows, K) or (E, max_m, K)
    sa: Any  # fp8: (rows,) or (E, max_m); None for bf16
    counts: Any  # int32 on the device: offs (contiguous) or masked_m
    starts: list[int]  # contiguous: first row of each expert


def _inputs(case: Case, device) -> _Inputs:
    import torch

    gen = torch.Generator(device=device).manual_seed(SEED + case.m)
    dt = torch.float8_e4m3fn if case.dtype == "fp8" else torch.bfloat16
    shape = (case.rows, case.k) if case.layout == "contiguous" else (case.e, case.max_m, case.k)
    a = randn(shape, dt, device, gen)
    sa = torch.rand(shape[:-1], device=device, generator=gen) + 0.5 if case.dtype == "fp8" else None
    starts = group_starts(case.counts)
    values = [s + c for s, c in zip(starts, case.counts)] if case.layout == "contiguous" else list(case.counts)
    return _Inputs(a, sa, torch.tensor(values, dtype=torch.int32, device=device), starts)


class _Refused(Exception):
    """The peer cannot run this case."""


def _build(provider: str, case: Case, ws: _Weights, x: _Inputs, fast_accum: bool, device) -> tuple[Callable, Callable, str]:
    """(call, output, note): one call of the provider, a function returning what the last call (or
    replay) wrote, and a note for the record (e.g. a fallback taken)."""
    import torch

    fp8, masked = case.dtype == "fp8", case.layout == "masked"
    bf16 = torch.bfloat16
    if provider == "tmagemm":
        from .. import grouped

        out = torch.empty((*x.a.shape[:-1], case.n), dtype=bf16, device=device)
        counts = {"masked_m": x.counts} if masked else {"offs": x.counts}
        if fp8:
            call = lambda: grouped.grouped_scaled_mm(x.a, ws.b, x.sa, ws.sb, out=out, use_fast_accum=fast_accum,  # noqa: E731
                                                     **counts)  # fmt: skip
        else:
            call = lambda: grouped.grouped_mm(x.a, ws.b, out=out, **counts)  # noqa: E731
        return call, lambda: out, ""
    if provider == "torch":
        held: dict[str, Any] = {}
        offs = {} if masked else {"offs": x.counts}
        if not fp8:
            variants = [("", lambda: torch._grouped_mm(x.a, ws.b, out_dtype=bf16, **offs))]
        else:
            def scaled(sa, acc):
                return lambda: torch._scaled_grouped_mm(x.a, ws.b, sa, ws.sb, out_dtype=bf16, use_fast_accum=acc, **offs)

            variants = [("", scaled(x.sa, fast_accum))]
            if masked:  # some releases take the 3-D case's row scales flattened
                variants.append(("scale_a flattened to (E * max_m,)", scaled(x.sa.reshape(-1), fast_accum)))
            if fast_accum:
                variants.append(("use_fast_accum=True refused; ran with its default False", scaled(x.sa, False)))
        errors = []
        for note, fn in variants:
            try:
                held["out"] = fn()
                torch.cuda.synchronize()
            except Exception as exc:
                errors.append(error_text(exc))
                torch.cuda.synchronize()
                continue

            def call(fn=fn):
                held["out"] = fn()

            first = f"; first try: {errors[0]}" if errors else ""
            return call, lambda: held["out"], (note + first) if note else ""
        raise _Refused("; ".join(dict.fromkeys(errors)))
    # loop: one torch call per expert into slices of one output
    out = torch.empty((*x.a.shape[:-1], case.n), dtype=bf16, device=device)
    parts = []
    for g, c in enumerate(case.counts):
        if masked:
            rows = (g,)
        elif c == 0:
            continue
        else:
            rows = (slice(x.starts[g], x.starts[g] + c),)
        a, o, w = x.a[rows], out[rows], ws.w[g].t()
        if fp8:
            # cuBLAS wants 16-byte aligned scale pointers: a slice starting at an odd row is not,
            # so each expert's row scales get their own allocation (made here, outside the timing).
            sa, sb = x.sa[rows].unsqueeze(-1).clone(), ws.sb[g].unsqueeze(0).clone()
            parts.append(lambda a=a, o=o, w=w, sa=sa, sb=sb: torch._scaled_mm(
                a, w, sa, sb, out_dtype=bf16, use_fast_accum=fast_accum, out=o))  # fmt: skip
        else:
            parts.append(lambda a=a, o=o, w=w: torch.mm(a, w, out=o))

    def run() -> None:
        for p in parts:
            p()

    return run, lambda: out, ""


def _references(case: Case, ws: _Weights, x: _Inputs) -> dict[int, tuple[int, Any]]:
    """Per checked expert: (rows checked, float64 reference of those rows)."""
    refs = {}
    for g in check_experts(case.counts):
        c = min(case.counts[g], CHECK_ROWS)
        rows = (g, slice(0, c)) if case.layout == "masked" else (slice(x.starts[g], x.starts[g] + c),)
        a, w = x.a[rows].double(), ws.w[g].double()
        if x.sa is not None:
            a = a * x.sa[rows].double().unsqueeze(-1)
            w = w * ws.sb[g].double().unsqueeze(-1)
        refs[g] = (c, a @ w.t())
    return refs


def _check(case: Case, out, x: _Inputs, refs: dict[int, tuple[int, Any]]) -> tuple[float, str]:
    import torch

    worst, where = 0.0, ""
    for g, (c, ref) in refs.items():
        got = (out[g, :c] if case.layout == "masked" else out[x.starts[g] : x.starts[g] + c]).double()
        if not torch.isfinite(got).all():
            return float("inf"), f"expert {g} (non-finite output)"
        err = ((got - ref).abs().max() / ref.abs().max().clamp(min=1e-300)).item()
        if err >= worst:
            worst, where = err, f"expert {g} ({case.counts[g]} rows)"
    return worst, where


def _run_case(case: Case, ws: _Weights, config: MoEConfig, device, flush) -> list[dict[str, Any]]:
    """Every provider at one case: build, first call, capture, time, check."""
    import torch

    x = _inputs(case, device)
    records = {p: new_record(case, p, config.fast_accum) for p in PROVIDERS}
    graphs, outputs = {}, {}
    for provider in PROVIDERS:
        rec = records[provider]
        try:
            call, output, note = _build(provider, case, ws, x, config.fast_accum, device)
            call()  # first call: compiles / plans (tmagemm), picks the kernel (torch)
            torch.cuda.synchronize()
            rec["reason"] = note or None
        except Exception as exc:
            peer = provider != "tmagemm"
            text = str(exc) if isinstance(exc, _Refused) else error_text(exc)
            rec.update(status=UNSUPPORTED if peer else FAILED, reason=(f"{provider} refuses: " if peer else "") + text)
            torch.cuda.synchronize()
            continue
        try:
            graphs[provider] = graphed.capture(call)
            outputs[provider] = output
        except Exception as exc:
            rec.update(status=FAILED, reason=f"graph capture: {error_text(exc)}")
            torch.cuda.synchronize()
    flushed = case_bytes(case.counts, case.n, case.k, case.dtype)["weight_bytes"] < FLUSH_BELOW_BYTES
    if graphs:
        times = graphed.time_graphs(graphs, config.budget_ms, flush if flushed else None)
        for provider, ms in times.items():
            median, p20, p80 = graphed.replay_quantiles(ms)
            records[provider].update(us=median, p20_us=p20, p80_us=p80, replays=len(ms), l2_flushed=flushed)
    refs = _references(case, ws, x)
    checked = f"{len(refs)} of {sum(1 for c in case.counts if c)} experts, <= {CHECK_ROWS} rows each"
    for provider, graph in graphs.items():
        graph.replay()  # the check reads what a replay of this provider's own graph wrote
        torch.cuda.synchronize()
        rec = records[provider]
        err, where = _check(case, outputs[provider](), x, refs)
        rec.update(max_rel_err=err, checked=checked, status=OK if err <= rec["tolerance"] else WRONG)
        if rec["status"] == WRONG:
            rec["reason"] = f"max rel err {err:.3g} > {rec['tolerance']:.3g} (vs float64; worst: {where})"
    del graphs, outputs, refs, x
    return list(records.values())


def run(config: MoEConfig, stream: TextIO | None = None) -> tuple[BenchResult, list[dict[str, Any]]]:
    """Time every case of ``config`` for every provider on the current GPU."""
    import torch

    from .runner import Progress
    from .timing import FLUSH_BYTES

    device, meta = graphed.start_run(NAME, config, "it times CUDA-graph replay of grouped expert GEMMs")
    meta["models"] = models_metadata(config.models)
    meta["routing"] = {"zipf_s": ZIPF_S, "seed": SEED, "max_rows": MAX_ROWS, "masked_max_m": MASKED_MAX_M}
    meta["ceilings"] = ceilings = graphed.copy_ceilings(device)
    flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device=device)
    cases = config.cases()
    records: list[dict[str, Any]] = []
    progress = Progress(len(cases), stream or sys.stderr)
    t0 = time.perf_counter()
    held: tuple = ()
    ws: _Weights | None = None
    for case in cases:
        label = f"{case.model} {case.projection} {case.dtype} {case.layout} {case.routing} m={case.m}"
        try:
            if held != (case.model, case.projection, case.dtype):
                ws = None  # free the previous set first
                torch.cuda.empty_cache()
                held = (case.model, case.projection, case.dtype)
                ws = _weights(case.e, case.n, case.k, case.dtype, device)
            records += _run_case(case, ws, config, device, flush)
        except Exception as exc:  # e.g. out of memory
            held = ()
            records += [{**new_record(case, p, config.fast_accum), "status": FAILED, "reason": error_text(exc)}
                        for p in PROVIDERS]  # fmt: skip
            torch.cuda.synchronize()
        progress.step(label)
    del ws
    meta["wall_s"] = round(time.perf_counter() - t0, 1)
    derive(records, ceilings["copy_gbs"])
    return graphed.make_result(meta, tables(records)), records
