"""``tmagemm bench --preset moe``: expert shapes, the case grid, Zipf routing, byte counting, tables,
saved schema, option checks and refusals; a tiny GPU run (marked ``gpu``)."""

import csv
import json

import pytest
import torch

from tmagemm import cli
from tmagemm.bench import graphed, moe, report, results

# ------------------------------------------------------------------------------ expert shapes


def test_expert_shapes_of_each_model():
    shapes = {name: {p.name: (p.n, p.k) for p in m.projections()} for name, m in moe.MODELS.items()}
    assert shapes["deepseek-v3"] == {"gate_up": (4096, 7168), "down": (7168, 2048)}
    assert shapes["deepseek-v3-ep4"] == shapes["deepseek-v3"]
    assert shapes["qwen3-235b-a22b"] == {"gate_up": (3072, 4096), "down": (4096, 1536)}
    assert shapes["mixtral-8x7b"] == {"gate_up": (28672, 4096), "down": (4096, 14336)}
    # The issue's E grid {8, 64, 128, 256}: each model's own E, DeepSeek-V3 also as one GPU of EP 4.
    assert sorted(m.experts for m in moe.MODELS.values()) == [8, 64, 128, 256]
    assert {m.name: m.top_k for m in moe.MODELS.values()}["mixtral-8x7b"] == 2


def test_row_cap_is_the_tokens_a_gpu_sees():
    # 256 experts x 4 rows = 1024 rows from 128 tokens (top-8): no expert can get more than 128.
    assert moe.MODELS["deepseek-v3"].max_rows_per_expert(1024) == 128
    # EP 4: 64 experts x 4 rows = 256 rows; each token sends 8 / 4 = 2 rows here on average: 128 tokens.
    assert moe.MODELS["deepseek-v3-ep4"].max_rows_per_expert(256) == 128
    assert moe.MODELS["mixtral-8x7b"].max_rows_per_expert(8) == 4


def test_default_grid_layouts_and_sizes():
    cases = moe.MoEConfig().cases()
    assert {c.model for c in cases} == set(moe.MODELS) and {c.dtype for c in cases} == {"fp8", "bf16"}
    assert {c.routing for c in cases} == {"balanced", "zipf"} and {c.projection for c in cases} == {"gate_up", "down"}
    for c in cases:
        assert c.rows == c.e * c.m  # balanced and zipf at the same total
        if c.layout == "contiguous":
            assert c.rows <= moe.MAX_ROWS and c.max_m is None
        else:
            assert c.m <= moe.MASKED_MAX_M and c.max_m == max(c.counts)
    assert max(c.m for c in cases if c.e == 8) == 2048  # Mixtral: 8 x 2048 rows
    assert max(c.m for c in cases if c.e == 256 and c.layout == "contiguous") == 256
    assert {c.m for c in cases if c.layout == "masked"} == {1, 16, 64}
    assert len(cases) == len(set(cases))
    # one weight set at a time: (model, dtype, projection) changes only between contiguous runs of cases
    keys = [(c.model, c.dtype, c.projection) for c in cases]
    assert len([k for i, k in enumerate(keys) if i == 0 or keys[i - 1] != k]) == len(set(keys))


def test_layouts_for_tokens_per_expert():
    assert moe.layouts_for(256, 1) == ("contiguous", "masked")
    assert moe.layouts_for(8, 8192) == ("contiguous",)
    assert moe.layouts_for(256, 512) == ()
    assert moe.layouts_for(8, 64) == ("contiguous", "masked")


# ---------------------------------------------------------------------------------- routing


@pytest.mark.parametrize("e, m", [(8, 1), (8, 2048), (64, 16), (128, 64), (256, 1), (256, 256)])
def test_zipf_counts_are_deterministic_preserve_the_sum_and_respect_the_cap(e, m):
    model = next(x for x in moe.MODELS.values() if x.experts == e)
    cap = model.max_rows_per_expert(e * m)
    counts = moe.counts_for(model, m, "zipf")
    assert counts == moe.counts_for(model, m, "zipf") == moe.zipf_counts(e, m, cap=cap)
    assert len(counts) == e and sum(counts) == e * m
    assert all(isinstance(c, int) and 0 <= c <= cap for c in counts)
    assert moe.counts_for(model, m, "balanced") == [m] * e


