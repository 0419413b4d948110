"""The native decode GEMM (tmagemm.cuda.decode, gemm_sm90_decode.cu).

CPU: configs, the parameter block's layout, the dispatcher's rule, and every build through NVRTC
for sm_90a: TMA loads, the tensor-core op, no local memory, the programmatic-dependent-launch
order (every load after the grid dependency wait, the next kernel signalled after the main
loop) and the split clusters' reduction. GPU: float64 references on ragged shapes with poisoned outputs inside a larger
NaN buffer, every scaling, bias and output dtype, refusals, CUDA graph replays with new inputs,
and chains where each GEMM reads (or its weight is) the previous kernel's output.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

import tmagemm
from tmagemm import inspection, plan
from tmagemm.cuda import decode
from tmagemm.plan import GemmArgs, Scaling

from gemm_ref import assert_close, check_product
from test_blockscaled import WGMMA_TOL, block_reference, outer_major, operands as block_operands
from test_native_gemm import _check_untouched, _poisoned_out, needs_nvrtc

FP8 = torch.float8_e4m3fn

# ------------------------------------------------------------------------------------------ CPU


def test_params_struct_matches_device_layout():
    # gemm_sm90_decode.cu: 6 int, then 4 pointers, the output's row stride and the block scales'
    # four strides, 8-byte aligned.
    assert ctypes.sizeof(decode._DecodeParams) == 96
    assert decode._DecodeParams.scale_a.offset == 24
    assert decode._DecodeParams.out.offset == 48
    assert decode._DecodeParams.ldo.offset == 56
    assert decode._DecodeParams.sa_row.offset == 64 and decode._DecodeParams.sb_k.offset == 88


def test_configs():
    tokens = [decode.choose_config(m, 4096, 4096, 1, 132).tokens for m in (1, 8, 9, 16, 17, 32, 33, 64)]
    assert tokens == [8, 8, 16, 16, 32, 32, 64, 64]
    for config in decode.CONFIGS:
        # the split CTAs' fragment buffer and the block scales' chunks (static, up to 16 KB each)
        # and the barriers come on top
        assert config.smem_bytes() + 32 * 1024 + 512 <= 227 * 1024
    for bad in (dict(tokens=4, stages=16), dict(tokens=128, stages=8), dict(tokens=8, stages=1),
                dict(tokens=64, stages=16), dict(tokens=8, stages=8, split=3)):
        with pytest.raises(ValueError, match=r"DecodeConfig\.(tokens|stages|split)"):
            decode.DecodeConfig(**bad)


@pytest.mark.parametrize("m, n, k, itemsize, expect", [
    (1, 4096, 4096, 1, (8, 8, 2)),  # 64 tiles: two CTAs each share K
    (1, 2112, 7168, 1, (8, 8, 4)),  # 33 tiles: four
    (1, 3584, 3584, 1, (8, 8, 2)),  # 56 tiles: four would take 224 CTAs
    (1, 2560, 1024, 1, (8, 8, 1)),  # 8 k-blocks: too short to split
    (16, 4096, 14336, 2, (16, 16, 2)),  # a split CTA with 112 k-blocks keeps 16 stages
    (1, 8192, 7168, 1, (8, 16, 1)),  # 128 tiles, 56 k-blocks each
    (1, 6144, 4096, 1, (8, 8, 1)),  # 96 tiles, 32 k-blocks: two CTAs may share an SM
    (1, 28672, 4096, 1, (8, 8, 1)),
    (40, 2048, 16384, 2, (64, 12, 4)),  # 64 tokens: 12 stages at most
])
def test_heuristic(m, n, k, itemsize, expect):
    config = decode.choose_config(m, n, k, itemsize, 132)
    assert (config.tokens, config.stages, config.split) == expect


@pytest.mark.parametrize("m, n, k, itemsize, expect", [
    (1, 4096, 4096, 1, (8, 16, 1)),  # 64 tiles: unsplit, one CTA per SM at most: the deep ring
    (1, 2560, 8192, 1, (8, 8, 2)),  # 40 tiles: pairs (80 CTAs, within 0.65 x 132)
    (1, 2112, 7168, 1, (8, 16, 2)),  # 33 tiles: pairs, 66 CTAs: half the SMs
    (16, 3584, 3584, 1, (16, 16, 1)),  # 56 tiles
    (1, 4608, 3584, 1, (8, 8, 1)),  # 72 tiles: more than half the SMs
    (8, 8192, 7168, 1, (8, 8, 1)),  # 128 tiles
    (1, 3584, 18944, 1, (8, 16, 1)),  # 148 k-blocks: one CTA keeps them all
    (1, 2560, 1024, 1, (8, 16, 1)),  # 8 k-blocks: too short to split
    (32, 2560, 8192, 1, (32, 8, 2)),  # the 32-token tile keeps the split and ring rules
    (24, 4096, 14336, 1, (32, 16, 1)),
])
def test_heuristic_for_slow_memory(m, n, k, itemsize, expect):
    config = decode.choose_config(m, n, k, itemsize, 132, decode.RULE_SLOW_MEMORY)
    assert (config.tokens, config.stages, config.split) == expect


def test_slow_memory_is_read_from_the_device(monkeypatch):
    """An H100 SXM's 3.35 TB/s over 132 SMs is below the threshold, an H200's 4.8 TB/s above;
    CPU tensors and unknown bandwidths keep the first rule."""
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(decode._device, "sm_count", lambda index: 132)
    for bandwidth, slow in ((3.35e12, True), (4.8e12, False), (None, False)):
        monkeypatch.setattr(decode._device, "memory_bandwidth", lambda index, b=bandwidth: b)
        assert decode._device.slow_memory(gpu) is slow
    assert not decode._device.slow_memory(torch.device("cpu"))
    assert decode._device.memory_bandwidth_per_sm(torch.device("cpu")) is None


@pytest.mark.gpu
def test_slow_memory_of_this_gpu():
    """torch reports the memory clock and bus width the rules read: an H100 has slow memory, an
    H200 does not (a GPU of another name is not asserted)."""
    name = torch.cuda.get_device_name(0)
    if "H100" not in name and "H200" not in name:
        pytest.skip(f"{name}: neither an H100 nor an H200")
    assert decode._device.memory_bandwidth_per_sm(torch.device("cuda", 0)) is not None
    assert decode._device.slow_memory(torch.device("cuda", 0)) == ("H100" in name)


@pytest.mark.parametrize("m, n, k, expect", [
    (1, 4096, 4096, (8, 8, 2)),  # RULE's split, 8 stages
    (8, 8192, 7168, (8, 8, 1)),  # 128 unsplit CTAs with 56 k-blocks each: RULE would take 16 stages
    (1, 3584, 18944, (8, 8, 2)),
    (1, 2112, 7168, (8, 8, 4)),
])
def test_heuristic_for_slow_memory_block_scales(m, n, k, expect):
    config = decode.choose_config(m, n, k, 1, 132, decode.RULE_SLOW_MEMORY_BLOCK)
    assert (config.tokens, config.stages, config.split) == expect


def test_rule_for_reads_the_recipe_and_the_memory(monkeypatch):
    """On slow memory fp8 with tensor/row scales and block-scaled fp8 take their refitted rules,
    whose unsplit CTAs may take up to 160 k-blocks; 16-bit problems keep RULE everywhere."""
    fp8 = _args(1, 7168, 16384, FP8)  # 112 tiles x 128 k-blocks: split-K under RULE
    block = _args(1, 7168, 16384, FP8, block_scaling=(Scaling.BLOCK_1X128, Scaling.BLOCK_128X128))
    half = _args(1, 4096, 4096)
    monkeypatch.setattr(decode._device, "slow_memory", lambda dev: False)
    assert decode.rule_for(fp8) is decode.rule_for(half) is decode.RULE
    assert decode.rule_for(block) is decode.RULE_BLOCK
    assert not plan._decode_first(fp8) and not plan._decode_first(block)
    monkeypatch.setattr(decode._device, "slow_memory", lambda dev: True)
    assert decode.rule_for(fp8) is decode.RULE_SLOW_MEMORY
    assert decode.rule_for(block) is decode.RULE_SLOW_MEMORY_BLOCK
    assert decode.rule_for(half) is decode.RULE
    assert plan._decode_first(fp8) and plan._decode_first(block)


def test_tensor_and_row_scales_take_the_kernel_to_32_tokens_on_slow_memory(monkeypatch):
    at = lambda m, n=4096, k=4096: plan._decode_first(_args(m, n, k, FP8))  # noqa: E731
    monkeypatch.setattr(decode._device, "slow_memory", lambda dev: False)
    assert at(16) and not at(17)
    monkeypatch.setattr(decode._device, "slow_memory", lambda dev: True)
    assert at(17) and at(32) and not at(33)
    assert not at(32, 14336, 4096)  # 224 weight tiles: more than one per SM


def test_block_scales_take_the_kernel_to_16_tokens_on_slow_memory(monkeypatch):
    block = (Scaling.BLOCK_1X128, Scaling.BLOCK_128X128)
    at = lambda m: plan._decode_first(_args(m, 4096, 4096, FP8, block_scaling=block))  # noqa: E731
    monkeypatch.setattr(decode._device, "slow_memory", lambda dev: False)
    assert at(8) and not at(9)
    monkeypatch.setattr(decode._device, "slow_memory", lambda dev: True)
    assert at(8) and at(16) and not at(17)


def test_block_scales_take_weights_wider_than_the_sms_on_slow_memory(monkeypatch):
    """On slow memory block-scaled fp8 takes weights of up to 5 64-row tiles per SM (unsplit, 8
    stages); the rules of builds that signal the next kernel at their wait keep one tile per SM,
    and so does the quantizing form."""
    cpu = torch.device("cpu")
    monkeypatch.setattr(decode._device, "sms_of", lambda dev: 132)
    takes = lambda m, n, k=4096, block=True: decode.takes(m, n, k, 1, block, cpu)  # noqa: E731
    monkeypatch.setattr(decode._device, "slow_memory", lambda dev: True)
    assert takes(1, 28672) and takes(16, 37888, 3584) and takes(8, 14336, 8192)
    assert takes(1, 5 * 132 * 64) and not takes(1, 5 * 132 * 64 + 1)  # past 5 tiles per SM: split-K
    assert not takes(17, 28672)  # the block rule's 16 tokens
    assert not takes(1, 28672, block=False) and not takes(16, 8449, block=False)  # tensor/row: one tile per SM
    assert decode.takes_quantizing(8, 8448, 4096, cpu) and not decode.takes_quantizing(1, 8449, 4096, cpu)
    config = decode.choose_config(16, 37888, 3584, 1, 132, decode.RULE_SLOW_MEMORY_BLOCK)
    assert (config.tokens, config.stages, config.split) == (16, 8, 1)
    monkeypatch.setattr(decode._device, "slow_memory", lambda dev: False)
    assert not takes(1, 8449) and takes(1, 8448)  # RULE_BLOCK: one tile per SM
    for rule in (decode.RULE, decode.RULE_BLOCK, decode.RULE_SLOW_MEMORY):
        assert rule.max_tiles_per_sm == 1


def _args(m, n, k, dtype=torch.bfloat16, k_major=True, device="cpu", **kw):
    a = torch.randn(m, k, device=device).to(dtype)
    w = torch.randn(n, k, device=device).to(dtype)
    b = w.t() if k_major else w.t().contiguous()
    out = torch.empty(m, n, device=device, dtype=torch.bfloat16)
    return GemmArgs(a, b, out, kw.get("scale_a"), kw.get("scale_b"), kw.get("bias"), kw.get("fast_accum", True),
                    kw.get("block_scaling"))


def test_dispatcher_puts_the_decode_kernel_first_where_measured():
    first = lambda *shape: plan.preference(_args(*shape))[0]  # noqa: E731
    assert first(1, 4096, 4096) == first(16, 3584, 3584) == first(8, 2112, 7168) == "cuda.decode"
    assert plan.preference(_args(1, 4096, 4096))[1] == "triton.splitk"  # where it refuses (e.g. fp8 N-major)
    assert first(17, 4096, 4096) != "cuda.decode"  # tokens past wgmma's n16
    assert first(1, 1024, 4096) != "cuda.decode"  # narrower than measured
    assert first(1, 4096, 1024) != "cuda.decode"  # shorter than measured
    assert first(8, 28672, 4096) != "cuda.decode"  # 448 weight tiles: more than one per SM
    assert first(1, 7168, 16384) != "cuda.decode"  # 256 k-blocks for each of 112 unsplit CTAs
    block = (Scaling.BLOCK_1X128, Scaling.BLOCK_128X128)
    assert plan.preference(_args(1, 4096, 4096, FP8, block_scaling=block))[:2] == ("cuda.decode", "triton.splitk")
    assert plan.preference(_args(8, 4096, 4096, FP8, block_scaling=block))[0] == "cuda.decode"
    assert "cuda.decode" not in plan.preference(_args(9, 4096, 4096, FP8, block_scaling=block))  # block: <= 8 tokens


def test_cpu_tensors_are_refused_with_a_reason():
    reason = decode.supports(_args(1, 4096, 4096))
    assert "Hopper" in reason
    with pytest.raises(ValueError, match="cuda.decode: native kernels need CUDA tensors"):
        decode.build(_args(1, 4096, 4096))


def test_aot_source_matches_the_launcher_build():
    source, defines = inspection.native_source("cuda.decode", "fp8")
    assert source == decode.SOURCE
    assert defines == decode.defines(decode.DecodeConfig(8, decode.STAGES_SHORT), FP8, torch.bfloat16)
    with pytest.raises(ValueError, match="dtype must be one of"):
        decode.aot_source("cuda.decode", "fp4")


@needs_nvrtc
@pytest.mark.parametrize("tokens", decode.TOKENS)
@pytest.mark.parametrize("ab, out, k_major", [(torch.bfloat16, torch.bfloat16, True), (torch.bfloat16, torch.bfloat16, False),
                                              (torch.float16, torch.float32, False), (FP8, torch.bfloat16, True),
                                              (FP8, torch.float32, True)],
                         ids=["bf16", "bf16-nmajor", "fp16-f32out-nmajor", "fp8", "fp8-f32out"])
@pytest.mark.parametrize("split", [1, 4])
def test_builds_for_sm90a(ab, out, k_major, tokens, split):
    """Every operand type and weight layout, with and without a cluster split."""
    config = decode.DecodeConfig(tokens, decode.STAGES_SHORT, split)
    module = decode.compile_module(config, ab, out, k_major)
    art = inspection.artifacts_from_binary("decode", module.ptx, module.cubin)
    s = inspection.summarize(art)
    assert s["sass UTMALDG"] > 0
    assert s["sass QGMMA" if ab == FP8 else "sass HGMMA"] > 0
    assert s["sass LDL"] == 0 and s["sass STL"] == 0, "register spills"
    # No path (k_tiles = 0 included) reaches the epilogue with a group in flight: ptxas would
    # serialize every wgmma (it did at 32 and 64 tokens).
    assert "are serialized" not in module.log, "ptxas serialized the wgmmas"
    assert f"m64n{tokens}k{32 if ab == FP8 else 16}" in module.ptx
    if ab != FP8:  # A (the weight) transposed when N-major; B (the tokens) K-major
        assert (", p, 1, 1, 0, 0;" if k_major else ", p, 1, 1, 1, 0;") in module.ptx
    # PDL order: every load (the previous kernel may write the weight too) comes after the grid
    # dependency wait. fp8 tiles of up to 16 tokens signal the next kernel right after the
    # producer's wait, before its first load; the others once the last wgmma retired.
    body = module.ptx[module.ptx.index(".entry"):]
    assert "cp.async.bulk.prefetch.tensor" not in body
    wait, signal = body.index("griddepcontrol.wait"), body.index("griddepcontrol.launch_dependents")
    assert body.index("cp.async.bulk.tensor") > wait
    assert body.count("griddepcontrol.launch_dependents") == 1
    # The weight stream loads evict-first (read once); the activation boxes without a policy.
    assert body.count("createpolicy.fractional.L2::evict_first") == 1
    assert body.count(".L2::cache_hint") == body.count("cp.async.bulk.tensor") // 2
    last_wgmma_wait = body.rindex("wgmma.wait_group.sync.aligned 0")
    if ab == FP8 and tokens <= 16:
        assert wait < signal < body.index("cp.async.bulk.tensor")
    else:
        assert signal > last_wgmma_wait
    # A split cluster adds its fragments over distributed shared memory, after two cluster barriers.
    assert ("ld.shared::cluster.v4.f32" in body) == (split > 1)
    assert body.count("barrier.cluster.arrive") == (3 if split > 1 else 0)
    # The launch's block is the kernel's: a missing loader warp would leave the epilogue waiting
    # on its barrier for ever. 8-token tiles read the epilogue's operands into the consumers'
    # registers instead (loads before the main loop, no barrier wait in the epilogue).
    assert f".maxntid {decode.block_threads(tokens)}, 1, 1" in body
    loader = tokens >= decode.LOADER_WARP_MIN_TOKENS
    assert decode.block_threads(tokens) == 160 + 32 * loader
    assert ("mbarrier.try_wait.parity" in body[last_wgmma_wait:]) == loader


@needs_nvrtc
@pytest.mark.parametrize("tokens", decode.TOKENS)
@pytest.mark.parametrize("scales", [decode.SCALES_BLOCK_128X128, decode.SCALES_BLOCK_PER_ROW],
                         ids=["128x128", "per_row"])
def test_block_scaled_builds_for_sm90a(scales, tokens):
    """Block scales: four fp8 wgmma per k-block into one of two fragments taking turns (one in
    flight while the other is scaled into the accumulator); a clean build without spills, and
    the wgmmas not serialized (each step's groups retire within it)."""
    module = decode.compile_module(decode.DecodeConfig(tokens, decode.STAGES_SHORT, 2), FP8, torch.bfloat16,
                                   scales=scales)
    s = inspection.summarize(inspection.artifacts_from_binary("decode", module.ptx, module.cubin))
    assert s["sass QGMMA"] % 4 == 0 and s["sass LDL"] == 0 and s["sass STL"] == 0
    assert "are serialized" not in module.log, "ptxas serialized the wgmmas"
    body = module.ptx[module.ptx.index(".entry"):]
    assert "wgmma.wait_group.sync.aligned 1" in body and "cp.async.ca.shared.global" in body
    with pytest.raises(Exception, match="block scales: fp8"):
        decode.compile_module(decode.DecodeConfig(8, 8), torch.bfloat16, torch.bfloat16, scales=scales)


@needs_nvrtc
@pytest.mark.parametrize("x_dtype", list(decode.QUANTIZE_TYPES))
@pytest.mark.parametrize("tokens, split", [(8, 1), (16, 4)])
@pytest.mark.parametrize("scales", [decode.SCALES_BLOCK_128X128, decode.SCALES_BLOCK_PER_ROW],
                         ids=["128x128", "per_row"])
def test_quantizing_builds_for_sm90a(scales, tokens, split, x_dtype):
    """The quantizing form: the 16-bit tokens land unswizzled (no 128B box for them) and are read
    and written back with shared-memory instructions (not generic ones), each value divided
    correctly rounded and converted with round-to-nearest-even saturation, the e4m3 box
    published to wgmma by a proxy fence and an mbarrier; no spills; only a's scale copies are
    gone (b's still come by cp.async)."""
    config = decode.DecodeConfig(tokens, 6, split)
    module = decode.compile_module(config, FP8, torch.bfloat16, scales=scales, quantize_from=x_dtype)
    s = inspection.summarize(inspection.artifacts_from_binary("decode", module.ptx, module.cubin))
    assert s["sass QGMMA"] % 4 == 0 and s["sass LDL"] == 0 and s["sass STL"] == 0
    assert "are serialized" not in module.log, "ptxas serialized the wgmmas"
    body = module.ptx[module.ptx.index(".entry"):]
    assert "cvt.rn.satfinite.e4m3x2.f32" in body and "div.rn.f32" in body
    assert "fence.proxy.async.shared::cta" in body and "shfl.sync.bfly" in body
    assert "ld.shared.v4.b32" in body and "ld.shared.v2.b32" in body and "st.shared.v2.b32" in body
    assert "cp.async.ca.shared.global" in body
    assert f".maxntid {decode.block_threads(tokens, quantizing=True)}, 1, 1" in body
    plain = decode.compile_module(config, FP8, torch.bfloat16, scales=scales).ptx
    assert "cvt.rn.satfinite.e4m3x2.f32" not in plain[plain.index(".entry"):]
    with pytest.raises(Exception, match="quantizing the activation"):
        decode.compile_module(config, FP8, torch.bfloat16, quantize_from=x_dtype)  # tensor-wise scales


@pytest.mark.parametrize("m, n, k", [(1, 4096, 4096), (16, 4096, 14336), (8, 2112, 7168), (3, 36864, 7168)])
def test_quantizing_config_keeps_the_fp8_split_in_less_shared_memory(m, n, k, monkeypatch):
    """The quantizing form takes the fp8 problem's K split (the same sums) and ring depth, cut
    to QUANTIZE_SMEM and never below 2 stages."""
    monkeypatch.setattr(decode._device, "sms_of", lambda dev: 132)
    for slow in (False, True):
        monkeypatch.setattr(decode._device, "slow_memory", lambda dev, slow=slow: slow)
        out = torch.empty(m, n, dtype=torch.bfloat16)
        args = GemmArgs(torch.empty(m, k, dtype=torch.bfloat16), torch.empty(n, k, dtype=FP8).t(), out, None,
                        torch.empty(-(-n // 128), -(-k // 128)), None, True, BLOCK_128)
        fp8 = decode.choose_config(m, n, k, 1, 132, decode.rule_of(1, True, out.device))
        got = decode.quantizing_config(args)
        assert (got.tokens, got.split) == (fp8.tokens, fp8.split)
        assert 2 <= got.stages <= fp8.stages and got.smem_bytes(True) <= decode.QUANTIZE_SMEM
        assert got.stages == fp8.stages or (got.stages + 1) * got.smem_bytes(True) // got.stages > decode.QUANTIZE_SMEM


@pytest.mark.parametrize("slow, most", [(True, 8), (False, 2)], ids=["slow_memory", "fast_memory"])
def test_quantizing_form_takes_the_rules_tokens_where_the_fp8_problem_runs_here(slow, most, monkeypatch):
    """Up to 8 tokens on GPUs with slow memory per SM (an H100), 2 elsewhere (an H200), where the
    dispatcher runs the fp8 problem on the decode kernel."""
    monkeypatch.setattr(decode._device, "sms_of", lambda dev: 132)
    monkeypatch.setattr(decode._device, "slow_memory", lambda dev: slow)
    dev = torch.device("cpu")
    assert decode.takes_quantizing(1, 4096, 4096, dev) and decode.takes_quantizing(most, 6144, 4096, dev)
    assert not decode.takes_quantizing(most + 1, 4096, 4096, dev)  # its quantizer warps' work grows with the tokens
    assert not decode.takes_quantizing(1, 1024, 4096, dev)  # split-K
    if slow:
        assert not decode.takes_quantizing(1, 28672, 4096, dev)  # split-K under this rule
    for rule in (decode.RULE_BLOCK, decode.RULE_SLOW_MEMORY_BLOCK):
        assert 0 < rule.quantize_max_m <= min(rule.max_m, decode.QUANTIZE_MAX_M)
    assert decode.QUANTIZE_MAX_M == max(decode.RULE_BLOCK.quantize_max_m, decode.RULE_SLOW_MEMORY_BLOCK.quantize_max_m)


def test_quantizing_form_refuses_cpu_tensors_with_a_reason():
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    args = GemmArgs(x, torch.empty(256, 256, dtype=FP8).t(), torch.empty(4, 256, dtype=torch.bfloat16), None,
                    torch.ones(2, 2), None, True, BLOCK_128)
    assert "Hopper" in decode.quantizing_reason(args)
    with pytest.raises(ValueError, match="quantizing a"):
        decode.build_quantizing(args)


# ------------------------------------------------------------------------------------------ GPU

DEV = "cuda"
# N ragged against the 64-row tiles, K off the k-block (still 16-byte rows), tokens around the
# n8 / n16 tiles.
SHAPES = [(1, 264, 144), (5, 4160, 4112), (8, 3584, 3584), (3, 2112, 2000), (9, 200, 1040), (16, 4096, 528),
          (17, 330, 1040), (64, 520, 2064)]


def _operands(m, n, k, ab):
    if ab == FP8:
        a = (torch.randn(m, k, device=DEV) * 2).to(FP8)
        w = (torch.randn(n, k, device=DEV) * 2).to(FP8)
    else:
        a = torch.randn(m, k, device=DEV, dtype=ab)
        w = torch.randn(n, k, device=DEV, dtype=ab)
    return a, w


def _run(a, w, out, scale_a=None, scale_b=None, bias=None, config=None, k_major=True):
    """out = a @ w.t() on the decode kernel, the weight K-major (w.t()) or N-major (a (K, N) copy)."""
    args = GemmArgs(a, w.t() if k_major else w.t().contiguous(), out, scale_a, scale_b, bias, True)
    built = plan.build(args, variant="cuda.decode", config=config)
    assert built.variant == "cuda.decode"
    built(args)
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("k_major", [True, False], ids=["kmajor", "nmajor"])
@pytest.mark.parametrize("ab, out_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                                           (torch.bfloat16, torch.float32)], ids=["bf16", "fp16", "bf16-f32out"])
def test_16bit_matches_float64(ab, out_dtype, k_major, shape, seeded):
    m, n, k = shape
    if not k_major and n % 8:
        pytest.skip("an N-major weight's rows must be 16-byte aligned (TMA)")
    a, w = _operands(m, n, k, ab)
    big, out = _poisoned_out(m, n, out_dtype)
    _run(a, w, out, k_major=k_major)
    check_product(out, a, w.t(), what=f"{ab} {shape}", accumulation=2.0**-12)
    _check_untouched(big, m, n)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("scaling", ["tensor", "row", "row-bias-f32out"])
def test_fp8_matches_float64(scaling, shape, seeded):
    m, n, k = shape
    a, w = _operands(m, n, k, FP8)
    row = scaling != "tensor"
    sa = torch.rand(m if row else 1, device=DEV) + 0.5
    sb = torch.rand(n if row else 1, device=DEV) + 0.5
    bias = torch.randn(n, device=DEV, dtype=torch.bfloat16) if "bias" in scaling else None
    out_dtype = torch.float32 if "f32out" in scaling else torch.bfloat16
    big, out = _poisoned_out(m, n, out_dtype)
    _run(a, w, out, sa, sb, bias)
    expect = out.double()
    if bias is not None:
        expect = expect - bias.double()  # bias is added exactly in fp32
    check_product(expect, a, w.t(), sa, sb, what=f"fp8 {scaling} {shape}")
    _check_untouched(big, m, n)


BLOCK_128 = (Scaling.BLOCK_1X128, Scaling.BLOCK_128X128)
PER_ROW = (Scaling.BLOCK_1X128, Scaling.BLOCK_1X128)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("recipe", [BLOCK_128, PER_ROW], ids=["128x128", "per_row"])
@pytest.mark.parametrize("sa_layout, out_dtype, bias", [("row", torch.bfloat16, False), ("outer", torch.float32, True)])
def test_block_scaled_matches_float64(recipe, sa_layout, out_dtype, bias, shape, seeded):
    """Against the float64 product of the exactly dequantized operands; K off the 128-deep scale
    blocks (a partial last block), N off the 128-row weight blocks, both scale_a layouts."""
    m, n, k = shape
    a, w, sa, sb = block_operands(m, n, k, recipe, device=DEV)
    sa = outer_major(sa) if sa_layout == "outer" else sa
    b = torch.randn(n, device=DEV).to(torch.bfloat16) if bias else None
    big, out = _poisoned_out(m, n, out_dtype)
    args = GemmArgs(a, w.t(), out, sa, sb, b, True, recipe)
    built = plan.build(args, variant="cuda.decode")
    built(args)
    torch.cuda.synchronize()
    assert_close(out, block_reference(a, w, sa, sb, recipe, b), WGMMA_TOL[out_dtype], f"{recipe[1].name} {shape}")
    _check_untouched(big, m, n)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 7, 16])
def test_block_scaled_weight_wider_than_the_sms(m, seeded):
    """8520 weight rows (134 tiles, ragged) through the dispatcher: on GPUs with slow memory per
    SM the decode kernel, several CTAs per SM; elsewhere split-K."""
    n, k = 8520, 2176
    a, w, sa, sb = block_operands(m, n, k, BLOCK_128, device=DEV)
    big, out = _poisoned_out(m, n, torch.bfloat16)
    args = GemmArgs(a, w.t(), out, sa, sb, None, True, BLOCK_128)
    built = plan.build(args)
    if decode._device.slow_memory(out.device) and -(-n // decode.WEIGHT_ROWS) > decode._device.sms_of(out.device):
        assert built.variant == "cuda.decode"
    built(args)
    torch.cuda.synchronize()
    assert_close(out, block_reference(a, w, sa, sb, BLOCK_128), WGMMA_TOL[torch.bfloat16], f"{built.variant} m={m}")
    _check_untouched(big, m, n)


@pytest.mark.gpu
@pytest.mark.parametrize("split", decode.SPLITS)
def test_block_scaled_extreme_scales_and_every_split(split, seeded):
    """Scales from 1e-6 to 1e4 (each k-block's product scaled on its own), and a NaN scale
    reaching exactly the outputs of its token (and nothing else) through the split's reduction."""
    m, n, k = 9, 320, 4096
    a, w, sa, sb = block_operands(m, n, k, BLOCK_128, device=DEV, low=1e-6, high=1e4)
    config = decode.DecodeConfig(16, decode.STAGES_SHORT, split)
    out = torch.empty(m, n, device=DEV, dtype=torch.float32)
    args = GemmArgs(a, w.t(), out, sa, sb, None, True, BLOCK_128)
    plan.build(args, variant="cuda.decode", config=config)(args)
    torch.cuda.synchronize()
    assert_close(out, block_reference(a, w, sa, sb, BLOCK_128), WGMMA_TOL[torch.float32], f"split {split}")
    sa[3, 7] = float("nan")
    plan.build(args, variant="cuda.decode", config=config)(args)
    torch.cuda.synchronize()
    assert bool(out[3].isnan().all()) and not bool(out[torch.arange(m) != 3].isnan().any())


@pytest.mark.gpu
@pytest.mark.parametrize("config", decode.CONFIGS, ids=lambda c: c.label())
def test_every_config(config, seeded):
    """8-token tiles walk 16 tokens in two CTA rows, wider ones leave rows empty; 8 stages wrap
    the ring many times."""
    m, n, k = 16, 320, 2112
    a, w = _operands(m, n, k, torch.bfloat16)
    big, out = _poisoned_out(m, n, torch.bfloat16)
    _run(a, w, out, config=config)
    check_product(out, a, w.t(), what=config.label(), accumulation=2.0**-12)
    _check_untouched(big, m, n)


@pytest.mark.gpu
@pytest.mark.parametrize("config", decode.CONFIGS, ids=lambda c: c.label())
def test_block_scaled_every_config(config, seeded):
    """Every tile, ring depth and split with per-row block scales (the most shared memory: 64
    tokens, 12 stages, 4 CTAs is the largest build); 40 k-blocks cross the scale chunks."""
    m, n, k = 40, 320, 5100
    a, w, sa, sb = block_operands(m, n, k, PER_ROW, device=DEV)
    big, out = _poisoned_out(m, n, torch.bfloat16)
    args = GemmArgs(a, w.t(), out, sa, sb, None, True, PER_ROW)
    plan.build(args, variant="cuda.decode", config=config)(args)
    torch.cuda.synchronize()
    assert_close(out, block_reference(a, w, sa, sb, PER_ROW), WGMMA_TOL[torch.bfloat16], config.label())
    _check_untouched(big, m, n)


@pytest.mark.gpu
def test_refusals():
    a, w = _operands(65, 4096, 4096, torch.bfloat16)
    out = torch.empty(65, 4096, device=DEV, dtype=torch.bfloat16)
    assert "M=65 > 64" in decode.supports(GemmArgs(a, w.t(), out))
    assert decode.supports(GemmArgs(a[:1], w.t().contiguous(), out[:1])) is None  # 16-bit N-major: taken
    wide = torch.empty(1, 8192, device=DEV, dtype=torch.bfloat16)
    assert "columns must be contiguous" in decode.supports(GemmArgs(a[:1], w.t(), wide[:, ::2]))
    q, wq = _operands(1, 4096, 4096, FP8)
    one = torch.ones(1, device=DEV)
    assert "use_fast_accum=False" in decode.supports(GemmArgs(q, wq.t(), out[:1], one, one, None, False))
    assert "K-major" in decode.supports(GemmArgs(q, wq.t().contiguous(), out[:1], one, one, None, True))
    block = (Scaling.BLOCK_1X128, Scaling.BLOCK_128X128)
    assert "scale_a" in decode.supports(GemmArgs(q, wq.t(), out[:1], one, one, None, True, block))  # shapes named
    sa, sb = torch.ones(1, 32, device=DEV), torch.ones(32, 32, device=DEV)
    assert decode.supports(GemmArgs(q, wq.t(), out[:1], sa, sb, None, False, block)) is None  # promotes per k-block
    assert "column-major" in decode.supports(GemmArgs(q, wq.t().contiguous(), out[:1], sa, sb, None, True, block))
    with pytest.raises(ValueError, match="cuda.decode: M=65"):
        plan.build(GemmArgs(a, w.t(), out), variant="cuda.decode")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16])
def test_public_api_takes_it_and_graph_replays_read_new_inputs(m, seeded):
    x = torch.randn(m, 4096, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device=DEV, dtype=torch.bfloat16) / 64
    assert plan.choose(GemmArgs(x, w.t(), torch.empty(m, 4096, device=DEV, dtype=torch.bfloat16))).name == "cuda.decode"
    y = tmagemm.matmul(x, w.t())
    torch.cuda.synchronize()
    check_product(y, x, w.t(), what="eager", accumulation=2.0**-12)
    static_x = x.clone()
    tmagemm.matmul(static_x, w.t())  # warm-up on the capture's signature
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = tmagemm.matmul(static_x, w.t())
    for replay in range(3):
        static_x.copy_(torch.randn_like(static_x))
        static_y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check_product(static_y, static_x, w.t(), what=f"replay {replay}", accumulation=2.0**-12)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16])
