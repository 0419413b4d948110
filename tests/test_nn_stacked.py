"""tmagemm.nn.stacked: an attention's q/k/v projections as one stacked GEMM (CPU under the
interpreter, and on the GPU), against the layers converted one by one and the float64 emulation."""

from __future__ import annotations

import copy

import pytest
import torch

import tmagemm.nn as tnn
import tmagemm.nn.linear as linear_module
from test_nn import CUDA, DEVICE, HALF, emulate, fp8_equal, rel_err, tiny_llama, traced
from tmagemm.nn.stacked import FP8StackedLinear, FP8StackMember, calls_on_one_input, stack_reason
from tmagemm.nn.warmup import _layers


class Attention(torch.nn.Module):
    """The calls of transformers' attention forward: q, k, v on the same hidden states."""

    def __init__(self, hidden=256, kv=128, bias=False, dtype=HALF, device=DEVICE):
        super().__init__()
        self.q_proj = torch.nn.Linear(hidden, hidden, bias=bias, dtype=dtype, device=device)
        self.k_proj = torch.nn.Linear(hidden, kv, bias=bias, dtype=dtype, device=device)
        self.v_proj = torch.nn.Linear(hidden, kv, bias=bias, dtype=dtype, device=device)

    def forward(self, hidden_states):
        query = self.q_proj(hidden_states)
        key = self.k_proj(hidden_states)
        value = self.v_proj(hidden_states)
        return query, key, value


class ValueFirst(Attention):
    def forward(self, hidden_states):
        value = self.v_proj(hidden_states)
        return self.q_proj(hidden_states), self.k_proj(hidden_states), value


class Reassigned(Attention):
    def forward(self, hidden_states):
        query = self.q_proj(hidden_states)
        hidden_states = hidden_states * 2
        return query, self.k_proj(hidden_states), self.v_proj(hidden_states)


def stacked(module, recipe="block"):
    return tnn.convert(module, recipe=recipe, skip=(), fuse_qkv=True)


