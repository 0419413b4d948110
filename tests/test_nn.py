"""tmagemm.nn: FP8Linear against a float64 emulation of its quantization, convert, the HF-layout
FP8 checkpoint round trip, a tiny transformers Llama generating, the fused gated MLP
(FP8GatedMLP: emulation, the unfused chain, views through moves and loads, convert and
checkpoints), and (marked gpu) torch.compile / CUDA graphs, accuracy against the bf16 model,
and 2-GPU tensor parallelism.

CPU tests run the kernels under the Triton interpreter in float16 (bf16 is refused there), on
dims of 128-272 and a one-layer Llama, to stay fast.
"""

from __future__ import annotations

import copy
import json
import os
import socket

import pytest
import torch

import tmagemm.nn as tnn
from tmagemm.gate_up import gate_up_silu_quant
from tmagemm.nn.linear import quantize_input
from tmagemm.nn.quantize import FP8, _quantize_128x128_torch

from test_gate_up import check as check_gate_up_h, reference as gate_up_reference

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
HALF = torch.bfloat16 if CUDA else torch.float16  # the interpreter refuses bf16
RECIPES = ("block", "row", "tensor")
FP8_MAX = 448.0
TINY = torch.finfo(torch.float32).tiny


# ------------------------------------------------------------------------------ references


def emulate_activation(x: torch.Tensor, recipe: str) -> torch.Tensor:
    """x (M, K) quantized and dequantized in torch as the layer's quantizers do (scale =
    amax / 448 in fp32, at least the smallest normal; round to nearest even), in float64."""
    xf = x.float()
    m, k = xf.shape
    if recipe == "block":
        kb = -(-k // 128)
        padded = xf.new_zeros(m, kb * 128)
        padded[:, :k] = xf
        groups = padded.view(m, kb, 128)
        scale = (groups.abs().amax(dim=2, keepdim=True) / FP8_MAX).clamp(min=TINY)
        q = (groups / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        return (q.double() * scale.double()).view(m, kb * 128)[:, :k]
    amax = xf.abs().amax(dim=1, keepdim=True) if recipe == "row" else xf.abs().amax().reshape(1, 1)
    scale = (amax / FP8_MAX).clamp(min=TINY)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).double() * scale.double()


def emulate(layer: tnn.FP8Linear, x: torch.Tensor) -> torch.Tensor:
    """The layer's output in float64 from the emulated quantized input and its dequantized weight."""
    x2 = x.reshape(-1, x.shape[-1]).cpu()
    y = emulate_activation(x2, layer.recipe) @ layer.dequantized_weight(torch.float64).cpu().t()
    if layer.bias is not None:
        y = y + layer.bias.double().cpu()
    return y.reshape(*x.shape[:-1], -1)


def accumulation(recipe: str) -> float:
    """The accumulation bound per unit of sum |x_q||w_q| of a layer's product: the interpreter
    sums in fp32; the GPU's fp8 tensor cores keep fewer bits while summing (``use_fast_accum``,
    the row/tensor default: across all of K, up to 2^-9 seen on an H100 at M = 4, K = 272;
    block-scaled products promote every 128-deep k-block)."""
    return 2.0**-20 if not CUDA else (2.0**-12 if recipe == "block" else 2.0**-8)


def assert_within(y: torch.Tensor, ref: torch.Tensor, size: torch.Tensor, acc: float, what: str) -> None:
    """y against the float64 ``ref`` element by element: |y - ref| <= out_rounding * |ref| + acc *
    size (size: sum |x_q||w_q| per element; out_rounding: one ulp of y's dtype at the bottom of
    its binade, the interpreter truncating, the GPU rounding)."""
    got = y.detach().double().cpu().reshape(ref.shape)
    out_rounding = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7, torch.float32: 2.0**-20}[y.dtype]
    bound = out_rounding * ref.abs() + acc * size
    bad = ~((got - ref).abs() <= bound)  # NaN fails
    if bool(bad.any()):
        r, c = bad.nonzero()[0].tolist()
        raise AssertionError(f"{what} {y.dtype}: {int(bad.sum())} of {got.numel()} elements off; first at "
                             f"({r}, {c}): got {float(got[r, c]):.6g}, want {float(ref[r, c]):.6g} "
                             f"+- {float(bound[r, c]):.3g}")


def check_emulated(y: torch.Tensor, layer: tnn.FP8Linear, x: torch.Tensor) -> None:
    """y against :func:`emulate` (:func:`assert_within`, :func:`accumulation`)."""
    ref = emulate(layer, x).reshape(-1, layer.out_features)
    size = emulate_activation(x.reshape(-1, x.shape[-1]).cpu(), layer.recipe).abs() @ \
        layer.dequantized_weight(torch.float64).cpu().abs().t()
    assert_within(y, ref, size, accumulation(layer.recipe), layer.recipe)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def fp8_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (fp8 compared as bytes: NaN payloads and signed zeros included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == FP8:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a.cpu(), b.cpu())


# --------------------------------------------------------------------------------- FP8Linear


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lead", [(5,), (2, 3), (1, 1, 4)], ids=lambda s: "x".join(map(str, s)))
def test_fp8linear_matches_emulation(recipe, bias, lead, seeded):
    """(…, K) inputs of any leading shape: the output equals the float64 product of the
    emulated quantized operands up to the output's rounding; and stays near the unquantized
    layer (two 3-bit-mantissa roundings). K = 272: a ragged last 1x128 group."""
    linear = torch.nn.Linear(272, 144, bias=bias, device=DEVICE, dtype=HALF)
    layer = tnn.FP8Linear.from_linear(linear, recipe)
    x = torch.randn(*lead, 272, device=DEVICE, dtype=HALF)
    y = layer(x)
    assert y.shape == (*lead, 144) and y.dtype == HALF and y.device == x.device
    check_emulated(y, layer, x)
    with torch.no_grad():
        exact = linear(x)
    assert rel_err(y, exact) < 0.08, f"{recipe}: {rel_err(y, exact):.3f} from the unquantized layer"


