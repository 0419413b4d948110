"""Compile and tune ahead of time, so no user call stalls: ``tmagemm.warmup`` and ``tmagemm tune``.

A server's batch size (M) changes from step to step. Every kernel takes M at run time (no binary
is specialised on it), and the heuristics choose configs per M *bucket*, so the binaries a weight
shape can need are those of one representative M per bucket (:func:`m_buckets`). ``warmup``
plans (and so compiles and loads) each of them once, at start-up; a later first call at any M
only builds its plan from what is already compiled and loaded (about a millisecond). Compiled
artefacts persist on disk (Triton's cache and tmagemm's NVRTC cubins under
``$TMAGEMM_CACHE_DIR``), so a second process warms up without compiling.

``tune`` times the Triton kernels' candidate configs for each bucket, offline, and stores the
winners where every later process reads them (``tmagemm.tuning``); call-time tuning is off
unless ``TMAGEMM_AUTOTUNE=1``.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

from . import api, plan, tuning
from .plan import MID_M

_FP8 = torch.float8_e4m3fn


def m_buckets(max_m: int) -> list[int]:
    """One M per bucket the dispatcher and the heuristics distinguish, up to ``max_m``: both ends of
    every power-of-two range (tuning buckets, split-K tiles), of every 64 rows up to MID_M (the
    small-M Triton tiles) and of every 128 rows up to 1024 (native tile counts)."""
    values = {1}
    power = 2
    while power // 2 < max_m:
        values.update((power // 2 + 1, power))
        power *= 2
    values.update(m + d for m in range(64, MID_M + 1, 64) for d in (0, 1))
    values.update(m + d for m in range(128, 1025, 128) for d in (0, 1))
    return sorted(v for v in values if 1 <= v <= max_m)


@dataclass
class Summary:
    """What a warm-up or tuning run did."""

    calls: int = 0
    seconds: float = 0.0
    slowest: list = field(default_factory=list)  # (seconds, description) of the slowest steps
    outcomes: list = field(default_factory=list)  # tuning.Outcome of each tuned bucket

    def line(self) -> str:
        slow = ", ".join(f"{what} {s:.2f} s" for s, what in sorted(self.slowest, reverse=True)[:3])
        return f"{self.calls} calls planned in {self.seconds:.1f} s" + (f"; slowest: {slow}" if slow else "")


def _shapes(shapes: Iterable) -> list[tuple[int, int]]:
    out = []
    for shape in shapes:
        try:
            n, k = (int(v) for v in shape)
        except (TypeError, ValueError):
            raise ValueError(f"shapes must be (N, K) pairs of ints (the weight's shape), got {shape!r}") from None
        if n < 1 or k < 1:
            raise ValueError(f"shapes must be positive (N, K) pairs, got {(n, k)}")
        out.append((n, k))
    return out


def _check_dtype(dtype: str) -> None:
    if dtype not in ("fp8", "bf16", "fp16"):
        raise ValueError(f"dtypes must be 'fp8', 'bf16' or 'fp16', got {dtype!r}")


_SCALES = ("tensor", "row", "block")


def _fp8_scales(scale: str, m: int, n: int, k: int, device):
    """Scales of one fp8 recipe, shaped as a model passes them (values do not matter here)."""
    if scale == "row":
        return torch.ones(m, 1, device=device), torch.ones(1, n, device=device)
    if scale == "block":  # 1x128 activations, 128x128 weight blocks (an HF checkpoint's layout)
        kb, nb = -(-k // 128), -(-n // 128)
        return torch.ones(m, kb, device=device), torch.ones(nb, kb, device=device)
    return torch.ones(1, device=device), torch.ones(1, device=device)


def _run_all(shapes, dtypes, m_values, scales, out_dtype, use_fast_accum, bias, device, progress, what,
             b_k_major: bool = True) -> Summary:
    shapes = _shapes(shapes)
    for dtype in dtypes:
        _check_dtype(dtype)
    for scale in scales:
        if scale not in _SCALES:
            raise ValueError(f"scales must be among {', '.join(repr(s) for s in _SCALES)}, got {scale!r}")
    device = torch.device(device if device is not None else "cuda")
    if device.type != "cuda":
        raise ValueError(f"device must be a CUDA device, got {device}")
    if not torch.cuda.is_available():
        raise RuntimeError(f"{what} needs a CUDA GPU: it compiles (and tune times) kernels on it")
    m_values = sorted(set(int(m) for m in m_values))
    if not m_values or m_values[0] < 1:
        raise ValueError(f"M values must be positive, got {m_values}")
    steps = [(n, k, dtype, scale if dtype == "fp8" else None)
             for n, k in shapes for dtype in dtypes for scale in (scales if dtype == "fp8" else ("none",))]
    total = len(steps) * len(m_values)
    summary, started, done = Summary(), time.perf_counter(), 0
    max_m = m_values[-1]
    with torch.cuda.device(device), torch.no_grad():
        for n, k, dtype, scale in steps:
            half = torch.bfloat16 if dtype == "bf16" else torch.float16
            a_all = torch.randn(max_m, k, device=device).to(_FP8 if dtype == "fp8" else half)
            w = torch.randn(n, k, device=device).to(_FP8 if dtype == "fp8" else half)
            # fp8 reads B K-major always; 16-bit B as the model holds it: w.t() of an nn.Linear
            # weight (K-major, the default) or a row-major (K, N) matrix.
            b = w.t() if dtype == "fp8" or b_k_major else w.t().contiguous()
            bias_t = torch.randn(n, device=device, dtype=out_dtype) if bias else None
            for m in m_values:
                a = a_all[:m]
                t0 = time.perf_counter()
                if dtype == "fp8":
                    sa, sb = _fp8_scales(scale, m, n, k, device)
                    api.scaled_mm(a, b, sa, sb, bias=bias_t, out_dtype=out_dtype, use_fast_accum=use_fast_accum)
                else:
                    api.matmul(a, b, out_dtype=out_dtype)
                torch.cuda.synchronize(device)
                spent = time.perf_counter() - t0
                done += 1
                summary.calls += 1
                label = f"N={n} K={k} {dtype}{'/' + scale if scale else ''} M={m}"
                summary.slowest = sorted(summary.slowest + [(spent, label)], reverse=True)[:5]
                if progress:
                    print(f"\r{what} [{done}/{total}] {label:<48} {time.perf_counter() - started:6.1f} s",
                          end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    # Compiling leaves many reference cycles behind; collect them here, at start-up, instead of
    # in a full collection during one of the first requests (~100 ms in a fresh process).
    gc.collect()
    summary.seconds = time.perf_counter() - started
    return summary


def warmup(
    shapes: Sequence[tuple[int, int]],
    *,
    dtypes: Sequence[str] = ("fp8",),
    max_m: int = 8192,
    m_values: Sequence[int] | None = None,
    scales: Sequence[str] = ("row",),
    out_dtype: torch.dtype = torch.bfloat16,
    use_fast_accum: bool = True,
    bias: bool = False,
    device: torch.device | str | int | None = None,
    progress: bool = True,
    b_k_major: bool = True,
) -> Summary:
    """Compile and load every kernel the given weight shapes can pick, for every M up to ``max_m``.

    shapes: (N, K) of each weight (``nn.Linear(K, N)``), planned as the model calls it:
    ``scaled_mm(x, w.t(), ...)`` (fp8) and ``matmul(x, w.t())`` (bf16/fp16; ``b_k_major=False``:
    ``matmul(x, w_kn)`` with a row-major (K, N) matrix instead, a different binary). dtypes: any
    of "fp8", "bf16", "fp16". scales: the fp8 scalings the model uses ("tensor", "row", "block" =
    1x128 activations x 128x128 weight blocks; each is its own binary), with ``out_dtype``,
    ``use_fast_accum`` and ``bias`` as the model calls them. m_values: the M values to plan
    (default: :func:`m_buckets` of ``max_m``). Prints progress to stderr unless ``progress`` is
    False; returns a :class:`Summary`.
    """
    if m_values is None:
        m_values = m_buckets(max_m)
    return _run_all(shapes, dtypes, m_values, scales, out_dtype, use_fast_accum, bias, device, progress, "warmup",
                    b_k_major)


def tune(
    shapes: Sequence[tuple[int, int]],
    *,
    dtypes: Sequence[str] = ("fp8",),
    max_m: int = 8192,
    scales: Sequence[str] = ("row",),
    out_dtype: torch.dtype = torch.bfloat16,
    use_fast_accum: bool = True,
    device: torch.device | str | int | None = None,
    progress: bool = True,
    retune: bool = False,
) -> Summary:
    """Tune the Triton kernels' configs for each power-of-two M bucket up to ``max_m`` and store
    the winners on disk (``$TMAGEMM_CACHE_DIR/tuning``), where every later process reads them.
    A tuned config replaces the heuristic only if it is still 2% faster when the two are re-timed
    in alternation; ``Summary.outcomes`` holds both times for every bucket tuned (buckets whose
    kernel is not a tunable Triton kernel keep their heuristic and are not listed; buckets tuned
    before keep their stored config unless ``retune``)."""
    previous = os.environ.get("TMAGEMM_AUTOTUNE")
    first = len(tuning.outcomes)
    os.environ["TMAGEMM_AUTOTUNE"] = "1"
    plan.clear_plans()
    if retune:
        tuning.forget()
    try:
        powers = sorted({1 << i for i in range(max_m.bit_length()) if 1 << i <= max_m})
        summary = _run_all(shapes, dtypes, powers, scales, out_dtype, use_fast_accum, False, device, progress, "tune")
    finally:
        if previous is None:
            os.environ.pop("TMAGEMM_AUTOTUNE", None)
        else:
            os.environ["TMAGEMM_AUTOTUNE"] = previous
        plan.clear_plans()  # later calls plan again, reading the stored configs
    summary.outcomes = tuning.outcomes[first:]
    return summary
