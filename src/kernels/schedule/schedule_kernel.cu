// The device schedule builder: one cooperative kernel on one stream, no host synchronisation, no
// allocation, integer-only (so deterministic), producing exactly what build_schedule_host produces.
//
// Grid (C, R), SchedulePlan (plan/schedule.h): block (c, s) owns chunk c of source rank s's T*k entries. Three phases
// with a grid barrier between them (a cooperative launch keeps every block resident):
//   1. count: the chunk's rows per local expert into chunk_rows[c][pair(e, s)]. The caller's own ids,
//             when given (OwnRouting), are checked here as they are read (routing_check.h).
//   2. scan:  each pair's column of chunk_rows, over c, becomes exclusive prefixes (one warp per pair,
//             the pairs spread over the grid), and its total goes to pair_rows.
//   3. place: every block computes the per-expert rows and padded offsets into its shared memory (the
//             same numbers in every block; block (0, 0) writes them out with the GEMM's block
//             offsets and checks the capacity), then places its chunk's rows and a share of the
//             padding rows, unless the schedule overflows.
// The last block to finish sets the barrier counter back for the next build.
//
// NOTES: this replaced three launches (routing validation, count with the offsets in its last block,
// place): 24 µs of a qwen3-30b-a3b forward under Nsight Compute, 14.9 µs for this kernel with blocks
// of 4 warps (128 chunks of 512 entries; 19.4 µs with 16 warps and 32 chunks), and the forward 0.9%
// faster than the control at full clock (measured 2026-12-04, commit ae1f5b0).
//
// Scratch (int32), P = E_loc * R pairs (core::pair_index, expert-major):
//   [0, C*P)        chunk_rows[c][pair]: counts (phase 1), then the rows of the pair in earlier chunks
//   [C*P, C*P + P)  pair_rows[pair]: rows of the pair over all chunks (|L_s| of schedule.h)
#include <algorithm>
#include <climits>

#include "common/cuda_check.h"
#include "common/kernel_loading.h"
#include "common/per_device.h"
#include "device/last_block.cuh"
#include "device/remote.cuh"
#include "device/sm90.cuh"
#include "kernels/schedule/api.h"
#include "kernels/schedule/core.h"
#include "kernels/schedule/routing_check.h"

namespace lynx::sched {
namespace {


struct Args {
  DeviceRouting routing;
  OwnRouting own;  // own.topk_ids null: every source's ids come from `routing`
  int32_t num_ranks, rank, local_experts;
  int64_t num_experts;
  int32_t chunks;
  int64_t entries, chunk_entries, capacity;
  int32_t* chunk_rows;  // scratch, see the layout above
  int32_t* pair_rows;
  int32_t* row_token_slot;
  int32_t* row_src_rank;
  int32_t* expert_offset;
  int32_t* expert_rows;
  int32_t* block_offset;
  int32_t* half_block_offset;
  int32_t* slot_row;
  int32_t* const* peer_slot_row;  // [R] device, or null (R = 1): every source rank's slot_row
  DeviceStatus* status;
  DeviceStatus* stall_report;
#if LYNX_EXPERIMENTS
  int32_t stall_block;  // test hook: this block never arrives at the first barrier (-1: none)
#endif
};

__device__ __forceinline__ int lane_id() { return threadIdx.x & 31; }
__device__ __forceinline__ int32_t linear_block() { return int32_t(blockIdx.y * gridDim.x + blockIdx.x); }

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
  const int64_t out = inclusive - v + (warp > 0 ? warp_sums[warp - 1] : 0);
  __syncthreads();  // warp_sums is read until here; the next call writes it
  return out;
}

// Waits until every block of the grid has arrived `round` times (round 1, 2, ...): what each block
// wrote before its arrival is then visible to every thread of this block. Bounded: past
// sm90::kCounterWaitNs it reports wait kScheduleBlocks with the round and the count seen, and traps.
__device__ void grid_barrier(const Args& a, int32_t round, bool arrive = true) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (arrive) sm90::red_release_add(&a.status->schedule_arrivals, 1);
    sm90::wait_counter(&a.status->schedule_arrivals, round * int32_t(gridDim.x * gridDim.y), 32, a.stall_report,
                       sm90::Wait::kScheduleBlocks, round);
  }
  __syncthreads();
}

