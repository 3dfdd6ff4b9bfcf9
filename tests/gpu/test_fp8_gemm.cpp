// The block-scaled FP8 GEMM (Fp8Gemm.*, kernels/fp8/gemm.cu) against the CPU reference's fp8_gemm
// (src/reference/fp8.h), on operands quantised by the reference: square tiles, M, N and K past a
// multiple of 128 (K = 2880, its last block 64 wide), one row, K below one block. Outputs poisoned with
// NaN first; no wait may stall; a second call gives the same bits.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/status.h"
#include "gpu/gpu_test.h"
#include "gpu/layer_check.h"
#include "kernels/fp8/api.h"
#include "reference/fp8.h"

namespace lynx::test {
namespace {

class Fp8Gemm : public GpuTest {};

// NOTES: the tensor core's FP8 sums inside one wgmma are not exact fp32 sums (DeepSeek-V3's report:
// about 14 bits kept), so the kernel and the double reference differ by a small multiple of 2^-14 of
// each K block's products; 1e-3 of the result's norm leaves room for that, while a wrong scale, block,
// row or swizzle gives errors of order one.
constexpr double kTolerance = 1e-3;

// normal(0, 1) times 2^u, u uniform in [-4, 4] per 16 columns: tiles whose scales differ.
std::vector<float> values(int64_t rows, int64_t cols, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-4, 4);
  std::vector<float> v(size_t(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    int e = 0;
    for (int64_t c = 0; c < cols; ++c) {
      if (c % 16 == 0) e = exponent(rng);
      v[size_t(r * cols + c)] = std::ldexp(normal(rng), e);
    }
  }
  return v;
}

void expect_matches_reference(int64_t M, int64_t N, int64_t K) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("M " + std::to_string(M) + " N " + std::to_string(N) + " K " + std::to_string(K) + " seed " +
               std::to_string(seed));
  const std::vector<float> a = values(M, K, seed), b = values(N, K, seed ^ 0xb);
  const ref::fp8::Quantized qa = ref::fp8::quantize_tiles(a.data(), M, K);
  const ref::fp8::Quantized qb = ref::fp8::quantize_blocks(b.data(), N, K);
  ASSERT_TRUE(qa.finite && qb.finite);
  DeviceBuffer d_a = to_device(qa.q), d_as = to_device(qa.scales), d_b = to_device(qb.q), d_bs = to_device(qb.scales);
  DeviceBuffer d_out(size_t(M * N) * sizeof(float));
  d_out.fill_bytes(0xFF);
  DeviceStatus* status = nullptr;
  LYNX_TEST_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&status), sizeof(DeviceStatus), cudaHostAllocMapped));
  *status = DeviceStatus{};
  DeviceStatus* status_device = nullptr;
  LYNX_TEST_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&status_device), status, 0));
  fp8::gemm_block_scaled(d_a.as<uint8_t>(), d_as.as<float>(), M, K, d_b.as<uint8_t>(), d_bs.as<float>(), N,
                         d_out.as<float>(), status_device, nullptr);
  LYNX_TEST_CUDA(cudaDeviceSynchronize());
  EXPECT_EQ(status->code, 0) << "a wait stalled: " << status->a << " at K block " << status->b;
  LYNX_TEST_CUDA(cudaFreeHost(status));
  const std::vector<float> got = to_host<float>(d_out, size_t(M * N));
  const std::vector<double> want = ref::fp8::fp8_gemm(qa, qb);
  double err = 0.0, norm = 0.0;
  int64_t nonfinite = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) ++nonfinite;
    err += (got[i] - want[i]) * (got[i] - want[i]);
    norm += want[i] * want[i];
  }
  EXPECT_EQ(nonfinite, 0);
  EXPECT_LT(std::sqrt(err / norm), kTolerance);
  // Deterministic: a second call gives the same bits.
  d_out.fill_bytes(0xFF);
  fp8::gemm_block_scaled(d_a.as<uint8_t>(), d_as.as<float>(), M, K, d_b.as<uint8_t>(), d_bs.as<float>(), N,
                         d_out.as<float>(), nullptr, nullptr);
  LYNX_TEST_CUDA(cudaDeviceSynchronize());
  const std::vector<float> again = to_host<float>(d_out, size_t(M * N));
  EXPECT_EQ(std::memcmp(again.data(), got.data(), got.size() * sizeof(float)), 0) << "two calls, different bits";
}

TEST_F(Fp8Gemm, OneTile) { expect_matches_reference(128, 128, 128); }
TEST_F(Fp8Gemm, EdgesPastEveryBlock) { expect_matches_reference(200, 384, 2880); }
TEST_F(Fp8Gemm, ColumnsPastABlock) { expect_matches_reference(256, 200, 1024); }
TEST_F(Fp8Gemm, OneRowShortK) { expect_matches_reference(1, 128, 64); }

}  // namespace
}  // namespace lynx::test
