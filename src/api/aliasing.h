// Which of a call's tensors may share memory: none of its outputs with another output or with an
// input (a pass reads its inputs while it writes, and at one rank reads x again after it writes dx).
// Byte ranges, so that views into one allocation are caught where they overlap and pass where they
// do not. Host-only; run after the tensors' own checks (validate.cpp), which make them contiguous.
#pragma once

#include <cstddef>
#include <vector>

#include "lynx/moe.h"

namespace lynx::api {

// y against x, topk_ids, topk_weights and the weights.
void check_forward_aliasing(const LayerInputs& in, const TensorView& y);

// Every gradient against every other and against x, topk_ids, topk_weights, the weights and dy.
void check_backward_aliasing(const LayerInputs& in, const TensorView& dy, const Gradients& grads);

// Across the ranks of one *_ranks call, which run at once: each rank's outputs (y; the gradients)
// against every other rank's outputs and inputs. Inputs may be shared between ranks (each only reads
// them), outputs not: each rank writes its own, the shared expert's gradients too (partial sums).
// Run after each rank's own checks.
void check_ranks_forward_aliasing(const std::vector<LayerInputs>& in, const std::vector<TensorView>& y);
void check_ranks_backward_aliasing(const std::vector<LayerInputs>& in, const std::vector<TensorView>& dy,
                                   const std::vector<Gradients>& grads);

// A caller's forward context (Config::caller_context): the bytes [data, data + bytes) a call uses of it.
struct ContextBytes {
  const void* data;
  size_t bytes;
};
// A forward (y present) or a recompute (y absent) writes the context: against y, x, topk_ids,
// topk_weights and the weights.
void check_context_written(const LayerInputs& in, const TensorView& y, ContextBytes ctx);
// A backward reads it: every gradient against it.
void check_context_read(const Gradients& grads, ContextBytes ctx);

}  // namespace lynx::api
