"""Scratch memory of kernels that need it (split-K's partial sums and per-tile arrival counters),
safe under CUDA-graph capture by design.

Two kinds of memory, with different rules:

* **Partial sums** need no initial value (every slice writes its partial before the last one
  reads them). Eager calls use one buffer per (device, stream), since launches on one stream are
  ordered. A call made while its stream is being captured takes a buffer of exactly its size
  from torch's caching allocator, which inside a capture hands out memory of the graph's own
  pool and keeps it for the graph's replays; the buffer is released when the call returns, so
  neither ``torch.cuda.graph`` nor cudagraph trees (``torch.compile(mode="reduce-overhead")``)
  see a tensor outlive the capture.
* **Arrival counters** must be zero before a launch; the kernel re-arms them itself, so they
  stay zero between launches without a memset. They come in zeroed chunks allocated outside any
  capture. Eager calls hold one chunk per (device, stream); a capture takes one chunk per
  (capture sequence, stream) for good: every split-K launch of that graph uses it, one after
  another, and the graph may be replayed any time later. A chunk is never shared by launches
  that can run at the same time (different streams, or different graphs).

Eager buffers and counter chunks come from the CUDA driver, not torch's caching allocator, so
they never land in a graph's memory pool (cudagraph trees route every allocation made while they
warm up a model into theirs, and would then find a live tensor they did not create). Free
chunks are topped up whenever a plan is built outside capture; a capture that finds none left
zeroes a chunk of its own graph pool inside the graph (correct, one memset node more) and warns.
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch

from .jit.runtime import stream_getter

# Counters per chunk: one per output tile of a launch; the split-K kernel has at most N / 64 tiles.
COUNTERS = 1 << 14
# Smallest eager partial-sum buffer (fp32 elements): every split-K config for M <= 128 on a
# 132-SM part fits, so a stream's buffer is allocated once.
MIN_PARTIALS = 4 << 20
_SPARE_CHUNKS = 8


@dataclass
class Workspace:
    partials: torch.Tensor  # fp32
    counters: torch.Tensor  # int32, zero between launches


@dataclass
class _DeviceState:
    side: torch.cuda.Stream
    spare: list = field(default_factory=list)  # zeroed counter chunks
    eager: dict = field(default_factory=dict)  # stream handle -> Workspace
    captures: dict = field(default_factory=dict)  # (capture id, stream handle) -> counter chunk
    # Outgrown eager buffers: the stream may still have launches in flight that read them.
    retired: list = field(default_factory=list)


_devices: dict[int, _DeviceState] = {}
_lock = threading.Lock()


def _state(index: int) -> _DeviceState:
    state = _devices.get(index)
    if state is None:
        with _lock:
            state = _devices.get(index)
            if state is None:
                state = _devices[index] = _DeviceState(torch.cuda.Stream(device=index))
    return state


class _DriverMemory:
    """Device memory from the CUDA driver, outside torch's caching allocator, shown to torch as an
    array (``__cuda_array_interface__``). Graph memory pools (``torch.cuda.graph``'s and those of
    cudagraph trees, which route every allocation made while they warm up or record) cannot
    claim it, so a workspace made during a compiled model's warm-up neither leaks into nor breaks
    its graphs. Never freed: workspaces live as long as the process."""

    def __init__(self, index: int, numel: int, dtype: torch.dtype):
        from cuda.bindings import driver

        from .jit.runtime import ensure_context

        ensure_context(index)
        result, pointer = driver.cuMemAlloc(max(numel, 1) * dtype.itemsize)
        if result != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"tmagemm workspace: cuMemAlloc of {numel} x {dtype} on cuda:{index} failed: {result.name}")
        typestr = {torch.float32: "<f4", torch.int32: "<i4"}[dtype]
        self.__cuda_array_interface__ = {"shape": (numel,), "typestr": typestr, "data": (int(pointer), False),
                                         "version": 3, "strides": None}


def _tensor(index: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    try:
        return torch.as_tensor(_DriverMemory(index, numel, dtype), device=f"cuda:{index}")
    except ImportError:  # no cuda-bindings: torch's allocator (graph pools may then claim it)
        return torch.empty(numel, dtype=dtype, device=f"cuda:{index}")


def _allocate(state: _DeviceState, index: int, partials: int, chunks: int) -> tuple[torch.Tensor, list]:
    """Outside capture: a partial-sum buffer and zeroed counter chunks, complete before the
    caller's stream uses them (zeroed on the side stream, which is then waited for)."""
    with torch.cuda.device(index), torch.cuda.stream(state.side):
        buffer = _tensor(index, partials, torch.float32) if partials else None
        zeroed = [_tensor(index, COUNTERS, torch.int32).zero_() for _ in range(chunks)]
    state.side.synchronize()
    return buffer, zeroed


