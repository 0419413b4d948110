#include "common.cuh"
PEER_FP8_CONFIG(co_128x128_c2, KernelTmaWarpSpecializedCooperativeFP8FastAccum, TmaWarpSpecializedCooperative, 128, 128, 128, 2, 1)
