#!/usr/bin/env bash
# Config sweep of the native persistent GEMMs for the device machine (one `run` call):
#   1. build every swept config and every test variant in parallel (NVRTC, CPU),
#   2. the sweep (scripts/gpu/native_tune.py: graph-timed, L2 flushed, vs cuBLAS, two phases),
#   3. the native GPU tests with the time left, 4. compute-sanitizer on the persistent rungs.
# Details go under $OUT (native_tune.json, tune.log, pytest.log); the compact tables print last.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/native_tune_out}
mkdir -p "$OUT"
T0=$SECONDS
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"

echo "== build"
( timeout 90 python scripts/gpu/native_tune.py --precompile > "$OUT/build_tune.log" 2>&1; echo "tune builds rc=$?" ) &
( timeout 90 python scripts/gpu/native_bench.py --precompile > "$OUT/build_tests.log" 2>&1; echo "test builds rc=$?" ) &
wait
grep -il "error" "$OUT"/build_*.log && tail -n 20 "$OUT"/build_*.log

echo "== smoke ($((SECONDS - T0))s)"  # a multicast pipeline that deadlocks must not eat the job
for r in cuda.persistent_coop_mc cuda.persistent_pingpong_mc; do
  timeout 40 python scripts/gpu/native_bench.py --smoke "$r" 2>&1 | tail -n 2 || { echo "smoke FAILED/hung: $r"; exit 1; }
done

echo "== sweep ($((SECONDS - T0))s)"
timeout 215 python scripts/gpu/native_tune.py "$OUT" --budget-s 175 > "$OUT/tune.log" 2>&1
echo "sweep rc=$?"

echo "== tests ($((SECONDS - T0))s)"
LEFT=$((420 - (SECONDS - T0)))
if [ "$LEFT" -gt 20 ]; then
  timeout "$LEFT" python -m pytest -q -p no:cacheprovider tests/test_native_gemm.py > "$OUT/pytest.log" 2>&1
  echo "pytest rc=$?"; tail -n 8 "$OUT/pytest.log" | cut -c1-300
else
  echo "tests skipped: no time left"
fi
echo "== sanitizer, persistent rungs ($((SECONDS - T0))s)"
CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n 1)
for tool in memcheck synccheck racecheck; do
  [ -n "$CS" ] && [ $((SECONDS - T0)) -lt 500 ] || { echo "$tool skipped"; continue; }
  timeout 40 "$CS" --tool "$tool" --report-api-errors no --print-limit 5 python scripts/gpu/native_sanitize.py \
    cuda.persistent_coop cuda.persistent_coop_mc cuda.persistent_pingpong_mc > "$OUT/sanitize_$tool.log" 2>&1
  echo "$tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize_$tool.log" | head -n 2 | tr '\n' ' ')"
done

echo "== tables"
sed -n '/^phase 1/,$p' "$OUT/tune.log"
grep -E "budget reached|Error|error" "$OUT/tune.log" | head -n 5
echo "total $((SECONDS - T0))s"
