#include "problem.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "common/cuda_check.h"
#include "random_fill.h"

namespace lynx::bench {

const char* routing_name(Routing r) {
  switch (r) {
    case Routing::kUniform: return "uniform";
    case Routing::kSkewed: return "skewed";
    case Routing::kBalanced: return "balanced";
  }
  return "?";
}

float Problem::gate_up_scale() const { return 2.0f / std::sqrt(float(shape().hidden)); }
float Problem::down_scale() const { return 2.0f / std::sqrt(float(shape().intermediate)); }
float Problem::shared_down_scale() const {
  return shape().shared_intermediate ? 2.0f / std::sqrt(float(shape().shared_intermediate)) : 0.0f;
}

void* Problem::alloc(int64_t bytes) {
  if (bytes == 0) return nullptr;
  void* p = nullptr;
  LYNX_CUDA(cudaMalloc(&p, size_t(bytes)));
  allocations_.push_back(p);
  return p;
}

Problem::Problem(const NamedShape& shape, Routing routing, uint64_t seed) : shape_(shape) {
  const LayerShape& s = shape_.shape;
  const int64_t T = s.tokens, H = s.hidden, I = s.intermediate, k = s.top_k, E = s.local_experts();
  const int64_t Is = s.shared_intermediate;
  seeds_ = {seed + 1, seed + 2, seed + 3, seed + 4, seed + 5, seed + 6, seed + 7, seed + 8};

  // Routing: k distinct experts per token. Uniform: every expert equally likely. Skewed: every fourth
  // token's first pick goes to one of 4 hot experts (as an unbalanced router does early in training),
  // which then receive about 2x an average expert's rows at qwen3-30b-a3b, 3x at deepseek-v3, 1.5x at
  // olmoe-1b-7b and 1.25x at mixtral-8x7b. Balanced: the tokens go in rounds of E / k, each round one
  // random permutation of the experts cut into k-sets, so every expert receives exactly T·k / E rows
  // when k divides E and E / k divides T, as at every benchmark shape (otherwise about as many: the
  // E mod k experts a round leaves out, and a last partial round, make the counts differ by a little).
  // What a perfectly balanced router gives: deepseek-v3 then has no expert with a second, nearly
  // empty row block.
  std::mt19937_64 rng(seed);
  ids_.resize(T * k);
  weights_.resize(T * k);
  std::vector<int32_t> experts(s.num_experts);
  std::iota(experts.begin(), experts.end(), 0);
  std::uniform_real_distribution<float> wdist(0.05f, 1.0f);
  std::uniform_int_distribution<int32_t> hot(0, int32_t(std::min<int64_t>(4, s.num_experts)) - 1);
  const int64_t round = std::max<int64_t>(1, s.num_experts / k);  // tokens per permutation (balanced)
  for (int64_t t = 0; t < T; ++t) {
    const int64_t first = routing == Routing::kBalanced ? t % round * k : 0;
    if (first == 0) std::shuffle(experts.begin(), experts.end(), rng);
    if (routing == Routing::kSkewed && t % 4 == 0) {
      std::swap(experts[0], *std::find(experts.begin(), experts.end(), hot(rng)));
    }
    float sum = 0;
    for (int64_t j = 0; j < k; ++j) sum += weights_[t * k + j] = wdist(rng);
    for (int64_t j = 0; j < k; ++j) {
      ids_[t * k + j] = experts[first + j];
      weights_[t * k + j] /= sum;
    }
  }

  x_ = alloc(T * H * 2);
  ids_d_ = alloc(T * k * 4);
  weights_d_ = alloc(T * k * 4);
  wg_ = alloc(E * I * H * 2);
  wu_ = alloc(E * I * H * 2);
  wd_ = alloc(E * H * I * 2);
  wsg_ = alloc(Is * H * 2);
  wsu_ = alloc(Is * H * 2);
  wsd_ = alloc(H * Is * 2);
  y_ = alloc(T * H * 2);
  dy_ = alloc(T * H * 2);
  dx_ = alloc(T * H * 2);
  dtk_ = alloc(T * k * 4);
  dwg_ = alloc(E * I * H * 2);
  dwu_ = alloc(E * I * H * 2);
  dwd_ = alloc(E * H * I * 2);
  dwsg_ = alloc(Is * H * 2);
  dwsu_ = alloc(Is * H * 2);
  dwsd_ = alloc(H * Is * 2);

  LYNX_CUDA(cudaMemcpy(ids_d_, ids_.data(), T * k * 4, cudaMemcpyHostToDevice));
  LYNX_CUDA(cudaMemcpy(weights_d_, weights_.data(), T * k * 4, cudaMemcpyHostToDevice));
  auto fill = [](void* p, int64_t n, uint64_t sd, float scale) {
    fill_uniform_bf16(static_cast<uint16_t*>(p), n, sd, scale, nullptr);
  };
  fill(x_, T * H, seeds_.x, input_scale());
  fill(dy_, T * H, seeds_.dy, input_scale());
  fill(wg_, E * I * H, seeds_.w_gate, gate_up_scale());
  fill(wu_, E * I * H, seeds_.w_up, gate_up_scale());
  fill(wd_, E * H * I, seeds_.w_down, down_scale());
  fill(wsg_, Is * H, seeds_.ws_gate, gate_up_scale());
  fill(wsu_, Is * H, seeds_.ws_up, gate_up_scale());
  fill(wsd_, H * Is, seeds_.ws_down, shared_down_scale());
  LYNX_CUDA(cudaDeviceSynchronize());
}

Problem::~Problem() {
  for (void* p : allocations_) cudaFree(p);
}

LayerInputs Problem::inputs() const {
  const LayerShape& s = shape();
  const int64_t T = s.tokens, H = s.hidden, I = s.intermediate, k = s.top_k, E = s.local_experts();
  const int64_t Is = s.shared_intermediate;
  LayerInputs in;
  in.x = make_view(x_, DType::kBF16, {T, H});
  in.topk_ids = make_view(ids_d_, DType::kI32, {T, k});
  in.topk_weights = make_view(weights_d_, DType::kF32, {T, k});
  in.weights.w_gate = make_view(wg_, DType::kBF16, {E, I, H});
  in.weights.w_up = make_view(wu_, DType::kBF16, {E, I, H});
  in.weights.w_down = make_view(wd_, DType::kBF16, {E, H, I});
  if (Is > 0) {
    in.weights.ws_gate = make_view(wsg_, DType::kBF16, {Is, H});
    in.weights.ws_up = make_view(wsu_, DType::kBF16, {Is, H});
    in.weights.ws_down = make_view(wsd_, DType::kBF16, {H, Is});
  }
  return in;
}

TensorView Problem::y() const { return make_view(y_, DType::kBF16, {shape().tokens, shape().hidden}); }
TensorView Problem::dy() const { return make_view(dy_, DType::kBF16, {shape().tokens, shape().hidden}); }

Gradients Problem::gradients() const {
  const LayerShape& s = shape();
  const int64_t T = s.tokens, H = s.hidden, I = s.intermediate, k = s.top_k, E = s.local_experts();
  const int64_t Is = s.shared_intermediate;
  Gradients g;
  g.dx = make_view(dx_, DType::kBF16, {T, H});
  g.d_topk_weights = make_view(dtk_, DType::kF32, {T, k});
  g.dw_gate = make_view(dwg_, DType::kBF16, {E, I, H});
  g.dw_up = make_view(dwu_, DType::kBF16, {E, I, H});
  g.dw_down = make_view(dwd_, DType::kBF16, {E, H, I});
  if (Is > 0) {
    g.dws_gate = make_view(dwsg_, DType::kBF16, {Is, H});
    g.dws_up = make_view(dwsu_, DType::kBF16, {Is, H});
    g.dws_down = make_view(dwsd_, DType::kBF16, {H, Is});
  }
  return g;
}

}  // namespace lynx::bench
