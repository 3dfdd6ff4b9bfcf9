// The grouped expert GEMM kernel: one producer warpgroup (TMA), two consumer warpgroups (wgmma,
// 64 rows each), a persistent tile scheduler (tiles claimed in order from a device ticket, or a static
// round robin; choose_tile_order).
// Four modes share the pipeline (A_e = the expert's block of schedule rows):
//   kRowsSwiGLU  C_e = silu(A_e·Gᵀ) ⊙ (A_e·Uᵀ)   G, U: [E, N, K] (K-major)
//   kRows        C_e = A_e · Bᵀ                   B: [E, N, K] (K-major)
//   kRowsMnB     C_e = A_e · [B0; B1]             B0: [E, K0, N], B1: [E, K - K0, N] (N-major)
//   kWeightGrad  C_e = A_eᵀ · B_e                 A, B: [capacity, M] and [capacity, N] row buffers
//                (M- and N-major), K = the expert's rows rounded up to 64 (padding rows hold zeros)
// Epilogue: each consumer warpgroup writes its fragments in [64, 128] pieces into its own swizzled
// shared-memory buffer and one thread stores them with TMA; the stores drain while the warpgroup
// goes on with the next tile's mainloop.
#include <cuda.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <string>
#include <type_traits>

#include "common/cuda_check.h"
#include "common/per_device.h"
#include "device/activation.cuh"
#include "device/sm90.cuh"
#include "kernels/expert_gemm/api.h"
#include "kernels/expert_gemm/row_gather.cuh"
#include "kernels/expert_gemm/tile_scheduler.h"
#include "kernels/expert_gemm/tma.h"

