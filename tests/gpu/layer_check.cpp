// The shared layer test helpers of layer_check.h.
#include "gpu/layer_check.h"

#include <algorithm>
#include <limits>
#include <cstring>
#include <initializer_list>
#include <numeric>

#include "common/parallel.h"
#include "experiments/test_hooks.h"
#include "runtime/workspace.h"

namespace lynx::test {

void parallel_for(int64_t n, const std::function<void(int64_t)>& body) {
  lynx::parallel_for(n, 0, [&](int64_t i, int64_t) { body(i); });
}

LayerStack layers_with_outputs(const Case& c, int n, std::mt19937_64& rng, const Config& config, bool recompute) {
  LayerStack s;
  for (int i = 0; i < n; ++i) {
    s.layers.push_back(std::make_unique<HostLayer>(c, rng()));
    s.dy.push_back(random_bf16(rng, c.T * c.H, 1.0));
    Workspace owning(s.layers.back()->shape, config);
    s.want.push_back(run_layer(owning, *s.layers.back(), s.dy.back(), recompute));
  }
  return s;
}

std::vector<HostBf16> random_bf16(std::mt19937_64& rng, int64_t n, double scale) {
  // NOTES: in chunks of 64 Ki values, each from a generator of its own seeded by one draw of rng and
  // the chunk's index, filled in parallel: drawing a large case's weights one value at a time took
  // most of a random case's time.
  constexpr int64_t kChunk = int64_t(1) << 16;
  const uint64_t base = rng();
  std::vector<HostBf16> v(n);
  parallel_for((n + kChunk - 1) / kChunk, [&](int64_t c) {
    std::mt19937_64 chunk_rng(base ^ (0x9e3779b97f4a7c15ull * uint64_t(c + 1)));
    std::normal_distribution<float> dist(0.0f, 1.0f);
    const int64_t end = std::min(n, (c + 1) * kChunk);
    for (int64_t i = c * kChunk; i < end; ++i) v[i] = float_to_bf16(static_cast<float>(scale) * dist(chunk_rng));
  });
  return v;
}

std::vector<double> to_double_vec(const std::vector<HostBf16>& v) {
  std::vector<double> d(v.size());
  for (size_t i = 0; i < v.size(); ++i) d[i] = to_double(v[i]);
  return d;
}

HostLayer::HostLayer(const Case& cs, uint64_t seed) : c(cs) {
  std::mt19937_64 rng(seed);
  shape.tokens = c.T;
  shape.hidden = c.H;
  shape.intermediate = c.I;
  shape.num_experts = c.E;
  shape.top_k = c.k;
  shape.shared_intermediate = c.Is;
  x = random_bf16(rng, c.T * c.H, 1.0);
  w_gate = random_bf16(rng, c.E * c.I * c.H, 2.0 / std::sqrt(double(c.H)));
  w_up = random_bf16(rng, c.E * c.I * c.H, 2.0 / std::sqrt(double(c.H)));
  w_down = random_bf16(rng, c.E * c.H * c.I, 1.0 / std::sqrt(double(c.I)));
  if (c.Is > 0) {
    ws_gate = random_bf16(rng, c.Is * c.H, 2.0 / std::sqrt(double(c.H)));
    ws_up = random_bf16(rng, c.Is * c.H, 2.0 / std::sqrt(double(c.H)));
    ws_down = random_bf16(rng, c.H * c.Is, 1.0 / std::sqrt(double(c.Is)));
  }
  ids.resize(c.T * c.k);
  weights.resize(c.T * c.k);
  std::vector<int32_t> experts(c.E);
  std::iota(experts.begin(), experts.end(), 0);
  std::uniform_real_distribution<float> wdist(0.05f, 1.0f);
  for (int64_t t = 0; t < c.T; ++t) {
    std::shuffle(experts.begin(), experts.end(), rng);
    for (int64_t j = 0; j < c.k; ++j) {
      int32_t e = experts[j];
      if (c.routing == "subset") e = (j % 2 == 0) ? 0 : int32_t(c.E - 1);
      if (c.routing == "one") e = int32_t(c.E / 2);
      if (c.routing == "cyclic") e = int32_t((t + j) % c.E);
      ids[t * c.k + j] = e;
      weights[t * c.k + j] = (c.zero_weights && (t * c.k + j) % 3 == 0) ? 0.0f : wdist(rng);
    }
  }
  for (int64_t t = 0; t < c.T; ++t) {
    for (int64_t j = 0; j < c.k; ++j) {
      if (routed(c, t, j)) continue;
      ids[t * c.k + j] = -1;
      weights[t * c.k + j] = std::numeric_limits<float>::quiet_NaN();
    }
  }
  d_x = to_device(x);
  if (c.int64_ids) {
    d_ids = to_device(std::vector<int64_t>(ids.begin(), ids.end()));
  } else {
    d_ids = to_device(ids);
  }
  d_weights = to_device(weights);
  d_wg = to_device(w_gate);
  d_wu = to_device(w_up);
  d_wd = to_device(w_down);
  if (c.Is > 0) {
    d_wsg = to_device(ws_gate);
    d_wsu = to_device(ws_up);
    d_wsd = to_device(ws_down);
  }
}

LayerInputs HostLayer::inputs() const {
  LayerInputs in;
  in.x = make_view(d_x.get(), DType::kBF16, {c.T, c.H});
  in.topk_ids = make_view(d_ids.get(), c.int64_ids ? DType::kI64 : DType::kI32, {c.T, c.k});
  in.topk_weights = make_view(d_weights.get(), DType::kF32, {c.T, c.k});
  in.weights.w_gate = make_view(d_wg.get(), DType::kBF16, {c.E, c.I, c.H});
  in.weights.w_up = make_view(d_wu.get(), DType::kBF16, {c.E, c.I, c.H});
  in.weights.w_down = make_view(d_wd.get(), DType::kBF16, {c.E, c.H, c.I});
  if (c.Is > 0) {
    in.weights.ws_gate = make_view(d_wsg.get(), DType::kBF16, {c.Is, c.H});
    in.weights.ws_up = make_view(d_wsu.get(), DType::kBF16, {c.Is, c.H});
    in.weights.ws_down = make_view(d_wsd.get(), DType::kBF16, {c.H, c.Is});
  }
  return in;
}

std::vector<double> HostLayer::weights_double() const { return std::vector<double>(weights.begin(), weights.end()); }

ref::Layer<HostBf16> HostLayer::reference(const std::vector<double>& w) const {
  ref::Layer<HostBf16> r;
  r.T = c.T, r.H = c.H, r.I = c.I, r.E = c.E, r.k = c.k, r.I_shared = c.Is;
  r.x = x.data();
  r.topk_ids = ids.data();
  r.topk_weights = w.data();
  r.w_gate = w_gate.data();
  r.w_up = w_up.data();
  r.w_down = w_down.data();
  r.ws_gate = ws_gate.data();
  r.ws_up = ws_up.data();
  r.ws_down = ws_down.data();
  return r;
}

std::string first_difference(const Outputs& a, const Outputs& b) {
  auto same = [](const auto& x, const auto& y) {
    return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(x[0])) == 0;
  };
  if (!same(a.y, b.y)) return "y";
  if (!same(a.dx, b.dx)) return "dx";
  if (!same(a.d_topk, b.d_topk)) return "d_topk_weights";
  if (!same(a.dw_gate, b.dw_gate)) return "dw_gate";
  if (!same(a.dw_up, b.dw_up)) return "dw_up";
  if (!same(a.dw_down, b.dw_down)) return "dw_down";
  if (!same(a.dws_gate, b.dws_gate)) return "dws_gate";
  if (!same(a.dws_up, b.dws_up)) return "dws_up";
  if (!same(a.dws_down, b.dws_down)) return "dws_down";
  return "";
}

