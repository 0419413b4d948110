"""Launching a compiled Triton kernel through ``tmagemm.jit`` instead of Triton's launcher.

Triton's ``kernel[grid](...)`` costs 30-45 us of host time per call on an H100 host: it binds and
specializes the arguments, looks the kernel up, and re-encodes every host ``TensorDescriptor``
with ``cuTensorMapEncodeTiled`` (the seed's end-to-end finding, still true today). A GEMM plan
already fixes everything that specialization depends on (shapes, strides, dtypes, alignment), so
:class:`DirectLaunch` asks Triton for the compiled kernel once (``JITFunction.warmup``), loads its
cubin with the driver, and then per call only writes the operand pointers, reuses tensor maps
cached per address, and calls ``cuLaunchKernel``.

The kernel's parameter list is read from its PTX ``.entry`` and checked against what the
arguments imply (per host descriptor: the 128-byte map, the shape as i32, the strides as i64;
per tensor a pointer; per int an i32/i64 unless Triton specialized it as the constant 1; then
Triton's trailing scratch pointers). Anything that does not match exactly, or that needs launch
features this path does not provide (scratch memory, clusters, PDL), makes :meth:`build` return
the reason instead, and the caller keeps Triton's launcher: never a guess about the ABI.
"""

from __future__ import annotations

import ctypes
import re
import threading
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from .. import tma
from ..inspection import launch_metadata
from ..jit.compiler import Module
from ..jit.runtime import stream_getter

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


def expected_params(args: Sequence[Any], n_operands: int, unspecialized: frozenset = frozenset()) -> list[Param] | str:
    """The parameters Triton generates for ``args`` (without its trailing scratch pointers), or
    why this module cannot launch them. ``unspecialized``: positions of the kernel's
    ``do_not_specialize`` ints."""
    out: list[Param] = []
    for i, arg in enumerate(args):
        if arg is None:
            continue
        if i < n_operands:
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
    if metadata.get("launch_cooperative_grid") or metadata.get("launch_pdl"):
        return "the kernel needs a cooperative or programmatic-dependent launch"
    if metadata.get("global_scratch_size") or metadata.get("profile_scratch_size"):
        return "the kernel needs global scratch memory (device-built tensor maps)"
    return None


def parameter_plan(ptx: str, metadata: dict, args: Sequence[Any], n_operands: int,
                   unspecialized: frozenset = frozenset()):
    """Check a compiled kernel (its PTX and :func:`tmagemm.inspection.launch_metadata`) against
    the arguments it was specialized for and lay out its parameters: ``(name, number of params, operand slots, fixed values)`` or the reason it cannot
    be launched here. Operand slots are ``(position in args, param index, tma.MapsByAddress | None)``;
    fixed values ``(param index, int)``."""
    expected = expected_params(args, n_operands, unspecialized)
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
            slots.append((pos, index, tma.MapsByAddress(layout, _MAPS_PER_SLOT)))
            rank = len(arg.shape)
            fixed += [(index + 1 + d, int(arg.shape[d])) for d in range(rank)]
            fixed += [(index + 1 + rank + d, int(arg.strides[d])) for d in range(rank)]
            index += 1 + 2 * rank
        elif isinstance(arg, torch.Tensor):
            slots.append((pos, index, None))
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


class DirectLaunch:
    """One specialization of a Triton kernel, launched with ``cuLaunchKernel`` (see the module doc).

    The first ``n_operands`` positional arguments are the per-call operands (tensors or host
    TensorDescriptors over a tensor, or None); everything after them is fixed by the plan. Call
    it with the operands' tensors in the same positions (a descriptor's base tensor where a
    descriptor was): ``launch(a, b, out, out, scale_a, scale_b, bias)``.
    """

    def __init__(self, kernel, grid, block, smem, slots, n_params, fixed, device_index):
        self._holders = [ctypes.c_uint64(0) for _ in range(n_params)]
        self._pointers = (ctypes.c_void_p * max(n_params, 1))()
        for i, holder in enumerate(self._holders):
            self._pointers[i] = ctypes.addressof(holder)
        for index, value in fixed:
            self._holders[index].value = value & (2**64 - 1)  # b32 params read the low half
        # Per call: pointer params get the operand's address, map params point at its map.
        self._pointer_slots = [(pos, self._holders[index]) for pos, index, slot in slots if slot is None]
        self._map_slots = [(pos, index, slot) for pos, index, slot in slots if slot is not None]
        self._launch = kernel.packed(grid, block, smem, self._pointers)
        self._device_index = device_index
        self._other_devices = torch.cuda.device_count() > 1
        self._stream = stream_getter()
        self._lock = threading.Lock()

    @classmethod
    def build(cls, fn, grid: tuple[int, ...], args: Sequence[Any], n_operands: int, unspecialized: frozenset = frozenset(),
              **kwargs) -> "DirectLaunch | str":
        """Compile (or fetch) the kernel Triton would run for ``fn[grid](*args, **kwargs)`` and
        return a DirectLaunch for it, or the reason it must stay on Triton's launcher.
        ``unspecialized``: argument positions the kernel marks ``do_not_specialize``."""
        reason = expected_params(args, n_operands, unspecialized)
        if isinstance(reason, str):
            return reason
        compiled = fn.warmup(*args, grid=grid, **kwargs)
        metadata = launch_metadata(compiled.metadata)
        plan = parameter_plan(compiled.asm["ptx"], metadata, args, n_operands, unspecialized)
        if isinstance(plan, str):
            return plan
        name, n_params, slots, fixed = plan
        module = Module(source=f"triton:{name}", key="", cubin=compiled.asm["cubin"], ptx="", log="",
                        compile_seconds=0.0, cache_hit=True, options=())
        kernel = module.function(name)  # loaded on torch's current device, which launches it
        smem = int(metadata["shared"])
        block = (32 * int(metadata["num_warps"]), 1, 1)
        grid3 = tuple(grid) + (1,) * (3 - len(grid))
        # Trailing scratch pointers stay 0: parameter_plan refused kernels that use scratch.
        return cls(kernel, grid3, block, smem, slots, n_params, fixed, torch.cuda.current_device())

    def __call__(self, *operands: torch.Tensor | None) -> None:
        if self._other_devices and torch.cuda.current_device() != self._device_index:
            with torch.cuda.device(self._device_index):  # the function lives in that device's context
                return self(*operands)
        with self._lock:  # the holders and retargeted maps are shared by every call of the plan
            for pos, holder in self._pointer_slots:
                holder.value = operands[pos].data_ptr()
            for pos, index, slot in self._map_slots:
                self._pointers[index] = slot.get(operands[pos].data_ptr()).address
            self._launch(self._stream(self._device_index))
