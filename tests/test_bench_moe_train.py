"""``tmagemm bench --preset moe-train``: the case grid, speedups and tables, saved schema, option
checks and refusals; a tiny GPU run (marked ``gpu``)."""

import json

import pytest
import torch

from tmagemm import cli
from tmagemm.bench import graphed, moe, moe_train, results


def test_default_grid_keeps_every_case_within_the_row_limit():
    cases = moe_train.MoETrainConfig().cases()
    assert {c.model for c in cases} == set(moe_train.DEFAULT_MODELS) and "deepseek-v3" not in moe_train.DEFAULT_MODELS
    assert {c.routing for c in cases} == {"balanced", "zipf"} and {c.projection for c in cases} == {"gate_up", "down"}
    m_of = {name: {c.m for c in cases if c.model == name} for name in moe_train.DEFAULT_MODELS}
    assert m_of == {"deepseek-v3-ep4": {256, 1024}, "qwen3-235b-a22b": {256}, "mixtral-8x7b": {256, 1024, 4096}}
    for c in cases:
        assert c.rows == c.e * c.m <= moe.MAX_ROWS  # balanced and zipf at the same total
        assert c.counts == tuple(moe.counts_for(moe.MODELS[c.model], c.m, c.routing))
        assert (c.n, c.k) in {(p.n, p.k) for p in moe.MODELS[c.model].projections()}
    assert len(cases) == len(set(cases))


def test_config_checks():
    assert moe_train.parse_models(None) == moe_train.DEFAULT_MODELS
    assert moe_train.parse_models(["deepseek-v3"]) == ("deepseek-v3",)
    for bad, words in ((dict(m_values=(0,)), "in 1..8192"), (dict(m_values=(9000,)), "in 1..8192"),
                       (dict(budget_ms=-1), "--budget-ms"), (dict(models=("llama3-8b",)), "unknown model"),
                       (dict(routings=("uniform",)), "unknown routing"),
                       (dict(models=("deepseek-v3",), m_values=(512,)), "gives no case")):  # fmt: skip
        with pytest.raises(ValueError, match=words):
            moe_train.MoETrainConfig(**bad)


def _records(torch_status="ok"):
    """One case (Mixtral gate_up, m = 64) x two routings x every step: tmagemm 100 us, torch 120 us
    (balanced) / 90 us (zipf)."""
    recs = []
    model = moe.MODELS["mixtral-8x7b"]
    p = model.projections()[0]
    for routing, torch_us in (("balanced", 120.0), ("zipf", 90.0)):
        case = moe.Case("mixtral-8x7b", p.name, p.n, p.k, model.experts, "bf16", "contiguous", routing, 64,
                        tuple(moe.counts_for(model, 64, routing)))  # fmt: skip
        for step in moe_train.STEPS:
            for provider, us in (("tmagemm", 100.0), ("torch", torch_us)):
                rec = moe_train.new_record(case, step, provider)
                status = torch_status if provider == "torch" else "ok"
                rec.update(status=status, us=us, max_rel_err=2e-3)
                if status != "ok":
                    rec["reason"] = "torch refuses: RuntimeError: offs must be int32"
                recs.append(rec)
    return recs


def test_derive_and_geomeans_per_step_and_routing():
    recs = moe_train.derive(_records())
    ours = [r for r in recs if r["provider"] == "tmagemm"]
    assert {r["step"] for r in ours} == set(moe_train.STEPS)
    forward = next(r for r in ours if r["step"] == "forward" and r["routing"] == "balanced")
    assert forward["speedup_vs_torch"] == pytest.approx(1.2)
    assert forward["flops"] == 2 * 8 * 64 * 28672 * 4096
    step = next(r for r in ours if r["step"] == "step" and r["routing"] == "balanced")
    assert step["flops"] == 3 * forward["flops"] and step["tflops"] == pytest.approx(step["flops"] / 100e-6 / 1e12)
    assert all(r["speedup_vs_torch"] is None for r in recs if r["provider"] == "torch")
    rows = {(g["step"], g["routing"]): g for g in moe_train.geomeans(recs)}
    assert set(rows) == {(s, r) for s in moe_train.STEPS for r in ("balanced", "zipf", "all")}
    every = rows["weight_grad", "all"]
    assert every["n"] == 2 and every["speedup_vs_torch"] == pytest.approx((1.2 * 0.9) ** 0.5)
    assert every["min"] == pytest.approx(0.9) and every["max"] == pytest.approx(1.2)
    # a peer that did not run gives no speedup
    assert moe_train.geomeans(moe_train.derive(_records(torch_status="unsupported"))) == []


