"""Inspecting cubins without a GPU: SASS listing and per-kernel resource usage.

Uses the ``cuobjdump`` that ships inside Triton's wheel (``triton/backends/nvidia/bin``), falling
back to one on ``PATH``.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path


@functools.lru_cache(maxsize=1)
def cuobjdump_path() -> str:
    try:
        import triton

        candidate = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        if candidate.is_file():
            return str(candidate)
    except ImportError:
        pass
    found = shutil.which("cuobjdump")
    if found is None:
        raise FileNotFoundError("cuobjdump not found in triton/backends/nvidia/bin nor on PATH")
    return found


def _cuobjdump(cubin: bytes, *options: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "module.cubin")
        with open(path, "wb") as handle:
            handle.write(cubin)
        done = subprocess.run(
            [cuobjdump_path(), *options, path], capture_output=True, text=True, check=False, timeout=120
        )
    if done.returncode != 0:
        raise RuntimeError(f"cuobjdump {' '.join(options)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def sass(cubin: bytes) -> str:
    """The SASS of every kernel in ``cubin`` (``cuobjdump -sass``)."""
    return _cuobjdump(cubin, "-sass")


@dataclass(frozen=True)
class ResourceUsage:
    kernel: str
    registers: int
    shared_bytes: int  # static shared memory
    local_bytes: int  # per-thread local memory (spills, local arrays)
    stack_bytes: int
    spill_stores: int | None = None  # from the ptxas -v log when given
    spill_loads: int | None = None


_RES = re.compile(r"Function (\S+):\s*\n\s*REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")
_SPILL = re.compile(
    r"Function properties for (\S+)\s*\n.*?(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
)


def resource_usage(cubin: bytes, kernel: str | None = None, *, log: str | None = None) -> ResourceUsage:
    """Registers, shared/local/stack bytes of ``kernel`` (the only kernel when None).

    ``log``: the NVRTC log of a compile with ``--ptxas-options=-v`` (Module.log) to add spills.
    """
    found = {m.group(1): m for m in _RES.finditer(_cuobjdump(cubin, "-res-usage"))}
    if kernel is None:
        if len(found) != 1:
            raise ValueError(f"cubin holds kernels {sorted(found)}; name one")
        kernel = next(iter(found))
    if kernel not in found:
        raise ValueError(f"kernel {kernel!r} not in cubin; it holds {sorted(found)}")
    m = found[kernel]
    stores = loads = None
    if log is not None:
        for s in _SPILL.finditer(log):
            if s.group(1).strip("'") == kernel:
                stores, loads = int(s.group(3)), int(s.group(4))
    return ResourceUsage(
        kernel=kernel,
        registers=int(m.group(2)),
        stack_bytes=int(m.group(3)),
        shared_bytes=int(m.group(4)),
        local_bytes=int(m.group(5)),
        spill_stores=stores,
        spill_loads=loads,
    )
