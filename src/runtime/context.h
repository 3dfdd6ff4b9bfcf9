// A call's forward context, when the caller holds it (Config::caller_context, lynx::ForwardContext):
// the workspace's context buffers point into the caller's block for the call, and the context's host
// key (what it was computed from) stands in for the workspace's own. A forward given no ForwardContext
// keeps none: it is lent the start of a block for the call (ContextLoan).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/cuda_check.h"
#include "lynx/moe.h"
#include "runtime/scratch.h"
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

// A forward that keeps no context, on a Config::caller_context workspace: the buffers it writes and reads
// of a context (the schedule, the shared expert's products, the gathered rows the bf16 GEMM reads at
// R > 1: Impl::context_forward_only_bytes, the block's start) point into a block taken on `stream` from
// config.scratch_allocator (without one, from the workspace's context_pool) and given back on it after the
// call's work; g and u are null for the call, and the workspace holds no context afterwards.
class ContextLoan {
 public:
  ContextLoan(Workspace::Impl& w, cudaStream_t stream) : w_(w), stream_(stream), bytes_(w.context_forward_only_bytes) {
    if (ScratchAllocator* a = w.config.scratch_allocator) {
      block_ = allocate_block(*a, bytes_, stream);
    } else {
      void* p = nullptr;
      LYNX_CUDA(cudaMallocFromPoolAsync(&p, size_t(bytes_), w.context_pool, stream));
      block_ = static_cast<char*>(p);
    }
    w.context_block.bind(block_, bytes_);
    w.keeping_no_context = true;
    w.context_valid = false;
    w.counts_on_host = false;  // as in ContextLease
  }
  ~ContextLoan() {
    w_.context_block.unbind();
    w_.keeping_no_context = false;
    w_.context_valid = false;
    w_.counts_on_host = false;
    if (ScratchAllocator* a = w_.config.scratch_allocator) {
      deallocate_block(*a, block_, bytes_, stream_);
    } else if (cudaFreeAsync(block_, stream_) != cudaSuccess) {
      (void)cudaGetLastError();  // NOTES: a destructor; the error being raised, if any, is the one to report
    }
  }
  ContextLoan(const ContextLoan&) = delete;
  ContextLoan& operator=(const ContextLoan&) = delete;

 private:
  Workspace::Impl& w_;
  cudaStream_t stream_;
  int64_t bytes_;
  char* block_ = nullptr;
};

}  // namespace lynx
