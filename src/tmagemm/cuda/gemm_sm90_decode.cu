// Decode GEMM (M <= 64 tokens) with swap-AB, warp-specialized, over a deep TMA ring
// (tmagemm/cuda/decode.py, docs/small-m.md "The native decode kernel").
//
// out[M, N] = (scale_a * scale_b) * (a[M, K] @ w[N, K]^T) + bias, w the K-major weight (b = w.t()),
// with tensor- or row-wise scales; or with block scales (DeepSeek-V3's recipe: one scale per
// token per 128 k, one per 128 x 128 block of the weight or per weight row per 128 k), where each
// 128-deep k-block's product is scaled and added into fp32 on its own.
// One cluster per 64 weight rows (and per TMAGEMM_DECODE_TOKENS tokens): the weight rows fill
// wgmma's M dimension and the tokens its N slot (n8 to n64). The cluster's TMAGEMM_DECODE_SPLIT
// CTAs take equal shares of K, so a narrow weight (64 row tiles for N = 4096) still keeps more
// SMs streaming; the partial sums never leave the chip: each CTA but the first leaves its
// fragment in its own shared memory and the first adds them over distributed shared memory.
// With no split (1) a CTA streams 64 x K alone. A producer warp keeps TMAGEMM_STAGES k-blocks in
// flight (16 x 9 KB); one consumer warpgroup multiplies.
//
// Quantizing form (TMAGEMM_DECODE_QUANTIZE): the activation arrives in bf16 / fp16 and a second
// warpgroup quantizes each landed k-block of tokens into the e4m3 box wgmma reads, with the 1x128
// quantizer's arithmetic (scales kept in shared memory), ahead of the multiplying warpgroup:
// one launch where quantizer and GEMM took two, the same output bit for bit.
//
// Programmatic dependent launch: everything before the grid dependency wait is set-up (barriers,
// descriptor prefetch), so it overlaps the previous kernel's tail; every load, the weight's
// included (the previous kernel may write it), comes after the wait. fp8 tiles of up to 16
// tokens with epilogue scales let the next kernel launch right after their own wait: its launch
// and set-up then pass under this kernel's whole stream (it launches once every CTA here has
// started, so its CTAs only take room these leave). Other builds signal once their main loop is
// done. Loading the weight (into L2 or the ring) before the wait measured slower in decode stacks
// (docs/small-m.md, "PDL placement").
//
// Compile-time knobs (tmagemm/cuda/decode.py through NVRTC -D flags):
//   TMAGEMM_AB_TYPE   0 f16, 1 bf16, 2 e4m3       TMAGEMM_OUT_TYPE  0 f16, 1 bf16, 2 f32
//   TMAGEMM_DECODE_TOKENS  8, 16, 32 or 64 (wgmma N)      TMAGEMM_STAGES    ring depth
//   TMAGEMM_B_KMAJOR  1: the weight is (N, K) row-major (b = w.t()); 0: (K, N) row-major (16-bit only)
//   TMAGEMM_DECODE_SPLIT  1, 2 or 4: CTAs per cluster along K (launched as cluster (1, 1, split))
//   TMAGEMM_DECODE_SCALES 0: tensor/row-wise (or none); 1: a 1x128, w 128x128; 2: a 1x128, w 1x128
//   TMAGEMM_DECODE_QUANTIZE 0: a is e4m3; 1: a is bf16, 2: fp16, quantized here per 1x128 group
//                         (block scales only; the same values and scales as tmagemm's 1x128 quantizer)
#ifndef TMAGEMM_DECODE_QUANTIZE
#define TMAGEMM_DECODE_QUANTIZE 0
#endif
#include "tmagemm/ptx.cuh"
#include "tmagemm/wgmma.cuh"

#if !defined(TMAGEMM_AB_TYPE) || !defined(TMAGEMM_OUT_TYPE) || !defined(TMAGEMM_DECODE_TOKENS) || \
    !defined(TMAGEMM_STAGES) || !defined(TMAGEMM_B_KMAJOR) || !defined(TMAGEMM_DECODE_SPLIT) ||       \
    !defined(TMAGEMM_DECODE_SCALES)
#error "gemm_sm90_decode.cu needs TMAGEMM_AB_TYPE, TMAGEMM_OUT_TYPE, TMAGEMM_DECODE_TOKENS, TMAGEMM_STAGES, TMAGEMM_B_KMAJOR, TMAGEMM_DECODE_SPLIT, TMAGEMM_DECODE_SCALES"
#endif

using namespace tmagemm;

