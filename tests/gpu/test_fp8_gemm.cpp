// The block-scaled FP8 GEMM (Fp8Gemm.*, kernels/fp8/gemm.cu) against the CPU reference's fp8_gemm
// (src/reference/fp8.h), on operands quantised by the reference: square tiles, M, N and K past a
// multiple of 128 (K = 2880, its last block 64 wide), one row, K below one block. Outputs poisoned with
// NaN first; no wait may stall; a second call gives the same bits.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "common/status.h"
#include "gpu/gpu_test.h"
#include "gpu/layer_check.h"
#include "kernels/expert_gemm/api.h"
#include "kernels/fp8/api.h"
#include "lynx/error.h"
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

// The grouped forms (grouped_gemm_block_scaled, grouped_swiglu_block_scaled): experts of `rows` rows
// each, in schedule order with each expert padded to whole 128-row blocks (padding rows of A zeros)
// and one more block past the schedule's rows; each expert's rows against the reference's fp8_gemm of
// its rows and its weights, the padding rows zeros (silu(0)·0 may be -0), the block past the rows not
// written (still NaN).

// A bf16 output's difference from the exact value beyond its rounding: zero where it lies within one
// bf16 step (8 significant bits) of it, as a correct kernel's fp32 value rounded gives (a step, not
// half of one, where the fp32 value and the exact one lie either side of a rounding boundary), else the
// whole difference. Summed over a tensor against its norm, what is left is the FP8 sums' error where it
// exceeds a step (values from cancelling terms, small against the norm) and any real fault, off by
// order one (kTolerance).
// NOTES: the outputs had been compared with the exact values under 3e-3, their rounding (at most 2^-8
// of each value) included: over one expert's single row of h, whose norm a few products dominate, the
// rounding alone reached 3.01e-3 (Fp8Gemm.GroupedPairedRowBlocks, 2026-12-07).
double beyond_bf16_rounding(double got, double exact) {
  const double step = exact == 0.0 ? 0.0 : std::ldexp(1.0, std::ilogb(exact) - 7);
  return std::fabs(got - exact) <= step ? 0.0 : got - exact;
}

// The grouped forms' operands: experts of `rows` rows each in schedule order, each padded to whole
// 128-row blocks (padding rows of A zeros), and one more block past the schedule's rows; A quantised in
// 1×128 tiles, and `weights` sets of expert weights ([N, K] each) in 128×128 blocks: w = 0 the gate (or
// the only one), w = 1 the up; b_q and b_scales every expert's one after another.
struct GroupedOperands {
  std::vector<int32_t> offset;
  int64_t total = 0, cap = 0;
  ref::fp8::Quantized qa;
  std::vector<ref::fp8::Quantized> qb[2];
  std::vector<uint8_t> b_q[2];
  std::vector<float> b_scales[2];
};

GroupedOperands grouped_operands(const std::vector<int64_t>& rows, int64_t N, int64_t K, int weights, uint64_t seed) {
  GroupedOperands o;
  const int64_t E = int64_t(rows.size());
  o.offset.assign(size_t(E + 1), 0);
  for (int64_t e = 0; e < E; ++e) {
    o.offset[size_t(e + 1)] = o.offset[size_t(e)] + int32_t((rows[size_t(e)] + 127) / 128 * 128);
  }
  o.total = o.offset[size_t(E)];
  o.cap = o.total + 128;
  std::vector<float> a(size_t(o.cap * K), 0.0f);
  for (int64_t e = 0; e < E; ++e) {
    const std::vector<float> v = values(rows[size_t(e)], K, seed ^ uint64_t(e));
    std::copy(v.begin(), v.end(), a.begin() + int64_t(o.offset[size_t(e)]) * K);
  }
  o.qa = ref::fp8::quantize_tiles(a.data(), o.cap, K);
  for (int w = 0; w < weights; ++w) {
    for (int64_t e = 0; e < E; ++e) {
      const std::vector<float> v = values(N, K, seed ^ 0xb ^ (uint64_t(e) << 8) ^ (uint64_t(w) << 20));
      o.qb[w].push_back(ref::fp8::quantize_blocks(v.data(), N, K));
      o.b_q[w].insert(o.b_q[w].end(), o.qb[w].back().q.begin(), o.qb[w].back().q.end());
      o.b_scales[w].insert(o.b_scales[w].end(), o.qb[w].back().scales.begin(), o.qb[w].back().scales.end());
    }
  }
  return o;
}

