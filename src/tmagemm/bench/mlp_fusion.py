"""The decode preset's "mlp fusion" comparison: what fusing the gate/up epilogue saves per layer.

For every model with an MLP (a ``gate_up`` and a ``down`` projection) and every M, the
block-scaled fp8 MLP of ``layers`` layers (each with its own weights: the decode preset's fp8
weights and 128x128 scales) is captured in one CUDA graph per chain and replayed:

* ``mlp-unfused``: quantize x (1x128) -> gate/up ``scaled_mm`` (bf16 out) -> ``silu(g) * u``
  (torch) -> quantize h (1x128) -> down ``scaled_mm``; what a model of ``tmagemm.nn.FP8Linear``
  layers runs once gate and up share a weight (five launches, the 2I-wide bf16 intermediate
  written and read).
* ``mlp-fused``: quantize x -> ``tmagemm.gate_up_silu_quant`` -> down ``scaled_mm`` (three).

Every layer reads the same bf16 input x (as the decode stacks read fixed buffers: a chain of
MLPs alone would shrink its activations layer by layer) and writes its own output. Per-layer
time = replay time / layers; speedup = unfused / fused. Correctness, in the same run: the last
layer's output of each chain against float64 of its quantized input (g, u and h in float64, h
not quantized), max|out - ref| / max|ref| <= :data:`TOLERANCE`.

Records share the decode preset's fields (``decode.FIELDS``; recipe "fp8-block", provider one
of :data:`PROVIDERS`, bytes of the two GEMMs), so they are saved in the same result files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .graphed import fmt, table
from .results import OK, geomean

PROVIDERS = ("mlp-unfused", "mlp-fused")
RECIPE = "fp8-block"
# h is quantized to e4m3 (relative rounding up to 2^-4, RMS about 3.6%) and the reference keeps
# it exact, so the output's error is that rounding carried through the down projection: 1.9-2.4%
# of max|ref| for both chains (interpreter runs, H = 256-1024, I = 256-1408, M = 5-16). A lost
# k-block, a wrong scale or gate and up swapped miss by O(1).
TOLERANCE = 0.08


def mlp_projections(model) -> tuple[int, int] | None:
    """Positions of the gate_up and down projections in ``model.layer()``, or None."""
    names = [p.name for p in model.layer()]
    return (names.index("gate_up"), names.index("down")) if "gate_up" in names and "down" in names else None


def new_record(model, m: int, layers: int, provider: str) -> dict[str, Any]:
    """A decode record for one chain: the bytes and flops of the gate_up and down GEMMs."""
    from .decode import FIELDS, layer_bytes

    gi, di = mlp_projections(model)
    layer = model.layer()
    rec: dict[str, Any] = {f: None for f in FIELDS}
    rec.update(model=model.name, tp=model.tp, recipe=RECIPE, m=m, layers=layers, provider=provider,
               tolerance=TOLERANCE, **layer_bytes((layer[gi], layer[di]), m, RECIPE))
    return rec


def table_text(records: list[dict[str, Any]]) -> str:
    """One row per (model, M): per-layer us of both chains, speedup (unfused / fused), errors;
    then a line with the geometric mean of the speedups. "" without MLP records."""
    pairs: dict[tuple, dict[str, dict]] = {}
    for r in records:
        if r["provider"] in PROVIDERS:
            pairs.setdefault((r["model"], r["m"]), {})[r["provider"]] = r
    if not pairs:
        return ""
    rows, speedups = [], []
    for (model, m), pair in pairs.items():
        unfused, fused = pair.get("mlp-unfused") or {}, pair.get("mlp-fused") or {}

        def cell(r: dict) -> str:
            return fmt(r.get("layer_us"), ".1f") if r.get("status") == OK else "-"

        speedup = fused.get("speedup")
        if speedup is not None:
            speedups.append(speedup)
        note = ", ".join(f"{p} {r['status']}" for p, r in pair.items() if r["status"] != OK)
        rows.append([model, str(m), fmt((fused or unfused)["bytes"] / 1e6, ".1f"), cell(unfused), cell(fused),
                     "-" if speedup is None else f"{speedup:.3f}x", fmt(unfused.get("max_rel_err"), ".1e"),
                     fmt(fused.get("max_rel_err"), ".1e"), note])
    text = table(["model", "M", "MB/layer", "unfused us", "fused us", "speedup", "unfused err", "fused err", "note"],
                 rows)
    return text + f"\ngeomean speedup {fmt(geomean(speedups), '.3f')} over {len(speedups)} of {len(pairs)} pairs"


NOTES = (
    "mlp fusion: per-layer CUDA-graph time of the block-scaled MLP, unfused = quantize x (1x128) -> gate/up "
    "scaled_mm (bf16 out) -> silu(g) * u in torch -> quantize h (1x128) -> down scaled_mm; fused = quantize x -> "
    "tmagemm.gate_up_silu_quant -> down scaled_mm. speedup = unfused / fused. err = max|out - ref| / max|ref| of "
    "the last layer vs float64 from its quantized input (h exact, so the err is h's fp8 rounding)."
)


# ----------------------------------------------------------------------- the chains (any device)


@dataclass
class Chain:
    """One provider's MLP stack: ``run()`` launches every layer; ``outs[l]`` is layer l's output."""

    provider: str
    x: Any  # (M, H) bf16, every layer's input
    outs: list
    run: Callable[[], None]


def build(provider: str, x, gate_up: list, down: list, s_gate_up, s_down) -> Chain:
    """The chain of ``provider`` over per-layer weights ``gate_up[l]`` (2I, H) and ``down[l]``
    (H, I) e4m3 with their 128x128 scales (shared by every layer)."""
    import torch
    import torch.nn.functional as F

    import tmagemm

    m, i = x.shape[0], gate_up[0].shape[0] // 2
    outs = [torch.empty(m, d.shape[0], dtype=torch.bfloat16, device=x.device) for d in down]
    block = dict(scale_recipe_a="1x128", scale_recipe_b="128x128")
    if provider == "mlp-fused":
        def gate_up_quant(xq, xs, w):
            return tmagemm.gate_up_silu_quant(xq, xs, w, s_gate_up)
    elif provider == "mlp-unfused":
        g_u = torch.empty(m, 2 * i, dtype=torch.bfloat16, device=x.device)

        def gate_up_quant(xq, xs, w):
            tmagemm.scaled_mm(xq, w.t(), xs, s_gate_up, out=g_u, **block)
            h = F.silu(g_u[:, :i]) * g_u[:, i:]
            return tmagemm.quantize_fp8(h, "1x128", check_finite=False)
    else:
        raise ValueError(f"unknown MLP chain {provider!r}; choose from {PROVIDERS}")

    def run() -> None:
        for w_gu, w_d, out in zip(gate_up, down, outs):
            xq, xs = tmagemm.quantize_fp8(x, "1x128", check_finite=False)
            hq, hs = gate_up_quant(xq, xs, w_gu)
            tmagemm.scaled_mm(hq, w_d.t(), hs, s_down, out=out, **block)

    return Chain(provider, x, outs, run)


def _dequant(w, s):
    """A (rows, K) e4m3 weight times its 128x128 scales, float64."""
    rows, k = w.shape
    return w.double() * s.double().repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :k]


def reference(x, gate_up_w, down_w, s_gate_up, s_down):
    """The last layer's output in float64 from x's 1x128 quantization (the chains' own: the
    quantizer is deterministic), g, u and h = silu(g) * u unquantized."""
    import torch

    import tmagemm

    xq, xs = tmagemm.quantize_fp8(x, "1x128", check_finite=False)
    x64 = xq.double() * xs.double().repeat_interleave(128, 1)[:, : x.shape[1]]
    w64 = _dequant(gate_up_w, s_gate_up)
    i = w64.shape[0] // 2
    g, u = x64 @ w64[:i].t(), x64 @ w64[i:].t()
    return (g * torch.sigmoid(g) * u) @ _dequant(down_w, s_down).t()


def max_rel_err(out, ref) -> float:
    got = out.double()
    if not bool(got.isfinite().all()):
        return float("inf")
    return ((got - ref).abs().max() / ref.abs().max().clamp(min=1e-300)).item()


# ------------------------------------------------------------------------------------- GPU


def run_case(model, m: int, weights: list[list[Any]], w_scales: list[dict], layers: int, budget_ms: float,
             device) -> list[dict[str, Any]]:
    """Both chains of ``model`` at M tokens: build, warm up, capture, time, check. ``weights``:
    the decode preset's fp8 weights per layer and projection; ``w_scales``: its fp8-block scales
    per projection."""
    import torch

    from . import graphed
    from .results import FAILED, WRONG, error_text

    gi, di = mlp_projections(model)
    gate_up, down = [row[gi] for row in weights], [row[di] for row in weights]
    s_gate_up, s_down = w_scales[gi]["sb"], w_scales[di]["sb"]
    gen = torch.Generator(device=device).manual_seed(1000 + m)
    x = torch.randn(m, gate_up[0].shape[1], device=device, generator=gen).to(torch.bfloat16)
    records = {p: new_record(model, m, layers, p) for p in PROVIDERS}
    chains, graphs = {}, {}
    for provider, rec in records.items():
        try:
            chain = build(provider, x, gate_up, down, s_gate_up, s_down)
            chain.run()  # plans and compiles eagerly, before capture
            torch.cuda.synchronize()
            graphs[provider] = graphed.capture(chain.run)
            chains[provider] = chain
        except Exception as exc:
            rec.update(status=FAILED, reason=error_text(exc))
            torch.cuda.synchronize()
    if graphs:
        for provider, ms in graphed.time_graphs(graphs, budget_ms).items():
            median, p20, p80 = graphed.replay_quantiles(ms, layers)
            records[provider].update(layer_us=median, layer_p20_us=p20, layer_p80_us=p80, replays=len(ms))
    ref = reference(x, gate_up[-1], down[-1], s_gate_up, s_down) if chains else None
    for provider, chain in chains.items():
        graphs[provider].replay()  # the check reads a replay of this chain's own graph
        torch.cuda.synchronize()
        rec = records[provider]
        rec["max_rel_err"] = err = max_rel_err(chain.outs[-1], ref)
        rec["status"] = OK if err <= TOLERANCE else WRONG
        if rec["status"] == WRONG:
            rec["reason"] = f"max rel err {err:.3g} > {TOLERANCE:.3g} (last layer vs float64)"
    if len(chains) == 2:
        a, b = (chains[p].outs[-1].double() for p in ("mlp-fused", "mlp-unfused"))
        diff = ((a - b).abs().max() / b.abs().max().clamp(min=1e-300)).item()
        for rec in records.values():
            rec["rel_diff_vs_peer"] = diff
    del graphs, chains
    return list(records.values())
