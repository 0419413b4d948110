"""``tmagemm bench --preset moe-layer``: a Mixture-of-Experts layer's experts end to end (routing
to tokens back), one forward per CUDA graph: ``tmagemm.nn.FP8Experts`` against the same
computation on torch's grouped GEMMs.

A *case* is one model of ``--preset moe`` (its experts on one GPU: DeepSeek-V3, its EP 4 share,
Qwen3-235B-A22B, Mixtral 8x7B) at ``tokens`` tokens and one routing, each token sent to ``top_k``
distinct experts of all ``experts * ep``, drawn with a fixed seed: ``balanced`` uniformly,
``zipf`` with probabilities p_r ~ 1/r^s (s = ``moe.ZIPF_S``) over a seeded permutation of the
experts, so a few are busy and many idle (under expert parallelism the ids of other GPUs'
experts are sentinels, which add nothing, as transformers marks them). The
forward is ``experts(hidden_states, top_k_index, top_k_weights)``, transformers' experts
contract: sort the (token, expert) pairs by expert, gate/up, SiLU * up, down, weight by the
routing weight, sum each token's pairs.

Providers, each one forward captured per ``torch.cuda.CUDAGraph`` and timed as graph replays in
alternating rounds (weights of 0.4-11 GB: no L2 flush needed):

* ``tmagemm-block``: FP8Experts, the "block" recipe (1x128 activations, 128x128 weight blocks:
  what FP8 MoE checkpoints hold), from the bf16 weights quantized once;
* ``tmagemm-row``: FP8Experts, the "row" recipe (per token x per output channel);
* ``torch-bf16``: transformers' ``grouped_mm`` experts implementation on the bf16 weights
  (``torch._grouped_mm``, its offsets from ``torch.histc``): what a model runs without fp8;
* ``torch-fp8-row``: the same steps on ``torch._scaled_grouped_mm`` (fp8 row-wise, PyTorch's
  only fp8 grouped GEMM), the activations quantized per row by torch ops, the weights as
  tmagemm-row's.

Every output is checked on its first ``CHECK_TOKENS`` tokens against float64 of the bf16 weights
(relative Frobenius error; the fp8 providers' bound covers fp8 rounding of weights and
activations, a token sent to a wrong expert or weighted wrongly is off by O(1)).
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

NAME = "moe-layer"  # the preset, and the key of its records in results.json
PROVIDERS = ("tmagemm-block", "tmagemm-row", "torch-bf16", "torch-fp8-row")
# (ours, peer) pairs whose time ratio the report gives
SPEEDUPS = (("tmagemm-block", "torch-bf16"), ("tmagemm-row", "torch-fp8-row"), ("tmagemm-row", "torch-bf16"))
DEFAULT_TOKENS = (1, 16, 128, 1024, 4096)
DEFAULT_MODELS = ("deepseek-v3-ep4", "qwen3-235b-a22b", "mixtral-8x7b")
DEFAULT_BUDGET_MS = 20.0
CHECK_TOKENS = 32
TOLERANCE = {"torch-bf16": 2e-2, "fp8": 0.1}  # relative Frobenius error vs float64 of the bf16 weights

FIELDS = (
    "model", "e", "top_k", "ep", "hidden", "intermediate", "tokens", "routing", "pairs", "experts_touched", "max_count",
    "provider", "status", "reason", "us", "p20_us", "p80_us", "replays", "weight_bytes", "gbs", "pct_copy",
    "speedup", "rel_err", "tolerance",
)  # fmt: skip


@dataclass(frozen=True)
class Case:
    model: str
    tokens: int
    routing: str = "balanced"


@dataclass(frozen=True)
class MoELayerConfig:
    """One ``--preset moe-layer`` run. budget_ms: GPU time of timed replays per (case, provider)."""

    models: tuple[str, ...] = DEFAULT_MODELS
    tokens: tuple[int, ...] = DEFAULT_TOKENS
    routings: tuple[str, ...] = moe.ROUTINGS
    budget_ms: float = DEFAULT_BUDGET_MS
    command: str = ""

    def __post_init__(self):
        if not self.tokens or any(t < 1 or t > 16384 for t in self.tokens):
            raise ValueError(f"--preset moe-layer needs token counts (--m) in 1..16384, got {list(self.tokens)}")
        if self.budget_ms <= 0:
            raise ValueError(f"--budget-ms must be > 0, got {self.budget_ms}")
        moe.parse_models(list(self.models))
        moe.parse_routings(list(self.routings))

    def cases(self) -> list[Case]:
        return [Case(m, t, r) for m in self.models for t in self.tokens for r in self.routings]


def routing(model: moe.MoEModel, tokens: int, device, kind: str = "balanced"):
    """(top_k_index, top_k_weights): each token's top_k distinct experts of all ``experts * ep``
    (ids of other GPUs' experts, >= experts, are sentinels), uniform (``balanced``) or Zipf-skewed
    (``zipf``, see the module doc), softmax-normalized weights, seeded."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(moe.SEED + tokens)
    every = model.experts * model.ep
    if kind == "zipf":
        popularity = 1.0 / torch.arange(1, every + 1, dtype=torch.float64) ** moe.ZIPF_S
        p = popularity[torch.randperm(every, generator=gen).argsort()]  # expert i has rank perm^-1[i]
        ids = torch.multinomial(p.expand(tokens, every), model.top_k, replacement=False, generator=gen)
    else:
        ids = torch.rand(tokens, every, generator=gen).argsort(dim=1)[:, : model.top_k]
    weights = torch.rand(tokens, model.top_k, generator=gen).softmax(dim=1)
    return ids.to(device), weights.to(device, torch.bfloat16)


def new_record(model: moe.MoEModel, tokens: int, ids, provider: str, routing_kind: str = "balanced") -> dict[str, Any]:
    import torch

    local = ids[(ids >= 0) & (ids < model.experts)]
    counts = torch.bincount(local.flatten(), minlength=model.experts)
    touched = int((counts > 0).sum())
    rec: dict[str, Any] = {f: None for f in FIELDS}
    rec.update(model=model.name, e=model.experts, top_k=model.top_k, ep=model.ep, hidden=model.hidden,
               intermediate=model.intermediate, tokens=tokens, routing=routing_kind, pairs=int(local.numel()),
               experts_touched=touched,
               max_count=int(counts.max()), provider=provider,
               weight_bytes=touched * 3 * model.hidden * model.intermediate * (2 if provider == "torch-bf16" else 1),
               tolerance=TOLERANCE["torch-bf16" if provider == "torch-bf16" else "fp8"])
    return rec


def derive(records: list[dict[str, Any]], copy_gbs: float | None) -> list[dict[str, Any]]:
    """GB/s of the touched experts' weights and its % of the copy rate; on each ``SPEEDUPS``
    provider, ``speedup`` = its peer's time / its own (tmagemm-row's against torch-fp8-row)."""
    by_case: dict[tuple, dict[str, dict]] = {}
    for r in records:
        r["gbs"] = r["pct_copy"] = r["speedup"] = None
        if r["status"] == OK and r.get("us"):
            r["gbs"] = r["weight_bytes"] / (r["us"] * 1e-6) / 1e9
            r["pct_copy"] = 100 * r["gbs"] / copy_gbs if copy_gbs else None
        by_case.setdefault((r["model"], r["tokens"], r["routing"]), {})[r["provider"]] = r
    for group in by_case.values():
        for ours, peer in SPEEDUPS[:2]:
            a, b = group.get(ours), group.get(peer)
            if a and b and a["status"] == OK and b["status"] == OK and a.get("us") and b.get("us"):
                a["speedup"] = b["us"] / a["us"]
    return records


def _ratio(records, ours: str, peer: str, model: str | None = None, routing_kind: str | None = None) -> list[float]:
    by_case: dict[tuple, dict[str, dict]] = {}
    for r in records:
        if r["status"] == OK and r.get("us") and model in (None, r["model"]) and routing_kind in (None, r["routing"]):
            by_case.setdefault((r["model"], r["tokens"], r["routing"]), {})[r["provider"]] = r
    return [g[peer]["us"] / g[ours]["us"] for g in by_case.values() if ours in g and peer in g]


def case_table(records: list[dict[str, Any]]) -> str:
    groups: dict[tuple, dict[str, dict]] = {}
    for r in records:
        groups.setdefault((r["model"], r["tokens"], r["routing"]), {})[r["provider"]] = r
    rows = []
    for (model, tokens, routing_kind), group in groups.items():
        any_ = next(iter(group.values()))

        def us(p: str) -> str:
            r = group.get(p) or {}
            return fmt(r.get("us"), ".1f") if r.get("status") == OK else (r.get("status") or "-")

        ratios = []
        for ours, peer in SPEEDUPS:
            a, b = group.get(ours) or {}, group.get(peer) or {}
            ok = a.get("status") == OK and b.get("status") == OK
            ratios.append(f"{b['us'] / a['us']:.3f}x" if ok else "-")
        block = group.get("tmagemm-block") or {}
        errs = "/".join(fmt((group.get(p) or {}).get("rel_err"), ".1e") for p in PROVIDERS)
        rows.append([model, str(tokens), routing_kind, str(any_["pairs"]), str(any_["experts_touched"]),
                     str(any_["max_count"]),
                     *[us(p) for p in PROVIDERS], *ratios, fmt(block.get("pct_copy"), ".0f"), errs])
    headers = ["model", "tokens", "routing", "pairs", "experts", "max count", *[f"{p} us" for p in PROVIDERS],
               "block vs bf16", "row vs torch row", "row vs bf16", "block %copy", "err " + "/".join(
                   p.split("-", 1)[1] for p in PROVIDERS)]  # fmt: skip
    return table(headers, rows)


def geomean_table(records: list[dict[str, Any]]) -> str:
    rows = []
    models = list(dict.fromkeys(r["model"] for r in records))
    routings = list(dict.fromkeys(r["routing"] for r in records))
    for ours, peer in SPEEDUPS:
        for model in models + ["all"]:
            for kind in routings + (["all"] if len(routings) > 1 else []):
                values = _ratio(records, ours, peer, None if model == "all" else model, None if kind == "all" else kind)
                if values:
                    rows.append([f"{ours} vs {peer}", model, kind, str(len(values)), f"{geomean(values):.3f}",
                                 f"{min(values):.3f}", f"{max(values):.3f}"])
    return table(["pair", "model", "routing", "n", "geomean", "min", "max"], rows)


NOTES = (
    "us = median CUDA-graph replay time of ONE experts forward (routing sort through the per-token "
    "sum), providers in alternating rounds. speedup columns = the peer's time / tmagemm's. %copy = "
    "the touched experts' weight bytes (fp8: 1 byte, bf16: 2) / time, as a share of the measured "
    "device copy rate. err = relative Frobenius error on the first "
    f"{CHECK_TOKENS} tokens vs float64 of the bf16 weights (bound {TOLERANCE['torch-bf16']} bf16, "
    f"{TOLERANCE['fp8']} fp8: weights and activations rounded to e4m3)."
)


def tables(records: list[dict[str, Any]]) -> dict[str, str]:
    out = {"moe-layer cases": case_table(records), "moe-layer geomeans": geomean_table(records)}
    return graphed.finish_tables("moe-layer", out, records, lambda r: f"{r['model']} T={r['tokens']} {r['routing']}",
                                 NOTES, 2)


# ---------------------------------------------------------------------------- GPU: providers


def _quantize_rows(x):
    """torch's row-wise fp8 quantization (amax / 448 per row, round to nearest): (q, scale (rows,))."""
    import torch

    fp8 = torch.float8_e4m3fn
    scale = (x.float().abs().amax(dim=1) / torch.finfo(fp8).max).clamp(min=torch.finfo(torch.float32).tiny)
    return (x.float() / scale[:, None]).clamp(-448.0, 448.0).to(fp8), scale


def torch_experts_forward(x, ids, weights, num_experts: int, gate_up, down, gate_up_scale=None, down_scale=None):
    """transformers' ``grouped_mm`` experts forward (bf16 weights: ``torch._grouped_mm``), or the
    same on ``torch._scaled_grouped_mm`` with row-wise fp8 weights (gate_up / down e4m3 (E, N, K)
    and their (E, N) scales). Ids outside 0..E-1 add nothing."""
    import torch
    import torch.nn.functional as F

    tokens, top_k = ids.shape
    flat = ids.reshape(-1)
    sorted_ids, perm = torch.sort(flat)
    counts = torch.histc(sorted_ids.float(), bins=num_experts, min=0, max=num_experts - 1)
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
    x_g = x[perm // top_k]
    fp8 = gate_up_scale is not None

    def mm(a, w, w_scale):
        if not fp8:
            return torch._grouped_mm(a, w.transpose(1, 2), offs=offs)
        q, s = _quantize_rows(a)
        return torch._scaled_grouped_mm(q, w.transpose(1, 2), s, w_scale, offs=offs, out_dtype=torch.bfloat16)

    gate, up = mm(x_g, gate_up, gate_up_scale).chunk(2, dim=-1)
    y = mm(F.silu(gate) * up, down, down_scale)
    y = torch.where(((sorted_ids >= 0) & (sorted_ids < num_experts))[:, None], y, 0.0)  # sentinel rows
    y = y * weights.reshape(-1)[perm, None]
    out = torch.empty_like(y).index_copy_(0, perm, y)
    return out.view(tokens, top_k, -1).sum(dim=1).to(x.dtype)


@dataclass
class _Layer:
    gate_up: Any  # (E, 2I, H) bf16
    down: Any  # (E, H, I) bf16
    block: Any = None  # FP8Experts
    row: Any = None


def _layer(model: moe.MoEModel, device) -> _Layer:
    import torch

    gen = torch.Generator(device=device).manual_seed(moe.SEED + model.hidden)
    e, h, i = model.experts, model.hidden, model.intermediate
    gate_up = moe.randn((e, 2 * i, h), torch.bfloat16, device, gen, 1 / math.sqrt(h))
    down = moe.randn((e, h, i), torch.bfloat16, device, gen, 1 / math.sqrt(i))
    return _Layer(gate_up, down)


def _fp8_experts(layer: _Layer, recipe: str):
    """FP8Experts of the bf16 weights (quantized once, per expert)."""
    from ..nn.experts import FP8Experts

    return FP8Experts.from_weights(layer.gate_up, layer.down, recipe)


def _build(provider: str, model: moe.MoEModel, layer: _Layer, x, ids, weights) -> Callable[[], Any]:
    e = model.experts
    if provider == "tmagemm-block":
        layer.block = layer.block or _fp8_experts(layer, "block")
        return lambda: layer.block(x, ids, weights)
    if provider == "tmagemm-row":
        layer.row = layer.row or _fp8_experts(layer, "row")
        return lambda: layer.row(x, ids, weights)
    if provider == "torch-bf16":
        return lambda: torch_experts_forward(x, ids, weights, e, layer.gate_up, layer.down)
    row = layer.row = layer.row or _fp8_experts(layer, "row")
    return lambda: torch_experts_forward(x, ids, weights, e, row.gate_up_proj, row.down_proj,
                                         row.gate_up_proj_scale_inv.squeeze(-1), row.down_proj_scale_inv.squeeze(-1))


def _reference(model: moe.MoEModel, layer: _Layer, x, ids, weights):
    """float64 of the first CHECK_TOKENS tokens on the bf16 weights."""
    import torch
    import torch.nn.functional as F

    t = min(CHECK_TOKENS, x.shape[0])
    out = torch.zeros(t, model.hidden, dtype=torch.float64, device=x.device)
    for tok in range(t):
        for j in range(model.top_k):
            g = int(ids[tok, j])
            if g >= model.experts:
                continue
            gate, up = (layer.gate_up[g].double() @ x[tok].double()).chunk(2)
            out[tok] += float(weights[tok, j]) * (layer.down[g].double() @ (F.silu(gate) * up))
    return out


def _run_case(case: Case, layer: _Layer, config: MoELayerConfig, device) -> list[dict[str, Any]]:
    import torch

    model = moe.MODELS[case.model]
    gen = torch.Generator(device=device).manual_seed(moe.SEED + case.tokens)
    x = torch.randn(case.tokens, model.hidden, device=device, generator=gen).to(torch.bfloat16)
    ids, weights = routing(model, case.tokens, device, case.routing)
    records = {p: new_record(model, case.tokens, ids, p, case.routing) for p in PROVIDERS}
    graphs, outputs = {}, {}
    for provider in PROVIDERS:
        try:
            call = _build(provider, model, layer, x, ids, weights)
            held: dict[str, Any] = {}

            def run(call=call, held=held) -> None:
                held["out"] = call()

            with torch.no_grad():
                run()
                torch.cuda.synchronize()
                graphs[provider] = graphed.capture(run)
            outputs[provider] = held
        except Exception as exc:
            records[provider].update(status=FAILED if provider.startswith("tmagemm") else UNSUPPORTED,
                                     reason=error_text(exc))
            torch.cuda.synchronize()
    if graphs:
        for provider, ms in graphed.time_graphs(graphs, config.budget_ms).items():
            median, p20, p80 = graphed.replay_quantiles(ms)
            records[provider].update(us=median, p20_us=p20, p80_us=p80, replays=len(ms))
    ref = _reference(model, layer, x, ids, weights)
    for provider, graph in graphs.items():
        graph.replay()
        torch.cuda.synchronize()
        got = outputs[provider]["out"][: ref.shape[0]].double()
        err = float((got - ref).norm() / ref.norm().clamp(min=1e-300)) if torch.isfinite(got).all() else math.inf
        rec = records[provider]
        rec.update(rel_err=err, status=OK if err <= rec["tolerance"] else WRONG)
        if rec["status"] == WRONG:
            rec["reason"] = f"relative error {err:.3g} > {rec['tolerance']} (vs float64, first {ref.shape[0]} tokens)"
    del graphs, outputs
    return list(records.values())


def run(config: MoELayerConfig, stream: TextIO | None = None) -> tuple[BenchResult, list[dict[str, Any]]]:
    """Time every case of ``config`` for every provider on the current GPU."""
    import torch

    from .runner import Progress

    device, meta = graphed.start_run(NAME, config, "it times CUDA-graph replay of MoE layers' experts")
    meta["models"] = moe.models_metadata(config.models)
    meta["ceilings"] = graphed.copy_ceilings(device)
    records: list[dict[str, Any]] = []
    progress = Progress(len(config.cases()), stream or sys.stderr)
    t0 = time.perf_counter()
    for name in config.models:
        model = moe.MODELS[name]
        layer = None
        try:
            torch.cuda.empty_cache()
            layer = _layer(model, device)
            for case in (c for c in config.cases() if c.model == name):
                records += _run_case(case, layer, config, device)
                progress.step(f"{name} T={case.tokens} {case.routing}")
        except Exception as exc:  # e.g. out of memory
            done = {(r["tokens"], r["routing"], r["provider"]) for r in records if r["model"] == name}
            ids, _ = routing(model, 1, "cpu")
            records += [{**new_record(model, t, ids, p, k), "tokens": t, "status": FAILED, "reason": error_text(exc)}
                        for t in config.tokens for k in config.routings for p in PROVIDERS
                        if (t, k, p) not in done]  # fmt: skip
            torch.cuda.synchronize()
        del layer
    meta["wall_s"] = round(time.perf_counter() - t0, 1)
    derive(records, meta["ceilings"].get("copy_gbs"))
    return graphed.make_result(meta, tables(records)), records
