"""Launching compiled Triton kernels through tmagemm.jit (tmagemm/triton/launch.py).

CPU: the kernels are compiled ahead of time for sm_90a from the same KernelCall a plan launches,
and the parameter plan is checked against the PTX Triton produced: the descriptor expansion, the
constant-1 specialization, the trailing scratch pointers, the tensor-map layouts, and refusals
for anything the path does not cover.
GPU: a direct launch gives bitwise the same output as Triton's launcher, across many operand
addresses (tensor maps retargeted), and the public API uses it.
"""


import pytest
import torch

from gemm_ref import assert_close, fp8_operands, poisoned, reference
from tmagemm import inspection, workspace
from tmagemm.configs import TritonGemmConfig
from tmagemm.triton import matmul_persistent, matmul_tma
from tmagemm.triton.host import example_args, tma_layout
from tmagemm.triton.launch import B32, B64, MAP, aot_spec, entry_params, expected_params, kernel_params, parameter_plan

F8 = torch.float8_e4m3fn
M, N, K = 256, 384, 512
CONFIG = TritonGemmConfig(128, 256, 128, 8, 3, 8)


def _call(module=matmul_tma, **options):
    args = example_args(F8, torch.bfloat16, M, N, K)
    return module.kernel_call(args, CONFIG, tma_layout(args), **options)


def _plan(art, call, positional=None):
    return parameter_plan(art.ptx, art.launch_metadata, positional or call.positional, call.operand_slots,
                          call.unspecialized)


@pytest.fixture(scope="module")
def tma_fp8():
    return inspection.compile_triton(aot_spec(_call(), "triton.tma"))


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


def test_kernel_call_derives_positions_from_the_kernel():
    call = _call()
    names = [p.name for p in kernel_params(matmul_tma.tma_gemm_kernel) if not p.is_constexpr]
    assert [names[i] for i in sorted(call.operand_slots)] == [
        "a_desc", "b_desc", "c_desc", "c_ptr", "scale_a_ptr", "scale_b_ptr", "bias_ptr"]
    assert sorted(call.operand_slots.values()) == [0, 1, 2, 2, 3, 4, 5]  # c_desc and c_ptr both take out
    assert len(call.positional) == len(names)


def test_expected_params_expand_descriptors_and_drop_constant_one():
    call = _call()
    args, slots = call.positional, call.operand_slots
    expanded = [MAP, B32, B32, B64, B64]
    ints = [a for a in args[7:] if a != 1]
    assert expected_params(args, slots) == expanded * 3 + [B64] * 3 + [B32] * len(ints)
    # Triton turns an int equal to 1 into a constant; an int past 2^31 is passed as 64 bits.
    assert expected_params(args[:-1] + (2**33,), slots)[-1] == B64
    assert "float" in expected_params(args[:-1] + (0.5,), slots)
    assert "operand 0" in expected_params(("not a tensor",) + args[1:], slots)


def test_parameter_plan_matches_the_compiled_tma_kernel(tma_fp8):
    plan = _plan(tma_fp8, _call())
    assert not isinstance(plan, str), plan
    name, n_params, slots, fixed = plan
    assert name == "tma_gemm_kernel"
    assert n_params == len(entry_params(tma_fp8.ptx)[1])
    # a, b, out (map), out (pointer), the two scales; bias is None (a constexpr).
    assert [operand for operand, _, _ in slots] == [0, 1, 2, 2, 3, 4]
    assert [maps is not None for _, _, maps in slots] == [True, True, True, False, False, False]
    # Each map is followed by its shape (i32) and strides (i64), fixed by the plan.
    values = dict(fixed)
    assert [values[i] for i in (1, 2, 3, 4)] == [M, K, K, 1]
    # The layouts are Triton's: 128-byte swizzle, boxes clamped to the 128-byte swizzle span.
    a_map, b_map, c_map = (maps.params for _, _, maps in slots[:3])
    assert (a_map.global_dims, a_map.global_strides, a_map.box_dims, a_map.swizzle) == ((K, M), (K,), (128, 128), "128B")
    assert (b_map.global_dims, b_map.box_dims) == ((K, N), (128, 256))
    assert (c_map.global_dims, c_map.global_strides, c_map.box_dims, c_map.dtype) == ((N, M), (2 * N,), (64, 128), "bfloat16")


