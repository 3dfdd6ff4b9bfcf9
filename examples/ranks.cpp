// Expert parallelism from C++: one layer's forward and backward on R virtual ranks of this GPU,
// checked bit for bit against one rank holding every token and every expert.
//   usage: lynx-example-ranks [R] [--fp8]   (default 4; E = 16 experts and T = 1024 tokens must divide by
//   R; --fp8: Config::precision = kFp8Block, each rank quantising its own experts' weights)
// With one process per rank, each process makes only its own Workspace, calls
// lynx::connect_process_group with an all-gather of its choice, and then lynx::forward / backward.
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "lynx/lynx.h"

namespace {

void cuda(cudaError_t err) {
  if (err != cudaSuccess) {
    std::fprintf(stderr, "CUDA: %s\n", cudaGetErrorString(err));
    std::exit(1);
  }
}

// `bytes` of device memory, copied from `host` (or zeroed).
void* device(size_t bytes, const void* host = nullptr) {
  void* p = nullptr;
  cuda(cudaMalloc(&p, bytes));
  cuda(host ? cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice) : cudaMemset(p, 0, bytes));
  return p;
}

std::vector<uint16_t> random_bf16(std::mt19937& rng, size_t n, float scale) {
  std::uniform_real_distribution<float> d(-scale, scale);
  std::vector<uint16_t> v(n);
  for (auto& x : v) {
    const float f = d(rng);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    x = uint16_t(u >> 16);
  }
  return v;
}

char* at(void* p, int64_t bytes) { return static_cast<char*>(p) + bytes; }

}  // namespace

