// The host schedule builder against a brute-force statement of the placement rule of schedule.h.
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "common/schedule_routing.h"
#include "kernels/schedule/api.h"
#include "kernels/schedule/core.h"
#include "plan/schedule.h"

namespace lynx::sched {
namespace {

using test::Routing;

// What rank r must compute, stated without schedule_core.h.
struct Expected {
  std::vector<int32_t> expert_rows, expert_offset, block_offset, half_block_offset;
  int64_t total = 0;
  std::vector<std::vector<std::vector<int32_t>>> lists;  // [E_loc][R]: flat indices t*k+j, increasing
  std::vector<int32_t> row_token_slot, row_src_rank, slot_row;  // when it fits
};

Expected expect(const Routing& g, int32_t r, int64_t capacity) {
  const int64_t E_loc = g.E / g.R;
  Expected x;
  x.lists.assign(E_loc, std::vector<std::vector<int32_t>>(g.R));
  for (int32_t s = 0; s < g.R; ++s) {
    for (int64_t i = 0; i < g.T * g.k; ++i) {
      const int32_t id = g.ids[s][i];
      if (id < 0 || id >= g.E || id / E_loc != r) continue;  // another rank's expert, or no expert at all
      x.lists[id % E_loc][s].push_back(int32_t(i));
    }
  }
  for (int64_t e = 0; e < E_loc; ++e) {
    int64_t rows = 0;
    for (auto& l : x.lists[e]) rows += int64_t(l.size());
    int64_t padded = rows;
    while (padded % 128 != 0) ++padded;
    x.expert_rows.push_back(int32_t(rows));
    x.expert_offset.push_back(int32_t(x.total));
    x.block_offset.push_back(x.block_offset.empty() ? 0 : x.block_offset.back());
    x.total += padded;
  }
  x.expert_offset.push_back(int32_t(x.total));
  // The GEMM's row blocks: an expert's 128-row blocks, but a last one with 1-16 rows after a whole
  // block has none of its own.
  x.block_offset.push_back(x.block_offset.empty() ? 0 : x.block_offset.back());
  for (int64_t e = 0; e < E_loc; ++e) {
    const int32_t rows = x.expert_rows[e], tail = rows % 128;
    const int32_t blocks = (rows + 127) / 128 - (rows > 128 && tail >= 1 && tail <= 16 ? 1 : 0);
    x.block_offset[e + 1] = x.block_offset[e] + blocks;
  }
  // The FP8 GEMMs' half blocks: an expert's last block holding 1-64 rows.
  x.half_block_offset.assign(size_t(E_loc) + 1, 0);
  for (int64_t e = 0; e < E_loc; ++e) {
    const int32_t tail = x.expert_rows[e] % 128;
    x.half_block_offset[e + 1] = x.half_block_offset[e] + (tail >= 1 && tail <= 64 ? 1 : 0);
  }

  x.row_token_slot.assign(std::max<int64_t>(capacity, 0), -1);
  x.row_src_rank.assign(std::max<int64_t>(capacity, 0), -1);
  x.slot_row.assign(g.T * g.k, -1);
  if (x.total > capacity) return x;
  // Global token order: source 0's rows, then source 1's, ..., each in t*k + j order.
  for (int64_t e = 0; e < E_loc; ++e) {
    int64_t row = x.expert_offset[e];
    for (int32_t s = 0; s < g.R; ++s) {
      for (const int32_t slot : x.lists[e][s]) {
        x.row_token_slot[row] = slot;
        x.row_src_rank[row] = s;
        if (s == r) x.slot_row[slot] = int32_t(row);
        ++row;
      }
    }
  }
  return x;
}

// First index where two vectors differ, as a message ("" when equal).
std::string first_difference(const std::vector<int32_t>& got, const std::vector<int32_t>& want) {
  if (got.size() != want.size()) return "size " + std::to_string(got.size()) + " != " + std::to_string(want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i]) return "[" + std::to_string(i) + "] = " + std::to_string(got[i]) + ", want " + std::to_string(want[i]);
  }
  return "";
}

