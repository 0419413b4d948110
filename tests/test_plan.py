"""The plan layer: the choice of kernel per problem (pure rules fitted to measurements), the Plan
contract every family returns, and the one cache of planned calls (CPU, the interpreter)."""

from dataclasses import replace

import pytest
import torch

from tmagemm import plan
from tmagemm.plan import GemmArgs

F8 = torch.float8_e4m3fn


def _args(m, n, k, dtype=F8):
    a = torch.empty(m, k, dtype=dtype, device="meta")
    b = torch.empty(n, k, dtype=dtype, device="meta").t()
    return GemmArgs(a, b, torch.empty(m, n, dtype=torch.bfloat16, device="meta"))


@pytest.mark.parametrize(
    "m, n, k, dtype, first",
    [
        (1, 4096, 4096, F8, "cuda.decode"),  # decode on a 16 MB weight (split-K next, where it refuses)
        (16, 4096, 14336, F8, "cuda.decode"),  # long K
        (16, 32768, 512, F8, "triton.tma"),  # short K, wide N: the tile kernel was ahead
        (32, 4096, 4096, F8, "triton.tma"),
        (16, 3584, 3584, F8, "cuda.decode"),
        (16, 2560, 3584, F8, "cuda.decode"),  # 40 tiles, each K shared by a cluster of 2
        (16, 4096, 2048, F8, "cuda.decode"),
        (16, 4096, 1536, F8, "triton.tma"),  # K < DECODE_MIN_K
        (1, 28672, 4096, F8, "triton.splitk"),  # 448 weight tiles: more than one per SM
        (1, 7168, 16384, F8, "triton.splitk"),  # 128 k-blocks for each of 112 CTAs
        (1, 8192, 7168, F8, "cuda.decode"),  # 56 k-blocks for each of 128 CTAs
        (32, 3584, 18944, F8, "triton.splitk"),  # K > 8192 on a weight narrower than FP8_TILE_MIN_N
        (32, 4096, 14336, F8, "triton.tma"),  # K > 8192, but FP8_TILE_MIN_N <= N <= FP8_TILE_MAX_N
        (17, 28672, 4096, F8, "triton.tma"),  # 117 MB weight, N <= FP8_TILE_MAX_N
        (32, 36864, 7168, F8, "triton.splitk"),  # 264 MB weight wider than FP8_TILE_MAX_N
        (32, 57344, 8192, F8, "triton.splitk"),  # 470 MB weight
        (16, 7168, 16384, F8, "triton.splitk"),  # M <= 16: split-K (the decode kernel refuses 128 k-blocks a CTA)
        (32, 4096, 14336, torch.bfloat16, "triton.splitk"),  # 16-bit: the 100 MB rule stays
        (64, 4096, 4096, F8, "triton.tma"),
        (256, 4096, 4096, F8, "triton.tma"),
        (257, 4096, 4096, F8, "cuda.persistent_coop"),  # 128x128 tiles (coop_config)
        (512, 4096, 4096, F8, "cuda.persistent_coop"),
        (256, 4096, 4096, torch.bfloat16, "triton.tma"),
        (512, 4096, 4096, torch.bfloat16, "cuda.persistent_coop"),
        (8, 4096, 4096, torch.bfloat16, "cuda.decode"),
        (16, 2048, 4096, torch.bfloat16, "cuda.decode"),
        (16, 1024, 4096, torch.bfloat16, "triton.splitk"),  # 16-bit at M <= 16 off the decode kernel's rule: split-K
        (17, 4096, 4096, torch.bfloat16, "triton.tma"),  # from 17 tokens: the 6-stage tile kernel
        (32, 2560, 8192, torch.float16, "triton.splitk"),  # ... but long K on 40 weight tiles: 3 slices
        (64, 2048, 8192, torch.bfloat16, "triton.splitk"),
        (64, 3072, 8192, torch.bfloat16, "triton.tma"),  # 48 tiles: 2 slices
        (64, 2048, 4096, torch.bfloat16, "triton.tma"),  # K < 8192
        (65, 2048, 8192, torch.bfloat16, "triton.tma"),
        (64, 3584, 3584, torch.bfloat16, "triton.tma"),
        (64, 4096, 14336, torch.bfloat16, "triton.tma"),
        (65, 4096, 4096, torch.bfloat16, "triton.tma"),
        (4096, 4096, 4096, torch.bfloat16, "cuda.persistent_coop"),
        (128, 28672, 4096, F8, "cuda.persistent_coop"),  # one row of tiles on a wide weight (_native_wide_first)
        (112, 24576, 1536, F8, "cuda.persistent_coop"),
        (111, 24576, 1536, F8, "triton.tma"),  # below WIDE_MIN_M
        (128, 14336, 4096, F8, "triton.tma"),  # narrower than WIDE_MIN_N
        (128, 28672, 8192, F8, "triton.tma"),  # deeper than WIDE_MAX_K
        (128, 28672, 4096, torch.bfloat16, "cuda.persistent_coop"),  # 16-bit too ...
        (128, 24576, 1536, torch.bfloat16, "triton.tma"),  # ... from WIDE_MIN_K_16BIT deep
        (128, 37888, 3584, F8, "mixed.wave_split"),  # 2.24 waves of 128-column tiles (_wave_split_first)
        (128, 36864, 7168, F8, "mixed.wave_split"),
        (96, 37888, 3584, torch.bfloat16, "mixed.wave_split"),
        (95, 37888, 3584, torch.bfloat16, "triton.tma"),  # from 96 tokens
        (95, 36864, 7168, F8, "triton.tma"),
    ],
)
def test_preference_table(m, n, k, dtype, first):
    order = plan.preference(_args(m, n, k, dtype))
    assert order[0] == first, order
    assert order[-1] == "triton.ptr"  # the pointer kernel accepts anything: always the last resort