OutputBuffers::OutputBuffers(const Case& cs)
    : c(cs), y(c.T * c.H * 2), dx(c.T * c.H * 2), dtk(c.T * c.k * 4), dwg(c.E * c.I * c.H * 2),
      dwu(c.E * c.I * c.H * 2), dwd(c.E * c.H * c.I * 2), dwsg(c.Is * c.H * 2), dwsu(c.Is * c.H * 2),
      dwsd(c.H * c.Is * 2) {}

void OutputBuffers::poison() {
  for (DeviceBuffer* b : {&y, &dx, &dtk, &dwg, &dwu, &dwd, &dwsg, &dwsu, &dwsd}) b->fill_bytes(0xFF);
}

TensorView OutputBuffers::y_view() const { return make_view(y.get(), DType::kBF16, {c.T, c.H}); }

Gradients OutputBuffers::grads() const {
  Gradients g;
  g.dx = make_view(dx.get(), DType::kBF16, {c.T, c.H});
  g.d_topk_weights = make_view(dtk.get(), DType::kF32, {c.T, c.k});
  g.dw_gate = make_view(dwg.get(), DType::kBF16, {c.E, c.I, c.H});
  g.dw_up = make_view(dwu.get(), DType::kBF16, {c.E, c.I, c.H});
  g.dw_down = make_view(dwd.get(), DType::kBF16, {c.E, c.H, c.I});
  if (c.Is > 0) {
    g.dws_gate = make_view(dwsg.get(), DType::kBF16, {c.Is, c.H});
    g.dws_up = make_view(dwsu.get(), DType::kBF16, {c.Is, c.H});
    g.dws_down = make_view(dwsd.get(), DType::kBF16, {c.H, c.Is});
  }
  return g;
}

