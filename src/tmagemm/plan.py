"""The plan layer: where a checked GEMM call becomes a kernel launch.

One problem description (:class:`GemmArgs`: operands, and :class:`Scaling`: how each scale
applies), one :class:`Plan` type that every kernel family returns (its config plus one call that
launches with the operands), one registry of kernel families, one preference order, and one
cache of plans keyed by the call's signature, planned once per signature.

Adding a kernel family: write ``tmagemm/<backend>/<family>.py`` with its kernel, frozen config,
validity rule, heuristic and a ``VARIANTS`` list of :class:`Variant` whose ``build`` returns a
:class:`Plan`; add the module to :data:`FAMILY_MODULES` (and, if "auto" should pick it, a rule to
:func:`preference`). docs/plan-layer.md walks through the steps.

Backend modules are imported lazily: importing ``tmagemm`` compiles and probes nothing.
"""

from __future__ import annotations

import enum
import functools
import importlib
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch

from . import device

# Modules that define VARIANTS. One line per kernel family.
FAMILY_MODULES = (
    "tmagemm.triton.matmul_tma",
    "tmagemm.triton.matmul_persistent",
    "tmagemm.triton.matmul_splitk",
    "tmagemm.triton.matmul_ptr",
    "tmagemm.triton.matmul_blockscaled",
    "tmagemm.cuda.gemm",
    "tmagemm.cuda.decode",
    "tmagemm.wave_split",
)

BACKENDS = ("auto", "triton", "cuda")  # what callers may force; "mixed" plans (both kinds) run under "auto" only


class Scaling(enum.IntEnum):
    """How a dequantization scale applies to its operand (the kernels' SCALE_A / SCALE_B)."""

    NONE = 0  # no scale (bf16/fp16 matmul)
    TENSOR = 1  # one fp32 value for the whole operand
    ROW = 2  # one fp32 value per row of A (M values) or per column of B (N values)
    BLOCK_1X128 = 3  # one per row of A (column of B) per 128-deep k-block: (M or N, ceil(K/128))
    BLOCK_128X128 = 4  # B only: one per 128 x 128 block of the (N, K) weight: (ceil(N/128), ceil(K/128))

    @classmethod
    def of(cls, scale: torch.Tensor | None) -> "Scaling":
        """The scaling of a normalised tensor- or row-wise scale operand (block scalings are
        never inferred: a :class:`GemmArgs` names them)."""
        if scale is None:
            return cls.NONE
        return cls.TENSOR if scale.numel() == 1 else cls.ROW

    @property
    def is_block(self) -> bool:
        return self >= Scaling.BLOCK_1X128


class GemmArgs(NamedTuple):
    """Validated, normalised operands of one GEMM: ``out = (scale_a*scale_b) * (a @ b) + bias``.

    a: (M, K); b: (K, N); out: (M, N), preallocated, written by the kernel.
    scale_a: None, or fp32 with one element (tensor-wise) or M elements 4 bytes apart (row-wise);
        kernels read only its pointer and numel.
    scale_b: None, or fp32 with one element or N elements 4 bytes apart.
    bias: None, or contiguous (N,) in any float dtype; added in fp32.
    fast_accum: fp8 only; True keeps wgmma's reduced-precision accumulation across all of K
        (``use_fast_accum`` of the public API), False adds each k-block's sum into fp32.
    block_scaling: None for tensor/row-wise scales (inferred from their sizes), or the
        ``(Scaling, Scaling)`` of block-scaled operands: scale_a (M, ceil(K/128)) with
        ``BLOCK_1X128``; scale_b (ceil(N/128), ceil(K/128)) with ``BLOCK_128X128`` or (N,
        ceil(K/128)) with ``BLOCK_1X128``; both 2-D fp32 with any strides (kernels take them).
        Block-scaled products always add each k-block's sum into fp32 (fast_accum is ignored).
        One family also takes a bf16/fp16 ``a`` with scale_a None and (BLOCK_1X128, ...): a
        quantized per 1x128 group inside the kernel (``cuda.decode.build_quantizing``, called
        directly, never through the dispatcher).
    (A NamedTuple: it is built on a first call, and that costs a fraction of a dataclass.)
    """

    a: torch.Tensor
    b: torch.Tensor
    out: torch.Tensor
    scale_a: torch.Tensor | None = None
    scale_b: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    fast_accum: bool = True
    block_scaling: tuple | None = None

    @property
    def m(self) -> int:
        return self.a.shape[0]

    @property
    def n(self) -> int:
        return self.b.shape[1]

    @property
    def k(self) -> int:
        return self.a.shape[1]

    @property
    def is_fp8(self) -> bool:
        return self.a.element_size() == 1

    @property
    def scaling(self) -> tuple[Scaling, Scaling]:
        if self.block_scaling is not None:
            return self.block_scaling
        return Scaling.of(self.scale_a), Scaling.of(self.scale_b)

    @property
    def operands(self) -> tuple:
        """What :meth:`Plan.run` takes: ``(a, b, out, scale_a, scale_b, bias)``."""
        return self.a, self.b, self.out, self.scale_a, self.scale_b, self.bias


