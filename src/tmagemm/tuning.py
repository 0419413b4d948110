"""Config selection for the Triton kernels: the heuristic, or a config tuned once per (device,
problem bucket) and cached on disk.

Policy, in order:
1. a config already chosen in this process for the same key;
2. one stored on disk by ``tmagemm tune`` or an earlier process
   (``$TMAGEMM_CACHE_DIR/tuning/<GPU name>-triton<version>.json``);
3. when call-time tuning is enabled (``TMAGEMM_AUTOTUNE=1``, a GPU, and the current stream is
   not being captured into a CUDA graph) time every valid candidate and keep the fastest, if it
   still beats the heuristic by 2% when the two are re-timed in alternation (:func:`pick`);
4. otherwise the kernel's heuristic, which times nothing (the default: no call stalls on timing).
"""

from __future__ import annotations

import json
import os
import re
import statistics
import tempfile
from pathlib import Path
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import triton
import triton.testing
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources, PTXASError

from . import envs
from .configs import TritonGemmConfig
from .plan import GemmArgs

_memory: dict[str, TritonGemmConfig] = {}
_disk_loaded: set[Path] = set()


@dataclass(frozen=True)
class Outcome:
    """One tuning run: the heuristic's and the chosen config's median times (ms) from the same
    alternating rounds (equal when the heuristic won the first pass)."""

    key: str
    heuristic: TritonGemmConfig
    chosen: TritonGemmConfig
    heuristic_ms: float | None
    chosen_ms: float | None


# What tuning did in this process, in order (``tmagemm tune`` reports it).
outcomes: list[Outcome] = []


def bucket_m(m: int) -> int:
    """M rounded up to a power of two: one tuning per bucket, since M varies per batch."""
    return 1 << max(m - 1, 0).bit_length()


def problem_key(variant: str, args: GemmArgs) -> str:
    a, b, out = args.a, args.b, args.out
    layout = f"{'r' if a.stride(1) == 1 else 'c'}{'r' if b.stride(1) == 1 else 'c'}"
    return f"{variant}|{a.dtype}|{b.dtype}|{out.dtype}|{layout}|m{bucket_m(args.m)}|n{args.n}|k{args.k}"


def _cache_file(device: torch.device) -> Path:
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", torch.cuda.get_device_name(device))
    return envs.cache_dir() / "tuning" / f"{name}-triton{triton.__version__}.json"


def _load_disk(path: Path) -> None:
    if path in _disk_loaded or _IGNORE_STORED in _disk_loaded:
        return
    _disk_loaded.add(path)
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    for key, cfg in stored.items():
        try:
            _memory.setdefault(f"{path}|{key}", TritonGemmConfig.from_dict(cfg))
        except TypeError:
            continue  # written by another version of tmagemm: retune


def forget() -> None:
    """Forget every chosen config of this process and ignore the stored ones, so the next
    selection tunes again (``tmagemm tune --retune``)."""
    _memory.clear()
    _disk_loaded.add(_IGNORE_STORED)


# A marker in _disk_loaded: stored configs are not read again in this process.
_IGNORE_STORED = Path("/dev/null/tmagemm-ignore-stored")


def _store_disk(path: Path, key: str, config: TritonGemmConfig) -> None:
    """Merge one entry into the file; write to a temp file and rename so readers never see half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        stored = {}
    stored[key] = config.to_dict()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(stored, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def can_tune(device: torch.device) -> bool:
    return (
        device.type == "cuda"
        and envs.autotune_enabled()
        and not envs.interpret()
        and not torch.cuda.is_current_stream_capturing()
    )


def select(
    variant: str,
    args: GemmArgs,
    candidates: Sequence[TritonGemmConfig],
    heuristic: Callable[[GemmArgs], TritonGemmConfig],
    launch: Callable[[TritonGemmConfig], None],
) -> TritonGemmConfig:
    """The config to run ``args`` with (see the module docstring for the policy)."""
    device = args.out.device
    sizes = (args.a.element_size(), args.b.element_size(), args.out.element_size())
    fallback = heuristic(args).fitted(*sizes)
    if device.type != "cuda" or envs.interpret():
        return fallback
    key = problem_key(variant, args)
    path = _cache_file(device)
    _load_disk(path)
    full_key = f"{path}|{key}"
    found = _memory.get(full_key)
    if found is not None:
        return found
    if not can_tune(device):
        return fallback

    def time_ms(config: TritonGemmConfig) -> float | None:
        try:
            return triton.testing.do_bench(lambda: launch(config), warmup=5, rep=25, return_mode="median")
        except (OutOfResources, PTXASError, CompilationError, RuntimeError):
            return None  # the config does not fit this problem or dtype

    valid = [c for c in dict.fromkeys((fallback, *candidates)) if c.is_valid(*sizes)]
    timings: dict[str, float] = {}
    best = pick(fallback, valid, time_ms, timings)
    outcomes.append(Outcome(key, fallback, best, timings.get("heuristic"), timings.get("chosen")))
    _memory[full_key] = best
    _store_disk(path, key, best)
    return best


# A candidate replaces the heuristic only if it is still at least _MIN_GAIN faster when the two are
# re-timed in alternation. One pass times each candidate once, in order, while clocks drift (the
# heuristic is timed first, on a GPU that may just have been idle), and a 12 us kernel's single
# timing moves by a few percent: on an H200 a one-pass pick ran fp8 M = 64 at 0.85x cuBLAS where
# the heuristic runs at 1.0x.
_CONFIRM_ROUNDS = 3
_MIN_GAIN = 0.02


def pick(
    fallback: TritonGemmConfig,
    candidates: Sequence[TritonGemmConfig],
    time_ms: Callable[[TritonGemmConfig], float | None],
    timings: dict | None = None,
) -> TritonGemmConfig:
    """The fastest of ``candidates`` by ``time_ms`` (None: the config cannot run), confirmed
    against ``fallback`` in alternating rounds; ``fallback`` when nothing beats it clearly.
    ``timings``, when given, receives the "heuristic" and "chosen" times (ms) compared last."""
    timings = {} if timings is None else timings
    timed = {c: ms for c in candidates if (ms := time_ms(c)) is not None}
    if not timed:
        return fallback
    best = min(timed, key=timed.get)
    timings.update(heuristic=timed.get(fallback), chosen=timed[best])
    if best == fallback or fallback not in timed:
        return best
    mine, theirs = [], []
    for _ in range(_CONFIRM_ROUNDS):
        mine.append(time_ms(fallback))
        theirs.append(time_ms(best))
    if None in mine or None in theirs:
        return fallback
    timings.update(heuristic=statistics.median(mine), chosen=statistics.median(theirs))
    if statistics.median(theirs) <= (1.0 - _MIN_GAIN) * statistics.median(mine):
        return best
    timings["chosen"] = timings["heuristic"]
    return fallback
