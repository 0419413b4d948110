"""Block-scaled FP8 GEMM (triton.blockscaled) and its fused 1x128 / 128x128 quantizers.

CPU runs the kernels under the Triton interpreter with small tiles; tests marked ``gpu`` run the
compiled kernels at the shapes of real checkpoints (ragged M, N = 2112, K = 7000). The GEMM
reference dequantizes both operands block by block in float64; outputs are poisoned with NaN.
"""

import dataclasses
import math

import pytest
import torch
from gemm_ref import FP8, assert_close, poisoned

import tmagemm
from tmagemm import device, tma
from tmagemm import plan as plan_layer
from tmagemm.configs import TritonGemmConfig
from tmagemm.plan import GemmArgs, Scaling
from tmagemm.triton import matmul_blockscaled as bs
from tmagemm.triton import matmul_splitk as splitk
from tmagemm.triton.quantize import quantize_1x128, quantize_128x128

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"
BLOCK_128 = (Scaling.BLOCK_1X128, Scaling.BLOCK_128X128)
PER_CHANNEL = (Scaling.BLOCK_1X128, Scaling.BLOCK_1X128)
TOL = {torch.float32: 1e-5, torch.float16: 1.5e-3, torch.bfloat16: 6e-3}
# Tiles of 64+ rows run on wgmma, whose fp8 adder keeps ~14 mantissa bits within each 128-deep
# block (the recipe's promotion interval, as in DeepGEMM): fp32 outputs then differ from the
# float64 reference by ~1e-4 (measured 1.3e-4 at K = 260 on an H100), not by fp32 rounding.
WGMMA_TOL = {**TOL, torch.float32: 5e-4}
# Small tiles keep the interpreter fast; every CPU shape spans several tiles and k-blocks.
SMALL = TritonGemmConfig(block_m=16, block_n=32, block_k=128, group_m=2, num_stages=2, num_warps=4)
WIDE = TritonGemmConfig(block_m=16, block_n=256, block_k=128, group_m=2, num_stages=2, num_warps=4)
CPU_SHAPES = [(1, 72, 200), (17, 200, 384), (130, 72, 384)]
GPU_SHAPES = [(1, 577, 576), (17, 2112, 7000), (727, 577, 7000), (727, 2112, 576)]


# ------------------------------------------------------------------------------------- helpers


def _kb(k):
    return math.ceil(k / 128)


def _expand(scale: torch.Tensor, rows_per: int, rows: int, cols: int) -> torch.Tensor:
    """A block scale broadcast to every element it applies to (float64)."""
    s = scale.double().cpu().repeat_interleave(128, dim=1)[:, :cols]
    return s.repeat_interleave(rows_per, dim=0)[:rows] if rows_per > 1 else s


def dequantized(a, w, scale_a, scale_b, recipe):
    """a (M, K) and w (N, K) dequantized exactly in float64."""
    m, k = a.shape
    n = w.shape[0]
    a64 = a.double().cpu() * _expand(scale_a, 1, m, k)
    rows_per = 1 if recipe[1] == Scaling.BLOCK_1X128 else 128
    w64 = w.double().cpu() * _expand(scale_b, rows_per, n, k)
    return a64, w64


def block_reference(a, w, scale_a, scale_b, recipe, bias=None):
    a64, w64 = dequantized(a, w, scale_a, scale_b, recipe)
    r = a64 @ w64.t()
    return r if bias is None else r + bias.double().cpu()


def outer_major(t: torch.Tensor) -> torch.Tensor:
    """The same values in PyTorch's outer-dim-major layout (strides (1, rows))."""
    return t.t().contiguous().t()


