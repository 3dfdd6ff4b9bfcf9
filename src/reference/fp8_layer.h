// The routed experts' part of the FP8 forward (Config::precision == kFp8Block, docs/fp8.md) as lynx
// computes it, with the roundings it makes, in double where the GPU keeps fp32: x quantised in 1×128
// tiles per token; each expert's weights in 128×128 blocks; g and u the block-scaled products;
// h = silu(g)·u rounded to bf16 and quantised in 1×128 tiles; the down product rounded to bf16 (the row
// the combine reads); y[t] = Σ_j w[t,j] · row. The GPU differs from it only by its fp32 and tensor-core
// sums (and where those tip a bf16 rounding of h one way or the other).
#pragma once

#include <cstdint>
#include <vector>

namespace lynx::ref::fp8 {

struct RoutedLayer {
  int64_t T = 0, H = 0, I = 0, E = 0, k = 0;
  const float* x = nullptr;             // [T, H] (bf16 values)
  const int32_t* topk_ids = nullptr;    // [T, k] in [0, E), or -1: not routed
  const double* topk_weights = nullptr; // [T, k]
  const float* w_gate = nullptr;        // [E, I, H] (bf16 values)
  const float* w_up = nullptr;          // [E, I, H]
  const float* w_down = nullptr;        // [E, H, I]
};

// y without the shared expert: [T, H]. Throws std::invalid_argument for a non-finite input (the GPU
// reports it instead).
std::vector<double> routed_forward(const RoutedLayer& layer);

}  // namespace lynx::ref::fp8
