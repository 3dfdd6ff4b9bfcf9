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

// A block of `bytes` from `a`, taken on `stream`: 256-byte aligned, else lynx::Error naming
// config.scratch_allocator (a misaligned block is given back first).
inline char* allocate_block(ScratchAllocator& a, int64_t bytes, cudaStream_t stream) {
  char* block = static_cast<char*>(a.allocate(size_t(bytes), stream));
  if (block == nullptr) {
    throw Error("config.scratch_allocator", "allocate(" + std::to_string(bytes) + " bytes) returned no memory");
  }
  if (reinterpret_cast<uintptr_t>(block) % 256 != 0) {
    a.deallocate(block, size_t(bytes), stream);
    throw Error("config.scratch_allocator", "allocate returned memory that is not 256-byte aligned");
  }
  return block;
}

// Gives a block of allocate_block back on `stream`. NOTES: a deallocate that throws is not reported
// (lynx/allocator.h asks that it not throw): the callers are a destructor and an error path, where the
// error already being raised is the one to report.
inline void deallocate_block(ScratchAllocator& a, char* block, int64_t bytes, cudaStream_t stream) noexcept {
  try {
    a.deallocate(block, size_t(bytes), stream);
  } catch (...) {
  }
}

class ScratchLease {
 public:
  // Points every scratch buffer of `w` into a block taken on `stream` (nothing without an allocator).
  ScratchLease(Workspace::Impl& w, cudaStream_t stream) : w_(w), stream_(stream) {
    ScratchAllocator* a = w.config.scratch_allocator;
    const int64_t bytes = w.scratch_block.bytes;
    if (a == nullptr || bytes == 0) return;
    block_ = allocate_block(*a, bytes, stream);
    w.scratch_block.bind(block_);
  }
  // Gives the block back on the stream, after everything the call queued; the buffers are null again.
  ~ScratchLease() {
    if (block_ == nullptr) return;
    w_.scratch_block.unbind();
    deallocate_block(*w_.config.scratch_allocator, block_, w_.scratch_block.bytes, stream_);
  }
  ScratchLease(const ScratchLease&) = delete;
  ScratchLease& operator=(const ScratchLease&) = delete;

 private:
  Workspace::Impl& w_;
  cudaStream_t stream_;
  char* block_ = nullptr;
};

}  // namespace lynx
