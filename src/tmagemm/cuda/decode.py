"""The native decode GEMM (``cuda.decode``): swap-AB tiles of 64 weight rows x 8-64 tokens,
a producer warp over a TMA ring, K shared by the CTAs of a cluster and their partial sums added
through distributed shared memory (``gemm_sm90_decode.cu``).

At decode sizes a GEMM streams its weight once; what is left to win is the start and the tail of
each kernel in a chain of them. This kernel has the shape cuBLAS picks at one token (64 weight
rows per CTA, a deep ring), and where a narrow weight would leave SMs idle, clusters of 2 or 4
CTAs split each tile's K without partial sums in global memory, counters or a second kernel.
``plan.preference`` puts it first up to its rule's tokens (:func:`rule_for`: 16, block-scaled
8; on GPUs with less memory bandwidth per SM 32 for fp8 with tensor- or row-wise scales and 16
block-scaled) where it measured ahead of split-K and the Triton tiles (``plan.DECODE_MIN_N`` and
the rules beside it).

Scope: M <= 64 (the dispatcher uses it up to its rule's ``max_m``, where it was measured); fp8
with a K-major weight (``b = w.t()`` of a row-major (N, K) weight, the ``nn.Linear`` layout):
tensor- or row-wise scales with fast accumulation, or block scales (1x128 activations with
128x128 or per-row 1x128 weight scales, each k-block's product scaled and added in fp32); 16-bit
operands with either weight layout; bias; bf16 / fp16 / fp32 output with contiguous columns.
Everything else is refused with its reason.

Quantizing form (:func:`build_quantizing`): a bf16 / fp16 activation quantized per 1x128 group
inside the kernel: a second warpgroup turns each k-block's tokens into e4m3 and their scales in
shared memory as they land, ahead of the multiplying one, with the arithmetic of tmagemm's 1x128
quantizer: one launch where
``quantize_fp8(x, "1x128")`` and the block-scaled GEMM took two, bit for bit the same output.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from dataclasses import dataclass, replace

import torch

from .. import device as _device
from .. import tma
from ..jit.runtime import stream_getter
from ..plan import DECODE_MIN_K, DECODE_MIN_N, GemmArgs, Plan, Scaling, Variant
from ..tma import MapsByAddress, params_for_tensor
from .gemm import _AB_TYPES, _OUT_TYPES, _ROW_BYTES, k_blocks, use_pdl

NAME = "cuda.decode"
SOURCE = "gemm_sm90_decode.cu"
KERNEL = "tmagemm_gemm_sm90_decode"
MAX_M = 64  # tokens fill wgmma's N slot: n8, n16, n32 or n64
WEIGHT_ROWS = 64  # weight rows per CTA: wgmma's M
LOADER_WARP_MIN_TOKENS = 16  # tiles of this many tokens or more have the loader warp (the .cu's kLoaderWarp)


def block_threads(tokens: int, quantizing: bool = False) -> int:
    """The kernel's block size: one consumer warpgroup and the producer warp; the loader warp of
    the epilogue's operands from LOADER_WARP_MIN_TOKENS tokens per tile (8-token tiles read them
    into the consumers' registers); quantizing, the quantizer warpgroup."""
    return 128 + 32 + (32 if tokens >= LOADER_WARP_MIN_TOKENS else 0) + (128 if quantizing else 0)


TOKENS = (8, 16, 32, 64)
SPLITS = (1, 2, 4)


