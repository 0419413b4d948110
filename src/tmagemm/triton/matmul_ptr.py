"""The pre-Hopper baseline: the same tiling as the TMA kernel, with pointer loads and masks.

Every thread computes addresses and issues its own (cp.async) loads, which is what the seed
compares TMA against. It also takes every input TMA cannot describe (unaligned base or leading
stride, e.g. K*itemsize % 16 != 0, or arbitrary strided views), so it masks all three dims.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .. import tuning
from ..configs import TritonGemmConfig
from ..dispatch import GemmArgs, Variant
from .common import grouped_tile, scale_bias_epilogue, scale_mode
from .matmul_tma import mma


@triton.jit
def ptr_gemm_kernel(
    a_ptr, b_ptr, c_ptr, scale_a_ptr, scale_b_ptr, bias_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SCALE_A: tl.constexpr, SCALE_B: tl.constexpr, HAS_BIAS: tl.constexpr, FAST_ACCUM: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
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

    acc = scale_bias_epilogue(acc, offs_m, offs_n, M, N, scale_a_ptr, scale_b_ptr, bias_ptr, SCALE_A, SCALE_B, HAS_BIAS)
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


def launch(args: GemmArgs, config: TritonGemmConfig) -> None:
    a, b, out = args.a, args.b, args.out
    grid = (triton.cdiv(args.m, config.block_m) * triton.cdiv(args.n, config.block_n),)
    ptr_gemm_kernel[grid](
        a, b, out, args.scale_a, args.scale_b, args.bias,
        args.m, args.n, args.k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        SCALE_A=scale_mode(args.scale_a), SCALE_B=scale_mode(args.scale_b), HAS_BIAS=args.bias is not None,
        FAST_ACCUM=args.fast_accum,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


def prepare(args: GemmArgs, config: TritonGemmConfig | None = None):
    if config is None:
        config = tuning.select("triton.ptr", args, CONFIGS, heuristic, lambda c: launch(args, c))
    return lambda problem: launch(problem, config)


def run(args: GemmArgs, config: TritonGemmConfig | None = None) -> None:
    prepare(args, config)(args)


VARIANTS = [
    Variant(
        name="triton.ptr",
        backend="triton",
        description="Triton, pointer loads (no TMA): the pre-Hopper baseline and the fallback for any strides",
        supports=lambda args: None if args.m and args.n and args.k else "a zero-size dimension",
        run=run,
        prepare=prepare,
    )
]


def aot_spec(config: TritonGemmConfig | None = None, a_dtype=None, out_dtype=None):
    """A compilable instance for ``tmagemm inspect``: fp8 A row-major, B K-major, as the TMA kernels."""
    import torch

    from ..inspection import KernelSpec
    from .host import _TL_NAMES

    a_dtype = a_dtype or torch.float8_e4m3fn
    out_dtype = out_dtype or torch.bfloat16
    fp8 = a_dtype.itemsize == 1
    config = config or TritonGemmConfig(128, 128, 64, 8, 4, 8)
    b_name = "fp8e4nv" if fp8 else _TL_NAMES[a_dtype]
    sig = {
        "a_ptr": f"*{_TL_NAMES[a_dtype]}", "b_ptr": f"*{b_name}", "c_ptr": f"*{_TL_NAMES[out_dtype]}",
        "scale_a_ptr": "*fp32" if fp8 else "constexpr", "scale_b_ptr": "*fp32" if fp8 else "constexpr",
        "bias_ptr": "constexpr",
        **{name: "i32" for name in ("M", "N", "K", "stride_am", "stride_bn", "stride_cm")},
        **{name: "constexpr" for name in ("stride_ak", "stride_bk", "stride_cn")},
    }
    consts = {"bias_ptr": None, "stride_ak": 1, "stride_bk": 1, "stride_cn": 1,
              "BLOCK_M": config.block_m, "BLOCK_N": config.block_n, "BLOCK_K": config.block_k,
              "GROUP_M": config.group_m, "SCALE_A": int(fp8), "SCALE_B": int(fp8), "HAS_BIAS": False,
              "FAST_ACCUM": True}
    if not fp8:
        consts.update(scale_a_ptr=None, scale_b_ptr=None, stride_bk=None, stride_bn=1)
        sig.update(stride_bk="i32", stride_bn="constexpr")
        del consts["stride_bk"]
    sig.update({name: "constexpr" for name in consts if name.isupper()})
    attrs = {name: [["tt.divisibility", 16]] for name in ("a_ptr", "b_ptr", "c_ptr", "K", "stride_am", "stride_cm")}
    return KernelSpec(ptr_gemm_kernel, sig, consts, config.num_warps, config.num_stages, "triton.ptr", attrs)
