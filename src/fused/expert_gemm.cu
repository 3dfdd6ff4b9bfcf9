// The grouped expert GEMM kernel: one producer warpgroup (TMA), two consumer warpgroups (wgmma,
// 64 rows each), a persistent tile scheduler (tiles claimed in order from a device ticket, or a static
// round robin; choose_tile_order).
// Four modes share the pipeline (A_e = the expert's block of schedule rows):
//   kRowsSwiGLU  C_e = silu(A_e·Gᵀ) ⊙ (A_e·Uᵀ)   G, U: [E, N, K] (K-major)
//   kRows        C_e = A_e · Bᵀ                   B: [E, N, K] (K-major)
//   kRowsMnB     C_e = A_e · [B0; B1]             B0: [E, K0, N], B1: [E, K - K0, N] (N-major)
//   kWeightGrad  C_e = A_eᵀ · B_e                 A, B: [capacity, M] and [capacity, N] row buffers
//                (M- and N-major), K = the expert's padded rows (padding rows hold zeros)
// Epilogue: each consumer warpgroup writes its fragments in [64, 128] pieces into its own swizzled
// shared-memory buffer and one thread stores them with TMA; the stores drain while the warpgroup
// goes on with the next tile's mainloop.
#include <cuda.h>
#include <cuda_bf16.h>

#include <atomic>
#include <cstdlib>
#include <string>

#include "common/cuda_check.h"
#include "fused/expert_gemm.h"
#include "fused/sm90.cuh"
#include "fused/tile_scheduler.h"
#include "fused/tma.h"