@dataclass(frozen=True)
class DecodeConfig:
    """tokens: the tile's tokens (wgmma n8, n16, n32 or n64; more tokens take more CTAs along M);
    stages: depth of the TMA ring (a stage is one 64-row weight box and one token box of 128
    bytes of K each); split: CTAs of one cluster sharing a tile's K, their partial sums added
    through distributed shared memory (1: no split)."""

    tokens: int
    stages: int
    split: int = 1

    def __post_init__(self):
        if self.tokens not in TOKENS:
            raise ValueError(f"DecodeConfig.tokens={self.tokens}: must be one of {TOKENS}")
        if self.split not in SPLITS:
            raise ValueError(f"DecodeConfig.split={self.split}: must be one of {SPLITS}")
        if not 2 <= self.stages or self.smem_bytes() > _device.SM90_SMEM_PER_BLOCK:
            raise ValueError(f"DecodeConfig.stages={self.stages}: must be >= 2 and fit "
                             f"{_device.SM90_SMEM_PER_BLOCK} bytes of shared memory")

    def smem_bytes(self, quantizing: bool = False) -> int:
        """Dynamic shared memory: the ring plus 1 KB to align it for the 128-byte swizzle (a
        split CTA's fragment buffer and two chunks of block scales are static shared memory, at
        most 32 KB more); quantizing, each stage also holds its tokens' 16-bit values."""
        raw = self.tokens * QUANTIZE_GROUP * 2 if quantizing else 0
        return self.stages * ((WEIGHT_ROWS + self.tokens) * _ROW_BYTES + raw) + 1024

    def label(self) -> str:
        return f"decode64x{self.tokens}s{self.stages}" + (f"k{self.split}" if self.split > 1 else "")


# Ring depths. 16 stages measured ahead of 20 and 24 on every shape of the prototype's study
# (H100: 4096 x 4096 bf16 at one token 22.2 us against 23.4 with 24): deeper rings only keep more
# bytes of one CTA in flight than the memory system turns around. 8 stages let two CTAs share an
# SM, and measured ahead of 16 on most decode-stack shapes (below).
STAGES = 16
STAGES_SHORT = 8
STAGES_64 = 12  # 64-token tiles: 16 KB stages, 12 fit shared memory
QUANTIZE_GROUP = 128  # the quantizing form's activation group: one k-block of e4m3
# The quantizing form keeps the fp8 problem's K split (the same k-blocks in the same order: the
# same sums) and its ring depth, cut to at most this much dynamic shared memory (two CTAs still
# share an SM where the 8-stage ring let them).
QUANTIZE_SMEM = 100 * 1024


@dataclass(frozen=True)
class DecodeRule:
    """The constants of one fitted heuristic (:func:`choose_config`, ``plan._decode_first``).

    split_fill: clusters of 4, else 2 CTAs share a tile's K while the CTAs stay within
    split_fill x SMs (and each keeps at least MIN_SHARE k-blocks); deep_ring_fill: 16 stages while
    the CTAs fill at most this share of the SMs (0: never), or None for the long-share rule (16
    stages when the CTAs fit one per SM and each keeps at least LONG_SHARE k-blocks); the
    dispatcher takes the kernel up to max_m tokens, up to max_share k-blocks per CTA after the
    split and up to max_tiles_per_sm 64-row weight tiles per SM; block-scaled rules: the
    quantizing form replaces quantizer + GEMM up to quantize_max_m tokens
    (:func:`takes_quantizing`)."""

    split_fill: float
    deep_ring_fill: float | None
    max_share: int
    max_m: int
    quantize_max_m: int = 0
    max_tiles_per_sm: int = 1


