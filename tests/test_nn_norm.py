"""tmagemm.nn.norm: RMSNorm fused with the FP8 layers' input quantization (the kernel against a
float64 RMSNorm and the layers' own quantizer, the hand-off to linked layers, convert and
checkpoints, torch.compile), CPU under the interpreter and on the GPU."""

from __future__ import annotations

import copy

import pytest
import torch

import tmagemm.nn as tnn
from test_nn import CUDA, DEVICE, HALF, assert_graph_replays_match_eager, fp8_equal, rel_err, tiny_llama, traced
from tmagemm.nn.norm import FP8RMSNorm, norm_feeds, quantizing_layers, rms_norm_reason
from tmagemm.nn.warmup import _layers
from tmagemm.quant import quantize_fp8
from tmagemm.triton.norm_quantize import MAX_HIDDEN, rms_norm_quantize

FP8 = torch.float8_e4m3fn
# The interpreter's bfloat16 casts do not round to nearest: bf16 runs on the GPU only.
DTYPES = [(torch.float16, torch.float16), (torch.float32, torch.float32), (torch.float16, torch.float32)]
if CUDA:
    DTYPES += [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)]


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm, op for op (in float32 on the CPU: no approximate rsqrt)."""
    xf = x.cpu().float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight.cpu() * normed.to(x.dtype)


def ulp(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


@pytest.mark.parametrize("x_dtype,w_dtype", DTYPES)
@pytest.mark.parametrize("recipe", ["1x128", "row"])
@pytest.mark.parametrize("rows,hidden", [(1, 256), (17, 208), (130, 4096), (3, 16)])
def test_kernel_matches_the_norm_and_the_layers_quantizer(rows, hidden, recipe, x_dtype, w_dtype, seeded):
    """y is transformers' RMSNorm within one rounding of its dtype (the rsqrt and the sum's order
    differ) and float64's within two; y_fp8 and the scales are bit for bit quantize_fp8(y)."""
    x = (torch.randn(rows, hidden) * 3 + 0.5).to(device=DEVICE, dtype=x_dtype)
    weight = (torch.rand(hidden) + 0.5).to(device=DEVICE, dtype=w_dtype)
    y, q, scale = rms_norm_quantize(x, weight, 1e-5, recipe)
    want = hf_rms_norm(x, weight, 1e-5)
    assert y.dtype == want.dtype == torch.promote_types(w_dtype, x_dtype) and y.shape == (rows, hidden)
    # Two roundings (normed, then the product) plus the fp32 rsqrt of a sum in another order.
    step = ulp(torch.promote_types(w_dtype, x_dtype)) + ulp(x_dtype) + 16 * ulp(torch.float32)
    worst = ((y.cpu().double() - want.double()).abs() / want.double().abs().clamp_min(1e-30)).max().item()
    assert worst <= step, (worst, step)
    xd = x.cpu().double()
    exact = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.cpu().double()
    assert rel_err(y, exact) < 2 * step
    q_want, s_want = quantize_fp8(y, recipe, check_finite=False)
    assert fp8_equal(q, q_want) and torch.equal(scale, s_want)
    assert scale.shape == ((rows, -(-hidden // 128)) if recipe == "1x128" else (rows, 1))
    if recipe == "1x128":  # the same values with the scales contiguous along M
        _, q_m, scale_m = rms_norm_quantize(x, weight, 1e-5, recipe, m_major=True)
        assert scale_m.stride() == (1, -(-rows // 4) * 4) and torch.equal(scale_m, scale) and fp8_equal(q_m, q)


@pytest.mark.parametrize("recipe", ["block", "row"])
@pytest.mark.parametrize("rows", [17, 128, 129, 200])
def test_layers_activation_scales_are_m_major_past_decode_sizes(rows, recipe, seeded):
    """The layers' quantizer ops give block scales contiguous along M above 128 rows (what the
    native kernel loads by TMA) and row-major ones up to 128; their fake implementations (meta
    tensors, torch.compile's tracing) say the same shapes and strides; the values are the
    row-major quantizer's."""
    x = torch.randn(rows, 384, device=DEVICE, dtype=HALF) * 2
    w = torch.rand(384, device=DEVICE, dtype=HALF) + 0.5
    m_major = recipe == "block" and rows > 128
    want_stride = (1, -(-rows // 4) * 4) if m_major else ((3, 1) if recipe == "block" else (1, 1))
    granularity = "1x128" if recipe == "block" else recipe
    q, scale = torch.ops.tmagemm_nn.quantize_activation(x, recipe)
    q_want, s_want = quantize_fp8(x, granularity, check_finite=False)
    assert scale.stride() == want_stride and torch.equal(scale, s_want) and fp8_equal(q, q_want)
    fake = torch.ops.tmagemm_nn.quantize_activation(x.to("meta"), recipe)
    assert [(t.shape, t.stride(), t.dtype) for t in fake] == [(t.shape, t.stride(), t.dtype) for t in (q, scale)]
    y, q, scale = torch.ops.tmagemm_nn.rms_norm_quantize_activation(x, w, 1e-6, recipe)
    q_want, s_want = quantize_fp8(y, granularity, check_finite=False)
    assert scale.stride() == want_stride and torch.equal(scale, s_want) and fp8_equal(q, q_want)
    fake = torch.ops.tmagemm_nn.rms_norm_quantize_activation(x.to("meta"), w.to("meta"), 1e-6, recipe)
    assert [(t.shape, t.stride(), t.dtype) for t in fake] == [(t.shape, t.stride(), t.dtype) for t in (y, q, scale)]


def test_kernel_edges_and_refusals():
    x = torch.randn(4, 256, device=DEVICE, dtype=HALF)
    w = torch.ones(256, device=DEVICE, dtype=HALF)
    y, q, s = rms_norm_quantize(x[:0], w, 1e-6)
    assert y.shape == (0, 256) and q.shape == (0, 256) and s.shape == (0, 2)
    zero_y, zero_q, zero_s = rms_norm_quantize(torch.zeros_like(x), w, 1e-6)  # eps keeps a zero row finite
    assert not zero_y.any() and not zero_q.float().any() and (zero_s == torch.finfo(torch.float32).tiny).all()
    cases = [
        ((x.int(), w, 1e-6), TypeError, "x must be float16"),
        ((x, w.to(FP8), 1e-6), TypeError, "weight must be float16"),
        ((x[0], w, 1e-6), ValueError, "x must be 2-D"),
        ((x, w[:128], 1e-6), ValueError, r"weight has shape \(128,\)"),
        ((x.t(), torch.ones(4, device=DEVICE, dtype=HALF), 1e-6), ValueError, "contiguous last dimension"),
        ((x, w, -1.0), ValueError, "eps must be"),
        ((x, w, 1e-6, "tensor"), ValueError, "recipe must be one of"),
        ((x, w, 1e-6, "row", FP8, True), ValueError, "m_major applies to the '1x128' recipe"),
        ((torch.zeros(1, MAX_HIDDEN + 16, device=DEVICE), torch.zeros(MAX_HIDDEN + 16, device=DEVICE), 1e-6),
         ValueError, "hidden size"),
    ]
    for args, error, match in cases:
        with pytest.raises(error, match=match):
            rms_norm_quantize(*args)


class Block(torch.nn.Module):
    """A decoder layer's shape: a norm feeding q/k/v, another feeding a gated MLP."""

    def __init__(self, hidden=256, kv=128, inter=256, dtype=HALF):
        super().__init__()
        transformers = pytest.importorskip("transformers")
        llama = transformers.models.llama.modeling_llama
        config = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_attention_heads=4,
                                          num_key_value_heads=2, head_dim=64)
        self.input_layernorm = llama.LlamaRMSNorm(hidden, eps=1e-5)
        self.attn = QKV(hidden, kv)
        self.post_attention_layernorm = llama.LlamaRMSNorm(hidden, eps=1e-5)
        self.mlp = llama.LlamaMLP(config)
        for norm in (self.input_layernorm, self.post_attention_layernorm):
            torch.nn.init.uniform_(norm.weight, 0.5, 1.5)
        self.to(device=DEVICE, dtype=dtype)

    def forward(self, x):
        h = self.input_layernorm(x)
        q, k, v = self.attn(h)
        x = x + q + torch.cat([k, v], dim=-1)
        h = self.post_attention_layernorm(x)
        return x + self.mlp(h)


class QKV(torch.nn.Module):
    def __init__(self, hidden, kv):
        super().__init__()
        self.q_proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.k_proj = torch.nn.Linear(hidden, kv, bias=False)
        self.v_proj = torch.nn.Linear(hidden, kv, bias=False)

    def forward(self, hidden_states):
        return self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)


@pytest.fixture
def count_quantizers(monkeypatch):
    """Inputs the layers quantized themselves since the fixture: through the standalone
    activation quantizer, or (block recipe) ``block_linear``, which quantizes its input before
    or inside its GEMM."""
    import tmagemm.nn.linear as linear_module

    calls = []
    real, real_linear = linear_module.activation_ops, linear_module.linear_ops

    class Ops:
        def __getattr__(self, name):
            return getattr(real(), name)

        def quantize_activation(self, x, recipe):
            calls.append(tuple(x.shape))
            return real().quantize_activation(x, recipe)

    class LinearOps:
        def block_linear(self, x, *args):
            calls.append(tuple(x.shape))
            return real_linear().block_linear(x, *args)

    monkeypatch.setattr(linear_module, "activation_ops", Ops)
    monkeypatch.setattr(linear_module, "linear_ops", LinearOps)
    return calls


@pytest.mark.parametrize("fusions", [{}, {"fuse_qkv": True}, {"fuse_qkv": True, "fuse_gate_up": True}])
@pytest.mark.parametrize("recipe", ["block", "row"])
@pytest.mark.parametrize("lead", [(1,), (17,), (2, 9), (0,), (2, 75)])
def test_linked_layers_take_the_norms_quantization(lead, recipe, fusions, seeded, count_quantizers):
    """Both norms become FP8RMSNorm linked to what they feed; the layers quantize nothing
    themselves (unfused MLP: only down_proj's input), and the block gives the layers-converted
    model's output bit for bit where the norms agree (the fused norm's rsqrt and sum order may
    move a value by one rounding: then within 1e-2)."""
    if recipe == "row" and fusions.get("fuse_gate_up"):
        pytest.skip("the fused MLP is block-scaled")
    block = Block()
    plain = tnn.convert(copy.deepcopy(block), recipe=recipe, skip=(), **fusions)
    fused = tnn.convert(block, recipe=recipe, skip=(), fuse_norms=True, **fusions)
    first, second = fused.input_layernorm, fused.post_attention_layernorm
    assert type(first) is FP8RMSNorm and type(second) is FP8RMSNorm and first.recipe == recipe
    takers = quantizing_layers(fused.attn)
    assert first.consumers == len(takers) == (1 if fusions.get("fuse_qkv") else 3)
    assert all(layer.input_norm is first for layer in takers)
    assert fused.state_dict().keys() == plain.state_dict().keys()
    twin = copy.deepcopy(fused)  # links follow the copy (the model preset's variants are copies)
    assert all(layer.input_norm is twin.input_layernorm for layer in quantizing_layers(twin.attn))
    x = torch.randn(*lead, 256, device=DEVICE, dtype=HALF) * 2
    with torch.no_grad():
        want = plain(x)
        del count_quantizers[:]
        got = fused(x)
        h = first(x)
        same_norm = torch.equal(h, plain.input_layernorm(x))
    assert count_quantizers == ([] if fusions.get("fuse_gate_up") else [(x.numel() // 256, 256)])  # down_proj's h
    assert first.handoff.holding()  # the last call (h above) is held for its takers...
    with torch.no_grad():
        fused.attn(h)
    # ...and released once they took it
    assert not first.handoff.holding() and not second.handoff.holding()
    assert torch.equal(got, want) if same_norm else rel_err(got, want) < 1e-2


def test_other_inputs_and_in_place_changes_are_quantized_by_the_layer(seeded, count_quantizers):
    block = tnn.convert(Block(), skip=(), fuse_qkv=True, fuse_norms=True)
    norm, q_proj = block.input_layernorm, block.attn.q_proj
    x = torch.randn(5, 256, device=DEVICE, dtype=HALF)
    with torch.no_grad():
        h = norm(x)
        twin = h.clone()
        assert count_quantizers == []
        other = block.attn(twin)  # another tensor with the same values: quantized by the stack itself
        assert len(count_quantizers) == 1 and norm.handoff.holding()
        handed = block.attn(h)
        assert len(count_quantizers) == 1 and not norm.handoff.holding()
        for a, b in zip(handed, other):
            assert torch.equal(a, b)  # the norm's quantization is the layer's, bit for bit
        h = norm(x)
        h.mul_(-2)  # changed in place after the norm: the held quantization is stale
        changed = q_proj(h)
        assert len(count_quantizers) == 2
        assert torch.equal(changed, q_proj(h.clone()))


def test_linking_rules_and_refusals(seeded):
    transformers = pytest.importorskip("transformers")
    assert norm_feeds(transformers.models.llama.modeling_llama.LlamaDecoderLayer) == (
        ("input_layernorm", "self_attn"), ("post_attention_layernorm", "mlp"))
    assert norm_feeds(transformers.models.llama.modeling_llama.LlamaModel) == ()  # the final norm: no layer call
    assert norm_feeds(Block) == (("input_layernorm", "attn"), ("post_attention_layernorm", "mlp"))

    class Gemma(torch.nn.Module):  # (1 + weight), computed in float32: not this formula
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(256))
            self.variance_epsilon = 1e-6

        def forward(self, hidden_states):
            return hidden_states * (1 + self.weight)

    assert "is not transformers' RMSNorm" in rms_norm_reason(Gemma())
    llama_norm = transformers.models.llama.modeling_llama.LlamaRMSNorm
    assert rms_norm_reason(llama_norm(256)) is None
    assert "multiple of 16" in rms_norm_reason(llama_norm(200))
    assert "dtype torch.float64" in rms_norm_reason(llama_norm(256).double())
    # A tensor-wise model, a skipped norm, a Gemma norm: nothing fused, nothing linked.
    with pytest.raises(ValueError, match="fuse_norms=True needs recipe='block' or 'row'"):
        tnn.convert(Block(), recipe="tensor", fuse_norms=True)
    with pytest.raises(TypeError, match="fuse_norms must be a bool"):
        tnn.convert(Block(), fuse_norms=1)
    kept = tnn.convert(Block(), skip=("input_layernorm",), fuse_norms=True)
    assert type(kept.input_layernorm) is not FP8RMSNorm and type(kept.post_attention_layernorm) is FP8RMSNorm
    assert kept.attn.q_proj.input_norm is None
    block = Block()
    block.input_layernorm = Gemma().to(DEVICE)
    assert type(tnn.convert(block, fuse_norms=True).input_layernorm) is Gemma
    mixed = Block()
    mixed.attn.k_proj = tnn.FP8Linear.from_linear(mixed.attn.k_proj, "row")  # q/v block, k row: no one recipe
    assert type(tnn.convert(mixed, fuse_norms=True).input_layernorm) is not FP8RMSNorm
    for args, error, match in [((200,), ValueError, "hidden_size"), ((256, -1.0), ValueError, "eps"),
                               ((256, 1e-6, "tensor"), ValueError, "recipe"),
                               ((256, 1e-6, "block", torch.int8), TypeError, "dtype")]:
        with pytest.raises(error, match=match):
            FP8RMSNorm(*args)
    norm = FP8RMSNorm(256, device=DEVICE)
    with pytest.raises(ValueError, match="does not take 'block' activations of width 256"):
        norm.link([tnn.FP8Linear(128, 256, recipe="block", device=DEVICE)])
    with pytest.raises(TypeError, match="takes bfloat16, float16 or float32"):
        norm(torch.zeros(2, 256, device=DEVICE, dtype=torch.float64))
    with pytest.raises(ValueError, match="last dimension must be in_features = 256"):
        norm(torch.zeros(2, 128, device=DEVICE, dtype=HALF))


# (config, model, extra config, norms fused in its 2 layers): Qwen3-MoE's MLP is a block of
# experts (only the attention's norm feeds FP8 layers it links); Gemma2's norm is (1 + weight) in
# float32 and OLMo2's its own formula, so theirs stay.
FAMILIES = [("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 64}, 4),
            ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
             {"head_dim": 64, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 256}, 2),
            ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 64}, 0),
            ("Olmo2Config", "Olmo2ForCausalLM", {"eos_token_id": 2, "pad_token_id": 0}, 0)]


@pytest.mark.parametrize("config_name,model_name,extra,fused_norms", FAMILIES, ids=[f[1] for f in FAMILIES])
def test_transformers_families(config_name, model_name, extra, fused_norms, seeded):
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, model_name):
        pytest.skip(f"transformers {transformers.__version__} has no {model_name}")
    config = getattr(transformers, config_name)(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                                num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                                                max_position_embeddings=128, **extra)
    base = getattr(transformers, model_name)(config).to(device=DEVICE, dtype=HALF).eval()
    plain = tnn.convert(copy.deepcopy(base), fuse_qkv=True)
    fused = tnn.convert(base, fuse_qkv=True, fuse_norms=True)
    assert sum(isinstance(m, FP8RMSNorm) for m in fused.modules()) == fused_norms
    ids = torch.tensor([[1, 17, 42, 99, 7]], device=DEVICE)
    with torch.no_grad():
        assert rel_err(fused(ids).logits, plain(ids).logits) < 1e-2


def test_compile_traces_no_quantizer_for_linked_layers(seeded):
    """torch.compile(fullgraph=True) of the block with every fusion: the graph holds the two norm
    kernels and no standalone quantizer (the hand-off is resolved while tracing), runs to the
    eager result, and leaves no hand-off held."""
    block = tnn.convert(Block(), skip=(), fuse_qkv=True, fuse_gate_up=True, fuse_norms=True)
    x = torch.randn(3, 256, device=DEVICE, dtype=HALF)
    with torch.no_grad():
        want = block(x)
    out, code = traced(block, x)
    assert torch.equal(out, want)
    assert code.count("tmagemm_nn.rms_norm_quantize_activation(") == 2, code
    assert "tmagemm_nn.quantize_activation(" not in code and "tmagemm_nn.block_linear(" not in code, code
    assert not any(norm.handoff.holding() for norm in (block.input_layernorm, block.post_attention_layernorm))


def test_llama_checkpoint_loads_with_fused_norms_and_warms_them_up(tmp_path, seeded):
    base = tiny_llama(layers=2, hidden=256, intermediate=512, vocab=300)
    model = tnn.convert(copy.deepcopy(base), fuse_qkv=True, fuse_gate_up=True, fuse_norms=True)
    single = tnn.convert(base, fuse_qkv=True, fuse_gate_up=True)  # transformers' norms
    layer = model.model.layers[1]
    assert type(layer.input_layernorm) is FP8RMSNorm and layer.self_attn.q_proj.input_norm is layer.input_layernorm
    assert list(model.state_dict()) == list(single.state_dict())
    tnn.save_fp8_checkpoint(model, tmp_path)
    ids = torch.tensor([[1, 17, 42, 99, 7]], device=DEVICE)
    with torch.no_grad():
        want = single(ids).logits
        assert rel_err(model(ids).logits, want) < 1e-2
        loaded = tnn.from_pretrained_fp8(tmp_path, device=DEVICE, dtype=HALF, fuse_norms=True)
        norm = loaded.model.layers[0].post_attention_layernorm
        assert type(norm) is FP8RMSNorm and norm.consumers == 2  # gate_proj and up_proj, unfused here
        assert torch.equal(norm.weight, model.model.layers[0].post_attention_layernorm.weight)
        # (against the same build without fused norms: a model built from the config in half
        # precision computes its rotary tables otherwise than the converted one)
        layered = tnn.from_pretrained_fp8(tmp_path, device=DEVICE, dtype=HALF)
        assert rel_err(loaded(ids).logits, layered(ids).logits) < 1e-2
    keys = [key for key in _layers(model) if key[0] == "norm"]
    assert keys == [("norm", 256, "block", HALF, layer.input_layernorm.weight.device)]
    summary = tnn.warmup(model, dtype=HALF, m_values=[1, 3], progress=False)
    assert summary.calls == 2 * len(_layers(model))
    assert all(not m.handoff.holding() for m in model.modules() if isinstance(m, FP8RMSNorm))


@pytest.mark.gpu
def test_gpu_llama_fused_norms_graph_replays_match_eager(seeded, monkeypatch):
    """Every fusion on a bf16 Llama in a CUDA graph (cudagraphs back end) gives eager's logits bit
    for bit, step after step; the logits stay within 2% of the model whose norms are
    transformers' own."""
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 16)
    base = tiny_llama(layers=2, hidden=256, intermediate=512, vocab=1000)
    plain = tnn.convert(copy.deepcopy(base), fuse_gate_up=True, fuse_qkv=True)
    model = tnn.convert(base, fuse_gate_up=True, fuse_qkv=True, fuse_norms=True)

    def close_to_plain(ids, eager):
        assert rel_err(eager, plain(ids, use_cache=False).logits) < 2e-2

    assert_graph_replays_match_eager(model, close_to_plain)