// Builds rank r's schedule into `got` and checks every property of schedule.h.
void build_and_check(const Routing& g, int32_t r, int64_t capacity, const std::string& what, HostSchedule& got) {
  SCOPED_TRACE(what + " rank " + std::to_string(r) + " capacity " + std::to_string(capacity));
  const Problem p = g.problem(r, capacity);
  const HostResult res = build_schedule_host(p, g.ptrs.data(), got);
  const Expected want = expect(g, r, capacity);
  const int64_t E_loc = g.E / g.R;

  EXPECT_EQ(res.rows_needed, want.total);
  EXPECT_EQ(res.code, want.total <= capacity ? StatusCode::kOk : StatusCode::kCapacityOverflow);
  EXPECT_EQ(first_difference(got.expert_rows, want.expert_rows), "") << "expert_rows";
  EXPECT_EQ(first_difference(got.expert_offset, want.expert_offset), "") << "expert_offset";
  EXPECT_EQ(first_difference(got.block_offset, want.block_offset), "") << "block_offset";
  EXPECT_EQ(first_difference(got.half_block_offset, want.half_block_offset), "") << "half_block_offset";
  for (int64_t e = 0; e < E_loc && e + 1 < int64_t(got.expert_offset.size()); ++e) {
    EXPECT_EQ(got.expert_offset[e] % 128, 0);
    EXPECT_GE(got.expert_offset[e + 1] - got.expert_offset[e], got.expert_rows[e]);
    EXPECT_LT(got.expert_offset[e + 1] - got.expert_offset[e], got.expert_rows[e] + 128);
  }
  EXPECT_EQ(first_difference(got.row_token_slot, want.row_token_slot), "") << "row_token_slot";
  EXPECT_EQ(first_difference(got.row_src_rank, want.row_src_rank), "") << "row_src_rank";
  EXPECT_EQ(first_difference(got.slot_row, want.slot_row), "") << "slot_row";
  if (res.code != StatusCode::kOk) return;

  // The same facts once more, read off the output: each local (source, slot) exactly once, in its
  // expert's block; padding -1 in both arrays; slot_row inverts the row map for this rank's tokens.
  std::vector<std::vector<int>> seen(g.R, std::vector<int>(g.T * g.k, 0));
  for (int64_t e = 0; e < E_loc; ++e) {
    for (int64_t row = got.expert_offset[e]; row < got.expert_offset[e + 1]; ++row) {
      const int32_t s = got.row_src_rank[row], slot = got.row_token_slot[row];
      const int64_t half_start = (row - got.expert_offset[e]) / core::kHalfRows * core::kHalfRows;
      EXPECT_EQ(core::in_rowless_half(got.row_token_slot.data(), row), half_start >= got.expert_rows[e])
          << "row " << row;
      if (row >= got.expert_offset[e] + got.expert_rows[e]) {
        EXPECT_TRUE(s == -1 && slot == -1) << "padding row " << row;
        // Read by a tile (so zeroed by the gathers): a whole block's second half, or the 16-row
        // group of the expert's last row when its last block ends in the first half.
        const int64_t rows = got.expert_rows[e], in_block = (row - got.expert_offset[e]) % 128;
        const int64_t block_rows = rows - (row - got.expert_offset[e] - in_block);
        const bool read = block_rows > 64 ? in_block < 128 : in_block < (block_rows + 15) / 16 * 16;
        if (half_start < rows) {
          EXPECT_EQ(core::padding_row_read(got.row_token_slot.data(), row), read) << "padding row " << row;
        }
        continue;
      }
      ASSERT_TRUE(s >= 0 && s < g.R && slot >= 0 && slot < g.T * g.k) << "row " << row;
      ++seen[s][slot];
      EXPECT_EQ(g.ids[s][slot], r * E_loc + e) << "row " << row << " sits in the block of another expert";
      if (s == r) {
        EXPECT_EQ(got.slot_row[slot], row);
      }
    }
  }
  for (int32_t s = 0; s < g.R; ++s) {
    for (int64_t i = 0; i < g.T * g.k; ++i) {
      const int32_t id = g.ids[s][i];
      const bool local = id >= 0 && id < g.E && id / E_loc == r;
      ASSERT_EQ(seen[s][i], local ? 1 : 0) << "source " << s << " slot " << i;
    }
  }
  for (int64_t row = want.total; row < capacity; ++row) {
    ASSERT_TRUE(got.row_token_slot[row] == -1 && got.row_src_rank[row] == -1) << "row past the total " << row;
  }
}

// Checks every rank of `g` with the worst-case capacity, and that a second build is identical.
void check_all_ranks(const Routing& g, const std::string& what) {
  for (int32_t r = 0; r < g.R; ++r) {
    HostSchedule a, b;
    build_and_check(g, r, g.worst_case_capacity(), what, a);
    build_schedule_host(g.problem(r, g.worst_case_capacity()), g.ptrs.data(), b);
    EXPECT_TRUE(a.row_token_slot == b.row_token_slot && a.row_src_rank == b.row_src_rank &&
                a.expert_offset == b.expert_offset && a.expert_rows == b.expert_rows &&
                a.block_offset == b.block_offset && a.half_block_offset == b.half_block_offset && a.slot_row == b.slot_row)
        << what << ": two builds differ, rank " << r;
  }
}