def test_parameter_plan_refuses_a_mismatch(tma_fp8):
    call = _call()
    # The kernel was compiled with stride_cn == 1 (a constant); an argument of 2 adds a parameter.
    names = [p.name for p in kernel_params(matmul_tma.tma_gemm_kernel) if not p.is_constexpr]
    positional = list(call.positional)
    positional[names.index("stride_cn")] = 2
    assert "do not match" in _plan(tma_fp8, call, tuple(positional))
    meta = dict(tma_fp8.launch_metadata, num_ctas=2)
    assert "clusters" in parameter_plan(tma_fp8.ptx, meta, call.positional, call.operand_slots)
    meta = dict(tma_fp8.launch_metadata, tensordesc_meta=[])
    assert "tensor map" in parameter_plan(tma_fp8.ptx, meta, call.positional, call.operand_slots)


def test_aot_spec_follows_the_arguments(tma_fp8):
    spec = aot_spec(_call(), "triton.tma")
    assert spec.signature["stride_cn"] == "constexpr" and spec.constexprs["stride_cn"] == 1
    assert spec.signature["a_desc"] == "tensordesc<fp8e4nv[128, 128]>"
    assert spec.signature["bias_ptr"] == "constexpr" and spec.constexprs["bias_ptr"] is None
    assert spec.attrs["K"] == [["tt.divisibility", 16]]
    assert (spec.num_warps, spec.num_stages) == (CONFIG.num_warps, CONFIG.num_stages)


def test_device_built_maps_stay_on_tritons_launcher():
    call = _call(device_desc=True)
    art = inspection.compile_triton(aot_spec(call, "triton.tma_device"))
    assert "scratch" in _plan(art, call)


def test_persistent_kernel_plan():
    call = _call(matmul_persistent, num_sms=132)
    art = inspection.compile_triton(aot_spec(call, "triton.persistent"))
    plan = _plan(art, call)
    assert not isinstance(plan, str), plan


# ----------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["triton.tma", "triton.persistent"])
@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (17, 576, 832), (727, 577, 864), (1024, 1024, 512)])
def test_direct_launch_equals_tritons(name, m, n, k, seeded):
    from tmagemm import plan
    from tmagemm.plan import GemmArgs

    module = matmul_tma if name == "triton.tma" else matmul_persistent
    a, b = fp8_operands(m, n, k, "cuda")
    sa, sb = torch.rand(1, device="cuda") + 0.5, torch.rand(n, device="cuda") + 0.5
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    expected = poisoned((m, n), torch.bfloat16, "cuda")
    args = GemmArgs(a, b, expected, sa, sb, bias)
    config = module.heuristic(args)
    module.kernel_call(args, config, tma_layout(args)).launch()
    assert_close(expected, reference(a, b, sa, sb, bias), 1e-2, f"{name} Triton launch")
    launcher = plan.build(args, variant=name, config=config)
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
    from tmagemm import plan

    plan.clear_plans()
    n, k = 512, 1024
    for step in range(6):  # new activations each step, one weight: maps must follow the addresses
        a, b = fp8_operands(16, n, k, "cuda")
        sa, sb = torch.rand(1, device="cuda") + 0.5, torch.rand(1, device="cuda") + 0.5
        out = poisoned((16, n), torch.bfloat16, "cuda")
        tmagemm.scaled_mm(a, b, sa, sb, out=out)
        # bf16 output: ~2^-9 relative rounding per element.
        assert_close(out, reference(a, b, sa, sb), 1e-2, f"step {step}")
    assert any(p.direct for p in plan.cached_plans()), "no plan took the direct launch path"


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (16, 576, 14336), (5, 2112, 7168), (32, 1024, 512)])
def test_splitk_direct_launch_equals_tritons(m, n, k, seeded):
    """Split-K keeps M, split_k and iters_per_split unspecialized (M = 1, split 1 stay parameters)
    and takes the calling stream's workspace per call."""
    from tmagemm.plan import GemmArgs
    from tmagemm.triton import matmul_splitk

    a, b = fp8_operands(m, n, k, "cuda")
    sa, sb = torch.rand(m, device="cuda") + 0.5, torch.rand(1, device="cuda") + 0.5
    expected = poisoned((m, n), torch.bfloat16, "cuda")
    args = GemmArgs(a, b, expected, sa, sb)
    config = matmul_splitk.choose_config(m, n, k, 1, torch.cuda.get_device_properties(0).multi_processor_count)
    matmul_splitk.kernel_call(args, config, workspace.for_launch(expected, matmul_splitk.partials_needed(args, config))).launch()
    assert_close(expected, reference(a, b, sa, sb), 1e-2, "split-K via Triton's launcher")
    launcher = matmul_splitk.build(args)
    assert launcher.direct
    side = torch.cuda.Stream()
    for stream in (torch.cuda.current_stream(), side, torch.cuda.current_stream()):
        out = poisoned((m, n), torch.bfloat16, "cuda")
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            launcher(GemmArgs(a, b, out, sa, sb))
        torch.cuda.synchronize()
        assert torch.equal(out, expected)  # deterministic reduction: bitwise equal
