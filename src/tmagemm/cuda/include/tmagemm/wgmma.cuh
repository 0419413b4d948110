// Hopper warpgroup MMA (wgmma) helpers: shared-memory matrix descriptors, the mma_async
// wrappers the GEMMs use, accumulator fences, stmatrix and 16-bit packing.
//
// Everything here is specific to sm_90a warpgroup math; generic PTX (mbarrier, TMA, fences,
// elect, setmaxnreg) lives in ptx.cuh. Compiled by NVRTC, so no standard headers.
#pragma once

namespace tmagemm {
namespace wgmma {

using u32 = unsigned int;
using u64 = unsigned long long;

// Element types, numbered as the host passes them in TMAGEMM_AB_TYPE and TMAGEMM_OUT_TYPE.
enum : int { kF16 = 0, kBF16 = 1, kE4M3 = 2 };      // operands
enum : int { kOutF16 = 0, kOutBF16 = 1, kOutF32 = 2 };  // output (and C for beta)

// ---------------------------------------------------------------------------------------------
// Shared-memory matrix descriptors (PTX ISA "Matrix Descriptor Format").
//
// Every operand tile in these kernels is stored the way TMA writes a box with 128-byte swizzle:
// rows of 128 bytes, 8-row atoms of 1 KB, the 16-byte chunk index XORed with (row % 8). The
// descriptor encodes start address, leading byte offset (LBO) and stride byte offset (SBO), all
// in 16-byte units, and layout type 1 = SWIZZLE_128B in bits 62-63. Atoms are 1 KB aligned, so
// the base-offset field stays 0.
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ u64 make_desc_sw128(u32 smem_addr, u32 lbo_bytes, u32 sbo_bytes) {
  u64 desc = 0;
  desc |= static_cast<u64>((smem_addr & 0x3FFFF) >> 4);
  desc |= static_cast<u64>((lbo_bytes >> 4) & 0x3FFF) << 16;
  desc |= static_cast<u64>((sbo_bytes >> 4) & 0x3FFF) << 32;
  desc |= static_cast<u64>(1) << 62;
  return desc;
}

// K-major operand (A always; B when it is a K-major weight; both operands for FP8): 8-row
// groups sit 1 KB apart (SBO); the K extent of one instruction (32 bytes) never leaves the
// 128-byte swizzle span, so LBO is unused and set to 1 as the ISA recommends.
__device__ __forceinline__ u64 desc_k_major(u32 smem_addr) {
  return make_desc_sw128(smem_addr, 16, 1024);
}

// MN-major B (row-major (K, N) in global memory): TMA boxes of 64 N-columns (128 bytes) x
// 64 K-rows, placed 8 KB apart. SBO steps 8 K-rows (1 KB) inside a box, LBO steps to the next
// 64-column box; an n128/n256 instruction spans 2/4 boxes.
__device__ __forceinline__ u64 desc_mn_major(u32 smem_addr) {
  return make_desc_sw128(smem_addr, 8192, 1024);
}

// Moving a descriptor by a byte offset that stays inside shared memory only touches the
// 14-bit start-address field (smem < 256 KB, so no carry leaves it).
__device__ __forceinline__ u64 desc_advance(u64 desc, u32 bytes) {
  return desc + static_cast<u64>(bytes >> 4);
}

// ---------------------------------------------------------------------------------------------
// Ordering of wgmma against ordinary register and shared-memory traffic.
// ---------------------------------------------------------------------------------------------

// Must precede the first wgmma of a batch: makes prior register writes to the accumulators
// (zero-fill, the previous tile's epilogue) visible to the async tensor core.
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }

__device__ __forceinline__ void commit_group() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// Wait until at most kPending committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void wait_group() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// The accumulators are written asynchronously behind the compiler's back: this empty asm
// pins every register so no read or write of them moves across a wgmma fence/wait.
template <int kRegs>
__device__ __forceinline__ void fence_operand(float (&acc)[kRegs]) {
#pragma unroll
  for (int i = 0; i < kRegs; ++i) asm volatile("" : "+f"(acc[i])::"memory");
}

// ---------------------------------------------------------------------------------------------
// mma_async wrappers: D(64 x N, fp32, registers) += A(64 x K, smem) * B(K x N, smem).
// Mma<N, type>::run(acc, desc_a, desc_b): 16-bit types take K = 16 per instruction and transpose
// bits for B and A (1 = the operand is MN-major: A for the weight gradient's x.t()); e4m3 takes
// K = 32 and K-major operands only.
// ---------------------------------------------------------------------------------------------
#define TMAGEMM_WGMMA_D64 \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define TMAGEMM_WGMMA_D128 \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
    "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
    "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
    "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"

#define TMAGEMM_F8(d, i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), \
    "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define TMAGEMM_F32(d, i) TMAGEMM_F8(d, i), TMAGEMM_F8(d, i + 8), TMAGEMM_F8(d, i + 16), TMAGEMM_F8(d, i + 24)
#define TMAGEMM_F64(d, i) TMAGEMM_F32(d, i), TMAGEMM_F32(d, i + 32)
#define TMAGEMM_F128(d, i) TMAGEMM_F64(d, i), TMAGEMM_F64(d, i + 64)

template <int kN, int kType>
struct Mma;

// scale-d is a predicate from `accumulate`: 1 (the default) adds to D, which the fast path
// zero-fills before the first k-block (so K = 0 still yields zeros); 0 overwrites D with A*B,
// which the promoting mainloop uses to start each k-block's scratch sum.
#define TMAGEMM_DEFINE_MMA_16BIT(N, NREG, TYPE_ID, PTX_TYPE, DA, DB, SD, TB, TA)                     \
  template <>                                                                                       \
  struct Mma<N, TYPE_ID> {                                                                          \
    static constexpr int kRegs = NREG;                                                              \
    template <int kTransB, int kTransA = 0>                                                         \
    __device__ __forceinline__ static void run(float (&d)[NREG], u64 desc_a, u64 desc_b,          \
                                               int accumulate = 1) {                                \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SD ", 0;\n"                                  \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX_TYPE "." PTX_TYPE " {"     \
                   TMAGEMM_WGMMA_D##NREG "}, " DA ", " DB ", p, 1, 1, " TA ", " TB ";\n}\n"         \
                   : TMAGEMM_F##NREG(d, 0)                                                          \
                   : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(kTransB), "n"(kTransA));        \
    }                                                                                               \
  };

