// Where and how far ahead the expert GEMM launches gather their rows: pure host functions that the
// CPU tests check.
#pragma once

#include <cstdint>

#include "plan/tiles.h"

namespace lynx::plan {

// NOTES: how far the gather may run ahead, in row blocks: about 24 MB of rows, about half the H200's
// L2, so that a block is still there when its tiles read it; at least 8 blocks, so that the copies
// keep ahead of the first wave (qwen3-30b-a3b: 48 blocks of 512 KB; deepseek-v3: 13 of 1.8 MB).
constexpr int64_t kGatherAheadBytes = int64_t(24) << 20;
constexpr int32_t kGatherMinAheadBlocks = 8;
inline int32_t gather_lookahead_blocks(int64_t k) {
  const int64_t block_bytes = int64_t(kBlockM) * k * 2;
  const int64_t blocks = block_bytes > 0 ? kGatherAheadBytes / block_bytes : 0;
  return static_cast<int32_t>(blocks < kGatherMinAheadBlocks ? kGatherMinAheadBlocks : blocks);
}

// NOTES: where a launch's rows are gathered: by the GEMM's own warps while its tiles run (above), or
// token-major by a kernel before it (glue::scatter_token_rows: each token row read once, its k
// copies written at the GPU's write rate, ~3.2 TB/s on the H200; the GEMM then reads its rows from
// DRAM and no longer overlaps the copy). Token-major where either
// - the launch streams its weights (under two row blocks per expert: each weight tile is read for
//   ~128 rows) and the token rows take more than half of the L2: the in-kernel gather's k reads of
//   each token row, spread over the launch, then mostly miss, and those bytes cost as much as any
//   in a launch bound by DRAM. deepseek-v3's forward (59 MB of x): -3.5% in each of 3 rounds at
//   full clock, -2.1% under the power cap (measured 2026-12-03, commit 6d25562);
//   its backward (dy, the same size) within the spread; or
// - each gathered row feeds fewer than kInGemmGatherMinProducts output columns, too few tiles to hide
//   its copy behind: qwen3-30b-a3b's dgrad of down (I = 768 columns): backward -1.2% in each of 4
//   rounds (section 3), where olmoe-1b-7b's (1024) was flat (+0.2%) and every gate/up launch (2I
//   columns) lost without its in-kernel gather (qwen3 +1.8%, olmoe +1.1%, mixtral-8x7b +3.9%;
//   section 1). Between 768 and 1024 columns nothing was measured.
constexpr int64_t kInGemmGatherMinProducts = 1024;
inline bool gather_token_major(int64_t routed_rows, int64_t experts, int64_t tokens, int64_t width,
                               int64_t products_per_row, int64_t l2_bytes) {
  const bool streams_weights = row_blocks_per_expert(routed_rows, experts) < 2;
  const bool rows_fill_l2 = 2 * (tokens * width * 2) > l2_bytes;
  return (streams_weights && rows_fill_l2) || products_per_row < kInGemmGatherMinProducts;
}

}  // namespace lynx::plan
