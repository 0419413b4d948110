"""Tensor maps (TMA descriptors) for Hopper kernels: tables, validation, encoding, swizzle reference.

A tensor map tells the TMA unit how a global tensor is laid out (data type, up to 5 dimensions,
byte strides) and which box one copy moves to or from shared memory (box shape, element strides,
swizzle, interleave, L2 promotion, out-of-bounds fill). The driver encodes it into 128 opaque bytes
(``cuTensorMapEncodeTiled``) that a kernel receives by value as ``const __grid_constant__
CUtensorMap``.

Dimension order: the driver lists dimensions **innermost first** (dimension 0 is the contiguous
one). :func:`make_tensor_map` takes shapes in torch order (outermost first, like ``tensor.shape``)
and reverses them; :func:`encode_tiled` and :class:`TiledParams` use the driver's order.

Every documented rule is checked in Python (:meth:`TiledParams.validate`), without a GPU, and a
failure names the rule and the value. The driver is reached through ``libcuda`` with ctypes
because the descriptor must sit at a 64-byte aligned address, which a ``cuda.bindings``
``CUtensorMap`` object does not guarantee; the map lives in an aligned buffer owned by
:class:`TensorMap`.

Not supported: the Blackwell-only packed data types (16U4/16U6) and 128B_ATOM swizzles, and
im2col maps.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import torch


class TensorMapError(ValueError):
    """A tensor-map parameter breaks a documented rule, or the driver refused the encoding."""


# ---------------------------------------------------------------------------------------------
# Tables (values are CUDA driver ABI constants from cuda.h)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DataType:
    name: str
    code: int  # CUtensorMapDataType
    size: int  # bytes per element
    is_float: bool  # NaN out-of-bounds fill is allowed only for floating-point types


DATA_TYPES: dict[str, DataType] = {
    t.name: t
    for t in (
        DataType("uint8", 0, 1, False),
        DataType("uint16", 1, 2, False),
        DataType("uint32", 2, 4, False),
        DataType("int32", 3, 4, False),
        DataType("uint64", 4, 8, False),
        DataType("int64", 5, 8, False),
        DataType("float16", 6, 2, True),
        DataType("float32", 7, 4, True),
        DataType("float64", 8, 8, True),
        DataType("bfloat16", 9, 2, True),
        DataType("float32_ftz", 10, 4, True),
        DataType("tfloat32", 11, 4, True),
        DataType("tfloat32_ftz", 12, 4, True),
    )
}

# Swizzle mode -> (CUtensorMapSwizzle, span in bytes; 0 = no swizzle).
SWIZZLES: dict[str, tuple[int, int]] = {"none": (0, 0), "32B": (1, 32), "64B": (2, 64), "128B": (3, 128)}
INTERLEAVES: dict[str, int] = {"none": 0, "16B": 1, "32B": 2}
L2_PROMOTIONS: dict[str, int] = {"none": 0, "64B": 1, "128B": 2, "256B": 3}
# "zero" (CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE fills zeros) or "nan" (NAN_REQUEST_ZERO_FMA).
OOB_FILLS: dict[str, int] = {"zero": 0, "nan": 1}

MAX_RANK = 5
MAX_BOX_DIM = 256
MAX_ELEMENT_STRIDE = 8
MAX_GLOBAL_DIM = 1 << 32
MAX_GLOBAL_STRIDE = 1 << 40


def _torch_dtype_table() -> dict[torch.dtype, str]:
    """torch dtype -> TMA data type. Types TMA has no name for move as same-width raw bits."""
    table = {
        torch.uint8: "uint8",
        torch.int8: "uint8",
        torch.bool: "uint8",
        torch.int16: "uint16",
        torch.float16: "float16",
        torch.bfloat16: "bfloat16",
        torch.int32: "int32",
        torch.float32: "float32",
        torch.int64: "int64",
        torch.float64: "float64",
        torch.complex32: "uint32",
        torch.complex64: "uint64",
    }
    # Newer dtypes, present depending on the torch version. fp8/fp4 have no TMA type: TMA only
    # moves bytes, so uint8 is exact (and NaN fill is unavailable for them, as for any uint8).
    for name, tma in (
        ("uint16", "uint16"),
        ("uint32", "uint32"),
        ("uint64", "uint64"),
        ("float8_e4m3fn", "uint8"),
        ("float8_e5m2", "uint8"),
        ("float8_e4m3fnuz", "uint8"),
        ("float8_e5m2fnuz", "uint8"),
        ("float8_e8m0fnu", "uint8"),
        ("float4_e2m1fn_x2", "uint8"),
    ):
        dtype = getattr(torch, name, None)
        if isinstance(dtype, torch.dtype):
            table[dtype] = tma
    return table


@functools.lru_cache(maxsize=1)
def _torch_dtypes() -> dict[torch.dtype, str]:
    return _torch_dtype_table()


def tma_dtype(dtype: torch.dtype | str) -> DataType:
    """The TMA data type for a torch dtype or a TMA type name (e.g. "tfloat32")."""
    if isinstance(dtype, str):
        if dtype not in DATA_TYPES:
            raise TypeError(f"unknown TMA data type {dtype!r}; known: {sorted(DATA_TYPES)}")
        return DATA_TYPES[dtype]
    name = _torch_dtypes().get(dtype)
    if name is None:
        raise TypeError(
            f"torch dtype {dtype} has no TMA data type (TMA elements are 1, 2, 4 or 8 bytes); "
            "view the tensor as a narrower dtype with an extra innermost dimension"
        )
    return DATA_TYPES[name]


# ---------------------------------------------------------------------------------------------
# Parameters and validation
# ---------------------------------------------------------------------------------------------


def _option(table: dict, value: str, what: str):
    if value not in table:
        raise TensorMapError(f"{what} must be one of {list(table)}, got {value!r}")
    return table[value]


@dataclass(frozen=True)
class TiledParams:
    """Every argument of ``cuTensorMapEncodeTiled``, in the driver's innermost-first order.

    global_strides has rank-1 entries: the byte stride of dimensions 1..rank-1 (dimension 0 is
    contiguous by definition).
    """

    dtype: str
    global_address: int
    global_dims: tuple[int, ...]
    global_strides: tuple[int, ...]
    box_dims: tuple[int, ...]
    element_strides: tuple[int, ...]
    interleave: str = "none"
    swizzle: str = "128B"
    l2_promotion: str = "128B"
    oob_fill: str = "zero"

    @property
    def rank(self) -> int:
        return len(self.global_dims)

    @property
    def element_size(self) -> int:
        return tma_dtype(self.dtype).size

    @property
    def swizzle_span(self) -> int:
        return _option(SWIZZLES, self.swizzle, "swizzle")[1]

    @property
    def box_elements(self) -> tuple[int, ...]:
        """Elements one copy moves per dimension: ceil(box/element_stride); dimension 0's element
        stride is ignored without interleave."""
        counts = []
        for i, (box, step) in enumerate(zip(self.box_dims, self.element_strides)):
            if i == 0 and self.interleave == "none":
                step = 1
            counts.append(-(-box // step))
        return tuple(counts)

    @property
    def box_bytes(self) -> int:
        """Bytes one load writes to shared memory (the mbarrier expect-tx count)."""
        total = self.element_size
        for count in self.box_elements:
            total *= count
        return total

    @property
    def smem_row_bytes(self) -> int:
        """Shared-memory pitch of one inner row of the box: with a swizzle, rows are padded to
        the span (measured on H100: a 64-byte row under 128B swizzle occupies 128 bytes)."""
        inner = self.box_elements[0] * self.element_size
        span = self.swizzle_span
        return max(inner, span) if span and self.interleave == "none" else inner

    @property
    def smem_bytes(self) -> int:
        """Shared-memory footprint of one box (allocate this much; expect-tx stays box_bytes)."""
        total = self.smem_row_bytes
        for count in self.box_elements[1:]:
            total *= count
        return total

    def validate_store(self) -> None:
        """Extra rule for maps used by TMA *stores*, measured on H100 (driver 580): when the inner
        extent ``global_dims[0] * element_size`` is not a multiple of 16 bytes, a store writes
        the whole last 16-byte chunk of each row, i.e. up to 15 bytes past the tensor into the
        row padding. Refuse such maps for outputs so no neighbouring data is overwritten."""
        inner = self.global_dims[0] * self.element_size
        if inner % 16:
            raise TensorMapError(
                f"TMA store target: inner extent global_dims[0]*element_size must be a multiple of 16 bytes "
                f"(stores write whole 16-byte chunks at the row end), got {self.global_dims[0]}*{self.element_size} = {inner}"
            )

    def describe(self) -> str:
        return (
            f"dtype={self.dtype} rank={self.rank} address=0x{self.global_address:x} "
            f"global_dims={list(self.global_dims)} global_strides={list(self.global_strides)} "
            f"box_dims={list(self.box_dims)} element_strides={list(self.element_strides)} "
            f"interleave={self.interleave} swizzle={self.swizzle} l2_promotion={self.l2_promotion} "
            f"oob_fill={self.oob_fill} (dimensions innermost first)"
        )

    def validate(self) -> None:
        """Raise TensorMapError naming the first broken rule of cuTensorMapEncodeTiled."""
        dtype = tma_dtype(self.dtype)
        _option(INTERLEAVES, self.interleave, "interleave")
        span = self.swizzle_span
        _option(L2_PROMOTIONS, self.l2_promotion, "l2_promotion")
        _option(OOB_FILLS, self.oob_fill, "oob_fill")
        rank = self.rank
        if not 1 <= rank <= MAX_RANK:
            raise TensorMapError(f"rank must be 1..{MAX_RANK}, got {rank}")
        if self.interleave != "none" and rank < 3:
            raise TensorMapError(f"interleave={self.interleave} needs rank >= 3, got rank {rank}")
        for field, n in (("global_strides", rank - 1), ("box_dims", rank), ("element_strides", rank)):
            got = len(getattr(self, field))
            if got != n:
                raise TensorMapError(f"{field} needs {n} entries for rank {rank}, got {got}")

        address_align = 32 if self.interleave == "32B" else 16
        if self.global_address % address_align:
            raise TensorMapError(
                f"global address must be {address_align}-byte aligned"
                f"{' with interleave=32B' if address_align == 32 else ''}, got 0x{self.global_address:x}"
            )
        for i, dim in enumerate(self.global_dims):
            if not 1 <= dim <= MAX_GLOBAL_DIM:
                raise TensorMapError(f"global_dims[{i}] must be in 1..2^32, got {dim}")
        stride_align = 32 if self.interleave == "32B" else 16
        for i, stride in enumerate(self.global_strides, start=1):
            if stride % stride_align:
                raise TensorMapError(
                    f"global stride of dimension {i} must be a multiple of {stride_align} bytes, got {stride}"
                )
            if not 0 <= stride < MAX_GLOBAL_STRIDE:
                raise TensorMapError(f"global stride of dimension {i} must be below 2^40 bytes, got {stride}")
        for i, box in enumerate(self.box_dims):
            if not 1 <= box <= MAX_BOX_DIM:
                raise TensorMapError(f"box_dims[{i}] must be in 1..{MAX_BOX_DIM}, got {box}")
        inner_bytes = self.box_dims[0] * dtype.size
        if self.interleave == "none" and inner_bytes % 16:
            raise TensorMapError(
                f"inner box extent box_dims[0]*element_size must be a multiple of 16 bytes, "
                f"got {self.box_dims[0]}*{dtype.size} = {inner_bytes}"
            )
        for i, step in enumerate(self.element_strides):
            if not 1 <= step <= MAX_ELEMENT_STRIDE:
                raise TensorMapError(f"element_strides[{i}] must be in 1..{MAX_ELEMENT_STRIDE}, got {step}")
        if self.interleave == "none" and span and inner_bytes > span:
            raise TensorMapError(
                f"inner box extent box_dims[0]*element_size must be <= the swizzle span ({self.swizzle} = "
                f"{span} bytes), got {self.box_dims[0]}*{dtype.size} = {inner_bytes}"
            )
        if self.interleave == "32B" and self.swizzle != "32B":
            raise TensorMapError(f"interleave=32B requires swizzle=32B, got swizzle={self.swizzle}")
        if self.oob_fill == "nan" and not dtype.is_float:
            raise TensorMapError(f"oob_fill='nan' needs a floating-point data type, got {self.dtype}")


def params_for_tensor(
    tensor: torch.Tensor,
    box_shape: Sequence[int],
    *,
    swizzle: str = "128B",
    element_strides: Sequence[int] | None = None,
    interleave: str = "none",
    l2_promotion: str = "128B",
    oob_fill: str = "zero",
    dtype: torch.dtype | str | None = None,
) -> TiledParams:
    """Validated :class:`TiledParams` describing ``tensor`` (any device; no driver needed).

    box_shape and element_strides are in torch order (outermost first, like ``tensor.shape``).
    The last torch dimension must be contiguous (stride 1); it becomes TMA dimension 0.
    dtype reinterprets the elements as another TMA type of the same size (e.g. "tfloat32").
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    shape, strides = tuple(tensor.shape), tuple(tensor.stride())
    rank = len(shape)
    if not 1 <= rank <= MAX_RANK:
        raise TensorMapError(f"rank must be 1..{MAX_RANK}, got tensor of shape {list(shape)}")
    if len(box_shape) != rank:
        raise TensorMapError(f"box_shape {list(box_shape)} needs {rank} entries for tensor shape {list(shape)}")
    if element_strides is not None and len(element_strides) != rank:
        raise TensorMapError(f"element_strides {list(element_strides)} needs {rank} entries for shape {list(shape)}")
    if tensor.numel() == 0:
        raise TensorMapError(f"global dimensions must be non-zero, got tensor shape {list(shape)}")
    if strides[-1] != 1 and shape[-1] != 1:
        raise TensorMapError(
            f"the last dimension must be contiguous (stride 1), got strides {list(strides)} for shape "
            f"{list(shape)}; permute the tensor so its contiguous dimension is last"
        )
    natural = tma_dtype(tensor.dtype)
    kind = natural if dtype is None else tma_dtype(dtype)
    if kind.size != tensor.element_size():
        raise TensorMapError(
            f"dtype={kind.name} has {kind.size}-byte elements but the tensor's {tensor.dtype} has "
            f"{tensor.element_size()}"
        )
    # Innermost-first byte strides of dimensions 1..rank-1. A size-1 dimension is never stepped
    # through, so its (arbitrary) torch stride is replaced by one TMA accepts.
    dims = tuple(reversed(shape))
    byte_strides: list[int] = []
    extent = dims[0] * kind.size
    for dim, stride in zip(dims[1:], reversed(strides[:-1])):
        step = stride * kind.size if dim != 1 else -(-extent // 16) * 16
        byte_strides.append(step)
        extent = step * dim
    params = TiledParams(
        dtype=kind.name,
        global_address=tensor.data_ptr(),
        global_dims=dims,
        global_strides=tuple(byte_strides),
        box_dims=tuple(int(b) for b in reversed(box_shape)),
        element_strides=tuple(reversed([int(e) for e in element_strides])) if element_strides else (1,) * rank,
        interleave=interleave,
        swizzle=swizzle,
        l2_promotion=l2_promotion,
        oob_fill=oob_fill,
    )
    params.validate()
    return params


# ---------------------------------------------------------------------------------------------
# GEMM operand layouts: the one place that decides which dimension of a 2-D operand is contiguous
# ---------------------------------------------------------------------------------------------

ALIGN = 16  # bytes: TMA base address and every non-innermost stride
MAX_STRIDE = 1 << 40  # bytes


def contiguous_dim(t: torch.Tensor) -> int | None:
    """1 when ``t`` (2-D) is row-major (its columns are contiguous), 0 when it is column-major,
    None when neither dimension has unit stride.

    A dimension of size 1 is never stepped through, so its stride says nothing: a vector takes
    the layout in which its one real stride is the leading (between-rows or between-columns)
    stride. This is the single tie-break every backend uses, e.g. for "is B K-major" when K or
    N is 1: a (K, 1) B with stride(0) == 1 is K-major; a (1, N) B with stride(1) == 1 is N-major.
    """
    rows, cols = t.shape
    row_stride, col_stride = t.stride()
    if cols > 1 and col_stride == 1:
        return 1
    if rows > 1 and row_stride == 1:
        return 0
    if rows > 1 and cols > 1:
        return None
    return 0 if cols > 1 else 1


def b_is_k_major(b: torch.Tensor) -> bool:
    """True when a GEMM's B (K, N) is K-major: the transpose of a row-major (N, K) weight."""
    return contiguous_dim(b) == 0


def leading_stride(t: torch.Tensor, row_major: bool) -> int:
    """Element stride between rows (``row_major``) or columns of ``t``.

    With a single row (column) the stride is never used to address memory and torch may report
    any value, so the smallest 16-byte aligned one is returned instead.
    """
    rows, cols = t.shape
    outer, inner = (rows, cols) if row_major else (cols, rows)
    if outer > 1:
        return t.stride(0) if row_major else t.stride(1)
    per_16b = ALIGN // t.element_size()
    return -(-inner // per_16b) * per_16b


def operand_reason(t: torch.Tensor, name: str, row_major: bool) -> str | None:
    """None if a tensor map can describe 2-D ``t`` in the given layout, else why not (names the
    base address or stride at fault)."""
    if t.data_ptr() % ALIGN:
        return f"{name}.data_ptr() is not {ALIGN}-byte aligned"
    if contiguous_dim(t) != (1 if row_major else 0):
        return f"{name} {tuple(t.shape)} is not {'row' if row_major else 'column'}-major (stride {tuple(t.stride())})"
    lead_bytes = leading_stride(t, row_major) * t.element_size()
    if lead_bytes % ALIGN:
        return f"{name} leading stride of {lead_bytes} bytes is not a multiple of {ALIGN} (TMA)"
    if lead_bytes >= MAX_STRIDE:
        return f"{name} leading stride of {lead_bytes} bytes is >= 2^40 (TMA)"
    return None


def store_reason(out: torch.Tensor) -> str | None:
    """None when a TMA store may write ``out`` (row-major, aligned, rows of whole 16-byte chunks).

    A ragged row end is refused: a TMA store may write the whole last 16-byte chunk of a row,
    which for a sliced output view would touch the neighbouring columns.
    """
    reason = operand_reason(out, "out", True)
    if reason is None and (out.shape[1] * out.element_size()) % ALIGN:
        return f"out rows of {out.shape[1] * out.element_size()} bytes are not a multiple of {ALIGN}"
    return reason


def map_layout(t: torch.Tensor, dims: Sequence[int]) -> tuple[list[int], list[int]]:
    """Shape and element strides of ``t`` permuted to ``dims`` (innermost last) as a tensor map
    describes it (any rank: grouped operands are 3-D). A size-1 dimension is never stepped, so
    its stride (any value in torch) is replaced by the aligned contiguous one; the innermost
    stride is 1."""
    shape = [t.shape[d] for d in dims]
    strides = [t.stride(d) for d in dims]
    per_16b = ALIGN // t.element_size()
    span = -(-shape[-1] // per_16b) * per_16b
    for i in range(len(dims) - 2, -1, -1):
        if shape[i] == 1:
            strides[i] = span
        span = strides[i] * shape[i]
    strides[-1] = 1
    return shape, strides


def map_reason(t: torch.Tensor, name: str, dims: Sequence[int], address: bool = True) -> str | None:
    """None if a tensor map can describe ``t`` permuted to ``dims`` (innermost last), else why not.
    ``address=False`` leaves out the base address (a tensor torch.compile traces has none yet)."""
    inner = dims[-1]
    if t.shape[inner] > 1 and t.stride(inner) != 1:
        return f"{name} (shape {tuple(t.shape)}, stride {tuple(t.stride())}) must be contiguous along dimension {inner}"
    if address and t.data_ptr() % ALIGN:
        return f"{name}.data_ptr() is not {ALIGN}-byte aligned (TMA)"
    _, strides = map_layout(t, dims)
    for d, stride in zip(dims[:-1], strides[:-1]):
        nbytes = stride * t.element_size()
        if nbytes % ALIGN or not 0 < nbytes < MAX_STRIDE:
            return (f"{name} stride {t.stride(d)} along dimension {d} is {nbytes} bytes, not a positive multiple of "
                    f"{ALIGN} below 2^40 (TMA); e.g. K * itemsize must be a multiple of 16")
    return None


def aligned_empty(shape: Sequence[int], inner: int, dtype: torch.dtype, device) -> torch.Tensor:
    """An empty 2-D tensor in a layout a tensor map describes: contiguous along dimension
    ``inner``, the other stride rounded up to 16 bytes, its storage ending at the last element.
    With ``inner=0`` this is the layout of 1x128 activation scales that DeepGEMM's
    ``get_mn_major_tma_aligned_tensor`` gives and PyTorch's ``F.scaled_mm`` takes (where M is a
    multiple of 4): the persistent kernel loads them by TMA (``cuda.gemm.block_scale_maps``)."""
    if len(shape) != 2 or inner not in (0, 1):
        raise ValueError(f"aligned_empty takes a 2-D shape and inner 0 or 1, got shape {tuple(shape)}, inner {inner}")
    per_16b = ALIGN // dtype.itemsize
    lead = -(-shape[inner] // per_16b) * per_16b
    return torch.empty_strided(tuple(shape), (lead, 1) if inner == 1 else (1, lead), dtype=dtype, device=device)


def aligned_copy(t: torch.Tensor, inner: int) -> torch.Tensor:
    """2-D ``t``'s values in :func:`aligned_empty`'s layout. Block scales laid out so (a's along
    M with ``inner=0``, the weight's along K with ``inner=1``) reach the persistent kernel's loads
    by TMA (``cuda.gemm.block_scale_maps``)."""
    if t.dim() != 2 or inner not in (0, 1):
        raise ValueError(f"aligned_copy takes a 2-D tensor and inner 0 or 1, got shape {tuple(t.shape)}, inner {inner}")
    view = aligned_empty(t.shape, inner, t.dtype, t.device)
    view.copy_(t)
    return view


def stacked_rows(t: torch.Tensor) -> torch.Tensor | None:
    """3-D ``t`` (E, R, C) as the 2-D (E * R, C) matrix of its rows, expert after expert, without
    a copy (grouped kernels read every expert through one 2-D map), or None when the experts do
    not follow each other at R rows' stride."""
    e, r, c = t.shape
    if e > 1 and t.stride(0) != r * t.stride(1):
        return None
    return t.as_strided((e * r, c), (t.stride(1), t.stride(2)))


def operand_view(t: torch.Tensor, row_major: bool) -> torch.Tensor:
    """``t`` as the row-major matrix a tensor map describes: itself, or its transpose when
    column-major (the kernel then reads the tile transposed)."""
    return t if row_major else t.t()


# ---------------------------------------------------------------------------------------------
# Encoding through the driver
# ---------------------------------------------------------------------------------------------

_U64 = ctypes.c_uint64
_U32 = ctypes.c_uint32


@functools.lru_cache(maxsize=1)
def _libcuda() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise RuntimeError(f"the CUDA driver (libcuda.so.1) is not loadable: {exc}") from exc
    lib.cuTensorMapEncodeTiled.restype = ctypes.c_int
    lib.cuTensorMapEncodeTiled.argtypes = [
        ctypes.c_void_p, ctypes.c_int, _U32, ctypes.c_void_p, ctypes.POINTER(_U64), ctypes.POINTER(_U64),
        ctypes.POINTER(_U32), ctypes.POINTER(_U32), ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
    ]  # fmt: skip
    lib.cuTensorMapReplaceAddress.restype = ctypes.c_int
    lib.cuTensorMapReplaceAddress.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.cuGetErrorName.restype = ctypes.c_int
    lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    return lib


def _error_name(code: int) -> str:
    name = ctypes.c_char_p()
    if _libcuda().cuGetErrorName(code, ctypes.byref(name)) == 0 and name.value:
        return name.value.decode()
    return f"CUresult {code}"


class TensorMap:
    """An encoded 128-byte descriptor in a 64-byte aligned host buffer, plus its parameters.

    Pass it to :meth:`tmagemm.jit.Kernel.launch`; the bytes are copied into the launch, so the
    map may be changed or dropped once ``launch`` returns.
    """

    __slots__ = ("params", "_storage", "address")
    SIZE = 128

    def __init__(self, params: TiledParams):
        self.params = params
        self._storage = (ctypes.c_ubyte * (self.SIZE + 64))()
        base = ctypes.addressof(self._storage)
        self.address = base + (-base % 64)  # host address of the 128 descriptor bytes

    @property
    def box_bytes(self) -> int:
        return self.params.box_bytes

    @property
    def global_address(self) -> int:
        return self.params.global_address

    def to_bytes(self) -> bytes:
        return ctypes.string_at(self.address, self.SIZE)

    def replace_address(self, global_address: int) -> None:
        """Point the map at another allocation with the same layout (cuTensorMapReplaceAddress)."""
        align = 32 if self.params.interleave == "32B" else 16
        if global_address % align:
            raise TensorMapError(f"global address must be {align}-byte aligned, got 0x{global_address:x}")
        code = _libcuda().cuTensorMapReplaceAddress(self.address, global_address)
        if code != 0:
            raise TensorMapError(
                f"cuTensorMapReplaceAddress(0x{global_address:x}) failed with {_error_name(code)}: {self.params.describe()}"
            )
        self.params = _with_address(self.params, global_address)

    def __repr__(self) -> str:
        return f"TensorMap({self.params.describe()})"


def _with_address(params: TiledParams, address: int) -> TiledParams:
    fields = {name: getattr(params, name) for name in params.__dataclass_fields__}
    fields["global_address"] = address
    return TiledParams(**fields)


def encode(params: TiledParams) -> TensorMap:
    """Validate ``params`` and encode them with the driver. Needs an initialised CUDA driver."""
    params.validate()
    if not torch.cuda.is_initialized():
        torch.cuda.init()
    rank = params.rank
    out = TensorMap(params)
    code = _libcuda().cuTensorMapEncodeTiled(
        out.address,
        DATA_TYPES[params.dtype].code,
        rank,
        params.global_address,
        (_U64 * rank)(*params.global_dims),
        (_U64 * max(rank - 1, 1))(*params.global_strides),
        (_U32 * rank)(*params.box_dims),
        (_U32 * rank)(*params.element_strides),
        INTERLEAVES[params.interleave],
        SWIZZLES[params.swizzle][0],
        L2_PROMOTIONS[params.l2_promotion],
        OOB_FILLS[params.oob_fill],
    )
    if code != 0:
        raise TensorMapError(f"cuTensorMapEncodeTiled failed with {_error_name(code)}: {params.describe()}")
    return out


def encode_tiled(
    global_address: int,
    dtype: torch.dtype | str,
    global_dims: Sequence[int],
    global_strides: Sequence[int],
    box_dims: Sequence[int],
    *,
    element_strides: Sequence[int] | None = None,
    interleave: str = "none",
    swizzle: str = "128B",
    l2_promotion: str = "128B",
    oob_fill: str = "zero",
) -> TensorMap:
    """Raw form: everything in the driver's innermost-first order, strides in bytes (rank-1)."""
    params = TiledParams(
        dtype=tma_dtype(dtype).name,
        global_address=int(global_address),
        global_dims=tuple(int(d) for d in global_dims),
        global_strides=tuple(int(s) for s in global_strides),
        box_dims=tuple(int(b) for b in box_dims),
        element_strides=tuple(int(e) for e in element_strides) if element_strides else (1,) * len(global_dims),
        interleave=interleave,
        swizzle=swizzle,
        l2_promotion=l2_promotion,
        oob_fill=oob_fill,
    )
    return encode(params)


def make_tensor_map(
    tensor: torch.Tensor,
    box_shape: Sequence[int],
    *,
    swizzle: str = "128B",
    element_strides: Sequence[int] | None = None,
    interleave: str = "none",
    l2_promotion: str = "128B",
    oob_fill: str = "zero",
    dtype: torch.dtype | str | None = None,
) -> TensorMap:
    """Encode a tensor map for a CUDA tensor.

    box_shape (and element_strides) are in torch order, outermost first, like ``tensor.shape``;
    they are reversed into the driver's innermost-first order. fp8 tensors are described as uint8.
    """
    if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cuda":
        where = tensor.device if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise TensorMapError(f"make_tensor_map needs a CUDA tensor, got one on {where}")
    params = params_for_tensor(
        tensor,
        box_shape,
        swizzle=swizzle,
        element_strides=element_strides,
        interleave=interleave,
        l2_promotion=l2_promotion,
        oob_fill=oob_fill,
        dtype=dtype,
    )
    return encode(params)


class TensorMapCache:
    """Encoded maps for reuse across calls, keyed on layout (device, dtype, shape, strides, box,
    options) and then on address.

    A hit on layout and address returns the cached map (well under a microsecond). A new address
    for a known layout takes a fresh slot while the layout has fewer than ``per_layout`` maps, and
    otherwise retargets its least recently used map with cuTensorMapReplaceAddress (~3 us, vs
    ~17 us to encode). So up to ``per_layout`` tensors of one layout (e.g. A and B of a square
    GEMM) hold distinct maps at once; a retargeted map is one no recent call asked for.
    """

    def __init__(self, maxsize: int = 256, per_layout: int = 4):
        if per_layout < 1:
            raise ValueError(f"per_layout must be >= 1, got {per_layout}")
        self._maps: OrderedDict[tuple, OrderedDict[int, TensorMap]] = OrderedDict()
        self._maxsize = maxsize
        self._per_layout = per_layout
        self._lock = threading.Lock()
        self.encodes = 0
        self.replacements = 0

    def get(self, tensor: torch.Tensor, box_shape: Sequence[int], **options) -> TensorMap:
        # The key is built from cheap attributes only: this runs on every GEMM call.
        layout = (
            tensor.get_device(),
            tensor.dtype,
            tensor.shape,
            tensor.stride(),
            tuple(box_shape),
            tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in sorted(options.items())) if options else (),
        )
        address = tensor.data_ptr()
        slots = self._maps.get(layout)
        if slots is not None:
            hit = slots.get(address)
            if hit is not None:
                slots.move_to_end(address)
                return hit
        with self._lock:
            slots = self._maps.get(layout)
            if slots is None:
                slots = self._maps[layout] = OrderedDict()
                while len(self._maps) > self._maxsize:
                    self._maps.popitem(last=False)  # the oldest layout
            if len(slots) >= self._per_layout:
                _, target = slots.popitem(last=False)
                target.replace_address(address)
                self.replacements += 1
            else:
                target = make_tensor_map(tensor, box_shape, **options)
                self.encodes += 1
            slots[address] = target
            return target

    def clear(self) -> None:
        with self._lock:
            self._maps.clear()


class MapsByAddress:
    """Encoded maps of one fixed layout, by global address: the per-operand cache of a GEMM plan,
    whose shapes and strides the plan already fixes (so the address is the whole key).

    A new address beyond ``size`` retargets the least recently used map with
    cuTensorMapReplaceAddress (~3 us) instead of encoding (~14 us). A map is only ever handed out
    for the address it points at. Not thread-safe: the caller serialises ``get`` and the launch
    that reads the map.
    """

    __slots__ = ("params", "_maps", "_size")

    def __init__(self, params: TiledParams, size: int = 4):
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        params.validate()
        self.params = params
        self._maps: OrderedDict[int, TensorMap] = OrderedDict()
        self._size = size

    def get(self, address: int) -> TensorMap:
        found = self._maps.get(address)
        if found is not None:
            return found
        if len(self._maps) >= self._size:
            _, found = self._maps.popitem(last=False)
            found.replace_address(address)
        else:
            found = encode(_with_address(self.params, address))
        self._maps[address] = found
        return found


# ---------------------------------------------------------------------------------------------
# Swizzle reference
# ---------------------------------------------------------------------------------------------


def _span(mode: str | int) -> int:
    if isinstance(mode, str):
        return _option(SWIZZLES, mode, "swizzle")[1]
    if mode not in (0, 32, 64, 128):
        raise ValueError(f"swizzle span must be 0, 32, 64 or 128 bytes, got {mode}")
    return mode


def swizzle_offset(byte_offset: int, mode: str | int) -> int:
    """Where byte ``byte_offset`` of a densely packed box lands in shared memory.

    mode: "none" | "32B" | "64B" | "128B" (or the span in bytes). The 16-byte chunk index within
    the span (address bits 4..) is XORed with the 128-byte row index (bits 7..) modulo span/16.
    Assumes the buffer is aligned to 8 * span bytes (1024 for 128B), as kernels must arrange.
    The same function is ``tmagemm::ptx::swizzle_offset<SPAN>`` on the device.
    """
    span = _span(mode)
    if byte_offset < 0:
        raise ValueError(f"byte offset must be >= 0, got {byte_offset}")
    if span == 0:
        return byte_offset
    mask = span // 16 - 1
    return byte_offset ^ (((byte_offset >> 7) & mask) << 4)


def smem_image(
    dense: torch.Tensor, row_bytes: int, mode: str | int, *, size: int | None = None, fill: int = 0
) -> torch.Tensor:
    """Shared-memory bytes after a TMA load of a box whose dense bytes are ``dense``.

    ``row_bytes`` is the box's inner extent in bytes. Under a swizzle each inner row starts at a
    multiple of the span (rows shorter than the span are padded), then 16-byte chunks are
    permuted by :func:`swizzle_offset`. Bytes TMA does not write hold ``fill``; ``size`` (a
    multiple of 128, default: the footprint rounded up to 128) is the length of the image.
    """
    if dense.dtype != torch.uint8 or dense.dim() != 1:
        raise TypeError(f"expected a 1-D uint8 tensor, got {dense.dtype} with shape {list(dense.shape)}")
    if row_bytes <= 0 or dense.numel() % row_bytes:
        raise ValueError(f"{dense.numel()} bytes are not whole rows of {row_bytes} bytes")
    span = _span(mode)
    pitch = max(row_bytes, span) if span else row_bytes
    rows = dense.numel() // row_bytes
    footprint = -(-(rows * pitch) // 128) * 128
    size = footprint if size is None else size
    if size < footprint or size % 128:
        raise ValueError(f"size must be a multiple of 128 and >= {footprint}, got {size}")
    padded = torch.full((size,), fill, dtype=torch.uint8)
    padded[: rows * pitch].view(rows, pitch)[:, :row_bytes] = dense.view(rows, row_bytes)
    return swizzle_tile(padded, mode)


def swizzle_tile(dense: torch.Tensor, mode: str | int) -> torch.Tensor:
    """Shared-memory image of a dense box: ``out[swizzle_offset(i)] = dense[i]`` for its bytes.

    ``dense`` is a 1-D uint8 tensor whose length is a multiple of 128 (whole 128-byte rows, so
    the permutation stays inside the tile).
    """
    if dense.dtype != torch.uint8 or dense.dim() != 1:
        raise TypeError(f"expected a 1-D uint8 tensor, got {dense.dtype} with shape {list(dense.shape)}")
    n = dense.numel()
    if n % 128:
        raise ValueError(f"tile size must be a multiple of 128 bytes, got {n}")
    offsets = torch.arange(n, dtype=torch.int64)
    span = _span(mode)
    if span:
        offsets = offsets ^ (((offsets >> 7) & (span // 16 - 1)) << 4)
    out = torch.empty_like(dense)
    out[offsets] = dense
    return out
