// The FP8 forward of the layer (Config::precision == kFp8Block, runtime/fp8_passes.h) against the CPU
// emulation of its roundings (src/reference/fp8_layer.h) and against the exact layer; its backward (FP8
// dgrad GEMMs on the FP8 g and u, bf16 weight gradients) against the exact layer; the context of forward
// and of recompute alike; determinism; the same bits at R virtual ranks; the errors: weights not
// quantised, a NaN in x, dy or the weights.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

#include "experiments/test_hooks.h"
#include "gpu/gpu_test.h"
#include "gpu/layer_check.h"
#include "gpu/ranks_check.h"
#include "lynx/error.h"
#include "reference/fp8.h"
#include "reference/fp8_layer.h"

namespace lynx::test {
namespace {

class Fp8Layer : public GpuTest {};

Config fp8_config() {
  Config c;
  c.precision = Precision::kFp8Block;
  return c;
}

std::vector<float> to_float(const std::vector<HostBf16>& v) {
  std::vector<float> f(v.size());
  for (size_t i = 0; i < v.size(); ++i) f[i] = bf16_to_float(v[i]);
  return f;
}

// y as the FP8 forward computes it: the routed part emulated (reference/fp8_layer.h), the shared
// expert's (bf16) from the reference with no slot routed.
// y as the emulation makes it, and for each slot whether its h lies near a scale boundary
// (ref::fp8::RoutedLayer::near_scale_boundary).
struct Emulated {
  std::vector<double> y;
  std::vector<uint8_t> near_scale_boundary;
};

Emulated emulated_y(const HostLayer& L) {
  const Case& c = L.c;
  const std::vector<double> w = L.weights_double();
  const std::vector<float> x = to_float(L.x), wg = to_float(L.w_gate), wu = to_float(L.w_up), wd = to_float(L.w_down);
  ref::fp8::RoutedLayer r;
  r.T = c.T, r.H = c.H, r.I = c.I, r.E = c.E, r.k = c.k;
  r.x = x.data();
  r.topk_ids = L.ids.data();
  r.topk_weights = w.data();
  r.w_gate = wg.data();
  r.w_up = wu.data();
  r.w_down = wd.data();
  std::vector<uint8_t> near(L.ids.size(), 0);
  r.near_scale_boundary = near.data();
  std::vector<double> y = ref::fp8::routed_forward(r);
  if (c.Is > 0) {
    const std::vector<int32_t> none(L.ids.size(), -1);
    ref::Layer<HostBf16> shared = L.reference(w);
    shared.topk_ids = none.data();
    const std::vector<double> ys = ref::forward(shared);
    for (size_t i = 0; i < y.size(); ++i) y[i] += ys[i];
  }
  return {std::move(y), std::move(near)};
}

// NOTES: the bounds (estimates, not proofs). Against the emulation, y differs by the GPU's fp32 and tensor-core sums (about
// 1e-3 of each product, Fp8Gemm's bound) and where those tip h's bf16 rounding, after which h's E4M3
// rounding may move an element by one E4M3 step (2^-3 of it): a few per mille of h's elements, a few
// 1e-3 of y's norm; 1e-2, the layer's bf16 tolerance, holds that with room, where a wrong scale, row,
// expert or block is off by order one. Where h's tile has its amax at a scale boundary, the GPU's sums
// may tip the tile's scale itself (twice or half the emulation's), and all of its elements move by E4M3
// steps, so tokens with such a slot are left out of the comparison with the emulation (the exact
// layer's bound still covers them). Even one element of h moved by one E4M3 step (up to 1/8 of it)
// moves its token's y by up to a few 1e-2 where I · k is 64: the bounds hold for the whole comparison
// only over enough tokens. At T = 5, I = 64, k = 1 one such token made y 1.85e-2 from the emulation and
// dw_gate's dissimilarity 5.91e-3 (an H200, 2026-12-05, seed 3506817434); at T = 96, k = 1 y stayed
// within 8.5e-3 of it (an H100, the same day). So the case of experts without rows takes 96 tokens,
// k = 4 over 128 experts: a token's y sums four slots' products, each tip moves it half as much, and
// experts still have one row, a few or none. Against the exact layer: each quantised operand has an
// RMS relative error of at most ε = 2^-4/√3 (docs/fp8.md), and a dot product with random signs brings
// it into its result: g and u take x's and their weights' (2ε² each), h = silu(g)·u both of them and its
// own (5ε²), y that and w_down's (6ε²); the dissimilarity, half of y's squared relative error, 3ε² =
// 2^-8 ≈ 3.9e-3. silu amplifies g's error where g < 0 (by 1.3 on average at these tests' g, which
// makes it 3.3ε²), while E4M3's actual RMS error is 0.5-0.6 of ε: the CPU emulation measures 0.67 of
// the bound (Fp8Reference.LayerForwardIsCloseToTheExactLayer). The backward: da takes dy's and
// w_downᵀ's (2ε²); dg = da·u·silu′(g) da's, u's and g's (6ε²), du = da·silu(g) 4ε², h 4ε²; so
// d_topk_weights = ⟨da, h⟩ bears 6ε², within 2^-8 too; dx_row = [dg | du] · [w_gate; w_up] adds the
// quantisation of dg | du and of the weights (8ε²): a dissimilarity of at most 4ε² = 2^-6/3 ≈ 5.2e-3.
// The weight gradients read the token rows as they travelled, x̂ and dŷ (one ε² each), and in FP8 the
// quantisation of both operands along the rows (2ε²): dw_gate's dg 6ε² + 3ε² = 9ε² (3·2^-9 ≈ 5.9e-3),
// dw_up's du and dw_down's h 4ε² + 3ε² = 7ε² (7·2^-9/3 ≈ 4.6e-3); with bf16 weight gradients 2ε² less.
// The shared expert's gradients are bf16 throughout (the layer's 1e-2).
constexpr double kMaxDissimilarity = 1.0 / 256.0;
constexpr double kMaxDxDissimilarity = 1.0 / 192.0;
constexpr double kMaxDwGateDissimilarity = 3.0 / 512.0;
constexpr double kMaxDwDissimilarity = 7.0 / 1536.0;

template <class T>
double dissimilarity_of(const std::vector<T>& got, const std::vector<double>& want, const char* what) {
  std::vector<double> g(got.size());
  for (size_t i = 0; i < got.size(); ++i) {
    if constexpr (std::is_same_v<T, HostBf16>) {
      g[i] = to_double(got[i]);
    } else {
      g[i] = got[i];
    }
    if (!std::isfinite(g[i])) {
      ADD_FAILURE() << what << "[" << i << "] is not finite (" << g[i] << "): not written or NaN";
      return INFINITY;
    }
  }
  EXPECT_EQ(g.size(), want.size()) << what;
  return ref::fp8::dissimilarity(g, want);
}

// NOTES: each d_topk_weights value is one dot product ⟨da, h⟩ over I, and da, g and u are themselves
// sums over H that may cancel, so a term's FP8 error does not scale with that term: the magnitude of
// the terms does not bound the value's error (√6·ε of it was crossed, 0.0958, at T=130 H=256 I=128
// E=8 k=4, seed 3131583568, on an H100: d_topk_weights[323] -119.912 against -102.950; the CPU
// emulation of the FP8 backward gives -119.935 for it, so the recipe's roundings, not a kernel). Every
// value within 6 RMS error scales of its terms, √2·ε·d_topk_term_rss (the random cases' bound,
// random_case.h: that value is 3.4 of them), and the dissimilarity where there are 32 values or more.
const double kDTopkTermRssTolerance = 6.0 * ref::fp8::kQuantisedProductRmsError;

// Every gradient against the exact layer's.
void expect_gradients_close(const Outputs& o, const HostLayer& L, const std::vector<HostBf16>& dy) {
  const ref::Gradients g = ref::backward(L.reference(L.weights_double()), to_double_vec(dy).data());
  EXPECT_LT(dissimilarity_of(o.dx, g.dx, "dx"), kMaxDxDissimilarity);
  expect_d_topk_values_near(o.d_topk, g, g.d_topk_term_rss, kDTopkTermRssTolerance);
  if (::testing::Test::HasFatalFailure()) return;
  if (o.d_topk.size() >= 32) {
    EXPECT_LT(dissimilarity_of(o.d_topk, g.d_topk_weights, "d_topk_weights"), kMaxDissimilarity);
  }
  EXPECT_LT(dissimilarity_of(o.dw_gate, g.dw_gate, "dw_gate"), kMaxDwGateDissimilarity);
  EXPECT_LT(dissimilarity_of(o.dw_up, g.dw_up, "dw_up"), kMaxDwDissimilarity);
  EXPECT_LT(dissimilarity_of(o.dw_down, g.dw_down, "dw_down"), kMaxDwDissimilarity);
  if (L.c.Is > 0) {
    EXPECT_LT(rel_error(o.dws_gate, g.dws_gate, "dws_gate"), kTolerance);
    EXPECT_LT(rel_error(o.dws_up, g.dws_up, "dws_up"), kTolerance);
    EXPECT_LT(rel_error(o.dws_down, g.dws_down, "dws_down"), kTolerance);
  }
}

void expect_fp8_layer_matches(const Case& c, bool bf16_weight_grads = false, int64_t capacity = 0) {
  const auto seed = fresh_seed();
  SCOPED_TRACE(case_name(c) + " seed " + std::to_string(seed));
  const HostLayer L(c, seed);
  std::mt19937_64 rng(seed ^ 0x5eed);
  const std::vector<HostBf16> dy = random_bf16(rng, c.T * c.H, 1.0);
  Config config = fp8_config();
  config.bf16_weight_grads = bf16_weight_grads;
  if (capacity > 0) config.schedule_capacity = capacity;
  Workspace ws(L.shape, config);
  // A row no kernel wrote (a padding row of a 128-row block the quantisations read) cannot pass.
  test_hooks::poison_row_buffers(ws);
  quantize_weights(ws, L.inputs().weights, nullptr);
  const Outputs o = run_layer(ws, L, dy);
  ws.check(nullptr);
  // The context recomputed gives the same bits as the forward's.
  const Outputs again = run_layer(ws, L, dy, true);
  EXPECT_EQ(first_difference(o, again), "") << "differs with the context recomputed";
  const Emulated em = emulated_y(L);
  std::vector<HostBf16> got;
  std::vector<double> want;
  int64_t left_out = 0;
  for (int64_t t = 0; t < c.T; ++t) {
    bool near = false;
    for (int64_t j = 0; j < c.k; ++j) near = near || em.near_scale_boundary[size_t(t * c.k + j)] != 0;
    if (near) {
      ++left_out;
      continue;
    }
    got.insert(got.end(), o.y.begin() + t * c.H, o.y.begin() + (t + 1) * c.H);
    want.insert(want.end(), em.y.begin() + t * c.H, em.y.begin() + (t + 1) * c.H);
  }
  EXPECT_LT(left_out, c.T) << "every token's h at a scale boundary: nothing compared with the emulation";
  const double err = rel_error(got, want, "y");
  EXPECT_LT(err, kTolerance);
  std::vector<double> y(o.y.size());
  for (size_t i = 0; i < y.size(); ++i) y[i] = to_double(o.y[i]);
  const double dis = ref::fp8::dissimilarity(y, ref::forward(L.reference(L.weights_double())));
  EXPECT_LT(dis, kMaxDissimilarity);
  std::printf("  fp8 y: %.2e from the emulation (%lld of %lld tokens at an h scale boundary left out), "
              "dissimilarity %.2e from the exact layer (%s)\n",
              err, static_cast<long long>(left_out), static_cast<long long>(c.T), dis, case_name(c).c_str());
  expect_gradients_close(o, L, dy);
}

TEST_F(Fp8Layer, ForwardMatchesEmulation) {
  expect_fp8_layer_matches({300, 256, 128, 8, 2, 0});
  expect_fp8_layer_matches({257, 320, 192, 16, 4, 128});  // H and I past a multiple of 128, a shared expert
  expect_fp8_layer_matches({96, 128, 64, 128, 4, 0});    // experts of a few rows or none, a K of half a block
  Case cyclic{200, 448, 128, 8, 2, 0, "cyclic"};  // H of three and a half blocks
  expect_fp8_layer_matches(cyclic);
  Case unrouted{130, 256, 128, 8, 4, 0};
  unrouted.unrouted_every = 3;
  expect_fp8_layer_matches(unrouted);
}

// The recipe's option: the weight gradients in bf16 (within the same bounds).
TEST_F(Fp8Layer, Bf16WeightGradients) { expect_fp8_layer_matches({257, 320, 192, 16, 4, 128}, true); }

// A schedule of fewer rows than tokens, which holds every routed slot where half are not routed (two
// experts, ~150 rows each: two blocks): one rank's x̂ and dŷ rows then come from the gathered tiles, the
// scratch of capacity rows being too small for T token rows.
TEST_F(Fp8Layer, Bf16WeightGradientsWithFewerRowsThanTokens) {
  Case c{600, 256, 128, 2, 1, 0};
  c.unrouted_every = 2;
  expect_fp8_layer_matches(c, true, 512);
}

// FP8 at R virtual ranks (the R·T tokens cut into R) gives FP8 at R = 1's bits: a row's tiles are the
// row's wherever it is quantised, its products are its own, and each expert's weight-gradient K blocks
// hold the same rows in the same order (docs/expert-parallel.md). R = 1 itself against the exact layer,
// so that equal bits are right bits; the shared expert's per-rank gradients sum to R = 1's.
void expect_fp8_every_r(const Case& c, const std::vector<int32_t>& Rs, const Config& config, bool recompute) {
  const auto seed = fresh_seed();
  SCOPED_TRACE(case_name(c) + " seed " + std::to_string(seed));
  const HostLayer L(c, seed);
  const std::vector<HostBf16> dy = random_dy(c);
  Workspace one(L.shape, config);
  test_hooks::poison_row_buffers(one);  // as every rank's (VirtualGroup)
  quantize_weights(one, L.inputs().weights, nullptr);
  const Outputs want = run_layer(one, L, dy, recompute);
  one.check(nullptr);
  EXPECT_LT(dissimilarity_of(want.y, ref::forward(L.reference(L.weights_double())), "y"), kMaxDissimilarity);
  expect_gradients_close(want, L, dy);
  if (::testing::Test::HasFailure()) return;
  expect_every_r_gives(want, L, Rs, dy, config, recompute);
}

TEST_F(Fp8Layer, BitwiseEqualAtEveryR) { expect_fp8_every_r({512, 256, 256, 16, 4, 128}, {2, 4, 8}, fp8_config(), false); }

// gate/up's x tiles gathered inside its GEMM (the plan's choice where the bf16 layer gathers there; forced
// here, as the small shapes gather token-major) give the bits of the tiles gathered by a kernel before
// it, at one rank (there dy's tiles too, inside the da GEMM: DyGatherInTheDaGemmGivesTheKernelsBits)
// and at R ranks (each row pulled from its source rank's staged tiles); with the copies held to a
// lookahead of 2 row blocks (the throttle), and with rows of 2176 bytes (more than one round of loads a
// lane).
TEST_F(Fp8Layer, GateUpGatherInTheGemmGivesTheKernelsBits) {
  const auto gather_in_gemm = [](int32_t in_gemm, int32_t lookahead = 0) {
    return [in_gemm, lookahead](Workspace& ws) {
      test_hooks::set_gather_token_major(ws, 0);
      test_hooks::set_gemm_gather(ws, in_gemm);
      test_hooks::set_gather_lookahead(ws, lookahead);
    };
  };
  for (const Case& c : {Case{384, 256, 192, 12, 4, 0}, Case{128, 2176, 128, 4, 2, 0}}) {
    SCOPED_TRACE(case_name(c));
    const HostLayer L(c, fresh_seed());
    const std::vector<HostBf16> dy = random_dy(c);
    const Outputs kernel = run_virtual_ranks(L, 1, dy, fp8_config(), false, gather_in_gemm(0));
    for (const int32_t R : {1, 2, 3}) {
      if (c.E % R != 0) continue;
      SCOPED_TRACE("R = " + std::to_string(R));
      EXPECT_EQ(first_difference(kernel, run_virtual_ranks(L, R, dy, fp8_config(), false, gather_in_gemm(1))), "");
    }
    EXPECT_EQ(first_difference(kernel, run_virtual_ranks(L, 2, dy, fp8_config(), false, gather_in_gemm(1, 1))), "")
        << "lookahead 1 (2 E4M3 row blocks)";
  }
}

// One rank's dy tiles gathered inside the da GEMM (fp8_backward.cpp: where the plan puts da's gather in
// the GEMM, as the bf16 layer's; forced here, as the small shapes gather token-major) give every output
// the bits of the tiles gathered by a kernel before it: with FP8 and with bf16 weight gradients (which
// read dŷ from the token tiles), experts without rows, slots not routed, a shared expert, H past a
// multiple of 128, rows of 2176 bytes (more than one round of loads a lane), and with the context
// recomputed and the copies held to a lookahead of 2 row blocks (the throttle); the row buffers
// poisoned first, the gather's counters at rest after.
TEST_F(Fp8Layer, DyGatherInTheDaGemmGivesTheKernelsBits) {
  const auto run = [](const HostLayer& L, const std::vector<HostBf16>& dy, const Config& config, int32_t in_gemm,
                      int32_t lookahead, bool recompute) {
    Workspace ws(L.shape, config);
    test_hooks::poison_row_buffers(ws);
    test_hooks::set_gather_token_major(ws, 0);
    test_hooks::set_gemm_gather(ws, in_gemm);
    test_hooks::set_gather_lookahead(ws, lookahead);
    EXPECT_EQ(ws.impl().plan.da_gather == plan::GatherPlace::kInGemm, in_gemm == 1) << "the plan's place for da";
    quantize_weights(ws, L.inputs().weights, nullptr);
    const Outputs o = run_layer(ws, L, dy, recompute);
    ws.check(nullptr);
    EXPECT_EQ(test_hooks::counters_not_at_rest(ws), "");
    return o;
  };
  Case unrouted{130, 256, 128, 8, 4, 0};
  unrouted.unrouted_every = 3;
  const Case cases[] = {Case{96, 128, 64, 128, 4, 0}, Case{257, 320, 192, 16, 4, 128}, unrouted,
                        Case{128, 2176, 128, 4, 2, 0}};
  for (const Case& c : cases) {
    for (const bool bf16_weight_grads : {false, true}) {
      const auto seed = fresh_seed();
      SCOPED_TRACE(case_name(c) + " seed " + std::to_string(seed) +
                   (bf16_weight_grads ? ", bf16 weight gradients" : ""));
      const HostLayer L(c, seed);
      const std::vector<HostBf16> dy = random_dy(c);
      Config config = fp8_config();
      config.bf16_weight_grads = bf16_weight_grads;
      const Outputs kernel = run(L, dy, config, 0, 0, false);
      EXPECT_EQ(first_difference(kernel, run(L, dy, config, 1, 0, false)), "");
      EXPECT_EQ(first_difference(kernel, run(L, dy, config, 1, 1, true)), "")
          << "context recomputed, lookahead 1 (2 E4M3 row blocks)";
    }
  }
}

// The grouped GEMMs' tiles in pairs of an expert's row blocks (every FP8 grouped launch of the forward
// and backward) give the plain order's bits, at one rank with gate/up's rows gathered in the GEMM and
// at two ranks (rows pulled from the other rank).
TEST_F(Fp8Layer, PairedRowBlocksGiveThePlainOrdersBits) {
  const auto order = [](int32_t paired) {
    return [paired](Workspace& ws) {
      test_hooks::set_gather_token_major(ws, 0);
      test_hooks::set_gemm_gather(ws, 1);
      test_hooks::set_fp8_pair_rows(ws, paired);
    };
  };
  // 128 rows an expert on average (about half of the experts span two row blocks, whose tiles share
  // B); H and I of 512, so that every launch has an even count of column tiles (gate/up 4 of 128, the
  // others 2 of 256).
  const Case c{512, 512, 512, 16, 4, 0};
  const HostLayer L(c, fresh_seed());
  const std::vector<HostBf16> dy = random_dy(c);
  const Outputs plain = run_virtual_ranks(L, 1, dy, fp8_config(), false, order(0));
  for (const int32_t R : {1, 2}) {
    SCOPED_TRACE("R = " + std::to_string(R));
    EXPECT_EQ(first_difference(plain, run_virtual_ranks(L, R, dy, fp8_config(), false, order(1))), "");
  }
}

// An expert's last row block of at most 64 rows (a half block) in wide tiles (every FP8 grouped launch
// of the forward and backward) gives the plain tiles' bits, the row buffers poisoned first (the rows of
// a half block past 64 are written by neither GEMM): at one rank with gate/up's rows gathered in the
// GEMM, with the context recomputed, with bf16 weight gradients, and at two ranks (rows pulled from the
// other rank). 1440 rows an expert on average, most ending in a half block, several tiles a CTA; I of 384
// (gate/up 3 column tiles of 128: a wide tile of one part, and tiles after it; da 2 of 256), H of 640 (down
// and dx 3 of 256).
TEST_F(Fp8Layer, WideTilesGiveThePlainTilesBits) {
  const auto tiles = [](int32_t wide) {
    return [wide](Workspace& ws) {
      test_hooks::poison_row_buffers(ws);
      test_hooks::set_gather_token_major(ws, 0);
      test_hooks::set_gemm_gather(ws, 1);
      test_hooks::set_fp8_pair_rows(ws, 0);
      test_hooks::set_fp8_wide_tiles(ws, wide);
      EXPECT_EQ(ws.impl().plan.fp8_wide_tiles, wide == 1);
    };
  };
  const Case c{2880, 640, 384, 8, 4, 0};
  const HostLayer L(c, fresh_seed());
  const std::vector<HostBf16> dy = random_dy(c);
  Config bf16_grads = fp8_config();
  bf16_grads.bf16_weight_grads = true;
  for (const bool recompute : {false, true}) {
    SCOPED_TRACE(recompute ? "context recomputed" : "context kept");
    const Outputs plain = run_virtual_ranks(L, 1, dy, fp8_config(), recompute, tiles(0));
    for (const int32_t R : {1, 2}) {
      SCOPED_TRACE("R = " + std::to_string(R));
      EXPECT_EQ(first_difference(plain, run_virtual_ranks(L, R, dy, fp8_config(), recompute, tiles(1))), "");
    }
  }
  EXPECT_EQ(first_difference(run_virtual_ranks(L, 1, dy, bf16_grads, false, tiles(0)),
                             run_virtual_ranks(L, 1, dy, bf16_grads, false, tiles(1))),
            "")
      << "bf16 weight gradients";
}

// Three ranks, H and I past a multiple of 128, the context recomputed, bf16 weight gradients.
TEST_F(Fp8Layer, BitwiseEqualAtThreeRanksRecomputed) {
  Config config = fp8_config();
  config.save_forward_context = false;
  config.bf16_weight_grads = true;
  expect_fp8_every_r({300, 192, 192, 60, 6, 64}, {3}, config, true);
}

// At R ranks a NaN in one rank's x, or an infinity in one rank's w_gate (found by that rank's
// quantize_weights), is reported by every rank, and none writes y. The x case: token 5 of rank 1 (64
// tokens a rank) routed to experts 0 (rank 0's) and 2 (rank 1's): rank 1 finds it when it stages its
// tiles, rank 0 when it pulls the tile, both naming rank 1; ranks 2 and 3 report a peer's error. The
// w_gate case: rank 2 names itself, every other rank reports rank 2.
TEST_F(Fp8Layer, NonFiniteOnOneRankIsReportedByEvery) {
  const Case c{256, 256, 128, 8, 2, 0};
  constexpr int32_t R = 4;
  const auto holds = [](const char* tensor, int32_t rank) {
    return std::string(tensor) + " holds a NaN or an infinity, which the FP8 path cannot quantise (rank " +
           std::to_string(rank) + ")";
  };
  const auto peer = [](int32_t rank) {
    return "rank " + std::to_string(rank) + " reported an error in this pass (a NaN or an infinity in an FP8 operand";
  };
  for (const bool weight : {false, true}) {
    SCOPED_TRACE(weight ? "infinity in rank 2's w_gate" : "NaN in rank 1's x");
    HostLayer L(c, fresh_seed());
    std::vector<std::string> want(R);
    if (weight) {  // expert 5, rank 2's second
      std::vector<HostBf16> wg = L.w_gate;
      wg[size_t(5 * c.I * c.H + 77)] = float_to_bf16(INFINITY);
      upload(L.d_wg.get(), wg.data(), wg.size() * 2);
      want = {peer(2), peer(2), holds("weights.w_gate", 2), peer(2)};
    } else {
      const int64_t t = 64 + 5;
      std::vector<HostBf16> x = L.x;
      x[size_t(t * c.H + 31)] = float_to_bf16(std::nanf(""));
      upload(L.d_x.get(), x.data(), x.size() * 2);
      L.ids[size_t(t * c.k)] = 0;  // the ranks' slices take their ids from the host copy (RankSlice)
      L.ids[size_t(t * c.k + 1)] = 2;
      want = {holds("x", 1), holds("x", 1), "reported an error in this pass (a NaN or an infinity in an FP8 operand",
              "reported an error in this pass (a NaN or an infinity in an FP8 operand"};
    }
    VirtualGroup g(L, R, random_dy(c), fp8_config());
    expect_forward_reported(g, L, want);
  }
}

void expect_check_names(Workspace& ws, const std::string& name) {
  try {
    ws.check(nullptr);
    ADD_FAILURE() << "check() reported nothing; expected " << name;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
  }
}

// Pre-quantised weights (set_quantized_weights): L's weights quantised on the host by the reference
// (lynx's recipe, the GPU's bit for bit) and given as e4m3 tensors with their scales give quantize_weights'
// y bit for bit, and every output where I % 128 == 0 (each transposed block then one given block's
// values; and at 2 virtual ranks, each given its share); elsewhere the gradients stay within the bounds.
// Errors: e4m3 weights on a bf16 workspace, other
// e4m3 tensors than those given, scales of the wrong shape.
void expect_prequantized_like_quantize_weights(const Case& c) {
  const auto seed = fresh_seed();
  SCOPED_TRACE(case_name(c) + " seed " + std::to_string(seed));
  const HostLayer L(c, seed);
  const std::vector<HostBf16> dy = random_dy(c);
  Workspace by_lynx(L.shape, fp8_config());
  quantize_weights(by_lynx, L.inputs().weights, nullptr);
  const Outputs want = run_layer(by_lynx, L, dy);
  by_lynx.check(nullptr);
  // Each expert's matrix quantised in 128×128 blocks: e4m3 [E, rows, cols], scales [E, rows/128↑, cols/128↑].
  struct Blocks {
    DeviceBuffer q, scales;
  };
  const auto quantise = [&](const std::vector<HostBf16>& w, int64_t rows, int64_t cols) {
    std::vector<uint8_t> q;
    std::vector<float> scales;
    for (int64_t e = 0; e < c.E; ++e) {
      std::vector<float> m(size_t(rows * cols));
      for (int64_t i = 0; i < rows * cols; ++i) m[size_t(i)] = bf16_to_float(w[size_t(e * rows * cols + i)]);
      const ref::fp8::Quantized b = ref::fp8::quantize_blocks(m.data(), rows, cols);
      q.insert(q.end(), b.q.begin(), b.q.end());
      scales.insert(scales.end(), b.scales.begin(), b.scales.end());
    }
    return Blocks{to_device(q), to_device(scales)};
  };
  const Blocks gate = quantise(L.w_gate, c.I, c.H), up = quantise(L.w_up, c.I, c.H), down = quantise(L.w_down, c.H, c.I);
  const int64_t kbH = (c.H + 127) / 128, kbI = (c.I + 127) / 128;
  Fp8ExpertWeights f;
  f.w_gate = make_view(gate.q.get(), DType::kE4M3, {c.E, c.I, c.H});
  f.w_up = make_view(up.q.get(), DType::kE4M3, {c.E, c.I, c.H});
  f.w_down = make_view(down.q.get(), DType::kE4M3, {c.E, c.H, c.I});
  f.w_gate_scales = make_view(gate.scales.get(), DType::kF32, {c.E, kbI, kbH});
  f.w_up_scales = make_view(up.scales.get(), DType::kF32, {c.E, kbI, kbH});
  f.w_down_scales = make_view(down.scales.get(), DType::kF32, {c.E, kbH, kbI});
  LayerInputs in = L.inputs();
  in.weights.w_gate = f.w_gate;
  in.weights.w_up = f.w_up;
  in.weights.w_down = f.w_down;
  Workspace given(L.shape, fp8_config());
  EXPECT_THROW(forward(given, in, OutputBuffers(c).y_view(), nullptr), Error);  // nothing given yet
  set_quantized_weights(given, f, nullptr);
  const Outputs got = run_layer(given, L, in, dy);
  given.check(nullptr);
  Outputs got_y, want_y;
  got_y.y = got.y;
  want_y.y = want.y;
  EXPECT_EQ(first_difference(got_y, want_y), "") << "y differs from quantize_weights'";
  if (c.I % 128 == 0) {
    EXPECT_EQ(first_difference(got, want), "") << "differs from quantize_weights'";
    // At 2 virtual ranks, each given its experts' share of the same tensors: the same routed bits.
    VirtualGroup g(L, 2, dy, fp8_config());
    const int64_t E_loc = c.E / 2;
    const auto share = [&](const DeviceBuffer& b, int64_t r, int64_t bytes) {
      return static_cast<char*>(b.get()) + r * bytes;
    };
    for (int64_t r = 0; r < 2; ++r) {
      Fp8ExpertWeights mine;
      mine.w_gate = make_view(share(gate.q, r, E_loc * c.I * c.H), DType::kE4M3, {E_loc, c.I, c.H});
      mine.w_up = make_view(share(up.q, r, E_loc * c.I * c.H), DType::kE4M3, {E_loc, c.I, c.H});
      mine.w_down = make_view(share(down.q, r, E_loc * c.H * c.I), DType::kE4M3, {E_loc, c.H, c.I});
      mine.w_gate_scales = make_view(share(gate.scales, r, 4 * E_loc * kbI * kbH), DType::kF32, {E_loc, kbI, kbH});
      mine.w_up_scales = make_view(share(up.scales, r, 4 * E_loc * kbI * kbH), DType::kF32, {E_loc, kbI, kbH});
      mine.w_down_scales = make_view(share(down.scales, r, 4 * E_loc * kbH * kbI), DType::kF32, {E_loc, kbH, kbI});
      set_quantized_weights(*g.ws[size_t(r)], mine, nullptr);
      g.in[size_t(r)].weights.w_gate = mine.w_gate;
      g.in[size_t(r)].weights.w_up = mine.w_up;
      g.in[size_t(r)].weights.w_down = mine.w_down;
    }
    g.forward(nullptr);
    g.backward(nullptr);
    g.check(nullptr);
    EXPECT_EQ(first_routed_difference(gather_outputs(L, g.global, g.slices), want), "") << "2 ranks differ";
  } else {
    expect_gradients_close(got, L, dy);
  }
  // Errors, each named.
  Workspace bf16(L.shape, Config{});
  EXPECT_THROW(set_quantized_weights(bf16, f, nullptr), Error);
  try {
    forward(bf16, in, OutputBuffers(c).y_view(), nullptr);
    ADD_FAILURE() << "a bf16 workspace took e4m3 weights";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("e4m3"), std::string::npos) << e.what();
  }
  const Blocks other = quantise(L.w_gate, c.I, c.H);
  LayerInputs moved = in;
  moved.weights.w_gate = make_view(other.q.get(), DType::kE4M3, {c.E, c.I, c.H});
  try {
    forward(given, moved, OutputBuffers(c).y_view(), nullptr);
    ADD_FAILURE() << "other e4m3 tensors were taken";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("set_quantized_weights"), std::string::npos) << e.what();
  }
  Fp8ExpertWeights bad = f;
  bad.w_up_scales = make_view(up.scales.get(), DType::kF32, {c.E, kbH, kbI + 1});
  try {
    set_quantized_weights(given, bad, nullptr);
    ADD_FAILURE() << "scales of the wrong shape were taken";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "w_up_scales") << e.what();
  }
  // A NaN code (0x7F) in w_up: reported by set_quantized_weights, naming w_up.
  std::vector<uint8_t> nan_up = to_host<uint8_t>(up.q, size_t(c.E * c.I * c.H));
  nan_up[size_t(c.I * c.H + 7)] = 0x7F;
  DeviceBuffer d_nan_up = to_device(nan_up);
  Fp8ExpertWeights with_nan = f;
  with_nan.w_up = make_view(d_nan_up.get(), DType::kE4M3, {c.E, c.I, c.H});
  set_quantized_weights(given, with_nan, nullptr);
  expect_check_names(given, "weights.w_up holds a NaN");
}

