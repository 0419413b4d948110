"""NVRTC compile + cache (CPU), SASS/resource inspection (CPU), load and launch (GPU)."""

import ctypes
import os

import pytest
import torch

from tmagemm import jit
from tmagemm.jit import compiler, runtime

# Every helper of ptx.cuh in one kernel: proves the header compiles with NVRTC for sm_90a.
PTX_ALL = r"""
#include <tmagemm/ptx.cuh>
namespace ptx = tmagemm::ptx;
extern "C" __global__ void all_helpers(const __grid_constant__ CUtensorMap m, int* out) {
  __shared__ alignas(1024) unsigned char buf[4096];
  __shared__ unsigned long long bar;
  if (threadIdx.x == 0) { ptx::tma_prefetch_descriptor(&m); ptx::mbarrier_init(&bar, 1); ptx::fence_barrier_init(); }
  __syncthreads();
  ptx::griddep_wait(); ptx::griddep_launch_dependents();
  if (threadIdx.x == 0) {
    ptx::mbarrier_arrive_expect_tx(&bar, 4096);
    ptx::tma_load_1d(buf, &m, &bar, 0); ptx::tma_load_2d(buf, &m, &bar, 0, 1); ptx::tma_load_3d(buf, &m, &bar, 0, 1, 2);
    ptx::tma_load_4d(buf, &m, &bar, 0, 1, 2, 3); ptx::tma_load_5d(buf, &m, &bar, 0, 1, 2, 3, 4);
    ptx::tma_load_2d_hint(buf, &m, &bar, 0, 1, ptx::l2_policy_evict_first());
    ptx::tma_load_3d_hint(buf, &m, &bar, 0, 1, 2, ptx::l2_policy_evict_last());
    ptx::tma_load_2d_multicast(buf, &m, &bar, 0, 1, 3); ptx::tma_load_3d_multicast(buf, &m, &bar, 0, 1, 2, 3);
    ptx::mbarrier_expect_tx(&bar, 16); ptx::mbarrier_arrive(&bar);
    ptx::tma_prefetch_2d(&m, 0, 1); ptx::tma_prefetch_3d(&m, 0, 1, 2);
  }
  ptx::mbarrier_wait(&bar, 0); ptx::mbarrier_wait_cluster(&bar, 1);
  buf[ptx::swizzle_offset<128>(threadIdx.x)] += ptx::swizzle_offset<64>(threadIdx.x) + ptx::swizzle_offset<32>(threadIdx.x);
  ptx::fence_proxy_async_shared(); ptx::fence_proxy_async_global();
  __syncthreads();
  if (threadIdx.x < 32 && ptx::elect_one_sync()) {
    ptx::tma_store_1d(&m, buf, 0); ptx::tma_store_2d(&m, buf, 0, 1); ptx::tma_store_3d(&m, buf, 0, 1, 2);
    ptx::tma_store_4d(&m, buf, 0, 1, 2, 3); ptx::tma_store_5d(&m, buf, 0, 1, 2, 3, 4);
    ptx::tma_store_commit_group(); ptx::tma_store_wait_group_read<0>(); ptx::tma_store_wait_group<0>();
    ptx::mbarrier_arrive_cluster(&bar, 1);
  }
  ptx::cluster_arrive_relaxed(); ptx::cluster_wait(); ptx::cluster_sync();
  out[0] = ptx::cluster_ctarank() + ptx::cluster_nctarank() + ptx::mapa_shared(ptx::smem_u32(buf), 1);
  if (threadIdx.x == 0) ptx::mbarrier_inval(&bar);
}
extern "C" __global__ void __launch_bounds__(384, 1) regs(int* out) {
  if (threadIdx.x < 128) ptx::warpgroup_reg_dealloc<40>(); else ptx::warpgroup_reg_alloc<232>();
  out[threadIdx.x] = 1;
}
"""

