"""Public GEMMs: argument checks, zero-size handling, and dispatch to a kernel variant.

``matmul`` and ``scaled_mm`` check everything that can be checked from shapes, strides and
dtypes (this also runs while torch.compile traces), then call the implementation directly in
eager mode (lowest host overhead) or through the registered torch ops (``ops.py``) when compiling.
"""

from __future__ import annotations

import torch

from . import device, envs
from .dispatch import BACKENDS, GemmArgs, plan
from .dispatch import remembered_calls as _calls

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
            raise ValueError(f"{name} is on {t.device} but {first} is on {dev}; move all tensors to one CUDA device")
    return dev


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def _check_runtime_device(dev: torch.device) -> None:
    """Device checks that need the CUDA runtime (done at run time, not while tracing)."""
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
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


def _scale_vector(scale, name: str, rows: int, row_shapes: tuple[tuple[int, ...], ...]) -> None:
    _check_tensor(scale, name)
    if scale.dtype != torch.float32:
        raise TypeError(f"{name} must be float32 (a dequantization scale), got {scale.dtype}")
    if scale.numel() != 1 and tuple(scale.shape) not in row_shapes:
        raise ValueError(
            f"{name} has shape {tuple(scale.shape)}; expected one element (tensor-wise) or "
            f"{' or '.join(str(s) for s in row_shapes)} (row-wise)"
        )


def _check_bias(bias, n: int) -> None:
    if bias is None:
        return
    _check_tensor(bias, "bias")
    if tuple(bias.shape) != (n,):
        raise ValueError(f"bias has shape {tuple(bias.shape)}; expected ({n},), one value per output column")
    if bias.dtype not in _OUT:
        raise TypeError(f"bias must be bfloat16, float16 or float32, got {bias.dtype}")


def check_scaled_mm(a, b, scale_a, scale_b, bias, out_dtype, out, backend) -> None:
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
    _scale_vector(scale_a, "scale_a", m, ((m, 1), (m,)))
    _scale_vector(scale_b, "scale_b", n, ((1, n), (n,)))
    _check_bias(bias, n)
    _check_out_dtype(out_dtype)
    dev = _check_devices({"a": a, "b": b, "scale_a": scale_a, "scale_b": scale_b, "bias": bias})
    _check_out(out, m, n, out_dtype, dev)
    _check_backend(backend)


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


# ---------------------------------------------------------------------------------- run


def _scale_operand(scale: torch.Tensor | None) -> torch.Tensor | None:
    """What the kernels read: a scale's elements in order (tensor-wise: one value; row-wise: M or
    N values 4 bytes apart). Kernels use only the pointer and numel, so a scale already laid out
    that way is passed as is; a strided row-wise scale is copied."""
    if scale is None or scale.numel() == 1:
        return scale
    flat = scale.reshape(-1)
    return flat if flat.stride(0) == 1 else flat.contiguous()


def _gemm_args(a, b, out, scale_a, scale_b, bias, fast_accum) -> GemmArgs:
    return GemmArgs(a, b, out, _scale_operand(scale_a), _scale_operand(scale_b),
                    None if bias is None else bias.contiguous(), fast_accum)


def run_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    scale_a: torch.Tensor | None,
    scale_b: torch.Tensor | None,
    bias: torch.Tensor | None,
    fast_accum: bool,
    backend: str,
) -> torch.Tensor:
    """Write the GEMM into ``out`` (already checked) and return it."""
    _run(a, b, out, scale_a, scale_b, bias, fast_accum, backend)
    return out


def _run(a, b, out, scale_a, scale_b, bias, fast_accum, backend) -> GemmArgs | None:
    """run_gemm's work; returns the planned problem (None when a zero size needed no kernel)."""
    m, k = a.shape
    n = b.shape[1]
    _check_runtime_device(a.device)
    if m == 0 or n == 0:
        return None
    if k == 0:
        # An empty sum: zeros, plus the bias (scales multiply zero).
        out.zero_()
        if bias is not None:
            out.add_(bias.to(out.dtype))
        return None
    args = _gemm_args(a, b, out, scale_a, scale_b, bias, fast_accum)
    plan(args, backend)(args)
    return args


# ------------------------------------------------------------------ repeated calls (host time)
#
# Host time per call is a measured goal (a decode step calls the same few GEMMs thousands of
# times). Everything the checks and the plan read from the arguments (types, devices, dtypes,
# shapes, strides, 16-byte alignment, flags) forms a call key; a call whose key was seen goes
# straight to the planned launcher. A key is stored only after a call with it passed every check
# and was planned outside CUDA-graph capture, so a hit can skip both.

def _key(t: torch.Tensor | None):
    if t is None:
        return None
    # get_device() is -1 off CUDA, and only CUDA calls are remembered, so it tells devices apart.
    return (type(t), t.get_device(), t.dtype, t.shape, t.stride(), t.data_ptr() % 16)


