#!/usr/bin/env bash
# Build DeepGEMM in place as a measurement peer (deepgemm_peer.py). Nothing of it is committed here.
#   bash scripts/peers/deepgemm/build.sh /path/to/DeepGEMM
# The checkout needs its submodules' headers: third-party/cutlass/include (and, from 2.x,
# third-party/fmt/include): a `git clone --recursive`, or the pinned commits unpacked there. Needs nvcc, torch and setuptools;
# no network and no GPU (DeepGEMM compiles its kernels at run time, with nvcc or NVRTC). Writes the
# extension next to deep_gemm/__init__.py, so `PYTHONPATH=/path/to/DeepGEMM` imports it, and records
# the commit in deep_gemm_commit.txt.
set -euo pipefail
DG=$(cd "${1:?usage: build.sh /path/to/DeepGEMM}" && pwd)
for d in third-party/cutlass/include/cute third-party/cutlass/include/cutlass; do
  [ -d "$DG/$d" ] || { echo "missing $DG/$d: clone DeepGEMM with --recursive" >&2; exit 2; }
done
command -v nvcc > /dev/null || { echo "nvcc not on PATH: DeepGEMM's extension and JIT need it" >&2; exit 2; }
cd "$DG"
# What DeepGEMM's develop.sh does: its JIT finds CUTLASS/CuTe under deep_gemm/include.
ln -sfn "$DG/third-party/cutlass/include/cutlass" deep_gemm/include/cutlass
ln -sfn "$DG/third-party/cutlass/include/cute" deep_gemm/include/cute
t0=$(date +%s)
if [ -d csrc ]; then  # 2.x: a C++ extension (pybind11, torch's headers) drives the JIT
  DG_USE_LOCAL_VERSION=0 python setup.py build_ext --inplace > build.log 2>&1 || { tail -n 30 build.log >&2; exit 1; }
  ls deep_gemm/_C*.so
fi  # 1.x: the JIT is Python; the links above are the whole build
if [ "$(git rev-parse --show-toplevel 2>/dev/null)" = "$DG" ]; then git log -1 --format='%H %cs %s'
else cat DEEPGEMM_COMMIT 2>/dev/null || echo "unknown (not a git checkout)"; fi > deep_gemm_commit.txt
echo "built in $(( $(date +%s) - t0 ))s: $(cat deep_gemm_commit.txt)"
