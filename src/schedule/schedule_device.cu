// The device schedule builder: two kernels on one stream, no host synchronisation, no allocation,
// integer-only (so deterministic), producing exactly what build_schedule_host produces.
//
//   1. count_rows_kernel  grid (C, R): rows per (chunk, local expert, source) into scratch; then the
//                         last block to finish computes the exclusive prefix over chunks, per-expert
//                         rows and padded offsets, and checks the capacity (expert_offsets).
//   2. place_rows_kernel  grid (C, R): each chunk places its rows in t*k + j order; padding rows -1.
//
// NOTES: the offsets were a one-block kernel of their own between the two; a launch fewer shortens
// what the host queues before the first GEMM (the GPU waits for it in an eager forward).
//
// Each source rank's T*k entries are cut into C chunks of `chunk_entries` (a multiple of kRoundEntries).
// Scratch (int32), P = E_loc * R pairs (core::pair_index, expert-major):
//   [0, C*P)        chunk_rows[c][pair]: kernel 1 writes counts, then (its last block) turns them into
//                   the number of rows of the pair in earlier chunks (an exclusive prefix over c)
//   [C*P, C*P + P)  pair_rows[pair]: rows of the pair over all chunks (|L_s| of schedule.h)
//   [C*P + P]       fits: 1 when the padded total fits the capacity (rows are placed), else 0
#include <algorithm>

#include "common/last_block.cuh"
#include "schedule/schedule.h"
#include "schedule/schedule_core.h"

namespace lynx::sched {
namespace {

// NOTES: a round gives each lane 4 entries and a block 16 warps, the chunk (and so the count kernel's
// work) staying 2048 entries. place_rows_kernel's warps each ran a chain of ~1100 dependent
// instructions at 8 entries per lane (ncu); halving it took the kernel from 12.2-12.5 to 10.9-11.0 µs
// at qwen3-30b-a3b and from 14.6-15.3 to 12.5-12.8 at deepseek-v3; 2 entries and 32 warps gained no
// more (bench/results/2026-12-01-h200-session16.txt, sections 3 and 5).
constexpr int kLaneEntries = 4;                        // entries one lane holds per round
constexpr int kWarpEntries = 32 * kLaneEntries;        // 128: entries of one warp per round
constexpr int kMaxWarps = 16;                          // warps of a place block
constexpr int kRoundEntries = kMaxWarps * kWarpEntries;  // 2048: smallest chunk
// NOTES: 1024 threads, because the count kernel's last block also computes the offsets, a walk over
// C·P counts (up to kMaxChunkInts) by one block; a 256-thread block gave each thread 4 times as many.
constexpr int kCountThreads = 1024;                    // count_rows_kernel block
constexpr int kCountLaneEntries = kRoundEntries / kCountThreads;  // 2: entries one thread counts per round
static_assert(kRoundEntries % kCountThreads == 0, "a round of the count covers the smallest chunk");
constexpr int64_t kMaxChunkInts = int64_t(1) << 20;    // bound on C * P (4 MiB of scratch)
constexpr int64_t kSharedInts = 48 * 1024 / 4;         // dynamic shared memory without an opt-in

struct Plan {
  int64_t entries;        // T*k per source
  int64_t chunk_entries;  // multiple of kRoundEntries
  int32_t chunks;         // C >= 1
  int32_t pairs;          // P = E_loc * R
  int32_t place_warps;    // warps of a place_rows_kernel block: a power of two up to kMaxWarps
};

Plan make_plan(const Problem& p) {
  Plan plan{};
  plan.entries = p.tokens * p.top_k;
  plan.pairs = static_cast<int32_t>(p.num_experts);
  // NOTES: chunks grow (in powers of two) only when the per-chunk counts would outgrow kMaxChunkInts,
  // which keeps the offsets (one block) short; at the target shapes a chunk is 2048 entries.
  plan.chunk_entries = kRoundEntries;
  auto chunks = [&] { return std::max<int64_t>(1, (plan.entries + plan.chunk_entries - 1) / plan.chunk_entries); };
  while (chunks() * plan.pairs > kMaxChunkInts) plan.chunk_entries *= 2;
  plan.chunks = static_cast<int32_t>(chunks());
  // Shared memory of place_rows_kernel: (W + 1) * E_loc running counters + the P pair_rows.
  const int64_t E_loc = p.local_experts();
  plan.place_warps = kMaxWarps;
  while (plan.place_warps > 1 && (plan.place_warps + 1) * E_loc + plan.pairs > kSharedInts) plan.place_warps /= 2;
  return plan;
}

struct Args {
  DeviceRouting routing;
  int32_t num_ranks, rank, local_experts;
  int32_t chunks;
  int64_t entries, chunk_entries, capacity;
  int32_t* chunk_rows;  // scratch, see the layout above
  int32_t* pair_rows;
  int32_t* fits;
  int32_t* row_token_slot;
  int32_t* row_src_rank;
  int32_t* expert_offset;
  int32_t* expert_rows;
  int32_t* block_offset;
  int32_t* slot_row;
  DeviceStatus* status;
};

__device__ __forceinline__ int lane_id() { return threadIdx.x & 31; }

// Exclusive prefix sum of one int64 per thread over the block; *total gets the sum of all.
__device__ int64_t block_exclusive_sum(int64_t v, int64_t* total) {
  __shared__ int64_t warp_sums[32];
  const int lane = lane_id(), warp = threadIdx.x / 32, warps = blockDim.x / 32;
  int64_t inclusive = v;
#pragma unroll
  for (int d = 1; d < 32; d *= 2) {
    const int64_t up = __shfl_up_sync(0xffffffffu, inclusive, d);
    if (lane >= d) inclusive += up;
  }
  if (lane == 31) warp_sums[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    int64_t w = lane < warps ? warp_sums[lane] : 0;
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int64_t up = __shfl_up_sync(0xffffffffu, w, d);
      if (lane >= d) w += up;
    }
    warp_sums[lane] = w;  // inclusive over warps
  }
  __syncthreads();
  *total = warp_sums[warps - 1];
  return inclusive - v + (warp > 0 ? warp_sums[warp - 1] : 0);
}

// One whole block: turns chunk_rows into exclusive prefixes over chunks (one thread per pair), writes
// pair_rows, expert_rows, the padded expert_offset and the GEMM's block_offset (contiguous experts per
// thread, block scans) and the fits flag; on overflow reports kCapacityOverflow (a = rows needed, b = capacity). Other blocks wrote
// chunk_rows: their writes are ordered before these reads by last_block_to_arrive; __ldcg only skips
// L1, which holds no line of them in this block anyway.
__device__ void expert_offsets(const Args& a) {
  const int32_t P = a.local_experts * a.num_ranks;
  for (int32_t pair = threadIdx.x; pair < P; pair += blockDim.x) {
    int32_t* col = a.chunk_rows + pair;
    int32_t before = 0;
    // NOTES: loads of a batch go out together; loading and storing one at a time would serialise
    // C global round trips, as the compiler cannot move a load above a possibly aliasing store.
    constexpr int kBatch = 8;
    for (int32_t c0 = 0; c0 < a.chunks; c0 += kBatch) {
      int32_t v[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) v[u] = c0 + u < a.chunks ? __ldcg(&col[int64_t(c0 + u) * P]) : 0;
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        if (c0 + u < a.chunks) col[int64_t(c0 + u) * P] = before;
        before += v[u];
      }
    }
    a.pair_rows[pair] = before;
  }
  __syncthreads();

