#include "ranks_bench.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <memory>

#include "common/cuda_check.h"
#include "lynx/lynx.h"
#include "timing.h"

namespace lynx::bench {
namespace {

char* offset(const void* p, int64_t bytes) { return static_cast<char*>(const_cast<void*>(p)) + bytes; }

size_t bytes_of(const TensorView& v) { return size_t(v.numel()) * (v.dtype == DType::kF32 ? 4 : 2); }

// Rank r's share of the global problem's tensors: tokens [r·T, (r+1)·T), experts [r·E_loc, ...).
struct Share {
  LayerInputs in;
  TensorView y, dy;
  Gradients grads;
};

Share share_of(const Problem& p, int32_t R, int32_t r) {
  const LayerShape& g = p.shape();
  const int64_t T = g.tokens / R, E = g.num_experts / R, H = g.hidden, I = g.intermediate, k = g.top_k;
  const int64_t Is = g.shared_intermediate;
  const LayerInputs all = p.inputs();
  const Gradients ga = p.gradients();
  Share s;
  s.in.x = make_view(offset(all.x.data, 2 * r * T * H), DType::kBF16, {T, H});
  s.in.topk_ids = make_view(offset(all.topk_ids.data, 4 * r * T * k), all.topk_ids.dtype, {T, k});
  s.in.topk_weights = make_view(offset(all.topk_weights.data, 4 * r * T * k), DType::kF32, {T, k});
  s.in.weights.w_gate = make_view(offset(all.weights.w_gate.data, 2 * r * E * I * H), DType::kBF16, {E, I, H});
  s.in.weights.w_up = make_view(offset(all.weights.w_up.data, 2 * r * E * I * H), DType::kBF16, {E, I, H});
  s.in.weights.w_down = make_view(offset(all.weights.w_down.data, 2 * r * E * H * I), DType::kBF16, {E, H, I});
  s.in.weights.ws_gate = all.weights.ws_gate;
  s.in.weights.ws_up = all.weights.ws_up;
  s.in.weights.ws_down = all.weights.ws_down;
  s.y = make_view(offset(p.y().data, 2 * r * T * H), DType::kBF16, {T, H});
  s.dy = make_view(offset(p.dy().data, 2 * r * T * H), DType::kBF16, {T, H});
  s.grads.dx = make_view(offset(ga.dx.data, 2 * r * T * H), DType::kBF16, {T, H});
  s.grads.d_topk_weights = make_view(offset(ga.d_topk_weights.data, 4 * r * T * k), DType::kF32, {T, k});
  s.grads.dw_gate = make_view(offset(ga.dw_gate.data, 2 * r * E * I * H), DType::kBF16, {E, I, H});
  s.grads.dw_up = make_view(offset(ga.dw_up.data, 2 * r * E * I * H), DType::kBF16, {E, I, H});
  s.grads.dw_down = make_view(offset(ga.dw_down.data, 2 * r * E * H * I), DType::kBF16, {E, H, I});
  // The shared expert's gradients (per-rank partial sums): the problem's buffers, which only rank 0 keeps
  // (Group gives the others memory of their own: the ranks run at once).
  if (Is > 0) {
    s.grads.dws_gate = ga.dws_gate;
    s.grads.dws_up = ga.dws_up;
    s.grads.dws_down = ga.dws_down;
  }
  return s;
}

// Device memory freed with its owner.
struct DeviceBytes {
  void* p = nullptr;
  explicit DeviceBytes(size_t bytes) { LYNX_CUDA(cudaMalloc(&p, bytes)); }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;
  ~DeviceBytes() { cudaFree(p); }
};

// A group of R virtual ranks with their shares.
struct Group {
  int32_t R;
  std::vector<std::unique_ptr<Workspace>> owned;
  std::vector<Workspace*> ws;
  std::vector<LayerInputs> in;
  std::vector<TensorView> y, dy;
  std::vector<Gradients> grads;
  std::vector<std::unique_ptr<DeviceBytes>> own_dws;  // ranks 1 .. R - 1's shared-expert gradients

