"""The native weight gradient: grouped GEMMs over the reduction dimension on warp-specialized,
persistent 128 x 256 tiles (``gemm_sm90_grouped_k.cu``).

``out[g] = a[:, K_g] @ b[K_g, :]`` (:class:`~tmagemm.grouped.ReduceArgs`) with a = ``x.t()``
(contiguous along M) and b contiguous along N: the weight gradient of a grouped GEMM, where both
operands are the layer's tokens sorted by expert. One producer thread streams every tile's
k-blocks while two consumer warpgroups multiply and store, so a tile of a short group (a few
k-blocks and a 64 KB store) costs no pipeline fill; the Triton kernel
(``triton/matmul_grouped_k.py``), which cannot overlap them, keeps the other layouts of a and b
and the CPU. The kernel's group-edge rule and schedule are documented in its source.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass, replace

import torch

from .. import device as _device
from .. import tma
from ..grouped import GroupLayout, ReduceArgs
from ..jit.runtime import stream_getter
from ..plan import Plan
from ..tma import MapsByAddress, params_for_tensor
from .gemm import _AB_TYPES, _OUT_TYPES, _ROW_BYTES, _Params, use_pdl

NAME = "cuda.grouped_k"
SOURCE = "gemm_sm90_grouped_k.cu"
KERNEL = "tmagemm_gemm_sm90_grouped_k"
BLOCK_M, BLOCK_N = 128, 256
THREADS = 384  # a producer warpgroup and two consumers
# The group table takes 12 bytes per group of shared memory next to the ring (and 8 of the
# epilogue buffers' while it is built); more groups take the Triton kernel.
MAX_GROUPS = 1024


@dataclass(frozen=True)
class GroupedKConfig:
    """Launch shape of the native weight gradient. ``stages``: depth of the TMA ring (48 KB a
    stage); ``epi_passes`` / ``epi_buffers``: each consumer stages its 64 x 256 output fragment in
    ``epi_passes`` column slices through ``epi_buffers`` alternating slice buffers; ``group_m``:
    rows of tiles per L2 group of a group's tile order; ``ctas``: persistent CTAs (0 = one per
    SM; tests use a few so every CTA walks several items)."""

    stages: int = 4
    epi_passes: int = 4
    epi_buffers: int = 2
    group_m: int = 8
    ctas: int = 0

    def label(self) -> str:
        return f"coop128x256s{self.stages}e{self.epi_passes}b{self.epi_buffers}" + (f"n{self.ctas}" if self.ctas else "")

    def epilogue_bytes(self, out_itemsize: int) -> int:
        """Both consumers' output staging."""
        return 2 * 64 * BLOCK_N * out_itemsize // self.epi_passes * self.epi_buffers

    def smem_bytes(self, groups: int, out_itemsize: int) -> int:
        """Dynamic shared memory: the ring, the epilogue staging, the group table."""
        ring = self.stages * (BLOCK_M + BLOCK_N) * _ROW_BYTES
        return ring + self.epilogue_bytes(out_itemsize) + 12 * groups + 1024  # + alignment slack

    def is_valid(self, groups: int, out_itemsize: int) -> bool:
        chunks = BLOCK_N * out_itemsize // _ROW_BYTES  # 128-byte chunks of a fragment row
        return (self.stages >= 2 and self.group_m >= 1 and self.ctas >= 0 and self.epi_passes in (1, 2, 4)
                and chunks % self.epi_passes == 0 and self.epi_buffers in (1, 2)
                and (self.epi_buffers == 1 or self.epi_passes >= 2)
                and self.epilogue_bytes(out_itemsize) >= 8 * groups  # the table's scratch while it is built
                # + the ring's barriers in static shared memory
                and self.smem_bytes(groups, out_itemsize) + 256 <= _device.SM90_SMEM_PER_BLOCK)

    def fitted(self, groups: int, out_itemsize: int) -> "GroupedKConfig":
        """The same config with ``stages`` lowered until shared memory fits (many groups, fp32
        output)."""
        config = self
        while config.stages > 2 and not config.is_valid(groups, out_itemsize):
            config = replace(config, stages=config.stages - 1)
        return config


DEFAULT = GroupedKConfig()


