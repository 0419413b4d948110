"""Native sm_90a GEMM kernels (tmagemm.cuda.gemm).

CPU: every native variant builds through NVRTC for sm_90a for each dtype/layout family, and its
SASS has the tensor-core op (HGMMA / QGMMA), TMA loads and stores, no local memory, and, for the
warp-specialized kernels, the setmaxnreg register split. GPU: results vs a float64 reference on
ragged shapes, outputs poisoned with NaN (inside and around the output), alpha/beta, fp8 scales
and bias.
"""

from __future__ import annotations

import ctypes
from dataclasses import replace
import math
from pathlib import Path
import re

import pytest
import torch

from tmagemm.cuda import gemm as native
from tmagemm import tma
from tmagemm.plan import GemmArgs

FP8 = torch.float8_e4m3fn

# (a/b dtype, out dtype, B K-major): the families the launcher can build.
# Every native config a plain (tensor/row-scaled or unscaled) problem can use.
PLAIN = sorted(name for name, config in native.NATIVE_CONFIGS.items() if not config.block_scaled)

FAMILIES = [
    (torch.bfloat16, torch.bfloat16, True),
    (torch.float16, torch.float16, False),
    (torch.bfloat16, torch.float32, False),
    (FP8, torch.bfloat16, True),
]


def _family_id(family) -> str:
    ab, out, k_major = family
    return f"{str(ab).split('.')[-1]}-{str(out).split('.')[-1]}-{'kmajor' if k_major else 'nmajor'}"


def _nvrtc_reason() -> str | None:
    try:
        from cuda.bindings import nvrtc  # noqa: F401
        from cuda.pathfinder import load_nvidia_dynamic_lib

        load_nvidia_dynamic_lib("nvrtc")
    except Exception as exc:  # missing wheel or library: the build tests cannot run here
        return f"NVRTC unavailable: {exc}"
    return None


needs_nvrtc = pytest.mark.skipif(_nvrtc_reason() is not None, reason=str(_nvrtc_reason()))


# ------------------------------------------------------------------------------- CPU: configs


def test_params_struct_matches_device_layout():
    # gemm_sm90.cuh: 4 int + 2 float, 6 x 8-byte fields, 4 int, then the block scales' 2 pointers
    # and 4 strides = 128 bytes; the grouped fields: a pointer, 4 int, 4 strides, the output
    # pointer and its stride = 72 bytes; the tail split's scratch and counter pointers = 16 bytes;
    # the block scales' map switch and the heavy-group threshold (2 int); pointers 8-aligned.
    assert ctypes.sizeof(native._Params) == 224
    assert native._Params.c.offset == 24
    assert native._Params.bias.offset == 56
    assert native._Params.scale_a_rowwise.offset == 64
    assert native._Params.block_scale_a.offset == 80
    assert native._Params.block_scale_b_k.offset == 120
    assert native._Params.group_counts.offset == 128
    assert native._Params.scale_b_group.offset == 152
    assert native._Params.block_scale_a_group.offset == 176
    assert native._Params.d.offset == 184
    assert native._Params.tail_partials.offset == 200
    assert native._Params.tail_counters.offset == 208
    assert native._Params.block_scale_maps.offset == 216


@pytest.mark.parametrize("name", sorted(native.NATIVE_CONFIGS))
@pytest.mark.parametrize("out_size", [2, 4])
def test_default_configs_fit_shared_memory(name, out_size):
    config = native.NATIVE_CONFIGS[name]
    fitted = config.fitted(out_size)
    assert fitted.is_valid(out_size), f"{name} does not fit with {out_size}-byte output: {fitted}"
    assert fitted.smem_bytes(out_size) <= 232448
    if out_size == 2:
        assert fitted == config, "default stages are chosen for 16-bit output"


def test_invalid_configs_are_refused():
    assert not native.NativeGemmConfig("one_warpgroup", block_n=256, stages=3).is_valid(2)  # 256 acc regs
    assert not native.NativeGemmConfig("warp_specialized", block_n=256, stages=5).is_valid(2)  # 240 KB ring
    assert not native.NativeGemmConfig("warp_specialized", block_n=128, stages=4, pingpong=True).is_valid(2)
    assert not native.NativeGemmConfig("persistent", block_n=256, stages=2, pingpong=True).is_valid(2)
    assert not native.NativeGemmConfig("one_warpgroup", block_n=128, stages=1).is_valid(2)
    assert not native.NativeGemmConfig("warp_specialized", block_n=256, stages=4, ctas=8).is_valid(2)  # not persistent
    assert not native.NativeGemmConfig("warp_specialized", block_n=256, stages=4, cluster_m=2).is_valid(2)
    assert not native.NativeGemmConfig("persistent", block_n=128, stages=5, pingpong=True, cluster_m=4).is_valid(2)
    assert not native.NativeGemmConfig("persistent", block_n=128, stages=5, pingpong=True, epi_passes=2).is_valid(2)
    coop = native.NATIVE_CONFIGS["cuda.persistent_coop"]
    assert not replace(coop, epi_passes=1, epi_buffers=2).is_valid(2)  # nothing to alternate
    assert not replace(coop, epi_passes=8).is_valid(2)  # 4 chunks of 128 bytes per row
    assert coop.epi_passes == 4 and coop.fitted(4).is_valid(4)  # fp32 out: 8 chunks, 3 stages
    assert not replace(coop, block_n=128, epi_passes=4).is_valid(2)  # 2 chunks
    assert not replace(coop, epi_buffers=3).is_valid(2)
    pingpong = native.NATIVE_CONFIGS["cuda.persistent_pingpong"]
    assert replace(pingpong, groups=8).is_valid(2)  # grouped ping-pong: single CTAs only
    assert not replace(pingpong, groups=8, cluster_m=2).is_valid(2)
    assert not replace(coop, kernel="warp_specialized", groups=8).is_valid(2)
    sliced = native.NativeGemmConfig("warp_specialized", block_n=256, stages=3, epi_passes=2, epi_buffers=2)
    assert not sliced.is_valid(2)  # slices belong to the persistent epilogue


# Shapes for the per-shape heuristic: ragged, tiny, tall, wide, and the benchmark targets.
_HEURISTIC_SHAPES = [(1, 8, 16), (17, 72, 336), (727, 520, 208), (513, 4096, 4096), (1024, 4096, 4096),
                     (2048, 2048, 2048), (4096, 14336, 4096), (8192, 8192, 8192), (65536, 128, 8192)]


@pytest.mark.parametrize("sms", [132, 114, 3])
@pytest.mark.parametrize("ab_itemsize,k_major", [(1, True), (2, True), (2, False)])
def test_coop_config_is_a_valid_cooperative_config(ab_itemsize, k_major, sms):
    for m, n, k in _HEURISTIC_SHAPES:
        config = native.coop_config(m, n, k, ab_itemsize, k_major, sms)
        what = f"coop_config({m}, {n}, {k}, {ab_itemsize}, {k_major}, {sms}) = {config}"
        assert config.kernel == "persistent" and config.cluster_m == 1, what
        assert config.is_valid(2) and config.fitted(4).is_valid(4), what
        assert config.ctas <= sms, what  # never more CTAs than SMs (persistent: one per SM)


