#include "gpu/random_case.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "experiments/test_hooks.h"
#include "gpu/case_dump.h"
#include "gpu/ranks_check.h"

namespace lynx::test {
namespace {

unsigned thread_count() { return std::max(1u, std::thread::hardware_concurrency()); }

void add_into(double* to, const std::vector<double>& from) {
  for (size_t i = 0; i < from.size(); ++i) to[i] += from[i];
}

// The layer made of expert e's terms `slots` alone: one row each (its token's x and dy), E = 1, k = 1,
// the router weight kept.
struct ExpertTerms {
  std::vector<HostBf16> x;
  std::vector<double> dy, weights;
  std::vector<int32_t> ids;
  ref::Layer<HostBf16> layer;

  ExpertTerms(const ref::Layer<HostBf16>& r, const double* dy_all, int64_t e, const std::vector<int64_t>& slots)
      : x(slots.size() * r.H), dy(slots.size() * r.H), weights(slots.size()), ids(slots.size(), 0) {
    const int64_t H = r.H;
    for (size_t i = 0; i < slots.size(); ++i) {
      const int64_t t = slots[i] / r.k;
      std::copy_n(r.x + t * H, H, x.data() + i * H);
      std::copy_n(dy_all + t * H, H, dy.data() + i * H);
      weights[i] = r.topk_weights[slots[i]];
    }
    layer.T = int64_t(slots.size()), layer.H = H, layer.I = r.I, layer.E = 1, layer.k = 1, layer.I_shared = 0;
    layer.x = x.data();
    layer.topk_ids = ids.data();
    layer.topk_weights = weights.data();
    layer.w_gate = r.w_gate + e * r.I * H;
    layer.w_up = r.w_up + e * r.I * H;
    layer.w_down = r.w_down + e * H * r.I;
  }
  ExpertTerms(const ExpertTerms&) = delete;
  ExpertTerms& operator=(const ExpertTerms&) = delete;
};

// The shared expert's part of y, [T, H].
std::vector<double> shared_forward(const ref::Layer<HostBf16>& r) {
  std::vector<double> y(r.T * r.H, 0.0);
  const int64_t block = std::max<int64_t>(1, (r.T + 4 * thread_count() - 1) / (4 * thread_count()));
  parallel_for((r.T + block - 1) / block, [&](int64_t b) {
    const int64_t t0 = b * block, t1 = std::min(r.T, t0 + block);
    ref::Layer<HostBf16> sub;
    sub.T = t1 - t0, sub.H = r.H, sub.I = 0, sub.E = 0, sub.k = 0, sub.I_shared = r.I_shared;
    sub.x = r.x + t0 * r.H;
    sub.ws_gate = r.ws_gate, sub.ws_up = r.ws_up, sub.ws_down = r.ws_down;
    const std::vector<double> part = ref::forward(sub, 1);  // one thread: the blocks run at once
    std::copy(part.begin(), part.end(), y.begin() + t0 * r.H);
  });
  return y;
}

struct ExpertChunk {
  int64_t e, begin, end;  // slots_by_expert(r)[e][begin, end)
};

// Each expert's slots cut into chunks of at most `rows`, so that one busy expert spreads over threads.
std::vector<ExpertChunk> expert_chunks(const std::vector<std::vector<int64_t>>& slots, int64_t rows) {
  std::vector<ExpertChunk> chunks;
  for (int64_t e = 0; e < int64_t(slots.size()); ++e) {
    const int64_t n = int64_t(slots[e].size());
    for (int64_t b = 0; b < n; b += rows) chunks.push_back({e, b, std::min(n, b + rows)});
  }
  return chunks;
}

// The routed terms into g: dw_* whole, d_topk_weights and its magnitude per slot; each slot's term of
// y and of dx into term_y and term_dx [T·k, H].
void routed_terms(const ref::Layer<HostBf16>& r, const double* dy, ref::Gradients& g, std::vector<double>& term_y,
                  std::vector<double>& term_dx) {
  const int64_t H = r.H, I = r.I;
  const std::vector<std::vector<int64_t>> slots = slots_by_expert(r);
  // NOTES: small chunks where the slots are few: a case of one wide expert and ~100 tokens took ~9 s
  // in 2 chunks of 64 (2026-12-04). Each chunk copies its expert's weights, the cost of about one row.
  const int64_t rows = std::max<int64_t>(4, (r.T * r.k + 4 * thread_count() - 1) / (4 * thread_count()));
  const std::vector<ExpertChunk> chunks = expert_chunks(slots, rows);
  std::vector<std::mutex> expert_lock(r.E);
  term_y.assign(r.T * r.k * H, 0.0);
  term_dx.assign(r.T * r.k * H, 0.0);
  parallel_for(int64_t(chunks.size()), [&](int64_t i) {
    const ExpertChunk& ch = chunks[i];
    const std::vector<int64_t> mine(slots[ch.e].begin() + ch.begin, slots[ch.e].begin() + ch.end);
    const ExpertTerms terms(r, dy, ch.e, mine);
    const std::vector<double> y = ref::forward(terms.layer, 1);  // one thread: the chunks run at once
    const ref::Gradients s = ref::backward(terms.layer, terms.dy.data(), 1);
    for (size_t n = 0; n < mine.size(); ++n) {
      std::copy_n(y.data() + n * H, H, term_y.data() + mine[n] * H);
      std::copy_n(s.dx.data() + n * H, H, term_dx.data() + mine[n] * H);
      g.d_topk_weights[mine[n]] = s.d_topk_weights[n];
      g.d_topk_magnitude[mine[n]] = s.d_topk_magnitude[n];
      g.d_topk_term_rss[mine[n]] = s.d_topk_term_rss[n];
    }
    const std::lock_guard<std::mutex> lock(expert_lock[ch.e]);
    add_into(g.dw_gate.data() + ch.e * I * H, s.dw_gate);
    add_into(g.dw_up.data() + ch.e * I * H, s.dw_up);
    add_into(g.dw_down.data() + ch.e * H * I, s.dw_down);
    for (int q = 0; q < 3; ++q) g.dw_term_square[3 * ch.e + q] += s.dw_term_square[q];
  });
}

double row_norm(const double* v, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += v[i] * v[i];
  return std::sqrt(s);
}

double value(HostBf16 v) { return to_double(v); }
double value(float v) { return v; }

std::string format_error(double e) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1e", e);
  return buf;
}

// Adds the failures of one output: non-finite values, the per-tensor and the per-row bounds (a "row"
// is what tensor_error was given: a token's row of y or dx, one expert's weight gradient).
void judge(CheckReport& report, const std::string& name, const TensorError& err, bool frobenius_applies,
           double row_tolerance = kRowTolerance, double tolerance = kTolerance) {
  report.outputs.push_back({name, err});
  if (err.first_non_finite >= 0) {
    report.failures.push_back(name + "[" + std::to_string(err.first_non_finite) + "] is not finite");
    return;
  }
  if (frobenius_applies && !(err.frobenius < tolerance)) {
    report.failures.push_back(name + ": relative error " + format_error(err.frobenius) + " >= " +
                              format_error(tolerance));
  }
  if (!(err.worst_row < row_tolerance)) {
    report.failures.push_back(name + ": row " + std::to_string(err.worst_row_index) + " relative error " +
                              format_error(err.worst_row) + " >= " + format_error(row_tolerance));
  }
}

template <class T>
std::vector<T> part(const std::vector<T>& v, int64_t begin, int64_t count) {
  return std::vector<T>(v.begin() + begin, v.begin() + begin + count);
}

// NOTES: a d_topk_weights value is one dot product over I of bf16-rounded factors; its error scales
// with the size of its terms, not with its (possibly cancelled) value, so a row's denominator is also
// at least the row's Σ|terms| / √I (the terms' rms size when their signs are random; expect_matches_
// reference explains the per-value bound).
// With `rss` (the FP8 bounds) the denominator is at least 2·rss·‖the row's d_topk_term_rss‖ instead:
// a row whose values are each within rss times their terms' root-sum-square stays within 0.5.
std::vector<double> d_topk_row_scale(const ref::Gradients& g, int64_t T, int64_t k, int64_t I, double rss) {
  std::vector<double> scale(T);
  for (int64_t t = 0; t < T; ++t) {
    scale[t] = rss > 0.0 ? 2.0 * rss * row_norm(g.d_topk_term_rss.data() + t * k, k)
                         : row_norm(g.d_topk_magnitude.data() + t * k, k) / std::sqrt(double(I));
  }
  return scale;
}

// Each expert's root-sum-square of its terms' norms in weight gradient q (0: dw_gate, 1: dw_up, 2:
// dw_down): a lower bound on the expert's denominator (random_case.h, kRowTolerance's notes).
std::vector<double> dw_term_scale(const ref::Gradients& g, int q) {
  std::vector<double> scale(g.dw_term_square.size() / 3);
  for (size_t e = 0; e < scale.size(); ++e) scale[e] = std::sqrt(g.dw_term_square[3 * e + q]);
  return scale;
}

// NOTES: the tensor's error (FP8: against its terms' root-sum-square too, kFp8Bounds' notes) is judged
// only over 32 values or more that are not exact zeros: fewer make no average, whose bound (kTolerance)
// is below what one value's error reaches (kDTopkRowTolerance's notes). With dy on one token the tensor
// is k values (Exactness.DyOnOneToken*: at seed 46102489, 1.1e-2 of their norm off and 6.0e-3 of their
// scale, within the row's and the values' bounds, which still judge them).
void check_d_topk(const Outputs& o, const ref::Gradients& g, const Case& c, CheckReport& report, const Bounds& b) {
  const std::vector<double> row_scale = d_topk_row_scale(g, c.T, c.k, c.I, b.d_topk_rss);
  const double tensor_scale = b.d_topk_rss > 0.0 ? row_norm(g.d_topk_term_rss.data(), c.T * c.k) : 0.0;
  const auto nonzero = std::count_if(g.d_topk_weights.begin(), g.d_topk_weights.end(), [](double v) { return v != 0.0; });
  judge(report, "d_topk_weights", tensor_error(o.d_topk, g.d_topk_weights, c.k, row_scale, tensor_scale),
        nonzero >= 32, b.d_topk_row, b.tensor);
  for (size_t i = 0; i < o.d_topk.size(); ++i) {
    const double bound = b.d_topk_rss > 0.0 ? b.d_topk_rss * g.d_topk_term_rss[i] : b.d_topk_value * g.d_topk_magnitude[i];
    if (!(std::abs(double(o.d_topk[i]) - g.d_topk_weights[i]) <= bound)) {
      report.failures.push_back("d_topk_weights[" + std::to_string(i) + "] = " + std::to_string(o.d_topk[i]) +
                                ", reference " + std::to_string(g.d_topk_weights[i]) + ", bound " +
                                std::to_string(bound) + " (terms' magnitude " + std::to_string(g.d_topk_magnitude[i]) +
                                ", root-sum-square " + std::to_string(g.d_topk_term_rss[i]) + ")");
      return;
    }
  }
}

// The experts that received no row: weight gradients of exact zeros (+0 bits, as check_against_reference).
void check_unused_experts_zero(const Outputs& o, const HostLayer& L, CheckReport& report) {
  const Case& c = L.c;
  std::vector<int64_t> rows(c.E, 0);
  for (int32_t e : L.ids) {
    if (e >= 0) ++rows[e];  // -1: not routed
  }
  for (int64_t e = 0; e < c.E; ++e) {
    if (rows[e] != 0) continue;
    for (int64_t i = 0; i < c.I * c.H; ++i) {
      if (o.dw_gate[e * c.I * c.H + i].bits != 0 || o.dw_up[e * c.I * c.H + i].bits != 0 ||
          o.dw_down[e * c.H * c.I + i].bits != 0) {
        report.failures.push_back("expert " + std::to_string(e) + " received no row but its weight gradient is not 0");
        return;
      }
    }
  }
}

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

bool chance(std::mt19937_64& rng, double p) { return std::uniform_real_distribution<double>(0, 1)(rng) < p; }

int64_t uniform_int(std::mt19937_64& rng, int64_t lo, int64_t hi) {
  return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
}

int64_t log_uniform(std::mt19937_64& rng, int64_t lo, int64_t hi) {
  std::uniform_real_distribution<double> d(std::log(double(lo)), std::log(double(hi) + 1));
  return std::clamp<int64_t>(int64_t(std::exp(d(rng))), lo, hi);
}

// A multiple of 64 up to max: small (64-512), log-uniform (odd multiples such as 2880 included), or a
// width of a released model.
int64_t draw_width(std::mt19937_64& rng, int64_t max) {
  static const int64_t kModelWidths[] = {768, 1024, 1408, 1536, 2048, 2816, 2880, 3584, 4096, 5632};
  switch (uniform_int(rng, 0, 2)) {
    case 0: return 64 * uniform_int(rng, 1, 8);
    case 1: return 64 * log_uniform(rng, 1, max / 64);
    default: {
      std::vector<int64_t> fit;
      for (int64_t w : kModelWidths) if (w <= max) fit.push_back(w);
      return fit[uniform_int(rng, 0, int64_t(fit.size()) - 1)];
    }
  }
}

int64_t draw_experts(std::mt19937_64& rng) {
  return chance(rng, 1.0 / 3) ? int64_t(1) << uniform_int(rng, 0, 8) : log_uniform(rng, 1, 256);
}

// Fits E, k and T under the host bounds: E·I·H ≤ kMaxExpertElements (but for one expert of I·H above
// it: a drawn I and H are kept), the reference's multiply-adds under kMaxReferenceMacs; E and T
// multiples of R.
void fit_sizes(RandomCase& rc, std::mt19937_64& rng) {
  Case& c = rc.c;
  while (rc.R > 1 && rc.R * c.I * c.H > kMaxExpertElements) rc.R /= 2;
  c.E = std::min(c.E, kMaxExpertElements / (c.I * c.H));
  c.E = std::max<int64_t>(rc.R, c.E / rc.R * rc.R);
  c.k = uniform_int(rng, 1, std::min<int64_t>(8, c.E));
  const double per_token = double(c.k) * c.I * c.H + double(c.Is) * c.H;
  const int64_t t_max = std::min<int64_t>(8192, int64_t(kMaxReferenceMacs / per_token));
  c.T = chance(rng, 0.15) ? t_max : log_uniform(rng, 1, t_max);
  c.T = std::max<int64_t>(rc.R, c.T / rc.R * rc.R);
}

const char* routing_name(Routing r) {
  switch (r) {
    case Routing::kUniform: return "uniform";
    case Routing::kSkewed: return "skewed";
    case Routing::kFewExperts: return "few-experts";
    case Routing::kDuplicates: return "duplicates";
  }
  return "?";
}

const char* weights_name(RouterWeights w) {
  switch (w) {
    case RouterWeights::kPositive: return "positive";
    case RouterWeights::kWithZeros: return "with-zeros";
    case RouterWeights::kWithNegatives: return "with-negatives";
  }
  return "?";
}

// k distinct experts of `pool`, uniformly (a partial Fisher-Yates shuffle of pool).
void distinct_from(std::vector<int32_t>& pool, int64_t k, std::mt19937_64& rng, int32_t* out) {
  for (int64_t j = 0; j < k; ++j) {
    std::swap(pool[j], pool[uniform_int(rng, j, int64_t(pool.size()) - 1)]);
    out[j] = pool[j];
  }
}

// k distinct experts, expert e with weight popularity[e] (Efraimidis-Spirakis: the k largest u^(1/w)).
void distinct_weighted(const std::vector<double>& popularity, int64_t k, std::mt19937_64& rng, int32_t* out) {
  std::uniform_real_distribution<double> u(0, 1);
  std::vector<std::pair<double, int32_t>> keys(popularity.size());
  for (size_t e = 0; e < popularity.size(); ++e) keys[e] = {std::log(u(rng) + 1e-300) / popularity[e], int32_t(e)};
  std::partial_sort(keys.begin(), keys.begin() + k, keys.end(), std::greater<>());
  for (int64_t j = 0; j < k; ++j) out[j] = keys[j].second;
}

void route_ids(HostLayer& L, Routing routing, std::mt19937_64& rng) {
  const int64_t T = L.c.T, E = L.c.E, k = L.c.k;
  std::vector<int32_t> all(E);
  for (int64_t e = 0; e < E; ++e) all[e] = int32_t(e);
  std::shuffle(all.begin(), all.end(), rng);
  std::vector<double> popularity(E);
  const double s = std::uniform_real_distribution<double>(1, 2)(rng);
  for (int64_t e = 0; e < E; ++e) popularity[all[e]] = 1.0 / std::pow(double(e + 1), s);
  std::vector<int32_t> few(all.begin(), all.begin() + std::min<int64_t>(E, k + uniform_int(rng, 0, 2)));
  for (int64_t t = 0; t < T; ++t) {
    int32_t* ids = L.ids.data() + t * k;
    switch (routing) {
      case Routing::kUniform: distinct_from(all, k, rng, ids); break;
      case Routing::kSkewed: distinct_weighted(popularity, k, rng, ids); break;
      case Routing::kFewExperts: distinct_from(few, k, rng, ids); break;
      case Routing::kDuplicates: {
        const int64_t pool = std::max<int64_t>(1, k / 2);
        for (int64_t j = 0; j < k; ++j) ids[j] = all[(t * 7 + uniform_int(rng, 0, pool - 1)) % E];
        if (k > 1) ids[1] = ids[0];
        break;
      }
    }
  }
}

void route_weights(HostLayer& L, RouterWeights weights, std::mt19937_64& rng) {
  const int64_t k = L.c.k;
  std::uniform_real_distribution<float> positive(0.05f, 1.0f), signed_(-1.0f, 1.0f);
  for (int64_t t = 0; t < L.c.T; ++t) {
    const bool all_zero = weights == RouterWeights::kWithZeros && chance(rng, 0.1);
    for (int64_t j = 0; j < k; ++j) {
      float& w = L.weights[t * k + j];
      switch (weights) {
        case RouterWeights::kPositive: w = positive(rng); break;
        case RouterWeights::kWithZeros: w = (all_zero || chance(rng, 0.25)) ? 0.0f : positive(rng); break;
        case RouterWeights::kWithNegatives: w = chance(rng, 0.125) ? 0.0f : signed_(rng); break;
      }
    }
  }
}

}  // namespace

