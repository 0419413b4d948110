"""The benchmark suite behind ``tmagemm bench`` / ``tmagemm report``.

shapes (presets), providers (tmagemm variants and cuBLAS peers), timing (L2-flushed events,
CUDA graphs, host loop, device ceilings), runner (the loop), results (long-form JSON/CSV),
report (terminal tables) and plots (PNG figures). ``tma_copy`` is the TMA copy-throughput
benchmark of the TMA toolkit.
"""
