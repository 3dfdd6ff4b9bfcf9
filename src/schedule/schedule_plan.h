// How the device schedule builder (schedule_device.cu) cuts its work into blocks: pure host functions,
// CPU-tested (tests/cpu/test_schedule.cpp).
#pragma once

#include <algorithm>
#include <cstdint>

namespace lynx::sched {

constexpr int kLaneEntries = 4;                          // entries one lane places per round
constexpr int kWarpEntries = 32 * kLaneEntries;          // 128: entries of one warp per round
constexpr int kMaxWarps = 16;                            // warps of a block, at most
constexpr int kMinWarps = 4;                             // warps of a block, at least (unless shared memory)
constexpr int kLaneChunks = 8;                           // chunks one lane sums in the column scan
constexpr int kMaxChunks = 32 * kLaneChunks;             // 256: chunks per source a warp can scan

struct Plan {
  int64_t entries;        // T*k per source
  int64_t chunk_entries;  // entries of one block: a multiple of warps * kWarpEntries
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
// NOTES: a chunk is first one round of the fewest warps (from `min_warps`) whose chunks still fit the
// grid, so that the entries spread over as many SMs as the grid allows; past 16 warps chunks grow by
// rounds. Warps halve again only when the shared memory would not fit: with many local experts
// (E_loc = 4096: 8 warps).
inline Plan make_plan(int64_t tokens, int64_t top_k, int64_t local_experts, int32_t ranks, int32_t max_blocks,
                      int64_t max_shared_ints, int32_t min_warps = kMinWarps) {
  Plan plan{};
  plan.entries = tokens * top_k;
  plan.pairs = static_cast<int32_t>(local_experts * ranks);
  const int64_t block_limit = std::max<int64_t>(1, std::min<int64_t>(max_blocks / std::max(ranks, 1), kMaxChunks));
  auto chunks = [&] { return std::max<int64_t>(1, (plan.entries + plan.chunk_entries - 1) / plan.chunk_entries); };
  plan.warps = std::clamp(min_warps, 1, kMaxWarps);
  plan.chunk_entries = int64_t(plan.warps) * kWarpEntries;
  while (plan.warps < kMaxWarps && chunks() > block_limit) {
    plan.warps *= 2;
    plan.chunk_entries *= 2;
  }
  while (chunks() > block_limit) plan.chunk_entries *= 2;
  plan.chunks = static_cast<int32_t>(chunks());
  while (plan.warps > 1 && schedule_shared_ints(local_experts, ranks, plan.warps) > max_shared_ints) plan.warps /= 2;
  plan.shared_ints = schedule_shared_ints(local_experts, ranks, plan.warps);
  return plan;
}

}  // namespace lynx::sched