std::vector<std::vector<int64_t>> slots_by_expert(const ref::Layer<HostBf16>& r) {
  std::vector<std::vector<int64_t>> slots(r.E);
  for (int64_t s = 0; s < r.T * r.k; ++s) {
    if (r.topk_ids[s] >= 0) slots[r.topk_ids[s]].push_back(s);  // -1: not routed
  }
  return slots;
}

ref::Gradients expert_terms_reference(const ref::Layer<HostBf16>& r, const double* dy, int64_t e,
                                      const std::vector<int64_t>& slots) {
  const ExpertTerms terms(r, dy, e, slots);
  return ref::backward(terms.layer, terms.dy.data(), 1);  // one thread: its callers run experts at once
}

ref::Gradients shared_expert_reference(const ref::Layer<HostBf16>& r, const double* dy) {
  const int64_t H = r.H, Is = r.I_shared;
  // NOTES: each block of tokens keeps its own 3·I_s·H doubles of gradients; at most 8 GiB of them.
  const int64_t budget = std::max<int64_t>(1, (int64_t(8) << 30) / (24 * Is * H));
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>({int64_t(thread_count()), r.T, budget}));
  std::vector<ref::Gradients> part(blocks);
  parallel_for(blocks, [&](int64_t b) {
    const int64_t t0 = r.T * b / blocks, t1 = r.T * (b + 1) / blocks;
    ref::Layer<HostBf16> sub;
    sub.T = t1 - t0, sub.H = H, sub.I = 0, sub.E = 0, sub.k = 0, sub.I_shared = Is;
    sub.x = r.x + t0 * H;
    sub.ws_gate = r.ws_gate, sub.ws_up = r.ws_up, sub.ws_down = r.ws_down;
    part[b] = ref::backward(sub, dy + t0 * H, 1);  // one thread: the blocks run at once
  });
  ref::Gradients g;
  g.dx.reserve(r.T * H);
  g.dws_gate.assign(Is * H, 0.0), g.dws_up.assign(Is * H, 0.0), g.dws_down.assign(H * Is, 0.0);
  for (const ref::Gradients& p : part) {
    g.dx.insert(g.dx.end(), p.dx.begin(), p.dx.end());
    add_into(g.dws_gate.data(), p.dws_gate);
    add_into(g.dws_up.data(), p.dws_up);
    add_into(g.dws_down.data(), p.dws_down);
  }
  return g;
}

