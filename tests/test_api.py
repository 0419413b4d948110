"""Public API: every validation error, zero-size dims, quantize_fp8, the torch ops.

CPU tensors are accepted only under the Triton interpreter, which conftest turns on without a GPU;
on a GPU machine the same tests run on CUDA tensors.
"""

import pytest
import torch
from gemm_ref import FP8, assert_close, fp8_operands, poisoned, reference

import tmagemm
from tmagemm import api

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Every test here runs on the GPU when there is one (the GPU job selects "gpu or anydevice").
pytestmark = pytest.mark.anydevice

def _fp8(m=32, n=48, k=64):
    a, b = fp8_operands(m, n, k, DEVICE)
    return a, b, torch.tensor([0.5], device=DEVICE), torch.tensor([2.0], device=DEVICE)


# ------------------------------------------------------------------------------ validation

@pytest.mark.parametrize(
    "mutate, exc, words",
    [
        (lambda a, b, sa, sb: (a.float(), b, sa, sb), TypeError, "a must be float8"),
        (lambda a, b, sa, sb: (a, b.to(torch.float8_e5m2), sa, sb), TypeError, "b must be float8_e4m3fn"),
        (lambda a, b, sa, sb: (a[:, :32], b, sa, sb), ValueError, "a.shape[1] (32) must equal b.shape[0] (64)"),
        (lambda a, b, sa, sb: (a[None], b, sa, sb), ValueError, "must be 2-D"),
        (lambda a, b, sa, sb: (a.t().contiguous().t(), b, sa, sb), ValueError, "a must be row-major"),
        (lambda a, b, sa, sb: (a, b.contiguous(), sa, sb), ValueError, "b must be column-major"),
        (lambda a, b, sa, sb: (a, b, sa.half(), sb), TypeError, "scale_a must be float32"),
        (lambda a, b, sa, sb: (a, b, torch.ones(5, device=sa.device), sb), ValueError, "scale_a has shape (5,)"),
        (lambda a, b, sa, sb: (a, b, sa, torch.ones(48, 2, device=sb.device)), ValueError, "scale_b has shape (48, 2)"),
        (lambda a, b, sa, sb: (a, b, sa, [2.0]), TypeError, "scale_b must be a torch.Tensor"),
        (lambda a, b, sa, sb: ("a", b, sa, sb), TypeError, "a must be a torch.Tensor"),
    ],
)
def test_scaled_mm_rejects(mutate, exc, words):
    args = mutate(*_fp8())
    with pytest.raises(exc) as info:
        tmagemm.scaled_mm(*args)
    assert words in str(info.value)