def test_tables_save_and_report(tmp_path, capsys):
    recs = moe_train.derive(_records(torch_status="unsupported"))
    text = moe_train.tables(recs)
    assert "offs must be int32" in text["moe-train not run / not correct"]
    recs = moe_train.derive(_records())
    text = moe_train.tables(recs)
    assert "moe-train not run / not correct" not in text
    lines = text["moe-train cases"].splitlines()
    assert lines[0].split()[:5] == ["model", "proj", "E", "routing", "m"] and "vs torch" in lines[0]
    assert len(lines) == 2 + 2 * len(moe_train.STEPS)
    row = next(line for line in lines if "weight_grad" in line and "zipf" in line)
    assert "100.0" in row and "90.0" in row and "0.900x" in row
    geo = text["moe-train geomeans (tmagemm vs torch)"]
    assert "1.200" in geo and f"{(1.2 * 0.9) ** 0.5:.3f}" in geo
    assert "float64" in text["moe-train notes"]
    meta = {"gpu": "NVIDIA H100 80GB HBM3", "command": "tmagemm bench --preset moe-train", "preset": "moe-train"}
    paths = graphed.save(graphed.make_result(meta, text), recs, moe_train.FIELDS, moe_train.NAME, tmp_path)
    payload = json.loads(paths["json"].read_text())
    assert payload["schema"] == results.SCHEMA and payload["moe-train"]["fields"] == list(moe_train.FIELDS)
    assert all(set(r) == set(moe_train.FIELDS) for r in payload["moe-train"]["records"])
    assert cli.main(["report", str(tmp_path), "--out", str(tmp_path / "plots")]) == 0
    out = capsys.readouterr().out
    assert "moe-train cases:" in out and "moe-train geomeans (tmagemm vs torch):" in out


def test_without_a_gpu_the_preset_is_refused_by_name(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = cli.build_parser().parse_args(["bench", "--preset", "moe-train", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="--preset moe-train needs a GPU: it times CUDA-graph replay"):
        cli.cmd_bench(args, "tmagemm bench --preset moe-train")
    with pytest.raises(RuntimeError, match="--preset moe-train needs a CUDA GPU"):
        moe_train.run(moe_train.MoETrainConfig())


@pytest.mark.parametrize("argv, message", [
    (["--dtype", "fp8"], "--dtype fp8 do not apply"),
    (["--n", "64", "--graph"], "--n, --graph do not apply"),
    (["--exact-accum"], "--exact-accum do not apply"),
    (["--models", "llama3-8b"], "unknown model llama3-8b"),
    (["--routing", "uniform"], "unknown routing uniform"),
    (["--m", "0"], "in 1..8192"),
    (["--models", "deepseek-v3", "--m", "4096"], "gives no case"),
])
def test_options_are_checked_before_any_gpu_work(argv, message, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(moe_train, "run", lambda *a, **k: pytest.fail("reached the GPU run"))
    assert cli.main(["bench", "--preset", "moe-train", *argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err, err


def test_options_reach_the_config(monkeypatch, tmp_path):
    seen = {}

    def fake_run(config):
        seen["config"] = config
        return graphed.make_result({"command": config.command}, moe_train.tables([])), []

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(moe_train, "run", fake_run)
    argv = ["bench", "--preset", "moe-train", "--models", "mixtral-8x7b", "--m", "512,4096", "--dtype", "bf16",
            "--routing", "zipf", "--budget-ms", "5", "--out", str(tmp_path)]  # fmt: skip
    assert cli.main(argv) == 0
    config = seen["config"]
    assert config.models == ("mixtral-8x7b",) and config.m_values == (512, 4096) and config.routings == ("zipf",)
    assert config.budget_ms == 5 and config.command.startswith("tmagemm bench --preset moe-train")
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])


# ------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_tiny_moe_train_bench_on_gpu(tmp_path, capsys):
    code = cli.main(["bench", "--preset", "moe-train", "--models", "deepseek-v3-ep4", "--m", "64", "--budget-ms", "5",
                     "--out", str(tmp_path)])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    recs = json.loads((tmp_path / "results.json").read_text())["moe-train"]["records"]
    cases = moe_train.MoETrainConfig(models=("deepseek-v3-ep4",), m_values=(64,)).cases()
    assert len(recs) == len(cases) * len(moe_train.STEPS) * len(moe_train.PROVIDERS)
    for r in recs:
        assert r["status"] == "ok", r
        assert r["max_rel_err"] <= r["tolerance"], r
        assert 0 < r["us"] < 50000 and r["p20_us"] <= r["us"] <= r["p80_us"], r
        assert r["replays"] >= 8 and r["checked"]
    assert all(r["speedup_vs_torch"] is not None for r in recs if r["provider"] == "tmagemm")
    assert "moe-train cases:" in out and "moe-train geomeans (tmagemm vs torch):" in out
