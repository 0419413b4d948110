#!/usr/bin/env bash
# TMA toolkit on the GPU: environment facts, GPU tests of tensor maps / jit / TMA copy kernels,
# a probe dump of swizzle layouts, the copy benchmark + host costs, and a memcheck run.
# Usage (repo root): OUT=/some/dir bash scripts/gpu/tma.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
export TMAGEMM_CACHE_DIR=/tmp/tmagemm-cache-tma
OUT=${OUT:-/tmp/tma-out}
mkdir -p "$OUT"

echo "== environment"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/device.txt"
python - <<'PY' 2>&1 | tee "$OUT/env.txt"
import torch, triton, cuda.bindings
from tmagemm import jit
print("torch", torch.__version__, "triton", triton.__version__, "cuda.bindings", cuda.bindings.__version__, "nvrtc", jit.nvrtc_version())
try:
    from cuda.pathfinder import load_nvidia_dynamic_lib
    print("libnvrtc:", load_nvidia_dynamic_lib("nvrtc").abs_path)
except Exception as exc:
    print("pathfinder:", type(exc).__name__, exc)
from tmagemm.jit.tools import cuobjdump_path
print("cuobjdump:", cuobjdump_path())
PY

echo "== GPU tests (one process per group: a faulting kernel poisons its CUDA context)"
for group in "tests/test_tma.py tests/test_jit.py" "tests/test_tma_copy.py -k elementwise" \
             "tests/test_tma_copy.py -k probe" "tests/test_tma_copy.py -k copy_exact"; do
  name=$(echo "$group" | tr -c 'a-z' '_' | cut -c1-40)
  timeout 60 python -m pytest -q -m gpu -p no:cacheprovider --tb=short $group > "$OUT/pytest_$name.txt" 2>&1
  echo "[$group] rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest_$name.txt" | tail -8
  grep -E "^E  .*(wrote|differ|bad index)" "$OUT/pytest_$name.txt" | head -4
done

echo "== probe dump (inner box < swizzle span)"
timeout 30 python - <<'PY' 2>&1 | tee "$OUT/probe_dump.txt" | tail -12
import torch
from tmagemm import tma
from tmagemm.cuda import tma_copy
x = torch.arange(64 * 64, dtype=torch.int32, device="cuda").reshape(64, 64)
for swizzle, cols in [("128B", 16), ("128B", 8), ("64B", 8), ("32B", 4)]:
    for rows in (3, 9):
        img = tma_copy.probe(x, (rows, cols), (0, 0), swizzle=swizzle, sentinel=0xFF).cpu().view(torch.int32)
        # element value v = r*64 + c -> print (r, c) at each 4-byte slot of the first 2 KB
        cells = [(-1 if v == -1 else (v // 64, v % 64)) for v in img[:512].tolist()]
        torch.save(img, f"{__import__('os').environ.get('OUT', '/tmp')}/probe_{swizzle}_{cols}x{rows}.pt")
        print(swizzle, "inner bytes", cols * 4, "rows", rows, "->", cells[:40])
PY

echo "== benchmark"
timeout 90 python -m tmagemm.bench.tma_copy --json "$OUT/tma_bench.json" 2>&1 | tee "$OUT/bench.txt" | tail -40

echo "== compute-sanitizer"
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
if [ -n "$SAN" ]; then
  timeout 40 "$SAN" --tool memcheck --report-api-errors no python - > "$OUT/memcheck.txt" 2>&1 <<'PY'
import torch
from tmagemm.cuda import tma_copy
from tmagemm.cuda.tma_copy import CopyConfig, ElementwiseConfig
x = torch.randn(77, 200, device="cuda").to(torch.bfloat16)
out = tma_copy.elementwise_2d(x, config=ElementwiseConfig(64, 64, "128B"))
y = torch.empty_like(x); tma_copy.copy_2d(x, y, CopyConfig(32, 64, "128B", 3))
img = tma_copy.probe(x, (16, 64), (70, 144), swizzle="128B")
torch.cuda.synchronize(); print("ok", bool(torch.equal(y, x)))
PY
  echo "memcheck rc=$?"; tail -4 "$OUT/memcheck.txt"
else
  echo "compute-sanitizer not found"
fi
