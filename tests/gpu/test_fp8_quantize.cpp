// The FP8 quantisation kernels (Fp8Quantize.*) against the CPU reference (src/reference/fp8.h) bit for
// bit: codes, power-of-two scales and dequantised values, for 1×128 tiles and 128×128 blocks, with
// shorter edge tiles (K = 2880), all-zero and -0 tiles, subnormal inputs, the largest bf16 magnitude,
// magnitudes spread over 2^±40 and exact E4M3 ties; a NaN or an infinity reported, its tile's scale NaN.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/bf16.h"
#include "common/status.h"
#include "gpu/gpu_test.h"
#include "gpu/layer_check.h"
#include "kernels/fp8/api.h"
#include "kernels/glue/api.h"
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

// `offset` > 0 places x and q that many elements past an aligned address: the kernels' one-at-a-time
// accesses, as for a view into a larger tensor.
GpuQuantized quantize_on_gpu(const std::vector<HostBf16>& x, int64_t rows, int64_t cols, bool blocks,
                             int64_t offset = 0) {
  const int64_t n_scales = (blocks ? fp8::blocks_of(rows) : rows) * fp8::blocks_of(cols);
  std::vector<HostBf16> shifted(size_t(offset), float_to_bf16(0.0f));
  shifted.insert(shifted.end(), x.begin(), x.end());
  DeviceBuffer d_x = to_device(shifted), d_q(size_t(rows * cols + offset)), d_s(size_t(n_scales) * 4),
               d_deq(size_t(rows * cols) * 4);
  DeviceBuffer d_flag = to_device(std::vector<int32_t>{0});
  d_q.fill_bytes(0x7F);  // NaN codes and scales: an element the kernel skips cannot pass
  d_s.fill_bytes(0xFF);
  d_deq.fill_bytes(0xFF);
  const auto* xp = static_cast<const bf16_t*>(d_x.get()) + offset;
  auto* qp = static_cast<uint8_t*>(d_q.get()) + offset;
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
  const std::vector<uint8_t> q = to_host<uint8_t>(d_q, size_t(rows * cols + offset));
  g.q.assign(q.begin() + offset, q.end());
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

void expect_equal_to_reference(int64_t rows, int64_t cols, bool blocks, int spread, int64_t offset = 0) {
  const auto seed = fresh_seed();
  SCOPED_TRACE(std::to_string(rows) + " x " + std::to_string(cols) + (blocks ? " blocks" : " tiles") + " spread 2^" +
               std::to_string(spread) + " offset " + std::to_string(offset) + " seed " + std::to_string(seed));
  const std::vector<HostBf16> x = spread_values(rows, cols, spread, seed);
  const std::vector<float> xf = to_floats(x);
  const ref::fp8::Quantized want =
      blocks ? ref::fp8::quantize_blocks(xf.data(), rows, cols) : ref::fp8::quantize_tiles(xf.data(), rows, cols);
  ASSERT_TRUE(want.finite);
  const GpuQuantized got = quantize_on_gpu(x, rows, cols, blocks, offset);
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
  expect_equal_to_reference(130, 256, false, 8, 1);  // unaligned x and q: one value at a time
  expect_equal_to_reference(5, 300, false, 8);       // cols % 8 == 4: one value at a time; 3 tiles a row
  expect_equal_to_reference(130, 256, false, 8, 4);  // x 8-byte, q 4-byte aligned: one value at a time
  expect_equal_to_reference(4, 1408, false, 8, 8);   // x 16-byte, q 8-byte aligned past the start; 11 tiles
}

// Tiles of edge values, 4 rows of 5 tiles (two per warp at a time: tile 4 alone in its pair): a NaN in
// tile (0, 1) and an infinity in tile (1, 4), each half-warp's own, their scales NaN and every other tile
// equal to the reference; a tile of -0, one of the largest finite bf16 magnitude, one of subnormals
// with the smallest. Then a row limit above the rows and one of 0: nothing written.
TEST_F(Fp8Quantize, TilesOfEdgeValuesEqualTheReference) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const int64_t rows = 4, cols = 640, kb = fp8::blocks_of(cols);
  std::vector<HostBf16> x = spread_values(rows, cols, 8, seed);
  x[size_t(0 * cols + 128 + 77)] = float_to_bf16(std::numeric_limits<float>::quiet_NaN());
  x[size_t(1 * cols + 512 + 3)] = float_to_bf16(-std::numeric_limits<float>::infinity());
  for (int64_t c = 0; c < 128; ++c) {
    x[size_t(2 * cols + c)] = HostBf16{0x8000};                                       // -0
    x[size_t(2 * cols + 128 + c)] = HostBf16{uint16_t(c % 3 == 0 ? 0xFF7F : 0x7F7F)};  // ±the largest
    x[size_t(2 * cols + 256 + c)] = HostBf16{uint16_t(c % 2 ? 0x8001 : 0x0001 + c)};   // subnormals
  }
  const std::vector<float> xf = to_floats(x);
  const ref::fp8::Quantized want = ref::fp8::quantize_tiles(xf.data(), rows, cols);
  const GpuQuantized got = quantize_on_gpu(x, rows, cols, false);
  EXPECT_EQ(got.nonfinite, 1);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < kb; ++b) {
      const size_t i = size_t(r * kb + b);
      if ((r == 0 && b == 1) || (r == 1 && b == 4)) {
        EXPECT_TRUE(std::isnan(got.scales[i])) << "tile (" << r << ", " << b << ")";
        continue;
      }
      ASSERT_EQ(bits(got.scales[i]), bits(want.scales[i])) << "scale of tile (" << r << ", " << b << ")";
      for (int64_t c = b * 128; c < std::min(cols, (b + 1) * 128); ++c) {
        ASSERT_EQ(got.q[size_t(r * cols + c)], want.q[size_t(r * cols + c)]) << "q[" << r << ", " << c << "]";
      }
    }
  }

  DeviceBuffer d_x = to_device(x), d_q(size_t(rows * cols)), d_s(size_t(rows * kb) * 4);
  for (const int32_t limit : {int32_t(rows + 1), 0}) {
    DeviceBuffer d_limit = to_device(std::vector<int32_t>{limit}), d_flag = to_device(std::vector<int32_t>{0});
    d_q.fill_bytes(0x7F);
    d_s.fill_bytes(0xFF);
    fp8::quantize_tiles(d_x.as<bf16_t>(), rows, cols, d_limit.as<int32_t>(), d_q.as<uint8_t>(), d_s.as<float>(),
                        fp8::NonfiniteReport{d_flag.as<int32_t>()}, nullptr);
    LYNX_TEST_CUDA(cudaDeviceSynchronize());
    EXPECT_EQ(to_host<int32_t>(d_flag, 1)[0], 0) << "limit " << limit << ": a row read";
    for (const uint8_t v : to_host<uint8_t>(d_q, size_t(rows * cols))) ASSERT_EQ(v, 0x7F) << "limit " << limit;
    for (const float v : to_host<float>(d_s, size_t(rows * kb))) ASSERT_TRUE(std::isnan(v)) << "limit " << limit;
  }
}

