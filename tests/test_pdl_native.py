"""Programmatic dependent launch (PDL) in the native GEMM kernels (docs/native-gemm.md,
"Programmatic dependent launch").

CPU: every native build (each variant x dtype/layout family, and the promoting and block-scaled
builds) holds griddepcontrol.wait / .launch_dependents, and in its SASS control-flow graph
nothing that can run before the wait touches global memory (not even an L2 prefetch), exits or
releases the dependents. The checker is itself checked on
small kernels that break each rule. The launch asks for PDL per ``TMAGEMM_PDL``.

GPU (Hopper): chains of 6 GEMMs where each consumes the previous one's output (bf16 with the
weights' layouts alternating; fp8 row-wise and block-scaled fp8, each activation quantized by
``quantize_fp8`` from the previous GEMM's bf16 output), M = 256 and 4096, eager and replayed from a
CUDA graph, with PDL on and off; every native kernel in a chain of its own; and the hazards of one
kernel boundary: GEMM 2's weight is GEMM 1's output, and
GEMM 2 writes a buffer GEMM 1 reads. Outputs are NaN-poisoned before every run and inputs change
between runs, so a read from before the previous kernel finished shows up. Every GEMM is checked
against float64 from the operands it actually read (gemm_ref.check_product).
"""

from __future__ import annotations

import math
import re
from dataclasses import replace

import pytest
import torch
from gemm_ref import ACCUMULATION, FP8, OUT_ROUNDING, check_product as check
from test_native_gemm import FAMILIES, PLAIN, _family_id, needs_nvrtc

import tmagemm
from tmagemm import plan
from tmagemm.cuda import gemm as native

# ------------------------------------------------------------------------------- CPU: SASS order

# One SASS instruction: /*address*/ [@guard] OPCODE operands ;
_SASS_LINE = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s*(.*?)\s*;")
_INSTRUCTION = re.compile(r"(@!?U?P[T0-9]+\s+)?(\S+)\s*(.*)")
# Opcodes that read or write global memory: loads, stores, atomics/reductions, TMA loads, stores
# and reductions, bulk copies, LDGSTS (generic LD/ST may address global memory too).
_GLOBAL_OPS = {"LDG", "STG", "LD", "ST", "ATOM", "ATOMG", "RED", "REDG", "UTMALDG", "UTMAPF", "UTMASTG", "UTMAREDG",
               "UBLKCP", "UBLKRED", "LDGSTS"}


def _before_wait(sass: str) -> list[str]:
    """Base opcodes of the instructions that can run before griddepcontrol.wait (SASS ACQBULK):
    those reachable from the kernel's entry along a path that does not pass an unguarded ACQBULK,
    found on the control-flow graph of branches, calls and exits (one kernel per cubin)."""
    code = {}
    for line in sass.splitlines():
        m = _SASS_LINE.match(line)
        if m:
            address = int(m.group(1), 16)
            assert address not in code, "one kernel per cubin"
            code[address] = m.group(2)
    addresses = sorted(code)
    following = dict(zip(addresses, addresses[1:]))
    reached, seen, todo = [], set(), [addresses[0]]
    while todo:
        address = todo.pop()
        if address in seen or address not in code:
            continue
        seen.add(address)
        guard, opcode, operands = _INSTRUCTION.match(code[address]).groups()
        conditional = guard is not None and guard.strip() != "@PT"
        base = opcode.split(".")[0]
        reached.append(base)
        assert base not in ("BRX", "JMX", "JMP"), f"indirect branch {code[address]!r}: the order is not checkable"
        if base == "ACQBULK" and not conditional:
            continue  # the wait: whatever follows it runs after it
        successors = []
        if base in ("BRA", "CALL"):
            successors.append(int(re.findall(r"0x([0-9a-f]+)", operands)[-1], 16))
            # BRA with a predicate operand ("BRA P4, 0x..", "BRA.DIV UR4, 0x..") may fall through.
            if conditional or base == "CALL" or "," in operands:
                successors.append(following.get(address))
        elif base in ("EXIT", "RET"):
            if conditional:
                successors.append(following.get(address))
        else:
            successors.append(following.get(address))
        todo.extend(s for s in successors if s is not None)
    return reached


