"""What machine and software a result came from (``tmagemm env`` and the bench metadata)."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

import tmagemm

_SMI_FIELDS = ("driver_version", "clocks.sm", "clocks.max.sm", "clocks.mem", "clocks.max.mem", "power.limit")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _nvidia_smi(index: int) -> dict[str, str]:
    """Driver version and current/max clocks through a read-only nvidia-smi query."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {}
    cmd = [smi, f"--query-gpu={','.join(_SMI_FIELDS)}", "--format=csv,noheader", "-i", str(index)]
    try:
        line = subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return {}
    values = [v.strip() for v in line.split(",")]
    return dict(zip(_SMI_FIELDS, values)) if len(values) == len(_SMI_FIELDS) else {}


def nvrtc_version() -> str | None:
    try:
        from cuda.bindings import nvrtc
    except ImportError:
        return None
    err, major, minor = nvrtc.nvrtcVersion()
    return f"{major}.{minor}" if int(err) == 0 else None


def git_sha() -> str | None:
    """The commit of the checkout tmagemm is imported from (with ``-dirty`` if modified)."""
    root = Path(tmagemm.__file__).resolve().parents[2]
    if not (root / ".git").exists() or shutil.which("git") is None:
        return None
    try:
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"],
                             capture_output=True, text=True, timeout=10).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (sha + ("-dirty" if dirty else "")) or None


def software() -> dict[str, Any]:
    import triton

    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": triton.__version__,
        "tmagemm": tmagemm.__version__,
        "cuda_bindings": _version("cuda-bindings") or _version("cuda-python"),
        "nvrtc": nvrtc_version(),
        "git_sha": git_sha(),
        "triton_interpret": os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
    }


def gpu(index: int) -> dict[str, Any]:
    props = torch.cuda.get_device_properties(index)
    info = {
        "gpu": props.name,
        "capability": f"{props.major}.{props.minor}",
        "sm_count": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "l2_mib": round(getattr(props, "L2_cache_size", 0) / 2**20, 1) or None,
    }
    smi = _nvidia_smi(index)
    info["driver"] = smi.get("driver_version")
    info["clocks"] = {k: v for k, v in smi.items() if k != "driver_version"} or None
    return info


def metadata(command: str) -> dict[str, Any]:
    """Everything a saved result needs to be compared with another one later."""
    meta: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "host": os.uname().nodename,
    }
    if torch.cuda.is_available():
        meta.update(gpu(torch.cuda.current_device()))
    else:
        meta["gpu"] = None
    meta.update(software())
    return meta


def capabilities() -> list[tuple[str, str]]:
    """(path, "available" or the reason it is not) for every way tmagemm can run a GEMM."""
    from ..device import hopper_available

    rows = []
    hopper = hopper_available()
    rows.append(("Hopper GPU (TMA + WGMMA)", "available" if hopper is None else f"no: {hopper}"))
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401

        triton_tma = "available" if hopper is None else "compiles (AOT), cannot run: no Hopper GPU"
    except ImportError as exc:
        triton_tma = f"no: triton {_version('triton')} lacks host TensorDescriptor ({exc})"
    rows.append(("Triton TMA kernels", triton_tma))
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        rows.append(("Triton interpreter", "on (TRITON_INTERPRET=1): kernels run on the CPU, slowly"))
    nvrtc = nvrtc_version()
    if _version("cuda-bindings") is None and _version("cuda-python") is None:
        native = "no: cuda-bindings is not installed (pip install 'tmagemm[cuda]')"
    elif nvrtc is None:
        native = "no: NVRTC not loadable (pip install nvidia-cuda-nvrtc)"
    else:
        native = f"NVRTC {nvrtc} compiles sm_90a" + ("" if hopper is None else "; cannot run: no Hopper GPU")
    rows.append(("native CUDA kernels", native))

    from ..inspection import cuda_tool

    tool = cuda_tool("cuobjdump")
    rows.append(("SASS inspection (cuobjdump)", tool or "no: cuobjdump not found (ships with triton)"))
    return rows


def registry() -> list[tuple[str, str]]:
    """(variant or module, description or import failure) from the tmagemm registry."""
    from .. import plan

    rows = [(v.name, f"[{v.backend}] {v.description}") for v in plan.variants()]
    rows += [(module, f"not importable: {reason}") for module, reason in plan.unavailable().items()]
    return rows
