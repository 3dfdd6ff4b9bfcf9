// The block-scaled FP8 GEMM's tiles (gemm/kernel.cuh): which output tile a persistent CTA computes, which
// of its 128-column halves exist, the bytes each K block's stage loads and the B scales each half reads.
// Compiles for host and device; the CPU tests check it (tests/cpu/test_fp8_tiles.cpp).
#pragma once

#include <cstdint>

#include "common/hd.h"
#include "kernels/expert_gemm/tile_scheduler.h"
#include "kernels/fp8/api.h"

namespace lynx::fp8::impl {

constexpr int kTileM = 128;  // output rows per CTA (two consumer warpgroups of 64)
constexpr int kTileN = 128;  // columns of one wgmma half of a tile: one B scale block

// What a CTA computes: kDense, a [128, 128] tile of A·Bᵀ; kGrouped, a [128, 256] one over one expert's
// rows of A in schedule order (M = the capacity) with B [experts, N, K] and its scales [experts, N
// blocks, K blocks]; kSwiGLU, grouped, a [128, 128] tile of h = silu(A·Gᵀ) ⊙ (A·Uᵀ): its two halves are
// the gate's 128 columns and the same 128 of the up's (B's stage holds both, tma_b and tma_b2), each
// promoted with its own block scale. A grouped row block past the schedule's rows has nothing to do.
// kWeightGrad, per expert a [128, 256] tile of Σ over its rows of A·Bᵀ, K being the
// schedule's rows: A [M, capacity] and B [N, capacity] are the transposed row buffers in 1×128 tiles
// along the rows (scales [capacity / 128, scale_pitch(M or N)]: B's scale is per column), the K loop
// runs over the expert's row blocks only (none: a zero tile).
enum class Form { kDense, kGrouped, kSwiGLU, kWeightGrad };

// NOTES: the grouped forms (the forward's GEMMs and the dgrads, the layer's bulk) take [128, 256] tiles:
// a K block's 48 KB of operands feed 4.2 M multiply-adds, where a [128, 128] tile's 32 KB feed 2.1 M,
// 27% fewer bytes from L2 for each product. At twice the bf16 rate a [128, 128] tile would need 1.33×
// the L2 bandwidth of the bf16 kernel's [128, 256] tiles (docs/fp8.md). Two temporaries of 128 columns
// beside a 256-column accumulator would be 256 registers a thread: one temporary takes each half in
// turn, and the other warpgroup's wgmma run while one promotes (as DeepGEMM's and CUTLASS's block-scaled
// kernels do).
// The weight gradient likewise: its K blocks are an expert's few row blocks (~4 at qwen3-30b-a3b), so
// a tile's operands stream from L2 with little reuse; at [128, 128] its GEMMs took as long as bf16's
// (H100, 2026-12-06, bench/results/2026-12-06-h100-63a71b0-kernels-log.txt), at [128, 256] 9% less
// (bench/results/2026-12-06-h100-3a8cd4b-fp8-wgrad-256-log.txt).
// The forms over the experts' rows in schedule order (a tile's rows are one expert's).
template <Form kForm>
constexpr bool kScheduleRows = kForm == Form::kGrouped || kForm == Form::kSwiGLU;
template <Form kForm>
constexpr int kHalves = kScheduleRows<kForm> || kForm == Form::kWeightGrad ? 2 : 1;  // 128-column halves a tile
// Output columns per tile (kSwiGLU: h's, each from a gate and an up column).
template <Form kForm>
constexpr int32_t kOutN = kForm == Form::kSwiGLU ? kTileN : kHalves<kForm> * kTileN;
// A stage's E4M3 bytes when every half is loaded.
template <Form kForm>
constexpr uint32_t kStageBytes = uint32_t((kTileM + kHalves<kForm> * kTileN) * kBlock);

// One output tile: its corner, its expert, and the K blocks it sums (none: a zero tile).
struct Tile {
  int32_t m0, n0, expert, kb_begin, kb_end;
};

// Whether a tile computes its second 128-column half: always for gate/up (the up's columns); for the
// grouped form and the weight gradient where columns n0 + 128 .. lie below N (the producer loads, and
// the consumers compute, only those that do).
template <Form kForm>
LYNX_HD bool second_half(const Tile& tile, int32_t N) {
  if constexpr (kHalves<kForm> == 1) return false;
  return kForm == Form::kSwiGLU || tile.n0 + kTileN < N;
}

// The E4M3 bytes of a tile's stage: A's 128 rows and B's rows of the halves it loads (boxes past M, N
// or K are zero-filled by the TMA and still count their whole bytes).
template <Form kForm>
LYNX_HD uint32_t stage_bytes(const Tile& tile, int32_t N) {
  return kStageBytes<kForm> - (kHalves<kForm> == 2 && !second_half<kForm>(tile, N) ? uint32_t(kTileN * kBlock) : 0u);
}

// The first of the K block scales of half h's B block ([experts, blocks_of(N), k_blocks]; the forward
// forms): block n0 / 128 + h of the grouped form (a half that is not computed reads the first half's),
// block n0 / 128 of gate/up (the gate's scales for h = 0, the up's, in their own array, for h = 1).
template <Form kForm>
LYNX_HD int64_t b_scale_row(const Tile& tile, int32_t N, int32_t k_blocks, int h) {
  const int64_t first = (int64_t(tile.expert) * blocks_of(N) + tile.n0 / kBlock) * k_blocks;
  return kForm == Form::kGrouped && h == 1 && second_half<kForm>(tile, N) ? first + k_blocks : first;
}

// The grid's tiles, linear index t: columns fastest (the CTAs working at once share A's row block and,
// grouped, its expert's B), then row blocks, then (kWeightGrad) experts. Grouped forms count only the
// row blocks below the schedule's rows (none after an overflow), read once per CTA. A tile's columns:
// kOutN from n0.
// With `pair_rows` (grouped forms), an expert's tiles go in groups of two of its row blocks (the last
// group of an odd count holds one): within a group the columns, and for each column the group's row
// blocks, so that tiles 2u and 2u + 1 of a two-block group read the same B tile. Expert e's tiles keep
// the indices [B_e · n_tiles, B_{e+1} · n_tiles) of the plain order (B_e: its first row block), so the
// expert of tile t is, in both orders, that of row block t / n_tiles (search_row). The pairs are tiles
// (2u, 2u + 1) where the expert's tiles start at an even index: always where n_tiles is even; else
// after an expert with an odd count of row blocks they are shifted by one, and such tiles share nothing.
// NOTES: the grid is persistent with an even number of CTAs (gemm.cu), CTA b taking tiles b, b + grid,
// ..., so such a pair runs on two CTAs at once, tile after tile, and the second read of each B block
// finds it in L2. In the plain order the row blocks of an expert that receives about one block's rows
// (deepseek-v3: T · k / E = 128, so about half the experts span two blocks) are n_tiles apart and
// stream the same weights at different times: there the FP8 gate/up GEMM moved ~1.25× its operands'
// bytes at 85% of the DRAM's rate and 97% of the L2's (H100, 2026-12-06, docs/fp8.md). In pairs the
// FP8 forward at deepseek-v3 took 5.05 ms against 5.61 plain (bf16 8.68), the same bits (H100,
// 2026-12-06, bench/results/2026-12-06-h100-4f8dcd8-fp8-row-pairs-log.txt). Tried and refuted there:
// each pair on a cluster of two CTAs that load one half of the shared B (or A) tile each and multicast
// it (branch fp8-multicast, 4f8dcd8): 5.15 ms, and 1.376-1.380 against 1.360-1.362 at 4096, 7168,
// 2048, 64 experts, k = 2; the L2 already serves the pair's second read.
template <Form kForm>
struct TileSpace {
  int32_t n_tiles, m_tiles, count;
  const int32_t* expert_offset;
  int32_t experts, k_blocks;
  bool pair_rows;

