"""tmagemm.nn.FP8Experts (a Mixture-of-Experts layer's experts on grouped GEMMs) and its
SiLU-and-multiply quantizer: the kernel against torch bit for bit, the layer against a float64
emulation of its steps (routing edge cases: empty experts, one expert taking every token,
expert-parallel sentinels, no tokens), convert and the hub's per-expert checkpoint layout on tiny
transformers MoE models, refusals, torch.compile; marked gpu: CUDA graphs with routing that
changes between replays, larger layers in bf16.

CPU tests run the kernels under the Triton interpreter in float16 (its bf16 is not exact).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_nn import emulate_activation
from torch import nn

import tmagemm.nn as tnn
from tmagemm.nn.experts import FP8Experts, convert_experts, experts_reason
from tmagemm.nn.quantize import FP8
from tmagemm.quant import quantize_fp8
from tmagemm.triton.moe_permute import ROUTE_MAX_PAIRS, combine_pairs, quantize_pairs, route_pairs
from tmagemm.triton.silu_mul_quantize import silu_mul_quantize

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
HALF = torch.bfloat16 if CUDA else torch.float16  # the interpreter's bf16 rounding is not torch's


class SyntheticExperts(nn.Module):
    """transformers' experts contract (3-D gate/up and down weights, the flags
    ``use_experts_implementation`` sets, a SiLU act_fn) without transformers."""

    has_gate, has_bias, is_transposed, is_concatenated = True, False, False, True

    def __init__(self, e, h, i, dtype=torch.float32, device=DEVICE):
        super().__init__()
        self.num_experts = e
        self.gate_up_proj = nn.Parameter(torch.randn(e, 2 * i, h, device=device, dtype=dtype) / h**0.5)
        self.down_proj = nn.Parameter(torch.randn(e, h, i, device=device, dtype=dtype) / i**0.5)
        self.act_fn = nn.SiLU()


def reference(layer: FP8Experts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The layer's steps in float64 on the CPU: x quantized as the layer quantizes it, each
    (token, expert) pair's gate/up product rounded to x's dtype, SiLU * up rounded as torch rounds
    it and quantized per row / 1x128 group, the down product times the routing weight, summed per
    token; pairs with an id outside 0..E-1 add nothing."""
    x, ids, weights = x.cpu(), ids.cpu(), weights.cpu().double()
    xd = emulate_activation(x, layer.recipe)
    out = torch.zeros(x.shape[0], layer.hidden_size, dtype=torch.float64)
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if not 0 <= e < layer.num_experts:
                continue
            gate_up = (xd[t] @ layer.dequantized(e, "gate_up_proj", torch.float64).cpu().t()).to(x.dtype)
            gate, up = gate_up.chunk(2)
            act = (F.silu(gate.float()).to(x.dtype).float() * up.float()).to(x.dtype)
            a = emulate_activation(act[None], layer.recipe)[0]
            out[t] += weights[t, j] * (a @ layer.dequantized(e, "down_proj", torch.float64).cpu().t())
    return out


def check(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    """Frobenius error within 3% and every token's row within 6% of its norm. The emulation is
    exact up to the GEMMs' summation order, but that order can round a gate/up output to the
    next 16-bit value; where it is a row's amax (one scale per row, recipe "row"), every fp8 value
    of that row may move by one step (2^-4 relative): about 1.5% on a bf16 row (H100). A token
    sent to a wrong expert, weighted wrongly or dropped is off by 30% or more."""
    got = got.detach().double().cpu()
    assert got.shape == want.shape, what
    assert bool(torch.isfinite(got).all()), f"{what}: non-finite output"
    scale = want.norm().clamp(min=1e-30)
    assert float((got - want).norm() / scale) < 3e-2, f"{what}: relative error {float((got - want).norm() / scale)}"
    rows = (got - want).norm(dim=1) / want.norm(dim=1).clamp(min=float(scale) / want.shape[0] ** 0.5)
    assert float(rows.max()) < 6e-2, f"{what}: worst token row off by {float(rows.max())} of its norm"


def routing(tokens: int, top_k: int, e: int, dtype=HALF):
    """Distinct expert ids per token and softmax-like positive weights."""
    ids = torch.stack([torch.randperm(e)[:top_k] for _ in range(tokens)]) if tokens else \
        torch.empty(0, top_k, dtype=torch.long)
    weights = torch.rand(tokens, top_k).softmax(-1).to(dtype)
    return ids.to(DEVICE), weights.to(DEVICE)


def make_layer(e, h, i, recipe, seeded_dtype=torch.float32):
    return FP8Experts.from_experts(SyntheticExperts(e, h, i, seeded_dtype), recipe)


# ------------------------------------------------------------------------------ the kernel


@pytest.mark.anydevice
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32] + ([torch.bfloat16] if CUDA else []),
                         ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("recipe", ["1x128", "row"])
