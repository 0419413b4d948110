"""Every environment knob tmagemm reads, in one place (all share the ``TMAGEMM_`` prefix).

Knobs are read when asked for, not at import, so tests can set them with ``monkeypatch``.
The README lists them.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Root of the on-disk caches (tuned configs, compiled cubins).

    ``TMAGEMM_CACHE_DIR``; default ``$XDG_CACHE_HOME/tmagemm`` or ``~/.cache/tmagemm``.
    """
    explicit = os.environ.get("TMAGEMM_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tmagemm"


def autotune_enabled() -> bool:
    """``TMAGEMM_AUTOTUNE=1`` enables call-time tuning (off by default: a first call at a new
    shape would time every candidate config, a stall of up to seconds in a server; tune offline
    with ``tmagemm tune`` instead, whose on-disk results every process reads)."""
    return os.environ.get("TMAGEMM_AUTOTUNE", "0") not in ("", "0")


def forced_backend() -> str | None:
    """``TMAGEMM_BACKEND=triton|cuda|auto``: default for calls that pass ``backend="auto"``."""
    value = os.environ.get("TMAGEMM_BACKEND", "").strip().lower()
    return value or None


def direct_launch_enabled() -> bool:
    """``TMAGEMM_DIRECT_LAUNCH=0`` keeps Triton's own launcher for Triton kernels (see
    ``tmagemm/triton/launch.py``; on by default: it removes most of the per-call host time)."""
    return os.environ.get("TMAGEMM_DIRECT_LAUNCH", "1") != "0"


def pdl_enabled() -> bool:
    """``TMAGEMM_PDL=0`` launches every kernel without programmatic dependent launch (on by
    default: a GEMM may start, set up and prefetch its weight into L2 while the kernel before it
    in the stream drains; it waits for that kernel before reading anything it may have written)."""
    return os.environ.get("TMAGEMM_PDL", "1") != "0"


def interpret() -> bool:
    """True when Triton kernels run under the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
