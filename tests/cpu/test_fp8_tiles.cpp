// The block-scaled FP8 GEMM's tiles (kernels/fp8/tiles.h) on random padded schedules: every output
// element computed by exactly one tile and half, the halves that exist, the bytes a stage loads and the
// B scale blocks each half reads.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kernels/fp8/tiles.h"

namespace lynx::fp8::impl {
namespace {

// Padded expert offsets (each expert's rows rounded up to whole 128-row blocks; some experts empty).
std::vector<int32_t> random_offsets(std::mt19937& rng, int32_t experts, int32_t max_rows) {
  std::vector<int32_t> offsets(size_t(experts + 1), 0);
  for (int32_t e = 0; e < experts; ++e) {
    const int32_t n = rng() % 4 == 0 ? 0 : int32_t(rng() % uint32_t(max_rows + 1));
    offsets[size_t(e + 1)] = offsets[size_t(e)] + (n + kTileM - 1) / kTileM * kTileM;
  }
  return offsets;
}

// The columns of N that half h of `tile` computes: [first, end).
template <Form kForm>
std::pair<int32_t, int32_t> half_columns(const Tile& tile, int h, int32_t N) {
  const int32_t first = kForm == Form::kSwiGLU ? tile.n0 : tile.n0 + h * kTileN;  // gate/up: h is gate or up
  return {first, std::min(N, first + kTileN)};
}

// In pairs (n_tiles even, so that every expert's tiles start at an even index): tiles 2u and 2u + 1 are
// the same expert's and columns in consecutive row blocks wherever the expert has a row block left
// for the second, and else the same block's neighbouring column tiles.
template <Form kForm>
void expect_pairs(const TileSpace<kForm>& tiles, const std::vector<int32_t>& offsets) {
  int32_t shared_b = 0, expected_b = 0;
  for (size_t e = 0; e + 1 < offsets.size(); ++e) expected_b += (offsets[e + 1] - offsets[e]) / kTileM / 2 * tiles.n_tiles;
  for (int32_t t = 0; t + 1 < tiles.count; t += 2) {
    const Tile a = tiles[t], b = tiles[t + 1];
    ASSERT_EQ(a.expert, b.expert) << "tile " << t;
    if (a.m0 != b.m0) {
      ASSERT_EQ(a.n0, b.n0) << "tile " << t;
      ASSERT_EQ(b.m0, a.m0 + kTileM) << "tile " << t;
      ++shared_b;
    } else {
      ASSERT_EQ(b.n0, a.n0 + kOutN<kForm>) << "tile " << t;
    }
  }
  EXPECT_EQ(shared_b, expected_b);
}

// Every (row block, column) of the grouped forms' output computed once, by the tile of the row block's
// expert; a half computed exactly where it holds a column below N; its stage's bytes; its B scales.
// pair_rows: the same, in pairs of an expert's row blocks (expect_pairs).
template <Form kForm>
void expect_grouped_tiles(std::mt19937& rng, int trial, bool pair_rows = false) {
  const int32_t experts = 1 + int32_t(rng() % 24);
  const std::vector<int32_t> offsets = random_offsets(rng, experts, 600);
  const int32_t total = offsets[size_t(experts)];
  const int32_t capacity = trial % 7 == 0 && total > 0 ? total - kTileM : total + kTileM * int32_t(rng() % 3);
  const int32_t N = 8 * (1 + int32_t(rng() % 400)), K = 16 * (1 + int32_t(rng() % 300));
  SCOPED_TRACE("trial " + std::to_string(trial) + " N " + std::to_string(N) + " K " + std::to_string(K) +
               " total " + std::to_string(total) + " capacity " + std::to_string(capacity));
  const TileSpace<kForm> tiles(capacity, N, K, offsets.data(), experts, pair_rows);
  if (total > capacity) {  // a schedule over capacity placed no rows: no tiles
    EXPECT_EQ(tiles.count, 0);
    return;
  }
  const int32_t blocks = total / kTileM, k_blocks = int32_t(blocks_of(K));
  ASSERT_EQ(tiles.m_tiles, blocks);
  // The outputs: [row block, column] (gate/up: [row block, g or u, column], each tile's two halves the
  // same columns of g and u).
  constexpr size_t kParts = kForm == Form::kSwiGLU ? 2 : 1;
  std::vector<int> hits(size_t(blocks) * kParts * size_t(N), 0);
  const auto hit = [&](const Tile& tile, int h, int32_t c) -> int& {
    const size_t part = kParts == 2 ? size_t(h) : 0;
    return hits[(size_t(tile.m0 / kTileM) * kParts + part) * size_t(N) + size_t(c)];
  };
  for (int32_t t = 0; t < tiles.count; ++t) {
    const Tile tile = tiles[t];
    ASSERT_EQ(tile.m0 % kTileM, 0);
    ASSERT_LT(tile.m0, total);
    ASSERT_EQ(tile.n0 % kOutN<kForm>, 0);
    ASSERT_LT(tile.n0, N);
    ASSERT_TRUE(offsets[size_t(tile.expert)] <= tile.m0 && tile.m0 < offsets[size_t(tile.expert + 1)]);
    ASSERT_EQ(tile.kb_begin, 0);
    ASSERT_EQ(tile.kb_end, k_blocks);
    const bool second = second_half<kForm>(tile, N);
    for (int h = 0; h < 2; ++h) {
      const auto [first, end] = half_columns<kForm>(tile, h, N);
      if (h == 1 && kForm == Form::kGrouped) {  // computed exactly where it holds a column below N
        ASSERT_EQ(second, first < N);
      }
      // Half h's B scale block ([experts, blocks_of(N), k_blocks]): the block of its first column, or,
      // not computed, the first half's (the consumers load both halves' scales either way).
      const int64_t row = b_scale_row<kForm>(tile, N, k_blocks, h);
      ASSERT_LE(row + k_blocks, int64_t(experts) * blocks_of(N) * k_blocks);
      if (h == 1 && !second) {
        ASSERT_EQ(row, b_scale_row<kForm>(tile, N, k_blocks, 0));
        continue;
      }
      ASSERT_EQ(row, (int64_t(tile.expert) * blocks_of(N) + first / kBlock) * k_blocks);
      for (int32_t c = first; c < end; ++c) ++hit(tile, h, c);
    }
    ASSERT_EQ(stage_bytes<kForm>(tile, N), uint32_t((kTileM + (second ? 2 : 1) * kTileN) * kBlock));
  }
  for (size_t i = 0; i < hits.size(); ++i) ASSERT_EQ(hits[i], 1) << "output element " << i;
  if (pair_rows && tiles.n_tiles % 2 == 0) expect_pairs(tiles, offsets);
}

TEST(Fp8Tiles, GroupedCoverEveryOutputOnce) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 200; ++trial) expect_grouped_tiles<Form::kGrouped>(rng, trial);
}

