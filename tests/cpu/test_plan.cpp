// The layer plan (plan/layer_plan.h): the launch choices the rules make for the benchmark shapes, and
// the overrides that replace them (pure host functions).
#include <gtest/gtest.h>

#include <string>

#include "lynx/error.h"
#include "plan/layer_plan.h"
#include "plan/shared_load_block.h"

namespace lynx::plan {
namespace {

LayerShape shape(int64_t T, int64_t H, int64_t I, int64_t E, int64_t k) {
  LayerShape s;
  s.tokens = T;
  s.hidden = H;
  s.intermediate = I;
  s.num_experts = E;
  s.top_k = k;
  return s;
}

const LayerShape kQwen3 = shape(8192, 2048, 768, 128, 8);
const LayerShape kDeepseekV3 = shape(4096, 7168, 2048, 256, 8);
const LayerShape kMixtral = shape(8192, 4096, 14336, 8, 2);

DeviceProps h200() {
  DeviceProps d;
  d.sm_count = 132;
  d.l2_bytes = 60 << 20;
  d.schedule = {132, 227 * 1024 / 4};
  return d;
}

// qwen3-30b-a3b: 4 row blocks per expert. Gate/up gathers its rows inside the GEMM (2I = 1536 columns
// per row) and so claims its tiles in order; da's rows (I = 768 columns) are gathered token-major
// before it, and it walks the static round robin in groups of 4 blocks; no launch pairs CTAs (K <=
// 2048) or folds tails.
TEST(LayerPlan, Qwen3) {
  const LayerPlan p = make_layer_plan(kQwen3, h200());
  EXPECT_EQ(p.gemm_sm_count, 132);
  EXPECT_EQ(p.gate_up_gather, GatherPlace::kInGemm);
  EXPECT_EQ(p.da_gather, GatherPlace::kTokenKernel);
  EXPECT_TRUE(p.gate_up.order.in_order);
  EXPECT_FALSE(p.down.order.in_order);
  EXPECT_EQ(p.down.order.group_rows, 4);
  EXPECT_FALSE(p.da.order.in_order);
  EXPECT_FALSE(p.dx.order.in_order);
  EXPECT_FALSE(p.weight_grad_in_order);
  for (const gemm::RowLaunch* l : {&p.gate_up, &p.down, &p.da, &p.dx}) {
    EXPECT_FALSE(l->clusters);
    EXPECT_FALSE(l->fold);
    EXPECT_TRUE(l->half_tiles);
    EXPECT_TRUE(l->swapped);
  }
  EXPECT_EQ(p.gate_up.gather_lookahead, 48);  // 24 MB of 512 KB row blocks
  EXPECT_EQ(p.x_rows_again, XRowsAgain::kBesideDgradDown);  // da gathers no dy rows itself
  EXPECT_EQ(p.schedule.warps, 4);
  EXPECT_EQ(p.schedule.chunks, 128);
  EXPECT_EQ(p.baseline_gemm, -1);
  EXPECT_FALSE(p.fp8_pair_rows);  // four row blocks an expert
  EXPECT_TRUE(p.fp8_wide_tiles);  // where tiles are not in pairs
}

// Where one rank gathers the x rows again: beside the dgrad of down unless that GEMM gathers its dy
// rows itself, then by a kernel; forced: a kernel, beside down where it can be, beside gate/up; at R > 1
// the context keeps them.
TEST(LayerPlan, XRowsAgain) {
  EXPECT_EQ(x_rows_again_place(kQwen3, GatherPlace::kTokenKernel), XRowsAgain::kBesideDgradDown);
  EXPECT_EQ(x_rows_again_place(kQwen3, GatherPlace::kRowKernel), XRowsAgain::kBesideDgradDown);
  EXPECT_EQ(x_rows_again_place(kQwen3, GatherPlace::kInGemm), XRowsAgain::kKernel);
  EXPECT_EQ(x_rows_again_place(kQwen3, GatherPlace::kTokenKernel, 0), XRowsAgain::kKernel);
  EXPECT_EQ(x_rows_again_place(kQwen3, GatherPlace::kTokenKernel, 1), XRowsAgain::kBesideDgradDown);
  EXPECT_EQ(x_rows_again_place(kQwen3, GatherPlace::kInGemm, 1), XRowsAgain::kKernel);
  EXPECT_EQ(x_rows_again_place(kQwen3, GatherPlace::kInGemm, 2), XRowsAgain::kBesideDgradGateUp);
  LayerShape two = kQwen3;
  two.num_ranks = 2;
  EXPECT_EQ(x_rows_again_place(two, GatherPlace::kRowKernel), XRowsAgain::kKept);
  EXPECT_EQ(x_rows_again_place(two, GatherPlace::kRowKernel, 2), XRowsAgain::kKept);
  Overrides bad;
  bad.x_rows_again = 3;
  EXPECT_THROW(make_layer_plan(kQwen3, h200(), bad), Error);
}

// deepseek-v3: about one row block per expert, x (59 MB) over half the L2: every gather token-major,
// every launch in order with expert groups, tails folded, the long-K launches (gate/up and da, K =
// 7168; dx, K = 4096) as cluster units, down (K = 2048) not.
TEST(LayerPlan, DeepseekV3) {
  const LayerPlan p = make_layer_plan(kDeepseekV3, h200());
  EXPECT_EQ(p.gate_up_gather, GatherPlace::kTokenKernel);
  EXPECT_EQ(p.da_gather, GatherPlace::kTokenKernel);
  for (const gemm::RowLaunch* l : {&p.gate_up, &p.down, &p.da, &p.dx}) {
    EXPECT_TRUE(l->order.in_order);
    EXPECT_TRUE(l->order.expert_groups);
    EXPECT_TRUE(l->fold);
  }
  EXPECT_TRUE(p.gate_up.clusters);
  EXPECT_FALSE(p.down.clusters);
  EXPECT_TRUE(p.da.clusters);
  EXPECT_TRUE(p.dx.clusters);
  EXPECT_TRUE(p.weight_grad_in_order);
  EXPECT_TRUE(p.fp8_pair_rows);  // 128 rows an expert on average
  EXPECT_FALSE(p.fp8_wide_tiles);  // not with tile pairs
}

// mixtral-8x7b: 16 row blocks per expert: in order, groups of 16; every K at least 4096: paired.
TEST(LayerPlan, Mixtral) {
  const LayerPlan p = make_layer_plan(kMixtral, h200());
  for (const gemm::RowLaunch* l : {&p.gate_up, &p.down, &p.da, &p.dx}) {
    EXPECT_TRUE(l->order.in_order);
    EXPECT_EQ(l->order.group_rows, 16);
    EXPECT_TRUE(l->clusters);
    EXPECT_FALSE(l->fold);
  }
  EXPECT_FALSE(p.fp8_pair_rows);
}

// Each override replaces exactly its choice.
TEST(LayerPlan, OverridesReplaceTheirChoice) {
  Overrides o;
  o.gemm_order = 1;
  o.gemm_group_rows = 3;
  o.gemm_clusters = 1;
  o.gemm_fold = 1;
  o.gemm_swapped = 0;
  o.gemm_half_tiles = 0;
  o.gather_lookahead = 2;
  o.gemm_sm_count = 7;
  o.schedule_min_warps = 16;
  o.baseline_gemm = 1;
  o.fp8_pair_rows = 1;
  const LayerPlan p = make_layer_plan(kQwen3, h200(), o);
  EXPECT_EQ(p.gemm_sm_count, 7);
  for (const gemm::RowLaunch* l : {&p.gate_up, &p.down, &p.da, &p.dx}) {
    EXPECT_TRUE(l->order.in_order);
    EXPECT_EQ(l->order.group_rows, 3);
    EXPECT_TRUE(l->clusters);
    EXPECT_TRUE(l->fold);
    EXPECT_FALSE(l->swapped);
    EXPECT_FALSE(l->half_tiles);
    EXPECT_EQ(l->gather_lookahead, 2);
  }
  EXPECT_TRUE(p.weight_grad_in_order);
  EXPECT_TRUE(p.fp8_pair_rows);
  Overrides plain;
  plain.fp8_pair_rows = 0;
  EXPECT_FALSE(make_layer_plan(kDeepseekV3, h200(), plain).fp8_pair_rows);
  EXPECT_TRUE(make_layer_plan(kDeepseekV3, h200(), plain).fp8_wide_tiles);  // plain tiles: wide ones too
  EXPECT_FALSE(p.fp8_wide_tiles);  // qwen3-30b-a3b's tiles forced into pairs
  Overrides no_wide;
  no_wide.fp8_wide_tiles = 0;
  EXPECT_FALSE(make_layer_plan(kQwen3, h200(), no_wide).fp8_wide_tiles);
  EXPECT_EQ(p.schedule.warps, 16);
  EXPECT_EQ(baseline_gemm_strategy(p, 4, 1e6), GemmStrategy::kGrouped);
  EXPECT_EQ(baseline_gemm_strategy(make_layer_plan(kQwen3, h200()), 4, 1e6), GemmStrategy::kLoop);

  Overrides g;
  g.gather_token_major = 0;
  g.gemm_gather = 0;
  const LayerPlan q = make_layer_plan(kQwen3, h200(), g);
  EXPECT_EQ(q.gate_up_gather, GatherPlace::kRowKernel);
  EXPECT_EQ(q.da_gather, GatherPlace::kRowKernel);
  g.gather_token_major = 1;
  EXPECT_EQ(make_layer_plan(kQwen3, h200(), g).gate_up_gather, GatherPlace::kTokenKernel);
}

// At R > 1 the rows come from other ranks: gate/up's own gather pulls them (no token-major push, even
// where one rank would scatter by token) where each rank has the GPU's SMs to itself, the row-major
// kernel where ranks share them or the override says so; `da` always pulls with the row-major kernel.
TEST(LayerPlan, RanksPullRowsInGateUp) {
  for (LayerShape s : {kQwen3, kDeepseekV3}) {
    s.num_ranks = 8;
    s.tokens /= 8;
    const LayerPlan p = make_layer_plan(s, h200());
    EXPECT_EQ(p.gate_up_gather, GatherPlace::kInGemm);
    EXPECT_EQ(p.da_gather, GatherPlace::kRowKernel);
    Overrides g;
    g.gemm_gather = 0;
    EXPECT_EQ(make_layer_plan(s, h200(), g).gate_up_gather, GatherPlace::kRowKernel);
    for (int32_t sharing : {2, 8}) {
      DeviceProps shared = h200();
      shared.ranks_sharing_sms = sharing;
      const LayerPlan q = make_layer_plan(s, shared);
      EXPECT_EQ(q.gate_up_gather, GatherPlace::kRowKernel) << sharing;
      EXPECT_EQ(q.da_gather, GatherPlace::kRowKernel) << sharing;
      Overrides in_gemm;
      in_gemm.gemm_gather = 1;
      EXPECT_EQ(make_layer_plan(s, shared, in_gemm).gate_up_gather, GatherPlace::kInGemm) << sharing;
    }
  }
  DeviceProps shared = h200();
  shared.ranks_sharing_sms = 8;  // one rank: nothing to share with, the one-rank rules
  EXPECT_EQ(make_layer_plan(kQwen3, shared).gate_up_gather, GatherPlace::kInGemm);
  EXPECT_EQ(make_layer_plan(kDeepseekV3, h200()).gate_up_gather, GatherPlace::kTokenKernel);
}

TEST(LayerPlan, OverridesOutOfRangeAreErrors) {
  const auto expect_error = [](Overrides o, const std::string& name) {
    try {
      make_layer_plan(kQwen3, h200(), o);
      ADD_FAILURE() << "accepted " << name;
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), name) << e.what();
    }
  };
  Overrides o;
  o.gemm_order = 2;
  expect_error(o, "gemm_order");
  o = {};
  o.gemm_group_rows = 65;
  expect_error(o, "gemm_group_rows");
  o = {};
  o.schedule_min_warps = 17;
  expect_error(o, "schedule_min_warps");
  o = {};
  o.gemm_sm_count = -1;
  expect_error(o, "gemm_sm_count");
  o = {};
  o.fp8_pair_rows = 2;
  expect_error(o, "fp8_pair_rows");
  o = {};
  o.fp8_wide_tiles = 2;
  expect_error(o, "fp8_wide_tiles");
}

