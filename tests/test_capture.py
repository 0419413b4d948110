"""CUDA-graph capture of tmagemm calls at every M from 1 to 130, fp8 and bf16: torch.cuda.graph
after an eager warm-up, several graphs alive at once beside eager calls, a graph holding a chain
of GEMMs, and torch.compile(mode="reduce-overhead") (cudagraph trees) over a two-layer model.

Guards two bugs: split-K kept one workspace per stream, so capturing on torch.cuda.graph's own
side stream after an eager warm-up failed at small M; and under cudagraph trees a workspace
allocated in the graph pool outlived the capture ("tensor(s) in the cudagraph pool not tracked as
outputs") at M = 1 and 16. Needs a Hopper GPU. References are float64 GEMMs on the GPU (a CPU
float64 reference of 130 x 8192 x 8192 per M would dominate the runtime).
"""

import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gemm_ref import FP8, check_product as check

import tmagemm

pytestmark = pytest.mark.gpu

# One weight shape per kind, shared by every test so compiled kernels are shared:
# fp8 N = K = 4096 with row-wise scales: split-K at M <= 16, the tile kernel above;
# bf16 N = K = 8192 (128 MB of weight): split-K at M <= 32, the tile kernel above.
NK = {"fp8": 4096, "bf16": 8192}
KINDS = tuple(NK)
EVERY_M = range(1, 131)  # both sides of the split-K limits, the tile edges at 64 and 128, and past 128
FP8_MAX = torch.finfo(FP8).max

# Elementwise bound on |out - ref|: bf16 output rounding (half an ulp is 2^-9 relative; doubled)
# plus the accumulation's error as a fraction of sum_k |a_ik b_kj| (scaled): fp8 fast accumulation
# 2^-10; bf16 products summed in fp32 2^-12, 4x the worst case of K/16 fp32 roundings at K = 8192.


@pytest.fixture(autouse=True)
def heuristic_configs(monkeypatch):
    """Heuristic configs: tuning per M would dominate the time (capture with tuning enabled is
    test_gemm_gpu.py's)."""
    monkeypatch.setenv("TMAGEMM_AUTOTUNE", "0")