def _pdl_violations(sass: str) -> list[str]:
    """What breaks the PDL rules before the wait: global memory accesses, exits (a CTA must never
    complete ahead of the kernel it follows) and the trigger of dependents (issued after it)."""
    before = _before_wait(sass)
    problems = [f"{op} (global memory) before the wait" for op in sorted(set(before) & _GLOBAL_OPS)]
    if "EXIT" in before:
        problems.append("EXIT before the wait")
    if "PREEXIT" in before:
        problems.append("launch_dependents (PREEXIT) before the wait")
    if "ACQBULK" not in before:
        problems.append("no reachable griddepcontrol.wait (ACQBULK)")
    return problems


_CHECKER_CASES = {
    # kernel body -> the violations _pdl_violations must name
    "ptx::griddep_wait(); ptx::griddep_launch_dependents(); out[threadIdx.x] = in[threadIdx.x];": [],
    "int v = in[threadIdx.x]; ptx::griddep_wait(); out[threadIdx.x] = v;": ["LDG (global memory) before the wait"],
    "out[threadIdx.x] = 1; ptx::griddep_wait();": ["STG (global memory) before the wait"],
    "if (threadIdx.x >= 32) return; ptx::griddep_wait(); out[threadIdx.x] = in[0];": ["EXIT before the wait"],
    "ptx::griddep_launch_dependents(); ptx::griddep_wait(); out[threadIdx.x] = 1;":
        ["launch_dependents (PREEXIT) before the wait"],
    # one path skips the wait
    "if (in == nullptr) ptx::griddep_wait(); out[0] = 1;": ["STG (global memory) before the wait", "EXIT before the wait"],
}


@needs_nvrtc
@pytest.mark.parametrize("body", list(_CHECKER_CASES), ids=range(len(_CHECKER_CASES)))
def test_order_checker_names_each_broken_rule(body):
    from tmagemm import jit

    module = jit.compile_string('#include <tmagemm/ptx.cuh>\nnamespace ptx = tmagemm::ptx;\n'
                                'extern "C" __global__ void k(const int* in, int* out) { ' + body + " }")
    assert _pdl_violations(jit.sass(module.cubin)) == _CHECKER_CASES[body]


# Every native build: each plain variant x family, the promoting fp8 kernel (both output widths)
# and the block-scaled one.
_PROMOTE = native.coop_config(4096, 4096, 4096, 1, True, 132, fast_accum=False)
BUILDS = [(name, native.NATIVE_CONFIGS[name], family) for name in PLAIN for family in FAMILIES] + [
    ("promote", _PROMOTE, (FP8, torch.bfloat16, True)),
    ("promote", _PROMOTE, (FP8, torch.float32, True)),
    ("cuda.blockscaled", native.NATIVE_CONFIGS["cuda.blockscaled"], (FP8, torch.bfloat16, True)),
    # The grouped kernel reads the group sizes (maybe written by the kernel before) after the wait.
    ("grouped", replace(native.NATIVE_CONFIGS["cuda.blockscaled"], groups=8), (FP8, torch.bfloat16, True)),
    ("grouped", replace(native.NATIVE_CONFIGS["cuda.persistent_coop"], groups=8), (torch.bfloat16, torch.bfloat16, False)),
]


@needs_nvrtc
@pytest.mark.parametrize("name,config,family", BUILDS, ids=[f"{n}-{_family_id(f)}" for n, _, f in BUILDS])
def test_every_build_waits_before_touching_global_memory(name, config, family):
    """Before griddepcontrol.wait a kernel only sets up (barrier init, descriptor prefetch): no
    thread reads A, B, scales, bias or C (not even into L2), stores, exits or releases the
    dependents; the TMA loads come after the wait."""
    from tmagemm import jit

    module = native.compile_module(config, *family)
    for instruction in ("griddepcontrol.wait;", "griddepcontrol.launch_dependents;"):
        assert instruction in module.ptx, instruction
    sass = jit.sass(module.cubin)
    assert _pdl_violations(sass) == []
    assert "UTMALDG" in sass and "UTMALDG" not in _before_wait(sass), "TMA loads after the wait"


def test_launch_asks_for_pdl_per_the_knob(monkeypatch):
    """Decided when a launch is planned (gemm._Launch); plans are cached per signature, so a
    changed knob applies after plan.clear_plans()."""
    gpu = torch.device("cuda", 0)
    monkeypatch.delenv("TMAGEMM_PDL", raising=False)
    assert native.use_pdl(gpu)
    monkeypatch.setenv("TMAGEMM_PDL", "0")
    assert not native.use_pdl(gpu)
    monkeypatch.setenv("TMAGEMM_PDL", "1")
    assert native.use_pdl(gpu)
    assert not native.use_pdl(torch.device("cpu"))


