"""Lazy queries about the CUDA device: capability, SM count, memory bandwidth, and why a fast path is
unavailable."""

from __future__ import annotations

import contextlib
import functools

import torch

# Shared memory one block may opt in to on sm_90 (227 KB), shared by every kernel's smem plan.
SM90_SMEM_PER_BLOCK = 232448
# What the interpreter (CPU tensors) pretends to have, so CPU runs take an H100's choices.
H100_SMS = 132


def index_of(dev: torch.device) -> int:
    """The CUDA device index of ``dev`` (``cuda`` without an index: the current device)."""
    return dev.index if dev.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@functools.lru_cache(maxsize=None)
def sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=None)
def name(index: int) -> str:
    return torch.cuda.get_device_name(index)


@functools.lru_cache(maxsize=None)
def memory_bandwidth(index: int) -> float | None:
    """Peak DRAM bandwidth in bytes/s (memory clock x bus width, double data rate), or None where
    torch does not report the two (H100 SXM: 2619 MHz x 5120 bits = 3.35e12)."""
    props = torch.cuda.get_device_properties(index)
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    return 2 * clock_khz * 1e3 * bus_bits / 8 if clock_khz and bus_bits else None


def memory_bandwidth_per_sm(dev: torch.device) -> float | None:
    """Peak DRAM bytes/s per SM of the device a tensor lives on; None for CPU tensors or where
    the bandwidth is not reported."""
    if dev.type != "cuda":
        return None
    index = index_of(dev)
    bandwidth = memory_bandwidth(index)
    return None if bandwidth is None else bandwidth / sm_count(index)


# GPUs with at most this peak DRAM bandwidth per SM (bytes/s) have "slow memory": an H100 SXM
# (3.35 TB/s, 25 GB/s per SM) does, an H200 (4.8 TB/s, 36 GB/s per SM) does not. Heuristics that
# were fitted on both kinds of GPU (the native decode kernel's rules, the grouped kernel's swapped
# tiles) split on it.
SLOW_MEMORY_PER_SM = 30e9


def slow_memory(dev: torch.device) -> bool:
    """Whether the GPU of ``dev`` has at most SLOW_MEMORY_PER_SM of DRAM bandwidth per SM; False
    for CPU tensors and where the bandwidth is not known."""
    per_sm = memory_bandwidth_per_sm(dev)
    return per_sm is not None and per_sm <= SLOW_MEMORY_PER_SM


def sms_of(dev: torch.device, cpu: int = H100_SMS) -> int:
    """SM count of the device a tensor lives on; ``cpu`` for CPU tensors (the interpreter)."""
    if dev.type != "cuda":
        return cpu
    return sm_count(index_of(dev))


def on_device(dev: torch.device):
    """A context that makes ``dev`` the current CUDA device when it is not already: planning
    compiles and loads kernels on the current device, and Triton launches on it (a pointer of
    another GPU is refused there). A no-op for CPU tensors."""
    if dev.type != "cuda" or dev.index is None or dev.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(dev.index)


def is_hopper(device: torch.device) -> bool:
    return device.type == "cuda" and capability(index_of(device)) == (9, 0)


def hopper_available() -> str | None:
    """None when a Hopper GPU is usable, otherwise the reason it is not."""
    if not torch.cuda.is_available():
        return "no CUDA device is visible to torch (torch.cuda.is_available() is False)"
    major, minor = capability(torch.cuda.current_device())
    if (major, minor) != (9, 0):
        return f"the current GPU is sm_{major}{minor} ({name(torch.cuda.current_device())}); TMA + WGMMA kernels need sm_90 (H100/H200)"
    return None