TEST_F(Fp8Layer, PreQuantizedWeights) {
  expect_prequantized_like_quantize_weights({256, 320, 256, 8, 2, 64});  // H past a multiple of 128
  expect_prequantized_like_quantize_weights({200, 320, 192, 8, 4, 0});  // H and I past a multiple of 128
}

// One layer's workspaces at two token counts sharing one set of weight copies: quantised through either,
// both read them, with the bits of workspaces that keep copies of their own; the workspace that gave up
// its copies holds less, and one made on another's copies holds as little; sharing with a bf16
// workspace or another layer's shape is an error, as is making a workspace on such copies, and so is
// moving a workspace whose copies others read onto another's copies.
TEST_F(Fp8Layer, SharedWeightCopies) {
  const Case big{200, 256, 192, 8, 2, 64}, small{72, 256, 192, 8, 2, 64};
  const HostLayer L(big, fresh_seed()), S(small, fresh_seed());
  LayerInputs s_in = S.inputs();
  s_in.weights = L.inputs().weights;  // one layer's weights at two token counts
  const std::vector<HostBf16> dy_big = random_dy(big), dy_small = random_dy(small);
  Workspace own_big(L.shape, fp8_config()), own_small(S.shape, fp8_config());
  quantize_weights(own_big, L.inputs().weights, nullptr);
  quantize_weights(own_small, s_in.weights, nullptr);
  const Outputs want_big = run_layer(own_big, L, dy_big);
  const Outputs want_small = run_layer(own_small, S, s_in, dy_small);

  Workspace a(L.shape, fp8_config()), b(S.shape, fp8_config());
  const int64_t b_alone = b.device_bytes();
  share_quantized_weights(a, b);
  EXPECT_LT(b.device_bytes(), b_alone);
  quantize_weights(b, s_in.weights, nullptr);  // made through one, read by both
  EXPECT_EQ(first_difference(run_layer(a, L, dy_big), want_big), "");
  EXPECT_EQ(first_difference(run_layer(b, S, s_in, dy_small), want_small), "");
  a.check(nullptr);
  b.check(nullptr);

  // A workspace made to read a's copies from the start: none of its own, the same bits.
  Workspace d(S.shape, fp8_config(), a);
  EXPECT_EQ(d.device_bytes(), b.device_bytes());
  EXPECT_EQ(first_difference(run_layer(d, S, s_in, dy_small), want_small), "");
  d.check(nullptr);

  const auto expect_refused = [](const std::function<void()>& make, const std::string& argument) {
    try {
      make();
      ADD_FAILURE() << "made or shared weight copies that cannot be read so (" << argument << ")";
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), argument) << e.what();
    }
  };
  // Sharing never splits a group: b and d read a's copies, so a may not move on to e's (they would
  // keep copies that no quantisation through a or e makes again); sharing what b already reads is a no-op.
  Workspace e(L.shape, fp8_config());
  expect_refused([&] { share_quantized_weights(e, a); }, "to");
  share_quantized_weights(a, b);
  EXPECT_EQ(first_difference(run_layer(b, S, s_in, dy_small), want_small), "");
  b.check(nullptr);

  Workspace bf16(L.shape);
  expect_refused([&] { share_quantized_weights(a, bf16); }, "to");
  expect_refused([&] { share_quantized_weights(bf16, a); }, "from");
  expect_refused([&] { Workspace w(S.shape, Config{}, a); }, "config.precision");
  expect_refused([&] { Workspace w(S.shape, fp8_config(), bf16); }, "fp8_weights_of");
  const HostLayer other(Case{72, 256, 128, 8, 2, 64}, fresh_seed());
  Workspace c(other.shape, fp8_config());
  try {
    share_quantized_weights(a, c);
    ADD_FAILURE() << "shared copies with another intermediate size";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "to") << e.what();
  }
  expect_refused([&] { Workspace w(other.shape, fp8_config(), a); }, "shape");
}