// swiglu: h = silu(g) · u of the gate and up products (grouped_swiglu_block_scaled), against the same
// of the reference's two products. pair_rows: the tiles in pairs of an expert's row blocks, and every
// output (h, kept g and u) also bit for bit the plain order's. every: the rows of an expert checked
// against the reference, every `every`-th and its last (every row's padding and finiteness checked).
void expect_grouped_matches_reference(const std::vector<int64_t>& rows, int64_t N, int64_t K, bool swiglu = false,
                                      bool pair_rows = false, int64_t every = 1) {
  const auto seed = fresh_seed();
  const int64_t E = int64_t(rows.size()), kb = fp8::blocks_of(K);
  SCOPED_TRACE("E " + std::to_string(E) + " N " + std::to_string(N) + " K " + std::to_string(K) + " seed " +
               std::to_string(seed) + (swiglu ? " swiglu" : "") + (pair_rows ? " paired" : ""));
  const GroupedOperands ops = grouped_operands(rows, N, K, swiglu ? 2 : 1, seed);
  const std::vector<int32_t>& offset = ops.offset;
  const int64_t total = ops.total, cap = ops.cap;
  const ref::fp8::Quantized& qa = ops.qa;
  const auto& qb = ops.qb;
  const auto& b_q = ops.b_q;
  const auto& b_scales = ops.b_scales;
  DeviceBuffer d_a = to_device(qa.q), d_as = to_device(qa.scales), d_offset = to_device(offset);
  DeviceBuffer d_b = to_device(b_q[0]), d_bs = to_device(b_scales[0]);
  DeviceBuffer d_u = swiglu ? to_device(b_q[1]) : DeviceBuffer(16), d_us = swiglu ? to_device(b_scales[1]) : DeviceBuffer(16);
  DeviceBuffer d_out(size_t(cap * N) * 2);
  d_out.fill_bytes(0xFF);
  // The gate/up form also keeps g and u (KeptGateUp): row r's to row slot[r] = cap − 1 − r, none for every
  // third row (-1).
  std::vector<int32_t> slot(static_cast<size_t>(cap));
  for (int64_t r = 0; r < cap; ++r) slot[size_t(r)] = r % 3 == 2 ? -1 : int32_t(cap - 1 - r);
  DeviceBuffer d_slot = to_device(slot), d_kept_g(size_t(cap * N) * 2), d_kept_u(size_t(cap * N) * 2);
  d_kept_g.fill_bytes(0xFF);
  d_kept_u.fill_bytes(0xFF);
  const auto run = [&](DeviceBuffer& out, DeviceBuffer& kept_g, DeviceBuffer& kept_u, bool pair) {
    if (swiglu) {
      fp8::grouped_swiglu_block_scaled(d_a.as<uint8_t>(), d_as.as<float>(), cap, K, d_b.as<uint8_t>(),
                                       d_bs.as<float>(), d_u.as<uint8_t>(), d_us.as<float>(), E, N,
                                       d_offset.as<int32_t>(), out.as<bf16_t>(), nullptr, nullptr,
                                       fp8::KeptGateUp{kept_g.as<bf16_t>(), kept_u.as<bf16_t>(), d_slot.as<int32_t>()},
                                       {}, {}, pair);
    } else {
      fp8::grouped_gemm_block_scaled(d_a.as<uint8_t>(), d_as.as<float>(), cap, K, d_b.as<uint8_t>(), d_bs.as<float>(),
                                     E, N, d_offset.as<int32_t>(), out.as<bf16_t>(), nullptr, nullptr, {}, pair);
    }
    LYNX_TEST_CUDA(cudaDeviceSynchronize());
  };
  run(d_out, d_kept_g, d_kept_u, pair_rows);
  const std::vector<HostBf16> got = to_host<HostBf16>(d_out, size_t(cap * N));
  const std::vector<HostBf16> kept_g = to_host<HostBf16>(d_kept_g, size_t(cap * N));
  const std::vector<HostBf16> kept_u = to_host<HostBf16>(d_kept_u, size_t(cap * N));
  if (pair_rows) {  // the plain order's outputs, poisoned the same way: the same bytes
    DeviceBuffer plain(size_t(cap * N) * 2), plain_g(size_t(cap * N) * 2), plain_u(size_t(cap * N) * 2);
    for (DeviceBuffer* b : {&plain, &plain_g, &plain_u}) b->fill_bytes(0xFF);
    run(plain, plain_g, plain_u, false);
    const auto same = [&](DeviceBuffer& b, const std::vector<HostBf16>& paired) {
      const std::vector<HostBf16> v = to_host<HostBf16>(b, size_t(cap * N));
      return std::memcmp(v.data(), paired.data(), v.size() * sizeof(HostBf16)) == 0;
    };
    EXPECT_TRUE(same(plain, got)) << "out: the paired order's bits differ from the plain order's";
    EXPECT_TRUE(same(plain_g, kept_g)) << "kept g";
    EXPECT_TRUE(same(plain_u, kept_u)) << "kept u";
  }
  // The kept rows `pick` of an expert against the reference's g or u of them, [pick.size(), N] (relative
  // Frobenius error over those rows).
  const auto expect_kept = [&](const std::vector<HostBf16>& kept, const std::vector<double>& want, int64_t first,
                               const std::vector<int64_t>& pick, const char* what) {
    double err = 0.0, norm = 0.0;
    for (size_t p = 0; p < pick.size(); ++p) {
      const int32_t to = slot[size_t(first + pick[p])];
      if (to < 0) continue;
      for (int64_t c = 0; c < N; ++c) {
        const double g = to_double(kept[size_t(to * N + c)]), w = want[p * size_t(N) + size_t(c)];
        ASSERT_TRUE(std::isfinite(g)) << what << " row " << pick[p] << " column " << c;
        const double d = beyond_bf16_rounding(g, w);
        err += d * d;
        norm += w * w;
      }
    }
    if (norm > 0.0) {
      EXPECT_LT(std::sqrt(err / norm), kTolerance) << what;
    }
  };
  for (int64_t e = 0; e < E; ++e) {
    SCOPED_TRACE("expert " + std::to_string(e));
    const int64_t first = offset[size_t(e)], n = rows[size_t(e)];
    if (n > 0) {
      std::vector<int64_t> pick;  // the expert's rows checked against the reference
      for (int64_t i = 0; i < n; ++i) {
        if (i % every == 0 || i == n - 1) pick.push_back(i);
      }
      ref::fp8::Quantized qe;
      qe.rows = int64_t(pick.size()), qe.cols = K;
      for (const int64_t i : pick) {
        qe.q.insert(qe.q.end(), qa.q.begin() + (first + i) * K, qa.q.begin() + (first + i + 1) * K);
        const auto scales = qa.scales.begin() + (first + i) * kb;
        qe.scales.insert(qe.scales.end(), scales, scales + kb);
      }
      std::vector<double> want = ref::fp8::fp8_gemm(qe, qb[0][size_t(e)]);
      if (swiglu) {
        const std::vector<double> u = ref::fp8::fp8_gemm(qe, qb[1][size_t(e)]);
        expect_kept(kept_g, want, first, pick, "kept g");
        expect_kept(kept_u, u, first, pick, "kept u");
        for (size_t i = 0; i < want.size(); ++i) want[i] = want[i] / (1.0 + std::exp(-want[i])) * u[i];
      }
      double err = 0.0, norm = 0.0;
      for (size_t p = 0; p < pick.size(); ++p) {
        for (int64_t c = 0; c < N; ++c) {
          const double g = to_double(got[size_t((first + pick[p]) * N + c)]), w = want[p * size_t(N) + size_t(c)];
          const double d = beyond_bf16_rounding(g, w);
          err += d * d;
          norm += w * w;
        }
      }
      EXPECT_LT(std::sqrt(err / norm), kTolerance);
      for (int64_t i = first * N; i < (first + n) * N; ++i) {
        ASSERT_TRUE(std::isfinite(to_double(got[size_t(i)]))) << "row " << i / N - first << " column " << i % N;
      }
    }
    for (int64_t i = (first + n) * N; i < int64_t(offset[size_t(e + 1)]) * N; ++i) {
      ASSERT_EQ(got[size_t(i)].bits & 0x7FFF, 0) << "padding row " << i / N - first - n;
    }
  }
  for (int64_t i = total * N; i < cap * N; ++i) ASSERT_EQ(got[size_t(i)].bits, 0xFFFF) << "past the rows: written";
  if (!swiglu) return;
  // Kept rows: a padding row's are zeros, every other kept row's finite (also those `every` leaves out of
  // the reference check); rows no schedule row below total keeps to are not written.
  for (int64_t to = 0; to < cap; ++to) {
    const int64_t r = cap - 1 - to;
    const bool kept = r % 3 != 2 && r < total;
    int64_t e = 0;
    while (kept && offset[size_t(e + 1)] <= r) ++e;
    const bool padding = kept && r >= offset[size_t(e)] + rows[size_t(e)];
    for (int64_t c = 0; c < N; ++c) {
      for (const auto* k : {&kept_g, &kept_u}) {
        const uint16_t bits = (*k)[size_t(to * N + c)].bits;
        if (!kept) {
          ASSERT_EQ(bits, 0xFFFF) << "kept row " << to << " written, column " << c;
        } else if (padding) {
          ASSERT_EQ(bits & 0x7FFF, 0) << "kept row " << to << " of a padding row, column " << c;
        } else {
          ASSERT_TRUE(std::isfinite(to_double((*k)[size_t(to * N + c)]))) << "kept row " << to << ", column " << c;
        }
      }
    }
  }
}

