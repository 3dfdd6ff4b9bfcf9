// The fused backward path (R = 1), with no host synchronisation: every routed GEMM runs on the
// expert GEMM kernel, which reads the schedule on the device and takes the weights and the per-row
// buffers in their stored layouts (K-, N- or M-major), so nothing is transposed.
#pragma once

#include "api/workspace_impl.h"

namespace lynx::fused {

void backward(Workspace::Impl& ws, const LayerInputs& in, const TensorView& dy, const Gradients& grads,
              cudaStream_t stream);

}  // namespace lynx::fused
