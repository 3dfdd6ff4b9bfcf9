// Proves the double-precision CPU reference right: known values, an independent literal forward,
// central finite differences for every element of every gradient, the per-token entry points, the
// bf16 instantiation, and the edge cases (no shared expert, k = 1, duplicate experts, zero
// router weights).
#include "reference/reference.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <limits>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using lynx::HostBf16;
using namespace lynx::ref;

struct Shape {
  int64_t T, H, I, E, k, I_shared;
};

// The tensors of one layer, in double.
struct Problem {
  Shape s;
  std::vector<double> x, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, dy;
  std::vector<int32_t> topk_ids;

  Layer<double> layer() const {
    Layer<double> L;
    L.T = s.T, L.H = s.H, L.I = s.I, L.E = s.E, L.k = s.k, L.I_shared = s.I_shared;
    L.x = x.data(), L.topk_ids = topk_ids.data(), L.topk_weights = topk_weights.data();
    L.w_gate = w_gate.data(), L.w_up = w_up.data(), L.w_down = w_down.data();
    L.ws_gate = ws_gate.data(), L.ws_up = ws_up.data(), L.ws_down = ws_down.data();
    return L;
  }
};

// x, dy ~ N(0,1); gate/up rows ~ N(0,1)·1.5/sqrt(H), so g and u ~ N(0, 1.5²): silu is sampled over
// its curved range (about [-4, 4]), not its linear tail. down ~ N(0,1)/sqrt(I); router weights
// U(0.1, 1). Each token gets k distinct experts; tests that want duplicates write them in.
Problem make_problem(Shape s, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal;
  auto fill = [&](std::vector<double>& v, int64_t n, double scale) {
    v.resize(n);
    for (double& e : v) e = normal(rng) * scale;
  };
  Problem p{s, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}};
  const double gs = 1.5 / std::sqrt(double(s.H));
  fill(p.x, s.T * s.H, 1.0);
  fill(p.dy, s.T * s.H, 1.0);
  fill(p.w_gate, s.E * s.I * s.H, gs);
  fill(p.w_up, s.E * s.I * s.H, gs);
  fill(p.w_down, s.E * s.H * s.I, 1.0 / std::sqrt(double(s.I)));
  fill(p.ws_gate, s.I_shared * s.H, gs);
  fill(p.ws_up, s.I_shared * s.H, gs);
  fill(p.ws_down, s.H * s.I_shared, s.I_shared ? 1.0 / std::sqrt(double(s.I_shared)) : 0.0);
  std::uniform_real_distribution<double> uniform(0.1, 1.0);
  p.topk_weights.resize(s.T * s.k);
  for (double& w : p.topk_weights) w = uniform(rng);
  std::vector<int32_t> perm(s.E);
  for (int64_t t = 0; t < s.T; ++t) {
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    p.topk_ids.insert(p.topk_ids.end(), perm.begin(), perm.begin() + s.k);
  }
  return p;
}

double loss(const Problem& p) {
  const std::vector<double> y = forward(p.layer());
  double L = 0.0;
  for (size_t i = 0; i < y.size(); ++i) L += y[i] * p.dy[i];
  return L;
}

// Central finite differences of L = <forward(layer), dy> for every element of `param`, against the
// analytic gradient `grad`.
//
// Step h = 1e-5·(1+|θ|). Truncation error ≈ h²/6·|∂³L| ≈ 2e-11·|∂³L|; rounding error ≈
// ε·(Σ|terms of L|)/h ≈ 1e-16·O(100)/1e-5 ≈ 1e-9. Both are far below the tolerance: the error,
// relative to |g| + max|grad| of the tensor, must be ≤ 1e-8 (observed worst: 1.3e-10, printed
// below).
// The divisor is the actual step (θ+h) - (θ-h) as represented, not 2h.
constexpr double kFdRelStep = 1e-5;
constexpr double kFdTol = 1e-8;

