"""Grouped GEMMs for Mixture-of-Experts: ``grouped_mm`` (bf16/fp16) and ``grouped_scaled_mm`` (fp8).

Drop-ins for ``torch._grouped_mm`` / ``torch._scaled_grouped_mm`` where the contracts overlap
(a 2-D ``a`` with ``offs``, 3-D ``a`` x 3-D ``b``, and for ``grouped_mm`` 2-D x 2-D with the
groups along K), plus DeepGEMM's masked layout; ``grouped_mm`` is differentiable (ops.py):

* contiguous: a (M_total, K), rows sorted by expert; b (E, K, N); ``offs`` (E,) int32 on the
  device, the cumulative group ends; out (M_total, N). Group g is rows [end_{g-1}, end_g) with
  end_g = min(max(offs[0..g], 0), M_total) (a running maximum: decreasing offsets give empty
  groups, offsets past M_total stop there). Rows past the last end are not written.
* masked: a (E, max_m, K); ``masked_m`` (E,) int32 on the device, valid rows per expert
  (clamped to [0, max_m]); out (E, max_m, N). Rows past an expert's count are not written.
* batched (neither given): a (E, M, K) x b (E, K, N) -> (E, M, N), every row valid.
* groups along K (``grouped_mm``): a (M, K_total) x b (K_total, N) with ``offs`` the cumulative
  group ends along K_total (the same rule) -> (E, M, N), ``out[g] = a[:, K_g] @ b[K_g]``; the
  weight gradient ``grouped_mm(x.t(), dy, offs=offs)``.

Counts stay on the device: no call reads them on the host, so a call captures into a CUDA graph
and replays with new counts. Under torch.compile both functions trace as the torch ops
``torch.ops.tmagemm.grouped_mm`` / ``grouped_scaled_mm`` (and their ``_out`` forms, ops.py), so
``fullgraph=True`` and ``mode="reduce-overhead"`` work. Checks that need no sync (dtypes,
devices, shapes, layouts) raise TypeError / ValueError naming the argument; counts that are
wrong at run time are clamped in the kernel as above (never an out-of-bounds access). Each call
signature is checked and planned once (a key built like ``plan.call_key``, stored in the plan
layer's one cache through ``plan.remember`` / ``plan.cached``); later calls with it go straight
to the launch.
docs/grouped.md has the contracts, the scheduler and the limitations.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import torch

from . import tma
from .api import check_runtime_device, parse_recipe, pick_recipe
from .device import on_device
from .plan import Plan, cached, cached_calls, remember, tensor_key

_HALF = (torch.bfloat16, torch.float16)
_OUT = (torch.bfloat16, torch.float16, torch.float32)
_FP8 = torch.float8_e4m3fn
BLOCK = 128  # the block-scaled recipes' block edge


class GroupLayout(enum.IntEnum):
    """How the rows of A are split into groups (the kernel's LAYOUT)."""

    CONTIGUOUS = 0  # a (M_total, K), offs (E,) cumulative ends
    MASKED = 1  # a (E, max_m, K), masked_m (E,) rows per expert
    BATCHED = 2  # a (E, M, K), every row valid


class GroupScaling(enum.IntEnum):
    """Where fp8 dequantization scales apply (the kernel's SCALING)."""

    NONE = 0  # 16-bit inputs
    EPILOGUE = 1  # tensor- or row-wise: the finished fp32 accumulator is scaled
    BLOCK = 2  # 1x128 / 128x128 block scales: each 128-deep k-block's product is scaled into fp32


class GroupedArgs(NamedTuple):
    """Checked operands of one grouped GEMM (the problem a plan is built for).

    a: (M_total, K) or (E, max_m, K), K contiguous; b: (E, K, N), K-major (``b_k_major``) or
    N-major; out: (M_total, N) or (E, max_m, N), any strides; counts: offs or masked_m (None
    when BATCHED). Scales are the user's tensors, read through ``scale_a_strides`` (expert, row,
    k-block) and ``scale_b_strides`` (expert, column or column block, k-block), 0 along
    broadcast axes: tensor- and row-wise scales are strided views of the same indexing, so
    nothing is copied. ``b_per_channel``: block mode reads scale_b per column (tensor, row,
    1x128 recipes) rather than per 128-column block. bias: (E, N), read through its strides.
    """

    a: torch.Tensor
    b: torch.Tensor
    out: torch.Tensor
    counts: torch.Tensor | None
    scale_a: torch.Tensor | None
    scale_b: torch.Tensor | None
    bias: torch.Tensor | None
    layout: GroupLayout
    b_k_major: bool
    scaling: GroupScaling = GroupScaling.NONE
    scale_a_strides: tuple = (0, 0, 0)
    scale_b_strides: tuple = (0, 0, 0)
    b_per_channel: bool = False
    fast_accum: bool = True

    @property
    def e(self) -> int:
        return self.b.shape[0]

    @property
    def m(self) -> int:
        """Rows of A per group dimension: M_total (CONTIGUOUS) or max_m."""
        return self.a.shape[-2]

    @property
    def k(self) -> int:
        return self.b.shape[1]

    @property
    def n(self) -> int:
        return self.b.shape[2]

    @property
    def is_fp8(self) -> bool:
        return self.a.element_size() == 1

    @property
    def operands(self) -> tuple:
        """What a grouped plan's launch takes: ``(a, b, out, scale_a, scale_b, bias, counts)``."""
        return self.a, self.b, self.out, self.scale_a, self.scale_b, self.bias, self.counts


class ReduceArgs(NamedTuple):
    """Checked operands of a grouped GEMM over the reduction dimension (``torch._grouped_mm``'s
    2-D x 2-D form; the weight gradient of the other forms): ``out[g] = a[:, K_g] @ b[K_g, :]``.

    a: (M, K_total), contiguous along K_total (``a_k_major``) or along M; b: (K_total, N),
    contiguous along N (``b_n_major``) or along K_total; out: (E, M, N), any strides. The groups
    split K_total: CONTIGUOUS, ``counts`` = offs, the cumulative group ends (the row rule of the
    other forms); MASKED, group g is the first clamp(counts[g], 0, rows) of its ``rows``
    (K_total = E x rows); BATCHED (counts None), all ``rows`` of each group.
    """

    a: torch.Tensor
    b: torch.Tensor
    out: torch.Tensor
    counts: torch.Tensor | None
    layout: GroupLayout
    e: int
    rows: int
    a_k_major: bool
    b_n_major: bool

    @property
    def m(self) -> int:
        return self.a.shape[0]

    @property
    def k(self) -> int:
        return self.a.shape[1]

    @property
    def n(self) -> int:
        return self.b.shape[1]

    @property
    def operands(self) -> tuple:
        """The grouped plans' launch operands: ``(a, b, out, scale_a, scale_b, bias, counts)``."""
        return self.a, self.b, self.out, None, None, None, self.counts


# ---------------------------------------------------------------------------------- checks


def _tensor(t, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def _same_device(t: torch.Tensor, name: str, dev: torch.device) -> None:
    if t.device != dev:
        raise ValueError(f"{name} is on {t.device} but a is on {dev}; move all tensors to one device")


def _counts(t, name: str, e: int, dev: torch.device) -> None:
    _tensor(t, name)
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {t.dtype}")
    if t.dim() != 1 or t.shape[0] != e:
        raise ValueError(f"{name} must be 1-D with one entry per expert ({e},), got shape {tuple(t.shape)}")
    if e > 1 and t.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous, got stride {tuple(t.stride())}")
    _same_device(t, name, dev)


def _layout(a, b, offs, masked_m, fp8: bool, tracing: bool = False):
    """(GroupLayout, b_k_major, counts) of checked operands; raises naming the argument.
    ``tracing``: torch.compile's fake tensors, which have no base address to check yet."""
    _tensor(a, "a")
    _tensor(b, "b")
    if b.dim() != 3:
        raise ValueError(f"b must be 3-D (E, K, N){'' if fp8 else ' or 2-D (K_total, N)'}, got shape {tuple(b.shape)}")
    e, k, n = b.shape
    if offs is not None and masked_m is not None:
        raise ValueError("pass offs (contiguous layout, 2-D a) or masked_m (masked layout, 3-D a), not both")
    if offs is not None:
        if a.dim() != 2:
            raise ValueError(f"a must be 2-D (M_total, K) with offs, got shape {tuple(a.shape)}")
        layout, counts = GroupLayout.CONTIGUOUS, offs
    else:
        if a.dim() == 2:
            raise ValueError("offs is required for a 2-D a (M_total, K): the cumulative row ends of the groups")
        if a.dim() != 3:
            raise ValueError(f"a must be 2-D (M_total, K) with offs or 3-D (E, max_m, K), got shape {tuple(a.shape)}")
        if a.shape[0] != e:
            raise ValueError(f"a has {a.shape[0]} experts (shape {tuple(a.shape)}) but b has {e} (shape {tuple(b.shape)})")
        layout, counts = (GroupLayout.BATCHED, None) if masked_m is None else (GroupLayout.MASKED, masked_m)
    if a.shape[-1] != k:
        raise ValueError(f"inner dimensions differ: a is {tuple(a.shape)} (..., K) but b is {tuple(b.shape)} (E, K, N); "
                         f"a.shape[-1] ({a.shape[-1]}) must equal b.shape[1] ({k})")
    if a.shape[-2] >= 2**31:
        raise ValueError(f"a has {a.shape[-2]} rows; grouped GEMMs index rows with int32 (< 2^31)")
    dev = a.device
    _same_device(b, "b", dev)
    if counts is not None:
        _counts(counts, "offs" if layout == GroupLayout.CONTIGUOUS else "masked_m", e, dev)
    # Layouts: A K-major; b K-major (fp8 wgmma needs it) or, for 16-bit, N-major.
    k_major = k <= 1 or b.stride(1) == 1
    n_major = n <= 1 or b.stride(2) == 1
    if fp8 and not k_major:
        raise ValueError(f"b must be K-major for fp8 (b.stride(1) == 1), got stride {tuple(b.stride())}; "
                         "pass w.transpose(1, 2) of (E, N, K) row-major weights")
    if not (k_major or n_major):
        raise ValueError(f"b (E, K, N) must be contiguous along K or N, got stride {tuple(b.stride())}")
    b_k_major = k_major and (fp8 or not n_major or (k > 1 and b.stride(1) == 1))
    if k > 0 and min(a.shape[:-1] + (n,)) > 0:
        for t, name, dims in ((a, "a", tuple(range(a.dim()))), (b, "b", (0, 2, 1) if b_k_major else (0, 1, 2))):
            reason = tma.map_reason(t, name, dims, address=not tracing)
            if reason:
                raise ValueError(reason)
    return layout, b_k_major, counts


def _out(out, shape: tuple, out_dtype: torch.dtype, dev: torch.device,
         allocate: bool = True) -> torch.Tensor | None:
    if out_dtype not in _OUT:
        raise TypeError(f"out_dtype must be one of torch.bfloat16, torch.float16, torch.float32; got {out_dtype}")
    if out is None:
        return torch.empty(shape, dtype=out_dtype, device=dev) if allocate else None
    _tensor(out, "out")
    if tuple(out.shape) != shape:
        raise ValueError(f"out has shape {tuple(out.shape)} but the result is {shape}")
    if out.dtype != out_dtype:
        raise TypeError(f"out has dtype {out.dtype} but out_dtype is {out_dtype}")
    _same_device(out, "out", dev)
    return out


def _out_shape(a: torch.Tensor, b: torch.Tensor) -> tuple:
    return (*a.shape[:-1], b.shape[2])


def _no_grad(a, b) -> None:
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        raise ValueError("grouped_scaled_mm (fp8) does not support automatic differentiation; call it under "
                         "torch.no_grad() (grouped_mm's 16-bit GEMMs are differentiable)")


def mm_args(a, b, *, offs=None, masked_m=None, out_dtype=None, out=None, tracing=False) -> GroupedArgs:
    """Check the arguments of :func:`grouped_mm` and return the problem (``out`` allocated).
    ``tracing``: torch.compile is tracing (fake tensors): no base addresses are checked and no
    output is allocated (the problem's ``out`` is the caller's, maybe None)."""
    _tensor(a, "a")
    _tensor(b, "b")
    if a.dtype not in _HALF or b.dtype != a.dtype:
        raise TypeError(f"a and b must both be bfloat16 or both float16, got a {a.dtype} and b {b.dtype}"
                        + ("; use grouped_scaled_mm for fp8" if a.element_size() == 1 else ""))
    out_dtype = a.dtype if out_dtype is None else out_dtype
    if b.dim() == 2 and a.dim() == 3:
        rows, weights, out_rows = columns_form(a, b, offs, masked_m, out_dtype, out, tracing)
        return mm_args(rows, weights, offs=offs, out_dtype=out_dtype, out=out_rows, tracing=tracing)
    if b.dim() == 2:
        if masked_m is not None:
            raise ValueError("masked_m takes a 3-D a and b; a 2-D b (K_total, N) takes offs, its groups along K_total")
        return reduce_args(a, b, offs, out_dtype, out, tracing)
    layout, b_k_major, counts = _layout(a, b, offs, masked_m, fp8=False, tracing=tracing)
    out = _out(out, _out_shape(a, b), out_dtype, a.device, allocate=not tracing)
    return GroupedArgs(a, b, out, counts, None, None, None, layout, b_k_major)


def columns_form(a, b, offs, masked_m, out_dtype, out, tracing=False):
    """torch's 3-D x 2-D form, ``out[:, N_g] = a[g] @ b[:, N_g]`` with a (G, M, K), b (K, N_total)
    and ``offs`` the cumulative ends of the groups along N_total (the row rule of the other forms),
    checked and turned into the contiguous 2-D x 3-D form of its transpose, ``out^T[N_g] =
    b^T[N_g] @ a[g]^T``: (rows, weights, out rows) = (b^T contiguous along K (a transposing copy
    unless b is column-major), a.transpose(1, 2), the (N_total, M) rows the result is written to:
    ``out.t()``, or new row-major rows (a column-major result) unless tracing)."""
    if masked_m is not None:
        raise ValueError("masked_m takes a 3-D a and b; a 3-D a with a 2-D b (K, N_total) takes offs, its groups "
                         "along N_total")
    if offs is None:
        raise ValueError("offs is required for a 3-D a (G, M, K) with a 2-D b (K, N_total): the cumulative ends of the "
                         "groups along N_total")
    _offsets(offs, a.device)
    g, m, k = a.shape
    if offs.shape[0] != g:
        raise ValueError(f"offs has {offs.shape[0]} groups but a has {g} (shape {tuple(a.shape)})")
    if b.shape[0] != k:
        raise ValueError(f"inner dimensions differ: a is {tuple(a.shape)} (G, M, K) but b is {tuple(b.shape)} (K, "
                         f"N_total); a.shape[2] ({k}) must equal b.shape[0] ({b.shape[0]})")
    _same_device(b, "b", a.device)
    _out(out, (m, b.shape[1]), out_dtype, a.device, allocate=False)
    if b.shape[1] <= 1 or b.shape[0] <= 1 or b.stride(0) == 1:
        rows = b.t()
    elif tracing:
        rows = b.t().contiguous()
    else:  # TMA's transposing copy where it applies (torch's strided copy moved ~0.5 TB/s)
        from .triton.transpose import transposed

        rows = transposed(b)
    if out is None:
        out_rows = None if tracing else torch.empty((b.shape[1], m), dtype=out_dtype, device=a.device)
    else:
        out_rows = out.t()
    return rows, a.transpose(1, 2), out_rows


def _major(t: torch.Tensor, name: str, dims: tuple[str, str]) -> bool:
    """Whether 2-D ``t`` is contiguous along its last dimension (else along its first); raises
    naming ``t`` when along neither."""
    if t.shape[1] <= 1 or t.stride(1) == 1:
        return True
    if t.shape[0] <= 1 or t.stride(0) == 1:
        return False
    raise ValueError(f"{name} {tuple(t.shape)} must be contiguous along {dims[1]} or {dims[0]}, "
                     f"got stride {tuple(t.stride())}")


def _reduce_operands(a, b, out, counts, layout: GroupLayout, e: int, rows: int, out_dtype, tracing: bool,
                     names=("a", "b")) -> ReduceArgs:
    """The checks shared by every reduction-form problem: 2-D a (M, K_total) and b (K_total, N)
    of one 16-bit dtype, each contiguous along one dimension and readable by TMA."""
    if a.dtype not in _HALF or b.dtype != a.dtype:
        raise TypeError(f"{names[0]} and {names[1]} must both be bfloat16 or both float16, got {a.dtype} and {b.dtype}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"{names[0]} {tuple(a.shape)} and {names[1]} {tuple(b.shape)} must share their grouped "
                         f"dimension K_total: {a.shape[1]} != {b.shape[0]}")
    if a.shape[1] >= 2**31:
        raise ValueError(f"K_total = {a.shape[1]}; grouped GEMMs index rows with int32 (< 2^31)")
    dev = a.device
    _same_device(b, names[1], dev)
    a_k_major = _major(a, names[0], ("M", "K_total"))
    b_n_major = _major(b, names[1], ("K_total", "N"))
    if min(a.shape + b.shape) > 0:
        for t, name, row_major in ((a, names[0], a_k_major), (b, names[1], b_n_major)):
            reason = tma.map_reason(t, name, (0, 1) if row_major else (1, 0), address=not tracing)
            if reason:
                raise ValueError(reason)
    out = _out(out, (e, a.shape[0], b.shape[1]), out_dtype, dev, allocate=not tracing)
    return ReduceArgs(a, b, out, counts, layout, e, rows, a_k_major, b_n_major)


def _offsets(offs, dev: torch.device) -> None:
    """Checks of ``offs`` where its length sets E (the 2-D x 2-D form, the zero rows)."""
    _tensor(offs, "offs")
    if offs.dim() != 1:
        raise ValueError(f"offs must be 1-D (E,), one cumulative end per group, got shape {tuple(offs.shape)}")
    _counts(offs, "offs", offs.shape[0], dev)


def reduce_args(a, b, offs, out_dtype=None, out=None, tracing=False) -> ReduceArgs:
    """Check ``grouped_mm``'s 2-D x 2-D form, ``out[g] = a[:, K_g] @ b[K_g, :]`` with ``offs``
    the cumulative ends of the groups along K_total, and return the problem (``out`` allocated;
    ``tracing`` as in :func:`mm_args`)."""
    _tensor(a, "a")
    _tensor(b, "b")
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"the 2-D x 2-D form takes a (M, K_total) and b (K_total, N), got shapes "
                         f"{tuple(a.shape)} and {tuple(b.shape)}")
    if offs is None:
        raise ValueError("offs is required for a 2-D b (K_total, N): the cumulative ends of the groups along K_total")
    _offsets(offs, a.device)
    return _reduce_operands(a, b, out, offs, GroupLayout.CONTIGUOUS, offs.shape[0], 0,
                            a.dtype if out_dtype is None else out_dtype, tracing)


def weight_grad_args(a, grad, offs=None, masked_m=None, out_dtype=None, tracing=False) -> ReduceArgs:
    """The weight gradient of a grouped GEMM ``out = grouped_mm(a, b, ...)``: ``a_g^T @ grad_g``
    per group, (E, K, N), for each layout of ``a``: 2-D with ``offs``, 3-D (E, max_m, K) with
    ``masked_m`` (rows past a count excluded) or with neither (batched). ``grad`` has the
    output's shape; 3-D operands are read as their (E * max_m, .) rows."""
    _tensor(a, "a")
    _tensor(grad, "grad")
    if grad.dim() != a.dim() or grad.shape[:-1] != a.shape[:-1]:
        raise ValueError(f"grad {tuple(grad.shape)} must have the rows of a {tuple(a.shape)}")
    if a.dim() not in (2, 3):
        raise ValueError(f"a must be 2-D (with offs) or 3-D (E, max_m, K), got shape {tuple(a.shape)}")
    a_t, rows_of_grad = _weight_grad_operands(a, grad)
    if a.dim() == 2:
        return reduce_args(a_t, rows_of_grad, offs, out_dtype, tracing=tracing)
    e, rows = a.shape[0], a.shape[1]
    layout = GroupLayout.BATCHED if masked_m is None else GroupLayout.MASKED
    if masked_m is not None:
        _counts(masked_m, "masked_m", e, a.device)
    return _reduce_operands(a_t, rows_of_grad, None, masked_m, layout, e, rows,
                            a.dtype if out_dtype is None else out_dtype, tracing, names=("a", "grad"))


def _weight_grad_operands(a: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reduction form's (a, b) of a weight gradient: ``a^T`` and ``grad`` over their rows (a
    3-D operand's (E * max_m, .) rows)."""
    if a.dim() == 3:
        a, grad = a.reshape(-1, a.shape[2]), grad.reshape(-1, grad.shape[2])
    return a.t(), grad


def _scale_tensor(scale, name: str, dev: torch.device) -> None:
    _tensor(scale, name)
    if scale.dtype != torch.float32:
        raise TypeError(f"{name} must be float32 (a dequantization scale), got {scale.dtype}")
    _same_device(scale, name, dev)


def scale_strides(scale_a, scale_b, layout: GroupLayout, e: int, m: int, n: int, k: int,
                  recipe_a=None, recipe_b=None) -> tuple[GroupScaling, tuple, tuple, bool]:
    """How the fp8 scales apply: ``(scaling, scale_a_strides, scale_b_strides, b_per_channel)``.

    scale_a, per row of A: one element (tensor-wise); row-wise (M_total,) or (M_total, 1)
    (masked/batched: (E, max_m) or (E, max_m, 1)); 1x128 blocks (M_total, KB) (masked/batched:
    (E, max_m, KB)), KB = ceil(K/128). scale_b, per expert: (E,), (E, 1) or (E, 1, 1) (tensor-wise
    per expert; one element: one for all); row-wise (E, N) or (E, 1, N); 128x128 blocks of the
    (N, K) weights (E, ceil(N/128), KB); 1x128 per output channel (E, N, KB). Any strides.
    Where two recipes fit one shape with different meanings (tiny N or K), the first in the order
    tensor, row, 128x128, 1x128 wins unless ``recipe_a`` / ``recipe_b`` name one.
    """
    recipe_a, recipe_b = parse_recipe(recipe_a, "scale_recipe_a"), parse_recipe(recipe_b, "scale_recipe_b")
    kb, nb = -(-k // BLOCK), -(-n // BLOCK)
    rows = (m,) if layout == GroupLayout.CONTIGUOUS else (e, m)
    sa, sb = tuple(scale_a.shape), tuple(scale_b.shape)
    if recipe_a == "128x128":
        raise ValueError("scale_recipe_a: 128x128 blocks apply to the weights (b) only; activations take 1x128")
    a = pick_recipe("scale_a", sa, {"tensor": scale_a.numel() == 1, "row": sa in (rows, rows + (1,)),
                                    "1x128": sa == rows + (kb,)}, recipe_a,
                    lambda: {"tensor": "one element", "row": f"{rows} or {rows + (1,)}", "1x128": f"{rows + (kb,)}"})
    b = pick_recipe("scale_b", sb, {"tensor": scale_b.numel() == 1 or sb in ((e,), (e, 1), (e, 1, 1)),
                                    "row": sb in ((e, n), (e, 1, n)), "128x128": sb == (e, nb, kb),
                                    "1x128": sb == (e, n, kb)}, recipe_b,
                    lambda: {"tensor": f"({e},), ({e}, 1) or one element", "row": f"({e}, {n}) or ({e}, 1, {n})",
                             "128x128": f"({e}, {nb}, {kb})", "1x128": f"({e}, {n}, {kb})"})
    st_a, st_b = scale_a.stride(), scale_b.stride()
    if a == "tensor":
        a_strides = (0, 0, 0)
    else:
        per_expert = 0 if layout == GroupLayout.CONTIGUOUS else st_a[0]
        lead = len(rows) - 1  # the row dimension of the scale
        a_strides = (per_expert, st_a[lead], st_a[lead + 1] if a == "1x128" else 0)
    if b == "tensor":
        b_strides = (st_b[0] if scale_b.dim() and sb[0] == e and e > 1 else 0, 0, 0)
    elif b == "row":
        b_strides = (st_b[0], st_b[-1], 0)
    else:
        b_strides = st_b
    block = a == "1x128" or b in ("128x128", "1x128")
    return (GroupScaling.BLOCK if block else GroupScaling.EPILOGUE), a_strides, tuple(b_strides), b != "128x128"


def scaled_mm_args(a, b, scale_a, scale_b, *, offs=None, masked_m=None, bias=None, out_dtype=torch.bfloat16,
                   out=None, scale_recipe_a=None, scale_recipe_b=None, use_fast_accum=False,
                   tracing=False) -> GroupedArgs:
    """Check the arguments of :func:`grouped_scaled_mm` and return the problem (``out``
    allocated; ``tracing`` as in :func:`mm_args`)."""
    _tensor(a, "a")
    _tensor(b, "b")
    if a.dtype != _FP8:
        raise TypeError(f"a must be float8_e4m3fn, got {a.dtype}" + ("; use grouped_mm for 16-bit inputs"
                                                                      if a.dtype in _HALF else ""))
    if b.dtype != _FP8:
        raise TypeError(f"b must be float8_e4m3fn, got {b.dtype}")
    if not isinstance(use_fast_accum, bool):
        raise TypeError(f"use_fast_accum must be a bool, got {type(use_fast_accum).__name__}")
    layout, b_k_major, counts = _layout(a, b, offs, masked_m, fp8=True, tracing=tracing)
    dev = a.device
    e, k, n = b.shape
    _scale_tensor(scale_a, "scale_a", dev)
    _scale_tensor(scale_b, "scale_b", dev)
    scaling, sa_strides, sb_strides, per_channel = scale_strides(
        scale_a, scale_b, layout, e, a.shape[-2], n, k, scale_recipe_a, scale_recipe_b)
    if bias is not None:
        _tensor(bias, "bias")
        if tuple(bias.shape) != (e, n):
            raise ValueError(f"bias has shape {tuple(bias.shape)}; expected ({e}, {n}), one row per expert")
        if bias.dtype not in _OUT:
            raise TypeError(f"bias must be bfloat16, float16 or float32, got {bias.dtype}")
        _same_device(bias, "bias", dev)
    _no_grad(a, b)
    out = _out(out, _out_shape(a, b), out_dtype, dev, allocate=not tracing)
    return GroupedArgs(a, b, out, counts, scale_a, scale_b, bias, layout, b_k_major, scaling, sa_strides,
                       sb_strides, per_channel, use_fast_accum)


# ---------------------------------------------------------------------------------- execution


class _Call:
    """One cached call signature: its plan and the output it allocates (shaped like ``out``)."""

    __slots__ = ("plan", "out_shape", "out_dtype", "device")

    def __init__(self, plan: Plan, out: torch.Tensor):
        self.plan = plan
        self.out_shape, self.out_dtype, self.device = tuple(out.shape), out.dtype, out.device

    def __call__(self, a, b, out, scale_a, scale_b, bias, counts) -> torch.Tensor:
        if out is None:
            out = torch.empty(self.out_shape, dtype=self.out_dtype, device=self.device)
        self.plan.run(a, b, out, scale_a, scale_b, bias, counts)
        return out


def run(args: GroupedArgs, config=None, key=None, num_sms: int | None = None) -> torch.Tensor:
    """Write the checked grouped GEMM into ``args.out`` and return it, planning once per ``key``
    (None: do not remember). The native kernel (cuda/grouped.py) runs what it supports with
    groups above decode size, the Triton kernel the rest. ``config`` (a TritonGemmConfig or a
    NativeGemmConfig, which also picks the kernel) / ``num_sms`` override the heuristic and the
    persistent width (tests, benchmarks). E, M or N of zero return without a kernel; K of zero runs the
    kernel's epilogue alone (zeros plus each group's bias row), since which rows to write is on
    the device. Plans made during CUDA-graph capture are not kept."""
    if args.a.device.type != "meta":
        check_runtime_device(args.a.device, args.a.dtype)
    if isinstance(args, ReduceArgs):
        return _run_reduce(args, config, key)
    if args.e == 0 or args.m == 0 or args.n == 0 or args.a.device.type == "meta":
        return args.out
    from .cuda import gemm as native_gemm
    from .cuda import grouped as native
    from .triton import matmul_grouped

    with on_device(args.out.device):
        if isinstance(config, native_gemm.NativeGemmConfig) or (config is None and native.preferred(args)):
            plan = native.build(args, config, num_sms)
        else:
            plan = matmul_grouped.build(args, config, num_sms)
    plan.run(*args.operands)
    if key is not None and not (args.out.is_cuda and torch.cuda.is_current_stream_capturing()):
        remember(key, _Call(plan, args.out))
    return args.out


def _run_reduce(args: ReduceArgs, config, key) -> torch.Tensor:
    """:func:`run` for the reduction form: the native kernel (``cuda/grouped_k.py``) where it is
    preferred, else the Triton kernel of ``triton/matmul_grouped_k.py``. An empty K_total makes
    every group empty: zeros, without a kernel."""
    if args.e == 0 or args.m == 0 or args.n == 0 or args.a.device.type == "meta":
        return args.out
    if args.k == 0:
        return args.out.zero_()
    from .cuda import grouped_k as native_k
    from .triton import matmul_grouped_k

    with on_device(args.out.device):
        if isinstance(config, native_k.GroupedKConfig) or (config is None and native_k.preferred(args)):
            plan = native_k.build(args, config)
        else:
            plan = matmul_grouped_k.build(args, config)
    plan.run(*args.operands)
    if key is not None and not (args.out.is_cuda and torch.cuda.is_current_stream_capturing()):
        remember(key, _Call(plan, args.out))
    return args.out


def zero_uncovered_rows(out: torch.Tensor, *, offs: torch.Tensor | None = None,
                        masked_m: torch.Tensor | None = None) -> torch.Tensor:
    """Zeros into the rows of a grouped GEMM's output that no group covers (contiguous: past the
    last end of ``offs``; masked: past each expert's count; batched: none), by the row rule of
    the module doc, with the counts read on the device. The gradient of ``a`` needs zeros there;
    only those rows are written. Returns ``out``."""
    counts = offs if masked_m is None else masked_m
    try:
        key = ("grouped_zero_rows", tensor_key(out), tensor_key(offs), tensor_key(masked_m))
        known = cached(key)
    except (AttributeError, TypeError):  # not tensors: the checks say why
        key = known = None
    if known is not None:
        return known(None, None, out, None, None, None, counts)
    _tensor(out, "out")
    if counts is None:  # batched: every row is covered
        return out
    layout = GroupLayout.CONTIGUOUS if masked_m is None else GroupLayout.MASKED
    if out.dim() != (2 if layout == GroupLayout.CONTIGUOUS else 3):
        raise ValueError(f"out {tuple(out.shape)} must be 2-D with offs, 3-D (E, max_m, N) with masked_m")
    if layout == GroupLayout.CONTIGUOUS:
        _offsets(offs, out.device)
    else:
        _counts(masked_m, "masked_m", out.shape[0], out.device)
    if out.numel() == 0 or out.device.type == "meta":
        return out
    from .triton.matmul_grouped import zero_rows_plan

    with on_device(out.device):
        plan = zero_rows_plan(out, counts, layout)
    plan.run(None, None, out, None, None, None, counts)
    if key is not None and not (out.is_cuda and torch.cuda.is_current_stream_capturing()):
        remember(key, _Call(plan, out))
    return out


def cached_plans() -> list[Plan]:
    """The plans of the cached grouped call signatures (in the plan layer's one cache)."""
    return [call.plan for call in cached_calls() if isinstance(call, _Call)]


# ---------------------------------------------------------------------------------- public API


def grouped_mm(a: torch.Tensor, b: torch.Tensor, *, offs: torch.Tensor | None = None,
               masked_m: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Grouped BF16/FP16 GEMM with fp32 accumulation (``torch._grouped_mm``'s 2-D x 3-D, 3-D x 3-D,
    2-D x 2-D and 3-D x 2-D forms, plus the masked layout). Differentiable, except with ``out=``.

    a: (M_total, K) with ``offs``, or (E, max_m, K) with ``masked_m`` (or neither: batched);
    K contiguous. b: (E, K, N), K-major (``w.transpose(1, 2)`` of (E, N, K) weights) or N-major.
    offs / masked_m: (E,) int32 on a's device (see the module doc for the row rule).
    2-D x 2-D: a (M, K_total) and b (K_total, N), each contiguous along either dimension, with
    ``offs`` the cumulative ends of the groups along K_total (the same rule): out (E, M, N),
    ``out[g] = a[:, K_g] @ b[K_g, :]``, zeros for an empty group (the weight gradient of an MoE
    layer: ``grouped_mm(x.t(), dy, offs=offs)``).
    3-D x 2-D: a (G, M, K) and b (K, N_total) with ``offs`` the cumulative ends of the groups
    along N_total: out (M, N_total), ``out[:, N_g] = a[g] @ b[:, N_g]``, run as the 2-D x 3-D form
    of its transpose (b is copied once, by TMA, to be contiguous along K unless it is
    column-major). The result is column-major (the transpose's rows); a row-major ``out`` is
    written through its transpose (stores across its rows: slower).
    out_dtype: defaults to a.dtype; bfloat16, float16 or float32. out: preallocated result;
    rows no group covers keep their values (with out=None they are uninitialised).
    Strides: every non-innermost stride of a and b a multiple of 16 bytes (TMA), as torch requires.
    Under torch.compile, and where a or b requires grad, the call runs as
    ``torch.ops.tmagemm.grouped_mm`` (``_out`` with out=), whose backward is grouped GEMMs too:
    docs/grouped.md, "Autograd".
    """
    needs_grad = (torch.is_grad_enabled() and isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                  and (a.requires_grad or b.requires_grad))
    if torch.compiler.is_compiling() or needs_grad:
        mm_args(a, b, offs=offs, masked_m=masked_m, out_dtype=out_dtype, out=out, tracing=True)
        if out is None:
            return torch.ops.tmagemm.grouped_mm(a, b, offs, masked_m, out_dtype)
        if needs_grad:
            raise ValueError("grouped_mm: out= is not differentiable; call without out= (or under torch.no_grad())")
        torch.ops.tmagemm.grouped_mm_out(a, b, offs, masked_m, out)
        return out
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() == 3 and b.dim() == 2:
        out_dtype = a.dtype if out_dtype is None else out_dtype
        rows, weights, out_rows = columns_form(a, b, offs, masked_m, out_dtype, out)
        grouped_mm(rows, weights, offs=offs, out_dtype=out_dtype, out=out_rows)
        return out_rows.t()
    counts = offs if masked_m is None else masked_m
    try:
        key = ("grouped_mm", tensor_key(a), tensor_key(b), tensor_key(offs), tensor_key(masked_m), tensor_key(out),
               out_dtype)
        known = cached(key)
    except (AttributeError, TypeError):  # not tensors, or an unhashable option: the checks say why
        key = known = None
    if known is not None:
        return known(a, b, out, None, None, None, counts)
    return run(mm_args(a, b, offs=offs, masked_m=masked_m, out_dtype=out_dtype, out=out), key=key)


def weight_grad(a: torch.Tensor, grad: torch.Tensor, *, offs: torch.Tensor | None = None,
                masked_m: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The weight gradient of ``grouped_mm(a, b, offs=offs | masked_m=masked_m)`` for the output
    gradient ``grad``: (E, K, N), ``a_g^T @ grad_g`` over each group's rows (masked: the first
    masked_m[g] of expert g's; an empty group gives zeros). The backward of the op calls it;
    with a 2-D ``a`` it is ``grouped_mm(a.t(), grad, offs=offs)``."""
    if torch.compiler.is_compiling():
        weight_grad_args(a, grad, offs, masked_m, out_dtype, tracing=True)
        return torch.ops.tmagemm.grouped_weight_grad(a, grad, offs, masked_m, out_dtype)
    try:
        key = ("grouped_weight_grad", tensor_key(a), tensor_key(grad), tensor_key(offs), tensor_key(masked_m),
               out_dtype)
        known = cached(key)
    except (AttributeError, TypeError):  # not tensors, or an unhashable option: the checks say why
        key = known = None
    if known is not None:
        return known(*_weight_grad_operands(a, grad), None, None, None, None, offs if masked_m is None else masked_m)
    return run(weight_grad_args(a, grad, offs, masked_m, out_dtype), key=key)


def grouped_scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, *,
                      offs: torch.Tensor | None = None, masked_m: torch.Tensor | None = None,
                      bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
                      out: torch.Tensor | None = None, scale_recipe_a=None, scale_recipe_b=None,
                      use_fast_accum: bool = False) -> torch.Tensor:
    """Grouped FP8 GEMM: ``out[rows of g] = (scale_a * scale_b[g]) * (a[rows of g] @ b[g]) + bias[g]``
    (``torch._scaled_grouped_mm`` for 2-D x 3-D and 3-D x 3-D with row-wise scales, plus
    tensor-wise per expert and the DeepSeek-V3 block recipe, and the masked layout).

    a: float8_e4m3fn, (M_total, K) with ``offs`` or (E, max_m, K) with ``masked_m`` (or neither:
    batched), K contiguous. b: float8_e4m3fn (E, K, N), K-major: ``w.transpose(1, 2)`` of (E, N, K)
    row-major weights. scale_a / scale_b: float32, any strides (see :func:`scale_strides`):
    tensor-wise, row-wise ((M_total,) x (E, N), as torch), or block-wise (scale_a (M_total,
    ceil(K/128)) 1x128, scale_b (E, ceil(N/128), ceil(K/128)) 128x128); block-scaled products are
    promoted into fp32 every 128-deep k-block. scale_recipe_a / scale_recipe_b: "tensor", "row",
    "1x128", "128x128" (or torch's ScalingType), for shapes two recipes fit. bias: (E, N).
    use_fast_accum: tensor/row-wise only: keep wgmma's fp8 accumulation across all of K (False,
    the default as in torch, adds each k-tile's sum into fp32). out_dtype: bfloat16 (default),
    float16 or float32. out: as in :func:`grouped_mm`. Under torch.compile the call traces as
    ``torch.ops.tmagemm.grouped_scaled_mm`` (``_out`` with out=).
    """
    if torch.compiler.is_compiling():
        scaled_mm_args(a, b, scale_a, scale_b, offs=offs, masked_m=masked_m, bias=bias, out_dtype=out_dtype, out=out,
                       scale_recipe_a=scale_recipe_a, scale_recipe_b=scale_recipe_b, use_fast_accum=use_fast_accum,
                       tracing=True)
        recipes = parse_recipe(scale_recipe_a, "scale_recipe_a"), parse_recipe(scale_recipe_b, "scale_recipe_b")
        if out is None:
            return torch.ops.tmagemm.grouped_scaled_mm(a, b, scale_a, scale_b, offs, masked_m, bias, out_dtype,
                                                        *recipes, use_fast_accum)
        torch.ops.tmagemm.grouped_scaled_mm_out(a, b, scale_a, scale_b, offs, masked_m, bias, *recipes,
                                                use_fast_accum, out)
        return out
    counts = offs if masked_m is None else masked_m
    try:
        grad = torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)
        key = ("grouped_scaled_mm", tensor_key(a), tensor_key(b), tensor_key(scale_a), tensor_key(scale_b),
               tensor_key(offs), tensor_key(masked_m), tensor_key(bias), tensor_key(out), out_dtype,
               scale_recipe_a, scale_recipe_b, use_fast_accum, grad)
        known = cached(key)
    except (AttributeError, TypeError):
        key = known = None
    if known is not None:
        return known(a, b, out, scale_a, scale_b, bias, counts)
    args = scaled_mm_args(a, b, scale_a, scale_b, offs=offs, masked_m=masked_m, bias=bias, out_dtype=out_dtype,
                          out=out, scale_recipe_a=scale_recipe_a, scale_recipe_b=scale_recipe_b,
                          use_fast_accum=use_fast_accum)
    return run(args, key=key)


def example_args(a_dtype: torch.dtype = _FP8, out_dtype: torch.dtype = torch.bfloat16, e: int = 8,
                 rows: int = 512, n: int = 4096, k: int = 7168) -> GroupedArgs:
    """CPU operands of a contiguous grouped call (fp8: row-wise scales; b K-major), for deriving
    ahead-of-time compile specs."""
    fp8 = a_dtype == _FP8
    a = torch.empty(e * rows, k, dtype=a_dtype)
    b = torch.empty(e, n, k, dtype=a_dtype).transpose(1, 2)
    offs = torch.arange(1, e + 1, dtype=torch.int32) * rows
    out = torch.empty(e * rows, n, dtype=out_dtype)
    if not fp8:
        return GroupedArgs(a, b, out, offs, None, None, None, GroupLayout.CONTIGUOUS, True)
    sa, sb = torch.ones(e * rows), torch.ones(e, n)
    return GroupedArgs(a, b, out, offs, sa, sb, None, GroupLayout.CONTIGUOUS, True, GroupScaling.EPILOGUE,
                       (0, 1, 0), (n, 1, 0), True, False)
