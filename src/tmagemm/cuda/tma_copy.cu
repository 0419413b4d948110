// TMA copy kernels: a tile-wise elementwise op in shared memory, a layout probe that dumps the raw
// shared-memory bytes one TMA load produces, and a pipelined bulk copy for throughput.
//
// Variants are selected with -D macros by tma_copy.py:
//   tma_elementwise_2d: ELEM_TYPE (0 int32, 1 float32, 2 bfloat16, 3 fp8 e4m3), BOX_ROWS,
//                       BOX_COLS (elements), SWIZZLE_SPAN (0/32/64/128 bytes).
//   tma_probe:          PROBE_RANK (1..5).
//   tma_copy_2d:        BOX_ROWS, BOX_COLS, ELEM_BYTES, ROW_PITCH (smem bytes per box row), STAGES.
//
// Shared-memory layout of a box: inner rows one after another; under a swizzle each row takes
// the full span even when it is shorter (e.g. 64 B of data in a 128 B row under 128B swizzle),
// then the 16-byte chunks of every 128-byte line are XOR-permuted (ptx::swizzle_offset).
#include <tmagemm/ptx.cuh>

namespace ptx = tmagemm::ptx;

// Dynamic shared memory is only guaranteed 16-byte aligned; swizzled TMA boxes need 1024 (the
// swizzle pattern repeats every 8 x 128 B and is computed from absolute smem address bits), so
// every kernel over-allocates 1 KB and rounds its base up.
__device__ __forceinline__ unsigned char* align_1024(unsigned char* base) {
  unsigned pad = (1024u - (ptx::smem_u32(base) & 1023u)) & 1023u;
  return base + pad;
}

#ifdef ELEM_TYPE
// ---------------------------------------------------------------------------------------------
// Elementwise: out = 2 * in - 1, one box per CTA, computed in place in shared memory.
// ---------------------------------------------------------------------------------------------
#if ELEM_TYPE == 0
typedef int elem_t;
#elif ELEM_TYPE == 1
typedef float elem_t;
#elif ELEM_TYPE == 2
typedef unsigned short elem_t;  // bfloat16 bits
#elif ELEM_TYPE == 3
typedef unsigned char elem_t;  // fp8 e4m3 bits
#else
#error "ELEM_TYPE must be 0 (int32), 1 (float32), 2 (bfloat16) or 3 (fp8 e4m3)"
#endif

static_assert(BOX_ROWS >= 1 && BOX_ROWS <= 256 && BOX_COLS >= 1 && BOX_COLS <= 256, "box dims are 1..256");
static_assert((BOX_COLS * sizeof(elem_t)) % 16 == 0, "inner box bytes must be a multiple of 16");
static_assert(SWIZZLE_SPAN == 0 || BOX_COLS * sizeof(elem_t) <= SWIZZLE_SPAN, "inner box must fit the swizzle span");

__device__ __forceinline__ elem_t twice_minus_one(elem_t x) {
#if ELEM_TYPE == 0
  return 2 * x - 1;  // wraps like the int32 reference
#elif ELEM_TYPE == 1
  return 2.0f * x - 1.0f;
#elif ELEM_TYPE == 2
  // bf16 -> fp32 is a shift; 2x-1 is exact in fp32 for bf16 x, so the single rounding is the
  // final cvt.rn, as in a float64 reference.
  float f = __uint_as_float(static_cast<unsigned>(x) << 16);
  unsigned short y;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(y) : "f"(2.0f * f - 1.0f));
  return y;
#else
  // e4m3 -> f16 (exact) -> f32, then one rounding back with satfinite.
  unsigned short pair = x, half2;
  unsigned f16x2;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(f16x2) : "h"(pair));
  half2 = static_cast<unsigned short>(f16x2 & 0xffffu);
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(half2));
  unsigned short packed;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(packed) : "f"(0.0f), "f"(2.0f * f - 1.0f));
  return static_cast<elem_t>(packed & 0xffu);
