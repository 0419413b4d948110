"""Small runs of every native rung for compute-sanitizer (memcheck / racecheck / synccheck).

    compute-sanitizer --tool racecheck python scripts/gpu/native_sanitize.py [RUNG ...]

Shapes are ragged and, for the persistent rungs, run on 2 CTAs so each walks several tiles.
"""

import sys
from dataclasses import replace

import torch

from tmagemm.cuda import gemm as native
from tmagemm.dispatch import GemmArgs

names = sys.argv[1:] or list(native.RUNGS)
for name in names:
    config = native.RUNGS[name]
    if config.kernel == "persistent":
        config = replace(config, ctas=2)
    for ab, k_major in ((torch.bfloat16, False), (torch.float8_e4m3fn, True)):
        m, n, k = 200, 264, 208
        a = torch.randn(m, k, device="cuda").to(ab)
        w = torch.randn(n, k, device="cuda").to(ab)
        b = w.t() if k_major else w.t().contiguous()
        out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        native.run(GemmArgs(a, b, out), config)
        torch.cuda.synchronize()
        ref = a.float() @ b.float()
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        print(f"{name} {ab}: rel err {err:.1e}", flush=True)