@functools.lru_cache(maxsize=1)
def _several_gpus() -> bool:
    return torch.cuda.device_count() > 1


@dataclass(frozen=True, eq=False)
class Plan:
    """A resolved GEMM: what every kernel family's ``build`` returns.

    variant: the registered name that built it; config: that family's frozen config (None when
    it has none); launch: ``launch(a, b, out, scale_a, scale_b, bias)`` writes ``out`` for any
    operands with the signature the plan was built for; device_index: the GPU the kernel is
    loaded on (-1: CPU, the interpreter); direct: launched through ``tmagemm.jit`` (host time)
    rather than Triton's launcher.
    """

    variant: str
    config: Any
    launch: Callable[..., None]
    device_index: int = -1
    direct: bool = False

    def run(self, *operands) -> None:
        """``launch(*operands)`` on the plan's GPU whatever the current device is, leaving the
        current device as it was (the check costs one driver query, and only on machines with
        several GPUs). Dense plans take ``(a, b, out, scale_a, scale_b, bias)``; grouped ones
        add the group counts."""
        if self.device_index >= 0 and _several_gpus() and torch.cuda.current_device() != self.device_index:
            with torch.cuda.device(self.device_index):
                self.launch(*operands)
            return
        self.launch(*operands)

    def __call__(self, args: GemmArgs) -> None:
        self.run(*args.operands)


@dataclass(frozen=True)
class Variant:
    """One registered kernel path of a family.

    ``supports(args)`` returns None when the variant computes ``args`` correctly, or a short
    reason why not (e.g. "b leading stride of 12 bytes is not a multiple of 16"). ``build(args,
    config=None)`` returns the :class:`Plan` for every problem with the same signature (shapes,
    strides, dtypes, alignment, scaling, fast_accum) as ``args``; ``config`` overrides the
    family's heuristic (tests, benchmarks). ``configs``: the family's candidate configs, the ones
    call-time tuning times and ``tmagemm bench --configs`` lists one by one (empty: the family has
    a rule, not candidates).
    """

    name: str
    backend: str  # "triton", "cuda", or "mixed" (a plan of both kinds: "auto" only)
    description: str
    supports: Callable[[GemmArgs], str | None]
    build: Callable[..., Plan]
    configs: tuple = ()


# ------------------------------------------------------------------------------------ registry

_registry: dict[str, Variant] | None = None
_unavailable: dict[str, str] = {}


def _load() -> dict[str, Variant]:
    global _registry
    if _registry is None:
        found: dict[str, Variant] = {}
        for module_name in FAMILY_MODULES:
            try:
                module = importlib.import_module(module_name)
            except ImportError as exc:  # an optional dependency (e.g. cuda-bindings) is missing
                _unavailable[module_name] = f"{type(exc).__name__}: {exc}"
                continue
            for variant in module.VARIANTS:
                found[variant.name] = variant
        _registry = found
    return _registry


def variants() -> list[Variant]:
    """All registered variants, in registry order."""
    return list(_load().values())


def unavailable() -> dict[str, str]:
    """Family modules that could not be imported, with the reason."""
    _load()
    return dict(_unavailable)


def get(name: str) -> Variant:
    registry = _load()
    if name not in registry:
        raise ValueError(f"unknown tmagemm variant {name!r}; known: {sorted(registry)}")
    return registry[name]


# ---------------------------------------------------------------------------------- preference

# Largest M the non-persistent Triton kernel is preferred for (H200, graph-timed vs cuBLAS,
# BENCHMARKS.md): at M = 384-512, N = K = 4096 the native cooperative kernel with 128x128 tiles
# ran at 0.91-0.99x (fp8) and 1.04x (bf16 512) against 0.84-0.91x and 0.90x on Triton; at M = 256
# Triton was ahead (fp8 1.01-1.02x).
MID_M = 256


