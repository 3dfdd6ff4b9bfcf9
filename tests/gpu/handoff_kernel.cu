#include "gpu/handoff_kernel.h"

#include <cuda_runtime_api.h>

#include "device/sm90.cuh"
#include "gpu/gpu_test.h"

namespace lynx::test {
namespace {

constexpr int kStages = 4;
constexpr int32_t kDone = -2;
constexpr int32_t kNoTile = -1;

__device__ int32_t tile_stages(int32_t id) { return id == kDone ? 1 : 1 + id % 3; }

__global__ void __launch_bounds__(384, 1) tile_handoff_kernel(int32_t tiles, int32_t* seen) {
    __shared__ uint64_t full[kStages], empty[kStages];
  __shared__ int32_t stage_tile[kStages];
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      sm90::mbarrier_init(&full[s], 1);
      sm90::mbarrier_init(&empty[s], 256);
      stage_tile[s] = kNoTile;
    }
    sm90::fence_barrier_init();
  }
  __syncthreads();
  int stage = 0;
  uint32_t phase = 0;
  if (threadIdx.x < 128) {
    // ---- producer: thread 0 writes the tile id of each tile's first stage, then arrives ----
    if (threadIdx.x != 0) return;
    for (int32_t tile = 0;; ++tile) {
      const int32_t id = tile < tiles ? tile : kDone;
      for (int32_t kb = 0; kb < tile_stages(id); ++kb) {
        sm90::mbarrier_wait(&empty[stage], phase ^ 1, nullptr, sm90::Wait::kEmptyStage, id);
        stage_tile[stage] = kb == 0 ? id : kNoTile;
        sm90::mbarrier_arrive(&full[stage]);
        if (++stage == kStages) stage = 0, phase ^= 1;
      }
      if (id == kDone) return;
    }
  }
  // ---- consumers: every thread reads each tile id from its first stage, as the GEMM's consumers ----
  int32_t* mine = seen + int64_t(threadIdx.x - 128) * (tiles + 1);
  for (int32_t n = 0;; ++n) {
    sm90::mbarrier_wait(&full[stage], phase, nullptr, sm90::Wait::kFullStage, kNoTile);
    const int32_t id = stage_tile[stage];
    mine[n] = id;
    if (id == kDone) return;
    // A stage is released one stage late, as the GEMM releases it after the next wgmma group.
    int prev = -1;
    for (int32_t kb = 0; kb < tile_stages(id); ++kb) {
      if (kb > 0) sm90::mbarrier_wait(&full[stage], phase, nullptr, sm90::Wait::kFullStage, id);
      if (prev >= 0) sm90::mbarrier_arrive(&empty[prev]);
      prev = stage;
      if (++stage == kStages) stage = 0, phase ^= 1;
    }
    sm90::mbarrier_arrive(&empty[prev]);
  }
}

}  // namespace

std::vector<int32_t> run_tile_handoff(int32_t tiles) {
  DeviceBuffer seen(size_t(256) * (tiles + 1) * sizeof(int32_t));
  seen.fill_bytes(0x7F);
  tile_handoff_kernel<<<1, 384>>>(tiles, seen.as<int32_t>());
  LYNX_TEST_CUDA(cudaGetLastError());
  LYNX_TEST_CUDA(cudaDeviceSynchronize());
  return to_host<int32_t>(seen, size_t(256) * (tiles + 1));
}

}  // namespace lynx::test
