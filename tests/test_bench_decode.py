"""``tmagemm bench --preset decode``: layer shapes, byte counting, tables, saved schema, refusals;
a tiny GPU run (marked ``gpu``)."""

import csv
import json

import pytest
import torch

from tmagemm import cli
from tmagemm.bench import decode, graphed, mlp_fusion, report, results, shapes


def _llm(label):
    (nk,) = [(n, k) for lbl, n, k in shapes.LLM_LAYERS if lbl == label]
    return nk


# ------------------------------------------------------------------------------ layer shapes


def test_unsplit_models_take_the_llm_presets_shapes():
    for name, source in (("llama3-8b", "llama3-8b"), ("qwen2.5-7b", "qwen2.5-7b"), ("deepseek-v3", "deepseek-v3")):
        model = decode.MODELS[name]
        assert model.tp == 1
        assert [(p.n, p.k) for p in model.layer()] == [_llm(f"{source}.{p.name}") for p in model.projections]
    assert [p.name for p in decode.MODELS["llama3-8b"].layer()] == ["qkv", "o", "gate_up", "down"]
    # DeepSeek-V3's decode step absorbs kv_b into attention: five dense GEMMs per layer.
    assert [p.name for p in decode.MODELS["deepseek-v3"].layer()] == ["q_a+kv_a", "q_b", "o", "gate_up", "down"]