#endif
}

extern "C" __global__ void __launch_bounds__(128) tma_elementwise_2d(const __grid_constant__ CUtensorMap in_map,
                                                                      const __grid_constant__ CUtensorMap out_map) {
  // Bytes the load delivers (the expect-tx count) vs. the smem pitch of one box row.
  constexpr unsigned kTileBytes = BOX_ROWS * BOX_COLS * sizeof(elem_t);
  constexpr unsigned kPitch = SWIZZLE_SPAN ? SWIZZLE_SPAN : BOX_COLS * sizeof(elem_t);
  extern __shared__ unsigned char dynamic_smem[];
  unsigned char* tile = align_1024(dynamic_smem);
  __shared__ unsigned long long full;

  // Box origin in elements; TMA coordinates are innermost (column) first.
  const int col0 = blockIdx.x * BOX_COLS;
  const int row0 = blockIdx.y * BOX_ROWS;

  if (threadIdx.x == 0) {
    ptx::tma_prefetch_descriptor(&in_map);
    ptx::tma_prefetch_descriptor(&out_map);
    ptx::mbarrier_init(&full, 1);
    ptx::fence_barrier_init();  // the async proxy must see the initialised barrier
  }
  __syncthreads();

  if (threadIdx.x == 0) {
    // The whole box counts, including out-of-bounds elements TMA fills.
    ptx::mbarrier_arrive_expect_tx(&full, kTileBytes);
    ptx::tma_load_2d(tile, &in_map, &full, col0, row0);
  }
  ptx::mbarrier_wait(&full, 0);

  // Element (r, c) of the box sits at byte r * pitch + c * size, passed through the swizzle.
  for (unsigned i = threadIdx.x; i < BOX_ROWS * BOX_COLS; i += blockDim.x) {
    const unsigned r = i / BOX_COLS, c = i % BOX_COLS;
    elem_t* p = reinterpret_cast<elem_t*>(tile + ptx::swizzle_offset<SWIZZLE_SPAN>(r * kPitch + c * sizeof(elem_t)));
    *p = twice_minus_one(*p);
  }
  // Generic-proxy writes must be ordered before the async-proxy (TMA) read of the store, per
  // thread, then gathered by the CTA barrier.
  ptx::fence_proxy_async_shared();
  __syncthreads();

  if (threadIdx.x == 0) {
    // Out-of-bounds parts of the box are not written: ragged edges stay untouched.
    ptx::tma_store_2d(&out_map, tile, col0, row0);
    ptx::tma_store_commit_group();
    ptx::tma_store_wait_group_read<0>();  // smem must outlive the store's read
  }
}
#endif  // ELEM_TYPE

#ifdef PROBE_RANK
// ---------------------------------------------------------------------------------------------
// Layout probe: one TMA load, then the raw shared-memory region (box plus slack) copied out.
// ---------------------------------------------------------------------------------------------
static_assert(PROBE_RANK >= 1 && PROBE_RANK <= 5, "PROBE_RANK is 1..5");

extern "C" __global__ void __launch_bounds__(128)
    tma_probe(const __grid_constant__ CUtensorMap map, unsigned char* out, int c0, int c1, int c2, int c3, int c4,
              unsigned box_bytes, unsigned region_bytes, unsigned char sentinel) {
  extern __shared__ unsigned char dynamic_smem[];
  unsigned char* region = align_1024(dynamic_smem);
  __shared__ unsigned long long full;

  // Pre-fill with a sentinel so bytes TMA did not write are visible in the dump.
  for (unsigned i = threadIdx.x; i < region_bytes; i += blockDim.x) region[i] = sentinel;
  ptx::fence_proxy_async_shared();  // order the sentinel writes before the TMA overwrite
  if (threadIdx.x == 0) {
    ptx::mbarrier_init(&full, 1);
    ptx::fence_barrier_init();
  }
  __syncthreads();

  if (threadIdx.x == 0) {
    ptx::mbarrier_arrive_expect_tx(&full, box_bytes);
#if PROBE_RANK == 1
    ptx::tma_load_1d(region, &map, &full, c0);
#elif PROBE_RANK == 2
    ptx::tma_load_2d(region, &map, &full, c0, c1);
#elif PROBE_RANK == 3
    ptx::tma_load_3d(region, &map, &full, c0, c1, c2);
#elif PROBE_RANK == 4
    ptx::tma_load_4d(region, &map, &full, c0, c1, c2, c3);
#else
    ptx::tma_load_5d(region, &map, &full, c0, c1, c2, c3, c4);
#endif
  }
  ptx::mbarrier_wait(&full, 0);

  for (unsigned i = threadIdx.x; i < region_bytes; i += blockDim.x) out[i] = region[i];
}
#endif  // PROBE_RANK