// The local expert of entry i of the caller's own ids (-1: not local), checked as it is read: a bad
// entry lowers status->first_bad_route, and the int32 copy gets -1 for an id out of range.
template <class Id>
__device__ __forceinline__ int32_t own_local_expert(const Args& a, int64_t i) {
  const int64_t id = static_cast<int64_t>(static_cast<const Id*>(a.own.topk_ids)[i]);
  if (check_route(id, __float_as_uint(a.own.topk_weights[i]), a.num_experts) != StatusCode::kOk) {
    atomicMin(&a.status->first_bad_route, static_cast<unsigned long long>(i));
  }
  const int32_t id32 = (id >= 0 && id < a.num_experts) ? static_cast<int32_t>(id) : -1;
  a.own.ids32[i] = id32;
  return core::local_expert(id32, a.rank, a.local_experts);
}

// The lowest offending entry of the own ids, if any, as the status report; then the tracking is set
// back for the next build. One thread, after every block's checks.
template <class Id>
__device__ void report_first_bad_route(const Args& a) {
  DeviceStatus* st = a.status;
  const unsigned long long i = atomicAdd(&st->first_bad_route, 0ull);
  if (i != ULLONG_MAX) {
    const int64_t id = static_cast<int64_t>(static_cast<const Id*>(a.own.topk_ids)[i]);
    report_route(st, static_cast<int64_t>(i), id, __float_as_uint(a.own.topk_weights[i]), a.num_experts, a.rank);
  }
  st->first_bad_route = ULLONG_MAX;
}

// Phase 1: block (c, s) counts the rows of chunk c of source s per local expert into hist, then into
// chunk_rows[c][pair(e, s)] for every e.
template <class Id>
__device__ void count_chunk(const Args& a, int32_t* hist) {
  const int32_t c = blockIdx.x, s = blockIdx.y;
  for (int32_t e = threadIdx.x; e < a.local_experts; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  const bool own = a.own.topk_ids != nullptr && s == a.rank;
  const int32_t* ids = a.routing.topk_ids[s];
  const int64_t begin = c * a.chunk_entries;
  const int64_t end = min(a.entries, begin + a.chunk_entries);
  const int64_t round_entries = int64_t(blockDim.x) * kLaneEntries;
  for (int64_t round = begin; round < end; round += round_entries) {
    int32_t e[kLaneEntries];
#pragma unroll
    for (int u = 0; u < kLaneEntries; ++u) {
      const int64_t i = round + int64_t(u) * blockDim.x + threadIdx.x;
      e[u] = i >= end ? -1 : own ? own_local_expert<Id>(a, i) : core::local_expert(ids[i], a.rank, a.local_experts);
    }
    // NOTES: one shared atomic per distinct expert per warp, so a chunk routed to a single expert
    // does not serialise its atomics on one word.
#pragma unroll
    for (int u = 0; u < kLaneEntries; ++u) {
      const unsigned peers = __match_any_sync(0xffffffffu, e[u]);
      if (e[u] >= 0 && lane_id() == __ffs(peers) - 1) atomicAdd(&hist[e[u]], __popc(peers));
    }
  }
  __syncthreads();
  int32_t* out = a.chunk_rows + int64_t(c) * a.num_ranks * a.local_experts;
  for (int32_t e = threadIdx.x; e < a.local_experts; e += blockDim.x) out[core::pair_index(e, s, a.num_ranks)] = hist[e];
}

// Phase 2: warp w of block b scans the columns b + nb * (w + W * j) of chunk_rows: lane l holds chunks
// l * kLaneChunks .. + kLaneChunks - 1, so the lanes' sums scanned in lane order give each chunk the
// rows of the pair in the chunks before it.
__device__ void scan_columns(const Args& a) {
  const int32_t P = a.local_experts * a.num_ranks;
  const int32_t nb = int32_t(gridDim.x * gridDim.y), warps = int32_t(blockDim.x / 32);
  const int lane = lane_id();
  for (int32_t p = linear_block() + nb * int32_t(threadIdx.x / 32); p < P; p += nb * warps) {
    int32_t v[kLaneChunks];
    int32_t sum = 0;
#pragma unroll
    for (int j = 0; j < kLaneChunks; ++j) {
      const int32_t c = lane * kLaneChunks + j;
      v[j] = c < a.chunks ? __ldcg(&a.chunk_rows[int64_t(c) * P + p]) : 0;
      sum += v[j];
    }
    int32_t inclusive = sum;
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int32_t up = __shfl_up_sync(0xffffffffu, inclusive, d);
      if (lane >= d) inclusive += up;
    }
    int32_t before = inclusive - sum;
#pragma unroll
    for (int j = 0; j < kLaneChunks; ++j) {
      const int32_t c = lane * kLaneChunks + j;
      if (c < a.chunks) a.chunk_rows[int64_t(c) * P + p] = before;
      before += v[j];
    }
    if (lane == 31) a.pair_rows[p] = inclusive;
  }
}

