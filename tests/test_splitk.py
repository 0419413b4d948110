"""Small-M split-K / swap-AB kernels (tmagemm.triton.matmul_splitk), and the small/medium-M fp8
tiles of tmagemm.triton.matmul_tma's heuristic.

CPU tests run the Triton kernel under the interpreter at small shapes (fp16 and fp8: the
interpreter's bf16 dot is wrong); GPU tests cover every M up to 128, bf16, determinism and
CUDA-graph capture.
"""

import pytest
import torch

from tmagemm import envs, plan, workspace
from tmagemm.plan import GemmArgs
from tmagemm.triton import matmul_splitk as sk
from tmagemm.triton import matmul_tma
from tmagemm.triton.host import tma_layout

F8 = torch.float8_e4m3fn
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _operands(m, n, k, dtype, *, integer=False, device=DEV):
    """a (m, k) row-major; b (k, n) = w.t() of a row-major (n, k) weight, like nn.Linear."""
    if integer:  # small integers: every product and fp32 partial sum is exact
        a = torch.randint(-4, 5, (m, k), device=device).to(dtype)
        w = torch.randint(-4, 5, (n, k), device=device).to(dtype)
    else:
        a = torch.randn(m, k, device=device).to(dtype)
        w = torch.randn(n, k, device=device).to(dtype)
    return a, w.t()


def _reference(a, b, scale_a=None, scale_b=None, bias=None):
    ref = a.double() @ b.double()
    if scale_a is not None:
        ref = ref * (scale_a.double()[:, None] if scale_a.numel() > 1 else scale_a.double())
    if scale_b is not None:
        ref = ref * (scale_b.double()[None, :] if scale_b.numel() > 1 else scale_b.double())
    if bias is not None:
        ref = ref + bias.double()[None, :]
    return ref


def _assert_close(out, ref, rtol, atol):
    err = (out.double() - ref).abs()
    bound = rtol * ref.abs() + atol
    bad = ~(err <= bound)  # NaN (poison left unwritten) counts as out of tolerance
    if bad.any():
        flat = int(torch.where(bad, torch.inf, err - bound).flatten().argmax())
        r, c = divmod(flat, ref.shape[1])
        raise AssertionError(
            f"{int(bad.sum())} of {bad.numel()} elements out of tolerance; worst at ({r}, {c}): "
            f"got {out[r, c].item()}, want {ref[r, c].item()} (rtol={rtol}, atol={atol})"
        )


# Interpreter-sized tiles (16..32) are outside what the launcher accepts on a GPU.
interpreter_only = pytest.mark.skipif(not envs.interpret(), reason="interpreter-sized tiles; GPU tests cover real ones")


def _run(args, config=None):
    assert sk.supports(args) is None, sk.supports(args)
    args.out.fill_(float("nan"))  # poison: any element the kernel skips fails the check
    sk.build(args, config)(args)


# ----------------------------------------------------------------------------------------------
# CPU (interpreter) and GPU: the kernel itself at small shapes with explicit configs
# ----------------------------------------------------------------------------------------------

# (M, N, K): ragged in every dim; K=208 is 6.5 blocks of 32, 3.25 blocks of 64.
SHAPES = [(1, 40, 208), (17, 72, 208), (5, 33, 96)]
CONFIGS = [
    # block_m, block_n, block_k, split, swap, a_tma, stages
    (16, 32, 32, 1, True, False, 2),
    (16, 32, 32, 3, True, False, 2),  # 7 K-blocks in slices of 3, 3, 1
    (16, 32, 32, 2, True, True, 2),  # activation through TMA too
    (16, 32, 32, 3, False, False, 2),  # no swap
    (32, 16, 64, 4, True, False, 3),
]


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float16, F8], ids=["fp16", "fp8"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"bm{c[0]}bn{c[1]}bk{c[2]}s{c[3]}{'swap' if c[4] else ''}{'tma' if c[5] else ''}")
def test_exact_on_integers(dtype, shape, cfg, seeded):
    m, n, k = shape
    config = sk.SplitKConfig(*cfg)
    a, b = _operands(m, n, k, dtype, integer=True)
    scale_b = torch.tensor([0.5], device=DEV)  # power of two: scaling stays exact
    bias = torch.randint(-8, 9, (n,), device=DEV).float()
    out = torch.empty(m, n, device=DEV, dtype=torch.float32)
    args = GemmArgs(a, b, out, None, scale_b, bias)
    _run(args, config)
    ref = _reference(a, b, None, scale_b, bias)
    _assert_close(out, ref, rtol=0.0, atol=0.0)


