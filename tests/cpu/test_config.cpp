// The config heuristics and their range checks (pure host functions).
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "api/omit.h"
#include "lynx/lynx.h"
#include "unfused/gemm_strategy.h"

namespace lynx {
namespace {

LayerShape qwen3() {
  LayerShape s;
  s.tokens = 8192;
  s.hidden = 2048;
  s.intermediate = 768;
  s.num_experts = 128;
  s.top_k = 8;
  return s;
}

template <class F>
void expect_error(F&& f, const std::string& argument) {
  try {
    f();
    ADD_FAILURE() << "no error thrown; expected one naming " << argument;
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), argument) << e.what();
  }
}

TEST(Config, WorstCaseRows) {
  LayerShape s = qwen3();
  // 65536 routed rows + 128 experts each padded by at most 127.
  EXPECT_EQ(worst_case_schedule_rows(s), 65536 + 128 * 127);
  s.num_ranks = 8;
  // 8 ranks' rows can all land on this rank's 16 experts.
  EXPECT_EQ(worst_case_schedule_rows(s), 526336);  // 8 * 65536 + 16 * 127 = 526320, rounded up to 128
  EXPECT_EQ(worst_case_schedule_rows(s) % kTileRows, 0);
  s = qwen3();
  s.tokens = 1;
  s.top_k = 1;
  // One row can only pad one expert.
  EXPECT_EQ(worst_case_schedule_rows(s), 128);
}

TEST(Config, DefaultsAreConsistent) {
  for (int32_t sms : {78, 114, 132}) {
    const ResolvedConfig r = resolve_config(qwen3(), Config{}, DeviceInfo{sms, int64_t(80) << 30});
    EXPECT_EQ(r.schedule_capacity, worst_case_schedule_rows(qwen3()));
    EXPECT_EQ(r.minibatch_rows % kTileRows, 0);
    EXPECT_GE(r.ring_rows, r.minibatch_rows);
    EXPECT_EQ(r.ring_rows % r.minibatch_rows, 0);
    EXPECT_GE(r.num_comm_sms, 1);
    EXPECT_LT(r.num_comm_sms, sms);
    EXPECT_TRUE(r.deterministic);
    EXPECT_TRUE(r.save_forward_context);
    EXPECT_EQ(r.backend, Backend::kFused);
  }
  // A tiny layer: minibatch and ring never exceed the schedule.
  LayerShape tiny = qwen3();
  tiny.tokens = 3;
  tiny.top_k = 1;
  const ResolvedConfig r = resolve_config(tiny, Config{}, DeviceInfo{});
  EXPECT_EQ(r.schedule_capacity, 384);
  EXPECT_LE(r.minibatch_rows, r.schedule_capacity);
  EXPECT_LE(r.ring_rows, r.schedule_capacity);
}

TEST(Config, ExplicitValuesAreKeptOrRejected) {
  Config c;
  c.num_comm_sms = 16;
  c.minibatch_rows = 1024;
  c.ring_rows = 8192;
  c.schedule_capacity = 4096;
  const ResolvedConfig r = resolve_config(qwen3(), c, DeviceInfo{});
  EXPECT_EQ(r.num_comm_sms, 16);
  EXPECT_EQ(r.minibatch_rows, 1024);
  EXPECT_EQ(r.ring_rows, 8192);
  EXPECT_EQ(r.schedule_capacity, 4096);
  c.backend = Backend::kUnfused;
  EXPECT_EQ(resolve_config(qwen3(), c, DeviceInfo{}).backend, Backend::kUnfused);
  // Capacity beyond the worst case is clamped to it.
  c = Config{};
  c.schedule_capacity = 1 << 24;
  EXPECT_EQ(resolve_config(qwen3(), c, DeviceInfo{}).schedule_capacity, worst_case_schedule_rows(qwen3()));

  c = Config{};
  c.num_comm_sms = 132;
  expect_error([&] { resolve_config(qwen3(), c, DeviceInfo{}); }, "config.num_comm_sms");
  c = Config{};
  c.num_comm_sms = -1;
  expect_error([&] { resolve_config(qwen3(), c, DeviceInfo{}); }, "config.num_comm_sms");
  c = Config{};
  c.minibatch_rows = 1000;
  expect_error([&] { resolve_config(qwen3(), c, DeviceInfo{}); }, "config.minibatch_rows");
  c = Config{};
  c.minibatch_rows = 1024;
  c.ring_rows = 1536;
  expect_error([&] { resolve_config(qwen3(), c, DeviceInfo{}); }, "config.ring_rows");
  c = Config{};
  c.schedule_capacity = 100;
  expect_error([&] { resolve_config(qwen3(), c, DeviceInfo{}); }, "config.schedule_capacity");
  c = Config{};
  c.schedule_capacity = -128;
  expect_error([&] { resolve_config(qwen3(), c, DeviceInfo{}); }, "config.schedule_capacity");
  c = Config{};
  c.backend = static_cast<Backend>(7);
  expect_error([&] { resolve_config(qwen3(), c, DeviceInfo{}); }, "config.backend");
  LayerShape bad = qwen3();
  bad.top_k = 200;
  expect_error([&] { resolve_config(bad, Config{}, DeviceInfo{}); }, "shape.top_k");
  bad = qwen3();
  bad.num_ranks = 2;  // the schedule builder takes any R; the layer paths do not yet
  expect_error([&] { resolve_config(bad, Config{}, DeviceInfo{}); }, "shape.num_ranks");
}