@pytest.mark.parametrize(
    "m, n, k, fast_accum, first",
    [
        (1, 14336, 8192, True, "triton.tma"),  # wide fp8 weights at M <= 16: the tile kernel
        (16, 28672, 4096, True, "triton.tma"),
        (16, 32768, 4096, True, "triton.tma"),  # up to FP8_TILE_MAX_N
        (16, 36864, 7168, True, "triton.splitk"),  # wider: split-K
        (16, 12288, 8192, True, "triton.splitk"),  # narrower than FP8_WIDE_TILE_MIN_N
        (16, 28672, 3584, True, "triton.splitk"),  # shallower than FP8_WIDE_TILE_MIN_K
        (16, 14336, 8192, False, "triton.splitk"),  # exact accumulation: split-K
        (32, 36864, 7168, True, "triton.tma"),  # 17-32 tokens: up to FP8_SLOW_MEMORY_TILE_MAX_N
        (17, 37888, 3584, True, "triton.tma"),
        (32, 40960, 7168, True, "triton.splitk"),  # wider than FP8_SLOW_MEMORY_TILE_MAX_N
        (32, 36864, 7168, False, "triton.splitk"),  # exact accumulation: split-K
    ],
)
def test_preference_wide_fp8_tiles_on_slow_memory(monkeypatch, m, n, k, fast_accum, first):
    """On a GPU with slow memory (an H100) fp8 with fast accumulation runs on the tile kernel at up
    to 16 tokens on weights FP8_WIDE_TILE_MIN_N to FP8_TILE_MAX_N wide and FP8_WIDE_TILE_MIN_K
    deep, and at 17-32 tokens up to FP8_SLOW_MEMORY_TILE_MAX_N wide; elsewhere split-K stays
    first (the meta tensors of the table above have no memory bandwidth: not slow)."""
    monkeypatch.setattr(plan.device, "slow_memory", lambda dev: True)
    base = _args(m, n, k)
    args = GemmArgs(base.a, base.b, base.out, fast_accum=fast_accum)
    assert plan.preference(args)[0] == first
    monkeypatch.setattr(plan.device, "slow_memory", lambda dev: False)
    assert plan.preference(args)[0] == "triton.splitk"


@pytest.mark.parametrize(
    "m, n, fast_accum, first",
    [
        (256, 8192, False, "cuda.persistent_coop"),  # 128 tiles of 128 x 128: the native promoting kernel
        (256, 4096, False, "triton.tma"),  # 64 tiles: half the SMs
        (128, 8192, False, "triton.tma"),  # M <= 128: the Triton tile kernel was ahead
        (256, 8192, True, "triton.tma"),  # fast accumulation: unchanged
        (128, 36864, False, "triton.tma"),  # the wide-weight rule is for fast accumulation only (K = 4096)
    ],
)
def test_exact_fp8_above_m_128_prefers_native_tiles_that_fill_the_sms(m, n, fast_accum, first):
    a = torch.empty(m, 4096, dtype=F8, device="meta")
    w = torch.empty(n, 4096, dtype=F8, device="meta")
    out = torch.empty(m, n, dtype=torch.bfloat16, device="meta")
    assert plan.preference(GemmArgs(a, w.t(), out, fast_accum=fast_accum))[0] == first


