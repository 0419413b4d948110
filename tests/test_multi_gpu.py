"""Two GPUs in one process: operands on one GPU while the other is current, devices alternating
call by call, one thread per GPU, CUDA-graph capture on the second GPU, and cuBLAS still working
on both afterwards.

Guards the issue where tensors on cuda:1 with cuda:0 current gave wrong results or left the
process's CUDA context broken. Needs two Hopper GPUs; skipped otherwise. References are float64
GEMMs on the operands' own GPU (a CPU float64 reference of M = 4096 would dominate the runtime).
"""

import threading

import pytest
import torch
from gemm_ref import poisoned
from gemm_ref import check_product as check

import tmagemm
from tmagemm import plan


def _two_hoppers() -> bool:
    # device_count() does not initialise CUDA, so this is free on a machine without a GPU.
    return torch.cuda.device_count() >= 2 and all(torch.cuda.get_device_capability(i) == (9, 0) for i in range(2))


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _two_hoppers(), reason="needs two Hopper (sm_90) GPUs")]

# (N, K) per M. N = K = 4096 at M = 1 and 16 puts "auto" and "cuda" on the native decode kernel
# (clusters of 2 CTAs; its modules are loaded per device) and "triton" on split-K, whose workspace
# is per device; 2048 elsewhere keeps the float64 references of M = 4096 cheap. "auto" then
# covers the decode kernel, the Triton tile kernel and the native persistent kernel (M = 4096);
# "triton" and "cuda" force their families. M = 128 on 35800 columns (280 tiles of 128: two waves
# of 132 SMs and 16) puts "auto" on mixed.wave_split for fp8 tensor-wise and bf16: a native and a
# Triton launch per call, on the operands' GPU. M = 1024 on 4352 x 4096 (136 tiles of 128 x 256:
# one wave and 4 tiles) gives the native persistent kernel a tail split, whose scratch and
# counters are per device.
SHAPES = {1: (4096, 4096), 16: (4096, 4096), 128: (35800, 512), 256: (2048, 2048), 1024: (4352, 4096),
          4096: (2048, 2048)}
KINDS = ("fp8-tensor", "fp8-row", "bf16")
# "op": the torch.library ops (torch.ops.tmagemm.*), which torch.compile calls, with backend "auto".
APIS = ("auto", "triton", "cuda", "op")

# Elementwise bound on |out - ref|: bf16 output rounding (half an ulp is 2^-9 relative; doubled)
# plus the accumulation's error as a fraction of sum_k |a_ik b_kj| (scaled): fp8 fast accumulation
# 2^-10; bf16 products summed in fp32 2^-12, 4x the worst case of K/16 fp32 roundings at K = 8192.


@pytest.fixture(autouse=True)
def heuristic_configs(monkeypatch):
    """Heuristic configs: correctness does not depend on them, and tuning would dominate the time."""
    monkeypatch.setenv("TMAGEMM_AUTOTUNE", "0")


def make(kind: str, m: int, device) -> tuple:
    """Fresh random operands ``(a, b, scale_a, scale_b)`` of one problem (scales None for bf16);
    fp8 ones quantized from Gaussian data like a real activation and weight."""
    n, k = SHAPES[m]
    if kind == "bf16":
        return (torch.randn(m, k, device=device, dtype=torch.bfloat16),
                torch.randn(k, n, device=device, dtype=torch.bfloat16), None, None)
    granularity = kind.removeprefix("fp8-")
    a, scale_a = tmagemm.quantize_fp8(torch.randn(m, k, device=device), granularity)
    w, scale_w = tmagemm.quantize_fp8(torch.randn(n, k, device=device), granularity)
    return a, w.t(), scale_a, scale_w.t()