@pytest.fixture
def frozen_gc():
    """torch.cuda.graph (in older torch releases; cudagraph trees record through it) runs
    gc.collect() for every capture: with torch and inductor loaded that is ~0.1 s, and this
    module captures hundreds of graphs. Objects frozen now are skipped by collect() (tests
    refreeze after compiling for the same reason); unfrozen at the end."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture
def fresh_dynamo(monkeypatch):
    import torch._inductor.config as inductor_config

    # One graph is recorded per distinct M; the warning about "many distinct sizes" is expected.
    if hasattr(inductor_config.triton, "cudagraph_dynamic_shape_warn_limit"):
        monkeypatch.setattr(inductor_config.triton, "cudagraph_dynamic_shape_warn_limit", None)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def check_quantized(h, hq, hs, what=""):
    """(hq, hs) is a per-row fp8 quantization of h: hs = amax|h_row| / 448 and hq * hs within one
    fp8 rounding of h (half an ulp is 2^-4 relative for normals, 2^-10 * hs for subnormals; both
    doubled, which also admits round-toward-zero)."""
    h64, hs64 = h.double(), hs.double()
    amax = h64.abs().amax(dim=1, keepdim=True)
    torch.testing.assert_close(hs64, (amax / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny), rtol=1e-6, atol=0,
                               msg=lambda m: f"{what}: scales: {m}")
    err = (hq.double() * hs64 - h64).abs()
    bad = ~(err <= 2.0**-3 * h64.abs() + 2.0**-9 * hs64)
    if bool(bad.any()):
        r, c = bad.nonzero()[0].tolist()
        raise AssertionError(f"{what}: {int(bad.sum())} quantized values off; first at ({r}, {c}): "
                             f"{float(hq[r, c].float()) * float(hs[r]):.6g} for {float(h[r, c]):.6g}")


def fp8_weight(n: int, k: int):
    """(b, scale_b) of a row-quantized (N, K) weight in the scaled_mm layout."""
    w, scale = tmagemm.quantize_fp8(torch.randn(n, k, device="cuda"), "row")
    return w.t(), scale.t()


class Operands:
    """Max-size operands of one GEMM kind; a call at M uses views of the first M rows, so one
    weight and one set of input/output tensors serve every M (as captured inputs must: a graph
    reads the addresses it was captured with)."""

    def __init__(self, kind: str, rows: int, weight_of: "Operands | None" = None):
        self.kind, nk = kind, NK[kind]
        if weight_of is not None:
            self.b, self.scale_b = weight_of.b, weight_of.scale_b
        elif kind == "fp8":
            self.b, self.scale_b = fp8_weight(nk, nk)
        else:
            self.b, self.scale_b = torch.randn(nk, nk, device="cuda", dtype=torch.bfloat16), None
        self.a = torch.empty(rows, nk, device="cuda", dtype=FP8 if kind == "fp8" else torch.bfloat16)
        self.scale_a = torch.empty(rows, 1, device="cuda") if kind == "fp8" else None
        self.out = torch.empty(rows, nk, device="cuda", dtype=torch.bfloat16)

    def fill(self, m: int) -> None:
        """New random inputs in the first m rows (in place) and a poisoned (NaN) output."""
        x = torch.randn(m, self.a.shape[1], device="cuda")
        if self.kind == "fp8":
            q, s = tmagemm.quantize_fp8(x, "row")
            self.a[:m].copy_(q)
            self.scale_a[:m].copy_(s)
        else:
            self.a[:m].copy_(x)
        self.out[:m].fill_(float("nan"))

    def call(self, m: int) -> None:
        if self.kind == "fp8":
            tmagemm.scaled_mm(self.a[:m], self.b, self.scale_a[:m], self.scale_b, out=self.out[:m])
        else:
            tmagemm.matmul(self.a[:m], self.b, out=self.out[:m])

    def check(self, m: int, what: str) -> None:
        scale_a = None if self.scale_a is None else self.scale_a[:m]
        check(self.out[:m], self.a[:m], self.b, scale_a, self.scale_b, f"{self.kind} M={m} {what}")


# ------------------------------------------------------------------------------- torch.cuda.graph


@pytest.mark.parametrize("kind", KINDS)
def test_graph_after_eager_warmup_every_m(kind, frozen_gc, seeded):
    """At each M: an eager call on the default stream (plans, compiles, makes the stream's
    workspace), then a capture with ``torch.cuda.graph(g)`` on torch's own side stream, replayed
    twice with new inputs (the second replay also needs the split-K counters re-armed)."""
    ops = Operands(kind, max(EVERY_M))
    for m in EVERY_M:
        ops.fill(m)
        ops.call(m)
        ops.check(m, "eager warm-up")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            ops.call(m)
        for replay in range(2):
            ops.fill(m)
            graph.replay()
            ops.check(m, f"replay {replay}")
        del graph


@pytest.mark.parametrize("shared_pool", [False, True], ids=["own-pools", "shared-pool"])
def test_graphs_alive_at_once(shared_pool, seeded):
    """Graphs for M = 1, 16 and 100, each holding an fp8 and a bf16 call with its own inputs,
    replayed in interleaved order; beside each replay an eager call of the same shapes runs on a
    side stream at the same time. Sharing one memory pool between the graphs (as cudagraph trees
    and serving engines do) must not make their scratch memory collide either."""
    ms = (1, 16, 100)
    pool = torch.cuda.graph_pool_handle() if shared_pool else None
    eager = {kind: Operands(kind, max(ms)) for kind in KINDS}
    captured, graphs = {}, {}
    for m in ms:
        captured[m] = [Operands(kind, m, weight_of=eager[kind]) for kind in KINDS]
        for ops in captured[m]:
            ops.fill(m)
            ops.call(m)  # eager warm-up
            ops.check(m, "warm-up")
        graphs[m] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[m], pool=pool):
            for ops in captured[m]:
                ops.call(m)
    side = torch.cuda.Stream()
    for step, m in enumerate((16, 1, 100, 1, 100, 16, 16, 1, 100)):
        for ops in (*captured[m], *eager.values()):
            ops.fill(m)
        side.wait_stream(torch.cuda.current_stream())
        graphs[m].replay()
        with torch.cuda.stream(side):
            for ops in eager.values():
                ops.call(m)
        torch.cuda.current_stream().wait_stream(side)
        for ops in captured[m]:
            ops.check(m, f"step {step}: graph replay")
        for ops in eager.values():
            ops.check(m, f"step {step}: eager call beside the replay")


def bf16_chain(x, w1, w2):
    h = tmagemm.matmul(x, w1)
    return h, tmagemm.matmul(h, w2)


def quantize_rows(h):
    """Per-row fp8 quantization in plain torch ops (torch.compile fuses them; tmagemm.quantize_fp8
    reads a flag back to reject Inf/NaN, which fullgraph cannot trace)."""
    amax = h.float().abs().amax(dim=1, keepdim=True)
    scale = (amax / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    return (h.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_mlp(x, scale_x, w1, scale_w1, w2, scale_w2, quantize=quantize_rows):
    h = tmagemm.scaled_mm(x, w1, scale_x, scale_w1)
    hq, scale_h = quantize(h)
    return h, hq, scale_h, tmagemm.scaled_mm(hq, w2, scale_h, scale_w2)


class Model:
    """A two-layer model of one kind with fixed weights; ``inputs(m)`` makes fresh inputs and
    ``check`` verifies each layer's result against float64 from that layer's actual inputs (the
    quantization between fp8 layers is checked on its own: requantizing a float64 h would round
    differently near ties)."""

    def __init__(self, kind: str):
        self.kind, nk = kind, NK[kind]
        if kind == "fp8":
            self.weights = (*fp8_weight(nk, nk), *fp8_weight(nk, nk))
        else:
            self.weights = tuple(torch.randn(nk, nk, device="cuda", dtype=torch.bfloat16) for _ in range(2))

    def inputs(self, m: int) -> tuple:
        x = torch.randn(m, NK[self.kind], device="cuda")
        return tmagemm.quantize_fp8(x, "row") if self.kind == "fp8" else (x.bfloat16(),)

    def function(self, quantize=quantize_rows):
        if self.kind == "bf16":
            return bf16_chain
        return lambda x, scale_x, w1, scale_w1, w2, scale_w2: fp8_mlp(x, scale_x, w1, scale_w1, w2, scale_w2, quantize)

    def check(self, inputs: tuple, results: tuple, what: str) -> None:
        what = f"{self.kind} M={inputs[0].shape[0]} {what}"
        if self.kind == "bf16":
            (x,), (w1, w2), (h, y) = inputs, self.weights, results
            check(h, x, w1, what=f"{what}: layer 1")
            check(y, h, w2, what=f"{what}: layer 2")
            return
        (x, scale_x), (w1, scale_w1, w2, scale_w2), (h, hq, scale_h, y) = inputs, self.weights, results
        check(h, x, w1, scale_x, scale_w1, f"{what}: layer 1")
        check_quantized(h, hq, scale_h, f"{what}: quantization")
        check(y, hq, w2, scale_h, scale_w2, f"{what}: layer 2")


@pytest.mark.parametrize("m", [1, 16, 100])
@pytest.mark.parametrize("kind", KINDS)
def test_graph_with_chained_gemms(kind, m, seeded):
    """One graph holding two GEMMs, the second reading the first's output (fp8: through
    tmagemm.quantize_fp8 inside the capture), replayed with new inputs."""
    model = Model(kind)
    fn = model.function(quantize=lambda h: tmagemm.quantize_fp8(h, "row"))
    inputs = model.inputs(m)
    model.check(inputs, fn(*inputs, *model.weights), "eager warm-up")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        results = fn(*inputs, *model.weights)  # allocated in the graph's pool, rewritten by each replay
    for replay in range(2):
        for captured, fresh in zip(inputs, model.inputs(m)):
            captured.copy_(fresh)
        for result in results:
            if result.is_floating_point() and result.element_size() > 1:
                result.fill_(float("nan"))
        graph.replay()
        model.check(inputs, results, f"replay {replay}")


# ------------------------------------------------------------------------------- torch.compile


def _cudagraph_skips() -> int:
    from torch._dynamo.utils import counters

    return counters["inductor"]["cudagraph_skips"]


def _recorded_graphs() -> int:
    """CUDA graphs cudagraph trees recorded on the current device since the last dynamo reset
    (warm-up runs are not graphs)."""
    from torch._inductor import cudagraph_trees

    manager = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    if manager is None:
        return 0
    nodes = [node for found in manager.roots.values() for node in found]
    count = 0
    while nodes:
        node = nodes.pop()
        count += 1
        nodes += [child for found in getattr(node, "children", {}).values() for child in found]
    return count


@pytest.mark.parametrize("kind", KINDS)
def test_compile_reduce_overhead_every_m(kind, fresh_dynamo, frozen_gc, seeded):
    """torch.compile(mode="reduce-overhead", fullgraph=True) over the two-layer model at every M.

    Automatic dynamic shapes (the default) compile twice: M = 1 specialised, then M symbolic for
    every later M; cudagraph trees then warm up, record and replay one graph per distinct M, which
    is what the three calls per M walk through (warm-up and recording are where the pool bug hit).
    """
    model = Model(kind)
    compiled = torch.compile(model.function(), mode="reduce-overhead", fullgraph=True)
    skips = _cudagraph_skips()
    with torch.no_grad():
        for m in EVERY_M:
            for call in ("warm-up", "recording", "replay"):
                inputs = model.inputs(m)
                torch.compiler.cudagraph_mark_step_begin()
                results = compiled(*inputs, *model.weights)
                model.check(inputs, results, f"reduce-overhead {call}")
                del results  # cudagraph trees rewrite them on the next replay
            if m <= 2:
                gc.freeze()  # what the compiles left behind
        assert _cudagraph_skips() == skips, "cudagraph trees skipped the graph (see the log for why)"
        assert _recorded_graphs() >= len(EVERY_M), f"{_recorded_graphs()} graphs recorded for {len(EVERY_M)} sizes"


@pytest.mark.parametrize("kind", KINDS)
def test_compile_default_mode(kind, fresh_dynamo, seeded):
    """torch.compile(fullgraph=True) without CUDA graphs at a few M (two compiles: M = 1, then
    symbolic M)."""
    model = Model(kind)
    compiled = torch.compile(model.function(), fullgraph=True)
    with torch.no_grad():
        for m in (1, 16, 100, 130):
            for _ in range(2):
                inputs = model.inputs(m)
                model.check(inputs, compiled(*inputs, *model.weights), "compiled")


COLD_CAPTURE = r"""
import sys
import torch
sys.path.insert(0, sys.argv[1])
from gemm_ref import check_product
import tmagemm
from tmagemm import nn as tnn