def test_fp8linear_float32_input(seeded):
    """float32 in -> float32 out, quantized from float32 directly (nothing cast behind the caller)."""
    layer = tnn.FP8Linear.from_linear(torch.nn.Linear(256, 128, device=DEVICE), "block")
    assert layer.bias.dtype == torch.float32
    x = torch.randn(3, 256, device=DEVICE)
    y = layer(x)
    assert y.dtype == torch.float32
    check_emulated(y, layer, x)


def test_zero_tokens():
    layer = tnn.FP8Linear(128, 64, device=DEVICE, dtype=HALF)
    assert layer(torch.empty(0, 128, device=DEVICE, dtype=HALF)).shape == (0, 64)
    assert layer(torch.empty(2, 0, 128, device=DEVICE, dtype=HALF)).shape == (2, 0, 64)


@pytest.mark.parametrize("shape", [(144, 272), (128, 128), (16, 32)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_from_linear_block_weights(shape, seeded):
    """The weight quantization of "block" (torch arithmetic off the GPU) is bit for bit the
    fused 128x128 quantizer's, scales in the HF (NB, KB) layout; dequantized near the original."""
    from tmagemm.triton.quantize import quantize_128x128

    w = torch.randn(*shape, dtype=torch.float16) * 3
    q, scale = _quantize_128x128_torch(w)
    q_ref, scale_ref = quantize_128x128(w.to(DEVICE))
    assert fp8_equal(q, q_ref.contiguous()) and fp8_equal(scale, scale_ref)
    linear = torch.nn.Linear(shape[1], shape[0], dtype=torch.float16)
    with torch.no_grad():
        linear.weight.copy_(w)
    layer = tnn.FP8Linear.from_linear(linear)
    assert layer.weight.dtype == FP8 and layer.weight.is_contiguous()
    assert layer.weight_scale_inv.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    assert fp8_equal(layer.weight, q) and fp8_equal(layer.weight_scale_inv, scale)
    assert rel_err(layer.dequantized_weight(), w) < 0.05


@pytest.mark.parametrize("recipe,scale_shape", [("row", (144, 1)), ("tensor", (1,))])
def test_from_linear_row_tensor_scales(recipe, scale_shape, seeded):
    linear = torch.nn.Linear(272, 144, dtype=torch.float16)
    layer = tnn.FP8Linear.from_linear(linear, recipe)
    assert layer.weight_scale_inv.shape == scale_shape and layer.weight_scale_inv.dtype == torch.float32
    assert rel_err(layer.dequantized_weight(), linear.weight) < 0.05


def test_dtype_casts_keep_fp8(seeded):
    """model.half() / .to(bfloat16) cast the bias but leave the e4m3 weight and fp32 scales alone."""
    layer = tnn.FP8Linear.from_linear(torch.nn.Linear(256, 128))
    weight, scale = layer.weight.clone(), layer.weight_scale_inv.clone()
    for cast in (lambda m: m.half(), lambda m: m.to(torch.bfloat16), lambda m: m.to("cpu", torch.float32)):
        cast(layer)
        assert fp8_equal(layer.weight, weight) and fp8_equal(layer.weight_scale_inv, scale)
    assert layer.bias.dtype == torch.float32


def test_errors():
    layer = tnn.FP8Linear(128, 64, device=DEVICE, dtype=HALF)
    with pytest.raises(TypeError, match="float64"):
        layer(torch.randn(2, 128, dtype=torch.float64, device=DEVICE))
    with pytest.raises(TypeError, match="int32"):
        layer(torch.ones(2, 128, dtype=torch.int32, device=DEVICE))
    with pytest.raises(TypeError, match="torch.Tensor"):
        layer([1.0] * 128)
    with pytest.raises(ValueError, match="in_features = 128"):
        layer(torch.randn(2, 96, dtype=HALF, device=DEVICE))
    with pytest.raises(ValueError, match="in_features = 128"):
        layer(torch.tensor(1.0, dtype=HALF, device=DEVICE))
    with pytest.raises(ValueError, match="multiple of 16"):
        tnn.FP8Linear(100, 64)
    with pytest.raises(ValueError, match="out_features"):
        tnn.FP8Linear(128, 0)
    with pytest.raises(ValueError, match="recipe"):
        tnn.FP8Linear(128, 64, recipe="1x128")
    with pytest.raises(TypeError, match="dtype"):
        tnn.FP8Linear(128, 64, dtype=torch.float64)
    with pytest.raises(TypeError, match="nn.Linear"):
        tnn.FP8Linear.from_linear(layer)
    with pytest.raises(RuntimeError, match="float8_e4m3fn"):  # no silent quantization of a bf16 weight
        layer.load_state_dict({**layer.state_dict(), "weight": torch.zeros(64, 128)})
    broken = torch.nn.Linear(128, 128)
    with torch.no_grad():
        broken.weight[3, 5] = float("nan")
    with pytest.raises(ValueError, match="Inf or NaN"):
        tnn.FP8Linear.from_linear(broken)


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8linear_bfloat16(recipe, seeded):
    """bfloat16 in and out (on the CPU too: the interpreter's bf16 trouble is a bf16 tl.dot, and
    here the operands of the dot are fp8); only the bf16 output rounding (2^-9) differs."""
    linear = torch.nn.Linear(272, 144, device=DEVICE, dtype=torch.bfloat16)
    layer = tnn.FP8Linear.from_linear(linear, recipe)
    x = torch.randn(2, 5, 272, device=DEVICE, dtype=torch.bfloat16)
    y = layer(x)
    assert y.dtype == torch.bfloat16
    check_emulated(y, layer, x)


@pytest.mark.skipif(CUDA, reason="CPU-only error path")
def test_cpu_without_interpreter(monkeypatch):
    layer = tnn.FP8Linear(128, 64, dtype=torch.float16)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA"):
        layer(torch.randn(2, 128, dtype=torch.float16))


def test_compile_fullgraph_traces(seeded):
    """torch.compile(fullgraph=True) traces the layer without a graph break (aot_eager on the CPU,
    where no compiler back end runs the interpreter's kernels; inductor on a GPU)."""
    layer = tnn.FP8Linear.from_linear(torch.nn.Linear(256, 128, device=DEVICE, dtype=HALF))
    compiled = torch.compile(layer, fullgraph=True, backend="inductor" if CUDA else "aot_eager")
    x = torch.randn(2, 3, 256, device=DEVICE, dtype=HALF)
    with torch.no_grad():
        assert torch.equal(compiled(x), layer(x))


@pytest.mark.parametrize("recipe", ["block", "row"])
def test_eager_forward_calls_the_quantizers_plainly(recipe, seeded, monkeypatch):
    """Eagerly the layer quantizes through the plain function, not the custom op (whose dispatch
    costs more host time than the quantizer's cached launch): the ops stand poisoned and the
    output is the one the ops give. While torch.compile traces, the ops are used (the test
    above)."""
    import tmagemm.nn.quantize as quantize_module

    layer = tnn.FP8Linear.from_linear(torch.nn.Linear(256, 128, device=DEVICE, dtype=HALF), recipe=recipe)
    x = torch.randn(3, 256, device=DEVICE, dtype=HALF)
    with torch.no_grad():
        want = layer.quantized_input_mm(*torch.ops.tmagemm_nn.quantize_activation(x, recipe), layer.bias, x.dtype)

        class Poisoned:
            def __getattr__(self, name):
                raise AssertionError(f"torch.ops.tmagemm_nn.{name} called in eager mode")

        monkeypatch.setattr(quantize_module.torch.ops, "tmagemm_nn", Poisoned())
        assert quantize_module.activation_ops() is not torch.ops.tmagemm_nn
        assert torch.equal(layer(x), want)


# ----------------------------------------------------------------------------------- convert


def test_convert_skip_and_alignment(seeded):
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 100),
                                torch.nn.Linear(100, 128), torch.nn.Linear(128, 128))
    shared = torch.nn.Linear(128, 128)
    model.add_module("a", shared)
    model.add_module("b", shared)  # one layer under two names: one FP8Linear under both
    tnn.convert(model, "row", skip=["4"])
    kinds = [type(m).__name__ for m in model]
    assert kinds == ["FP8Linear", "ReLU", "Linear", "Linear", "Linear", "FP8Linear", "FP8Linear"], kinds
    assert model.a is model.b
    single = torch.nn.Linear(128, 64)
    assert isinstance(tnn.convert(single), tnn.FP8Linear)
    with pytest.raises(ValueError, match="recipe"):
        tnn.convert(model, "fp8")