@pytest.mark.parametrize("rows, inner", [(1, 128), (17, 200), (33, 272), (0, 128)])
@pytest.mark.parametrize("with_row_scale", [False, True], ids=["", "row_scale"])
def test_silu_mul_quantize_matches_torch(dtype, recipe, rows, inner, with_row_scale, seeded):
    """q bit for bit and the scales of quantize_fp8(silu(gate) * up) computed by torch in h's
    dtype (row_scale multiplies the scales, never q); ragged I (200, 272), a row, no rows."""
    h = (torch.randn(rows, 2 * inner, device=DEVICE) * 3).to(dtype)
    row_scale = torch.rand(rows, device=DEVICE) + 0.5 if with_row_scale else None
    q, scale = silu_mul_quantize(h, recipe, row_scale)
    gate, up = h.chunk(2, dim=-1)
    want_q, want_scale = quantize_fp8(F.silu(gate) * up, recipe)
    if row_scale is not None:
        want_scale = want_scale * row_scale[:, None]
    assert q.shape == (rows, inner) and q.dtype == FP8 and scale.shape == want_scale.shape
    same = q.view(torch.uint8) == want_q.view(torch.uint8)
    if dtype == torch.bfloat16:
        # The GPU's exp may differ from torch's by an ulp of fp32, which can move a bf16 rounding.
        assert float(same.float().mean()) > 0.999 if rows else True
        torch.testing.assert_close(scale, want_scale, rtol=2**-7, atol=0)
    else:
        assert bool(same.all()), f"{int((~same).sum())} of {same.numel()} fp8 values differ"
        torch.testing.assert_close(scale, want_scale, rtol=2**-22, atol=0)


@pytest.mark.anydevice
def test_silu_mul_quantize_gathers_the_row_scale(seeded):
    """row_scale_index: row r's scales times row_scale[index[r]] (an MoE pair's routing weight)."""
    h = torch.randn(9, 512, device=DEVICE).to(HALF)
    weights = torch.rand(12, device=DEVICE).to(HALF)
    index = torch.randperm(12, device=DEVICE)[:9]
    q, scale = silu_mul_quantize(h, "1x128", weights, index)
    q0, scale0 = silu_mul_quantize(h, "1x128")
    assert torch.equal(q.view(torch.uint8), q0.view(torch.uint8))
    torch.testing.assert_close(scale, scale0 * weights[index].float()[:, None], rtol=2**-22, atol=0)
    with pytest.raises(ValueError, match="row_scale_index needs a row_scale"):
        silu_mul_quantize(h, "1x128", None, index)
    with pytest.raises(ValueError, match="row_scale_index"):
        silu_mul_quantize(h, "1x128", weights, index[:4])


@pytest.mark.anydevice
@pytest.mark.parametrize("recipe", ["1x128", "row"])
@pytest.mark.parametrize("tokens, top_k, k", [(1, 2, 128), (17, 3, 272), (0, 2, 128)])
def test_quantize_pairs_is_the_quantizer_in_expert_order(recipe, tokens, top_k, k, seeded):
    """Row r is token order[r] // top_k quantized bit for bit as quantize_fp8 does; pos is the
    inverse of order."""
    x = (torch.randn(tokens, k, device=DEVICE) * 4).to(HALF)
    order = torch.randperm(tokens * top_k, device=DEVICE)
    q, scale, pos = quantize_pairs(x, order, top_k, recipe)
    want_q, want_scale = quantize_fp8(x, recipe)
    rows = order // top_k
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)[rows])
    assert torch.equal(scale, want_scale[rows])
    assert pos.dtype == torch.int32 and torch.equal(order[pos.long()], torch.arange(tokens * top_k, device=DEVICE))


