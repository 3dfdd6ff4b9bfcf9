// How the unfused path issues a batch of independent GEMMs (a pure host choice, tested on the CPU).
#pragma once

#include <cstdint>

namespace lynx::unfused {

enum class GemmStrategy { kLoop, kGrouped };

// One cublasGemmEx per product (kLoop) or one cublasGemmGroupedBatchedEx call (kGrouped), for
// `products` non-empty products of `mean_flops` FLOPs each on average.
GemmStrategy choose_gemm_strategy(int64_t products, double mean_flops);

}  // namespace lynx::unfused