# ------------------------------------------------------------------- transformers Llama (tiny)


def tiny_llama(layers=1, hidden=128, intermediate=256, vocab=200, dtype=HALF, device=DEVICE, seed=0):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                                      max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()


def greedy(model, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                              min_new_tokens=new_tokens, pad_token_id=0)


def test_convert_llama_skips(seeded):
    model = tnn.convert(tiny_llama(), skip=("lm_head", "*.mlp.down_proj"))
    fp8 = [n for n, m in model.named_modules() if isinstance(m, tnn.FP8Linear)]
    linear = [n for n, m in model.named_modules() if type(m) is torch.nn.Linear]
    assert len(fp8) == 6 and all("down_proj" not in n for n in fp8), fp8
    assert linear == ["model.layers.0.mlp.down_proj", "lm_head"], linear


@pytest.fixture(scope="module")
def fp8_llama_checkpoint(tmp_path_factory):
    """A converted tiny Llama and the directory it was saved to."""
    model = tnn.convert(tiny_llama())
    path = tnn.save_fp8_checkpoint(model, tmp_path_factory.mktemp("fp8_llama"))
    return model, path


def test_checkpoint_round_trip_exact(fp8_llama_checkpoint):
    model, path = fp8_llama_checkpoint
    config = json.loads((path / "config.json").read_text())
    quant = config["quantization_config"]
    assert quant["quant_method"] == "fp8" and quant["weight_block_size"] == [128, 128]
    assert quant["modules_to_not_convert"] == ["lm_head"] and config["model_type"] == "llama"
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        key = "model.layers.0.mlp.down_proj"
        assert f.get_tensor(key + ".weight").dtype == FP8
        assert f.get_tensor(key + ".weight_scale_inv").shape == (1, 2)  # (N/128, K/128) = (128/128, 256/128)

    for loaded in (tnn.from_pretrained_fp8(path, device=DEVICE, dtype=HALF),
                   tnn.load_fp8_checkpoint(tiny_llama(seed=1), path)):
        want, got = model.state_dict(), loaded.state_dict()
        assert want.keys() == got.keys()
        for key in want:
            assert fp8_equal(got[key], want[key]), key
        assert isinstance(loaded.model.layers[0].mlp.up_proj, tnn.FP8Linear)
        assert type(loaded.lm_head) is torch.nn.Linear


@pytest.mark.parametrize("recipe", ["row", "tensor"])
def test_checkpoint_round_trip_other_recipes(recipe, tmp_path, seeded):
    model = tnn.convert(torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.Linear(256, 48)), recipe)
    tnn.save_fp8_checkpoint(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"]["tmagemm_recipe"] == recipe
    loaded = tnn.load_fp8_checkpoint(torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.Linear(256, 48)), tmp_path)
    assert all(isinstance(m, tnn.FP8Linear) and m.recipe == recipe for m in loaded)
    for key, value in model.state_dict().items():
        assert fp8_equal(loaded.state_dict()[key], value), key


