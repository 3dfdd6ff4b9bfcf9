// The expert GEMM kernel's tile schedule (kernels/expert_gemm/tile_scheduler.h) on random padded
// schedules, and the plan's tiling and gather rules (plan/tiles.h, plan/gather.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <set>
#include <tuple>
#include <vector>

#include "plan/gather.h"
#include "kernels/expert_gemm/tile_scheduler.h"
#include "kernels/schedule/core.h"

namespace lynx::gemm {
namespace {

using namespace lynx::plan;  // the rules: choose_tile_order, gather_token_major, ...

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
                     false, group_rows, trial % 3 == 0};
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

// Row block, column block of each tile in launch order.
std::vector<std::pair<int32_t, int32_t>> raster(const TileGrid& g) {
  std::vector<std::pair<int32_t, int32_t>> order;
  for (int32_t tile = 0; tile < tile_count(g); ++tile) {
    const Tile t = tile_at(g, tile);
    order.push_back({t.a_row / kBlockM, t.b_row / g.block_n});
  }
  return order;
}

TEST(TileSchedule, RasterGroupsStraddleExperts) {
  // Experts of 3 and 5 row blocks, 2 column blocks, groups of 4: {0,1,2,3}, {4,5,6,7}, each column by
  // column; block 3 is the second expert's.
  const std::vector<int32_t> offsets = {0, 384, 1024};
  const TileGrid g{offsets.data(), 2, 8, 2, 128, 4, 1024, false, 4, false};
  const std::vector<std::pair<int32_t, int32_t>> want = {
      {0, 0}, {1, 0}, {2, 0}, {3, 0}, {0, 1}, {1, 1}, {2, 1}, {3, 1},
      {4, 0}, {5, 0}, {6, 0}, {7, 0}, {4, 1}, {5, 1}, {6, 1}, {7, 1}};
  EXPECT_EQ(raster(g), want);
  EXPECT_EQ(tile_at(g, 2).expert, 0);
  EXPECT_EQ(tile_at(g, 3).expert, 1);
}

TEST(TileSchedule, RasterGroupsEndAtExpertBoundaries) {
  // The same experts with expert_groups: {0,1,2}, then {3,4,5,6}, {7}.
  const std::vector<int32_t> offsets = {0, 384, 1024};
  const TileGrid g{offsets.data(), 2, 8, 2, 128, 4, 1024, false, 4, true};
  const std::vector<std::pair<int32_t, int32_t>> want = {
      {0, 0}, {1, 0}, {2, 0}, {0, 1}, {1, 1}, {2, 1},
      {3, 0}, {4, 0}, {5, 0}, {6, 0}, {3, 1}, {4, 1}, {5, 1}, {6, 1},
      {7, 0}, {7, 1}};
  EXPECT_EQ(raster(g), want);
  EXPECT_EQ(tile_at(g, 5).expert, 0);
  EXPECT_EQ(tile_at(g, 6).expert, 1);
}

TEST(TileSchedule, ExpertGroupsSkipEmptyExperts) {
  // Expert 0 has blocks 0-1, expert 1 none, expert 2 blocks 2-4; 2 column blocks, groups of 2:
  // {0,1}, then {2,3} and {4} of expert 2, each column by column.
  const std::vector<int32_t> offsets = {0, 256, 256, 640};
  const TileGrid g{offsets.data(), 3, 5, 2, 256, 4, 640, false, 2, true};
  const std::vector<std::pair<int32_t, int32_t>> want = {{0, 0}, {1, 0}, {0, 1}, {1, 1}, {2, 0},
                                                         {3, 0}, {2, 1}, {3, 1}, {4, 0}, {4, 1}};
  EXPECT_EQ(raster(g), want);
  EXPECT_EQ(tile_at(g, 3).expert, 0);
  EXPECT_EQ(tile_at(g, 4).expert, 2);
}

TEST(TileSchedule, RowModesCountTheRowsThatAreNotPadding) {
  // Experts of 200, 0, 64 and 129 rows, padded to 256, 0, 128 and 256: row blocks 0-4 hold 128, 72,
  // 64, 128 and 1 rows. Every tile of a block says so, in both rasters (2 column blocks, groups of 2,
  // so the two orders differ); without expert_rows every tile counts as full.
  const std::vector<int32_t> offsets = {0, 256, 256, 384, 640}, rows = {200, 0, 64, 129};
  const std::vector<int32_t> block_rows = {128, 72, 64, 128, 1};
  for (const bool expert_groups : {false, true}) {
    TileGrid g{offsets.data(), 4, 5, 2, 256, 4, 640, false, 2, expert_groups};
    ASSERT_EQ(tile_count(g), 10);
    for (int32_t tile = 0; tile < tile_count(g); ++tile) EXPECT_EQ(tile_at(g, tile).rows, kBlockM);
    g.expert_rows = rows.data();
    for (int32_t tile = 0; tile < tile_count(g); ++tile) {
      const Tile t = tile_at(g, tile);
      EXPECT_EQ(t.rows, block_rows[t.a_row / kBlockM]) << "tile " << tile << (expert_groups ? ", expert groups" : "");
    }
  }
}

// The schedule's tables for per-expert row counts: padded offsets, and the tiles' row blocks when
// tails are folded (schedule_core.h).
struct Tables {
  std::vector<int32_t> rows, offsets, blocks;
};
Tables tables_of(const std::vector<int32_t>& rows) {
  Tables x{rows, {0}, {0}};
  for (const int32_t n : rows) {
    x.offsets.push_back(x.offsets.back() + int32_t(sched::core::padded_rows(n)));
    x.blocks.push_back(x.blocks.back() + int32_t(sched::core::tile_blocks(n)));
  }
  return x;
}

// With folded tails every row of every expert is computed once per column block: by a tile's own
// rows or as the tail it folds, 1 .. kFoldRows rows right after its whole block; no tile starts at
// a folded tail.
TEST(TileSchedule, FoldedTailsCoverEveryRowOnce) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 60; ++trial) {
    const int32_t experts = 1 + rng() % 40, block_n = trial % 2 ? 256 : 128, n = block_n * (1 + rng() % 6);
    std::vector<int32_t> rows(experts);
    for (int32_t& r : rows) {
      const int32_t kind = rng() % 4;  // near a whole block: some tails fold, some do not
      r = kind == 0 ? 0 : kind == 1 ? int32_t(rng() % 600) : int32_t(128 * (1 + rng() % 3) + rng() % 20);
    }
    const Tables x = tables_of(rows);
    const int32_t capacity = x.offsets.back();
    const int32_t group_rows = std::vector<int32_t>{1, 2, 3, 4, 16}[trial % 5];
    TileGrid g{x.offsets.data(), experts, capacity / kBlockM, n / block_n, block_n, 12, capacity,
               false, group_rows, trial % 3 == 0};
    g.expert_rows = x.rows.data();
    g.block_offset = x.blocks.data();
    ASSERT_EQ(tile_count(g), x.blocks.back() * g.tiles_n);
    std::vector<int32_t> covered(size_t(capacity) * g.tiles_n, 0);
    for (int32_t tile = 0; tile < tile_count(g); ++tile) {
      const Tile t = tile_at(g, tile);
      const int32_t e = t.expert, begin = x.offsets[e], in_block = t.a_row - begin;
      ASSERT_EQ(in_block % kBlockM, 0) << "tile " << tile;
      ASSERT_GE(in_block, 0);
      ASSERT_LT(in_block, x.rows[e]) << "tile " << tile << " starts past its expert's rows";
      ASSERT_EQ(t.rows, std::min(kBlockM, x.rows[e] - in_block));
      ASSERT_GE(t.fold, 0);
      ASSERT_LE(t.fold, kFoldRows);
      if (t.fold > 0) {
        ASSERT_EQ(t.rows, kBlockM);
        ASSERT_EQ(in_block + kBlockM + t.fold, x.rows[e]) << "the fold is the expert's last rows";
      }
      const int32_t col = t.b_row / block_n;
      for (int32_t r = 0; r < t.rows + t.fold; ++r) ++covered[size_t(t.a_row + r) * g.tiles_n + col];
    }
    for (int32_t e = 0; e < experts; ++e) {
      for (int32_t r = x.offsets[e]; r < x.offsets[e + 1]; ++r) {
        for (int32_t col = 0; col < g.tiles_n; ++col) {
          ASSERT_EQ(covered[size_t(r) * g.tiles_n + col], r < x.offsets[e] + x.rows[e] ? 1 : 0)
              << "expert " << e << " (" << x.rows[e] << " rows), row " << r - x.offsets[e] << ", column block " << col;
        }
      }
    }
  }
}