namespace lynx::fused {
namespace {

enum class Mode { kRowsSwiGLU, kRows, kRowsMnB, kWeightGrad };

constexpr int kThreads = 384; // warpgroup 0: producer; 1 and 2: consumers
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegs = 232;
// NOTES: setmaxnreg moves registers within what the CTA got at launch, 384 threads × 168 (the most
// __launch_bounds__(384, 1) allows, rounded down to 8): 40 + 2 × 232 uses it exactly. The consumers'
// increase blocks until the producer's decrease has freed enough, so a budget over the launch
// allocation deadlocks before any wait can time out (seen on the H200 with 64 + 2 × 224).
constexpr int kLaunchRegs = 65536 / kThreads / 8 * 8;
static_assert(kProducerRegs * 128 + 2 * kConsumerRegs * 128 <= kLaunchRegs * kThreads, "register budget");

template <Mode kMode>
struct Config {
  static constexpr bool kSwiGLU = kMode == Mode::kRowsSwiGLU;
  static constexpr bool kTransA = kMode == Mode::kWeightGrad;                          // A is M-major
  static constexpr bool kTransB = kMode == Mode::kRowsMnB || kMode == Mode::kWeightGrad;  // B is N-major
  static constexpr int kOperandsB = kSwiGLU ? 2 : 1;
  // NOTES: every mode computes a 128 × 256 block of products per tile (gate 128 + up 128 columns,
  // or 256 plain columns): 128 fp32 accumulators per consumer thread, 48 KB per stage, 4 stages.
  static constexpr int kBlockN = kSwiGLU ? 128 : 256;
  static constexpr int kStages = 4;
  static constexpr uint32_t kStageBytes = 2 * (kBlockM * kBlockK + kOperandsB * kBlockN * kBlockK);
  static_assert(kStageBytes == 48 * 1024, "stage size");
};

// NOTES: an epilogue piece is 64 rows × 128 columns (16 KB): with four 48 KB stages, two pieces (one
// per consumer warpgroup) are all that fits in 227 KB; a 256-wide tile goes out in two pieces.
constexpr int kPieceBoxes = 2;  // [64, 64] boxes per piece

template <Mode kMode>
struct SharedStorage {
  using C = Config<kMode>;
  alignas(1024) __nv_bfloat16 a[C::kStages][kBlockM * kBlockK];                    // [BLOCK_M, BLOCK_K] bf16, 128B swizzle
  alignas(1024) __nv_bfloat16 b[C::kStages][C::kOperandsB][C::kBlockN * kBlockK];  // [BLOCK_N, BLOCK_K] bf16, 128B swizzle
  alignas(1024) __nv_bfloat16 c[2][kPieceBoxes][64 * 64];  // per consumer warpgroup: [64, 128] bf16 piece as two [64, 64] boxes, 128B swizzle
  uint64_t full[C::kStages];   // producer -> consumers: the stage's bytes have landed
  uint64_t empty[C::kStages];  // consumers -> producer: every consumer thread is done with the stage
  int32_t stage_tile[C::kStages];  // the tile whose first K block a stage holds (kNoTile otherwise), kDone at the end
};
static_assert(sizeof(__nv_bfloat16) * kBlockM * kBlockK % 1024 == 0, "A stages stay 1024-byte aligned");
static_assert(sizeof(__nv_bfloat16) * 128 * kBlockK % 1024 == 0, "B stages stay 1024-byte aligned");
static_assert(sizeof(SharedStorage<Mode::kRowsSwiGLU>) + 1024 <= 227 * 1024, "shared memory");
static_assert(sizeof(SharedStorage<Mode::kRows>) + 1024 <= 227 * 1024, "shared memory");

struct Params {
  TileGrid grid;
  int32_t m;           // rows of C per expert (weight grad)
  int32_t n;
  int32_t out_split;   // weight grad: rows >= out_split go to tma_c1 (row - out_split); else INT32_MAX
  int32_t k_split;     // kRowsMnB: K rows [0, k_split) come from B0, the rest from B1
  bool out_gate_up;    // SwiGLU: the gate and up products go out too (tma_c1, tma_c2)
  DeviceStatus* status;
  bool in_order;       // tiles claimed in order from `tickets`; else the static round robin
  int32_t* tickets;    // [2] device: next tile to claim, CTAs finished claiming; zero between launches
  int32_t stall_task;  // test hook: the producer stops at this tile, so its consumers must time out
};

constexpr int32_t kNoTile = -1;  // stage_tile: the stage continues the tile before it
constexpr int32_t kDone = -2;    // stage_tile: no tiles are left; the stage holds no data

// ---- tile scheduler: the producer thread picks each tile; the consumers learn it from its first stage ----
// NOTES: in order (p.in_order): a static round robin lets CTAs drift apart over the waves, so the tiles
// that share a weight tile or a row block (neighbours in tile_at's raster) run apart in time and
// re-read their operands from DRAM; claims from a ticket keep neighbours together. Which CTA computes
// a tile does not change its bits: each tile is still computed whole, over its K in order. When each
// order wins: choose_tile_order.
__device__ __forceinline__ int32_t claim_ticket(const Params& p) { return atomicAdd(&p.tickets[0], 1); }

// The last CTA to finish claiming zeroes the counters for the next launch on the stream.
__device__ __forceinline__ void finish_claims(const Params& p) {
  __threadfence();  // this CTA's last claim is ordered before its count
  if (atomicAdd(&p.tickets[1], 1) == int32_t(gridDim.x) - 1) {
    atomicExch(&p.tickets[0], 0);
    atomicExch(&p.tickets[1], 0);
  }
}

__device__ __forceinline__ float silu(float z) { return z / (1.0f + __expf(-z)); }

// One epilogue piece of consumer warpgroup `wg`: 64 rows × 128 columns, value(j, r) giving the two
// fp32 values of fragment column group j (columns 8j + 2(lane % 4) + {0, 1}) in row half r, stored at
// (col, row[, batch]) of `map`. Columns at or past n are not stored.
template <bool k3d, class Value>
__device__ __forceinline__ void store_piece(__nv_bfloat16 (&buf)[kPieceBoxes][64 * 64], const CUtensorMap* map,
                                            int wg, int32_t col, int32_t row, int32_t batch, int32_t n, Value value) {
  const int thread = threadIdx.x % 128, warp = thread / 32, lane = thread % 32;
  // The previous piece's store must be done reading the buffer before it is overwritten.
  if (thread == 0) sm90::bulk_wait_group_read<0>();
  sm90::named_barrier_sync(1 + wg, 128);
  // 128-byte swizzle: 16-byte chunk j % 8 of row R sits at chunk (j % 8) ^ (R % 8), and R % 8 = lane / 4
  // for both rows a thread holds. Rows are 128-byte aligned, so the chunk XOR acts on the address.
  const uint32_t base = sm90::smem_addr(buf[0]) + (warp * 16 + lane / 4) * 128 + 4 * (lane % 4) + (lane / 4) * 16;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const float2 v = value(j, r);
      const __nv_bfloat162 packed = __floats2bfloat162_rn(v.x, v.y);
      const uint32_t at = ((base + r * 8 * 128) ^ ((j % 8) * 16)) + (j / 8) * 64 * 64 * 2;
      asm volatile("st.shared.b32 [%0], %1;" ::"r"(at), "r"(*reinterpret_cast<const uint32_t*>(&packed)) : "memory");
    }
  }
  sm90::fence_proxy_async_shared();
  sm90::named_barrier_sync(1 + wg, 128);
  if (thread == 0) {
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

template <Mode kMode>
__global__ void __launch_bounds__(kThreads, 1)
    expert_gemm_kernel(const __grid_constant__ CUtensorMap tma_a, const __grid_constant__ CUtensorMap tma_b0,
                       const __grid_constant__ CUtensorMap tma_b1, const __grid_constant__ CUtensorMap tma_c0,
                       const __grid_constant__ CUtensorMap tma_c1, const __grid_constant__ CUtensorMap tma_c2,
                       const Params p) {
  using C = Config<kMode>;
  constexpr int kStages = C::kStages;
  constexpr int kBlockN = C::kBlockN;
  extern __shared__ uint8_t smem_raw[];
  auto& smem = *reinterpret_cast<SharedStorage<kMode>*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));

