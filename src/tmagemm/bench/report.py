"""Terminal tables of a :class:`~tmagemm.bench.results.BenchResult` (live run or saved file)."""

from __future__ import annotations

import json
from typing import Any

from .results import CHECKED, OK, BenchResult, shape_key, summary


def _fmt(value: Any, spec: str = ".1f") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


def table(headers: list[str], rows: list[list[str]]) -> str:
    """A plain fixed-width table: text columns left-aligned, everything else right-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    numeric = [all(_looks_numeric(r[i]) for r in rows) and bool(rows) for i in range(len(headers))]

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(cells, widths, numeric)).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), sep, *(line(r) for r in rows)])


def _looks_numeric(cell: str) -> bool:
    return cell == "-" or cell.replace(".", "", 1).replace("x", "", 1).replace("%", "").replace("-", "").isdigit()


def _shape_cell(r: dict[str, Any]) -> str:
    base = f"{r['m']}x{r['n']}x{r['k']}"
    return f"{base} {r['label']}" if r.get("label") else base


def header(result: BenchResult) -> str:
    m = result.metadata
    lines = []
    if m.get("gpu"):
        lines.append(f"{m['gpu']} ({m.get('sm_count')} SMs), driver {m.get('driver')}, CUDA {m.get('torch_cuda')}")
    else:
        lines.append("no GPU: " + (m.get("mode") or "interpreter"))
    lines.append(f"torch {m.get('torch')}, triton {m.get('triton')}, tmagemm {m.get('tmagemm')} ({m.get('git_sha') or 'no git sha'}), {m.get('date')}")
    c = m.get("ceilings") or {}
    if c:
        peaks = ", ".join(f"{d} {v:.0f} TFLOP/s" for d, v in (c.get("peak_tflops") or {}).items())
        lines.append(f"measured ceilings: copy {_fmt(c.get('copy_gbs'), '.0f')} GB/s; cuBLAS peak {peaks or '-'}")
        lines += [f"  ceiling not measured: {e}" for e in c.get("errors") or []]
    if m.get("command"):
        lines.append(f"command: {m['command']}")
    return "\n".join(lines)


def detail_table(result: BenchResult) -> str:
    """One row per (shape, provider); times in microseconds, speedups as peer time / own time."""
    timed = any(r.get("median_us") is not None for r in result.records)
    if not timed:
        headers = ["shape", "dtype", "provider", "status", "max rel err", "tol", "note"]
        rows = [[_shape_cell(r), r["dtype"], r["provider"], r["status"], _fmt(r.get("max_rel_err"), ".2e"),
                 _fmt(r.get("tolerance"), "g"), (r.get("reason") or "")[:70]] for r in result.records]  # fmt: skip
        return table(headers, rows)
    peers = result.peers
    graph = any(r.get("graph_median_us") is not None for r in result.records)
    headers = ["shape", "provider", "status", "us", "p20-p80"] + (["graph us"] if graph else [])
    headers += ["TFLOP/s", "GB/s", "%copy", "%peak", "%roof"] + [f"vs {p}" for p in peers] + ["rel err"]
    rows = []
    previous = None
    for r in sorted(result.records, key=shape_key):
        key = shape_key(r)
        shape_cell = _shape_cell(r) if key != previous else ""
        previous = key
        spread = f"{r['p20_us']:.1f}-{r['p80_us']:.1f}" if r.get("p20_us") is not None else "-"
        row = [shape_cell, r["provider"], r["status"], _fmt(r.get("median_us")), spread]
        if graph:
            row.append(_fmt(r.get("graph_median_us")))
        row += [_fmt(r.get("tflops")), _fmt(r.get("gbps"), ".0f"), _fmt(r.get("pct_copy_bw"), ".0f"),
                _fmt(r.get("pct_peak"), ".0f"), _fmt(r.get("pct_roofline"), ".0f")]  # fmt: skip
        row += [_fmt(r.get(f"speedup_vs_{p}"), ".2f") for p in peers]
        row.append(_fmt(r.get("max_rel_err"), ".1e"))
        rows.append(row)
    return table(headers, rows)


def summary_table(result: BenchResult) -> str:
    """Per provider: shapes that ran correctly, geomean TFLOP/s and geomean speedup per peer."""
    peers = result.peers
    rows = []
    for s in summary(result):
        rows.append([s["provider"], s["family"], f"{s['ok']}/{s['shapes']}", _fmt(s["geomean_tflops"])]
                    + [_fmt(s[f"geomean_vs_{p}"], ".2f") for p in peers])  # fmt: skip
    return table(["provider", "family", "ok", "geomean TFLOP/s"] + [f"vs {p}" for p in peers], rows)


def issues_table(result: BenchResult) -> str:
    """Why providers are absent, unsupported, failed or wrong (one row per distinct reason)."""
    seen: dict[tuple[str, str, str], list[str]] = {}
    for r in result.records:
        if r["status"] in (OK, CHECKED) and not r.get("reason"):
            continue
        seen.setdefault((r["provider"], r["status"], r.get("reason") or ""), []).append(_shape_cell(r))
    rows = []
    for (provider, status, reason), shapes in seen.items():
        where = "all shapes" if len(shapes) == len({shape_key(r) for r in result.records}) else ", ".join(shapes[:3]) + (" ..." if len(shapes) > 3 else "")
        rows.append([provider, status, where, reason[:110]])
    return table(["provider", "status", "shapes", "reason"], rows) if rows else ""


def host_table(result: BenchResult) -> str:
    if not result.host_loop:
        return ""
    rows = [[h["provider"], f"{h['m']}x{h['n']}x{h['k']}", _fmt(h.get("us_per_call")), h.get("reason") or ""]
            for h in result.host_loop]  # fmt: skip
    return table(["provider", "shape", "us/call (loop, 1 sync)", "note"], rows)


def render(result: BenchResult) -> str:
    """The full terminal report."""
    parts = [header(result)] + (["", detail_table(result)] if result.records else [])
    if any(r.get("median_us") is not None for r in result.records):
        parts += ["", "Geometric means over shapes that ran correctly:", summary_table(result)]
    issues = issues_table(result)
    if issues:
        parts += ["", "Not run / not correct:", issues]
    host = host_table(result)
    if host:
        parts += ["", "End-to-end per call (Python loop incl. checks and descriptor creation):", host]
    for name, value in result.extras.items():
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            headers = list(dict.fromkeys(k for v in value for k in v))
            text = table(headers, [[_fmt(v.get(h)) for h in headers] for v in value])
        else:
            text = value if isinstance(value, str) else json.dumps(value, indent=1, default=str)
        parts += ["", f"{name}:", text]
    if result.metadata.get("mode"):
        parts += ["", f"Note: {result.metadata['mode']}."]
    return "\n".join(parts)