TEST(TileSchedule, TailsOfOneToSixteenRowsBehindAWholeBlockFold) {
  EXPECT_EQ(sched::core::folded_tail_rows(129), 1);
  EXPECT_EQ(sched::core::folded_tail_rows(136), 8);
  EXPECT_EQ(sched::core::folded_tail_rows(144), 16);
  EXPECT_EQ(sched::core::folded_tail_rows(145), 0);
  EXPECT_EQ(sched::core::folded_tail_rows(128), 0);
  EXPECT_EQ(sched::core::folded_tail_rows(16), 0);  // no whole block before it
  EXPECT_EQ(sched::core::folded_tail_rows(512 + 3), 3);
  EXPECT_EQ(sched::core::tile_blocks(0), 0);
  EXPECT_EQ(sched::core::tile_blocks(16), 1);
  EXPECT_EQ(sched::core::tile_blocks(128), 1);
  EXPECT_EQ(sched::core::tile_blocks(130), 1);
  EXPECT_EQ(sched::core::tile_blocks(144), 1);
  EXPECT_EQ(sched::core::tile_blocks(145), 2);
  EXPECT_EQ(sched::core::tile_blocks(515), 4);
}

// A warpgroup swaps its operands when it holds 1 to 16 of the tile's rows: warpgroup 0 of a block
// with 1-16 rows (a half tile, whose warpgroup 1 holds none), warpgroup 1 of a block with 65-80.
TEST(TileSchedule, SwappedProductsForWarpgroupsWithOneToSixteenRows) {
  for (int32_t rows = 1; rows <= kBlockM; ++rows) {
    Tile t{};
    t.rows = rows;
    EXPECT_EQ(swapped_products(t, 0), rows <= 16) << rows << " rows";
    EXPECT_EQ(swapped_products(t, 1), rows >= 65 && rows <= 80) << rows << " rows";
    EXPECT_FALSE(half_tile(t) && swapped_products(t, 1)) << rows << " rows";
  }
}

