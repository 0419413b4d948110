"""Launching compiled Triton kernels through tmagemm.jit (tmagemm/triton/direct.py).

CPU: the kernels are compiled ahead of time for sm_90a and the parameter plan is checked against
the PTX Triton produced: the descriptor expansion, the constant-1 specialization, the trailing
scratch pointers, the tensor-map layouts, and refusals for anything the path does not cover.
GPU: a direct launch gives bitwise the same output as Triton's launcher, across many operand
addresses (tensor maps retargeted), and the public API uses it.
"""

import dataclasses

import pytest
import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from gemm_ref import assert_close, fp8_operands, poisoned, reference
from tmagemm import inspection
from tmagemm.triton import matmul_persistent, matmul_tma
from tmagemm.triton.direct import B32, B64, MAP, entry_params, expected_params, parameter_plan

F8 = torch.float8_e4m3fn
M, N, K = 256, 384, 512


def _host_args(stride_cn=2):
    """Arguments shaped like the AOT spec of the fp8 TMA kernels (a row-major, b = w.t())."""
    a = torch.empty(M, K, dtype=F8)
    w = torch.empty(N, K, dtype=F8)
    out = torch.empty(M, N, dtype=torch.bfloat16)
    sa, sb = torch.empty(1), torch.empty(1)
    descs = (
        TensorDescriptor(a, [M, K], [K, 1], [128, 128]),
        TensorDescriptor(w, [N, K], [K, 1], [256, 128]),
        TensorDescriptor(out, [M, N], [N, 1], [128, 256]),
    )
    return descs + (out, sa, sb, None, M, N, K, N, stride_cn)


@pytest.fixture(scope="module")
def tma_fp8():
    return inspection.compile_triton(matmul_tma.aot_spec())


def test_entry_params_reads_maps_scalars_and_pointers():
    ptx = """
    .visible .entry k(
        .param .align 64 .b8 k_param_0[128],
        .param .u32 k_param_1,
        .param .u64 .ptr .global .align 16 k_param_2,
        .param .u64 k_param_3,
        .param .f32 k_param_4
    )"""
    name, params = entry_params(ptx)
    assert name == "k"
    assert params == [MAP, B32, B64, B64, ".f32"]
    with pytest.raises(ValueError, match="no .entry"):
        entry_params("// nothing")


def test_expected_params_expand_descriptors_and_drop_constant_one():
    args = _host_args()
    expanded = [MAP, B32, B32, B64, B64]
    assert expected_params(args, 7) == expanded * 3 + [B64] * 3 + [B32] * 5
    # Triton turns an int equal to 1 into a constant; an int past 2^31 is passed as 64 bits.
    assert expected_params(args[:-1] + (1,), 7) == expanded * 3 + [B64] * 3 + [B32] * 4
    assert expected_params(args[:-1] + (2**33,), 7)[-1] == B64
    assert "float" in expected_params(args[:-1] + (0.5,), 7)
    assert "operand 0" in expected_params(("not a tensor",) + args[1:], 7)


def test_parameter_plan_matches_the_compiled_tma_kernel(tma_fp8):
    args = _host_args()
    plan = parameter_plan(tma_fp8.ptx, tma_fp8.launch_metadata, args + (0, 0), 7)
    assert not isinstance(plan, str), plan
    name, n_params, slots, fixed = plan
    assert name == "tma_gemm_kernel"
    assert n_params == len(entry_params(tma_fp8.ptx)[1])
    # a, b, out (map), out (pointer), the two scales; bias is None (a constexpr).
    assert [pos for pos, _, _ in slots] == [0, 1, 2, 3, 4, 5]
    assert [slot is not None for _, _, slot in slots] == [True, True, True, False, False, False]
    # Each map is followed by its shape (i32) and strides (i64), fixed by the plan.
    values = dict(fixed)
    assert [values[i] for i in (1, 2, 3, 4)] == [M, K, K, 1]
    # The layouts are Triton's: 128-byte swizzle, boxes clamped to the 128-byte swizzle span.
    a_map, b_map, c_map = (slot.params for _, _, slot in slots[:3])
    assert (a_map.global_dims, a_map.global_strides, a_map.box_dims, a_map.swizzle) == ((K, M), (K,), (128, 128), "128B")
    assert (b_map.global_dims, b_map.box_dims) == ((K, N), (128, 256))
    assert (c_map.global_dims, c_map.global_strides, c_map.box_dims, c_map.dtype) == ((N, M), (2 * N,), (64, 128), "bfloat16")


def test_parameter_plan_refuses_a_mismatch(tma_fp8):
    # The spec compiled stride_cn as an i32; arguments that would specialize it away do not match.
    args = _host_args(stride_cn=1) + (0, 0)
    assert "do not match" in parameter_plan(tma_fp8.ptx, tma_fp8.launch_metadata, args, 7)
    meta = dict(tma_fp8.launch_metadata, num_ctas=2)
    assert "clusters" in parameter_plan(tma_fp8.ptx, meta, _host_args() + (0, 0), 7)
    meta = dict(tma_fp8.launch_metadata, tensordesc_meta=[])
    assert "tensor map" in parameter_plan(tma_fp8.ptx, meta, _host_args() + (0, 0), 7)


