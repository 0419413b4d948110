"""Public GEMMs on a Hopper GPU: every dtype/scale/bias/out combination, ragged and odd shapes,
NaN propagation, torch.compile and CUDA-graph capture. Skipped without a Hopper GPU."""

import json

import pytest
import torch
from gemm_ref import FP8, assert_close, fp8_operands, poisoned, reference

import tmagemm
from tmagemm import plan, tuning
from tmagemm.plan import GemmArgs

pytestmark = pytest.mark.gpu
TOL = {torch.float32: 2e-4, torch.float16: 1.5e-3, torch.bfloat16: 6e-3}
# fp8 wgmma with fast accumulation keeps partial sums in a reduced-precision adder (measured
# 4.8e-4 at K=864); with fp32 output that, not the output rounding, bounds the error.
FP8_TOL = {**TOL, torch.float32: 1e-3}


@pytest.fixture(autouse=True)
def no_tuning(monkeypatch):
    """Correctness does not depend on the config: use the heuristic ones (tuning is tested apart)."""
    monkeypatch.setenv("TMAGEMM_AUTOTUNE", "0")


def _scales(kind, m, n):
    if kind == "tensor":
        return torch.rand(1, device="cuda") + 0.5, torch.rand(1, device="cuda") + 0.5
    return torch.rand(m, 1, device="cuda") + 0.5, torch.rand(1, n, device="cuda") + 0.5


@pytest.mark.parametrize("a_dtype", [FP8, torch.float8_e5m2])
@pytest.mark.parametrize("scales", ["tensor", "row"])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m,n,k", [(727, 577, 864), (727, 577, 859), (2048, 1024, 512)])
def test_scaled_mm_combinations(a_dtype, scales, with_bias, out_dtype, m, n, k, seeded):
    a, b = fp8_operands(m, n, k, "cuda", a_dtype)
    sa, sb = _scales(scales, m, n)
    bias = torch.randn(n, device="cuda").to(out_dtype) if with_bias else None
    out = poisoned((m, n), out_dtype, "cuda")
    tmagemm.scaled_mm(a, b, sa, sb, bias=bias, out_dtype=out_dtype, out=out)
    assert_close(out, reference(a, b, sa, sb, bias), FP8_TOL[out_dtype], f"{a_dtype} {scales} bias={with_bias}")


@pytest.mark.parametrize("fast_accum", [True, False])
def test_scaled_mm_accumulation_modes(fast_accum, seeded):
    m, n, k = 512, 512, 4096  # long K: where fast accumulation loses bits
    a, b = fp8_operands(m, n, k, "cuda")
    sa, sb = _scales("tensor", m, n)
    out = tmagemm.scaled_mm(a, b, sa, sb, out_dtype=torch.float32, use_fast_accum=fast_accum)
    # Measured at K=4096: fast accumulation 1.3e-3, promotion every K tile 1.3e-4.
    assert_close(out, reference(a, b, sa, sb), 3e-3 if fast_accum else 3e-4, f"fast_accum={fast_accum}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
@pytest.mark.parametrize("a_col,b_col", [(False, False), (False, True), (True, False)])
@pytest.mark.parametrize("m,n,k", [(727, 577, 864), (727, 577, 859), (1024, 1024, 1024)])
def test_matmul_combinations(dtype, out_dtype, a_col, b_col, m, n, k, seeded):
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    b = torch.randn(k, n, device="cuda", dtype=dtype)
    a = a.t().contiguous().t() if a_col else a
    b = b.t().contiguous().t() if b_col else b
    want = out_dtype or dtype
    out = poisoned((m, n), want, "cuda")
    tmagemm.matmul(a, b, out_dtype=out_dtype, out=out)
    assert_close(out, reference(a, b), TOL[want], f"{dtype} a_col={a_col} b_col={b_col}")


@pytest.mark.parametrize("kind", ["fp8", "bf16"])
def test_m_sweep(kind, seeded):
    """Every M from 1 to 130: the small-M kernels, the tile edges at 64 and 128, and the crossover."""
    n, k = 384, 1024
    for m in range(1, 131):
        if kind == "fp8":
            a, b = fp8_operands(m, n, k, "cuda")
            sa, sb = _scales("row", m, n)
            out = poisoned((m, n), torch.bfloat16, "cuda")
            tmagemm.scaled_mm(a, b, sa, sb, out=out)
            assert_close(out, reference(a, b, sa, sb), TOL[torch.bfloat16], f"fp8 M={m}")
        else:
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
            out = poisoned((m, n), torch.bfloat16, "cuda")
            tmagemm.matmul(a, b, out=out)
            assert_close(out, reference(a, b), TOL[torch.bfloat16], f"bf16 M={m}")


@pytest.mark.parametrize("name", ["triton.tma", "triton.tma_device", "triton.persistent", "triton.ptr",
                                  "cuda.persistent_coop"])
def test_each_variant_large(name, seeded):
    m, n, k = 1000, 1504, 2000  # N*2 bytes a multiple of 16: every variant accepts it
    a, b = fp8_operands(m, n, k, "cuda")
    sa, sb = _scales("row", m, n)
    out = poisoned((m, n), torch.bfloat16, "cuda")
    args = GemmArgs(a, b, out, sa.reshape(-1), sb.reshape(-1))
    if name not in {v.name for v in plan.variants()}:
        pytest.skip(f"{name} not registered: {plan.unavailable()}")
    plan.build(args, variant=name)(args)
    assert_close(out, reference(a, b, sa, sb), TOL[torch.bfloat16], name)


def test_padded_leading_dims(seeded):
    m, n, k = 300, 200, 512
    abuf = torch.randn(m, k + 64, device="cuda").to(FP8)
    wbuf = torch.randn(n, k + 32, device="cuda").to(FP8)
    a, b = abuf[:, :k], wbuf[:, :k].t()
    obuf = poisoned((m, n + 8), torch.bfloat16, "cuda")
    sa, sb = _scales("tensor", m, n)
    tmagemm.scaled_mm(a, b, sa, sb, out=obuf[:, :n])
    assert_close(obuf[:, :n], reference(a, b, sa, sb), TOL[torch.bfloat16], "padded")
    assert torch.isnan(obuf[:, n:].float()).all()


@pytest.mark.parametrize("m", [7, 300])
def test_nan_propagates_to_its_row(m, seeded):
    n, k = 256, 512
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    a[3, 17] = float("nan")
    out = tmagemm.matmul(a, b)
    assert torch.isnan(out[3].float()).all()
    assert torch.isfinite(out[torch.arange(m, device="cuda") != 3].float()).all()
    a8, b8 = fp8_operands(m, n, k, "cuda")
    a8[3, 17] = float("nan")
    out8 = tmagemm.scaled_mm(a8, b8, *_scales("tensor", m, n))
    assert torch.isnan(out8[3].float()).all()


def test_torch_compile_fullgraph(seeded):
    m, n, k = 96, 256, 512
    a, b = fp8_operands(m, n, k, "cuda")
    sa, sb = _scales("row", m, n)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)

    @torch.compile(fullgraph=True)
    def f(a, b, sa, sb, x, w):
        return tmagemm.scaled_mm(a, b, sa, sb, out_dtype=torch.float32) + tmagemm.matmul(x, w).float()

    got = f(a, b, sa, sb, x, w)
    assert_close(got, reference(a, b, sa, sb) + reference(x, w), 1e-2, "compiled")