TEST(TileSchedule, TileOrderByRowBlocksPerExpert) {
  // deepseek-v3: 128 rows per expert on average: in order, groups end at experts.
  const TileOrder deepseek = choose_tile_order(4096 * 8, 256, false);
  EXPECT_TRUE(deepseek.in_order);
  EXPECT_TRUE(deepseek.expert_groups);
  EXPECT_EQ(deepseek.group_rows, 16);
  // mixtral-8x7b (2048 rows per expert: 16 blocks) and more: in order, groups of 16 ending at experts.
  for (const auto& [rows, experts] : std::vector<std::pair<int64_t, int64_t>>{{8192 * 2, 8}, {int64_t(1) << 30, 1}}) {
    const TileOrder o = choose_tile_order(rows, experts, false);
    EXPECT_TRUE(o.in_order) << rows << " rows, " << experts << " experts";
    EXPECT_TRUE(o.expert_groups);
    EXPECT_EQ(o.group_rows, 16);
  }
  // qwen3-30b-a3b (512 rows per expert), olmoe-1b-7b (1024), and 2 to 15 blocks: static round robin,
  // groups of the power of two within an expert's average blocks, straddling experts.
  for (const auto& [rows, experts, g] : std::vector<std::tuple<int64_t, int64_t, int32_t>>{
           {8192 * 8, 128, 4}, {8192 * 8, 64, 8}, {15 * 128, 1, 8}, {256, 1, 2}, {768, 1, 4}}) {
    const TileOrder o = choose_tile_order(rows, experts, false);
    EXPECT_FALSE(o.in_order) << rows << " rows, " << experts << " experts";
    EXPECT_FALSE(o.expert_groups);
    EXPECT_EQ(o.group_rows, g) << rows << " rows, " << experts << " experts";
  }
  EXPECT_TRUE(choose_tile_order(255, 1, false).in_order);  // under two blocks
  EXPECT_TRUE(choose_tile_order(100, 8, false).in_order);
  EXPECT_TRUE(choose_tile_order(0, 0, false).in_order);
  // A launch that gathers its rows: in order, groups of 16 ending at experts, at every size.
  for (const auto& [rows, experts] : std::vector<std::pair<int64_t, int64_t>>{
           {8192 * 8, 128}, {8192 * 8, 64}, {4096 * 8, 256}, {8192 * 2, 8}, {256, 1}, {0, 0}}) {
    const TileOrder o = choose_tile_order(rows, experts, true);
    EXPECT_TRUE(o.in_order) << rows << " rows, " << experts << " experts";
    EXPECT_TRUE(o.expert_groups);
    EXPECT_EQ(o.group_rows, 16);
  }
  EXPECT_EQ(static_tiles(1).group_rows, 1);
}