namespace lynx::gemm {
namespace {

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
  // consumers' samples (bench/results/2026-11-29-h200-session14.txt, section 7).
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

struct Params {
  TileGrid grid;
  int32_t m;           // rows of C per expert (weight grad)
  int32_t n;
  int32_t out_split;   // weight grad: rows >= out_split go to tma_c1 (row - out_split); else INT32_MAX
  int32_t k_split;     // kRowsMnB: K rows [0, k_split) come from B0, the rest from B1
  bool out_gate_up;    // SwiGLU: the gate and up products go out too (tma_c1, tma_c2)
  DeviceStatus* status;
  bool in_order;       // tiles claimed in order from `tickets`; else the static round robin
  int32_t cluster;     // CTAs per cluster: 1, or kClusterTiles (row modes; use_cluster_units)
  int32_t* tickets;    // [2] device: next tile to claim, CTAs finished claiming; zero between launches
#if LYNX_EXPERIMENTS
  int32_t stall_task;  // test hook: the producer stops at this tile, so its consumers must time out
#endif
  RowGather gather;    // row modes: A gathered by the kernel itself (gather.src set; row_gather.cuh)
  bool swapped;        // row modes: a warpgroup with 1-16 rows swaps the operands (swapped_products)
};

constexpr int32_t kNoTile = -1;   // stage_tile: the stage continues the tile before it
constexpr int32_t kDone = -2;     // stage_tile: no tiles are left; the stage holds no data
constexpr int32_t kPadTile = -3;  // stage_tile: rank 1's tile of the last unit is past the last tile; its
                                  // K blocks' stages hold no data and are passed on in step with rank 0

// ---- tile scheduler: the producer thread picks each tile; the consumers learn it from its first stage ----
// NOTES: in order (p.in_order): a static round robin lets CTAs drift apart over the waves, so the tiles
// that share a weight tile or a row block (neighbours in tile_at's raster) run apart in time and
// re-read their operands from DRAM; claims from a ticket keep neighbours together. Which CTA computes
// a tile does not change its bits: each tile is still computed whole, over its K in order. When each
// order wins: choose_tile_order.
__device__ __forceinline__ int32_t claim_ticket(const Params& p) { return atomicAdd(&p.tickets[0], 1); }

// The last of the `claimers` CTAs to finish claiming zeroes the counters for the next launch on the stream.
__device__ __forceinline__ void finish_claims(const Params& p, int32_t claimers) {
  __threadfence();  // this CTA's last claim is ordered before its count
  if (atomicAdd(&p.tickets[1], 1) == claimers - 1) {
    atomicExch(&p.tickets[0], 0);
    atomicExch(&p.tickets[1], 0);
  }
}

// Two fp32 values as the bf16 pair of one stmatrix register (round to nearest).
__device__ __forceinline__ uint32_t bf16x2_bits(float2 v) {
  const __nv_bfloat162 packed = __floats2bfloat162_rn(v.x, v.y);
  return *reinterpret_cast<const uint32_t*>(&packed);
}

// Stores the boxes of warpgroup `wg`'s epilogue piece at (col, row[, batch]) of `map`, once all of its
// threads have written them; columns at or past n are not stored.
template <bool k3d, int kPieceBoxes>
__device__ __forceinline__ void store_piece_boxes(__nv_bfloat16 (&buf)[kPieceBoxes][64 * 64], const CUtensorMap* map,
                                                  int wg, int32_t col, int32_t row, int32_t batch, int32_t n) {
  sm90::fence_proxy_async_shared();
  sm90::named_barrier_sync(1 + wg, 128);
  if (threadIdx.x % 128 == 0) {
#pragma unroll
    for (int b = 0; b < kPieceBoxes; ++b) {
      if (col + 64 * b >= n) break;
      if constexpr (k3d) {
        sm90::tma_store_3d(map, buf[b], col + 64 * b, row, batch);
      } else {
        sm90::tma_store_2d(map, buf[b], col + 64 * b, row);
      }
    }
    sm90::bulk_commit_group();
  }
}

// One epilogue piece of consumer warpgroup `wg`: 64 rows × 64·kPieceBoxes columns, value(j, r) giving the two
// fp32 values of fragment column group j (columns 8j + 2(lane % 4) + {0, 1}) in row half r, stored at
// (col, row[, batch]) of `map`. Columns at or past n are not stored.
template <bool k3d, int kPieceBoxes, class Value>
__device__ __forceinline__ void store_piece(__nv_bfloat16 (&buf)[kPieceBoxes][64 * 64], const CUtensorMap* map,
                                            int wg, int32_t col, int32_t row, int32_t batch, int32_t n, Value value) {
  const int thread = threadIdx.x % 128, warp = thread / 32, lane = thread % 32;
  // The previous piece's store must be done reading the buffer before it is overwritten.
  if (thread == 0) sm90::bulk_wait_group_read<0>();
  sm90::named_barrier_sync(1 + wg, 128);
  // One stmatrix.x4 per two column groups: matrices (j, r) = (2q, 0), (2q, 1), (2q + 1, 0), (2q + 1, 1),
  // the lane's fragment values as they are. Lane t addresses row t % 8 of matrix t / 8: piece row
  // R = 16 warp + 8 (t / 8 % 2) + t % 8, column group 2q + t / 16. 128-byte swizzle: 16-byte chunk
  // j % 8 of row R sits at chunk (j % 8) ^ (R % 8); rows are 128-byte aligned, so the XOR acts on the
  // address, and R % 8 = t % 8.
  const uint32_t lane_base = sm90::smem_addr(buf[0]) + (warp * 16 + (lane / 8 % 2) * 8 + lane % 8) * 128 +
                             (((lane / 16) ^ (lane % 8)) * 16);
  const auto pack = [&](int j, int r) { return bf16x2_bits(value(j, r)); };
#pragma unroll
  for (int q = 0; q < 4 * kPieceBoxes; ++q) {
    const uint32_t at = (lane_base ^ (((2 * q) % 8) * 16)) + (q / 4) * 64 * 64 * 2;
    sm90::stmatrix_x4(at, pack(2 * q, 0), pack(2 * q, 1), pack(2 * q + 1, 0), pack(2 * q + 1, 1));
  }
  store_piece_boxes<k3d>(buf, map, wg, col, row, batch, n);
}

// One epilogue piece of a warpgroup whose products were swapped (swapped_products): its [64, 64]
// boxes b get rows 0-15 from value(b, i), the two fp32 values of fragment registers i, i + 1 (i = 4j +
// 2h) of the box's [64 columns, 16 rows] product, and zeros in rows 16-63 (padding rows, which every
// piece stores as zeros). Stored at (col, row) of `map`; columns at or past n are not stored.
template <int kPieceBoxes, class Value>
__device__ __forceinline__ void store_swapped_piece(__nv_bfloat16 (&buf)[kPieceBoxes][64 * 64],
                                                    const CUtensorMap* map, int wg, int32_t col, int32_t row,
                                                    int32_t n, Value value) {
  const int thread = threadIdx.x % 128, warp = thread / 32, lane = thread % 32;
  if (thread == 0) sm90::bulk_wait_group_read<0>();
  sm90::named_barrier_sync(1 + wg, 128);
  // Rows 16-63: 48 rows of 128 bytes per box, three 16-byte stores per thread and box.
#pragma unroll
  for (int b = 0; b < kPieceBoxes; ++b) {
#pragma unroll
    for (int u = 0; u < 3; ++u) {
      const int chunk = thread + 128 * u;
      *reinterpret_cast<uint4*>(&buf[b][(16 + chunk / 8) * 64 + (chunk % 8) * 8]) = make_uint4(0, 0, 0, 0);
    }
  }
  // Rows 0-15: one stmatrix.x4.trans per box. Matrix 2j + h of a warp holds the product's rows 16w +
  // 8h .. + 7 (the box's columns) × columns 8j .. + 7 (the box's rows), stored transposed: lane t
  // addresses box row 8j + t % 8 (j, h from t / 8), where the warp's 8 columns are 16-byte chunk
  // 2w + h, swizzled to (2w + h) ^ (t % 8).
  const int mi = lane / 8, h = mi % 2, j = mi / 2, rho = lane % 8;
  const uint32_t lane_off = (8 * j + rho) * 128 + (((2 * warp + h) ^ rho) * 16);
  const auto pack = [&](int b, int i) { return bf16x2_bits(value(b, i)); };
#pragma unroll
  for (int b = 0; b < kPieceBoxes; ++b) {
    sm90::stmatrix_x4_trans(sm90::smem_addr(buf[b]) + lane_off, pack(b, 0), pack(b, 2), pack(b, 4), pack(b, 6));
  }
  store_piece_boxes<false>(buf, map, wg, col, row, 0, n);
}

// The epilogue box of a folded tail (tile_scheduler.h): the [64 columns, kFoldRows rows] product of
// one weight slice, transposed into rows 0 .. kFoldRows - 1 of a [64, 64] box, and zeros in rows
// kFoldRows .. 63 (padding rows, which every piece stores as zeros). value(i): the two fp32 values of
// fragment registers i, i + 1, i = 4j + 2h: product row 16w + l/4 + 8h, columns 8j + 2(l%4) + {0, 1}.
// Stored at (col, row) of `map`; columns at or past n are not stored.
template <class Value>
__device__ __forceinline__ void store_fold_box(__nv_bfloat16 (&buf)[1][64 * 64], const CUtensorMap* map, int wg,
                                               int32_t col, int32_t row, int32_t n, Value value) {
  const int thread = threadIdx.x % 128, warp = thread / 32, lane = thread % 32;
  if (thread == 0) sm90::bulk_wait_group_read<0>();
  sm90::named_barrier_sync(1 + wg, 128);
  constexpr int kZeroChunks = (64 - kFoldRows) * 8;  // 16-byte chunks of rows kFoldRows .. 63
#pragma unroll
  for (int chunk = thread; chunk < kZeroChunks; chunk += 128) {
    *reinterpret_cast<uint4*>(&buf[0][(kFoldRows + chunk / 8) * 64 + (chunk % 8) * 8]) = make_uint4(0, 0, 0, 0);
  }
  // Rows 0 .. kFoldRows - 1: one stmatrix.trans of kFoldRows / 4 matrices. Matrix 2j + h of a warp
  // holds the product's rows 16w + 8h .. + 7 (the box's columns) × its columns 8j .. + 7 (the box's
  // rows), stored transposed: lane t addresses box row 8j + t % 8 (j, h from t / 8), where the warp's
  // 8 columns are 16-byte chunk 2w + h, swizzled to (2w + h) ^ (t % 8).
  const int mi = lane / 8, h = mi % 2, j = mi / 2 % (kFoldRows / 8), rho = lane % 8;
  const uint32_t at = sm90::smem_addr(buf[0]) + (8 * j + rho) * 128 + (((2 * warp + h) ^ rho) * 16);
  if constexpr (kFoldRows == 8) {
    sm90::stmatrix_x2_trans(at, bf16x2_bits(value(0)), bf16x2_bits(value(2)));
  } else {
    sm90::stmatrix_x4_trans(at, bf16x2_bits(value(0)), bf16x2_bits(value(2)), bf16x2_bits(value(4)),
                            bf16x2_bits(value(6)));
  }
  store_piece_boxes<false>(buf, map, wg, col, row, 0, n);
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
// (bench/results/2026-12-02-h200-session19.txt, sections 1 and 6): less work for the same bits.
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
    // (bench/results/ncu/2026-12-01-h200-db2c085-qwen3-wgrad-stalls.txt).
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

// A row-mode tile whose rows 64-127 are padding (half_tile; weight grad has none: its Tile::rows
// counts K).
template <Mode kMode>
__device__ __forceinline__ bool is_half_tile(const Tile& t) {
  return kMode != Mode::kWeightGrad && half_tile(t);
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
    if (kMode != Mode::kWeightGrad && p.gather.src) {
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

// Releases a stage: every consumer thread arrives on this CTA's `empty` barrier (an arrive releases
// only its own thread's accesses, so each thread covers its own reads), and in a cluster each warp,
// once converged, on the partner's too, which may multicast into this CTA's stage next.
// `peer_empty`: the partner's empty[0] in the cluster's shared-memory window (sm90::peer_addr), used
// when `paired`.
template <Mode kMode, bool kFold>
__device__ __forceinline__ void release_stage(SharedStorage<kMode, kFold>& smem, int stage, bool paired, uint32_t peer_empty) {
  sm90::mbarrier_arrive(&smem.empty[stage]);
  if (Config<kMode>::kMayPair && paired) {
    __syncwarp();
    if (threadIdx.x % 32 == 0) sm90::mbarrier_arrive_remote(peer_empty + stage * sizeof(uint64_t));
  }
}

// ---- consumers: warpgroup c computes rows [64c, 64c + 64) of each tile ----
// The weight tile's 64-row slices (C's columns 64s .. 64s + 63) whose products with a folded tail
// consumer warpgroup c computes, h in [0, 2): SwiGLU's gate and up slices of the same columns,
// otherwise two neighbouring slices.
template <class C>
__device__ __forceinline__ int fold_slice(int c, int h) {
  return C::kSwiGLU ? c + 2 * h : 2 * c + h;
}

// NOTES: the consumers never trap. A consumer thread whose wait for a stage times out records the
// stall and leaves without arriving on `consumers_done`; the producer thread, waiting for every
// consumer thread there (twice the bound of a stage wait, so the consumers' report comes first),
// traps for them. ptxas fits a setmaxnreg region from which a trap is reachable into the launch
// bound (168 registers, not the consumers' 224): with traps in the consumers, folding 16-row tails
// (16 more accumulators) spilled and serialised every wgmma of the folding kernels
// (bench/results/2026-12-02-h200-session24.txt, section 2).
constexpr uint64_t kConsumersDoneNs = 2 * sm90::kMbarrierWaitNs;

template <Mode kMode, bool kFold>
__device__ __forceinline__ void consumer(SharedStorage<kMode, kFold>& smem, const CUtensorMap* tma_c0,
                                         const CUtensorMap* tma_c1, const CUtensorMap* tma_c2, const Params& p,
                                         int c, uint32_t rank) {
  using C = Config<kMode, kFold>;
  const bool paired = C::kMayPair && p.cluster > 1;
  const uint32_t peer_empty = paired ? sm90::peer_addr(&smem.empty[0], rank ^ 1) : 0;
  int stage = 0;
  uint32_t phase = 0;
  // [64, 256] fp32 per warpgroup: 256 plain columns, or gate columns 0-127 then up columns 128-255.
  float acc[128];
  // A folded tail: fold[4h .. 4h + 3] is the [64, kFoldRows] product of weight slice fold_slice(c, h)
  // and the tail's rows.
  static_assert(kFoldRows == 8 || kFoldRows == 16, "a folded tail's products are m64n8k16 or m64n16k16");
  constexpr int kFoldAcc = kFoldRows / 2;  // accumulators of one slice's [64, kFoldRows] product
  float fold[kFold ? 2 * kFoldAcc : 1];
  for (;;) {
    // The tile: from the first stage the producer filled for it (task kNoTile in a stall report: the
    // consumers were waiting to learn their next tile).
    if (!sm90::mbarrier_wait_or_record(&smem.full[stage], phase, p.status, sm90::Wait::kFullStage, kNoTile)) return;
    const int32_t tile = smem.stage_tile[stage];
    if (tile == kDone) break;
    const bool pad = tile == kPadTile;
    // NOTES: the producer's decoding, not tile_at again: its global loads (a binary search over the
    // expert offsets) sat between the first stage's arrival and the first wgmma of every tile.
    const Tile t = smem.stage_info[stage];
    // NOTES: zeroed for every tile, not only for an expert without rows (whose weight gradient must be
    // exactly zero): the wgmma operands are read-write ("+f"), so without this the compiler keeps the
    // previous tile's accumulators alive across the loop, and ptxas serialises every wgmma of this
    // kernel (each HGMMA waits for the one before; tools/sass-check): the dynamic scheduler's 7-13%
    // loss in bench/results/2026-11-29-h200-6e0170f-dynamic-tiles.txt.
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
    if constexpr (kFold) {
#pragma unroll
      for (int i = 0; i < 2 * kFoldAcc; ++i) fold[i] = 0.0f;
    }
    if (t.k_blocks == 0) {  // the stage held no data
      release_stage(smem, stage, paired, peer_empty);
      if (++stage == C::kStages) stage = 0, phase ^= 1;
    }
    // NOTES: the last row block of an expert holds 1-128 rows; when its rows 64-127 are all padding,
    // warpgroup 1 computes nothing, only passes the stages on, and stores nothing: no kernel reads the
    // rows of a 64-row half without rows (row_gather.cuh). At deepseek-v3 (128 ± 11 rows per expert)
    // about half of the experts end with such a block. A padding tile passes every stage on in both.
    // Every thread waits for each stage before it releases it, so none can fall a phase behind.
    const bool idle = pad || (c == 1 && is_half_tile<kMode>(t));
    if (idle && t.k_blocks > 0) {
      for (int32_t kb = 0; kb < t.k_blocks; ++kb) {
        if (kb > 0 && !sm90::mbarrier_wait_or_record(&smem.full[stage], phase, p.status, sm90::Wait::kFullStage, tile)) {
          return;
        }
        release_stage(smem, stage, paired, peer_empty);
        if (++stage == C::kStages) stage = 0, phase ^= 1;
      }
    }
    // Mainloop: wgmma over the K blocks; a stage is released once the wgmma group after it is issued
    // and its own group has completed (wait_group 1), so one group is always in flight.
    // Weight grad: the last K block's steps past the expert's rows are skipped (last_k_steps).
    // A warpgroup with 1-16 rows (swapped_products): acc[8s .. 8s + 7] is the [64, 16] product of the
    // weight tile's slice s (C's columns 64s .. 64s + 63) and the warpgroup's first 16 rows, s in [0, 4).
    // NOTES: a kernel that folds tails has no swapped products: beside them the fold's accumulators made
    // ptxas serialise every wgmma (bench/results/2026-12-02-h200-session23.txt, section 4).
    const bool swapped = !kFold && kMode != Mode::kWeightGrad && p.swapped && !idle && swapped_products(t, c);
    const bool folds = kFold && !idle && t.fold > 0;
    int prev_stage = -1;
    bool stalled = false;
    const int32_t last_steps = kMode == Mode::kWeightGrad ? last_k_steps(t) : kBlockK / kStepK;
    for (int32_t kb = 0; kb < (idle ? 0 : t.k_blocks); ++kb) {
      if (kb > 0 && !sm90::mbarrier_wait_or_record(&smem.full[stage], phase, p.status, sm90::Wait::kFullStage, tile)) {
        stalled = true;
        break;
      }
      // k16 steps [kk0, kk1) of the stage as one wgmma group.
      const auto mma_group = [&](int kk0, int kk1) {
        sm90::wgmma_fence();
#pragma unroll
        for (int kk = kk0; kk < kk1; ++kk) {
          // K-major tiles step 16 elements along their 128-byte rows; MN-major tiles step 16 rows.
          const uint64_t da = C::kTransA
                                  ? sm90::smem_desc_mn_major_sw128(&smem.a[stage][c * 64 * kBlockK + kk * 16 * 64])
                                  : sm90::smem_desc_k_major_sw128(&smem.a[stage][c * 64 * kBlockK + kk * 16]);
          const uint64_t db = C::kTransB ? sm90::smem_desc_mn_major_sw128(&smem.b[stage][0][kk * 16 * 64])
                                         : sm90::smem_desc_k_major_sw128(&smem.b[stage][0][kk * 16]);
          const bool accumulate = kb > 0 || kk > 0;
          // NOTES: SwiGLU: the gate and up tiles lie back to back in the stage (b[stage][0], [1]), so one
          // m64n256k16 over both reads the A slice once; two m64n128k16 read it twice, 12 KB of shared
          // memory per step and warpgroup instead of 10.
          sm90::wgmma_m64n256k16<C::kTransA, C::kTransB>(acc, da, db, accumulate);
        }
        sm90::wgmma_commit();
      };
      // The swapped products of a k16 step: the weight tile's 64-row slice s as A (MN-major when B is),
      // the warpgroup's first 16 rows as B (K-major).
      const auto swapped_group = [&]() {
        sm90::wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kBlockK / kStepK; ++kk) {
          const uint64_t db = sm90::smem_desc_k_major_sw128(&smem.a[stage][c * 64 * kBlockK + kk * 16]);
#pragma unroll
          for (int s = 0; s < 4; ++s) {
            const __nv_bfloat16* w = &smem.b[stage][0][0] + s * 64 * kBlockK;
            const uint64_t da = C::kTransB ? sm90::smem_desc_mn_major_sw128(w + kk * 16 * 64)
                                           : sm90::smem_desc_k_major_sw128(w + kk * 16);
            sm90::wgmma_m64n16k16<C::kTransB, false>(&acc[8 * s], da, db, kb > 0 || kk > 0);
          }
        }
        sm90::wgmma_commit();
      };
      // A tile that folds a tail: each k16 step's m64n256k16, then the tail's products with the
      // warpgroup's two weight slices as A and the tail's rows as B (K-major, kFoldRows rows).
      const auto fold_group = [&]() {
        if constexpr (kFold) {
          sm90::wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < kBlockK / kStepK; ++kk) {
            const uint64_t da = sm90::smem_desc_k_major_sw128(&smem.a[stage][c * 64 * kBlockK + kk * 16]);
            const uint64_t db = C::kTransB ? sm90::smem_desc_mn_major_sw128(&smem.b[stage][0][kk * 16 * 64])
                                           : sm90::smem_desc_k_major_sw128(&smem.b[stage][0][kk * 16]);
            sm90::wgmma_m64n256k16<false, C::kTransB>(acc, da, db, kb > 0 || kk > 0);
            const uint64_t dt = sm90::smem_desc_k_major_sw128(&smem.tail.box[stage][kk * 16]);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const __nv_bfloat16* w = &smem.b[stage][0][0] + fold_slice<C>(c, h) * 64 * kBlockK;
              const uint64_t dw = C::kTransB ? sm90::smem_desc_mn_major_sw128(w + kk * 16 * 64)
                                             : sm90::smem_desc_k_major_sw128(w + kk * 16);
              if constexpr (kFoldRows == 8) {
                sm90::wgmma_m64n8k16<C::kTransB, false>(&fold[kFoldAcc * h], dw, dt, kb > 0 || kk > 0);
              } else {
                sm90::wgmma_m64n16k16<C::kTransB, false>(&fold[kFoldAcc * h], dw, dt, kb > 0 || kk > 0);
              }
            }
          }
          sm90::wgmma_commit();
        }
      };
      constexpr int kSteps = kBlockK / kStepK;
      if (folds) {
        fold_group();
      } else if (swapped) {
        swapped_group();
      } else if (kMode != Mode::kWeightGrad || kb + 1 < t.k_blocks || last_steps == kSteps) {
        mma_group(0, kSteps);
      } else {
        // NOTES: a group per step, in a loop: a wgmma under a branch of its own (or a guard predicate)
        // makes ptxas serialise every wgmma of the kernel (tools/sass-check, ptxas C7520).
#pragma unroll 1
        for (int kk = 0; kk < last_steps; ++kk) mma_group(kk, kk + 1);
      }
      sm90::wgmma_wait<1>();
      if (prev_stage >= 0) release_stage(smem, prev_stage, paired, peer_empty);
      prev_stage = stage;
      if (++stage == C::kStages) stage = 0, phase ^= 1;
    }
    sm90::wgmma_wait<0>();
    if (stalled) return;
    if (prev_stage >= 0) release_stage(smem, prev_stage, paired, peer_empty);
    if (pad || (c == 1 && is_half_tile<kMode>(t))) continue;

    // Epilogue: pieces of Config::kPieceBoxes [64, 64] boxes through shared memory and TMA stores.
    const int32_t row = t.a_row + c * 64;
    if constexpr (kMode != Mode::kWeightGrad && !kFold) {
      if (swapped) {
        // Box b of a piece is slice b of its 128 columns: SwiGLU's gate slices 0-1, up slices 2-3.
        if constexpr (C::kSwiGLU) {
          store_swapped_piece(smem.c[c], tma_c0, c, t.b_row, row, p.n, [&](int b, int i) {
            const float* g = &acc[8 * b + i];
            const float* u = &acc[8 * (b + 2) + i];
            return make_float2(silu(g[0]) * u[0], silu(g[1]) * u[1]);
          });
          if (p.out_gate_up) {
            store_swapped_piece(smem.c[c], tma_c1, c, t.b_row, row, p.n,
                                [&](int b, int i) { return make_float2(acc[8 * b + i], acc[8 * b + i + 1]); });
            store_swapped_piece(smem.c[c], tma_c2, c, t.b_row, row, p.n, [&](int b, int i) {
              return make_float2(acc[8 * (b + 2) + i], acc[8 * (b + 2) + i + 1]);
            });
          }
        } else {
#pragma unroll
          for (int q = 0; q < 2; ++q) {
            store_swapped_piece(smem.c[c], tma_c0, c, t.b_row + 128 * q, row, p.n, [&](int b, int i) {
              return make_float2(acc[8 * (2 * q + b) + i], acc[8 * (2 * q + b) + i + 1]);
            });
          }
        }
        continue;
      }
    }
    if constexpr (kMode == Mode::kWeightGrad) {
      if (row < p.m) {
        const bool second = row >= p.out_split;
        const CUtensorMap* map = second ? tma_c1 : tma_c0;
        const int32_t out_row = second ? row - p.out_split : row;
        store_piece<true>(smem.c[c], map, c, t.b_row, out_row, t.expert, p.n,
                          [&](int j, int r) { return make_float2(acc[4 * j + 2 * r], acc[4 * j + 2 * r + 1]); });
      }
    } else if constexpr (C::kSwiGLU) {
      // Column group j of piece q is the tile's group kGroups · q + j of 16 (gate in acc[0 .. 63], up in
      // acc[64 .. 127]).
      constexpr int kGroups = 8 * C::kPieceBoxes;
#pragma unroll
      for (int q = 0; q < 16 / kGroups; ++q) {
        store_piece<false>(smem.c[c], tma_c0, c, t.b_row + 8 * kGroups * q, row, 0, p.n, [&](int j, int r) {
          const int i = 4 * (kGroups * q + j) + 2 * r;
          return make_float2(silu(acc[i]) * acc[64 + i], silu(acc[i + 1]) * acc[64 + i + 1]);
        });
      }
      if (p.out_gate_up) {
#pragma unroll
        for (int q = 0; q < 16 / kGroups; ++q) {
          store_piece<false>(smem.c[c], tma_c1, c, t.b_row + 8 * kGroups * q, row, 0, p.n, [&](int j, int r) {
            const int i = 4 * (kGroups * q + j) + 2 * r;
            return make_float2(acc[i], acc[i + 1]);
          });
        }
#pragma unroll
        for (int q = 0; q < 16 / kGroups; ++q) {
          store_piece<false>(smem.c[c], tma_c2, c, t.b_row + 8 * kGroups * q, row, 0, p.n, [&](int j, int r) {
            const int i = 64 + 4 * (kGroups * q + j) + 2 * r;
            return make_float2(acc[i], acc[i + 1]);
          });
        }
      }
    } else {
      constexpr int kGroups = 8 * C::kPieceBoxes;  // fragment column groups (8 columns each) per piece
#pragma unroll
      for (int q = 0; q < C::kBlockN / (8 * kGroups); ++q) {
        store_piece<false>(smem.c[c], tma_c0, c, t.b_row + 8 * kGroups * q, row, 0, p.n, [&](int j, int r) {
          return make_float2(acc[4 * (kGroups * q + j) + 2 * r], acc[4 * (kGroups * q + j) + 2 * r + 1]);
        });
      }
    }
    // The folded tail's rows: warpgroup c's columns of them (fold_slice), a [64, 64] box per slice
    // at the tail block's first row.
    if constexpr (kFold) {
      if (folds) {
        const int32_t tail_row = t.a_row + kBlockM;
        if constexpr (C::kSwiGLU) {
          const int32_t col = t.b_row + 64 * c;
          const float* g = fold;
          const float* u = fold + kFoldAcc;
          store_fold_box(smem.c[c], tma_c0, c, col, tail_row, p.n, [&](int i) {
            return make_float2(silu(g[i]) * u[i], silu(g[i + 1]) * u[i + 1]);
          });
          if (p.out_gate_up) {
            store_fold_box(smem.c[c], tma_c1, c, col, tail_row, p.n, [&](int i) { return make_float2(g[i], g[i + 1]); });
            store_fold_box(smem.c[c], tma_c2, c, col, tail_row, p.n, [&](int i) { return make_float2(u[i], u[i + 1]); });
          }
        } else {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            store_fold_box(smem.c[c], tma_c0, c, t.b_row + 64 * fold_slice<C>(c, h), tail_row, p.n,
                           [&](int i) { return make_float2(fold[kFoldAcc * h + i], fold[kFoldAcc * h + i + 1]); });
          }
        }
      }
    }
  }
  // The stores must finish before the CTA's shared memory goes away.
  if (threadIdx.x % 128 == 0) sm90::bulk_wait_group<0>();
  sm90::mbarrier_arrive(&smem.consumers_done);
}

template <Mode kMode, bool kFold>
__global__ void __launch_bounds__(kThreads, 1)
    expert_gemm_kernel(const __grid_constant__ CUtensorMap tma_a, const __grid_constant__ CUtensorMap tma_a_half,
                       const __grid_constant__ CUtensorMap tma_a_quarter, const __grid_constant__ CUtensorMap tma_a_fold,
                       const __grid_constant__ CUtensorMap tma_b0, const __grid_constant__ CUtensorMap tma_b1,
                       const __grid_constant__ CUtensorMap tma_b_half, const __grid_constant__ CUtensorMap tma_c0,
                       const __grid_constant__ CUtensorMap tma_c1, const __grid_constant__ CUtensorMap tma_c2,
                       const Params p) {
  using C = Config<kMode, kFold>;
  const bool paired = C::kMayPair && p.cluster > 1;
  extern __shared__ uint8_t smem_raw[];
  // NOTES: the dynamic shared memory starts at the same address in every CTA, so the aligned storage,
  // and each stage, sits at the same offset in both CTAs of a cluster, as multicast loads require.
  auto& smem =
      *reinterpret_cast<SharedStorage<kMode, kFold>*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const uint32_t rank = paired ? sm90::cluster_rank() : 0;

  const int warpgroup = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    for (int s = 0; s < C::kStages; ++s) {
      sm90::mbarrier_init(&smem.full[s], 1);
      sm90::mbarrier_init(&smem.empty[s], kConsumerThreads + (paired ? kConsumerWarps : 0));
      smem.stage_tile[s] = kNoTile;
    }
    sm90::mbarrier_init(&smem.consumers_done, kConsumerThreads);
    for (int s = 0; s < 2; ++s) {
      sm90::mbarrier_init(&smem.unit_full[s], 1);
      sm90::mbarrier_init(&smem.unit_empty[s], 1);
    }
    sm90::fence_barrier_init();
  }
  // The partner's barriers must be initialised before this CTA arrives on them or multicasts to them.
  if (paired) {
    sm90::cluster_sync();
  } else {
    __syncthreads();
  }