// The weight-gradient form: experts of `rows` rows each in schedule order (whole 128-row blocks,
// padding rows zeros, the block past the schedule NaN: it must not be read), A rows [cap, M] and B rows
// [cap, N] bf16 transposed and quantised by transpose_tiles (against the reference's quantize_tiles of
// the transposed matrix, bit for bit), then each expert's Σ_r A[r]ᵀ B[r] against the reference's
// fp8_gemm with both operands in tiles; rows [0, split) of each expert's output in out, the others in
// out2; an expert without rows exact zeros.
void expect_weight_grad_matches_reference(const std::vector<int64_t>& rows, int64_t M, int64_t N, int64_t split) {
  const auto seed = fresh_seed();
  const int64_t E = int64_t(rows.size());
  SCOPED_TRACE("E " + std::to_string(E) + " M " + std::to_string(M) + " N " + std::to_string(N) + " split " +
               std::to_string(split) + " seed " + std::to_string(seed));
  std::vector<int32_t> offset(size_t(E + 1), 0);
  for (int64_t e = 0; e < E; ++e) offset[size_t(e + 1)] = offset[size_t(e)] + int32_t((rows[size_t(e)] + 127) / 128 * 128);
  const int64_t total = offset[size_t(E)], cap = total + 128;
  // Row buffers: each expert's rows from values(), padding rows zero, the block past total NaN.
  auto row_buffer = [&](int64_t width, uint64_t salt) {
    std::vector<float> v(size_t(cap * width), 0.0f);
    for (int64_t e = 0; e < E; ++e) {
      const std::vector<float> r = values(rows[size_t(e)], width, seed ^ salt ^ (uint64_t(e) << 12));
      std::copy(r.begin(), r.end(), v.begin() + int64_t(offset[size_t(e)]) * width);
    }
    for (int64_t i = total * width; i < cap * width; ++i) v[size_t(i)] = std::nanf("");
    std::vector<HostBf16> b(v.size());
    for (size_t i = 0; i < v.size(); ++i) b[i] = float_to_bf16(v[i]);
    return b;
  };
  const std::vector<HostBf16> a_rows = row_buffer(M, 0xa), b_rows = row_buffer(N, 0xb);
  DeviceBuffer d_ar = to_device(a_rows), d_br = to_device(b_rows), d_offset = to_device(offset);
  DeviceBuffer d_total = to_device(std::vector<int32_t>{int32_t(total)});
  const int64_t kbt = cap / 128, pitch_m = fp8::scale_pitch(M), pitch_n = fp8::scale_pitch(N);
  DeviceBuffer d_a(size_t(M * cap)), d_as(size_t(pitch_m * kbt) * 4), d_b(size_t(N * cap)),
      d_bs(size_t(pitch_n * kbt) * 4);
  for (DeviceBuffer* d : {&d_a, &d_as, &d_b, &d_bs}) d->fill_bytes(0xFF);
  fp8::transpose_tiles(d_ar.as<bf16_t>(), cap, M, d_total.as<int32_t>(), d_a.as<uint8_t>(), d_as.as<float>(), {}, nullptr);
  fp8::transpose_tiles(d_br.as<bf16_t>(), cap, N, d_total.as<int32_t>(), d_b.as<uint8_t>(), d_bs.as<float>(), {}, nullptr);
  const int64_t rest = M - split;
  DeviceBuffer d_out(size_t(E * split * N) * 2), d_out2(size_t(std::max<int64_t>(rest, 1) * E * N) * 2);
  d_out.fill_bytes(0xFF);
  d_out2.fill_bytes(0xFF);
  fp8::grouped_weight_grad_block_scaled(d_a.as<uint8_t>(), d_as.as<float>(), M, d_b.as<uint8_t>(), d_bs.as<float>(), N,
                                        cap, E, d_offset.as<int32_t>(), d_out.as<bf16_t>(),
                                        rest > 0 ? d_out2.as<bf16_t>() : nullptr, split, nullptr, nullptr);
  LYNX_TEST_CUDA(cudaDeviceSynchronize());
  // transpose_tiles: the transposed [width, total] matrix in 1×128 tiles along the rows, bit for bit.
  auto transposed = [&](const std::vector<HostBf16>& r, int64_t width) {
    std::vector<float> t(static_cast<size_t>(width * total));
    for (int64_t c = 0; c < width; ++c) {
      for (int64_t i = 0; i < total; ++i) t[size_t(c * total + i)] = bf16_to_float(r[size_t(i * width + c)]);
    }
    return ref::fp8::quantize_tiles(t.data(), width, total);
  };
  const ref::fp8::Quantized qa = transposed(a_rows, M), qb = transposed(b_rows, N);
  const std::vector<uint8_t> ga = to_host<uint8_t>(d_a, size_t(M * cap));
  const std::vector<float> gas = to_host<float>(d_as, size_t(pitch_m * kbt));
  const int64_t kb = total / 128;
  const std::vector<uint8_t> gb = to_host<uint8_t>(d_b, size_t(N * cap));
  const std::vector<float> gbs = to_host<float>(d_bs, size_t(pitch_n * kbt));
  // Bit for bit below total; the columns and scales of the NaN block past it never written.
  auto expect_transposed = [&](const std::vector<uint8_t>& g, const std::vector<float>& gs,
                               const ref::fp8::Quantized& q, int64_t width, const char* what) {
    for (int64_t c = 0; c < width; ++c) {
      for (int64_t i = 0; i < cap; ++i) {
        ASSERT_EQ(g[size_t(c * cap + i)], i < total ? q.q[size_t(c * total + i)] : 0xFF) << what << " " << c << ", " << i;
      }
      const int64_t pitch = fp8::scale_pitch(width);
      for (int64_t j = 0; j < kbt; ++j) {  // scales [row blocks, pitch]
        if (j < kb) {
          ASSERT_EQ(gs[size_t(j * pitch + c)], q.scales[size_t(c * kb + j)]) << what << " scale " << c << ", " << j;
        } else {
          ASSERT_TRUE(std::isnan(gs[size_t(j * pitch + c)])) << what << " scale past the rows " << c << ", " << j;
        }
      }
    }
  };
  expect_transposed(ga, gas, qa, M, "A");
  expect_transposed(gb, gbs, qb, N, "B");
  // Each expert's sum over its rows: its K blocks of both operands, against fp8_gemm in tiles.
  const std::vector<HostBf16> out = to_host<HostBf16>(d_out, size_t(E * split * N));
  const std::vector<HostBf16> out2 = rest > 0 ? to_host<HostBf16>(d_out2, size_t(E * rest * N)) : std::vector<HostBf16>{};
  auto expert_part = [&](const ref::fp8::Quantized& q, int64_t e) {
    ref::fp8::Quantized p;
    const int64_t first = offset[size_t(e)], n = offset[size_t(e + 1)] - first;
    p.rows = q.rows, p.cols = n;
    for (int64_t r = 0; r < q.rows; ++r) {
      p.q.insert(p.q.end(), q.q.begin() + r * total + first, q.q.begin() + r * total + first + n);
      p.scales.insert(p.scales.end(), q.scales.begin() + r * kb + first / 128, q.scales.begin() + r * kb + (first + n) / 128);
    }
    return p;
  };
  for (int64_t e = 0; e < E; ++e) {
    SCOPED_TRACE("expert " + std::to_string(e));
    auto got = [&](int64_t m, int64_t n) {
      return to_double(m < split ? out[size_t((e * split + m) * N + n)] : out2[size_t((e * rest + m - split) * N + n)]);
    };
    if (rows[size_t(e)] == 0) {
      for (int64_t m = 0; m < M; ++m) {
        for (int64_t n = 0; n < N; ++n) ASSERT_EQ(got(m, n), 0.0) << "no rows, [" << m << ", " << n << "]";
      }
      continue;
    }
    const std::vector<double> want = ref::fp8::fp8_gemm(expert_part(qa, e), expert_part(qb, e), true);
    double err = 0.0, norm = 0.0;
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t n = 0; n < N; ++n) {
        const double g = got(m, n), w = want[size_t(m * N + n)];
        ASSERT_TRUE(std::isfinite(g)) << "[" << m << ", " << n << "]";
        const double d = beyond_bf16_rounding(g, w);
        err += d * d;
        norm += w * w;
      }
    }
    EXPECT_LT(std::sqrt(err / norm), kTolerance);
  }
}

