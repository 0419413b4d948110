"""Test set-up shared by every test module.

Without a CUDA device the Triton kernels run under the interpreter, which must be chosen before
any ``@triton.jit`` function is created, hence before tmagemm's kernel modules are imported.
Tests marked ``gpu`` need a Hopper GPU and skip cleanly without one.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _hopper_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    if torch.cuda.get_device_capability() != (9, 0):
        return "needs a Hopper (sm_90) GPU"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _hopper_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def seeded():
    """A fresh, test-specific seed: random data differs between tests but a failure reproduces."""
    import zlib

    seed = zlib.crc32(os.environ.get("PYTEST_CURRENT_TEST", "").encode())
    torch.manual_seed(seed)
    return seed


@pytest.fixture(params=["pdl", "no-pdl"])
def pdl_mode(request, monkeypatch):
    """Every kernel with programmatic dependent launch (the default) and without it
    (TMAGEMM_PDL=0), heuristic configs, plans made afresh in each mode."""
    from tmagemm import plan

    monkeypatch.setenv("TMAGEMM_AUTOTUNE", "0")
    if request.param == "no-pdl":
        monkeypatch.setenv("TMAGEMM_PDL", "0")
    else:
        monkeypatch.delenv("TMAGEMM_PDL", raising=False)
    plan.clear_plans()
    yield request.param
    plan.clear_plans()