def test_coop_config_choices():
    # The measured rules (docs/native-gemm.md): balanced grids at 2-9 waves with K <= 8 KB, ping-pong
    # for large fp8, the 132-CTA cooperative default elsewhere.
    default = native.NATIVE_CONFIGS["cuda.persistent_coop"]
    assert native.coop_config(4096, 4096, 4096, 2, False, 132) == replace(default, ctas=128)  # 512 tiles
    assert native.coop_config(6144, 6144, 6144, 1, True, 132) == replace(default, ctas=128)  # 1152 tiles
    assert native.coop_config(8192, 8192, 8192, 2, False, 132) == default  # 16 KB of K
    assert native.coop_config(6144, 6144, 6144, 2, False, 132) == default  # 12 KB of K
    assert native.coop_config(1024, 4096, 4096, 1, True, 132) == default  # one wave (128 tiles)
    assert native.coop_config(4096, 14336, 4096, 2, False, 132) == default  # 14 waves
    assert native.coop_config(8192, 8192, 8192, 1, True, 132) == native.NATIVE_CONFIGS["cuda.persistent_pingpong"]
    assert native.coop_config(2048, 8192, 8192, 1, True, 132).pingpong is False
    assert native.coop_config(727, 256 * 40, 4096, 2, True, 132) == replace(default, ctas=120)  # 6 x 40 tiles
    # At most half the SMs busy with 128x256 tiles: 128x128 tiles instead, unless they are no more.
    n128 = native.coop_config(512, 4096, 4096, 1, True, 132)  # 64 tiles -> 128
    assert (n128.kernel, n128.block_n, n128.pingpong, n128.cluster_m) == ("persistent", 128, False, 1)
    assert native.coop_config(512, 4096, 4096, 1, True, 114) == default  # 64 tiles > half of 114 SMs
    assert native.coop_config(1024, 4096, 4096, 1, True, 132) == default  # 128 tiles: most SMs busy
    assert native.coop_config(17, 72, 336, 2, False, 132) == default  # one tile either way
    # fp8 and 16-bit, one row of 128-row tiles from WIDE_MIN_M tokens on a weight WIDE_MIN_N wide: 128x128 tiles, every SM.
    assert native.coop_config(128, 37888, 3584, 1, True, 132) == native.NativeGemmConfig("persistent", block_n=128, stages=6)
    assert native.coop_config(112, 24576, 4096, 1, True, 132).block_n == 128
    assert native.coop_config(111, 24576, 1536, 1, True, 132).block_n == 256  # below WIDE_MIN_M
    assert native.coop_config(128, 24575, 1536, 1, True, 132).block_n == 256  # narrower than WIDE_MIN_N
    assert native.coop_config(128, 36864, 4097, 1, True, 132).block_n == 256  # deeper than WIDE_MAX_K
    assert native.coop_config(128, 37888, 3584, 2, True, 132).block_n == 128  # 16-bit operands too
    assert native.coop_config(128, 37888, 3584, 4, True, 132).block_n == 256  # no fp32 wgmma operands
    assert native.coop_config(128, 24576, 2048, 2, True, 132).block_n == 128
    assert native.coop_config(128, 24576, 1536, 2, True, 132).block_n == 256  # 16-bit below WIDE_MIN_K_16BIT
    assert native.coop_config(128, 24576, 1536, 1, True, 132).block_n == 128  # fp8 at any depth


