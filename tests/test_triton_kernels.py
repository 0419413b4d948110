"""Every Triton GEMM variant against a float64 reference.

Runs under the Triton interpreter on CPU (fp16 and fp8; the interpreter's bf16 dot is wrong, so
bf16 runs only on a GPU) and compiled on a Hopper GPU. Outputs are poisoned with NaN first.
"""

import pytest
import torch
from gemm_ref import assert_close, fp8_operands, poisoned, reference

from tmagemm import plan
from tmagemm.configs import TritonGemmConfig
from tmagemm.plan import GemmArgs
from tmagemm.triton import host, matmul_tma

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# CPU: the Triton interpreter (CI); GPU: every case on CUDA (the GPU job's `-m "gpu or anydevice"`).
pytestmark = pytest.mark.anydevice
ON_GPU = DEVICE == "cuda"
VARIANTS = ["triton.tma", "triton.tma_device", "triton.persistent", "triton.ptr"]
# Ragged against every tile size used below: M=1 and 17, N and K off 32/64/128.
SHAPES = [(1, 48, 64), (17, 40, 96), (130, 72, 144)]
TOL = {torch.float32: 2e-4, torch.float16: 1.5e-3, torch.bfloat16: 6e-3}
HALF_DTYPES = [torch.float16] + ([torch.bfloat16] if ON_GPU else [])
# Small tiles keep the interpreter fast and make every test shape span several tiles.
SMALL = TritonGemmConfig(block_m=32, block_n=32, block_k=32, group_m=2, num_stages=2, num_warps=4)
SMALL_SUBTILE = TritonGemmConfig(32, 32, 32, 2, 2, 4, epilogue_subtile=True)


def _layout(t: torch.Tensor, row_major: bool, pad: int = 0) -> torch.Tensor:
    """The same values stored row- or column-major, the leading dim padded by ``pad`` elements and
    then up to 16 bytes (as an allocator for TMA would) so TMA can describe it."""
    rows, cols = t.shape
    per_16b = 16 // t.element_size()
    pad += -((cols if row_major else rows) + pad) % per_16b
    if row_major:
        buf = torch.empty(rows, cols + pad, dtype=t.dtype, device=t.device)
        view = buf[:, :cols]
    else:
        buf = torch.empty(cols, rows + pad, dtype=t.dtype, device=t.device)
        view = buf[:, :rows].t()
    view.copy_(t)
    return view