TEST(Schedule, SourceMajorPositionCountsTheSourcesBefore) {
  const std::vector<int32_t> n{3, 0, 2, 5};
  EXPECT_EQ(core::source_major_position(0, 0, n.data()), 0);
  EXPECT_EQ(core::source_major_position(2, 0, n.data()), 2);
  EXPECT_EQ(core::source_major_position(0, 2, n.data()), 3);
  EXPECT_EQ(core::source_major_position(1, 2, n.data()), 4);
  EXPECT_EQ(core::source_major_position(4, 3, n.data()), 9);
}

// Invariance in R (docs/expert-parallel.md): the R-rank schedules of a routing, expert by expert, list the
// same rows in the same order as the one-rank schedule of all R ranks' tokens numbered rank-major.
TEST(Schedule, EveryExpertsRowsAreTheOneRankOrderAtEveryR) {
  std::mt19937 rng(11);
  for (const int32_t R : {2, 3, 4, 8, 64}) {
    const int64_t E = R * (1 + int64_t(rng() % 4)), k = 1 + int64_t(rng() % std::min<int64_t>(E, 8));
    const int64_t T = 1 + int64_t(rng() % 300);
    // Duplicate ids within a token included; a quarter of the entries on experts 0 and 1.
    Routing g(R, T, k, E, 5);
    for (auto& ids : g.ids) {
      for (auto& id : ids) id = int32_t(rng() % (rng() % 4 == 0 ? 2 : E));
    }
    // The one-rank problem: every rank's tokens, rank-major.
    Routing one(1, T * R, k, E, 5);
    for (int32_t s = 0; s < R; ++s) std::copy(g.ids[s].begin(), g.ids[s].end(), one.ids[0].begin() + s * T * k);
    HostSchedule whole;
    ASSERT_EQ(build_schedule_host(one.problem(0, one.worst_case_capacity()), one.ptrs.data(), whole).code,
              StatusCode::kOk);
    const int64_t E_loc = E / R;
    for (int32_t r = 0; r < R; ++r) {
      HostSchedule part;
      ASSERT_EQ(build_schedule_host(g.problem(r, g.worst_case_capacity()), g.ptrs.data(), part).code, StatusCode::kOk);
      for (int64_t e = 0; e < E_loc; ++e) {
        const int64_t ge = r * E_loc + e;
        ASSERT_EQ(part.expert_rows[e], whole.expert_rows[ge]) << "R " << R << " expert " << ge;
        for (int32_t q = 0; q < part.expert_rows[e]; ++q) {
          const int64_t pr = part.expert_offset[e] + q, wr = whole.expert_offset[ge] + q;
          ASSERT_EQ(int64_t(part.row_src_rank[pr]) * T * k + part.row_token_slot[pr], whole.row_token_slot[wr])
              << "R " << R << " expert " << ge << " row " << q;
        }
      }
    }
  }
}

TEST(Schedule, CoreRules) {
  EXPECT_EQ(core::local_expert(5, 1, 4), 1);
  EXPECT_EQ(core::local_expert(3, 1, 4), -1);
  EXPECT_EQ(core::local_expert(8, 1, 4), -1);
  EXPECT_EQ(core::local_expert(-1, 0, 4), -1);
  EXPECT_EQ(core::local_expert(INT_MIN, 0, 4), -1);
  EXPECT_EQ(core::local_expert(INT_MAX, 63, 64), -1);
  EXPECT_EQ(core::padded_rows(0), 0);
  EXPECT_EQ(core::padded_rows(1), 128);
  EXPECT_EQ(core::padded_rows(128), 128);
  EXPECT_EQ(core::padded_rows(129), 256);
  EXPECT_TRUE(core::fits_capacity(256, 256));
  EXPECT_FALSE(core::fits_capacity(256, 255));
}

TEST(Schedule, RandomRoutings) {
  for (int32_t R : {1, 2, 4, 8}) {
    check_all_ranks(Routing(R, 300, 8, 64, 100 + R), "T=300 k=8 E=64 R=" + std::to_string(R));
    check_all_ranks(Routing(R, 1000, 2, 16, 200 + R), "T=1000 k=2 E=16 R=" + std::to_string(R));
    check_all_ranks(Routing(R, 129, 4, 128, 300 + R), "T=129 k=4 E=128 R=" + std::to_string(R));
  }
}

TEST(Schedule, UnequalSources) {
  for (int32_t R : {2, 4, 8}) {
    check_all_ranks(Routing(R, 500, 4, 32, 400 + R, /*hot=*/0, /*hot_share=*/70), "hot R=" + std::to_string(R));
  }
}

