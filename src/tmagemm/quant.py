"""FP8 quantization producing (values, dequantization scale) pairs that ``scaled_mm`` accepts."""

from __future__ import annotations

import torch

from .envs import interpret

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


_GRANULARITIES = ("tensor", "row", "1x128", "128x128")
_SCALE_LAYOUTS = ("row-major", "m-major")


def quantize_fp8(
    x: torch.Tensor,
    granularity: str = "tensor",
    dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    pow2_scale: bool = False,
    check_finite: bool = True,
    scale_layout: str = "row-major",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D float tensor to FP8 with an fp32 dequantization scale (x ~= x_fp8 * scale).

    granularity="tensor": one scale, shape (1, 1). "row": one scale per row, shape (rows, 1).
    "1x128": one scale per row per 128 columns, shape (rows, ceil(cols/128)) (activations of
    block-scaled checkpoints). "128x128": one scale per 128 x 128 block, shape (ceil(rows/128),
    ceil(cols/128)) (their weights; an HF checkpoint's ``weight_scale_inv``). The block
    granularities run one fused kernel that reads x once, "row" one that reads each row twice
    (the second time from L2), on CUDA tensors and under the interpreter
    (``tmagemm.triton.quantize``); "tensor", and "row" on other CPU tensors, run torch ops with
    the same arithmetic. The kernels' fp8 output has its row stride padded to 16 bytes where K is
    not a multiple of 16 (what the GEMMs' TMA loads need).
    For an activation x (M, K) the scale is ``scale_a``; for a weight w (N, K) pass ``w_fp8.t()``
    as ``b`` and ``w_scale.t()`` ((1, N), row) or ``w_scale`` itself (block) as ``scale_b``.
    An all-zero tensor (row, group) gets the smallest positive scale, so it quantizes to zeros.
    pow2_scale (block granularities): scales rounded up to powers of two (UE8M0).
    scale_layout ("1x128"): "row-major" (the default), or "m-major": contiguous along M, the
    column stride M rounded up to 4 (16 bytes). That is DeepGEMM's TMA-aligned layout and, where
    M is a multiple of 4, the outer-dim-major one PyTorch's ``F.scaled_mm`` takes. The native
    block-scaled kernel loads it by TMA: from M = 512 the GEMM ran 2-3.5% faster in geomean than
    with row-major scales (up to 9%), level at M = 192-256 (H100, BENCHMARKS.md); at 128 rows
    and fewer row-major scales are faster (``tmagemm.nn`` switches at that size).

    Raises ValueError when ``x`` holds Inf or NaN: no finite scale represents it, and quantizing
    anyway would give an infinite scale and silently zero the tensor (or row). The message names
    the row (``granularity="row"``) or the first (row, column) holding the value. The check reads
    a flag back from the GPU (a sync); ``check_finite=False`` skips it (a model's forward pass),
    and it is skipped while a CUDA graph is being captured.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"quantize_fp8 expects a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"quantize_fp8 expects a 2-D tensor, got shape {tuple(x.shape)}")
    if not x.is_floating_point() or x.dtype in _FP8_DTYPES:
        raise TypeError(f"quantize_fp8 expects float16/bfloat16/float32 input, got {x.dtype}")
    if dtype not in _FP8_DTYPES:
        raise TypeError(f"dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    if granularity not in _GRANULARITIES:
        raise ValueError(f"granularity must be one of {', '.join(repr(g) for g in _GRANULARITIES)}, got {granularity!r}")
    if scale_layout not in _SCALE_LAYOUTS:
        raise ValueError(f"scale_layout must be one of {', '.join(repr(s) for s in _SCALE_LAYOUTS)}, got {scale_layout!r}")
    if scale_layout != "row-major" and granularity != "1x128":
        raise ValueError(f"scale_layout={scale_layout!r} applies to granularity '1x128' (activations), "
                         f"got {granularity!r}")
    if granularity == "1x128":
        from .triton.quantize import quantize_1x128

        return quantize_1x128(x, dtype, pow2_scale=pow2_scale, check_finite=check_finite,
                              m_major=scale_layout == "m-major")
    if granularity == "128x128":
        from .triton.quantize import quantize_128x128

        return quantize_128x128(x, dtype, pow2_scale=pow2_scale, check_finite=check_finite)
    if pow2_scale:
        raise ValueError("pow2_scale applies to the block granularities ('1x128', '128x128')")
    if granularity == "row" and (x.is_cuda or interpret()):
        from .triton.quantize import quantize_rows

        if x.shape[1] > 1 and x.stride(1) != 1:
            x = x.contiguous()
        q, scale = quantize_rows(x, dtype)
        if check_finite and not _capturing(x) and not bool(torch.isfinite(scale).all()):
            raise ValueError(_non_finite_message(x.float(), scale, granularity))
        return q, scale
    fp8_max = torch.finfo(dtype).max
    xf = x.float()
    if granularity == "tensor":
        amax = xf.abs().amax().reshape(1, 1) if x.numel() else xf.new_zeros(1, 1)
    else:
        amax = xf.abs().amax(dim=1, keepdim=True) if x.shape[1] else xf.new_zeros(x.shape[0], 1)
    if check_finite and not _capturing(x) and not bool(torch.isfinite(amax).all()):
        raise ValueError(_non_finite_message(xf, amax, granularity))
    # Tensor by tensor: torch divides a CUDA tensor by a Python number as a multiplication by its
    # reciprocal, one ulp off the correctly rounded quotient the quantizing kernels (div_rn) and
    # the CPU give.
    scale = (amax / amax.new_full((1, 1), fp8_max)).clamp(min=torch.finfo(torch.float32).tiny)
    x_fp8 = (xf / scale).clamp(-fp8_max, fp8_max).to(dtype)
    return x_fp8, scale


def _capturing(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def _non_finite_message(xf: torch.Tensor, amax: torch.Tensor, granularity: str) -> str:
    """Where the Inf/NaN values of ``xf`` are (only computed once the cheap check failed)."""
    bad = ~torch.isfinite(xf)
    found = (("Inf", bool(xf.isinf().any())), ("NaN", bool(xf.isnan().any())))
    kinds = " and ".join(kind for kind, present in found if present)
    if granularity == "row":
        rows = (~torch.isfinite(amax.flatten())).nonzero().flatten().tolist()
        shown = ", ".join(map(str, rows[:8])) + (f", ... ({len(rows)} rows)" if len(rows) > 8 else "")
        return f"quantize_fp8: x holds {kinds} in row {shown} of {tuple(xf.shape)}; no finite scale represents it"
    row, col = bad.nonzero()[0].tolist()
    return (f"quantize_fp8: x holds {kinds} ({int(bad.sum())} values, the first at row {row}, column {col}) "
            f"of {tuple(xf.shape)}; no finite scale represents it")
