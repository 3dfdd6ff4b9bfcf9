// The fused backend's passes (R = 1): the schedule kernel, then the routed experts on the expert GEMM
// kernel, which reads the schedule from device memory (forward: gate/up with SwiGLU in the epilogue,
// then down; backward: da, the SwiGLU backward, dx_row, then the weight gradients), the shared expert
// and the combines. No host synchronisation anywhere: capturable in a CUDA graph. Errors found on the
// device (routing, schedule capacity) leave y and dx unwritten and are reported by Workspace::check().
#pragma once

#include "runtime/workspace.h"

namespace lynx::fused {

void forward(Workspace::Impl& ws, const LayerInputs& in, const TensorView& y, cudaStream_t stream);
void recompute_forward_context(Workspace::Impl& ws, const LayerInputs& in, cudaStream_t stream);
void backward(Workspace::Impl& ws, const LayerInputs& in, const TensorView& dy, const Gradients& grads,
              cudaStream_t stream);

}  // namespace lynx::fused