Outputs OutputBuffers::to_host_outputs() const {
  LYNX_TEST_CUDA(cudaDeviceSynchronize());
  Outputs o;
  o.y = to_host<HostBf16>(y, c.T * c.H);
  o.dx = to_host<HostBf16>(dx, c.T * c.H);
  o.d_topk = to_host<float>(dtk, c.T * c.k);
  o.dw_gate = to_host<HostBf16>(dwg, c.E * c.I * c.H);
  o.dw_up = to_host<HostBf16>(dwu, c.E * c.I * c.H);
  o.dw_down = to_host<HostBf16>(dwd, c.E * c.H * c.I);
  o.dws_gate = to_host<HostBf16>(dwsg, c.Is * c.H);
  o.dws_up = to_host<HostBf16>(dwsu, c.Is * c.H);
  o.dws_down = to_host<HostBf16>(dwsd, c.H * c.Is);
  return o;
}

Outputs run_layer(Workspace& ws, const HostLayer& L, const std::vector<HostBf16>& dy, bool recompute) {
  return run_layer(ws, L, L.inputs(), dy, recompute);
}

Outputs run_layer(Workspace& ws, const HostLayer& L, const LayerInputs& in, const std::vector<HostBf16>& dy,
                  bool recompute) {
  const Case& c = L.c;
  OutputBuffers out(c);
  out.poison();
  DeviceBuffer d_dy = to_device(dy);
  forward(ws, in, out.y_view(), nullptr);
  if (recompute) recompute_forward_context(ws, in, nullptr);
  backward(ws, in, make_view(d_dy.get(), DType::kBF16, {c.T, c.H}), out.grads(), nullptr);
  return out.to_host_outputs();
}

GateUpHalves::GateUpHalves(const HostLayer& L)
    : c(L.c), n(c.I * c.H), stride(2 * n + kGap), host(size_t(c.E * stride), float_to_bf16(-3.0f)),
      grads(size_t(c.E * stride) * 2) {
  for (int64_t e = 0; e < c.E; ++e) {
    std::copy_n(L.w_gate.begin() + e * n, n, host.begin() + e * stride);
    std::copy_n(L.w_up.begin() + e * n, n, host.begin() + e * stride + n);
  }
  weights = to_device(host);
  grads.fill_bytes(0xFF);
}

void GateUpHalves::views(int64_t e0, int64_t E, ExpertWeights& w, Gradients& g, bool up_too) const {
  const auto half = [&](void* base, int64_t offset, TensorView& v) {
    v = make_view(static_cast<HostBf16*>(base) + e0 * stride + offset, DType::kBF16, {E, c.I, c.H});
    v.strides[0] = stride;
  };
  half(weights.get(), 0, w.w_gate);
  half(grads.get(), 0, g.dw_gate);
  if (up_too) {
    half(weights.get(), n, w.w_up);
    half(grads.get(), n, g.dw_up);
  }
}