// Unit u of a cluster: tiles 2u and 2u + 1. What shared_operand says they share must be the same
// bytes: B the same weight rows of the same expert, A the same schedule rows, over the same K.
TEST(TileSchedule, ClusterUnitsShareOnlyWhatIsTheSame) {
  std::mt19937 rng(13);
  int64_t shared_a = 0, shared_b = 0;
  for (int trial = 0; trial < 50; ++trial) {
    const int32_t experts = 1 + rng() % 40, n = 64 * (1 + rng() % 40), block_n = trial % 2 ? 256 : 128;
    const std::vector<int32_t> offsets = random_offsets(rng, experts, 700);
    const int32_t group_rows = std::vector<int32_t>{1, 2, 3, 4, 16}[trial % 5];
    const TileGrid g{offsets.data(), experts, offsets[experts] / kBlockM, (n + block_n - 1) / block_n, block_n, 12,
                     offsets[experts], false, group_rows, trial % 3 == 0};
    for (int32_t tile = 0; tile + 1 < tile_count(g); tile += kClusterTiles) {
      const Tile t0 = tile_at(g, tile), t1 = tile_at(g, tile + 1);
      switch (shared_operand(t0, t1)) {
        case Shared::kB:
          ASSERT_EQ(t0.expert, t1.expert);
          ASSERT_EQ(t0.b_row, t1.b_row);
          ASSERT_NE(t0.a_row, t1.a_row);
          ++shared_b;
          break;
        case Shared::kA:
          ASSERT_EQ(t0.a_row, t1.a_row);
          ASSERT_EQ(t0.expert, t1.expert);
          ASSERT_NE(t0.b_row, t1.b_row);
          ++shared_a;
          break;
        case Shared::kNone:
          ASSERT_TRUE(t0.expert != t1.expert || (t0.a_row != t1.a_row && t0.b_row != t1.b_row));
          break;
      }
      ASSERT_EQ(t0.k_blocks, t1.k_blocks);
    }
  }
  EXPECT_GT(shared_a, 0);
  EXPECT_GT(shared_b, 0);
}

// deepseek-v3's rasters (1-2 row blocks per expert, in order, groups ending at experts): every unit
// shares an operand, the weight tile when the expert has two row blocks, else the row block. (The
// static raster of qwen3-30b-a3b straddles experts: a unit across an expert boundary shares nothing,
// ~22% of them.)
TEST(TileSchedule, ClusterUnitsOfDeepseekAllShare) {
  std::mt19937 rng(17);
  std::binomial_distribution<int32_t> rows(4096 * 8, 1.0 / 256);
  for (const int32_t n : {2048, 7168}) {
    const int32_t experts = 256, block_n = n == 2048 ? 128 : 256;
    const TileOrder order = choose_tile_order(4096 * 8, experts, false);
    std::vector<int32_t> counts(experts);
    for (int32_t& c : counts) c = rows(rng);
    const Tables x = tables_of(counts);
    for (const bool fold : {false, true}) {
      TileGrid g{x.offsets.data(), experts, x.offsets[experts] / kBlockM, n / block_n, block_n, 32,
                 x.offsets[experts], false, order.group_rows, order.expert_groups};
      g.expert_rows = x.rows.data();
      if (fold) g.block_offset = x.blocks.data();
      for (int32_t tile = 0; tile + 1 < tile_count(g); tile += kClusterTiles) {
        const Tile t0 = tile_at(g, tile), t1 = tile_at(g, tile + 1);
        const int32_t blocks = fold ? x.blocks[t0.expert + 1] - x.blocks[t0.expert]
                                    : (x.offsets[t0.expert + 1] - x.offsets[t0.expert]) / kBlockM;
        ASSERT_EQ(shared_operand(t0, t1), blocks > 1 ? Shared::kB : Shared::kA)
            << "n " << n << ", tile " << tile << (fold ? ", folded tails" : "");
        if (shared_operand(t0, t1) == Shared::kA) {
          ASSERT_EQ(t0.fold, t1.fold);
        }
      }
    }
  }
}