TEST_F(Fp8Quantize, BlocksEqualTheReference) {
  expect_equal_to_reference(300, 2880, true, 8);  // edge blocks of 44 rows and 64 columns
  expect_equal_to_reference(128, 128, true, 40);
  expect_equal_to_reference(3, 200, true, 4);     // one short block of bf16 subnormals among others
  expect_equal_to_reference(1, 1, true, 2);
  expect_equal_to_reference(300, 2880, true, 8, 1);  // unaligned w and q: one value at a time
  expect_equal_to_reference(130, 258, true, 8);      // columns not a multiple of 4
  expect_equal_to_reference(131, 260, true, 8);      // cols % 8 == 4: one value at a time; 3 rows in a block
  expect_equal_to_reference(200, 384, true, 8, 4);   // w 8-byte, q 4-byte aligned: one value at a time
  expect_equal_to_reference(200, 384, true, 8, 8);   // w 16-byte, q 8-byte aligned past the start
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

void expect_codes_and_scales(const std::vector<uint8_t>& q, const std::vector<float>& scales,
                             const ref::fp8::Quantized& want, const std::string& what) {
  ASSERT_EQ(q.size(), want.q.size()) << what;
  ASSERT_EQ(scales.size(), want.scales.size()) << what;
  for (size_t i = 0; i < want.q.size(); ++i) ASSERT_EQ(q[i], want.q[i]) << what << " q[" << i << "]";
  for (size_t i = 0; i < want.scales.size(); ++i) {
    ASSERT_EQ(bits(scales[i]), bits(want.scales[i])) << what << " scale " << i;
  }
}

// The layer's forms (docs/fp8.md, "The FP8 forward"): the experts' weights quantised in one launch, each
// matrix as quantize_blocks alone; tiles over the rows below a row count on the device, a NaN past it
// not read, one before it reported in the status word; the tiles gathered into schedule order, and their
// scales alone (gather_tile_scales: gather_tiles' bits, none for a schedule over capacity).
TEST_F(Fp8Quantize, LayerFormsEqualTheReference) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  // Three experts' [200, 320] weights: blocks of 72 rows and 64 columns at the edges.
  const int64_t batch = 3, rows = 200, cols = 320;
  const std::vector<HostBf16> w = spread_values(batch * rows, cols, 6, seed);
  const int64_t block_scales = fp8::blocks_of(rows) * fp8::blocks_of(cols);
  DeviceBuffer d_w = to_device(w), d_q(size_t(batch * rows * cols)), d_s(size_t(batch * block_scales) * 4);
  d_q.fill_bytes(0x7F);
  d_s.fill_bytes(0xFF);
  fp8::quantize_blocks(d_w.as<bf16_t>(), batch, rows, cols, d_q.as<uint8_t>(), d_s.as<float>(), {}, nullptr);
  LYNX_TEST_CUDA(cudaDeviceSynchronize());
  const std::vector<uint8_t> q = to_host<uint8_t>(d_q, size_t(batch * rows * cols));
  const std::vector<float> sc = to_host<float>(d_s, size_t(batch * block_scales));
  const std::vector<float> wf = to_floats(w);
  for (int64_t m = 0; m < batch; ++m) {
    const ref::fp8::Quantized want = ref::fp8::quantize_blocks(wf.data() + m * rows * cols, rows, cols);
    expect_codes_and_scales({q.begin() + m * rows * cols, q.begin() + (m + 1) * rows * cols},
                            {sc.begin() + m * block_scales, sc.begin() + (m + 1) * block_scales}, want,
                            "matrix " + std::to_string(m));
  }

  // Tiles of 300 token rows below a limit of 257 on the device; a NaN at row 280 is past it.
  const int64_t T = 300, limit = 257, kb = fp8::blocks_of(cols);
  std::vector<HostBf16> x = spread_values(T, cols, 6, seed ^ 1);
  x[size_t(280 * cols + 5)] = float_to_bf16(std::numeric_limits<float>::quiet_NaN());
  DeviceBuffer d_x = to_device(x), d_xq(size_t(T * cols)), d_xs(size_t(T * kb) * 4);
  DeviceBuffer d_limit = to_device(std::vector<int32_t>{int32_t(limit)});
  DeviceBuffer d_status = to_device(std::vector<DeviceStatus>{DeviceStatus{}});
  d_xq.fill_bytes(0x7F);
  d_xs.fill_bytes(0xFF);
  fp8::NonfiniteReport report{nullptr, d_status.as<DeviceStatus>(), int64_t(Fp8Tensor::kH)};
  fp8::quantize_tiles(d_x.as<bf16_t>(), T, cols, d_limit.as<int32_t>(), d_xq.as<uint8_t>(), d_xs.as<float>(), report,
                      nullptr);
  LYNX_TEST_CUDA(cudaDeviceSynchronize());
  EXPECT_EQ(to_host<DeviceStatus>(d_status, 1)[0].code, int32_t(StatusCode::kOk)) << "a row past the limit was read";
  const std::vector<uint8_t> xq = to_host<uint8_t>(d_xq, size_t(T * cols));
  const std::vector<float> xs = to_host<float>(d_xs, size_t(T * kb));
  const std::vector<float> xf = to_floats(x);
  const ref::fp8::Quantized tiles = ref::fp8::quantize_tiles(xf.data(), limit, cols);
  expect_codes_and_scales({xq.begin(), xq.begin() + limit * cols}, {xs.begin(), xs.begin() + limit * kb}, tiles,
                          "tiles below the limit");
  for (int64_t i = limit * cols; i < T * cols; ++i) ASSERT_EQ(xq[size_t(i)], 0x7F) << "written past the limit: " << i;
  for (int64_t i = limit * kb; i < T * kb; ++i) ASSERT_TRUE(std::isnan(xs[size_t(i)])) << "scale past the limit: " << i;
  // A NaN below the limit: reported once, naming the tensor.
  x[size_t(10 * cols + 300)] = float_to_bf16(std::numeric_limits<float>::infinity());
  upload(d_x.get(), x.data(), x.size() * 2);
  fp8::quantize_tiles(d_x.as<bf16_t>(), T, cols, d_limit.as<int32_t>(), d_xq.as<uint8_t>(), d_xs.as<float>(), report,
                      nullptr);
  LYNX_TEST_CUDA(cudaDeviceSynchronize());
  const DeviceStatus st = to_host<DeviceStatus>(d_status, 1)[0];
  EXPECT_EQ(st.code, int32_t(StatusCode::kNonFiniteInput));
  EXPECT_EQ(st.a, int64_t(Fp8Tensor::kH));
  // The finite x again, quantised again: the tiles the gather below reads are `tiles`.
  x[size_t(10 * cols + 300)] = float_to_bf16(xf[size_t(10 * cols + 300)]);
  upload(d_x.get(), x.data(), x.size() * 2);
  fp8::quantize_tiles(d_x.as<bf16_t>(), T, cols, d_limit.as<int32_t>(), d_xq.as<uint8_t>(), d_xs.as<float>(), {},
                      nullptr);

  // The first 64 tokens' tiles gathered into a schedule of 256 rows (top-2), of which 200 are rows:
  // row r takes token slot/2 for slot = (7r) mod 128, every fifth a padding row (-1).
  const int64_t cap = 256, total = 200, k = 2;
  std::vector<int32_t> slots(static_cast<size_t>(cap));
  for (int64_t r = 0; r < cap; ++r) slots[size_t(r)] = r % 5 == 4 ? -1 : int32_t((7 * r) % 128);
  DeviceBuffer d_slots = to_device(slots), d_total = to_device(std::vector<int32_t>{int32_t(total)});
  DeviceBuffer d_gq(size_t(cap * cols)), d_gs(size_t(cap * kb) * 4);
  d_gq.fill_bytes(0x7F);
  d_gs.fill_bytes(0xFF);
  fp8::gather_tiles(d_gq.as<uint8_t>(), d_gs.as<float>(), d_xq.as<uint8_t>(), d_xs.as<float>(), d_slots.as<int32_t>(),
                    d_total.as<int32_t>(), cap, k, cols, nullptr);
  LYNX_TEST_CUDA(cudaDeviceSynchronize());
  const std::vector<uint8_t> gq = to_host<uint8_t>(d_gq, size_t(cap * cols));
  const std::vector<float> gs = to_host<float>(d_gs, size_t(cap * kb));
  for (int64_t r = 0; r < cap; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const uint8_t want = r >= total ? 0x7F : slots[size_t(r)] < 0 ? 0 : tiles.q[size_t((slots[size_t(r)] / k) * cols + c)];
      ASSERT_EQ(gq[size_t(r * cols + c)], want) << "row " << r << " column " << c;
    }
    for (int64_t b = 0; b < kb; ++b) {
      const float got = gs[size_t(r * kb + b)];
      if (r >= total) {
        ASSERT_TRUE(std::isnan(got)) << "row " << r << " past the schedule written";
      } else {
        const float want = slots[size_t(r)] < 0 ? 1.0f : tiles.scales[size_t((slots[size_t(r)] / k) * kb + b)];
        ASSERT_EQ(bits(got), bits(want)) << "row " << r << " scale " << b;
      }
    }
  }
  // The scales alone (a GEMM gathering the bytes itself): gather_tiles' scales, bit for bit, none past the
  // schedule written; a schedule over capacity writes none.
  DeviceBuffer d_gs2(size_t(cap * kb) * 4);
  d_gs2.fill_bytes(0xFF);
  fp8::gather_tile_scales(d_gs2.as<float>(), d_xs.as<float>(), d_slots.as<int32_t>(), d_total.as<int32_t>(), cap, k,
                          cols, nullptr);
  DeviceBuffer d_over = to_device(std::vector<int32_t>{int32_t(cap + 128)}), d_gs3(size_t(cap * kb) * 4);
  d_gs3.fill_bytes(0xFF);
  fp8::gather_tile_scales(d_gs3.as<float>(), d_xs.as<float>(), d_slots.as<int32_t>(), d_over.as<int32_t>(), cap, k,
                          cols, nullptr);
  LYNX_TEST_CUDA(cudaDeviceSynchronize());
  const std::vector<float> gs2 = to_host<float>(d_gs2, size_t(cap * kb)), gs3 = to_host<float>(d_gs3, size_t(cap * kb));
  for (int64_t i = 0; i < cap * kb; ++i) {
    ASSERT_EQ(bits(gs2[size_t(i)]), bits(gs[size_t(i)])) << "gather_tile_scales, scale " << i;
    ASSERT_TRUE(std::isnan(gs3[size_t(i)])) << "a schedule over capacity gathered scale " << i;
  }
}

// Two ranks' tokens (T each) quantised in 1×128 tiles, each rank's staged as at R > 1 (bytes [T, cols],
// then scales), and a schedule of `cap` rows over them: row r takes slot (stride·r) mod (T·k) of rank
// r % 2, every `padding`-th row a padding row; one_rank_slots are the same rows in one rank holding both
// ranks' tokens (tiles.q, tiles.scales), and the device copies of it all.
struct TwoRankTiles {
  ref::fp8::Quantized tiles;
  std::vector<DeviceBuffer> staged;
  std::vector<int32_t> slots, src, one_rank_slots;
  DeviceBuffer d_bases, d_src, d_slots, d_one_slots, d_all, d_all_s;

  fp8::TileSources sources(int64_t T) const {
    return fp8::TileSources{static_cast<const void* const*>(d_bases.get()), d_src.as<int32_t>(), T};
  }
};

TwoRankTiles two_rank_tiles(int64_t T, int64_t cols, int64_t k, int64_t cap, int64_t stride, int64_t padding,
                            uint64_t seed) {
  TwoRankTiles t;
  const int64_t kb = fp8::blocks_of(cols);
  const std::vector<float> xf = to_floats(spread_values(2 * T, cols, 6, seed));  // rank 0's tokens, then rank 1's
  t.tiles = ref::fp8::quantize_tiles(xf.data(), 2 * T, cols);
  for (int64_t r = 0; r < 2; ++r) {
    std::vector<uint8_t> bytes(size_t(T * cols + 4 * T * kb));
    std::memcpy(bytes.data(), t.tiles.q.data() + r * T * cols, size_t(T * cols));
    std::memcpy(bytes.data() + T * cols, t.tiles.scales.data() + r * T * kb, size_t(4 * T * kb));
    t.staged.push_back(to_device(bytes));
  }
  const std::vector<const void*> bases{t.staged[0].get(), t.staged[1].get()};
  t.slots.resize(size_t(cap));
  t.src.resize(size_t(cap));
  t.one_rank_slots.resize(size_t(cap));
  for (int64_t r = 0; r < cap; ++r) {
    t.src[size_t(r)] = int32_t(r % 2);
    t.slots[size_t(r)] = r % padding == padding - 1 ? -1 : int32_t((stride * r) % (T * k));
    t.one_rank_slots[size_t(r)] = t.slots[size_t(r)] < 0 ? -1 : int32_t(t.src[size_t(r)] * T * k + t.slots[size_t(r)]);
  }
  t.d_bases = to_device(bases);
  t.d_src = to_device(t.src);
  t.d_slots = to_device(t.slots);
  t.d_one_slots = to_device(t.one_rank_slots);
  t.d_all = to_device(t.tiles.q);
  t.d_all_s = to_device(t.tiles.scales);
  return t;
}

