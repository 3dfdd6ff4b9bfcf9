// The per-entry routing check, shared by the device validation kernel and the host tests.
#pragma once

#include <cstdint>

#include "common/hd.h"
#include "common/status.h"

namespace lynx {

LYNX_HD bool is_finite_bits(uint32_t bits) { return (bits & 0x7f800000u) != 0x7f800000u; }

// The id of a slot that is not routed: no expert computes it, its router weight is not read, and its
// d_topk_weights is 0 (include/lynx/moe.h, LayerInputs::topk_ids).
constexpr int64_t kNotRouted = -1;

LYNX_HD StatusCode check_route(int64_t expert_id, uint32_t weight_bits, int64_t num_experts) {
  if (expert_id == kNotRouted) return StatusCode::kOk;
  if (expert_id < 0 || expert_id >= num_experts) return StatusCode::kExpertOutOfRange;
  if (!is_finite_bits(weight_bits)) return StatusCode::kNonFiniteWeight;
  return StatusCode::kOk;
}

#ifdef __CUDACC__
// Sets `status` to the routing error of entry `index` (id, weight bits) unless an error is set already.
__device__ __forceinline__ void report_route(DeviceStatus* status, int64_t index, int64_t id, uint32_t weight_bits,
                                             int64_t num_experts, int32_t rank) {
  const StatusCode code = check_route(id, weight_bits, num_experts);
  if (atomicCAS(&status->code, int32_t(StatusCode::kOk), int32_t(code)) == int32_t(StatusCode::kOk)) {
    status->rank = rank;
    status->a = index;
    status->b = code == StatusCode::kExpertOutOfRange ? id : int64_t(weight_bits);
    status->c = num_experts;
  }
}
#endif

}  // namespace lynx
