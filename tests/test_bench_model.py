"""``tmagemm bench --preset model``: the static-cache decode step against transformers, the
variants (shared tensors, PyTorch's block-scale layouts, the layer check), records and tables,
an eager end-to-end run of the tiny model on the CPU, CLI refusals; a tiny GPU run with CUDA
graphs (marked ``gpu``). No timing is asserted anywhere."""

import csv
import dataclasses
import json

import pytest
import torch

import tmagemm.nn as tnn
from tmagemm import cli
from tmagemm.bench import graphed, model, model_variants, report, results, static_decode
from tmagemm.nn.quantize import dequantize_weight, quantize_weight

transformers = pytest.importorskip("transformers")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TINY = static_decode.SPECS["tiny"]


def tiny_model(layers=1, dtype=torch.bfloat16, family="llama", device="cpu", init_std=None):
    spec = dataclasses.replace(TINY, family=family)
    return static_decode.build_model(spec, layers, device, dtype, seed=0, init_std=init_std)


# -------------------------------------------------------------------------------- models


def test_specs_are_the_published_shapes():
    llama, qwen = static_decode.SPECS["llama3-8b"], static_decode.SPECS["qwen3-8b"]
    assert (llama.hidden, llama.intermediate, llama.layers, llama.heads, llama.kv_heads, llama.head_dim,
            llama.vocab, llama.rope_theta) == (4096, 14336, 32, 32, 8, 128, 128256, 500000.0)  # fmt: skip
    assert llama.params() == 8_030_261_248  # Meta-Llama-3-8B's parameter count
    assert (qwen.hidden, qwen.intermediate, qwen.layers, qwen.vocab) == (4096, 12288, 36, 151936)
    assert qwen.params() == 8_190_735_360  # Qwen3-8B's
    moe = static_decode.SPECS["qwen3-30b-a3b"]
    assert (moe.hidden, moe.layers, moe.heads, moe.kv_heads, moe.experts, moe.top_k, moe.expert_intermediate) == \
        (2048, 48, 32, 4, 128, 8, 768)
    assert moe.params() == 30_532_122_624  # Qwen3-30B-A3B's 30.5 B


def _tiny_moe(layers=2, dtype=torch.float32):
    if not hasattr(transformers, "Qwen3MoeForCausalLM"):
        pytest.skip("transformers without Qwen3-MoE")
    spec = static_decode.SPECS["tiny-moe"]
    m = static_decode.build_model(spec, layers, "cpu", dtype, seed=0, init_std=0.05)
    if getattr(m.model.layers[0].mlp, "experts", None) is None or not hasattr(m.model.layers[0].mlp.experts, "gate_up_proj"):
        pytest.skip(f"transformers {transformers.__version__} keeps experts as a ModuleList")
    return spec, m