TEST(Schedule, ExpertsWithNoRows) {
  for (int32_t R : {1, 2, 4, 8}) check_all_ranks(Routing(R, 3, 2, 64, 500 + R), "T=3 E=64 R=" + std::to_string(R));
}

TEST(Schedule, EveryTokenOnOneExpert) {
  for (int32_t R : {1, 2, 4, 8}) {
    for (int64_t k : {1, 4}) {
      const Routing g(R, 333, k, 16, 600 + R, /*hot=*/5, /*hot_share=*/100, /*hot_step=*/0);
      check_all_ranks(g, "one expert k=" + std::to_string(k) + " R=" + std::to_string(R));
    }
  }
}

TEST(Schedule, TopKOne) {
  for (int32_t R : {1, 2, 4, 8}) check_all_ranks(Routing(R, 777, 1, 32, 700 + R), "k=1 R=" + std::to_string(R));
}

TEST(Schedule, OneLocalExpert) {
  for (int32_t R : {1, 2, 4, 8}) check_all_ranks(Routing(R, 200, 1, R, 800 + R), "E=R R=" + std::to_string(R));
  for (int32_t R : {2, 4, 8}) check_all_ranks(Routing(R, 200, 2, R, 850 + R), "E=R k=2 R=" + std::to_string(R));
}

TEST(Schedule, SingleToken) {
  for (int32_t R : {1, 2, 4, 8}) check_all_ranks(Routing(R, 1, 8, 64, 900 + R), "T=1 R=" + std::to_string(R));
}

TEST(Schedule, ManyRanks) { check_all_ranks(Routing(64, 20, 4, 128, 950), "R=64"); }

TEST(Schedule, CapacityExactlyEnough) {
  for (int32_t R : {1, 2, 4, 8}) {
    const Routing g(R, 250, 4, 32, 1000 + R);
    for (int32_t r = 0; r < R; ++r) {
      const int64_t total = expect(g, r, 0).total;
      HostSchedule s;
      EXPECT_EQ(build_schedule_host(g.problem(r, total), g.ptrs.data(), s).code, StatusCode::kOk);
      build_and_check(g, r, total, "exact capacity", s);
    }
  }
}

TEST(Schedule, CapacityOneRowShort) {
  for (int32_t R : {1, 2, 4, 8}) {
    const Routing g(R, 250, 4, 32, 1100 + R);
    for (int32_t r = 0; r < R; ++r) {
      const int64_t total = expect(g, r, 0).total;
      ASSERT_GT(total, 0);
      HostSchedule s;
      const HostResult res = build_schedule_host(g.problem(r, total - 1), g.ptrs.data(), s);
      EXPECT_EQ(res.code, StatusCode::kCapacityOverflow);
      EXPECT_EQ(res.rows_needed, total);
      EXPECT_EQ(s.row_token_slot, std::vector<int32_t>(total - 1, -1));
      EXPECT_EQ(s.row_src_rank, std::vector<int32_t>(total - 1, -1));
      EXPECT_EQ(s.slot_row, std::vector<int32_t>(g.T * g.k, -1));
      build_and_check(g, r, total - 1, "one row short", s);  // expert_offset / expert_rows still right
    }
  }
}

TEST(Schedule, IdsOutsideRangeAreNotLocal) {
  for (int32_t R : {1, 2, 4}) {
    Routing g(R, 100, 4, 16, 1200 + R);
    const int32_t bad[] = {-1, 16, INT_MIN, INT_MAX, 17, -16};
    for (int32_t s = 0; s < R; ++s) {
      for (int64_t i = 0; i < g.T * g.k; i += 7) g.ids[s][i] = bad[(i / 7 + s) % 6];
    }
    g.refresh();
    check_all_ranks(g, "bad ids R=" + std::to_string(R));
  }
}

// Sources with fewer tokens than the others, padded with entries not routed (-1): half of every odd
// source, all but its first token on the last; as any other source's entries that are not local.
TEST(Schedule, SourcesWithFewerTokens) {
  for (int32_t R : {2, 4, 8}) {
    Routing g(R, 64, 4, 32, 1300 + R);
    for (int32_t s = 0; s < R; ++s) {
      const int64_t first = s == R - 1 ? g.k : s % 2 == 1 ? g.T / 2 * g.k : g.T * g.k;
      for (int64_t i = first; i < g.T * g.k; ++i) g.ids[s][i] = -1;
    }
    g.refresh();
    check_all_ranks(g, "fewer tokens R=" + std::to_string(R));
  }
}

