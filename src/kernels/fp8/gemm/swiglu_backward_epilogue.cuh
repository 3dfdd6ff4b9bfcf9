// The dgrad of down's epilogue with the SwiGLU backward (kernel.cuh, Form::kSwiGLUBackward): a tile's da,
// never stored, turned into the quantised operands of the dgrad of gate/up (dg | du in 1×128 row tiles)
// and of the weight gradients (dg | du and hw transposed, in 128-row tiles), and each row's sums of
// da·silu(g)·u over the tile's 128-column chunks (api.h, SwiGLUBackwardOutputs).
//
// NOTES: a tile's [128, 256] sums are two 128-column halves, each one 1×128 tile of every row of dg and
// of du and one 128-row tile of each of its columns of dg, du and hw, since the schedule pads every
// expert to whole 128-row blocks: so every code and scale of the row kernel and transpose_tiles
// (glue.cu, transpose_tiles.cu) comes from the tile in registers, from the same bf16 values
// (swiglu_backward.cuh). Per half: each thread's 2 rows × 32 columns of dg, du and hw as bf16 pairs (96
// registers); a row's largest magnitude over the four threads of the row (shuffles); a column's over the
// tile's 128 rows, each warp's 16 rows by shuffles that leave each lane two of its sixteen column
// groups, then shared-memory maxima over the eight warps of both consumer warpgroups (each half's values
// carry an epoch above the magnitude bits, so that no one clears them between halves); the codes into
// shared memory, out by TMA stores that drain during the next half. Against the dgrad GEMM writing da
// and a kernel of its own reading da, g and u back (~0.3 GB at qwen3-30b-a3b), the epilogue reads g and
// u alone.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "device/sm90.cuh"
#include "kernels/expert_gemm/epilogue.cuh"
#include "kernels/fp8/e4m3.cuh"
#include "kernels/fp8/gemm/epilogue.cuh"
#include "kernels/fp8/gemm/storage.cuh"
#include "kernels/fp8/tiles.h"
#include "kernels/glue/swiglu_backward.cuh"

