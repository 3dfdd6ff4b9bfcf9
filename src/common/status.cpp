#include <cstring>
#include <string>

#include "common/status.h"

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
    case StatusCode::kWaitTimeout: {
      const char* wait = st.a == 1   ? "full stage (consumer waiting for the producer's TMA loads)"
                         : st.a == 2 ? "empty stage (producer waiting for the consumers to free a stage)"
                         : st.a == 3 ? "unit posted (cluster rank 1 waiting for rank 0's next claimed unit)"
                         : st.a == 4 ? "unit taken (cluster rank 0 waiting for rank 1 to take a claimed unit)"
                         : st.a == 5 ? "rows gathered (producer waiting for the gather warps to copy its tile's rows)"
                         : st.a == 6 ? "consumers done (producer waiting for its consumers to finish their last tile)"
                         : st.a == 7 ? "schedule blocks (a schedule builder block waiting for the others at a grid barrier)"
                         : st.a == 8 ? "peer arrival (waiting at a cross-rank barrier for another rank, which never came)"
                                     : "unknown";
      const bool unit = st.a == 3 || st.a == 4;  // the mailbox waits name cluster units, not tiles
      if (st.a == 8) {
        return "a device wait timed out: wait 8 = " + std::string(wait) + ", rank " + std::to_string(st.b) +
               " had not arrived (" + std::to_string(-st.c) +
               " barrier(s) behind); the kernel trapped and the CUDA context is lost";
      }
      const std::string task = st.a == 7    ? "barrier " + std::to_string(st.b)
                               : st.b >= 0  ? (unit ? "unit " : "task ") + std::to_string(st.b)
                               : st.b == -1 ? std::string(unit ? "the next unit (not yet known)" : "the next task (not yet known)")
                               : st.b == -3 ? std::string("a padding tile (cluster rank 1 after an odd tile count)")
                                            : std::string("past the last task");
      return "a device wait timed out in block " + std::to_string(st.rank) + ": wait " + std::to_string(st.a) + " = " +
             wait + ", " + task + ", phase/counter " + std::to_string(st.c) +
             "; the kernel trapped and the CUDA context is lost";
    }
    case StatusCode::kNonFiniteInput: {
      static const char* const names[] = {"x", "the SwiGLU output h (from finite x: an overflow, or weights "
                                          "reported not finite earlier)",
                                          "weights.w_gate", "weights.w_up", "weights.w_down", "dy",
                                          "the SwiGLU backward's dg | du (of finite inputs: an overflow, or weights "
                                          "reported not finite earlier)"};
      const bool known = st.a >= 0 && st.a < int64_t(sizeof(names) / sizeof(names[0]));
      return std::string(known ? names[st.a] : "an input") +
             " holds a NaN or an infinity, which the FP8 path cannot quantise" + on_rank;
    }
    case StatusCode::kPeerFailed:
      return "rank " + std::to_string(st.a) + " reported an error in this pass (" +
             (st.b == int64_t(StatusCode::kCapacityOverflow) ? std::string("schedule capacity")
              : st.b == int64_t(StatusCode::kWaitTimeout)    ? std::string("a device wait timed out")
              : st.b == int64_t(StatusCode::kNonFiniteInput) ? std::string("a NaN or an infinity in an FP8 operand")
                                                             : std::string("a bad route")) +
             "; its own check() says which), so rank " + std::to_string(st.rank) + " wrote no outputs";
  }
  return "unknown device status code " + std::to_string(st.code) + on_rank;
}

}  // namespace lynx
