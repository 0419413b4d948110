// Measurement-only CUTLASS 3.x FP8 GEMM peer configs (Hopper, sm_90a).
// D (M,N) bf16 row-major = alpha * A (M,K) e4m3 row-major @ B^T, B given as (N,K) e4m3 row-major
// (= column-major K x N, the "TN" GEMM torch._scaled_mm takes as w.t()). fp32 accumulate, FP8 fast accum,
// no C (ElementC = void, beta = 0). Persistent tile scheduler with runtime swizzle / raster order.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cuda_runtime.h>

#include "cutlass/cutlass.h"
#include "cutlass/numeric_types.h"
#include "cute/tensor.hpp"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/tile_scheduler_params.h"
#include "cutlass/util/packed_stride.hpp"

namespace peer {

using namespace cute;

// Return codes (0 = success; nothing is launched for 1..4).
enum : int {
  kOk = 0,
  kErrArgs = 1,           // bad swizzle / raster / pointers
  kErrCanImplement = 2,   // Gemm::can_implement rejected the problem
  kErrWorkspace = 3,      // workspace too small / null
  kErrInitialize = 4,     // Gemm::initialize failed
  kErrRun = 5,            // launch failed (Gemm::run status or cudaGetLastError)
  kErrDevice = 6,         // cudaGetDevice / SM count query failed
};

inline int sm_count_cached(int* device_out) {
  static int cache[64] = {0};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) { cudaGetLastError(); return -1; }
  *device_out = dev;
  if (cache[dev] == 0) {
    int sms = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) { cudaGetLastError(); return -1; }
    cache[dev] = sms;
  }
  return cache[dev];
}

template <class KernelSchedule, class EpilogueSchedule, class TileShape, class ClusterShape>
struct Fp8Gemm {
  using ElementA = cutlass::float_e4m3_t;
  using LayoutA = cutlass::layout::RowMajor;
  static constexpr int AlignmentA = 16;
  using ElementB = cutlass::float_e4m3_t;
  using LayoutB = cutlass::layout::ColumnMajor;
  static constexpr int AlignmentB = 16;
  using ElementC = void;
  using LayoutC = cutlass::layout::RowMajor;
  static constexpr int AlignmentC = 8;
  using ElementD = cutlass::bfloat16_t;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int AlignmentD = 8;
  using ElementAccumulator = float;
  using ElementCompute = float;
  using ArchTag = cutlass::arch::Sm90;
  using OperatorClass = cutlass::arch::OpClassTensorOp;

  using FusionOp = cutlass::epilogue::fusion::LinearCombination<ElementD, ElementCompute, ElementC, ElementCompute>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      ArchTag, OperatorClass, TileShape, ClusterShape, cutlass::epilogue::collective::EpilogueTileAuto,
      ElementAccumulator, ElementCompute, ElementC, LayoutC, AlignmentC, ElementD, LayoutD, AlignmentD,
      EpilogueSchedule, FusionOp>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      ArchTag, OperatorClass, ElementA, LayoutA, AlignmentA, ElementB, LayoutB, AlignmentB, ElementAccumulator,
      TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;

  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop,
                                                          CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
  using StrideA = typename GemmKernel::StrideA;
  using StrideB = typename GemmKernel::StrideB;
  using StrideC = typename GemmKernel::StrideC;
  using StrideD = typename GemmKernel::StrideD;
  using RasterOrderOptions = cutlass::gemm::kernel::detail::RasterOrderOptions;

