"""Launching Triton kernels: one declaration per kernel, Triton's launcher or a direct launch.

A kernel family describes one launch as a :class:`KernelCall`: the ``@triton.jit`` function, the
grid, every argument by parameter name, and which parameters are per-call operands (declared once,
next to the kernel, as a mapping from parameter name to an :data:`OPERAND_NAMES` slot). Everything
else is derived from that and the function's own parameter list: the positional order, the
``do_not_specialize`` positions, the signature ``tmagemm inspect`` compiles ahead of time.

Triton's ``kernel[grid](...)`` costs 30-45 us of host time per call on an H100 host: it binds and
specializes the arguments, looks the kernel up, and re-encodes every host ``TensorDescriptor``
with ``cuTensorMapEncodeTiled``. A GEMM plan already fixes everything that specialization
depends on (shapes, strides, dtypes, alignment), so :class:`DirectLaunch` asks Triton for the
compiled kernel once (``JITFunction.warmup``), loads its cubin with the driver, and then per call
only writes the operand pointers, reuses tensor maps cached per address, and calls
``cuLaunchKernel``.

The kernel's parameter list is read from its PTX ``.entry`` and checked against what the
arguments imply (per host descriptor: the 128-byte map, the shape as i32, the strides as i64;
per tensor a pointer; per int an i32/i64 unless Triton specialized it as the constant 1; then
Triton's trailing scratch pointers). Anything that does not match exactly, or that needs launch
features this path does not provide (scratch memory, clusters, cooperative grids), makes
:meth:`DirectLaunch.build` return the reason instead, and the caller keeps Triton's launcher:
never a guess about the ABI.

Programmatic dependent launch: a kernel with a ``PDL`` constexpr set by :func:`pdl` is launched
with PDL by either path (Triton's ``launch_pdl`` option; here the launch attribute of
``cuLaunchKernelEx``), and waits for the previous kernel itself (``common.wait_for_previous_kernel``).
"""

from __future__ import annotations

import ctypes
import hashlib
import re
import threading
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from .. import envs, tma
from ..jit.compiler import Module
from ..jit.runtime import stream_getter
from .common import HAS_GDC

# The per-call operand slots a kernel's parameters can be bound to, in the order a plan's launch
# receives them: GemmArgs.operands, then the split-K workspace.
OPERAND_NAMES = ("a", "b", "out", "scale_a", "scale_b", "bias", "partials", "counters")
A, B, OUT, SCALE_A, SCALE_B, BIAS, PARTIALS, COUNTERS = range(len(OPERAND_NAMES))


def pdl(out: torch.Tensor) -> bool:
    """Whether a kernel writing ``out`` is launched with programmatic dependent launch: a CUDA
    tensor (not the interpreter), ``TMAGEMM_PDL`` not 0, a Triton with grid dependency control.
    A kernel's ``PDL`` constexpr takes this value, so its launch and its device code agree."""
    return out.is_cuda and HAS_GDC and envs.pdl_enabled() and not envs.interpret()


@dataclass(frozen=True)
class KernelCall:
    """One launch of a ``@triton.jit`` kernel.

    args: every parameter by name (constexprs included); options: launch options such as
    ``num_warps`` / ``num_stages``; operands: parameter name -> operand slot (``A``, ``OUT``, ...)
    for the parameters that take a per-call tensor, or a host TensorDescriptor over one.
    """

    fn: Any
    grid: tuple[int, ...]
    args: Mapping[str, Any]
    options: Mapping[str, Any] = field(default_factory=dict)
    operands: Mapping[str, int] = field(default_factory=dict)

    def _params(self):
        return [(p.name, p) for p in kernel_params(self.fn)]

    @property
    def positional(self) -> tuple:
        """The non-constexpr arguments in the kernel's parameter order."""
        return tuple(self.args[name] for name, p in self._params() if not p.is_constexpr)

    @property
    def constexprs(self) -> dict[str, Any]:
        return {name: self.args[name] for name, p in self._params() if p.is_constexpr}

    @property
    def operand_slots(self) -> dict[int, int]:
        """Position among :attr:`positional` -> operand slot."""
        names = [name for name, p in self._params() if not p.is_constexpr]
        return {names.index(name): slot for name, slot in self.operands.items()}

    @property
    def unspecialized(self) -> frozenset:
        """Positions among :attr:`positional` of the kernel's ``do_not_specialize`` ints."""
        params = [p for _, p in self._params() if not p.is_constexpr]
        return frozenset(i for i, p in enumerate(params) if p.do_not_specialize)

    @property
    def launch_options(self) -> dict[str, Any]:
        """:attr:`options` plus ``launch_pdl`` for a kernel whose ``PDL`` constexpr is set."""
        return {**self.options, "launch_pdl": True} if self.args.get("PDL") else dict(self.options)

    def launch(self) -> None:
        """Through Triton's own launcher (any device, the interpreter, graph capture)."""
        self.fn[self.grid](**self.args, **self.launch_options)


