// Hooks for tests only (the experiments build): not part of the public API.
#pragma once

#if !LYNX_EXPERIMENTS
#error "test hooks exist only in the experiments build (CMake option LYNX_EXPERIMENTS)"
#endif

#include <string>
#include <utility>
#include <vector>

#include "common/cuda_check.h"
#include "kernels/expert_gemm/api.h"
#include "kernels/fp8/api.h"
#include "runtime/workspace.h"

namespace lynx::test_hooks {

// Makes the fused forward's gate/up kernel never load tile `task` (-1 turns the hook off), so that its
// bounded waits must time out and report instead of hanging.
inline void set_stall_task(Workspace& ws, int32_t task) { ws.impl().test_stall_task = task; }

// Forces one of the plan's choices (a field of plan/overrides.h; -1, or 0 for counts, gives it back
// to the rule) for this workspace and plans again: the small test shapes then take the choices a
// benchmark shape would, or each choice's other branch.
inline void force(Workspace& ws, int32_t plan::Overrides::*choice, int32_t value) {
  ws.impl().overrides.*choice = value;
  ws.impl().replan();
}
// Runs every row-mode expert GEMM as cluster units (1), as single CTAs (0), or as the rule decides (-1).
inline void set_gemm_clusters(Workspace& ws, int32_t v) { force(ws, &plan::Overrides::gemm_clusters, v); }
// Swapped products for warpgroups of 1-16 rows always (1), never (0), or by the rule (-1).
inline void set_gemm_swapped(Workspace& ws, int32_t v) { force(ws, &plan::Overrides::gemm_swapped, v); }
// Folds tails of 1-kFoldRows rows into the row block before them (1), never (0), or by the rule (-1).
inline void set_gemm_fold(Workspace& ws, int32_t v) { force(ws, &plan::Overrides::gemm_fold, v); }
// Takes the FP8 grouped GEMMs' tiles in pairs of an expert's row blocks (1), in the plain order (0), or
// by the rule (-1).
inline void set_fp8_pair_rows(Workspace& ws, int32_t v) { force(ws, &plan::Overrides::fp8_pair_rows, v); }
// Computes the FP8 grouped GEMMs' half blocks in wide tiles where their tiles are not in pairs (1 or -1),
// or in plain tiles (0).
inline void set_fp8_wide_tiles(Workspace& ws, int32_t v) { force(ws, &plan::Overrides::fp8_wide_tiles, v); }
// Walks every expert GEMM's tiles in order from the ticket (1), as the static round robin (0), or by
// the rule (-1).
inline void set_gemm_order(Workspace& ws, int32_t v) { force(ws, &plan::Overrides::gemm_order, v); }
// Launches the expert GEMMs on `sm_count` CTAs (0: every SM), so that a few CTAs, or one cluster, walk
// many tiles: pipeline phases and the unit mailbox's slots wrap many times.
inline void set_gemm_sm_count(Workspace& ws, int32_t v) { force(ws, &plan::Overrides::gemm_sm_count, v); }
// The in-kernel gather may run only `blocks` row blocks ahead of the tiles begun (0: the rule), so
// that small test shapes exercise its throttle.
inline void set_gather_lookahead(Workspace& ws, int32_t v) { force(ws, &plan::Overrides::gather_lookahead, v); }
// Gathers the fused launches' rows token-major in a kernel before each GEMM (1), in the GEMMs or the
// row-major kernel (0), or by the rule (-1: token-major for the small test shapes, whose launches have
// fewer than 1024 columns).
inline void set_gather_token_major(Workspace& ws, int32_t v) { force(ws, &plan::Overrides::gather_token_major, v); }

// Gathers the rows of gate/up and `da` inside the GEMMs (1; at R > 1 gate/up's only: `da` always uses
// the row-major kernel there), in the row-major kernel before them (0), or by the rule (-1).
inline void set_gemm_gather(Workspace& ws, int32_t v) { force(ws, &plan::Overrides::gemm_gather, v); }

// Where one rank's backward gathers the x rows again (plan::Overrides::x_rows_again; -1: the rule).
inline void set_x_rows_again(Workspace& ws, int32_t v) { force(ws, &plan::Overrides::x_rows_again, v); }

// The in-kernel gather claims row block `block`'s rows but never copies them (-1 turns the hook off),
// so that the producer's bounded wait for them must time out and report instead of hanging.
inline void set_gather_stall_block(Workspace& ws, int32_t block) { ws.impl().test_gather_stall_block = block; }

// Schedule block `block` (in the grid's x-fastest order) never arrives at the builder's first grid
// barrier (-1 turns the hook off), so that the other blocks' bounded wait must time out and report.
inline void set_schedule_stall_block(Workspace& ws, int32_t block) { ws.impl().schedule.test_stall_block = block; }

// "" when every counter that a kernel's last block (or CTA) sets back is at rest: the schedule
// builder's barrier and arrival counters at zero, first_bad_route at UINT64_MAX, the
// GEMM's tile tickets and (fused) the in-kernel gather's counters at zero; else what is not.
// Synchronises the device.
inline std::string counters_not_at_rest(Workspace& ws) {
  Workspace::Impl& w = ws.impl();
  LYNX_CUDA(cudaDeviceSynchronize());
  DeviceStatus st{};
  LYNX_CUDA(cudaMemcpy(&st, w.status, sizeof(st), cudaMemcpyDeviceToHost));
  std::string bad;
  if (st.schedule_arrivals != 0) bad += " schedule_arrivals=" + std::to_string(st.schedule_arrivals);
  if (st.counted_blocks != 0) bad += " counted_blocks=" + std::to_string(st.counted_blocks);
  if (st.first_bad_route != ~0ull) bad += " first_bad_route=" + std::to_string(st.first_bad_route);
  int32_t tickets[2] = {};
  LYNX_CUDA(cudaMemcpy(tickets, w.gemm_tickets, sizeof(tickets), cudaMemcpyDeviceToHost));
  if (tickets[0] != 0 || tickets[1] != 0) bad += " gemm_tickets";
  if (w.gather_sync) {
    std::vector<int32_t> sync(gemm::gather_sync_ints(w.problem.capacity));
    LYNX_CUDA(cudaMemcpy(sync.data(), w.gather_sync, sync.size() * sizeof(int32_t), cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < sync.size(); ++i) {
      if (sync[i] != 0) {
        bad += " gather_sync[" + std::to_string(i) + "]=" + std::to_string(sync[i]);
        break;
      }
    }
  }
  return bad;
}

// Fills the per-row buffers ([capacity, ...], padding rows included) with bf16 NaN (0xFFFF), so that a
// padding row a kernel should have zeroed turns the gradients it feeds into NaN instead of reading
// the zeros fresh device memory often holds. Synchronous.
inline void poison_row_buffers(Workspace& ws) {
  Workspace::Impl& w = ws.impl();
  const int64_t cap = w.problem.capacity, H = w.shape.hidden, I = w.shape.intermediate;
  const int64_t gate_up = (w.gate_up_by_slot ? w.shape.tokens * w.shape.top_k : cap) * I;
  const std::pair<void*, int64_t> buffers[] = {
      {w.un.xg, cap * H}, {w.un.g, gate_up},      {w.un.u, gate_up},      {w.un.h, cap * I},
      {w.un.rows_a, cap * H}, {w.un.rows_b, cap * H}, {w.un.da, cap * I}, {w.un.dg, cap * I},
      {w.un.du, cap * I},     {w.fb.dgu, cap * 2 * I}};
  for (const auto& [ptr, count] : buffers) {
    if (ptr != nullptr) LYNX_CUDA(cudaMemset(ptr, 0xFF, size_t(count) * sizeof(uint16_t)));
  }
  // FP8 (sizes in bytes): 0xFF is an E4M3 NaN, and a NaN scale.
  const int64_t kbH = fp8::blocks_of(H), kbI = fp8::blocks_of(I), kb2I = fp8::blocks_of(2 * I);
  const std::pair<void*, int64_t> fp8_buffers[] = {
      {w.f8.xg, cap * H}, {w.f8.xg_scales, 4 * cap * kbH}, {w.f8.h, cap * I},
      {w.f8.h_scales, 4 * cap * kbI}, {w.f8.dgu, cap * 2 * I}, {w.f8.dgu_scales, 4 * cap * kb2I}};
  for (const auto& [ptr, bytes] : fp8_buffers) {
    if (ptr != nullptr) LYNX_CUDA(cudaMemset(ptr, 0xFF, size_t(bytes)));
  }
  LYNX_CUDA(cudaDeviceSynchronize());
}

// Fills the gathered x rows with bf16 NaN (one rank: scratch, which backward must gather again, not
// read from its forward). Nothing when they are lent (Config::scratch_allocator). Synchronous.
inline void poison_gathered_x(Workspace& ws) {
  Workspace::Impl& w = ws.impl();
  if (w.un.xg == nullptr) return;
  LYNX_CUDA(cudaMemset(w.un.xg, 0xFF, size_t(w.problem.capacity * w.shape.hidden) * sizeof(uint16_t)));
  LYNX_CUDA(cudaDeviceSynchronize());
}

}  // namespace lynx::test_hooks
