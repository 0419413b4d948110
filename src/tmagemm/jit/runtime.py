"""Loading cubins and launching kernels with the driver API on torch's current stream.

Launch arguments are typed: torch tensors (passed as 64-bit device pointers), TensorMaps (their
128 bytes by value, for ``const __grid_constant__ CUtensorMap`` parameters) and ctypes scalars or
structures. The argument array points straight at those objects, so nothing is serialised; the
driver copies the bytes during the launch call.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from typing import Callable, Sequence

import torch

from tmagemm.tma import TensorMap

# cudaFuncAttributeMaxDynamicSharedMemorySize: above 48 KB a kernel must opt in.
_DEFAULT_SMEM_LIMIT = 48 * 1024


class LaunchError(RuntimeError):
    """The driver refused to load or launch a kernel."""


@functools.lru_cache(maxsize=1)
def _launch_fn():
    """libcuda's cuLaunchKernel through ctypes: the hot path, several microseconds cheaper per call
    than the cuda.bindings wrapper (loading, attributes and cluster launches use cuda.bindings)."""
    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuLaunchKernel
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    return fn


@functools.lru_cache(maxsize=1)
def stream_getter():
    """``device_index -> handle of torch's current stream there``: Triton's driver hook, one C
    call (building a ``torch.cuda.Stream`` object per launch costs several times more). Hot
    paths keep the returned function."""
    import triton

    return triton.runtime.driver.active.get_current_stream


def current_stream(device_index: int) -> int:
    """Handle of torch's current stream on ``device_index``."""
    return stream_getter()(device_index)


@functools.lru_cache(maxsize=1)
def _launch_untyped():
    """cuLaunchKernel without argtypes, for :meth:`Kernel.packed` whose arguments are already
    ctypes objects (a CDLL of its own: argtypes live on the function object)."""
    fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernel
    fn.restype = ctypes.c_int
    return fn


def _driver():
    from cuda.bindings import driver

    return driver


def _check(result, what: str) -> None:
    driver = _driver()
    if result != driver.CUresult.CUDA_SUCCESS:
        _, text = driver.cuGetErrorString(result)
        detail = text.decode() if isinstance(text, bytes) else text
        raise LaunchError(f"{what} failed with {result.name}: {detail}")


def ensure_context(device_index: int) -> None:
    """Make the primary context of ``device_index`` (the one torch uses) current on this thread."""
    driver = _driver()
    if not torch.cuda.is_initialized():
        torch.cuda.init()
    result, ctx = driver.cuCtxGetCurrent()
    _check(result, "cuCtxGetCurrent")
    if int(ctx) != 0:
        result, current = driver.cuCtxGetDevice()
        if result == driver.CUresult.CUDA_SUCCESS and int(current) == device_index:
            return
    result, device = driver.cuDeviceGet(device_index)
    _check(result, "cuDeviceGet")
    result, primary = driver.cuDevicePrimaryCtxRetain(device)
    _check(result, "cuDevicePrimaryCtxRetain")
    _check(driver.cuCtxSetCurrent(primary)[0], "cuCtxSetCurrent")


