#include "common.cuh"
PEER_FP8_CONFIG(pp_128x128_c2, KernelTmaWarpSpecializedPingpongFP8FastAccum, TmaWarpSpecialized, 128, 128, 128, 2, 1)
