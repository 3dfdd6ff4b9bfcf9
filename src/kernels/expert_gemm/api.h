// Grouped expert GEMMs on sm_90a (TMA + wgmma, warp-specialized, persistent) that take the per-expert
// row offsets from device memory: no host synchronisation, capturable in a CUDA graph.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/bf16.h"
#include "common/peers.h"
#include "common/status.h"

namespace lynx::gemm {

constexpr int32_t kBlockM = 128;  // rows of an output tile (two consumer warpgroups × 64)
constexpr int32_t kBlockK = 64;   // K per pipeline stage: 64 bf16 = one 128-byte swizzle row
constexpr int32_t kClusterTiles = 2;  // CTAs of a cluster unit (tile_scheduler.h)

// How the expert GEMM walks its tiles: claimed in order from a device ticket, or a static round robin
// (CTA b takes tiles b, b + gridDim.x, ...; in cluster units, cluster c takes units c, c + clusters,
// ...), and the raster (tile_at).
struct TileOrder {
  bool in_order;
  bool expert_groups;
  int32_t group_rows;
};


// How one row-mode launch runs: every choice is made by the plan (plan/layer_plan.h), none here.
struct RowLaunch {
  TileOrder order{true, true, 16};
  bool clusters = false;      // cluster units of kClusterTiles CTAs sharing operands by TMA multicast
  bool half_tiles = true;     // a tile whose rows 64-127 are padding runs on one consumer warpgroup
  bool swapped = true;        // a warpgroup with 1-16 rows swaps the operands (needs half_tiles)
  bool fold = false;          // tails of 1-16 rows are folded into the block before them (needs half_tiles)
  int32_t gather_lookahead = 8;  // in-kernel gather: row blocks it may run ahead of the tiles begun
};

struct ExpertGemmArgs {
  const bf16_t* a = nullptr;              // [capacity, K]  rows in schedule order (expert-major, 128-padded)
  int64_t capacity = 0;                   // multiple of 128
  int64_t k = 0;                          // multiple of 64
  const bf16_t* b0 = nullptr;             // [experts, n, K]  (gate, or the only weight); n-major: [experts, k_split, n]
  const bf16_t* b1 = nullptr;             // [experts, n, K]  (up; SwiGLU only); n-major: [experts, K - k_split, n]
  int64_t k_split = 0;                    // n-major with b1: K rows [0, k_split) come from b0, the rest from b1
  int64_t b0_stride = 0, b1_stride = 0;   // elements from one expert's matrix to the next (0: contiguous)
  int64_t experts = 0;
  int64_t n = 0;                          // multiple of 64
  const int32_t* expert_offset = nullptr; // [experts + 1] device; [experts] = rows used (padded total)
  const int32_t* expert_rows = nullptr;   // [experts] device: rows before padding (needed by half tiles)
  const int32_t* block_offset = nullptr;  // [experts + 1] device: the schedule's block_offset (needed to fold tails)
  bf16_t* out = nullptr;                  // [capacity, n]
  bf16_t* out_gate = nullptr;             // [rows, n]  SwiGLU only, may be null
  bf16_t* out_up = nullptr;               // [rows, n]  SwiGLU only, may be null
  // With out_gate: row r's products go to row gate_up_slot[r] of out_gate and out_up (nowhere where it
  // is -1): their t·k + j (no padding rows kept), or r itself (an array 0, 1, ...).
  // NOTES: an array either way: a null pointer meaning "r itself" made ptxas serialise the kernel's wgmma.
  const int32_t* gate_up_slot = nullptr;  // [capacity] device
  DeviceStatus* status = nullptr;         // where a stalled wait is reported
  int32_t* tickets = nullptr;             // [2] device, zero between launches: the dynamic tile scheduler's
                                          // counters (launches sharing them must be stream-ordered)
  int sm_count = 0;                       // CTAs of the persistent grid
  RowLaunch launch;
  // In-kernel gather (row_gather.cuh): when gather_src is set, the kernel itself writes A (`a`, which
  // must then be writable): schedule row r = gather_src[row_token_slot[r] / top_k], zeros where the
  // slot is -1, rows up to expert_offset[experts]. Null: A is already in place.
  const bf16_t* gather_src = nullptr;     // [tokens, K]
  // Set: the gather copies the rows here instead of into A, and no tile waits for them: a copy for a
  // later launch, beside this one's work (one rank's backward: x rows for the weight gradients during
  // a dgrad GEMM). A is then read as it is. The rows are gather_width wide (a multiple of 8; 0: K).
  bf16_t* gather_dst = nullptr;           // [capacity, gather_width]
  int64_t gather_width = 0;
  RowSources gather_sources;              // R > 1: row r from gather_sources.base[row_src_rank[r]] instead of
                                          // gather_src (which must still be set)
  const int32_t* row_token_slot = nullptr;// [capacity] device
  int64_t top_k = 0;
  int32_t* gather_sync = nullptr;         // [gather_sync_ints(capacity)] device: zero before the launch,
                                          // which leaves it zero
#if LYNX_EXPERIMENTS
  int32_t stall_task = -1;                // test hook: the producer never loads this tile (-1: off)
  int32_t gather_stall_block = -1;        // test hook: a row block the gather claims but never copies
#endif
};

// The in-kernel gather's counters of a launch, zero before it: the next schedule row to claim, the
// furthest row block a producer has begun, the CTAs that have finished, then per row block the rows
// copied so far (kBlockM when complete). The last CTA to finish zeroes those it used for the next
// launch (row_gather.cuh, finish_gather), so they are zero between launches.
constexpr int32_t kGatherRowTicket = 0;
constexpr int32_t kGatherFrontier = 1;
constexpr int32_t kGatherCtasDone = 2;
constexpr int32_t kGatherSyncHeader = 3;
inline int64_t gather_sync_ints(int64_t capacity) { return kGatherSyncHeader + capacity / kBlockM; }

// Loads the GEMM kernels into the current context (common/kernel_loading.h says why) and sets them up
// on the current device (shared-memory limits, how many 2-CTA clusters fit, once per process and
// device). A fused workspace calls it when it is made; a launch does it itself
// otherwise, which must not be the first thing a stream capture does.
void prepare_expert_gemm_kernels(int sm_count);

// out = A·B0ᵀ per expert block of rows.
void expert_gemm(const ExpertGemmArgs& args, cudaStream_t stream);

// out = silu(A·B0ᵀ) ⊙ (A·B1ᵀ), and the two products themselves into out_gate / out_up when given.
void expert_gemm_swiglu(const ExpertGemmArgs& args, cudaStream_t stream);

// out = A · [B0; B1] with B0, B1 stored n-major ([K rows, n] per expert: e.g. w_down as [H, I] for
// dy·w_down, or w_gate and w_up stacked along K for [dg | du]·[w_gate; w_up]). No transposed copy of
// the weights is made.
void expert_gemm_n_major(const ExpertGemmArgs& args, cudaStream_t stream);

// Weight gradients per local expert e, over the expert's schedule rows r (its block, up to the last
// 64 rows that hold any):
//   out[e][i][j] = Σ_r a[r][i] · b[r][j]         (i < split, or every i when out2 is null)
//   out2[e][i - split][j] = the same             (i >= split)
// a: [capacity, m], b: [capacity, n], the per-row buffers as they are (no transposed copies); their
// padding rows in each 64-row block that K covers must hold zeros. Each output tile is computed by one
// CTA over the expert's rows in order: deterministic. An expert without rows gets exact zeros.
struct WeightGradArgs {
  const bf16_t* a = nullptr;
  const bf16_t* b = nullptr;
  int64_t m = 0, n = 0, capacity = 0, experts = 0;
  int64_t split = 0;
  const int32_t* expert_offset = nullptr;
  const int32_t* expert_rows = nullptr;   // [experts] device, rows before padding: K stops after the last
                                          // 64-row block holding rows (null: the whole padded block)
  bf16_t* out = nullptr;
  bf16_t* out2 = nullptr;
  int64_t out_stride = 0, out2_stride = 0;  // elements from one expert's matrix to the next (0: contiguous)
  DeviceStatus* status = nullptr;
  int32_t* tickets = nullptr;  // as ExpertGemmArgs::tickets
  int sm_count = 0;
  bool in_order = true;        // tiles claimed in order from the ticket, else the static round robin
};

void expert_weight_grad(const WeightGradArgs& args, cudaStream_t stream);

}  // namespace lynx::gemm
