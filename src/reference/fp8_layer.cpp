#include "reference/fp8_layer.h"

#include <cmath>
#include <stdexcept>

#include "common/bf16.h"
#include "reference/fp8.h"

namespace lynx::ref::fp8 {
namespace {

double silu(double z) { return z / (1.0 + std::exp(-z)); }

float round_bf16(double v) { return bf16_to_float(float_to_bf16(float(v))); }

// Each of `count` matrices [rows, cols] quantised in 128×128 blocks, and back: the values the GPU's
// products read.
std::vector<double> dequantised_blocks(const float* w, int64_t count, int64_t rows, int64_t cols) {
  std::vector<double> out(size_t(count * rows * cols));
  for (int64_t m = 0; m < count; ++m) {
    const Quantized q = quantize_blocks(w + m * rows * cols, rows, cols);
    if (!q.finite) throw std::invalid_argument("fp8 routed_forward: a weight is not finite");
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) out[size_t((m * rows + r) * cols + c)] = q.dequant(r, c, true);
    }
  }
  return out;
}

std::vector<double> dequantised_tiles(const float* x, int64_t rows, int64_t cols) {
  const Quantized q = quantize_tiles(x, rows, cols);
  if (!q.finite) throw std::invalid_argument("fp8 routed_forward: an activation is not finite");
  std::vector<double> out(size_t(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) out[size_t(r * cols + c)] = q.dequant(r, c, false);
  }
  return out;
}

}  // namespace

std::vector<double> routed_forward(const RoutedLayer& L) {
  const int64_t T = L.T, H = L.H, I = L.I, E = L.E, k = L.k;
  const std::vector<double> x = dequantised_tiles(L.x, T, H);
  const std::vector<double> wg = dequantised_blocks(L.w_gate, E, I, H);
  const std::vector<double> wu = dequantised_blocks(L.w_up, E, I, H);
  const std::vector<double> wd = dequantised_blocks(L.w_down, E, H, I);
  std::vector<double> y(size_t(T * H), 0.0);
  std::vector<float> h(static_cast<size_t>(I));
  for (int64_t t = 0; t < T; ++t) {
    const double* xt = &x[size_t(t * H)];
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = L.topk_ids[t * k + j];
      if (e < 0) continue;
      if (e >= E) throw std::out_of_range("fp8 routed_forward: expert id out of range");
      for (int64_t i = 0; i < I; ++i) {
        const double* g_row = &wg[size_t((e * I + i) * H)];
        const double* u_row = &wu[size_t((e * I + i) * H)];
        double g = 0.0, u = 0.0;
        for (int64_t c = 0; c < H; ++c) {
          g += g_row[c] * xt[c];
          u += u_row[c] * xt[c];
        }
        h[size_t(i)] = round_bf16(silu(g) * u);
      }
      const std::vector<double> hq = dequantised_tiles(h.data(), 1, I);
      const double w = L.topk_weights[t * k + j];
      for (int64_t c = 0; c < H; ++c) {
        const double* d_row = &wd[size_t((e * H + c) * I)];
        double o = 0.0;
        for (int64_t i = 0; i < I; ++i) o += d_row[i] * hq[size_t(i)];
        y[size_t(t * H + c)] += w * double(round_bf16(o));
      }
    }
  }
  return y;
}

}  // namespace lynx::ref::fp8
