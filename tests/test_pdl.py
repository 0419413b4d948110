"""Programmatic dependent launch (PDL) of the Triton kernels.

CPU: the launch configuration cuLaunchKernelEx receives (layout of the ctypes structures, the
attributes), when a launch asks for PDL, and the compiled kernels: each Triton GEMM family and
the quantizer wait on the previous grid (``griddepcontrol.wait``) before their first load and
let dependents launch after it; with ``TMAGEMM_PDL=0`` none of it is compiled in.

GPU: chains where every GEMM (and quantizer) consumes the previous kernel's output, eagerly and
replayed from a CUDA graph with new inputs, with PDL on and off; each step is checked against
float64 of the buffers it read, so a step that ran ahead of its producer fails. Hazards: a GEMM
whose weight is the previous GEMM's output, and a GEMM writing the buffer the previous GEMM
reads.
"""

from __future__ import annotations

import ctypes
import types

import pytest
import torch
from gemm_ref import FP8, check_product, poisoned

import tmagemm
from tmagemm import inspection, workspace
from tmagemm.jit import runtime
from tmagemm.triton import launch, matmul_grouped, matmul_splitk, matmul_tma
from tmagemm.triton.common import HAS_GDC

# ----------------------------------------------------------------------------------------------
# CPU
# ----------------------------------------------------------------------------------------------


def test_launch_config_matches_cuda_h():
    """CUlaunchAttribute: 4-byte id, padding to 8, 64-byte value; CUlaunchConfig: seven uints,
    the stream at offset 32, the attribute pointer at 40, their count at 48 (56 bytes)."""
    assert ctypes.sizeof(runtime._LaunchAttribute) == 72
    assert runtime._LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(runtime._LaunchConfig) == 56
    assert (runtime._LaunchConfig.stream.offset, runtime._LaunchConfig.attrs.offset,
            runtime._LaunchConfig.num_attrs.offset) == (32, 40, 48)


def test_launch_attributes():
    assert runtime.launch_attributes((1, 1, 1), False) == []
    assert runtime.launch_attributes((1, 1, 1), True) == [(6, (1,))]
    assert runtime.launch_attributes((2, 1, 1), True) == [(4, (2, 1, 1)), (6, (1,))]
    config = runtime._config_struct((4, 1, 1), (384, 1, 1), 1000, runtime.launch_attributes((2, 1, 1), True))
    assert (list(config.grid), list(config.block), config.shared_mem_bytes, config.num_attrs) == ([4, 1, 1], [384, 1, 1], 1000, 2)
    assert (config.attrs[0].id, list(config.attrs[0].value[:3]), config.attrs[1].id, config.attrs[1].value[0]) == (4, [2, 1, 1], 6, 1)


def test_pdl_decision(monkeypatch):
    cuda_tensor = types.SimpleNamespace(is_cuda=True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.delenv("TMAGEMM_PDL", raising=False)
    assert launch.pdl(cuda_tensor) is HAS_GDC
    monkeypatch.setenv("TMAGEMM_PDL", "0")
    assert launch.pdl(cuda_tensor) is False
    monkeypatch.setenv("TMAGEMM_PDL", "1")
    assert launch.pdl(types.SimpleNamespace(is_cuda=False)) is False
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert launch.pdl(cuda_tensor) is False


def test_launch_options_follow_the_kernels_pdl_flag():
    base = dict(num_warps=4)
    call = launch.KernelCall(matmul_tma.tma_gemm_kernel, (1,), {"PDL": True}, base)
    assert call.launch_options == {"num_warps": 4, "launch_pdl": True}
    assert launch.KernelCall(matmul_tma.tma_gemm_kernel, (1,), {"PDL": False}, base).launch_options == base


def _splitk_spec(dtype, k_major):
    from tmagemm.plan import GemmArgs

    a = torch.empty(16, 1024, dtype=dtype)
    w = torch.empty(512, 1024, dtype=dtype)
    b = w.t() if k_major else w.t().contiguous()
    out = torch.empty(16, 512, dtype=torch.bfloat16)
    scales = (torch.ones(16, 1), torch.ones(1, 512)) if dtype == FP8 else (None, None)
    args = GemmArgs(a, b, out, *scales, None, True)
    config = matmul_splitk.choose_config(16, 512, 1024, a.element_size(), 132)
    ws = workspace.for_launch(out, matmul_splitk.partials_needed(args, config))
    return launch.aot_spec(matmul_splitk.kernel_call(args, config, ws), "triton.splitk")


def _quantizer_spec():
    from tmagemm.triton import quantize

    constexprs = {**quantize.fp8_grid(), "BLOCK_R": 16, "BLOCK_K": 128, "PER_ROW": True, "POW2": False, "PDL": True}
    signature = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "R": "i32", "K": "i32", "stride_x": "i32",
                 "stride_q": "i32", "stride_s": "i32", "stride_sk": "i32", **{c: "constexpr" for c in constexprs}}
    return inspection.KernelSpec(quantize._block_quantize_kernel, signature, constexprs, 4, 3, "quantize_1x128")


