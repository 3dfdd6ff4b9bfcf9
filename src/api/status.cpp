#include <cstring>
#include <string>

#include "api/routing_check.h"

namespace lynx {

std::string describe_status(const DeviceStatus& st, int64_t top_k) {
  const auto code = static_cast<StatusCode>(st.code);
  std::string at = "[";
  at += std::to_string(st.a / top_k);
  at += ", ";
  at += std::to_string(st.a % top_k);
  at += "]";
  const std::string on_rank = " (rank " + std::to_string(st.rank) + ")";
  switch (code) {
    case StatusCode::kOk:
      return {};
    case StatusCode::kCapacityOverflow:
      return "the routing needs " + std::to_string(st.a) + " schedule rows but config.schedule_capacity is " +
             std::to_string(st.b) + on_rank + "; raise it (0 = worst case)";
    case StatusCode::kExpertOutOfRange:
      return "topk_ids" + at + " = " + std::to_string(st.b) + " is out of range [0, " + std::to_string(st.c) + ")" +
             on_rank;
    case StatusCode::kNonFiniteWeight: {
      const uint32_t bits = static_cast<uint32_t>(st.b);
      float w;
      std::memcpy(&w, &bits, sizeof w);
      return "topk_weights" + at + " = " + std::to_string(w) + " is not finite" + on_rank;
    }
    case StatusCode::kWaitTimeout:
      return "a device wait timed out: wait " + std::to_string(st.a) + ", task " + std::to_string(st.b) +
             ", counter value " + std::to_string(st.c) + on_rank;
  }
  return "unknown device status code " + std::to_string(st.code) + on_rank;
}

}  // namespace lynx