@pytest.fixture
def count_own_gemms(monkeypatch):
    """The FP8 layers' GEMMs (their scaled_mm and, block recipe, block_linear calls, a stack's
    included) made since the fixture."""
    calls = []
    real, real_linear = linear_module.scaled_mm, linear_module.linear_ops

    class LinearOps:
        def block_linear(self, *args):
            calls.append(1)
            return real_linear().block_linear(*args)

    monkeypatch.setattr(linear_module, "scaled_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(linear_module, "linear_ops", LinearOps)
    return calls


@pytest.mark.parametrize("recipe,bias", [("block", False), ("row", False), ("block", True)])
@pytest.mark.parametrize("lead", [(1,), (17,), (2, 9)])
def test_stack_matches_emulation_with_one_gemm(recipe, bias, lead, seeded, count_own_gemms):
    """One stacked GEMM serves all three projections; each output matches the float64 emulation
    of its own layer (bias included: Qwen2's q/k/v have one), and the separately converted
    layers' outputs."""
    module = Attention(bias=bias)
    if bias:
        for layer in (module.q_proj, module.k_proj, module.v_proj):
            torch.nn.init.normal_(layer.bias)
    single = tnn.convert(copy.deepcopy(module), recipe=recipe, skip=())
    fused = stacked(module, recipe)
    assert [type(fused.q_proj), type(fused.k_proj), type(fused.v_proj)] == [FP8StackedLinear, FP8StackMember,
                                                                            FP8StackMember]
    x = torch.randn(*lead, 256, device=DEVICE, dtype=HALF) * 3
    with torch.no_grad():
        want = single(x)
        del count_own_gemms[:]
        got = fused(x)
        assert len(count_own_gemms) == 1, "not one GEMM for the stack (a member ran its own)"
        assert not fused.q_proj.handoff.holding()  # every member served: nothing held
    for g, w, layer in zip(got, want, (single.q_proj, single.k_proj, single.v_proj)):
        assert g.shape == (*lead, layer.out_features) and g.dtype == HALF
        assert rel_err(g, emulate(layer, x)) < 1e-2
        assert rel_err(g, w) < 1e-2


def test_members_compute_their_own_for_other_inputs(seeded, count_own_gemms):
    """A member returns the stack's rows only for the very tensor the first layer saw, unchanged,
    once: another tensor, an in-place change, or a second call run its own GEMM."""
    fused = stacked(Attention())
    single = tnn.convert(Attention(), skip=())
    single.load_state_dict(fused.state_dict())
    x, other = (torch.randn(5, 256, device=DEVICE, dtype=HALF) for _ in range(2))
    with torch.no_grad():
        fused.q_proj(x)
        del count_own_gemms[:]
        assert rel_err(fused.k_proj(other), single.k_proj(other)) < 1e-2
        assert len(count_own_gemms) == 2  # fused.k_proj and single.k_proj
        assert rel_err(fused.k_proj(x), single.k_proj(x)) < 1e-2  # the stack's rows
        assert len(count_own_gemms) == 3
        assert rel_err(fused.k_proj(x), single.k_proj(x)) < 1e-2  # taken already: its own GEMM
        assert len(count_own_gemms) == 5
        x.mul_(-2)
        assert rel_err(fused.v_proj(x), emulate(single.v_proj, x)) < 1e-2  # changed in place since
        assert len(count_own_gemms) == 6


@pytest.mark.parametrize("bias", [False, True])
def test_moves_casts_and_state_dict_loads_keep_the_views(bias, seeded):
    fused = stacked(Attention(bias=bias))
    first = fused.q_proj
    fused.half().to(torch.float32)
    assert first.stacked_weight.dtype == torch.float8_e4m3fn and first.tied()
    assert fused.k_proj.weight.dtype == torch.float8_e4m3fn and fused.k_proj.weight_scale_inv.dtype == torch.float32
    if bias:  # the biases are cast with the model, still views of the stacked bias
        assert first.stacked_bias.dtype == torch.float32 and fused.v_proj.bias.dtype == torch.float32
        fused.to(HALF)
    # Loading the layers converted one by one writes through the views into the stacked buffers.
    single = tnn.convert(Attention(bias=bias), skip=())
    fused.load_state_dict(single.state_dict())
    assert first.tied()
    assert fp8_equal(first.stacked_weight, torch.cat([single.q_proj.weight, single.k_proj.weight,
                                                     single.v_proj.weight]))
    # assign=True replaces the tensors: the parent's hook rebuilds the stack from them.
    if bias:
        assert torch.equal(first.stacked_bias, torch.cat([single.q_proj.bias, single.k_proj.bias,
                                                          single.v_proj.bias]))
    other = tnn.convert(Attention(bias=bias), skip=())
    fused.load_state_dict(other.state_dict(), assign=True)
    assert first.tied() and fp8_equal(fused.v_proj.weight, other.v_proj.weight)
    assert set(fused.state_dict()) == set(single.state_dict())
    x = torch.randn(3, 256, device=DEVICE, dtype=HALF)
    with torch.no_grad():
        for got, want in zip(fused(x), other(x)):
            assert rel_err(got, want) < 1e-2


def test_refusals():
    assert calls_on_one_input(Attention) and not calls_on_one_input(ValueFirst)
    assert not calls_on_one_input(Reassigned)
    assert "in order on one input" in stack_reason(ValueFirst())
    assert stack_reason(Attention(bias=True)) is None
    mixed = Attention()
    mixed.k_proj = torch.nn.Linear(256, 128, dtype=HALF, device=DEVICE)
    assert "biases differ" in stack_reason(mixed)
    assert "multiples of 128" in stack_reason(Attention(kv=64))
    assert stack_reason(Attention(kv=64), recipe="row") is None
    assert "only 'block' and 'row'" in stack_reason(Attention(), recipe="tensor")
    for module in (ValueFirst(), mixed, Attention(kv=64)):
        converted = stacked(module)  # converted one by one instead
        assert type(converted.k_proj) is tnn.FP8Linear
    with pytest.raises(ValueError, match="fuse_qkv=True needs recipe='block' or 'row'"):
        tnn.convert(Attention(), recipe="tensor", fuse_qkv=True)
    with pytest.raises(TypeError, match="fuse_qkv must be a bool"):
        tnn.convert(Attention(), fuse_qkv=1)
    with pytest.raises(TypeError, match="stack"):
        FP8StackedLinear.from_linear(torch.nn.Linear(256, 256))
    kept = tnn.convert(Attention(), skip=("k_proj",), fuse_qkv=True)  # a skipped projection: no stack
    assert type(kept.q_proj) is tnn.FP8Linear and type(kept.k_proj) is torch.nn.Linear


def test_compile_traces_one_gemm_for_the_stack(seeded):
    """torch.compile(fullgraph=True): the traced graph holds one GEMM for q/k/v (the block
    recipe's block_linear op; the members' hand-off is resolved while tracing), and runs to the
    eager result."""
    fused = stacked(Attention())
    x = torch.randn(4, 256, device=DEVICE, dtype=HALF)
    with torch.no_grad():
        want = fused(x)
    out, code = traced(fused, x)
    for got, w in zip(out, want):
        assert torch.equal(got, w)
    assert code.count("tmagemm_nn.block_linear") == 1 and "tmagemm.scaled_mm" not in code, code
    assert not fused.q_proj.handoff.holding()


def test_llama_checkpoint_round_trip_and_warmup_layers(tmp_path, seeded):
    """A Llama converted with stacked attention projections saves the Hugging Face layout (the
    state dict of the layers converted one by one), loads back stacked or not (the same logits
    up to the GEMMs' summation order), and warm-up runs the stack, not its members."""
    base = tiny_llama(layers=2, hidden=256, intermediate=512, vocab=300)
    model = tnn.convert(copy.deepcopy(base), fuse_qkv=True)
    attn = model.model.layers[0].self_attn
    assert type(attn.q_proj) is FP8StackedLinear and type(attn.v_proj) is FP8StackMember
    single = tnn.convert(base).state_dict()
    saved = model.state_dict()
    assert list(saved) == list(single) and all(fp8_equal(saved[k], single[k]) for k in saved)
    tnn.save_fp8_checkpoint(model, tmp_path)
    ids = torch.tensor([[1, 17, 42, 99, 7]], device=DEVICE)
    logits = {}
    with torch.no_grad():
        for fuse in (False, True):
            loaded = tnn.load_fp8_checkpoint(model.config, tmp_path, device=DEVICE, dtype=HALF, fuse_qkv=fuse)
            assert (type(loaded.model.layers[1].self_attn.k_proj) is FP8StackMember) == fuse
            state = loaded.state_dict()
            assert all(fp8_equal(state[k], saved[k]) for k in saved)
            logits[fuse] = loaded(ids).logits
    assert torch.equal(logits[True], logits[False]) if not CUDA else rel_err(logits[True], logits[False]) < 1e-2
    kinds = [key[0] for key in _layers(model)]
    assert kinds.count("stack") == 1 and all(type(m) is not FP8StackMember for m in _layers(model).values())


@pytest.mark.gpu
def test_gpu_llama_stacked_graphs_match_eager(seeded, monkeypatch):
    """The stacked and fused Llama in a CUDA graph (cudagraphs back end: eager's kernels replayed)
    gives eager's logits bit for bit; its stacked projections match the layers converted one by
    one (the same fp8 products, summed in another order) on the model's own hidden states."""
    torch.compiler.reset()
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 16)
    base = tiny_llama(layers=2, hidden=256, intermediate=512, vocab=1000)
    model = tnn.convert(copy.deepcopy(base), fuse_gate_up=True, fuse_qkv=True)
    single = tnn.convert(base).model.layers[1].self_attn
    compiled = torch.compile(model, fullgraph=True, backend="cudagraphs", dynamic=False)
    ids = torch.tensor([[1, 17, 42, 99, 7, 3, 250, 11]], device="cuda")
    with torch.no_grad():
        for _ in range(3):
            out = model(ids, use_cache=False, output_hidden_states=True)
            eager = out.logits
            assert torch.equal(compiled(ids, use_cache=False).logits.clone(), eager)
            attn = model.model.layers[1].self_attn
            h = model.model.layers[1].input_layernorm(out.hidden_states[1])
            got = (attn.q_proj(h), attn.k_proj(h), attn.v_proj(h))
            for g, layer in zip(got, (single.q_proj, single.k_proj, single.v_proj)):
                assert rel_err(g, layer(h)) < 1e-2 and rel_err(g, emulate(layer, h)) < 1e-2
            ids = torch.cat([ids, eager[:, -1].argmax(-1, keepdim=True)], dim=1)