def gemm(operands: tuple, api: str = "auto", out=None) -> torch.Tensor:
    """One call through the public function (``api`` = its backend) or the torch op ("op")."""
    a, b, scale_a, scale_b = operands
    fp8 = a.dtype != torch.bfloat16
    if api != "op":
        if fp8:
            return tmagemm.scaled_mm(a, b, scale_a, scale_b, out=out, backend=api)
        return tmagemm.matmul(a, b, out=out, backend=api)
    ops = torch.ops.tmagemm
    if out is None:
        return ops.scaled_mm(a, b, scale_a, scale_b) if fp8 else ops.matmul(a, b)
    if fp8:
        ops.scaled_mm_out(a, b, scale_a, scale_b, None, True, "auto", out)
    else:
        ops.matmul_out(a, b, "auto", out)
    return out


def run_checked(kind: str, m: int, device: int, api: str = "auto", what: str = "") -> None:
    """Fresh operands on ``device``, a poisoned output, one call; the result and the current
    device (which the call must leave as it found it) checked."""
    current = torch.cuda.current_device()
    operands = make(kind, m, f"cuda:{device}")
    out = poisoned((m, SHAPES[m][0]), torch.bfloat16, f"cuda:{device}")
    assert gemm(operands, api, out=out) is out
    assert torch.cuda.current_device() == current, f"{what}: the call left cuda:{torch.cuda.current_device()} current"
    check(out, *operands, what=what)


# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("m", list(SHAPES))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("data,current", [(1, 0), (0, 1)], ids=["data1-current0", "data0-current1"])
def test_operands_on_the_other_gpu(data, current, api, kind, m, seeded):
    """Operands on one GPU, the other current: into a poisoned ``out``, the first call plans and
    the second takes the cached plan (new operands, same signature); then the same twice with
    the output allocated by tmagemm (on the operands' GPU, not the current one)."""
    what = f"{kind} M={m} api={api} data on cuda:{data}, cuda:{current} current"
    with torch.cuda.device(current):
        for call in ("planned", "cached"):
            run_checked(kind, m, data, api, f"{what}, {call}")
        for call in ("planned", "cached"):
            operands = make(kind, m, f"cuda:{data}")
            got = gemm(operands, api)
            assert torch.cuda.current_device() == current, f"{what}: left cuda:{torch.cuda.current_device()} current"
            check(got, *operands, what=f"{what}, out=None, {call}")


@pytest.mark.parametrize("kind", ["fp8-row", "bf16"])
def test_alternating_devices(kind, seeded):
    """The same signatures on cuda:0 and cuda:1 in turn, with either GPU current: every result is
    right, each device keeps its own cached call, and later rounds plan nothing new."""
    ms = (1, 256)  # split-K (fp8) and the tile kernel
    planned = None
    for round_ in range(4):
        with torch.cuda.device(round_ % 2):  # rounds 0 and 2 with cuda:0 current, 1 and 3 with cuda:1
            for m in ms:
                for device in (0, 1):
                    run_checked(kind, m, device, what=f"{kind} M={m} round {round_} on cuda:{device}")
        if round_ == 0:
            planned = len(plan.cached_plans())
        else:
            assert len(plan.cached_plans()) == planned, f"round {round_} planned again"
    for m in ms:
        calls = []
        for device in (0, 1):
            a, b, scale_a, scale_b = make(kind, m, f"cuda:{device}")
            out = torch.empty(m, SHAPES[m][0], device=f"cuda:{device}", dtype=torch.bfloat16)
            op = "matmul" if kind == "bf16" else "scaled_mm"
            key = plan.call_key(op, a, b, scale_a, scale_b, None, out, torch.bfloat16 if op == "scaled_mm" else None,
                                True, "auto", (None, None) if op == "scaled_mm" else None)
            call = plan.cached(key)
            assert call is not None, f"M={m}: no cached call for cuda:{device}"
            assert call.device == out.device, f"M={m}: the cached call for cuda:{device} allocates on {call.device}"
            calls.append(call)
        assert calls[0] is not calls[1]