namespace lynx::fp8::impl {

using SwiGLUBackwardSmem = SharedStorage<Form::kSwiGLUBackward>;

// The named barrier of the two consumer warpgroups (ids 1 and 2 are each warpgroup's own).
constexpr int kConsumersBarrier = 3;

// The slots of a consumer thread's two rows of its tile (64c + 16·warp + lane / 4 + 8r; -1: a padding
// row), loaded at the tile's start: the epilogue's first loads wait for them. A tile's rows lie below
// the schedule's total (whole 128-row blocks).
struct SwiGLUBackwardRows {
  int32_t slot[2];
};
__device__ __forceinline__ SwiGLUBackwardRows swiglu_backward_rows(const SwiGLUBackwardOutputs& o, const Tile& tile,
                                                                   int c) {
  const int lane = int(threadIdx.x) % 32, warp = (int(threadIdx.x) % 128) / 32;
  const int32_t row = tile.m0 + 64 * c + 16 * warp + lane / 4;
  return {{__ldg(o.row_token_slot + row), __ldg(o.row_token_slot + row + 8)}};
}

// Byte (column col, row) of a [128 columns, 128 rows] transposed box, 128-byte swizzle.
__device__ __forceinline__ uint32_t transposed_offset(int col, int row) {
  return uint32_t(col * 128 + (((row >> 4) ^ (col & 7)) << 4) + (row & 15));
}

// A word's two bf16 magnitudes (kMagnitudeBits of each half).
__device__ __forceinline__ uint32_t magnitudes(uint32_t w) { return w & 0x7FFF7FFFu; }

// One 128-column half h of the tile (columns col0 = n0 + 128h ..), its da in `da` (as bf16 pairs: word
// 2j + r holds columns 8j + 2q, + 1 of row r), `epoch` its number in the CTA's run (from 1; below 2^16).
template <class Out>
__device__ __forceinline__ void swiglu_backward_half(SwiGLUBackwardSmem& smem, const KernelArgs<Out>& p,
                                                     const Tile& tile, int c, int h, const uint32_t (&da)[32],
                                                     const int32_t (&slot)[2], const float (&w)[2],
                                                     uint32_t epoch) {
  using namespace e4m3;
  const SwiGLUBackwardOutputs& o = *p.dswiglu;
  const int thread = int(threadIdx.x) % 128, warp = thread / 32, lane = thread % 32, x = lane / 4, q = lane % 4;
  const int32_t N = p.N, col0 = tile.n0 + kTileN * h;
  const int32_t row0 = tile.m0 + 64 * c + 16 * warp + x;  // row r: row0 + 8r
  // g and u of columns col0 + 8j + 2q, + 1 of each row (zeros for a padding row), eight groups j at a
  // time: with all sixteen in flight beside both halves' sums, ptxas spilled.
  const uint32_t* g[2];
  const uint32_t* u[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t at = (o.by_slot ? int64_t(slot[r]) : int64_t(row0 + 8 * r)) * N + col0 + 2 * q;
    g[r] = reinterpret_cast<const uint32_t*>(o.g + at);
    u[r] = reinterpret_cast<const uint32_t*>(o.u + at);
  }
  // dg, du, hw as bf16 pairs; each row's chunk sum of da·silu(g)·u as a tree over j (swiglu_backward.cuh):
  // level[r][l] holds the pending sum of 2^l terms.
  uint32_t v[3][2][16];  // dg, du, hw
  float level[2][4], chunk[2];
#pragma unroll
  for (int j0 = 0; j0 < 16; j0 += 8) {
    uint32_t gw[2][8], uw[2][8];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        gw[r][j] = slot[r] >= 0 ? __ldg(g[r] + 4 * (j0 + j)) : 0u;
        uw[r][j] = slot[r] >= 0 ? __ldg(u[r] + 4 * (j0 + j)) : 0u;
      }
    }
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) {
      const int j = j0 + jj;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float2 a = bf16_pair(da[2 * j + r]);
        const glue::SwigluPair s = glue::swiglu_backward_pair(a, bf16_pair(gw[r][jj]), bf16_pair(uw[r][jj]), w[r]);
        const bool live = slot[r] >= 0;
        v[0][r][j] = live ? gemm::impl::bf16x2_bits(s.dg) : 0u;
        v[1][r][j] = live ? gemm::impl::bf16x2_bits(s.du) : 0u;
        v[2][r][j] = live ? gemm::impl::bf16x2_bits(s.hw) : 0u;
        float d = live ? s.dot : 0.0f;
#pragma unroll
        for (int l = 0; l < 4; ++l) {  // j's bit l set: add to the pending sum of level l, else wait there
          if (!((j >> l) & 1)) {
            level[r][l] = d;
            break;
          }
          d = __fadd_rn(level[r][l], d);
          if (l == 3) chunk[r] = d;
        }
      }
    }
  }
  // The rows' chunk sums: the four threads of a row, (s0 + s1) + (s2 + s3).
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    chunk[r] = __fadd_rn(chunk[r], __shfl_xor_sync(0xffffffffu, chunk[r], 1));
    chunk[r] = __fadd_rn(chunk[r], __shfl_xor_sync(0xffffffffu, chunk[r], 2));
    if (o.chunk_sums != nullptr && q == 0 && slot[r] >= 0) {
      o.chunk_sums[int64_t(row0 + 8 * r) * (N / kTileN) + col0 / kTileN] = chunk[r];
    }
  }
  // Each row's tile of dg and of du: its largest magnitude over the row's four threads, its scale.
  float row_inv[2][2];
  const int64_t row_scales = 2 * int64_t(N) / kTileN;
#pragma unroll
  for (int t = 0; t < 2; ++t) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      uint32_t m2 = 0;
#pragma unroll
      for (int j = 0; j < 16; ++j) m2 = __vmaxu2(m2, magnitudes(v[t][r][j]));
      uint32_t m = max(m2 & 0xFFFFu, m2 >> 16);
      m = max(m, __shfl_xor_sync(0xffffffffu, m, 1));
      m = max(m, __shfl_xor_sync(0xffffffffu, m, 2));
      const bool finite = m < kInfBits;
      const int e = scale_exponent_of_bf16_bits(m) & -int(finite);
      row_inv[t][r] = pow2(-e);
      if (q == 0) {
        if (!finite) report_nonfinite(o.dgu_report);
        o.dgu_scales[int64_t(row0 + 8 * r) * row_scales + (int64_t(t) * N + col0) / kTileN] = scale_or_nan(e, finite);
      }
    }
  }
  // Each column's largest magnitude over the warp's 16 rows, its sixteen groups of pairs halved at each
  // step (lanes 16, 8 and 4 apart): lane (x, q) keeps groups j = 2x and 2x + 1, then into shared memory.