  if (warpgroup == 0) {
    sm90::setmaxnreg_dec<kProducerRegs>();
    if (threadIdx.x == 0) {
      sm90::prefetch_tma_descriptor(&tma_a);
      sm90::prefetch_tma_descriptor(&tma_b0);
      if constexpr (C::kSwiGLU || kMode == Mode::kRowsMnB) sm90::prefetch_tma_descriptor(&tma_b1);
      producer(smem, OperandMaps{&tma_a, &tma_a_half, &tma_a_quarter, &tma_a_fold, &tma_b0, &tma_b1, &tma_b_half}, p,
               rank);
      sm90::mbarrier_wait(&smem.consumers_done, 0, p.status, sm90::Wait::kConsumersDone, kNoTile, kConsumersDoneNs);
    } else if (kMode != Mode::kWeightGrad && p.gather.src && threadIdx.x >= 32) {
      gather_rows_warp(p.gather, p.grid);  // warps 1-3
    }
  } else {
    sm90::setmaxnreg_inc<kConsumerRegs>();
    consumer(smem, &tma_c0, &tma_c1, &tma_c2, p, warpgroup - 1, rank);
  }
  // NOTES: no CTA of a cluster leaves while its partner may still arrive on its barriers or multicast
  // into its stages. This wait is not bounded itself, but each of the partner's waits is: a stalled
  // partner traps, and the trap ends the grid.
  if (paired) sm90::cluster_sync();
  if constexpr (kMode != Mode::kWeightGrad) {
    if (p.gather.src) finish_gather(p.gather, p.grid);
  }
}