@pytest.mark.parametrize("set_device", [True, False], ids=["thread-sets-device", "thread-keeps-cuda0"])
def test_one_thread_per_gpu(set_device, seeded):
    """Two threads, each driving one GPU with 20 calls of mixed kinds and sizes, planning at the
    same time (plans are cleared after a warm-up, so they plan concurrently but do not compile
    Triton kernels concurrently, which is Triton's business rather than tmagemm's)."""
    work = [(kind, m) for m in (1, 16, 256) for kind in ("fp8-row", "bf16")]
    for device in (0, 1):
        for kind, m in work:
            run_checked(kind, m, device, what=f"warm-up {kind} M={m} on cuda:{device}")
    plan.clear_plans()
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    errors = []
    start = threading.Barrier(2)

    def drive(device: int) -> None:
        try:
            if set_device:
                torch.cuda.set_device(device)
            start.wait(timeout=60)
            for i in range(20):
                kind, m = work[(i + 3 * device) % len(work)]  # the two threads call different shapes at once
                run_checked(kind, m, device, what=f"thread for cuda:{device}, call {i}, {kind} M={m}")
            torch.cuda.synchronize(device)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append((device, exc))
            start.abort()

    threads = [threading.Thread(target=drive, args=(device,)) for device in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not any(thread.is_alive() for thread in threads), "a thread hung"
    assert not errors, "; ".join(f"cuda:{device}: {type(exc).__name__}: {exc}" for device, exc in errors)


@pytest.mark.parametrize("how", ["device-context", "stream-only"])
def test_graph_capture_on_second_gpu(how, monkeypatch, seeded):
    """Capture an fp8 split-K call and a bf16 tile-kernel call on cuda:1, replay with new inputs.

    "device-context": ``with torch.cuda.device(1), torch.cuda.graph(g)``. torch.cuda.graph's
    default capture stream is one class attribute made on whatever device was current at its
    first use, so it is reset here to be made on cuda:1 (otherwise a stream of cuda:0 left by an
    earlier capture in this process would capture nothing of cuda:1: a torch gotcha, not tmagemm's).
    "stream-only": cuda:0 stays current and torch.cuda.graph gets a stream of cuda:1 (entering the
    stream makes cuda:1 current during the capture, and leaving restores cuda:0)."""
    fp8 = make("fp8-row", 16, "cuda:1")
    bf16 = make("bf16", 256, "cuda:1")
    outs = [poisoned((m, SHAPES[m][0]), torch.bfloat16, "cuda:1") for m in (16, 256)]
    with torch.cuda.device(0):
        gemm(fp8, out=outs[0])  # eager warm-up: plans and compiles outside the capture
        gemm(bf16, out=outs[1])
        check(outs[0], *fp8, what="fp8 eager warm-up")
        check(outs[1], *bf16, what="bf16 eager warm-up")
        if how == "device-context":
            monkeypatch.setattr(torch.cuda.graph, "default_capture_stream", None)
            with torch.cuda.device(1):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    gemm(fp8, out=outs[0])
                    gemm(bf16, out=outs[1])
        else:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=torch.cuda.Stream(device=1)):
                gemm(fp8, out=outs[0])
                gemm(bf16, out=outs[1])
        assert torch.cuda.current_device() == 0
        for replay in range(2):
            # New values in the captured tensors (the graph reads their addresses).
            for captured, fresh in ((fp8, make("fp8-row", 16, "cuda:1")), (bf16, make("bf16", 256, "cuda:1"))):
                captured[0].copy_(fresh[0])
                if captured[2] is not None:
                    captured[2].copy_(fresh[2])
            for out in outs:
                out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize(1)
            assert torch.cuda.current_device() == 0
            check(outs[0], *fp8, what=f"{how}: fp8 replay {replay}")
            check(outs[1], *bf16, what=f"{how}: bf16 replay {replay}")


