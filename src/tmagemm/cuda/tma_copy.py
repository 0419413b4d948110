"""Launchers for ``tma_copy.cu``: elementwise op on TMA tiles, the layout probe, pipelined copy.

These kernels exist to show and check TMA itself: the elementwise kernel generalises the seed write-ups'
"load a tile, add in shared memory, store" to several dtypes and every swizzle mode; the probe
returns the exact shared-memory bytes of one TMA load so tests can compare them with
:func:`tmagemm.tma.swizzle_offset`; the copy kernel measures TMA throughput.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Sequence

import torch

from tmagemm import device, jit, tma

SOURCE = "tma_copy.cu"
# Opt-in shared-memory ceiling per block on sm_90 (227 KB); kernels add 1 KB for alignment.
MAX_SMEM_BYTES = device.SM90_SMEM_PER_BLOCK
_ALIGN_SLACK = 1024


def _elem_types() -> dict[torch.dtype, int]:
    return {torch.int32: 0, torch.float32: 1, torch.bfloat16: 2, torch.float8_e4m3fn: 3}


@dataclass(frozen=True)
class ElementwiseConfig:
    """One box per CTA: ``box_rows x box_cols`` elements, ``swizzle`` in shared memory."""

    box_rows: int = 64
    box_cols: int | None = None  # None: the swizzle span (or 128 bytes without swizzle)
    swizzle: str = "128B"

    def resolved_cols(self, element_size: int) -> int:
        if self.box_cols is not None:
            return self.box_cols
        span = tma.SWIZZLES[self.swizzle][1] if self.swizzle in tma.SWIZZLES else 0
        return (span or 128) // element_size


def elementwise_defines(dtype: torch.dtype, config: ElementwiseConfig) -> dict[str, int]:
    """The -D macros selecting the elementwise variant for ``dtype`` and ``config``."""
    kinds = _elem_types()
    if dtype not in kinds:
        raise TypeError(f"elementwise_2d supports {sorted(str(d) for d in kinds)}, got {dtype}")
    if config.swizzle not in tma.SWIZZLES:
        raise ValueError(f"swizzle must be one of {list(tma.SWIZZLES)}, got {config.swizzle!r}")
    size = torch.empty((), dtype=dtype).element_size()
    return {
        "ELEM_TYPE": kinds[dtype],
        "BOX_ROWS": config.box_rows,
        "BOX_COLS": config.resolved_cols(size),
        "SWIZZLE_SPAN": tma.SWIZZLES[config.swizzle][1],
    }


def copy_defines(element_size: int, config: "CopyConfig") -> dict[str, int]:
    """The -D macros selecting the pipelined-copy variant."""
    return {
        "BOX_ROWS": config.box_rows,
        "BOX_COLS": config.box_cols,
        "ELEM_BYTES": element_size,
        "ROW_PITCH": config.row_pitch(element_size),
        "STAGES": config.stages,
    }


def _check_2d(x: torch.Tensor, what: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{what} must be 2-D, got shape {list(x.shape)}")
    if x.device.type != "cuda":
        raise ValueError(f"{what} must be a CUDA tensor, got one on {x.device}")


def elementwise_2d(
    x: torch.Tensor, out: torch.Tensor | None = None, config: ElementwiseConfig = ElementwiseConfig()
) -> torch.Tensor:
    """``out = 2 * x - 1`` through TMA load -> shared memory -> TMA store, one box per CTA.

    x: 2-D int32 / float32 / bfloat16 / float8_e4m3fn, last dim contiguous, rows 16-byte aligned.
    out: same shape and dtype (may have padded strides); its rows must be a multiple of 16 bytes
    (see TiledParams.validate_store); elements outside it are never written.
    """
    _check_2d(x, "x")
    defines = elementwise_defines(x.dtype, config)
    if out is None:
        out = torch.empty_like(x)
    _check_2d(out, "out")
    if out.shape != x.shape or out.dtype != x.dtype:
        raise ValueError(f"out must match x: got {out.dtype}{list(out.shape)} for x {x.dtype}{list(x.shape)}")
    if x.numel() == 0:
        return out
    size = x.element_size()
    rows, cols = config.box_rows, config.resolved_cols(size)
    in_map = tma.make_tensor_map(x, (rows, cols), swizzle=config.swizzle)
    tile_bytes = in_map.params.smem_bytes
    if tile_bytes + _ALIGN_SLACK > MAX_SMEM_BYTES:
        raise ValueError(
            f"box {rows}x{cols} of {x.dtype} needs {tile_bytes} B of shared memory, over {MAX_SMEM_BYTES - _ALIGN_SLACK}"
        )
    out_map = tma.make_tensor_map(out, (rows, cols), swizzle=config.swizzle)
    out_map.params.validate_store()
    module = jit.compile(SOURCE, defines=defines)
    grid = (-(-x.shape[1] // cols), -(-x.shape[0] // rows))
    if grid[1] > 65535:
        raise ValueError(f"{x.shape[0]} rows need {grid[1]} row tiles; the grid's y limit is 65535")
    with torch.cuda.device(x.device):
        module.function("tma_elementwise_2d").launch(grid, 128, (in_map, out_map), smem_bytes=tile_bytes + _ALIGN_SLACK)
    return out


def probe(
    tensor: torch.Tensor,
    box_shape: Sequence[int],
    coords: Sequence[int],
    *,
    swizzle: str = "none",
    element_strides: Sequence[int] | None = None,
    oob_fill: str = "zero",
    dtype: torch.dtype | str | None = None,
    sentinel: int = 0xA5,
) -> torch.Tensor:
    """Raw shared-memory bytes after one TMA load of the box at ``coords``.

    box_shape, coords and element_strides are in torch order (outermost first). Returns a uint8
    CUDA tensor covering the box's shared-memory footprint (``TiledParams.smem_bytes``) rounded
    up to 1024 bytes; bytes TMA did not write hold ``sentinel``.
    """
    rank = tensor.dim()
    if len(coords) != rank:
        raise ValueError(f"coords {list(coords)} needs {rank} entries for shape {list(tensor.shape)}")
    if not 0 <= sentinel <= 255:
        raise ValueError(f"sentinel must be a byte value, got {sentinel}")
    # Measured on H100: a load whose innermost start is not 16-byte aligned faults with an
    # illegal instruction (e.g. bf16 column 150 = byte 300), so refuse it here.
    if (int(coords[-1]) * tensor.element_size()) % 16:
        raise ValueError(
            f"the innermost coordinate {coords[-1]} starts at byte {int(coords[-1]) * tensor.element_size()}, "
            "not a multiple of 16; TMA box starts must be 16-byte aligned along the contiguous dimension"
        )
    tensor_map = tma.make_tensor_map(
        tensor, box_shape, swizzle=swizzle, element_strides=element_strides, oob_fill=oob_fill, dtype=dtype
    )
    box_bytes = tensor_map.box_bytes
    region = -(-tensor_map.params.smem_bytes // 1024) * 1024
    if region + _ALIGN_SLACK > MAX_SMEM_BYTES:
        raise ValueError(f"box needs {region} B of shared memory, over the {MAX_SMEM_BYTES - _ALIGN_SLACK} B probe buffer")
    inner_first = [int(c) for c in reversed(coords)] + [0] * (5 - rank)
    out = torch.empty(region, dtype=torch.uint8, device=tensor.device)
    module = jit.compile(SOURCE, defines={"PROBE_RANK": rank})
    args = (
        tensor_map,
        out,
        *(ctypes.c_int32(c) for c in inner_first),
        ctypes.c_uint32(box_bytes),
        ctypes.c_uint32(region),
        ctypes.c_uint8(sentinel),
    )
    with torch.cuda.device(tensor.device):
        module.function("tma_probe").launch(1, 128, args, smem_bytes=region + _ALIGN_SLACK)
    return out


@dataclass(frozen=True)
class CopyConfig:
    """Pipelined copy: ``box_rows x box_cols`` tiles, ``stages`` buffers per CTA."""

    box_rows: int = 64
    box_cols: int = 64
    swizzle: str = "128B"
    stages: int = 4
    ctas_per_sm: int | None = None  # None: as many as shared memory allows (at most 8)

    def row_pitch(self, element_size: int) -> int:
        """Shared-memory bytes per box row: swizzled rows take at least the span."""
        span = tma.SWIZZLES[self.swizzle][1] if self.swizzle in tma.SWIZZLES else 0
        return max(self.box_cols * element_size, span)

    def stage_bytes(self, element_size: int) -> int:
        return -(-(self.box_rows * self.row_pitch(element_size)) // 1024) * 1024


def copy_2d(x: torch.Tensor, out: torch.Tensor, config: CopyConfig = CopyConfig()) -> None:
    """``out.copy_(x)`` through TMA: every tile is loaded to shared memory and stored back."""
    _check_2d(x, "x")
    _check_2d(out, "out")
    if out.shape != x.shape or out.dtype != x.dtype:
        raise ValueError(f"out must match x: got {out.dtype}{list(out.shape)} for x {x.dtype}{list(x.shape)}")
    if x.numel() == 0:
        return
    size = x.element_size()
    smem = config.stages * config.stage_bytes(size) + _ALIGN_SLACK
    if smem > MAX_SMEM_BYTES:
        raise ValueError(f"{config.stages} stages of {config.box_rows}x{config.box_cols} need {smem} B of shared memory")
    box = (config.box_rows, config.box_cols)
    in_map = tma.make_tensor_map(x, box, swizzle=config.swizzle)
    out_map = tma.make_tensor_map(out, box, swizzle=config.swizzle)
    out_map.params.validate_store()
    tiles_cols = -(-x.shape[1] // config.box_cols)
    num_tiles = tiles_cols * -(-x.shape[0] // config.box_rows)
    index = device.index_of(x.device)
    per_sm = config.ctas_per_sm or max(1, min(8, (MAX_SMEM_BYTES + _ALIGN_SLACK) // (smem + _ALIGN_SLACK)))
    grid = min(num_tiles, device.sm_count(index) * per_sm)
    module = jit.compile(SOURCE, defines=copy_defines(size, config))
    with torch.cuda.device(x.device):
        module.function("tma_copy_2d").launch(
            grid, 32, (in_map, out_map, ctypes.c_int32(tiles_cols), ctypes.c_int32(num_tiles)), smem_bytes=smem
        )