@interpreter_only
@pytest.mark.parametrize("scales", ["none", "tensor", "row"])
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.float32])
def test_random_fp8_scales_bias(scales, out_dtype, seeded):
    m, n, k = 17, 72, 208
    a, b = _operands(m, n, k, F8)
    if scales == "tensor":
        scale_a, scale_b = torch.rand(1, device=DEV) + 0.5, torch.rand(1, device=DEV) + 0.5
    elif scales == "row":
        scale_a, scale_b = torch.rand(m, device=DEV) + 0.5, torch.rand(n, device=DEV) + 0.5
    else:
        scale_a = scale_b = None
    bias = torch.randn(n, device=DEV).to(torch.float16)
    out = torch.empty(m, n, device=DEV, dtype=out_dtype)
    args = GemmArgs(a, b, out, scale_a, scale_b, bias)
    _run(args, sk.SplitKConfig(16, 32, 64, 3, True, False, 2))
    ref = _reference(a, b, scale_a, scale_b, bias)
    # fp32 accumulation of 208 products: ~1e-5 absolute; fp16 output rounding: 2^-11 relative.
    rtol = 2.0**-10 if out_dtype == torch.float16 else 1e-6
    _assert_close(out, ref, rtol=rtol, atol=1e-3)


@interpreter_only
def test_row_major_fp16_weight_and_strided_operands(seeded):
    """16-bit b may be N-major; a and out may have padded rows (pointer loads / stores)."""
    m, n, k = 9, 48, 160
    a_full = torch.randint(-4, 5, (m, k + 24), device=DEV).to(torch.float16)
    a = a_full[:, 8 : 8 + k]
    b = torch.randint(-4, 5, (k, n), device=DEV).to(torch.float16)  # row-major (K, N)
    out_full = torch.empty(m, n + 16, device=DEV, dtype=torch.float32)
    out = out_full[:, :n]
    args = GemmArgs(a, b, out)
    assert sk.supports(args) is None
    _run(args, sk.SplitKConfig(16, 16, 32, 2, True, False, 2))
    _assert_close(out, _reference(a, b), rtol=0.0, atol=0.0)


@interpreter_only
def test_heuristic_loads_16bit_activations_through_tma_where_tma_can(seeded):
    """33-64 tokens of 16-bit activations: the heuristic loads them through TMA when a tensor map
    can describe them and falls back to pointer loads otherwise (same exact result); a forced
    TMA config on such an activation is refused with the reason."""
    m, n, k = 40, 72, 208
    a_wide = torch.randint(-4, 5, (m, k + 4), device=DEV).to(torch.float16)  # row stride 424 B: not 16-B aligned
    w = torch.randint(-4, 5, (n, k), device=DEV).to(torch.float16)
    for a, through_tma in ((a_wide[:, :k].contiguous(), True), (a_wide[:, :k], False)):
        out = torch.empty(m, n, device=DEV, dtype=torch.float32)
        args = GemmArgs(a, w.t(), out)
        built = sk.build(args)
        assert built.config.a_tma == through_tma and built.config.block_m == 64
        out.fill_(float("nan"))
        built(args)
        _assert_close(out, _reference(a, w.t()), rtol=0.0, atol=0.0)
    forced = sk.SplitKConfig(64, 64, 64, 2, True, True, 2)
    with pytest.raises(ValueError, match="loads a through TMA.*not a multiple of 16"):
        sk.build(GemmArgs(a_wide[:, :k], w.t(), torch.empty(m, n, device=DEV)), forced)


@interpreter_only
def test_split_is_bitwise_deterministic_and_rearms_counters(seeded):
    m, n, k = 17, 72, 200
    a, b = _operands(m, n, k, torch.float16)
    out = torch.empty(m, n, device=DEV, dtype=torch.float32)
    args = GemmArgs(a, b, out)
    config = sk.SplitKConfig(16, 32, 32, 3, True, False, 2)
    ws = workspace.for_launch(out, sk.partials_needed(args, config))
    sk.kernel_call(args, config, ws).launch()
    first = out.clone()
    for _ in range(2):
        out.fill_(float("nan"))
        sk.kernel_call(args, config, ws).launch()  # the same counters: re-armed by the last launch
        assert torch.equal(out, first)
        assert int(ws.counters.abs().sum()) == 0, "arrival counters must be back at zero after a launch"
    _assert_close(out, _reference(a, b), rtol=1e-6, atol=1e-4)


