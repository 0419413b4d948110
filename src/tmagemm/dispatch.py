"""The variant registry and the per-call choice of kernel.

Every kernel family (a Triton file under ``tmagemm/triton`` or a native one under
``tmagemm/cuda``) exposes ``VARIANTS``: a list of :class:`Variant`. ``api.py`` validates and
normalises the user's tensors into a :class:`GemmArgs`, then :func:`choose` picks the variant.
The benchmark enumerates the same registry, so every backend it reports is one a user can get.
Backend modules are imported lazily: importing ``tmagemm`` compiles and probes nothing.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch


# Modules that define VARIANTS, in order of preference when several accept a problem.
_BACKEND_MODULES = (
    "tmagemm.triton.matmul_tma",
    "tmagemm.triton.matmul_persistent",
    "tmagemm.triton.matmul_splitk",
    "tmagemm.triton.matmul_ptr",
    "tmagemm.cuda.gemm",
)

BACKENDS = ("auto", "triton", "cuda")


class GemmArgs(NamedTuple):
    """Validated, normalised operands of one GEMM: ``out = (scale_a*scale_b) * (a @ b) + bias``.

    a: (M, K); b: (K, N); out: (M, N), preallocated, written by the kernel.
    scale_a: None, or fp32 with one element (tensor-wise) or M elements 4 bytes apart (row-wise);
        kernels read only its pointer and numel.
    scale_b: None, or fp32 with one element or N elements 4 bytes apart.
    bias: None, or contiguous (N,) in any float dtype; added in fp32.
    (A NamedTuple: it is built on every call, and that costs a fraction of a dataclass.)
    """

    a: torch.Tensor
    b: torch.Tensor
    out: torch.Tensor
    scale_a: torch.Tensor | None = None
    scale_b: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    fast_accum: bool = True  # fp8 only: keep wgmma's reduced-precision accumulation across K tiles

    @property
    def m(self) -> int:
        return self.a.shape[0]

    @property
    def n(self) -> int:
        return self.b.shape[1]

    @property
    def k(self) -> int:
        return self.a.shape[1]

    @property
    def is_fp8(self) -> bool:
        return self.a.element_size() == 1


@dataclass(frozen=True)
class Variant:
    """One callable kernel path.

    ``supports(args)`` returns None when the variant can compute ``args`` correctly, or a short
    reason why not (e.g. "K*itemsize not 16-byte aligned for TMA"). ``run(args)`` writes
    ``args.out`` and never allocates on the host hot path beyond what its cache holds.
    ``prepare(args)``, when given, resolves everything that depends only on the problem's
    shapes, strides, dtypes and alignment (layout flags, config) and returns a launcher for any
    problem with the same signature; :func:`plan` caches it so repeated calls skip that work.
    """

    name: str
    backend: str  # "triton" or "cuda"
    description: str
    supports: Callable[[GemmArgs], str | None]
    run: Callable[[GemmArgs], None]
    prepare: Callable[[GemmArgs], Callable[[GemmArgs], None]] | None = None


_registry: dict[str, Variant] | None = None
_unavailable: dict[str, str] = {}


def _load() -> dict[str, Variant]:
    global _registry
    if _registry is None:
        found: dict[str, Variant] = {}
        for module_name in _BACKEND_MODULES:
            try:
                module = importlib.import_module(module_name)
            except ImportError as exc:  # an optional dependency (e.g. cuda-bindings) is missing
                _unavailable[module_name] = f"{type(exc).__name__}: {exc}"
                continue
            for variant in module.VARIANTS:
                found[variant.name] = variant
        _registry = found
    return _registry


def variants() -> list[Variant]:
    """All registered variants, in preference order."""
    return list(_load().values())


def unavailable() -> dict[str, str]:
    """Backend modules that could not be imported, with the reason."""
    _load()
    return dict(_unavailable)


def get(name: str) -> Variant:
    registry = _load()
    if name not in registry:
        raise ValueError(f"unknown tmagemm variant {name!r}; known: {sorted(registry)}")
    return registry[name]


# Largest M the non-persistent Triton kernel is preferred for (H200, graph-timed vs cuBLAS,
# BENCHMARKS.md): at M = 384-512, N = K = 4096 the native cooperative kernel with 128x128 tiles
# ran at 0.91-0.99x (fp8) and 1.04x (bf16 512) against 0.84-0.91x and 0.90x on Triton; at M = 256
# Triton was ahead (fp8 1.01-1.02x).
MID_M = 256


def _splitk_first(args: GemmArgs) -> bool:
    """Small M where split-K measured ahead of the tile kernel (H200, graph-timed vs cuBLAS fp8;
    scripts/gpu/small_m_pick.py and stream_floor.py, BENCHMARKS.md): fp8 at M <= 16 with K >= 4096
    (N = K = 4096: 0.88-0.92x vs 0.82-0.87x; long-K projections 0.97-1.04x vs 0.73-0.88x; with a
    short K, e.g. K = 512-1536 and N = 24-32K, the tile kernel was ahead), fp8 at M <= 32 with
    K > 8192 (the tile kernel then walks a long K on few CTAs), and any M <= 32 with >= 100 MB of
    weight (earlier H100 sweep)."""
    if args.m <= 32 and args.n * args.k * args.b.element_size() >= 100e6:
        return True
    return args.is_fp8 and ((args.m <= 16 and args.k >= 4096) or (args.m <= 32 and args.k > 8192))


def preference(args: GemmArgs) -> tuple[str, ...]:
    """Variants "auto" tries, best first, from the side-by-side measurements in BENCHMARKS.md.

    A variant is skipped when it is not registered or its supports() refuses the problem; the
    pointer kernel accepts everything.
    - small M (see :func:`_splitk_first`): split-K, whose partial sums keep enough CTAs streaming
      the weight.
    - M <= MID_M (256): the non-persistent Triton kernel with host-encoded tensor maps, launched through
      ``triton/direct.py`` (maps cached per address, so no per-call encode); its device-built-map
      twin ``triton.tma_device`` costs ~2.5 us more GPU time and stays a fallback.
    - larger M: the native persistent cooperative kernel (per-shape config, ``coop_config``), then
      the Triton persistent one.
    """
    tma = ("triton.tma", "triton.tma_device")
    if _splitk_first(args):
        return ("triton.splitk", *tma, "triton.persistent", "triton.ptr")
    if args.m <= MID_M:
        return (*tma, "triton.persistent", "cuda.persistent_coop", "triton.ptr")
    return ("cuda.persistent_coop", "triton.persistent", *tma, "triton.ptr")


def choose(args: GemmArgs, backend: str = "auto") -> Variant:
    """The variant that runs ``args`` for ``backend`` ("auto", "triton" or "cuda")."""
    registry = _load()
    if backend == "auto":
        backend = _env_backend()
    reasons = []
    for name in preference(args):
        variant = registry.get(name)
        if variant is None or (backend != "auto" and variant.backend != backend):
            continue
        reason = variant.supports(args)
        if reason is None:
            return variant
        reasons.append(f"{name}: {reason}")
    # Anything registered for the backend that accepts the problem (e.g. native rungs).
    for variant in registry.values():
        if (backend == "auto" or variant.backend == backend) and variant.supports(args) is None:
            return variant
    missing = unavailable()
    raise ValueError(
        f"no {backend!r} tmagemm kernel accepts this problem (M={args.m}, N={args.n}, K={args.k}, "
        f"a {args.a.dtype} stride {tuple(args.a.stride())}, b {args.b.dtype} stride {tuple(args.b.stride())}); "
        f"refusals: {reasons or 'none'}; modules not importable: {missing or 'none'}. "
        "Use backend='auto' to fall back to the pointer kernel."
    )


_plans: dict[tuple, Callable[[GemmArgs], None]] = {}
# The public API's call key -> planned launcher (api.py fills it; cleared with the plans).
remembered_calls: dict[tuple, Callable] = {}


def _signature(args: GemmArgs, backend: str) -> tuple:
    """Everything the choice of variant, layout flags and config can depend on, except the
    environment knobs, which are read when a signature is first planned (see :func:`plan`)."""
    a, b, out = args.a, args.b, args.out
    sa, sb, bias = args.scale_a, args.scale_b, args.bias
    return (
        backend, out.device,
        a.shape, a.stride(), a.dtype, b.shape, b.stride(), b.dtype, out.stride(), out.dtype,
        a.data_ptr() % 16, b.data_ptr() % 16, out.data_ptr() % 16,
        None if sa is None else (sa.numel(), sa.data_ptr() % 16),
        None if sb is None else (sb.numel(), sb.data_ptr() % 16),
        None if bias is None else (bias.dtype, bias.data_ptr() % 16), args.fast_accum,
    )


def plan(args: GemmArgs, backend: str = "auto") -> Callable[[GemmArgs], None]:
    """A launcher for ``args``, cached per problem signature (host overhead is a measured goal).

    A plan made while a CUDA graph is being captured is not kept: its config may be the
    untuned heuristic, and a later eager call should get the chance to tune. ``TMAGEMM_BACKEND``
    and ``TMAGEMM_AUTOTUNE`` are read when a signature is first planned (reading the environment
    on every call costs microseconds); call :func:`clear_plans` after changing them.
    """
    if args.out.is_cuda and torch.cuda.is_current_stream_capturing():
        # A capture must not tune, and its heuristic plan should not stick: plan afresh.
        variant = choose(args, backend)
        return variant.prepare(args) if variant.prepare is not None else variant.run
    key = _signature(args, backend)
    found = _plans.get(key)
    if found is not None:
        return found
    variant = choose(args, backend)
    launcher = variant.prepare(args) if variant.prepare is not None else variant.run
    _plans[key] = launcher
    return launcher


def clear_plans() -> None:
    """Forget cached plans and the API's remembered calls (after changing tuning state or the
    ``TMAGEMM_*`` knobs in tests or benchmarks)."""
    _plans.clear()
    remembered_calls.clear()


def _env_backend() -> str:
    from .envs import forced_backend

    value = forced_backend() or "auto"
    if value not in BACKENDS:
        raise ValueError(f"TMAGEMM_BACKEND={value!r} is not one of {BACKENDS}")
    return value
