"""A static-cache decode step over the modules of a transformers Llama-family model, for
``tmagemm bench --preset model``.

Why not transformers' own ``generate``/``StaticCache``: their constructor arguments, mask
creation and cache layout changed across 4.4x and 5.x, and parts of their forward pass run host
code that a ``torch.cuda.graph`` capture cannot hold. This module calls the model's own modules
(embedding, RMSNorms, q/k/v/o projections, Qwen3's q/k norms, the MLP module as a whole (an
MoE block with its router and experts too), final norm, lm_head), which are stable across those versions, and does only the attention itself:

* rotary tables from the model's own ``rotary_emb`` (its rope type and theta), computed once
  for every position of the cache and indexed by a position tensor on the device;
* a static KV cache per layer, (max_batch, kv_heads, length, head_dim), written with
  ``index_copy_`` at the step's positions (a device tensor, so one captured graph serves every
  step) and read in full with a mask of the positions not yet written;
* grouped-query attention without copies: the query heads of one KV head are folded into the
  query length (q (B, kv_heads, groups * T, D) against k/v (B, kv_heads, length, D)), one
  ``F.scaled_dot_product_attention`` call per layer.

Layers are called as a transformers decoder layer computes them (pre-norm, residual adds), so the
step's logits match the model's own forward pass (checked on the CPU in float32, and in every
``--preset model`` run on the bf16 model). Sequences of a batch share their position.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# ---------------------------------------------------------------------------------- models


@dataclass(frozen=True)
class ModelSpec:
    """A model's shape. family: "llama" (LlamaForCausalLM), "qwen3" (Qwen3ForCausalLM: q/k norms)
    or "qwen3_moe" (Qwen3MoeForCausalLM: every layer's MLP ``experts`` routed experts of
    ``expert_intermediate``, ``top_k`` per token)."""

    name: str
    family: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    rope_theta: float
    eps: float = 1e-5
    experts: int = 0
    top_k: int = 0
    expert_intermediate: int = 0

    def params(self, layers: int | None = None) -> int:
        """Parameters of the model with ``layers`` layers (default its own depth)."""
        layers = self.layers if layers is None else layers
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = self.experts * self.hidden * (3 * self.expert_intermediate + 1) if self.experts else \
            3 * self.hidden * self.intermediate
        norms = 2 * self.hidden + (2 * self.head_dim if self.family.startswith("qwen3") else 0)
        return layers * (attn + mlp + norms) + 2 * self.vocab * self.hidden + self.hidden


SPECS = {s.name: s for s in (
    # Meta-Llama-3-8B's config.json (its rope_scaling is left out: it changes values, not time).
    ModelSpec("llama3-8b", "llama", 4096, 14336, 32, 32, 8, 128, 128256, 500000.0, 1e-5),
    # Qwen3-8B's config.json.
    ModelSpec("qwen3-8b", "qwen3", 4096, 12288, 36, 32, 8, 128, 151936, 1000000.0, 1e-6),
    # Qwen3-30B-A3B's config.json: 128 experts of 768, 8 per token, in every layer.
    ModelSpec("qwen3-30b-a3b", "qwen3_moe", 2048, 6144, 48, 32, 4, 128, 151936, 1000000.0, 1e-6, 128, 8, 768),
    # For tests: every projection a multiple of 16 (FP8Linear's rule) and of 128 in K.
    ModelSpec("tiny", "llama", 256, 512, 2, 4, 2, 64, 1024, 500000.0, 1e-5),
    ModelSpec("tiny-moe", "qwen3_moe", 256, 512, 2, 4, 2, 64, 1024, 1000000.0, 1e-6, 4, 2, 256),
)}  # fmt: skip


def _classes(family: str):
    import transformers

    names = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
             "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM")}[family]
    found = [getattr(transformers, n, None) for n in names]
    if None in found:
        raise ValueError(f"{family} models need transformers with {' and '.join(names)} (Qwen3: 4.51 or later); "
                         f"this is transformers {transformers.__version__}")
    return found


def build_model(spec: ModelSpec, layers: int | None, device, dtype: torch.dtype, seed: int = 0,
                init_std: float | None = None, max_positions: int = 8192) -> nn.Module:
    """A randomly initialised ``spec`` causal LM (transformers' own init, normal(0, init_std) for
    linears and embeddings; init_std None keeps the config's initializer_range, 0.02), built
    directly on ``device`` in ``dtype`` (no float32 copy, no host-to-device transfer), eval mode,
    no gradients."""
    config_cls, model_cls = _classes(spec.family)
    extra = {} if init_std is None else {"initializer_range": init_std}
    if spec.experts:  # every layer sparse; transformers' grouped_mm experts (its default where it runs)
        extra.update(num_experts=spec.experts, num_experts_per_tok=spec.top_k,
                     moe_intermediate_size=spec.expert_intermediate, decoder_sparse_step=1, mlp_only_layers=[],
                     norm_topk_prob=True)
    config = config_cls(hidden_size=spec.hidden, intermediate_size=spec.intermediate,
                        num_hidden_layers=spec.layers if layers is None else layers, num_attention_heads=spec.heads,
                        num_key_value_heads=spec.kv_heads, head_dim=spec.head_dim, vocab_size=spec.vocab,
                        max_position_embeddings=max_positions, rope_theta=spec.rope_theta, rms_norm_eps=spec.eps,
                        tie_word_embeddings=False, attention_bias=False, bos_token_id=1, eos_token_id=2,
                        **extra)  # fmt: skip
    previous = torch.get_default_dtype()
    torch.manual_seed(seed)
    try:
        # Parameters are created in ``dtype`` on ``device`` and initialised there.
        torch.set_default_dtype(dtype)
        with torch.device(device):
            model = model_cls(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval().requires_grad_(False)


def shared_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model``'s module tree that shares every parameter and buffer with it (no
    tensor is copied): converting or swapping its layers leaves ``model`` untouched."""
    memo = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, memo)


