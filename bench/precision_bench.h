// lynx-bench --precision fp8: the fused forward in bf16 and in FP8 (Config::precision) on the same
// problem, the FP8 y checked against the bf16 y, timed in interleaved rounds, with the time to quantise
// the weights (once per optimizer step) beside them.
#pragma once

#include <string>
#include <vector>

#include "gpu_clock.h"
#include "problem.h"
#include "regime.h"

namespace lynx::bench {

struct PrecisionRow {
  std::string what;  // "forward bf16", "forward fp8", "quantize_weights"
  double ms;
  ClockSummary clocks;
};

struct PrecisionResult {
  std::vector<PrecisionRow> rows;
  double dissimilarity;  // 1 − 2⟨a,b⟩/(|a|²+|b|²) of the FP8 y and the bf16 y
  bool finite;           // every FP8 y value finite (the outputs were poisoned with NaN)
};

// NOTES: the yardstick of the check (tests/gpu/test_fp8_layer.cpp derives it against the exact layer;
// the bf16 y is within its own 1e-2 of that, which adds at most 5e-5).
constexpr double kFp8MaxDissimilarity = 1.0 / 256.0;

PrecisionResult time_precisions(Problem& p, const Protocol& protocol, int rounds, const GpuClock* clock);

}  // namespace lynx::bench
