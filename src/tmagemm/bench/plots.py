"""PNG figures of a benchmark result: TFLOP/s per provider (the seed write-ups' figure 1), speedup over
cuBLAS, and a roofline view. Uses matplotlib's Agg backend, so it runs headless."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .providers import main_peer
from .results import OK, BenchResult, shape_key

# Peers drawn dashed so our kernels stand out, as in the seed write-ups' figures.
_PEER_STYLE = {"linestyle": "--", "alpha": 0.8}


def _colors(names) -> dict[str, tuple]:
    """One distinct colour per provider (tab20: a dozen providers stay tellable apart)."""
    palette = _pyplot().get_cmap("tab20").colors
    ordered = list(dict.fromkeys(names))
    return {name: palette[(2 * i) % 20 + (2 * i) // 20 % 2] for i, name in enumerate(ordered)}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _axis(records: list[dict[str, Any]]) -> tuple[str, list[tuple], list[str]]:
    """How to lay shapes on the x axis: "m" (one N, K: an M sweep), "square", or
    "category" (mixed shapes, one tick each). Returns (kind, shape keys in order, tick labels)."""
    keys = sorted({shape_key(r) for r in records})
    nk = {(n, k) for _, n, k, _ in keys}
    if len(nk) == 1 and len(keys) > 1:
        return "m", keys, [str(k[0]) for k in keys]
    if all(m == n == k for m, n, k, _ in keys):
        return "square", keys, [str(k[0]) for k in keys]
    return "category", keys, [f"{lbl} M={m}" if lbl else f"{m}x{n}x{k}" for m, n, k, lbl in keys]


def _series(result: BenchResult, value: str) -> dict[str, dict[tuple, float]]:
    out: dict[str, dict[tuple, float]] = {}
    for r in result.records:
        if r["status"] == OK and r.get(value) is not None:
            out.setdefault(r["provider"], {})[shape_key(r)] = r[value]
    return out


def _families(result: BenchResult) -> dict[str, str]:
    return {r["provider"]: r["family"] for r in result.records}


def _title(result: BenchResult, what: str) -> str:
    m = result.metadata
    dtype = (m.get("config") or {}).get("dtype", "")
    return f"{what} — {dtype} on {m.get('gpu') or 'no GPU'}"


def _line_plot(result: BenchResult, series: dict[str, dict[tuple, float]], ylabel: str, title: str, path: Path,
               hline: float | None = None) -> Path:  # fmt: skip
    plt = _pyplot()
    kind, keys, ticks = _axis(result.records)
    families = _families(result)
    fig, ax = plt.subplots(figsize=(10, 5.5) if kind != "category" else (max(10, 0.45 * len(keys)), 6))
    xs = list(range(len(keys)))
    colors = _colors(result.providers)
    for name, points in series.items():
        idx = [i for i, key in enumerate(keys) if key in points]
        style = _PEER_STYLE if families.get(name) == "peer" else {}
        ax.plot([xs[i] for i in idx], [points[keys[i]] for i in idx], marker="o", markersize=3, label=name,
                color=colors[name], **style)  # fmt: skip
    if hline is not None:
        ax.axhline(hline, color="black", linewidth=0.8)
    ax.set_xticks(xs)
    ax.set_xticklabels(ticks, rotation=0 if kind != "category" else 60, ha="center" if kind != "category" else "right",
                       fontsize=8)  # fmt: skip
    if kind == "m":
        _, n, k, _ = keys[0]
        ax.set_xlabel(f"M (N={n}, K={k})")
    elif kind == "square":
        ax.set_xlabel("M = N = K")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_tflops(result: BenchResult, path: Path) -> Path:
    """TFLOP/s of every provider over the shapes (the seed write-ups' figure 1 for the sweep preset)."""
    return _line_plot(result, _series(result, "tflops"), "TFLOP/s (median, L2 flushed)", _title(result, "GEMM throughput"), path)


def plot_speedup(result: BenchResult, path: Path) -> Path | None:
    """Speedup of each tmagemm provider over the main cuBLAS peer (1.0 = parity)."""
    dtype = (result.metadata.get("config") or {}).get("dtype") or (result.records[0]["dtype"] if result.records else "")
    peer = main_peer(dtype) if main_peer(dtype) in result.peers else (result.peers[0] if result.peers else None)
    if peer is None:
        return None
    key = f"speedup_vs_{peer}"
    families = _families(result)
    series = {name: pts for name, pts in _series(result, key).items() if families.get(name) == "tmagemm"}
    if not series:
        return None
    return _line_plot(result, series, f"speedup over {peer} (x)", _title(result, f"speedup over {peer}"), path, hline=1.0)


def plot_roofline(result: BenchResult, path: Path) -> Path | None:
    """Achieved TFLOP/s against arithmetic intensity, under the measured copy/matmul ceilings."""
    ceilings = result.metadata.get("ceilings") or {}
    copy_gbs = ceilings.get("copy_gbs")
    peaks = ceilings.get("peak_tflops") or {}
    ok = [r for r in result.records if r["status"] == OK and r.get("tflops") and r["bytes"]]
    if not ok or not copy_gbs or not peaks:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 6))
    intensities = [r["flops"] / r["bytes"] for r in ok]
    lo, hi = min(intensities) / 2, max(intensities) * 2
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    for dtype, peak in peaks.items():
        ax.plot(grid, [min(peak, x * copy_gbs / 1e3) for x in grid], color="black", linewidth=1)
        ax.annotate(f"{dtype} cuBLAS peak {peak:.0f}", (hi, peak), ha="right", va="bottom", fontsize=8)
    families = _families(result)
    colors = _colors(result.providers)
    for name in dict.fromkeys(r["provider"] for r in ok):
        mine = [r for r in ok if r["provider"] == name]
        marker = "x" if families.get(name) == "peer" else "o"
        ax.scatter([r["flops"] / r["bytes"] for r in mine], [r["tflops"] for r in mine], s=14, marker=marker,
                   label=name, color=colors[name])  # fmt: skip
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP per compulsory byte)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(_title(result, f"roofline (copy {copy_gbs:.0f} GB/s)"))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_all(result: BenchResult, directory: str | Path) -> list[Path]:
    """Every figure that the result has data for; [] for an untimed (interpreter) result."""
    if not any(r["status"] == OK and r.get("tflops") for r in result.records):
        return []
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    made = [plot_tflops(result, out / "tflops.png"), plot_speedup(result, out / "speedup.png"),
            plot_roofline(result, out / "roofline.png")]  # fmt: skip
    return [p for p in made if p is not None]