TEST(TileSchedule, ClusterUnitsForALongK) {
  // deepseek-v3: gate/up (K = H = 7168) and the backward's dgrads (K = 7168, K = 2I = 4096) pair,
  // down (K = I = 2048) does not; mixtral-8x7b (K = 4096, 14336, 28672) pairs; qwen3-30b-a3b and
  // olmoe-1b-7b (K <= 2048) never.
  for (const int64_t k : {7168, 4096, 14336, 28672}) EXPECT_TRUE(use_cluster_units(k)) << k;
  for (const int64_t k : {2048, 1536, 1024, 768, 64}) EXPECT_FALSE(use_cluster_units(k)) << k;
  EXPECT_TRUE(use_cluster_units(kClusterFromKBlocks * kBlockK));
  EXPECT_FALSE(use_cluster_units(kClusterFromKBlocks * kBlockK - kBlockK));
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
      if (t.k_blocks > 0) {
        ASSERT_EQ(last_k_steps(t), kBlockK / kStepK);  // without the rows: every step
      }
    }
    ASSERT_EQ(int64_t(seen.size()), int64_t(experts) * g.tiles_m * g.tiles_n);
  }
}

// With the rows per expert: K ends with the last 64-row block that holds rows, and within that block
// with the last 16-row wgmma step that holds rows.
TEST(TileSchedule, WeightGradStopsAtTheLastBlockWithRows) {
  const std::vector<int32_t> offsets = {0, 256, 256, 384, 512, 640, 768, 896};
  const std::vector<int32_t> rows = {129, 0, 64, 65, 100, 112, 84};
  TileGrid g{offsets.data(), 7, 1, 1, 256, 0, 896, true};
  g.expert_rows = rows.data();
  const int32_t expected_blocks[] = {3, 0, 1, 2, 2, 2, 2};
  const int32_t expected_steps[] = {1, 0, 4, 1, 3, 3, 2};
  for (int32_t tile = 0; tile < tile_count(g); ++tile) {
    const Tile t = tile_at(g, tile);
    EXPECT_EQ(t.k0, offsets[t.expert]);
    EXPECT_EQ(t.k_blocks, expected_blocks[t.expert]) << "expert " << t.expert;
    if (t.k_blocks > 0) {
      EXPECT_EQ(last_k_steps(t), expected_steps[t.expert]) << "expert " << t.expert;
    }
  }
}

TEST(TileSchedule, WeightGradIsZeroWhenTheScheduleOverflowed) {
  const std::vector<int32_t> offsets = {0, 256, 512};
  const TileGrid g{offsets.data(), 2, 1, 1, 256, 0, 384, true};
  for (int32_t tile = 0; tile < tile_count(g); ++tile) EXPECT_EQ(tile_at(g, tile).k_blocks, 0);
  EXPECT_EQ(tile_count(g), 2);  // the tiles still run, to store zeros
}

