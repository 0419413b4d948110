"""NVRTC compilation of the CUDA sources shipped in ``tmagemm/cuda`` with a two-level cache.

The cache key hashes everything that can change the binary: the source file, every header under
``cuda/include``, the defines, the flags, the target architecture and the NVRTC version. Cubins
are kept in memory per process and on disk under ``$TMAGEMM_CACHE_DIR/cubin`` (written to a
temporary file, then renamed, so concurrent processes never read a partial file).
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from tmagemm import envs

CUDA_DIR = Path(__file__).resolve().parent.parent / "cuda"
INCLUDE_DIR = CUDA_DIR / "include"

# Always passed: C++17 for `if constexpr`, line info for profilers, ptxas -v so the log carries
# registers and spills.
BASE_OPTIONS = ("-std=c++17", "-lineinfo", "--ptxas-options=-v")

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class CompileError(RuntimeError):
    """NVRTC rejected a source; the message carries the options and the compiler log."""


@dataclass(eq=False)
class Module:
    """A compiled source: cubin, PTX, compiler log, and its kernels once loaded."""

    source: str
    key: str
    cubin: bytes
    ptx: str
    log: str
    compile_seconds: float  # time spent in compile(): NVRTC on a miss, the disk read on a hit
    cache_hit: bool  # True when the cubin came from the on-disk cache
    options: tuple[str, ...]
    _functions: dict = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def function(self, name: str):
        """The kernel ``name`` (declared ``extern "C" __global__``), loaded into the CUDA context
        of torch's current device on first use."""
        from tmagemm.jit.runtime import load_function

        return load_function(self, name)

    def resource_usage(self, kernel: str | None = None):
        from tmagemm.jit.tools import resource_usage

        return resource_usage(self.cubin, kernel, log=self.log)


@dataclass(frozen=True)
class _Request:
    source: str
    defines: tuple[tuple[str, str], ...]
    arch: str
    flags: tuple[str, ...]


_memory: dict[str, Module] = {}  # cache key -> module
# (source, code digest or None, defines, arch, flags) -> module: skips re-hashing the files on
# every call (headers are fixed for the life of the process; clear_memory_cache() resets both).
_requests: dict[tuple, Module] = {}
_memory_lock = threading.Lock()


def nvrtc_version() -> tuple[int, int]:
    from cuda.bindings import nvrtc

    result, major, minor = nvrtc.nvrtcVersion()
    _check(result, "nvrtcVersion")
    return int(major), int(minor)


def _check(result, what: str) -> None:
    from cuda.bindings import nvrtc

    if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise CompileError(f"{what} failed: {result.name}")


def _source_path(source: str) -> Path:
    path = (CUDA_DIR / source).resolve()
    if CUDA_DIR not in path.parents or not path.is_file():
        raise ValueError(f"CUDA source {source!r} is not a file under {CUDA_DIR}")
    return path


def _headers_digest() -> bytes:
    digest = hashlib.sha256()
    for header in sorted(INCLUDE_DIR.rglob("*")):
        if header.is_file():
            digest.update(str(header.relative_to(INCLUDE_DIR)).encode() + b"\0" + header.read_bytes() + b"\0")
    return digest.digest()


def _normalise(defines: Mapping[str, int | str]) -> tuple[tuple[str, str], ...]:
    out = []
    for name, value in sorted(defines.items()):
        if not isinstance(name, str) or not _IDENT.match(name):
            raise ValueError(f"define name must be a C identifier, got {name!r}")
        if isinstance(value, bool):
            value = int(value)
        if not isinstance(value, (int, str)):
            raise TypeError(f"define {name} must be an int or str, got {type(value).__name__}")
        out.append((name, str(value)))
    return tuple(out)


def _options(request: _Request) -> tuple[str, ...]:
    return (
        f"--gpu-architecture={request.arch}",
        *BASE_OPTIONS,
        f"-I{INCLUDE_DIR}",
        *(f"-D{name}={value}" for name, value in request.defines),
        *request.flags,
    )


def _cache_key(request: _Request, source_bytes: bytes) -> str:
    digest = hashlib.sha256()
    for part in (
        request.source.encode(),
        source_bytes,
        _headers_digest(),
        repr(request.defines).encode(),
        request.arch.encode(),
        repr(request.flags).encode(),
        repr(BASE_OPTIONS).encode(),
        repr(nvrtc_version()).encode(),
    ):
        digest.update(part + b"\0")
    return digest.hexdigest()[:40]