// The operand maps (OperandMaps) and the output maps (C0, C1, C2) of one launch.
struct Maps {
  CUtensorMap a, a_half, a_quarter, a_fold, b0, b1, b_half, c0, c1, c2;
};

cudaLaunchConfig_t launch_config(int grid, size_t smem, cudaStream_t stream, cudaLaunchAttribute* cluster) {
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = cluster;
  config.numAttrs = cluster ? 1 : 0;
  return config;
}

cudaLaunchAttribute pair_attribute() {
  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = kClusterTiles;
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  return cluster;
}

// Once per device and mode: the kernel's shared-memory limit (a per-device attribute) and, for the
// modes that may pair, how many clusters can be resident at once (the GPCs may leave an SM without a
// partner). Returns that count (0 for the weight gradient). prepare_expert_gemm_kernels runs it when a
// fused workspace is made, so that no launch, captured in a graph or not, is the first to.
template <Mode kMode, bool kFold>
int prepare(int sm_count) {
  constexpr size_t kSmem = sizeof(SharedStorage<kMode, kFold>) + 1024;
  static detail::PerDeviceCache resident_clusters;  // -1: prepared, never pairs
  const int clusters = detail::per_device(resident_clusters, [&](int) {
    LYNX_CUDA(cudaFuncSetAttribute(expert_gemm_kernel<kMode, kFold>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   int(kSmem)));
    int n = -1;
    if (Config<kMode>::kMayPair) {
      cudaLaunchAttribute pair = pair_attribute();
      const cudaLaunchConfig_t config =
          launch_config(std::max(sm_count / kClusterTiles, 1) * kClusterTiles, kSmem, nullptr, &pair);
      LYNX_CUDA(cudaOccupancyMaxActiveClusters(&n, expert_gemm_kernel<kMode, kFold>, &config));
      if (n < 1) throw Error("", "internal: no cluster of two expert GEMM CTAs fits the GPU");
    }
    return n;
  });
  return std::max(clusters, 0);
}

