#!/usr/bin/env bash
# One device job for the whole library: GPU tests of the public API, the Triton and native GEMMs
# and the small-M kernel, then the graph-timed speed table (scripts/gpu/foundation.py).
# Prints pass/fail counts and the speed table last; logs go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 TMAGEMM_CACHE_DIR=${TMAGEMM_CACHE_DIR:-/tmp/tmagemm-cache}
OUT=${OUT:-/tmp/final_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 200 python -m pytest -q -p no:cacheprovider -m gpu tests/test_gemm_gpu.py tests/test_native_gemm.py \
  tests/test_splitk.py >"$OUT/pytest.txt" 2>&1
echo "pytest (gpu-marked) rc=$?"
timeout 60 python -m pytest -q -p no:cacheprovider tests/test_api.py >>"$OUT/pytest.txt" 2>&1
echo "pytest (api on cuda) rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest.txt" | tail -12
grep -E "^E  " "$OUT/pytest.txt" | cut -c1-220 | head -8
timeout 200 python scripts/gpu/foundation.py --skip-correctness >"$OUT/foundation.txt" 2>&1
echo "foundation rc=$?"
grep -v "UserWarning\|warn_once" "$OUT/foundation.txt" | tail -62
