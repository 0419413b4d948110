"""The fused gate/up projection (tmagemm.gate_up_silu_quant, kernel tmagemm.triton.gate_up).

CPU runs the kernel under the Triton interpreter on small ragged shapes with explicit configs
(split and unsplit, swap-AB and not) and compiles it ahead of time for sm_90a (wgmma, TMA, no
spills, the direct launch's parameter plan); tests marked ``gpu`` run it at decode shapes
(Llama-3-8B's MLP and a ragged one, every M from 1 to 130), deterministically, in a CUDA graph
and under torch.compile(fullgraph=True).

The reference dequantizes xq and w block by block in float64, forms g, u and h = silu(g) * u
there, and holds the kernel's output to the fp8 rounding of h: |hq * hs - h| <= 2^-4 |h| plus
half a subnormal step (and a little for fp32 vs float64 in g and u), and hs to amax(h) / 448
within 1e-5. Outputs are poisoned (e4m3 NaN bytes, NaN scales) before every call.
"""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

import tmagemm
from tmagemm import envs, gate_up, plan
from tmagemm.triton import gate_up as kernel
from tmagemm.triton.common import HAS_GDC
from tmagemm.triton.quantize import fp8_grid, quantize_1x128, quantize_row_groups

FP8 = torch.float8_e4m3fn
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
interpreter_only = pytest.mark.skipif(not envs.interpret(), reason="interpreter-sized shapes; GPU tests cover real ones")


# ------------------------------------------------------------------------------------- helpers


