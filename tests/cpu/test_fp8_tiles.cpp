// The block-scaled FP8 GEMM's tiles (kernels/fp8/tiles.h) on random padded schedules: every output
// element computed by exactly one tile and half, the halves that exist, the bytes a stage loads and the
// B scale blocks each half reads; and a model of the kernel's ring of stages over a CTA's tiles.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels/fp8/tiles.h"

namespace lynx::fp8::impl {
namespace {

// Padded expert offsets (each expert's rows rounded up to whole 128-row blocks; some experts empty) and,
// in `half_blocks`, the schedule's half_block_offset (stated here without schedule/core.h: the experts
// before e whose last block holds 1-64 rows).
std::vector<int32_t> random_offsets(std::mt19937& rng, int32_t experts, int32_t max_rows,
                                    std::vector<int32_t>* half_blocks = nullptr) {
  std::vector<int32_t> offsets(size_t(experts + 1), 0), halves(size_t(experts + 1), 0);
  for (int32_t e = 0; e < experts; ++e) {
    const int32_t n = rng() % 4 == 0 ? 0 : int32_t(rng() % uint32_t(max_rows + 1));
    offsets[size_t(e + 1)] = offsets[size_t(e)] + (n + kTileM - 1) / kTileM * kTileM;
    halves[size_t(e + 1)] = halves[size_t(e)] + (n % kTileM >= 1 && n % kTileM <= 64 ? 1 : 0);
  }
  if (half_blocks != nullptr) *half_blocks = halves;
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

// Every (64-row half of a row block, column) of the grouped forms' output computed once, by a warpgroup
// of a tile of the row block's expert; a half computed exactly where it holds a column below N; its
// stage's bytes; its B scales. pair_rows: the same, in pairs of an expert's row blocks (expect_pairs).
// wide: with the schedule's half blocks, each computed in wide tiles, their second 64 rows by none, an
// expert's tiles after those of the experts before it.
template <Form kForm>
void expect_grouped_tiles(std::mt19937& rng, int trial, bool pair_rows = false, bool wide = false) {
  const int32_t experts = 1 + int32_t(rng() % 24);
  std::vector<int32_t> half_blocks;
  const std::vector<int32_t> offsets = random_offsets(rng, experts, 600, &half_blocks);
  const int32_t total = offsets[size_t(experts)];
  const int32_t capacity = trial % 7 == 0 && total > 0 ? total - kTileM : total + kTileM * int32_t(rng() % 3);
  const int32_t N = 8 * (1 + int32_t(rng() % 400)), K = 16 * (1 + int32_t(rng() % 300));
  SCOPED_TRACE("trial " + std::to_string(trial) + " N " + std::to_string(N) + " K " + std::to_string(K) +
               " total " + std::to_string(total) + " capacity " + std::to_string(capacity));
  const TileSpace<kForm> tiles(capacity, N, K, offsets.data(), experts, pair_rows, wide ? half_blocks.data() : nullptr);
  if (total > capacity) {  // a schedule over capacity placed no rows: no tiles
    EXPECT_EQ(tiles.count, 0);
    return;
  }
  const int32_t blocks = total / kTileM, k_blocks = int32_t(blocks_of(K));
  ASSERT_EQ(tiles.m_tiles, blocks);
  const bool wide_tiles = wide && !pair_rows;
  ASSERT_EQ(tiles.count, tiles.n_tiles * blocks - (wide_tiles ? tiles.n_tiles / 2 * half_blocks[size_t(experts)] : 0));
  // The row blocks that are half blocks (an expert's last, holding 1-64 rows).
  std::vector<bool> half_block(size_t(blocks), false);
  for (int32_t e = 0; e < experts; ++e) {
    if (half_blocks[size_t(e + 1)] > half_blocks[size_t(e)]) half_block[size_t(offsets[size_t(e + 1)] / kTileM - 1)] = true;
  }
  // The outputs: [64-row half of a row block, column] (gate/up: [half, g or u, column], each tile's two
  // halves the same columns of g and u).
  constexpr size_t kParts = kForm == Form::kSwiGLU ? 2 : 1;
  std::vector<int> hits(size_t(2 * blocks) * kParts * size_t(N), 0);
  const auto hit = [&](int32_t row, int h, int32_t c) -> int& {
    const size_t part = kParts == 2 ? size_t(h) : 0;
    return hits[(size_t(row / 64) * kParts + part) * size_t(N) + size_t(c)];
  };
  int32_t last_expert = 0;
  for (int32_t t = 0; t < tiles.count; ++t) {
    const Tile tile = tiles[t];
    ASSERT_EQ(tile.m0 % kTileM, 0);
    ASSERT_LT(tile.m0, total);
    ASSERT_EQ(tile.n0 % kOutN<kForm>, 0);
    ASSERT_LT(tile.n0, N);
    ASSERT_TRUE(offsets[size_t(tile.expert)] <= tile.m0 && tile.m0 < offsets[size_t(tile.expert + 1)]);
    ASSERT_EQ(tile.kb_begin, 0);
    ASSERT_EQ(tile.kb_end, k_blocks);
    ASSERT_GE(tile.expert, last_expert) << "tile " << t;
    last_expert = tile.expert;
    // Wide exactly on half blocks (with wide tiles), two parts but where one column tile is left.
    const bool on_half = half_block[size_t(tile.m0 / kTileM)];
    ASSERT_EQ(tile.wide > 0, wide_tiles && on_half) << "tile " << t;
    if (tile.wide > 0) {
      ASSERT_EQ(tile.n0 % (2 * kOutN<kForm>), 0);
      ASSERT_EQ(tile.wide, std::min(2, tiles.n_tiles - tile.n0 / kOutN<kForm>));
    }
    ASSERT_EQ(stages_per_block(tile), std::max(1, tile.wide));
    Tile unpacked{0, tile.n0, tile.expert, tile.kb_begin, tile.kb_end, -1};
    unpack_m0_wide(pack_m0_wide(tile), unpacked);
    ASSERT_EQ(std::tie(unpacked.m0, unpacked.wide), std::tie(tile.m0, tile.wide)) << "tile " << t;
    for (int c = 0; c < 2; ++c) {
      ASSERT_EQ(computes(tile, c), tile.wide != 1 || c == 0);
      if (!computes(tile, c)) continue;
      const Tile part = part_of<kForm>(tile, c);
      ASSERT_EQ(part.n0, tile.n0 + (tile.wide > 0 ? c * kOutN<kForm> : 0));
      ASSERT_LT(part.n0, N);
      const int32_t row = first_row(part, c);
      ASSERT_EQ(row, tile.m0 + (tile.wide > 0 ? 0 : 64 * c));
      const bool second = second_half<kForm>(part, N);
      for (int h = 0; h < 2; ++h) {
        const auto [first, end] = half_columns<kForm>(part, h, N);
        if (h == 1 && kForm == Form::kGrouped) {  // computed exactly where it holds a column below N
          ASSERT_EQ(second, first < N);
        }
        // Half h's B scale block ([experts, blocks_of(N), k_blocks]): the block of its first column, or,
        // not computed, the first half's (the consumers load both halves' scales either way).
        const int64_t scales = b_scale_row<kForm>(part, N, k_blocks, h);
        ASSERT_LE(scales + k_blocks, int64_t(experts) * blocks_of(N) * k_blocks);
        if (h == 1 && !second) {
          ASSERT_EQ(scales, b_scale_row<kForm>(part, N, k_blocks, 0));
          continue;
        }
        ASSERT_EQ(scales, (int64_t(tile.expert) * blocks_of(N) + first / kBlock) * k_blocks);
        for (int32_t col = first; col < end; ++col) ++hit(row, h, col);
      }
      ASSERT_EQ(stage_bytes<kForm>(part, N), uint32_t((kTileM + (second ? 2 : 1) * kTileN) * kBlock));
    }
  }
  // Once each, but a half block's second 64 rows: by none in wide tiles.
  for (size_t i = 0; i < hits.size(); ++i) {
    const size_t half = i / (kParts * size_t(N));
    const bool skipped = wide_tiles && half % 2 == 1 && half_block[half / 2];
    ASSERT_EQ(hits[i], skipped ? 0 : 1) << "output element " << i;
  }
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

TEST(Fp8Tiles, WideTilesCoverEveryOutputOnceButHalfBlocksSecondRows) {
  std::mt19937 rng(15);
  for (int trial = 0; trial < 200; ++trial) {
    expect_grouped_tiles<Form::kGrouped>(rng, trial, false, true);
    expect_grouped_tiles<Form::kSwiGLU>(rng, trial, false, true);
  }
}

TEST(Fp8Tiles, PairedRowBlocksTakeNoWideTiles) {
  std::mt19937 rng(16);
  for (int trial = 0; trial < 100; ++trial) {
    expect_grouped_tiles<Form::kGrouped>(rng, trial, true, true);
    expect_grouped_tiles<Form::kSwiGLU>(rng, trial, true, true);
  }
}

TEST(Fp8Tiles, PairedRowBlocksCoverEveryOutputOnceAndShareB) {
  std::mt19937 rng(14);
  for (int trial = 0; trial < 200; ++trial) {
    expect_grouped_tiles<Form::kGrouped>(rng, trial, true);
    expect_grouped_tiles<Form::kSwiGLU>(rng, trial, true);
  }
}

// ---- the ring of stages (gemm/producer.cuh, gemm/kernel.cuh, gemm/mainloop.cuh) ----
// The producer fills the stages of a CTA's tiles in order (K block i of a tile: stages_per_block of them,
// part by part); stage g (counted over the CTA's run) goes to slot g % S, its round g / S. Each slot has
// a full barrier (the producer's arrival and its TMA bytes) and an empty one (every consumer thread's
// arrival: two units here, a warpgroup's 128 threads one unit). A wait sees a phase's parity only. The
// model interleaves the producer, the landing of any stage in flight (in any order) and the two
// consumer warpgroups at random, and reports the first wait that passes on a phase other than the one it
// is meant for, a stage refilled before each consumer has released it, an arrival past a phase's count,
// or a deadlock.

// One consumer warpgroup's step: wait for stage `fill`, then release it with `units` arrivals.
struct RingStep {
  int32_t fill;
  int units;
};

// How a consumer warpgroup takes a tile's stages.
enum class RingRule {
  kKernel,       // every stage in turn, one arrival each (those it computes nothing from too)
  kOwnPartOnly,  // 1dd4993: of a wide tile of two parts, only its part's, each released alone (two units)
  kSkipUnused,   // 9f7fe63: a wide tile's stages, of one part too, only by the warpgroup of their part (two units)
};

// Warpgroup c's steps over `tiles` (a CTA's, in order). kKernel as the kernel takes them: a tile it
// computes nothing of passed on whole (kernel.cuh); else, per K block, the parts' stages in order, its
// own (computes_part) where mainloop() computes it from, the other's passed on.
std::vector<RingStep> consumer_steps(const std::vector<Tile>& tiles, int c, RingRule rule) {
  std::vector<RingStep> steps;
  int32_t it = 0;
  for (const Tile& tile : tiles) {
    const int32_t stride = stages_per_block(tile), n = tile.kb_end - tile.kb_begin;
    for (int32_t i = 0; i < n; ++i) {
      for (int part = 0; part < stride; ++part) {
        const int32_t fill = it + stride * i + part;
        const bool own = computes(tile, c) && computes_part(tile, c, part);
        if (own) {
          EXPECT_EQ(fill, it + (tile.wide > 0 ? c : 0) + stride * i) << "mainloop's stage of K block " << i;
        }
        if (rule == RingRule::kKernel || tile.wide == 0) {
          steps.push_back({fill, 1});
        } else if (tile.wide == 2 || rule == RingRule::kSkipUnused) {
          if (own) steps.push_back({fill, 2});
        } else {
          steps.push_back({fill, 1});
        }
      }
    }
    it += n * stride;
  }
  return steps;
}

// One run of the ring over `tiles` with S slots, interleaved by `rng`: "" if it held, else what failed.
// in_order: the stages land in the order issued.
std::string run_ring(const std::vector<Tile>& tiles, int S, RingRule rule, std::mt19937& rng, bool in_order) {
  int32_t fills = 0;
  for (const Tile& tile : tiles) fills += (tile.kb_end - tile.kb_begin) * stages_per_block(tile);
  const std::vector<RingStep> steps[2] = {consumer_steps(tiles, 0, rule), consumer_steps(tiles, 1, rule)};
  std::vector<int32_t> full_phases(size_t(S), 0), empty_phases(size_t(S), 0), empty_pending(size_t(S), 2);
  std::vector<int32_t> released(size_t(fills), 0), in_flight;
  std::vector<bool> landing(size_t(S), false);
  size_t next[2] = {0, 0};
  bool waited[2] = {false, false};  // the warpgroup has passed its next step's wait
  int32_t issued = 0;
  // A wait for a barrier's phase `round` given `phases` completed (sm90::mbarrier_wait's parity).
  const auto passes = [](int32_t phases, int32_t round) { return (phases & 1) != (round & 1); };
  for (;;) {
    // The agents that can move: 0 the producer, 1 a landing, 2 and 3 the consumer warpgroups.
    std::vector<int> ready;
    if (issued < fills && (issued < S || passes(empty_phases[size_t(issued % S)], issued / S - 1))) ready.push_back(0);
    if (!in_flight.empty()) ready.push_back(1);
    for (int c = 0; c < 2; ++c) {
      if (next[c] == steps[c].size()) continue;
      const int32_t g = steps[c][next[c]].fill;
      if (waited[c] || passes(full_phases[size_t(g % S)], g / S)) ready.push_back(2 + c);
    }
    if (ready.empty()) {
      if (issued == fills && in_flight.empty() && next[0] == steps[0].size() && next[1] == steps[1].size()) return "";
      return "deadlock at stage " + std::to_string(issued);
    }
    const int agent = ready[rng() % ready.size()];
    if (agent == 0) {
      const int32_t g = issued++, s = g % S;
      const std::string stage = "stage " + std::to_string(g);
      if (g >= S && empty_phases[size_t(s)] != g / S) return "the producer's wait for " + stage + " passed on another phase";
      if (g >= S && released[size_t(g - S)] != 2) return stage + " filled before its slot's previous stage was released";
      if (landing[size_t(s)]) return stage + " filled while its slot's previous stage still lands";
      landing[size_t(s)] = true;
      in_flight.push_back(g);
    } else if (agent == 1) {
      const size_t k = in_order ? 0 : rng() % in_flight.size();
      const int32_t s = in_flight[k] % S;
      in_flight.erase(in_flight.begin() + std::ptrdiff_t(k));
      landing[size_t(s)] = false;
      ++full_phases[size_t(s)];
    } else {
      const int c = agent - 2;
      const RingStep step = steps[c][next[c]];
      const int32_t s = step.fill % S;
      if (!waited[c]) {
        if (full_phases[size_t(s)] != step.fill / S + 1) {
          return "warpgroup " + std::to_string(c) + "'s wait for stage " + std::to_string(step.fill) +
                 " passed on another phase";
        }
        waited[c] = true;
      } else {
        released[size_t(step.fill)] += step.units;
        empty_pending[size_t(s)] -= step.units;
        if (empty_pending[size_t(s)] < 0) return "arrivals past the count at stage " + std::to_string(step.fill);
        if (empty_pending[size_t(s)] == 0) {
          ++empty_phases[size_t(s)];
          empty_pending[size_t(s)] = 2;
        }
        waited[c] = false;
        ++next[c];
      }
    }
  }
}

// CTA b's tiles of a grid of `grid` CTAs: the producer's (tiles[t]), checked against the consumers' (the
// batch's fields, packed as kernel.cuh carries them, and every K block).
template <Form kForm>
std::vector<Tile> cta_tiles(const TileSpace<kForm>& tiles, int32_t b, int32_t grid) {
  std::vector<Tile> out;
  for (int32_t t = b; t < tiles.count; t += grid) {
    const Tile found = tiles[t];
    Tile consumer{0, found.n0, found.expert, 0, tiles.k_blocks, 0};
    unpack_m0_wide(pack_m0_wide(found), consumer);
    EXPECT_EQ(std::tie(consumer.m0, consumer.n0, consumer.expert, consumer.kb_begin, consumer.kb_end, consumer.wide),
              std::tie(found.m0, found.n0, found.expert, found.kb_begin, found.kb_end, found.wide))
        << "tile " << t;
    out.push_back(found);
  }
  return out;
}

// The first failure of `runs` interleavings of CTA b's ring, "" if none.
template <Form kForm>
std::string first_ring_failure(const TileSpace<kForm>& tiles, int32_t b, int32_t grid, int S, RingRule rule, int runs,
                               std::mt19937& rng, bool in_order = false) {
  const std::vector<Tile> cta = cta_tiles(tiles, b, grid);
  for (int r = 0; r < runs; ++r) {
    const std::string failure = run_ring(cta, S, rule, rng, in_order);
    if (!failure.empty()) return failure;
  }
  return "";
}

// The kernel's ring holds on random schedules in wide tiles (and plain, and paired), both forms, rings of
// 2-6 slots (the grouped form has 3, gate/up 4: gemm/storage.cuh), several tiles a CTA; and at
// qwen3-30b-a3b's da (128 experts of ~256 rows, half of them ending in a half block; N = I = 768, three
// column tiles: a wide tile of one part after each of two; K = H = 2048, 16 K blocks; 132 CTAs). The
// earlier rules fail: a warpgroup taking only its part's stages of a wide tile (1dd4993), there and at
// qwen3-30b-a3b's dx (N = H = 2048, K = 2I = 1536: wide tiles of two parts only), though not where the
// stages land in the order issued; and one skipping a wide tile of one part (9f7fe63), however they land.
TEST(Fp8Tiles, RingTakesEveryStageInOrder) {
  std::mt19937 rng(17);
  for (int trial = 0; trial < 60; ++trial) {
    const int32_t experts = 1 + int32_t(rng() % 8);
    std::vector<int32_t> half_blocks;
    const std::vector<int32_t> offsets = random_offsets(rng, experts, 600, &half_blocks);
    const int32_t N = 8 * (1 + int32_t(rng() % 160)), K = 128 * (1 + int32_t(rng() % 18));
    const int32_t grid = 1 + int32_t(rng() % 6);
    const int S = 2 + trial % 5;
    const int mode = trial % 3;  // wide tiles, plain, paired
    SCOPED_TRACE("trial " + std::to_string(trial) + " N " + std::to_string(N) + " K " + std::to_string(K) +
                 " grid " + std::to_string(grid) + " slots " + std::to_string(S));
    const int32_t* halves = mode == 0 ? half_blocks.data() : nullptr;
    const TileSpace<Form::kGrouped> grouped(offsets[size_t(experts)], N, K, offsets.data(), experts, mode == 2, halves);
    const TileSpace<Form::kSwiGLU> gate_up(offsets[size_t(experts)], N, K, offsets.data(), experts, mode == 2, halves);
    for (int32_t b = 0; b < std::min(grid, 3); ++b) {
      EXPECT_EQ(first_ring_failure(grouped, b, grid, S, RingRule::kKernel, 4, rng), "") << "grouped, CTA " << b;
      EXPECT_EQ(first_ring_failure(gate_up, b, grid, S, RingRule::kKernel, 4, rng), "") << "gate/up, CTA " << b;
    }
  }

  // qwen3-30b-a3b: T = 4096, k = 8, 128 experts of 256 ± 40 rows, half of them ending in a half block.
  constexpr int32_t kExperts = 128;
  std::vector<int32_t> offsets(kExperts + 1, 0), halves(kExperts + 1, 0);
  for (int32_t e = 0; e < kExperts; ++e) {
    const int32_t rows = 216 + int32_t(rng() % 81);
    offsets[size_t(e + 1)] = offsets[size_t(e)] + (rows + kTileM - 1) / kTileM * kTileM;
    halves[size_t(e + 1)] = halves[size_t(e)] + (rows % kTileM >= 1 && rows % kTileM <= 64 ? 1 : 0);
  }
  const int32_t capacity = offsets[kExperts] + 64 * kTileM;
  ASSERT_GT(offsets[kExperts], 32 * 1024);
  ASSERT_GT(halves[kExperts], kExperts / 4);
  const TileSpace<Form::kGrouped> da(capacity, 768, 2048, offsets.data(), kExperts, false, halves.data());
  const TileSpace<Form::kGrouped> dx(capacity, 2048, 1536, offsets.data(), kExperts, false, halves.data());
  int32_t one_part = 0, rules_found[2] = {0, 0}, skip_found_in_order = 0;
  bool own_part_fails_dx = false;
  for (int32_t b = 0; b < 132; ++b) {
    const std::vector<Tile> cta = cta_tiles(da, b, 132);
    bool wide = false;
    for (const Tile& tile : cta) {
      one_part += tile.wide == 1;
      wide = wide || tile.wide > 0;
    }
    ASSERT_GE(cta.size(), 4u);
    EXPECT_EQ(first_ring_failure(da, b, 132, 3, RingRule::kKernel, 8, rng), "") << "da, CTA " << b;
    EXPECT_EQ(first_ring_failure(dx, b, 132, 3, RingRule::kKernel, 8, rng), "") << "dx, CTA " << b;
    if (!wide) continue;
    rules_found[0] += !first_ring_failure(da, b, 132, 3, RingRule::kOwnPartOnly, 8, rng).empty();
    rules_found[1] += !first_ring_failure(da, b, 132, 3, RingRule::kSkipUnused, 8, rng).empty();
    EXPECT_EQ(first_ring_failure(da, b, 132, 3, RingRule::kOwnPartOnly, 8, rng, true), "") << "da in order, CTA " << b;
    EXPECT_EQ(first_ring_failure(dx, b, 132, 3, RingRule::kOwnPartOnly, 8, rng, true), "") << "dx in order, CTA " << b;
    skip_found_in_order += !first_ring_failure(da, b, 132, 3, RingRule::kSkipUnused, 8, rng, true).empty();
    own_part_fails_dx = own_part_fails_dx || !first_ring_failure(dx, b, 132, 3, RingRule::kOwnPartOnly, 8, rng).empty();
  }
  EXPECT_GT(one_part, 0);
  EXPECT_GT(rules_found[0], 0) << "1dd4993's rule not found failing";
  EXPECT_GT(rules_found[1], 0) << "9f7fe63's rule not found failing";
  EXPECT_GT(skip_found_in_order, 0) << "9f7fe63's rule not found failing with the stages landing in order";
  EXPECT_TRUE(own_part_fails_dx) << "1dd4993's rule not found failing at dx";
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

// The quantising gate/up epilogue's code stores: each byte of the [64, 128] box written once, by the
// thread whose fragment holds its row and column, where the TMA's 128-byte swizzle puts it.
TEST(Fp8Tiles, CodeStoresFillTheSwizzledBoxOnce) {
  std::vector<int> hits(64 * 128, 0);
  for (int warp = 0; warp < 4; ++warp) {
    for (int lane = 0; lane < 32; ++lane) {
      for (int j = 0; j < 16; ++j) {
        for (int r = 0; r < 2; ++r) {
          const uint32_t at = code_offset(warp, lane, j, r);
          const int row = 16 * warp + lane / 4 + 8 * r, col = 8 * j + 2 * (lane % 4);
          ASSERT_EQ(at % 2, 0u);  // one 16-bit store of the pair
          ASSERT_EQ(int(at / 128), row);
          ASSERT_EQ(int(at % 128 / 16), (col / 16) ^ (row % 8));
          ASSERT_EQ(int(at % 16), col % 16);
          ++hits[at];
          ++hits[at + 1];
        }
      }
    }
  }
  for (size_t i = 0; i < hits.size(); ++i) ASSERT_EQ(hits[i], 1) << "byte " << i;
}

}  // namespace
}  // namespace lynx::fp8::impl
