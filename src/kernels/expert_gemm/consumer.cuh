// The expert GEMM's consumers (MMA): two warpgroups of 64 rows each run the wgmma mainloop over the
// stages the producer fills, release each stage, and hand their accumulators to the epilogue.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "device/activation.cuh"
#include "device/sm90.cuh"
#include "kernels/expert_gemm/epilogue.cuh"
#include "kernels/expert_gemm/tile_scheduler.h"
#include "kernels/expert_gemm/traits.cuh"

namespace lynx::gemm::impl {

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
// (measured 2026-12-02, commit 8062572).
constexpr uint64_t kConsumersDoneNs = 2 * sm90::kMbarrierWaitNs;

// kRowsFromFragments: the kept gate and up rows stored straight from the fragments (store_fragment_rows);
// else staged in pieces.
// NOTES: not where the kernel pulls rows from other ranks: there ptxas serialised the wgmma (C7511).
template <Mode kMode, bool kFold, bool kRowsFromFragments>
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
    // loss measured on 2026-11-29 (commit 6e0170f).
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
    // ptxas serialise every wgmma (measured 2026-12-02, commit 2fe9a46).
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
            return make_float2(epilogue_silu(g[0]) * u[0], epilogue_silu(g[1]) * u[1]);
          });
          if (p.out_gate_up) {
            store_swapped_piece(smem.c[c], p.gate_rows, c, t.b_row, row, p.n,
                                [&](int b, int i) { return make_float2(acc[8 * b + i], acc[8 * b + i + 1]); });
            store_swapped_piece(smem.c[c], p.up_rows, c, t.b_row, row, p.n, [&](int b, int i) {
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
          return make_float2(epilogue_silu(acc[i]) * acc[64 + i], epilogue_silu(acc[i + 1]) * acc[64 + i + 1]);
        });
      }
      if (p.out_gate_up && kRowsFromFragments) {  // row by row, by slot
        store_fragment_rows(p.gate_rows, fragment_slots(p.gate_rows.slot, row), p.n, t.b_row, acc);
        store_fragment_rows(p.up_rows, fragment_slots(p.up_rows.slot, row), p.n, t.b_row, acc + 64);
      } else if (p.out_gate_up) {
#pragma unroll
        for (int q = 0; q < 16 / kGroups; ++q) {
          store_piece<false>(smem.c[c], p.gate_rows, c, t.b_row + 8 * kGroups * q, row, 0, p.n, [&](int j, int r) {
            const int i = 4 * (kGroups * q + j) + 2 * r;
            return make_float2(acc[i], acc[i + 1]);
          });
        }
#pragma unroll
        for (int q = 0; q < 16 / kGroups; ++q) {
          store_piece<false>(smem.c[c], p.up_rows, c, t.b_row + 8 * kGroups * q, row, 0, p.n, [&](int j, int r) {
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
            return make_float2(epilogue_silu(g[i]) * u[i], epilogue_silu(g[i + 1]) * u[i + 1]);
          });
          if (p.out_gate_up) {
            store_fold_box(smem.c[c], p.gate_rows, c, col, tail_row, p.n, [&](int i) { return make_float2(g[i], g[i + 1]); });
            store_fold_box(smem.c[c], p.up_rows, c, col, tail_row, p.n, [&](int i) { return make_float2(u[i], u[i + 1]); });
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

}  // namespace lynx::gemm::impl