double check_fd(Problem& p, std::vector<double>& param, const std::vector<double>& grad,
                const std::string& name) {
  EXPECT_EQ(param.size(), grad.size()) << name;
  if (param.size() != grad.size()) return 0.0;
  double scale = 0.0;
  for (double g : grad) scale = std::max(scale, std::abs(g));
  double worst = 0.0;
  for (size_t i = 0; i < param.size(); ++i) {
    const double theta = param[i], h = kFdRelStep * (1.0 + std::abs(theta));
    const double up = theta + h, down = theta - h;
    param[i] = up;
    const double Lp = loss(p);
    param[i] = down;
    const double Lm = loss(p);
    param[i] = theta;
    const double fd = (Lp - Lm) / (up - down);
    const double bound = std::abs(grad[i]) + scale;
    EXPECT_LE(std::abs(fd - grad[i]), kFdTol * bound)
        << name << "[" << i << "]: finite difference " << fd << ", backward " << grad[i];
    if (bound > 0) worst = std::max(worst, std::abs(fd - grad[i]) / bound);
  }
  return worst;
}

// Checks every gradient of `backward` against finite differences; returns the gradients.
Gradients check_all_fd(Problem& p, const char* test) {
  const Gradients g = backward(p.layer(), p.dy.data());
  double worst = 0.0;
  worst = std::max(worst, check_fd(p, p.x, g.dx, "dx"));
  worst = std::max(worst, check_fd(p, p.topk_weights, g.d_topk_weights, "d_topk_weights"));
  worst = std::max(worst, check_fd(p, p.w_gate, g.dw_gate, "dw_gate"));
  worst = std::max(worst, check_fd(p, p.w_up, g.dw_up, "dw_up"));
  worst = std::max(worst, check_fd(p, p.w_down, g.dw_down, "dw_down"));
  worst = std::max(worst, check_fd(p, p.ws_gate, g.dws_gate, "dws_gate"));
  worst = std::max(worst, check_fd(p, p.ws_up, g.dws_up, "dws_up"));
  worst = std::max(worst, check_fd(p, p.ws_down, g.dws_down, "dws_down"));
  std::printf("[ %s ] worst finite-difference error / (|g| + max|g|): %.3g\n", test, worst);
  return g;
}

bool bits_equal(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (std::bit_cast<uint64_t>(a[i]) != std::bit_cast<uint64_t>(b[i])) return false;
  return true;
}

double silu_literal(double z) { return z / (1.0 + std::exp(-z)); }

// The formula of docs/design.md written out literally, with the layouts spelled as index
// formulas: an independent check of forward (finite differences only tie backward to forward).
std::vector<double> forward_literal(const Problem& p) {
  const auto [T, H, I, E, k, Is] = p.s;
  std::vector<double> y(T * H, 0.0);
  auto ffn = [&](const double* wg, const double* wu, const double* wd, int64_t n, int64_t t,
                 double w) {
    std::vector<double> a(n);
    for (int64_t i = 0; i < n; ++i) {
      double g = 0, u = 0;
      for (int64_t h = 0; h < H; ++h) {
        g += wg[i * H + h] * p.x[t * H + h];  // w_gate[i, h]
        u += wu[i * H + h] * p.x[t * H + h];
      }
      a[i] = silu_literal(g) * u;
    }
    for (int64_t h = 0; h < H; ++h) {
      double f = 0;
      for (int64_t i = 0; i < n; ++i) f += wd[h * n + i] * a[i];  // w_down[h, i]
      y[t * H + h] += w * f;
    }
  };
  for (int64_t t = 0; t < T; ++t) {
    if (Is > 0) ffn(p.ws_gate.data(), p.ws_up.data(), p.ws_down.data(), Is, t, 1.0);
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = p.topk_ids[t * k + j];
      ffn(&p.w_gate[e * I * H], &p.w_up[e * I * H], &p.w_down[e * H * I], I, t,
          p.topk_weights[t * k + j]);
    }
  }
  return y;
}

void expect_near_rel(const std::vector<double>& a, const std::vector<double>& b, double rel,
                     const char* name) {
  ASSERT_EQ(a.size(), b.size()) << name;
  double scale = 0.0;
  for (double v : b) scale = std::max(scale, std::abs(v));
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_NEAR(a[i], b[i], rel * scale) << name << "[" << i << "]";
}

