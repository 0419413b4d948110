"""scripts/gpu/check.sh's reading of a racecheck log (no GPU needed): it passes only a run whose
reported pairs are all the block-scaled scale loader's cp.async writes against reads (an
mbarrier ring racecheck does not follow; docs/native-gemm.md), every pair displayed."""

import pathlib
import shutil
import subprocess

import pytest

CHECK = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "gpu" / "check.sh"

RING_PAIR = """========= Error: Race reported between Read access at tmagemm_gemm_sm90_persistent::[lambda] in gemm_sm90_persistent.cu:462
=========     and Write access at tmagemm::ptx::cp_async_4(void *, const void *)+0x14b00 in ptx.cuh:371 [512 hazards]
"""
RING_PAIR_WRITE_FIRST = """========= Error: Race reported between Write access at tmagemm::ptx::cp_async_4(void *, const void *)+0xef80 in ptx.cuh:371
=========     and Read access at tmagemm_gemm_sm90_persistent::[lambda] in gemm_sm90_persistent.cu:465 [32 hazards]
"""
OTHER_PAIR = """========= Error: Race reported between Write access at tmagemm_gemm_sm90_persistent+0x1200 in gemm_sm90_persistent.cu:700
=========     and Read access at tmagemm_gemm_sm90_persistent+0x1300 in gemm_sm90_persistent.cu:720 [8 hazards]
"""


def summary(shown: int, errors: int) -> str:
    return f"========= RACECHECK SUMMARY: {shown} hazards displayed ({errors} errors, 0 warnings)\n"


def ring_only(tmp_path, log: str) -> bool:
    path = tmp_path / "racecheck.log"
    path.write_text(log)
    script = f'source <(sed -n "/^mbarrier_ring_only()/,/^}}/p" "{CHECK}"); mbarrier_ring_only "{path}"'
    return subprocess.run(["bash", "-c", script], check=False).returncode == 0


pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("sed") is None, reason="needs bash and sed")


def test_the_function_is_defined_in_check_sh():
    assert "mbarrier_ring_only()" in CHECK.read_text()


def test_only_scale_loader_pairs_pass(tmp_path):
    assert ring_only(tmp_path, RING_PAIR + RING_PAIR_WRITE_FIRST + summary(2, 2))


@pytest.mark.parametrize("log", [
    RING_PAIR + OTHER_PAIR + summary(2, 2),  # another hazard beside the ring's
    OTHER_PAIR + summary(1, 1),
    RING_PAIR + summary(1, 7),  # more errors than displayed: the rest unseen
    summary(0, 0),  # nothing reported (rc 99 would then be something else)
    "",
])
def test_anything_else_fails(tmp_path, log):
    assert not ring_only(tmp_path, log)
