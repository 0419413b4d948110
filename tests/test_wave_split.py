"""mixed.wave_split: whole waves of native 128x128 tiles over the leading columns, the remaining
columns as their own GEMM. The rule and the refusals run on the CPU; the products (fp8 tensor-
and row-wise with bias, bf16, fp16 with either weight layout, ragged N and K, forced split
points, CUDA-graph capture with new inputs) need a Hopper GPU."""

import pytest
import torch
from gemm_ref import FP8, assert_close, check_product, fp8_operands, poisoned, reference

import tmagemm
from tmagemm import plan, wave_split
from tmagemm.plan import GemmArgs
from tmagemm.wave_split import WaveSplitConfig, lead_columns

SMS = 132


@pytest.mark.parametrize(
    "m, n, itemsize, columns",
    [
        (128, 36864, 1, 2 * SMS * 128),  # 288 tiles: 2 waves + 24 tiles
        (96, 36864, 1, 2 * SMS * 128),  # from 96 tokens
        (95, 36864, 1, 0),
        (128, 36864, 4, 0),  # fp32 operands: no such kernel
        (129, 36864, 1, 0),  # two rows of tiles
        (96, 37888, 2, 2 * SMS * 128),  # 296 tiles
        (128, 54272, 1, 3 * SMS * 128),  # 424 tiles: 3 waves + 28
        (128, 2 * SMS * 128, 1, 0),  # exactly two waves: nothing to split
        (128, 2 * SMS * 128 + 1, 1, 2 * SMS * 128),  # one ragged column over two waves
        (128, (2 * SMS + SMS // 4) * 128, 1, 2 * SMS * 128),  # a last wave of 33 tiles: the limit
        (128, (2 * SMS + SMS // 4 + 1) * 128, 1, 0),
        (128, 28672, 1, 0),  # 1.70 waves
        (128, 24576, 1, 0),  # 1.45 waves
    ],
)
def test_lead_columns(m, n, itemsize, columns):
    assert lead_columns(m, n, itemsize, SMS) == columns


def _meta_args(m, n, k, dtype=FP8, **kw):
    a = torch.empty(m, k, dtype=dtype, device="meta")
    b = torch.empty(n, k, dtype=dtype, device="meta").t()
    return GemmArgs(a, b, torch.empty(m, n, dtype=torch.bfloat16, device="meta"), **kw)


def test_tile_width_is_the_native_tiles():
    from tmagemm.cuda.gemm import COOP_N128

    assert wave_split.TILE_N == COOP_N128.block_n  # lead_columns counts the tiles build launches


def test_preference_and_refusals():
    assert plan.preference(_meta_args(128, 36864, 7168))[0] == wave_split.NAME
    one = torch.empty(1, device="meta")
    assert plan.preference(_meta_args(128, 36864, 7168, scale_a=one, scale_b=one))[0] == wave_split.NAME
    rowwise = _meta_args(128, 36864, 7168, scale_a=one, scale_b=torch.empty(36864, device="meta"))
    assert plan.preference(rowwise)[0] != wave_split.NAME
    assert "row-wise" in wave_split.supports(rowwise)
    assert plan.preference(_meta_args(128, 36864, 7168, fast_accum=False))[0] != wave_split.NAME
    args = _meta_args(128, 36864, 7168, fast_accum=False)
    assert "fast accumulation" in wave_split.supports(args)
    assert "waves" in wave_split.supports(_meta_args(128, 28672, 4096))
    cpu = GemmArgs(torch.randn(128, 64).half(), torch.randn(36864, 64).half().t(), torch.empty(128, 36864))
    assert "CUDA" in wave_split.supports(cpu)  # the native tiles need a Hopper GPU
    assert plan.get(wave_split.NAME).backend == "mixed"  # never taken for a forced backend


@pytest.mark.parametrize("columns", [0, 100, 36864, 40000])
def test_forced_columns_must_split_on_a_tile_edge_inside_n(columns):
    with pytest.raises(ValueError, match="columns must be a multiple of 128"):
        wave_split.build(_meta_args(128, 36864, 7168), WaveSplitConfig(columns))


def test_slices_take_columns_of_b_out_column_scales_and_bias():
    """Column-wise scales come in any shape holding N values 4 bytes apart (a cached call passes
    the user's (1, N)); the activation and its scale are shared by both parts."""
    m, n, k = 3, 10, 4
    a, b, out = torch.randn(m, k), torch.randn(n, k).t(), torch.randn(m, n)
    sa, bias = torch.rand(m, 1), torch.randn(n)
    for sb in (torch.rand(1, n), torch.rand(n), torch.rand(n, 1)):
        got = wave_split._slice((a, b, out, sa, sb, bias), 6, n)
        assert got[0] is a and got[3] is sa
        assert torch.equal(got[1], b[:, 6:]) and got[2].data_ptr() == out[:, 6:].data_ptr()
        assert torch.equal(got[4], sb.reshape(-1)[6:]) and torch.equal(got[5], bias[6:])
    tensor_scale = torch.rand(1)
    assert wave_split._slice((a, b, out, sa, tensor_scale, None), 0, 6)[4:] == (tensor_scale, None)


# ---------------------------------------------------------------------------------------- GPU


def _sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def _split_n(ragged: int = 40) -> int:
    """N whose 128-column tiles are two whole waves and a last wave of an eighth of the SMs, less
    ``ragged`` columns (the last tile partly past N)."""
    return (2 * _sms() + _sms() // 8) * 128 - ragged


def _planned(args: GemmArgs) -> str:
    return plan.choose(args).name


@pytest.mark.gpu
@pytest.mark.parametrize("m", [96, 100, 128])
@pytest.mark.parametrize("out_dtype, with_bias", [(torch.bfloat16, False), (torch.float32, True)])
def test_fp8(m, out_dtype, with_bias, seeded):
    n, k = _split_n(), 1008  # K off the 128-deep k-block
    a, b = fp8_operands(m, n, k, "cuda")
    sa, sb = torch.rand(1, device="cuda") + 0.5, torch.rand(1, device="cuda") + 0.5
    bias = torch.randn(n, device="cuda").to(out_dtype) if with_bias else None
    out = poisoned((m, n), out_dtype, "cuda")
    args = plan.gemm_args(a, b, out, sa, sb, bias, True)
    assert _planned(args) == wave_split.NAME
    for call in ("first", "cached"):  # planned, then through the cached call with the user's scale shapes
        out.fill_(float("nan"))
        tmagemm.scaled_mm(a, b, sa, sb, bias=bias, out_dtype=out_dtype, out=out)
        if with_bias:
            assert_close(out, reference(a, b, sa, sb, bias), 1e-3, f"fp8 M={m} {call}")
        else:
            check_product(out, a, b, sa, sb, f"fp8 M={m} {call}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k_major", [False, True])
@pytest.mark.parametrize("m", [96, 128])
def test_16bit(dtype, k_major, m, seeded):
    n, k = _split_n(), 1000
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    b = torch.randn(n, k, device="cuda", dtype=dtype).t() if k_major else torch.randn(k, n, device="cuda", dtype=dtype)
    out = poisoned((m, n), dtype, "cuda")
    assert _planned(GemmArgs(a, b, out)) == wave_split.NAME
    tmagemm.matmul(a, b, out=out)
    check_product(out, a, b, what=f"{dtype} k_major={k_major} M={m}", accumulation=2.0**-12)  # fp32 sums


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", [1, 100, 2 * 132 + 15])
def test_forced_split_points(tiles, seeded):
    """Any split on a tile edge computes the same product (the lead's grid then walks several
    tiles per CTA, or a few CTAs hold one)."""
    m, n, k = 128, 2 * 132 * 128 + 2000, 512
    a, b = fp8_operands(m, n, k, "cuda")
    sa, sb = torch.rand(m, device="cuda") + 0.5, torch.rand(n, device="cuda") + 0.5
    out = poisoned((m, n), torch.bfloat16, "cuda")
    args = GemmArgs(a, b, out, sa, sb)
    plan.build(args, variant=wave_split.NAME, config=WaveSplitConfig(tiles * 128))(args)
    check_product(out, a, b, sa, sb, f"{tiles} lead tiles")


@pytest.mark.gpu
def test_graph_capture_with_new_inputs(seeded):
    """Eager warm-up on the default stream, capture on torch.cuda.graph's side stream, replays with
    new activations and scales."""
    m, n, k = 120, _split_n(8), 1024
    a, b = fp8_operands(m, n, k, "cuda")
    sa, sb = torch.rand(1, device="cuda") + 0.5, torch.rand(1, device="cuda") + 0.5
    assert _planned(plan.gemm_args(a, b, torch.empty(m, n, device="cuda", dtype=torch.bfloat16), sa, sb, None,
                                   True)) == wave_split.NAME
    out = poisoned((m, n), torch.bfloat16, "cuda")
    tmagemm.scaled_mm(a, b, sa, sb, out=out)
    check_product(out, a, b, sa, sb, "eager")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tmagemm.scaled_mm(a, b, sa, sb, out=out)
    for replay in range(2):
        a.copy_(fp8_operands(m, n, k, "cuda")[0])
        sa.copy_(torch.rand(1, device="cuda") + 0.5)
        out.fill_(float("nan"))
        graph.replay()
        check_product(out, a, b, sa, sb, f"replay {replay}")
