"""Persistent TMA GEMM: one program per SM walks the output tiles in grouped order.

Launching exactly as many programs as SMs removes the per-tile launch tail and lets the
compiler overlap one tile's epilogue with the next tile's first TMA loads. The epilogue can be
split into two half-width subtiles, halving the registers and shared memory it needs so the
operand ring can be deeper.

No warp-specialized Triton variant: Triton's automatic warp specialization for Hopper
(``tl.range(..., warp_specialize=True)``) aborts in its WSDataPartition pass on this kernel with
Triton 3.6 and 3.9 at 4 warps, and leaves the kernel unchanged (no setmaxnreg) at 8 warps.
Warp specialization lives in the native kernels (``tmagemm/cuda``), which control it directly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import device
from ..configs import TritonGemmConfig
from ..plan import GemmArgs, Variant
from .common import (epilogue_operands, first_row_in_bounds, grouped_tile, let_next_kernel_launch, mma, scale_bias,
                     wait_for_previous_kernel)
from .host import GEMM_OPERANDS, Layout, example_args, operand_descriptors, tma_builder, tma_layout, tma_supports
from .launch import KernelCall, aot_spec as _aot_spec, pdl
from .matmul_tma import load_a_tile, load_b_tile, store_tile


@triton.jit
def _epilogue(acc, c_desc, c_ptr, off_m, off_n, M, N, stride_cm, stride_cn, scale_a_ptr, scale_b_ptr, bias_ptr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA_STORE: tl.constexpr,
              SCALE_A: tl.constexpr, SCALE_B: tl.constexpr, HAS_BIAS: tl.constexpr):
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    out_sa, out_sb, out_bias = epilogue_operands(offs_m, offs_n, M, N, scale_a_ptr, scale_b_ptr, bias_ptr,
                                                 SCALE_A, SCALE_B, HAS_BIAS)
    acc = scale_bias(acc, out_sa, out_sb, out_bias, SCALE_A, SCALE_B, HAS_BIAS)
    store_tile(c_desc, c_ptr, acc, offs_m, offs_n, off_m, off_n, M, N, stride_cm, stride_cn, TMA_STORE)


# M changes with every batch: not specialising on it keeps one binary per config, so a new M
# never compiles (the masks and TMA bounds take M at run time).
@triton.jit(do_not_specialize=["M"])
def persistent_gemm_kernel(
    a_desc, b_desc, c_desc, c_ptr, scale_a_ptr, scale_b_ptr, bias_ptr,
    M, N, K, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_SMS: tl.constexpr, EPILOGUE_SUBTILE: tl.constexpr,
    A_ROW_MAJOR: tl.constexpr, B_ROW_MAJOR: tl.constexpr, TMA_STORE: tl.constexpr,
    SCALE_A: tl.constexpr, SCALE_B: tl.constexpr, HAS_BIAS: tl.constexpr, FAST_ACCUM: tl.constexpr,
    PDL: tl.constexpr,
):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    wait_for_previous_kernel(PDL)  # PDL: all reads and writes come after the previous kernel

    # Static round-robin scheduler: program p takes tiles p, p + NUM_SMS, ...
    for tile_id in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_SMS):
        pid_m, pid_n = grouped_tile(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m = first_row_in_bounds(pid_m, BLOCK_M, M, A_ROW_MAJOR)
        off_n = pid_n * BLOCK_N

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(k_tiles):
            a = load_a_tile(a_desc, off_m, k * BLOCK_K, A_ROW_MAJOR)
            b = load_b_tile(b_desc, k * BLOCK_K, off_n, B_ROW_MAJOR)
            acc = mma(a, b, acc, FAST_ACCUM, BLOCK_K)
        if tile_id + NUM_SMS >= num_pid_m * num_pid_n:  # this program's last main loop is done
            let_next_kernel_launch(PDL)

        if EPILOGUE_SUBTILE:
            # [BM, BN] -> two [BM, BN/2] halves: each is scaled, converted and stored on its own.
            halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
            acc0, acc1 = tl.split(halves)
            _epilogue(acc0, c_desc, c_ptr, off_m, off_n, M, N, stride_cm, stride_cn, scale_a_ptr, scale_b_ptr,
                      bias_ptr, BLOCK_M, BLOCK_N // 2, TMA_STORE, SCALE_A, SCALE_B, HAS_BIAS)
            _epilogue(acc1, c_desc, c_ptr, off_m, off_n + BLOCK_N // 2, M, N, stride_cm, stride_cn, scale_a_ptr,
                      scale_b_ptr, bias_ptr, BLOCK_M, BLOCK_N // 2, TMA_STORE, SCALE_A, SCALE_B, HAS_BIAS)
        else:
            _epilogue(acc, c_desc, c_ptr, off_m, off_n, M, N, stride_cm, stride_cn, scale_a_ptr, scale_b_ptr,
                      bias_ptr, BLOCK_M, BLOCK_N, TMA_STORE, SCALE_A, SCALE_B, HAS_BIAS)


def _configs(subtile: bool) -> tuple[TritonGemmConfig, ...]:
    shapes = (
        (128, 256, 64, 4, 8),
        (128, 256, 128, 3, 8),
        (128, 128, 64, 5, 8),
        (128, 128, 128, 4, 8),
        (64, 128, 128, 5, 4),
        (128, 64, 128, 5, 4),
    )
    return tuple(TritonGemmConfig(bm, bn, bk, 8, s, w, subtile) for bm, bn, bk, s, w in shapes)


CONFIGS = _configs(True) + _configs(False)


def heuristic(args: GemmArgs) -> TritonGemmConfig:
    if args.m <= 128:
        return TritonGemmConfig(64, 128, 128, 8, 5, 4, False)
    if args.is_fp8:
        return TritonGemmConfig(128, 256, 128, 8, 3, 8, True)
    return TritonGemmConfig(128, 256, 64, 8, 4, 8, True)


def kernel_call(args: GemmArgs, config: TritonGemmConfig, layout: Layout, num_sms: int | None = None) -> KernelCall:
    """One launch (see host.tma_builder). ``num_sms``: persistent programs (default: the device's
    SMs; under the interpreter 4, so the persistent loop runs more than once per program)."""
    out_block_n = config.block_n // 2 if config.epilogue_subtile else config.block_n
    a_desc, b_desc, c_desc = operand_descriptors(args, layout, config.block_m, config.block_n, config.block_k, out_block_n)
    num_sms = num_sms or device.sms_of(args.out.device, cpu=4)
    tiles = triton.cdiv(args.m, config.block_m) * triton.cdiv(args.n, config.block_n)
    values = dict(
        a_desc=a_desc, b_desc=b_desc, c_desc=c_desc, c_ptr=args.out, scale_a_ptr=args.scale_a,
        scale_b_ptr=args.scale_b, bias_ptr=args.bias, M=args.m, N=args.n, K=args.k,
        stride_cm=args.out.stride(0), stride_cn=args.out.stride(1),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        NUM_SMS=num_sms, EPILOGUE_SUBTILE=config.epilogue_subtile, **layout.constexprs(args.fast_accum),
        PDL=pdl(args.out),
    )
    return KernelCall(persistent_gemm_kernel, (min(num_sms, tiles),), values,
                      dict(num_warps=config.num_warps, num_stages=config.num_stages), GEMM_OPERANDS)


build = tma_builder("triton.persistent", CONFIGS, heuristic, kernel_call)


VARIANTS = [
    Variant(
        name="triton.persistent",
        backend="triton",
        description="Triton, persistent (one program per SM), TMA loads/stores, epilogue subtiling",
        supports=tma_supports,
        build=build,
        configs=CONFIGS,
    ),
]


def aot_spec(config: TritonGemmConfig | None = None, a_dtype=None, out_dtype=None):
    """A compilable instance for ``tmagemm inspect`` (fp8 by default: A row-major, B K-major)."""
    args = example_args(a_dtype or torch.float8_e4m3fn, out_dtype or torch.bfloat16)
    config = config or TritonGemmConfig(128, 256, 128 if args.is_fp8 else 64, 8, 3 if args.is_fp8 else 4, 8, True)
    return _aot_spec(kernel_call(args, config, tma_layout(args), num_sms=132), "triton.persistent")
