"""The peer scripts (scripts/peers/): what can be checked without their checkouts or a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEEPGEMM = ROOT / "scripts" / "peers" / "deepgemm"


def test_deepgemm_build_names_the_missing_submodule(tmp_path):
    (tmp_path / "deep_gemm" / "include").mkdir(parents=True)  # a checkout cloned without --recursive
    done = subprocess.run(["bash", str(DEEPGEMM / "build.sh"), str(tmp_path)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert "third-party/cutlass/include/cute" in done.stderr and "--recursive" in done.stderr


def test_deepgemm_peer_describes_itself_without_a_gpu():
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    done = subprocess.run([sys.executable, str(DEEPGEMM / "deepgemm_peer.py"), "--help"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--grouped" in done.stdout and "--m" in done.stdout