// The device builder's plan (plan/schedule.h): every block resident at once, warps within the shared
// memory, every entry in exactly one chunk, whole rounds per chunk.
constexpr int32_t kH200Sms = 132;
constexpr int64_t kH200SharedInts = 232448 / 4;  // cudaDevAttrMaxSharedMemoryPerBlockOptin

TEST(SchedulePlan, TargetShapes) {
  const SchedulePlan qwen3 = plan::make_schedule_plan(8192, 8, 128, 1, kH200Sms, kH200SharedInts);  // 65536 entries
  EXPECT_EQ(qwen3.warps, 4);
  EXPECT_EQ(qwen3.chunk_entries, 512);
  EXPECT_EQ(qwen3.chunks, 128);
  EXPECT_EQ(qwen3.pairs, 128);
  EXPECT_EQ(qwen3.scratch_ints(), 128 * 128 + 128);
  const SchedulePlan deepseek = plan::make_schedule_plan(4096, 8, 256, 1, kH200Sms, kH200SharedInts);
  EXPECT_EQ(deepseek.warps, 4);
  EXPECT_EQ(deepseek.chunks, 64);
  const SchedulePlan sixteen = plan::make_schedule_plan(8192, 8, 128, 1, kH200Sms, kH200SharedInts, kMaxWarps);
  EXPECT_EQ(sixteen.warps, kMaxWarps);
  EXPECT_EQ(sixteen.chunks, 32);
}

TEST(SchedulePlan, ChunksGrowUntilTheGridFits) {
  const SchedulePlan many = plan::make_schedule_plan(65536, 8, 128, 1, kH200Sms, kH200SharedInts);  // 512 Ki entries: 2 rounds of 16 warps
  EXPECT_EQ(many.warps, kMaxWarps);
  EXPECT_EQ(many.chunk_entries, 4096);
  EXPECT_EQ(many.chunks, 128);
  const SchedulePlan p = plan::make_schedule_plan(131072, 8, 4096, 1, kH200Sms, kH200SharedInts);  // 1 Mi entries
  EXPECT_EQ(p.chunk_entries, 8192);
  EXPECT_EQ(p.chunks, 128);
  EXPECT_EQ(p.warps, 8);  // 16 warps' counts of 4096 experts would take 311 KB
  const SchedulePlan ranks = plan::make_schedule_plan(8192, 8, 2, 64, kH200Sms, kH200SharedInts);  // 64 sources share the grid
  EXPECT_EQ(ranks.chunks, 2);
  EXPECT_EQ(ranks.chunk_entries, 32768);
}

TEST(SchedulePlan, Invariants) {
  for (int64_t T : {int64_t(1), int64_t(3), int64_t(129), int64_t(2048), int64_t(8192), int64_t(100000), int64_t(1) << 20}) {
    for (int64_t k : {int64_t(1), int64_t(2), int64_t(8), int64_t(32)}) {
      for (int64_t E_loc : {int64_t(1), int64_t(8), int64_t(128), int64_t(1024), int64_t(4096)}) {
        for (int32_t R : {1, 2, 8, 64}) {
          if (E_loc * R > 4096) continue;  // Limits::kMaxExperts
          for (int32_t sms : {64, 114, 132}) {
            SCOPED_TRACE(std::to_string(T) + " " + std::to_string(k) + " " + std::to_string(E_loc) + " " +
                         std::to_string(R) + " " + std::to_string(sms));
            const SchedulePlan p = plan::make_schedule_plan(T, k, E_loc, R, sms, kH200SharedInts);
            EXPECT_EQ(p.entries, T * k);
            EXPECT_GE(p.chunks, 1);
            EXPECT_LE(p.chunks, kMaxChunks);
            EXPECT_LE(int64_t(p.chunks) * R, sms);
            EXPECT_GE(int64_t(p.chunks) * p.chunk_entries, p.entries);
            EXPECT_LT(int64_t(p.chunks - 1) * p.chunk_entries, p.entries);
            EXPECT_EQ(p.pairs, E_loc * R);
            EXPECT_TRUE(p.warps >= 1 && p.warps <= kMaxWarps && (p.warps & (p.warps - 1)) == 0);
            EXPECT_EQ(p.chunk_entries % (int64_t(p.warps) * kWarpEntries), 0);
            EXPECT_LE(p.shared_ints, kH200SharedInts);
            EXPECT_EQ(p.shared_ints, schedule_shared_ints(E_loc, R, p.warps));
            if (p.warps < kMinWarps) {  // fewer only where more would not fit the shared memory
              EXPECT_GT(schedule_shared_ints(E_loc, R, 2 * p.warps), kH200SharedInts);
            }
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace lynx::sched
