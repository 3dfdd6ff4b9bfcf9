// The routing's first step at R > 1: this rank's ids and weights checked and copied into its shared
// region, where the other ranks' schedule builds and backward passes read them after the pass's
// opening barrier (at R = 1 the schedule kernel checks the ids as it reads them instead).
#include <algorithm>
#include <climits>

#include "common/cuda_check.h"
#include "common/kernel_loading.h"
#include "device/last_block.cuh"
#include "kernels/schedule/api.h"
#include "kernels/schedule/routing_check.h"

namespace lynx::sched {
namespace {

template <class Id>
__global__ void stage_routing_kernel(const Id* __restrict__ ids, const float* __restrict__ weights,
                                     int32_t* __restrict__ ids32, float* __restrict__ weights_copy, int64_t entries,
                                     int64_t num_experts, int32_t rank, DeviceStatus* status) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < entries; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t id = static_cast<int64_t>(ids[i]);
    const float w = weights[i];
    if (check_route(id, __float_as_uint(w), num_experts) != StatusCode::kOk) {
      atomicMin(&status->first_bad_route, static_cast<unsigned long long>(i));
    }
    ids32[i] = (id >= 0 && id < num_experts) ? static_cast<int32_t>(id) : -1;
    weights_copy[i] = w;
  }
  if (!last_block_to_arrive(&status->counted_blocks) || threadIdx.x != 0) return;
  const unsigned long long i = status->first_bad_route;
  if (i != ULLONG_MAX) {
    report_route(status, static_cast<int64_t>(i), static_cast<int64_t>(ids[i]), __float_as_uint(weights[i]),
                 num_experts, rank);
  }
  status->first_bad_route = ULLONG_MAX;
}

}  // namespace

void stage_routing(const OwnRouting& own, float* weights_copy, int64_t entries, int64_t num_experts, int32_t rank,
                   DeviceStatus* status, cudaStream_t stream) {
  const int grid = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((entries + 255) / 256, 1024)));
  if (own.ids_int64) {
    stage_routing_kernel<<<grid, 256, 0, stream>>>(static_cast<const int64_t*>(own.topk_ids), own.topk_weights,
                                                   own.ids32, weights_copy, entries, num_experts, rank, status);
  } else {
    stage_routing_kernel<<<grid, 256, 0, stream>>>(static_cast<const int32_t*>(own.topk_ids), own.topk_weights,
                                                   own.ids32, weights_copy, entries, num_experts, rank, status);
  }
  LYNX_CHECK_LAUNCH();
}

void load_stage_routing_kernels() { load_module_of(reinterpret_cast<const void*>(&stage_routing_kernel<int32_t>)); }

}  // namespace lynx::sched
