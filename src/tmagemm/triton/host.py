"""Host-side pieces shared by the Triton GEMM launchers: operand layouts and TMA descriptors.

A 2-D operand is "row-major" when its columns are contiguous (stride(1) == 1) and "col-major"
when its rows are (stride(0) == 1). TMA describes either one as long as the base address and the
leading stride are 16-byte aligned; anything else goes to the pointer kernel.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from .. import envs, tuning
from ..dispatch import GemmArgs
from .common import scale_mode
from .direct import DirectLaunch

_TMA_ALIGN = 16  # bytes: base address and every non-innermost stride
_TMA_MAX_STRIDE = 1 << 40  # bytes


def is_row_major(t: torch.Tensor) -> bool:
    """Columns contiguous. A single column counts as both layouts."""
    return t.stride(1) == 1 or t.shape[1] == 1


def is_col_major(t: torch.Tensor) -> bool:
    return t.stride(0) == 1 or t.shape[0] == 1


def leading_stride(t: torch.Tensor, row_major: bool) -> int:
    """Element stride between rows (row-major) or columns (col-major).

    With a single row (column) the stride is never used to address memory and torch may report any
    value, so use the smallest aligned one instead.
    """
    rows, cols = t.shape
    if row_major:
        if rows > 1:
            return t.stride(0)
        per_16b = _TMA_ALIGN // t.element_size()
        return -(-cols // per_16b) * per_16b
    if cols > 1:
        return t.stride(1)
    per_16b = _TMA_ALIGN // t.element_size()
    return -(-rows // per_16b) * per_16b


def tma_layout_reason(t: torch.Tensor, name: str, row_major: bool) -> str | None:
    """None if TMA can describe ``t`` in the given layout, else why not (names the stride)."""
    if t.data_ptr() % _TMA_ALIGN:
        return f"{name}.data_ptr() is not {_TMA_ALIGN}-byte aligned"
    if row_major and not is_row_major(t):
        return f"{name} is not row-major (stride {tuple(t.stride())})"
    if not row_major and not is_col_major(t):
        return f"{name} is not column-major (stride {tuple(t.stride())})"
    lead_bytes = leading_stride(t, row_major) * t.element_size()
    if lead_bytes % _TMA_ALIGN:
        return f"{name} leading stride of {lead_bytes} bytes is not a multiple of {_TMA_ALIGN}"
    if lead_bytes >= _TMA_MAX_STRIDE:
        return f"{name} leading stride of {lead_bytes} bytes is >= 2^40"
    return None


def descriptor(t: torch.Tensor, row_major: bool, block_rows: int, block_cols: int) -> TensorDescriptor:
    """A host TensorDescriptor over ``t`` as stored in memory (passed to the kernel by value).

    Col-major operands are described through their transpose, so the descriptor's block is
    (block_cols, block_rows) and the kernel transposes the loaded tile.
    """
    rows, cols = t.shape
    lead = leading_stride(t, row_major)
    if row_major:
        return TensorDescriptor(t, [rows, cols], [lead, 1], [block_rows, block_cols])
    return TensorDescriptor(t, [cols, rows], [lead, 1], [block_cols, block_rows])


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Global scratch for device-built tensor maps, from torch's caching allocator (cheap, and
    CUDA-graph safe: inside a capture it comes from the graph's pool)."""
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
    scale_a: int
    scale_b: int
    has_bias: bool

    def constexprs(self, fast_accum: bool) -> dict:
        """The kernels' layout and epilogue constexprs (same names in every TMA kernel)."""
        return dict(
            A_ROW_MAJOR=self.a_row_major, B_ROW_MAJOR=self.b_row_major, TMA_STORE=self.tma_store,
            SCALE_A=self.scale_a, SCALE_B=self.scale_b, HAS_BIAS=self.has_bias, FAST_ACCUM=fast_accum,
        )