  Group(const Problem& p, int32_t ranks, Precision precision) : R(ranks) {
    Config config;
    config.precision = precision;
    for (int32_t r = 0; r < R; ++r) {
      LayerShape s = p.shape();
      s.tokens /= R;
      s.num_ranks = R;
      s.rank = r;
      owned.push_back(std::make_unique<Workspace>(s, config));
      ws.push_back(owned.back().get());
      const Share sh = share_of(p, R, r);
      in.push_back(sh.in), y.push_back(sh.y), dy.push_back(sh.dy), grads.push_back(sh.grads);
      Gradients& g = grads.back();
      for (TensorView* v : {&g.dws_gate, &g.dws_up, &g.dws_down}) {
        if (r == 0 || !v->present()) continue;
        own_dws.push_back(std::make_unique<DeviceBytes>(bytes_of(*v)));
        v->data = own_dws.back()->p;
      }
    }
    connect_ranks(ws);
    if (precision == Precision::kFp8Block) {
      for (int32_t r = 0; r < R; ++r) quantize_weights(*ws[r], in[r].weights, nullptr);
    }
  }
  void forward(cudaStream_t s) { forward_ranks(ws, in, y, s); }
  void backward(cudaStream_t s) { backward_ranks(ws, in, dy, grads, s); }
  // The passes on a stream of their own, captured once (graph mode).
  OwnedStream stream;
  std::unique_ptr<CapturedGraph> forward_graph, backward_graph;
  void capture() {
    forward_graph = std::make_unique<CapturedGraph>(stream.get(), [&] { forward(stream.get()); });
    backward_graph = std::make_unique<CapturedGraph>(stream.get(), [&] { backward(stream.get()); });
  }
  void check(cudaStream_t s) {
    for (Workspace* w : ws) w->check(s);
  }
};

// The routed outputs as bytes (y, dx, d_topk_weights, dw_*), for the bitwise comparison.
std::vector<TensorView> routed_views(const Problem& p) {
  const Gradients g = p.gradients();
  return {p.y(), g.dx, g.d_topk_weights, g.dw_gate, g.dw_up, g.dw_down};
}

std::vector<uint8_t> routed_outputs(const Problem& p) {
  std::vector<uint8_t> out;
  for (const TensorView& v : routed_views(p)) {
    const size_t at = out.size();
    out.resize(at + bytes_of(v));
    LYNX_CUDA(cudaMemcpy(out.data() + at, v.data, bytes_of(v), cudaMemcpyDeviceToHost));
  }
  return out;
}

void poison_outputs(const Problem& p) {
  for (const TensorView& v : routed_views(p)) LYNX_CUDA(cudaMemset(v.data, 0xFF, bytes_of(v)));
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

}  // namespace

RankTraffic rank_traffic(const LayerShape& g, const std::vector<int32_t>& ids, int32_t R, Precision precision) {
  RankTraffic t;
  if (R == 1) return t;
  const int64_t T = g.tokens / R, k = g.top_k, E_loc = g.num_experts / R;
  for (int64_t i = 0; i < int64_t(ids.size()); ++i) {
    const int64_t source = i / (T * k), owner = ids[i] / E_loc;
    if (source != owner) ++t.remote_rows;
  }
  const int64_t row = 2 * g.hidden, routing = (R - 1) * g.tokens * k * 4;  // every rank reads the others' ids
  const int64_t pulled = precision == Precision::kFp8Block ? g.hidden + 4 * ((g.hidden + 127) / 128) : row;
  t.forward_bytes = t.remote_rows * (pulled + row) + routing;
  t.backward_bytes = t.remote_rows * (pulled + row + 4 + 4);
  return t;
}

std::vector<RanksRow> time_ranks(Problem& p, const std::vector<int32_t>& ranks, const std::vector<std::string>& passes,
                                 const Protocol& protocol, int rounds, const GpuClock* clock, Precision precision,
                                 bool graph) {
  std::vector<std::unique_ptr<Group>> groups;
  for (int32_t R : ranks) groups.push_back(std::make_unique<Group>(p, R, precision));
  // Correctness: every R's routed outputs against R = 1's (the first group's when it is R = 1).
  std::vector<uint8_t> want;
  std::vector<std::string> checks;
  for (auto& g : groups) {
    poison_outputs(p);
    g->forward(nullptr);
    g->backward(nullptr);
    g->check(nullptr);
    const std::vector<uint8_t> got = routed_outputs(p);
    if (want.empty()) want = got;
    checks.push_back(got == want ? "bitwise = R=" + std::to_string(ranks.front())
                                 : "DIFFERS from R=" + std::to_string(ranks.front()));
    if (graph) g->capture();
  }
  std::vector<std::vector<std::vector<double>>> ms(groups.size(), std::vector<std::vector<double>>(passes.size()));
  std::vector<std::vector<std::vector<double>>> enqueue_ms = ms;
  std::vector<std::vector<ClockSummary>> clocks(groups.size(), std::vector<ClockSummary>(passes.size()));
  for (int round = 0; round < rounds; ++round) {
    for (size_t gi = 0; gi < groups.size(); ++gi) {
      Group& g = *groups[gi];
      // Eager: every call on the legacy stream; graph: the replays on the group's stream.
      const cudaStream_t s = graph ? g.stream.get() : nullptr;
      const auto forward = [&] { graph ? g.forward_graph->launch(s) : g.forward(s); };
      const auto backward = [&] { graph ? g.backward_graph->launch(s) : g.backward(s); };
      for (size_t pi = 0; pi < passes.size(); ++pi) {
        const std::string& pass = passes[pi];
        Timing t;
        if (pass == "forward") {
          t = time_pass(forward, protocol, s, clock);
        } else if (pass == "backward") {
          forward();
          t = time_pass(backward, protocol, s, clock);
        } else {
          t = time_pass([&] { forward(); backward(); }, protocol, s, clock);
        }
        ms[gi][pi].push_back(t.ms);
        enqueue_ms[gi][pi].push_back(t.enqueue_ms);
        clocks[gi][pi] = t.clocks;
      }
    }
  }
  // The replays' bits: a graph that replayed stale work, or none, would fail here.
  for (size_t gi = 0; gi < groups.size() && graph; ++gi) {
    Group& g = *groups[gi];
    poison_outputs(p);
    g.forward_graph->launch(g.stream.get());
    g.backward_graph->launch(g.stream.get());
    LYNX_CUDA(cudaStreamSynchronize(g.stream.get()));
    g.check(g.stream.get());
    if (routed_outputs(p) != want) checks[gi] = "DIFFERS from R=" + std::to_string(ranks.front()) + " (graph replays)";
  }
  std::vector<RanksRow> rows;
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    for (size_t pi = 0; pi < passes.size(); ++pi) {
      rows.push_back({ranks[gi], passes[pi], median(ms[gi][pi]), median(enqueue_ms[gi][pi]), clocks[gi][pi],
                      rank_traffic(p.shape(), p.host_ids(), ranks[gi], precision), checks[gi]});
    }
  }
  return rows;
}

}  // namespace lynx::bench