@dataclass(frozen=True)
class KernelParam:
    """What a launch needs to know of one kernel parameter."""

    name: str
    is_constexpr: bool
    do_not_specialize: bool


def kernel_params(fn) -> list[KernelParam]:
    """The parameters of a ``@triton.jit`` function, compiled or under the interpreter (whose
    wrapper keeps only the Python function: constexprs are read from its annotations)."""
    params = getattr(fn, "params", None)
    if params is not None:
        return [KernelParam(p.name, p.is_constexpr, p.do_not_specialize) for p in params]
    import inspect

    unspecialized = set(getattr(fn, "kwargs", {}).get("do_not_specialize") or ())
    signature = inspect.signature(fn.fn)
    return [KernelParam(p.name, "constexpr" in str(p.annotation), p.name in unspecialized or i in unspecialized)
            for i, p in enumerate(signature.parameters.values())]


def direct_launch(name: str, call: KernelCall) -> "DirectLaunch | None":
    """``call``'s kernel launched through :class:`DirectLaunch`, or None to keep Triton's
    launcher (CPU, a capture in progress, the knob off, or a kernel whose ABI the direct path
    does not cover: the reason is given as a RuntimeWarning)."""
    out = next((call.args[p] for p, slot in call.operands.items() if slot == OUT and call.args[p] is not None), None)
    out = out.base if isinstance(out, TensorDescriptor) else out
    if out is None or not out.is_cuda or envs.interpret() or not envs.direct_launch_enabled():
        return None
    if torch.cuda.is_current_stream_capturing():  # the plan is not kept (plan.run_gemm): Triton's launcher serves it
        return None
    built = DirectLaunch.build(call.fn, call.grid, call.positional, call.operand_slots, call.unspecialized,
                               **call.constexprs, **call.launch_options)
    if isinstance(built, str):
        warnings.warn(f"{name}: using Triton's launcher ({built})", RuntimeWarning, stacklevel=3)
        return None
    return built


def pointer_plan(name: str, call: KernelCall):
    """The :class:`~tmagemm.plan.Plan` of ``call``'s kernel for every later call with the same
    signature, where each per-call operand is a tensor the kernel takes as a pointer: the direct
    launch where :func:`direct_launch` gives one, else Triton's launcher with that call's
    tensors in the operand parameters. Its launch takes the tensors in operand-slot order
    (:data:`OPERAND_NAMES`, None in the slots the kernel does not use)."""
    from ..plan import Plan

    fast = direct_launch(name, call)
    if fast is not None:
        return Plan(name, None, fast, fast.device_index, direct=True)

    def launch(*operands) -> None:
        replace(call, args={**call.args, **{p: operands[slot] for p, slot in call.operands.items()}}).launch()

    out = next(call.args[p] for p, slot in call.operands.items() if slot == OUT)
    return Plan(name, None, launch, out.get_device())


# ------------------------------------------------------------------ AOT specs (tmagemm inspect)

_TL_NAMES = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.float8_e4m3fn: "fp8e4nv",
    torch.float8_e5m2: "fp8e5",
    torch.int32: "i32",
}