void GateUpHalves::expect_gradients_and_weights(Outputs& got, bool up_too) const {
  const std::vector<HostBf16> dgu = to_host<HostBf16>(grads, host.size());
  got.dw_gate.assign(size_t(c.E * n), HostBf16{});
  if (up_too) got.dw_up.assign(size_t(c.E * n), HostBf16{});
  int64_t gap_written = 0;
  for (int64_t e = 0; e < c.E; ++e) {
    std::copy_n(dgu.begin() + e * stride, n, got.dw_gate.begin() + e * n);
    if (up_too) std::copy_n(dgu.begin() + e * stride + n, n, got.dw_up.begin() + e * n);
    for (int64_t i = up_too ? 2 * n : n; i < stride; ++i) gap_written += dgu[size_t(e * stride + i)].bits != 0xFFFF;
  }
  EXPECT_EQ(gap_written, 0) << "elements written between the experts' gradients";
  const std::vector<HostBf16> after = to_host<HostBf16>(weights, host.size());
  EXPECT_EQ(std::memcmp(after.data(), host.data(), host.size() * sizeof(HostBf16)), 0) << "the weights changed";
}

void expect_gate_up_halves_give_the_same_bits(const Case& c, const Config& config, bool gate_only) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const HostLayer L(c, seed);
  const std::vector<HostBf16> dy = random_dy(c);
  const bool fp8 = config.precision == Precision::kFp8Block;
  Outputs want;
  {
    Workspace ws(L.shape, config);
    if (fp8) quantize_weights(ws, L.inputs().weights, nullptr);
    want = run_layer(ws, L, dy);
  }
  const GateUpHalves joined(L);
  LayerInputs in = L.inputs();
  OutputBuffers out(c);
  out.poison();
  Gradients g = out.grads();
  joined.views(0, c.E, in.weights, g, !gate_only);
  Workspace ws(L.shape, config);
  if (fp8) quantize_weights(ws, in.weights, nullptr);
  DeviceBuffer d_dy = to_device(dy);
  forward(ws, in, out.y_view(), nullptr);
  backward(ws, in, make_view(d_dy.get(), DType::kBF16, {c.T, c.H}), g, nullptr);
  ws.check(nullptr);
  Outputs got = out.to_host_outputs();
  joined.expect_gradients_and_weights(got, !gate_only);
  EXPECT_EQ(first_difference(got, want), "");
}

void expect_weight_grads_can_be_left_out(Workspace& ws, const HostLayer& L) {
  const Case& c = L.c;
  const std::vector<HostBf16> dy = random_dy(c);
  const Outputs all = run_layer(ws, L, dy);
  DeviceBuffer d_dy = to_device(dy);
  for (const bool expert : {false, true}) {
    for (const bool shared : {false, true}) {
      if (expert && (shared || c.Is == 0)) continue;  // the whole backward, or the same as it
      SCOPED_TRACE(std::string("expert weight gradients ") + (expert ? "given" : "left out") +
                   ", shared expert's " + (shared ? "given" : "left out"));
      OutputBuffers out(c);
      out.poison();
      Gradients g = out.grads();
      if (!expert) g.dw_gate = g.dw_up = g.dw_down = TensorView{};
      if (!shared) g.dws_gate = g.dws_up = g.dws_down = TensorView{};
      forward(ws, L.inputs(), out.y_view(), nullptr);
      backward(ws, L.inputs(), make_view(d_dy.get(), DType::kBF16, {c.T, c.H}), g, nullptr);
      ws.check(nullptr);
      Outputs got = out.to_host_outputs();
      if (!expert) got.dw_gate = all.dw_gate, got.dw_up = all.dw_up, got.dw_down = all.dw_down;
      if (!shared) got.dws_gate = all.dws_gate, got.dws_up = all.dws_up, got.dws_down = all.dws_down;
      EXPECT_EQ(first_difference(got, all), "");
    }
  }
}