namespace {
using u32 = unsigned int;
using u64 = unsigned long long;

constexpr int kAbType = TMAGEMM_AB_TYPE;
constexpr int kOutType = TMAGEMM_OUT_TYPE;
constexpr int kTokens = TMAGEMM_DECODE_TOKENS;
constexpr int kStages = TMAGEMM_STAGES;
constexpr int kSplit = TMAGEMM_DECODE_SPLIT;
constexpr int kScales = TMAGEMM_DECODE_SCALES;
constexpr bool kBlockScales = kScales != 0;
constexpr int kQuantize = TMAGEMM_DECODE_QUANTIZE;
constexpr bool kQuantizeA = kQuantize != 0;
constexpr int kScaleChunk = kBlockScales ? 16 : 1;  // k-blocks of scales per shared-memory chunk
constexpr int kScaleRows = kScales == 2 ? 64 : 1;   // weight scale rows per k-block: per row, or one block
// A K-major weight box is 64 weight rows of 128 bytes of K; an N-major one is 64 rows of K (one
// k-block of 16-bit values) of 128 bytes of N, which wgmma reads as a transposed (MN-major) A.
constexpr bool kWeightKMajor = TMAGEMM_B_KMAJOR != 0;
constexpr int kRows = 64;         // weight rows per CTA: wgmma's M
constexpr int kRowBytes = 128;    // one k-block: a 128-byte swizzle row (64 16-bit or 128 e4m3 values)
constexpr int kBlockK = kRowBytes / (kAbType == wgmma::kE4M3 ? 1 : 2);
constexpr int kWeightBytes = kRows * kRowBytes;
constexpr int kTokenBytes = kTokens * kRowBytes;
// Quantizing: a stage's 16-bit tokens (tokens x 128 values, unswizzled) land beside its e4m3 box.
constexpr int kRawBytes = kQuantizeA ? kTokens * kBlockK * 2 : 0;
constexpr int kLoadedTokenBytes = kQuantizeA ? kRawBytes : kTokenBytes;
constexpr int kAccRegs = kTokens / 2;  // a thread's share of the 64 x kTokens fp32 fragment
constexpr int kConsumerThreads = 128;  // one warpgroup multiplies
// Quantizing: a second warpgroup turns each stage's 16-bit tokens into its e4m3 box as it lands,
// running ahead of the multiplying one by up to the ring's depth.
constexpr int kQuantizerThreads = kQuantizeA ? 128 : 0;
constexpr int kProducerThread = kConsumerThreads + kQuantizerThreads;  // then the producer warp
// The epilogue's scales and bias are read right after the PDL wait, so their latency passes under
// the stream (read in the epilogue they added a round trip to memory to the kernel's tail: the
// weight stream evicts them from L2). 8-token tiles read them into the consumers' registers,
// measured the fastest at 1-8 tokens; wider tiles have a loader warp that reads them into shared
// memory (into registers the main loop ran up to 38% slower at 16 tokens, cause not found; by the
// producer warp's idle lanes they held up the producer thread, a lane of the same warp).
constexpr bool kLoaderWarp = kTokens > 8;
constexpr int kLoaderThread = kProducerThread + 32;  // then the loader warp, if any
constexpr int kThreads = kLoaderThread + (kLoaderWarp ? 32 : 0);
// Where the next kernel may launch (see the header): measured per build kind in the decode stacks.
constexpr bool kSignalAtWait = kTokens <= 16 && kAbType == wgmma::kE4M3 && !kBlockScales;
static_assert(kTokens == 8 || kTokens == 16 || kTokens == 32 || kTokens == 64,
              "tokens per tile: 8, 16, 32 or 64 (wgmma n8 ... n64)");
static_assert(kTokenBytes % 1024 == 0, "128B-swizzled boxes start 1 KB aligned");
static_assert(kStages >= 2, "at least two stages");
static_assert(kSplit == 1 || kSplit == 2 || kSplit == 4, "K split: 1, 2 or 4 CTAs per cluster");
static_assert(kWeightKMajor || kAbType != wgmma::kE4M3, "fp8 wgmma reads K-major operands only");
static_assert(!kBlockScales || (kAbType == wgmma::kE4M3 && kBlockK == 128), "block scales: fp8, one scale block per k-block");
static_assert(!kQuantizeA || kBlockScales, "quantizing the activation: block scales only");

// Mirrored by a ctypes.Structure in decode.py: keep the field order and types in step.
struct DecodeParams {
  int m, n, k;
  int scale_a_rowwise;   // 1: scale_a has M entries (else one, or none)
  int scale_b_colwise;   // 1: scale_b has N entries
  int bias_type;         // 0 f16, 1 bf16, 2 f32 (ignored without bias)
  const float* scale_a;  // null, (1,) or (M,)
  const float* scale_b;  // null, (1,) or (N,)
  const void* bias;      // null or (N,)
  void* out;             // (M, N), row stride ldo, columns contiguous
  long long ldo;
  // Block scales (TMAGEMM_DECODE_SCALES != 0), element strides: scale_a (M, KB); scale_b
  // (ceil(N / 128), KB) for 128 x 128 blocks or (N, KB) per weight row.
  long long sa_row, sa_k, sb_row, sb_k;
};

// acc(64 x kTokens) += weight(64 x 32 B of K) * tokens(32 B of K x kTokens): scale-d is a
// predicate, as in wgmma.cuh; the 16-bit forms' transpose bits are A's (set for an N-major
// weight) and B's (the tokens are K-major).
#define TMAGEMM_DECODE_WGMMA(SHAPE, REGS, OPERANDS, TRANSPOSE)                                          \
  "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\nwgmma.mma_async.sync.aligned." SHAPE " {" REGS "}, " OPERANDS \
  ", p, 1, 1" TRANSPOSE ";\n}\n"
#if TMAGEMM_B_KMAJOR
#define TMAGEMM_DECODE_TRANSPOSE ", 0, 0"
#else
#define TMAGEMM_DECODE_TRANSPOSE ", 1, 0"
#endif
#define TMAGEMM_DECODE_F4(d, i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define TMAGEMM_DECODE_F8(d, i) TMAGEMM_DECODE_F4(d, i), TMAGEMM_DECODE_F4(d, i + 4)
#define TMAGEMM_DECODE_F16(d, i) TMAGEMM_DECODE_F8(d, i), TMAGEMM_DECODE_F8(d, i + 8)
#define TMAGEMM_DECODE_F32(d, i) TMAGEMM_DECODE_F16(d, i), TMAGEMM_DECODE_F16(d, i + 16)
// One instruction of wgmma N = tokens for the operand type: REGS the accumulator list, OPERANDS
// the two descriptors' operand numbers, FREGS the accumulators' constraints.
#define TMAGEMM_DECODE_MMA(N, REGS, OPERANDS, FREGS)                                                       \
  if constexpr (kAbType == wgmma::kE4M3) {                                                                 \
    asm volatile(TMAGEMM_DECODE_WGMMA("m64n" #N "k32.f32.e4m3.e4m3", REGS, OPERANDS, "")                   \
                 : FREGS(d, 0) : "l"(desc_w), "l"(desc_x));                                                \
  } else if constexpr (kAbType == wgmma::kBF16) {                                                          \
    asm volatile(TMAGEMM_DECODE_WGMMA("m64n" #N "k16.f32.bf16.bf16", REGS, OPERANDS, TMAGEMM_DECODE_TRANSPOSE) \
                 : FREGS(d, 0) : "l"(desc_w), "l"(desc_x));                                                \
  } else {                                                                                                 \
    asm volatile(TMAGEMM_DECODE_WGMMA("m64n" #N "k16.f32.f16.f16", REGS, OPERANDS, TMAGEMM_DECODE_TRANSPOSE)   \
                 : FREGS(d, 0) : "l"(desc_w), "l"(desc_x));                                                \
  }

__device__ __forceinline__ void mma(float (&d)[kAccRegs], u64 desc_w, u64 desc_x) {
  if constexpr (kTokens == 8) {
    TMAGEMM_DECODE_MMA(8, "%0, %1, %2, %3", "%4, %5", TMAGEMM_DECODE_F4)
  } else if constexpr (kTokens == 16) {
    TMAGEMM_DECODE_MMA(16, "%0, %1, %2, %3, %4, %5, %6, %7", "%8, %9", TMAGEMM_DECODE_F8)
  } else if constexpr (kTokens == 32) {
    TMAGEMM_DECODE_MMA(32,
                       "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15",
                       "%16, %17", TMAGEMM_DECODE_F16)
  } else {
    TMAGEMM_DECODE_MMA(64,
                       "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                       "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31",
                       "%32, %33", TMAGEMM_DECODE_F32)
  }
}
#undef TMAGEMM_DECODE_MMA

// One stage's tokens quantized per 1x128 group as tmagemm's 1x128 quantizer does
// (triton/quantize.py): magnitudes with NaN as +Inf, scale = max(amax / 448 correctly rounded, the
// smallest normal), q = x / scale correctly rounded, clamped to +-448 and rounded to nearest even
// on the e4m3 grid (cvt.rn.satfinite). A group is spread over 128 / kValues lanes, kValues of its
// values each, so a warp takes kValues / 4 tokens at a time: few values per lane keep a lone
// token's latency short (the ring waits on it), more share each lane's two divisions among more
// values when many tokens must be quantized per k-block.
// raw: the stage's 16-bit tokens (rows of 2 kBlockK bytes) and box: its e4m3 box (128B-swizzled
// rows), as shared-window addresses; scales: its token scales; rows: the CTA's real tokens.
// Tokens past them are left as they are: they only feed outputs that are never stored.
template <int kValues>
__device__ __forceinline__ void quantize_stage(u32 raw, u32 box, float* scales, int rows, int lane) {
  constexpr int kLanes = kBlockK / kValues;    // lanes per group
  constexpr int kGroups = 32 / kLanes;         // groups per warp at a time
  constexpr int kRun = kValues < 8 ? kValues : 8;  // values per load: 8 (16 bytes), or a lane's 4 (8 bytes)
  static_assert(kValues == 4 || kValues == 8 || kValues == 16, "4, 8 or 16 values per lane");
  constexpr u32 kInfBits = kQuantize == 2 ? 0x7c00u : 0x7f80u;  // +Inf of the 16-bit activation type
  auto to_float16bit = [](u32 bits) {
    if constexpr (kQuantize == 1) return __uint_as_float(bits << 16);
    float out;
    asm("cvt.f32.f16 %0, %1;\n" : "=f"(out) : "h"(static_cast<unsigned short>(bits)));
    return out;
  };
  const int sub = lane / kLanes, part = lane % kLanes;
  for (int t0 = 0; t0 < rows; t0 += kGroups) {
    // Only real tokens' groups: an all-zero group's scale (the smallest normal) would send its
    // reciprocal down the division's slow path. Their lanes shuffle among themselves only.
    const int groups = min(kGroups, rows - t0);
    if (sub >= groups) break;
    const u32 taking = groups == kGroups ? 0xffffffffu : (1u << (groups * kLanes)) - 1;
    const int t = t0 + sub;
    // Run j of a lane holds values j * kRun * kLanes + part * kRun ...: a group's lanes read
    // contiguous bytes per load (no bank conflict).
    float v[kValues];
    u32 magnitudes = 0;  // per 16-bit half: the largest |x| bits so far (unsigned order = magnitude order)
#pragma unroll
    for (int j = 0; j < kValues / kRun; ++j) {
      const u32 at = raw + t * kBlockK * 2 + (j * kLanes + part) * kRun * 2;
      u32 words[kRun / 2];
      if constexpr (kRun == 8) {
        const uint4 w = ptx::ld_shared_v4(at);
        words[0] = w.x, words[1] = w.y, words[2] = w.z, words[3] = w.w;
      } else {
        const uint2 w = ptx::ld_shared_v2(at);
        words[0] = w.x, words[1] = w.y;
      }
#pragma unroll
      for (int i = 0; i < kRun / 2; ++i) {
        v[j * kRun + 2 * i] = to_float16bit(words[i] & 0xffffu);
        v[j * kRun + 2 * i + 1] = to_float16bit(words[i] >> 16);
        magnitudes = __vmaxu2(magnitudes, words[i] & 0x7fff7fffu);
      }
    }
    // A NaN's magnitude bits lie above Inf's: capped there, NaN counts as +Inf.
    float amax = to_float16bit(min(max(magnitudes & 0xffffu, magnitudes >> 16), kInfBits));
#pragma unroll
    for (int o = kLanes / 2; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(taking, amax, o));
    const float scale = fmaxf(__fdiv_rn(amax, 448.0f), 1.17549435e-38f);
    // x / scale correctly rounded with one division per group: from the correctly rounded
    // reciprocal r, q0 = x r is within an ulp and q0 + r (x - q0 scale), the remainder exact by
    // fma, rounds to the quotient (Markstein). A zero keeps its sign as the division would.
    // Finite quotients need no clamp to +-448: satfinite saturates them there as the clamp
    // would. An infinite scale (a non-finite value in the group) takes the division itself and
    // the clamp (a NaN quotient becomes -448, as the clamp makes it). One branch per group, not
    // one per value.
    float c[kValues];
    if (scale < __int_as_float(0x7f800000)) {
      const float r = __fdiv_rn(1.0f, scale);
#pragma unroll
      for (int i = 0; i < kValues; ++i) {
        const float q0 = v[i] * r;
        c[i] = v[i] == 0.0f ? q0 : fmaf(fmaf(-q0, scale, v[i]), r, q0);
      }
    } else {
#pragma unroll
      for (int i = 0; i < kValues; ++i) c[i] = fminf(fmaxf(__fdiv_rn(v[i], scale), -448.0f), 448.0f);
    }
#pragma unroll
    for (int j = 0; j < kValues / kRun; ++j) {
      u32 packed[kRun / 4];
#pragma unroll
      for (int i = 0; i < kRun / 4; ++i) {
        const float* f = c + j * kRun + 4 * i;
        unsigned short lo, hi;  // cvt packs its first source into the upper byte
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(lo) : "f"(f[1]), "f"(f[0]));
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(hi) : "f"(f[3]), "f"(f[2]));
        packed[i] = static_cast<u32>(lo) | (static_cast<u32>(hi) << 16);
      }
      const u32 to = box + ptx::swizzle_offset<128>(t * kRowBytes + (j * kLanes + part) * kRun);
      if constexpr (kRun == 8) ptx::st_shared_v2(to, make_uint2(packed[0], packed[1]));
      else ptx::st_shared_u32(to, packed[0]);
    }
    if (part == 0) scales[t] = scale;
  }
}
#undef TMAGEMM_DECODE_F32
#undef TMAGEMM_DECODE_F16
#undef TMAGEMM_DECODE_F8
#undef TMAGEMM_DECODE_F4
#undef TMAGEMM_DECODE_TRANSPOSE
#undef TMAGEMM_DECODE_WGMMA
}  // namespace

extern "C" __global__ void __launch_bounds__(kThreads, 1)
    tmagemm_gemm_sm90_decode(const __grid_constant__ CUtensorMap map_w, const __grid_constant__ CUtensorMap map_x,
                             const __grid_constant__ DecodeParams p) {
  // ---- shared memory: STAGES weight boxes (64 x 128 B), then STAGES token boxes, 1 KB aligned,
  // then (quantizing) STAGES boxes of the 16-bit tokens as loaded
  extern __shared__ unsigned char smem_raw[];
  unsigned char* weights =
      reinterpret_cast<unsigned char*>((reinterpret_cast<u64>(smem_raw) + 1023) & ~static_cast<u64>(1023));
  unsigned char* tokens = weights + kStages * kWeightBytes;
  unsigned char* raw = tokens + kStages * kTokenBytes;  // quantizing: the 16-bit tokens as loaded
  __shared__ alignas(8) u64 full[kStages];   // producer arrival + both boxes' bytes
  __shared__ alignas(8) u64 empty[kStages];  // the consumer warpgroup released the stage
  __shared__ alignas(8) u64 quantized[kQuantizeA ? kStages : 1];  // the stage's e4m3 tokens are written
  // A split CTA's fragment, float4 q of thread t at [q * 128 + t]: 16-byte accesses, no conflicts.
  __shared__ alignas(16) float partial[kSplit > 1 ? kAccRegs * kConsumerThreads : 4];
  // Block scales of two chunks of k-blocks (this one and the next): per token, and per weight
  // row (or for the one 128 x 128 block the CTA's 64 rows sit in).
  __shared__ float scale_a_s[kBlockScales ? 2 : 1][kScaleChunk][kTokens];
  __shared__ float scale_b_s[kBlockScales ? 2 : 1][kScaleChunk][kScaleRows];
  // Quantizing: each stage's token scales, computed here.
  __shared__ float scale_x_s[kQuantizeA ? kStages : 1][kTokens];
  // The epilogue's tensor/row/column-wise scales and bias (the loader warp's), and their barrier.
  __shared__ float column_scale[kLoaderWarp ? kRows : 1], column_bias[kLoaderWarp ? kRows : 1];
  __shared__ float token_scale[kLoaderWarp ? kTokens : 1];
  __shared__ alignas(8) u64 epilogue_ready;

  const int n0 = blockIdx.x * kRows;
  const int m0 = blockIdx.y * kTokens;
  // The cluster spans blockIdx.z, so the CTA's rank in it is blockIdx.z: its share of the k-blocks.
  const int rank = kSplit > 1 ? static_cast<int>(blockIdx.z) : 0;
  const int k_all = (p.k + kBlockK - 1) / kBlockK;
  const int kt0 = k_all * rank / kSplit;
  const int k_tiles = k_all * (rank + 1) / kSplit - kt0;

  // Set-up touches no global memory: it may overlap the previous kernel.
  if (threadIdx.x == kProducerThread) {
    ptx::tma_prefetch_descriptor(&map_w);
    ptx::tma_prefetch_descriptor(&map_x);
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      ptx::mbarrier_init(&full[s], 1);
      // Quantizing, every consumer warp frees the stage: the token scales are read by each.
      ptx::mbarrier_init(&empty[s], kQuantizeA ? kConsumerThreads / 32 : 1);
      if constexpr (kQuantizeA) ptx::mbarrier_init(&quantized[s], 1);
    }
    ptx::mbarrier_init(&epilogue_ready, 1);
    ptx::fence_barrier_init();
  }
  __syncthreads();