@pytest.mark.parametrize("shape", _HEURISTIC_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_coop_config_promotes_fp8_without_fast_accum(shape):
    m, n, k = shape
    config = native.coop_config(m, n, k, 1, True, 132, fast_accum=False)
    assert config.promote and not config.pingpong and config.fitted(4).is_valid(4), config
    assert config == native.promote_config(m, n, k, 132)
    assert config.is_valid(2) and config.fitted(4).is_valid(4)
    assert not native.coop_config(m, n, k, 1, True, 132).promote
    assert native.coop_config(m, n, k, 2, False, 132, fast_accum=False) == native.coop_config(m, n, k, 2, False, 132)


def test_promote_config_choices():
    wide = native.promote_config(4096, 4096, 7168, 132)  # 512 wide tiles: 256 pairs
    assert (wide.block_n, wide.promote_depth, wide.cluster_m, wide.ctas, wide.tail_split) == (256, 1, 2, 128, 0)
    # 160 wide tiles take 2 waves, 320 narrow ones 3 waves of tiles half the size
    narrow = native.promote_config(1024, 5120, 2048, 132)
    assert (narrow.block_n, narrow.promote_depth, narrow.cluster_m, narrow.tail_split) == (128, 2, 2, 0)
    # 36 wide pairs: one wave on 36 of 66 slots; 68 narrow pairs: one wave and 2 pairs cut in 3
    # K slices, 1.33 waves of tiles half the size
    split = native.promote_config(1024, 2112, 7168, 132)
    assert (split.block_n, split.tail_split, split.ctas) == (128, native.TAIL_SPLIT, 0)
    assert native.promote_config(1024, 2112, 2048, 132).block_n == 256  # 16 k-blocks: no slices, one wave either way
    # 144 wide pairs: 2 waves and 12 pairs in 4 slices (2 + 1/4 + 15/56 = 2.52 waves); 272 narrow
    # pairs: 4 waves and 8 pairs in 4 slices (4.52 waves of tiles 0.54 the time: 2.44)
    tail = native.promote_config(4096, 2112, 7168, 132)
    assert (tail.block_n, tail.cluster_m, tail.tail_split, tail.ctas) == (128, 2, native.TAIL_SPLIT, 0)
    # Four rows of tiles run as single CTAs: 64 wide tiles in 2 slices of 16 k-blocks take 1/2 +
    # 15/32 of a wave, no less than the one wave of 128 narrow tiles
    short = native.promote_config(512, 4096, 4096, 132)
    assert (short.block_n, short.cluster_m, short.tail_split) == (128, 1, 0)
    # Clusters pair an even number of rows of tiles, from 8: an odd count leaves the last pair's
    # second CTA without rows
    assert [native.promote_config(m, 7168, 2048, 132).cluster_m for m in (768, 1024, 1025, 1152, 4224, 4096)] == [
        1, 2, 1, 1, 1, 2]
    one_row = native.promote_config(128, 51200, 5120, 132)
    assert one_row.cluster_m == 1 and one_row.ctas == 0  # nothing to pair; every SM streams the weight
    # One row of tiles never splits (Llama-3-70B TP4's 14336 x 8192 at 64-128 tokens: 56 wide
    # tiles could take two slices each; it keeps the narrow tiles it had).
    one_row = native.promote_config(128, 14336, 8192, 132)
    assert (one_row.block_n, one_row.tail_split) == (128, 0)
    for m, n in ((1, 8), (17, 577), (300, 2112), (8192, 51200)):
        assert native.promote_config(m, n, 4096, 132).fitted(4).is_valid(4)


def test_tail_split_rule():
    """cuda.gemm.tail_split mirrors the kernel's tail_schedule (same constants)."""
    source = (Path(native.__file__).parent / "gemm_sm90_persistent.cu").read_text()
    assert re.search(r"kTailMinKBlocks = (\d+);", source).group(1) == str(native.TAIL_MIN_K_BLOCKS)
    assert native.tail_split(288, 132, 56, 4) == 3  # 24 tiles left: 5 slices fit the clusters, 3 the k-blocks
    assert native.tail_split(288, 132, 112, 4) == 4  # at most max_split
    assert native.tail_split(288, 132, 112, 8) == 5  # clusters // tail
    assert native.tail_split(256, 132, 112, 4) == 1  # 124 tiles left: more than half of the clusters
    assert native.tail_split(264, 132, 112, 4) == 1  # whole waves
    assert native.tail_split(288, 132, 31, 4) == 1  # slices under TAIL_MIN_K_BLOCKS
    assert native.tail_split(288, 132, 112, 0) == 1  # off
    assert native.tail_split(16, 132, 64, 4) == 4  # fewer tiles than clusters: the idle ones take slices
    assert native.tail_split(5, 0, 64, 4) == 1


def test_tail_scratch_floats():
    config = replace(native.NATIVE_CONFIGS["cuda.persistent_coop_mc"], tail_split=4)
    # 144 pair tiles on 66 clusters, 56 k-blocks: 12 tiles in 3 slices, 2 later slices x 2 CTAs x
    # 2 consumers, 64 x 256 floats each.
    assert native.tail_scratch_floats(config, 144, 66, 56, exact=True) == 12 * 2 * 2 * 2 * 64 * 256
    assert native.tail_scratch_floats(config, 132, 66, 56, exact=True) == 0  # no tail
    # Grouped (tiles known on the device only): at most clusters - 1 later slices.
    assert native.tail_scratch_floats(config, 1000, 66, 56, exact=False) == 65 * 2 * 2 * 64 * 256
    assert native.tail_scratch_floats(replace(config, tail_split=0), 144, 66, 56, exact=True) == 0
    # K too short for two slices of TAIL_MIN_K_BLOCKS: no split whatever the count, no scratch.
    assert native.tail_scratch_floats(config, 1000, 66, 2 * native.TAIL_MIN_K_BLOCKS - 1, exact=False) == 0


def test_tail_split_configs():
    coop = native.NATIVE_CONFIGS["cuda.persistent_coop"]
    assert replace(coop, tail_split=4).is_valid(2) and replace(coop, tail_split=4).label().endswith("t4")
    for bad in (replace(coop, tail_split=1), replace(coop, tail_split=9),
                replace(native.NATIVE_CONFIGS["cuda.persistent_pingpong"], tail_split=4),
                replace(native.NATIVE_CONFIGS["cuda.warp_specialized"], tail_split=4)):
        assert not bad.is_valid(2), bad
    # 288 tiles of 128x256 on 132 SMs: 24 left over, cut into K slices (the balanced grid of
    # before would run 3 waves of 96 CTAs).
    for itemsize in (1, 2):
        config = native.coop_config(4096, 2112, 7168, itemsize, True, 132)
        assert (config.tail_split, config.ctas) == (native.TAIL_SPLIT, 0)
    # 512 tiles: 116 left over, more than half the SMs: the balanced grid of 128 CTAs.
    assert native.coop_config(4096, 4096, 7168, 1, True, 132).tail_split == 0
    # 2048 deep fp8: 16 k-blocks, too few for slices.
    assert native.coop_config(2048, 7168, 2048, 1, True, 132).tail_split == 0
    # One row of tiles (M <= 128) never splits: 56 tiles of 14336 columns.
    assert native.coop_config(128, 14336, 8192, 2, True, 132).tail_split == 0
    assert (native.dense_tail_split(128), native.dense_tail_split(129)) == (0, native.TAIL_SPLIT)


def test_promote_needs_the_cooperative_schedule():
    promote = native.NativeGemmConfig("persistent", block_n=128, stages=6, promote=True)
    assert promote.is_valid(2)
    assert replace(promote, block_n=256, stages=4, epi_passes=4, epi_buffers=2).is_valid(2)  # promoted in halves
    assert replace(promote, cluster_m=2).is_valid(2)
    assert not replace(promote, pingpong=True, stages=5).is_valid(2)
    assert not replace(promote, kernel="warp_specialized", stages=4).is_valid(2)


@needs_nvrtc
@pytest.mark.parametrize("dtype", ["fp8", "bf16", "fp16"])
def test_aot_source_matches_the_launcher_build(dtype):
    from tmagemm import inspection, jit

    source, defines = native.aot_source("cuda.persistent_coop", dtype)
    assert source == "gemm_sm90_persistent.cu"
    ab, out, k_major = native._AOT_FAMILIES[dtype]
    module = native.compile_module(native.NATIVE_CONFIGS["cuda.persistent_coop"], ab, out, k_major)
    assert jit.compile(source, defines=defines).key == module.key  # the same binary
    assert inspection.native_source("cuda.persistent_coop", dtype) == (source, defines)
    with pytest.raises(ValueError, match="dtype must be one of"):
        native.aot_source("cuda.one_warpgroup", "int8")
    with pytest.raises(ValueError, match="unknown native variant"):
        native.aot_source("cuda.nope", "bf16")


def test_cpu_tensors_are_refused_with_a_reason():
    a = torch.randn(17, 64, dtype=torch.bfloat16)
    b = torch.randn(64, 72, dtype=torch.bfloat16)
    args = GemmArgs(a, b, torch.empty(17, 72, dtype=torch.bfloat16))
    for variant in native.VARIANTS:
        assert variant.backend == "cuda"
        assert "CUDA" in variant.supports(args)
    with pytest.raises(ValueError, match="CUDA tensors"):
        native.run(args, native.NATIVE_CONFIGS["cuda.one_warpgroup"])


def test_b_layout_detection():
    w = torch.randn(72, 64)  # (N, K) weight
    assert tma.b_is_k_major(w.t())
    assert not tma.b_is_k_major(torch.randn(64, 72))
    assert tma.b_is_k_major(torch.randn(64, 1))  # one column: describe it as a (1, K) row
    assert not tma.b_is_k_major(torch.randn(1, 72))


# ------------------------------------------------------------------------------- CPU: builds


def _count(sass: str, op: str) -> int:
    return len(re.findall(r"\b" + re.escape(op) + r"\b", sass))


@needs_nvrtc
@pytest.mark.parametrize("family", FAMILIES, ids=_family_id)
@pytest.mark.parametrize("name", PLAIN)
def test_variant_builds_for_sm90a(name, family):
    from tmagemm import jit

    ab, out, k_major = family
    config = native.NATIVE_CONFIGS[name]
    module = native.compile_module(config, ab, out, k_major)
    sass = jit.sass(module.cubin)
    usage = jit.resource_usage(module.cubin, native.kernel_name(config))

    mma = "QGMMA" if ab == FP8 else "HGMMA"
    other = "HGMMA" if ab == FP8 else "QGMMA"
    # Two 64-row fragments x 4 K-steps per stage (one_warpgroup, ping-pong) or one fragment (warp_specialized, coop).
    per_stage = 8 if config.kernel == "one_warpgroup" or config.pingpong else 4
    assert _count(sass, mma) == per_stage, f"{mma} count in {name}"
    assert _count(sass, other) == 0
    n_width = 128 if per_stage == 8 else config.block_n
    assert f"64x{n_width}x{32 if ab == FP8 else 16}" in sass, "wgmma shape"
    assert _count(sass, "UTMALDG") >= 2 and _count(sass, "UTMASTG") >= 1
    assert _count(sass, "LDL") == 0 and _count(sass, "STL") == 0, "local memory (spills) in the kernel"
    assert usage.local_bytes == 0 and usage.stack_bytes == 0
    # A GPU-wide memory barrier may appear once, where the cluster's barrier init is published;
    # one in the pipeline (e.g. a cluster-scope release on every stage release) stalls the
    # issuing warp for microseconds per k-block.
    assert _count(sass, "MEMBAR.ALL.GPU") <= (1 if config.cluster_m > 1 else 0), "GPU-wide barrier in the pipeline"
    # ptxas C7514/C7515: registers of an in-flight wgmma touched, so it waits after every wgmma.
    assert "are serialized" not in module.log, "ptxas serialized the wgmmas"
    if config.kernel == "one_warpgroup":
        assert "USETMAXREG" not in sass
    else:
        # launch_bounds(384, 1) caps the kernel at 168 registers; the producer gives back to 40
        # (0x28) and the consumers ask for 232 (0xe8).
        assert usage.registers == 168
        assert re.search(r"USETMAXREG\.DEALLOC\.CTAPOOL 0x28\b", sass)
        assert re.search(r"USETMAXREG\.TRY_ALLOC\.CTAPOOL \w+, 0xe8\b", sass)


@needs_nvrtc
@pytest.mark.parametrize("out", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("config", native.PROMOTE_CANDIDATES, ids=lambda c: c.label())
def test_promoted_fp8_builds_for_sm90a(config, out):
    """use_fast_accum=False: one wgmma batch per k-block and 128 columns into scratch registers,
    then 64 adds into the fp32 accumulators, without spills or ptxas serializing the wgmmas."""
    from tmagemm import jit

    config = config.fitted(torch.empty((), dtype=out).element_size())
    module = native.compile_module(config, FP8, out, True)
    sass = jit.sass(module.cubin)
    parts = config.block_n // 128
    # 4 wgmmas per k-block and 128 columns; depth 2 issues them at three sites (a step's two
    # k-blocks, the odd last one).
    assert _count(sass, "QGMMA") == (12 if config.promote_depth == 2 else 4 * parts)
    assert "QGMMA.64x128x32.F32.E4M3.E4M3" in sass
    assert _count(sass, "FADD") >= 64 * parts, "the promotion adds"
    assert _count(sass, "LDL") == 0 and _count(sass, "STL") == 0
    assert "are serialized" not in module.log, "ptxas serialized the wgmmas"
    assert jit.resource_usage(module.cubin, native.kernel_name(config)).registers == 168


_TAIL_BUILDS = [
    (replace(native.NATIVE_CONFIGS["cuda.persistent_coop"], tail_split=4), FP8, torch.bfloat16, True),
    (replace(native.NATIVE_CONFIGS["cuda.persistent_coop_mc"], tail_split=4), torch.bfloat16, torch.float32, False),
    (replace(native._PROMOTE_WIDE, tail_split=4, block_scaled=True), FP8, torch.bfloat16, True),
    (replace(native._PROMOTE_NARROW, tail_split=4), FP8, torch.float32, True),
]


@needs_nvrtc
@pytest.mark.parametrize("config, ab, out, k_major", _TAIL_BUILDS, ids=lambda c: getattr(c, "label", lambda: None)())
def test_tail_split_builds_for_sm90a(config, ab, out, k_major):
    """The tail slices' hand-over: 16-byte fragment stores and loads through L2, one release add
    after a GPU-scope fence and an acquire spin, and the mainloop as before (no spills, wgmmas
    not serialized, the register split)."""
    from tmagemm import jit

    config = config.fitted(torch.empty((), dtype=out).element_size())
    module = native.compile_module(config, ab, out, k_major)
    sass = jit.sass(module.cubin)
    frag_vectors = config.block_n // 2 // 4  # float4s of one consumer's fragment per thread
    assert _count(sass, "STG.E.128.STRONG.GPU") == frag_vectors
    assert _count(sass, "LDG.E.128.STRONG.GPU") == frag_vectors
    assert _count(sass, "REDG.E.ADD.S32.STRONG.GPU") == 1 and "NANOSLEEP" in sass
    assert _count(sass, "MEMBAR.ALL.GPU") == 1 + (1 if config.cluster_m > 1 else 0)
    assert _count(sass, "LDL") == 0 and _count(sass, "STL") == 0
    assert "are serialized" not in module.log, "ptxas serialized the wgmmas"
    assert jit.resource_usage(module.cubin, native.kernel_name(config)).registers == 168


def test_fast_accum_false_is_accepted_only_by_promoting_configs():
    a = torch.randn(64, 128).to(FP8)
    args = GemmArgs(a, a.t(), torch.empty(64, 64, dtype=torch.bfloat16), fast_accum=False)
    if torch.cuda.is_available() and native._device.hopper_available() is None:
        args = GemmArgs(a.cuda(), a.cuda().t(), args.out.cuda(), fast_accum=False)
        assert "use_fast_accum=False" in native.unsupported_reason(args, native.NATIVE_CONFIGS["cuda.warp_specialized"])
        assert native.unsupported_reason(args, native._COOP_PROMOTE) is None
        coop = next(v for v in native.VARIANTS if v.name == "cuda.persistent_coop")
        assert coop.supports(args) is None
        assert coop.build(args).config.promote
    else:  # without a Hopper GPU every native config refuses first, naming the device
        assert native.unsupported_reason(args, native._COOP_PROMOTE) is not None


# ------------------------------------------------------------------------------- GPU


def _assert_close(out: torch.Tensor, ref: torch.Tensor, rtol: float, atol, what: str) -> None:
    got = out.double()
    bad = ~((got - ref).abs() <= atol + rtol * ref.abs())  # NaN counts as bad
    if bad.any():
        idx = tuple(int(i) for i in bad.nonzero()[0])
        err = ((got - ref).abs() - rtol * ref.abs()).nan_to_num(float("inf"))
        worst = tuple(int(i) for i in torch.unravel_index(err.argmax(), err.shape))
        pytest.fail(
            f"{what}: {int(bad.sum())} of {bad.numel()} elements off (rtol={rtol}); first at {idx}: "
            f"got {got[idx].item()} want {ref[idx].item()}; worst at {worst}: got {got[worst].item()} "
            f"want {ref[worst].item()}"
        )


# Output rounding (bf16 8 bits, fp16 11 bits) with a factor 2 for fp32 accumulation order.
_OUT_TOL = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 2**-13}


def _fp8_accum_atol(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """FP8 wgmma accumulates with fewer mantissa bits than fp32 (the "fast accumulation" of
    torch._scaled_mm(use_fast_accum=True), which the kernels match bit for bit in the benchmark):
    the error grows with the magnitude of the partial sums, bounded here by 2^-10 * (|A| @ |B|) (observed worst: about 2^-12)."""
    return 2.0**-10 * (a.double().abs() @ b.double().abs())


def _poisoned_out(m: int, n: int, dtype: torch.dtype):
    """out = a view inside a larger NaN-filled buffer, so writes past M or N are detected."""
    pad = 16 // torch.empty((), dtype=dtype).element_size()
    big = torch.full((m + 3, n + pad), float("nan"), dtype=dtype, device="cuda")
    return big, big[1 : m + 1, :n]


def _check_untouched(big: torch.Tensor, m: int, n: int) -> None:
    mask = torch.ones(big.shape, dtype=torch.bool, device=big.device)
    mask[1 : m + 1, :n] = False
    assert big[mask].isnan().all(), "the kernel wrote outside the (M, N) output"


def _operands(m, n, k, ab, k_major):
    if ab == FP8:
        a = (torch.randn(m, k, device="cuda") * 2).to(FP8)
        w = (torch.randn(n, k, device="cuda") * 2).to(FP8)
    else:
        a = torch.randn(m, k, device="cuda", dtype=ab)
        w = torch.randn(n, k, device="cuda", dtype=ab)
    b = w.t() if k_major else w.t().contiguous()
    return a, b


# K stays a multiple of 16 (fp8 rows must be 16-byte aligned for TMA) but off the 64/128 k-block.
SHAPES = [(1, 264, 144), (17, 72, 336), (727, 520, 208), (300, 1000, 1104)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("family", FAMILIES, ids=_family_id)
@pytest.mark.parametrize("name", PLAIN)
def test_variant_matches_float64(name, family, shape, seeded):
    ab, out_dtype, k_major = family
    m, n, k = shape
    a, b = _operands(m, n, k, ab, k_major)
    big, out = _poisoned_out(m, n, out_dtype)
    scale_a = scale_b = bias = None
    ref = a.double() @ b.double()
    if ab == FP8 and shape in (SHAPES[1], SHAPES[3]):  # tensor-wise scales: the one-multiply epilogue
        scale_a = torch.rand(1, device="cuda") + 0.5
        scale_b = torch.rand(1, device="cuda") + 0.5
        ref = ref * (scale_a.double() * scale_b.double())
    elif ab == FP8:  # row-wise scales and a bias: the general scaled_mm epilogue
        scale_a = torch.rand(m, device="cuda") + 0.5
        scale_b = torch.rand(n, device="cuda") + 0.5
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        ref = ref * scale_a.double()[:, None] * scale_b.double()[None, :] + bias.double()
    args = GemmArgs(a, b, out, scale_a, scale_b, bias)
    variant = next(v for v in native.VARIANTS if v.name == name)
    assert variant.supports(args) is None
    variant.build(args)(args)
    torch.cuda.synchronize()
    tol = _OUT_TOL[out_dtype]
    atol = tol * math.sqrt(k) * 2
    if ab == FP8:
        atol = atol + _fp8_accum_atol(a, b) * (scale_a.double().reshape(-1, 1) * scale_b.double().reshape(1, -1))
    _assert_close(out, ref, rtol=tol, atol=atol, what=f"{name} {_family_id(family)} {shape}")
    _check_untouched(big, m, n)


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES, ids=_family_id)
@pytest.mark.parametrize("raster_n", [False, True], ids=["raster_m", "raster_n"])
@pytest.mark.parametrize("name", ["cuda.persistent_coop", "cuda.persistent_coop_mc", "cuda.persistent_pingpong",
                                  "cuda.persistent_pingpong_mc"])
def test_persistent_ctas_walk_many_tiles(name, family, raster_n, seeded):
    # 3 CTAs (2 clusters of 2 for _mc) for 24 (coop) / 48 (ping-pong) tiles: the ring's phases
    # carry across tiles, the ping-pong turn barriers alternate, the last CTA gets a different
    # tile count, and the multicast pairs of the last cluster row meet the ragged edge (M = 727).
    ab, out_dtype, k_major = family
    m, n, k = 727, 1000, 336
    a, b = _operands(m, n, k, ab, k_major)
    big, out = _poisoned_out(m, n, out_dtype)
    # Groups of 4 rows (6 tile rows, 3 cluster rows) or 3 columns (4 or 8 tile columns): the last
    # group is partial either way.
    group = 3 if raster_n else 4
    config = replace(native.NATIVE_CONFIGS[name], ctas=4 if name.endswith("_mc") else 3, group_m=group,
                     raster_n=raster_n)
    native.run(GemmArgs(a, b, out), config)
    torch.cuda.synchronize()
    tol = _OUT_TOL[out_dtype]
    atol = tol * math.sqrt(k) * 2 + (_fp8_accum_atol(a, b) if ab == FP8 else 0.0)
    _assert_close(out, a.double() @ b.double(), rtol=tol, atol=atol, what=f"{name} 3 CTAs")
    _check_untouched(big, m, n)


@pytest.mark.gpu
@pytest.mark.parametrize("name", PLAIN)
def test_alpha_beta(name, seeded):
    m, n, k = 727, 520, 208
    a, b = _operands(m, n, k, torch.bfloat16, False)
    c = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    big, out = _poisoned_out(m, n, torch.bfloat16)
    alpha, beta = 0.75, -1.5
    native.run(GemmArgs(a, b, out), native.NATIVE_CONFIGS[name], alpha=alpha, beta=beta, c=c)
    torch.cuda.synchronize()
    ref = alpha * (a.double() @ b.double()) + beta * c.double()
    tol = _OUT_TOL[torch.bfloat16]
    _assert_close(out, ref, rtol=tol, atol=tol * math.sqrt(k) * 2, what=f"{name} alpha/beta")
    _check_untouched(big, m, n)


@pytest.mark.gpu
def test_beta_in_place_and_tensorwise_fp8(seeded):
    # c aliasing out (D = A@B + D) and tensor-wise fp8 scales on the persistent kernel.
    m, n, k = 300, 1000, 1104
    a, b = _operands(m, n, k, FP8, True)
    out = torch.randn(m, n, device="cuda", dtype=torch.float32)
    before = out.double().clone()
    sa = torch.tensor([0.25], device="cuda")
    sb = torch.tensor([3.0], device="cuda")
    native.run(GemmArgs(a, b, out, sa, sb), native.NATIVE_CONFIGS["cuda.persistent_coop"], beta=1.0, c=out)
    torch.cuda.synchronize()
    ref = (a.double() @ b.double()) * 0.75 + before
    _assert_close(out, ref, rtol=1e-5, atol=1e-3 + 0.75 * _fp8_accum_atol(a, b), what="fp8 tensor-wise, in-place beta")


# use_fast_accum=False: wgmma sums only one 128-deep k-block before each fp32 add. Measured worst
# error / (|A| @ |B|) on the H200 (scripts/gpu/exact_accum.py, identical to cuBLAS's promoted
# path): 1.8e-5 at K = 4096, 9e-6 at K = 16384, 7e-5 at K = 336 (one k-block's partial sums are
# then a larger part of the total); the fast path reaches 4.4e-4 - 6.1e-4 at K >= 4096.
_PROMOTED_ATOL = 2.0**-12


def _promoted_run(m, n, k, config=None):
    """fp8 with row-wise scales and a bias through the promoting cooperative kernel, fp32 out in a
    poisoned buffer; returns (big, out, ref, |error| bound)."""
    a, b = _operands(m, n, k, FP8, True)
    big, out = _poisoned_out(m, n, torch.float32)
    scale_a = torch.rand(m, device="cuda") + 0.5
    scale_b = torch.rand(n, device="cuda") + 0.5
    bias = torch.randn(n, device="cuda", dtype=torch.float32)
    args = GemmArgs(a, b, out, scale_a, scale_b, bias, fast_accum=False)
    if config is None:
        launcher = next(v for v in native.VARIANTS if v.name == "cuda.persistent_coop").build(args)
        assert launcher.config.promote
        launcher(args)
    else:
        native.run(args, config)
    torch.cuda.synchronize()
    scales = scale_a.double()[:, None] * scale_b.double()[None, :]
    ref = (a.double() @ b.double()) * scales + bias.double()
    bound = _PROMOTED_ATOL * (a.double().abs() @ b.double().abs()) * scales + 2.0**-22 * ref.abs()
    return big, out, ref, bound


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 264, 4096), (300, 1000, 1104), (727, 520, 4224)], ids=lambda s: "x".join(map(str, s)))
def test_promoted_fp8_matches_float64(shape, seeded):
    m, n, k = shape
    big, out, ref, bound = _promoted_run(m, n, k)
    _assert_close(out, ref, rtol=0.0, atol=bound, what=f"promoted fp8 {shape}")
    _check_untouched(big, m, n)


