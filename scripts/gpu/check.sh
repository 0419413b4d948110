#!/usr/bin/env bash
# The device job: versions, GPU tests, compute-sanitizer over the public API, then `tmagemm bench`.
#
#   OUT=/some/dir bash scripts/gpu/check.sh        # from anywhere, on a Hopper machine
#
# Needs torch, triton and cuda-bindings installed (no package registry is used); runs the library
# from src/. Every step runs even when an earlier one failed; the exit status is the number of
# failed steps (0: all passed). Logs and the bench result (results.json/csv, table.txt, plots) go
# under $OUT; a summary (test counts, sanitizer counts, the bench's table) prints last.
#
# Environment (all optional):
#   OUT=/tmp/check_out                        where everything is written
#   SKIP_TESTS=1 SKIP_SANITIZER=1 SKIP_BENCH=1  leave a step out
#   PYTEST_ARGS="tests/"                      what `pytest -m "gpu or anydevice"` runs, e.g. "tests/test_splitk.py -x"
#   SANITIZER_TOOLS="memcheck racecheck synccheck"
#   BENCH_ARGS="--preset sweep --m 16,256,1024,4096 --budget-ms 50"   (--graph and --out are added)
#   TEST_TIMEOUT=480 SANITIZER_TIMEOUT=240 BENCH_TIMEOUT=300          seconds (sanitizer: per tool)
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export TMAGEMM_CACHE_DIR=${TMAGEMM_CACHE_DIR:-/tmp/tmagemm-cache}
OUT=${OUT:-/tmp/check_out}
mkdir -p "$OUT"
FAILED=0
SUMMARY=()
record() {  # step, exit status, detail
  local status=ok
  case $2 in 0) ;; 124|137) status="TIMEOUT" ;; *) status="FAIL($2)" ;; esac
  [ "$2" -eq 0 ] || FAILED=$((FAILED + 1))
  SUMMARY+=("$(printf '%-20s %-10s %s' "$1" "$status" "$3")")
}

# True when every pair racecheck reported (all of them displayed) is a cp.async write against a
# read: the block-scaled scale loader's ring, ordered by mbarriers racecheck does not follow.
mbarrier_ring_only() {
  local pairs ring
  pairs=$(grep -c "Race reported between" "$1")
  ring=$(grep -A1 "Race reported between" "$1" | grep -c "cp_async_4")
  [ "$pairs" -gt 0 ] && [ "$pairs" -eq "$ring" ] && grep -qE "SUMMARY: ([0-9]+) hazards displayed \(\1 errors" "$1"
}

echo "== environment"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1 | tee "$OUT/env.txt"
python -c 'import sys, torch, triton; print("python", sys.version.split()[0], "torch", torch.__version__,
  "cuda", torch.version.cuda, "triton", triton.__version__)' 2>&1 | tee -a "$OUT/env.txt"
python -m tmagemm.cli env >>"$OUT/env.txt" 2>&1 || echo "tmagemm env failed (see $OUT/env.txt)"
grep -E "^(gpu|driver|cuda_bindings|nvrtc|git_sha) " "$OUT/env.txt"

if [ -z "${SKIP_TESTS:-}" ]; then
  echo "== GPU tests"
  # shellcheck disable=SC2086  # PYTEST_ARGS is a list of words
  timeout "${TEST_TIMEOUT:-480}" python -m pytest -q -p no:cacheprovider -m "gpu or anydevice" ${PYTEST_ARGS:-tests/} \
    >"$OUT/pytest.log" 2>&1
  rc=$?
  grep -E "^(FAILED|ERROR) " "$OUT/pytest.log" | cut -c1-200 | head -n 20
  record "pytest -m 'gpu or anydevice'" $rc "$(grep -E "[0-9]+ [a-z]+.* in [0-9.]+s" "$OUT/pytest.log" | tail -n 1)"
fi

if [ -z "${SKIP_SANITIZER:-}" ]; then
  echo "== compute-sanitizer"
  CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n 1)
  for tool in ${SANITIZER_TOOLS:-memcheck racecheck synccheck}; do
    log="$OUT/sanitize_$tool.log"
    if [ -z "$CS" ]; then record "sanitizer $tool" 127 "compute-sanitizer not found"; continue; fi
    # Heuristic configs only (no tuning launches); API errors are cuda-bindings' symbol probes.
    TMAGEMM_AUTOTUNE=0 timeout "${SANITIZER_TIMEOUT:-240}" "$CS" --tool "$tool" --report-api-errors no \
      --print-limit 10 --error-exitcode 99 python scripts/gpu/sanitize_driver.py >"$log" 2>&1
    rc=$?
    grep -E "^(FAIL|OFF) " "$log" | head -n 5
    if [ "$tool" = racecheck ] && [ $rc -eq 99 ] && mbarrier_ring_only "$log"; then
      echo "racecheck: only the block-scaled scale loader's cp.async writes against the consumers' reads"
      echo "  (an mbarrier ring racecheck cannot see through; docs/native-gemm.md, scripts/gpu/mbarrier_ring.cu)"
      rc=0
    fi
    record "sanitizer $tool" $rc "$(grep -E "(ERROR|RACECHECK) SUMMARY" "$log" | tail -n 1 | sed 's/^=* *//');\
 $(grep -E "^sanitize_driver:" "$log" | cut -d' ' -f2-)"
  done
fi

if [ -z "${SKIP_BENCH:-}" ]; then
  echo "== tmagemm bench"
  rm -rf "$OUT/bench"  # no stale result read back if this run dies early
  # shellcheck disable=SC2086  # BENCH_ARGS is a list of words
  timeout "${BENCH_TIMEOUT:-300}" python -m tmagemm.cli bench ${BENCH_ARGS:---preset sweep --m 16,256,1024,4096 \
    --budget-ms 50} --graph --out "$OUT/bench" >"$OUT/bench.log" 2>&1
  rc=$?
  # Record counts by status; a provider that crashed ("failed") or is off ("wrong") fails the step.
  counts=$(python -c 'import collections, json, sys
c = collections.Counter(r["status"] for r in json.load(open(sys.argv[1]))["records"])
print(", ".join(f"{n} {s}" for s, n in c.most_common())); sys.exit(bool(c["failed"] or c["wrong"]))' \
    "$OUT/bench/results.json" 2>/dev/null) || { [ $rc -ne 0 ] || rc=1; }
  record "tmagemm bench" $rc "records: ${counts:-none}; log $OUT/bench.log"
fi

echo "== summary ($OUT)"
if [ -z "${SKIP_BENCH:-}" ]; then  # the bench's geomean, issues and host tables (or the log's end)
  TABLE=$(sed -n '/^Geometric means/,$p' "$OUT/bench/table.txt" 2>/dev/null)
  echo "${TABLE:-$(tail -n 15 "$OUT/bench/table.txt" 2>/dev/null || tail -n 15 "$OUT/bench.log")}"
fi
printf '%-20s %-10s %s\n' step status detail
printf '%s\n' "${SUMMARY[@]}"
echo "failed steps: $FAILED"
exit "$FAILED"
