// What exists only in the experiments build: stage omission (runtime/stages.h) and the tuning
// overrides read from the environment (plan/overrides.h).
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "lynx/error.h"
#include "plan/overrides.h"
#include "runtime/stages.h"

namespace lynx {
namespace {

// LYNX_OMIT's names (runtime/stages.h): each stage by its name, lists, and a clear error for the rest.
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

// Every variable the environment overrides reads (read once per process: the only test of this binary
// that calls environment_overrides).
TEST(EnvironmentOverrides, ReadsEveryVariable) {
  const char* vars[][2] = {{"LYNX_GEMM_ORDER", "static"}, {"LYNX_GEMM_GROUP_ROWS", "8"},
                           {"LYNX_GEMM_CLUSTER", "1"},     {"LYNX_GEMM_FOLD", "0"},
                           {"LYNX_GEMM_SWAPPED", "0"},     {"LYNX_GEMM_HALF_TILES", "1"},
                           {"LYNX_GEMM_GATHER", "0"},      {"LYNX_GEMM_GATHER_TOKENS", "1"},
                           {"LYNX_GEMM_GATHER_AHEAD", "5"}, {"LYNX_SCHEDULE_MIN_WARPS", "2"},
                           {"LYNX_UNFUSED_GEMM", "grouped"}, {"LYNX_X_ROWS_AGAIN", "dgrad-gate-up"},
                           {"LYNX_VIRTUAL_RANKS", "serial"}, {"LYNX_FP8_PAIR_ROWS", "1"},
                           {"LYNX_FP8_WIDE_TILES", "0"}};
  for (const auto& v : vars) ASSERT_EQ(setenv(v[0], v[1], 1), 0);
  const plan::Overrides& o = plan::environment_overrides();
  for (const auto& v : vars) unsetenv(v[0]);
  EXPECT_EQ(o.gemm_order, 0);
  EXPECT_EQ(o.gemm_group_rows, 8);
  EXPECT_EQ(o.gemm_clusters, 1);
  EXPECT_EQ(o.gemm_fold, 0);
  EXPECT_EQ(o.gemm_swapped, 0);
  EXPECT_EQ(o.gemm_half_tiles, 1);
  EXPECT_EQ(o.gemm_gather, 0);
  EXPECT_EQ(o.gather_token_major, 1);
  EXPECT_EQ(o.gather_lookahead, 5);
  EXPECT_EQ(o.schedule_min_warps, 2);
  EXPECT_EQ(o.baseline_gemm, 1);
  EXPECT_EQ(o.x_rows_again, 2);
  EXPECT_EQ(o.virtual_serial, 1);
  EXPECT_EQ(o.fp8_pair_rows, 1);
  EXPECT_EQ(o.fp8_wide_tiles, 0);
  EXPECT_EQ(o.gemm_sm_count, 0);  // a test hook only
}

}  // namespace
}  // namespace lynx
