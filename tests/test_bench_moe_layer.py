"""``tmagemm bench --preset moe-layer`` without a GPU: its config rules, routing (seeded, expert-parallel
sentinels), the torch peer's forward against float64, the derived speedups and tables, and the CLI's
refusal to run it without a GPU. The timed run itself is GPU work (BENCHMARKS.md)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tmagemm import cli
from tmagemm.bench import moe, moe_layer


def test_config_rules():
    config = moe_layer.MoELayerConfig(models=("mixtral-8x7b",), tokens=(1, 64), routings=("zipf",))
    assert config.cases() == [moe_layer.Case("mixtral-8x7b", 1, "zipf"), moe_layer.Case("mixtral-8x7b", 64, "zipf")]
    assert len(moe_layer.MoELayerConfig().cases()) == 30  # 3 models x 5 token counts x 2 routings
    with pytest.raises(ValueError, match="unknown routing"):
        moe_layer.MoELayerConfig(routings=("skewed",))
    with pytest.raises(ValueError, match="token counts"):
        moe_layer.MoELayerConfig(tokens=(0,))
    with pytest.raises(ValueError, match="budget-ms"):
        moe_layer.MoELayerConfig(budget_ms=0)
    with pytest.raises(ValueError, match="unknown"):
        moe_layer.MoELayerConfig(models=("gpt-9",))


def test_routing_is_seeded_with_sentinels_under_expert_parallelism():
    model = moe.MODELS["deepseek-v3-ep4"]
    ids, weights = moe_layer.routing(model, 300, "cpu")
    again, _ = moe_layer.routing(model, 300, "cpu")
    assert torch.equal(ids, again) and ids.shape == (300, 8) and weights.shape == (300, 8)
    assert all(len(set(row.tolist())) == 8 for row in ids)  # distinct experts per token
    assert int(ids.max()) < 256 and bool((ids >= model.experts).any())  # other GPUs' experts: sentinels
    torch.testing.assert_close(weights.float().sum(dim=1), torch.ones(300), rtol=0, atol=1e-2)


def test_zipf_routing_is_skewed_and_distinct_per_token():
    model = moe.MODELS["qwen3-235b-a22b"]
    ids, weights = moe_layer.routing(model, 1024, "cpu", "zipf")
    again, _ = moe_layer.routing(model, 1024, "cpu", "zipf")
    assert torch.equal(ids, again) and ids.shape == (1024, 8)
    assert all(len(set(row.tolist())) == 8 for row in ids)
    counts = torch.bincount(ids.flatten(), minlength=128)
    balanced = torch.bincount(moe_layer.routing(model, 1024, "cpu")[0].flatten(), minlength=128)
    assert int(counts.max()) > 4 * int(balanced.max())  # a few experts take most tokens


def test_torch_peer_matches_float64():
    """The bf16 peer (transformers' grouped_mm steps) with a sentinel id, against float64."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    torch.manual_seed(3)
    x = torch.randn(6, 32).bfloat16()
    ids = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 1], [2, 3], [1, 0]])  # 3: a sentinel of 3 experts
    weights = torch.rand(6, 2).bfloat16()
    gate_up, down = (torch.randn(3, 64, 32) / 6).bfloat16(), (torch.randn(3, 32, 32) / 6).bfloat16()
    try:
        got = moe_layer.torch_experts_forward(x, ids, weights, 3, gate_up, down)
    except (RuntimeError, NotImplementedError) as exc:
        pytest.skip(f"torch._grouped_mm does not run on this CPU: {exc}")
    want = torch.zeros(6, 32, dtype=torch.float64)
    for t in range(6):
        for j in range(2):
            e = int(ids[t, j])
            if e < 3:
                gate, up = (gate_up[e].double() @ x[t].double()).chunk(2)
                want[t] += float(weights[t, j]) * (down[e].double() @ (F.silu(gate) * up))
    assert float((got.double() - want).norm() / want.norm()) < 2e-2


def test_derive_and_tables():
    model = moe.MODELS["mixtral-8x7b"]
    ids, _ = moe_layer.routing(model, 4, "cpu")
    records = []
    for provider, us in zip(moe_layer.PROVIDERS, (100.0, 110.0, 200.0, 150.0)):
        rec = moe_layer.new_record(model, 4, ids, provider, "zipf")
        rec.update(status="ok", us=us, rel_err=0.05)
        records.append(rec)
    moe_layer.derive(records, copy_gbs=3000.0)
    by = {r["provider"]: r for r in records}
    assert by["tmagemm-block"]["speedup"] == pytest.approx(2.0)
    assert by["tmagemm-row"]["speedup"] == pytest.approx(150 / 110)
    assert by["torch-bf16"]["weight_bytes"] == 2 * by["tmagemm-block"]["weight_bytes"]
    assert by["tmagemm-block"]["pct_copy"] == pytest.approx(100 * by["tmagemm-block"]["gbs"] / 3000)
    text = moe_layer.tables(records)
    assert "2.000x" in text["moe-layer cases"] and "zipf" in text["moe-layer cases"]
    assert "tmagemm-block vs torch-bf16" in text["moe-layer geomeans"]


def test_cli_refuses_without_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("with a GPU the preset runs")
    assert cli.main(["bench", "--preset", "moe-layer"]) != 0
    assert "--preset moe-layer needs a GPU" in capsys.readouterr().err
