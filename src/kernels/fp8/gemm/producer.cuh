// The FP8 GEMM kernel's producer (kernel.cuh): TMA loads of each tile's K blocks into the ring of stages.
#pragma once

#include <cstdint>

#include "device/sm90.cuh"
#include "kernels/expert_gemm/row_gather.cuh"
#include "kernels/fp8/gemm/storage.cuh"
#include "kernels/fp8/tiles.h"

namespace lynx::fp8::impl {

// ---- producer: warpgroup 0's first thread ----
// The tiles' K blocks into the ring of stages, running ahead into the next tile's while the consumers
// finish a tile; the stages' phases counted over the CTA's whole run (`it`, the stages filled). A wide
// tile's K block fills a stage for each of its parts, in turn.
template <Form kForm, class Out, int kGather>
__device__ __forceinline__ void producer(SharedStorage<kForm>& smem, const TileSpace<kForm>& tiles,
                                         const KernelArgs<Out>& p) {
  constexpr bool kSwiGLU = kForm == Form::kSwiGLU;
  constexpr bool kWeightGrad = kForm == Form::kWeightGrad;
  constexpr int kStages = SharedStorage<kForm>::kStages;
  const int32_t M = p.M, N = p.N;
  sm90::prefetch_tma_descriptor(p.tma_a);
  sm90::prefetch_tma_descriptor(p.tma_b);
  if constexpr (kSwiGLU) sm90::prefetch_tma_descriptor(p.tma_b2);
  int32_t it = 0;
  for (int32_t t = blockIdx.x; t < tiles.count; t += gridDim.x) {
    const Tile tile = tiles[t];
    // The rows of the tile's block, when the kernel gathers A (announced first: row_gather.cuh).
    if constexpr (kGather != kGatherNone) gemm::await_gathered_rows(p.gather, tile.m0 / kTileM, t, p.status);
    // The weight gradient's scales ([K blocks, M or N rounded up to 4]): a K block's of the tile's rows
    // and columns, as far as the rounded rows go (the scales of rows and columns past M and N are read,
    // never stored: their products are zeros and their outputs not stored).
    const int32_t lda = int32_t(scale_pitch(M)), ldb = int32_t(scale_pitch(N));
    const uint32_t a_scale_bytes = kWeightGrad ? 4 * uint32_t(min(kTileM, lda - tile.m0)) : 0;
    const uint32_t b_scale_bytes = kWeightGrad ? 4 * uint32_t(min(kOutN<kForm>, ldb - tile.n0)) : 0;
    // The tile's parts (part_of): part p's columns from n0 + p · kOutN.
    // NOTES: stepped by their columns: counted, each made by part_of, they spilled 20 bytes of the
    // producer's 40 registers in the gathering grouped form (its stall report; CUDA 13.0, 2026-12-07).
    const int32_t n0_end = tile.n0 + stages_per_block(tile) * kOutN<kForm>;
    for (int32_t kb = tile.kb_begin; kb < tile.kb_end; ++kb) {
      for (Tile sub = tile; sub.n0 < n0_end; sub.n0 += kOutN<kForm>, ++it) {
        const bool second = second_half<kForm>(sub, N);
        const int stage = it % kStages;
        // The stage's previous use (it - kStages) must be released by every consumer thread.
        if (it >= kStages) {
          sm90::mbarrier_wait(&smem.empty[stage], uint32_t(it / kStages + 1) & 1, p.status, sm90::Wait::kEmptyStage, t);
        }
        // NOTES: boxes past M, N or K are zero-filled by the TMA and still count their whole bytes.
        sm90::mbarrier_arrive_expect_tx(&smem.full[stage], stage_bytes<kForm>(sub, N) + a_scale_bytes + b_scale_bytes);
        if constexpr (kWeightGrad) {
          sm90::bulk_load(smem.scale_a[stage], p.a_scales + int64_t(kb) * lda + tile.m0, a_scale_bytes,
                          &smem.full[stage]);
          sm90::bulk_load(smem.scale_b[stage], p.b_scales + int64_t(kb) * ldb + tile.n0, b_scale_bytes,
                          &smem.full[stage]);
        }
        const int32_t k = kb * int32_t(kBlock);
        sm90::tma_load_2d(smem.a[stage], p.tma_a, &smem.full[stage], k, tile.m0);
        uint8_t* b = smem.b[stage];
        if constexpr (kSwiGLU) {  // [128 gate rows; the same 128 up rows]
          sm90::tma_load_3d(b, p.tma_b, &smem.full[stage], k, sub.n0, tile.expert);
          sm90::tma_load_3d(b + kTileN * kBlock, p.tma_b2, &smem.full[stage], k, sub.n0, tile.expert);
        } else if constexpr (kForm == Form::kGrouped) {  // B rows n0 .. + 127, then (second) n0 + 128 .. + 255
          sm90::tma_load_3d(b, p.tma_b, &smem.full[stage], k, sub.n0, tile.expert);
          if (second) sm90::tma_load_3d(b + kTileN * kBlock, p.tma_b, &smem.full[stage], k, sub.n0 + kTileN, tile.expert);
        } else {  // dense, and the weight gradients' transposed rows (theirs in two halves, as the grouped form's)
          sm90::tma_load_2d(b, p.tma_b, &smem.full[stage], k, tile.n0);
          if (kWeightGrad && second) sm90::tma_load_2d(b + kTileN * kBlock, p.tma_b, &smem.full[stage], k, tile.n0 + kTileN);
        }
      }
    }
  }
}

}  // namespace lynx::fp8::impl
