// A stream-ordered scratch allocator for the tests (cudaMallocFromPoolAsync / cudaFreeAsync): every block
// is poisoned when handed out (0xFF bytes: NaN in bf16 and fp32, -1 in int32), so that a read of scratch
// no kernel wrote cannot pass; it counts what it lends.
// NOTES: outside a graph capture, from a pool of its own that never reuses a block freed on another stream by making the
// allocating stream wait for that stream's work (cudaMemPoolReuseAllowInternalDependencies off, which
// the device's default pool allows): virtual ranks' calls run on a stream each and wait for one another
// inside their kernels, so such a wait would hold a rank back until the others' barriers time out
// (include/lynx/allocator.h).
#pragma once

#include <cstddef>

#include "gpu/gpu_test.h"
#include "lynx/allocator.h"

namespace lynx::test {

class PoisoningAllocator final : public ScratchAllocator {
 public:
  PoisoningAllocator() {
    int device = 0;
    LYNX_TEST_CUDA(cudaGetDevice(&device));
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device;
    LYNX_TEST_CUDA(cudaMemPoolCreate(&pool_, &props));
    int off = 0;
    LYNX_TEST_CUDA(cudaMemPoolSetAttribute(pool_, cudaMemPoolReuseAllowInternalDependencies, &off));
  }
  ~PoisoningAllocator() override {
    cudaDeviceSynchronize();  // every block's free has run
    cudaMemPoolDestroy(pool_);
  }
  PoisoningAllocator(const PoisoningAllocator&) = delete;
  PoisoningAllocator& operator=(const PoisoningAllocator&) = delete;

  void* allocate(size_t bytes, cudaStream_t stream) override {
    void* p = nullptr;
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    LYNX_TEST_CUDA(cudaStreamIsCapturing(stream, &capture));
    if (capture == cudaStreamCaptureStatusNone) {
      LYNX_TEST_CUDA(cudaMallocFromPoolAsync(&p, bytes, pool_, stream));
    } else {  // a graph memory node, from the graph's own pool
      LYNX_TEST_CUDA(cudaMallocAsync(&p, bytes, stream));
    }
    LYNX_TEST_CUDA(cudaMemsetAsync(p, 0xFF, bytes, stream));
    ++allocations;
    ++outstanding;
    last_bytes = bytes;
    return p;
  }
  void deallocate(void* p, size_t, cudaStream_t stream) override {
    cudaFreeAsync(p, stream);
    --outstanding;
  }
  int allocations = 0;
  int outstanding = 0;
  size_t last_bytes = 0;

 private:
  cudaMemPool_t pool_ = nullptr;
};

}  // namespace lynx::test