def test_16bit_decode_kernel_then_split_k_first_for_either_weight_layout():
    a = torch.empty(8, 4096, dtype=torch.bfloat16, device="meta")
    out = torch.empty(8, 4096, dtype=torch.bfloat16, device="meta")
    k_major = torch.empty(4096, 4096, dtype=torch.bfloat16, device="meta").t()
    n_major = torch.empty(4096, 4096, dtype=torch.bfloat16, device="meta")  # a row-major (K, N) matrix
    assert plan.preference(GemmArgs(a, k_major, out))[:2] == ("cuda.decode", "triton.splitk")
    assert plan.preference(GemmArgs(a, n_major, out))[:2] == ("cuda.decode", "triton.splitk")
    a64 = torch.empty(64, 4096, dtype=torch.bfloat16, device="meta")
    out64 = torch.empty(64, 4096, dtype=torch.bfloat16, device="meta")
    assert plan.preference(GemmArgs(a64, n_major, out64))[0] == "triton.tma"  # from 33 tokens: the tile kernel
    a128 = torch.empty(128, 4096, dtype=torch.bfloat16, device="meta")
    out128 = torch.empty(128, 4096, dtype=torch.bfloat16, device="meta")
    assert plan.preference(GemmArgs(a128, n_major, out128))[0] == "triton.tma"  # M > 64: the tile kernel


# ------------------------------------------------------------------------------ the Plan contract

@pytest.mark.parametrize("name", ["triton.tma", "triton.tma_device", "triton.persistent"])
def test_forced_tile_config_that_does_not_fit_is_refused(name):
    """A config passed to a TMA tile family is held to TritonGemmConfig.is_valid for the call's
    dtypes, with a ValueError naming it (the launch would fail on the shared-memory opt-in)."""
    from tmagemm.configs import TritonGemmConfig

    a = torch.randn(16, 512).to(torch.float16)
    b = torch.randn(256, 512).to(torch.float16).t()
    args = GemmArgs(a, b, torch.empty(16, 256, dtype=torch.float16))
    too_big = TritonGemmConfig(64, 32, 256, 8, 6, 4)  # 6 stages of 48 KiB with 16-bit operands
    assert too_big.is_valid(1, 1, 2)  # the same tiles fit fp8
    with pytest.raises(ValueError, match=f"{name}: config 64x32x256s6w4 does not fit torch.float16"):
        plan.build(args, variant=name, config=too_big)


@pytest.mark.parametrize("name", ["triton.tma", "triton.tma_device", "triton.persistent", "triton.ptr",
                                  "triton.blockscaled", "triton.grouped_k"])
@pytest.mark.parametrize("field, label", [(dict(swap_ab=True), "16x128x128s6w4t"),
                                          (dict(programs_per_sm=3), "16x128x128s6w4p3")])
def test_other_tile_families_refuse_grouped_only_configs(name, field, label):
    """``swap_ab`` (the grouped kernel's decode tiles) and several programs per SM are the grouped
    kernel's alone: another Triton family given such a config refuses it (a ValueError naming the
    family and the field, or its validity rule), never a silent run without them."""
    from tmagemm import grouped
    from tmagemm.configs import TritonGemmConfig
    from tmagemm.triton import matmul_blockscaled, matmul_grouped_k

    config = TritonGemmConfig(16, 128, 128, 8, 6, 4, **field)
    assert config.is_valid(1, 1, 2) and config.label() == label and config.grouped_only()
    plain = TritonGemmConfig(16, 128, 128, 8, 6, 4)
    assert plain.grouped_only() is None
    if name == "triton.blockscaled":
        assert matmul_blockscaled.is_valid(plain, 2) and not matmul_blockscaled.is_valid(config, 2)
        return
    if name == "triton.grouped_k":
        x, dy = torch.randn(64, 16).half(), torch.randn(64, 32).half()
        args = grouped.weight_grad_args(x, dy, offs=torch.tensor([30, 64], dtype=torch.int32))
        assert matmul_grouped_k.is_valid(replace(plain, block_k=16), args)
        assert not matmul_grouped_k.is_valid(replace(config, block_k=16), args)
        return
    a = torch.randn(16, 512).to(torch.float16)
    b = torch.randn(256, 512).to(torch.float16).t()
    with pytest.raises(ValueError, match=f"{name}: config {label} has {config.grouped_only()}"):
        plan.build(GemmArgs(a, b, torch.empty(16, 256, dtype=torch.float16)), variant=name, config=config)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU: the Triton families under the interpreter")
