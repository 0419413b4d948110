"""AOT compilation for sm_90a and the PTX/SASS summaries, without a GPU.

Tests run with TRITON_INTERPRET=1 on the CPU, so compile_triton goes through its child process
(the interpreter's @triton.jit objects cannot be compiled in this process).
"""

import pytest
import triton
import triton.language as tl

from tmagemm import inspection


@triton.jit
def _copy_tile(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)


def test_ptx_and_sass_counters_on_known_text():
    ptx = """
    // cp.async.bulk.tensor in a comment is not counted
    cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%r1], [%rd1, {%r2, %r3}], [%r4];
    cp.async.bulk.tensor.2d.shared::cta.global.mbarrier::complete_tx::bytes [%r1], [%rd1, {%r2, %r3}], [%r4];
    cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%rd2, {%r5, %r6}], [%r7];
    @%p1 cp.async.cg.shared.global [ %r27 + 0 ], [ %rd20 + 0 ], 0x10, %r30;
    cp.async.commit_group;
    mbarrier.arrive.expect_tx.shared::cta.b64 _, [%r8], 16384;
    mbarrier.try_wait.parity.shared::cta.b64 %p2, [%r8], %r9;
    wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%f1}, %rd3, %rd4, 1, 1, 1;
    ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%r1, %r2, %r3, %r4}, [%r5];
    """
    counts = inspection.ptx_counts(ptx)
    assert counts["cp.async.bulk.tensor load"] == 2
    assert counts["cp.async.bulk.tensor store"] == 1
    assert counts["cp.async (per-thread)"] == 1
    assert counts["mbarrier.expect_tx"] == 1 and counts["mbarrier.arrive"] == 0 and counts["mbarrier.wait"] == 1
    assert counts["wgmma.mma_async"] == 1 and counts["ldmatrix"] == 1 and counts["mma.sync"] == 0
    sass = """
        /*0100*/                   UTMALDG.2D [UR8], [UR4] ;
        /*0110*/              @P0  LDGSTS.E.BYPASS.128 [R1], desc[UR6][R2.64] ;
        /*0120*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR4], R24, gsb0 ;
        /*0130*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR8], R24, gsb0 ;
        /*0140*/                   SYNCS.ARRIVE.TRANS64.RED.A1T0 RZ, [UR4], RZ ;
        /*0150*/                   STL [R1+0x4], R3 ;
    """
    s = inspection.sass_counts(sass)
    assert (s["UTMALDG"], s["LDGSTS"], s["QGMMA"], s["SYNCS"], s["STL"], s["HGMMA"]) == (1, 1, 2, 1, 1, 0)


def test_compile_a_kernel_defined_here_through_the_child_process(tmp_path):
    spec = inspection.KernelSpec(_copy_tile, {"src": "*fp16", "dst": "*fp16", "n": "i32", "BLOCK": "constexpr"},
                                 {"BLOCK": 1024}, num_warps=4, num_stages=1, name="copy")
    art = inspection.compile_triton(spec)
    assert ".target sm_90a" in art.ptx and ".entry _copy_tile" in art.ptx
    assert art.cubin[:4] == b"\x7fELF"
    summary = inspection.summarize(art)
    assert summary["load path"] == "ld.global" and summary["math"] == "none"
    assert summary["ptx ld.global"] > 0 and summary["sass LDG"] > 0 and summary["sass UTMALDG"] == 0
    assert 0 < art.registers <= 255 and art.spills == 0
    paths = inspection.write_dumps(art, tmp_path)
    assert paths["ptx"].read_text() == art.ptx and paths["sass"].read_text() == art.sass
    assert paths["cubin"].read_bytes() == art.cubin


def test_bad_specs_name_the_problem():
    with pytest.raises(ValueError, match=r"missing \['n'\]"):
        inspection.compile_triton(inspection.KernelSpec(_copy_tile, {"src": "*fp16", "dst": "*fp16", "BLOCK": "constexpr"}, {"BLOCK": 8}))
    with pytest.raises(ValueError, match="without a value"):
        inspection.compile_triton(
            inspection.KernelSpec(_copy_tile, {"src": "*fp16", "dst": "*fp16", "n": "i32", "BLOCK": "constexpr"}, {}))
    with pytest.raises(RuntimeError, match="copy"):
        inspection.compile_triton(inspection.KernelSpec(
            _copy_tile, {"src": "*fp16", "dst": "*fp16", "n": "i32", "BLOCK": "constexpr"}, {"BLOCK": 1000}, name="copy"))


def test_triton_tma_variant_uses_tma_and_wgmma():
    art = inspection.inspect_variant("triton.tma", "fp8")
    s = inspection.summarize(art)
    assert s["load path"] == "TMA" and s["math"] == "wgmma"
    assert s["ptx cp.async.bulk.tensor load"] > 0 and s["sass UTMALDG"] > 0
    assert s["sass QGMMA"] > 0 and s["sass HGMMA"] == 0  # fp8 wgmma is QGMMA in SASS
    assert s["ptx cp.async (per-thread)"] == 0 and s["ptx mbarrier.wait"] > 0
    assert art.shared > 64 * 1024 and 0 < art.registers <= 255


def test_triton_pointer_baseline_has_no_tma_loads():
    s = inspection.summarize(inspection.inspect_variant("triton.ptr", "fp16", {"block_m": 128, "block_n": 128, "block_k": 64}))
    assert s["sass UTMALDG"] == 0 and s["ptx cp.async.bulk.tensor load"] == 0
    assert s["load path"] in ("cp.async", "ld.global") and s["sass HGMMA"] > 0


def test_unknown_variant_and_config_fields():
    with pytest.raises(ValueError, match="unknown tmagemm variant"):
        inspection.inspect_variant("triton.nope")
    with pytest.raises(ValueError, match="unknown config fields"):
        inspection.triton_spec("triton.tma", "fp8", {"blockm": 64})
    for field in ({"swap_ab": True}, {"programs_per_sm": 3}):  # the grouped kernel's fields
        with pytest.raises(ValueError, match=f"triton.persistent: config has {next(iter(field))}.*only triton.grouped"):
            inspection.triton_spec("triton.persistent", "fp8", field)


def test_native_source_compiles_with_nvrtc_and_shows_tma_and_setmaxnreg():
    pytest.importorskip("cuda.bindings.nvrtc")
    defines = {"TMAGEMM_AB_TYPE": 2, "TMAGEMM_OUT_TYPE": 1, "TMAGEMM_B_KMAJOR": 1, "TMAGEMM_BLOCK_N": 128, "TMAGEMM_STAGES": 4}
    art = inspection.compile_native("gemm_sm90_warp_specialized.cu", defines)
    s = inspection.summarize(art)
    assert s["load path"] == "TMA" and s["math"] == "wgmma"
    assert s["sass UTMALDG"] > 0 and s["sass QGMMA"] > 0
    assert s["ptx setmaxnreg"] > 0 and s["sass USETMAXREG"] > 0  # producer/consumer register split
    assert "static shared bytes" in s and art.registers > 0