class Kernel:
    """One ``extern "C" __global__`` function loaded on one device."""

    def __init__(self, name: str, function, device_index: int):
        self.name = name
        self.device_index = device_index
        self._function = function
        self._handle = int(function) if function is not None else 0  # raw CUfunction for ctypes
        self._smem_opt_in = _DEFAULT_SMEM_LIMIT
        self._lock = threading.Lock()

    def attribute(self, attribute: str) -> int:
        """A CUfunction attribute by short name, e.g. "NUM_REGS", "MAX_THREADS_PER_BLOCK"."""
        driver = _driver()
        enum = getattr(driver.CUfunction_attribute, f"CU_FUNC_ATTRIBUTE_{attribute}")
        result, value = driver.cuFuncGetAttribute(enum, self._function)
        _check(result, f"cuFuncGetAttribute({attribute})")
        return int(value)

    def reserve_shared_memory(self, smem_bytes: int) -> None:
        """Opt in to ``smem_bytes`` of dynamic shared memory (needed above 48 KB) ahead of
        :meth:`packed`."""
        if smem_bytes > self._smem_opt_in:
            self._opt_in_smem(smem_bytes)

    def _opt_in_smem(self, smem_bytes: int) -> None:
        with self._lock:
            if smem_bytes <= self._smem_opt_in:
                return
            driver = _driver()
            attribute = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            _check(
                driver.cuFuncSetAttribute(self._function, attribute, smem_bytes)[0],
                f"cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES={smem_bytes}) for {self.name}",
            )
            self._smem_opt_in = smem_bytes

    def launch(
        self,
        grid: Sequence[int] | int,
        block: Sequence[int] | int,
        args: Sequence,
        *,
        smem_bytes: int = 0,
        cluster: Sequence[int] = (1, 1, 1),
        stream: torch.cuda.Stream | int | None = None,
    ) -> None:
        """Launch on ``stream`` (default: torch's current stream of the kernel's device).

        args: torch tensors (device pointers), TensorMaps (by value), ctypes scalars/structures.
        Plain Python numbers are refused: the kernel's parameter width must be explicit.
        """
        gx, gy, gz = _dim3(grid, "grid")
        bx, by, bz = _dim3(block, "block")
        if smem_bytes < 0:
            raise ValueError(f"smem_bytes must be >= 0, got {smem_bytes}")
        if smem_bytes > self._smem_opt_in:
            self._opt_in_smem(smem_bytes)

        keep = []  # ctypes holders that must outlive the launch call
        pointers = _pointer_array(len(args))()
        for i, arg in enumerate(args):
            if isinstance(arg, torch.Tensor):
                if arg.get_device() != self.device_index:  # -1 for CPU tensors
                    raise ValueError(
                        f"{self.name}: argument {i} is on {arg.device}, kernel is loaded on cuda:{self.device_index}"
                    )
                holder = ctypes.c_uint64(arg.data_ptr())
                keep.append(holder)
                pointers[i] = ctypes.addressof(holder)
            elif isinstance(arg, TensorMap):
                pointers[i] = arg.address
            elif isinstance(arg, (ctypes._SimpleCData, ctypes.Structure)):
                pointers[i] = ctypes.addressof(arg)
            else:
                raise TypeError(
                    f"{self.name}: argument {i} has type {type(arg).__name__}; pass a torch tensor, a "
                    "TensorMap or a ctypes value (e.g. ctypes.c_int32(n))"
                )

        if stream is None:
            handle = current_stream(self.device_index)
        elif isinstance(stream, torch.cuda.Stream):
            handle = stream.cuda_stream
        else:
            handle = int(stream)

        cx, cy, cz = _dim3(cluster, "cluster")
        if cx * cy * cz == 1:
            code = _launch_fn()(self._handle, gx, gy, gz, bx, by, bz, smem_bytes, handle, pointers, None)
            if code == 0:
                return
            result = _driver().CUresult(code)
        else:
            if gx % cx or gy % cy or gz % cz:
                raise ValueError(f"{self.name}: grid {(gx, gy, gz)} is not a multiple of cluster {(cx, cy, cz)}")
            result = self._launch_cluster((gx, gy, gz), (bx, by, bz), (cx, cy, cz), smem_bytes, handle, pointers)
        _check(
            result,
            f"launch of {self.name} grid={(gx, gy, gz)} block={(bx, by, bz)} cluster={(cx, cy, cz)} smem={smem_bytes}",
        )

    def max_active_clusters(self, block: tuple[int, int, int], smem_bytes: int, cluster: tuple[int, int, int]) -> int:
        """How many clusters of this shape can be resident on the device at once
        (cuOccupancyMaxActiveClusters). A GPC holds whole clusters, so with large shared-memory
        footprints this can be below SMs / cluster size; a persistent grid larger than it would
        run its last clusters as a second wave."""
        self.reserve_shared_memory(smem_bytes)
        config = _launch_config((cluster[0], cluster[1], cluster[2]), block, cluster, smem_bytes, 0)
        result, count = _driver().cuOccupancyMaxActiveClusters(self._function, config)
        _check(result, f"cuOccupancyMaxActiveClusters for {self.name} block={block} cluster={cluster} smem={smem_bytes}")
        return int(count)

    def packed(self, grid: tuple[int, int, int], block: tuple[int, int, int], smem_bytes: int, pointers,
               cluster: tuple[int, int, int] = (1, 1, 1)) -> Callable[[int], None]:
        """A launcher for callers that keep their own argument array (a ``ctypes`` ``void*[]``
        pointing at each parameter's bytes, updated in place between calls): call it with a
        stream handle. Shape, shared memory and the array are fixed, so the C arguments are built
        once; a call converts only the stream (about half the cost of a typed ctypes call)."""
        self.reserve_shared_memory(smem_bytes)
        if cluster != (1, 1, 1):
            driver = _driver()
            config = _launch_config(grid, block, cluster, smem_bytes, 0)
            address = ctypes.addressof(pointers)

            def launch_cluster(stream: int) -> None:
                config.hStream = driver.CUstream(stream)
                _check(driver.cuLaunchKernelEx(config, self._function, address, 0)[0],
                       f"launch of {self.name} grid={grid} block={block} cluster={cluster} smem={smem_bytes}")

            return launch_cluster
        fn = _launch_untyped()
        head = (ctypes.c_void_p(self._handle),) + tuple(ctypes.c_uint(v) for v in (*grid, *block, smem_bytes))

        def launch(stream: int) -> None:
            code = fn(*head, ctypes.c_void_p(stream), pointers, None)
            if code:
                _check(_driver().CUresult(code), f"launch of {self.name} grid={grid} block={block} smem={smem_bytes}")

        return launch

    def _launch_cluster(self, grid, block, cluster, smem_bytes, handle, pointers):
        config = _launch_config(grid, block, cluster, smem_bytes, handle)
        (result,) = _driver().cuLaunchKernelEx(config, self._function, ctypes.addressof(pointers), 0)
        return result


