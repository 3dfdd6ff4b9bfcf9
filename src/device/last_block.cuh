// "The last block to finish does the rest": a grid-wide arrival counter for kernels whose final step
// needs every block's results (the routing validation's report, the schedule's per-expert offsets).
#pragma once

#include <cstdint>

namespace lynx {

// Called by every thread of every block (1-D blocks: thread 0 arrives for its block), once, after the
// block's last global write that the final step reads. Returns true in every thread of the grid's
// last block to arrive; those threads then see the writes of every block made before its arrival.
// The last block sets `*arrived` back to zero, so the counter is at rest for the next launch on the
// stream. `Counter`: int32_t or uint32_t.
// NOTES: one fence by thread 0 after the barrier publishes the whole block's writes (a release is
// cumulative over what the barrier ordered before it), as in a cooperative grid sync; the first
// versions fenced in every thread.
template <class Counter>
__device__ __forceinline__ bool last_block_to_arrive(Counter* arrived) {
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();  // the block's writes before its arrival
    const Counter blocks = Counter(gridDim.x * gridDim.y * gridDim.z);
    last = atomicAdd(arrived, Counter(1)) == blocks - 1;
    if (last) {
      *arrived = 0;
      __threadfence();  // every block's writes before this block reads them
    }
  }
  __syncthreads();
  return last;
}

}  // namespace lynx