// At R > 1 the tiles travel: two ranks' staged tiles (bytes [T, cols], then scales) gathered into one
// schedule by each row's source rank, as the same rows' tiles gathered from one rank holding all the
// tokens; then dequantised to bf16 below a row limit, exact (value · power-of-two scale), the rows past
// it untouched. The scales alone pulled likewise; a pulled tile whose scale is NaN reported by both
// gathers, naming its source rank.
TEST_F(Fp8Quantize, RemoteTilesAndTheirDequantisation) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const int64_t T = 40, cols = 320, kb = fp8::blocks_of(cols), k = 2, cap = 128, total = 120;
  // Schedule row r: slot (5r) mod (T·k) of rank r % 2, every seventh a padding row.
  const TwoRankTiles two = two_rank_tiles(T, cols, k, cap, 5, 7, seed);
  const ref::fp8::Quantized& tiles = two.tiles;
  const std::vector<int32_t>& one_rank_slots = two.one_rank_slots;
  const DeviceBuffer &d_slots = two.d_slots, &d_one_slots = two.d_one_slots, &d_all = two.d_all,
                     &d_all_s = two.d_all_s;
  DeviceBuffer d_total = to_device(std::vector<int32_t>{int32_t(total)});
  DeviceBuffer d_gq(size_t(cap * cols)), d_gs(size_t(cap * kb) * 4), d_wq(size_t(cap * cols)), d_ws(size_t(cap * kb) * 4);
  for (DeviceBuffer* d : {&d_gq, &d_gs, &d_wq, &d_ws}) d->fill_bytes(0xFF);
  fp8::gather_tiles(d_gq.as<uint8_t>(), d_gs.as<float>(), nullptr, nullptr, d_slots.as<int32_t>(), d_total.as<int32_t>(),
                    cap, k, cols, nullptr, two.sources(T));
  fp8::gather_tiles(d_wq.as<uint8_t>(), d_ws.as<float>(), d_all.as<uint8_t>(), d_all_s.as<float>(),
                    d_one_slots.as<int32_t>(), d_total.as<int32_t>(), cap, k, cols, nullptr);
  LYNX_TEST_CUDA(cudaDeviceSynchronize());
  EXPECT_TRUE(to_host<uint8_t>(d_gq, size_t(cap * cols)) == to_host<uint8_t>(d_wq, size_t(cap * cols)))
      << "the pulled tiles differ from one rank's";
  const std::vector<float> gs = to_host<float>(d_gs, size_t(cap * kb)), ws = to_host<float>(d_ws, size_t(cap * kb));
  for (int64_t i = 0; i < cap * kb; ++i) {
    if (i < total * kb) {
      ASSERT_EQ(bits(gs[size_t(i)]), bits(ws[size_t(i)])) << "scale " << i;
    } else {
      ASSERT_TRUE(std::isnan(gs[size_t(i)])) << "scale past the schedule written: " << i;
    }
  }
  // The scales alone, pulled (the gate/up GEMM gathering the bytes itself at R > 1): the same bits.
  DeviceBuffer d_ps(size_t(cap * kb) * 4);
  d_ps.fill_bytes(0xFF);
  fp8::gather_tile_scales(d_ps.as<float>(), nullptr, d_slots.as<int32_t>(), d_total.as<int32_t>(), cap, k, cols, nullptr,
                          two.sources(T));
  LYNX_TEST_CUDA(cudaDeviceSynchronize());
  const std::vector<float> ps = to_host<float>(d_ps, size_t(cap * kb));
  for (int64_t i = 0; i < cap * kb; ++i) ASSERT_EQ(bits(ps[size_t(i)]), bits(gs[size_t(i)])) << "pulled scale " << i;
  // Dequantised below a limit of 100 rows, then with no limit over the first `total` rows (the padding
  // rows' zeros among them): every row below the limit exact, none past it written.
  DeviceBuffer d_out(size_t(cap * cols) * 2);
  const auto expect_dequantized = [&](int64_t capacity, const int32_t* d_limit, int64_t limit) {
    SCOPED_TRACE("capacity " + std::to_string(capacity) + (d_limit != nullptr ? ", row limit " : ", no limit ") +
                 std::to_string(limit));
    d_out.fill_bytes(0xFF);
    fp8::dequantize_tiles(d_gq.as<uint8_t>(), d_gs.as<float>(), capacity, cols, d_limit, d_out.as<bf16_t>(), nullptr);
    LYNX_TEST_CUDA(cudaDeviceSynchronize());
    const std::vector<HostBf16> out = to_host<HostBf16>(d_out, size_t(cap * cols));
    for (int64_t r = 0; r < cap; ++r) {
      const int32_t slot = one_rank_slots[size_t(r)];
      for (int64_t c = 0; c < cols; ++c) {
        const HostBf16 got = out[size_t(r * cols + c)];
        if (r >= limit) {
          ASSERT_TRUE(std::isnan(to_double(got))) << "row " << r << " past the limit written";
          continue;
        }
        const float want = slot < 0 ? 0.0f : tiles.dequant(slot / k, c, false);
        ASSERT_EQ(float_to_bf16(want).bits, got.bits) << "row " << r << " column " << c;
        ASSERT_EQ(double(want), to_double(got)) << "not exact: row " << r << " column " << c;
      }
    }
  };
  const int64_t limit = 100;
  DeviceBuffer d_limit = to_device(std::vector<int32_t>{int32_t(limit)});
  expect_dequantized(cap, d_limit.as<int32_t>(), limit);
  expect_dequantized(total, nullptr, total);
  // A tile its source found not finite (a NaN scale; row 3 pulls rank 1's token 7): reported by both
  // gathers, naming the source rank.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  LYNX_TEST_CUDA(cudaMemcpy(static_cast<uint8_t*>(two.staged[1].get()) + T * cols + 4 * (7 * kb + 1), &nan, 4,
                            cudaMemcpyHostToDevice));
  for (const bool scales_alone : {false, true}) {
    SCOPED_TRACE(scales_alone ? "gather_tile_scales" : "gather_tiles");
    DeviceBuffer d_nq(size_t(cap * cols)), d_ns(size_t(cap * kb) * 4);
    DeviceBuffer d_st = to_device(std::vector<DeviceStatus>{DeviceStatus{}});
    const fp8::NonfiniteReport report{nullptr, d_st.as<DeviceStatus>(), int64_t(Fp8Tensor::kX)};
    if (scales_alone) {
      fp8::gather_tile_scales(d_ns.as<float>(), nullptr, d_slots.as<int32_t>(), d_total.as<int32_t>(), cap, k, cols,
                              nullptr, two.sources(T), report);
    } else {
      fp8::gather_tiles(d_nq.as<uint8_t>(), d_ns.as<float>(), nullptr, nullptr, d_slots.as<int32_t>(),
                        d_total.as<int32_t>(), cap, k, cols, nullptr, two.sources(T), report);
    }
    LYNX_TEST_CUDA(cudaDeviceSynchronize());
    const DeviceStatus st = to_host<DeviceStatus>(d_st, 1)[0];
    EXPECT_EQ(st.code, int32_t(StatusCode::kNonFiniteInput));
    EXPECT_EQ(st.a, int64_t(Fp8Tensor::kX));
    EXPECT_EQ(st.rank, 1);
  }
}

// The scales alone over a schedule of more scales than gather_tile_scales has threads (4096 CTAs of 256:
// each thread takes one or two), as a layer's at qwen3-30b-a3b (H = 2048, 16 scales a row): every row's
// its token's, padding rows 1, none past the schedule written.
TEST_F(Fp8Quantize, ScalesOfAScheduleLargerThanTheGridAreGathered) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const int64_t T = 8192, k = 8, cols = 2048, kb = fp8::blocks_of(cols), cap = 75000, total = 72960;
  ASSERT_GT(total * kb, 4096 * 256);
  std::mt19937_64 rng(seed);
  std::vector<float> scales(size_t(T * kb));
  for (float& v : scales) v = std::ldexp(1.0f, int(rng() % 40) - 20);
  std::vector<int32_t> slots(static_cast<size_t>(cap));
  for (int64_t r = 0; r < cap; ++r) slots[size_t(r)] = rng() % 9 == 0 ? -1 : int32_t(rng() % uint64_t(T * k));
  DeviceBuffer d_scales = to_device(scales), d_slots = to_device(slots);
  DeviceBuffer d_total = to_device(std::vector<int32_t>{int32_t(total)}), d_out(size_t(cap * kb) * 4);
  d_out.fill_bytes(0xFF);
  fp8::gather_tile_scales(d_out.as<float>(), d_scales.as<float>(), d_slots.as<int32_t>(), d_total.as<int32_t>(), cap,
                          k, cols, nullptr);
  LYNX_TEST_CUDA(cudaDeviceSynchronize());
  const std::vector<float> out = to_host<float>(d_out, size_t(cap * kb));
  for (int64_t r = 0; r < cap; ++r) {
    for (int64_t b = 0; b < kb; ++b) {
      const float got = out[size_t(r * kb + b)];
      if (r >= total) {
        ASSERT_TRUE(std::isnan(got)) << "row " << r << " past the schedule written";
        continue;
      }
      const int32_t slot = slots[size_t(r)];
      const float want = slot < 0 ? 1.0f : scales[size_t((slot / k) * kb + b)];
      ASSERT_EQ(bits(got), bits(want)) << "row " << r << " scale " << b;
    }
  }
}

// One rank's token tiles gathered into schedule order and dequantised in one pass
// (gather_dequantized_tiles): the bits of dequantize_tiles on the tokens then glue::gather_rows, each
// value exact; zeros in padding rows, nothing written from the schedule's total on, nor anywhere for a
// schedule over capacity. cols a multiple of 128 and not (a last tile of 8 columns).
void expect_gathered_dequantised_tiles_match(int64_t cols, uint64_t seed) {
  SCOPED_TRACE("cols " + std::to_string(cols) + " seed " + std::to_string(seed));
  const int64_t T = 150, k = 2, cap = 384, total = 301;
  // Schedule row r: slot (7r) mod (T·k), every fifth a padding row (one_rank_slots: both ranks' tokens).
  const TwoRankTiles two = two_rank_tiles(T, cols, k, cap, 7, 5, seed);
  const int64_t tokens = 2 * T;
  DeviceBuffer d_total = to_device(std::vector<int32_t>{int32_t(total)});
  DeviceBuffer d_tokens(size_t(tokens * cols) * 2), d_want(size_t(cap * cols) * 2), d_got(size_t(cap * cols) * 2);
  for (DeviceBuffer* d : {&d_tokens, &d_want, &d_got}) d->fill_bytes(0xFF);
  fp8::dequantize_tiles(two.d_all.as<uint8_t>(), two.d_all_s.as<float>(), tokens, cols, nullptr,
                        d_tokens.as<bf16_t>(), nullptr);
  glue::gather_rows(d_want.as<bf16_t>(), d_tokens.as<bf16_t>(), two.d_one_slots.as<int32_t>(), d_total.as<int32_t>(),
                    cap, k, cols, nullptr);
  fp8::gather_dequantized_tiles(two.d_all.as<uint8_t>(), two.d_all_s.as<float>(), two.d_one_slots.as<int32_t>(),
                                d_total.as<int32_t>(), cap, k, cols, d_got.as<bf16_t>(), nullptr);
  LYNX_TEST_CUDA(cudaDeviceSynchronize());
  const std::vector<HostBf16> want = to_host<HostBf16>(d_want, size_t(cap * cols));
  const std::vector<HostBf16> got = to_host<HostBf16>(d_got, size_t(cap * cols));
  for (int64_t r = 0; r < cap; ++r) {
    const int32_t slot = two.one_rank_slots[size_t(r)];
    for (int64_t c = 0; c < cols; ++c) {
      const size_t i = size_t(r * cols + c);
      ASSERT_EQ(got[i].bits, want[i].bits) << "row " << r << " column " << c << " against the two kernels";
      if (r >= total) {
        ASSERT_EQ(got[i].bits, 0xFFFF) << "row " << r << " past the schedule written";
        continue;
      }
      const float value = slot < 0 ? 0.0f : two.tiles.dequant(slot / k, c, false);
      ASSERT_EQ(got[i].bits, float_to_bf16(value).bits) << "row " << r << " column " << c;
      ASSERT_EQ(double(value), to_double(got[i])) << "not exact: row " << r << " column " << c;
    }
  }
  // A schedule over capacity placed no rows: nothing is read or written.
  DeviceBuffer d_over = to_device(std::vector<int32_t>{int32_t(cap + 1)});
  d_got.fill_bytes(0xFF);
  fp8::gather_dequantized_tiles(two.d_all.as<uint8_t>(), two.d_all_s.as<float>(), two.d_one_slots.as<int32_t>(),
                                d_over.as<int32_t>(), cap, k, cols, d_got.as<bf16_t>(), nullptr);
  LYNX_TEST_CUDA(cudaDeviceSynchronize());
  for (const HostBf16 v : to_host<HostBf16>(d_got, size_t(cap * cols))) ASSERT_EQ(v.bits, 0xFFFF) << "written";
}

TEST_F(Fp8Quantize, GatheredDequantisedTilesEqualTheTwoKernels) {
  const auto seed = fresh_seed();
  expect_gathered_dequantised_tiles_match(2048, seed);
  expect_gathered_dequantised_tiles_match(136, seed ^ 1);
}

// The SwiGLU backward tests' inputs: T·k slots, rows [0, cap) of which those below `total` are placed,
// row r on slot (5r) mod (T·k), every seventh row and the last 40 below the total padding rows; da by
// row, g and u by row or (by_slot) by slot; router weights in [0.1, 1).
struct SwigluInputs {
  std::vector<int32_t> slots;
  std::vector<HostBf16> da, g, u;
  std::vector<float> weights;
};
SwigluInputs swiglu_inputs(std::mt19937_64& rng, int64_t I, int64_t T, int64_t k, int64_t cap, int64_t total,
                           bool by_slot) {
  SwigluInputs in;
  in.slots.assign(size_t(cap), -1);
  for (int64_t r = 0; r < total; ++r) in.slots[size_t(r)] = r % 7 == 6 || r >= total - 40 ? -1 : int32_t((5 * r) % (T * k));
  const int64_t gu_rows = by_slot ? T * k : cap;
  in.da = random_bf16(rng, cap * I, 1.0);
  in.g = random_bf16(rng, gu_rows * I, 2.0);
  in.u = random_bf16(rng, gu_rows * I, 1.0);
  in.weights.resize(size_t(T * k));
  for (float& w : in.weights) w = float(std::uniform_real_distribution<double>(0.1, 1.0)(rng));
  return in;
}