#pragma unroll
  for (int t = 0; t < 3; ++t) {
    uint32_t m[16];
#pragma unroll
    for (int j = 0; j < 16; ++j) m[j] = __vmaxu2(magnitudes(v[t][0][j]), magnitudes(v[t][1][j]));
    // Lanes 16, 8, then 4 apart (x's bits 2, 1, 0) halve their groups: each keeps the lower or the upper
    // half by its bit, taking the other lane's maxima of those.
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const bool bit = (x >> 2) & 1;
      const uint32_t send = bit ? m[i] : m[i + 8], keep = bit ? m[i + 8] : m[i];
      m[i] = __vmaxu2(keep, __shfl_xor_sync(0xffffffffu, send, 16));
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const bool bit = (x >> 1) & 1;
      const uint32_t send = bit ? m[i] : m[i + 4], keep = bit ? m[i + 4] : m[i];
      m[i] = __vmaxu2(keep, __shfl_xor_sync(0xffffffffu, send, 8));
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const bool bit = x & 1;
      const uint32_t send = bit ? m[i] : m[i + 2], keep = bit ? m[i + 2] : m[i];
      m[i] = __vmaxu2(keep, __shfl_xor_sync(0xffffffffu, send, 4));
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int col = 8 * (2 * x + i) + 2 * q;
      atomicMax(&smem.column_max[t][col], epoch << 16 | (m[i] & 0xFFFFu));
      atomicMax(&smem.column_max[t][col + 1], epoch << 16 | (m[i] >> 16));
    }
  }
  // The boxes free (the previous half's stores have read them) and every warp's maxima in.
  if (thread == 0) sm90::bulk_wait_group_read<0>();
  sm90::named_barrier_sync(kConsumersBarrier, 2 * 128);
  // The codes: dg and du along the rows into this warpgroup's boxes; dg, du and hw along the columns,
  // transposed. Column 8j + 2q + e of row `row` in a transposed box lies at offset[r][e] + 1024j (its
  // column % 8 is 2q + e whatever j).
  uint32_t offset[2][2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = 64 * c + 16 * warp + x + 8 * r;
#pragma unroll
    for (int e = 0; e < 2; ++e) offset[r][e] = transposed_offset(2 * q + e, row);
  }
  // The scales of column pair 8j + 2q, + 1 of tensor t: their exponents (0 where not finite).
  struct ColumnScales {
    int e0, e1;
    bool finite0, finite1;
  };
  const auto column_scales = [&](int t, int j) {
    const uint2 mm = sm90::ld_shared_u32x2(&smem.column_max[t][8 * j + 2 * q]);
    const uint32_t m0 = mm.x & 0xFFFFu, m1 = mm.y & 0xFFFFu;
    ColumnScales cs;
    cs.finite0 = m0 < kInfBits;
    cs.finite1 = m1 < kInfBits;
    // (0 where not finite, by a mask: a conditional call made each a branch)
    cs.e0 = scale_exponent_of_bf16_bits(m0) & -int(cs.finite0);
    cs.e1 = scale_exponent_of_bf16_bits(m1) & -int(cs.finite1);
    return cs;
  };
#pragma unroll
  for (int t = 0; t < 3; ++t) {
    const uint32_t box_t = sm90::smem_addr(smem.codes_t[t]);
    const uint32_t box_rows = t < 2 ? sm90::smem_addr(smem.codes_rows[c][t]) : 0u;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const ColumnScales cs = column_scales(t, j);
      const float inv0 = pow2(-cs.e0), inv1 = pow2(-cs.e1);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float2 f = bf16_pair(v[t][r][j]);
        const uint32_t codes = to_e4m3x2(f.x * inv0, f.y * inv1);
        sm90::st_shared_u8(box_t + offset[r][0] + 1024 * j, codes);
        sm90::st_shared_u8(box_t + offset[r][1] + 1024 * j, codes >> 8);
        if (t < 2) {
          sm90::st_shared_u16(box_rows + code_offset(warp, lane, j, r), uint16_t(pack2_bits(v[t][r][j], row_inv[t][r])));
        }
      }
    }
  }
  // Each column's scale by warp 0 of warpgroup 0, lane (x, q) those of groups 2x and 2x + 1.
  if (c == 0 && warp == 0) {
    const int64_t block_row = tile.m0 / kTileM;
#pragma unroll
    for (int t = 0; t < 3; ++t) {
      const int64_t pitch = scale_pitch(t < 2 ? 2 * int64_t(N) : int64_t(N));
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int j = 2 * x + i;
        const ColumnScales cs = column_scales(t, j);
        float* scales = (t < 2 ? o.dgu_t_scales : o.hw_t_scales) + block_row * pitch + (t == 1 ? N : 0) + col0 + 8 * j + 2 * q;
        scales[0] = scale_or_nan(cs.e0, cs.finite0);
        scales[1] = scale_or_nan(cs.e1, cs.finite1);
        if (!(cs.finite0 && cs.finite1)) report_nonfinite(t < 2 ? o.dgu_report : o.hw_report);
      }
    }
  }
  sm90::fence_proxy_async_shared();
  sm90::named_barrier_sync(kConsumersBarrier, 2 * 128);
  if (thread == 0) {
    const int32_t row = tile.m0 + 64 * c;
    sm90::tma_store_2d(p.tma_out, smem.codes_rows[c][0], col0, row);
    sm90::tma_store_2d(p.tma_out, smem.codes_rows[c][1], N + col0, row);
    if (c == 0) {
      sm90::tma_store_2d(p.tma_out2, smem.codes_t[0], tile.m0, col0);
      sm90::tma_store_2d(p.tma_out2, smem.codes_t[1], tile.m0, N + col0);
    } else {
      sm90::tma_store_2d(p.tma_out3, smem.codes_t[2], tile.m0, col0);
    }
    sm90::bulk_commit_group();
  }
}