def _as_given(scale: torch.Tensor | None) -> bool:
    """True when the kernels can read ``scale`` without :func:`_scale_operand` copying it."""
    return scale is None or scale.numel() == 1 or scale.reshape(-1).stride(0) == 1


def _remember(key: tuple, args: GemmArgs, backend: str, user_tensors: tuple, out_dtype) -> None:
    """Store a direct path for ``key`` (the plan for ``args`` is cached). ``user_tensors`` are the
    caller's (scale_a, scale_b, bias) before normalisation: a remembered call passes tensors as
    given only when they need no copy."""
    launcher = plan(args, backend)
    scale_a, scale_b, bias = user_tensors
    as_given = _as_given(scale_a) and _as_given(scale_b) and (bias is None or bias.is_contiguous())
    out_shape, device = tuple(args.out.shape), args.out.device
    operands = getattr(launcher, "operands", None)  # launchers that take the tensors without GemmArgs
    if as_given and operands is not None:

        def call(a, b, scale_a, scale_b, bias, fast_accum, out):
            if out is None:
                out = torch.empty(out_shape, dtype=out_dtype, device=device)
            operands(a, b, out, scale_a, scale_b, bias)
            return out

    else:
        prepare = GemmArgs if as_given else _gemm_args

        def call(a, b, scale_a, scale_b, bias, fast_accum, out):
            if out is None:
                out = torch.empty(out_shape, dtype=out_dtype, device=device)
            launcher(prepare(a, b, out, scale_a, scale_b, bias, fast_accum))
            return out

    _calls[key] = call


def _first_call(key, a, b, scale_a, scale_b, bias, fast_accum, out, out_dtype, backend) -> torch.Tensor:
    """The checked path of an unseen call key (arguments already validated); remembers the key
    for CUDA calls outside graph capture (CPU calls, for the interpreter, always come here)."""
    if out is None:
        out = torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype, device=a.device)
    args = _run(a, b, out, scale_a, scale_b, bias, fast_accum, backend)
    if args is not None and key is not None and out.is_cuda and not torch.cuda.is_current_stream_capturing():
        _remember(key, args, backend, (scale_a, scale_b, bias), out_dtype)
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
) -> torch.Tensor:
    """FP8 GEMM with the ``torch._scaled_mm`` contract: ``(scale_a * scale_b) * (a @ b) + bias``.

    a: (M, K) float8_e4m3fn or float8_e5m2, row-major. b: (K, N) float8_e4m3fn, column-major
    (``w.t()`` of a row-major (N, K) weight). Leading strides may be padded.
    scale_a / scale_b: float32 dequantization scales, tensor-wise (one element) or row-wise
    ((M, 1) or (M,) for a; (1, N) or (N,) for b). bias: (N,), added after scaling.
    out_dtype: bfloat16 (default), float16 or float32. use_fast_accum: keep wgmma's fast fp8
    accumulation across K (False promotes partial sums to fp32 every K tile).
    backend: "auto" (measured best), "triton" or "cuda" (native kernels).
    Raises TypeError / ValueError naming the argument at fault.
    """
    key = None
    if not torch.compiler.is_compiling():
        try:
            key = ("scaled_mm", _key(a), _key(b), _key(scale_a), _key(scale_b), _key(bias), _key(out),
                   out_dtype, bool(use_fast_accum), backend)
            known = _calls.get(key)
        except (AttributeError, TypeError):  # not tensors, or unhashable options: the checks say why
            key = known = None
        if known is not None:
            return known(a, b, scale_a, scale_b, bias, use_fast_accum, out)
    check_scaled_mm(a, b, scale_a, scale_b, bias, out_dtype, out, backend)
    if torch.compiler.is_compiling():
        from . import ops  # noqa: F401  (registers the ops)

        if out is None:
            return torch.ops.tmagemm.scaled_mm(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum, backend)
        torch.ops.tmagemm.scaled_mm_out(a, b, scale_a, scale_b, bias, use_fast_accum, backend, out)
        return out
    return _first_call(key, a, b, scale_a, scale_b, bias, use_fast_accum, out, out_dtype, backend)


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
            key = ("matmul", _key(a), _key(b), _key(out), out_dtype, backend)
            known = _calls.get(key)
            if known is not None:
                return known(a, b, None, None, None, True, out)
    except (AttributeError, TypeError):
        key = None
    out_dtype = check_matmul(a, b, out_dtype, out, backend)
    needs_grad = torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)
    if needs_grad and out is not None:
        raise ValueError("matmul(out=...) does not support automatic differentiation; drop out= or use torch.no_grad()")
    if needs_grad or compiling:
        from . import ops  # noqa: F401

        if out is None:
            return torch.ops.tmagemm.matmul(a, b, out_dtype, backend)
        torch.ops.tmagemm.matmul_out(a, b, backend, out)
        return out
    return _first_call(key, a, b, None, None, None, True, out, out_dtype, backend)
