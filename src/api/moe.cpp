// The public entry points: validate everything on the host, then hand over to the chosen path.
#include "lynx/moe.h"

#include "baseline/passes.h"
#include "lynx/error.h"
#include "runtime/fused_passes.h"
#include "runtime/workspace.h"

namespace lynx {
namespace {

void check_device(const Workspace::Impl& w) {
  int device = -1;
  if (cudaGetDevice(&device) != cudaSuccess || device != w.device) {
    throw Error("stream", "the current CUDA device (" + std::to_string(device) + ") is not the workspace's device (" +
                              std::to_string(w.device) + ")");
  }
}

// Runs a pass's enqueue. A CUDA error it meets after a device wait timed out (whose trap lost the
// context) is reported as that wait: the host-mapped stall report names it, the CUDA error does not.
// NOTES: a launch or a lazy module load after the trap fails with "unspecified launch failure"
// before Workspace::check could read the report.
template <class Enqueue>
void enqueue_pass(const Workspace::Impl& w, Enqueue&& enqueue) {
  try {
    enqueue();
  } catch (const Error&) {
    if (w.stall_report && w.stall_report->code != int32_t(StatusCode::kOk)) {
      throw Error("", describe_status(*w.stall_report, w.shape.top_k));
    }
    throw;
  }
}

}  // namespace

void forward(Workspace& ws, const LayerInputs& in, const TensorView& y, cudaStream_t stream) {
  Workspace::Impl& w = ws.impl();
  validate_inputs(w.shape, in);
  validate_output(w.shape, y);
  if (y.data == in.x.data) throw Error("y", "must not alias x");
  check_device(w);
  enqueue_pass(w, [&] {
    if (w.config.backend == Backend::kFused) {
      fused::forward(w, in, y, stream);
    } else {
      baseline::forward(w, in, y, stream);
    }
  });
  ++w.forward_calls;
}

void recompute_forward_context(Workspace& ws, const LayerInputs& in, cudaStream_t stream) {
  Workspace::Impl& w = ws.impl();
  validate_inputs(w.shape, in);
  check_device(w);
  enqueue_pass(w, [&] {
    if (w.config.backend == Backend::kFused) {
      fused::recompute_forward_context(w, in, stream);
    } else {
      baseline::recompute_forward_context(w, in, stream);
    }
  });
}

void backward(Workspace& ws, const LayerInputs& in, const TensorView& dy, const Gradients& grads, cudaStream_t stream) {
  Workspace::Impl& w = ws.impl();
  validate_inputs(w.shape, in);
  validate_gradients(w.shape, dy, grads);
  if (grads.dx.data == dy.data) throw Error("dx", "must not alias dy");
  check_device(w);
  enqueue_pass(w, [&] {
    if (w.config.backend == Backend::kFused) {
      fused::backward(w, in, dy, grads, stream);
    } else {
      baseline::backward(w, in, dy, grads, stream);
    }
  });
  ++w.backward_calls;
}

}  // namespace lynx