template <Mode kMode, bool kFold>
void launch_as(const Maps& m, const Params& p, int sm_count, cudaStream_t stream) {
  constexpr size_t kSmem = sizeof(SharedStorage<kMode, kFold>) + 1024;
  const int resident = prepare<kMode, kFold>(sm_count);
  cudaLaunchAttribute pair = pair_attribute();
  const cudaLaunchConfig_t config =
      p.cluster > 1 ? launch_config(std::max(1, std::min(sm_count / kClusterTiles, resident)) * kClusterTiles, kSmem,
                                    stream, &pair)
                    : launch_config(sm_count, kSmem, stream, nullptr);
  LYNX_CUDA(cudaLaunchKernelEx(&config, expert_gemm_kernel<kMode, kFold>, m.a, m.a_half, m.a_quarter, m.a_fold, m.b0,
                               m.b1, m.b_half, m.c0, m.c1, m.c2, p));
  LYNX_CHECK_LAUNCH();
}

// The kernel that folds tails when the launch does (Params::grid.block_offset), else the one that does not.
template <Mode kMode>
void launch(const Maps& m, const Params& p, int sm_count, cudaStream_t stream) {
  if constexpr (kMode != Mode::kWeightGrad) {
    if (p.grid.block_offset) return launch_as<kMode, true>(m, p, sm_count, stream);
  }
  launch_as<kMode, false>(m, p, sm_count, stream);
}

