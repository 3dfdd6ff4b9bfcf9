// A call's forward context, when the caller holds it (Config::caller_context, lynx::ForwardContext):
// the workspace's context buffers point into the caller's block for the call, and the context's host
// key (what it was computed from) stands in for the workspace's own.
#pragma once

#include "lynx/moe.h"
#include "runtime/workspace.h"

namespace lynx {

// What `ctx` was computed from, as the workspace keys its own context.
inline ContextKey context_key(const ForwardContext& ctx) {
  return {ctx.inputs[0], ctx.inputs[1], ctx.inputs[2], ctx.inputs[3], ctx.inputs[4], ctx.inputs[5], ctx.inputs[6]};
}

class ContextLease {
 public:
  ContextLease(Workspace::Impl& w, const ForwardContext& ctx) : w_(w) {
    w.context_block.bind(static_cast<char*>(ctx.data));
    w.context_valid = ctx.valid;
    w.context = context_key(ctx);
    // NOTES: the host copy of the schedule's counts (the unfused path) belongs to whichever context
    // was computed last; this call's may be another.
    w.counts_on_host = false;
  }
  // Gives `ctx` what the call left in the workspace: the key of the inputs it was computed from.
  void keep(ForwardContext& ctx) const {
    const void* const key[7] = {w_.context.x,     w_.context.topk_ids, w_.context.topk_weights, w_.context.w_gate,
                                w_.context.w_up,  w_.context.ws_gate,  w_.context.ws_up};
    for (int i = 0; i < 7; ++i) ctx.inputs[i] = key[i];
    ctx.valid = w_.context_valid;
    ctx.layout = w_.context_layout;
  }
  ~ContextLease() {
    w_.context_block.unbind();
    w_.context_valid = false;
    w_.counts_on_host = false;
  }
  ContextLease(const ContextLease&) = delete;
  ContextLease& operator=(const ContextLease&) = delete;

 private:
  Workspace::Impl& w_;
};

}  // namespace lynx