// out = shared + Σ_j term[t·k + j] row by row, and scale[t] = the root-sum-square of those terms' norms.
void sum_terms(const std::vector<double>& shared, const std::vector<double>& term, int64_t T, int64_t k, int64_t H,
               std::vector<double>& out, std::vector<double>& scale) {
  out = shared;
  scale.assign(T, 0.0);
  for (int64_t t = 0; t < T; ++t) {
    double* row = out.data() + t * H;
    double sq = std::pow(row_norm(row, H), 2);
    for (int64_t j = 0; j < k; ++j) {
      const double* add = term.data() + (t * k + j) * H;
      for (int64_t h = 0; h < H; ++h) row[h] += add[h];
      sq += std::pow(row_norm(add, H), 2);
    }
    scale[t] = std::sqrt(sq);
  }
}

Reference parallel_reference(const ref::Layer<HostBf16>& r, const std::vector<double>& dy) {
  const int64_t T = r.T, H = r.H, k = r.k;
  Reference out;
  ref::Gradients& g = out.g;
  std::vector<double> shared_y(T * H, 0.0);
  if (r.I_shared > 0) {
    shared_y = shared_forward(r);
    g = shared_expert_reference(r, dy.data());
  } else {
    g.dx.assign(T * H, 0.0);
  }
  g.d_topk_weights.assign(T * k, 0.0);
  g.d_topk_magnitude.assign(T * k, 0.0);
  g.d_topk_term_rss.assign(T * k, 0.0);
  g.dw_gate.assign(r.E * r.I * H, 0.0);
  g.dw_up.assign(r.E * r.I * H, 0.0);
  g.dw_down.assign(r.E * H * r.I, 0.0);
  g.dw_term_square.assign(3 * r.E, 0.0);
  std::vector<double> term_y, term_dx;
  routed_terms(r, dy.data(), g, term_y, term_dx);
  sum_terms(shared_y, term_y, T, k, H, out.y, out.y_term_scale);
  const std::vector<double> shared_dx = g.dx;
  sum_terms(shared_dx, term_dx, T, k, H, g.dx, out.dx_term_scale);
  return out;
}