// Frozen experts in FP8, with FP8 and with bf16 weight gradients: the other gradients keep the bits of
// the whole backward.
TEST_F(Fp8Layer, WeightGradientsLeftOut) {
  for (const bool bf16_weight_grads : {false, true}) {
    SCOPED_TRACE(bf16_weight_grads ? "bf16 weight gradients" : "FP8 weight gradients");
    const Case c{200, 256, 192, 8, 2, 64};
    HostLayer L(c, fresh_seed());
    Config config = fp8_config();
    config.bf16_weight_grads = bf16_weight_grads;
    Workspace ws(L.shape, config);
    quantize_weights(ws, L.inputs().weights, nullptr);
    expect_weight_grads_can_be_left_out(ws, L);
  }
}

// Both quantisations of gate and up from one read (I % 128 == 0) and apart (I = 192), and the bf16
// weight gradients, from the halves of one gate_up tensor.
TEST_F(Fp8Layer, GateAndUpAsHalvesOfOneTensor) {
  expect_gate_up_halves_give_the_same_bits({200, 256, 128, 8, 2, 64}, fp8_config());
  expect_gate_up_halves_give_the_same_bits({130, 320, 192, 6, 3, 0}, fp8_config());
  Config bf16_wgrads = fp8_config();
  bf16_wgrads.bf16_weight_grads = true;
  expect_gate_up_halves_give_the_same_bits({200, 256, 128, 8, 2, 64}, bf16_wgrads);
}