# bf16/fp16 from 17 to 64 tokens: the tile kernel (6-stage 64 x 64 tiles, matmul_tma), except
# on long K (>= SPLITK_16BIT_LONG_K) over weights so narrow that split-K cuts K in >= 3 slices
# (its 64-row tiles cover at most a third of the SMs). H100, graph-timed, L2 flushed, both weight
# layouts, M = 24-64 (BENCHMARKS.md): the tile kernel 0.94-1.05x cuBLAS where split-K ran
# 0.82-1.01x (N = K = 4096, 3584, 3072, 2048 x 2048, 1024 x 4096, 4096 x 14336); split-K
# 0.93-1.03x where the tile kernel ran 0.85-0.92x (2048 and 2560 x 8192).
SPLITK_16BIT_MAX_M = 64
SPLITK_16BIT_LONG_K = 8192


# The native decode kernel (cuda/decode.py) first on weights of at least DECODE_MIN_N x
# DECODE_MIN_K, up to its rule's max_m tokens, max_share k-blocks of 128 bytes per CTA after its K
# split and max_tiles_per_sm 64-row weight tiles per SM (cuda.decode.rule_for). Measured per GEMM
# on the 17 decode-stack projections, 8 chained copies with their own weights in one CUDA graph,
# M = 1 and 16 (H200, BENCHMARKS.md): where the rule takes it, fp8 1-19% faster than split-K on
# all 10 shapes (geomean 9.8%), bf16 2.4% faster in geomean (11% faster to 4% slower). Past it
# split-K was ahead: more tiles than SMs (N = 14336-37888, 2-11%; block-scaled fp8 on an H100
# excepted) or a longer share of K per CTA (7168 x 16384 and 7168 x 18432, 1-6%; on an H100 the
# unsplit kernel was ahead there). Narrower or shorter weights were not measured.
DECODE_MIN_N = 2048
DECODE_MIN_K = 2048


def _decode_first(args: GemmArgs) -> bool:
    from .cuda.decode import takes  # backend modules: imported lazily

    return takes(args.m, args.n, args.k, args.a.element_size(), args.block_scaling is not None, args.out.device)


# fp8 from 17 to 32 tokens on weights FP8_TILE_MIN_N to FP8_TILE_MAX_N wide: the tile kernel (its
# activation through pointer loads, matmul_tma.a_pointer_loads), also on K > 8192 and on 100 MB
# weights, where split-K ran before the pointer loads. Decode stacks at M = 24 and 32, two
# rounds: fp8 tensor-wise 0.991 -> 1.010x cuBLAS on an H200 (Llama-3-8B 5% faster per layer),
# 1.007 -> 1.017x on an H100, no layer slower. Per GEMM (H200, M = 32) split-K stayed ahead on
# 3584-wide weights and on the widest ones (36864 x 7168, 37888 x 3584: 6-9%). On GPUs with slow
# memory (an H100), with fast accumulation, up to FP8_SLOW_MEMORY_TILE_MAX_N: there the tile
# kernel takes 256-deep steps (matmul_tma._fp8_small_m), and 8 chained copies with their own
# weights in one CUDA graph ran 36864 x 7168 at 32 tokens in 94.3 us against split-K's 96.0-96.3
# and 37888 x 3584 in 51.7 against 52.1 (H100, 2026-11-28, two jobs); in the decode stacks at 24
# and 32 tokens DeepSeek-V3's layers 0.7-1.0% and Qwen2.5-7B's 0.2-1.2% faster (two rounds).
FP8_TILE_MIN_N = 4096
FP8_TILE_MAX_N = 32768
FP8_SLOW_MEMORY_TILE_MAX_N = 37888
# fp8 with fast accumulation at up to 16 tokens on weights FP8_WIDE_TILE_MIN_N to FP8_TILE_MAX_N
# wide with K >= FP8_WIDE_TILE_MIN_K, on GPUs with slow memory (an H100): the tile kernel too
# (64 x 128 tiles, 256-deep steps), not split-K. 8 chained copies with their own weights in one
# CUDA graph, fp8 tensor-wise, two rounds (H100, 2026-11-28, BENCHMARKS.md): 14336 x 8192 43.2 ->
# 41.6 us at one token and 44.1 -> 42.3 at 16 (0.97x -> 1.01x cuBLAS), 28672 x 4096 42.6 -> 41.8
# and 43.9 -> 43.0; the wider 36864 x 7168 level and 37888 x 3584 2% slower keep split-K. Decode
# stacks (two rounds): Llama-3-8B and Llama-3-70B TP 4 1.3-1.9% faster per layer at 1 and 16
# tokens, fp8 tensor- and row-wise, level at 32; the other stacks level.
FP8_WIDE_TILE_MIN_N = 14336
FP8_WIDE_TILE_MIN_K = 4096