// The SwiGLU backward quantising dg | du as it writes them (the FP8 backward where I % 128 == 0): the
// bits quantize_tiles gives from its bf16 dg | du, in every row below the schedule's total (padding rows
// among them: zero codes, scales of 1), nothing past it; g and u at the rows and at their slots; I = 640
// leaves the warps' last step half full. A g that is not finite is reported as dg | du.
void expect_swiglu_codes_match(int64_t I, bool by_slot, uint64_t seed) {
  SCOPED_TRACE("I " + std::to_string(I) + (by_slot ? ", g and u by slot" : ", g and u by row") + ", seed " +
               std::to_string(seed));
  std::mt19937_64 rng(seed);
  const int64_t T = 96, k = 2, cap = 320, total = 256, kb = 2 * I / fp8::kBlock;
  SwigluInputs in = swiglu_inputs(rng, I, T, k, cap, total, by_slot);
  const std::vector<int32_t>& slots = in.slots;
  const std::vector<HostBf16>& da = in.da;
  std::vector<HostBf16>& g = in.g;
  const std::vector<HostBf16>& u = in.u;
  const std::vector<float>& weights = in.weights;
  DeviceBuffer d_slots = to_device(slots), d_total = to_device(std::vector<int32_t>{int32_t(total)}),
               d_w = to_device(weights), d_g = to_device(g), d_u = to_device(u);
  struct Run {
    std::vector<HostBf16> dgu;
    std::vector<uint8_t> q;
    std::vector<float> s;
    DeviceStatus status;
  };
  const auto run = [&](bool fused) {
    DeviceBuffer d_da = to_device(da), d_dgu(size_t(cap * 2 * I) * 2), d_q(size_t(cap * 2 * I)),
                 d_s(size_t(cap * kb) * 4), d_dtopk(size_t(T * k) * 4);
    DeviceBuffer d_status = to_device(std::vector<DeviceStatus>{DeviceStatus{}});
    d_dgu.fill_bytes(0xFF);
    d_q.fill_bytes(0x7F);
    d_s.fill_bytes(0xFF);
    const fp8::NonfiniteReport report{nullptr, d_status.as<DeviceStatus>(), int64_t(Fp8Tensor::kDgu)};
    glue::QuantizedDgu codes;
    if (fused) codes = {d_q.as<uint8_t>(), d_s.as<float>(), report};
    bf16_t* dgu = d_dgu.as<bf16_t>();
    glue::swiglu_backward(dgu, dgu + I, 2 * I, nullptr, d_dtopk.as<float>(), d_da.as<bf16_t>(), d_g.as<bf16_t>(),
                          d_u.as<bf16_t>(), d_w.as<float>(), d_slots.as<int32_t>(), d_total.as<int32_t>(), cap, I,
                          nullptr, {}, by_slot, true, codes);
    if (!fused) {
      fp8::quantize_tiles(dgu, cap, 2 * I, d_total.as<int32_t>(), d_q.as<uint8_t>(), d_s.as<float>(), report, nullptr);
    }
    LYNX_TEST_CUDA(cudaDeviceSynchronize());
    return Run{to_host<HostBf16>(d_dgu, size_t(cap * 2 * I)), to_host<uint8_t>(d_q, size_t(cap * 2 * I)),
               to_host<float>(d_s, size_t(cap * kb)), to_host<DeviceStatus>(d_status, 1)[0]};
  };
  const Run want = run(false), got = run(true);
  EXPECT_EQ(got.status.code, int32_t(StatusCode::kOk));
  for (int64_t r = 0; r < cap; ++r) {
    for (int64_t c = 0; c < 2 * I; ++c) {
      const size_t i = size_t(r * 2 * I + c);
      ASSERT_EQ(got.dgu[i].bits, want.dgu[i].bits) << "dg | du[" << r << ", " << c << "]";
      ASSERT_EQ(got.q[i], want.q[i]) << "code [" << r << ", " << c << "]";
      if (r >= total) {
        ASSERT_EQ(got.q[i], 0x7F) << "code [" << r << ", " << c << "] past the total written";
      } else if (slots[size_t(r)] < 0) {
        ASSERT_EQ(got.q[i], 0) << "padding row " << r;
      }
    }
    for (int64_t b = 0; b < kb; ++b) {
      const size_t i = size_t(r * kb + b);
      ASSERT_EQ(bits(got.s[i]), bits(want.s[i])) << "scale [" << r << ", " << b << "]";
      if (r >= total) {
        ASSERT_EQ(bits(got.s[i]), 0xFFFFFFFFu) << "scale of row " << r << " past the total written";
      } else if (slots[size_t(r)] < 0) {
        ASSERT_EQ(got.s[i], 1.0f) << "padding row " << r;
      }
    }
  }
  // An infinity in g of a row's vector: reported, naming dg | du, every scale as quantize_tiles gives it
  // (a NaN for the tiles that are not finite) and the codes of every finite tile.
  const int64_t bad_row = 3;
  g[size_t((by_slot ? slots[bad_row] : bad_row) * I + 17)] = float_to_bf16(std::numeric_limits<float>::infinity());
  upload(d_g.get(), g.data(), g.size() * 2);
  const Run bad_want = run(false), bad = run(true);
  EXPECT_EQ(bad.status.code, int32_t(StatusCode::kNonFiniteInput));
  EXPECT_EQ(bad.status.a, int64_t(Fp8Tensor::kDgu));
  int64_t nan_scales = 0;
  for (int64_t i = 0; i < cap * kb; ++i) {
    ASSERT_EQ(bits(bad.s[size_t(i)]), bits(bad_want.s[size_t(i)])) << "scale " << i << " with an infinity in g";
    if (std::isnan(bad.s[size_t(i)]) && i / kb < total) ++nan_scales;
  }
  EXPECT_GT(nan_scales, 0) << "no tile's scale marks the infinity";
  for (int64_t r = 0; r < total; ++r) {
    for (int64_t c = 0; c < 2 * I; ++c) {
      if (std::isnan(bad.s[size_t(r * kb + c / fp8::kBlock)])) continue;  // that tile's codes are unspecified
      ASSERT_EQ(bad.q[size_t(r * 2 * I + c)], bad_want.q[size_t(r * 2 * I + c)]) << "code [" << r << ", " << c << "]";
    }
  }
}

TEST_F(Fp8Quantize, SwigluBackwardCodesEqualQuantizeTiles) {
  const auto seed = fresh_seed();
  expect_swiglu_codes_match(256, true, seed);
  expect_swiglu_codes_match(640, false, seed ^ 1);
}

// One rank's SwiGLU backward for FP8 weight gradients in one pass (glue::swiglu_backward_fp8): the bits of
// swiglu_backward with row codes, then transpose_tiles of its bf16 dg | du and hw: row codes and scales,
// transposed codes and scales, d_topk_weights; every byte of every output compared, the 128-row block
// past the schedule's total left as it was by both; g and u at the rows and at their slots; I = 128
// (one step), 384 (three: d_topk_weights' running sums over steps of both parities) and 640. An
// infinity in g: reported first as dg | du's, as the two kernels report it, the scales alike.
void expect_swiglu_transposed_match(int64_t I, bool by_slot, uint64_t seed) {
  SCOPED_TRACE("I " + std::to_string(I) + (by_slot ? ", g and u by slot" : ", g and u by row") + ", seed " +
               std::to_string(seed));
  std::mt19937_64 rng(seed);
  // T·k = 256 slots, so that (5r) mod 256 gives each row below the total a slot of its own (two rows on
  // one slot would each write its d_topk_weights there, in either order).
  const int64_t T = 128, k = 2, cap = 384, total = 256, kb = 2 * I / fp8::kBlock;
  const int64_t pitch2 = fp8::scale_pitch(2 * I), pitch1 = fp8::scale_pitch(I), blocks = cap / fp8::kBlock;
  SwigluInputs in = swiglu_inputs(rng, I, T, k, cap, total, by_slot);
  const std::vector<int32_t>& slots = in.slots;
  std::vector<HostBf16>& g = in.g;
  DeviceBuffer d_slots = to_device(slots), d_total = to_device(std::vector<int32_t>{int32_t(total)}),
               d_w = to_device(in.weights), d_da = to_device(in.da), d_u = to_device(in.u);
  struct Run {
    std::vector<uint8_t> q, dgu_t, hw_t;
    std::vector<float> s, dgu_t_s, hw_t_s, d_topk;
    DeviceStatus status;
  };
  const auto run = [&](bool one_pass) {
    DeviceBuffer d_g = to_device(g), d_dgu(size_t(cap * 2 * I) * 2), d_hw(size_t(cap * I) * 2),
                 d_q(size_t(cap * 2 * I)), d_s(size_t(cap * kb) * 4), d_dgu_t(size_t(2 * I * cap)),
                 d_dgu_t_s(size_t(blocks * pitch2) * 4), d_hw_t(size_t(I * cap)), d_hw_t_s(size_t(blocks * pitch1) * 4),
                 d_dtopk(size_t(T * k) * 4);
    DeviceBuffer d_status = to_device(std::vector<DeviceStatus>{DeviceStatus{}});
    for (DeviceBuffer* b : {&d_q, &d_dgu_t, &d_hw_t}) b->fill_bytes(0x7F);
    for (DeviceBuffer* b : {&d_s, &d_dgu_t_s, &d_hw_t_s, &d_dtopk}) b->fill_bytes(0xFF);
    const auto report = [&](Fp8Tensor what) {
      return fp8::NonfiniteReport{nullptr, d_status.as<DeviceStatus>(), int64_t(what)};
    };
    const glue::QuantizedDgu codes{d_q.as<uint8_t>(), d_s.as<float>(), report(Fp8Tensor::kDgu)};
    const glue::TransposedCodes dgu_t{d_dgu_t.as<uint8_t>(), d_dgu_t_s.as<float>(), report(Fp8Tensor::kDgu)};
    const glue::TransposedCodes hw_t{d_hw_t.as<uint8_t>(), d_hw_t_s.as<float>(), report(Fp8Tensor::kH)};
    if (one_pass) {
      glue::swiglu_backward_fp8(d_dtopk.as<float>(), d_da.as<bf16_t>(), d_g.as<bf16_t>(), d_u.as<bf16_t>(),
                                d_w.as<float>(), d_slots.as<int32_t>(), d_total.as<int32_t>(), cap, I, by_slot, codes,
                                dgu_t, hw_t, nullptr);
    } else {
      bf16_t* dgu = d_dgu.as<bf16_t>();
      glue::swiglu_backward(dgu, dgu + I, 2 * I, d_hw.as<bf16_t>(), d_dtopk.as<float>(), d_da.as<bf16_t>(),
                            d_g.as<bf16_t>(), d_u.as<bf16_t>(), d_w.as<float>(), d_slots.as<int32_t>(),
                            d_total.as<int32_t>(), cap, I, nullptr, {}, by_slot, true, codes);
      fp8::transpose_tiles(dgu, cap, 2 * I, d_total.as<int32_t>(), dgu_t.q, dgu_t.scales, dgu_t.report, nullptr);
      fp8::transpose_tiles(d_hw.as<bf16_t>(), cap, I, d_total.as<int32_t>(), hw_t.q, hw_t.scales, hw_t.report,
                           nullptr);
    }
    LYNX_TEST_CUDA(cudaDeviceSynchronize());
    return Run{to_host<uint8_t>(d_q, size_t(cap * 2 * I)),         to_host<uint8_t>(d_dgu_t, size_t(2 * I * cap)),
               to_host<uint8_t>(d_hw_t, size_t(I * cap)),           to_host<float>(d_s, size_t(cap * kb)),
               to_host<float>(d_dgu_t_s, size_t(blocks * pitch2)), to_host<float>(d_hw_t_s, size_t(blocks * pitch1)),
               to_host<float>(d_dtopk, size_t(T * k)),              to_host<DeviceStatus>(d_status, 1)[0]};
  };
  const auto expect_bytes = [](const std::vector<uint8_t>& got, const std::vector<uint8_t>& want, const char* what) {
    for (size_t i = 0; i < want.size(); ++i) ASSERT_EQ(got[i], want[i]) << what << " byte " << i;
  };
  const auto expect_floats = [](const std::vector<float>& got, const std::vector<float>& want, const char* what) {
    for (size_t i = 0; i < want.size(); ++i) ASSERT_EQ(bits(got[i]), bits(want[i])) << what << " " << i;
  };
  const Run want = run(false), got = run(true);
  EXPECT_EQ(want.status.code, int32_t(StatusCode::kOk));
  EXPECT_EQ(got.status.code, int32_t(StatusCode::kOk));
  expect_bytes(got.q, want.q, "row code");
  expect_floats(got.s, want.s, "row scale");
  expect_bytes(got.dgu_t, want.dgu_t, "dg | du transposed code");
  expect_floats(got.dgu_t_s, want.dgu_t_s, "dg | du transposed scale");
  expect_bytes(got.hw_t, want.hw_t, "hw transposed code");
  expect_floats(got.hw_t_s, want.hw_t_s, "hw transposed scale");
  expect_floats(got.d_topk, want.d_topk, "d_topk_weights");
  // Something was written, and the block past the total was not.
  EXPECT_NE(got.dgu_t[0], 0x7F);
  EXPECT_EQ(got.dgu_t[size_t(total)], 0x7F) << "column past the total written";
  EXPECT_EQ(bits(got.hw_t_s[size_t(2 * pitch1)]), 0xFFFFFFFFu) << "the third row block's scale written";
  EXPECT_NE(bits(got.d_topk[5]), 0xFFFFFFFFu) << "row 1's slot 5: no d_topk_weights";

  const int64_t bad_row = 3;
  g[size_t((by_slot ? slots[bad_row] : bad_row) * I + 17)] = float_to_bf16(std::numeric_limits<float>::infinity());
  const Run bad_want = run(false), bad = run(true);
  EXPECT_EQ(bad_want.status.code, int32_t(StatusCode::kNonFiniteInput));
  EXPECT_EQ(bad.status.code, int32_t(StatusCode::kNonFiniteInput));
  EXPECT_EQ(bad.status.a, int64_t(Fp8Tensor::kDgu));
  expect_floats(bad.s, bad_want.s, "row scale with an infinity in g");
  expect_floats(bad.dgu_t_s, bad_want.dgu_t_s, "dg | du transposed scale with an infinity in g");
  expect_floats(bad.hw_t_s, bad_want.hw_t_s, "hw transposed scale with an infinity in g");
  EXPECT_TRUE(std::isnan(bad.hw_t_s[size_t(17)])) << "hw's column 17 over rows 0-127 holds the infinity";
}