  const int warpgroup = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      sm90::mbarrier_init(&smem.full[s], 1);
      sm90::mbarrier_init(&smem.empty[s], 2 * 128);
      smem.stage_tile[s] = kNoTile;
    }
    sm90::fence_barrier_init();
  }
  __syncthreads();

  if (warpgroup == 0) {
    // ---- producer: one thread issues every TMA load ----
    sm90::setmaxnreg_dec<kProducerRegs>();
    if (threadIdx.x != 0) return;
    sm90::prefetch_tma_descriptor(&tma_a);
    sm90::prefetch_tma_descriptor(&tma_b0);
    if constexpr (C::kSwiGLU) sm90::prefetch_tma_descriptor(&tma_b1);
    const int32_t tiles = tile_count(p.grid);
    int stage = 0;
    uint32_t phase = 0;
    // In order, the next tile's claim is in flight while this tile loads.
    int32_t ticket = p.in_order ? claim_ticket(p) : int32_t(blockIdx.x);
    for (;;) {
      const int32_t tile = ticket < tiles ? ticket : kDone;
      if (tile != kDone) ticket = p.in_order ? claim_ticket(p) : ticket + int32_t(gridDim.x);
      if (tile == p.stall_task) {  // test hook: this CTA never fills the stage its consumers wait on
        if (p.in_order) finish_claims(p);
        return;
      }
      // The consumers learn each tile from its first stage (written before the arrive, whose release
      // orders it before their acquiring wait); the end, and a tile without K blocks (an expert
      // without rows in weight-grad mode), take a stage with no data.
      if (tile == kDone || tile_at(p.grid, tile).k_blocks == 0) {
        sm90::mbarrier_wait(&smem.empty[stage], phase ^ 1, p.status, sm90::Wait::kEmptyStage, tile);
        smem.stage_tile[stage] = tile;
        sm90::mbarrier_arrive(&smem.full[stage]);
        if (++stage == kStages) stage = 0, phase ^= 1;
        if (tile == kDone) break;
        continue;
      }
      const Tile t = tile_at(p.grid, tile);
      for (int32_t kb = 0; kb < t.k_blocks; ++kb) {
        const int32_t k = t.k0 + kb * kBlockK;
        sm90::mbarrier_wait(&smem.empty[stage], phase ^ 1, p.status, sm90::Wait::kEmptyStage, tile);
        smem.stage_tile[stage] = kb == 0 ? tile : kNoTile;
        sm90::mbarrier_arrive_expect_tx(&smem.full[stage], C::kStageBytes);
        __nv_bfloat16* a = smem.a[stage];
        __nv_bfloat16* b = smem.b[stage][0];
        if constexpr (kMode == Mode::kWeightGrad) {
          // [64 rows, 64 columns] boxes of the row buffers: 2 for A's 128 columns, 4 for B's 256.
          for (int j = 0; j < kBlockM / 64; ++j) sm90::tma_load_2d(a + j * 64 * kBlockK, &tma_a, &smem.full[stage], t.a_row + 64 * j, k);
          for (int j = 0; j < kBlockN / 64; ++j) sm90::tma_load_2d(b + j * 64 * kBlockK, &tma_b0, &smem.full[stage], t.b_row + 64 * j, k);
        } else {
          sm90::tma_load_2d(a, &tma_a, &smem.full[stage], k, t.a_row);
          if constexpr (kMode == Mode::kRowsMnB) {
            const bool second = k >= p.k_split;
            const CUtensorMap* map = second ? &tma_b1 : &tma_b0;
            const int32_t kr = second ? k - p.k_split : k;
            for (int j = 0; j < kBlockN / 64; ++j) sm90::tma_load_3d(b + j * 64 * kBlockK, map, &smem.full[stage], t.b_row + 64 * j, kr, t.expert);
          } else {
            sm90::tma_load_3d(b, &tma_b0, &smem.full[stage], k, t.b_row, t.expert);
            if constexpr (C::kSwiGLU) sm90::tma_load_3d(smem.b[stage][1], &tma_b1, &smem.full[stage], k, t.b_row, t.expert);
          }
        }
        if (++stage == kStages) stage = 0, phase ^= 1;
      }
    }
    if (p.in_order) finish_claims(p);
    return;
  }

  // ---- consumers: warpgroup c computes rows [64c, 64c + 64) of each tile ----
  sm90::setmaxnreg_inc<kConsumerRegs>();
  const int c = warpgroup - 1;
  const int thread = threadIdx.x % 128;
  int stage = 0;
  uint32_t phase = 0;
  float acc0[kBlockN / 2];
  float acc1[C::kSwiGLU ? kBlockN / 2 : 1];
  for (;;) {
    // The tile: from the first stage the producer filled for it (task kNoTile in a stall report: the
    // consumers were waiting to learn their next tile).
    sm90::mbarrier_wait(&smem.full[stage], phase, p.status, sm90::Wait::kFullStage, kNoTile);
    // NOTES: every consumer thread arrives on `empty`, so each release covers that thread's own read of
    // stage_tile (an arrive releases only its own thread's accesses).
    const int32_t tile = smem.stage_tile[stage];
    if (tile == kDone) break;
    const Tile t = tile_at(p.grid, tile);
    // NOTES: zeroed for every tile, not only for an expert without rows (whose weight gradient must be
    // exactly zero): the wgmma operands are read-write ("+f"), so without this the compiler keeps the
    // previous tile's accumulators alive across the loop, and ptxas serialises every wgmma of this
    // kernel (each HGMMA waits for the one before; tools/sass-check): the dynamic scheduler's 7-13%
    // loss in bench/results/2026-11-29-h200-6e0170f-dynamic-tiles.txt.
#pragma unroll
    for (int i = 0; i < kBlockN / 2; ++i) acc0[i] = 0.0f;
    if constexpr (C::kSwiGLU) {
#pragma unroll
      for (int i = 0; i < kBlockN / 2; ++i) acc1[i] = 0.0f;
    }
    if (t.k_blocks == 0) {  // the stage held no data
      sm90::mbarrier_arrive(&smem.empty[stage]);
      if (++stage == kStages) stage = 0, phase ^= 1;
    }
    // NOTES: the last row block of an expert holds 1-128 rows; when its rows 64-127 are all padding,
    // warpgroup 1 computes nothing and only passes the stages on (its accumulators stay zero, so it
    // stores the zeros that padding rows must hold). At deepseek-v3 (128 ± 11 rows per expert) about
    // half of the experts end with such a block.
    // Every thread waits for each stage before it releases it, so none can fall a phase behind.
    const bool idle = c == 1 && t.rows <= 64;
    if (idle && t.k_blocks > 0) {
      for (int32_t kb = 0; kb < t.k_blocks; ++kb) {
        if (kb > 0) sm90::mbarrier_wait(&smem.full[stage], phase, p.status, sm90::Wait::kFullStage, tile);
        sm90::mbarrier_arrive(&smem.empty[stage]);
        if (++stage == kStages) stage = 0, phase ^= 1;
      }
    }
    // Mainloop: wgmma over the K blocks; a stage is released once the wgmma group after it is issued
    // and its own group has completed (wait_group 1), so one group is always in flight.
    int prev_stage = -1;
    for (int32_t kb = 0; kb < (idle ? 0 : t.k_blocks); ++kb) {
      if (kb > 0) sm90::mbarrier_wait(&smem.full[stage], phase, p.status, sm90::Wait::kFullStage, tile);
      sm90::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBlockK / 16; ++kk) {
        // K-major tiles step 16 elements along their 128-byte rows; MN-major tiles step 16 rows.
        const uint64_t da = C::kTransA
                                ? sm90::smem_desc_mn_major_sw128(&smem.a[stage][c * 64 * kBlockK + kk * 16 * 64])
                                : sm90::smem_desc_k_major_sw128(&smem.a[stage][c * 64 * kBlockK + kk * 16]);
        const uint64_t db = C::kTransB ? sm90::smem_desc_mn_major_sw128(&smem.b[stage][0][kk * 16 * 64])
                                       : sm90::smem_desc_k_major_sw128(&smem.b[stage][0][kk * 16]);
        const bool accumulate = kb > 0 || kk > 0;
        if constexpr (kBlockN == 256) {
          sm90::wgmma_m64n256k16<C::kTransA, C::kTransB>(acc0, da, db, accumulate);
        } else {
          sm90::wgmma_m64n128k16(acc0, da, db, accumulate);
        }
        if constexpr (C::kSwiGLU) {
          sm90::wgmma_m64n128k16(acc1, da, sm90::smem_desc_k_major_sw128(&smem.b[stage][1][kk * 16]), accumulate);
        }
      }
      sm90::wgmma_commit();
      sm90::wgmma_wait<1>();
      if (prev_stage >= 0) sm90::mbarrier_arrive(&smem.empty[prev_stage]);
      prev_stage = stage;
      if (++stage == kStages) stage = 0, phase ^= 1;
    }
    sm90::wgmma_wait<0>();
    if (prev_stage >= 0) sm90::mbarrier_arrive(&smem.empty[prev_stage]);

    // Epilogue: [64, 128] pieces through shared memory and TMA stores.
    const int32_t row = t.a_row + c * 64;
    if constexpr (kMode == Mode::kWeightGrad) {
      if (row < p.m) {
        const bool second = row >= p.out_split;
        const CUtensorMap* map = second ? &tma_c1 : &tma_c0;
        const int32_t out_row = second ? row - p.out_split : row;
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          store_piece<true>(smem.c[c], map, c, t.b_row + 128 * q, out_row, t.expert, p.n, [&](int j, int r) {
            return make_float2(acc0[4 * (16 * q + j) + 2 * r], acc0[4 * (16 * q + j) + 2 * r + 1]);
          });
        }
      }
    } else if constexpr (C::kSwiGLU) {
      store_piece<false>(smem.c[c], &tma_c0, c, t.b_row, row, 0, p.n, [&](int j, int r) {
        const int i = 4 * j + 2 * r;
        return make_float2(silu(acc0[i]) * acc1[i], silu(acc0[i + 1]) * acc1[i + 1]);
      });
      if (p.out_gate_up) {
        store_piece<false>(smem.c[c], &tma_c1, c, t.b_row, row, 0, p.n,
                           [&](int j, int r) { return make_float2(acc0[4 * j + 2 * r], acc0[4 * j + 2 * r + 1]); });
        store_piece<false>(smem.c[c], &tma_c2, c, t.b_row, row, 0, p.n,
                           [&](int j, int r) { return make_float2(acc1[4 * j + 2 * r], acc1[4 * j + 2 * r + 1]); });
      }
    } else {
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        store_piece<false>(smem.c[c], &tma_c0, c, t.b_row + 128 * q, row, 0, p.n, [&](int j, int r) {
          return make_float2(acc0[4 * (16 * q + j) + 2 * r], acc0[4 * (16 * q + j) + 2 * r + 1]);
        });
      }
    }
  }
  // The stores must finish before the CTA's shared memory goes away.
  if (thread == 0) sm90::bulk_wait_group<0>();
}