template <class T>
TensorError tensor_error(const std::vector<T>& got, const std::vector<double>& want, int64_t cols,
                         const std::vector<double>& row_scale, double tensor_scale) {
  TensorError err;
  if (got.size() != want.size()) {  // cannot pass
    err.frobenius = err.worst_row = INFINITY;
    return err;
  }
  const int64_t rows = cols > 0 ? int64_t(want.size()) / cols : 0;
  std::vector<double> num(rows, 0.0), den(rows, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = r * cols; i < (r + 1) * cols; ++i) {
      const double g = value(got[i]);
      if (!std::isfinite(g)) {
        err.first_non_finite = i;
        return err;
      }
      num[r] += (g - want[i]) * (g - want[i]);
      den[r] += want[i] * want[i];
    }
  }
  double num_all = 0, den_all = 0;
  for (int64_t r = 0; r < rows; ++r) num_all += num[r], den_all += den[r];
  const double den_tensor = std::max(std::sqrt(den_all), tensor_scale);
  err.frobenius = den_tensor > 0 ? std::sqrt(num_all) / den_tensor : std::sqrt(num_all);
  // The RMS over the rows whose reference is not zero: the exact-zero rows of experts without rows
  // (or, with dy on a few tokens, without gradient) are not typical rows and would dilute the floor.
  int64_t nonzero_rows = 0;
  for (int64_t r = 0; r < rows; ++r) nonzero_rows += den[r] > 0 ? 1 : 0;
  const double floor = nonzero_rows > 0 ? kRowFloor * std::sqrt(den_all / double(nonzero_rows)) : 0.0;
  for (int64_t r = 0; r < rows; ++r) {
    double d = std::max(std::sqrt(den[r]), floor);
    if (!row_scale.empty()) d = std::max(d, row_scale[r]);
    const double e = d > 0 ? std::sqrt(num[r]) / d : (num[r] == 0 ? 0.0 : INFINITY);
    if (e > err.worst_row || err.worst_row_index < 0) err.worst_row = e, err.worst_row_index = r;
  }
  return err;
}

