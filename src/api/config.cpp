// Shape limits and the config heuristics: pure host functions, tested on the CPU.
#include <algorithm>
#include <cmath>
#include <string>

#include "lynx/config.h"
#include "lynx/error.h"
#include "lynx/moe.h"
#include "plan/context_layout.h"

namespace lynx {
namespace {

std::string str(int64_t v) { return std::to_string(v); }

void require(bool ok, const char* field, const std::string& message) {
  if (!ok) throw Error(field, message);
}

void require_dim(int64_t v, const char* field, int64_t align, int64_t max) {
  require(v > 0, field, "must be positive, got " + str(v));
  require(v % align == 0, field, "must be a multiple of " + str(align) + " (the kernels' K/N tile), got " + str(v));
  require(v <= max, field, "must be at most " + str(max) + ", got " + str(v));
}

int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

}  // namespace

void validate_shape(const LayerShape& s) {
  require(s.tokens >= 1 && s.tokens <= Limits::kMaxTokens, "shape.tokens",
          "must be in [1, " + str(Limits::kMaxTokens) + "], got " + str(s.tokens));
  require_dim(s.hidden, "shape.hidden", Limits::kHiddenAlign, Limits::kMaxHidden);
  require_dim(s.intermediate, "shape.intermediate", Limits::kIntermediateAlign, Limits::kMaxIntermediate);
  if (s.shared_intermediate != 0) {
    require_dim(s.shared_intermediate, "shape.shared_intermediate", Limits::kIntermediateAlign,
                Limits::kMaxIntermediate);
  }
  require(s.num_ranks >= 1 && s.num_ranks <= Limits::kMaxRanks, "shape.num_ranks",
          "must be in [1, " + str(Limits::kMaxRanks) + "], got " + str(s.num_ranks));
  require(s.rank >= 0 && s.rank < s.num_ranks, "shape.rank",
          "must be in [0, num_ranks = " + str(s.num_ranks) + "), got " + str(s.rank));
  require(s.num_experts >= 1 && s.num_experts <= Limits::kMaxExperts, "shape.num_experts",
          "must be in [1, " + str(Limits::kMaxExperts) + "], got " + str(s.num_experts));
  require(s.num_experts % s.num_ranks == 0, "shape.num_experts",
          "E = " + str(s.num_experts) + " is not divisible by num_ranks = " + str(s.num_ranks));
  require(s.top_k >= 1, "shape.top_k", "must be at least 1, got " + str(s.top_k));
  require(s.top_k <= s.num_experts, "shape.top_k",
          "k = " + str(s.top_k) + " is larger than the number of experts E = " + str(s.num_experts));
  require(s.top_k <= Limits::kMaxTopK, "shape.top_k", "must be at most " + str(Limits::kMaxTopK) + ", got " + str(s.top_k));
  const int64_t routed = s.tokens * s.top_k * s.num_ranks;
  require(routed <= Limits::kMaxRoutedRows, "shape.tokens",
          "tokens * top_k * num_ranks = " + str(routed) + " exceeds " + str(Limits::kMaxRoutedRows));
  // NOTES: the schedule's rows, each local expert's padded to kTileRows, are int32-indexed too, and a
  // given capacity does not bound them: the schedule builder sums the padded counts before it compares
  // them with the capacity.
  const int64_t padded = worst_case_schedule_rows(s);
  require(padded <= Limits::kMaxRoutedRows + 1 - kTileRows, "shape.tokens",
          "tokens * top_k * num_ranks = " + str(routed) + " rows, each of the " + str(s.local_experts()) +
              " local experts' padded to " + str(kTileRows) + ", can need " + str(padded) + " schedule rows; at most " +
              str(Limits::kMaxRoutedRows + 1 - kTileRows) + " are indexable");
}

int64_t worst_case_schedule_rows(const LayerShape& s) {
  const int64_t routed = s.tokens * s.top_k * s.num_ranks;
  const int64_t padded_experts = std::min(s.local_experts(), routed);
  return round_up(routed + padded_experts * (kTileRows - 1), kTileRows);
}

int64_t schedule_capacity_for_load(const LayerShape& s, double max_load) {
  validate_shape(s);
  require(std::isfinite(max_load) && max_load >= 1.0, "max_load",
          "must be a finite number >= 1 (times the balanced share of rows), got " + std::to_string(max_load));
  const int64_t routed = s.tokens * s.top_k * s.num_ranks;
  // NOTES: clamped in floating point first: a huge max_load must not overflow the conversion.
  const int64_t rows = int64_t(std::ceil(std::min(max_load * double(s.tokens * s.top_k), double(routed))));
  const int64_t padded_experts = std::min(s.local_experts(), rows);
  return std::min(worst_case_schedule_rows(s), round_up(rows + padded_experts * (kTileRows - 1), kTileRows));
}

ResolvedConfig resolve_config(const LayerShape& shape, const Config& c, const DeviceInfo& device) {
  validate_shape(shape);
  require(device.sm_count >= 2, "device.sm_count", "needs at least 2 SMs, got " + str(device.sm_count));
  ResolvedConfig r{};
  const int64_t worst = worst_case_schedule_rows(shape);

  if (c.schedule_capacity == 0) {
    r.schedule_capacity = worst;
  } else {
    require(c.schedule_capacity > 0 && c.schedule_capacity % kTileRows == 0, "config.schedule_capacity",
            "must be a positive multiple of " + str(kTileRows) + ", got " + str(c.schedule_capacity));
    require(c.schedule_capacity <= Limits::kMaxRoutedRows + 1 - kTileRows, "config.schedule_capacity",
            "must be at most " + str(Limits::kMaxRoutedRows + 1 - kTileRows) + ", got " + str(c.schedule_capacity));
    // More than the worst case can never be used: clamp instead of wasting memory.
    r.schedule_capacity = std::min(c.schedule_capacity, worst);
  }

  require(c.backend == Backend::kAuto || c.backend == Backend::kUnfused || c.backend == Backend::kFused,
          "config.backend", "unknown backend " + str(static_cast<int64_t>(c.backend)));
  r.backend = c.backend == Backend::kAuto ? Backend::kFused : c.backend;
  require(shape.num_ranks == 1 || r.backend == Backend::kFused, "config.backend",
          "the unfused baseline runs one rank only; num_ranks = " + str(shape.num_ranks) + " needs the fused backend");
  require(c.peer_timeout_ms >= 0 && c.peer_timeout_ms <= 3'600'000, "config.peer_timeout_ms",
          "must be in [0, 3600000] (0: 30 s), got " + str(c.peer_timeout_ms));
  r.peer_timeout_ms = c.peer_timeout_ms == 0 ? 30'000 : c.peer_timeout_ms;
  r.scratch_allocator = c.scratch_allocator;
  require(!c.caller_context || c.save_forward_context, "config.caller_context",
          "needs save_forward_context: the caller's context is what forward saves");
  r.caller_context = c.caller_context;
  r.save_forward_context = c.save_forward_context;
  require(c.precision == Precision::kBf16 || c.precision == Precision::kFp8Block, "config.precision",
          "unknown precision " + str(static_cast<int64_t>(c.precision)));
  if (c.precision == Precision::kFp8Block) {
    require(r.backend == Backend::kFused, "config.precision", "fp8_block needs the fused backend");
    // NOTES: refused here, not at the first forward's GEMM launch (fp8/gemm.cu takes M and K below 2^30).
    require(r.schedule_capacity <= Limits::kMaxFp8ScheduleRows, "config.schedule_capacity",
            "fp8_block schedules at most " + str(Limits::kMaxFp8ScheduleRows) + " rows; " +
                (c.schedule_capacity == 0 ? "this shape can need " + str(worst) + " (give a smaller capacity)"
                                          : "got " + str(c.schedule_capacity)));
  }
  r.precision = c.precision;
  require(!c.bf16_weight_grads || c.precision == Precision::kFp8Block, "config.bf16_weight_grads",
          "applies to precision kFp8Block only (bf16 passes compute every gradient in bf16)");
  r.bf16_weight_grads = c.bf16_weight_grads;
  return r;
}

int64_t forward_context_bytes(const LayerShape& shape, const Config& config) {
  require(config.save_forward_context, "config.save_forward_context",
          "is false: forward saves no context, so there is none to size (a caller's context needs it)");
  Config c = config;
  c.caller_context = false;
  const ResolvedConfig r = resolve_config(shape, c, DeviceInfo{});
  return plan::context_block_bytes(plan::context_sizes(shape, r.schedule_capacity, r.backend));
}

}  // namespace lynx
