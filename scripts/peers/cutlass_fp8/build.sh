#!/usr/bin/env bash
# Build build/cutlass_fp8/libcutlass_fp8.so: CUTLASS 3.x FP8 GEMM configs used as a measurement
# peer (cutlass_peer.py). Needs nvcc (CUDA 12.3+) and a CUTLASS checkout; no GPU.
#   CUTLASS_DIR=/path/to/cutlass bash scripts/peers/cutlass_fp8/build.sh
#   CONFIGS="pp_128x128_c2" JOBS=2 ...   a subset, and parallel compiles (one TU per config)
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
: "${CUTLASS_DIR:?set CUTLASS_DIR to a CUTLASS checkout (its include/ and tools/util/include/ are used)}"
NVCC=${NVCC:-nvcc}
CONFIGS=${CONFIGS:-"pp_64x128_c1 pp_64x128_c2 pp_128x128_c2 pp_64x256_c2 co_128x256_c2 co_256x128_c2 co_128x128_c2"}
JOBS=${JOBS:-1}
OUTDIR="$ROOT/build/cutlass_fp8"
mkdir -p "$OUTDIR/obj"
FLAGS="-std=c++17 -O3 -arch=sm_90a --expt-relaxed-constexpr -Xcompiler -fPIC -Xcompiler -fvisibility=hidden \
 -I$HERE -I$CUTLASS_DIR/include -I$CUTLASS_DIR/tools/util/include -DNDEBUG -diag-suppress 20012"
export NVCC FLAGS HERE OUTDIR
printf '%s\n' $CONFIGS | xargs -P "$JOBS" -I{} bash -c '
  src=$HERE/cfg_{}.cu obj=$OUTDIR/obj/cfg_{}.o
  if [ -f "$obj" ] && [ "$obj" -nt "$src" ] && [ "$obj" -nt "$HERE/common.cuh" ]; then echo "up to date: {}"; exit 0; fi
  echo "compiling {}"; t0=$(date +%s)
  $NVCC $FLAGS -c "$src" -o "$obj" && echo "done {} in $(( $(date +%s) - t0 ))s"'
OBJS=$(for c in $CONFIGS; do echo "$OUTDIR/obj/cfg_$c.o"; done)
$NVCC -arch=sm_90a -shared -cudart static -Xcompiler -fPIC $OBJS -o "$OUTDIR/libcutlass_fp8.so"
(git -C "$CUTLASS_DIR" log -1 --format='%H %cs %s' 2>/dev/null || echo unknown) > "$OUTDIR/cutlass_commit.txt"
ls -l "$OUTDIR/libcutlass_fp8.so"
