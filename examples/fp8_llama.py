"""A small Llama in FP8 end to end: build it from a transformers LlamaConfig (random weights,
nothing downloaded), convert its linear layers to tmagemm.nn.FP8Linear (128x128 block weights,
1x128 activations), save the FP8 checkpoint in the Hugging Face layout, load it back, check the
round trip is bit-exact, and generate greedily next to the unquantized model.

    python examples/fp8_llama.py                 # a Hopper GPU: bfloat16
    python examples/fp8_llama.py --device cpu    # no GPU: float16 under the Triton interpreter
    python examples/fp8_llama.py --fuse-gate-up  # MLPs as tnn.FP8GatedMLP (fused gate/up kernel)
    python examples/fp8_llama.py --fuse-gate-up --fuse-qkv  # and attention q/k/v as one stacked GEMM
    python examples/fp8_llama.py --fuse-gate-up --fuse-qkv --fuse-norms  # and norms quantizing for them

On the CPU the script sets TRITON_INTERPRET=1 itself (before tmagemm is imported) and runs in
float16; it takes seconds (each FP8 GEMM is interpreted). Needs transformers and safetensors.
"""

from __future__ import annotations

import argparse
import copy
import os
import tempfile
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--recipe", choices=["block", "row", "tensor"], default="block")
    parser.add_argument("--tokens", type=int, default=8, help="new tokens to generate")
    parser.add_argument("--save-dir", help="keep the FP8 checkpoint here (default: a temporary directory)")
    parser.add_argument("--fuse-gate-up", action="store_true",
                        help="block recipe: each MLP as tnn.FP8GatedMLP (gate/up GEMMs, SiLU * up and the down "
                             "projection's input quantization in one kernel), converted and reloaded so")
    parser.add_argument("--fuse-qkv", action="store_true",
                        help="block or row recipe: each attention's q/k/v projections as one stacked GEMM")
    parser.add_argument("--fuse-norms", action="store_true",
                        help="block or row recipe: each decoder layer's RMSNorms as tnn.FP8RMSNorm, quantizing "
                             "their output for the FP8 layers they feed in the norm's own kernel")
    args = parser.parse_args()
    if args.fuse_gate_up and args.recipe != "block":
        parser.error("--fuse-gate-up needs --recipe block")
    for flag, wanted in (("--fuse-qkv", args.fuse_qkv), ("--fuse-norms", args.fuse_norms)):
        if wanted and args.recipe == "tensor":
            parser.error(f"{flag} needs --recipe block or row")
    if args.device == "cpu":
        # Must be set before tmagemm (and its @triton.jit kernels) is imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float16

    from transformers import LlamaConfig, LlamaForCausalLM

    import tmagemm.nn as tnn

    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=1000, max_position_embeddings=256,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    reference = LlamaForCausalLM(config).to(device=args.device, dtype=dtype).eval()

    # lm_head (vocab 1000) stays high precision
    fusions = {"fuse_gate_up": args.fuse_gate_up, "fuse_qkv": args.fuse_qkv, "fuse_norms": args.fuse_norms}
    model = tnn.convert(copy.deepcopy(reference), args.recipe, **fusions)
    fp8 = [name for name, m in model.named_modules() if isinstance(m, tnn.FP8Linear)]
    fused = [name for name, m in model.named_modules() if isinstance(m, tnn.FP8GatedMLP)]
    stacks = [name for name, m in model.named_modules() if isinstance(m, tnn.FP8StackedLinear)]
    norms = [name for name, m in model.named_modules() if isinstance(m, tnn.FP8RMSNorm)]
    print(f"{args.device}, {dtype}: {len(fp8)} linear layers in FP8 ({args.recipe}), e.g. {fp8[0]}: "
          f"{model.get_submodule(fp8[0])}" + (f"; {len(fused)} fused MLPs, e.g. {fused[0]}" if fused else "")
          + (f"; {len(stacks)} stacked q/k/v, e.g. {stacks[0]}" if stacks else "")
          + (f"; {len(norms)} fused norms, e.g. {norms[0]}" if norms else ""))

    with tempfile.TemporaryDirectory() as tmp:
        path = tnn.save_fp8_checkpoint(model, args.save_dir or tmp)
        sizes = ", ".join(f"{f.name} {f.stat().st_size / 2**20:.2f} MiB" for f in sorted(Path(path).iterdir()))
        print(f"saved {path}: {sizes}")
        loaded = tnn.from_pretrained_fp8(path, device=args.device, dtype=dtype, **fusions)
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
    print(f"{agree}/{len(tokens_ref)} tokens agree (random weights give flat logits; a real model's agree more)")


if __name__ == "__main__":
    main()
