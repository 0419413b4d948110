"""``gate_up_silu_quant``: a gated MLP's gate/up projection, SiLU-and-multiply and the 1x128 fp8
quantization of the down projection's input, in one kernel (block-scaled fp8 recipe).

    g = xq @ W_gate^T,  u = xq @ W_up^T     (1x128 x 128x128 block scales, fp32 per k-block)
    h = silu(g) * u                          (fp32, never written to memory)
    hq, hs = quantize_1x128(h)               (e4m3 + one fp32 scale per token per 128 channels)

``(hq, hs)`` is exactly the ``(a, scale_a)`` of the down projection, ``tmagemm.scaled_mm(hq,
w_down.t(), hs, w_down_scale)``: a Linear -> SiLU*mul -> Linear chain runs as quantize(x) ->
this -> scaled_mm, with no standalone quantization kernel and no 16-bit intermediate.

Layout (vLLM's and SGLang's ``gate_up_proj``): ``w`` (2I, H) e4m3 row-major, rows [0, I) the gate
projection's weight and [I, 2I) the up projection's, I a positive multiple of 128; ``sw`` (2I/128,
ceil(H/128)) fp32, one dequantization scale per 128x128 block (the two HF ``weight_scale_inv``
tensors stacked). ``xq`` (M, H) e4m3 row-major with ``sx`` (M, ceil(H/128)) fp32, what
``tmagemm.quantize_fp8(x, "1x128")`` returns.

Each call signature is checked and planned once (a key built like ``plan.call_key``, kept in the
plan layer's one cache through ``plan.remember`` / ``plan.cached``); later calls with it go
straight to the launch. While torch.compile traces, the call becomes the opaque op
``torch.ops.tmagemm.gate_up_silu_quant`` (``ops.py``). No host synchronisation: non-finite
inputs are not checked (a group holding one gets an Inf scale, as with the nn layers'
quantizer). The kernel is ``triton/gate_up.py``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .api import check_runtime_device
from .device import on_device
from .plan import Plan, cached, cached_calls, remember, tensor_key

FP8 = torch.float8_e4m3fn
GROUP = 128  # channels per 1x128 group of h = rows per 128x128 weight block = k-block depth
_ALIGN = 16  # bytes: TMA row strides and base addresses


class GateUpArgs(NamedTuple):
    """Checked operands of one fused gate/up call (the problem a plan is built for).

    xq (M, H) e4m3, sx (M, KB) fp32, w (2I, H) e4m3, sw (2I/128, KB) fp32 (KB = ceil(H/128); scales
    with any strides); the outputs hq (M, I) e4m3 (contiguous rows, 16-byte row stride) and hs
    (M, I/128) fp32 (any strides); pow2_scale: h's scales rounded up to powers of two.
    """

    xq: torch.Tensor
    sx: torch.Tensor
    w: torch.Tensor
    sw: torch.Tensor
    hq: torch.Tensor
    hs: torch.Tensor
    pow2_scale: bool = False

    @property
    def m(self) -> int:
        return self.xq.shape[0]

    @property
    def h(self) -> int:
        return self.xq.shape[1]

    @property
    def i(self) -> int:
        return self.w.shape[0] // 2

    @property
    def operands(self) -> tuple:
        """What a gate/up plan's launch takes: ``(xq, w, hq, sx, sw, hs)`` (the plan layer's
        operand slots a, b, out, scale_a, scale_b, then hs in the sixth)."""
        return self.xq, self.w, self.hq, self.sx, self.sw, self.hs


# ---------------------------------------------------------------------------------- checks


def _tensor(t, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def _fp8_rows(t, name: str, hint: str) -> None:
    """An e4m3 matrix read through TMA: 2-D, contiguous rows, 16-byte row stride."""
    _tensor(t, name)
    if t.dtype != FP8:
        raise TypeError(f"{name} must be float8_e4m3fn, got {t.dtype}; {hint}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    rows, cols = t.shape
    if cols > 1 and t.stride(1) != 1:
        raise ValueError(f"{name} must be row-major (stride(1) == 1), got stride {tuple(t.stride())}")
    if rows > 1 and cols > 0 and t.stride(0) % _ALIGN:
        raise ValueError(f"{name} row stride of {t.stride(0)} bytes is not a multiple of {_ALIGN} (TMA); store it "
                         f"with rows padded to 16 bytes, as tmagemm.quantize_fp8 does")


def _scale(t, name: str, shape: tuple, what: str) -> None:
    _tensor(t, name)
    if t.dtype != torch.float32:
        raise TypeError(f"{name} must be float32 (dequantization scales), got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}; {what} needs {shape}")


def check(xq, sx, w, sw, pow2_scale=False, out=None) -> None:
    """The argument checks of :func:`gate_up_silu_quant` (shapes, strides, dtypes, devices: no
    data read, so they also run while torch.compile traces); TypeError / ValueError naming the
    argument at fault."""
    _fp8_rows(xq, "xq", "quantize the activation with tmagemm.quantize_fp8(x, '1x128')")
    _fp8_rows(w, "w", "quantize the weight with tmagemm.quantize_fp8(w, '128x128')")
    m, h = xq.shape
    rows, w_h = w.shape
    if w_h != h:
        raise ValueError(f"w has shape {tuple(w.shape)} but xq has shape {tuple(xq.shape)}: w.shape[1] must equal "
                         f"the hidden size H = {h}")
    if rows == 0 or rows % (2 * GROUP):
        raise ValueError(f"w has {rows} rows; it must stack [W_gate; W_up] with the intermediate size I = rows / 2 "
                         f"a positive multiple of {GROUP} (I = {rows / 2:g})")
    kb, i = -(-h // GROUP), rows // 2
    _scale(sx, "sx", (m, kb), "1x128 activation scaling (one per token per 128 columns of xq)")
    _scale(sw, "sw", (rows // GROUP, kb), "128x128 weight scaling (one per 128x128 block of w)")
    if not isinstance(pow2_scale, bool):
        raise TypeError(f"pow2_scale must be a bool, got {type(pow2_scale).__name__}")
    dev = xq.device
    named = {"sx": sx, "w": w, "sw": sw}
    if out is not None:
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise TypeError(f"out must be a (hq, hs) pair of tensors, got {type(out).__name__}")
        hq, hs = out
        _fp8_rows(hq, "out[0] (hq)", "hq holds the quantized h")
        if tuple(hq.shape) != (m, i):
            raise ValueError(f"out[0] (hq) has shape {tuple(hq.shape)}; the result is ({m}, {i})")
        _scale(hs, "out[1] (hs)", (m, i // GROUP), "h's 1x128 scales")
        named.update({"out[0] (hq)": hq, "out[1] (hs)": hs})
    for name, t in named.items():
        if t.device != dev:
            raise ValueError(f"{name} is on {t.device} but xq is on {dev}; move all tensors to one device")


def make_args(xq, sx, w, sw, pow2_scale=False, out=None) -> GateUpArgs:
    """The problem of checked arguments, ``out`` allocated when None (hq contiguous, as the
    quantizer's: its rows of I bytes are whole 16-byte chunks)."""
    m, i = xq.shape[0], w.shape[0] // 2
    if out is None:
        out = (torch.empty(m, i, dtype=FP8, device=xq.device),
               torch.empty(m, i // GROUP, dtype=torch.float32, device=xq.device))
    return GateUpArgs(xq, sx, w, sw, out[0], out[1], pow2_scale)


def _runtime_reason(args: GateUpArgs) -> str | None:
    """What only real tensors tell (base addresses), checked when a signature is first planned
    (the call key holds each address modulo 16)."""
    for t, name in ((args.xq, "xq"), (args.w, "w"), (args.hq, "out[0] (hq)")):
        if t.data_ptr() % _ALIGN:
            return f"{name}.data_ptr() is not {_ALIGN}-byte aligned (TMA); pass a tensor that starts on 16 bytes"
    return None


# ---------------------------------------------------------------------------------- execution


class _Call:
    """One cached call signature: its plan and the outputs it allocates."""

    __slots__ = ("plan", "m", "i", "device")

    def __init__(self, plan: Plan, args: GateUpArgs):
        self.plan, self.m, self.i, self.device = plan, args.m, args.i, args.hq.device

    def __call__(self, xq, sx, w, sw, out):
        if out is None:
            hq = torch.empty(self.m, self.i, dtype=FP8, device=self.device)
            hs = torch.empty(self.m, self.i // GROUP, dtype=torch.float32, device=self.device)
        else:
            hq, hs = out
        self.plan.run(xq, w, hq, sx, sw, hs)
        return hq, hs


def run(args: GateUpArgs, config=None, key=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Write the checked call into ``args.hq`` / ``args.hs`` and return them, planning once per
    ``key`` (None: do not remember). ``config`` overrides the heuristic (tests, benchmarks).
    M of zero returns without a kernel; H of zero gives h = 0: zeros and the smallest normal
    scale, what the quantizer gives an all-zero group. Plans made during CUDA-graph capture are
    not kept (a capture cannot load modules, so they use Triton's launcher)."""
    if args.xq.device.type == "meta":
        return args.hq, args.hs
    check_runtime_device(args.xq.device, args.xq.dtype)
    if args.m == 0:
        return args.hq, args.hs
    if args.h == 0:
        args.hq.zero_()
        args.hs.fill_(torch.finfo(torch.float32).tiny)
        return args.hq, args.hs
    reason = _runtime_reason(args)
    if reason:
        raise ValueError(f"gate_up_silu_quant: {reason}")
    from .triton import gate_up

    with on_device(args.hq.device):
        plan = gate_up.build(args, config)
    plan.run(*args.operands)
    if key is not None and not (args.hq.is_cuda and torch.cuda.is_current_stream_capturing()):
        remember(key, _Call(plan, args))
    return args.hq, args.hs


def cached_plans() -> list[Plan]:
    """The plans of the cached gate/up call signatures (in the plan layer's one cache)."""
    return [call.plan for call in cached_calls() if isinstance(call, _Call)]


# ---------------------------------------------------------------------------------- public API


def gate_up_silu_quant(xq: torch.Tensor, sx: torch.Tensor, w: torch.Tensor, sw: torch.Tensor, *,
                       pow2_scale: bool = False,
                       out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused gate/up projection of a gated MLP: ``quantize_1x128(silu(x @ W_gate^T) * (x @ W_up^T))``.

    xq: (M, H) float8_e4m3fn, row-major, row stride a multiple of 16 bytes; sx: (M, ceil(H/128))
    float32, its 1x128 dequantization scales (``tmagemm.quantize_fp8(x, "1x128")`` gives both).
    w: (2I, H) float8_e4m3fn row-major, ``[W_gate; W_up]`` stacked (vLLM's ``gate_up_proj``), I a
    positive multiple of 128; sw: (2I/128, ceil(H/128)) float32, one scale per 128x128 block of w
    (the gate and up layers' ``weight_scale_inv`` stacked). Scales may have any strides.
    Each 128-deep k-block's fp8 product is added into fp32 with ``sx[m, kb] * sw[j, kb]``, as in
    ``tmagemm.scaled_mm``'s block recipe; ``h = silu(g) * u`` is formed in fp32 and quantized per
    token per 128 channels exactly like ``quantize_fp8(h, "1x128")`` (scale = amax / 448, at least
    the smallest normal float; values rounded to nearest even; ``pow2_scale`` rounds scales up to
    powers of two).

    Returns ``(hq, hs)``: hq (M, I) float8_e4m3fn (contiguous), hs (M, I/128) float32, with
    ``h ~= hq * hs.repeat_interleave(128, 1)``: the ``(a, scale_a)`` of the down projection's
    ``tmagemm.scaled_mm(hq, w_down.t(), hs, w_down_scale)``. out: a preallocated (hq, hs) pair
    (hq row-major with a 16-byte row stride, hs any strides), written and returned.
    Raises TypeError / ValueError naming the argument at fault. No host synchronisation; works
    under torch.compile(fullgraph=True) (``torch.ops.tmagemm.gate_up_silu_quant``) and in CUDA
    graphs. Needs a Hopper GPU (CPU tensors only under the Triton interpreter).
    """
    compiling = torch.compiler.is_compiling()
    key = None
    if not compiling:
        try:
            outs = None if out is None else tuple(tensor_key(t) for t in out)
            key = ("gate_up_silu_quant", tensor_key(xq), tensor_key(sx), tensor_key(w), tensor_key(sw), outs,
                   pow2_scale)
            known = cached(key)
        except (AttributeError, TypeError):  # not tensors, or unhashable options: the checks say why
            key = known = None
        if known is not None:
            return known(xq, sx, w, sw, out)
    check(xq, sx, w, sw, pow2_scale, out)
    if compiling:
        if out is None:
            return torch.ops.tmagemm.gate_up_silu_quant(xq, sx, w, sw, pow2_scale)
        torch.ops.tmagemm.gate_up_silu_quant_out(xq, sx, w, sw, pow2_scale, out[0], out[1])
        return out[0], out[1]
    return run(make_args(xq, sx, w, sw, pow2_scale, out), key=key)


def example_args(m: int = 16, h: int = 4096, i: int = 14336) -> GateUpArgs:
    """CPU operands as a Llama-3-8B MLP passes them at decode (for ahead-of-time compile specs)."""
    kb = -(-h // GROUP)
    return make_args(torch.empty(m, h, dtype=FP8), torch.ones(m, kb), torch.empty(2 * i, h, dtype=FP8),
                     torch.ones(2 * i // GROUP, kb))
