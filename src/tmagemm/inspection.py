"""Ahead-of-time compilation for sm_90a and a summary of what the compiler produced.

This is the seed write-ups' PTX analysis as a tool: does the load path use ``cp.async`` (one 16-byte
copy per thread, addresses in registers) or ``cp.async.bulk.tensor`` (TMA: one thread issues a
whole tile through a tensor map)? Does the math use ``wgmma`` (HGMMA/QGMMA in SASS) or the
older ``mma.sync`` fed by ``ldmatrix``? How many registers, how much shared memory, any spills?

Everything here works without a GPU: Triton compiles for ``GPUTarget("cuda", 90, 32)`` on any
host, and the SASS comes from the ``cuobjdump`` that Triton's wheel ships.

Triton kernel modules describe a compilable instance with :class:`KernelSpec` (their
``aot_spec(...)``). Under ``TRITON_INTERPRET=1`` ``@triton.jit`` yields an interpreter object
that cannot be compiled, so :func:`compile_triton` then compiles in a child process with the
interpreter switched off.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import importlib
import importlib.util
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

# Hopper with the arch-specific features (wgmma, setmaxnreg) that sm_90a unlocks.
SM90_TARGET = ("cuda", 90, 32)


@dataclass(frozen=True)
class KernelSpec:
    """One compilable instance of a ``@triton.jit`` kernel.

    signature: every parameter name -> Triton type string: ``"*fp16"``, ``"*fp8e4nv"``, ``"i32"``,
        ``"fp32"``, ``"tensordesc<fp16[128, 64]>"`` (a host TensorDescriptor of that block shape),
        or ``"constexpr"``.
    constexprs: the value of every ``"constexpr"`` parameter.
    attrs: optional ``{param_name: [["tt.divisibility", 16]]}`` hints, as the launcher would
        specialize them (16-byte aligned pointers, strides divisible by 16).
    """

    fn: Any
    signature: Mapping[str, str]
    constexprs: Mapping[str, Any]
    num_warps: int = 4
    num_stages: int = 3
    name: str = ""
    attrs: Mapping[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.name or _python_fn(self.fn).__name__


@dataclass(frozen=True)
class Artifacts:
    """What compiling a kernel produced, plus the resource numbers read from the cubin.

    registers: per thread; shared: bytes of shared memory the launch needs (dynamic + static),
        or only the static part when ``static_shared_only`` (native kernels size it at launch);
    spills: SASS local-memory stores + loads (STL/LDL), 0 for a kernel that fits in registers;
    local_bytes: the per-thread local-memory frame reported by cuobjdump.
    """

    name: str
    ptx: str
    cubin: bytes
    sass: str
    registers: int | None
    shared: int | None
    spills: int | None
    local_bytes: int | None = None
    static_shared_only: bool = False  # native kernels: dynamic shared memory is a launch setting
    launch_metadata: dict = field(default_factory=dict)  # Triton kernels: what its launcher reads

    def summary(self) -> dict[str, Any]:
        return summarize(self)


# --------------------------------------------------------------------------------------------
# Triton AOT
# --------------------------------------------------------------------------------------------

# Triton 3.9 warns, once per process on the first compile, that its FP-fusion default will change
# when TRITON_DEFAULT_FP_FUSION is unset. It says nothing about the kernel being inspected, so the
# inspect command hides exactly that message (matched from its start) and no other warning.
_FP_FUSION_NOTICE = r"TRITON_DEFAULT_FP_FUSION is unset"


@contextlib.contextmanager
def quiet_fp_fusion_notice():
    """Ignore Triton's FP-fusion default notice inside the block; every other warning still shows."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_FP_FUSION_NOTICE, category=UserWarning)
        yield


def _python_fn(fn: Any) -> Any:
    """The plain Python function behind a JITFunction or an InterpretedFunction."""
    return getattr(fn, "fn", fn)


def _is_compilable(fn: Any) -> bool:
    from triton.runtime.jit import JITFunction

    return isinstance(fn, JITFunction)


