#!/usr/bin/env bash
# Benchmark-suite job for the device machine: the seed's M sweep (fp8, N=K=4096) for every
# tmagemm provider next to cuBLAS, then the end-to-end GPU test of the bench harness.
#
#   scripts/gpu/bench.sh [M list]     # default M = 1,16,64,128,512,2048,4096
#
# Timings: median (p20/p80) of CUDA events around each call, a 256 MiB buffer zeroed before each
# call (L2 flushed); warm-up (compile + autotune) before timing; accuracy vs float64 in the same run.
# Writes results.json/csv, table.txt and PNG plots under $OUT/sweep-fp8, the pytest log under $OUT;
# prints the geomean summary last.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench_out}
M_LIST=${1:-1,16,64,128,512,2048,4096}
mkdir -p "$OUT"

timeout 200 python -m tmagemm.cli bench --preset sweep --m "$M_LIST" --dtype fp8 --budget-ms 100 \
  --out "$OUT/sweep-fp8" >"$OUT/bench.log" 2>&1
echo "bench exit code: $?" >>"$OUT/bench.log"

# The harness test checks plumbing, not speed: heuristic configs keep it short.
TMAGEMM_AUTOTUNE=0 timeout 80 python -m pytest -q -p no:cacheprovider tests/test_bench_gpu.py >"$OUT/pytest.log" 2>&1
echo "pytest exit code: $?" >>"$OUT/pytest.log"

tail -n 3 "$OUT/pytest.log"
tail -n 1 "$OUT/bench.log"
python - "$OUT/sweep-fp8" <<'PY'
import sys
from tmagemm.bench import report, results
try:
    r = results.load(sys.argv[1])
except ValueError as exc:
    sys.exit(f"no result: {exc}")
print(report.header(r)); print(report.summary_table(r)); print(report.host_table(r))
PY