def swap_modules(model: nn.Module, want: Callable[[str, nn.Module], bool],
                 make: Callable[[nn.Module], nn.Module]) -> int:  # fmt: skip
    """Replace every module ``m`` named ``name`` with ``want(name, m)`` true by ``make(m)`` (one
    replacement per module object, reachable under any name); returns how many were replaced."""
    named = [(n, m) for n, m in model.named_modules(remove_duplicate=False) if n and want(n, m)]
    made: dict[int, nn.Module] = {}
    for name, module in named:
        if id(module) not in made:
            made[id(module)] = make(module)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, made[id(module)])
    return len(made)


def experts_touched(experts: int, top_k: int, batch: int) -> float:
    """Experts a step of ``batch`` tokens reads on average when each token picks ``top_k`` of
    ``experts`` uniformly: ``E (1 - (1 - k/E)^batch)``."""
    return experts * (1 - (1 - top_k / experts) ** batch)


def _is_experts(module: nn.Module) -> bool:
    """A layer's routed experts as one module: transformers' 3-D experts or tmagemm's FP8Experts."""
    return hasattr(module, "num_experts") and getattr(module, "gate_up_proj", None) is not None


def step_weight_bytes(model: nn.Module, batch: int | None = None) -> int:
    """Bytes of every parameter and buffer one decode step reads: the decoder layers, the final
    norm and lm_head (one embedding row per token is not counted), each storage once (views
    such as a fused MLP's gate_proj / up_proj halves of its stacked weight count with it). An
    MoE layer's experts count as the share a step of ``batch`` tokens reads on average
    (:func:`experts_touched`; all of them without a batch)."""
    inner = model.model
    top_k = getattr(model.config, "num_experts_per_tok", 0)
    share = {}
    for m in inner.layers.modules():
        if _is_experts(m) and batch is not None and top_k:
            for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)):
                share[t.untyped_storage().data_ptr()] = experts_touched(m.num_experts, top_k, batch) / m.num_experts
    seen, total = set(), 0.0
    for part in (inner.layers, inner.norm, model.lm_head):
        for name, t in (*part.named_parameters(), *part.named_buffers()):
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen and not name.endswith("inv_freq"):  # old transformers' rotary
                seen.add(storage.data_ptr())
                total += storage.nbytes() * share.get(storage.data_ptr(), 1.0)
    return int(total)


# ---------------------------------------------------------------------------------- rotary


