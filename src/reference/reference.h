// Double-precision CPU reference of the whole MoE layer (R = 1), forward and backward.
//
// Inputs are read through `Src` (double, or HostBf16 for the bf16 tensors the GPU consumes) and
// converted to double; every sum is in double. Shapes and layouts are those of include/lynx/moe.h.
// Each token's terms are summed in a fixed order (shared expert, then j = 0..k-1), so the per-token
// entry points give bitwise the rows of forward() / backward(). Duplicate ids in a token's top-k
// are allowed; an id outside [0, E) throws std::out_of_range.
#pragma once

#include <cstdint>
#include <vector>

#include "common/bf16.h"

namespace lynx::ref {

template <class Src>
struct Layer {
  int64_t T = 0, H = 0, I = 0, E = 0, k = 0, I_shared = 0;
  const Src* x = nullptr;               // [T, H]
  const int32_t* topk_ids = nullptr;    // [T, k] in [0, E), or -1: not routed (no term, d_topk_weights 0)
  const double* topk_weights = nullptr; // [T, k]
  const Src* w_gate = nullptr;          // [E, I, H]
  const Src* w_up = nullptr;            // [E, I, H]
  const Src* w_down = nullptr;          // [E, H, I]
  const Src* ws_gate = nullptr;         // [I_shared, H]  (unused when I_shared == 0)
  const Src* ws_up = nullptr;           // [I_shared, H]
  const Src* ws_down = nullptr;         // [H, I_shared]
};

struct Gradients {
  std::vector<double> dx;              // [T, H]
  std::vector<double> d_topk_weights;  // [T, k]
  // [T, k] Σ_i |(w_down^T dy)_i · a_i|: the magnitude of the terms of each d_topk_weights dot product.
  // Its rounding error scales with this, not with the (possibly cancelled) sum.
  std::vector<double> d_topk_magnitude;
  // [T, k] √(Σ_i [a_i² Σ_h (dy_h w_down[h, i])² + da_i² ((silu′(g_i) u_i)² Σ_h (w_gate[i, h] x_h)²
  // + silu(g_i)² Σ_h (w_up[i, h] x_h)²)]): the root-sum-square of the terms of the sums over H behind
  // each d_topk_weights value, weighted by how much the value moves with each (to first order). When
  // every factor of those terms carries an independent relative error of RMS ε (FP8's quantised
  // operands: two factors a term), the value's error has an RMS of about √2·ε times this, however much
  // da_i, g_i, u_i or the value itself cancel.
  std::vector<double> d_topk_term_rss;
  std::vector<double> dw_gate, dw_up;  // [E, I, H]
  std::vector<double> dw_down;         // [E, H, I]
  // [E, 3] per expert, Σ over its routed terms of each term's squared norm in dw_gate, dw_up and
  // dw_down (‖dg‖²‖x‖², ‖du‖²‖x‖², w²‖dy‖²‖a‖²): the scale of the rounding error of a sum whose terms
  // are rounded one by one, which terms of opposite signs cancel in the sum but not in its error.
  std::vector<double> dw_term_square;
  std::vector<double> dws_gate, dws_up;  // [I_shared, H] (empty when I_shared == 0)
  std::vector<double> dws_down;          // [H, I_shared]
};

// y: [T, H]. forward() and backward() spread the tokens, and backward() the weight gradients'
// pieces, over `threads` threads (0: the machine's; 1 where the caller runs several at once): the
// results are the same bits at every count.
template <class Src>
std::vector<double> forward(const Layer<Src>& layer, int threads = 0);

// One token's output row (y[t], H values): cheap enough to spot-check shapes too large for forward().
template <class Src>
void forward_token(const Layer<Src>& layer, int64_t t, double* y_row);

// dy: [T, H]. All gradients of the scalar <y, dy>. d_topk_weights[t,j] = <dy[t], f_e(x[t])> is
// computed as <w_down[e]^T dy[t], silu(g) ⊙ u>, as the GPU backward does.
template <class Src>
Gradients backward(const Layer<Src>& layer, const double* dy, int threads = 0);

// One token's input gradients: dx[t] (H values) and d_topk_weights[t] (k values) from dy[t].
template <class Src>
void backward_token(const Layer<Src>& layer, int64_t t, const double* dy_row, double* dx_row,
                    double* d_topk_row);

}  // namespace lynx::ref