TEST_F(Fp8Gemm, OneTile) { expect_matches_reference(128, 128, 128); }
TEST_F(Fp8Gemm, EdgesPastEveryBlock) { expect_matches_reference(200, 384, 2880); }
TEST_F(Fp8Gemm, ColumnsPastABlock) { expect_matches_reference(256, 200, 1024); }
TEST_F(Fp8Gemm, OneRowShortK) { expect_matches_reference(1, 128, 64); }
// More tiles (140) than an H200's SMs, of 5 K blocks each: CTAs take a second tile, and the ring of
// stages runs across tile boundaries.
TEST_F(Fp8Gemm, MoreTilesThanSMs) { expect_matches_reference(1280, 1792, 640); }
// Every count of K blocks the pipelined mainloop's tails distinguish (1-5, the last one short in 400),
// and an odd N (every pair of output columns stored one by one; the other tests' even N, together).
TEST_F(Fp8Gemm, EveryBlockCountOfThePipeline) {
  for (const int64_t K : {128, 256, 384, 400, 512, 640}) {
    SCOPED_TRACE("K = " + std::to_string(K));
    expect_matches_reference(130, 199, K);
  }
}
TEST_F(Fp8Gemm, GroupedExperts) { expect_grouped_matches_reference({200, 0, 128, 1, 300}, 384, 1024); }
TEST_F(Fp8Gemm, GroupedEdges) { expect_grouped_matches_reference({77, 129, 0}, 200, 2880); }
// [128, 256] tiles across N: four whole ones, then one whose second 128-column half lies past N (neither
// loaded nor computed), with more tiles than SMs.
TEST_F(Fp8Gemm, GroupedTilesAcrossN) { expect_grouped_matches_reference({3000, 129, 700}, 1152, 640); }
// One K block (K = 128, and a short one of 96: the scales' look-ahead has no next block) and N within
// one half (the second never loaded), in both grouped forms.
TEST_F(Fp8Gemm, GroupedOneKBlockOneHalf) {
  expect_grouped_matches_reference({200, 77}, 128, 128);
  expect_grouped_matches_reference({200, 77}, 120, 96);
  expect_grouped_matches_reference({200, 77}, 64, 128, true);
  expect_grouped_matches_reference({200, 77}, 128, 96, true);
}
TEST_F(Fp8Gemm, GroupedSwiGLU) { expect_grouped_matches_reference({200, 0, 128, 1, 300}, 384, 1024, true); }
// Tiles in pairs of an expert's row blocks (fp8/tiles.h): experts of one, two, three and four blocks,
// empty ones, partial blocks; column tiles even (pairs within experts) and odd (pairs across them);
// a second half past N; more tiles than SMs; against the reference and bit for bit the plain order.
TEST_F(Fp8Gemm, GroupedPairedRowBlocks) {
  const std::vector<int64_t> rows = {100, 250, 0, 300, 129, 1, 0, 512, 77};
  expect_grouped_matches_reference(rows, 512, 640, false, true);
  expect_grouped_matches_reference(rows, 1152, 384, false, true);  // 5 column tiles, the last one half
  expect_grouped_matches_reference(rows, 896, 256, false, true);   // 4 column tiles, the last one half
  expect_grouped_matches_reference(rows, 256, 1024, true, true);
  expect_grouped_matches_reference(rows, 384, 256, true, true);     // 3 column tiles
  expect_grouped_matches_reference({4000, 129, 700}, 1024, 256, false, true);  // many tiles per CTA
  expect_grouped_matches_reference({4000, 129, 700}, 256, 384, true, true);
}
// More than 32 tiles a CTA (4896 and 9792 tiles: the tiles each consumer warp finds 32 at a time, the
// stages' phases carried from tile to tile), plain and paired; every 61st row and each expert's last
// against the reference.
TEST_F(Fp8Gemm, GroupedManyTilesPerCta) {
  const std::vector<int64_t> rows = {9000, 6000, 77, 4000, 0, 130};
  expect_grouped_matches_reference(rows, 8192, 256, false, false, 61);
  expect_grouped_matches_reference(rows, 8192, 256, true, true, 61);
}
TEST_F(Fp8Gemm, GroupedSwiGLUEdges) {
  expect_grouped_matches_reference({77, 129, 0}, 192, 2880, true);
  expect_grouped_matches_reference({77, 129, 0}, 200, 1024, true);  // a last tile of 8 columns
}