# ------------------------------------------------------------------------------- GPU

D = 2048  # hidden size of the chains: every layer is (M, D) x (D, D)
DEPTH = 6
KINDS = ("bf16", "fp8", "blockscaled")


@pytest.fixture
def pdl_knob(request, monkeypatch):
    """TMAGEMM_PDL as the test's parameter (default on), with the plan cache cleared around it:
    plans read the knob when a signature is first planned."""
    on = getattr(request, "param", True)
    if on:
        monkeypatch.delenv("TMAGEMM_PDL", raising=False)
    else:
        monkeypatch.setenv("TMAGEMM_PDL", "0")
    plan.clear_plans()
    yield on
    plan.clear_plans()


def _weights(kind: str, d: int = D, depth: int = DEPTH) -> list[tuple]:
    """(b, scale_b) per layer from w (N, K) ~ N(0, 1/d), so activations stay near unit size.
    bf16: K-major ``w.t()`` and N-major (K, N) alternate; fp8: ``w_q.t()`` with row scales
    (``ws.t()``) or 128x128 block scales."""
    layers = []
    for i in range(depth):
        w = torch.randn(d, d, device="cuda") / math.sqrt(d)
        if kind == "bf16":
            b = w.bfloat16().t()
            layers.append((b if i % 2 else b.contiguous(), None))
        elif kind == "fp8":
            wq, ws = tmagemm.quantize_fp8(w, "row")
            layers.append((wq.t(), ws.t()))
        else:
            wq, ws = tmagemm.quantize_fp8(w, "128x128")
            layers.append((wq.t(), ws))
    return layers


def _chain(kind: str, x: torch.Tensor, layers, outs) -> list[tuple]:
    """x -> GEMM(layer 0) -> ... -> outs[-1], each native GEMM (backend="cuda") reading the previous
    one's bf16 output (fp8 kinds: through quantize_fp8, without its finiteness sync). Returns per
    layer what its GEMM read: (a, scale_a, the bf16 tensor a was quantized from or None)."""
    steps, h = [], x
    for (b, scale_b), out in zip(layers, outs):
        if kind == "bf16":
            tmagemm.matmul(h, b, out=out, backend="cuda")
            steps.append((h, None, None))
        else:
            hq, hs = tmagemm.quantize_fp8(h, "row" if kind == "fp8" else "1x128", check_finite=False)
            tmagemm.scaled_mm(hq, b, hs, scale_b, out_dtype=torch.bfloat16, out=out, backend="cuda")
            steps.append((hq, hs, h))
        h = out
    return steps


