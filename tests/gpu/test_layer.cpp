// Both GPU paths (unfused, fused) against the double-precision CPU reference, on fresh random inputs,
// with every output poisoned first.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "experiments/test_hooks.h"
#include "common/bf16.h"
#include "gpu/gpu_test.h"
#include "gpu/spin_kernel.h"
#include "lynx/lynx.h"
#include "reference/reference.h"
#include "kernels/schedule/core.h"

namespace lynx {
namespace {

using test::DeviceBuffer;
using test::to_device;
using test::to_host;

struct Case {
  int64_t T, H, I, E, k, Is;
  // random | subset (j even: expert 0, j odd: expert E-1) | one (every row to expert E/2) |
  // cyclic (expert (t + j) % E)
  std::string routing = "random";
  bool int64_ids = false;
  bool zero_weights = false;       // every third router weight is exactly 0
};

std::vector<HostBf16> random_bf16(std::mt19937_64& rng, int64_t n, double scale) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<HostBf16> v(n);
  for (auto& e : v) e = float_to_bf16(static_cast<float>(scale) * dist(rng));
  return v;
}

std::vector<double> to_double_vec(const std::vector<HostBf16>& v) {
  std::vector<double> d(v.size());
  for (size_t i = 0; i < v.size(); ++i) d[i] = to_double(v[i]);
  return d;
}

// A layer's host inputs and their device copies.
struct HostLayer {
  Case c;
  LayerShape shape;
  std::vector<HostBf16> x, w_gate, w_up, w_down, ws_gate, ws_up, ws_down;
  std::vector<int32_t> ids;
  std::vector<float> weights;
  DeviceBuffer d_x, d_ids, d_weights, d_wg, d_wu, d_wd, d_wsg, d_wsu, d_wsd;

