#!/usr/bin/env bash
# Create (once) and activate .venv with tmagemm installed in editable mode plus test/bench extras.
# Source it: `. scripts/setup.sh`. Uses the machine's torch when one is installed (e.g. CUDA torch
# on a GPU machine); otherwise installs the CPU build of torch 2.13.0.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
if [ ! -x .venv/bin/python ]; then
    "${PYTHON:-python3}" -m venv --system-site-packages .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
python -c "import torch" 2>/dev/null || python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[dev]"
set +euo pipefail
