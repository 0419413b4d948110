"""The TMA transposing copy (``triton/transpose.py``): exact values on ragged shapes, the cases it
leaves to torch's copy, and its sm_90a build."""

import pytest
import torch

import tmagemm.ops  # noqa: F401  (registers torch.ops.tmagemm.transposed)
from tmagemm.triton import transpose

DEV = "cuda" if torch.cuda.is_available() else "cpu"
HALF = torch.bfloat16 if DEV == "cuda" else torch.float16


@pytest.mark.anydevice
@pytest.mark.parametrize("shape", [(72, 136), (200, 64), (8, 520), (64, 64)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", [HALF, torch.float32], ids=["16bit", "fp32"])
def test_transposed_copies_exactly(shape, dtype, seeded):
    """Every element lands at its transposed place (a copy: bit for bit), tiles off 64 clipped."""
    t = torch.randn(*shape, device=DEV).to(dtype)
    assert transpose.reason(t) is None
    out = transpose.transposed(t)
    assert out.shape == shape[::-1] and out.is_contiguous() and out.dtype == dtype
    assert torch.equal(out, t.t())


@pytest.mark.anydevice
def test_transposed_is_planned_once_per_signature(seeded):
    """A second tensor of the same signature takes the cached plan and gets its own values."""
    from tmagemm import plan

    plan.clear_plans()
    for _ in range(2):
        t = torch.randn(72, 136, device=DEV).to(HALF)
        assert torch.equal(transpose.transposed(t), t.t())
    plans = [c.plan.variant for c in plan.cached_calls() if isinstance(c, transpose._Call)]
    assert plans == ["triton.transpose"]


@pytest.mark.anydevice
def test_transposed_of_a_row_slice(seeded):
    """A view with a row stride past its width (rows of a wider tensor) reads only its columns."""
    wide = torch.randn(96, 200, device=DEV).to(HALF)
    t = wide[:, 8:136]
    out = transpose.transposed(t)
    assert torch.equal(out, t.t())


def test_transposed_leaves_the_rest_to_torch():
    """Where TMA cannot read t or write its transpose the result is torch's copy, and why is said."""
    cases = {
        "16- or 32-bit": torch.randn(16, 16).to(torch.float8_e4m3fn),
        "2-D": torch.randn(4, 16, 16).half(),
        "result rows of 34 bytes": torch.randn(17, 64).half(),
        "stride 17": torch.randn(64, 17).half(),
        "no element": torch.randn(0, 64).half(),
    }
    for words, t in cases.items():
        assert words in transpose.reason(t), (words, transpose.reason(t))
    t = cases["result rows of 34 bytes"]
    assert torch.equal(transpose.transposed(t), t.t())


def test_the_op_and_its_fake():
    """torch.ops.tmagemm.transposed (the backward's copies): the same values, and a fake with the
    real output's shape and strides."""
    t = torch.randn(72, 136).to(torch.float16)
    out = torch.ops.tmagemm.transposed(t)
    assert torch.equal(out, t.t())
    fake = torch.ops.tmagemm.transposed(t.to("meta"))
    assert fake.shape == out.shape and fake.stride() == out.stride()


def test_transpose_builds_for_sm90a():
    """The kernel as the GPU runs it: a TMA load and a TMA store, no spills, and a parameter list
    the direct launch can fill."""
    from tmagemm import inspection
    from tmagemm.inspection import KernelSpec

    spec = KernelSpec(transpose.transpose_kernel,
                      {"src_desc": "tensordesc<bf16[64, 64]>", "dst_desc": "tensordesc<bf16[64, 64]>", "M": "i32",
                       "N": "i32", "BLOCK": "constexpr", "PDL": "constexpr"},
                      {"BLOCK": 64, "PDL": False}, 4, 1, "transpose", {})
    art = inspection.compile_triton(spec)
    s = inspection.summarize(art)
    assert s["sass UTMALDG"] > 0 and s["sass UTMASTG"] > 0, s
    assert art.spills == 0
    # The parameter list the direct launch fills (two tensor maps, M and N).
    from tmagemm.triton.launch import A, OUT, KernelCall, parameter_plan
    from triton.tools.tensor_descriptor import TensorDescriptor

    t, out = torch.empty(72, 136, dtype=torch.bfloat16), torch.empty(136, 72, dtype=torch.bfloat16)
    call = KernelCall(transpose.transpose_kernel, (6,),
                      dict(src_desc=TensorDescriptor(t, [72, 136], [136, 1], [64, 64]),
                           dst_desc=TensorDescriptor(out, [136, 72], [72, 1], [64, 64]), M=72, N=136, BLOCK=64,
                           PDL=False), {}, {"src_desc": A, "dst_desc": OUT})
    laid_out = parameter_plan(art.ptx, art.launch_metadata, call.positional, call.operand_slots, call.unspecialized)
    assert not isinstance(laid_out, str), laid_out
