#!/usr/bin/env bash
# Native GEMM ladder job for the device machine (one `run` call):
#   1. build every variant in parallel (NVRTC, CPU), 2. a hang guard: one small run per rung in
#   its own process with a timeout, 3. GPU tests, 4. benchmark vs cuBLAS (rungs that passed the
#   guard) with 100 s kept back for 5. compute-sanitizer memcheck/racecheck/synccheck on small shapes if time is left.
# Details go under $OUT; a compact table is printed last.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/native_out}
mkdir -p "$OUT"
T0=$SECONDS
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"

echo "== build"; timeout 120 python scripts/gpu/native_bench.py --precompile 2>&1 | tail -n 30
echo "== smoke ($((SECONDS - T0))s)"
OK=""
for r in $(python -c "from tmagemm.cuda.gemm import RUNGS; print(*RUNGS)"); do
  if timeout 40 python scripts/gpu/native_bench.py --smoke "$r" 2>&1 | tail -n 3; then OK="$OK,$r"; else echo "smoke FAILED/hung: $r"; fi
done
OK=${OK#,}
echo "rungs ok: $OK"

echo "== tests ($((SECONDS - T0))s)"
timeout 130 python -m pytest -q -p no:cacheprovider tests/test_native_gemm.py --maxfail=25 2>&1 > "$OUT/pytest.log"
tail -n 25 "$OUT/pytest.log" | cut -c1-400

echo "== bench ($((SECONDS - T0))s)"
LEFT=$((400 - (SECONDS - T0) - 100))
[ -n "$OK" ] && timeout $((LEFT + 30)) python scripts/gpu/native_bench.py "$OUT" --rungs "$OK" --budget-s "$LEFT" 2>&1 | tee "$OUT/bench.log" | tail -n 40
echo "== sanitizer ($((SECONDS - T0))s)"
CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n 1)
if [ -n "$CS" ] && [ -n "$OK" ]; then
  for tool in memcheck synccheck racecheck; do
    [ $((SECONDS - T0)) -lt 370 ] || { echo "$tool skipped: no time"; continue; }
    timeout 45 "$CS" --tool "$tool" --report-api-errors no --print-limit 5 python scripts/gpu/native_sanitize.py ${OK//,/ } cuda.persistent_coop+promote > "$OUT/sanitize_$tool.log" 2>&1
    echo "$tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|Error|error' "$OUT/sanitize_$tool.log" | head -n 3 | tr '\n' ' ')"
  done
else
  echo "compute-sanitizer not found or no rung ok"
fi

echo "total $((SECONDS - T0))s"
