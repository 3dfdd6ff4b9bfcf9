// A kernel that keeps the GPU busy for a while, to see whether host calls queued behind it wait for it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace lynx::test {

// Queues one thread on `stream` that spins for `ns` nanoseconds of %globaltimer.
void spin_on_stream(cudaStream_t stream, uint64_t ns);

}  // namespace lynx::test