TEST(Fp8Tiles, GateUpCoverEveryOutputOnce) {
  std::mt19937 rng(12);
  for (int trial = 0; trial < 200; ++trial) expect_grouped_tiles<Form::kSwiGLU>(rng, trial);
}

TEST(Fp8Tiles, PairedRowBlocksCoverEveryOutputOnceAndShareB) {
  std::mt19937 rng(14);
  for (int trial = 0; trial < 200; ++trial) {
    expect_grouped_tiles<Form::kGrouped>(rng, trial, true);
    expect_grouped_tiles<Form::kSwiGLU>(rng, trial, true);
  }
}

// The dense form's [128, 128] tiles cover [M, N] once; the weight gradient's [128, 256] ones (a second
// half where columns n0 + 128 .. lie below N) cover every expert's [M, N] once, with K the expert's row
// blocks (none over capacity).
TEST(Fp8Tiles, DenseAndWeightGradientFormsCoverEveryOutputOnce) {
  std::mt19937 rng(13);
  for (int trial = 0; trial < 100; ++trial) {
    const int32_t M = 1 + int32_t(rng() % 700), N = 8 * (1 + int32_t(rng() % 100)), K = 16 * (1 + int32_t(rng() % 80));
    SCOPED_TRACE("trial " + std::to_string(trial));
    const TileSpace<Form::kDense> dense(M, N, K, nullptr, 0);
    std::vector<int> hits(size_t(M) * size_t(N), 0);
    for (int32_t t = 0; t < dense.count; ++t) {
      const Tile tile = dense[t];
      ASSERT_FALSE(second_half<Form::kDense>(tile, N));
      ASSERT_EQ(stage_bytes<Form::kDense>(tile, N), uint32_t(2 * kTileN * kBlock));
      for (int32_t r = tile.m0; r < std::min(M, tile.m0 + kTileM); ++r) {
        for (int32_t c = tile.n0; c < std::min(N, tile.n0 + kTileN); ++c) ++hits[size_t(r) * size_t(N) + size_t(c)];
      }
    }
    for (size_t i = 0; i < hits.size(); ++i) ASSERT_EQ(hits[i], 1) << "dense output element " << i;

    const int32_t experts = 1 + int32_t(rng() % 8);
    const std::vector<int32_t> offsets = random_offsets(rng, experts, 500);
    const int32_t total = offsets[size_t(experts)];
    const int32_t capacity = trial % 5 == 0 && total > 0 ? total - kTileM : total + kTileM;
    const TileSpace<Form::kWeightGrad> wgrad(M, N, capacity, offsets.data(), experts);
    std::vector<int> per_expert(size_t(experts) * size_t(M) * size_t(N), 0);
    for (int32_t t = 0; t < wgrad.count; ++t) {
      const Tile tile = wgrad[t];
      const bool second = second_half<Form::kWeightGrad>(tile, N);
      ASSERT_EQ(second, tile.n0 + kTileN < N);
      ASSERT_EQ(stage_bytes<Form::kWeightGrad>(tile, N), uint32_t((second ? 3 : 2) * kTileN * kBlock));
      const bool placed = total <= capacity;
      ASSERT_EQ(tile.kb_begin, placed ? offsets[size_t(tile.expert)] / kTileM : 0);
      ASSERT_EQ(tile.kb_end, placed ? offsets[size_t(tile.expert + 1)] / kTileM : 0);
      for (int32_t r = tile.m0; r < std::min(M, tile.m0 + kTileM); ++r) {
        for (int32_t c = tile.n0; c < std::min(N, tile.n0 + (second ? 2 : 1) * kTileN); ++c) {
          ++per_expert[(size_t(tile.expert) * size_t(M) + size_t(r)) * size_t(N) + size_t(c)];
        }
      }
    }
    for (size_t i = 0; i < per_expert.size(); ++i) ASSERT_EQ(per_expert[i], 1) << "weight-gradient element " << i;
  }
}

}  // namespace
}  // namespace lynx::fp8::impl