void expect_graph_replays_match_reference(Workspace& ws, HostLayer& L, bool eager_first) {
  const Case& c = L.c;
  OutputBuffers out(c);
  std::mt19937_64 rng(fresh_seed());
  const std::vector<HostBf16> dy_host = random_bf16(rng, c.T * c.H, 1.0);
  DeviceBuffer dy = to_device(dy_host);
  const Gradients g = out.grads();
  const TensorView yv = out.y_view();
  const TensorView dyv = make_view(dy.get(), DType::kBF16, {c.T, c.H});
  // NOTES: a blocking stream, so that the synchronous-looking cudaMemcpy / cudaMemset of new routing
  // and poison (legacy default stream) are ordered before each replay.
  cudaStream_t stream;
  LYNX_TEST_CUDA(cudaStreamCreate(&stream));
  if (eager_first) {
    forward(ws, L.inputs(), yv, stream);
    backward(ws, L.inputs(), dyv, g, stream);
    ws.check(stream);
  }
  cudaGraph_t graph;
  LYNX_TEST_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  forward(ws, L.inputs(), yv, stream);
  backward(ws, L.inputs(), dyv, g, stream);
  LYNX_TEST_CUDA(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  LYNX_TEST_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 2; ++replay) {
    const HostLayer fresh(c, rng());
    L.ids = fresh.ids;
    L.weights = fresh.weights;
    // Into the same buffers: the graph reads them where it was captured.
    if (c.int64_ids) {
      const std::vector<int64_t> ids(L.ids.begin(), L.ids.end());
      upload(L.d_ids.get(), ids.data(), ids.size() * 8);
    } else {
      upload(L.d_ids.get(), L.ids.data(), L.ids.size() * 4);
    }
    upload(L.d_weights.get(), L.weights.data(), L.weights.size() * 4);
    out.poison();
    LYNX_TEST_CUDA(cudaGraphLaunch(exec, stream));
    ws.check(stream);
    SCOPED_TRACE("replay " + std::to_string(replay));
    expect_matches_reference(out.to_host_outputs(), L, dy_host);
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

void expect_d_topk_values_near(const std::vector<float>& got, const ref::Gradients& g,
                               const std::vector<double>& scale, double tolerance) {
  ASSERT_EQ(got.size(), scale.size());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_LE(std::abs(double(got[i]) - g.d_topk_weights[i]), tolerance * scale[i])
        << "d_topk_weights[" << i << "] = " << got[i] << ", reference " << g.d_topk_weights[i]
        << " (its terms' magnitude " << g.d_topk_magnitude[i] << ", root-sum-square " << g.d_topk_term_rss[i] << ")";
  }
}

void expect_rows_near(const std::vector<HostBf16>& got, const std::vector<double>& want, int64_t width,
                      const char* what) {
  constexpr double kRowBound = 0.1, kRowFloor = 0.25;  // layer_check.h says why
  ASSERT_EQ(got.size(), want.size()) << what;
  const int64_t rows = int64_t(want.size()) / width;
  std::vector<double> norm(size_t(rows), 0.0), err(size_t(rows), 0.0);
  double sum_sq = 0;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = r * width; i < (r + 1) * width; ++i) {
      const double d = to_double(got[size_t(i)]) - want[size_t(i)];
      norm[size_t(r)] += want[size_t(i)] * want[size_t(i)];
      err[size_t(r)] += d * d;  // NaN stays NaN, and fails below
    }
    sum_sq += norm[size_t(r)];
  }
  const double floor = kRowFloor * std::sqrt(sum_sq / double(std::max<int64_t>(rows, 1)));
  for (int64_t r = 0; r < rows; ++r) {
    const double e = std::sqrt(err[size_t(r)]) / std::max(std::sqrt(norm[size_t(r)]), floor);
    ASSERT_TRUE(e <= kRowBound) << what << " row " << r << ": relative error " << e << " (norm "
                                    << std::sqrt(norm[size_t(r)]) << ", rows' rms norm " << floor / kRowFloor << ")";
  }
}

