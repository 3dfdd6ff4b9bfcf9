// The public entry points: validate everything on the host, then hand over to the chosen path.
#include "lynx/moe.h"

#include <cstdint>
#include <string>

#include "api/aliasing.h"
#include "api/call.h"
#include "api/passes.h"
#include "baseline/passes.h"
#include "common/cuda_check.h"
#include "common/current_device.h"
#include "lynx/error.h"
#include "runtime/context.h"
#include "runtime/scratch.h"
#include "runtime/workspace.h"

namespace lynx {

using api::check_device;
using api::require_connected;
using api::require_quantized_weights;

namespace {

// Whether the call's form (with a ForwardContext or without) is the workspace's.
void require_context_form(const Workspace::Impl& w, bool given) {
  if (w.config.caller_context && !given) {
    throw Error("ctx", "this workspace keeps no forward context (Config::caller_context): pass a ForwardContext");
  }
  if (!w.config.caller_context && given) {
    throw Error("ctx", "this workspace keeps its own forward context: make it with Config::caller_context to pass one");
  }
}

// NOTES: the unfused backend reads the schedule's counts back to the host between its kernels, which a
// stream being captured into a CUDA graph cannot do: refused before anything is queued, so that the
// caller's capture and the workspace's context stay as they were.
void require_not_captured(const Workspace::Impl& w, cudaStream_t stream) {
  if (w.config.backend != Backend::kUnfused) return;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaError_t e = cudaStreamIsCapturing(stream, &status);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky: this call's own
    throw Error("stream", std::string("cannot be used now (") + cudaGetErrorString(e) + ")");
  }
  if (status != cudaStreamCaptureStatusNone) {
    throw Error("stream", "is being captured into a CUDA graph: the unfused backend reads counts back to the host "
                          "between its kernels, which a graph cannot hold (the fused backend can be captured)");
  }
}

void validate_context(const Workspace::Impl& w, const ForwardContext& ctx) {
  if (ctx.data == nullptr) throw Error("ctx.data", "is null");
  if (ctx.bytes < w.context_block.bytes) {
    throw Error("ctx.bytes", "is " + std::to_string(ctx.bytes) + "; the workspace's context needs " +
                                 std::to_string(w.context_block.bytes) + " (Workspace::forward_context_bytes)");
  }
  if (reinterpret_cast<uintptr_t>(ctx.data) % 256 != 0) throw Error("ctx.data", "must be 256-byte aligned");
}

// The bytes of a caller's context that a call uses (its own layout's, from the start).
api::ContextBytes used_bytes(const Workspace::Impl& w, const ForwardContext& ctx) {
  return {ctx.data, size_t(w.context_block.bytes)};
}

// Queues one call: its scratch (and, with a caller's context, that context) lent for the call; a
// forward or recompute gives `filled` the key of what it computed the context from. A forward given no
// context on a workspace that keeps none is lent what it uses of one (ContextLoan).
template <class Pass>
void run(Workspace::Impl& w, const ForwardContext* ctx, ForwardContext* filled, cudaStream_t stream, Pass&& pass) {
  api::enqueue_call(w, stream, [&] {
    const ScratchLease scratch(w, stream);
    if (ctx == nullptr && w.config.caller_context) {
      const ContextLoan loan(w, stream);
      return pass();
    }
    if (ctx == nullptr) return pass();
    const ContextLease lease(w, *ctx);
    pass();
    if (filled) lease.keep(*filled);
  });
}

void forward_call(Workspace& ws, const LayerInputs& in, const TensorView& y, ForwardContext* ctx,
                  cudaStream_t stream) {
  Workspace::Impl& w = ws.impl();
  validate_inputs(w.shape, in);
  validate_output(w.shape, y);
  api::check_forward_aliasing(in, y);
  check_device(w);
  require_not_captured(w, stream);
  require_connected(w);
  // NOTES: without one, a caller_context workspace's forward keeps no context (ContextLoan).
  if (ctx) require_context_form(w, true);
  require_quantized_weights(w, in, Fp8Copies::kForward);
  if (ctx) {
    validate_context(w, *ctx);
    api::check_context_written(in, y, used_bytes(w, *ctx));
    ctx->valid = false;  // until this call has queued its work
  }
  run(w, ctx, ctx, stream, [&] {
    if (w.config.backend == Backend::kFused) {
      for (fused::Step step : fused::kSteps) api::forward_step(w, in, y, stream, step);
    } else {
      baseline::forward(w, in, y, stream);
    }
  });
  ++w.forward_calls;
}

void recompute_call(Workspace& ws, const LayerInputs& in, ForwardContext* ctx, cudaStream_t stream) {
  Workspace::Impl& w = ws.impl();
  validate_inputs(w.shape, in);
  check_device(w);
  require_not_captured(w, stream);
  require_connected(w);
  require_context_form(w, ctx != nullptr);
  require_quantized_weights(w, in, Fp8Copies::kForward);
  if (ctx) {
    validate_context(w, *ctx);
    api::check_context_written(in, TensorView{}, used_bytes(w, *ctx));
    ctx->valid = false;
  }
  run(w, ctx, ctx, stream, [&] {
    if (w.config.backend == Backend::kFused) {
      for (fused::Step step : fused::kSteps) api::recompute_step(w, in, stream, step);
    } else {
      baseline::recompute_forward_context(w, in, stream);
    }
  });
}

void backward_call(Workspace& ws, const LayerInputs& in, const TensorView& dy, const Gradients& grads,
                   const ForwardContext* ctx, cudaStream_t stream) {
  Workspace::Impl& w = ws.impl();
  validate_inputs(w.shape, in);
  validate_gradients(w.shape, dy, grads);
  api::check_backward_aliasing(in, dy, grads);
  require_quantized_weights(w, in, Fp8Copies::kBackward);  // the FP8 dgrads read the transposed copies
  check_device(w);
  require_not_captured(w, stream);
  require_connected(w);
  require_context_form(w, ctx != nullptr);
  if (ctx) {
    validate_context(w, *ctx);
    api::check_context_read(grads, used_bytes(w, *ctx));
    if (!ctx->valid) {
      throw Error("ctx", "holds no forward context: fill it with forward or recompute_forward_context first");
    }
    if (ctx->layout != w.context_layout) {
      throw Error("ctx", "was filled by a workspace of another layout (shape, capacity, backend or precision; "
                         "Workspace::context_layout): a backward reads a context of its own workspace's layout");
    }
    if (!(context_key(*ctx) == ContextKey::of(in))) {
      throw Error("ctx", "was filled from other x / topk_ids / topk_weights / gate / up tensors");
    }
  }
  run(w, ctx, nullptr, stream, [&] {
    if (w.config.backend == Backend::kFused) {
      for (fused::Step step : fused::kSteps) api::backward_step(w, in, dy, grads, stream, step);
    } else {
      baseline::backward(w, in, dy, grads, stream);
    }
  });
  ++w.backward_calls;
}

}  // namespace

