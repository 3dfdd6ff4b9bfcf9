#include "precision_bench.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <initializer_list>

#include "common/bf16.h"
#include "common/cuda_check.h"
#include "lynx/lynx.h"
#include "timing.h"

namespace lynx::bench {
namespace {

std::vector<double> values(const TensorView& t) {  // a bf16 tensor's
  std::vector<uint16_t> bits(size_t(t.numel()));
  LYNX_CUDA(cudaMemcpy(bits.data(), t.data, bits.size() * 2, cudaMemcpyDeviceToHost));
  std::vector<double> v(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) {
    const uint32_t f = uint32_t(bits[i]) << 16;
    float x;
    std::memcpy(&x, &f, sizeof x);
    v[i] = x;
  }
  return v;
}

double dissimilarity(const std::vector<double>& a, const std::vector<double>& b) {
  double dot = 0.0, aa = 0.0, bb = 0.0;
  for (size_t i = 0; i < a.size(); ++i) dot += a[i] * b[i], aa += a[i] * a[i], bb += b[i] * b[i];
  return aa + bb > 0.0 ? 1.0 - 2.0 * dot / (aa + bb) : 0.0;
}

// FNV-1a over the bytes of device tensors, in order: whether two builds give the same bits.
uint64_t digest(std::initializer_list<TensorView> tensors) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (const TensorView& t : tensors) {
    std::vector<uint8_t> bytes(size_t(t.numel() * dtype_size(t.dtype)));
    LYNX_CUDA(cudaMemcpy(bytes.data(), t.data, bytes.size(), cudaMemcpyDeviceToHost));
    for (const uint8_t b : bytes) h = (h ^ b) * 0x100000001b3ull;
  }
  return h;
}

bool all_finite(const std::vector<double>& v) {
  return std::all_of(v.begin(), v.end(), [](double x) { return std::isfinite(x); });
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

}  // namespace

PrecisionResult time_precisions(Problem& p, const Protocol& protocol, int rounds, const GpuClock* clock,
                                bool forward_only) {
  Config bf16_config, fp8_config;
  bf16_config.backend = fp8_config.backend = Backend::kFused;
  fp8_config.precision = Precision::kFp8Block;
  Config fp8_bf16_wgrad_config = fp8_config;
  fp8_bf16_wgrad_config.bf16_weight_grads = true;
  // NOTES: the two FP8 workspaces read one set of E4M3 weight copies, as one layer's would, the second
  // made on the first's (6·E·I·H bytes less: 21 GiB at deepseek-v3, whose three workspaces beside the
  // bf16 weights and their gradients did not fit 80 GB, neither with the copies shared after the fact).
  Workspace bf16(p.shape(), bf16_config), fp8(p.shape(), fp8_config);
  Workspace fp8_bf16_wgrad(p.shape(), fp8_bf16_wgrad_config, fp8);
  const LayerInputs in = p.inputs();
  const Gradients grads = p.gradients();
  const TensorView y = p.y(), dy = p.dy();
  quantize_weights(fp8, in.weights, nullptr);
  // Each precision's y and dx (dx empty forward only), from outputs poisoned with NaN.
  auto outputs = [&](Workspace& ws) {
    LYNX_CUDA(cudaMemset(y.data, 0xFF, size_t(y.numel()) * 2));
    LYNX_CUDA(cudaMemset(grads.dx.data, 0xFF, size_t(grads.dx.numel()) * 2));
    forward(ws, in, y, nullptr);
    if (!forward_only) backward(ws, in, dy, grads, nullptr);
    ws.check(nullptr);
    return std::make_pair(values(y), forward_only ? std::vector<double>{} : values(grads.dx));
  };
  const auto want = outputs(bf16), got = outputs(fp8);
  PrecisionResult r{};
  const auto all_outputs = [&] {
    return forward_only ? digest({y}) : digest({y, grads.dx, grads.d_topk_weights, grads.dw_gate, grads.dw_up,
                                                grads.dw_down});
  };
  r.fp8_bits = all_outputs();
  if (!forward_only) {
    outputs(fp8_bf16_wgrad);
    r.fp8_bf16_wgrad_bits = all_outputs();
  }
  r.finite = all_finite(got.first) && all_finite(got.second);
  r.dissimilarity = dissimilarity(got.first, want.first);
  r.dx_dissimilarity = dissimilarity(got.second, want.second);
  const std::function<void()> passes[] = {
      [&] { forward(bf16, in, y, nullptr); },
      [&] { forward(fp8, in, y, nullptr); },
      [&] {
        forward(bf16, in, y, nullptr);
        backward(bf16, in, dy, grads, nullptr);
      },
      [&] {
        forward(fp8, in, y, nullptr);
        backward(fp8, in, dy, grads, nullptr);
      },
      [&] {
        forward(fp8_bf16_wgrad, in, y, nullptr);
        backward(fp8_bf16_wgrad, in, dy, grads, nullptr);
      },
      [&] { quantize_weights(fp8, in.weights, nullptr); }};
  const char* names[] = {"forward bf16", "forward fp8", "fwd+bwd bf16", "fwd+bwd fp8", "fwd+bwd fp8, bf16 wgrad",
                         "quantize_weights"};
  const std::vector<int> timed = forward_only ? std::vector<int>{0, 1, 5} : std::vector<int>{0, 1, 2, 3, 4, 5};
  std::vector<double> ms[6];
  ClockSummary clocks[6];
  for (int round = 0; round < rounds; ++round) {
    for (const int i : timed) {
      const Timing t = time_pass(passes[i], protocol, nullptr, clock);
      ms[i].push_back(t.ms), clocks[i] = t.clocks;
    }
  }
  bf16.check(nullptr);
  fp8.check(nullptr);
  fp8_bf16_wgrad.check(nullptr);
  for (const int i : timed) r.rows.push_back({names[i], median(ms[i]), clocks[i]});
  return r;
}

}  // namespace lynx::bench
