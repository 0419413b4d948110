#include "common.cuh"
PEER_FP8_CONFIG(pp_64x256_c2, KernelTmaWarpSpecializedPingpongFP8FastAccum, TmaWarpSpecialized, 64, 256, 128, 2, 1)
