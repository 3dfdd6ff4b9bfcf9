// The random cases (RandomCases.*) and the exactness tests (Exactness.*): a seeded case generator, a
// threaded fp64 reference built from src/reference, and a check of every output against it with the
// per-tensor bound and a per-row bound.
#pragma once

#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "gpu/layer_check.h"
#include "reference/fp8.h"

namespace lynx::test {

// NOTES: bf16 operands and results (8 significant bits: rounding error at most 2⁻⁸ relative, about
// 1.6e-3 rms, as a bf16 GEMM's output showed: bench/results/2026-12-06-h100-205e984-cublas-k-tail-log.txt) through a
// few chained roundings (x·w → g, u → a → y) leave a row of n ≥ 64 values about 4e-3 off relative to
// its norm, with little spread, since a row averages n values. A wrong row is far above that: one of
// k = 8 equal-weight terms missing or doubled gives ~0.35, another expert's output ~1.4. 3e-2 is ~7
// times the typical error, room for the worst of ~10⁶ rows in a batch. Set from this arithmetic, not
// from measured errors.
inline constexpr double kRowTolerance = 3e-2;
// NOTES: a row's error is taken relative to max(‖want_row‖, kRowFloor × the RMS norm of the tensor's
// rows whose reference is not zero):
// a row whose reference is near zero (router weights that cancel, an expert's weight-gradient row
// whose SwiGLU derivative crosses zero) still carries the absolute rounding error of its terms, and
// would otherwise divide by ~0.
inline constexpr double kRowFloor = 0.1;
// NOTES: a token's d_topk_weights are dot products over I of bf16-rounded factors (da, and silu(g)·u):
// each value's error is ~2^-8 of the root-sum-square of its terms, about 5e-3 of the row scale
// Σ|terms|/√I (d_topk_row_scale) with random signs, and the worst of the ~10^5 values of a batch lies
// some 5 standard deviations out, ~2.5e-2 (measured: 3.2e-2 on 2 rows of 197 cases, 2026-12-04,
// 41b3855). 6e-2 leaves a factor of 2 over that; a wrong value (a term of another row, a missing
// router weight) is off by the order of the value itself.
inline constexpr double kDTopkRowTolerance = 6e-2;
// NOTES: the per-row bound covers the per-token outputs (y, dx; d_topk_weights with its own bound,
// kDTopkRowTolerance, and per value). A weight gradient is checked per expert instead: with few rows on an expert, one row of
// dw_gate is a handful of bf16 products through silu′(g), and near its zero (g ≈ −1.28) the rounding
// of the stored bf16 g moves silu′ by far more than 3e-2 of its value; duplicate ids with router
// weights of opposite signs cancel a row but not its rounding. Both seen on the unfused (cuBLAS) path
// as on the fused one (2026-12-04, 41b3855: 43 of 197 cases over 3e-2 on such rows, at most 0.14).
// An expert's whole gradient averages over its I·H values, so an error confined to one expert is
// still not diluted below the bound. As for y and dx (below), an expert's denominator is also at least
// the root-sum-square of its terms' norms (ref::Gradients::dw_term_square): an expert whose only rows
// are one token's duplicate ids with router weights of opposite signs has a gradient that cancels and
// an error that does not (2026-12-04, b97cbdb: 3 of 745 cases, 3.2-3.7e-2, every one of them
// duplicates with negative weights, on experts of so few rows that the tensor's floor did not cover them).

// NOTES: a row of y or dx is the sum of the shared expert's term and k routed terms, and the GPU rounds
// each term on its own (a bf16 row per term or per factor). Router weights of opposite signs on one
// expert (duplicate ids) cancel the terms but not their rounding, so a row's per-row denominator is
// also at least the root-sum-square of its terms' norms, which is ‖row‖ on average when the terms do
// not cancel (the experts' outputs are uncorrelated).
// The fp64 reference outputs of a whole layer.
struct Reference {
  std::vector<double> y;
  ref::Gradients g;
  std::vector<double> y_term_scale, dx_term_scale;  // [T]: √(Σ ‖term‖²) of each row of y and dx
};

// Every output of layer r for dy, on every hardware thread, from src/reference's entry points: each
// expert's terms as a layer of its own (E = 1, k = 1, its routed rows) and the shared expert over
// blocks of tokens (k = 0), summed. Equal to ref::forward and ref::backward up to the order of
// double-precision sums.
Reference parallel_reference(const ref::Layer<HostBf16>& r, const std::vector<double>& dy);

// The slots t·k + j routed to each expert, in slot order.
std::vector<std::vector<int64_t>> slots_by_expert(const ref::Layer<HostBf16>& r);

// ref::backward of the layer made of expert e's terms `slots` alone (one row each, router weight
// kept): dx and d_topk_weights per term, and expert e's weight gradients over exactly those rows. On
// one thread: its callers compute several experts at once.
ref::Gradients expert_terms_reference(const ref::Layer<HostBf16>& r, const double* dy, int64_t e,
                                      const std::vector<int64_t>& slots);

// The shared expert's part of the backward (dws_*, and dx from the shared expert alone), threaded.
ref::Gradients shared_expert_reference(const ref::Layer<HostBf16>& r, const double* dy);

// The error of `got` [rows, cols] against `want`.
struct TensorError {
  double frobenius = 0;           // ‖got − want‖ / max(‖want‖, tensor_scale) (‖got − want‖ when both are 0)
  double worst_row = 0;           // max over rows of ‖got_r − want_r‖ / max(‖want_r‖, floor, row_scale[r])
  int64_t worst_row_index = -1;
  int64_t first_non_finite = -1;  // -1 when every value is finite
};

// row_scale (empty, or one value per row): a further lower bound on a row's denominator; tensor_scale
// one on the whole tensor's.
template <class T>
TensorError tensor_error(const std::vector<T>& got, const std::vector<double>& want, int64_t cols,
                         const std::vector<double>& row_scale = {}, double tensor_scale = 0.0);

// What check_outputs found: each output's errors, and every bound missed.
struct CheckReport {
  struct Output {
    std::string name;
    TensorError error;
  };
  std::vector<Output> outputs;
  std::vector<std::string> failures;

