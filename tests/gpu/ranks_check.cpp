#include "gpu/ranks_check.h"

#include <cstring>

#include "experiments/test_hooks.h"

namespace lynx::test {
namespace {

template <class T>
std::vector<T> slice(const std::vector<T>& v, int64_t begin, int64_t count) {
  return std::vector<T>(v.begin() + begin, v.begin() + begin + count);
}

char* at(const DeviceBuffer& b, int64_t byte_offset) { return static_cast<char*>(b.get()) + byte_offset; }

}  // namespace

RankSlice::RankSlice(const HostLayer& L, const OutputBuffers& global, int32_t R, int32_t r) {
  const Case& c = L.c;
  const int64_t T = c.T / R, E_loc = c.E / R, H = c.H, I = c.I, k = c.k, Is = c.Is;
  shape = L.shape;
  shape.tokens = T;
  shape.num_ranks = R;
  shape.rank = r;
  const std::vector<int32_t> my_ids = slice(L.ids, r * T * k, T * k);
  ids = c.int64_ids ? to_device(std::vector<int64_t>(my_ids.begin(), my_ids.end())) : to_device(my_ids);
  weights = to_device(slice(L.weights, r * T * k, T * k));
  in.x = make_view(at(L.d_x, 2 * r * T * H), DType::kBF16, {T, H});
  in.topk_ids = make_view(ids.get(), c.int64_ids ? DType::kI64 : DType::kI32, {T, k});
  in.topk_weights = make_view(weights.get(), DType::kF32, {T, k});
  in.weights.w_gate = make_view(at(L.d_wg, 2 * r * E_loc * I * H), DType::kBF16, {E_loc, I, H});
  in.weights.w_up = make_view(at(L.d_wu, 2 * r * E_loc * I * H), DType::kBF16, {E_loc, I, H});
  in.weights.w_down = make_view(at(L.d_wd, 2 * r * E_loc * H * I), DType::kBF16, {E_loc, H, I});
  if (Is > 0) {
    in.weights.ws_gate = make_view(L.d_wsg.get(), DType::kBF16, {Is, H});
    in.weights.ws_up = make_view(L.d_wsu.get(), DType::kBF16, {Is, H});
    in.weights.ws_down = make_view(L.d_wsd.get(), DType::kBF16, {H, Is});
  }
  y = make_view(at(global.y, 2 * r * T * H), DType::kBF16, {T, H});
  d_topk = DeviceBuffer(T * k * 4);
  d_topk.fill_bytes(0xFF);
  grads.dx = make_view(at(global.dx, 2 * r * T * H), DType::kBF16, {T, H});
  grads.d_topk_weights = make_view(d_topk.get(), DType::kF32, {T, k});
  grads.dw_gate = make_view(at(global.dwg, 2 * r * E_loc * I * H), DType::kBF16, {E_loc, I, H});
  grads.dw_up = make_view(at(global.dwu, 2 * r * E_loc * I * H), DType::kBF16, {E_loc, I, H});
  grads.dw_down = make_view(at(global.dwd, 2 * r * E_loc * H * I), DType::kBF16, {E_loc, H, I});
  if (Is > 0) {
    dws_gate = DeviceBuffer(Is * H * 2);
    dws_up = DeviceBuffer(Is * H * 2);
    dws_down = DeviceBuffer(H * Is * 2);
    for (DeviceBuffer* b : {&dws_gate, &dws_up, &dws_down}) b->fill_bytes(0xFF);
    grads.dws_gate = make_view(dws_gate.get(), DType::kBF16, {Is, H});
    grads.dws_up = make_view(dws_up.get(), DType::kBF16, {Is, H});
    grads.dws_down = make_view(dws_down.get(), DType::kBF16, {H, Is});
  }
}

Outputs gather_outputs(const HostLayer& L, const OutputBuffers& global, const std::vector<RankSlice>& slices) {
  const Case& c = L.c;
  Outputs o = global.to_host_outputs();
  const int64_t R = int64_t(slices.size()), T = c.T / R, k = c.k;
  std::vector<double> sg(c.Is * c.H, 0.0), su(c.Is * c.H, 0.0), sd(c.H * c.Is, 0.0);
  for (int64_t r = 0; r < R; ++r) {
    const std::vector<float> part = to_host<float>(slices[r].d_topk, T * k);
    std::copy(part.begin(), part.end(), o.d_topk.begin() + r * T * k);
    if (c.Is == 0) continue;
    const auto add = [](std::vector<double>& sum, const std::vector<HostBf16>& v) {
      for (size_t i = 0; i < v.size(); ++i) sum[i] += to_double(v[i]);
    };
    add(sg, to_host<HostBf16>(slices[r].dws_gate, c.Is * c.H));
    add(su, to_host<HostBf16>(slices[r].dws_up, c.Is * c.H));
    add(sd, to_host<HostBf16>(slices[r].dws_down, c.H * c.Is));
  }
  const auto round = [](const std::vector<double>& v) {
    std::vector<HostBf16> out(v.size());
    for (size_t i = 0; i < v.size(); ++i) out[i] = float_to_bf16(float(v[i]));
    return out;
  };
  o.dws_gate = round(sg);
  o.dws_up = round(su);
  o.dws_down = round(sd);
  return o;
}

std::string first_routed_difference(const Outputs& a, const Outputs& b) {
  Outputs x = a, y = b;
  x.dws_gate.clear(), x.dws_up.clear(), x.dws_down.clear();
  y.dws_gate.clear(), y.dws_up.clear(), y.dws_down.clear();
  return first_difference(x, y);
}

std::vector<std::unique_ptr<Workspace>> make_virtual_ranks(const LayerShape& global, int32_t R, const Config& config) {
  std::vector<std::unique_ptr<Workspace>> ranks;
  for (int32_t r = 0; r < R; ++r) {
    LayerShape s = global;
    s.tokens = global.tokens / R;
    s.num_ranks = R;
    s.rank = r;
    ranks.push_back(std::make_unique<Workspace>(s, config));
  }
  connect_ranks(pointers(ranks));
  return ranks;
}

std::vector<Workspace*> pointers(const std::vector<std::unique_ptr<Workspace>>& ranks) {
  std::vector<Workspace*> p;
  for (const auto& w : ranks) p.push_back(w.get());
  return p;
}

VirtualGroup::VirtualGroup(const HostLayer& L, int32_t R, const std::vector<HostBf16>& dy_host, const Config& config)
    : owned(make_virtual_ranks(L.shape, R, config)), ws(pointers(owned)), global(L.c), d_dy(to_device(dy_host)) {
  global.poison();
  // A row no kernel wrote (a padding row the gathers must zero, say) cannot pass.
  for (Workspace* w : ws) test_hooks::poison_row_buffers(*w);
  slices.reserve(R);
  const int64_t T = L.c.T / R;
  for (int32_t r = 0; r < R; ++r) {
    slices.emplace_back(L, global, R, r);
    in.push_back(slices[r].in);
    y.push_back(slices[r].y);
    dy.push_back(make_view(at(d_dy, 2 * r * T * L.c.H), DType::kBF16, {T, L.c.H}));
    grads.push_back(slices[r].grads);
    if (config.precision == Precision::kFp8Block) quantize_weights(*ws[r], slices[r].in.weights, nullptr);
  }
}

void VirtualGroup::check(cudaStream_t s) const {
  for (Workspace* w : ws) w->check(s);
}

Outputs run_virtual_ranks(const HostLayer& L, int32_t R, const std::vector<HostBf16>& dy, const Config& config,
                          bool recompute, const std::function<void(Workspace&)>& hook) {
  VirtualGroup g(L, R, dy, config);
  if (hook) {
    for (Workspace* w : g.ws) hook(*w);
  }
  g.forward(nullptr);
  if (recompute) recompute_forward_context_ranks(g.ws, g.in, nullptr);
  g.backward(nullptr);
  g.check(nullptr);
  return gather_outputs(L, g.global, g.slices);
}

void expect_forward_reported(VirtualGroup& g, const HostLayer& L, const std::vector<std::string>& want) {
  g.forward(nullptr);
  for (size_t r = 0; r < g.ws.size(); ++r) {
    try {
      g.ws[r]->check(nullptr);
      ADD_FAILURE() << "rank " << r << " reported nothing";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(want[r]), std::string::npos) << "rank " << r << ": " << e.what();
    }
  }
  const std::vector<HostBf16> y = to_host<HostBf16>(g.global.y, L.c.T * L.c.H);
  for (size_t i = 0; i < y.size(); ++i) ASSERT_TRUE(std::isnan(to_double(y[i]))) << "y[" << i << "] written";
}

void expect_every_r_gives(const Outputs& want, const HostLayer& L, const std::vector<int32_t>& Rs,
                          const std::vector<HostBf16>& dy, const Config& config, bool recompute) {
  for (const int32_t R : Rs) {
    SCOPED_TRACE("R = " + std::to_string(R));
    const Outputs got = run_virtual_ranks(L, R, dy, config, recompute);
    EXPECT_EQ(first_routed_difference(got, want), "") << "differs from R = 1";
    if (L.c.Is > 0) {
      EXPECT_LT(rel_error(got.dws_gate, to_double_vec(want.dws_gate), "dws_gate"), kTolerance);
      EXPECT_LT(rel_error(got.dws_up, to_double_vec(want.dws_up), "dws_up"), kTolerance);
      EXPECT_LT(rel_error(got.dws_down, to_double_vec(want.dws_down), "dws_down"), kTolerance);
    }
  }
}

}  // namespace lynx::test