# A kernel for launch tests: scalar args of several widths, big dynamic smem, cluster rank.
LAUNCH_TEST = r"""
#include <tmagemm/ptx.cuh>
extern "C" __global__ void fill(float* out, int n, float scale, long long offset, unsigned char tag) {
  extern __shared__ unsigned char smem[];
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  smem[threadIdx.x] = tag;
  __syncthreads();
  if (i < n) out[i] = scale * i + static_cast<float>(offset) + smem[threadIdx.x];
}
extern "C" __global__ void cluster_rank(int* out) {
  if (threadIdx.x == 0) out[blockIdx.x] = static_cast<int>(tmagemm::ptx::cluster_ctarank()) * 1000 + tmagemm::ptx::cluster_nctarank();
}
"""


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TMAGEMM_CACHE_DIR", str(tmp_path))
    jit.clear_memory_cache()
    yield tmp_path
    jit.clear_memory_cache()


def test_ptx_header_compiles_and_emits_tma_instructions(cache_dir):
    module = jit.compile_string(PTX_ALL, name="ptx_all.cu")
    sass = jit.sass(module.cubin)
    for op in ("UTMALDG.1D", "UTMALDG.5D", "UTMALDG.2D.MULTICAST", "UTMASTG.2D", "UTMASTG.5D", "UTMAPF.L2.2D",
               "UTMACCTL.PF", "SYNCS.ARRIVE.TRANS64", "SYNCS.PHASECHK.TRANS64.TRYWAIT", "ELECT", "UCGABAR_ARV",
               "ACQBULK", "PREEXIT"):  # griddepcontrol.wait / .launch_dependents
        assert op in sass, op
    assert "'setmaxnreg' ignored" not in module.log
    usage = module.resource_usage("all_helpers")
    assert usage.local_bytes == 0 and usage.spill_stores == 0 and usage.spill_loads == 0
    assert usage.shared_bytes >= 4096


def test_disk_cache_roundtrip_and_key(cache_dir):
    first = jit.compile("tma_copy.cu", defines={"PROBE_RANK": 2})
    assert not first.cache_hit and first.cubin and ".visible .entry tma_probe" in first.ptx
    assert jit.compile("tma_copy.cu", defines={"PROBE_RANK": 2}) is first  # in-process hit
    files = sorted(p.suffix for p in (cache_dir / "cubin").iterdir())
    assert files == [".cubin", ".log", ".ptx"]
    jit.clear_memory_cache()
    again = jit.compile("tma_copy.cu", defines={"PROBE_RANK": 2})
    assert again.cache_hit and again.cubin == first.cubin and again.key == first.key
    assert jit.compile("tma_copy.cu", defines={"PROBE_RANK": 3}).key != first.key
    assert jit.compile("tma_copy.cu", defines={"PROBE_RANK": 2}, flags=["-DEXTRA=1"]).key != first.key


def test_cache_key_covers_headers(cache_dir, tmp_path, monkeypatch):
    include = tmp_path / "include" / "tmagemm"
    include.mkdir(parents=True)
    header = include / "extra.cuh"
    header.write_text("#define EXTRA_VALUE 1\n")
    monkeypatch.setattr(compiler, "INCLUDE_DIR", tmp_path / "include")
    code = '#include <tmagemm/extra.cuh>\nextern "C" __global__ void k(int* p) { *p = EXTRA_VALUE; }\n'
    one = jit.compile_string(code)
    header.write_text("#define EXTRA_VALUE 2\n")
    two = jit.compile_string(code)
    assert one.key != two.key and one.cubin != two.cubin


def test_compile_errors_carry_the_log(cache_dir):
    with pytest.raises(jit.CompileError, match="ELEM_TYPE must be"):
        jit.compile("tma_copy.cu", defines={"ELEM_TYPE": 9, "BOX_ROWS": 8, "BOX_COLS": 8, "SWIZZLE_SPAN": 0})
    assert not list(cache_dir.rglob("*.cubin"))  # failures are not cached