# The heuristic (H200, 8 chained GEMMs with their own weights in one CUDA graph, per GEMM, M = 1
# and 16, fp8 and bf16, the 13 decode-stack projections with at most 2 x 132 weight tiles;
# BENCHMARKS.md): clusters of 4 or 2 CTAs share K while that keeps the CTAs within 1.25 x SMs
# (N = 4096: 2 CTAs per tile, 7.90 us against 8.68 unsplit for fp8 at one token; N = 2112: 4,
# 7.88 against 11.81); CTAs that fit one per SM, each with a share of K of at least LONG_SHARE
# k-blocks, keep 16 stages (bf16 4096 x 14336: 31.0 against 33.3 us; fp8 8192 x 7168: 17.3
# against 19.1), everything else takes 8. Where the dispatcher takes the kernel, within 1.6% of
# the best of the six measured configs in geomean, 10% at worst. Past 112 k-blocks per CTA
# split-K was ahead (7168 x 16384 and 7168 x 18432, 1-6%). Up to 16 tokens (wgmma's n16; at 17-32
# tokens the tile kernel or split-K ran ahead, measured while ptxas serialized the 32-token
# tile's wgmmas: not measured since on this rule's GPUs).
RULE = DecodeRule(split_fill=1.25, deep_ring_fill=None, max_share=112, max_m=16)
# Block-scaled (1x128 x 128x128 or per-row), the same rule up to 8 tokens (H200): the decode-stack
# layers at M = 1 and 8 0.4-4% faster than on split-K, single kernels at one token 2% faster
# (flushed) on the block preset's shapes the rule takes; at 16 tokens 1-9% slower. The quantizing
# form up to 2 tokens (H200, RULE_SLOW_MEMORY_BLOCK's study: one and two tokens 0.6-2.4 us per GEMM ahead
# of quantizer + GEMM; at four 4096 x 14336 1.5 us behind, at eight 0.6-4.2 us behind on two of
# the three weights: with faster memory the quantizer's latency shows on long shares of K).
RULE_BLOCK = replace(RULE, max_m=8, quantize_max_m=2)
LONG_SHARE = 48
MIN_SHARE = 8  # a split never leaves a CTA fewer k-blocks than this
# GPUs with slow memory (``device.slow_memory``: at most 30 GB/s of peak DRAM bandwidth per SM, an
# H100 SXM but not an H200) take rules refitted on an H100 (:func:`rule_for`): the same chains at
# M = 1, 8 and 16, every config of the token tile (BENCHMARKS.md).
# fp8 with tensor- or row-wise scales (two rounds): the K split only while the CTAs stay within
# 0.65 x SMs (N = 4096 unsplit: 10.0 us against 10.5 in 2-CTA clusters at one token; N = 2560 in
# pairs: 12.1 against 12.5 in fours), 16 stages only while the CTAs fill at most half the SMs
# (3584 x 3584: 8.9 against 9.1 us with 8; 4608 x 3584, 72 CTAs: 9.9 with 8 stages against
# 10.2). A likely reason, not profiled: with less bandwidth to cover, fewer bytes in flight keep
# the memory busy, and a split's adds cost more than its extra CTAs gain. Where the dispatcher
# takes the kernel, within 0.2% of the best config per shape in geomean (2% at worst), where
# RULE was 2.4% behind (12% at worst: Qwen2.5-7B's 4608 x 3584, unsplit 9.9 us against 10.9 in
# pairs). Unsplit CTAs of 128-148 k-blocks ran 7168 x 16384 and 7168 x 18432 0.4-0.6% ahead of
# split-K and 3584 x 18944 within 0.8% either way. Up to 32 tokens (the 32-token tile): at 32
# tokens, where the rule takes the kernel, 1-9% ahead of the Triton tiles and split-K on 11 of
# the 13 projections (2112 x 7168 11.1 us in pairs against 12.1; 2560 x 8192 12.8 against 13.7;
# 4096 x 14336 25.3 against 25.6), 7168 x 16384 level and 7168 x 18432 0.6% behind; at 64 tokens
# the Triton tiles stayed ahead on every projection (BENCHMARKS.md).
RULE_SLOW_MEMORY = DecodeRule(split_fill=0.65, deep_ring_fill=0.5, max_share=160, max_m=32)
# Block-scaled fp8 (one round): RULE's K split, whose extra CTAs the per-k-block adds need (under
# RULE_SLOW_MEMORY's the decode stacks ran up to 14% slower), but 8 stages throughout (8192 x 7168
# unsplit: 24.5 against 25.2 us at one token; 3584 x 18944 in pairs: 29.6 against 30.7); one
# 4096 x 4096 pair ran 1% faster with 16. Unsplit CTAs of 128-144 k-blocks ran 7168 x 16384 and
# 7168 x 18432 3.3-4.7% ahead of split-K. Up to 16 tokens: the decode stacks at 12 and 16 tokens
# ran 0.7-3.3% faster per layer than on split-K. The quantizing form up to 8 tokens: every CTA
# quantizes its share of K for all its tokens, so the quantizer warps' work grows with them (8
# GEMMs with distinct weights in one CUDA graph, per GEMM, 4096 x 4096 / 4096 x 14336 / 6144 x 4096
# against quantize_fp8(x, "1x128") + this kernel: one token 9.9 / 25.1 / 13.0 us against 13.2 /
# 28.7 / 15.1, four 10.1 / 26.4 / 13.8 against 12.9 / 29.4 / 14.9, eight 10.7 / 28.2 / 14.7
# against 12.9 / 29.4 / 15.0; sixteen 1.1-1.3x slower).
# Weights of more 64-row tiles than SMs (up to 37888 rows: 592 tiles, 4.5 per SM), unsplit with 8
# stages, about three CTAs per SM: the decode stacks' block-scaled layers at 1, 8 and 16 tokens ran
# 1.5-3.5% faster per layer in geomean than with split-K on those weights (H100, two rounds;
# DeepSeek-V3 211.2 -> 205.2 us at 8 tokens, Qwen2.5-7B 97.3 -> 94.1 at 16; Llama-3-8B at one
# token 0.5% slower); Qwen3-32B's 10240 x 5120 qkv alone (L2 flushed) 31.7 -> 27.6 us. The
# rules of builds that signal the next kernel at their wait (fp8 with tensor- or row-wise scales)
# keep one tile per SM: with every CTA of a 448-592-CTA grid resident and signalling at its wait,
# Llama-3-8B's and Llama-3-70B's layers at 1-16 tokens ran 8-12% slower (signalling after the main
# loop, from 0.5% slower to 1.3% faster; per GEMM split-K measured up to 3% ahead on those weights).
# The quantizing form keeps one tile per SM too (:func:`takes_quantizing`: not measured wider).
RULE_SLOW_MEMORY_BLOCK = DecodeRule(split_fill=1.25, deep_ring_fill=0.0, max_share=160, max_m=16, quantize_max_m=8,
                                    max_tiles_per_sm=5)
