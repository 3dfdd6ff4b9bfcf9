// The expert GEMM kernel's tile schedule (src/fused/tile_scheduler.h) on random padded schedules.
#include <gtest/gtest.h>

#include <random>
#include <set>
#include <tuple>
#include <vector>

#include "fused/tile_scheduler.h"

namespace lynx::fused {
namespace {

// Padded expert offsets for random row counts (some experts empty), like the schedule builder's.
std::vector<int32_t> random_offsets(std::mt19937& rng, int32_t experts, int32_t max_rows) {
  std::vector<int32_t> offsets(experts + 1, 0);
  std::uniform_int_distribution<int32_t> rows(0, max_rows);
  for (int32_t e = 0; e < experts; ++e) {
    const int32_t n = rng() % 4 == 0 ? 0 : rows(rng);
    offsets[e + 1] = offsets[e] + (n + kBlockM - 1) / kBlockM * kBlockM;
  }
  return offsets;
}

TEST(TileSchedule, RowModesCoverTheRowsInUseOnce) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 50; ++trial) {
    const int32_t experts = 1 + rng() % 40, n = 64 * (1 + rng() % 40), block_n = trial % 2 ? 256 : 128;
    const std::vector<int32_t> offsets = random_offsets(rng, experts, 700);
    const int32_t used = offsets[experts];
    const int32_t capacity = used + kBlockM * (rng() % 3);
    const int32_t group_rows = std::vector<int32_t>{1, 2, 3, 4, 16}[trial % 5];
    const TileGrid g{offsets.data(), experts, capacity / kBlockM, (n + block_n - 1) / block_n, block_n, 12, capacity,
                     false, group_rows};
    std::set<std::pair<int32_t, int32_t>> seen;
    for (int32_t tile = 0; tile < tile_count(g); ++tile) {
      const Tile t = tile_at(g, tile);
      ASSERT_TRUE(seen.insert({t.a_row, t.b_row}).second) << "tile " << tile << " repeats";
      ASSERT_LT(t.a_row, used);
      ASSERT_LT(t.b_row, n);
      ASSERT_EQ(t.k_blocks, 12);
      // The tile's 128 rows lie inside its expert's block.
      ASSERT_LE(offsets[t.expert], t.a_row);
      ASSERT_LE(t.a_row + kBlockM, offsets[t.expert + 1]);
    }
    ASSERT_EQ(int64_t(seen.size()), int64_t(used / kBlockM) * g.tiles_n);
  }
}

TEST(TileSchedule, RowModesRasterInGroupsOfRowBlocks) {
  // 10 row blocks in use, 3 column blocks, groups of 4: blocks 0-3 column by column, then 4-7, then
  // the last group of 2.
  const std::vector<int32_t> offsets = {0, 512, 1280};
  const TileGrid g{offsets.data(), 2, 12, 3, 256, 4, 1536, false, 4};
  ASSERT_EQ(tile_count(g), 30);
  std::vector<std::pair<int32_t, int32_t>> order;
  for (int32_t tile = 0; tile < tile_count(g); ++tile) {
    const Tile t = tile_at(g, tile);
    order.push_back({t.a_row / kBlockM, t.b_row / 256});
  }
  const std::vector<std::pair<int32_t, int32_t>> want = {
      {0, 0}, {1, 0}, {2, 0}, {3, 0}, {0, 1}, {1, 1}, {2, 1}, {3, 1}, {0, 2}, {1, 2}, {2, 2}, {3, 2},
      {4, 0}, {5, 0}, {6, 0}, {7, 0}, {4, 1}, {5, 1}, {6, 1}, {7, 1}, {4, 2}, {5, 2}, {6, 2}, {7, 2},
      {8, 0}, {9, 0}, {8, 1}, {9, 1}, {8, 2}, {9, 2}};
  EXPECT_EQ(order, want);
  EXPECT_EQ(tile_at(g, 3).expert, 0);
  EXPECT_EQ(tile_at(g, 12).expert, 1);  // row block 4 starts the second expert
}

TEST(TileSchedule, GroupRowsStayWithinAnExpertsAverageRows) {
  EXPECT_EQ(choose_group_rows(8192 * 8, 128), 4);   // qwen3-30b-a3b: 512 rows per expert
  EXPECT_EQ(choose_group_rows(8192 * 8, 64), 8);    // olmoe-1b-7b: 1024
  EXPECT_EQ(choose_group_rows(8192 * 2, 8), 16);    // mixtral-8x7b: 2048
  EXPECT_EQ(choose_group_rows(4096 * 8, 256), 1);   // deepseek-v3: 128
  EXPECT_EQ(choose_group_rows(1 << 30, 1), 16);     // capped
  EXPECT_EQ(choose_group_rows(100, 8), 1);
  EXPECT_EQ(choose_group_rows(0, 0), 1);
}

TEST(TileSchedule, RowModesStartNothingWhenTheScheduleOverflowed) {
  const std::vector<int32_t> offsets = {0, 256, 512};
  const TileGrid g{offsets.data(), 2, 3, 2, 128, 4, 384, false};  // 512 rows needed, 384 held
  EXPECT_EQ(tile_count(g), 0);
}

TEST(TileSchedule, WeightGradCoversEveryExpertTileWithItsRows) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 50; ++trial) {
    const int32_t experts = 1 + rng() % 20, m = 64 * (1 + rng() % 20), n = 64 * (1 + rng() % 20);
    const std::vector<int32_t> offsets = random_offsets(rng, experts, 500);
    const TileGrid g{offsets.data(), experts, (m + kBlockM - 1) / kBlockM, (n + 255) / 256, 256, 0, offsets[experts],
                     true};
    std::set<std::tuple<int32_t, int32_t, int32_t>> seen;
    for (int32_t tile = 0; tile < tile_count(g); ++tile) {
      const Tile t = tile_at(g, tile);
      ASSERT_TRUE(seen.insert({t.expert, t.a_row, t.b_row}).second);
      ASSERT_LT(t.a_row, m);
      ASSERT_LT(t.b_row, n);
      // K: exactly the expert's padded rows (none for an expert without rows).
      ASSERT_EQ(t.k0, offsets[t.expert]);
      ASSERT_EQ(t.k_blocks * kBlockK, offsets[t.expert + 1] - offsets[t.expert]);
    }
    ASSERT_EQ(int64_t(seen.size()), int64_t(experts) * g.tiles_m * g.tiles_n);
  }
}

TEST(TileSchedule, WeightGradIsZeroWhenTheScheduleOverflowed) {
  const std::vector<int32_t> offsets = {0, 256, 512};
  const TileGrid g{offsets.data(), 2, 1, 1, 256, 0, 384, true};
  for (int32_t tile = 0; tile < tile_count(g); ++tile) EXPECT_EQ(tile_at(g, tile).k_blocks, 0);
  EXPECT_EQ(tile_count(g), 2);  // the tiles still run, to store zeros
}

TEST(TileSchedule, ExpertOfRowSkipsEmptyExperts) {
  const std::vector<int32_t> offsets = {0, 0, 128, 128, 128, 384};
  EXPECT_EQ(expert_of_row(offsets.data(), 5, 0), 1);
  EXPECT_EQ(expert_of_row(offsets.data(), 5, 127), 1);
  EXPECT_EQ(expert_of_row(offsets.data(), 5, 128), 4);
  EXPECT_EQ(expert_of_row(offsets.data(), 5, 383), 4);
}

}  // namespace
}  // namespace lynx::fused