def top_up(index: int) -> None:
    """Keep spare counter chunks for captures to come (called when a plan is built, outside
    capture)."""
    state = _state(index)
    missing = _SPARE_CHUNKS - len(state.spare)
    if missing > 0 and not torch.cuda.is_current_stream_capturing():
        state.spare += _allocate(state, index, 0, missing)[1]


def _capture_id(stream: int) -> int | None:
    try:
        from cuda.bindings import driver
    except ImportError:
        return None
    result = driver.cuStreamGetCaptureInfo(driver.CUstream(stream))
    return int(result[2]) if result[0] == driver.CUresult.CUDA_SUCCESS else None


def getter(index: int, partials: int) -> Callable[[], Workspace]:
    """``get()`` -> scratch for one launch on the current stream of device ``index`` (which must
    be the current device when it is called): at least ``partials`` fp32 partial sums and
    :data:`COUNTERS` counters. Binds what is fixed, since it runs on every split-K call."""
    state = _state(index)
    stream_of = stream_getter()
    capturing = torch.cuda.is_current_stream_capturing

    def get() -> Workspace:
        stream = stream_of(index)
        if not capturing():
            found = state.eager.get(stream)
            if found is not None and found.partials.numel() >= partials:
                return found
            return _grow(state, index, stream, found, partials)
        return _for_capture(state, index, stream, partials)

    return get


def get(index: int, partials: int) -> Workspace:
    """One launch's scratch (see :func:`getter`)."""
    return getter(index, partials)()


def for_launch(out: torch.Tensor, partials: int) -> Workspace:
    """Scratch for one launch writing ``out``: :func:`get` on its GPU; under the interpreter
    (CPU tensors) fresh partials and zeroed counters per call."""
    if out.is_cuda:
        return get(out.get_device(), partials)
    return Workspace(torch.empty(max(partials, 1), dtype=torch.float32), torch.zeros(COUNTERS, dtype=torch.int32))


def _for_capture(state: _DeviceState, index: int, stream: int, partials: int) -> Workspace:
    key = (_capture_id(stream), stream)
    counters = state.captures.get(key) if key[0] is not None else None
    if counters is None:
        if state.spare:
            counters = state.spare.pop()
            if key[0] is not None:
                state.captures[key] = counters
        else:
            warnings.warn("tmagemm: no spare split-K counters left for this CUDA-graph capture; zeroing "
                          "them inside the graph (one memset node more). Build plans eagerly before "
                          "capturing to avoid it.", RuntimeWarning, stacklevel=4)
            counters = torch.zeros(COUNTERS, dtype=torch.int32, device=f"cuda:{index}")
    return Workspace(torch.empty(max(partials, 1), dtype=torch.float32, device=f"cuda:{index}"), counters)


def _grow(state: _DeviceState, index: int, stream: int, found: Workspace | None, partials: int) -> Workspace:
    size = max(partials, MIN_PARTIALS, 2 * found.partials.numel() if found is not None else 0)
    if found is not None:
        state.retired.append(found.partials)
        buffer, _ = _allocate(state, index, size, 0)
        counters = found.counters
    else:
        buffer, (counters,) = _allocate(state, index, size, 1)
    workspace = state.eager[stream] = Workspace(buffer, counters)
    return workspace
