"""Saved benchmark results: one long-form record per (shape, provider), plus run metadata.

``results.json`` holds everything (metadata, records, host-loop times, extras such as the TMA
copy benchmark); ``results.csv`` holds the records with the metadata as leading ``# key: value``
lines (``pandas.read_csv(path, comment="#")`` reads it). Derived numbers (TFLOP/s, GB/s, % of
ceilings, speedups) are recomputed from the raw times by :func:`derive`, so ``tmagemm report``
renders a saved file exactly as the run did.
"""

from __future__ import annotations

import csv
import json
import math
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCHEMA = 1

# Statuses of a record. Only "ok" records enter speedups and geometric means.
OK, WRONG, UNSUPPORTED, ABSENT, FAILED, CHECKED = "ok", "wrong", "unsupported", "absent", "failed", "checked"


def error_text(exc: BaseException) -> str:
    """The exception's first line plus where it was raised, short enough for a table cell."""
    first = (str(exc).strip().splitlines() or [""])[0][:240]
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {frames[-1].name}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {first}{where}"


BASE_FIELDS = (
    "m", "n", "k", "label", "dtype", "provider", "family", "status", "reason",
    "median_us", "p20_us", "p80_us", "reps", "graph_median_us", "graph_p20_us", "graph_p80_us",
    "max_rel_err", "tolerance", "flops", "bytes",
)  # fmt: skip
DERIVED_FIELDS = ("tflops", "gbps", "pct_copy_bw", "pct_peak", "pct_roofline")


@dataclass
class BenchResult:
    metadata: dict[str, Any]
    records: list[dict[str, Any]] = field(default_factory=list)
    host_loop: list[dict[str, Any]] = field(default_factory=list)
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def peers(self) -> list[str]:
        """Names of the peer providers that appear in the records, in first-seen order."""
        return list(dict.fromkeys(r["provider"] for r in self.records if r["family"] == "peer"))

    @property
    def providers(self) -> list[str]:
        return list(dict.fromkeys(r["provider"] for r in self.records))


def shape_key(record: dict[str, Any]) -> tuple:
    return (record["m"], record["n"], record["k"], record.get("label") or "")


def derive(result: BenchResult) -> BenchResult:
    """Fill the derived columns of every record from its median and the run's ceilings."""
    ceilings = result.metadata.get("ceilings") or {}
    copy_gbs = ceilings.get("copy_gbs")
    peaks = ceilings.get("peak_tflops") or {}
    medians: dict[tuple, dict[str, float]] = {}
    for r in result.records:
        for name in DERIVED_FIELDS:
            r[name] = None
        us = r.get("median_us")
        if us is None or r["status"] != OK or us <= 0:
            continue
        medians.setdefault(shape_key(r), {})[r["provider"]] = us
        r["tflops"] = r["flops"] / (us * 1e-6) / 1e12
        r["gbps"] = r["bytes"] / (us * 1e-6) / 1e9
        peak = peaks.get(r["dtype"])
        if copy_gbs:
            r["pct_copy_bw"] = 100 * r["gbps"] / copy_gbs
        if peak:
            r["pct_peak"] = 100 * r["tflops"] / peak
        if peak and copy_gbs:
            # Roofline: the best a kernel can do at this arithmetic intensity (FLOP per byte).
            attainable = min(peak, r["flops"] / r["bytes"] * copy_gbs / 1e3) if r["bytes"] else peak
            r["pct_roofline"] = 100 * r["tflops"] / attainable
    for r in result.records:
        own = medians.get(shape_key(r), {}).get(r["provider"]) if r["status"] == OK else None
        for peer in result.peers:
            peer_us = medians.get(shape_key(r), {}).get(peer)
            r[f"speedup_vs_{peer}"] = peer_us / own if (own and peer_us and peer != r["provider"]) else None
    return result


def geomean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None and v > 0 and math.isfinite(v)]
    if not values:
        return None
    return math.exp(sum(math.log(v) for v in values) / len(values))


def summary(result: BenchResult) -> list[dict[str, Any]]:
    """Per provider: shapes run ok / total, geomean TFLOP/s, geomean speedup vs each peer."""
    rows = []
    for name in result.providers:
        mine = [r for r in result.records if r["provider"] == name]
        ok = [r for r in mine if r["status"] == OK]
        row = {
            "provider": name,
            "family": mine[0]["family"],
            "ok": len(ok),
            "shapes": len(mine),
            "geomean_tflops": geomean([r.get("tflops") for r in ok]),
        }
        for peer in result.peers:
            row[f"geomean_vs_{peer}"] = geomean([r.get(f"speedup_vs_{peer}") for r in ok])
        problems = sorted({f"{r['status']}: {r.get('reason') or ''}".strip() for r in mine if r["status"] not in (OK, CHECKED)})
        row["issues"] = "; ".join(problems)
        rows.append(row)
    return rows


def _fields(result: BenchResult) -> list[str]:
    return [*BASE_FIELDS, *DERIVED_FIELDS, *(f"speedup_vs_{p}" for p in result.peers)]


def save(result: BenchResult, directory: str | Path) -> dict[str, Path]:
    """Write ``results.json`` and ``results.csv`` under ``directory``; return their paths."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "csv": out / "results.csv"}
    payload = {
        "schema": SCHEMA,
        "metadata": result.metadata,
        "records": result.records,
        "host_loop": result.host_loop,
        "extras": result.extras,
    }
    paths["json"].write_text(json.dumps(payload, indent=1, default=str) + "\n")
    fields = _fields(result)
    with paths["csv"].open("w", newline="") as f:
        for key, value in result.metadata.items():
            f.write(f"# {key}: {json.dumps(value, default=str)}\n")
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(result.records)
    return paths


def load(path: str | Path) -> BenchResult:
    """Read a ``results.json`` (or the directory holding one); raises ValueError if it is not one."""
    p = Path(path)
    if p.is_dir():
        p = p / "results.json"
    if not p.is_file():
        raise ValueError(f"no benchmark result at {p}")
    try:
        payload = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{p} is not valid JSON: {exc}") from exc
    if not isinstance(payload, dict) or payload.get("schema") != SCHEMA or "records" not in payload:
        raise ValueError(f"{p} is not a tmagemm benchmark result (schema {SCHEMA})")
    result = BenchResult(payload["metadata"], payload["records"], payload.get("host_loop", []), payload.get("extras", {}))
    missing = [f for f in ("m", "n", "k", "provider", "family", "status", "flops", "bytes") if result.records and f not in result.records[0]]
    if missing:
        raise ValueError(f"{p}: records lack fields {missing}")
    return derive(result)