#define TMAGEMM_DEFINE_MMA_FP8(N, NREG, DA, DB, SD)                                                 \
  template <>                                                                                       \
  struct Mma<N, kE4M3> {                                                                            \
    static constexpr int kRegs = NREG;                                                              \
    template <int kTransB>                                                                          \
    __device__ __forceinline__ static void run(float (&d)[NREG], u64 desc_a, u64 desc_b,          \
                                               int accumulate = 1) {                                \
      static_assert(kTransB == 0, "FP8 wgmma reads K-major B only");                               \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SD ", 0;\n"                                  \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k32.f32.e4m3.e4m3 {"                     \
                   TMAGEMM_WGMMA_D##NREG "}, " DA ", " DB ", p, 1, 1;\n}\n"                         \
                   : TMAGEMM_F##NREG(d, 0)                                                          \
                   : "l"(desc_a), "l"(desc_b), "r"(accumulate));                                    \
    }                                                                                               \
  };

TMAGEMM_DEFINE_MMA_16BIT(128, 64, kF16, "f16", "%64", "%65", "%66", "%67", "%68")
TMAGEMM_DEFINE_MMA_16BIT(128, 64, kBF16, "bf16", "%64", "%65", "%66", "%67", "%68")
TMAGEMM_DEFINE_MMA_16BIT(256, 128, kF16, "f16", "%128", "%129", "%130", "%131", "%132")
TMAGEMM_DEFINE_MMA_16BIT(256, 128, kBF16, "bf16", "%128", "%129", "%130", "%131", "%132")
TMAGEMM_DEFINE_MMA_FP8(128, 64, "%64", "%65", "%66")
TMAGEMM_DEFINE_MMA_FP8(256, 128, "%128", "%129", "%130")

#undef TMAGEMM_DEFINE_MMA_16BIT
#undef TMAGEMM_DEFINE_MMA_FP8
#undef TMAGEMM_F128
#undef TMAGEMM_F64
#undef TMAGEMM_F32
#undef TMAGEMM_F8
#undef TMAGEMM_WGMMA_D128
#undef TMAGEMM_WGMMA_D64

// ---------------------------------------------------------------------------------------------
// Epilogue helpers: reading an output-typed value as fp32, packing fp32 pairs to 16-bit, stmatrix.
// ---------------------------------------------------------------------------------------------

// Element ``index`` of an array of output type ``type`` (kOutF16/kOutBF16/kOutF32), as fp32: a
// bias or C read in the epilogue.
__device__ __forceinline__ float load_as_float(const void* ptr, long long index, int type) {
  if (type == kOutF32) return static_cast<const float*>(ptr)[index];
  const unsigned short bits = static_cast<const unsigned short*>(ptr)[index];
  if (type == kOutBF16) return __uint_as_float(static_cast<u32>(bits) << 16);
  float out;
  asm("cvt.f32.f16 %0, %1;\n" : "=f"(out) : "h"(bits));
  return out;
}

// cvt packs its first source into the upper half: pass (hi, lo) so lo lands at the lower address.
template <int kOutType>
__device__ __forceinline__ u32 pack2(float lo, float hi) {
  u32 out;
  if constexpr (kOutType == kOutBF16) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(out) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(out) : "f"(hi), "f"(lo));
  }
  return out;
}

// Four 8x8 b16 matrices from the warp's registers to shared memory: lane l gives the address
// of row (l % 8) of matrix (l / 8); register i of every lane holds its row-pair of matrix i,
// which is exactly the wgmma accumulator layout after pack2.
__device__ __forceinline__ void stmatrix_x4(u32 smem_addr, u32 r0, u32 r1, u32 r2, u32 r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_addr),
               "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

}  // namespace wgmma
}  // namespace tmagemm