def test_chain_and_a_weight_the_previous_kernel_writes(m, pdl_mode, seeded):
    """Each GEMM reads the previous one's output, eagerly and in a CUDA graph; then a weight
    written by the kernel just before is read fresh (no load of it may run ahead of the grid
    dependency wait)."""
    widths = (4096, 3584, 4096, 3584)
    ws = [torch.randn(n, k, device=DEV, dtype=torch.bfloat16) / k**0.5 for k, n in zip(widths, widths[1:])]

    def chain(x):
        steps = []
        for w in ws:
            y = tmagemm.matmul(x, w.t())
            steps.append((x, w, y))
            x = y
        return steps

    x0 = torch.randn(m, widths[0], device=DEV, dtype=torch.bfloat16)
    for i, (x, w, y) in enumerate(chain(x0)):
        torch.cuda.synchronize()
        check_product(y, x, w.t(), what=f"{pdl_mode} eager step {i}", accumulation=2.0**-12)
    static_x = x0.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = chain(static_x)
    for replay in range(2):
        static_x.copy_(torch.randn_like(static_x))
        for _, _, y in captured:
            y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for i, (x, w, y) in enumerate(captured):
            check_product(y, x, w.t(), what=f"{pdl_mode} replay {replay} step {i}", accumulation=2.0**-12)

    p = torch.randn(4096, 64, device=DEV, dtype=torch.bfloat16)
    q = torch.randn(64, 4096, device=DEV, dtype=torch.bfloat16) / 8
    x = torch.randn(m, 4096, device=DEV, dtype=torch.bfloat16)
    for _ in range(3):
        w = tmagemm.matmul(p, q)  # (N, K) weight, written just before its use
        y = tmagemm.matmul(x, w.t())
        torch.cuda.synchronize()
        check_product(y, x, w.t(), what=f"{pdl_mode} fresh weight", accumulation=2.0**-12)
        p.add_(0.5)


