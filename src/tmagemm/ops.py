"""The GEMMs (and the fused gate/up projection) as torch ops (``torch.ops.tmagemm.*``) with fake
implementations.

torch.compile traces these as opaque ops (``fullgraph=True`` works), using the fake
implementations for shapes. The public functions in ``api.py`` call them while compiling and
run the plan directly in eager mode, which skips the dispatcher's host overhead. Called
directly, the ops check their arguments like the public functions and take the same defaults.
"""

from __future__ import annotations

import torch

from . import api, gate_up
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