// The unfused path's GEMM issue strategy on the products of the benchmark shapes' forward gate GEMMs
// (mean rows per expert · I · H · 2 FLOPs), as measured on the H200 (docs/unfused.md).
TEST(GemmStrategy, FollowsTheMeasuredSweep) {
  using unfused::GemmStrategy;
  using unfused::choose_gemm_strategy;
  EXPECT_EQ(choose_gemm_strategy(2 * 128, 512.0 * 768 * 2048 * 2), GemmStrategy::kGrouped);  // qwen3-30b-a3b
  EXPECT_EQ(choose_gemm_strategy(2 * 64, 1024.0 * 1024 * 2048 * 2), GemmStrategy::kLoop);    // olmoe-1b-7b
  EXPECT_EQ(choose_gemm_strategy(2 * 8, 2048.0 * 14336 * 4096 * 2), GemmStrategy::kLoop);    // mixtral-8x7b
  EXPECT_EQ(choose_gemm_strategy(2 * 256, 128.0 * 2048 * 7168 * 2), GemmStrategy::kLoop);    // deepseek-v3
  EXPECT_EQ(choose_gemm_strategy(4, 1e6), GemmStrategy::kLoop);  // a handful of launches costs nothing
}

// LYNX_OMIT's names (src/api/omit.h): each stage by its name, lists, and a clear error for the rest.
TEST(OmitStages, ParsesEveryStageAndRejectsUnknownNames) {
  EXPECT_EQ(parse_omitted_stages(""), 0u);
  for (uint32_t i = 0; i < uint32_t(Stage::kCount); ++i) {
    EXPECT_EQ(parse_omitted_stages(stage_name(Stage(i))), 1u << i) << stage_name(Stage(i));
  }
  EXPECT_EQ(parse_omitted_stages("gather,down"), (1u << uint32_t(Stage::kGather)) | (1u << uint32_t(Stage::kDown)));
  for (const char* bad : {"gate", "gather,", ",down", "gather,,down", "Gather", "all"}) {
    try {
      parse_omitted_stages(bad);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("LYNX_OMIT"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("stages: gather, shared, gate_up"), std::string::npos) << e.what();
    }
  }
}

// The first call of a pass runs every stage (so that a stage left out later leaves real values behind).
// The only test in this binary that reads LYNX_OMIT, which omitted() reads once.
TEST(OmitStages, LeavesStagesOutOnlyAfterTheFirstCallOfTheirPass) {
  ASSERT_EQ(setenv("LYNX_OMIT", "down,wgrad_down", 1), 0);
  EXPECT_FALSE(omitted(Stage::kDown, 0));
  EXPECT_TRUE(omitted(Stage::kDown, 1));
  EXPECT_TRUE(omitted(Stage::kWgradDown, 3));
  EXPECT_FALSE(omitted(Stage::kWgradDown, 0));
  EXPECT_FALSE(omitted(Stage::kGateUp, 5));
  unsetenv("LYNX_OMIT");
}

}  // namespace
}  // namespace lynx
