#include "plan/layer_plan.h"

#include <string>

#include "lynx/error.h"
#include "plan/gather.h"
#include "plan/schedule.h"
#include "plan/tiles.h"

namespace lynx::plan {
namespace {

void check_forced(bool ok, const char* name, const std::string& range) {
  if (!ok) throw Error(name, "override out of range: " + range);
}

void check(const Overrides& f) {
  check_forced(f.gemm_order >= -1 && f.gemm_order <= 1, "gemm_order", "-1, 0 or 1");
  check_forced(f.gemm_group_rows >= 0 && f.gemm_group_rows <= 64, "gemm_group_rows", "0 (the rule) or 1-64");
  check_forced(f.gemm_clusters >= -1 && f.gemm_clusters <= 1, "gemm_clusters", "-1, 0 or 1");
  check_forced(f.gemm_fold >= -1 && f.gemm_fold <= 1, "gemm_fold", "-1, 0 or 1");
  check_forced(f.gemm_swapped >= -1 && f.gemm_swapped <= 1, "gemm_swapped", "-1, 0 or 1");
  check_forced(f.gemm_half_tiles >= -1 && f.gemm_half_tiles <= 1, "gemm_half_tiles", "-1, 0 or 1");
  check_forced(f.gemm_gather >= -1 && f.gemm_gather <= 1, "gemm_gather", "-1, 0 or 1");
  check_forced(f.fp8_pair_rows >= -1 && f.fp8_pair_rows <= 1, "fp8_pair_rows", "-1, 0 or 1");
  check_forced(f.fp8_wide_tiles >= -1 && f.fp8_wide_tiles <= 1, "fp8_wide_tiles", "-1, 0 or 1");
  check_forced(f.gather_token_major >= -1 && f.gather_token_major <= 1, "gather_token_major", "-1, 0 or 1");
  check_forced(f.x_rows_again >= -1 && f.x_rows_again <= 2, "x_rows_again", "-1, 0, 1 or 2");
  check_forced(f.gather_lookahead >= 0, "gather_lookahead", "0 (the rule) or more row blocks");
  check_forced(f.gemm_sm_count >= 0, "gemm_sm_count", "0 (every SM) or more CTAs");
  check_forced(f.schedule_min_warps >= 0 && f.schedule_min_warps <= sched::kMaxWarps, "schedule_min_warps",
               "0 (the rule) or 1-16");
  check_forced(f.baseline_gemm >= -1 && f.baseline_gemm <= 1, "baseline_gemm", "-1, 0 or 1");
}

// A row-mode launch over K = `k` whose rows the launch itself gathers or not (`gathers`).
gemm::RowLaunch row_launch(const LayerShape& shape, int64_t k, bool gathers, const Overrides& f) {
  const int64_t routed = shape.tokens * shape.top_k, experts = shape.local_experts();
  gemm::RowLaunch l;
  l.order = f.gemm_order == 1   ? in_order_tiles()
            : f.gemm_order == 0 ? static_tiles(row_blocks_per_expert(routed, experts))
                                : choose_tile_order(routed, experts, gathers);
  if (f.gemm_group_rows > 0) l.order.group_rows = f.gemm_group_rows;
  l.clusters = f.gemm_clusters >= 0 ? f.gemm_clusters == 1 : use_cluster_units(k);
  l.half_tiles = f.gemm_half_tiles != 0;
  l.swapped = f.gemm_swapped != 0;
  l.fold = f.gemm_fold >= 0 ? f.gemm_fold == 1 : fold_tails(routed, experts);
  l.gather_lookahead = f.gather_lookahead > 0 ? f.gather_lookahead : gather_lookahead_blocks(k);
  return l;
}

// `products_per_row`: the output columns each gathered row feeds in the launch that reads it.
// `gemm_may_pull`: the launch has a GEMM kernel that gathers from other ranks.
GatherPlace gather_place(const LayerShape& shape, int64_t products_per_row, bool gemm_may_pull,
                         const DeviceProps& device, const Overrides& f) {
  const bool token_major =
      f.gather_token_major >= 0
          ? f.gather_token_major == 1
          : gather_token_major(shape.tokens * shape.top_k, shape.local_experts(), shape.tokens, shape.hidden,
                               products_per_row, device.l2_bytes);
  // NOTES: at R > 1 the rows come from other ranks: gate/up pulls them in its own gather (a kernel
  // variant reading through the table of ranks), `da` with the row-major kernel (the GEMM has no such
  // variant: kernels/expert_gemm/launch.cu says why). A token-major gather would be a push from each
  // source, which the passes do not have. Where ranks share a GPU's SMs, gate/up's rows too come by the
  // row-major kernel: a GEMM's gather warps copy rows for every CTA of its grid, which assumes the whole
  // grid resident, while R ranks' grids take turns on the SMs (R = 8 virtual ranks at qwen3-30b-a3b, as
  // graphs: forward 1.058x of R = 1 with the kernel, 1.209x with the gather in the GEMM; 2026-12-05,
  // bench/results/2026-12-05-h100-2f73042-fp8-tile-start-log.txt).
  if (shape.num_ranks > 1) {
    const bool pull_in_gemm = f.gemm_gather >= 0 ? f.gemm_gather == 1 : device.ranks_sharing_sms == 1;
    return pull_in_gemm && gemm_may_pull ? GatherPlace::kInGemm : GatherPlace::kRowKernel;
  }
  if (token_major) return GatherPlace::kTokenKernel;
  return f.gemm_gather != 0 ? GatherPlace::kInGemm : GatherPlace::kRowKernel;
}

}  // namespace

XRowsAgain x_rows_again_place(const LayerShape& shape, GatherPlace da_gather, int32_t forced) {
  if (shape.num_ranks > 1) return XRowsAgain::kKept;
  const bool da_free = da_gather != GatherPlace::kInGemm;  // its gather warps copy no dy rows
  if (forced == 0) return XRowsAgain::kKernel;
  if (forced == 2) return XRowsAgain::kBesideDgradGateUp;
  return da_free ? XRowsAgain::kBesideDgradDown : XRowsAgain::kKernel;
}

LayerPlan make_layer_plan(const LayerShape& shape, const DeviceProps& device, const Overrides& forced) {
  check(forced);
  const int64_t H = shape.hidden, I = shape.intermediate;
  LayerPlan p;
  p.gemm_sm_count = forced.gemm_sm_count > 0 ? forced.gemm_sm_count : device.sm_count;
  p.gate_up_gather = gather_place(shape, 2 * I, true, device, forced);  // gate and up: 2I columns
  p.da_gather = gather_place(shape, I, false, device, forced);          // da: I columns
  p.x_rows_again = x_rows_again_place(shape, p.da_gather, forced.x_rows_again);
  p.gate_up = row_launch(shape, H, p.gate_up_gather == GatherPlace::kInGemm, forced);
  p.down = row_launch(shape, I, false, forced);
  p.da = row_launch(shape, H, p.da_gather == GatherPlace::kInGemm, forced);
  p.dx = row_launch(shape, 2 * I, false, forced);
  const int64_t routed = shape.tokens * shape.top_k, experts = shape.local_experts();
  p.fp8_pair_rows = forced.fp8_pair_rows >= 0 ? forced.fp8_pair_rows == 1 : fp8_pair_row_blocks(routed, experts);
  p.fp8_wide_tiles = fp8_wide_half_blocks(p.fp8_pair_rows) && forced.fp8_wide_tiles != 0;
  p.weight_grad_in_order = forced.gemm_order >= 0 ? forced.gemm_order == 1
                                                  : choose_tile_order(routed, experts, false).in_order;
  p.schedule = make_schedule_plan(shape.tokens, shape.top_k, experts, shape.num_ranks, device.schedule.sm_count,
                                  device.schedule.max_shared_ints,
                                  forced.schedule_min_warps > 0 ? forced.schedule_min_warps : sched::kMinWarps);
  p.baseline_gemm = forced.baseline_gemm;
  return p;
}

GemmStrategy baseline_gemm_strategy(const LayerPlan& plan, int64_t products, double mean_flops) {
  return choose_gemm_strategy(products, mean_flops, plan.baseline_gemm);
}

}  // namespace lynx::plan
