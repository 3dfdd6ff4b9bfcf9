// The passes of a workspace's precision, step by step (runtime/fused_passes.h: FP8 runs on the fused
// backend only), and the check that an FP8 pass is given the weights its E4M3 copies were made from.
#pragma once

#include <string>

#include "lynx/error.h"
#include "runtime/fp8_passes.h"
#include "runtime/fused_passes.h"
#include "runtime/workspace.h"

namespace lynx::api {

inline bool fp8(const Workspace::Impl& w) { return w.config.precision == Precision::kFp8Block; }

// The calls that give a workspace its FP8 weights (`call`) need one made with fp8_block; the error names
// `argument` (the workspace's config, or which of a call's workspaces).
inline void require_fp8(const Workspace::Impl& w, const char* call, const char* argument = "config.precision") {
  if (!fp8(w)) throw Error(argument, std::string("is bf16: ") + call + " is for a workspace made with fp8_block");
}

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

// The FP8 passes read the weights' E4M3 copies, `copies` (the forward's, or the backward's transposed
// ones): they must be those of the weights given (pointer identity and dtype: bf16 ones given to
// quantize_weights, or e4m3 ones to set_quantized_weights). The bf16 passes take bf16 weights only.
inline void require_quantized_weights(const Workspace::Impl& w, const LayerInputs& in, Fp8Copies copies) {
  const ExpertWeights& x = in.weights;
  const DType dtype = x.w_gate.dtype;
  if (x.w_up.dtype != dtype || x.w_down.dtype != dtype) {
    throw Error("weights", "w_gate, w_up and w_down must have one dtype, got " + std::string(dtype_name(dtype)) + ", " +
                               dtype_name(x.w_up.dtype) + " and " + dtype_name(x.w_down.dtype));
  }
  if (!fp8(w)) {
    if (dtype != DType::kBF16) {
      throw Error("weights",
                  "are e4m3, but config.precision is bf16 (fp8_block takes them, after set_quantized_weights)");
    }
    return;
  }
  const bool forward = copies == Fp8Copies::kForward;
  const QuantizedWeightsKey& made = forward ? w.fp8_store->forward : w.fp8_store->backward;
  const std::string which =
      forward ? "the forward's copies (Fp8Copies::kForward)" : "the backward's copies (Fp8Copies::kBackward)";
  if (!made.valid) {
    throw Error("weights", "config.precision is fp8_block: call quantize_weights (or set_quantized_weights) before "
                           "the first " + std::string(forward ? "forward" : "backward") + ", making " + which);
  }
  const QuantizedWeightsKey given = QuantizedWeightsKey::of(x, dtype);
  if (!(made == given)) {
    throw Error("weights", dtype == DType::kE4M3
                               ? "are not the tensors set_quantized_weights was given: call it with these weights"
                               : "are not the tensors quantize_weights last made " + which +
                                     " from: call it with these weights");
  }
}

}  // namespace lynx::api