@pytest.mark.anydevice
@pytest.mark.parametrize("dtype", [HALF, torch.float32], ids=["half", "fp32"])
def test_combine_pairs_sums_each_tokens_pairs(dtype, seeded):
    """out[t] = sum_j y[pos[t*k + j]] in fp32, pairs at rows >= valid_rows left out (their rows
    hold NaN here: never read); N off the block width."""
    tokens, top_k, n = 13, 3, 1100
    y = torch.randn(tokens * top_k, n, device=DEVICE).to(dtype)
    pos = torch.randperm(tokens * top_k, device=DEVICE).to(torch.int32)
    valid = torch.tensor([30], dtype=torch.int32, device=DEVICE)
    y[30:] = float("nan")
    got = combine_pairs(y, pos, valid, top_k)
    rows = y.double()[pos.long()].view(tokens, top_k, n)
    keep = (pos.long() < 30).view(tokens, top_k, 1)
    want = torch.where(keep, rows, 0.0).sum(dim=1)
    assert got.dtype == dtype and bool(torch.isfinite(got).all())
    torch.testing.assert_close(got.double(), want, rtol=2**-7 if dtype != torch.float32 else 1e-6, atol=1e-6)
    assert combine_pairs(y[:0], pos[:0], valid, top_k).shape == (0, n)


@pytest.mark.anydevice
@pytest.mark.parametrize("tokens, top_k, e", [(1, 8, 64), (5, 2, 4), (33, 8, 256), (128, 8, 16), (300, 3, 130)])
def test_route_pairs_is_a_stable_sort_by_expert(tokens, top_k, e, seeded):
    """order and offs as torch.sort(stable) and searchsorted give them, sentinels (E, E + 5, -1)
    last and in no group; repeated ids keep pair order."""
    ids = torch.randint(0, e, (tokens, top_k), device=DEVICE)
    ids.view(-1)[::7] = e
    ids.view(-1)[3::11] = -1
    ids.view(-1)[5::13] = e + 5
    for dtype in (torch.int64, torch.int32):
        order, offs = route_pairs(ids.to(dtype), e)
        keyed = torch.where((ids >= 0) & (ids < e), ids, e).reshape(-1)
        want_sorted, want_order = torch.sort(keyed, stable=True)
        assert torch.equal(order, want_order)
        assert torch.equal(offs.long(), torch.searchsorted(want_sorted, torch.arange(e, device=DEVICE), right=True))
        assert offs.dtype == torch.int32 and order.dtype == torch.int64


def test_experts_sort_past_the_routing_kernels_bound(seeded):
    """Past ROUTE_MAX_PAIRS pairs the layer sorts with torch: the same output as the emulation."""
    layer = make_layer(3, 128, 128, "row")
    tokens = ROUTE_MAX_PAIRS // 2 + 5
    x = torch.randn(tokens, 128, device=DEVICE).to(HALF)
    ids, weights = routing(tokens, 2, 3)
    ids[::9, 1] = -1
    check(layer(x, ids, weights), reference(layer, x, ids, weights), "sorted by torch")
    with pytest.raises(ValueError, match="ranks at most"):
        route_pairs(torch.zeros(ROUTE_MAX_PAIRS + 1, 1, dtype=torch.long), 4)


def test_permute_refusals():
    x = torch.randn(4, 128, dtype=torch.float16)
    order = torch.arange(8)
    with pytest.raises(ValueError, match="order has 7 pairs"):
        quantize_pairs(x, order[:7], 2)
    with pytest.raises(TypeError, match="order must be a 1-D int32/int64"):
        quantize_pairs(x, order.float(), 2)
    with pytest.raises(ValueError, match="top_k must be a positive int"):
        quantize_pairs(x, order, 0)
    with pytest.raises(ValueError, match="recipe"):
        quantize_pairs(x, order, 2, "tensor")
    y = torch.randn(8, 128, dtype=torch.float16)
    valid = torch.tensor([8], dtype=torch.int32)
    with pytest.raises(TypeError, match="pos must be an int32"):
        combine_pairs(y, order, valid, 2)
    with pytest.raises(ValueError, match="a multiple of top_k 3"):
        combine_pairs(y, order.int(), valid, 3)
    with pytest.raises(TypeError, match="y must be a 2-D"):
        combine_pairs(y.int(), order.int(), valid, 2)


