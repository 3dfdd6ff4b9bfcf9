// The expert GEMM launches' tiling choices: pure host functions of the shape, CPU-tested
// (tests/cpu/test_tiles.cpp). The runtime reaches them through plan/layer_plan.h.
#pragma once

#include <cstdint>

#include "kernels/expert_gemm/api.h"

namespace lynx::plan {

using gemm::kBlockK;
using gemm::kBlockM;
using gemm::TileOrder;

// NOTES: when clusters pay: a long K (64 K blocks or more). Over a long K loop the CTAs that share a
// tile's operand without clusters read it far apart in time (deepseek-v3's gate/up, K = 7168: a median
// 6.4 µs apart, ~42 MB of other loads, so about half of the second reads missed L2); over a short
// one the pair's lockstep (a stage is refilled only when both CTAs are done with it) costs more than
// the L2 traffic saved. Measured on 2026-11-29 (H200, alternating rounds in one call,
// measured 2026-11-29, commit 27164ab): paired, deepseek-v3's
// gate/up read 15.9 GB from DRAM instead of 19.7 and its forward ran 8.3% faster, its backward (K =
// 7168 and 4096) 2.1%; mixtral-8x7b (K = 4096 and 14336) forward 1.7-2.3% and backward 0.6-1.3%
// faster; slower with every launch paired: qwen3-30b-a3b forward 3.9-7.6% and olmoe-1b-7b 1.6-4.7%
// (K <= 2048), and deepseek-v3's down alone (K = 2048) 5%; again on 2026-11-29 (commit 61e8b61), on the kernel of
// then: deepseek-v3's forward +1.2% with its down paired (measured 2026-11-29, commit 61e8b61).
constexpr int64_t kClusterFromKBlocks = 64;
inline bool use_cluster_units(int64_t k) { return k / kBlockK >= kClusterFromKBlocks; }

// NOTES: the order is chosen per launch from the rows an expert receives on average and from whether
// the launch gathers its rows. A wave of S concurrent tiles covering G row blocks and S / G column
// blocks reads G A-blocks (128 × K) and S / G weight tiles (256 × K): the traffic is least near
// G = sqrt(2 S) ≈ 16 on 132 SMs.
// - Fewer than two row blocks per expert (deepseek-v3: 128 rows on average, so about half of the
//   experts get a second, nearly empty block): the weights dominate the traffic and each weight tile
//   serves one or two row blocks. Groups end at expert boundaries, so an expert's blocks are
//   neighbours, and tiles are claimed in order, so neighbours run together and the second block reads
//   the weights from L2. Static round robin with m-major order let CTAs drift apart and read ~26.6 GB
//   where ~16 GB are needed; in-order claims with expert groups: forward 10.18 → 9.32 ms, backward
//   19.95 → 18.27 ms (measured 2026-11-29).
// - 16 or more row blocks per expert (mixtral-8x7b: 16, and ~108 waves of gate/up tiles): in order
//   too, groups of 16 ending at experts. Over that many waves the static round robin's CTAs drift
//   apart; with every consumer thread releasing its stages (2026-11-29, commit 811550f) in-order claims won in each of
//   5 alternating rounds: forward 9.73-9.86 → 9.43-9.48 ms, backward 19.10-19.17 → 18.91-18.95, at a
//   lower board power (measured 2026-11-29, commit 811550f). Before that change the
//   3-round A/B had not confirmed single-run gains.
// - Between (qwen3-30b-a3b: 4, olmoe-1b-7b: 8): the static round robin with groups of a fixed size
//   that straddle experts, G the power of two within the row blocks an expert receives on average.
//   In-order claims lost there on 2026-11-29 (commit 811550f), before the gather ran in the GEMM: qwen3 forward +2.2% in
//   each of 4 rounds (same run), and on 2026-11-29 (commit 8b04d67) they still did not win for launches that do
//   not gather (the backward part of forward+backward unchanged, section 6); expert-bounded
//   groups in static order were up to 6% slower (measured 2026-11-29).
//   Not measured between 8 and 16 blocks. Its end needs no balancing: claiming the last 0-4 rounds
//   from the ticket instead (a simulation put the busiest CTA of qwen3's `da`, 13.1 tiles per CTA, 7%
//   over the mean) measured within 0.4% (measured 2026-12-04, commit 0defeac):
//   these launches are bound by L2 and DRAM, so the CTAs still running at the end go faster.
// - A launch that gathers its own rows (row_gather.cuh): in order at every size. The gather warps copy
//   the rows in schedule order, a few row blocks ahead of the furthest block a producer has begun;
//   tiles claimed in the same order read each block soon after it was copied. 5 alternated
//   rounds (measured 2026-11-29, commit 8b04d67): forward -2.3% at
//   qwen3-30b-a3b, -2.2% at olmoe-1b-7b, faster in every round.
inline int64_t row_blocks_per_expert(int64_t routed_rows, int64_t experts) {
  return experts > 0 ? routed_rows / experts / kBlockM : 0;
}
inline TileOrder in_order_tiles() { return {true, true, 16}; }

// NOTES: whether a launch folds tails (folded tails, above): where experts receive fewer than two row
// blocks on average (deepseek-v3: 128 ± 11 rows, so about half of the experts end in a tail of ~9
// rows behind one whole block, and ~84% of those tails hold 1-16 rows). There a tail tile costs its
// staged weights, 27% of a whole tile's time at deepseek-v3 (measured 2026-12-02,
// commit 2fe9a46). With four or more blocks per expert the tail tile runs beside its expert's other blocks
// and reads their weight tile from L2, and folding made qwen3-30b-a3b and olmoe-1b-7b slower (forward
// +1.4% and +2.4%, backward +2.3% and +1.2%, though ~29% of qwen3's tails hold 1-16 rows): the folding
// kernels pay for their narrower epilogue pieces on every tile (measured 2026-12-03, commit ce5473e).
inline bool fold_tails(int64_t routed_rows, int64_t experts) { return row_blocks_per_expert(routed_rows, experts) < 2; }
// NOTES: the FP8 grouped GEMMs' tiles in pairs of an expert's row blocks (kernels/fp8/tiles.h) where
// experts receive fewer than two row blocks on average, as where tails fold (above): there about half
// the experts span two blocks, and in the plain order each block's tiles stream the expert's weights
// at a different time (deepseek-v3: the FP8 gate/up GEMM at 85% of the DRAM's rate moved ~1.25× its
// operands' bytes, H100, 2026-12-06, docs/fp8.md). In pairs the FP8 forward took 10% less at
// deepseek-v3 (5.05 ms against 5.61) and 6% less at 4096, 7168, 2048, 64 experts, k = 2 (H100,
// 2026-12-06, bench/results/2026-12-06-h100-4f8dcd8-fp8-row-pairs-log.txt). Where experts span more
// blocks their tiles gain nothing: at qwen3-30b-a3b (four an expert) 1.031 ms in pairs against 1.027
// (bench/results/2026-12-06-h100-5e443e3-log.txt).
inline bool fp8_pair_row_blocks(int64_t routed_rows, int64_t experts) {
  return row_blocks_per_expert(routed_rows, experts) < 2;
}

// NOTES: the FP8 grouped GEMMs' half blocks (an expert's last row block holding at most 64 rows) in wide
// tiles (kernels/fp8/tiles.h) wherever their tiles are not in pairs: a pair's tiles share their B reads
// by running in step, which a wide tile, with twice a plain tile's columns, would not keep.
inline bool fp8_wide_half_blocks(bool pair_rows) { return !pair_rows; }
inline TileOrder static_tiles(int64_t blocks_per_expert) {
  int32_t g = 1;
  while (g < 16 && 2 * g <= blocks_per_expert) g *= 2;
  return {false, false, g};
}
constexpr int64_t kInOrderFromBlocks = 16;
inline TileOrder choose_tile_order(int64_t routed_rows, int64_t experts, bool gathers_rows) {
  const int64_t blocks = row_blocks_per_expert(routed_rows, experts);
  return gathers_rows || blocks < 2 || blocks >= kInOrderFromBlocks ? in_order_tiles() : static_tiles(blocks);
}

}  // namespace lynx::plan
