// The baseline (Backend::kUnfused): schedule on the device, gather, cuBLAS grouped GEMMs, SwiGLU, combine; the same
// for backward. It is the baseline of the fused kernels and the reference for large shapes.
//
// NOTES: cuBLAS needs each expert's row count on the host, so every call reads the schedule's counts
// back once (one stream synchronisation after the schedule is built). This path therefore cannot be
// captured in a CUDA graph; the fused path has no such synchronisation.
#pragma once

#include "runtime/workspace.h"

namespace lynx::baseline {

void forward(Workspace::Impl& ws, const LayerInputs& in, const TensorView& y, cudaStream_t stream);
void recompute_forward_context(Workspace::Impl& ws, const LayerInputs& in, cudaStream_t stream);
void backward(Workspace::Impl& ws, const LayerInputs& in, const TensorView& dy, const Gradients& grads,
              cudaStream_t stream);

}  // namespace lynx::baseline
