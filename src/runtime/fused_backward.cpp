#include "common/cuda_check.h"
#include "kernels/expert_gemm/api.h"
#include "kernels/glue/api.h"
#include "runtime/fused_launch.h"
#include "runtime/fused_passes.h"
#include "runtime/stages.h"
#include "runtime/steps.h"

namespace lynx::fused {

void dx_combine(Workspace::Impl& w, const Gradients& grads, cudaStream_t s) {
  const LayerShape& sh = w.shape;
  if (omitted(Stage::kDxCombine, w.backward_calls)) return;
  CombineSources peers = w.combine_sources(comm::kRowsB);
  if (w.ranks() > 1) peers.d_topk_rows = w.table<const float>(comm::kDTopkRows);
  peers.d_topk_weights = data_of<float>(grads.d_topk_weights);
  glue::combine(data_of<bf16_t>(grads.dx), w.un.rows_b, w.schedule.slot_row, nullptr,
                sh.shared_intermediate > 0 ? w.un.ys : nullptr, sh.tokens, sh.top_k, sh.hidden, w.status, s, peers);
}

namespace {

// The fields of a weight-gradient launch that come from the workspace: each expert's rows, rounded up
// to 64 (WeightGradArgs::expert_rows).
gemm::WeightGradArgs weight_grad_args(const Workspace::Impl& w) {
  gemm::WeightGradArgs wg;
  wg.capacity = w.problem.capacity;
  wg.experts = w.shape.local_experts();
  wg.expert_offset = w.schedule.expert_offset;
  wg.expert_rows = w.schedule.expert_rows;
  wg.status = w.stall_report_device;
  wg.tickets = w.gemm_tickets;
  wg.sm_count = w.plan.gemm_sm_count;
  wg.in_order = w.plan.weight_grad_in_order;
  return wg;
}

}  // namespace

void weight_grad_gate_up(Workspace::Impl& w, const Gradients& grads, cudaStream_t s) {
  if (!wants_expert_weight_grads(grads) || omitted(Stage::kWgradGateUp, w.backward_calls)) return;
  const int64_t H = w.shape.hidden, I = w.shape.intermediate;
  // dw_gate[e] = dgᵀ · x and dw_up[e] = duᵀ · x: one GEMM with M = 2I, split at I.
  gemm::WeightGradArgs wg = weight_grad_args(w);
  wg.a = w.fb.dgu;
  wg.m = 2 * I;
  wg.b = w.un.xg;
  wg.n = H;
  wg.split = I;
  wg.out = data_of<bf16_t>(grads.dw_gate);
  wg.out2 = data_of<bf16_t>(grads.dw_up);
  wg.out_stride = expert_stride(grads.dw_gate);
  wg.out2_stride = expert_stride(grads.dw_up);
  gemm::expert_weight_grad(wg, s);
}

void weight_grad_down(Workspace::Impl& w, const Gradients& grads, const bf16_t* dyg, cudaStream_t s) {
  if (!wants_expert_weight_grads(grads) || omitted(Stage::kWgradDown, w.backward_calls)) return;
  // dw_down[e] = dyᵀ · (w · silu(g)⊙u)
  gemm::WeightGradArgs wg = weight_grad_args(w);
  wg.a = dyg;
  wg.m = w.shape.hidden;
  wg.b = w.un.h;
  wg.n = w.shape.intermediate;
  wg.split = 0;
  wg.out = data_of<bf16_t>(grads.dw_down);
  wg.out2 = nullptr;
  gemm::expert_weight_grad(wg, s);
}

void restage_routing(Workspace::Impl& w, const LayerInputs& in, cudaStream_t s) {
  if (w.config.caller_context) enqueue_stage_routing(w, in, s);
}

namespace {

// The experts' backward (and the shared expert's), between the two barriers at R > 1.
void backward_compute(Workspace::Impl& w, const LayerInputs& in, const TensorView& dy, const Gradients& grads,
                      cudaStream_t s) {
  const LayerShape& sh = w.shape;
  const int64_t H = sh.hidden, I = sh.intermediate;
  const int64_t cap = w.problem.capacity;
  const int32_t* total = w.device_total_rows();
  const int32_t* slots = w.schedule.row_token_slot;
  bf16_t* dyg = w.un.rows_a;  // [cap, H]  gathered dy rows (zeros on padding rows)
  bf16_t* dxe = w.un.rows_b;  // [cap, H]  per-row dx, once the dy rows are done with (the same memory)
  bf16_t* dgu = w.fb.dgu;     // [cap, 2I] dg | du per row (zeros on padding rows)

  enqueue_shared_backward(w, in, dy, grads, s);
  const bool gather = !omitted(Stage::kDyGather, w.backward_calls);
  const plan::GatherPlace place = w.plan.da_gather;
  // At R > 1 the rows are pulled from every rank's staged dy (the open step), not from `dy`.
  if (gather) queue_gather_kernel(place, w, dy, dyg, s);

  // One rank keeps no x rows from its forward (plan/context_layout.cpp): the gate/up weight gradients'
  // x rows are gathered again into xg, where the plan says (plan::XRowsAgain).
  const bool x_again =
      w.ranks() == 1 && wants_expert_weight_grads(grads) && !omitted(Stage::kXGather, w.backward_calls);
  plan::XRowsAgain x_place = x_again ? w.plan.x_rows_again : plan::XRowsAgain::kKept;
  if (x_place == plan::XRowsAgain::kBesideDgradDown &&
      ((gather && place == plan::GatherPlace::kInGemm) || omitted(Stage::kDgradDown, w.backward_calls))) {
    x_place = plan::XRowsAgain::kKernel;
  }
  if (x_place == plan::XRowsAgain::kBesideDgradGateUp && omitted(Stage::kDgradGateUp, w.backward_calls)) {
    x_place = plan::XRowsAgain::kKernel;
  }
  // The x rows beside GEMM launch `a`, in its idle gather warps.
  const auto copy_x_beside = [&](gemm::ExpertGemmArgs& a) {
    gather_rows_in(a, w, in.x);
    a.gather_dst = w.un.xg;
    a.gather_width = H;
  };

  gemm::ExpertGemmArgs g = expert_gemm_args(w, w.plan.da);

  // da = dy_row · w_down[e]   ([n, H] · [H, I], w_down read as stored: N-major)
  g.a = dyg;
  g.k = H;
  g.b0 = data_of<const bf16_t>(in.weights.w_down);
  g.n = I;
  g.out = w.un.da;
  if (!omitted(Stage::kDgradDown, w.backward_calls)) {
    gemm::ExpertGemmArgs da = g;
    if (gather && place == plan::GatherPlace::kInGemm) gather_rows_in(da, w, dy);  // dy rows into dyg, inside the GEMM
    if (x_place == plan::XRowsAgain::kBesideDgradDown) copy_x_beside(da);
    gemm::expert_gemm_n_major(da, s);
  }

  // dg | du, w · silu(g)⊙u (into h), d_topk_weights.
  if (!omitted(Stage::kSwigluBackward, w.backward_calls)) {
    // At R > 1 each row's router weight is its source rank's, and its d_topk_weights stays with the row.
    const RowSources weights = w.row_sources(comm::kWeights);
    float* d_topk = data_of<float>(grads.d_topk_weights);
    if (w.ranks() > 1) d_topk = w.in_region<float>(w.layout.d_topk_rows);
    glue::swiglu_backward(dgu, dgu + I, 2 * I, w.un.h, d_topk, w.un.da, w.un.g, w.un.u,
                          data_of<const float>(in.topk_weights), slots, total, cap, I, s, weights, w.gate_up_by_slot);
  }

  // The dy rows' last use: rows_b, which dx_row fills next, is their memory (runtime/workspace.cpp).
  weight_grad_down(w, grads, dyg, s);

  // dx_row = [dg | du] · [w_gate[e]; w_up[e]]: one GEMM over K = 2I, fp32 accumulation throughout.
  g.launch = w.plan.dx;
  g.a = dgu;
  g.k = 2 * I;
  g.b0 = data_of<const bf16_t>(in.weights.w_gate);
  g.b1 = data_of<const bf16_t>(in.weights.w_up);
  g.b0_stride = expert_stride(in.weights.w_gate);
  g.b1_stride = expert_stride(in.weights.w_up);
  g.k_split = I;
  g.n = H;
  g.out = dxe;
  if (!omitted(Stage::kDgradGateUp, w.backward_calls)) {
    gemm::ExpertGemmArgs dx = g;
    if (x_place == plan::XRowsAgain::kBesideDgradGateUp) copy_x_beside(dx);
    gemm::expert_gemm_n_major(dx, s);
  }
  if (w.ranks() == 1) dx_combine(w, grads, s);

  // The x rows by a kernel: the forward's where it has one (its padding rows are zeros wherever a tile
  // reads them), else row by row.
  if (x_place == plan::XRowsAgain::kKernel) {
    const plan::GatherPlace forward = w.plan.gate_up_gather;
    queue_gather_kernel(forward == plan::GatherPlace::kInGemm ? plan::GatherPlace::kRowKernel : forward, w, in.x,
                        w.un.xg, s);
  }
  weight_grad_gate_up(w, grads, s);
}

}  // namespace

void backward(Workspace::Impl& w, const LayerInputs& in, const TensorView& dy, const Gradients& grads,
              cudaStream_t s, Step step) {
  const bool ranks = w.ranks() > 1;
  switch (step) {
    case Step::kOpen:
      require_context(w, in);
      if (!ranks) break;
      restage_routing(w, in, s);
      LYNX_CUDA(cudaMemcpyAsync(w.in_region<void>(w.layout.token_rows), dy.data,
                                size_t(2 * w.shape.tokens * w.shape.hidden), cudaMemcpyDeviceToDevice, s));
      peer::arrive(w.barrier_args(), false, s);
      break;
    case Step::kCompute:
      compute_begins(w, s);
      backward_compute(w, in, dy, grads, s);
      compute_ends(w, s);
      break;
    case Step::kClose:
      if (!ranks) break;
      peer::wait(w.barrier_args(), true, s);
      dx_combine(w, grads, s);
      break;
  }
}

}  // namespace lynx::fused
