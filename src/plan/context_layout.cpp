#include "plan/context_layout.h"

#include <initializer_list>

namespace lynx::plan {

bool gate_up_by_slot(const LayerShape& s, Backend backend) { return s.num_ranks == 1 && backend == Backend::kFused; }

ContextSizes context_sizes(const LayerShape& s, int64_t cap, Backend backend) {
  const int64_t E = s.local_experts(), Is = s.shared_intermediate;
  // NOTES: one rank keeps no gathered x rows: backward gathers them again from x, which the caller
  // keeps anyway (beside the dgrad of down: runtime/fused_backward.cpp), against 320 MiB kept per
  // layer at qwen3-30b-a3b. At R > 1 the rows came from other ranks' x, which backward does not stage
  // (it stages dy), so they are kept. Nor does one rank keep its rows' source ranks (all its own).
  const bool one_rank = s.num_ranks == 1;
  const int64_t xg = one_rank ? 0 : 2 * cap * s.hidden;
  const int64_t gate_up_rows = gate_up_by_slot(s, backend) ? s.tokens * s.top_k : cap;
  return {4 * cap,
          one_rank ? 0 : 4 * cap,
          4 * (E + 1),
          4 * E,
          4 * (E + 1),
          4 * (E + 1),
          4 * s.tokens * s.top_k,
          2 * s.tokens * Is,
          2 * s.tokens * Is,
          xg,
          2 * gate_up_rows * s.intermediate,
          2 * gate_up_rows * s.intermediate};
}

int64_t context_block_bytes(const ContextSizes& s) {
  int64_t total = 0;
  for (const int64_t b : {s.row_token_slot, s.row_src_rank, s.expert_offset, s.expert_rows, s.block_offset, s.half_block_offset, s.slot_row,
                          s.gs, s.us, s.xg, s.g, s.u}) {
    total += lent_bytes(b);
  }
  return total;
}

int64_t forward_only_bytes(const ContextSizes& s, bool gathered_rows) {
  return context_block_bytes(s) - lent_bytes(s.g) - lent_bytes(s.u) - (gathered_rows ? 0 : lent_bytes(s.xg));
}

}  // namespace lynx::plan
