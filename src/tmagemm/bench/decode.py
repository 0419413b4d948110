"""``tmagemm bench --preset decode``: a model's layer stack in one CUDA graph, per-layer time vs cuBLAS.

A *layer* is the dense projections of one transformer layer run in order (qkv, o, gate_up, down;
DeepSeek-V3's MLA layer: q_a+kv_a, q_b, o, gate_up, down). A *stack* is ``layers`` such layers,
each with its own weights, so every replay streams ``layers`` x the weight bytes of a layer
(hundreds of MB per layer: far more than the 50 MB L2, which is therefore not flushed). The
whole stack of one provider is captured in ONE ``torch.cuda.CUDAGraph`` after eager warm-up, the
way a serving engine captures its decode step, and replayed; per-layer time = replay time / layers.

What runs in the graph, for both providers alike, is the GEMMs alone:

* bf16: each GEMM reads the previous GEMM's output where the widths match (o -> gate_up,
  down -> the next layer's first projection), so the graph is a real dependency chain. Where they
  do not (attention, SiLU-and-mul sit between), it reads a preallocated (M, K) buffer that stands
  in for that op's output.
* fp8: activations are quantized ONCE, before capture, into fixed fp8 buffers (with their tensor,
  row or 1x128 scales) that every layer reads; the quantization kernel is not in the timed stack.

Providers: ``tmagemm`` (``tmagemm.scaled_mm`` / ``tmagemm.matmul`` with ``out=``) and ``cublas``
(``torch._scaled_mm`` / ``torch.mm`` with ``out=``; block-scaled through
``torch.nn.functional.scaled_mm`` with BlockWise1x128 x BlockWise128x128 scales in PyTorch's
layout). A call the peer refuses is recorded as ``unsupported``; a tmagemm error as ``failed``.

Counted per layer (:func:`layer_bytes`): every weight byte, every scale byte, every activation
byte read and every output byte written, once. ``%copy`` = those bytes / per-layer time as a
percentage of the measured device-to-device copy rate (bytes read + bytes written / time).

With the fp8-block recipe, each model's MLP also runs as two chains of its own, unfused and
with the fused gate/up epilogue (``tmagemm.gate_up_silu_quant``): the "mlp fusion" table,
``bench/mlp_fusion.py``.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, TextIO

from . import graphed, mlp_fusion
from .graphed import fmt, table
from .results import FAILED, OK, UNSUPPORTED, WRONG, BenchResult, error_text, geomean
from .shapes import LLM_LAYERS

# ------------------------------------------------------------------------------------ models


@dataclass(frozen=True)
class Projection:
    """One GEMM of a layer: ``(M, K) @ (K, N)`` with an (N, K) weight, as run on one TP rank.

    parallel: "column" (N is split across TP ranks: qkv, gate_up), "row" (K is split: o, down)
    or "replicated" (every rank holds the whole weight: DeepSeek-V3's fused q_a+kv_a).
    """

    name: str
    n: int
    k: int
    parallel: str


@dataclass(frozen=True)
class Model:
    name: str
    projections: tuple[Projection, ...]  # unsplit shapes
    tp: int = 1

    def layer(self) -> tuple[Projection, ...]:
        """The projections one TP rank runs: column-parallel N / tp, row-parallel K / tp."""
        out = []
        for p in self.projections:
            n, k = p.n, p.k
            split = {"column": "n", "row": "k"}.get(p.parallel)
            if split and self.tp > 1:
                size = n if split == "n" else k
                if size % self.tp:
                    raise ValueError(f"{self.name}: {p.name} {split.upper()}={size} does not divide by TP {self.tp}")
                n, k = (n // self.tp, k) if split == "n" else (n, k // self.tp)
            out.append(Projection(p.name, n, k, p.parallel))
        return tuple(out)


_PARALLEL = {"qkv": "column", "gate_up": "column", "q_b": "column", "o": "row", "down": "row",
             "q_a+kv_a": "replicated"}  # fmt: skip


def _model(name: str, source: str, projections: tuple[str, ...], tp: int = 1) -> Model:
    """A model from the ``llm`` preset's (unsplit) shapes, so both presets share one table."""
    shapes = {label: (n, k) for label, n, k in LLM_LAYERS}
    projs = tuple(Projection(p, *shapes[f"{source}.{p}"], _PARALLEL[p]) for p in projections)
    return Model(name, projs, tp)


_DENSE = ("qkv", "o", "gate_up", "down")
# DeepSeek-V3's decode step absorbs kv_b into attention (per-head batched products on the latent
# cache, MLA weight absorption), so the dense GEMMs an engine runs per layer are these five.
_MLA = ("q_a+kv_a", "q_b", "o", "gate_up", "down")
MODELS = {m.name: m for m in (
    _model("llama3-8b", "llama3-8b", _DENSE),
    _model("llama3-70b-tp4", "llama3-70b", _DENSE, tp=4),
    _model("qwen2.5-7b", "qwen2.5-7b", _DENSE),
    _model("deepseek-v3", "deepseek-v3", _MLA),
)}  # fmt: skip

RECIPES = ("fp8-tensor", "fp8-row", "fp8-block", "bf16")
DECODE_M = (1, 8, 16, 32, 64, 128)
DEFAULT_LAYERS = 8
DEFAULT_BUDGET_MS = 100.0
NAME = "decode"  # the preset, and the key of its records in results.json
PROVIDERS = ("tmagemm", "cublas")
TOLERANCE = {"fp8": 2e-2, "bf16": 1e-2}  # as the other presets (providers.TOLERANCE)
FAST_ACCUM_K = 4096  # the K at which the fp8 tolerance was set; fast accumulation's error grows past it


def tolerance(recipe: str, k_max: int, fast_accum: bool = True) -> float:
    """Largest accepted max|out - ref| / max|ref|. fp8 tensor/row-wise with fast accumulation (wgmma's
    reduced-precision partial sums, cuBLAS's too) grows like sqrt(K): 2e-2 x sqrt(K / 4096) beyond
    K = 4096 (both providers measured 2.35e-2 at DeepSeek-V3's K = 18432, where that allows 4.2e-2).
    Block-scaled products promote to fp32 every k-block and keep 2e-2. A dropped tile or a
    mis-applied scale misses by O(1)."""
    base = TOLERANCE["bf16" if recipe == "bf16" else "fp8"]
    if recipe in ("fp8-tensor", "fp8-row") and fast_accum:
        return base * max(1.0, math.sqrt(k_max / FAST_ACCUM_K))
    return base
BLOCK = 128


def recipes_for(dtype: str | None) -> tuple[str, ...]:
    """The recipes ``--dtype`` selects: fp8 -> tensor-, row- and block-scaled; fp8-block -> block
    only; bf16 -> bf16; None -> all."""
    if dtype is None:
        return RECIPES
    if dtype == "fp8":
        return tuple(r for r in RECIPES if r.startswith("fp8"))
    if dtype in ("fp8-block", "bf16"):
        return (dtype,)
    raise ValueError(f"--preset decode runs fp8 (tensor-, row-, block-scaled) and bf16 stacks; --dtype {dtype} does not apply")


def parse_models(names: list[str] | None) -> tuple[str, ...]:
    if not names:
        return tuple(MODELS)
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        raise ValueError(f"unknown model {', '.join(unknown)} for --preset decode; choose from {', '.join(MODELS)}")
    return tuple(dict.fromkeys(names))


# ------------------------------------------------------------------------------ byte counting


def _kb(k: int) -> int:
    return -(-k // BLOCK)


def gemm_bytes(m: int, n: int, k: int, recipe: str) -> dict[str, int]:
    """Compulsory bytes of one GEMM: weight (N x K) and activation (M x K) read in the input
    dtype, their scales read (fp32; block scales in tmagemm's (M, KB) / (NB, KB) shapes), the
    bf16 output (M x N) written. Each once."""
    elt = 2 if recipe == "bf16" else 1
    scales = {"bf16": 0, "fp8-tensor": 2, "fp8-row": m + n, "fp8-block": (m + _kb(n)) * _kb(k)}[recipe]
    return {"weight_bytes": n * k * elt, "scale_bytes": 4 * scales, "activation_bytes": m * k * elt,
            "output_bytes": m * n * 2}  # fmt: skip


def layer_bytes(layer: tuple[Projection, ...], m: int, recipe: str) -> dict[str, int]:
    """Per-layer totals of :func:`gemm_bytes` plus ``bytes`` (their sum) and ``flops`` (2MNK)."""
    total = {"weight_bytes": 0, "scale_bytes": 0, "activation_bytes": 0, "output_bytes": 0}
    for p in layer:
        for key, value in gemm_bytes(m, p.n, p.k, recipe).items():
            total[key] += value
    total["bytes"] = sum(total.values())
    total["flops"] = sum(2 * m * p.n * p.k for p in layer)
    return total


# ------------------------------------------------------------------------------------ records


FIELDS = (
    "model", "tp", "recipe", "m", "layers", "provider", "status", "reason",
    "layer_us", "layer_p20_us", "layer_p80_us", "replays",
    "weight_bytes", "scale_bytes", "activation_bytes", "output_bytes", "bytes", "flops",
    "gbps", "pct_copy", "speedup", "max_rel_err", "tolerance", "rel_diff_vs_peer",
)  # fmt: skip


@dataclass(frozen=True)
class DecodeConfig:
    """One ``--preset decode`` run. budget_ms: GPU time of timed replays per (model, recipe, M,
    provider); fast_accum: fp8 tensor/row-wise accumulation of both providers (block-scaled
    products always promote to fp32 per 128-deep k-block)."""

    models: tuple[str, ...] = tuple(MODELS)
    recipes: tuple[str, ...] = RECIPES
    m_values: tuple[int, ...] = DECODE_M
    layers: int = DEFAULT_LAYERS
    budget_ms: float = DEFAULT_BUDGET_MS
    fast_accum: bool = True
    command: str = ""

    def __post_init__(self):
        if self.layers < 1:
            raise ValueError(f"--layers must be >= 1, got {self.layers}")
        if not self.m_values or any(m < 1 for m in self.m_values):
            raise ValueError(f"--preset decode needs M values >= 1, got {list(self.m_values)}")
        if self.budget_ms <= 0:
            raise ValueError(f"--budget-ms must be > 0, got {self.budget_ms}")
        bad = [r for r in self.recipes if r not in RECIPES]
        if bad:
            raise ValueError(f"unknown decode recipe {bad}; choose from {RECIPES}")
        parse_models(list(self.models))


def new_record(model: Model, recipe: str, m: int, layers: int, provider: str, fast_accum: bool = True) -> dict[str, Any]:
    rec: dict[str, Any] = {f: None for f in FIELDS}
    layer = model.layer()
    rec.update(model=model.name, tp=model.tp, recipe=recipe, m=m, layers=layers, provider=provider,
               tolerance=tolerance(recipe, max(p.k for p in layer), fast_accum), **layer_bytes(layer, m, recipe))  # fmt: skip
    return rec


def derive(records: list[dict[str, Any]], copy_gbs: float | None) -> list[dict[str, Any]]:
    """GB/s and %copy of every timed record, and speedup (cuBLAS time / tmagemm time) on the
    tmagemm record of each (model, recipe, M) where both ran correctly (and unfused / fused time
    on the mlp-fused record of each MLP comparison)."""
    by_key: dict[tuple, dict[str, dict]] = {}
    for r in records:
        r["gbps"] = r["pct_copy"] = r["speedup"] = None
        us = r.get("layer_us")
        if r["status"] == OK and us:
            r["gbps"] = r["bytes"] / (us * 1e-6) / 1e9
            if copy_gbs:
                r["pct_copy"] = 100 * r["gbps"] / copy_gbs
        by_key.setdefault((r["model"], r["recipe"], r["m"]), {})[r["provider"]] = r
    for pair in by_key.values():
        for ours, peer in ((pair.get("tmagemm"), pair.get("cublas")), (pair.get("mlp-fused"), pair.get("mlp-unfused"))):
            if ours and peer and ours["status"] == OK and peer["status"] == OK and ours["layer_us"] and peer["layer_us"]:
                ours["speedup"] = peer["layer_us"] / ours["layer_us"]
    return records


def geomeans(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per recipe: rows where both ran correctly, geomean speedup, geomean %copy of each provider."""
    rows = []
    for recipe in dict.fromkeys(r["recipe"] for r in records):
        mine = [r for r in records if r["recipe"] == recipe]
        ours = [r for r in mine if r["provider"] == "tmagemm"]
        paired = [r for r in ours if r["speedup"] is not None]
        row = {"recipe": recipe, "paired": len(paired), "rows": len(ours), "speedup": geomean([r["speedup"] for r in paired])}
        for p in PROVIDERS:
            row[f"{p}_pct_copy"] = geomean([r["pct_copy"] for r in mine if r["provider"] == p])
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------------- tables


def layer_table(records: list[dict[str, Any]]) -> str:
    """One row per (model, recipe, M): per-layer us of both providers, speedup, %copy; a provider
    that did not run correctly shows "-" and its status in the note (the reason is listed below)."""
    pairs: dict[tuple, dict[str, dict]] = {}
    for r in records:
        if r["provider"] in PROVIDERS:
            pairs.setdefault((r["model"], r["recipe"], r["m"]), {})[r["provider"]] = r
    rows = []
    for (model, recipe, m), pair in pairs.items():
        ours, peer = pair.get("tmagemm") or {}, pair.get("cublas") or {}

        def cell(r: dict, key: str, spec: str) -> str:
            return fmt(r.get(key), spec) if r.get("status") == OK else "-"

        speedup = ours.get("speedup")
        note = ", ".join(f"{p} {r['status']}" for p, r in pair.items() if r["status"] != OK)
        rows.append([model, recipe, str(m), fmt((ours or peer)["bytes"] / 1e6, ".1f"), cell(ours, "layer_us", ".1f"),
                     cell(peer, "layer_us", ".1f"), "-" if speedup is None else f"{speedup:.3f}x",
                     cell(ours, "pct_copy", ".0f"), cell(peer, "pct_copy", ".0f"),
                     fmt(ours.get("max_rel_err"), ".1e"), fmt(peer.get("max_rel_err"), ".1e"), note])  # fmt: skip
    headers = ["model", "recipe", "M", "MB/layer", "tmagemm us", "cuBLAS us", "speedup", "tmagemm %copy",
               "cuBLAS %copy", "tmagemm err", "cuBLAS err", "note"]  # fmt: skip
    return table(headers, rows)


def geomean_table(records: list[dict[str, Any]]) -> str:
    rows = [[g["recipe"], f"{g['paired']}/{g['rows']}", fmt(g["speedup"], ".3f"), fmt(g["tmagemm_pct_copy"], ".0f"),
             fmt(g["cublas_pct_copy"], ".0f")] for g in geomeans(records)]  # fmt: skip
    return table(["recipe", "paired", "geomean speedup", "tmagemm %copy", "cuBLAS %copy"], rows)


NOTES = (
    "per-layer us = median CUDA-graph replay time of the whole stack / layers (alternating rounds of "
    "both providers); the stack streams its own weights per layer (>> L2), so L2 is not flushed. "
    "%copy = (weight + scale + activation-read + output-write bytes per layer) / per-layer time, as a "
    "percentage of the measured device-to-device copy rate counting bytes read + written. "
    "speedup = cuBLAS time / tmagemm time. fp8 activations are quantized once before capture "
    "(not timed); bf16 GEMMs chain through each other's outputs where widths match. "
    "err = max|out - ref| / max|ref| of every GEMM of the last layer vs float64."
)


def tables(records: list[dict[str, Any]]) -> dict[str, str]:
    """The printed report, as named text blocks (also stored in results.json's extras, so
    ``tmagemm report`` prints the same)."""
    out = {"decode layers": layer_table(records), "decode geomeans": geomean_table(records)}
    fusion = mlp_fusion.table_text(records)
    if fusion:
        out["mlp fusion"] = fusion
    return graphed.finish_tables("decode", out, records, lambda r: f"{r['model']} {r['recipe']} M={r['m']}",
                                 NOTES + (" " + mlp_fusion.NOTES if fusion else ""))


# ------------------------------------------------------------------------------- GPU: stacks


@dataclass
class _Operands:
    """Per (model, input dtype): the weights of every layer, shared by both providers and by the
    fp8 recipes (which differ in their scales only)."""

    weights: list[list[Any]]  # [layer][projection] (N, K) row-major, fp8 e4m3 or bf16


@dataclass
class _Gemm:
    proj: Projection
    a: Any  # (M, K) input buffer
    w: Any  # (N, K) weight
    out: Any  # (M, N) bf16, this provider's own
    sa: Any = None  # tmagemm-layout scales
    sb: Any = None
    sa_t: Any = None  # PyTorch-layout block scales
    sb_t: Any = None


@dataclass
class _Stack:
    provider: str
    gemms: list[list[_Gemm]]  # [layer][projection]
    call: Callable[[], None] = field(default=lambda: None)


def _weights(model: Model, layers: int, fp8: bool, device) -> _Operands:
    import torch

    ws = []
    for _ in range(layers):
        row = []
        for p in model.layer():
            if fp8:  # randn in e4m3; the per-recipe weight scales carry the 1/sqrt(K)
                row.append(torch.randn(p.n, p.k, device=device).to(torch.float8_e4m3fn))
            else:  # unit-variance outputs, so the bf16 chain stays O(1) over any depth
                row.append((torch.randn(p.n, p.k, device=device) / math.sqrt(p.k)).to(torch.bfloat16))
        ws.append(row)
    return _Operands(ws)


def weight_scales(recipe: str, p: Projection, device) -> dict[str, Any]:
    """The weight's dequantization scales (values in [0.5, 1.5) / sqrt(K), so outputs stay O(1)),
    fixed per (recipe, projection): every layer and every M share them."""
    import torch

    gen = torch.Generator(device=device).manual_seed(p.n * 31 + p.k)
    root = math.sqrt(p.k)
    if recipe == "fp8-tensor":
        return {"sb": (torch.rand(1, device=device, generator=gen) + 0.5) / root}
    if recipe == "fp8-row":
        return {"sb": (torch.rand(1, p.n, device=device, generator=gen) + 0.5) / root}
    kb, nb = _kb(p.k), _kb(p.n)
    sb = (torch.rand(nb, kb, device=device, generator=gen) + 0.5) / root
    sb_store = torch.ones(nb, -(-kb // 4) * 4, device=device)  # PyTorch's 128x128 layout: (KB rounded up
    sb_store[:, :kb] = sb  # to 4, NB) with stride (1, KB4), i.e. the transpose of a padded (NB, KB4)
    return {"sb": sb, "sb_t": sb_store.t()}


def _act_scales(recipe: str, m: int, p: Projection, device, gen) -> dict[str, Any]:
    """The activation's scales (values in [0.5, 1.5)); 1x128 also in PyTorch's outer-dim-major layout."""
    import torch

    if recipe == "fp8-tensor":
        return {"sa": torch.rand(1, device=device, generator=gen) + 0.5}
    if recipe == "fp8-row":
        return {"sa": torch.rand(m, 1, device=device, generator=gen) + 0.5}
    sa = torch.rand(m, _kb(p.k), device=device, generator=gen) + 0.5
    sa_t = torch.empty(_kb(p.k), m, device=device).t()  # (M, KB) with stride (1, M)
    sa_t.copy_(sa)
    return {"sa": sa, "sa_t": sa_t}


def _build(provider: str, model: Model, recipe: str, m: int, ops: _Operands, inputs: dict, scales: list,
           fast_accum: bool, device) -> _Stack:  # fmt: skip
    """The provider's stack: buffers wired as the module docstring says, and one call that runs it."""
    import torch

    fp8 = recipe != "bf16"
    gemms: list[list[_Gemm]] = []
    prev = None
    for row in ops.weights:
        layer = []
        for j, (p, w) in enumerate(zip(model.layer(), row)):
            if not fp8 and prev is not None and prev.shape[1] == p.k:
                a = prev  # the previous GEMM's output: a real dependency chain
            else:
                a = inputs[p.k]
            out = torch.empty(m, p.n, dtype=torch.bfloat16, device=device)
            layer.append(_Gemm(p, a, w, out, **(scales[j] if fp8 else {})))
            prev = out
        gemms.append(layer)
    flat = [g for layer in gemms for g in layer]
    if provider == "tmagemm":
        import tmagemm

        if recipe == "bf16":
            calls = [lambda g=g: tmagemm.matmul(g.a, g.w.t(), out=g.out) for g in flat]
        elif recipe == "fp8-block":
            calls = [lambda g=g: tmagemm.scaled_mm(g.a, g.w.t(), g.sa, g.sb, out=g.out, scale_recipe_a="1x128",
                                                   scale_recipe_b="128x128") for g in flat]  # fmt: skip
        else:
            calls = [lambda g=g: tmagemm.scaled_mm(g.a, g.w.t(), g.sa, g.sb, out=g.out, use_fast_accum=fast_accum)
                     for g in flat]  # fmt: skip
    elif recipe == "bf16":
        calls = [lambda g=g: torch.mm(g.a, g.w.t(), out=g.out) for g in flat]
    elif recipe == "fp8-block":
        import torch.nn.functional as F

        if not hasattr(F, "scaled_mm") or not hasattr(F, "ScalingType"):
            raise _Refused(f"torch {torch.__version__} has no torch.nn.functional.scaled_mm (block-scaled cuBLAS)")
        st = F.ScalingType

        def block(g: _Gemm) -> Callable[[], None]:
            def call():
                g.out = F.scaled_mm(g.a, g.w.t(), g.sa_t, st.BlockWise1x128, g.sb_t, st.BlockWise128x128,
                                    output_dtype=torch.bfloat16)  # fmt: skip
            return call

        calls = [block(g) for g in flat]
    else:
        calls = [lambda g=g: torch._scaled_mm(g.a, g.w.t(), g.sa, g.sb, out_dtype=torch.bfloat16,
                                              use_fast_accum=fast_accum, out=g.out) for g in flat]  # fmt: skip

    def run() -> None:
        for c in calls:
            c()

    return _Stack(provider, gemms, run)


class _Refused(Exception):
    """The peer cannot run this recipe at all here."""


def _dequant_a(g: _Gemm, recipe: str):
    a = g.a.double()
    if recipe == "bf16":
        return a
    if recipe == "fp8-block":
        return a * g.sa.double().repeat_interleave(BLOCK, dim=1)[:, : a.shape[1]]
    return a * g.sa.double()


def _dequant_w(g: _Gemm, recipe: str):
    w = g.w.double()
    if recipe == "bf16":
        return w
    if recipe == "fp8-block":
        s = g.sb.double().repeat_interleave(BLOCK, dim=0)[: w.shape[0]].repeat_interleave(BLOCK, dim=1)[:, : w.shape[1]]
        return w * s
    return w * g.sb.double().reshape(-1, 1)  # (1,) or (1, N) -> per output row of the (N, K) weight


def _check(stack: _Stack, recipe: str, ref_w: dict[int, Any]) -> tuple[float, str]:
    """Worst max|out - ref| / max|ref| over the GEMMs of the last layer, vs float64 of the inputs
    they actually read (the replay is idempotent: layer 0 reads a fixed buffer)."""
    import torch

    worst, where = 0.0, ""
    for j, g in enumerate(stack.gemms[-1]):
        if j not in ref_w:
            ref_w[j] = _dequant_w(g, recipe)
        ref = _dequant_a(g, recipe) @ ref_w[j].t()
        got = g.out.double()
        if not torch.isfinite(got).all():
            return float("inf"), f"{g.proj.name} (non-finite output)"
        err = ((got - ref).abs().max() / ref.abs().max().clamp(min=1e-300)).item()
        if err >= worst:
            worst, where = err, f"{g.proj.name} {g.proj.n}x{g.proj.k}"
    return worst, where


def _run_case(model: Model, recipe: str, m: int, ops: _Operands, config: DecodeConfig, device,
              w_scales: list[dict], ref_w: dict[int, Any]) -> list[dict[str, Any]]:  # fmt: skip
    """Both providers at one (model, recipe, M): build, warm up, capture, time, check."""
    import torch

    fp8 = recipe != "bf16"
    gen = torch.Generator(device=device).manual_seed(m)
    inputs = {}
    for k in sorted({p.k for p in model.layer()}):
        x = torch.randn(m, k, device=device, generator=gen)
        inputs[k] = x.to(torch.float8_e4m3fn) if fp8 else x.to(torch.bfloat16)
    scales = [{**w, **_act_scales(recipe, m, p, device, gen)} for p, w in zip(model.layer(), w_scales)] if fp8 else []
    records, stacks, graphs = {}, {}, {}
    for provider in PROVIDERS:
        rec = records[provider] = new_record(model, recipe, m, config.layers, provider, config.fast_accum)
        try:
            stack = _build(provider, model, recipe, m, ops, inputs, scales, config.fast_accum, device)
            stack.call()  # first call: compiles / plans (tmagemm), picks the algorithm (cuBLAS)
            torch.cuda.synchronize()
        except Exception as exc:
            refused = provider == "cublas"
            rec.update(status=UNSUPPORTED if refused else FAILED, reason=("cuBLAS refuses: " if refused else "") + error_text(exc))
            torch.cuda.synchronize()
            continue
        try:
            graphs[provider] = graphed.capture(stack.call)
            stacks[provider] = stack
        except Exception as exc:
            rec.update(status=FAILED, reason=f"graph capture: {error_text(exc)}")
            torch.cuda.synchronize()
    if graphs:
        times = graphed.time_graphs(graphs, config.budget_ms)
        for provider, ms in times.items():
            median, p20, p80 = graphed.replay_quantiles(ms, config.layers)
            records[provider].update(layer_us=median, layer_p20_us=p20, layer_p80_us=p80, replays=len(ms))
    finals = {}
    for provider, stack in stacks.items():
        graphs[provider].replay()  # the check reads the outputs of a replay of this provider's own graph
        torch.cuda.synchronize()
        rec = records[provider]
        err, where = _check(stack, recipe, ref_w)
        rec["max_rel_err"] = err
        rec["status"] = OK if err <= rec["tolerance"] else WRONG
        if rec["status"] == WRONG:
            rec["reason"] = f"max rel err {err:.3g} > {rec['tolerance']:.3g} (last layer vs float64; worst: {where})"
        finals[provider] = stack.gemms[-1][-1].out.double()
    if len(finals) == 2:
        a, b = finals["tmagemm"], finals["cublas"]
        diff = ((a - b).abs().max() / b.abs().max().clamp(min=1e-300)).item()
        for rec in records.values():
            rec["rel_diff_vs_peer"] = diff
    del graphs, stacks
    return list(records.values())


def run(config: DecodeConfig, stream: TextIO | None = None) -> tuple[BenchResult, list[dict[str, Any]]]:
    """Time every (model, recipe, M) of ``config`` for both providers on the current GPU."""
    import torch

    from .runner import Progress

    device, meta = graphed.start_run(NAME, config, "it times CUDA-graph replay of model layer stacks")
    meta["models"] = {name: {"tp": MODELS[name].tp, "layer": [f"{p.name} {p.n}x{p.k} ({p.parallel})"
                                                               for p in MODELS[name].layer()]}
                      for name in config.models}  # fmt: skip
    meta["ceilings"] = ceilings = graphed.copy_ceilings(device)
    records: list[dict[str, Any]] = []
    fused = [name for name in config.models if "fp8-block" in config.recipes and mlp_fusion.mlp_projections(MODELS[name])]
    progress = Progress((len(config.models) * len(config.recipes) + len(fused)) * len(config.m_values),
                        stream or sys.stderr)
    t0 = time.perf_counter()
    for name in config.models:
        model = MODELS[name]
        for dtype in ("fp8", "bf16"):
            recipes = [r for r in config.recipes if (r == "bf16") == (dtype == "bf16")]
            if not recipes:
                continue
            try:
                ops = _weights(model, config.layers, dtype == "fp8", device)
            except Exception as exc:  # e.g. out of memory
                for recipe in recipes:
                    for m in config.m_values:
                        for p in PROVIDERS:
                            records.append({**new_record(model, recipe, m, config.layers, p, config.fast_accum), "status": FAILED,
                                            "reason": f"weights: {error_text(exc)}"})  # fmt: skip
                        progress.step(f"{name} {recipe} M={m}")
                        if recipe == "fp8-block" and name in fused:
                            records += [{**mlp_fusion.new_record(model, m, config.layers, p), "status": FAILED,
                                         "reason": f"weights: {error_text(exc)}"} for p in mlp_fusion.PROVIDERS]
                            progress.step(f"{name} mlp fusion M={m}")
                continue
            for recipe in recipes:
                ref_w: dict[int, Any] = {}  # float64 weights of the checked layer, shared by every M
                w_scales = [weight_scales(recipe, p, device) for p in model.layer()] if dtype == "fp8" else []
                for m in config.m_values:
                    try:
                        records += _run_case(model, recipe, m, ops, config, device, w_scales, ref_w)
                    except Exception as exc:
                        for p in PROVIDERS:
                            records.append({**new_record(model, recipe, m, config.layers, p, config.fast_accum), "status": FAILED,
                                            "reason": error_text(exc)})  # fmt: skip
                    progress.step(f"{name} {recipe} M={m}")
                for m in config.m_values if recipe == "fp8-block" and name in fused else ():
                    try:
                        records += mlp_fusion.run_case(model, m, ops.weights, w_scales, config.layers,
                                                       config.budget_ms, device)
                    except Exception as exc:
                        records += [{**mlp_fusion.new_record(model, m, config.layers, p), "status": FAILED,
                                     "reason": error_text(exc)} for p in mlp_fusion.PROVIDERS]
                    progress.step(f"{name} mlp fusion M={m}")
                del ref_w
            del ops
            torch.cuda.empty_cache()
    meta["wall_s"] = round(time.perf_counter() - t0, 1)
    derive(records, ceilings["copy_gbs"])
    return graphed.make_result(meta, tables(records)), records