def test_silu_mul_quantize_refusals():
    h = torch.randn(4, 256, dtype=torch.float16)
    with pytest.raises(ValueError, match="even number of columns"):
        silu_mul_quantize(h[:, :255].contiguous())
    with pytest.raises(ValueError, match="recipe"):
        silu_mul_quantize(h, "tensor")
    with pytest.raises(ValueError, match=r"row_scale has shape \(3,\)"):
        silu_mul_quantize(h, "1x128", torch.ones(3))
    with pytest.raises(TypeError, match="row_scale"):
        silu_mul_quantize(h, "1x128", torch.ones(4, dtype=torch.int32))
    with pytest.raises(TypeError, match="h must be float16"):
        silu_mul_quantize(h.to(torch.int32))
    with pytest.raises(ValueError, match="contiguous last dimension"):
        silu_mul_quantize(h.t())


# ------------------------------------------------------------------------------ the layer


@pytest.mark.anydevice
@pytest.mark.parametrize("recipe, h, i", [("block", 272, 256), ("row", 272, 208)], ids=["block", "row"])
@pytest.mark.parametrize("tokens, top_k", [(1, 2), (17, 2), (33, 1)])
def test_experts_match_float64(recipe, h, i, tokens, top_k, seeded):
    """Random routing over 5 experts (some empty at few tokens); H off the 128 blocks."""
    layer = make_layer(5, h, i, recipe)
    x = torch.randn(tokens, h, device=DEVICE).to(HALF)
    ids, weights = routing(tokens, top_k, 5)
    y = layer(x, ids, weights)
    assert y.dtype == HALF
    check(y, reference(layer, x, ids, weights), f"{recipe} T={tokens} k={top_k}")


@pytest.mark.anydevice
@pytest.mark.parametrize("case", ["one_expert_takes_all", "sentinels", "repeated_expert", "int32_ids", "fp32_input"])
def test_experts_routing_edge_cases(case, seeded):
    e, h, i, tokens = 4, 256, 128, 19
    layer = make_layer(e, h, i, "block")
    x = torch.randn(tokens, h, device=DEVICE).to(torch.float32 if case == "fp32_input" else HALF)
    ids, weights = routing(tokens, 2, e, x.dtype)
    if case == "one_expert_takes_all":
        ids = torch.full_like(ids, 2)
        ids[:, 1] = torch.randint(0, 2, (tokens,))  # experts 0-1 get some, 3 none
    elif case == "sentinels":  # expert-parallel sentinels (E and -1) add nothing
        ids[::3, 0] = e
        ids[1::4, 1] = -1
        ids[5] = torch.tensor([e + 7, -3])
    elif case == "repeated_expert":
        ids[:, 1] = ids[:, 0]
    elif case == "int32_ids":
        ids = ids.to(torch.int32)
    y = layer(x, ids, weights)
    assert y.dtype == x.dtype
    check(y, reference(layer, x, ids, weights), case)
    if case == "sentinels":
        assert float(y[5].abs().max()) == 0.0


def test_experts_without_tokens():
    layer = make_layer(3, 128, 128, "row")
    y = layer(torch.empty(0, 128, device=DEVICE, dtype=HALF), torch.empty(0, 2, dtype=torch.long, device=DEVICE),
              torch.empty(0, 2, device=DEVICE, dtype=HALF))
    assert y.shape == (0, 128) and y.dtype == HALF