def compile_triton(spec: KernelSpec) -> Artifacts:
    """Compile ``spec`` for sm_90a and return PTX, cubin, SASS and resource usage.

    Raises ValueError when the signature does not name every parameter of the kernel, and
    RuntimeError (with the compiler's message) when compilation fails.
    """
    py_fn = _python_fn(spec.fn)
    params = list(getattr(spec.fn, "arg_names", None) or py_fn.__code__.co_varnames[: py_fn.__code__.co_argcount])
    missing = [p for p in params if p not in spec.signature]
    extra = [p for p in spec.signature if p not in params]
    if missing or extra:
        raise ValueError(f"KernelSpec for {py_fn.__name__}: signature is missing {missing} / has unknown {extra}")
    unset = [p for p, ty in spec.signature.items() if ty == "constexpr" and p not in spec.constexprs]
    if unset:
        raise ValueError(f"KernelSpec for {py_fn.__name__}: constexpr parameters without a value: {unset}")

    if _is_compilable(spec.fn):
        ptx, cubin, shared, meta = _compile_in_process(spec)
    else:
        ptx, cubin, shared, meta = _compile_in_child(spec)
    return dataclasses.replace(_artifacts(spec.label, ptx, cubin, shared), launch_metadata=meta)


def _compile_in_process(spec: KernelSpec) -> tuple[str, bytes, int, dict]:
    import triton
    from triton.backends.compiler import GPUTarget

    attrs = {(spec.fn.arg_names.index(k),): v for k, v in spec.attrs.items()}
    source = triton.compiler.ASTSource(spec.fn, dict(spec.signature), dict(spec.constexprs), attrs)
    try:
        kernel = triton.compile(
            source,
            target=GPUTarget(*SM90_TARGET),
            options={"num_warps": spec.num_warps, "num_stages": spec.num_stages},
        )
    except Exception as exc:  # surface the compiler's own message with the kernel named
        raise RuntimeError(f"Triton failed to compile {spec.label} for sm_90a: {exc}") from exc
    return kernel.asm["ptx"], kernel.asm["cubin"], int(kernel.metadata.shared), launch_metadata(kernel.metadata)


# Fields of Triton's kernel metadata that decide how the kernel must be launched.
_LAUNCH_FIELDS = ("num_warps", "num_ctas", "shared", "global_scratch_size", "profile_scratch_size",
                  "launch_cooperative_grid", "launch_pdl", "tensordesc_meta")


def launch_metadata(metadata) -> dict[str, Any]:
    """The launch-relevant fields of a compiled Triton kernel's metadata (a namedtuple)."""
    fields = metadata._asdict() if hasattr(metadata, "_asdict") else dict(metadata)
    return {key: fields[key] for key in _LAUNCH_FIELDS if key in fields}


