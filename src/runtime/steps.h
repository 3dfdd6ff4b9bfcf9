// The steps of a layer call that the unfused and the fused paths share.
#pragma once

#include "runtime/workspace.h"

namespace lynx {

template <class T>
T* data_of(const TensorView& v) {
  return static_cast<T*>(v.data);
}

// Queues, with no host synchronisation: status reset, routing validation, the schedule, the gather of
// x rows into schedule order (unless `gather_rows` is false: the fused path places its gather itself,
// fused/forward.h), and
// the shared expert's gate/up GEMMs.
void enqueue_dispatch(Workspace::Impl& w, const LayerInputs& in, cudaStream_t s, bool gather_rows = true);

// Queues the shared expert's SwiGLU and down GEMM, then the combine of the routed rows (already in
// w.un.rows_a) into y. Combine writes nothing if a kernel reported an error.
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