// The grouped form gathering A itself (TileGather: the dgrad of down at R = 1) from token tiles [T, K]:
// experts of `rows` rows each, a token slot drawn for each row (so tokens repeat and some go unread),
// padding rows (slot -1), and the block past the schedule's rows (slot 0 there: it must not be
// gathered); `a` poisoned with 0xFF, the rows' scales in place (as gather_tile_scales leaves them).
// Against the same form on the tiles gathered on the host, bit for bit: every output (poisoned with NaN
// first) and every byte of `a` (a row its token's tile, zeros for padding, the block past the rows
// untouched); no wait stalls, and the gather's counters are left zero for the next launch, which (with
// the copies held to one row block ahead of the tiles) gives the same bits again.
void expect_gathered_equals_pregathered(const std::vector<int64_t>& rows, int64_t T, int64_t N, int64_t K,
                                        bool pair_rows = false) {
  const auto seed = fresh_seed();
  const int64_t E = int64_t(rows.size()), kb = fp8::blocks_of(K), top_k = 4;
  SCOPED_TRACE("E " + std::to_string(E) + " T " + std::to_string(T) + " N " + std::to_string(N) + " K " +
               std::to_string(K) + " seed " + std::to_string(seed) + (pair_rows ? " paired" : ""));
  const GroupedOperands ops = grouped_operands(rows, N, K, 1, seed);
  const std::vector<int32_t>& offset = ops.offset;
  const int64_t total = ops.total, cap = ops.cap;
  const std::vector<float> tokens = values(T, K, seed ^ 0x70);
  const ref::fp8::Quantized qt = ref::fp8::quantize_tiles(tokens.data(), T, K);
  ASSERT_TRUE(qt.finite);
  std::mt19937_64 rng(seed ^ 0x51);
  std::uniform_int_distribution<int32_t> any_slot(0, int32_t(T * top_k - 1));
  std::vector<int32_t> slot(size_t(cap), 0);
  std::vector<uint8_t> a(size_t(cap * K), 0xFF);
  std::vector<float> a_scales(size_t(cap * kb), std::nanf(""));
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t r = offset[size_t(e)]; r < offset[size_t(e + 1)]; ++r) {
      const bool padding = r >= offset[size_t(e)] + rows[size_t(e)];
      slot[size_t(r)] = padding ? -1 : any_slot(rng);
      const int64_t token = slot[size_t(r)] / top_k;
      for (int64_t c = 0; c < K; ++c) a[size_t(r * K + c)] = padding ? 0 : qt.q[size_t(token * K + c)];
      for (int64_t b = 0; b < kb; ++b) {
        a_scales[size_t(r * kb + b)] = padding ? 1.0f : qt.scales[size_t(token * kb + b)];
      }
    }
  }
  DeviceBuffer d_tokens = to_device(qt.q), d_pregathered = to_device(a), d_scales = to_device(a_scales);
  DeviceBuffer d_slot = to_device(slot), d_offset = to_device(offset);
  DeviceBuffer d_b = to_device(ops.b_q[0]), d_bs = to_device(ops.b_scales[0]);
  DeviceBuffer d_sync(size_t(gemm::gather_sync_ints(cap)) * sizeof(int32_t));
  d_sync.fill_bytes(0);
  DeviceStatus* status = nullptr;
  LYNX_TEST_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&status), sizeof(DeviceStatus), cudaHostAllocMapped));
  *status = DeviceStatus{};
  DeviceStatus* status_device = nullptr;
  LYNX_TEST_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&status_device), status, 0));
  // The form's output on `a_in` (gathered into it where `gather` is on), from a poisoned output.
  const auto run = [&](const DeviceBuffer& a_in, const fp8::TileGather& gather) {
    DeviceBuffer out(size_t(cap * N) * 2);
    out.fill_bytes(0xFF);
    fp8::grouped_gemm_block_scaled(a_in.as<uint8_t>(), d_scales.as<float>(), cap, K, d_b.as<uint8_t>(),
                                   d_bs.as<float>(), E, N, d_offset.as<int32_t>(), out.as<bf16_t>(), status_device,
                                   nullptr, gather, pair_rows);
    LYNX_TEST_CUDA(cudaDeviceSynchronize());
    return to_host<HostBf16>(out, size_t(cap * N));
  };
  // A gathered into a poisoned buffer, the copies held to `lookahead` row blocks ahead of the tiles: the
  // outputs, A's bytes and the gather's counters after.
  struct Gathered {
    std::vector<HostBf16> out;
    std::vector<uint8_t> a;
    std::vector<int32_t> sync;
  };
  const auto gathered = [&](int32_t lookahead) {
    DeviceBuffer d_a(size_t(cap * K));
    d_a.fill_bytes(0xFF);
    fp8::TileGather gather;
    gather.tokens = d_tokens.as<uint8_t>();
    gather.row_token_slot = d_slot.as<int32_t>();
    gather.top_k = top_k;
    gather.lookahead = lookahead;
    gather.sync = d_sync.as<int32_t>();
    Gathered g;
    g.out = run(d_a, gather);
    g.a = to_host<uint8_t>(d_a, size_t(cap * K));
    g.sync = to_host<int32_t>(d_sync, size_t(gemm::gather_sync_ints(cap)));
    return g;
  };
  const std::vector<HostBf16> want = run(d_pregathered, {});
  const Gathered runs[] = {gathered(8), gathered(1)};
  const DeviceStatus st = *status;
  LYNX_TEST_CUDA(cudaFreeHost(status));
  EXPECT_EQ(st.code, 0) << "a wait stalled: " << st.a << " at " << st.b;
  for (int64_t i = 0; i < total * N; ++i) ASSERT_TRUE(std::isfinite(to_double(want[size_t(i)]))) << "element " << i;
  for (const Gathered& g : runs) {
    SCOPED_TRACE(&g == &runs[0] ? "lookahead 8" : "lookahead 1, the counters left by the launch before");
    EXPECT_EQ(std::memcmp(g.out.data(), want.data(), want.size() * sizeof(HostBf16)), 0)
        << "the gathered A's outputs differ from the pre-gathered A's";
    for (int64_t i = 0; i < cap * K; ++i) {
      ASSERT_EQ(g.a[size_t(i)], a[size_t(i)]) << "a row " << i / K << " column " << i % K;
    }
    for (size_t i = 0; i < g.sync.size(); ++i) ASSERT_EQ(g.sync[i], 0) << "gather counter " << i << " left set";
  }
}

