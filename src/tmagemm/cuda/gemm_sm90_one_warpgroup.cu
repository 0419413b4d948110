// One-warpgroup TMA + wgmma GEMM, the design of the seed write-ups (seeds/004); docs/native-gemm.md.
//
// One warpgroup (128 threads) per 128 x BLOCK_N output tile. Thread 0 doubles as the TMA
// producer: it keeps STAGES k-blocks in flight, refilling a stage as soon as every consumer
// thread has released it on the stage's "empty" mbarrier; the warpgroup waits on the stage's
// "full" mbarrier, issues 2 x 4 wgmma (two 64-row fragments, four 32-byte K steps) and keeps one
// batch in flight while the next stage lands. The epilogue applies alpha/scales/bias/beta*C in
// fp32 registers, stages the tile in swizzled shared memory (stmatrix) and stores it with TMA.
#include "tmagemm/gemm_sm90.cuh"

using namespace tmagemm;
using namespace tmagemm::gemm;

namespace {
constexpr int kThreads = 128;
// The epilogue reuses the operand ring, which must hold both staged fragments.
constexpr int kEpiBytes = kBlockM * kBlockN * kOutBytes;
static_assert(kStages * kStageBytes >= kEpiBytes, "operand ring too small to stage the output tile");
static_assert(kBlockN <= 128, "one warpgroup holds 128 x BLOCK_N fp32 accumulators: BLOCK_N <= 128");
}  // namespace

extern "C" __global__ void __launch_bounds__(kThreads, 1)
    tmagemm_gemm_sm90_one_warpgroup(const __grid_constant__ CUtensorMap map_a,
                                    const __grid_constant__ CUtensorMap map_b,
                                    const __grid_constant__ CUtensorMap map_d,
                                    const __grid_constant__ Params params) {
  // ---- shared-memory plan: STAGES x [A 128 x 128 B | B BLOCK_N x 128 B], 1 KB aligned -------
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = aligned_smem(smem_raw);
  __shared__ alignas(8) u64 full[kStages];   // TMA bytes landed (1 arrival + tx bytes)
  __shared__ alignas(8) u64 empty[kStages];  // all 128 threads finished reading the stage

  const TileCoord tile = tile_origin(blockIdx.x, params);
  const int k_tiles = ceil_div(params.k, kBlockK);
  const bool producer = threadIdx.x == 0;

  // ---- descriptor prefetch, barrier init + fence + sync ------------------------------------
  // (gemm_sm90.cuh, "Programmatic dependent launch": everything up to the wait may overlap the
  // previous kernel, so it touches no global memory.)
  if (producer) init_pipeline(full, empty, kThreads, &map_a, &map_b, &map_d);
  __syncthreads();

  // ---- grid dependency: before the first load of A, the scales, C, and the first store --------
  wait_for_previous_kernel();

  // ---- prologue: fill the ring -------------------------------------------------------------
  if (producer) {
    for (int s = 0; s < min(kStages, k_tiles); ++s)
      load_stage(smem + s * kStageBytes, &full[s], &map_a, &map_b, s, tile.m0, tile.n0);
  }
  __syncwarp();

  // ---- mainloop -----------------------------------------------------------------------------
  const EpilogueOp op = epilogue_op(params);
  float acc[2][kAccRegs];
#pragma unroll
  for (int f = 0; f < 2; ++f)
#pragma unroll
    for (int i = 0; i < kAccRegs; ++i) acc[f][i] = 0.0f;

  const StageDescs descs(smem, 0);
  const ConsumerBarriers<> bars(full, empty);
  PipelineState read;      // stage the warpgroup computes on
  PipelineState released;  // stage whose wgmma batch retired last (refilled next)
  for (int kt = 0; kt < k_tiles; ++kt) {
    bars.wait_full(read.index, read.phase);
    const u64 a = descs.a_at(read.index), b = descs.b_at(read.index);
    wgmma::fence_operand(acc[0]);
    wgmma::fence_operand(acc[1]);
    wgmma::fence();
    mma_stage<kBlockN>(acc[0], a, b);
    mma_stage<kBlockN>(acc[1], wgmma::desc_advance(a, 64 * kRowBytes), b);
    wgmma::commit_group();
    // Keep this batch in flight; the previous one has retired, so its stage can be refilled.
    wgmma::wait_group<1>();
    wgmma::fence_operand(acc[0]);
    wgmma::fence_operand(acc[1]);
    if (kt > 0) {
      ptx::mbarrier_arrive(&empty[released.index]);
      const int next = kt - 1 + kStages;
      if (producer && next < k_tiles) {
        // Every thread of the warpgroup must be done with the stage, not just this one.
        ptx::mbarrier_wait(&empty[released.index], released.phase);
        load_stage(smem + released.index * kStageBytes, &full[released.index], &map_a, &map_b, next, tile.m0,
                   tile.n0);
      }
      __syncwarp();
      released.advance();
    }
    read.advance();
  }
  wgmma::wait_group<0>();
  wgmma::fence_operand(acc[0]);
  wgmma::fence_operand(acc[1]);
  if (producer) let_next_kernel_launch();  // every load issued and consumed: the epilogue is left

  // ---- epilogue -------------------------------------------------------------------------------
  // All loads were consumed and all wgmma retired: the ring is free to stage the output.
  __syncthreads();
#pragma unroll
  for (int f = 0; f < 2; ++f) {
    epilogue_apply<kBlockN>(acc[f], tile.m0 + 64 * f, tile.n0, params, op);
    epilogue_to_smem<kBlockN>(acc[f], ptx::smem_u32(smem + f * kFragBytes));
  }
  ptx::fence_proxy_async_shared();
  __syncthreads();
  if (producer) {
#pragma unroll
    for (int f = 0; f < 2; ++f) epilogue_issue_store<kBlockN>(&map_d, smem + f * kFragBytes, tile.m0 + 64 * f, tile.n0);
    // Shared memory must outlive the bulk reads of the stores.
    ptx::tma_store_wait_group<0>();
  }
}
