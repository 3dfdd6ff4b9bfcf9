// The in-kernel row gather (KernelGather.*): its throttle, the token-major gather kernel, a stall reported.
#include <gtest/gtest.h>

#include <vector>

#include "experiments/test_hooks.h"
#include "gpu/layer_check.h"

namespace lynx::test {
namespace {

// The in-kernel gather (fused/row_gather.cuh) with a lookahead of one row block: its warps keep
// waiting for the producers to begin nearer blocks while the producers wait for theirs, on a grid of
// one CTA pair or two CTAs walking every tile; static and in-order tile orders, clusters or not, the
// backward's dy gather (inside the da GEMM) as well. A launch that gathers claims its tiles in order
// (choose_tile_order); the static round robin with a gather is what LYNX_GEMM_ORDER=static runs.
class KernelGather : public FusedOnlyTest {};  // the same fused-only fixture as PairedTiles

TEST_F(KernelGather, ThrottledStaticOrder) {  // ~4.7 blocks per expert, shared expert
  check_against_reference({600, 128, 192, 4, 4, 64}, fresh_seed(), fused(), false, 0, 2, 1, /*order=*/0);
}
TEST_F(KernelGather, ThrottledInOrderFewBlocksPerExpert) {  // the rule's order for a gathering launch
  check_against_reference({600, 128, 192, 4, 4, 64}, fresh_seed(), fused(), false, 0, 2, 1);
}
TEST_F(KernelGather, ThrottledInOrder) {  // 18 blocks per expert
  check_against_reference({2200, 128, 64, 4, 4, 0}, fresh_seed(), fused(), false, 0, 2, 1);
}
TEST_F(KernelGather, ThrottledInClusterUnits) {  // 16 · 130 rows: half tiles, shared A and B
  check_against_reference({520, 256, 256, 16, 4, 0}, fresh_seed(), fused(), false, 1, 2, 1);
}
TEST_F(KernelGather, ThrottledWithRecomputedContext) {
  Config c = fused();
  c.save_forward_context = false;
  check_against_reference({300, 192, 192, 8, 2, 0}, fresh_seed(), c, /*recompute=*/true, 0, 2, 1);
}

// The token-major gather kernel before each GEMM (glue::scatter_token_rows) against the in-kernel
// gather: the same bits in every output, the reference matched, padding rows exact zeros in buffers
// poisoned with NaN. Random routing with a shared expert, tails folded (1096 rows, cyclic), k = 1,
// and more tokens than the kernel's token blocks (a second pass of their loop).
TEST_F(KernelGather, TokenMajorSameBitsAsInKernel) {
  for (const Case& c : {Case{600, 128, 192, 4, 4, 64}, Case{1096, 256, 256, 16, 2, 0, "cyclic"},
                        Case{300, 192, 128, 8, 1, 0}, Case{2600, 128, 64, 8, 2, 0}}) {
    SCOPED_TRACE(case_name(c));
    const HostLayer L(c, fresh_seed());
    const std::vector<HostBf16> dy = random_dy(c);
    Workspace token_major(L.shape, fused()), in_kernel(L.shape, fused());
    test_hooks::set_gather_token_major(token_major, 1);
    test_hooks::set_gather_token_major(in_kernel, 0);
    for (Workspace* ws : {&token_major, &in_kernel}) test_hooks::poison_row_buffers(*ws);
    const Outputs a = run_layer(token_major, L, dy);
    expect_matches_reference(a, L, dy);
    expect_padding_rows_zero(token_major, c);
    EXPECT_EQ(first_difference(a, run_layer(in_kernel, L, dy)), "");
  }
}

// The gather's rows never arrive (test hook: row block 0 is claimed, never copied): the producer's
// bounded wait for them reports, naming the wait.
[[noreturn]] void run_stalled_gather() {
  run_stalled_forward([](Workspace& ws) {
    test_hooks::set_gather_token_major(ws, 0);  // the stall hook is the in-kernel gather's
    test_hooks::set_gather_stall_block(ws, 0);
  });
}

TEST_F(KernelGather, StalledRowsAreReportedNotHung) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(run_stalled_gather(), ::testing::ExitedWithCode(3),
              "timed out in block [0-9]+: wait 5 = rows gathered.*\\[context lost\\]");
}

}  // namespace
}  // namespace lynx::test
