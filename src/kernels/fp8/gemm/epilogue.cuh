// The FP8 GEMM kernel's epilogues (kernel.cuh): a tile's sums out, as fp32 rows (dense), bf16 pieces by
// TMA or by slot, or h quantised into the down GEMM's 1×128 tiles (gate/up).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "device/activation.cuh"
#include "device/sm90.cuh"
#include "kernels/expert_gemm/epilogue.cuh"
#include "kernels/fp8/e4m3.cuh"
#include "kernels/fp8/gemm/storage.cuh"
#include "kernels/fp8/tiles.h"

namespace lynx::fp8::impl {

// ---- epilogue: the tile's sums out ----

// Columns col (even) and col + 1 of an fp32 row of N (the dense form): one store of both where N is even
// (the pair is then aligned), else each below N on its own.
__device__ __forceinline__ void store_pair(float* row, int32_t col, int32_t N, float v0, float v1) {
  if (col + 1 < N && N % 2 == 0) {
    *reinterpret_cast<float2*>(row + col) = make_float2(v0, v1);
    return;
  }
  if (col < N) row[col] = v0;
  if (col + 1 < N) row[col + 1] = v1;
}

// NOTES: the quantising gate/up epilogue. Each row of a warpgroup's piece is one 1×128 tile of h (n0 is
// a multiple of 128): its largest magnitude (the thread's 32 values of each of its two rows, then the
// four threads of the row: lanes l ^ 1, l ^ 2), its scale, the codes, out by a TMA store of a [64, 128]
// byte box (128-byte swizzle) through the piece's first box, and the scales. The values are h rounded
// to bf16, as the bf16 output holds them, quantised with e4m3.cuh's helpers: the bits quantize_tiles
// gives from that output.

// Fragment word 2j + r of a thread: h of columns 8j + 2(lane % 4) + {0, 1}, row half r, as bf16.
__device__ __forceinline__ float2 bf16_pair(uint32_t w) {
  const __nv_bfloat162 v = *reinterpret_cast<const __nv_bfloat162*>(&w);
  return __bfloat1622float2(v);
}

// Warpgroup c's rows [row, row + 64) of h, columns [n0, n0 + 128) (h(j, r): the fragment's values),
// quantised.
template <Form kForm, class Out, class Value>
__device__ __forceinline__ void quantize_h_piece(SharedStorage<kForm>& smem, const KernelArgs<Out>& p, int c,
                                                 int32_t n0, int32_t row, Value h) {
  const int thread = int(threadIdx.x) % 128, warp = thread / 32, lane = thread % 32;
  const int32_t N = p.N;
  uint32_t words[32];
#pragma unroll
  for (int j = 0; j < 16; ++j) {
#pragma unroll
    for (int r = 0; r < 2; ++r) words[2 * j + r] = gemm::impl::bf16x2_bits(h(j, r));
  }
  // Each row's largest magnitude and finiteness over the tile's columns below N.
  float amax[2] = {0.0f, 0.0f};
  bool bad[2] = {false, false};
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const int32_t col = n0 + 8 * j + 2 * (lane % 4);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float2 v = bf16_pair(words[2 * j + r]);
      if (col < N) {
        bad[r] = bad[r] || !isfinite(v.x);
        amax[r] = fmaxf(amax[r], fabsf(v.x));
      }
      if (col + 1 < N) {
        bad[r] = bad[r] || !isfinite(v.y);
        amax[r] = fmaxf(amax[r], fabsf(v.y));
      }
    }
  }
  float inv[2], scale[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
#pragma unroll
    for (int o = 1; o <= 2; o <<= 1) {
      amax[r] = fmaxf(amax[r], __shfl_xor_sync(0xffffffffu, amax[r], o));
      bad[r] = __shfl_xor_sync(0xffffffffu, int(bad[r]), o) != 0 || bad[r];
    }
    const int e = bad[r] ? 0 : e4m3::scale_exponent(amax[r]);
    inv[r] = e4m3::pow2(-e);
    scale[r] = e4m3::scale_or_nan(e, !bad[r]);
  }
  if ((bad[0] || bad[1]) && lane % 4 == 0) e4m3::report_nonfinite(p.h_report);
  // The codes into box 0 as one [64, 128] byte box, 128-byte swizzle (code_offset, tiles.h), once the
  // box's last store has read it and every thread is done with it.
  const uint32_t box = sm90::smem_addr(smem.piece[0][c][0]);
  if (thread == 0) sm90::bulk_wait_group_read<0>();
  sm90::named_barrier_sync(1 + c, 128);
#pragma unroll
  for (int j = 0; j < 16; ++j) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float2 v = bf16_pair(words[2 * j + r]);
      sm90::st_shared_u16(box + code_offset(warp, lane, j, r), e4m3::to_e4m3x2(v.x * inv[r], v.y * inv[r]));
    }
  }
  sm90::fence_proxy_async_shared();
  sm90::named_barrier_sync(1 + c, 128);
  if (thread == 0) {
    sm90::tma_store_2d(p.tma_out2, smem.piece[0][c][0], n0, row);
    sm90::bulk_commit_group();
  }
  if (lane % 4 == 0) {
    const int64_t blocks = blocks_of(N);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int32_t R = row + 16 * warp + lane / 4 + 8 * r;
      if (R < p.M) p.h_scales[int64_t(R) * blocks + n0 / int32_t(kBlock)] = scale[r];
    }
  }
}

