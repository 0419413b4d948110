"""Launchers of the native sm_90a GEMM kernels and their dispatch variants.

Variants (device code in ``gemm_sm90_*.cu``, shared pieces in ``include/tmagemm/gemm_sm90.cuh``;
docs/native-gemm.md explains each and records what it is worth):

=========================  =====================================================================
cuda.one_warpgroup         1 warpgroup, 128x128x64 tile, thread 0 also issues TMA
cuda.warp_specialized      producer + 2 consumer warpgroups, 128x256 tile, setmaxnreg
cuda.persistent_coop       persistent warp-specialized, grouped static scheduler, both consumers per tile;
                           per-shape config from coop_config (the dispatcher's choice)
cuda.persistent_coop_mc    the same on 2x1 clusters, B multicast by TMA to both CTAs
cuda.persistent_pingpong   persistent warp-specialized, consumers alternate 128x128 tiles (epilogue hidden)
cuda.persistent_pingpong_mc  the same on 2x1 clusters, B multicast by TMA to both CTAs
cuda.blockscaled           persistent cooperative 128x128 tiles, fp8 only: 1x128 activation and
                           128x128 weight scales applied as each k-block's sum is promoted to fp32
=========================  =====================================================================

Layouts: A (M, K) row-major; B (K, N) either N-major (row-major, the torch default) or K-major
(``w.t()`` of an (N, K) weight) for bf16/fp16, K-major only for e4m3 (wgmma reads FP8 K-major);
out (M, N) row-major in bf16/fp16/fp32. Every operand goes through a TMA tensor map, so ragged
M/N/K are handled by TMA (zero fill on loads, clipping on stores); layouts TMA cannot describe
are refused by ``supports`` and the dispatcher picks another backend.

Every launch is a programmatic dependent launch unless ``TMAGEMM_PDL=0`` (:func:`use_pdl`): a
kernel may start while the one before it in the stream drains, initialises its pipeline and
prefetches its first weight tiles into L2, then waits for that kernel before it reads A, the
scales, bias or C, or writes anything (gemm_sm90.cuh, docs/native-gemm.md).
"""

from __future__ import annotations

import ctypes
import functools
import threading
from dataclasses import dataclass, replace

import torch

from .. import device as _device
from .. import envs, tma, workspace
from ..jit.runtime import stream_getter
from ..plan import GemmArgs, Plan, Scaling, Variant
from ..tma import MapsByAddress, params_for_tensor

_AB_TYPES = {torch.float16: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2}
_OUT_TYPES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
_ROW_BYTES = 128  # one k-block is one 128-byte swizzle row of A and B
# gemm_sm90_persistent.cu's kScaleFloats in bytes: a block-scaled stage's scale slot (128 row
# scales, then 16 bytes of weight-block scales per 128 columns, padded to 128 bytes: TMA boxes
# land 128-byte aligned).
SCALE_SLOT_BYTES = 4 * (128 + 32)


