// The tile schedule of the expert GEMM kernel: which output tile a persistent CTA computes, with which
// K range. Compiles for host and device; the CPU tests check it on random schedules.
#pragma once

#include <cstdint>

#include "common/hd.h"
#include "kernels/expert_gemm/api.h"
#include "kernels/schedule/core.h"

namespace lynx::gemm {


// The grid of output tiles of one launch.
struct TileGrid {
  const int32_t* expert_offset;  // [experts + 1] padded row offsets of the schedule (device memory)
  int32_t experts;
  int32_t tiles_m;    // row modes: capacity / kBlockM; weight grad: ceil(m / kBlockM) per expert
  int32_t tiles_n;    // ceil(n / block_n)
  int32_t block_n;    // columns of an output tile
  int32_t k_blocks;   // row modes: K / kBlockK (the weight gradient's K comes from the schedule)
  int32_t capacity;   // schedule rows the buffers hold
  bool weight_grad;   // per-expert weight gradients (K = an expert's rows) instead of row blocks
  int32_t group_rows = 1;      // row modes: row blocks per raster group (plan/tiles.h)
  bool expert_groups = false;  // row modes: raster groups end at expert boundaries (plan/tiles.h)
  const int32_t* expert_rows = nullptr;  // [experts] rows before padding (device memory). Row modes: the
                                         // rows of each tile (null: every tile counts as full); weight
                                         // grad: K stops at the last 64-row block holding rows (null: K is
                                         // the padded block)
  const int32_t* block_offset = nullptr;  // [experts + 1] row modes with folded tails (needs expert_rows):
                                          // the schedule's block_offset, each expert's first row block
                                          // among the tiles' (null: no tail is folded)
};

// What one tile computes.
struct Tile {
  int32_t a_row;     // row modes: first schedule row; weight grad: first row of C (a column of A's buffer)
  int32_t b_row;     // first column of C (a row of B, or a column of an N-major B)
  int32_t k0;        // first K coordinate
  int32_t k_blocks;  // 0: an expert without rows (its weight-gradient tile is zero)
  int32_t expert;
  int32_t rows;      // row modes: rows of the tile that are not padding (1 .. kBlockM); weight grad: the
                     // expert's rows, its K before padding (the padded rows without expert_rows)
  int32_t fold;      // row modes: rows of the expert's next block (its tail, 1 .. kFoldRows) that this tile
                     // computes too, 0: none (folded tails, below)
};

// ---- folded tails (row modes) ----
// An expert's last row block that holds 1 .. kFoldRows rows behind a whole block (its tail) has no
// tiles of its own when the launch folds tails: the tiles of the block before it also multiply the
// tail's rows with the weight tile they stage (the weight tile as wgmma's A, the tail rows as N). So
// the weights are staged once for both blocks. The tiles then walk the row blocks of the schedule's
// block_offset (schedule_core.h, tile_blocks) instead of expert_offset / kBlockM.
constexpr int32_t kFoldRows = int32_t(sched::core::kFoldRows);

// The expert whose (padded) block holds `row`: the last e with expert_offset[e] <= row.
LYNX_HD int32_t expert_of_row(const int32_t* expert_offset, int32_t experts, int32_t row) {
  int32_t lo = 0, hi = experts;  // invariant: offset[lo] <= row < offset[hi]
  while (hi - lo > 1) {
    const int32_t mid = (lo + hi) / 2;
    if (expert_offset[mid] <= row) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// Tiles of the launch. Row modes: only the row blocks in use (none when the schedule is over
// capacity: it placed no rows). Weight grad: every (expert, row block, column block).
// The first row block of expert e among the tiles' (row modes), with or without folded tails.
template <bool kFolded>
LYNX_HD int32_t first_block_of(const TileGrid& g, int32_t e) {
  return kFolded ? g.block_offset[e] : g.expert_offset[e] / kBlockM;
}

LYNX_HD int32_t tile_count(const TileGrid& g) {
  if (g.weight_grad) return g.experts * g.tiles_m * g.tiles_n;
  if (g.expert_offset[g.experts] > g.capacity) return 0;
  return (g.block_offset ? first_block_of<true>(g, g.experts) : first_block_of<false>(g, g.experts)) * g.tiles_n;
}

// The expert of the tiles' row block `block`: the last e with first_block_of(g, e) <= block.
template <bool kFolded>
LYNX_HD int32_t expert_of_block(const TileGrid& g, int32_t block) {
  return kFolded ? expert_of_row(g.block_offset, g.experts, block)
                 : expert_of_row(g.expert_offset, g.experts, block * kBlockM);
}

// A row-mode tile (tile_at below); kFolded: the launch folds tails (g.block_offset is set).
template <bool kFolded>
LYNX_HD Tile row_tile_at(const TileGrid& g, int32_t tile) {
  Tile t;
  int32_t first_block = 0, blocks = first_block_of<kFolded>(g, g.experts), local = tile;
  if (g.expert_groups) {
    // B_e · tiles_n <= tile < B_e+1 · tiles_n  <=>  B_e <= tile / tiles_n < B_e+1
    const int32_t e = expert_of_block<kFolded>(g, tile / g.tiles_n);
    first_block = first_block_of<kFolded>(g, e);
    blocks = first_block_of<kFolded>(g, e + 1) - first_block;
    local = tile - first_block * g.tiles_n;
  }
  const int32_t per_group = g.group_rows * g.tiles_n;
  const int32_t first = local / per_group * g.group_rows, r = local % per_group;
  const int32_t rows = g.group_rows < blocks - first ? g.group_rows : blocks - first;
  const int32_t block = first_block + first + r % rows;
  if (kFolded) {
    t.expert = expert_of_block<true>(g, block);
    t.a_row = g.expert_offset[t.expert] + (block - g.block_offset[t.expert]) * kBlockM;
  } else {
    t.a_row = block * kBlockM;
    t.expert = expert_of_row(g.expert_offset, g.experts, t.a_row);
  }
  t.b_row = (r / rows) * g.block_n;
  const int32_t left = g.expert_rows ? g.expert_rows[t.expert] - (t.a_row - g.expert_offset[t.expert]) : kBlockM;
  t.rows = left < kBlockM ? left : kBlockM;
  // Rows past the expert's last row block among the tiles' are its folded tail.
  t.fold = kFolded && left > kBlockM && block + 1 == g.block_offset[t.expert + 1] ? left - kBlockM : 0;
  t.k0 = 0;
  t.k_blocks = g.k_blocks;
  return t;
}

// Tile `tile`. Row modes: grouped raster. Row blocks go in groups of `group_rows`; within a group the
// column blocks are outermost, so a wave of concurrent CTAs covers a few row blocks × many column
// blocks and reads each weight tile once for the whole group while it is in L2 (group_rows = 1:
// m-major). With `expert_groups` no group reaches into the next expert: expert e's tiles are
// [B_e · tiles_n, B_e+1 · tiles_n) of the launch (B_e = its first row block) and its last group may be
// smaller; without, groups are all `group_rows` blocks (the launch's last one excepted) and may straddle
// experts. Weight grad: expert-major, m-major within an expert.
LYNX_HD Tile tile_at(const TileGrid& g, int32_t tile) {
  if (!g.weight_grad) return g.block_offset ? row_tile_at<true>(g, tile) : row_tile_at<false>(g, tile);
  Tile t;
  const int32_t mn = tile / g.tiles_n;
  t.b_row = (tile % g.tiles_n) * g.block_n;
  t.expert = mn / g.tiles_m;
  t.a_row = (mn % g.tiles_m) * kBlockM;
  t.k0 = g.expert_offset[t.expert];
  // A schedule over capacity placed no rows: every weight gradient is zero.
  // NOTES: the padded block's K blocks past the expert's rows hold only zeros (padding rows), which
  // add nothing: at deepseek-v3 (128 ± 11 rows per expert, half of the experts padded to 256) they
  // are 17% of the weight gradients' K.
  const bool overflow = g.expert_offset[g.experts] > g.capacity;
  const int32_t padded = g.expert_offset[t.expert + 1] - t.k0;
  const int32_t rows = g.expert_rows ? g.expert_rows[t.expert] : padded;
  t.k_blocks = overflow ? 0 : (rows + kBlockK - 1) / kBlockK;
  t.rows = rows;
  t.fold = 0;
  return t;
}

// A half tile (row modes): the block's rows 64-127 are all padding. Consumer warpgroup 1 computes
// nothing for it, and the producer loads only rows 0-63 of A.
LYNX_HD bool half_tile(const Tile& t) { return t.rows <= kBlockM / 2; }

// Row modes: consumer warpgroup `wg` (0 or 1, rows 64·wg .. 64·wg + 63 of the tile) computes its
// products with the operands swapped, the weight tile as wgmma's M and its rows as N = 16, when it
// holds 1 to 16 rows. NOTES: m64 is wgmma's smallest M, so a warpgroup with a few rows otherwise
// multiplies 48-63 padding rows (zeros) by the whole weight tile. Those products cost no time where
// the loads bound the launch, but they cost energy, and under the H200's power cap energy is time:
// skipping them took 4.1% off deepseek-v3's capped forward, whose experts' last blocks hold ~9 rows
// (measured 2026-12-02, commit 7daebf7). Swapped, a k16 step multiplies 16 rows:
// −1.3% there (section 2); the rest of that bound is the weight tile's reads out of shared memory,
// which the swapped products still make.
constexpr int32_t kSwappedRows = 16;
LYNX_HD bool swapped_products(const Tile& t, int wg) {
  const int32_t rows = t.rows - 64 * wg;
  return rows >= 1 && rows <= kSwappedRows;
}

// Weight grad: the 16-row steps (wgmma k16) of the tile's last K block that hold rows (1 .. 4); the
// steps past them read only padding rows, zeros that add nothing. NOTES: K is an expert's rows, a
// count that 64-row K blocks round up by 32 on average: a quarter of deepseek-v3's K (128 ± 11 rows
// per expert), 6% of qwen3-30b-a3b's (512 ± 23). Skipping a product of zeros can only turn an
// exactly-zero sum's -0 into +0 or back; the result stays deterministic.
constexpr int32_t kStepK = 16;
LYNX_HD int32_t last_k_steps(const Tile& t) {
  return t.rows > 0 ? ((t.rows - 1) % kBlockK) / kStepK + 1 : kBlockK / kStepK;
}

// ---- cluster units (row modes) ----
// The row modes run as clusters of two CTAs that walk the tiles in units: unit u is tiles 2u (cluster
// rank 0) and 2u + 1 (rank 1). When the two tiles read an operand in common, each CTA loads half of it
// into both CTAs' shared memory (TMA multicast), so the pair reads it from L2 once and at the same
// moment. NOTES: in tile_at's raster, neighbouring tiles are neighbouring row blocks of one column
// block (the weight tile in common) or, in a group of one row block, neighbouring column blocks of
// one row block (the A block in common). At deepseek-v3 (1-2 row blocks per expert) the CTAs that
// shared a weight tile without clusters started a median 6.4 µs apart, time in which the GPU loads
// ~42 MB, so the second read of ~half of them missed L2: gate/up read 19.8 GB from DRAM for ~15.6
// needed (measured 2026-11-29, commit 27164ab).
enum class Shared : int32_t { kNone = 0, kA = 1, kB = 2 };

LYNX_HD Shared shared_operand(const Tile& t0, const Tile& t1) {
  if (t0.k0 != t1.k0 || t0.k_blocks != t1.k_blocks) return Shared::kNone;
  if (t0.expert == t1.expert && t0.b_row == t1.b_row) return Shared::kB;
  if (t0.a_row == t1.a_row) return Shared::kA;
  return Shared::kNone;
}

}  // namespace lynx::gemm
