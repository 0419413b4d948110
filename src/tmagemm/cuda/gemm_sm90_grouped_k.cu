// Grouped GEMM over the reduction dimension, warp-specialized and persistent: the weight gradient
// of a Mixture-of-Experts layer (torch._grouped_mm's 2-D x 2-D form; tmagemm/cuda/grouped_k.py).
//
//   out[g] = a[:, K_g] @ b[K_g, :]     a = x.t() of x (K_total, M); b (K_total, N); out (E, M, N)
//
// Both operands are read along their rows of K_total (x and the output gradient dy, tokens sorted
// by expert), so A is MN-major here: its TMA boxes are 64 M-columns (128 bytes) x 64 K-rows, the
// layout desc_mn_major describes, and wgmma reads A and B transposed.
//
// The groups stay on the device: after the grid dependency wait the CTA turns the counts into a
// table in shared memory of (group, first row, end row), longest group first, and walks the work
// items (group, 128 x BLOCK_N output tile) in that order, in rounds of gridDim.x items, CTA c
// taking item c of even rounds and gridDim.x - 1 - c of odd ones (the items of a round shrink
// along it, so each CTA's sum of K loops stays even). One producer thread streams every item's
// k-blocks, running ahead into the next item while the two consumer warpgroups (64 rows each)
// finish the current one's wgmmas and store it: a short group's tile (a few k-blocks and a 64 KB
// store) costs no pipeline fill.
//
// Group edges: no value of another group may reach a result, not even an Inf or NaN through a
// zero of the other operand. A group of at least 64 rows runs whole k-blocks from its first row
// and, if rows are left, one more on the box that ends at its last row: that box lies inside the
// group, and each consumer zeroes in shared memory its A rows the k-blocks before counted (b's
// box is used as TMA loaded it; a group's own Inf in b then meets a zero of a: NaN where
// float64 has an Inf). A group of fewer rows takes one box from its first row, whose rows past
// the group's end both consumers zero in A and B before the wgmmas. Zeros are written by the
// generic proxy and fenced before the async proxy (wgmma) reads them.
#include "tmagemm/gemm_sm90.cuh"

#if !defined(TMAGEMM_EPI_PASSES) || !defined(TMAGEMM_EPI_BUFFERS)
#error "gemm_sm90_grouped_k.cu needs TMAGEMM_EPI_PASSES and TMAGEMM_EPI_BUFFERS (and gemm_sm90.cuh's knobs)"
#endif

using namespace tmagemm;
using namespace tmagemm::gemm;