def test_checkpoint_errors(tmp_path, seeded):
    from safetensors.torch import save_file

    model = tnn.convert(torch.nn.Sequential(torch.nn.Linear(128, 128)))
    tnn.save_fp8_checkpoint(model, tmp_path)
    with pytest.raises(ValueError, match="no FP8Linear"):
        tnn.save_fp8_checkpoint(torch.nn.Sequential(torch.nn.Linear(128, 128)), tmp_path / "plain")
    with pytest.raises(ValueError, match="missing"):  # strict: the model's second layer is not in the file
        tnn.load_fp8_checkpoint(torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Linear(128, 128)), tmp_path)
    with pytest.raises(ValueError, match="shape"):
        tnn.load_fp8_checkpoint(torch.nn.Sequential(torch.nn.Linear(128, 256)), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for change, message in ((("weight_block_size", [64, 64]), "64"), (("activation_scheme", "static"), "static"),
                            (("quant_method", "awq"), "awq")):
        bad = tmp_path / f"bad_{change[0]}"
        bad.mkdir()
        (bad / "model.safetensors").write_bytes((tmp_path / "model.safetensors").read_bytes())
        (bad / "config.json").write_text(json.dumps({**config, "quantization_config": {
            **config["quantization_config"], change[0]: change[1]}}))
        with pytest.raises(ValueError, match=message):
            tnn.load_fp8_checkpoint(torch.nn.Sequential(torch.nn.Linear(128, 128)), bad)
    wrong = tmp_path / "bf16_weight"
    wrong.mkdir()
    save_file({"0.weight": torch.zeros(128, 128), "0.weight_scale_inv": torch.ones(1, 1), "0.bias": torch.zeros(128)},
              str(wrong / "model.safetensors"))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        tnn.load_fp8_checkpoint(torch.nn.Sequential(torch.nn.Linear(128, 128)), wrong)


def test_tiny_llama_generates(fp8_llama_checkpoint):
    """The converted model generates (CPU: fp16 under the interpreter), and the reloaded
    checkpoint generates the same tokens (the same bits through the same kernels)."""
    model, path = fp8_llama_checkpoint
    ids = torch.tensor([[1, 17, 42, 99]], device=DEVICE)
    tokens = greedy(model, ids, 3)
    assert tokens.shape == (1, 7) and torch.equal(tokens[:, :4], ids)
    assert int(tokens.min()) >= 0 and int(tokens.max()) < 200
    loaded = tnn.from_pretrained_fp8(path, device=DEVICE, dtype=HALF)
    assert torch.equal(greedy(loaded, ids, 3), tokens)


# ------------------------------------------------------------------------ fused gated MLP


class GatedMLP(torch.nn.Module):
    """transformers' LlamaMLP, standalone: ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, hidden, inter, bias=False, dtype=HALF, device=DEVICE, act=None):
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, inter, bias=False, dtype=dtype, device=device)
        self.up_proj = torch.nn.Linear(hidden, inter, bias=False, dtype=dtype, device=device)
        self.down_proj = torch.nn.Linear(inter, hidden, bias=bias, dtype=dtype, device=device)
        self.act_fn = act or torch.nn.SiLU()

    def forward(self, x):
        down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return down_proj


class OtherMLP(GatedMLP):
    """The same children, another computation: never fused."""

    def forward(self, x):
        return self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))


def emulate_gated(mlp: tnn.FP8GatedMLP, x: torch.Tensor) -> torch.Tensor:
    """The fused MLP in float64: x quantized per 1x128 group, g and u from the dequantized weights,
    h = silu(g) * u quantized per 1x128 group, times the dequantized down weight (+ bias)."""
    x2 = x.reshape(-1, x.shape[-1]).cpu()
    wg, wu = (w.cpu() for w in mlp.dequantized_weights(torch.float64))
    xd = emulate_activation(x2, "block")
    g, u = xd @ wg.t(), xd @ wu.t()
    h = emulate_activation((g * torch.sigmoid(g) * u).float(), "block")
    y = h @ mlp.down_proj.dequantized_weight(torch.float64).cpu().t()
    if mlp.down_proj.bias is not None:
        y = y + mlp.down_proj.bias.double().cpu()
    return y.reshape(*x.shape[:-1], -1)


def check_gated(y: torch.Tensor, mlp: tnn.FP8GatedMLP, x: torch.Tensor) -> None:
    """The fused MLP's y (at most FUSED_MAX_TOKENS tokens) in two steps, element by element. The
    h its gate/up kernel makes for this x against float64 silu(g) * u (tests/test_gate_up.py's
    check: half an fp8 step plus g's and u's accumulation); then y against that very h times the
    dequantized down weight (+ bias), bounded as a block-scaled layer (:func:`assert_within`).
    Comparing y with emulate_gated's instead would let every element of h whose float64 value
    lies within the accumulation error of an fp8 rounding boundary round either way: on the GPU's
    fp8 adder, too many of them for a useful bound."""
    xq, xs = quantize_input(x, mlp.hidden_size, "block", mlp.input_norm)
    w, sw = mlp.gate_up_weight, mlp.gate_up_weight_scale_inv
    hq, hs = gate_up_silu_quant(xq, xs, w, sw)
    check_gate_up_h(hq, hs, gate_up_reference(xq, xs, w, sw), "fused MLP's h")
    hd = hq.double().cpu() * hs.double().cpu().repeat_interleave(128, dim=1)[:, :hq.shape[1]]
    wd = mlp.down_proj.dequantized_weight(torch.float64).cpu()
    ref = hd @ wd.t()
    if mlp.down_proj.bias is not None:
        ref = ref + mlp.down_proj.bias.double().cpu()
    assert_within(y, ref, hd.abs() @ wd.abs().t(), accumulation("block"), "fused MLP")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("lead", [(5,), (2, 9)], ids=lambda s: "x".join(map(str, s)))
def test_gated_mlp_matches_emulation_and_unfused(bias, lead, seeded):
    """FP8GatedMLP against float64 (check_gated), the unfused FP8Linear chain (same fp8 weights;
    h rounded to 16 bits before its quantization there) and the 16-bit MLP. H = 272: a ragged
    k-block; I = 384: three 1x128 groups of h."""
    reference = GatedMLP(272, 384, bias)
    unfused = tnn.convert(copy.deepcopy(reference))
    fused = tnn.FP8GatedMLP.from_mlp(reference)
    assert fused.down_proj.bias is not None if bias else fused.down_proj.bias is None
    x = torch.randn(*lead, 272, device=DEVICE, dtype=HALF)
    with torch.no_grad():
        y, y_unfused, y_ref = fused(x), unfused(x), reference(x)
    assert y.shape == (*lead, 272) and y.dtype == HALF
    check_gated(y, fused, x)
    assert rel_err(y, y_unfused) < 3e-2, rel_err(y, y_unfused)
    assert rel_err(y, y_ref) < 0.1, rel_err(y, y_ref)


def test_gated_mlp_past_decode_sizes_runs_unfused(seeded):
    """Above FUSED_MAX_TOKENS tokens: the stacked gate/up GEMM, SiLU * up in x's dtype and a
    quantizer, i.e. the unfused FP8Linear chain's arithmetic on the same fp8 weights."""
    from tmagemm.nn import mlp

    reference = GatedMLP(272, 384)
    unfused = tnn.convert(copy.deepcopy(reference))
    fused = tnn.FP8GatedMLP.from_mlp(reference)
    x = torch.randn(mlp.FUSED_MAX_TOKENS + 6, 272, device=DEVICE, dtype=HALF)
    with torch.no_grad():
        y, y_unfused = fused(x), unfused(x)
    assert rel_err(y, y_unfused) < 2e-3, rel_err(y, y_unfused)
    assert rel_err(y, emulate_gated(fused, x)) < 3e-2
    assert rel_err(y[:5], fused(x[:5])) < 3e-2  # the fused kernel on the first rows


def test_gated_mlp_from_fp8_layers_float32_and_zero_tokens(seeded):
    """FP8Linear projections are copied bit for bit (down_proj reused as it is); float32 in ->
    float32 out; zero tokens give an empty output."""
    mlp = tnn.convert(GatedMLP(256, 256, bias=True, dtype=torch.float32))
    fused = tnn.FP8GatedMLP.from_mlp(mlp)
    assert fused.down_proj is mlp.down_proj and fused.down_proj.bias.dtype == torch.float32
    for name in ("gate_proj", "up_proj"):
        assert fp8_equal(getattr(fused, name).weight, getattr(mlp, name).weight)
        assert fp8_equal(getattr(fused, name).weight_scale_inv, getattr(mlp, name).weight_scale_inv)
    x = torch.randn(3, 256, device=DEVICE)
    with torch.no_grad():
        y = fused(x)
    assert y.dtype == torch.float32
    check_gated(y, fused, x)
    assert fused(torch.empty(0, 256, device=DEVICE)).shape == (0, 256)
    assert fused(torch.empty(2, 0, 256, device=DEVICE)).shape == (2, 0, 256)


def test_gated_mlp_refusals_and_errors():
    from tmagemm.nn.mlp import gated_mlp_reason

    assert gated_mlp_reason(GatedMLP(128, 256)) is None
    transformers = pytest.importorskip("transformers")
    assert gated_mlp_reason(GatedMLP(128, 256, act=transformers.activations.ACT2FN["silu"])) is None
    assert "not SiLU" in gated_mlp_reason(GatedMLP(128, 256, act=torch.nn.GELU()))
    assert "forward is not" in gated_mlp_reason(OtherMLP(128, 256))
    assert "multiple of 128" in gated_mlp_reason(GatedMLP(128, 192))
    biased = GatedMLP(128, 256)
    biased.up_proj = torch.nn.Linear(128, 256, device=DEVICE, dtype=HALF)
    assert "bias" in gated_mlp_reason(biased)
    row = tnn.convert(GatedMLP(128, 256), "row")
    assert "recipe 'row'" in gated_mlp_reason(row)
    assert "lacks" in gated_mlp_reason(torch.nn.Sequential(torch.nn.Linear(128, 128)))
    assert "already" in gated_mlp_reason(tnn.FP8GatedMLP(128, 256))
    with pytest.raises(ValueError, match="not SiLU"):
        tnn.FP8GatedMLP.from_mlp(GatedMLP(128, 256, act=torch.nn.GELU()))
    with pytest.raises(ValueError, match="intermediate_size = 192 is not a multiple of 128"):
        tnn.FP8GatedMLP(128, 192)
    with pytest.raises(ValueError, match="hidden_size|in_features"):
        tnn.FP8GatedMLP(100, 256)
    fused = tnn.FP8GatedMLP(128, 256, device=DEVICE, dtype=HALF)
    with pytest.raises(TypeError, match="FP8GatedMLP takes bfloat16, float16 or float32 input"):
        fused(torch.zeros(2, 128, dtype=torch.float64, device=DEVICE))
    with pytest.raises(ValueError, match="FP8GatedMLP: input has shape .2, 96.; its last dimension must be"):
        fused(torch.zeros(2, 96, dtype=HALF, device=DEVICE))
    with pytest.raises(ValueError, match="fuse_gate_up=True needs recipe='block'"):
        tnn.convert(GatedMLP(128, 256), "row", fuse_gate_up=True)
    with pytest.raises(TypeError, match="fuse_gate_up must be a bool"):
        tnn.convert(GatedMLP(128, 256), fuse_gate_up="yes")


def test_gated_mlp_views_survive_moves_casts_copies_and_loads(seeded):
    """gate_proj / up_proj hold views of the stacked buffers through .half(), .to(), deepcopy and
    load_state_dict (copying or assigning); the state dict has the HF names only."""
    fused = tnn.FP8GatedMLP.from_mlp(GatedMLP(128, 256, bias=True))
    assert fused._tied()
    assert sorted(fused.state_dict()) == sorted([f"{p}.{t}" for p in ("gate_proj", "up_proj", "down_proj")
                                                 for t in ("weight", "weight_scale_inv")] + ["down_proj.bias"])
    stacked = fused.gate_up_weight.clone()
    for cast in (lambda m: m.half(), lambda m: m.to(torch.float32), lambda m: m.to("cpu")):
        cast(fused)
        assert fused._tied() and fused.gate_up_weight.dtype == FP8 and fp8_equal(fused.gate_up_weight, stacked)
    assert fused.down_proj.bias.dtype == torch.float32
    clone = copy.deepcopy(fused)
    assert clone._tied() and clone.gate_up_weight.data_ptr() != fused.gate_up_weight.data_ptr()
    other = tnn.FP8GatedMLP.from_mlp(GatedMLP(128, 256, bias=True, dtype=torch.float32, device="cpu"))
    clone.load_state_dict(other.state_dict())  # copies through the views
    assert clone._tied() and fp8_equal(clone.gate_up_weight, other.gate_up_weight)
    meta = tnn.FP8GatedMLP(128, 256, bias=True, dtype=torch.float32, device="meta")
    meta.load_state_dict(fused.state_dict(), assign=True)  # replaces the children's tensors
    assert meta._tied() and meta.gate_up_weight.device.type == "cpu"
    assert fp8_equal(meta.gate_up_weight, stacked)
    assert fp8_equal(meta.gate_up_weight_scale_inv, fused.gate_up_weight_scale_inv)


def test_gated_mlp_compile_fullgraph_traces(seeded):
    fused = tnn.FP8GatedMLP.from_mlp(GatedMLP(128, 256))
    compiled = torch.compile(fused, fullgraph=True, backend="inductor" if CUDA else "aot_eager")
    x = torch.randn(2, 3, 128, device=DEVICE, dtype=HALF)
    with torch.no_grad():
        assert torch.equal(compiled(x), fused(x))


def test_convert_fuse_gate_up_llama(seeded):
    """convert(fuse_gate_up=True): the MLP becomes an FP8GatedMLP holding the bits the unfused
    conversion gives (same state dict, key for key); skipping one projection keeps it unfused."""
    fused = tnn.convert(tiny_llama(), fuse_gate_up=True)
    plain = tnn.convert(tiny_llama())
    mlp = fused.model.layers[0].mlp
    assert isinstance(mlp, tnn.FP8GatedMLP) and mlp._tied()
    want, got = plain.state_dict(), fused.state_dict()
    assert list(want) == list(got)
    for key in want:
        assert fp8_equal(got[key], want[key]), key
    assert type(fused.lm_head) is torch.nn.Linear
    assert tnn.quantization_config(fused) == tnn.quantization_config(plain)
    kept = tnn.convert(tiny_llama(), skip=("lm_head", "*.mlp.down_proj"), fuse_gate_up=True)
    assert type(kept.model.layers[0].mlp).__name__ == "LlamaMLP"
    assert type(kept.model.layers[0].mlp.down_proj) is torch.nn.Linear
    assert isinstance(kept.model.layers[0].mlp.gate_proj, tnn.FP8Linear)
    # An FP8 model converted earlier fuses too (its MLP's FP8Linear bits are copied).
    again = tnn.convert(plain, fuse_gate_up=True)
    assert isinstance(again.model.layers[0].mlp, tnn.FP8GatedMLP)
    assert fp8_equal(again.model.layers[0].mlp.gate_up_weight, mlp.gate_up_weight)


def test_fused_checkpoint_round_trip_exact(tmp_path, seeded):
    """A fused model's checkpoint is the unfused layout; it loads bit for bit into an unfused
    model, a fused one (fuse_gate_up=True) and a model converted with fuse_gate_up, and the
    reloaded fused model computes the same bits."""
    model = tnn.convert(tiny_llama(), fuse_gate_up=True)
    path = tnn.save_fp8_checkpoint(model, tmp_path)
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.mlp.gate_proj.weight_scale_inv" in keys and not any("gate_up" in k for k in keys)
    loaded = [tnn.from_pretrained_fp8(path, device=DEVICE, dtype=HALF),
              tnn.from_pretrained_fp8(path, device=DEVICE, dtype=HALF, fuse_gate_up=True),
              tnn.load_fp8_checkpoint(tnn.convert(tiny_llama(seed=1), fuse_gate_up=True), path)]
    assert type(loaded[0].model.layers[0].mlp).__name__ == "LlamaMLP"
    want = model.state_dict()
    for m in loaded:
        got = m.state_dict()
        assert list(got) == list(want)
        for key in want:
            assert fp8_equal(got[key], want[key]), key
    for m in loaded[1:]:
        mlp = m.model.layers[0].mlp
        assert isinstance(mlp, tnn.FP8GatedMLP) and mlp._tied()
        assert fp8_equal(mlp.gate_up_weight, model.model.layers[0].mlp.gate_up_weight)
    ids = torch.tensor([[1, 17, 42, 99]], device=DEVICE)
    with torch.no_grad():
        logits = model(ids).logits
        assert torch.equal(loaded[1](ids).logits, logits)
    assert torch.equal(greedy(loaded[2], ids, 2), greedy(model, ids, 2))


# ------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("backend,mode", [("cudagraphs", None), ("inductor", "default"),
                                          ("inductor", "reduce-overhead")])
