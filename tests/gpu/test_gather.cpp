// The row gather (glue::gather_rows, used by both paths for x and dy) against a host gather, bit for
// bit: every source value encodes its token and column, so a row copied from the wrong token or a
// piece placed at the wrong column differs. Widths from one 128-byte row to deepseek-v3's 14336 bytes.
#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "gpu/gpu_test.h"
#include "kernels/glue/api.h"

namespace lynx::test {
namespace {

class GatherRows : public GpuTest, public ::testing::WithParamInterface<int64_t> {};

uint16_t encoded(int64_t token, int64_t column) {
  return static_cast<uint16_t>((token * 7919 + column * 31 + 1) & 0xFFFF);
}

struct Result {
  std::vector<uint16_t> dst;
  std::vector<uint16_t> expected;
};

// Gathers the rows below `total` (about 15% of them padding) into a [capacity + 2, width] buffer
// poisoned with 0xFF bytes: rows at or past `total` must stay poisoned, and every row when `total`
// exceeds the capacity (a schedule over capacity places no rows).
Result gather(int64_t width, int64_t total, int64_t capacity, uint32_t seed) {
  const int64_t tokens = 37, top_k = 3;
  std::mt19937 rng(seed);
  std::vector<uint16_t> src(size_t(tokens * width));
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t c = 0; c < width; ++c) src[size_t(t * width + c)] = encoded(t, c);
  const int64_t rows = capacity + 2;
  std::vector<int32_t> slots(size_t(rows), -1);
  std::uniform_int_distribution<int32_t> slot(0, int32_t(tokens * top_k - 1));
  std::bernoulli_distribution padding(0.15);
  for (int64_t r = 0; r < total && r < rows; ++r) slots[size_t(r)] = padding(rng) ? -1 : slot(rng);

