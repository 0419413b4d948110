// PTX helpers shared by every native tmagemm kernel: mbarriers, TMA (cp.async.bulk.tensor)
// loads/stores/prefetches, proxy fences, grid dependency control (programmatic dependent launch),
// elect.sync, cluster helpers and register reallocation.
//
// Written for NVRTC: no standard headers, only builtin integer types. Target sm_90a.
// Conventions:
//   * Shared-memory addresses given to PTX are 32-bit ".shared" window addresses (smem_u32).
//   * Tensor-map coordinates are innermost first (c0 = the contiguous dimension), in elements,
//     signed: a box may start before 0 or run past the end; TMA fills those elements on load
//     and skips them on store. Measured on H100 (tests/test_tma_copy.py, scripts/gpu/tma.sh):
//     c0 * element_size must be a multiple of 16 (an unaligned start faulted with an illegal
//     instruction), and a store writes the whole last 16-byte chunk of a row whose extent is
//     not a multiple of 16 bytes (tmagemm.tma.TiledParams.validate_store refuses such maps).
//   * Every function is a thin wrapper over one PTX instruction (or a tiny loop around one), so the
//     caller decides which thread issues it.
#pragma once

// NVRTC has no <cuda.h>. The driver only needs 128 bytes, 64-byte aligned, passed as a
// `const __grid_constant__ CUtensorMap` kernel parameter so its address lies in param space,
// which is what cp.async.bulk.tensor reads the descriptor from.
#ifndef CUDA_VERSION
struct alignas(64) CUtensorMap {
  unsigned long long opaque[16];
};
#endif

namespace tmagemm {
namespace ptx {

// ---------------------------------------------------------------------------------------------
// Addresses
// ---------------------------------------------------------------------------------------------

// Generic pointer to shared memory -> 32-bit shared window address used by PTX operands.
__device__ __forceinline__ unsigned smem_u32(const void* ptr) {
  return static_cast<unsigned>(__cvta_generic_to_shared(ptr));
}

// Map a local shared-memory address to the same offset in CTA `cta_rank` of this cluster
// (a "shared::cluster" address usable by remote arrives and multicast).
__device__ __forceinline__ unsigned mapa_shared(unsigned local_addr, unsigned cta_rank) {
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local_addr), "r"(cta_rank));
  return remote;
}

// Load 16 bytes at a shared::cluster address (mapa_shared): another CTA's shared memory.
__device__ __forceinline__ void ld_shared_cluster_v4(float (&v)[4], unsigned cluster_addr) {
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v[0]), "=f"(v[1]), "=f"(v[2]), "=f"(v[3])
               : "r"(cluster_addr)
               : "memory");
}

// 16 or 8 bytes at a shared-window address (smem_u32). For buffers whose pointer the compiler
// cannot trace to shared memory (one aligned through an integer): it would emit generic loads
// and stores, slower than ld/st.shared.
__device__ __forceinline__ uint4 ld_shared_v4(unsigned addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr)
               : "memory");
  return v;
}

__device__ __forceinline__ uint2 ld_shared_v2(unsigned addr) {
  uint2 v;
  asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(addr) : "memory");
  return v;
}

__device__ __forceinline__ void st_shared_v2(unsigned addr, uint2 v) {
  asm volatile("st.shared.v2.b32 [%0], {%1, %2};" ::"r"(addr), "r"(v.x), "r"(v.y) : "memory");
}

__device__ __forceinline__ void st_shared_u32(unsigned addr, unsigned v) {
  asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}

// Byte offset inside a tile -> byte offset in shared memory under the TMA swizzle modes.
// SPAN is the swizzle span in bytes (0 = none, 32, 64, 128). The 16-byte chunk index inside the
// span (bits 4..) is XORed with the 128-byte row index (bits 7..) modulo SPAN/16. Valid when the
// tile base is aligned to 8 * SPAN bytes (256/512/1024), which is why swizzled buffers are
// aligned to 1024. Mirrors tmagemm.tma.swizzle_offset.
template <int SPAN>
__device__ __forceinline__ unsigned swizzle_offset(unsigned byte_offset) {
  static_assert(SPAN == 0 || SPAN == 32 || SPAN == 64 || SPAN == 128, "swizzle span must be 0/32/64/128");
  if constexpr (SPAN == 0) {
    return byte_offset;
  } else {
    constexpr unsigned kMask = SPAN / 16 - 1;
    return byte_offset ^ (((byte_offset >> 7) & kMask) << 4);
  }
}