@pytest.mark.gpu
def test_promoted_fp8_ctas_walk_many_tiles(seeded):
    m, n, k = 727, 1000, 336  # 3 CTAs for 48 tiles of 128x128: phases carry across tiles
    big, out, ref, bound = _promoted_run(m, n, k, replace(native._COOP_PROMOTE, ctas=3, group_m=4))
    _assert_close(out, ref, rtol=0.0, atol=bound, what="promoted fp8, 3 CTAs")
    _check_untouched(big, m, n)


@pytest.mark.gpu
def test_promotion_bound_rejects_fast_accumulation(seeded):
    """The bound above is tight enough to tell the modes apart: on the same inputs the fast
    path (wgmma accumulating all of K) exceeds it somewhere."""
    m, n, k = 512, 512, 8192
    a, b = _operands(m, n, k, FP8, True)
    ref = a.double() @ b.double()
    bound = _PROMOTED_ATOL * (a.double().abs() @ b.double().abs())
    errors = {}
    for fast in (True, False):
        out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.float32)
        args = GemmArgs(a, b, out, fast_accum=fast)
        launcher = next(v for v in native.VARIANTS if v.name == "cuda.persistent_coop").build(args)
        assert launcher.config.promote is not fast
        launcher(args)
        torch.cuda.synchronize()
        errors[fast] = (out.double() - ref).abs()
    assert bool((errors[False] <= bound).all()), f"promoted: worst error / bound {float((errors[False] / bound).max()):.3f}"
    assert bool((errors[True] > bound).any()), f"fast: worst error / bound {float((errors[True] / bound).max()):.3f}"