# Tokens past which no GPU's rule takes the quantizing form (``nn.quantize.block_linear`` stops
# looking there).
QUANTIZE_MAX_M = max(RULE_BLOCK.quantize_max_m, RULE_SLOW_MEMORY_BLOCK.quantize_max_m)


def _max_stages(tokens: int) -> int:
    return STAGES_64 if tokens == 64 else STAGES


CONFIGS = tuple(DecodeConfig(t, s, k) for t in TOKENS for s in (STAGES_SHORT, _max_stages(t)) for k in SPLITS)


# How the kernel applies scales (TMAGEMM_DECODE_SCALES): in the epilogue (none, tensor- or
# row-wise), or per k-block with 1x128 activation scales and 128x128 or per-row weight scales.
SCALES_EPILOGUE, SCALES_BLOCK_128X128, SCALES_BLOCK_PER_ROW = 0, 1, 2


def scales_mode(args: GemmArgs) -> int:
    if args.block_scaling is None:
        return SCALES_EPILOGUE
    return SCALES_BLOCK_128X128 if args.block_scaling[1] == Scaling.BLOCK_128X128 else SCALES_BLOCK_PER_ROW


def rule_for(args: GemmArgs) -> DecodeRule:
    """The heuristic's constants for ``args``: RULE (RULE_BLOCK for block scales), or on a GPU
    with slow memory (``device.slow_memory``) RULE_SLOW_MEMORY for fp8 with tensor- or row-wise
    scales and RULE_SLOW_MEMORY_BLOCK for block scales. 16-bit operands keep RULE: in the decode
    stacks (H100, M = 1-16, BENCHMARKS.md) they measured level to 1% slower under
    RULE_SLOW_MEMORY."""
    return rule_of(args.b.element_size(), args.block_scaling is not None, args.out.device)


def rule_of(itemsize: int, block: bool, dev: torch.device) -> DecodeRule:
    """:func:`rule_for` of a problem with ``itemsize``-byte weights, block-scaled or not, on ``dev``."""
    if itemsize != 1 or not _device.slow_memory(dev):
        return RULE_BLOCK if block else RULE
    return RULE_SLOW_MEMORY_BLOCK if block else RULE_SLOW_MEMORY