def tma_layout(args: GemmArgs) -> Layout | str:
    """Layout flags for the TMA kernels, or the reason TMA cannot describe the operands."""
    if args.m == 0 or args.n == 0 or args.k == 0:
        return "a zero-size dimension (tmagemm.matmul / scaled_mm return those without a kernel)"
    a_row = is_row_major(args.a)
    b_row = is_row_major(args.b) and not (args.is_fp8 and is_col_major(args.b))
    if args.is_fp8 and not (a_row and not b_row):
        # fp8 wgmma reads both operands K-major from shared memory: A row-major, B column-major.
        return "fp8 TMA kernels need A row-major and B column-major (the torch._scaled_mm layout)"
    for t, name, row in ((args.a, "a", a_row), (args.b, "b", b_row)):
        reason = tma_layout_reason(t, name, row)
        if reason:
            return reason
    # A ragged row end (N*itemsize not a multiple of 16 bytes) is stored with masked pointer
    # stores: a TMA store may write the whole last 16-byte chunk of a row (seen with the native
    # kernels), which for a sliced output view would touch the neighbouring columns.
    tma_store = tma_layout_reason(args.out, "out", True) is None and (args.n * args.out.element_size()) % _TMA_ALIGN == 0
    return Layout(
        a_row_major=a_row,
        b_row_major=b_row,
        tma_store=tma_store,
        scale_a=scale_mode(args.scale_a),
        scale_b=scale_mode(args.scale_b),
        has_bias=args.bias is not None,
    )


def tma_supports(args: GemmArgs) -> str | None:
    """``Variant.supports`` of every TMA kernel."""
    layout = tma_layout(args)
    return layout if isinstance(layout, str) else None


# Every TMA GEMM kernel takes its per-call operands first, in this order:
# (a_desc, b_desc, c_desc, c_ptr, scale_a_ptr, scale_b_ptr, bias_ptr); c_desc and c_ptr both
# describe ``out``. Everything after them is fixed by the problem's signature.
GEMM_OPERANDS = 7


def _operands(args: GemmArgs) -> tuple:
    return (args.a, args.b, args.out, args.out, args.scale_a, args.scale_b, args.bias)


def direct_launch(name: str, args: GemmArgs, call, n_operands: int = GEMM_OPERANDS,
                  unspecialized: frozenset = frozenset()) -> DirectLaunch | None:
    """The plan's launch through :mod:`.direct`, or None to keep Triton's launcher (CPU, a
    capture in progress, the knob off, or a kernel whose ABI the direct path does not cover)."""
    if not args.out.is_cuda or envs.interpret() or not envs.direct_launch_enabled():
        return None
    if torch.cuda.is_current_stream_capturing():  # loading a module is not a capturable call
        return None
    fn, grid, positional, constexprs = call
    built = DirectLaunch.build(fn, grid, positional, n_operands, unspecialized, **constexprs)
    if isinstance(built, str):
        warnings.warn(f"{name}: using Triton's launcher ({built})", RuntimeWarning, stacklevel=3)
        return None
    return built


def triton_launch(call) -> None:
    """Run a ``kernel_call`` result through Triton's own launcher."""
    fn, grid, positional, constexprs = call
    fn[grid](*positional, **constexprs)


def tma_planner(name: str, candidates, heuristic, kernel_call, *, direct: bool = True, **call_options):
    """``(prepare, run)`` of a TMA variant: layout flags and config (tuned or heuristic) are
    resolved once in ``prepare``; the launcher it returns serves every same-signature problem.

    ``kernel_call(args, config, layout, **call_options)`` returns ``(jit_fn, grid, positional
    args, constexpr kwargs)`` with the :data:`GEMM_OPERANDS` first. Tuning times Triton's own
    launches; the plan then launches directly when it can (the ``direct`` attribute of the
    returned launcher says which). ``direct=False`` keeps Triton's launcher always (kernels
    that need its scratch allocator).
    """

    def launch(args: GemmArgs, config, layout: Layout) -> None:
        triton_launch(kernel_call(args, config, layout, **call_options))

    def resolve(args: GemmArgs, config):
        layout = tma_layout(args)
        if isinstance(layout, str):
            raise ValueError(f"{name} cannot run this problem: {layout}")
        if config is None:
            config = tuning.select(name, args, candidates, heuristic, lambda c: launch(args, c, layout))
        return layout, config

    def prepare(args: GemmArgs, config=None):
        layout, config = resolve(args, config)
        fast = direct_launch(name, args, kernel_call(args, config, layout, **call_options)) if direct else None
        if fast is not None:

            def launcher(problem: GemmArgs) -> None:
                fast(*_operands(problem))

            launcher.operands = lambda a, b, out, scale_a, scale_b, bias: fast(a, b, out, out, scale_a, scale_b, bias)

        else:

            def launcher(problem: GemmArgs) -> None:
                launch(problem, config, layout)

        launcher.direct = fast is not None
        launcher.config = config
        return launcher

    def run(args: GemmArgs, config=None) -> None:
        """One call through Triton's launcher (no plan is built or kept)."""
        layout, config = resolve(args, config)
        launch(args, config, layout)

    # Belong to the kernel's module (where ``kernel_call`` lives): tools such as ``tmagemm inspect``
    # find a variant's ``aot_spec`` through ``variant.run.__module__``.
    prepare.__module__ = run.__module__ = kernel_call.__module__
    return prepare, run