  LYNX_HD TileSpace(int32_t M, int32_t N, int32_t K, const int32_t* offset, int32_t num_experts,
                    bool pair_row_blocks = false)
      : expert_offset(offset),
        experts(num_experts),
        k_blocks(int32_t(blocks_of(K))),
        pair_rows(kScheduleRows<kForm> && pair_row_blocks) {
    n_tiles = (N + kOutN<kForm> - 1) / kOutN<kForm>;
    m_tiles = int32_t(blocks_of(M));
    if constexpr (kScheduleRows<kForm>) {
      const int32_t total = offset[num_experts];
      m_tiles = total > M ? 0 : int32_t(blocks_of(total));  // a schedule over capacity placed no rows
    }
    count = n_tiles * m_tiles * (kForm == Form::kWeightGrad ? num_experts : 1);
  }

  LYNX_HD Tile operator[](int32_t t) const {
    if constexpr (kScheduleRows<kForm>) {
      return at(t, gemm::expert_of_row(expert_offset, experts, search_row(t)));
    } else {
      return without_expert(t);
    }
  }

  // The grouped forms: a row of tile t's expert, and tile t of that expert.
  LYNX_HD int32_t search_row(int32_t t) const { return t / n_tiles * kTileM; }
  LYNX_HD Tile at(int32_t t, int32_t expert) const {
    Tile tile = without_expert(t);
    tile.expert = expert;
    if (pair_rows) {
      const int32_t first = expert_offset[expert] / kTileM, blocks = expert_offset[expert + 1] / kTileM - first;
      const int32_t local = t - first * n_tiles, group = local / (2 * n_tiles), i = local - group * 2 * n_tiles;
      const int32_t rows = blocks - 2 * group < 2 ? 1 : 2;  // the group's row blocks
      tile.n0 = i / rows * kOutN<kForm>;
      tile.m0 = (first + 2 * group + i % rows) * kTileM;
    }
    return tile;
  }

  // Tile t but, in the grouped forms, its expert (0) and, with pair_rows, its corner in the plain order.
  LYNX_HD Tile without_expert(int32_t t) const {
    Tile tile;
    tile.n0 = (t % n_tiles) * kOutN<kForm>;
    tile.m0 = (t / n_tiles % m_tiles) * kTileM;
    tile.expert = 0;
    tile.kb_begin = 0;
    tile.kb_end = k_blocks;
    if constexpr (kForm == Form::kWeightGrad) {
      // The expert's row blocks (its rows are padded to whole blocks); none over capacity: a zero tile.
      tile.expert = t / (n_tiles * m_tiles);
      const bool placed = expert_offset[experts] <= k_blocks * int32_t(kBlock);
      tile.kb_begin = placed ? expert_offset[tile.expert] / int32_t(kBlock) : 0;
      tile.kb_end = placed ? expert_offset[tile.expert + 1] / int32_t(kBlock) : 0;
    }
    return tile;
  }
};

}  // namespace lynx::fp8::impl
