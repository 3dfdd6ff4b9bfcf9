// The public entry points: validate everything on the host, then hand over to the chosen path.
#include "lynx/moe.h"

#include "api/call.h"
#include "baseline/passes.h"
#include "lynx/error.h"
#include "runtime/fused_passes.h"
#include "runtime/scratch.h"
#include "runtime/workspace.h"

namespace lynx {

using api::check_device;
using api::enqueue_pass;
using api::require_connected;

void forward(Workspace& ws, const LayerInputs& in, const TensorView& y, cudaStream_t stream) {
  Workspace::Impl& w = ws.impl();
  validate_inputs(w.shape, in);
  validate_output(w.shape, y);
  if (y.data == in.x.data) throw Error("y", "must not alias x");
  check_device(w);
  require_connected(w);
  enqueue_pass(w, [&] {
    const ScratchLease scratch(w, stream);
    if (w.config.backend == Backend::kFused) {
      for (fused::Step step : fused::kSteps) fused::forward(w, in, y, stream, step);
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
  require_connected(w);
  enqueue_pass(w, [&] {
    const ScratchLease scratch(w, stream);
    if (w.config.backend == Backend::kFused) {
      for (fused::Step step : fused::kSteps) fused::recompute_forward_context(w, in, stream, step);
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
  require_connected(w);
  enqueue_pass(w, [&] {
    const ScratchLease scratch(w, stream);
    if (w.config.backend == Backend::kFused) {
      for (fused::Step step : fused::kSteps) fused::backward(w, in, dy, grads, stream, step);
    } else {
      baseline::backward(w, in, dy, grads, stream);
    }
  });
  ++w.backward_calls;
}

}  // namespace lynx
