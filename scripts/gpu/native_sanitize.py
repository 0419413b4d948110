"""Small runs of every native rung (and the promoting fp8 mainloop) for compute-sanitizer
(memcheck / racecheck / synccheck).

    compute-sanitizer --tool racecheck python scripts/gpu/native_sanitize.py [RUNG ...]

Shapes are ragged and, for the persistent rungs, run on 2 CTAs so each walks several tiles.
"""

import sys
from dataclasses import replace

import torch

from tmagemm.cuda import gemm as native
from tmagemm.dispatch import GemmArgs

# fp8 with use_fast_accum=False: the cooperative kernel's promoting mainloop.
PROMOTE = "cuda.persistent_coop+promote"
names = sys.argv[1:] or [*native.RUNGS, PROMOTE]
for name in names:
    m, n, k = 200, 264, 208
    config = native.coop_config(m, n, k, 1, True, 132, fast_accum=False) if name == PROMOTE else native.RUNGS[name]
    if config.kernel == "persistent":
        config = replace(config, ctas=2)
    families = ((torch.float8_e4m3fn, True),) if config.promote else ((torch.bfloat16, False), (torch.float8_e4m3fn, True))
    for ab, k_major in families:
        a = torch.randn(m, k, device="cuda").to(ab)
        w = torch.randn(n, k, device="cuda").to(ab)
        b = w.t() if k_major else w.t().contiguous()
        out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        native.run(GemmArgs(a, b, out, fast_accum=not config.promote), config)
        torch.cuda.synchronize()
        ref = a.float() @ b.float()
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        print(f"{name} {ab}: rel err {err:.1e}", flush=True)
