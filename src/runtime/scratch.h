// A call's scratch, when the workspace takes it from Config::scratch_allocator (lynx/allocator.h): one
// block for the call's whole queue of work, given back on the call's stream when the call has queued it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "lynx/allocator.h"
#include "lynx/error.h"
#include "runtime/workspace.h"

namespace lynx {

class ScratchLease {
 public:
  // Points every scratch buffer of `w` into a block taken on `stream` (nothing without an allocator).
  ScratchLease(Workspace::Impl& w, cudaStream_t stream) : w_(w), stream_(stream) {
    ScratchAllocator* a = w.config.scratch_allocator;
    const int64_t bytes = w.scratch_block.bytes;
    if (a == nullptr || bytes == 0) return;
    block_ = static_cast<char*>(a->allocate(size_t(bytes), stream));
    if (block_ == nullptr) {
      throw Error("config.scratch_allocator", "allocate(" + std::to_string(bytes) + " bytes) returned no memory");
    }
    if (reinterpret_cast<uintptr_t>(block_) % 256 != 0) {
      char* misaligned = block_;
      block_ = nullptr;
      a->deallocate(misaligned, size_t(bytes), stream);
      throw Error("config.scratch_allocator", "allocate returned memory that is not 256-byte aligned");
    }
    w.scratch_block.bind(block_);
  }
  // Gives the block back on the stream, after everything the call queued; the buffers are null again.
  // NOTES: a destructor cannot report: an allocator whose deallocate throws loses that error here
  // (lynx/allocator.h asks that it not throw).
  ~ScratchLease() {
    if (block_ == nullptr) return;
    w_.scratch_block.unbind();
    try {
      w_.config.scratch_allocator->deallocate(block_, size_t(w_.scratch_block.bytes), stream_);
    } catch (...) {
    }
  }
  ScratchLease(const ScratchLease&) = delete;
  ScratchLease& operator=(const ScratchLease&) = delete;

 private:
  Workspace::Impl& w_;
  cudaStream_t stream_;
  char* block_ = nullptr;
};

}  // namespace lynx