  Result res;
  res.expected.assign(size_t(rows * width), 0xFFFF);
  if (total <= capacity) {
    for (int64_t r = 0; r < total; ++r)
      for (int64_t c = 0; c < width; ++c)
        res.expected[size_t(r * width + c)] = slots[size_t(r)] < 0 ? 0 : encoded(slots[size_t(r)] / top_k, c);
  }
  DeviceBuffer d_src = to_device(src), d_slots = to_device(slots);
  DeviceBuffer d_total = to_device(std::vector<int32_t>{int32_t(total)});
  DeviceBuffer d_dst(size_t(rows * width) * sizeof(uint16_t));
  d_dst.fill_bytes(0xFF);
  glue::gather_rows(d_dst.as<uint16_t>(), d_src.as<uint16_t>(), d_slots.as<int32_t>(), d_total.as<int32_t>(),
                       capacity, top_k, width, nullptr);
  LYNX_TEST_CUDA(cudaGetLastError());
  LYNX_TEST_CUDA(cudaDeviceSynchronize());
  res.dst = to_host<uint16_t>(d_dst, size_t(rows * width));
  return res;
}

void expect_equal(const Result& r, int64_t width) {
  ASSERT_EQ(r.dst.size(), r.expected.size());
  for (size_t i = 0; i < r.dst.size(); ++i) {
    ASSERT_EQ(r.dst[i], r.expected[i]) << "row " << i / size_t(width) << ", column " << i % size_t(width);
  }
}

// Rows below the capacity (about 15% padding), every row of it, none, and one row too many (a schedule
// over capacity places no rows, so nothing may be written).
TEST_P(GatherRows, MatchesHostGather) {
  const int64_t width = GetParam();
  struct Rows {
    int64_t total;
    const char* what;
  };
  for (const Rows& rows : {Rows{173, "173 rows"}, Rows{200, "every row"}, Rows{0, "no rows"}, Rows{201, "over capacity"}}) {
    const uint32_t seed = std::random_device{}();  // fresh slots each run; the trace names the seed
    SCOPED_TRACE(std::string(rows.what) + ", seed " + std::to_string(seed));
    expect_equal(gather(width, rows.total, 200, seed), width);
  }
}

// More rows than one pass of the kernel's grid covers (2112 blocks of 4 rows), so its grid-stride loop
// takes a second pass.
class GatherRowsLong : public GpuTest {};

TEST_F(GatherRowsLong, SecondGridPass) {
  const uint32_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  expect_equal(gather(64, 9000, 9088, seed), 64);
}

// glue::scatter_token_rows, the token-major form: a schedule-like layout of 128-row blocks, each
// with its rows first (none, a few, about half, all), each slot of a local expert on one row, a fifth
// of the slots on no row (another rank's expert). Padding rows that no row GEMM reads (past the
// 16-row group of a block's last row when it ends in the first half, and the halves without rows)
// must stay poisoned, and every row when the schedule is over capacity.
struct Layout {
  std::vector<int32_t> row_token_slot, slot_row;
  std::vector<bool> read;  // a padding row some tile reads: must be zero
  int64_t tokens = 0;
};

Layout make_layout(int64_t blocks, int64_t top_k, std::mt19937& rng) {
  Layout l;
  std::uniform_int_distribution<int> used(0, 128);
  std::vector<int64_t> live;
  l.read.assign(size_t(blocks * 128), false);
  for (int64_t b = 0; b < blocks; ++b) {
    const int n = b == 0 ? 128 : b == 1 ? 0 : b == 2 ? 64 : b == 3 ? 65 : b == 4 ? 16 : used(rng);
    const int zero_to = n == 0 ? 0 : n > 64 ? 128 : (n + 15) / 16 * 16;
    for (int i = 0; i < 128; ++i) {
      if (i < n) live.push_back(b * 128 + i);
      else l.read[size_t(b * 128 + i)] = i < zero_to;
    }
  }
  l.row_token_slot.assign(size_t(blocks * 128), -1);
  l.tokens = (int64_t(live.size()) * 5 / 4 + top_k) / top_k;
  l.slot_row.assign(size_t(l.tokens * top_k), -1);
  std::vector<int32_t> slots(l.slot_row.size());
  for (size_t i = 0; i < slots.size(); ++i) slots[i] = int32_t(i);
  std::shuffle(slots.begin(), slots.end(), rng);
  for (size_t i = 0; i < live.size(); ++i) {
    l.row_token_slot[size_t(live[i])] = slots[i];
    l.slot_row[size_t(slots[i])] = int32_t(live[i]);
  }
  return l;
}

Result scatter(int64_t width, int64_t blocks, bool over_capacity, uint32_t seed) {
  const int64_t top_k = 3, rows = blocks * 128, capacity = over_capacity ? rows - 128 : rows;
  std::mt19937 rng(seed);
  const Layout l = make_layout(blocks, top_k, rng);
  std::vector<uint16_t> src(size_t(l.tokens * width));
  for (int64_t t = 0; t < l.tokens; ++t)
    for (int64_t c = 0; c < width; ++c) src[size_t(t * width + c)] = encoded(t, c);
  Result res;
  res.expected.assign(size_t(rows * width), 0xFFFF);
  for (int64_t r = 0; r < rows && !over_capacity; ++r) {
    const int32_t slot = l.row_token_slot[size_t(r)];
    if (slot < 0 && !l.read[size_t(r)]) continue;  // a padding row no tile reads
    for (int64_t c = 0; c < width; ++c) res.expected[size_t(r * width + c)] = slot < 0 ? 0 : encoded(slot / top_k, c);
  }
  DeviceBuffer d_src = to_device(src), d_slots = to_device(l.row_token_slot), d_slot_row = to_device(l.slot_row);
  DeviceBuffer d_total = to_device(std::vector<int32_t>{int32_t(rows)});
  DeviceBuffer d_dst(size_t(rows * width) * sizeof(uint16_t));
  d_dst.fill_bytes(0xFF);
  glue::scatter_token_rows(d_dst.as<uint16_t>(), d_src.as<uint16_t>(), d_slot_row.as<int32_t>(), d_slots.as<int32_t>(),
                              d_total.as<int32_t>(), capacity, l.tokens, top_k, width, nullptr);
  LYNX_TEST_CUDA(cudaGetLastError());
  LYNX_TEST_CUDA(cudaDeviceSynchronize());
  res.dst = to_host<uint16_t>(d_dst, size_t(rows * width));
  return res;
}

TEST_P(GatherRows, TokenMajorMatchesHostGather) {
  const int64_t width = GetParam();
  for (const bool over : {false, true}) {
    const uint32_t seed = std::random_device{}();
    SCOPED_TRACE(std::string(over ? "over capacity" : "within capacity") + ", seed " + std::to_string(seed));
    expect_equal(scatter(width, 8, over, seed), width);
  }
}

// More tokens than the kernel's token blocks (a second pass of their loop) and more rows than its
// padding blocks cover at once.
TEST_F(GatherRowsLong, TokenMajorSecondPass) {
  const uint32_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  expect_equal(scatter(64, 600, false, seed), 64);
}

// Row bytes 128, 4096, 4224, 10240 and 14336 (widths that are and are not multiples of the block's 256
// vectors of 8).
INSTANTIATE_TEST_SUITE_P(Widths, GatherRows, ::testing::Values(int64_t(64), int64_t(2048), int64_t(2112),
                                                               int64_t(5120), int64_t(7168)));

}  // namespace
}  // namespace lynx::test
