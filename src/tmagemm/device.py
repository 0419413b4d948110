"""Lazy queries about the CUDA device: capability, SM count, and why a fast path is unavailable."""

from __future__ import annotations

import contextlib
import functools

import torch

# Shared memory one block may opt in to on sm_90 (227 KB), shared by every kernel's smem plan.
SM90_SMEM_PER_BLOCK = 232448
# What the interpreter (CPU tensors) pretends to have, so CPU runs take an H100's choices.
H100_SMS = 132


@functools.lru_cache(maxsize=None)
def capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@functools.lru_cache(maxsize=None)
def sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=None)
def name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def sms_of(dev: torch.device, cpu: int = H100_SMS) -> int:
    """SM count of the device a tensor lives on; ``cpu`` for CPU tensors (the interpreter)."""
    if dev.type != "cuda":
        return cpu
    return sm_count(dev.index if dev.index is not None else torch.cuda.current_device())


def on_device(dev: torch.device):
    """A context that makes ``dev`` the current CUDA device when it is not already: planning
    compiles and loads kernels on the current device, and Triton launches on it (a pointer of
    another GPU is refused there). A no-op for CPU tensors."""
    if dev.type != "cuda" or dev.index is None or dev.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(dev.index)


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