def aot_spec(call: KernelCall, name: str):
    """The :class:`~tmagemm.inspection.KernelSpec` Triton's launcher would compile for ``call``
    (specialization as at run time: 16-byte aligned pointers and ints divisible by 16 carry the
    divisibility hint; None arguments and ints equal to 1 become constants). A ``PDL`` constexpr
    is set as on a GPU (``TMAGEMM_PDL``), whatever device the example tensors are on."""
    from ..inspection import KernelSpec

    signature, constants, attrs = {}, {}, {}
    for param in kernel_params(call.fn):
        value = call.args[param.name]
        if param.name == "PDL":
            value = HAS_GDC and envs.pdl_enabled()
        if param.is_constexpr or value is None:
            signature[param.name] = "constexpr"
            constants[param.name] = value
        elif isinstance(value, TensorDescriptor):
            block = ", ".join(str(b) for b in value.block_shape)
            signature[param.name] = f"tensordesc<{_TL_NAMES[value.base.dtype]}[{block}]>"
        elif isinstance(value, torch.Tensor):
            signature[param.name] = f"*{_TL_NAMES[value.dtype]}"
            if value.data_ptr() % 16 == 0:
                attrs[param.name] = [["tt.divisibility", 16]]
        elif isinstance(value, int) and not isinstance(value, bool):
            if value == 1 and not param.do_not_specialize:
                signature[param.name] = "constexpr"
                constants[param.name] = 1
                continue
            signature[param.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0 and not param.do_not_specialize:
                attrs[param.name] = [["tt.divisibility", 16]]
        else:
            raise TypeError(f"{name}: argument {param.name} is a {type(value).__name__}")
    return KernelSpec(call.fn, signature, constants, call.options.get("num_warps", 4),
                      call.options.get("num_stages", 3), name, attrs)


_ENTRY = re.compile(r"\.entry\s+(\w+)\s*\((.*?)\)", re.S)
_PARAM = re.compile(r"\.param\s+(?:\.align\s+(\d+)\s+)?\.(\w+)\s+(?:\.ptr\s+(?:\.\w+\s+)*)?\w+(?:\[(\d+)\])?")
_SWIZZLE = {0: "none", 1: "32B", 2: "64B", 3: "128B"}  # CUtensorMapSwizzle values Triton records
_MAPS_PER_SLOT = 4  # distinct operand addresses kept encoded per descriptor argument


@dataclass(frozen=True)
class Param:
    """One kernel parameter as the PTX declares it: "map" (128-byte tensor map), "b32" or "b64"."""

    kind: str


MAP, B32, B64 = Param("map"), Param("b32"), Param("b64")


def entry_params(ptx: str) -> tuple[str, list[Param | str]]:
    """The kernel name and parameter list of the (single) ``.entry`` in ``ptx``; a parameter this
    module cannot pass is returned as its PTX type string."""
    match = _ENTRY.search(ptx)
    if match is None:
        raise ValueError("no .entry in the PTX")
    params: list[Param | str] = []
    for align, ty, count in _PARAM.findall(match.group(2)):
        if ty == "b8" and count == "128" and align == "64":
            params.append(MAP)
        elif ty in ("u32", "s32", "b32") and not count:
            params.append(B32)
        elif ty in ("u64", "s64", "b64") and not count:
            params.append(B64)
        else:
            params.append(f".{ty}" + (f"[{count}]" if count else ""))
    return match.group(1), params


def _int_params(value: int, specialized: bool) -> list[Param]:
    if value == 1 and specialized:
        return []  # Triton turns an int equal to 1 into a constant (unless told not to specialize)
    return [B32] if -(2**31) <= value < 2**31 else [B64]


def expected_params(args: Sequence[Any], operand_slots: Mapping[int, int],
                    unspecialized: frozenset = frozenset()) -> list[Param] | str:
    """The parameters Triton generates for the positional ``args`` (without its trailing scratch
    pointers), or why this module cannot launch them. ``operand_slots``: positions of the
    per-call operands; ``unspecialized``: positions of the kernel's ``do_not_specialize`` ints."""
    out: list[Param] = []
    for i, arg in enumerate(args):
        if arg is None:
            continue
        if i in operand_slots:
            if isinstance(arg, TensorDescriptor):
                rank = len(arg.shape)
                out += [MAP] + [B32] * rank + [B64] * rank
            elif isinstance(arg, torch.Tensor):
                out.append(B64)
            else:
                return f"operand {i} is a {type(arg).__name__}, not a tensor or TensorDescriptor"
        elif isinstance(arg, int) and not isinstance(arg, bool):
            out += _int_params(arg, i not in unspecialized)
        else:
            return f"argument {i} is a {type(arg).__name__}; only ints follow the operands"
    return out


def _launch_reason(metadata) -> str | None:
    """Launch features Triton's launcher would provide and this path does not."""
    if metadata.get("num_ctas", 1) != 1:
        return "the kernel launches clusters"
    if metadata.get("launch_cooperative_grid"):
        return "the kernel needs a cooperative launch"
    if metadata.get("global_scratch_size") or metadata.get("profile_scratch_size"):
        return "the kernel needs global scratch memory (device-built tensor maps)"
    return None


def parameter_plan(ptx: str, metadata: dict, args: Sequence[Any], operand_slots: Mapping[int, int],
                   unspecialized: frozenset = frozenset()):
    """Check a compiled kernel (its PTX and :func:`tmagemm.inspection.launch_metadata`) against
    the positional arguments it was specialized for and lay out its parameters: ``(name, number
    of params, operand slots, fixed values)`` or the reason it cannot be launched here. Operand
    slots are ``(operand slot, param index, tma.MapsByAddress | None)``; fixed values ``(param
    index, int)``."""
    expected = expected_params(args, operand_slots, unspecialized)
    if isinstance(expected, str):
        return expected
    reason = _launch_reason(metadata)
    if reason:
        return reason
    name, params = entry_params(ptx)
    extra = params[len(expected):]
    if params[: len(expected)] != expected or len(extra) > 2 or any(p != B64 for p in extra):
        return f"parameters of {name} ({params}) do not match the arguments ({expected} + scratch pointers)"
    metas = list(metadata.get("tensordesc_meta") or [])
    slots, fixed, index, n_desc = [], [], 0, 0
    for pos, arg in enumerate(args):
        if arg is None:
            continue
        if isinstance(arg, TensorDescriptor):
            layout = _map_params(arg, metas[n_desc] if n_desc < len(metas) else None)
            if isinstance(layout, str):
                return layout
            n_desc += 1
            slots.append((operand_slots[pos], index, tma.MapsByAddress(layout, _MAPS_PER_SLOT)))
            rank = len(arg.shape)
            fixed += [(index + 1 + d, int(arg.shape[d])) for d in range(rank)]
            fixed += [(index + 1 + rank + d, int(arg.strides[d])) for d in range(rank)]
            index += 1 + 2 * rank
        elif isinstance(arg, torch.Tensor):
            slots.append((operand_slots[pos], index, None))
            index += 1
        elif arg != 1 or pos in unspecialized:
            fixed.append((index, int(arg)))
            index += 1
    if n_desc != len(metas):
        return f"{len(metas)} tensor maps in the kernel, {n_desc} descriptors passed"
    return name, len(params), slots, fixed


def _map_params(desc: TensorDescriptor, meta: dict | None) -> tma.TiledParams | str:
    """The tensor map Triton's launcher would encode for ``desc`` (its ``tensordesc_meta``:
    swizzle, box; interleave none, 128-byte L2 promotion, element strides 1), address left 0."""
    if not meta:
        return "Triton did not lower the descriptor to a tensor map"
    if meta.get("fp4_padded") or meta.get("is_im2col") or meta.get("swizzle") not in _SWIZZLE:
        return f"unsupported tensor-map options {meta}"
    itemsize = desc.base.element_size()
    if meta.get("elem_size") != itemsize or list(desc.strides)[-1] != 1:
        return f"tensor map element size {meta.get('elem_size')} vs {itemsize}, strides {list(desc.strides)}"
    rank = len(desc.shape)
    return tma.TiledParams(
        dtype=tma.tma_dtype(desc.base.dtype).name,
        global_address=0,
        global_dims=tuple(int(d) for d in reversed(desc.shape)),
        global_strides=tuple(int(s) * itemsize for s in reversed(list(desc.strides)[:-1])),
        box_dims=tuple(int(b) for b in reversed(meta["block_size"])),
        element_strides=(1,) * rank,
        swizzle=_SWIZZLE[meta["swizzle"]],
        l2_promotion="128B",
        oob_fill="nan" if getattr(desc, "padding", "zero") == "nan" else "zero",
    )


# Loaded kernels by (compiled kernel's hash, device): a plan for a new M that compiles to the
# same binary reuses the loaded function instead of loading the cubin again (milliseconds).
_loaded: dict[tuple, Any] = {}
_loaded_lock = threading.Lock()


def _load(compiled, name: str, device_index: int):
    key = (getattr(compiled, "hash", None) or hashlib.sha1(compiled.asm["cubin"]).hexdigest(), name, device_index)
    kernel = _loaded.get(key)
    if kernel is None:
        with _loaded_lock:
            kernel = _loaded.get(key)
            if kernel is None:
                module = Module(source=f"triton:{name}", key="", cubin=compiled.asm["cubin"], ptx="", log="",
                                compile_seconds=0.0, cache_hit=True, options=())
                kernel = _loaded[key] = module.function(name)  # loads on the current device
    return kernel


class DirectLaunch:
    """One specialization of a Triton kernel, launched with ``cuLaunchKernel`` (see the module doc).

    Called with the operand slots' tensors in :data:`OPERAND_NAMES` order (a descriptor's base
    tensor where a descriptor parameter was): ``launch(a, b, out, scale_a, scale_b, bias)``, plus
    the workspace for kernels that take one. Launches on the current stream of the device it was
    built on; the caller makes that device current (:meth:`tmagemm.plan.Plan.run` does).
    """

    def __init__(self, kernel, grid, block, smem, slots, n_params, fixed, device_index, pdl: bool = False):
        self._holders = [ctypes.c_uint64(0) for _ in range(n_params)]
        self._pointers = (ctypes.c_void_p * max(n_params, 1))()
        for i, holder in enumerate(self._holders):
            self._pointers[i] = ctypes.addressof(holder)
        for index, value in fixed:
            self._holders[index].value = value & (2**64 - 1)  # b32 params read the low half
        # Per call: pointer params get the operand's address, map params point at its map.
        self._pointer_slots = [(operand, self._holders[index]) for operand, index, maps in slots if maps is None]
        self._map_slots = [(operand, index, maps) for operand, index, maps in slots if maps is not None]
        self._launch = kernel.packed(grid, block, smem, self._pointers, pdl=pdl)
        self.pdl = pdl
        self.device_index = device_index
        self._stream = stream_getter()
        self._lock = threading.Lock()

    @classmethod
    def build(cls, fn, grid: tuple[int, ...], args: Sequence[Any], operand_slots: Mapping[int, int],
              unspecialized: frozenset = frozenset(), **kwargs) -> "DirectLaunch | str":
        """Compile (or fetch) the kernel Triton would run for ``fn[grid](*args, **kwargs)`` on the
        current device and return a DirectLaunch for it, or the reason it must stay on Triton's
        launcher. ``operand_slots``: positions of the per-call operands -> operand slot;
        ``unspecialized``: positions the kernel marks ``do_not_specialize``."""
        from ..inspection import launch_metadata

        reason = expected_params(args, operand_slots, unspecialized)
        if isinstance(reason, str):
            return reason
        compiled = fn.warmup(*args, grid=grid, **kwargs)
        metadata = launch_metadata(compiled.metadata)
        plan = parameter_plan(compiled.asm["ptx"], metadata, args, operand_slots, unspecialized)
        if isinstance(plan, str):
            return plan
        name, n_params, slots, fixed = plan
        device_index = torch.cuda.current_device()
        kernel = _load(compiled, name, device_index)
        smem = int(metadata["shared"])
        block = (32 * int(metadata["num_warps"]), 1, 1)
        grid3 = tuple(grid) + (1,) * (3 - len(grid))
        # Trailing scratch pointers stay 0: parameter_plan refused kernels that use scratch.
        return cls(kernel, grid3, block, smem, slots, n_params, fixed, device_index,
                   pdl=bool(metadata.get("launch_pdl")))

    def __call__(self, *operands: torch.Tensor | None) -> None:
        with self._lock:  # the holders and retargeted maps are shared by every call of the plan
            for operand, holder in self._pointer_slots:
                holder.value = operands[operand].data_ptr()
            for operand, index, maps in self._map_slots:
                self._pointers[index] = maps.get(operands[operand].data_ptr()).address
            self._launch(self._stream(self.device_index))