def _launch_config(grid, block, cluster, smem_bytes: int, stream: int):
    """A cuLaunchKernelEx configuration with a cluster-dimension attribute."""
    driver = _driver()
    config = driver.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid
    config.blockDimX, config.blockDimY, config.blockDimZ = block
    config.sharedMemBytes = smem_bytes
    config.hStream = driver.CUstream(stream)
    attr = driver.CUlaunchAttribute()
    attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = cluster
    config.attrs = [attr]
    config.numAttrs = 1
    return config


@functools.lru_cache(maxsize=None)
def _pointer_array(n: int):
    return ctypes.c_void_p * max(n, 1)


def _dim3(value: Sequence[int] | int, what: str) -> tuple[int, int, int]:
    dims = (value,) if isinstance(value, int) else tuple(value)
    if not 1 <= len(dims) <= 3 or any(not isinstance(d, int) or d < 1 for d in dims):
        raise ValueError(f"{what} must be 1-3 positive ints, got {value!r}")
    return dims + (1,) * (3 - len(dims))  # type: ignore[return-value]


def load_function(module, name: str) -> Kernel:
    """``module.function(name)`` for torch's current device; loads the cubin once per device."""
    device_index = torch.cuda.current_device()
    key = (device_index, name)
    kernel = module._functions.get(key)
    if kernel is not None:
        return kernel
    with module._lock:
        kernel = module._functions.get(key)
        if kernel is not None:
            return kernel
        driver = _driver()
        ensure_context(device_index)
        handle = module._functions.get((device_index, None))
        if handle is None:
            result, handle = driver.cuModuleLoadData(module.cubin)
            _check(result, f"cuModuleLoadData({module.source})")
            module._functions[(device_index, None)] = handle
        result, function = driver.cuModuleGetFunction(handle, name.encode())
        _check(result, f"cuModuleGetFunction({name!r}) in {module.source} (is it declared extern \"C\"?)")
        kernel = Kernel(name, function, device_index)
        module._functions[key] = kernel
        return kernel