template TensorError tensor_error<HostBf16>(const std::vector<HostBf16>&, const std::vector<double>&, int64_t,
                                            const std::vector<double>&, double);
template TensorError tensor_error<float>(const std::vector<float>&, const std::vector<double>&, int64_t,
                                         const std::vector<double>&, double);

std::string CheckReport::row_errors() const {
  std::string s;
  for (const Output& o : outputs) {
    if (!s.empty()) s += ' ';
    s += o.name + ' ' + (o.error.first_non_finite >= 0 ? std::string("NaN") : format_error(o.error.worst_row));
  }
  return s;
}

std::string CheckReport::failure_text() const {
  std::string s;
  for (const std::string& f : failures) s += (s.empty() ? "" : "; ") + f;
  return s;
}

CheckReport check_outputs(const Outputs& o, const Reference& want, const HostLayer& L, const Bounds& b) {
  const Case& c = L.c;
  const ref::Gradients& g = want.g;
  CheckReport report;
  judge(report, "y", tensor_error(o.y, want.y, c.H, want.y_term_scale), true, b.row, b.tensor);
  judge(report, "dx", tensor_error(o.dx, g.dx, c.H, want.dx_term_scale), true, b.row, b.tensor);
  check_d_topk(o, g, c, report, b);
  // NOTES: the weight gradients' "rows" are experts (random_case.h says why).
  judge(report, "dw_gate", tensor_error(o.dw_gate, g.dw_gate, c.I * c.H, dw_term_scale(g, 0)), true, b.row, b.tensor);
  judge(report, "dw_up", tensor_error(o.dw_up, g.dw_up, c.I * c.H, dw_term_scale(g, 1)), true, b.row, b.tensor);
  judge(report, "dw_down", tensor_error(o.dw_down, g.dw_down, c.H * c.I, dw_term_scale(g, 2)), true, b.row, b.tensor);
  if (c.Is > 0) check_shared_gradients(o, g, c, report);
  check_unused_experts_zero(o, L, report);
  return report;
}