@pytest.mark.parametrize("name", ["triton.tma", "triton.tma_device", "triton.persistent", "triton.splitk", "triton.ptr"])
def test_every_triton_family_returns_a_plan(name, seeded):
    from gemm_ref import assert_close, poisoned, reference

    a = torch.randn(17, 96).half()
    b = torch.randn(72, 96).half().t()
    args = GemmArgs(a, b, poisoned((17, 72), torch.float32, "cpu"))
    built = plan.build(args, variant=name)
    assert isinstance(built, plan.Plan) and built.variant == name and built.config is not None
    assert built.device_index == -1 and not built.direct  # CPU: Triton's launcher, no device
    built.run(*args.operands)
    assert_close(args.out, reference(a, b), 1e-5, name)
    # The same plan serves another problem of the same signature.
    again = GemmArgs(torch.randn(17, 96).half(), b, poisoned((17, 72), torch.float32, "cpu"))
    built(again)
    assert_close(again.out, reference(again.a, b), 1e-5, f"{name}, second problem")


def test_native_families_refuse_cpu_tensors():
    args = GemmArgs(torch.randn(17, 96).half(), torch.randn(96, 72).half(), torch.empty(17, 72))
    native = [v for v in plan.variants() if v.backend == "cuda"]
    for variant in native:
        assert "CUDA" in variant.supports(args), variant.name


def test_one_cache_plans_once_per_signature(monkeypatch, seeded):
    """A call key is planned once; a new signature plans again; clear_plans forgets both."""
    import tmagemm

    calls = []
    real_build = plan.build
    monkeypatch.setattr(plan, "build", lambda *a, **k: calls.append(1) or real_build(*a, **k))
    plan.clear_plans()
    a, b = torch.randn(8, 32).half(), torch.randn(32, 16).half()
    for _ in range(3):
        tmagemm.matmul(a, b)
    # CPU calls are not remembered (only CUDA ones skip the checks), so each plans: the cache is
    # exercised on the GPU; here the key function must at least tell signatures apart.
    key = plan.call_key("matmul", a, b, None, None, None, None, None, True, "auto")
    assert key == plan.call_key("matmul", torch.randn(8, 32).half(), b, None, None, None, None, None, True, "auto")
    assert key != plan.call_key("matmul", torch.randn(9, 32).half(), b, None, None, None, None, None, True, "auto")
    assert key != plan.call_key("matmul", a.t().contiguous().t(), b, None, None, None, None, None, True, "auto")
    assert len(calls) == 3
    plan.clear_plans()
    assert plan.cached_plans() == []


def test_scaling_description():
    assert plan.Scaling.of(None) is plan.Scaling.NONE
    assert plan.Scaling.of(torch.ones(1)) is plan.Scaling.TENSOR
    assert plan.Scaling.of(torch.ones(7)) is plan.Scaling.ROW
    args = GemmArgs(torch.empty(7, 32, dtype=F8), torch.empty(5, 32, dtype=F8).t(), torch.empty(7, 5),
                    torch.ones(7), torch.ones(1))
    assert args.scaling == (plan.Scaling.ROW, plan.Scaling.TENSOR)


S, T, C, D = "triton.splitk", "triton.blockscaled", "cuda.blockscaled", "cuda.decode"


