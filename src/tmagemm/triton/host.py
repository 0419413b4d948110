"""Host side shared by the Triton TMA GEMM families: layout flags, descriptors, plan builder.

Which operand is row- or column-major, leading strides and what TMA can describe are decided in
``tmagemm.tma``; this module turns those decisions into the kernels' constexpr flags and host
``TensorDescriptor``s, and builds every TMA family's :class:`~tmagemm.plan.Plan`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from .. import tma, tuning
from ..plan import GemmArgs, Plan, Scaling
from .launch import A, B, BIAS, OUT, SCALE_A, SCALE_B, direct_launch

# Every TMA GEMM kernel takes its per-call operands under these parameter names.
GEMM_OPERANDS = {"a_desc": A, "b_desc": B, "c_desc": OUT, "c_ptr": OUT, "scale_a_ptr": SCALE_A,
                 "scale_b_ptr": SCALE_B, "bias_ptr": BIAS}


def descriptor(t: torch.Tensor, row_major: bool, block_rows: int, block_cols: int) -> TensorDescriptor:
    """A host TensorDescriptor over ``t`` as stored in memory (passed to the kernel by value).

    Col-major operands are described through their transpose, so the descriptor's block is
    (block_cols, block_rows) and the kernel transposes the loaded tile.
    """
    rows, cols = t.shape
    lead = tma.leading_stride(t, row_major)
    if row_major:
        return TensorDescriptor(t, [rows, cols], [lead, 1], [block_rows, block_cols])
    return TensorDescriptor(t, [cols, rows], [lead, 1], [block_cols, block_rows])


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Global scratch for device-built tensor maps, from torch's caching allocator (cheap, and
    CUDA-graph safe: inside a capture it comes from the graph's pool) on the current device."""
    return torch.empty(size, dtype=torch.int8, device="cuda" if torch.cuda.is_available() else "cpu")


def install_allocator() -> None:
    """Give Triton the scratch allocator that ``tl.make_tensor_descriptor`` needs.

    Triton keeps the allocator per thread/context (autograd runs the backward on its own
    thread), so this is called before every launch that needs it; setting it costs well under
    a microsecond.
    """
    triton.set_allocator(_scratch)


@dataclass(frozen=True)
class Layout:
    """Constexpr layout flags of one problem, shared by all TMA kernels."""

    a_row_major: bool  # A K-major (the usual activation layout)
    b_row_major: bool  # B N-major: a (K, N) row-major weight; False means B = w.t() (K-major)
    tma_store: bool  # out can be written by TMA (row-major, aligned); otherwise masked stores
    scale_a: Scaling
    scale_b: Scaling
    has_bias: bool

    def constexprs(self, fast_accum: bool) -> dict:
        """The kernels' layout and epilogue constexprs (same names in every TMA kernel)."""
        return dict(
            A_ROW_MAJOR=self.a_row_major, B_ROW_MAJOR=self.b_row_major, TMA_STORE=self.tma_store,
            SCALE_A=int(self.scale_a), SCALE_B=int(self.scale_b), HAS_BIAS=self.has_bias, FAST_ACCUM=fast_accum,
        )


def tma_layout(args: GemmArgs) -> Layout | str:
    """Layout flags for the TMA kernels, or the reason TMA cannot describe the operands."""
    if args.m == 0 or args.n == 0 or args.k == 0:
        return "a zero-size dimension (the plan layer returns those without a kernel)"
    if args.block_scaling is not None:
        return "block scales (1x128 / 128x128) are applied by the block-scaled kernels only"
    a_row = tma.contiguous_dim(args.a) == 1
    b_row = tma.contiguous_dim(args.b) == 1
    if args.is_fp8 and not (a_row and not b_row):
        # fp8 wgmma reads both operands K-major from shared memory: A row-major, B column-major.
        return "fp8 TMA kernels need A row-major and B column-major (the torch._scaled_mm layout)"
    for t, name, row in ((args.a, "a", a_row), (args.b, "b", b_row)):
        reason = tma.operand_reason(t, name, row)
        if reason:
            return reason
    return Layout(
        a_row_major=a_row,
        b_row_major=b_row,
        tma_store=tma.store_reason(args.out) is None,
        scale_a=Scaling.of(args.scale_a),
        scale_b=Scaling.of(args.scale_b),
        has_bias=args.bias is not None,
    )