TEST_F(Fp8Quantize, SwigluBackwardInOnePassEqualsTheKernelsApart) {
  const auto seed = fresh_seed();
  expect_swiglu_transposed_match(128, true, seed);
  expect_swiglu_transposed_match(384, false, seed ^ 1);
  expect_swiglu_transposed_match(640, true, seed ^ 2);
}

// The weight gradients' operands straight from one rank's token tiles (transpose_gathered_tiles): the
// bits of gathering, dequantising and transpose_tiles in turn; rows of `cols` a multiple of 4 (4-byte
// loads) and not; whole 128-row blocks below the schedule's total (padding rows among them), the block
// past it not written. The gathered tiles it keeps on request: gather_tiles' bytes and scales, the rows
// past the total not written.
void expect_transposed_gathered_tiles_match(int64_t cols, uint64_t seed) {
  SCOPED_TRACE("cols " + std::to_string(cols) + " seed " + std::to_string(seed));
  const int64_t T = 150, k = 2, cap = 384, total = 256, pitch = fp8::scale_pitch(cols);
  // Schedule row r: slot (7r) mod (T·k) of rank r % 2, every fifth a padding row.
  const TwoRankTiles two = two_rank_tiles(T, cols, k, cap, 7, 5, seed);
  const DeviceBuffer &d_one_slots = two.d_one_slots, &d_all = two.d_all, &d_all_s = two.d_all_s;
  DeviceBuffer d_total = to_device(std::vector<int32_t>{int32_t(total)});
  // The path through bf16 rows: the gathered tiles dequantised (RemoteTilesAndTheirDequantisation shows
  // gather_tiles and dequantize_tiles give these bits; dequantize_tiles itself takes cols % 8 == 0 only).
  std::vector<HostBf16> rows(size_t(cap * cols), float_to_bf16(0.0f));
  for (int64_t r = 0; r < total; ++r) {
    const int32_t slot = two.one_rank_slots[size_t(r)];
    if (slot < 0) continue;
    for (int64_t c = 0; c < cols; ++c) {
      rows[size_t(r * cols + c)] = float_to_bf16(two.tiles.dequant(slot / k, c, false));
    }
  }
  DeviceBuffer d_rows = to_device(rows);
  struct Out {
    DeviceBuffer q, s;
  };
  // Poisoned outputs of `scales` floats: transposed ([cap / 128, pitch]) or gathered ([cap, kb]).
  const int64_t kb = fp8::blocks_of(cols);
  const auto make_out = [&](int64_t scales) {
    Out o{DeviceBuffer(size_t(cols * cap)), DeviceBuffer(size_t(scales) * 4)};
    o.q.fill_bytes(0xFF);
    o.s.fill_bytes(0xFF);
    return o;
  };
  Out want = make_out(cap / 128 * pitch), got = make_out(cap / 128 * pitch), got_keeping = make_out(cap / 128 * pitch);
  Out gathered = make_out(cap * kb), kept = make_out(cap * kb);
  fp8::transpose_tiles(d_rows.as<bf16_t>(), cap, cols, d_total.as<int32_t>(), want.q.as<uint8_t>(), want.s.as<float>(),
                       {}, nullptr);
  fp8::transpose_gathered_tiles(d_all.as<uint8_t>(), d_all_s.as<float>(), d_one_slots.as<int32_t>(),
                                d_total.as<int32_t>(), cap, k, cols, got.q.as<uint8_t>(), got.s.as<float>(), {},
                                nullptr);
  fp8::gather_tiles(gathered.q.as<uint8_t>(), gathered.s.as<float>(), d_all.as<uint8_t>(), d_all_s.as<float>(),
                    d_one_slots.as<int32_t>(), d_total.as<int32_t>(), cap, k, cols, nullptr);
  fp8::transpose_gathered_tiles(d_all.as<uint8_t>(), d_all_s.as<float>(), d_one_slots.as<int32_t>(),
                                d_total.as<int32_t>(), cap, k, cols, got_keeping.q.as<uint8_t>(),
                                got_keeping.s.as<float>(), {}, nullptr,
                                {kept.q.as<uint8_t>(), kept.s.as<float>()});
  LYNX_TEST_CUDA(cudaDeviceSynchronize());
  // Keeping the gathered tiles changes nothing of the transposed ones; those kept are gather_tiles'.
  EXPECT_EQ(to_host<uint8_t>(got_keeping.q, size_t(cols * cap)), to_host<uint8_t>(got.q, size_t(cols * cap)));
  const std::vector<float> keeping_s = to_host<float>(got_keeping.s, size_t(cap / 128 * pitch));
  const std::vector<float> plain_s = to_host<float>(got.s, size_t(cap / 128 * pitch));
  for (size_t i = 0; i < plain_s.size(); ++i) ASSERT_EQ(bits(keeping_s[i]), bits(plain_s[i])) << "scale " << i;
  const std::vector<uint8_t> gq = to_host<uint8_t>(gathered.q, size_t(cap * cols));
  const std::vector<uint8_t> kq = to_host<uint8_t>(kept.q, size_t(cap * cols));
  const std::vector<float> gs = to_host<float>(gathered.s, size_t(cap * kb));
  const std::vector<float> ks = to_host<float>(kept.s, size_t(cap * kb));
  // Each kept row: its token's tile (the host's quantisation), zeros and scales of 1 for a padding row,
  // the poison past the total; and gather_tiles' bits wherever it wrote.
  for (int64_t r = 0; r < cap; ++r) {
    const int32_t slot = two.one_rank_slots[size_t(r)];
    const int64_t token = slot < 0 ? -1 : slot / k;
    for (int64_t c = 0; c < cols; ++c) {
      const size_t i = size_t(r * cols + c);
      const uint8_t expected = r >= total ? 0xFF : token < 0 ? 0 : two.tiles.q[size_t(token * cols + c)];
      ASSERT_EQ(kq[i], expected) << "kept tile byte of row " << r << " column " << c;
      ASSERT_EQ(kq[i], gq[i]) << "kept tile byte of row " << r << " column " << c << " against gather_tiles";
    }
    for (int64_t b = 0; b < kb; ++b) {
      const size_t i = size_t(r * kb + b);
      const uint32_t expected = r >= total ? 0xFFFFFFFFu : token < 0 ? bits(1.0f)
                                                                     : bits(two.tiles.scales[size_t(token * kb + b)]);
      ASSERT_EQ(bits(ks[i]), expected) << "kept scale of row " << r << " block " << b;
      ASSERT_EQ(bits(ks[i]), bits(gs[i])) << "kept scale of row " << r << " block " << b << " against gather_tiles";
    }
  }
  const std::vector<uint8_t> wq = to_host<uint8_t>(want.q, size_t(cols * cap));
  const std::vector<float> ws = to_host<float>(want.s, size_t(cap / 128 * pitch));
  const std::vector<uint8_t> q = to_host<uint8_t>(got.q, size_t(cols * cap));
  const std::vector<float> sc = to_host<float>(got.s, size_t(cap / 128 * pitch));
  for (int64_t c = 0; c < cols; ++c) {
    for (int64_t r = 0; r < cap; ++r) {
      if (r >= total) {
        ASSERT_EQ(q[size_t(c * cap + r)], 0xFF) << "q[" << c << ", " << r << "] past the schedule written";
      } else {
        ASSERT_EQ(q[size_t(c * cap + r)], wq[size_t(c * cap + r)]) << "q[" << c << ", " << r << "]";
      }
    }
  }
  for (int64_t b = 0; b < cap / 128; ++b) {
    for (int64_t c = 0; c < cols; ++c) {
      const size_t i = size_t(b * pitch + c);
      ASSERT_EQ(bits(sc[i]), bits(ws[i])) << "scale of row block " << b << " column " << c;
      if (b * 128 >= total) {
        ASSERT_EQ(bits(sc[i]), 0xFFFFFFFFu) << "a scale past the schedule written";
      }
    }
  }
}

TEST_F(Fp8Quantize, TransposedGatheredTilesEqualThePathThroughBf16) {
  const auto seed = fresh_seed();
  expect_transposed_gathered_tiles_match(320, seed);
  expect_transposed_gathered_tiles_match(130, seed ^ 1);  // rows not a multiple of 4: one byte at a time
  // Kept tiles need their bytes and their scales: one without the other is refused before launch.
  DeviceBuffer d(size_t(4096));
  DeviceBuffer d_total = to_device(std::vector<int32_t>{128});
  for (const bool bytes_only : {true, false}) {
    const fp8::GatheredTiles half{bytes_only ? d.as<uint8_t>() : nullptr, bytes_only ? nullptr : d.as<float>()};
    EXPECT_THROW(fp8::transpose_gathered_tiles(d.as<uint8_t>(), d.as<float>(), d_total.as<int32_t>(),
                                               d_total.as<int32_t>(), 128, 1, 8, d.as<uint8_t>(), d.as<float>(), {},
                                               nullptr, half),
                 Error)
        << (bytes_only ? "bytes without scales" : "scales without bytes");
  }
}