  const int32_t per_thread = (a.local_experts + blockDim.x - 1) / blockDim.x;
  const int32_t e_begin = min(a.local_experts, int32_t(threadIdx.x) * per_thread);
  const int32_t e_end = min(a.local_experts, e_begin + per_thread);
  auto expert_rows = [&](int32_t e) {
    int64_t rows = 0;
    for (int32_t s = 0; s < a.num_ranks; ++s) rows += a.pair_rows[core::pair_index(e, s, a.num_ranks)];
    return rows;
  };
  int64_t padded = 0, blocks = 0;
  for (int32_t e = e_begin; e < e_end; ++e) {
    padded += core::padded_rows(expert_rows(e));
    blocks += core::tile_blocks(expert_rows(e));
  }
  int64_t total = 0, total_blocks = 0;
  int64_t offset = block_exclusive_sum(padded, &total);
  __syncthreads();  // block_exclusive_sum's shared sums are read until its return
  int64_t block = block_exclusive_sum(blocks, &total_blocks);
  for (int32_t e = e_begin; e < e_end; ++e) {
    const int64_t rows = expert_rows(e);
    a.expert_rows[e] = static_cast<int32_t>(rows);
    a.expert_offset[e] = static_cast<int32_t>(offset);
    a.block_offset[e] = static_cast<int32_t>(block);
    offset += core::padded_rows(rows);
    block += core::tile_blocks(rows);
  }
  if (threadIdx.x == 0) {
    a.expert_offset[a.local_experts] = static_cast<int32_t>(total);
    a.block_offset[a.local_experts] = static_cast<int32_t>(total_blocks);
    const bool fits = core::fits_capacity(total, a.capacity);
    *a.fits = fits ? 1 : 0;
    if (!fits && atomicCAS(&a.status->code, int32_t(StatusCode::kOk), int32_t(StatusCode::kCapacityOverflow)) ==
                     int32_t(StatusCode::kOk)) {
      a.status->rank = a.rank;
      a.status->a = total;
      a.status->b = a.capacity;
      a.status->c = 0;
    }
  }
}