def _specs():
    """(name, KernelSpec factory) per Triton GEMM family and the quantizer."""
    out = [(name, lambda name=name: inspection.triton_spec(name, "fp8"))
           for name in ("triton.tma", "triton.tma_device", "triton.persistent", "triton.blockscaled", "triton.ptr")]
    return out + [("triton.splitk fp8", lambda: _splitk_spec(FP8, True)),
                  ("triton.splitk bf16 n-major", lambda: _splitk_spec(torch.bfloat16, False)),
                  ("triton.grouped", matmul_grouped.aot_spec), ("quantize_1x128", _quantizer_spec)]


_LOADS = ("cp.async.bulk.tensor", "ld.global", "cp.async.ca", "cp.async.cg")


@pytest.mark.skipif(not HAS_GDC, reason="this Triton has no grid dependency control")
@pytest.mark.parametrize("name, spec", _specs(), ids=[s[0] for s in _specs()])
def test_compiled_kernels_wait_before_any_load(name, spec, monkeypatch):
    """One wait, ahead of every load in program order; the trigger for dependents after the
    first load (once the main loop is done); with TMAGEMM_PDL=0 neither is compiled in."""
    monkeypatch.delenv("TMAGEMM_PDL", raising=False)
    ptx = inspection.compile_triton(spec()).ptx
    body = ptx[ptx.index(".entry"):]
    assert body.count("griddepcontrol.wait") == 1, name
    wait = body.index("griddepcontrol.wait")
    loads = [body.index(load) for load in _LOADS if load in body]
    assert loads and min(loads) > wait, f"{name}: a load before griddepcontrol.wait"
    assert body.index("griddepcontrol.launch_dependents") > min(loads), name
    if name != "quantize_1x128":  # (its spec sets PDL itself; the launch takes launch.pdl)
        monkeypatch.setenv("TMAGEMM_PDL", "0")
        assert "griddepcontrol" not in inspection.compile_triton(spec()).ptx


# ----------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------

DEV = "cuda"
WIDTHS = (1024, 2048, 1152, 3072, 1024)  # every step changes width; multiples of 128 (block scales)


def _weights(kind):
    gen = torch.Generator(device=DEV).manual_seed(7)
    ws = []
    for k, n in zip(WIDTHS, WIDTHS[1:]):
        w = torch.randn(n, k, device=DEV, generator=gen) / k**0.5
        ws.append(w.to(torch.bfloat16) if kind == "bf16" else tmagemm.quantize_fp8(w, "row" if kind == "row" else "128x128"))
    return ws


def _chain(kind, ws, x0):
    """Every step reads what the step before wrote; returns [(inputs of the step, its output)]."""
    steps, x = [], x0
    for w in ws:
        if kind == "bf16":
            y = tmagemm.matmul(x, w.t())
            steps.append(((x, w.t(), None, None), y))
        else:
            (wq, sw), recipe = w, "row" if kind == "row" else "1x128"
            xq, sx = tmagemm.quantize_fp8(x, recipe, check_finite=False)
            y = tmagemm.scaled_mm(xq, wq.t(), sx, sw.t() if kind == "row" else sw)
            steps.append(((xq, wq.t(), sx, sw), y))
        x = y
    return steps


