// The benchmark's correctness check: rows of the layer's outputs against the double-precision CPU
// reference, for a spread of tokens (the full reference is too slow at benchmark shapes).
#pragma once

#include <string>

#include "problem.h"

namespace lynx::bench {

struct CheckResult {
  double y = -1, dx = -1, d_topk = -1;  // relative Frobenius errors over the checked rows (-1: not checked)
  bool ok = false;
  std::string summary() const;
};

constexpr double kCheckTolerance = 1e-2;

// Compares y (and, with_backward, dx and d_topk_weights) of `tokens` tokens spread over [0, T) with
// the reference. The outputs must already be computed (stream synchronised).
CheckResult check_rows(const Problem& p, int tokens, bool with_backward);

}  // namespace lynx::bench