// Grid (C, R), kCountThreads threads, E_loc ints of dynamic shared memory: block (c, s) counts the
// rows of chunk c of source s per local expert and writes chunk_rows[c][pair(e, s)] for every e; the
// last block to finish then runs expert_offsets (common/last_block.cuh).
__global__ void __launch_bounds__(kCountThreads) count_rows_kernel(const Args a) {
  extern __shared__ int32_t hist[];
  const int32_t c = blockIdx.x, s = blockIdx.y;
  for (int32_t e = threadIdx.x; e < a.local_experts; e += blockDim.x) hist[e] = 0;
  __syncthreads();

  const int32_t* ids = a.routing.topk_ids[s];
  const int64_t begin = c * a.chunk_entries;
  const int64_t end = min(a.entries, begin + a.chunk_entries);
  for (int64_t round = begin; round < end; round += kRoundEntries) {
    int32_t e[kCountLaneEntries];
#pragma unroll
    for (int u = 0; u < kCountLaneEntries; ++u) {
      const int64_t i = round + u * kCountThreads + threadIdx.x;
      e[u] = i < end ? core::local_expert(ids[i], a.rank, a.local_experts) : -1;
    }
    // NOTES: one shared atomic per distinct expert per warp, so a chunk routed to a single expert
    // does not serialise 2048 atomics on one word.
#pragma unroll
    for (int u = 0; u < kCountLaneEntries; ++u) {
      const unsigned peers = __match_any_sync(0xffffffffu, e[u]);
      if (e[u] >= 0 && lane_id() == __ffs(peers) - 1) atomicAdd(&hist[e[u]], __popc(peers));
    }
  }
  __syncthreads();
  int32_t* out = a.chunk_rows + int64_t(c) * a.num_ranks * a.local_experts;
  for (int32_t e = threadIdx.x; e < a.local_experts; e += blockDim.x) out[core::pair_index(e, s, a.num_ranks)] = hist[e];

  if (last_block_to_arrive(&a.status->counted_blocks)) expert_offsets(a);
}

// Padding rows of every expert block get -1: a grid-stride pass over (expert, row of its last tile).
__device__ void write_padding(const Args& a) {
  const int64_t items = int64_t(a.local_experts) * kTileRows;
  const int64_t stride = int64_t(gridDim.x) * gridDim.y * blockDim.x;
  for (int64_t x = (int64_t(blockIdx.y) * gridDim.x + blockIdx.x) * blockDim.x + threadIdx.x; x < items; x += stride) {
    const int32_t e = static_cast<int32_t>(x / kTileRows);
    const int64_t row = int64_t(a.expert_offset[e]) + a.expert_rows[e] + x % kTileRows;
    if (row < a.expert_offset[e + 1]) {
      a.row_token_slot[row] = -1;
      a.row_src_rank[row] = -1;
    }
  }
}

