"""Lazy queries about the CUDA device: capability, SM count, and why a fast path is unavailable."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@functools.lru_cache(maxsize=None)
def sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=None)
def name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def is_hopper(device: torch.device) -> bool:
    return device.type == "cuda" and capability(device.index if device.index is not None else torch.cuda.current_device()) == (9, 0)


def hopper_available() -> str | None:
    """None when a Hopper GPU is usable, otherwise the reason it is not."""
    if not torch.cuda.is_available():
        return "no CUDA device is visible to torch (torch.cuda.is_available() is False)"
    major, minor = capability(torch.cuda.current_device())
    if (major, minor) != (9, 0):
        return f"the current GPU is sm_{major}{minor} ({name(torch.cuda.current_device())}); TMA + WGMMA kernels need sm_90 (H100/H200)"
    return None
