// Persistent warp-specialized GEMM kernels, cooperative and ping-pong (docs/native-gemm.md).
//
// One CTA per SM walks the tiles blockIdx.x, blockIdx.x + gridDim.x, ... in grouped order, so
// the producer streams the next tile's k-blocks while the consumers run the current tile's
// epilogue, and launch/tail costs are paid once per SM instead of once per tile. Two consumer
// schedules (TMAGEMM_PINGPONG):
//   0 cooperative: both consumer warpgroups share each 128 x BLOCK_N tile (64 rows each).
//   1 ping-pong:   consumer warpgroups take alternate tiles (128 x BLOCK_N each, two 64-row
//                  fragments); an ordering barrier hands the tensor cores from one to the other,
//                  so one warpgroup's epilogue hides behind the other's mainloop.
// Each consumer stages its output in a dedicated buffer (the ring keeps streaming meanwhile).
//
// TMAGEMM_CLUSTER_M = 2 (either schedule): CTA pairs of a 2x1 cluster take vertically adjacent
// tiles with the same columns and multicast halves of the shared B tile to each other, halving
// B's L2 -> SM traffic. A stage is then overwritten by the peer's TMA too, so each consumer
// warpgroup that reads it releases it in both CTAs, and a producer only exits once every
// arrival, local or remote, has landed on its barriers. Both CTAs walk the same local tile
// sequence, so in ping-pong the same consumer of each CTA reads a given stage.
//
// TMAGEMM_GROUPED = 1 (cooperative, or ping-pong on single CTAs): one launch over the tiles of
// every expert of a grouped GEMM (tmagemm.grouped, docs/grouped.md). The group sizes stay on the
// device: after the grid dependency wait one warp turns them into a table of rows per group in
// shared memory, and each thread maps its tile ids to (group, tile) with cursors that only move
// forward. Groups of at least params.heavy_group_rows rows (compute-bound: their weight is reused
// from L2 by several rows of tiles) and the shorter ones (weight-streaming) are two tile
// sequences, each in group order, merged in proportion to their lengths: at any time some CTAs
// keep the tensor cores busy while others stream weights, where group order ran one kind after
// the other. The light groups' weights load with an L2 evict-first policy, so that they do not
// push out the operands the heavy tiles reuse (single CTAs: 2x1 clusters keep the group order).
// A tile that starts inside group g may run past the group's last row: those rows (the next
// group's, or padding) only feed output rows that are never stored, since the epilogue clips
// each 64-row fragment's stores at the group's end.
//
// TMAGEMM_TAIL_SPLIT = S >= 2 (cooperative only): when the tiles leave a last wave on at most half
// of the clusters, those last tiles are cut along K into up to S slices, and the clusters that
// would idle run the later slices (stream-K over the tail wave only; the whole tiles before it
// keep their order and L2 reuse). A slice's consumers hand their fp32 fragments to the tile's
// first slice through global scratch and a counter; the first slice adds them in slice order and
// runs the epilogue. Every cluster takes at most one slice, after its whole tiles, so every slice
// a first slice waits for runs on a resident CTA (the grid never exceeds what fits at once).
#include "tmagemm/gemm_sm90.cuh"

#if !defined(TMAGEMM_PINGPONG) || !defined(TMAGEMM_CLUSTER_M) || !defined(TMAGEMM_EPI_PASSES) || \
    !defined(TMAGEMM_EPI_BUFFERS) || !defined(TMAGEMM_PROMOTE) || !defined(TMAGEMM_BLOCK_SCALED) || \
    !defined(TMAGEMM_GROUPED) || !defined(TMAGEMM_TAIL_SPLIT)
#error "gemm_sm90_persistent.cu needs TMAGEMM_PINGPONG (0 cooperative, 1 ping-pong), TMAGEMM_CLUSTER_M (1, 2), TMAGEMM_EPI_PASSES, TMAGEMM_EPI_BUFFERS, TMAGEMM_PROMOTE (0, 1, 2), TMAGEMM_BLOCK_SCALED (0, 1), TMAGEMM_GROUPED (0, 1), TMAGEMM_TAIL_SPLIT (0, 2-8)"
#endif

using namespace tmagemm;
using namespace tmagemm::gemm;