void check(bool ok, const char* what) {
  if (!ok) throw Error("", std::string("internal: expert GEMM sizes not supported: ") + what);
}

// What the L2 fetches for each line of the weights (B) a row mode misses: the 256-byte block for
// gate/up, the line alone for the others. NOTES: the row launches other than gate/up run at 94-98% of
// L2 throughput at deepseek-v3, and a 256-byte fetch there costs more L2 work than it saves. In
// `da` and `dx_row` (N-major B, 4 adjacent [64, 64] blocks per stage) its second half is a block the
// same stage asks for anyway; in down (K-major) it is the next K block, asked for one stage later.
// Measured on the H200 (bench/results/2026-12-01-h200-session18.txt, sections 3-4; Nsight Compute,
// deepseek-v3): down 2.27 -> 2.16 ms, `da` 2.41 -> 2.26, `dx_row` 4.17 -> 4.13, with 20% fewer L2
// bytes and the same DRAM reads; gate/up 1% slower without it, and the rows (A) of every mode gained
// nothing from fetching lines.
constexpr L2Fetch weights_fetch(Mode mode) { return mode == Mode::kRowsSwiGLU ? L2Fetch::k256B : L2Fetch::kLine; }

// The Params every row mode shares.
Params rows_params(const ExpertGemmArgs& args, int block_n) {
  check(args.tickets != nullptr, "tile tickets");
  check(args.capacity % kBlockM == 0 && args.k % kBlockK == 0 && args.n % 64 == 0 && args.capacity <= INT32_MAX,
        "capacity % 128, K % 64, N % 64");
  check(args.k > 0 && args.n > 0, "K > 0 and N > 0 (a padding tile passes K / 64 stages)");
  const RowLaunch& l = args.launch;
  check(l.order.group_rows >= 1 && l.order.group_rows <= 64, "group rows in [1, 64]");
  Params p{};
  p.grid.expert_offset = args.expert_offset;
  p.grid.expert_rows = l.half_tiles ? args.expert_rows : nullptr;
  p.swapped = l.swapped;
  p.grid.block_offset = l.fold && p.grid.expert_rows ? args.block_offset : nullptr;
  p.grid.experts = static_cast<int32_t>(args.experts);
  p.grid.tiles_m = static_cast<int32_t>(args.capacity / kBlockM);
  p.grid.tiles_n = static_cast<int32_t>((args.n + block_n - 1) / block_n);
  p.grid.block_n = block_n;
  p.grid.k_blocks = static_cast<int32_t>(args.k / kBlockK);
  p.grid.capacity = static_cast<int32_t>(args.capacity);
  p.grid.weight_grad = false;
  p.grid.group_rows = l.order.group_rows;
  p.grid.expert_groups = l.order.expert_groups;
  p.in_order = l.order.in_order;
  p.cluster = l.clusters ? kClusterTiles : 1;
  p.n = static_cast<int32_t>(args.n);
  p.out_split = INT32_MAX;
  p.status = args.status;
  p.tickets = args.tickets;
#if LYNX_EXPERIMENTS
  p.stall_task = args.stall_task;
#endif
  if (args.gather_src) {
    check(args.row_token_slot != nullptr && args.gather_sync != nullptr && args.top_k > 0, "gather: slots, sync, top_k");
    check(l.gather_lookahead >= 1, "gather lookahead >= 1 row block");
    // NOTES: the kernel writes A (args.a, the workspace's gathered-rows buffer) when it gathers.
    p.gather.src = reinterpret_cast<const uint4*>(args.gather_src);
    p.gather.dst = reinterpret_cast<uint4*>(const_cast<bf16_t*>(args.a));
    p.gather.row_token_slot = args.row_token_slot;
    p.gather.top_k = static_cast<int32_t>(args.top_k);
    p.gather.vecs = static_cast<int32_t>(args.k / 8);
    p.gather.lookahead = l.gather_lookahead;
    p.gather.sync = args.gather_sync;
#if LYNX_EXPERIMENTS
    p.gather.stall_block = args.gather_stall_block;
#endif
  }
  return p;
}