TEST(Reference, KnownValuesOnATinyLayer) {
  // H = I = I_shared = 1, two experts, both routed; dy = 1. Expected values from closed forms
  // (e.g. y = -silu(2) - 0.75 silu(1) + 0.75 silu(-2)) evaluated with 30-digit arithmetic.
  Problem p{{1, 1, 1, 2, 2, 1}, {2.0}, {0.25, 0.75}, {0.5, -1.0}, {3.0, 0.25}, {-0.5, 2.0},
            {1.0}, {-1.0}, {0.5}, {1.0}, {0, 1}};
  const std::vector<double> y = forward(p.layer());
  EXPECT_NEAR(y[0], -2.48869247296144488, 1e-15);
  const Gradients g = backward(p.layer(), p.dy.data());
  EXPECT_NEAR(g.dx[0], -2.61491874062875383, 1e-15);
  EXPECT_NEAR(g.d_topk_weights[0], -2.19317573589001464, 1e-15);  // f_0 = -3 silu(1)
  EXPECT_NEAR(g.d_topk_weights[1], -0.238405844044235112, 1e-15);  // f_1 = silu(-2)
  EXPECT_NEAR(g.dw_down[0], 1.09658786794500732, 1e-15);   // 0.25 · a_0 = 1.5 silu(1)
  EXPECT_NEAR(g.dw_gate[0], -1.39150576780723010, 1e-15);  // -1.5 silu'(1)
  EXPECT_NEAR(g.dw_up[0], -0.182764644657501220, 1e-15);   // -0.25 silu(1)
  EXPECT_NEAR(g.dws_down[0], -3.52318831191152978, 1e-15);  // a_shared = -2 silu(2)
  // One term per dot product (I = 1): the magnitude is the value's absolute value.
  EXPECT_NEAR(g.d_topk_magnitude[0], 2.19317573589001464, 1e-15);
  EXPECT_NEAR(g.d_topk_magnitude[1], 0.238405844044235112, 1e-15);
  // One term per expert: each term's squared norm is the gradient's square.
  ASSERT_EQ(g.dw_term_square.size(), 6u);
  EXPECT_NEAR(g.dw_term_square[0], g.dw_gate[0] * g.dw_gate[0], 1e-15);
  EXPECT_NEAR(g.dw_term_square[1], g.dw_up[0] * g.dw_up[0], 1e-15);
  EXPECT_NEAR(g.dw_term_square[2], g.dw_down[0] * g.dw_down[0], 1e-15);
}

// A token routed twice to one expert with router weights w and -w: the expert's weight gradients
// cancel to exact zeros, the sum of its terms' squared norms does not (twice one term's).
TEST(Reference, DwTermSquareSurvivesCancellation) {
  Problem p = make_problem({1, 8, 4, 2, 2, 0}, 11);
  p.topk_ids = {1, 1};
  p.topk_weights = {0.625, -0.625};
  const Gradients g = backward(p.layer(), p.dy.data());
  Problem one = p;
  one.s.k = 1;
  one.topk_ids = {1};
  one.topk_weights = {0.625};
  const Gradients single = backward(one.layer(), one.dy.data());
  for (double v : g.dw_gate) EXPECT_EQ(v, 0.0);
  for (double v : g.dw_down) EXPECT_EQ(v, 0.0);
  for (int q = 0; q < 3; ++q) {
    EXPECT_EQ(g.dw_term_square[q], 0.0);  // expert 0: no rows
    EXPECT_GT(single.dw_term_square[3 + q], 0.0);
    EXPECT_NEAR(g.dw_term_square[3 + q], 2 * single.dw_term_square[3 + q], 1e-12 * single.dw_term_square[3 + q]);
  }
}

TEST(Reference, DTopkMagnitudeBoundsTheValue) {
  const Problem p = make_problem({9, 16, 8, 4, 2, 8}, 5);
  const Gradients g = backward(p.layer(), p.dy.data());
  ASSERT_EQ(g.d_topk_magnitude.size(), g.d_topk_weights.size());
  bool some_cancellation = false;
  for (size_t i = 0; i < g.d_topk_weights.size(); ++i) {
    EXPECT_GE(g.d_topk_magnitude[i], std::abs(g.d_topk_weights[i]));
    some_cancellation = some_cancellation || g.d_topk_magnitude[i] > 1.5 * std::abs(g.d_topk_weights[i]);
  }
  EXPECT_TRUE(some_cancellation);  // random signs: the terms do cancel
}

TEST(Reference, ForwardMatchesLiteralFormula) {
  for (const Shape s : {Shape{6, 12, 10, 5, 3, 7}, Shape{4, 9, 5, 3, 2, 0}}) {
    Problem p = make_problem(s, 11);
    p.topk_ids[1 * s.k + 1] = p.topk_ids[1 * s.k + 0];  // a duplicate
    expect_near_rel(forward(p.layer()), forward_literal(p), 1e-13, "y");
  }
}

