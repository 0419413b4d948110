"""The GEMMs (dense and grouped, and the fused gate/up projection) as torch ops
(``torch.ops.tmagemm.*``) with fake implementations.

torch.compile traces these as opaque ops (``fullgraph=True`` works), using the fake
implementations for shapes. The public functions in ``api.py`` call them while compiling and
run the plan directly in eager mode, which skips the dispatcher's host overhead. Called
directly, the ops check their arguments like the public functions and take the same defaults.
"""

from __future__ import annotations

import torch

from . import api, gate_up, grouped, tma
from .plan import call_key


@torch.library.custom_op("tmagemm::scaled_mm", mutates_args=())
def scaled_mm_op(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    use_fast_accum: bool = True,
    backend: str = "auto",
    scale_recipe_a: str | None = None,
    scale_recipe_b: str | None = None,
) -> torch.Tensor:
    layout = api.check_scaled_mm(a, b, scale_a, scale_b, bias, out_dtype, None, use_fast_accum, backend,
                                 scale_recipe_a, scale_recipe_b)
    key = call_key("scaled_mm", a, b, scale_a, scale_b, bias, None, out_dtype, use_fast_accum, backend,
                   (scale_recipe_a, scale_recipe_b))
    return api.execute(key, a, b, scale_a, scale_b, bias, None, out_dtype, use_fast_accum, backend, layout)


@scaled_mm_op.register_fake
def _(a, b, scale_a, scale_b, bias=None, out_dtype=torch.bfloat16, use_fast_accum=True, backend="auto",
      scale_recipe_a=None, scale_recipe_b=None):
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
    scale_recipe_a: str | None = None,
    scale_recipe_b: str | None = None,
) -> None:
    layout = api.check_scaled_mm(a, b, scale_a, scale_b, bias, out.dtype, out, use_fast_accum, backend,
                                 scale_recipe_a, scale_recipe_b)
    key = call_key("scaled_mm", a, b, scale_a, scale_b, bias, out, out.dtype, use_fast_accum, backend,
                   (scale_recipe_a, scale_recipe_b))
    api.execute(key, a, b, scale_a, scale_b, bias, out, out.dtype, use_fast_accum, backend, layout)


@scaled_mm_out_op.register_fake
def _(a, b, scale_a, scale_b, bias, use_fast_accum, backend, out, scale_recipe_a=None, scale_recipe_b=None):
    return None


@torch.library.custom_op("tmagemm::matmul", mutates_args=())
def matmul_op(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None, backend: str = "auto") -> torch.Tensor:
    out_dtype = api.check_matmul(a, b, out_dtype, None, backend)
    key = call_key("matmul", a, b, None, None, None, None, out_dtype, True, backend)
    return api.execute(key, a, b, None, None, None, None, out_dtype, True, backend)


@matmul_op.register_fake
def _(a, b, out_dtype=None, backend="auto"):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=a.dtype if out_dtype is None else out_dtype)


@torch.library.custom_op("tmagemm::matmul_out", mutates_args=("out",))
def matmul_out_op(a: torch.Tensor, b: torch.Tensor, backend: str, out: torch.Tensor) -> None:
    api.check_matmul(a, b, out.dtype, out, backend)
    key = call_key("matmul", a, b, None, None, None, out, out.dtype, True, backend)
    api.execute(key, a, b, None, None, None, out, out.dtype, True, backend)


@matmul_out_op.register_fake
def _(a, b, backend, out):
    return None


