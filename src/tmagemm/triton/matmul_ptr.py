"""The pre-Hopper baseline: the same tiling as the TMA kernel, with pointer loads and masks.

Every thread computes addresses and issues its own (cp.async) loads, which is what the seed
write-ups compare TMA against. It also takes every input TMA cannot describe (unaligned base or leading
stride, e.g. K*itemsize % 16 != 0, or arbitrary strided views), so it masks all three dims.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import tuning
from ..configs import TritonGemmConfig
from ..plan import GemmArgs, Plan, Scaling, Variant
from .common import epilogue_operands, grouped_tile, let_next_kernel_launch, mma, scale_bias, wait_for_previous_kernel
from .host import example_args
from .launch import A, B, BIAS, OUT, SCALE_A, SCALE_B, KernelCall, aot_spec as _aot_spec, pdl


# M changes with every batch: not specialising on it keeps one binary per config, so a new M
# never compiles (the masks and TMA bounds take M at run time).
@triton.jit(do_not_specialize=["M"])
def ptr_gemm_kernel(
    a_ptr, b_ptr, c_ptr, scale_a_ptr, scale_b_ptr, bias_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SCALE_A: tl.constexpr, SCALE_B: tl.constexpr, HAS_BIAS: tl.constexpr, FAST_ACCUM: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)  # PDL: all reads and writes come after the previous kernel
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    out_sa, out_sb, out_bias = epilogue_operands(offs_m, offs_n, M, N, scale_a_ptr, scale_b_ptr, bias_ptr,
                                                 SCALE_A, SCALE_B, HAS_BIAS)
    # int64 offsets: M*stride_am can pass 2^31 for large activations.
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :].to(tl.int64) * stride_bn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        # Out-of-range rows/cols/K read as 0 so they add nothing to the dot product.
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
        acc = mma(a, b, acc, FAST_ACCUM, BLOCK_K)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    let_next_kernel_launch(PDL)

    acc = scale_bias(acc, out_sa, out_sb, out_bias, SCALE_A, SCALE_B, HAS_BIAS)
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


CONFIGS = tuple(
    TritonGemmConfig(bm, bn, bk, 8, s, w)
    for bm, bn, bk, s, w in (
        (128, 256, 64, 3, 8),
        (128, 128, 64, 4, 8),
        (128, 128, 128, 3, 8),
        (64, 128, 64, 4, 4),
        (64, 64, 128, 4, 4),
    )
)


def heuristic(args: GemmArgs) -> TritonGemmConfig:
    # 128x128x128 fp8 at 8 warps spills (the loaded tiles live in registers before shared memory).
    if args.m <= 64:
        return TritonGemmConfig(64, 64, 128 if args.is_fp8 else 64, 8, 4, 4)
    return TritonGemmConfig(128, 128, 64, 8, 4, 8)


_OPERANDS = {"a_ptr": A, "b_ptr": B, "c_ptr": OUT, "scale_a_ptr": SCALE_A, "scale_b_ptr": SCALE_B, "bias_ptr": BIAS}


def kernel_call(args: GemmArgs, config: TritonGemmConfig) -> KernelCall:
    a, b, out = args.a, args.b, args.out
    grid = (triton.cdiv(args.m, config.block_m) * triton.cdiv(args.n, config.block_n),)
    values = dict(
        a_ptr=a, b_ptr=b, c_ptr=out, scale_a_ptr=args.scale_a, scale_b_ptr=args.scale_b, bias_ptr=args.bias,
        M=args.m, N=args.n, K=args.k,
        stride_am=a.stride(0), stride_ak=a.stride(1), stride_bk=b.stride(0), stride_bn=b.stride(1),
        stride_cm=out.stride(0), stride_cn=out.stride(1),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        SCALE_A=int(Scaling.of(args.scale_a)), SCALE_B=int(Scaling.of(args.scale_b)), HAS_BIAS=args.bias is not None,
        FAST_ACCUM=args.fast_accum, PDL=pdl(out),
    )
    return KernelCall(ptr_gemm_kernel, grid, values, dict(num_warps=config.num_warps, num_stages=config.num_stages),
                      _OPERANDS)


def supports(args: GemmArgs) -> str | None:
    if args.m == 0 or args.n == 0 or args.k == 0:
        return "a zero-size dimension (the plan layer returns those without a kernel)"
    if args.block_scaling is not None:
        return "block scales (1x128 / 128x128) are applied by the block-scaled kernels only"
    return None


def build(args: GemmArgs, config: TritonGemmConfig | None = None) -> Plan:
    """Triton's launcher per call: the pointer kernel serves layouts the fast paths refuse."""
    if config is None:
        config = tuning.select("triton.ptr", args, CONFIGS, heuristic, lambda c: kernel_call(args, c).launch())
    elif field := config.grouped_only():
        raise ValueError(f"triton.ptr: config {config.label()} has {field}, which only triton.grouped runs")

    def launch(a, b, out, scale_a, scale_b, bias) -> None:
        kernel_call(GemmArgs(a, b, out, scale_a, scale_b, bias, args.fast_accum), config).launch()

    return Plan("triton.ptr", config, launch, args.out.get_device())


VARIANTS = [
    Variant(
        name="triton.ptr",
        backend="triton",
        description="Triton, pointer loads (no TMA): the pre-Hopper baseline and the fallback for any strides",
        supports=supports,
        build=build,
    )
]


def aot_spec(config: TritonGemmConfig | None = None, a_dtype=None, out_dtype=None):
    """A compilable instance for ``tmagemm inspect``: fp8 A row-major, B K-major, as the TMA kernels."""
    args = example_args(a_dtype or torch.float8_e4m3fn, out_dtype or torch.bfloat16)
    return _aot_spec(kernel_call(args, config or TritonGemmConfig(128, 128, 64, 8, 4, 8)), "triton.ptr")
