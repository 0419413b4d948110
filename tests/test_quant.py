"""quantize_fp8: scales, round trips, ragged and all-zero inputs, and refusal of Inf/NaN."""

import pytest
import torch

import tmagemm
from tmagemm import quantize_fp8

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Every test here runs on the GPU when there is one (the GPU job selects "gpu or anydevice").
pytestmark = pytest.mark.anydevice

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("granularity", ["tensor", "row"])
@pytest.mark.parametrize("shape", [(1, 1), (1, 17), (17, 1), (5, 727), (33, 96)])
def test_round_trip_on_ragged_shapes(seeded, shape, granularity, dtype):
    x = torch.randn(*shape) * 3
    q, scale = quantize_fp8(x, granularity, dtype)
    assert q.dtype == dtype and q.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == ((1, 1) if granularity == "tensor" else (shape[0], 1))
    amax = x.abs().amax() if granularity == "tensor" else x.abs().amax(dim=1, keepdim=True)
    # The largest magnitude lands on the format's max, so the scale is amax / max exactly.
    torch.testing.assert_close(scale, (amax / torch.finfo(dtype).max).expand_as(scale), rtol=1e-6, atol=0)
    back = q.float() * scale
    # One fp8 rounding: relative error <= 2^-(mantissa bits + 1) of each value (normal range).
    rel = 2.0 ** -(4 if dtype == E4M3 else 3)
    bound = rel * x.abs() + scale * 2.0 ** -9  # plus the subnormal step for tiny values
    worst = ((back - x).abs() - bound).max()
    assert worst <= 0, f"round trip off by {worst:.3g} beyond the bound"


def _correctly_rounded(x: torch.Tensor, dtype: torch.dtype, dim=None):
    """The quantization every path must give bit for bit: scale = max(amax / fp8_max, tiny) with
    the quotient correctly rounded to fp32 (from float64: amax / fp8_max never lies near an fp32
    rounding midpoint, fp8_max being 7 x 2^j), q = clamp(x / scale) (fp32 IEEE division of two
    tensors) cast to fp8 with rounding to nearest even."""
    fp8_max = torch.finfo(dtype).max
    amax = x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)
    scale = (amax.double() / fp8_max).float().clamp(min=torch.finfo(torch.float32).tiny).reshape(-1, 1)
    return (x / scale).clamp(-fp8_max, fp8_max).to(dtype), scale


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("shape", [(1, 1), (3, 17), (17, 727), (5, 2100), (40, 96)])
def test_row_kernel_matches_correctly_rounded_arithmetic_bit_for_bit(seeded, shape, dtype):
    """The fused row quantizer (GPU, interpreter) per row against :func:`_correctly_rounded`.
    Rows with tiny values exercise the subnormal grid; K = 2100 takes two column steps."""
    from tmagemm.triton.quantize import quantize_rows

    x = torch.randn(*shape, device=DEVICE) * 3
    x[0] *= 1e-30  # a row that quantizes into subnormals
    q, scale = quantize_rows(x, dtype)
    want_q, want_scale = _correctly_rounded(x, dtype, dim=1)
    assert torch.equal(scale, want_scale)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert q.stride(0) % 16 == 0 and q.stride(1) == 1


@pytest.mark.parametrize("granularity", ["tensor", "row"])
@pytest.mark.parametrize("shape", [(3, 17), (17, 727), (40, 96)])
def test_quantize_fp8_scales_are_correctly_rounded_on_every_device(seeded, shape, granularity):
    """quantize_fp8's "tensor" path (torch ops) and "row" path (the kernel on the GPU) give the
    correctly rounded scale, as the CPU does: torch's division of a CUDA tensor by a Python
    number multiplies by the reciprocal, one ulp off on most of these rows."""
    x = torch.randn(*shape, device=DEVICE) * 3
    q, scale = quantize_fp8(x, granularity)
    want_q, want_scale = _correctly_rounded(x, E4M3, dim=None if granularity == "tensor" else 1)
    assert torch.equal(scale, want_scale)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


def test_integer_values_are_exact():
    x = torch.tensor([[448.0, -3.0, 0.0], [2.0, 1.0, -0.5]])
    q, scale = quantize_fp8(x, "tensor")
    assert scale.item() == 1.0
    assert torch.equal(q.float(), x)


def test_all_zero_rows_and_tensors_quantize_to_zeros():
    x = torch.tensor([[0.0, 0.0, 0.0], [1.0, -2.0, 4.0], [0.0, 0.0, 0.0]])
    q, scale = quantize_fp8(x, "row")
    assert torch.isfinite(scale).all() and (scale > 0).all()
    assert torch.equal(q[0].float(), torch.zeros(3)) and torch.equal(q[2].float(), torch.zeros(3))
    torch.testing.assert_close(q[1].float() * scale[1], x[1])
    q, scale = quantize_fp8(torch.zeros(4, 9), "tensor")
    assert torch.isfinite(scale).all() and scale.item() > 0 and not q.float().any()


@pytest.mark.parametrize("granularity", ["tensor", "row"])
@pytest.mark.parametrize("shape", [(0, 5), (4, 0), (0, 0)])
def test_zero_size(shape, granularity):
    q, scale = quantize_fp8(torch.empty(shape), granularity)
    assert q.shape == shape and torch.isfinite(scale).all()


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_rows_are_named(bad):
    x = torch.randn(6, 10)
    x[4, 7] = bad
    kind = "NaN" if bad != bad else "Inf"
    with pytest.raises(ValueError, match=rf"quantize_fp8: x holds {kind} in row 4 of \(6, 10\)"):
        quantize_fp8(x, "row")
    with pytest.raises(ValueError, match=rf"x holds {kind} \(1 values, the first at row 4, column 7\)"):
        quantize_fp8(x, "tensor")