int main(int argc, char** argv) {
  int32_t R = 4;
  lynx::Config config;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--fp8") == 0) config.precision = lynx::Precision::kFp8Block;
    else R = std::atoi(argv[i]);
  }
  const int64_t T = 1024, H = 512, I = 256, E = 16, k = 4;
  if (R < 1 || T % R || E % R) {
    std::fprintf(stderr, "R must divide T = %lld and E = %lld\n", (long long)T, (long long)E);
    return 2;
  }
  // The global problem: T tokens, E experts.
  std::mt19937 rng(1);
  const auto x = random_bf16(rng, T * H, 1.0f), dy = random_bf16(rng, T * H, 1.0f);
  const auto wg = random_bf16(rng, E * I * H, 0.05f), wu = random_bf16(rng, E * I * H, 0.05f);
  const auto wd = random_bf16(rng, E * H * I, 0.05f);
  std::vector<int32_t> ids(T * k);
  std::vector<float> weights(T * k);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < k; ++j) ids[t * k + j] = int32_t((t * 7 + j * 5 + rng() % 3) % E), weights[t * k + j] = 0.25f;
  }
  void *d_x = device(2 * T * H, x.data()), *d_dy = device(2 * T * H, dy.data());
  void *d_wg = device(2 * E * I * H, wg.data()), *d_wu = device(2 * E * I * H, wu.data());
  void *d_wd = device(2 * E * H * I, wd.data());
  void *d_ids = device(4 * T * k, ids.data()), *d_w = device(4 * T * k, weights.data());

  // Outputs of one run in the global layout: y, dx, d_topk_weights, dw_gate, dw_up, dw_down.
  const size_t sizes[] = {size_t(2 * T * H), size_t(2 * T * H), size_t(4 * T * k), size_t(2 * E * I * H),
                          size_t(2 * E * I * H), size_t(2 * E * H * I)};
  const auto run = [&](int32_t ranks) {
    std::vector<void*> out;
    for (size_t b : sizes) out.push_back(device(b));
    const int64_t Tr = T / ranks, Er = E / ranks;
    std::vector<std::unique_ptr<lynx::Workspace>> owned;
    std::vector<lynx::Workspace*> ws;
    std::vector<lynx::LayerInputs> in;
    std::vector<lynx::TensorView> y, dys;
    std::vector<lynx::Gradients> grads;
    for (int32_t r = 0; r < ranks; ++r) {
      lynx::LayerShape s{.tokens = Tr, .hidden = H, .intermediate = I, .num_experts = E, .top_k = k,
                         .num_ranks = ranks, .rank = r};
      owned.push_back(std::make_unique<lynx::Workspace>(s, config));
      ws.push_back(owned.back().get());
      lynx::LayerInputs li;  // rank r: tokens [r·Tr, (r+1)·Tr), experts [r·Er, (r+1)·Er)
      li.x = lynx::make_view(at(d_x, 2 * r * Tr * H), lynx::DType::kBF16, {Tr, H});
      li.topk_ids = lynx::make_view(at(d_ids, 4 * r * Tr * k), lynx::DType::kI32, {Tr, k});
      li.topk_weights = lynx::make_view(at(d_w, 4 * r * Tr * k), lynx::DType::kF32, {Tr, k});
      li.weights.w_gate = lynx::make_view(at(d_wg, 2 * r * Er * I * H), lynx::DType::kBF16, {Er, I, H});
      li.weights.w_up = lynx::make_view(at(d_wu, 2 * r * Er * I * H), lynx::DType::kBF16, {Er, I, H});
      li.weights.w_down = lynx::make_view(at(d_wd, 2 * r * Er * H * I), lynx::DType::kBF16, {Er, H, I});
      in.push_back(li);
      y.push_back(lynx::make_view(at(out[0], 2 * r * Tr * H), lynx::DType::kBF16, {Tr, H}));
      dys.push_back(lynx::make_view(at(d_dy, 2 * r * Tr * H), lynx::DType::kBF16, {Tr, H}));
      lynx::Gradients g;
      g.dx = lynx::make_view(at(out[1], 2 * r * Tr * H), lynx::DType::kBF16, {Tr, H});
      g.d_topk_weights = lynx::make_view(at(out[2], 4 * r * Tr * k), lynx::DType::kF32, {Tr, k});
      g.dw_gate = lynx::make_view(at(out[3], 2 * r * Er * I * H), lynx::DType::kBF16, {Er, I, H});
      g.dw_up = lynx::make_view(at(out[4], 2 * r * Er * I * H), lynx::DType::kBF16, {Er, I, H});
      g.dw_down = lynx::make_view(at(out[5], 2 * r * Er * H * I), lynx::DType::kBF16, {Er, H, I});
      grads.push_back(g);
    }
    lynx::connect_ranks(ws);
    if (config.precision == lynx::Precision::kFp8Block) {
      for (int32_t r = 0; r < ranks; ++r) lynx::quantize_weights(*ws[r], in[r].weights, nullptr);
    }
    lynx::forward_ranks(ws, in, y, nullptr);
    lynx::backward_ranks(ws, in, dys, grads, nullptr);
    for (lynx::Workspace* w : ws) w->check(nullptr);
    std::vector<std::vector<uint8_t>> host;
    for (size_t i = 0; i < out.size(); ++i) {
      host.emplace_back(sizes[i]);
      cuda(cudaMemcpy(host.back().data(), out[i], sizes[i], cudaMemcpyDeviceToHost));
      cuda(cudaFree(out[i]));
    }
    return host;
  };
  try {
    const auto one = run(1), many = run(R);
    const char* names[] = {"y", "dx", "d_topk_weights", "dw_gate", "dw_up", "dw_down"};
    bool same = true;
    for (size_t i = 0; i < one.size(); ++i) {
      const bool eq = one[i] == many[i];
      same = same && eq;
      std::printf("%-15s R = %d %s R = 1\n", names[i], R, eq ? "==" : "!=");
    }
    const char* precision = config.precision == lynx::Precision::kFp8Block ? "FP8" : "bf16";
    std::printf(same ? "%s: every output of R = %d ranks equals R = 1 bit for bit\n"
                     : "%s: R = %d DIFFERS from R = 1\n",
                precision, R);
    return same ? 0 : 1;
  } catch (const lynx::Error& e) {
    std::fprintf(stderr, "lynx: %s\n", e.what());
    return 1;
  }
}