namespace {
constexpr bool kPingPong = TMAGEMM_PINGPONG != 0;
constexpr int kCluster = TMAGEMM_CLUSTER_M;
static_assert(kCluster == 1 || kCluster == 2, "1 or 2 CTAs per cluster");
constexpr int kFrags = kPingPong ? 2 : 1;  // 64-row fragments per consumer
static_assert(kFrags * kAccRegs <= 128, "a consumer holds at most 128 fp32 accumulators per thread");
// TMAGEMM_PROMOTE = 1 (fp8, use_fast_accum=False): wgmma's fp8 accumulator keeps fewer mantissa
// bits than fp32, so each k-block's 128-deep products are summed by wgmma into a scratch fragment
// (its first instruction overwrites it) and added into the fp32 accumulators once that group has
// retired. The scratch covers 128 columns (64 registers): a 256-wide tile is promoted in two
// halves, 128 accumulators + 64 scratch registers, which still fit the consumer budget. Wider
// tiles (and 2x1 clusters) halve the operand bytes each output needs from L2.
constexpr bool kPromote = TMAGEMM_PROMOTE != 0;
// TMAGEMM_PROMOTE = 2: two scratch fragments, so a consumer's next k-block runs on the tensor
// cores while it adds the last one (64 + 2 x 64 registers: 128-wide tiles only).
constexpr int kPromoteDepth = TMAGEMM_PROMOTE;
static_assert(kPromoteDepth <= 1 || (kPromoteDepth == 2 && kBlockN == 128), "two scratch fragments: BLOCK_N = 128");
constexpr int kPromoteN = 128;  // columns per scratch fragment
constexpr int kPromoteParts = kBlockN / kPromoteN;
constexpr int kPartRegs = kPromoteN / 2;
static_assert(!kPromote || (kAbType == wgmma::kE4M3 && !kPingPong && kBlockN % kPromoteN == 0),
              "promotion: fp8, cooperative schedule, BLOCK_N = 128 or 256");
// TMAGEMM_BLOCK_SCALED = 1 (fp8 with 1x128 activation scales and 128x128 weight scales): the
// promotion step multiplies each k-block's sum by its scales as it adds it, acc += part * sa[row]
// * sb[block]. A k-block is one scale block (128 e4m3 of K) and a scratch fragment's 128 columns
// one weight block, so a thread needs its two rows' sa and one sb per scratch fragment.
//
// The scales arrive with the operands, into the stage's scale slot, in one of two ways
// (Params::block_scale_maps, chosen by the host from the scales' layouts):
// * tensor maps (a's scales contiguous along M, PyTorch's and DeepGEMM's layout; the weight's
//   along K, a checkpoint's): the producer loads the k-block's row scales as one box and each
//   part's run of 4 weight-block scales holding the k-block's as another (16 bytes, TMA's least
//   box, starting 16-byte aligned), completing on the stage's full barrier with the operands;
// * any other layout: warp 1 of the producer warpgroup copies them 4 bytes at a time (cp.async)
//   through the strides, and each lane's copies complete an arrival on the full barrier.
// A consumer reads its scales from shared memory once the stage is full, before it issues the
// k-block's wgmmas. (Read from global memory in the promotion step instead, the scale loads cost
// 16-19% at M = 4096, whether or not they hit L1: the step waited for them before it could issue
// the next wgmmas.)
constexpr bool kBlockScaled = TMAGEMM_BLOCK_SCALED != 0;
static_assert(!kBlockScaled || kPromote, "block scaling rides on the promoting mainloop");
constexpr int kScaleLoaders = kBlockScaled ? 32 : 0;  // the copying lanes: one arrival each per stage
// A stage's scale slot: sa of the CTA tile's rows, then per part a 16-byte run holding the
// part's sb (first from the copying warp, (kt % 4)-th from a box), padded to 128 bytes (a TMA
// box lands 128-byte aligned). cuda/gemm.py's SCALE_SLOT_BYTES mirrors its size.
constexpr int kScaleRun = 4;  // floats of a part's weight-scale box: 16 bytes
constexpr int kScaleFloats = kBlockScaled ? kBlockM + 32 : 0;
static_assert(kScaleRun * kPromoteParts <= 32, "the weight scales' boxes fit their 128 bytes");
constexpr unsigned kScaleBoxBytes = 4 * (kBlockM + kScaleRun * kPromoteParts);  // both boxes of a stage
static_assert(kBlockM % 32 == 0, "each scale-loading lane copies kBlockM / 32 row scales");
// Cooperative: the output fragment is staged in TMAGEMM_EPI_PASSES column slices through
// TMAGEMM_EPI_BUFFERS slice buffers. Staging less than the fragment buys a 4th ring stage for
// 128x256 tiles; two buffers let a slice be written while the previous one is still being stored.
constexpr int kEpiPasses = TMAGEMM_EPI_PASSES;
constexpr int kEpiBuffers = TMAGEMM_EPI_BUFFERS;
static_assert((kEpiPasses == 1 && kEpiBuffers == 1) || !kPingPong, "ping-pong stages whole fragments");
constexpr int kEpiBytesPerConsumer = kFrags * kFragBytes / kEpiPasses * kEpiBuffers;
// Arrivals that free a stage (ConsumerBarriers::release_stage): one per reading consumer
// warpgroup (both in the cooperative schedule, the tile's owner in ping-pong) of every CTA whose
// TMA writes into it; block-scaled, one per warp of those, as each warp reads the stage's scales.
// The producer's wait on `empty` needs no cluster-scope acquire either (that one invalidates L1):
// it only orders its next TMA write after reads that are already complete.
constexpr int kReadersPerCta = kPingPong ? 1 : kConsumerWarpgroups;
constexpr int kStageReaders = kCluster * kReadersPerCta * (kBlockScaled ? 4 : 1);
// Named barriers: 0 is __syncthreads; 1 + i private to consumer i; 3 and 4 order the mainloops
// of consumer 0 -> 1 and 1 -> 0 (ping-pong only).
constexpr int kBarConsumer0 = 1;
constexpr int kBarTurnTo1 = 3;
constexpr int kBarTurnTo0 = 4;

constexpr bool kGrouped = TMAGEMM_GROUPED != 0;
// Grouped on single CTAs: heavy and light groups' tiles merged (build_group_table). 2x1 clusters
// multicast B without a cache policy for the light groups' weights, so they keep the group order.
constexpr bool kTwoKinds = kGrouped && kCluster == 1;
constexpr int kClusterRows = kBlockM * kCluster;  // rows of A per cluster tile

// Tail split: at most kTailSplit slices of at least kTailMinKBlocks k-blocks each (shorter ones
// would spend their time filling and draining the ring). cuda/gemm.py's tail_split mirrors the rule.
constexpr int kTailSplit = TMAGEMM_TAIL_SPLIT;
constexpr int kTailMinKBlocks = 16;
static_assert(kTailSplit == 0 || (kTailSplit >= 2 && kTailSplit <= 8 && !kPingPong),
              "tail split: 2-8 slices, cooperative schedule");

// One launch's schedule: cluster tiles [0, whole) are walked whole with the stride `clusters`;
// the `tail` tiles after them are cut into `split` K slices each. Cluster u < tail * split runs
// slice u / tail of tile whole + u % tail after its whole tiles.
struct TailSchedule {
  int whole, tail, split;
};

__device__ __forceinline__ TailSchedule tail_schedule(int tiles, int clusters, int k_tiles) {
  const int tail = tiles % clusters;
  const int split = tail ? min(min(kTailSplit, clusters / tail), k_tiles / kTailMinKBlocks) : 0;
  return split >= 2 ? TailSchedule{tiles - tail, tail, split} : TailSchedule{tiles, 0, 1};
}

// One item of a cluster's walk: a cluster tile and its k-blocks [k0, k1); `slice` is -1 for a
// whole tile, else the tile's K slice (and `slot` the tile's place in the tail).
struct Work {
  int tile, k0, k1, slot, slice;
};

// Tail split, after a slice's mainloop: a later slice (slice > 0) publishes its consumer's fp32
// fragment and returns false (the tile's first slice stores it); the first slice waits for the
// others, adds them in slice order (the same sum whatever the timing) and returns true.
__device__ __forceinline__ bool tail_reduce(float (&acc)[kAccRegs], const Work& w, int split, int rank, int consumer,
                                            const Params& p, bool leader) {
  constexpr int kFragFloats = 128 * kAccRegs;
  const int t = threadIdx.x % 128;
  const int unit = (w.slot * kCluster + rank) * kConsumerWarpgroups + consumer;
  int* counter = p.tail_counters + unit;
  float* fragments = p.tail_partials + static_cast<i64>(unit) * (split - 1) * kFragFloats;
  const int barrier = kBarConsumer0 + consumer;
  if (w.slice > 0) {
    // Thread-major float4s: each store instruction of the warpgroup writes 2 KB contiguously.
    float* mine = fragments + static_cast<i64>(w.slice - 1) * kFragFloats;
#pragma unroll
    for (int j = 0; j < kAccRegs / 4; ++j)
      ptx::st_global_cg_v4(mine + (j * 128 + t) * 4, acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]);
    ptx::named_barrier_sync(barrier, 128);
    if (leader) ptx::red_add_release_gpu(counter, 1);
    return false;
  }
  if (leader) {
    while (ptx::ld_acquire_gpu(counter) < split - 1) __nanosleep(64);
    *counter = 0;  // re-armed for the next launch: nothing else touches it in this one
  }
  ptx::named_barrier_sync(barrier, 128);
  for (int s = 0; s < split - 1; ++s) {
    const float* other = fragments + static_cast<i64>(s) * kFragFloats;
#pragma unroll
    for (int j = 0; j < kAccRegs / 4; ++j) {
      float x, y, z, v;
      ptx::ld_global_cg_v4(other + (j * 128 + t) * 4, x, y, z, v);
      acc[4 * j] += x;
      acc[4 * j + 1] += y;
      acc[4 * j + 2] += z;
      acc[4 * j + 3] += v;
    }
  }
  return true;
}