TEST(Reference, FiniteDifferencesWithSharedExpert) {
  Problem p = make_problem({5, 8, 6, 4, 2, 4}, 1);
  check_all_fd(p, "shared expert");
}

TEST(Reference, FiniteDifferencesWithoutSharedExpert) {
  Problem p = make_problem({5, 8, 6, 4, 2, 0}, 2);
  const Gradients g = check_all_fd(p, "no shared expert");
  EXPECT_TRUE(g.dws_gate.empty() && g.dws_up.empty() && g.dws_down.empty());
}

TEST(Reference, FiniteDifferencesTopOne) {
  Problem p = make_problem({5, 8, 6, 4, 1, 4}, 3);
  check_all_fd(p, "k = 1");
}

TEST(Reference, FiniteDifferencesDuplicateExpertInTopK) {
  const Shape s{5, 8, 6, 4, 3, 4};
  Problem p = make_problem(s, 4);
  // Token 2 sends rows j = 0 and j = 2 to expert 1; token 4 sends all three rows to expert 3.
  p.topk_ids[2 * 3 + 0] = 1, p.topk_ids[2 * 3 + 1] = 0, p.topk_ids[2 * 3 + 2] = 1;
  for (int j = 0; j < 3; ++j) p.topk_ids[4 * 3 + j] = 3;
  const Gradients g = check_all_fd(p, "duplicate expert");
  EXPECT_EQ(g.d_topk_weights[2 * 3 + 0], g.d_topk_weights[2 * 3 + 2]);
  EXPECT_EQ(g.d_topk_weights[4 * 3 + 0], g.d_topk_weights[4 * 3 + 1]);

  // A duplicate pair (w0, w2) on one expert is the same layer as (w0 + w2, 0) with the second row
  // sent anywhere.
  Problem merged = p;
  merged.topk_weights[2 * 3 + 0] += merged.topk_weights[2 * 3 + 2];
  merged.topk_weights[2 * 3 + 2] = 0.0;
  merged.topk_ids[2 * 3 + 2] = 2;
  expect_near_rel(forward(p.layer()), forward(merged.layer()), 1e-14, "y");
  const Gradients gm = backward(merged.layer(), merged.dy.data());
  expect_near_rel(g.dx, gm.dx, 1e-14, "dx");
  expect_near_rel(g.dw_gate, gm.dw_gate, 1e-14, "dw_gate");
  expect_near_rel(g.dw_up, gm.dw_up, 1e-14, "dw_up");
  expect_near_rel(g.dw_down, gm.dw_down, 1e-14, "dw_down");
}

TEST(Reference, FiniteDifferencesZeroRouterWeight) {
  const Shape s{5, 8, 6, 4, 2, 4};
  Problem p = make_problem(s, 5);
  p.topk_weights[3 * 2 + 1] = 0.0;
  const Gradients g = check_all_fd(p, "zero router weight");
  // The row still has a gradient for its weight: <dy, f_e(x)>, which is not small here.
  double scale = 0.0;
  for (double d : g.d_topk_weights) scale = std::max(scale, std::abs(d));
  EXPECT_GT(std::abs(g.d_topk_weights[3 * 2 + 1]), 1e-3 * scale);
}

template <class Src>
void expect_token_entry_points_match(const Layer<Src>& L, const std::vector<double>& dy) {
  const std::vector<double> y = forward(L);
  const Gradients g = backward(L, dy.data());
  std::vector<double> row(L.H), dx(L.H), dw(L.k);
  for (int64_t t = 0; t < L.T; ++t) {
    forward_token(L, t, row.data());
    for (int64_t h = 0; h < L.H; ++h)
      EXPECT_EQ(row[h], y[t * L.H + h]) << "y[" << t << "," << h << "]";
    backward_token(L, t, dy.data() + t * L.H, dx.data(), dw.data());
    for (int64_t h = 0; h < L.H; ++h)
      EXPECT_EQ(dx[h], g.dx[t * L.H + h]) << "dx[" << t << "," << h << "]";
    for (int64_t j = 0; j < L.k; ++j)
      EXPECT_EQ(dw[j], g.d_topk_weights[t * L.k + j]) << "d_topk_weights[" << t << "," << j << "]";
  }
}