namespace {
static_assert(kAbBytes == 2, "16-bit operands: fp8 wgmma reads K-major operands only");
static_assert(!kBKMajor, "b is read along its rows of K_total (N-major)");
constexpr int kEpiPasses = TMAGEMM_EPI_PASSES;
constexpr int kEpiBuffers = TMAGEMM_EPI_BUFFERS;
constexpr int kEpiBytesPerConsumer = kFragBytes / kEpiPasses * kEpiBuffers;
constexpr int kBoxBytes = 64 * kRowBytes;  // one 64-column x 64-row box of A or B
// Named barriers: 0 is __syncthreads; 1 + i private to consumer i; 3 both consumers (a short
// group's edge rows of B).
constexpr int kBarConsumer0 = 1;
constexpr int kBarBothConsumers = 3;

// One work item: its group, output tile origin within the group's (M, N) block, and the group's rows.
struct Item {
  int group, m0, n0, start, rows;
};

// k-blocks of a group of `rows` rows (a group shorter than a k-block still takes one).
__device__ __forceinline__ int item_k_blocks(int rows) { return rows >= kBlockK ? ceil_div(rows, kBlockK) : (rows > 0); }

// First K_total row of k-block kb: whole k-blocks from the group's start, then the box that ends
// at its last row; a short group's one box starts at its first row.
__device__ __forceinline__ int k_block_row(const Item& it, int kb) {
  if (it.rows < kBlockK || kb < it.rows / kBlockK) return it.start + kb * kBlockK;
  return it.start + it.rows - kBlockK;
}

__device__ __forceinline__ Item item_at(int i, const int* table, const Params& p, int tiles_m, int tiles_n) {
  const int per_group = tiles_m * tiles_n;
  const int rank = i / per_group;
  const TileIndex t = grouped_tile(i % per_group, tiles_m, tiles_n, p.group_m, false);
  return Item{table[3 * rank], t.m * kBlockM, t.n * kBlockN, table[3 * rank + 1], table[3 * rank + 2] - table[3 * rank + 1]};
}

// The group table (every thread): group g's rows [start, end) of K_total by the row rule of the
// other grouped GEMMs (contiguous: ends are the running maximum of offs clamped to [0, K_total],
// each group starting where the previous one ended; masked: the first clamp(counts[g], 0, rows)
// of the group's `rows`; batched: all of them), then table[3r .. 3r + 2] = (group, start, end) of
// the group ranked r by rows, most first (ties in group order). `scratch` holds 2 x E ints.
__device__ __forceinline__ void build_table(int* table, int* scratch, const Params& p) {
  const int e = p.groups, tid = threadIdx.x;
  int* starts = scratch;
  int* lens = scratch + e;
  if (p.group_layout == 0) {
    if (tid < 32) {  // one warp: each lane a run of groups, its running maximum, then a warp scan
      const int per_lane = ceil_div(e, 32);
      const int first = min(tid * per_lane, e), last = min(first + per_lane, e);
      int run = 0;
      for (int g = first; g < last; ++g) {
        run = max(run, min(max(p.group_counts[g], 0), p.k));
        lens[g] = run;  // the running maximum within the run, for now
      }
      int before = run;
#pragma unroll
      for (int d = 1; d < 32; d *= 2) {
        const int v = __shfl_up_sync(0xffffffffu, before, d);
        if (tid >= d) before = max(before, v);
      }
      before = __shfl_up_sync(0xffffffffu, before, 1);
      if (tid == 0) before = 0;
      for (int g = first; g < last; ++g) lens[g] = max(lens[g], before);  // the group's end
    }
    __syncthreads();
    for (int g = tid; g < e; g += blockDim.x) starts[g] = g == 0 ? 0 : lens[g - 1];
    __syncthreads();
    for (int g = tid; g < e; g += blockDim.x) lens[g] -= starts[g];
  } else {
    for (int g = tid; g < e; g += blockDim.x) {
      starts[g] = g * p.group_rows;
      lens[g] = p.group_counts ? min(max(p.group_counts[g], 0), p.group_rows) : p.group_rows;
    }
  }
  __syncthreads();
  for (int g = tid; g < e; g += blockDim.x) {
    const int len = lens[g];
    int rank = 0;
    for (int h = 0; h < e; ++h) rank += lens[h] > len || (lens[h] == len && h < g);
    table[3 * rank] = g;
    table[3 * rank + 1] = starts[g];
    table[3 * rank + 2] = starts[g] + len;
  }
  __syncthreads();
}

// Zeroes rows [r0, r1) of one 64-row box in shared memory: a row is 128 contiguous bytes (the
// swizzle only permutes 16-byte units within it). `count` threads, this one `t` of them.
__device__ __forceinline__ void zero_box_rows(unsigned char* box, int r0, int r1, int t, int count) {
  const uint4 zero = make_uint4(0, 0, 0, 0);
  for (int u = r0 * 8 + t; u < r1 * 8; u += count) reinterpret_cast<uint4*>(box)[u] = zero;
}

// wgmma over one stage, A and B both MN-major: every instruction takes the next 16 K-rows.
__device__ __forceinline__ void mma_stage_mn(float (&acc)[kAccRegs], u64 desc_a, u64 desc_b) {
#pragma unroll
  for (int kk = 0; kk < kMmaPerStage; ++kk)
    wgmma::Mma<kBlockN, kAbType>::template run<1, 1>(acc, wgmma::desc_advance(desc_a, kk * 16 * kRowBytes),
                                                     wgmma::desc_advance(desc_b, kk * 16 * kRowBytes));
}
}  // namespace