def _run(name, args, config=SMALL):
    variant = plan.get(name)
    assert variant.supports(args) is None, variant.supports(args)
    built = plan.build(args, variant=name, config=config)
    assert built.variant == name and built.config == config
    built(args)


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("a_row,b_row", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_half_layouts(name, dtype, a_row, b_row, m, n, k, seeded):
    a = _layout(torch.randn(m, k, device=DEVICE).to(dtype), a_row)
    b = _layout(torch.randn(k, n, device=DEVICE).to(dtype), b_row)
    out = poisoned((m, n), torch.float32, DEVICE)
    _run(name, GemmArgs(a, b, out))
    assert_close(out, reference(a, b), TOL[torch.float32], f"{name} {dtype} a_row={a_row} b_row={b_row}")


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scales", ["tensor", "row", "mixed"])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_fp8_epilogue(name, out_dtype, scales, with_bias, m, n, k, seeded):
    a, b = fp8_operands(m, n, k, DEVICE)
    row_a = scales in ("row", "mixed")
    row_b = scales == "row"
    sa = torch.rand(m if row_a else 1, device=DEVICE) + 0.5
    sb = torch.rand(n if row_b else 1, device=DEVICE) + 0.5
    bias = torch.randn(n, device=DEVICE).to(torch.bfloat16) if with_bias else None
    out = poisoned((m, n), out_dtype, DEVICE)
    config = SMALL_SUBTILE if name == "triton.persistent" else SMALL
    _run(name, GemmArgs(a, b, out, sa, sb, bias), config)
    assert_close(out, reference(a, b, sa, sb, bias), TOL[out_dtype], f"{name} fp8 -> {out_dtype}")


@pytest.mark.parametrize("name", VARIANTS)
def test_fp8_e5m2_a(name, seeded):
    a, b = fp8_operands(33, 64, 96, DEVICE, a_dtype=torch.float8_e5m2)
    sa, sb = torch.tensor([0.5], device=DEVICE), torch.tensor([2.0], device=DEVICE)
    out = poisoned((33, 64), torch.float32, DEVICE)
    _run(name, GemmArgs(a, b, out, sa, sb))
    assert_close(out, reference(a, b, sa, sb), TOL[torch.float32], f"{name} e5m2 x e4m3")


@pytest.mark.parametrize("name", VARIANTS)
def test_padded_leading_dims(name, seeded):
    """Views into wider buffers: TMA takes the padded stride, nothing outside the view is read or written."""
    m, n, k = 40, 48, 64
    a = _layout(torch.randn(m, k, device=DEVICE).half(), True, pad=16)
    b = _layout(torch.randn(k, n, device=DEVICE).half(), True, pad=8)
    big = poisoned((m, n + 24), torch.float16, DEVICE)
    out = big[:, :n]
    _run(name, GemmArgs(a, b, out))
    assert_close(out, reference(a, b), TOL[torch.float16], name)
    assert torch.isnan(big[:, n:].float()).all(), "wrote outside the output view"


def test_tma_refuses_unaligned_and_ptr_accepts(seeded):
    """K*itemsize % 16 != 0 cannot be described by TMA; the pointer kernel computes it."""
    m, n, k = 150, 40, 99  # M > 128: the large-M order, where only the pointer kernel accepts it
    a = torch.randn(m, k, device=DEVICE).half()
    b = torch.randn(k, n, device=DEVICE).half()
    out = poisoned((m, n), torch.float32, DEVICE)
    args = GemmArgs(a, b, out)
    for name in ("triton.tma", "triton.tma_device", "triton.persistent"):
        assert "not a multiple of 16" in plan.get(name).supports(args)
    assert plan.choose(args).name == "triton.ptr"
    _run("triton.ptr", args)
    assert_close(out, reference(a, b), TOL[torch.float32], "ptr, K=99")


def test_tma_refuses_fp8_wrong_major(seeded):
    a, b = fp8_operands(32, 32, 64, DEVICE)
    args = GemmArgs(a, b.contiguous(), poisoned((32, 32), torch.float32, DEVICE))
    assert "column-major" in plan.get("triton.tma").supports(args)


@pytest.mark.parametrize("config", [SMALL, TritonGemmConfig(64, 32, 64, 1, 2, 4), TritonGemmConfig(32, 64, 32, 4, 3, 4)])
def test_configs_and_group_order(config, seeded):
    """Other tile shapes and L2 group sizes: the grouped order must still cover every tile once."""
    m, n, k = 150, 200, 96
    a = torch.randn(m, k, device=DEVICE).half()
    b = torch.randn(k, n, device=DEVICE).half()
    for name in VARIANTS:
        out = poisoned((m, n), torch.float32, DEVICE)
        _run(name, GemmArgs(a, b, out), config)
        assert_close(out, reference(a, b), TOL[torch.float32], f"{name} {config}")


def test_config_validity():
    assert TritonGemmConfig().is_valid(2, 2, 2)
    assert not TritonGemmConfig(128, 256, 128, 8, 6, 8).is_valid(2, 2, 2)  # 6 x 96 KB ring > 227 KB
    assert not TritonGemmConfig(128, 128, 8, 8, 3, 8).is_valid(2, 2, 2)  # 16-byte inner box
    assert not TritonGemmConfig(96, 128, 64).is_valid(2, 2, 2)  # not a power of two
    assert TritonGemmConfig(128, 256, 128, 8, 3, 8).is_valid(1, 1, 2)


def test_device_desc_plan_reused_across_calls(seeded):
    """The same plan serves new tensors of the same signature (values change, results follow)."""
    m, n, k = 40, 64, 96
    args = [GemmArgs(torch.randn(m, k, device=DEVICE).half(), torch.randn(k, n, device=DEVICE).half(),
                     poisoned((m, n), torch.float32, DEVICE)) for _ in range(3)]
    launcher = matmul_tma.build_device(args[0], SMALL)
    for problem in args:
        launcher(problem)
        assert_close(problem.out, reference(problem.a, problem.b), TOL[torch.float32], "reused plan")


@pytest.mark.parametrize("name", ["triton.tma", "triton.tma_device", "triton.persistent"])
@pytest.mark.parametrize("m", [65, 100, 127])
def test_last_row_tile_overlaps_its_neighbour(name, m, seeded):
    """A ragged M over one 64-row tile: the last tile starts at M - 64 and shares rows with its
    neighbour; every row (the shared ones written twice) must hold the product."""
    n, k = 40, 96
    a, b = fp8_operands(m, n, k, DEVICE)
    scale_a = torch.rand(m, 1, device=DEVICE) + 0.5
    scale_b = torch.rand(1, n, device=DEVICE) + 0.5
    bias = torch.randn(n, device=DEVICE).to(torch.bfloat16)
    out = poisoned((m, n), torch.bfloat16, DEVICE)
    _run(name, GemmArgs(a, b, out, scale_a, scale_b, bias, True), TritonGemmConfig(64, 32, 64, 1, 2, 4))
    assert_close(out, reference(a, b, scale_a, scale_b, bias), TOL[torch.bfloat16], f"{name} M={m}")


@pytest.mark.parametrize("name", ["triton.tma", "triton.tma_device"])
@pytest.mark.parametrize("m", [1, 19, 32, 33])
def test_activation_pointer_loads_up_to_half_a_tile(name, m, seeded):
    """Up to half a 64-row tile the activation comes through masked pointer loads (above it through
    TMA); both read a row-major A with a padded row stride and K off the tile."""
    n, k = 40, 208
    config = TritonGemmConfig(64, 32, 64, 1, 2, 4)
    a, b = fp8_operands(m, n, k, DEVICE)
    a = _layout(a, True, pad=16)
    scale_a = torch.rand(m, 1, device=DEVICE) + 0.5
    scale_b = torch.tensor([0.75], device=DEVICE)
    out = poisoned((m, n), torch.bfloat16, DEVICE)
    args = GemmArgs(a, b, out, scale_a, scale_b, None, True)
    assert matmul_tma.a_pointer_loads(args, config, host.tma_layout(args)) == (m <= 32)
    _run(name, args, config)
    assert_close(out, reference(a, b, scale_a, scale_b), TOL[torch.bfloat16], f"{name} M={m}")
