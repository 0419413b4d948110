"""The native grouped GEMM: the persistent kernel over every expert's tiles.

``gemm_sm90_persistent.cu`` built with ``TMAGEMM_GROUPED`` (a :class:`NativeGemmConfig` with
``groups`` = E) runs one launch over all groups of a :class:`~tmagemm.grouped.GroupedArgs`
problem, with the mainloops of the dense kernel (tiles per :func:`config_for`): cooperative
128 x 256 tiles for 16-bit and for fast-accumulation fp8 on groups of more than 128 rows at
larger K, ping-pong 128 x 128 tiles for the other fast-accumulation fp8 problems, fp32-promoted
fp8 for the ``use_fast_accum=False`` default (128 x 128 tiles) and the 1x128 / 128x128 block
scales (128 x 256 tiles, on 2x1 clusters for groups of 1024 rows or more). A, B and the output
are read and written through 2-D tensor maps over the experts stacked row after row
(:func:`tmagemm.tma.stacked_rows`); group sizes stay on the device and become a table in shared
memory (docs/grouped.md, "The native kernel").

The Triton kernel (``triton/matmul_grouped.py``) stays the path for what this one refuses
(:func:`unsupported_reason`), for decode-sized groups, where its 64-row tiles waste less, and
where it measured faster (:func:`preferred`).
"""

from __future__ import annotations

from dataclasses import replace

from .. import device as _device
from .. import tma
from ..grouped import GroupedArgs, GroupLayout, GroupScaling
from ..plan import Plan
from .gemm import (_OUT_TYPES, _PROMOTE_NARROW, _PROMOTE_WIDE, _ROW_BYTES, NATIVE_CONFIGS, TAIL_SPLIT,
                   NativeGemmConfig, _MappedLaunch, _Params)

NAME = "cuda.grouped"
# Where this kernel runs instead of the Triton one: the groups' expected rows (the mean for
# contiguous, max_m for masked), from which it was ahead, measured side by side on the expert
# projections of DeepSeek-V3, Qwen3-MoE and Mixtral (H100, contiguous balanced groups of 128-2048
# rows, graph-timed; BENCHMARKS.md). Block-scaled fp8 from above decode size: the Triton kernel's
# fresh product per k-block ran at 0.6-0.7x DeepGEMM there. Otherwise from above one 128-row tile
# per group: at 128 rows the two were within a few percent (bf16 and promoted fp8); from 256 rows
# the native kernel ran promoted fp8 at 1.14-1.32x torch's grouped op against the Triton kernel's
# 0.82-0.99x, at every K measured (1536-14336).
BLOCK_MIN_ROWS = 65
MIN_ROWS = 129
# fp8 with fast accumulation (tensor / row-wise scales) runs here from fewer rows, on the ping-pong
# schedule (see PINGPONG_MAX_K): from SHORT_K_MIN_ROWS rows per group at K <= PINGPONG_MAX_K and
# from FAST_MIN_ROWS at any K. Contiguous expert projections of DeepSeek-V3, Qwen3-MoE and Mixtral
# (H100, balanced and Zipf-routed groups, graph-timed; BENCHMARKS.md): at 64 rows and K <= 2048
# ping-pong tiles ran 0.96-1.02x the Triton kernel on balanced groups and 1.10-1.18x on Zipf ones;
# at K = 4096 0.95-0.97x / 1.03x, and at 14336 0.94x / 0.83x; at 128 rows 0.99-1.09x (balanced) and
# 1.03-1.31x (Zipf) at every K.
SHORT_K_MIN_ROWS = 64
FAST_MIN_ROWS = 128
# 2x1 clusters (B multicast to a pair of vertically adjacent tiles of one group): from this many
# rows per contiguous group. A pair whose second tile lies past a short group's end holds an SM
# for the tile's whole mainloop without output; with skewed routing most groups are short, and a
# masked layout's max_m says nothing about how many rows each group holds. On balanced groups of
# 256-512 rows single CTAs were within 3% of pairs, and the moe preset's geomeans and DeepGEMM's
# shapes measured the same with either rule (H100, BENCHMARKS.md).
CLUSTER_MIN_ROWS = 1024
# Groups of at least this many rows are compute-bound: their rows of tiles reuse the weight from
# L2, about 2 x rows FLOPs per weight byte (fp8; rows per byte for 16-bit) against the 230-430
# FLOPs an H100's tensor cores do per byte of memory bandwidth. Shorter groups stream their
# weight. The kernel spreads the heavy groups' tiles evenly among the light ones', whose weight
# it loads with an L2 evict-first policy (docs/grouped.md, "Heavy and light groups"): under Zipf
# routing the two kinds then keep tensor cores and memory busy at once, where group order ran
# them one after the other (moe preset, Zipf rows at 256 tokens per expert: H100 1.00-1.20x,
# H200 0.97-1.06x; BENCHMARKS.md). Balanced groups are all of one kind and keep the group order,
# as do 2x1 clusters.
HEAVY_GROUP_ROWS = 256
# The same on the ping-pong tiles (PINGPONG_MAX_K, below): groups of a whole 128-row tile count
# as heavy. Against 256 (H100, DeepSeek-V3, its EP4 and Qwen3-235B `down`, K = 1536-2048, 64 and
# 256 tokens per expert, two rounds): Zipf rows 0.99-1.03x (5 of 6 faster), balanced 0.99-1.00x;
# 192 0.99-1.01x, 384 and 512 down to 0.95x.
HEAVY_GROUP_ROWS_PINGPONG = 128
# fp8 with fast accumulation: the ping-pong schedule (consumers take alternate 128 x 128 tiles, so
# one's epilogue runs while the other's mainloop keeps the tensor cores busy) at K <=
# PINGPONG_MAX_K (at most 16 k-blocks per tile: the epilogue is a large share of its time) and, at
# any K, on groups of at most PINGPONG_MAX_ROWS rows (one row of tiles, waiting on streamed
# weights). Elsewhere the cooperative 128 x 256 tiles, which read less shared memory per FLOP.
# Against the cooperative tiles (H100, moe expert projections, graph-timed; BENCHMARKS.md), balanced
# / Zipf-routed groups: at K = 1536-2048 and 256 rows per group 1.09-1.15x / 1.02-1.13x; at 128
# rows 1.03-1.08x / 1.01-1.22x at every K (1536-14336); at K = 4096-14336 and 192 rows 0.96-1.07x /
# 0.95-1.05x (DeepSeek-V3 `gate_up` and Mixtral `down` behind), at 256 rows 0.93-1.08x / 0.82-1.02x.
# 16-bit operands (a k-block half as deep) stay cooperative: ping-pong measured 0.84-1.02x /
# 0.68-0.89x at 256-2048 rows, and 0.92-0.98x / 0.97-1.12x on the `down` projections at 192.
PINGPONG_MAX_K = 2048
PINGPONG_MAX_ROWS = 128


