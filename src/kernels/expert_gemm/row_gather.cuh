// The expert GEMM's in-kernel gather: warps 1-3 of the producer warpgroup copy the token rows of x
// into schedule order (A) while the GEMM runs, and the producer thread waits, per tile, until the
// rows of its tile's row block are all there.
// NOTES: why in the kernel. The separate gather kernel wrote the whole gathered copy (285 MB at
// qwen3-30b-a3b) at ~2 TB/s before the GEMM could start: 0.14 ms of the forward, on every SM.
// Here the copies run on warps the producer warpgroup leaves idle, a few row blocks ahead of the
// tiles being computed, so the GEMM reads each block from L2 shortly after it was written. Row
// granularity (a claim per four rows, a count per 128-row block) keeps the start short: the first
// wave's blocks are copied by every SM's gather warps at once.
#pragma once

#include <vector_types.h>

#include <cstdint>

#include "common/peers.h"
#include "common/status.h"
#include "device/last_block.cuh"
#include "device/remote.cuh"
#include "device/sm90.cuh"
#include "kernels/expert_gemm/api.h"
#include "kernels/expert_gemm/tile_scheduler.h"
#include "kernels/schedule/core.h"

namespace lynx::gemm {

struct RowGather {
  const uint4* src;               // [tokens, vecs] the token rows (null: no gather, A is in place)
  uint4* dst;                     // [capacity, vecs] A, or rows for a later launch (awaited false)
  const int32_t* row_token_slot;  // [capacity] t·k + j of each schedule row, -1 for padding
  int32_t top_k;
  int32_t vecs;                   // 16-byte vectors per row (K / 8)
  int32_t lookahead;              // row blocks it may run ahead (plan/gather.h)
  int32_t* sync;                  // [gather_sync_ints(capacity)] (api.h)
  bool awaited;                   // dst is A: each tile waits until its row block is copied
#if LYNX_EXPERIMENTS
  int32_t stall_block = -1;       // test hook: this row block is claimed but never copied (-1: off)
#endif
};

// The gather claims rows four at a time up to the schedule's total, a multiple of the padding unit.
static_assert(kTileRows == kBlockM, "experts are padded to whole GEMM row blocks");
// Rows in a 64-row half without rows are not written: no K block may reach into one.
static_assert(sched::core::kHalfRows % kBlockK == 0, "K blocks stay within 64-row halves");
// How long a gather warp pauses for the tiles to catch up before it copies anyway.
constexpr uint64_t kGatherPauseNs = 1'000'000;

// One gather warp: claims schedule rows kGatherRowsPerClaim at a time and copies them (zeros for a
// padding row), then counts them in their row block's counter with a release. Rows past the
// schedule's total are not claimed; a schedule over capacity (no rows placed) copies nothing.
// kRemote (R > 1): row r is read from its source rank's token rows, sources.base[row_src_rank[r]],
// instead of g.src. NOTES: a kernel of its own, not a branch: reading through the rank table in the
// one-rank kernels cost them 4-6% (ptxas moved the consumers' wgmma waits; docs/expert-parallel.md).
// NOTES: a claim of one row cost a claim, a slot lookup and a release fence per 4 KB (qwen3), about
// 1.2 GB/s per warp: ~0.5 TB/s from the 396 gather warps, barely above what gate/up reads (~0.36 TB/s
// at qwen3). Four rows per claim share those round trips. The total is a multiple of kBlockM (every
// expert's block is padded), so a claim never straddles it or a row block.
constexpr int32_t kGatherRowsPerClaim = 4;
constexpr int kGatherVecsPerLane = 8;  // 16-byte loads in flight per lane
static_assert(sched::core::kHalfRows % kGatherRowsPerClaim == 0 && kGatherRowsPerClaim <= 32,
              "claims stay in one 64-row half");

// kVecsPerLane: fewer loads in flight for a kernel whose producer warpgroup has fewer registers (the
// FP8 GEMM's 40). kZeroRowlessHalves: a half without rows is written as zeros too (the FP8 GEMM reads
// every row of its tiles, and its rows go on to the quantisations of the weight gradients).
template <bool kRemote, int kVecsPerLane = kGatherVecsPerLane, bool kZeroRowlessHalves = false>
__device__ __forceinline__ void gather_rows_warp(const RowGather& g, const TileGrid& grid, const RowSources& sources) {
  const int lane = threadIdx.x % 32;
  const int32_t total = grid.expert_offset[grid.experts];
  if (total > grid.capacity) return;
  for (;;) {
    int32_t first = 0;
    if (lane == 0) first = atomicAdd(&g.sync[kGatherRowTicket], kGatherRowsPerClaim);
    first = __shfl_sync(0xffffffffu, first, 0);
    if (first >= total) return;
    const int32_t block = first / kBlockM;
    if (block > g.lookahead) {
      // NOTES: a throttle, not a dependency: the warp pauses while its block is more than `lookahead`
      // past the furthest block a producer has begun, for kGatherPauseNs at most. A producer announces
      // its block before it waits for it, so no producer waits behind the throttle; but the gather
      // warps of CTAs whose tiles are done must still finish copying for CTAs that have not started
      // (a grid not all resident at once, say beside another kernel), so the pause gives up instead of
      // waiting for them.
      int32_t frontier;
      if (lane == 0) sm90::poll_counter<false>(&g.sync[kGatherFrontier], block - g.lookahead, 256, kGatherPauseNs, frontier);
      __syncwarp();
    }
#if LYNX_EXPERIMENTS
    if (block == g.stall_block) continue;
#endif
    // A half without rows (sched::core::in_rowless_half): its rows are counted, not written.
    const bool dead_half = !kZeroRowlessHalves && sched::core::in_rowless_half(g.row_token_slot, first);
    const int32_t lane_slot = lane < kGatherRowsPerClaim ? g.row_token_slot[first + lane] : -1;
    // kRemote: lane i < kGatherRowsPerClaim finds row first + i in its source rank's token rows, and
    // the warp takes each row's address from its lane (fewer live registers in the copy loop).
    unsigned long long lane_from = 0;
    if constexpr (kRemote) {
      if (lane_slot >= 0) {
        const uint4* base = static_cast<const uint4*>(sources.base[sources.row_src_rank[first + lane]]);
        lane_from = reinterpret_cast<unsigned long long>(base + int64_t(lane_slot / g.top_k) * g.vecs);
      }
    }
    for (int32_t i = 0; i < (dead_half ? 0 : kGatherRowsPerClaim); ++i) {
      const uint4* from;
      if constexpr (kRemote) {
        from = reinterpret_cast<const uint4*>(__shfl_sync(0xffffffffu, lane_from, i));
      } else {
        const int32_t slot = __shfl_sync(0xffffffffu, lane_slot, i);
        from = slot >= 0 ? g.src + int64_t(slot / g.top_k) * g.vecs : nullptr;
      }
      uint4* to = g.dst + int64_t(first + i) * g.vecs;
      // kVecsPerLane loads of the row in flight per lane, then their stores.
      const auto copy = [&](int32_t v0) {
        uint4 val[kVecsPerLane];
#pragma unroll
        for (int u = 0; u < kVecsPerLane; ++u) {
          const int32_t v = v0 + u * 32 + lane;
          if constexpr (kRemote) {
            val[u] = from && v < g.vecs ? remote::load_nc(from + v) : make_uint4(0, 0, 0, 0);
          } else {
            val[u] = from && v < g.vecs ? __ldg(from + v) : make_uint4(0, 0, 0, 0);
          }
        }
#pragma unroll
        for (int u = 0; u < kVecsPerLane; ++u) {
          const int32_t v = v0 + u * 32 + lane;
          if (v < g.vecs) to[v] = val[u];
        }
      };
      // NOTES: with fewer loads a lane (the FP8 kernel's), ptxas unrolled this loop by two and paired
      // each load with its store, one load in flight a lane; not unrolled, the loads go out together.
      if constexpr (kVecsPerLane == kGatherVecsPerLane) {
        for (int32_t v0 = 0; v0 < g.vecs; v0 += 32 * kVecsPerLane) copy(v0);
      } else {
#pragma unroll 1
        for (int32_t v0 = 0; v0 < g.vecs; v0 += 32 * kVecsPerLane) copy(v0);
      }
    }
    // The rows' writes, by every lane, before the count: the producer reads them with TMA. NOTES: the
    // count's release by lane 0 covers the other lanes' stores through __syncwarp's memory ordering
    // (the CUDA guide's; bar.warp.sync is not among the PTX model's synchronising operations), as in
    // the usual warp-then-lane-0 release.
    sm90::fence_proxy_async_global();
    __syncwarp();
    if (lane == 0) sm90::red_release_add(&g.sync[kGatherSyncHeader + block], kGatherRowsPerClaim);
  }
}

// The producer, before it loads tile `tile` (row block `block`): announces the block to the gather's
// throttle, then waits until the block's rows are all copied.
__device__ __forceinline__ void await_gathered_rows(const RowGather& g, int32_t block, int32_t tile,
                                                    DeviceStatus* report) {
  sm90::red_relaxed_max(&g.sync[kGatherFrontier], block);
  sm90::wait_counter(&g.sync[kGatherSyncHeader + block], kBlockM, 32, report, sm90::Wait::kRowsGathered, tile);
  sm90::fence_proxy_async_global();
}

// Every thread of every CTA, each past its last use of the counters: the last CTA to finish zeroes
// them for the next launch on the stream: the header and the row blocks up to the schedule's total (no
// launch touches a block past it; none when the schedule is over capacity).
// NOTES: the counters were zeroed by a memset before each launch, one of the launches the host queues
// before the first GEMM can start (the GPU waits for it in an eager forward).
__device__ __forceinline__ void finish_gather(const RowGather& g, const TileGrid& grid) {
  if (!last_block_to_arrive(&g.sync[kGatherCtasDone])) return;
  const int32_t total = grid.expert_offset[grid.experts];
  const int32_t blocks = total <= grid.capacity ? total / kBlockM : 0;
  for (int32_t i = threadIdx.x; i < kGatherSyncHeader + blocks; i += blockDim.x) g.sync[i] = 0;
}

}  // namespace lynx::gemm