// ---------------------------------------------------------------------------------------------
// mbarrier (64-bit barrier objects in shared memory)
// ---------------------------------------------------------------------------------------------

// `count` = number of arrivals that complete a phase (transaction bytes are tracked separately).
__device__ __forceinline__ void mbarrier_init(unsigned long long* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void mbarrier_inval(unsigned long long* bar) {
  asm volatile("mbarrier.inval.shared::cta.b64 [%0];" ::"r"(smem_u32(bar)) : "memory");
}

// The waits and arrivals on a barrier take its shared-window address (smem_u32) or a pointer.
__device__ __forceinline__ void mbarrier_arrive(unsigned bar) {
  // The arrival state is not needed: waits use the phase parity instead.
  asm volatile(
      "{\n"
      "  .reg .b64 state;\n"
      "  mbarrier.arrive.shared::cta.b64 state, [%0];\n"
      "}\n" ::"r"(bar)
      : "memory");
}

__device__ __forceinline__ void mbarrier_arrive(unsigned long long* bar) { mbarrier_arrive(smem_u32(bar)); }

// One arrival that also announces `bytes` of TMA traffic the phase must wait for. Issue it
// before or after the copies: the phase completes only when both arrivals and bytes are in.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(unsigned long long* bar, unsigned bytes) {
  asm volatile(
      "{\n"
      "  .reg .b64 state;\n"
      "  mbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1;\n"
      "}\n" ::"r"(smem_u32(bar)),
      "r"(bytes)
      : "memory");
}

// Announce bytes without arriving (e.g. a consumer CTA expecting multicast data from a peer).
__device__ __forceinline__ void mbarrier_expect_tx(unsigned long long* bar, unsigned bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
}

// Arrive on the barrier at the same shared offset in CTA `cta_rank` of the cluster (release at
// cluster scope, so this CTA's prior writes are visible to the waiter there).
__device__ __forceinline__ void mbarrier_arrive_cluster(unsigned long long* bar, unsigned cta_rank) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(
                   mapa_shared(smem_u32(bar), cta_rank))
               : "memory");
}

// Arrive on a barrier of another CTA of the cluster (`cluster_bar`: its shared::cluster
// address, mapa_shared) with release at CTA scope only. For a consumer freeing a pipeline stage
// whose only accesses were wgmma reads already retired by wgmma.wait_group, there is nothing to
// publish: the cluster-scope release above compiles to MEMBAR.ALL.GPU (+ ERRBAR), which stalls
// the warp on every k-block, while this form is a bare remote SYNCS arrive.
__device__ __forceinline__ void mbarrier_arrive_remote(unsigned cluster_bar) {
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(cluster_bar) : "memory");
}

// True once the phase with parity `phase` (0 or 1) has completed. try_wait may suspend the
// thread for a system-defined time before returning false, so a spin on it is cheap.
__device__ __forceinline__ bool mbarrier_try_wait_parity(unsigned bar, unsigned phase) {
  unsigned done;
  asm volatile(
      "{\n"
      "  .reg .pred p;\n"
      "  mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "  selp.u32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(done)
      : "r"(bar), "r"(phase)
      : "memory");
  return done != 0;
}

__device__ __forceinline__ bool mbarrier_try_wait_parity(unsigned long long* bar, unsigned phase) {
  return mbarrier_try_wait_parity(smem_u32(bar), phase);
}

// Same, with acquire at cluster scope: use when the arrivals come from other CTAs.
__device__ __forceinline__ bool mbarrier_try_wait_parity_cluster(unsigned long long* bar, unsigned phase) {
  unsigned done;
  asm volatile(
      "{\n"
      "  .reg .pred p;\n"
      "  mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
      "  selp.u32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(done)
      : "r"(smem_u32(bar)), "r"(phase)
      : "memory");
  return done != 0;
}

__device__ __forceinline__ void mbarrier_wait(unsigned bar, unsigned phase) {
  while (!mbarrier_try_wait_parity(bar, phase)) {
  }
}