  if (threadIdx.x >= kProducerThread) {
    // ---- producer: one thread of its warp streams the k-blocks
    if (threadIdx.x == kProducerThread) {
      ptx::griddep_wait();  // the activation, or even the weight, may be the previous kernel's output
      if constexpr (kSignalAtWait) ptx::griddep_launch_dependents();
      // Each weight byte is read once: evict-first keeps the stream from pushing out of L2 what
      // is read again (the activation, read by every CTA, and the next kernels' operands).
      const u64 stream = ptx::l2_policy_evict_first();
      for (int kt = 0; kt < k_tiles; ++kt) {
        const int s = kt % kStages;
        // The (kt / kStages)-th refill of stage s waits for its previous k-block's release (the
        // first pass finds the phase before phase 0 complete).
        ptx::mbarrier_wait(&empty[s], ((kt / kStages) & 1) ^ 1);
        ptx::mbarrier_arrive_expect_tx(&full[s], kWeightBytes + kLoadedTokenBytes);
        const int k = (kt0 + kt) * kBlockK;
        if constexpr (kWeightKMajor) ptx::tma_load_2d_hint(weights + s * kWeightBytes, &map_w, &full[s], k, n0, stream);
        else ptx::tma_load_2d_hint(weights + s * kWeightBytes, &map_w, &full[s], n0, k, stream);
        if constexpr (kQuantizeA) ptx::tma_load_2d(raw + s * kRawBytes, &map_x, &full[s], k, m0);
        else ptx::tma_load_2d(tokens + s * kTokenBytes, &map_x, &full[s], k, m0);
      }
    } else if (kLoaderWarp && threadIdx.x >= kLoaderThread) {
      // ---- loader warp: the epilogue's scales and bias into shared memory (see kLoaderWarp)
      ptx::griddep_wait();  // the scales may be the previous kernel's output
      const int lane = threadIdx.x - kLoaderThread;
      float tensor_scale = 1.0f;  // block scales are applied in the main loop instead
      if (p.scale_a && !p.scale_a_rowwise && !kBlockScales) tensor_scale = p.scale_a[0];
      if (p.scale_b && !p.scale_b_colwise && !kBlockScales) tensor_scale = p.scale_b[0] * tensor_scale;
      for (int r = lane; r < kRows; r += 32) {
        const int col = n0 + r;
        const bool in = col < p.n;
        column_scale[r] = p.scale_b_colwise && in ? tensor_scale * p.scale_b[col] : tensor_scale;
        column_bias[r] = p.bias && in ? wgmma::load_as_float(p.bias, col, p.bias_type) : 0.0f;
      }
      for (int t = lane; t < kTokens; t += 32) {
        const int tok = m0 + t;
        token_scale[t] = p.scale_a_rowwise && tok < p.m ? p.scale_a[tok] : 1.0f;
      }
      __syncwarp();  // every lane's stores come before lane 0's release
      if (lane == 0) ptx::mbarrier_arrive(&epilogue_ready);
    }
    // A split cluster's barriers wait for non-exited threads only: these warps may leave.
    return;
  }