// Half h's g and u of the thread's rows on their way to L2: lanes q = 0, 1 the two 128-byte lines of g
// of a row, 2 and 3 those of u.
__device__ __forceinline__ void prefetch_gate_up(const SwiGLUBackwardOutputs& o, const Tile& tile, int c, int32_t N,
                                                 const SwiGLUBackwardRows& rows, int h) {
  const int q = int(threadIdx.x) % 4;
  const int32_t row0 = tile.m0 + 64 * c + 16 * ((int(threadIdx.x) % 128) / 32) + (int(threadIdx.x) % 32) / 4;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int32_t s = rows.slot[r];
    if (s < 0) continue;
    const int64_t at = (o.by_slot ? int64_t(s) : int64_t(row0 + 8 * r)) * N + tile.n0 + kTileN * h + 64 * (q % 2);
    sm90::prefetch_l2((q < 2 ? o.g : o.u) + at);
  }
}

// The tile's halves (the second where it has columns). `tile_index`: the tile's number in the CTA's run;
// `next`: the CTA's next tile, if any, whose first half's g and u go to L2 once this one is done.
// NOTES: both halves of the next tile's g and u go to L2 during its K loop (~15 µs at qwen3-30b-a3b);
// against the second half's fetched during the first half's work, no change (1b6741b, H100): the loads
// wait on L2, not DRAM.
template <class Out>
__device__ __forceinline__ void swiglu_backward_epilogue(SwiGLUBackwardSmem& smem, const KernelArgs<Out>& p,
                                                         const Tile& tile, int c, const float (&acc)[2][64],
                                                         const SwiGLUBackwardRows& rows, int32_t tile_index,
                                                         const Tile* next) {
  const SwiGLUBackwardOutputs& o = *p.dswiglu;
  const bool second = second_half<Form::kSwiGLUBackward>(tile, p.N);
  SwiGLUBackwardRows next_rows{{-1, -1}};
  if (next != nullptr) next_rows = swiglu_backward_rows(o, *next, c);
  float w[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int32_t s = rows.slot[r];
    w[r] = s >= 0 && o.topk_weights != nullptr ? __ldg(o.topk_weights + s) : 1.0f;
  }
  if (second && tile_index == 0) prefetch_gate_up(o, tile, c, p.N, rows, 1);
  // da rounded to bf16, as the plain grouped form stores it: word 2j + r of half h holds columns 8j +
  // 2q, + 1 of row r (half the registers of the fp32 sums, which the first half's work needs).
  uint32_t da[2][32];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int i = 0; i < 32; ++i) da[h][i] = gemm::impl::bf16x2_bits(make_float2(acc[h][2 * i], acc[h][2 * i + 1]));
  }
  // NOTES: one half's code run twice, the second half's da moved into the first's registers. With a copy
  // of the code for each half (~6 k instructions each: fully unrolled over 16 column groups, 3 tensors and 2
  // rows) the kernel's 12.9 k took ~1.5 ms at qwen3-30b-a3b where ~13 µs a tile would issue (H100,
  // 2026-12-07, d1363d4), 46% of its warp samples waiting for instructions; this way 7.4 k, 2.4% so
  // (bench/results/2026-12-07-h100-c58cafc-fp8-swiglu-epilogue-stalls-log.txt on main).
  const uint32_t epoch = 2 * uint32_t(tile_index) + 1;
#pragma unroll 1
  for (int h = 0; h < (second ? 2 : 1); ++h) {
    swiglu_backward_half(smem, p, tile, c, h, da[0], rows.slot, w, epoch + uint32_t(h));
#pragma unroll
    for (int i = 0; i < 32; ++i) da[0][i] = da[1][i];
  }
  if (next != nullptr) {
    prefetch_gate_up(o, *next, c, p.N, next_rows, 0);
    if (second_half<Form::kSwiGLUBackward>(*next, p.N)) prefetch_gate_up(o, *next, c, p.N, next_rows, 1);
  }
}

}  // namespace lynx::fp8::impl
