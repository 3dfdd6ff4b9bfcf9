// lynx's cuBLAS products (src/kernels/cublas) against an fp64 reference where K % 8 != 0: the weight
// gradients' form (K = tokens or an expert's rows), one product and grouped, C poisoned or accumulated.
#include <cublas_v2.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <iterator>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/bf16.h"
#include "gpu/gpu_test.h"
#include "gpu/layer_check.h"
#include "kernels/cublas/api.h"

namespace lynx::test {
namespace {

// NOTES: C's bf16 rounding (bf16 keeps 8 significant bits: at most 2⁻⁸ relative) measured 1.65e-3 of
// ‖C‖ once and ~2.3e-3 where the product is cut at K − K % 8 and rounded twice (products.h;
// bench/results/2026-12-06-h100-205e984-cublas-k-tail-log.txt); 5e-3 is twice that. An fp32 C carries
// only the fp32 sums' error, ~√K · 2⁻²⁴ ≈ 5e-6 of ‖C‖ at K ≈ 8000 (derived, not measured): 1e-4. A's
// last 8 rows are scaled by 16, so that the K tail carries about a quarter of C's square norm at
// K ≈ 5600 and one of its rows left out costs ~0.15-0.25, far above either bound.
constexpr double kBound = 5e-3, kBoundFp32 = 1e-4;

struct Product {
  int m, n, k;
  float beta;
  std::vector<HostBf16> a, b, c0;  // a [k, m], b [k, n], c0 [m, n] (the C that beta 1 adds onto)
  DeviceBuffer da, db, dc;

  Product(int m_, int n_, int k_, float beta_, std::mt19937_64& rng) : m(m_), n(n_), k(k_), beta(beta_) {
    std::normal_distribution<float> nd;
    a.resize(size_t(k) * m), b.resize(size_t(k) * n), c0.resize(size_t(m) * n);
    for (size_t i = 0; i < a.size(); ++i) a[i] = float_to_bf16((int64_t(i / m) >= k - 8 ? 16.0f : 1.0f) * nd(rng));
    for (auto& v : b) v = float_to_bf16(nd(rng));
    for (auto& v : c0) v = float_to_bf16(8.0f * nd(rng));
    da = to_device(a), db = to_device(b), dc = DeviceBuffer(4 * c0.size());
  }
  // C (bf16 or fp32) as beta asks: c0 under it for beta 1, NaN everywhere for beta 0.
  void prepare(bool c_fp32) {
    if (beta == 0.0f) return dc.fill_bytes(0xFF);
    if (!c_fp32) {
      upload(dc.get(), c0.data(), 2 * c0.size());
      return;
    }
    std::vector<float> f(c0.size());
    for (size_t i = 0; i < f.size(); ++i) f[i] = float(to_double(c0[i]));
    upload(dc.get(), f.data(), 4 * f.size());
  }
  blas::Gemm gemm() const { return {true, false, m, n, k, da.get(), m, db.get(), n, dc.get(), n, beta}; }
  // ‖C − reference‖ / ‖reference‖ (rel_error: a non-finite element fails the test).
  double error(bool c_fp32) const {
    std::vector<double> want(size_t(m) * n, 0.0);
    for (int t = 0; t < k; ++t)
      for (int i = 0; i < m; ++i) {
        const double ai = to_double(a[size_t(t) * m + i]);
        for (int j = 0; j < n; ++j) want[size_t(i) * n + j] += ai * to_double(b[size_t(t) * n + j]);
      }
    if (beta == 1.0f)
      for (size_t q = 0; q < want.size(); ++q) want[q] += to_double(c0[q]);
    const std::string what = name();
    if (c_fp32) return rel_error(to_host<float>(dc, want.size()), want, what.c_str());
    return rel_error(to_host<HostBf16>(dc, want.size()), want, what.c_str());
  }
  std::string name() const {
    return "m=" + std::to_string(m) + " n=" + std::to_string(n) + " K=" + std::to_string(k) +
           " beta=" + std::to_string(int(beta));
  }
};

class CublasGemm : public GpuTest {
 protected:
  void SetUp() override {
    GpuTest::SetUp();
    if (IsSkipped()) return;
    ASSERT_EQ(cublasCreate(&handle_), CUBLAS_STATUS_SUCCESS);
  }
  void TearDown() override {
    if (handle_ != nullptr) cublasDestroy(handle_);
  }
  cublasHandle_t handle_ = nullptr;
  const uint64_t seed_ = std::random_device{}();
  std::mt19937_64 rng_{seed_};
  const ::testing::ScopedTrace trace_{__FILE__, __LINE__, "random seed " + std::to_string(seed_)};
};

// The shared expert's weight-gradient shapes where cuBLAS 13.1 alone left out the K tail.
TEST_F(CublasGemm, WeightGradientKTails) {
  struct Shape { int m, n, k; float beta; bool c_fp32; };
  const Shape shapes[] = {{64, 320, 5632, 0, false}, {64, 320, 5633, 0, false}, {64, 320, 5634, 0, false},
                          {64, 320, 5635, 0, false}, {64, 320, 5639, 0, false}, {64, 320, 5634, 1, false},
                          {64, 320, 5634, 0, true},  {64, 320, 5633, 1, true},  {320, 64, 2817, 0, false},
                          {128, 512, 8193, 0, false}, {128, 512, 8195, 1, false}, {64, 320, 3, 0, false},
                          {64, 320, 7, 1, false},    {64, 320, 9, 0, false}};
  for (const Shape& s : shapes) {
    Product p(s.m, s.n, s.k, s.beta, rng_);
    p.prepare(s.c_fp32);
    blas::gemm(handle_, p.gemm(), s.c_fp32, nullptr);
    LYNX_TEST_CUDA(cudaDeviceSynchronize());
    const double e = p.error(s.c_fp32);
    EXPECT_LT(e, s.c_fp32 ? kBoundFp32 : kBound) << p.name() << (s.c_fp32 ? " fp32 C" : " bf16 C");
  }
}

// The same cut through GroupedGemm, products issued one by one and as grouped calls (bodies, then
// tails; a product of K < 8 a tail alone, beta 1 at odd places), in a pool with room for every part and
// in one that runs out between the two calls (run() then waits for the stream); an empty K sets C to
// zero.
TEST_F(CublasGemm, GroupedKTails) {
  const int ks[] = {5634, 5, 2817, 16, 0, 4101};  // 4 bodies and 4 tails
  for (const int64_t pool_parts : {int64_t(12), int64_t(4)}) {
    for (const bool grouped : {false, true}) {
      std::vector<std::unique_ptr<Product>> ps;
      std::vector<blas::Gemm> gemms;
      for (size_t i = 0; i < std::size(ks); ++i) {
        ps.push_back(std::make_unique<Product>(64, 320, ks[i], i % 2 == 1 ? 1.0f : 0.0f, rng_));
        ps.back()->prepare(false);
        gemms.push_back(ps.back()->gemm());
      }
      blas::GroupedGemm pool(pool_parts);
      pool.run(handle_, gemms, false, grouped, nullptr);
      LYNX_TEST_CUDA(cudaDeviceSynchronize());
      for (const auto& p : ps) {
        EXPECT_LT(p->error(false), kBound) << p->name() << (grouped ? " grouped" : " one by one") << ", a pool of "
                                           << pool_parts;
      }
    }
  }
}

}  // namespace
}  // namespace lynx::test
