// How the device schedule builder (schedule_device.cu) cuts its work into blocks: pure host functions,
// CPU-tested (tests/cpu/test_schedule.cpp).
#pragma once

#include <algorithm>
#include <cstdint>

namespace lynx::sched {

constexpr int kLaneEntries = 4;                          // entries one lane places per round
constexpr int kWarpEntries = 32 * kLaneEntries;          // 128: entries of one warp per round
constexpr int kMaxWarps = 16;                            // warps of a block
constexpr int kRoundEntries = kMaxWarps * kWarpEntries;  // 2048: the smallest chunk
constexpr int kLaneChunks = 8;                           // chunks one lane sums in the column scan
constexpr int kMaxChunks = 32 * kLaneChunks;             // 256: chunks per source a warp can scan

struct Plan {
  int64_t entries;        // T*k per source
  int64_t chunk_entries;  // entries of one block: a multiple of kRoundEntries
  int32_t chunks;         // C per source, 1 .. kMaxChunks; the grid is (C, R)
  int32_t pairs;          // P = E_loc * R
  int32_t warps;          // W per block: a power of two, 1 .. kMaxWarps
  int64_t shared_ints;    // dynamic shared memory of a block, in int32s

  int64_t scratch_ints() const { return int64_t(chunks) * pairs + pairs; }
};

// Shared memory of a block with `warps` warps: its chunk's running counts (E_loc), the warps' counts of
// a round (W * E_loc), every pair's rows (P) and the padded expert offsets (E_loc + 1).
inline int64_t schedule_shared_ints(int64_t local_experts, int32_t ranks, int32_t warps) {
  return (int64_t(warps) + 2) * local_experts + local_experts * ranks + 1;
}

// `max_blocks`: how many blocks the device runs at once (>= ranks; the kernel waits at grid barriers, so
// every block must be resident). `max_shared_ints`: the most dynamic shared memory a block may ask for.
// NOTES: chunks of 2048 entries (one round of 16 warps) spread a forward's schedule over as many SMs as
// there are chunks; they double only until the grid fits. Warps halve only when the shared memory
// would not fit: with many local experts (E_loc = 4096: 8 warps).
inline Plan make_plan(int64_t tokens, int64_t top_k, int64_t local_experts, int32_t ranks, int32_t max_blocks,
                      int64_t max_shared_ints) {
  Plan plan{};
  plan.entries = tokens * top_k;
  plan.pairs = static_cast<int32_t>(local_experts * ranks);
  const int64_t block_limit = std::max<int64_t>(1, std::min<int64_t>(max_blocks / std::max(ranks, 1), kMaxChunks));
  plan.chunk_entries = kRoundEntries;
  auto chunks = [&] { return std::max<int64_t>(1, (plan.entries + plan.chunk_entries - 1) / plan.chunk_entries); };
  while (chunks() > block_limit) plan.chunk_entries *= 2;
  plan.chunks = static_cast<int32_t>(chunks());
  plan.warps = kMaxWarps;
  while (plan.warps > 1 && schedule_shared_ints(local_experts, ranks, plan.warps) > max_shared_ints) plan.warps /= 2;
  plan.shared_ints = schedule_shared_ints(local_experts, ranks, plan.warps);
  return plan;
}

}  // namespace lynx::sched