@pytest.mark.gpu
def test_fp8_n_major_b_is_refused():
    a = torch.randn(64, 128, device="cuda").to(FP8)
    b = torch.randn(128, 64, device="cuda").to(FP8)  # row-major (K, N): not K-major
    args = GemmArgs(a, b, torch.empty(64, 64, device="cuda", dtype=torch.bfloat16))
    for variant in native.VARIANTS:
        if variant.name != "cuda.blockscaled":  # refuses unscaled problems first
            assert "K-major" in variant.supports(args)


@pytest.mark.gpu
def test_unaligned_stride_is_refused():
    a = torch.randn(64, 70, device="cuda", dtype=torch.bfloat16)  # 140-byte rows
    b = torch.randn(70, 64, device="cuda", dtype=torch.bfloat16)
    args = GemmArgs(a, b, torch.empty(64, 64, device="cuda", dtype=torch.bfloat16))
    assert "multiple of 16" in native.VARIANTS[0].supports(args)


# ------------------------------------------------------------------------------- block-scaled fp8


_BLOCK_CONFIGS = next(v for v in native.VARIANTS if v.name == "cuda.blockscaled").configs


@needs_nvrtc
@pytest.mark.parametrize("config", _BLOCK_CONFIGS, ids=lambda c: c.label())
def test_block_scaled_builds_for_sm90a(config):
    """The promoting mainloop with scales: the same four fp8 wgmmas per stage and 128 columns, no
    spills, and no serialized wgmma (ptxas warns when the scale loads would force it)."""
    from tmagemm import jit

    module = native.compile_module(config, FP8, torch.bfloat16, True)
    sass = jit.sass(module.cubin)
    assert _count(sass, "QGMMA") == (12 if config.promote_depth == 2 else 4 * (config.block_n // 128))
    assert "64x128x32" in sass
    usage = jit.resource_usage(module.cubin, native.kernel_name(config))
    assert usage.local_bytes == 0 and usage.stack_bytes == 0, usage
    assert "serialized" not in module.log
    assert not native.NATIVE_CONFIGS["cuda.blockscaled"].__class__(
        "persistent", block_n=128, stages=6, block_scaled=True).is_valid(2), "scales need the promoting mainloop"
    # The scales come with the operands: by TMA (the producer's A, B and two scale boxes per
    # stage), or, for other layouts, one loader lane copies 4 row scales and a weight-block scale
    # per stage and arrives once its copies land. The consumers read no scale from global memory.
    assert _count(sass, "UTMALDG.2D") == 4, "A, B (multicast for clusters), sa, sb"
    assert _count(sass, "UTMALDG.2D.MULTICAST") == (1 if config.cluster_m > 1 else 0)
    assert _count(sass, "LDGSTS.E") == 5 and _count(sass, "ARRIVES.LDGSTSBAR.64.ARVCNT") == 1
    assert "LDG.E.CONSTANT" not in sass, "a consumer reads its scales from global memory"


def _empty_barrier_arrivals(config, ab=FP8, out=torch.bfloat16) -> int:
    """The arrivals a stage's empty barrier waits for, as the kernel initialises it (each stage
    inits full, then empty; the count is an immediate moved into a register)."""
    ptx = native.compile_module(config, ab, out, True).ptx
    counts = re.findall(r"mbarrier\.init\.shared(?:::cta)?\.b64\s+\[[^\]]+\],\s*(\S+);", ptx)
    empty = counts[1]
    if empty.isdigit():
        return int(empty)
    return int(re.search(r"mov\.u32\s+" + re.escape(empty) + r",\s*(\d+);", ptx).group(1))


@needs_nvrtc
@pytest.mark.parametrize("config", [*_BLOCK_CONFIGS, replace(native._PROMOTE_WIDE, cluster_m=1)],
                         ids=lambda c: c.label())
def test_block_scaled_stages_are_freed_by_every_consumer_warp(config):
    """Each consumer warp reads its scales from the stage itself, so every warp (not one thread
    per warpgroup, whose retired wgmma group orders only the wgmma reads) frees it: the empty
    barrier counts 4 warps per consumer warpgroup and CTA of the cluster."""
    readers = config.cluster_m * (1 if config.pingpong else 2)
    assert _empty_barrier_arrivals(config) == readers * (4 if config.block_scaled else 1)


def _first_wait_and_wgmma(sass: str) -> tuple[list[str], int, int]:
    """The kernel's instructions, and the indices of a consumer's first full-barrier wait and of
    the wgmma it lets issue."""
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", sass)
    first = next(i for i, op in enumerate(ops) if "GMMA" in op)
    wait = max(i for i in range(first) if "SYNCS.PHASECHK" in ops[i])
    return ops, wait, first


@needs_nvrtc
@pytest.mark.parametrize("case", [*((native.NATIVE_CONFIGS[name], family) for name in PLAIN for family in FAMILIES[1::2]),
                                  *((config, FAMILIES[3]) for config in _BLOCK_CONFIGS)],
                         ids=lambda case: f"{case[0].label()}-{_family_id(case[1])}")
def test_stage_addresses_are_built_once(case):
    """Every k-block's wgmmas issue a few instructions after its stage is seen full: the operand
    descriptors of each stage are one add away from stage 0's, built before the mainloop
    (rebuilt from the ring's address, 23-34 instructions stood between the wait and the wgmma),
    and so is the full barrier's address (rebuilt from &full[stage], it read the CTA's id in its
    cluster, a long-latency S2UR, right before every wait)."""
    from tmagemm import jit

    config, (ab, out, k_major) = case
    module = native.compile_module(config, ab, out, k_major)
    ops, wait, first = _first_wait_and_wgmma(jit.sass(module.cubin))
    between = ops[wait + 1:first]
    if config.block_scaled:
        # The k-block's scale reads (and their addresses) stand there too, on purpose: read
        # after the wgmmas are issued, their multiplications held back the k-block's last wgmma.
        scale_reads = [i for i, op in enumerate(between) if op.startswith("LDS")]
        arrive = next(i for i, op in enumerate(between) if op.startswith("WARPGROUP.ARRIVE"))
        assert len(scale_reads) == 2 + config.block_n // 128 and max(scale_reads) < arrive, between
        # Up to 33 with NVRTC 13.0 (32 with 13.5); descriptors rebuilt from the ring would add
        # 23-34 more.
        assert len(between) <= 14 + 19, between
    else:
        assert len(between) <= 14, ops[wait:first + 1]
    assert not any("SR_CgaCtaId" in op for op in ops[wait - 8:first]), ops[wait - 8:first + 1]


def test_block_scaled_shared_memory_plan():
    """cuda.gemm's scale slot mirrors the kernel's kScaleFloats; block-scaled tiles keep their
    stages by staging half as much output (128 x 256: one buffer; 128 x 128: two passes)."""
    source = (Path(native.__file__).parent / "gemm_sm90_persistent.cu").read_text()
    assert "kScaleFloats = kBlockScaled ? kBlockM + 32 : 0;" in source
    assert native.SCALE_SLOT_BYTES == 4 * (128 + 32) and native.SCALE_SLOT_BYTES % 128 == 0
    wide = replace(native._PROMOTE_WIDE, block_scaled=True)
    assert wide.epi_buffers == 2 and not wide.is_valid(2)
    fitted = wide.fitted(2)
    assert (fitted.stages, fitted.epi_buffers) == (4, 1) and fitted.is_valid(2)
    assert fitted.smem_bytes(2) == wide.smem_bytes(2) - 16384 <= 232448
    assert wide.scale_bytes() == 4 * native.SCALE_SLOT_BYTES and native._PROMOTE_WIDE.scale_bytes() == 0
    fp32 = wide.fitted(4)  # one buffer cannot keep 4 stages: 3 stages with both buffers
    assert (fp32.stages, fp32.epi_buffers) == (3, 2) and fp32.is_valid(4)
    assert native._PROMOTE_WIDE.fitted(2) == native._PROMOTE_WIDE, "exact mode (no slots) keeps both buffers"
    narrow = replace(native._PROMOTE_NARROW, block_scaled=True)  # one pass: twice the passes keeps 6 stages
    assert (narrow.stages, narrow.epi_passes) == (6, 1) and not narrow.is_valid(2)
    assert (narrow.fitted(2).stages, narrow.fitted(2).epi_passes) == (6, 2)
    assert (narrow.fitted(4).stages, narrow.fitted(4).epi_passes) == (5, 2)
    assert native._PROMOTE_NARROW.fitted(2) == native._PROMOTE_NARROW


def _block_operands(m, n, k, device="cuda"):
    kb, nb = -(-k // 128), -(-n // 128)
    a = (torch.randn(m, k, device=device) * 4).to(FP8)
    w = (torch.randn(n, k, device=device) * 4).to(FP8)
    # Scales across 1e-6..1e4, as checkpoints with outlier blocks have them.
    sa = 10 ** (torch.rand(m, kb, device=device) * 10 - 6)
    sb = 10 ** (torch.rand(nb, kb, device=device) * 4 - 2)
    return a, w, sa, sb


def _block_reference(a, w, sa, sb):
    kb = torch.arange(a.shape[1], device=a.device) // 128
    rows = torch.arange(w.shape[0], device=a.device) // 128
    return (a.double() * sa.double()[:, kb]) @ (w.double() * sb.double()[rows][:, kb]).t()


def _block_scaled_check(m, n, k, scale_layout="row-major", config=None, maps=None):
    """The native block-scaled kernel (its heuristic config, or ``config``) on fresh operands with
    a bf16 bias, fp32 out in a poisoned buffer, against the float64 block dequantization.
    scale_layout "tight": a's scales along M and the weight's along K with 16-byte padded strides,
    in buffers ending at their last elements. ``maps``: whether a map can describe both scales;
    the launch then loads them by TMA (Params.block_scale_maps) on 128 x 256 tiles without a tail
    split, where they measured faster."""
    from tmagemm.plan import Scaling

    a, w, sa, sb = _block_operands(m, n, k)
    if scale_layout == "outer-dim-major":
        sa = sa.t().contiguous().t()
    elif scale_layout == "tight":
        sa, sb = tma.aligned_copy(sa, 0), tma.aligned_copy(sb, 1)
    big, out = _poisoned_out(m, n, torch.float32)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    args = GemmArgs(a, w.t(), out, sa, sb, bias, True, (Scaling.BLOCK_1X128, Scaling.BLOCK_128X128))
    variant = next(v for v in native.VARIANTS if v.name == "cuda.blockscaled")
    assert variant.supports(args) is None, variant.supports(args)
    plan = variant.build(args, config)
    if maps is not None:
        assert (native.block_scale_maps(sa, sb, plan.config.block_n) is not None) == maps, (sa.stride(), sb.stride())
        used = native._Launch(args, plan.config)._core.params.block_scale_maps
        assert used == int(maps and plan.config.block_n == 256 and not plan.config.tail_split), plan.config
    plan(args)
    torch.cuda.synchronize()
    ref = _block_reference(a, w, sa, sb) + bias.double()
    # Each k-block's sum is exact products added by wgmma's reduced-precision fp8 adder (bounded
    # like fast accumulation, 2^-10 of sum |a||b|; seen up to 6e-4 of it), then scaled and
    # added in fp32.
    kb = torch.arange(k, device="cuda") // 128
    magnitude = (a.double().abs() * sa.double()[:, kb]) @ (w.double().abs() * sb.double()[torch.arange(n, device="cuda") // 128][:, kb]).t()
    _assert_close(out, ref, rtol=1e-5, atol=2.0**-10 * magnitude + 1e-6, what=f"block-scaled {m}x{n}x{k} {config}")
    _check_untouched(big, m, n)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 2112, 576), (17, 520, 7168), (727, 2112, 576), (300, 1000, 1104)])
@pytest.mark.parametrize("scale_layout", ["row-major", "outer-dim-major"])
def test_block_scaled_matches_float64(m, n, k, scale_layout, seeded):
    _block_scaled_check(m, n, k, scale_layout)


# Scales that maps describe (loaded by TMA on the 128 x 256 candidates, by the copying warp on
# the others): M off 4 and K off 512 (boxes past a's last row and the weight's last k-block
# arrive as zeros from buffers that end at their last elements), K off 128, N ending in a
# 256-wide tile's first half, and 2x1 clusters whose second CTA has no rows (M = 4).
@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(727, 2112, 7168), (300, 1000, 1104), (1024, 584, 4224), (130, 2112, 2000),
                                   (4, 264, 640)])
