"""Shapes, providers and the check loop of the benchmark, on the CPU (Triton interpreter)."""

import io

import pytest
import torch

from tmagemm.bench import providers as prov, runner, shapes
from tmagemm.bench.results import ABSENT, CHECKED, FAILED, UNSUPPORTED, WRONG
from tmagemm.bench.shapes import Shape


def test_presets():
    sweep = shapes.preset_shapes("sweep")
    assert [s.m for s in sweep] == list(shapes.SWEEP_M) and {(s.n, s.k) for s in sweep} == {(4096, 4096)}
    assert [s.m for s in shapes.preset_shapes("sweep", [3, 5])] == [3, 5]
    llm = shapes.preset_shapes("llm")
    assert len(llm) == len(shapes.LLM_M) * len(shapes.LLM_LAYERS)
    assert len({(s.label, s.m) for s in llm}) == len(llm)
    assert Shape(4, 6144, 4096, "llama3-8b.qkv") in llm or Shape(64, 6144, 4096, "llama3-8b.qkv") in llm
    assert [s.m for s in shapes.preset_shapes("square")] == list(shapes.SQUARE_SIZES)
    with pytest.raises(ValueError, match="unknown preset"):
        shapes.preset_shapes("huge")
    with pytest.raises(ValueError, match="square"):
        shapes.preset_shapes("square", [5])


def test_custom_shapes():
    got = shapes.custom_shapes([1, 17], [80], [96, 0])
    assert got == [Shape(1, 80, 96), Shape(1, 80, 0), Shape(17, 80, 96), Shape(17, 80, 0)]
    with pytest.raises(ValueError, match="--n"):
        shapes.custom_shapes([1], [], [2])
    with pytest.raises(ValueError, match=">= 0"):
        shapes.custom_shapes([1], [-2], [2])


@pytest.mark.parametrize("dtype, rowwise", [("fp16", False), ("fp8", False), ("fp8", True)])
def test_case_reference_and_error(seeded, dtype, rowwise):
    case = prov.make_case(Shape(17, 40, 48), dtype, "cpu", rowwise=rowwise)
    assert case.a.float().abs().sum() > 0 and case.b.float().abs().sum() > 0
    if dtype == "fp8":
        assert case.b.stride() == (1, 48)  # (K, N) view of a row-major (N, K) weight
        assert case.scale_a.shape == ((17,) if rowwise else (1,))
        manual = (case.a.double() * case.scale_a.double().reshape(-1, 1)) @ (case.b.double() * case.scale_b.double().reshape(1, -1))
    else:
        manual = case.a.double() @ case.b.double()
    torch.testing.assert_close(case.reference, manual, rtol=1e-12, atol=1e-12)
    assert prov.relative_error(case.reference.to(case.out_dtype), case) <= prov.TOLERANCE[dtype] / 2
    poisoned = case.empty_out()
    assert poisoned.isnan().all()
    assert prov.relative_error(poisoned, case) == float("inf")
    off = case.reference.clone()
    off[3, 5] += 0.05 * case.reference.abs().max()
    assert prov.relative_error(off.to(case.out_dtype), case) > prov.TOLERANCE[dtype]


def test_select_by_glob():
    everything = prov.peer_providers()
    assert [p.name for p in prov.select(everything, "fp8", ["cublas.fp8*"])] == ["cublas.fp8", "cublas.fp8.exact"]
    assert [p.name for p in prov.select(everything, "bf16", None)] == ["cublas"]
    with pytest.raises(ValueError, match="matches none"):
        prov.select(everything, "fp8", ["cublsa"])


def _fake(name, prepare=None, absent=None):
    return prov.Provider(name, "tmagemm", "triton", "test double", prov.DTYPES, prepare, absent)


def test_run_one_classifies_every_outcome(seeded):
    case = prov.make_case(Shape(5, 24, 32), "fp16", "cpu")

    def exact(c):
        out = c.empty_out()
        return prov.Prepared(lambda: out.copy_(c.reference))

    def skips_a_tile(c):
        out = c.empty_out()

        def call():
            out[:, :16] = c.reference[:, :16].to(out.dtype)
            return out

        return prov.Prepared(call)

    def refuses(c):
        raise prov.Unsupported("K not a multiple of 64")

    def crashes(c):
        return prov.Prepared(lambda: 1 / 0)

    got = {p.name: runner._run_one(p, case, None, False) for p in [
        _fake("exact", exact), _fake("skips", skips_a_tile), _fake("refuses", refuses),
        _fake("crashes", crashes), _fake("missing", absent="No module named x")]}
    assert got["exact"]["status"] == CHECKED and got["exact"]["max_rel_err"] <= prov.TOLERANCE["fp16"]
    assert got["skips"]["status"] == WRONG and got["skips"]["max_rel_err"] == float("inf")
    assert (got["refuses"]["status"], got["refuses"]["reason"]) == (UNSUPPORTED, "K not a multiple of 64")
    assert got["crashes"]["status"] == FAILED and "ZeroDivisionError" in got["crashes"]["reason"]
    assert (got["missing"]["status"], got["missing"]["reason"]) == (ABSENT, "No module named x")