// Grouped: whether a group of `rows` rows is heavy (compute-bound: several rows of tiles reuse its
// weight from L2) rather than light (it streams its weight). Without two kinds, every group is.
__device__ __forceinline__ bool heavy_group(int rows, const Params& p) {
  return !kTwoKinds || rows >= p.heavy_group_rows;
}

// Grouped: rows of every group into table[2 + g], the cluster tiles of all groups into table[0]
// and those of the heavy groups into table[1], by one warp.
// Contiguous groups end at the running maximum of offs clamped to [0, M] and start where the
// previous one ended (decreasing offsets give empty groups); masked counts clamp to [0, max_m].
// Each lane takes a run of groups: its own maximum, then a warp scan.
__device__ __forceinline__ void build_group_table(int* table, const Params& p, int tiles_n) {
  const int lane = threadIdx.x % 32;
  const int per_lane = ceil_div(p.groups, 32);
  const int first = min(lane * per_lane, p.groups), last = min(first + per_lane, p.groups);
  const bool contiguous = p.group_layout == 0;
  const int limit = contiguous ? p.m : p.group_rows;
  auto count = [&](int g) { return p.group_counts ? min(max(p.group_counts[g], 0), limit) : limit; };
  int end = 0;  // contiguous: the end of the group before this lane's first
  if (contiguous) {
    int lane_max = 0;
    for (int g = first; g < last; ++g) lane_max = max(lane_max, count(g));
#pragma unroll
    for (int offset = 1; offset < 32; offset *= 2) {
      const int other = __shfl_up_sync(0xffffffff, lane_max, offset);
      if (lane >= offset) lane_max = max(lane_max, other);
    }
    end = __shfl_up_sync(0xffffffff, lane_max, 1);
    if (lane == 0) end = 0;
  }
  int tiles = 0, heavy = 0;
  for (int g = first; g < last; ++g) {
    int rows = count(g);
    if (contiguous) {
      const int group_end = max(end, rows);
      rows = group_end - end;
      end = group_end;
    }
    table[2 + g] = rows;
    const int group_tiles = ceil_div(rows, kClusterRows) * tiles_n;
    tiles += group_tiles;
    if (heavy_group(rows, p)) heavy += group_tiles;
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    tiles += __shfl_xor_sync(0xffffffff, tiles, offset);
    heavy += __shfl_xor_sync(0xffffffff, heavy, offset);
  }
  if (lane == 0) {
    table[0] = tiles;
    table[1] = heavy;
  }
}

