"""The Triton GEMMs compiled ahead of time for sm_90a (no GPU needed): the TMA kernels load and
store through the tensor-memory accelerator and multiply with wgmma, the pointer baseline uses
per-thread cp.async instead, and nothing spills to local memory."""

import pytest

from tmagemm import inspection


@pytest.mark.parametrize("name", ["triton.tma", "triton.persistent"])
@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_tma_kernels_emit_bulk_tensor_copies_and_wgmma(name, dtype):
    s = inspection.summarize(inspection.inspect_variant(name, dtype))
    assert s["ptx cp.async.bulk.tensor load"] > 0 and s["sass UTMALDG"] > 0
    assert s["ptx cp.async.bulk.tensor store"] > 0 and s["sass UTMASTG"] > 0  # TMA-store epilogue
    assert s["ptx wgmma.mma_async"] > 0
    assert s["sass QGMMA" if dtype == "fp8" else "sass HGMMA"] > 0
    assert s["ptx cp.async (per-thread)"] == 0
    assert s["sass LDL"] == 0 and s["sass STL"] == 0, "register spills"


def test_pointer_kernel_uses_cp_async_not_tma():
    s = inspection.summarize(inspection.inspect_variant("triton.ptr", "fp8"))
    assert s["sass UTMALDG"] == 0 and s["ptx cp.async.bulk.tensor load"] == 0
    assert s["load path"] == "cp.async" and s["sass LDGSTS"] > 0
    assert s["sass QGMMA"] > 0
    assert s["sass LDL"] == 0 and s["sass STL"] == 0, "register spills"