def test_qwen2_biased_projections_stack_and_round_trip(tmp_path, seeded):
    """Qwen2's q/k/v carry biases: stacked with them (a stacked bias the GEMM adds), each bias a
    view saved under its HF name, checkpoints loading stacked or not."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                                      max_position_embeddings=128)
    torch.manual_seed(0)
    base = transformers.Qwen2ForCausalLM(config).to(device=DEVICE, dtype=HALF).eval()
    for layer in base.model.layers:
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            torch.nn.init.normal_(proj.bias, std=0.5)  # transformers initialises them to zero
    model = tnn.convert(copy.deepcopy(base), fuse_qkv=True)
    single = tnn.convert(base)
    attn = model.model.layers[1].self_attn
    assert type(attn.q_proj) is FP8StackedLinear and attn.q_proj.stacked_bias is not None
    ids = torch.tensor([[1, 17, 42, 99, 7]], device=DEVICE)
    with torch.no_grad():
        want = single(ids).logits
        assert rel_err(model(ids).logits, want) < 2e-2
        tnn.save_fp8_checkpoint(model, tmp_path)
        loaded = tnn.load_fp8_checkpoint(model.config, tmp_path, device=DEVICE, dtype=HALF, fuse_qkv=True)
        state, saved = loaded.state_dict(), model.state_dict()
        assert set(state) == set(saved) and all(fp8_equal(state[k], saved[k]) for k in saved)
        assert loaded.model.layers[0].self_attn.q_proj.tied()
        assert rel_err(loaded(ids).logits, want) < 2e-2


class ValueRegisteredFirst(Attention):
    """Children registered v, k, q (so ``.to()`` reaches the members before the first layer)."""

    def __init__(self):
        torch.nn.Module.__init__(self)
        self.v_proj = torch.nn.Linear(256, 128, bias=True, dtype=HALF, device=DEVICE)
        self.k_proj = torch.nn.Linear(256, 128, bias=True, dtype=HALF, device=DEVICE)
        self.q_proj = torch.nn.Linear(256, 256, bias=True, dtype=HALF, device=DEVICE)


def test_casts_in_any_child_order_and_deepcopy(seeded):
    fused = stacked(ValueRegisteredFirst())
    assert type(fused.q_proj) is FP8StackedLinear
    fused.float()
    assert fused.q_proj.tied() and fused.v_proj.bias.dtype == torch.float32
    twin = copy.deepcopy(fused)
    assert twin.q_proj.tied() and twin.k_proj.first is twin.q_proj
    assert twin.q_proj.stacked_weight.data_ptr() != fused.q_proj.stacked_weight.data_ptr()
    with torch.no_grad():
        twin.v_proj.bias.add_(1)  # writes through the view into the copy's stacked bias only
    assert torch.equal(twin.q_proj.stacked_bias[-128:], fused.q_proj.stacked_bias[-128:] + 1)
    x = torch.randn(3, 256, device=DEVICE, dtype=torch.float32)
    with torch.no_grad():
        (q, k, v), (q0, k0, v0) = twin(x), fused(x)
    assert torch.equal(q, q0) and torch.equal(k, k0) and v.dtype == torch.float32
    torch.testing.assert_close(v, v0 + 1, rtol=0, atol=1e-5)  # only the copy's v bias moved