def test_interpreter_check_runs_the_triton_variants(seeded):
    stream = io.StringIO()
    result = runner.check(("fp16", "fp8"), (Shape(17, 80, 96), Shape(1, 64, 128)), ("triton.tma", "tmagemm.auto"), stream=stream)
    assert {r["provider"] for r in result.records} == {"triton.tma", "tmagemm.auto"}
    assert len(result.records) == 2 * 2 * 2
    for r in result.records:
        assert r["status"] == CHECKED, r
        assert r["median_us"] is None  # no timing without a GPU
    assert stream.getvalue().count("\n") == len(result.records)  # one progress line per step off a terminal


def test_interpreter_check_zero_size_through_the_api(seeded):
    result = runner.check(("fp8",), (Shape(0, 80, 96), Shape(3, 80, 0)), ("tmagemm.auto",), stream=io.StringIO())
    assert [r["status"] for r in result.records] == [CHECKED, CHECKED]


def test_check_refuses_bf16():
    with pytest.raises(ValueError, match="bf16"):
        runner.check(("bf16",))


def test_check_passes_rowwise_and_accumulation_on(seeded, monkeypatch):
    made, asked = [], []
    real_case, real_providers = prov.make_case, prov.tmagemm_providers

    def make_case(*args, **kwargs):
        made.append(real_case(*args, **kwargs))
        return made[-1]

    def tmagemm_providers(fast_accum=True, configs=False):
        asked.append(fast_accum)
        return real_providers(fast_accum, configs)

    monkeypatch.setattr(prov, "make_case", make_case)
    monkeypatch.setattr(prov, "tmagemm_providers", tmagemm_providers)
    result = runner.check(("fp8",), (Shape(5, 64, 64),), ("triton.tma",), stream=io.StringIO(),
                          rowwise=True, fast_accum=False)
    assert [r["status"] for r in result.records] == [CHECKED]
    assert [c.scale_a.shape for c in made] == [(5,)] and asked == [False]  # row-wise scales, exact accumulation
    assert result.metadata["config"]["rowwise"] is True and result.metadata["config"]["fast_accum"] is False


def test_check_refuses_gpu_only_providers_naming_the_dtypes():
    gpu_only = r"'cublas\.fp8\*' matches none .* for fp16 and fp8 .*cublas\.fp8\.exact need a GPU"
    with pytest.raises(ValueError, match=gpu_only):
        runner.check(("fp16", "fp8"), patterns=("cublas.fp8*",))
    with pytest.raises(ValueError, match=r"'nope' matches none of the providers the interpreter check runs for fp8 \("):
        runner.check(("fp8",), patterns=("nope",))


def test_configs_adds_one_provider_per_candidate(seeded):
    """--configs: every candidate config of triton.tma is its own provider, built with that
    config (not the heuristic) and checked against the reference; without it, none are listed."""
    from tmagemm.triton import matmul_tma

    plain = {p.name for p in prov.tmagemm_providers()}
    assert not any("@" in name for name in plain)
    listed = {p.name for p in prov.tmagemm_providers(configs=True)}
    for config in matmul_tma.CONFIGS:
        assert f"triton.tma@{config.label()}" in listed
    result = runner.check(("fp8",), (Shape(17, 80, 96),), ("triton.tma@64x*",), configs=True, stream=io.StringIO())
    recs = result.records
    assert {r["provider"] for r in recs} == {f"triton.tma@{c.label()}" for c in matmul_tma.CONFIGS if c.block_m == 64}
    assert all(r["status"] == CHECKED and r["max_rel_err"] <= r["tolerance"] for r in recs), recs


def test_config_provider_builds_the_forced_config(monkeypatch):
    from tmagemm import plan
    from tmagemm.configs import TritonGemmConfig

    forced = TritonGemmConfig(64, 32, 256, 8, 6, 4)
    seen = []
    variant = plan.get("triton.tma")
    monkeypatch.setattr(plan, "build", lambda args, variant=None, config=None: seen.append((variant, config)) or
                        (lambda a: None))
    provider = next(p for p in prov.tmagemm_providers(configs=True) if p.name == f"triton.tma@{forced.label()}")
    provider.prepare(prov.make_case(Shape(16, 64, 256), "fp8", "cpu"))
    assert seen == [(variant.name, forced)]
    assert forced.label() == "64x32x256s6w4"
