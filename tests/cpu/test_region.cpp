// The shared region's layout (src/comm/region.h): every buffer inside it, aligned, apart from the
// others, sized for the shape, and the peer tables pointing at each rank's copy.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "comm/region.h"
#include "common/status.h"
#include "kernels/peer/api.h"

namespace lynx::comm {
namespace {

struct Span {
  const char* name;
  int64_t at, bytes;
};

std::vector<Span> spans(const RegionLayout& l, const LayerShape& s, int64_t cap, const RegionContents& c) {
  const bool shared = s.num_ranks > 1;
  const int64_t entries = s.tokens * s.top_k;
  std::vector<Span> v = {{"status", l.status, int64_t(sizeof(DeviceStatus))},
                         {"signals", l.signals, int64_t(sizeof(peer::Signals))},
                         {"ids32", l.ids32, shared ? 4 * entries : 0},
                         {"slot_row", l.slot_row, shared || c.slot_row ? 4 * entries : 0},
                         {"weights", l.weights, shared ? 4 * entries : 0},
                         {"d_topk_rows", l.d_topk_rows, shared ? 4 * cap : 0},
                         {"token_rows", l.token_rows, shared ? 2 * s.tokens * s.hidden : 0},
                         {"rows_a", l.rows_a, shared || c.rows ? 2 * cap * s.hidden : 0}};
  if (c.rows_b_apart) v.push_back({"rows_b", l.rows_b, shared || c.rows ? 2 * cap * s.hidden : 0});
  return v;
}

TEST(Region, BuffersAreAlignedDisjointAndInside) {
  for (const int32_t R : {1, 2, 3, 8, 64}) {
    LayerShape s{.tokens = 37, .hidden = 192, .intermediate = 64, .num_experts = 64 * 2, .top_k = 3, .num_ranks = R};
    const int64_t cap = worst_case_schedule_rows(s);
    // Without the per-row results (a scratch allocator: at R = 1 they are scratch then), and without
    // slot_row (a caller's context, which at R = 1 holds it): at R > 1 both stay, the other ranks' to read.
    // rows_b apart from rows_a (the unfused backend), or on them (the fused one).
    for (const bool rows : {true, false}) {
      for (const bool apart : {true, false}) {
        const RegionContents c{.rows = rows, .slot_row = rows, .rows_b_apart = apart};
        const std::string where =
            "at R = " + std::to_string(R) + (rows ? "" : ", rows lent") + (apart ? "" : ", rows_b on rows_a");
        const RegionLayout l = region_layout(s, cap, c);
        std::vector<Span> v = spans(l, s, cap, c);
        std::sort(v.begin(), v.end(), [](const Span& a, const Span& b) { return a.at < b.at; });
        for (size_t i = 0; i < v.size(); ++i) {
          EXPECT_EQ(v[i].at % 1024, 0) << v[i].name << " " << where;
          EXPECT_LE(v[i].at + v[i].bytes, l.bytes) << v[i].name << " " << where;
          if (i + 1 < v.size()) {
            EXPECT_LE(v[i].at + v[i].bytes, v[i + 1].at) << v[i].name << " overlaps " << where;
          }
        }
        if (!apart) {
          EXPECT_EQ(l.rows_b, l.rows_a) << where;
        }
        const int64_t rows_bytes = (R > 1 || rows) ? 2 * cap * s.hidden : 0;
        const RegionContents both_apart{.rows = rows, .slot_row = rows, .rows_b_apart = true};
        if (!apart) {
          EXPECT_LE(l.bytes, region_layout(s, cap, both_apart).bytes - rows_bytes) << where;
        }
        if (!rows && R == 1) {
          EXPECT_LT(l.bytes, 4 * cap * s.hidden) << "the rows are not in the region";
          EXPECT_LE(l.bytes, 2048) << "one rank, caller's context: the status and the signals alone";
        }
        const RegionContents all{.rows = true, .slot_row = true, .rows_b_apart = apart};
        if (R > 1) {
          EXPECT_EQ(l.bytes, region_layout(s, cap, all).bytes) << where << ": rows and slot_row change nothing";
        }
      }
    }
  }
}

// docs/python.md's figure: what a rank keeps at qwen3-30b-a3b shapes, T = 8192 a rank, R = 8, the
// capacity for a load of 2, with lent scratch and a caller's context (the flags change nothing at R > 1),
// for the fused backend (rows_b on rows_a).
TEST(Region, SizeAtEightRanks) {
  LayerShape s{.tokens = 8192, .hidden = 2048, .intermediate = 768, .num_experts = 128, .top_k = 8, .num_ranks = 8};
  const RegionLayout l =
      region_layout(s, schedule_capacity_for_load(s, 2.0), {.rows = false, .slot_row = false, .rows_b_apart = false});
  EXPECT_NEAR(double(l.bytes) / (1 << 20), 553.3, 0.1);  // 1073.3 with rows_b apart
}

TEST(Region, TablesPointAtEveryRanksCopy) {
  LayerShape s{.tokens = 8, .hidden = 64, .intermediate = 64, .num_experts = 4, .top_k = 2, .num_ranks = 4};
  const RegionLayout l = region_layout(s, 1024);
  std::vector<char> memory(size_t(4 * l.bytes));
  std::vector<char*> bases;
  for (int r = 0; r < 4; ++r) bases.push_back(memory.data() + r * l.bytes);
  const std::vector<void*> t = peer_tables(l, bases);
  ASSERT_EQ(t.size(), size_t(kTables * 4));
  const std::pair<Table, int64_t> offsets[] = {{kTokenRows, l.token_rows}, {kWeights, l.weights},
                                               {kSlotRow, l.slot_row},     {kRowsA, l.rows_a},
                                               {kRowsB, l.rows_b},         {kDTopkRows, l.d_topk_rows},
                                               {kSignals, l.signals}};
  for (const auto& [table, offset] : offsets) {
    for (int r = 0; r < 4; ++r) EXPECT_EQ(t[table * 4 + r], bases[r] + offset) << "table " << table << " rank " << r;
  }
}

}  // namespace
}  // namespace lynx::comm
