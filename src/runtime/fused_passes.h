// The fused backend's passes: the schedule kernel, then the routed experts on the expert GEMM kernel,
// which reads the schedule from device memory (forward: gate/up with SwiGLU in the epilogue, then down;
// backward: da, the SwiGLU backward, dw_down, dx_row over the dy rows, dw_gate | dw_up), the shared expert and the
// combines. No host synchronisation anywhere: capturable in a CUDA graph. Errors found on the device
// (routing, schedule capacity) leave y and dx unwritten and are reported by Workspace::check().
//
// At R > 1 a pass has two cross-rank barriers, which cut it into three steps (Step); each rank queues
// its three in order on its own stream (one per device or process; the virtual-rank driver gives each
// virtual rank one, api/ranks.cpp).
//   open:    what the other ranks read is staged in this rank's shared region; arrive.
//   compute: wait for every rank; the schedule over every rank's routing; the experts, pulling the
//            rows they need from their source ranks; arrive.
//   close:   wait for every rank (and take over a rank's error); combine, pulling each (t, j)'s row
//            from the rank that computed it.
// At R = 1 there are no barriers: the three steps queue the one-rank launches, in their order.
#pragma once

#include "runtime/workspace.h"

namespace lynx::fused {

enum class Step { kOpen, kCompute, kClose };
inline constexpr Step kSteps[] = {Step::kOpen, Step::kCompute, Step::kClose};

void forward(Workspace::Impl& ws, const LayerInputs& in, const TensorView& y, cudaStream_t stream, Step step);
void recompute_forward_context(Workspace::Impl& ws, const LayerInputs& in, cudaStream_t stream, Step step);
void backward(Workspace::Impl& ws, const LayerInputs& in, const TensorView& dy, const Gradients& grads,
              cudaStream_t stream, Step step);

}  // namespace lynx::fused