// Where the fused launches gather their rows (plan/gather.h): token-major before the launch
// where it streams its weights and the token rows fill the L2, or where each row feeds too few columns.
TEST(KernelGatherPlan, TokenMajorWhereTheRuleSays) {
  const int64_t l2 = int64_t(60) << 20;  // the H200's
  struct Launch {
    const char* what;
    int64_t tokens, hidden, experts, top_k, products;
    bool token_major;
  };
  const Launch launches[] = {
      {"deepseek-v3 gate/up", 4096, 7168, 256, 8, 2 * 2048, true},
      {"deepseek-v3 da", 4096, 7168, 256, 8, 2048, true},
      {"qwen3-30b-a3b gate/up", 8192, 2048, 128, 8, 2 * 768, false},
      {"qwen3-30b-a3b da", 8192, 2048, 128, 8, 768, true},
      {"olmoe-1b-7b gate/up", 8192, 2048, 64, 8, 2 * 1024, false},
      {"olmoe-1b-7b da", 8192, 2048, 64, 8, 1024, false},
      {"mixtral-8x7b gate/up", 8192, 4096, 8, 2, 2 * 14336, false},
      {"mixtral-8x7b da", 8192, 4096, 8, 2, 14336, false},
      // deepseek-v3's experts with a quarter of its tokens: the rows fit in the L2 beside the stream
      {"deepseek-v3, 1024 tokens", 1024, 7168, 64, 8, 2 * 2048, false},
  };
  for (const Launch& l : launches) {
    EXPECT_EQ(gather_token_major(l.tokens * l.top_k, l.experts, l.tokens, l.hidden, l.products, l2), l.token_major)
        << l.what;
  }
  // The column threshold on its own, and the L2 bound at exactly half of it.
  EXPECT_TRUE(gather_token_major(8192 * 8, 128, 8192, 2048, kInGemmGatherMinProducts - 1, l2));
  EXPECT_FALSE(gather_token_major(8192 * 8, 128, 8192, 2048, kInGemmGatherMinProducts, l2));
  EXPECT_FALSE(gather_token_major(128, 1, 1, l2 / 4, 4096, l2));     // rows = half the L2: not more
  EXPECT_TRUE(gather_token_major(128, 1, 1, l2 / 4 + 1, 4096, l2));  // a byte more
  EXPECT_FALSE(gather_token_major(256, 1, 1, l2, 4096, l2));         // two blocks per expert: not streaming
}

// The in-kernel gather's lookahead (plan/gather.h): about 24 MB of rows, never under 8 blocks.
TEST(KernelGatherPlan, LookaheadIsAboutHalfTheL2InRowBlocks) {
  EXPECT_EQ(gather_lookahead_blocks(2048), 48);  // qwen3-30b-a3b, olmoe-1b-7b: 512 KB blocks
  EXPECT_EQ(gather_lookahead_blocks(4096), 24);  // mixtral-8x7b
  EXPECT_EQ(gather_lookahead_blocks(7168), 13);  // deepseek-v3: 1.75 MB blocks
  EXPECT_EQ(gather_lookahead_blocks(64), kGatherAheadBytes / (kBlockM * 64 * 2));
  EXPECT_EQ(gather_lookahead_blocks(1 << 20), kGatherMinAheadBlocks);  // huge rows: the floor
  EXPECT_EQ(gather_lookahead_blocks(0), kGatherMinAheadBlocks);
  for (int64_t k = 64; k <= 65536; k += 64) {
    const int32_t blocks = gather_lookahead_blocks(k);
    EXPECT_GE(blocks, kGatherMinAheadBlocks);
    if (blocks > kGatherMinAheadBlocks) {
      EXPECT_LE(int64_t(blocks) * kBlockM * k * 2, kGatherAheadBytes) << k;
    }
  }
}

TEST(KernelGatherPlan, SyncHoldsACounterPerRowBlock) {
  EXPECT_EQ(gather_sync_ints(0), kGatherSyncHeader);
  EXPECT_EQ(gather_sync_ints(128 * 37), kGatherSyncHeader + 37);
}

TEST(TileSchedule, ExpertOfRowSkipsEmptyExperts) {
  const std::vector<int32_t> offsets = {0, 0, 128, 128, 128, 384};
  EXPECT_EQ(expert_of_row(offsets.data(), 5, 0), 1);
  EXPECT_EQ(expert_of_row(offsets.data(), 5, 127), 1);
  EXPECT_EQ(expert_of_row(offsets.data(), 5, 128), 4);
  EXPECT_EQ(expert_of_row(offsets.data(), 5, 383), 4);
}

}  // namespace
}  // namespace lynx::gemm