def test_block_scaled_scales_by_tma(m, n, k, seeded):
    _block_scaled_check(m, n, k, "tight", maps=True)
    for config in native.PROMOTE_CANDIDATES:
        _block_scaled_check(m, n, k, "tight", replace(config, ctas=4, block_scaled=True), maps=True)


@pytest.mark.gpu
def test_block_scaled_scales_by_copying_warp(seeded):
    """Layouts no map describes keep the copying warp: row-major a scales, and weight scales
    whose row stride is not a multiple of 16 bytes (9 k-blocks)."""
    _block_scaled_check(300, 1000, 1104, "row-major", maps=False)
    _block_scaled_check(300, 1000, 1104, "outer-dim-major", maps=False)


def test_block_scale_maps_of_layouts():
    """Which scale layouts the producer loads by TMA: a's contiguous along M, the weight's along
    K, 16-byte aligned; boxes of 128 row scales and of 4 scales per 128 columns of the tile."""
    sa = torch.empty(9, 300).t()  # (300, 9), contiguous along M
    sb = torch.empty(8, 12)[:, :9]  # (8, 9), contiguous along K, rows 48 bytes apart
    layouts = native.block_scale_maps(sa, sb, 256)
    assert layouts is not None
    assert layouts[0].global_dims == (300, 9) and layouts[0].box_dims == (128, 1)
    assert layouts[1].global_dims == (9, 8) and layouts[1].box_dims == (4, 2)
    assert native.block_scale_maps(sa, sb, 128)[1].box_dims == (4, 1)
    assert native.block_scale_maps(torch.empty(300, 9), sb, 256) is None  # row-major a scales
    assert native.block_scale_maps(torch.empty(9, 301).t(), sb, 256) is None  # 1204-byte stride
    assert native.block_scale_maps(sa, torch.empty(8, 9), 256) is None  # 36-byte rows