// Rounds every bf16-stored tensor of p to bf16 and returns the bf16 copies, in Problem order.
std::vector<std::vector<HostBf16>> to_bf16(Problem& p) {
  std::vector<std::vector<HostBf16>> out;
  for (std::vector<double>* v :
       {&p.x, &p.w_gate, &p.w_up, &p.w_down, &p.ws_gate, &p.ws_up, &p.ws_down}) {
    std::vector<HostBf16> b(v->size());
    for (size_t i = 0; i < v->size(); ++i) {
      b[i] = lynx::float_to_bf16(float((*v)[i]));
      (*v)[i] = lynx::to_double(b[i]);
    }
    out.push_back(std::move(b));
  }
  return out;
}

Layer<HostBf16> bf16_layer(const Problem& p, const std::vector<std::vector<HostBf16>>& b) {
  Layer<HostBf16> L;
  L.T = p.s.T, L.H = p.s.H, L.I = p.s.I, L.E = p.s.E, L.k = p.s.k, L.I_shared = p.s.I_shared;
  L.x = b[0].data(), L.topk_ids = p.topk_ids.data(), L.topk_weights = p.topk_weights.data();
  L.w_gate = b[1].data(), L.w_up = b[2].data(), L.w_down = b[3].data();
  L.ws_gate = b[4].data(), L.ws_up = b[5].data(), L.ws_down = b[6].data();
  return L;
}

TEST(Reference, TokenEntryPointsMatchFullPasses) {
  Problem p = make_problem({7, 24, 16, 6, 3, 8}, 6);
  p.topk_ids[0] = p.topk_ids[1];  // a duplicate
  expect_token_entry_points_match(p.layer(), p.dy);
  const auto b = to_bf16(p);
  expect_token_entry_points_match(bf16_layer(p, b), p.dy);
}

// The passes spread tokens and weight-gradient pieces over threads; every output is the same bits on
// 1, 2, 3 and the machine's threads: a shared expert, duplicate ids, slots not routed, an unused
// expert, and I and I_shared past a multiple of the 16-row pieces.
TEST(Reference, SameBitsOnAnyThreadCount) {
  Problem p = make_problem({29, 24, 37, 6, 3, 21}, 14);
  p.topk_ids[4] = p.topk_ids[3];  // a duplicate within token 1
  p.topk_ids[7] = -1;             // not routed
  for (int32_t& e : p.topk_ids) {
    if (e == 5) e = 0;  // expert 5 receives nothing
  }
  const Layer<double> L = p.layer();
  const std::vector<double> y = forward(L, 1);
  const Gradients g = backward(L, p.dy.data(), 1);
  for (const int threads : {2, 3, 0}) {
    SCOPED_TRACE("threads " + std::to_string(threads));
    EXPECT_TRUE(bits_equal(y, forward(L, threads)));
    const Gradients h = backward(L, p.dy.data(), threads);
    EXPECT_TRUE(bits_equal(g.dx, h.dx));
    EXPECT_TRUE(bits_equal(g.d_topk_weights, h.d_topk_weights));
    EXPECT_TRUE(bits_equal(g.d_topk_magnitude, h.d_topk_magnitude));
    EXPECT_TRUE(bits_equal(g.d_topk_term_rss, h.d_topk_term_rss));
    EXPECT_TRUE(bits_equal(g.dw_gate, h.dw_gate));
    EXPECT_TRUE(bits_equal(g.dw_up, h.dw_up));
    EXPECT_TRUE(bits_equal(g.dw_down, h.dw_down));
    EXPECT_TRUE(bits_equal(g.dw_term_square, h.dw_term_square));
    EXPECT_TRUE(bits_equal(g.dws_gate, h.dws_gate));
    EXPECT_TRUE(bits_equal(g.dws_up, h.dws_up));
    EXPECT_TRUE(bits_equal(g.dws_down, h.dws_down));
  }
}