def _check_steps(kind, steps, what):
    for i, ((a, b, sa, sb), y) in enumerate(steps):
        label = f"{what} step {i}"
        if kind == "bf16":
            check_product(y, a, b, what=label)
        elif kind == "row":
            check_product(y, a, b, sa, sb.t(), what=label)
        else:  # block: dequantize with the block scales, then the fp8-operand product bound
            a_deq = a.double() * sa.double().repeat_interleave(128, dim=1)[:, : a.shape[1]]
            w = b.t().double() * sb.double().repeat_interleave(128, 0)[: b.shape[1]].repeat_interleave(128, 1)[:, : b.shape[0]]
            ref = a_deq @ w.t()
            size = a_deq.abs() @ w.abs().t()
            bad = ~((y.double() - ref).abs() <= 2.0**-8 * ref.abs() + 2.0**-9 * size)
            assert not bad.any(), f"{label}: {int(bad.sum())} elements off, first at {bad.nonzero()[0].tolist()}"


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["bf16", "row", "block"])
@pytest.mark.parametrize("m", [1, 16, 64, 200, 1024])
def test_chain_eager_and_graph(kind, m, pdl_mode):
    """Split-K (small M), the tile kernels (medium M), the persistent / native kernels (large M)
    and the quantizers, each consuming the previous kernel's output without a sync between."""
    ws = _weights(kind)
    x0 = torch.randn(m, WIDTHS[0], device=DEV, dtype=torch.bfloat16)
    steps = _chain(kind, ws, x0)  # eager (plans built here)
    torch.cuda.synchronize()
    _check_steps(kind, steps, f"{kind} M={m} {pdl_mode} eager")

    static_x = x0.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _chain(kind, ws, static_x)
    for replay in range(3):  # new inputs each replay: a step reading stale data fails its check
        static_x.copy_(torch.randn_like(static_x))
        for (a, *_), y in captured:
            y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check_steps(kind, captured, f"{kind} M={m} {pdl_mode} replay {replay}")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [16, 256])
def test_weight_made_by_the_previous_kernel(m, pdl_mode):
    """A weight written by the kernel just before (an N-major and a K-major one) is read fresh."""
    p = torch.randn(1024, 64, device=DEV, dtype=torch.bfloat16)
    q = torch.randn(64, 2048, device=DEV, dtype=torch.bfloat16)
    x = torch.randn(m, 1024, device=DEV, dtype=torch.bfloat16)
    for _ in range(3):
        w = tmagemm.matmul(p, q)  # (K, N) row-major, written just before its use
        y = tmagemm.matmul(x, w)
        wt = tmagemm.matmul(q.t(), p.t())  # (N, K): used K-major through .t()
        z = tmagemm.matmul(x, wt.t())
        torch.cuda.synchronize()
        check_product(w, p, q, what="w")
        check_product(y, x, w, what=f"y, M={m}")
        check_product(z, x, wt.t(), what=f"z, M={m}")
        p.add_(0.5)  # new weights next round


@pytest.mark.gpu
@pytest.mark.parametrize("m", [16, 256])
def test_writing_what_the_previous_kernel_reads(m, pdl_mode):
    """GEMM 2 writes the buffer GEMM 1 reads: its first write comes after GEMM 1 finished."""
    a = torch.randn(m, 2048, device=DEV, dtype=torch.bfloat16)
    w1 = torch.randn(2048, 2048, device=DEV, dtype=torch.bfloat16) / 45
    w2 = torch.randn(2048, 2048, device=DEV, dtype=torch.bfloat16) / 45
    a0 = a.clone()
    y = poisoned((m, 2048), torch.bfloat16, DEV)
    tmagemm.matmul(a, w1.t(), out=y)
    tmagemm.matmul(y, w2.t(), out=a)
    torch.cuda.synchronize()
    check_product(y, a0, w1.t(), what="y")
    check_product(a, y, w2.t(), what="a")


@pytest.mark.gpu
def test_plans_launch_with_pdl_unless_switched_off(pdl_mode):
    from tmagemm.plan import GemmArgs

    a = torch.randn(200, 1024, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(1024, 512, device=DEV, dtype=torch.bfloat16)
    out = torch.empty(200, 512, device=DEV, dtype=torch.bfloat16)
    args = GemmArgs(a, b, out, None, None, None, True)
    tile = matmul_tma.build(args)
    assert tile.direct and tile.launch.pdl is (pdl_mode == "pdl" and HAS_GDC)
    small = GemmArgs(a[:16], b, out[:16], None, None, None, True)
    config = matmul_splitk.choose_config(16, 512, 1024, 2, torch.cuda.get_device_properties(0).multi_processor_count)
    ws = workspace.for_launch(small.out, matmul_splitk.partials_needed(small, config))
    direct = launch.direct_launch("triton.splitk", matmul_splitk.kernel_call(small, config, ws))
    assert direct is not None and direct.pdl is (pdl_mode == "pdl" and HAS_GDC)
