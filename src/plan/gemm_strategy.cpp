#include "plan/gemm_strategy.h"

namespace lynx::plan {

GemmStrategy choose_gemm_strategy(int64_t products, double mean_flops, int32_t forced) {
  if (forced >= 0) return forced == 1 ? GemmStrategy::kGrouped : GemmStrategy::kLoop;
  // NOTES: measured on an H200 (2026-11-29):
  // cuBLAS's grouped call wins only for many small products (qwen3: 128 experts × 1.6 GFLOP each,
  // 2.68 vs 3.45 ms forward); from about 3.8 GFLOP per product (deepseek-v3, olmoe) and for few
  // large ones (mixtral: 8 × 240 GFLOP, 8.8 vs 21.2 ms) one dense call per product is faster.
  constexpr double kLoopFromFlops = 2.5e9;
  constexpr int64_t kLoopUpToProducts = 16;
  return products <= kLoopUpToProducts || mean_flops >= kLoopFromFlops ? GemmStrategy::kLoop : GemmStrategy::kGrouped;
}

}  // namespace lynx::plan
