"""Kernel configurations of the Triton GEMMs, as frozen dataclasses with one validity rule."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from .device import SM90_SMEM_PER_BLOCK

# Margin under the per-block limit for barriers and the compiler's own scratch (epilogue layout
# conversions).
SMEM_MARGIN_BYTES = 8192


@dataclass(frozen=True)
class TritonGemmConfig:
    """Tile shape and pipelining of one Triton GEMM launch.

    block_m/n/k: output tile and K step; group_m: rows of tiles per L2 group (grouped order);
    num_stages: software-pipeline depth (TMA buffers in flight); num_warps: 4 = one warpgroup,
    8 = two; epilogue_subtile: store the output tile in two halves to halve epilogue registers
    and shared memory (persistent kernel only); swap_ab: the grouped kernel's decode tiles
    (``triton.grouped`` only; the dense families refuse them): block_n weight rows fill wgmma's M
    and the block_m rows of A its N slot, the tile computed as out^T; programs_per_sm: persistent
    programs per SM (``triton.grouped`` only; the other families refuse more than one): the grid
    is that many times the SMs, so several programs share an SM's shared memory and keep more
    loads in flight.
    """

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    num_stages: int = 4
    num_warps: int = 8
    epilogue_subtile: bool = False
    swap_ab: bool = False
    programs_per_sm: int = 1

    def label(self) -> str:
        """Short name, e.g. ``64x128x128s4w4`` (tile, stages, warps; group, subtiling, swapped
        tiles and programs per SM when not the defaults): how ``tmagemm bench --configs`` names a
        config's provider."""
        extra = ((f"g{self.group_m}" if self.group_m != 8 else "") + ("e" if self.epilogue_subtile else "")
                 + ("t" if self.swap_ab else "") + (f"p{self.programs_per_sm}" if self.programs_per_sm != 1 else ""))
        return f"{self.block_m}x{self.block_n}x{self.block_k}s{self.num_stages}w{self.num_warps}{extra}"

    def grouped_only(self) -> str | None:
        """What this config sets that only ``triton.grouped`` runs (``swap_ab``, more than one
        program per SM), for the other families' refusals; None if nothing."""
        if self.swap_ab:
            return "swap_ab"
        if self.programs_per_sm != 1:
            return f"programs_per_sm={self.programs_per_sm}"
        return None

    def smem_bytes(self, a_itemsize: int, b_itemsize: int, out_itemsize: int) -> int:
        """Shared memory the pipeline and epilogue need (operand ring + output staging tile)."""
        ring = self.num_stages * self.block_k * (self.block_m * a_itemsize + self.block_n * b_itemsize)
        out_cols = self.block_n // 2 if self.epilogue_subtile else self.block_n
        return ring + self.block_m * out_cols * out_itemsize

    def is_valid(self, a_itemsize: int, b_itemsize: int, out_itemsize: int) -> bool:
        """The one rule every heuristic, tuner and test uses to accept a config."""
        pow2 = all(v > 0 and v & (v - 1) == 0 for v in (self.block_m, self.block_n, self.block_k))
        return (
            pow2
            and self.block_m >= 16
            and self.block_n >= 16
            and self.block_k * min(a_itemsize, b_itemsize) >= 32  # TMA inner box >= 32 bytes, wgmma K >= 16/32
            and self.num_warps in (4, 8)
            and self.num_stages >= 1
            and self.group_m >= 1
            and self.programs_per_sm >= 1
            and self.smem_bytes(a_itemsize, b_itemsize, out_itemsize) + SMEM_MARGIN_BYTES <= SM90_SMEM_PER_BLOCK
        )

    def fitted(self, a_itemsize: int, b_itemsize: int, out_itemsize: int) -> "TritonGemmConfig":
        """This config with fewer pipeline stages (down to 2) until it fits shared memory, e.g. a
        heuristic picked for bf16 output that now writes fp32. Unchanged if it already fits."""
        config = self
        while not config.is_valid(a_itemsize, b_itemsize, out_itemsize) and config.num_stages > 2:
            config = replace(config, num_stages=config.num_stages - 1)
        return config

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "TritonGemmConfig":
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})
