// The block-scaled FP8 GEMM kernel (its host side: gemm.cu): persistent CTAs, one per SM, each taking
// output tiles in turn (the next tile's loads overlap this one's epilogue).
//
// Roles: warpgroup 0's first thread is the producer (TMA loads of A and B per 128-wide K block into a
// ring of stages); warpgroups 1 and 2 are the consumers, rows [64c, 64c + 64) of the tile each: four
// m64n128k32 E4M3 wgmma per K block and 128 columns into a temporary fp32 accumulator, then promoted
// into the running one times the row's A scale and the block's B scale (the DeepSeek-V3 recipe). The
// grouped forms' tiles are two such 128-column halves wide ([128, 256]; gate/up: the gate's 128 and the
// up's same 128), one temporary taking each half in turn, as does the weight gradient (its B scales per
// column); the two warpgroups issue independently, so that one's products may keep the tensor cores
// busy while the other promotes. The dense form alternates two temporaries over [128, 128] tiles. The bf16
// outputs leave as the bf16 expert GEMM's do (expert_gemm/epilogue.cuh): each warpgroup's [64, n] piece
// into shared memory with stmatrix, then out by TMA stores that drain while it goes on with its next
// tile (kept g and u by slot, straight from the fragments). The gate/up form may instead quantise h itself, in the 1×128
// tiles the down GEMM reads: a tile's 128 columns of h are one such tile of each of its rows.
// Its roles, a file each: storage.cuh (threads, registers, shared memory, arguments), producer.cuh,
// mainloop.cuh (the consumers' K-block loop), epilogue.cuh; this file the kernel and the gather's end.
#pragma once

#include <cstdint>

#include "common/status.h"
#include "device/sm90.cuh"
#include "kernels/expert_gemm/row_gather.cuh"
#include "kernels/fp8/gemm/epilogue.cuh"
#include "kernels/fp8/gemm/mainloop.cuh"
#include "kernels/fp8/gemm/producer.cuh"
#include "kernels/fp8/gemm/storage.cuh"
#include "kernels/fp8/tiles.h"