template <Mode kMode>
void launch_rows(const ExpertGemmArgs& args, cudaStream_t stream) {
  constexpr int kBlockN = Config<kMode>::kBlockN;
  Params p = rows_params(args, kBlockN);
  check((args.out_gate == nullptr) == (args.out_up == nullptr), "gate and up products both stored or neither");
  Maps m;
  m.a = make_tma_2d(args.a, args.capacity, args.k, kBlockM, kBlockK);
  m.a_half = make_tma_2d(args.a, args.capacity, args.k, 64, kBlockK);
  m.a_quarter = make_tma_2d(args.a, args.capacity, args.k, kQuarterRows, kBlockK);
  m.a_fold = make_tma_2d(args.a, args.capacity, args.k, kFoldRows, kBlockK);
  constexpr L2Fetch fb = weights_fetch(kMode);
  m.b0 = make_tma_3d(args.b0, args.experts, args.n, args.k, kBlockN, kBlockK, fb);
  m.b1 = Config<kMode>::kSwiGLU ? make_tma_3d(args.b1, args.experts, args.n, args.k, kBlockN, kBlockK, fb) : m.b0;
  m.b_half = make_tma_3d(args.b0, args.experts, args.n, args.k, 128, kBlockK, fb);
  m.c0 = make_tma_2d(args.out, args.capacity, args.n, 64, 64);
  p.out_gate_up = Config<kMode>::kSwiGLU && args.out_gate != nullptr;
  m.c1 = p.out_gate_up ? make_tma_2d(args.out_gate, args.capacity, args.n, 64, 64) : m.c0;
  m.c2 = p.out_gate_up ? make_tma_2d(args.out_up, args.capacity, args.n, 64, 64) : m.c0;
  launch<kMode>(m, p, args.sm_count, stream);
}

