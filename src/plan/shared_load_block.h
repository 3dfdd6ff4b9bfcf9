// The block a workspace with a shared expert takes while it is made, to run the shared expert's
// products once so that cuBLAS loads their kernels (runtime/steps.h, load_shared_expert_kernels;
// lynx/allocator.h gives its size to callers): its areas in placement order, each rounded up to 1 KB.
#pragma once

#include <cstdint>

#include "lynx/config.h"
#include "plan/context_layout.h"

namespace lynx::plan {

struct SharedLoadBlock {
  int64_t x = 0;        // x (also dy) [T, H] bf16, zeroed
  int64_t weights = 0;  // one shared weight [I_s, H] bf16, zeroed: every weight, then every weight gradient
  int64_t scratch = 0;  // hs, dhs, dgs, dus [T, I_s] bf16 and ys [T, H] fp32, where the workspace lends its scratch
  int64_t context = 0;  // gs, us [T, I_s] bf16, where the caller holds the forward context
  int64_t total() const { return x + weights + scratch + context; }
};

// All zero without a shared expert.
inline SharedLoadBlock shared_load_block(const LayerShape& s, bool scratch_lent, bool context_lent) {
  SharedLoadBlock b;
  const int64_t T = s.tokens, H = s.hidden, Is = s.shared_intermediate;
  if (Is == 0) return b;
  const int64_t per_token = lent_bytes(2 * T * Is);
  b.x = lent_bytes(2 * T * H);
  b.weights = lent_bytes(2 * Is * H);
  b.scratch = scratch_lent ? 4 * per_token + lent_bytes(4 * T * H) : 0;
  b.context = context_lent ? 2 * per_token : 0;
  return b;
}

}  // namespace lynx::plan