torch.manual_seed(0)
w8, sw8 = tmagemm.quantize_fp8(torch.randn(4096, 4096, device="cuda"), "row")
w16 = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
layer = tnn.FP8Linear.from_linear(torch.nn.Linear(4096, 4096, device="cuda", dtype=torch.bfloat16))
cases = []
for m in (1, 16, 100):
    x8, sx8 = tmagemm.quantize_fp8(torch.randn(m, 4096, device="cuda"), "row")
    cases.append(("fp8", m, (x8, sx8), torch.full((m, 4096), float("nan"), device="cuda", dtype=torch.bfloat16)))
    cases.append(("bf16", m, (torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16),),
                  torch.full((m, 4096), float("nan"), device="cuda", dtype=torch.bfloat16)))
x_layer = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
from tmagemm.cuda import decode
built = []
build_quantizing = decode.build_quantizing
decode.build_quantizing = lambda args, config=None: built.append(args.m) or build_quantizing(args, config)
torch.cuda.synchronize()
graph = torch.cuda.CUDAGraph()
with torch.no_grad(), torch.cuda.graph(graph):  # no GEMM and no layer call ran before
    for kind, m, inputs, out in cases:
        if kind == "fp8":
            tmagemm.scaled_mm(inputs[0], w8.t(), inputs[1], sw8.reshape(1, -1), out=out)
        else:
            tmagemm.matmul(inputs[0], w16.t(), out=out)
    y_layer = layer(x_layer)