// Grouped: tiles of a group of `rows` rows in the kind walked.
__device__ __forceinline__ int kind_tiles(int rows, bool heavy, const Params& p, int tiles_n) {
  return heavy_group(rows, p) == heavy ? ceil_div(rows, kClusterRows) * tiles_n : 0;
}

// Grouped: where a thread is in the walk over one kind's tiles (the indices within a kind only
// increase, so the cursor moves forward over each group once per thread). It and the walk stay
// small: they live through every mainloop, beside the accumulators.
struct GroupCursor {
  int group, first_tile, first_row, rows;  // the group, its first tile index in the kind, first row, rows
};

// floor(v * heavy / tiles): a float estimate corrected by exact 64-bit products (a 64-bit
// division is a long inlined sequence at every call site; the estimate is off by a few at most).
__device__ __forceinline__ int heavy_share(int v, int heavy, int tiles) {
  const i64 x = static_cast<i64>(v) * heavy;
  int q = __float2int_rd(__fdividef(static_cast<float>(v) * static_cast<float>(heavy), static_cast<float>(tiles)));
  while (q > 0 && static_cast<i64>(q) * tiles > x) --q;
  while (static_cast<i64>(q + 1) * tiles <= x) ++q;
  return q;
}

// Grouped: the two kinds' sequences merged. Of tile ids [0, v) the heavy groups' tiles take
// floor(v * heavy / tiles) (table[1] of table[0]): spread evenly, whatever the counts. With one
// kind only (`mixed` false), the group order, and no arithmetic per tile: the consumers' next
// mainloop waits on it.
struct GroupWalk {
  GroupCursor heavy, light;
  bool mixed;
};

__device__ __forceinline__ GroupWalk first_groups(const int* table) {
  return GroupWalk{{0, 0, 0, table[2]}, {0, 0, 0, table[2]}, kTwoKinds && table[1] != 0 && table[1] != table[0]};
}

// Origin of cluster tile `tile` (CTA `rank`'s row of it), its group and the group's row end.
// Within a group, tiles go in the grouped (L2-friendly) order of the dense kernel.
__device__ __forceinline__ TileCoord group_tile_origin(GroupWalk& walk, const int* table, int tile, const Params& p,
                                                       int tiles_n, int rank) {
  const bool mixed = kTwoKinds && walk.mixed;  // constant on clusters: their light cursor is dead code
  const int heavy_before = mixed ? heavy_share(tile, table[1], table[0]) : 0;
  const bool heavy = mixed ? heavy_share(tile + 1, table[1], table[0]) > heavy_before
                           : !kTwoKinds || table[1] != 0;
  GroupCursor c = heavy ? walk.heavy : walk.light;  // a copy: a reference would put the walk in local memory
  const int index = heavy && mixed ? heavy_before : tile - heavy_before;  // the tile's place in its kind
  for (int tiles = kind_tiles(c.rows, heavy, p, tiles_n); index >= c.first_tile + tiles;
       tiles = kind_tiles(c.rows, heavy, p, tiles_n)) {
    c.first_tile += tiles;
    c.first_row += p.group_layout == 0 ? c.rows : p.group_rows;
    c.rows = table[2 + ++c.group];
  }
  if (heavy)
    walk.heavy = c;
  else
    walk.light = c;
  const TileIndex at =
      grouped_tile(index - c.first_tile, ceil_div(c.rows, kClusterRows), tiles_n, p.group_m, p.raster_n);
  return TileCoord{c.first_row + (at.m * kCluster + rank) * kBlockM, at.n * kBlockN, c.group, c.first_row + c.rows};
}

// Grouped: the parameters of one tile's epilogue, pointed at its expert's scales and bias, with
// M the group's row end (the clamp of every row index).
__device__ __forceinline__ Params group_params(const Params& p, const TileCoord& tile) {
  Params q = p;
  q.m = tile.row_end;
  if (p.scale_b) q.scale_b = p.scale_b + tile.group * p.scale_b_group;
  if (p.bias) {
    const int bytes = p.bias_type == wgmma::kOutF32 ? 4 : 2;
    q.bias = static_cast<const unsigned char*>(p.bias) + static_cast<i64>(tile.group) * p.bias_group * bytes;
  }
  return q;
}
}  // namespace