def rows_per_group(args: GroupedArgs) -> int:
    """The expected rows of a group from shapes alone: the mean (contiguous) or max_m."""
    if args.layout == GroupLayout.CONTIGUOUS:
        return -(-args.m // max(args.e, 1))
    return args.m


def config_for(args: GroupedArgs) -> NativeGemmConfig:
    """The grouped config for a problem (pure; nothing timed).

    * block-scaled fp8: the dense kernel's promoting 128 x 256 tiles, as 2x1 clusters only for
      contiguous groups of CLUSTER_MIN_ROWS rows or more on average (DeepGEMM's shapes);
    * fp8 with tensor/row scales and ``use_fast_accum=False``: 128 x 128 promoting tiles with two
      scratch fragments, single CTAs: ahead of the 128 x 256 ones or within 3% on every measured
      expert shape from 128 to 2048 rows per group, 3-8% ahead at 128 rows (H100, BENCHMARKS.md,
      "Native or Triton per shape, promoted fp8");
    * fp8 with fast accumulation at K <= PINGPONG_MAX_K or at most PINGPONG_MAX_ROWS rows per
      group: the ping-pong schedule's 128 x 128 tiles, single CTAs (see PINGPONG_MAX_K);
    * otherwise (16-bit, fp8 with fast accumulation) the dense cooperative 128 x 256 tiles.
    """
    if args.scaling == GroupScaling.BLOCK:
        pairs = args.layout == GroupLayout.CONTIGUOUS and rows_per_group(args) >= CLUSTER_MIN_ROWS
        config = replace(_PROMOTE_WIDE, cluster_m=2 if pairs else 1, block_scaled=True)
    elif args.is_fp8 and not args.fast_accum:
        config = replace(_PROMOTE_NARROW, cluster_m=1)
    elif args.is_fp8 and (args.k <= PINGPONG_MAX_K or rows_per_group(args) <= PINGPONG_MAX_ROWS):
        config = NATIVE_CONFIGS["cuda.persistent_pingpong"]
    else:
        config = NATIVE_CONFIGS["cuda.persistent_coop"]
    tail_split = 0 if config.pingpong else TAIL_SPLIT  # the tail split needs both consumers on a tile
    return replace(config, groups=args.e, tail_split=tail_split).fitted(args.out.element_size())


def _operand_views(args: GroupedArgs):
    """(a, b, out) as the 2-D maps the kernel reads, or a reason string when they cannot be."""
    a = args.a if args.layout == GroupLayout.CONTIGUOUS else tma.stacked_rows(args.a)
    out = args.out if args.layout == GroupLayout.CONTIGUOUS else tma.stacked_rows(args.out)
    b = tma.stacked_rows(args.b.transpose(1, 2) if args.b_k_major else args.b)
    for view, name in ((a, "a"), (b, "b"), (out, "out")):
        if view is None:
            return f"{name}'s experts are not stacked at one stride (a strided view of a larger tensor)"
    return a, b, out


def preferred(args: GroupedArgs) -> bool:
    """Whether the dispatcher runs ``args`` here (see MIN_ROWS, SHORT_K_MIN_ROWS) rather than on
    the Triton kernel.
    Masked 16-bit groups and fp8 ones with fast accumulation (tensor/row scales) at K >
    PINGPONG_MAX_K stay on the Triton kernel at any max_m: max_m bounds the rows without saying
    how many there are, and with Zipf-routed counts (64 tokens per expert on average, max_m
    189-1024) the Triton kernel ran Mixtral, Qwen3-MoE and DeepSeek-V3 expert projections 1-22%
    faster than the cooperative tiles (fp8 row-wise with fast accumulation and bf16; H100,
    BENCHMARKS.md). Masked fp8 with fast accumulation at K <= PINGPONG_MAX_K takes the ping-pong
    tiles from FAST_MIN_ROWS of max_m: against the Triton kernel they ran the `down` projections
    of DeepSeek-V3, its EP4 and Qwen3-235B 1.06-1.13x under Zipf routing at 64 tokens per expert
    (max_m in the hundreds) and 0.96-1.02x on balanced groups of 64, which stay below the bound.
    Promoted fp8 (use_fast_accum=False), whose native tiles measured 1.1-1.4x the Triton kernel
    on full groups, and block scales keep the rows-per-group rule."""
    fast, promoted = args.is_fp8 and args.fast_accum, args.is_fp8 and not args.fast_accum
    short_k = args.k <= PINGPONG_MAX_K
    if args.scaling == GroupScaling.BLOCK:
        min_rows = BLOCK_MIN_ROWS
    elif args.layout == GroupLayout.MASKED and not promoted:
        if not (fast and short_k):
            return False
        min_rows = FAST_MIN_ROWS
    elif fast:
        min_rows = SHORT_K_MIN_ROWS if short_k else FAST_MIN_ROWS
    else:
        min_rows = MIN_ROWS
    return rows_per_group(args) >= min_rows and unsupported_reason(args) is None


def unsupported_reason(args: GroupedArgs, config: NativeGemmConfig | None = None) -> str | None:
    """None when the native grouped kernel computes ``args`` (with ``config``, default
    :func:`config_for`), else why not."""
    if not _device.is_hopper(args.a.device):
        return f"native kernels need CUDA tensors on a Hopper GPU (sm_90), got {args.a.device}"
    if args.k == 0 or args.m == 0 or args.n == 0 or args.e == 0:
        return "zero-size problems take the Triton kernel (its epilogue writes the bias rows of K = 0)"
    if args.scaling == GroupScaling.BLOCK and args.b_per_channel:
        return "block scales per output channel (1x128 scale_b) are applied by the Triton kernel only"
    if not args.b_k_major and args.k % (_ROW_BYTES // args.b.element_size()):
        return "an N-major b needs K a multiple of the k-block (a box would read the next expert's rows)"
    views = _operand_views(args)
    if isinstance(views, str):
        return views
    a, b, out = views
    if max(a.shape[0], b.shape[0], args.k, args.n) >= 2**31:
        return "stacked rows and dimensions must fit in int32"
    reason = (tma.operand_reason(a, "a", True) or tma.operand_reason(b, "b", True) or tma.store_reason(out))
    if reason:
        return reason
    sa_e, sa_m, _ = args.scale_a_strides
    sb_e, sb_n, _ = args.scale_b_strides
    if args.scaling == GroupScaling.EPILOGUE:
        # The epilogue reads row-wise scales by stacked row; block scales take an expert offset
        # (Params::block_scale_a_group), so any (E, max_m, K/128) strides work.
        stacked = args.layout == GroupLayout.CONTIGUOUS or args.e == 1 or sa_e == sa_m * args.m
        if not stacked:
            return "scale_a's experts are not stacked at one stride"
        if sa_m not in (0, 1) or sb_n not in (0, 1):
            return "row-wise scales must be contiguous along their rows / columns"
    if args.bias is not None and args.n > 1 and args.bias.stride(1) != 1:
        return f"bias must be contiguous along N, got stride {tuple(args.bias.stride())}"
    config = config or config_for(args)
    if not (config.groups >= args.e and config.fitted(args.out.element_size()).is_valid(args.out.element_size())):
        return f"config {config.label()} does not fit {args.e} groups in shared memory"
    if args.is_fp8 and not args.fast_accum and not config.promote and args.scaling != GroupScaling.BLOCK:
        return "use_fast_accum=False needs a promoting config"
    if config.block_scaled != (args.scaling == GroupScaling.BLOCK):
        return "block scales need a block-scaled config, and a block-scaled config block scales"
    return None


def tile_bound(args: GroupedArgs, config: NativeGemmConfig) -> int:
    """An upper bound of the cluster tiles any counts can give, from shapes alone (the grid)."""
    rows = 128 * config.cluster_m
    tiles_n = -(-args.n // config.block_n)
    if args.layout == GroupLayout.CONTIGUOUS:
        # Each non-empty group adds at most one partial cluster tile to ceil(M_total / rows).
        return (-(-args.m // rows) + min(args.e, args.m)) * tiles_n
    return args.e * -(-args.m // rows) * tiles_n


class _GroupedLaunch:
    """What a grouped plan resolves once: the checked config and the fixed parameters, over the
    native launch core (maps, kernel, grid); a call points them at the operands and launches."""

    def __init__(self, args: GroupedArgs, config: NativeGemmConfig):
        reason = unsupported_reason(args, config)
        if reason is not None:
            raise ValueError(f"{NAME} {config.label()}: {reason}")
        config = self.config = config.fitted(args.out.element_size())
        a, b, out = _operand_views(args)
        p = _Params()
        p.m, p.n, p.k, p.group_m = a.shape[0], args.n, args.k, config.group_m
        p.alpha, p.beta = 1.0, 0.0
        p.groups, p.group_layout = args.e, int(args.layout != GroupLayout.CONTIGUOUS)
        p.group_rows = args.m
        # The heavy/light threshold of the tile walk (2x1 clusters ignore it: they keep group order).
        p.heavy_group_rows = HEAVY_GROUP_ROWS_PINGPONG if config.pingpong else HEAVY_GROUP_ROWS
        p.b_group_rows = args.n if args.b_k_major else args.k
        p.ldd = out.stride(0)
        sa_e, sa_m, sa_k = args.scale_a_strides
        sb_e, sb_n, sb_k = args.scale_b_strides
        if args.scaling == GroupScaling.BLOCK:  # the mainloop reads both block scales through their strides
            p.block_scale_a_m, p.block_scale_a_k = sa_m, sa_k
            if args.layout != GroupLayout.CONTIGUOUS:  # masked / batched: each expert's scales at its stride
                p.block_scale_a_group = sa_e - args.m * sa_m
            p.block_scale_b_n, p.block_scale_b_k, p.block_scale_b_group = sb_n, sb_k, sb_e
        elif args.scaling != GroupScaling.NONE:
            p.scale_a_rowwise, p.scale_b_colwise, p.scale_b_group = int(sa_m != 0), int(sb_n != 0), sb_e
        if args.bias is not None:
            p.bias_type, p.bias_group = _OUT_TYPES[args.bias.dtype], args.bias.stride(0)
        self._core = _MappedLaunch(config, a, b, out, args.b_k_major, p, tile_bound(args, config), exact_tiles=False)
        self.pdl = self._core.pdl
        self.device_index = self._core.device_index

    @property
    def heavy_group_rows(self) -> int:
        """The heavy/light threshold the kernel walks its tiles with (rows per group)."""
        return self._core.params.heavy_group_rows

    def __call__(self, a, b, out, scale_a, scale_b, bias, counts) -> None:
        """The launch on these operands (same signature as the plan's), on the current stream."""
        core = self._core
        with core.lock:  # the maps and the parameter block are shared by every call of the plan
            p = core.params
            p.d = out.data_ptr()
            p.group_counts = counts.data_ptr() if counts is not None else None
            core(a, b, out, scale_a, scale_b, bias)


def build(args: GroupedArgs, config: NativeGemmConfig | None = None, num_sms: int | None = None) -> Plan:
    """A plan for every grouped problem with ``args``' signature: ``launch(a, b, out, scale_a,
    scale_b, bias, counts)``. ``config`` overrides :func:`config_for`; ``num_sms`` caps the
    persistent grid (its ``ctas``; tests make every CTA walk several tiles)."""
    config = config or config_for(args)
    if num_sms:
        config = replace(config, ctas=num_sms)
    launch = _GroupedLaunch(args, config)
    return Plan(NAME, launch.config, launch, launch.device_index, direct=True)
