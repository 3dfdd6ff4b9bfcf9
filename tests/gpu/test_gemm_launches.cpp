// The expert GEMMs' launch variants (PairedTiles.*): cluster units, tile orders, half tiles, swapped products, folded tails.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "experiments/test_hooks.h"
#include "gpu/layer_check.h"
#include "kernels/schedule/core.h"
#include "runtime/workspace.h"

namespace lynx::test {
namespace {

// The row-mode expert GEMMs as cluster units (forced; the rule pairs only long K, use_cluster_units)
// on cases that reach every kind of unit: a shared weight tile, a shared row block, nothing shared
// (units across experts or column blocks), rank 1's padding tile after an odd tile count, in-order
// claims posted through the mailbox and the static round robin, half tiles, experts without rows.
class PairedTiles : public FusedOnlyTest {};

TEST_F(PairedTiles, InOrderTwoBlocksPerExpert) {  // 16 · 130 rows: shared B and A, half tiles
  check_against_reference({520, 256, 256, 16, 4, 0}, fresh_seed(), fused(), false, 1);
}
TEST_F(PairedTiles, InOrderManyBlocksPerExpert) {  // 18 blocks per expert: groups of 16 + 2
  check_against_reference({2200, 128, 64, 4, 4, 0}, fresh_seed(), fused(), false, 1);
}
TEST_F(PairedTiles, StaticGroupsSpanExperts) {  // ~4.7 blocks per expert: units across experts share nothing
  check_against_reference({600, 128, 192, 4, 4, 64}, fresh_seed(), fused(), false, 1);
}
TEST_F(PairedTiles, ExpertsWithNoRows) {
  Case c{257, 64, 64, 8, 2, 0};
  c.routing = "subset";
  check_against_reference(c, fresh_seed(), fused(), false, 1);
}
TEST_F(PairedTiles, OneTileAndAPaddingTile) { check_against_reference({1, 64, 64, 1, 1, 64}, fresh_seed(), fused(), false, 1); }
TEST_F(PairedTiles, OddTileCounts) {  // 3 row blocks of one expert; down has 1 column block: 3 tiles
  check_against_reference({300, 192, 192, 1, 1, 0}, fresh_seed(), fused(), false, 1);
}
TEST_F(PairedTiles, RecomputedContext) {
  Config c = fused();
  c.save_forward_context = false;
  check_against_reference({200, 128, 64, 8, 2, 64}, fresh_seed(), c, /*recompute=*/true, 1);
}
// One cluster (a grid of two CTAs) walks every unit: the unit mailbox's slots are reused dozens of
// times (in order), the stage phases wrap, and the last unit may hold a padding tile.
TEST_F(PairedTiles, OneClusterInOrder) {  // 18 blocks per expert, 72 tiles per GEMM
  check_against_reference({2200, 128, 64, 4, 4, 0}, fresh_seed(), fused(), false, 1, 2);
}
TEST_F(PairedTiles, OneClusterStatic) {  // ~4.7 blocks per expert, shared expert
  check_against_reference({600, 128, 192, 4, 4, 64}, fresh_seed(), fused(), false, 1, 2);
}
TEST_F(PairedTiles, OneClusterOddTileCounts) {
  check_against_reference({300, 192, 192, 1, 1, 0}, fresh_seed(), fused(), false, 1, 2);
}
// Every expert a single half block (~5 rows), every launch with two or more column blocks (H = I =
// 512): units of two column tiles share a half row block in every row mode (gate/up, down, both
// dgrads), where rank 0 alone loads rows 0-63 of A for both CTAs; in order (under two blocks per
// expert) and, on one cluster, with the claims wrapping the mailbox.
TEST_F(PairedTiles, HalfTilesShareTheirRowBlockInEveryMode) {
  const Case c{40, 512, 512, 8, 1, 0};
  check_against_reference(c, fresh_seed(), fused(), false, 1);
  check_against_reference(c, fresh_seed(), fused(), false, 1, 2);
}

// How many experts end with a warpgroup of 1-16 rows (swapped_products in fused/tile_scheduler.h).
int experts_with_swapped_tails(Workspace& ws, const Case& c) {
  std::vector<int32_t> rows(c.E);
  LYNX_TEST_CUDA(cudaMemcpy(rows.data(), ws.impl().schedule.expert_rows, rows.size() * 4, cudaMemcpyDeviceToHost));
  int swapped = 0;
  for (int64_t e = 0; e < c.E; ++e) swapped += rows[e] % 64 >= 1 && rows[e] % 64 <= 16;
  return swapped;
}

// Each expert's last row block a half tile with 10-60 rows (160 ± 13 rows per expert), so its A goes in
// 1-4 boxes of 16 rows and zeros for the rest of the half (load_half_a in fused/expert_gemm.cu). The
// padding rows of that half must come out as exact zeros, as from a 64-row box, poisoned with NaN
// first (seen in h and the down GEMM's rows after a forward, in the per-row dx and w·silu(g)⊙u after
// a whole layer: layer_check.h); single CTAs and cluster units.

TEST_F(PairedTiles, TailPaddingRowsComeOutZero) {
  const Case c{640, 128, 128, 8, 2, 0};
  for (const int32_t clusters : {0, 1}) {
    SCOPED_TRACE("clusters " + std::to_string(clusters));
    const HostLayer L(c, fresh_seed());
    const std::vector<HostBf16> dy = random_dy(c);
    Workspace ws(L.shape, fused());
    test_hooks::set_gemm_clusters(ws, clusters);
    test_hooks::poison_row_buffers(ws);
    expect_matches_reference(run_layer(ws, L, dy), L, dy);
    std::vector<int32_t> rows(c.E);
    LYNX_TEST_CUDA(cudaMemcpy(rows.data(), ws.impl().schedule.expert_rows, rows.size() * 4, cudaMemcpyDeviceToHost));
    int tails = 0;
    for (int64_t e = 0; e < c.E; ++e) tails += rows[e] % 128 != 0 && rows[e] % 128 <= 64;
    ASSERT_GE(tails, c.E / 2) << "the case should give most experts a half tile";
    expect_padding_rows_zero(ws, c);
    expect_forward_padding_rows_zero(ws, L);
  }
}

// The products of a warpgroup with 1-16 rows, computed with the operands swapped. Cyclic routing
// gives every expert T·k/E rows: 128-130 (half tiles of 1-2 rows), 144 (16 rows), 208 (warpgroup 1 of
// a second, full block holds 16; cluster units share its weights), 80 (one full block whose warpgroup
// 1 holds 16; H = 512 gives every row mode two column tiles, so cluster units share its rows); random
// routing 136 ± 11 rows per expert, tails of every size, some swapped. Every output against the
// reference and bit for bit against the same layer computed without swapping (the H200 gives the
// same bits both ways: the same k16 products in the same K order; PTX does not promise wgmma's
// internal order, so this pins what was observed); the padding rows exact zeros; single CTAs and
// cluster units; I = 192 clips the last column block of gate/up and of da.
TEST_F(PairedTiles, SwappedProductsOfFewRows) {
  for (const Case& c : {Case{1032, 256, 256, 16, 2, 0, "cyclic"}, Case{1152, 256, 192, 16, 2, 0, "cyclic"},
                        Case{1664, 256, 256, 16, 2, 0, "cyclic"}, Case{640, 512, 256, 16, 2, 0, "cyclic"},
                        Case{1088, 256, 192, 16, 2, 0}}) {
    SCOPED_TRACE("T=" + std::to_string(c.T) + " I=" + std::to_string(c.I) + " routing=" + c.routing);
    for (const int32_t clusters : {0, 1}) {
      SCOPED_TRACE("clusters " + std::to_string(clusters));
      const HostLayer L(c, fresh_seed());
      const std::vector<HostBf16> dy = random_dy(c);
      Workspace swapped(L.shape, fused()), plain(L.shape, fused());
      test_hooks::set_gemm_swapped(swapped, 1);
      test_hooks::set_gemm_swapped(plain, 0);
      for (Workspace* ws : {&swapped, &plain}) {
        test_hooks::set_gemm_fold(*ws, 0);  // a kernel that folds tails has no swapped products
        test_hooks::set_gemm_clusters(*ws, clusters);
        test_hooks::poison_row_buffers(*ws);
      }
      const Outputs a = run_layer(swapped, L, dy);
      expect_matches_reference(a, L, dy);
      ASSERT_GE(experts_with_swapped_tails(swapped, c), 1) << "the case should swap some warpgroups";
      expect_padding_rows_zero(swapped, c);
      expect_forward_padding_rows_zero(swapped, L);
      EXPECT_EQ(first_difference(a, run_layer(plain, L, dy)), "");
    }
  }
}
// How many experts end in a tail of 1-kFoldRows rows behind a whole block (folded tails in
// fused/tile_scheduler.h).
int experts_with_folded_tails(Workspace& ws, const Case& c) {
  std::vector<int32_t> rows(c.E);
  LYNX_TEST_CUDA(cudaMemcpy(rows.data(), ws.impl().schedule.expert_rows, rows.size() * 4, cudaMemcpyDeviceToHost));
  int folded = 0;
  for (int64_t e = 0; e < c.E; ++e) folded += sched::core::folded_tail_rows(rows[e]) > 0;
  return folded;
}

// Tails of 1-16 rows folded into the block before them. Cyclic routing (expert (t + j) % E, k = 2)
// gives the experts 2T/E rows or one either side: 128-130 (tails of 1 and 2 rows), 136-138 (8-10),
// 144 (16), 144-146 (16 folded beside 17 and 18 not), 272 (two whole blocks and 16 rows: the folding
// tile pairs with the block before it, sharing the weights); random routing
// 132 ± 11 rows per expert. Every output against the reference and bit for bit against the same
// layer without folding (same k16 products in the same K order); the padding rows exact zeros; single
// CTAs and cluster units (H = 512: two column tiles per row mode, so cluster units of a one-block
// expert share its rows and its tail), in order and in the static round robin; I = 192 clips the last
// column block of gate/up and of da.
TEST_F(PairedTiles, FoldedTailsOfFewRows) {
  struct Run {
    Case c;
    int32_t order;  // -1: the rule's (in order at these shapes), 0: the static round robin
  };
  for (const Run& run : {Run{Case{1032, 256, 256, 16, 2, 0, "cyclic"}, -1}, Run{Case{1096, 256, 256, 16, 2, 0, "cyclic"}, -1},
                         Run{Case{1152, 512, 192, 16, 2, 0, "cyclic"}, -1}, Run{Case{1160, 256, 256, 16, 2, 0, "cyclic"}, -1},
                         Run{Case{2176, 256, 256, 16, 2, 0, "cyclic"}, -1}, Run{Case{2176, 256, 256, 16, 2, 0, "cyclic"}, 0},
                         Run{Case{1056, 512, 192, 16, 2, 0}, -1}, Run{Case{1056, 512, 192, 16, 2, 0}, 0}}) {
    const Case& c = run.c;
    SCOPED_TRACE("T=" + std::to_string(c.T) + " H=" + std::to_string(c.H) + " I=" + std::to_string(c.I) +
                 " routing=" + c.routing + " order " + std::to_string(run.order));
    for (const int32_t clusters : {0, 1}) {
      SCOPED_TRACE("clusters " + std::to_string(clusters));
      const HostLayer L(c, fresh_seed());
      const std::vector<HostBf16> dy = random_dy(c);
      Workspace folded(L.shape, fused()), plain(L.shape, fused());
      test_hooks::set_gemm_fold(folded, 1);
      test_hooks::set_gemm_fold(plain, 0);
      for (Workspace* ws : {&folded, &plain}) {
        test_hooks::set_gemm_clusters(*ws, clusters);
        test_hooks::set_gemm_order(*ws, run.order);
        test_hooks::poison_row_buffers(*ws);
      }
      const Outputs a = run_layer(folded, L, dy);
      expect_matches_reference(a, L, dy);
      ASSERT_GE(experts_with_folded_tails(folded, c), 1) << "the case should fold some tails";
      expect_padding_rows_zero(folded, c);
      EXPECT_EQ(first_difference(a, run_layer(plain, L, dy)), "");
      expect_forward_padding_rows_zero(folded, L);
    }
  }
}

// The rule itself pairs at K = 4096 (gate/up: K = H; the dgrad of down: K = H): no hook.
TEST_F(PairedTiles, ByTheRuleAtALongK) { check_against_reference({96, 4096, 128, 4, 2, 0}, fresh_seed(), fused()); }

TEST_F(PairedTiles, SameBitsAsSingleCtas) {  // each tile is computed whole over its K in order either way
  const Case c{520, 256, 256, 16, 4, 64};
  const HostLayer L(c, fresh_seed());
  const std::vector<HostBf16> dy = random_dy(c);
  Workspace single(L.shape, fused()), paired(L.shape, fused());
  test_hooks::set_gemm_clusters(single, 0);
  test_hooks::set_gemm_clusters(paired, 1);
  EXPECT_EQ(first_difference(run_layer(single, L, dy), run_layer(paired, L, dy)), "");
}

}  // namespace
}  // namespace lynx::test
