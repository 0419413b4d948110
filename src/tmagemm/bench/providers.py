"""What the benchmark runs: test operands, every tmagemm variant, and the cuBLAS peers.

A :class:`Provider` turns a :class:`Case` (operands of one shape) into a zero-argument call that
writes a preallocated output. Providers that cannot run are never dropped: an import failure
makes them *absent*, a shape their ``supports()`` refuses makes them *unsupported*, and both
reasons end up in the results.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Callable

import torch

from .shapes import Shape

DTYPES = ("fp8", "fp8-block", "bf16", "fp16")

# Largest accepted max|out - ref| / max|ref| per input dtype. The output is rounded once to
# bf16 (up to 2^-8 relative) or fp16 (2^-11); fp8 fast accumulation (wgmma's reduced-precision
# partial sums, cuBLAS's too) adds more: cuBLAS measured 7e-3 at K=4096 on H100, so fp8 allows
# 2e-2 for long K. A kernel that drops a tile or mis-applies a scale misses by O(1).
# Block-scaled fp8 promotes every 128-deep k-block into fp32: only the bf16 rounding remains.
TOLERANCE = {"fp8": 2e-2, "fp8-block": 1e-2, "bf16": 1e-2, "fp16": 2e-3}
BLOCK = 128

FP8 = torch.float8_e4m3fn


class Unsupported(Exception):
    """A provider refuses a shape (the message says why)."""


@dataclass(frozen=True, eq=False)
class Case:
    """Operands of one benchmark problem, laid out as the tmagemm contract expects.

    fp8: a (M, K) row-major e4m3; b (K, N) the ``.t()`` view of a row-major (N, K) weight;
    fp32 dequantization scales, tensor-wise (1,) or row-wise (M,)/(N,); bf16 output.
    fp8-block: the same operands with 1x128 scales of a, (M, ceil(K/128)), and 128x128 scales of
    the weight, (ceil(N/128), ceil(K/128)), both row-major (an HF checkpoint's layout); bf16 output.
    bf16/fp16: a (M, K) and b (K, N) row-major, output in the input dtype.
    ``reference`` is the float64 product including the scales.
    """

    shape: Shape
    dtype: str
    a: torch.Tensor
    b: torch.Tensor
    scale_a: torch.Tensor | None
    scale_b: torch.Tensor | None
    reference: torch.Tensor

    @property
    def out_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.dtype.startswith("fp8") else self.a.dtype

    def empty_out(self) -> torch.Tensor:
        """An output buffer poisoned with NaN, so an unwritten tile fails the accuracy check."""
        m, n = self.shape.m, self.shape.n
        return torch.full((m, n), float("nan"), dtype=self.out_dtype, device=self.a.device)

    @property
    def compulsory_bytes(self) -> int:
        """Bytes every kernel must move at least once: A and B read, C written."""
        s = self.shape
        out_size = torch.empty((), dtype=self.out_dtype).element_size()
        return (s.m * s.k + s.k * s.n) * self.a.element_size() + s.m * s.n * out_size


def make_case(shape: Shape, dtype: str, device: torch.device | str, rowwise: bool = False) -> Case:
    """Fresh random operands (never zeros) and their float64 reference."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    m, n, k = shape.m, shape.n, shape.k
    if dtype == "fp8-block":
        kb, nb = -(-k // BLOCK), -(-n // BLOCK)
        a = torch.randn(m, k, device=device).to(FP8)
        w = torch.randn(n, k, device=device).to(FP8)
        scale_a = torch.rand(m, kb, device=device) + 0.5
        scale_b = torch.rand(nb, kb, device=device) + 0.5
        per_k = torch.arange(k, device=device) // BLOCK
        ref = (a.double() * scale_a.double()[:, per_k]) @ (w.double() * scale_b.double()[
            torch.arange(n, device=device) // BLOCK][:, per_k]).t()
        return Case(shape, dtype, a, w.t(), scale_a, scale_b, ref)
    if dtype == "fp8":
        a = torch.randn(m, k, device=device).to(FP8)
        b = torch.randn(n, k, device=device).to(FP8).t()
        if rowwise:
            scale_a = torch.rand(m, device=device) + 0.5
            scale_b = torch.rand(n, device=device) + 0.5
        else:
            scale_a = torch.rand(1, device=device) + 0.5
            scale_b = torch.rand(1, device=device) + 0.5
    else:
        torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float16
        a = torch.randn(m, k, device=device, dtype=torch_dtype)
        b = torch.randn(k, n, device=device, dtype=torch_dtype)
        scale_a = scale_b = None
    ref = a.double() @ b.double()
    if scale_a is not None:
        ref *= (scale_a.double()[:, None] if rowwise else scale_a.double())
        ref *= (scale_b.double()[None, :] if rowwise else scale_b.double())
    return Case(shape, dtype, a, b, scale_a, scale_b, ref)


def relative_error(out: torch.Tensor, case: Case, out_scale: float = 1.0,
                   reference: torch.Tensor | None = None) -> float:
    """max|out*out_scale - ref| / max|ref| (ref: the case's, or a provider's own); inf when the
    output holds NaN/Inf."""
    if out.numel() == 0:
        return 0.0
    got = out.double() * out_scale
    if not torch.isfinite(got).all():
        return float("inf")
    reference = case.reference if reference is None else reference
    denom = reference.abs().max().item() or 1.0
    return (got - reference).abs().max().item() / denom


@dataclass(frozen=True)
class Prepared:
    """A ready call for one case; ``out_scale`` maps its output onto the reference's scale;
    ``reference``, when set, is what this provider computes instead (a speed peer that runs the
    case's data with other scales, e.g. cuBLAS tensor-wise fp8 next to block-scaled kernels)."""

    call: Callable[[], torch.Tensor]
    out_scale: float = 1.0
    reference: torch.Tensor | None = None


@dataclass(frozen=True)
class Provider:
    """One implementation the benchmark times.

    family: "tmagemm" (our variants and the public API) or "peer" (cuBLAS through torch).
    backend: "api" (tmagemm.auto), "triton" or "cuda" (a variant), "torch" (a peer).
    absent: why the provider cannot run at all here (not installed, not importable), else None.
    prepare(case): returns a :class:`Prepared` or raises :class:`Unsupported`.
    """

    name: str
    family: str
    backend: str
    description: str
    dtypes: tuple[str, ...]
    prepare: Callable[[Case], Prepared] | None = None
    absent: str | None = None


# --------------------------------------------------------------------------------------------
# tmagemm providers
# --------------------------------------------------------------------------------------------


def _variant_provider(variant, fast_accum: bool, config=None) -> Provider:
    """A registered variant with its own choice of config, or with ``config`` forced."""

    def prepare(case: Case) -> Prepared:
        from .. import plan

        out = case.empty_out()
        block = (plan.Scaling.BLOCK_1X128, plan.Scaling.BLOCK_128X128) if case.dtype == "fp8-block" else None
        args = plan.gemm_args(case.a, case.b, out, case.scale_a, case.scale_b, None, fast_accum, block)
        reason = variant.supports(args)
        if reason is not None:
            raise Unsupported(reason)
        # What a user's repeated call gets: the plan built once for the signature.
        try:
            built = plan.build(args, variant=variant.name, config=config)
        except ValueError as exc:  # a forced config that does not fit this problem
            if config is None:
                raise
            raise Unsupported(str(exc)) from None

        def call() -> torch.Tensor:
            built(args)
            return out

        return Prepared(call)

    if config is None:
        return Provider(variant.name, "tmagemm", variant.backend, variant.description, DTYPES, prepare)
    return Provider(f"{variant.name}@{config.label()}", "tmagemm", variant.backend,
                    f"{variant.name} with config {config.label()} (not its heuristic)", DTYPES, prepare)


def _auto_provider(fast_accum: bool) -> Provider:
    """The public API as users call it: ``tmagemm.scaled_mm`` (fp8) / ``tmagemm.matmul``."""
    import tmagemm

    missing = [f for f in ("matmul", "scaled_mm") if not hasattr(tmagemm, f)]
    if missing:
        return Provider("tmagemm.auto", "tmagemm", "api", "public API", DTYPES,
                        absent=f"tmagemm does not export {', '.join(missing)}")  # fmt: skip

    def prepare(case: Case) -> Prepared:
        out = case.empty_out()
        if case.dtype.startswith("fp8"):
            def call() -> torch.Tensor:
                return tmagemm.scaled_mm(case.a, case.b, case.scale_a, case.scale_b, out_dtype=out.dtype,
                                         use_fast_accum=fast_accum, out=out)  # fmt: skip
        else:
            def call() -> torch.Tensor:
                return tmagemm.matmul(case.a, case.b, out=out)
        return Prepared(call)

    return Provider("tmagemm.auto", "tmagemm", "api", "public API: tmagemm.scaled_mm / tmagemm.matmul", DTYPES, prepare)


def tmagemm_providers(fast_accum: bool = True, configs: bool = False) -> list[Provider]:
    """The public API, every registered variant, and an absent entry per unimportable module;
    with ``configs``, also one provider per candidate config of each variant that has them
    (named ``variant@label``, e.g. ``triton.tma@64x128x128s4w4``)."""
    found = [_auto_provider(fast_accum)]
    try:
        from .. import plan

        variants = plan.variants()
        missing = plan.unavailable()
    except Exception as exc:  # the registry itself is broken: say so instead of crashing
        return found + [Provider("tmagemm.variants", "tmagemm", "api", "variant registry", DTYPES,
                                 absent=f"variant registry failed: {type(exc).__name__}: {exc}")]  # fmt: skip
    found += [_variant_provider(v, fast_accum) for v in variants]
    if configs:
        found += [_variant_provider(v, fast_accum, c) for v in variants for c in v.configs]
    for module, reason in missing.items():
        name = module.removeprefix("tmagemm.")
        backend = name.split(".")[0]
        found.append(Provider(f"{name} (module)", "tmagemm", backend, f"variants of {module}", DTYPES, absent=reason))
    return found


# --------------------------------------------------------------------------------------------
# cuBLAS peers through torch
# --------------------------------------------------------------------------------------------


def _cublas_matmul(case: Case) -> Prepared:
    if case.dtype == "fp8":
        raise Unsupported("torch.matmul has no fp8 path; see cublas.fp8")
    out = case.empty_out()

    def call() -> torch.Tensor:
        return torch.matmul(case.a, case.b, out=out)

    return Prepared(call)


def _cublas_fp16_of_fp8(case: Case) -> Prepared:
    """The seed write-ups' comparison: the same e4m3 values as fp16 (exact), cuBLAS fp16 GEMM."""
    if case.dtype != "fp8":
        raise Unsupported("only compared against fp8 runs")
    if case.scale_a.numel() != 1 or case.scale_b.numel() != 1:
        raise Unsupported("row-wise scales: compare against cublas.fp8")
    a16, b16 = case.a.to(torch.float16), case.b.to(torch.float16)
    out = torch.full((case.shape.m, case.shape.n), float("nan"), dtype=torch.float16, device=case.a.device)

    def call() -> torch.Tensor:
        return torch.matmul(a16, b16, out=out)

    return Prepared(call, out_scale=case.scale_a.item() * case.scale_b.item())


def _cublas_fp8(fast_accum: bool) -> Callable[[Case], Prepared]:
    def prepare(case: Case) -> Prepared:
        if case.dtype != "fp8":
            raise Unsupported("fp8 inputs only")
        scale_a, scale_b = case.scale_a, case.scale_b
        if scale_a.numel() != 1:  # torch wants row-wise scales as (M, 1) and (1, N)
            scale_a, scale_b = scale_a[:, None], scale_b[None, :]

        def call() -> torch.Tensor:
            return torch._scaled_mm(case.a, case.b, scale_a, scale_b,
                                    out_dtype=torch.bfloat16, use_fast_accum=fast_accum)  # fmt: skip

        return Prepared(call)

    return prepare


def _cublas_fp8_block(case: Case) -> Prepared:
    """cuBLAS's block scaling through torch.nn.functional.scaled_mm: 1x128 scales outer-dim-major
    (stride (1, M)), 128x128 scales as (KB rounded up to 4, NB) with stride (1, that)."""
    if case.dtype != "fp8-block":
        raise Unsupported("block-scaled fp8 runs only")
    from torch.nn.functional import ScalingType, scaled_mm

    nb, kb = case.scale_b.shape
    kb4 = -(-kb // 4) * 4
    scale_a = case.scale_a.t().contiguous().t()
    padded = torch.ones(nb, kb4, device=case.scale_b.device)
    padded[:, :kb] = case.scale_b
    scale_b = padded.t()

    def call() -> torch.Tensor:
        return scaled_mm(case.a, case.b, scale_a, ScalingType.BlockWise1x128, scale_b, ScalingType.BlockWise128x128,
                         output_dtype=torch.bfloat16)

    return Prepared(call)


def _cublas_fp8_tensorwise(case: Case) -> Prepared:
    """cuBLAS tensor-wise fp8 on a block case's data: the speed a block kernel should approach."""
    if case.dtype != "fp8-block":
        raise Unsupported("block-scaled fp8 runs only (tensor-wise runs: cublas.fp8)")
    one = torch.ones(1, device=case.a.device)

    def call() -> torch.Tensor:
        return torch._scaled_mm(case.a, case.b, one, one, out_dtype=torch.bfloat16, use_fast_accum=True)

    return Prepared(call, reference=case.a.double() @ case.b.double())


def peer_providers() -> list[Provider]:
    scaled_mm_absent = None if hasattr(torch, "_scaled_mm") else f"torch {torch.__version__} has no _scaled_mm"
    block_absent = None
    try:
        from torch.nn.functional import ScalingType, scaled_mm  # noqa: F401
    except ImportError:
        block_absent = f"torch {torch.__version__} has no torch.nn.functional.scaled_mm with ScalingType"
    return [
        Provider("cublas", "peer", "torch", "cuBLAS via torch.matmul", ("bf16", "fp16"), _cublas_matmul),
        Provider("cublas.fp16", "peer", "torch", "cuBLAS fp16 on the fp8 values (exact in fp16)", ("fp8",),
                 _cublas_fp16_of_fp8),  # fmt: skip
        Provider("cublas.fp8", "peer", "torch", "cuBLAS via torch._scaled_mm, fast accumulation", ("fp8",),
                 _cublas_fp8(True), scaled_mm_absent),  # fmt: skip
        Provider("cublas.fp8.exact", "peer", "torch", "cuBLAS via torch._scaled_mm, fp32 accumulation", ("fp8",),
                 _cublas_fp8(False), scaled_mm_absent),  # fmt: skip
        Provider("cublas.fp8.block", "peer", "torch", "cuBLAS block scaling via torch.nn.functional.scaled_mm",
                 ("fp8-block",), _cublas_fp8_block, block_absent),  # fmt: skip
        Provider("cublas.fp8.tensorwise", "peer", "torch", "cuBLAS tensor-wise fp8 on the same data (speed only)",
                 ("fp8-block",), _cublas_fp8_tensorwise, scaled_mm_absent),  # fmt: skip
    ]


def main_peer(dtype: str) -> str:
    """The peer that headline speedups are quoted against."""
    return {"fp8": "cublas.fp8", "fp8-block": "cublas.fp8.block"}.get(dtype, "cublas")


def select(providers: list[Provider], dtype: str, patterns: list[str] | None) -> list[Provider]:
    """Providers for ``dtype`` whose name matches any glob in ``patterns`` (all when None).

    Raises ValueError when a pattern matches nothing, so a typo is not a silently empty run.
    """
    chosen = [p for p in providers if dtype in p.dtypes]
    if not patterns:
        return chosen
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(p.name, pattern) for p in chosen):
            names = ", ".join(p.name for p in chosen)
            raise ValueError(f"--providers {pattern!r} matches none of the {dtype} providers: {names}")
    return [p for p in chosen if any(fnmatch.fnmatchcase(p.name, pat) for pat in patterns)]