// A token's tile with a NaN scale (its source found a NaN or an infinity), gathered by
// transpose_gathered_tiles at top-3 into every row block: reported, and each transposed tile whose rows
// hold that token in that column block gets a NaN scale; every other keeps the codes and scale of the
// run without it.
TEST_F(Fp8Quantize, TransposedGatheredTilesReportANonFiniteTile) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const int64_t T = 150, k = 3, cap = 384, cols = 320, kb = fp8::blocks_of(cols), pitch = fp8::scale_pitch(cols);
  // Schedule row r: slot (7r) mod (T·k) of rank r % 2, every fifth a padding row; every row block placed.
  const TwoRankTiles two = two_rank_tiles(T, cols, k, cap, 7, 5, seed);
  const int32_t bad_token = two.one_rank_slots[5] / int32_t(k);
  const int64_t bad_block = 1;  // columns 128-255
  std::vector<float> bad_scales = two.tiles.scales;
  bad_scales[size_t(bad_token * kb + bad_block)] = std::numeric_limits<float>::quiet_NaN();
  DeviceBuffer d_bad_s = to_device(bad_scales), d_total = to_device(std::vector<int32_t>{int32_t(cap)});
  struct Out {
    std::vector<uint8_t> q;
    std::vector<float> s;
    int32_t flag;
  };
  const auto run = [&](const DeviceBuffer& scales) {
    DeviceBuffer d_q(size_t(cols * cap)), d_s(size_t(cap / 128 * pitch) * 4);
    DeviceBuffer d_flag = to_device(std::vector<int32_t>{0});
    d_q.fill_bytes(0xFF);
    d_s.fill_bytes(0xFF);
    fp8::transpose_gathered_tiles(two.d_all.as<uint8_t>(), scales.as<float>(), two.d_one_slots.as<int32_t>(),
                                  d_total.as<int32_t>(), cap, k, cols, d_q.as<uint8_t>(), d_s.as<float>(),
                                  fp8::NonfiniteReport{d_flag.as<int32_t>()}, nullptr);
    LYNX_TEST_CUDA(cudaDeviceSynchronize());
    return Out{to_host<uint8_t>(d_q, size_t(cols * cap)), to_host<float>(d_s, size_t(cap / 128 * pitch)),
               to_host<int32_t>(d_flag, 1)[0]};
  };
  const Out clean = run(two.d_all_s), bad = run(d_bad_s);
  EXPECT_EQ(clean.flag, 0);
  EXPECT_EQ(bad.flag, 1);
  int64_t nan_scales = 0;
  for (int64_t b = 0; b < cap / 128; ++b) {
    bool holds = false;  // a row of block b is the bad token's
    for (int64_t r = 128 * b; r < 128 * (b + 1); ++r) {
      const int32_t slot = two.one_rank_slots[size_t(r)];
      holds |= slot >= 0 && slot / int32_t(k) == bad_token;
    }
    for (int64_t c = 0; c < cols; ++c) {
      const size_t i = size_t(b * pitch + c);
      if (holds && c / 128 == bad_block) {
        ASSERT_TRUE(std::isnan(bad.s[i])) << "scale of row block " << b << " column " << c;
        ++nan_scales;
        continue;
      }
      ASSERT_EQ(bits(bad.s[i]), bits(clean.s[i])) << "scale of row block " << b << " column " << c;
      for (int64_t r = 128 * b; r < 128 * (b + 1); ++r) {
        ASSERT_EQ(bad.q[size_t(c * cap + r)], clean.q[size_t(c * cap + r)]) << "q[" << c << ", " << r << "]";
      }
    }
  }
  EXPECT_EQ(nan_scales % 128, 0);
  EXPECT_GT(nan_scales, 0);
}

// Matrix m of the transposed pair [rows, n0 + n1] of sources [batch, n0, rows] and [batch, n1, rows]:
// t(r, c) = src0[m][c][r] for c < n0, src1[m][c − n0][r] otherwise.
std::vector<float> transposed_matrix(const std::vector<float>& src0, const std::vector<float>& src1, int64_t m,
                                     int64_t n0, int64_t n1, int64_t rows) {
  const int64_t cols = n0 + n1;
  std::vector<float> t(size_t(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      t[size_t(r * cols + c)] = c < n0 ? src0[size_t((m * n0 + c) * rows + r)] : src1[size_t((m * n1 + c - n0) * rows + r)];
    }
  }
  return t;
}

// The dgrad GEMMs' transposed weights: w_downᵀ (one source) and [w_gate; w_up]ᵀ (two, here of 200 rows
// each: a block straddles them) against quantize_blocks of the transposed matrix, bit for bit; from bf16
// sources and from E4M3 ones with their block scales (quantize_blocks_transposed_fp8, whose values are
// the sources dequantised), with the source rows' length a multiple of 8 (8 values a load) and not.
TEST_F(Fp8Quantize, TransposedBlocksEqualTheReference) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const int64_t batch = 2, n = 200;  // sources [batch, n, rows]
  for (const int64_t rows : {int64_t(320), int64_t(130)}) {
    const std::vector<HostBf16> a = spread_values(batch * n, rows, 6, seed ^ uint64_t(rows)),
                                b = spread_values(batch * n, rows, 6, seed ^ uint64_t(rows) ^ 2);
    const std::vector<float> af = to_floats(a), bf = to_floats(b);
    // The E4M3 sources: each matrix of a and b quantised in blocks by the reference.
    const int64_t source_scales = fp8::blocks_of(n) * fp8::blocks_of(rows);
    std::vector<uint8_t> aq, bq;
    std::vector<float> as, bs, adq(af.size()), bdq(bf.size());
    for (int64_t m = 0; m < batch; ++m) {
      for (const bool second : {false, true}) {
        std::vector<uint8_t>& codes = second ? bq : aq;
        std::vector<float>& scales = second ? bs : as;
        std::vector<float>& values = second ? bdq : adq;
        const ref::fp8::Quantized qm = ref::fp8::quantize_blocks((second ? bf : af).data() + m * n * rows, n, rows);
        codes.insert(codes.end(), qm.q.begin(), qm.q.end());
        scales.insert(scales.end(), qm.scales.begin(), qm.scales.end());
        for (int64_t i = 0; i < n * rows; ++i) values[size_t(m * n * rows + i)] = qm.dequant(i / rows, i % rows, true);
      }
    }
    ASSERT_EQ(as.size(), size_t(batch * source_scales));
    DeviceBuffer d_a = to_device(a), d_b = to_device(b), d_aq = to_device(aq), d_bq = to_device(bq);
    DeviceBuffer d_as = to_device(as), d_bs = to_device(bs);
    for (const bool fp8_source : {false, true}) {
      for (const bool two : {false, true}) {
        const std::string what = std::string(fp8_source ? "E4M3" : "bf16") + (two ? ", two sources" : ", one source") +
                                 ", rows " + std::to_string(rows);
        const int64_t cols = two ? 2 * n : n;
        const int64_t n_scales = fp8::blocks_of(rows) * fp8::blocks_of(cols);
        DeviceBuffer d_q(size_t(batch * rows * cols)), d_s(size_t(batch * n_scales) * 4);
        d_q.fill_bytes(0x7F);
        d_s.fill_bytes(0xFF);
        if (fp8_source) {
          fp8::quantize_blocks_transposed_fp8(d_aq.as<uint8_t>(), d_as.as<float>(), n, two ? d_bq.as<uint8_t>() : nullptr,
                                              two ? d_bs.as<float>() : nullptr, two ? n : 0, batch, rows,
                                              d_q.as<uint8_t>(), d_s.as<float>(), {}, nullptr);
        } else {
          fp8::quantize_blocks_transposed(d_a.as<bf16_t>(), n, two ? d_b.as<bf16_t>() : nullptr, two ? n : 0, batch,
                                          rows, d_q.as<uint8_t>(), d_s.as<float>(), {}, nullptr);
        }
        LYNX_TEST_CUDA(cudaDeviceSynchronize());
        const std::vector<uint8_t> q = to_host<uint8_t>(d_q, size_t(batch * rows * cols));
        const std::vector<float> sc = to_host<float>(d_s, size_t(batch * n_scales));
        const std::vector<float>& a_values = fp8_source ? adq : af;
        const std::vector<float>& b_values = fp8_source ? bdq : bf;
        for (int64_t m = 0; m < batch; ++m) {
          const std::vector<float> t = transposed_matrix(a_values, b_values, m, n, cols - n, rows);
          const ref::fp8::Quantized want = ref::fp8::quantize_blocks(t.data(), rows, cols);
          expect_codes_and_scales({q.begin() + m * rows * cols, q.begin() + (m + 1) * rows * cols},
                                  {sc.begin() + m * n_scales, sc.begin() + (m + 1) * n_scales}, want,
                                  what + ", matrix " + std::to_string(m));
        }
      }
    }
  }
}

// Bytes (and scales) past each output of the block forms' tests, never written.
constexpr int64_t kCanary = 64;

// An output fetched with its surroundings (q poisoned with 0x7F, scales with NaN): nothing written in
// the q_offset bytes before its `bytes`, nor in the kCanary bytes and scales past them and its `scales`.
void expect_canaries(const std::vector<uint8_t>& q, const std::vector<float>& sc, int64_t q_offset, int64_t bytes,
                     int64_t scales, const std::string& what) {
  for (int64_t i = 0; i < q_offset; ++i) ASSERT_EQ(q[size_t(i)], 0x7F) << what << ": written before it, " << i;
  for (int64_t i = 0; i < kCanary; ++i) {
    ASSERT_EQ(q[size_t(q_offset + bytes + i)], 0x7F) << what << ": written past it, " << i;
    ASSERT_TRUE(std::isnan(sc[size_t(scales + i)])) << what << ": written past its scales, " << i;
  }
}