@pytest.mark.parametrize("m, n, k, expected", [
    (1, 51200, 5120, (S, T, C)),  # M <= 16: split-K (800 weight tiles: past the decode kernel's rule)
    (8, 5120, 2048, (D, S, T, C)),  # the decode kernel where its rule takes the shape, split-K next
    (16, 5120, 2048, (S, T, C)),  # block-scaled: the decode kernel up to 8 tokens
    (1, 7168, 16384, (S, T, C)),  # 128 k-blocks for each of 112 CTAs
    (17, 5120, 2048, (T, C, S)),  # past M = 16: no decode kernel
    (32, 4096, 7168, (S, T, C)),  # 64 tiles: 4 slices
    (32, 6144, 4096, (S, T, C)),  # swapped tiles: 2 slices are enough
    (64, 6144, 4096, (T, C, S)),  # 96 unswapped tiles, 2 slices: the 64 x 64 tiles instead
    (64, 8192, 7168, (T, C, S)),  # 128 tiles, 2 slices
    (64, 4096, 4096, (S, T, C)),  # 64 tiles, 2 slices: split-K while the tiles fill under half the SMs
    (47, 1000, 4400, (S, T, C)),  # 16 tiles
    (32, 14336, 8192, (S, T, C)),  # 224 tiles fill the SMs unsplit: split-K streams faster at M <= 32
    (32, 28672, 4096, (S, T, C)),
    (32, 24576, 1536, (T, C, S)),  # 12 k-blocks: one row of 64 x 64 tiles, any width
    (33, 14336, 8192, (T, C, S)),  # above M = 32: the 64 x 64 tiles up to 64 rows
    (65, 14336, 8192, (C, T, S)),  # two rows of tiles on a wide weight: the native tiles
    (32, 8192, 2048, (T, C, S)),  # 128 tiles: short of the SMs
    (64, 5120, 2048, (T, C, S)),  # 80 tiles, 16 k-blocks: no split, the 64 x 64 tiles
    (128, 7168, 16384, (T, C, S)),  # 112 tiles, 2 slices: not enough above M = 64
    (128, 2112, 7168, (S, T, C)),  # 33 tiles, 3 slices
    (128, 24576, 1536, (C, T, S)),
    (129, 2112, 7168, (C, T, S)),
    (4096, 4096, 7168, (C, T, S)),
])
def test_block_scaled_preference(m, n, k, expected):
    args = GemmArgs(torch.empty(m, k, dtype=F8, device="meta"), torch.empty(n, k, dtype=F8, device="meta").t(),
                    torch.empty(m, n, dtype=torch.bfloat16, device="meta"), torch.empty(m, -(-k // 128), device="meta"),
                    torch.empty(-(-n // 128), -(-k // 128), device="meta"), None, True,
                    (plan.Scaling.BLOCK_1X128, plan.Scaling.BLOCK_128X128))
    assert plan.preference(args) == expected


def test_block_split_k():
    assert plan.block_split_k(1, 2112, 7168, 132) == 4  # 33 tiles: 8 for two CTAs per SM, 56 k-blocks allow 4
    assert plan.block_split_k(32, 2112, 7168, 132) == 3  # above M = 16: >= 16 k-blocks per slice
    assert plan.block_split_k(16, 7168, 16384, 132) == 2  # 112 tiles, but 128 k-blocks: worth two slices
    assert plan.block_split_k(1, 7168, 2048, 132) == 1  # 16 k-blocks: one slice
    assert plan.block_split_k(1, 3584, 3584, 132) == 2  # 28 k-blocks: two slices of 14
    assert plan.block_split_k(64, 3584, 3584, 132) == 1
    assert plan.block_split_k(1, 6144, 4096, 132) == 1  # 96 tiles on 132 SMs: two slices of 16 lost 9%
    assert plan.block_split_k(64, 6144, 4096, 132) == 2
    assert plan.block_split_k(128, 51200, 5120, 132) == 1
    assert plan.block_split_k(1, 64, 100000, 132) == 65  # capped by the k-blocks (782 // 12)
    assert plan.block_split_k(32, 64, 100000, 132) == 48  # (782 // 16)
    assert plan.block_split_k(1, 64, 128 * 40, 132) == 3


def test_block_tiling():
    assert plan.block_tiling(1, 4096, 4096, 132)[:2] == (16, True)
    assert plan.block_tiling(32, 4096, 4096, 132)[:2] == (32, True)
    assert plan.block_tiling(33, 4096, 4096, 132) == (64, False, 2)  # 64-token tiles, not swapped
    assert plan.block_tiling(64, 6144, 4096, 132) == (64, False, 2)
    assert plan.block_tiling(128, 2112, 7168, 132) == (64, False, 3)  # 66 tiles still cut K in three
    assert plan.block_tiling(128, 2560, 8192, 132) == (64, False, 3)  # 80 tiles: 3, not 128-token tiles' 4
    assert plan.block_tiling(128, 3584, 18944, 132) == (128, True, 4)  # 64-token tiles would get 2
    assert plan.block_tiling(128, 4096, 14336, 132) == (128, True, 4)