// Phase 3, first part: every block computes the experts' padded offsets into `offset` (E_loc + 1, the
// total last) from pair_rows (in shared memory); block (0, 0) also writes expert_rows, expert_offset
// and the GEMMs' block_offset and half_block_offset, and reports an overflow (a = rows needed, b = capacity). Contiguous
// experts per thread, block scans.
__device__ void expert_offsets(const Args& a, const int32_t* pair_rows, int32_t* offset) {
  const int32_t per_thread = (a.local_experts + blockDim.x - 1) / blockDim.x;
  const int32_t e_begin = min(a.local_experts, int32_t(threadIdx.x) * per_thread);
  const int32_t e_end = min(a.local_experts, e_begin + per_thread);
  auto expert_rows = [&](int32_t e) {
    int64_t rows = 0;
    for (int32_t s = 0; s < a.num_ranks; ++s) rows += pair_rows[core::pair_index(e, s, a.num_ranks)];
    return rows;
  };
  int64_t padded = 0;
  for (int32_t e = e_begin; e < e_end; ++e) padded += core::padded_rows(expert_rows(e));
  int64_t total = 0;
  int64_t at = block_exclusive_sum(padded, &total);
  for (int32_t e = e_begin; e < e_end; ++e) {
    offset[e] = static_cast<int32_t>(at);
    at += core::padded_rows(expert_rows(e));
  }
  if (threadIdx.x == 0) offset[a.local_experts] = static_cast<int32_t>(total);
  if (linear_block() != 0) return;

  int64_t blocks = 0, halves = 0;
  for (int32_t e = e_begin; e < e_end; ++e) {
    blocks += core::tile_blocks(expert_rows(e));
    halves += core::half_blocks(expert_rows(e));
  }
  int64_t total_blocks = 0, total_halves = 0;
  int64_t block = block_exclusive_sum(blocks, &total_blocks);
  int64_t half = block_exclusive_sum(halves, &total_halves);
  for (int32_t e = e_begin; e < e_end; ++e) {
    const int64_t rows = expert_rows(e);
    a.expert_rows[e] = static_cast<int32_t>(rows);
    a.expert_offset[e] = offset[e];
    a.block_offset[e] = static_cast<int32_t>(block);
    a.half_block_offset[e] = static_cast<int32_t>(half);
    block += core::tile_blocks(rows);
    half += core::half_blocks(rows);
  }
  if (threadIdx.x == 0) {
    a.expert_offset[a.local_experts] = static_cast<int32_t>(total);
    a.block_offset[a.local_experts] = static_cast<int32_t>(total_blocks);
    a.half_block_offset[a.local_experts] = static_cast<int32_t>(total_halves);
    if (!core::fits_capacity(total, a.capacity) &&
        atomicCAS(&a.status->code, int32_t(StatusCode::kOk), int32_t(StatusCode::kCapacityOverflow)) ==
            int32_t(StatusCode::kOk)) {
      a.status->rank = a.rank;
      a.status->a = total;
      a.status->b = a.capacity;
      a.status->c = 0;
    }
  }
}

// Padding rows of every expert block get -1: a grid-stride pass over (expert, row of its last tile).
__device__ void write_padding(const Args& a, const int32_t* pair_rows, const int32_t* offset) {
  const int64_t items = int64_t(a.local_experts) * kTileRows;
  const int64_t stride = int64_t(gridDim.x) * gridDim.y * blockDim.x;
  for (int64_t x = int64_t(linear_block()) * blockDim.x + threadIdx.x; x < items; x += stride) {
    const int32_t e = static_cast<int32_t>(x / kTileRows);
    int64_t rows = 0;
    for (int32_t s = 0; s < a.num_ranks; ++s) rows += pair_rows[core::pair_index(e, s, a.num_ranks)];
    const int64_t row = int64_t(offset[e]) + rows + x % kTileRows;
    if (row < offset[e + 1]) {
      a.row_token_slot[row] = -1;
      a.row_src_rank[row] = -1;
    }
  }
}