def _splitk_first(args: GemmArgs) -> bool:
    """Small M where split-K measured ahead of the tile kernel (H200, graph-timed vs cuBLAS fp8,
    docs/small-m.md): fp8 at M <= 16 with K >= 3072 (N = K = 4096: 0.88-0.92x vs 0.82-0.87x;
    long-K projections 0.97-1.04x vs 0.73-0.88x; Qwen2.5-7B's K = 3584 projections on an H100:
    1-12% faster; with a short K, e.g. K = 512-1536 and N =
    24-32K, the tile kernel was ahead), fp8 at M <= 32 with K > 8192 (the tile kernel then walks
    a long K on few CTAs), any M <= 32 with >= 100 MB of weight (earlier H100 sweep), bf16 /
    fp16 at M <= 16 (H100, M = 8 and 16 on N = K = 4096, 3584, 6144 / 14336 x 4096 and 4096 x
    14336, either weight layout: split-K ahead of the tile kernel's heuristic tiles at 14 of 20
    points, by up to 15%, and behind at 6 by at most 3%), and bf16 / fp16 up to
    SPLITK_16BIT_MAX_M on long K over narrow weights (above). fp8 where :func:`_fp8_tile` holds
    keeps the tile kernel."""
    fp8_tile = _fp8_tile(args)
    if args.m <= 32 and args.n * args.k * args.b.element_size() >= 100e6 and not fp8_tile:
        return True
    if not args.is_fp8:
        if args.m <= 16:
            return True
        if args.m > SPLITK_16BIT_MAX_M or args.k < SPLITK_16BIT_LONG_K:
            return False
        from .triton.matmul_splitk import choose_config  # a backend module: imported lazily

        sms = device.sms_of(args.out.device)
        return choose_config(args.m, args.n, args.k, args.a.element_size(), sms).split_k >= 3
    return not fp8_tile and ((args.m <= 16 and args.k >= 3072) or (args.m <= 32 and args.k > 8192))


def _fp8_tile(args: GemmArgs) -> bool:
    """fp8 at decode sizes where the tile kernel stays ahead of split-K (above): 17-32 tokens on
    a weight FP8_TILE_MIN_N to FP8_TILE_MAX_N wide, and with fast accumulation on a GPU with
    slow memory 17-32 tokens up to FP8_SLOW_MEMORY_TILE_MAX_N wide and up to 16 tokens on a
    weight FP8_WIDE_TILE_MIN_N to FP8_TILE_MAX_N wide and at least FP8_WIDE_TILE_MIN_K deep."""
    if not args.is_fp8 or args.m > 32 or args.n < FP8_TILE_MIN_N:
        return False
    if args.m > 16 and args.n <= FP8_TILE_MAX_N:
        return True
    if not (args.fast_accum and device.slow_memory(args.out.device)):
        return False
    if args.m > 16:
        return args.n <= FP8_SLOW_MEMORY_TILE_MAX_N
    return args.k >= FP8_WIDE_TILE_MIN_K and FP8_WIDE_TILE_MIN_N <= args.n <= FP8_TILE_MAX_N


# Block-scaled fp8 at decode-sized M. The split-K kernel (swap-AB, 64 weight rows per tile) wins
# at M <= 16 on every checkpoint shape, and up to BLOCK_SMALL_M where its K split is at least 3,
# or 2 on its swapped tiles (M <= BLOCK_SWAP_MAX_M) and, up to one row of 64-token tiles, where
# those tiles cover under half the SMs: narrow or long-K weights whose tiles alone leave SMs
# idle. Elsewhere the Triton kernel's 64 x 64 tiles are ahead of the native kernel's 128 x 128 on
# weights up to BLOCK_SMALL_N wide, and on every weight while its tiles make one row (M <=
# BLOCK_ONE_ROW_M). H100, 8 chained copies in one CUDA graph, the decode stacks' 17 projections
# at M = 64 (BENCHMARKS.md): where split-K cut K in 2 over half the SMs or more, the Triton tiles
# ran 1-15% faster (6144 x 4096 16.4 -> 14.2 us, 8192 x 7168 29.2 -> 27.3, 7168 x 16384 51.6 ->
# 49.9); on weights wider than 8192, 5-9% faster than the native tiles (36864 x 7168 113.7 ->
# 104.0 us), which stay ahead at M = 128. Decode stacks at 48 and 64 tokens: layers 4-7% faster
# on an H100, 7-14% on an H200. At M = 32 the chained copies measured the same, but in
# the MLP chain (quantized activations from the kernel before) 7168 x 18432 ran 20% slower on
# the Triton tiles, whose 64-row activation box hangs half past M, than split in 2: the swapped
# tiles keep their 2 slices.
BLOCK_SMALL_M = 128
BLOCK_SMALL_N = 8192
BLOCK_ONE_ROW_M = 64