assert built == [1], f"the block layer's one-launch form was not built in the capture: {built}"
for replay in range(2):
    for kind, m, inputs, out in cases:
        inputs[0].copy_(torch.randn(m, 4096, device="cuda").to(inputs[0].dtype))
        out.fill_(float("nan"))
    x_layer.copy_(torch.randn_like(x_layer))
    graph.replay()
    torch.cuda.synchronize()
    for kind, m, inputs, out in cases:
        if kind == "fp8":
            check_product(out, inputs[0], w8.t(), inputs[1], sw8.reshape(1, -1), f"fp8 M={m} replay {replay}")
        else:
            check_product(out, inputs[0], w16.t(), what=f"bf16 M={m} replay {replay}")
    with torch.no_grad():
        want = layer.quantized_input_mm(*tnn.quantize.quantize_activation(x_layer, "block"), layer.bias, x_layer.dtype)
    assert torch.equal(y_layer, want), f"block FP8Linear replay {replay}"
print("cold capture ok")
"""


def test_capture_without_warm_up(tmp_path):
    """A process whose very first tmagemm calls are inside ``torch.cuda.graph`` (empty Triton and
    tmagemm compile caches, so kernels are compiled and modules loaded during the capture): fp8
    and bf16 GEMMs at M = 1, 16, 100 and a block-recipe FP8Linear at one token (its one-launch
    form, the decode kernel quantizing x), replayed twice with new inputs against float64 / the
    layer's two-launch path."""
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"), TMAGEMM_CACHE_DIR=str(tmp_path / "tmagemm"),
               TMAGEMM_AUTOTUNE="0")
    done = subprocess.run([sys.executable, "-c", COLD_CAPTURE, str(Path(__file__).parent)], env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0 and "cold capture ok" in done.stdout, done.stdout[-3000:] + done.stderr[-6000:]
