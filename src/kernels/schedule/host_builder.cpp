// The host schedule builder: plain serial code over the rules of schedule_core.h. It is the reference
// the device builder is tested against, bit for bit.
#include <algorithm>

#include "kernels/schedule/api.h"
#include "kernels/schedule/core.h"

namespace lynx::sched {

HostResult build_schedule_host(const Problem& p, const int32_t* const* topk_ids, HostSchedule& out) {
  const int32_t R = p.num_ranks;
  const int32_t E_loc = static_cast<int32_t>(p.local_experts());
  const int64_t entries = p.tokens * p.top_k;  // (t, j) pairs per source rank, flat index t*k + j

  // Rows each source sends to each local expert.
  std::vector<int32_t> source_rows(size_t(E_loc) * R, 0);
  for (int32_t s = 0; s < R; ++s) {
    for (int64_t i = 0; i < entries; ++i) {
      const int32_t e = core::local_expert(topk_ids[s][i], p.rank, E_loc);
      if (e >= 0) ++source_rows[core::pair_index(e, s, R)];
    }
  }

  out.expert_rows.assign(E_loc, 0);
  out.expert_offset.assign(size_t(E_loc) + 1, 0);
  out.block_offset.assign(size_t(E_loc) + 1, 0);
  out.half_block_offset.assign(size_t(E_loc) + 1, 0);
  int64_t total = 0, blocks = 0, half_blocks = 0;
  for (int32_t e = 0; e < E_loc; ++e) {
    int64_t rows = 0;
    for (int32_t s = 0; s < R; ++s) rows += source_rows[core::pair_index(e, s, R)];
    out.expert_rows[e] = static_cast<int32_t>(rows);
    out.expert_offset[e] = static_cast<int32_t>(total);
    out.block_offset[e] = static_cast<int32_t>(blocks);
    out.half_block_offset[e] = static_cast<int32_t>(half_blocks);
    total += core::padded_rows(rows);
    blocks += core::tile_blocks(rows);
    half_blocks += core::half_blocks(rows);
  }
  out.expert_offset[E_loc] = static_cast<int32_t>(total);
  out.block_offset[E_loc] = static_cast<int32_t>(blocks);
  out.half_block_offset[E_loc] = static_cast<int32_t>(half_blocks);

  const size_t capacity = size_t(std::max<int64_t>(p.capacity, 0));
  out.row_token_slot.assign(capacity, -1);
  out.row_src_rank.assign(capacity, -1);
  out.slot_row.assign(size_t(entries), -1);

  HostResult result;
  result.rows_needed = total;
  if (!core::fits_capacity(total, p.capacity)) {
    result.code = StatusCode::kCapacityOverflow;
    return result;
  }

  // Row q of source s for expert e goes after the rows of the sources before s; q counts in t*k + j order.
  std::vector<int32_t> next_q(size_t(E_loc) * R, 0);
  for (int32_t s = 0; s < R; ++s) {
    for (int64_t i = 0; i < entries; ++i) {
      const int32_t e = core::local_expert(topk_ids[s][i], p.rank, E_loc);
      if (e < 0) continue;
      const int32_t q = next_q[core::pair_index(e, s, R)]++;
      const int64_t row = out.expert_offset[e] +
                          core::source_major_position(q, s, &source_rows[core::pair_index(e, 0, R)]);
      out.row_token_slot[row] = static_cast<int32_t>(i);
      out.row_src_rank[row] = s;
      if (s == p.rank) out.slot_row[i] = static_cast<int32_t>(row);
    }
  }
  return result;
}

}  // namespace lynx::sched
