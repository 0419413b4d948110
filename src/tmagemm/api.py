"""Public GEMMs: argument checks, then the plan layer (``plan.py``).

``matmul`` and ``scaled_mm`` check everything that can be checked from shapes, strides and
dtypes (this also runs while torch.compile traces), then run the planned kernel directly in
eager mode (lowest host overhead) or through the registered torch ops (``ops.py``) when compiling.
A call whose signature was seen before skips the checks and the planning (``plan.cached``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import device, envs
from .plan import BACKENDS, Scaling, cached, call_key, run_gemm

_FP8_A = (torch.float8_e4m3fn, torch.float8_e5m2)
_FP8_B = (torch.float8_e4m3fn,)
_HALF = (torch.bfloat16, torch.float16)
_OUT = (torch.bfloat16, torch.float16, torch.float32)


# ---------------------------------------------------------------------------------- checks


def _check_tensor(t, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def _check_2d(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"a and b must be 2-D, got a {tuple(a.shape)} and b {tuple(b.shape)}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(
            f"inner dimensions differ: a is {tuple(a.shape)} (M, K) but b is {tuple(b.shape)} (K, N); "
            f"a.shape[1] ({a.shape[1]}) must equal b.shape[0] ({b.shape[0]})"
        )


def _check_out_dtype(out_dtype: torch.dtype) -> None:
    if out_dtype not in _OUT:
        raise TypeError(f"out_dtype must be one of torch.bfloat16, torch.float16, torch.float32; got {out_dtype}")


def _check_out(out: torch.Tensor | None, m: int, n: int, out_dtype: torch.dtype, dev: torch.device) -> None:
    if out is None:
        return
    _check_tensor(out, "out")
    if tuple(out.shape) != (m, n):
        raise ValueError(f"out has shape {tuple(out.shape)} but the result is ({m}, {n})")
    if out.dtype != out_dtype:
        raise TypeError(f"out has dtype {out.dtype} but out_dtype is {out_dtype}")
    if out.device != dev:
        raise ValueError(f"out is on {out.device} but the inputs are on {dev}")


def _check_devices(tensors: dict[str, torch.Tensor | None]) -> torch.device:
    dev = None
    for name, t in tensors.items():
        if t is None:
            continue
        if dev is None:
            dev = t.device
        elif t.device != dev:
            first = next(k for k, v in tensors.items() if v is not None)
            raise ValueError(
                f"{name} is on {t.device} but {first} is on {dev}; move all tensors to one device (a CUDA "
                "device; the CPU only under the Triton interpreter, TRITON_INTERPRET=1)"
            )
    return dev


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def check_runtime_device(dev: torch.device, dtype: torch.dtype) -> None:
    """Device checks that need the CUDA runtime or the environment (done at run time, not while
    tracing)."""
    if dev.type == "cuda":
        index = device.index_of(dev)
        major, minor = device.capability(index)
        if (major, minor) != (9, 0):
            raise ValueError(
                f"tensors are on {dev} ({device.name(index)}, sm_{major}{minor}); tmagemm's kernels need a "
                "Hopper GPU (sm_90: H100/H200)"
            )
    elif not envs.interpret():
        raise ValueError(
            f"tensors are on {dev}; tmagemm needs CUDA tensors on a Hopper GPU "
            "(CPU tensors run only under the Triton interpreter, TRITON_INTERPRET=1, for testing)"
        )
    elif dtype == torch.bfloat16:
        raise ValueError(
            "bfloat16 inputs on the CPU: the Triton interpreter computes bf16 tl.dot wrongly, so tmagemm "
            "refuses instead of returning garbage; test with float16 (or fp8) on the CPU, bf16 on a GPU"
        )


_RECIPES = {"tensor": "tensor", "row": "row", "1x128": "1x128", "128x128": "128x128",
            "TensorWise": "tensor", "RowWise": "row", "BlockWise1x128": "1x128", "BlockWise128x128": "128x128"}
BLOCK = 128  # the block-scaled recipes' block edge


def parse_recipe(value, name: str) -> str | None:
    """A scaling recipe keyword: None, one of "tensor", "row", "1x128", "128x128", or the
    matching member of torch's ``ScalingType`` (``TensorWise``, ``RowWise``, ``BlockWise1x128``,
    ``BlockWise128x128``)."""
    if value is None:
        return None
    key = value if isinstance(value, str) else getattr(value, "name", None)
    if key not in _RECIPES:
        raise ValueError(f"{name} must be 'tensor', 'row', '1x128' or '128x128' (or torch's ScalingType "
                         f"TensorWise / RowWise / BlockWise1x128 / BlockWise128x128), got {value!r}")
    return _RECIPES[key]


def _scale_tensor(scale, name: str) -> None:
    _check_tensor(scale, name)
    if scale.dtype != torch.float32:
        raise TypeError(f"{name} must be float32 (a dequantization scale), got {scale.dtype}")
    if scale.dim() > 2:
        raise ValueError(f"{name} must have at most 2 dimensions, got shape {tuple(scale.shape)}")


def pick_recipe(name: str, shape: tuple, fits: dict, wanted: str | None, expected) -> str:
    """The recipe of a scale: the one asked for, which must fit its shape, or else the first that
    fits (the candidates that can all fit one shape describe the same product). ``expected()``
    names the shapes for an error message; it is only called then, since formatting a size
    while torch.compile traces would specialise the graph on it."""
    if wanted is not None:
        if wanted not in fits:
            raise ValueError(f"{name}: the {wanted} recipe does not apply to this operand; "
                             f"use one of {', '.join(repr(r) for r in fits)}")
        if not fits[wanted]:
            raise ValueError(f"{name} has shape {shape}; the {wanted} recipe expects {expected()[wanted]}")
        return wanted
    for recipe, ok in fits.items():
        if ok:
            return recipe
    options = "; ".join(f"{recipe}: {text}" for recipe, text in expected().items())
    raise ValueError(f"{name} has shape {shape}; expected {options}")


@dataclass(frozen=True)
class ScaleLayout:
    """How the two scales of a call apply (resolved from their shapes and the recipe keywords)."""

    a: str  # "tensor", "row" or "1x128"
    b: str  # "tensor", "row", "1x128" or "128x128"
    b_k_first: bool  # b's block scales given as (k-blocks, N or N/128) (PyTorch's orientation)

    @property
    def is_block(self) -> bool:
        return self.a == "1x128" or self.b in ("1x128", "128x128")


def scale_layout(scale_a, scale_b, m: int, n: int, k: int, recipe_a=None, recipe_b=None) -> ScaleLayout:
    """Resolve the scaling of ``scale_mm``'s operands, or raise ValueError naming the shapes the
    recipes expect.

    scale_a: one element (tensor-wise), (M, 1) or (M,) (row-wise), or (M, KB) (1x128: one per row
    per 128-deep k-block; KB = ceil(K/128)). scale_b: one element, (1, N) or (N,) (row-wise), or
    block scales of the (N, K) weight: 128x128 blocks as (NB, KB) (an HF checkpoint's
    ``weight_scale_inv``; NB = ceil(N/128)) or (KB, NB) / (KB rounded up to 4, NB) (PyTorch's
    orientation), 1x128 groups per output channel as (N, KB) or (KB, N). Block scales may have any
    strides. A square block scale (NB == KB) is read in PyTorch's orientation when its first
    dimension is the contiguous one (PyTorch's outer-dim-major layout) and in the checkpoint's
    otherwise. Where two recipes fit a shape with different meanings (tiny N or K), the first in
    this order wins unless ``recipe_a`` / ``recipe_b`` name one: tensor, row, 128x128, 1x128.
    """
    recipe_a, recipe_b = parse_recipe(recipe_a, "scale_recipe_a"), parse_recipe(recipe_b, "scale_recipe_b")
    kb, nb = -(-k // BLOCK), -(-n // BLOCK)
    kb4 = -(-kb // 4) * 4
    sa, sb = tuple(scale_a.shape), tuple(scale_b.shape)
    if recipe_a == "128x128":
        raise ValueError("scale_recipe_a: 128x128 blocks apply to the weight (b) only; activations take 1x128 groups")
    a = pick_recipe("scale_a", sa, {"tensor": scale_a.numel() == 1, "row": sa in ((m, 1), (m,)), "1x128": sa == (m, kb)},
              recipe_a, lambda: {"tensor": "one element", "row": f"({m}, 1) or ({m},)", "1x128": f"({m}, {kb})"})
    blocks = {"128x128": ((nb, kb), ((kb, nb), (kb4, nb))), "1x128": ((n, kb), ((kb, n),))}
    b = pick_recipe("scale_b", sb, {"tensor": scale_b.numel() == 1, "row": sb in ((1, n), (n,)),
                              **{r: sb == weight or sb in k_first for r, (weight, k_first) in blocks.items()}},
              recipe_b, lambda: {"tensor": "one element", "row": f"(1, {n}) or ({n},)",
                                 "128x128": f"({nb}, {kb}) or ({kb}, {nb}) (KB rounded up to 4 allowed there)",
                                 "1x128": f"({n}, {kb}) or ({kb}, {n})"})
    k_first = False
    if b in blocks:
        weight, k_first_shapes = blocks[b]
        k_first = sb in k_first_shapes
        if k_first and sb == weight:  # square: the layout decides
            k_first = scale_b.stride(0) == 1 and scale_b.stride(1) != 1
    return ScaleLayout(a, b, k_first)


def block_views(layout: ScaleLayout, m: int, n: int, k: int):
    """``(block_scaling, transform)``: the kernels' view of block scales. transform(scale_a,
    scale_b) returns scale_a as (M, KB) and scale_b as (NB, KB) (128x128) or (N, KB) (per output
    channel), as views (tensor- and row-wise sides become stride-0 expansions): no copy."""
    kb, nb = -(-k // BLOCK), -(-n // BLOCK)
    per_channel = layout.b in ("row", "1x128")
    rows_b = n if per_channel else nb

    def transform(scale_a, scale_b):
        if layout.a == "1x128":
            va = scale_a
        else:
            va = scale_a.reshape(1 if layout.a == "tensor" else m, 1).expand(m, kb)
        if layout.b in ("tensor", "row"):
            vb = scale_b.reshape(1 if layout.b == "tensor" else n, 1).expand(rows_b, kb)
        else:
            vb = scale_b.t()[:, :kb] if layout.b_k_first else scale_b
        return va, vb

    scaling = (Scaling.BLOCK_1X128, Scaling.BLOCK_1X128 if per_channel else Scaling.BLOCK_128X128)
    return scaling, transform


def _check_bias(bias, n: int) -> None:
    if bias is None:
        return
    _check_tensor(bias, "bias")
    if tuple(bias.shape) != (n,):
        raise ValueError(f"bias has shape {tuple(bias.shape)}; expected ({n},), one value per output column")
    if bias.dtype not in _OUT:
        raise TypeError(f"bias must be bfloat16, float16 or float32, got {bias.dtype}")


def check_scaled_mm(a, b, scale_a, scale_b, bias, out_dtype, out, use_fast_accum, backend,
                    scale_recipe_a=None, scale_recipe_b=None) -> ScaleLayout:
    _check_tensor(a, "a")
    _check_tensor(b, "b")
    if a.dtype not in _FP8_A:
        raise TypeError(f"a must be float8_e4m3fn or float8_e5m2, got {a.dtype}; quantize with tmagemm.quantize_fp8")
    if b.dtype not in _FP8_B:
        raise TypeError(f"b must be float8_e4m3fn, got {b.dtype}; quantize with tmagemm.quantize_fp8")
    _check_2d(a, b)
    m, k = a.shape
    n = b.shape[1]
    if not (a.stride(1) == 1 or k <= 1):
        raise ValueError(f"a must be row-major (stride(1) == 1) for fp8, got stride {tuple(a.stride())}; use a.contiguous()")
    if not (b.stride(0) == 1 or k <= 1):
        raise ValueError(
            f"b must be column-major (stride(0) == 1) for fp8, got stride {tuple(b.stride())}; "
            "pass w.t() of a row-major (N, K) weight"
        )
    _scale_tensor(scale_a, "scale_a")
    _scale_tensor(scale_b, "scale_b")
    layout = scale_layout(scale_a, scale_b, m, n, k, scale_recipe_a, scale_recipe_b)
    _check_bias(bias, n)
    _check_out_dtype(out_dtype)
    dev = _check_devices({"a": a, "b": b, "scale_a": scale_a, "scale_b": scale_b, "bias": bias})
    _check_out(out, m, n, out_dtype, dev)
    _check_fast_accum(use_fast_accum)
    _check_backend(backend)
    return layout


def check_matmul(a, b, out_dtype, out, backend) -> torch.dtype:
    _check_tensor(a, "a")
    _check_tensor(b, "b")
    if a.dtype in _FP8_A or b.dtype in _FP8_A:
        raise TypeError(f"matmul takes bfloat16/float16 inputs, got a {a.dtype} and b {b.dtype}; use tmagemm.scaled_mm for fp8")
    if a.dtype not in _HALF or b.dtype != a.dtype:
        raise TypeError(f"a and b must both be bfloat16 or both float16, got a {a.dtype} and b {b.dtype}")
    _check_2d(a, b)
    out_dtype = a.dtype if out_dtype is None else out_dtype
    _check_out_dtype(out_dtype)
    dev = _check_devices({"a": a, "b": b})
    _check_out(out, a.shape[0], b.shape[1], out_dtype, dev)
    _check_backend(backend)
    return out_dtype


def _check_fast_accum(use_fast_accum) -> None:
    if not isinstance(use_fast_accum, bool):
        raise TypeError(f"use_fast_accum must be a bool, got {type(use_fast_accum).__name__} {use_fast_accum!r}")


def _interpreted_nonfinite(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, scale_a, scale_b, bias,
                           layout: ScaleLayout | None) -> None:
    """The Triton interpreter reads a NaN or Inf of an fp8 operand as a finite value (NaN as
    480): recompute the rows of ``out`` with a non-finite value in ``a`` and the columns with one
    in ``b`` in float64, as the GPU's IEEE arithmetic gives them (NaN propagates, Inf * 0 is NaN)."""
    rows = (~torch.isfinite(a.float())).any(dim=1).nonzero().flatten()
    cols = (~torch.isfinite(b.float())).any(dim=0).nonzero().flatten()
    if rows.numel() == 0 and cols.numel() == 0:
        return
    (m, k), n = a.shape, b.shape[1]
    _, views = block_views(layout or ScaleLayout("tensor", "tensor", False), m, n, k)
    sa, sb = views(scale_a if scale_a is not None else torch.ones(1), scale_b if scale_b is not None else torch.ones(1))
    per_k = torch.arange(k) // BLOCK
    b_rows = torch.arange(n) if sb.shape[0] == n else torch.arange(n) // BLOCK
    a_deq = a.double() * sa.double()[:, per_k]
    b_deq = b.double() * sb.double()[b_rows][:, per_k].t()

    def exact(r: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        value = a_deq[r] @ b_deq[:, c]
        if bias is not None:
            value = value + bias.double()[c][None, :]
        return value.to(out.dtype)

    if rows.numel():
        out[rows] = exact(rows, torch.arange(n))
    if cols.numel():
        out[:, cols] = exact(torch.arange(m), cols)


def execute(key, a, b, scale_a, scale_b, bias, out, out_dtype, fast_accum, backend,
            layout: ScaleLayout | None = None) -> torch.Tensor:
    """Run a call whose arguments passed the checks (eager calls and the torch ops); ``key``:
    the call's cache key, or None; ``layout``: how fp8 scales apply (None: no scales)."""
    if a.device.type == "meta":  # shape propagation only
        return out if out is not None else torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype, device="meta")
    check_runtime_device(a.device, a.dtype)
    if out is None:
        out = torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype, device=a.device)
    block_scaling = block_scales = None
    if layout is not None and layout.is_block:
        block_scaling, block_scales = block_views(layout, a.shape[0], b.shape[1], a.shape[1])
    run_gemm(key, a, b, out, scale_a, scale_b, bias, fast_accum, backend, block_scales, block_scaling)
    if not out.is_cuda and a.element_size() == 1 and a.shape[1]:
        _interpreted_nonfinite(a, b, out, scale_a, scale_b, bias, layout)
    return out


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    use_fast_accum: bool = True,
    out: torch.Tensor | None = None,
    backend: str = "auto",
    scale_recipe_a=None,
    scale_recipe_b=None,
) -> torch.Tensor:
    """FP8 GEMM with the ``torch._scaled_mm`` contract: ``(scale_a * scale_b) * (a @ b) + bias``,
    and the block-scaled recipe of FP8 checkpoints (1x128 activations x 128x128 weights).

    a: (M, K) float8_e4m3fn or float8_e5m2, row-major. b: (K, N) float8_e4m3fn, column-major
    (``w.t()`` of a row-major (N, K) weight). Leading strides may be padded.
    scale_a / scale_b: float32 dequantization scales: tensor-wise (one element), row-wise
    ((M, 1) or (M,) for a; (1, N) or (N,) for b), or block-wise: scale_a (M, ceil(K/128)) for 1x128
    groups of a; scale_b (ceil(N/128), ceil(K/128)) for 128x128 blocks of the (N, K) weight (an HF
    checkpoint's ``weight_scale_inv``; PyTorch's transposed (ceil(K/128) [rounded up to 4],
    ceil(N/128)) layout too) or (N, ceil(K/128)) for 1x128 groups per output channel. Block scales
    may have any strides; see :func:`scale_layout` for how shapes are read.
    scale_recipe_a / scale_recipe_b: "tensor", "row", "1x128", "128x128" (or torch's ScalingType
    members): decide where a shape fits two recipes (tiny M, N or K); optional otherwise.
    bias: (N,), added after scaling. out_dtype: bfloat16 (default), float16 or float32.
    use_fast_accum: keep wgmma's fast fp8 accumulation across K (False promotes partial sums to
    fp32 every 128-deep k-block; block-scaled products always do).
    backend: "auto" (measured best), "triton" or "cuda" (native kernels).
    Raises TypeError / ValueError naming the argument at fault.
    """
    compiling = torch.compiler.is_compiling()
    key = None
    if not compiling:
        try:
            key = call_key("scaled_mm", a, b, scale_a, scale_b, bias, out, out_dtype, use_fast_accum, backend,
                           (scale_recipe_a, scale_recipe_b))
            known = cached(key)
        except (AttributeError, TypeError):  # not tensors, or unhashable options: the checks say why
            key = known = None
        if known is not None:
            return known(a, b, scale_a, scale_b, bias, out)
    layout = check_scaled_mm(a, b, scale_a, scale_b, bias, out_dtype, out, use_fast_accum, backend,
                             scale_recipe_a, scale_recipe_b)
    if compiling:
        if out is None:
            return torch.ops.tmagemm.scaled_mm(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum, backend,
                                               layout.a, layout.b)
        torch.ops.tmagemm.scaled_mm_out(a, b, scale_a, scale_b, bias, use_fast_accum, backend, out, layout.a, layout.b)
        return out
    return execute(key, a, b, scale_a, scale_b, bias, out, out_dtype, use_fast_accum, backend, layout)


def matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """BF16/FP16 GEMM ``a @ b`` with fp32 accumulation.

    a: (M, K), b: (K, N), both bfloat16 or both float16, each row- or column-major (padded
    leading strides are fine; layouts TMA cannot describe take the pointer kernel).
    out_dtype: defaults to a.dtype; bfloat16, float16 or float32.
    Differentiable (the backward runs the same kernels on transposed operands), except with ``out=``.
    """
    key = None
    compiling = torch.compiler.is_compiling()
    try:
        needs_grad = torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)
        if not (needs_grad or compiling):
            key = call_key("matmul", a, b, None, None, None, out, out_dtype, True, backend)
            known = cached(key)
            if known is not None:
                return known(a, b, None, None, None, out)
    except (AttributeError, TypeError):
        key = None
    out_dtype = check_matmul(a, b, out_dtype, out, backend)
    needs_grad = torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)
    if needs_grad and out is not None:
        raise ValueError("matmul(out=...) does not support automatic differentiation; drop out= or use torch.no_grad()")
    if needs_grad or compiling:
        if out is None:
            return torch.ops.tmagemm.matmul(a, b, out_dtype, backend)
        torch.ops.tmagemm.matmul_out(a, b, backend, out)
        return out
    return execute(key, a, b, None, None, None, out, out_dtype, True, backend)
