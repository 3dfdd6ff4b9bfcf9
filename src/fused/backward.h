// The fused backward path (R = 1), with no host synchronisation: every routed GEMM runs on the
// expert GEMM kernel, which reads the schedule on the device. The kernel takes K-major operands only,
// so weights and per-row activations are transposed first (see docs/backward.md for the cost).
#pragma once

#include "api/workspace_impl.h"

namespace lynx::fused {

void backward(Workspace::Impl& ws, const LayerInputs& in, const TensorView& dy, const Gradients& grads,
              cudaStream_t stream);

}  // namespace lynx::fused
