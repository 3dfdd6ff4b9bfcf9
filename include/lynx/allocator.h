// lynx: where a workspace takes the device memory it needs only while a call runs.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

namespace lynx {

// A workspace made with Config::scratch_allocator keeps only what lives from one call to the next (the
// forward context unless the caller holds it, the schedule, the status word; at R > 1 the shared region
// the other ranks read, ranks.h) and takes its scratch, the per-row intermediates of
// a pass (Workspace::scratch_bytes()), from the allocator at every call: allocate(bytes, stream) once
// before the call queues its first kernel on `stream`, deallocate(p, bytes, stream) once after it
// queued its last (a forward keeping no context on a Config::caller_context workspace takes a second
// block, what it uses of a context, after the first and gives it back before). The allocator must be
// stream-ordered: memory given back on `stream` may go to other work only once `stream` has run the
// call's kernels, or to later work on `stream` itself (cudaMallocAsync / cudaFreeAsync, PyTorch's caching
// allocator). Layers that run one after another on a stream then share one scratch, and the memory held
// between calls is the context alone (at one rank).
// allocate returns 256-byte-aligned memory, or throws (a null return or a misaligned block is reported
// as an error); deallocate does not throw. Under CUDA graph capture a call takes and gives back its
// block once, while it is captured, and every replay uses that block: the allocator must keep it for
// the graph alone for the graph's life (cudaMallocAsync's graph memory nodes, a caching allocator's
// private pool for the capture, as PyTorch's graph capture uses). Where several ranks of a group share one
// allocator, each with its calls on a stream of its own (virtual ranks), it must not hand a rank memory
// another rank's stream gave back by making the first stream wait for the other's queued work: the
// ranks' passes wait for one another inside their kernels, so that wait would hold the ranks until
// their barriers' time limit. cudaMallocAsync's default pool may do so
// (cudaMemPoolReuseAllowInternalDependencies: turn it off in a pool of its own); PyTorch's caching
// allocator reuses a block only on the stream that gave it back. A workspace with a shared expert also
// takes one block while it is made (on the legacy default stream, given back before the constructor
// returns): the shared expert's products run once on it, so that cuBLAS loads their kernels then
// rather than inside a pass (src/common/kernel_loading.h says why). Its bytes: x's [T, H] and one
// shared-expert weight's [I_s, H] in bf16, and the shared expert's intermediates the workspace lends
// (hs, dhs, dgs, dus [T, I_s] bf16, ys [T, H] fp32; gs and us [T, I_s] too with
// Config::caller_context), each rounded up to 1 KB.
class ScratchAllocator {
 public:
  virtual ~ScratchAllocator() = default;
  virtual void* allocate(size_t bytes, cudaStream_t stream) = 0;
  virtual void deallocate(void* p, size_t bytes, cudaStream_t stream) = 0;
};

}  // namespace lynx
