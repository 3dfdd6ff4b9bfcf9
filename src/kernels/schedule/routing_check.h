// The per-entry routing check, shared by the device validation kernel and the host tests.
#pragma once

#include <cstdint>

#include "common/hd.h"
#include "common/status.h"

namespace lynx {

LYNX_HD bool is_finite_bits(uint32_t bits) { return (bits & 0x7f800000u) != 0x7f800000u; }

LYNX_HD StatusCode check_route(int64_t expert_id, uint32_t weight_bits, int64_t num_experts) {
  if (expert_id < 0 || expert_id >= num_experts) return StatusCode::kExpertOutOfRange;
  if (!is_finite_bits(weight_bits)) return StatusCode::kNonFiniteWeight;
  return StatusCode::kOk;
}

}  // namespace lynx