// The operand maps (A, B0, B1) and the output maps (C0, C1, C2) of one launch.
struct Maps {
  CUtensorMap a, b0, b1, c0, c1, c2;
};

template <Mode kMode>
void launch(const Maps& m, const Params& p, int sm_count, cudaStream_t stream) {
  constexpr size_t kSmem = sizeof(SharedStorage<kMode>) + 1024;
  // The shared-memory limit is a per-device attribute of the kernel: set once on each device.
  constexpr int kMaxDevices = 64;
  static std::atomic<bool> configured[kMaxDevices];
  int device = 0;
  LYNX_CUDA(cudaGetDevice(&device));
  if (device >= kMaxDevices) throw Error("", "internal: device index " + std::to_string(device) + " >= 64");
  if (!configured[device].load()) {
    LYNX_CUDA(cudaFuncSetAttribute(expert_gemm_kernel<kMode>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmem)));
    configured[device].store(true);
  }
  expert_gemm_kernel<kMode><<<sm_count, kThreads, kSmem, stream>>>(m.a, m.b0, m.b1, m.c0, m.c1, m.c2, p);
  LYNX_CHECK_LAUNCH();
}

void check(bool ok, const char* what) {
  if (!ok) throw Error("", std::string("internal: expert GEMM sizes not supported: ") + what);
}