def operands(m, h, i, device=DEVICE, seed=0):
    """xq, sx from a random activation and w, sw from a random [W_gate; W_up] (scaled so g and u
    are O(1)), all through tmagemm's quantizers (xq, w rows padded to 16 bytes when H is not)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, h, device=device, generator=gen)
    w = torch.randn(2 * i, h, device=device, generator=gen) / math.sqrt(h)
    xq, sx = tmagemm.quantize_fp8(x, "1x128")
    wq, sw = tmagemm.quantize_fp8(w, "128x128")
    return xq, sx, wq, sw


# Accumulation error of g and u per unit of sum |x||w|: fp32 sums under the interpreter; on the
# GPU wgmma's fp8 adder within each 128-deep block (promoted to fp32 between blocks), as
# tests/test_nn.py bounds the block-scaled layers.
ACCUMULATION = 2.0**-12 if DEVICE == "cuda" else 2.0**-20


def reference(xq, sx, w, sw):
    """(h, size): h = silu(g) * u in float64 on the CPU from the exactly dequantized operands, and
    what an accumulation error of one unit per sum |x||w| in g and u can move h by."""
    h, i = xq.shape[1], w.shape[0] // 2
    kb = torch.arange(h) // 128
    x64 = xq.double().cpu() * sx.double().cpu()[:, kb]
    w64 = w.double().cpu() * sw.double().cpu()[torch.arange(2 * i) // 128][:, kb]
    g, u = x64 @ w64[:i].t(), x64 @ w64[i:].t()
    size_g, size_u = x64.abs() @ w64[:i].abs().t(), x64.abs() @ w64[i:].abs().t()
    silu = g * torch.sigmoid(g)
    # |d silu / dg| <= 1.1
    return silu * u, 1.1 * size_g * u.abs() + silu.abs() * size_u


def poisoned_out(m, i, device=DEVICE):
    """(hq, hs) full of NaN (0x7F is e4m3fn's NaN), so an unwritten element fails the checks."""
    hq = torch.full((m, i), 0x7F, dtype=torch.uint8, device=device).view(FP8)
    return hq, torch.full((m, i // 128), float("nan"), device=device)


def check(hq, hs, ref, what=""):
    """hq * hs against ``ref`` (float64 h and its accumulation size) element by element, and hs
    against amax(h) / 448."""
    ref, size = ref
    m, i = ref.shape
    got_s = hs.double().cpu()
    got = hq.double().cpu() * got_s.repeat_interleave(128, dim=1)
    assert torch.isfinite(got).all(), f"{what}: unwritten (NaN) outputs at {(~torch.isfinite(got)).nonzero()[:4].tolist()}"
    # fp8 rounding of h: half an ulp (2^-4 relative) for normals, half the 2^-9 subnormal step of
    # the scale below them; plus the accumulation error of the h the kernel rounds (a lost
    # k-block, a wrong scale or gate and up swapped miss by O(1)).
    bound = 2.0**-4 * ref.abs() + 2.0**-10 * got_s.repeat_interleave(128, dim=1) + 1.07 * ACCUMULATION * size
    bad = ~((got - ref).abs() <= bound)
    if bad.any():
        r, c = bad.nonzero()[0].tolist()
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.numel()} elements off; first at ({r}, {c}): got "
                             f"{float(got[r, c]):.6g}, want {float(ref[r, c]):.6g} +- {float(bound[r, c]):.3g}")
    amax = ref.abs().reshape(m, i // 128, 128).amax(dim=2)
    want_s = (amax / 448).clamp(min=torch.finfo(torch.float32).tiny)
    slack = ACCUMULATION * size.reshape(m, i // 128, 128).amax(dim=2) / 448
    off = (got_s - want_s).abs() - 1e-6 * want_s - slack
    assert bool((off <= 0).all()), (f"{what}: scale {float((got_s - want_s).abs().max() / want_s.max()):.2e} "
                                    "(relative) from amax(h) / 448")


def call(xq, sx, w, sw, config=None, pow2=False):
    """One launch into poisoned outputs, through the plan layer's run with ``config``."""
    out = poisoned_out(xq.shape[0], w.shape[0] // 2, xq.device)
    args = gate_up.make_args(xq, sx, w, sw, pow2, out)
    hq, hs = gate_up.run(args, config)
    assert hq is out[0] and hs is out[1]
    return hq, hs


# ----------------------------------------------------------------------------- the kernel (CPU)

# (M, H, I): ragged M (a partial token tile), H off 128 (200: one and a half k-blocks, rows
# padded to 208 bytes; 576: 4.5 k-blocks), I of one and of three groups.
SHAPES = [(1, 200, 128), (17, 576, 384), (70, 200, 384), (17, 200, 128)]
CONFIGS = {
    "heuristic": None,
    "swap16_split3": kernel.GateUpConfig(block_m=16, split_k=3, swap_ab=True, num_stages=2),
    "swap32_split2": kernel.GateUpConfig(block_m=32, split_k=2, swap_ab=True, num_stages=2),
    "tile16_split2": kernel.GateUpConfig(block_m=16, split_k=2, swap_ab=False, num_stages=2),
    "tile64": kernel.GateUpConfig(block_m=64, split_k=1, swap_ab=False, num_stages=2, num_warps=8),
}


@interpreter_only
@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("m,h,i", SHAPES, ids=lambda v: str(v))
def test_matches_float64_reference(m, h, i, config):
    xq, sx, w, sw = operands(m, h, i, seed=m * h + i)
    hq, hs = call(xq, sx, w, sw, CONFIGS[config])
    assert hq.shape == (m, i) and hq.dtype == FP8 and hs.shape == (m, i // 128) and hs.dtype == torch.float32
    check(hq, hs, reference(xq, sx, w, sw), f"{m}x{h}x{i} {config}")


@interpreter_only
@pytest.mark.parametrize("band", [1, 2, 3])
@pytest.mark.parametrize("config", ["tile16", "tile16_split2", "swap16_split3"])
def test_token_tiles_walk_in_bands(band, config, monkeypatch):
    """The tile order's bands of token tiles (a band of 2 or 3 over 5 tiles leaves a partial last
    band; a band of 1 walks the groups first) cover every tile once, with and without a K split."""
    monkeypatch.setattr(kernel, "BAND_M_TILES", band)
    m, h, i = 70, 200, 384
    xq, sx, w, sw = operands(m, h, i, seed=band)
    unsplit = kernel.GateUpConfig(block_m=16, split_k=1, swap_ab=False, num_stages=2)
    hq, hs = call(xq, sx, w, sw, unsplit if config == "tile16" else CONFIGS[config])
    check(hq, hs, reference(xq, sx, w, sw), f"band {band} {config}")


@interpreter_only
def test_split_and_unsplit_agree_and_outer_major_scales():
    """A K split changes only the fp32 summation order; sx in PyTorch's outer-dim-major layout
    (strides (1, M)) and a strided sw view are read through their strides."""
    m, h, i = 9, 576, 256
    xq, sx, w, sw = operands(m, h, i, seed=3)
    whole = call(xq, sx, w, sw, kernel.GateUpConfig(block_m=16, split_k=1, swap_ab=True, num_stages=2))
    sx_outer = sx.t().contiguous().t()
    sw_padded = torch.ones(sw.shape[0], sw.shape[1] + 3)
    sw_padded[:, : sw.shape[1]] = sw
    split = call(xq, sx_outer, w, sw_padded[:, : sw.shape[1]], CONFIGS["swap16_split3"])
    ref = reference(xq, sx, w, sw)
    check(*whole, ref, "whole K")
    check(*split, ref, "split K, strided scales")
    # Off a rounding boundary, both give the same fp8 value; scales agree to fp32 summation order.
    assert (whole[0].float() == split[0].float()).float().mean() > 0.99
    assert torch.allclose(whole[1], split[1], rtol=1e-5, atol=0)


@interpreter_only
def test_pow2_scales():
    xq, sx, w, sw = operands(5, 200, 128, seed=5)
    hq, hs = call(xq, sx, w, sw, pow2=True)
    ref, _ = reference(xq, sx, w, sw)
    mant, _ = torch.frexp(hs)
    assert bool((mant == 0.5).all()), "pow2_scale: every scale is a power of two"
    amax = ref.abs().reshape(5, 1, 128).amax(dim=2).float()
    assert bool((hs >= amax / 448 * (1 - 1e-5)).all()) and bool((hs < amax / 448 * 2).all())
    got = hq.double() * hs.double().repeat_interleave(128, dim=1)
    assert float(((got - ref).abs() / ref.abs().amax()).max()) < 2.0**-4


@interpreter_only
def test_zero_tokens_and_zero_hidden():
    xq, sx, w, sw = operands(0, 200, 128)
    hq, hs = tmagemm.gate_up_silu_quant(xq, sx, w, sw)
    assert hq.shape == (0, 128) and hs.shape == (0, 1)
    xq = torch.empty(3, 0, dtype=FP8)
    w = torch.empty(256, 0, dtype=FP8)
    hq, hs = tmagemm.gate_up_silu_quant(xq, torch.empty(3, 0), w, torch.empty(2, 0), out=poisoned_out(3, 128, "cpu"))
    assert bool((hq.float() == 0).all()) and bool((hs == torch.finfo(torch.float32).tiny).all())


@interpreter_only
def test_public_api_out_and_plan_cache():
    """The public function plans once per signature (in the plan layer's one cache) and writes
    into ``out=``; a second call goes straight to the cached launch."""
    plan.clear_plans()
    xq, sx, w, sw = operands(4, 200, 256, seed=11)
    hq, hs = tmagemm.gate_up_silu_quant(xq, sx, w, sw)
    ref = reference(xq, sx, w, sw)
    check(hq, hs, ref, "allocated")
    (cached,) = gate_up.cached_plans()
    assert cached.variant == kernel.NAME and cached.config == kernel.choose_config(4, 256, 200, 132)
    out = poisoned_out(4, 256, "cpu")
    got = tmagemm.gate_up_silu_quant(xq, sx, w, sw, out=out)
    assert got[0] is out[0] and got[1] is out[1]
    assert torch.equal(out[0].view(torch.uint8), hq.view(torch.uint8)) and torch.equal(out[1], hs)
    again = tmagemm.gate_up_silu_quant(xq, sx, w, sw, out=out)  # the cached out= signature
    assert again[0] is out[0]
    assert len(gate_up.cached_plans()) == 2


@interpreter_only
def test_compile_fullgraph_traces():
    """torch.compile(fullgraph=True) traces the call as torch.ops.tmagemm.gate_up_silu_quant (and
    its out= form); aot_eager on the CPU, where no compiler back end runs the interpreter."""
    xq, sx, w, sw = operands(3, 200, 128, seed=2)

    def fused(xq, sx, w, sw):
        return tmagemm.gate_up_silu_quant(xq, sx, w, sw)

    def fused_out(xq, sx, w, sw, hq, hs):
        tmagemm.gate_up_silu_quant(xq, sx, w, sw, out=(hq, hs))
        return hq.float() * 2, hs

    want = fused(xq, sx, w, sw)
    got = torch.compile(fused, fullgraph=True, backend="aot_eager")(xq, sx, w, sw)
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])
    hq, hs = poisoned_out(3, 128, "cpu")
    doubled, scales = torch.compile(fused_out, fullgraph=True, backend="aot_eager")(xq, sx, w, sw, hq, hs)
    assert torch.equal(doubled, want[0].float() * 2) and torch.equal(scales, want[1])


# --------------------------------------------------------------------------------- the epilogue


@triton.jit
def _quantize_tile(x_ptr, q_ptr, s_ptr, R, BLOCK_R: tl.constexpr, POW2: tl.constexpr, FP8_MAX: tl.constexpr,
                   MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr, F32_TINY: tl.constexpr):
    rows = tl.arange(0, BLOCK_R)
    cols = tl.arange(0, 128)
    x = tl.load(x_ptr + rows[:, None] * 128 + cols[None, :], mask=rows[:, None] < R, other=0.0)
    q, scale = quantize_row_groups(x, FP8_MAX, MANT_BITS, MIN_EXP, F32_TINY, POW2)
    tl.store(q_ptr + rows[:, None] * 128 + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=rows[:, None] < R)
    tl.store(s_ptr + rows, scale, mask=rows < R)


@interpreter_only
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf / inf in the Inf row
@pytest.mark.parametrize("pow2", [False, True])
def test_epilogue_quantizes_like_quantize_1x128(pow2):
    """The fused epilogue's quantization (quantize.quantize_row_groups) is quantize_1x128's,
    bit for bit: rows of zeros, of subnormal-range values, near-ties, huge and tiny magnitudes."""
    torch.manual_seed(0)
    x = torch.randn(12, 128) * torch.logspace(-30, 30, 12)[:, None]
    x[0] = 0
    x[1, :5] = torch.tensor([448.0, 1.0, -2.0**-9, 2.0**-10, 3 * 2.0**-10])  # amax 448: scale 1, subnormals
    x[2] = torch.arange(128) * 0.5 + 0.25  # halfway cases
    x[3, 7] = float("inf")
    q, s = torch.empty(12, 128, dtype=FP8), torch.empty(12)
    _quantize_tile[(1,)](x, q, s, 12, BLOCK_R=16, POW2=pow2, **fp8_grid())
    want_q, want_s = quantize_1x128(x, pow2_scale=pow2, check_finite=False)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(s, want_s.reshape(-1))


# ---------------------------------------------------------------------------------- the checks


def test_errors(monkeypatch):
    # CPU tensors built without a kernel (on a GPU machine the interpreter is off).
    xq, sx = torch.randn(4, 256).to(FP8), torch.ones(4, 2)
    w, sw = torch.randn(256, 256).to(FP8), torch.ones(2, 2)
    fn = tmagemm.gate_up_silu_quant
    with pytest.raises(TypeError, match="xq must be a torch.Tensor"):
        fn(xq.tolist(), sx, w, sw)
    with pytest.raises(TypeError, match="xq must be float8_e4m3fn"):
        fn(xq.to(torch.bfloat16), sx, w, sw)
    with pytest.raises(ValueError, match="xq must be 2-D"):
        fn(xq[None], sx, w, sw)
    with pytest.raises(ValueError, match="xq must be row-major"):
        fn(xq.t().contiguous().t(), sx, w, sw)
    with pytest.raises(ValueError, match="xq row stride of 200 bytes"):
        fn(torch.zeros(4, 200, dtype=FP8), torch.ones(4, 2), torch.zeros(256, 200, dtype=FP8), torch.ones(2, 2))
    with pytest.raises(TypeError, match="w must be float8_e4m3fn"):
        fn(xq, sx, w.float(), sw)
    with pytest.raises(ValueError, match="w.shape.1. must equal the hidden size H = 256"):
        fn(xq, sx, w[:, :128], sw)
    with pytest.raises(ValueError, match="a positive multiple of 128 .I = 64"):
        fn(xq, sx, w[:128], sw[:1])
    with pytest.raises(ValueError, match="w has 0 rows"):
        fn(xq, sx, w[:0], sw[:0])
    with pytest.raises(TypeError, match="sx must be float32"):
        fn(xq, sx.half(), w, sw)
    with pytest.raises(ValueError, match=r"sx has shape \(4, 1\); 1x128 activation scaling .* needs \(4, 2\)"):
        fn(xq, sx[:, :1], w, sw)
    with pytest.raises(ValueError, match=r"sw has shape \(2, 3\); 128x128 weight scaling .* needs \(2, 2\)"):
        fn(xq, sx, w, torch.ones(2, 3))
    with pytest.raises(TypeError, match="pow2_scale must be a bool"):
        fn(xq, sx, w, sw, pow2_scale=1)
    with pytest.raises(ValueError, match="sw is on meta but xq is on cpu"):
        fn(xq, sx, w, sw.to("meta"))
    with pytest.raises(TypeError, match="out must be a .hq, hs. pair"):
        fn(xq, sx, w, sw, out=torch.empty(2, 4))
    hq, hs = poisoned_out(4, 128, "cpu")
    with pytest.raises(ValueError, match=r"out\[0\] \(hq\) has shape \(4, 64\); the result is \(4, 128\)"):
        fn(xq, sx, w, sw, out=(hq[:, :64], hs))
    with pytest.raises(TypeError, match=r"out\[1\] \(hs\) must be float32"):
        fn(xq, sx, w, sw, out=(hq, hs.double()))
    with pytest.raises(ValueError, match=r"out\[1\] \(hs\) is on meta"):
        fn(xq, sx, w, sw, out=(hq, hs.to("meta")))
    # Base addresses are read when a signature is first planned.
    shifted = torch.zeros(4 * 256 + 16, dtype=torch.uint8)[1 : 1 + 4 * 256].view(FP8).view(4, 256)
    if envs.interpret():
        with pytest.raises(ValueError, match="xq.data_ptr.. is not 16-byte aligned"):
            fn(shifted, sx, w, sw)
    plan.clear_plans()  # a cached CPU signature would skip the device check
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CPU tensors run only under the Triton interpreter"):
        fn(xq, sx, w, sw)


def test_config_rules():
    with pytest.raises(ValueError, match="block_m=128"):
        kernel.GateUpConfig(block_m=128, split_k=1, swap_ab=False, num_stages=2, num_warps=8)
    with pytest.raises(ValueError, match="block_m <= 8 x num_warps"):
        kernel.GateUpConfig(block_m=64, split_k=1, swap_ab=True, num_stages=2, num_warps=4)
    with pytest.raises(ValueError, match="num_warps"):
        kernel.GateUpConfig(block_m=16, split_k=1, swap_ab=True, num_stages=2, num_warps=2)
    with pytest.raises(ValueError, match="split_k"):
        kernel.GateUpConfig(block_m=16, split_k=0, swap_ab=True, num_stages=2)


# Decode-time MLPs: (name, I, H) per TP rank.
MLPS = [("llama3-8b", 14336, 4096), ("llama3-70b-tp4", 7168, 8192), ("qwen2.5-7b", 18944, 3584),
        ("deepseek-v3", 18432, 7168), ("ragged", 1408, 2000)]


@pytest.mark.parametrize("name,i,h", MLPS, ids=[n for n, _, _ in MLPS])
@pytest.mark.parametrize("m", [1, 7, 16, 17, 32, 33, 64, 65, 128, 4096])
def test_heuristic_invariants(name, i, h, m):
    sms = 132
    c = kernel.choose_config(m, i, h, sms)
    assert c.swap_ab == (m <= kernel.MAX_SWAP_M)
    assert c.block_m >= min(max(m, 16), 64) and (c.block_m == 64 or c.block_m < 2 * max(m, 16))
    tiles = -(-m // c.block_m) * (i // 128)
    slots = kernel.ctas_per_sm(c.block_m) * sms
    k_blocks = -(-h // 128)
    if c.split_k > 1:  # a split only while the tiles leave CTA slots empty, never an empty slice
        assert tiles * 2 <= slots and c.split_k * tiles <= slots
        assert k_blocks // c.split_k >= kernel.MIN_SLICE_BLOCKS
        assert (c.split_k - 1) * -(-k_blocks // c.split_k) < k_blocks
    else:
        assert tiles * 2 > slots or k_blocks < 2 * kernel.MIN_SLICE_BLOCKS
    # Shared memory for the CTAs per SM, registers for the accumulators.
    assert kernel.ctas_per_sm(c.block_m) * (c.smem_bytes() + 2048) <= 228 * 1024
    assert c.block_m <= 8 * c.num_warps
    if m <= 64:  # eager split-K partials fit the stream's first workspace buffer
        from tmagemm import workspace

        args = gate_up.make_args(torch.empty(m, h, dtype=FP8), torch.empty(m, k_blocks),
                                 torch.empty(2 * i, h, dtype=FP8), torch.empty(2 * i // 128, k_blocks))
        assert kernel.partials_needed(args, c) <= workspace.MIN_PARTIALS


def test_heuristic_table():
    labels = {name: [kernel.choose_config(m, i, h, 132).label for m in (1, 32, 64, 128)] for name, i, h in MLPS}
    assert labels["llama3-8b"] == ["swap16x256s3w4k2", "swap32x256s3w4k2", "tile64x256s5w8k1", "tile64x256s5w8k1"]
    assert labels["llama3-70b-tp4"][0] == "swap16x256s3w4k4"
    assert labels["qwen2.5-7b"][0] == "swap16x256s3w4k1"


# ------------------------------------------------------------------------ sm_90a, ahead of time


@pytest.mark.parametrize("m", [16, 32, 64, 128])
def test_compiles_for_sm90a_without_spills(m):
    """The heuristic's configs compiled for sm_90a: TMA loads, fp8 wgmma, no register spills,
    shared memory for ctas_per_sm CTAs, and a parameter list the direct launch can fill."""
    from tmagemm import inspection, workspace
    from tmagemm.triton.launch import parameter_plan

    config = kernel.choose_config(m, 14336, 4096, 132)
    art = inspection.compile_triton(kernel.aot_spec(config, m=m))
    s = inspection.summarize(art)
    assert s["sass UTMALDG"] > 0 and s["sass QGMMA"] > 0
    assert art.spills == 0, f"{config.label}: {art.spills} spills"
    assert kernel.ctas_per_sm(config.block_m) * (art.shared + 1024) <= 228 * 1024, (config.label, art.shared)
    call_ = kernel.kernel_call(gate_up.example_args(m), config,
                               workspace.Workspace(torch.empty(1), torch.zeros(1, dtype=torch.int32)))
    laid_out = parameter_plan(art.ptx, art.launch_metadata, call_.positional, call_.operand_slots, call_.unspecialized)
    assert not isinstance(laid_out, str), laid_out


@pytest.mark.skipif(not HAS_GDC, reason="this Triton has no grid dependency control")
def test_compiled_kernel_waits_for_the_previous_grid(monkeypatch):
    """With PDL (launch.pdl) every program waits on the previous grid before its first load of
    anything and lets the next kernel launch after its main loop; TMAGEMM_PDL=0 compiles neither."""
    from tmagemm import inspection

    monkeypatch.delenv("TMAGEMM_PDL", raising=False)
    config = kernel.choose_config(16, 14336, 4096, 132)
    body = inspection.compile_triton(kernel.aot_spec(config)).ptx
    body = body[body.index(".entry"):]
    wait = body.index("griddepcontrol.wait")
    assert body.count("griddepcontrol.wait") == 1 and body.index("griddepcontrol.launch_dependents") > wait
    for load in ("cp.async.bulk.tensor", "ld.global"):
        assert body.index(load) > wait, f"{load} before griddepcontrol.wait"
    monkeypatch.setenv("TMAGEMM_PDL", "0")
    assert "griddepcontrol" not in inspection.compile_triton(kernel.aot_spec(config)).ptx


# -------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("i,h", [(14336, 4096), (1408, 2000)], ids=["llama3-8b", "ragged"])
def test_gpu_every_decode_m(i, h):
    """Every M from 1 to 130 (swap-AB with and without a K split, the unswapped tiles past 64)
    against float64; the plans launch directly."""
    xq_all, sx_all, w, sw = operands(130, h, i, seed=i)
    ref_all, size_all = reference(xq_all, sx_all, w, sw)
    for m in range(1, 131):
        hq, hs = poisoned_out(m, i)
        tmagemm.gate_up_silu_quant(xq_all[:m], sx_all[:m], w, sw, out=(hq, hs))
        check(hq, hs, (ref_all[:m], size_all[:m]), f"M={m}")
    direct = [p.direct for p in gate_up.cached_plans()]
    assert direct and all(direct), "every plan should launch through tmagemm.jit"


@pytest.mark.gpu
def test_gpu_split_is_deterministic():
    m, i, h = 16, 14336, 4096
    xq, sx, w, sw = operands(m, h, i)
    config = kernel.choose_config(m, i, h, torch.cuda.get_device_properties(0).multi_processor_count)
    assert config.split_k > 1, "Llama-3-8B's MLP at M = 16 splits K"
    first = call(xq, sx, w, sw, config)
    for _ in range(20):
        again = call(xq, sx, w, sw, config)
        assert torch.equal(again[0].view(torch.uint8), first[0].view(torch.uint8)) and torch.equal(again[1], first[1])


@pytest.mark.gpu
@pytest.mark.parametrize("m", [4, 48])
def test_gpu_cuda_graph_and_compile(m):
    """A captured call replays with new inputs like an eager call; torch.compile(fullgraph=True)
    (inductor) runs the same kernel (bitwise the same output)."""
    i, h = 14336, 4096
    xq, sx, w, sw = operands(m, h, i, seed=m)
    out = poisoned_out(m, i)
    tmagemm.gate_up_silu_quant(xq, sx, w, sw, out=out)  # eager first: plans, loads, tops up counters
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tmagemm.gate_up_silu_quant(xq, sx, w, sw, out=out)
    for seed in range(3):
        new_xq, new_sx, _, _ = operands(m, h, i, seed=100 + seed)
        xq.copy_(new_xq)
        sx.copy_(new_sx)
        out[0].view(torch.uint8).fill_(0x7F)
        graph.replay()
        torch.cuda.synchronize()
        check(*out, reference(xq, sx, w, sw), f"replay {seed}")
        eager = tmagemm.gate_up_silu_quant(xq, sx, w, sw)
        assert torch.equal(eager[0].view(torch.uint8), out[0].view(torch.uint8)) and torch.equal(eager[1], out[1])

    compiled = torch.compile(lambda *a: tmagemm.gate_up_silu_quant(*a), fullgraph=True)
    got = compiled(xq, sx, w, sw)
    want = tmagemm.gate_up_silu_quant(xq, sx, w, sw)
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])