def test_non_finite_message_lists_every_bad_row_and_both_kinds():
    x = torch.ones(12, 3, dtype=torch.float16)
    x[1, 0] = float("inf")
    x[9, 2] = float("nan")
    with pytest.raises(ValueError, match=r"holds Inf and NaN in row 1, 9 of"):
        quantize_fp8(x, "row")
    x = torch.full((20, 2), float("nan"))
    with pytest.raises(ValueError, match=r"row 0, 1, 2, 3, 4, 5, 6, 7, \.\.\. \(20 rows\)"):
        quantize_fp8(x, "row")


def test_fp16_overflow_is_reported_not_zeroed():
    # 70000 is past fp16's max: the fp16 tensor already holds Inf, which used to quantize to 0.
    x = torch.tensor([[1.0, 70000.0]]).half()
    with pytest.raises(ValueError, match="row 0"):
        quantize_fp8(x, "row")


@pytest.mark.parametrize("granularity, shape", [("1x128", (17, 3)), ("128x128", (1, 3))])
def test_block_granularities_through_quantize_fp8(granularity, shape):
    x = torch.randn(17, 300, device=DEVICE) * 3
    q, scale = tmagemm.quantize_fp8(x, granularity)
    assert q.dtype == torch.float8_e4m3fn and tuple(q.shape) == (17, 300) and tuple(scale.shape) == shape
    rows = torch.arange(17, device=DEVICE) if granularity == "1x128" else torch.arange(17, device=DEVICE) // 128
    group_scale = scale[rows][:, torch.arange(300, device=DEVICE) // 128]
    deq = q.float() * group_scale
    # e4m3: 3 mantissa bits (2^-4 relative rounding), and subnormal steps of 2^-9 (half: 2^-10).
    assert bool(((deq - x).abs() <= x.abs() * 2.0**-4 + group_scale * 2.0**-10 + 1e-7).all())
    with pytest.raises(ValueError, match="pow2_scale applies"):
        tmagemm.quantize_fp8(x, "row", pow2_scale=True)


def test_check_finite_false_skips_the_check():
    x = torch.randn(4, 256, device=DEVICE)
    x[1, 7] = float("inf")
    with pytest.raises(ValueError, match="Inf"):
        tmagemm.quantize_fp8(x, "1x128")
    _, scale = tmagemm.quantize_fp8(x, "1x128", check_finite=False)  # no sync: the Inf shows in its scale
    assert torch.isinf(scale[1, 0]) and torch.isfinite(scale[0]).all()
    _, scale = tmagemm.quantize_fp8(x, "row", check_finite=False)
    assert torch.isinf(scale[1, 0])


@pytest.mark.parametrize("granularity", ["1x128", "128x128", "row"])
def test_each_input_signature_is_planned_once(granularity):
    """The kernel quantizers keep one checked plan per input signature in the plan layer's cache:
    a second call with the same shape, strides and dtype reuses it (fresh outputs, the same
    values), a new shape adds one, and a call the checks refuse caches nothing."""
    from tmagemm import plan

    plan.clear_plans()
    name = "triton.quantize_rows" if granularity == "row" else "triton.quantize_blocks"

    def ours():
        return [c for c in plan.cached_calls() if getattr(getattr(c, "plan", None), "variant", None) == name]

    x = torch.randn(20, 300, device=DEVICE)
    q1, s1 = quantize_fp8(x, granularity)
    (call,) = ours()
    q2, s2 = quantize_fp8(x.clone(), granularity)
    assert ours() == [call]
    assert q2.data_ptr() != q1.data_ptr() and torch.equal(q1.float(), q2.float()) and torch.equal(s1, s2)
    quantize_fp8(torch.randn(7, 300, device=DEVICE), granularity)
    assert len(ours()) == 2
    with pytest.raises(ValueError, match="contiguous last dimension"):
        from tmagemm.triton.quantize import quantize_1x128, quantize_rows
        (quantize_rows if granularity == "row" else quantize_1x128)(torch.randn(300, 20, device=DEVICE).t())
    assert len(ours()) == 2


@pytest.mark.parametrize("block_r", [1, 16])
def test_row_kernel_compiles_for_sm90a(block_r):
    """The row quantizer as the GPU runs it (one row per program, PDL), compiled ahead of time:
    one griddepcontrol.wait before its loads and the trigger for dependents after them."""
    from tmagemm import inspection
    from tmagemm.triton import quantize

    constexprs = {**quantize.fp8_grid(), "BLOCK_R": block_r, "BLOCK_K": 1024, "PDL": True}
    signature = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "R": "i32", "K": "i32", "stride_x": "i32",
                 "stride_q": "i32", **{c: "constexpr" for c in constexprs}}
    art = inspection.compile_triton(
        inspection.KernelSpec(quantize._row_quantize_kernel, signature, constexprs, 4, 3, "quantize_rows"))
    body = art.ptx[art.ptx.index(".entry"):]
    assert body.count("griddepcontrol.wait") == 1 and body.index("griddepcontrol.wait") < body.index("ld.global")
    assert body.index("griddepcontrol.launch_dependents") > body.index("ld.global")
