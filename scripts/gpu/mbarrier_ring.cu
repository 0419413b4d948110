// The smallest mbarrier ring, to show what compute-sanitizer's racecheck makes of one (see
// docs/native-gemm.md, "racecheck and mbarrier rings"). Warp 0 fills a two-slot ring, warp 1
// reads each slot after its full barrier and frees it on its empty barrier; warp 0 waits on that
// before refilling. The PTX memory model orders every access (the arrivals release, the parity
// waits acquire), so any hazard racecheck reports here is one it cannot see through the barriers.
//
//   nvcc -arch=sm_90a -lineinfo -o /tmp/ring scripts/gpu/mbarrier_ring.cu
//   /tmp/ring && compute-sanitizer --tool racecheck /tmp/ring
#include <cstdint>
#include <cstdio>

__device__ __forceinline__ unsigned smem(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void arrive(uint64_t* bar) {
  asm volatile("{.reg .b64 s; mbarrier.arrive.shared::cta.b64 s, [%0];}" ::"r"(smem(bar)) : "memory");
}

__device__ __forceinline__ void wait(uint64_t* bar, unsigned phase) {
  asm volatile(
      "{.reg .pred p; WAIT: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1; @!p bra WAIT;}" ::"r"(smem(bar)),
      "r"(phase)
      : "memory");
}

// kCpAsync: the writer fills a slot with 4-byte cp.async (completion arrives on the full
// barrier), as the block-scaled GEMM's scale loader does; else with st.shared and an arrival.
template <bool kCpAsync>
__global__ void ring(const float* src, float* out, int rounds) {
  __shared__ float slot[2][32];
  __shared__ alignas(8) uint64_t full[2], empty[2];
  if (threadIdx.x == 0) {
    for (int s = 0; s < 2; ++s) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem(&full[s])), "r"(32));
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem(&empty[s])), "r"(1));
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int lane = threadIdx.x % 32;
  float sum = 0.0f;
  for (int r = 0; r < rounds; ++r) {
    const int s = r % 2;
    const unsigned phase = (r / 2) % 2;
    if (threadIdx.x < 32) {
      wait(&empty[s], phase ^ 1);
      if constexpr (kCpAsync) {
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(smem(&slot[s][lane])), "l"(src + r * 32 + lane)
                     : "memory");
        asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem(&full[s])) : "memory");
      } else {
        slot[s][lane] = src[r * 32 + lane];
        arrive(&full[s]);
      }
    } else {
      wait(&full[s], phase);
      sum += slot[s][lane];
      __syncwarp();  // every lane's read before lane 0 frees the slot
      if (lane == 0) arrive(&empty[s]);
    }
  }
  if (threadIdx.x >= 32) out[lane] = sum;
}

int main() {
  constexpr int kRounds = 8;
  float host[kRounds * 32], expect[32] = {};
  for (int i = 0; i < kRounds * 32; ++i) {
    host[i] = static_cast<float>(i % 7);
    expect[i % 32] += host[i];
  }
  float *src, *out;
  cudaMalloc(&src, sizeof host);
  cudaMalloc(&out, sizeof expect);
  cudaMemcpy(src, host, sizeof host, cudaMemcpyHostToDevice);
  int failed = 0;
  for (int cp_async = 0; cp_async < 2; ++cp_async) {
    cp_async ? ring<true><<<1, 64>>>(src, out, kRounds) : ring<false><<<1, 64>>>(src, out, kRounds);
    float got[32];
    cudaMemcpy(got, out, sizeof got, cudaMemcpyDeviceToHost);
    int wrong = 0;
    for (int i = 0; i < 32; ++i) wrong += got[i] != expect[i];
    printf("%s ring: %s (%s)\n", cp_async ? "cp.async" : "st.shared", wrong ? "WRONG" : "sums match",
           cudaGetErrorString(cudaGetLastError()));
    failed |= wrong;
  }
  return failed;
}