// The tile order: choose_tile_order, or from the environment for sweeps: LYNX_GEMM_ORDER=static|in-order
// (the raster of that branch of the rule), LYNX_GEMM_GROUP_ROWS=N.
TileOrder tile_order(int64_t routed_rows, int64_t experts) {
  static const int forced_order = [] {
    const char* v = std::getenv("LYNX_GEMM_ORDER");
    if (!v) return -1;
    if (std::string(v) == "in-order") return 1;
    if (std::string(v) == "static") return 0;
    throw Error("LYNX_GEMM_ORDER", std::string("must be static or in-order, got '") + v + "'");
  }();
  static const int32_t forced_rows = [] {
    const char* v = std::getenv("LYNX_GEMM_GROUP_ROWS");
    return v ? std::atoi(v) : 0;
  }();
  TileOrder o = forced_order == 1   ? in_order_tiles()
                : forced_order == 0 ? static_tiles(row_blocks_per_expert(routed_rows, experts))
                                    : choose_tile_order(routed_rows, experts);
  if (forced_rows > 0) o.group_rows = forced_rows < 64 ? forced_rows : 64;  // keeps group_rows · tiles_n far from overflow
  return o;
}

// Half tiles (warpgroup 1 idle on a block whose rows 64-127 are padding) unless the environment turns
// them off for a sweep: LYNX_GEMM_HALF_TILES=0. NOTES: at deepseek-v3 the half tile of an expert's
// second block runs ahead of the full tile it shares weights with, which may cost L2 hits
// (docs/plan.md, item 1); the switch measures that.
bool half_tiles() {
  static const bool on = [] {
    const char* v = std::getenv("LYNX_GEMM_HALF_TILES");
    if (!v || std::string(v) == "1") return true;
    if (std::string(v) == "0") return false;
    throw Error("LYNX_GEMM_HALF_TILES", std::string("must be 0 or 1, got '") + v + "'");
  }();
  return on;
}

