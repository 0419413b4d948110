"""FP8 checkpoints in the Hugging Face layout, written and read without dequantizing.

A directory holds ``config.json`` (the model's config plus a ``quantization_config``) and
``model.safetensors`` (or shards listed by ``model.safetensors.index.json``, which the loader
reads too). Each FP8 linear layer ``name`` stores ``name.weight`` (float8_e4m3fn, (N, K)) and
``name.weight_scale_inv`` (fp32 dequantization scales: (ceil(N/128), ceil(K/128)) for 128x128
blocks, which is what HF's ``quant_method: "fp8"`` / ``weight_block_size: [128, 128]``
checkpoints hold (DeepSeek-V3, Qwen3-FP8); (N, 1) per channel and (1,) per tensor for tmagemm's
"row" and "tensor" recipes), plus ``name.bias`` if it has one. A Mixture-of-Experts layer's experts (:class:`~tmagemm.nn.FP8Experts`)
are stored expert by expert in that layout, ``<experts>.<e>.gate_proj``, ``up_proj`` and
``down_proj``, as FP8 MoE checkpoints on the hub hold them. Every other tensor is stored as
the model holds it. A layer's recipe is read from its scale's shape (unambiguous, since N >= 16).
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import torch
from torch import nn

from .convert import high_precision_linears
from .experts import FP8Experts, expert_checkpoint_names, experts_reason
from .linear import FP8Linear
from .mlp import fuse_gated_mlps
from .norm import fuse_norms as fuse_rms_norms
from .parallel import ColumnParallelFP8Linear, RowParallelFP8Linear
from .quantize import FP8, RECIPES, SCALE_BLOCK, weight_scale_shape
from .stacked import fuse_stacked_projections

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
SCALE_SUFFIX = ".weight_scale_inv"


def _safetensors():
    try:
        import safetensors.torch
    except ImportError as exc:  # an optional dependency: say which
        raise ImportError("FP8 checkpoints need the safetensors package (pip install safetensors, "
                          "or tmagemm's dev extras)") from exc
    return safetensors


# -------------------------------------------------------------------------------------- save


def quantization_config(model: nn.Module) -> dict:
    """The ``quantization_config`` that describes ``model``'s FP8Linear and FP8Experts layers (HF's FP8 keys,
    plus ``tmagemm_recipe``: "block", "row", "tensor" or "mixed")."""
    layers = [m for m in model.modules() if isinstance(m, (FP8Linear, FP8Experts))]
    if not layers:
        raise ValueError("the model has no FP8Linear or FP8Experts layer; convert it first (tmagemm.nn.convert)")
    recipes = {layer.recipe for layer in layers}
    recipe = recipes.pop() if len(recipes) == 1 else "mixed"
    return {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        # HF's fp8 loader reads 128x128 block checkpoints; other recipes are tmagemm's own.
        "weight_block_size": [SCALE_BLOCK, SCALE_BLOCK] if recipe == "block" else None,
        "modules_to_not_convert": high_precision_linears(model),
        "tmagemm_recipe": recipe,
    }


def save_fp8_checkpoint(model: nn.Module, path, config=None) -> Path:
    """Write ``model`` to the directory ``path`` (created if needed) as ``model.safetensors``
    plus ``config.json``, and return the directory.

    Tensors are written as the model holds them (e4m3 weights and fp32 scales bit for bit,
    everything else in its own dtype); weights tied to another (lm_head / embed_tokens) are
    written once, as safetensors requires. config: a transformers config, a dict, or None for
    ``model.config`` (if any); ``quantization_config`` is added to it. Tensor-parallel shards are
    refused: save the full model.
    """
    sharded = [n for n, m in model.named_modules() if isinstance(m, (ColumnParallelFP8Linear, RowParallelFP8Linear))]
    if sharded:
        raise ValueError(f"{sharded[0]} is a tensor-parallel shard; save the full (unsharded) model instead")
    quant = quantization_config(model)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)

    tensors, seen, storages = {}, set(), set()
    for name, tensor in model.state_dict().items():
        view = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
                tuple(tensor.stride()), tensor.dtype)
        if view in seen:  # tied to a tensor already written
            continue
        seen.add(view)
        out = tensor.detach().cpu().contiguous()
        if out.untyped_storage().data_ptr() in storages:  # a distinct view of a storage already written
            out = out.clone()
        storages.add(out.untyped_storage().data_ptr())
        tensors[name] = out
    _write_atomic(path / WEIGHTS_NAME, lambda tmp: _safetensors().torch.save_file(tensors, tmp, metadata={"format": "pt"}))

    config = getattr(model, "config", None) if config is None else config
    if hasattr(config, "to_json_string"):  # a transformers config
        config = json.loads(config.to_json_string(use_diff=False))
    config = dict(config or {})
    config["quantization_config"] = quant
    _write_atomic(path / CONFIG_NAME, lambda tmp: Path(tmp).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n"))
    return path


def _write_atomic(target: Path, write) -> None:
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        write(str(tmp))
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


# -------------------------------------------------------------------------------------- load


def read_quantization_config(path) -> dict | None:
    """``quantization_config`` of the checkpoint directory ``path`` (None without one),
    ValueError for what tmagemm cannot load (another quant_method, static activation scales,
    blocks other than 128x128, e5m2 weights)."""
    config_file = Path(path) / CONFIG_NAME
    if not config_file.is_file():
        return None
    quant = json.loads(config_file.read_text()).get("quantization_config")
    if quant is None:
        return None
    method = quant.get("quant_method")
    if method != "fp8":
        raise ValueError(f"{config_file}: quant_method is {method!r}; tmagemm.nn loads 'fp8' checkpoints")
    if quant.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"{config_file}: activation_scheme {quant['activation_scheme']!r}; tmagemm.nn quantizes "
                         "activations dynamically and has no use for static input scales")
    block = quant.get("weight_block_size")
    if block is not None and list(block) != [SCALE_BLOCK, SCALE_BLOCK]:
        raise ValueError(f"{config_file}: weight_block_size {block}; tmagemm's block-scaled kernels take 128x128 blocks")
    if quant.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"{config_file}: fmt {quant['fmt']!r}; tmagemm's fp8 weights are e4m3")
    return quant


def _weight_files(path: Path) -> list[Path]:
    if (path / WEIGHTS_NAME).is_file():
        return [path / WEIGHTS_NAME]
    if (path / INDEX_NAME).is_file():
        weight_map = json.loads((path / INDEX_NAME).read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    raise FileNotFoundError(f"{path} holds neither {WEIGHTS_NAME} nor {INDEX_NAME}")


def _layer_recipe(name: str, weight_shape, scale_shape) -> str:
    """The recipe whose scale shape a layer's stored scale has ((), (1, 1) and (N,) accepted
    as the per-tensor and per-channel shapes other tools write)."""
    if len(weight_shape) != 2:
        raise ValueError(f"{name}.weight has shape {tuple(weight_shape)}; an FP8 linear weight is 2-D (N, K)")
    n, k = weight_shape
    scale_shape = tuple(scale_shape)
    for recipe in RECIPES:
        if scale_shape == weight_scale_shape(recipe, n, k):
            return recipe
    if scale_shape in ((), (1, 1)):
        return "tensor"
    if scale_shape == (n,):
        return "row"
    raise ValueError(f"{name}{SCALE_SUFFIX} has shape {scale_shape}, which fits no recipe for a weight {(n, k)}: "
                     f"block {weight_scale_shape('block', n, k)}, row {(n, 1)}, tensor (1,)")


def _build_model(config, device, dtype):
    """A causal-LM model from a transformers config (random init; its linears get replaced)."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as exc:
        raise ImportError("building a model from a config needs transformers (pip install transformers); or pass "
                          "the model itself to load_fp8_checkpoint") from exc
    config = copy.deepcopy(config)
    if getattr(config, "quantization_config", None) is not None:
        # transformers would set up its own fp8 quantizer; the layers here are tmagemm's.
        del config.quantization_config
    if dtype is None:
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.bfloat16
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with torch.device(device or "cpu"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def load_fp8_checkpoint(model_or_config, path, *, device=None, dtype=None, strict: bool = True,
                        fuse_gate_up: bool = False, fuse_qkv: bool = False, fuse_norms: bool = False) -> nn.Module:
    """Load the FP8 checkpoint directory ``path`` into a model and return it.

    model_or_config: a model (its nn.Linear layers that the checkpoint stores in fp8 become
    FP8Linear shells on the layer's device, and its experts modules whose experts it stores in
    fp8, ``<experts>.<e>.gate_proj`` / ``up_proj`` / ``down_proj``, FP8Experts shells; then
    everything is loaded), or a transformers config
    (a causal LM is built from it with ``AutoModelForCausalLM.from_config`` on ``device`` in
    ``dtype``, default the config's, then loaded). fp8 weights and scales are copied bit for
    bit (never dequantized); other tensors are cast to the model's dtypes. strict: ValueError
    for checkpoint tensors the model lacks, model tensors the checkpoint lacks (tied weights
    excepted) and shape mismatches. Needs safetensors (and transformers for a config).
    fuse_gate_up: every gated SiLU MLP whose three projections the checkpoint stores in fp8 ("block")
    becomes an :class:`~tmagemm.nn.FP8GatedMLP` before the tensors are copied (they land in its
    stacked gate/up buffers directly). A model already holding FP8GatedMLPs (converted with
    ``fuse_gate_up=True``) loads either way: the checkpoint's names are the same.
    fuse_qkv: likewise, attention q/k/v projections stored in fp8 become one stacked layer
    (:mod:`tmagemm.nn.stacked`, as ``convert(..., fuse_qkv=True)``) before the copy.
    fuse_norms: then the RMSNorms feeding fp8 layers become :class:`~tmagemm.nn.FP8RMSNorm`
    (as ``convert(..., fuse_norms=True)``; a block- or row-scaled checkpoint).
    """
    path = Path(path)
    read_quantization_config(path)  # refuse what cannot be loaded before building anything
    safe_open = _safetensors().safe_open
    files = _weight_files(path)
    handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
    where = {key: handle for handle in handles for key in handle.keys()}  # noqa: SIM118 (safe_open, not a dict)
    shape = {key: handle.get_slice(key).get_shape() for key, handle in where.items()}
    fp8_layers = {key[: -len(SCALE_SUFFIX)] for key in where if key.endswith(SCALE_SUFFIX)}
    if not fp8_layers:
        raise ValueError(f"{path}: no '*{SCALE_SUFFIX}' tensor; not an FP8 checkpoint")
    recipes = {}
    for name in sorted(fp8_layers):
        if name + ".weight" not in where:
            raise ValueError(f"{path}: {name}{SCALE_SUFFIX} has no {name}.weight beside it")
        recipes[name] = _layer_recipe(name, shape[name + ".weight"], shape[name + SCALE_SUFFIX])

    model = model_or_config if isinstance(model_or_config, nn.Module) else _build_model(model_or_config, device, dtype)
    for name in _install_experts_shells(model, recipes, shape):
        del recipes[name]
    for name, recipe in recipes.items():
        _install_shell(model, name, recipe, shape[name + ".weight"], name + ".bias" in where)
    if fuse_gate_up:
        model = fuse_gated_mlps(model, quantize=False)
    if fuse_qkv:
        model = fuse_stacked_projections(model, quantize=False)
    if fuse_norms:
        model = fuse_rms_norms(model)
    _copy_tensors(model, where, path, strict)
    return model


def _install_experts_shells(model: nn.Module, recipes: dict, shape: dict) -> list[str]:
    """Make every experts module of ``model`` whose experts the checkpoint stores in fp8
    (``<module>.<e>.gate_proj`` / ``up_proj`` / ``down_proj``, the hub's layout) an FP8Experts of
    their recipe; return those layer names (the rest are linear layers). Per-expert layers whose
    module is not an experts module (a ModuleList of MLPs) are left to the linear layers' path."""
    taken = []
    for prefix, experts in sorted(expert_checkpoint_names(recipes).items()):
        try:
            module = model.get_submodule(prefix)
        except AttributeError:
            continue
        if not isinstance(module, FP8Experts) and experts_reason(module) is not None:
            continue
        names = [f"{prefix}.{g}.{p}" for g in sorted(experts) for p in ("gate_proj", "up_proj", "down_proj")]
        layer_recipes = {recipes.get(n) for n in names}
        if len(layer_recipes) != 1 or None in layer_recipes:
            raise ValueError(f"{prefix}: the checkpoint's experts have mixed recipes or lack projections "
                             f"({sorted(map(str, layer_recipes))})")
        recipe = layer_recipes.pop()
        i, h = shape[f"{prefix}.{min(experts)}.gate_proj.weight"]
        if isinstance(module, FP8Experts):
            if (module.recipe, module.hidden_size, module.intermediate_size) != (recipe, h, i):
                raise ValueError(f"{prefix}: the model's FP8Experts has recipe {module.recipe!r}, H = "
                                 f"{module.hidden_size}, I = {module.intermediate_size}; the checkpoint {recipe!r}, "
                                 f"H = {h}, I = {i}")
        else:
            e, two_i, model_h = module.gate_up_proj.shape
            if (two_i // 2, model_h) != (i, h):
                raise ValueError(f"{prefix}: the model's experts have H = {model_h}, I = {two_i // 2}; the "
                                 f"checkpoint's H = {h}, I = {i}")
            device = module.gate_up_proj.device
            shell = FP8Experts(e, h, i, recipe, device=None if device.type == "meta" else device)
            parent_name, _, child = prefix.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, shell)
        taken += [n for n in names if n in recipes]
    return taken


def _install_shell(model: nn.Module, name: str, recipe: str, weight_shape, has_bias: bool) -> None:
    """Make ``model.<name>`` an FP8Linear of ``recipe`` (an nn.Linear is replaced by an empty one)."""
    try:
        layer = model.get_submodule(name)
    except AttributeError as exc:
        raise ValueError(f"the checkpoint has an fp8 layer {name!r} that the model lacks") from exc
    n, k = weight_shape
    if isinstance(layer, FP8Linear):
        if layer.recipe != recipe or (layer.out_features, layer.in_features) != (n, k):
            raise ValueError(f"{name}: the model's FP8Linear has recipe {layer.recipe!r} and weight "
                             f"{(layer.out_features, layer.in_features)}; the checkpoint holds {recipe!r} {(n, k)}")
        return
    if not isinstance(layer, nn.Linear):
        raise TypeError(f"{name}: the checkpoint holds an fp8 linear layer there, the model a {type(layer).__name__}")
    if (layer.out_features, layer.in_features) != (n, k):
        raise ValueError(f"{name}: the model's weight has shape {(layer.out_features, layer.in_features)}, the "
                         f"checkpoint's {(n, k)}")
    bias_dtype = layer.weight.dtype if layer.weight.dtype in (torch.bfloat16, torch.float16, torch.float32) \
        else torch.bfloat16
    device = layer.weight.device
    shell = FP8Linear(k, n, has_bias, recipe, bias_dtype, device=None if device.type == "meta" else device)
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, shell)