@pytest.mark.parametrize("data,current", [(1, 0), (0, 1)], ids=["data1-current0", "data0-current1"])
def test_quantizers_and_fp8_layers_on_the_other_gpu(data, current, seeded):
    """The quantizers (row, 1x128, 128x128), the fused RMSNorm and an FP8 layer with their tensors
    on one GPU and the other current: bit for bit what they give with their own GPU current."""
    import copy

    import tmagemm.nn as tnn
    from tmagemm.triton.norm_quantize import rms_norm_quantize

    x = torch.randn(17, 512, dtype=torch.bfloat16) * 3
    norm_weight = torch.rand(512, dtype=torch.bfloat16) + 0.5
    layer = tnn.FP8Linear.from_linear(torch.nn.Linear(512, 256, dtype=torch.bfloat16, device=f"cuda:{data}"))

    def results():
        xd = x.to(f"cuda:{data}")
        out = [t for g in ("row", "1x128", "128x128") for t in tmagemm.quantize_fp8(xd, g)]
        out += rms_norm_quantize(xd, norm_weight.to(f"cuda:{data}"), 1e-5)
        out.append(layer(xd))
        assert all(t.device == torch.device(f"cuda:{data}") for t in out)
        return [t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t for t in out]

    with torch.cuda.device(data):
        want = results()
    with torch.cuda.device(current):
        got = results()
        assert torch.cuda.current_device() == current
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    moved = copy.deepcopy(layer).to(f"cuda:{current}")  # and the layer's values are the same on the other GPU
    with torch.cuda.device(data):
        assert torch.equal(moved(x.to(f"cuda:{current}")).cpu(), want[-1].cpu())


@pytest.mark.parametrize("data,current", [(1, 0), (0, 1)], ids=["data1-current0", "data0-current1"])
def test_fp8_experts_on_the_other_gpu(data, current, seeded):
    """FP8Experts (routing, quantize, grouped GEMMs, SiLU quantizer, combine; the routing kernel at
    5 tokens, torch's sort at 600) with its tensors on one GPU and the other current: bit for bit
    what it gives with its own GPU current."""
    from tmagemm.nn.experts import FP8Experts

    layer = FP8Experts.from_weights(torch.randn(6, 512, 256, device=f"cuda:{data}", dtype=torch.bfloat16) / 16,
                                    torch.randn(6, 256, 256, device=f"cuda:{data}", dtype=torch.bfloat16) / 16)
    for tokens in (5, 600):
        x = torch.randn(tokens, 256, device=f"cuda:{data}", dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(6)[:2] for _ in range(tokens)]).to(f"cuda:{data}")
        w = torch.rand(tokens, 2, device=f"cuda:{data}", dtype=torch.bfloat16)
        with torch.cuda.device(data):
            want = layer(x, ids, w)
        with torch.cuda.device(current):
            got = layer(x, ids, w)
            assert torch.cuda.current_device() == current
        assert got.device == x.device and torch.equal(got, want), tokens


def test_cublas_still_works_on_both_gpus(seeded):
    """After tmagemm calls with the other GPU current (here and in the tests before: this one runs
    last), cuBLAS's bf16 GEMM and fp8 torch._scaled_mm still run and are right on each GPU: the
    old bug left the CUDA context broken."""
    m, n, k = 256, 384, 512
    for device in (0, 1):
        with torch.cuda.device(1 - device):
            run_checked("fp8-row", 16, device, what=f"tmagemm on cuda:{device}")
            x = torch.randn(m, k, device=f"cuda:{device}", dtype=torch.bfloat16)
            w = torch.randn(k, n, device=f"cuda:{device}", dtype=torch.bfloat16)
            # cuBLAS may reduce split-K partials in bf16 (torch's default), hence fp8's looser
            # accumulation term.
            check(torch.matmul(x, w), x, w, what=f"torch.matmul on cuda:{device}", accumulation=2.0**-10)
            a, sa = tmagemm.quantize_fp8(torch.randn(m, k, device=f"cuda:{device}"), "tensor")
            wq, sw = tmagemm.quantize_fp8(torch.randn(n, k, device=f"cuda:{device}"), "tensor")
            got = torch._scaled_mm(a, wq.t(), sa.reshape(()), sw.reshape(()), out_dtype=torch.bfloat16)
            check(got, a, wq.t(), sa, sw, what=f"torch._scaled_mm on cuda:{device}")
        torch.cuda.synchronize(device)