def test_bad_requests_are_refused(cache_dir):
    with pytest.raises(ValueError, match="not a file under"):
        jit.compile("../tma.py")
    with pytest.raises(ValueError, match="C identifier"):
        jit.compile("tma_copy.cu", defines={"BAD NAME": 1})
    with pytest.raises(TypeError, match="int or str"):
        jit.compile("tma_copy.cu", defines={"PROBE_RANK": 1.5})
    with pytest.raises(ValueError, match="arch"):
        jit.compile("tma_copy.cu", arch="hopper")


def test_launch_refuses_untyped_arguments():
    kernel = runtime.Kernel("fake", function=None, device_index=0)
    with pytest.raises(TypeError, match="argument 1 has type int"):
        kernel.launch(1, 32, (ctypes.c_int32(1), 5))
    with pytest.raises(ValueError, match="grid"):
        kernel.launch((0, 1), 32, ())


def test_atomic_write_leaves_no_temporaries(tmp_path):
    target = tmp_path / "a" / "b.cubin"
    compiler._atomic_write(target, b"abc")
    compiler._atomic_write(target, b"defg")
    assert target.read_bytes() == b"defg" and os.listdir(target.parent) == ["b.cubin"]


# ------------------------------------------------------------------ GPU


@pytest.mark.gpu
def test_launch_with_scalars_big_smem_and_current_stream(cache_dir, seeded):
    module = jit.compile_string(LAUNCH_TEST, name="launch_test.cu")
    kernel = module.function("fill")
    assert module.function("fill") is kernel
    n = 1000
    out = torch.full((n,), float("nan"), device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        kernel.launch(
            (n + 255) // 256, 256,
            (out, ctypes.c_int32(n), ctypes.c_float(0.5), ctypes.c_int64(-3), ctypes.c_uint8(7)),
            smem_bytes=100 * 1024,  # above 48 KB: needs the opt-in attribute
        )
    stream.synchronize()
    expected = 0.5 * torch.arange(n, device="cuda", dtype=torch.float64) - 3 + 7
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-4)


@pytest.mark.gpu
def test_cluster_launch(cache_dir):
    kernel = jit.compile_string(LAUNCH_TEST, name="launch_test.cu").function("cluster_rank")
    out = torch.full((8,), -1, dtype=torch.int32, device="cuda")
    kernel.launch(8, 32, (out,), cluster=(2, 1, 1))
    torch.cuda.synchronize()
    assert out.tolist() == [0 * 1000 + 2, 1 * 1000 + 2] * 4
    with pytest.raises(ValueError, match="not a multiple of cluster"):
        kernel.launch(3, 32, (out,), cluster=(2, 1, 1))


@pytest.mark.gpu
def test_tensor_map_passed_by_value():
    x = torch.arange(64 * 64, dtype=torch.int32, device="cuda").reshape(64, 64)
    from tmagemm.cuda import tma_copy

    image = tma_copy.probe(x, (8, 32), (8, 32), swizzle="none")
    expected = x[8:16, 32:64].contiguous().view(torch.uint8).flatten()
    assert torch.equal(image[: expected.numel()], expected)


def test_static_shared_memory_counts_toward_the_48_kb_a_launch_takes_unasked(monkeypatch):
    """A kernel's static shared memory and the launch's dynamic bytes share the 48 KB a launch
    may take without the opt-in attribute: with 4 KB static, 46 KB dynamic needs the opt-in
    (the launch fails with an invalid argument otherwise), 44 KB does not."""
    from tmagemm.jit import runtime

    asked = []
    kernel = runtime.Kernel("k", None, 0)
    monkeypatch.setattr(kernel, "attribute", lambda name: 4096 if name == "SHARED_SIZE_BYTES" else 0)
    monkeypatch.setattr(kernel, "_opt_in_smem", asked.append)
    kernel._function = object()  # a loaded function: its static bytes are read
    kernel.reserve_shared_memory(44 * 1024)
    assert asked == []
    kernel.reserve_shared_memory(46 * 1024)
    assert asked == [46 * 1024]
