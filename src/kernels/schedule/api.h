// The schedule builder (docs/design.md, "The schedule"): which routed rows this rank computes, in which
// order. The row-placement rules live in schedule_core.h and compile for host and device; the host
// builder (tests, reference) and the device builder (every forward) produce identical schedules.
//
// Placement rule, for this rank r with local experts e = 0 .. E_loc-1 (global id r*E_loc + e):
//  * Rows are expert-major: expert e's block starts at expert_offset[e]; its length is padded up to a
//    multiple of kTileRows (experts with no rows take no space). expert_offset[E_loc] = total rows.
//  * Inside expert e's block, rows stand in global token order: L_s = the (t, j) pairs of source rank
//    s routed to e, in increasing t*k + j order; row q of L_s goes to position Σ_{s' < s} |L_s'| + q.
//  * block_offset[e] = Σ_{e' < e} tile_blocks(rows of e'): where expert e's row blocks start in the
//    expert GEMM's tiles when it folds tails (schedule_core.h). block_offset[E_loc] = all of them.
//  * half_block_offset[e] = Σ_{e' < e} half_blocks(rows of e'): the experts before e whose last row
//    block holds at most 64 rows (schedule_core.h; the FP8 GEMMs' wide tiles). [E_loc] = all of them.
//  * Padding rows have row_token_slot = row_src_rank = -1.
//  * slot_row[t*k + j] (for this rank's own tokens) is the row of (t, j) if its expert is local to this
//    rank, else -1. With peer_slot_row (R > 1), the rank that computes (t, j) of source s writes its row
//    into peer_slot_row[s][t*k + j] instead, and no rank writes the others.
//  * row_token_slot holds the flat index t*k + j into the source rank's [T, k] ids.
//  * If the padded total exceeds the capacity, nothing is written to the row arrays or slot_row (they
//    keep whatever an earlier build left: consumers must go by the total, expert_offset[E_loc]),
//    expert_offset/expert_rows are still written, and the status reports kCapacityOverflow.
//  * The device builder reads the ids twice: they must not change while a build runs. Its scratch
//    needs no initialisation; status->schedule_arrivals and counted_blocks must be zero (as a workspace
//    starts and as every build leaves them).
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/status.h"
#include "lynx/config.h"

namespace lynx::sched {

struct Problem {
  int32_t num_ranks = 1;   // R
  int32_t rank = 0;        // r
  int64_t tokens = 0;      // T per rank
  int64_t top_k = 0;       // k
  int64_t num_experts = 0; // E (global); E % R == 0
  int64_t capacity = 0;    // rows available in the row arrays

  int64_t local_experts() const { return num_experts / num_ranks; }
};

struct HostSchedule {
  std::vector<int32_t> row_token_slot;  // [capacity]
  std::vector<int32_t> row_src_rank;    // [capacity]
  std::vector<int32_t> expert_offset;   // [E_loc + 1]
  std::vector<int32_t> expert_rows;     // [E_loc]
  std::vector<int32_t> block_offset;    // [E_loc + 1]
  std::vector<int32_t> half_block_offset;  // [E_loc + 1]
  std::vector<int32_t> slot_row;        // [T*k]
};

struct HostResult {
  StatusCode code = StatusCode::kOk;
  int64_t rows_needed = 0;  // padded total (also when it overflows)
};

// topk_ids[s] points to rank s's [T, k] int32 ids (host memory), all assumed in [0, E).
HostResult build_schedule_host(const Problem& p, const int32_t* const* topk_ids, HostSchedule& out);

// Device buffers of one schedule (all device memory).
struct DeviceBuffers {
  int32_t* row_token_slot;  // [capacity]
  int32_t* row_src_rank;    // [capacity]
  int32_t* expert_offset;   // [E_loc + 1]
  int32_t* expert_rows;     // [E_loc]
  int32_t* block_offset;    // [E_loc + 1]
  int32_t* half_block_offset;  // [E_loc + 1]
  int32_t* slot_row;        // [T*k]
  int32_t* scratch;         // [SchedulePlan::scratch_ints()]
  DeviceStatus* status;
  DeviceStatus* stall_report = nullptr;  // host-mapped: where a timed-out wait reports before its trap
  int32_t* const* peer_slot_row = nullptr;  // [R] device: each source rank's slot_row (R > 1), else null
#if LYNX_EXPERIMENTS
  int32_t test_stall_block = -1;         // test hook: a block that never arrives at the first barrier
#endif
};

// The R ranks' ids as device pointers (through the transport's peer table; all local at R = 1).
struct DeviceRouting {
  const int32_t* topk_ids[Limits::kMaxRanks];
};

// This rank's routing as the caller gave it, checked by the builder as it reads it: every id against
// [0, E) and every weight for a finite value (api/routing_check.h). The lowest offending entry is
// reported through the status (kExpertOutOfRange or kNonFiniteWeight; an error already set stays), and
// the ids are copied to int32 (-1 for an id out of range), the copy other ranks and later kernels read.
// Needs status->first_bad_route = UINT64_MAX (as a workspace starts and as every build leaves it).
// NOTES: at R > 1 the other ranks read the int32 copy after the routing exchange, so there the check
// runs before it and the build reads every rank's ids from DeviceRouting (own = null).
struct OwnRouting {
  const void* topk_ids = nullptr;  // [T*k], int32 or int64
  bool ids_int64 = false;
  const float* topk_weights = nullptr;  // [T*k]
  int32_t* ids32 = nullptr;             // [T*k], written
};

constexpr int kLaneEntries = 4;                          // entries one lane places per round
constexpr int kWarpEntries = 32 * kLaneEntries;          // 128: entries of one warp per round
constexpr int kMaxWarps = 16;                            // warps of a block, at most
constexpr int kMinWarps = 4;                             // warps of a block, at least (unless shared memory)
constexpr int kLaneChunks = 8;                           // chunks one lane sums in the column scan
constexpr int kMaxChunks = 32 * kLaneChunks;             // 256: chunks per source a warp can scan

// How the schedule kernel cuts its work into blocks (plan/schedule.h makes it).
struct SchedulePlan {
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

// What the current device lets the schedule kernel use: SMs (the most blocks resident at once) and the
// dynamic shared memory of a block, in int32s. The first call on a device also raises the kernel's
// shared-memory limit: make it before any stream capture (a workspace does).
struct LaunchLimits {
  int32_t sm_count;
  int64_t max_shared_ints;
};
LaunchLimits launch_limits();

// Enqueues the builder on `stream` (one cooperative kernel of `plan`'s grid); no host synchronisation.
// Reports through buffers.status. With `own`, rank p.rank's ids are read from it (and checked) instead
// of `routing`. buffers.scratch holds plan.scratch_ints().
void build_schedule_device(const Problem& p, const SchedulePlan& plan, const DeviceRouting& routing,
                           const DeviceBuffers& buffers, cudaStream_t stream, const OwnRouting* own = nullptr);

// R > 1, before the pass's opening barrier: checks this rank's routing as the builder does (the lowest
// offending entry reported through `status`; ids out of range copied as -1) and copies the ids to
// own.ids32 and the weights to `weights_copy`, both in this rank's shared region. The builds then
// read every rank's ids through DeviceRouting (own = null).
void stage_routing(const OwnRouting& own, float* weights_copy, int64_t entries, int64_t num_experts, int32_t rank,
                   DeviceStatus* status, cudaStream_t stream);

// Load the schedule kernels and the routing copy's into the current context (common/kernel_loading.h
// says why).
void load_schedule_kernels();
void load_stage_routing_kernels();

}  // namespace lynx::sched
