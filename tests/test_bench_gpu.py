"""A tiny benchmark end to end on a Hopper GPU: every provider runs or says why not."""

import pytest
import torch

from tmagemm.bench import plots, results, runner
from tmagemm.bench.shapes import Shape


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_tiny_bench_end_to_end(dtype, tmp_path):
    config = runner.BenchConfig(shapes=(Shape(64, 512, 512), Shape(127, 384, 1024)), dtype=dtype,
                                budget_ms=10.0, graph=True, host_loop=True)
    result = runner.run(config)
    peer = "cublas.fp8" if dtype == "fp8" else "cublas"
    assert result.metadata["sm_count"] > 0 and result.metadata["ceilings"]["copy_gbs"] > 100
    assert result.metadata["ceilings"]["peak_tflops"][dtype] > 50
    for r in result.records:
        assert r["status"] in (results.OK, results.UNSUPPORTED, results.ABSENT), r
        if r["status"] == results.OK:
            assert r["max_rel_err"] <= r["tolerance"]
            assert 0 < r["p20_us"] <= r["median_us"] <= r["p80_us"]
            assert r["tflops"] > 0
            # Graph capture may be refused by a provider, but then the reason is recorded.
            assert r["graph_median_us"] is not None or "graph:" in (r["reason"] or ""), r
            if r["family"] == "peer":
                assert r["graph_median_us"] is not None, r
    peer_rows = [r for r in result.records if r["provider"] == peer]
    assert [r["status"] for r in peer_rows] == [results.OK, results.OK]
    ours = [r for r in result.records if r["family"] == "tmagemm" and r["status"] == results.OK]
    assert ours, "no tmagemm provider ran"
    assert all(r[f"speedup_vs_{peer}"] > 0 for r in ours)
    assert any(h["us_per_call"] for h in result.host_loop)
    results.save(result, tmp_path)
    again = results.load(tmp_path)
    assert len(again.records) == len(result.records)
    assert {p.name for p in plots.plot_all(again, tmp_path)} >= {"tflops.png", "speedup.png"}
    torch.cuda.synchronize()
