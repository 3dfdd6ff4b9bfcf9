#include "reference/fp8.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace lynx::ref::fp8 {
namespace {

constexpr uint8_t kNaN = 0x7F;
constexpr uint8_t kMaxCode = 0x7E;  // 448 = 1.75 · 2^8
constexpr int kMinScaleExponent = -126;  // scales stay normal floats (a GPU may flush subnormals)

int64_t blocks_of(int64_t n) { return (n + kBlock - 1) / kBlock; }

// Round half to even of a value whose fraction is exact (the default rounding mode).
int round_even(double v) { return static_cast<int>(std::nearbyint(v)); }

}  // namespace

uint8_t to_e4m3(float x) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  if (!std::isfinite(x)) return sign | kNaN;
  const double a = std::fabs(double(x));
  if (a > kE4M3Max) return sign | kMaxCode;
  if (a < std::ldexp(1.0, -6)) {  // subnormal: multiples of 2^-9 (8 rounds up to the smallest normal)
    return sign | uint8_t(round_even(a * 512.0));
  }
  int e = std::ilogb(a);  // 2^e <= a < 2^(e+1), e in [-6, 8]
  int mant = round_even((std::ldexp(a, -e) - 1.0) * 8.0);
  if (mant == 8) mant = 0, ++e;
  return sign | uint8_t(((e + 7) << 3) | mant);
}

float from_e4m3(uint8_t q) {
  const float sign = (q & 0x80) ? -1.0f : 1.0f;
  const int e = (q >> 3) & 0xF, m = q & 0x7;
  if (e == 15 && m == 7) return std::nanf("");
  if (e == 0) return sign * std::ldexp(float(m), -9);
  return sign * std::ldexp(1.0f + float(m) / 8.0f, e - 7);
}

float pow2_scale(float amax) {
  if (!(amax > 0.0f)) return 1.0f;
  int p = 0;
  const float m = std::frexp(amax, &p);  // amax = m · 2^p, m in [0.5, 1); 448 = 0.875 · 2^9
  const int e = m <= 0.875f ? p - 9 : p - 8;
  return std::ldexp(1.0f, e < kMinScaleExponent ? kMinScaleExponent : e);
}

float Quantized::dequant(int64_t r, int64_t c, bool blocks) const {
  const int64_t kb = blocks_of(cols);
  const float s = blocks ? scales[(r / kBlock) * kb + c / kBlock] : scales[r * kb + c / kBlock];
  return from_e4m3(q[r * cols + c]) * s;
}

namespace {

// Quantises x with tiles of `tile_rows` rows (1: activations; 128: weight blocks) × 128 columns.
Quantized quantize(const float* x, int64_t rows, int64_t cols, int64_t tile_rows) {
  Quantized out;
  out.rows = rows, out.cols = cols;
  out.q.assign(size_t(rows * cols), 0);
  const int64_t rb = (rows + tile_rows - 1) / tile_rows, kb = blocks_of(cols);
  out.scales.assign(size_t(rb * kb), 1.0f);
  for (int64_t br = 0; br < rb; ++br) {
    for (int64_t bc = 0; bc < kb; ++bc) {
      const int64_t r_end = std::min(rows, (br + 1) * tile_rows), c_end = std::min(cols, (bc + 1) * kBlock);
      float amax = 0.0f;
      for (int64_t r = br * tile_rows; r < r_end; ++r) {
        for (int64_t c = bc * kBlock; c < c_end; ++c) {
          const float v = x[r * cols + c];
          if (!std::isfinite(v)) out.finite = false;
          amax = std::max(amax, std::fabs(v));
        }
      }
      const float scale = pow2_scale(amax);
      const float inv = 1.0f / scale;  // exact: a power of two
      out.scales[br * kb + bc] = scale;
      for (int64_t r = br * tile_rows; r < r_end; ++r) {
        for (int64_t c = bc * kBlock; c < c_end; ++c) out.q[r * cols + c] = to_e4m3(x[r * cols + c] * inv);
      }
    }
  }
  return out;
}

}  // namespace

Quantized quantize_tiles(const float* x, int64_t rows, int64_t cols) { return quantize(x, rows, cols, 1); }

Quantized quantize_blocks(const float* w, int64_t rows, int64_t cols) { return quantize(w, rows, cols, kBlock); }

std::vector<double> fp8_gemm(const Quantized& a, const Quantized& b, bool b_tiles) {
  if (a.cols != b.cols) throw std::invalid_argument("fp8_gemm: K differs");
  const int64_t M = a.rows, N = b.rows, K = a.cols, kb = blocks_of(K);
  // The codes' values, decoded once (the products below are the same, in the same order).
  double value[256];
  for (int q = 0; q < 256; ++q) value[q] = double(from_e4m3(uint8_t(q)));
  std::vector<double> av(size_t(M * K)), bv(size_t(N * K));
  for (size_t i = 0; i < av.size(); ++i) av[i] = value[a.q[i]];
  for (size_t i = 0; i < bv.size(); ++i) bv[i] = value[b.q[i]];
  std::vector<double> out(size_t(M * N), 0.0);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < N; ++n) {
      double acc = 0.0;
      for (int64_t blk = 0; blk < kb; ++blk) {
        double part = 0.0;
        for (int64_t k = blk * kBlock; k < std::min(K, (blk + 1) * kBlock); ++k) {
          part += av[size_t(m * K + k)] * bv[size_t(n * K + k)];
        }
        const float sb = b_tiles ? b.scales[n * kb + blk] : b.scales[(n / kBlock) * kb + blk];
        acc += part * double(a.scales[m * kb + blk]) * double(sb);
      }
      out[m * N + n] = acc;
    }
  }
  return out;
}

double dissimilarity(const std::vector<double>& a, const std::vector<double>& b) {
  double ab = 0.0, aa = 0.0, bb = 0.0;
  for (size_t i = 0; i < a.size(); ++i) ab += a[i] * b[i], aa += a[i] * a[i], bb += b[i] * b[i];
  return aa + bb > 0.0 ? 1.0 - 2.0 * ab / (aa + bb) : 0.0;
}

}  // namespace lynx::ref::fp8
