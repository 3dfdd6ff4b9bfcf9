// Choices forced in place of the plan's rules, for sweeps and tests. Only the experiments build (CMake
// option LYNX_EXPERIMENTS) can set them: from the environment (environment_overrides) or, per
// workspace, through the test hooks (experiments/test_hooks.h). What users install always plans with
// the defaults below, which leave every choice to the rules.
#pragma once

#include <cstdint>

namespace lynx::plan {

// -1 (or 0 for counts): the rule decides.
struct Overrides {
  int32_t gemm_order = -1;          // 1: tiles claimed in order, 0: static round robin   LYNX_GEMM_ORDER=in-order|static
  int32_t gemm_group_rows = 0;      // row blocks per raster group, 1-64                 LYNX_GEMM_GROUP_ROWS
  int32_t gemm_clusters = -1;       // row launches as cluster units (1) or single CTAs (0) LYNX_GEMM_CLUSTER
  int32_t gemm_fold = -1;           // fold tails of 1-16 rows                           LYNX_GEMM_FOLD
  int32_t gemm_swapped = -1;        // swapped products for warpgroups of 1-16 rows       LYNX_GEMM_SWAPPED
  int32_t gemm_half_tiles = -1;     // half tiles (0 also turns off swapped and folded)   LYNX_GEMM_HALF_TILES
  int32_t gemm_gather = -1;         // 0: a row-major gather kernel instead of in-GEMM    LYNX_GEMM_GATHER
  int32_t gather_token_major = -1;  // 1: every gather token-major before its GEMM        LYNX_GEMM_GATHER_TOKENS
  int32_t gather_lookahead = 0;     // row blocks the in-GEMM gather runs ahead           LYNX_GEMM_GATHER_AHEAD
  int32_t gemm_sm_count = 0;        // CTAs of the expert GEMMs' grid (test hook only)
  int32_t schedule_min_warps = 0;   // the schedule kernel's fewest warps per block, 1-16 LYNX_SCHEDULE_MIN_WARPS
  int32_t baseline_gemm = -1;       // the baseline's products: 0 one call each, 1 grouped LYNX_UNFUSED_GEMM=loop|grouped
  int32_t virtual_serial = -1;      // virtual ranks: 1 every rank's steps on the caller's stream, one rank after
                                    // another; 0 (default) each rank on its own stream   LYNX_VIRTUAL_RANKS=serial|streams
  int32_t fp8_pair_rows = -1;       // the FP8 grouped GEMMs' tiles in pairs of row blocks  LYNX_FP8_PAIR_ROWS
  int32_t fp8_wide_tiles = -1;      // 0: the FP8 grouped GEMMs' half blocks in plain tiles  LYNX_FP8_WIDE_TILES
  int32_t x_rows_again = -1;        // one rank's x rows for the weight gradients: 0 a kernel, 1 beside the dgrad of
                                    // down (where it gathers no dy rows; else a kernel), 2 beside the dgrad of
                                    // gate/up                  LYNX_X_ROWS_AGAIN=kernel|dgrad-down|dgrad-gate-up
};

#if LYNX_EXPERIMENTS
// The overrides the environment sets (the variables above), read once per process. Throws lynx::Error
// naming the variable when a value is not one it takes.
const Overrides& environment_overrides();
#endif

}  // namespace lynx::plan