def test_compiled_llama_same_tokens(backend, mode, seeded, monkeypatch):
    """torch.compile(fullgraph=True) of the FP8 Llama, greedy decoding over a growing sequence.

    backend="cudagraphs" (the traced graph replayed as CUDA graphs, eager's kernels): logits and
    tokens identical to eager, bit for bit. Inductor ("default", and "reduce-overhead" with CUDA
    graphs): inductor's fused norms and rotary round differently from eager and fp8 quantization
    turns some last-bit differences into whole fp8 steps (6%), so the logits differ by a few
    percent (3.5% seen on an H100) and a near-tie of a random model's flat logits can flip. So
    there: logits within 10%, and the same token wherever eager's lead over the runner-up is at
    least a quarter of the logits' standard deviation (teacher-forced on eager's tokens)."""
    torch.compiler.reset()  # each case compiles a new model: keep dynamo's recompile count per case
    model = tnn.convert(tiny_llama(layers=2, hidden=256, intermediate=512, vocab=1000))
    if backend == "cudagraphs":
        # One static graph per sequence length: the cudagraphs backend's dynamic-shape path failed
        # copying a length-11 input into a length-10 graph input after other compiled tests ran in
        # the same process (torch 2.11), which says nothing about the layers under test.
        monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 16)
        compiled = torch.compile(model, fullgraph=True, backend=backend, dynamic=False)
    else:
        compiled = torch.compile(model, fullgraph=True, backend=backend, mode=mode)
    ids = torch.tensor([[1, 17, 42, 99, 7, 3, 250, 11]], device="cuda")
    decisive = 0
    with torch.no_grad():
        for step in range(8):
            eager = model(ids, use_cache=False).logits[0, -1].float()
            fast = compiled(ids, use_cache=False).logits[0, -1].float().clone()  # before the next replay
            if backend == "cudagraphs":
                assert torch.equal(fast, eager), f"step {step}: replayed logits differ from eager"
                decisive += 1
            else:
                assert rel_err(fast, eager) < 0.1, f"step {step}: compiled logits {rel_err(fast, eager):.3f} from eager"
                first, second = eager.topk(2).values.tolist()
                if first - second >= 0.25 * float(eager.std()):
                    decisive += 1
                    assert int(fast.argmax()) == int(eager.argmax()), f"step {step}: compiled picked another token"
            ids = torch.cat([ids, eager.argmax().reshape(1, 1)], dim=1)
    assert decisive >= 1, "no step had a clear top-1 token"


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_llama_logits_close_to_bf16(recipe, seeded):
    """A 2-layer, 1024-wide Llama: FP8 logits against the bf16 model's (printed; -s shows it).
    Seen on an H100 (random weights, 4 x 64 tokens): relative error 0.110 / 0.114 / 0.115 and
    top-1 agreement 0.76 / 0.76 / 0.74 for block / row / tensor: the quantization noise of 14
    GEMMs in a random model, whose logits are flat. A wrong scale or layout gives errors near 1."""
    reference = tiny_llama(layers=2, hidden=1024, intermediate=2816, vocab=4096)
    model = tnn.convert(tiny_llama(layers=2, hidden=1024, intermediate=2816, vocab=4096), recipe)
    ids = torch.randint(3, 4096, (4, 64), device="cuda")
    with torch.no_grad():
        want, got = reference(ids).logits, model(ids).logits
    err = rel_err(got, want)
    agree = float((got.argmax(-1) == want.argmax(-1)).float().mean())
    print(f"\n{recipe}: FP8 logits relative error {err:.4f}, top-1 agreement {agree:.3f}")
    assert err < 0.2 and agree > 0.6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tp_worker(rank: int, world: int, port: int, recipe: str) -> None:
    """One rank: the single-GPU FP8 MLP (same seed on every rank) against its tensor-parallel
    version (gate/up column-parallel, down row-parallel)."""
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        hidden, inter = 512, 1024
        gate, up, down = (tnn.FP8Linear.from_linear(torch.nn.Linear(i, o, bias=b, device="cuda", dtype=torch.bfloat16),
                                                    recipe)
                          for i, o, b in ((hidden, inter, False), (hidden, inter, False), (inter, hidden, True)))
        x = torch.randn(3, 7, hidden, device="cuda", dtype=torch.bfloat16)

        def mlp(g, u, d):
            return d(torch.nn.functional.silu(g(x)) * u(x))

        with torch.no_grad():
            want = mlp(gate, up, down)
            shards = (tnn.ColumnParallelFP8Linear.from_full(gate), tnn.ColumnParallelFP8Linear.from_full(up),
                      tnn.RowParallelFP8Linear.from_full(down))
            assert shards[0].out_features == inter // world and shards[2].in_features == inter // world
            got = mlp(*shards)
        err = rel_err(got, want)
        # block: the same 1x128 groups as one GPU, so only the bf16 rounding of the partial sums
        # differs; row/tensor: each rank's activation scale covers its own slice.
        assert err < (1e-2 if recipe == "block" else 3e-2), f"rank {rank} {recipe}: relative error {err:.4f}"
        with pytest.raises(ValueError, match="multiple of"):
            tnn.ColumnParallelFP8Linear(hidden, 128 * world + 16, recipe="block")
    finally:
        dist.destroy_process_group()