// Grid (C, R), place_warps warps, dynamic shared memory (place_warps + 1) * E_loc + P ints. Block
// (c, s) places the rows of chunk c of source s; it and every other block first check the fits flag
// of this build and write nothing when the schedule overflows.
// A chunk is walked in rounds of place_warps * 128 entries; in a round warp w holds entries
// w*128 + u*32 + lane (u = 0..3), so (warp, u, lane) order is t*k + j order. Per round:
//   1. each warp ranks its entries among same-expert entries of the warp (match_any; the lowest
//      peer lane bumps the warp's counter for that expert),
//   2. per expert, the warps' counts become prefixes on top of the chunk's running count q0[e],
//   3. row q = prefix + rank goes to expert_offset[e] + interleaved_position(q, s, pair_rows of e).
__global__ void __launch_bounds__(kMaxWarps * 32) place_rows_kernel(const Args a) {
  if (*a.fits != 1) return;
  write_padding(a);

  extern __shared__ int32_t smem[];
  const int32_t E_loc = a.local_experts, R = a.num_ranks;
  const int32_t c = blockIdx.x, s = blockIdx.y;
  const int lane = lane_id(), warp = threadIdx.x / 32, warps = blockDim.x / 32;
  int32_t* q0 = smem;                           // [E_loc]: rows of (e, s) before this round
  int32_t* warp_q = q0 + E_loc;                 // [warps][E_loc]: counts, then prefixes, of a round
  int32_t* pair_rows = warp_q + warps * E_loc;  // [P]
  int32_t* my_q = warp_q + warp * E_loc;

  const int32_t* chunk_q = a.chunk_rows + int64_t(c) * R * E_loc;
  for (int32_t e = threadIdx.x; e < E_loc; e += blockDim.x) q0[e] = chunk_q[core::pair_index(e, s, R)];
  for (int32_t i = threadIdx.x; i < warps * E_loc; i += blockDim.x) warp_q[i] = 0;
  for (int32_t i = threadIdx.x; i < E_loc * R; i += blockDim.x) pair_rows[i] = a.pair_rows[i];
  __syncthreads();

  const int32_t* ids = a.routing.topk_ids[s];
  const int64_t begin = c * a.chunk_entries;
  const int64_t end = min(a.entries, begin + a.chunk_entries);
  const unsigned lanes_below = (1u << lane) - 1;
  for (int64_t round = begin; round < end; round += int64_t(warps) * kWarpEntries) {
    const int64_t first = round + int64_t(warp) * kWarpEntries + lane;
    int32_t e[kLaneEntries], rank[kLaneEntries];
#pragma unroll
    for (int u = 0; u < kLaneEntries; ++u) {
      const int64_t i = first + u * 32;
      e[u] = i < end ? core::local_expert(ids[i], a.rank, E_loc) : -1;
    }
#pragma unroll
    for (int u = 0; u < kLaneEntries; ++u) {
      const unsigned peers = __match_any_sync(0xffffffffu, e[u]);
      const int leader = __ffs(peers) - 1;
      int32_t before = 0;
      if (e[u] >= 0 && lane == leader) {
        before = my_q[e[u]];
        my_q[e[u]] = before + __popc(peers);
      }
      rank[u] = __shfl_sync(0xffffffffu, before, leader) + __popc(peers & lanes_below);
      __syncwarp();
    }
    __syncthreads();

    for (int32_t x = threadIdx.x; x < E_loc; x += blockDim.x) {
      int32_t q = q0[x];
      for (int w = 0; w < warps; ++w) {
        const int32_t n = warp_q[w * E_loc + x];
        warp_q[w * E_loc + x] = q;
        q += n;
      }
      q0[x] = q;
    }
    __syncthreads();

#pragma unroll
    for (int u = 0; u < kLaneEntries; ++u) {
      const int64_t i = first + u * 32;
      if (i >= end) continue;
      int32_t row = -1;
      if (e[u] >= 0) {
        const int32_t q = my_q[e[u]] + rank[u];
        row = static_cast<int32_t>(a.expert_offset[e[u]] +
                                   core::interleaved_position(q, s, pair_rows + core::pair_index(e[u], 0, R), R));
        a.row_token_slot[row] = static_cast<int32_t>(i);
        a.row_src_rank[row] = s;
      }
      if (s == a.rank) a.slot_row[i] = row;
    }
    // NOTES: only this warp reads my_q after the block barrier above, so resetting it for the next
    // round needs only the warp's own barrier; the next round's step 2 sits behind a block barrier.
    __syncwarp();
    for (int32_t x = lane; x < E_loc; x += 32) my_q[x] = 0;
    __syncwarp();
  }
}

Args make_args(const Problem& p, const Plan& plan, const DeviceRouting& routing, const DeviceBuffers& b) {
  Args a{};
  a.routing = routing;
  a.num_ranks = p.num_ranks;
  a.rank = p.rank;
  a.local_experts = static_cast<int32_t>(p.local_experts());
  a.chunks = plan.chunks;
  a.entries = plan.entries;
  a.chunk_entries = plan.chunk_entries;
  a.capacity = p.capacity;
  a.chunk_rows = b.scratch;
  a.pair_rows = b.scratch + int64_t(plan.chunks) * plan.pairs;
  a.fits = a.pair_rows + plan.pairs;
  a.row_token_slot = b.row_token_slot;
  a.row_src_rank = b.row_src_rank;
  a.expert_offset = b.expert_offset;
  a.expert_rows = b.expert_rows;
  a.block_offset = b.block_offset;
  a.slot_row = b.slot_row;
  a.status = b.status;
  return a;
}

}  // namespace

int64_t device_scratch_ints(const Problem& p) {
  const Plan plan = make_plan(p);
  return int64_t(plan.chunks) * plan.pairs + plan.pairs + 1;
}

void build_schedule_device(const Problem& p, const DeviceRouting& routing, const DeviceBuffers& buffers,
                           cudaStream_t stream) {
  const Plan plan = make_plan(p);
  const Args a = make_args(p, plan, routing, buffers);
  const dim3 grid(plan.chunks, p.num_ranks);
  const size_t E_loc = size_t(a.local_experts);
  count_rows_kernel<<<grid, kCountThreads, E_loc * sizeof(int32_t), stream>>>(a);
  const size_t place_shared = ((plan.place_warps + 1) * E_loc + plan.pairs) * sizeof(int32_t);
  place_rows_kernel<<<grid, plan.place_warps * 32, place_shared, stream>>>(a);
}

}  // namespace lynx::sched