__device__ __forceinline__ void mbarrier_wait(unsigned long long* bar, unsigned phase) {
  mbarrier_wait(smem_u32(bar), phase);
}

__device__ __forceinline__ void mbarrier_wait_cluster(unsigned long long* bar, unsigned phase) {
  while (!mbarrier_try_wait_parity_cluster(bar, phase)) {
  }
}

// ---------------------------------------------------------------------------------------------
// Fences
// ---------------------------------------------------------------------------------------------

// Make mbarrier.init visible to the async proxy (TMA) and to other CTAs of the cluster.
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// Order this thread's generic-proxy shared-memory writes before later async-proxy accesses
// (a TMA store reading the tile, or a TMA load overwriting a buffer just read).
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// Same for global memory written by generic stores and read later by TMA.
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

// ---------------------------------------------------------------------------------------------
// TMA: descriptor prefetch, tile loads (global -> shared), tile stores (shared -> global)
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ unsigned long long map_addr(const CUtensorMap* map) {
  return reinterpret_cast<unsigned long long>(map);
}

// Pull the 128-byte descriptor into the TMA unit's cache ahead of the first copy.
__device__ __forceinline__ void tma_prefetch_descriptor(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(map_addr(map)) : "memory");
}

// L2 cache policies for the *_hint variants.
__device__ __forceinline__ unsigned long long l2_policy_evict_first() {
  unsigned long long policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

__device__ __forceinline__ unsigned long long l2_policy_evict_last() {
  unsigned long long policy;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

// Loads: the box lands at `dst` (aligned to 128 B, 1024 B when swizzled) and its byte count
// completes on `bar` (complete_tx). The .shared::cluster destination with a local address means
// this CTA.
__device__ __forceinline__ void tma_load_1d(void* dst, const CUtensorMap* map, unsigned long long* bar, int c0) {
  asm volatile(
      "cp.async.bulk.tensor.1d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3}], [%2];" ::"r"(smem_u32(dst)),
      "l"(map_addr(map)), "r"(smem_u32(bar)), "r"(c0)
      : "memory");
}

__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, unsigned long long* bar, int c0,
                                            int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];" ::"r"(smem_u32(dst)),
      "l"(map_addr(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1)
      : "memory");
}

__device__ __forceinline__ void tma_load_3d(void* dst, const CUtensorMap* map, unsigned long long* bar, int c0,
                                            int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5}], [%2];" ::"r"(smem_u32(dst)),
      "l"(map_addr(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

__device__ __forceinline__ void tma_load_4d(void* dst, const CUtensorMap* map, unsigned long long* bar, int c0,
                                            int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6}], [%2];" ::"r"(smem_u32(dst)),
      "l"(map_addr(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

__device__ __forceinline__ void tma_load_5d(void* dst, const CUtensorMap* map, unsigned long long* bar, int c0,
                                            int c1, int c2, int c3, int c4) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6, %7}], [%2];" ::"r"(smem_u32(dst)),
      "l"(map_addr(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4)
      : "memory");
}

// Loads with an L2 cache policy (from l2_policy_evict_first/last).
__device__ __forceinline__ void tma_load_2d_hint(void* dst, const CUtensorMap* map, unsigned long long* bar, int c0,
                                                 int c1, unsigned long long policy) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(smem_u32(dst)),
      "l"(map_addr(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "l"(policy)
      : "memory");
}

__device__ __forceinline__ void tma_load_3d_hint(void* dst, const CUtensorMap* map, unsigned long long* bar, int c0,
                                                 int c1, int c2, unsigned long long policy) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1, {%3, %4, %5}], [%2], %6;" ::"r"(smem_u32(dst)),
      "l"(map_addr(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2), "l"(policy)
      : "memory");
}

// Multicast: one L2 read delivered to the same smem offset (and the same barrier offset) in every
// CTA of the cluster whose bit is set in `cta_mask`. Each receiving CTA must expect the bytes.
__device__ __forceinline__ void tma_load_2d_multicast(void* dst, const CUtensorMap* map, unsigned long long* bar,
                                                      int c0, int c1, unsigned short cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(smem_u32(dst)),
      "l"(map_addr(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "h"(cta_mask)
      : "memory");
}

__device__ __forceinline__ void tma_load_3d_multicast(void* dst, const CUtensorMap* map, unsigned long long* bar,
                                                      int c0, int c1, int c2, unsigned short cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%3, %4, %5}], [%2], %6;" ::"r"(smem_u32(dst)),
      "l"(map_addr(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2), "h"(cta_mask)
      : "memory");
}