// Rows of 64 and of 180 16-byte pieces (less than one round of a gather warp's loads, and two rounds,
// with a short last K block), experts without rows or of one row, a last column tile of one half; more
// tiles than SMs; tiles in pairs of an expert's row blocks.
TEST_F(Fp8Gemm, GroupedGathersItsRows) {
  expect_gathered_equals_pregathered({200, 0, 128, 1, 300}, 300, 384, 1024);
  expect_gathered_equals_pregathered({77, 129, 0}, 50, 768, 2880);
  expect_gathered_equals_pregathered({4000, 129, 700}, 2000, 1536, 256);
  expect_gathered_equals_pregathered({100, 250, 0, 300, 129, 1, 0, 512, 77}, 600, 512, 640, true);
}

// The grouped form gathers this rank's token tiles only, with its arguments: refused by name before any
// launch.
TEST_F(Fp8Gemm, GroupedGatherIsCheckedBeforeLaunch) {
  DeviceBuffer d(size_t(1) << 20);
  const auto* q = d.as<uint8_t>();
  const auto* s = d.as<float>();
  const auto* offset = d.as<int32_t>();
  fp8::TileGather gather;
  gather.tokens = q;
  gather.row_token_slot = offset;
  gather.top_k = 2;
  gather.lookahead = 1;
  gather.sync = d.as<int32_t>();
  const auto message = [&](const fp8::TileGather& g) {
    try {
      fp8::grouped_gemm_block_scaled(q, s, 128, 128, q, s, 1, 128, offset, d.as<bf16_t>(), nullptr, nullptr, g);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  fp8::TileGather remote = gather;
  remote.tokens = nullptr;
  remote.sources.base = reinterpret_cast<const void* const*>(d.get());
  remote.sources.row_src_rank = offset;
  EXPECT_NE(message(remote).find("this rank's token tiles only"), std::string::npos) << message(remote);
  fp8::TileGather no_lookahead = gather;
  no_lookahead.lookahead = 0;
  EXPECT_NE(message(no_lookahead).find("lookahead"), std::string::npos) << message(no_lookahead);
  fp8::TileGather unaligned = gather;
  unaligned.tokens = q + 8;
  EXPECT_NE(message(unaligned).find("16-byte aligned"), std::string::npos) << message(unaligned);
}

// The gate/up form quantising h in its epilogue (QuantizedH): its codes and scales equal quantize_tiles'
// of the bf16 h the same form writes, bit for bit, over the schedule's rows, and nothing past them is
// written; h, g and u written beside the codes keep their bits. With `nan_weight` one gate weight code of
// expert 0 is an E4M3 NaN: its tiles' scales NaN in both, and both report h, as quantize_tiles does.
void expect_quantised_h_matches_quantize_tiles(const std::vector<int64_t>& rows, int64_t N, int64_t K,
                                               bool nan_weight = false) {
  const auto seed = fresh_seed();
  const int64_t E = int64_t(rows.size()), kbN = fp8::blocks_of(N);
  SCOPED_TRACE("E " + std::to_string(E) + " N " + std::to_string(N) + " K " + std::to_string(K) + " seed " +
               std::to_string(seed) + (nan_weight ? " NaN weight" : ""));
  GroupedOperands ops = grouped_operands(rows, N, K, 2, seed);
  const std::vector<int32_t>& offset = ops.offset;
  const int64_t total = ops.total, cap = ops.cap;
  const ref::fp8::Quantized& qa = ops.qa;
  auto& b_q = ops.b_q;
  const auto& b_scales = ops.b_scales;
  if (nan_weight) b_q[0][size_t(3 * K + 5)] = 0x7F;  // expert 0, gate row 3 (h column 3), K column 5
  DeviceBuffer d_a = to_device(qa.q), d_as = to_device(qa.scales), d_offset = to_device(offset);
  DeviceBuffer d_g = to_device(b_q[0]), d_gs = to_device(b_scales[0]), d_u = to_device(b_q[1]),
               d_us = to_device(b_scales[1]);
  std::vector<int32_t> slot(static_cast<size_t>(cap));
  for (int64_t r = 0; r < cap; ++r) slot[size_t(r)] = r % 3 == 2 ? -1 : int32_t(cap - 1 - r);
  DeviceBuffer d_slot = to_device(slot);
  DeviceStatus* status = nullptr;
  LYNX_TEST_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&status), sizeof(DeviceStatus), cudaHostAllocMapped));
  DeviceStatus* status_device = nullptr;
  LYNX_TEST_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&status_device), status, 0));
  const int64_t what = int64_t(Fp8Tensor::kH);
  struct Run {
    std::vector<HostBf16> h, g, u;
    std::vector<uint8_t> q;
    std::vector<float> scales;
    DeviceStatus status;
  };
  // quantized: the codes from the epilogue, else from quantize_tiles over h; `all`: h, g and u written
  // too (h always where not quantized).
  const auto run = [&](bool quantized, bool all) {
    DeviceBuffer d_h(size_t(cap * N) * 2), d_kg(size_t(cap * N) * 2), d_ku(size_t(cap * N) * 2);
    DeviceBuffer d_q(size_t(cap * N)), d_s(size_t(cap * kbN) * 4);
    for (DeviceBuffer* b : {&d_h, &d_kg, &d_ku, &d_q, &d_s}) b->fill_bytes(0xFF);
    *status = DeviceStatus{};
    const fp8::NonfiniteReport report{nullptr, status_device, what, 0};
    const bool h_out = !quantized || all;
    const fp8::KeptGateUp kept = all ? fp8::KeptGateUp{d_kg.as<bf16_t>(), d_ku.as<bf16_t>(), d_slot.as<int32_t>()}
                                     : fp8::KeptGateUp{};
    fp8::grouped_swiglu_block_scaled(d_a.as<uint8_t>(), d_as.as<float>(), cap, K, d_g.as<uint8_t>(), d_gs.as<float>(),
                                     d_u.as<uint8_t>(), d_us.as<float>(), E, N, d_offset.as<int32_t>(),
                                     h_out ? d_h.as<bf16_t>() : nullptr, nullptr, nullptr, kept,
                                     quantized ? fp8::QuantizedH{d_q.as<uint8_t>(), d_s.as<float>(), report}
                                               : fp8::QuantizedH{});
    if (!quantized) {
      fp8::quantize_tiles(d_h.as<bf16_t>(), cap, N, d_offset.as<int32_t>() + E, d_q.as<uint8_t>(), d_s.as<float>(),
                          report, nullptr);
    }
    LYNX_TEST_CUDA(cudaDeviceSynchronize());
    Run r;
    r.h = to_host<HostBf16>(d_h, size_t(cap * N));
    r.g = to_host<HostBf16>(d_kg, size_t(cap * N));
    r.u = to_host<HostBf16>(d_ku, size_t(cap * N));
    r.q = to_host<uint8_t>(d_q, size_t(cap * N));
    r.scales = to_host<float>(d_s, size_t(cap * kbN));
    r.status = *status;
    return r;
  };
  const Run want = run(false, true), got = run(true, false), both = run(true, true);
  LYNX_TEST_CUDA(cudaFreeHost(status));
  for (const Run* r : {&want, &got, &both}) {
    if (nan_weight) {
      EXPECT_EQ(r->status.code, int32_t(StatusCode::kNonFiniteInput));
      EXPECT_EQ(r->status.a, what);
    } else {
      EXPECT_EQ(r->status.code, 0);
    }
  }
  int64_t nan_tiles = 0;
  for (const Run* r : {&got, &both}) {
    for (int64_t row = 0; row < cap; ++row) {
      for (int64_t b = 0; b < kbN; ++b) {
        const float ws = want.scales[size_t(row * kbN + b)], gs = r->scales[size_t(row * kbN + b)];
        if (row >= total) {  // not written
          ASSERT_EQ(std::memcmp(&gs, &ws, 4), 0) << "row " << row << " past the schedule's, block " << b;
          continue;
        }
        if (std::isnan(ws)) {  // a tile with a NaN: its scale NaN too, its codes unspecified
          ASSERT_TRUE(std::isnan(gs)) << "row " << row << " block " << b;
          nan_tiles += r == &got;
          continue;
        }
        ASSERT_EQ(std::memcmp(&gs, &ws, 4), 0) << "scale of row " << row << " block " << b;
        for (int64_t c = b * 128; c < std::min(N, b * 128 + 128); ++c) {
          ASSERT_EQ(r->q[size_t(row * N + c)], want.q[size_t(row * N + c)]) << "code of row " << row << " column " << c;
        }
      }
      if (row >= total) {
        for (int64_t c = 0; c < N; ++c) ASSERT_EQ(r->q[size_t(row * N + c)], 0xFF) << "row " << row << " written";
      }
    }
  }
  if (nan_weight) {
    EXPECT_GT(nan_tiles, 0) << "the NaN weight reached no tile";
  }
  // Beside the codes, h, g and u keep the bits of the form without them (NaN where the weight is).
  const auto same = [](HostBf16 a, HostBf16 b) {
    return a.bits == b.bits || (std::isnan(to_double(a)) && std::isnan(to_double(b)));
  };
  for (int64_t i = 0; i < cap * N; ++i) {
    ASSERT_TRUE(same(both.h[size_t(i)], want.h[size_t(i)])) << "h element " << i;
    ASSERT_TRUE(same(both.g[size_t(i)], want.g[size_t(i)])) << "kept g element " << i;
    ASSERT_TRUE(same(both.u[size_t(i)], want.u[size_t(i)])) << "kept u element " << i;
  }
}