TEST(Reference, Bf16MatchesDoubleBitwise) {
  for (const Shape s : {Shape{7, 24, 16, 6, 3, 8}, Shape{4, 16, 8, 4, 2, 0}}) {
    Problem p = make_problem(s, 7);
    const auto b = to_bf16(p);  // p now holds the bf16 values, exactly, in double
    const Layer<double> Ld = p.layer();
    const Layer<HostBf16> Lb = bf16_layer(p, b);
    EXPECT_TRUE(bits_equal(forward(Ld), forward(Lb)));
    const Gradients gd = backward(Ld, p.dy.data()), gb = backward(Lb, p.dy.data());
    EXPECT_TRUE(bits_equal(gd.dx, gb.dx));
    EXPECT_TRUE(bits_equal(gd.d_topk_weights, gb.d_topk_weights));
    EXPECT_TRUE(bits_equal(gd.dw_gate, gb.dw_gate));
    EXPECT_TRUE(bits_equal(gd.dw_up, gb.dw_up));
    EXPECT_TRUE(bits_equal(gd.dw_down, gb.dw_down));
    EXPECT_TRUE(bits_equal(gd.dws_gate, gb.dws_gate));
    EXPECT_TRUE(bits_equal(gd.dws_up, gb.dws_up));
    EXPECT_TRUE(bits_equal(gd.dws_down, gb.dws_down));
  }
}

TEST(Reference, UnusedExpertHasZeroWeightGradients) {
  const Shape s{6, 8, 6, 5, 2, 4};
  Problem p = make_problem(s, 8);
  const int32_t used[4] = {0, 1, 3, 4};  // expert 2 receives nothing
  for (int64_t t = 0; t < s.T; ++t) {
    p.topk_ids[t * 2] = used[t % 4];
    p.topk_ids[t * 2 + 1] = used[(t + 1) % 4];
  }
  for (int32_t e : p.topk_ids) ASSERT_NE(e, 2);
  const Gradients g = backward(p.layer(), p.dy.data());
  const int64_t n = s.I * s.H;
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_EQ(g.dw_gate[2 * n + i], 0.0);
    EXPECT_EQ(g.dw_up[2 * n + i], 0.0);
    EXPECT_EQ(g.dw_down[2 * n + i], 0.0);
  }
  // ...while the experts that are used have nonzero gradients.
  EXPECT_NE(g.dw_down[4 * n], 0.0);
}

// A slot not routed (id -1, its weight NaN: not read) adds nothing: every output equals the layer
// without it (k = 2 with slot j = 1 unrouted against k = 1), and its d_topk_weights is 0.
TEST(Reference, UnroutedSlotAddsNothing) {
  Problem p = make_problem({3, 8, 4, 4, 2, 4}, 13);
  Problem one = p;
  one.s.k = 1;
  one.topk_ids.clear(), one.topk_weights.clear();
  for (int64_t t = 0; t < p.s.T; ++t) {
    one.topk_ids.push_back(p.topk_ids[t * 2]);
    one.topk_weights.push_back(p.topk_weights[t * 2]);
    p.topk_ids[t * 2 + 1] = -1;
    p.topk_weights[t * 2 + 1] = std::numeric_limits<double>::quiet_NaN();
  }
  EXPECT_EQ(forward(p.layer()), forward(one.layer()));
  const Gradients g = backward(p.layer(), p.dy.data()), h = backward(one.layer(), one.dy.data());
  EXPECT_EQ(g.dx, h.dx);
  EXPECT_EQ(g.dw_gate, h.dw_gate);
  EXPECT_EQ(g.dw_up, h.dw_up);
  EXPECT_EQ(g.dw_down, h.dw_down);
  EXPECT_EQ(g.dws_gate, h.dws_gate);
  EXPECT_EQ(g.dw_term_square, h.dw_term_square);
  for (int64_t t = 0; t < p.s.T; ++t) {
    EXPECT_EQ(g.d_topk_weights[t * 2], h.d_topk_weights[t]);
    EXPECT_EQ(g.d_topk_weights[t * 2 + 1], 0.0);
    EXPECT_EQ(g.d_topk_magnitude[t * 2 + 1], 0.0);
  }
}

TEST(Reference, ExpertIdOutOfRangeThrows) {
  Problem p = make_problem({2, 4, 3, 3, 2, 0}, 9);
  p.topk_ids[3] = 3;
  EXPECT_THROW(forward(p.layer()), std::out_of_range);
  EXPECT_THROW(backward(p.layer(), p.dy.data()), std::out_of_range);
  p.topk_ids[3] = -2;  // (-1 is "not routed")
  std::vector<double> row(4), dw(2);
  EXPECT_THROW(forward_token(p.layer(), 1, row.data()), std::out_of_range);
  EXPECT_THROW(backward_token(p.layer(), 1, p.dy.data() + 4, row.data(), dw.data()),
               std::out_of_range);
}

}  // namespace