void check_expert_gradients(const Outputs& o, const ref::Gradients& want, const Case& c, int64_t e,
                            CheckReport& report) {
  const std::string at = "[" + std::to_string(e) + "]";
  const int64_t n = c.I * c.H;
  judge(report, "dw_gate" + at, tensor_error(part(o.dw_gate, e * n, n), want.dw_gate, n, dw_term_scale(want, 0)), true);
  judge(report, "dw_up" + at, tensor_error(part(o.dw_up, e * n, n), want.dw_up, n, dw_term_scale(want, 1)), true);
  judge(report, "dw_down" + at, tensor_error(part(o.dw_down, e * n, n), want.dw_down, n, dw_term_scale(want, 2)),
        true);
}

void check_shared_gradients(const Outputs& o, const ref::Gradients& want, const Case& c, CheckReport& report) {
  const int64_t n = c.Is * c.H;  // one "row": the shared expert is one expert
  judge(report, "dws_gate", tensor_error(o.dws_gate, want.dws_gate, n), true);
  judge(report, "dws_up", tensor_error(o.dws_up, want.dws_up, n), true);
  judge(report, "dws_down", tensor_error(o.dws_down, want.dws_down, n), true);
}

void check_finite(const std::vector<HostBf16>& v, const std::string& name, CheckReport& report) {
  for (size_t i = 0; i < v.size(); ++i) {
    if (!std::isfinite(to_double(v[i]))) {
      report.failures.push_back(name + "[" + std::to_string(i) + "] is not finite");
      return;
    }
  }
}