def padded(t: torch.Tensor, extra: int = 0) -> torch.Tensor:
    """``t`` in a buffer whose row stride is padded by ``extra`` elements and then up to 16 bytes
    (TMA needs 16-byte row strides: a K like 200 or 7000 fp8 values is stored that way)."""
    rows, cols = t.shape
    per_16b = 16 // t.element_size()
    lead = -(-(cols + extra) // per_16b) * per_16b
    view = torch.empty(rows, lead, dtype=t.dtype, device=t.device)[:, :cols]
    view.copy_(t)
    return view


def operands(m, n, k, recipe, device=DEVICE, low=0.5, high=2.0):
    """fp8 a (M, K), weight w (N, K) (row strides padded to 16 bytes) and positive block scales
    log-uniform in [low, high]."""
    a = padded((torch.randn(m, k, device=device) * 2).to(FP8))
    w = padded((torch.randn(n, k, device=device) * 2).to(FP8))
    rows_b = n if recipe[1] == Scaling.BLOCK_1X128 else _kb(n)

    def scales(rows):
        u = torch.rand(rows, _kb(k), device=device)
        return torch.exp(math.log(low) + u * (math.log(high) - math.log(low)))

    return a, w, scales(m), scales(rows_b)


def run(args, config=SMALL):
    assert bs.supports(args) is None, bs.supports(args)
    plan = bs.build(args, config)
    assert plan.variant == "triton.blockscaled" and plan.config == config
    plan(args)
    return plan


# ----------------------------------------------------------------------------------- the GEMM


@pytest.mark.parametrize("recipe", [BLOCK_128, PER_CHANNEL], ids=["128x128", "per_channel"])
@pytest.mark.parametrize("sa_layout", ["row", "outer"])
@pytest.mark.parametrize("bias_dtype,out_dtype", [(None, torch.float32), (torch.bfloat16, torch.float16)])
@pytest.mark.parametrize("m,n,k", CPU_SHAPES)
def test_matches_block_reference(m, n, k, recipe, sa_layout, bias_dtype, out_dtype, seeded):
    a, w, sa, sb = operands(m, n, k, recipe)
    if sa_layout == "outer":
        sa = outer_major(sa)
        assert m == 1 or sa.stride() == (1, m)
    bias = None if bias_dtype is None else torch.randn(n, device=DEVICE).to(bias_dtype)
    out = poisoned((m, n), out_dtype, DEVICE)
    run(GemmArgs(a, w.t(), out, sa, sb, bias, False, recipe))
    assert_close(out, block_reference(a, w, sa, sb, recipe, bias), TOL[out_dtype], f"{m}x{n}x{k} {recipe}")


@pytest.mark.parametrize("config", [SMALL, WIDE, TritonGemmConfig(64, 64, 128, 8, 2, 4)], ids=["32", "256", "64"])
@pytest.mark.parametrize("recipe", [BLOCK_128, PER_CHANNEL], ids=["128x128", "per_channel"])
def test_tile_widths_and_strided_operands(config, recipe, seeded):
    """Tiles narrower and wider than a weight block; padded leading strides of a, out and the
    scales; out too ragged for TMA (masked stores); scale_b outer-dim-major."""
    m, n, k = 33, 300, 260
    a, w, sa, sb = operands(m, n, k, recipe)
    a_pad, w_pad = padded(a, 16), padded(w, 48)
    sa_pad = torch.empty(m, _kb(k) + 5, device=DEVICE)[:, 1:1 + _kb(k)]
    sa_pad.copy_(sa)
    sb = outer_major(sb)
    out = poisoned((m, n + 3), torch.float32, DEVICE)[:, :n]  # row stride 303: no TMA store
    assert bs.layout_of(GemmArgs(a_pad, w_pad.t(), out, sa_pad, sb, None, False, recipe)).tma_store is False
    run(GemmArgs(a_pad, w_pad.t(), out, sa_pad, sb, None, False, recipe), config)
    tol = (WGMMA_TOL if config.block_m >= 64 and ON_GPU else TOL)[torch.float32]
    assert_close(out, block_reference(a, w, sa, sb, recipe), tol, f"{config} {recipe}")


@pytest.mark.parametrize("recipe", [BLOCK_128, PER_CHANNEL], ids=["128x128", "per_channel"])
def test_extreme_scale_ranges(recipe, seeded):
    """Scales spread over 1e-6 .. 1e4 (per block): every element still matches to fp32 rounding
    relative to the sum of magnitudes that formed it."""
    m, n, k = 40, 160, 520
    a, w, sa, sb = operands(m, n, k, recipe, low=1e-6, high=1e4)
    out = poisoned((m, n), torch.float32, DEVICE)
    run(GemmArgs(a, w.t(), out, sa, sb, None, False, recipe))
    a64, w64 = dequantized(a, w, sa, sb, recipe)
    ref, magnitude = a64 @ w64.t(), a64.abs() @ w64.abs().t()
    err = (out.double().cpu() - ref).abs() / magnitude.clamp_min(1e-300)
    assert torch.isfinite(out).all() and err.max() < 2e-6, f"worst relative error {err.max():.3g}"


def test_exact_integer_case():
    """Integer fp8 values and power-of-two scales: every partial sum is exact in fp32, so the
    output equals the reference bit for bit (K ragged: the zero-filled tail adds nothing)."""
    m, n, k = 17, 40, 300
    a = padded(torch.randint(-4, 5, (m, k), device=DEVICE).to(FP8))
    w = padded(torch.randint(-4, 5, (n, k), device=DEVICE).to(FP8))
    sa = torch.exp2(torch.randint(-3, 4, (m, _kb(k)), device=DEVICE).float())
    sb = torch.exp2(torch.randint(-3, 4, (1, _kb(k)), device=DEVICE).float())
    out = poisoned((m, n), torch.float32, DEVICE)
    run(GemmArgs(a, w.t(), out, sa, sb, None, False, BLOCK_128))
    assert torch.equal(out.double().cpu(), block_reference(a, w, sa, sb, BLOCK_128))


def test_quantized_linear_end_to_end(seeded):
    """quantize_1x128(x) x quantize_128x128(w) through the GEMM: exact to the dequantized
    reference, and close to the unquantized x @ w.T."""
    m, n, k = 20, 136, 264
    x = torch.randn(m, k, device=DEVICE)
    wt = torch.randn(n, k, device=DEVICE) * 0.05
    xq, sx = quantize_1x128(x)
    wq, sw = quantize_128x128(wt)
    bias = torch.randn(n, device=DEVICE)
    out = poisoned((m, n), torch.float32, DEVICE)
    run(GemmArgs(xq, wq.t(), out, sx, sw, bias, False, BLOCK_128))
    assert_close(out, block_reference(xq, wq, sx, sw, BLOCK_128, bias), TOL[torch.float32], "dequantized")
    exact = x.double().cpu() @ wt.double().cpu().t() + bias.double().cpu()
    assert_close(out, exact, 0.06, "unquantized")  # two 3-bit-mantissa roundings


def _args(m=17, n=72, k=200, recipe=BLOCK_128, **change):
    a, w, sa, sb = operands(m, n, k, recipe)
    fields = dict(a=a, b=w.t(), out=torch.empty(m, n, dtype=torch.bfloat16, device=DEVICE), scale_a=sa,
                  scale_b=sb, bias=None, fast_accum=False, block_scaling=recipe)
    fields.update(change)
    return GemmArgs(**fields)


@pytest.mark.parametrize("change,words", [
    (dict(block_scaling=None), "no block scaling"),
    (dict(block_scaling=(Scaling.BLOCK_128X128, Scaling.BLOCK_128X128)), "is not (BLOCK_1X128"),
    (dict(b=torch.zeros(200, 72, device=DEVICE).to(FP8)), "b (200, 72) must be column-major"),
    (dict(a=torch.zeros(200, 17, device=DEVICE).to(FP8).t()), "a (17, 200) must be row-major"),
    (dict(a=torch.zeros(17, 200, device=DEVICE, dtype=torch.bfloat16)), "must be float8_e4m3fn"),
    (dict(out=torch.empty(17, 72, device=DEVICE, dtype=torch.float8_e4m3fn)), "out must be"),
    (dict(out=torch.empty(72, 17, device=DEVICE).t()), "out (17, 72) must be row-major"),
    (dict(scale_a=None), "scale_a is missing"),
    (dict(scale_a=torch.ones(17, device=DEVICE)), "scale_a has shape (17,)"),
    (dict(scale_b=torch.ones(72, 2, device=DEVICE)), "scale_b has shape (72, 2); 128x128"),
    (dict(scale_b=torch.ones(1, 2, device=DEVICE, dtype=torch.float16)), "scale_b must be float32"),
    (dict(bias=torch.ones(71, device=DEVICE)), "bias must be"),
    (dict(a=torch.zeros(0, 200, device=DEVICE).to(FP8), out=torch.empty(0, 72, device=DEVICE),
          scale_a=torch.ones(0, 2, device=DEVICE)), "zero-size"),
])
def test_supports_names_the_reason(change, words):
    reason = bs.supports(_args(**change))
    assert reason is not None and words in reason, reason
    with pytest.raises(ValueError, match="triton.blockscaled cannot run"):
        bs.build(_args(**change), SMALL)


def test_supports_per_channel_shape_and_misaligned_b():
    assert bs.supports(_args(recipe=PER_CHANNEL)) is None
    reason = bs.supports(_args(recipe=PER_CHANNEL, scale_b=torch.ones(1, 2, device=DEVICE)))
    assert "(72, 2)" in reason and "per-channel" in reason
    w = torch.zeros(72, 200 + 8, device=DEVICE).to(FP8)[:, 1:201]  # base off 16 bytes: no tensor map
    args = _args(b=w.t())
    assert bs.supports(args) is None and not bs.layout_of(args).operand_tma  # pointer loads instead


def test_configs_and_heuristic():
    for config in bs.CONFIGS:
        assert bs.is_valid(config, 2) and bs.is_valid(config.fitted(1, 1, 4), 4), config
    assert not bs.is_valid(TritonGemmConfig(64, 64, 64, 8, 4, 4), 2)  # K step must be the scale block
    with pytest.raises(ValueError, match="block_k must be 128"):
        bs.build(_args(), TritonGemmConfig(16, 32, 64, 2, 2, 4))
    for m in (1, 17, 64, 256, 727, 4096):
        for n in (577, 2112, 7168):
            config = bs.heuristic_for(m, n, 7168, 132)
            assert bs.is_valid(config, 2) and bs.is_valid(config.fitted(1, 1, 4), 4), (m, n, config)
            assert m > 128 or (config.block_m, config.block_n) == (64, 64)
    # Winners of the H100 sweep the heuristic was fitted to.
    tile = {(m, n): (c.block_m, c.block_n) for m, n in ((256, 2112), (256, 4096), (512, 2112), (1024, 2112),
                                                         (1024, 4096), (256, 7168)) for c in [bs.heuristic_for(m, n, 0, 132)]}
    assert tile == {(256, 2112): (64, 64), (256, 4096): (64, 128), (512, 2112): (128, 64), (1024, 2112): (128, 64),
                    (1024, 4096): (128, 128), (256, 7168): (128, 128)}


def test_variant_and_aot_spec():
    (variant,) = bs.VARIANTS
    assert variant.name == "triton.blockscaled" and variant.backend == "triton" and variant.build is bs.build
    spec = bs.aot_spec()
    assert spec.signature["a_desc"] == "tensordesc<fp8e4nv[128, 128]>"
    assert spec.signature["M"] == "i32" and "M" not in spec.attrs and "stride_sak" not in spec.attrs
    assert spec.constexprs["B_PER_CHANNEL"] is False and spec.constexprs["bias_ptr"] is None


# ---------------------------------------------------------------------------------- quantizers


def quantize_reference(x, rows_per, dtype=FP8, pow2=False):
    """Block quantization in torch (float32, IEEE division): values and scales."""
    r, k = x.shape
    fp8_max = torch.finfo(dtype).max
    xf = x.float().cpu()
    rb, kb = math.ceil(r / rows_per), _kb(k)
    padded = torch.zeros(rb * rows_per, kb * 128)
    padded[:r, :k] = xf.abs()
    amax = padded.view(rb, rows_per, kb, 128).amax(dim=(1, 3))
    scale = (amax / fp8_max).clamp(min=torch.finfo(torch.float32).tiny)
    if pow2:
        mantissa, exponent = torch.frexp(scale)  # scale = mantissa * 2^exponent, mantissa in [0.5, 1)
        scale = torch.ldexp(torch.ones_like(scale), torch.where(mantissa == 0.5, exponent - 1, exponent))
    full = scale.repeat_interleave(rows_per, 0).repeat_interleave(128, 1)[:r, :k]
    q = (xf / full).clamp(-fp8_max, fp8_max).to(dtype)
    return q, scale, full


QUANTIZERS = {"1x128": (quantize_1x128, 1), "128x128": (quantize_128x128, 128)}


@pytest.mark.parametrize("which", list(QUANTIZERS))
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("shape", [(1, 1), (17, 200), (130, 384), (129, 129)])
def test_quantizer_matches_torch(which, in_dtype, pow2, shape, seeded):
    fn, rows_per = QUANTIZERS[which]
    x = (torch.randn(*shape, device=DEVICE) * 3).to(in_dtype)
    x[0, 0] = 1e-3 * x.abs().max()  # a value in fp8's subnormal range after scaling
    q, scale = fn(x, pow2_scale=pow2)
    q_ref, scale_ref, full = quantize_reference(x, rows_per, pow2=pow2)
    assert q.shape == x.shape and q.dtype == FP8 and q.stride() == (-(-shape[1] // 16) * 16, 1)
    assert scale.shape == scale_ref.shape and scale.dtype == torch.float32 and scale.is_contiguous()
    assert torch.equal(scale.cpu(), scale_ref), (scale.cpu() - scale_ref).abs().max()
    assert torch.equal(q.float().cpu(), q_ref.float()), "fp8 values differ from torch's rounding"
    if pow2:
        mantissa, _ = torch.frexp(scale.cpu())
        assert (mantissa == 0.5).all(), "pow2 scales must be powers of two"
    # One fp8 rounding: relative error <= 2^-4 of each value, plus the subnormal step.
    xf = x.float().cpu()
    back = q.float().cpu() * full
    worst = ((back - xf).abs() - (xf.abs() * 2.0**-4 + full * 2.0**-9)).max()
    assert worst <= 0, f"round trip off by {worst:.3g} beyond the bound"


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("shape", [(1, 1), (17, 200), (130, 384), (727, 300)])
def test_quantizer_m_major_scales(shape, pow2, seeded):
    """scale_layout="m-major": the row-major quantizer's values, the scales contiguous along M with
    the column stride M rounded up to 4, in a buffer ending at the last scale: a layout a tensor
    map describes (what the native kernel loads by TMA)."""
    x = torch.randn(*shape, device=DEVICE) * torch.logspace(-2, 2, shape[1], device=DEVICE)
    q, scale = tmagemm.quantize_fp8(x, "1x128", scale_layout="m-major", pow2_scale=pow2)
    q_ref, scale_ref, _ = quantize_reference(x, 1, pow2=pow2)
    m, kb = scale_ref.shape
    assert scale.shape == (m, kb) and scale.stride() == (1, -(-m // 4) * 4)
    assert scale.untyped_storage().nbytes() == 4 * ((kb - 1) * scale.stride(1) + m)
    assert tma.map_reason(scale, "scale_a", (1, 0), address=False) is None
    assert torch.equal(scale.cpu(), scale_ref) and torch.equal(q.float().cpu(), q_ref.float())


def test_quantizer_scale_layout_refusals():
    x = torch.randn(4, 256, device=DEVICE)
    with pytest.raises(ValueError, match="scale_layout must be one of 'row-major', 'm-major', got 'col'"):
        tmagemm.quantize_fp8(x, "1x128", scale_layout="col")
    for granularity in ("tensor", "row", "128x128"):
        with pytest.raises(ValueError, match=f"applies to granularity '1x128'.*got '{granularity}'"):
            tmagemm.quantize_fp8(x, granularity, scale_layout="m-major")
    q, scale = tmagemm.quantize_fp8(x[:0], "1x128", scale_layout="m-major")
    assert q.shape == (0, 256) and scale.shape == (0, 2)


@pytest.mark.parametrize("which", list(QUANTIZERS))
def test_quantizer_e5m2(which, seeded):
    fn, rows_per = QUANTIZERS[which]
    x = torch.randn(33, 300, device=DEVICE) * torch.logspace(-3, 3, 300, device=DEVICE)
    q, scale = fn(x, dtype=torch.float8_e5m2)
    q_ref, scale_ref, _ = quantize_reference(x, rows_per, dtype=torch.float8_e5m2)
    assert q.dtype == torch.float8_e5m2 and torch.equal(scale.cpu(), scale_ref)
    assert torch.equal(q.float().cpu(), q_ref.float())


@pytest.mark.parametrize("which", list(QUANTIZERS))
def test_quantizer_strided_rows_and_zero_groups(which):
    fn, rows_per = QUANTIZERS[which]
    base = torch.randn(140, 300, device=DEVICE)
    x = base[:, 10:270]  # row stride 300, contiguous columns
    x[:, 128:256] = 0.0  # an all-zero column group
    q, scale = fn(x)
    q_ref, scale_ref, _ = quantize_reference(x, rows_per)
    assert torch.equal(scale.cpu(), scale_ref) and torch.equal(q.float().cpu(), q_ref.float())
    assert (scale[:, 1] == torch.finfo(torch.float32).tiny).all() and not q[:, 128:256].float().any()
    with pytest.raises(ValueError, match="contiguous last dimension"):
        fn(base.t())


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf / inf in the interpreter
@pytest.mark.parametrize("which", list(QUANTIZERS))
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_quantizer_refuses_non_finite(which, bad):
    fn, _ = QUANTIZERS[which]
    x = torch.randn(20, 300, device=DEVICE)
    x[13, 260] = bad
    kind = "NaN" if math.isnan(bad) else "Inf"
    where = "row 13" if which == "1x128" else "rows 0..19"
    with pytest.raises(ValueError, match=rf"holds {kind} .*first at {where}, columns 256..299"):
        fn(x)


def test_quantizer_zero_size_and_types():
    q, scale = quantize_1x128(torch.empty(0, 300, device=DEVICE))
    assert q.shape == (0, 300) and scale.shape == (0, 3)
    q, scale = quantize_128x128(torch.empty(5, 0, device=DEVICE))
    assert q.shape == (5, 0) and scale.shape == (1, 0)
    with pytest.raises(TypeError, match="float16/bfloat16/float32"):
        quantize_1x128(torch.zeros(4, 4, device=DEVICE, dtype=torch.float64))
    with pytest.raises(ValueError, match="2-D"):
        quantize_128x128(torch.zeros(4, device=DEVICE))


# ------------------------------------------------------------------------------------ GPU only


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", [BLOCK_128, PER_CHANNEL], ids=["128x128", "per_channel"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m,n,k", GPU_SHAPES)
def test_gpu_checkpoint_shapes(m, n, k, recipe, out_dtype, seeded):
    a, w, sa, sb = operands(m, n, k, recipe, device="cuda")
    sa = outer_major(sa) if m % 2 else sa
    bias = torch.randn(n, device="cuda").to(torch.bfloat16) if k == 576 else None
    args = GemmArgs(a, w.t(), poisoned((m, n), out_dtype, "cuda"), sa, sb, bias, False, recipe)
    plan = bs.build(args)  # the heuristic (or a tuned) config, direct launch
    assert plan.direct and plan.device_index == 0
    plan(args)
    torch.cuda.synchronize()
    assert_close(args.out, block_reference(a, w, sa, sb, recipe, bias), WGMMA_TOL[out_dtype], f"{m}x{n}x{k}")
    if out_dtype != torch.bfloat16:
        return
    # The same plan serves new operands of the same signature (pointers re-bound per call).
    a2, w2, sa2, sb2 = operands(m, n, k, recipe, device="cuda")
    sa2 = outer_major(sa2) if m % 2 else sa2
    out2 = poisoned((m, n), out_dtype, "cuda")
    plan.run(a2, w2.t(), out2, sa2, sb2, bias)
    assert_close(out2, block_reference(a2, w2, sa2, sb2, recipe, bias), WGMMA_TOL[out_dtype], "second call")


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(33, 2112, 7168), (64, 4096, 4096), (47, 1000, 4400), (32, 8448, 3072),
                                   (17, 8500, 3100), (128, 2112, 7168), (100, 2500, 8000)])
def test_gpu_small_m_auto(m, n, k, seeded):
    """What "auto" runs between decode and the tile kernels: unswapped 64 x 64 split-K tiles at
    M = 33-64 and on narrow weights with a long K up to 128 (ragged N and K included), and
    split-K on weights wide enough to fill the SMs at M <= 32; through the public API, row-major and outer-dim-major scale_a."""
    a, w, sa, sb = operands(m, n, k, BLOCK_128, device="cuda")
    args = GemmArgs(a, w.t(), poisoned((m, n), torch.bfloat16, "cuda"), sa, sb, None, True, BLOCK_128)
    assert plan_layer.preference(args)[0] == "triton.splitk"
    config = splitk.choose_block_config(m, n, k, device.sms_of(args.out.device))
    assert (config.block_m, config.swap_ab) == plan_layer.block_tiling(m, n, k, device.sms_of(args.out.device))[:2]
    assert config.swap_ab == (m <= plan_layer.BLOCK_SWAP_MAX_M)
    want = block_reference(a, w, sa, sb, BLOCK_128)
    for scale_a in (sa, outer_major(sa)):
        out = tmagemm.scaled_mm(a, w.t(), scale_a, sb, out_dtype=torch.bfloat16, scale_recipe_a="1x128",
                               scale_recipe_b="128x128")
        assert_close(out, want, WGMMA_TOL[torch.bfloat16], f"{m}x{n}x{k}")


@pytest.mark.gpu
@pytest.mark.parametrize("config", bs.CONFIGS, ids=str)
def test_gpu_every_config(config, seeded):
    m, n, k = 300, 640, 1100
    a, w, sa, sb = operands(m, n, k, BLOCK_128, device="cuda")
    out = poisoned((m, n), torch.bfloat16, "cuda")
    run(GemmArgs(a, w.t(), out, sa, sb, None, False, BLOCK_128), config)
    assert_close(out, block_reference(a, w, sa, sb, BLOCK_128), WGMMA_TOL[torch.bfloat16], str(config))


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(129, 2112, 7168), (727, 577, 7000), (1100, 2112, 576), (4096, 4096, 1024)])
def test_gpu_m_major_activation_scales(m, n, k, seeded):
    """The quantizers' m-major activation scales (what tmagemm.nn passes above 128 rows, loaded by
    TMA where the native kernel can) give the float64 block reference, and the very output of
    the same values as row-major scales."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 3
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    a, sa = tmagemm.quantize_fp8(x, "1x128", scale_layout="m-major")
    wq, sb = tmagemm.quantize_fp8(w, "128x128")
    assert sa.stride() == (1, -(-m // 4) * 4)
    out = poisoned((m, n), torch.bfloat16, "cuda")
    tmagemm.scaled_mm(a, wq.t(), sa, sb, out=out)
    row_major = poisoned((m, n), torch.bfloat16, "cuda")
    tmagemm.scaled_mm(a, wq.t(), sa.contiguous(), sb, out=row_major)
    assert_close(out, block_reference(a, wq, sa, sb, BLOCK_128), WGMMA_TOL[torch.bfloat16], f"{m}x{n}x{k}")
    assert torch.equal(out, row_major)


@pytest.mark.gpu
@pytest.mark.parametrize("which", list(QUANTIZERS))
@pytest.mark.parametrize("pow2", [False, True])
def test_gpu_quantizers_match_torch(which, pow2, seeded):
    fn, rows_per = QUANTIZERS[which]
    x = (torch.randn(727, 7000, device="cuda") * 5).to(torch.bfloat16)
    q, scale = fn(x, pow2_scale=pow2)
    q_ref, scale_ref, _ = quantize_reference(x, rows_per, pow2=pow2)
    assert torch.equal(scale.cpu(), scale_ref)
    assert torch.equal(q.float().cpu(), q_ref.float())


@pytest.mark.parametrize("m,n,k", [(1, 72, 700), (17, 200, 1000), (33, 130, 257)])
def test_k_without_a_tensor_map_takes_pointer_loads(m, n, k, seeded):
    """K * 1 byte not a multiple of 16 (K = 7000 in checkpoints' terms): TMA cannot describe the
    operands, so the kernel reads them with masked pointer loads; same float64 emulation."""
    kb, nb = -(-k // 128), -(-n // 128)
    a = (torch.randn(m, k, device=DEVICE) * 4).to(FP8)
    w = (torch.randn(n, k, device=DEVICE) * 4).to(FP8)
    sa, sb = torch.rand(m, kb, device=DEVICE) + 0.5, torch.rand(nb, kb, device=DEVICE) + 0.5
    out = torch.full((m, n), float("nan"), device=DEVICE)
    args = GemmArgs(a, w.t(), out, sa, sb, None, True, (Scaling.BLOCK_1X128, Scaling.BLOCK_128X128))
    assert not bs.layout_of(args).operand_tma
    bs.build(args)(args)
    per_k = torch.arange(k, device=DEVICE) // 128
    a_deq = a.double() * sa.double()[:, per_k]
    w_deq = w.double() * sb.double()[torch.arange(n, device=DEVICE) // 128][:, per_k]
    ref, magnitude = a_deq @ w_deq.t(), a_deq.abs() @ w_deq.abs().t()
    # Within a k-block wgmma's fp8 adder (GPU) rounds like fast accumulation: 2^-10 of sum |a||b|.
    assert bool(((out.double() - ref).abs() <= 2.0**-10 * magnitude + 1e-6).all())


def m_contiguous(t: torch.Tensor, lead: int | None = None) -> torch.Tensor:
    """``t`` (M, KB) contiguous along M with a column stride of ``lead`` (default M rounded up to
    4: DeepGEMM's TMA-aligned layout), in a buffer whose padding rows hold NaN."""
    rows, cols = t.shape
    lead = lead or -(-rows // 4) * 4
    view = torch.full((cols, lead), float("nan"), dtype=t.dtype, device=t.device)[:, :rows].t()
    view.copy_(t)
    return view


@pytest.mark.anydevice
@pytest.mark.parametrize("m", [17, 40, 130])
@pytest.mark.parametrize("recipe", [BLOCK_128, PER_CHANNEL], ids=["128x128", "per_channel"])
def test_m_contiguous_scales_in_chunks(m, recipe, seeded):
    """a's scales contiguous along M (PyTorch's outer-dim-major layout and DeepGEMM's, whose
    column stride is M rounded up to 4) reach both Triton block kernels in chunks of k-blocks:
    18 k-blocks (ragged K) make two whole chunks and a partial one, and split-K's slices start
    inside a chunk (9 k-blocks each); NaN in the padding rows of the scale buffer never reaches
    a stored row. Row-major scales keep the per-step loads."""
    n, k = 200, 2200
    a, w, sa, sb = operands(m, n, k, recipe)
    want = block_reference(a, w, sa, sb, recipe)
    tol = (WGMMA_TOL if ON_GPU else TOL)[torch.float32]
    for scale_a in (outer_major(sa), m_contiguous(sa)):
        args = GemmArgs(a, w.t(), poisoned((m, n), torch.float32, DEVICE), scale_a, sb, None, True, recipe)
        assert bs.layout_of(args).scale_a_chunks and not bs.layout_of(args._replace(scale_a=sa)).scale_a_chunks
        run(args)
        assert_close(args.out, want, tol, f"tile kernel, M = {m}, stride {scale_a.stride()}")
        for swap in (True, False):
            out = poisoned((m, n), torch.float32, DEVICE)
            config = splitk.SplitKConfig(block_m=16, block_n=64, block_k=128, split_k=2, swap_ab=swap, a_tma=True,
                                         num_stages=2)
            splitk.build(args._replace(out=out), config)(args._replace(out=out))
            assert_close(out, want, tol, f"split-K, swap {swap}, M = {m}, stride {scale_a.stride()}")


# ------------------------------------------------------------- small M: split-K (triton.splitk)


@pytest.mark.parametrize("split,swap,a_tma", [(1, True, False), (3, True, True), (2, False, False), (2, False, True)],
                         ids=["whole_k", "split3_swap_tma", "split2_noswap", "split2_noswap_tma"])
@pytest.mark.parametrize("recipe", [BLOCK_128, PER_CHANNEL], ids=["128x128", "per_channel"])
@pytest.mark.parametrize("m,n,k", [(1, 72, 200), (17, 200, 640), (40, 130, 384)])
def test_splitk_block_scaled(m, n, k, recipe, split, swap, a_tma, seeded):
    """The small-M kernel promotes each 128-deep k-block with its scales, in every K slice, and
    sums the slices' dequantised partials; ragged M, N and K; outer-dim-major scale_a."""
    a, w, sa, sb = operands(m, n, k, recipe)
    sa = outer_major(sa)
    bias = torch.randn(n, device=DEVICE).to(torch.bfloat16) if split == 3 else None
    args = GemmArgs(a, w.t(), poisoned((m, n), torch.float32, DEVICE), sa, sb, bias, True, recipe)
    assert splitk.supports(args) is None, splitk.supports(args)
    # On a GPU the kernel's tiles are at least 64 wide (SplitKConfig.gpu_reason); the interpreter
    # takes the narrower, faster tile.
    config = splitk.SplitKConfig(block_m=16, block_n=64 if ON_GPU else 32, block_k=128, split_k=split, swap_ab=swap,
                                 a_tma=a_tma, num_stages=2)
    plan = splitk.build(args, config)
    plan(args)
    tol = WGMMA_TOL if ON_GPU else TOL
    assert_close(args.out, block_reference(a, w, sa, sb, recipe, bias), tol[torch.float32], f"{m}x{n}x{k}")


def test_splitk_refuses_what_block_rules_refuse():
    a, w, sa, sb = operands(4, 72, 200, BLOCK_128, device="cpu")
    good = GemmArgs(a, w.t(), torch.empty(4, 72), sa, sb, None, True, BLOCK_128)
    assert splitk.supports(good) is None
    assert "scale_b has shape" in splitk.supports(good._replace(scale_b=sb[:, :1]))
    assert "small M" in splitk.supports(good._replace(a=padded(torch.zeros(129, 200).to(FP8)),
                                                      out=torch.empty(129, 72), scale_a=torch.ones(129, 2)))
    unaligned = torch.empty(72, 201, dtype=FP8)[:, :200]  # a row stride TMA cannot describe
    assert "pointer loads" in splitk.supports(good._replace(b=unaligned.t()))
    fits = splitk.SplitKConfig(block_m=16, block_n=32, block_k=128, split_k=1, swap_ab=True, a_tma=False,
                               num_stages=2)
    for bad in (dict(block_k=64), dict(block_n=256)):  # a K step off the scale block; a tile over two
        with pytest.raises(ValueError, match="block-scaled problems need block_k = 128"):
            splitk.build(good, dataclasses.replace(fits, **bad))
