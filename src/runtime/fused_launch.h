// What the fused passes share: the expert GEMM arguments a workspace fills in, and the gathers of rows
// into schedule order that the plan places before a launch or inside it.
#pragma once

#include "kernels/expert_gemm/api.h"
#include "runtime/workspace.h"

namespace lynx::fused {

// The fields of gemm::ExpertGemmArgs that come from the workspace (schedule, status, tickets, grid),
// with the launch choices `launch` of the plan.
gemm::ExpertGemmArgs expert_gemm_args(const Workspace::Impl& w, const gemm::RowLaunch& launch);

// Makes the launch of `a` gather its A rows (into a.a, schedule order) from `rows` ([T, K]) itself.
void gather_rows_in(gemm::ExpertGemmArgs& a, const Workspace::Impl& w, const TensorView& rows);

// Queues the gather of `rows` ([T, K]) into `dst` (schedule order) where the plan puts it in a kernel
// before the launch; nothing for plan::GatherPlace::kInGemm (gather_rows_in then).
void queue_gather_kernel(plan::GatherPlace place, const Workspace::Impl& w, const TensorView& rows, bf16_t* dst,
                         cudaStream_t s);

// The compute step's barriers at R > 1 (fused_passes.h), nothing at R = 1: its wait for every rank's
// open step, and its arrival (with this rank's status, for the others' close step).
void compute_begins(const Workspace::Impl& w, cudaStream_t s);
void compute_ends(const Workspace::Impl& w, cudaStream_t s);

// The backward's open step at R > 1 with a caller's context: this rank's routing staged again (ids32
// and router weights in the region, read by the dx combine and by the other ranks' SwiGLU backward),
// since another forward on the workspace may have staged its own since this backward's forward.
void restage_routing(Workspace::Impl& w, const LayerInputs& in, cudaStream_t s);

// dx[t] = dx_s[t] + Σ_j dx_row of (t, j) (w.un.rows_b); at R > 1 pulled from the ranks that computed
// them, with the d_topk_weights those ranks computed; 0 for the slots not routed.
void dx_combine(Workspace::Impl& w, const Gradients& grads, cudaStream_t s);

// The experts' weight gradients (bf16 GEMMs), each over its expert's rows: dw_gate | dw_up from dg | du
// (w.fb.dgu) and the x rows (w.un.xg); dw_down from the dy rows `dyg` and w·silu(g)⊙u (w.un.h). The
// backwards queue dw_down before the dgrad of gate/up, whose per-row dx (w.un.rows_b) overwrite the
// dy rows (w.un.rows_a, the same memory for the fused backend: runtime/workspace.cpp).
void weight_grad_gate_up(Workspace::Impl& w, const Gradients& grads, cudaStream_t s);
void weight_grad_down(Workspace::Impl& w, const Gradients& grads, const bf16_t* dyg, cudaStream_t s);

}  // namespace lynx::fused
