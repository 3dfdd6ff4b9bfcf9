// The experiments build's tuning overrides from the environment (plan/overrides.h).
#include <cstdlib>
#include <initializer_list>
#include <string>

#include "lynx/error.h"
#include "plan/overrides.h"

namespace lynx::plan {
namespace {

// -1 when `name` is unset, else 0 or 1.
int32_t env_switch(const char* name) {
  const char* v = std::getenv(name);
  if (!v) return -1;
  if (std::string(v) == "0" || std::string(v) == "1") return v[0] - '0';
  throw Error(name, std::string("must be 0 or 1, got '") + v + "'");
}

// 0 when `name` is unset, else a whole number of `what` in [1, most].
int32_t env_count(const char* name, long most, const char* what) {
  const char* v = std::getenv(name);
  if (!v) return 0;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  if (end == v || *end != '\0' || n < 1 || n > most) {
    throw Error(name, std::string("must be a whole number of ") + what + " in [1, " + std::to_string(most) +
                          "], got '" + v + "'");
  }
  return int32_t(n);
}

// -1 when `name` is unset, else the index of its value among `values`.
int32_t env_choice(const char* name, std::initializer_list<const char*> values) {
  const char* v = std::getenv(name);
  if (!v) return -1;
  std::string expected;
  int32_t i = 0;
  for (const char* value : values) {
    if (std::string(v) == value) return i;
    expected += (i == 0 ? "" : i + 1 == int32_t(values.size()) ? " or " : ", ") + std::string(value);
    ++i;
  }
  throw Error(name, "must be " + expected + ", got '" + v + "'");
}

Overrides read_environment() {
  Overrides o;
  o.gemm_order = env_choice("LYNX_GEMM_ORDER", {"static", "in-order"});
  o.gemm_group_rows = env_count("LYNX_GEMM_GROUP_ROWS", 64, "row blocks");
  o.gemm_clusters = env_switch("LYNX_GEMM_CLUSTER");
  o.gemm_fold = env_switch("LYNX_GEMM_FOLD");
  o.gemm_swapped = env_switch("LYNX_GEMM_SWAPPED");
  o.gemm_half_tiles = env_switch("LYNX_GEMM_HALF_TILES");
  o.gemm_gather = env_switch("LYNX_GEMM_GATHER");
  o.gather_token_major = env_switch("LYNX_GEMM_GATHER_TOKENS");
  o.gather_lookahead = env_count("LYNX_GEMM_GATHER_AHEAD", 1 << 30, "row blocks");
  o.schedule_min_warps = env_count("LYNX_SCHEDULE_MIN_WARPS", 16, "warps");
  o.baseline_gemm = env_choice("LYNX_UNFUSED_GEMM", {"loop", "grouped"});
  o.fp8_pair_rows = env_switch("LYNX_FP8_PAIR_ROWS");
  o.fp8_wide_tiles = env_switch("LYNX_FP8_WIDE_TILES");
  o.x_rows_again = env_choice("LYNX_X_ROWS_AGAIN", {"kernel", "dgrad-down", "dgrad-gate-up"});
  o.virtual_serial = env_choice("LYNX_VIRTUAL_RANKS", {"streams", "serial"});
  return o;
}

}  // namespace

const Overrides& environment_overrides() {
  static const Overrides overrides = read_environment();
  return overrides;
}

}  // namespace lynx::plan
