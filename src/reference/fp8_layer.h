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
  // Out, optional ([T, k]): 1 where a 1×128 tile of the slot's h has its amax within 2^-7 of a scale
  // boundary (amax / 448 near a power of two), so that a GPU whose sums moved h by a bf16 step there
  // may pick the scale twice or half this one's: that slot's row of y may then differ from this
  // emulation by E4M3 steps of the whole tile, not by the fp32 sums alone.
  uint8_t* near_scale_boundary = nullptr;
  // routed_backward: g and u as DeepSeek-V3's recipe keeps the SwiGLU's inputs, E4M3 in 1×128 tiles
  // along I (each row's bf16 g and u quantised, then dequantised), not as lynx keeps them (bf16).
  bool gate_up_e4m3 = false;
};

// y without the shared expert: [T, H]. Throws std::invalid_argument for a non-finite input (the GPU
// reports it instead).
std::vector<double> routed_forward(const RoutedLayer& layer);

// The routed experts' gradients of the FP8 backward (FP8 weight gradients), with the roundings lynx
// makes, in double where the GPU keeps fp32: dŷ and x̂ (dy and x in 1×128 tiles per token, dequantised);
// g and u as the forward keeps them (its FP8 products rounded to bf16); da = dŷ · w_down on w_downᵀ's
// 128×128 blocks, rounded to bf16; the SwiGLU backward (dg, du, w·silu(g)⊙u rounded to bf16);
// dx_row = [dg | du] in 1×128 tiles over K = 2I times [w_gate; w_up]ᵀ's blocks, rounded to bf16; the
// weight gradients per expert over its rows in token order, padded to 128-row blocks, both operands in
// 1×128 tiles along the rows (dg | du with x̂, dŷ with w·silu(g)⊙u), rounded to bf16.
struct RoutedGradients {
  std::vector<double> dx;              // [T, H] (the routed part)
  std::vector<double> d_topk_weights;  // [T, k]
  std::vector<double> dw_gate, dw_up;  // [E, I, H]
  std::vector<double> dw_down;         // [E, H, I]
};
RoutedGradients routed_backward(const RoutedLayer& layer, const float* dy);

}  // namespace lynx::ref::fp8