def test_constant_one_argument_is_left_out(tma_fp8):
    spec = matmul_tma.aot_spec()
    spec = dataclasses.replace(
        spec,
        signature=dict(spec.signature, stride_cn="constexpr"),
        constexprs=dict(spec.constexprs, stride_cn=1),
    )
    art = inspection.compile_triton(spec)
    plan = parameter_plan(art.ptx, art.launch_metadata, _host_args(stride_cn=1) + (0, 0), 7)
    assert not isinstance(plan, str), plan
    assert plan[1] == len(entry_params(tma_fp8.ptx)[1]) - 1


def test_device_built_maps_stay_on_tritons_launcher():
    art = inspection.compile_triton(matmul_tma.aot_spec(variant="triton.tma_device"))
    a, w = torch.empty(M, K, dtype=F8), torch.empty(N, K, dtype=F8)
    args = (a, w.t(), None, torch.empty(M, N, dtype=torch.bfloat16), torch.empty(1), torch.empty(1), None,
            M, N, K, N, 2, K, K)
    assert "scratch" in parameter_plan(art.ptx, art.launch_metadata, args, 7)


def test_persistent_kernel_plan():
    art = inspection.compile_triton(matmul_persistent.aot_spec())
    a = torch.empty(M, K, dtype=F8)
    w = torch.empty(N, K, dtype=F8)
    out = torch.empty(M, N, dtype=torch.bfloat16)
    args = (
        TensorDescriptor(a, [M, K], [K, 1], [128, 128]),
        TensorDescriptor(w, [N, K], [K, 1], [256, 128]),
        TensorDescriptor(out, [M, N], [N, 1], [128, 128]),
        out, torch.empty(1), torch.empty(1), None, M, N, K, N, 2,
    )
    plan = parameter_plan(art.ptx, art.launch_metadata, args, 7)
    assert not isinstance(plan, str), plan


# ----------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["triton.tma", "triton.persistent"])
@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (17, 576, 832), (727, 577, 864), (1024, 1024, 512)])
def test_direct_launch_equals_tritons(name, m, n, k, seeded):
    from tmagemm import dispatch
    from tmagemm.dispatch import GemmArgs
    from tmagemm.triton.host import tma_layout, triton_launch

    variant = dispatch.get(name)
    module = matmul_tma if name == "triton.tma" else matmul_persistent
    a, b = fp8_operands(m, n, k, "cuda")
    sa, sb = torch.rand(1, device="cuda") + 0.5, torch.rand(n, device="cuda") + 0.5
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    expected = poisoned((m, n), torch.bfloat16, "cuda")
    args = GemmArgs(a, b, expected, sa, sb, bias)
    config = module.heuristic(args)
    triton_launch(module.kernel_call(args, config, tma_layout(args)))
    assert_close(expected, reference(a, b, sa, sb, bias), 1e-2, f"{name} Triton launch")
    launcher = variant.prepare(args, config)
    assert launcher.direct, "the direct path refused a kernel it is meant to launch"
    # Many output buffers: more addresses than map slots, so maps get retargeted.
    for _ in range(7):
        out = poisoned((m, n), torch.bfloat16, "cuda")
        launcher(GemmArgs(a, b, out, sa, sb, bias))
        torch.cuda.synchronize()
        assert torch.equal(out, expected)


@pytest.mark.gpu
def test_api_uses_direct_launch_and_tracks_new_operands(seeded):
    import tmagemm
    from tmagemm import dispatch

    dispatch.clear_plans()
    n, k = 512, 1024
    for step in range(6):  # new activations each step, one weight: maps must follow the addresses
        a, b = fp8_operands(16, n, k, "cuda")
        sa, sb = torch.rand(1, device="cuda") + 0.5, torch.rand(1, device="cuda") + 0.5
        out = poisoned((16, n), torch.bfloat16, "cuda")
        tmagemm.scaled_mm(a, b, sa, sb, out=out)
        # bf16 output: ~2^-9 relative rounding per element.
        assert_close(out, reference(a, b, sa, sb), 1e-2, f"step {step}")
    launchers = [p for p in dispatch._plans.values() if getattr(p, "direct", False)]
    assert launchers, "no plan took the direct launch path"


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (16, 576, 14336), (5, 2112, 7168), (32, 1024, 512)])
def test_splitk_direct_launch_equals_tritons(m, n, k, seeded):
    """Split-K keeps M, split_k and iters_per_split unspecialized (M = 1, split 1 stay parameters)
    and takes the calling stream's workspace per call."""
    from tmagemm.dispatch import GemmArgs
    from tmagemm.triton import matmul_splitk

    a, b = fp8_operands(m, n, k, "cuda")
    sa, sb = torch.rand(m, device="cuda") + 0.5, torch.rand(1, device="cuda") + 0.5
    expected = poisoned((m, n), torch.bfloat16, "cuda")
    matmul_splitk.run(GemmArgs(a, b, expected, sa, sb))
    assert_close(expected, reference(a, b, sa, sb), 1e-2, "split-K via Triton's launcher")
    launcher = matmul_splitk.prepare(GemmArgs(a, b, expected, sa, sb))
    assert launcher.direct
    side = torch.cuda.Stream()
    for stream in (torch.cuda.current_stream(), side, torch.cuda.current_stream()):
        out = poisoned((m, n), torch.bfloat16, "cuda")
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            launcher(GemmArgs(a, b, out, sa, sb))
        torch.cuda.synchronize()
        assert torch.equal(out, expected)  # deterministic reduction: bitwise equal