def test_moe_model_counts_and_decoder_matches_transformers():
    """Qwen3-MoE (tiny-moe): the parameter count, the decode step against transformers' forward
    (float32, CPU), and the experts' share of a step's weight bytes."""
    spec, m = _tiny_moe()
    assert sum(p.numel() for p in m.parameters()) == spec.params(2)
    length = 16
    dec = static_decode.Decoder(m, static_decode.rope_tables(m, length), max_batch=2, length=length)
    ids = torch.randint(3, spec.vocab, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = m(input_ids=ids[:, :9], use_cache=False).logits
        torch.testing.assert_close(dec.prefill(ids[:, :8]), want[:, 7], rtol=1e-4, atol=1e-5)
        dec.reset(ids[:, 8], 8)
        torch.testing.assert_close(dec.step(2), want[:, 8], rtol=1e-4, atol=1e-5)
    everything = static_decode.step_weight_bytes(m)
    experts = sum(layer.mlp.experts.gate_up_proj.nbytes + layer.mlp.experts.down_proj.nbytes for layer in m.model.layers)
    touched = static_decode.experts_touched(4, 2, 1)
    assert touched == pytest.approx(2.0)  # one token: its top_k experts
    assert static_decode.step_weight_bytes(m, 1) == pytest.approx(everything - experts + experts * touched / 4, abs=8)
    assert static_decode.experts_touched(4, 2, 64) == pytest.approx(4.0)


def test_moe_variants_on_cpu(capsys):
    """The preset's variants of an MoE model, eager on the CPU: FP8Experts in fp8-tmagemm, the
    experts zeroed in no-proj, torch's block-scaled peer refused (no grouped block GEMM)."""
    if torch.cuda.is_available():
        pytest.skip("the CPU path")
    _tiny_moe()
    variants = ["bf16", "fp8-tmagemm", "fp8-torch-block", "no-proj"]
    config = model.ModelBenchConfig(models=("tiny-moe",), variants=variants, batches=(2,), layers=1, context=8,
                                    new_tokens=2, cuda_graphs=False, device="cpu", command="test")  # fmt: skip
    _, recs = model.run(config)
    by = {r["variant"]: r for r in recs}
    assert by["bf16"]["status"] == "ok" and by["bf16"]["hf_rel_err"] < model.HF_WRONG
    assert by["fp8-tmagemm"]["status"] == "ok", by["fp8-tmagemm"]
    assert 0 < by["fp8-tmagemm"]["logits_rel_err"] < model.LOGITS_WRONG
    assert by["no-proj"]["status"] == "ok"
    assert by["fp8-torch-block"]["status"] == "unsupported" and "grouped" in by["fp8-torch-block"]["reason"]
    assert by["fp8-tmagemm"]["weight_bytes"] < by["bf16"]["weight_bytes"]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_build_model_counts_dtype_and_init(family):
    if family == "qwen3" and not hasattr(transformers, "Qwen3ForCausalLM"):
        pytest.skip("transformers without Qwen3")
    m = tiny_model(layers=2, family=family, init_std=0.05)
    spec = dataclasses.replace(TINY, family=family)
    assert sum(p.numel() for p in m.parameters()) == spec.params(2)
    assert {p.dtype for p in m.parameters()} == {torch.bfloat16} and not any(p.requires_grad for p in m.parameters())
    assert m.config.initializer_range == 0.05 and not m.training
    assert float(m.model.layers[0].mlp.up_proj.weight.float().std()) == pytest.approx(0.05, rel=0.05)
    again = tiny_model(layers=2, family=family, init_std=0.05)  # fixed seed: the same weights
    assert torch.equal(again.lm_head.weight, m.lm_head.weight)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_decoder_matches_transformers(family):
    """float32 on the CPU: prefill, decode steps of a batch and of its first rows, and greedy
    tokens, against transformers' own forward pass and generate()."""
    if family == "qwen3" and not hasattr(transformers, "Qwen3ForCausalLM"):
        pytest.skip("transformers without Qwen3")
    m = tiny_model(layers=2, dtype=torch.float32, family=family, init_std=0.05)
    length = 24
    dec = static_decode.Decoder(m, static_decode.rope_tables(m, length), max_batch=3, length=length)
    ids = torch.randint(3, TINY.vocab, (3, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = m(input_ids=ids[:, :11], use_cache=False).logits
        prefill = dec.prefill(ids[:, :10])
        torch.testing.assert_close(prefill, want[:, 9], rtol=1e-4, atol=1e-5)
        dec.reset(ids[:, 10], 10)
        torch.testing.assert_close(dec.step(3), want[:, 10], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(dec.step(2), want[:2, 10], rtol=1e-4, atol=1e-5)  # the first rows of the cache
        tokens = dec.greedy(3, lambda: dec.step(3), ids[:, 10], 10, 4)
        generated = m.generate(ids[:, :11], attention_mask=torch.ones_like(ids[:, :11]), max_new_tokens=4,
                               min_new_tokens=4, do_sample=False, pad_token_id=0)  # fmt: skip
    assert torch.equal(tokens, generated[:, 11:])
    assert int(dec.pos) == 10 and torch.equal(dec.tok[:, 0], ids[:, 10])  # greedy sets the buffers back
    assert dec.cache_bytes(2) == 2 * 2 * 2 * TINY.kv_heads * length * TINY.head_dim * 4


def test_shared_copy_and_swap_modules():
    m = tiny_model()
    copy = static_decode.shared_copy(m)
    assert copy is not m and copy.model.layers[0] is not m.model.layers[0]
    assert copy.lm_head.weight is m.lm_head.weight and copy.model.embed_tokens.weight is m.model.embed_tokens.weight
    n = static_decode.swap_modules(copy, lambda name, mod: name.endswith("q_proj"), lambda mod: torch.nn.Identity())
    assert n == 1 and isinstance(copy.model.layers[0].self_attn.q_proj, torch.nn.Identity)
    assert type(m.model.layers[0].self_attn.q_proj) is torch.nn.Linear  # the original is untouched


# ----------------------------------------------------------------------- torch fp8 layouts


@pytest.mark.parametrize("n, k", [(384, 640), (256, 512), (128, 1664)])
def test_torch_block_weight_scale_layout(n, k, seeded):
    """PyTorch's 128x128 operand: (KB rounded up to 4, NB), stride (1, KB4), entry [kb, nb] the
    scale of weight block (nb, kb): dequantizing with it gives tmagemm's float64 dequantization."""
    q, scale = quantize_weight(torch.randn(n, k), "block")
    nb, kb = scale.shape
    kb4 = -(-kb // 4) * 4
    st = model_variants.torch_block_weight_scale(scale)
    assert st.shape == (kb4, nb) and st.stride() == (1, kb4) and st.dtype == torch.float32
    per_element = st.double()[:kb].t().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    assert torch.equal(q.double() * per_element, dequantize_weight(q, scale, "block", torch.float64))
    assert torch.all(st[kb:] == 1)  # padding blocks cover no column of K


@pytest.mark.parametrize("m", [1, 2, 17])
def test_torch_block_activation_scale_layout(m):
    xs = torch.rand(m, 5)
    st = model_variants.torch_block_activation_scale(xs)
    assert st.shape == (m, 5) and st.stride() == (1, m) and torch.equal(st, xs)


# ------------------------------------------------------------------------------ variants


def test_variants_share_the_bf16_models_tensors():
    m = tiny_model(layers=2)
    built = {}
    for name in ("bf16", "fp8-tmagemm", "fp8-torch-block", "fp8-tmagemm-row", "fp8-torch-row", "no-proj"):
        built[name] = model_variants.build_variant(name, m, built)
    assert built["bf16"] is m and all(type(mod) is not tnn.FP8Linear for mod in m.modules())
    for name, variant in built.items():
        assert variant.lm_head.weight is m.lm_head.weight, name  # lm_head kept (convert's default skip)
        assert variant.model.embed_tokens.weight is m.model.embed_tokens.weight, name
        assert variant.model.norm.weight is m.model.norm.weight, name
    kinds = {name: [type(mod).__name__ for n, mod in v.named_modules() if n.endswith("_proj")]
             for name, v in built.items()}  # fmt: skip
    assert kinds["fp8-tmagemm"] == ["FP8Linear"] * 14 and kinds["fp8-torch-row"] == ["TorchRowFP8Linear"] * 14
    assert kinds["fp8-torch-block"] == ["TorchBlockFP8Linear"] * 14 and kinds["no-proj"] == ["ZeroProjection"] * 14
    mine = built["fp8-tmagemm"].model.layers[1].mlp.down_proj
    peer = built["fp8-torch-block"].model.layers[1].mlp.down_proj
    assert peer.inner.weight is mine.weight and mine.recipe == "block"  # the same fp8 tensors, not a copy
    assert peer.inner.weight_scale_inv is mine.weight_scale_inv
    assert peer.weight_scale_torch.stride() == (1, 4)  # K = 512: KB = 4
    assert built["fp8-torch-row"].model.layers[0].self_attn.o_proj.inner.recipe == "row"
    # bytes a step reads: every projection's weight (bf16 2 B, fp8 1 B + fp32 scales), norms and lm_head
    proj = 2 * TINY.params(2) - 2 * 2 * TINY.vocab * TINY.hidden - 2 * (2 * 2 * TINY.hidden + TINY.hidden)
    head = 2 * TINY.vocab * TINY.hidden + 2 * (2 * 2 * TINY.hidden + TINY.hidden)
    assert static_decode.step_weight_bytes(m) == proj + head
    assert static_decode.step_weight_bytes(built["no-proj"]) == head
    fp8 = static_decode.step_weight_bytes(built["fp8-tmagemm"])
    assert proj // 2 + head < fp8 < proj // 2 + head + 4096  # + the 128x128 block scales
    if model_variants.fused_available("fp8-tmagemm-fused"):  # gate/up and q/k/v views of stacked weights count once
        fused = model_variants.build_variant("fp8-tmagemm-fused", m, built)
        mlp, twin = fused.model.layers[0].mlp, built["fp8-tmagemm"].model.layers[0]
        assert type(mlp).__name__ == "FP8GatedMLP" and fused.lm_head.weight is m.lm_head.weight
        assert mlp.down_proj.weight is twin.mlp.down_proj.weight  # fp8-tmagemm's bits, shared where possible
        assert fused.model.layers[0].self_attn.o_proj.weight is twin.self_attn.o_proj.weight
        attn = fused.model.layers[0].self_attn  # q/k/v: views of one stacked copy of the same bits
        assert type(attn.q_proj).__name__ == "FP8StackedLinear" and type(attn.v_proj).__name__ == "FP8StackMember"
        assert torch.equal(attn.v_proj.weight.view(torch.uint8), twin.self_attn.v_proj.weight.view(torch.uint8))
        assert torch.equal(mlp.gate_proj.weight.view(torch.uint8), twin.mlp.gate_proj.weight.view(torch.uint8))
        assert static_decode.step_weight_bytes(fused) == fp8
    if model_variants.fused_available("fp8-tmagemm-fused-norms"):  # + each layer's two norms, linked
        fused = model_variants.build_variant("fp8-tmagemm-fused-norms", m, built)
        layer = fused.model.layers[1]
        assert type(layer.input_layernorm) is tnn.FP8RMSNorm and type(layer.post_attention_layernorm) is tnn.FP8RMSNorm
        assert layer.self_attn.q_proj.input_norm is layer.input_layernorm
        assert layer.mlp.input_norm is layer.post_attention_layernorm
        assert type(fused.model.norm) is not tnn.FP8RMSNorm  # the final norm feeds the bf16 lm_head
        assert static_decode.step_weight_bytes(fused) == fp8  # the norms' weights, copied: as many bytes


def test_fused_variant_follows_converts_signature(monkeypatch):
    def convert_without(model, recipe="block", skip=("lm_head",)):
        return model

    def convert_gate_up_only(model, recipe="block", skip=("lm_head",), fuse_gate_up=False):
        return model

    def convert_with(model, recipe="block", skip=("lm_head",), fuse_gate_up=False, fuse_qkv=False):
        return model

    def convert_all(model, recipe="block", skip=("lm_head",), fuse_gate_up=False, fuse_qkv=False, fuse_norms=False):
        return model

    for older in (convert_without, convert_gate_up_only):
        monkeypatch.setattr(model_variants.tnn, "convert", older)
        assert "fp8-tmagemm-fused" not in model.default_variants()
        with pytest.raises(ValueError, match="fuse_gate_up=True, fuse_qkv=True"):
            model.parse_variants(["bf16", "fp8-tmagemm-fused"])
    monkeypatch.setattr(model_variants.tnn, "convert", convert_with)
    assert "fp8-tmagemm-fused" in model.default_variants()
    assert "fp8-tmagemm-fused-norms" not in model.default_variants()
    with pytest.raises(ValueError, match="fused-norms needs .*fuse_qkv=True, fuse_norms=True"):
        model.parse_variants(["bf16", "fp8-tmagemm-fused-norms"])
    assert model.parse_variants(["fp8-tmagemm-fused", "bf16"]) == ("bf16", "fp8-tmagemm-fused")
    monkeypatch.setattr(model_variants.tnn, "convert", convert_all)
    assert {"fp8-tmagemm-fused", "fp8-tmagemm-fused-norms"} <= set(model.default_variants())


def test_check_linears_passes_and_catches_a_wrong_scale():
    m = tiny_model().to(DEVICE)
    built = {}
    for name in ("bf16", "fp8-tmagemm", "fp8-tmagemm-fused"):
        if name in model.default_variants():
            built[name] = model_variants.build_variant(name, m, built)
    with torch.no_grad():
        for name, variant in built.items():
            err, tol, where = model_variants.check_linears(variant.model.layers[0], 2)
            assert 0 < err <= tol, (name, err, tol, where)
        layer = built["fp8-tmagemm"].model.layers[0]
        v_proj = layer.self_attn.v_proj
        v_proj.forward = lambda x, forward=v_proj.forward: 1.5 * forward(x)  # a GEMM that misapplies a scale
        err, tol, where = model_variants.check_linears(layer, 2)
    assert err > 10 * tol and where.startswith("self_attn.v_proj 128x256"), (err, tol, where)


# ------------------------------------------------------------------------ records, tables


def _records():
    recs = []
    times = {"bf16": 1000.0, "fp8-tmagemm": 625.0, "fp8-torch-block": 750.0, "fp8-torch-row": 700.0, "no-proj": 250.0}
    for batch in (1, 16):
        for variant, us in times.items():
            r = model.new_record("llama3-8b", 32, 512, batch, variant)
            if variant == "fp8-torch-block" and batch == 1:
                r.update(status="unsupported", reason="torch refuses: RuntimeError: CUBLAS_STATUS_NOT_SUPPORTED")
            else:
                r.update(status="ok", step_us=us * (2 if batch == 16 else 1), bytes=8e9, greedy_equal=1.0,
                         logits_rel_err=None if variant in ("bf16", "no-proj") else 0.11)  # fmt: skip
            recs.append(r)
    return recs


def test_derive_speedups_projections_and_fallback_peer():
    recs = model.derive(_records(), copy_gbs=3000.0)
    by = {(r["variant"], r["batch"]): r for r in recs}
    ours = by["fp8-tmagemm", 1]
    assert ours["tokens_per_s"] == pytest.approx(1 / 625e-6)
    assert by["fp8-tmagemm", 16]["tokens_per_s"] == pytest.approx(16 / 1250e-6)
    assert ours["vs_bf16"] == pytest.approx(1.6) and ours["vs_torch_row"] == pytest.approx(700 / 625)
    assert ours["vs_torch_block"] is None and ours["vs_torch"] == ours["vs_torch_row"]  # cuBLAS refused block at B=1
    assert by["fp8-tmagemm", 16]["vs_torch"] == pytest.approx(1.2)  # block where it ran
    assert ours["proj_us"] == pytest.approx(375) and ours["proj_vs_bf16"] == pytest.approx(750 / 375)
    assert ours["pct_copy"] == pytest.approx(100 * 8e9 / 625e-6 / 1e9 / 3000)
    assert by["bf16", 1]["vs_bf16"] is None and by["no-proj", 1]["proj_us"] is None
    assert by["fp8-torch-row", 1]["vs_bf16"] == pytest.approx(1000 / 700) and by["fp8-torch-row", 1]["vs_torch"] is None
    assert by["fp8-torch-block", 1]["tokens_per_s"] is None
    rows = {g["variant"]: g for g in model.geomeans(recs)}
    assert rows["fp8-tmagemm"]["vs_bf16"]["geomean"] == pytest.approx(1.6) and rows["fp8-tmagemm"]["vs_bf16"]["n"] == 2
    assert rows["fp8-tmagemm"]["vs_torch_block"]["n"] == 1
    assert rows["fp8-tmagemm"]["vs_torch"]["min"] == pytest.approx(700 / 625)


def test_tables_show_every_cell_and_why_one_did_not_run():
    recs = model.derive(_records(), 3000.0)
    text = model.tables(recs)
    lines = text["model decode"].splitlines()
    assert lines[0].split()[:5] == ["model", "B", "variant", "step", "us"] and len(lines) == 2 + 10
    row = next(line for line in lines if "fp8-tmagemm" in line and " 1 " in line)
    assert "625.0" in row and "1.600" in row and "1.120" in row and "same" in row
    refused = next(line for line in lines if "fp8-torch-block" in line and " 1 " in line)
    assert refused.rstrip().endswith("unsupported")
    assert "1.600 (min 1.600, 2)" in text["model geomeans"]
    assert "CUBLAS_STATUS_NOT_SUPPORTED" in text["model not run / not correct"]
    assert "1.4x bf16" in text["model notes"]


# --------------------------------------------------------------------- CPU end to end


def test_eager_run_of_the_tiny_model_on_cpu(tmp_path, capsys):
    """The whole preset without CUDA graphs (eager steps; the CPU runs the fp8 kernels under the
    Triton interpreter): every variant built, checked and recorded; the results round-trip."""
    if torch.cuda.is_available():
        pytest.skip("the CPU path; the GPU test runs the preset with graphs")
    variants = [v for v in model.default_variants() if v != "fp8-tmagemm-row"]  # the slowest under the interpreter
    config = model.ModelBenchConfig(models=("tiny",), variants=variants, batches=(2,), layers=1, context=8,
                                    new_tokens=2, cuda_graphs=False, device="cpu", command="test")  # fmt: skip
    result, recs = model.run(config)
    assert "[" in capsys.readouterr().err  # progress lines with elapsed seconds
    by = {r["variant"]: r for r in recs}
    assert list(by) == variants
    for name in variants:
        if not name.startswith("fp8-torch"):
            assert by[name]["status"] == "ok", by[name]
            assert by[name]["timing"] == "eager" and by[name]["step_us"] > 0 and by[name]["graph_equal"] is True
    for name in ("fp8-tmagemm", "fp8-tmagemm-fused", "fp8-tmagemm-fused-norms"):
        if name in by:
            ours = by[name]
            assert ours["gemm_max_rel_err"] <= ours["gemm_tolerance"] and ours["greedy_equal"] == 1.0, ours
            assert 0 < ours["logits_rel_err"] < model.LOGITS_WRONG and 0 <= ours["top1_agree"] <= 1, ours
    ours = by["fp8-tmagemm"]
    assert by["bf16"]["hf_rel_err"] < model.HF_WRONG and by["bf16"]["logits_rel_err"] is None
    for peer in ("fp8-torch-block", "fp8-torch-row"):  # CPU torch may lack the fp8 GEMM: refused, with why
        assert by[peer]["status"] in ("ok", "unsupported"), by[peer]
        assert by[peer]["status"] == "ok" or by[peer]["reason"].startswith("torch")
    assert ours["bytes"] == ours["weight_bytes"] + ours["kv_bytes"] > 0
    assert result.metadata["setup"][0]["layers"] == 1 and result.metadata["ceilings"]["copy_gbs"] is None
    paths = graphed.save(result, recs, model.FIELDS, model.NAME, tmp_path)
    payload = json.loads(paths["json"].read_text())
    assert payload["model"]["fields"] == list(model.FIELDS) and len(payload["model"]["records"]) == len(variants)
    rows = list(csv.DictReader(line for line in paths["csv"].read_text().splitlines() if not line.startswith("#")))
    assert [r["variant"] for r in rows] == [r["variant"] for r in recs]
    assert "model decode:" in report.render(results.load(paths["json"]))


# ---------------------------------------------------------------------------------- CLI


def test_without_a_gpu_the_model_preset_is_refused_by_name(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = cli.build_parser().parse_args(["bench", "--preset", "model", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="--preset model needs a GPU"):
        cli.cmd_bench(args, "tmagemm bench --preset model")
    with pytest.raises(RuntimeError, match="--preset model needs a CUDA GPU"):
        model.run(model.ModelBenchConfig())
    with pytest.raises(RuntimeError, match="CUDA graphs"):
        model.run(model.ModelBenchConfig(device="cpu"))


@pytest.mark.parametrize("argv, message", [
    (["--preset", "model", "--graph"], "--graph do not apply"),
    (["--preset", "model", "--dtype", "fp8", "--providers", "cublas"], "--providers, --dtype do not apply"),
    (["--preset", "model", "--models", "gpt2"], "unknown model gpt2"),
    (["--preset", "model", "--variants", "fp8-tensor"], "unknown variant fp8-tensor"),
    (["--preset", "model", "--layers", "0"], "--layers must be >= 1"),
    (["--preset", "model", "--m", "0,16"], "batch sizes (--m) >= 1"),
    (["--preset", "model", "--context", "0"], "--context must be >= 1"),
    (["--preset", "model", "--new-tokens", "0"], "--new-tokens must be >= 1"),
    (["--preset", "model", "--init-std", "0"], "--init-std must be > 0"),
    (["--preset", "decode", "--variants", "bf16"], "--variants apply to --preset model only"),
    (["--preset", "moe", "--compile-check", "--context", "64"], "--context, --compile-check apply to --preset model"),
])
def test_model_options_are_checked_before_any_gpu_work(argv, message, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the GPU path; refused before any GPU work
    monkeypatch.setattr(model, "run", lambda *a, **k: pytest.fail("reached the GPU run"))
    assert cli.main(["bench", *argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err, err


def test_cli_builds_the_config_and_saves_the_tables(monkeypatch, capsys, tmp_path):
    seen = {}

    def fake_run(config):
        seen["config"] = config
        recs = model.derive(_records(), 3000.0)
        return graphed.make_result({"command": config.command, "preset": "model"}, model.tables(recs)), recs

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(model, "run", fake_run)
    argv = ["bench", "--preset", "model", "--models", "tiny", "--m", "4,1,4", "--variants", "fp8-tmagemm,bf16",
            "--context", "64", "--new-tokens", "3", "--layers", "2", "--budget-ms", "50", "--compile-check",
            "--init-std", "0.03", "--out", str(tmp_path)]  # fmt: skip
    assert cli.main(argv) == 0
    c = seen["config"]
    assert (c.models, c.variants, c.batches, c.context, c.new_tokens, c.layers, c.budget_ms, c.compile_check,
            c.init_std) == (("tiny",), ("bf16", "fp8-tmagemm"), (4, 1), 64, 3, 2, 50.0, True, 0.03)  # fmt: skip
    assert c.cuda_graphs and c.device is None and c.command.startswith("tmagemm bench --preset model")
    assert "model decode:" in capsys.readouterr().out
    assert json.loads((tmp_path / "results.json").read_text())["model"]["fields"] == list(model.FIELDS)


def test_bench_help_documents_the_model_preset(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "model: decode tokens/s of a whole random 8B-shaped model" in text
    for flag in ("--variants", "--context", "--new-tokens", "--compile-check", "--init-std"):
        assert flag in text


# ------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_tiny_model_bench_on_gpu(tmp_path, capsys):
    code = cli.main(["bench", "--preset", "model", "--models", "tiny", "--m", "1,4", "--context", "64",
                     "--new-tokens", "4", "--budget-ms", "20", "--out", str(tmp_path)])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    payload = json.loads((tmp_path / "results.json").read_text())
    recs = payload["model"]["records"]
    variants = model.default_variants()
    assert {(r["variant"], r["batch"]) for r in recs} == {(v, b) for v in variants for b in (1, 4)}
    assert payload["metadata"]["ceilings"]["copy_gbs"] > 500
    for r in recs:
        if r["variant"] == "fp8-torch-block" and r["batch"] == 1:  # cuBLAS refuses block scales at M = 1
            assert r["status"] in ("ok", "unsupported") and (r["status"] == "ok" or r["reason"]), r
            continue
        assert r["status"] == "ok", r
        assert r["timing"] == "graph" and r["replays"] >= 8 and 0 < r["step_p20_us"] <= r["step_us"] <= r["step_p80_us"]
        if r["variant"].startswith("fp8-tmagemm") or r["variant"] == "no-proj":
            assert r["graph_equal"] is True, r  # a replay gives eager's logits bit for bit
        if r["variant"] != "no-proj":
            assert r["gemm_max_rel_err"] <= r["gemm_tolerance"] and r["greedy_equal"] == 1.0, r
        if r["variant"] not in ("bf16", "no-proj"):
            assert r["logits_rel_err"] < model.LOGITS_WRONG and r["vs_bf16"] > 0, r
    assert all(r["hf_rel_err"] < model.HF_WRONG for r in recs if r["variant"] == "bf16")
    assert "model decode:" in out and "model geomeans:" in out


@pytest.mark.gpu
def test_tiny_moe_model_bench_on_gpu(tmp_path, capsys):
    """Qwen3-MoE in CUDA graphs: FP8Experts and the torch row-wise grouped peer run, correct."""
    code = cli.main(["bench", "--preset", "model", "--models", "tiny-moe", "--m", "1,4", "--context", "64",
                     "--new-tokens", "4", "--budget-ms", "20", "--variants", "bf16,fp8-tmagemm,fp8-tmagemm-row,"
                     "fp8-torch-row,no-proj", "--out", str(tmp_path)])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    recs = json.loads((tmp_path / "results.json").read_text())["model"]["records"]
    for r in recs:
        assert r["status"] == "ok", r
        if r["variant"].startswith("fp8-tmagemm"):
            assert r["graph_equal"] is True and r["greedy_equal"] == 1.0, r
            assert r["logits_rel_err"] < model.LOGITS_WRONG, r


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_tiny_model_compile_check_on_gpu(name, tmp_path):
    """Compiled with eager's roundings (emulate_precision_casts), the steps give eager's logits and
    greedy tokens (tiny-moe: FP8Experts under torch.compile(mode="reduce-overhead"))."""
    if name == "tiny-moe":
        _tiny_moe()
    variants = ("bf16", "fp8-tmagemm", "fp8-tmagemm-fused-norms")
    config = model.ModelBenchConfig(models=(name,), variants=variants, batches=(2,), layers=2,
                                    context=32, new_tokens=4, budget_ms=10, compile_check=True)  # fmt: skip
    result, _ = model.run(config)
    rows = result.metadata["compile_check"]
    assert tuple(r["variant"] for r in rows) == variants
    for row in rows:
        assert not row.get("error"), row
        assert row["compile_s"] > 0 and row["step_us"] > 0 and row["tokens_equal"] == 1.0, row
        assert row["logits_rel_diff"] < 1e-3, row
    assert "model compile check:" in graphed.render(result)