def test_scaled_mm_rejects_bias_out_and_options():
    a, b, sa, sb = _fp8()
    with pytest.raises(ValueError, match=r"bias has shape \(47,\); expected \(48,\)"):
        tmagemm.scaled_mm(a, b, sa, sb, bias=torch.zeros(47, device=DEVICE))
    with pytest.raises(TypeError, match="bias must be"):
        tmagemm.scaled_mm(a, b, sa, sb, bias=torch.zeros(48, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match=r"out has shape \(32, 47\) but the result is \(32, 48\)"):
        tmagemm.scaled_mm(a, b, sa, sb, out=torch.empty(32, 47, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(TypeError, match="out has dtype torch.float16 but out_dtype is torch.bfloat16"):
        tmagemm.scaled_mm(a, b, sa, sb, out=torch.empty(32, 48, dtype=torch.float16, device=DEVICE))
    with pytest.raises(TypeError, match="out_dtype must be"):
        tmagemm.scaled_mm(a, b, sa, sb, out_dtype=torch.int8)
    with pytest.raises(ValueError, match="backend must be one of"):
        tmagemm.scaled_mm(a, b, sa, sb, backend="cublas")


def test_matmul_rejects():
    a = torch.randn(8, 16, device=DEVICE).half()
    b = torch.randn(16, 4, device=DEVICE).half()
    with pytest.raises(TypeError, match="must both be bfloat16 or both float16"):
        tmagemm.matmul(a, b.bfloat16())
    with pytest.raises(TypeError, match="use tmagemm.scaled_mm for fp8"):
        tmagemm.matmul(a.to(FP8), b.to(FP8))
    with pytest.raises(TypeError, match="must both be bfloat16 or both float16"):
        tmagemm.matmul(a.float(), b.float())
    with pytest.raises(ValueError, match=r"a.shape\[1\] \(16\) must equal b.shape\[0\] \(15\)"):
        tmagemm.matmul(a, b[:15])
    with pytest.raises(ValueError, match="out has shape"):
        tmagemm.matmul(a, b, out=torch.empty(8, 5, dtype=torch.float16, device=DEVICE))
    with pytest.raises(TypeError, match="out_dtype must be"):
        tmagemm.matmul(a, b, out_dtype=torch.float64)


def test_rejects_cpu_tensors_outside_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    a = torch.randn(8, 16).half()
    b = torch.randn(16, 4).half()
    with pytest.raises(ValueError, match="tmagemm needs CUDA tensors on a Hopper GPU"):
        tmagemm.matmul(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs two devices to disagree")
def test_rejects_mixed_devices():
    a = torch.randn(8, 16, device="cuda").half()
    with pytest.raises(ValueError, match="b is on cpu but a is on cuda"):
        tmagemm.matmul(a, torch.randn(16, 4).half())


def test_non_hopper_gpu_message(monkeypatch):
    """The capability check names the device and what is needed (simulated sm_80)."""
    monkeypatch.setattr(api.device, "capability", lambda index: (8, 0))
    monkeypatch.setattr(api.device, "name", lambda index: "NVIDIA A100")
    with pytest.raises(ValueError, match="sm_80.*need a Hopper GPU"):
        api.check_runtime_device(torch.device("cuda", 0), torch.float8_e4m3fn)


# ------------------------------------------------------------------------------ repeated calls


def test_repeated_calls_follow_new_operands(seeded):
    """Same signature, new tensors every call (a decode loop): each result is its own."""
    for step in range(5):
        a, b, sa, sb = _fp8(17, 48, 64)
        sa = sa * (step + 1)
        bias = torch.randn(48, device=DEVICE, dtype=torch.bfloat16)
        out = poisoned((17, 48), torch.bfloat16, DEVICE)
        tmagemm.scaled_mm(a, b, sa, sb, bias=bias, out=out)
        assert_close(out, reference(a, b, sa, sb, bias), 1e-2, f"step {step}")
        x = torch.randn(17, 64, device=DEVICE).half()
        w = torch.randn(64, 48, device=DEVICE).half()
        assert_close(tmagemm.matmul(x, w, out_dtype=torch.float32), reference(x, w), 2e-4, f"matmul step {step}")


def test_remembered_calls_still_check_what_changed(seeded):
    a, b, sa, sb = _fp8()
    tmagemm.scaled_mm(a, b, sa, sb)
    tmagemm.scaled_mm(a, b, sa, sb)  # a remembered call on CUDA
    with pytest.raises(TypeError, match="scale_a must be float32"):
        tmagemm.scaled_mm(a, b, sa.double(), sb)
    with pytest.raises(ValueError, match="bias has shape"):
        tmagemm.scaled_mm(a, b, sa, sb, bias=torch.ones(3, device=DEVICE, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out has shape"):
        tmagemm.scaled_mm(a, b, sa, sb, out=torch.empty(3, 3, device=DEVICE, dtype=torch.bfloat16))
    # A view one element in: not 16-byte aligned, so a new key and the pointer kernel.
    a2 = torch.empty(32 * 64 + 1, device=DEVICE, dtype=torch.uint8).view(FP8)[1:].view(32, 64)
    a2.copy_(a)
    assert_close(tmagemm.scaled_mm(a2, b, sa, sb), reference(a, b, sa, sb), 1e-2, "unaligned a")


def test_remembered_calls_copy_strided_scales_and_bias(seeded):
    """A row-wise scale or a bias that is a strided view must be copied on every call, also once
    the call is remembered (the kernels read them contiguously)."""
    a, b, _, _ = _fp8(24, 48, 64)
    for step in range(3):
        sa = (torch.rand(24, 2, device=DEVICE) + 0.5)[:, :1]  # (M, 1), stride (2, 1)
        sb = (torch.rand(2, 48, device=DEVICE) + 0.5)[:1]
        bias = torch.randn(96, device=DEVICE, dtype=torch.bfloat16)[::2]  # (N,), stride 2
        out = poisoned((24, 48), torch.bfloat16, DEVICE)
        tmagemm.scaled_mm(a, b, sa, sb, bias=bias, out=out)
        assert_close(out, reference(a, b, sa, sb, bias), 1e-2, f"step {step}")


@pytest.mark.gpu
def test_cuda_calls_are_remembered_outside_capture(monkeypatch, seeded):
    from tmagemm import plan

    monkeypatch.setenv("TMAGEMM_AUTOTUNE", "0")  # capture and eager then share the heuristic kernel
    plan.clear_plans()
    a, b, sa, sb = _fp8()
    tmagemm.scaled_mm(a, b, sa, sb)  # compiles and loads the kernel outside the capture
    plan.clear_plans()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tmagemm.scaled_mm(a, b, sa, sb)  # planned during capture: not remembered
    assert len(plan._calls) == 0
    graph.replay()
    assert_close(out, reference(a, b, sa, sb), 1e-2, "replay")
    tmagemm.scaled_mm(a, b, sa, sb)
    assert len(plan._calls) == 1
    plan.clear_plans()


# ------------------------------------------------------------------------------ zero sizes

@pytest.mark.parametrize("m,n", [(0, 48), (32, 0), (0, 0)])
def test_zero_m_or_n(m, n):
    a, b = fp8_operands(m, n, 64, DEVICE)
    out = tmagemm.scaled_mm(a, b, torch.ones(1, device=DEVICE), torch.ones(1, device=DEVICE))
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    h = tmagemm.matmul(torch.randn(m, 16, device=DEVICE).half(), torch.randn(16, n, device=DEVICE).half())
    assert h.shape == (m, n)


def test_k_zero_gives_bias():
    a, b = fp8_operands(5, 7, 0, DEVICE)
    bias = torch.randn(7, device=DEVICE).to(torch.bfloat16)
    out = poisoned((5, 7), torch.bfloat16, DEVICE)
    tmagemm.scaled_mm(a, b, torch.ones(1, device=DEVICE), torch.ones(1, device=DEVICE), bias=bias, out=out)
    assert torch.equal(out.cpu(), bias.cpu().expand(5, 7))
    h = tmagemm.matmul(torch.empty(5, 0, device=DEVICE).half(), torch.empty(0, 7, device=DEVICE).half())
    assert torch.equal(h.cpu(), torch.zeros(5, 7, dtype=torch.float16))


# ------------------------------------------------------------------------------ results

@pytest.mark.parametrize("scale_shapes", [((1,), (1,)), ((), ()), ((1, 1), (1, 1)), ("M1", "1N"), ("M", "N")])
def test_scaled_mm_scale_forms(scale_shapes, seeded):
    m, n, k = 19, 40, 96
    a, b = fp8_operands(m, n, k, DEVICE)
    dims = {"M1": (m, 1), "1N": (1, n), "M": (m,), "N": (n,)}
    sa = torch.rand(dims.get(scale_shapes[0], scale_shapes[0]), device=DEVICE) + 0.5
    sb = torch.rand(dims.get(scale_shapes[1], scale_shapes[1]), device=DEVICE) + 0.5
    out = tmagemm.scaled_mm(a, b, sa, sb, out_dtype=torch.float32)
    assert_close(out, reference(a, b, sa, sb), 2e-4, f"scales {scale_shapes}")


def test_scaled_mm_unaligned_k_takes_pointer_kernel(seeded):
    m, n, k = 150, 40, 100  # K bytes % 16 != 0
    a, b = fp8_operands(m, n, k, DEVICE)
    sa, sb = torch.tensor([0.25], device=DEVICE), torch.tensor([4.0], device=DEVICE)
    out = tmagemm.scaled_mm(a, b, sa, sb, out_dtype=torch.float32)
    assert_close(out, reference(a, b, sa, sb), 2e-4, "K=100")


def test_matmul_out_and_dtype(seeded):
    a = torch.randn(33, 64, device=DEVICE).half()
    b = torch.randn(64, 40, device=DEVICE).half()
    out = poisoned((33, 40), torch.float32, DEVICE)
    got = tmagemm.matmul(a, b, out_dtype=torch.float32, out=out)
    assert got is out
    assert_close(out, reference(a, b), 2e-4, "matmul out=")
    assert tmagemm.matmul(a, b).dtype == torch.float16


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_backend_choice(backend, seeded):
    a = torch.randn(33, 64, device=DEVICE).half()
    b = torch.randn(64, 40, device=DEVICE).half()
    assert_close(tmagemm.matmul(a, b, out_dtype=torch.float32, backend=backend), reference(a, b), 2e-4, backend)


def test_backend_env_knob(monkeypatch):
    from tmagemm import plan

    plan.clear_plans()  # knobs are read when a problem signature is first planned
    monkeypatch.setenv("TMAGEMM_BACKEND", "bogus")
    with pytest.raises(ValueError, match="TMAGEMM_BACKEND='bogus'"):
        tmagemm.matmul(torch.randn(8, 16, device=DEVICE).half(), torch.randn(16, 8, device=DEVICE).half())


# ------------------------------------------------------------------------------ quantize_fp8

@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_quantize_fp8_round_trip(granularity, seeded):
    x = torch.randn(37, 80, device=DEVICE) * 3
    q, scale = tmagemm.quantize_fp8(x, granularity)
    assert q.dtype == FP8 and scale.dtype == torch.float32
    assert scale.shape == ((1, 1) if granularity == "tensor" else (37, 1))
    err = ((q.float() * scale - x).norm() / x.norm()).item()
    assert err < 0.05, err  # e4m3 has 3 mantissa bits: ~2-3% relative
    assert (q.float().abs().amax(dim=1 if granularity == "row" else None) > 400).all()  # range is used


def test_quantize_fp8_zero_rows_and_errors():
    x = torch.randn(4, 16, device=DEVICE)
    x[2] = 0
    q, scale = tmagemm.quantize_fp8(x, "row")
    assert torch.isfinite(scale).all() and (scale > 0).all() and (q[2].float() == 0).all()
    with pytest.raises(ValueError, match="granularity"):
        tmagemm.quantize_fp8(x, "col")
    with pytest.raises(TypeError, match="float16/bfloat16/float32"):
        tmagemm.quantize_fp8(x.to(FP8))
    with pytest.raises(ValueError, match="2-D"):
        tmagemm.quantize_fp8(x[0])


def test_quantize_then_scaled_mm(seeded):
    x = torch.randn(24, 64, device=DEVICE)
    w = torch.randn(40, 64, device=DEVICE)
    xq, xs = tmagemm.quantize_fp8(x, "row")
    wq, ws = tmagemm.quantize_fp8(w, "row")
    out = tmagemm.scaled_mm(xq, wq.t(), xs, ws.t(), out_dtype=torch.float32)
    assert_close(out, reference(xq, wq.t(), xs, ws.t()), 2e-4, "quantized")
    assert_close(out, x.double().cpu() @ w.double().cpu().t(), 0.08, "vs unquantized")


# ------------------------------------------------------------------------------ torch ops

def test_fake_implementations():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a = torch.empty(16, 32, dtype=FP8, device=DEVICE)
        b = torch.empty(64, 32, dtype=FP8, device=DEVICE).t()
        s = torch.empty(1, device=DEVICE)
        out = torch.ops.tmagemm.scaled_mm(a, b, s, s, None, torch.float16, True, "auto")
        assert out.shape == (16, 64) and out.dtype == torch.float16
        h = torch.ops.tmagemm.matmul(torch.empty(16, 32, dtype=torch.half, device=DEVICE),
                                     torch.empty(32, 8, dtype=torch.half, device=DEVICE), torch.float32, "auto")
        assert h.shape == (16, 8) and h.dtype == torch.float32


def test_opcheck(seeded):
    a, b = fp8_operands(16, 32, 64, DEVICE)
    s = torch.tensor([0.5], device=DEVICE)
    # opcheck's schema test multiplies fp8 tensors, which torch implements on neither CPU nor CUDA.
    utils = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    torch.library.opcheck(
        torch.ops.tmagemm.scaled_mm.default, (a, b, s, s, None, torch.float32, True, "auto"), test_utils=utils
    )
    x = torch.randn(16, 32, device=DEVICE).half()
    y = torch.randn(32, 24, device=DEVICE).half()
    torch.library.opcheck(torch.ops.tmagemm.matmul.default, (x, y, torch.float32, "auto"))
    out = torch.empty(16, 24, dtype=torch.float16, device=DEVICE)
    torch.library.opcheck(torch.ops.tmagemm.matmul_out.default, (x, y, "auto", out))


def test_matmul_backward(seeded):
    a = torch.randn(33, 64, device=DEVICE).half().requires_grad_()
    b = torch.randn(64, 40, device=DEVICE).half().requires_grad_()
    out = tmagemm.matmul(a, b, out_dtype=torch.float32)
    grad = torch.randn(33, 40, device=DEVICE)
    out.backward(grad)
    g16 = grad.half().double().cpu()
    assert_close(a.grad, g16 @ b.detach().double().cpu().t(), 1.5e-3, "grad a")
    assert_close(b.grad, a.detach().double().cpu().t() @ g16, 1.5e-3, "grad b")
    with pytest.raises(ValueError, match="does not support automatic differentiation"):
        tmagemm.matmul(a, b, out=torch.empty(33, 40, dtype=torch.float16, device=DEVICE))


# ------------------------------------------------------------------------------ block scales

def _layout(sa_shape, sb_shape, m, n, k, recipe_a=None, recipe_b=None, sb=None):
    sa = torch.ones(sa_shape)
    sb = torch.ones(sb_shape) if sb is None else sb
    return api.scale_layout(sa, sb, m, n, k, recipe_a, recipe_b)


@pytest.mark.parametrize("sa, sb, m, n, k, want", [
    ((1,), (1,), 16, 256, 512, ("tensor", "tensor", False)),
    ((16, 1), (1, 256), 16, 256, 512, ("row", "row", False)),
    ((16, 4), (2, 4), 16, 256, 512, ("1x128", "128x128", False)),  # an HF checkpoint's (NB, KB)
    ((16, 4), (4, 2), 16, 256, 512, ("1x128", "128x128", True)),  # PyTorch's (KB, NB)
    ((16, 5), (8, 5), 16, 1000, 600, ("1x128", "128x128", False)),  # K = 600: 5 k-blocks, the last partial
    ((16, 5), (8, 8), 16, 1000, 600, ("1x128", "128x128", True)),  # PyTorch pads KB to 4: (8, NB)
    ((16, 4), (256, 4), 16, 256, 512, ("1x128", "1x128", False)),  # per output channel
    ((16, 4), (4, 256), 16, 256, 512, ("1x128", "1x128", True)),
    ((16, 1), (2, 4), 16, 256, 512, ("row", "128x128", False)),  # row-wise activations, block weights
    ((1, 4), (1,), 1, 64, 512, ("1x128", "tensor", False)),  # M = 1: (1, KB) is 1x128 (1 element would be tensor)
])
def test_scale_layout_table(sa, sb, m, n, k, want):
    layout = _layout(sa, sb, m, n, k)
    assert (layout.a, layout.b, layout.b_k_first) == want


def test_square_block_scales_follow_their_layout():
    """NB == KB: a row-major scale is the checkpoint's (n-block, k-block), an outer-dim-major one
    PyTorch's (k-block, n-block)."""
    hf = torch.arange(16.0).reshape(4, 4)
    assert not _layout((8, 4), (4, 4), 8, 512, 512, sb=hf).b_k_first
    assert _layout((8, 4), (4, 4), 8, 512, 512, sb=hf.t().contiguous().t()).b_k_first


def test_recipe_keywords_decide_ambiguous_shapes():
    # N = 4, K = 512: (1, 4) is row-wise (1, N) and also one 128-row block of 4 k-blocks.
    assert _layout((2, 1), (1, 4), 2, 4, 512).b == "row"
    assert _layout((2, 1), (1, 4), 2, 4, 512, recipe_b="128x128").b == "128x128"
    from types import SimpleNamespace

    scaling_type = SimpleNamespace(name="BlockWise128x128")  # how torch's ScalingType members read
    assert _layout((2, 1), (1, 4), 2, 4, 512, recipe_b=scaling_type).b == "128x128"
    with pytest.raises(ValueError, match=r"scale_b has shape \(1, 4\); the 1x128 recipe expects \(4, 4\)"):
        _layout((2, 1), (1, 4), 2, 4, 512, recipe_b="1x128")
    with pytest.raises(ValueError, match="weight \\(b\\) only"):
        _layout((2, 4), (1, 4), 2, 4, 512, recipe_a="128x128")
    with pytest.raises(ValueError, match="scale_recipe_b must be"):
        _layout((2, 1), (1, 4), 2, 4, 512, recipe_b="block")


def _block_quantized(m, n, k, device):
    """fp8 operands with random 1x128 / 128x128 scales spanning 1e-3..1e2 (not a quantizer's: the
    GEMM must apply any scales)."""
    kb, nb = -(-k // 128), -(-n // 128)
    a = (torch.randn(m, k, device=device) * 4).to(FP8)
    w = (torch.randn(n, k, device=device) * 4).to(FP8)
    sa = 10 ** (torch.rand(m, kb, device=device) * 5 - 3)
    sb = 10 ** (torch.rand(nb, kb, device=device) * 5 - 3)
    return a, w, sa, sb


def _block_reference(a, w, sa, sb, per_channel=False, bias=None):
    k = a.shape[1]
    kb = torch.arange(k, device=a.device) // 128
    rows = torch.arange(w.shape[0], device=a.device)
    b_scale = sb.double()[rows if per_channel else rows // 128][:, kb]
    ref = (a.double() * sa.double()[:, kb]) @ (w.double() * b_scale).t()
    return ref if bias is None else ref + bias.double()


@pytest.mark.parametrize("m,n,k", [(1, 72, 208), (17, 200, 384), (33, 130, 144)])
@pytest.mark.parametrize("scale_layout", ["row-major", "pytorch"])
def test_block_scaled_scaled_mm(m, n, k, scale_layout, seeded):
    a, w, sa, sb = _block_quantized(m, n, k, DEVICE)
    bias = torch.randn(n, device=DEVICE)
    if scale_layout == "pytorch":  # 1x128 outer-dim-major; 128x128 as (KB, NB), outer-dim-major
        sa_in, sb_in = sa.t().contiguous().t(), sb.t()
    else:
        sa_in, sb_in = sa, sb
    out = poisoned((m, n), torch.float32, DEVICE)
    tmagemm.scaled_mm(a, w.t(), sa_in, sb_in, bias=bias, out=out, out_dtype=torch.float32)
    ref = _block_reference(a, w, sa, sb, bias=bias)
    # fp32 accumulation of exact fp8 products, scaled once per k-block: ~1e-6 of the magnitudes.
    scale = (a.double().abs() * sa.double()[:, torch.arange(k, device=a.device) // 128]).sum(1, keepdim=True)
    bound = 1e-5 * scale * float(sb.max()) * 448 + 1e-5 * ref.abs()
    err = (out.double() - ref).abs()
    assert bool((err <= bound).all()), f"max err / bound {float((err / bound).max()):.3f}"


def test_block_scaled_mixes_with_row_and_per_channel_scales(seeded):
    m, n, k = 9, 100, 304
    a, w, sa, sb = _block_quantized(m, n, k, DEVICE)
    kb = -(-k // 128)
    per_channel = 10 ** (torch.rand(n, kb, device=DEVICE) * 3 - 2)
    row = torch.rand(m, 1, device=DEVICE) + 0.5
    a_abs, w_abs = a.double().abs(), w.double().abs()
    cases = [
        (sa, per_channel, _block_reference(a, w, sa, per_channel, per_channel=True),
         _block_reference(a_abs, w_abs, sa, per_channel, per_channel=True)),
        (row, sb, _block_reference(a, w, row.expand(m, kb), sb), _block_reference(a_abs, w_abs, row.expand(m, kb), sb)),
    ]
    for scale_a, scale_b, ref, mag in cases:
        out = tmagemm.scaled_mm(a, w.t(), scale_a, scale_b, out_dtype=torch.float32)
        # fp8 wgmma sums each 128-deep k-block's products in fewer bits than fp32 (DeepSeek-V3's
        # report: about 14): bounded by the sum of the products' magnitudes, not by |ref|.
        err = (out.double() - ref).abs()
        bound = 2e-4 * mag + 1e-6 * ref.abs()
        assert bool((err <= bound).all()), (f"scale_a {tuple(scale_a.shape)} scale_b {tuple(scale_b.shape)}: "
                                            f"max err / bound {float((err / bound).max()):.3f}")


def test_scale_checks_do_not_specialise_compiled_graphs_on_m():
    """Resolving the scale layout while torch.compile traces must not turn M into a constant
    (formatting a size for an error message would): one graph serves every M."""
    torch._dynamo.reset()
    frames = []

    def backend(graph, example_inputs):
        frames.append(graph)
        return graph.forward

    @torch.compile(backend=backend, dynamic=True, fullgraph=True)
    def layout_and_scale(sa, sb, k):
        layout = api.scale_layout(sa, sb, sa.shape[0], sb.shape[1], 512)
        return sa * (2.0 if layout.a == "row" else 3.0)

    for m in (3, 5, 9, 17):
        assert torch.equal(layout_and_scale(torch.ones(m, 1), torch.ones(1, 64), 512), torch.full((m, 1), 2.0))
    assert len(frames) == 1, f"{len(frames)} graphs for 4 values of M"
    torch._dynamo.reset()


# ------------------------------------------------------------------------------ bad input a new user tried

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton interpreter's limits (CPU)")


@cpu_only
def test_bf16_under_the_interpreter_is_refused():
    """The interpreter's bf16 dot is wrong (relative error ~1e9): refuse instead of returning it."""
    a, b = torch.randn(8, 32).bfloat16(), torch.randn(32, 16).bfloat16()
    with pytest.raises(ValueError, match="interpreter computes bf16"):
        tmagemm.matmul(a, b)
    with pytest.raises(ValueError, match="interpreter computes bf16"):
        torch.ops.tmagemm.matmul(a, b)


@cpu_only
@pytest.mark.parametrize("where", ["a", "b"])
def test_non_finite_fp8_inputs_propagate_under_the_interpreter(where, seeded):
    """The interpreter reads an fp8 NaN as 480; the API recomputes the affected rows (a) or
    columns (b) in float64 as the GPU's arithmetic gives them (e4m3 has no Inf: NaN is the only
    non-finite value it holds)."""
    value = float("nan")
    a, b = fp8_operands(9, 24, 64, "cpu")
    sa, sb = torch.rand(9, 1) + 0.5, torch.rand(1, 24) + 0.5
    a, w = a.clone(), b.t().clone()
    if where == "a":
        a[3, 5] = value
    else:
        w[7, 5] = value
    out = tmagemm.scaled_mm(a, w.t(), sa, sb, out_dtype=torch.float32)
    ref = reference(a, w.t(), sa, sb)
    hit = out[3] if where == "a" else out[:, 7]
    want = ref[3] if where == "a" else ref[:, 7]
    assert bool(want.isnan().all()) and bool(hit.isnan().all()), "a NaN operand makes its whole row / column NaN"
    keep = torch.ones_like(out, dtype=torch.bool)
    keep[3 if where == "a" else slice(None), slice(None) if where == "a" else 7] = False
    assert_close(out[keep].reshape(-1, 1), ref[keep].reshape(-1, 1), 1e-5, "untouched elements")


def test_use_fast_accum_must_be_a_bool():
    a, b, sa, sb = _fp8()
    with pytest.raises(TypeError, match="use_fast_accum must be a bool, got str 'no'"):
        tmagemm.scaled_mm(a, b, sa, sb, use_fast_accum="no")


def test_meta_tensors_propagate_shapes():
    a = torch.empty(7, 64, dtype=FP8, device="meta")
    b = torch.empty(40, 64, dtype=FP8, device="meta").t()
    s = torch.empty(1, device="meta")
    out = tmagemm.scaled_mm(a, b, s, s, out_dtype=torch.float16)
    assert out.device.type == "meta" and out.shape == (7, 40) and out.dtype == torch.float16
    h = tmagemm.matmul(torch.empty(7, 64, dtype=torch.half, device="meta"),
                       torch.empty(64, 40, dtype=torch.half, device="meta"))
    assert h.device.type == "meta" and h.shape == (7, 40) and h.dtype == torch.half


def test_mixed_devices_name_the_tensor_and_the_rule():
    a = torch.empty(7, 64, dtype=torch.half)
    b = torch.empty(64, 40, dtype=torch.half, device="meta")
    with pytest.raises(ValueError, match=r"b is on meta but a is on cpu; move all tensors to one device"):
        tmagemm.matmul(a, b)


def test_ops_take_the_python_defaults_and_check(seeded):
    a, b, sa, sb = _fp8(16, 32, 64)
    out = torch.ops.tmagemm.scaled_mm(a, b, sa, sb)  # bias, out_dtype, use_fast_accum, backend defaulted
    assert out.dtype == torch.bfloat16
    assert_close(out, reference(a, b, sa, sb), 1e-2, "op defaults")
    x, y = torch.randn(16, 32, device=DEVICE).half(), torch.randn(32, 24, device=DEVICE).half()
    assert torch.ops.tmagemm.matmul(x, y).dtype == torch.half
    with pytest.raises(TypeError, match="a must be float8"):
        torch.ops.tmagemm.scaled_mm(a.half(), b, sa, sb)
