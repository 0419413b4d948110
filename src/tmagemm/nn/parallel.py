"""Tensor-parallel FP8 linear layers over torch.distributed (one process per GPU, NCCL).

Megatron's split: a column-parallel layer holds a slice of W's output rows and returns its slice
of the output features (no communication); a row-parallel layer holds a slice of W's input
columns, takes the matching slice of the input features (what a column-parallel layer before it
returned) and all-reduces its partial product, the bias added once (by group rank 0, inside
the GEMM). An MLP is gate/up column-parallel, then down row-parallel: one all-reduce.

Shards are contiguous and equal: the sharded dimension must divide by the group size, and each
shard must be a multiple of 128 for the "block" recipe (scales cover 128-wide blocks, so a shard
must own whole blocks) or of 16 for "row" and "tensor" (the kernels' row alignment). Each rank
quantizes its own slice of the activation: for "block" the 1x128 groups are the same as on one
GPU, for "row"/"tensor" a rank's scale covers its slice only (still exact per rank).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .linear import ALIGN, FP8Linear
from .quantize import SCALE_BLOCK, check_recipe


def _group_rank_size(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("tensor-parallel FP8 layers need torch.distributed initialised "
                           "(torch.distributed.init_process_group('nccl', ...)) first")
    return dist.get_rank(group), dist.get_world_size(group)


def shard_size(size: int, world: int, recipe: str, name: str) -> int:
    """The per-rank size of a dimension of ``size`` split ``world`` ways; ValueError if the
    shards would not be whole, or would cut a 128-wide scale block (block recipe) or a 16-byte row."""
    quantum = SCALE_BLOCK if recipe == "block" else ALIGN
    if size % world or (size // world) % quantum:
        raise ValueError(f"{name} = {size} cannot be split over {world} ranks into shards that are multiples of "
                         f"{quantum} (the {recipe!r} recipe's {'scale block' if recipe == 'block' else 'alignment'}); "
                         f"{name} must be a multiple of {quantum * world}")
    return size // world


def _empty_shard(cls, layer: FP8Linear, group, device):
    """This rank's ``cls`` shard of ``layer``'s shape, recipe and bias dtype, not yet loaded."""
    bias = layer.bias
    return cls(layer.in_features, layer.out_features, bias is not None, layer.recipe,
               bias.dtype if bias is not None else torch.bfloat16, device or layer.weight.device, group)


class ColumnParallelFP8Linear(FP8Linear):
    """The output features of an FP8Linear split over the ranks of ``group``: this rank holds
    rows [r * N/world, (r+1) * N/world) of W (and of its scales and bias) and returns that slice
    of the output, (..., out_features / world). out_features: the full layer's."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, recipe: str = "block",
                 dtype: torch.dtype = torch.bfloat16, device=None, group=None):
        rank, world = _group_rank_size(group)
        local = shard_size(out_features, world, check_recipe(recipe), "out_features")
        super().__init__(in_features, local, bias, recipe, dtype, device)
        self.group, self.rank, self.world_size, self.full_out_features = group, rank, world, out_features

    @classmethod
    def from_full(cls, layer: FP8Linear, group=None, device=None) -> ColumnParallelFP8Linear:
        """This rank's shard of a full (unsharded) FP8Linear, on ``device`` (default: the layer's)."""
        bias, shard = layer.bias, _empty_shard(cls, layer, group, device)
        rows = slice(shard.rank * shard.out_features, (shard.rank + 1) * shard.out_features)
        scale = layer.weight_scale_inv
        if layer.recipe == "block":
            scale = scale[rows.start // SCALE_BLOCK: rows.stop // SCALE_BLOCK]
        elif layer.recipe == "row":
            scale = scale[rows]
        return shard.load_quantized(layer.weight[rows], scale, None if bias is None else bias[rows])

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}/{self.world_size}, full_out_features={self.full_out_features}"


class RowParallelFP8Linear(FP8Linear):
    """The input features of an FP8Linear split over the ranks of ``group``: this rank holds
    columns [r * K/world, (r+1) * K/world) of W, takes x (..., in_features / world) (the slice a
    column-parallel layer returns) and returns the full (..., out_features) output, all-reduced
    over the group; the bias (full, (out_features,)) is added once. in_features: the full layer's."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, recipe: str = "block",
                 dtype: torch.dtype = torch.bfloat16, device=None, group=None):
        rank, world = _group_rank_size(group)
        local = shard_size(in_features, world, check_recipe(recipe), "in_features")
        super().__init__(local, out_features, bias, recipe, dtype, device)
        self.group, self.rank, self.world_size, self.full_in_features = group, rank, world, in_features

    @classmethod
    def from_full(cls, layer: FP8Linear, group=None, device=None) -> RowParallelFP8Linear:
        """This rank's shard of a full (unsharded) FP8Linear, on ``device`` (default: the layer's)."""
        bias, shard = layer.bias, _empty_shard(cls, layer, group, device)
        cols = slice(shard.rank * shard.in_features, (shard.rank + 1) * shard.in_features)
        scale = layer.weight_scale_inv
        if layer.recipe == "block":
            scale = scale[:, cols.start // SCALE_BLOCK: cols.stop // SCALE_BLOCK]
        # row / tensor: a weight scale covers whole output rows, so every shard keeps all of it.
        return shard.load_quantized(layer.weight[:, cols], scale, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.check_input(x)
        # Rank 0 adds the bias inside its GEMM (no extra kernel); the sum carries it once.
        y = self.quantized_mm(x, self.bias if self.rank == 0 else None)
        dist.all_reduce(y, group=self.group)
        return y

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}/{self.world_size}, full_in_features={self.full_in_features}"


def parallelize_linear(layer: nn.Module, style: str, group=None) -> FP8Linear:
    """``ColumnParallelFP8Linear.from_full`` (style "column") or ``RowParallelFP8Linear.from_full``
    ("row") of an FP8Linear (an nn.Linear is refused: convert it first, or quantize with
    FP8Linear.from_linear)."""
    if not isinstance(layer, FP8Linear) or isinstance(layer, (ColumnParallelFP8Linear, RowParallelFP8Linear)):
        raise TypeError(f"parallelize_linear shards a full FP8Linear, got {type(layer).__name__}")
    if style == "column":
        return ColumnParallelFP8Linear.from_full(layer, group)
    if style == "row":
        return RowParallelFP8Linear.from_full(layer, group)
    raise ValueError(f"style must be 'column' or 'row', got {style!r}")