// quantize_blocks_transposed(_fp8) of `batch` matrices from sources [batch, n0, rows] and [batch, n1,
// rows] (n1 = 0: one), the sources `src_offset` values and q `q_offset` bytes past aligned addresses,
// against quantize_blocks of the transposed matrix bit for bit, nothing written before q. E4M3
// sources: the reference's blocks of fresh values, each block's scale times 1 + (i % 5) / π (block i),
// so mostly not a power of two: the values, code · scale in fp32, then round.
void expect_transposed_blocks_match(bool fp8_source, int64_t batch, int64_t n0, int64_t n1, int64_t rows,
                                    int64_t src_offset, int64_t q_offset) {
  const auto seed = fresh_seed();
  const int64_t cols = n0 + n1;
  SCOPED_TRACE(std::string(fp8_source ? "E4M3" : "bf16") + " sources " + std::to_string(n0) + " + " +
               std::to_string(n1) + " of " + std::to_string(rows) + ", batch " + std::to_string(batch) +
               ", offsets " + std::to_string(src_offset) + " / " + std::to_string(q_offset) + " seed " +
               std::to_string(seed));
  std::vector<float> values[2];  // each source's [batch, n, rows]
  DeviceBuffer d_src[2], d_src_scales[2];
  for (int k = 0; k < 2; ++k) {
    const int64_t n = k == 0 ? n0 : n1;
    if (n == 0) continue;
    const std::vector<HostBf16> x = spread_values(batch * n, rows, 6, seed ^ uint64_t(k));
    if (!fp8_source) {
      values[k] = to_floats(x);
      std::vector<HostBf16> shifted(size_t(src_offset), float_to_bf16(0.0f));
      shifted.insert(shifted.end(), x.begin(), x.end());
      d_src[k] = to_device(shifted);
      continue;
    }
    const std::vector<float> xf = to_floats(x);
    std::vector<uint8_t> codes(size_t(src_offset), 0);
    std::vector<float> scales;
    for (int64_t m = 0; m < batch; ++m) {
      const ref::fp8::Quantized qm = ref::fp8::quantize_blocks(xf.data() + m * n * rows, n, rows);
      codes.insert(codes.end(), qm.q.begin(), qm.q.end());
      scales.insert(scales.end(), qm.scales.begin(), qm.scales.end());
    }
    for (size_t i = 0; i < scales.size(); ++i) scales[i] *= 1.0f + float(i % 5) / 3.14159265f;
    const int64_t per_matrix = fp8::blocks_of(n) * fp8::blocks_of(rows);
    values[k].resize(size_t(batch * n * rows));
    for (int64_t m = 0; m < batch; ++m) {
      for (int64_t c = 0; c < n; ++c) {
        for (int64_t r = 0; r < rows; ++r) {
          const size_t i = size_t((m * n + c) * rows + r);
          const float s = scales[size_t(m * per_matrix + (c / fp8::kBlock) * fp8::blocks_of(rows) + r / fp8::kBlock)];
          values[k][i] = ref::fp8::from_e4m3(codes[size_t(src_offset) + i]) * s;
        }
      }
    }
    d_src[k] = to_device(codes);
    d_src_scales[k] = to_device(scales);
  }
  const int64_t n_scales = fp8::blocks_of(rows) * fp8::blocks_of(cols);
  DeviceBuffer d_q(size_t(batch * rows * cols + q_offset + kCanary)), d_s(size_t(batch * n_scales + kCanary) * 4);
  d_q.fill_bytes(0x7F);
  d_s.fill_bytes(0xFF);
  uint8_t* qp = d_q.as<uint8_t>() + q_offset;
  if (fp8_source) {
    fp8::quantize_blocks_transposed_fp8(d_src[0].as<uint8_t>() + src_offset, d_src_scales[0].as<float>(), n0,
                                        n1 > 0 ? d_src[1].as<uint8_t>() + src_offset : nullptr,
                                        d_src_scales[1].as<float>(), n1, batch, rows, qp, d_s.as<float>(), {},
                                        nullptr);
  } else {
    fp8::quantize_blocks_transposed(d_src[0].as<bf16_t>() + src_offset, n0,
                                    n1 > 0 ? d_src[1].as<bf16_t>() + src_offset : nullptr, n1, batch, rows, qp,
                                    d_s.as<float>(), {}, nullptr);
  }
  LYNX_TEST_CUDA(cudaDeviceSynchronize());
  const std::vector<uint8_t> q = to_host<uint8_t>(d_q, size_t(batch * rows * cols + q_offset + kCanary));
  const std::vector<float> sc = to_host<float>(d_s, size_t(batch * n_scales + kCanary));
  ASSERT_NO_FATAL_FAILURE(expect_canaries(q, sc, q_offset, batch * rows * cols, batch * n_scales, "q"));
  for (int64_t m = 0; m < batch; ++m) {
    const std::vector<float> t = transposed_matrix(values[0], values[1], m, n0, n1, rows);
    const ref::fp8::Quantized want = ref::fp8::quantize_blocks(t.data(), rows, cols);
    ASSERT_TRUE(want.finite);
    const auto at = q.begin() + q_offset + m * rows * cols;
    expect_codes_and_scales({at, at + rows * cols}, {sc.begin() + m * n_scales, sc.begin() + (m + 1) * n_scales},
                            want, "matrix " + std::to_string(m));
  }
}

// The transposed forms' load and store paths: sources of 8-value multiples, aligned (8 values a load)
// or not (one at a time), rows % 8 == 4; q's rows of 16-byte multiples, aligned (16 bytes a store) or
// not (one byte at a time); blocks straddling sources of 200 and 136 (n0 % 128 != 0) whose second
// source's blocks (from 56 on) split a transposed block; E4M3 sources with scales not powers of two.
TEST_F(Fp8Quantize, TransposedBlocksEqualTheReferenceOnEachPath) {
  for (const bool fp8_source : {false, true}) {
    expect_transposed_blocks_match(fp8_source, 2, 200, 136, 320, 0, 0);  // both vector
    expect_transposed_blocks_match(fp8_source, 1, 200, 136, 320, 1, 4);  // neither
    expect_transposed_blocks_match(fp8_source, 1, 200, 136, 264, 8, 16);  // both vector, an 8-row edge block
    expect_transposed_blocks_match(fp8_source, 1, 136, 200, 132, 0, 0);  // rows % 8 == 4: one value at a time
    expect_transposed_blocks_match(fp8_source, 2, 200, 0, 130, 0, 0);    // one source; cols % 16 == 8: bytes
    expect_transposed_blocks_match(fp8_source, 1, 3, 2, 5, 0, 0);        // one short block of both sources
  }
}

// A NaN or an infinity in a transposed copy's source is reported through that source's report (also in a
// block straddling the two), and its transposed block gets a NaN scale (from bf16 values, and from an E4M3
// block whose scale is NaN); one in transpose_tiles' rows through its report.
TEST_F(Fp8Quantize, TransposedFormsReportNonFiniteBySource) {
  const int64_t n = 200, rows = 130, cols = 2 * n;  // sources [1, n, rows]; transposed [rows, 2n]
  const int64_t n_scales = fp8::blocks_of(rows) * fp8::blocks_of(cols);
  const auto run = [&](const std::vector<HostBf16>& a, const std::vector<HostBf16>& b) {
    DeviceBuffer d_a = to_device(a), d_b = to_device(b), d_q(size_t(rows * cols)), d_s(size_t(n_scales) * 4);
    DeviceBuffer d_flags = to_device(std::vector<int32_t>{0, 0});
    fp8::NonfiniteReport r0{d_flags.as<int32_t>()}, r1{d_flags.as<int32_t>() + 1};
    fp8::quantize_blocks_transposed(d_a.as<bf16_t>(), n, d_b.as<bf16_t>(), n, 1, rows, d_q.as<uint8_t>(),
                                    d_s.as<float>(), r0, nullptr, &r1);
    LYNX_TEST_CUDA(cudaDeviceSynchronize());
    return std::make_pair(to_host<int32_t>(d_flags, 2), to_host<float>(d_s, size_t(n_scales)));
  };
  const std::vector<HostBf16> a = spread_values(n, rows, 4, 3), b = spread_values(n, rows, 4, 4);
  const auto [clean_flags, clean_scales] = run(a, b);
  EXPECT_EQ(clean_flags, (std::vector<int32_t>{0, 0}));
  for (const float s : clean_scales) EXPECT_TRUE(std::isfinite(s));
  // b's row 150, value 7: transposed row 7, column n + 150 = 350, block (0, 2).
  std::vector<HostBf16> bad_b = b;
  bad_b[size_t(150 * rows + 7)] = float_to_bf16(std::numeric_limits<float>::infinity());
  const auto [flags1, scales1] = run(a, bad_b);
  EXPECT_EQ(flags1, (std::vector<int32_t>{0, 1})) << "a value of the second source reported as the first's";
  for (int64_t i = 0; i < n_scales; ++i) EXPECT_EQ(std::isnan(scales1[size_t(i)]), i == 2) << "scale " << i;
  // a's row 3, value 129: transposed row 129, column 3, block (1, 0).
  std::vector<HostBf16> bad_a = a;
  bad_a[size_t(3 * rows + 129)] = float_to_bf16(std::numeric_limits<float>::quiet_NaN());
  const auto [flags0, scales0] = run(bad_a, b);
  EXPECT_EQ(flags0, (std::vector<int32_t>{1, 0})) << "a value of the first source reported as the second's";
  for (int64_t i = 0; i < n_scales; ++i) {
    EXPECT_EQ(std::isnan(scales0[size_t(i)]), i == fp8::blocks_of(cols)) << "scale " << i;
  }
  // Block (0, 1) straddles the sources (columns 128-199 of a, 200-255 of b): a NaN in b's row 10, value
  // 100 (column 210) is b's alone, an infinity in a's row 150, value 5 (column 150) a's alone.
  for (const bool in_b : {true, false}) {
    std::vector<HostBf16> sa = a, sb = b;
    if (in_b) {
      sb[size_t(10 * rows + 100)] = float_to_bf16(std::numeric_limits<float>::quiet_NaN());
    } else {
      sa[size_t(150 * rows + 5)] = float_to_bf16(-std::numeric_limits<float>::infinity());
    }
    const auto [flags, scales] = run(sa, sb);
    EXPECT_EQ(flags, (std::vector<int32_t>{in_b ? 0 : 1, in_b ? 1 : 0})) << "straddling, in " << (in_b ? "b" : "a");
    for (int64_t i = 0; i < n_scales; ++i) EXPECT_EQ(std::isnan(scales[size_t(i)]), i == 1) << "scale " << i;
  }

  // From E4M3 sources: a's block (1, 0) (its rows 128-199, values 0-127) with a NaN scale.
  const int64_t source_scales = fp8::blocks_of(n) * fp8::blocks_of(rows);
  const ref::fp8::Quantized qa = ref::fp8::quantize_blocks(to_floats(a).data(), n, rows);
  const ref::fp8::Quantized qb = ref::fp8::quantize_blocks(to_floats(b).data(), n, rows);
  std::vector<float> a_scales = qa.scales;
  a_scales[size_t(1 * fp8::blocks_of(rows) + 0)] = std::numeric_limits<float>::quiet_NaN();
  ASSERT_EQ(a_scales.size(), size_t(source_scales));
  DeviceBuffer d_aq = to_device(qa.q), d_bq = to_device(qb.q), d_as = to_device(a_scales), d_bs = to_device(qb.scales);
  DeviceBuffer d_q(size_t(rows * cols)), d_s(size_t(n_scales) * 4), d_flags = to_device(std::vector<int32_t>{0, 0});
  fp8::NonfiniteReport r0{d_flags.as<int32_t>()}, r1{d_flags.as<int32_t>() + 1};
  fp8::quantize_blocks_transposed_fp8(d_aq.as<uint8_t>(), d_as.as<float>(), n, d_bq.as<uint8_t>(), d_bs.as<float>(), n,
                                      1, rows, d_q.as<uint8_t>(), d_s.as<float>(), r0, nullptr, &r1);
  LYNX_TEST_CUDA(cudaDeviceSynchronize());
  EXPECT_EQ(to_host<int32_t>(d_flags, 2), (std::vector<int32_t>{1, 0}));
  // Transposed rows 0-127 of columns 128-199 hold it: block (0, 1).
  const std::vector<float> fp8_scales = to_host<float>(d_s, size_t(n_scales));
  for (int64_t i = 0; i < n_scales; ++i) EXPECT_EQ(std::isnan(fp8_scales[size_t(i)]), i == 1) << "E4M3 scale " << i;

  // transpose_tiles: an infinity in row 5 of 256 (every row placed), column 7.
  const int64_t cap = 256, width = 136;
  std::vector<HostBf16> x = spread_values(cap, width, 4, 5);
  x[size_t(5 * width + 7)] = float_to_bf16(-std::numeric_limits<float>::infinity());
  DeviceBuffer d_x = to_device(x), d_total = to_device(std::vector<int32_t>{int32_t(cap)});
  DeviceBuffer d_tq(size_t(width * cap)), d_ts(size_t(width * cap / 128) * 4), d_flag = to_device(std::vector<int32_t>{0});
  fp8::transpose_tiles(d_x.as<bf16_t>(), cap, width, d_total.as<int32_t>(), d_tq.as<uint8_t>(), d_ts.as<float>(),
                       fp8::NonfiniteReport{d_flag.as<int32_t>()}, nullptr);
  LYNX_TEST_CUDA(cudaDeviceSynchronize());
  EXPECT_EQ(to_host<int32_t>(d_flag, 1)[0], 1);
  const std::vector<float> ts = to_host<float>(d_ts, size_t(width * cap / 128));  // [row blocks, width]
  for (int64_t i = 0; i < width * cap / 128; ++i) EXPECT_EQ(std::isnan(ts[size_t(i)]), i == 7) << "tile scale " << i;
}

