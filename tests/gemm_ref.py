"""Float64 references and checks shared by the GEMM tests."""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn


def reference(a, b, scale_a=None, scale_b=None, bias=None) -> torch.Tensor:
    """(scale_a * scale_b) * (a @ b) + bias in float64 on the CPU, from the exact operand values."""
    r = a.double().cpu() @ b.double().cpu()
    for scale, axis in ((scale_a, 0), (scale_b, 1)):
        if scale is not None:
            s = scale.double().cpu().reshape(-1)
            r = r * (s if s.numel() == 1 else (s[:, None] if axis == 0 else s[None, :]))
    if bias is not None:
        r = r + bias.double().cpu()
    return r


def assert_close(out: torch.Tensor, ref: torch.Tensor, rel: float, what: str = "") -> None:
    """Relative Frobenius error <= rel, every element written (no poison left), and a readable
    failure that names the worst element."""
    got, ref = out.double().cpu(), ref.double().cpu()
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    if got.numel() == 0:
        return
    assert torch.isfinite(got).all(), f"{what}: non-finite output at {torch.nonzero(~torch.isfinite(got))[:5].tolist()}"
    err = (got - ref).norm() / ref.norm().clamp_min(1e-30)
    if err > rel:
        idx = int((got - ref).abs().argmax())
        r, c = divmod(idx, got.shape[1])
        raise AssertionError(
            f"{what}: relative error {err:.3e} > {rel:.1e}; worst at ({r}, {c}): got {got[r, c]:.6g}, want {ref[r, c]:.6g}"
        )


def poisoned(shape, dtype, device) -> torch.Tensor:
    """An output buffer full of NaN, so any element the kernel fails to write shows up."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def fp8_operands(m, n, k, device, a_dtype=FP8):
    """a (M, K) row-major fp8, b = w.t() with w (N, K) row-major, from values exact in fp8."""
    a = (torch.randn(m, k, device=device) * 2).to(a_dtype)
    w = (torch.randn(n, k, device=device) * 2).to(FP8)
    return a, w.t()


# Per-element bounds of check_product: the output's rounding (bf16: 2^-8 relative) and the
# accumulation (fp8 fast accumulation: 2^-10 of sum |a||b|; bf16 products summed in fp32).
OUT_ROUNDING = 2.0**-8
ACCUMULATION = {FP8: 2.0**-10, torch.bfloat16: 2.0**-12}


def check_product(out, a, b, scale_a=None, scale_b=None, what="", accumulation=None) -> None:
    """``out`` against ``(scale_a * scale_b) * (a @ b)`` computed in float64 on the operands'
    device, element by element. A NaN left in a poisoned output (never written) fails."""
    assert out.device == a.device, f"{what}: result on {out.device}, operands on {a.device}"
    a64, b64 = a.double(), b.double()
    ref, size = a64 @ b64, a64.abs() @ b64.abs()
    for scale, axis in ((scale_a, 0), (scale_b, 1)):
        if scale is not None:
            s = scale.double().reshape(-1)
            s = s if s.numel() == 1 else (s[:, None] if axis == 0 else s[None, :])
            ref, size = ref * s, size * s.abs()
    bound = OUT_ROUNDING * ref.abs() + (accumulation or ACCUMULATION[a.dtype]) * size
    bad = ~((out.double() - ref).abs() <= bound)  # NaN compares False
    if bool(bad.any()):
        r, c = bad.nonzero()[0].tolist()
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {out.numel()} elements off; first at ({r}, {c}): got {float(out[r, c]):.6g}, "
            f"want {float(ref[r, c]):.6g} +- {float(bound[r, c]):.3g}"
        )
