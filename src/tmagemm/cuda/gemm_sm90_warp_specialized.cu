// Warp-specialized TMA + wgmma GEMM: a producer warpgroup and two consumers (docs/native-gemm.md).
//
// Three warpgroups per 128 x BLOCK_N tile (BLOCK_N = 256 by default). Warpgroup 0 is the
// producer: it gives most of its registers back (setmaxnreg.dec) and one thread only issues
// TMA, so loads never wait behind math. Warpgroups 1 and 2 are consumers with the registers
// the producer released (setmaxnreg.inc): each owns 64 rows and issues one m64n256k16 (or k32
// for e4m3) wgmma per 32-byte K step, which reads B from shared memory once per 64 x 256
// product instead of twice for the one-warpgroup kernel's 2 x m64n128. Stores go through swizzled shared
// memory and TMA, one warpgroup at a time.
#include "tmagemm/gemm_sm90.cuh"

using namespace tmagemm;
using namespace tmagemm::gemm;

namespace {
// The epilogue stages each consumer's 64 x BLOCK_N fragment in the (then idle) operand ring.
static_assert(kStages * kStageBytes >= kConsumerWarpgroups * kFragBytes,
              "operand ring too small to stage the output tile");
// Named barriers: 0 is __syncthreads, 1 spans both consumers, 2 + i is consumer i alone.
constexpr int kBarConsumers = 1;
constexpr int kBarConsumer0 = 2;
}  // namespace

extern "C" __global__ void __launch_bounds__(kWarpSpecializedThreads, 1)
    tmagemm_gemm_sm90_warp_specialized(const __grid_constant__ CUtensorMap map_a,
                                       const __grid_constant__ CUtensorMap map_b,
                                       const __grid_constant__ CUtensorMap map_d,
                                       const __grid_constant__ Params params) {
  // ---- shared-memory plan: STAGES x [A 128 x 128 B | B BLOCK_N x 128 B], 1 KB aligned -------
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = aligned_smem(smem_raw);
  __shared__ alignas(8) u64 full[kStages];   // producer arrival + TMA bytes
  __shared__ alignas(8) u64 empty[kStages];  // both consumer warpgroups released the stage

  const TileCoord tile = tile_origin(blockIdx.x, params);
  const int k_tiles = ceil_div(params.k, kBlockK);
  const int warpgroup = threadIdx.x / 128;

  // ---- descriptor prefetch, barrier init + fence + sync ------------------------------------
  // (gemm_sm90.cuh, "Programmatic dependent launch": everything up to the wait may overlap the
  // previous kernel, so it touches no global memory.)
  if (threadIdx.x == 0) init_pipeline(full, empty, kConsumerWarpgroups, &map_a, &map_b, &map_d);
  __syncthreads();

  // ---- grid dependency: every thread, before the warpgroups part (the producer's idle warps
  // exit right after), before the first load of A, the scales, C, and the first store -----------
  wait_for_previous_kernel();

  if (warpgroup == 0) {
    // ---- producer: register reallocation, then one thread streams the k-blocks ---------------
    ptx::warpgroup_reg_dealloc<kProducerRegs>();
    if (threadIdx.x == 0) {
      PipelineState write;
      for (int kt = 0; kt < k_tiles; ++kt) {
        // Parity starts at 1 (phase ^ 1): a fresh barrier counts as having completed the phase
        // before phase 0, so the first pass over the ring does not wait.
        ptx::mbarrier_wait(&empty[write.index], write.phase ^ 1);
        load_stage(smem + write.index * kStageBytes, &full[write.index], &map_a, &map_b, kt, tile.m0, tile.n0);
        write.advance();
      }
      let_next_kernel_launch();  // the last loads are in flight: the next kernel may launch
    }
    return;
  }

  // ---- consumers -------------------------------------------------------------------------------
  ptx::warpgroup_reg_alloc<kConsumerRegs>();
  const int consumer = warpgroup - 1;
  const EpilogueOp op = epilogue_op(params);
  float acc[kAccRegs];
#pragma unroll
  for (int i = 0; i < kAccRegs; ++i) acc[i] = 0.0f;

  const StageDescs descs(smem, consumer * 64 * kRowBytes);
  const ConsumerBarriers<> bars(full, empty);
  PipelineState read;
  PipelineState release;
  for (int kt = 0; kt < k_tiles; ++kt) {
    bars.wait_full(read.index, read.phase);
    wgmma::fence_operand(acc);
    wgmma::fence();
    mma_stage<kBlockN>(acc, descs.a_at(read.index), descs.b_at(read.index));
    wgmma::commit_group();
    // One batch stays in flight; the one before it has retired and its stage goes back.
    wgmma::wait_group<1>();
    wgmma::fence_operand(acc);
    if (kt > 0) {
      bars.release_stage(release.index);
      release.advance();
    }
    read.advance();
  }
  // Only after a mainloop: on the K = 0 path the zero-filled registers would meet an in-flight
  // wgmma's at this wait, and ptxas would then serialize every wgmma of the kernel.
  if (k_tiles > 0) {
    wgmma::wait_group<0>();
    wgmma::fence_operand(acc);
  }

  // ---- epilogue ---------------------------------------------------------------------------------
  // The other consumer may still be reading the ring with wgmma: wait for both before reusing it.
  ptx::named_barrier_sync(kBarConsumers, 128 * kConsumerWarpgroups);
  const bool leader = threadIdx.x % 128 == 0;
  epilogue_fragment<kBlockN>(acc, smem + consumer * kFragBytes, &map_d, tile.m0 + 64 * consumer, tile.n0, params, op,
                             kBarConsumer0 + consumer, leader);
  // Shared memory must outlive the bulk reads of the stores.
  if (leader) ptx::tma_store_wait_group<0>();
}