def test_experts_input_errors():
    layer = FP8Experts(4, 128, 128, device=DEVICE)
    x = torch.zeros(3, 128, device=DEVICE, dtype=HALF)
    ids = torch.zeros(3, 2, dtype=torch.long, device=DEVICE)
    w = torch.zeros(3, 2, device=DEVICE, dtype=HALF)
    with pytest.raises(TypeError, match="hidden_states must be bfloat16"):
        layer(x.to(torch.int8), ids, w)
    with pytest.raises(ValueError, match=r"hidden_states has shape \(3, 64\)"):
        layer(x[:, :64], ids, w)
    with pytest.raises(TypeError, match="top_k_index must hold int32 or int64"):
        layer(x, ids.float(), w)
    with pytest.raises(TypeError, match="top_k_index must hold int32 or int64"):
        layer(x, ids.to(torch.int16), w)
    with pytest.raises(TypeError, match="top_k_weights must be floating"):
        layer(x, ids, ids)
    with pytest.raises(ValueError, match=r"top_k_index has shape \(2, 2\)"):
        layer(x, ids[:2], w[:2])
    with pytest.raises(ValueError, match="top_k_weights has shape"):
        layer(x, ids, w[:, :1])
    with pytest.raises(TypeError, match="hidden_states must be a torch.Tensor"):
        layer([0.0], ids, w)
    with pytest.raises(ValueError, match="intermediate_size = 208 is not a multiple of 128"):
        FP8Experts(4, 128, 208)
    with pytest.raises(ValueError, match="recipe must be 'block' or 'row'"):
        FP8Experts(4, 128, 128, "tensor")
    with pytest.raises(ValueError, match="hidden_size = 120 is not a multiple of 16"):
        FP8Experts(4, 120, 128, "row")
    with pytest.raises(ValueError, match="num_experts must be a positive int"):
        FP8Experts(0, 128, 128)


def test_experts_reason_refusals():
    good = SyntheticExperts(2, 128, 128, device="cpu")
    assert experts_reason(good) is None
    biased = SyntheticExperts(2, 128, 128, device="cpu")
    biased.has_bias = True
    assert "without bias" in experts_reason(biased)
    gelu = SyntheticExperts(2, 128, 128, device="cpu")
    gelu.act_fn = nn.GELU()
    assert "not SiLU" in experts_reason(gelu)
    assert "not a transformers experts module" in experts_reason(nn.Linear(4, 4))
    odd = SyntheticExperts(2, 128, 120, device="cpu")
    assert "multiples of 16" in experts_reason(odd)
    assert "already" in experts_reason(FP8Experts(2, 128, 128))
    with pytest.raises(TypeError, match="not SiLU"):
        FP8Experts.from_experts(gelu)
    # block: I must split into whole 128-row blocks; row takes it
    with pytest.raises(ValueError, match="intermediate_size = 208"):
        FP8Experts.from_experts(SyntheticExperts(2, 128, 208, device="cpu"), "block")
    assert FP8Experts.from_experts(SyntheticExperts(2, 128, 208, device="cpu"), "row").intermediate_size == 208
    # from_weights: the same layer from the two tensors alone
    direct = FP8Experts.from_weights(good.gate_up_proj, good.down_proj)
    assert torch.equal(direct.gate_up_proj.view(torch.uint8), FP8Experts.from_experts(good).gate_up_proj.view(torch.uint8))
    with pytest.raises(TypeError, match="must be torch.Tensors"):
        FP8Experts.from_weights(good.gate_up_proj, None)
    with pytest.raises(ValueError, match="shapes"):
        FP8Experts.from_weights(good.gate_up_proj, good.down_proj[:, :64])


def test_experts_state_dict_is_the_hub_layout(seeded):
    """Per-expert names and shapes of FP8 MoE checkpoints, views of the stacked buffers; loading
    writes through them; dtype and shape refusals; .to(dtype) keeps fp8 and fp32."""
    layer = make_layer(3, 256, 128, "block")
    sd = layer.state_dict()
    assert sorted(sd) == sorted(f"{g}.{p}.{s}" for g in range(3) for p in ("gate_proj", "up_proj", "down_proj")
                                for s in ("weight", "weight_scale_inv"))
    assert sd["1.gate_proj.weight"].shape == (128, 256) and sd["1.gate_proj.weight_scale_inv"].shape == (1, 2)
    assert sd["2.down_proj.weight"].shape == (256, 128) and sd["2.down_proj.weight_scale_inv"].shape == (2, 1)
    assert torch.equal(sd["1.up_proj.weight"].view(torch.uint8), layer.gate_up_proj[1, 128:].view(torch.uint8))
    other = FP8Experts(3, 256, 128, device=DEVICE)
    other.load_state_dict(sd)
    for name in ("gate_up_proj", "down_proj", "gate_up_proj_scale_inv", "down_proj_scale_inv"):
        a, b = getattr(layer, name), getattr(other, name)
        assert torch.equal(a.view(torch.uint8) if a.dtype == FP8 else a, b.view(torch.uint8) if b.dtype == FP8 else b)
    bad = dict(sd)
    bad["0.gate_proj.weight"] = bad["0.gate_proj.weight"].to(HALF)
    with pytest.raises(RuntimeError, match="float8_e4m3fn weights"):
        other.load_state_dict(bad)
    missing = {k: v for k, v in sd.items() if not k.startswith("2.")}
    with pytest.raises(RuntimeError, match="Missing key"):
        other.load_state_dict(missing)
    with pytest.raises(RuntimeError, match="Unexpected key"):
        other.load_state_dict({**sd, "3.gate_proj.weight": sd["0.gate_proj.weight"]})
    other.to(torch.float16)
    assert other.gate_up_proj.dtype == FP8 and other.down_proj_scale_inv.dtype == torch.float32


