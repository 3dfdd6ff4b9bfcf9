// The expert GEMM's producer: the tile scheduler (in-order ticket claims, the static round robin,
// cluster units posted from rank 0 to rank 1) and the one thread that issues every TMA load of the
// CTA's tiles into the stage pipeline.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "device/sm90.cuh"
#include "kernels/expert_gemm/row_gather.cuh"
#include "kernels/expert_gemm/tile_scheduler.h"
#include "kernels/expert_gemm/traits.cuh"
#include "kernels/schedule/core.h"

namespace lynx::gemm::impl {

// ---- tile scheduler: the producer thread picks each tile; the consumers learn it from its first stage ----
// NOTES: in order (p.in_order): a static round robin lets CTAs drift apart over the waves, so the tiles
// that share a weight tile or a row block (neighbours in tile_at's raster) run apart in time and
// re-read their operands from DRAM; claims from a ticket keep neighbours together. Which CTA computes
// a tile does not change its bits: each tile is still computed whole, over its K in order. When each
// order wins: plan::choose_tile_order (plan/tiles.h).
__device__ __forceinline__ int32_t claim_ticket(const Params& p) { return atomicAdd(&p.tickets[0], 1); }

// The last of the `claimers` CTAs to finish claiming zeroes the counters for the next launch on the stream.
__device__ __forceinline__ void finish_claims(const Params& p, int32_t claimers) {
  __threadfence();  // this CTA's last claim is ordered before its count
  if (atomicAdd(&p.tickets[1], 1) == claimers - 1) {
    atomicExch(&p.tickets[0], 0);
    atomicExch(&p.tickets[1], 0);
  }
}

// ---- in-order claims in a cluster: rank 0 claims each unit and posts it to rank 1 ----
// Two slots, so rank 0's next claim is posted while rank 1 still loads the current unit. The n-th
// unit goes through slot n % 2, that slot's (n / 2)-th use.
template <class Smem>
__device__ __forceinline__ int32_t post_unit(Smem& smem, int32_t n, int32_t unit, DeviceStatus* status) {
  const int slot = n & 1;
  const uint32_t parity = (n >> 1) & 1;
  sm90::mbarrier_wait<sm90::Scope::kCluster>(&smem.unit_empty[slot], parity ^ 1, status, sm90::Wait::kUnitTaken, unit);
  sm90::st_peer(&smem.unit_slot[slot], 1, unit);
  sm90::mbarrier_arrive_peer(&smem.unit_full[slot], 1);  // releases the store
  return unit;
}

template <class Smem>
__device__ __forceinline__ int32_t take_unit(Smem& smem, int32_t n, DeviceStatus* status) {
  const int slot = n & 1;
  const uint32_t parity = (n >> 1) & 1;
  sm90::mbarrier_wait<sm90::Scope::kCluster>(&smem.unit_full[slot], parity, status, sm90::Wait::kUnitPosted, kNoTile);
  const int32_t unit = *static_cast<volatile int32_t*>(&smem.unit_slot[slot]);
  sm90::mbarrier_arrive_peer(&smem.unit_empty[slot], 0);  // the slot may be written again
  return unit;
}

// The operand maps of a launch, as the kernel holds them (grid constants). a and b0 load a whole
// stage's A and B (b0 and b1 both with SwiGLU); a_half ([64, 64] boxes) and b_half ([128, 64] boxes,
// plain K-major B) load the halves a cluster multicasts; a_quarter ([16, 64] boxes) loads a half
// tile's A (load_half_a).
struct OperandMaps {
  const CUtensorMap *a, *a_half, *a_quarter, *a_fold, *b0, *b1, *b_half;
};

// A half tile's A, rows [row, row + 64) of the stage, as four [16, 64] boxes: the first
// ceil(rows / 16) from A, the others from rows before A's first (kOutsideRows), which the TMA fills
// with zeros without reading memory. So the stage holds what one [64, 64] box would (the padding rows
// of A are zeros) while the L2 serves only the 16-row groups that hold rows. NOTES: at deepseek-v3 a
// third of the row blocks are tails of ~9 rows (1-43), half tiles all. With 16-row boxes its gate/up
// moved 39.7 GB through L2 instead of 41.0, down 20.5 instead of 21.1 (Nsight Compute), but neither
// launch got shorter, and the timed passes stayed within noise at full clock and under the power cap
// (measured 2026-12-02, commit e6fa4ff): less work for the same bits.
constexpr int32_t kQuarterRows = 16;
static_assert(kQuarterRows == sched::core::kReadGroupRows, "the gathers zero the padding rows a half tile reads");
constexpr int32_t kOutsideRows = -kQuarterRows;
constexpr uint16_t kBothCtas = 0b11;  // multicast mask: both CTAs of the pair
template <bool kMulticast>
__device__ __forceinline__ void load_half_a(__nv_bfloat16* a, const CUtensorMap* map, uint64_t* full, int32_t k,
                                            int32_t row, int32_t rows) {
#pragma unroll
  for (int32_t q = 0; q < 64 / kQuarterRows; ++q) {
    __nv_bfloat16* dst = a + q * kQuarterRows * kBlockK;
    const int32_t from = q * kQuarterRows < rows ? row + q * kQuarterRows : kOutsideRows;
    if constexpr (kMulticast) {
      sm90::tma_load_2d_multicast(dst, map, full, k, from, kBothCtas);
    } else {
      sm90::tma_load_2d(dst, map, full, k, from);
    }
  }
}

// K block `k` of tile `t` into `stage`. A shared operand (kShare) is loaded half by each CTA of the
// cluster, each half into both CTAs; the rest by this CTA for itself. Either way each CTA's `full`
// barrier receives the whole stage, stage_bytes<kHalfA>. NOTES: kShare is a template parameter, and a
// stage that shares nothing takes the unsplit boxes, because the producer's time per stage is on the
// critical path (about three stages of slack against the load latency): with split boxes and
// run-time choices per box, launches without clusters ran 5-10% slower.
// kHalfA (row modes): the tile's rows 64-127 are padding (a half tile, warpgroup 1 idle), so only
// rows 0-63 of A are loaded: at deepseek-v3 about a third of the tiles, 8 KB less per stage each.
// kFoldTile: the tile folds its expert's tail (tile_scheduler.h), whose first kFoldRows rows come too
// (a_fold boxes; shared: both tiles fold the same tail, and rank 0 loads it for both).
template <Mode kMode, bool kHalfA, bool kFoldTile>
constexpr uint32_t stage_bytes() {
  return Config<kMode>::kStageBytes - (kHalfA ? 64 * kBlockK * sizeof(__nv_bfloat16) : 0) +
         (kFoldTile ? kFoldRows * kBlockK * sizeof(__nv_bfloat16) : 0);
}

template <Mode kMode, bool kFold, Shared kShare, bool kHalfA, bool kFoldTile>
__device__ __forceinline__ void load_stage(SharedStorage<kMode, kFold>& smem, int stage, const Tile& t, int32_t k,
                                           uint32_t rank, const OperandMaps& maps, const Params& p) {
  using C = Config<kMode, kFold>;
  static_assert(!kFoldTile || (kFold && !kHalfA), "a folded tail follows a whole block");
  uint64_t* full = &smem.full[stage];
  __nv_bfloat16* a = smem.a[stage];
  __nv_bfloat16* b = smem.b[stage][0];
  if constexpr (kMode == Mode::kWeightGrad) {
    // One load per operand: A's 128 columns and B's 256 of the row buffers' 64 rows from k, as [64
    // rows, 64 columns] blocks side by side (make_tma_2d_chunks). NOTES: one thread issues every load of
    // the CTA, and a weight-gradient tile is short (8 K blocks at qwen3-30b-a3b): with a load per block,
    // 6 per stage, the stretch of the producer that issues them held about a third of its samples
    // (measured 2026-12-01, commit db2c085).
    sm90::tma_load_3d(a, maps.a, full, 0, k, t.a_row / 64);
    sm90::tma_load_3d(b, maps.b0, full, 0, k, t.b_row / 64);
  } else {
    // A: [BLOCK_M, BLOCK_K] in one box; shared: the [64, 64] half `rank`. A half tile: rows 0-63 only,
    // in 16-row boxes (load_half_a; shared: both tiles are halves of the same block, and rank 0 loads
    // them for both).
    if constexpr (kShare == Shared::kA && kHalfA) {
      if (rank == 0) load_half_a<true>(a, maps.a_quarter, full, k, t.a_row, t.rows);
    } else if constexpr (kShare == Shared::kA) {
      sm90::tma_load_2d_multicast(a + rank * 64 * kBlockK, maps.a_half, full, k, t.a_row + 64 * int32_t(rank), kBothCtas);
    } else if constexpr (kHalfA) {
      load_half_a<false>(a, maps.a_quarter, full, k, t.a_row, t.rows);
    } else {
      sm90::tma_load_2d(a, maps.a, full, k, t.a_row);
    }
    if constexpr (kFoldTile) {
      if constexpr (kShare == Shared::kA) {
        if (rank == 0) sm90::tma_load_2d_multicast(smem.tail.box[stage], maps.a_fold, full, k, t.a_row + kBlockM, kBothCtas);
      } else {
        sm90::tma_load_2d(smem.tail.box[stage], maps.a_fold, full, k, t.a_row + kBlockM);
      }
    }
    // B; shared: the first half from rank 0, the second from rank 1.
    if constexpr (kMode == Mode::kRowsMnB) {  // [64 K, 64 N] boxes, kBlockN / 64 = 4 of them
      const bool second = k >= p.k_split;
      const CUtensorMap* map = second ? maps.b1 : maps.b0;
      const int32_t kr = second ? k - p.k_split : k;
      if constexpr (kShare == Shared::kB) {
        for (int j = 2 * int(rank); j < 2 * int(rank) + 2; ++j) {
          sm90::tma_load_3d_multicast(b + j * 64 * kBlockK, map, full, t.b_row + 64 * j, kr, t.expert, kBothCtas);
        }
      } else {
        for (int j = 0; j < C::kBlockN / 64; ++j) sm90::tma_load_3d(b + j * 64 * kBlockK, map, full, t.b_row + 64 * j, kr, t.expert);
      }
    } else if constexpr (C::kSwiGLU) {  // gate and up: [128, 64] each
      if constexpr (kShare == Shared::kB) {
        sm90::tma_load_3d_multicast(smem.b[stage][rank], rank == 0 ? maps.b0 : maps.b1, full, k, t.b_row, t.expert, kBothCtas);
      } else {
        sm90::tma_load_3d(smem.b[stage][0], maps.b0, full, k, t.b_row, t.expert);
        sm90::tma_load_3d(smem.b[stage][1], maps.b1, full, k, t.b_row, t.expert);
      }
    } else {  // [256, 64] in one box; shared: [128, 64] halves
      if constexpr (kShare == Shared::kB) {
        sm90::tma_load_3d_multicast(b + rank * 128 * kBlockK, maps.b_half, full, k, t.b_row + 128 * int32_t(rank), t.expert, kBothCtas);
      } else {
        sm90::tma_load_3d(b, maps.b0, full, k, t.b_row, t.expert);
      }
    }
  }
}

// Every K block of tile `t` (stage_tile `tile` on the first) through the pipeline.
template <Mode kMode, bool kFold, Shared kShare, bool kHalfA, bool kFoldTile>
__device__ __forceinline__ void load_tile_as(SharedStorage<kMode, kFold>& smem, int& stage, uint32_t& phase,
                                             const Tile& t, int32_t tile, uint32_t rank, const OperandMaps& maps,
                                             const Params& p) {
  for (int32_t kb = 0; kb < t.k_blocks; ++kb) {
    sm90::mbarrier_wait(&smem.empty[stage], phase ^ 1, p.status, sm90::Wait::kEmptyStage, tile);
    smem.stage_tile[stage] = kb == 0 ? tile : kNoTile;
    if (kb == 0) smem.stage_info[stage] = t;
    sm90::mbarrier_arrive_expect_tx(&smem.full[stage], stage_bytes<kMode, kHalfA, kFoldTile>());
    load_stage<kMode, kFold, kShare, kHalfA, kFoldTile>(smem, stage, t, t.k0 + kb * kBlockK, rank, maps, p);
    if (++stage == Config<kMode>::kStages) stage = 0, phase ^= 1;
  }
}

// A half tile (the consumers' `idle` rule for warpgroup 1) takes the stages with half of A, a tile
// that folds a tail the stages with its rows.
template <Mode kMode, bool kFold, Shared kShare>
__device__ __forceinline__ void load_tile(SharedStorage<kMode, kFold>& smem, int& stage, uint32_t& phase,
                                          const Tile& t, int32_t tile, uint32_t rank, const OperandMaps& maps,
                                          const Params& p) {
  if (is_half_tile<kMode>(t)) {
    load_tile_as<kMode, kFold, kShare, true, false>(smem, stage, phase, t, tile, rank, maps, p);
  } else if (kFold && t.fold > 0) {
    load_tile_as<kMode, kFold, kShare, false, kFold>(smem, stage, phase, t, tile, rank, maps, p);
  } else {
    load_tile_as<kMode, kFold, kShare, false, false>(smem, stage, phase, t, tile, rank, maps, p);
  }
}

// A stage without data, marked `marker` for the consumers (the end, a tile without K blocks, a
// padding tile's stages), with the decoded tile `t` for a marker that names one.
template <Mode kMode, bool kFold>
__device__ __forceinline__ void pass_stage(SharedStorage<kMode, kFold>& smem, int& stage, uint32_t& phase, int32_t marker,
                                           const Tile& t, int32_t tile, const Params& p) {
  sm90::mbarrier_wait(&smem.empty[stage], phase ^ 1, p.status, sm90::Wait::kEmptyStage, tile);
  smem.stage_tile[stage] = marker;
  if (marker != kNoTile && marker != kDone) smem.stage_info[stage] = t;
  sm90::mbarrier_arrive(&smem.full[stage]);
  if (++stage == Config<kMode>::kStages) stage = 0, phase ^= 1;
}

// ---- producer: one thread walks the units and issues every TMA load of this CTA's tiles ----
// NOTES: static order: cluster c takes units c, c + clusters, ...; in order: the claims CTA (rank 0,
// or every CTA without clusters) claims units from the ticket. Both CTAs of a cluster go through the
// same number of stages per unit (a padding tile passes as many as a real one), so their stage
// sequences stay paired: a stage's empty barrier counts both CTAs' consumers, and a multicast into
// the partner's stage waits on this CTA's own barrier.
// The tile's decoding: tile_at, with the launch's fold as a template argument in the row modes.
// NOTES: ptxas holds the producer to kProducerRegs, and a run-time choice between the two row
// decodings spilled in cluster units (two tiles to decode).
template <Mode kMode, bool kFold>
__device__ __forceinline__ Tile decode_tile(const TileGrid& g, int32_t tile) {
  if constexpr (kMode == Mode::kWeightGrad) {
    return tile_at(g, tile);
  } else {
    return row_tile_at<kFold>(g, tile);
  }
}

template <Mode kMode, bool kFold>
__device__ __forceinline__ void producer(SharedStorage<kMode, kFold>& smem, const OperandMaps& maps, const Params& p,
                                         uint32_t rank) {
  using C = Config<kMode, kFold>;
  const int32_t cluster = C::kMayPair ? p.cluster : 1;
  const int32_t tiles = tile_count(p.grid);
  const int32_t units = (tiles + cluster - 1) / cluster;
  const int32_t clusters = int32_t(gridDim.x) / cluster;
  const bool claims = p.in_order && rank == 0;
  int stage = 0;
  uint32_t phase = 0;
  // In order, the next unit's claim is in flight while this unit loads.
  int32_t ticket = claims ? claim_ticket(p) : int32_t(blockIdx.x) / cluster;
  for (int32_t n = 0;; ++n) {
    int32_t unit = ticket < units ? ticket : kDone;
    if (cluster > 1 && p.in_order) unit = rank == 0 ? post_unit(smem, n, unit, p.status) : take_unit(smem, n, p.status);
    if (unit != kDone) ticket = claims ? claim_ticket(p) : ticket + clusters;
    const int32_t tile = unit == kDone ? kDone : unit * cluster + int32_t(rank);
#if LYNX_EXPERIMENTS
    if (tile == p.stall_task) break;  // test hook: this CTA never fills the stage its consumers wait on
#endif
    // The consumers learn each tile, decoded, from its first stage (stage_tile and stage_info, written
    // before the arrive, whose release orders them before their acquiring wait); the end, and a tile
    // without K blocks (an expert without rows in weight-grad mode), take a stage with no data.
    Tile t{};
    Shared share = Shared::kNone;
    const bool pad = tile >= tiles;
    if (tile != kDone) {
      if (pad) {
        t.k_blocks = p.grid.k_blocks;
      } else if (cluster > 1) {
        const int32_t first = unit * cluster;
        const Tile t0 = decode_tile<kMode, kFold>(p.grid, first);
        if (first + 1 < tiles) {
          const Tile t1 = decode_tile<kMode, kFold>(p.grid, first + 1);
          share = shared_operand(t0, t1);
          t = rank == 0 ? t0 : t1;
        } else {
          t = t0;
        }
      } else {
        t = decode_tile<kMode, kFold>(p.grid, tile);
      }
    }
    if (tile == kDone || t.k_blocks == 0) {
      pass_stage(smem, stage, phase, tile, t, tile, p);
      if (tile == kDone) break;
      continue;
    }
    if (pad) {  // no data: the stages go on in step with the partner's
      for (int32_t kb = 0; kb < t.k_blocks; ++kb) pass_stage(smem, stage, phase, kb == 0 ? kPadTile : kNoTile, t, kPadTile, p);
      continue;
    }
    // The rows of the tile's block, when the kernel gathers A itself (announced first: row_gather.cuh).
    // A folded tail's rows are the next block's.
    if (kMode != Mode::kWeightGrad && p.gather.src && p.gather.awaited) {
      await_gathered_rows(p.gather, t.a_row / kBlockM, tile, p.status);
      if (kFold && t.fold > 0) await_gathered_rows(p.gather, t.a_row / kBlockM + 1, tile, p.status);
    }
    if (share == Shared::kA) {
      load_tile<kMode, kFold, C::kMayPair ? Shared::kA : Shared::kNone>(smem, stage, phase, t, tile, rank, maps, p);
    } else if (share == Shared::kB) {
      load_tile<kMode, kFold, C::kMayPair ? Shared::kB : Shared::kNone>(smem, stage, phase, t, tile, rank, maps, p);
    } else {
      load_tile<kMode, kFold, Shared::kNone>(smem, stage, phase, t, tile, rank, maps, p);
    }
  }
  if (claims) finish_claims(p, clusters);
}

}  // namespace lynx::gemm::impl
