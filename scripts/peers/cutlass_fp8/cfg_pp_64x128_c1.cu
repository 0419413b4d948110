#include "common.cuh"
PEER_FP8_CONFIG(pp_64x128_c1, KernelTmaWarpSpecializedPingpongFP8FastAccum, TmaWarpSpecialized, 64, 128, 128, 1, 1)