def k_blocks(k: int, itemsize: int) -> int:
    """128-byte k-blocks of one operand row: the native kernels' pipeline unit."""
    return -(-k * itemsize // _ROW_BYTES)


@dataclass(frozen=True)
class NativeGemmConfig:
    """One native kernel's launch shape. ``kernel``: "one_warpgroup" | "warp_specialized" |
    "persistent" (the source file and kernel it builds); ``pingpong`` picks the
    persistent consumer schedule; ``stages``: depth of the TMA ring; ``group_m``: rows of tiles
    per L2 group of the grouped order (columns of tiles with ``raster_n``); ``ctas``: persistent
    grid size (0 = one CTA per SM; tests use a few to make every CTA walk several tiles);
    ``cluster_m``: 2 = persistent CTA pairs multicasting B (grid capped at the clusters that fit
    at once); ``epi_passes`` / ``epi_buffers``: the persistent cooperative epilogue stores its
    output in ``epi_passes`` column slices through ``epi_buffers`` (1 or 2, alternating) slice
    buffers, so staging takes ``epi_buffers / epi_passes`` of the tile (2 passes x 1 buffer or 4 x
    2 leave room for a 4th ring stage); ``promote``: fp8 with fp32-promoted accumulation (each
    k-block's wgmma sum is added into fp32 registers, 128 columns at a time: the
    ``use_fast_accum=False`` semantics), persistent cooperative tiles only; ``promote_depth``: 2 =
    two scratch fragments, so the next k-block's wgmmas run while one is added (128-wide tiles
    only); ``block_scaled``: the promoting
    mainloop also multiplies each k-block's sum by its 1x128 activation and 128x128 weight scales
    (fp8 block-scaled checkpoints); ``groups``: 0 for one GEMM, E for the grouped kernel over E
    experts (cuda/grouped.py; persistent, ping-pong on single CTAs only), whose table of group
    sizes takes shared memory; ``tail_split``: 0, or up to this many K slices for the tiles of a
    last wave that would leave at least half of the clusters idle (:func:`tail_split`; persistent
    cooperative only, with scratch from tmagemm.workspace). Block M is always 128 and block K one
    128-byte row."""

    kernel: str
    block_n: int
    stages: int
    group_m: int = 8
    pingpong: bool = False
    ctas: int = 0
    cluster_m: int = 1
    epi_passes: int = 1
    epi_buffers: int = 1
    raster_n: bool = False
    promote: bool = False
    promote_depth: int = 1
    block_scaled: bool = False
    groups: int = 0
    tail_split: int = 0

    @property
    def threads(self) -> int:
        return 128 if self.kernel == "one_warpgroup" else 384

    def stage_bytes(self) -> int:
        return (128 + self.block_n) * _ROW_BYTES

    def label(self) -> str:
        """Short name, e.g. ``coop128x256s4c2p`` (schedule, tile, stages, cluster, promotion): how
        ``tmagemm bench --configs`` names a config's provider."""
        schedule = {"one_warpgroup": "wg1", "warp_specialized": "ws"}.get(
            self.kernel, "pingpong" if self.pingpong else "coop")
        promotion = ("p" if self.promote_depth == 1 else "p2") if self.promote else ""
        extra = "".join((f"c{self.cluster_m}" if self.cluster_m > 1 else "", f"n{self.ctas}" if self.ctas else "",
                         f"g{self.group_m}" if self.group_m != 8 else "", "r" if self.raster_n else "",
                         promotion, "b" if self.block_scaled else "", f"e{self.groups}" if self.groups else "",
                         f"t{self.tail_split}" if self.tail_split else ""))
        return f"{schedule}128x{self.block_n}s{self.stages}{extra}"

    def epilogue_bytes(self, out_itemsize: int) -> int:
        """Dedicated output staging (persistent only; the others reuse the idle ring): one
        128 x block_n tile shared by the cooperative consumers, one each in ping-pong."""
        if self.kernel != "persistent":
            return 0
        return (2 if self.pingpong else 1) * 128 * self.block_n * out_itemsize * self.epi_buffers // self.epi_passes

    def scale_bytes(self) -> int:
        """Block-scaled: one scale slot per stage (the k-block's activation-row and weight-block
        scales, copied in with the operands)."""
        return self.stages * SCALE_SLOT_BYTES if self.block_scaled else 0

    def group_table_bytes(self) -> int:
        """The grouped kernel's table in shared memory: the tile count, the heavy groups' tile
        count and each group's rows."""
        return 4 * (self.groups + 2) if self.groups else 0

    def smem_bytes(self, out_itemsize: int) -> int:
        ring = self.stages * self.stage_bytes()
        extra = self.scale_bytes() + self.group_table_bytes()
        return ring + self.epilogue_bytes(out_itemsize) + extra + 1024  # + alignment slack

    def is_valid(self, out_itemsize: int) -> bool:
        """The one rule the launcher, defaults and tests use to accept a config."""
        tile_ok = {
            "one_warpgroup": self.block_n in (128,),
            "warp_specialized": self.block_n in (128, 256),
            "persistent": self.block_n in ((128,) if self.pingpong else (128, 256)),
        }.get(self.kernel, False)
        reuse_ok = self.kernel == "persistent" or self.stages * self.stage_bytes() >= 128 * self.block_n * out_itemsize
        return (
            tile_ok
            and reuse_ok
            and self.stages >= 2
            and self.group_m >= 1
            and (self.kernel == "persistent" or not (self.pingpong or self.ctas))
            and self.ctas >= 0
            and (self.cluster_m == 1 or (self.cluster_m == 2 and self.kernel == "persistent"))
            and (self.epi_passes == 1 or (self.kernel == "persistent" and not self.pingpong))
            and self.epi_passes in (1, 2, 4)
            and (self.block_n * out_itemsize // _ROW_BYTES) % self.epi_passes == 0  # whole 128-byte chunks
            and self.epi_buffers in (1, 2)
            and (self.epi_buffers == 1 or self.epi_passes >= 2)
            # promotion: cooperative consumers hold the accumulators plus a 128-column scratch fragment
            and (not self.promote or (self.kernel == "persistent" and not self.pingpong))
            and (self.promote_depth == 1 or (self.promote_depth == 2 and self.promote and self.block_n == 128))
            and (not self.block_scaled or self.promote)  # scales ride on the promotion step
            # grouped: persistent; ping-pong on single CTAs only (the schedule the dispatcher picks for them)
            and (self.groups == 0 or (self.kernel == "persistent" and self.groups > 0
                                      and not (self.pingpong and self.cluster_m > 1)))
            and (self.tail_split == 0 or (2 <= self.tail_split <= 8 and self.kernel == "persistent" and not self.pingpong))
            and self.smem_bytes(out_itemsize) + 256 <= _device.SM90_SMEM_PER_BLOCK
        )

    def fitted(self, out_itemsize: int) -> "NativeGemmConfig":
        """The same config with ``stages`` lowered until shared memory fits (fp32 output).
        Block-scaled configs first try half the epilogue staging at each depth (one buffer instead
        of two, else twice the passes): their scale slots leave 128 x 256 tiles 320 bytes short
        of a 4th stage with two buffers, and 128 x 128 tiles 1.4 KB short of a 6th with one pass
        (H200, BENCHMARKS.md: 4096 x 4096 x 7168 and 4096 x 7168 x 16384 ran 2-5% faster with 4
        stages than with 3 and two buffers; six 128 x 128 stages with two passes ran 1-8% faster
        than five on five of eight block-scaled problems at 128-2048 rows, 1-3% slower on three)."""
        config = self
        while config.stages > 2:
            if config.is_valid(out_itemsize):
                return config
            if config.block_scaled:
                half = (replace(config, epi_buffers=1) if config.epi_buffers == 2
                        else replace(config, epi_passes=2 * config.epi_passes))
                if half.is_valid(out_itemsize):
                    return half
            config = replace(config, stages=config.stages - 1)
        return config


# gemm_sm90_persistent.cu's kTailMinKBlocks: a tail slice has at least this many k-blocks.
TAIL_MIN_K_BLOCKS = 16
# Slices per tail tile at most, in the dispatcher's configs (coop_config, promote_config,
# cuda.grouped.config_for). The tile's first slice reads the others' fp32 fragments (128 KB per
# CTA each for 128x256 tiles) on one SM, so each slice more adds to the tail's end.
TAIL_SPLIT = 4


def tail_split(tiles: int, clusters: int, blocks: int, max_split: int) -> int:
    """K slices per tile of the last wave (1: none), the persistent kernel's ``tail_schedule``:
    a last wave of ``tiles % clusters`` tiles on at most half of the clusters is cut into as many
    slices as the clusters, ``max_split`` and slices of TAIL_MIN_K_BLOCKS of the ``blocks``
    k-blocks allow."""
    tail = tiles % clusters if clusters else 0
    split = min(max_split, clusters // tail, blocks // TAIL_MIN_K_BLOCKS) if tail and max_split else 0
    return split if split >= 2 else 1


def dense_tail_split(m: int) -> int:
    """The most slices a dense problem's config allows: TAIL_SPLIT from two rows of 128-row tiles.
    One row (M <= 128) streams the weight, and there the split measured 9-11% slower on the
    Llama-3-70B TP4 block-scaled decode stack at 64-128 tokens (3-4% faster on DeepSeek-V3's;
    H100, BENCHMARKS.md)."""
    return TAIL_SPLIT if m > 128 else 0


def tail_scratch_floats(config: NativeGemmConfig, tiles: int, clusters: int, blocks: int, exact: bool) -> int:
    """fp32 scratch one launch's tail slices need: one 64 x block_n fragment per later slice of a
    tail tile, per CTA of its cluster and consumer warpgroup. ``exact``: ``tiles`` is the count
    (else an upper bound, as for grouped GEMMs, whose tiles the kernel counts: tail * (split - 1)
    < clusters for any count). 0 where K is too short for two slices: the launch then never
    fetches scratch."""
    if not config.tail_split or blocks < 2 * TAIL_MIN_K_BLOCKS:
        return 0
    if exact:
        split = tail_split(tiles, clusters, blocks, config.tail_split)
        slices = (tiles % clusters) * (split - 1)
    else:
        slices = clusters - 1
    return slices * config.cluster_m * 2 * 64 * config.block_n


# Each native variant's default config; stages are the most that fit with 16-bit output.
NATIVE_CONFIGS: dict[str, NativeGemmConfig] = {
    "cuda.one_warpgroup": NativeGemmConfig("one_warpgroup", block_n=128, stages=3),
    "cuda.warp_specialized": NativeGemmConfig("warp_specialized", block_n=256, stages=4),
    "cuda.persistent_coop": NativeGemmConfig("persistent", block_n=256, stages=4, epi_passes=4, epi_buffers=2),
    "cuda.persistent_coop_mc": NativeGemmConfig("persistent", block_n=256, stages=4, cluster_m=2, epi_passes=4,
                                                epi_buffers=2),
    "cuda.persistent_pingpong": NativeGemmConfig("persistent", block_n=128, stages=5, pingpong=True),
    "cuda.persistent_pingpong_mc": NativeGemmConfig("persistent", block_n=128, stages=5, pingpong=True, cluster_m=2),
}

_SOURCES = {
    "one_warpgroup": "gemm_sm90_one_warpgroup.cu",
    "warp_specialized": "gemm_sm90_warp_specialized.cu",
    "persistent": "gemm_sm90_persistent.cu",
}


class _Params(ctypes.Structure):
    """Mirror of ``tmagemm::gemm::Params`` (gemm_sm90.cuh): same field order and C types."""

    _fields_ = [
        ("m", ctypes.c_int32),
        ("n", ctypes.c_int32),
        ("k", ctypes.c_int32),
        ("group_m", ctypes.c_int32),
        ("alpha", ctypes.c_float),
        ("beta", ctypes.c_float),
        ("c", ctypes.c_void_p),
        ("ldc", ctypes.c_int64),
        ("scale_a", ctypes.c_void_p),
        ("scale_b", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("scale_a_rowwise", ctypes.c_int32),
        ("scale_b_colwise", ctypes.c_int32),
        ("bias_type", ctypes.c_int32),
        ("raster_n", ctypes.c_int32),
        ("block_scale_a", ctypes.c_void_p),
        ("block_scale_b", ctypes.c_void_p),
        ("block_scale_a_m", ctypes.c_int64),
        ("block_scale_a_k", ctypes.c_int64),
        ("block_scale_b_n", ctypes.c_int64),
        ("block_scale_b_k", ctypes.c_int64),
        ("group_counts", ctypes.c_void_p),
        ("groups", ctypes.c_int32),
        ("group_layout", ctypes.c_int32),
        ("group_rows", ctypes.c_int32),
        ("b_group_rows", ctypes.c_int32),
        ("scale_b_group", ctypes.c_int64),
        ("bias_group", ctypes.c_int64),
        ("block_scale_b_group", ctypes.c_int64),
        ("block_scale_a_group", ctypes.c_int64),
        ("d", ctypes.c_void_p),
        ("ldd", ctypes.c_int64),
        ("tail_partials", ctypes.c_void_p),
        ("tail_counters", ctypes.c_void_p),
        ("block_scale_maps", ctypes.c_int32),
        ("heavy_group_rows", ctypes.c_int32),
    ]


# ------------------------------------------------------------------------------------ checks


def unsupported_reason(args: GemmArgs, config: NativeGemmConfig) -> str | None:
    """None when ``config`` can compute ``args``, else why not (names the tensor at fault)."""
    if not _device.is_hopper(args.a.device):
        return f"native kernels need CUDA tensors on a Hopper GPU (sm_90), got {args.a.device}"
    if args.a.dtype not in _AB_TYPES or args.b.dtype != args.a.dtype:
        return f"a/b dtypes {args.a.dtype}/{args.b.dtype} not supported (fp16, bf16 or float8_e4m3fn, both equal)"
    if args.out.dtype not in _OUT_TYPES:
        return f"out dtype {args.out.dtype} not supported (bf16, fp16, fp32)"
    if args.k == 0 or args.m == 0 or args.n == 0:
        return "zero-size problems are handled before dispatch"
    if args.block_scaling is not None and not config.block_scaled:
        return "block scales (1x128 / 128x128) are applied by the block-scaled kernels only"
    if config.block_scaled:
        if args.block_scaling != (Scaling.BLOCK_1X128, Scaling.BLOCK_128X128):
            return "the native block-scaled kernel takes 1x128 scales for a and 128x128 scales for b"
        if args.a.dtype != torch.float8_e4m3fn:
            return f"block-scaled a must be float8_e4m3fn, got {args.a.dtype}"
    if max(args.m, args.n, args.k) >= 2**31:
        return "dimensions must fit in int32"
    if args.bias is not None and args.bias.dtype not in _OUT_TYPES:
        return f"bias dtype {args.bias.dtype} not supported (bf16, fp16, fp32)"
    if (args.scale_a is not None or args.scale_b is not None) and not args.is_fp8:
        return "scales are only applied to fp8 problems"
    if args.is_fp8 and not args.fast_accum and not config.promote:
        return ("use_fast_accum=False needs fp32 promotion of the fp8 partial sums: "
                "a config with promote=True (cuda.persistent_coop picks one)")
    if config.promote and not args.is_fp8:
        return "promote applies to fp8 only (16-bit wgmma accumulates in fp32)"
    b_k_major = tma.b_is_k_major(args.b)
    if args.is_fp8 and not b_k_major:
        return "fp8 needs B K-major (column-major (K, N), the torch._scaled_mm layout): FP8 wgmma reads K-major B"
    # out through a TMA store: a row that ends inside a 16-byte chunk would have the chunk's rest
    # (the neighbouring columns of a sliced view) written too; such outputs take another kernel.
    reason = (tma.operand_reason(args.a, "a", True) or tma.operand_reason(args.b, "b", not b_k_major)
              or tma.store_reason(args.out))
    if reason:
        return reason
    if not config.fitted(args.out.element_size()).is_valid(args.out.element_size()):
        return f"config {config} does not fit shared memory with {args.out.dtype} output"
    return None


# ------------------------------------------------------------------------------------ launch


def use_pdl(device: torch.device) -> bool:
    """Whether a native GEMM writing to ``device`` is launched with programmatic dependent launch
    (decided once, when its launch is planned): CUDA, and ``TMAGEMM_PDL`` not 0. The kernels
    always contain the grid dependency wait (a no-op without the launch attribute), so this only
    decides whether they may start while the previous kernel in the stream drains."""
    return device.type == "cuda" and envs.pdl_enabled()


def a_box_rows(config: NativeGemmConfig) -> int:
    """Rows of A's TMA box: grouped kernels (TMAGEMM_GROUPED) load a 128-row tile as two 64-row
    boxes and skip the second where it lies past the group's end (kAHalfBoxes in gemm_sm90.cuh)."""
    return 64 if config.kernel == "persistent" and config.groups > 0 else 128


def _defines(config: NativeGemmConfig, ab_dtype: torch.dtype, out_dtype: torch.dtype, b_k_major: bool) -> dict[str, int]:
    """NVRTC -D flags of one build; launch-time fields (group_m, ctas, raster_n) are not among them."""
    defines = {
        "TMAGEMM_AB_TYPE": _AB_TYPES[ab_dtype],
        "TMAGEMM_OUT_TYPE": _OUT_TYPES[out_dtype],
        "TMAGEMM_B_KMAJOR": int(b_k_major),
        "TMAGEMM_BLOCK_N": config.block_n,
        "TMAGEMM_STAGES": config.stages,
    }
    if config.kernel == "persistent":
        defines["TMAGEMM_PINGPONG"] = int(config.pingpong)
        defines["TMAGEMM_CLUSTER_M"] = config.cluster_m
        defines["TMAGEMM_EPI_PASSES"] = config.epi_passes
        defines["TMAGEMM_EPI_BUFFERS"] = config.epi_buffers
        defines["TMAGEMM_PROMOTE"] = config.promote_depth if config.promote else 0
        defines["TMAGEMM_BLOCK_SCALED"] = int(config.block_scaled)
        defines["TMAGEMM_GROUPED"] = int(config.groups > 0)
        defines["TMAGEMM_TAIL_SPLIT"] = config.tail_split
    return defines


def compile_module(config: NativeGemmConfig, ab_dtype: torch.dtype, out_dtype: torch.dtype, b_k_major: bool):
    """The NVRTC module of one native config (no GPU needed; tests inspect its SASS)."""
    from .. import jit

    config = config.fitted(out_dtype.itemsize)
    defines = _defines(config, ab_dtype, out_dtype, b_k_major)
    return jit.compile(_SOURCES[config.kernel], defines=defines)


def kernel_name(config: NativeGemmConfig) -> str:
    return f"tmagemm_gemm_sm90_{config.kernel}"


@functools.lru_cache(maxsize=None)
def _kernel(config: NativeGemmConfig, ab_dtype: torch.dtype, out_dtype: torch.dtype, b_k_major: bool, device_index: int):
    module = compile_module(config, ab_dtype, out_dtype, b_k_major)
    with torch.cuda.device(device_index):
        return module.function(kernel_name(config))


# The bytes passed for the persistent kernel's map_sa and map_sb where it loads no scale by TMA: a
# kernel parameter is copied from its pointer at launch, and the kernel never reads these.
_NO_MAP = (ctypes.c_ubyte * 128)()


def block_scale_maps(scale_a: torch.Tensor, scale_b: torch.Tensor,
                     block_n: int) -> tuple[tma.TiledParams, tma.TiledParams] | None:
    """The map layouts by which the persistent kernel's producer loads block scales with the
    operands (Params::block_scale_maps), or None where a layout allows none (a producer warp then
    copies them 4 bytes at a time). a's 1x128 scales (M, ceil(K/128)) must be contiguous along M
    (PyTorch's and DeepGEMM's outer-dim-major layout): a box is one k-block's 128 row scales. The
    weight's 128x128 scales (ceil(N/128), ceil(K/128)) must be contiguous along K (a
    checkpoint's): a box is, per 128 columns of the tile, the 16-byte aligned run of 4 scales
    holding the stage's k-block's (TMA's least box; a box may not start between 16 bytes).
    :func:`tmagemm.tma.aligned_copy` lays scales out so (a's with ``inner=0``, the weight's 1).

    The dense launches use them on 128 x 256 tiles without a tail split: there they measured
    1.7-4.7% faster than the copying warp on DeepGEMM's M = 4096 shapes (H100, BENCHMARKS.md);
    with a tail split (4-10% slower) and on 128 x 128 tiles (-4% to +2%) they did not pay, for a
    reason not found."""
    if tma.map_reason(scale_a, "scale_a", (1, 0)) or tma.map_reason(scale_b, "scale_b", (0, 1)):
        return None
    return (tma.params_for_tensor(scale_a.t(), (1, 128), swizzle="none"),
            tma.params_for_tensor(scale_b, (block_n // 128, 4), swizzle="none"))


class _MappedLaunch:
    """What every native launch resolves once: the tensor-map layouts of its 2-D A, B and output
    (cached by address), the parameter block, the loaded kernel with its grid (persistent: one CTA
    per SM or ``config.ctas``, never more clusters than fit at once, never more than ``tiles``),
    and the stream. ``__call__`` points the maps, scales and bias at the operands and launches;
    the caller holds ``lock`` and has set its own per-call parameters (host time is a measured
    goal). ``scales``: the block scales' map layouts (the persistent kernel's map_sa and map_sb,
    see :func:`block_scale_maps`), or None."""

    def __init__(self, config: NativeGemmConfig, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, b_k_major: bool,
                 params: _Params, tiles: int, exact_tiles: bool = True,
                 scales: tuple[tma.TiledParams, tma.TiledParams] | None = None):
        out_size = out.element_size()
        block_k = _ROW_BYTES // a.element_size()
        b_box = (config.block_n // config.cluster_m, block_k) if b_k_major else (block_k, 64)
        self._maps = (
            MapsByAddress(params_for_tensor(a, (a_box_rows(config), block_k))),
            MapsByAddress(params_for_tensor(b, b_box)),
            MapsByAddress(params_for_tensor(out, (64, _ROW_BYTES // out_size))),
        )
        self.params = params
        self._block = config.block_scaled  # the scales are the mainloop's 2-D block scales
        # The persistent kernel takes the block scales' maps after the parameters (_NO_MAP where
        # it reads none).
        self._scale_maps = tuple(MapsByAddress(layout) for layout in scales) if scales else None
        self._pointers = (ctypes.c_void_p * (6 if config.kernel == "persistent" else 4))()
        self._pointers[3] = ctypes.addressof(params)
        if config.kernel == "persistent":
            self._pointers[4] = self._pointers[5] = ctypes.addressof(_NO_MAP)
        self.device_index = out.get_device()
        kernel = _kernel(config, a.dtype, out.dtype, b_k_major, self.device_index)
        cm = config.cluster_m
        smem, block, cluster = config.smem_bytes(out_size), (config.threads, 1, 1), (cm, 1, 1)
        self._tail_scratch = None
        if config.kernel == "persistent":
            clusters = (config.ctas or _device.sm_count(self.device_index)) // cm
            if cm > 1:  # never more clusters than fit at once: the extra ones would form a second wave
                clusters = min(clusters, kernel.max_active_clusters(block, smem, cluster))
            # With a tail split the clusters beyond the tiles take K slices of them. Every CTA is
            # resident at once either way, which the slices' hand-over relies on.
            clusters = min(tiles * max(config.tail_split, 1), clusters)
            grid = cm * clusters
            floats = tail_scratch_floats(config, tiles, clusters, k_blocks(params.k, a.element_size()), exact_tiles)
            if floats:
                workspace.top_up(self.device_index)
                self._tail_scratch = workspace.getter(self.device_index, floats)
        else:
            grid = tiles
        self.pdl = use_pdl(out.device)
        self._launch = kernel.packed((grid, 1, 1), block, smem, self._pointers, cluster, pdl=self.pdl)
        self._stream = stream_getter()
        self.lock = threading.Lock()

    def __call__(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, scale_a, scale_b, bias) -> None:
        params = self.params
        if self._block:
            params.block_scale_a, params.block_scale_b = scale_a.data_ptr(), scale_b.data_ptr()
        else:
            params.scale_a = scale_a.data_ptr() if scale_a is not None else None
            params.scale_b = scale_b.data_ptr() if scale_b is not None else None
        params.bias = bias.data_ptr() if bias is not None else None
        if self._tail_scratch is not None:  # this stream's (or this capture's) scratch
            scratch = self._tail_scratch()
            params.tail_partials, params.tail_counters = scratch.partials.data_ptr(), scratch.counters.data_ptr()
        pointers = self._pointers
        pointers[0] = self._maps[0].get(a.data_ptr()).address
        pointers[1] = self._maps[1].get(b.data_ptr()).address
        pointers[2] = self._maps[2].get(out.data_ptr()).address
        if self._scale_maps is not None:
            pointers[4] = self._scale_maps[0].get(scale_a.data_ptr()).address
            pointers[5] = self._scale_maps[1].get(scale_b.data_ptr()).address
        self._launch(self._stream(self.device_index))


class _Launch:
    """Everything :func:`run` resolves for one problem signature: checked config, loaded kernel,
    grid, tensor-map layouts and the fixed kernel parameters. A call then only points the maps
    and parameters at the operands' addresses and launches (the plan layer caches the Plan built
    from it)."""

    def __init__(self, args: GemmArgs, config: NativeGemmConfig, alpha: float = 1.0, beta: float = 0.0,
                 c: torch.Tensor | None = None):
        reason = unsupported_reason(args, config)
        if reason is not None:
            raise ValueError(f"native GEMM {config}: {reason}")
        config = self.config = config.fitted(args.out.element_size())
        if beta != 0.0:
            if c is None:
                raise ValueError("beta != 0 needs c")
            if tuple(c.shape) != (args.m, args.n) or c.dtype != args.out.dtype or c.device != args.out.device:
                raise ValueError(
                    f"c must be ({args.m}, {args.n}) {args.out.dtype} on {args.out.device}, got {tuple(c.shape)} {c.dtype} on {c.device}"
                )
            if args.n > 1 and c.stride(1) != 1:
                raise ValueError(f"c must be row-major, got stride {tuple(c.stride())}")

        params = _Params()
        params.m, params.n, params.k, params.group_m = args.m, args.n, args.k, config.group_m
        params.alpha, params.beta = float(alpha), float(beta)
        params.ldc = c.stride(0) if beta != 0.0 else 0
        scales = None
        if config.block_scaled:  # the mainloop reads the 2-D block scales through their strides, or maps
            params.block_scale_a_m, params.block_scale_a_k = args.scale_a.stride()
            params.block_scale_b_n, params.block_scale_b_k = args.scale_b.stride()
            if config.block_n == 256 and not config.tail_split:  # where the maps measured faster
                scales = block_scale_maps(args.scale_a, args.scale_b, config.block_n)
            params.block_scale_maps = int(scales is not None)
        else:
            params.scale_a_rowwise = int(args.scale_a is not None and args.scale_a.numel() != 1)
            params.scale_b_colwise = int(args.scale_b is not None and args.scale_b.numel() != 1)
        params.bias_type = _OUT_TYPES[args.bias.dtype] if args.bias is not None else 0
        params.raster_n = int(config.raster_n)
        self._uses_c = beta != 0.0
        b_k_major = tma.b_is_k_major(args.b)
        tiles = -(-args.m // (128 * config.cluster_m)) * -(-args.n // config.block_n)  # cluster tiles
        self._core = _MappedLaunch(config, args.a, tma.operand_view(args.b, not b_k_major), args.out, b_k_major,
                                   params, tiles, scales=scales)
        self.pdl = self._core.pdl

    def plan(self, name: str) -> Plan:
        return Plan(name, self.config, self.operands, self._core.device_index, direct=True)

    def operands(self, a, b, out, scale_a, scale_b, bias, c: torch.Tensor | None = None) -> None:
        """The launch on these operands, on the current stream of the kernel's device (which
        the caller makes current: :meth:`tmagemm.plan.Plan.run` does)."""
        core = self._core
        with core.lock:  # the maps and the parameter block are shared by every call of the plan
            core.params.c = c.data_ptr() if self._uses_c else None
            core(a, b, out, scale_a, scale_b, bias)


def run(
    args: GemmArgs,
    config: NativeGemmConfig | None = None,
    alpha: float = 1.0,
    beta: float = 0.0,
    c: torch.Tensor | None = None,
) -> None:
    """``out = alpha * (scale_a * scale_b) * (a @ b) + bias + beta * c`` with one native kernel
    (one call; a :class:`~tmagemm.plan.Plan` keeps the resolved launch for repeated calls).

    c: (M, N) row-major in the output dtype (needed when beta != 0; may alias ``out``, since each
    element of c is read before the tile holding it is written).
    """
    with _device.on_device(args.out.device):
        _Launch(args, config or NATIVE_CONFIGS["cuda.warp_specialized"], alpha, beta, c).operands(*args.operands, c)


# ------------------------------------------------------------------------------------ heuristic


# Where the per-shape choices were measured to help (H100 sweep of 2026-11-21, docs/native-gemm.md).
# Balanced grids won with up to 64 k-blocks per tile (K * itemsize <= 8 KB: 16-bit K = 4096, fp8
# K = 4096-6144), were mixed at 96 (16-bit K = 6144) and 4-6% slower from 112 (K >= 8192 16-bit,
# fp8 K = 14336). A k-block takes the same time in both widths, so this bounds the tile's mainloop.
_BALANCE_MAX_K_BYTES = 8192
_BALANCE_MAX_WAVES = 9  # measured up to 9 waves; at 14 waves (N = 14336) it was mixed
_PINGPONG_FP8_MIN = (4096, 8192, 8192)  # fp8 M, N, K from which ping-pong beat cooperative (8192^3)
# Cooperative 128x128 tiles (6 stages): for problems whose 128x256 tiles would leave at least half
# of the SMs idle (fp8 512 x 4096 x 4096: 64 tiles -> 128; 0.99x cuBLAS instead of 0.66x, H200).
COOP_N128 = NativeGemmConfig("persistent", block_n=128, stages=6)
# One row of 128-row tiles (WIDE_MIN_M <= M <= 128; fp8, 16-bit below) on a weight at least WIDE_MIN_N rows wide
# and at most WIDE_MAX_K deep: the same 128x128 tiles on every SM, which the dispatcher then runs
# ahead of the Triton 64-row tiles. 8 chained copies per GEMM in one CUDA graph: on an H200 at
# M = 112 and 128, 28672 x 4096, 37888 x 3584 and 24576 x 1536 5-13% faster than the Triton
# tiles; on an H100 at M = 96, level, level and 5% faster. On 36864 x 7168 the H200 gained 6% and
# the H100 lost 0.4-1.1% (DeepSeek-V3's decode stack 1% slower): deeper weights keep the Triton
# tiles. 128x256 tiles ran 2-20% slower than these; at M = 96 the native tiles were mixed on the
# H200 (+3% to -10%), at 64-80 and on 14336-wide weights the Triton tiles stayed ahead or level.
# 16-bit operands take the same tiles from WIDE_MIN_K_16BIT deep (2026-11-26, decode stacks at
# M = 112 / 128, two rounds per GPU): Llama-3-8B (28672 x 4096) 4.9-5.2% faster per layer on an
# H200 and 0.7-0.9% on an H100; DeepSeek-V3's q_b (24576 x 1536) left its stack 0.6-0.8% slower
# on the H200 (level on the H100), so 16-bit weights under 2048 deep (between the depth that lost
# and the shallowest that gained) keep the Triton tiles. (Wider ones, e.g. Qwen2.5-7B's 37888 x
# 3584, whose H100 stack was 3% slower this way, take wave_split first.)
WIDE_MIN_M = 112
WIDE_MIN_N = 24576
WIDE_MAX_K = 4096
WIDE_MIN_K_16BIT = 2048
# fp8 with use_fast_accum=False: the same tiles with per-k-block fp32 promotion into one
# 128-column scratch fragment (the base of the promoting candidates below).
_COOP_PROMOTE = replace(COOP_N128, promote=True)
# The promoting tiles `tmagemm bench --configs` times side by side: 128 or 256 wide (promoted
# 128 columns at a time), 128 wide with two scratch fragments, alone or as 2x1 clusters
# multicasting B.
_PROMOTE_N256 = replace(_COOP_PROMOTE, block_n=256, stages=4, epi_passes=4, epi_buffers=2)
PROMOTE_CANDIDATES = tuple(replace(c, cluster_m=cm) for c in (_COOP_PROMOTE, _PROMOTE_N256) for cm in (1, 2)) + tuple(
    replace(_COOP_PROMOTE, promote_depth=2, cluster_m=cm) for cm in (1, 2))
# What the dispatcher runs (H100, the candidates side by side at M = 1024 / 4096 on the block
# preset's ten shapes and at M = 4096 without fast accumulation; BENCHMARKS.md): 128x256 tiles
# on clusters ran 1.05-1.25x the 128x128 tiles of before. 128x128 tiles with two scratch
# fragments on clusters were the best narrow tile, at about 0.9x the wide tile's speed per output,
# and won only where they fill the last wave of SMs much better (e.g. 1024 x 5120 x 2048: 160
# wide tiles are 2 waves, 320 narrow ones 3 waves of half-size tiles).
_PROMOTE_WIDE = replace(_PROMOTE_N256, cluster_m=2)
_PROMOTE_NARROW = replace(_COOP_PROMOTE, promote_depth=2, cluster_m=2)
# The wave model of promote_config, fitted to both tiles side by side over the block and llm
# presets' (N, K) at M = 256-8192 (179 problems, block-scaled and exact fp8, H100; BENCHMARKS.md,
# 2026-11-26): a narrow tile takes 0.54 of a wide tile's time, and a split tail 1 / split of a
# wave plus a fixed cost (the slices' prologues and the reduction) of about 15 k-blocks' time.
_PROMOTE_NARROW_TILE_TIME = 0.54
_TAIL_SPLIT_COST_K_BLOCKS = 15
# Promoting tiles pair rows of tiles in clusters (multicasting B) where the rows are even and at
# least this many. Clusters of 2 against single CTAs over the same (N, K), H100 (BENCHMARKS.md,
# 2026-11-26): 0.98x at 2 and 4 rows, 1.00x at 8, 1.02-1.03x at 16-64; with an odd count the last
# pair's second CTA has no rows: 0.90x at 5 and 7 rows, 0.91x at 9, 0.96x at 13, 0.995x at 17.
PROMOTE_CLUSTER_MIN_ROWS = 8


def promote_config(m: int, n: int, k: int, sms: int) -> NativeGemmConfig:
    """The promoting config for one problem (fp8 without fast accumulation, and block scales):
    wide tiles unless the narrow ones finish the waves of tiles sooner (by the wave model above:
    a narrow tile 0.54 of a wide one, a split tail 1 / split of a wave plus 15 k-blocks' time);
    clusters for an even number of rows of tiles from PROMOTE_CLUSTER_MIN_ROWS; a tail split
    where the last wave would leave at least half of the clusters idle (:func:`dense_tail_split`)."""
    rows = -(-m // 128)
    cluster = 2 if rows >= PROMOTE_CLUSTER_MIN_ROWS and rows % 2 == 0 else 1
    slots = sms // cluster  # clusters at work at once
    max_split = dense_tail_split(m)
    blocks = k_blocks(k, 1)

    def cluster_tiles(block_n: int) -> int:
        return -(-rows // cluster) * -(-n // block_n)

    def waves(block_n: int) -> float:  # in waves of that tile
        tiles = cluster_tiles(block_n)
        split = tail_split(tiles, slots, blocks, max_split)
        if split > 1:
            return tiles // slots + min(1.0, 1 / split + _TAIL_SPLIT_COST_K_BLOCKS / blocks)
        return -(-tiles // slots)

    narrow = waves(_PROMOTE_NARROW.block_n) * _PROMOTE_NARROW_TILE_TIME < waves(_PROMOTE_WIDE.block_n)
    config = replace(_PROMOTE_NARROW if narrow else _PROMOTE_WIDE, cluster_m=cluster)
    tiles = cluster_tiles(config.block_n)
    if tail_split(tiles, slots, blocks, max_split) > 1:
        return replace(config, tail_split=max_split)
    # Two or more rows of tiles: the fewest CTAs that keep the number of waves (e.g. 128 instead
    # of 132 for 4 waves of 128 CTAs), so every CTA walks the same number of tiles and idle SMs
    # leave the others more power. One row (M <= 128) streams the weight: every SM that can pull
    # bytes should (M = 64, 51200 x 5120: 100 balanced CTAs 133.9 us, all 132 117.6 us; H100).
    busy = -(-tiles // -(-tiles // slots))
    return replace(config, ctas=busy * cluster) if rows >= 2 and busy < slots else config


# Block-scaled fp8: the promoting tiles, scaling each k-block's sum as it is added (one epilogue
# buffer: the stages' scale slots take the room of the second, see NativeGemmConfig.fitted).
NATIVE_CONFIGS["cuda.blockscaled"] = replace(_PROMOTE_WIDE, block_scaled=True, epi_buffers=1)


def one_row_wide(m: int, n: int, k: int, ab_itemsize: int) -> bool:
    """One row of 128-row tiles on a wide, shallow weight (fp8, or 16-bit from WIDE_MIN_K_16BIT
    deep): where :func:`coop_config` takes 128x128 tiles on every SM and the dispatcher runs them
    first (WIDE_MIN_M above)."""
    depth_ok = k <= WIDE_MAX_K and (ab_itemsize == 1 or (ab_itemsize == 2 and k >= WIDE_MIN_K_16BIT))
    return depth_ok and WIDE_MIN_M <= m <= 128 and n >= WIDE_MIN_N


@functools.lru_cache(maxsize=4096)
def coop_config(
    m: int, n: int, k: int, ab_itemsize: int, b_k_major: bool, sms: int, fast_accum: bool = True
) -> NativeGemmConfig:
    """The persistent config ``cuda.persistent_coop`` runs for one problem: a pure function of the
    shape, the operand width (1 = e4m3, 2 = bf16/fp16), B's layout and the SM count, fitted to
    one H100 sweep (docs/native-gemm.md, "Per-shape configs", has the table). No call-time
    tuning. Group size and raster order stay at the default: no choice beat it beyond the
    sweep's noise.

    * fp8 with M >= 4096 and N, K >= 8192: ping-pong 128x128 tiles (1.08x cuBLAS at 8192^3, where
      cooperative 128x256 was at 0.99x): a smaller tile's A and B working set stays in L2.
    * 2-9 waves of tiles and K * itemsize <= 8 KB: the fewest CTAs that keep the number of waves
      (e.g. 128 instead of 132 for 512 tiles), so every CTA walks the same number of tiles (+0.4-2%).
    * 128x256 tiles for at most half the SMs, where 128x128 tiles are more: cooperative 128x128
      tiles (twice the CTAs at work).
    * one row of tiles (WIDE_MIN_M <= M <= 128) on a weight of at least WIDE_MIN_N rows and at
      most WIDE_MAX_K deep (16-bit: at least WIDE_MIN_K_16BIT): cooperative 128x128 tiles on
      every SM (see WIDE_MIN_M).
    * otherwise the 4-stage cooperative default (1 CTA per SM).
    * fp8 without ``fast_accum``: cooperative tiles with fp32 promotion (:func:`promote_config`).
    """
    if ab_itemsize == 1 and not fast_accum:
        return promote_config(m, n, k, sms)
    min_m, min_n, min_k = _PINGPONG_FP8_MIN
    if ab_itemsize == 1 and m >= min_m and n >= min_n and k >= min_k:
        return NATIVE_CONFIGS["cuda.persistent_pingpong"]
    if one_row_wide(m, n, k, ab_itemsize):
        return COOP_N128
    config = NATIVE_CONFIGS["cuda.persistent_coop"]
    tiles = -(-m // 128) * -(-n // config.block_n)
    if 2 * tiles <= sms and -(-m // 128) * -(-n // COOP_N128.block_n) > tiles:
        return COOP_N128
    max_split = dense_tail_split(m)
    if tail_split(tiles, sms, k_blocks(k, ab_itemsize), max_split) > 1:
        return replace(config, tail_split=max_split)
    waves = -(-tiles // sms)
    if 2 <= waves <= _BALANCE_MAX_WAVES and k * ab_itemsize <= _BALANCE_MAX_K_BYTES:
        ctas = -(-tiles // waves)
        if ctas < sms:
            config = replace(config, ctas=ctas)
    return config


def _variant(name: str, description: str, configs: tuple[NativeGemmConfig, ...] = ()) -> Variant:
    default = NATIVE_CONFIGS[name]
    # The dispatcher's choices get per-shape configs (grid balance, tile width, promotion).
    per_shape = name in ("cuda.persistent_coop", "cuda.blockscaled")

    def supports(args: GemmArgs) -> str | None:
        promoting = name == "cuda.persistent_coop" and args.is_fp8 and not args.fast_accum
        return unsupported_reason(args, _PROMOTE_WIDE if promoting else default)

    def build(args: GemmArgs, config: NativeGemmConfig | None = None) -> Plan:
        if config is None:
            config = default
            if per_shape:
                block = default.block_scaled
                config = coop_config(args.m, args.n, args.k, args.a.element_size(), tma.b_is_k_major(args.b),
                                     _device.sm_count(args.out.get_device()), args.fast_accum and not block)
                config = replace(config, block_scaled=block)
        return _Launch(args, config).plan(name)

    return Variant(name=name, backend="cuda", description=description, supports=supports, build=build,
                   configs=configs)


# ------------------------------------------------------------------------------------ inspection

# `tmagemm inspect` dtype names -> (A/B dtype, out dtype, B K-major): fp8 in the torch._scaled_mm
# layout, 16-bit types with B as torch.randn(K, N) gives it.
_AOT_FAMILIES = {
    "fp8": (torch.float8_e4m3fn, torch.bfloat16, True),
    "bf16": (torch.bfloat16, torch.bfloat16, False),
    "fp16": (torch.float16, torch.float16, False),
}


def aot_source(name: str, dtype: str = "fp8") -> tuple[str, dict[str, int]]:
    """(source file under tmagemm/cuda, NVRTC defines) of native variant ``name`` with its
    default config, for ``tmagemm inspect`` (tmagemm.inspection.native_source)."""
    if name not in NATIVE_CONFIGS:
        raise ValueError(f"unknown native variant {name!r}; known: {sorted(NATIVE_CONFIGS)}")
    if dtype not in _AOT_FAMILIES:
        raise ValueError(f"dtype must be one of {sorted(_AOT_FAMILIES)}, got {dtype!r}")
    ab, out, k_major = _AOT_FAMILIES[dtype]
    config = NATIVE_CONFIGS[name]
    if (config.promote or config.block_scaled) and dtype != "fp8":
        raise ValueError(f"{name} is an fp8 kernel (its mainloop promotes fp8 partial sums); use dtype 'fp8'")
    return _SOURCES[config.kernel], _defines(config, ab, out, k_major)


# Best first (measured on H100, docs/native-gemm.md): the dispatcher takes the first that accepts a
# problem when asked for "cuda". The multicast variant is correct but measured slower: last.
VARIANTS = [
    _variant(
        "cuda.persistent_coop",
        "native persistent WS, per-shape config (coop_config): cooperative 128x256 tiles, 4 stages, "
        "balanced grid for short K; ping-pong for large fp8; promoting tiles (promote_config) for fp8 "
        "without fast accumulation",
        PROMOTE_CANDIDATES,
    ),
    _variant("cuda.blockscaled", "native persistent WS, fp8 with 1x128 activation and 128x128 weight scales "
             "applied as each k-block's sum is promoted into fp32 (cooperative tiles, promote_config)",
             tuple(replace(c, block_scaled=True) for c in PROMOTE_CANDIDATES)),
    _variant("cuda.warp_specialized", "native warp-specialized TMA + wgmma, 128x256 tiles, setmaxnreg"),
    _variant("cuda.persistent_pingpong", "native persistent WS, ping-pong consumers, 128x128 tiles"),
    _variant("cuda.one_warpgroup", "native TMA + wgmma, one warpgroup (thread 0 also issues TMA), 128x128 tiles, "
             "3 stages"),
    _variant("cuda.persistent_coop_mc", "native persistent WS, cooperative, 2x1 clusters with B multicast"),
    _variant("cuda.persistent_pingpong_mc", "native persistent WS, ping-pong, 2x1 clusters with B multicast"),
]