# The layout of the 1x128 activation scales the library's own quantizers write for a block-scaled
# GEMM (tmagemm.nn): contiguous along M (tma.aligned_empty) above BLOCK_SMALL_M rows, where the
# native kernel runs and its producer loads such scales by TMA with the operands (H100, 11
# checkpoint shapes, auto: 0.999x row-major's speed at M = 192, 1.004x at 256, 1.022-1.035x at
# 512-4096, outputs bit for bit the same; BENCHMARKS.md); row-major at fewer rows, where the
# split-K and Triton tiles read a k-block's scales across the tile's tokens (0.89x at M = 16-128
# with M-contiguous scales before those kernels loaded them in chunks, 0.95-0.99x since).
def activation_scales_m_major(m: int) -> bool:
    return m > BLOCK_SMALL_M


# Block-scaled split-K tiles: up to BLOCK_SWAP_MAX_M tokens (rounded up to a power of two >= 16)
# sit in WGMMA's N slot (swap-AB); from there 64-token tiles keep them in the M slot, where each
# thread promotes 2 token rows per k-block instead of loading 16 column scales strided by
# ceil(K/128). Above 64 tokens, 64-token tiles only where they still cut K in >= 3 slices, else
# 128 tokens swapped. H100, 8 chained copies in one CUDA graph (BENCHMARKS.md): M = 64, 1-9%
# faster on every split-K decode shape (6144 x 4096 17.2 -> 16.1 us); M = 128, 2112 x 7168 and
# 2560 x 8192 13-14% faster; at M = 32 the swapped 32-token tiles stay 1-6% faster.
BLOCK_SWAP_MAX_M = 32


