// The schedule's placement rules (see schedule.h), as small functions that compile for host and device.
// build_schedule_host and the device kernels both place rows only through these, so the two builders
// cannot drift apart.
#pragma once

#include <cstdint>

#include "common/hd.h"
#include "lynx/config.h"

namespace lynx::sched::core {

// Local index (0 .. E_loc-1) of global expert `id` on rank `rank`, or -1 when another rank owns it.
// NOTES: an id outside [0, E) falls outside every rank's range, so it is simply non-local; the
// difference is taken in 64 bits so no id can overflow it.
LYNX_HD int32_t local_expert(int32_t id, int32_t rank, int32_t local_experts) {
  const int64_t e = int64_t(id) - int64_t(rank) * local_experts;
  return (e >= 0 && e < local_experts) ? int32_t(e) : -1;
}

// Rows an expert's block takes: its row count rounded up to the tile height (0 stays 0).
LYNX_HD int64_t padded_rows(int64_t rows) { return (rows + kTileRows - 1) / kTileRows * kTileRows; }

// The expert GEMM's row blocks (kernels/expert_gemm/tile_scheduler.h, "folded tails"): an expert's block of
// padded_rows / kTileRows row blocks, less its last when that holds a tail of 1 .. kFoldRows rows
// behind at least one whole block: such a tail is computed by the tile of the block before it.
// block_offset[e] counts these blocks over the experts before e.
constexpr int64_t kFoldRows = 16;
LYNX_HD int64_t folded_tail_rows(int64_t rows) {
  const int64_t tail = rows % kTileRows;
  return rows > kTileRows && tail <= kFoldRows ? tail : 0;
}
LYNX_HD int64_t tile_blocks(int64_t rows) { return padded_rows(rows) / kTileRows - (folded_tail_rows(rows) > 0 ? 1 : 0); }

// Whether an expert's last row block holds 1 .. kHalfRows rows, its second 64-row half none: a half
// block, which the FP8 grouped GEMMs compute in wide tiles (kernels/fp8/tiles.h). half_block_offset[e]
// counts them over the experts before e.
constexpr int64_t kHalfRows = 64;
LYNX_HD int64_t half_blocks(int64_t rows) {
  const int64_t tail = rows % kTileRows;
  return tail > 0 && tail <= kHalfRows ? 1 : 0;
}

// Whether schedule row `row` lies in a 64-row half of its expert's block that holds no routed rows.
// An expert's rows come first in its block, so such a half starts with a padding row. No kernel reads
// those halves (half tiles load rows 0-63; the weight gradients' K stops at the last 64-row block with
// rows), so none writes them either: ~117 MB per gather at deepseek-v3.
LYNX_HD bool in_rowless_half(const int32_t* row_token_slot, int64_t row) {
  return row_token_slot[row - row % kHalfRows] < 0;
}

// Whether padding row `row` (one of a half with rows) is read by a row GEMM's tile, so must hold zeros:
// in the second half of a block, read whole by its tile (the block's first half is then whole), or in
// a 16-row group that begins with a routed row (a half tile loads its rows in 16-row boxes and a folded
// tail in one, the TMA filling the rest with zeros without reading; the weight gradients stop at the
// last 16-row step that holds rows). No other padding row is read: ~89 MB per gather at deepseek-v3.
constexpr int64_t kReadGroupRows = 16;
static_assert(kFoldRows == kReadGroupRows, "a folded tail's box is one read group");
LYNX_HD bool padding_row_read(const int32_t* row_token_slot, int64_t row) {
  if (row % kTileRows >= kHalfRows) return row_token_slot[row - row % kHalfRows] >= 0;
  return row_token_slot[row - row % kReadGroupRows] >= 0;
}

// Whether a schedule of `total` padded rows fits in the row arrays.
LYNX_HD bool fits_capacity(int64_t total, int64_t capacity) { return total <= capacity; }

// Index of the (local expert e, source rank s) pair in per-pair tables: expert-major, sources inner,
// so one expert's per-source row counts are contiguous (what source_major_position reads).
LYNX_HD int32_t pair_index(int32_t e, int32_t s, int32_t num_sources) { return e * num_sources + s; }

// Position, inside its expert's block, of row q of source s, where source_rows[s'] = |L_s'| is the
// number of rows source s' sends to this expert: the rows of the sources before s, then q.
// NOTES: global token order (tokens numbered rank-major, a source's rows in t*k + j order), with no
// padding per source: an expert's rows stand in the same order at every R, so the weight gradients'
// K order, and with it their bits, do not depend on R (docs/expert-parallel.md, "Invariance in R").
LYNX_HD int64_t source_major_position(int64_t q, int32_t s, const int32_t* source_rows) {
  int64_t pos = q;
  for (int32_t other = 0; other < s; ++other) pos += source_rows[other];
  return pos;
}

}  // namespace lynx::sched::core