// Stores: read the box from `src` and write its in-bounds elements. Completion is tracked per
// thread with bulk groups: commit, then wait_group(_read).
__device__ __forceinline__ void tma_store_1d(const CUtensorMap* map, const void* src, int c0) {
  asm volatile("cp.async.bulk.tensor.1d.global.shared::cta.bulk_group [%0, {%2}], [%1];" ::"l"(map_addr(map)),
               "r"(smem_u32(src)), "r"(c0)
               : "memory");
}

__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, const void* src, int c0, int c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];" ::"l"(map_addr(map)),
               "r"(smem_u32(src)), "r"(c0), "r"(c1)
               : "memory");
}

__device__ __forceinline__ void tma_store_3d(const CUtensorMap* map, const void* src, int c0, int c1, int c2) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];" ::"l"(
                   map_addr(map)),
               "r"(smem_u32(src)), "r"(c0), "r"(c1), "r"(c2)
               : "memory");
}

__device__ __forceinline__ void tma_store_4d(const CUtensorMap* map, const void* src, int c0, int c1, int c2,
                                             int c3) {
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];" ::"l"(
                   map_addr(map)),
               "r"(smem_u32(src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
               : "memory");
}

__device__ __forceinline__ void tma_store_5d(const CUtensorMap* map, const void* src, int c0, int c1, int c2,
                                             int c3, int c4) {
  asm volatile("cp.async.bulk.tensor.5d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5, %6}], [%1];" ::"l"(
                   map_addr(map)),
               "r"(smem_u32(src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4)
               : "memory");
}

// Close the current bulk group of stores issued by this thread.
__device__ __forceinline__ void tma_store_commit_group() {
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// Wait until at most N committed groups are pending (writes complete and visible).
template <int N>
__device__ __forceinline__ void tma_store_wait_group() {
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
}

// Wait until at most N groups still *read* shared memory: enough to reuse the source buffer,
// cheaper than waiting for the global writes.
template <int N>
__device__ __forceinline__ void tma_store_wait_group_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}

// Asynchronous 4-byte copy global -> shared (cp.async, no registers held while it is in flight);
// a thread's copies complete at cp_async_wait_all, and other threads see them after a barrier.
__device__ __forceinline__ void cp_async_4(void* smem_dst, const void* gmem_src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(smem_u32(smem_dst)), "l"(gmem_src) : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}

__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_all;" ::: "memory");
}

// One arrival on `bar` once every cp.async this thread issued before it has landed (.noinc: the
// arrival counts against the barrier's expected count, so the barrier is initialised with it);
// threads that see the phase complete then see the copied data.
__device__ __forceinline__ void cp_async_mbarrier_arrive_noinc(unsigned long long* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_u32(bar)) : "memory");
}

// L2 prefetch of a box (no shared memory, no barrier): warms L2 for a later load. Only a hint:
// it writes nothing this kernel reads back, and L2 is the GPU's point of coherence, so it may be
// issued before griddepcontrol.wait even for data the previous kernel is still writing (the loads
// that follow the wait read the fresh values through L2 whatever the prefetch brought in).
__device__ __forceinline__ void tma_prefetch_2d(const CUtensorMap* map, int c0, int c1) {
  asm volatile("cp.async.bulk.prefetch.tensor.2d.L2.global.tile [%0, {%1, %2}];" ::"l"(map_addr(map)), "r"(c0),
               "r"(c1)
               : "memory");
}

__device__ __forceinline__ void tma_prefetch_3d(const CUtensorMap* map, int c0, int c1, int c2) {
  asm volatile("cp.async.bulk.prefetch.tensor.3d.L2.global.tile [%0, {%1, %2, %3}];" ::"l"(map_addr(map)), "r"(c0),
               "r"(c1), "r"(c2)
               : "memory");
}

