#include "common.cuh"
PEER_FP8_CONFIG(co_128x256_c2, KernelTmaWarpSpecializedCooperativeFP8FastAccum, TmaWarpSpecializedCooperative, 128, 256, 128, 2, 1)
