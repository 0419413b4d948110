"""Transposing copy through TMA: ``transposed(t)`` = ``t.t().contiguous()`` for a row-major 2-D
16- or 32-bit tensor, where the grouped GEMMs need an operand contiguous along its other
dimension (torch's 3-D x 2-D form with a row-major b; the backward's transposed operands through
``torch.ops.tmagemm.transposed``).

One program per 64 x 64 tile: a TMA box in, transposed in registers, a TMA box out (TMA clips
the ragged edges). On an H100 it moved 2.6 TB/s (read + written) where torch's strided copy of a
transpose moved 0.5 (BENCHMARKS.md, "torch's 3-D x 2-D grouped form; a TMA transposing copy").
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .. import device, envs, tma
from ..plan import Plan, cached, remember, tensor_key
from .common import let_next_kernel_launch, wait_for_previous_kernel
from .launch import A, OUT, KernelCall, direct_launch, pdl

BLOCK = 64


@triton.jit
def transpose_kernel(src_desc, dst_desc, M, N, BLOCK: tl.constexpr, PDL: tl.constexpr):
    tiles_n = tl.cdiv(N, BLOCK)
    m0 = tl.program_id(0) // tiles_n * BLOCK
    n0 = tl.program_id(0) % tiles_n * BLOCK
    wait_for_previous_kernel(PDL)  # PDL: the source may come from the kernel before
    tile = src_desc.load([m0, n0])
    let_next_kernel_launch(PDL)  # what is left is the store
    dst_desc.store([n0, m0], tl.trans(tile))


def reason(t: torch.Tensor) -> str | None:
    """None when the kernel copies ``t``, else why not (the caller then takes torch's copy)."""
    if t.dim() != 2 or t.element_size() not in (2, 4):
        return "a 2-D tensor of 16- or 32-bit elements"
    if not (t.is_cuda or envs.interpret()):
        return "a CUDA tensor (or the Triton interpreter)"
    if min(t.shape) == 0:
        return "no element"
    out_rows = t.shape[0] * t.element_size()
    return tma.map_reason(t, "t", (0, 1)) or (None if out_rows % tma.ALIGN == 0 else
                                              f"result rows of {out_rows} bytes are not a multiple of {tma.ALIGN}")


NAME = "triton.transpose"


class _Call:
    """One cached signature: its plan; a call allocates the result and launches."""

    __slots__ = ("plan",)

    def __init__(self, plan: Plan):
        self.plan = plan

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        out = torch.empty((t.shape[1], t.shape[0]), dtype=t.dtype, device=t.device)
        self.plan.run(t, None, out, None, None, None)
        return out


def _plan(t: torch.Tensor, out: torch.Tensor) -> Plan:
    """A plan for every tensor with ``t``'s signature: ``launch(t, None, out, None, None, None)``
    (a direct launch where the ABI allows, Triton's launcher otherwise: the CPU, a capture)."""
    m, n = t.shape
    src = TensorDescriptor(t, [m, n], [t.stride(0), 1], [BLOCK, BLOCK])
    dst = TensorDescriptor(out, [n, m], [m, 1], [BLOCK, BLOCK])
    grid = (triton.cdiv(m, BLOCK) * triton.cdiv(n, BLOCK),)
    call = KernelCall(transpose_kernel, grid, dict(src_desc=src, dst_desc=dst, M=m, N=n, BLOCK=BLOCK, PDL=pdl(out)),
                      dict(num_warps=4, num_stages=1), {"src_desc": A, "dst_desc": OUT})
    fast = direct_launch(NAME, call)
    if fast is not None:
        return Plan(NAME, None, fast, fast.device_index, direct=True)

    def launch(t_, b, out_, scale_a, scale_b, bias) -> None:
        src_ = TensorDescriptor(t_, [m, n], [t_.stride(0), 1], [BLOCK, BLOCK])
        dst_ = TensorDescriptor(out_, [n, m], [m, 1], [BLOCK, BLOCK])
        replace(call, args={**call.args, "src_desc": src_, "dst_desc": dst_}).launch()

    return Plan(NAME, None, launch, out.get_device())


def transposed(t: torch.Tensor) -> torch.Tensor:
    """``t.t().contiguous()``: by the TMA kernel where :func:`reason` allows, else torch's copy.
    One plan per signature in the plan layer's cache, so a call after the first plans nothing."""
    try:
        key = (NAME, tensor_key(t))
        known = cached(key)
    except (AttributeError, TypeError):  # not a tensor: the check below says why
        key = known = None
    if known is not None:
        return known(t)
    if reason(t) is not None:
        return t.t().contiguous()
    with device.on_device(t.device):
        call = _Call(_plan(t, torch.empty((t.shape[1], t.shape[0]), dtype=t.dtype, device=t.device)))
    if key is not None and not (t.is_cuda and torch.cuda.is_current_stream_capturing()):
        remember(key, call)
    return call(t)
