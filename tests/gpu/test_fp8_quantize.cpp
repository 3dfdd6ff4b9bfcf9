// The FP8 quantisation kernels (Fp8Quantize.*) against the CPU reference (src/reference/fp8.h) bit for
// bit: codes, power-of-two scales and dequantised values, for 1×128 tiles and 128×128 blocks, with
// shorter edge tiles (K = 2880), all-zero tiles, subnormal inputs, magnitudes spread over 2^±40 and
// exact E4M3 ties; a NaN or an infinity reported.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/bf16.h"
#include "gpu/gpu_test.h"
#include "gpu/layer_check.h"
#include "kernels/fp8/api.h"
#include "reference/fp8.h"

namespace lynx::test {
namespace {

class Fp8Quantize : public GpuTest {};

// bf16 values: normal(0, 1) times 2^u with u uniform in [-spread, spread] per 8-column group (so tiles
// mix magnitudes); with a second row, a zero tile at (0, 0) and a tile at (1, 0) whose amax is exactly
// 448 · 2^-3 (scale 2^-3 exactly at the boundary); with a third, a row of bf16 subnormals of both signs.
std::vector<HostBf16> spread_values(int64_t rows, int64_t cols, int spread, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-spread, spread);
  std::vector<HostBf16> v(size_t(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    int e = 0;
    for (int64_t c = 0; c < cols; ++c) {
      if (c % 8 == 0) e = exponent(rng);
      v[r * cols + c] = float_to_bf16(std::ldexp(normal(rng), e));
    }
  }
  if (rows > 1) {
    for (int64_t c = 0; c < std::min<int64_t>(cols, fp8::kBlock); ++c) {
      v[c] = float_to_bf16(0.0f);
      v[cols + c] = float_to_bf16(std::ldexp(normal(rng), -2));
    }
    v[cols + std::min<int64_t>(cols, fp8::kBlock) / 2] = float_to_bf16(448.0f / 8);  // the others ~N(0, 1/16)
  }
  if (rows > 2) {
    for (int64_t c = 0; c < cols; ++c) {
      v[2 * cols + c] = HostBf16{uint16_t(((c * 37) % 0x7F + 1) | (c % 2 ? 0x8000 : 0))};  // subnormals
    }
  }
  return v;
}

std::vector<float> to_floats(const std::vector<HostBf16>& v) {
  std::vector<float> f(v.size());
  for (size_t i = 0; i < v.size(); ++i) f[i] = bf16_to_float(v[i]);
  return f;
}

struct GpuQuantized {
  std::vector<uint8_t> q;
  std::vector<float> scales, dequant;
  int32_t nonfinite = 0;
};

GpuQuantized quantize_on_gpu(const std::vector<HostBf16>& x, int64_t rows, int64_t cols, bool blocks) {
  const int64_t n_scales = (blocks ? fp8::blocks_of(rows) : rows) * fp8::blocks_of(cols);
  DeviceBuffer d_x = to_device(x), d_q(size_t(rows * cols)), d_s(size_t(n_scales) * 4), d_deq(size_t(rows * cols) * 4);
  DeviceBuffer d_flag = to_device(std::vector<int32_t>{0});
  d_q.fill_bytes(0x7F);  // NaN codes and scales: an element the kernel skips cannot pass
  d_s.fill_bytes(0xFF);
  d_deq.fill_bytes(0xFF);
  const auto* xp = static_cast<const bf16_t*>(d_x.get());
  auto* qp = static_cast<uint8_t*>(d_q.get());
  auto* sp = static_cast<float*>(d_s.get());
  auto* flag = static_cast<int32_t*>(d_flag.get());
  if (blocks) {
    fp8::quantize_blocks(xp, rows, cols, qp, sp, flag, nullptr);
  } else {
    fp8::quantize_tiles(xp, rows, cols, qp, sp, flag, nullptr);
  }
  fp8::dequantize(qp, sp, rows, cols, blocks, static_cast<float*>(d_deq.get()), nullptr);
  LYNX_TEST_CUDA(cudaDeviceSynchronize());
  GpuQuantized g;
  g.q = to_host<uint8_t>(d_q, size_t(rows * cols));
  g.scales = to_host<float>(d_s, size_t(n_scales));
  g.dequant = to_host<float>(d_deq, size_t(rows * cols));
  g.nonfinite = to_host<int32_t>(d_flag, 1)[0];
  return g;
}

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

void expect_equal_to_reference(int64_t rows, int64_t cols, bool blocks, int spread) {
  const auto seed = fresh_seed();
  SCOPED_TRACE(std::to_string(rows) + " x " + std::to_string(cols) + (blocks ? " blocks" : " tiles") + " spread 2^" +
               std::to_string(spread) + " seed " + std::to_string(seed));
  const std::vector<HostBf16> x = spread_values(rows, cols, spread, seed);
  const std::vector<float> xf = to_floats(x);
  const ref::fp8::Quantized want =
      blocks ? ref::fp8::quantize_blocks(xf.data(), rows, cols) : ref::fp8::quantize_tiles(xf.data(), rows, cols);
  ASSERT_TRUE(want.finite);
  const GpuQuantized got = quantize_on_gpu(x, rows, cols, blocks);
  EXPECT_EQ(got.nonfinite, 0);
  ASSERT_EQ(got.scales.size(), want.scales.size());
  for (size_t i = 0; i < want.scales.size(); ++i) {
    ASSERT_EQ(bits(got.scales[i]), bits(want.scales[i])) << "scale " << i << ": " << got.scales[i] << " vs " << want.scales[i];
  }
  int64_t ties = 0;
  for (int64_t i = 0; i < rows * cols; ++i) {
    ASSERT_EQ(got.q[i], want.q[i]) << "q[" << i / cols << ", " << i % cols << "] of x = " << xf[i];
    const float d = want.dequant(i / cols, i % cols, blocks);
    ASSERT_EQ(bits(got.dequant[i]), bits(d)) << "dequantised [" << i / cols << ", " << i % cols << "]";
    // A tie: x / scale halfway between two codes (bf16's 8 significant bits hold E4M3's halfway points).
    const float s = blocks ? want.scales[(i / cols / fp8::kBlock) * fp8::blocks_of(cols) + (i % cols) / fp8::kBlock]
                           : want.scales[(i / cols) * fp8::blocks_of(cols) + (i % cols) / fp8::kBlock];
    const float scaled = std::fabs(xf[i] / s);
    const uint8_t lo = ref::fp8::to_e4m3(scaled);
    if (lo < 0x7E && scaled != ref::fp8::from_e4m3(lo)) {
      const float a = ref::fp8::from_e4m3(lo), b = ref::fp8::from_e4m3(uint8_t(lo + (scaled > a ? 1 : -1)));
      if (scaled - std::min(a, b) == std::fabs(b - a) / 2) ++ties;
    }
  }
  if (rows * cols >= 4096) {
    EXPECT_GT(ties, 0) << "no input fell on an E4M3 tie: the rounding of ties went untested";
  }
}

TEST_F(Fp8Quantize, TilesEqualTheReference) {
  expect_equal_to_reference(3, 2880, false, 8);   // 22 tiles and a 64-wide one per row
  expect_equal_to_reference(130, 256, false, 40);
  expect_equal_to_reference(1, 64, false, 4);     // one short tile
}

TEST_F(Fp8Quantize, BlocksEqualTheReference) {
  expect_equal_to_reference(300, 2880, true, 8);  // edge blocks of 44 rows and 64 columns
  expect_equal_to_reference(128, 128, true, 40);
  expect_equal_to_reference(3, 200, true, 4);     // one short block of bf16 subnormals among others
  expect_equal_to_reference(1, 1, true, 2);
}

TEST_F(Fp8Quantize, NonFiniteInputIsReported) {
  for (const float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    for (const bool blocks : {false, true}) {
      std::vector<HostBf16> x = spread_values(5, 300, 4, 1);
      x[3 * 300 + 257] = float_to_bf16(bad);
      EXPECT_EQ(quantize_on_gpu(x, 5, 300, blocks).nonfinite, 1) << bad << (blocks ? " blocks" : " tiles");
    }
  }
  EXPECT_EQ(quantize_on_gpu(spread_values(5, 300, 4, 1), 5, 300, false).nonfinite, 0);
}

}  // namespace
}  // namespace lynx::test