  explicit HostLayer(const Case& cs, uint64_t seed) : c(cs) {
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

  LayerInputs inputs() const {
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

  std::vector<double> weights_double() const { return std::vector<double>(weights.begin(), weights.end()); }

  ref::Layer<HostBf16> reference(const std::vector<double>& w) const {
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
};

// ‖got − want‖ / ‖want‖ (Frobenius); got must be all finite.
template <class T>
double rel_error(const std::vector<T>& got, const std::vector<double>& want, const char* what) {
  EXPECT_EQ(got.size(), want.size()) << what;
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    double g;
    if constexpr (std::is_same_v<T, HostBf16>) {
      g = to_double(got[i]);
    } else {
      g = got[i];
    }
    if (!std::isfinite(g)) {
      ADD_FAILURE() << what << "[" << i << "] is not finite (" << g << "): not written or NaN";
      return INFINITY;
    }
    num += (g - want[i]) * (g - want[i]);
    den += want[i] * want[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

constexpr double kTolerance = 1e-2;  // bf16 operands, fp32 accumulation (ARCHITECTURE.md §8)

struct Outputs {
  std::vector<HostBf16> y, dx, dw_gate, dw_up, dw_down, dws_gate, dws_up, dws_down;
  std::vector<float> d_topk;
};

// The first output whose bits differ between a and b ("" when every output is the same).
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

// Device buffers of every output of a layer call, with their views.
struct OutputBuffers {
  const Case c;
  DeviceBuffer y, dx, dtk, dwg, dwu, dwd, dwsg, dwsu, dwsd;

  explicit OutputBuffers(const Case& cs)
      : c(cs), y(c.T * c.H * 2), dx(c.T * c.H * 2), dtk(c.T * c.k * 4), dwg(c.E * c.I * c.H * 2),
        dwu(c.E * c.I * c.H * 2), dwd(c.E * c.H * c.I * 2), dwsg(c.Is * c.H * 2), dwsu(c.Is * c.H * 2),
        dwsd(c.H * c.Is * 2) {}

  // NaN in every float, so that an unwritten element cannot pass.
  void poison() {
    for (DeviceBuffer* b : {&y, &dx, &dtk, &dwg, &dwu, &dwd, &dwsg, &dwsu, &dwsd}) b->fill_bytes(0xFF);
  }
  TensorView y_view() const { return make_view(y.get(), DType::kBF16, {c.T, c.H}); }
  Gradients grads() const {
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
  Outputs to_host_outputs() const {
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
};

// Runs forward and backward on poisoned outputs and copies everything back.
Outputs run_layer(Workspace& ws, const HostLayer& L, const std::vector<HostBf16>& dy, bool recompute = false) {
  const Case& c = L.c;
  OutputBuffers out(c);
  out.poison();
  DeviceBuffer d_dy = to_device(dy);
  const LayerInputs in = L.inputs();
  forward(ws, in, out.y_view(), nullptr);
  if (recompute) recompute_forward_context(ws, in, nullptr);
  backward(ws, in, make_view(d_dy.get(), DType::kBF16, {c.T, c.H}), out.grads(), nullptr);
  return out.to_host_outputs();
}

// Every output against the reference for these inputs and dy.
void expect_matches_reference(const Outputs& o, const HostLayer& L, const std::vector<HostBf16>& dy) {
  const Case& c = L.c;
  const std::vector<double> w = L.weights_double();
  const ref::Layer<HostBf16> r = L.reference(w);
  const std::vector<double> y_ref = ref::forward(r);
  const ref::Gradients g = ref::backward(r, to_double_vec(dy).data());
  EXPECT_LT(rel_error(o.y, y_ref, "y"), kTolerance);
  EXPECT_LT(rel_error(o.dx, g.dx, "dx"), kTolerance);
  // NOTES: each d_topk_weights value is one dot product over I of bf16-rounded factors (da, g, u),
  // so its error scales with the magnitude of its terms, Σ|da_i a_i|, not with its value: each term
  // is off by a few 2⁻⁹ at most, with random signs. Every value must be within 1e-2 of that
  // magnitude (the only meaningful test of a single cancelled sum: T = 1 once gave a plain relative
  // error of 1.2e-2); a tensor of 32 values or more must also meet the plain relative Frobenius
  // error, which averages the cancellations out and is 3-5 times tighter.
  ASSERT_EQ(o.d_topk.size(), g.d_topk_magnitude.size());
  for (size_t i = 0; i < o.d_topk.size(); ++i) {
    ASSERT_LE(std::abs(double(o.d_topk[i]) - g.d_topk_weights[i]), kTolerance * g.d_topk_magnitude[i])
        << "d_topk_weights[" << i << "] = " << o.d_topk[i] << ", reference " << g.d_topk_weights[i];
  }
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

// Every test runs once per backend.
class Layer : public test::GpuTest, public ::testing::WithParamInterface<Backend> {
 protected:
  Config config() const {
    Config c;
    c.backend = GetParam();
    return c;
  }
};

// A case's sizes and routing, for test traces.
std::string case_name(const Case& c) {
  return "T=" + std::to_string(c.T) + " H=" + std::to_string(c.H) + " I=" + std::to_string(c.I) +
         " E=" + std::to_string(c.E) + " k=" + std::to_string(c.k) + " Is=" + std::to_string(c.Is) +
         " routing=" + c.routing;
}

// `clusters`: test_hooks::set_gemm_clusters (-1: the rule); `gemm_sm_count`: set_gemm_sm_count;
// `gather_lookahead`: set_gather_lookahead (0: the rule).
void check_against_reference(const Case& c, uint64_t seed, const Config& config, bool recompute = false,
                             int32_t clusters = -1, int32_t gemm_sm_count = 0, int32_t gather_lookahead = 0,
                             int32_t order = -1) {
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
  for (int32_t e : L.ids) ++rows_per_expert[e];
  for (int64_t e = 0; e < c.E; ++e) {
    if (rows_per_expert[e] != 0) continue;
    for (int64_t i = 0; i < c.I * c.H; ++i) {
      ASSERT_EQ(o.dw_gate[e * c.I * c.H + i].bits, 0) << "expert " << e;
      ASSERT_EQ(o.dw_up[e * c.I * c.H + i].bits, 0) << "expert " << e;
      ASSERT_EQ(o.dw_down[e * c.H * c.I + i].bits, 0) << "expert " << e;
    }
  }
}

std::random_device::result_type fresh_seed() { return std::random_device{}(); }

// A fresh random dy for case `c`.
std::vector<HostBf16> random_dy(const Case& c) {
  std::mt19937_64 rng(fresh_seed());
  return random_bf16(rng, c.T * c.H, 1.0);
}

TEST_P(Layer, MatchesReference) {
  const auto seed = fresh_seed();
  RecordProperty("seed", std::to_string(seed));
  check_against_reference({200, 128, 64, 8, 2, 64}, seed, config());
}

TEST_P(Layer, NoSharedExpertAndTopOne) {
  const auto seed = fresh_seed();
  check_against_reference({130, 128, 128, 4, 1, 0}, seed, config());
}

TEST_P(Layer, LargerShape) {
  check_against_reference({700, 256, 192, 16, 4, 128}, fresh_seed(), config());
}

TEST_P(Layer, ExpertsWithNoRows) {
  Case c{257, 64, 64, 8, 2, 0};
  c.routing = "subset";
  check_against_reference(c, fresh_seed(), config());
}

TEST_P(Layer, EveryRowToOneExpert) {
  Case c{300, 128, 64, 8, 1, 64};
  c.routing = "one";
  check_against_reference(c, fresh_seed(), config());
}

// About 4.7 row blocks per expert: the GEMM's static order rasters in groups of 4 row blocks
// (choose_tile_order), and groups reach across expert boundaries.
TEST_P(Layer, RasterGroupsSpanExperts) { check_against_reference({600, 128, 64, 4, 4, 0}, fresh_seed(), config()); }

// Every token to every expert (E = k = 4): 2200 rows, 18 row blocks per expert: tiles claimed in order,
// groups of 16 + 2 ending at each expert; the last block's 24 rows leave warpgroup 1 idle.
TEST_P(Layer, InOrderTilesWithManyBlocksPerExpert) {
  check_against_reference({2200, 128, 64, 4, 4, 0}, fresh_seed(), config());
}

// About 130 rows per expert, as deepseek-v3: tiles claimed in order, groups ending at each expert, and
// many experts with a second, nearly empty row block.
TEST_P(Layer, InOrderTilesWithTwoBlocksPerExpert) {
  check_against_reference({520, 128, 192, 16, 4, 0}, fresh_seed(), config());
}

TEST_P(Layer, OneLocalExpert) { check_against_reference({77, 64, 64, 1, 1, 0}, fresh_seed(), config()); }

TEST_P(Layer, SmallestShape) { check_against_reference({1, 64, 64, 1, 1, 64}, fresh_seed(), config()); }

// The largest sizes the API accepts, one at a time (tests/cpu/test_validation.cpp checks the limits
// themselves): the most experts with the largest top_k (most experts get no row; the schedule's
// offsets over 4096 experts run in one block), the largest hidden size, the largest intermediate
// size. The most tokens: MaxTokensMatchesUnfused.
TEST_P(Layer, MostExpertsAndLargestTopK) {
  check_against_reference({64, 64, 64, Limits::kMaxExperts, Limits::kMaxTopK, 0}, fresh_seed(), config());
}
TEST_P(Layer, LargestHidden) { check_against_reference({16, Limits::kMaxHidden, 64, 2, 2, 0}, fresh_seed(), config()); }
TEST_P(Layer, LargestIntermediate) {
  check_against_reference({16, 64, Limits::kMaxIntermediate, 2, 2, 64}, fresh_seed(), config());
}

TEST_P(Layer, Int64IdsAndZeroRouterWeights) {
  Case c{150, 128, 64, 8, 4, 64};
  c.int64_ids = true;
  c.zero_weights = true;
  check_against_reference(c, fresh_seed(), config());
}

TEST_P(Layer, RecomputedContextMatchesReference) {
  Config c = config();
  c.save_forward_context = false;
  check_against_reference({200, 128, 64, 8, 2, 64}, fresh_seed(), c, /*recompute=*/true);
}

TEST_P(Layer, BitwiseDeterministic) {
  const Case c{513, 256, 128, 16, 4, 64};
  const HostLayer L(c, fresh_seed());
  std::mt19937_64 rng(fresh_seed());
  const std::vector<HostBf16> dy = random_bf16(rng, c.T * c.H, 1.0);
  Workspace ws(L.shape, config());
  const Outputs first = run_layer(ws, L, dy);
  for (int run = 1; run < 20; ++run) {
    ASSERT_EQ(first_difference(run_layer(ws, L, dy), first), "") << "differs in run " << run;
  }
}

// The row-mode expert GEMMs as cluster units (forced; the rule pairs only long K, use_cluster_units)
// on cases that reach every kind of unit: a shared weight tile, a shared row block, nothing shared
// (units across experts or column blocks), rank 1's padding tile after an odd tile count, in-order
// claims posted through the mailbox and the static round robin, half tiles, experts without rows.
class PairedTiles : public test::GpuTest {
 protected:
  static Config fused() {
    Config c;
    c.backend = Backend::kFused;
    return c;
  }
};

TEST_F(PairedTiles, InOrderTwoBlocksPerExpert) {  // 16 · 130 rows: shared B and A, half tiles
  check_against_reference({520, 256, 256, 16, 4, 0}, fresh_seed(), fused(), false, 1);
}
TEST_F(PairedTiles, InOrderManyBlocksPerExpert) {  // 18 blocks per expert: groups of 16 + 2
  check_against_reference({2200, 128, 64, 4, 4, 0}, fresh_seed(), fused(), false, 1);
}
TEST_F(PairedTiles, StaticGroupsSpanExperts) {  // ~4.7 blocks per expert: units across experts share nothing
  check_against_reference({600, 128, 192, 4, 4, 64}, fresh_seed(), fused(), false, 1);
}
TEST_F(PairedTiles, ExpertsWithNoRows) {
  Case c{257, 64, 64, 8, 2, 0};
  c.routing = "subset";
  check_against_reference(c, fresh_seed(), fused(), false, 1);
}
TEST_F(PairedTiles, OneTileAndAPaddingTile) { check_against_reference({1, 64, 64, 1, 1, 64}, fresh_seed(), fused(), false, 1); }
TEST_F(PairedTiles, OddTileCounts) {  // 3 row blocks of one expert; down has 1 column block: 3 tiles
  check_against_reference({300, 192, 192, 1, 1, 0}, fresh_seed(), fused(), false, 1);
}
TEST_F(PairedTiles, RecomputedContext) {
  Config c = fused();
  c.save_forward_context = false;
  check_against_reference({200, 128, 64, 8, 2, 64}, fresh_seed(), c, /*recompute=*/true, 1);
}
// One cluster (a grid of two CTAs) walks every unit: the unit mailbox's slots are reused dozens of
// times (in order), the stage phases wrap, and the last unit may hold a padding tile.
TEST_F(PairedTiles, OneClusterInOrder) {  // 18 blocks per expert, 72 tiles per GEMM
  check_against_reference({2200, 128, 64, 4, 4, 0}, fresh_seed(), fused(), false, 1, 2);
}
TEST_F(PairedTiles, OneClusterStatic) {  // ~4.7 blocks per expert, shared expert
  check_against_reference({600, 128, 192, 4, 4, 64}, fresh_seed(), fused(), false, 1, 2);
}
TEST_F(PairedTiles, OneClusterOddTileCounts) {
  check_against_reference({300, 192, 192, 1, 1, 0}, fresh_seed(), fused(), false, 1, 2);
}
// Every expert a single half block (~5 rows), every launch with two or more column blocks (H = I =
// 512): units of two column tiles share a half row block in every row mode (gate/up, down, both
// dgrads), where rank 0 alone loads rows 0-63 of A for both CTAs; in order (under two blocks per
// expert) and, on one cluster, with the claims wrapping the mailbox.
TEST_F(PairedTiles, HalfTilesShareTheirRowBlockInEveryMode) {
  const Case c{40, 512, 512, 8, 1, 0};
  check_against_reference(c, fresh_seed(), fused(), false, 1);
  check_against_reference(c, fresh_seed(), fused(), false, 1, 2);
}
// Every padding row of the 64-row halves that hold rows is an exact zero in g and u (gate/up), da
// (the dgrad of down) and the per-row dx (the dgrad of gate/up); stops at the first that is not.
void expect_padding_rows_zero(Workspace& ws, const Case& c) {
  Workspace::Impl& w = ws.impl();
  std::vector<int32_t> offset(c.E + 1), rows(c.E);
  LYNX_TEST_CUDA(cudaMemcpy(offset.data(), w.schedule.expert_offset, offset.size() * 4, cudaMemcpyDeviceToHost));
  LYNX_TEST_CUDA(cudaMemcpy(rows.data(), w.schedule.expert_rows, rows.size() * 4, cudaMemcpyDeviceToHost));
  const int64_t cap = w.problem.capacity;
  struct RowBuffer {
    const char* name;
    const void* data;
    int64_t cols;
  };
  const RowBuffer buffers[] = {
      {"g", w.un.g, c.I}, {"u", w.un.u, c.I}, {"da", w.un.da, c.I}, {"dx rows", w.un.rows_b, c.H}};
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

// How many experts end with a warpgroup of 1-16 rows (swapped_products in fused/tile_scheduler.h).
int experts_with_swapped_tails(Workspace& ws, const Case& c) {
  std::vector<int32_t> rows(c.E);
  LYNX_TEST_CUDA(cudaMemcpy(rows.data(), ws.impl().schedule.expert_rows, rows.size() * 4, cudaMemcpyDeviceToHost));
  int swapped = 0;
  for (int64_t e = 0; e < c.E; ++e) swapped += rows[e] % 64 >= 1 && rows[e] % 64 <= 16;
  return swapped;
}

// Each expert's last row block a half tile with 10-60 rows (160 ± 13 rows per expert), so its A goes in
// 1-4 boxes of 16 rows and zeros for the rest of the half (load_half_a in fused/expert_gemm.cu). The
// padding rows of that half must come out of every row GEMM as exact zeros, as from a 64-row box,
// poisoned with NaN first; single CTAs and cluster units.

TEST_F(PairedTiles, TailPaddingRowsComeOutZero) {
  const Case c{640, 128, 128, 8, 2, 0};
  for (const int32_t clusters : {0, 1}) {
    SCOPED_TRACE("clusters " + std::to_string(clusters));
    const HostLayer L(c, fresh_seed());
    const std::vector<HostBf16> dy = random_dy(c);
    Workspace ws(L.shape, fused());
    test_hooks::set_gemm_clusters(ws, clusters);
    test_hooks::poison_row_buffers(ws);
    expect_matches_reference(run_layer(ws, L, dy), L, dy);
    std::vector<int32_t> rows(c.E);
    LYNX_TEST_CUDA(cudaMemcpy(rows.data(), ws.impl().schedule.expert_rows, rows.size() * 4, cudaMemcpyDeviceToHost));
    int tails = 0;
    for (int64_t e = 0; e < c.E; ++e) tails += rows[e] % 128 != 0 && rows[e] % 128 <= 64;
    ASSERT_GE(tails, c.E / 2) << "the case should give most experts a half tile";
    expect_padding_rows_zero(ws, c);
  }
}

// The products of a warpgroup with 1-16 rows, computed with the operands swapped. Cyclic routing
// gives every expert T·k/E rows: 128-130 (half tiles of 1-2 rows), 144 (16 rows), 208 (warpgroup 1 of
// a second, full block holds 16; cluster units share its weights), 80 (one full block whose warpgroup
// 1 holds 16; H = 512 gives every row mode two column tiles, so cluster units share its rows); random
// routing 136 ± 11 rows per expert, tails of every size, some swapped. Every output against the
// reference and bit for bit against the same layer computed without swapping (the H200 gives the
// same bits both ways: the same k16 products in the same K order; PTX does not promise wgmma's
// internal order, so this pins what was observed); the padding rows exact zeros; single CTAs and
// cluster units; I = 192 clips the last column block of gate/up and of da.
TEST_F(PairedTiles, SwappedProductsOfFewRows) {
  for (const Case& c : {Case{1032, 256, 256, 16, 2, 0, "cyclic"}, Case{1152, 256, 192, 16, 2, 0, "cyclic"},
                        Case{1664, 256, 256, 16, 2, 0, "cyclic"}, Case{640, 512, 256, 16, 2, 0, "cyclic"},
                        Case{1088, 256, 192, 16, 2, 0}}) {
    SCOPED_TRACE("T=" + std::to_string(c.T) + " I=" + std::to_string(c.I) + " routing=" + c.routing);
    for (const int32_t clusters : {0, 1}) {
      SCOPED_TRACE("clusters " + std::to_string(clusters));
      const HostLayer L(c, fresh_seed());
      const std::vector<HostBf16> dy = random_dy(c);
      Workspace swapped(L.shape, fused()), plain(L.shape, fused());
      test_hooks::set_gemm_swapped(swapped, 1);
      test_hooks::set_gemm_swapped(plain, 0);
      for (Workspace* ws : {&swapped, &plain}) {
        test_hooks::set_gemm_fold(*ws, 0);  // a kernel that folds tails has no swapped products
        test_hooks::set_gemm_clusters(*ws, clusters);
        test_hooks::poison_row_buffers(*ws);
      }
      const Outputs a = run_layer(swapped, L, dy);
      expect_matches_reference(a, L, dy);
      ASSERT_GE(experts_with_swapped_tails(swapped, c), 1) << "the case should swap some warpgroups";
      expect_padding_rows_zero(swapped, c);
      EXPECT_EQ(first_difference(a, run_layer(plain, L, dy)), "");
    }
  }
}
// How many experts end in a tail of 1-kFoldRows rows behind a whole block (folded tails in
// fused/tile_scheduler.h).
int experts_with_folded_tails(Workspace& ws, const Case& c) {
  std::vector<int32_t> rows(c.E);
  LYNX_TEST_CUDA(cudaMemcpy(rows.data(), ws.impl().schedule.expert_rows, rows.size() * 4, cudaMemcpyDeviceToHost));
  int folded = 0;
  for (int64_t e = 0; e < c.E; ++e) folded += sched::core::folded_tail_rows(rows[e]) > 0;
  return folded;
}

// Tails of 1-16 rows folded into the block before them. Cyclic routing (expert (t + j) % E, k = 2)
// gives the experts 2T/E rows or one either side: 128-130 (tails of 1 and 2 rows), 136-138 (8-10),
// 144 (16), 144-146 (16 folded beside 17 and 18 not), 272 (two whole blocks and 16 rows: the folding
// tile pairs with the block before it, sharing the weights); random routing
// 132 ± 11 rows per expert. Every output against the reference and bit for bit against the same
// layer without folding (same k16 products in the same K order); the padding rows exact zeros; single
// CTAs and cluster units (H = 512: two column tiles per row mode, so cluster units of a one-block
// expert share its rows and its tail), in order and in the static round robin; I = 192 clips the last
// column block of gate/up and of da.
TEST_F(PairedTiles, FoldedTailsOfFewRows) {
  struct Run {
    Case c;
    int32_t order;  // -1: the rule's (in order at these shapes), 0: the static round robin
  };
  for (const Run& run : {Run{Case{1032, 256, 256, 16, 2, 0, "cyclic"}, -1}, Run{Case{1096, 256, 256, 16, 2, 0, "cyclic"}, -1},
                         Run{Case{1152, 512, 192, 16, 2, 0, "cyclic"}, -1}, Run{Case{1160, 256, 256, 16, 2, 0, "cyclic"}, -1},
                         Run{Case{2176, 256, 256, 16, 2, 0, "cyclic"}, -1}, Run{Case{2176, 256, 256, 16, 2, 0, "cyclic"}, 0},
                         Run{Case{1056, 512, 192, 16, 2, 0}, -1}, Run{Case{1056, 512, 192, 16, 2, 0}, 0}}) {
    const Case& c = run.c;
    SCOPED_TRACE("T=" + std::to_string(c.T) + " H=" + std::to_string(c.H) + " I=" + std::to_string(c.I) +
                 " routing=" + c.routing + " order " + std::to_string(run.order));
    for (const int32_t clusters : {0, 1}) {
      SCOPED_TRACE("clusters " + std::to_string(clusters));
      const HostLayer L(c, fresh_seed());
      const std::vector<HostBf16> dy = random_dy(c);
      Workspace folded(L.shape, fused()), plain(L.shape, fused());
      test_hooks::set_gemm_fold(folded, 1);
      test_hooks::set_gemm_fold(plain, 0);
      for (Workspace* ws : {&folded, &plain}) {
        test_hooks::set_gemm_clusters(*ws, clusters);
        test_hooks::set_gemm_order(*ws, run.order);
        test_hooks::poison_row_buffers(*ws);
      }
      const Outputs a = run_layer(folded, L, dy);
      expect_matches_reference(a, L, dy);
      ASSERT_GE(experts_with_folded_tails(folded, c), 1) << "the case should fold some tails";
      expect_padding_rows_zero(folded, c);
      EXPECT_EQ(first_difference(a, run_layer(plain, L, dy)), "");
    }
  }
}

// The rule itself pairs at K = 4096 (gate/up: K = H; the dgrad of down: K = H): no hook.
TEST_F(PairedTiles, ByTheRuleAtALongK) { check_against_reference({96, 4096, 128, 4, 2, 0}, fresh_seed(), fused()); }

TEST_F(PairedTiles, SameBitsAsSingleCtas) {  // each tile is computed whole over its K in order either way
  const Case c{520, 256, 256, 16, 4, 64};
  const HostLayer L(c, fresh_seed());
  const std::vector<HostBf16> dy = random_dy(c);
  Workspace single(L.shape, fused()), paired(L.shape, fused());
  test_hooks::set_gemm_clusters(single, 0);
  test_hooks::set_gemm_clusters(paired, 1);
  EXPECT_EQ(first_difference(run_layer(single, L, dy), run_layer(paired, L, dy)), "");
}

// The in-kernel gather (fused/row_gather.cuh) with a lookahead of one row block: its warps keep
// waiting for the producers to begin nearer blocks while the producers wait for theirs, on a grid of
// one CTA pair or two CTAs walking every tile; static and in-order tile orders, clusters or not, the
// backward's dy gather (inside the da GEMM) as well. A launch that gathers claims its tiles in order
// (choose_tile_order); the static round robin with a gather is what LYNX_GEMM_ORDER=static runs.
class KernelGather : public PairedTiles {};  // the same fused-only fixture

TEST_F(KernelGather, ThrottledStaticOrder) {  // ~4.7 blocks per expert, shared expert
  check_against_reference({600, 128, 192, 4, 4, 64}, fresh_seed(), fused(), false, 0, 2, 1, /*order=*/0);
}
TEST_F(KernelGather, ThrottledInOrderFewBlocksPerExpert) {  // the rule's order for a gathering launch
  check_against_reference({600, 128, 192, 4, 4, 64}, fresh_seed(), fused(), false, 0, 2, 1);
}
TEST_F(KernelGather, ThrottledInOrder) {  // 18 blocks per expert
  check_against_reference({2200, 128, 64, 4, 4, 0}, fresh_seed(), fused(), false, 0, 2, 1);
}
TEST_F(KernelGather, ThrottledInClusterUnits) {  // 16 · 130 rows: half tiles, shared A and B
  check_against_reference({520, 256, 256, 16, 4, 0}, fresh_seed(), fused(), false, 1, 2, 1);
}
TEST_F(KernelGather, ThrottledWithRecomputedContext) {
  Config c = fused();
  c.save_forward_context = false;
  check_against_reference({300, 192, 192, 8, 2, 0}, fresh_seed(), c, /*recompute=*/true, 0, 2, 1);
}

// The token-major gather kernel before each GEMM (glue::scatter_token_rows) against the in-kernel
// gather: the same bits in every output, the reference matched, padding rows exact zeros in buffers
// poisoned with NaN. Random routing with a shared expert, tails folded (1096 rows, cyclic), k = 1,
// and more tokens than the kernel's token blocks (a second pass of their loop).
TEST_F(KernelGather, TokenMajorSameBitsAsInKernel) {
  for (const Case& c : {Case{600, 128, 192, 4, 4, 64}, Case{1096, 256, 256, 16, 2, 0, "cyclic"},
                        Case{300, 192, 128, 8, 1, 0}, Case{2600, 128, 64, 8, 2, 0}}) {
    SCOPED_TRACE(case_name(c));
    const HostLayer L(c, fresh_seed());
    const std::vector<HostBf16> dy = random_dy(c);
    Workspace token_major(L.shape, fused()), in_kernel(L.shape, fused());
    test_hooks::set_gather_token_major(token_major, 1);
    test_hooks::set_gather_token_major(in_kernel, 0);
    for (Workspace* ws : {&token_major, &in_kernel}) test_hooks::poison_row_buffers(*ws);
    const Outputs a = run_layer(token_major, L, dy);
    expect_matches_reference(a, L, dy);
    expect_padding_rows_zero(token_major, c);
    EXPECT_EQ(first_difference(a, run_layer(in_kernel, L, dy)), "");
  }
}

// A routing error on the device is reported by the call, naming the entry, and y is not written.
void expect_forward_error(HostLayer& L, const Config& config, const std::string& needle) {
  Workspace ws(L.shape, config);
  DeviceBuffer y(L.c.T * L.c.H * 2);
  y.fill_bytes(0x7B);
  try {
    forward(ws, L.inputs(), make_view(y.get(), DType::kBF16, {L.c.T, L.c.H}), nullptr);
    ws.check(nullptr);  // the fused path reports device-side errors here, not from forward
    ADD_FAILURE() << "forward accepted bad routing; expected: " << needle;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
  LYNX_TEST_CUDA(cudaDeviceSynchronize());
  for (HostBf16 v : to_host<HostBf16>(y, L.c.T * L.c.H)) ASSERT_EQ(v.bits, 0x7B7B) << "y was written";
  // The workspace is usable again once the routing is fixed (two experts, well inside any capacity used).
  for (int64_t i = 0; i < int64_t(L.ids.size()); ++i) L.ids[i] = (i % L.c.k) % 2 == 0 ? 0 : int32_t(L.c.E - 1);
  L.weights.assign(L.weights.size(), 0.5f);
  L.d_ids = to_device(L.ids);
  L.d_weights = to_device(L.weights);
  EXPECT_NO_THROW(forward(ws, L.inputs(), make_view(y.get(), DType::kBF16, {L.c.T, L.c.H}), nullptr));
  EXPECT_NO_THROW(ws.check(nullptr));
}

TEST_P(Layer, ExpertIdOutOfRangeIsReported) {
  HostLayer L({64, 64, 64, 8, 2, 0}, fresh_seed());
  L.ids[2 * 37 + 1] = 8;
  L.ids[2 * 50 + 0] = -3;
  L.d_ids = to_device(L.ids);
  expect_forward_error(L, config(), "topk_ids[37, 1] = 8 is out of range [0, 8)");
}

TEST_P(Layer, NonFiniteRouterWeightIsReported) {
  HostLayer L({64, 64, 64, 8, 2, 0}, fresh_seed());
  L.weights[2 * 11 + 0] = std::numeric_limits<float>::infinity();
  L.d_weights = to_device(L.weights);
  expect_forward_error(L, config(), "topk_weights[11, 0] = inf is not finite");
}

// Routing errors of successive calls on one workspace, in entries of different schedule blocks: each
// call reports its own lowest offending entry (the tracking of the call before does not leak in), and
// a call with good routing after them reports nothing.
TEST_P(Layer, SuccessiveRoutingErrorsAreEachReported) {
  HostLayer L({1500, 64, 64, 8, 4, 0}, fresh_seed());  // 6000 entries: 3 schedule blocks of 2048
  const std::vector<int32_t> good_ids = L.ids;
  const std::vector<float> good_weights = L.weights;
  Workspace ws(L.shape, config());
  DeviceBuffer y(L.c.T * L.c.H * 2);
  const TensorView y_view = make_view(y.get(), DType::kBF16, {L.c.T, L.c.H});
  auto run = [&](const std::string& needle) {
    L.d_ids = to_device(L.ids);
    L.d_weights = to_device(L.weights);
    try {
      forward(ws, L.inputs(), y_view, nullptr);
      ws.check(nullptr);
      if (!needle.empty()) ADD_FAILURE() << "forward accepted bad routing; expected: " << needle;
    } catch (const Error& e) {
      if (needle.empty()) ADD_FAILURE() << "good routing reported: " << e.what();
      else EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    L.ids = good_ids;
    L.weights = good_weights;
  };
  L.ids[1400 * 4 + 1] = 9;
  L.ids[900 * 4 + 2] = -1;
  run("topk_ids[900, 2] = -1 is out of range [0, 8)");
  L.ids[1300 * 4 + 0] = 8;
  L.weights[200 * 4 + 3] = -std::numeric_limits<float>::infinity();
  run("topk_weights[200, 3] = -inf is not finite");
  L.ids[1499 * 4 + 3] = 1000;
  run("topk_ids[1499, 3] = 1000 is out of range [0, 8)");
  run("");
}

TEST_P(Layer, CapacityOverflowIsReported) {
  Case c{100, 64, 64, 8, 2, 0};
  c.routing = "cyclic";  // all 8 experts receive rows: 8 padded blocks of 128
  HostLayer L(c, fresh_seed());
  Config small = config();
  small.schedule_capacity = 256;
  expect_forward_error(L, small, "needs 1024 schedule rows but config.schedule_capacity is 256");
}

// A bad route and an overflow in one call: the routing error is the one reported, as the first.
TEST_P(Layer, RoutingErrorWinsOverCapacityOverflow) {
  Case c{100, 64, 64, 8, 2, 0};
  c.routing = "cyclic";
  HostLayer L(c, fresh_seed());
  L.ids[2 * 60 + 1] = 8;
  L.d_ids = to_device(L.ids);
  Config small = config();
  small.schedule_capacity = 256;
  expect_forward_error(L, small, "topk_ids[60, 1] = 8 is out of range [0, 8)");
}

TEST_P(Layer, BackwardWithoutContextIsAnError) {
  const Case c{64, 64, 64, 4, 2, 0};
  HostLayer L(c, fresh_seed());
  Config no_context = config();
  no_context.save_forward_context = false;
  Workspace ws(L.shape, no_context);
  OutputBuffers out(c);
  DeviceBuffer dy(c.T * c.H * 2);
  forward(ws, L.inputs(), out.y_view(), nullptr);
  try {
    backward(ws, L.inputs(), make_view(dy.get(), DType::kBF16, {c.T, c.H}), out.grads(), nullptr);
    ADD_FAILURE() << "backward ran without a forward context";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "backward");
    EXPECT_NE(std::string(e.what()).find("recompute_forward_context"), std::string::npos) << e.what();
  }
}

// The fused forward has no host synchronisation: captured once in a CUDA graph, it is replayed with
// new routing written into the same buffers, and every replay matches the reference.
class FusedForward : public test::GpuTest {};

void capture_and_replay(const Case& c, int32_t clusters = -1) {
  HostLayer L(c, fresh_seed());
  Config config;
  config.backend = Backend::kFused;
  Workspace ws(L.shape, config);
  test_hooks::set_gemm_clusters(ws, clusters);
  DeviceBuffer y(c.T * c.H * 2);
  const TensorView yv = make_view(y.get(), DType::kBF16, {c.T, c.H});
  // NOTES: a blocking stream, so that the synchronous-looking cudaMemcpy / cudaMemset of new routing
  // and poison (legacy default stream) are ordered before each replay.
  cudaStream_t stream;
  LYNX_TEST_CUDA(cudaStreamCreate(&stream));
  forward(ws, L.inputs(), yv, stream);  // first call: one-time kernel setup stays out of the capture
  ws.check(stream);
  cudaGraph_t graph;
  LYNX_TEST_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  forward(ws, L.inputs(), yv, stream);
  LYNX_TEST_CUDA(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  LYNX_TEST_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  std::mt19937_64 rng(fresh_seed());
  for (int replay = 0; replay < 3; ++replay) {
    const HostLayer fresh(c, rng());  // new routing and router weights; same x and weights buffers
    L.ids = fresh.ids;
    L.weights = fresh.weights;
    LYNX_TEST_CUDA(cudaMemcpy(L.d_ids.get(), L.ids.data(), L.ids.size() * 4, cudaMemcpyHostToDevice));
    LYNX_TEST_CUDA(cudaMemcpy(L.d_weights.get(), L.weights.data(), L.weights.size() * 4, cudaMemcpyHostToDevice));
    y.fill_bytes(0xFF);
    LYNX_TEST_CUDA(cudaGraphLaunch(exec, stream));
    ws.check(stream);
    const std::vector<double> w = L.weights_double();
    EXPECT_LT(rel_error(to_host<HostBf16>(y, c.T * c.H), ref::forward(L.reference(w)), "y"), kTolerance)
        << "replay " << replay;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

TEST_F(FusedForward, GraphReplayWithNewRouting) { capture_and_replay({300, 128, 192, 8, 2, 0}); }

TEST_F(FusedForward, GraphReplayWithSharedExpert) { capture_and_replay({200, 128, 64, 8, 2, 64}); }

TEST_F(FusedForward, GraphReplayInClusterUnits) { capture_and_replay({300, 128, 192, 8, 2, 0}, 1); }

// Backward after a forward whose schedule overflowed capacity, before the error is reported: the
// routed outputs (dx, d_topk_weights) stay unwritten, the weight gradients are exact zeros (no rows
// were placed), nothing is read from unplaced row slots (memcheck), and check() names the overflow.
TEST_F(FusedForward, BackwardAfterCapacityOverflowWritesNoRoutedOutputs) {
  Case c{100, 64, 64, 8, 2, 0};
  c.routing = "cyclic";  // all 8 experts receive rows: 8 padded blocks of 128
  HostLayer L(c, fresh_seed());
  Config config;
  config.backend = Backend::kFused;
  config.schedule_capacity = 256;
  Workspace ws(L.shape, config);
  OutputBuffers out(c);
  out.poison();
  DeviceBuffer dy = to_device(std::vector<HostBf16>(c.T * c.H, float_to_bf16(1.0f)));
  forward(ws, L.inputs(), out.y_view(), nullptr);
  backward(ws, L.inputs(), make_view(dy.get(), DType::kBF16, {c.T, c.H}), out.grads(), nullptr);
  try {
    ws.check(nullptr);
    ADD_FAILURE() << "the overflow was not reported";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("config.schedule_capacity is 256"), std::string::npos) << e.what();
  }
  const Outputs o = out.to_host_outputs();
  for (HostBf16 v : o.dx) ASSERT_EQ(v.bits, 0xFFFF) << "dx was written";
  for (float v : o.d_topk) ASSERT_TRUE(std::isnan(v)) << "d_topk_weights was written";
  for (const auto* dw : {&o.dw_gate, &o.dw_up, &o.dw_down}) {
    for (HostBf16 v : *dw) ASSERT_EQ(v.bits & 0x7FFF, 0) << "a weight gradient is not zero";
  }
}

// A workspace destroyed right after queueing a call: its destructor waits for the device, so the
// queued kernels never touch freed memory (memcheck runs this test) and the output is complete.
TEST_F(FusedForward, DestroyingAWorkspaceWaitsForItsKernels) {
  const Case c{300, 128, 128, 8, 2, 64};
  HostLayer L(c, fresh_seed());
  DeviceBuffer y(c.T * c.H * 2);
  y.fill_bytes(0xFF);
  LYNX_TEST_CUDA(cudaDeviceSynchronize());  // the poison lands before the non-blocking stream starts
  cudaStream_t stream;
  LYNX_TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  {
    Config config;
    config.backend = Backend::kFused;
    Workspace ws(L.shape, config);
    forward(ws, L.inputs(), make_view(y.get(), DType::kBF16, {c.T, c.H}), stream);
  }
  LYNX_TEST_CUDA(cudaStreamSynchronize(stream));
  LYNX_TEST_CUDA(cudaStreamDestroy(stream));
  const std::vector<double> w = L.weights_double();
  EXPECT_LT(rel_error(to_host<HostBf16>(y, c.T * c.H), ref::forward(L.reference(w)), "y"), kTolerance);
}

// Shapes too large for the CPU reference: the fused forward against the unfused one.
void expect_fused_forward_matches_unfused(const Case& c) {
  const HostLayer L(c, fresh_seed());
  std::vector<std::vector<HostBf16>> ys;
  for (Backend b : {Backend::kUnfused, Backend::kFused}) {
    Config config;
    config.backend = b;
    Workspace ws(L.shape, config);
    DeviceBuffer y(c.T * c.H * 2);
    y.fill_bytes(0xFF);
    forward(ws, L.inputs(), make_view(y.get(), DType::kBF16, {c.T, c.H}), nullptr);
    ws.check(nullptr);
    ys.push_back(to_host<HostBf16>(y, c.T * c.H));
  }
  EXPECT_LT(rel_error(ys[1], to_double_vec(ys[0]), "y (fused vs unfused)"), kTolerance);
}

TEST_F(FusedForward, MatchesUnfusedOnALargerShape) {
  expect_fused_forward_matches_unfused({4096, 1024, 512, 32, 4, 256});
}

// The most tokens the API accepts (2^20, k = 2: 2 Mi entries, 128 schedule blocks of 8 rounds each);
// a CPU reference at this size would take minutes.
TEST_F(FusedForward, MaxTokensMatchesUnfused) {
  expect_fused_forward_matches_unfused({Limits::kMaxTokens, 64, 64, 8, 2, 0});
}

// What the kernels' last blocks set back is at rest after every call: a forward and backward (the
// in-kernel gathers of x and dy), a call with a routing error, a call over the schedule's capacity
// (the GEMMs have no tiles), and a good call after them; in cluster units and on single CTAs.
TEST_F(FusedForward, CountersAreAtRestBetweenCalls) {
  for (int32_t clusters : {0, 1}) {
    SCOPED_TRACE("clusters=" + std::to_string(clusters));
    const Case c{600, 128, 192, 8, 2, 64};
    HostLayer L(c, fresh_seed());
    std::mt19937_64 rng(fresh_seed());
    const std::vector<HostBf16> dy = random_bf16(rng, c.T * c.H, 1.0);
    Config config;
    config.backend = Backend::kFused;
    Workspace ws(L.shape, config);
    test_hooks::set_gemm_clusters(ws, clusters);
    EXPECT_EQ(test_hooks::counters_not_at_rest(ws), "") << "new workspace";
    run_layer(ws, L, dy);
    EXPECT_EQ(test_hooks::counters_not_at_rest(ws), "") << "after forward and backward";
    OutputBuffers out(c);
    const std::vector<int32_t> good = L.ids;
    L.ids[5 * c.k + 1] = int32_t(c.E);
    L.d_ids = to_device(L.ids);
    EXPECT_THROW({ forward(ws, L.inputs(), out.y_view(), nullptr); ws.check(nullptr); }, Error);
    EXPECT_EQ(test_hooks::counters_not_at_rest(ws), "") << "after a routing error";
    L.ids = good;
    L.d_ids = to_device(L.ids);
    Config small = config;
    small.schedule_capacity = 128;  // 8 experts with rows need 8 blocks
    Workspace over(L.shape, small);
    EXPECT_THROW({ forward(over, L.inputs(), out.y_view(), nullptr); over.check(nullptr); }, Error);
    EXPECT_EQ(test_hooks::counters_not_at_rest(over), "") << "after a capacity overflow";
    EXPECT_EQ(first_difference(run_layer(ws, L, dy), run_layer(ws, L, dy)), "");
    EXPECT_EQ(test_hooks::counters_not_at_rest(ws), "") << "after good calls";
  }
}

// Forward and backward of the fused path captured together in one CUDA graph, replayed with new
// routing: every gradient matches the reference on every replay.
TEST_F(FusedForward, GraphReplayOfForwardAndBackward) {
  const Case c{250, 128, 128, 8, 2, 64};
  HostLayer L(c, fresh_seed());
  Config config;
  config.backend = Backend::kFused;
  Workspace ws(L.shape, config);
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
  forward(ws, L.inputs(), yv, stream);
  backward(ws, L.inputs(), dyv, g, stream);
  ws.check(stream);
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
    LYNX_TEST_CUDA(cudaMemcpy(L.d_ids.get(), L.ids.data(), L.ids.size() * 4, cudaMemcpyHostToDevice));
    LYNX_TEST_CUDA(cudaMemcpy(L.d_weights.get(), L.weights.data(), L.weights.size() * 4, cudaMemcpyHostToDevice));
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

// A forced stall (a test hook set by `stall`) ends in a diagnostic naming the wait, not a hang, and in
// a trap: the consumers that time out record the stall and leave, and their producer thread traps for
// them. The trap kills the CUDA context (printed after the diagnostic: "[context lost]"), so it runs
// in a child process.
template <class Stall>
[[noreturn]] void run_stalled_forward(Stall stall) {
  const Case c{300, 128, 128, 4, 2, 0};
  const HostLayer L(c, 7);
  Config config;
  config.backend = Backend::kFused;
  Workspace ws(L.shape, config);
  stall(ws);
  DeviceBuffer y(c.T * c.H * 2);
  try {
    forward(ws, L.inputs(), make_view(y.get(), DType::kBF16, {c.T, c.H}), nullptr);
    ws.check(nullptr);
  } catch (const std::exception& e) {
    const bool lost = cudaDeviceSynchronize() != cudaSuccess;
    std::fprintf(stderr, "%s [%s]\n", e.what(), lost ? "context lost" : "the grid ended without a trap");
    std::exit(3);
  }
  std::exit(0);
}

// Tile 0's loads are never issued.
[[noreturn]] void run_stalled_tile(int32_t clusters) {
  run_stalled_forward([clusters](Workspace& ws) {
    test_hooks::set_stall_task(ws, 0);
    test_hooks::set_gemm_clusters(ws, clusters);
  });
}

TEST_F(FusedForward, ForcedStallIsReportedNotHung) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(run_stalled_tile(0), ::testing::ExitedWithCode(3), "timed out in block [0-9]+: wait [12] = (full|empty) stage.*\\[context lost\\]");
}

// The same in cluster units with in-order claims: rank 0 of the cluster that claims unit 0 stops; its
// consumers, its partner's producer (stages or the unit mailbox) or its partner's consumers time out.
TEST_F(FusedForward, ForcedStallInAClusterIsReportedNotHung) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(run_stalled_tile(1), ::testing::ExitedWithCode(3),
              "timed out in block [0-9]+: wait [1-4] = (full stage|empty stage|unit posted|unit taken).*\\[context lost\\]");
}

// The gather's rows never arrive (test hook: row block 0 is claimed, never copied): the producer's
// bounded wait for them reports, naming the wait.
[[noreturn]] void run_stalled_gather() {
  run_stalled_forward([](Workspace& ws) {
    test_hooks::set_gather_token_major(ws, 0);  // the stall hook is the in-kernel gather's
    test_hooks::set_gather_stall_block(ws, 0);
  });
}

TEST_F(KernelGather, StalledRowsAreReportedNotHung) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(run_stalled_gather(), ::testing::ExitedWithCode(3),
              "timed out in block [0-9]+: wait 5 = rows gathered.*\\[context lost\\]");
}

// A schedule block never arrives at the builder's first grid barrier (test hook): the bounded wait
// of the blocks there reports it, naming the wait.
[[noreturn]] void run_stalled_schedule() {
  run_stalled_forward([](Workspace& ws) { test_hooks::set_schedule_stall_block(ws, 0); });
}

TEST_F(FusedForward, StalledScheduleIsReportedNotHung) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(run_stalled_schedule(), ::testing::ExitedWithCode(3),
              "timed out in block [0-9]+: wait 7 = schedule blocks.*barrier 1.*\\[context lost\\]");
}

// A workspace's first forward and backward only queue work: behind a kernel that keeps the GPU busy
// for 500 ms, both host calls return long before it ends. In a child process, so that no kernel is
// loaded yet: lazy module loading loads a kernel at its first launch, and a load waits for the kernels
// running (glue::prepare_glue_kernels).
[[noreturn]] void run_first_calls_behind_a_busy_gpu() {
  const Case c{300, 128, 128, 4, 2, 0};
  const HostLayer L(c, 7);
  Config config;
  config.backend = Backend::kFused;
  Workspace ws(L.shape, config);
  OutputBuffers out(c);
  const DeviceBuffer dy = to_device(std::vector<HostBf16>(c.T * c.H, float_to_bf16(1.0f)));
  cudaStream_t stream;
  LYNX_TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  test::spin_on_stream(stream, 500'000'000);
  const auto t0 = std::chrono::steady_clock::now();
  forward(ws, L.inputs(), out.y_view(), stream);
  backward(ws, L.inputs(), make_view(dy.get(), DType::kBF16, {c.T, c.H}), out.grads(), stream);
  const double host_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  ws.check(stream);
  std::fprintf(stderr, "host %.1f ms\n", host_ms);
  std::exit(host_ms < 100 ? 0 : 4);
}

TEST_F(FusedForward, FirstCallsDoNotWaitForTheGpu) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(run_first_calls_behind_a_busy_gpu(), ::testing::ExitedWithCode(0), "host [0-9.]+ ms");
}

INSTANTIATE_TEST_SUITE_P(Backends, Layer, ::testing::Values(Backend::kUnfused, Backend::kFused),
                         [](const ::testing::TestParamInfo<Backend>& info) {
                           return info.param == Backend::kFused ? std::string("fused") : std::string("unfused");
                         });

}  // namespace
}  // namespace lynx
