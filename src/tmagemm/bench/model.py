"""``tmagemm bench --preset model``: decode tokens/s of a whole random 8B-shaped model in a CUDA
graph, bf16 vs its ``tmagemm.nn`` FP8 conversion vs the same FP8 weights on PyTorch's fp8 GEMMs.

A model (``--models``: Llama-3-8B's shape by default; Qwen3-8B; Qwen3-30B-A3B, a Mixture-of-Experts
model whose experts run on transformers' grouped_mm experts in bf16 and become FP8Experts when
converted) is built by transformers from its config
with random weights, directly on the GPU in bf16 (fixed seed; transformers' own init, std
0.02 unless ``--init-std``). Its *variants* run the same decode step (bench/static_decode.py:
the model's own modules, a static KV cache of ``context`` prefilled tokens, one new token per
sequence) and differ in their linear layers only:

* ``bf16``: the model as built (nn.Linear, cuBLAS);
* ``fp8-tmagemm``: ``tmagemm.nn.convert(copy, recipe="block")`` (lm_head kept bf16 by default);
* ``fp8-tmagemm-fused``: ``convert(..., fuse_gate_up=True, fuse_qkv=True)``, where this tmagemm has it;
* ``fp8-tmagemm-fused-norms``: the same plus ``fuse_norms=True`` (RMSNorms quantizing for the layers);
* ``fp8-torch-block``: fp8-tmagemm's fp8 weights (shared, not copied) and activation quantizer,
  the GEMM on ``torch.nn.functional.scaled_mm`` (BlockWise1x128 x BlockWise128x128);
* ``fp8-tmagemm-row`` / ``fp8-torch-row``: ``convert(copy, recipe="row")``, the GEMM on tmagemm /
  on ``torch._scaled_mm`` row-wise (a torch fp8 peer at batch 1, which cuBLAS's block path refuses);
* ``no-proj``: a reference, every converted projection replaced by a zero-filled output: what
  the step costs besides its projections (attention, norms, rotary, lm_head, launches).

Copies share every tensor with the bf16 model (``static_decode.shared_copy``), so only the fp8
weights are new memory. Per batch size, each variant's step is captured once in a
``torch.cuda.CUDAGraph`` (after an eager step) and the graphs are replayed in alternating rounds
at a fixed position (every replay is the same step); tokens/s = batch / median replay time.
Checked in the same run: every linear of layer 0 against float64, the step's logits against the
bf16 model's (relative error, top-1 agreement), the bf16 step against transformers' own forward
pass, graph replay against eager (logits bit for bit, and ``new_tokens`` greedy tokens), and
with ``compile_check`` greedy tokens of ``torch.compile(mode="reduce-overhead")`` against eager.
"""

from __future__ import annotations

import functools
import gc
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

from . import graphed
from .graphed import fmt, table
from .model_variants import FUSED_FLAGS, VARIANTS, build_variant, check_linears, fused_available, rel_err
from .results import FAILED, OK, UNSUPPORTED, WRONG, BenchResult, error_text, geomean
from .static_decode import SPECS

NAME = "model"
DEFAULT_MODELS = ("llama3-8b",)
DEFAULT_BATCHES = (1, 2, 4, 8, 16)
DEFAULT_CONTEXT = 512
DEFAULT_NEW_TOKENS = 16
DEFAULT_BUDGET_MS = 300.0
TMAGEMM_VARIANTS = ("fp8-tmagemm", "fp8-tmagemm-fused", "fp8-tmagemm-fused-norms", "fp8-tmagemm-row")
# Logits farther than this from the bf16 model's are wrong (independent logits give sqrt(2)).
# fp8 rounding grows through a random model's depth: on the 32-layer Llama-3-8B shape (init std
# 0.02, H100) every fp8 variant, PyTorch's cuBLAS ones included, lands 0.58-0.67 from bf16; the
# linears themselves are checked against float64 on layer 0.
LOGITS_WRONG = 1.0
# The bf16 decode step against transformers' forward pass: the same function, other kernels
# (~0.01 on random bf16 Llamas of 2-32 layers on the CPU; a wrong rotary or mask gives O(1)).
HF_WRONG = 0.1
HF_ROWS = 4  # sequences of the transformers reference


def default_variants() -> tuple[str, ...]:
    return tuple(v for v in VARIANTS if v not in FUSED_FLAGS or fused_available(v))