@pytest.mark.parametrize("shape", [(0, 40, 64), (5, 0, 64), (5, 40, 0)])
def test_zero_size(shape):
    """The kernel refuses zero sizes; the plan layer answers them without a launch."""
    m, n, k = shape
    a, b = _operands(m, n, k, torch.float16)
    bias = torch.randn(n, device=DEV)
    out = torch.full((m, n), float("nan"), device=DEV, dtype=torch.float32)
    assert "zero-size" in sk.supports(GemmArgs(a, b, out, None, None, bias))
    plan.run_gemm(None, a, b, out, None, None, bias, True, "triton")
    assert torch.equal(out, bias.expand(m, n))


def test_supports_reasons():
    a, b = _operands(129, 64, 64, torch.float16)
    assert "M=129" in sk.supports(GemmArgs(a, b, torch.empty(129, 64, device=DEV)))
    a8 = torch.randn(4, 64, device=DEV).to(F8)
    b8_row_major = torch.randn(64, 32, device=DEV).to(F8)
    assert "column-major" in sk.supports(GemmArgs(a8, b8_row_major, torch.empty(4, 32, device=DEV)))
    w = torch.randn(32, 72, device=DEV).to(torch.float16)[:, :68]  # ld 72 ok, K=68: 136 B rows
    a16 = torch.randn(4, 68, device=DEV).to(torch.float16)
    assert sk.supports(GemmArgs(a16, w.t(), torch.empty(4, 32, device=DEV))) is None
    w_bad = torch.randn(32, 70, device=DEV).to(torch.float16)[:, :68]  # ld 70 x 2 B = 140 B
    assert "not a multiple of 16" in sk.supports(GemmArgs(a16, w_bad.t(), torch.empty(4, 32, device=DEV)))


# ----------------------------------------------------------------------------------------------
# Heuristic
# ----------------------------------------------------------------------------------------------


def _slices(cfg, k):
    k_iters = -(-k // cfg.block_k)
    per = -(-k_iters // cfg.split_k)
    return k_iters, per


# (K, N) of Llama-3-8B and 70B projections.
LLM_PROJECTIONS = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096),
                   (8192, 10240), (8192, 8192), (8192, 57344), (28672, 8192)]


