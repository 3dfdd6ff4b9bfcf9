#include "check.h"

#include <cmath>
#include <cstdio>
#include <memory>
#include <set>
#include <vector>

#include "common/bf16.h"
#include "common/cuda_check.h"
#include "random_fill.h"
#include "reference/reference.h"

namespace lynx::bench {
namespace {

// Host array of n elements whose pages are only touched where rows are filled in (no zeroing), so a
// 7.5 GB expert tensor costs only the experts actually copied.
std::unique_ptr<HostBf16[]> sparse_array(int64_t n) { return std::unique_ptr<HostBf16[]>(new HostBf16[n]); }

void regenerate_row(HostBf16* dst, int64_t row, int64_t width, uint64_t seed, float scale) {
  for (int64_t i = 0; i < width; ++i) dst[row * width + i] = float_to_bf16(hash_uniform(seed, uint64_t(row * width + i), scale));
}

// dst[0, count) = v[offset, offset + count).
void copy_slice(HostBf16* dst, const TensorView& v, int64_t offset, int64_t count) {
  LYNX_CUDA(cudaMemcpy(dst, static_cast<const HostBf16*>(v.data) + offset, count * 2, cudaMemcpyDeviceToHost));
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

}  // namespace

std::string CheckResult::summary() const {
  char buf[160];
  if (dx < 0) {
    std::snprintf(buf, sizeof buf, "y %.1e", y);
  } else {
    std::snprintf(buf, sizeof buf, "y %.1e dx %.1e dw_k %.1e", y, dx, d_topk);
  }
  return buf;
}

CheckResult check_rows(const Problem& p, int tokens, bool with_backward) {
  const LayerShape& s = p.shape();
  const int64_t T = s.tokens, H = s.hidden, I = s.intermediate, k = s.top_k, E = s.local_experts();
  const int64_t Is = s.shared_intermediate;
  const LayerInputs in = p.inputs();
  const Seeds& seeds = p.seeds();

  std::vector<int64_t> checked;
  const int64_t n = std::min<int64_t>(tokens, T);
  for (int64_t i = 0; i < n; ++i) checked.push_back(n == 1 ? 0 : i * (T - 1) / (n - 1));

  auto x = sparse_array(T * H), dy = sparse_array(T * H);
  auto wg = sparse_array(E * I * H), wu = sparse_array(E * I * H), wd = sparse_array(E * H * I);
  std::vector<HostBf16> wsg(Is * H), wsu(Is * H), wsd(H * Is);
  std::set<int32_t> experts;
  for (int64_t t : checked) {
    regenerate_row(x.get(), t, H, seeds.x, p.input_scale());
    regenerate_row(dy.get(), t, H, seeds.dy, p.input_scale());
    for (int64_t j = 0; j < k; ++j) experts.insert(p.host_ids()[t * k + j]);
  }
  for (int32_t e : experts) {
    copy_slice(wg.get() + e * I * H, in.weights.w_gate, e * I * H, I * H);
    copy_slice(wu.get() + e * I * H, in.weights.w_up, e * I * H, I * H);
    copy_slice(wd.get() + e * H * I, in.weights.w_down, e * H * I, H * I);
  }
  if (Is > 0) {
    copy_slice(wsg.data(), in.weights.ws_gate, 0, Is * H);
    copy_slice(wsu.data(), in.weights.ws_up, 0, Is * H);
    copy_slice(wsd.data(), in.weights.ws_down, 0, H * Is);
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

  ErrorSum ey, edx, edtk;
  std::vector<double> want(H), want_dx(H), want_dtk(k), dy_row(H);
  std::vector<HostBf16> got(H);
  std::vector<float> got_dtk(k);
  for (int64_t t : checked) {
    ref::forward_token(r, t, want.data());
    copy_slice(got.data(), p.y(), t * H, H);
    for (int64_t h = 0; h < H; ++h) ey.add(to_double(got[h]), want[h]);
    if (!with_backward) continue;
    for (int64_t h = 0; h < H; ++h) dy_row[h] = to_double(dy[t * H + h]);
    ref::backward_token(r, t, dy_row.data(), want_dx.data(), want_dtk.data());
    const Gradients g = p.gradients();
    copy_slice(got.data(), g.dx, t * H, H);
    for (int64_t h = 0; h < H; ++h) edx.add(to_double(got[h]), want_dx[h]);
    LYNX_CUDA(cudaMemcpy(got_dtk.data(), static_cast<const float*>(g.d_topk_weights.data) + t * k, k * 4,
                         cudaMemcpyDeviceToHost));
    for (int64_t j = 0; j < k; ++j) edtk.add(got_dtk[j], want_dtk[j]);
  }
  CheckResult res;
  res.y = ey.rel();
  res.ok = res.y < kCheckTolerance;
  if (with_backward) {
    res.dx = edx.rel();
    res.d_topk = edtk.rel();
    res.ok = res.ok && res.dx < kCheckTolerance && res.d_topk < kCheckTolerance;
  }
  return res;
}

}  // namespace lynx::bench
