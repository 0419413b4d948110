"""The dispatcher's choice of kernel per problem (pure rules fitted to measurements; no GPU)."""

import pytest
import torch

from tmagemm import dispatch
from tmagemm.dispatch import GemmArgs

F8 = torch.float8_e4m3fn


def _args(m, n, k, dtype=F8):
    a = torch.empty(m, k, dtype=dtype, device="meta")
    b = torch.empty(n, k, dtype=dtype, device="meta").t()
    return GemmArgs(a, b, torch.empty(m, n, dtype=torch.bfloat16, device="meta"))


@pytest.mark.parametrize(
    "m, n, k, dtype, first",
    [
        (1, 4096, 4096, F8, "triton.splitk"),  # decode on a 16 MB weight
        (16, 4096, 14336, F8, "triton.splitk"),  # long K
        (16, 32768, 512, F8, "triton.tma"),  # short K, wide N: the tile kernel was ahead
        (32, 4096, 4096, F8, "triton.tma"),
        (32, 4096, 14336, F8, "triton.splitk"),  # K > 8192
        (32, 57344, 8192, F8, "triton.splitk"),  # 470 MB weight
        (64, 4096, 4096, F8, "triton.tma"),
        (256, 4096, 4096, F8, "triton.tma"),
        (257, 4096, 4096, F8, "cuda.persistent_coop"),  # 128x128 tiles (coop_config)
        (512, 4096, 4096, F8, "cuda.persistent_coop"),
        (256, 4096, 4096, torch.bfloat16, "triton.tma"),
        (512, 4096, 4096, torch.bfloat16, "cuda.persistent_coop"),
        (8, 4096, 4096, torch.bfloat16, "triton.tma"),  # bf16 at small M: not measured to favour split-K
        (8, 28672, 4096, torch.bfloat16, "triton.splitk"),  # ... unless the weight is >= 100 MB
        (4096, 4096, 4096, torch.bfloat16, "cuda.persistent_coop"),
    ],
)
def test_preference_table(m, n, k, dtype, first):
    order = dispatch.preference(_args(m, n, k, dtype))
    assert order[0] == first, order
    assert order[-1] == "triton.ptr"  # the pointer kernel accepts anything: always the last resort
