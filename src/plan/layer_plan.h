// Every launch choice of a layer's passes for one shape on one device, made once when a workspace is
// built: the only place where the tuning rules (plan/tiles.h, plan/gather.h, plan/schedule.h,
// plan/gemm_strategy.h) are applied and where overrides (plan/overrides.h) enter. Pure host code,
// CPU-tested (tests/cpu/test_plan.cpp).
#pragma once

#include <cstdint>

#include "kernels/expert_gemm/api.h"
#include "kernels/schedule/api.h"
#include "lynx/config.h"
#include "plan/gemm_strategy.h"
#include "plan/overrides.h"

namespace lynx::plan {

// What the choices depend on besides the shape.
struct DeviceProps {
  int32_t sm_count = 132;
  int64_t l2_bytes = int64_t(50) << 20;
  sched::LaunchLimits schedule{132, 227 * 1024 / 4};  // what the schedule kernel may use
  // Ranks of the group whose passes run on this GPU's SMs at once (virtual ranks; processes on one GPU).
  int32_t ranks_sharing_sms = 1;
};

// Where a launch's rows are gathered into schedule order: token-major by a kernel before it
// (glue::scatter_token_rows), by the expert GEMM's own warps while its tiles run, or by the row-major
// kernel before it (glue::gather_rows).
enum class GatherPlace { kTokenKernel, kInGemm, kRowKernel };

// Where one rank's backward gathers the x rows for the gate/up weight gradients again (it keeps none:
// plan/context_layout.cpp): by a kernel before the weight gradients, or beside a dgrad GEMM, in its
// idle gather warps (a copy no tile waits for). kKept at R > 1, whose context holds them.
enum class XRowsAgain { kKept, kKernel, kBesideDgradDown, kBesideDgradGateUp };

// NOTES: beside the dgrad of down where that GEMM gathers no dy rows itself (qwen3-30b-a3b: dy is
// gathered token-major before it): backward 2.61 ms against 2.70 by a row kernel and 2.45-2.54 with
// the rows kept (2026-12-04, 059d52f and 66e7145). Beside the dgrad of gate/up (twice as long, so the
// copy's bytes are spread thinner; its gather warps are always idle): not yet measured.
XRowsAgain x_rows_again_place(const LayerShape& shape, GatherPlace da_gather, int32_t forced = -1);

struct LayerPlan {
  int32_t gemm_sm_count = 0;      // CTAs of the expert GEMMs' persistent grids
  GatherPlace gate_up_gather = GatherPlace::kInGemm;  // the x rows of the forward's gate/up launch
  GatherPlace da_gather = GatherPlace::kInGemm;       // the dy rows of the backward's da launch
  XRowsAgain x_rows_again = XRowsAgain::kBesideDgradDown;  // one rank's x rows for the weight gradients
  gemm::RowLaunch gate_up;        // forward: silu(x·w_gateᵀ) ⊙ (x·w_upᵀ), K = H
  gemm::RowLaunch down;           // forward: h·w_downᵀ, K = I
  gemm::RowLaunch da;             // backward: dy·w_down, K = H
  gemm::RowLaunch dx;             // backward: [dg | du]·[w_gate; w_up], K = 2I
  bool weight_grad_in_order = true;  // the weight-gradient launches' tile order
  bool fp8_pair_rows = false;        // the FP8 grouped launches' tiles in pairs of row blocks (fp8/tiles.h)
  bool fp8_wide_tiles = false;       // the FP8 grouped launches' half blocks in wide tiles (fp8/tiles.h)
  sched::SchedulePlan schedule{};    // the schedule kernel's grid
  int32_t baseline_gemm = -1;        // the baseline's GEMM strategy: -1 the rule, else forced (Overrides)
};

// Throws lynx::Error naming the override when `forced` holds a value out of range.
LayerPlan make_layer_plan(const LayerShape& shape, const DeviceProps& device, const Overrides& forced = {});

// How the baseline issues a batch of `products` GEMMs of `mean_flops` FLOPs each on average.
GemmStrategy baseline_gemm_strategy(const LayerPlan& plan, int64_t products, double mean_flops);

}  // namespace lynx::plan