// The gate a strided half, the up weight contiguous (different expert strides: each quantised from its
// own); one expert given as halves.
TEST_F(Fp8Layer, GateAndUpAtDifferentStrides) {
  expect_gate_up_halves_give_the_same_bits({200, 256, 128, 8, 2, 64}, fp8_config(), true);
  expect_gate_up_halves_give_the_same_bits({130, 320, 192, 6, 3, 0}, fp8_config(), true);
  expect_gate_up_halves_give_the_same_bits({90, 256, 128, 1, 1, 0}, fp8_config());
}

TEST_F(Fp8Layer, SameBitsEveryCall) {
  const Case c{400, 256, 192, 8, 4, 64};
  const HostLayer L(c, fresh_seed());
  Workspace ws(L.shape, fp8_config());
  quantize_weights(ws, L.inputs().weights, nullptr);
  OutputBuffers a(c), b(c);
  a.poison();
  b.poison();
  forward(ws, L.inputs(), a.y_view(), nullptr);
  forward(ws, L.inputs(), b.y_view(), nullptr);
  ws.check(nullptr);
  const Outputs ya = a.to_host_outputs(), yb = b.to_host_outputs();
  ASSERT_EQ(ya.y.size(), yb.y.size());
  EXPECT_EQ(std::memcmp(ya.y.data(), yb.y.data(), ya.y.size() * sizeof(ya.y[0])), 0);
}

