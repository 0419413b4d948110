// Pieces shared by the sm_90a GEMM kernels (gemm_sm90_one_warpgroup.cu, gemm_sm90_warp_specialized.cu,
// gemm_sm90_persistent.cu): compile-time problem types, kernel parameters, the pipeline
// stage/phase helper, grouped tile order, the TMA producer step, the programmatic-dependent-launch
// steps (grid dependency wait, dependents' trigger), the wgmma consumer step and the epilogue
// (alpha/scales/bias/beta*C in registers -> swizzled smem -> TMA store).
//
// Compile-time knobs (set by tmagemm/cuda/gemm.py through NVRTC -D flags):
//   TMAGEMM_AB_TYPE   0 f16, 1 bf16, 2 e4m3          (A and B share one type)
//   TMAGEMM_OUT_TYPE  0 f16, 1 bf16, 2 f32           (C for beta has the output type)
//   TMAGEMM_B_KMAJOR  1: B tile is K-major ((N, K) contiguous); 0: N-major ((K, N) contiguous)
//   TMAGEMM_BLOCK_N, TMAGEMM_STAGES                   tile width and pipeline depth
#pragma once

#include "tmagemm/ptx.cuh"
#include "tmagemm/wgmma.cuh"

#if !defined(TMAGEMM_AB_TYPE) || !defined(TMAGEMM_OUT_TYPE) || !defined(TMAGEMM_B_KMAJOR) || \
    !defined(TMAGEMM_BLOCK_N) || !defined(TMAGEMM_STAGES)
#error "gemm_sm90.cuh needs TMAGEMM_AB_TYPE, TMAGEMM_OUT_TYPE, TMAGEMM_B_KMAJOR, TMAGEMM_BLOCK_N, TMAGEMM_STAGES"
#endif

