// The passes of a workspace's precision, step by step (runtime/fused_passes.h: FP8 runs on the fused
// backend only), and the check that an FP8 pass is given the weights its E4M3 copies were made from.
#pragma once

#include "lynx/error.h"
#include "runtime/fp8_passes.h"
#include "runtime/fused_passes.h"
#include "runtime/workspace.h"

namespace lynx::api {

inline bool fp8(const Workspace::Impl& w) { return w.config.precision == Precision::kFp8Block; }

inline void forward_step(Workspace::Impl& w, const LayerInputs& in, const TensorView& y, cudaStream_t s,
                         fused::Step step) {
  if (fp8(w)) return fp8pass::forward(w, in, y, s, step);
  fused::forward(w, in, y, s, step);
}

inline void recompute_step(Workspace::Impl& w, const LayerInputs& in, cudaStream_t s, fused::Step step) {
  if (fp8(w)) return fp8pass::recompute_forward_context(w, in, s, step);
  fused::recompute_forward_context(w, in, s, step);
}

inline void backward_step(Workspace::Impl& w, const LayerInputs& in, const TensorView& dy, const Gradients& grads,
                          cudaStream_t s, fused::Step step) {
  if (fp8(w)) return fp8pass::backward(w, in, dy, grads, s, step);
  fused::backward(w, in, dy, grads, s, step);
}

// The FP8 passes read the weights' E4M3 copies: they must be those of the weights given (pointer
// identity). Nothing for bf16.
inline void require_quantized_weights(const Workspace::Impl& w, const LayerInputs& in) {
  if (!fp8(w)) return;
  if (!w.quantized_weights.valid) {
    throw Error("weights", "config.precision is fp8_block: call quantize_weights before the first forward");
  }
  const QuantizedWeightsKey given{in.weights.w_gate.data, in.weights.w_up.data, in.weights.w_down.data, true};
  if (!(w.quantized_weights == given)) {
    throw Error("weights", "are not the tensors quantize_weights was given: call it with these weights");
  }
}

}  // namespace lynx::api
