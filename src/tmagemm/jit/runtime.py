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


# cuLaunchKernelEx's configuration, laid out as cuda.h declares it (CUlaunchAttribute: a 4-byte id,
# padding to 8, a 64-byte value union), so the hot path builds it once and calls libcuda directly.
_ATTR_CLUSTER_DIMENSION = 4  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


class _LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint * 16)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem_bytes", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


@functools.lru_cache(maxsize=1)
def _launch_ex_fn():
    fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    return fn


def launch_attributes(cluster: tuple[int, int, int], pdl: bool) -> list[tuple[int, tuple[int, ...]]]:
    """The cuLaunchKernelEx attributes of a launch: ``(id, leading words of the value)``: the
    cluster shape when it is not 1x1x1; programmatic stream serialization (PDL) when ``pdl``, so
    the kernel may start while the previous kernel in the stream drains (the kernel itself waits
    with ``griddepcontrol.wait`` before touching what that kernel writes)."""
    attributes = []
    if tuple(cluster) != (1, 1, 1):
        attributes.append((_ATTR_CLUSTER_DIMENSION, tuple(cluster)))
    if pdl:
        attributes.append((_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION, (1,)))
    return attributes


def _config_struct(grid, block, smem_bytes: int, attributes) -> _LaunchConfig:
    config = _LaunchConfig()
    config.grid[:] = grid
    config.block[:] = block
    config.shared_mem_bytes = smem_bytes
    array = (_LaunchAttribute * max(len(attributes), 1))()
    for slot, (ident, words) in zip(array, attributes):
        slot.id = ident
        slot.value[: len(words)] = words
    config.attrs = ctypes.cast(array, ctypes.POINTER(_LaunchAttribute))
    config.num_attrs = len(attributes)
    config._keep = array  # the attribute array lives as long as the config
    return config


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
        self._smem_opt_in = None  # dynamic bytes a launch may take unasked: 48 KB less the static ones
        self._lock = threading.Lock()

    def attribute(self, attribute: str) -> int:
        """A CUfunction attribute by short name, e.g. "NUM_REGS", "MAX_THREADS_PER_BLOCK"."""
        driver = _driver()
        enum = getattr(driver.CUfunction_attribute, f"CU_FUNC_ATTRIBUTE_{attribute}")
        result, value = driver.cuFuncGetAttribute(enum, self._function)
        _check(result, f"cuFuncGetAttribute({attribute})")
        return int(value)

    def reserve_shared_memory(self, smem_bytes: int) -> None:
        """Opt in to ``smem_bytes`` of dynamic shared memory ahead of :meth:`packed`: needed once
        the kernel's static and dynamic shared memory together pass 48 KB (the launch fails
        with an invalid argument otherwise)."""
        if self._smem_opt_in is None:
            static = self.attribute("SHARED_SIZE_BYTES") if self._function is not None else 0
            self._smem_opt_in = _DEFAULT_SMEM_LIMIT - static
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
        pdl: bool = False,
    ) -> None:
        """Launch on ``stream`` (default: torch's current stream of the kernel's device).

        args: torch tensors (device pointers), TensorMaps (by value), ctypes scalars/structures.
        Plain Python numbers are refused: the kernel's parameter width must be explicit.
        pdl: a programmatic dependent launch (:func:`launch_attributes`).
        """
        gx, gy, gz = _dim3(grid, "grid")
        bx, by, bz = _dim3(block, "block")
        if smem_bytes < 0:
            raise ValueError(f"smem_bytes must be >= 0, got {smem_bytes}")
        self.reserve_shared_memory(smem_bytes)

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
        if gx % cx or gy % cy or gz % cz:
            raise ValueError(f"{self.name}: grid {(gx, gy, gz)} is not a multiple of cluster {(cx, cy, cz)}")
        attributes = launch_attributes((cx, cy, cz), pdl)
        if not attributes:
            code = _launch_fn()(self._handle, gx, gy, gz, bx, by, bz, smem_bytes, handle, pointers, None)
        else:
            config = _config_struct((gx, gy, gz), (bx, by, bz), smem_bytes, attributes)
            config.stream = handle
            code = _launch_ex_fn()(ctypes.byref(config), self._handle, pointers, None)
        if code:
            _check(_driver().CUresult(code), f"launch of {self.name} grid={(gx, gy, gz)} block={(bx, by, bz)} "
                                             f"cluster={(cx, cy, cz)} smem={smem_bytes} pdl={pdl}")

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
               cluster: tuple[int, int, int] = (1, 1, 1), pdl: bool = False) -> Callable[[int], None]:
        """A launcher for callers that keep their own argument array (a ``ctypes`` ``void*[]``
        pointing at each parameter's bytes, updated in place between calls): call it with a
        stream handle. Shape, shared memory and the array are fixed, so the C arguments are built
        once; a call converts only the stream (about half the cost of a typed ctypes call).
        Clusters and ``pdl`` (:func:`launch_attributes`) go through cuLaunchKernelEx, with its
        configuration built once too."""
        self.reserve_shared_memory(smem_bytes)
        attributes = launch_attributes(cluster, pdl)
        if attributes:
            config = _config_struct(grid, block, smem_bytes, attributes)
            config_ref, handle, fn_ex = ctypes.byref(config), ctypes.c_void_p(self._handle), _launch_ex_fn()

            def launch_ex(stream: int) -> None:
                config.stream = stream
                code = fn_ex(config_ref, handle, pointers, None)
                if code:
                    _check(_driver().CUresult(code), f"launch of {self.name} grid={grid} block={block} "
                                                     f"cluster={cluster} smem={smem_bytes} pdl={pdl}")

            return launch_ex
        fn = _launch_untyped()
        head = (ctypes.c_void_p(self._handle),) + tuple(ctypes.c_uint(v) for v in (*grid, *block, smem_bytes))

        def launch(stream: int) -> None:
            code = fn(*head, ctypes.c_void_p(stream), pointers, None)
            if code:
                _check(_driver().CUresult(code), f"launch of {self.name} grid={grid} block={block} smem={smem_bytes}")

        return launch



def _launch_config(grid, block, cluster, smem_bytes: int, stream: int):
    """A cuda.bindings launch configuration with a cluster-dimension attribute (occupancy
    queries; launches use :func:`_config_struct`)."""
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