TEST_F(Fp8Gemm, GroupedSwiGLUQuantisesH) {
  expect_quantised_h_matches_quantize_tiles({200, 0, 128, 1, 300}, 384, 1024);  // three whole blocks
  expect_quantised_h_matches_quantize_tiles({77, 129, 0}, 192, 2880);          // a last block of 64 columns
  expect_quantised_h_matches_quantize_tiles({77, 129}, 208, 1024);             // a last block of 80 columns
  // 48 row blocks × 4 blocks of h: 192 tiles, more than the SMs, so CTAs take several (the code box
  // reused, the stages' phases carried across tiles).
  expect_quantised_h_matches_quantize_tiles({3000, 2000, 1000}, 512, 256);
}
TEST_F(Fp8Gemm, GroupedSwiGLUQuantisedHReportsNonFinite) {
  expect_quantised_h_matches_quantize_tiles({150, 60}, 256, 512, true);
}

TEST_F(Fp8Gemm, GroupedWeightGrad) { expect_weight_grad_matches_reference({130, 0, 300, 64}, 200, 384, 64); }
TEST_F(Fp8Gemm, GroupedWeightGradOneOutput) { expect_weight_grad_matches_reference({1, 257}, 256, 200, 256); }
// An operand width not a multiple of 4 (M): transpose_tiles reads it one value at a time.
TEST_F(Fp8Gemm, GroupedWeightGradOddWidths) { expect_weight_grad_matches_reference({130, 70}, 202, 136, 202); }