// The Params every row mode shares.
Params rows_params(const ExpertGemmArgs& args, int block_n) {
  check(args.tickets != nullptr, "tile tickets");
  check(args.capacity % kBlockM == 0 && args.k % kBlockK == 0 && args.n % 64 == 0 && args.capacity <= INT32_MAX,
        "capacity % 128, K % 64, N % 64");
  Params p{};
  p.grid.expert_offset = args.expert_offset;
  p.grid.expert_rows = half_tiles() ? args.expert_rows : nullptr;
  p.grid.experts = static_cast<int32_t>(args.experts);
  p.grid.tiles_m = static_cast<int32_t>(args.capacity / kBlockM);
  p.grid.tiles_n = static_cast<int32_t>((args.n + block_n - 1) / block_n);
  p.grid.block_n = block_n;
  p.grid.k_blocks = static_cast<int32_t>(args.k / kBlockK);
  p.grid.capacity = static_cast<int32_t>(args.capacity);
  p.grid.weight_grad = false;
  const TileOrder order = tile_order(args.routed_rows, args.experts);
  p.grid.group_rows = order.group_rows;
  p.grid.expert_groups = order.expert_groups;
  p.in_order = order.in_order;
  p.n = static_cast<int32_t>(args.n);
  p.out_split = INT32_MAX;
  p.status = args.status;
  p.tickets = args.tickets;
  p.stall_task = args.stall_task;
  return p;
}