void expect_matches_reference(const Outputs& o, const HostLayer& L, const std::vector<HostBf16>& dy) {
  const Case& c = L.c;
  const std::vector<double> w = L.weights_double();
  const ref::Layer<HostBf16> r = L.reference(w);
  const std::vector<double> y_ref = ref::forward(r);
  const ref::Gradients g = ref::backward(r, to_double_vec(dy).data());
  EXPECT_LT(rel_error(o.y, y_ref, "y"), kTolerance);
  EXPECT_LT(rel_error(o.dx, g.dx, "dx"), kTolerance);
  expect_rows_near(o.y, y_ref, c.H, "y");
  expect_rows_near(o.dx, g.dx, c.H, "dx");
  if (::testing::Test::HasFatalFailure()) return;
  // NOTES: each d_topk_weights value is one dot product over I of bf16-rounded factors (da, g, u),
  // so its error scales with the magnitude of its terms, Σ|da_i a_i|, not with its value: each term
  // is off by a few 2⁻⁹ at most, with random signs. Every value must be within 1e-2 of that
  // magnitude (the only meaningful test of a single cancelled sum: T = 1 once gave a plain relative
  // error of 1.2e-2); a tensor of 32 values or more must also meet the plain relative Frobenius
  // error, which averages the cancellations out and is 3-5 times tighter.
  expect_d_topk_values_near(o.d_topk, g, g.d_topk_magnitude, kTolerance);
  if (::testing::Test::HasFatalFailure()) return;
  if (o.d_topk.size() >= 32) {
    EXPECT_LT(rel_error(o.d_topk, g.d_topk_weights, "d_topk_weights"), kTolerance);
  }
  EXPECT_LT(rel_error(o.dw_gate, g.dw_gate, "dw_gate"), kTolerance);
  EXPECT_LT(rel_error(o.dw_up, g.dw_up, "dw_up"), kTolerance);
  EXPECT_LT(rel_error(o.dw_down, g.dw_down, "dw_down"), kTolerance);
  if (c.Is > 0) {
    EXPECT_LT(rel_error(o.dws_gate, g.dws_gate, "dws_gate"), kTolerance);
    EXPECT_LT(rel_error(o.dws_up, g.dws_up, "dws_up"), kTolerance);
    EXPECT_LT(rel_error(o.dws_down, g.dws_down, "dws_down"), kTolerance);
  }
}

std::string case_name(const Case& c) {
  return "T=" + std::to_string(c.T) + " H=" + std::to_string(c.H) + " I=" + std::to_string(c.I) +
         " E=" + std::to_string(c.E) + " k=" + std::to_string(c.k) + " Is=" + std::to_string(c.Is) +
         " routing=" + c.routing;
}

void check_against_reference(const Case& c, uint64_t seed, const Config& config, bool recompute, int32_t clusters,
                             int32_t gemm_sm_count, int32_t gather_lookahead, int32_t order) {
  SCOPED_TRACE(case_name(c));
  const HostLayer L(c, seed);
  std::mt19937_64 rng(seed ^ 0x5eed);
  const std::vector<HostBf16> dy = random_bf16(rng, c.T * c.H, 1.0);
  Workspace ws(L.shape, config);
  test_hooks::set_gemm_clusters(ws, clusters);
  test_hooks::set_gemm_sm_count(ws, gemm_sm_count);
  test_hooks::set_gather_lookahead(ws, gather_lookahead);
  // A lookahead tests the in-kernel gather, which the rule does not pick at these launches' few columns.
  if (gather_lookahead != 0) test_hooks::set_gather_token_major(ws, 0);
  test_hooks::set_gemm_order(ws, order);
  test_hooks::poison_row_buffers(ws);
  const Outputs o = run_layer(ws, L, dy, recompute);
  expect_matches_reference(o, L, dy);
  // Experts that received no row: weight gradients exactly zero (they were poisoned before the call).
  std::vector<int64_t> rows_per_expert(c.E, 0);
  for (int32_t e : L.ids) {
    if (e >= 0) ++rows_per_expert[e];
  }
  for (int64_t e = 0; e < c.E; ++e) {
    if (rows_per_expert[e] != 0) continue;
    for (int64_t i = 0; i < c.I * c.H; ++i) {
      ASSERT_EQ(o.dw_gate[e * c.I * c.H + i].bits, 0) << "expert " << e;
      ASSERT_EQ(o.dw_up[e * c.I * c.H + i].bits, 0) << "expert " << e;
      ASSERT_EQ(o.dw_down[e * c.H * c.I + i].bits, 0) << "expert " << e;
    }
  }
}