void upload_routing(HostLayer& L) {
  if (L.c.int64_ids) {
    L.d_ids = to_device(std::vector<int64_t>(L.ids.begin(), L.ids.end()));
  } else {
    L.d_ids = to_device(L.ids);
  }
  L.d_weights = to_device(L.weights);
}

void apply_routing(HostLayer& L, Routing routing, RouterWeights weights, std::mt19937_64& rng) {
  route_ids(L, routing, rng);
  route_weights(L, weights, rng);
  upload_routing(L);
}

RandomCase draw_case(uint64_t seed) {
  std::mt19937_64 rng(seed);
  RandomCase rc;
  rc.seed = seed;
  static const int32_t kRanks[] = {1, 1, 1, 2, 4, 8};  // half the cases on one rank
  rc.R = kRanks[uniform_int(rng, 0, 5)];
  Case& c = rc.c;
  c.H = draw_width(rng, 4096);
  c.I = draw_width(rng, 4096);
  c.Is = chance(rng, 0.5) ? 0 : draw_width(rng, 5632);
  c.E = draw_experts(rng);
  fit_sizes(rc, rng);
  c.int64_ids = chance(rng, 0.2);
  static const Routing kRoutings[] = {Routing::kUniform, Routing::kUniform, Routing::kSkewed,
                                      Routing::kFewExperts, Routing::kDuplicates};
  rc.routing = kRoutings[uniform_int(rng, 0, 4)];
  if (rc.routing == Routing::kDuplicates && c.k == 1) rc.routing = Routing::kFewExperts;
  static const RouterWeights kWeights[] = {RouterWeights::kPositive, RouterWeights::kPositive,
                                           RouterWeights::kWithZeros, RouterWeights::kWithNegatives};
  rc.weights = kWeights[uniform_int(rng, 0, 3)];
  // At R > 1 only the fused backend exists.
  rc.backend = rc.R == 1 && chance(rng, 0.5) ? Backend::kUnfused : Backend::kFused;
  rc.recompute = chance(rng, 0.3);
  c.routing = routing_name(rc.routing);
  return rc;
}