def _disk_dir() -> Path:
    return envs.cache_dir() / "cubin"


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _nvrtc_compile(name: str, code: bytes, options: tuple[str, ...]) -> tuple[bytes, str, str]:
    from cuda.bindings import nvrtc

    result, program = nvrtc.nvrtcCreateProgram(code, name.encode(), 0, [], [])
    _check(result, "nvrtcCreateProgram")
    try:
        encoded = [o.encode() for o in options]
        (compiled,) = nvrtc.nvrtcCompileProgram(program, len(encoded), encoded)
        result, size = nvrtc.nvrtcGetProgramLogSize(program)
        _check(result, "nvrtcGetProgramLogSize")
        log = b" " * size
        _check(nvrtc.nvrtcGetProgramLog(program, log)[0], "nvrtcGetProgramLog")
        log_text = log.rstrip(b"\0 ").decode(errors="replace")
        if compiled != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(
                f"NVRTC failed to compile {name} ({compiled.name}) with options {list(options)}:\n{log_text}"
            )
        result, size = nvrtc.nvrtcGetCUBINSize(program)
        _check(result, "nvrtcGetCUBINSize")
        cubin = b" " * size
        _check(nvrtc.nvrtcGetCUBIN(program, cubin)[0], "nvrtcGetCUBIN")
        result, size = nvrtc.nvrtcGetPTXSize(program)
        _check(result, "nvrtcGetPTXSize")
        ptx = b" " * size
        _check(nvrtc.nvrtcGetPTX(program, ptx)[0], "nvrtcGetPTX")
        return cubin, ptx.rstrip(b"\0").decode(), log_text
    finally:
        nvrtc.nvrtcDestroyProgram(program)


def compile(
    source: str,
    *,
    defines: Mapping[str, int | str] | None = None,
    arch: str = "sm_90a",
    flags: Sequence[str] = (),
) -> Module:
    """Compile ``source`` (a file name under ``tmagemm/cuda``) for ``arch`` with NVRTC.

    Includes resolve from ``tmagemm/cuda/include``; ``defines`` become ``-DNAME=value`` (kernel
    variants are selected this way); ``flags`` are extra NVRTC options. Kernels must be declared
    ``extern "C" __global__``. Results are cached in memory and on disk.
    """
    fast_key = (source, None, tuple(sorted((defines or {}).items())), arch, tuple(flags))
    module = _requests.get(fast_key)
    if module is None:
        module = _compile(source, _source_path(source).read_bytes(), defines, arch, flags)
        _requests[fast_key] = module
    return module


def compile_string(
    code: str,
    *,
    name: str = "kernel.cu",
    defines: Mapping[str, int | str] | None = None,
    arch: str = "sm_90a",
    flags: Sequence[str] = (),
) -> Module:
    """Like :func:`compile` for CUDA C++ given as text (``#include <tmagemm/ptx.cuh>`` works)."""
    if not re.match(r"^[A-Za-z0-9_.-]+$", name):
        raise ValueError(f"name must be a plain file name, got {name!r}")
    return _compile(name, code.encode(), defines, arch, flags)


def _compile(
    source: str, code: bytes, defines: Mapping[str, int | str] | None, arch: str, flags: Sequence[str]
) -> Module:
    if not re.match(r"^sm_\d+[a-z]?$", arch):
        raise ValueError(f"arch must look like 'sm_90a', got {arch!r}")
    request = _Request(source, _normalise(defines or {}), arch, tuple(flags))
    start = time.perf_counter()
    key = _cache_key(request, code)
    with _memory_lock:
        module = _memory.get(key)
    if module is not None:
        return module

    options = _options(request)
    stem = _disk_dir() / f"{Path(source).stem}-{key}"
    cubin_path, ptx_path, log_path = (stem.with_suffix(s) for s in (".cubin", ".ptx", ".log"))
    try:
        # The cubin is written last, so its presence means the other two are complete.
        cubin = cubin_path.read_bytes()
        ptx, log = ptx_path.read_text(), log_path.read_text()
        hit = True
    except OSError:
        cubin, ptx, log = _nvrtc_compile(source, code, options)
        hit = False
        try:
            _atomic_write(ptx_path, ptx.encode())
            _atomic_write(log_path, log.encode())
            _atomic_write(cubin_path, cubin)
        except OSError:
            pass  # an unwritable cache directory costs recompiles, not correctness
    module = Module(source, key, cubin, ptx, log, time.perf_counter() - start, hit, options)
    with _memory_lock:
        return _memory.setdefault(key, module)


def clear_memory_cache() -> None:
    """Forget in-process modules (tests use it to exercise the disk cache)."""
    with _memory_lock:
        _memory.clear()
        _requests.clear()
