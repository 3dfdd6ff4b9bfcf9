// The experiments build's stage omission (runtime/stages.h): the stages LYNX_OMIT names.
#include "runtime/stages.h"

#include <cstdlib>

#include "lynx/error.h"

namespace lynx {
namespace {

constexpr const char* kNames[] = {"gather",     "shared",     "gate_up",    "down",          "combine",
                                  "dy_gather",  "dgrad_down", "swiglu_bwd", "dgrad_gate_up", "dx_combine",
                                  "x_gather",   "wgrad_gate_up", "wgrad_down", "shared_bwd"};
static_assert(sizeof(kNames) / sizeof(kNames[0]) == size_t(Stage::kCount), "a name per stage");

}  // namespace

const char* stage_name(Stage s) { return kNames[uint32_t(s)]; }

uint32_t parse_omitted_stages(const std::string& list) {
  uint32_t bits = 0;
  if (list.empty()) return bits;
  size_t at = 0;
  for (;;) {
    size_t end = list.find(',', at);
    if (end == std::string::npos) end = list.size();
    const std::string name = list.substr(at, end - at);
    uint32_t i = 0;
    while (i < uint32_t(Stage::kCount) && name != kNames[i]) ++i;
    if (i == uint32_t(Stage::kCount)) {
      std::string known;
      for (const char* n : kNames) known += std::string(known.empty() ? "" : ", ") + n;
      throw Error("LYNX_OMIT", "unknown stage '" + name + "' (stages: " + known + ")");
    }
    bits |= 1u << i;
    if (end == list.size()) return bits;
    at = end + 1;
  }
}

bool omitted(Stage s, int64_t calls_before) {
  static const uint32_t bits = [] {
    const char* v = std::getenv("LYNX_OMIT");
    return v ? parse_omitted_stages(v) : 0u;
  }();
  return calls_before > 0 && ((bits >> uint32_t(s)) & 1u);
}

}  // namespace lynx