// `call` throws a lynx::Error whose message names `what`.
template <class F>
void expect_error_naming(F&& call, const std::string& what) {
  try {
    call();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    return;
  }
  ADD_FAILURE() << "no lynx::Error naming " << what;
}

TEST_F(Fp8Layer, NeedsItsQuantizedWeights) {
  const Case c{64, 128, 64, 4, 2, 0};
  const HostLayer L(c, fresh_seed()), other(c, fresh_seed());
  Workspace ws(L.shape, fp8_config());
  OutputBuffers out(c);
  expect_error_naming([&] { forward(ws, L.inputs(), out.y_view(), nullptr); }, "quantize_weights");
  quantize_weights(ws, other.inputs().weights, nullptr);
  EXPECT_THROW(forward(ws, L.inputs(), out.y_view(), nullptr), Error);
  quantize_weights(ws, L.inputs().weights, nullptr);
  forward(ws, L.inputs(), out.y_view(), nullptr);
  ws.check(nullptr);
  // A bf16 workspace has no FP8 weights to make.
  Workspace bf16(L.shape, Config{});
  EXPECT_THROW(quantize_weights(bf16, L.inputs().weights, nullptr), Error);
  EXPECT_THROW(quantize_weights(ws, L.inputs().weights, nullptr, Fp8Copies(3)), Error);
}