#ifdef STAGES
// ---------------------------------------------------------------------------------------------
// Pipelined copy: each CTA walks tiles blockIdx.x, +gridDim.x, ...; one elected thread keeps
// STAGES-1 loads in flight and stores each tile straight from shared memory.
// ---------------------------------------------------------------------------------------------
static_assert(STAGES >= 2 && STAGES <= 16, "STAGES is 2..16");

extern "C" __global__ void __launch_bounds__(32)
    tma_copy_2d(const __grid_constant__ CUtensorMap in_map, const __grid_constant__ CUtensorMap out_map,
                int tiles_cols, int num_tiles) {
  constexpr unsigned kTileBytes = BOX_ROWS * BOX_COLS * ELEM_BYTES;
  // Stages start on 1024-byte boundaries so any swizzle mode is valid for every stage.
  constexpr unsigned kStageStride = (BOX_ROWS * ROW_PITCH + 1023u) / 1024u * 1024u;
  extern __shared__ unsigned char dynamic_smem[];
  unsigned char* stages = align_1024(dynamic_smem);
  __shared__ unsigned long long full[STAGES];

  if (!ptx::elect_one_sync()) return;  // a single thread drives the TMA unit

  ptx::tma_prefetch_descriptor(&in_map);
  ptx::tma_prefetch_descriptor(&out_map);
  for (int s = 0; s < STAGES; ++s) ptx::mbarrier_init(&full[s], 1);
  ptx::fence_barrier_init();

  const int local_tiles = num_tiles > static_cast<int>(blockIdx.x)
                              ? (num_tiles - 1 - static_cast<int>(blockIdx.x)) / static_cast<int>(gridDim.x) + 1
                              : 0;
  auto load = [&](int i) {
    const int tile = blockIdx.x + i * gridDim.x;
    const int s = i % STAGES;
    ptx::mbarrier_arrive_expect_tx(&full[s], kTileBytes);
    ptx::tma_load_2d(stages + s * kStageStride, &in_map, &full[s], (tile % tiles_cols) * BOX_COLS,
                     (tile / tiles_cols) * BOX_ROWS);
  };

  for (int i = 0; i < STAGES && i < local_tiles; ++i) load(i);
  for (int i = 0; i < local_tiles; ++i) {
    const int tile = blockIdx.x + i * gridDim.x;
    const int s = i % STAGES;
    // Stage s is filled for the (i / STAGES)-th time: wait for that phase's parity.
    ptx::mbarrier_wait(&full[s], (i / STAGES) & 1);
    ptx::tma_store_2d(&out_map, stages + s * kStageStride, (tile % tiles_cols) * BOX_COLS,
                      (tile / tiles_cols) * BOX_ROWS);
    ptx::tma_store_commit_group();
    // Refill the stage of tile i-1 once its store has finished reading it; the store of tile i
    // stays in flight meanwhile.
    if (i >= 1 && i - 1 + STAGES < local_tiles) {
      ptx::tma_store_wait_group_read<1>();
      load(i - 1 + STAGES);
    }
  }
  ptx::tma_store_wait_group_read<0>();
}
#endif  // STAGES