def _block_slices(m: int, n: int, k: int, sms: int, token_rows: int) -> int:
    tiles = -(-max(m, 1) // token_rows) * -(-n // 64)
    k_blocks = -(-k // 128)
    decode = m <= 16
    split = min(2 * sms // tiles, k_blocks // (12 if decode else 16))
    if decode and split == 2 and 2 * tiles >= sms and k_blocks < 64:
        split = 1
    return max(1, split)


def block_tiling(m: int, n: int, k: int, sms: int) -> tuple[int, bool, int]:
    """(token rows per tile, swap-AB, K slices) of the block-scaled split-K launch over 64-row
    weight tiles. The slices: enough for two CTAs per SM, keeping >= 16 k-blocks of 128 per
    slice (a shorter slice costs more in partial sums than it gains: H100, K = 2048 lost 10% with
    2 slices).

    At decode M (<= 16) the slices may be 12 k-blocks long, and tiles that already cover half the
    SMs are not cut in two below 64 k-blocks. Measured per GEMM with 8 chained copies (own
    weights) in one CUDA graph, M = 1 and 16, H100 (BENCHMARKS.md): 3584 x 3584 with 2 slices
    instead of 1, 8.6% faster; 6144 x 4096 and 8192 x 7168 unsplit instead of 2 slices, 9.5% and
    2-5% faster; the other decode-stack shapes unchanged or within 1.5%."""
    if m <= BLOCK_SWAP_MAX_M:
        rows = max(16, 1 << max(0, (m - 1).bit_length()))
        return rows, True, _block_slices(m, n, k, sms, rows)
    split = _block_slices(m, n, k, sms, 64)
    if m <= 64 or split >= 3:
        return 64, False, split
    return 128, True, _block_slices(m, n, k, sms, 128)


def block_split_k(m: int, n: int, k: int, sms: int) -> int:
    """K slices of the block-scaled split-K launch (:func:`block_tiling`)."""
    return block_tiling(m, n, k, sms)[2]


# On the swapped tiles (M <= BLOCK_SWAP_MAX_M), weights wide enough for one 64-row tile per SM
# stream faster through the unsplit split-K kernel than through the 128-row native tiles, once K
# has BLOCK_STREAM_K_BLOCKS k-blocks (H100, 8 chained copies in one CUDA graph, M = 32: 14336 x
# 8192, 36864 x 7168 and 37888 x 3584 11-13% faster, 28672 x 4096 2%; 24576 x 1536, 12
# k-blocks, 5% slower; BENCHMARKS.md).
BLOCK_STREAM_K_BLOCKS = 24


def _block_splitk_first(args: GemmArgs) -> bool:
    if args.m > BLOCK_SMALL_M:
        return False
    sms = device.sms_of(args.out.device)
    if args.m <= BLOCK_SWAP_MAX_M and -(-args.n // 64) >= sms and -(-args.k // 128) >= BLOCK_STREAM_K_BLOCKS:
        return True
    split = block_split_k(args.m, args.n, args.k, sms)
    if args.m <= 16 or split >= 3:
        return True
    # Two slices: on the swapped tiles, or while one row of 64-token tiles covers under half the SMs.
    one_row_short = args.m <= BLOCK_ONE_ROW_M and 2 * -(-args.n // 64) < sms
    return split == 2 and (args.m <= BLOCK_SWAP_MAX_M or one_row_short)


def preference(args: GemmArgs) -> tuple[str, ...]:
    """Variants "auto" tries, best first, from the side-by-side measurements in BENCHMARKS.md.

    A variant is skipped when it is not registered or refuses the problem; the pointer kernel
    accepts everything.
    - decode M (see :func:`_decode_first`): the native decode kernel, whose clusters share a
      narrow weight's K (fp8 with K-major weights and fast accumulation or block scales, 16-bit
      operands with either weight layout; it refuses the rest), then split-K.
    - small M (see :func:`_splitk_first`): split-K, whose partial sums keep enough CTAs streaming
      the weight.
    - M <= MID_M (256): the non-persistent Triton kernel with host-encoded tensor maps, launched
      directly (maps cached per address, so no per-call encode); its device-built-map twin
      ``triton.tma_device`` costs ~2.5 us more GPU time and stays a fallback. fp8 without fast
      accumulation above M = 128 takes the native kernel where :func:`_promoting_native_first`,
      and fp8 with fast accumulation or 16-bit operands at 112-128 tokens on wide weights where
      :func:`_native_wide_first`. Ahead of all of these, one row of 128-row tiles on a weight
      a little over two or more waves wide runs as ``mixed.wave_split``
      (:func:`_wave_split_first`): the whole waves on native tiles, the rest as its own GEMM.
    - larger M: the native persistent cooperative kernel (per-shape config), then the Triton
      persistent one.
    - block-scaled fp8 (1x128 x 128x128 or per-row 1x128): the native decode kernel at decode M
      (:func:`_decode_first`, up to 8 tokens, 16 on GPUs with slow memory); split-K where
      :func:`_block_splitk_first` (K in 3 or more slices; in 2 on the swapped tiles, or where
      the 64-token tiles cover under half the SMs; or at M <= BLOCK_SWAP_MAX_M the weight alone
      fills the SMs), then the native block-scaled kernel, or the Triton one first at M <=
      BLOCK_ONE_ROW_M, and at M <= BLOCK_SMALL_M on weights with N <= BLOCK_SMALL_N.
    """
    if args.block_scaling is not None:
        native = ("cuda.blockscaled", "triton.blockscaled")
        if args.m <= BLOCK_ONE_ROW_M or (args.m <= BLOCK_SMALL_M and args.n <= BLOCK_SMALL_N):
            native = native[::-1]
        order = ("triton.splitk", *native) if _block_splitk_first(args) else (*native, "triton.splitk")
        return ("cuda.decode", *order) if _decode_first(args) else order
    tma = ("triton.tma", "triton.tma_device")
    if _decode_first(args):
        return ("cuda.decode", "triton.splitk", *tma, "triton.persistent", "triton.ptr")
    if _splitk_first(args):
        return ("triton.splitk", *tma, "triton.persistent", "triton.ptr")
    if args.m <= MID_M and not _promoting_native_first(args) and not _native_wide_first(args):
        order = (*tma, "triton.persistent", "cuda.persistent_coop", "triton.ptr")
    else:
        order = ("cuda.persistent_coop", "triton.persistent", *tma, "triton.ptr")
    return ("mixed.wave_split", *order) if _wave_split_first(args) else order


def _wave_split_first(args: GemmArgs) -> bool:
    """One row of 128-row tiles on a weight a little over two or more waves of 128-column tiles
    wide (fp8 with fast accumulation and tensor-wise scales, or 16-bit operands): whole waves on
    the native tiles, the rest as its own GEMM (wave_split.py says where and by how much)."""
    from .wave_split import refusal  # imports this module: loaded lazily

    return refusal(args) is None


def _native_wide_first(args: GemmArgs) -> bool:
    """fp8 (fast accumulation, tensor- or row-wise scales) or 16-bit operands with one row of
    128-row tiles on a wide weight: the native cooperative kernel's 128x128 tiles on every SM ahead
    of the Triton 64-row tiles (cuda/gemm.py, WIDE_MIN_M, WIDE_MIN_N, WIDE_MAX_K and
    WIDE_MIN_K_16BIT, say where and by how much)."""
    if not args.fast_accum or args.block_scaling is not None:
        return False
    from .cuda.gemm import one_row_wide  # a backend module: imported lazily

    return one_row_wide(args.m, args.n, args.k, args.a.element_size())


def _promoting_native_first(args: GemmArgs) -> bool:
    """fp8 with use_fast_accum=False above M = 128 whose 128 x 128 tiles nearly fill the SMs: the
    native promoting kernel (H100, graph-timed vs torch._scaled_mm(use_fast_accum=False); M =
    256, N = 8192, K = 4096 / 8192: 0.97 / 1.00x where the Triton tile kernel ran 0.86 / 0.87x;
    with half the SMs' worth of tiles, N = 4096, 0.83-0.84x against 0.85-0.87x)."""
    if not args.is_fp8 or args.fast_accum or args.m <= 128:
        return False
    return 4 * (-(-args.m // 128) * -(-args.n // 128)) >= 3 * device.sms_of(args.out.device)


def _env_backend() -> str:
    from .envs import forced_backend

    value = forced_backend() or "auto"
    if value not in BACKENDS:
        raise ValueError(f"TMAGEMM_BACKEND={value!r} is not one of {BACKENDS}")
    return value


def choose(args: GemmArgs, backend: str = "auto") -> Variant:
    """The variant that runs ``args`` for ``backend`` ("auto", "triton" or "cuda")."""
    registry = _load()
    if backend == "auto":
        backend = _env_backend()
    reasons = []
    for name in preference(args):
        variant = registry.get(name)
        if variant is None or (backend != "auto" and variant.backend != backend):
            continue
        reason = variant.supports(args)
        if reason is None:
            return variant
        reasons.append(f"{name}: {reason}")
    # Anything registered for the backend that accepts the problem (e.g. the other native kernels).
    for variant in registry.values():
        if (backend == "auto" or variant.backend == backend) and variant.supports(args) is None:
            return variant
    missing = unavailable()
    raise ValueError(
        f"no {backend!r} tmagemm kernel accepts this problem (M={args.m}, N={args.n}, K={args.k}, "
        f"a {args.a.dtype} stride {tuple(args.a.stride())}, b {args.b.dtype} stride {tuple(args.b.stride())}); "
        f"refusals: {reasons or 'none'}; modules not importable: {missing or 'none'}"
        + (". Use backend='auto' to fall back to the pointer kernel." if backend != "auto" else "")
    )


def build(args: GemmArgs, backend: str = "auto", variant: str | None = None, config: Any = None) -> Plan:
    """A plan for ``args``: the ``variant`` named, or the one :func:`choose` picks for ``backend``.
    Not cached (the public API caches through :func:`cached`); compiles what it needs on the
    operands' device."""
    with device.on_device(args.out.device):
        chosen = get(variant) if variant is not None else choose(args, backend)
        return chosen.build(args, config)


# ------------------------------------------------------------------------------------ the cache
#
# Host time per call is a measured goal (a decode step calls the same few GEMMs thousands of
# times). Everything the checks and the plan read from the arguments (types, devices, dtypes,
# shapes, strides, 16-byte alignment, flags) forms the call key; a key is stored only after a call
# with it passed every check and was planned, so a hit skips both.

_calls: dict[tuple, Callable] = {}  # dense (Call), grouped (grouped._Call) and gate/up (gate_up._Call) alike


def tensor_key(t: torch.Tensor | None):
    """What a call key holds of one tensor argument (None stays None)."""
    if t is None:
        return None
    # get_device() is -1 off CUDA, so it tells CUDA devices apart; is_cpu tells CPU from meta.
    return (type(t), t.get_device(), t.is_cpu, t.dtype, t.shape, t.stride(), t.data_ptr() % 16)


def call_key(op: str, a, b, scale_a, scale_b, bias, out, out_dtype, fast_accum, backend, recipes=None) -> tuple:
    """The cache key of one call (raises AttributeError / TypeError for non-tensor arguments,
    which the caller's checks then name)."""
    return (op, tensor_key(a), tensor_key(b), tensor_key(scale_a), tensor_key(scale_b), tensor_key(bias),
            tensor_key(out), out_dtype, fast_accum, backend, recipes)


def _scale_operand(scale: torch.Tensor | None) -> torch.Tensor | None:
    """What the kernels read of a scale: its elements in order (tensor-wise: one value; row-wise:
    M or N values 4 bytes apart). A scale already laid out that way is passed as is; a strided
    row-wise scale is copied."""
    if scale is None or scale.numel() == 1:
        return scale
    flat = scale.reshape(-1)
    return flat if flat.stride(0) == 1 else flat.contiguous()


def _as_given(scale: torch.Tensor | None) -> bool:
    return scale is None or scale.numel() == 1 or scale.reshape(-1).stride(0) == 1


def gemm_args(a, b, out, scale_a, scale_b, bias, fast_accum: bool, block_scaling=None) -> GemmArgs:
    """The kernels' operands for checked user arguments (tensor/row-wise scales flattened, bias
    contiguous; block scales are 2-D views the kernels read through their strides)."""
    if block_scaling is None:
        scale_a, scale_b = _scale_operand(scale_a), _scale_operand(scale_b)
    return GemmArgs(a, b, out, scale_a, scale_b, None if bias is None else bias.contiguous(), bool(fast_accum),
                    block_scaling)


class Call:
    """One cached call signature: its plan, and what the call does around the launch (allocate
    ``out``, flatten strided scales). ``call(a, b, scale_a, scale_b, bias, out)`` returns out."""

    __slots__ = ("plan", "out_shape", "out_dtype", "device", "normalise", "scales")

    def __init__(self, plan: Plan, args: GemmArgs, user: tuple, scales: Callable | None = None):
        scale_a, scale_b, bias = user
        self.plan = plan
        self.out_shape, self.out_dtype, self.device = tuple(args.out.shape), args.out.dtype, args.out.device
        self.scales = scales  # block-scaled calls: the user's scales -> the kernels' 2-D views
        plain = scales is None and _as_given(scale_a) and _as_given(scale_b)
        self.normalise = not (plain and (bias is None or bias.is_contiguous()))

    def __call__(self, a, b, scale_a, scale_b, bias, out):
        if out is None:
            out = torch.empty(self.out_shape, dtype=self.out_dtype, device=self.device)
        if self.normalise:
            if self.scales is not None:
                scale_a, scale_b = self.scales(scale_a, scale_b)
            else:
                scale_a, scale_b = _scale_operand(scale_a), _scale_operand(scale_b)
            bias = None if bias is None else bias.contiguous()
        self.plan.run(a, b, out, scale_a, scale_b, bias)
        return out


def cached(key):
    """The cached call of ``key`` (a :class:`Call`, or a grouped or gate/up one), or None."""
    return _calls.get(key)


def remember(key, call) -> None:
    """Cache ``call`` (it holds a ``plan``) under ``key``: every problem kind shares this cache."""
    _calls[key] = call


def call_for(key: Callable[[], Any], build: Callable[[], Any]):
    """The call cached under ``key()``, else ``build()``, remembered under that key unless
    ``key()`` raised AttributeError / TypeError (arguments a key cannot describe, such as a
    non-tensor: ``build`` then says what is wrong with them) or a CUDA-graph capture is in
    progress (plans made during a capture are not kept)."""
    try:
        key = key()
    except (AttributeError, TypeError):
        key = None
    known = None if key is None else _calls.get(key)
    if known is None:
        known = build()
        if key is not None and not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            _calls[key] = known
    return known


def _zero_size(args: GemmArgs) -> bool:
    """Handle M, N or K of zero without a kernel; True when handled."""
    if args.m == 0 or args.n == 0:
        return True
    if args.k == 0:
        # An empty sum: zeros, plus the bias (scales multiply zero).
        args.out.zero_()
        if args.bias is not None:
            args.out.add_(args.bias.to(args.out.dtype))
        return True
    return False


def run_gemm(key, a, b, out, scale_a, scale_b, bias, fast_accum: bool, backend: str,
             block_scales: Callable | None = None, block_scaling=None) -> torch.Tensor:
    """Write the checked GEMM into ``out`` and return it, planning once per ``key`` (None: do not
    remember). Block-scaled calls pass ``block_scales`` (the user's scales -> the kernels' 2-D
    views) and the resulting ``block_scaling``. Plans made while a CUDA graph is being captured
    are not kept: their Triton kernels launch through Triton's launcher there, and later eager
    calls deserve the direct launch."""
    user = (scale_a, scale_b, bias)
    if block_scales is not None:
        scale_a, scale_b = block_scales(scale_a, scale_b)
    args = gemm_args(a, b, out, scale_a, scale_b, bias, fast_accum, block_scaling)
    if _zero_size(args):
        return out
    plan = build(args, backend)
    plan(args)
    if key is not None and out.is_cuda and not torch.cuda.is_current_stream_capturing():
        _calls[key] = Call(plan, args, user, block_scales)
    return out


def clear_plans() -> None:
    """Forget cached plans (after changing tuning state or the ``TMAGEMM_*`` knobs)."""
    _calls.clear()


def cached_calls() -> list:
    """The cached calls, every problem kind (diagnostics, tests)."""
    return list(_calls.values())


def cached_plans() -> list[Plan]:
    """The plans of the cached dense call signatures (diagnostics, tests)."""
    return [call.plan for call in _calls.values() if isinstance(call, Call)]
