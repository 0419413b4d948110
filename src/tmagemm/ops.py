"""The GEMMs as torch ops (``torch.ops.tmagemm.*``) with fake implementations.

torch.compile traces these as opaque ops (``fullgraph=True`` works), using the fake
implementations for shapes. The public functions in ``api.py`` call them while compiling and
call the implementation directly in eager mode, which skips the dispatcher's host overhead.
"""

from __future__ import annotations

import torch

from .api import run_gemm


@torch.library.custom_op("tmagemm::scaled_mm", mutates_args=())
def scaled_mm_op(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    use_fast_accum: bool,
    backend: str,
) -> torch.Tensor:
    out = torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype, device=a.device)
    return run_gemm(a, b, out, scale_a, scale_b, bias, use_fast_accum, backend)


@scaled_mm_op.register_fake
def _(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum, backend):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


@torch.library.custom_op("tmagemm::scaled_mm_out", mutates_args=("out",))
def scaled_mm_out_op(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    bias: torch.Tensor | None,
    use_fast_accum: bool,
    backend: str,
    out: torch.Tensor,
) -> None:
    run_gemm(a, b, out, scale_a, scale_b, bias, use_fast_accum, backend)


@scaled_mm_out_op.register_fake
def _(a, b, scale_a, scale_b, bias, use_fast_accum, backend, out):
    return None


@torch.library.custom_op("tmagemm::matmul", mutates_args=())
def matmul_op(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, backend: str) -> torch.Tensor:
    out = torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype, device=a.device)
    return run_gemm(a, b, out, None, None, None, True, backend)


@matmul_op.register_fake
def _(a, b, out_dtype, backend):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


@torch.library.custom_op("tmagemm::matmul_out", mutates_args=("out",))
def matmul_out_op(a: torch.Tensor, b: torch.Tensor, backend: str, out: torch.Tensor) -> None:
    run_gemm(a, b, out, None, None, None, True, backend)


@matmul_out_op.register_fake
def _(a, b, backend, out):
    return None


def _matmul_setup_context(ctx, inputs, output):
    a, b, out_dtype, backend = inputs
    ctx.save_for_backward(a, b)
    ctx.backend = backend


def _matmul_backward(ctx, grad):
    """d(a @ b): grad @ b^T and a^T @ grad, through the same kernels (transposed operands are
    column-major views, which every path takes without a copy)."""
    a, b = ctx.saved_tensors
    grad = grad.to(a.dtype)
    grad_a = grad_b = None
    if ctx.needs_input_grad[0]:
        grad_a = torch.ops.tmagemm.matmul(grad, b.t(), a.dtype, ctx.backend)
    if ctx.needs_input_grad[1]:
        grad_b = torch.ops.tmagemm.matmul(a.t(), grad, b.dtype, ctx.backend)
    return grad_a, grad_b, None, None


torch.library.register_autograd("tmagemm::matmul", _matmul_backward, setup_context=_matmul_setup_context)