extern "C" __global__ void __launch_bounds__(kWarpSpecializedThreads, 1)
    tmagemm_gemm_sm90_grouped_k(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                                const __grid_constant__ CUtensorMap map_d, const __grid_constant__ Params params) {
  // ---- shared memory: STAGES x [A | B] ring, one epilogue buffer per consumer, the group table --
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = aligned_smem(smem_raw);
  unsigned char* epi = smem + kStages * kStageBytes;
  int* table = reinterpret_cast<int*>(epi + kConsumerWarpgroups * kEpiBytesPerConsumer);
  __shared__ alignas(8) u64 full[kStages];
  __shared__ alignas(8) u64 empty[kStages];

  const int tiles_m = ceil_div(params.m, kBlockM), tiles_n = ceil_div(params.n, kBlockN);
  const int warpgroup = static_cast<int>(ptx::warp_uniform(threadIdx.x / 128));
  if (threadIdx.x == 0) init_pipeline(full, empty, kConsumerWarpgroups, &map_a, &map_b, &map_d);
  __syncthreads();

  // ---- grid dependency (gemm_sm90.cuh): before reading the counts or any operand, and before
  // the first store; every thread, whether or not this CTA has items.
  wait_for_previous_kernel();
  // The epilogue buffers are idle until the first tile's epilogue: scratch for the table.
  build_table(table, reinterpret_cast<int*>(epi), params);

  // ---- schedule: rounds of gridDim.x items, snake order (see the top of the file) ----------------
  const int items = params.groups * tiles_m * tiles_n;
  const int ctas = gridDim.x, cta = blockIdx.x;
  const int full_rounds = items / ctas;
  const int last_slot = full_rounds % 2 == 0 ? cta : ctas - 1 - cta;
  const int my_items = full_rounds + (last_slot < items % ctas ? 1 : 0);
  auto item_index = [&](int r) { return r * ctas + (r % 2 == 0 ? cta : ctas - 1 - cta); };

  if (warpgroup == 0) {
    // ---- producer: every k-block of every item, in the order the consumers read them -------------
    ptx::warpgroup_reg_dealloc<kProducerRegs>();
    if (threadIdx.x == 0) {
      PipelineState write;
      for (int r = 0; r < my_items; ++r) {
        const Item it = item_at(item_index(r), table, params, tiles_m, tiles_n);
        const int k_blocks = item_k_blocks(it.rows);
        for (int kb = 0; kb < k_blocks; ++kb) {
          ptx::mbarrier_wait(&empty[write.index], write.phase ^ 1);
          unsigned char* stage = smem + write.index * kStageBytes;
          const int row = k_block_row(it, kb);
          ptx::mbarrier_arrive_expect_tx(&full[write.index], kStageBytes);
#pragma unroll
          for (int j = 0; j < kBlockM / 64; ++j)
            ptx::tma_load_2d(stage + j * kBoxBytes, &map_a, &full[write.index], it.m0 + 64 * j, row);
#pragma unroll
          for (int j = 0; j < kBlockN / 64; ++j)
            ptx::tma_load_2d(stage + kStageBytesA + j * kBoxBytes, &map_b, &full[write.index], it.n0 + 64 * j, row);
          write.advance();
        }
      }
      let_next_kernel_launch();  // this CTA's last loads are in flight: the next kernel may launch
    }
    return;
  }

  // ---- consumers: 64 rows of each tile each --------------------------------------------------------
  ptx::warpgroup_reg_alloc<kConsumerRegs>();
  const int consumer = warpgroup - 1;
  const int t = threadIdx.x % 128;
  const bool leader = t == 0;
  unsigned char* my_epi = epi + consumer * kEpiBytesPerConsumer;
  const StageDescs descs(smem, 0);  // B's MN-major descriptors (A's are MN-major too, below)
  // This consumer's A box of stage 0; stage s is s * kStageBytes further (16-byte units).
  const u64 desc_a0 = wgmma::desc_mn_major(ptx::smem_u32(smem + consumer * kBoxBytes));
  const u64 a_step = kStageBytes >> 4;
  const ConsumerBarriers<> bars(full, empty);
  float acc[kAccRegs];
  PipelineState read;
  for (int r = 0; r < my_items; ++r) {
    const Item it = item_at(item_index(r), table, params, tiles_m, tiles_n);
    const int k_blocks = item_k_blocks(it.rows);
#pragma unroll
    for (int i = 0; i < kAccRegs; ++i) acc[i] = 0.0f;
    PipelineState release = read;
    for (int kb = 0; kb < k_blocks; ++kb) {
      bars.wait_full(read.index, read.phase);
      unsigned char* stage = smem + read.index * kStageBytes;
      if (kb == k_blocks - 1 && it.rows % kBlockK != 0) {
        if (it.rows > kBlockK) {
          // The box ending at the group's last row: its first rows were counted by the k-block before.
          zero_box_rows(stage + consumer * kBoxBytes, 0, kBlockK - it.rows % kBlockK, t, 128);
          ptx::fence_proxy_async_shared();
          ptx::named_barrier_sync(kBarConsumer0 + consumer, 128);
        } else {
          // A short group's one box: rows past its end are the next group's, in A and in B.
          zero_box_rows(stage + consumer * kBoxBytes, it.rows, kBlockK, t, 128);
#pragma unroll
          for (int j = 0; j < kBlockN / 64; ++j)
            zero_box_rows(stage + kStageBytesA + j * kBoxBytes, it.rows, kBlockK, consumer * 128 + t, 256);
          ptx::fence_proxy_async_shared();
          ptx::named_barrier_sync(kBarBothConsumers, 256);
        }
      }
      const u64 a = desc_a0 + static_cast<u64>(read.index) * a_step;
      wgmma::fence_operand(acc);
      wgmma::fence();
      mma_stage_mn(acc, a, descs.b_at(read.index));
      wgmma::commit_group();
      wgmma::wait_group<1>();
      wgmma::fence_operand(acc);
      // One batch stays in flight; the one before it has retired and its stage goes back.
      if (kb > 0) {
        bars.release_stage(release.index);
        release.advance();
      }
      read.advance();
    }
    wgmma::wait_group<0>();
    wgmma::fence_operand(acc);
    if (k_blocks > 0) bars.release_stage(release.index);

    // ---- epilogue: out rows g * M + m0 + 64 * consumer of the (E * M, N) map, clipped at the
    // group's block (rows past M belong to the next expert's gradient) --------------------------------
    const int block0 = it.group * params.m;
    epilogue_fragment<kBlockN, kEpiPasses, kEpiBuffers, true>(
        acc, my_epi, &map_d, block0 + it.m0 + 64 * consumer, it.n0, params, EpilogueOp{kIdentity, 1.0f},
        kBarConsumer0 + consumer, leader, block0 + params.m);
  }
  if (leader) ptx::tma_store_wait_group<0>();
}