namespace lynx::fp8::impl {

// finish_gather (row_gather.cuh) over the producer warpgroup alone, warp by warp: the consumers never
// touch the gather's counters. The last of the grid's producer warps to arrive zeroes them (those of the
// row blocks up to the schedule's total) for the next launch on the stream.
// NOTES: not every thread, as the bf16 kernel does: with the consumers' 232 registers reaching code
// that every thread runs, ptxas serialised their wgmma (C7511), and dropping them back to 40 first
// did too (C7512).
__device__ __forceinline__ void finish_gather_warp(const gemm::RowGather& g, const gemm::TileGrid& grid) {
  const int lane = int(threadIdx.x) % 32;
  __syncwarp();
  int last = 0;
  if (lane == 0) {
    __threadfence();  // the warp's copies and counts before its arrival
    const int32_t warps = 4 * int32_t(gridDim.x);
    last = atomicAdd(&g.sync[gemm::kGatherCtasDone], 1) == warps - 1;
    if (last) __threadfence();  // every warp's before this one zeroes the counters
  }
  if (!__shfl_sync(0xffffffffu, last, 0)) return;
  __syncwarp();  // every lane's zeros after lane 0's fence
  const int32_t total = grid.expert_offset[grid.experts];
  const int32_t blocks = total <= grid.capacity ? total / gemm::kBlockM : 0;
  for (int32_t i = lane; i < gemm::kGatherSyncHeader + blocks; i += 32) g.sync[i] = 0;
}

// Persistent: each CTA takes tiles t = blockIdx.x, + gridDim.x, ... With kGather, every CTA's warps 1-3
// copy A's rows for all (a CTA without tiles too), and the last producer warp to finish zeroes the
// gather's counters.
template <Form kForm, class Out, int kGather>
__global__ void __launch_bounds__(kThreads, 1)
    gemm_kernel(const __grid_constant__ CUtensorMap tma_a, const __grid_constant__ CUtensorMap tma_b,
                const __grid_constant__ CUtensorMap tma_b2, const float* __restrict__ a_scales,
                const float* __restrict__ b_scales, const float* __restrict__ b2_scales,
                const __grid_constant__ CUtensorMap tma_out, const __grid_constant__ CUtensorMap tma_out2,
                Out* __restrict__ out,
                int32_t M, int32_t N, int32_t K, const int32_t* __restrict__ expert_offset, int32_t experts,
                DeviceStatus* status, KeptGateUp kept, int32_t split, SwiGLUOutputs swiglu, gemm::RowGather gather,
                RowSources sources, bool pair_rows) {
  static_assert(kGather == kGatherNone || kForm == Form::kSwiGLU ||
                    (kForm == Form::kGrouped && kGather == kGatherLocal),
                "only the grouped forms gather their rows, and only gate/up's from other ranks");
  extern __shared__ uint8_t raw[];
  using Smem = SharedStorage<kForm>;
  Smem& smem = *reinterpret_cast<Smem*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023));
  const KernelArgs<Out> p{&tma_a, &tma_b, &tma_b2, &tma_out, &tma_out2, a_scales, b_scales, b2_scales, out, M, N,
                          status, kept, split, swiglu.store_h, swiglu.quantize_h, swiglu.h_scales, swiglu.h_report,
                          gather, sources};
  // NOTES: broadcast from lane 0, so that ptxas knows it is the same in every lane of a warp and keeps
  // what derives from it (the consumers' A descriptors) in uniform registers.
  const int warpgroup = __shfl_sync(0xffffffffu, int(threadIdx.x) / 128, 0);
  const TileSpace<kForm> tiles(M, N, K, expert_offset, experts, pair_rows);
  // Every thread alike, before any barrier (a gathering CTA copies rows for the others, tiles or not).
  if (kGather == kGatherNone && int32_t(blockIdx.x) >= tiles.count) return;
  if (threadIdx.x == 0) {
    for (int s = 0; s < Smem::kStages; ++s) {
      sm90::mbarrier_init(&smem.full[s], 1);
      sm90::mbarrier_init(&smem.empty[s], kConsumerThreads);
    }
    sm90::fence_barrier_init();
  }
  __syncthreads();

  if (warpgroup == 0) {
    sm90::setmaxnreg_dec<kProducerRegs>();
    const gemm::TileGrid grid{expert_offset, experts, 0, 0, 0, 0, M, false};
    if (threadIdx.x == 0) {
      producer<kForm, Out, kGather>(smem, tiles, p);
    } else if (kGather != kGatherNone && threadIdx.x >= 32) {
      gemm::gather_rows_warp<kGather == kGatherRemote, kFp8GatherVecsPerLane, true>(p.gather, grid, p.sources);
    }
    if constexpr (kGather != kGatherNone) finish_gather_warp(p.gather, grid);
    return;
  }
  sm90::setmaxnreg_inc<kConsumerRegs>();
  const int c = warpgroup - 1;
  int32_t it = 0;      // K blocks consumed before this tile
  bool previous_second = false;  // the previous tile's second half stored (grouped, weight gradient)
  // NOTES: a tile's expert is a binary search over the experts' offsets, and the tile's first B scales
  // wait for it: each tile's start held ~17% of the down GEMM's warp samples with seven loads in turn
  // (ncu source counters, H100, 2026-12-05), ~11% with a warp's search of 32 offsets a round
  // (2026-12-06). Each consumer warp finds its CTA's next 32 tiles at once instead, a lane's binary
  // search each, their loads in flight together, and a tile takes its corner and expert from its lane
  // by shuffle: no load where a tile starts. FP8 forward 0.939-0.943 ms against 0.960-0.965 at
  // qwen3-30b-a3b (1980 MHz), the same bits (H100, 2026-12-07,
  // bench/results/2026-12-07-h100-db0f1f6-fp8-tile-search-log.txt).
  const int lane = int(threadIdx.x) % 32;
  Tile batch{0, 0, 0, 0, 0};  // lane l: the CTA's tile number 32·⌊j / 32⌋ + l (tile t + l·gridDim.x)
  // Tile t, the CTA's j-th: the grouped forms' from the warp's batch; the others' from t alone.
  const auto tile_of = [&](int32_t t, int32_t j) {
    if constexpr (kScheduleRows<kForm>) {
      if (j % 32 == 0) {
        const int64_t mine = int64_t(t) + int64_t(lane) * gridDim.x;
        if (mine < tiles.count) batch = tiles[int32_t(mine)];
      }
      Tile tile = tiles.without_expert(t);
      tile.m0 = __shfl_sync(0xffffffffu, batch.m0, j % 32);
      tile.n0 = __shfl_sync(0xffffffffu, batch.n0, j % 32);
      tile.expert = __shfl_sync(0xffffffffu, batch.expert, j % 32);
      return tile;
    } else {
      return tiles.without_expert(t);
    }
  };
  for (int32_t t = blockIdx.x, j = 0; t < tiles.count; t += gridDim.x, ++j) {
    const Tile tile = tile_of(t, j);
    // NOTES: the kept rows' slots, loaded in the epilogue, held the gate/up kernel's first row stores for
    // a global load's latency: those stores took ~10% of its warp samples (ncu, H100, 2026-12-06). Loaded
    // at the tile's start instead, but where the kernel pulls rows from other ranks: there the four more
    // registers spilled.
    constexpr bool kPreloadSlots = kForm == Form::kSwiGLU && kGather != kGatherRemote;
    int2 kept_slots = make_int2(-1, -1);
    if (kPreloadSlots && p.kept.gate != nullptr) {
      kept_slots = gemm::impl::fragment_slots(p.kept.slot, tile.m0 + 64 * c);
    }
    float acc[kHalves<kForm>][64];
    mainloop(smem, tiles, p, tile, t, it, c, acc);
    it += tile.kb_end - tile.kb_begin;
    epilogue(smem, p, tile, c, acc, kPreloadSlots ? &kept_slots : nullptr, previous_second);
    // (the weight gradient's warpgroup stores nothing where its rows lie past M)
    if (kForm != Form::kWeightGrad || tile.m0 + 64 * c < p.M) previous_second = second_half<kForm>(tile, p.N);
  }
  // The stores must finish before the CTA's shared memory goes away.
  if (kForm != Form::kDense && threadIdx.x % 128 == 0) sm90::bulk_wait_group<0>();
}

}  // namespace lynx::fp8::impl