bool routed(const Case& c, int64_t t, int64_t j) {
  if (c.unrouted_every > 0 && (t * c.k + j) % c.unrouted_every == 1) return false;
  if (!c.routed_tokens.empty()) {
    const int64_t blocks = int64_t(c.routed_tokens.size()), per_block = c.T / blocks;
    const int64_t b = std::min(t / per_block, blocks - 1);
    if (t - b * per_block >= c.routed_tokens[size_t(b)]) return false;
  }
  return true;
}

std::random_device::result_type fresh_seed() { return std::random_device{}(); }

std::vector<HostBf16> random_dy(const Case& c) {
  std::mt19937_64 rng(fresh_seed());
  return random_bf16(rng, c.T * c.H, 1.0);
}

namespace {

struct RowBuffer {
  const char* name;
  const void* data;
  int64_t cols;
};

// Every padding row of the 64-row halves that hold rows is an exact zero in each of `buffers` ([cap,
// cols] bf16 by schedule row); stops at the first that is not.
void expect_padding_rows_zero_in(Workspace& ws, const Case& c, std::initializer_list<RowBuffer> buffers) {
  Workspace::Impl& w = ws.impl();
  std::vector<int32_t> offset(c.E + 1), rows(c.E);
  LYNX_TEST_CUDA(cudaMemcpy(offset.data(), w.schedule.expert_offset, offset.size() * 4, cudaMemcpyDeviceToHost));
  LYNX_TEST_CUDA(cudaMemcpy(rows.data(), w.schedule.expert_rows, rows.size() * 4, cudaMemcpyDeviceToHost));
  const int64_t cap = w.problem.capacity;
  for (const RowBuffer& b : buffers) {
    const int64_t cols = b.cols;
    std::vector<HostBf16> host(cap * cols);
    LYNX_TEST_CUDA(cudaMemcpy(host.data(), b.data, host.size() * sizeof(HostBf16), cudaMemcpyDeviceToHost));
    for (int64_t e = 0; e < c.E; ++e) {
      const int64_t last = offset[e] + rows[e];  // the first padding row
      const int64_t half_end = offset[e] + (rows[e] + 63) / 64 * 64;
      for (int64_t r = last; r < half_end; ++r) {
        for (int64_t i = 0; i < cols; ++i) {
          ASSERT_EQ(host[r * cols + i].bits, 0) << b.name << ": expert " << e << ", padding row " << r - offset[e];
        }
      }
    }
  }
}

}  // namespace

void expect_padding_rows_zero(Workspace& ws, const Case& c) {
  Workspace::Impl& w = ws.impl();
  if (!w.gate_up_by_slot) {
    expect_padding_rows_zero_in(ws, c, {{"g", w.un.g, c.I}, {"u", w.un.u, c.I}});
    if (::testing::Test::HasFatalFailure()) return;
  }
  expect_padding_rows_zero_in(ws, c, {{"w·silu(g)⊙u (over da)", w.un.h, c.I}, {"dx rows", w.un.rows_b, c.H}});
}

void expect_forward_padding_rows_zero(Workspace& ws, const HostLayer& L) {
  test_hooks::poison_row_buffers(ws);
  OutputBuffers out(L.c);
  forward(ws, L.inputs(), out.y_view(), nullptr);
  ws.check(nullptr);
  Workspace::Impl& w = ws.impl();
  expect_padding_rows_zero_in(ws, L.c, {{"h (gate/up's)", w.un.h, L.c.I}, {"down's rows", w.un.rows_a, L.c.H}});
}

Config FusedOnlyTest::fused() {
  Config c;
  c.backend = Backend::kFused;
  return c;
}

}  // namespace lynx::test
