// lynx-bench --precision fp8: the fused layer in bf16 and in FP8 (Config::precision) on the same
// problem, the FP8 y and dx checked against the bf16 ones, the forward and forward+backward timed in
// interleaved rounds (forward+backward in FP8 also with bf16 weight gradients), with the time to
// quantise the weights (once per optimizer step) beside them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "gpu_clock.h"
#include "problem.h"
#include "regime.h"

namespace lynx::bench {

struct PrecisionRow {
  std::string what;  // "forward bf16", "forward fp8", "fwd+bwd bf16", "fwd+bwd fp8", "fwd+bwd fp8, bf16 wgrad"
                     // (Config::bf16_weight_grads), "quantize_weights"
  double ms;
  ClockSummary clocks;
};

struct PrecisionResult {
  std::vector<PrecisionRow> rows;
  double dissimilarity;     // 1 − 2⟨a,b⟩/(|a|²+|b|²) of the FP8 y and the bf16 y
  double dx_dissimilarity;  // the same of dx
  bool finite;              // every FP8 y and dx value finite (the outputs were poisoned with NaN)
  // FNV-1a digests of every output's bits (y, dx, d_topk_weights, dw_gate, dw_up, dw_down) of the FP8
  // pass and of the FP8 pass with bf16 weight gradients: builds whose kernels differ only in how they
  // compute the same values (tiles, fused steps) give the same digests. Forward only: y's, and no second.
  uint64_t fp8_bits, fp8_bf16_wgrad_bits;
};

// NOTES: the yardsticks of the check (tests/gpu/test_fp8_layer.cpp derives them against the exact
// layer; the bf16 outputs are within their own 1e-2 of that, which adds at most 5e-5): y's, and dx's,
// whose FP8 dgrad bears two more quantised operands.
constexpr double kFp8MaxDissimilarity = 1.0 / 256.0;
constexpr double kFp8MaxDxDissimilarity = 1.0 / 192.0;

// forward_only: the forwards and quantize_weights alone, y checked and digested (no backward is run).
PrecisionResult time_precisions(Problem& p, const Protocol& protocol, int rounds, const GpuClock* clock,
                                bool forward_only);

}  // namespace lynx::bench