  static bool make_args(typename Gemm::Arguments& args, const void* a, const void* b, void* d, int m, int n, int k,
                        float alpha, int swizzle, int raster) {
    if (!(swizzle == 1 || swizzle == 2 || swizzle == 4 || swizzle == 8)) return false;
    if (raster < 0 || raster > 2) return false;
    if (m <= 0 || n <= 0 || k <= 0) return false;
    int dev = 0;
    int sms = sm_count_cached(&dev);
    if (sms <= 0) return false;
    cutlass::KernelHardwareInfo hw;
    hw.device_id = dev;
    hw.sm_count = sms;

    StrideA sA = cutlass::make_cute_packed_stride(StrideA{}, cute::make_shape(m, k, 1));
    StrideB sB = cutlass::make_cute_packed_stride(StrideB{}, cute::make_shape(n, k, 1));
    StrideC sC = cutlass::make_cute_packed_stride(StrideC{}, cute::make_shape(m, n, 1));
    StrideD sD = cutlass::make_cute_packed_stride(StrideD{}, cute::make_shape(m, n, 1));

    args = typename Gemm::Arguments{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {m, n, k, 1},
        {static_cast<const ElementA*>(a), sA, static_cast<const ElementB*>(b), sB},
        {{}, nullptr, sC, static_cast<ElementD*>(d), sD},
        hw};
    args.epilogue.thread.alpha = alpha;
    args.epilogue.thread.beta = 0.0f;
    args.scheduler.max_swizzle_size = swizzle;
    args.scheduler.raster_order = static_cast<RasterOrderOptions>(raster);
    return true;
  }

  static size_t workspace(int m, int n, int k, int swizzle, int raster) {
    typename Gemm::Arguments args;
    // Pointers are irrelevant for the size; use a non-null dummy so nothing dereferences null.
    static char dummy[16];
    if (!make_args(args, dummy, dummy, dummy, m, n, k, 1.0f, swizzle, raster)) return 0;
    return Gemm::get_workspace_size(args);
  }

  static int run(const void* a, const void* b, void* d, int m, int n, int k, float alpha, int swizzle, int raster,
                 void* ws, size_t ws_bytes, cudaStream_t stream) {
    if (!a || !b || !d) return kErrArgs;
    typename Gemm::Arguments args;
    int dev = 0;
    if (sm_count_cached(&dev) <= 0) return kErrDevice;
    if (!make_args(args, a, b, d, m, n, k, alpha, swizzle, raster)) return kErrArgs;
    if (Gemm::can_implement(args) != cutlass::Status::kSuccess) return kErrCanImplement;
    size_t need = Gemm::get_workspace_size(args);
    if (need > ws_bytes || (need > 0 && ws == nullptr)) return kErrWorkspace;
    Gemm gemm;
    if (gemm.initialize(args, need > 0 ? ws : nullptr, stream) != cutlass::Status::kSuccess) return kErrInitialize;
    cutlass::Status st = gemm.run(stream);
    if (st != cutlass::Status::kSuccess) return kErrRun;
    if (cudaGetLastError() != cudaSuccess) return kErrRun;
    return kOk;
  }
};

}  // namespace peer

// One config per translation unit: NAME, kernel schedule, epilogue schedule, tile M N K, cluster M N.
#define PEER_FP8_CONFIG(NAME, KSCHED, ESCHED, TM, TN, TK, CM, CN)                                            \
  namespace {                                                                                               \
  using Cfg_##NAME = peer::Fp8Gemm<cutlass::gemm::KSCHED, cutlass::epilogue::ESCHED,                        \
                                   cute::Shape<cute::_##TM, cute::_##TN, cute::_##TK>,                      \
                                   cute::Shape<cute::_##CM, cute::_##CN, cute::_1>>;                        \
  }                                                                                                         \
  extern "C" __attribute__((visibility("default"))) int cutlass_fp8_##NAME(                                 \
      const void* a, const void* b, void* d, int m, int n, int k, float alpha, int swizzle, int raster,      \
      void* workspace, size_t workspace_bytes, cudaStream_t stream) {                                       \
    return Cfg_##NAME::run(a, b, d, m, n, k, alpha, swizzle, raster, workspace, workspace_bytes, stream);    \
  }                                                                                                         \
  extern "C" __attribute__((visibility("default"))) size_t cutlass_fp8_##NAME##_workspace(                 \
      int m, int n, int k, int swizzle, int raster) {                                                       \
    return Cfg_##NAME::workspace(m, n, k, swizzle, raster);                                                 \
  }
