// The expert GEMM kernel's configuration per mode: threads and registers of the warp roles, the tile
// and pipeline sizes, the shared-memory layout (one struct, sizes static_asserted) and the kernel's
// parameters.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#include "common/status.h"
#include "kernels/expert_gemm/api.h"
#include "kernels/expert_gemm/row_gather.cuh"
#include "kernels/expert_gemm/tile_scheduler.h"

namespace lynx::gemm::impl {

enum class Mode { kRowsSwiGLU, kRows, kRowsMnB, kWeightGrad };

constexpr int kThreads = 384; // warpgroup 0: producer; 1 and 2: consumers
constexpr int kProducerRegs = 56;
constexpr int kConsumerRegs = 224;
// NOTES: setmaxnreg moves registers within what the CTA got at launch, 384 threads × 168 (the most
// __launch_bounds__(384, 1) allows, rounded down to 8): 56 + 2 × 224 uses it exactly. The consumers'
// increase blocks until the producer's decrease has freed enough, so a budget over the launch
// allocation deadlocks before any wait can time out (seen on the H200 with 64 + 2 × 224). ptxas holds
// the producer's code to its count: with cluster units (two tiles to decode) 40 spilled.
constexpr int kLaunchRegs = 65536 / kThreads / 8 * 8;
static_assert(kProducerRegs * 128 + 2 * kConsumerRegs * 128 <= kLaunchRegs * kThreads, "register budget");

template <Mode kMode, bool kFoldTails = false>
struct Config {
  // Folded tails (tile_scheduler.h): a tile may also compute the next block's first kFoldRows rows.
  static constexpr bool kFold = kFoldTails;
  static_assert(!kFold || kMode != Mode::kWeightGrad, "only the row modes fold tails");
  static constexpr bool kSwiGLU = kMode == Mode::kRowsSwiGLU;
  static constexpr bool kTransA = kMode == Mode::kWeightGrad;                          // A is M-major
  static constexpr bool kTransB = kMode == Mode::kRowsMnB || kMode == Mode::kWeightGrad;  // B is N-major
  static constexpr int kOperandsB = kSwiGLU ? 2 : 1;
  // NOTES: every mode computes a 128 × 256 block of products per tile (gate 128 + up 128 columns,
  // or 256 plain columns): 128 fp32 accumulators per consumer thread, 48 KB per stage, 4 stages in
  // the row modes.
  static constexpr int kBlockN = kSwiGLU ? 128 : 256;
  // NOTES: the weight gradient trades a stage for a whole [64, 256] epilogue piece per warpgroup:
  // its tiles are short (K = an expert's rows: 8 K blocks at qwen3-30b-a3b), and with [64, 128]
  // pieces the second waited for the TMA to read the first out of shared memory, ~17% of the
  // consumers' samples (measured 2026-11-29, commit 61e8b61).
  static constexpr int kStages = kMode == Mode::kWeightGrad ? 3 : 4;
  // [64, 64] boxes per epilogue piece. NOTES: folding tails takes a [kFoldRows, 64] box per stage, and
  // 4 × 48 KB stages, two [64, 128] pieces and those boxes exceed 227 KB: [64, 64] pieces then.
  static constexpr int kPieceBoxes = kMode == Mode::kWeightGrad ? 4 : kFold ? 1 : 2;
  static constexpr uint32_t kStageBytes = 2 * (kBlockM * kBlockK + kOperandsB * kBlockN * kBlockK);
  static_assert(kStageBytes == 48 * 1024, "stage size");
  // The row modes may run as clusters of two CTAs (Params::cluster; tile_scheduler.h, cluster units);
  // the weight gradient always as single CTAs.
  static constexpr bool kMayPair = kMode != Mode::kWeightGrad;
  static_assert(kClusterTiles == 2, "the kernel pairs CTAs: multicast mask 0b11, partner rank ^ 1, halves");
};

constexpr int kConsumerThreads = 256;
constexpr int kConsumerWarps = kConsumerThreads / 32;

// NOTES: an epilogue piece is 64 rows × 128 columns (16 KB) in the row modes: with four 48 KB stages,
// two pieces (one per consumer warpgroup) are all that fits in 227 KB; a 256-wide tile goes out in two
// pieces. The weight gradient's pieces are 64 × 256 (Config::kPieceBoxes, at a stage's cost).

// A folded tail's rows of each stage (tile_scheduler.h, folded tails).
template <int kStages>
struct FoldStages {
  alignas(1024) __nv_bfloat16 box[kStages][kFoldRows * kBlockK];  // [kFoldRows, BLOCK_K] bf16, 128B swizzle
};
struct NoFoldStages {};

template <Mode kMode, bool kFold = false>
struct SharedStorage {
  using C = Config<kMode, kFold>;
  alignas(1024) __nv_bfloat16 a[C::kStages][kBlockM * kBlockK];                    // [BLOCK_M, BLOCK_K] bf16, 128B swizzle
  alignas(1024) __nv_bfloat16 b[C::kStages][C::kOperandsB][C::kBlockN * kBlockK];  // [BLOCK_N, BLOCK_K] bf16, 128B swizzle
  alignas(1024) __nv_bfloat16 c[2][C::kPieceBoxes][64 * 64];  // per consumer warpgroup: [64, 64 · boxes] bf16 piece as [64, 64] boxes, 128B swizzle
  std::conditional_t<kFold, FoldStages<C::kStages>, NoFoldStages> tail;
  uint64_t full[C::kStages];   // producer -> consumers: the stage's bytes have landed
  uint64_t empty[C::kStages];  // consumers -> producers: every consumer thread here, and each consumer warp of
                               // the cluster's other CTA, is done with the stage
  int32_t stage_tile[C::kStages];  // the tile whose first K block a stage holds (kNoTile otherwise), kDone at the
                                   // end, kPadTile on a padding tile's first stage
  Tile stage_info[C::kStages];     // with a tile or kPadTile in stage_tile: that tile as the producer decoded it
  uint64_t consumers_done;  // consumers -> producer thread: every consumer thread finished its last tile
  uint64_t unit_full[2];   // in-order claims, cluster rank 1: rank 0 posted a unit into unit_slot
  uint64_t unit_empty[2];  // in-order claims, cluster rank 0: rank 1 took the unit of the slot
  int32_t unit_slot[2];    // rank 1: the units rank 0 claimed, two in flight
};
static_assert(sizeof(__nv_bfloat16) * kBlockM * kBlockK % 1024 == 0, "A stages stay 1024-byte aligned");
static_assert(sizeof(__nv_bfloat16) * 128 * kBlockK % 1024 == 0, "B stages stay 1024-byte aligned");
static_assert(Config<Mode::kRowsSwiGLU>::kOperandsB * Config<Mode::kRowsSwiGLU>::kBlockN == 256 &&
                  !Config<Mode::kRowsSwiGLU>::kTransB,
              "SwiGLU: gate and up tiles back to back form the K-major [256, BLOCK_K] operand of one m64n256k16");
static_assert(sizeof(SharedStorage<Mode::kRowsSwiGLU>) + 1024 <= 227 * 1024, "shared memory");
static_assert(sizeof(SharedStorage<Mode::kRows>) + 1024 <= 227 * 1024, "shared memory");
static_assert(sizeof(SharedStorage<Mode::kRowsMnB>) + 1024 <= 227 * 1024, "shared memory");
static_assert(sizeof(SharedStorage<Mode::kWeightGrad>) + 1024 <= 227 * 1024, "shared memory");
static_assert(sizeof(SharedStorage<Mode::kRowsSwiGLU, true>) + 1024 <= 227 * 1024, "shared memory");
static_assert(sizeof(SharedStorage<Mode::kRows, true>) + 1024 <= 227 * 1024, "shared memory");
static_assert(sizeof(SharedStorage<Mode::kRowsMnB, true>) + 1024 <= 227 * 1024, "shared memory");
static_assert(sizeof(__nv_bfloat16) * kFoldRows * kBlockK % 1024 == 0, "fold boxes stay 1024-byte aligned");

// Where an epilogue piece goes row by row (epilogue.cuh): schedule row r to row slot[r] of dst (nowhere
// where slot[r] is -1), rows `pitch` elements apart.
struct SlotRows {
  bf16_t* dst;
  const int32_t* slot;
  int32_t pitch;
};

struct Params {
  TileGrid grid;
  int32_t m;           // rows of C per expert (weight grad)
  int32_t n;
  int32_t out_split;   // weight grad: rows >= out_split go to tma_c1 (row - out_split); else INT32_MAX
  int32_t k_split;     // kRowsMnB: K rows [0, k_split) come from B0, the rest from B1
  bool out_gate_up;    // SwiGLU: the gate and up products go out too, row by row (gate_rows, up_rows)
  SlotRows gate_rows, up_rows;
  DeviceStatus* status;
  bool in_order;       // tiles claimed in order from `tickets`; else the static round robin
  int32_t cluster;     // CTAs per cluster: 1, or kClusterTiles (row modes; plan/tiles.h)
  int32_t* tickets;    // [2] device: next tile to claim, CTAs finished claiming; zero between launches
#if LYNX_EXPERIMENTS
  int32_t stall_task = -1;  // test hook: the producer stops at this tile, so its consumers must time out
#endif
  RowGather gather;    // row modes: A gathered by the kernel itself (gather.src set; row_gather.cuh)
  bool swapped;        // row modes: a warpgroup with 1-16 rows swaps the operands (swapped_products)
  // kRemote kernels (R > 1): where the gather reads each row. Last, so that the one-rank kernels'
  // parameters keep their offsets.
  RowSources sources;
};

constexpr int32_t kNoTile = -1;   // stage_tile: the stage continues the tile before it
constexpr int32_t kDone = -2;     // stage_tile: no tiles are left; the stage holds no data
constexpr int32_t kPadTile = -3;  // stage_tile: rank 1's tile of the last unit is past the last tile; its
                                  // K blocks' stages hold no data and are passed on in step with rank 0

// A row-mode tile whose rows 64-127 are padding (half_tile; weight grad has none: its Tile::rows
// counts K).
template <Mode kMode>
__device__ __forceinline__ bool is_half_tile(const Tile& t) {
  return kMode != Mode::kWeightGrad && half_tile(t);
}

}  // namespace lynx::gemm::impl