def _group_scales(scale: torch.Tensor, k: int) -> torch.Tensor:
    """Per-element float64 scales of an (M, K) operand from (M, 1) row or (M, ceil(K/128)) group scales."""
    s = scale.double()
    return s if s.shape[1] == 1 else s[:, torch.arange(k, device=s.device) // 128]


def _check_bound(out, ref, bound, what):
    bad = ~((out.double() - ref).abs() <= bound)  # NaN (never written, or read too early) fails
    if bool(bad.any()):
        r, c = bad.nonzero()[0].tolist()
        raise AssertionError(f"{what}: {int(bad.sum())} of {out.numel()} elements off; first at ({r}, {c}): got "
                             f"{float(out[r, c]):.6g}, want {float(ref[r, c]):.6g} +- {float(bound[r, c]):.3g}")


def _check_quantized(h, hq, hs, what):
    """hq * hs is h within one fp8 rounding (2^-4 relative for normals, 2^-10 * scale below; both
    doubled), so the quantization read the final h."""
    s = _group_scales(hs, h.shape[1])
    h64 = h.double()
    _check_bound(hq.double() * s, h64, 2.0**-3 * h64.abs() + 2.0**-9 * s, f"{what}: quantized activation")


def _check_block_product(out, a, b, scale_a, scale_b, what):
    """(a * 1x128 scales) @ (b * 128x128 scales) in float64; each k-block's sum goes through
    wgmma's fp8 adder (2^-10 of sum |a||b|, as test_native_gemm bounds it), then bf16 rounding."""
    k, n = b.shape
    a64 = a.double() * _group_scales(scale_a, k)
    blocks = torch.arange(k, device=b.device) // 128, torch.arange(n, device=b.device) // 128
    b64 = b.double() * scale_b.double()[blocks[1]][:, blocks[0]].t()
    ref = a64 @ b64
    _check_bound(out, ref, OUT_ROUNDING * ref.abs() + ACCUMULATION[FP8] * (a64.abs() @ b64.abs()), what)


def _check_chain(kind, steps, layers, outs, what):
    for i, ((a, scale_a, h), (b, scale_b), out) in enumerate(zip(steps, layers, outs)):
        where = f"{what}, GEMM {i + 1} of {len(outs)}"
        if h is not None:
            _check_quantized(h, a, scale_a, where)
        if kind == "blockscaled":
            _check_block_product(out, a, b, scale_a, scale_b, where)
        else:
            check(out, a, b, None if scale_a is None else scale_a.reshape(-1),
                  None if scale_b is None else scale_b.reshape(-1), what=where)


def _poison(tensors):
    for t in tensors:
        t.fill_(float("nan"))


def _native_plans_only():
    plans = plan.cached_plans()
    assert plans and all(p.variant.startswith("cuda.") for p in plans), [p.variant for p in plans]


@pytest.mark.gpu
@pytest.mark.parametrize("pdl_knob", [True, False], ids=["pdl", "no_pdl"], indirect=True)
@pytest.mark.parametrize("m", [256, 4096])
@pytest.mark.parametrize("kind", KINDS)
def test_chain_eager(kind, m, pdl_knob, seeded):
    layers = _weights(kind)
    outs = [torch.empty(m, D, device="cuda", dtype=torch.bfloat16) for _ in range(DEPTH)]
    for run in range(3):
        x = torch.randn(m, D, device="cuda", dtype=torch.bfloat16)
        _poison(outs)
        steps = _chain(kind, x, layers, outs)
        torch.cuda.synchronize()
        _check_chain(kind, steps, layers, outs, f"{kind} M={m} pdl={pdl_knob} run {run}")
    _native_plans_only()


@pytest.mark.gpu
@pytest.mark.parametrize("pdl_knob", [True, False], ids=["pdl", "no_pdl"], indirect=True)
@pytest.mark.parametrize("m", [256, 4096])
@pytest.mark.parametrize("kind", KINDS)
def test_chain_in_cuda_graph(kind, m, pdl_knob, seeded):
    """Captured after an eager warm-up (plans and modules exist); each replay gets a fresh x and
    poisoned outputs, so a GEMM that read its input before the previous kernel wrote it would
    see the last replay's values or NaN."""
    layers = _weights(kind)
    outs = [torch.empty(m, D, device="cuda", dtype=torch.bfloat16) for _ in range(DEPTH)]
    x = torch.randn(m, D, device="cuda", dtype=torch.bfloat16)
    _chain(kind, x, layers, outs)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        steps = _chain(kind, x, layers, outs)
    for replay in range(3):
        x.copy_(torch.randn(m, D, device="cuda"))
        _poison(outs)
        graph.replay()
        torch.cuda.synchronize()
        _check_chain(kind, steps, layers, outs, f"{kind} M={m} pdl={pdl_knob} graph replay {replay}")
    _native_plans_only()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["bf16", "fp8"])
@pytest.mark.parametrize("name", PLAIN)
def test_each_native_kernel_in_a_chain(name, kind, pdl_knob, seeded):
    """Every variant (its own wait placement: one warpgroup, warp specialized, persistent
    cooperative / ping-pong, 2-CTA multicast) chained with itself; ragged M and a hidden size off
    the 256-wide tiles. fp8: row-wise scales written by the quantization just before (the general
    epilogue reads them)."""
    m, d = 300, 1408
    layers = _weights(kind, d, 4)
    outs = [torch.empty(m, d, device="cuda", dtype=torch.bfloat16) for _ in range(len(layers))]
    plans = {}

    def gemm(a, b, out, scale_a=None, scale_b=None):
        args = plan.gemm_args(a, b, out, scale_a, scale_b, None, True)
        key = (a.dtype, b.stride())
        if key not in plans:
            plans[key] = plan.build(args, variant=name)
            assert plans[key].variant == name
        plans[key](args)

    for run in range(2):
        h = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
        _poison(outs)
        steps = []
        for (b, scale_b), out in zip(layers, outs):
            if kind == "bf16":
                gemm(h, b, out)
                steps.append((h, None, None))
            else:
                hq, hs = tmagemm.quantize_fp8(h, "row", check_finite=False)
                gemm(hq, b, out, hs, scale_b)
                steps.append((hq, hs, h))
            h = out
        torch.cuda.synchronize()
        _check_chain(kind, steps, layers, outs, f"{name} {kind} run {run}")