// quantize_blocks_and_transposed (quantize_weights' forward and backward copies from one read): each
// source's straight copy against quantize_blocks of it and the transposed copy against quantize_blocks
// of the transposed matrix, bit for bit, from `batch` matrices of sources [batch, n0, rows] and [batch,
// n1, rows] (n1 = 0: one), the sources `src_offset` values and the copies `q_offset` bytes past aligned
// addresses; nothing written before or past any copy or its scales.
void expect_blocks_and_transposed_match(int64_t batch, int64_t n0, int64_t n1, int64_t rows, int64_t src_offset,
                                        int64_t q_offset) {
  const auto seed = fresh_seed();
  const int64_t cols = n0 + n1, n[2] = {n0, n1};
  SCOPED_TRACE("sources " + std::to_string(n0) + " + " + std::to_string(n1) + " of " + std::to_string(rows) +
               ", batch " + std::to_string(batch) + ", offsets " + std::to_string(src_offset) + " / " +
               std::to_string(q_offset) + " seed " + std::to_string(seed));
  std::vector<float> values[2];
  DeviceBuffer d_src[2], d_q[2], d_s[2];
  int64_t q_bytes[2] = {0, 0}, n_scales[2] = {0, 0};
  for (int k = 0; k < 2; ++k) {
    q_bytes[k] = batch * n[k] * rows;
    n_scales[k] = batch * fp8::blocks_of(n[k]) * fp8::blocks_of(rows);
    if (n[k] == 0) continue;
    const std::vector<HostBf16> x = spread_values(batch * n[k], rows, 6, seed ^ uint64_t(k + 1));
    values[k] = to_floats(x);
    std::vector<HostBf16> shifted(size_t(src_offset), float_to_bf16(0.0f));
    shifted.insert(shifted.end(), x.begin(), x.end());
    d_src[k] = to_device(shifted);
    d_q[k] = DeviceBuffer(size_t(q_offset + q_bytes[k] + kCanary));
    d_s[k] = DeviceBuffer(size_t(n_scales[k] + kCanary) * 4);
    d_q[k].fill_bytes(0x7F);
    d_s[k].fill_bytes(0xFF);
  }
  const int64_t t_bytes = batch * rows * cols, t_scales = batch * fp8::blocks_of(rows) * fp8::blocks_of(cols);
  DeviceBuffer d_qt(size_t(q_offset + t_bytes + kCanary)), d_st(size_t(t_scales + kCanary) * 4);
  d_qt.fill_bytes(0x7F);
  d_st.fill_bytes(0xFF);
  const auto q_at = [&](DeviceBuffer& b) { return b.get() == nullptr ? nullptr : b.as<uint8_t>() + q_offset; };
  const auto s_at = [&](DeviceBuffer& b) { return b.get() == nullptr ? nullptr : b.as<float>(); };
  fp8::quantize_blocks_and_transposed(d_src[0].as<bf16_t>() + src_offset, n0,
                                      n1 > 0 ? d_src[1].as<bf16_t>() + src_offset : nullptr, n1, batch, rows,
                                      q_at(d_q[0]), s_at(d_s[0]), q_at(d_q[1]), s_at(d_s[1]), q_at(d_qt),
                                      d_st.as<float>(), {}, nullptr);
  LYNX_TEST_CUDA(cudaDeviceSynchronize());
  for (int k = 0; k < 2; ++k) {
    if (n[k] == 0) continue;
    const std::string what = "straight copy of source " + std::to_string(k);
    const std::vector<uint8_t> q = to_host<uint8_t>(d_q[k], size_t(q_offset + q_bytes[k] + kCanary));
    const std::vector<float> sc = to_host<float>(d_s[k], size_t(n_scales[k] + kCanary));
    ASSERT_NO_FATAL_FAILURE(expect_canaries(q, sc, q_offset, q_bytes[k], n_scales[k], what));
    const int64_t per_matrix = fp8::blocks_of(n[k]) * fp8::blocks_of(rows);
    for (int64_t m = 0; m < batch; ++m) {
      const ref::fp8::Quantized want = ref::fp8::quantize_blocks(values[k].data() + m * n[k] * rows, n[k], rows);
      ASSERT_TRUE(want.finite);
      const auto at = q.begin() + q_offset + m * n[k] * rows;
      expect_codes_and_scales({at, at + n[k] * rows}, {sc.begin() + m * per_matrix, sc.begin() + (m + 1) * per_matrix},
                              want, what + ", matrix " + std::to_string(m));
    }
  }
  const std::vector<uint8_t> qt = to_host<uint8_t>(d_qt, size_t(q_offset + t_bytes + kCanary));
  const std::vector<float> st = to_host<float>(d_st, size_t(t_scales + kCanary));
  ASSERT_NO_FATAL_FAILURE(expect_canaries(qt, st, q_offset, t_bytes, t_scales, "transposed copy"));
  const int64_t per_matrix = fp8::blocks_of(rows) * fp8::blocks_of(cols);
  for (int64_t m = 0; m < batch; ++m) {
    const std::vector<float> t = transposed_matrix(values[0], values[1], m, n0, n1, rows);
    const ref::fp8::Quantized want = ref::fp8::quantize_blocks(t.data(), rows, cols);
    const auto at = qt.begin() + q_offset + m * rows * cols;
    expect_codes_and_scales({at, at + rows * cols}, {st.begin() + m * per_matrix, st.begin() + (m + 1) * per_matrix},
                            want, "transposed copy, matrix " + std::to_string(m));
  }
}

// Its load and store paths: sources aligned (8 values a load) or not, rows % 8 == 4 (one value at a
// time); copies aligned (8- and 16-byte stores) or not; edge blocks of 8 rows; one source whose row count
// is not a multiple of 128 (w_down with H % 128 != 0); one short block.
TEST_F(Fp8Quantize, BlocksAndTransposedFromOneReadEqualTheReference) {
  expect_blocks_and_transposed_match(2, 256, 256, 320, 0, 0);  // both vector
  expect_blocks_and_transposed_match(1, 128, 256, 320, 1, 4);  // neither
  expect_blocks_and_transposed_match(1, 256, 128, 264, 8, 16);  // both vector, an 8-row edge block
  expect_blocks_and_transposed_match(1, 128, 128, 132, 0, 0);  // rows % 8 == 4
  expect_blocks_and_transposed_match(2, 200, 0, 130, 0, 0);    // one source of 200 rows
  expect_blocks_and_transposed_match(1, 3, 0, 5, 0, 0);        // one short block
}

// A NaN or an infinity in a source: reported through that source's report, its straight block's scale
// and its transposed block's NaN, no other; two sources whose blocks would straddle them refused.
TEST_F(Fp8Quantize, BlocksAndTransposedFromOneReadReportBySource) {
  const int64_t n = 128, rows = 130, cols = 2 * n;  // sources [1, n, rows]; transposed [rows, 2n]
  const int64_t src_scales = fp8::blocks_of(n) * fp8::blocks_of(rows), t_scales = fp8::blocks_of(rows) * fp8::blocks_of(cols);
  struct Result {
    std::vector<int32_t> flags;
    std::vector<float> s0, s1, st;
  };
  // Scales are filled with this byte first: 0x3F3F3F3F is a finite float no power-of-two scale equals.
  constexpr int kUnwritten = 0x3F;
  const auto written = [](float s) { return bits(s) != 0x3F3F3F3Fu; };
  const auto run = [&](const std::vector<HostBf16>& a, const std::vector<HostBf16>& b) {
    DeviceBuffer d_a = to_device(a), d_b = to_device(b), d_q0(size_t(n * rows)), d_q1(size_t(n * rows));
    DeviceBuffer d_s0(size_t(src_scales) * 4), d_s1(size_t(src_scales) * 4), d_qt(size_t(rows * cols)),
        d_st(size_t(t_scales) * 4);
    DeviceBuffer d_flags = to_device(std::vector<int32_t>{0, 0});
    for (DeviceBuffer* d : {&d_s0, &d_s1, &d_st}) d->fill_bytes(kUnwritten);
    fp8::NonfiniteReport r0{d_flags.as<int32_t>()}, r1{d_flags.as<int32_t>() + 1};
    fp8::quantize_blocks_and_transposed(d_a.as<bf16_t>(), n, d_b.as<bf16_t>(), n, 1, rows, d_q0.as<uint8_t>(),
                                        d_s0.as<float>(), d_q1.as<uint8_t>(), d_s1.as<float>(), d_qt.as<uint8_t>(),
                                        d_st.as<float>(), r0, nullptr, &r1);
    LYNX_TEST_CUDA(cudaDeviceSynchronize());
    return Result{to_host<int32_t>(d_flags, 2), to_host<float>(d_s0, size_t(src_scales)),
                  to_host<float>(d_s1, size_t(src_scales)), to_host<float>(d_st, size_t(t_scales))};
  };
  const std::vector<HostBf16> a = spread_values(n, rows, 4, 3), b = spread_values(n, rows, 4, 4);
  const Result clean = run(a, b);
  EXPECT_EQ(clean.flags, (std::vector<int32_t>{0, 0}));
  for (const auto* v : {&clean.s0, &clean.s1, &clean.st}) {
    for (const float s : *v) EXPECT_TRUE(std::isfinite(s) && written(s)) << s;
  }
  // b's row 100, value 129: its block (0, 1); transposed row 129, column n + 100 = 228, block (1, 1).
  std::vector<HostBf16> bad_b = b;
  bad_b[size_t(100 * rows + 129)] = float_to_bf16(std::numeric_limits<float>::infinity());
  const Result r = run(a, bad_b);
  EXPECT_EQ(r.flags, (std::vector<int32_t>{0, 1})) << "a value of the second source reported as the first's";
  for (int64_t i = 0; i < src_scales; ++i) {
    EXPECT_TRUE(written(r.s0[size_t(i)]) && !std::isnan(r.s0[size_t(i)])) << "first source's scale " << i;
    EXPECT_TRUE(written(r.s1[size_t(i)])) << "second source's scale " << i;
    EXPECT_EQ(std::isnan(r.s1[size_t(i)]), i == 1) << "second source's scale " << i;
  }
  for (int64_t i = 0; i < t_scales; ++i) {
    EXPECT_TRUE(written(r.st[size_t(i)])) << "transposed scale " << i;
    EXPECT_EQ(std::isnan(r.st[size_t(i)]), i == 1 * fp8::blocks_of(cols) + 1) << "transposed scale " << i;
  }
  DeviceBuffer d(size_t(4096));
  EXPECT_THROW(fp8::quantize_blocks_and_transposed(d.as<bf16_t>(), 200, d.as<bf16_t>(), 56, 1, 8, d.as<uint8_t>(),
                                                   d.as<float>(), d.as<uint8_t>(), d.as<float>(), d.as<uint8_t>(),
                                                   d.as<float>(), {}, nullptr),
               Error)
      << "a block straddling the two sources";
}

}  // namespace
}  // namespace lynx::test
