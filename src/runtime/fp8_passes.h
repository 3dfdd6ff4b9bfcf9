// The FP8 passes (Config::precision == Precision::kFp8Block, docs/fp8.md), by launches of their own,
// correct first, in the bf16 passes' three steps (fused_passes.h). The tokens' rows travel as 1×128
// tiles, one byte an element plus a scale per 128: one rank quantises its tokens and gathers their
// tiles into schedule order; at R > 1 each rank stages its tokens' tiles in its open step and pulls the
// tiles its experts need. The close steps (the combines) are the bf16 passes'.
// The forward: the schedule; x's tiles in schedule order; the gate/up GEMM with SwiGLU on E4M3 operands,
// h quantised in its epilogue; the down GEMM on E4M3 operands into the rows the combine reads; the shared
// expert (bf16) and the combine as in the bf16 forward. No host synchronisation. With
// config.save_forward_context it keeps the context the backward reads: the schedule, g and u (the FP8
// products, rounded to bf16) as the bf16 forward keeps them, and at R > 1 the x rows as they travelled
// (x̂). A NaN or an infinity in x or h is reported through the status word (Workspace::check; at R > 1
// by the rank that holds it and the ranks that pull a tile of it, naming that rank, and by every other
// rank as a peer's error), and y is then not written.
#pragma once

#include "runtime/fused_passes.h"
#include "runtime/workspace.h"

namespace lynx::fp8pass {

// The E4M3 copies of the routed experts' weights, per 128×128 block of each expert's matrix (`copies`:
// the forward's, the backward's transposed ones, or both); a weight that is not finite is reported
// through the status word, as the pass reports x.
void quantize_weights(Workspace::Impl& w, const ExpertWeights& weights, Fp8Copies copies, cudaStream_t s);

// Pre-quantised weights (moe.h, set_quantized_weights): copied as the E4M3 copies, the transposed copies
// quantised from their values; a value or scale that is not finite reported as quantize_weights does.
void set_quantized_weights(Workspace::Impl& w, const Fp8ExpertWeights& weights, cudaStream_t s);

void forward(Workspace::Impl& w, const LayerInputs& in, const TensorView& y, cudaStream_t s, fused::Step step);

// The forward's context without y (Workspace::recompute_forward_context): the same FP8 g and u.
void recompute_forward_context(Workspace::Impl& w, const LayerInputs& in, cudaStream_t s, fused::Step step);

// The backward on that context, its two dgrad GEMMs in FP8: dy's tiles in schedule order (as x's), da
// = dy_row · w_down on w_downᵀ's blocks; the SwiGLU backward in bf16; dg | du quantised in 1×128 tiles
// over K = 2I, dx_row on [w_gate; w_up]ᵀ's blocks; the combine into dx. The weight gradients per expert
// over its rows read the token rows as they travelled (x̂ and dŷ, dequantised): in FP8 with both
// operands transposed and quantised in 1×128 tiles along the rows (dg | du with x̂, dŷ with
// w·silu(g)⊙u), or in bf16 (config.bf16_weight_grads). A NaN or an infinity in dy, or an overflow of
// dg | du, is reported as the forward reports x.
void backward(Workspace::Impl& w, const LayerInputs& in, const TensorView& dy, const Gradients& grads, cudaStream_t s,
              fused::Step step);

}  // namespace lynx::fp8pass