void quantize_weights(Workspace& ws, const ExpertWeights& weights, cudaStream_t stream, Fp8Copies copies) {
  Workspace::Impl& w = ws.impl();
  api::require_fp8(w, "quantize_weights");
  if (copies != Fp8Copies::kBoth && copies != Fp8Copies::kForward && copies != Fp8Copies::kBackward) {
    throw Error("copies", "must be Fp8Copies::kBoth, kForward or kBackward, got " + std::to_string(int(copies)));
  }
  validate_weights(w.shape, weights);
  check_device(w);
  api::enqueue_call(w, stream, [&] { fp8pass::quantize_weights(w, weights, copies, stream); });
}

void set_quantized_weights(Workspace& ws, const Fp8ExpertWeights& weights, cudaStream_t stream) {
  Workspace::Impl& w = ws.impl();
  api::require_fp8(w, "set_quantized_weights");
  validate_fp8_weights(w.shape, weights);
  check_device(w);
  api::enqueue_call(w, stream, [&] { fp8pass::set_quantized_weights(w, weights, stream); });
}

namespace {

// Whether a workspace of shape `sb` (on `a`'s device: each caller checks that) may read `a`'s FP8
// weight copies (`a` is FP8); the errors name the arguments `from` and `to` as the caller calls them.
void check_copies_fit(const Workspace::Impl& a, const LayerShape& sb, const std::string& from, const std::string& to) {
  const LayerShape& sa = a.shape;
  if (sa.num_ranks != 1 || sb.num_ranks != 1) {
    throw Error(sa.num_ranks != 1 ? from : to,
                "is a rank of an expert-parallel group: each rank keeps its own experts' copies");
  }
  if (sa.hidden != sb.hidden || sa.intermediate != sb.intermediate || sa.local_experts() != sb.local_experts()) {
    throw Error(to, "holds experts of hidden " + std::to_string(sb.hidden) + ", intermediate " +
                        std::to_string(sb.intermediate) + " and " + std::to_string(sb.local_experts()) +
                        " local experts, `" + from + "` of " + std::to_string(sa.hidden) + ", " +
                        std::to_string(sa.intermediate) + " and " + std::to_string(sa.local_experts()) +
                        ": their weight copies differ");
  }
}

}  // namespace