# Every promoting tile the candidates offer, on 4 CTAs so each walks several tiles (phases carry
# across tiles); N = 584 and 2112 end inside a 256-wide tile's second 128-column half, whose
# weight-block index is clamped to the last block.
_PROMOTE_SHAPES = [(727, 2112, 1104), (300, 584, 4224), (1, 264, 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize("config", [replace(c, ctas=4) for c in native.PROMOTE_CANDIDATES], ids=lambda c: c.label())
@pytest.mark.parametrize("m,n,k", _PROMOTE_SHAPES)
def test_block_scaled_every_promoting_tile(config, m, n, k, seeded):
    _block_scaled_check(m, n, k, "outer-dim-major" if m % 2 else "row-major", replace(config, block_scaled=True))


@pytest.mark.gpu
@pytest.mark.parametrize("config", [replace(c, ctas=4) for c in native.PROMOTE_CANDIDATES], ids=lambda c: c.label())
@pytest.mark.parametrize("m,n,k", _PROMOTE_SHAPES)
def test_promoted_fp8_every_promoting_tile(config, m, n, k, seeded):
    big, out, ref, bound = _promoted_run(m, n, k, config)
    _assert_close(out, ref, rtol=0.0, atol=bound, what=f"promoted fp8 {config.label()}")
    _check_untouched(big, m, n)


# Tail splits: CTA counts that leave a last wave on at most half of the clusters, K deep enough
# for 2-4 slices of TAIL_MIN_K_BLOCKS k-blocks (each case asserts that its launch splits); ragged
# M, N and K, one row of tiles on more CTAs than tiles, single CTAs and 2x1 clusters.
_COOP = native.NATIVE_CONFIGS["cuda.persistent_coop"]
_TAIL_CASES = [
    ("fp8_tensorwise", replace(_COOP, ctas=11, tail_split=4), "fp8", (727, 1000, 8208)),
    ("fp8_one_row", replace(_COOP, ctas=16, tail_split=4), "fp8", (1, 1000, 8208)),
    ("bf16_nmajor_fp32", replace(_COOP, ctas=10, tail_split=4), "bf16", (300, 1000, 4160)),
    ("fp16_pairs", replace(native.NATIVE_CONFIGS["cuda.persistent_coop_mc"], ctas=10, tail_split=4), "fp16",
     (727, 1000, 2112)),
    ("promoted_pairs", replace(native._PROMOTE_WIDE, ctas=10, tail_split=4), "promoted", (727, 1000, 4224)),
    ("block_pairs", replace(native._PROMOTE_WIDE, ctas=10, tail_split=4, block_scaled=True), "block",
     (727, 1000, 4224)),
    ("block_narrow", replace(native._PROMOTE_NARROW, cluster_m=1, ctas=10, tail_split=4, block_scaled=True), "block",
     (300, 1000, 4224)),
]


def _tail_problem(kind, m, n, k):
    """(args in a poisoned output, the poisoned buffer, the variant, refill(): new A in place, and
    reference() -> (float64 result, atol, rtol) of the current inputs)."""
    from tmagemm.plan import Scaling

    if kind == "block":
        a, w, sa, sb = _block_operands(m, n, k)
        big, out = _poisoned_out(m, n, torch.float32)
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        args = GemmArgs(a, w.t(), out, sa, sb, bias, True, (Scaling.BLOCK_1X128, Scaling.BLOCK_128X128))

        def reference():
            kb = torch.arange(k, device="cuda") // 128
            w_abs = w.double().abs() * sb.double()[torch.arange(n, device="cuda") // 128][:, kb]
            magnitude = (a.double().abs() * sa.double()[:, kb]) @ w_abs.t()
            return _block_reference(a, w, sa, sb) + bias.double(), 2.0**-10 * magnitude + 1e-6, 1e-5

        return args, big, "cuda.blockscaled", lambda: a.copy_((torch.randn(m, k, device="cuda") * 4).to(FP8)), reference
    ab = {"fp8": FP8, "promoted": FP8, "bf16": torch.bfloat16, "fp16": torch.float16}[kind]
    out_dtype = {"fp8": torch.bfloat16, "promoted": torch.float32, "bf16": torch.float32, "fp16": torch.float16}[kind]
    a, b = _operands(m, n, k, ab, ab == FP8)
    big, out = _poisoned_out(m, n, out_dtype)
    if kind == "promoted":  # row-wise scales and a bias, fp32 promotion of every k-block
        scale_a, scale_b = torch.rand(m, device="cuda") + 0.5, torch.rand(n, device="cuda") + 0.5
        bias = torch.randn(n, device="cuda", dtype=torch.float32)
        args = GemmArgs(a, b, out, scale_a, scale_b, bias, fast_accum=False)

        def reference():
            scales = scale_a.double()[:, None] * scale_b.double()[None, :]
            ref = (a.double() @ b.double()) * scales + bias.double()
            return ref, _PROMOTED_ATOL * (a.double().abs() @ b.double().abs()) * scales + 2.0**-22 * ref.abs(), 0.0
    else:
        scale_a = scale_b = None
        if ab == FP8:
            scale_a, scale_b = torch.rand(1, device="cuda") + 0.5, torch.rand(1, device="cuda") + 0.5
        args = GemmArgs(a, b, out, scale_a, scale_b, None)

        def reference():
            tol = _OUT_TOL[out_dtype]
            ref, atol = a.double() @ b.double(), tol * math.sqrt(k) * 2
            if ab == FP8:
                scale = scale_a.double() * scale_b.double()
                ref, atol = ref * scale, atol + _fp8_accum_atol(a, b) * scale
            return ref, atol, tol

    def refill():
        a.copy_(_operands(m, 1, k, ab, True)[0])

    return args, big, "cuda.persistent_coop", refill, reference


@pytest.mark.gpu
@pytest.mark.parametrize("case", _TAIL_CASES, ids=lambda c: c[0])
def test_tail_split_matches_float64(case, seeded):
    """Eager twice (the first launch re-arms its counters for the second; the same bits both
    times), then replays of a CUDA graph (scratch from the capture) on new inputs."""
    label, config, kind, (m, n, k) = case
    args, big, name, refill, reference = _tail_problem(kind, m, n, k)
    cm = config.cluster_m
    tiles = -(-m // (128 * cm)) * -(-n // config.block_n)
    k_blocks = -(-k * args.a.element_size() // 128)
    clusters = min(config.ctas // cm, tiles * config.tail_split)
    assert native.tail_split(tiles, clusters, k_blocks, config.tail_split) > 1, "the case does not split"
    plan = next(v for v in native.VARIANTS if v.name == name).build(args, config)
    plan(args)
    first = args.out.clone()
    plan(args)
    torch.cuda.synchronize()
    assert torch.equal(first, args.out), "two launches on the same inputs differ"
    ref, atol, rtol = reference()
    _assert_close(args.out, ref, rtol=rtol, atol=atol, what=f"tail split {label}")
    _check_untouched(big, m, n)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan(args)
    for replay in range(2):
        refill()
        args.out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref, atol, rtol = reference()
        _assert_close(args.out, ref, rtol=rtol, atol=atol, what=f"tail split {label}, graph replay {replay}")
    _check_untouched(big, m, n)


@pytest.mark.gpu
def test_block_scaled_refusals():
    from tmagemm.plan import Scaling

    a, w, sa, sb = _block_operands(16, 256, 512)
    out = torch.empty(16, 256, device="cuda", dtype=torch.bfloat16)
    variant = next(v for v in native.VARIANTS if v.name == "cuda.blockscaled")
    per_channel = torch.ones(256, 4, device="cuda")
    reason = variant.supports(GemmArgs(a, w.t(), out, sa, per_channel, None, True,
                                       (Scaling.BLOCK_1X128, Scaling.BLOCK_1X128)))
    assert "128x128 scales for b" in reason
    assert "block-scaled kernels only" not in (variant.supports(GemmArgs(a, w.t(), out, sa, sb, None, True,
                                                                         (Scaling.BLOCK_1X128, Scaling.BLOCK_128X128))) or "")
    plain = next(v for v in native.VARIANTS if v.name == "cuda.persistent_coop")
    assert "block-scaled kernels only" in plain.supports(GemmArgs(a, w.t(), out, sa, sb, None, True,
                                                                  (Scaling.BLOCK_1X128, Scaling.BLOCK_128X128)))


def test_aot_source_refuses_16_bit_block_scaled():
    with pytest.raises(ValueError, match="fp8 kernel"):
        native.aot_source("cuda.blockscaled", "bf16")
    source, defines = native.aot_source("cuda.blockscaled", "fp8")
    assert defines["TMAGEMM_BLOCK_SCALED"] == 1 and defines["TMAGEMM_PROMOTE"] == 1