// ---------------------------------------------------------------------------------------------
// Programmatic dependent launch (grid dependency control, sm_90)
// ---------------------------------------------------------------------------------------------
// A kernel launched with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION may start while the
// kernel before it in the stream (its prerequisite grid) still runs. Both instructions are no-ops
// for a kernel launched without the attribute: its prerequisite has completed before it starts,
// so the wait finds no grid in flight, and no dependent is designated to react to the trigger
// (PTX ISA, "griddepcontrol"; Triton's gdc_* wrappers document the same). The device code can
// therefore always contain them, whichever way the host launches it.

// Block until every prerequisite grid has completed and its memory operations are performed and
// visible to this grid. Every global read of data the previous kernel may write, and every
// global write (the previous kernel may still read what we overwrite), comes after it. The
// "memory" clobber keeps the compiler from moving this thread's memory accesses above it.
__device__ __forceinline__ void griddep_wait() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}

// Let the dependent grid be scheduled once every CTA of this grid has issued this (or exited).
// It orders nothing: the dependent still waits for this grid's completion with griddep_wait
// before touching our output, so it may be issued as early as right after our own wait.
__device__ __forceinline__ void griddep_launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// ---------------------------------------------------------------------------------------------
// Flags between CTAs of one grid (global memory, GPU scope)
// ---------------------------------------------------------------------------------------------
// A CTA that publishes data for another: its threads store the data, sync among themselves, then
// one thread adds to the flag with release semantics (cumulative: it publishes the stores the
// barrier ordered before it). The reader's one thread spins with acquire loads, then syncs its
// threads, which read the data through L2 (ld.global.cg: L1 is not coherent across SMs).
__device__ __forceinline__ void red_add_release_gpu(int* flag, int value) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(flag), "r"(value) : "memory");
}

__device__ __forceinline__ int ld_acquire_gpu(const int* flag) {
  int value;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(value) : "l"(flag) : "memory");
  return value;
}

__device__ __forceinline__ void st_global_cg_v4(float* dst, float x, float y, float z, float w) {
  asm volatile("st.global.cg.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "f"(x), "f"(y), "f"(z), "f"(w) : "memory");
}

__device__ __forceinline__ void ld_global_cg_v4(const float* src, float& x, float& y, float& z, float& w) {
  asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(x), "=f"(y), "=f"(z), "=f"(w) : "l"(src) : "memory");
}

// ---------------------------------------------------------------------------------------------
// Warp / CTA / cluster helpers
// ---------------------------------------------------------------------------------------------

// Lane 0's value in every lane of the (fully active) warp. The compiler then knows it is
// warp-uniform, so what is built from it (shared-memory descriptors, barrier addresses) stays in
// uniform registers instead of being recomputed, or moved there with R2UR, at every use.
__device__ __forceinline__ unsigned warp_uniform(unsigned value) { return __shfl_sync(0xffffffffu, value, 0); }

// True in exactly one lane of the (fully active) warp; the hardware picks it, so no divergence
// on threadIdx is needed before a single-thread TMA issue.
__device__ __forceinline__ bool elect_one_sync() {
  unsigned elected;
  asm volatile(
      "{\n"
      "  .reg .b32 lane;\n"
      "  .reg .pred p;\n"
      "  elect.sync lane|p, 0xffffffff;\n"
      "  selp.u32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(elected));
  return elected != 0;
}

__device__ __forceinline__ unsigned cluster_ctarank() {
  unsigned rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  return rank;
}

__device__ __forceinline__ unsigned cluster_nctarank() {
  unsigned n;
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
  return n;
}

// All threads of all CTAs in the cluster must arrive before any passes wait. Release/acquire
// orders shared-memory writes (e.g. barrier init) across CTAs.
__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}

__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}

__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

__device__ __forceinline__ void cluster_sync() {
  cluster_arrive();
  cluster_wait();
}

// bar.sync on a named barrier: syncs `count` threads (a warpgroup or the consumers) without
// stalling the rest of the CTA. Id 0 is __syncthreads.
__device__ __forceinline__ void named_barrier_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

// Warp-specialised kernels hand registers from producer warpgroups to consumer warpgroups.
// N must be a multiple of 8 in [24, 256]; every thread of the warpgroup executes it.
template <int N>
__device__ __forceinline__ void warpgroup_reg_alloc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
}

template <int N>
__device__ __forceinline__ void warpgroup_reg_dealloc() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
}

}  // namespace ptx
}  // namespace tmagemm