// Each pass reads only its own copies: with the forward's made from L's weights and the backward's from
// another layer's, forward runs and backward is refused, naming the backward's copies; once those are
// L's too, the passes give the bits of copies made together (Fp8Copies::kBoth).
TEST_F(Fp8Layer, ForwardAndBackwardCopiesAreMadeApart) {
  const Case c{200, 256, 192, 8, 4, 64};
  const HostLayer L(c, fresh_seed()), other(c, fresh_seed());
  const std::vector<HostBf16> dy = random_dy(c);
  Workspace both(L.shape, fp8_config());
  quantize_weights(both, L.inputs().weights, nullptr);
  const Outputs want = run_layer(both, L, dy);
  both.check(nullptr);

  Workspace apart(L.shape, fp8_config());
  quantize_weights(apart, other.inputs().weights, nullptr, Fp8Copies::kBackward);
  quantize_weights(apart, L.inputs().weights, nullptr, Fp8Copies::kForward);
  OutputBuffers out(c);
  out.poison();
  DeviceBuffer d_dy = to_device(dy);
  const TensorView dyv = make_view(d_dy.get(), DType::kBF16, {c.T, c.H});
  forward(apart, L.inputs(), out.y_view(), nullptr);
  expect_error_naming([&] { backward(apart, L.inputs(), dyv, out.grads(), nullptr); }, "Fp8Copies::kBackward");
  quantize_weights(apart, L.inputs().weights, nullptr, Fp8Copies::kBackward);
  backward(apart, L.inputs(), dyv, out.grads(), nullptr);
  apart.check(nullptr);
  EXPECT_EQ(first_difference(out.to_host_outputs(), want), "");
  // A fresh workspace with only the backward's copies: forward is refused, naming the forward's.
  Workspace backward_only(L.shape, fp8_config());
  quantize_weights(backward_only, L.inputs().weights, nullptr, Fp8Copies::kBackward);
  expect_error_naming([&] { forward(backward_only, L.inputs(), out.y_view(), nullptr); }, "Fp8Copies::kForward");
}