  if constexpr (kQuantizeA) {
    if (threadIdx.x >= kConsumerThreads) {
      // ---- quantizer warpgroup: warp w takes k-blocks w, w + 4, ... (four in flight); per CTA
      // its tokens set how many values of a group each lane takes (measured: 4 for one token, 8
      // for two, 16 from three on).
      const int w = (threadIdx.x - kConsumerThreads) / 32, lane = threadIdx.x % 32;
      const int rows = min(kTokens, p.m - m0);
      for (int kt = w; kt < k_tiles; kt += kQuantizerThreads / 32) {
        const int s = kt % kStages;
        ptx::mbarrier_wait(&full[s], (kt / kStages) & 1);
        const u32 stage = ptx::smem_u32(raw + s * kRawBytes), box = ptx::smem_u32(tokens + s * kTokenBytes);
        if (rows == 1) quantize_stage<4>(stage, box, scale_x_s[s], rows, lane);
        else if (rows == 2) quantize_stage<8>(stage, box, scale_x_s[s], rows, lane);
        else quantize_stage<16>(stage, box, scale_x_s[s], rows, lane);
        ptx::fence_proxy_async_shared();  // the e4m3 box is read by wgmma (the async proxy)
        __syncwarp();
        if (lane == 0) ptx::mbarrier_arrive(&quantized[s]);
      }
      return;
    }
  }

