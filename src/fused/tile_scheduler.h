// The tile schedule of the expert GEMM kernel: which output tile a persistent CTA computes, with which
// K range. Compiles for host and device; the CPU tests check it on random schedules.
#pragma once

#include <cstdint>

#include "common/hd.h"

namespace lynx::fused {

constexpr int32_t kBlockM = 128;  // rows of an output tile (two consumer warpgroups × 64)
constexpr int32_t kBlockK = 64;   // K per pipeline stage: 64 bf16 = one 128-byte swizzle row

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
  int32_t group_rows = 1;  // row modes: row blocks per raster group (choose_group_rows)
};

// What one tile computes.
struct Tile {
  int32_t a_row;     // row modes: first schedule row; weight grad: first row of C (a column of A's buffer)
  int32_t b_row;     // first column of C (a row of B, or a column of an N-major B)
  int32_t k0;        // first K coordinate
  int32_t k_blocks;  // 0: an expert without rows (its weight-gradient tile is zero)
  int32_t expert;
};

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
LYNX_HD int32_t tile_count(const TileGrid& g) {
  if (g.weight_grad) return g.experts * g.tiles_m * g.tiles_n;
  const int32_t used = g.expert_offset[g.experts];
  return ((used <= g.capacity ? used : 0) / kBlockM) * g.tiles_n;
}

// Tile `tile`. Row modes: grouped raster. Row blocks go in groups of `group_rows`; within a group
// the column blocks are outermost, so a wave of concurrent CTAs covers a few row blocks × many column
// blocks and reads each weight tile for the whole group while it is in L2 (with group_rows = 1 the
// order is m-major). Weight grad: expert-major, m-major within an expert.
LYNX_HD Tile tile_at(const TileGrid& g, int32_t tile) {
  Tile t;
  if (g.weight_grad) {
    const int32_t mn = tile / g.tiles_n;
    t.b_row = (tile % g.tiles_n) * g.block_n;
    t.expert = mn / g.tiles_m;
    t.a_row = (mn % g.tiles_m) * kBlockM;
    t.k0 = g.expert_offset[t.expert];
    // A schedule over capacity placed no rows: every weight gradient is zero.
    const bool overflow = g.expert_offset[g.experts] > g.capacity;
    t.k_blocks = overflow ? 0 : (g.expert_offset[t.expert + 1] - t.k0) / kBlockK;
  } else {
    const int32_t used_blocks = g.expert_offset[g.experts] / kBlockM;
    const int32_t per_group = g.group_rows * g.tiles_n;
    const int32_t first = tile / per_group * g.group_rows, r = tile % per_group;
    const int32_t rows = g.group_rows < used_blocks - first ? g.group_rows : used_blocks - first;
    t.a_row = (first + r % rows) * kBlockM;
    t.b_row = (r / rows) * g.block_n;
    t.expert = expert_of_row(g.expert_offset, g.experts, t.a_row);
    t.k0 = 0;
    t.k_blocks = g.k_blocks;
  }
  return t;
}

// NOTES: the raster group of the row modes. A wave of S concurrent tiles covering G row blocks and
// S / G column blocks reads G A-blocks (128 × K) and S / G weight tiles (256 × K): the traffic is least
// near G = sqrt(2 S) ≈ 16 on 132 SMs. A group reaching into another expert shares no weights, so G
// stays within the row blocks an expert receives on average. Powers of two only.
inline int32_t choose_group_rows(int64_t routed_rows, int64_t experts) {
  const int64_t blocks_per_expert = experts > 0 ? routed_rows / experts / kBlockM : 0;
  int32_t g = 1;
  while (g < 16 && 2 * g <= blocks_per_expert) g *= 2;
  return g;
}

}  // namespace lynx::fused
