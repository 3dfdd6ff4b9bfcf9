// The FP8 forward (Config::precision == Precision::kFp8Block, one rank, docs/fp8.md), by launches of its
// own, correct first: the schedule; x quantised once per token (1×128 tiles) and its tiles gathered into
// schedule order; the gate/up GEMM with SwiGLU on E4M3 operands (h in bf16); h quantised; the down GEMM
// on E4M3 operands into the rows the combine reads; the shared expert (bf16) and the combine as in the
// bf16 forward. No host synchronisation. With config.save_forward_context it keeps the context the bf16
// backward reads: the schedule, and g and u (the FP8 products, rounded to bf16) by slot, as the bf16
// forward keeps them; the backward is bf16 (docs/fp8.md). A NaN or an infinity in x or h is reported
// through the status word (Workspace::check), and y is then not written.
#pragma once

#include "runtime/workspace.h"

namespace lynx::fp8pass {

// The E4M3 copies of the routed experts' weights, per 128×128 block of each expert's matrix; a weight
// that is not finite is reported through the status word, as the pass reports x.
void quantize_weights(Workspace::Impl& w, const ExpertWeights& weights, cudaStream_t s);

void forward(Workspace::Impl& w, const LayerInputs& in, const TensorView& y, cudaStream_t s);

// The forward's context without y (Workspace::recompute_forward_context): the same FP8 g and u.
void recompute_forward_context(Workspace::Impl& w, const LayerInputs& in, cudaStream_t s);

}  // namespace lynx::fp8pass