def _two_gpus() -> bool:
    return torch.cuda.device_count() >= 2


@pytest.mark.gpu
@pytest.mark.skipif(not _two_gpus(), reason="needs two GPUs")
@pytest.mark.parametrize("recipe", RECIPES)
def test_tensor_parallel_mlp(recipe, monkeypatch):
    import torch.multiprocessing as mp

    # NVLink multicast stays off in the children (inherited environment).
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"
    mp.spawn(_tp_worker, args=(2, _free_port(), recipe), nprocs=2, join=True)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 3, 8, 9])
def test_gpu_block_layer_quantizes_inside_the_decode_gemm(m, seeded):
    """Up to the decode rule's token count (8 on an H100, 2 on an H200) a "block" FP8Linear runs
    one kernel, the decode GEMM quantizing its input (nn.quantize.block_linear), whose output is
    the two-launch path's bit for bit: eagerly, in a CUDA graph replayed with new inputs, and
    compiled; past it (at nine tokens everywhere) it quantizes first."""
    from tmagemm.cuda import decode
    from tmagemm import plan
    from tmagemm.nn import quantize as quantize_module

    layer = tnn.FP8Linear.from_linear(torch.nn.Linear(4096, 4096, device="cuda", dtype=torch.bfloat16))

    def two_launches(x):
        return layer.quantized_input_mm(*quantize_module.quantize_activation(x, "block"), layer.bias, x.dtype)

    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    plan.clear_plans()
    with torch.no_grad():
        y, want = layer(x), two_launches(x)
    fused = [c for c in plan.cached_calls() if isinstance(c, quantize_module._BlockLinear)]
    if decode.takes_quantizing(m, 4096, 4096, x.device):  # up to 8 tokens on an H100, 2 on an H200
        assert len(fused) == 1 and fused[0].plan is not None and fused[0].plan.variant == "cuda.decode"
    elif m <= decode.QUANTIZE_MAX_M:
        assert len(fused) == 1 and fused[0].plan is None
    else:  # past QUANTIZE_MAX_M tokens block_linear goes straight to the two launches
        assert fused == []
    assert torch.equal(y, want)
    static_x = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        static_y = layer(static_x)
    for _ in range(2):
        static_x.copy_(torch.randn_like(static_x))
        static_y.fill_(float("nan"))
        graph.replay()
        with torch.no_grad():
            assert torch.equal(static_y, two_launches(static_x))
    torch.compiler.reset()
    with torch.no_grad():
        assert torch.equal(torch.compile(layer, fullgraph=True)(x), want)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 64, 300])
