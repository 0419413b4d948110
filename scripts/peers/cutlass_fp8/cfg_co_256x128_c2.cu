#include "common.cuh"
PEER_FP8_CONFIG(co_256x128_c2, KernelTmaWarpSpecializedCooperativeFP8FastAccum, TmaWarpSpecializedCooperative, 256, 128, 128, 1, 2)