def operand_descriptors(args: GemmArgs, layout: Layout, block_m: int, block_n: int, block_k: int, out_block_n: int):
    """Descriptors for A, B and (when TMA stores) the output tile."""
    a_desc = descriptor(args.a, layout.a_row_major, block_m, block_k)
    b_desc = descriptor(args.b, layout.b_row_major, block_k, block_n)
    c_desc = descriptor(args.out, True, block_m, out_block_n) if layout.tma_store else None
    return a_desc, b_desc, c_desc


# ------------------------------------------------------------------ AOT specs (tmagemm inspect)

_TL_NAMES = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.float8_e4m3fn: "fp8e4nv",
    torch.float8_e5m2: "fp8e5",
}
_ALIGNED = [["tt.divisibility", 16]]


def aot_tma_spec(fn, name: str, config, a_dtype, out_dtype, out_block_n: int, **kernel_constexprs):
    """The :class:`~tmagemm.inspection.KernelSpec` of a TMA GEMM kernel in the common case: fp8
    (A row-major, B K-major, tensor-wise scales) or 16-bit (both row-major), aligned row-major
    output stored through TMA, no bias. ``kernel_constexprs`` are the kernel's own extra knobs."""
    from ..inspection import KernelSpec

    fp8 = a_dtype.itemsize == 1
    a = _TL_NAMES[a_dtype]
    b = _TL_NAMES[torch.float8_e4m3fn] if fp8 else a
    c = _TL_NAMES[out_dtype]
    b_block = f"{config.block_n}, {config.block_k}" if fp8 else f"{config.block_k}, {config.block_n}"
    device_desc = kernel_constexprs.get("DEVICE_DESC", False)
    sig = {
        "a_desc": f"*{a}" if device_desc else f"tensordesc<{a}[{config.block_m}, {config.block_k}]>",
        "b_desc": f"*{b}" if device_desc else f"tensordesc<{b}[{b_block}]>",
        "c_desc": "constexpr" if device_desc else f"tensordesc<{c}[{config.block_m}, {out_block_n}]>",
        "c_ptr": f"*{c}",
        "scale_a_ptr": "*fp32" if fp8 else "constexpr",
        "scale_b_ptr": "*fp32" if fp8 else "constexpr",
        "bias_ptr": "constexpr",
        **{arg: "i32" for arg in ("M", "N", "K", "stride_cm", "stride_cn")},
    }
    consts = {
        "bias_ptr": None,
        "BLOCK_M": config.block_m, "BLOCK_N": config.block_n, "BLOCK_K": config.block_k, "GROUP_M": config.group_m,
        "A_ROW_MAJOR": True, "B_ROW_MAJOR": not fp8, "TMA_STORE": True,
        "SCALE_A": int(fp8), "SCALE_B": int(fp8), "HAS_BIAS": False, "FAST_ACCUM": True,
        **kernel_constexprs,
    }
    if device_desc:
        consts["c_desc"] = None
    if not fp8:
        consts.update(scale_a_ptr=None, scale_b_ptr=None)
    if "lead_a" in fn.arg_names:
        sig.update(lead_a="i32", lead_b="i32")
    sig.update({key: "constexpr" for key in consts if key.isupper()})
    aligned = ("c_ptr", "K", "stride_cm", "lead_a", "lead_b") + (("a_desc", "b_desc") if device_desc else ())
    attrs = {arg: _ALIGNED for arg in aligned if arg in sig}
    return KernelSpec(fn, sig, consts, config.num_warps, config.num_stages, name, attrs)
