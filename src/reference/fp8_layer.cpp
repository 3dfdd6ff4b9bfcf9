#include "reference/fp8_layer.h"

#include <algorithm>
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

// The matrices [rows, cols] of `count` after one another, each transposed: [count, cols, rows].
std::vector<float> transposed(const float* w, int64_t count, int64_t rows, int64_t cols) {
  std::vector<float> out(size_t(count * rows * cols));
  for (int64_t m = 0; m < count; ++m) {
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) out[size_t((m * cols + c) * rows + r)] = w[(m * rows + r) * cols + c];
    }
  }
  return out;
}

// Σ over the rows of a [rows, m] and b [rows, n] (rows a multiple of 128) of a[r]ᵀ b[r], both operands
// transposed and quantised in 1×128 tiles along the rows (the weight-gradient GEMM), rounded to bf16:
// [m, n].
std::vector<double> weight_gradient(const std::vector<float>& a, int64_t m, const std::vector<float>& b, int64_t n,
                                    int64_t rows) {
  const std::vector<float> at = transposed(a.data(), 1, rows, m), bt = transposed(b.data(), 1, rows, n);
  const std::vector<double> out = fp8_gemm(quantize_tiles(at.data(), m, rows), quantize_tiles(bt.data(), n, rows), true);
  std::vector<double> rounded(out.size());
  for (size_t i = 0; i < out.size(); ++i) rounded[i] = round_bf16(out[i]);
  return rounded;
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
      if (L.near_scale_boundary) {
        uint8_t near = 0;
        for (int64_t b0 = 0; b0 < I; b0 += 128) {
          float amax = 0.0f;
          for (int64_t i = b0; i < std::min(I, b0 + 128); ++i) amax = std::max(amax, std::fabs(h[size_t(i)]));
          const double r = std::log2(double(amax) / 448.0);
          if (amax > 0.0f && std::fabs(r - std::round(r)) < std::log2(1.0 + 1.0 / 128.0)) near = 1;
        }
        L.near_scale_boundary[t * k + j] = near;
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

RoutedGradients routed_backward(const RoutedLayer& L, const float* dy) {
  const int64_t T = L.T, H = L.H, I = L.I, E = L.E, k = L.k;
  const std::vector<double> x = dequantised_tiles(L.x, T, H), dyq = dequantised_tiles(dy, T, H);
  const std::vector<double> wg = dequantised_blocks(L.w_gate, E, I, H);
  const std::vector<double> wu = dequantised_blocks(L.w_up, E, I, H);
  const std::vector<double> wd_t = dequantised_blocks(transposed(L.w_down, E, H, I).data(), E, I, H);
  // [w_gate; w_up]ᵀ per expert: [H, 2I].
  std::vector<float> gu(size_t(E * 2 * I * H));
  for (int64_t e = 0; e < E; ++e) {
    std::copy(L.w_gate + e * I * H, L.w_gate + (e + 1) * I * H, gu.begin() + e * 2 * I * H);
    std::copy(L.w_up + e * I * H, L.w_up + (e + 1) * I * H, gu.begin() + e * 2 * I * H + I * H);
  }
  const std::vector<double> wgu_t = dequantised_blocks(transposed(gu.data(), E, 2 * I, H).data(), E, H, 2 * I);
  RoutedGradients out;
  out.dx.assign(size_t(T * H), 0.0);
  out.d_topk_weights.assign(size_t(T * k), 0.0);
  out.dw_gate.assign(size_t(E * I * H), 0.0);
  out.dw_up.assign(size_t(E * I * H), 0.0);
  out.dw_down.assign(size_t(E * H * I), 0.0);
  for (int64_t e = 0; e < E; ++e) {
    std::vector<int64_t> slots;  // the expert's rows, in token order
    for (int64_t s = 0; s < T * k; ++s) {
      if (L.topk_ids[s] == e) slots.push_back(s);
    }
    const int64_t rows = (int64_t(slots.size()) + kBlock - 1) / kBlock * kBlock;  // padding rows: zeros
    std::vector<float> dgu(size_t(rows * 2 * I), 0.0f), hw(size_t(rows * I), 0.0f), xr(size_t(rows * H), 0.0f),
        dyr(size_t(rows * H), 0.0f);
    for (size_t r = 0; r < slots.size(); ++r) {
      const int64_t s = slots[r], t = s / k;
      const double w = L.topk_weights[s];
      for (int64_t c = 0; c < H; ++c) {
        xr[r * H + c] = float(x[size_t(t * H + c)]);
        dyr[r * H + c] = float(dyq[size_t(t * H + c)]);
      }
      std::vector<float> gr(static_cast<size_t>(I)), ur(static_cast<size_t>(I)), dar(static_cast<size_t>(I));
      for (int64_t i = 0; i < I; ++i) {
        double g = 0.0, u = 0.0, da = 0.0;
        for (int64_t c = 0; c < H; ++c) {
          g += wg[size_t((e * I + i) * H + c)] * x[size_t(t * H + c)];
          u += wu[size_t((e * I + i) * H + c)] * x[size_t(t * H + c)];
          da += wd_t[size_t((e * I + i) * H + c)] * dyq[size_t(t * H + c)];
        }
        gr[size_t(i)] = round_bf16(g), ur[size_t(i)] = round_bf16(u), dar[size_t(i)] = round_bf16(da);
      }
      if (L.gate_up_e4m3) {
        const std::vector<double> gq = dequantised_tiles(gr.data(), 1, I), uq = dequantised_tiles(ur.data(), 1, I);
        for (int64_t i = 0; i < I; ++i) gr[size_t(i)] = float(gq[size_t(i)]), ur[size_t(i)] = float(uq[size_t(i)]);
      }
      double dot = 0.0;
      for (int64_t i = 0; i < I; ++i) {
        const double g = gr[size_t(i)], u = ur[size_t(i)], da = dar[size_t(i)];
        const double sig = 1.0 / (1.0 + std::exp(-g)), silg = g * sig;
        dot += da * silg * u;
        dgu[r * 2 * I + i] = round_bf16(w * da * u * sig * (1.0 + g * (1.0 - sig)));
        dgu[r * 2 * I + I + i] = round_bf16(w * da * silg);
        hw[r * I + i] = round_bf16(w * silg * u);
      }
      out.d_topk_weights[size_t(s)] = dot;
      const std::vector<double> q = dequantised_tiles(&dgu[r * 2 * I], 1, 2 * I);
      for (int64_t c = 0; c < H; ++c) {
        double v = 0.0;
        for (int64_t i = 0; i < 2 * I; ++i) v += wgu_t[size_t((e * H + c) * 2 * I + i)] * q[size_t(i)];
        out.dx[size_t(t * H + c)] += round_bf16(v);
      }
    }
    if (rows == 0) continue;  // an expert without rows: zero gradients
    const std::vector<double> dw_gu = weight_gradient(dgu, 2 * I, xr, H, rows);
    std::copy(dw_gu.begin(), dw_gu.begin() + I * H, out.dw_gate.begin() + e * I * H);
    std::copy(dw_gu.begin() + I * H, dw_gu.end(), out.dw_up.begin() + e * I * H);
    const std::vector<double> dw_d = weight_gradient(dyr, H, hw, I, rows);
    std::copy(dw_d.begin(), dw_d.end(), out.dw_down.begin() + e * H * I);
  }
  for (double& v : out.dx) v = round_bf16(v);
  return out;
}

}  // namespace lynx::ref::fp8
