// How the device schedule builder (kernels/schedule/schedule_kernel.cu) cuts its work into blocks: a
// pure host function, CPU-tested (tests/cpu/test_schedule.cpp).
#pragma once

#include <algorithm>
#include <cstdint>

#include "kernels/schedule/api.h"

namespace lynx::plan {

using sched::kMaxChunks;
using sched::kMaxWarps;
using sched::kMinWarps;
using sched::kWarpEntries;
using sched::schedule_shared_ints;
using sched::SchedulePlan;

// `max_blocks`: how many blocks the device runs at once (>= ranks; the kernel waits at grid barriers, so
// every block must be resident). `max_shared_ints`: the most dynamic shared memory a block may ask for.
// NOTES: a chunk is first one round of the fewest warps (from `min_warps`) whose chunks still fit the
// grid, so that the entries spread over as many SMs as the grid allows; past 16 warps chunks grow by
// rounds. Warps halve again only when the shared memory would not fit: with many local experts
// (E_loc = 4096: 8 warps).
inline SchedulePlan make_schedule_plan(int64_t tokens, int64_t top_k, int64_t local_experts, int32_t ranks, int32_t max_blocks,
                      int64_t max_shared_ints, int32_t min_warps = kMinWarps) {
  SchedulePlan plan{};
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

}  // namespace lynx::plan
