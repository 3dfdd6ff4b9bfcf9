#include "check.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <set>
#include <thread>
#include <vector>

#include "common/bf16.h"
#include "common/cuda_check.h"
#include "common/parallel.h"
#include "random_fill.h"
#include "reference/reference.h"

namespace lynx::bench {
namespace {

// NOTES: the reference's multiply-adds per row and checked unit (ref::backward: gate and up 2H,
// down^T dy H, dx 2H, the three weight gradients 3H), and the budget per FFN (about 2.6e9 of them a
// second per core): every unit of the checked experts at qwen3-30b-a3b (also a hot expert's 1024 rows
// with skewed routing), olmoe-1b-7b and deepseek-v3; 256 of 14336 at mixtral-8x7b; 128 of a shared
// expert's 2048 at T = 8192, H = 2048. At most 3 experts and the shared one: seconds on a host's cores.
constexpr int64_t kMacsPerRowUnit = 8;
constexpr int64_t kFfnMacs = int64_t(1) << 34;
constexpr int64_t kRowBlock = 256;  // rows per reference call: bounds the dx it also computes

unsigned thread_count() { return std::max(1u, std::thread::hardware_concurrency()); }

// f(i) for every i in [0, n), on thread_count() threads at most.
template <class F>
void parallel_for(int64_t n, const F& f) {
  lynx::parallel_for(n, 0, [&](int64_t i, int64_t) { f(i); });
}

// Host array of n elements whose pages are only touched where rows are filled in (no zeroing), so a
// 7.5 GB expert tensor costs only the experts actually copied.
std::unique_ptr<HostBf16[]> sparse_array(int64_t n) { return std::unique_ptr<HostBf16[]>(new HostBf16[n]); }

// dst[0, width) = row `row` of a generated [*, width] tensor (Problem's fill).
void generate_row(HostBf16* dst, int64_t row, int64_t width, uint64_t seed, float scale) {
  for (int64_t i = 0; i < width; ++i) dst[i] = float_to_bf16(hash_uniform(seed, uint64_t(row * width + i), scale));
}

const void* element(const void* data, int64_t index, int64_t bytes) {
  return static_cast<const char*>(data) + index * bytes;
}

// dst[0, count) = the bf16 device tensor at data, from element `offset`.
void copy_slice(HostBf16* dst, const void* data, int64_t offset, int64_t count) {
  LYNX_CUDA(cudaMemcpy(dst, element(data, offset, 2), count * 2, cudaMemcpyDeviceToHost));
}

std::vector<HostBf16> read_bf16(const void* data, int64_t offset, int64_t count) {
  std::vector<HostBf16> host(count);
  copy_slice(host.data(), data, offset, count);
  return host;
}

struct ErrorSum {
  double num = 0, den = 0;
  bool finite = true;
  void add(double got, double want) {
    finite = finite && std::isfinite(got);
    num += (got - want) * (got - want);
    den += want * want;
  }
  double rel() const { return finite ? std::sqrt(num / (den > 0 ? den : 1)) : INFINITY; }
};

double relative_error(const std::vector<HostBf16>& got, const std::vector<double>& want) {
  ErrorSum e;
  for (size_t i = 0; i < got.size(); ++i) e.add(to_double(got[i]), want[i]);
  return e.rel();
}

std::vector<int64_t> spread_tokens(int64_t T, int tokens) {
  std::vector<int64_t> checked;
  const int64_t n = std::min<int64_t>(tokens, T);
  for (int64_t i = 0; i < n; ++i) checked.push_back(n == 1 ? 0 : i * (T - 1) / (n - 1));
  return checked;
}

// The reference rows of the checked tokens, from the experts they are routed to.
std::vector<RowReference> row_reference(const Problem& p, const std::vector<int64_t>& checked, bool with_backward) {
  const LayerShape& s = p.shape();
  const int64_t T = s.tokens, H = s.hidden, I = s.intermediate, k = s.top_k, E = s.local_experts();
  const int64_t Is = s.shared_intermediate;
  const LayerInputs in = p.inputs();
  const Seeds& seeds = p.seeds();

  auto x = sparse_array(T * H), dy = sparse_array(T * H);
  auto wg = sparse_array(E * I * H), wu = sparse_array(E * I * H), wd = sparse_array(E * H * I);
  std::vector<HostBf16> wsg(Is * H), wsu(Is * H), wsd(H * Is);
  std::set<int32_t> experts;
  for (int64_t t : checked) {
    generate_row(x.get() + t * H, t, H, seeds.x, p.input_scale());
    generate_row(dy.get() + t * H, t, H, seeds.dy, p.input_scale());
    for (int64_t j = 0; j < k; ++j) experts.insert(p.host_ids()[t * k + j]);
  }
  for (int32_t e : experts) {
    copy_slice(wg.get() + e * I * H, in.weights.w_gate.data, e * I * H, I * H);
    copy_slice(wu.get() + e * I * H, in.weights.w_up.data, e * I * H, I * H);
    copy_slice(wd.get() + e * H * I, in.weights.w_down.data, e * H * I, H * I);
  }
  if (Is > 0) {
    copy_slice(wsg.data(), in.weights.ws_gate.data, 0, Is * H);
    copy_slice(wsu.data(), in.weights.ws_up.data, 0, Is * H);
    copy_slice(wsd.data(), in.weights.ws_down.data, 0, H * Is);
  }

  const std::vector<double> w(p.host_weights().begin(), p.host_weights().end());
  ref::Layer<HostBf16> r;
  r.T = T, r.H = H, r.I = I, r.E = E, r.k = k, r.I_shared = Is;
  r.x = x.get();
  r.topk_ids = p.host_ids().data();
  r.topk_weights = w.data();
  r.w_gate = wg.get();
  r.w_up = wu.get();
  r.w_down = wd.get();
  r.ws_gate = wsg.data();
  r.ws_up = wsu.data();
  r.ws_down = wsd.data();

  std::vector<RowReference> rows(checked.size());
  parallel_for(int64_t(checked.size()), [&](int64_t i) {
    RowReference& row = rows[i];
    row.token = checked[i];
    row.y.resize(H);
    ref::forward_token(r, row.token, row.y.data());
    if (!with_backward) return;
    std::vector<double> dy_row(H);
    for (int64_t h = 0; h < H; ++h) dy_row[h] = to_double(dy[row.token * H + h]);
    row.dx.resize(H);
    row.d_topk.resize(k);
    ref::backward_token(r, row.token, dy_row.data(), row.dx.data(), row.d_topk.data());
  });
  return rows;
}

// One FFN's three matrices in device memory: gate and up [width, H], down [H, width].
struct FfnMatrices {
  const void *gate, *up, *down;
};

// Expert e's matrices in [E, width, H] / [E, H, width] tensors (the shared expert: e = 0).
FfnMatrices expert_matrices(const TensorView& gate, const TensorView& up, const TensorView& down, int64_t e,
                            int64_t width, int64_t H) {
  const int64_t at = e * width * H;
  return {element(gate.data, at, 2), element(up.data, at, 2), element(down.data, at, 2)};
}

// Rows `units` of a device [width, H] matrix: [units, H].
std::vector<HostBf16> unit_rows(const void* m, int64_t H, const std::vector<int64_t>& units) {
  std::vector<HostBf16> out(units.size() * H);
  for (size_t u = 0; u < units.size(); ++u) copy_slice(out.data() + u * H, m, units[u] * H, H);
  return out;
}

// Columns `units` of a device [H, width] matrix: [H, units].
std::vector<HostBf16> unit_columns(const void* m, int64_t H, int64_t width, const std::vector<int64_t>& units) {
  const std::vector<HostBf16> all = read_bf16(m, 0, H * width);
  const int64_t n = int64_t(units.size());
  std::vector<HostBf16> out(H * n);
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t u = 0; u < n; ++u) out[h * n + u] = all[h * width + units[u]];
  }
  return out;
}