def test_gpu_gated_mlp_against_unfused(m, seeded):
    """A 1024 -> 2816 -> 1024 MLP on the GPU: fused against float64 (check_gated at decode sizes,
    the emulation past them), the unfused FP8Linear chain and the bf16 MLP (decode and prefill
    token counts)."""
    from tmagemm.nn import mlp

    reference = GatedMLP(1024, 2816, dtype=torch.bfloat16)
    unfused = tnn.convert(copy.deepcopy(reference))
    fused = tnn.FP8GatedMLP.from_mlp(reference)
    x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        y, y_unfused, y_ref = fused(x), unfused(x), reference(x)
    # Above FUSED_MAX_TOKENS the module rounds h to bf16 like the unfused chain; the emulation
    # keeps the fused kernel's fp32 h.
    fused_kernel = m <= mlp.FUSED_MAX_TOKENS
    if fused_kernel:
        check_gated(y, fused, x)
    else:
        assert rel_err(y, emulate_gated(fused, x)) < 3e-2
    assert rel_err(y, y_unfused) < (3e-2 if fused_kernel else 1e-2)
    assert rel_err(y, y_ref) < 0.1


def assert_graph_replays_match_eager(model, check=None, steps: int = 3) -> None:
    """torch.compile(fullgraph=True) of a causal LM replayed as CUDA graphs (cudagraphs back end,
    eager's kernels): over ``steps`` greedy steps its logits equal eager's bit for bit;
    ``check(ids, eager_logits)`` adds a step's own assertions."""
    torch.compiler.reset()
    compiled = torch.compile(model, fullgraph=True, backend="cudagraphs", dynamic=False)
    ids = torch.tensor([[1, 17, 42, 99, 7, 3, 250, 11]], device="cuda")
    with torch.no_grad():
        for _ in range(steps):
            eager = model(ids, use_cache=False).logits
            assert torch.equal(compiled(ids, use_cache=False).logits.clone(), eager)
            if check is not None:
                check(ids, eager)
            ids = torch.cat([ids, eager[:, -1].argmax(-1, keepdim=True)], dim=1)


