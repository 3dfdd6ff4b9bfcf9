// The FP8 GEMM kernel's consumers' K-block loop (kernel.cuh): each K block's E4M3 products into a
// temporary, promoted into the running sums with the block's scales.
#pragma once

#include <cstdint>

#include "device/sm90.cuh"
#include "kernels/fp8/gemm/storage.cuh"
#include "kernels/fp8/tiles.h"

namespace lynx::fp8::impl {

// ---- consumers: warpgroup c + 1 computes rows [64c, 64c + 64) of each tile (of a wide tile, its
// rows [0, 64) of part c) ----
// Fragment of thread t of warpgroup c (warp w, lane l): acc[h][4j + r] is row first_row(tile, c) + 16w +
// l/4 + 8(r/2), column 128h + 8j + 2(l%4) + r%2 of the part's columns (gate/up: h = 0 the gate's column
// 8j + .., 1 the up's), j in [0, 16).

// NOTES: in the wide forms and the weight gradient the two consumer warpgroups issue their wgmma
// groups independently, sharing only the stages' barriers. They had issued them in turn (each group at a
// named barrier until the other warpgroup had issued its previous one), which gained the loop alone 14
// points of the FP8 rate (61% against 75%, 2026-12-05) while each group's eight descriptors were
// recomputed from their addresses; with the descriptors as offsets (d8a4107) the loop alone reached 88%
// without turns against 81% with them, and the forward's GEMMs 4-7% less time under ncu (H100,
// 2026-12-06; docs/fp8.md).

// Stages [first, first + count) of the ring waited for and released by a consumer thread that computes
// nothing from them (gemm/kernel.cuh).
template <int kStages>
__device__ __forceinline__ void pass_stages(uint64_t* full, uint64_t* empty, int32_t first, int32_t count,
                                            DeviceStatus* status, int32_t tile) {
  for (int32_t i = first; i < first + count; ++i) {
    sm90::mbarrier_wait(&full[i % kStages], uint32_t(i / kStages) & 1, status, sm90::Wait::kFullStage, tile);
    sm90::mbarrier_arrive(&empty[i % kStages]);
  }
}

// Warpgroup c's sums of `tile` (part_of(tile, c)) over its K blocks into acc (zeroed first). `it`: the
// stages consumed before the tile; a wide tile's K block i is in stage it + wide · i + c, and in one of
// two parts the other part's, it + 2i + 1 − c, is passed on (waited for and released) in its turn.
template <Form kForm, class Out>
__device__ __forceinline__ void mainloop(SharedStorage<kForm>& smem, const TileSpace<kForm>& tiles,
                                         const KernelArgs<Out>& p, const Tile& tile, int32_t t, int32_t it, int c,
                                         float (&acc)[kHalves<kForm>][64]) {
  constexpr bool kSwiGLU = kForm == Form::kSwiGLU;
  constexpr bool kWeightGrad = kForm == Form::kWeightGrad;
  constexpr int kH = kHalves<kForm>;
  constexpr int kStages = SharedStorage<kForm>::kStages;
  const int32_t M = p.M, N = p.N, k_blocks = tiles.k_blocks;
  const int lane = int(threadIdx.x) % 32, warp = (int(threadIdx.x) % 128) / 32;
  const int32_t row0 = first_row(tile, c) + 16 * warp + lane / 4, row1 = row0 + 8;
  const int32_t n = tile.kb_end - tile.kb_begin;
  const bool second = second_half<kForm>(tile, N);
  // A wide tile's part: its own stages, A's first 64 rows of each.
  const bool wide = tile.wide > 0;
  const int32_t stride = stages_per_block(tile), base = it + (wide ? c : 0);
  const int a_row = wide ? 0 : 64 * c;
  // Stage 0's descriptors: this warpgroup's 64 rows of A, and B.
  const uint64_t desc_a = sm90::smem_desc_k_major_sw128(&smem.a[0][a_row * kBlock]);
  const uint64_t desc_b = sm90::smem_desc_k_major_sw128(&smem.b[0][0]);
  // The B scale blocks of the tile's halves (gate/up: the gate's in b_scales, the up's in b2_scales).
  const int64_t b_scale_row = fp8::impl::b_scale_row<kForm>(tile, N, k_blocks, 0);
  const int64_t b2_scale_row = fp8::impl::b_scale_row<kForm>(tile, N, k_blocks, 1);
  const float* b2_scales = kSwiGLU ? p.b2_scales : p.b_scales;
  // NOTES: rows past M and columns past N may end up NaN (their products are zeros, the weight
  // gradient's scales there stale): every epilogue leaves them out.
#pragma unroll
  for (int h = 0; h < kH; ++h) {
#pragma unroll
    for (int e = 0; e < 64; ++e) acc[h][e] = 0.0f;
  }
  // The products of half h of the tile's K block i into d, as one wgmma group (its stage landed).
  // NOTES: each descriptor is stage 0's plus the operand's byte offset / 16 (sm90::smem_desc_offset):
  // recomputed from the address, each of a group's eight cost a mask, a shift and an or, and A's
  // (whose rows depend on c) a move into a uniform register too, ~40 instructions a group on the path
  // from a warpgroup's last promotion to its next wgmma (SASS, 2026-12-06).
  const auto issue_half = [&](float(&d)[64], int32_t i, int h) {
    const int stage = (base + stride * i) % kStages;
    const uint64_t da0 = sm90::smem_desc_offset(desc_a, stage * int(sizeof(smem.a[0])));
    const uint64_t db0 = sm90::smem_desc_offset(desc_b, stage * int(sizeof(smem.b[0])) + h * int(kTileN * kBlock));
    sm90::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < int(kBlock) / 32; ++kk) {  // k32 steps: 32 bytes along the 128-byte rows
      sm90::wgmma_m64n128k32_e4m3(d, sm90::smem_desc_offset(da0, kk * 32), sm90::smem_desc_offset(db0, kk * 32), kk > 0);
    }
    sm90::wgmma_commit();
  };
  const auto wait_full = [&](int32_t i) {
    const int32_t g = base + stride * i;
    sm90::mbarrier_wait(&smem.full[g % kStages], uint32_t(g / kStages) & 1, p.status, sm90::Wait::kFullStage, t);
  };
  const auto issue = [&](float(&d)[64], int32_t i) {
    wait_full(i);
    issue_half(d, i, 0);
  };
  // Block i's stage back to the producer, once every wgmma reading it has completed.
  const auto release = [&](int32_t i) { sm90::mbarrier_arrive(&smem.empty[(base + stride * i) % kStages]); };
  // The forward forms' scales (a row's per K block, [M, K blocks]; the halves' B blocks), loaded from
  // global memory ahead of their use; the weight gradient's (per row of A and per column of B) come
  // with the stage.
  struct Scales {
    float a0, a1, b, b2;
  };
  const auto scales_of = [&](int32_t i) {
    const int32_t kb = tile.kb_begin + i;
    const auto a_scale = [&](int32_t row) { return row < M ? p.a_scales[int64_t(row) * k_blocks + kb] : 0.0f; };
    return Scales{a_scale(row0), a_scale(row1), p.b_scales[b_scale_row + kb], b2_scales[b2_scale_row + kb]};
  };
  // d, its group completed, into `to` times the rows' scale products s0 (row0) and s1 (row1): exact
  // products of E4M3 values, so the order of the sums is the promotion's alone.
  const auto promote = [&](float(&to)[64], float(&d)[64], float s0, float s1) {
    sm90::fence_registers(d);
#pragma unroll
    for (int e = 0; e < 64; ++e) to[e] = fmaf(d[e], (e % 4) < 2 ? s0 : s1, to[e]);
  };
  float pa[64];
  if constexpr (kWeightGrad) {
    // NOTES: one half's products at a time through one temporary, leaving the overlap to the other
    // warpgroup: with two temporaries it spilled (120 bytes, its scales read from the stage by ld.shared),
    // and ptxas serialised its wgmma.
    const int row = 64 * c + 16 * warp + lane / 4;  // the tile's rows row, row + 8
    // Half h's first column scales of the stage: columns 128h + 8j + 2(l%4) + {0, 1}, j in [0, 8).
    // NOTES: read before the half's group is issued, so that the promotion after its wait starts without
    // waiting for them (read after it, the first FMULs waited on the loads: ~6% of the kernel's warp
    // samples, ncu, H100, 2026-12-06); the other eight after it, behind the first eight's products. All
    // sixteen before it spilled 38 bytes.
    constexpr int kEarlyScales = 8;
    const auto column_scale = [&](int stage, int h, int j) {
      return sm90::ld_shared_x2(&smem.scale_b[stage][kTileN * h + 8 * j + 2 * (lane % 4)]);
    };
    const auto column_scales = [&](float2(&b)[kEarlyScales], int stage, int h) {
#pragma unroll
      for (int j = 0; j < kEarlyScales; ++j) b[j] = column_scale(stage, h, j);
    };
    // pa, its group completed, into half h's running sums times the rows' and the columns' scales.
    const auto promote_columns = [&](float(&to)[64], const float2(&early)[kEarlyScales], int stage, int h, float a0,
                                     float a1) {
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const float2 b = j < kEarlyScales ? early[j % kEarlyScales] : column_scale(stage, h, j);
        to[4 * j] = fmaf(pa[4 * j], a0 * b.x, to[4 * j]);
        to[4 * j + 1] = fmaf(pa[4 * j + 1], a0 * b.y, to[4 * j + 1]);
        to[4 * j + 2] = fmaf(pa[4 * j + 2], a1 * b.x, to[4 * j + 2]);
        to[4 * j + 3] = fmaf(pa[4 * j + 3], a1 * b.y, to[4 * j + 3]);
      }
    };
    for (int32_t i = 0; i < n; ++i) {
      wait_full(i);
      const int stage = (it + i) % kStages;  // (never a wide tile)
      const float a0 = sm90::ld_shared(&smem.scale_a[stage][row]), a1 = sm90::ld_shared(&smem.scale_a[stage][row + 8]);
      const auto half = [&](float(&to)[64], int h) {
        float2 early[kEarlyScales];
        column_scales(early, stage, h);
        issue_half(pa, i, h);
        sm90::wgmma_wait<0>();
        sm90::fence_registers(pa);
        promote_columns(to, early, stage, h, a0, a1);
      };
      half(acc[0], 0);
      if (second) half(acc[1], 1);
      release(i);  // once its scales are read
    }
  } else if constexpr (kH == 2) {
    // Each K block's halves one after another through pa; the scales a block ahead (their loads'
    // latency behind this block's products). Nothing orders the two warpgroups: while one waits for
    // its group and promotes it, the other's may run.
    // A wide tile of two parts: K block i's stage of the other part passed on, so that the warpgroup
    // takes the ring's stages in order: warpgroup 1 passes part 0's before its own, warpgroup 0 part 1's
    // after its own.
    const bool pass_before = stride == 2 && !computes_part(tile, c, 0);
    const bool pass_after = stride == 2 && !computes_part(tile, c, 1);
    const auto pass = [&](int32_t i) {
      pass_stages<kStages>(smem.full, smem.empty, it + 2 * i + 1 - c, 1, p.status, t);
    };
    Scales next = n > 0 ? scales_of(0) : Scales{};
    for (int32_t i = 0; i < n; ++i) {
      const Scales sc = next;
      if (i + 1 < n) next = scales_of(i + 1);
      if (pass_before) pass(i);
      wait_full(i);
      issue_half(pa, i, 0);
      sm90::wgmma_wait<0>();
      if (!second) release(i);
      promote(acc[0], pa, sc.a0 * sc.b, sc.a1 * sc.b);
      if (second) {
        issue_half(pa, i, 1);
        sm90::wgmma_wait<0>();
        release(i);
        promote(acc[1], pa, sc.a0 * sc.b2, sc.a1 * sc.b2);
      }
      if (pass_after) pass(i);
    }
  } else {
    // NOTES: pipelined: block i + 1's group is issued before block i's products are promoted, so the
    // tensor cores work on it meanwhile (wait_group 1: only block i's group must have completed).
    float pb[64];
    const auto promote_block = [&](float(&d)[64], int32_t i, const Scales& sc) {
      release(i);
      promote(acc[0], d, sc.a0 * sc.b, sc.a1 * sc.b);
    };
    if (n > 0) issue(pa, 0);
    int32_t i = 0;
    for (; i + 2 < n; i += 2) {
      Scales sc = scales_of(i);
      issue(pb, i + 1);
      sm90::wgmma_wait<1>();
      promote_block(pa, i, sc);
      sc = scales_of(i + 1);
      issue(pa, i + 2);
      sm90::wgmma_wait<1>();
      promote_block(pb, i + 1, sc);
    }
    if (i + 1 < n) {  // two blocks left, in pa and pb
      Scales sc = scales_of(i);
      issue(pb, i + 1);
      sm90::wgmma_wait<1>();
      promote_block(pa, i, sc);
      sc = scales_of(i + 1);
      sm90::wgmma_wait<0>();
      promote_block(pb, i + 1, sc);
    } else if (i < n) {  // one, in pa
      const Scales sc = scales_of(i);
      sm90::wgmma_wait<0>();
      promote_block(pa, i, sc);
    }
    // NOTES: ptxas, not seeing that a tail always follows the loop, adds an empty wait on the exit
    // path (warning C7517). A wgmma_wait<0> here instead made it serialise every wgmma (C7514;
    // tools/sass-check would say SERIAL).
  }
}

}  // namespace lynx::fp8::impl