// The rows an FFN receives: their tokens and router weights (the shared expert: every token, weight 1).
struct FfnRows {
  std::vector<int64_t> tokens;
  std::vector<double> scales;
};

FfnRows routed_rows(const Problem& p, int32_t e) {
  const int64_t k = p.shape().top_k;
  FfnRows r;
  for (size_t i = 0; i < p.host_ids().size(); ++i) {
    if (p.host_ids()[i] != e) continue;
    r.tokens.push_back(int64_t(i) / k);
    r.scales.push_back(p.host_weights()[i]);
  }
  return r;
}

FfnRows shared_rows(const Problem& p) {
  FfnRows r;
  for (int64_t t = 0; t < p.shape().tokens; ++t) {
    r.tokens.push_back(t);
    r.scales.push_back(1.0);
  }
  return r;
}

// The first distinct experts of `token`, at most kCheckedExperts.
std::vector<int32_t> checked_experts(const Problem& p, int64_t token) {
  const int64_t k = p.shape().top_k;
  std::vector<int32_t> experts;
  for (int64_t j = 0; j < k && int(experts.size()) < kCheckedExperts; ++j) {
    const int32_t e = p.host_ids()[token * k + j];
    if (std::find(experts.begin(), experts.end(), e) == experts.end()) experts.push_back(e);
  }
  return experts;
}