def traced(module, *inputs):
    """(module(*inputs) compiled with torch.compile(fullgraph=True) through a back end that runs
    the traced graphs as they are, the graphs' code)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with torch.no_grad():
        out = torch.compile(module, fullgraph=True, backend=backend)(*inputs)
    return out, "\n".join(gm.code for gm in graphs)


@pytest.mark.gpu
def test_gpu_compiled_fused_llama_matches_eager(seeded, monkeypatch):
    """torch.compile(fullgraph=True) of a Llama with fused MLPs, replayed as CUDA graphs
    (cudagraphs back end, eager's kernels): logits bit-identical to eager."""
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 16)
    assert_graph_replays_match_eager(tnn.convert(tiny_llama(layers=2, hidden=256, intermediate=512, vocab=1000),
                                                 fuse_gate_up=True))


# ------------------------------------------------------------------------ warm-up


def test_warmup_runs_each_distinct_layer_per_token_count():
    """A 2-layer Llama with fused MLPs: q/k/v/o share two signatures (128->128, 128->64) and
    the two MLPs one; the fused MLPs' gate/up children are not run on their own. After warm-up
    the same calls are planned already (the plan layer's cache holds them)."""
    from tmagemm import plan

    model = tnn.convert(tiny_llama(layers=2), fuse_gate_up=True)
    plan.clear_plans()
    summary = tnn.warmup(model, dtype=HALF, m_values=(1, 3), progress=False)
    assert summary.calls == 3 * 2 and summary.seconds > 0 and len(summary.slowest) == 5
    planned = len(plan.cached_calls())
    assert planned > 0
    with torch.no_grad():  # the other layer's MLP (the CPU caches gate/up plans too), and a linear
        model.model.layers[1].mlp(torch.randn(3, 128, device=DEVICE, dtype=HALF))
        model.model.layers[1].self_attn.k_proj(torch.randn(3, 128, device=DEVICE, dtype=HALF))
    assert len(plan.cached_calls()) == planned, "a warmed signature was planned again"


def test_warmup_errors():
    with pytest.raises(ValueError, match="has no FP8 layer"):
        tnn.warmup(torch.nn.Linear(16, 16), progress=False)
    layer = tnn.FP8Linear(128, 128, device=DEVICE, dtype=HALF)
    with pytest.raises(TypeError, match="dtype must be bfloat16, float16 or float32"):
        tnn.warmup(layer, dtype=torch.int32, progress=False)
    with pytest.raises(ValueError, match="token counts must be positive"):
        tnn.warmup(layer, m_values=(0, 4), progress=False)