_BIG = 4096  # GEMM 1 of the hazard tests: 4096^3 bf16, long enough for GEMM 2 to start beside its tail


@pytest.mark.gpu
@pytest.mark.parametrize("k_major", [False, True], ids=["n_major", "k_major"])
def test_weight_written_by_the_previous_gemm(k_major, pdl_knob, seeded):
    """GEMM 2's weight is GEMM 1's output: GEMM 2 may be resident while GEMM 1 still writes it,
    and must read only the final values."""
    w1 = (torch.randn(_BIG, _BIG, device="cuda") / math.sqrt(_BIG)).bfloat16()
    a2 = torch.randn(256, _BIG, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(_BIG, _BIG, device="cuda", dtype=torch.bfloat16)
    z = torch.empty(256, _BIG, device="cuda", dtype=torch.bfloat16)
    b2 = y.t() if k_major else y
    for run in range(4):
        x = torch.randn(_BIG, _BIG, device="cuda", dtype=torch.bfloat16)
        _poison((y, z))
        tmagemm.matmul(x, w1, out=y, backend="cuda")
        tmagemm.matmul(a2, b2, out=z, backend="cuda")
        torch.cuda.synchronize()
        check(y, x, w1, what=f"GEMM 1, run {run}")
        check(z, a2, b2, what=f"GEMM 2 on GEMM 1's output as its weight ({'K' if k_major else 'N'}-major), run {run}")
    _native_plans_only()


@pytest.mark.gpu
@pytest.mark.parametrize("target", ["a", "b"])
def test_output_overwrites_what_the_previous_gemm_reads(target, pdl_knob, seeded):
    """GEMM 2 (K = 64: little to compute, all of its output to write) writes the A or B that GEMM 1
    reads: its stores come after its wait, so GEMM 1 reads its inputs unchanged to the end."""
    x = torch.empty(_BIG, _BIG, device="cuda", dtype=torch.bfloat16)
    w1 = torch.empty(_BIG, _BIG, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(_BIG, _BIG, device="cuda", dtype=torch.bfloat16)
    a2 = torch.randn(_BIG, 64, device="cuda", dtype=torch.bfloat16)
    w2 = torch.randn(64, _BIG, device="cuda", dtype=torch.bfloat16)
    overwritten = x if target == "a" else w1
    for run in range(4):
        x.copy_(torch.randn(_BIG, _BIG, device="cuda"))
        w1.copy_(torch.randn(_BIG, _BIG, device="cuda") / math.sqrt(_BIG))
        x0, w0 = x.clone(), w1.clone()
        _poison((y,))
        tmagemm.matmul(x, w1, out=y, backend="cuda")
        tmagemm.matmul(a2, w2, out=overwritten, backend="cuda")
        torch.cuda.synchronize()
        check(y, x0, w0, what=f"GEMM 1 while GEMM 2 overwrites its {target}, run {run}")
        check(overwritten, a2, w2, what=f"GEMM 2 into GEMM 1's {target}, run {run}")
    _native_plans_only()


@pytest.mark.gpu
def test_launch_is_planned_with_the_knob(monkeypatch):
    a = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    args = plan.GemmArgs(a, b, torch.empty(300, 512, device="cuda", dtype=torch.bfloat16))
    config = native.NATIVE_CONFIGS["cuda.persistent_coop_mc"]  # clusters and PDL together
    monkeypatch.setenv("TMAGEMM_PDL", "0")
    off = native._Launch(args, config)
    monkeypatch.delenv("TMAGEMM_PDL")
    on = native._Launch(args, config)
    assert (off.pdl, on.pdl) == (False, True)
    for launch in (off, on):
        args.out.fill_(float("nan"))
        launch.operands(*args.operands)
        torch.cuda.synchronize()
        check(args.out, a, b, what=f"pdl={launch.pdl}")