  bool ok() const { return failures.empty(); }
  // Each output's worst row error, "y 3.1e-03 dx 2.9e-03 ...".
  std::string row_errors() const;
  std::string failure_text() const;
};

// The bounds of check_outputs: the bf16 path's by default.
struct Bounds {
  double tensor = kTolerance;        // relative Frobenius error per tensor
  double row = kRowTolerance;        // per row (an expert's whole weight gradient is one row)
  double d_topk_row = kDTopkRowTolerance;
  double d_topk_value = kTolerance;  // per value, of the magnitude of its terms
  double d_topk_rss = 0.0;  // if not 0: per value, of its terms' root-sum-square instead (d_topk_term_rss)
};

// NOTES: the FP8 path's (Config::precision = kFp8Block): each tensor's relative error is at most
// √(2 × its dissimilarity bound) (tests/gpu/test_fp8_layer.cpp derives those, docs/fp8.md tabulates
// them): 0.109 for dw_gate, the largest, used for every tensor. A d_topk_weights value within 6 RMS
// error scales √2·ε·d_topk_term_rss (ε = 2^-4/√3; reference.h): the sums over H behind it (da, g, u)
// and over I may cancel, so the magnitude of its terms over I does not bound its FP8 error (the first
// batch, 2026-12-05, found values 0.0998 of it off, bound √6·ε = 0.0884); the emulation of the FP8
// backward measures its largest 2.1 and its RMS 0.69 of that scale
// (Fp8Reference.DTopkWeightsErrorsScaleWithTheirTermsRss). Per row (a token's y, dx or d_topk_weights;
// an expert's whole weight gradient) 0.5: a wrong scale, expert or row is off by the order of the value
// itself, while a right row's error, an average over 64 values or more of per-value errors of the
// tensor's size, stays well below (bf16's 3e-2 is 7 times its typical error); d_topk_weights' row
// scale is then the values' bound (d_topk_row_scale). d_topk_weights' error as a whole is taken
// against max(‖d_topk_weights‖, ‖d_topk_term_rss‖): its values' errors scale with their terms'
// root-sum-square, which with few values (T·k = 32) their own norm may fall well below. The emulation
// of the FP8 backward, at T = 4, H = 64, k = 8 with duplicate ids (I = 512, E = 8: 200 draws; I = 2496,
// E = 26: 40 draws), put d_topk_weights' error up to 0.109 and 0.113 of ‖d_topk_weights‖, but at most
// 0.046 of ‖d_topk_term_rss‖ (2026-12-06; Fp8Reference.FewDTopkWeightsErrorsScaleWithTheirTermsRss
// checks 20 such draws); 0.109 is 2.1 times √2·ε·‖d_topk_term_rss‖, the RMS the per-value bound derives.
// Given up: an error in proportion to the values (a wrong scale) where their norm is below 0.109 of their
// terms' rss, which every d_topk_weights check then measures against the rss.
inline const Bounds kFp8Bounds{0.109, 0.5, 0.5, 0.0884, 6.0 * ref::fp8::kQuantisedProductRmsError};

// Every output of layer L (y, dx, d_topk_weights, dw_*, dws_*) against `want`: finite, within
// bounds.tensor per tensor and bounds.row per row; d_topk_weights also per value against the
// magnitude of its terms (as expect_matches_reference); the experts that received no row have weight
// gradients of exact zeros.
CheckReport check_outputs(const Outputs& o, const Reference& want, const HostLayer& L, const Bounds& bounds = {});

// Adds the failures of expert e's weight gradients against `want` (expert_terms_reference) to
// `report`, each named "<name>[e]".
void check_expert_gradients(const Outputs& o, const ref::Gradients& want, const Case& c, int64_t e,
                            CheckReport& report);

// Adds the failures of the shared expert's gradients against `want` (shared_expert_reference).
void check_shared_gradients(const Outputs& o, const ref::Gradients& want, const Case& c, CheckReport& report);

// Adds a failure naming the first non-finite value of `v`, if any.
void check_finite(const std::vector<HostBf16>& v, const std::string& name, CheckReport& report);

enum class Routing {
  kUniform,     // k distinct experts, uniformly
  kSkewed,      // k distinct experts, popularity ∝ 1/rank^s with s in [1, 2]
  kFewExperts,  // every token on a set of k to k + 2 experts
  kDuplicates,  // ids repeat within a token (at least j = 0 and j = 1)
};
enum class RouterWeights {
  kPositive,       // uniform in [0.05, 1)
  kWithZeros,      // a quarter exactly 0, and one token in ten with every weight 0
  kWithNegatives,  // uniform in [-1, 1), one in eight exactly 0
};

// Replaces L's routing (ids and weights, host and device) with one drawn from rng.
void apply_routing(HostLayer& L, Routing routing, RouterWeights weights, std::mt19937_64& rng);

// Copies L's host ids and weights to its device buffers.
void upload_routing(HostLayer& L);

// One random case, a function of its seed alone.
struct RandomCase {
  uint64_t seed = 0;
  Case c;
  Routing routing = Routing::kUniform;
  RouterWeights weights = RouterWeights::kPositive;
  Backend backend = Backend::kFused;
  bool recompute = false;  // context recomputed (save_forward_context off) instead of saved
  int32_t R = 1;           // virtual ranks
  bool fp8 = false;        // Config::precision = kFp8Block (fused)
};

// NOTES: the fp64 reference runs on the CPU. Each case's routed and shared multiply-adds per pass,
// T·k·I·H + T·I_s·H, are held under this (the weight gradients' reference costs as many again), and
// T is drawn last, so big T comes with small H and I and the other way round.
inline constexpr double kMaxReferenceMacs = 1.5e9;
// Expert weight elements E·I·H: bounds the host's random generation and its fp64 gradient arrays.
// NOTES: 2^22: the host's generation (one thread) took most of a case's ~2 s at 2^24, over the time a
// test may take for 200 cases.
inline constexpr int64_t kMaxExpertElements = int64_t(1) << 22;

RandomCase draw_case(uint64_t seed);

// The case of `seed` in FP8: draw_case's shape, routing, context and ranks, on the fused backend.
RandomCase draw_fp8_case(uint64_t seed);

// "T=.. H=.. I=.. E=.. k=.. Is=.. routing=.. weights=.. ids=.. backend=.. R=.. context=..".
std::string describe(const RandomCase& rc);

struct CaseOutcome {
  RandomCase rc;
  CheckReport report;
  std::string error;  // an exception the case threw, "" when none
  // Where the case's time went, ms of wall time: the host's inputs, the GPU calls (workspaces made,
  // forward and backward, results copied back), the reference and the checks.
  double inputs_ms = 0, gpu_ms = 0, reference_ms = 0;
  bool ok() const { return error.empty() && report.ok(); }
  // One line: seed, description, each output's worst row error, the times, the verdict.
  std::string line() const;
};

// Draws, runs (forward and backward on poisoned outputs) and checks case `seed` (in FP8: draw_fp8_case,
// against the exact reference within kFp8Bounds).
CaseOutcome run_random_case(uint64_t seed, bool fp8 = false);

// The seed of case i of a batch drawn from `base` (splitmix64).
uint64_t case_seed(uint64_t base, int64_t i);

}  // namespace lynx::test