// kept_slots: the slots of the kept g and u rows this thread stores (gemm::impl::fragment_slots), loaded
// at the tile's start; null: loaded here. previous_second: whether the warpgroup's previous tile stored a
// second half (the grouped form's pieces).
template <Form kForm, class Out>
__device__ __forceinline__ void epilogue(SharedStorage<kForm>& smem, const KernelArgs<Out>& p, const Tile& tile,
                                         int c, const float (&acc)[kHalves<kForm>][64], const int2* kept_slots,
                                         bool previous_second) {
  constexpr bool kSwiGLU = kForm == Form::kSwiGLU;
  constexpr bool kWeightGrad = kForm == Form::kWeightGrad;
  const int32_t M = p.M, N = p.N, m0 = tile.m0, n0 = tile.n0;
  const int lane = int(threadIdx.x) % 32, warp = (int(threadIdx.x) % 128) / 32;
  if constexpr (kForm == Form::kDense) {  // fp32 out: each thread's two rows, two adjacent columns at a time
    const int32_t row0 = m0 + 64 * c + 16 * warp + lane / 4, row1 = row0 + 8;
    float* dst[2] = {row0 < M ? p.out + int64_t(row0) * N : nullptr, row1 < M ? p.out + int64_t(row1) * N : nullptr};
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const int32_t col = n0 + 8 * j + 2 * (lane % 4);
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // rows row0 (acc[4j], acc[4j + 1]) and row1 (acc[4j + 2], acc[4j + 3])
        if (dst[h] != nullptr) store_pair(dst[h], col, N, acc[0][4 * j + 2 * h], acc[0][4 * j + 2 * h + 1]);
      }
    }
  } else {
    // The warpgroup's piece: rows [m0 + 64c, + 64), fragment column group j (columns 8j ..) of half h in
    // row half r at acc[h][4j + 2r], acc[h][4j + 2r + 1]. The TMA stores leave out rows and columns past
    // their tensor.
    const int32_t row = m0 + 64 * c;
    const auto pair = [&](int h, int i) { return make_float2(acc[h][i], acc[h][i + 1]); };
    if constexpr (kSwiGLU) {  // 128 columns: h = silu(g) ⊙ u from the gate's half and the up's
      const auto h = [&](int j, int r) {
        const int i = 4 * j + 2 * r;
        return make_float2(epilogue_silu(acc[0][i]) * acc[1][i], epilogue_silu(acc[0][i + 1]) * acc[1][i + 1]);
      };
      if (p.store_h) gemm::impl::store_piece<false>(smem.piece[0][c], p.tma_out, c, n0, row, 0, N, h);
      // NOTES: from the fragments, not staged in the piece (store_fragment_rows says how): without kept g
      // and u the forward was 5.8% faster (299d468's probe, docs/fp8.md).
      if (p.kept.gate != nullptr) {  // row by row, by slot
        using gemm::impl::SlotRows;
        const int2 slots = kept_slots ? *kept_slots : gemm::impl::fragment_slots(p.kept.slot, row);
        gemm::impl::store_fragment_rows(SlotRows{p.kept.gate, p.kept.slot, N}, slots, N, n0, acc[0]);
        gemm::impl::store_fragment_rows(SlotRows{p.kept.up, p.kept.slot, N}, slots, N, n0, acc[1]);
      }
      // Last: the acc registers are dead once it has taken h's words.
      if (p.quantize_h) quantize_h_piece(smem, p, c, n0, row, h);
    } else if constexpr (kWeightGrad) {  // the expert's rows [0, split) to out, the others to out2
      // Each half in its piece, as the grouped form's below (previous_second: the warpgroup's last stored
      // tile's).
      if (row < M) {
        const bool lower = row >= p.split;
        const CUtensorMap* map = lower ? p.tma_out2 : p.tma_out;
        const int32_t out_row = lower ? row - p.split : row;
        if (!previous_second && threadIdx.x % 128 == 0) sm90::bulk_wait_group_read<0>();
        gemm::impl::store_piece<true, 1>(smem.piece[0][c], map, c, n0, out_row, tile.expert, N,
                                         [&](int j, int r) { return pair(0, 4 * j + 2 * r); });
        if (second_half<kForm>(tile, N)) {
          gemm::impl::store_piece<true, 1>(smem.piece[1][c], map, c, n0 + kTileN, out_row, tile.expert, N,
                                           [&](int j, int r) { return pair(1, 4 * j + 2 * r); });
        }
      }
    } else {  // grouped: the first half's columns, then the second's where it has any, each in its piece
      // NOTES: one store group since each piece's last (the other piece's): the previous tile's second
      // half before the first piece, this tile's first half before the second. Where the previous tile
      // had no second half, its first half's store, the last, read the first piece: waited for here.
      if (!previous_second && threadIdx.x % 128 == 0) sm90::bulk_wait_group_read<0>();
      gemm::impl::store_piece<false, 1>(smem.piece[0][c], p.tma_out, c, n0, row, 0, N,
                                        [&](int j, int r) { return pair(0, 4 * j + 2 * r); });
      if (second_half<kForm>(tile, N)) {
        gemm::impl::store_piece<false, 1>(smem.piece[1][c], p.tma_out, c, n0 + kTileN, row, 0, N,
                                          [&](int j, int r) { return pair(1, 4 * j + 2 * r); });
      }
    }
  }
}

}  // namespace lynx::fp8::impl