def parse_models(names: list[str] | None) -> tuple[str, ...]:
    if not names:
        return DEFAULT_MODELS
    unknown = [n for n in names if n not in SPECS]
    if unknown:
        raise ValueError(f"unknown model {', '.join(unknown)} for --preset model; choose from "
                         f"{', '.join(SPECS)}")  # fmt: skip
    return tuple(dict.fromkeys(names))


def parse_variants(names: list[str] | None) -> tuple[str, ...]:
    if not names:
        return default_variants()
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variant {', '.join(unknown)} for --preset model; choose from "
                         f"{', '.join(VARIANTS)}")  # fmt: skip
    for name in names:
        if name in FUSED_FLAGS and not fused_available(name):
            flags = ", ".join(f"{flag}=True" for flag in FUSED_FLAGS[name])
            raise ValueError(f"variant {name} needs tmagemm.nn.convert(..., {flags}), which this tmagemm does not have")
    return tuple(v for v in VARIANTS if v in names)  # the canonical order: bf16 first (the reference)


def cache_length(context: int, new_tokens: int) -> int:
    """Positions of the static cache: the context plus the greedy tokens, rounded up to 16."""
    return -(-(context + new_tokens) // 16) * 16


@dataclass(frozen=True)
class ModelBenchConfig:
    """One ``--preset model`` run. layers: None = each model's own depth. batches: sequences per
    step. context: tokens already in the cache when the timed step runs. new_tokens: greedy
    tokens of the eager vs graph check. budget_ms: GPU time of timed replays per (variant,
    batch). cuda_graphs: False times eager steps instead (the CPU tests; never a reported number)."""

    models: tuple[str, ...] = DEFAULT_MODELS
    variants: tuple[str, ...] = field(default_factory=default_variants)
    batches: tuple[int, ...] = DEFAULT_BATCHES
    layers: int | None = None
    context: int = DEFAULT_CONTEXT
    new_tokens: int = DEFAULT_NEW_TOKENS
    budget_ms: float = DEFAULT_BUDGET_MS
    compile_check: bool = False
    init_std: float | None = None
    seed: int = 0
    cuda_graphs: bool = True
    device: str | None = None
    command: str = ""

    def __post_init__(self):
        parse_models(list(self.models))
        if not self.variants:
            raise ValueError(f"--preset model needs at least one variant; choose from {', '.join(VARIANTS)}")
        # The canonical order (bf16 first) and each batch size once, whatever the order given.
        object.__setattr__(self, "variants", parse_variants(list(self.variants)))
        object.__setattr__(self, "batches", tuple(dict.fromkeys(self.batches)))
        if self.layers is not None and self.layers < 1:
            raise ValueError(f"--layers must be >= 1, got {self.layers}")
        if not self.batches or any(b < 1 for b in self.batches):
            raise ValueError(f"--preset model needs batch sizes (--m) >= 1, got {list(self.batches)}")
        for flag, value in (("--context", self.context), ("--new-tokens", self.new_tokens)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if self.budget_ms <= 0:
            raise ValueError(f"--budget-ms must be > 0, got {self.budget_ms}")
        if self.init_std is not None and not self.init_std > 0:
            raise ValueError(f"--init-std must be > 0, got {self.init_std}")


# ------------------------------------------------------------------------------- records


FIELDS = (
    "model", "layers", "context", "batch", "variant", "status", "reason", "timing",
    "step_us", "step_p20_us", "step_p80_us", "replays", "tokens_per_s",
    "weight_bytes", "kv_bytes", "bytes", "gbps", "pct_copy",
    "vs_bf16", "vs_torch_block", "vs_torch_row", "vs_torch", "proj_us", "proj_vs_bf16",
    "logits_rel_err", "top1_agree", "hf_rel_err", "gemm_max_rel_err", "gemm_tolerance", "gemm_worst",
    "graph_equal", "greedy_equal", "compile_s", "compile_tokens_equal",
)  # fmt: skip
_DERIVED = ("tokens_per_s", "gbps", "pct_copy", "vs_bf16", "vs_torch_block", "vs_torch_row", "vs_torch", "proj_us",
            "proj_vs_bf16")  # fmt: skip


def new_record(model: str, layers: int, context: int, batch: int, variant: str,
               timing: str = "graph") -> dict[str, Any]:  # fmt: skip
    rec: dict[str, Any] = dict.fromkeys(FIELDS)
    rec.update(model=model, layers=layers, context=context, batch=batch, variant=variant, timing=timing)
    return rec


def derive(records: list[dict[str, Any]], copy_gbs: float | None) -> list[dict[str, Any]]:
    """tokens/s, GB/s, %copy and the speedups (peer step time / own, same model and batch, both
    ok) of every record, from its raw step time. ``vs_torch`` is against fp8-torch-block where
    it ran, else fp8-torch-row (the issue's fallback where cuBLAS refuses block scales).
    ``proj_us`` = step time - the no-proj reference's (what the projections, and for fp8 their
    activation quantizers, cost in the step); ``proj_vs_bf16`` the bf16 one's / this one's."""
    times: dict[tuple, dict[str, float]] = {}
    for r in records:
        if r["status"] == OK and r.get("step_us"):
            times.setdefault((r["model"], r["batch"]), {})[r["variant"]] = r["step_us"]
    for r in records:
        for key in _DERIVED:
            r[key] = None
        us = r.get("step_us")
        if r["status"] != OK or not us:
            continue
        seconds = us * 1e-6
        r["tokens_per_s"] = r["batch"] / seconds
        if r.get("bytes"):
            r["gbps"] = r["bytes"] / seconds / 1e9
            r["pct_copy"] = 100 * r["gbps"] / copy_gbs if copy_gbs else None
        peers = times.get((r["model"], r["batch"]), {})
        if "no-proj" in peers and r["variant"] != "no-proj":
            r["proj_us"] = us - peers["no-proj"]
            bf16_proj = peers["bf16"] - peers["no-proj"] if "bf16" in peers else None
            if r["variant"] != "bf16" and bf16_proj and r["proj_us"] > 0:
                r["proj_vs_bf16"] = bf16_proj / r["proj_us"]
        if r["variant"] not in ("bf16", "no-proj"):
            r["vs_bf16"] = _ratio(peers, "bf16", r)
        if r["variant"] in TMAGEMM_VARIANTS:
            r["vs_torch_block"] = _ratio(peers, "fp8-torch-block", r)
            r["vs_torch_row"] = _ratio(peers, "fp8-torch-row", r)
            r["vs_torch"] = r["vs_torch_block"] if r["vs_torch_block"] is not None else r["vs_torch_row"]
    return records


def _ratio(times: dict[str, float], peer: str, r: dict[str, Any]) -> float | None:
    return times[peer] / r["step_us"] if peer in times and peer != r["variant"] else None


GEOMEAN_KEYS = (("vs_bf16", "vs bf16"), ("vs_torch_block", "vs torch-block"), ("vs_torch_row", "vs torch-row"),
                ("vs_torch", "vs torch fp8"), ("proj_vs_bf16", "projections vs bf16"))  # fmt: skip


def geomeans(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (model, variant): geomean, min and count of each speedup over the batches run."""
    rows = []
    keys = dict.fromkeys((r["model"], r["variant"]) for r in records if r["variant"] not in ("bf16", "no-proj"))
    for model, variant in keys:
        mine = [r for r in records if r["model"] == model and r["variant"] == variant]
        row: dict[str, Any] = {"model": model, "variant": variant, "batches": len(mine)}
        for key, _ in GEOMEAN_KEYS:
            values = [r[key] for r in mine if r.get(key) is not None]
            row[key] = {"geomean": geomean(values), "min": min(values) if values else None, "n": len(values)}
        rows.append(row)
    return rows


# -------------------------------------------------------------------------------- tables


def _greedy_cell(r: dict[str, Any]) -> str:
    v = r.get("greedy_equal")
    return "-" if v is None else ("same" if v == 1 else f"{v:.2f}")


def _note(r: dict[str, Any]) -> str:
    parts = []
    if r["status"] != OK:
        parts.append(r["status"])
    if r["variant"] == "no-proj":
        parts.append("reference")
    if r.get("hf_rel_err") is not None:
        parts.append(f"vs transformers {r['hf_rel_err']:.1e}")
    if r.get("graph_equal") is False:
        parts.append("graph logits != eager")
    if r.get("timing") == "eager":
        parts.append("eager timing")
    return ", ".join(parts)


def decode_table(records: list[dict[str, Any]]) -> str:
    rows = [[r["model"], str(r["batch"]), r["variant"], fmt(r.get("step_us"), ".1f"), fmt(r.get("tokens_per_s"), ".0f"),
             fmt(r.get("proj_us"), ".1f"), fmt(r["bytes"] / 1e9 if r.get("bytes") else None, ".2f"),
             fmt(r.get("pct_copy"), ".0f"),
             fmt(r.get("vs_bf16"), ".3f"), fmt(r.get("vs_torch_block"), ".3f"), fmt(r.get("vs_torch_row"), ".3f"),
             fmt(r.get("logits_rel_err"), ".3f"), fmt(r.get("top1_agree"), ".2f"), _greedy_cell(r), _note(r)]
            for r in records]  # fmt: skip
    headers = ["model", "B", "variant", "step us", "tok/s", "proj us", "GB/step", "%copy", "vs bf16", "vs torch-block",
               "vs torch-row", "logits err", "top-1", "greedy", "note"]  # fmt: skip
    return table(headers, rows)


def geomean_table(records: list[dict[str, Any]]) -> str:
    def cell(g: dict[str, Any]) -> str:
        if g["geomean"] is None:
            return "-"
        return f"{g['geomean']:.3f} (min {g['min']:.3f}, {g['n']})"

    rows = [[g["model"], g["variant"], *(cell(g[key]) for key, _ in GEOMEAN_KEYS)] for g in geomeans(records)]
    return table(["model", "variant", *(label for _, label in GEOMEAN_KEYS)], rows)


def setup_table(setups: Sequence[dict[str, Any]]) -> str:
    rows = []
    for s in setups:
        for name, v in s["variants"].items():
            gb = v["weight_bytes"] / 1e9 if v.get("weight_bytes") else None
            rows.append([s["model"], name, fmt(gb, ".2f"),
                         fmt(v.get("setup_s"), ".1f"), (v.get("error") or "")[:90]])  # fmt: skip
    return table(["model", "variant", "weights GB/step", "build+prefill s", "error"], rows)


def setup_lines(setups: Sequence[dict[str, Any]]) -> str:
    return "\n".join(
        f"{s['model']}: {s['layers']} layers, {s['params'] / 1e9:.2f} B parameters, init std {s['init_std']}, "
        f"{s['context']} tokens in the cache (length {s['cache_length']}), built in {s['build_s']:.1f} s; "
        f"bf16 step vs transformers' forward: {fmt(s.get('hf_rel_err'), '.1e')}"
        f"{' (' + s['hf_error'] + ')' if s.get('hf_error') else ''}; peak memory {fmt(s.get('peak_gib'), '.1f')} GiB"
        for s in setups)  # fmt: skip


def compile_table(rows: Sequence[dict[str, Any]]) -> str:
    body = [[c["model"], c["variant"], str(c["batch"]), fmt(c.get("compile_s"), ".1f"), fmt(c.get("step_us"), ".1f"),
             fmt(c.get("vs_bf16"), ".3f"), fmt(c.get("logits_rel_diff"), ".1e"), fmt(c.get("tokens_equal"), ".3f"),
             fmt(c.get("first_diff"), "d"), (c.get("error") or "")[:80]] for c in rows]  # fmt: skip
    headers = ["model", "variant", "B", "first call s", "step us", "vs bf16", "logits vs eager", "tokens = eager",
               "first diff", "error"]  # fmt: skip
    return table(headers, body)


NOTES = (
    "step us = median CUDA-graph replay time of one decode step (one new token per sequence, the cache holding "
    "`context` tokens; every variant's graph replayed in alternating rounds). tok/s = B / step time. GB/step = "
    "bytes of every weight and scale the step reads (decoder layers, final norm, lm_head) plus the KV cache "
    "read in full (its static length); %copy = those bytes / step time as a percentage of the measured "
    "device-to-device copy rate (read + write bytes). vs X = X's step time / this variant's, same batch. "
    "vs torch fp8 (geomeans) = vs torch-block where cuBLAS ran it, else vs torch-row. proj us = step us - "
    "no-proj's step us: the projections' share of the step (GEMMs, and for fp8 their activation quantizers); "
    "projections vs bf16 = bf16's proj us / this one's. logits err = "
    "|logits - bf16 logits| / |bf16 logits| (Frobenius over the batch, each variant with its own prefill), "
    "top-1 = argmax agreement with bf16; greedy = the fraction of `new_tokens` greedy tokens identical "
    "between eager steps and graph replays (same = all). no-proj is a reference, not a peer: the step with "
    "every converted projection returning zeros (attention, norms, rotary, residual adds, lm_head, launches). "
    "compile check (--compile-check): torch.compile(mode='reduce-overhead', fullgraph=True) of the step at "
    "every batch, inductor rounding its fused elementwise ops where eager rounds (emulate_precision_casts): "
    "first call s (compilation), step us of back-to-back calls (the compiled variants side by "
    "side), logits and greedy tokens vs eager. Issue 17's bars: fp8-tmagemm >= 1.4x bf16 and >= 1.1x torch "
    "fp8 at every batch 1-16."
)


def tables(records: list[dict[str, Any]], setups: Sequence[dict[str, Any]] = (),
           compiles: Sequence[dict[str, Any]] = ()) -> dict[str, str]:  # fmt: skip
    out = {"model decode": decode_table(records), "model geomeans": geomean_table(records)}
    if setups:
        out["model setup"] = setup_lines(setups) + "\n" + setup_table(setups)
    if compiles:
        out["model compile check"] = compile_table(compiles)
    return graphed.finish_tables("model", out, [{**r, "provider": r["variant"]} for r in records],
                                 lambda r: f"{r['model']} B={r['batch']}", NOTES)


# ------------------------------------------------------------------------------------ run


class _Log:
    """Progress lines with the seconds since the run started."""

    def __init__(self, stream: TextIO | None):
        self.stream, self.t0 = stream if stream is not None else sys.stderr, time.perf_counter()

    def __call__(self, text: str) -> None:
        self.stream.write(f"[{time.perf_counter() - self.t0:7.1f}s] {text}\n")
        self.stream.flush()


@dataclass
class _Variant:
    name: str
    module: Any = None  # the causal LM (or copy) the decoder calls
    decoder: Any = None
    weight_bytes: int = 0
    setup_s: float = 0.0
    error: str | None = None
    status: str = FAILED  # of every record when ``error`` is set


class _Runner:
    """One variant's step at one batch size: a captured graph (or, without CUDA graphs, the eager
    call). ``logits()`` runs the step once and returns its output buffer."""

    def __init__(self, decoder, batch: int, graphs: bool):
        self.out: dict[str, Any] = {}

        def call() -> None:
            self.out["logits"] = decoder.step(batch)

        self.call = call
        self.graph = graphed.capture(call) if graphs else None
        if self.graph is None:
            call()

    def replay(self) -> None:
        (self.graph.replay if self.graph is not None else self.call)()

    def logits(self):
        self.replay()
        return self.out["logits"]


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_eager(calls: dict[str, Callable[[], None]], device, rounds: int = 2) -> dict[str, list[float]]:
    """Wall times (ms) of eager calls in alternating rounds: the CPU tests' stand-in for graph
    timing, never a reported number."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            t0 = time.perf_counter()
            call()
            _sync(device)
            times[name].append(1e3 * (time.perf_counter() - t0))
    return times


def _setup_variants(config: ModelBenchConfig, model, rope, prompts, length: int, log: _Log,
                    tag: str) -> dict[str, _Variant]:  # fmt: skip
    """Build every variant, then prefill its cache with ``context`` prompt tokens per sequence."""
    from .static_decode import Decoder, step_weight_bytes

    variants: dict[str, _Variant] = {}
    built: dict[str, Any] = {}
    for name in config.variants:
        t0 = time.perf_counter()
        try:
            module = build_variant(name, model, built)
            built[name] = module
            decoder = Decoder(module, rope, max(config.batches), length)
            decoder.prefill(prompts[:, : config.context])
            _sync(decoder.device)
            v = _Variant(name, module, decoder, step_weight_bytes(module), time.perf_counter() - t0)
            log(f"{tag} {name}: {v.weight_bytes / 1e9:.2f} GB of weights per step, built and prefilled in "
                f"{v.setup_s:.1f} s")  # fmt: skip
        except Exception as exc:
            peer = name.startswith("fp8-torch")
            v = _Variant(name, setup_s=time.perf_counter() - t0, status=UNSUPPORTED if peer else FAILED,
                         error=("torch: " if peer else "") + error_text(exc))  # fmt: skip
            log(f"{tag} {name}: not built: {v.error}")
            _sync(prompts.device)
        variants[name] = v
    return variants


def _transformers_logits(model, prompts, context: int):
    """transformers' own forward pass over the first HF_ROWS prompts (context + 1 tokens, no
    cache): the logits of the last position, which the bf16 decode step must reproduce."""
    rows = min(HF_ROWS, prompts.shape[0])
    return model(input_ids=prompts[:rows, : context + 1], use_cache=False).logits[:, -1].float()


def _run_batch(variants: dict[str, _Variant], spec_name: str, layers: int, batch: int, config: ModelBenchConfig,
               prompts, hf_logits, greedy_tokens: dict) -> list[dict[str, Any]]:  # fmt: skip
    """Every variant at one batch size: check layer 0's linears, an eager step, capture, time all
    graphs side by side, then the logits and greedy checks."""
    import torch

    from .static_decode import step_weight_bytes

    ctx, first = config.context, prompts[:, config.context]
    timing = "graph" if config.cuda_graphs else "eager"
    recs: dict[str, dict[str, Any]] = {}
    live: dict[str, tuple[_Variant, _Runner, Any]] = {}
    for v in variants.values():
        rec = recs[v.name] = new_record(spec_name, layers, ctx, batch, v.name, timing)
        if v.error:
            rec.update(status=v.status, reason=v.error)
            continue
        dec = v.decoder
        kv, weights = dec.cache_bytes(batch), step_weight_bytes(v.module, batch)  # an MoE's experts: their share
        rec.update(weight_bytes=weights, kv_bytes=kv, bytes=weights + kv)
        peer = v.name.startswith("fp8-torch")
        try:
            if v.name != "no-proj":
                err, tol, where = check_linears(dec.layers[0], batch, config.seed)
                rec.update(gemm_max_rel_err=err, gemm_tolerance=tol, gemm_worst=where)
                if not err <= tol:
                    rec.update(status=WRONG, reason=f"layer 0 {where}: max rel err {err:.3g} > {tol:.3g} vs float64")
            dec.reset(first, ctx)
            eager = dec.step(batch).float()
            _sync(dec.device)
        except Exception as exc:
            why = ("torch refuses: " if peer else "") + error_text(exc)
            rec.update(status=UNSUPPORTED if peer else FAILED, reason=why)
            _sync(dec.device)
            continue
        try:
            live[v.name] = (v, _Runner(dec, batch, config.cuda_graphs), eager)
        except Exception as exc:
            rec.update(status=FAILED, reason=f"graph capture: {error_text(exc)}")
            _sync(dec.device)
    if live:
        if config.cuda_graphs:
            times = graphed.time_graphs({n: r.graph for n, (_, r, _) in live.items()}, config.budget_ms)
        else:
            device = next(iter(live.values()))[0].decoder.device
            times = _time_eager({n: r.replay for n, (_, r, _) in live.items()}, device)
        for name, ms in times.items():
            ms.sort()
            us = [1e3 * ms[min(len(ms) - 1, int(f * len(ms)))] for f in (0.5, 0.2, 0.8)]
            recs[name].update(step_us=us[0], step_p20_us=us[1], step_p80_us=us[2], replays=len(ms))
    reference = live["bf16"][2] if "bf16" in live else None
    for name, (v, runner, eager) in live.items():
        rec, dec = recs[name], v.decoder
        try:
            dec.reset(first, ctx)
            rec["graph_equal"] = bool(torch.equal(runner.logits().float(), eager))
            if name != "no-proj":
                _check_logits(rec, eager, reference, hf_logits)
                eager_tokens = dec.greedy(batch, functools.partial(dec.step, batch), first, ctx, config.new_tokens)
                graph_tokens = dec.greedy(batch, runner.logits, first, ctx, config.new_tokens)
                same = float((eager_tokens == graph_tokens).float().mean())
                rec["greedy_equal"] = same
                greedy_tokens[(name, batch)] = eager_tokens
                if same < 1 and rec["status"] is None:
                    rec.update(status=WRONG, reason=f"greedy tokens of graph replays differ from eager steps "
                                                    f"({same:.3f} equal)")  # fmt: skip
        except Exception as exc:
            rec.update(status=FAILED, reason=f"checks: {error_text(exc)}")
        if rec["status"] is None:
            rec["status"] = OK
    del live
    return list(recs.values())


def _check_logits(rec: dict[str, Any], logits, reference, hf_logits) -> None:
    import torch

    if not bool(torch.isfinite(logits).all()):
        rec.update(status=WRONG, reason="non-finite logits")
        return
    if reference is not None and rec["variant"] != "bf16":
        rec["logits_rel_err"] = rel_err(logits, reference)
        rec["top1_agree"] = float((logits.argmax(-1) == reference.argmax(-1)).float().mean())
        if rec["logits_rel_err"] > LOGITS_WRONG and rec["status"] is None:
            rec.update(status=WRONG, reason=f"logits {rec['logits_rel_err']:.3f} from the bf16 model's "
                                            f"(> {LOGITS_WRONG})")  # fmt: skip
    if hf_logits is not None and rec["variant"] == "bf16":
        rows = min(logits.shape[0], hf_logits.shape[0])
        rec["hf_rel_err"] = rel_err(logits[:rows], hf_logits[:rows])
        if rec["hf_rel_err"] > HF_WRONG and rec["status"] is None:
            rec.update(status=WRONG, reason=f"the bf16 decode step is {rec['hf_rel_err']:.3f} from transformers' own "
                                            f"forward pass (> {HF_WRONG})")  # fmt: skip


# Not fp8-torch-block: dynamo refuses to trace its F.scaled_mm call (torch 2.11, "Attempted to
# call function marked as skipped").
COMPILED_VARIANTS = ("bf16", "fp8-tmagemm", "fp8-tmagemm-fused", "fp8-tmagemm-fused-norms")


def _compile_check(variants: dict[str, _Variant], spec_name: str, batch: int, config: ModelBenchConfig, prompts,
                   greedy_tokens: dict, log: _Log) -> list[dict[str, Any]]:  # fmt: skip
    """torch.compile(mode="reduce-overhead", fullgraph=True) of the step of bf16 and the
    fp8-tmagemm variants at one batch size: the first call's time (compilation), the step-0
    logits and ``new_tokens`` greedy tokens against eager, then the compiled steps timed side
    by side (inductor fuses the norms, rotary and residual adds that the eager graph runs as
    separate kernels). Compiled with ``emulate_precision_casts``: inductor's fused elementwise
    ops round to bf16 where eager's separate ops do, so the compiled step computes eager's
    values and greedy tokens can be compared (without it a random model's near-tied logits
    flip within a few tokens; docs/nn.md, "torch.compile")."""
    import torch
    from torch._inductor import config as inductor_config

    rows, steps = [], {}
    ctx, first = config.context, prompts[:, config.context]
    for name in COMPILED_VARIANTS:
        v = variants.get(name)
        if v is None or v.error or (name, batch) not in greedy_tokens:
            continue
        dec = v.decoder
        row: dict[str, Any] = {"model": spec_name, "variant": name, "batch": batch}
        t0 = time.perf_counter()
        try:
            # Compiles happen at the first calls below: the rounding option is set around them.
            with inductor_config.patch(emulate_precision_casts=True):
                for t in dec.static_tensors():  # caches mutated in place: fixed addresses for the graphs
                    torch._dynamo.mark_static_address(t)
                compiled = torch.compile(dec.forward, mode="reduce-overhead", fullgraph=True)

                def step(compiled=compiled, dec=dec):
                    torch.compiler.cudagraph_mark_step_begin()
                    return compiled(dec.tok[:batch], dec.pos)

                dec.reset(first, ctx)
                fast = step().float()
                _sync(dec.device)
                row["compile_s"] = time.perf_counter() - t0
                dec.reset(first, ctx)
                row["logits_rel_diff"] = rel_err(fast, dec.step(batch).float())
                tokens = dec.greedy(batch, step, first, ctx, config.new_tokens)
                equal = tokens == greedy_tokens[(name, batch)]
                row["tokens_equal"] = float(equal.float().mean())
                diffs = (~equal).any(dim=0).nonzero()
                row["first_diff"] = int(diffs[0]) if len(diffs) else None
                steps[name] = step
        except Exception as exc:
            row["error"] = error_text(exc)
        log(f"{spec_name} {name} B={batch}: torch.compile(mode='reduce-overhead'): first call "
            f"{fmt(row.get('compile_s'), '.1f')} s, greedy tokens equal to eager {fmt(row.get('tokens_equal'), '.3f')}"
            f"{', ' + row['error'] if row.get('error') else ''}")  # fmt: skip
        rows.append(row)
    if steps and config.cuda_graphs:
        for name, ms in graphed.time_calls(steps, config.budget_ms).items():
            row = next(r for r in rows if r["variant"] == name)
            row["step_us"] = 1e3 * sorted(ms)[len(ms) // 2]
        bf16 = next((r.get("step_us") for r in rows if r["variant"] == "bf16"), None)
        for row in rows:
            if bf16 and row.get("step_us") and row["variant"] != "bf16":
                row["vs_bf16"] = bf16 / row["step_us"]
    torch.compiler.reset()
    return rows


def _run_model(spec_name: str, config: ModelBenchConfig, device, log: _Log, setups: list,
               compiles: list) -> list[dict[str, Any]]:  # fmt: skip
    import torch

    from .static_decode import build_model, rope_tables

    spec = SPECS[spec_name]
    layers = config.layers or spec.layers
    length = cache_length(config.context, config.new_tokens)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    model = build_model(spec, layers, device, torch.bfloat16, config.seed, config.init_std, max(8192, length))
    _sync(device)
    setup: dict[str, Any] = {"model": spec_name, "layers": layers, "params": spec.params(layers),
                             "context": config.context, "cache_length": length,
                             "init_std": model.config.initializer_range,
                             "build_s": time.perf_counter() - t0, "variants": {}}  # fmt: skip
    setups.append(setup)
    log(f"{spec_name}: {layers} layers, {setup['params'] / 1e9:.2f} B parameters built in bf16 on {device} "
        f"in {setup['build_s']:.1f} s (init std {setup['init_std']})")  # fmt: skip
    rope = rope_tables(model, length)
    gen = torch.Generator().manual_seed(config.seed + 1)
    prompts = torch.randint(3, spec.vocab, (max(config.batches), config.context + 1), generator=gen).to(device)
    hf_logits = None
    if "bf16" in config.variants:
        try:
            hf_logits = _transformers_logits(model, prompts, config.context)
        except Exception as exc:
            setup["hf_error"] = f"transformers forward: {error_text(exc)}"
    variants = _setup_variants(config, model, rope, prompts, length, log, spec_name)
    setup["variants"] = {n: {"weight_bytes": v.weight_bytes, "setup_s": v.setup_s, "error": v.error}
                         for n, v in variants.items()}  # fmt: skip
    records: list[dict[str, Any]] = []
    greedy_tokens: dict = {}
    for batch in config.batches:
        batch_records = _run_batch(variants, spec_name, layers, batch, config, prompts, hf_logits, greedy_tokens)
        records += batch_records
        times = ", ".join(f"{r['variant']} {fmt(r.get('step_us'), '.0f')}"
                          + ("" if r["status"] == OK else f" ({r['status']})") for r in batch_records)
        log(f"{spec_name} B={batch}: step us {times}")
    bf16 = [r for r in records if r["variant"] == "bf16" and r.get("hf_rel_err") is not None]
    setup["hf_rel_err"] = max((r["hf_rel_err"] for r in bf16), default=None)
    for batch in config.batches if config.compile_check else ():
        rows = _compile_check(variants, spec_name, batch, config, prompts, greedy_tokens, log)
        for row in rows:
            for r in records:
                if (r["variant"], r["batch"]) == (row["variant"], row["batch"]):
                    r.update(compile_s=row.get("compile_s"), compile_tokens_equal=row.get("tokens_equal"))
        compiles += rows
    if device.type == "cuda":
        setup["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    del variants, model, rope, hf_logits
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return records


def run(config: ModelBenchConfig, stream: TextIO | None = None) -> tuple[BenchResult, list[dict[str, Any]]]:
    """Every (model, batch, variant) of ``config`` on the current GPU (or, with
    ``cuda_graphs=False`` and ``device="cpu"``, eagerly on the CPU for the tests)."""
    import torch

    from . import envinfo

    if config.device is not None:
        device = torch.device(config.device)
    elif torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        raise RuntimeError("--preset model needs a CUDA GPU: it times CUDA-graph replay of a whole model's decode step")
    if config.cuda_graphs and device.type != "cuda":
        raise RuntimeError(f"--preset model times CUDA graphs, which need a CUDA device (got {device})")
    log = _Log(stream)
    meta = envinfo.metadata(config.command)
    meta.update(preset=NAME, config=asdict(config), variants={n: VARIANTS[n] for n in config.variants},
                models={n: asdict(SPECS[n]) for n in config.models})  # fmt: skip
    if device.type == "cuda":
        meta["ceilings"] = ceilings = graphed.copy_ceilings(device)
    else:
        meta["mode"] = "eager steps on the CPU (Triton interpreter): a test run, no timings to report"
        ceilings = {"copy_gbs": None, "peak_tflops": {}, "errors": ["no GPU: copy rate not measured"]}
        meta["ceilings"] = ceilings
    log(f"--preset model: {', '.join(config.models)}; variants {', '.join(config.variants)}; batches "
        f"{', '.join(map(str, config.batches))}; copy rate {fmt(ceilings['copy_gbs'], '.0f')} GB/s")
    records: list[dict[str, Any]] = []
    setups: list[dict[str, Any]] = []
    compiles: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    with torch.no_grad():
        for name in config.models:
            records += _run_model(name, config, device, log, setups, compiles)
    meta["wall_s"] = round(time.perf_counter() - t0, 1)
    meta["setup"], meta["compile_check"] = setups, compiles
    derive(records, ceilings["copy_gbs"])
    log(f"done in {meta['wall_s']} s")
    return graphed.make_result(meta, tables(records, setups, compiles)), records