// Units spread evenly over [0, width), as many as kFfnMacs allows over `rows` rows (at least one).
std::vector<int64_t> spread_units(int64_t width, int64_t rows, int64_t H) {
  const int64_t per_unit = std::max<int64_t>(1, rows * H * kMacsPerRowUnit);
  const int64_t n = std::clamp<int64_t>(kFfnMacs / per_unit, 1, width);
  std::vector<int64_t> units(n);
  for (int64_t u = 0; u < n; ++u) units[u] = u * width / n;
  return units;
}

// An FFN's inputs on its rows, [rows, H]: x as the GPU reads it, dy in double.
struct RowInputs {
  std::vector<HostBf16> x;
  std::vector<double> dy;
};

RowInputs row_inputs(const Problem& p, const FfnRows& rows) {
  const int64_t H = p.shape().hidden, n = int64_t(rows.tokens.size());
  RowInputs in{std::vector<HostBf16>(n * H), std::vector<double>(n * H)};
  parallel_for(n, [&](int64_t i) {
    const int64_t t = rows.tokens[i];
    generate_row(in.x.data() + i * H, t, H, p.seeds().x, p.input_scale());
    std::vector<HostBf16> dy(H);
    generate_row(dy.data(), t, H, p.seeds().dy, p.input_scale());
    for (int64_t h = 0; h < H; ++h) in.dy[i * H + h] = to_double(dy[h]);
  });
  return in;
}

// The checked units' weights of an FFN: gate, up [units, H], down [H, units].
struct UnitWeights {
  std::vector<HostBf16> gate, up, down;
};

