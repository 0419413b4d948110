"""Problem shapes for the benchmark: an M sweep at N = K = 4096, LLM projections, squares, custom lists."""

from __future__ import annotations

import itertools
from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    """One GEMM problem ``(M, K) @ (K, N)``; ``label`` names where it comes from (e.g. a layer)."""

    m: int
    n: int
    k: int
    label: str = ""

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k

    def __str__(self) -> str:
        base = f"{self.m}x{self.n}x{self.k}"
        return f"{base} {self.label}" if self.label else base


# The seed write-ups' figures 1 and 10: M from a single token to a large batch at N = K = 4096.
SWEEP_M = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)

# (label, N, K) of the dense projections of common open models, unsplit (tensor parallel = 1).
# Fused projections are listed as the serving stacks run them: QKV as one GEMM, gate+up as one.
LLM_LAYERS = (
    # Llama-3 8B: hidden 4096, 32 q heads / 8 kv heads of 128, MLP 14336.
    ("llama3-8b.qkv", 6144, 4096),
    ("llama3-8b.o", 4096, 4096),
    ("llama3-8b.gate_up", 28672, 4096),
    ("llama3-8b.down", 4096, 14336),
    # Llama-3 70B: hidden 8192, 64 q heads / 8 kv heads of 128, MLP 28672.
    ("llama3-70b.qkv", 10240, 8192),
    ("llama3-70b.o", 8192, 8192),
    ("llama3-70b.gate_up", 57344, 8192),
    ("llama3-70b.down", 8192, 28672),
    # Qwen2.5 7B: hidden 3584, 28 q heads / 4 kv heads of 128, MLP 18944.
    ("qwen2.5-7b.qkv", 4608, 3584),
    ("qwen2.5-7b.o", 3584, 3584),
    ("qwen2.5-7b.gate_up", 37888, 3584),
    ("qwen2.5-7b.down", 3584, 18944),
    # DeepSeek-V3 dense layers: hidden 7168, MLA (q_lora 1536, kv_lora 512 + rope 64,
    # 128 heads of nope 128 + rope 64, v 128), dense MLP 18432.
    ("deepseek-v3.q_a+kv_a", 2112, 7168),
    ("deepseek-v3.q_b", 24576, 1536),
    ("deepseek-v3.kv_b", 32768, 512),
    ("deepseek-v3.o", 7168, 16384),
    ("deepseek-v3.gate_up", 36864, 7168),
    ("deepseek-v3.down", 7168, 18432),
)
LLM_M = (64, 4096)  # a decode batch and a prefill chunk

SQUARE_SIZES = (1024, 2048, 4096, 8192, 16384)

# Small shapes for the CPU interpreter check: single row, ragged M/N, K over several tiles.
CHECK_SHAPES = (Shape(1, 64, 64), Shape(17, 80, 96), Shape(64, 128, 192))

# (label, N, K) of block-scaled FP8 checkpoints: DeepGEMM's six DeepSeek-V3 shapes, then Qwen3
# FP8 projections (Qwen3-32B: hidden 5120, 64 q / 8 kv heads of 128, MLP 25600; Qwen3-30B-A3B's
# attention: hidden 2048, 32 q / 4 kv heads of 128).
BLOCK_LAYERS = (
    ("deepseek-v3.2112x7168", 2112, 7168),
    ("deepseek-v3.24576x1536", 24576, 1536),
    ("deepseek-v3.32768x512", 32768, 512),
    ("deepseek-v3.7168x16384", 7168, 16384),
    ("deepseek-v3.4096x7168", 4096, 7168),
    ("deepseek-v3.7168x2048", 7168, 2048),
    ("qwen3-32b.qkv", 10240, 5120),
    ("qwen3-32b.gate_up", 51200, 5120),
    ("qwen3-32b.down", 5120, 25600),
    ("qwen3-30b-a3b.qkv", 5120, 2048),
)
BLOCK_M = (1, 16, 64, 128, 4096)

PRESETS = ("sweep", "llm", "square", "block")


def preset_shapes(preset: str, m_values: list[int] | None = None) -> list[Shape]:
    """Shapes of a preset; ``m_values`` overrides the preset's M list (sweep and llm)."""
    if preset == "sweep":
        return [Shape(m, 4096, 4096) for m in (m_values or SWEEP_M)]
    if preset == "llm":
        return [Shape(m, n, k, label) for m in (m_values or LLM_M) for label, n, k in LLM_LAYERS]
    if preset == "block":
        return [Shape(m, n, k, label) for m in (m_values or BLOCK_M) for label, n, k in BLOCK_LAYERS]
    if preset == "square":
        if m_values:
            raise ValueError("--m does not apply to the square preset; use --m/--n/--k without --preset")
        return [Shape(s, s, s) for s in SQUARE_SIZES]
    raise ValueError(f"unknown preset {preset!r}; choose one of {PRESETS}")


def custom_shapes(m: list[int], n: list[int], k: list[int]) -> list[Shape]:
    """Every combination of the given M, N and K lists."""
    for name, values in (("--m", m), ("--n", n), ("--k", k)):
        if not values:
            raise ValueError(f"custom shapes need {name} (a list of sizes)")
        bad = [v for v in values if v < 0]
        if bad:
            raise ValueError(f"{name} sizes must be >= 0, got {bad}")
    return [Shape(mm, nn, kk) for mm, nn, kk in itertools.product(m, n, k)]