def _tiny_moe(model_name: str, **extra):
    transformers = pytest.importorskip("transformers")
    config_name = model_name.replace("ForCausalLM", "Config")
    if not hasattr(transformers, model_name):
        pytest.skip(f"transformers {transformers.__version__} has no {model_name}")
    shape = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 1, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 300, "head_dim": 64}
    config = getattr(transformers, config_name)(**{**shape, **extra})
    model = getattr(transformers, model_name)(config).to(DEVICE, HALF).eval()
    experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    if not experts or experts_reason(experts[0]) is not None:
        pytest.skip(f"transformers {transformers.__version__}'s {model_name} has no 3-D experts module")
    return model


MOE_MODELS = [("Qwen3MoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 256}),
              ("MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
              ("Qwen2MoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
                                       "shared_expert_intermediate_size": 256}),
              # DeepSeek-V3: MLA attention, a shared expert beside 4 routed ones, grouped routing
              ("DeepseekV3ForCausalLM", {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
                                         "n_shared_experts": 1, "first_k_dense_replace": 0, "n_group": 2,
                                         "topk_group": 1, "kv_lora_rank": 64, "q_lora_rank": 64,
                                         "qk_rope_head_dim": 32, "qk_nope_head_dim": 32, "v_head_dim": 64,
                                         "head_dim": 32})]


@pytest.mark.anydevice
@pytest.mark.parametrize("model_name, extra", MOE_MODELS, ids=[m[0] for m in MOE_MODELS])
def test_convert_moe_model_and_checkpoint(model_name, extra, tmp_path, seeded):
    """convert turns the experts into FP8Experts (their output as the emulation on the routing
    the model computes); logits near the 16-bit model's; the checkpoint holds the hub's
    per-expert names and reloads bit for bit into a model built from the config."""
    model = _tiny_moe(model_name, **extra)
    high = [m for m in model.modules() if type(m).__name__.endswith("Experts")][0]
    ids = torch.randint(0, 300, (1, 9), device=DEVICE)
    with torch.no_grad():
        want = model(ids).logits.double()
    x = torch.randn(6, 256, device=DEVICE, dtype=HALF)
    route, weights = routing(6, 2, 4)
    tnn.convert(model)
    experts = [m for m in model.modules() if isinstance(m, FP8Experts)]
    assert len(experts) == 1 and experts[0].num_experts == 4 and high not in list(model.modules())
    check(experts[0](x, route, weights), reference(experts[0], x, route, weights), model_name)
    with torch.no_grad():
        got = model(ids).logits.double()
    assert float((got - want).norm() / want.norm()) < 0.15
    path = tnn.save_fp8_checkpoint(model, tmp_path / "moe")
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert {f"model.layers.0.mlp.experts.{g}.{p}.{s}" for g in range(4) for p in ("gate_proj", "up_proj", "down_proj")
            for s in ("weight", "weight_scale_inv")} <= keys
    reloaded = tnn.from_pretrained_fp8(path, device=DEVICE, dtype=HALF)
    again = [m for m in reloaded.modules() if isinstance(m, FP8Experts)]
    assert len(again) == 1
    for name in ("gate_up_proj", "down_proj"):
        assert torch.equal(getattr(again[0], name).view(torch.uint8), getattr(experts[0], name).view(torch.uint8))
        assert torch.equal(getattr(again[0], name + "_scale_inv"), getattr(experts[0], name + "_scale_inv"))
    assert torch.equal(again[0](x, route, weights), experts[0](x, route, weights))
    # into a model already converted, too
    tnn.load_fp8_checkpoint(model, path)


def test_convert_experts_rules(seeded):
    """skip keeps an experts module; "tensor" keeps experts in high precision; "row" converts;
    a bare experts module converts to one; a checkpoint's recipe must match a converted model's."""
    model = _tiny_moe(MOE_MODELS[0][0], **MOE_MODELS[0][1])
    tnn.convert(model, skip=("lm_head", "experts"))
    assert not any(isinstance(m, FP8Experts) for m in model.modules())
    model = _tiny_moe(MOE_MODELS[0][0], **MOE_MODELS[0][1])
    tnn.convert(model, recipe="tensor")
    assert not any(isinstance(m, FP8Experts) for m in model.modules())
    model = _tiny_moe(MOE_MODELS[0][0], **MOE_MODELS[0][1])
    tnn.convert(model, recipe="row")
    assert [m.recipe for m in model.modules() if isinstance(m, FP8Experts)] == ["row"]
    bare = SyntheticExperts(2, 128, 128)
    assert isinstance(convert_experts(bare, "block"), FP8Experts)
    assert isinstance(tnn.convert(SyntheticExperts(2, 128, 128)), FP8Experts)


def test_checkpoint_recipe_mismatch(tmp_path, seeded):
    model = _tiny_moe(MOE_MODELS[0][0], **MOE_MODELS[0][1])
    tnn.convert(model, recipe="row")
    path = tnn.save_fp8_checkpoint(model, tmp_path / "row")
    block = _tiny_moe(MOE_MODELS[0][0], **MOE_MODELS[0][1])
    tnn.convert(block)
    with pytest.raises(ValueError, match="FP8Experts has recipe 'block'"):
        tnn.load_fp8_checkpoint(block, path)


@pytest.mark.anydevice
def test_experts_compile_fullgraph(seeded):
    """torch.compile(fullgraph=True) traces the layer (aot_eager on the CPU, where no back end
    runs the interpreter's kernels; inductor on a GPU) and gives the eager output."""
    layer = make_layer(4, 256, 128, "block")
    compiled = torch.compile(layer, fullgraph=True, backend="inductor" if CUDA else "aot_eager")
    for tokens in (3, 17):
        x = torch.randn(tokens, 256, device=DEVICE, dtype=HALF)
        ids, weights = routing(tokens, 2, 4)
        with torch.no_grad():
            assert torch.equal(compiled(x, ids, weights), layer(x, ids, weights))


def test_warmup_runs_experts(seeded):
    layer = make_layer(4, 256, 128, "row")
    model = nn.Sequential()
    model.add_module("experts", layer)
    summary = tnn.warmup(model, dtype=HALF, m_values=[1, 5], progress=False)
    assert summary.calls == 2


# ------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["block", "row"])
def test_gpu_experts_in_a_cuda_graph(recipe, seeded):
    """One captured forward replayed with new tokens and new routing each time (experts
    emptied and filled, sentinels) equals the eager forward and the emulation."""
    e, h, i, tokens = 16, 1024, 512, 40
    layer = make_layer(e, h, i, recipe)
    x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16)
    ids, weights = routing(tokens, 4, e, torch.bfloat16)
    with torch.no_grad():
        layer(x, ids, weights)  # warm-up: plans and compiles
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = layer(x, ids, weights)
        for step in range(3):
            new_ids, new_weights = routing(tokens, 4, e, torch.bfloat16)
            if step == 1:
                new_ids[:, 0] = 3  # expert 3 takes every token
            if step == 2:
                new_ids[::5, 2] = e  # sentinels
            x.copy_(torch.randn_like(x))
            ids.copy_(new_ids)
            weights.copy_(new_weights)
            y.fill_(float("nan"))
            graph.replay()
            eager = layer(x, ids, weights)
            assert torch.equal(y, eager), f"step {step}"
            check(y, reference(layer, x, ids, weights), f"{recipe} step {step}")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 727])
def test_gpu_experts_larger(tokens, seeded):
    """64 experts of a DeepSeek-like shape, top-8: a decode token and a prefill's worth."""
    layer = make_layer(64, 2048, 768, "block")
    x = torch.randn(tokens, 2048, device="cuda", dtype=torch.bfloat16)
    ids, weights = routing(tokens, 8, 64, torch.bfloat16)
    check(layer(x, ids, weights), reference(layer, x, ids, weights), f"T={tokens}")