def tma_supports(args: GemmArgs) -> str | None:
    """``Variant.supports`` of every TMA kernel."""
    layout = tma_layout(args)
    return layout if isinstance(layout, str) else None


def operand_descriptors(args: GemmArgs, layout: Layout, block_m: int, block_n: int, block_k: int, out_block_n: int,
                        a_tma: bool = True):
    """Descriptors for A (unless ``a_tma`` is False: the kernel reads A through pointers), B and
    (when TMA stores) the output tile."""
    a_desc = descriptor(args.a, layout.a_row_major, block_m, block_k) if a_tma else None
    b_desc = descriptor(args.b, layout.b_row_major, block_k, block_n)
    c_desc = descriptor(args.out, True, block_m, out_block_n) if layout.tma_store else None
    return a_desc, b_desc, c_desc


def tma_builder(name: str, candidates, heuristic, kernel_call, *, direct: bool = True, **call_options):
    """``Variant.build`` of a TMA family: layout flags and config (tuned or heuristic) resolved
    once; the plan serves every same-signature problem.

    ``kernel_call(args, config, layout, **call_options)`` returns the :class:`KernelCall`. Tuning
    times Triton's own launches; the plan then launches directly when it can. ``direct=False``
    keeps Triton's launcher always (kernels that need its scratch allocator).
    """

    def build(args: GemmArgs, config=None) -> Plan:
        layout = tma_layout(args)
        if isinstance(layout, str):
            raise ValueError(f"{name} cannot run this problem: {layout}")
        if config is None:
            config = tuning.select(name, args, candidates, heuristic,
                                   lambda c: kernel_call(args, c, layout, **call_options).launch())
        elif field := config.grouped_only():
            raise ValueError(f"{name}: config {config.label()} has {field}, which only triton.grouped runs")
        elif not config.is_valid(args.a.element_size(), args.b.element_size(), args.out.element_size()):
            need = config.smem_bytes(args.a.element_size(), args.b.element_size(), args.out.element_size())
            raise ValueError(f"{name}: config {config.label()} does not fit {args.a.dtype} x {args.b.dtype} -> "
                             f"{args.out.dtype} (TritonGemmConfig.is_valid: pow2 tiles, a TMA box row of >= 32 "
                             f"bytes, 4 or 8 warps; {need} bytes of shared memory)")
        fast = direct_launch(name, kernel_call(args, config, layout, **call_options)) if direct else None
        if fast is not None:
            return Plan(name, config, fast, fast.device_index, direct=True)

        def launch(a, b, out, scale_a, scale_b, bias) -> None:
            kernel_call(GemmArgs(a, b, out, scale_a, scale_b, bias, args.fast_accum), config, layout,
                        **call_options).launch()

        return Plan(name, config, launch, args.out.get_device())

    # ``tmagemm inspect`` finds a variant's module (and its aot_spec) through build.__module__.
    build.__module__ = kernel_call.__module__
    return build


def example_args(a_dtype: torch.dtype, out_dtype: torch.dtype, m: int = 4096, n: int = 4096, k: int = 4096) -> GemmArgs:
    """CPU operands in the layouts the public API passes (fp8: A row-major, B = w.t() K-major with
    tensor-wise scales; 16-bit: both row-major), for deriving ahead-of-time compile specs."""
    fp8 = a_dtype.itemsize == 1
    a = torch.empty(m, k, dtype=a_dtype)
    b = torch.empty(n, k, dtype=torch.float8_e4m3fn).t() if fp8 else torch.empty(k, n, dtype=a_dtype)
    out = torch.empty(m, n, dtype=out_dtype)
    scale = torch.ones(1, dtype=torch.float32) if fp8 else None
    return GemmArgs(a, b, out, scale, scale, None, True)
