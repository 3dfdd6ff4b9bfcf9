#include "precision_bench.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/bf16.h"
#include "common/cuda_check.h"
#include "lynx/lynx.h"
#include "timing.h"

namespace lynx::bench {
namespace {

std::vector<double> y_values(const TensorView& y) {
  std::vector<uint16_t> bits(size_t(y.numel()));
  LYNX_CUDA(cudaMemcpy(bits.data(), y.data, bits.size() * 2, cudaMemcpyDeviceToHost));
  std::vector<double> v(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) {
    const uint32_t f = uint32_t(bits[i]) << 16;
    float x;
    std::memcpy(&x, &f, sizeof x);
    v[i] = x;
  }
  return v;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

}  // namespace

PrecisionResult time_precisions(Problem& p, const Protocol& protocol, int rounds, const GpuClock* clock) {
  Config bf16_config, fp8_config;
  bf16_config.backend = fp8_config.backend = Backend::kFused;
  fp8_config.precision = Precision::kFp8Block;
  Workspace bf16(p.shape(), bf16_config), fp8(p.shape(), fp8_config);
  const LayerInputs in = p.inputs();
  const TensorView y = p.y();
  const size_t y_bytes = size_t(y.numel()) * 2;
  quantize_weights(fp8, in.weights, nullptr);
  forward(bf16, in, y, nullptr);
  bf16.check(nullptr);
  const std::vector<double> want = y_values(y);
  LYNX_CUDA(cudaMemset(y.data, 0xFF, y_bytes));
  forward(fp8, in, y, nullptr);
  fp8.check(nullptr);
  const std::vector<double> got = y_values(y);
  PrecisionResult r{};
  r.finite = std::all_of(got.begin(), got.end(), [](double v) { return std::isfinite(v); });
  double dot = 0.0, aa = 0.0, bb = 0.0;
  for (size_t i = 0; i < got.size(); ++i) dot += got[i] * want[i], aa += got[i] * got[i], bb += want[i] * want[i];
  r.dissimilarity = aa + bb > 0.0 ? 1.0 - 2.0 * dot / (aa + bb) : 0.0;
  const char* names[] = {"forward bf16", "forward fp8", "quantize_weights"};
  std::vector<double> ms[3];
  ClockSummary clocks[3];
  for (int round = 0; round < rounds; ++round) {
    const Timing t[3] = {time_pass([&] { forward(bf16, in, y, nullptr); }, protocol, nullptr, clock),
                         time_pass([&] { forward(fp8, in, y, nullptr); }, protocol, nullptr, clock),
                         time_pass([&] { quantize_weights(fp8, in.weights, nullptr); }, protocol, nullptr, clock)};
    for (int i = 0; i < 3; ++i) ms[i].push_back(t[i].ms), clocks[i] = t[i].clocks;
  }
  bf16.check(nullptr);
  fp8.check(nullptr);
  for (int i = 0; i < 3; ++i) r.rows.push_back({names[i], median(ms[i]), clocks[i]});
  return r;
}

}  // namespace lynx::bench
