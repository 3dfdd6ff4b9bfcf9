// The steps of a layer call that the unfused and the fused paths share.
#pragma once

#include "runtime/workspace.h"

namespace lynx {

template <class T>
T* data_of(const TensorView& v) {
  return static_cast<T*>(v.data);
}

// Whether a backward computes the routed experts' weight gradients, and the shared expert's: the caller
// gives all three of a group or none (validate_gradients), e.g. none for frozen experts.
inline bool wants_expert_weight_grads(const Gradients& g) { return g.dw_gate.present(); }
inline bool wants_shared_weight_grads(const Gradients& g) { return g.dws_gate.present(); }

// Queues the schedule build (no host synchronisation). At R = 1 the build checks and copies the
// caller's ids itself; at R > 1 it reads every rank's checked copy (stage_routing, in the pass's
// opening step) and writes each placed row into its source rank's slot_row.
void enqueue_schedule(Workspace::Impl& w, const LayerInputs& in, cudaStream_t s);

// R > 1, the opening step of a forward or recompute: this rank's routing checked and copied into its
// shared region (enqueue_stage_routing), and x copied to its token rows, for the other ranks to read.
void enqueue_stage_routing(Workspace::Impl& w, const LayerInputs& in, cudaStream_t s);
void enqueue_stage_inputs(Workspace::Impl& w, const LayerInputs& in, cudaStream_t s);

// The shared expert's gate/up GEMMs, and its SwiGLU and down GEMM (fp32 output in w.un.ys).
void enqueue_shared_gate_up(Workspace::Impl& w, const LayerInputs& in, cudaStream_t s);
void enqueue_shared_down(Workspace::Impl& w, const LayerInputs& in, cudaStream_t s);

// Runs the shared expert's products, forward and backward, once on zeros (x, dy and the weights in a
// block of their own; the intermediates in the workspace's buffers, or in that block where they are
// lent), so that cuBLAS loads their kernels when the workspace is made rather than at a pass's first
// call (common/kernel_loading.h says why; cuBLAS loads a kernel at its first use, whatever
// CUDA_MODULE_LOADING says). cuBLAS chooses its kernel by the products' shapes and by their operands'
// alignment: the block's operands are aligned to 256 bytes or more, as lynx's buffers and PyTorch's
// tensors are. Waits for the GPU. Nothing when there is no shared expert.
void load_shared_expert_kernels(Workspace::Impl& w);

// The combine of the routed rows (w.un.rows_a; at R > 1 every rank's, pulled) into y, with the shared
// expert's output. Writes nothing if a kernel reported an error (at R > 1: any rank, this pass).
void enqueue_combine(Workspace::Impl& w, const LayerInputs& in, const TensorView& y, cudaStream_t s);

// Queues, with no host synchronisation: the schedule, the gather of x rows into schedule order (unless
// `gather_rows` is false: the fused path places its gather itself), and the shared expert's gate/up
// GEMMs. One rank.
void enqueue_dispatch(Workspace::Impl& w, const LayerInputs& in, cudaStream_t s, bool gather_rows = true);

// The shared expert's SwiGLU and down GEMM, then the combine. One rank.
void enqueue_shared_and_combine(Workspace::Impl& w, const LayerInputs& in, const TensorView& y, cudaStream_t s);

// Copies the per-expert counts and the status to the host and waits for them; throws on a reported
// error. Afterwards w.host_expert_offset() / host_expert_rows() are valid.
void fetch_counts(Workspace::Impl& w, cudaStream_t s);

// Throws unless the workspace holds a forward context for these inputs.
void require_context(const Workspace::Impl& w, const LayerInputs& in);

// Queues the shared expert's backward (no host synchronisation): its weight gradients into `grads`
// and its dx, in fp32, into w.un.ys. Nothing when there is no shared expert.
void enqueue_shared_backward(Workspace::Impl& w, const LayerInputs& in, const TensorView& dy, const Gradients& grads,
                             cudaStream_t s);

}  // namespace lynx