# Tokens around the n8 / n16 tiles; N ragged against the 64-row tiles and the 128-row scale
# blocks; K off the 128-deep groups (a partial last group, still 16-byte rows).
QUANTIZING_SHAPES = [(1, 4096, 4096), (2, 4096, 4112), (3, 264, 144), (5, 2112, 7168), (9, 200, 1040),
                     (13, 3072, 2064), (16, 4160, 14352)]


def _quantizing_input(m, k, dtype):
    """Fresh activations with a row of tiny values (the e4m3 subnormal grid) and a row spanning
    six decades (most of a group far below its amax)."""
    x = torch.randn(m, k, device=DEV) * 3
    x[0] *= 1e-3
    if m > 2:
        x[2] *= 10 ** (torch.rand(k, device=DEV) * 6 - 3)
    return x.to(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", QUANTIZING_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("x_dtype", list(decode.QUANTIZE_TYPES))
@pytest.mark.parametrize("recipe", [BLOCK_128, PER_ROW], ids=["128x128", "per_row"])
@pytest.mark.parametrize("out_dtype, bias", [(torch.bfloat16, False), (torch.float32, True)])
def test_quantizing_form_is_quantize_then_gemm_bit_for_bit(out_dtype, bias, recipe, x_dtype, shape, seeded):
    """One launch quantizing x in the kernel gives exactly what tmagemm's 1x128 quantizer and the
    decode kernel give in two (every split the heuristic takes), which is the float64 product of
    the quantized operands within wgmma's accumulation; nothing written outside the output."""
    m, n, k = shape
    x = _quantizing_input(m, k, x_dtype)
    _, w, _, sb = block_operands(m, n, k, recipe, device=DEV)
    b = torch.randn(n, device=DEV).to(torch.bfloat16) if bias else None
    xq, xs = tmagemm.quantize_fp8(x, "1x128")
    two = torch.full((m, n), float("nan"), device=DEV, dtype=out_dtype)
    unfused = GemmArgs(xq, w.t(), two, xs, sb, b, True, recipe)
    plan.build(unfused, variant="cuda.decode")(unfused)
    big, out = _poisoned_out(m, n, out_dtype)
    fused = GemmArgs(x, w.t(), out, None, sb, b, True, recipe)
    built = decode.build_quantizing(fused)
    built(fused)
    torch.cuda.synchronize()
    assert built.config.split == decode.choose_config(m, n, k, 1, torch.cuda.get_device_properties(0).multi_processor_count,
                                                      decode.rule_of(1, True, out.device)).split
    assert torch.equal(out, two), f"max difference {float((out.double() - two.double()).abs().max())}"
    assert_close(out, block_reference(xq, w, xs, sb, recipe, b), WGMMA_TOL[out_dtype], f"{recipe[1].name} {shape}")
    _check_untouched(big, m, n)


@pytest.mark.gpu
@pytest.mark.parametrize("split", decode.SPLITS)
def test_quantizing_form_every_split_and_non_finite_groups(split, seeded):
    """Every cluster split, 8- and 16-token tiles; an Inf in one group gives that token an
    infinite scale (as the quantizer does) and leaves the other tokens' outputs finite and equal."""
    m, n, k = 12, 2048, 4096
    x = _quantizing_input(m, k, torch.bfloat16)
    _, w, _, sb = block_operands(m, n, k, BLOCK_128, device=DEV)
    for tokens in (8, 16):
        config = decode.DecodeConfig(tokens, 4, split)
        for poison in (False, True):
            xin = x.clone()
            if poison:
                xin[5, 300] = float("inf")
            xq, xs = tmagemm.quantize_fp8(xin, "1x128", check_finite=False)
            two = torch.empty(m, n, device=DEV, dtype=torch.bfloat16)
            unfused = GemmArgs(xq, w.t(), two, xs, sb, None, True, BLOCK_128)
            plan.build(unfused, variant="cuda.decode", config=config)(unfused)
            out = torch.full((m, n), float("nan"), device=DEV, dtype=torch.bfloat16)
            fused = GemmArgs(xin, w.t(), out, None, sb, None, True, BLOCK_128)
            decode.build_quantizing(fused, config)(fused)
            torch.cuda.synchronize()
            keep = torch.arange(m, device=DEV) != 5
            assert torch.equal(out[keep], two[keep]) and torch.isfinite(out[keep]).all()
            assert torch.equal(out[5].isnan(), two[5].isnan())


@pytest.mark.gpu
def test_quantizing_form_refusals():
    x = torch.randn(4, 4096, device=DEV, dtype=torch.bfloat16)
    w = (torch.randn(4096, 4096, device=DEV) * 2).to(FP8)
    out = torch.empty(4, 4096, device=DEV, dtype=torch.bfloat16)
    sb = torch.ones(32, 32, device=DEV)

    def reason(a=x, b=w.t(), scale_a=None, scale_b=sb, scaling=BLOCK_128, o=out):
        return decode.quantizing_reason(GemmArgs(a, b, o, scale_a, scale_b, None, True, scaling))

    assert reason() is None
    assert "bfloat16 or float16" in reason(a=x.float())
    assert "computes a's 1x128 scales itself" in reason(scale_a=torch.ones(4, 32, device=DEV))
    assert "computes a's 1x128 scales itself" in reason(scaling=None)
    assert "scale_b must be float32 (32, 32)" in reason(scale_b=torch.ones(4096, 32, device=DEV))
    assert decode.quantizing_reason(GemmArgs(x, w.t(), out, None, torch.ones(4096, 32, device=DEV), None, True,
                                             PER_ROW)) is None
    assert "K-major" in reason(b=w.t().contiguous())
    assert "M=65" in reason(a=torch.randn(65, 4096, device=DEV, dtype=torch.bfloat16),
                            o=torch.empty(65, 4096, device=DEV, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"cuda.decode \(quantizing a\): a must be"):
        decode.build_quantizing(GemmArgs(x.float(), w.t(), out, None, sb, None, True, BLOCK_128))
