"""GPU timing: L2-flushed event timing, CUDA-graph replay, host-loop time, device ceilings.

Every kernel time is the median (with p20/p80) of many runs, each preceded by zeroing a 256 MB
buffer so that no operand is still in the 50 MB L2 from the previous run; only the call itself
sits between its two CUDA events. Callers warm up first so compilation (and call-time tuning,
when ``TMAGEMM_AUTOTUNE=1`` enables it) is outside timing.

A call whose Python side (checks, descriptor creation, launch) takes longer than the GPU work
queued before it would leave the GPU idle between the start event and the kernel, and the
"kernel time" would be host time. So the GPU is first held in a spin kernel long enough for the
host to enqueue every timed run; the runs then execute back to back, and a run where the host
still fell behind is flagged (``Timing.host_bound``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

FLUSH_BYTES = 256 << 20  # > 5x the H100/H200 L2


@dataclass(frozen=True)
class Timing:
    median_us: float
    p20_us: float
    p80_us: float
    reps: int
    host_bound: bool = False  # the host enqueued slower than the GPU hold: times may include launch work

MAX_HOLD_US = 2e6  # never spin the GPU longer than this per measurement


class Timer:
    """Owns the flush buffer of one device; ``budget_ms`` bounds the timed runs per call."""

    def __init__(self, device: torch.device, budget_ms: float = 200.0, min_reps: int = 10, max_reps: int = 200):
        self.device = device
        self.budget_ms = budget_ms
        self.min_reps = min_reps
        self.max_reps = max_reps
        self._flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device=device)
        self._cycles_per_us = self._calibrate_spin()

    @staticmethod
    def _calibrate_spin() -> float:
        """GPU clock cycles per microsecond of ``torch.cuda._sleep`` (the spin kernel)."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1000)  # load the kernel outside the measurement
        start.record()
        torch.cuda._sleep(2_000_000)
        end.record()
        end.synchronize()
        return 2_000_000 / (start.elapsed_time(end) * 1e3)

    def _estimate(self, run_once: Callable[[], None]) -> tuple[int, float]:
        """(reps that fit the budget, host microseconds to enqueue one flushed run)."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        start.record()
        for _ in range(3):
            self._flush.zero_()
            run_once()
        end.record()
        host_us = (time.perf_counter() - t0) / 3 * 1e6
        end.synchronize()
        per_run_ms = start.elapsed_time(end) / 3
        reps = int(min(self.max_reps, max(self.min_reps, self.budget_ms / max(per_run_ms, 1e-3))))
        return reps, host_us

    def _timed(self, run_once: Callable[[], None]) -> Timing:
        reps, host_us = self._estimate(run_once)
        hold_us = min(MAX_HOLD_US, 1.5 * reps * (host_us + 10.0) + 200.0)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        hold_start, hold_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        hold_start.record()
        torch.cuda._sleep(int(hold_us * self._cycles_per_us))
        hold_end.record()
        t0 = time.perf_counter()
        for i in range(reps):
            self._flush.zero_()
            starts[i].record()
            run_once()
            ends[i].record()
        enqueue_us = (time.perf_counter() - t0) * 1e6
        torch.cuda.synchronize(self.device)
        times_us = np.array([s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)])
        p20, p50, p80 = np.percentile(times_us, [20, 50, 80])
        # The GPU left the spin before the host had queued every run: later runs may have waited on the host.
        host_bound = enqueue_us > hold_start.elapsed_time(hold_end) * 1e3
        return Timing(float(p50), float(p20), float(p80), reps, host_bound)

    def host_us(self, fn: Callable[[], object], calls: int = 400) -> float:
        """Host time per call: ``calls`` back-to-back calls, timed without waiting for the GPU,
        which a spin kernel keeps busy meanwhile (so a full launch queue never stalls the loop and
        the number is the Python + driver cost alone, whatever the kernel time)."""
        for _ in range(5):
            fn()
        torch.cuda.synchronize(self.device)
        torch.cuda._sleep(int(min(MAX_HOLD_US, calls * 200.0) * self._cycles_per_us))
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        per_call = (time.perf_counter() - t0) / calls * 1e6
        torch.cuda.synchronize(self.device)
        return per_call

    def eager(self, fn: Callable[[], object]) -> Timing:
        """Kernel time of ``fn`` launched from Python (includes its host-side launch work only
        where that work is slower than the preceding flush)."""
        return self._timed(fn)

    def graph(self, fn: Callable[[], object]) -> Timing:
        """Time of replaying a CUDA graph that captured one call of ``fn``.

        Raises RuntimeError when ``fn`` cannot be captured (e.g. it synchronises or copies
        from the host during the call).
        """
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # the graph capture recipe: warm up on a side stream
            fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            # Capture on the warm-up stream: state kept per stream (e.g. triton.splitk's workspace)
            # then already exists and nothing is allocated inside the capture.
            with torch.cuda.graph(graph, stream=side):
                fn()
        except Exception as exc:
            raise RuntimeError(f"CUDA graph capture failed: {type(exc).__name__}: {exc}") from exc
        return self._timed(graph.replay)


def host_loop_us(fn: Callable[[], object], calls: int = 200) -> float:
    """Per-call wall time of ``calls`` back-to-back calls with one sync at the end.

    This is the seed write-ups' end-to-end number: it includes Python, argument checks, descriptor
    creation and launch; when the GPU is the slower side it converges to the kernel time.
    """
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def _median_ms(fn: Callable[[], object], reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return float(np.median([s.elapsed_time(e) for s, e in zip(starts, ends)]))


def copy_bandwidth_gbs(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Measured device-to-device copy bandwidth, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 4, dtype=torch.int32, device=device).random_()
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src), reps=20)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def matmul_peak_tflops(dtype: str, device: torch.device, size: int = 8192) -> float:
    """Measured cuBLAS throughput at size^3: torch.matmul for 16-bit, fast-accum _scaled_mm for fp8."""
    if dtype == "fp8":
        a = torch.randn(size, size, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(size, size, device=device).to(torch.float8_e4m3fn).t()
        one = torch.ones(1, device=device)
        ms = _median_ms(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16, use_fast_accum=True), 20)
    else:
        torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float16
        a = torch.randn(size, size, device=device, dtype=torch_dtype)
        b = torch.randn(size, size, device=device, dtype=torch_dtype)
        ms = _median_ms(lambda: torch.matmul(a, b), 20)
    return 2 * size**3 / (ms * 1e-3) / 1e12
