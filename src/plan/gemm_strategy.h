// How the baseline issues a batch of independent GEMMs: a pure host choice, tested on the CPU.
#pragma once

#include <cstdint>

namespace lynx::plan {

enum class GemmStrategy { kLoop, kGrouped };

// One cublasGemmEx per product (kLoop) or one cublasGemmGroupedBatchedEx call (kGrouped), for
// `products` non-empty products of `mean_flops` FLOPs each on average. `forced`: 0 loop, 1 grouped,
// -1 the rule (plan/overrides.h).
GemmStrategy choose_gemm_strategy(int64_t products, double mean_flops, int32_t forced = -1);

}  // namespace lynx::plan
