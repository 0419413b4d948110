"""Shared by the presets that time whole CUDA graphs (``decode``, ``moe``): capture, alternating
replay timing, and the result files (their records have their own fields, so they live beside
the common schema, and ``tmagemm report`` prints the preset's tables from ``extras``)."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any, Callable, Sequence

from .results import OK, SCHEMA, BenchResult, error_text


def start_run(preset: str, config, why: str):
    """(device, metadata) a graph-timed preset's run starts from: the current GPU, and the
    environment with the preset's name and config. Without a GPU: RuntimeError, "--preset
    {preset} needs a CUDA GPU: {why}"."""
    import dataclasses

    import torch

    from . import envinfo

    if not torch.cuda.is_available():
        raise RuntimeError(f"--preset {preset} needs a CUDA GPU: {why}")
    meta = envinfo.metadata(config.command)
    meta["preset"] = preset
    meta["config"] = dataclasses.asdict(config)
    return torch.device("cuda", torch.cuda.current_device()), meta


def copy_ceilings(device) -> dict[str, Any]:
    """A graph-timed preset's ``ceilings``: the measured device-to-device copy rate (1 GiB, bytes
    read + written), or why it could not be measured."""
    from .timing import copy_bandwidth_gbs

    ceilings: dict[str, Any] = {"copy_gbs": None, "peak_tflops": {}, "errors": []}
    try:
        ceilings["copy_gbs"] = copy_bandwidth_gbs(device)
    except Exception as exc:
        ceilings["errors"].append(f"copy bandwidth: {error_text(exc)}")
    return ceilings


def fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(headers: list[str], rows: list[list[str]]) -> str:
    from .report import table as text_table

    return text_table(headers, rows)


def issues_table(records: list[dict[str, Any]], where: Callable[[dict[str, Any]], str], shown: int = 3) -> str:
    """Records not ok (or ok with a note), grouped by (provider, status, reason): the first
    ``shown`` places (``where(record)``) of each and how many more; "" when there are none."""
    seen: dict[tuple[str, str, str], list[str]] = {}
    for r in records:
        if r["status"] != OK or r.get("reason"):
            seen.setdefault((r["provider"], r["status"], r.get("reason") or ""), []).append(where(r))
    rows = [[p, s, ", ".join(places[:shown]) + (f" (+{len(places) - shown})" if len(places) > shown else ""),
             reason[:110]] for (p, s, reason), places in seen.items()]  # fmt: skip
    return table(["provider", "status", "where", "reason"], rows) if rows else ""


def finish_tables(preset: str, blocks: dict[str, str], records: list[dict[str, Any]],
                  where: Callable[[dict[str, Any]], str], notes: str, shown: int = 3) -> dict[str, str]:
    """A preset's printed report: its own ``blocks``, then the records that did not run or were
    not correct (:func:`issues_table`, when there are any), then its notes."""
    issues = issues_table(records, where, shown)
    if issues:
        blocks[f"{preset} not run / not correct"] = issues
    blocks[f"{preset} notes"] = notes
    return blocks


def render(result: BenchResult) -> str:
    """The metadata header and the preset's named tables."""
    from .report import header

    parts = [header(result)]
    for name, text in result.extras.items():
        parts += ["", f"{name}:", text if isinstance(text, str) else json.dumps(text, default=str)]
    return "\n".join(parts)


def make_result(metadata: dict[str, Any], tables: dict[str, str]) -> BenchResult:
    """A :class:`BenchResult` whose extras hold the preset's tables (its records are saved beside)."""
    return BenchResult(metadata, records=[], extras=tables)


def save(result: BenchResult, records: list[dict[str, Any]], fields: Sequence[str], preset: str,
         directory: str | Path) -> dict[str, Path]:
    """``results.json`` (the common schema with records [], the preset's records under
    ``preset``), ``results.csv`` (the preset's records, metadata as ``# key: value`` lines) and
    ``table.txt``."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "csv": out / "results.csv", "table": out / "table.txt"}
    payload = {"schema": SCHEMA, "metadata": result.metadata, "records": [], "host_loop": [],
               "extras": result.extras, preset: {"fields": list(fields), "records": records}}  # fmt: skip
    paths["json"].write_text(json.dumps(payload, indent=1, default=str) + "\n")
    with paths["csv"].open("w", newline="") as f:
        for key, value in result.metadata.items():
            f.write(f"# {key}: {json.dumps(value, default=str)}\n")
        writer = csv.DictWriter(f, fieldnames=list(fields), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(records)
    paths["table"].write_text(render(result) + "\n")
    return paths


def capture(call: Callable[[], Any]):
    """Eager warm-up on a side stream, then one CUDA graph of ``call`` (torch's recipe)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        call()
    torch.cuda.synchronize()
    return graph


def _per_run_ms(run: Callable[[], Any]) -> float:
    """A first estimate of one run's GPU time (ms): two runs between events, after a warm one."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    run()
    start.record()
    run()
    run()
    end.record()
    end.synchronize()
    return max(start.elapsed_time(end) / 2, 1e-3)


def _reps(budget_ms: float, rounds: int, per_run_ms: float) -> int:
    return int(min(50, max(2, budget_ms / rounds / per_run_ms)))


def time_graphs(graphs: dict[str, Any], budget_ms: float, flush=None, rounds: int = 4) -> dict[str, list[float]]:
    """Replay times (ms) of each graph, in alternating rounds so drift (clocks, power) hits every
    one alike; ``flush`` (a tensor or None) is zeroed before each replay, outside its events."""
    import torch

    per_replay = {name: _per_run_ms(g.replay) for name, g in graphs.items()}
    times: dict[str, list[float]] = {name: [] for name in graphs}
    for _ in range(rounds):
        for name, g in graphs.items():
            reps = _reps(budget_ms, rounds, per_replay[name])
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
            for s, e in events:
                if flush is not None:
                    flush.zero_()
                s.record()
                g.replay()
                e.record()
            torch.cuda.synchronize()
            times[name] += [s.elapsed_time(e) for s, e in events]
    return times


def replay_quantiles(ms: list[float], per: int = 1) -> tuple[float, float, float]:
    """Median, 20th and 80th percentile of replay times ``ms`` (milliseconds), in microseconds per
    ``per`` (e.g. per layer of a captured stack)."""
    ordered = sorted(ms)
    at = lambda f: 1e3 * ordered[min(len(ordered) - 1, int(f * len(ordered)))] / per  # noqa: E731
    return at(0.5), at(0.2), at(0.8)


def time_calls(calls: dict[str, Callable[[], Any]], budget_ms: float, rounds: int = 4) -> dict[str, list[float]]:
    """Per-call GPU time (ms) of host-launched calls (e.g. compiled steps), in alternating rounds
    of back-to-back calls between two CUDA events (the host runs ahead, so its own time per call
    hides behind the GPU's except on a round's first call)."""
    import torch

    per_call = {name: _per_run_ms(call) for name, call in calls.items()}
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            reps = _reps(budget_ms, rounds, per_call[name])
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                call()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / reps)
    return times