// Phase 3, second part: block (c, s) places the rows of chunk c of source s, in rounds of W * 128
// entries; in a round warp w holds entries w*128 + u*32 + lane (u = 0..3), so (warp, u, lane) order is
// t*k + j order. Per round:
//   1. each warp ranks its entries among same-expert entries of the warp (match_any; the lowest
//      peer lane bumps the warp's counter for that expert),
//   2. per expert, the warps' counts become prefixes on top of the chunk's running count q0[e],
//   3. row q = prefix + rank goes to offset[e] + source_major_position(q, s, pair_rows of e).
// `ids` holds source s's int32 ids (the own rank's checked copy when the build checked them).
__device__ void place_chunk(const Args& a, const int32_t* ids, int32_t* q0, int32_t* warp_q, const int32_t* pair_rows,
                            const int32_t* offset) {
  const int32_t E_loc = a.local_experts, R = a.num_ranks;
  const int32_t c = blockIdx.x, s = blockIdx.y;
  const int lane = lane_id(), warp = threadIdx.x / 32, warps = blockDim.x / 32;
  int32_t* my_q = warp_q + warp * E_loc;
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
        row = static_cast<int32_t>(offset[e[u]] +
                                   core::source_major_position(q, s, pair_rows + core::pair_index(e[u], 0, R)));
        a.row_token_slot[row] = static_cast<int32_t>(i);
        a.row_src_rank[row] = s;
      }
      // At R > 1 the rank that computes (t, j) tells its source where the row is (the combine pulls
      // it from there); every entry has one such rank, so no other writes the slot.
      if (a.peer_slot_row) {
        if (row >= 0) remote::store(a.peer_slot_row[s] + i, row);
      } else if (s == a.rank) {
        a.slot_row[i] = row;
      }
    }
    // NOTES: only this warp reads my_q after the block barrier above, so resetting it for the next
    // round needs only the warp's own barrier; the next round's step 2 sits behind a block barrier.
    __syncwarp();
    for (int32_t x = lane; x < E_loc; x += 32) my_q[x] = 0;
    __syncwarp();
  }
}

// Grid (C, R), W warps, plan.shared_ints of dynamic shared memory, launched cooperatively. `Id`: the
// type of the own ids (int32_t when the build does not check them).
template <class Id>
__global__ void __launch_bounds__(kMaxWarps * 32) schedule_kernel(const Args a) {
  extern __shared__ int32_t smem[];
  const int32_t E_loc = a.local_experts, P = a.local_experts * a.num_ranks;
  const int warps = blockDim.x / 32;
  int32_t* q0 = smem;                        // [E_loc]: phase 1's counts, then rows of (e, s) before this round
  int32_t* warp_q = q0 + E_loc;              // [warps][E_loc]: counts, then prefixes, of a round
  int32_t* pair_rows = warp_q + warps * E_loc;  // [P]
  int32_t* offset = pair_rows + P;           // [E_loc + 1]: padded expert offsets, the total last

  count_chunk<Id>(a, q0);
#if LYNX_EXPERIMENTS
  grid_barrier(a, 1, linear_block() != a.stall_block);
#else
  grid_barrier(a, 1);
#endif
  const bool checked = a.own.topk_ids != nullptr;
  // NOTES: the routing's report comes before the capacity check below in the same thread, so that a
  // bad route wins over an overflow, as when the validation was a kernel of its own before the schedule.
  if (checked && linear_block() == 0 && threadIdx.x == 0) report_first_bad_route<Id>(a);
  scan_columns(a);
  grid_barrier(a, 2);

  const int32_t c = blockIdx.x, s = blockIdx.y;
  const int32_t* chunk_q = a.chunk_rows + int64_t(c) * P;
  for (int32_t e = threadIdx.x; e < E_loc; e += blockDim.x) q0[e] = __ldcg(&chunk_q[core::pair_index(e, s, a.num_ranks)]);
  for (int32_t i = threadIdx.x; i < warps * E_loc; i += blockDim.x) warp_q[i] = 0;
  for (int32_t i = threadIdx.x; i < P; i += blockDim.x) pair_rows[i] = __ldcg(&a.pair_rows[i]);
  __syncthreads();
  expert_offsets(a, pair_rows, offset);
  __syncthreads();
  if (core::fits_capacity(offset[E_loc], a.capacity)) {
    write_padding(a, pair_rows, offset);
    place_chunk(a, checked && s == a.rank ? a.own.ids32 : a.routing.topk_ids[s], q0, warp_q, pair_rows, offset);
  }
  if (last_block_to_arrive(&a.status->counted_blocks) && threadIdx.x == 0) a.status->schedule_arrivals = 0;
}

