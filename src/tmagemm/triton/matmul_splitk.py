"""Small-M (decode) GEMM: TMA weight streaming, optional swap-AB, split-K with an in-kernel reduction.

For M <= 128 and N, K in the thousands the GEMM reads the weight once and is bound by HBM
bandwidth. One row of 128x128 output tiles gives N/128 CTAs (32 at N=4096) for 132 SMs, so most of
the machine idles. This kernel family fixes that with two tools:

* **split-K**: each output tile's K range is cut into ``split_k`` slices, one CTA per slice, so
  ``tiles * split_k`` CTAs stream the weight in parallel. Slices write fp32 partials to a cached
  workspace; the CTA that arrives last at a per-tile counter sums all slices *in slice order*
  and runs the scale/bias/cast epilogue. One launch, no zeroing of ``out``, and the result is
  bitwise reproducible (the sum order never depends on which CTA finished first).
* **swap-AB**: compute ``out^T = b^T a^T`` so the weight fills the 64/128-row WGMMA M dimension
  and the few tokens land in the N dimension (16..128), instead of padding M up to 64.

The configuration comes from :func:`choose_config`, a pure function of (M, N, K, dtype, SMs);
nothing is tuned at call time. The call allocates nothing once the per-(device, stream)
workspace exists, so it can be captured in a CUDA graph (see :func:`run`).
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from tmagemm import device as _device
from tmagemm import envs
from tmagemm.dispatch import GemmArgs, Variant
from tmagemm.jit.runtime import stream_getter
from tmagemm.triton.common import scale_bias_epilogue, scale_mode
from tmagemm.triton.host import direct_launch, triton_launch

MAX_M = 128

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
HALF_DTYPES = (torch.bfloat16, torch.float16)

# Projection shapes of the `llm` benchmark preset, (K, N) of the weight: Llama-3-8B then 70B.
LLM_PROJECTIONS = {
    "llama3-8b.qkv": (4096, 6144),
    "llama3-8b.o": (4096, 4096),
    "llama3-8b.gate_up": (4096, 28672),
    "llama3-8b.down": (14336, 4096),
    "llama3-70b.qkv": (8192, 10240),
    "llama3-70b.o": (8192, 8192),
    "llama3-70b.gate_up": (8192, 57344),
    "llama3-70b.down": (28672, 8192),
}

# Shared memory one CTA may plan for its pipeline (H100/H200 allow 227 KiB per block); the rest
# is left for the layout conversions of the epilogue.
_SMEM_BUDGET = 200 * 1024


@dataclass(frozen=True)
class SplitKConfig:
    """Tiles and split of one small-M launch.

    block_m tiles the tokens (M), block_n the weight rows (N), block_k the reduction. With
    ``swap_ab`` the kernel computes ``[block_n, block_m]`` tiles of out^T. ``a_tma`` loads the
    activation through a TMA descriptor too (otherwise pointer loads, any strides).
    Without ``fast_accum`` an fp8 tile promotes WGMMA's reduced-precision accumulator into fp32
    once per block_k (like DeepGEMM); the kernel is bound by HBM, so the extra adds are free.
    """

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    swap_ab: bool
    a_tma: bool
    num_stages: int
    num_warps: int = 4
    fast_accum: bool = False  # fp8: let WGMMA accumulate the whole K range imprecisely

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value > 256 or value & (value - 1):
                raise ValueError(f"SplitKConfig.{name}={value}: must be a power of two in [16, 256]")
        if self.split_k < 1:
            raise ValueError(f"SplitKConfig.split_k={self.split_k}: must be >= 1")
        if self.num_stages < 1:
            raise ValueError(f"SplitKConfig.num_stages={self.num_stages}: must be >= 1")
        if self.num_warps not in (4, 8):
            raise ValueError(f"SplitKConfig.num_warps={self.num_warps}: must be 4 or 8")

    def smem_bytes(self, itemsize: int) -> int:
        """Pipeline buffers: one weight tile and one activation tile per stage."""
        return self.num_stages * (self.block_n + self.block_m) * self.block_k * itemsize


# ----------------------------------------------------------------------------------------------
# Heuristic
# ----------------------------------------------------------------------------------------------


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def stages_for(block_m: int, block_n: int, block_k: int, itemsize: int, ctas_per_sm: int = 2) -> int:
    """Deepest pipeline that lets ``ctas_per_sm`` CTAs share one SM's shared memory."""
    stage = (block_m + block_n) * block_k * itemsize
    return max(2, min(8, _SMEM_BUDGET // ctas_per_sm // stage))


def choose_config(m: int, n: int, k: int, a_dtype: torch.dtype, sm_count: int, fast_accum: bool = False) -> SplitKConfig:
    """Tiles and split factor for an (m, n, k) problem; pure, so tests can tabulate it.

    Fitted to a sweep on an H100 (docs/small-m.md): swap-AB with the tokens rounded up to a
    power of two >= 16 in the WGMMA N slot, 64 weight rows per tile (twice the CTAs of 128-row
    tiles, and the deepest pipeline: 8 stages at M <= 16), block_k spanning 128 bytes (one 128B
    swizzle row), and a K split only while the tiles alone leave SMs idle (split up to
    sm_count // tiles, keeping >= 4 K-blocks per slice). Splitting further to fill two waves lost
    in the sweep: the partial sums cost more than the extra parallelism returned. ``fast_accum``
    (fp8 only; the caller's ``use_fast_accum``) leaves wgmma's accumulation unpromoted: about 2%
    faster at M = 1-32 on a 4096 x 4096 weight (docs/small-m.md).
    """
    itemsize = 1 if a_dtype in FP8_DTYPES else 2
    block_k = 128 // itemsize
    block_m = min(MAX_M, max(16, _next_pow2(m)))
    block_n = 64
    tiles = _cdiv(max(m, 1), block_m) * _cdiv(max(n, 1), block_n)
    k_iters = max(1, _cdiv(k, block_k))
    split = max(1, min(sm_count // tiles, k_iters // 4))
    # Re-derive the split from the slice length so no slice is empty.
    split = _cdiv(k_iters, _cdiv(k_iters, split))
    return SplitKConfig(
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        split_k=split,
        swap_ab=True,
        a_tma=False,
        num_stages=stages_for(block_m, block_n, block_k, itemsize),
        num_warps=8 if block_m * block_n > 128 * 64 else 4,
        fast_accum=fast_accum and itemsize == 1,
    )


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------


# M changes every decode step and the split is picked per shape: not specialising on them keeps
# one binary per config (the reduction branch is a uniform scalar test).
@triton.jit(do_not_specialize=["M", "split_k", "iters_per_split"])
def _splitk_kernel(
    a_ptr,
    a_desc,
    w_desc,
    out_ptr,
    scale_a_ptr,
    scale_b_ptr,
    bias_ptr,
    ws_ptr,
    lock_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_om,
    stride_on,
    split_k,
    iters_per_split,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SWAP_AB: tl.constexpr,
    A_TMA: tl.constexpr,
    W_KMAJOR: tl.constexpr,
    SCALE_A: tl.constexpr,
    SCALE_B: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PROMOTE_EVERY: tl.constexpr,
):
    # -- scheduler: axis 0 is the K slice, so the slices of one tile are launched side by side
    # and the last one does not wait long for the others; consecutive tiles walk N, so CTAs in
    # flight share the activation row panel in L2.
    split_id = tl.program_id(0)
    tile_id = tl.program_id(1)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m = tile_id // num_pid_n
    pid_n = tile_id % num_pid_n
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)

    k_lo = split_id * iters_per_split
    k_hi = tl.minimum(k_lo + iters_per_split, tl.cdiv(K, BLOCK_K))

    # -- mainloop: the weight streams through TMA (zero-filled past N and K, so ragged edges need
    # no masks); Triton pipelines the loads num_stages deep behind mbarriers.
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ki in range(k_lo, k_hi):
        k0 = ki * BLOCK_K
        if A_TMA:
            a = a_desc.load([off_m, k0])
        else:
            # The activation is tiny next to the weight; pointer loads accept any strides and
            # skip a tensor-map encode per call on the host.
            ks = k0 + offs_k
            a = tl.load(
                a_ptr + offs_m[:, None] * stride_am + ks[None, :] * stride_ak,
                mask=(offs_m[:, None] < M) & (ks[None, :] < K),
                other=0.0,
            )
        if W_KMAJOR:
            w = w_desc.load([off_n, k0])  # [BLOCK_N, BLOCK_K], K contiguous (fp8 needs this)
            if SWAP_AB:
                acc = tl.dot(w, a.T, acc, max_num_imprecise_acc=PROMOTE_EVERY)
            else:
                acc = tl.dot(a, w.T, acc, max_num_imprecise_acc=PROMOTE_EVERY)
        else:
            w = w_desc.load([k0, off_n])  # [BLOCK_K, BLOCK_N], N contiguous (16-bit only)
            if SWAP_AB:
                acc = tl.dot(w.T, a.T, acc, max_num_imprecise_acc=PROMOTE_EVERY)
            else:
                acc = tl.dot(a, w, acc, max_num_imprecise_acc=PROMOTE_EVERY)

    # -- split-K reduction, deterministic: every slice parks its partial in the workspace, then
    # bumps the tile's arrival counter; the last to arrive sums the slices in slice order.
    if split_k > 1:
        tile_elems: tl.constexpr = BLOCK_M * BLOCK_N
        ws_tile = ws_ptr + tile_id.to(tl.int64) * split_k * tile_elems
        if SWAP_AB:
            offs_acc = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        else:
            offs_acc = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        # .cg keeps partials in L2 (the coherence point across SMs), never in a stale L1 line.
        tl.store(ws_tile + split_id * tile_elems + offs_acc, acc, cache_modifier=".cg")
        # All threads' stores must be issued before the release below publishes them: the
        # scalar atomic runs on one thread, and its gpu-scope release is cumulative over what
        # the CTA barrier ordered before it.
        tl.debug_barrier()
        arrived = tl.atomic_add(lock_ptr + tile_id, 1, sem="acq_rel", scope="gpu")
        if arrived != split_k - 1:
            return
        acc = tl.zeros_like(acc)
        for s in range(0, split_k):
            acc += tl.load(ws_tile + s * tile_elems + offs_acc, cache_modifier=".cg")
        # Re-arm the counter for the next launch on this stream: the workspace never needs a
        # memset, which keeps the call a single kernel and CUDA-graph safe.
        tl.atomic_xchg(lock_ptr + tile_id, 0, sem="relaxed", scope="gpu")

    # -- epilogue: back to (tokens, N) orientation, dequantise, bias, cast, masked store.
    if SWAP_AB:
        acc = acc.T
    acc = scale_bias_epilogue(
        acc, offs_m, offs_n, M, N, scale_a_ptr, scale_b_ptr, bias_ptr, SCALE_A, SCALE_B, HAS_BIAS
    )
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


# ----------------------------------------------------------------------------------------------
# Host side: workspace, descriptors, launcher
# ----------------------------------------------------------------------------------------------


@dataclass
class _Workspace:
    partials: torch.Tensor  # fp32, split_k * tiles * block_m * block_n elements at most
    locks: torch.Tensor  # int32 arrival counters, one per tile, zero between launches


# Sized so that any config choose_config returns for M <= 128 on a 132-SM part fits without growth.
_MIN_PARTIALS = 4 << 20  # fp32 elements (16 MiB)
_MIN_LOCKS = 1 << 14

_workspaces: dict[tuple, _Workspace] = {}
# Buffers outgrown by a larger request stay alive: a captured CUDA graph may still point at them.
_retired: list[_Workspace] = []


def _stream_key(dev: torch.device) -> tuple:
    if dev.type != "cuda":
        return (dev.type, None, None)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    return (dev.type, index, stream_getter()(index))  # looked up on every call: keep it cheap


def _workspace(dev: torch.device, partials: int, locks: int) -> _Workspace:
    """The (device, stream)'s workspace, grown if too small; never allocated during capture.

    The counters are shared by every launch on one stream, so two streams must not share them
    (their launches could interleave); launches on one stream are ordered, which is all the
    self-resetting counters need.
    """
    key = _stream_key(dev)
    ws = _workspaces.get(key)
    if ws is not None and ws.partials.numel() >= partials and ws.locks.numel() >= locks:
        return ws
    if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "tmagemm split-K: no workspace for this CUDA stream yet and a graph capture is in "
            "progress (allocating now would tie the buffer to the graph). Make one eager call of "
            "the same GEMM on the capture stream before capturing, e.g. "
            "`with torch.cuda.stream(s): gemm(...)` then `torch.cuda.graph(g, stream=s)`."
        )
    if ws is not None:
        _retired.append(ws)
    partials = max(partials, _MIN_PARTIALS, 2 * ws.partials.numel() if ws is not None else 0)
    locks = max(locks, _MIN_LOCKS, 2 * ws.locks.numel() if ws is not None else 0)
    ws = _Workspace(
        partials=torch.empty(partials, dtype=torch.float32, device=dev),
        locks=torch.zeros(locks, dtype=torch.int32, device=dev),
    )
    _workspaces[key] = ws
    return ws


_desc_cache: OrderedDict[tuple, TensorDescriptor] = OrderedDict()
_DESC_CACHE_SIZE = 256


def _aligned_ld(ld: int, rows: int, cols: int, itemsize: int) -> int:
    """Leading stride for TMA; a single-row matrix's stride is never used, so make it legal."""
    if rows > 1:
        return ld
    return _cdiv(cols * itemsize, 16) * 16 // itemsize


def _weight_desc(b: torch.Tensor, kmajor: bool, block_n: int, block_k: int) -> TensorDescriptor:
    """TMA descriptor of the weight, cached: weights persist across calls, so this hits."""
    k, n = b.shape
    key = (b.data_ptr(), k, n, b.stride(0), b.stride(1), b.dtype, kmajor, block_n, block_k, b.device)
    desc = _desc_cache.get(key)
    if desc is not None:
        _desc_cache.move_to_end(key)
        return desc
    if kmajor:  # (N, K) row-major view of b
        ld = _aligned_ld(b.stride(1), n, k, b.element_size())
        desc = TensorDescriptor(b, [n, k], [ld, 1], [block_n, block_k])
    else:
        ld = _aligned_ld(b.stride(0), k, n, b.element_size())
        desc = TensorDescriptor(b, [k, n], [ld, 1], [block_k, block_n])
    _desc_cache[key] = desc
    if len(_desc_cache) > _DESC_CACHE_SIZE:
        _desc_cache.popitem(last=False)
    return desc


def _weight_kmajor(b: torch.Tensor) -> bool:
    """True when b (K, N) is the transpose of a row-major (N, K) weight (K contiguous)."""
    k, _ = b.shape
    return b.stride(0) == 1 if k > 1 else b.stride(1) != 1


def _tma_reason(t: torch.Tensor, ld: int, rows: int, what: str) -> str | None:
    if t.data_ptr() % 16:
        return f"{what} base address is not 16-byte aligned for TMA"
    if rows > 1 and (ld * t.element_size()) % 16:
        return f"{what} leading stride {ld} x {t.element_size()} B is not a multiple of 16 B for TMA"
    return None


def supports(args: GemmArgs) -> str | None:
    a, b = args.a, args.b
    if args.m > MAX_M:
        return f"M={args.m} > {MAX_M}: the split-K kernels are for small M (decode)"
    if a.dtype not in FP8_DTYPES + HALF_DTYPES:
        return f"a dtype {a.dtype} is not fp8 (e4m3/e5m2), bf16 or fp16"
    if b.dtype != a.dtype:
        return f"b dtype {b.dtype} differs from a dtype {a.dtype}"
    if a.device.type == "cuda":
        if not _device.is_hopper(a.device):
            return "needs an sm_90 (Hopper) GPU for TMA + WGMMA"
    elif not envs.interpret():
        return f"tensors on {a.device.type} need TRITON_INTERPRET=1 (CPU interpreter)"
    if args.m == 0 or args.n == 0 or args.k == 0:
        return None  # run() handles empty problems without a launch
    kmajor = _weight_kmajor(b)
    if a.dtype in FP8_DTYPES and not kmajor:
        return "fp8 b must be column-major (b = w.t() of a row-major (N, K) weight): WGMMA reads fp8 K-major"
    if not kmajor and b.stride(1) != 1:
        return f"b strides {tuple(b.stride())}: neither dimension is contiguous"
    k, n = b.shape
    reason = _tma_reason(b, b.stride(1) if kmajor else b.stride(0), n if kmajor else k, "b")
    if reason:
        return reason
    if (k if kmajor else n) * b.element_size() < 16:
        return f"b inner dimension of {(k if kmajor else n) * b.element_size()} B is below TMA's 16 B minimum"
    return None


def _check_gpu_config(config: SplitKConfig, itemsize: int) -> None:
    """On a GPU, only the tile family the heuristic uses and the GPU tests cover may launch.

    Smaller tiles (block_n < 64, block_k rows under 128 B) run under the interpreter only: a GPU
    job of ours stalled on them once and the cause is not pinned down yet.
    """
    if config.block_n < 64 or config.block_k * itemsize != 128:
        raise ValueError(
            f"SplitKConfig block_n={config.block_n}, block_k={config.block_k}: on a GPU this kernel "
            f"takes block_n >= 64 and block_k spanning 128 B ({128 // itemsize} elements)"
        )


# Per-call operands of _splitk_kernel, first in its signature: a, a's descriptor (or None), the
# weight's descriptor, out, the scales, the bias, the stream's workspace (partials, counters).
_OPERANDS = 9
# Positions of the kernel's do_not_specialize ints (M, split_k, iters_per_split).
_UNSPECIALIZED = frozenset({9, 16, 17})


def _kernel_call(args: GemmArgs, config: SplitKConfig, ws: _Workspace):
    """``(kernel, grid, positional args, constexprs)`` of one launch on workspace ``ws``."""
    a, b, out = args.a, args.b, args.out
    m, n, k = args.m, args.n, args.k
    kmajor = _weight_kmajor(b)
    w_desc = _weight_desc(b, kmajor, config.block_n, config.block_k)
    if config.a_tma:
        ld = _aligned_ld(a.stride(0), m, k, a.element_size())
        a_desc = TensorDescriptor(a, [m, k], [ld, 1], [config.block_m, config.block_k])
    else:
        a_desc = None
    tiles = _cdiv(m, config.block_m) * _cdiv(n, config.block_n)
    k_iters = _cdiv(k, config.block_k)
    iters_per_split = _cdiv(k_iters, config.split_k)
    split = _cdiv(k_iters, iters_per_split)
    positional = (
        a, a_desc, w_desc, out, args.scale_a, args.scale_b, args.bias, ws.partials, ws.locks,
        m, n, k, a.stride(0), a.stride(1), out.stride(0), out.stride(1), split, iters_per_split,
    )
    constexprs = dict(
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        SWAP_AB=config.swap_ab,
        A_TMA=config.a_tma,
        W_KMAJOR=kmajor,
        SCALE_A=scale_mode(args.scale_a),
        SCALE_B=scale_mode(args.scale_b),
        HAS_BIAS=args.bias is not None,
        # None keeps Triton's default (fp8 on sm_90: accumulate imprecisely over all of K).
        PROMOTE_EVERY=config.block_k if args.is_fp8 and not config.fast_accum else None,
        num_stages=config.num_stages,
        num_warps=config.num_warps,
    )
    return _splitk_kernel, (split, tiles), positional, constexprs


def _workspace_need(args: GemmArgs, config: SplitKConfig) -> tuple[int, int]:
    """(fp32 partials, counters) one launch needs; nothing without a K split."""
    tiles = _cdiv(args.m, config.block_m) * _cdiv(args.n, config.block_n)
    k_iters = _cdiv(args.k, config.block_k)
    split = _cdiv(k_iters, _cdiv(k_iters, config.split_k))
    return (tiles * split * config.block_m * config.block_n, tiles) if split > 1 else (0, 0)


def _launch(args: GemmArgs, config: SplitKConfig) -> None:
    if args.a.device.type == "cuda":
        _check_gpu_config(config, args.a.element_size())
    ws = _workspace(args.a.device, *_workspace_need(args, config))
    triton_launch(_kernel_call(args, config, ws))


@functools.lru_cache(maxsize=4096)
def _cached_config(m: int, n: int, k: int, dtype: torch.dtype, sms: int, fast_accum: bool) -> SplitKConfig:
    return choose_config(m, n, k, dtype, sms, fast_accum)


def _prepare_zero_k(args: GemmArgs):
    def launcher(problem: GemmArgs) -> None:
        if problem.bias is None:  # empty sum: out = bias (or 0); scales multiply zero
            problem.out.zero_()
        else:
            problem.out.copy_(problem.bias.expand(problem.m, problem.n))

    return launcher


def prepare(args: GemmArgs, config: SplitKConfig | None = None):
    """The launch of one problem signature: heuristic config, and the kernel launched directly
    (``triton/direct.py``) with the calling stream's workspace looked up per call."""
    if args.m == 0 or args.n == 0:
        return lambda problem: None
    if args.k == 0:
        return _prepare_zero_k(args)
    if config is None:
        config = _cached_config(args.m, args.n, args.k, args.a.dtype, _device.sms_of(args.a.device), args.fast_accum)
    if args.a.device.type == "cuda":
        _check_gpu_config(config, args.a.element_size())
    need = _workspace_need(args, config)
    fast = direct_launch("triton.splitk", args, _kernel_call(args, config, _workspace(args.a.device, *need)),
                         _OPERANDS, _UNSPECIALIZED)
    if fast is None:

        def launcher(problem: GemmArgs) -> None:
            _launch(problem, config)

    else:
        a_operand = config.a_tma  # the descriptor over A takes A's address, like the A pointer

        index = args.out.get_device()
        stream_of = stream_getter()

        def operands(a, b, out, scale_a, scale_b, bias):
            ws = _workspaces.get(("cuda", index, stream_of(index)))  # this stream's, if big enough
            if ws is None or ws.partials.numel() < need[0] or ws.locks.numel() < need[1]:
                ws = _workspace(out.device, *need)
            fast(a, a if a_operand else None, b, out, scale_a, scale_b, bias, ws.partials, ws.locks)

        def launcher(problem: GemmArgs) -> None:
            operands(problem.a, problem.b, problem.out, problem.scale_a, problem.scale_b, problem.bias)

        launcher.operands = operands
    launcher.direct = fast is not None
    launcher.config = config
    return launcher


def run(args: GemmArgs, config: SplitKConfig | None = None) -> None:
    """Write ``args.out`` through Triton's launcher; ``config`` overrides the heuristic (tests,
    benchmarks).

    CUDA graphs: the first call on a stream allocates that stream's workspace (16 MiB partials,
    64 KiB counters). Capture is safe once one eager call has run on the capture stream; a call
    that would need to allocate during capture raises RuntimeError instead.
    """
    m, n, k = args.m, args.n, args.k
    if m == 0 or n == 0:
        return
    if k == 0:
        _prepare_zero_k(args)(args)
        return
    if config is None:
        config = _cached_config(m, n, k, args.a.dtype, _device.sms_of(args.a.device), args.fast_accum)
    _launch(args, config)


VARIANTS = [
    Variant(
        name="triton.splitk",
        backend="triton",
        description="small-M (<=128) decode GEMM: TMA weight stream, swap-AB, deterministic split-K",
        supports=supports,
        run=run,
        prepare=prepare,
    )
]