std::string describe(const RandomCase& rc) {
  const Case& c = rc.c;
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "T=%" PRId64 " H=%" PRId64 " I=%" PRId64 " E=%" PRId64 " k=%" PRId64 " Is=%" PRId64
                " routing=%s weights=%s ids=%s backend=%s R=%d context=%s%s",
                c.T, c.H, c.I, c.E, c.k, c.Is, routing_name(rc.routing), weights_name(rc.weights),
                c.int64_ids ? "int64" : "int32", rc.backend == Backend::kUnfused ? "unfused" : "fused", rc.R,
                rc.recompute ? "recomputed" : "saved", rc.fp8 ? " precision=fp8" : "");
  return buf;
}

std::string CaseOutcome::line() const {
  std::string verdict = ok() ? "ok" : "FAIL: " + (error.empty() ? report.failure_text() : "threw: " + error);
  char times[96];
  std::snprintf(times, sizeof times, " | ms: inputs %.0f gpu %.0f reference %.0f", inputs_ms, gpu_ms, reference_ms);
  return "random case seed=" + std::to_string(rc.seed) + " " + describe(rc) + " | worst row: " +
         report.row_errors() + times + " | " + verdict;
}

RandomCase draw_fp8_case(uint64_t seed) {
  RandomCase rc = draw_case(seed);  // its R too: half the cases at 2, 4 or 8 ranks
  rc.backend = Backend::kFused;
  rc.fp8 = true;
  return rc;
}

CaseOutcome run_random_case(uint64_t seed, bool fp8) {
  CaseOutcome out;
  out.rc = fp8 ? draw_fp8_case(seed) : draw_case(seed);
  // LYNX_RANDOM_RANKS=R replays a case at R ranks (a divisor of its T and E), to tell a failure's
  // dependence on the ranks.
  if (const char* ranks = std::getenv("LYNX_RANDOM_RANKS"); ranks != nullptr && *ranks != '\0') {
    out.rc.R = std::atoi(ranks);
  }
  const RandomCase& rc = out.rc;
  using Clock = std::chrono::steady_clock;
  const auto ms_since = [](Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); };
  try {
    auto t = Clock::now();
    HostLayer L(rc.c, seed);
    std::mt19937_64 rng(splitmix64(seed));
    apply_routing(L, rc.routing, rc.weights, rng);
    const std::vector<HostBf16> dy = random_bf16(rng, rc.c.T * rc.c.H, 1.0);
    Config config;
    config.backend = rc.backend;
    config.save_forward_context = !rc.recompute;
    if (rc.fp8) config.precision = Precision::kFp8Block;
    out.inputs_ms = ms_since(t);
    t = Clock::now();
    Outputs o;
    if (rc.R == 1) {
      Workspace ws(L.shape, config);
      test_hooks::poison_row_buffers(ws);
      if (rc.fp8) quantize_weights(ws, L.inputs().weights, nullptr);
      o = run_layer(ws, L, dy, rc.recompute);
      ws.check(nullptr);
    } else {
      o = run_virtual_ranks(L, rc.R, dy, config, rc.recompute);
    }
    out.gpu_ms = ms_since(t);
    t = Clock::now();
    const std::vector<double> w = L.weights_double();
    const Reference want = parallel_reference(L.reference(w), to_double_vec(dy));
    // LYNX_RANDOM_DUMP=DIR writes the case into DIR/<seed>/ (tests/gpu/case_dump.h), to study a failure
    // away from the GPU.
    if (const char* dir = std::getenv("LYNX_RANDOM_DUMP"); dir != nullptr && *dir != '\0') {
      dump_case(dir, seed, describe(rc), L, dy, o, want);
    }
    out.report = check_outputs(o, want, L, rc.fp8 ? kFp8Bounds : Bounds{});
    out.reference_ms = ms_since(t);
  } catch (const std::exception& e) {
    out.error = e.what();
  }
  return out;
}

uint64_t case_seed(uint64_t base, int64_t i) { return splitmix64(base + uint64_t(i)); }

}  // namespace lynx::test