template <Mode kMode>
void launch_rows(const ExpertGemmArgs& args, cudaStream_t stream) {
  constexpr int kBlockN = Config<kMode>::kBlockN;
  Params p = rows_params(args, kBlockN);
  check((args.out_gate == nullptr) == (args.out_up == nullptr), "gate and up products both stored or neither");
  Maps m;
  m.a = make_tma_2d(args.a, args.capacity, args.k, kBlockM, kBlockK);
  m.b0 = make_tma_3d(args.b0, args.experts, args.n, args.k, kBlockN, kBlockK);
  m.b1 = Config<kMode>::kSwiGLU ? make_tma_3d(args.b1, args.experts, args.n, args.k, kBlockN, kBlockK) : m.b0;
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
  m.b0 = make_tma_3d(args.b0, args.experts, k0, args.n, 64, 64);
  m.b1 = args.b1 ? make_tma_3d(args.b1, args.experts, args.k - k0, args.n, 64, 64) : m.b0;
  m.c0 = m.c1 = m.c2 = make_tma_2d(args.out, args.capacity, args.n, 64, 64);
  p.k_split = static_cast<int32_t>(k0);
  launch<Mode::kRowsMnB>(m, p, args.sm_count, stream);
}

}  // namespace

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
  m.a = make_tma_2d(args.a, args.capacity, args.m, 64, 64);
  m.b0 = m.b1 = make_tma_2d(args.b, args.capacity, args.n, 64, 64);
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
  p.m = static_cast<int32_t>(args.m);
  p.n = static_cast<int32_t>(args.n);
  p.out_split = args.out2 ? static_cast<int32_t>(args.split) : INT32_MAX;
  p.status = args.status;
  p.in_order = tile_order(args.routed_rows, args.experts).in_order;
  p.tickets = args.tickets;
  p.stall_task = -1;
  launch<Mode::kWeightGrad>(m, p, args.sm_count, stream);
}

}  // namespace lynx::fused