// Adds the weight gradients of units [u0, u1) of f over all its rows: the reference's backward of a
// layer of one expert (those units' weights) that holds exactly these rows, in blocks of kRowBlock.
void add_unit_gradients(const RowInputs& in, const FfnRows& rows, const UnitWeights& w, int64_t H, int64_t u0,
                        int64_t u1, FfnReference& f) {
  const int64_t n = int64_t(f.units.size()), m = u1 - u0, count = int64_t(rows.tokens.size());
  std::vector<HostBf16> down(H * m);
  for (int64_t h = 0; h < H; ++h) std::copy_n(w.down.data() + h * n + u0, m, down.data() + h * m);
  const std::vector<int32_t> ids(kRowBlock, 0);
  ref::Layer<HostBf16> L;
  L.H = H, L.I = m, L.E = 1, L.k = 1, L.I_shared = 0;
  L.topk_ids = ids.data();
  L.w_gate = w.gate.data() + u0 * H;
  L.w_up = w.up.data() + u0 * H;
  L.w_down = down.data();
  for (int64_t r0 = 0; r0 < count; r0 += kRowBlock) {
    L.T = std::min(kRowBlock, count - r0);
    L.x = in.x.data() + r0 * H;
    L.topk_weights = rows.scales.data() + r0;
    const ref::Gradients g = ref::backward(L, in.dy.data() + r0 * H, 1);  // one thread: the units run at once
    for (int64_t i = 0; i < m * H; ++i) {
      f.gate[u0 * H + i] += g.dw_gate[i];
      f.up[u0 * H + i] += g.dw_up[i];
    }
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t u = 0; u < m; ++u) f.down[h * n + u0 + u] += g.dw_down[h * m + u];
    }
  }
}

// NOTES: threads split the units, not the rows: each unit's gradient is its own, so no thread adds
// into another's values and the sum over the rows keeps one order.
FfnReference ffn_reference(const Problem& p, int64_t expert, const FfnRows& rows, const FfnMatrices& w,
                           int64_t width) {
  const int64_t H = p.shape().hidden, count = int64_t(rows.tokens.size());
  FfnReference f{expert, count, width, spread_units(width, count, H), {}, {}, {}};
  const int64_t n = int64_t(f.units.size());
  f.gate.assign(n * H, 0.0);
  f.up.assign(n * H, 0.0);
  f.down.assign(H * n, 0.0);
  const UnitWeights uw{unit_rows(w.gate, H, f.units), unit_rows(w.up, H, f.units),
                       unit_columns(w.down, H, width, f.units)};
  const RowInputs in = row_inputs(p, rows);
  const int64_t groups = std::min<int64_t>(n, thread_count());
  parallel_for(groups, [&](int64_t g) { add_unit_gradients(in, rows, uw, H, g * n / groups, (g + 1) * n / groups, f); });
  return f;
}

FfnMatrices gradient_matrices(const Problem& p, const FfnReference& f) {
  const Gradients g = p.gradients();
  const int64_t H = p.shape().hidden;
  if (f.expert < 0) return expert_matrices(g.dws_gate, g.dws_up, g.dws_down, 0, f.width, H);
  return expert_matrices(g.dw_gate, g.dw_up, g.dw_down, f.expert, f.width, H);
}

// The worst relative error of an FFN's three checked weight gradients.
double ffn_error(const Problem& p, const FfnReference& f) {
  const int64_t H = p.shape().hidden;
  const FfnMatrices g = gradient_matrices(p, f);
  return std::max({relative_error(unit_rows(g.gate, H, f.units), f.gate),
                   relative_error(unit_rows(g.up, H, f.units), f.up),
                   relative_error(unit_columns(g.down, H, f.width, f.units), f.down)});
}

void poison(const TensorView& v) {
  if (v.data == nullptr) return;
  LYNX_CUDA(cudaMemset(v.data, 0xFF, size_t(v.numel()) * (v.dtype == DType::kF32 ? 4 : 2)));
}

std::string ffn_text(const FfnReference& f) {
  char buf[96];
  std::snprintf(buf, sizeof buf, " (%lld rows, %zu of %lld units)", static_cast<long long>(f.rows), f.units.size(),
                static_cast<long long>(f.width));
  return (f.expert < 0 ? std::string("the shared expert") : std::to_string(f.expert)) + buf;
}

}  // namespace

