"""Report rendering, derived metrics and plots from the saved sample result (tests/data)."""

import json
import math
import struct
from pathlib import Path

import pytest

from tmagemm.bench import plots, report, results

SAMPLE = Path(__file__).parent / "data" / "bench_sample" / "results.json"
PROVIDERS = ["tmagemm.auto", "triton.tma", "triton.persistent", "triton.ptr", "cuda.gemm (module)",
             "cublas.fp16", "cublas.fp8", "cublas.fp8.exact"]
M_VALUES = [1, 16, 128, 1024, 4096]


@pytest.fixture
def sample():
    return results.load(SAMPLE)


def _record(result, provider, m):
    (r,) = [r for r in result.records if r["provider"] == provider and r["m"] == m]
    return r


def test_derived_metrics_follow_from_the_medians(sample):
    r = _record(sample, "tmagemm.auto", 1024)
    flops = 2 * 1024 * 4096 * 4096
    nbytes = 1024 * 4096 + 4096 * 4096 + 1024 * 4096 * 2  # fp8 A, fp8 B, bf16 C
    assert r["flops"] == flops and r["bytes"] == nbytes
    assert r["tflops"] == pytest.approx(flops / 70e-6 / 1e12, rel=1e-12)
    assert r["gbps"] == pytest.approx(nbytes / 70e-6 / 1e9, rel=1e-12)
    assert r["pct_peak"] == pytest.approx(100 * r["tflops"] / 1300.0, rel=1e-12)
    assert r["pct_copy_bw"] == pytest.approx(100 * r["gbps"] / 3000.0, rel=1e-12)
    # Compute-bound here: the roofline is the matmul peak.
    assert r["pct_roofline"] == pytest.approx(r["pct_peak"], rel=1e-12)
    # Memory-bound at M=1: the roofline is intensity x bandwidth.
    r1 = _record(sample, "tmagemm.auto", 1)
    attainable = r1["flops"] / r1["bytes"] * 3000.0 / 1e3
    assert r1["pct_roofline"] == pytest.approx(100 * r1["tflops"] / attainable, rel=1e-12)
    assert r["speedup_vs_cublas.fp8"] == pytest.approx(72.0 / 70.0, rel=1e-12)
    assert r["speedup_vs_cublas.fp16"] == pytest.approx(120.0 / 70.0, rel=1e-12)


def test_records_that_did_not_run_correctly_get_no_metrics(sample):
    wrong = _record(sample, "triton.ptr", 1)
    assert wrong["status"] == results.WRONG and wrong["tflops"] is None and wrong["speedup_vs_cublas.fp8"] is None
    assert _record(sample, "cublas.fp8", 1)["speedup_vs_cublas.fp8"] is None  # no self-comparison
    assert _record(sample, "triton.tma", 4096)["tflops"] is None


def test_geomeans_by_hand(sample):
    rows = {s["provider"]: s for s in results.summary(sample)}
    auto = [_record(sample, "tmagemm.auto", m) for m in M_VALUES]
    expected = math.exp(sum(math.log(r["tflops"]) for r in auto) / len(auto))
    assert rows["tmagemm.auto"]["geomean_tflops"] == pytest.approx(expected, rel=1e-12)
    ratios = [c / t for c, t in zip([15.0, 16.0, 24.0, 72.0, 235.0], [14.0, 15.0, 22.0, 70.0, 240.0])]
    assert rows["tmagemm.auto"]["geomean_vs_cublas.fp8"] == pytest.approx(
        math.exp(sum(map(math.log, ratios)) / 5), rel=1e-12)
    assert (rows["triton.tma"]["ok"], rows["triton.tma"]["shapes"]) == (4, 5)
    assert rows["cuda.gemm (module)"]["geomean_tflops"] is None


def test_rendered_tables_have_the_expected_rows(sample):
    text = report.render(sample)
    detail = report.detail_table(sample).splitlines()
    assert len(detail) == 2 + len(PROVIDERS) * len(M_VALUES)
    for m in M_VALUES:
        assert sum(line.startswith(f"{m}x4096x4096 ") for line in detail) == 1
    summary = report.summary_table(sample).splitlines()[2:]
    assert [line.split()[0] for line in summary] == ["tmagemm.auto", "triton.tma", "triton.persistent", "triton.ptr",
                                                     "cuda.gemm", "cublas.fp16", "cublas.fp8", "cublas.fp8.exact"]
    issues = report.issues_table(sample)
    assert "absent" in issues and "all shapes" in issues and "wrong" in issues and "unsupported" in issues
    assert "H100" in text and "copy 3000 GB/s" in text and "21.5" in text  # header and host-loop table
    # The speedup of tmagemm.auto over cublas.fp8 at M=1024 is printed with two decimals.
    row = next(line for line in detail if line.startswith("1024x4096x4096"))
    assert f"{72.0 / 70.0:.2f}" in row.split()


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_plots_are_valid_nonempty_pngs(sample, tmp_path):
    made = plots.plot_all(sample, tmp_path)
    assert sorted(p.name for p in made) == ["roofline.png", "speedup.png", "tflops.png"]
    for path in made:
        width, height = _png_size(path)
        assert width >= 600 and height >= 400
        assert path.stat().st_size > 10_000  # axes, lines and labels, not a blank canvas
    import matplotlib.image

    pixels = matplotlib.image.imread(tmp_path / "tflops.png")
    assert pixels[..., :3].std() > 0.05  # not a single flat colour


def test_save_load_round_trip(sample, tmp_path):
    paths = results.save(sample, tmp_path)
    again = results.load(tmp_path)
    assert again.metadata == sample.metadata and again.host_loop == sample.host_loop
    assert [r["median_us"] for r in again.records] == [r["median_us"] for r in sample.records]
    lines = paths["csv"].read_text().splitlines()
    meta = [line for line in lines if line.startswith("#")]
    assert any(line.startswith("# gpu: ") for line in meta)
    header = lines[len(meta)].split(",")
    assert "median_us" in header and "speedup_vs_cublas.fp8" in header
    assert len(lines) == len(meta) + 1 + len(sample.records)


def test_load_rejects_what_is_not_a_result(tmp_path):
    with pytest.raises(ValueError, match="no benchmark result"):
        results.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        results.load(bad)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"records": []}))
    with pytest.raises(ValueError, match="not a tmagemm benchmark result"):
        results.load(other)