// The poisoned y is left as it was: still NaN everywhere.
void expect_y_unwritten(const OutputBuffers& out) {
  const Outputs o = out.to_host_outputs();
  for (size_t i = 0; i < o.y.size(); ++i) {
    ASSERT_TRUE(std::isnan(to_double(o.y[i]))) << "y[" << i << "] was written";
  }
}


// A routing that needs more rows than the schedule's capacity: reported, y not written, and no row of
// the schedule's arrays (never placed) read (run under memcheck).
TEST_F(Fp8Layer, CapacityOverflowIsReported) {
  Case c{300, 256, 128, 8, 2, 0, "one"};  // every row to expert 4: 600 rows
  const HostLayer L(c, fresh_seed());
  Config config = fp8_config();
  config.schedule_capacity = 256;
  Workspace ws(L.shape, config);
  quantize_weights(ws, L.inputs().weights, nullptr);
  OutputBuffers out(c);
  out.poison();
  forward(ws, L.inputs(), out.y_view(), nullptr);
  expect_check_names(ws, "schedule rows but config.schedule_capacity is 256");
  expect_y_unwritten(out);
}

TEST_F(Fp8Layer, NonFiniteInputsAreReported) {
  const Case c{96, 256, 128, 4, 2, 0};
  HostLayer L(c, fresh_seed());
  Workspace ws(L.shape, fp8_config());
  quantize_weights(ws, L.inputs().weights, nullptr);
  ws.check(nullptr);
  OutputBuffers out(c);
  // A NaN in x.
  std::vector<HostBf16> x = L.x;
  x[size_t(37 * c.H + 200)] = float_to_bf16(std::nanf(""));
  upload(L.d_x.get(), x.data(), x.size() * 2);
  out.poison();
  forward(ws, L.inputs(), out.y_view(), nullptr);
  expect_check_names(ws, "x holds a NaN");
  expect_y_unwritten(out);
  // Reported once: the next call with finite inputs runs.
  upload(L.d_x.get(), L.x.data(), L.x.size() * 2);
  forward(ws, L.inputs(), out.y_view(), nullptr);
  ws.check(nullptr);
  // An infinity in w_down.
  std::vector<HostBf16> wd = L.w_down;
  wd[size_t(3 * c.H * c.I + 5)] = float_to_bf16(INFINITY);
  upload(L.d_wd.get(), wd.data(), wd.size() * 2);
  quantize_weights(ws, L.inputs().weights, nullptr);
  out.poison();
  forward(ws, L.inputs(), out.y_view(), nullptr);
  expect_check_names(ws, "weights.w_down holds a NaN or an infinity");
  expect_y_unwritten(out);
  // A NaN in dy: reported, dx not written.
  upload(L.d_wd.get(), L.w_down.data(), L.w_down.size() * 2);
  quantize_weights(ws, L.inputs().weights, nullptr);
  forward(ws, L.inputs(), out.y_view(), nullptr);
  ws.check(nullptr);
  std::vector<HostBf16> dy = random_dy(c);
  dy[size_t(5 * c.H + 17)] = float_to_bf16(std::nanf(""));
  DeviceBuffer d_dy = to_device(dy);
  out.poison();
  backward(ws, L.inputs(), make_view(d_dy.get(), DType::kBF16, {c.T, c.H}), out.grads(), nullptr);
  expect_check_names(ws, "dy holds a NaN");
  const Outputs o = out.to_host_outputs();
  for (size_t i = 0; i < o.dx.size(); ++i) ASSERT_TRUE(std::isnan(to_double(o.dx[i]))) << "dx[" << i << "] was written";
}

}  // namespace
}  // namespace lynx::test