def unsupported_reason(args: ReduceArgs, config: GroupedKConfig | None = None) -> str | None:
    """None when the native kernel computes ``args`` (with ``config``), else why not."""
    if not _device.is_hopper(args.out.device):
        return f"native kernels need CUDA tensors on a Hopper GPU (sm_90), got {args.out.device}"
    if args.e == 0 or args.m == 0 or args.n == 0 or args.k == 0:
        return "zero-size problems write no tile (the caller fills zeros)"
    if args.a_k_major or not args.b_n_major:
        return ("a must be contiguous along M (x.t()) and b along N: operands contiguous along K_total take the "
                "Triton kernel")
    if args.e > MAX_GROUPS:
        return f"{args.e} groups: the native kernel's table holds at most {MAX_GROUPS}"
    if args.out.dtype not in _OUT_TYPES:
        return f"out dtype {args.out.dtype} is not fp16, bf16 or fp32"
    if args.n > 1 and args.out.stride(2) != 1:
        return f"out (stride {tuple(args.out.stride())}) must be contiguous along N (the Triton kernel stores any strides)"
    rows = tma.stacked_rows(args.out)  # the output map's and clipped stores' (E x M, N) rows
    if rows is None:
        return f"out {tuple(args.out.shape)} (stride {tuple(args.out.stride())}): its experts are not stacked at one stride"
    reason = tma.store_reason(rows)
    if reason:
        return reason
    if max(args.e * args.m, args.k, args.n) >= 2**31:
        return "rows and dimensions must fit in int32"
    config = (config or DEFAULT).fitted(args.e, args.out.element_size())
    if not config.is_valid(args.e, args.out.element_size()):
        return f"config {config.label()} does not fit {args.e} groups in shared memory"
    return None


def compile_module(ab_dtype: torch.dtype, out_dtype: torch.dtype, config: GroupedKConfig):
    """The NVRTC module of one build (no GPU needed; tests inspect its SASS)."""
    from .. import jit

    defines = {"TMAGEMM_AB_TYPE": _AB_TYPES[ab_dtype], "TMAGEMM_OUT_TYPE": _OUT_TYPES[out_dtype], "TMAGEMM_B_KMAJOR": 0,
               "TMAGEMM_BLOCK_N": BLOCK_N, "TMAGEMM_STAGES": config.stages, "TMAGEMM_EPI_PASSES": config.epi_passes,
               "TMAGEMM_EPI_BUFFERS": config.epi_buffers}
    return jit.compile(SOURCE, defines=defines)


def preferred(args: ReduceArgs) -> bool:
    """Whether the dispatcher runs ``args`` here rather than on the Triton kernel: wherever the
    native kernel computes it."""
    return unsupported_reason(args) is None


class _Launch:
    """One problem signature's launch: the loaded kernel, its grid, the tensor-map layouts (cached
    by address) and the parameter block. A call points them at the operands and launches on the
    current stream of the output's device."""

    def __init__(self, args: ReduceArgs, config: GroupedKConfig):
        out_size = args.out.element_size()
        self.config = config = config.fitted(args.e, out_size)
        self.device_index = args.out.get_device()
        with torch.cuda.device(self.device_index):
            kernel = compile_module(args.a.dtype, args.out.dtype, config).function(KERNEL)
        # Both operands as stored: x (K_total, M) and b (K_total, N), boxes of 64 rows x 64 columns.
        self._maps = (MapsByAddress(params_for_tensor(args.a.t(), (64, 64))),
                      MapsByAddress(params_for_tensor(args.b, (64, 64))),
                      MapsByAddress(params_for_tensor(tma.stacked_rows(args.out), (64, _ROW_BYTES // out_size))))
        params = self.params = _Params()
        params.m, params.n, params.k, params.group_m = args.m, args.n, args.k, config.group_m
        params.alpha = 1.0
        params.groups = args.e
        params.group_layout = 0 if args.layout == GroupLayout.CONTIGUOUS else 1
        params.group_rows = args.rows
        params.ldd = args.out.stride(1)
        self._counted = args.counts is not None
        self._pointers = (ctypes.c_void_p * 4)()
        self._pointers[3] = ctypes.addressof(params)
        items = args.e * -(-args.m // BLOCK_M) * -(-args.n // BLOCK_N)
        grid = min(config.ctas or _device.sm_count(self.device_index), items)
        self.pdl = use_pdl(args.out.device)
        self._launch = kernel.packed((grid, 1, 1), (THREADS, 1, 1), config.smem_bytes(args.e, out_size),
                                     self._pointers, pdl=self.pdl)
        self._stream = stream_getter()
        self._lock = threading.Lock()

    def __call__(self, a, b, out, scale_a, scale_b, bias, counts) -> None:
        with self._lock:  # the maps and the parameter block are shared by every call of the plan
            self.params.group_counts = counts.data_ptr() if self._counted else None
            self.params.d = out.data_ptr()
            pointers = self._pointers
            pointers[0] = self._maps[0].get(a.data_ptr()).address
            pointers[1] = self._maps[1].get(b.data_ptr()).address
            pointers[2] = self._maps[2].get(out.data_ptr()).address
            self._launch(self._stream(self.device_index))


def build(args: ReduceArgs, config: GroupedKConfig | None = None) -> Plan:
    """A plan for every problem with ``args``' signature; its launch takes the grouped plans'
    seven operands ``(a, b, out, None, None, None, counts)``. Raises ValueError for what
    :func:`unsupported_reason` refuses."""
    config = config or DEFAULT
    reason = unsupported_reason(args, config)
    if reason is not None:
        raise ValueError(f"{NAME}: {reason}")
    launch = _Launch(args, config)
    return Plan(NAME, launch.config, launch, launch.device_index, direct=True)