// The block a workspace with a shared expert takes while it is made (lynx/allocator.h gives these
// sizes): x and one shared weight always, the intermediates where they are lent, each rounded up to
// 1 KB; nothing without a shared expert.
TEST(SharedLoadBlock, HoldsWhatTheWorkspaceDoesNot) {
  LayerShape s;
  s.tokens = 4096, s.hidden = 7168, s.intermediate = 2048, s.num_experts = 256, s.top_k = 8;
  EXPECT_EQ(plan::shared_load_block(s, true, true).total(), 0);
  s.shared_intermediate = 2048;
  const int64_t x = 2 * 4096 * 7168, w = 2 * 2048 * 7168, t = 2 * 4096 * 2048, y = 4 * 4096 * 7168;
  EXPECT_EQ(plan::shared_load_block(s, false, false).total(), x + w);
  EXPECT_EQ(plan::shared_load_block(s, true, false).total(), x + w + 4 * t + y);
  EXPECT_EQ(plan::shared_load_block(s, false, true).total(), x + w + 2 * t);
  EXPECT_EQ(plan::shared_load_block(s, true, true).total(), x + w + 6 * t + y);
  // Each area on its own 1 KB: T = 5, H = 64, I_s = 3.
  s.tokens = 5, s.hidden = 64, s.shared_intermediate = 3;
  const plan::SharedLoadBlock b = plan::shared_load_block(s, true, true);
  EXPECT_EQ(b.x, 1024);            // 640 bytes
  EXPECT_EQ(b.weights, 1024);      // 384
  EXPECT_EQ(b.scratch, 6 * 1024);  // four of 30, and ys' 1280
  EXPECT_EQ(b.context, 2 * 1024);
}

}  // namespace
}  // namespace lynx::plan
