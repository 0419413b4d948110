#!/usr/bin/env bash
# Set up and run the test suite. Without a GPU: Triton kernels under the interpreter, AOT/NVRTC
# compiles for sm_90a with PTX/SASS checks, validation, reports; GPU tests are skipped.
set -euo pipefail
. "$(dirname "$0")/setup.sh"
set -euo pipefail
exec python -m pytest -q "$@"