@pytest.mark.parametrize("m", [64, 640])  # the small-M plan differs inside a capture
def test_cuda_graph_capture_and_replay(m, monkeypatch, seeded):
    monkeypatch.setenv("TMAGEMM_AUTOTUNE", "1")  # tuning must be skipped during capture, not crash
    n, k = 512, 1024
    a, b = fp8_operands(m, n, k, "cuda")
    sa, sb = _scales("row", m, n)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        tmagemm.scaled_mm(a, b, sa, sb, out=out)  # warm-up: compiles (and tunes) outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tmagemm.scaled_mm(a, b, sa, sb, out=out)
    for _ in range(2):
        a.copy_(torch.randn(m, k, device="cuda").to(FP8))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, reference(a, b, sa, sb), TOL[torch.bfloat16], "graph replay")


def test_tuning_persists_to_disk(monkeypatch, tmp_path, seeded):
    monkeypatch.setenv("TMAGEMM_AUTOTUNE", "1")
    monkeypatch.setenv("TMAGEMM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tuning, "_memory", {})
    monkeypatch.setattr(tuning, "_disk_loaded", set())
    plan.clear_plans()
    m, n, k = 1024, 1024, 1024
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    out = tmagemm.matmul(a, b, backend="triton")
    assert_close(out, reference(a, b), TOL[torch.bfloat16], "tuned")
    files = list((tmp_path / "tuning").glob("*.json"))
    assert len(files) == 1
    stored = json.loads(files[0].read_text())
    assert any("m1024|n1024|k1024" in key for key in stored)
    # A fresh process (empty memory) reads the stored choice instead of tuning again.
    monkeypatch.setattr(tuning, "_memory", {})
    monkeypatch.setattr(tuning, "_disk_loaded", set())
    plan.clear_plans()
    monkeypatch.setattr(tuning.triton.testing, "do_bench", lambda *a, **k: pytest.fail("re-tuned"))
    tmagemm.matmul(a, b, backend="triton", out=out)


def test_forced_backends(seeded):
    """backend="cuda" runs a native kernel or says why none fits; "triton" never runs a native one."""
    if not any(v.backend == "cuda" for v in plan.variants()):
        pytest.skip(f"native backend not importable: {plan.unavailable()}")
    m, n, k = 1024, 1024, 1024
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    for backend in ("cuda", "triton"):
        out = poisoned((m, n), torch.bfloat16, "cuda")
        tmagemm.matmul(a, b, out=out, backend=backend)
        assert_close(out, reference(a, b), TOL[torch.bfloat16], backend)
        args = GemmArgs(a, b, out)
        assert plan.choose(args, backend).backend == backend
    with pytest.raises(ValueError, match="no 'cuda' tmagemm kernel accepts this problem"):
        tmagemm.matmul(a.t().contiguous().t(), b, backend="cuda")  # native kernels need A row-major


@pytest.mark.parametrize("m", [64, 300])
def test_repeated_calls_reuse_the_plan(m, seeded):
    """Later calls of one problem signature take the cached plan: fresh data each time, a side
    stream too, every result checked."""
    n, k = 512, 1024
    side = torch.cuda.Stream()
    for i in range(4):
        a, b = fp8_operands(m, n, k, "cuda")
        sa, sb = _scales("row", m, n)
        out = poisoned((m, n), torch.bfloat16, "cuda")
        stream = side if i % 2 else torch.cuda.current_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            tmagemm.scaled_mm(a, b, sa, sb, out=out)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        assert_close(out, reference(a, b, sa, sb), TOL[torch.bfloat16], f"call {i}")