@pytest.mark.parametrize("e, m", [(64, 64), (128, 16), (256, 64)])
def test_zipf_is_really_skewed(e, m):
    counts = sorted(moe.zipf_counts(e, m), reverse=True)
    assert counts[0] >= 10 * m  # the hottest expert gets >= 10x its balanced share
    top = sum(counts[: max(1, e // 10)])
    assert top >= 0.4 * e * m  # the top 10% of experts take >= 40% of the rows
    assert counts[-1] < m


def test_zipf_cap_clips_and_redistributes():
    free = moe.zipf_counts(8, 100)
    capped = moe.zipf_counts(8, 100, cap=200)
    assert max(free) > 200 and max(capped) == 200 and sum(capped) == 800
    with pytest.raises(ValueError, match="cap 10 x 8 experts < 800 rows"):
        moe.zipf_counts(8, 100, cap=10)
    assert moe.zipf_counts(8, 100, s=2.0) != free  # the exponent is part of the draw


def test_check_experts_busiest_lightest_then_seeded_others():
    counts = [0, 5, 90, 1, 7, 0, 3, 2]
    picked = moe.check_experts(counts)
    assert picked[:2] == [2, 3] and len(picked) == moe.CHECK_EXPERTS and 0 not in picked and 5 not in picked
    assert picked == moe.check_experts(counts)
    assert moe.check_experts([4]) == [0] and moe.check_experts([0, 0]) == []


# ---------------------------------------------------------------------------- byte counting


def test_case_bytes_count_touched_experts_only():
    counts = [3, 0, 5, 0]
    fp8 = moe.case_bytes(counts, 256, 512, "fp8")
    assert fp8["weight_bytes"] == 2 * 256 * 512  # two experts with rows
    assert fp8["scale_bytes"] == 4 * (8 + 2 * 256)  # one per row of A, N per touched expert
    assert fp8["activation_bytes"] == 8 * 512 and fp8["output_bytes"] == 8 * 256 * 2
    assert fp8["bytes"] == sum(fp8[k] for k in ("weight_bytes", "scale_bytes", "activation_bytes", "output_bytes"))
    assert fp8["flops"] == 2 * 8 * 256 * 512
    bf16 = moe.case_bytes(counts, 256, 512, "bf16")
    assert bf16["weight_bytes"] == 2 * fp8["weight_bytes"] and bf16["scale_bytes"] == 0
    assert bf16["activation_bytes"] == 2 * 8 * 512 and bf16["output_bytes"] == fp8["output_bytes"]


def test_masked_padding_rows_are_not_counted():
    case = next(c for c in moe.MoEConfig(models=("qwen3-235b-a22b",), m_values=(16,)).cases()
                if c.layout == "masked" and c.routing == "zipf")  # fmt: skip
    rec = moe.new_record(case, "tmagemm")
    assert rec["max_m"] > 16 and rec["rows"] == 128 * 16
    assert rec["activation_bytes"] == rec["rows"] * case.k  # not E x max_m rows
    assert rec["experts_touched"] == sum(1 for c in case.counts if c)


# ------------------------------------------------------------------------ records and tables


def _records(ours_us=100.0, torch_us=130.0, loop_us=300.0, torch_status="ok", loop_zipf=1.0):
    config = moe.MoEConfig(models=("mixtral-8x7b",), dtypes=("fp8",), m_values=(16,))
    recs = []
    for case in config.cases():
        if case.projection != "down":
            continue
        zipf = case.routing == "zipf"
        for provider, us in (("tmagemm", ours_us * (1.1 if zipf else 1.0)), ("torch", torch_us),
                             ("loop", loop_us * (loop_zipf if zipf else 1.0))):
            rec = moe.new_record(case, provider)
            if provider == "torch" and case.layout == "masked":
                rec.update(status="unsupported", reason="torch refuses: RuntimeError: scale_a must be 1-D")
            else:
                rec.update(status=torch_status if provider == "torch" else "ok", us=us, max_rel_err=3e-3)
            recs.append(rec)
    return recs


def test_derive_speedups_pct_copy_and_skew():
    recs = moe.derive(_records(), copy_gbs=3000.0)
    ours = next(r for r in recs if r["provider"] == "tmagemm" and r["layout"] == "contiguous" and r["routing"] == "balanced")
    assert ours["speedup_vs_torch"] == pytest.approx(1.3) and ours["speedup_vs_loop"] == pytest.approx(3.0)
    assert ours["tflops"] == pytest.approx(ours["flops"] / 100e-6 / 1e12)
    assert ours["pct_copy"] == pytest.approx(100 * ours["bytes"] / 100e-6 / 1e9 / 3000.0)
    assert ours["skew_ratio"] is None  # only zipf rows compare with balanced
    skew = next(r for r in recs if r["provider"] == "tmagemm" and r["layout"] == "contiguous" and r["routing"] == "zipf")
    assert skew["skew_ratio"] == pytest.approx(1 / 1.1)
    masked = next(r for r in recs if r["provider"] == "tmagemm" and r["layout"] == "masked")
    assert masked["speedup_vs_torch"] is None and masked["speedup_vs_loop"] is not None
    peers = [r for r in recs if r["provider"] != "tmagemm"]
    assert all(r["speedup_vs_torch"] is None and r["speedup_vs_loop"] is None for r in peers)
    assert all(r["speedup_vs_torch"] is None for r in moe.derive(_records(torch_status="wrong"), 3000.0))
    assert all(r["pct_copy"] is None for r in moe.derive(_records(), None))


def test_geomeans_per_dtype_and_layout():
    recs = moe.derive(_records(), 3000.0)
    rows = {(g["dtype"], g["layout"]): g for g in moe.geomeans(recs)}
    cont = rows["fp8", "contiguous"]
    assert cont["rows"] == 2 and cont["speedup_vs_torch_n"] == 2
    assert cont["speedup_vs_torch"] == pytest.approx((1.3 * 1.3 / 1.1) ** 0.5)
    assert cont["speedup_vs_torch_min"] == pytest.approx(1.3 / 1.1)
    assert cont["skew_ratio_n"] == 1 and cont["skew_ratio"] == pytest.approx(1 / 1.1)
    assert rows["fp8", "masked"]["speedup_vs_torch_n"] == 0 and rows["fp8", "masked"]["speedup_vs_torch"] is None
    both = rows["fp8", "all"]  # the preset's geomean: both layouts
    assert both["rows"] == 4 and both["speedup_vs_torch_n"] == 2
    assert both["speedup_vs_loop_n"] == cont["speedup_vs_loop_n"] + rows["fp8", "masked"]["speedup_vs_loop_n"]


def test_geomeans_give_the_peers_own_skew():
    recs = moe.derive(_records(loop_zipf=1.25), 3000.0)
    rows = {(g["dtype"], g["layout"]): g for g in moe.geomeans(recs)}
    cont, masked, both = rows["fp8", "contiguous"], rows["fp8", "masked"], rows["fp8", "all"]
    assert cont["skew_ratio"] == pytest.approx(1 / 1.1)  # ours
    assert cont["torch_skew"] == pytest.approx(1.0) and cont["loop_skew"] == pytest.approx(1 / 1.25)
    assert masked["torch_skew"] is None and masked["torch_skew_min"] is None  # torch refused the masked rows
    assert both["loop_skew_min"] == pytest.approx(1 / 1.25)
    header, _, *lines = moe.tables(recs)["moe geomeans (tmagemm)"].splitlines()
    assert "torch skew" in header and "loop skew" in header
    assert any(f"{1 / 1.25:.3f}" in line for line in lines)


def test_tables_show_times_speedups_and_why_a_row_did_not_run():
    recs = moe.derive(_records(), 3000.0)
    text = moe.tables(recs)
    lines = text["moe cases"].splitlines()
    assert lines[0].split()[:6] == ["model", "proj", "dtype", "E", "layout", "routing"] and "vs torch" in lines[0]
    assert len(lines) == 2 + 4  # header, rule, (contiguous, masked) x (balanced, zipf)
    row = next(line for line in lines if "contiguous" in line and "balanced" in line)
    assert "100.0" in row and "130.0" in row and "300.0" in row and "1.30x" in row and "3.00x" in row
    # %copy, ours then the loop's: the loop took 3x our time over the same bytes.
    ours = next(r for r in recs if r["provider"] == "tmagemm" and r["layout"] == "contiguous" and r["routing"] == "balanced")
    cells = row.split()
    at = cells.index("3.00x")
    assert cells[at + 1: at + 3] == [f"{ours['pct_copy']:.0f}", f"{ours['pct_copy'] / 3:.0f}"]
    assert "loop %copy" in lines[0]
    masked = next(line for line in lines if "masked" in line and "balanced" in line)
    assert masked.rstrip().endswith("torch unsupported")
    assert "scale_a must be 1-D" in text["moe not run / not correct"]
    geo = text["moe geomeans (tmagemm)"]
    assert f"{(1.3 * 1.3 / 1.1) ** 0.5:.3f}" in geo and "1.182" in geo and "2/2" in geo and "0/2" in geo
    assert "float64" in text["moe notes"] and "max_m" in text["moe notes"]


def test_save_writes_the_common_schema_and_report_prints_it(tmp_path, capsys):
    recs = moe.derive(_records(), 3000.0)
    meta = {"gpu": "NVIDIA H100 80GB HBM3", "command": "tmagemm bench --preset moe", "preset": "moe",
            "ceilings": {"copy_gbs": 3000.0, "peak_tflops": {}, "errors": []}}  # fmt: skip
    result = graphed.make_result(meta, moe.tables(recs))
    paths = graphed.save(result, recs, moe.FIELDS, moe.NAME, tmp_path)
    payload = json.loads(paths["json"].read_text())
    assert payload["schema"] == results.SCHEMA and payload["records"] == []
    assert payload["moe"]["fields"] == list(moe.FIELDS)
    assert all(set(r) == set(moe.FIELDS) for r in payload["moe"]["records"])
    assert set(payload["extras"]) >= {"moe cases", "moe geomeans (tmagemm)", "moe notes"}
    lines = paths["csv"].read_text().splitlines()
    assert lines[0].startswith("# gpu: ")
    rows = list(csv.DictReader(line for line in lines if not line.startswith("#")))
    assert len(rows) == len(recs) and rows[0]["model"] == "mixtral-8x7b"
    assert float(rows[0]["speedup_vs_torch"]) == pytest.approx(1.3)
    assert "moe cases:" in paths["table"].read_text()
    loaded = results.load(paths["json"])
    assert moe.case_table(recs) in report.render(loaded)
    assert cli.main(["report", str(tmp_path), "--out", str(tmp_path / "plots")]) == 0
    out = capsys.readouterr().out
    assert "moe cases:" in out and "moe geomeans (tmagemm):" in out and "unsupported" in out


# -------------------------------------------------------------------------------- options


def test_options_parse_and_config_checks():
    assert moe.dtypes_for(None) == ("fp8", "bf16") and moe.dtypes_for("bf16") == ("bf16",)
    for bad in ("fp16", "fp8-block"):
        with pytest.raises(ValueError, match=f"--dtype {bad} does not apply"):
            moe.dtypes_for(bad)
    assert moe.parse_models(None) == tuple(moe.MODELS)
    assert moe.parse_models(["mixtral-8x7b", "mixtral-8x7b"]) == ("mixtral-8x7b",)
    with pytest.raises(ValueError, match="unknown model llama3-8b for the moe presets"):
        moe.parse_models(["llama3-8b"])
    assert moe.parse_routings(None) == ("balanced", "zipf") and moe.parse_routings(["zipf"]) == ("zipf",)
    with pytest.raises(ValueError, match="unknown routing uniform"):
        moe.parse_routings(["uniform"])
    for bad, words in ((dict(m_values=(0,)), "in 1..8192"), (dict(m_values=(16384,)), "in 1..8192"),
                       (dict(budget_ms=0), "--budget-ms"),
                       (dict(models=("deepseek-v3",), m_values=(512,)), "gives no case")):  # fmt: skip
        with pytest.raises(ValueError, match=words):
            moe.MoEConfig(**bad)
    # tolerance: decode's rule (fp8 fast accumulation grows with K)
    assert moe.tolerance("bf16", 14336, True) == 1e-2
    assert moe.tolerance("fp8", 14336, True) == pytest.approx(2e-2 * (14336 / 4096) ** 0.5)
    assert moe.tolerance("fp8", 14336, False) == 2e-2


def test_without_a_gpu_the_moe_preset_is_refused_by_name(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv in (["bench", "--preset", "moe"], ["bench", "--check", "--preset", "moe", "--routing", "zipf"]):
        args = cli.build_parser().parse_args([*argv, "--out", str(tmp_path)])
        with pytest.raises(ValueError, match="--preset moe needs a GPU: it times CUDA-graph replay of grouped"):
            cli.cmd_bench(args, "tmagemm " + " ".join(argv))
    with pytest.raises(RuntimeError, match="--preset moe needs a CUDA GPU"):
        moe.run(moe.MoEConfig())


@pytest.mark.skipif(torch.cuda.is_available(), reason="main() without a GPU (on one it re-executes under the interpreter)")
def test_cpu_refusal_through_main(capsys, tmp_path):
    assert cli.main(["bench", "--preset", "moe", "--out", str(tmp_path)]) == 2
    assert "--preset moe needs a GPU" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--preset", "moe", "--graph"], "--graph do not apply"),
    (["--preset", "moe", "--n", "64", "--providers", "torch"], "--n, --providers do not apply"),
    (["--preset", "moe", "--rowwise"], "--rowwise do not apply"),
    (["--preset", "moe", "--layers", "2"], "--layers do not apply"),
    (["--preset", "moe", "--dtype", "fp8-block"], "--dtype fp8-block does not apply"),
    (["--preset", "moe", "--models", "llama3-8b"], "unknown model llama3-8b"),
    (["--preset", "moe", "--routing", "uniform"], "unknown routing uniform"),
    (["--preset", "moe", "--m", "0,16"], "in 1..8192"),
    (["--preset", "moe", "--models", "deepseek-v3", "--m", "512"], "gives no case"),
    (["--preset", "decode", "--routing", "zipf"], "--routing applies to --preset moe, moe-train and moe-layer only"),
    (["--routing", "balanced"], "--routing applies to --preset moe, moe-train and moe-layer only"),
])
def test_moe_options_are_checked_before_any_gpu_work(argv, message, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the GPU path; refused before any GPU work
    monkeypatch.setattr(moe, "run", lambda *a, **k: pytest.fail("reached the GPU run"))
    assert cli.main(["bench", *argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err, err


def test_moe_options_reach_the_config(monkeypatch, tmp_path):
    seen = {}

    def fake_run(config):
        seen["config"] = config
        return graphed.make_result({"command": config.command}, moe.tables([])), []

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(moe, "run", fake_run)
    argv = ["bench", "--preset", "moe", "--models", "mixtral-8x7b", "--m", "1,4096", "--dtype", "bf16",
            "--routing", "zipf", "--budget-ms", "5", "--out", str(tmp_path)]  # fmt: skip
    assert cli.main(argv) == 0
    config = seen["config"]
    assert config.models == ("mixtral-8x7b",) and config.m_values == (1, 4096) and config.dtypes == ("bf16",)
    assert config.routings == ("zipf",) and config.budget_ms == 5 and config.fast_accum
    assert (tmp_path / "results.json").is_file()


def test_bench_help_documents_the_moe_options(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "moe: grouped expert GEMMs" in text and "--routing" in text and "mixtral-8x7b" in text


# ------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_tiny_moe_bench_on_gpu(tmp_path, capsys):
    code = cli.main(["bench", "--preset", "moe", "--models", "qwen3-235b-a22b", "--m", "1,16", "--budget-ms", "5",
                     "--out", str(tmp_path)])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    payload = json.loads((tmp_path / "results.json").read_text())
    recs = payload["moe"]["records"]
    cases = moe.MoEConfig(models=("qwen3-235b-a22b",), m_values=(1, 16)).cases()
    assert len(recs) == len(cases) * len(moe.PROVIDERS)
    copy = payload["metadata"]["ceilings"]["copy_gbs"]
    assert copy and 500 < copy < 20000
    for r in recs:
        if r["provider"] != "torch":
            assert r["status"] == "ok", r
        if r["status"] != "ok":  # only torch's grouped ops may refuse a case, and they say why
            assert r["status"] == "unsupported" and r["reason"], r
            continue
        assert r["max_rel_err"] <= r["tolerance"], r
        assert 0 < r["us"] < 20000 and r["p20_us"] <= r["us"] <= r["p80_us"], r
        assert r["replays"] >= 8 and r["checked"]
    ours = [r for r in recs if r["provider"] == "tmagemm"]
    assert all(r["speedup_vs_loop"] is not None for r in ours)
    assert all(2 < r["pct_copy"] < 150 for r in ours if r["layout"] == "masked"), ours
    assert "moe cases:" in out and "moe geomeans (tmagemm):" in out