def test_tp4_splits_n_of_column_parallel_and_k_of_row_parallel():
    layer = {p.name: (p.n, p.k, p.parallel) for p in decode.MODELS["llama3-70b-tp4"].layer()}
    assert layer == {
        "qkv": (10240 // 4, 8192, "column"),  # 16 q heads + 2 + 2 kv heads of 128 per rank
        "o": (8192, 8192 // 4, "row"),
        "gate_up": (57344 // 4, 8192, "column"),
        "down": (8192, 28672 // 4, "row"),
    }


def test_replicated_projections_are_not_split_and_indivisible_sizes_are_refused():
    model = decode.Model("x", (decode.Projection("q_a+kv_a", 2112, 7168, "replicated"),
                               decode.Projection("qkv", 96, 64, "column")), tp=4)  # fmt: skip
    assert [(p.n, p.k) for p in model.layer()] == [(2112, 7168), (24, 64)]
    with pytest.raises(ValueError, match="qkv N=96 does not divide by TP 5"):
        decode.Model("x", model.projections, tp=5).layer()


def test_every_stack_streams_far_more_than_l2():
    for model in decode.MODELS.values():
        per_layer = decode.layer_bytes(model.layer(), 1, "fp8-tensor")["weight_bytes"]
        assert per_layer > 4 * 50e6, (model.name, per_layer)  # > 4x the 50 MB L2 in one layer


# ---------------------------------------------------------------------------- byte counting


@pytest.mark.parametrize("recipe, elt, scale_bytes", [
    ("bf16", 2, 0),
    ("fp8-tensor", 1, 8),
    ("fp8-row", 1, 4 * (16 + 320)),
    ("fp8-block", 1, 4 * (16 * 3 + 3 * 3)),  # KB = ceil(300/128) = 3, NB = ceil(320/128) = 3
])
def test_gemm_bytes(recipe, elt, scale_bytes):
    got = decode.gemm_bytes(16, 320, 300, recipe)
    assert got == {"weight_bytes": 320 * 300 * elt, "scale_bytes": scale_bytes, "activation_bytes": 16 * 300 * elt,
                   "output_bytes": 16 * 320 * 2}  # fmt: skip


def test_layer_bytes_sum_the_gemms():
    layer = decode.MODELS["llama3-8b"].layer()
    total = decode.layer_bytes(layer, 8, "bf16")
    assert total["weight_bytes"] == 2 * sum(p.n * p.k for p in layer)
    assert total["activation_bytes"] == 2 * 8 * sum(p.k for p in layer)
    assert total["output_bytes"] == 2 * 8 * sum(p.n for p in layer)
    assert total["bytes"] == sum(total[k] for k in ("weight_bytes", "scale_bytes", "activation_bytes", "output_bytes"))
    assert total["flops"] == 2 * 8 * sum(p.n * p.k for p in layer)


# ------------------------------------------------------------------------ records and tables


def _records(ours_us=100.0, peer_us=125.0, peer_status="ok"):
    model = decode.MODELS["llama3-8b"]
    recs = []
    for recipe in ("fp8-tensor", "fp8-block"):
        for m in (1, 16):
            ours = decode.new_record(model, recipe, m, 8, "tmagemm")
            peer = decode.new_record(model, recipe, m, 8, "cublas")
            ours.update(status="ok", layer_us=ours_us, max_rel_err=3e-3)
            if recipe == "fp8-block" and m == 1:
                peer.update(status="unsupported", reason="cuBLAS refuses: RuntimeError: M must be > 1")
            else:
                peer.update(status=peer_status, layer_us=peer_us, max_rel_err=4e-3)
            recs += [ours, peer]
    return recs


def test_derive_speedup_and_pct_copy():
    recs = decode.derive(_records(), copy_gbs=3000.0)
    ours = recs[0]
    assert ours["speedup"] == pytest.approx(1.25)
    assert ours["gbps"] == pytest.approx(ours["bytes"] / 100e-6 / 1e9)
    assert ours["pct_copy"] == pytest.approx(100 * ours["gbps"] / 3000.0)
    refused = [r for r in recs if r["status"] == "unsupported"]
    assert len(refused) == 1 and refused[0]["pct_copy"] is None
    # Where the peer did not run, there is no speedup; nothing is compared against a non-ok record.
    (lonely,) = [r for r in recs if r["provider"] == "tmagemm" and r["recipe"] == "fp8-block" and r["m"] == 1]
    assert lonely["speedup"] is None and lonely["pct_copy"] is not None
    assert all(r["speedup"] is None for r in decode.derive(_records(peer_status="wrong"), 3000.0))
    assert all(r["pct_copy"] is None for r in decode.derive(_records(), None))


def test_geomeans_per_recipe():
    recs = decode.derive(_records(), 3000.0)
    rows = {g["recipe"]: g for g in decode.geomeans(recs)}
    assert rows["fp8-tensor"]["speedup"] == pytest.approx(1.25) and rows["fp8-tensor"]["paired"] == 2
    assert rows["fp8-block"]["paired"] == 1 and rows["fp8-block"]["rows"] == 2
    assert rows["fp8-tensor"]["tmagemm_pct_copy"] > rows["fp8-tensor"]["cublas_pct_copy"]


def test_tables_show_times_speedups_and_why_a_row_did_not_run():
    recs = decode.derive(_records(), 3000.0)
    text = decode.tables(recs)
    layers = text["decode layers"].splitlines()
    assert layers[0].split()[:4] == ["model", "recipe", "M", "MB/layer"] and "speedup" in layers[0]
    assert len(layers) == 2 + 4  # header, rule, one row per (model, recipe, M)
    row = next(line for line in layers if "fp8-tensor" in line and " 16 " in line)
    assert "100.0" in row and "125.0" in row and "1.250x" in row
    refused = next(line for line in layers if "fp8-block" in line and " 1 " in line)
    assert refused.split()[5] == "-" and refused.rstrip().endswith("cublas unsupported")
    assert "1.250" in text["decode geomeans"] and "1/2" in text["decode geomeans"]
    assert "M must be > 1" in text["decode not run / not correct"]
    assert "read + written" in text["decode notes"] and "not timed" in text["decode notes"]


def test_save_writes_the_common_schema_and_report_prints_it(tmp_path, capsys):
    recs = decode.derive(_records(), 3000.0)
    meta = {"gpu": "NVIDIA H100 80GB HBM3", "command": "tmagemm bench --preset decode", "preset": "decode",
            "ceilings": {"copy_gbs": 3000.0, "peak_tflops": {}, "errors": []}}  # fmt: skip
    result = graphed.make_result(meta, decode.tables(recs))
    paths = graphed.save(result, recs, decode.FIELDS, decode.NAME, tmp_path)
    payload = json.loads(paths["json"].read_text())
    assert payload["schema"] == results.SCHEMA and payload["records"] == []
    assert payload["decode"]["fields"] == list(decode.FIELDS)
    assert all(set(r) == set(decode.FIELDS) for r in payload["decode"]["records"])
    assert set(payload["extras"]) >= {"decode layers", "decode geomeans", "decode notes"}
    lines = paths["csv"].read_text().splitlines()
    assert lines[0].startswith("# gpu: ")
    rows = list(csv.DictReader(line for line in lines if not line.startswith("#")))
    assert len(rows) == len(recs) and rows[0]["model"] == "llama3-8b" and float(rows[0]["speedup"]) == pytest.approx(1.25)
    assert "decode layers:" in paths["table"].read_text()
    # tmagemm report reads it back (the decode tables travel in extras; no plots: no GEMM records).
    loaded = results.load(paths["json"])
    assert decode.layer_table(recs) in report.render(loaded) and report.render(loaded).count("1.250x") == 3
    assert cli.main(["report", str(tmp_path), "--out", str(tmp_path / "plots")]) == 0
    out = capsys.readouterr().out
    assert "decode layers:" in out and "decode geomeans:" in out and "unsupported" in out
    assert not (tmp_path / "plots").exists() or not list((tmp_path / "plots").glob("*.png"))


# ----------------------------------------------------------------------------- mlp fusion


def _mlp_records(unfused_us=50.0, fused_us=40.0):
    model = decode.MODELS["llama3-8b"]
    recs = []
    for m in (1, 16):
        unfused = mlp_fusion.new_record(model, m, 8, "mlp-unfused")
        fused = mlp_fusion.new_record(model, m, 8, "mlp-fused")
        unfused.update(status="ok", layer_us=unfused_us, max_rel_err=0.02)
        if m == 16:
            fused.update(status="wrong", layer_us=fused_us, max_rel_err=0.5, reason="max rel err 0.5 > 0.08")
        else:
            fused.update(status="ok", layer_us=fused_us, max_rel_err=0.019)
        recs += [unfused, fused]
    return recs


def test_mlp_records_count_the_two_gemms():
    rec = mlp_fusion.new_record(decode.MODELS["llama3-70b-tp4"], 16, 8, "mlp-fused")
    gemms = [decode.gemm_bytes(16, 57344 // 4, 8192, "fp8-block"), decode.gemm_bytes(16, 8192, 28672 // 4, "fp8-block")]
    assert rec["weight_bytes"] == sum(g["weight_bytes"] for g in gemms) and rec["recipe"] == "fp8-block"
    assert set(rec) == set(decode.FIELDS) and rec["tolerance"] == mlp_fusion.TOLERANCE
    assert mlp_fusion.mlp_projections(decode.MODELS["deepseek-v3"]) == (3, 4)
    assert mlp_fusion.mlp_projections(decode.Model("x", (decode.Projection("qkv", 96, 64, "column"),))) is None


def test_mlp_fusion_table_and_speedup():
    """speedup = unfused / fused on the mlp-fused record (ok pairs only); the table has its own
    rows and a geomean; the layer tables and geomeans keep to tmagemm vs cuBLAS."""
    recs = decode.derive(_records() + _mlp_records(), 3000.0)
    fused = [r for r in recs if r["provider"] == "mlp-fused"]
    assert fused[0]["speedup"] == pytest.approx(1.25) and fused[1]["speedup"] is None
    text = decode.tables(recs)
    rows = text["mlp fusion"].splitlines()
    assert rows[0].split()[:5] == ["model", "M", "MB/layer", "unfused", "us"] and len(rows) == 2 + 2 + 1
    assert "1.250x" in rows[2] and "50.0" in rows[2] and "40.0" in rows[2]
    assert rows[3].rstrip().endswith("mlp-fused wrong") and rows[-1] == "geomean speedup 1.250 over 1 of 2 pairs"
    assert len(text["decode layers"].splitlines()) == 2 + 4 and "mlp" not in text["decode layers"]
    assert decode.geomean_table(recs) == decode.geomean_table(decode.derive(_records(), 3000.0))
    assert "max rel err 0.5" in text["decode not run / not correct"]
    assert "gate_up_silu_quant" in text["decode notes"]
    assert "mlp fusion" not in decode.tables(decode.derive(_records(), 3000.0))


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter-sized chains; the GPU run covers real ones")
def test_mlp_chains_under_the_interpreter(seeded):
    """Both chains of a small MLP (2 layers, H = 256, I = 384) run on the CPU under the Triton
    interpreter and land within the tolerance of the float64 reference (1.7-3.2% over 12 seeds),
    and near each other (fused vs unfused: up to 4.7% of max|out|, h's fp8 rounding flips)."""
    model = decode.Model("tiny", (decode.Projection("gate_up", 768, 256, "column"),
                                  decode.Projection("down", 256, 384, "row")))
    ops = decode._weights(model, 2, True, "cpu")
    scales = [decode.weight_scales("fp8-block", p, "cpu") for p in model.layer()]
    gate_up, down = [row[0] for row in ops.weights], [row[1] for row in ops.weights]
    x = torch.randn(5, 256).to(torch.bfloat16)
    ref = mlp_fusion.reference(x, gate_up[-1], down[-1], scales[0]["sb"], scales[1]["sb"])
    outs = {}
    for provider in mlp_fusion.PROVIDERS:
        chain = mlp_fusion.build(provider, x, gate_up, down, scales[0]["sb"], scales[1]["sb"])
        chain.run()
        assert len(chain.outs) == 2 and chain.outs[0].shape == (5, 256)
        err = mlp_fusion.max_rel_err(chain.outs[-1], ref)
        assert 1e-3 < err <= mlp_fusion.TOLERANCE, (provider, err)
        outs[provider] = chain.outs[-1].double()
    assert mlp_fusion.max_rel_err(outs["mlp-fused"], outs["mlp-unfused"]) < mlp_fusion.TOLERANCE
    with pytest.raises(ValueError, match="unknown MLP chain"):
        mlp_fusion.build("mlp-other", x, gate_up, down, scales[0]["sb"], scales[1]["sb"])


# -------------------------------------------------------------------------------- options


def test_recipes_and_models_options():
    assert decode.recipes_for(None) == decode.RECIPES
    assert decode.recipes_for("fp8") == ("fp8-tensor", "fp8-row", "fp8-block")
    assert decode.recipes_for("fp8-block") == ("fp8-block",)
    assert decode.recipes_for("bf16") == ("bf16",)
    with pytest.raises(ValueError, match="--dtype fp16 does not apply"):
        decode.recipes_for("fp16")
    assert decode.parse_models(None) == tuple(decode.MODELS)
    assert decode.parse_models(["qwen2.5-7b", "qwen2.5-7b"]) == ("qwen2.5-7b",)
    with pytest.raises(ValueError, match="unknown model llama2"):
        decode.parse_models(["llama2"])
    for bad, words in ((dict(layers=0), "--layers"), (dict(m_values=(0,)), "M values >= 1"),
                       (dict(budget_ms=0), "--budget-ms"), (dict(recipes=("fp4",)), "unknown decode recipe")):  # fmt: skip
        with pytest.raises(ValueError, match=words):
            decode.DecodeConfig(**bad)


def test_without_a_gpu_the_decode_preset_is_refused_by_name(monkeypatch, tmp_path):
    # cmd_bench directly: main() would switch to the Triton interpreter (re-executing on a GPU machine).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv in (["bench", "--preset", "decode"], ["bench", "--check", "--preset", "decode", "--dtype", "fp8"]):
        args = cli.build_parser().parse_args([*argv, "--out", str(tmp_path)])
        with pytest.raises(ValueError, match="--preset decode needs a GPU: it times CUDA-graph replay"):
            cli.cmd_bench(args, "tmagemm " + " ".join(argv))
    with pytest.raises(RuntimeError, match="--preset decode needs a CUDA GPU"):
        decode.run(decode.DecodeConfig())


@pytest.mark.skipif(torch.cuda.is_available(), reason="main() without a GPU (on one it re-executes under the interpreter)")
def test_cpu_refusal_through_main(capsys, tmp_path):
    assert cli.main(["bench", "--preset", "decode", "--out", str(tmp_path)]) == 2
    assert "--preset decode needs a GPU" in capsys.readouterr().err


def test_fp8_fast_accumulation_tolerance_grows_with_k():
    assert decode.tolerance("fp8-tensor", 4096) == decode.tolerance("fp8-row", 1024) == 2e-2
    assert decode.tolerance("fp8-tensor", 16384) == pytest.approx(4e-2)
    assert decode.tolerance("fp8-tensor", 16384, fast_accum=False) == 2e-2
    assert decode.tolerance("fp8-block", 18432) == 2e-2 and decode.tolerance("bf16", 28672) == 1e-2
    assert decode.new_record(decode.MODELS["deepseek-v3"], "fp8-row", 1, 8, "tmagemm")["tolerance"] == pytest.approx(
        2e-2 * (18432 / 4096) ** 0.5)


@pytest.mark.parametrize("argv, message", [
    (["--preset", "decode", "--graph"], "--graph do not apply"),
    (["--preset", "decode", "--n", "64", "--providers", "cublas"], "--n, --providers do not apply"),
    (["--preset", "decode", "--dtype", "fp16"], "--dtype fp16 does not apply"),
    (["--preset", "decode", "--models", "gpt2"], "unknown model gpt2"),
    (["--preset", "decode", "--layers", "0"], "--layers must be >= 1"),
    (["--preset", "decode", "--m", "0,16"], "M values >= 1"),
    (["--preset", "llm", "--models", "llama3-8b"], "apply to --preset decode only"),
    (["--layers", "4"], "apply to --preset decode only"),
])
def test_decode_options_are_checked_before_any_gpu_work(argv, message, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the GPU path; refused before any GPU work
    monkeypatch.setattr(decode, "run", lambda *a, **k: pytest.fail("reached the GPU run"))
    assert cli.main(["bench", *argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err, err


def test_bench_help_documents_the_decode_options(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "decode: each model's layer stack" in text and "--models" in text and "--layers" in text
    assert "llama3-70b-tp4" in text


# ------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_tiny_decode_bench_on_gpu(tmp_path, capsys):
    code = cli.main(["bench", "--preset", "decode", "--models", "llama3-8b", "--layers", "2", "--m", "1,16",
                     "--budget-ms", "10", "--out", str(tmp_path)])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    payload = json.loads((tmp_path / "results.json").read_text())
    recs = payload["decode"]["records"]
    mlp = [r for r in recs if r["provider"] in mlp_fusion.PROVIDERS]
    recs = [r for r in recs if r["provider"] in decode.PROVIDERS]
    assert {(r["recipe"], r["m"]) for r in recs} == {(rc, m) for rc in decode.RECIPES for m in (1, 16)}
    assert len(recs) == 2 * len(decode.RECIPES) * 2
    copy = payload["metadata"]["ceilings"]["copy_gbs"]
    assert copy and 500 < copy < 20000
    for r in recs:
        if r["provider"] == "tmagemm" or r["recipe"] != "fp8-block":
            assert r["status"] == "ok", r
        if r["status"] != "ok":  # only cuBLAS block-scaled may refuse (M = 1), and it says why
            assert r["status"] == "unsupported" and r["reason"], r
            continue
        assert r["max_rel_err"] <= r["tolerance"], r
        assert 0 < r["layer_us"] < 5000 and r["layer_p20_us"] <= r["layer_us"] <= r["layer_p80_us"], r
        assert 5 < r["pct_copy"] < 150, r  # a stack that streams its weights runs near the copy rate
        assert r["replays"] >= 8
    for r in recs:
        if r["speedup"] is not None:
            assert 0.2 < r["speedup"] < 5, r
            assert r["rel_diff_vs_peer"] < 0.05, r
    assert "decode layers:" in out and "decode geomeans:" in out and "mlp fusion:" in out
    # The MLP comparison: both chains ran correctly, the fused one with its speedup.
    assert {(r["provider"], r["m"]) for r in mlp} == {(p, m) for p in mlp_fusion.PROVIDERS for m in (1, 16)}
    for r in mlp:
        assert r["status"] == "ok" and r["rel_diff_vs_peer"] < mlp_fusion.TOLERANCE, r
        assert 0 < r["layer_us"] < 5000 and r["replays"] >= 8, r
        if r["provider"] == "mlp-fused":
            assert 0.2 < r["speedup"] < 5, r