@torch.no_grad()
def _copy_tensors(model: nn.Module, where: dict, path: Path, strict: bool) -> None:
    targets = model.state_dict(keep_vars=True)
    fp8_weights = {key for key, target in targets.items() if target.dtype == FP8}
    loaded, unexpected, mismatched = set(), [], []
    for key, handle in where.items():
        target = targets.get(key)
        if target is None:
            unexpected.append(key)
            continue
        value = handle.get_tensor(key)
        if key in fp8_weights and value.dtype != FP8:
            raise ValueError(f"{path}: {key} has dtype {value.dtype}; fp8 weights must be float8_e4m3fn")
        if key.endswith(SCALE_SUFFIX) and value.numel() == target.numel():
            value = value.reshape(target.shape)  # per-tensor () / (1, 1), per-channel (N,)
        if tuple(value.shape) != tuple(target.shape):
            mismatched.append(f"{key}: checkpoint {tuple(value.shape)}, model {tuple(target.shape)}")
            continue
        target.copy_(value)
        loaded.add(id(target))
    missing = [key for key, target in targets.items() if id(target) not in loaded]
    problems = [f"{what}: {', '.join(keys[:6])}{' ...' if len(keys) > 6 else ''} ({len(keys)})"
                for what, keys in (("shape mismatches", mismatched), ("unexpected in the checkpoint", unexpected),
                                   ("missing from the checkpoint", missing)) if keys]
    if mismatched or (strict and problems):
        raise ValueError(f"loading {path}: " + "; ".join(problems))


def from_pretrained_fp8(path, *, device=None, dtype=None, strict: bool = True,
                        fuse_gate_up: bool = False, fuse_qkv: bool = False, fuse_norms: bool = False) -> nn.Module:
    """A transformers causal LM built from the ``config.json`` in ``path`` and loaded from its
    FP8 checkpoint (see :func:`load_fp8_checkpoint`, also for ``fuse_gate_up``, ``fuse_qkv`` and
    ``fuse_norms``), in eval mode. Reads local files only."""
    try:
        from transformers import AutoConfig
    except ImportError as exc:
        raise ImportError("from_pretrained_fp8 needs transformers (pip install transformers)") from exc
    config = AutoConfig.from_pretrained(str(path))
    return load_fp8_checkpoint(config, path, device=device, dtype=dtype, strict=strict,
                               fuse_gate_up=fuse_gate_up, fuse_qkv=fuse_qkv, fuse_norms=fuse_norms).eval()