// What the device offers the plan: blocks resident at once (one per SM: a block takes at most 512
// threads and 227 KB) and the dynamic shared memory a block may opt in to, per device.
LaunchLimits device_limits() {
  static detail::PerDeviceCache sms{}, shared{};
  LaunchLimits l{};
  l.sm_count = detail::per_device(sms, [](int device) {
    int v = 0;
    LYNX_CUDA(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, device));
    return v;
  });
  l.max_shared_ints = detail::per_device(shared, [](int device) {
    int optin = 0;
    LYNX_CUDA(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    // NOTES: the opt-in is set here, once per device and before any capture, for both instantiations;
    // it excludes the kernel's static shared memory (the block scans' and the last block's).
    int dynamic = optin;
    for (const void* kernel : {reinterpret_cast<const void*>(schedule_kernel<int32_t>),
                               reinterpret_cast<const void*>(schedule_kernel<int64_t>)}) {
      cudaFuncAttributes attr{};
      LYNX_CUDA(cudaFuncGetAttributes(&attr, kernel));
      dynamic = std::min(dynamic, optin - int(attr.sharedSizeBytes));
    }
    LYNX_CUDA(cudaFuncSetAttribute(schedule_kernel<int32_t>, cudaFuncAttributeMaxDynamicSharedMemorySize, dynamic));
    LYNX_CUDA(cudaFuncSetAttribute(schedule_kernel<int64_t>, cudaFuncAttributeMaxDynamicSharedMemorySize, dynamic));
    return dynamic / int(sizeof(int32_t));
  });
  return l;
}

Args make_args(const Problem& p, const SchedulePlan& plan, const DeviceRouting& routing, const OwnRouting* own,
               const DeviceBuffers& b) {
  Args a{};
  a.routing = routing;
  if (own) a.own = *own;
  a.num_ranks = p.num_ranks;
  a.rank = p.rank;
  a.local_experts = static_cast<int32_t>(p.local_experts());
  a.num_experts = p.num_experts;
  a.chunks = plan.chunks;
  a.entries = plan.entries;
  a.chunk_entries = plan.chunk_entries;
  a.capacity = p.capacity;
  a.chunk_rows = b.scratch;
  a.pair_rows = b.scratch + int64_t(plan.chunks) * plan.pairs;
  a.row_token_slot = b.row_token_slot;
  a.row_src_rank = b.row_src_rank;
  a.expert_offset = b.expert_offset;
  a.expert_rows = b.expert_rows;
  a.block_offset = b.block_offset;
  a.half_block_offset = b.half_block_offset;
  a.slot_row = b.slot_row;
  a.peer_slot_row = b.peer_slot_row;
  a.status = b.status;
  a.stall_report = b.stall_report;
#if LYNX_EXPERIMENTS
  a.stall_block = b.test_stall_block;
#endif
  return a;
}

}  // namespace

LaunchLimits launch_limits() { return device_limits(); }

void build_schedule_device(const Problem& p, const SchedulePlan& plan, const DeviceRouting& routing,
                           const DeviceBuffers& buffers, cudaStream_t stream, const OwnRouting* own) {
  const LaunchLimits limits = device_limits();
  if (int64_t(plan.chunks) * p.num_ranks > limits.sm_count || plan.shared_ints > limits.max_shared_ints) {
    throw Error("", "internal: the schedule's grid (" + std::to_string(plan.chunks) + " x " +
                        std::to_string(p.num_ranks) + " blocks, " + std::to_string(plan.shared_ints * 4) +
                        " bytes of shared memory each) does not fit the device at once");
  }
  const Args a = make_args(p, plan, routing, own, buffers);
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(plan.chunks, p.num_ranks);
  cfg.blockDim = dim3(plan.warps * 32);
  cfg.dynamicSmemBytes = size_t(plan.shared_ints) * sizeof(int32_t);
  cfg.stream = stream;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeCooperative;
  attr.val.cooperative = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  if (own && own->ids_int64) {
    LYNX_CUDA(cudaLaunchKernelEx(&cfg, schedule_kernel<int64_t>, a));
  } else {
    LYNX_CUDA(cudaLaunchKernelEx(&cfg, schedule_kernel<int32_t>, a));
  }
}

void load_schedule_kernels() { load_module_of(reinterpret_cast<const void*>(&schedule_kernel<int32_t>)); }

}  // namespace lynx::sched