  // ---- consumer warpgroup
  ptx::griddep_wait();  // before the output is written, and so before this CTA can finish
  // Register 4j + 2h + e of a fragment: weight row (output column) 16w + l/4 + 8h, token
  // 8j + 2(l % 4) + e (warp w, lane l).
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // Without a loader warp: this thread's epilogue operands, the loader warp's values for its two
  // columns and two tokens. (Written out in both places: shared as device functions, they changed
  // the loader warp's builds.)
  float my_column_scale[2], my_column_bias[2], my_token_scale[2];
  if constexpr (!kLoaderWarp) {
    float tensor_scale = 1.0f;
    if (p.scale_a && !p.scale_a_rowwise && !kBlockScales) tensor_scale = p.scale_a[0];
    if (p.scale_b && !p.scale_b_colwise && !kBlockScales) tensor_scale = p.scale_b[0] * tensor_scale;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int col = n0 + 16 * warp + lane / 4 + 8 * h, tok = m0 + 2 * (lane % 4) + h;
      const bool in = col < p.n;
      my_column_scale[h] = p.scale_b_colwise && in ? tensor_scale * p.scale_b[col] : tensor_scale;
      my_column_bias[h] = p.bias && in ? wgmma::load_as_float(p.bias, col, p.bias_type) : 0.0f;
      my_token_scale[h] = p.scale_a_rowwise && tok < p.m ? p.scale_a[tok] : 1.0f;
    }
  }
  float acc[kAccRegs];