def takes(m: int, n: int, k: int, itemsize: int, block: bool, dev: torch.device) -> bool:
    """Whether the dispatcher runs an (m, n, k) problem of ``itemsize``-byte operands
    (block-scaled or not) on this kernel first (``plan._decode_first``): weights of at least
    ``plan.DECODE_MIN_N`` x ``DECODE_MIN_K``, up to the rule's tokens, share of K per CTA and
    weight tiles per SM."""
    if not (n >= DECODE_MIN_N and k >= DECODE_MIN_K):
        return False
    rule = rule_of(itemsize, block, dev)
    if m > rule.max_m:
        return False
    sms = _device.sms_of(dev)
    split = choose_config(m, n, k, itemsize, sms, rule).split
    return -(-n // WEIGHT_ROWS) <= rule.max_tiles_per_sm * sms and k_blocks(k, itemsize) <= rule.max_share * split


def choose_config(m: int, n: int, k: int, itemsize: int, sms: int, rule: DecodeRule = RULE) -> DecodeConfig:
    """The launch for an (m, n, k) problem of ``itemsize``-byte operands on ``sms`` SMs (pure):
    the smallest of n8, n16, n32, n64 that holds the tokens; the K split and ring depth of
    ``rule`` (:func:`rule_for`)."""
    tokens = next((t for t in TOKENS if m <= t), TOKENS[-1])
    tiles = -(-n // WEIGHT_ROWS) * -(-m // tokens)
    blocks = k_blocks(k, itemsize)
    split = next((s for s in SPLITS[::-1] if tiles * s <= rule.split_fill * sms and blocks >= s * MIN_SHARE), 1)
    if rule.deep_ring_fill is None:
        deep = tiles * split <= sms and blocks >= split * LONG_SHARE
    else:
        deep = tiles * split <= rule.deep_ring_fill * sms
    return DecodeConfig(tokens, _max_stages(tokens) if deep else STAGES_SHORT, split)


def supports(args: GemmArgs) -> str | None:
    """None when the decode kernel computes ``args``, else why not (names the operand at fault)."""
    if not _device.is_hopper(args.a.device):
        return f"native kernels need CUDA tensors on a Hopper GPU (sm_90), got {args.a.device}"
    if args.block_scaling is not None:
        from ..triton.matmul_blockscaled import layout_of  # the block recipes' operand and scale rules

        layout = layout_of(args)
        if isinstance(layout, str):
            return layout
    reason = _problem_reason(args)
    if reason:
        return reason
    if args.a.dtype not in _AB_TYPES or args.b.dtype != args.a.dtype:
        return f"a/b dtypes {args.a.dtype}/{args.b.dtype} not supported (fp16, bf16 or float8_e4m3fn, both equal)"
    if args.is_fp8 and not args.fast_accum and args.block_scaling is None:
        return ("use_fast_accum=False needs fp32 promotion of the fp8 partial sums, which the decode kernel "
                "does not do (triton.splitk does)")
    if (args.scale_a is not None or args.scale_b is not None) and not args.is_fp8:
        return "scales are only applied to fp8 problems"
    k_major = tma.b_is_k_major(args.b)
    if args.is_fp8 and not k_major:
        return "fp8 b must be K-major (b = w.t() of a row-major (N, K) weight): fp8 wgmma reads K-major operands"
    return tma.operand_reason(args.a, "a", True) or tma.operand_reason(args.b, "b", not k_major)


def _problem_reason(args: GemmArgs) -> str | None:
    """The shape, output and bias rules both forms share (:func:`supports`,
    :func:`quantizing_reason`)."""
    m, n, k = args.m, args.n, args.k
    if m == 0 or n == 0 or k == 0:
        return "zero-size problems are handled before dispatch"
    if m > MAX_M:
        return f"M={m} > {MAX_M}: the decode kernel puts the tokens in wgmma's N slot (n8 to n64)"
    if max(m, n, k) >= 2**31:
        return "dimensions must fit in int32"
    if args.out.dtype not in _OUT_TYPES:
        return f"out dtype {args.out.dtype} not supported (bf16, fp16, fp32)"
    if n > 1 and args.out.stride(1) != 1:
        return f"out columns must be contiguous, got stride {tuple(args.out.stride())}"
    if args.bias is not None and args.bias.dtype not in _OUT_TYPES:
        return f"bias dtype {args.bias.dtype} not supported (bf16, fp16, fp32)"
    return None


class _DecodeParams(ctypes.Structure):
    """Mirror of ``DecodeParams`` (gemm_sm90_decode.cu): same field order and C types."""

    _fields_ = [
        ("m", ctypes.c_int32),
        ("n", ctypes.c_int32),
        ("k", ctypes.c_int32),
        ("scale_a_rowwise", ctypes.c_int32),
        ("scale_b_colwise", ctypes.c_int32),
        ("bias_type", ctypes.c_int32),
        ("scale_a", ctypes.c_void_p),
        ("scale_b", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("ldo", ctypes.c_int64),
        ("sa_row", ctypes.c_int64),
        ("sa_k", ctypes.c_int64),
        ("sb_row", ctypes.c_int64),
        ("sb_k", ctypes.c_int64),
    ]


# TMAGEMM_DECODE_QUANTIZE of the quantizing form's activation dtypes (0: the activation is fp8).
QUANTIZE_TYPES = {torch.bfloat16: 1, torch.float16: 2}


def defines(config: DecodeConfig, ab_dtype: torch.dtype, out_dtype: torch.dtype, b_k_major: bool = True,
            scales: int = SCALES_EPILOGUE, quantize_from: torch.dtype | None = None) -> dict[str, int]:
    """NVRTC -D flags of one build; ``quantize_from``: the 16-bit activation dtype the quantizing
    form reads (``ab_dtype`` is then the weight's, e4m3)."""
    return {"TMAGEMM_AB_TYPE": _AB_TYPES[ab_dtype], "TMAGEMM_OUT_TYPE": _OUT_TYPES[out_dtype],
            "TMAGEMM_DECODE_TOKENS": config.tokens, "TMAGEMM_STAGES": config.stages,
            "TMAGEMM_B_KMAJOR": int(b_k_major), "TMAGEMM_DECODE_SPLIT": config.split, "TMAGEMM_DECODE_SCALES": scales,
            "TMAGEMM_DECODE_QUANTIZE": QUANTIZE_TYPES[quantize_from] if quantize_from is not None else 0}


def compile_module(config: DecodeConfig, ab_dtype: torch.dtype, out_dtype: torch.dtype, b_k_major: bool = True,
                   scales: int = SCALES_EPILOGUE, quantize_from: torch.dtype | None = None):
    """The NVRTC module of one build (no GPU needed; tests inspect its SASS)."""
    from .. import jit

    return jit.compile(SOURCE, defines=defines(config, ab_dtype, out_dtype, b_k_major, scales, quantize_from))


@functools.lru_cache(maxsize=None)
def _kernel(config: DecodeConfig, ab_dtype: torch.dtype, out_dtype: torch.dtype, b_k_major: bool, scales: int,
            quantize_from: torch.dtype | None, device_index: int):
    module = compile_module(config, ab_dtype, out_dtype, b_k_major, scales, quantize_from)
    with torch.cuda.device(device_index):
        return module.function(KERNEL)


class _DecodeLaunch:
    """What a decode plan resolves once: the weight's and the activation's tensor maps (cached by
    address), the parameter block and the packed launcher; a call points them at the operands."""

    def __init__(self, args: GemmArgs, config: DecodeConfig, quantizing: bool = False):
        block_k = _ROW_BYTES // args.b.element_size()
        k_major = tma.b_is_k_major(args.b)
        # K-major: boxes of 64 weight rows x one k-block of the (N, K) weight; N-major: boxes of one
        # k-block of rows x 64 columns of the (K, N) matrix b itself.
        if k_major:
            self._w_maps = MapsByAddress(params_for_tensor(args.b.t(), (WEIGHT_ROWS, block_k)))
        else:
            self._w_maps = MapsByAddress(params_for_tensor(args.b, (block_k, WEIGHT_ROWS)))
        # Quantizing: boxes of the 16-bit tokens' k-block, 256 bytes wide, unswizzled (the kernel
        # writes the e4m3 box wgmma reads).
        self._x_maps = MapsByAddress(params_for_tensor(args.a, (config.tokens, block_k),
                                                       swizzle="none" if quantizing else "128B"))
        p = self.params = _DecodeParams()
        p.m, p.n, p.k = args.m, args.n, args.k
        scales = scales_mode(args)
        if scales == SCALES_EPILOGUE:
            p.scale_a_rowwise = int(Scaling.of(args.scale_a) == Scaling.ROW)
            p.scale_b_colwise = int(Scaling.of(args.scale_b) == Scaling.ROW)
        else:  # 2-D block scales, any strides (fixed per plan signature); quantizing: no scale_a
            if not quantizing:
                p.sa_row, p.sa_k = args.scale_a.stride()
            p.sb_row, p.sb_k = args.scale_b.stride()
        p.bias_type = _OUT_TYPES[args.bias.dtype] if args.bias is not None else 0
        p.ldo = args.out.stride(0) if args.m > 1 else args.n
        self._pointers = (ctypes.c_void_p * 3)()
        self._pointers[2] = ctypes.addressof(p)
        self.device_index = args.out.get_device()
        kernel = _kernel(config, args.b.dtype, args.out.dtype, k_major, scales, args.a.dtype if quantizing else None,
                         self.device_index)
        grid = (-(-args.n // WEIGHT_ROWS), -(-args.m // config.tokens), config.split)
        threads = block_threads(config.tokens, quantizing)
        self._launch = kernel.packed(grid, (threads, 1, 1), config.smem_bytes(quantizing), self._pointers,
                                     cluster=(1, 1, config.split), pdl=use_pdl(args.out.device))
        self._stream = stream_getter()
        self._lock = threading.Lock()  # the maps and the parameter block are shared by every call

    def __call__(self, a, b, out, scale_a, scale_b, bias) -> None:
        with self._lock:
            p = self.params
            p.scale_a = scale_a.data_ptr() if scale_a is not None else None
            p.scale_b = scale_b.data_ptr() if scale_b is not None else None
            p.bias = bias.data_ptr() if bias is not None else None
            p.out = out.data_ptr()
            self._pointers[0] = self._w_maps.get(b.data_ptr()).address
            self._pointers[1] = self._x_maps.get(a.data_ptr()).address
            self._launch(self._stream(self.device_index))


def build(args: GemmArgs, config: DecodeConfig | None = None) -> Plan:
    """The plan of one problem signature: :func:`choose_config`'s tile unless ``config`` is given."""
    reason = supports(args)
    if reason is not None:
        raise ValueError(f"{NAME}: {reason}")
    config = config or choose_config(args.m, args.n, args.k, args.a.element_size(), _device.sms_of(args.out.device),
                                     rule_for(args))
    launch = _DecodeLaunch(args, config)
    return Plan(NAME, config, launch, launch.device_index, direct=True)


def takes_quantizing(m: int, n: int, k: int, dev: torch.device) -> bool:
    """Whether a block-scaled (m, n, k) problem with a 16-bit activation runs as the quantizing
    form (``nn.quantize.block_linear``): up to the block rule's quantize_max_m tokens (8 on GPUs
    with slow memory per SM, 2 elsewhere) where the dispatcher takes this kernel for the fp8
    problem (:func:`takes`), on weights of at most one 64-row tile per SM (where it was measured)."""
    return (m <= rule_of(1, True, dev).quantize_max_m and -(-n // WEIGHT_ROWS) <= _device.sms_of(dev)
            and takes(m, n, k, 1, True, dev))


def quantizing_reason(args: GemmArgs) -> str | None:
    """None when the quantizing form computes ``args``, else why not: ``args.a`` (M, K) bf16 or
    fp16 (row-major, quantized here per 1x128 group), ``scale_a`` None, ``block_scaling``
    (BLOCK_1X128, BLOCK_128X128 or BLOCK_1X128) with its scale_b, a K-major e4m3 ``b``."""
    if not _device.is_hopper(args.a.device):
        return f"native kernels need CUDA tensors on a Hopper GPU (sm_90), got {args.a.device}"
    if args.a.dtype not in QUANTIZE_TYPES:
        return f"a must be bfloat16 or float16 (quantized per 1x128 group in the kernel), got {args.a.dtype}"
    if args.scale_a is not None or args.block_scaling is None or args.block_scaling[0] != Scaling.BLOCK_1X128:
        return "the quantizing form computes a's 1x128 scales itself: scale_a None, block_scaling (BLOCK_1X128, ...)"
    if args.block_scaling[1] not in (Scaling.BLOCK_128X128, Scaling.BLOCK_1X128):
        return f"weight scaling {Scaling(args.block_scaling[1]).name} is not BLOCK_128X128 or BLOCK_1X128"
    if args.b.dtype != torch.float8_e4m3fn:
        return f"b must be float8_e4m3fn, got {args.b.dtype}"
    reason = _problem_reason(args)
    if reason:
        return reason
    kb = -(-args.k // QUANTIZE_GROUP)
    rows = args.n if args.block_scaling[1] == Scaling.BLOCK_1X128 else -(-args.n // QUANTIZE_GROUP)
    sb = args.scale_b
    if sb is None or sb.dtype != torch.float32 or tuple(sb.shape) != (rows, kb) or sb.device != args.a.device:
        got = "None" if sb is None else f"{sb.dtype} {tuple(sb.shape)} on {sb.device}"
        return f"scale_b must be float32 ({rows}, {kb}) on {args.a.device}, got {got}"
    if not tma.b_is_k_major(args.b):
        return "b must be K-major (b = w.t() of a row-major (N, K) weight): fp8 wgmma reads K-major operands"
    return tma.operand_reason(args.a, "a", True) or tma.operand_reason(args.b, "b", False)


def quantizing_config(args: GemmArgs) -> DecodeConfig:
    """The fp8 problem's config (:func:`choose_config` under its rule: the same K split and so
    the same sums), its ring cut to QUANTIZE_SMEM (at least 2 stages)."""
    config = choose_config(args.m, args.n, args.k, 1, _device.sms_of(args.out.device),
                           rule_of(1, True, args.out.device))
    per_stage = config.smem_bytes(True) // config.stages
    return replace(config, stages=max(2, min(config.stages, (QUANTIZE_SMEM - 1024) // per_stage)))


def build_quantizing(args: GemmArgs, config: DecodeConfig | None = None) -> Plan:
    """The plan of the quantizing form (:func:`quantizing_reason`): ``launch(a, b, out, None,
    scale_b, bias)`` with a 16-bit ``a``; :func:`quantizing_config` unless ``config`` is given."""
    reason = quantizing_reason(args)
    if reason is not None:
        raise ValueError(f"{NAME} (quantizing a): {reason}")
    config = config or quantizing_config(args)
    if config.smem_bytes(True) > _device.SM90_SMEM_PER_BLOCK:
        raise ValueError(f"{NAME} (quantizing a): {config} needs {config.smem_bytes(True)} bytes of shared memory")
    launch = _DecodeLaunch(args, config, quantizing=True)
    return Plan(NAME, config, launch, launch.device_index, direct=True)


def aot_source(name: str, dtype: str = "fp8") -> tuple[str, dict[str, int]]:
    """(source file under tmagemm/cuda, NVRTC defines) of the decode kernel at one token, for
    ``tmagemm inspect`` (tmagemm.inspection.native_source)."""
    types = {"fp8": (torch.float8_e4m3fn, torch.bfloat16), "bf16": (torch.bfloat16, torch.bfloat16),
             "fp16": (torch.float16, torch.float16)}
    if name != NAME:
        raise ValueError(f"unknown decode variant {name!r}; known: [{NAME!r}]")
    if dtype not in types:
        raise ValueError(f"dtype must be one of {sorted(types)}, got {dtype!r}")
    return SOURCE, defines(DecodeConfig(TOKENS[0], STAGES_SHORT), *types[dtype])


VARIANTS = [
    Variant(
        name=NAME,
        backend="cuda",
        description="native decode GEMM (M <= 64): swap-AB 64-row weight tiles x 8-64 tokens, producer warp over "
                    "an 8-16-stage TMA ring, K shared by clusters of 1, 2 or 4 CTAs that add their partial sums "
                    "through distributed shared memory",
        supports=supports,
        build=build,
        configs=CONFIGS,
    )
]
