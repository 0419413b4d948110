"""A small Mixture-of-Experts model in FP8 end to end: build it from a transformers config (random
weights, nothing downloaded), convert it (linear layers to tmagemm.nn.FP8Linear, each layer's
experts to tmagemm.nn.FP8Experts: two grouped fp8 GEMMs over every expert), save the FP8
checkpoint in the layout FP8 MoE checkpoints on the hub use (each expert's gate_proj / up_proj /
down_proj with its weight_scale_inv), load it back, check the round trip is bit-exact, and
generate greedily next to the unquantized model.

    python examples/fp8_moe.py                          # a Hopper GPU: bfloat16, Qwen3-MoE
    python examples/fp8_moe.py --model deepseek-v3      # MLA attention, a shared expert, grouped routing
    python examples/fp8_moe.py --model mixtral --recipe row
    python examples/fp8_moe.py --device cpu             # no GPU: float16 under the Triton interpreter

On the CPU the script sets TRITON_INTERPRET=1 itself (before tmagemm is imported) and runs in
float16; it takes seconds. Needs transformers 5 (experts as 3-D weights) and safetensors.
"""

from __future__ import annotations

import argparse
import copy
import os
import tempfile

import torch

# (config class, model class, the config's MoE fields) of each family, at a small size
MODELS = {
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 256, "head_dim": 64}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 8, "num_experts_per_tok": 2}),
    "deepseek-v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    {"n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 256,
                     "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1,
                     "kv_lora_rank": 64, "q_lora_rank": 64, "qk_rope_head_dim": 32, "qk_nope_head_dim": 32,
                     "v_head_dim": 64, "head_dim": 32}),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen3-moe")
    parser.add_argument("--recipe", choices=["block", "row"], default="block")
    parser.add_argument("--tokens", type=int, default=8, help="new tokens to generate")
    args = parser.parse_args()
    if args.device == "cpu":
        # Must be set before tmagemm (and its @triton.jit kernels) is imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float16

    import transformers

    import tmagemm.nn as tnn

    config_name, model_name, moe = MODELS[args.model]
    if not hasattr(transformers, model_name):
        raise SystemExit(f"transformers {transformers.__version__} has no {model_name}")
    config = getattr(transformers, config_name)(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        vocab_size=1000, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2, **moe)
    torch.manual_seed(0)
    reference = getattr(transformers, model_name)(config).to(device=args.device, dtype=dtype).eval()

    model = tnn.convert(copy.deepcopy(reference), args.recipe)  # lm_head stays high precision
    experts = [name for name, m in model.named_modules() if isinstance(m, tnn.FP8Experts)]
    linears = [name for name, m in model.named_modules() if isinstance(m, tnn.FP8Linear)]
    if not experts:
        raise SystemExit(f"transformers {transformers.__version__} keeps {model_name}'s experts as a ModuleList of "
                         "MLPs (transformers 4); convert made their linear layers FP8Linear one by one")
    print(f"{args.device}, {dtype}, {args.model}: {len(experts)} experts modules in FP8 ({args.recipe}), e.g. "
          f"{experts[0]}: {model.get_submodule(experts[0])}; {len(linears)} linear layers")

    with tempfile.TemporaryDirectory() as tmp:
        path = tnn.save_fp8_checkpoint(model, tmp)
        prefix = experts[0] + ".0."
        keys = [k[len(prefix):] for k in model.state_dict() if k.startswith(prefix)]
        print(f"saved {path}: expert 0 of {experts[0]} as {prefix}{{{', '.join(keys)}}}")
        loaded = tnn.from_pretrained_fp8(path, device=args.device, dtype=dtype)
    want, got = model.state_dict(), loaded.state_dict()
    same = want.keys() == got.keys() and all(
        torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)) if want[k].dtype == torch.float8_e4m3fn
        else torch.equal(got[k], want[k]) for k in want)
    print(f"reloaded: {len(got)} tensors, bit-exact round trip: {same}")
    if not same:
        raise SystemExit("the reloaded checkpoint differs from the saved model")

    ids = torch.tensor([[1, 15, 27, 99, 512, 3]], device=args.device)
    with torch.no_grad():
        logits_ref, logits_fp8 = reference(ids).logits.float(), loaded(ids).logits.float()
        err = float((logits_fp8 - logits_ref).norm() / logits_ref.norm())
        kwargs = {"attention_mask": torch.ones_like(ids), "max_new_tokens": args.tokens,
                  "min_new_tokens": args.tokens, "do_sample": False, "pad_token_id": 0}
        tokens_fp8 = loaded.generate(ids, **kwargs)[0, ids.shape[1]:].tolist()
        tokens_ref = reference.generate(ids, **kwargs)[0, ids.shape[1]:].tolist()
    print(f"prompt logits: FP8 vs {dtype} relative error {err:.4f}")
    print(f"greedy FP8:   {tokens_fp8}")
    print(f"greedy {str(dtype).removeprefix('torch.')}: {tokens_ref}")
    agree = sum(a == b for a, b in zip(tokens_fp8, tokens_ref))
    print(f"{agree}/{len(tokens_ref)} tokens agree (random weights give flat logits, and fp8 rounding can change "
          "which experts a router picks; a real model's agree more)")


if __name__ == "__main__":
    main()
