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

// Tile `tile`, in m-major order (the column blocks of one row block are consecutive, so concurrent
// CTAs share A rows and one expert's weights in L2); weight grad: expert-major.
LYNX_HD Tile tile_at(const TileGrid& g, int32_t tile) {
  Tile t;
  const int32_t mn = tile / g.tiles_n;
  t.b_row = (tile % g.tiles_n) * g.block_n;
  if (g.weight_grad) {
    t.expert = mn / g.tiles_m;
    t.a_row = (mn % g.tiles_m) * kBlockM;
    t.k0 = g.expert_offset[t.expert];
    // A schedule over capacity placed no rows: every weight gradient is zero.
    const bool overflow = g.expert_offset[g.experts] > g.capacity;
    t.k_blocks = overflow ? 0 : (g.expert_offset[t.expert + 1] - t.k0) / kBlockK;
  } else {
    t.a_row = mn * kBlockM;
    t.expert = expert_of_row(g.expert_offset, g.experts, t.a_row);
    t.k0 = 0;
    t.k_blocks = g.k_blocks;
  }
  return t;
}

}  // namespace lynx::fused