def _compile_in_child(spec: KernelSpec) -> tuple[str, bytes, int, dict]:
    """Re-import the kernel's module with the interpreter off and compile it there."""
    py_fn = _python_fn(spec.fn)
    request = {
        "module": py_fn.__module__,
        "file": getattr(sys.modules.get(py_fn.__module__), "__file__", None),
        "fn": py_fn.__name__,
        "spec": {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.name != "fn"},
    }
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    with tempfile.TemporaryDirectory(prefix="tmagemm-aot-") as tmp:
        req_path, out_path = Path(tmp, "request.pkl"), Path(tmp, "result.pkl")
        req_path.write_bytes(pickle.dumps(request))
        proc = subprocess.run(
            [sys.executable, "-m", "tmagemm.inspection", str(req_path), str(out_path)],
            env=env,
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
            raise RuntimeError(f"AOT compile of {spec.label} failed in a child process:\n" + "\n".join(tail))
        return pickle.loads(out_path.read_bytes())


def _child_main(request_path: str, out_path: str) -> None:
    request = pickle.loads(Path(request_path).read_bytes())
    try:
        module = importlib.import_module(request["module"])
    except ImportError:
        if not request["file"]:
            raise
        loader_spec = importlib.util.spec_from_file_location(request["module"], request["file"])
        module = importlib.util.module_from_spec(loader_spec)
        loader_spec.loader.exec_module(module)
    spec = KernelSpec(fn=getattr(module, request["fn"]), **request["spec"])
    with quiet_fp_fusion_notice():  # its stderr becomes the error message when compiling fails
        compiled = _compile_in_process(spec)
    Path(out_path).write_bytes(pickle.dumps(compiled))


# --------------------------------------------------------------------------------------------
# cubin -> SASS and resource usage
# --------------------------------------------------------------------------------------------


def cuda_tool(name: str) -> str | None:
    """Path of ``cuobjdump``/``nvdisasm``: Triton's bundled copy first, then ``$PATH``."""
    try:
        import triton.backends.nvidia as nv

        bundled = Path(nv.__file__).parent / "bin" / name
        if bundled.is_file() and os.access(bundled, os.X_OK):
            return str(bundled)
    except ImportError:
        pass
    return shutil.which(name)


def _run_cuobjdump(flag: str, cubin: bytes) -> str | None:
    tool = cuda_tool("cuobjdump")
    if tool is None:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        proc = subprocess.run([tool, flag, f.name], capture_output=True, text=True)
    return proc.stdout if proc.returncode == 0 else None


_RES_USAGE = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")


def resource_usage(cubin: bytes) -> dict[str, int] | None:
    """Registers, stack, static shared and local bytes of the first kernel in ``cubin``."""
    text = _run_cuobjdump("-res-usage", cubin)
    match = _RES_USAGE.search(text or "")
    if match is None:
        return None
    reg, stack, shared, local = (int(g) for g in match.groups())
    return {"registers": reg, "stack": stack, "static_shared": shared, "local": local}


def disassemble(cubin: bytes) -> str:
    """SASS of ``cubin`` ("" when no cuobjdump is available)."""
    return _run_cuobjdump("-sass", cubin) or ""


def _artifacts(name: str, ptx: str, cubin: bytes, dynamic_shared: int | None) -> Artifacts:
    sass = disassemble(cubin)
    usage = resource_usage(cubin)
    counts = sass_counts(sass)
    shared = None
    if dynamic_shared is not None or usage is not None:
        # Triton reports the dynamic allocation; cuobjdump the static one. A launch needs both.
        shared = (dynamic_shared or 0) + (usage["static_shared"] if usage else 0)
    return Artifacts(
        name=name,
        ptx=ptx,
        cubin=cubin,
        sass=sass,
        registers=usage["registers"] if usage else None,
        shared=shared,
        spills=(counts["STL"] + counts["LDL"]) if sass else None,
        local_bytes=usage["local"] if usage else None,
        static_shared_only=dynamic_shared is None,
    )


def artifacts_from_binary(name: str, ptx: str, cubin: bytes, shared: int | None = None) -> Artifacts:
    """Artifacts for a kernel compiled elsewhere (e.g. a native kernel from ``tmagemm.jit``)."""
    return _artifacts(name, ptx, cubin, shared)


# --------------------------------------------------------------------------------------------
# Summaries
# --------------------------------------------------------------------------------------------

# PTX instruction families that tell the load/math path apart. Patterns match the opcode only.
PTX_PATTERNS: dict[str, str] = {
    "cp.async (per-thread)": r"cp\.async\.c[ag]\.shared",
    "cp.async.bulk.tensor load": r"cp\.async\.bulk\.tensor\.\dd\.shared::(?:cluster|cta)\.global",
    "cp.async.bulk.tensor store": r"cp\.async\.bulk\.tensor\.\dd\.global\.shared",
    "cp.async.bulk (non-tensor)": r"cp\.async\.bulk\.(?!tensor|commit|wait)",
    "cp.reduce.async.bulk": r"cp\.reduce\.async\.bulk",
    "tma prefetch": r"cp\.async\.bulk\.prefetch\.tensor",
    "wgmma.mma_async": r"wgmma\.mma_async",
    "mma.sync": r"\bmma\.sync",
    "ldmatrix": r"\bldmatrix\.",
    "stmatrix": r"\bstmatrix\.",
    "mbarrier.init": r"mbarrier\.init",
    "mbarrier.arrive": r"mbarrier\.arrive(?!\.expect_tx)",
    "mbarrier.expect_tx": r"mbarrier\.(?:arrive\.)?expect_tx",
    "mbarrier.wait": r"mbarrier\.(?:try_wait|test_wait)",
    "fence.proxy.async": r"fence\.proxy\.async",
    "setmaxnreg": r"setmaxnreg",
    "ld.global": r"\bld\.global",
    "st.global": r"\bst\.global",
}

# SASS opcodes: TMA (UTMALDG/UTMASTG/UTMAPF), cp.async (LDGSTS), tensor cores (HGMMA fp16/bf16
# wgmma, QGMMA fp8 wgmma, HMMA mma.sync), shared-memory matrix moves (LDSM/STSM), mbarrier
# (SYNCS.*), register reallocation (USETMAXREG), global and local (spill) memory.
SASS_OPCODES = (
    "UTMALDG", "UTMASTG", "UTMAPF", "UBLKCP", "LDGSTS", "HGMMA", "QGMMA", "HMMA", "IMMA",
    "LDSM", "STSM", "SYNCS", "USETMAXREG", "LDG", "STG", "LDS", "STS", "LDL", "STL", "BAR",
)  # fmt: skip

_SASS_LINE = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", re.M)


def ptx_counts(ptx: str) -> dict[str, int]:
    """Static occurrences of each :data:`PTX_PATTERNS` family in ``ptx`` (comments skipped)."""
    code = "\n".join(line.split("//", 1)[0] for line in ptx.splitlines())
    return {key: len(re.findall(pattern, code)) for key, pattern in PTX_PATTERNS.items()}


def sass_counts(sass: str) -> dict[str, int]:
    """Static occurrences of each :data:`SASS_OPCODES` base opcode (``HGMMA.64x128x16`` -> HGMMA)."""
    seen = collections.Counter(_SASS_LINE.findall(sass))
    return {op: seen.get(op, 0) for op in SASS_OPCODES}


def summarize(art: Artifacts) -> dict[str, Any]:
    """The numbers that matter, as one flat dict (the ``inspect`` table and its JSON)."""
    ptx = ptx_counts(art.ptx)
    sass = sass_counts(art.sass) if art.sass else {}
    tma = ptx["cp.async.bulk.tensor load"] > 0 or sass.get("UTMALDG", 0) > 0
    cp_async = ptx["cp.async (per-thread)"] > 0 or sass.get("LDGSTS", 0) > 0
    return {
        "kernel": art.name,
        "load path": "TMA" if tma else ("cp.async" if cp_async else "ld.global"),
        "math": "wgmma" if ptx["wgmma.mma_async"] else ("mma.sync" if ptx["mma.sync"] else "none"),
        "registers": art.registers,
        ("static shared bytes" if art.static_shared_only else "shared bytes"): art.shared,
        "local bytes": art.local_bytes,
        "spill instrs (STL+LDL)": art.spills,
        **{f"ptx {k}": v for k, v in ptx.items()},
        **{f"sass {k}": v for k, v in sass.items()},
    }


def write_dumps(art: Artifacts, directory: str | os.PathLike) -> dict[str, Path]:
    """Write ``<name>.ptx``, ``.cubin`` and ``.sass`` under ``directory``; return their paths."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    stem = re.sub(r"[^\w.-]+", "_", art.name)
    paths = {"ptx": out / f"{stem}.ptx", "cubin": out / f"{stem}.cubin", "sass": out / f"{stem}.sass"}
    paths["ptx"].write_text(art.ptx)
    paths["cubin"].write_bytes(art.cubin)
    paths["sass"].write_text(art.sass)
    return paths


# --------------------------------------------------------------------------------------------
# Finding what to compile: a registered variant, or a native source file
# --------------------------------------------------------------------------------------------

# dtype name -> (A dtype, output dtype) as the benchmark and the public API use them.
_DTYPES = {"fp8": ("float8_e4m3fn", "bfloat16"), "bf16": ("bfloat16", "bfloat16"), "fp16": ("float16", "float16")}


def _variant_module(name: str):
    from . import plan

    variant = plan.get(name)  # ValueError listing the known names
    return variant, importlib.import_module(variant.build.__module__)


def triton_spec(name: str, dtype: str = "fp8", config: Mapping[str, Any] | None = None) -> KernelSpec:
    """The :class:`KernelSpec` of Triton variant ``name`` via its module's ``aot_spec``.

    ``config`` overrides fields of ``tmagemm.configs.TritonGemmConfig`` (unnamed fields keep the
    dataclass defaults); None keeps the module's own default config.
    """
    import inspect as pyinspect

    import torch

    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    variant, module = _variant_module(name)
    if variant.backend != "triton":
        raise ValueError(f"{name} is a {variant.backend} variant; inspect it with inspect_native / --cu")
    aot_spec = getattr(module, "aot_spec", None)
    if aot_spec is None:
        raise ValueError(f"{module.__name__} has no aot_spec(); {name} cannot be compiled ahead of time")
    kwargs: dict[str, Any] = {
        "a_dtype": getattr(torch, _DTYPES[dtype][0]),
        "out_dtype": getattr(torch, _DTYPES[dtype][1]),
    }
    if config:
        from .configs import TritonGemmConfig

        unknown = sorted(set(config) - set(TritonGemmConfig.__dataclass_fields__))
        if unknown:
            raise ValueError(f"unknown config fields {unknown}; TritonGemmConfig has {list(TritonGemmConfig.__dataclass_fields__)}")
        kwargs["config"] = TritonGemmConfig(**config)
        grouped_only = kwargs["config"].grouped_only()
        if grouped_only:
            raise ValueError(f"{name}: config has {grouped_only}, which only triton.grouped runs")
    params = pyinspect.signature(aot_spec).parameters
    if "variant" in params:  # one module, several variants (e.g. triton.tma and triton.tma_device)
        kwargs["variant"] = name
    return aot_spec(**kwargs)


def compile_native(source: str, defines: Mapping[str, int | str] | None = None, name: str | None = None) -> Artifacts:
    """Compile a native source under ``tmagemm/cuda`` with ``tmagemm.jit`` (NVRTC, sm_90a)."""
    try:
        from . import jit
    except ImportError as exc:
        raise RuntimeError(f"native kernels need tmagemm.jit and cuda-bindings: {exc}") from exc
    module = jit.compile(source, defines=dict(defines or {}))
    return artifacts_from_binary(name or Path(source).stem, module.ptx, module.cubin)


def native_source(name: str, dtype: str = "fp8") -> tuple[str, dict[str, Any]]:
    """(source file, defines) of native variant ``name`` via its module's ``aot_source``."""
    variant, module = _variant_module(name)
    if variant.backend != "cuda":
        raise ValueError(f"{name} is a {variant.backend} variant; inspect it with triton_spec")
    aot_source = getattr(module, "aot_source", None)
    if aot_source is None:
        raise ValueError(f"{module.__name__} has no aot_source(name, dtype); inspect the .cu file with --cu")
    source, defines = aot_source(name, dtype=dtype)
    return source, dict(defines)


def inspect_variant(name: str, dtype: str = "fp8", config: Mapping[str, Any] | None = None) -> Artifacts:
    """Compile registered variant ``name`` (Triton or native) for sm_90a."""
    from . import plan

    if plan.get(name).backend == "cuda":
        if config:
            raise ValueError("config overrides apply to Triton variants; pass defines for native sources")
        source, defines = native_source(name, dtype)
        return compile_native(source, defines, name)
    return compile_triton(triton_spec(name, dtype, config))


if __name__ == "__main__":  # the child process of _compile_in_child
    _child_main(sys.argv[1], sys.argv[2])
