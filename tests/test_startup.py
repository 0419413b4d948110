"""Ahead-of-time warm-up and tuning (tmagemm.startup, `tmagemm warmup | tune`).

The CPU tests check the property warm-up relies on: every binary any M can need is the binary of
one of the M values warm-up plans (kernels take M at run time; configs change only per bucket).
The GPU test checks the bar: after warm-up, a first call at a new M compiles nothing and is fast.
"""

import time
from dataclasses import replace

import pytest
import torch

import tmagemm
from tmagemm import device, plan, wave_split
from tmagemm.cuda import decode
from tmagemm.cuda import gemm as native
from tmagemm.plan import GemmArgs
from tmagemm.startup import m_buckets
from tmagemm.triton import matmul_persistent, matmul_splitk, matmul_tma
from tmagemm.triton.launch import kernel_params

F8 = torch.float8_e4m3fn
SHAPES = [(4096, 4096), (2048, 7168), (7168, 2048), (14336, 4096), (2560, 4096), (28672, 4096), (4096, 14336), (57344, 8192),
          (24576, 1536), (14336, 8192), (36864, 7168), (37888, 3584)]


def _args(m, n, k, dtype):
    a = torch.empty(m, k, dtype=dtype, device="meta")
    b = torch.empty(n, k, dtype=dtype, device="meta").t()
    scale = torch.empty(1, device="meta") if dtype == F8 else None
    return GemmArgs(a, b, torch.empty(m, n, dtype=torch.bfloat16, device="meta"), scale, scale)


def _binary(m, n, k, dtype, sms=132):
    """What decides the compiled binary of the call "auto" makes first at this M (launch-time
    values such as split_k, the persistent grid or M itself excluded)."""
    args = _args(m, n, k, dtype)
    name = plan.preference(args)[0]
    if name == "mixed.wave_split":  # whole waves on native 128 x 128 tiles, the rest planned alone
        columns = wave_split.lead_columns(m, n, dtype.itemsize, sms)
        return name, native.COOP_N128, _binary(m, n - columns, k, dtype, sms)
    if name == "cuda.decode":
        return name, decode.choose_config(m, n, k, dtype.itemsize, sms, decode.rule_for(args))
    if name == "triton.splitk":
        return name, matmul_splitk.choose_config(m, n, k, dtype.itemsize, sms)
    if name == "cuda.persistent_coop":
        config = native.coop_config(m, n, k, dtype.itemsize, True, sms)
        return name, replace(config, ctas=0, group_m=8, raster_n=False)
    module = matmul_tma if name == "triton.tma" else matmul_persistent
    return name, module.heuristic(args)


@pytest.mark.parametrize("slow", [False, True], ids=["fast_memory", "slow_memory"])
@pytest.mark.parametrize("dtype", [F8, torch.bfloat16], ids=["fp8", "bf16"])
@pytest.mark.parametrize("n,k", SHAPES)
def test_every_m_reuses_a_warmed_binary(dtype, n, k, slow, monkeypatch):
    """On a GPU with slow memory (an H100: its own decode rules and tile configs) and without."""
    monkeypatch.setattr(device, "slow_memory", lambda dev: slow)
    buckets = m_buckets(2100)
    warmed = {_binary(m, n, k, dtype) for m in buckets}
    for m in range(1, 2101):
        assert _binary(m, n, k, dtype) in warmed, f"M={m} needs a binary warm-up did not build"


def test_kernels_take_m_at_run_time():
    for fn in (matmul_tma.tma_gemm_kernel, matmul_persistent.persistent_gemm_kernel, matmul_splitk._splitk_kernel):
        param = next(p for p in kernel_params(fn) if p.name == "M")
        assert param.do_not_specialize, fn


def test_m_buckets():
    values = m_buckets(8192)
    assert values[0] == 1 and values[-1] == 8192 and values == sorted(set(values))
    for edge in (16, 17, 32, 33, 64, 65, 128, 129, 256, 257, 4096, 4097):
        assert edge in values
    assert m_buckets(20) == [1, 2, 3, 4, 5, 8, 9, 16, 17]


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="device must be a CUDA device"):
        tmagemm.warmup([(64, 64)], device="cpu")
    with pytest.raises(ValueError, match=r"\(N, K\) pairs"):
        tmagemm.warmup([(64,)])
    with pytest.raises(ValueError, match="dtypes"):
        tmagemm.warmup([(64, 64)], dtypes=["int8"])
    with pytest.raises(ValueError, match="scales"):
        tmagemm.tune([(64, 64)], scales=["blocks"])
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
            tmagemm.warmup([(64, 64)], scales=["block"])


@pytest.mark.gpu
def test_first_calls_after_warmup_compile_nothing(seeded):
    """The issue's bar: after warm-up for N = K = 4096 and 7168 x 2048, the first call at each of
    16 new M values takes a few milliseconds (planning only), never a compile."""
    shapes = [(4096, 4096), (7168, 2048)]
    tmagemm.warmup(shapes, dtypes=["fp8", "bf16"], max_m=2048, progress=False)
    new_m = [3, 7, 13, 24, 37, 50, 77, 100, 150, 200, 300, 333, 500, 777, 1500, 2000]
    worst = 0.0
    for n, k in shapes:
        w8 = torch.randn(n, k, device="cuda").to(F8)
        w16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()  # nn.Linear weight.t()
        for m in new_m:
            x8 = torch.randn(m, k, device="cuda").to(F8)
            x16 = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            sa, sb = torch.rand(m, 1, device="cuda") + 0.5, torch.rand(1, n, device="cuda") + 0.5
            for call in (lambda: tmagemm.scaled_mm(x8, w8.t(), sa, sb), lambda: tmagemm.matmul(x16, w16)):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                call()
                torch.cuda.synchronize()
                worst = max(worst, time.perf_counter() - t0)
    # A compile takes 0.3-2 s; planning from loaded binaries about a millisecond. 50 ms leaves
    # room for a slow host without letting any compile through.
    assert worst < 0.05, f"slowest first call {worst * 1e3:.1f} ms"
