"""One call each of cuBLAS fp8 and `cuda.persistent_coop` (M x 4096 x 4096) in an NVTX range, for ncu:

    ncu --clock-control none --nvtx --nvtx-include "prof/" --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section LaunchStats \
        --metrics sm__cycles_elapsed.avg.per_second,lts__t_bytes.sum.per_second,sm__inst_executed_pipe_tensor_op_gmma.sum \
        python scripts/gpu/ncu_fp8.py 4096

`--clock-control none` keeps the clocks the GPU picks under load (power-limited for fp8), which
is what the timings see.
"""
import functools
import sys

import torch

from native_bench import make, peer
from tmagemm.cuda import gemm as native

m = int(sys.argv[1])
args = make((m, 4096, 4096), torch.float8_e4m3fn, torch.bfloat16, True)
cublas = peer(args)
config = native.coop_config(m, 4096, 4096, 1, True, torch.cuda.get_device_properties(0).multi_processor_count)
ours = functools.partial(native._Launch(args, config), args)
for _ in range(3):  # load and warm both outside the profiled range
    cublas()
    ours()
torch.cuda.synchronize()
torch.cuda.nvtx.range_push("prof")
cublas()
ours()
torch.cuda.nvtx.range_pop()
torch.cuda.synchronize()