void share_quantized_weights(Workspace& from, Workspace& to) {
  Workspace::Impl& a = from.impl();
  Workspace::Impl& b = to.impl();
  api::require_fp8(a, "share_quantized_weights", "from");
  api::require_fp8(b, "share_quantized_weights", "to");
  if (a.device != b.device) {
    throw Error("to", "is on device " + std::to_string(b.device) + ", `from` on device " + std::to_string(a.device) +
                          ": weight copies are shared on one device");
  }
  check_copies_fit(a, b.shape, "from", "to");
  // NOTES: another workspace reading `to`'s copies would keep them when `to` moves on, and no later
  // quantize_weights through `from` or `to` would update them: it would run on stale copies without a
  // word (their record of what they were made from unchanged). Refused instead.
  if (b.fp8_store != a.fp8_store && b.fp8_store.use_count() > 1) {
    throw Error("to", "holds weight copies that " + std::to_string(b.fp8_store.use_count() - 1) +
                          " other workspace(s) also read and would keep reading: share `from`'s copies with "
                          "those first");
  }
  const detail::CurrentDevice on(b.device);
  b.use_fp8_store(a.fp8_store);
}

Workspace::Workspace(const LayerShape& shape, const Config& config, Workspace& fp8_weights_of) {
  validate_shape(shape);
  Workspace::Impl& a = fp8_weights_of.impl();
  if (!a.fp8_store) throw Error("fp8_weights_of", "is a bf16 workspace: it holds no FP8 weight copies");
  if (config.precision != Precision::kFp8Block) {
    throw Error("config.precision", "must be kFp8Block to read the FP8 weight copies of `fp8_weights_of`");
  }
  int device = 0;
  LYNX_CUDA(cudaGetDevice(&device));
  if (a.device != device) {
    throw Error("fp8_weights_of", "is on device " + std::to_string(a.device) + ", the current device is " +
                                      std::to_string(device) + ": weight copies are shared on one device");
  }
  check_copies_fit(a, shape, "fp8_weights_of", "shape");
  impl_ = std::make_unique<Impl>(shape, config, a.fp8_store);
}

void forward(Workspace& ws, const LayerInputs& in, const TensorView& y, cudaStream_t stream) {
  forward_call(ws, in, y, nullptr, stream);
}
void forward(Workspace& ws, const LayerInputs& in, const TensorView& y, ForwardContext& ctx, cudaStream_t stream) {
  forward_call(ws, in, y, &ctx, stream);
}

void recompute_forward_context(Workspace& ws, const LayerInputs& in, cudaStream_t stream) {
  recompute_call(ws, in, nullptr, stream);
}
void recompute_forward_context(Workspace& ws, const LayerInputs& in, ForwardContext& ctx, cudaStream_t stream) {
  recompute_call(ws, in, &ctx, stream);
}

void backward(Workspace& ws, const LayerInputs& in, const TensorView& dy, const Gradients& grads, cudaStream_t stream) {
  backward_call(ws, in, dy, grads, nullptr, stream);
}
void backward(Workspace& ws, const LayerInputs& in, const TensorView& dy, const Gradients& grads,
              const ForwardContext& ctx, cudaStream_t stream) {
  backward_call(ws, in, dy, grads, &ctx, stream);
}

}  // namespace lynx