@torch.library.custom_op("tmagemm::gate_up_silu_quant", mutates_args=())
def gate_up_silu_quant_op(xq: torch.Tensor, sx: torch.Tensor, w: torch.Tensor, sw: torch.Tensor,
                          pow2_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    return gate_up.gate_up_silu_quant(xq, sx, w, sw, pow2_scale=pow2_scale)


@gate_up_silu_quant_op.register_fake
def _(xq, sx, w, sw, pow2_scale=False):
    m, i = xq.shape[0], w.shape[0] // 2
    return xq.new_empty((m, i)), xq.new_empty((m, i // gate_up.GROUP), dtype=torch.float32)


@torch.library.custom_op("tmagemm::gate_up_silu_quant_out", mutates_args=("hq", "hs"))
def gate_up_silu_quant_out_op(xq: torch.Tensor, sx: torch.Tensor, w: torch.Tensor, sw: torch.Tensor,
                              pow2_scale: bool, hq: torch.Tensor, hs: torch.Tensor) -> None:
    gate_up.gate_up_silu_quant(xq, sx, w, sw, pow2_scale=pow2_scale, out=(hq, hs))


@gate_up_silu_quant_out_op.register_fake
def _(xq, sx, w, sw, pow2_scale, hq, hs):
    return None


# Grouped GEMMs: the op runs the public function (its checks, its plan cache). Counts stay on the
# device; rows no group covers are left as they are (uninitialised in a returned output).


@torch.library.custom_op("tmagemm::grouped_mm", mutates_args=())
def grouped_mm_op(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None = None,
                  masked_m: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    with torch.no_grad():  # the op's own autograd formula covers it; the function would call the op again
        return grouped.grouped_mm(a, b, offs=offs, masked_m=masked_m, out_dtype=out_dtype)


@grouped_mm_op.register_fake
def _(a, b, offs=None, masked_m=None, out_dtype=None):
    dtype = a.dtype if out_dtype is None else out_dtype
    if b.dim() == 2 and a.dim() == 3:  # 3-D x 2-D: (M, N_total) column-major, the transpose's rows
        return a.new_empty((b.shape[1], a.shape[1]), dtype=dtype).t()
    if b.dim() == 2:  # 2-D x 2-D: one (M, N) block per group along K_total
        return a.new_empty((offs.shape[0], a.shape[0], b.shape[1]), dtype=dtype)
    return a.new_empty((*a.shape[:-1], b.shape[2]), dtype=dtype)


@torch.library.custom_op("tmagemm::transposed", mutates_args=())
def transposed_op(t: torch.Tensor) -> torch.Tensor:
    """``t.t().contiguous()`` by TMA where it applies (triton/transpose.py); the backward GEMMs'
    operands that must be read along their other dimension."""
    from .triton.transpose import transposed

    return transposed(t)


@transposed_op.register_fake
def _(t):
    return t.new_empty((t.shape[1], t.shape[0]))


@torch.library.custom_op("tmagemm::grouped_zero_uncovered_rows", mutates_args=("out",))
def grouped_zero_uncovered_rows_op(out: torch.Tensor, offs: torch.Tensor | None = None,
                                   masked_m: torch.Tensor | None = None) -> None:
    grouped.zero_uncovered_rows(out, offs=offs, masked_m=masked_m)


@grouped_zero_uncovered_rows_op.register_fake
def _(out, offs=None, masked_m=None):
    return None


@torch.library.custom_op("tmagemm::grouped_weight_grad", mutates_args=())
def grouped_weight_grad_op(a: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor | None = None,
                           masked_m: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    return grouped.weight_grad(a, grad, offs=offs, masked_m=masked_m, out_dtype=out_dtype)


@grouped_weight_grad_op.register_fake
def _(a, grad, offs=None, masked_m=None, out_dtype=None):
    e = a.shape[0] if a.dim() == 3 else offs.shape[0]
    return a.new_empty((e, a.shape[-1], grad.shape[-1]), dtype=a.dtype if out_dtype is None else out_dtype)


@torch.library.custom_op("tmagemm::grouped_mm_out", mutates_args=("out",))
def grouped_mm_out_op(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None, masked_m: torch.Tensor | None,
                      out: torch.Tensor) -> None:
    grouped.grouped_mm(a, b, offs=offs, masked_m=masked_m, out_dtype=out.dtype, out=out)


@grouped_mm_out_op.register_fake
def _(a, b, offs, masked_m, out):
    return None


@torch.library.custom_op("tmagemm::grouped_scaled_mm", mutates_args=())
def grouped_scaled_mm_op(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    offs: torch.Tensor | None = None,
    masked_m: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    scale_recipe_a: str | None = None,
    scale_recipe_b: str | None = None,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    return grouped.grouped_scaled_mm(a, b, scale_a, scale_b, offs=offs, masked_m=masked_m, bias=bias,
                                     out_dtype=out_dtype, scale_recipe_a=scale_recipe_a,
                                     scale_recipe_b=scale_recipe_b, use_fast_accum=use_fast_accum)


@grouped_scaled_mm_op.register_fake
def _(a, b, scale_a, scale_b, offs=None, masked_m=None, bias=None, out_dtype=torch.bfloat16, scale_recipe_a=None,
      scale_recipe_b=None, use_fast_accum=False):
    return a.new_empty((*a.shape[:-1], b.shape[2]), dtype=out_dtype)


@torch.library.custom_op("tmagemm::grouped_scaled_mm_out", mutates_args=("out",))
def grouped_scaled_mm_out_op(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    offs: torch.Tensor | None,
    masked_m: torch.Tensor | None,
    bias: torch.Tensor | None,
    scale_recipe_a: str | None,
    scale_recipe_b: str | None,
    use_fast_accum: bool,
    out: torch.Tensor,
) -> None:
    grouped.grouped_scaled_mm(a, b, scale_a, scale_b, offs=offs, masked_m=masked_m, bias=bias, out_dtype=out.dtype,
                              out=out, scale_recipe_a=scale_recipe_a, scale_recipe_b=scale_recipe_b,
                              use_fast_accum=use_fast_accum)


@grouped_scaled_mm_out_op.register_fake
def _(a, b, scale_a, scale_b, offs, masked_m, bias, scale_recipe_a, scale_recipe_b, use_fast_accum, out):
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


def _grouped_mm_setup_context(ctx, inputs, output):
    a, b, offs, masked_m, out_dtype = inputs
    ctx.save_for_backward(a, b, offs, masked_m)


def _rows_for_tma(t: torch.Tensor) -> torch.Tensor:
    """``t`` (..., N) contiguous, its rows 16-byte aligned (padded past N where N * itemsize is not
    a multiple of 16): the backward GEMMs read the output gradient by TMA, which the forward's
    output (any strides; e.g. the expanded gradient of a sum(), strides of 0) need not allow."""
    t = t.contiguous()
    if (t.shape[-1] * t.element_size()) % 16 == 0:
        return t
    return tma.aligned_copy(t.reshape(-1, t.shape[-1]), 1).view(t.shape)


def _grouped_mm_backward(ctx, grad):
    """d(grouped_mm) through grouped GEMMs (docs/grouped.md, "Autograd"). Gradient rows of a that
    no group covers get zeros from grouped_zero_uncovered_rows, which writes those rows alone."""
    a, b, offs, masked_m = ctx.saved_tensors
    grad = _rows_for_tma(grad.to(a.dtype))
    grad_a = grad_b = None
    if b.dim() == 2 and a.dim() == 3:
        # out[:, N_g] = a[g] @ b[:, N_g]: d(a)[g] = grad[:, N_g] @ b[:, N_g]^T is the 2-D x 2-D form
        # (groups along N_total; an empty group's gradient is zeros), and d(b)^T[N_g] =
        # grad[:, N_g]^T @ a[g] the contiguous form, zeros on the columns of b no group covers.
        if ctx.needs_input_grad[0]:
            grad_a = torch.ops.tmagemm.grouped_mm(grad, b.t(), offs, None, a.dtype)
        if ctx.needs_input_grad[1]:
            grad_b = torch.empty_like(b, memory_format=torch.contiguous_format)
            torch.ops.tmagemm.grouped_mm_out(torch.ops.tmagemm.transposed(grad), a, offs, None, grad_b.t())
            torch.ops.tmagemm.grouped_zero_uncovered_rows(grad_b.t(), offs, None)
        return grad_a, grad_b, None, None, None
    if b.dim() == 2:
        # out[g] = a[:, K_g] @ b[K_g]: the gradients' rows along K_total are the contiguous form,
        # d(a)^T[K_g] = b[K_g] @ grad[g]^T and d(b)[K_g] = a[:, K_g]^T @ grad[g].
        if ctx.needs_input_grad[0]:
            grad_a = torch.empty_like(a, memory_format=torch.contiguous_format)
            b_rows = b if b.stride(-1) == 1 else torch.ops.tmagemm.transposed(b.t())  # b contiguous along N
            torch.ops.tmagemm.grouped_mm_out(b_rows, grad.transpose(1, 2), offs, None, grad_a.t())
            torch.ops.tmagemm.grouped_zero_uncovered_rows(grad_a.t(), offs, None)
        if ctx.needs_input_grad[1]:
            grad_b = torch.empty_like(b, memory_format=torch.contiguous_format)
            a_rows = a.t() if a.t().is_contiguous() else torch.ops.tmagemm.transposed(a)
            torch.ops.tmagemm.grouped_mm_out(a_rows, grad, offs, None, grad_b)
            torch.ops.tmagemm.grouped_zero_uncovered_rows(grad_b, offs, None)
        return grad_a, grad_b, None, None, None
    if ctx.needs_input_grad[0]:
        grad_a = torch.empty_like(a, memory_format=torch.contiguous_format)
        torch.ops.tmagemm.grouped_mm_out(grad, b.transpose(1, 2), offs, masked_m, grad_a)
        torch.ops.tmagemm.grouped_zero_uncovered_rows(grad_a, offs, masked_m)
    if ctx.needs_input_grad[1]:
        if b.stride(1) == 1 and b.shape[2] > 1:
            # b = w.transpose(1, 2) of (E, N, K) weights: compute d w = grad_g^T @ a_g in w's own
            # layout, so accumulating it into w.grad reads no transposed tensor.
            grad_b = torch.ops.tmagemm.grouped_weight_grad(grad, a, offs, masked_m, b.dtype).transpose(1, 2)
        else:
            grad_b = torch.ops.tmagemm.grouped_weight_grad(a, grad, offs, masked_m, b.dtype)
    return grad_a, grad_b, None, None, None


torch.library.register_autograd("tmagemm::grouped_mm", _grouped_mm_backward, setup_context=_grouped_mm_setup_context)
