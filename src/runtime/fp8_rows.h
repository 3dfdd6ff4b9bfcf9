// The FP8 passes' token rows as 1×128 tiles (fp8_rows.cpp): quantised, staged for other ranks, put in
// schedule order, transposed for a weight gradient, dequantised; and the status report each names.
// Shared by the forward (fp8_forward.cpp), the backward (fp8_backward.cpp) and the weights' quantisation
// (fp8_weights.cpp).
#pragma once

#include <cstdint>

#include "kernels/fp8/api.h"
#include "runtime/workspace.h"

namespace lynx::fp8pass {

// A NaN or an infinity in `what`, reported through this rank's status word (Workspace::check).
fp8::NonfiniteReport report(const Workspace::Impl& w, Fp8Tensor what);

// The schedule's half blocks where the plan computes them in wide tiles (the grouped GEMMs'
// half_block_offset), else null.
inline const int32_t* half_blocks(const Workspace::Impl& w) {
  return w.plan.fp8_wide_tiles ? w.schedule.half_block_offset : nullptr;
}

// R > 1, the open step: this rank's tokens of `rows` (x, or dy) quantised once per token in 1×128 tiles
// into its shared region's token rows, where the ranks whose experts need them pull them.
void stage_tiles(Workspace::Impl& w, const TensorView& rows, Fp8Tensor what, cudaStream_t s);

// One rank's tokens of `rows` (x, or dy) quantised once per token in 1×128 tiles, into f8.x.
void quantize_tokens(Workspace::Impl& w, const TensorView& rows, Fp8Tensor what, cudaStream_t s);

// The 1×128 tiles of `rows`' tokens (x, or dy) in schedule order, into f8.xg.
void tiles_in_schedule_order(Workspace::Impl& w, const TensorView& rows, Fp8Tensor what, cudaStream_t s);

// tiles_in_schedule_order's work left to a grouped GEMM that gathers the tiles' bytes itself: one rank
// quantises its tokens of `rows` into f8.x, and the rows' scales go into f8.xg_scales in schedule order
// (pulled from their source ranks at R > 1); the returned TileGather has the GEMM copy the bytes, at most
// `lookahead` bf16 row blocks ahead of its tiles (plan/gather.h).
fp8::TileGather tiles_for_gemm_gather(Workspace::Impl& w, const TensorView& rows, Fp8Tensor what, int32_t lookahead,
                                      cudaStream_t s);

// A weight gradient's operand from one rank's tokens' tiles (f8.x): transposed and quantised along the
// rows into q, scales; with `kept`, the tiles in schedule order there too (gather_tiles' bits).
void transposed_token_tiles(const Workspace::Impl& w, Fp8Tensor what, uint8_t* q, float* scales, cudaStream_t s,
                            const fp8::GatheredTiles& kept = {});

// f8.xg's rows as bf16, into `out`: x̂ or dŷ, the rows as they travelled.
void dequantized_rows(const Workspace::Impl& w, bf16_t* out, cudaStream_t s);

// One rank's x̂ or dŷ rows in schedule order into `out`, from its tokens' tiles in f8.x.
void dequantized_token_rows(const Workspace::Impl& w, bf16_t* out, cudaStream_t s);

}  // namespace lynx::fp8pass