std::string CheckResult::summary() const {
  char buf[160];
  if (dx < 0) {
    std::snprintf(buf, sizeof buf, "y %.1e", y);
  } else if (dw < 0) {
    std::snprintf(buf, sizeof buf, "y %.1e dx %.1e dw_k %.1e", y, dx, d_topk);
  } else {
    std::snprintf(buf, sizeof buf, "y %.1e dx %.1e dw_k %.1e dW %.1e", y, dx, d_topk, dw);
  }
  return buf;
}

std::string CheckReference::describe() const {
  std::string d = std::string(with_backward ? "y, dx, d_topk_weights" : "y") + " of " + std::to_string(rows.size()) +
                  " tokens";
  std::string experts, shared;
  for (const FfnReference& f : ffns) {
    if (f.expert < 0) {
      shared = "; dW of " + ffn_text(f);
    } else {
      experts += (experts.empty() ? "; dW of experts " : ", ") + ffn_text(f);
    }
  }
  return d + experts + shared;
}

CheckReference check_reference(const Problem& p, int tokens, bool with_backward) {
  const LayerShape& s = p.shape();
  CheckReference c;
  c.with_backward = with_backward;
  const std::vector<int64_t> checked = spread_tokens(s.tokens, tokens);
  c.rows = row_reference(p, checked, with_backward);
  if (!with_backward || checked.empty()) return c;
  const LayerInputs in = p.inputs();
  const ExpertWeights& w = in.weights;
  for (int32_t e : checked_experts(p, checked.front())) {
    const FfnMatrices m = expert_matrices(w.w_gate, w.w_up, w.w_down, e, s.intermediate, s.hidden);
    c.ffns.push_back(ffn_reference(p, e, routed_rows(p, e), m, s.intermediate));
  }
  if (s.shared_intermediate > 0) {
    const FfnMatrices m = expert_matrices(w.ws_gate, w.ws_up, w.ws_down, 0, s.shared_intermediate, s.hidden);
    c.ffns.push_back(ffn_reference(p, -1, shared_rows(p), m, s.shared_intermediate));
  }
  return c;
}

void poison_outputs(const Problem& p) {
  const Gradients g = p.gradients();
  for (const TensorView& v : {p.y(), g.dx, g.d_topk_weights, g.dw_gate, g.dw_up, g.dw_down, g.dws_gate, g.dws_up,
                              g.dws_down}) {
    poison(v);
  }
  LYNX_CUDA(cudaDeviceSynchronize());
}

CheckResult check_outputs(const Problem& p, const CheckReference& want) {
  const int64_t H = p.shape().hidden, k = p.shape().top_k;
  const Gradients g = p.gradients();
  ErrorSum ey, edx, edtk;
  std::vector<float> got_dtk(k);
  for (const RowReference& r : want.rows) {
    const std::vector<HostBf16> y = read_bf16(p.y().data, r.token * H, H);
    for (int64_t h = 0; h < H; ++h) ey.add(to_double(y[h]), r.y[h]);
    if (!want.with_backward) continue;
    const std::vector<HostBf16> dx = read_bf16(g.dx.data, r.token * H, H);
    for (int64_t h = 0; h < H; ++h) edx.add(to_double(dx[h]), r.dx[h]);
    LYNX_CUDA(cudaMemcpy(got_dtk.data(), element(g.d_topk_weights.data, r.token * k, 4), k * 4, cudaMemcpyDeviceToHost));
    for (int64_t j = 0; j < k; ++j) edtk.add(got_dtk[j], r.d_topk[j]);
  }
  CheckResult res;
  res.y = ey.rel();
  res.ok = res.y < kCheckTolerance;
  if (!want.with_backward) return res;
  res.dx = edx.rel();
  res.d_topk = edtk.rel();
  res.ok = res.ok && res.dx < kCheckTolerance && res.d_topk < kCheckTolerance;
  for (const FfnReference& f : want.ffns) res.dw = std::max(res.dw, ffn_error(p, f));
  if (!want.ffns.empty()) res.ok = res.ok && res.dw < kCheckTolerance;
  return res;
}

}  // namespace lynx::bench
