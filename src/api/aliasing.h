// Which of a call's tensors may share memory: none of its outputs with another output or with an
// input (a pass reads its inputs while it writes, and at one rank reads x again after it writes dx).
// Byte ranges, so that views into one allocation are caught where they overlap and pass where they
// do not. Host-only; run after the tensors' own checks (validate.cpp), which make them contiguous.
#pragma once

#include "lynx/moe.h"

namespace lynx::api {

// y against x, topk_ids, topk_weights and the weights.
void check_forward_aliasing(const LayerInputs& in, const TensorView& y);

// Every gradient against every other and against x, topk_ids, topk_weights, the weights and dy.
void check_backward_aliasing(const LayerInputs& in, const TensorView& dy, const Gradients& grads);

}  // namespace lynx::api