extern "C" __global__ void __launch_bounds__(kWarpSpecializedThreads, 1)
    tmagemm_gemm_sm90_persistent(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                                 const __grid_constant__ CUtensorMap map_d, const __grid_constant__ Params params,
                                 const __grid_constant__ CUtensorMap map_sa, const __grid_constant__ CUtensorMap map_sb) {
  // ---- shared-memory plan: STAGES x [A | B] ring, then one epilogue buffer per consumer ------
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = aligned_smem(smem_raw);
  unsigned char* epi = smem + kStages * kStageBytes;
  // Block-scaled: one scale slot per stage after the epilogue buffers; grouped: 2 + E ints after
  // those (the host sizes the window for both).
  float* scale_slots = reinterpret_cast<float*>(epi + kConsumerWarpgroups * kEpiBytesPerConsumer);
  int* group_table = reinterpret_cast<int*>(scale_slots + kStages * kScaleFloats);
  __shared__ alignas(8) u64 full[kStages];
  __shared__ alignas(8) u64 empty[kStages];

  // ---- scheduler: a static stride over the grouped order of cluster tiles --------------------
  // A cluster tile is kCluster vertically adjacent CTA tiles; CTA `rank` takes row `rank` of it.
  // Both CTAs of a cluster walk the same sequence, so their pipelines stay in step.
  const int rank = kCluster > 1 ? static_cast<int>(ptx::cluster_ctarank()) : 0;
  const int cluster = blockIdx.x / kCluster;
  const int clusters = gridDim.x / kCluster;
  const int tiles_n = ceil_div(params.n, kBlockN);
  const int k_tiles = ceil_div(params.k, kBlockK);
  // Warp-uniform, so the shared-memory descriptors built from it stay in uniform registers.
  const int warpgroup = static_cast<int>(ptx::warp_uniform(threadIdx.x / 128));

  // ---- descriptor prefetch, barrier init + fence + sync ------------------------------------
  // (gemm_sm90.cuh, "Programmatic dependent launch": everything up to the wait may overlap the
  // previous kernel, so it touches no global memory.)
  // Block scales by TMA (map_sa, map_sb; unused otherwise): the full barriers then count the
  // producer's arrival only, else the scale-copying lanes' too.
  const bool scale_maps = kBlockScaled && !kGrouped && params.block_scale_maps;
  if (threadIdx.x == 0) {
    init_pipeline(full, empty, kStageReaders, &map_a, &map_b, &map_d, 1 + (scale_maps ? 0 : kScaleLoaders));
    if (scale_maps) {
      ptx::tma_prefetch_descriptor(&map_sa);
      ptx::tma_prefetch_descriptor(&map_sb);
    }
  }
  if constexpr (kCluster > 1) {
    // The peer's barriers must be initialised before our multicasts and remote arrivals.
    ptx::cluster_arrive();
    ptx::cluster_wait();
  } else {
    __syncthreads();
  }

  // ---- grid dependency: every thread, before the warpgroups part (the producer's idle warps
  // exit right after) and whether or not this CTA has tiles, before the first load of A, the
  // scales, bias or C and the first store. On a cluster the peer's multicasts into our shared
  // memory come after the peer's own wait, and touch nothing the previous kernel writes.
  wait_for_previous_kernel();

  // Tiles of the problem (grouped: known once the group sizes, maybe written by the previous
  // kernel, are read); local tile i < my_whole of this cluster is cluster tile cluster + i *
  // clusters, and with a tail split its last item may be one K slice of a tail tile.
  int tiles;
  if constexpr (kGrouped) {
    if (threadIdx.x < 32) build_group_table(group_table, params, tiles_n);
    __syncthreads();
    tiles = group_table[0];
  } else {
    tiles = ceil_div(params.m, kClusterRows) * tiles_n;
  }
  const TailSchedule sched = kTailSplit ? tail_schedule(tiles, clusters, k_tiles) : TailSchedule{tiles, 0, 1};
  const int my_whole = cluster < sched.whole ? (sched.whole - cluster + clusters - 1) / clusters : 0;
  const int my_tiles = my_whole + (cluster < sched.tail * sched.split ? 1 : 0);
  auto work = [&](int i) {
    if (kTailSplit == 0 || i < my_whole) return Work{cluster + i * clusters, 0, k_tiles, 0, -1};
    const int slot = cluster % sched.tail, slice = cluster / sched.tail;
    return Work{sched.whole + slot, slice * k_tiles / sched.split, (slice + 1) * k_tiles / sched.split, slot, slice};
  };
  GroupWalk walk{};  // grouped: this thread's place in the walk (its tile ids only increase)
  if constexpr (kGrouped) walk = first_groups(group_table);
  auto tile_coord = [&](int tile) {
    if constexpr (kGrouped)
      return group_tile_origin(walk, group_table, tile, params, tiles_n, rank);
    else
      return tile_origin<kCluster>(tile, params, rank);
  };

  if (warpgroup == 0) {
    // ---- producer: every k-block of every tile, in the order the consumers read them ----------
    ptx::warpgroup_reg_dealloc<kProducerRegs>();
    if (threadIdx.x == 0) {
      PipelineState write;
      const u64 stream = kTwoKinds ? ptx::l2_policy_evict_first() : 0;  // load_stage's b_policy
      for (int i = 0; i < my_tiles; ++i) {
        const Work w = work(i);
        const TileCoord tile = tile_coord(w.tile);
        // Grouped: a light group's weight is read by its one or few rows of tiles and then done.
        const u64 b_policy = kTwoKinds && !heavy_group(group_table[2 + tile.group], params) ? stream : 0;
        for (int kt = w.k0; kt < w.k1; ++kt) {
          ptx::mbarrier_wait(&empty[write.index], write.phase ^ 1);
          load_stage<kCluster>(smem + write.index * kStageBytes, &full[write.index], &map_a, &map_b, kt, tile.m0,
                               tile.n0, rank, tile.group * params.b_group_rows, scale_maps ? kScaleBoxBytes : 0,
                               b_policy, kGrouped ? tile.row_end - tile.m0 : kBlockM);
          if (scale_maps) {  // rows past M and blocks past N or K arrive as zeros
            float* slot = scale_slots + write.index * kScaleFloats;
            ptx::tma_load_2d(slot, &map_sa, &full[write.index], tile.m0, kt);
            // a box's inner start must be 16-byte aligned: the run of 4 holding k-block kt
            ptx::tma_load_2d(slot + kBlockM, &map_sb, &full[write.index], kt & ~(kScaleRun - 1), tile.n0 / kPromoteN);
          }
          write.advance();
        }
      }
      let_next_kernel_launch();  // this CTA's last loads are in flight: the next kernel may launch
      if constexpr (kCluster > 1) {
        // Producer tail: wait until every stage was released by both CTAs, i.e. no remote
        // arrival can still target this CTA's barriers, before it may exit.
        for (int s = 0; s < kStages; ++s) {
          ptx::mbarrier_wait(&empty[write.index], write.phase ^ 1);
          write.advance();
        }
      }
    } else if (kBlockScaled && !scale_maps && threadIdx.x / 32 == 1) {
      // ---- scale loader: the same walk; lane l copies rows l, l + 32, ... and lane p < parts
      // part p's weight-block scale (to the first float of the part's run). Rows past the tile's
      // last (past M or the group's end) take that row's scales: finite, and their outputs are
      // never stored.
      const int lane = threadIdx.x % 32;
      const int last_block = ceil_div(params.n, kPromoteN) - 1;
      PipelineState write;
      for (int i = 0; i < my_tiles; ++i) {
        const Work w = work(i);
        const TileCoord tile = tile_coord(w.tile);
        const int row_end = kGrouped ? tile.row_end : params.m;
        const float* sa[kBlockM / 32];
#pragma unroll
        for (int j = 0; j < kBlockM / 32; ++j)
          sa[j] = params.block_scale_a + (kGrouped ? tile.group * params.block_scale_a_group : 0) +
                  min(tile.m0 + lane + 32 * j, row_end - 1) * params.block_scale_a_m + w.k0 * params.block_scale_a_k;
        const float* sb = params.block_scale_b + (kGrouped ? tile.group * params.block_scale_b_group : 0) +
                          min(tile.n0 / kPromoteN + min(lane, kPromoteParts - 1), last_block) * params.block_scale_b_n +
                          w.k0 * params.block_scale_b_k;
        for (int kt = w.k0; kt < w.k1; ++kt) {
          ptx::mbarrier_wait(&empty[write.index], write.phase ^ 1);
          float* slot = scale_slots + write.index * kScaleFloats;
#pragma unroll
          for (int j = 0; j < kBlockM / 32; ++j) {
            ptx::cp_async_4(slot + lane + 32 * j, sa[j]);
            sa[j] += params.block_scale_a_k;
          }
          if (lane < kPromoteParts) ptx::cp_async_4(slot + kBlockM + kScaleRun * lane, sb);
          sb += params.block_scale_b_k;
          ptx::cp_async_mbarrier_arrive_noinc(&full[write.index]);
          write.advance();
        }
      }
      ptx::cp_async_wait_all();
    }
    return;
  }

  // ---- consumers -------------------------------------------------------------------------------
  ptx::warpgroup_reg_alloc<kConsumerRegs>();
  const int consumer = warpgroup - 1;
  const bool leader = threadIdx.x % 128 == 0;
  unsigned char* my_epi = epi + consumer * kEpiBytesPerConsumer;
  // What the epilogue does to every tile (grouped: decided per tile, whose expert's scales differ).
  const EpilogueOp op = kGrouped ? EpilogueOp{} : epilogue_op(params);
  float acc[kFrags][kAccRegs];
  const StageDescs descs(smem, kPingPong ? 0 : consumer * 64 * kRowBytes);
  const ConsumerBarriers<kCluster, kBlockScaled> bars(full, empty);

  // Block-scaled: where this thread's first row scale sits in a scale slot, and which float of a
  // part's run holds a k-block's weight scale (computed once: the mainloop only adds the stage's).
  const float* my_scale_rows = scale_slots + 64 * consumer + (threadIdx.x % 128 / 32) * 16 + (threadIdx.x % 32) / 4;
  const int sb_in_run = scale_maps ? kScaleRun - 1 : 0;

  PipelineState read;
  // Ping-pong: consumer 1 starts at the second tile's first k-block; both skip the other's tiles.
  const int first = kPingPong ? consumer : 0;
  const int step = kPingPong ? kConsumerWarpgroups : 1;
  if (kPingPong && consumer == 1)
    for (int kt = 0; kt < k_tiles; ++kt) read.advance();

  for (int i = first; i < my_tiles; i += step) {
    const Work w = work(i);
    const TileCoord tile = tile_coord(w.tile);
    const int k_blocks = w.k1 - w.k0;  // k_tiles but in a tail slice
#pragma unroll
    for (int f = 0; f < kFrags; ++f)
#pragma unroll
      for (int r = 0; r < kAccRegs; ++r) acc[f][r] = 0.0f;

    // Ping-pong: wait for the other consumer to finish issuing its mainloop. Besides taking
    // turns on the tensor cores, this keeps each full-barrier wait at most one phase ahead of
    // the barrier, which parity waits require.
    if (kPingPong && i > 0) ptx::named_barrier_sync(consumer == 0 ? kBarTurnTo0 : kBarTurnTo1, 256);

    float part[kPartRegs];  // promotion scratch: one k-block's wgmma sum over 128 columns (kPromote only)
    // Block scales of k-block kt (in stage `stage`) from its scale slot, read once the stage is
    // full and before it is released: this thread's rows' sa (row, row + 8), then sb per part
    // (the first float of the part's run from the copying warp, the (kt % 4)-th of a TMA box).
    using Scales = float[2 + kPromoteParts];
    auto read_scales = [&](int stage, int kt, Scales& raw) {
      if constexpr (kBlockScaled) {
        const int slot = stage * kScaleFloats;
        raw[0] = my_scale_rows[slot];
        raw[1] = my_scale_rows[slot + 8];
#pragma unroll
        for (int p = 0; p < kPromoteParts; ++p) raw[2 + p] = scale_slots[slot + kBlockM + kScaleRun * p + (kt & sb_in_run)];
      }
    };
    // sa[row + 8h] * sb[block of part p], multiplied where used.
    auto scale_rows = [&](const Scales& raw, float(&s_row)[kPromoteParts][2]) {
      if constexpr (kBlockScaled) {
#pragma unroll
        for (int p = 0; p < kPromoteParts; ++p)
#pragma unroll
          for (int h = 0; h < 2; ++h) s_row[p][h] = raw[h] * raw[2 + p];
      }
    };
    // Adds part p's retired scratch fragment (scaled, with block scales). Register 4j + 2h + e
    // holds row + 8h of the fragment (see epilogue_apply); part p is columns [128p, 128p + 128)
    // of the tile, accumulators [64p, 64p + 64).
    auto add_part = [&](const float(&src)[kPartRegs], int p, const float(&s_row)[kPromoteParts][2]) {
#pragma unroll
      for (int r = 0; r < kPartRegs; ++r) {
        if constexpr (kBlockScaled)
          acc[0][p * kPartRegs + r] += src[r] * s_row[p][(r >> 1) & 1];
        else
          acc[0][p * kPartRegs + r] += src[r];
      }
    };
    PipelineState release = read;
    if constexpr (kPromoteDepth == 2) {
      // Two scratch fragments: k-block kt + 1's wgmmas are issued before k-block kt's sum is
      // added, so the consumer keeps a batch on the tensor cores while it adds (with one scratch
      // fragment they idle whenever both consumers add at once).
      float part_odd[kPartRegs];
      Scales s_even, s_odd;  // each fragment's k-block scales
      auto issue = [&](float(&dst)[kPartRegs], Scales& raw, int kt) {
        bars.wait_full(read.index, read.phase);
        read_scales(read.index, kt, raw);  // before the wgmmas, as the one-scratch loop below
        wgmma::fence_operand(dst);  // the previous step's adds read it first
        wgmma::fence();
        mma_stage<kPromoteN, true>(dst, descs.a_at(read.index), descs.b_at(read.index));
        wgmma::commit_group();
        read.advance();
      };
      // A k-block's group has retired: free its stage, add its scaled sum.
      auto retire = [&](float(&src)[kPartRegs], const Scales& raw) {
        wgmma::fence_operand(src);
        bars.release_stage(release.index);
        release.advance();
        float s_row[kPromoteParts][2];
        scale_rows(raw, s_row);
        add_part(src, 0, s_row);
      };
      // Two k-blocks per step, both issued before the first is added; every group retires
      // within its step (ptxas serializes the wgmmas when a group stays in flight across the
      // loop's back edge).
      int kt = 0;
      for (; kt + 1 < k_blocks; kt += 2) {
        issue(part, s_even, w.k0 + kt);
        issue(part_odd, s_odd, w.k0 + kt + 1);
        wgmma::wait_group<1>();
        retire(part, s_even);
        wgmma::wait_group<0>();
        retire(part_odd, s_odd);
      }
      if (kt < k_blocks) {  // odd count: the last k-block alone
        issue(part, s_even, w.k0 + kt);
        wgmma::wait_group<0>();
        retire(part, s_even);
      }
    } else {
      for (int kt = 0; kt < k_blocks; ++kt) {
        Scales raw;
        float s_row[kPromoteParts][2];
        bars.wait_full(read.index, read.phase);
        const u64 a = descs.a_at(read.index), b = descs.b_at(read.index);
        if constexpr (kPromote) {
#pragma unroll
          for (int p = 0; p < kPromoteParts; ++p) {
            // The scales are read before the wgmmas are issued: read after them, ptxas put the
            // multiplications waiting on the reads between the k-block's last two wgmmas (2%
            // slower at M = 4096, H100; BENCHMARKS.md).
            if (p == 0) read_scales(read.index, w.k0 + kt, raw);
            wgmma::fence_operand(part);  // the adds of the previous part read it first
            wgmma::fence();
            mma_stage<kPromoteN, true>(part, a, wgmma::desc_advance(b, p * kPromoteN * kRowBytes));
            wgmma::commit_group();
            if (p == 0) scale_rows(raw, s_row);  // while the wgmmas run
            // The adds read the scratch registers, so its group must be complete (wait 0; a deeper
            // wait would make ptxas serialize every wgmma). The other consumer's wgmmas keep the
            // tensor core busy meanwhile.
            wgmma::wait_group<0>();
            wgmma::fence_operand(part);
            // The stage's last reads are done: free it before adding, so the producer refills sooner.
            if (p == kPromoteParts - 1) bars.release_stage(read.index);
            add_part(part, p, s_row);
          }
        } else {
#pragma unroll
          for (int f = 0; f < kFrags; ++f) wgmma::fence_operand(acc[f]);
          wgmma::fence();
#pragma unroll
          for (int f = 0; f < kFrags; ++f) mma_stage<kBlockN>(acc[f], wgmma::desc_advance(a, f * 64 * kRowBytes), b);
          wgmma::commit_group();
          wgmma::wait_group<1>();
#pragma unroll
          for (int f = 0; f < kFrags; ++f) wgmma::fence_operand(acc[f]);
          // One batch stays in flight; the one before it has retired and its stage goes back.
          if (kt > 0) {
            bars.release_stage(release.index);
            release.advance();
          }
        }
        read.advance();
      }
    }
    if constexpr (!kPromote) {
      // Hand the tensor cores over as soon as the last batch is issued (if the other has a tile).
      if (kPingPong && i + 1 < my_tiles) {
        asm volatile("bar.arrive %0, %1;\n" ::"r"(consumer == 0 ? kBarTurnTo1 : kBarTurnTo0), "r"(256) : "memory");
      }
      wgmma::wait_group<0>();
#pragma unroll
      for (int f = 0; f < kFrags; ++f) wgmma::fence_operand(acc[f]);
      if (k_blocks > 0) bars.release_stage(release.index);
      if (kPingPong)
        for (int kt = 0; kt < k_tiles; ++kt) read.advance();
    }

    // A tail slice: the later ones hand their sums to the first, which runs the epilogue.
    if constexpr (kTailSplit != 0) {
      if (w.slice >= 0 && !tail_reduce(acc[0], w, sched.split, rank, consumer, params, leader)) continue;
    }

    // ---- epilogue (overlaps the producer's loads and, in ping-pong, the other's mainloop) ------
    if constexpr (kGrouped) {
      // Fragment by fragment (ping-pong: both of the consumer's tile), each clipped at the group's end.
      const Params tile_params = group_params(params, tile);
#pragma unroll
      for (int f = 0; f < kFrags; ++f)
        epilogue_fragment<kBlockN, kEpiPasses, kEpiBuffers, true>(
            acc[f], my_epi + f * kFragBytes, &map_d, tile.m0 + 64 * (kPingPong ? f : consumer), tile.n0, tile_params,
            epilogue_op(tile_params), kBarConsumer0 + consumer, leader, tile.row_end);
    } else if constexpr (kPingPong) {
#pragma unroll
      for (int f = 0; f < kFrags; ++f) epilogue_apply<kBlockN>(acc[f], tile.m0 + 64 * f, tile.n0, params, op);
      if (leader) ptx::tma_store_wait_group_read<0>();
      ptx::named_barrier_sync(kBarConsumer0 + consumer, 128);
#pragma unroll
      for (int f = 0; f < kFrags; ++f) epilogue_to_smem<kBlockN>(acc[f], ptx::smem_u32(my_epi + f * kFragBytes));
      ptx::fence_proxy_async_shared();
      ptx::named_barrier_sync(kBarConsumer0 + consumer, 128);
      if (leader) {
#pragma unroll
        for (int f = 0; f < kFrags; ++f)
          epilogue_issue_store<kBlockN>(&map_d, my_epi + f * kFragBytes, tile.m0 + 64 * f, tile.n0);
      }
    } else {
      epilogue_fragment<kBlockN, kEpiPasses, kEpiBuffers>(acc[0], my_epi, &map_d, tile.m0 + 64 * consumer, tile.n0, params,
                                                          op, kBarConsumer0 + consumer, leader);
    }
  }
  if (leader) ptx::tma_store_wait_group<0>();
}