template <>
void launch_rows<Mode::kRowsMnB>(const ExpertGemmArgs& args, cudaStream_t stream) {
  check(args.k_split % kBlockK == 0 && args.k_split >= 0 && args.k_split <= args.k, "K split % 64");
  Params p = rows_params(args, Config<Mode::kRowsMnB>::kBlockN);
  const int64_t k0 = args.b1 ? args.k_split : args.k;
  Maps m;
  m.a = make_tma_2d(args.a, args.capacity, args.k, kBlockM, kBlockK);
  m.a_half = make_tma_2d(args.a, args.capacity, args.k, 64, kBlockK);
  m.a_quarter = make_tma_2d(args.a, args.capacity, args.k, kQuarterRows, kBlockK);
  m.a_fold = make_tma_2d(args.a, args.capacity, args.k, kFoldRows, kBlockK);
  constexpr L2Fetch fb = weights_fetch(Mode::kRowsMnB);
  m.b0 = m.b_half = make_tma_3d(args.b0, args.experts, k0, args.n, 64, 64, fb);
  m.b1 = args.b1 ? make_tma_3d(args.b1, args.experts, args.k - k0, args.n, 64, 64, fb) : m.b0;
  m.c0 = m.c1 = m.c2 = make_tma_2d(args.out, args.capacity, args.n, 64, 64);
  p.k_split = static_cast<int32_t>(k0);
  launch<Mode::kRowsMnB>(m, p, args.sm_count, stream);
}

}  // namespace

void prepare_expert_gemm_kernels(int sm_count) {
  prepare<Mode::kRowsSwiGLU, false>(sm_count);
  prepare<Mode::kRows, false>(sm_count);
  prepare<Mode::kRowsMnB, false>(sm_count);
  prepare<Mode::kRowsSwiGLU, true>(sm_count);
  prepare<Mode::kRows, true>(sm_count);
  prepare<Mode::kRowsMnB, true>(sm_count);
  prepare<Mode::kWeightGrad, false>(sm_count);
}

void expert_gemm(const ExpertGemmArgs& args, cudaStream_t stream) { launch_rows<Mode::kRows>(args, stream); }
void expert_gemm_swiglu(const ExpertGemmArgs& args, cudaStream_t stream) {
  launch_rows<Mode::kRowsSwiGLU>(args, stream);
}
void expert_gemm_n_major(const ExpertGemmArgs& args, cudaStream_t stream) { launch_rows<Mode::kRowsMnB>(args, stream); }

void expert_weight_grad(const WeightGradArgs& args, cudaStream_t stream) {
  check(args.tickets != nullptr, "tile tickets");
  check(args.capacity % kBlockM == 0 && args.m % 64 == 0 && args.n % 64 == 0 && args.capacity <= INT32_MAX,
        "capacity % 128, M % 64, N % 64");
  // Rows [0, split) of each expert's output go to out, the rest to out2 (as many rows again).
  check(args.out2 == nullptr || (args.split % 64 == 0 && args.m == 2 * args.split), "weight grad split: M = 2 · split, split % 64");
  constexpr int kBlockN = Config<Mode::kWeightGrad>::kBlockN;
  const int64_t out_rows = args.out2 ? args.split : args.m;
  Maps m;
  m.a = m.a_half = m.a_quarter = m.a_fold = make_tma_2d_chunks(args.a, args.capacity, args.m, kBlockK, kBlockM / 64);
  m.b0 = m.b1 = m.b_half = make_tma_2d_chunks(args.b, args.capacity, args.n, kBlockK, kBlockN / 64);
  m.c0 = make_tma_3d(args.out, args.experts, out_rows, args.n, 64, 64);
  m.c1 = m.c2 = args.out2 ? make_tma_3d(args.out2, args.experts, out_rows, args.n, 64, 64) : m.c0;
  Params p{};
  p.grid.expert_offset = args.expert_offset;
  p.grid.experts = static_cast<int32_t>(args.experts);
  p.grid.tiles_m = static_cast<int32_t>((args.m + kBlockM - 1) / kBlockM);
  p.grid.tiles_n = static_cast<int32_t>((args.n + kBlockN - 1) / kBlockN);
  p.grid.block_n = kBlockN;
  p.grid.capacity = static_cast<int32_t>(args.capacity);
  p.grid.weight_grad = true;
  p.grid.expert_rows = args.expert_rows;
  p.m = static_cast<int32_t>(args.m);
  p.n = static_cast<int32_t>(args.n);
  p.out_split = args.out2 ? static_cast<int32_t>(args.split) : INT32_MAX;
  p.status = args.status;
  p.in_order = args.in_order;
  p.cluster = 1;
  p.tickets = args.tickets;
  launch<Mode::kWeightGrad>(m, p, args.sm_count, stream);
}

}  // namespace lynx::gemm
