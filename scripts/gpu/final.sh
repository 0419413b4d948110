#!/usr/bin/env bash
# One device job for the whole library: GPU tests of the public API, the direct launch path, the
# Triton and native GEMMs and the small-M kernel; then host time per call and the graph-timed speed
# table (scripts/gpu/foundation.py); then the small-M streaming floor (scripts/gpu/stream_floor.py).
# Prints pass/fail counts, the host-time block and the speed table last; logs go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 TMAGEMM_CACHE_DIR=${TMAGEMM_CACHE_DIR:-/tmp/tmagemm-cache}
OUT=${OUT:-/tmp/final_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout ${TEST_TIMEOUT:-240} python -m pytest -q -p no:cacheprovider -m gpu tests/test_direct_launch.py \
  tests/test_gemm_gpu.py tests/test_native_gemm.py tests/test_splitk.py >"$OUT/pytest.txt" 2>&1
echo "pytest (gpu-marked) rc=$?"
timeout 90 python -m pytest -q -p no:cacheprovider tests/test_api.py >>"$OUT/pytest.txt" 2>&1
echo "pytest (api on cuda) rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest.txt" | tail -12
grep -E "^E  " "$OUT/pytest.txt" | cut -c1-220 | head -8
timeout 240 python scripts/gpu/foundation.py --skip-correctness >"$OUT/foundation.txt" 2>&1
echo "foundation rc=$?"
timeout 120 python scripts/gpu/stream_floor.py >"$OUT/stream_floor.txt" 2>&1
echo "stream_floor rc=$?"
grep -v "UserWarning\|warn_once" "$OUT/stream_floor.txt" | grep -E "copy|M=   1|M=  64|weight" | head -40
grep -A16 "^host time per call" "$OUT/foundation.txt"
grep -E "^(variant|triton|cuda|tmagemm)|correctness" "$OUT/foundation.txt" | tail -70