def rope_tables(model: nn.Module, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (length, head_dim) in the model's dtype, for positions 0..length-1, from
    the model's own rotary module (transformers >= 4.45) or, failing that, the default rope of
    its config's theta."""
    config = model.config
    weight = model.model.embed_tokens.weight
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    positions = torch.arange(length, device=weight.device)
    rotary = getattr(model.model, "rotary_emb", None)
    if rotary is not None:
        cos, sin = rotary(weight.new_zeros(1, 1, head_dim), positions[None])
        return cos[0].to(weight.dtype), sin[0].to(weight.dtype)
    theta = getattr(config, "rope_theta", None) or (getattr(config, "rope_parameters", None) or {})["rope_theta"]
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=weight.device, dtype=torch.float32) / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(weight.dtype), emb.sin().to(weight.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb on x (B, T, heads, D) with cos/sin (T, 1, D)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


# ---------------------------------------------------------------------------------- decoder


class Decoder:
    """Decode steps of ``model`` (a transformers Llama or Qwen3 causal LM, or a copy of one with
    converted layers) against its own static KV cache of ``length`` positions for up to
    ``max_batch`` sequences. ``rope``: :func:`rope_tables` of the same length (shared by the
    decoders of one model's variants).

    ``forward(tokens (B, T), start (1,) long)`` runs T tokens per sequence at positions
    start..start+T-1 (T > 1 is a prefill), writes their keys and values into the cache and
    returns the logits of the last position, (B, vocab). ``step(b)`` is one decode step of the
    first b sequences reading the token buffer ``tok`` (max_batch, 1) and position ``pos`` (1,):
    both device tensors, so a graph captured around it replays any step the buffers describe.
    """

    def __init__(self, model: nn.Module, rope: tuple[torch.Tensor, torch.Tensor], max_batch: int, length: int):
        config, inner = model.config, model.model
        self.embed, self.layers, self.norm, self.lm_head = inner.embed_tokens, inner.layers, inner.norm, model.lm_head
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        if self.heads % self.kv_heads:
            raise ValueError(f"{self.heads} attention heads do not group over {self.kv_heads} KV heads")
        self.groups = self.heads // self.kv_heads
        weight = self.embed.weight
        self.device, self.dtype, self.length, self.max_batch = weight.device, weight.dtype, length, max_batch
        cos, sin = rope
        if cos.shape[0] < length:
            raise ValueError(f"rotary tables cover {cos.shape[0]} positions; the cache holds {length}")
        self.cos, self.sin = cos[:length], sin[:length]
        shape = (max_batch, self.kv_heads, length, self.head_dim)
        self.k = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in self.layers]
        self.v = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in self.layers]
        self.keys = torch.arange(length, device=self.device)
        self.tok = torch.zeros(max_batch, 1, dtype=torch.long, device=self.device)
        self.pos = torch.zeros(1, dtype=torch.long, device=self.device)

    def cache_bytes(self, batch: int) -> int:
        """KV-cache bytes one step of ``batch`` sequences reads (every position of the cache)."""
        return 2 * len(self.layers) * batch * self.kv_heads * self.length * self.head_dim * self.k[0].element_size()

    def static_tensors(self) -> list[torch.Tensor]:
        """The tensors a compiled step mutates or reads by address (caches, buffers)."""
        return [*self.k, *self.v, self.tok, self.pos]

    def forward(self, tokens: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        steps = tokens.shape[1]
        positions = start + torch.arange(steps, device=self.device)
        cos = self.cos.index_select(0, positions)[:, None, :]
        sin = self.sin.index_select(0, positions)[:, None, :]
        # Key j is visible to the query at position p iff j <= p; one row per (group, query).
        mask = (self.keys[None, :] <= positions[:, None]).repeat(self.groups, 1)
        h = self.embed(tokens)
        for i, layer in enumerate(self.layers):
            h = h + self._attention(layer.self_attn, layer.input_layernorm(h), i, positions, cos, sin, mask)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.lm_head(self.norm(h[:, -1]))

    __call__ = forward

    def _attention(self, attn: nn.Module, x: torch.Tensor, i: int, positions, cos, sin, mask) -> torch.Tensor:
        batch, steps, _ = x.shape
        hd, kvh, groups = self.head_dim, self.kv_heads, self.groups
        q = attn.q_proj(x).view(batch, steps, self.heads, hd)
        k = attn.k_proj(x).view(batch, steps, kvh, hd)
        v = attn.v_proj(x).view(batch, steps, kvh, hd)
        if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head before rotary
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        k_cache, v_cache = self.k[i][:batch], self.v[i][:batch]
        k_cache.index_copy_(2, positions, k.transpose(1, 2))
        v_cache.index_copy_(2, positions, v.transpose(1, 2))
        # Query head h reads KV head h // groups: fold the groups into the query length.
        q = q.view(batch, steps, kvh, groups, hd).permute(0, 2, 3, 1, 4).reshape(batch, kvh, groups * steps, hd)
        o = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask, scale=1.0 / math.sqrt(hd))
        o = o.view(batch, kvh, groups, steps, hd).permute(0, 3, 1, 2, 4).reshape(batch, steps, self.heads * hd)
        return attn.o_proj(o)

    def prefill(self, prompts: torch.Tensor) -> torch.Tensor:
        """Fill the cache with ``prompts`` (B, T) at positions 0..T-1; the last position's logits."""
        return self.forward(prompts, torch.zeros(1, dtype=torch.long, device=self.device))

    def reset(self, tokens: torch.Tensor, position: int) -> None:
        """Point the step buffers at ``tokens`` (max_batch,) at ``position``."""
        self.tok[:, 0].copy_(tokens)
        self.pos.fill_(position)

    def step(self, batch: int) -> torch.Tensor:
        return self.forward(self.tok[:batch], self.pos)

    def greedy(self, batch: int, logits_of_step: Callable[[], torch.Tensor], tokens: torch.Tensor, position: int,
               count: int) -> torch.Tensor:  # fmt: skip
        """``count`` greedy tokens (batch, count) from the step buffers set to (tokens, position),
        each step run by ``logits_of_step`` (an eager ``step`` or a graph replay); the buffers are
        set back afterwards."""
        self.reset(tokens, position)
        out = []
        for _ in range(count):
            nxt = logits_of_step().argmax(-1)
            out.append(nxt)
            self.tok[:batch, 0].copy_(nxt)
            self.pos.add_(1)
        self.reset(tokens, position)
        return torch.stack(out, dim=1)
