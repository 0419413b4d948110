"""Where the time goes in fp8 GEMMs at N = 4096: time(K) = fixed + slope * K, ours vs cuBLAS.

    python scripts/gpu/fixed_cost.py

For M = 1024 and 4096 and K = 256..8192, times `cuda.persistent_coop` (its per-shape config) and
torch._scaled_mm(use_fast_accum=True) side by side (CUDA-graph replay, L2 flushed, median of 3
medians). The slope between K = 4096 and 8192 is the mainloop's throughput; the intercept is
what a call pays outside it (launch, pipeline fill, epilogue, output drain).
"""

import functools
import statistics

import torch

from native_bench import make, peer
from tmagemm.bench.timing import Timer
from tmagemm.cuda import gemm as native

F8, BF16 = torch.float8_e4m3fn, torch.bfloat16

timer = Timer(torch.device("cuda"), budget_ms=60.0, min_reps=15, max_reps=80)
sms = torch.cuda.get_device_properties(0).multi_processor_count
for m in (1024, 4096):
    times = {}
    for k in (256, 512, 1024, 2048, 4096, 8192):
        args = make((m, 4096, k), F8, BF16, True)
        fn = peer(args)
        call = functools.partial(native._Launch(args, native.coop_config(m, 4096, k, 1, True, sms)), args)
        call()
        fn()
        torch.cuda.synchronize()
        times[k] = (statistics.median([timer.graph(fn).median_us for _ in range(3)]),
                    statistics.median([timer.graph(call).median_us for _ in range(3)]))
        print(f"M={m} N=4096 K={k}: cuBLAS {times[k][0]:.1f} us, ours {times[k][1]:.1f} us", flush=True)
    for who, i in (("cuBLAS", 0), ("ours", 1)):
        slope = (times[8192][i] - times[4096][i]) / 4096
        tflops = 2 * m * 4096 * 4096 / (slope * 4096) / 1e6
        print(f"M={m} {who}: {slope * 1024:.2f} us per 1024 of K ({tflops:.0f} TFLOP/s), "
              f"fixed {times[4096][i] - slope * 4096:.1f} us", flush=True)