#pragma unroll
  for (int i = 0; i < kAccRegs; ++i) acc[i] = 0.0f;
  // Each wgmma takes 32 bytes of K: the next 32 bytes of a K-major row (the hardware applies
  // the swizzle to the advanced address), or the next 16 K-rows of an N-major box.
  constexpr u32 kWeightStep = kWeightKMajor ? 32 : 16 * kRowBytes;
  if constexpr (kBlockScales) {
    // Each k-block's product lands in a fresh fragment; once its wgmma retired it is added into
    // acc times its token's and weight row's scales. The scales come through shared memory in
    // chunks of kScaleChunk k-blocks, copied (cp.async) a whole chunk ahead: a load per k-block
    // would put its latency into every step.
    auto load_chunk = [&](int chunk) {  // k-blocks kt0 + chunk * kScaleChunk ... of this CTA's share
      const int buf = chunk & 1;
      constexpr int kAEntries = kQuantizeA ? 0 : kScaleChunk * kTokens;  // quantizing: a's come from the quantizer warpgroup
      for (int i = threadIdx.x; i < kAEntries + kScaleChunk * kScaleRows; i += kConsumerThreads) {
        const bool is_a = i < kAEntries;
        const int r = is_a ? i % kTokens : (i - kAEntries) % kScaleRows;
        const int c = is_a ? i / kTokens : (i - kAEntries) / kScaleRows;
        const int kt = chunk * kScaleChunk + c;
        float* dst = is_a ? &scale_a_s[buf][c][r] : &scale_b_s[buf][c][r];
        const int row = is_a ? m0 + r : (kScales == 1 ? n0 / 128 : n0 + r);  // 64 rows sit in one 128-row block
        if (kt < k_tiles && row < (is_a ? p.m : (kScales == 1 ? (p.n + 127) / 128 : p.n))) {
          const long long at = is_a ? row * p.sa_row + (kt0 + kt) * p.sa_k : row * p.sb_row + (kt0 + kt) * p.sb_k;
          ptx::cp_async_4(dst, (is_a ? p.scale_a : p.scale_b) + at);
        } else {
          *dst = 0.0f;  // rows and tokens past the edge: their TMA-filled operands are 0 too
        }
      }
      ptx::cp_async_commit();
    };
    // Two fragments take turns, so one k-block's wgmma runs while the one before it is scaled.
    float part0[kAccRegs], part1[kAccRegs];
    auto issue = [&](int kt, float(&part)[kAccRegs]) {
      const int s = kt % kStages;
      ptx::mbarrier_wait(&full[s], (kt / kStages) & 1);
      // Quantizing, the weight box is seen landed (full, above) and the quantizer's e4m3 box here.
      if constexpr (kQuantizeA) ptx::mbarrier_wait(&quantized[s], (kt / kStages) & 1);
#pragma unroll
      for (int i = 0; i < kAccRegs; ++i) part[i] = 0.0f;
      const u64 desc_w = wgmma::desc_k_major(ptx::smem_u32(weights + s * kWeightBytes));
      const u64 desc_x = wgmma::desc_k_major(ptx::smem_u32(tokens + s * kTokenBytes));
      wgmma::fence_operand(part);
      wgmma::fence();
#pragma unroll
      for (int kk = 0; kk < kRowBytes / 32; ++kk)
        mma(part, wgmma::desc_advance(desc_w, kk * 32), wgmma::desc_advance(desc_x, kk * 32));
      wgmma::commit_group();
    };
    auto token_scale = [&](int kt, int buf, int c, int token) {
      return kQuantizeA ? scale_x_s[kt % kStages][token] : scale_a_s[buf][c][token];
    };
    // k-block kt's wgmma has retired (the caller waited): scale it into acc, free its stage.
    auto retire = [&](int kt, float(&part)[kAccRegs]) {
      wgmma::fence_operand(part);
      if (kt % kScaleChunk == 0) {
        // This chunk's copies are done and visible, and every consumer is past the previous
        // chunk's last k-block: its buffer takes the next chunk.
        ptx::cp_async_wait_all();
        ptx::named_barrier_sync(1, kConsumerThreads);
        if (kt + kScaleChunk < k_tiles) load_chunk(kt / kScaleChunk + 1);
      }
      const int buf = (kt / kScaleChunk) & 1, c = kt % kScaleChunk;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float sb = scale_b_s[buf][c][kScales == 1 ? 0 : 16 * warp + lane / 4 + 8 * h];
#pragma unroll
        for (int j = 0; j < kTokens / 8; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e)
            acc[4 * j + 2 * h + e] += part[4 * j + 2 * h + e] * (token_scale(kt, buf, c, 8 * j + 2 * (lane % 4) + e) * sb);
      }
      if constexpr (kQuantizeA) {
        __syncwarp();
        if (lane == 0) ptx::mbarrier_arrive(&empty[kt % kStages]);
      } else if (threadIdx.x == 0) {
        ptx::mbarrier_arrive(&empty[kt % kStages]);
      }
    };
    // Even k-blocks go to part0, odd ones to part1 (register arrays cannot be picked at run
    // time); each step issues both, then retires the first while the second runs. Every group
    // retires within its step: one left in flight across the loop's back edge made ptxas
    // serialize every wgmma.
    load_chunk(0);
    int kt = 0;
    for (; kt + 1 < k_tiles; kt += 2) {
      issue(kt, part0);
      issue(kt + 1, part1);
      wgmma::wait_group<1>();
      retire(kt, part0);
      wgmma::wait_group<0>();
      retire(kt + 1, part1);
    }
    if (kt < k_tiles) {  // an odd count: the last k-block alone
      issue(kt, part0);
      wgmma::wait_group<0>();
      retire(kt, part0);
    }
  } else {  // tensor/row-wise: one fp32 accumulation over all of K (fast accumulation)
    for (int kt = 0; kt < k_tiles; ++kt) {
      const int s = kt % kStages;
      ptx::mbarrier_wait(&full[s], (kt / kStages) & 1);
      const u32 w_addr = ptx::smem_u32(weights + s * kWeightBytes);
      const u64 desc_w = kWeightKMajor ? wgmma::desc_k_major(w_addr) : wgmma::desc_mn_major(w_addr);
      const u64 desc_x = wgmma::desc_k_major(ptx::smem_u32(tokens + s * kTokenBytes));
      wgmma::fence_operand(acc);
      wgmma::fence();
#pragma unroll
      for (int kk = 0; kk < kRowBytes / 32; ++kk)
        mma(acc, wgmma::desc_advance(desc_w, kk * kWeightStep), wgmma::desc_advance(desc_x, kk * 32));
      wgmma::commit_group();
      // One batch stays in flight; the one before it has retired and its stage goes back.
      wgmma::wait_group<1>();
      wgmma::fence_operand(acc);
      if (kt > 0 && threadIdx.x == 0) ptx::mbarrier_arrive(&empty[(kt - 1) % kStages]);
    }
    wgmma::wait_group<0>();
    wgmma::fence_operand(acc);
  }
  if constexpr (!kSignalAtWait) ptx::griddep_launch_dependents();  // the stream is done: the next kernel may launch

  // ---- split K: the other CTAs of the cluster publish their fragments (release at cluster
  // scope), the first adds them from their shared memory, and they stay resident until it has.
  if constexpr (kSplit > 1) {
    float4* mine = reinterpret_cast<float4*>(partial) + threadIdx.x;
    if (rank != 0) {
#pragma unroll
      for (int q = 0; q < kAccRegs / 4; ++q)
        mine[q * kConsumerThreads] = make_float4(acc[4 * q], acc[4 * q + 1], acc[4 * q + 2], acc[4 * q + 3]);
    }
    ptx::cluster_arrive();
    ptx::cluster_wait();
    if (rank != 0) {
      ptx::cluster_arrive();  // the first CTA's reads are done when this phase completes
      ptx::cluster_wait();
      return;
    }
#pragma unroll
    for (int r = 1; r < kSplit; ++r) {
      const u32 peer = ptx::mapa_shared(ptx::smem_u32(mine), r);
#pragma unroll
      for (int q = 0; q < kAccRegs / 4; ++q) {
        float v[4];
        ptx::ld_shared_cluster_v4(v, peer + q * kConsumerThreads * 16);
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[4 * q + e] += v[e];
      }
    }
    ptx::cluster_arrive();  // released: the others may exit
  }

  // ---- epilogue: the output is at most 16 x 64 values per CTA: plain stores, each warp writing
  // 16-byte runs of a token's row. Block scales are in acc already.
  if constexpr (kLoaderWarp) ptx::mbarrier_wait(&epilogue_ready, 0);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = 16 * warp + lane / 4 + 8 * h, col = n0 + r;
    if (col >= p.n) continue;
    const float col_scale = kLoaderWarp ? column_scale[r] : my_column_scale[h];
    const float add = kLoaderWarp ? column_bias[r] : my_column_bias[h];
#pragma unroll
    for (int j = 0; j < kTokens / 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int t = 8 * j + 2 * (lane % 4) + e, tok = m0 + t;
        if (tok >= p.m) continue;
        const float v = acc[4 * j + 2 * h + e] * col_scale * (kLoaderWarp ? token_scale[t] : my_token_scale[e]) + add;
        const long long at = tok * p.ldo + col;
        if constexpr (kOutType == wgmma::kOutF32) {
          static_cast<float*>(p.out)[at] = v;
        } else {
          static_cast<unsigned short*>(p.out)[at] = static_cast<unsigned short>(wgmma::pack2<kOutType>(v, 0.0f));
        }
      }
  }
}
