#!/usr/bin/env bash
# Set up and run the main job: `tmagemm bench` (benchmark vs cuBLAS on a Hopper GPU; without a
# GPU it checks the Triton kernels under the interpreter on small shapes). Extra args go to bench.
set -euo pipefail
. "$(dirname "$0")/setup.sh"
set -euo pipefail
exec tmagemm bench "$@"