namespace tmagemm {
namespace gemm {

using u32 = unsigned int;
using u64 = unsigned long long;
using i64 = long long;

// ---------------------------------------------------------------------------------------------
// Static problem description
// ---------------------------------------------------------------------------------------------
constexpr int kAbType = TMAGEMM_AB_TYPE;
constexpr int kOutType = TMAGEMM_OUT_TYPE;
constexpr bool kBKMajor = TMAGEMM_B_KMAJOR != 0;
constexpr int kBlockN = TMAGEMM_BLOCK_N;
constexpr int kStages = TMAGEMM_STAGES;

constexpr int kBlockM = 128;
constexpr int kAbBytes = kAbType == wgmma::kE4M3 ? 1 : 2;
constexpr int kOutBytes = kOutType == wgmma::kOutF32 ? 4 : 2;
// One k-block is one 128-byte swizzle row: 64 elements of 16-bit types, 128 of e4m3. Every
// wgmma consumes 32 bytes of K (k16 x 2 B or k32 x 1 B), so a stage is always 4 instructions.
constexpr int kRowBytes = 128;
constexpr int kBlockK = kRowBytes / kAbBytes;
constexpr int kMmaPerStage = kRowBytes / 32;
constexpr int kStageBytesA = kBlockM * kRowBytes;
// Grouped GEMMs (TMAGEMM_GROUPED) load A as two 64-row boxes (the host encodes map_a with that
// box, cuda.gemm.a_box_rows), so that a tile whose second 64 rows lie past its group's end loads
// only the first: those rows belong to the next group (or padding) and feed outputs never stored.
#if defined(TMAGEMM_GROUPED) && TMAGEMM_GROUPED
constexpr bool kAHalfBoxes = true;
#else
constexpr bool kAHalfBoxes = false;
#endif
constexpr int kStageBytesB = kBlockN * kRowBytes;
constexpr int kStageBytes = kStageBytesA + kStageBytesB;
// A warpgroup's wgmma fragment is 64 rows x kBlockN columns: kAccRegs fp32 accumulators per
// thread, kFragBytes once converted to the output type.
constexpr int kAccRegs = kBlockN / 2;
constexpr int kFragBytes = 64 * kBlockN * kOutBytes;
// Warp-specialized kernels (warp_specialized, persistent): one producer warpgroup and
// kConsumerWarpgroups consumers.
// 65536 registers / 384 threads = 168 each at launch; the producer gives back down to 40 so each
// consumer thread can hold 128 fp32 accumulators plus addressing and the epilogue.
constexpr int kConsumerWarpgroups = 2;
constexpr int kWarpSpecializedThreads = 128 * (1 + kConsumerWarpgroups);
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegs = 232;
static_assert(128 * kProducerRegs + 128 * kConsumerWarpgroups * kConsumerRegs <= 65536, "register file");
// Epilogue tiles are staged as 64-row chunks one 128-byte swizzle row wide, which is also the
// TMA store box: 64 columns of 16-bit output or 32 of fp32.
constexpr int kEpiCols = kRowBytes / kOutBytes;
constexpr int kEpiChunkBytes = 64 * kRowBytes;

static_assert(kAbType == wgmma::kF16 || kAbType == wgmma::kBF16 || kAbType == wgmma::kE4M3, "AB type");
static_assert(kOutType == wgmma::kOutF16 || kOutType == wgmma::kOutBF16 || kOutType == wgmma::kOutF32, "out type");
static_assert(kBKMajor || kAbBytes == 2, "FP8 wgmma needs K-major B");
static_assert(kBlockN % 64 == 0 && kBlockN <= 256, "BLOCK_N: multiple of 64, at most 256 (TMA box limit)");
static_assert(kStages >= 2, "at least two stages to overlap TMA with wgmma");

// Kernel parameters after the three tensor maps. Mirrored by a ctypes.Structure in gemm.py:
// keep the field order and types in step.
struct Params {
  int m, n, k;
  int group_m;            // rows (columns if raster_n) of tiles per L2 group in the grouped order
  float alpha, beta;      // D = alpha * (sa * sb) * A @ B + bias + beta * C
  const void* c;          // beta source, output dtype, row stride ldc; null when beta == 0
  i64 ldc;
  const float* scale_a;   // null, (1,) or (M,)
  const float* scale_b;   // null, (1,) or (N,)
  const void* bias;       // null or (N,)
  int scale_a_rowwise;    // 1: scale_a has M entries
  int scale_b_colwise;    // 1: scale_b has N entries
  int bias_type;          // 0 f16, 1 bf16, 2 f32 (ignored when bias is null)
  int raster_n;           // 1: tile groups span group_m columns of tiles instead of rows
  // Block-scaled fp8 (TMAGEMM_BLOCK_SCALED): a's scales (M, ceil(K/128)) and the weight's 128x128
  // block scales (ceil(N/128), ceil(K/128)), read through these element strides; null otherwise.
  const float* block_scale_a;
  const float* block_scale_b;
  i64 block_scale_a_m, block_scale_a_k;
  i64 block_scale_b_n, block_scale_b_k;
  // Grouped GEMMs (TMAGEMM_GROUPED, gemm_sm90_persistent.cu): A, B and D are the experts'
  // operands stacked into 2-D maps (A and D by rows, B by rows of its (E * N, K) or (E * K, N)
  // view). Group g's rows are [start_g, start_g + rows_g) of A and D, rows_g read on the device
  // from group_counts (contiguous: offs, cumulative ends; masked: masked_m, null: all).
  const int* group_counts;
  int groups;             // E
  int group_layout;       // 0 contiguous (groups follow each other), 1 masked (group g starts at g * group_rows)
  int group_rows;         // masked: rows of A per expert (max_m)
  int b_group_rows;       // rows of B's 2-D map per expert: N (K-major) or K (N-major)
  i64 scale_b_group, bias_group, block_scale_b_group;  // element strides from one expert to the next
  // a's block scales of expert g sit g * block_scale_a_group elements past where its stacked rows
  // put them: 0 where the experts' scales are stacked rows (contiguous groups; masked ones with
  // an expert stride of group_rows rows), else expert stride - group_rows * block_scale_a_m
  // (e.g. DeepGEMM's (E, max_m, K/128) scales, each expert's contiguous along its rows).
  i64 block_scale_a_group;
  void* d;                // the output, for stores clipped at a group's last row
  i64 ldd;
  // Tail split (TMAGEMM_TAIL_SPLIT, gemm_sm90_persistent.cu): the fp32 fragments of the split
  // tiles' later K slices, and one arrival counter per (split tile, CTA, consumer), zero between
  // launches (the kernel re-arms them). Null when no launch of the plan splits.
  float* tail_partials;
  int* tail_counters;
  // Block-scaled: 1 when the kernel's map_sa and map_sb describe the scales (a's contiguous along
  // M, the weight's along K) and the producer loads them by TMA with the operands; 0: a producer
  // warp copies them 4 bytes at a time through the strides above (any layout).
  int block_scale_maps;
  // Grouped on single CTAs: groups of at least this many rows are the heavy kind, whose tiles are
  // spread evenly among the others' (gemm_sm90_persistent.cu); 0: every group heavy, the group order.
  int heavy_group_rows;
};

// ---------------------------------------------------------------------------------------------
// Pipeline stage/phase helper: the one place a stage index wraps and the parity flips.
// ---------------------------------------------------------------------------------------------
struct PipelineState {
  int index = 0;
  u32 phase = 0;
  __device__ __forceinline__ void advance() {
    if (++index == kStages) {
      index = 0;
      phase ^= 1;
    }
  }
};

// ---------------------------------------------------------------------------------------------
// Grouped tile order: consecutive tile ids walk `group` rows of tiles column by column, so
// CTAs running together share A rows and B columns in L2. With `raster_n` the roles swap: ids
// walk `group` columns of tiles row by row (better when B is the larger operand to keep in L2,
// or when there are few rows of tiles). Returns tile indices (row, column).
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }

struct TileIndex {
  int m, n;
};

struct TileCoord {
  int m0, n0;       // first output row and column of a tile
  int group = 0;    // grouped GEMMs: the tile's expert,
  int row_end = 0;  // and one past its group's last row (rows from here on are never stored)
};

__device__ __forceinline__ TileIndex grouped_tile(int tile, int tiles_m, int tiles_n, int group, bool raster_n) {
  // Written for row groups; column groups are the same walk on the transposed tile grid.
  const int major = raster_n ? tiles_n : tiles_m;
  const int minor = raster_n ? tiles_m : tiles_n;
  const int group_size = group * minor;
  const int first = (tile / group_size) * group;
  const int lines = min(major - first, group);
  const int in_group = tile % group_size;
  const int a = first + in_group % lines, b = in_group / lines;
  return raster_n ? TileIndex{b, a} : TileIndex{a, b};
}

// Origin of output tile `tile` in grouped order. kCluster > 1: the order walks cluster tiles of
// kCluster vertically adjacent CTA tiles, and CTA `rank` of the cluster takes row `rank`.
template <int kCluster = 1>
__device__ __forceinline__ TileCoord tile_origin(int tile, const Params& p, int rank = 0) {
  const TileIndex index =
      grouped_tile(tile, ceil_div(p.m, kBlockM * kCluster), ceil_div(p.n, kBlockN), p.group_m, p.raster_n);
  return TileCoord{(index.m * kCluster + rank) * kBlockM, index.n * kBlockN};
}

// ---------------------------------------------------------------------------------------------
// Kernel start, by one thread: prefetch the three tensor maps and initialise the ring's
// barriers (full: `loads` arrivals, the producer's plus any copying threads', and the TMA bytes;
// empty: `releases` arrivals), then fence so the TMA unit, and the other CTAs of a cluster, see
// the initialised barriers. The caller then syncs the CTA (or the cluster) before any thread
// uses them.
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ void init_pipeline(u64* full, u64* empty, unsigned releases, const CUtensorMap* map_a,
                                              const CUtensorMap* map_b, const CUtensorMap* map_d, unsigned loads = 1) {
  ptx::tma_prefetch_descriptor(map_a);
  ptx::tma_prefetch_descriptor(map_b);
  ptx::tma_prefetch_descriptor(map_d);
#pragma unroll
  for (int s = 0; s < kStages; ++s) {
    ptx::mbarrier_init(&full[s], loads);
    ptx::mbarrier_init(&empty[s], releases);
  }
  ptx::fence_barrier_init();
}

// A consumer warpgroup's side of the ring's barriers: it waits for a stage to be full and frees
// it once wgmma.wait_group has retired its reads of it. wgmma groups are tracked per warpgroup,
// so one thread arrives for all 128 (the empty barrier counts warpgroups). kCluster > 1: the
// peers' TMA writes into the stage too, so thread t arrives on CTA t's barrier. The reads are
// already complete, so the arrival publishes nothing: a cluster-scope release there would
// compile to a MEMBAR.ALL.GPU per k-block.
// kEveryWarp (block scales): each warp also loads the stage's scales itself, and one thread's
// retired group says nothing of another warp's loads, so every warp arrives once its lanes are
// done (the barrier counts warps). The arrival's CTA-scope release orders those loads before the
// scale loader's next writes, which come from this CTA.
//
// The barriers' addresses are computed once (stage 0's, warp-uniform): built from &full[stage]
// at every k-block, each address read the CTA's id in its cluster (S2UR SR_CgaCtaId, a
// long-latency read) between the adds of one k-block and the wait for the next.
template <int kCluster = 1, bool kEveryWarp = false>
struct ConsumerBarriers {
  u32 full;     // full[0]
  u32 release;  // the empty[0] this thread arrives on (a shared::cluster address for kCluster > 1)
  __device__ __forceinline__ ConsumerBarriers(u64* full_bars, u64* empty_bars) {
    full = ptx::warp_uniform(ptx::smem_u32(full_bars));
    const u32 empty = ptx::warp_uniform(ptx::smem_u32(empty_bars));
    release = kCluster == 1 ? empty : ptx::mapa_shared(empty, threadIdx.x % kCluster);
  }
  __device__ __forceinline__ void wait_full(int stage, u32 phase) const {
    ptx::mbarrier_wait(full + stage * static_cast<u32>(sizeof(u64)), phase);
  }
  __device__ __forceinline__ void release_stage(int stage) const {
    const int t = threadIdx.x % (kEveryWarp ? 32 : 128);
    const u32 bar = release + stage * static_cast<u32>(sizeof(u64));
    if constexpr (kEveryWarp) __syncwarp();  // every lane's reads before its warp's arrival
    if constexpr (kCluster == 1) {
      if (t == 0) ptx::mbarrier_arrive(bar);
    } else {
      if (t < kCluster) ptx::mbarrier_arrive_remote(bar);
    }
  }
};

// One 2-D box by TMA, with an L2 cache policy unless `policy` is 0.
__device__ __forceinline__ void load_box(void* dst, const CUtensorMap* map, u64* bar, int c0, int c1, u64 policy) {
  if (policy)
    ptx::tma_load_2d_hint(dst, map, bar, c0, c1, policy);
  else
    ptx::tma_load_2d(dst, map, bar, c0, c1);
}

// ---------------------------------------------------------------------------------------------
// Producer step: one thread loads k-block `k_tile` of the A and B tiles into a stage.
// Boxes past M, N or K are zero-filled by TMA, so ragged edges need no code here, and the
// expected byte count is always that of the whole boxes loaded.
//
// kCluster > 1: the CTAs of a cluster own vertically adjacent tiles with the same columns, so
// they need the same B tile. CTA `rank` loads its 1/kCluster share of B once from L2 and
// multicasts it to the same offset (and the same full barrier) in every CTA of the cluster;
// each CTA still expects the whole stage, because the shares of its peers land on it too.
//
// b_row0: rows of B's map before the tile's operand (grouped GEMMs stack the experts' weights:
// g * N rows of a K-major map, g * K of an N-major one; 0 otherwise). extra_bytes: boxes the
// caller loads into the stage besides A and B (block scales), expected with them. b_policy: 0,
// or an L2 cache policy for B's boxes on single CTAs (grouped GEMMs stream the weights of short
// groups with evict_first, so that they do not push out the operands other tiles reuse).
// a_rows: with kAHalfBoxes, the tile's rows before its group's end; at most 64 skips A's second
// box (its shared memory keeps stale bytes that only feed rows never stored).
// ---------------------------------------------------------------------------------------------
template <int kCluster = 1>
__device__ __forceinline__ void load_stage(unsigned char* stage, u64* full, const CUtensorMap* map_a,
                                           const CUtensorMap* map_b, int k_tile, int m0, int n0, int rank = 0,
                                           int b_row0 = 0, unsigned extra_bytes = 0, u64 b_policy = 0,
                                           int a_rows = kBlockM) {
  const int k0 = k_tile * kBlockK;
  const bool a_second_half = !kAHalfBoxes || a_rows > kBlockM / 2;
  ptx::mbarrier_arrive_expect_tx(full, kStageBytes - (a_second_half ? 0 : kStageBytesA / 2) + extra_bytes);
  ptx::tma_load_2d(stage, map_a, full, k0, m0);
  if (kAHalfBoxes && a_second_half) ptx::tma_load_2d(stage + kStageBytesA / 2, map_a, full, k0, m0 + kBlockM / 2);
  // K-major B's rows are columns of the output, N-major B's are K.
  const int bn0 = kBKMajor ? n0 + b_row0 : n0;
  const int bk0 = kBKMajor ? k0 : k0 + b_row0;
  unsigned char* b = stage + kStageBytesA;
  if constexpr (kCluster == 1) {
    if constexpr (kBKMajor) {
      load_box(b, map_b, full, bk0, bn0, b_policy);
    } else {
      // Row-major (K, N) B: a box is 64 N-columns (128 B) by 64 K-rows; boxes sit 8 KB apart,
      // the layout desc_mn_major describes.
#pragma unroll
      for (int j = 0; j < kBlockN / 64; ++j) load_box(b + j * 8192, map_b, full, bn0 + 64 * j, bk0, b_policy);
    }
  } else {
    constexpr unsigned short kMask = (1u << kCluster) - 1;
    if constexpr (kBKMajor) {
      // The host encodes this map with a box of BLOCK_N / kCluster rows.
      constexpr int kRows = kBlockN / kCluster;
      ptx::tma_load_2d_multicast(b + rank * kRows * kRowBytes, map_b, full, bk0, bn0 + rank * kRows, kMask);
    } else {
      constexpr int kBoxes = kBlockN / 64 / kCluster;
#pragma unroll
      for (int j = rank * kBoxes; j < (rank + 1) * kBoxes; ++j)
        ptx::tma_load_2d_multicast(b + j * 8192, map_b, full, bn0 + 64 * j, bk0, kMask);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Programmatic dependent launch. The host launches every GEMM so that it may start while the
// kernel before it in the stream drains (gemm.py, TMAGEMM_PDL). A kernel then runs, in order:
//   1. set-up that touches only shared memory and parameters: barrier init, descriptor prefetch;
//   2. wait_for_previous_kernel, by every thread, before any global read of A, B, scales, bias
//      or C and before any global write, and before any thread may exit (a kernel never
//      completes ahead of the one it follows);
//   3. let_next_kernel_launch, by the producer once it has issued its last load: the next
//      kernel's launch and set-up overlap this one's last k-blocks and epilogue.
// Measured on the Triton kernels (docs/small-m.md, "Programmatic dependent launch"): a trigger
// right after the wait lets the next kernel's CTAs sit on SM resources while this one streams
// (1.5-4% slower decode layers), and an L2 prefetch of the weight before the wait cost 1-2%.
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ void wait_for_previous_kernel() { ptx::griddep_wait(); }

__device__ __forceinline__ void let_next_kernel_launch() { ptx::griddep_launch_dependents(); }

// ---------------------------------------------------------------------------------------------
// Consumer step: acc(64 x kN) += A(64 rows) * B(kN columns) over one stage, from the operands'
// shared-memory descriptors; with kOverwrite, acc = A * B over the stage (the first instruction
// ignores acc's contents).
// ---------------------------------------------------------------------------------------------
template <int kN, bool kOverwrite = false>
__device__ __forceinline__ void mma_stage(float (&acc)[kN / 2], u64 desc_a, u64 desc_b) {
#pragma unroll
  for (int kk = 0; kk < kMmaPerStage; ++kk) {
    // K-major: the next 32 bytes of each 128-byte row (the hardware applies the swizzle to the
    // advanced address). MN-major: the next 16 K-rows of 128 bytes.
    const u32 b_step = kBKMajor ? 32 : 16 * kRowBytes;
    wgmma::Mma<kN, kAbType>::template run<kBKMajor ? 0 : 1>(acc, wgmma::desc_advance(desc_a, kk * 32),
                                                            wgmma::desc_advance(desc_b, kk * b_step),
                                                            kOverwrite && kk == 0 ? 0 : 1);
  }
}

// Descriptors of one consumer's A rows and of B in every stage of the ring, built once: stage s
// is stage 0's descriptors moved by s * kStageBytes, one integer add per k-block instead of
// rebuilding them from the ring's address (a chain of a dozen dependent uniform-datapath
// instructions between the full-barrier wait and the first wgmma of every k-block). Only the
// low words depend on the address; made warp-uniform, they stay in uniform registers instead of
// being recomputed from the shared-memory window every k-block.
struct StageDescs {
  u32 a_lo, b_lo;  // stage 0
  u32 a_hi, b_hi;
  __device__ __forceinline__ StageDescs(const unsigned char* ring, u32 a_offset) {
    const u64 a = wgmma::desc_k_major(ptx::smem_u32(ring) + a_offset);
    const u64 b = kBKMajor ? wgmma::desc_k_major(ptx::smem_u32(ring) + kStageBytesA)
                           : wgmma::desc_mn_major(ptx::smem_u32(ring) + kStageBytesA);
    a_lo = ptx::warp_uniform(static_cast<u32>(a));
    b_lo = ptx::warp_uniform(static_cast<u32>(b));
    a_hi = static_cast<u32>(a >> 32);
    b_hi = static_cast<u32>(b >> 32);
  }
  // The 14-bit address field never carries into the next one: shared memory is below 256 KB.
  __device__ __forceinline__ u64 a_at(int stage) const {
    return static_cast<u64>(a_hi) << 32 | (a_lo + static_cast<u32>(stage) * (kStageBytes >> 4));
  }
  __device__ __forceinline__ u64 b_at(int stage) const {
    return static_cast<u64>(b_hi) << 32 | (b_lo + static_cast<u32>(stage) * (kStageBytes >> 4));
  }
};

// ---------------------------------------------------------------------------------------------
// Epilogue. A warpgroup owns a 64 x kN fp32 fragment in the wgmma layout: thread t (warp w,
// lane l) holds rows 16w + l/4 (+8) and columns 8j + 2(l%4) (+1); register 4j + 2h + e is
// (row + 8h, column + e).
// ---------------------------------------------------------------------------------------------

// What the epilogue does to every tile, decided once per kernel before the mainloop: the
// scalar loads then overlap the pipeline fill instead of stalling each tile's epilogue on an L2
// round trip while the tensor cores wait.
struct EpilogueOp {
  int kind;     // kIdentity, kScale (one multiply: alpha and tensor-wise scales) or kGeneral
  float scale;  // kScale: alpha * scale_a * scale_b
};
enum : int { kIdentity = 0, kScale = 1, kGeneral = 2 };

__device__ __forceinline__ EpilogueOp epilogue_op(const Params& p) {
  if (p.alpha == 1.0f && p.scale_a == nullptr && p.scale_b == nullptr && p.bias == nullptr && p.beta == 0.0f)
    return {kIdentity, 1.0f};
  if (!p.scale_a_rowwise && !p.scale_b_colwise && p.bias == nullptr && p.beta == 0.0f)
    return {kScale, p.alpha * (p.scale_a ? p.scale_a[0] : 1.0f) * (p.scale_b ? p.scale_b[0] : 1.0f)};
  return {kGeneral, 0.0f};
}

// Column factors of one chunk of a thread's columns: v[j][e] = the element of column first +
// 8 (j0 + j) + e as float (kType: wgmma::kOut*), clamped to N - 1 with kClamp (a tile reaching
// past N), else at a fixed offset from one address (no per-column index arithmetic).
template <int kChunk, int kType, bool kClamp>
__device__ __forceinline__ void load_columns(float (&v)[kChunk][2], const void* ptr, int first, int j0, int n) {
#pragma unroll
  for (int j = 0; j < kChunk; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int c = first + 8 * (j0 + j) + e;
      v[j][e] = wgmma::load_as_float(ptr, kClamp ? min(c, n - 1) : c, kType);
    }
}

template <int kChunk, int kType>
__device__ __forceinline__ void load_columns(float (&v)[kChunk][2], const void* ptr, int first, int j0, int n,
                                             bool inside) {
  if (inside)
    load_columns<kChunk, kType, false>(v, ptr, first, j0, n);
  else
    load_columns<kChunk, kType, true>(v, ptr, first, j0, n);
}

// alpha, scales, bias and beta * C, in fp32 on the accumulators. Index loads are clamped
// to the problem; rows/columns past the edge are computed but never stored.
//
// Per-column factors (scale_b, bias) come a chunk of kChunk column pairs at a time, all loads of
// a chunk before the first use, with every uniform choice (which factors, the bias type, whether
// the tile reaches past N) taken once outside the per-element loops. Written element by element
// with those choices inside, this took 2.4x the kernel's instructions and ran the dense fp8
// row-wise GEMM at 551 us against 316 us tensor-wise (H100, 32768 x 4096 x 1536; now 363-368 us).
// Loading the row factors before the mainloop and column pairs in one load each measured no
// faster (BENCHMARKS.md).
template <int kN>
__device__ __forceinline__ void epilogue_apply(float (&acc)[kN / 2], int row0, int col0, const Params& p,
                                               EpilogueOp op) {
  if (op.kind == kIdentity) return;  // uniform branch: the plain GEMM pays nothing
  if (op.kind == kScale) {
#pragma unroll
    for (int i = 0; i < kN / 2; ++i) acc[i] *= op.scale;
    return;
  }
  const int t = threadIdx.x % 128;
  const int lane = t % 32;
  int rows[2];
  rows[0] = row0 + (t / 32) * 16 + lane / 4;
  rows[1] = rows[0] + 8;
  const bool col_scaled = p.scale_b != nullptr && p.scale_b_colwise;
  const float tensor_b = p.scale_b != nullptr && !p.scale_b_colwise ? p.scale_b[0] : 1.0f;
  float row_scale[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = min(rows[h], p.m - 1);
    row_scale[h] = p.alpha * tensor_b * (p.scale_a ? p.scale_a[p.scale_a_rowwise ? r : 0] : 1.0f);
  }
  const bool use_c = p.beta != 0.0f && p.c != nullptr;
  const int first = col0 + 2 * (lane % 4);  // this thread's first column; then + 8j (+1)
  const bool inside = col0 + kN <= p.n;
  constexpr int kChunk = kN / 8 < 8 ? kN / 8 : 8;
#pragma unroll
  for (int j0 = 0; j0 < kN / 8; j0 += kChunk) {
    float col_scale[kChunk][2], bias[kChunk][2];
    if (col_scaled) {
      load_columns<kChunk, wgmma::kOutF32>(col_scale, p.scale_b, first, j0, p.n, inside);
    } else {
#pragma unroll
      for (int j = 0; j < kChunk; ++j) col_scale[j][0] = col_scale[j][1] = 1.0f;
    }
    if (p.bias == nullptr) {
#pragma unroll
      for (int j = 0; j < kChunk; ++j) bias[j][0] = bias[j][1] = 0.0f;
    } else if (p.bias_type == wgmma::kOutF32) {
      load_columns<kChunk, wgmma::kOutF32>(bias, p.bias, first, j0, p.n, inside);
    } else if (p.bias_type == wgmma::kOutBF16) {
      load_columns<kChunk, wgmma::kOutBF16>(bias, p.bias, first, j0, p.n, inside);
    } else {
      load_columns<kChunk, wgmma::kOutF16>(bias, p.bias, first, j0, p.n, inside);
    }
#pragma unroll
    for (int j = 0; j < kChunk; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = 4 * (j0 + j) + 2 * h + e;
          acc[r] = acc[r] * (row_scale[h] * col_scale[j][e]) + bias[j][e];
        }
    if (use_c) {  // beta * C (rare: addmm-style calls)
#pragma unroll
      for (int j = 0; j < kChunk; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int col = first + 8 * (j0 + j) + e;
#pragma unroll
          for (int h = 0; h < 2; ++h)
            if (rows[h] < p.m && col < p.n)
              acc[4 * (j0 + j) + 2 * h + e] +=
                  p.beta * wgmma::load_as_float(p.c, static_cast<i64>(rows[h]) * p.ldc + col, kOutType);
        }
    }
  }
}

// Registers -> shared memory in the TMA store box layout: 64-row chunks of 128-byte rows with
// the 128-byte swizzle (16-byte unit index XOR row % 8), which also makes every warp's writes
// bank-conflict free. Writes chunks [kFirst, kFirst + kCount) of the fragment (a chunk is
// kEpiCols columns) to `smem`, which is 1 KB aligned and holds kCount chunks.
template <int kN, int kFirst = 0, int kCount = kN / kEpiCols>
__device__ __forceinline__ void epilogue_to_smem(const float (&acc)[kN / 2], u32 smem) {
  const int t = threadIdx.x % 128;
  const int warp = t / 32, lane = t % 32;
  if constexpr (kOutBytes == 2) {
    // stmatrix x4 stores columns 8j..8j+15 of the warp's 16 rows: matrices (rows 0-7, j),
    // (rows 8-15, j), (rows 0-7, j+1), (rows 8-15, j+1); lane l addresses row l % 8 of matrix l / 8.
    const int row = warp * 16 + ((lane / 8) & 1) * 8 + lane % 8;
#pragma unroll
    for (int j = kFirst * 8; j < (kFirst + kCount) * 8; j += 2) {
      const int unit = j + lane / 16;  // 16-byte column unit; j even, so j and j + 1 share a chunk
      const u32 addr =
          smem + (unit / 8 - kFirst) * kEpiChunkBytes + row * kRowBytes + (((unit % 8) ^ (row % 8)) << 4);
      wgmma::stmatrix_x4(addr, wgmma::pack2<kOutType>(acc[4 * j + 0], acc[4 * j + 1]),
                         wgmma::pack2<kOutType>(acc[4 * j + 2], acc[4 * j + 3]),
                         wgmma::pack2<kOutType>(acc[4 * j + 4], acc[4 * j + 5]),
                         wgmma::pack2<kOutType>(acc[4 * j + 6], acc[4 * j + 7]));
    }
  } else {
#pragma unroll
    for (int j = kFirst * 4; j < (kFirst + kCount) * 4; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = warp * 16 + lane / 4 + 8 * h;
        const int col = 8 * j + 2 * (lane % 4);
        const u32 byte = (col % kEpiCols) * 4;
        const u32 addr =
            smem + (col / kEpiCols - kFirst) * kEpiChunkBytes + row * kRowBytes + (byte ^ ((row % 8) << 4));
        asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(acc[4 * j + 2 * h]),
                     "f"(acc[4 * j + 2 * h + 1])
                     : "memory");
      }
    }
  }
}

// One thread sends staged chunks [kFirst, kFirst + kCount) of a fragment to global memory; TMA
// drops what lies past M or N.
template <int kN, int kFirst = 0, int kCount = kN / kEpiCols>
__device__ __forceinline__ void epilogue_issue_store(const CUtensorMap* map_d, const unsigned char* smem, int row0,
                                                     int col0) {
#pragma unroll
  for (int q = 0; q < kCount; ++q)
    ptx::tma_store_2d(map_d, smem + q * kEpiChunkBytes, col0 + (kFirst + q) * kEpiCols, row0);
  ptx::tma_store_commit_group();
}

// All 128 threads of a warpgroup copy staged chunks [kFirst, kFirst + kCount) of a fragment to
// p.d, 16 bytes at a time, skipping rows from row_limit on and columns past N: the store of a
// tile that ends inside a group (grouped GEMMs), where a TMA box would write the next group's rows.
// The host makes rows whole 16-byte units (as for TMA stores), so a unit is in or past N.
template <int kFirst, int kCount>
__device__ __forceinline__ void epilogue_store_clipped(const unsigned char* smem, const Params& p, int row0, int col0,
                                                       int row_limit) {
  constexpr int kElems = 16 / kOutBytes;  // outputs per 16-byte unit; 8 units per staged row
  const int t = threadIdx.x % 128;
#pragma unroll 4
  for (int u = t; u < kCount * 64 * 8; u += 128) {
    const int q = u / (64 * 8), row = (u / 8) % 64, unit = u % 8;
    const int r = row0 + row;
    const int col = col0 + (kFirst + q) * kEpiCols + unit * kElems;
    if (r >= row_limit || col >= p.n) continue;
    // The staging layout of epilogue_to_smem: 16-byte unit index XOR row % 8.
    const uint4 v = *reinterpret_cast<const uint4*>(smem + q * kEpiChunkBytes + row * kRowBytes + ((unit ^ (row % 8)) << 4));
    unsigned char* dst = static_cast<unsigned char*>(p.d) + (static_cast<i64>(r) * p.ldd + col) * kOutBytes;
    *reinterpret_cast<uint4*>(dst) = v;
  }
}

// Stage and store column slice kPass of kPasses, then the following ones. Slices alternate over
// kBuffers staging buffers of one slice each. kClipRows (grouped GEMMs): a fragment reaching
// row_limit is stored by epilogue_store_clipped instead of TMA.
template <int kN, int kPasses, int kBuffers, bool kClipRows, int kPass = 0>
__device__ __forceinline__ void epilogue_passes(const float (&acc)[kN / 2], unsigned char* smem,
                                                const CUtensorMap* map_d, int row0, int col0, const Params& p,
                                                int row_limit, int bar_id, bool leader) {
  if constexpr (kPass < kPasses) {
    constexpr int kCount = kN / kEpiCols / kPasses;
    unsigned char* buffer = smem + (kPass % kBuffers) * kCount * kEpiChunkBytes;
    const bool clipped = kClipRows && row0 + 64 > row_limit;
    // The buffer may still be read by the store issued kBuffers slices ago (in persistent
    // kernels, maybe by the previous tile): the leader waits until at most the kBuffers - 1
    // newer stores are reading, the barrier tells everyone. With two buffers that store was
    // issued a whole slice earlier, so the wait rarely stalls. A clipped slice commits no TMA
    // store, so it waits for all of them: the count stays right for the slices after it.
    if (leader) {
      if (clipped)
        ptx::tma_store_wait_group_read<0>();
      else
        ptx::tma_store_wait_group_read<kBuffers - 1>();
    }
    ptx::named_barrier_sync(bar_id, 128);
    epilogue_to_smem<kN, kPass * kCount, kCount>(acc, ptx::smem_u32(buffer));
    // Generic-proxy writes must be ordered before the async-proxy (TMA) read of the same bytes.
    ptx::fence_proxy_async_shared();
    ptx::named_barrier_sync(bar_id, 128);
    if (clipped)
      epilogue_store_clipped<kPass * kCount, kCount>(buffer, p, row0, col0, row_limit);
    else if (leader)
      epilogue_issue_store<kN, kPass * kCount, kCount>(map_d, buffer, row0, col0);
    epilogue_passes<kN, kPasses, kBuffers, kClipRows, kPass + 1>(acc, smem, map_d, row0, col0, p, row_limit, bar_id,
                                                                 leader);
  }
}

// The whole epilogue of one warpgroup fragment, staged in kPasses column slices so the staging
// memory (kBuffers slices of 64 x kN / kPasses outputs) can be smaller than the fragment.
// `bar_id` is a named barrier private to the warpgroup; `leader` is one of its threads, the only
// one that issues (and waits on) stores. kClipRows: rows from row_limit on are not stored.
template <int kN, int kPasses = 1, int kBuffers = 1, bool kClipRows = false>
__device__ __forceinline__ void epilogue_fragment(float (&acc)[kN / 2], unsigned char* smem, const CUtensorMap* map_d,
                                                  int row0, int col0, const Params& p, EpilogueOp op, int bar_id,
                                                  bool leader, int row_limit = 0) {
  static_assert((kN / kEpiCols) % kPasses == 0, "epilogue passes must split the chunks evenly");
  static_assert(kBuffers == 1 || (kBuffers == 2 && kPasses >= 2), "one buffer, or two alternating slices");
  epilogue_apply<kN>(acc, row0, col0, p, op);
  epilogue_passes<kN, kPasses, kBuffers, kClipRows>(acc, smem, map_d, row0, col0, p, row_limit, bar_id, leader);
}

// Dynamic shared memory rounded up to 1 KB: 128-byte swizzled TMA boxes and wgmma atoms need
// 1 KB alignment, which the dynamic window does not promise (the host asks for 1 KB extra).
__device__ __forceinline__ unsigned char* aligned_smem(unsigned char* raw) {
  const u32 addr = ptx::smem_u32(raw);
  return raw + (((addr + 1023) & ~1023u) - addr);
}

}  // namespace gemm
}  // namespace tmagemm