// The bf16 outputs go out by TMA in 16-byte pieces: N a multiple of 8 and the outputs 128-byte aligned, and a
// weight gradient's split a multiple of 64 (an epilogue piece's rows) below M; each refused by name
// before anything runs.
TEST_F(Fp8Gemm, Bf16OutputsAreCheckedBeforeLaunch) {
  DeviceBuffer d(size_t(1) << 20);
  const auto* q = d.as<uint8_t>();
  const auto* s = d.as<float>();
  const auto* offset = d.as<int32_t>();
  bf16_t* out = d.as<bf16_t>();
  const auto message = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message([&] { fp8::grouped_gemm_block_scaled(q, s, 128, 128, q, s, 1, 130, offset, out, nullptr, nullptr); })
                .find("multiple of 8"),
            std::string::npos);
  EXPECT_NE(message([&] { fp8::grouped_gemm_block_scaled(q, s, 128, 128, q, s, 1, 136, offset, out + 1, nullptr, nullptr); })
                .find("128-byte aligned"),
            std::string::npos);
  EXPECT_NE(message([&] {
              fp8::grouped_weight_grad_block_scaled(q, s, 200, q, s, 136, 128, 1, offset, out, out + 4096, 120, nullptr,
                                                    nullptr);
            }).find("multiple of 64"),
            std::string::npos);
  EXPECT_NE(message([&] {
              fp8::grouped_weight_grad_block_scaled(q, s + 1, 200, q, s, 136, 128, 1, offset, out, out + 32768, 128,
                                                    nullptr, nullptr);
            }).find("16-byte aligned"),
            std::string::npos);
  EXPECT_NE(message([&] {
              fp8::grouped_swiglu_block_scaled(q, s, 128, 128, q, s, q, s, 1, 136, offset, out + 8, nullptr, nullptr);
            }).find("128-byte aligned"),
            std::string::npos);
  EXPECT_NE(message([&] {
              fp8::grouped_swiglu_block_scaled(q, s, 128, 128, q, s, q, s, 1, 136, offset, out, nullptr, nullptr,
                                               fp8::KeptGateUp{out + 65536 + 4, out + 131072, offset});
            }).find("16-byte aligned"),
            std::string::npos);
}
// An expert starting at K block 2 with 9 blocks: the ring of stages wraps (parities past kStages).
TEST_F(Fp8Gemm, GroupedWeightGradLongExperts) {
  expect_weight_grad_matches_reference({130, 1100, 0, 640}, 128, 256, 128);
}
// More tiles than SMs (3 × 3 × 24), so that CTAs take several: tiles with and without a second half in
// turn (N = 640: 256 + 256 + 128 columns), the second warpgroup's rows past M = 320 in the last row block,
// out and out2 split at 192, experts with 0 to 3 row blocks.
TEST_F(Fp8Gemm, GroupedWeightGradManyTiles) {
  std::vector<int64_t> rows;
  for (int64_t e = 0; e < 24; ++e) rows.push_back((e * 97) % 350);
  expect_weight_grad_matches_reference(rows, 320, 640, 192);
}

}  // namespace
}  // namespace lynx::test