@pytest.mark.parametrize("dtype", [F8, torch.bfloat16], ids=["fp8", "bf16"])
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16, 17, 32, 64, 100, 128])
@pytest.mark.parametrize("kn", [(4096, 4096), *LLM_PROJECTIONS, (200, 40), (4000, 1000)])
def test_heuristic_invariants(dtype, m, kn):
    k, n = kn
    cfg = sk.choose_config(m, n, k, dtype.itemsize, 132)
    assert cfg == sk.choose_config(m, n, k, dtype.itemsize, 132), "must be a pure function"
    assert cfg.block_m >= min(m, cfg.block_m) and cfg.block_m >= 16
    assert cfg.block_k * (1 if dtype == F8 else 2) == 128, "block_k spans one 128 B swizzle row"
    k_iters, per = _slices(cfg, k)
    assert -(-k_iters // per) == cfg.split_k, "no K slice may be empty"
    assert cfg.smem_bytes(1 if dtype == F8 else 2) <= sk._SMEM_BUDGET
    tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
    if cfg.split_k > 1:
        # A stream's first eager workspace holds every split the heuristic picks for M <= 128.
        assert tiles * cfg.split_k * cfg.block_m * cfg.block_n <= workspace.MIN_PARTIALS
    assert tiles <= workspace.COUNTERS
    # 16-bit activations of 33-64 tokens come through TMA; fp8 and other token counts through
    # pointer loads (block-scaled has its own config).
    assert cfg.a_tma == (dtype != F8 and m > 32)


@pytest.mark.parametrize("m", [1, 16, 17, 32, 33, 64, 100, 128])
@pytest.mark.parametrize("n,k", [(2112, 7168), (24576, 1536), (32768, 512), (7168, 16384), (5120, 25600),
                                 (64, 100000), (200, 300)])
def test_block_config_invariants(m, n, k):
    """Block-scaled launches: one 128-deep scale block per K step, weight tiles inside one
    128-row scale block, at most two CTAs per SM once split, >= 16 k-blocks per slice (>= 12 at
    decode M <= 16), and the partial sums within a stream's first eager workspace."""
    cfg = sk.choose_block_config(m, n, k, 132)
    assert cfg == sk.choose_block_config(m, n, k, 132), "must be a pure function"
    assert cfg.block_k == 128 and 128 % cfg.block_n == 0 and cfg.a_tma
    # Tokens in WGMMA's N slot up to 32; 64 x 64 token-by-weight tiles at 33-64, and above where
    # they still cut K in three.
    assert (cfg.block_m, cfg.swap_ab, cfg.split_k) == plan.block_tiling(m, n, k, 132)
    assert cfg.swap_ab == (m <= plan.BLOCK_SWAP_MAX_M or (m > 64 and cfg.block_m == 128))
    if not cfg.swap_ab:
        assert (cfg.block_m, cfg.block_n, cfg.num_warps) == (64, 64, 4)
    k_iters, per = _slices(cfg, k)
    split = -(-k_iters // per)
    tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
    if split > 1:
        assert tiles * split <= 2 * 132 and per >= (12 if m <= 16 else 16), (tiles, split, per)
        assert tiles * split * cfg.block_m * cfg.block_n <= workspace.MIN_PARTIALS
    assert cfg.smem_bytes(1) <= sk._SMEM_BUDGET


HEURISTIC_TABLE = [
    # m, n, k, dtype, expected (block_m, block_n, split_k, swap_ab); from the H100 sweep
    (1, 4096, 4096, F8, (16, 64, 1, True)),  # fp8: unsplit once the tiles fill half the SMs
    (1, 3584, 18944, F8, (16, 64, 2, True)),  # ... unless K is long
    (16, 4096, 4096, torch.bfloat16, (16, 64, 2, True)),
    (128, 4096, 14336, F8, (128, 64, 1, True)),
    (128, 4096, 14336, torch.bfloat16, (128, 64, 2, True)),
    (64, 57344, 8192, torch.bfloat16, (64, 64, 1, True)),
    (8, 1000, 4000, F8, (16, 64, 8, True)),
    (100, 8192, 28672, torch.bfloat16, (128, 64, 1, True)),
]


@pytest.mark.parametrize("row", HEURISTIC_TABLE)
def test_heuristic_table(row):
    m, n, k, dtype, want = row
    cfg = sk.choose_config(m, n, k, dtype.itemsize, 132)
    assert (cfg.block_m, cfg.block_n, cfg.split_k, cfg.swap_ab) == want


@pytest.mark.parametrize("n, k, stages", [
    (14336, 8192, 8),  # 224 tiles: two per SM hold them all
    (28672, 4096, 8),  # three per SM would leave a last wave of 52 CTAs
    (36864, 7168, sk.WIDE_FP8_STAGES),  # 576 tiles: a last wave of 180
    (37888, 3584, sk.WIDE_FP8_STAGES),
    (4096, 4096, 8),
])
def test_wide_fp8_weights_at_decode_tokens(n, k, stages):
    """fp8 at <= 16 tokens on weights of more 64-row tiles than two per SM: three CTAs per SM
    unless their last wave is short; 16-bit operands and 17 tokens keep the first rule."""
    for m in (1, 16):
        cfg = sk.choose_config(m, n, k, 1, 132)
        assert (cfg.block_n, cfg.num_stages, cfg.split_k, cfg.swap_ab) == (64, stages, 1, True)
        assert 3 * cfg.smem_bytes(1) <= 227 * 1024 or stages != sk.WIDE_FP8_STAGES  # three CTAs per SM
    for m, itemsize in ((17, 1), (1, 2)):
        cfg = sk.choose_config(m, n, k, itemsize, 132)
        assert (cfg.block_n, cfg.num_stages) == (64, sk.stages_for(cfg.block_m, 64, cfg.block_k, itemsize))


# ----------------------------------------------------------------------------------------------
# matmul_tma.heuristic at small and medium M (fp8): the winners of scripts/gpu/mid_m.py
# ----------------------------------------------------------------------------------------------

TMA_FP8_TABLE = [
    # m, n, expected (block_m, block_n, block_k, num_stages, num_warps); K=4096, H100 (132 SMs)
    (16, 4096, (64, 64, 256, 6, 4)),  # 64 CTAs: 0.95x cuBLAS
    (32, 4096, (64, 64, 256, 6, 4)),
    (33, 4096, (64, 32, 256, 6, 4)),  # 33-64 tokens, 64 x 64 tiles on half the SMs: 64 x 32
    (64, 4096, (64, 32, 256, 6, 4)),
    (64, 4608, (64, 64, 256, 6, 4)),  # 72 tiles
    (128, 4096, (64, 64, 256, 6, 4)),  # 2 x 64 tiles: 1.00x
    (256, 4096, (64, 128, 256, 4, 4)),  # 4 x 32 tiles: 1.00x
    (512, 4096, (128, 64, 128, 4, 4)),  # 256 tiles, two CTAs per SM: 0.95x
    (2048, 4096, (128, 256, 128, 3, 8)),
    (16, 28672, (64, 128, 128, 4, 4)),  # no 256-deep tile fits one wave: 128-deep, two CTAs per SM
    (64, 36864, (64, 128, 256, 4, 4)),  # ... except one row of tiles at 33-64 tokens with K >= 3072
    (33, 28672, (64, 128, 256, 4, 4)),
    (96, 28672, (64, 128, 128, 4, 4)),  # two rows of tiles: 128-deep
]


def _fp8_args(m, n, k, out_dtype=torch.bfloat16, device="cpu"):
    a, b = _operands(m, n, k, F8, device=device)
    return GemmArgs(a, b, torch.empty(m, n, device=device, dtype=out_dtype))


@pytest.mark.parametrize("row", TMA_FP8_TABLE, ids=lambda r: f"m{r[0]}n{r[1]}")
def test_tma_fp8_heuristic_table(row):
    m, n, want = row
    cfg = matmul_tma.heuristic(_fp8_args(m, n, 4096))
    assert (cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_stages, cfg.num_warps) == want


@pytest.mark.parametrize("m", [1, 16, 32])
def test_tma_fp8_256_deep_steps_at_decode_tokens_on_slow_memory(monkeypatch, m):
    """One row of 128-wide tiles past a wave with K >= 3072: 256-deep steps at 1-32 tokens too on
    a GPU with slow memory (an H100), 128-deep elsewhere."""
    monkeypatch.setattr(matmul_tma.device, "slow_memory", lambda dev: True)
    cfg = matmul_tma.heuristic(_fp8_args(m, 28672, 4096))
    assert (cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_stages, cfg.num_warps) == (64, 128, 256, 4, 4)
    monkeypatch.setattr(matmul_tma.device, "slow_memory", lambda dev: False)
    assert matmul_tma.heuristic(_fp8_args(m, 28672, 4096)).block_k == 128


def test_tma_fp8_short_k_keeps_128_deep_steps_past_a_wave():
    """One row of 128-wide tiles past a wave at 33-64 tokens: 256-deep steps only from K = 3072."""
    assert matmul_tma.heuristic(_fp8_args(64, 24576, 1536)).block_k == 128
    assert matmul_tma.heuristic(_fp8_args(64, 24576, 3072)).block_k == 256


@pytest.mark.parametrize("m", [1, 17, 64, 100, 200, 256, 300, 512])
@pytest.mark.parametrize("n", [72, 1000, 4096, 6144])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_tma_fp8_heuristic_invariants(m, n, out_dtype):
    cfg = matmul_tma.heuristic(_fp8_args(m, n, 256, out_dtype))
    fitted = cfg.fitted(1, 1, out_dtype.itemsize)
    assert fitted.is_valid(1, 1, out_dtype.itemsize), fitted
    assert fitted in matmul_tma.CONFIGS or fitted.num_stages < cfg.num_stages, "tuning must see the heuristic's tiles"
    if m <= 256:
        tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
        assert tiles <= 132 or cfg.block_n == 128, f"{tiles} tiles of {cfg} overflow one wave on 132 SMs"


TMA_FP8_EXACT_TABLE = [
    # m, n, expected tiles with use_fast_accum=False; K=4096, H100 (132 SMs)
    (16, 4096, (64, 32, 256, 6, 4)),  # 64 tiles of 64 x 64: half a wave -> 64 x 32 tiles
    (64, 4096, (64, 32, 256, 6, 4)),
    (64, 4608, (64, 64, 128, 10, 4)),  # 72 tiles: one wave, 10 stages deep
    (64, 8192, (64, 64, 128, 10, 4)),  # 128 tiles: one wave, 10 stages deep
    (128, 4096, (64, 64, 128, 10, 4)),
    (128, 8192, (64, 64, 128, 6, 4)),  # 256 tiles: two CTAs per SM
    (256, 4096, (64, 64, 128, 6, 4)),
    (64, 28672, (64, 128, 256, 4, 4)),  # 448 tiles, past two waves: the fast-accumulation tiles
]


@pytest.mark.parametrize("row", TMA_FP8_EXACT_TABLE, ids=lambda r: f"m{r[0]}n{r[1]}")
def test_tma_fp8_exact_heuristic_table(row):
    m, n, want = row
    args = _fp8_args(m, n, 4096)
    cfg = matmul_tma.heuristic(GemmArgs(args.a, args.b, args.out, fast_accum=False))
    assert (cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_stages, cfg.num_warps) == want
    assert cfg in matmul_tma.CONFIGS, "tuning must see the heuristic's tiles"


TMA_16BIT_TABLE = [
    # m, n, expected (block_m, block_n, block_k, num_stages, num_warps); K=4096, H100 (132 SMs)
    (33, 4096, (64, 64, 128, 6, 4)),  # 64 tiles of 64 x 64 fit a wave: 6 stages deep
    (64, 6144, (64, 64, 128, 6, 4)),  # 96 tiles
    (128, 4096, (64, 64, 128, 6, 4)),  # 2 x 64 tiles
    (64, 14336, (64, 128, 128, 4, 4)),  # 224 narrow tiles, 112 wide ones: one wave of 64 x 128
    (128, 6144, (64, 128, 128, 4, 4)),
    (96, 14336, (64, 128, 64, 4, 4)),  # 224 wide tiles on two rows: 64-deep, two CTAs per SM
    (128, 14336, (64, 128, 64, 4, 4)),
    (192, 6144, (64, 128, 128, 4, 4)),  # three rows of tiles: the 2026-11-23 sweep's tiles
    (256, 14336, (64, 128, 128, 4, 4)),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("row", TMA_16BIT_TABLE, ids=lambda r: f"m{r[0]}n{r[1]}")
def test_tma_16bit_heuristic_table(row, dtype):
    m, n, want = row
    a, b = _operands(m, n, 4096, dtype, device="cpu")
    cfg = matmul_tma.heuristic(GemmArgs(a, b, torch.empty(m, n, dtype=dtype)))
    assert (cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_stages, cfg.num_warps) == want
    assert cfg in matmul_tma.CONFIGS, "tuning must see the heuristic's tiles"
    assert cfg.is_valid(2, 2, 2)


@interpreter_only
@pytest.mark.parametrize(
    "m, n, sms, want",
    [(40, 72, 4, (32, 256, 6)), (17, 72, 2, (64, 128, 10)), (70, 200, 4, (64, 128, 6)), (130, 72, 4, (64, 128, 6))],
)
def test_tma_fp8_exact_tiles_ragged(m, n, sms, want, seeded):
    """Each exact-mode tile (64 x 32 x 256; 64 x 64 x 128 at 10 and 6 stages), chosen here for a
    device of ``sms`` SMs, under the interpreter: ragged M, N and K, use_fast_accum=False."""
    k = 592
    a, b = _operands(m, n, k, F8)
    scale_a, scale_b = torch.rand(m) + 0.5, torch.rand(n) + 0.5
    out = torch.full((m, n), float("nan"), dtype=torch.float32)
    args = GemmArgs(a, b, out, scale_a, scale_b, None, fast_accum=False)
    config = matmul_tma._fp8_exact_small_m(-(-m // 64) * -(-n // 64), sms)
    assert (config.block_n, config.block_k, config.num_stages) == want
    layout = tma_layout(args)
    assert not isinstance(layout, str), layout
    matmul_tma.kernel_call(args, config.fitted(1, 1, 4), layout).launch()
    _assert_close(out, _reference(a, b, scale_a, scale_b), rtol=1e-5, atol=1e-4)


@interpreter_only
@pytest.mark.parametrize("m", [1, 17, 40, 70])
def test_tma_fp8_small_m_tiles_ragged(m, seeded):
    """The heuristic's 64x64x256 tile (64x32x256 at 33-64 tokens on few tiles) under the
    interpreter: ragged M, N and K (K=592 is 2.3 K steps of 256, so the last TMA box is mostly
    zero-fill)."""
    n, k = 72, 592
    a, b = _operands(m, n, k, F8)
    scale_a, scale_b = torch.rand(1) + 0.5, torch.rand(n) + 0.5
    out = torch.full((m, n), float("nan"), dtype=torch.float32)
    args = GemmArgs(a, b, out, scale_a, scale_b, None)
    config = matmul_tma.heuristic(args)
    assert (config.block_m, config.block_n, config.block_k) == (64, 32 if 32 < m <= 64 else 64, 256)
    layout = tma_layout(args)
    assert not isinstance(layout, str), layout
    matmul_tma.kernel_call(args, config, layout).launch()
    # fp8 products are exact in fp32; 592 fp32 additions: ~600 * 2^-24 relative at worst.
    _assert_close(out, _reference(a, b, scale_a, scale_b), rtol=1e-5, atol=1e-4)


# ----------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F8, torch.bfloat16], ids=["fp8", "bf16"])
@pytest.mark.parametrize("nk", [(4096, 4096), (1000, 4000), (72, 176)], ids=lambda s: f"n{s[0]}k{s[1]}")
def test_gpu_every_m(dtype, nk, seeded):
    """Heuristic configs with fp32-promoted fp8 accumulation (use_fast_accum=False)."""
    n, k = nk
    a_all, b = _operands(130, n, k, dtype)
    scale_b = (torch.rand(n, device="cuda") + 0.5) if dtype == F8 else None
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    worst = 0.0
    for m in range(1, 131):
        a = a_all[:m]
        scale_a = (torch.rand(m, device="cuda") + 0.5) if dtype == F8 else None
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        args = GemmArgs(a, b, out, scale_a, scale_b, bias, fast_accum=False)
        if m > sk.MAX_M:
            assert sk.supports(args) is not None
            continue
        assert sk.supports(args) is None
        _run(args)
        ref = _reference(a, b, scale_a, scale_b, bias)
        # bf16 output: 2^-8 relative; fp32 accumulation over K: far below 2^-10 of max|ref|.
        _assert_close(out, ref, rtol=2.0**-7, atol=2.0**-10 * float(ref.abs().max()))
        worst = max(worst, float(((out.double() - ref).abs() / (ref.abs() + 1)).max()))
    assert worst > 0.0, "a check that compared nothing"


@pytest.mark.gpu
@pytest.mark.parametrize("n", [34368, 36872])
@pytest.mark.parametrize("m", [1, 11, 16])
def test_gpu_fp8_wide_weight_tiles(m, n, seeded):
    """fp8 at decode tokens on the widest weights (:func:`sk._wide_fp8_stages`: three CTAs per
    SM), N ragged, row-wise scales and a bias, against float64 (fast accumulation: 2^-10 x sum
    |a||b|)."""
    k = 2176
    a, b = _operands(m, n, k, F8)
    scale_a, scale_b = torch.rand(m, device="cuda") + 0.5, torch.rand(n, device="cuda") + 0.5
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    out = torch.full((m, n), float("nan"), device="cuda")
    args = GemmArgs(a, b, out, scale_a, scale_b, bias)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    config = sk.choose_config(m, n, k, 1, sms)
    assert config.num_stages == sk.WIDE_FP8_STAGES
    _run(args)
    ref = _reference(a, b, scale_a, scale_b, bias)
    bound = 2.0**-10 * (a.double().abs() @ b.double().abs()) * scale_a.double()[:, None] * scale_b.double() + 1e-6
    err = (out.double() - ref).abs()
    assert bool((err <= bound).all()), f"max error / bound = {float((err / bound).max()):.3f}"


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 17, 64])
def test_gpu_fp8_fast_accumulation(m, seeded):
    """use_fast_accum=True (the GemmArgs default) runs the heuristic config unpromoted: wgmma's
    own fp8 accumulation over all of K, bounded like the native kernels' (2^-10 x sum |a||b|)."""
    n, k = 4096, 4000
    a, b = _operands(m, n, k, F8)
    out = torch.empty(m, n, device="cuda", dtype=torch.float32)
    args = GemmArgs(a, b, out)
    _run(args)
    ref = _reference(a, b)
    err = (out.double() - ref).abs()
    bound = 2.0**-10 * (a.double().abs() @ b.double().abs())
    assert bool((err <= bound).all()), f"max error / bound = {float((err / bound).max()):.3f}"


@pytest.mark.parametrize("fast_accum", [True, False])
def test_kernel_follows_use_fast_accum(fast_accum):
    """The caller's flag, and nothing else, picks the kernel's accumulation mode."""
    a, b = _operands(16, 128, 256, F8, device="cpu")
    out = torch.empty(16, 128)
    args = GemmArgs(a, b, out, None, None, None, fast_accum)
    config = sk.choose_config(16, 128, 256, 1, 132)
    call = sk.kernel_call(args, config, workspace.for_launch(out, sk.partials_needed(args, config)))
    assert call.args["FAST_ACCUM"] is fast_accum


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F8, torch.bfloat16], ids=["fp8", "bf16"])
def test_gpu_deterministic(dtype, seeded):
    m, n, k = 16, 2048, 4000  # K not a multiple of the split
    a, b = _operands(m, n, k, dtype)
    out = torch.empty(m, n, device="cuda", dtype=torch.float32)
    args = GemmArgs(a, b, out, fast_accum=False)  # fp8 promoted once per k-block
    config = sk.choose_config(m, n, k, dtype.itemsize, torch.cuda.get_device_properties(0).multi_processor_count)
    assert config.split_k > 1, "the decode shape should split K"
    _run(args, config)
    first = out.clone()
    for _ in range(20):
        _run(args, config)
        assert torch.equal(out, first), "split-K result changed between runs"
    ref = _reference(a, b)
    if dtype == F8:
        # WGMMA's fp8 accumulator is below fp32 precision inside each 128-wide K block (the kernel
        # promotes to fp32 between blocks); without the promotion errors reach ~2^-10 relative.
        _assert_close(out, ref, rtol=2.0**-12, atol=2.0**-12 * float(ref.abs().max()))
    else:
        _assert_close(out, ref, rtol=1e-5, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("capture_stream", ["own", "fresh"])
def test_gpu_cuda_graph(capture_stream, seeded):
    """Capture works on any stream, with or without an eager call on it first (torch.cuda.graph
    captures on a side stream of its own), and replays follow new inputs."""
    m, n, k = 8, 2048, 4096
    a, b = _operands(m, n, k, F8)
    scale_a = torch.rand(1, device="cuda") + 0.5
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    args = GemmArgs(a, b, out, scale_a, None, None)
    launch = sk.build(args)
    assert launch.config.split_k > 1, "the shape should split K"
    launch(args)  # eager, on the current stream
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream() if capture_stream == "fresh" else None
    with torch.cuda.graph(graph, stream=stream):
        launch(args)
    for _ in range(3):
        a.copy_(torch.randn(m, k, device="cuda").to(F8))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        replayed = out.clone()
        _run(args)
        assert torch.equal(replayed, out), "graph replay and eager launch differ"
    ref = _reference(a, b, scale_a)
    # The GemmArgs default is fast accumulation: wgmma's fp8 sum over all of K (2^-10 x sum |a||b|).
    fast_accum_atol = 2.0**-10 * (a.double().abs() @ b.double().abs()) * scale_a.double()
    _assert_close(out, ref, rtol=2.0**-7, atol=fast_accum_atol)


@pytest.mark.gpu
def test_gpu_two_graphs_and_eager_keep_separate_counters(seeded):
    """Two graphs replayed on two streams at once and eager calls on a third never share
    counters: every result stays exact."""
    m, n, k = 4, 2048, 8192
    a, b = _operands(m, n, k, torch.float16, integer=True)
    outs = [torch.empty(m, n, device="cuda", dtype=torch.float32) for _ in range(3)]
    launch = sk.build(GemmArgs(a, b, outs[0]))
    graphs = []
    for out in outs[:2]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(4):
                launch(GemmArgs(a, b, out))
        graphs.append(graph)
    ref = _reference(a, b)
    streams = [torch.cuda.Stream() for _ in range(3)]
    for _ in range(5):
        for out in outs:
            out.fill_(float("nan"))
        torch.cuda.synchronize()
        for stream, graph in zip(streams, graphs):
            with torch.cuda.stream(stream):
                graph.replay()
        with torch.cuda.stream(streams[2]):
            for _ in range(4):
                launch(GemmArgs(a, b, outs[2]))
        torch.cuda.synchronize()
        for out in outs:
            _assert_close(out, ref, rtol=0.0, atol=0.0)


def test_gpu_refuses_untested_tiles():
    a, b = _operands(4, 64, 64, torch.float16)
    args = GemmArgs(a, b, torch.empty(4, 64, device=DEV))
    if a.device.type == "cuda":
        with pytest.raises(ValueError, match="block_n"):
            sk.build(args, sk.SplitKConfig(16, 32, 64, 1, True, False, 2))
