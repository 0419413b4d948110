"""Fused gate/up projection of a gated MLP: block-scaled fp8 GEMMs, SiLU-and-multiply, 1x128 quantization.

    g = xq @ W_gate^T,  u = xq @ W_up^T     sum_kb sx[m, kb] * sw[block, kb] * (fp8 product of k-block kb)
    h = silu(g) * u                          fp32 registers
    hq, hs = quantize_1x128(h)               e4m3 + one fp32 scale per token per 128 channels

The problem and its checks are ``tmagemm.gate_up`` (``GateUpArgs``); W = [W_gate; W_up] is (2I, H)
e4m3 row-major with 128x128 block scales sw (2I/128, ceil(H/128)), I a multiple of 128.

**Program = one 1x128 group of h.** A program owns output channels [128j, 128j + 128) of one
BLOCK_M-token tile: the weight's gate rows [128j, 128j + 128) and up rows [I + 128j, I + 128j +
128), one fp32 accumulator each. Those 128 channels are exactly one 1x128 group of h, so the
program holds everything the group's amax needs: the quantization happens in its registers with
no exchange between programs. Per 128-deep k-block (one scale block) it loads one activation
tile and the two weight tiles through TMA (host TensorDescriptors; zero-filled past M and H, so
ragged edges need no masks), takes two fresh fp8 products and promotes each into its
accumulator with ``sx[m, kb] * sw[., kb]`` (``common.block_scaled_add``, as every block-scaled
kernel here). Triton pipelines the three loads ``num_stages`` deep.

**Decode (M <= 64): swap-AB.** The weight rows fill WGMMA's M dimension (128 = two m64
instructions) and the tokens, padded to a power of two >= 16, sit in its N slot, as
``matmul_splitk`` does; the accumulators are [128, BLOCK_M] tiles of g^T and u^T, transposed once
for the epilogue. **Larger M:** unswapped [64 tokens, 128 channels] tiles.

**Split-K.** With the groups x token tiles below the CTA slots (two per SM at M <= 32, one
above; Llama-3-8B: 112 groups at decode for 264 slots on 132 SMs) the K range is cut into
slices, one program each, with ``matmul_splitk``'s
deterministic protocol and workspace (``tmagemm.workspace``): every slice parks its two fp32
partial tiles, bumps the tile's arrival counter (acq_rel, gpu scope, after a CTA barrier); the
last to arrive sums both in slice order (bitwise reproducible whatever the arrival order),
re-arms the counter and runs the epilogue. One launch, no memset.

**PDL.** Launched with programmatic dependent launch like the other Triton kernels
(``launch.pdl``, ``TMAGEMM_PDL``): each program waits for the previous kernel after its setup
(``common.wait_for_previous_kernel``) and lets the next one launch once its main loop is done.

**Epilogue.** h = g / (1 + exp(-g)) * u in fp32, then ``quantize.quantize_row_groups``: the
1x128 quantizer's arithmetic bit for bit (scale = max(div_rn(amax, 448), smallest normal),
optionally a power of two; q = div_rn(h, scale) clamped and rounded to the e4m3 grid). hq rows
and hs are written with masked stores (rows past M are never written).

The config (:class:`GateUpConfig`) comes from :func:`choose_config`, a pure function of (M, I,
H, SMs); plans are built once per call signature (``tmagemm.gate_up`` keeps them in the plan
layer's cache) and launched directly through ``tmagemm.jit`` when possible (``launch.py``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import device, workspace
from ..gate_up import GROUP, GateUpArgs
from ..plan import BLOCK_SWAP_MAX_M, Plan
from .common import (SCALES_AHEAD_MIN_ROWS, block_scaled_add, let_next_kernel_launch, load_block_scales,
                     wait_for_previous_kernel)
from .host import descriptor
from .launch import A, B, BIAS, COUNTERS, OUT, PARTIALS, SCALE_A, SCALE_B, KernelCall, direct_launch, pdl
from .launch import aot_spec as _aot_spec
from .quantize import fp8_grid, quantize_row_groups

NAME = "triton.gate_up"
BLOCK_K = 128  # one k-step = one 128-deep scale block
# Largest M that runs swap-AB (the tokens in WGMMA's N slot): the block-scaled split-K GEMM's
# rule. Above it, 64-token tiles promote two token rows per thread per k-block instead of
# loading 16 strided column scales.
MAX_SWAP_M = BLOCK_SWAP_MAX_M
# hs, the second output, travels in the sixth operand slot (the one dense GEMMs use for the
# bias; this family has none): launch(xq, w, hq, sx, sw, hs, partials, counters).
HS = BIAS
_OPERANDS = {"x_desc": A, "w_desc": B, "hq_ptr": OUT, "sx_ptr": SCALE_A, "sw_ptr": SCALE_B, "hs_ptr": HS,
             "ws_ptr": PARTIALS, "lock_ptr": COUNTERS}
# Token tiles per band of the tile order (the kernel's scheduler): 8 x 64 tokens of activation (3.5
# MiB at H = 7168) stay in L2 while the band walks every group, and each group's weight rows are
# read from DRAM about once per band.
BAND_M_TILES = 8
# K-blocks a slice keeps at least: ``plan.block_split_k``'s 16 above M = 16, measured for the
# block-scaled split-K GEMM (a shorter slice costs more in partial sums than it gains). A slice
# here reads twice the weight rows of one of its tiles and parks twice the partials: the same ratio.
MIN_SLICE_BLOCKS = 16
# Shared memory of one SM the pipelines may take: sm_90's 228 KiB less 1 KiB reserved per CTA
# and the ~1 KiB of barriers the compiled kernel adds to its stages (sm_90a compile: 105,496
# bytes for 3 stages at block_m = 16, 205,864 for 5 at block_m = 64).
_SMEM_PER_SM = 220 * 1024


@dataclass(frozen=True)
class GateUpConfig:
    """Tiles and split of one fused gate/up launch.

    block_m: tokens per program (the WGMMA N slot with ``swap_ab``); each program also covers
    128 gate and 128 up weight rows. split_k: K slices per tile (1: no workspace).
    Two accumulators and their fresh per-block products live in registers: 4 x 128 x block_m
    fp32 values over 32 x num_warps threads, held to <= 128 per thread (block_m <= 8 x num_warps)
    so nothing spills.
    """

    block_m: int
    split_k: int
    swap_ab: bool
    num_stages: int
    num_warps: int = 4

    def __post_init__(self):
        if self.block_m not in (16, 32, 64):
            raise ValueError(f"GateUpConfig.block_m={self.block_m}: must be 16, 32 or 64")
        if self.num_warps not in (4, 8):
            raise ValueError(f"GateUpConfig.num_warps={self.num_warps}: must be 4 or 8")
        if self.block_m > 8 * self.num_warps:
            raise ValueError(f"GateUpConfig block_m={self.block_m} with num_warps={self.num_warps}: two 128 x block_m "
                             f"fp32 accumulators and their products need block_m <= 8 x num_warps")
        if self.split_k < 1:
            raise ValueError(f"GateUpConfig.split_k={self.split_k}: must be >= 1")
        if self.num_stages < 1:
            raise ValueError(f"GateUpConfig.num_stages={self.num_stages}: must be >= 1")

    def smem_bytes(self) -> int:
        """Pipeline buffers: per stage two 128 x 128 weight tiles and one block_m x 128 activation tile."""
        return self.num_stages * (2 * GROUP + self.block_m) * BLOCK_K

    @property
    def label(self) -> str:
        kind = "swap" if self.swap_ab else "tile"
        return f"{kind}{self.block_m}x{2 * GROUP}s{self.num_stages}w{self.num_warps}k{self.split_k}"


# ----------------------------------------------------------------------------------------------
# Heuristic
# ----------------------------------------------------------------------------------------------


def ctas_per_sm(block_m: int) -> int:
    """CTAs of a config one SM holds: two of the 4-warp configs (block_m <= 32) fit its 64K
    registers at any count (<= 255 per thread; 96 and 198 on the sm_90a compile) and its shared
    memory (:func:`stages_for`); the 8-warp configs at block_m = 64 take 213 (swap-AB) and 165
    (tile) registers per thread (Triton 3.9), so one."""
    return 2 if block_m <= 32 else 1


def split_k_for(tiles: int, h: int, sms: int, per_sm: int = 2) -> int:
    """K slices: none once the tiles fill the SMs' CTA slots (``per_sm`` each); below that,
    enough to fill them, each slice keeping >= MIN_SLICE_BLOCKS k-blocks, and no slice empty."""
    k_blocks = max(1, -(-h // BLOCK_K))
    split = max(1, min(per_sm * sms // max(tiles, 1), k_blocks // MIN_SLICE_BLOCKS))
    return -(-k_blocks // -(-k_blocks // split))


def stages_for(block_m: int) -> int:
    """The deepest pipeline (at most 6) that leaves room for :func:`ctas_per_sm` CTAs per SM: 3
    stages of 34-36 KiB at block_m = 16 and 32 (two CTAs), 5 of 40 KiB at 64 (one)."""
    stage = (2 * GROUP + block_m) * BLOCK_K
    return max(2, min(6, _SMEM_PER_SM // ctas_per_sm(block_m) // stage))


@functools.lru_cache(maxsize=4096)
def choose_config(m: int, i: int, h: int, sms: int) -> GateUpConfig:
    """The config of an (M tokens, I channels, H hidden) problem; pure, so tests can tabulate it.

    M <= MAX_SWAP_M: swap-AB with the tokens rounded up to a power of two >= 16 (the block-scaled
    split-K GEMM's rule, :func:`tmagemm.plan.block_tiling`, fitted to H100 sweeps); larger M:
    64-token tiles. 8 warps from 64 tokens (the register rule of :class:`GateUpConfig`),
    pipelines as deep as :func:`stages_for` allows. The split: :func:`split_k_for` over the groups x token tiles
    (Llama-3-8B, I = 14336, H = 4096 at M = 16: 112 tiles for 264 CTA slots -> 2 slices; Qwen2.5-7B's
    148 groups -> none; Llama-3-70B at TP 4, I = 7168, H = 8192: 56 -> 4). Derived from the
    compiled kernel's resources and the split-K GEMM's measured rules, not yet tuned on a GPU.
    """
    swap = m <= MAX_SWAP_M
    block_m = max(16, 1 << max(0, (m - 1).bit_length())) if swap else 64
    tiles = -(-max(m, 1) // block_m) * (i // GROUP)
    return GateUpConfig(block_m=block_m, split_k=split_k_for(tiles, h, sms, ctas_per_sm(block_m)), swap_ab=swap,
                        num_stages=stages_for(block_m), num_warps=8 if block_m > 32 else 4)


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------


# M changes every decode step and the split is picked per shape: not specialising on them keeps
# one binary per config (the reduction branch is a uniform scalar test); nor on the k-stride of
# an outer-dim-major sx, which equals M.
@triton.jit(do_not_specialize=["M", "split_k", "iters_per_split", "stride_sxk"])
def gate_up_kernel(
    x_desc, w_desc, hq_ptr, sx_ptr, sw_ptr, hs_ptr, ws_ptr, lock_ptr,
    M, H, I,
    stride_hqm, stride_sxm, stride_sxk, stride_swn, stride_swk, stride_hsm, stride_hsg,
    split_k, iters_per_split,
    BLOCK_M: tl.constexpr, BAND_M: tl.constexpr, SWAP_AB: tl.constexpr, POW2: tl.constexpr,
    FP8_MAX: tl.constexpr, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr, F32_TINY: tl.constexpr,
    PDL: tl.constexpr,
):
    GROUP_N: tl.constexpr = 128  # channels per program: one 1x128 group of h, one weight block row
    BK: tl.constexpr = 128  # one k-step: one 128-deep scale block

    # ---- scheduler: the slices of one tile are neighbours in launch order (the last one then
    # does not wait long for the others). Tiles walk bands of BAND_M token tiles, token tiles
    # first: the band's programs of one group run together and read its weight rows once from
    # DRAM (L2 serves the others), and the band's activation rows stay in L2 while the groups
    # go by. Walking the groups first would stream the whole weight once per token tile.
    pid = tl.program_id(0)
    split_id = pid % split_k
    tile_id = pid // split_k
    num_groups = I // GROUP_N
    band_tiles = BAND_M * num_groups
    first_m = (tile_id // band_tiles) * BAND_M
    band_rows = tl.minimum(tl.cdiv(M, BLOCK_M) - first_m, BAND_M)
    pid_m = first_m + (tile_id % band_tiles) % band_rows
    group = (tile_id % band_tiles) // band_rows
    off_m = pid_m * BLOCK_M
    offs_m = off_m + tl.arange(0, BLOCK_M)
    row_ok = offs_m < M
    k_lo = split_id * iters_per_split
    k_hi = tl.minimum(k_lo + iters_per_split, tl.cdiv(H, BK))

    # ---- scales: a token's 1x128 scales; the gate and up rows' 128x128 block rows. Rows past M
    # read 1.0 (block_scaled_add): their zero-filled products stay zero, never 0 * garbage.
    sx_ptrs = sx_ptr + offs_m * stride_sxm
    swg_ptrs = sw_ptr + group * stride_swn
    swu_ptrs = sw_ptr + (num_groups + group) * stride_swn
    # PDL: xq (typically the quantizer's output) and everything else is read, and anything
    # written, only after the previous kernel has finished.
    wait_for_previous_kernel(PDL)

    # ---- main loop: per k-block one activation and two weight tiles through TMA, two fresh fp8
    # products (no accumulator in: each block's sum starts from zero), each promoted into its
    # fp32 accumulator with its scales. Swap-AB: [128 channels, BLOCK_M tokens] tiles of g^T, u^T.
    if SWAP_AB:
        acc_g = tl.zeros((GROUP_N, BLOCK_M), dtype=tl.float32)
    else:
        acc_g = tl.zeros((BLOCK_M, GROUP_N), dtype=tl.float32)
    acc_u = tl.zeros_like(acc_g)
    SCALES_AHEAD: tl.constexpr = BLOCK_M >= SCALES_AHEAD_MIN_ROWS  # common.SCALES_AHEAD_MIN_ROWS says why
    if SCALES_AHEAD:
        sx, swg = load_block_scales(sx_ptrs, swg_ptrs, stride_sxk, stride_swk, k_lo, row_ok, row_ok, False, GROUP_N)
        swu = tl.load(swu_ptrs + k_lo * stride_swk)
    for kb in range(k_lo, k_hi):
        k0 = kb * BK
        x = x_desc.load([off_m, k0])  # [BLOCK_M, BK], K contiguous
        wg = w_desc.load([group * GROUP_N, k0])  # [128, BK] of W_gate
        wu = w_desc.load([I + group * GROUP_N, k0])  # [128, BK] of W_up
        if SWAP_AB:
            pg = tl.dot(wg, x.T)
            pu = tl.dot(wu, x.T)
        else:
            pg = tl.dot(x, wg.T)
            pu = tl.dot(x, wu.T)
        if not SCALES_AHEAD:
            sx, swg = load_block_scales(sx_ptrs, swg_ptrs, stride_sxk, stride_swk, kb, row_ok, row_ok, False, GROUP_N)
            swu = tl.load(swu_ptrs + kb * stride_swk)
        acc_g = block_scaled_add(acc_g, pg, sx, swg, False, GROUP_N, SWAP_AB)
        acc_u = block_scaled_add(acc_u, pu, sx, swu, False, GROUP_N, SWAP_AB)
        if SCALES_AHEAD:  # the next k-block's (this one's again after the last)
            kb_next = tl.minimum(kb + 1, k_hi - 1)
            sx, swg = load_block_scales(sx_ptrs, swg_ptrs, stride_sxk, stride_swk, kb_next, row_ok, row_ok, False,
                                        GROUP_N)
            swu = tl.load(swu_ptrs + kb_next * stride_swk)
    # The weight is streamed: the next kernel (the down projection) may launch and do its setup.
    let_next_kernel_launch(PDL)

    # ---- split-K reduction (matmul_splitk's protocol): park both partial tiles, bump the tile's
    # counter; the last slice to arrive sums them in slice order and runs the epilogue.
    if split_k > 1:
        TILE: tl.constexpr = GROUP_N * BLOCK_M
        ws_tile = ws_ptr + tile_id.to(tl.int64) * split_k * (2 * TILE)
        if SWAP_AB:
            offs_acc = tl.arange(0, GROUP_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        else:
            offs_acc = tl.arange(0, BLOCK_M)[:, None] * GROUP_N + tl.arange(0, GROUP_N)[None, :]
        slot = ws_tile + split_id * (2 * TILE)
        # .cg keeps partials in L2 (the coherence point across SMs), never in a stale L1 line.
        tl.store(slot + offs_acc, acc_g, cache_modifier=".cg")
        tl.store(slot + TILE + offs_acc, acc_u, cache_modifier=".cg")
        # Every thread's stores are issued before the scalar atomic's gpu-scope release, which is
        # cumulative over what the CTA barrier ordered before it.
        tl.debug_barrier()
        arrived = tl.atomic_add(lock_ptr + tile_id, 1, sem="acq_rel", scope="gpu")
        if arrived != split_k - 1:
            return
        acc_g = tl.zeros_like(acc_g)
        acc_u = tl.zeros_like(acc_u)
        for s in range(0, split_k):
            part = ws_tile + s * (2 * TILE)
            acc_g += tl.load(part + offs_acc, cache_modifier=".cg")
            acc_u += tl.load(part + TILE + offs_acc, cache_modifier=".cg")
        # Re-arm the counter for the next launch that uses it (no memset: tmagemm/workspace.py).
        tl.atomic_xchg(lock_ptr + tile_id, 0, sem="relaxed", scope="gpu")

    # ---- epilogue: (tokens, channels) orientation, h = silu(g) * u in fp32 (exp overflows to
    # +inf for g < -88: then h = -0 * u, silu's limit), the group's 1x128 quantization, stores.
    if SWAP_AB:
        acc_g = acc_g.T
        acc_u = acc_u.T
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    q, scale = quantize_row_groups(h, FP8_MAX, MANT_BITS, MIN_EXP, F32_TINY, POW2)
    cols = group * GROUP_N + tl.arange(0, GROUP_N)
    tl.store(hq_ptr + offs_m[:, None].to(tl.int64) * stride_hqm + cols[None, :], q.to(hq_ptr.dtype.element_ty),
             mask=row_ok[:, None])
    tl.store(hs_ptr + offs_m * stride_hsm + group * stride_hsg, scale, mask=row_ok)


# ----------------------------------------------------------------------------------------------
# Host side: launch, plan
# ----------------------------------------------------------------------------------------------


def _split(args: GateUpArgs, config: GateUpConfig) -> tuple[int, int, int]:
    """(tiles, K slices, k-blocks per slice); no slice is empty."""
    tiles = -(-args.m // config.block_m) * (args.i // GROUP)
    k_blocks = -(-args.h // BLOCK_K)
    per_split = -(-k_blocks // config.split_k)
    return tiles, -(-k_blocks // per_split), per_split


def partials_needed(args: GateUpArgs, config: GateUpConfig) -> int:
    """fp32 partial sums one launch needs: two [128, block_m] tiles per slice per tile (none
    without a K split)."""
    tiles, split, _ = _split(args, config)
    return tiles * split * 2 * GROUP * config.block_m if split > 1 else 0


def kernel_call(args: GateUpArgs, config: GateUpConfig, ws: workspace.Workspace) -> KernelCall:
    """One launch, every kernel argument named once (direct launch, Triton's launcher, AOT)."""
    tiles, split, per_split = _split(args, config)
    sx, sw, hq, hs = args.sx, args.sw, args.hq, args.hs
    values = dict(
        x_desc=descriptor(args.xq, True, config.block_m, BLOCK_K), w_desc=descriptor(args.w, True, GROUP, BLOCK_K),
        hq_ptr=hq, sx_ptr=sx, sw_ptr=sw, hs_ptr=hs, ws_ptr=ws.partials, lock_ptr=ws.counters,
        M=args.m, H=args.h, I=args.i, stride_hqm=hq.stride(0), stride_sxm=sx.stride(0), stride_sxk=sx.stride(1),
        stride_swn=sw.stride(0), stride_swk=sw.stride(1), stride_hsm=hs.stride(0), stride_hsg=hs.stride(1),
        split_k=split, iters_per_split=per_split,
        BLOCK_M=config.block_m, BAND_M=BAND_M_TILES, SWAP_AB=config.swap_ab, POW2=bool(args.pow2_scale),
        **fp8_grid(hq.dtype),
        PDL=pdl(hq),
    )
    return KernelCall(gate_up_kernel, (tiles * split,), values,
                      dict(num_stages=config.num_stages, num_warps=config.num_warps), _OPERANDS)


def build(args: GateUpArgs, config: GateUpConfig | None = None) -> Plan:
    """The plan of one call signature: the heuristic config (or ``config``), the kernel launched
    directly (``triton/launch.py``) with the workspace of the calling stream (or capture) per
    call. Its launch takes ``(xq, w, hq, sx, sw, hs)``."""
    if config is None:
        config = choose_config(args.m, args.i, args.h, device.sms_of(args.hq.device))
    tiles, split, _ = _split(args, config)
    if split > 1 and tiles > workspace.COUNTERS:
        raise ValueError(f"{NAME}: {tiles} tiles split over K need more arrival counters than a workspace chunk "
                         f"holds ({workspace.COUNTERS}); use split_k = 1 (the heuristic splits only below the CTA slots)")
    on_gpu = args.hq.is_cuda
    if on_gpu:
        workspace.top_up(args.hq.get_device())
    need = partials_needed(args, config)
    fast = direct_launch(NAME, kernel_call(args, config, workspace.for_launch(args.hq, need))) if on_gpu else None
    if fast is not None:
        scratch = workspace.getter(fast.device_index, need)

        def launch(xq, w, hq, sx, sw, hs) -> None:
            ws = scratch()
            fast(xq, w, hq, sx, sw, hs, ws.partials, ws.counters)

        return Plan(NAME, config, launch, fast.device_index, direct=True)
    pow2 = args.pow2_scale

    def launch(xq, w, hq, sx, sw, hs) -> None:
        kernel_call(GateUpArgs(xq, sx, w, sw, hq, hs, pow2), config, workspace.for_launch(hq, need)).launch()

    return Plan(NAME, config, launch, args.hq.get_device())


def aot_spec(config: GateUpConfig | None = None, m: int = 16, h: int = 4096, i: int = 14336):
    """A compilable instance for ahead-of-time checks (``inspection.compile_triton``; not a
    registered GEMM variant, so not in ``tmagemm inspect --list``): Llama-3-8B's MLP, the
    heuristic config for ``m`` tokens on 132 SMs unless ``config`` is given."""
    from ..gate_up import example_args

    args = example_args(m, h, i)
    config = config or choose_config(m, i, h, device.H100_SMS)
    ws = workspace.Workspace(torch.empty(1), torch.zeros(1, dtype=torch.int32))
    return _aot_spec(kernel_call(args, config, ws), NAME)
